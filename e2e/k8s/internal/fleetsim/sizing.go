package fleetsim

import (
	"fmt"
	"math"
	"sort"
)

// Recommendation is tessera's share sizing rule v1 (/work/sizing-rule.md; the same rule as
// `kubectl tessera rightsize`).
type Recommendation struct {
	RequestPercent int   // compute request, percent of the GPU (what the scheduler packs)
	CeilingPercent int   // MPS active-thread percentage the share runs with
	MemoryBytes    int64 // hard memory limit
}

const (
	gib              = int64(1) << 30
	minSizingSamples = 30
)

// Percentile is nearest rank on sorted samples: sorted[ceil(p/100·n) − 1].
func Percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p/100*float64(len(sorted)))) - 1
	if i < 0 {
		i = 0
	}
	return sorted[i]
}

// Rightsize applies the rule to samples u (fraction of one whole GPU's SM time used, whole-GPU
// units) and m (memory used, bytes), all replicas pooled.
func Rightsize(u []float64, m []float64) (Recommendation, error) {
	if len(u) < minSizingSamples {
		return Recommendation{}, fmt.Errorf("not enough data: %d samples, need %d", len(u), minSizingSamples)
	}
	s := append([]float64(nil), u...)
	sort.Float64s(s)
	// Round before ceil5 so that 100·0.36/0.8 = 45.000000000000007 stays 45.
	raw := math.Round(100*Percentile(s, 90)/0.8*1e6) / 1e6
	req := int(math.Ceil(raw/5)) * 5
	req = max(5, min(100, req))
	var maxM float64
	for _, v := range m {
		maxM = math.Max(maxM, v)
	}
	mem := int64(math.Ceil(1.15*maxM/float64(gib))) * gib
	mem = max(gib, mem)
	return Recommendation{RequestPercent: req, CeilingPercent: 100, MemoryBytes: mem}, nil
}
