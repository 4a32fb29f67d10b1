package e2etest

import (
	"fmt"
	"testing"
	"time"
)

// The standard attribute names (KEP-6072) other drivers' devices carry too, so one claim can align a GPU
// with a NIC. A stand-in node's GPUs 0-3 are on NUMA node 0 and 4-7 on node 1, and GPU 1 is published only
// as a share: four whole GPUs matched on resource.kubernetes.io/numaNode can only be GPUs 4-7, which the
// allocator finds only by honouring the constraint (without it, 0, 2, 3 and 4 fit as well).
func TestFourGPUsMatchedOnTheStandardNumaNodeAttributeShareOneNumaNode(t *testing.T) {
	ns := namespace(t, "e2e-numa")
	claimTemplate(t, ns, "four", gpuClass(t), count(4), matchAttribute("resource.kubernetes.io/numaNode"))
	node := e.nodes[len(e.nodes)-1]
	pod(t, ns, "aligned", "four", node)
	got := allocations(t, waitRunning(t, ns, "aligned", 2*time.Minute))
	if len(got) != 4 {
		t.Fatalf("%d devices allocated, want 4", len(got))
	}
	numa := map[int64][]string{}
	for _, a := range got {
		d := sliceDevice(t, node, a.result.Device)
		std, own := attr(d, "resource.kubernetes.io/numaNode"), attr(d, "numaNode")
		if std.IntValue == nil || own.IntValue == nil || *std.IntValue != *own.IntValue {
			t.Fatalf("%s publishes resource.kubernetes.io/numaNode %v and numaNode %v, want one value under both names",
				a.result.Device, std.IntValue, own.IntValue)
		}
		numa[*std.IntValue] = append(numa[*std.IntValue], a.result.Device)
	}
	if len(numa) != 1 {
		t.Fatalf("the claim's GPUs span NUMA nodes %v, want one", numa)
	}
	t.Logf("four GPUs on one NUMA node: %s", fmt.Sprint(numa))
}
