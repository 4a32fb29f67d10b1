package main

import (
	"math"
	"testing"
)

// Two GPUs, pods in arrival order: a 0.47 pod (4g.40gb: 4 compute, 4 memory slices), a whole GPU, a 0.65 pod
// (7g.80gb: the rest of no GPU), a 0.30 pod (3g.40gb: 3 and 4). Summed over both GPUs the slices hold the
// first, second and fourth (4+7+3 = 14 compute, 4+8+4 = 16 memory) and not the third, so arrival order
// reaches (470 + 1000 + 300) / 2000; the best subset by demand per slice is the same here.
func TestTheMIGSliceBoundPlacesInArrivalOrderWhateverTheClusterSlicesStillHold(t *testing.T) {
	b := h100Claims(t, StyleMIG)
	pods := []TracePod{pod("a", 1, 470), pod("b", 1, 1000), pod("c", 1, 650), pod("d", 1, 300)}
	got, ok := MIGSliceBound(b, pods, 2)
	if !ok {
		t.Fatal("no bound for a MIG builder")
	}
	if want := 100 * 1770.0 / 2000; math.Abs(got.ArrivalPct-want) > 1e-9 {
		t.Errorf("arrival-order bound %.3f %%, want %.3f %%", got.ArrivalPct, want)
	}
	if got.LPPct < got.ArrivalPct-1e-9 {
		t.Errorf("the best subset (%.3f %%) must reach at least what arrival order does (%.3f %%)", got.LPPct, got.ArrivalPct)
	}
}

// A profile's memory slices are its share of the GPU's memory in eighths, rounded: H100's 1g.10gb is one,
// 1g.20gb and 2g.20gb two, 3g.40gb and 4g.40gb four, 7g.80gb eight.
func TestEachH100ProfileTakesItsComputeAndMemorySlices(t *testing.T) {
	b := h100Claims(t, StyleMIG)
	want := map[string][2]int64{"1g.10gb": {1, 1}, "1g.20gb": {1, 2}, "2g.20gb": {2, 2}, "3g.40gb": {3, 4}, "4g.40gb": {4, 4}, "7g.80gb": {7, 8}}
	seen := 0
	for _, p := range b.mig {
		w, ok := want[p.Name]
		if !ok {
			continue
		}
		seen++
		c, m, ok := migSlices(p, b.Ref.Memory)
		if !ok || c != w[0] || m != w[1] {
			t.Errorf("%s: %d compute and %d memory slices, want %d and %d", p.Name, c, m, w[0], w[1])
		}
	}
	if seen != len(want) {
		t.Errorf("the fixture offered %d of the %d profiles checked", seen, len(want))
	}
}

// Shares publish no MIG profile: there is nothing to bound.
func TestTheMIGSliceBoundIsOnlyForPoliciesThatHandOutMIGInstances(t *testing.T) {
	if _, ok := MIGSliceBound(h100Claims(t, StyleShares), []TracePod{pod("a", 1, 470)}, 1); ok {
		t.Error("a bound for a builder without MIG profiles")
	}
}
