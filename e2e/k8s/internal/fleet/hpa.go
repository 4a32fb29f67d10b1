package fleet

import "math"

// hpa is one HorizontalPodAutoscaler on a per-pod average-utilization metric,
// following the Kubernetes algorithm (pkg/controller/podautoscaler):
//
//   - replica calculator: ratio = mean(metric of Ready pods) / target; within
//     tolerance -> keep; otherwise ceil(ratio * readyPods). When scaling up while
//     some pods are not Ready yet, those count with metric 0 and the ratio is
//     recomputed over all pods (the result is kept only if it still scales up).
//   - behavior defaults: scale-up has no stabilization and is limited per sync to
//     max(+100 %, +4 pods); scale-down takes the largest recommendation of the
//     stabilization window (so it only falls once a lower load has lasted the whole
//     window) and is limited to -100 % per sync;
//   - the result is clamped to [min, max].
type hpa struct {
	target, tolerance float64
	min, max          int
	window            float64 // scale-down stabilization window, trace seconds
	recs              []recommendation
}

type recommendation struct {
	at float64
	n  int
}

// rawRecommendation is the replica calculator for current pods, the metrics of
// the Ready ones, and the number not Ready yet.
func rawRecommendation(current int, ready []float64, unready int, target, tolerance float64) int {
	if len(ready) == 0 {
		return current
	}
	var sum float64
	for _, m := range ready {
		sum += m
	}
	ratio := sum / float64(len(ready)) / target
	if unready == 0 || ratio <= 1 {
		if math.Abs(1-ratio) <= tolerance {
			return current
		}
		return int(math.Ceil(ratio * float64(len(ready))))
	}
	n := len(ready) + unready
	newRatio := sum / float64(n) / target
	if math.Abs(1-newRatio) <= tolerance || newRatio < 1 {
		return current
	}
	desired := int(math.Ceil(newRatio * float64(n)))
	if desired < current {
		return current
	}
	return desired
}

// decide returns the replica count the HPA sets at trace time now.
func (h *hpa) decide(now float64, current int, ready []float64, unready int) int {
	raw := rawRecommendation(current, ready, unready, h.target, h.tolerance)
	h.recs = append(h.recs, recommendation{at: now, n: raw})
	kept := h.recs[:0]
	down := raw
	for _, r := range h.recs {
		if r.at >= now-h.window-eps {
			kept = append(kept, r)
			down = max(down, r.n)
		}
	}
	h.recs = kept
	up := raw // scale-up stabilization window 0: only the current recommendation

	desired := current
	if desired < up {
		desired = up
	}
	if desired > down {
		desired = down
	}
	if limit := max(2*current, current+4); desired > limit {
		desired = limit
	}
	return min(max(desired, h.min), h.max)
}
