package e2etest

import (
	"context"
	"fmt"
	"sort"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"tessera.dev/e2e/internal/cluster"
)

// legacyResource is the extended resource tessera's whole-GPU DeviceClass serves
// (deployments/classes/gpu.tessera.dev.yaml, applied by `make up`).
const legacyResource = v1.ResourceName("nvidia.com/gpu")

// legacyPod is a device-plugin-era pod: the container asks for GPUs as an extended resource and the pod
// names no ResourceClaim.
func legacyPod(t *testing.T, ns, name string, gpus int64) *v1.Pod {
	t.Helper()
	q := *resource.NewQuantity(gpus, resource.DecimalSI)
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			Containers: []v1.Container{{
				Name: "cuda", Image: "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04",
				Resources: v1.ResourceRequirements{Limits: v1.ResourceList{legacyResource: q}},
			}},
			TerminationGracePeriodSeconds: ptr.To[int64](1),
		},
	}
	created, err := e.client.CoreV1().Pods(ns).Create(ctxFor(t, 30*time.Second), p, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", ns, name, err)
	}
	return created
}

// (g) A pod written for NVIDIA's device plugin (`limits: {nvidia.com/gpu: 2}`, no claim) runs on tessera:
// kube-scheduler creates a claim for it from the DeviceClass that carries extendedResourceName
// nvidia.com/gpu and allocates two whole GPUs of one node, the kubelet's DRA manager prepares the claim it
// finds in pod.status.extendedResourceClaimStatus, and the container gets both GPUs' CDI devices.
func TestALegacyPodAskingForTwoNvidiaGPUsGetsTwoTesseraGPUs(t *testing.T) {
	ns := namespace(t, "e2e-legacy")
	p := waitRunning(t, ns, legacyPod(t, ns, "legacy", 2).Name, 2*time.Minute)

	st := p.Status.ExtendedResourceClaimStatus
	if st == nil || st.ResourceClaimName == "" {
		t.Fatalf("running pod has no extendedResourceClaimStatus (%+v): the scheduler did not serve %s through DRA", st, legacyResource)
	}
	mapped := false
	for _, m := range st.RequestMappings {
		mapped = mapped || (m.ContainerName == "cuda" && m.ResourceName == string(legacyResource))
	}
	if !mapped {
		t.Errorf("extendedResourceClaimStatus.requestMappings %+v do not map container cuda's %s", st.RequestMappings, legacyResource)
	}

	allocs := allocations(t, p)
	if len(allocs) != 2 {
		t.Fatalf("pod got %d %s devices, want 2", len(allocs), driver)
	}
	claim := allocs[0].claim
	if claim.Name != st.ResourceClaimName {
		t.Errorf("allocated claim %s, want the one in extendedResourceClaimStatus %s", claim.Name, st.ResourceClaimName)
	}
	owned := false
	for _, o := range claim.OwnerReferences {
		owned = owned || (o.Kind == "Pod" && o.UID == p.UID)
	}
	if !owned {
		t.Errorf("claim %s is not owned by pod %s (owners %+v): it would outlive the pod", claim.Name, p.Name, claim.OwnerReferences)
	}

	var devices, wantPaths []string
	env := allocs[0].edits.EnvMap()
	if env["NVIDIA_VISIBLE_DEVICES"] != "void" {
		t.Errorf("container cuda's NVIDIA_VISIBLE_DEVICES=%q, want void (the CDI spec carries both GPUs)", env["NVIDIA_VISIBLE_DEVICES"])
	}
	for _, a := range allocs {
		if !wholeGPUName.MatchString(a.result.Device) {
			t.Errorf("allocated %q, want a whole GPU gpu-<i> (the class with extendedResourceName is gpu.tessera.dev)", a.result.Device)
		}
		if a.result.Pool != p.Spec.NodeName {
			t.Errorf("device %s from pool %q, want the pod's node %q", a.result.Device, a.result.Pool, p.Spec.NodeName)
		}
		if !contains(a.edits.CDIDevices, cdiID(a)) {
			t.Errorf("container cuda's CDI devices %v do not include %s", a.edits.CDIDevices, cdiID(a))
		}
		dev := sliceDevice(t, p.Spec.NodeName, a.result.Device)
		// Each GPU's UUID under its own key: the env merge of the two devices keeps both.
		if key, uuid := uuidEnvKey(a.result.Device), attr(dev, "uuid").StringValue; uuid == nil || env[key] != *uuid {
			t.Errorf("container cuda's %s=%q, want the slice's uuid attribute %v", key, env[key], uuid)
		}
		minor := attr(dev, "minor").IntValue
		if minor == nil {
			t.Fatalf("device %s has no minor attribute", a.result.Device)
		}
		devices = append(devices, a.result.Device)
		wantPaths = append(wantPaths, fmt.Sprintf("/dev/nvidia%d", *minor))
	}
	if devices[0] == devices[1] {
		t.Errorf("both requests got %s, want two different GPUs", devices[0])
	}
	paths := allocs[0].edits.DevicePaths()
	for _, want := range append(wantPaths, "/dev/nvidiactl") {
		if !contains(paths, want) {
			t.Errorf("container cuda's device nodes %v lack %s", paths, want)
		}
	}
	if files := cdiSpecsMentioning(t, p.Spec.NodeName, string(claim.UID)); len(files) == 0 {
		t.Errorf("no CDI spec for claim %s in %s's CDI dir", claim.UID, p.Spec.NodeName)
	}
	sort.Strings(devices)
	t.Logf("pod %s on %s: claim %s, devices %v, CDI devices %v", p.Name, p.Spec.NodeName, claim.Name, devices, allocs[0].edits.CDIDevices)

	// Deleting the pod unprepares the claim and the garbage collector removes the claim the scheduler made.
	deletePod(t, ns, p.Name)
	waitGone(t, ns, p.Name, time.Minute)
	if files := cdiSpecsMentioning(t, p.Spec.NodeName, string(claim.UID)); len(files) != 0 {
		t.Errorf("CDI spec(s) %v of claim %s still on %s after the pod was deleted", files, claim.UID, p.Spec.NodeName)
	}
	ctx := ctxFor(t, time.Minute)
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 45*time.Second, true, func(ctx context.Context) (bool, error) {
		_, err := e.client.ResourceV1().ResourceClaims(ns).Get(ctx, claim.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	if err != nil {
		t.Errorf("claim %s/%s still exists 45s after its pod was deleted", ns, claim.Name)
	}
}

// A legacy pod asking for more GPUs than any node has stays Pending with the scheduler's reason instead
// of being half-served.
func TestALegacyPodAskingForMoreGPUsThanANodeHasStaysPending(t *testing.T) {
	ns := namespace(t, "e2e-legacy-surplus")
	p := legacyPod(t, ns, "too-many", int64(e.gpus)+1)
	ctx := ctxFor(t, time.Minute)
	var msg string
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 45*time.Second, true, func(ctx context.Context) (bool, error) {
		got, err := e.client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		if got.Spec.NodeName != "" {
			return false, fmt.Errorf("pod asking for %d %s was bound to %s", e.gpus+1, legacyResource, got.Spec.NodeName)
		}
		for _, c := range got.Status.Conditions {
			if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable {
				msg = c.Message
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("pod %s/%s: %v (want Unschedulable; %s)", ns, p.Name, err, cluster.PodProblem(ctx, e.client, p))
	}
	t.Logf("scheduler: %s", msg)
}
