package e2etest

// Issue 26 item 4, issue 41 item 4: quota with Kueue. Kueue v0.19.2's manager (the kueue add-on,
// e2e/scripts/kueue.sh) charges tessera's DRA claims to a ClusterQueue's quota through its deviceClassMappings:
// gpu.tessera.dev -> tessera.dev/gpu by device count, shared.gpu.tessera.dev -> tessera.dev/gpu-share-memory
// by the `memory` capacity each share consumes (a capacity source, KueueDRAIntegrationConsumableCapacity), and
// the MIG classes -> tessera.dev/mig-memory by the `memory` counter a placement consumes (a counter source,
// KueueDRAIntegrationPartitionableDevices; published while the scenario runs by the GpuPolicy option
// dynamicMig.quotaCounters: [memory]). The queues and the Job are the example's (e2e/manifests/kueue/, shown in
// deployments/examples/kueue/README.md); the Jobs run the CUDA probe on the real node.
//
// Asserted, as the user sees it (`kubectl get workloads`, the Workload's conditions, `kubectl logs`): the
// team's first whole-GPU Job is admitted, charged 1 tessera.dev/gpu, and its pod makes a CUDA context on
// the GPU; the second waits with Kueue's "insufficient unused quota for tessera.dev/gpu" and has no pod;
// when the first finishes, the second is admitted and runs. A Job asking for nvidia.com/gpu (no claim; the
// class's extendedResourceName) is charged to the same tessera.dev/gpu quota, and a claim with a CEL selector
// (refused by v0.17) waits behind it and then runs. Shares: a 10Gi share is charged 10Gi of the team's 40Gi,
// a 40Gi one (with an MPS GpuConfig, refused by v0.17) waits for "more needed" and runs once the first ends.
// MIG: a `profile == "3g.40gb"` claim is charged its placement's memory (40448Mi on an H100) of the team's
// 80Gi; a class-only claim, charged the largest placement's (7g.80gb, 81152Mi), waits for "more needed" and
// runs once the 3g ends. Still refused, no pod: a pod naming a ResourceClaim, and an nvidia.com/gpu Job that
// sets only limits (Kueue charges it as nvidia.com/gpu, which the ClusterQueue does not cover). The
// whole-GPU, share, MIG and refusal parts run side by side: their quotas and GPUs are separate.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/utils/ptr"

	"tessera.dev/e2e/internal/cluster"
)

var (
	workloadGVR       = schema.GroupVersionResource{Group: "kueue.x-k8s.io", Version: "v1beta2", Resource: "workloads"}
	clusterQueueGVR   = schema.GroupVersionResource{Group: "kueue.x-k8s.io", Version: "v1beta2", Resource: "clusterqueues"}
	resourceFlavorGVR = schema.GroupVersionResource{Group: "kueue.x-k8s.io", Version: "v1beta2", Resource: "resourceflavors"}
)

const (
	queueNameLabel = "kueue.x-k8s.io/queue-name"
	// The Jobs' container: the CUDA probe's device and context lines, then (holding) it waits until the test
	// writes /tmp/finish into it, as a training step runs until it is done.
	probeThenExit = `cuda-probe 2>&1 | grep -E '^cuda\.(device|ctx)'; echo done`
	probeThenHold = `cuda-probe 2>&1 | grep -E '^cuda\.(device|ctx)'; while [ ! -e /tmp/finish ]; do sleep 1; done; echo done`
)

func kueueAddon(t *testing.T) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(e.runDir, "kueue", "config.yaml")); err != nil {
		t.Fatalf("the kueue add-on is not running (%v): run through `make e2e` (ADDONS=autoscaling,kueue, its default) or `make up ADDONS=kueue`", err)
	}
}

// kueueFixture reads e2e/manifests/kueue/<name> and checks that the example's README shows it verbatim.
func kueueFixture(t *testing.T, name string) []*unstructured.Unstructured {
	t.Helper()
	path := filepath.Join(e.repoRoot, "e2e", "manifests", "kueue", name)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(e.repoRoot, "deployments", "examples", "kueue", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), string(data)) {
		t.Errorf("deployments/examples/kueue/README.md does not show e2e/manifests/kueue/%s verbatim", name)
	}
	objs, err := cluster.ReadManifests(path)
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

// kueueJob is the example's Job (e2e/manifests/kueue/job.yaml) named `name` in ns, pinned to the node, its
// container the CUDA probe image running cmd, its claim from `template`.
func kueueJob(t *testing.T, example *unstructured.Unstructured, ns, name, node, template, cmd string) *batchv1.Job {
	t.Helper()
	var j batchv1.Job
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(example.UnstructuredContent(), &j); err != nil {
		t.Fatalf("the example Job: %v", err)
	}
	if j.Labels[queueNameLabel] == "" || j.Spec.Suspend == nil || !*j.Spec.Suspend {
		t.Fatalf("the example Job must be suspended and carry %s (no Kueue webhook sets them here)", queueNameLabel)
	}
	j.ObjectMeta = metav1.ObjectMeta{Name: name, Namespace: ns, Labels: j.Labels}
	spec := &j.Spec.Template.Spec
	spec.NodeSelector = map[string]string{"kubernetes.io/hostname": node}
	spec.TerminationGracePeriodSeconds = ptr.To[int64](1)
	spec.Containers[0].Image, spec.Containers[0].ImagePullPolicy = probeImage, v1.PullNever
	spec.Containers[0].Command = []string{"sh", "-c", cmd}
	if template != "" {
		spec.ResourceClaims[0].ResourceClaimTemplateName = ptr.To(template)
	}
	return &j
}

// legacyJob is the example Job without a claim, its container asking for nvidia.com/gpu: 1 in its limits and,
// with requests, in its requests too (Kueue v0.19.2 reads only requests for DRA-backed extended resources:
// NeedsDRAReconcile in pkg/dra/extended_resources.go).
func legacyJob(t *testing.T, example *unstructured.Unstructured, ns, name, node string, requests bool) *batchv1.Job {
	t.Helper()
	j := kueueJob(t, example, ns, name, node, "", probeThenHold)
	j.Spec.Template.Spec.ResourceClaims = nil
	gpu := v1.ResourceList{"nvidia.com/gpu": resource.MustParse("1")}
	j.Spec.Template.Spec.Containers[0].Resources = v1.ResourceRequirements{Limits: gpu}
	if requests {
		j.Spec.Template.Spec.Containers[0].Resources.Requests = gpu
	}
	return j
}

func createJob(t *testing.T, j *batchv1.Job) {
	t.Helper()
	if _, err := e.client.BatchV1().Jobs(j.Namespace).Create(ctxFor(t, 30*time.Second), j, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create Job %s/%s: %v", j.Namespace, j.Name, err)
	}
}

// kueueWorkload is what `kubectl get workload` shows of the Workload Kueue made for a Job.
type kueueWorkload struct {
	name       string
	conditions map[string]metav1.Condition
	usage      map[string]string // status.admission.podSetAssignments[0].resourceUsage
}

func (w kueueWorkload) String() string {
	var cs []string
	for _, c := range w.conditions {
		cs = append(cs, fmt.Sprintf("%s=%s(%s: %s)", c.Type, c.Status, c.Reason, c.Message))
	}
	return fmt.Sprintf("%s %v usage %v", w.name, cs, w.usage)
}

func workloadOf(ctx context.Context, ns, job string) (kueueWorkload, error) {
	list, err := e.dyn.Resource(workloadGVR).Namespace(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return kueueWorkload{}, err
	}
	for _, u := range list.Items {
		for _, o := range u.GetOwnerReferences() {
			if o.Kind != "Job" || o.Name != job {
				continue
			}
			w := kueueWorkload{name: u.GetName(), conditions: map[string]metav1.Condition{}, usage: map[string]string{}}
			conds, _, _ := unstructured.NestedSlice(u.Object, "status", "conditions")
			for _, c := range conds {
				var cond metav1.Condition
				if runtime.DefaultUnstructuredConverter.FromUnstructured(c.(map[string]any), &cond) == nil {
					w.conditions[cond.Type] = cond
				}
			}
			psa, _, _ := unstructured.NestedSlice(u.Object, "status", "admission", "podSetAssignments")
			if len(psa) > 0 {
				usage, _, _ := unstructured.NestedStringMap(psa[0].(map[string]any), "resourceUsage")
				for k, v := range usage {
					w.usage[k] = v
				}
			}
			return w, nil
		}
	}
	return kueueWorkload{}, fmt.Errorf("no Workload owned by Job %s yet", job)
}

// waitWorkload waits until the Job's Workload has condition `typ` with `status` and a message matching msg.
func waitWorkload(t *testing.T, ns, job, typ string, status metav1.ConditionStatus, msg string, timeout time.Duration) kueueWorkload {
	t.Helper()
	var w kueueWorkload
	waitFor(t, fmt.Sprintf("Job %s's Workload %s=%s %q", job, typ, status, msg), timeout, func(ctx context.Context) (bool, string) {
		var err error
		if w, err = workloadOf(ctx, ns, job); err != nil {
			return false, err.Error()
		}
		c, ok := w.conditions[typ]
		return ok && c.Status == status && strings.Contains(c.Message, msg), w.String()
	})
	return w
}

func jobPods(t *testing.T, ns, job string) []v1.Pod {
	t.Helper()
	list, err := e.client.CoreV1().Pods(ns).List(ctxFor(t, 30*time.Second), metav1.ListOptions{LabelSelector: "batch.kubernetes.io/job-name=" + job})
	if err != nil {
		t.Fatal(err)
	}
	return list.Items
}

// waitJobPodRunning waits for the Job's one pod to run and for its CUDA probe's context line; returns the
// pod and the device's UUID as CUDA reports it.
func waitJobPodRunning(t *testing.T, ns, job string) (*v1.Pod, string) {
	t.Helper()
	var p *v1.Pod
	var log string
	waitFor(t, "Job "+job+"'s pod running with a CUDA context", 3*time.Minute, func(ctx context.Context) (bool, string) {
		list, err := e.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "batch.kubernetes.io/job-name=" + job})
		if err != nil || len(list.Items) != 1 {
			return false, fmt.Sprintf("%d pods (err %v)", len(list.Items), err)
		}
		p = &list.Items[0]
		if p.Status.Phase != v1.PodRunning && p.Status.Phase != v1.PodSucceeded {
			return false, cluster.PodProblem(ctx, e.client, p)
		}
		log, err = podLogs(ctx, p, p.Spec.Containers[0].Name, false)
		return err == nil && readyCtx.MatchString(log), fmt.Sprintf("logs (err %v): %s", err, log)
	})
	return p, readyUUID.FindStringSubmatch(log)[1]
}

// finishJob ends a probeThenHold container: the test writes /tmp/finish into its root.
func finishJob(t *testing.T, rn realNodeEnv, p *v1.Pod) {
	t.Helper()
	finish := filepath.Join("/proc", fmt.Sprint(rn.containerPID(t, p, p.Spec.Containers[0].Name)), "root", "tmp", "finish")
	if err := os.WriteFile(finish, nil, 0o644); err != nil {
		t.Fatalf("finish %s: %v", p.Name, err)
	}
}

func waitJobComplete(t *testing.T, ns, job string) {
	t.Helper()
	waitFor(t, "Job "+job+" Complete", 2*time.Minute, func(ctx context.Context) (bool, string) {
		j, err := e.client.BatchV1().Jobs(ns).Get(ctx, job, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, c := range j.Status.Conditions {
			if c.Type == batchv1.JobComplete && c.Status == v1.ConditionTrue {
				return true, ""
			}
		}
		return false, fmt.Sprintf("%+v", j.Status.Conditions)
	})
}

func TestKueueChargesATeamsGPUQuotaForTesseraClaimsAndQueuesItsSecondJob(t *testing.T) {
	rn := realNode(t)
	kueueAddon(t)
	installChart(t, rn)
	waitChartPods(t, "the plugin and MPS supervisor pods Ready on "+rn.name, "kubelet-plugin", "mps-supervisor")

	queues := kueueFixture(t, "queues.yaml")
	jobExample := kueueFixture(t, "job.yaml")
	applier, err := cluster.NewApplier(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Cluster-scoped: removed after the namespace (cleanups run last-in first-out), once no Workload holds them.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, o := range queues {
			var err error
			switch o.GetKind() {
			case "ClusterQueue":
				err = e.dyn.Resource(clusterQueueGVR).Delete(ctx, o.GetName(), metav1.DeleteOptions{})
			case "ResourceFlavor":
				err = e.dyn.Resource(resourceFlavorGVR).Delete(ctx, o.GetName(), metav1.DeleteOptions{})
			}
			if err != nil && !apierrors.IsNotFound(err) {
				t.Errorf("delete %s %s: %v", o.GetKind(), o.GetName(), err)
			}
		}
	})
	// The MIG part's counter source reads the `memory` counter, which a dynamicMig rule publishes only with
	// quotaCounters: [memory] (off by default: a device/counter pair more per device for kube-scheduler).
	// Put back at cleanup, after the namespace is gone.
	changePolicy(t, func(m map[string]any) {
		if mig, ok := m["dynamicMig"].(map[string]any); ok {
			mig["quotaCounters"] = []any{"memory"}
		}
	})
	waitFor(t, "the real node's MIG devices consume the memory counter", time.Minute, func(ctx context.Context) (bool, string) {
		devs, err := counterDevices(ctx, rn.name)
		if err != nil || len(devs) == 0 {
			return false, fmt.Sprintf("%d devices consuming counters (err %v)", len(devs), err)
		}
		for _, d := range devs {
			if _, ok := d.ConsumesCounters[0].Counters["memory"]; !ok {
				return false, d.Name + " consumes no memory"
			}
		}
		return true, ""
	})
	ns := namespace(t, "kueue-team-a")
	for _, o := range queues {
		if o.GetKind() == "LocalQueue" {
			o.SetNamespace(ns)
		}
	}
	var example, template *unstructured.Unstructured
	for _, o := range jobExample {
		o.SetNamespace(ns)
		switch o.GetKind() {
		case "Job":
			example = o
		case "ResourceClaimTemplate":
			template = o
		}
	}
	if example == nil || template == nil {
		t.Fatal("e2e/manifests/kueue/job.yaml must hold a ResourceClaimTemplate and a Job")
	}
	if err := applier.Apply(ctxFor(t, time.Minute), append(queues, template), ns); err != nil {
		t.Fatalf("apply the example's queues and ResourceClaimTemplate: %v", err)
	}
	wholeGPU := template.GetName()

	// Each part runs in parallel with the others: separate quotas, separate GPUs.
	t.Run("the second whole-GPU Job waits for the first's quota", func(t *testing.T) {
		t.Parallel()
		createJob(t, kueueJob(t, example, ns, "train-1", rn.name, wholeGPU, probeThenHold))
		w := waitWorkload(t, ns, "train-1", "Admitted", metav1.ConditionTrue, "", 2*time.Minute)
		if w.usage["tessera.dev/gpu"] != "1" {
			t.Errorf("train-1's Workload charged %v, want tessera.dev/gpu 1", w.usage)
		}
		p1, uuid1 := waitJobPodRunning(t, ns, "train-1")
		t.Logf("train-1: %s; pod %s runs on %s", w, p1.Name, uuid1)

		createJob(t, kueueJob(t, example, ns, "train-2", rn.name, wholeGPU, probeThenHold))
		w = waitWorkload(t, ns, "train-2", "QuotaReserved", metav1.ConditionFalse,
			"insufficient unused quota for tessera.dev/gpu in flavor tessera-gpus, 1 more needed", time.Minute)
		t.Logf("train-2 waits: %s", w)
		assertWaiting(t, ns, "train-2")

		// train-1 finishes: its training step ends.
		finishJob(t, rn, p1)
		finished := time.Now()
		waitJobComplete(t, ns, "train-1")
		w = waitWorkload(t, ns, "train-2", "Admitted", metav1.ConditionTrue, "", 2*time.Minute)
		admitted := time.Since(finished)
		if w.usage["tessera.dev/gpu"] != "1" {
			t.Errorf("train-2's Workload charged %v, want tessera.dev/gpu 1", w.usage)
		}
		p2, uuid2 := waitJobPodRunning(t, ns, "train-2")
		t.Logf("train-2 admitted %.1f s after train-1 finished, running %.1f s after: pod %s on %s", admitted.Seconds(), time.Since(finished).Seconds(), p2.Name, uuid2)
		finishJob(t, rn, p2)
		waitJobComplete(t, ns, "train-2")

		// No claim: kube-scheduler serves nvidia.com/gpu from gpu.tessera.dev (its extendedResourceName), and
		// KueueDRAIntegrationExtendedResource charges it to that class's mapped resource.
		createJob(t, legacyJob(t, example, ns, "legacy-1", rn.name, true))
		w = waitWorkload(t, ns, "legacy-1", "Admitted", metav1.ConditionTrue, "", 2*time.Minute)
		if len(w.usage) != 1 || w.usage["tessera.dev/gpu"] != "1" {
			t.Errorf("legacy-1's Workload charged %v, want only tessera.dev/gpu 1", w.usage)
		}
		p, uuid := waitJobPodRunning(t, ns, "legacy-1")
		t.Logf("legacy-1: %s; pod %s runs on %s", w, p.Name, uuid)

		// A CEL selector (v0.17 refused it): v0.19.2 checks it matches a published device
		// (validateCELSelectorsAgainstDevices, pkg/dra/claims.go) and counts the device as before.
		h100 := claimTemplate(t, ns, "whole-h100", "gpu.tessera.dev", selector(`device.attributes["gpu.tessera.dev"].productName.startsWith("NVIDIA H100")`))
		createJob(t, kueueJob(t, example, ns, "pick-h100", rn.name, h100, probeThenExit))
		w = waitWorkload(t, ns, "pick-h100", "QuotaReserved", metav1.ConditionFalse,
			"insufficient unused quota for tessera.dev/gpu in flavor tessera-gpus, 1 more needed", time.Minute)
		t.Logf("pick-h100 waits: %s", w)
		finishJob(t, rn, p)
		waitJobComplete(t, ns, "legacy-1")
		w = waitWorkload(t, ns, "pick-h100", "Admitted", metav1.ConditionTrue, "", 2*time.Minute)
		if len(w.usage) != 1 || w.usage["tessera.dev/gpu"] != "1" {
			t.Errorf("pick-h100's Workload charged %v, want only tessera.dev/gpu 1", w.usage)
		}
		waitJobPodRunning(t, ns, "pick-h100")
		waitJobComplete(t, ns, "pick-h100")
	})

	t.Run("shares are charged the memory they claim", func(t *testing.T) {
		t.Parallel()
		small := claimTemplate(t, ns, "share-10gi-25pct", "shared.gpu.tessera.dev", capacity(map[string]string{"memory": "10Gi", "compute": "25"}))
		// A GpuConfig (v0.17 refused any device config): v0.19.2 reads only the requests (countDevicesPerClass,
		// pkg/dra/claims.go).
		config := `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"defaultActiveThreadPercentage":50,"defaultPinnedDeviceMemoryLimit":"40Gi"}}}`
		big := claimTemplate(t, ns, "share-40gi-mps", "shared.gpu.tessera.dev", capacity(map[string]string{"memory": "40Gi", "compute": "50"}), opaqueConfig(config))

		createJob(t, kueueJob(t, example, ns, "infer-10gi", rn.name, small, probeThenHold))
		w := waitWorkload(t, ns, "infer-10gi", "Admitted", metav1.ConditionTrue, "", 2*time.Minute)
		assertCharged(t, "infer-10gi", w, "tessera.dev/gpu-share-memory", "10Gi")
		p, uuid := waitJobPodRunning(t, ns, "infer-10gi")
		t.Logf("infer-10gi: %s; pod %s runs on %s", w, p.Name, uuid)

		// 10Gi of 40Gi taken: a 40Gi share waits, though a device count (v0.17) would have let it in.
		createJob(t, kueueJob(t, example, ns, "infer-40gi", rn.name, big, probeThenExit))
		w = waitWorkload(t, ns, "infer-40gi", "QuotaReserved", metav1.ConditionFalse,
			"insufficient unused quota for tessera.dev/gpu-share-memory in flavor tessera-gpus", time.Minute)
		t.Logf("infer-40gi waits: %s", w)
		assertWaiting(t, ns, "infer-40gi")

		finishJob(t, rn, p)
		waitJobComplete(t, ns, "infer-10gi")
		w = waitWorkload(t, ns, "infer-40gi", "Admitted", metav1.ConditionTrue, "", 2*time.Minute)
		assertCharged(t, "infer-40gi", w, "tessera.dev/gpu-share-memory", "40Gi")
		_, uuid = waitJobPodRunning(t, ns, "infer-40gi")
		waitJobComplete(t, ns, "infer-40gi")
		t.Logf("infer-40gi: %s; ran on %s", w, uuid)
	})

	t.Run("a MIG claim is charged its memory and waits for the team's MIG memory", func(t *testing.T) {
		t.Parallel()
		// A counter source on `memory` charges the largest amount of it among the devices a request can match
		// (computeCounterCharges, pkg/dra/counters.go): a claim naming a profile is charged that profile's
		// memory, a class-only one the largest placement's.
		mig3g := claimTemplate(t, ns, "mig-3g", "mig.gpu.tessera.dev", selector(`device.attributes["gpu.tessera.dev"].profile == "3g.40gb"`))
		anyMIG := claimTemplate(t, ns, "mig-any", "mig.gpu.tessera.dev")
		want3g, wantLargest := migMemoryConsumed(t, rn.name, "3g.40gb"), migMemoryConsumed(t, rn.name, "")

		createJob(t, kueueJob(t, example, ns, "finetune-3g", rn.name, mig3g, probeThenHold))
		w := waitWorkload(t, ns, "finetune-3g", "Admitted", metav1.ConditionTrue, "", 2*time.Minute)
		assertCharged(t, "finetune-3g", w, "tessera.dev/mig-memory", want3g.String())
		p, uuid := waitJobPodRunning(t, ns, "finetune-3g")
		t.Logf("finetune-3g: %s; pod %s runs on %s", w, p.Name, uuid)

		// The 3g's memory taken: a class-only claim, charged the largest placement's (about the whole 80Gi),
		// waits though a 1g slice would be free on the GPU.
		createJob(t, kueueJob(t, example, ns, "finetune-mig", rn.name, anyMIG, probeThenExit))
		w = waitWorkload(t, ns, "finetune-mig", "QuotaReserved", metav1.ConditionFalse,
			"insufficient unused quota for tessera.dev/mig-memory in flavor tessera-gpus", time.Minute)
		if !strings.Contains(w.conditions["QuotaReserved"].Message, "more needed") {
			t.Errorf("finetune-mig waits without saying how much more it needs: %s", w)
		}
		t.Logf("finetune-mig waits: %s", w)
		assertWaiting(t, ns, "finetune-mig")

		finishJob(t, rn, p)
		waitJobComplete(t, ns, "finetune-3g")
		w = waitWorkload(t, ns, "finetune-mig", "Admitted", metav1.ConditionTrue, "", 2*time.Minute)
		assertCharged(t, "finetune-mig", w, "tessera.dev/mig-memory", wantLargest.String())
		_, uuid = waitJobPodRunning(t, ns, "finetune-mig")
		waitJobComplete(t, ns, "finetune-mig")
		t.Logf("finetune-mig: %s; ran on %s", w, uuid)
	})

	t.Run("claims Kueue v0.19.2 cannot charge are refused", func(t *testing.T) {
		t.Parallel()
		claim := &resourcev1.ResourceClaim{
			ObjectMeta: metav1.ObjectMeta{Name: "shared-gpu", Namespace: ns},
			Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{Requests: []resourcev1.DeviceRequest{{
				Name: "gpu", Exactly: &resourcev1.ExactDeviceRequest{DeviceClassName: "gpu.tessera.dev", AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: 1},
			}}}},
		}
		if _, err := e.client.ResourceV1().ResourceClaims(ns).Create(ctxFor(t, 30*time.Second), claim, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create ResourceClaim: %v", err)
		}
		named := kueueJob(t, example, ns, "uses-claim", rn.name, wholeGPU, probeThenExit)
		named.Spec.Template.Spec.ResourceClaims[0] = v1.PodResourceClaim{Name: "gpu", ResourceClaimName: ptr.To(claim.Name)}
		for _, c := range []struct {
			job         *batchv1.Job
			reason, msg string
		}{
			{named, "Inadmissible", "KueueDRAIntegration feature does not support use of resource claims"},
			// nvidia.com/gpu in limits only: Kueue charges it as nvidia.com/gpu, which no ClusterQueue here covers.
			{legacyJob(t, example, ns, "legacy-limits-only", rn.name, false), "Pending", "resource nvidia.com/gpu unavailable in ClusterQueue"},
		} {
			createJob(t, c.job)
			w := waitWorkload(t, ns, c.job.Name, "QuotaReserved", metav1.ConditionFalse, c.msg, time.Minute)
			if r := w.conditions["QuotaReserved"].Reason; r != c.reason {
				t.Errorf("%s: QuotaReserved reason %s, want %s", c.job.Name, r, c.reason)
			}
			t.Logf("%s refused: %s", c.job.Name, w.conditions["QuotaReserved"].Message)
			assertWaiting(t, ns, c.job.Name)
		}
	})
}

// assertWaiting: a Job whose Workload Kueue has not admitted stays suspended, without pods.
func assertWaiting(t *testing.T, ns, job string) {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	if w, err := workloadOf(ctx, ns, job); err != nil || w.conditions["Admitted"].Status == metav1.ConditionTrue {
		t.Fatalf("%s admitted while it should wait: %v %v", job, w, err)
	}
	j, err := e.client.BatchV1().Jobs(ns).Get(ctx, job, metav1.GetOptions{})
	if err != nil || j.Spec.Suspend == nil || !*j.Spec.Suspend {
		t.Errorf("%s not suspended while it waits (err %v)", job, err)
	}
	if pods := jobPods(t, ns, job); len(pods) != 0 {
		t.Errorf("%s has %d pods while it waits", job, len(pods))
	}
}

// assertCharged: the Workload's usage is `want` of `res` and nothing else (compared as quantities: Kueue may
// print bytes in either form).
func assertCharged(t *testing.T, job string, w kueueWorkload, res, want string) {
	t.Helper()
	got, err := resource.ParseQuantity(w.usage[res])
	if len(w.usage) != 1 || err != nil || got.Cmp(resource.MustParse(want)) != 0 {
		t.Errorf("%s's Workload charged %v, want only %s %s", job, w.usage, res, want)
	}
}

// counterDevices: the devices of node's slices that consume counters (dynamic MIG's placements and whole GPUs).
func counterDevices(ctx context.Context, node string) ([]resourcev1.Device, error) {
	slices, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		return nil, err
	}
	var out []resourcev1.Device
	for _, s := range slices.Items {
		for _, d := range s.Spec.Devices {
			if len(d.ConsumesCounters) > 0 {
				out = append(out, d)
			}
		}
	}
	return out, nil
}

// migMemoryConsumed: the largest `memory` counter a MIG placement of node consumes, of the profile named
// (all profiles for ""); each placement's must be its `memory` capacity, the profile's memory.
func migMemoryConsumed(t *testing.T, node, profile string) resource.Quantity {
	t.Helper()
	devs, err := counterDevices(ctxFor(t, 30*time.Second), node)
	if err != nil {
		t.Fatal(err)
	}
	var largest resource.Quantity
	for _, d := range devs {
		a := d.Attributes["profile"]
		if a.StringValue == nil || (profile != "" && *a.StringValue != profile) {
			continue
		}
		got := d.ConsumesCounters[0].Counters["memory"].Value
		if c := d.Capacity["memory"].Value; got.Cmp(c) != 0 {
			t.Errorf("%s consumes %s of the memory counter, has %s of memory", d.Name, got.String(), c.String())
		}
		if got.Cmp(largest) > 0 {
			largest = got
		}
	}
	if largest.IsZero() {
		t.Fatalf("no MIG placement of profile %q on %s consumes the memory counter", profile, node)
	}
	return largest
}
