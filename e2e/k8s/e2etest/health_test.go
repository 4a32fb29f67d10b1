package e2etest

// Sick GPUs (issue 13 items 1-3). A running pod holds a MIG slice of GPU 3; an XID injected into the
// simulated backend (`tessera-kubelet-plugin simulate`, what NVML's event would report) must taint GPU 3's
// devices in the ResourceSlices within 10 s, show in the pod's allocatedResourcesStatus (kubelet's DRA
// manager reading the plugin's DRAResourceHealth stream, in the kubelet stand-in), and send a new claim
// that could fit on GPU 3 or 4 to GPU 4. Recovery removes the taint after the policy's quiet period. A lost
// GPU is NoExecute: kube-controller-manager's device-taint-eviction controller evicts the pod.

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
)

const (
	xidTaint     = "gpu.tessera.dev/xid"
	gpuLostTaint = "gpu.tessera.dev/gpu-lost"
	// Short, so the test sees the taint go; the default is 60 s.
	testQuietPeriod = 5 * time.Second
	// The bound for a taint to appear.
	taintDeadline = 10 * time.Second
)

// simulate runs the plugin's `simulate` subcommand against one node's simulated backend.
func simulate(t *testing.T, node string, args ...string) {
	t.Helper()
	dir := filepath.Join(e.runDir, "nodes", node)
	bin := filepath.Join(e.repoRoot, "target", "debug", "tessera-kubelet-plugin")
	full := append([]string{"simulate"}, args...)
	full = append(full, "--state-dir", filepath.Join(dir, "plugin-state"), "--simulated-node-file", filepath.Join(dir, "node.yaml"))
	out, err := exec.Command(bin, full...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", bin, strings.Join(full, " "), err, out)
	}
}

// withQuietPeriod sets the default GpuPolicy's health.quietPeriod and restores the policy afterwards.
func withQuietPeriod(t *testing.T, d time.Duration) {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	policies := e.dyn.Resource(policyGVR)
	patch := []byte(fmt.Sprintf(`{"spec":{"health":{"quietPeriod":%q}}}`, fmt.Sprintf("%ds", int(d.Seconds()))))
	_, err := policies.Patch(ctx, "default", types.MergePatchType, patch, metav1.PatchOptions{})
	created := false
	if apierrors.IsNotFound(err) {
		// POLICY=none: a policy with no rules publishes the built-in defaults, as none does.
		obj := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuPolicy",
			"metadata": map[string]any{"name": "default"},
			"spec":     map[string]any{"health": map[string]any{"quietPeriod": fmt.Sprintf("%ds", int(d.Seconds()))}},
		}}
		_, err = policies.Create(ctx, obj, metav1.CreateOptions{})
		created = true
	}
	if err != nil {
		t.Fatalf("set the GpuPolicy's health.quietPeriod: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var err error
		if created {
			err = policies.Delete(ctx, "default", metav1.DeleteOptions{})
		} else {
			_, err = policies.Patch(ctx, "default", types.MergePatchType, []byte(`{"spec":{"health":null}}`), metav1.PatchOptions{})
		}
		if err != nil {
			t.Errorf("restore the GpuPolicy: %v", err)
		}
	})
}

// gpuTaints returns, for every published device of GPU `gpu` on `node`, the taint with `key` (nil when the
// device lacks it).
func gpuTaints(t *testing.T, node string, gpu int, key string) map[string]*resourcev1.DeviceTaint {
	t.Helper()
	slices, err := e.client.ResourceV1().ResourceSlices().List(ctxFor(t, 30*time.Second), metav1.ListOptions{FieldSelector: "spec.nodeName=" + node + ",spec.driver=" + driver})
	if err != nil {
		t.Fatalf("list slices: %v", err)
	}
	out := map[string]*resourcev1.DeviceTaint{}
	prefix := fmt.Sprintf("gpu-%d", gpu)
	for _, s := range slices.Items {
		for _, d := range s.Spec.Devices {
			if d.Name != prefix && !strings.HasPrefix(d.Name, prefix+"-") {
				continue
			}
			out[d.Name] = nil
			for i := range d.Taints {
				if d.Taints[i].Key == key {
					out[d.Name] = &d.Taints[i]
				}
			}
		}
	}
	return out
}

// waitTaints polls until every device of the GPU has (want) or lacks (!want) the taint; returns how long
// it took and the taints seen.
func waitTaints(t *testing.T, node string, gpu int, key string, want bool, timeout time.Duration) (time.Duration, map[string]*resourcev1.DeviceTaint) {
	t.Helper()
	start := time.Now()
	var last map[string]*resourcev1.DeviceTaint
	err := wait.PollUntilContextTimeout(ctxFor(t, timeout+10*time.Second), 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		last = gpuTaints(t, node, gpu, key)
		if len(last) == 0 {
			return false, nil
		}
		for _, taint := range last {
			if (taint != nil) != want {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		var have []string
		for d, taint := range last {
			have = append(have, fmt.Sprintf("%s: %v", d, taint))
		}
		t.Fatalf("GPU %d of %s: taint %s present=%v not on every device after %s; devices: %v", gpu, node, key, want, timeout, have)
	}
	return time.Since(start), last
}

// resourceHealth is the pod's allocatedResourcesStatus of container ctr, claim gpu, as the API shows it.
func resourceHealth(p *v1.Pod) []v1.ResourceHealth {
	for _, cs := range p.Status.ContainerStatuses {
		for _, rs := range cs.AllocatedResourcesStatus {
			if rs.Name == "claim:gpu" {
				return rs.Resources
			}
		}
	}
	return nil
}

func waitResourceHealth(t *testing.T, ns, name string, want v1.ResourceHealthStatus, timeout time.Duration) (time.Duration, []v1.ResourceHealth) {
	t.Helper()
	start := time.Now()
	var last []v1.ResourceHealth
	err := wait.PollUntilContextTimeout(ctxFor(t, timeout+10*time.Second), 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		p, err := e.client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		last = resourceHealth(p)
		return len(last) == 1 && last[0].Health == want, nil
	})
	if err != nil {
		t.Fatalf("pod %s/%s: allocatedResourcesStatus of claim gpu is %+v after %s, want one device %s", ns, name, last, timeout, want)
	}
	return time.Since(start), last
}

func TestASickGPUsHealthTaintsItsDevicesShowsInThePodAndIsAvoidedUntilItRecovers(t *testing.T) {
	ns := namespace(t, "e2e-health")
	node := e.nodes[0]
	const sick, other = 3, 4
	withQuietPeriod(t, testQuietPeriod)
	// Also on failure: later scenarios need a healthy GPU 3 and no leftover taint.
	t.Cleanup(func() {
		simulate(t, node, "recover", "--gpu", fmt.Sprint(sick))
		waitTaints(t, node, sick, xidTaint, false, testQuietPeriod+30*time.Second)
		waitTaints(t, node, sick, gpuLostTaint, false, testQuietPeriod+30*time.Second)
	})

	class := mig3gClass(t)
	claimTemplate(t, ns, "on-gpu-3", class, selector(fmt.Sprintf(`device.attributes[%q].index == %d`, driver, sick)))
	claimTemplate(t, ns, "on-gpu-3-or-4", class, selector(fmt.Sprintf(`device.attributes[%q].index in [%d, %d]`, driver, sick, other)))
	running := waitRunning(t, ns, pod(t, ns, "running", "on-gpu-3", node).Name, 2*time.Minute)
	held := allocations(t, running)[0].result.Device
	if !strings.HasPrefix(held, fmt.Sprintf("gpu-%d-mig-", sick)) {
		t.Fatalf("pod holds %s, want a MIG device of GPU %d", held, sick)
	}
	took, _ := waitResourceHealth(t, ns, "running", v1.ResourceHealthStatusHealthy, time.Minute)
	t.Logf("resource health of %s Healthy %s after the pod ran", held, took.Round(time.Millisecond))

	simulate(t, node, "inject-xid", "--gpu", fmt.Sprint(sick), "--xid", "94")
	took, taints := waitTaints(t, node, sick, xidTaint, true, taintDeadline)
	t.Logf("XID 94 on GPU %d: taint on all %d devices of the GPU after %s", sick, len(taints), took.Round(time.Millisecond))
	for d, taint := range taints {
		if taint.Value != "94" || taint.Effect != resourcev1.DeviceTaintEffectNoSchedule {
			t.Errorf("device %s: taint %s=%s:%s, want %s=94:NoSchedule", d, taint.Key, taint.Value, taint.Effect, xidTaint)
		}
	}
	if untouched := gpuTaints(t, node, other, xidTaint); len(untouched) == 0 {
		t.Fatalf("GPU %d publishes no devices", other)
	} else {
		for d, taint := range untouched {
			if taint != nil {
				t.Errorf("device %s of the healthy GPU %d is tainted: %+v", d, other, taint)
			}
		}
	}
	took, health := waitResourceHealth(t, ns, "running", v1.ResourceHealthStatusUnhealthy, 30*time.Second)
	msg := ""
	if health[0].Message != nil {
		msg = *health[0].Message
	}
	t.Logf("pod's allocatedResourcesStatus Unhealthy %s after the taint (%s: %q)", took.Round(time.Millisecond), health[0].ResourceID, msg)
	if !strings.Contains(msg, "XID 94") {
		t.Errorf("resource health message %q does not name the XID", msg)
	}
	newcomer := waitRunning(t, ns, pod(t, ns, "newcomer", "on-gpu-3-or-4", node).Name, 2*time.Minute)
	if got := allocations(t, newcomer)[0].result.Device; !strings.HasPrefix(got, fmt.Sprintf("gpu-%d-", other)) {
		t.Errorf("new claim got %s while GPU %d is tainted, want a device of GPU %d", got, sick, other)
	}

	simulate(t, node, "recover", "--gpu", fmt.Sprint(sick))
	took, _ = waitTaints(t, node, sick, xidTaint, false, testQuietPeriod+30*time.Second)
	t.Logf("recovery: taint gone after %s (quiet period %s)", took.Round(time.Millisecond), testQuietPeriod)
	if took < testQuietPeriod-time.Second {
		t.Errorf("taint removed %s after recovery, before the %s quiet period", took, testQuietPeriod)
	}
	took, _ = waitResourceHealth(t, ns, "running", v1.ResourceHealthStatusHealthy, 30*time.Second)
	t.Logf("pod's allocatedResourcesStatus Healthy again %s later", took.Round(time.Millisecond))

	simulate(t, node, "lose-gpu", "--gpu", fmt.Sprint(sick))
	took, taints = waitTaints(t, node, sick, gpuLostTaint, true, taintDeadline)
	t.Logf("lost GPU %d: %s taint on all %d devices after %s", sick, gpuLostTaint, len(taints), took.Round(time.Millisecond))
	for d, taint := range taints {
		if taint.Effect != resourcev1.DeviceTaintEffectNoExecute {
			t.Errorf("device %s: %s effect %s, want NoExecute", d, gpuLostTaint, taint.Effect)
		}
	}
	start := time.Now()
	waitGone(t, ns, "running", 2*time.Minute)
	t.Logf("pod on the lost GPU evicted and gone %s after the taint", time.Since(start).Round(time.Millisecond))
	events, err := e.client.CoreV1().Events(ns).List(ctxFor(t, 30*time.Second), metav1.ListOptions{FieldSelector: "involvedObject.name=running"})
	if err != nil {
		t.Fatalf("list events: %v", err)
	}
	evicted := false
	for _, ev := range events.Items {
		if ev.Reason == "DeviceTaintManagerEviction" {
			evicted = true
		}
	}
	if !evicted {
		t.Errorf("no DeviceTaintManagerEviction event for the evicted pod; events: %d", len(events.Items))
	}
	if _, err := e.client.CoreV1().Pods(ns).Get(ctxFor(t, 30*time.Second), "newcomer", metav1.GetOptions{}); err != nil {
		t.Errorf("the pod on the healthy GPU %d: %v", other, err)
	}
}

var deviceTaintRuleGVR = schema.GroupVersionResource{Group: "resource.k8s.io", Version: "v1", Resource: "devicetaintrules"}

// An admin's DeviceTaintRule (resource.k8s.io/v1 since 1.37) and tessera's health taints keep claims off
// their devices side by side: the controller neither copies the rule's taint into its slices nor removes
// it, and the scheduler honours both. On 1.36 the rule is v1beta2 and off by default, which is asserted
// instead (tessera's own taints are then the only ones).
func TestAnAdminsDeviceTaintRuleWorksBesideHealthTaints(t *testing.T) {
	resources, err := e.client.Discovery().ServerResourcesForGroupVersion("resource.k8s.io/v1")
	if err != nil {
		t.Fatalf("discover resource.k8s.io/v1: %v", err)
	}
	served := false
	for _, r := range resources.APIResources {
		served = served || r.Name == "devicetaintrules"
	}
	version, err := e.client.Discovery().ServerVersion()
	if err != nil {
		t.Fatalf("server version: %v", err)
	}
	if version.Minor == "36" {
		if served {
			t.Fatalf("Kubernetes 1.36 serves DeviceTaintRule in resource.k8s.io/v1; the README says v1beta2, off by default")
		}
		t.Logf("Kubernetes %s: no v1 DeviceTaintRule; health taints are the only device taints", version.GitVersion)
		return
	}
	if !served {
		t.Fatalf("Kubernetes %s does not serve DeviceTaintRule in resource.k8s.io/v1", version.GitVersion)
	}

	ns := namespace(t, "e2e-health-rule")
	node := e.nodes[len(e.nodes)-1]
	const ruled, sick, free = 5, 6, 7
	withQuietPeriod(t, testQuietPeriod)
	t.Cleanup(func() {
		simulate(t, node, "recover", "--gpu", fmt.Sprint(sick))
		waitTaints(t, node, sick, xidTaint, false, testQuietPeriod+30*time.Second)
	})
	rules := e.dyn.Resource(deviceTaintRuleGVR)
	rule := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
		"metadata": map[string]any{"name": "e2e-maintenance"},
		"spec": map[string]any{
			"deviceSelector": map[string]any{"driver": driver, "pool": node, "device": fmt.Sprintf("gpu-%d", ruled)},
			"taint":          map[string]any{"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"},
		},
	}}
	if _, err := rules.Create(ctxFor(t, 30*time.Second), rule, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create DeviceTaintRule: %v", err)
	}
	t.Cleanup(func() {
		if err := rules.Delete(context.Background(), "e2e-maintenance", metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete DeviceTaintRule: %v", err)
		}
	})

	simulate(t, node, "inject-xid", "--gpu", fmt.Sprint(sick), "--xid", "94")
	took, _ := waitTaints(t, node, sick, xidTaint, true, taintDeadline)
	t.Logf("XID on GPU %d tainted in %s beside the admin's rule on GPU %d", sick, took.Round(time.Millisecond), ruled)

	claimTemplate(t, ns, "gpu-5-6-or-7", gpuClass(t), selector(fmt.Sprintf(`device.attributes[%q].index in [%d, %d, %d]`, driver, ruled, sick, free)))
	p := waitRunning(t, ns, pod(t, ns, "avoids-both", "gpu-5-6-or-7", node).Name, 2*time.Minute)
	if got := allocations(t, p)[0].result.Device; got != fmt.Sprintf("gpu-%d", free) {
		t.Errorf("claim got %s; want gpu-%d, the one neither the admin's rule nor a health taint covers", got, free)
	}
	for _, taint := range sliceDevice(t, node, fmt.Sprintf("gpu-%d", ruled)).Taints {
		if taint.Key == "example.com/maintenance" {
			t.Errorf("the controller wrote the admin's rule into its slice: %+v", taint)
		}
	}
}

// An XID attributed to one MIG device (NVML reports it on the parent GPU with the GPU-instance id; the
// simulated backend takes the same id) taints only that placement, and only its pod reads Unhealthy: the
// plugin maps the GPU instance to the MIG device through the claim it prepared there.
func TestAMigDevicesXidTaintsOnlyThatPlacementAndItsPodsHealth(t *testing.T) {
	ns := namespace(t, "e2e-health-mig")
	node := e.nodes[0]
	const gpu = 5
	withQuietPeriod(t, testQuietPeriod)
	t.Cleanup(func() {
		simulate(t, node, "recover", "--gpu", fmt.Sprint(gpu))
		waitTaints(t, node, gpu, xidTaint, false, testQuietPeriod+30*time.Second)
	})
	claimTemplate(t, ns, "mig-on-5", mig3gClass(t), selector(fmt.Sprintf(`device.attributes[%q].index == %d`, driver, gpu)))
	sickPod := waitRunning(t, ns, pod(t, ns, "sick", "mig-on-5", node).Name, 2*time.Minute)
	wellPod := waitRunning(t, ns, pod(t, ns, "well", "mig-on-5", node).Name, 2*time.Minute)
	sickDevice := allocations(t, sickPod)[0].result.Device
	wellDevice := allocations(t, wellPod)[0].result.Device
	placement := sliceDevice(t, node, sickDevice).Attributes["placementStart"].IntValue
	if placement == nil {
		t.Fatalf("%s has no placementStart attribute", sickDevice)
	}
	start := int(*placement)
	gi, ok := simulatedGPUInstance(t, node, gpu, start)
	if !ok {
		t.Fatalf("no GPU instance at memory slice %d of GPU %d for %s", start, gpu, sickDevice)
	}

	simulate(t, node, "inject-xid", "--gpu", fmt.Sprint(gpu), "--gpu-instance", fmt.Sprint(gi.ID), "--xid", "94")
	injected := time.Now()
	deadline := injected.Add(taintDeadline)
	var taints map[string]*resourcev1.DeviceTaint
	for {
		taints = gpuTaints(t, node, gpu, xidTaint)
		if taints[sickDevice] != nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if taints[sickDevice] == nil {
		t.Fatalf("%s (GPU instance %d) not tainted %s within %s", sickDevice, gi.ID, xidTaint, taintDeadline)
	}
	t.Logf("XID 94 on GPU instance %d: %s tainted %s after the injection", gi.ID, sickDevice, time.Since(injected).Round(time.Millisecond))
	for d, taint := range taints {
		if d != sickDevice && taint != nil {
			t.Errorf("device %s is tainted too (%+v); only %s should be", d, taint, sickDevice)
		}
	}
	waitResourceHealth(t, ns, "sick", v1.ResourceHealthStatusUnhealthy, 30*time.Second)
	p, err := e.client.CoreV1().Pods(ns).Get(ctxFor(t, 30*time.Second), "well", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if h := resourceHealth(p); len(h) != 1 || h[0].Health != v1.ResourceHealthStatusHealthy {
		t.Errorf("pod on %s (same GPU, other GPU instance) reads %+v, want Healthy", wellDevice, h)
	}

	// The fault is hardware state: a restarted plugin reports it again. Had it forgotten it, the taint
	// would go one quiet period after the new plugin's first report.
	restarted := time.Now()
	proc(t, "restart", "plugin-"+node)
	waitFreshHeartbeat(t, node, restarted, time.Minute)
	time.Sleep(testQuietPeriod + 2*time.Second)
	if gpuTaints(t, node, gpu, xidTaint)[sickDevice] == nil {
		t.Errorf("%s lost its taint after a plugin restart: the injected fault did not persist", sickDevice)
	}
	waitResourceHealth(t, ns, "sick", v1.ResourceHealthStatusUnhealthy, 30*time.Second)
}
