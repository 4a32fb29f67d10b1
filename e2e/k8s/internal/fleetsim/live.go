package fleetsim

import (
	"math"
	"sort"

	"tessera.dev/e2e/internal/fleet"
)

// Live is the model with its replicas owned by a caller: the live loop (e2e fleet_test.go), where
// Kubernetes decides which replicas exist (KEDA, the HPA, kube-scheduler) and on which GPU, and the
// model serves the trace on them. The engines, routing, MPS contention and DCGM accounting are the
// same code as Run's; only the autoscaler and the placement come from outside. Times are trace
// seconds.
type Live struct {
	s     *sim
	byID  map[string]*replica
	gpuOf map[int]int // caller's GPU index -> index in s.gpus
}

// LiveReplica is a replica the caller reports serving: its service (0-based, as ServiceOf numbers
// them) and the GPU that holds its claim (the caller's index; two replicas with the same index
// share that GPU).
type LiveReplica struct {
	ID      string
	Service int
	GPU     int
	// Share, when its RequestPercent is set, is the MPS share the replica's claim was made with (the
	// sized run's replicas: the initial size, then each re-sizing's); otherwise the policy's size.
	Share Recommendation
}

// LiveUsage is one replica's use over a Step: ClaimUse is its SM-time in whole-GPU units (what
// tessera exports as tessera_claim_gpu_utilization_ratio); Requests its mean queued + running
// requests (the engine's gauge an HPA scales on); MemoryBytes its engine's peak memory (weights,
// overhead, resident KV: what tessera exports as tessera_claim_gpu_memory_used_bytes).
type LiveUsage struct {
	ClaimUse, Requests, MemoryBytes float64
}

// NewLive makes the model of trace under policy p with no replica; p.HPA and p.Sized must be off
// (the caller scales and sizes).
func NewLive(cfg Config, trace []fleet.Request, p Policy) *Live {
	p.HPA, p.Sized = false, false
	s := newSim(cfg, trace, p, true)
	s.nextSample = s.cfg.SampleSeconds
	s.nextResize = math.Inf(1)
	return &Live{s: s, byID: map[string]*replica{}, gpuOf: map[int]int{}}
}

// Step advances the model to trace time t with the replicas serving now. A replica not seen before
// starts empty and serves at once; a replica seen before and missing now retires (its queue goes to
// the others, its running requests finish, as a terminating pod drains). It returns each listed
// replica's use since the previous Step.
func (l *Live) Step(t float64, serving []LiveReplica) map[string]LiveUsage {
	s := l.s
	seen := map[string]bool{}
	for _, lr := range serving {
		seen[lr.ID] = true
		if _, ok := l.byID[lr.ID]; ok {
			continue
		}
		gi, ok := l.gpuOf[lr.GPU]
		if !ok {
			s.gpus = append(s.gpus, &gpuState{})
			gi = len(s.gpus) - 1
			l.gpuOf[lr.GPU] = gi
		}
		if sh := lr.Share; sh.RequestPercent > 0 {
			l.byID[lr.ID] = s.placeAs(lr.Service, s.now, gi, float64(sh.RequestPercent)/100, float64(sh.CeilingPercent)/100,
				float64(sh.MemoryBytes), MIGProfiles[len(MIGProfiles)-1])
		} else {
			l.byID[lr.ID] = s.place(lr.Service, s.now, gi)
		}
	}
	ids := make([]string, 0, len(l.byID))
	for id := range l.byID {
		ids = append(ids, id)
	}
	sort.Strings(ids) // retire in a fixed order: their queues are re-routed in it
	for _, id := range ids {
		if !seen[id] {
			s.retire(l.byID[id])
			delete(l.byID, id)
		}
	}
	for _, r := range l.byID {
		r.liveU, r.liveLoad, r.liveMem, r.liveTicks = 0, 0, 0, 0
	}
	for ; s.now < t-1e-9; s.now += s.cfg.Tick {
		s.tick()
	}
	out := map[string]LiveUsage{}
	for id, r := range l.byID {
		var u LiveUsage
		if r.liveTicks > 0 {
			u = LiveUsage{ClaimUse: r.liveU / float64(r.liveTicks), Requests: r.liveLoad / float64(r.liveTicks), MemoryBytes: r.liveMem}
		}
		out[id] = u
	}
	return out
}

// Result is the run so far, as Run reports it (PodsCreated counts the replicas the caller listed).
func (l *Live) Result() Result { return l.s.result() }
