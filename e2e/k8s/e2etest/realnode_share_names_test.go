package e2etest

// Issue 39 item 0 on the real node: one claim whose two requests take shares of one GPU (matchAttribute on
// its uuid, as consumable capacity allows) must run. containerd refuses a CDI spec that names one device
// twice, so each share is a CDI device of its own, with its own MPS limits, in the container that asks for
// that request.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

func TestRealNodeOneClaimWithTwoSharesOfOneGPURunsWithACDIDeviceAndLimitsPerShare(t *testing.T) {
	rn := realNode(t)
	installChart(t, rn)
	waitChartPods(t, "plugin and MPS supervisor pods Ready on "+rn.name, "kubelet-plugin", "mps-supervisor")
	waitFor(t, "ResourceSlices for "+rn.name, 2*time.Minute, func(ctx context.Context) (bool, string) {
		n := countDevices(t, rn.name, wholeGPUName)
		return n == rn.gpus-1, fmt.Sprintf("%d of %d whole GPUs published", n, rn.gpus-1)
	})

	ns := namespace(t, "real-node-share-pair")
	class := sharedClass(t)
	share := func(name, memory, compute string) resourcev1.DeviceRequest {
		return resourcev1.DeviceRequest{Name: name, Exactly: &resourcev1.ExactDeviceRequest{
			DeviceClassName: class, AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: 1,
			Capacity: &resourcev1.CapacityRequirements{Requests: map[resourcev1.QualifiedName]resource.Quantity{
				"memory": resource.MustParse(memory), "compute": resource.MustParse(compute)}},
		}}
	}
	tmpl := &resourcev1.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: "pair", Namespace: ns},
		Spec: resourcev1.ResourceClaimTemplateSpec{Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{share("small", "5Gi", "10"), share("large", "20Gi", "30")},
			Constraints: []resourcev1.DeviceConstraint{{
				MatchAttribute: ptr.To(resourcev1.FullyQualifiedName(driver + "/uuid")),
			}},
		}}},
	}
	if _, err := e.client.ResourceV1().ResourceClaimTemplates(ns).Create(ctxFor(t, 30*time.Second), tmpl, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create ResourceClaimTemplate %s/pair: %v", ns, err)
	}
	// The check container gets the small share only, the holding one the large: each sees its own limits.
	w := workloadPod(ns, "pair", rn.name).withClaimFrom("pair")
	w.pod.Spec.InitContainers[0].Resources.Claims = []v1.ResourceClaim{{Name: "gpu", Request: "small"}}
	w.pod.Spec.Containers[0].Resources.Claims = []v1.ResourceClaim{{Name: "gpu", Request: "large"}}
	w.create(t)
	p := waitRunning(t, ns, "pair", 3*time.Minute)

	claim, results := realAllocations(t, p)
	if len(results) != 2 || results[0].Device != results[1].Device ||
		results[0].ShareID == nil || results[1].ShareID == nil || *results[0].ShareID == *results[1].ShareID {
		t.Fatalf("allocated %v, want two shares of one shared GPU with their own share ids", results)
	}
	var want []string
	for _, r := range results {
		want = append(want, fmt.Sprintf("%s-%s-%s", claim.UID, r.Device, *r.ShareID))
	}
	sort.Strings(want)
	files := rn.cdiSpecsFor(t, claim.UID)
	if len(files) != 1 {
		t.Fatalf("CDI specs naming claim %s: %v, want one", claim.UID, files)
	}
	data, err := os.ReadFile(filepath.Join(rn.cdiDir, files[0]))
	if err != nil {
		t.Fatal(err)
	}
	var spec struct {
		Devices []struct {
			Name string `json:"name"`
		} `json:"devices"`
	}
	if err := json.Unmarshal(data, &spec); err != nil {
		t.Fatalf("parse %s: %v", files[0], err)
	}
	var names []string
	for _, d := range spec.Devices {
		names = append(names, d.Name)
	}
	sort.Strings(names)
	if fmt.Sprint(names) != fmt.Sprint(want) {
		t.Errorf("%s names CDI devices %v, want %v: one per share", files[0], names, want)
	}

	v := insideView(t, p)
	if got := v.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]; got != "10" {
		t.Errorf("the small share's container: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%q, want 10\n%s", got, v.raw)
	}
	if got := mpsLimitBytes(v.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]); got != 5<<30 {
		t.Errorf("the small share's container: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=%q, want 5Gi\n%s", v.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], v.raw)
	}

	deletePod(t, ns, "pair")
	waitGone(t, ns, "pair", 2*time.Minute)
	waitFor(t, "the claim's CDI spec removed", time.Minute, func(context.Context) (bool, string) {
		left := rn.cdiSpecsFor(t, claim.UID)
		return len(left) == 0, fmt.Sprintf("left: %v", left)
	})
}
