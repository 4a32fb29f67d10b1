package e2etest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"tessera.dev/e2e/internal/cluster"
)

// (a) Everything tessera ships is accepted by a real 1.36 API server: the controller's ResourceSlices
// (written by the controller, so already validated), the CRDs and DeviceClasses `make up` applied,
// every policy (dry run: applying one would change the slices) and every example, whose pods must run.
func TestEveryManifestIsAcceptedByTheAPIServer(t *testing.T) {
	ctx := ctxFor(t, 5*time.Minute)
	for _, node := range e.nodes {
		slices, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node + ",spec.driver=" + driver})
		if err != nil {
			t.Fatalf("list slices: %v", err)
		}
		devices := 0
		for _, s := range slices.Items {
			if s.Spec.Pool.Name != node {
				t.Errorf("slice %s: pool %q, want the node name %q", s.Name, s.Spec.Pool.Name, node)
			}
			for _, d := range s.Spec.Devices {
				devices++
				if !anyName.MatchString(d.Name) {
					t.Errorf("slice %s: device name %q does not follow the naming contract", s.Name, d.Name)
				}
			}
		}
		if devices < e.gpus {
			t.Errorf("node %s publishes %d devices, want at least one per GPU (%d)", node, devices, e.gpus)
		}
	}

	applier, err := cluster.NewApplier(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	dry, err := cluster.NewApplier(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	dry.DryRun = true
	for _, dir := range []string{"crds", "classes", "policies"} {
		path := filepath.Join(e.repoRoot, "deployments", dir)
		files, err := cluster.ManifestFiles(path)
		if err != nil {
			t.Errorf("deployments/%s: %v", dir, err)
			continue
		}
		objs, err := cluster.ReadManifests(files...)
		if err != nil {
			t.Errorf("deployments/%s: %v", dir, err)
			continue
		}
		if len(objs) == 0 {
			t.Errorf("deployments/%s has no manifests", dir)
		}
		for _, o := range objs {
			if err := dry.ApplyOne(ctx, o, "default"); err != nil {
				t.Errorf("rejected: %v", err)
			}
		}
	}

	ns := namespace(t, "e2e-examples")
	examples := filepath.Join(e.repoRoot, "deployments", "examples")
	files, err := cluster.ManifestFiles(examples)
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples under deployments/examples (%v)", err)
	}
	for _, f := range files {
		dir := filepath.Dir(f)
		if dir != examples && strings.TrimSuffix(filepath.Base(f), ".yaml") != filepath.Base(dir) {
			t.Errorf("example %s does not follow examples/<name>/<name>.yaml", f)
		}
	}
	objs, err := cluster.ReadManifests(files...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Examples may name their own namespaces; delete their objects explicitly so their devices free up.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := applier.Delete(ctx, objs, ns); err != nil {
			t.Errorf("delete examples: %v", err)
		}
		waitNoPods(t, objs, ns)
	})
	if err := applier.Apply(ctx, objs, ns); err != nil {
		t.Fatalf("examples rejected: %v", err)
	}
	var pods []*unstructured.Unstructured
	for _, o := range objs {
		if o.GetKind() == "Pod" {
			pods = append(pods, o)
		}
	}
	if len(pods) == 0 {
		t.Fatalf("the examples contain no Pod")
	}
	for _, o := range pods {
		p := waitRunning(t, o.GetNamespace(), o.GetName(), 2*time.Minute)
		for _, a := range allocations(t, p) {
			checkPrepared(t, a)
		}
	}
	var report strings.Builder
	if _, err := cluster.Report(ctx, e.client, &report); err == nil {
		t.Logf("examples:\n%s", report.String())
	}
}

func waitNoPods(t *testing.T, objs []*unstructured.Unstructured, ns string) {
	for _, o := range objs {
		if o.GetKind() != "Pod" {
			continue
		}
		podNS := o.GetNamespace()
		if podNS == "" {
			podNS = ns
		}
		waitGone(t, podNS, o.GetName(), time.Minute)
	}
}

// (b) The real scheduler allocates a whole GPU, a MIG 3g slice and a 10Gi/25% share; the plugin on the
// chosen node prepares them and CDI injection gives the container the right device nodes and env.
func TestWholeMigAndShareClaimsAreAllocatedAndPrepared(t *testing.T) {
	ns := namespace(t, "e2e-alloc")
	claimTemplate(t, ns, "whole", gpuClass(t))
	claimTemplate(t, ns, "mig", mig3gClass(t))
	claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "10Gi", "compute": "25"}))
	pod(t, ns, "whole", "whole", "")
	pod(t, ns, "mig", "mig", "")
	pod(t, ns, "share", "share", "")

	t.Run("whole GPU", func(t *testing.T) {
		p := waitRunning(t, ns, "whole", 2*time.Minute)
		a := allocations(t, p)[0]
		if !wholeGPUName.MatchString(a.result.Device) {
			t.Fatalf("allocated %q, want a whole GPU gpu-<i>", a.result.Device)
		}
		env := checkPrepared(t, a)
		dev := sliceDevice(t, p.Spec.NodeName, a.result.Device)
		key := uuidEnvKey(a.result.Device)
		if uuid := attr(dev, "uuid").StringValue; uuid == nil || env[key] != *uuid {
			t.Errorf("%s=%q, want the slice's uuid attribute %v", key, env[key], uuid)
		}
		minor := attr(dev, "minor").IntValue
		if minor == nil {
			t.Fatalf("device %s has no minor attribute", a.result.Device)
		}
		paths := a.edits.DevicePaths()
		for _, want := range []string{fmt.Sprintf("/dev/nvidia%d", *minor), "/dev/nvidiactl"} {
			if !contains(paths, want) {
				t.Errorf("device nodes %v lack %s", paths, want)
			}
		}
	})

	t.Run("MIG 3g", func(t *testing.T) {
		p := waitRunning(t, ns, "mig", 2*time.Minute)
		a := allocations(t, p)[0]
		if !mig3gName.MatchString(a.result.Device) {
			t.Fatalf("allocated %q, want a 3g MIG placement gpu-<i>-mig-3g-...-<start>", a.result.Device)
		}
		env := checkPrepared(t, a)
		key := uuidEnvKey(a.result.Device)
		if !strings.HasPrefix(env[key], "MIG-") {
			t.Errorf("%s=%q, want a MIG-… uuid", key, env[key])
		}
		paths := a.edits.DevicePaths()
		if !hasPrefix(paths, "/dev/nvidia-caps/") {
			t.Errorf("device nodes %v lack the MIG capability node under /dev/nvidia-caps/", paths)
		}
		if !contains(paths, "/dev/nvidiactl") {
			t.Errorf("device nodes %v lack /dev/nvidiactl", paths)
		}
		// The simulated hardware must now hold a 3g GPU instance exactly at the placement the scheduler
		// chose, whose compute instance is the MIG device the container was given.
		m := migDeviceName.FindStringSubmatch(a.result.Device)
		gpu, _ := strconv.Atoi(m[1])
		start, _ := strconv.Atoi(m[3])
		gi, ok := simulatedGPUInstance(t, p.Spec.NodeName, gpu, start)
		if !ok {
			t.Fatalf("no GPU instance at placement start %d on %s gpu %d", start, p.Spec.NodeName, gpu)
		}
		if gi.ProfileID != 9 || gi.Placement.Size != 4 {
			t.Errorf("GPU instance %+v, want the 3g profile (ID 9) over 4 memory slices", gi)
		}
		if len(gi.ComputeInstances) != 1 || gi.ComputeInstances[0].UUID != env[key] {
			t.Errorf("compute instances %+v, want one whose uuid is %s", gi.ComputeInstances, env[key])
		}
	})

	t.Run("10Gi 25% share", func(t *testing.T) {
		p := waitRunning(t, ns, "share", 2*time.Minute)
		a := allocations(t, p)[0]
		if !sharedName.MatchString(a.result.Device) {
			t.Fatalf("allocated %q, want a shared device", a.result.Device)
		}
		if got := a.result.ConsumedCapacity["memory"]; got.Cmp(resource.MustParse("10Gi")) != 0 {
			t.Errorf("consumed memory %s, want 10Gi", got.String())
		}
		if got := a.result.ConsumedCapacity["compute"]; got.Cmp(resource.MustParse("25")) != 0 {
			t.Errorf("consumed compute %s, want 25", got.String())
		}
		env := checkPrepared(t, a)
		if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "25" {
			t.Errorf("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%q, want 25", env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"])
		}
		if got := mpsLimitBytes(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]); got != 10<<30 {
			t.Errorf("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%q is %d bytes, want 10GiB", env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], got)
		}
		if env["CUDA_MPS_PIPE_DIRECTORY"] == "" {
			t.Errorf("CUDA_MPS_PIPE_DIRECTORY not set")
		}
	})
}

// (b, continued) Two share claims on one node land on its one shared GPU, each with its own limits in its
// CDI env, served by one MPS control daemon.
func TestTwoSharesOnOneGPUGetTheirOwnLimits(t *testing.T) {
	ns := namespace(t, "e2e-two-shares")
	claimTemplate(t, ns, "small", sharedClass(t), capacity(map[string]string{"memory": "10Gi", "compute": "25"}))
	claimTemplate(t, ns, "large", sharedClass(t), capacity(map[string]string{"memory": "20Gi", "compute": "50"}))
	node := e.nodes[0]
	pod(t, ns, "small", "small", node)
	pod(t, ns, "large", "large", node)
	small := allocations(t, waitRunning(t, ns, "small", 2*time.Minute))[0]
	large := allocations(t, waitRunning(t, ns, "large", 2*time.Minute))[0]
	if small.result.Device != large.result.Device {
		t.Fatalf("shares landed on %s and %s, want one shared GPU", small.result.Device, large.result.Device)
	}
	if small.result.ShareID == nil || large.result.ShareID == nil || *small.result.ShareID == *large.result.ShareID {
		t.Errorf("share ids %v and %v, want two distinct ones", small.result.ShareID, large.result.ShareID)
	}
	for _, c := range []struct {
		a       allocation
		percent string
		bytes   int64
	}{{small, "25", 10 << 30}, {large, "50", 20 << 30}} {
		env := checkPrepared(t, c.a)
		if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != c.percent {
			t.Errorf("%s: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%q, want %s", c.a.pod.Name, env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], c.percent)
		}
		if got := mpsLimitBytes(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]); got != c.bytes {
			t.Errorf("%s: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%q, want %d bytes", c.a.pod.Name, env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], c.bytes)
		}
	}
	if a, b := small.edits.EnvMap()["CUDA_MPS_PIPE_DIRECTORY"], large.edits.EnvMap()["CUDA_MPS_PIPE_DIRECTORY"]; a == "" || a != b {
		t.Errorf("MPS pipe directories %q and %q, want one daemon for the GPU", a, b)
	}
}

// Issue 23 item 6: shares that name only memory reserve no compute, so four 10Gi claims share one GPU,
// each with its memory limit and no thread limit.
func TestSharesThatNameOnlyMemoryFitBesideEachOtherWithoutAThreadLimit(t *testing.T) {
	ns := namespace(t, "e2e-memory-shares")
	claimTemplate(t, ns, "ten", sharedClass(t), capacity(map[string]string{"memory": "10Gi"}))
	node := e.nodes[0]
	names := []string{"ten-a", "ten-b", "ten-c", "ten-d"}
	for _, name := range names {
		pod(t, ns, name, "ten", node)
	}
	var device string
	for _, name := range names {
		a := allocations(t, waitRunning(t, ns, name, 2*time.Minute))[0]
		if device == "" {
			device = a.result.Device
		} else if a.result.Device != device {
			t.Errorf("%s landed on %s, the first share on %s: want one shared GPU for all four", name, a.result.Device, device)
		}
		if got := a.result.ConsumedCapacity["compute"]; got.Value() != 0 {
			t.Errorf("%s consumed compute %s, want 0 (it named none)", name, got.String())
		}
		env := checkPrepared(t, a)
		if v, ok := env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]; ok {
			t.Errorf("%s: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%q, want none (it named no compute)", name, v)
		}
		if got := mpsLimitBytes(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]); got != 10<<30 {
			t.Errorf("%s: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%q, want 10Gi", name, env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])
		}
	}
}

// Issue 23 item 1: a claim asking for time-slicing on a GPU published as MPS-shared (make e2e's host
// cluster has no admission webhook, so it reaches prepare) fails alone, naming the strategy; the GPU
// keeps serving MPS shares beside it.
func TestATimeSlicingClaimOnAnMpsSharedGPUFailsAloneAndTheGPUKeepsServingMps(t *testing.T) {
	ns := namespace(t, "e2e-strategy")
	share := capacity(map[string]string{"memory": "10Gi", "compute": "25"})
	a, b := oneClaimRefusedTwoServed(t, ns, e.nodes[0], share, "mps", "MPS", "sliced", "TimeSlicing")
	if a.result.Device != b.result.Device {
		t.Errorf("the MPS shares landed on %s and %s, want the one shared GPU", a.result.Device, b.result.Device)
	}
	for _, x := range []allocation{a, b} {
		if env := checkPrepared(t, x); env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "25" {
			t.Errorf("%s: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%q, want 25 (an MPS share)", x.pod.Name, env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"])
		}
	}
}

// Issue 23 item 1, the strategies swapped: with GPU 1 published for time-slicing, a claim whose config asks
// for MPS fails alone, naming both strategies; time-sliced shares run on the GPU beside it, without MPS.
func TestAnMpsClaimOnATimeSlicedGPUFailsAloneAndTheGPUKeepsServingTimeSlices(t *testing.T) {
	gpu1 := func(name string) bool { return name == "gpu-1-shared" }
	// Cleanups run last first: this one, after the policy is put back, keeps the next scenarios off a
	// time-sliced GPU 1.
	t.Cleanup(func() {
		for _, n := range e.nodes {
			waitDevices(t, n, "GPU 1 of "+n+" published for MPS again", gpu1, "sharingStrategy", "MPS")
		}
	})
	changePolicy(t, func(rule map[string]any) {
		if shared, ok := rule["shared"].(map[string]any); ok {
			shared["strategy"] = "TimeSlicing"
		}
	})
	node := e.nodes[0]
	waitDevices(t, node, "GPU 1 published for time-slicing", gpu1, "sharingStrategy", "TimeSlicing")
	ns := namespace(t, "e2e-strategy-swapped")
	share := capacity(map[string]string{"memory": "10Gi"})
	a, b := oneClaimRefusedTwoServed(t, ns, node, share, "sliced", "TimeSlicing", "mps", "MPS")
	if a.result.Device != "gpu-1-shared" || b.result.Device != "gpu-1-shared" {
		t.Errorf("the time-sliced shares landed on %s and %s, want gpu-1-shared", a.result.Device, b.result.Device)
	}
	for _, x := range []allocation{a, b} {
		if env := checkPrepared(t, x); env["CUDA_MPS_PIPE_DIRECTORY"] != "" {
			t.Errorf("%s: CUDA_MPS_PIPE_DIRECTORY=%q, want none (a time-sliced share)", x.pod.Name, env["CUDA_MPS_PIPE_DIRECTORY"])
		}
	}
}

// oneClaimRefusedTwoServed: on node, a pod whose share's config asks for strategy `asked` (template
// `refused`) while the GPU serves `served` fails its prepare, its event naming both strategies; then two
// pods of template `plain` (the same share, no config), "<plain>-a" and "<plain>-b", run, and their
// allocations are returned.
func oneClaimRefusedTwoServed(t *testing.T, ns, node string, share claimOpt, plain, served, refused, asked string) (allocation, allocation) {
	t.Helper()
	claimTemplate(t, ns, plain, sharedClass(t), share)
	claimTemplate(t, ns, refused, sharedClass(t), share, opaqueConfig(
		`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"`+asked+`"}}`))
	pod(t, ns, refused, refused, node)
	msg := waitPrepareFailure(t, ns, refused)
	t.Logf("the %s pod's event: %s", asked, msg)
	if !strings.Contains(msg, served) || !strings.Contains(msg, asked) {
		t.Errorf("event %q does not say the device serves %s and the claim asked for %s", msg, served, asked)
	}
	for _, name := range []string{plain + "-a", plain + "-b"} {
		pod(t, ns, name, plain, node)
	}
	a := allocations(t, waitRunning(t, ns, plain+"-a", 2*time.Minute))[0]
	b := allocations(t, waitRunning(t, ns, plain+"-b", 2*time.Minute))[0]
	return a, b
}

// mpsLimitBytes parses CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("<ordinal|uuid>=<n>G|M", MPS units are binary).
func mpsLimitBytes(v string) int64 {
	_, limit, ok := strings.Cut(v, "=")
	if !ok || strings.Contains(limit, ",") {
		return -1
	}
	limit = strings.TrimSuffix(limit, "B")
	mult := map[byte]int64{'G': 1 << 30, 'M': 1 << 20, 'K': 1 << 10}
	if m, ok := mult[limit[len(limit)-1]]; ok && len(limit) > 1 {
		n, err := strconv.ParseInt(limit[:len(limit)-1], 10, 64)
		if err != nil {
			return -1
		}
		return n * m
	}
	q, err := resource.ParseQuantity(limit)
	if err != nil {
		return -1
	}
	return q.Value()
}

// (c) Deleting a pod unprepares its claim (the CDI spec goes) and the same device serves the next pod.
func TestDeletingAPodUnpreparesAndFreesTheDevice(t *testing.T) {
	ns := namespace(t, "e2e-reuse")
	node := e.nodes[0]
	class := gpuClass(t)
	// Pinning node and GPU index makes "the same device" observable.
	claimTemplate(t, ns, "gpu0", class, selector(fmt.Sprintf(`device.attributes[%q].index == 0`, driver)))
	first := waitRunning(t, ns, pod(t, ns, "first", "gpu0", node).Name, 2*time.Minute)
	a := allocations(t, first)[0]
	checkPrepared(t, a)

	deletePod(t, ns, "first")
	waitGone(t, ns, "first", time.Minute)
	if files := cdiSpecsMentioning(t, node, string(a.claim.UID)); len(files) != 0 {
		t.Errorf("CDI spec(s) %v of claim %s still on %s after the pod was deleted", files, a.claim.UID, node)
	}

	second := waitRunning(t, ns, pod(t, ns, "second", "gpu0", node).Name, 2*time.Minute)
	b := allocations(t, second)[0]
	if b.result.Device != a.result.Device || b.result.Pool != a.result.Pool {
		t.Errorf("second pod got %s/%s, want the freed %s/%s", b.result.Pool, b.result.Device, a.result.Pool, a.result.Device)
	}
	if b.claim.UID == a.claim.UID {
		t.Errorf("second pod reuses claim %s; want a new claim from the template", a.claim.UID)
	}
	checkPrepared(t, b)
}

// (d) More claims than a node holds: the surplus pod stays Pending with the scheduler's reason and runs
// once capacity frees.
func TestSurplusClaimsStayPendingUntilCapacityFrees(t *testing.T) {
	ns := namespace(t, "e2e-surplus")
	node := e.nodes[len(e.nodes)-1]
	class := gpuClass(t)
	whole := countDevices(t, node, wholeGPUName)
	if whole == 0 {
		t.Fatalf("node %s publishes no whole GPU", node)
	}
	claimTemplate(t, ns, "all", class, count(int64(whole)))
	claimTemplate(t, ns, "one", class)
	big := waitRunning(t, ns, pod(t, ns, "all-gpus", "all", node).Name, 2*time.Minute)
	if n := len(allocations(t, big)); n != whole {
		t.Fatalf("all-gpus got %d devices, want all %d whole GPUs of %s", n, whole, node)
	}

	pod(t, ns, "surplus", "one", node)
	ctx := ctxFor(t, 2*time.Minute)
	var reason string
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		p, err := e.client.CoreV1().Pods(ns).Get(ctx, "surplus", metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		if p.Status.Phase == v1.PodRunning {
			return false, fmt.Errorf("surplus pod runs although %s has no free GPU", node)
		}
		for _, c := range p.Status.Conditions {
			if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable {
				reason = c.Message
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("surplus pod: %v", err)
	}
	if !strings.Contains(reason, "cannot allocate all claims") {
		t.Errorf("scheduler reason %q does not say the claims cannot be allocated", reason)
	}
	t.Logf("surplus pod pending: %s", reason)

	deletePod(t, ns, "all-gpus")
	p := waitRunning(t, ns, "surplus", 2*time.Minute)
	checkPrepared(t, allocations(t, p)[0])
}

// (e) Restarts: the plugin restarting keeps running pods prepared and prepare stays idempotent; the
// controller restarting does not churn slices; the API server restarting is survived by both.
func TestRestartsKeepPodsPreparedAndSlicesStable(t *testing.T) {
	ns := namespace(t, "e2e-restart")
	node := e.nodes[0]
	claimTemplate(t, ns, "whole", gpuClass(t))
	claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "4Gi", "compute": "10"}))
	running := []*v1.Pod{
		waitRunning(t, ns, pod(t, ns, "whole", "whole", node).Name, 2*time.Minute),
		waitRunning(t, ns, pod(t, ns, "share", "share", node).Name, 2*time.Minute),
	}

	t.Run("plugin restart keeps pods prepared and prepare idempotent", func(t *testing.T) {
		restartedAt := time.Now()
		proc(t, "restart", "plugin-"+node)
		waitFreshHeartbeat(t, node, restartedAt, 60*time.Second)
		for _, p := range running {
			a := allocations(t, p)[0]
			if files := cdiSpecsMentioning(t, node, string(a.claim.UID)); len(files) == 0 {
				t.Errorf("%s: CDI spec of claim %s gone after the plugin restart", p.Name, a.claim.UID)
			}
			// Call NodePrepareResources again, as a kubelet does after its own restart: same devices, same CDI ids.
			resp := prepareDirectly(t, node, a)
			got := resp.Claims[string(a.claim.UID)]
			if got == nil || got.Error != "" {
				t.Fatalf("%s: repeated NodePrepareResources: %+v", p.Name, got)
			}
			var ids []string
			for _, d := range got.Devices {
				ids = append(ids, d.CdiDeviceIds...)
			}
			if strings.Join(ids, ",") != strings.Join(a.edits.CDIDevices, ",") {
				t.Errorf("%s: repeated prepare returned CDI ids %v, first prepare gave %v", p.Name, ids, a.edits.CDIDevices)
			}
		}
		claimTemplate(t, ns, "after-plugin", gpuClass(t))
		p := waitRunning(t, ns, pod(t, ns, "after-plugin", "after-plugin", node).Name, 2*time.Minute)
		checkPrepared(t, allocations(t, p)[0])
	})

	t.Run("controller restart does not churn slices", func(t *testing.T) {
		before := stableSlices(t, 12*time.Second, 90*time.Second)
		proc(t, "restart", "controller")
		// Give the new instance time to take the lease and run a full reconcile of every pool.
		time.Sleep(20 * time.Second)
		if !procAlive("controller") {
			t.Fatalf("controller exited after restart; see %s", filepath.Join(e.runDir, "logs", "controller.log"))
		}
		after := slicesVersions(t)
		if len(after) != len(before) {
			t.Errorf("slice count changed from %d to %d", len(before), len(after))
		}
		for name, rv := range before {
			if after[name] != rv {
				t.Errorf("slice %s changed (resourceVersion %s -> %q) after a controller restart", name, rv, after[name])
			}
		}
	})

	t.Run("API server restart is survived", func(t *testing.T) {
		before := slicesVersions(t)
		proc(t, "restart", "kube-apiserver")
		ctx := ctxFor(t, 2*time.Minute)
		err := wait.PollUntilContextTimeout(ctx, time.Second, 90*time.Second, true, func(ctx context.Context) (bool, error) {
			body, err := e.client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
			return err == nil && string(body) == "ok", nil
		})
		if err != nil {
			t.Fatalf("API server not ready after restart")
		}
		back := time.Now()
		for _, n := range e.nodes {
			waitRenewed(t, n, back, 60*time.Second)
		}
		for _, name := range append([]string{"controller"}, pluginNames()...) {
			if !procAlive(name) {
				t.Errorf("%s exited after the API server restart", name)
			}
		}
		claimTemplate(t, ns, "after-apiserver", gpuClass(t))
		p := waitRunning(t, ns, pod(t, ns, "after-apiserver", "after-apiserver", node).Name, 2*time.Minute)
		checkPrepared(t, allocations(t, p)[0])
		for _, p := range running {
			cur, err := e.client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
			if err != nil || cur.Status.Phase != v1.PodRunning {
				t.Errorf("pod %s not Running after the API server restart (%v)", p.Name, err)
			}
		}
		after := slicesVersions(t)
		if len(after) != len(before) {
			t.Errorf("slice count changed from %d to %d across the API server restart", len(before), len(after))
		}
	})
}

func pluginNames() []string {
	var names []string
	for _, n := range e.nodes {
		names = append(names, "plugin-"+n)
	}
	return names
}

// prepareDirectly calls the plugin's v1 DRA service on its socket, bypassing the kubelet's cache.
func prepareDirectly(t *testing.T, node string, a allocation) *drapb.NodePrepareResourcesResponse {
	t.Helper()
	sock := filepath.Join(e.runDir, "nodes", node, "plugins", driver, "dra.sock")
	if _, err := os.Stat(sock); err != nil {
		t.Fatalf("plugin socket: %v", err)
	}
	conn, err := grpc.NewClient("unix:"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("dial %s: %v", sock, err)
	}
	defer conn.Close()
	ctx := ctxFor(t, 45*time.Second)
	resp, err := drapb.NewDRAPluginClient(conn).NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{{
		Namespace: a.claim.Namespace, Uid: string(a.claim.UID), Name: a.claim.Name,
	}}})
	if err != nil {
		t.Fatalf("NodePrepareResources: %v", err)
	}
	return resp
}

// invalidConfigError is what the plugin's error for the invalid config below must mention.
var invalidConfigError = regexp.MustCompile(`(?i)NotAStrategy|strategy`)

// (f) A claim with an invalid opaque config fails to prepare, and the plugin's error is on the pod's events.
func TestInvalidOpaqueConfigFailsPrepareWithAnEvent(t *testing.T) {
	ns := namespace(t, "e2e-badconfig")
	claimTemplate(t, ns, "bad", gpuClass(t), opaqueConfig(
		`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"NotAStrategy"}}`))
	p := pod(t, ns, "bad", "bad", "")
	ctx := ctxFor(t, 2*time.Minute)
	var msg string
	err := wait.PollUntilContextTimeout(ctx, time.Second, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		cur, err := e.client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		if cur.Status.Phase == v1.PodRunning {
			return false, fmt.Errorf("pod with an invalid opaque config is Running")
		}
		evs, err := e.client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + p.Name + ",reason=FailedPrepareDynamicResources"})
		if err != nil || len(evs.Items) == 0 {
			return false, nil
		}
		msg = evs.Items[len(evs.Items)-1].Message
		return true, nil
	})
	if err != nil {
		t.Fatalf("no FailedPrepareDynamicResources event: %v", err)
	}
	t.Logf("event: %s", msg)
	if !strings.Contains(msg, "NodePrepareResources failed for ResourceClaim") {
		t.Errorf("event %q is not a per-claim prepare failure from the plugin", msg)
	}
	if !invalidConfigError.MatchString(msg) {
		t.Errorf("event %q does not explain the invalid config (want %s)", msg, invalidConfigError)
	}
	cur, err := e.client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
	if err == nil && cur.Status.Phase != v1.PodPending {
		t.Errorf("pod phase %s, want Pending", cur.Status.Phase)
	}
}
