package e2etest

// The three driver-root layouts nodes have, one after another on the real node (a `helm upgrade` of
// driverRoot between them; the MPS supervisor, which an upgrade never restarts, is deleted so its new pod
// mounts the new root):
//
//   host      the driver in a host directory that is not the plugin's container path (real-node.sh's root)
//   operator  the GPU Operator's driver container: a distribution rootfs with NVIDIA's libraries beside a
//             decoy, incompatible libc.so.6 and loader, merged-/usr links (`simulate driver-root --layout operator`)
//   gke       GKE's lib64/ and bin/, no usr/, no libc (`--layout gke`), mounted under /usr/local/nvidia
//
// In each, a whole-GPU pod and an MPS share's pod run the glibc cuda-probe image with no LD_LIBRARY_PATH, and
// their own output says: the loader found libcuda.so.1 and libnvidia-ml.so.1 in the layout's container
// directory through /etc/ld.so.cache (which names them: tessera's CDI hook built it), libcuda.so exists there
// and dlopens, CUDA and NVML see exactly the claim's device, and the share's context is a client of its MPS
// server, which the supervisor started from that root (under the Operator layout, beside the decoy libc).

import (
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
	name   string // host, operator or gke (`simulate driver-root --layout`)
	root   string // the host directory, the chart's driverRoot
	libDir string // where the container gets the libraries
	binDir string // and the programs
}

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

// makeLayoutRoot builds a simulated driver root of the layout over the real node's simulated kernel (the
// same GPUs and hardware state) with the plugin binary real-node.sh used, and makes it a shared mount of its
// own, as real-node.sh does for its root (the chart mounts it with HostToContainer propagation).
func makeLayoutRoot(t *testing.T, rn realNodeEnv, layout, root string) {
	t.Helper()
	plugin := filepath.Join(getenv("CARGO_TARGET_DIR", filepath.Join(e.repoRoot, "target")), "debug", "tessera-kubelet-plugin")
	run := func(name string, args ...string) {
		t.Helper()
		if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
	}
	run(plugin, "simulate", "driver-root", "--layout", layout, "--root", root, "--kernel", rn.kernel,
		"--node-name", rn.name, "--node-file", filepath.Join(rn.dir, "sim-node.yaml"))
	run("mount", "--bind", root, root)
	run("mount", "--make-rshared", root)
	t.Cleanup(func() { _ = exec.Command("umount", "-l", root).Run() })
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
	layouts := []driverLayout{
		{name: "host", root: rn.driverRoot, libDir: "/usr/lib/x86_64-linux-gnu", binDir: "/usr/bin"},
		{name: "operator", root: filepath.Join(roots, "operator"), libDir: "/usr/lib/x86_64-linux-gnu", binDir: "/usr/bin"},
		{name: "gke", root: filepath.Join(roots, "gke"), libDir: "/usr/local/nvidia/lib64", binDir: "/usr/local/nvidia/bin"},
	}
	for _, l := range layouts[1:] {
		makeLayoutRoot(t, rn, l.name, l.root)
	}
	// The decoys the Operator layout must survive: its own libc.so.6 and loader beside NVIDIA's libraries.
	for _, decoy := range []string{"usr/lib/x86_64-linux-gnu/libc.so.6", "usr/lib64/ld-linux-x86-64.so.2"} {
		if _, err := os.Stat(filepath.Join(layouts[1].root, decoy)); err != nil {
			t.Fatalf("the Operator layout lacks its decoy %s: %v", decoy, err)
		}
	}
	installChart(t, rn)
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
	waitFor(t, "ResourceSlices for "+rn.name, 2*time.Minute, func(ctx context.Context) (bool, string) {
		n := countDevices(t, rn.name, wholeGPUName)
		return n > 0, fmt.Sprintf("%d whole GPUs published", n)
	})

	for i, l := range layouts {
		ok := t.Run(l.name, func(t *testing.T) {
			if i > 0 {
				start := time.Now()
				switchDriverRoot(t, rn, l.root)
				t.Logf("driverRoot %s: plugin and MPS supervisor serving after %s", l.root, time.Since(start).Round(time.Second))
			}
			ns := namespace(t, "layout-"+l.name)
			claimTemplate(t, ns, "whole", gpuClass(t))
			claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "10Gi", "compute": "25"}))
			for _, name := range []string{"whole", "share"} {
				w := workloadPod(ns, name, rn.name).withClaimFrom(name)
				w.pod.Spec.InitContainers[0].Command = []string{"sh", "-c", layoutInside(l)}
				w.create(t)
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
	hook := filepath.Join(rn.stateDir, "bin", "tessera-cdi-hook")
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
