package main

import (
	"context"
	"fmt"
	"time"
)

// Snapshot is the state of a replay after some pods have arrived.
//
// Definitions (README "Metrics"): a pod's demand is num_gpu GPUs, or gpu_milli/1000 of a GPU for a
// fractional pod. Arrived demand = Σ demand of the pods replayed so far / GPUs in the cluster. Allocation
// ratio = Σ demand of the pods placed / GPUs in the cluster — a fractional pod counts its fraction even when
// the policy hands it a whole GPU or a larger MIG instance, as in the FGD paper's "GPU allocation ratio".
type Snapshot struct {
	ArrivedMilli   int64
	AllocatedMilli int64
	Arrived        int
	Placed         int
	Failed         int
	// FailedFractional counts failed pods asking for part of a GPU; FailedWhole those asking for whole GPUs.
	FailedFractional int
	FailedWhole      int
}

// Record counts one replayed pod, placed or failed.
func (s *Snapshot) Record(pod TracePod, placed bool) {
	s.Arrived++
	s.ArrivedMilli += pod.DemandMilli()
	if placed {
		s.Placed++
		s.AllocatedMilli += pod.DemandMilli()
		return
	}
	s.Failed++
	if pod.Fractional() {
		s.FailedFractional++
	} else {
		s.FailedWhole++
	}
}

// ArrivedPct is arrived demand in percent of the cluster's GPUs.
func (s Snapshot) ArrivedPct(totalGPUs int) float64 {
	return 100 * float64(s.ArrivedMilli) / float64(totalGPUs*1000)
}

// AllocPct is the GPU allocation ratio in percent.
func (s Snapshot) AllocPct(totalGPUs int) float64 {
	return 100 * float64(s.AllocatedMilli) / float64(totalGPUs*1000)
}

// Point is one sample of the allocation-ratio curve.
type Point struct {
	ArrivedPct float64
	AllocPct   float64
}

// Checkpoint is the snapshot taken when arrived demand first reached Pct percent (or the last one).
type Checkpoint struct {
	Pct int
	Snapshot
}

// RunResult is one policy's outcome.
type RunResult struct {
	Policy      string
	TotalGPUs   int
	Points      []Point
	Checkpoints []Checkpoint
	Final       Snapshot
	// GPUsNeeded: GPUs holding an allocation once every pod of the trace is placed, on the trace's nodes
	// plus as many extra nodes as needed (the elastic run).
	GPUsNeeded int
	// Unplaceable: pods that did not fit even on an empty extra node in the elastic run.
	Unplaceable   int
	AllocateCalls int
	// Bound: for MIG policies, the allocation ratio no placement could exceed in this replay (MIGSliceBound).
	Bound   *SliceBound
	Elapsed time.Duration
	// Holdings counts the GPUs by what they hold at the end of the replay (Sim.Holdings).
	Holdings map[string]int
	// SameAs names the policy whose replay this one reused (identical slices and claims).
	SameAs string
}

// ReplaySequence lists the pods replayed: the trace in creation order, repeated (names suffixed -r<k>) while
// arrived demand stays within maxDemand × the cluster's GPUs. The trace alone is 98 % of the cluster, so a
// few pods of a second pass take it to 100 %, the way the FGD simulator inflates the workload.
func ReplaySequence(pods []TracePod, totalGPUs int, maxDemand float64) []TracePod {
	target := int64(maxDemand * float64(totalGPUs) * 1000)
	var out []TracePod
	var arrived int64
	for k := 0; len(pods) > 0; k++ {
		p := pods[k%len(pods)]
		if k >= len(pods) {
			p.Name = fmt.Sprintf("%s-r%d", p.Name, k/len(pods))
		}
		if arrived+p.DemandMilli() > target {
			break
		}
		arrived += p.DemandMilli()
		out = append(out, p)
	}
	return out
}

// Replay places the pods in order; pods never leave (long-running), and a pod that fails stays failed
// (nothing is ever freed, so it could not fit later either).
func Replay(ctx context.Context, sim *Sim, pods []TracePod, checkpoints []int) (RunResult, error) {
	start := time.Now()
	total := sim.TotalGPUs()
	res := RunResult{Policy: sim.Policy.Name, TotalGPUs: total}
	var s Snapshot
	nextPoint := 0.0
	nextCheck := 0
	for _, pod := range pods {
		ok, err := sim.Place(ctx, pod)
		if err != nil {
			return res, err
		}
		s.Record(pod, ok)
		arrived := s.ArrivedPct(total)
		if arrived >= nextPoint {
			res.Points = append(res.Points, Point{ArrivedPct: arrived, AllocPct: s.AllocPct(total)})
			nextPoint = arrived + 0.25
		}
		for nextCheck < len(checkpoints) && arrived >= float64(checkpoints[nextCheck]) {
			res.Checkpoints = append(res.Checkpoints, Checkpoint{Pct: checkpoints[nextCheck], Snapshot: s})
			nextCheck++
		}
	}
	res.Points = append(res.Points, Point{ArrivedPct: s.ArrivedPct(total), AllocPct: s.AllocPct(total)})
	// The replay stops just short of a checkpoint when the next pod would overshoot it (the last pod of a
	// 100 % run leaves it at 99.9x %): the end state stands for a checkpoint within half a point.
	for nextCheck < len(checkpoints) && s.ArrivedPct(total) >= float64(checkpoints[nextCheck])-0.5 {
		res.Checkpoints = append(res.Checkpoints, Checkpoint{Pct: checkpoints[nextCheck], Snapshot: s})
		nextCheck++
	}
	res.Final = s
	res.Holdings = sim.Holdings()
	res.AllocateCalls = sim.AllocateCalls
	res.Elapsed = time.Since(start)
	return res, nil
}

// GPUsNeeded replays every pod once on a cluster that grows by one node whenever a pod fits nowhere, and
// counts the GPUs that end up holding an allocation.
func GPUsNeeded(ctx context.Context, sim *Sim, pods []TracePod) (needed, unplaceable, calls int, err error) {
	for _, pod := range pods {
		ok, err := sim.Place(ctx, pod)
		if err != nil {
			return 0, 0, 0, err
		}
		if !ok {
			unplaceable++
		}
	}
	return sim.GPUsInUse(), unplaceable, sim.AllocateCalls, nil
}
