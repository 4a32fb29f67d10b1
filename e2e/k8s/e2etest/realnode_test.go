package e2etest

// Scenarios on the real node (e2e/scripts/real-node.sh): the upstream kubelet, containerd 2.x with CDI, runc
// and the CNI bridge. tessera is installed there with its Helm chart (the nvml backend, over the simulated
// driver root real-node.sh built from this repository; the image imported into containerd), and workload
// pods run real containers of the glibc cuda-probe image whose own output says what they got: the device
// nodes and driver files, and what a CUDA program loading the driver by soname sees (e2e/images/cuda-probe.c).

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
)

const (
	// The workload image real-node.sh imports (e2e/images/node_images.py): glibc, the CUDA probe at
	// /usr/local/bin/cuda-probe and a static busybox.
	probeImage = "tessera.dev/e2e/cuda-probe:1"
	// NVIDIA's character device major for /dev/nvidia<minor> and /dev/nvidiactl (minor 255), fixed by the
	// kernel driver (NVIDIA's driver README, "Device files"; nvidia-container-toolkit's nvcdi uses it too).
	nvidiaMajor = 195
)

// realNodeEnv is where the real node keeps what the chart's host paths point at.
type realNodeEnv struct {
	name     string
	dir      string // $RUN_DIR/real-node
	stateDir string // the chart's stateDir: checkpoint, MPS pipe dirs
	cdiDir   string
	// driverRoot is the simulated NVIDIA driver root (`tessera-kubelet-plugin simulate driver-root`), the
	// chart's driverRoot; kernel is its simulated kernel (driverRoot/tessera-sim links to it): the hardware
	// inventory (kernel.json), the hardware state (simulated-gpus.json) and what the driver shows in /proc.
	driverRoot string
	kernel     string
	gpus       int
}

// realNodePaths is where real-node.sh and the chart's values put the real node's directories (the name and
// paths only: realNode also reads its simulated kernel).
func realNodePaths() realNodeEnv {
	dir := filepath.Join(e.runDir, "real-node")
	return realNodeEnv{name: getenv("REAL_NODE_NAME", "real-node"), dir: dir, stateDir: filepath.Join(dir, "tessera"),
		cdiDir: filepath.Join(dir, "cdi"), driverRoot: filepath.Join(dir, "driver-root")}
}

func realNode(t *testing.T) realNodeEnv {
	t.Helper()
	if os.Getenv("REAL_NODE") != "1" {
		t.Fatal("these scenarios need the real node: run them through `make e2e` (REAL_NODE=1, its default) or `make up REAL_NODE=1`")
	}
	rn := realNodePaths()
	kernel, err := filepath.EvalSymlinks(filepath.Join(rn.driverRoot, "tessera-sim"))
	if err != nil {
		t.Fatalf("the real node's simulated driver root (real-node.sh up makes it): %v", err)
	}
	rn.kernel = kernel
	data, err := os.ReadFile(filepath.Join(kernel, "kernel.json"))
	if err != nil {
		t.Fatalf("the simulated kernel's inventory: %v", err)
	}
	var k struct {
		Node struct {
			GPUs []struct {
				Count int `json:"count"`
			} `json:"gpus"`
		} `json:"node"`
	}
	if err := json.Unmarshal(data, &k); err != nil {
		t.Fatalf("parse %s/kernel.json: %v", kernel, err)
	}
	for _, g := range k.Node.GPUs {
		rn.gpus += g.Count
	}
	return rn
}

// chartValues are the --set values for the real node: the nvml backend over the node's driver root, the
// image real-node.sh imported (never pulled), the kubelet's own root dir, and the cluster's existing
// DeviceClasses and GpuPolicy kept.
func (rn realNodeEnv) chartValues(extra ...string) []string {
	return append([]string{
		"backend=nvml",
		"driverRoot=" + rn.driverRoot,
		"image.pullPolicy=Never",
		"kubeletDir=" + filepath.Join(rn.dir, "kubelet"),
		"cdiDir=" + rn.cdiDir,
		"stateDir=" + rn.stateDir,
		"deviceClasses.create=false",
		"gpuPolicy.create=false",
		// The stand-ins run no containers: the controller's replicas must land on the real node.
		`controller.nodeSelector.kubernetes\.io/hostname=` + rn.name,
		"controller.tolerations[0].key=nvidia.com/gpu",
		"controller.tolerations[0].operator=Exists",
		"controller.tolerations[0].effect=NoSchedule",
		// The admission webhook's replicas too: the API server calls them at the pod IPs (up.sh's
		// --enable-aggregator-routing; no kube-proxy runs).
		`webhook.nodeSelector.kubernetes\.io/hostname=` + rn.name,
		"webhook.tolerations[0].key=nvidia.com/gpu",
		"webhook.tolerations[0].operator=Exists",
		"webhook.tolerations[0].effect=NoSchedule",
	}, extra...)
}

func helmRun(t *testing.T, args ...string) string {
	t.Helper()
	args = append(args, "--kubeconfig", filepath.Join(e.runDir, "pki", "admin.kubeconfig"))
	var out bytes.Buffer
	cmd := exec.Command(helmBinary(t), args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out.String())
	}
	return out.String()
}

func helmSetArgs(values []string) []string {
	var args []string
	for _, v := range values {
		args = append(args, "--set", v)
	}
	return args
}

// installChart installs the chart on the real node for the test and uninstalls it afterwards. The host
// controller `make up` runs is stopped meanwhile: the chart's controllers take the same Lease.
func installChart(t *testing.T, rn realNodeEnv, values ...string) {
	t.Helper()
	proc(t, "stop", "controller")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.Command(helmBinary(t), "uninstall", "tessera", "--namespace", chartNamespace, "--wait", "--timeout", "90s",
			"--kubeconfig", filepath.Join(e.runDir, "pki", "admin.kubeconfig"))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("helm uninstall: %v\n%s", err, out)
		}
		// Without its plugin the node must not offer devices to the scenarios that follow.
		_ = e.dyn.Resource(inventoryGVR).Delete(ctx, rn.name, metav1.DeleteOptions{})
		_ = e.client.CoordinationV1().Leases(chartNamespace).Delete(ctx, "tessera-node-"+rn.name, metav1.DeleteOptions{})
		_ = e.client.ResourceV1().ResourceSlices().DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{FieldSelector: "spec.nodeName=" + rn.name})
		proc(t, "start", "controller")
		waitStandInsPublished(t)
	})
	helmInstall(t, rn, values...)
	waitChartWebhookServing(t)
}

// helmInstall runs `helm install` of the chart with the real node's values (and extra ones).
func helmInstall(t *testing.T, rn realNodeEnv, values ...string) {
	t.Helper()
	helmRun(t, append([]string{"install", "tessera", chartDir(), "--namespace", chartNamespace}, helmSetArgs(rn.chartValues(values...))...)...)
}

// waitStandInsPublished waits until the host controller `make up` runs has republished every stand-in node:
// the chart's uninstall hook deletes every slice of the driver, and the scenarios that follow need theirs.
func waitStandInsPublished(t *testing.T) {
	t.Helper()
	waitFor(t, "the host controller republishes the stand-in nodes", 2*time.Minute, func(ctx context.Context) (bool, string) {
		for _, node := range e.nodes {
			if n, err := driverSlices(ctx, node); err != nil || n == 0 {
				return false, fmt.Sprintf("%s: %d slices (err %v)", node, n, err)
			}
		}
		return true, ""
	})
}

func waitFor(t *testing.T, what string, timeout time.Duration, cond func(ctx context.Context) (bool, string)) {
	t.Helper()
	ctx := ctxFor(t, timeout+10*time.Second)
	var last string
	err := wait.PollUntilContextTimeout(ctx, time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		ok, why := cond(ctx)
		last = why
		return ok, nil
	})
	if err != nil {
		t.Fatalf("%s: not within %s (last: %s)", what, timeout, last)
	}
}

func podsOf(ctx context.Context, component string) ([]v1.Pod, error) {
	list, err := e.client.CoreV1().Pods(chartNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=" + component})
	if err != nil {
		return nil, err
	}
	return list.Items, nil
}

func readyPods(pods []v1.Pod) (ready int, states []string) {
	for _, p := range pods {
		ok := p.DeletionTimestamp == nil && p.Status.Phase == v1.PodRunning
		for _, c := range p.Status.Conditions {
			if c.Type == v1.PodReady && c.Status != v1.ConditionTrue {
				ok = false
			}
		}
		if ok {
			ready++
		}
		states = append(states, fmt.Sprintf("%s on %q: %s", p.Name, p.Spec.NodeName, p.Status.Phase))
	}
	return ready, states
}

// --- workload pods ------------------------------------------------------------------------------

// inside is what a workload's check container prints about itself: `dev <path> <major>,<minor>` per
// device node, `file <path>` per driver file found, `env K=V`, `smi <line>` of nvidia-smi -L, `pipe <entry>`
// of the MPS pipe directory, `probe <line>` per line of the CUDA probe. It writes that to its termination
// message, which the API server returns (4096 bytes at most: insideView fails a message that fills it).
const inside = `exec > /dev/termination-log 2>&1
for f in /dev/nvidia* /dev/nvidia-caps/*; do [ -c "$f" ] && ls -l "$f" | awk '{print "dev", $NF, $5 $6}'; done
for f in /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 /usr/bin/nvidia-smi; do
  [ -f "$f" ] && echo "file $f"
done
env | grep -E '^(NVIDIA_VISIBLE_DEVICES|TESSERA_|CUDA_MPS_)' | sed 's/^/env /'
nvidia-smi -L 2>&1 | sed 's/^/smi /'
if [ -n "$CUDA_MPS_PIPE_DIRECTORY" ]; then ls "$CUDA_MPS_PIPE_DIRECTORY" | sed 's/^/pipe /'; fi
cuda-probe 2>&1 | sed 's/^/probe /'
exit 0`

// terminationMessageLimit is the kubelet's limit on a container's termination message.
const terminationMessageLimit = 4096

// workload is a pod on the real node whose init container prints what it sees (inside) and whose main
// container keeps the claim in use until the pod is deleted.
type workload struct{ pod *v1.Pod }

func workloadPod(ns, name, node string) *workload {
	ctr := func(name string, cmd string) v1.Container {
		return v1.Container{
			Name: name, Image: probeImage, ImagePullPolicy: v1.PullNever, Command: []string{"sh", "-c", cmd},
			Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
		}
	}
	return &workload{pod: &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			NodeSelector:                  map[string]string{"kubernetes.io/hostname": node},
			Tolerations:                   []v1.Toleration{{Key: "nvidia.com/gpu", Operator: v1.TolerationOpExists, Effect: v1.TaintEffectNoSchedule}},
			InitContainers:                []v1.Container{ctr("inside", inside)},
			Containers:                    []v1.Container{ctr("hold", "exec sleep 3600")},
			TerminationGracePeriodSeconds: ptr.To[int64](1),
		},
	}}
}

func (w *workload) withClaimFrom(template string) *workload {
	w.pod.Spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To(template)}}
	return w
}

// asking makes it a device-plugin-era pod: no claim, `nvidia.com/gpu: <gpus>` in both containers' limits
// (kube-scheduler serves it from the DeviceClass with that extendedResourceName; the check container, an
// init container, reuses the holding container's request).
func (w *workload) asking(gpus int64) *workload {
	q := *resource.NewQuantity(gpus, resource.DecimalSI)
	for _, c := range []*v1.Container{&w.pod.Spec.InitContainers[0], &w.pod.Spec.Containers[0]} {
		c.Resources = v1.ResourceRequirements{Limits: v1.ResourceList{legacyResource: q}}
	}
	return w
}

// reporting makes the holding container print, every second, the device nodes and MPS pipe entries it
// still sees and the CUDA probe's context lines (a share's names its MPS server), so a check after a plugin
// roll reads what the running container sees then.
func (w *workload) reporting() *workload {
	w.pod.Spec.Containers[0].Command = []string{"sh", "-c",
		`while true; do echo "sees $(ls /dev/nvidia* /dev/nvidia-caps/* /tmp/nvidia-mps 2>/dev/null | tr '\n' ' ')` +
			`$(cuda-probe 2>&1 | grep -E '^cuda\.(count|ctx)' | tr '\n' ' ')"; sleep 1; done`}
	return w
}

func (w *workload) create(t *testing.T) *v1.Pod {
	t.Helper()
	p, err := e.client.CoreV1().Pods(w.pod.Namespace).Create(ctxFor(t, 30*time.Second), w.pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", w.pod.Namespace, w.pod.Name, err)
	}
	return p
}

// seen parses the check container's termination message.
type seen struct {
	devices map[string]string // path → "major,minor"
	files   map[string]bool
	env     map[string]string
	smi     string
	pipe    []string
	probe   probeView
	// probeLines are the probe's own lines, for the log.
	probeLines []string
	raw        string
}

func insideView(t *testing.T, p *v1.Pod) seen {
	t.Helper()
	var msg string
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name == "inside" && s.State.Terminated != nil {
			msg = s.State.Terminated.Message
		}
	}
	if msg == "" {
		t.Fatalf("pod %s: the check container left no termination message (statuses %+v)", p.Name, p.Status.InitContainerStatuses)
	}
	if len(msg) >= terminationMessageLimit {
		t.Fatalf("pod %s: the check container's termination message is %d bytes, the kubelet's limit: it may be cut off\n%s", p.Name, len(msg), msg)
	}
	v := seen{devices: map[string]string{}, files: map[string]bool{}, env: map[string]string{}, raw: msg}
	var probe []string
	for _, line := range strings.Split(msg, "\n") {
		kind, rest, _ := strings.Cut(line, " ")
		switch kind {
		case "dev":
			if path, mm, ok := strings.Cut(rest, " "); ok {
				v.devices[path] = mm
			}
		case "file":
			v.files[rest] = true
		case "env":
			if k, val, ok := strings.Cut(rest, "="); ok {
				v.env[k] = val
			}
		case "smi":
			v.smi += rest + "\n"
		case "pipe":
			v.pipe = append(v.pipe, rest)
		case "probe":
			probe = append(probe, rest)
		}
	}
	v.probe, v.probeLines = parseProbe(probe), probe
	return v
}

// realAllocations returns the pod's claim (from its template, or the one kube-scheduler made for its
// extended resources) and the tessera devices allocated to it.
func realAllocations(t *testing.T, p *v1.Pod) (*resourcev1.ResourceClaim, []resourcev1.DeviceRequestAllocationResult) {
	t.Helper()
	var name string
	switch {
	case len(p.Status.ResourceClaimStatuses) > 0 && p.Status.ResourceClaimStatuses[0].ResourceClaimName != nil:
		name = *p.Status.ResourceClaimStatuses[0].ResourceClaimName
	case p.Status.ExtendedResourceClaimStatus != nil:
		name = p.Status.ExtendedResourceClaimStatus.ResourceClaimName
	default:
		t.Fatalf("pod %s has no generated claim", p.Name)
	}
	c, err := e.client.ResourceV1().ResourceClaims(p.Namespace).Get(ctxFor(t, 30*time.Second), name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("claim of %s: %v", p.Name, err)
	}
	if c.Status.Allocation == nil {
		t.Fatalf("claim %s of running pod %s is not allocated", c.Name, p.Name)
	}
	var out []resourcev1.DeviceRequestAllocationResult
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver == driver {
			out = append(out, r)
		}
	}
	return c, out
}

var migDevice = regexp.MustCompile(`-mig-`)

// checkInside asserts, from the container's own output, what every allocated device must give it.
func (rn realNodeEnv) checkInside(t *testing.T, p *v1.Pod, v seen, devices []resourcev1.DeviceRequestAllocationResult) {
	t.Helper()
	rn.checkInsideAs(t, p, v, devices, false)
}

// checkInsideAs is checkInside for a claim whose config may make its exclusive devices MPS clients.
func (rn realNodeEnv) checkInsideAs(t *testing.T, p *v1.Pod, v seen, devices []resourcev1.DeviceRequestAllocationResult, mpsClient bool) {
	t.Helper()
	fail := func(format string, args ...any) {
		t.Errorf("pod %s: "+format+"\n--- the container printed:\n%s", append([]any{p.Name}, append(args, v.raw)...)...)
	}
	if v.env["NVIDIA_VISIBLE_DEVICES"] != "void" {
		fail("NVIDIA_VISIBLE_DEVICES=%q, want void", v.env["NVIDIA_VISIBLE_DEVICES"])
	}
	if got := v.devices["/dev/nvidiactl"]; got != fmt.Sprintf("%d,255", nvidiaMajor) {
		fail("/dev/nvidiactl is %q, want %d,255", got, nvidiaMajor)
	}
	if _, ok := v.devices["/dev/nvidia-uvm"]; !ok {
		fail("no /dev/nvidia-uvm")
	}
	for _, f := range []string{"/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1", "/usr/bin/nvidia-smi"} {
		if !v.files[f] {
			fail("driver file %s is not mounted", f)
		}
	}
	for _, r := range devices {
		d := sliceDevice(t, p.Spec.NodeName, r.Device)
		minor := attr(d, "minor").IntValue
		if minor == nil {
			t.Fatalf("device %s has no minor attribute", r.Device)
		}
		node := fmt.Sprintf("/dev/nvidia%d", *minor)
		if got := v.devices[node]; got != fmt.Sprintf("%d,%d", nvidiaMajor, *minor) {
			fail("%s (device %s) is %q, want %d,%d", node, r.Device, got, nvidiaMajor, *minor)
		}
		uuid := attr(d, "uuid").StringValue
		got := v.env[uuidEnvKey(r.Device)]
		if migDevice.MatchString(r.Device) {
			// A dynamic MIG device's slice names its parent GPU; the instance and its MIG- UUID exist only
			// once prepare created them (the simulated kernel's hardware state says which).
			if want := rn.migUUID(t, r.Device); got != want {
				fail("%s=%q, want the created instance's UUID %s", uuidEnvKey(r.Device), got, want)
			}
			if !hasPrefix(keys(v.devices), "/dev/nvidia-caps/nvidia-cap") {
				fail("MIG device %s: no /dev/nvidia-caps/nvidia-cap* node", r.Device)
			}
			continue
		}
		if uuid == nil || got != *uuid {
			fail("%s=%q, want the slice's uuid %v", uuidEnvKey(r.Device), got, ptr.Deref(uuid, "<none>"))
		}
		if uuid != nil && !strings.Contains(v.smi, *uuid) {
			fail("nvidia-smi -L does not list %s (%s)", r.Device, *uuid)
		}
	}
	if len(v.smi) == 0 || !strings.Contains(v.smi, "GPU 0:") {
		fail("nvidia-smi -L printed nothing usable")
	}
	checkProbe(t, p, v, expectFor(t, p, v, devices, rn.migUUID, mpsClient))
}

func deviceNames(devices []resourcev1.DeviceRequestAllocationResult) []string {
	var out []string
	for _, d := range devices {
		out = append(out, d.Device)
	}
	return out
}

// keys are the map's keys, sorted.
func keys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// --- node-side state ----------------------------------------------------------------------------

// lastReport is the newest "sees ..." line the pod's holding container wrote, as `kubectl logs
// --timestamps` shows it.
func (rn realNodeEnv) lastReport(t *testing.T, p *v1.Pod) (string, time.Time) {
	t.Helper()
	// A container that has just started may not have written its first report yet: wait for it.
	var data string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		var err error
		data, err = podLogs(ctxFor(t, 10*time.Second), p, "hold", false)
		if err != nil && time.Now().After(deadline) {
			t.Fatalf("the holding container's log: %v", err)
		}
		lines := strings.Split(strings.TrimSpace(data), "\n")
		for i := len(lines) - 1; i >= 0; i-- {
			if ts, text, ok := logLine(lines[i]); ok && strings.HasPrefix(text, "sees ") {
				return text, ts
			}
		}
		if time.Now().After(deadline) {
			break
		}
	}
	t.Fatalf("pod %s/%s: the holding container logged no report line in 30 s:\n%s", p.Namespace, p.Name, data)
	return "", time.Time{}
}

// mpsDaemonPID is the pid file of the MPS control daemon of a shared GPU (in the supervisor's PID
// namespace): the same value before and after means the same daemon.
func (rn realNodeEnv) mpsDaemonPID(t *testing.T, device string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(rn.mpsDaemonDir(device), "pipe", "nvidia-cuda-mps-control.pid"))
	if err != nil {
		t.Fatalf("MPS daemon of %s: %v", device, err)
	}
	return strings.TrimSpace(string(data))
}

func (rn realNodeEnv) cdiSpecsFor(t *testing.T, uid types.UID) []string {
	t.Helper()
	entries, err := os.ReadDir(rn.cdiDir)
	if err != nil {
		t.Fatalf("read %s: %v", rn.cdiDir, err)
	}
	var out []string
	for _, en := range entries {
		if data, err := os.ReadFile(filepath.Join(rn.cdiDir, en.Name())); err == nil && strings.Contains(string(data), string(uid)) {
			out = append(out, en.Name())
		}
	}
	return out
}

// cdiEdits is what the e2e reads of a CDI spec's container edits.
type cdiEdits struct {
	Mounts []struct {
		HostPath      string `json:"hostPath"`
		ContainerPath string `json:"containerPath"`
	} `json:"mounts"`
	Hooks []struct {
		HookName string   `json:"hookName"`
		Path     string   `json:"path"`
		Args     []string `json:"args"`
	} `json:"hooks"`
}

// cdiSpecFile is a CDI spec's edits, the spec's own and each device's.
type cdiSpecFile struct {
	ContainerEdits cdiEdits `json:"containerEdits"`
	Devices        []struct {
		ContainerEdits cdiEdits `json:"containerEdits"`
	} `json:"devices"`
}

// readSpec parses the CDI spec file f of the real node's CDI directory.
func (rn realNodeEnv) readSpec(f string) (cdiSpecFile, error) {
	var spec cdiSpecFile
	data, err := os.ReadFile(filepath.Join(rn.cdiDir, f))
	if err != nil {
		return spec, err
	}
	if err := json.Unmarshal(data, &spec); err != nil {
		return spec, fmt.Errorf("parse %s: %w", f, err)
	}
	return spec, nil
}

// checkSpecsNameHostPaths checks that every mount of the claim's CDI specs names a path of the host, where
// the runtime reads it: the plugin pod reads the driver root at /driver-root (--container-driver-root), and
// the specs must say rn.driverRoot, with the libraries under it.
func (rn realNodeEnv) checkSpecsNameHostPaths(t *testing.T, name string, files []string) {
	t.Helper()
	for _, f := range files {
		spec, err := rn.readSpec(f)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		all := spec.ContainerEdits.Mounts
		for _, d := range spec.Devices {
			all = append(all, d.ContainerEdits.Mounts...)
		}
		libcuda := false
		for _, m := range all {
			if strings.HasPrefix(m.HostPath, "/driver-root/") {
				t.Errorf("%s: %s mounts %s from the plugin pod's path %s, not the host's", name, f, m.ContainerPath, m.HostPath)
			} else if _, err := os.Stat(m.HostPath); err != nil {
				t.Errorf("%s: %s mounts %s from %s, which the host lacks: %v", name, f, m.ContainerPath, m.HostPath, err)
			}
			if strings.HasSuffix(m.ContainerPath, "/libcuda.so.1") {
				libcuda = true
				if !strings.HasPrefix(m.HostPath, rn.driverRoot+"/") {
					t.Errorf("%s: %s mounts libcuda.so.1 from %s, want a file under the host's driver root %s", name, f, m.HostPath, rn.driverRoot)
				}
			}
		}
		if !libcuda {
			t.Errorf("%s: %s mounts no libcuda.so.1: %+v", name, f, all)
		}
	}
}

// mpsServes dials the simulated MPS control daemon's socket for a shared GPU (gpu-1-shared → gpu-1):
// the same socket the clients' CUDA_MPS_PIPE_DIRECTORY holds.
func (rn realNodeEnv) mpsServes(device string) bool {
	return controlAnswers(filepath.Join(rn.mpsDaemonDir(device), "pipe"))
}

// mpsDaemonDir is the directory of the MPS control daemon of a shared device's shares: the namespace's own
// (`<key>@<namespace>`, tessera's default tenancy) where there is one, else the device's one daemon
// (`<key>`, tenancy Shared). The scenarios share a device within one namespace, so at most one matches.
func (rn realNodeEnv) mpsDaemonDir(device string) string {
	key := strings.TrimSuffix(device, "-shared")
	if dirs, _ := filepath.Glob(filepath.Join(rn.stateDir, "mps", key+"@*")); len(dirs) > 0 {
		sort.Strings(dirs)
		return dirs[0]
	}
	return filepath.Join(rn.stateDir, "mps", key)
}

// controlAnswers dials the MPS control socket of a pipe directory.
func controlAnswers(pipe string) bool {
	conn, err := net.DialTimeout("unix", filepath.Join(pipe, "control"), 2*time.Second)
	if err != nil {
		return false
	}
	conn.Close()
	return true
}

// migInstance is the GPU instance at a MIG device's placement in the simulated kernel's hardware state
// (what NVML reports on the node).
func (rn realNodeEnv) migInstance(t *testing.T, device string) (simGPUInstance, bool) {
	t.Helper()
	m := migDeviceName.FindStringSubmatch(device)
	if m == nil {
		t.Fatalf("%s is not a MIG device name", device)
	}
	var gpu, start int
	fmt.Sscan(m[1], &gpu)
	fmt.Sscan(m[3], &start)
	return simulatedGPUInstanceIn(t, filepath.Join(rn.kernel, "simulated-gpus.json"), gpu, start)
}

func (rn realNodeEnv) migInstanceAt(t *testing.T, device string) bool {
	t.Helper()
	_, ok := rn.migInstance(t, device)
	return ok
}

// migUUID is the MIG- UUID of the compute instance prepare created for a MIG device.
func (rn realNodeEnv) migUUID(t *testing.T, device string) string {
	t.Helper()
	gi, ok := rn.migInstance(t, device)
	if !ok || len(gi.ComputeInstances) != 1 {
		t.Fatalf("%s: no GPU instance with one compute instance in %s/simulated-gpus.json (%+v)", device, rn.kernel, gi)
	}
	return gi.ComputeInstances[0].UUID
}

// --- tokens -------------------------------------------------------------------------------------

// podBoundClient is a client with the token kubelet would mount into the pod: a TokenRequest for the pod's
// ServiceAccount bound to the pod (and through it to its node: authentication.kubernetes.io/node-name).
func podBoundClient(t *testing.T, p v1.Pod) (kubernetes.Interface, dynamic.Interface) {
	t.Helper()
	tr := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
		ExpirationSeconds: ptr.To[int64](600),
		BoundObjectRef:    &authenticationv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: p.Name, UID: p.UID},
	}}
	tok, err := e.client.CoreV1().ServiceAccounts(p.Namespace).CreateToken(ctxFor(t, 30*time.Second), p.Spec.ServiceAccountName, tr, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("TokenRequest for %s bound to pod %s: %v", p.Spec.ServiceAccountName, p.Name, err)
	}
	cfg := rest.AnonymousClientConfig(e.cfg)
	cfg.BearerToken = tok.Status.Token
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	d, err := dynamic.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c, d
}

func expectForbidden(t *testing.T, what string, err error, mention string) {
	t.Helper()
	switch {
	case err == nil:
		t.Errorf("%s was allowed; it must be denied", what)
	case !apierrors.IsForbidden(err) && !apierrors.IsInvalid(err):
		t.Errorf("%s: want Forbidden, got %v", what, err)
	case mention != "" && !strings.Contains(err.Error(), mention):
		t.Errorf("%s: denied, but the reason %q does not mention %q", what, err.Error(), mention)
	default:
		t.Logf("%s: denied: %v", what, err)
	}
}

// --- the scenario -------------------------------------------------------------------------------

func TestRealNodeRunsTheChartAndItsWorkloadsSeeTheirDevicesFromInside(t *testing.T) {
	rn := realNode(t)
	start := time.Now()
	installChart(t, rn)

	ok := t.Run("the plugin registers with the real kubelet and the leader of two controllers publishes the node", func(t *testing.T) {
		waitFor(t, "plugin pod Ready on "+rn.name, 3*time.Minute, func(ctx context.Context) (bool, string) {
			pods, err := podsOf(ctx, "kubelet-plugin")
			if err != nil {
				return false, err.Error()
			}
			n, states := readyPods(pods)
			return n == 1 && len(pods) == 1 && pods[0].Spec.NodeName == rn.name, strings.Join(states, "; ")
		})
		waitFor(t, "NodeInventory "+rn.name+" ready", time.Minute, func(ctx context.Context) (bool, string) {
			hb, ready := heartbeat(t, rn.name)
			return ready, "lastHeartbeatTime " + hb
		})
		var controllers []v1.Pod
		waitFor(t, "two controller replicas Running on "+rn.name, 2*time.Minute, func(ctx context.Context) (bool, string) {
			pods, err := podsOf(ctx, "controller")
			if err != nil {
				return false, err.Error()
			}
			controllers = pods
			n, states := readyPods(pods)
			return n == 2 && len(pods) == 2, strings.Join(states, "; ")
		})
		waitFor(t, "one controller holds the Lease", time.Minute, func(ctx context.Context) (bool, string) {
			l, err := e.client.CoordinationV1().Leases(chartNamespace).Get(ctx, "tessera-controller", metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			holder := ptr.Deref(l.Spec.HolderIdentity, "")
			return holder == controllers[0].Name || holder == controllers[1].Name, "holder " + holder
		})
		waitFor(t, "ResourceSlices for "+rn.name, 2*time.Minute, func(ctx context.Context) (bool, string) {
			n := countDevices(t, rn.name, wholeGPUName)
			return n == rn.gpus-1, fmt.Sprintf("%d of %d whole GPUs published (GPU 1 is shared under the e2e policy)", n, rn.gpus-1)
		})
	})
	if !ok {
		return
	}

	t.Run("the plugin pod renews its node's Lease in the release namespace and, under the chart's leader, leaves the NodeInventory unwritten", func(t *testing.T) {
		var l *coordinationv1.Lease
		waitFor(t, "kubectl get lease -n "+chartNamespace+" tessera-node-"+rn.name, time.Minute, func(context.Context) (bool, string) {
			got, err := nodeLease(t, chartNamespace, rn.name)
			if err != nil {
				return false, err.Error()
			}
			l = got
			return true, ""
		})
		checkNodeLease(t, l, rn.name)
		waitLeaseRenewed(t, chartNamespace, rn.name, renewTime(l))
		waitLeaderReadsNodeLeases(t, chartNamespace)
		checkInventoryLeftAloneWhileTheLeaseRenews(t, chartNamespace, rn.name)
	})
	t.Logf("chart installed, plugin registered, slices published in %s", time.Since(start).Round(time.Second))

	t.Run("the chart's admission webhook, serving a certificate it made itself, refuses each bad config at create with prepare's message", func(t *testing.T) {
		checkChartWebhookCertificate(t)
		chartWebhookRefusesBadConfigs(t, namespace(t, "real-node-webhook"))
	})

	ns := namespace(t, "real-node")
	claimTemplate(t, ns, "whole", gpuClass(t))
	claimTemplate(t, ns, "mig", mig3gClass(t))
	claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "10Gi", "compute": "25"}))
	claimTemplate(t, ns, "two", gpuClass(t), count(2))
	type running struct {
		pod     *v1.Pod
		claim   *resourcev1.ResourceClaim
		devices []resourcev1.DeviceRequestAllocationResult
	}
	pods := map[string]*running{}

	ok = t.Run("whole, MIG, share, two-GPU and legacy containers see exactly their devices through the driver, the driver files and the MPS pipe", func(t *testing.T) {
		for _, name := range []string{"whole", "mig", "share", "two"} {
			workloadPod(ns, name, rn.name).withClaimFrom(name).create(t)
		}
		workloadPod(ns, "legacy", rn.name).asking(1).create(t)
		for _, name := range []string{"whole", "mig", "share", "two", "legacy"} {
			p := waitRunning(t, ns, name, 3*time.Minute)
			claim, devices := realAllocations(t, p)
			pods[name] = &running{pod: p, claim: claim, devices: devices}
			v := insideView(t, p)
			t.Logf("%s (%v): cuda-probe printed:\n  %s\nand nvidia-smi -L:\n  %s", name, deviceNames(devices), strings.Join(v.probeLines, "\n  "),
				strings.ReplaceAll(strings.TrimSpace(v.smi), "\n", "\n  "))
			rn.checkInside(t, p, v, devices)
			switch name {
			case "two":
				if len(devices) != 2 {
					t.Errorf("two: %d devices allocated, want 2", len(devices))
				}
			case "legacy":
				if len(devices) != 1 || !wholeGPUName.MatchString(devices[0].Device) {
					t.Errorf("legacy: allocated %v, want one whole GPU", devices)
				}
			case "mig":
				if !mig3gName.MatchString(devices[0].Device) {
					t.Errorf("mig: got %s, want a 3g MIG device", devices[0].Device)
				}
			case "share":
				if v.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "25" {
					t.Errorf("share: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%q, want 25\n%s", v.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], v.raw)
				}
				if got := mpsLimitBytes(v.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]); got != 10<<30 {
					t.Errorf("share: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%q, want 10GiB\n%s", v.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], v.raw)
				}
				if v.env["CUDA_MPS_PIPE_DIRECTORY"] == "" || !contains(v.pipe, "control") {
					t.Errorf("share: pipe directory %q lists %v, want the daemon's control socket\n%s", v.env["CUDA_MPS_PIPE_DIRECTORY"], v.pipe, v.raw)
				}
				if !rn.mpsServes(devices[0].Device) {
					t.Errorf("share: no MPS control daemon serves %s", devices[0].Device)
				}
			}
			if files := rn.cdiSpecsFor(t, claim.UID); len(files) == 0 {
				t.Errorf("%s: no CDI spec for claim %s in %s", name, claim.UID, rn.cdiDir)
			} else {
				rn.checkSpecsNameHostPaths(t, name, files)
			}
		}
	})
	if !ok {
		return
	}

	t.Run("kubectl exec runs nvidia-smi in the whole-GPU pod, listing its GPU, and kubectl port-forward reaches a server in it", func(t *testing.T) {
		w := pods["whole"]
		uuid := attr(sliceDevice(t, rn.name, w.devices[0].Device), "uuid").StringValue
		if uuid == nil {
			t.Fatalf("device %s has no uuid attribute", w.devices[0].Device)
		}
		checkKubectlReachesThePod(t, w.pod, "hold", *uuid)
	})

	t.Run("deleting the pods unprepares: no CDI spec, MIG instance or MPS daemon is left", func(t *testing.T) {
		for name := range pods {
			deletePod(t, ns, name)
		}
		for name, r := range pods {
			waitGone(t, ns, name, 2*time.Minute)
			waitFor(t, name+"'s CDI spec removed", time.Minute, func(ctx context.Context) (bool, string) {
				files := rn.cdiSpecsFor(t, r.claim.UID)
				return len(files) == 0, fmt.Sprintf("left: %v", files)
			})
			for _, d := range r.devices {
				switch {
				case migDeviceName.MatchString(d.Device) && !strings.HasSuffix(d.Device, "-shared"):
					if rn.migInstanceAt(t, d.Device) {
						t.Errorf("%s: the MIG instance of %s is still there", name, d.Device)
					}
				case strings.HasSuffix(d.Device, "-shared"):
					waitFor(t, "the MPS daemon of "+d.Device+" stopped", time.Minute, func(ctx context.Context) (bool, string) {
						return !rn.mpsServes(d.Device), "its control socket still answers"
					})
				}
			}
		}
	})

	t.Run("a Job with a whole-GPU claim runs to completion and kubectl logs job/... shows its GPU", func(t *testing.T) {
		checkGPUJobRuns(t, ns, "whole", rn.name)
	})

	// Its own subtest, once the pods above are gone: with them, the node's five MIG-capable GPUs are all
	// taken (four whole, one for the 3g MIG), and a MIG device on another GPU would leave a pod pending.
	t.Run("a MIG claim whose MigConfig asks for MPS runs on its own MPS server over the MIG device, with the config's limits", func(t *testing.T) {
		const (
			percentage = 50
			pinned     = 4 << 30
		)
		claimTemplate(t, ns, "mig-mps", mig1gClass(t), selector(fmt.Sprintf(`device.attributes[%q].profile == "1g.10gb"`, driver)),
			opaqueConfig(fmt.Sprintf(`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"MigConfig","sharing":{"strategy":"MPS",`+
				`"mps":{"defaultActiveThreadPercentage":%d,"defaultPinnedDeviceMemoryLimit":"4Gi"}}}`, percentage)))
		workloadPod(ns, "mig-mps", rn.name).withClaimFrom("mig-mps").create(t)
		p := waitRunning(t, ns, "mig-mps", 3*time.Minute)
		claim, devices := realAllocations(t, p)
		v := insideView(t, p)
		t.Logf("mig-mps (%v): cuda-probe printed:\n  %s\nand nvidia-smi -L:\n  %s", deviceNames(devices), strings.Join(v.probeLines, "\n  "),
			strings.ReplaceAll(strings.TrimSpace(v.smi), "\n", "\n  "))
		if len(devices) != 1 || !migDeviceName.MatchString(devices[0].Device) || !strings.Contains(devices[0].Device, "-mig-1g-10gb-") {
			t.Fatalf("mig-mps: allocated %v, want one exclusive 1g.10gb MIG device", deviceNames(devices))
		}
		device := devices[0].Device
		// The whole view, with every context an MPS client limited by the env the plugin set.
		rn.checkInsideAs(t, p, v, devices, true)
		fail := func(format string, args ...any) {
			t.Errorf("mig-mps (%s): "+format+"\n--- the container printed:\n%s", append([]any{device}, append(args, v.raw)...)...)
		}
		// The env is the config's, not left to the probe's check to compare with itself.
		if got := v.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]; got != fmt.Sprint(percentage) {
			fail("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%q, want the MigConfig's %d", got, percentage)
		}
		if got := mpsLimitBytes(v.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]); got != pinned {
			fail("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%q, want the MigConfig's 4Gi", v.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])
		}
		if v.env["CUDA_MPS_PIPE_DIRECTORY"] == "" || !contains(v.pipe, "control") {
			fail("pipe directory %q lists %v, want the daemon's control socket", v.env["CUDA_MPS_PIPE_DIRECTORY"], v.pipe)
		}
		// Exactly the MIG device, by its own MIG- UUID, and its one context through the MPS server with the
		// config's memory and half the MIG device's SMs.
		mig := rn.migUUID(t, device)
		pv := v.probe
		if len(pv.cuda) != 1 || pv.cuda[0].uuid != mig || len(pv.ctx) != 1 {
			fail("CUDA devices %v with %d contexts, want exactly the MIG device %s and one context", pv.cudaUUIDs(), len(pv.ctx), mig)
		} else {
			c, d := pv.ctx[0], pv.cuda[0]
			if c.rc != 0 || !strings.HasPrefix(c.mps, "yes server=") || c.mps == "yes server=" {
				fail("cuCtxCreate rc=%d mps=%q, want CUDA_SUCCESS through an MPS server", c.rc, c.mps)
			}
			if c.memTotal != pinned {
				fail("the MPS context has %d bytes, want the MigConfig's pinned 4Gi (%d) of the device's %d", c.memTotal, uint64(pinned), d.mem)
			}
			if want := (d.sms*percentage + 99) / 100; c.sms != want || d.sms < 2 {
				fail("the MPS context may use %d of the MIG device's %d SMs, want %d (%d %%)", c.sms, d.sms, want, percentage)
			}
		}
		// On the node: the MIG instance, and an MPS daemon of its own (keyed by the MIG device) that the
		// client reached with the MIG device's UUID, not its parent's.
		if !rn.migInstanceAt(t, device) {
			t.Errorf("mig-mps: no MIG instance for %s in the simulated kernel", device)
		}
		if !rn.mpsServes(device) {
			t.Errorf("mig-mps: no MPS control daemon serves %s (%s)", device, filepath.Join(rn.mpsDaemonDir(device), "pipe", "control"))
		}
		if log, err := os.ReadFile(filepath.Join(rn.mpsDaemonDir(device), "log", "control.log")); err != nil {
			t.Errorf("mig-mps: the MPS daemon's log: %v", err)
		} else if !strings.Contains(string(log), "NEW CLIENT") || !strings.Contains(string(log), "device="+mig) {
			t.Errorf("mig-mps: the MPS daemon of %s logged no client on the MIG device %s:\n%s", device, mig, log)
		}
		files := rn.cdiSpecsFor(t, claim.UID)
		if len(files) == 0 {
			t.Errorf("mig-mps: no CDI spec for claim %s in %s", claim.UID, rn.cdiDir)
		} else {
			rn.checkSpecsNameHostPaths(t, "mig-mps", files)
		}

		deletePod(t, ns, "mig-mps")
		waitGone(t, ns, "mig-mps", 2*time.Minute)
		waitFor(t, "mig-mps's CDI spec removed", time.Minute, func(ctx context.Context) (bool, string) {
			files := rn.cdiSpecsFor(t, claim.UID)
			return len(files) == 0, fmt.Sprintf("left: %v", files)
		})
		waitFor(t, "the MPS daemon of "+device+" stopped", time.Minute, func(ctx context.Context) (bool, string) {
			return !rn.mpsServes(device), "its control socket still answers"
		})
		waitFor(t, "the MIG instance of "+device+" destroyed", time.Minute, func(ctx context.Context) (bool, string) {
			return !rn.migInstanceAt(t, device), "still in the simulated kernel's state"
		})
	})

	t.Run("a Job's container reads its claims' device metadata where upstream's readers look, and it names what nvidia-smi shows", func(t *testing.T) {
		checkJobReadsItsDeviceMetadata(t, ns, "whole", rn.name)
	})

	// make up's examples, as it runs them: every pod on the real node, read through kubectl logs.
	t.Run("the examples' pods run in containers on the real node and kubectl logs shows each one's devices", func(t *testing.T) {
		checkExamplesRunOn(t, rn.name)
	})

	t.Run("with pod-bound tokens the plugin cannot write another node's inventory or any slice, nor the controller read Secrets", func(t *testing.T) {
		ctx := ctxFor(t, time.Minute)
		plugins, err := podsOf(ctx, "kubelet-plugin")
		if err != nil || len(plugins) != 1 {
			t.Fatalf("plugin pods: %v (%d)", err, len(plugins))
		}
		pc, pd := podBoundClient(t, plugins[0])
		// The token works: its own node's inventory is readable.
		if _, err := pd.Resource(inventoryGVR).Get(ctx, rn.name, metav1.GetOptions{}); err != nil {
			t.Fatalf("the plugin's token cannot read its own NodeInventory: %v", err)
		}
		other := e.nodes[0]
		patch := []byte(`{"metadata":{"labels":{"e2e.tessera.dev/forged":"true"}}}`)
		_, err = pd.Resource(inventoryGVR).Patch(ctx, other, types.MergePatchType, patch, metav1.PatchOptions{})
		expectForbidden(t, "the plugin on "+rn.name+" patching NodeInventory "+other, err, "its own node")
		_, err = pd.Resource(inventoryGVR).Patch(ctx, other, types.MergePatchType, []byte(`{"status":{"ready":false}}`), metav1.PatchOptions{}, "status")
		expectForbidden(t, "the plugin on "+rn.name+" patching NodeInventory "+other+"/status", err, "its own node")
		slice := &resourcev1.ResourceSlice{
			ObjectMeta: metav1.ObjectMeta{Name: "forged-" + rn.name},
			Spec: resourcev1.ResourceSliceSpec{Driver: driver, NodeName: ptr.To(rn.name),
				Pool: resourcev1.ResourcePool{Name: rn.name, ResourceSliceCount: 1}},
		}
		_, err = pc.ResourceV1().ResourceSlices().Create(ctx, slice, metav1.CreateOptions{})
		expectForbidden(t, "the plugin creating a ResourceSlice for its own node", err, "")
		existing, lerr := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + rn.name})
		if lerr != nil || len(existing.Items) == 0 {
			t.Fatalf("slices of %s: %v", rn.name, lerr)
		}
		err = pc.ResourceV1().ResourceSlices().Delete(ctx, existing.Items[0].Name, metav1.DeleteOptions{})
		expectForbidden(t, "the plugin deleting its node's ResourceSlice", err, "")

		// Leases: the plugin's Role lets it write any Lease in the release namespace; the admission policy
		// keeps it to tessera-node-<its node>, so it can neither forge another node's heartbeat nor take the
		// controller's leader Lease. Reading the leader Lease is what it needs get for.
		leases := pc.CoordinationV1().Leases(chartNamespace)
		if _, err := leases.Get(ctx, leaderLeaseName, metav1.GetOptions{}); err != nil {
			t.Errorf("the plugin's token cannot read the leader Lease %s: %v", leaderLeaseName, err)
		}
		apply := metav1.PatchOptions{FieldManager: "tessera-kubelet-plugin", Force: ptr.To(true)}
		forged := func(name string) []byte {
			return fmt.Appendf(nil, `{"apiVersion":"coordination.k8s.io/v1","kind":"Lease","metadata":{"name":%q,"namespace":%q},`+
				`"spec":{"holderIdentity":%q,"renewTime":%q}}`, name, chartNamespace, rn.name, time.Now().UTC().Format("2006-01-02T15:04:05.000000Z07:00"))
		}
		const rule = "tessera-node-lease-own-node"
		_, err = leases.Patch(ctx, "tessera-node-forged-node", types.ApplyPatchType, forged("tessera-node-forged-node"), apply)
		expectForbidden(t, "the plugin on "+rn.name+" creating the Lease of a node it does not run on", err, rule)
		_, err = leases.Patch(ctx, "tessera-node-"+other, types.ApplyPatchType, forged("tessera-node-"+other), apply)
		expectForbidden(t, "the plugin on "+rn.name+" renewing the Lease of node "+other, err, rule)
		_, err = leases.Patch(ctx, leaderLeaseName, types.MergePatchType, []byte(fmt.Sprintf(`{"spec":{"holderIdentity":%q}}`, rn.name)), metav1.PatchOptions{})
		expectForbidden(t, "the plugin on "+rn.name+" taking the controller's leader Lease", err, rule)
		if _, err := e.client.CoordinationV1().Leases(chartNamespace).Get(ctx, "tessera-node-forged-node", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("Lease tessera-node-forged-node: %v, want NotFound (the denied create left nothing)", err)
		}

		controllers, err := podsOf(ctx, "controller")
		if err != nil || len(controllers) == 0 {
			t.Fatalf("controller pods: %v", err)
		}
		cc, _ := podBoundClient(t, controllers[0])
		if _, err := cc.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
			t.Fatalf("the controller's token cannot list ResourceSlices: %v", err)
		}
		_, err = cc.CoreV1().Secrets(chartNamespace).List(ctx, metav1.ListOptions{})
		expectForbidden(t, "the controller listing Secrets in "+chartNamespace, err, "secrets")
		_, err = cc.CoreV1().Secrets("kube-system").Get(ctx, "anything", metav1.GetOptions{})
		expectForbidden(t, "the controller reading a Secret in kube-system", err, "secrets")
	})
	t.Run("a helm upgrade rolls the plugin while a share and a MIG pod run; both keep their devices and MPS daemon, and a new claim prepares", func(t *testing.T) {
		ctx := ctxFor(t, 5*time.Minute)
		share := workloadPod(ns, "share-roll", rn.name).withClaimFrom("share").reporting().create(t)
		mig := workloadPod(ns, "mig-roll", rn.name).withClaimFrom("mig").reporting().create(t)
		share, mig = waitRunning(t, ns, share.Name, 3*time.Minute), waitRunning(t, ns, mig.Name, 3*time.Minute)
		shareClaim, shareDevices := realAllocations(t, share)
		migClaim, migDevices := realAllocations(t, mig)
		daemon := rn.mpsDaemonPID(t, shareDevices[0].Device)
		before, err := podsOf(ctx, "kubelet-plugin")
		if err != nil || len(before) != 1 {
			t.Fatalf("plugin pods before the roll: %v (%d)", err, len(before))
		}
		seenBefore := map[string]string{}
		for _, p := range []*v1.Pod{share, mig} {
			seenBefore[p.Name], _ = rn.lastReport(t, p)
		}
		// The probe in each: one device, a context, and the share's through its MPS server.
		for p, want := range map[*v1.Pod]string{share: "cuda.ctx index=0 rc=0 mps=yes server=", mig: "cuda.ctx index=0 rc=0 mps=no"} {
			if r := seenBefore[p.Name]; !strings.Contains(r, "cuda.count rc=0 count=1 ") || !strings.Contains(r, want) {
				t.Errorf("pod %s reports %q, want one CUDA device and %q", p.Name, r, want)
			}
		}

		// A changed pod template (the plugin's log level) is what any upgrade of the plugin rolls on; the
		// webhook's rolls too, and it must keep its certificate and the API server's trust in it.
		webhooks, err := podsOf(ctx, "webhook")
		if err != nil || len(webhooks) == 0 {
			t.Fatalf("webhook pods before the roll: %v (%d)", err, len(webhooks))
		}
		certBefore := checkChartWebhookCertificate(t)
		rolled := time.Now()
		helmRun(t, append([]string{"upgrade", "tessera", chartDir(), "--namespace", chartNamespace, "--wait", "--timeout", "180s"},
			helmSetArgs(rn.chartValues("kubeletPlugin.logLevel=debug", "webhook.logLevel=debug"))...)...)
		waitPluginPodReplaced(t, "the plugin DaemonSet rolled to a new, Ready pod", before[0].Name, 3*time.Minute)
		waitFreshHeartbeat(t, rn.name, rolled, time.Minute)

		for _, p := range []*v1.Pod{share, mig} {
			now, err := e.client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
			if err != nil {
				t.Fatalf("pod %s after the roll: %v", p.Name, err)
			}
			if now.Status.Phase != v1.PodRunning || now.Status.ContainerStatuses[0].RestartCount != 0 {
				t.Errorf("pod %s after the roll: phase %s, restarts %d; want Running, 0", p.Name, now.Status.Phase, now.Status.ContainerStatuses[0].RestartCount)
			}
			// A report written after the roll, by the same container, seeing the same devices.
			waitFor(t, p.Name+" reports after the roll", 30*time.Second, func(context.Context) (bool, string) {
				_, ts := rn.lastReport(t, p)
				return ts.After(time.Now().Add(-2 * time.Second)), "last report " + ts.String()
			})
			if got, _ := rn.lastReport(t, p); got != seenBefore[p.Name] {
				t.Errorf("pod %s sees other devices after the roll:\nbefore: %s\nafter:  %s", p.Name, seenBefore[p.Name], got)
			}
		}
		if got := rn.mpsDaemonPID(t, shareDevices[0].Device); got != daemon || !rn.mpsServes(shareDevices[0].Device) {
			t.Errorf("MPS daemon of %s: pid %s before the roll, %s after (serving: %v); want the same daemon serving",
				shareDevices[0].Device, daemon, got, rn.mpsServes(shareDevices[0].Device))
		}
		if !rn.migInstanceAt(t, migDevices[0].Device) {
			t.Errorf("the MIG instance of %s is gone after the roll", migDevices[0].Device)
		}
		for _, c := range []*resourcev1.ResourceClaim{shareClaim, migClaim} {
			if len(rn.cdiSpecsFor(t, c.UID)) == 0 {
				t.Errorf("claim %s lost its CDI spec in the roll", c.Name)
			}
		}

		if now, err := podsOf(ctx, "webhook"); err != nil || !anyNewPod(webhooks, now) {
			t.Errorf("the webhook did not roll: pods %v before, %v after (err %v)", podNames(webhooks), podNames(now), err)
		}
		if certAfter := checkChartWebhookCertificate(t); certAfter != certBefore {
			t.Errorf("the upgrade replaced the webhook's serving certificate (its Secret is the webhook's to write, not the chart's)")
		}
		chartWebhookRefusesBadConfigs(t, namespace(t, "real-node-webhook-upgraded"))

		after := workloadPod(ns, "whole-after-roll", rn.name).withClaimFrom("whole").create(t)
		after = waitRunning(t, ns, after.Name, 2*time.Minute)
		_, devices := realAllocations(t, after)
		rn.checkInside(t, after, insideView(t, after), devices)
	})
	t.Run("a plugin pod deleted while an MPS client runs is replaced, and the client keeps its server", func(t *testing.T) {
		ctx := ctxFor(t, 3*time.Minute)
		share, err := e.client.CoreV1().Pods(ns).Get(ctx, "share-roll", metav1.GetOptions{})
		if err != nil {
			t.Fatalf("the share pod of the roll: %v", err)
		}
		_, devices := realAllocations(t, share)
		daemon := rn.mpsDaemonPID(t, devices[0].Device)
		report, _ := rn.lastReport(t, share)
		plugins, err := podsOf(ctx, "kubelet-plugin")
		if err != nil || len(plugins) != 1 {
			t.Fatalf("plugin pods: %v (%d)", err, len(plugins))
		}
		deleted := time.Now()
		if err := e.client.CoreV1().Pods(chartNamespace).Delete(ctx, plugins[0].Name, metav1.DeleteOptions{}); err != nil {
			t.Fatalf("delete plugin pod %s: %v", plugins[0].Name, err)
		}
		waitPluginPodReplaced(t, "a new plugin pod Ready", plugins[0].Name, 2*time.Minute)
		waitFreshHeartbeat(t, rn.name, deleted, time.Minute)
		now, err := e.client.CoreV1().Pods(ns).Get(ctx, share.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("share pod after the plugin's restart: %v", err)
		}
		if now.Status.Phase != v1.PodRunning || now.Status.ContainerStatuses[0].RestartCount != 0 {
			t.Errorf("share pod after the plugin's restart: phase %s, restarts %d; want Running, 0", now.Status.Phase, now.Status.ContainerStatuses[0].RestartCount)
		}
		waitFor(t, "the share pod reports after the restart", 30*time.Second, func(context.Context) (bool, string) {
			_, ts := rn.lastReport(t, share)
			return ts.After(time.Now().Add(-2 * time.Second)), "last report " + ts.String()
		})
		if got, _ := rn.lastReport(t, share); got != report {
			t.Errorf("the share pod sees other devices after the plugin's restart:\nbefore: %s\nafter:  %s", report, got)
		}
		if got := rn.mpsDaemonPID(t, devices[0].Device); got != daemon || !rn.mpsServes(devices[0].Device) {
			t.Errorf("MPS daemon of %s: pid %s before the plugin's restart, %s after (serving: %v); want the same daemon serving",
				devices[0].Device, daemon, got, rn.mpsServes(devices[0].Device))
		}
	})
	t.Logf("real-node scenario: %s", time.Since(start).Round(time.Second))
}

// waitPluginPodReplaced waits until the node's only plugin pod is Ready and is not the pod `old`.
func waitPluginPodReplaced(t *testing.T, what, old string, timeout time.Duration) {
	t.Helper()
	waitFor(t, what, timeout, func(ctx context.Context) (bool, string) {
		pods, err := podsOf(ctx, "kubelet-plugin")
		if err != nil {
			return false, err.Error()
		}
		n, states := readyPods(pods)
		return n == 1 && len(pods) == 1 && pods[0].Name != old, strings.Join(states, "; ")
	})
}
