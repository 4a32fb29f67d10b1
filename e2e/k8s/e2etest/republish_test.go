package e2etest

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

const retainedTaint = "gpu.tessera.dev/retained"

// publishedDevices is node's tessera devices by name, each with the keys of its taints.
func publishedDevices(ctx context.Context, node string) (map[string][]string, error) {
	slices, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node + ",spec.driver=" + driver})
	if err != nil {
		return nil, err
	}
	out := map[string][]string{}
	for _, s := range slices.Items {
		for _, d := range s.Spec.Devices {
			keys := []string{}
			for _, t := range d.Taints {
				keys = append(keys, t.Key)
			}
			out[d.Name] = keys
		}
	}
	return out, nil
}

func hasKey(keys []string, key string) bool {
	for _, k := range keys {
		if k == key {
			return true
		}
	}
	return false
}

// Issue 41 item 6: kube-scheduler counts a device's counters only while it finds the device in the slices
// (kubernetes/kubernetes#140802). A GpuPolicy change under a running 3g.40gb placement (memory slices 4-7)
// and a running share of GPU 1 — only 1g.10gb placements from now on, GPU 1 whole — keeps both published,
// tainted gpu.tessera.dev/retained, until their pods are gone: a 1g claim on slices 4-7 of that GPU, the
// whole GPU 1 and a new share of it stay pending while a 1g claim on slices 0-3 runs. Once the old pods are
// deleted the kept devices leave the slices and the pending claims are placed.
func TestPolicyChangeKeepsRunningClaimsDevicesUntilTheyAreReleased(t *testing.T) {
	ns := namespace(t, "republish")
	node := e.nodes[0]
	gpu := freeMigGPU(t, node)
	onGPU := fmt.Sprintf(`device.attributes[%q].index == %d`, driver, gpu)
	mig := func(profile, starts string) claimOpt {
		return selector(fmt.Sprintf(`%s && device.attributes[%q].profile == %q && device.attributes[%q].placementStart %s`,
			onGPU, driver, profile, driver, starts))
	}
	gpu1 := selector(fmt.Sprintf(`device.attributes[%q].index == 1`, driver))
	claimTemplate(t, ns, "mig-old", "mig.gpu.tessera.dev", mig("3g.40gb", "== 4"))
	claimTemplate(t, ns, "share-old", "shared.gpu.tessera.dev", gpu1, capacity(map[string]string{"memory": "10Gi"}))
	pod(t, ns, "mig-old", "mig-old", node)
	pod(t, ns, "share-old", "share-old", node)
	waitRunning(t, ns, "mig-old", time.Minute)
	waitRunning(t, ns, "share-old", time.Minute)

	kept := fmt.Sprintf("gpu-%d-mig-3g-40gb-4", gpu)
	small := regexp.MustCompile(fmt.Sprintf(`^gpu-%d-mig-1g-10gb-\d$`, gpu))
	changePolicy(t, func(rule map[string]any) {
		switch rule["name"] {
		case "gpu-1-shared":
			delete(rule, "shared")
			rule["whole"] = map[string]any{}
		case "dynamic-mig":
			rule["dynamicMig"] = map[string]any{"profiles": []any{"1g.10gb"}}
		}
	})
	waitFor(t, "the new policy on "+node+" with "+kept+" and gpu-1-shared kept, tainted", 30*time.Second, func(ctx context.Context) (bool, string) {
		devs, err := publishedDevices(ctx, node)
		if err != nil {
			return false, err.Error()
		}
		smalls := 0
		for name := range devs {
			if small.MatchString(name) {
				smalls++
			}
		}
		_, whole1 := devs["gpu-1"]
		ok := smalls > 0 && hasKey(devs[kept], retainedTaint) && hasKey(devs["gpu-1-shared"], retainedTaint) && !whole1
		return ok, fmt.Sprintf("%d 1g placements, %s taints %v, gpu-1-shared taints %v, gpu-1 published %v", smalls, kept, devs[kept], devs["gpu-1-shared"], whole1)
	})

	claimTemplate(t, ns, "mig-overlap", "mig.gpu.tessera.dev", mig("1g.10gb", ">= 4"))
	claimTemplate(t, ns, "mig-free", "mig.gpu.tessera.dev", mig("1g.10gb", "< 4"))
	claimTemplate(t, ns, "whole-1", gpuClass(t), gpu1)
	claimTemplate(t, ns, "share-new", "shared.gpu.tessera.dev", gpu1, capacity(map[string]string{"memory": "10Gi"}))
	for _, name := range []string{"mig-overlap", "mig-free", "whole-1", "share-new"} {
		pod(t, ns, name, name, node)
	}
	waitRunning(t, ns, "mig-free", time.Minute)
	for _, name := range []string{"mig-overlap", "whole-1", "share-new"} {
		t.Logf("%s: %s", name, waitUnschedulable(t, ns, name))
	}

	deletePod(t, ns, "mig-old")
	deletePod(t, ns, "share-old")
	waitFor(t, "the kept devices gone from "+node+" and gpu-1 published whole", 30*time.Second, func(ctx context.Context) (bool, string) {
		devs, err := publishedDevices(ctx, node)
		if err != nil {
			return false, err.Error()
		}
		var left []string
		for name, keys := range devs {
			if hasKey(keys, retainedTaint) {
				left = append(left, name)
			}
		}
		_, whole1 := devs["gpu-1"]
		return len(left) == 0 && whole1, fmt.Sprintf("still kept: %s; gpu-1 published %v", strings.Join(left, ", "), whole1)
	})
	waitRunning(t, ns, "mig-overlap", time.Minute)
	waitRunning(t, ns, "whole-1", time.Minute)
}
