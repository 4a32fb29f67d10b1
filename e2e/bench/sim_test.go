package main

import (
	"context"
	"fmt"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
)

// Two nodes with one H100 each (demand is measured against the H100: 81,559 MiB, 132 SMs).
var twoSingleGPUNodes = []TraceNode{{Name: "node-a", GPUs: 1, Model: "T4"}, {Name: "node-b", GPUs: 1, Model: "T4"}}

// tesseraClasses are the DeviceClasses tessera ships; the claims name them.
func tesseraClasses(t *testing.T) []*resourceapi.DeviceClass {
	t.Helper()
	classes, err := LoadClasses("../../deployments/classes")
	if err != nil {
		t.Fatal(err)
	}
	return classes
}

func pod(name string, numGPU, milli int) TracePod {
	return TracePod{Name: name, NumGPU: numGPU, GPUMilli: milli}
}

func fixturePolicies() []PolicySpec {
	return []PolicySpec{
		{Name: "whole", Style: StyleWhole},
		{Name: "mig", Style: StyleMIG},
		{Name: "shares", Style: StyleShares},
		{Name: "default", Style: StyleAuto},
	}
}

func replayFixture(t *testing.T, policy PolicySpec, nodes []TraceNode, pods []TracePod) RunResult {
	t.Helper()
	tr := &Trace{Pods: pods, Nodes: nodes}
	cfg := Config{Models: []string{"H100-SXM5-80GB"}, MaxDemand: 10, Checkpoints: []int{100}, SkipGPUsNeeded: true, Classes: tesseraClasses(t)}
	c, err := BuildCluster(fixtureSource{}, policy, tr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	res, err := Replay(context.Background(), NewSim(policy, c), tr.Pods, cfg.Checkpoints)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// Five 0.3-GPU pods, one whole-GPU pod, one 0.1-GPU pod on two single-GPU nodes:
//   - whole: the first two 0.3 pods take a GPU each; everything after fails: 2 placed.
//   - MIG: 0.3 needs 40 SMs, so 3g.40gb (60 SMs) is the smallest profile; two fit per GPU (placements 0
//     and 4), so four 0.3 pods fit, the fifth does not, nor the whole pod, nor the 0.1 pod (1g.10gb needs a
//     free memory slice and 3g+3g uses all eight): 4 placed.
//   - shares: three 30 % shares per GPU; the fifth 0.3 pod goes to the second GPU; no GPU is untouched for
//     the whole pod; the 0.1 pod takes the last 10 % of the first GPU: 6 placed.
//   - default (whole GPU + dynamic MIG, the built-in policy): as MIG, 4 placed.
func TestEachPolicyPlacesTheCountItsPackingAllows(t *testing.T) {
	pods := []TracePod{pod("a", 1, 300), pod("b", 1, 300), pod("c", 1, 300), pod("d", 1, 300), pod("e", 1, 300), pod("f", 1, 1000), pod("g", 1, 100)}
	want := map[string]int{"whole": 2, "mig": 4, "shares": 6, "default": 4}
	for _, p := range fixturePolicies() {
		res := replayFixture(t, p, twoSingleGPUNodes, pods)
		if res.Final.Placed != want[p.Name] || res.Final.Failed != len(pods)-want[p.Name] {
			t.Errorf("policy %s placed %d and failed %d of %d pods, want %d placed", p.Name, res.Final.Placed, res.Final.Failed, len(pods), want[p.Name])
		}
	}
}

// A whole GPU and any partition of the same GPU exclude each other through the GPU's counters: a whole
// pod, a 0.3 pod, then another whole pod fit 2 of 3 under every policy (the 0.3 pod holds the second GPU).
func TestAWholeGPUAndAPartitionOfItExcludeEachOther(t *testing.T) {
	pods := []TracePod{pod("w1", 1, 1000), pod("s", 1, 300), pod("w2", 1, 1000)}
	for _, p := range fixturePolicies() {
		res := replayFixture(t, p, twoSingleGPUNodes, pods)
		if res.Final.Placed != 2 || res.Final.FailedWhole != 1 {
			t.Errorf("policy %s placed %d (failed whole %d), want 2 placed and the second whole pod failed", p.Name, res.Final.Placed, res.Final.FailedWhole)
		}
	}
}

// Two 0.5 pods exactly fill one GPU with shares: memory is rounded down to the 1 GiB step, so the two
// requests (39 GiB each) stay within the GPU's 79.6 GiB, and compute is exactly 50 + 50 %.
func TestSharesThatAddUpToOneGPUFitOnOneGPU(t *testing.T) {
	pods := []TracePod{pod("x", 1, 500), pod("y", 1, 500), pod("z", 1, 1000)}
	res := replayFixture(t, PolicySpec{Name: "shares", Style: StyleShares}, twoSingleGPUNodes, pods)
	if res.Final.Placed != 3 {
		t.Errorf("placed %d of 3, want the two halves on one GPU and the whole pod on the other", res.Final.Placed)
	}
}

// An 8-GPU pod needs eight untouched GPUs on one node: on a 8-GPU node with one 0.1 pod it fails, and the
// best-fit order keeps the 0.1 pod on the 1-GPU node so the 8-GPU pod fits when it comes second.
func TestBestFitKeepsBigNodesFreeForMultiGPUPods(t *testing.T) {
	nodes := []TraceNode{{Name: "big", GPUs: 8}, {Name: "small", GPUs: 1}}
	pods := []TracePod{pod("tiny", 1, 100), pod("eight", 8, 1000)}
	for _, p := range fixturePolicies() {
		res := replayFixture(t, p, nodes, pods)
		if res.Final.Placed != 2 {
			t.Errorf("policy %s placed %d of 2", p.Name, res.Final.Placed)
		}
	}
}

// The allocation ratio counts a fractional pod's fraction, whatever the policy gives it.
func TestTheAllocationRatioCountsFractionsNotTheDevicesHandedOut(t *testing.T) {
	pods := []TracePod{pod("a", 1, 250), pod("b", 1, 1000)}
	res := replayFixture(t, PolicySpec{Name: "whole", Style: StyleWhole}, twoSingleGPUNodes, pods)
	if got := res.Final.AllocPct(res.TotalGPUs); got != 62.5 {
		t.Errorf("allocation ratio %.2f %%, want (0.25 + 1) / 2 = 62.5 %%", got)
	}
}

// The elastic run adds 8-GPU nodes until every pod is placed and counts GPUs holding an allocation.
func TestGPUsNeededGrowsTheClusterUntilEveryPodFits(t *testing.T) {
	pods := []TracePod{pod("a", 1, 300), pod("b", 1, 300), pod("c", 1, 300), pod("d", 1, 300), pod("e", 1, 300)}
	want := map[string]int{"whole": 5, "mig": 3, "shares": 2, "default": 3}
	for _, p := range fixturePolicies() {
		tr := &Trace{Pods: pods, Nodes: twoSingleGPUNodes}
		cfg := Config{Models: []string{"H100-SXM5-80GB"}, MaxDemand: 1, Checkpoints: []int{100}, Classes: tesseraClasses(t)}
		c, err := BuildCluster(fixtureSource{}, p, tr, cfg)
		if err != nil {
			t.Fatal(err)
		}
		res, err := RunPolicy(context.Background(), c, p, tr, cfg)
		if err != nil {
			t.Fatal(err)
		}
		if res.GPUsNeeded != want[p.Name] || res.Unplaceable != 0 {
			t.Errorf("policy %s needs %d GPUs (%d unplaceable), want %d", p.Name, res.GPUsNeeded, res.Unplaceable, want[p.Name])
		}
	}
}

func TestTheReplayRepeatsTheTraceUpToTheDemandLimit(t *testing.T) {
	pods := []TracePod{pod("a", 1, 600), pod("b", 1, 1000)}
	seq := ReplaySequence(pods, 2, 1.0)
	// 0.6 + 1 + 0.6 = 2.2 > 2: the second pass stops before its first pod.
	if len(seq) != 2 {
		t.Fatalf("sequence %v, want the two pods once", seq)
	}
	seq = ReplaySequence(pods, 4, 1.0)
	// 0.6 + 1 + 0.6 + 1 = 3.2, then 0.6 more = 3.8 <= 4.
	if len(seq) != 5 || seq[4].Name != "a-r2" {
		t.Fatalf("sequence %v, want five pods ending with a-r2", seq)
	}
}

// Two single-GPU nodes: a 0.47 pod (63 SMs, so a 4g.40gb, whose only placement is the bottom half), a 0.32
// pod (a 3g.40gb: best fit puts it beside the 4g, on the top half), then another 0.47 pod, which only the
// second GPU still takes. The end state names what each GPU holds: under MIG the second GPU's top half is
// left to whatever ≤ 3g pod comes next; under shares the first GPU holds two shares.
func TestTheEndStateCountsGPUsByWhatTheyHold(t *testing.T) {
	pods := []TracePod{pod("a", 1, 470), pod("b", 1, 320), pod("c", 1, 470)}
	want := map[string]map[string]int{
		"mig":    {"4g.40gb + 3g.40gb": 1, "4g.40gb": 1},
		"shares": {"2 × share": 1, "share": 1},
		"whole":  {"whole GPU": 2},
	}
	for _, p := range fixturePolicies() {
		w, ok := want[p.Name]
		if !ok {
			continue
		}
		res := replayFixture(t, p, twoSingleGPUNodes, pods)
		if fmt.Sprint(res.Holdings) != fmt.Sprint(w) {
			t.Errorf("policy %s ends with GPUs holding %v, want %v", p.Name, res.Holdings, w)
		}
	}
}

// The report lists the end state only where MIG devices were allocated, most common combination first.
func TestTheReportListsWhatMIGGPUsHoldMostCommonFirst(t *testing.T) {
	rep := Report{
		Trace: &Trace{},
		Cfg:   Config{Models: []string{"H100-SXM5-80GB"}},
		Results: []RunResult{
			{Policy: "whole", TotalGPUs: 3, Holdings: map[string]int{"whole GPU": 3}},
			{Policy: "mig", TotalGPUs: 3, Holdings: map[string]int{"4g.40gb": 1, "whole GPU": 2}},
		},
	}
	md := rep.Markdown()
	if strings.Contains(md, "What the GPUs hold at the end, whole") {
		t.Errorf("the report lists the end state of a policy without MIG devices:\n%s", md)
	}
	if !strings.Contains(md, "What the GPUs hold at the end, mig:\n\n| GPU holds | GPUs |\n|---|---|\n| whole GPU | 2 |\n| 4g.40gb | 1 |\n") {
		t.Errorf("the report does not list mig's end state most common first:\n%s", md)
	}
}

// Under shares a whole-GPU pod takes the shared device's defaults: all the memory and no compute. Its GPU
// must count as taken (for the node filter, the best-fit order and "GPUs needed"), by its memory.
func TestAWholeGPUPodOnASharedDeviceCountsItsGPUAsTaken(t *testing.T) {
	policy := PolicySpec{Name: "shares", Style: StyleShares}
	tr := &Trace{Pods: []TracePod{pod("w", 1, 1000)}, Nodes: twoSingleGPUNodes}
	cfg := Config{Models: []string{"H100-SXM5-80GB"}, MaxDemand: 10, Checkpoints: []int{100}, SkipGPUsNeeded: true, Classes: tesseraClasses(t)}
	c, err := BuildCluster(fixtureSource{}, policy, tr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	sim := NewSim(policy, c)
	if _, err := Replay(context.Background(), sim, tr.Pods, cfg.Checkpoints); err != nil {
		t.Fatal(err)
	}
	if got := sim.GPUsInUse(); got != 1 {
		t.Errorf("a whole-GPU pod on a shared device leaves %d GPUs in use, want 1", got)
	}
	if got := sim.nodes[0].used[0]; got < 0.99 {
		t.Errorf("the whole-GPU share counts as %.3f of its GPU, want its memory share (79 GiB of 79.6 GiB)", got)
	}
}
