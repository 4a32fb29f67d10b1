package main

import (
	"math"
	"sort"
	"strconv"
	"strings"
)

// SliceBound is how far any MIG placement could take a replay, from the slices alone. A 7-compute-slice,
// 8-memory-slice GPU (A100, H100, H200, B200) holds MIG instances whose slices sum to at most 7 and 8,
// whatever their positions, so the cluster's slice totals bound every outcome:
//
//   - ArrivalPct: the allocation ratio of placing the replay's pods in arrival order whenever the cluster's
//     free compute and memory slices, summed over all GPUs, still hold the pod's smallest covering profile
//     (or its whole GPUs). It is what a placement with no fragmentation at all would reach; a scheduler
//     that places whatever fits cannot do better except by leaving an earlier pod out to make room for a
//     later one.
//   - LPPct: the allocation ratio of the best subset of the pods in any order (a fractional knapsack per
//     slice kind, the tighter of the two): no policy that hands out these profiles exceeds it.
//
// Both count a pod's demand as the allocation ratio does (its fraction, not its profile).
type SliceBound struct {
	ArrivalPct float64
	LPPct      float64
}

// podSlices is what one pod takes from the cluster under MIG: compute and memory slices.
type podSlices struct {
	demand          int64
	compute, memory int64
}

// migSlices gives the slices of a profile: compute from its name (`3g.40gb`: 3), memory as its share of the
// GPU's memory in eighths (a 40 GB instance of an 80 GB GPU is 4 slices; instances are a little smaller
// than their slices, hence the rounding).
func migSlices(p migProfile, gpuMemory int64) (compute, memory int64, ok bool) {
	g := strings.IndexByte(p.Name, 'g')
	if g <= 0 || gpuMemory <= 0 {
		return 0, 0, false
	}
	c, err := strconv.Atoi(p.Name[:g])
	if err != nil || c <= 0 {
		return 0, 0, false
	}
	return int64(c), int64(math.Round(8 * float64(p.Memory) / float64(gpuMemory))), true
}

// MIGSliceBound computes the bound for a MIG policy's claims over the replayed pods on totalGPUs GPUs; ok is
// false when the builder offers no MIG profile (nothing to bound).
func MIGSliceBound(b *ClaimBuilder, pods []TracePod, totalGPUs int) (SliceBound, bool) {
	if len(b.mig) == 0 || totalGPUs == 0 {
		return SliceBound{}, false
	}
	items := make([]podSlices, 0, len(pods))
	for _, pod := range pods {
		it := podSlices{demand: pod.DemandMilli(), compute: 7 * int64(pod.NumGPU), memory: 8 * int64(pod.NumGPU)}
		if pod.Fractional() {
			if c := b.migCandidates(pod.GPUMilli); len(c) > 0 {
				cs, ms, ok := migSlices(c[0], b.Ref.Memory)
				if !ok {
					return SliceBound{}, false
				}
				it.compute, it.memory = cs, ms
			}
		}
		items = append(items, it)
	}
	capC, capM := 7*int64(totalGPUs), 8*int64(totalGPUs)
	var usedC, usedM, placed int64
	for _, it := range items {
		if usedC+it.compute <= capC && usedM+it.memory <= capM {
			usedC, usedM, placed = usedC+it.compute, usedM+it.memory, placed+it.demand
		}
	}
	pct := func(milli float64) float64 { return 100 * milli / float64(totalGPUs*1000) }
	lp := math.Min(knapsack(items, capC, func(p podSlices) int64 { return p.compute }),
		knapsack(items, capM, func(p podSlices) int64 { return p.memory }))
	return SliceBound{ArrivalPct: pct(float64(placed)), LPPct: pct(lp)}, true
}

// knapsack is the fractional knapsack's optimum: the most demand that fits in capacity of one slice kind,
// taking pods in order of demand per slice and a fraction of the last.
func knapsack(items []podSlices, capacity int64, cost func(podSlices) int64) float64 {
	sorted := append([]podSlices(nil), items...)
	sort.Slice(sorted, func(i, j int) bool {
		return sorted[i].demand*cost(sorted[j]) > sorted[j].demand*cost(sorted[i])
	})
	var used int64
	var total float64
	for _, it := range sorted {
		c := cost(it)
		if used+c <= capacity {
			used += c
			total += float64(it.demand)
			continue
		}
		total += float64(it.demand) * float64(capacity-used) / float64(c)
		break
	}
	return total
}
