package e2etest

// The driver-root layouts nodes have, as their vendors ship them, one after another on the real node (a
// `helm upgrade` of driverRoot between them; the MPS supervisor, which an upgrade never restarts, is deleted
// so its new pod mounts the new root):
//
//   host      HGX-like: the driver in a host directory that is not the plugin's container path (real-node.sh's
//             root), every GPU behind NVSwitch with its NVLink fabric still training when the plugin starts
//             (fabric manager finishes 20 s later): the plugin publishes the GPUs tainted
//             gpu.tessera.dev/fabric, and the taint goes once the fabric completes, without a plugin restart
//             (at 9b52720 the plugin left such GPUs out and never looked again: 0 GPUs until restarted)
//   operator  the GPU Operator's driver container: a distribution rootfs with NVIDIA's libraries beside a
//             decoy, incompatible libc.so.6 and loader, merged-/usr links (`simulate driver-root --layout
//             operator`), and DCGM holding every GPU through NVML (`simulate hold-nvml`, as the Operator's
//             nv-hostengine and dcgm-exporter do): whole GPUs and shares run, a dynamic-MIG claim's prepare
//             fails with an event naming DCGM, and succeeds once the holder stops
//   gke       GKE's lib64/ and bin/, no usr/, no libc (`--layout gke`) at GKE's /home/kubernetes/bin/nvidia,
//             mounted under /usr/local/nvidia; the chart's stateDir on a noexec mount (Container-Optimized
//             OS mounts /var noexec), and the API server's ResourceQuota admission limiting
//             system-node-critical and system-cluster-critical to namespaces with a quota for them, as GKE
//             configures it (up.sh; the chart brings the quota, priorityQuota.create). With 9b52720's chart
//             this layout runs nothing: the API server admits no plugin or supervisor pod (the DaemonSets'
//             FailedCreate events: `pods "tessera-kubelet-plugin-…" is forbidden: insufficient quota to match
//             these scopes: [{PriorityClass In [system-node-critical system-cluster-critical]}]`), and with
//             the quota added by hand, its plugin installs the CDI hook into <stateDir>/bin, on the noexec
//             mount, so every container with a tessera device fails at createContainer (`error running
//             createContainer hook #0: fork/exec <stateDir>/bin/tessera-cdi-hook: permission denied`; a
//             manual run, e2e/README.md "Vendor layouts").
//
// In each, a whole-GPU pod and an MPS share's pod run the glibc cuda-probe image with no LD_LIBRARY_PATH, and
// their own output says: the loader found libcuda.so.1 and libnvidia-ml.so.1 in the layout's container
// directory through /etc/ld.so.cache (which names them: tessera's CDI hook built it), libcuda.so exists there
// and dlopens, CUDA and NVML see exactly the claim's device, and the share's context is a client of its MPS
// server, which the supervisor started from that root (under the Operator layout, beside the decoy libc).

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// driverLayout is one driver root on the real node and where its files appear in a container.
type driverLayout struct {
	name    string // host, operator or gke (`simulate driver-root --layout`)
	root    string // the host directory, the chart's driverRoot
	libDir  string // where the container gets the libraries
	binDir  string // and the programs
	hookDir string // where the plugin installs tessera's CDI hook on the host (the chart's cdiHookDir)
}

const (
	// Where GKE's driver installer puts the driver, and where the chart then installs tessera's hook.
	gkeDriverRoot = "/home/kubernetes/bin/nvidia"
	gkeHookDir    = "/home/kubernetes/bin/tessera"
	// How long after the plugin starts the HGX-like node's NVLink fabric finishes training.
	hgxFabricTraining = 20 * time.Second
	// The taint a GPU whose fabric is not ready carries (controller/src/health.rs).
	fabricTaint = "gpu.tessera.dev/fabric"
)

// layoutInside is what a layout pod's check container prints (the `inside` format, shorter: the 4096-byte
// termination message must hold a share's probe output too).
func layoutInside(l driverLayout) string {
	return `exec > /dev/termination-log 2>&1
for f in /dev/nvidia* /dev/nvidia-caps/*; do [ -c "$f" ] && ls -l "$f" | awk '{print "dev", $NF, $5 $6}'; done
env | grep -E '^(LD_LIBRARY_PATH|TESSERA_|CUDA_MPS_)' | sed 's/^/env /'
` + l.binDir + `/nvidia-smi -L 2>&1 | sed 's/^/smi /'
cuda-probe 2>&1 | grep -v '^nvml\.driver\|^cuda\.driver\|^probe version' | sed 's/^/probe /'
exit 0`
}

// probeCache is the probe's `ldcache` and `devlink` lines: what /etc/ld.so.cache maps names to, and the
// libcuda.so development link.
type probeCache struct {
	cache                     map[string][]string // file name → paths
	loaderPath                string
	devlink, devTarget, devOK string
}

func parseProbeCache(lines []string) probeCache {
	c := probeCache{cache: map[string][]string{}}
	for _, line := range lines {
		fact, f := probeFields(line)
		switch fact {
		case "loader":
			c.loaderPath = f["ld_library_path"]
		case "ldcache":
			if f["path"] != "" {
				c.cache[f["file"]] = append(c.cache[f["file"]], f["path"])
			}
		case "devlink":
			c.devlink, c.devTarget, c.devOK = f["path"], f["target"], f["dlopen"]
		}
	}
	return c
}

// tesseraPluginBinary is the plugin binary real-node.sh used (its `simulate` subcommands set up the node).
func tesseraPluginBinary() string {
	return filepath.Join(getenv("CARGO_TARGET_DIR", filepath.Join(e.repoRoot, "target")), "debug", "tessera-kubelet-plugin")
}

func runOrFail(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// simulateDriverRoot (re)makes a simulated driver root over the real node's simulated kernel (the same GPUs
// and hardware state) from nodeFile; the kernel's inventory is rewritten only when the node file changed.
func simulateDriverRoot(t *testing.T, rn realNodeEnv, nodeFile, root string, layout ...string) {
	t.Helper()
	args := []string{"simulate", "driver-root", "--root", root, "--kernel", rn.kernel, "--node-name", rn.name, "--node-file", nodeFile}
	if len(layout) > 0 {
		args = append(args, "--layout", layout[0])
	}
	runOrFail(t, tesseraPluginBinary(), args...)
}

// makeLayoutRoot builds a simulated driver root of the layout with the plugin binary real-node.sh used, and
// makes it a shared mount of its own, as real-node.sh does for its root (the chart mounts it with
// HostToContainer propagation).
func makeLayoutRoot(t *testing.T, rn realNodeEnv, nodeFile, layout, root string) {
	t.Helper()
	simulateDriverRoot(t, rn, nodeFile, root, layout)
	runOrFail(t, "mount", "--bind", root, root)
	runOrFail(t, "mount", "--make-rshared", root)
	t.Cleanup(func() { _ = exec.Command("umount", "-l", root).Run() })
}

// hgxNodeFile writes the real node's node file with every GPU behind NVSwitch, its fabric in progress and
// completing hgxFabricTraining after the simulated driver loaded (the mtime of the kernel's kernel.json).
func hgxNodeFile(t *testing.T, rn realNodeEnv) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(rn.dir, "sim-node.yaml"))
	if err != nil {
		t.Fatalf("the real node's node file: %v", err)
	}
	var lines []string
	groups := 0
	for _, line := range strings.Split(string(data), "\n") {
		lines = append(lines, line)
		if strings.HasPrefix(line, "    count: ") {
			groups++
			lines = append(lines, "    fabric: InProgress", fmt.Sprintf("    fabricCompletesAfterMs: %d", hgxFabricTraining.Milliseconds()))
		}
	}
	if groups == 0 {
		t.Fatalf("the real node's node file has no `    count:` line to give a fabric:\n%s", data)
	}
	path := filepath.Join(rn.dir, "sim-node-hgx.yaml")
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// fabricTainted counts the node's published devices, its whole GPUs among them, and the devices carrying
// the fabric taint (which goes on every device of its GPU: the whole GPU, MIG placements, shares).
func fabricTainted(t *testing.T, node string) (tainted, devices, whole int) {
	t.Helper()
	slices, err := e.client.ResourceV1().ResourceSlices().List(ctxFor(t, 30*time.Second), metav1.ListOptions{FieldSelector: "spec.nodeName=" + node + ",spec.driver=" + driver})
	if err != nil {
		t.Fatalf("list slices: %v", err)
	}
	for _, s := range slices.Items {
		for _, d := range s.Spec.Devices {
			devices++
			if wholeGPUName.MatchString(d.Name) {
				whole++
			}
			for _, taint := range d.Taints {
				if taint.Key == fabricTaint {
					tainted++
					break
				}
			}
		}
	}
	return tainted, devices, whole
}

// holdNVML starts a DCGM-like NVML client over root (`simulate hold-nvml`) and returns once it holds the
// GPUs; stop kills it (also at the test's end).
func holdNVML(t *testing.T, root string) (stop func()) {
	t.Helper()
	cmd := exec.Command(tesseraPluginBinary(), "simulate", "hold-nvml", "--driver-root", root)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("simulate hold-nvml: %v", err)
	}
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}
	t.Cleanup(stop)
	line, err := bufio.NewReader(out).ReadString('\n')
	if !strings.HasPrefix(line, "holding GPUs") {
		stop()
		t.Fatalf("simulate hold-nvml --driver-root %s printed %q (%v): %s", root, line, err, stderr.String())
	}
	t.Logf("a DCGM-like NVML client is %s", strings.TrimSpace(line))
	return stop
}

// noexecStateDir stacks a noexec bind mount of the chart's stateDir over it (Container-Optimized OS mounts
// /var noexec), until the test ends.
func noexecStateDir(t *testing.T, rn realNodeEnv) {
	t.Helper()
	runOrFail(t, "mount", "--bind", rn.stateDir, rn.stateDir)
	t.Cleanup(func() { _ = exec.Command("umount", "-l", rn.stateDir).Run() })
	runOrFail(t, "mount", "-o", "remount,bind,noexec", rn.stateDir)
	opts, err := exec.Command("findmnt", "-n", "-o", "OPTIONS", "--mountpoint", rn.stateDir).Output()
	if err != nil || !strings.Contains(string(opts), "noexec") {
		t.Fatalf("stateDir %s is not mounted noexec: %q %v", rn.stateDir, opts, err)
	}
}

// criticalPodRefused asserts that the API server refuses a system-node-critical pod in ns, which has no
// quota for the class: the admission GKE configures is on, so the chart's quota is what admits its pods.
func criticalPodRefused(t *testing.T, ns, node string) {
	t.Helper()
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "node-critical", Namespace: ns},
		Spec: v1.PodSpec{
			NodeSelector:      map[string]string{"kubernetes.io/hostname": node},
			PriorityClassName: "system-node-critical",
			Containers:        []v1.Container{{Name: "c", Image: probeImage, ImagePullPolicy: v1.PullNever, Command: []string{"true"}}},
		},
	}
	_, err := e.client.CoreV1().Pods(ns).Create(ctxFor(t, 30*time.Second), p, metav1.CreateOptions{})
	if err == nil || !strings.Contains(err.Error(), "insufficient quota to match these scopes") {
		t.Fatalf("a system-node-critical pod in %s (no quota for the class): %v; want it refused by ResourceQuota admission as GKE configures it (up.sh)", ns, err)
	}
}

// switchDriverRoot upgrades the release to driverRoot=root and waits for the plugin and the MPS supervisor
// to run over it: the plugin pod is replaced by the upgrade, the supervisor (updateStrategy OnDelete) by
// deleting its pod.
func switchDriverRoot(t *testing.T, rn realNodeEnv, root string) {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	old := func(component string) string {
		pods, err := podsOf(ctx, component)
		if err != nil || len(pods) == 0 {
			t.Fatalf("%s pods before the upgrade: %v (%d)", component, err, len(pods))
		}
		return pods[0].Name
	}
	plugin, supervisor := old("kubelet-plugin"), old("mps-supervisor")
	helmRun(t, append([]string{"upgrade", "tessera", chartDir(), "--namespace", chartNamespace},
		helmSetArgs(rn.chartValues("driverRoot="+root))...)...)
	waitPluginPodReplaced(t, "the plugin pod over "+root, plugin, 3*time.Minute)
	if err := e.client.CoreV1().Pods(chartNamespace).Delete(ctx, supervisor, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete the MPS supervisor pod %s: %v", supervisor, err)
	}
	waitFor(t, "a new MPS supervisor pod over "+root, 3*time.Minute, func(ctx context.Context) (bool, string) {
		pods, err := podsOf(ctx, "mps-supervisor")
		if err != nil {
			return false, err.Error()
		}
		n, states := readyPods(pods)
		return n == 1 && len(pods) == 1 && pods[0].Name != supervisor, strings.Join(states, "; ")
	})
	for _, component := range []string{"kubelet-plugin", "mps-supervisor"} {
		pods, _ := podsOf(ctx, component)
		for _, p := range pods {
			if got := hostPathOf(p, "driver-root"); got != root {
				t.Fatalf("%s pod %s mounts the driver root from %q, want %s", component, p.Name, got, root)
			}
		}
	}
	waitFor(t, "NodeInventory "+rn.name+" ready over "+root, time.Minute, func(ctx context.Context) (bool, string) {
		hb, ready := heartbeat(t, rn.name)
		return ready, "lastHeartbeatTime " + hb
	})
}

// hostPathOf is the host path of the pod's volume `name`.
func hostPathOf(p v1.Pod, name string) string {
	for _, v := range p.Spec.Volumes {
		if v.Name == name && v.HostPath != nil {
			return v.HostPath.Path
		}
	}
	return ""
}

func TestRealNodeLayoutsGiveCUDAWorkloadsTheDriverThroughTheirOwnLoaderCache(t *testing.T) {
	rn := realNode(t)
	roots := filepath.Join(rn.dir, "driver-roots")
	hostHook := filepath.Join(rn.stateDir, "bin")
	layouts := []driverLayout{
		{name: "host", root: rn.driverRoot, libDir: "/usr/lib/x86_64-linux-gnu", binDir: "/usr/bin", hookDir: hostHook},
		{name: "operator", root: filepath.Join(roots, "operator"), libDir: "/usr/lib/x86_64-linux-gnu", binDir: "/usr/bin", hookDir: hostHook},
		{name: "gke", root: gkeDriverRoot, libDir: "/usr/local/nvidia/lib64", binDir: "/usr/local/nvidia/bin", hookDir: gkeHookDir},
	}
	// GKE's paths are absolute (the chart's GKE defaults key on them); they are this test's alone.
	if _, err := os.Stat("/home/kubernetes"); err == nil {
		t.Fatalf("/home/kubernetes exists on this machine; the GKE-like layout is made there (a killed run of this test leaves it, which `make down` removes)")
	}
	t.Cleanup(func() { _ = os.RemoveAll("/home/kubernetes") })
	// The mark real-node.sh's `down` looks for to clean up after a run that was killed.
	if err := os.MkdirAll("/home/kubernetes", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile("/home/kubernetes/.tessera-e2e", []byte(e.runDir+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Every GPU's fabric trains until hgxFabricTraining after the plugin starts (below); until then the
	// kernel's load time is in the future, which the simulated driver reads as training not yet finished.
	hgx := hgxNodeFile(t, rn)
	simulateDriverRoot(t, rn, hgx, rn.driverRoot)
	t.Cleanup(func() { simulateDriverRoot(t, rn, filepath.Join(rn.dir, "sim-node.yaml"), rn.driverRoot) })
	kernelFile := filepath.Join(rn.kernel, "kernel.json")
	if err := os.Chtimes(kernelFile, time.Now(), time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	for _, l := range layouts[1:] {
		makeLayoutRoot(t, rn, hgx, l.name, l.root)
	}
	// The decoys the Operator layout must survive: its own libc.so.6 and loader beside NVIDIA's libraries.
	for _, decoy := range []string{"usr/lib/x86_64-linux-gnu/libc.so.6", "usr/lib64/ld-linux-x86-64.so.2"} {
		if _, err := os.Stat(filepath.Join(layouts[1].root, decoy)); err != nil {
			t.Fatalf("the Operator layout lacks its decoy %s: %v", decoy, err)
		}
	}
	// The fabric taint goes after the quiet period once the fabric completes (60 s by default).
	withQuietPeriod(t, testQuietPeriod)
	installChart(t, rn)

	// HGX-like: fabric manager finishes hgxFabricTraining after the plugin container started.
	var plugin v1.Pod
	waitFor(t, "the plugin container running on "+rn.name, 3*time.Minute, func(ctx context.Context) (bool, string) {
		pods, err := podsOf(ctx, "kubelet-plugin")
		if err != nil || len(pods) != 1 {
			return false, fmt.Sprintf("%d pods (%v)", len(pods), err)
		}
		plugin = pods[0]
		for _, c := range plugin.Status.ContainerStatuses {
			if c.State.Running != nil {
				return true, ""
			}
		}
		return false, string(plugin.Status.Phase)
	})
	var started time.Time
	for _, c := range plugin.Status.ContainerStatuses {
		if c.State.Running != nil {
			started = c.State.Running.StartedAt.Time
		}
	}
	if err := os.Chtimes(kernelFile, time.Now(), started); err != nil {
		t.Fatal(err)
	}
	fabricDone := started.Add(hgxFabricTraining)
	// GPU 1 is shared under the e2e policy (no whole device); every other GPU publishes its whole device.
	waitFor(t, "every device of "+rn.name+" published with the "+fabricTaint+" taint while its fabric trains", hgxFabricTraining, func(ctx context.Context) (bool, string) {
		tainted, devices, whole := fabricTainted(t, rn.name)
		if time.Now().After(fabricDone) {
			t.Fatalf("the fabric completed before every device was published tainted (%d of %d, %d whole GPUs): the plugin did not report the training fabric", tainted, devices, whole)
		}
		return whole == rn.gpus-1 && tainted == devices, fmt.Sprintf("%d of %d devices tainted, %d of %d whole GPUs published", tainted, devices, whole, rn.gpus-1)
	})
	t.Logf("HGX-like: every device published with the %s taint %s after the plugin started", fabricTaint, time.Since(started).Round(time.Second))
	waitFor(t, "the "+fabricTaint+" taint gone once the fabric completed", hgxFabricTraining+20*time.Second, func(ctx context.Context) (bool, string) {
		tainted, devices, whole := fabricTainted(t, rn.name)
		return whole == rn.gpus-1 && tainted == 0, fmt.Sprintf("%d of %d devices tainted", tainted, devices)
	})
	t.Logf("HGX-like: the fabric taint gone %s after the fabric completed", time.Since(fabricDone).Round(time.Second))
	pods, err := podsOf(ctxFor(t, 30*time.Second), "kubelet-plugin")
	if err != nil || len(pods) != 1 || pods[0].UID != plugin.UID || pods[0].Status.ContainerStatuses[0].RestartCount != 0 {
		t.Fatalf("the plugin pod was replaced or restarted while the fabric trained (want %s, restarts 0): %v %+v", plugin.Name, err, pods)
	}

	waitFor(t, "plugin pod Ready on "+rn.name, 3*time.Minute, func(ctx context.Context) (bool, string) {
		pods, err := podsOf(ctx, "kubelet-plugin")
		if err != nil {
			return false, err.Error()
		}
		n, states := readyPods(pods)
		return n == 1 && len(pods) == 1, strings.Join(states, "; ")
	})
	waitFor(t, "the MPS supervisor Ready on "+rn.name, 3*time.Minute, func(ctx context.Context) (bool, string) {
		pods, err := podsOf(ctx, "mps-supervisor")
		if err != nil {
			return false, err.Error()
		}
		n, states := readyPods(pods)
		return n == 1, strings.Join(states, "; ")
	})

	for i, l := range layouts {
		ok := t.Run(l.name, func(t *testing.T) {
			ns := namespace(t, "layout-"+l.name)
			var stopHolder func()
			switch l.name {
			case "gke":
				// The admission is GKE's: without the chart's quota no node pod would be admitted.
				criticalPodRefused(t, ns, rn.name)
				noexecStateDir(t, rn)
			}
			if i > 0 {
				start := time.Now()
				switchDriverRoot(t, rn, l.root)
				t.Logf("driverRoot %s: plugin and MPS supervisor serving after %s", l.root, time.Since(start).Round(time.Second))
			}
			if l.name == "operator" {
				stopHolder = holdNVML(t, l.root)
			}
			claimTemplate(t, ns, "whole", gpuClass(t))
			claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "10Gi", "compute": "25"}))
			for _, name := range []string{"whole", "share"} {
				w := workloadPod(ns, name, rn.name).withClaimFrom(name)
				w.pod.Spec.InitContainers[0].Command = []string{"sh", "-c", layoutInside(l)}
				w.create(t)
			}
			if stopHolder != nil {
				// Dynamic MIG turns MIG mode on, which the driver refuses while DCGM holds the GPU.
				claimTemplate(t, ns, "mig", mig1gClass(t))
				workloadPod(ns, "mig", rn.name).withClaimFrom("mig").create(t)
			}
			for _, name := range []string{"whole", "share"} {
				p := waitRunning(t, ns, name, 3*time.Minute)
				claim, devices := realAllocations(t, p)
				v := insideView(t, p)
				t.Logf("%s layout, %s (%v): the container printed:\n  %s", l.name, name, deviceNames(devices),
					strings.ReplaceAll(strings.TrimSpace(v.raw), "\n", "\n  "))
				checkLayoutInside(t, rn, l, p, v, devices)
				checkLayoutSpecs(t, rn, l, name, rn.cdiSpecsFor(t, claim.UID))
			}
			if stopHolder != nil {
				msg := waitPrepareFailure(t, ns, "mig")
				t.Logf("operator layout, mig: kubelet's FailedPrepareDynamicResources event: %s", msg)
				if !strings.Contains(msg, "in use") || !strings.Contains(msg, "DCGM") {
					t.Errorf("the MIG claim's prepare failed with %q; want the GPU in use, naming DCGM", msg)
				}
				// Once DCGM stops, MIG prepares again. The failed pod would run on kubelet's next try, which its
				// back-off puts about 90 s away (measured); a new pod's claim is prepared at once.
				stopHolder()
				deletePod(t, ns, "mig")
				start := time.Now()
				workloadPod(ns, "mig-after", rn.name).withClaimFrom("mig").create(t)
				waitRunning(t, ns, "mig-after", 2*time.Minute)
				t.Logf("operator layout, mig: a new MIG pod running %s after the DCGM-like client stopped", time.Since(start).Round(time.Second))
			}
		})
		if !ok {
			return
		}
	}
}

// checkLayoutInside asserts the container's own view in a layout: the driver through the loader's cache,
// the development link, and exactly the claim's device (a share's through its MPS server).
func checkLayoutInside(t *testing.T, rn realNodeEnv, l driverLayout, p *v1.Pod, v seen, devices []resourcev1.DeviceRequestAllocationResult) {
	t.Helper()
	fail := func(format string, args ...any) {
		t.Errorf("%s layout, pod %s: "+format+"\n--- the container printed:\n%s", append([]any{l.name, p.Name}, append(args, v.raw)...)...)
	}
	c := parseProbeCache(v.probeLines)
	if c.loaderPath != "unset" {
		fail("LD_LIBRARY_PATH=%q in the container, want it unset: the loader must find the driver by itself", c.loaderPath)
	}
	pv := v.probe
	for _, soname := range []string{"libcuda.so.1", "libnvidia-ml.so.1"} {
		want := l.libDir + "/" + soname
		switch lib, ok := pv.libs[soname]; {
		case !ok || lib.err != "":
			fail("dlopen(%q) failed: %s", soname, lib.err)
		case lib.path != want:
			fail("the loader resolved %s to %s, want %s", soname, lib.path, want)
		case !lib.mounted:
			fail("%s (%s) is not a mount: not the driver's file", soname, lib.path)
		}
		if !contains(c.cache[soname], want) {
			fail("/etc/ld.so.cache maps %s to %v, want %s among them (the hook's update-ldcache)", soname, c.cache[soname], want)
		}
	}
	if devLink := l.libDir + "/libcuda.so"; c.devlink != devLink || c.devTarget != "libcuda.so.1" || c.devOK != "ok" {
		fail("libcuda.so: %s -> %s, dlopen %s; want %s -> libcuda.so.1 that dlopens (the hook's create-symlinks)", c.devlink, c.devTarget, c.devOK, devLink)
	}
	if !contains(c.cache["libcuda.so"], l.libDir+"/libcuda.so") {
		fail("/etc/ld.so.cache has no libcuda.so entry (%v): `ldconfig -p | grep libcuda.so` finds nothing", c.cache["libcuda.so"])
	}
	if len(devices) != 1 {
		fail("%d devices allocated, want 1", len(devices))
		return
	}
	uuid := attr(sliceDevice(t, p.Spec.NodeName, devices[0].Device), "uuid").StringValue
	if uuid == nil {
		t.Fatalf("device %s has no uuid attribute", devices[0].Device)
	}
	if pv.cudaInit != 0 {
		fail("cuInit returned %d, want 0", pv.cudaInit)
		return
	}
	if got := pv.cudaUUIDs(); !equal(got, []string{*uuid}) {
		fail("CUDA devices %v, want exactly the claim's %s", got, *uuid)
	}
	if got := pv.nvmlUUIDs(); !equal(got, []string{*uuid}) {
		fail("NVML GPUs %v, want exactly the claim's %s", got, *uuid)
	}
	if !strings.Contains(v.smi, *uuid) || strings.Count(v.smi, "GPU ") != 1 {
		fail("%s/nvidia-smi -L lists %q, want the claim's GPU %s alone", l.binDir, v.smi, *uuid)
	}
	if len(pv.ctx) != 1 || pv.ctx[0].rc != 0 {
		fail("contexts %+v, want one created", pv.ctx)
		return
	}
	// libcuda dlopens its PTX JIT by soname, so the loader's cache must name it too (the spec mounts it, the
	// hook's update-ldcache lists it).
	if len(pv.modules) != 1 || pv.modules[0].rc != 0 {
		fail("PTX modules %+v, want one loaded: libnvidia-ptxjitcompiler.so.1 is not reachable through the %s layout's mounts and cache", pv.modules, l.name)
	}
	shared := sharedName.MatchString(devices[0].Device)
	switch {
	case shared && !strings.HasPrefix(pv.ctx[0].mps, "yes server="):
		fail("the share's context is not a client of its MPS server (mps=%s): the daemon did not start from the %s root", pv.ctx[0].mps, l.name)
	case shared && !rn.mpsServes(devices[0].Device):
		fail("no MPS control daemon serves %s", devices[0].Device)
	case !shared && pv.ctx[0].mps != "no":
		fail("the whole GPU's context says mps=%s, want no", pv.ctx[0].mps)
	}
}

// checkLayoutSpecs asserts the claim's CDI specs: the driver's mounts and hook calls once, in the spec's own
// edits (none per device), every mount from the layout's host root (never the decoy libc), and tessera's
// hook, which the plugin installed on the host.
func checkLayoutSpecs(t *testing.T, rn realNodeEnv, l driverLayout, name string, files []string) {
	t.Helper()
	if len(files) == 0 {
		t.Errorf("%s layout, %s: no CDI spec", l.name, name)
	}
	hook := filepath.Join(l.hookDir, "tessera-cdi-hook")
	for _, f := range files {
		spec, err := rn.readSpec(f)
		if err != nil {
			t.Errorf("%s: %v", f, err)
			continue
		}
		for _, d := range spec.Devices {
			for _, m := range d.ContainerEdits.Mounts {
				if strings.Contains(m.ContainerPath, "libcuda") || strings.Contains(m.ContainerPath, "nvidia-smi") {
					t.Errorf("%s layout, %s: a device of %s mounts the driver's %s itself; the driver goes once per spec", l.name, name, f, m.ContainerPath)
				}
			}
			if len(d.ContainerEdits.Hooks) > 0 {
				t.Errorf("%s layout, %s: a device of %s carries hooks %+v", l.name, name, f, d.ContainerEdits.Hooks)
			}
		}
		libcuda := false
		for _, m := range spec.ContainerEdits.Mounts {
			if strings.HasSuffix(m.ContainerPath, "/libc.so.6") || strings.Contains(m.ContainerPath, "ld-linux") {
				t.Errorf("%s layout, %s: %s hands the container the driver root's %s", l.name, name, f, m.HostPath)
			}
			if m.ContainerPath == l.libDir+"/libcuda.so.1" {
				libcuda = true
				if !strings.HasPrefix(m.HostPath, l.root+"/") {
					t.Errorf("%s layout, %s: libcuda.so.1 from %s, want a file under %s", l.name, name, m.HostPath, l.root)
				}
			}
		}
		if !libcuda {
			t.Errorf("%s layout, %s: %s mounts no %s/libcuda.so.1: %+v", l.name, name, f, l.libDir, spec.ContainerEdits.Mounts)
		}
		var calls []string
		for _, h := range spec.ContainerEdits.Hooks {
			if h.HookName != "createContainer" || h.Path != hook || len(h.Args) < 2 {
				t.Errorf("%s layout, %s: hook %+v, want createContainer calls of %s", l.name, name, h, hook)
				continue
			}
			calls = append(calls, h.Args[1])
		}
		if want := []string{"create-symlinks", "enable-cuda-compat", "update-ldcache"}; !equal(calls, want) {
			t.Errorf("%s layout, %s: hook calls %v, want %v in that order", l.name, name, calls, want)
		}
	}
	if info, err := os.Stat(hook); err != nil || info.Mode()&0o111 == 0 {
		t.Errorf("the plugin did not install its CDI hook at %s on the host: %v", hook, err)
	}
}
