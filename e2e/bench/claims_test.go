package main

import (
	"testing"
)

func h100Claims(t *testing.T, style ClaimStyle) *ClaimBuilder {
	t.Helper()
	mode := map[ClaimStyle]fixtureMode{StyleMIG: fixtureMIG, StyleShares: fixtureShared, StyleWhole: fixtureWhole}[style]
	slices := fixtureNode("n", 1, mode).build()
	ref, err := refGPU(slices)
	if err != nil {
		t.Fatal(err)
	}
	return NewClaimBuilder(style, ref, slices, nil)
}

// The smallest MIG profile must cover the SMs as well as the memory: 0.47 of an H100 is 38.3 GB (3g.40gb
// has enough) but 63 SMs (3g.40gb has 60), so 4g.40gb comes first.
func TestAMIGClaimAsksForTheSmallestProfileCoveringMemoryAndSMs(t *testing.T) {
	b := h100Claims(t, StyleMIG)
	for _, c := range []struct {
		milli int
		first string
	}{{100, "1g.10gb"}, {150, "1g.20gb"}, {240, "2g.20gb"}, {300, "3g.40gb"}, {470, "4g.40gb"}, {650, "7g.80gb"}, {810, "7g.80gb"}} {
		cands := b.migCandidates(c.milli)
		if len(cands) == 0 || cands[0].Name != c.first {
			t.Errorf("milli %d: candidates %v, want %s first", c.milli, cands, c.first)
			continue
		}
	}
	// 0.999 of the memory is more than the 7g.80gb instance has: only a whole GPU will do.
	claim, err := b.Claim(pod("p", 1, 999))
	if err != nil {
		t.Fatal(err)
	}
	if r := claim.Spec.Devices.Requests[0]; r.Exactly == nil || r.Exactly.Count != 1 || b.WholeGPUs(pod("p", 1, 999)) != 1 {
		t.Errorf("milli 999: request %+v, want one whole GPU", r)
	}
}

// A share asks for its fraction of compute exactly and of memory rounded down to the 1 GiB step.
func TestAShareClaimAsksForItsFractionOfMemoryAndCompute(t *testing.T) {
	b := h100Claims(t, StyleShares)
	claim, err := b.Claim(pod("p", 1, 470))
	if err != nil {
		t.Fatal(err)
	}
	req := claim.Spec.Devices.Requests[0].Exactly.Capacity.Requests
	compute, memory := req["compute"], req["memory"]
	if compute.Value() != 47 {
		t.Errorf("compute %s, want 47", compute.String())
	}
	// 0.47 × 81,559 MiB = 37.43 GiB -> 37 GiB.
	if memory.Value() != 37<<30 {
		t.Errorf("memory %d, want %d", memory.Value(), int64(37<<30))
	}
}
