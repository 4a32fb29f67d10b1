package fleetsim

import (
	"fmt"
	"math"
	"sort"

	"tessera.dev/e2e/internal/fleet"
)

// DeviceKind is what one replica runs on.
type DeviceKind int

const (
	KindWhole DeviceKind = iota
	KindMPS
	KindMIG
	KindTimeSlice
)

// Policy is one way to give the services GPUs.
type Policy struct {
	Name string
	Kind DeviceKind
	// HPA scales replicas (KEDA-like, fixed target); otherwise the replica count is fixed.
	HPA bool
	// Sized: the device is sized online by the sizing rule (Rightsize) from the run's own samples.
	Sized bool
	// Guaranteed: the MPS ceiling equals the request.
	Guaranteed bool
	// Overcommit divides the rule's request (packing only). 1 = the rule; larger values are points
	// on the utilization–SLO curve, not the rule.
	Overcommit float64
	// Fixed, when its RequestPercent is set, is every service's share from the start, never re-sized
	// (the live loop's agreement scenario, whose claims are written before the run).
	Fixed Recommendation
}

// Policies are the policies compared; the first is the SLO baseline.
var Policies = []Policy{
	{Name: "whole-peak", Kind: KindWhole, Overcommit: 1},
	{Name: "whole-hpa", Kind: KindWhole, HPA: true, Overcommit: 1},
	{Name: "guaranteed-hpa", Kind: KindMPS, HPA: true, Sized: true, Guaranteed: true, Overcommit: 1},
	{Name: "burstable-hpa", Kind: KindMPS, HPA: true, Sized: true, Overcommit: 1},
	{Name: "mig-hpa", Kind: KindMIG, HPA: true, Sized: true, Overcommit: 1},
	{Name: "timeslice-hpa", Kind: KindTimeSlice, HPA: true, Sized: true, Overcommit: 1},
}

// CurvePolicies are burstable shares packed tighter than the rule says (request ÷ k): points that
// show where the utilization–SLO limit is. They are not the sizing rule.
var CurvePolicies = []Policy{
	{Name: "burstable-hpa req/2", Kind: KindMPS, HPA: true, Sized: true, Overcommit: 2},
	{Name: "burstable-hpa req/4", Kind: KindMPS, HPA: true, Sized: true, Overcommit: 4},
}

// Config holds every parameter of a run. All are fixed in code (DefaultConfig) before the trace
// is read; nothing is tuned per trace.
type Config struct {
	Services            int     // services the trace is split into
	ZipfS               float64 // service k's weight ∝ 1/(k+1)^ZipfS
	Tick                float64 // seconds of simulated time per step
	SampleSeconds       float64 // claim-use sample and HPA sync period
	LearnSeconds        float64 // first sizing after this much of the run
	ResizeSeconds       float64 // re-size period after that
	SizingWindowSeconds float64 // samples older than this are forgotten by the sizing
	HPATarget           float64 // per-pod concurrent requests (queued + running) on a whole GPU
	HPATolerance        float64
	ScaleDownWindow     float64
	MaxReplicas         int
	PeakReplicaBatch    int     // whole-peak: concurrent sequences one replica is sized for
	SLOSlack            float64 // SLO = slack × whole-peak's per-service p99
	DrainSeconds        float64 // after the last arrival, how long unfinished requests may run
}

// DefaultConfig is the configuration of `make bench-fleet-offline`.
func DefaultConfig() Config {
	return Config{
		Services: 24, ZipfS: 1.0, Tick: 0.05, SampleSeconds: 15, LearnSeconds: 600, ResizeSeconds: 600,
		SizingWindowSeconds: 1800, HPATarget: 16, HPATolerance: 0.1, ScaleDownWindow: 300, MaxReplicas: 32,
		PeakReplicaBatch: MaxBatch / 2, SLOSlack: 2, DrainSeconds: 600,
	}
}

// ServiceOf assigns trace row i to a service: a 64-bit mix of the row index mapped through the
// Zipf CDF of n services. Fixed in code; depends only on the row's index.
func ServiceOf(i, n int, zipfS float64) int {
	x := uint64(i) + 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	x ^= x >> 31
	u := float64(x>>11) / float64(1<<53)
	var total float64
	for k := 0; k < n; k++ {
		total += 1 / math.Pow(float64(k+1), zipfS)
	}
	var c float64
	for k := 0; k < n; k++ {
		c += 1 / math.Pow(float64(k+1), zipfS) / total
		if u < c {
			return k
		}
	}
	return n - 1
}

type request struct {
	svc         int
	arrival     float64
	ctx, gen    int
	prefillLeft float64 // prefill seconds left at SM fraction 1
	firstTok    float64
	tokens      float64
	finish      float64
}

type replica struct {
	svc              int
	gpu              int
	request, ceiling float64 // fractions of the GPU
	mem              float64 // bytes, hard limit
	mig              MIGProfile
	readyAt          float64
	retireAt         float64 // replaced: stops taking requests at this time
	retiring         bool
	queue, active    []*request
	used, grant      float64 // this tick
	uAcc, memMax     float64
	loadAcc          float64
	accTicks         int
	// The live loop's accumulators, reset at each Live.Step (the sampling ones above keep their own
	// period).
	liveU, liveLoad, liveMem float64
	liveTicks                int
}

func (r *replica) load() int { return len(r.queue) + len(r.active) }

func (r *replica) resident() float64 {
	var n float64
	for _, a := range r.active {
		n += float64(a.ctx) + a.tokens
	}
	return n
}

type gpuState struct {
	replicas       []*replica
	reqSum, memSum float64
	gSum, mSlices  int
	utilAcc, smAcc float64
	accTicks       int
}

type hpaRec struct {
	at float64
	n  int
}

type serviceState struct {
	class    ModelClass
	reqs     []*request
	next     int
	pending  []*request
	replicas []*replica
	rec      Recommendation
	haveRec  bool
	sampleAt []float64
	sampleU  []float64
	sampleM  []float64
	hpaRecs  []hpaRec
}

// Stats are mean and percentiles of per-second samples of GPUs held.
type Stats struct{ Mean, P10, P50, P90 float64 }

func statsOf(xs []float64) Stats {
	if len(xs) == 0 {
		return Stats{}
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	var sum float64
	for _, x := range s {
		sum += x
	}
	return Stats{Mean: sum / float64(len(s)), P10: Percentile(s, 10), P50: Percentile(s, 50), P90: Percentile(s, 90)}
}

// RequestOutcome is one request's latency.
type RequestOutcome struct {
	Service  int
	TTFT     float64 // seconds; -1 if it never got a first token
	TPOT     float64 // seconds per output token after the first; 0 for single-token outputs
	Finished bool
}

// Result is one policy's run.
type Result struct {
	Policy Policy
	// GPUUtil is DCGM_FI_DEV_GPU_UTIL of GPUs held (MIG: the GR_ENGINE_ACTIVE of its instances
	// weighted by compute slices, since GPU_UTIL reads 0 there); SMActive is PROF_SM_ACTIVE-like.
	GPUUtil, SMActive Stats
	GPUHours          float64
	MaxGPUs           int
	PodsCreated       int
	ReadySecondsP50   float64
	Outcomes          []RequestOutcome
	Requests          int
	Finished          int
}

// SLO is one service's latency targets.
type SLO struct{ TTFT, TPOT float64 }

// Attainment is the fraction of requests within their service's SLO.
type Attainment struct{ TTFT, TPOT, Both float64 }

// SLOsFrom sets each service's SLO from a baseline run: slack × its p99 TTFT and p99 TPOT.
func SLOsFrom(base Result, services int, slack float64) []SLO {
	ttft := make([][]float64, services)
	tpot := make([][]float64, services)
	for _, o := range base.Outcomes {
		if !o.Finished {
			continue
		}
		ttft[o.Service] = append(ttft[o.Service], o.TTFT)
		tpot[o.Service] = append(tpot[o.Service], o.TPOT)
	}
	out := make([]SLO, services)
	for k := range out {
		sort.Float64s(ttft[k])
		sort.Float64s(tpot[k])
		out[k] = SLO{TTFT: slack * Percentile(ttft[k], 99), TPOT: slack * Percentile(tpot[k], 99)}
	}
	return out
}

// Attain counts the requests within their SLO; an unfinished request misses both.
func Attain(r Result, slos []SLO) Attainment {
	if len(r.Outcomes) == 0 {
		return Attainment{}
	}
	var a, b, c int
	for _, o := range r.Outcomes {
		okT := o.Finished && o.TTFT <= slos[o.Service].TTFT
		okP := o.Finished && o.TPOT <= slos[o.Service].TPOT
		if okT {
			a++
		}
		if okP {
			b++
		}
		if okT && okP {
			c++
		}
	}
	n := float64(len(r.Outcomes))
	return Attainment{TTFT: float64(a) / n, TPOT: float64(b) / n, Both: float64(c) / n}
}

// WaterFill gives each busy client min(its ceiling, an equal share of what is left): clients whose
// demands sum to at most 1 get their ceilings; otherwise they slow down together, each within its
// ceiling. This is the model of MPS SM contention (MPS doc: the active-thread percentage is a
// ceiling, not a reservation; the hardware scheduler fills idle SMs).
func WaterFill(ceilings []float64) []float64 {
	out := make([]float64, len(ceilings))
	left := 1.0
	idx := make([]int, len(ceilings))
	for i := range idx {
		idx[i] = i
	}
	sort.Slice(idx, func(a, b int) bool { return ceilings[idx[a]] < ceilings[idx[b]] })
	for n, i := range idx {
		fair := left / float64(len(idx)-n)
		g := math.Min(ceilings[i], fair)
		out[i] = g
		left -= g
	}
	return out
}

// Run runs one policy over the trace. Whole-peak's replica counts come from the trace's peak
// (it is the "sized for the peak" baseline); every other policy starts at one replica per
// service and learns from its own samples.
func Run(cfg Config, trace []fleet.Request, p Policy) Result {
	s := newSim(cfg, trace, p, false)
	s.run()
	return s.result()
}

type sim struct {
	cfg      Config
	p        Policy
	svcs     []*serviceState
	gpus     []*gpuState
	now      float64
	end      float64
	gpuUtil  []float64
	smAct    []float64
	gpuHours float64
	maxGPUs  int
	pods     int
	readyDur []float64
	all      []*request

	nextSample, nextResize, secAcc float64
}

func newSim(cfg Config, trace []fleet.Request, p Policy, live bool) *sim {
	s := &sim{cfg: cfg, p: p}
	s.svcs = make([]*serviceState, cfg.Services)
	for k := range s.svcs {
		s.svcs[k] = &serviceState{class: Classes[k%len(Classes)]}
	}
	for i, tr := range trace {
		k := ServiceOf(i, cfg.Services, cfg.ZipfS)
		r := &request{svc: k, arrival: tr.At.Seconds(), ctx: tr.ContextTokens, gen: max(1, tr.GeneratedTokens),
			firstTok: -1, finish: -1}
		r.prefillLeft = s.svcs[k].class.PrefillSeconds(r.ctx, 1)
		s.svcs[k].reqs = append(s.svcs[k].reqs, r)
		s.all = append(s.all, r)
	}
	if len(trace) > 0 {
		s.end = trace[len(trace)-1].At.Seconds() + 1
	}
	for k, sv := range s.svcs {
		if p.Fixed.RequestPercent > 0 {
			sv.rec, sv.haveRec = p.Fixed, true
		}
		if live {
			continue // the caller adds the replicas
		}
		n := 1
		if p.Name == "whole-peak" {
			n = peakReplicas(sv, cfg.PeakReplicaBatch)
		}
		for i := 0; i < n; i++ {
			s.addReplica(k, 0, true)
		}
	}
	return s
}

// peakReplicas: the peak over 60 s windows of the service's offered concurrency on a whole GPU
// (Little's law: Σ isolated durations of the window's arrivals / 60 s) over PeakReplicaBatch.
func peakReplicas(sv *serviceState, perReplica int) int {
	win := map[int]float64{}
	for _, r := range sv.reqs {
		d := sv.class.PrefillSeconds(r.ctx, 1) + float64(r.gen)*sv.class.DecodeStepSeconds(1, 1, 1)
		win[int(r.arrival/60)] += d / 60
	}
	var peak float64
	for _, v := range win {
		peak = math.Max(peak, v)
	}
	return max(1, int(math.Ceil(peak/float64(perReplica))))
}

// size is the device the policy gives a new replica of service k now.
func (s *sim) size(k int) (request, ceiling, mem float64, mig MIGProfile) {
	sv := s.svcs[k]
	whole := MIGProfiles[len(MIGProfiles)-1]
	if (!s.p.Sized && s.p.Fixed.RequestPercent == 0) || !sv.haveRec {
		return 1, 1, GPUMemBytes, whole
	}
	req := float64(sv.rec.RequestPercent) / 100
	mem = float64(sv.rec.MemoryBytes)
	switch s.p.Kind {
	case KindMIG:
		m := SmallestMIGProfile(mem, sv.rec.RequestPercent)
		return float64(m.SMs) / GPUSMs, float64(m.SMs) / GPUSMs, m.MemoryBytes, m
	case KindTimeSlice:
		return 0, 1, mem, whole
	}
	ceiling = float64(sv.rec.CeilingPercent) / 100
	if s.p.Guaranteed {
		ceiling = req
	}
	return req / s.p.Overcommit, ceiling, mem, whole
}

func (s *sim) fits(g *gpuState, req, mem float64, mig MIGProfile) bool {
	if len(g.replicas) == 0 {
		return true
	}
	switch s.p.Kind {
	case KindWhole:
		return false
	case KindMIG:
		// Simplification: slices fit while compute (7) and memory (8) slices last; the real
		// placement rules of H100 MIG are stricter.
		return g.gSum+mig.ComputeG <= 7 && g.mSlices+mig.MemSlices <= 8
	case KindTimeSlice:
		return g.memSum+mem <= GPUMemBytes && len(g.replicas) < 48
	}
	return g.reqSum+req <= 1+1e-9 && g.memSum+mem <= GPUMemBytes && len(g.replicas) < 48
}

func (s *sim) addReplica(k int, now float64, warm bool) *replica {
	readyAt := now + s.svcs[k].class.ReadySeconds(s.p.Kind)
	if warm {
		readyAt = 0
	} else {
		s.readyDur = append(s.readyDur, readyAt-now)
	}
	return s.place(k, readyAt, -1)
}

// place puts a new replica of service k on GPU gi, or first-fit when gi < 0 (a new GPU when none
// fits); it serves from readyAt.
func (s *sim) place(k int, readyAt float64, gi int) *replica {
	req, ceil, mem, mig := s.size(k)
	return s.placeAs(k, readyAt, gi, req, ceil, mem, mig)
}

// placeAs is place with the device's size given (the live loop's replicas hold the size their
// claim was made with).
func (s *sim) placeAs(k int, readyAt float64, gi int, req, ceil, mem float64, mig MIGProfile) *replica {
	r := &replica{svc: k, request: req, ceiling: ceil, mem: mem, mig: mig, readyAt: readyAt}
	r.retireAt = math.Inf(1)
	for i := 0; gi < 0 && i < len(s.gpus); i++ {
		if s.fits(s.gpus[i], req, mem, mig) {
			gi = i
		}
	}
	if gi < 0 {
		s.gpus = append(s.gpus, &gpuState{})
		gi = len(s.gpus) - 1
	}
	g := s.gpus[gi]
	r.gpu = gi
	g.replicas = append(g.replicas, r)
	g.reqSum += req
	g.memSum += mem
	g.gSum += mig.ComputeG
	g.mSlices += mig.MemSlices
	s.svcs[k].replicas = append(s.svcs[k].replicas, r)
	s.pods++
	return r
}

func (s *sim) removeReplica(r *replica) {
	g := s.gpus[r.gpu]
	for i, x := range g.replicas {
		if x == r {
			g.replicas = append(g.replicas[:i], g.replicas[i+1:]...)
			break
		}
	}
	g.reqSum -= r.request
	g.memSum -= r.mem
	g.gSum -= r.mig.ComputeG
	g.mSlices -= r.mig.MemSlices
	sv := s.svcs[r.svc]
	for i, x := range sv.replicas {
		if x == r {
			sv.replicas = append(sv.replicas[:i], sv.replicas[i+1:]...)
			break
		}
	}
}

func (s *sim) serving(r *replica) bool { return !r.retiring && r.readyAt <= s.now }

// route sends q to the serving replica with the fewest outstanding requests (join-shortest-queue).
func (s *sim) route(q *request) {
	sv := s.svcs[q.svc]
	var best *replica
	for _, r := range sv.replicas {
		if s.serving(r) && (best == nil || r.load() < best.load()) {
			best = r
		}
	}
	if best == nil {
		sv.pending = append(sv.pending, q)
		return
	}
	best.queue = append(best.queue, q)
}

func (s *sim) retire(r *replica) {
	if r.retiring {
		return
	}
	r.retiring = true
	q := r.queue
	r.queue = nil
	for _, x := range q {
		if x.prefillLeft < s.svcs[x.svc].class.PrefillSeconds(x.ctx, 1) {
			x.prefillLeft = s.svcs[x.svc].class.PrefillSeconds(x.ctx, 1)
		}
		s.route(x)
	}
}

func (s *sim) run() {
	s.nextSample = s.cfg.SampleSeconds
	s.nextResize = s.cfg.LearnSeconds
	limit := s.end + s.cfg.DrainSeconds
	for s.now = 0; s.now < limit; s.now += s.cfg.Tick {
		if s.now >= s.end && s.allDone() {
			break
		}
		s.tick()
	}
}

// tick runs one Tick at s.now: retirements, routing, every GPU held, the per-second DCGM samples,
// the claim-use samples (and the HPA, where the policy scales), re-sizing, and the removal of
// drained replicas.
func (s *sim) tick() {
	dt := s.cfg.Tick
	for _, sv := range s.svcs {
		for _, r := range sv.replicas {
			if !r.retiring && r.retireAt <= s.now {
				s.retire(r)
			}
		}
		if len(sv.pending) > 0 {
			p := sv.pending
			sv.pending = nil
			for _, q := range p {
				s.route(q)
			}
		}
		for sv.next < len(sv.reqs) && sv.reqs[sv.next].arrival < s.now+dt {
			s.route(sv.reqs[sv.next])
			sv.next++
		}
	}
	held := 0
	for _, g := range s.gpus {
		if len(g.replicas) == 0 {
			continue
		}
		held++
		s.step(g, dt)
	}
	s.gpuHours += float64(held) * dt / 3600
	s.maxGPUs = max(s.maxGPUs, held)
	s.secAcc += dt
	if s.secAcc >= 1-1e-9 {
		s.secAcc = 0
		for _, g := range s.gpus {
			if len(g.replicas) > 0 && g.accTicks > 0 {
				s.gpuUtil = append(s.gpuUtil, g.utilAcc/float64(g.accTicks))
				s.smAct = append(s.smAct, g.smAcc/float64(g.accTicks))
			}
			g.utilAcc, g.smAcc, g.accTicks = 0, 0, 0
		}
	}
	if s.now+dt >= s.nextSample {
		s.sample(s.nextSample)
		s.nextSample += s.cfg.SampleSeconds
	}
	if s.p.Sized && s.now+dt >= s.nextResize {
		s.resize(s.nextResize)
		s.nextResize += s.cfg.ResizeSeconds
	}
	for _, sv := range s.svcs {
		for _, r := range append([]*replica(nil), sv.replicas...) {
			if r.retiring && r.load() == 0 {
				s.removeReplica(r)
			}
		}
	}
}

func (s *sim) allDone() bool {
	for _, r := range s.all {
		if r.finish < 0 {
			return false
		}
	}
	return true
}

// step runs one tick of one GPU: contention, then each busy replica's work, then DCGM accounting.
func (s *sim) step(g *gpuState, dt float64) {
	var busy []*replica
	for _, r := range g.replicas {
		r.used, r.grant = 0, 0
		if r.readyAt <= s.now && r.load() > 0 {
			busy = append(busy, r)
		}
	}
	var util, sm float64
	switch s.p.Kind {
	case KindMIG:
		for _, r := range busy {
			sf := float64(r.mig.SMs) / GPUSMs
			r.grant = sf
			r.used = s.work(r, dt, sf, float64(r.mig.MemSlices)/8)
			// GR_ENGINE_ACTIVE per instance, weighted by its compute slices out of 7.
			util += r.used / dt * float64(r.mig.ComputeG) / 7
			sm += sf * r.used / dt
		}
	case KindTimeSlice:
		n := float64(len(busy))
		slice := dt
		if n > 1 {
			slice = dt * (1 - TimeSliceOverhead) / n
		}
		for _, r := range busy {
			r.grant = 1
			r.used = s.work(r, slice, 1, 1)
			util += r.used / dt
			sm += r.used / dt
		}
		if n > 1 {
			util += TimeSliceOverhead // switching time counts as GPU time
		}
	default:
		ceil := make([]float64, len(busy))
		for i, r := range busy {
			ceil[i] = r.ceiling
		}
		grants := WaterFill(ceil)
		// HBM is shared and not partitioned by MPS: decoding clients' bandwidth demands
		// min(1, s/knee) are scaled down together when they sum above 1.
		var demand float64
		for i, r := range busy {
			if len(r.active) > 0 {
				demand += math.Min(1, grants[i]/BandwidthKnee)
			}
		}
		for i, r := range busy {
			bw := 1.0
			if demand > 1 {
				bw = math.Min(1, grants[i]/BandwidthKnee) / demand
			}
			r.grant = grants[i]
			r.used = s.work(r, dt, grants[i], bw)
			// GPU_UTIL: a kernel of any client runs; clients with work run concurrently.
			util = math.Max(util, r.used/dt)
			sm += grants[i] * r.used / dt
		}
	}
	g.utilAcc += math.Min(1, util)
	g.smAcc += math.Min(1, sm)
	g.accTicks++
	for _, r := range g.replicas {
		r.uAcc += r.grant * r.used / dt
		r.loadAcc += float64(r.load())
		r.accTicks++
		r.liveU += r.grant * r.used / dt
		r.liveLoad += float64(r.load())
		r.liveTicks++
		r.memMax = math.Max(r.memMax, s.svcs[r.svc].class.MemoryBytes(r.resident()))
		r.liveMem = math.Max(r.liveMem, s.svcs[r.svc].class.MemoryBytes(r.resident()))
	}
}

// work runs replica r for budget seconds with SM fraction sf and HBM fraction bw; it returns the
// time it had kernels running. Prefill goes first (FIFO), then decode steps of the whole batch.
func (s *sim) work(r *replica, budget, sf, bw float64) float64 {
	cls := s.svcs[r.svc].class
	t := 0.0
	for t < budget && len(r.queue) > 0 && len(r.active) < MaxBatch {
		q := r.queue[0]
		if cls.MemoryBytes(r.resident()+float64(q.ctx+q.gen)) > r.mem && len(r.active) > 0 {
			break // KV cache full within the memory limit: wait for a sequence to finish
		}
		need := q.prefillLeft / sf
		if need <= budget-t {
			t += need
			q.prefillLeft = 0
			q.firstTok = s.now + t
			q.tokens = 1
			r.queue = r.queue[1:]
			if q.gen <= 1 {
				q.finish = q.firstTok
			} else {
				r.active = append(r.active, q)
			}
		} else {
			q.prefillLeft -= (budget - t) * sf
			t = budget
		}
	}
	if t < budget && len(r.active) > 0 {
		step := cls.DecodeStepSeconds(len(r.active), sf, bw)
		rem := budget - t
		steps := rem / step
		var maxNeed float64
		keep := r.active[:0]
		for _, a := range r.active {
			need := float64(a.gen) - a.tokens
			maxNeed = math.Max(maxNeed, need)
			if need <= steps {
				a.tokens = float64(a.gen)
				a.finish = s.now + t + need*step
			} else {
				a.tokens += steps
				keep = append(keep, a)
			}
		}
		for i := len(keep); i < len(r.active); i++ {
			r.active[i] = nil
		}
		r.active = keep
		t += math.Min(rem, maxNeed*step)
	}
	return t
}

// sample records each serving replica's claim use since the last sample (tessera's
// tessera_claim_gpu_utilization_ratio: SM-time used in whole-GPU units) and peak memory; the
// HPA syncs on the same samples.
func (s *sim) sample(at float64) {
	for k, sv := range s.svcs {
		var ratios []float64
		unready := 0
		current := 0
		for _, r := range sv.replicas {
			if r.retiring || r.retireAt < math.Inf(1) {
				continue
			}
			current++
			if r.readyAt > at {
				unready++
				r.uAcc, r.accTicks, r.memMax, r.loadAcc = 0, 0, 0, 0
				continue
			}
			u, conc := 0.0, 0.0
			if r.accTicks > 0 {
				u = r.uAcc / float64(r.accTicks)
				conc = r.loadAcc / float64(r.accTicks)
			}
			sv.sampleAt = append(sv.sampleAt, at)
			sv.sampleU = append(sv.sampleU, u)
			sv.sampleM = append(sv.sampleM, r.memMax)
			// The HPA metric is the engine's concurrent requests (queued + running, as vLLM's
			// num_requests_running + num_requests_waiting that KEDA scalers read) per replica over
			// the target scaled by the replica's ceiling (1 for whole GPUs, time-slicing and
			// burstable shares; the request for guaranteed shares; the SM share for MIG). GPU_UTIL or
			// SM-time would not do: one decoding sequence keeps a memory-bound engine's kernels
			// running, so they read ~1 at any load and an HPA on them scales out idle replicas.
			ratios = append(ratios, conc/math.Max(r.ceiling, 0.05))
			r.uAcc, r.accTicks, r.memMax, r.loadAcc = 0, 0, 0, 0
		}
		if s.p.HPA && at < s.end {
			s.autoscale(k, at, current, unready, ratios)
		}
	}
}

// autoscale is the Kubernetes HPA algorithm (as KEDA drives it): ratio = mean metric / target;
// within tolerance keep; scale-up limited to max(2×, +4) per sync; scale-down to the largest
// recommendation of the stabilization window; clamped to [1, MaxReplicas].
func (s *sim) autoscale(k int, at float64, current, unready int, ratios []float64) {
	sv := s.svcs[k]
	if len(ratios) == 0 {
		return
	}
	var sum float64
	for _, x := range ratios {
		sum += x
	}
	ratio := sum / float64(len(ratios)) / s.cfg.HPATarget
	want := current
	if math.Abs(ratio-1) > s.cfg.HPATolerance {
		want = int(math.Ceil(ratio * float64(len(ratios))))
		if want > current && unready > 0 {
			// not-Ready pods count with metric 0
			r2 := sum / float64(len(ratios)+unready) / s.cfg.HPATarget
			if r2 <= 1 {
				want = current
			} else {
				want = int(math.Ceil(r2 * float64(current)))
			}
		}
	}
	want = min(want, max(2*current, current+4))
	want = max(1, min(s.cfg.MaxReplicas, want))
	sv.hpaRecs = append(sv.hpaRecs, hpaRec{at, want})
	keep := sv.hpaRecs[:0]
	stab := want
	for _, r := range sv.hpaRecs {
		if r.at >= at-s.cfg.ScaleDownWindow {
			keep = append(keep, r)
			stab = max(stab, r.n)
		}
	}
	sv.hpaRecs = keep
	if want < current {
		want = min(current, stab)
	}
	for n := current; n < want; n++ {
		s.addReplica(k, at, false)
	}
	for n := current; n > want; n-- {
		// newest first
		for i := len(sv.replicas) - 1; i >= 0; i-- {
			r := sv.replicas[i]
			if !r.retiring && r.retireAt == math.Inf(1) {
				s.retire(r)
				break
			}
		}
	}
}

// resize re-sizes every service from its samples of the last SizingWindowSeconds; a service whose
// recommendation changed gets its replicas replaced make-before-break (the old ones serve until
// the new ones are Ready).
func (s *sim) resize(at float64) {
	for k, sv := range s.svcs {
		var u, m []float64
		for i, t := range sv.sampleAt {
			if t > at-s.cfg.SizingWindowSeconds {
				u = append(u, sv.sampleU[i])
				m = append(m, sv.sampleM[i])
			}
		}
		rec, err := Rightsize(u, m)
		if err != nil || (sv.haveRec && rec == sv.rec) {
			continue
		}
		sv.rec, sv.haveRec = rec, true
		var old []*replica
		for _, r := range sv.replicas {
			if !r.retiring && r.retireAt == math.Inf(1) {
				old = append(old, r)
			}
		}
		for _, r := range old {
			n := s.addReplica(k, at, false)
			r.retireAt = n.readyAt
		}
	}
}

func (s *sim) result() Result {
	res := Result{Policy: s.p, GPUUtil: statsOf(s.gpuUtil), SMActive: statsOf(s.smAct), GPUHours: s.gpuHours,
		MaxGPUs: s.maxGPUs, PodsCreated: s.pods, Requests: len(s.all)}
	if len(s.readyDur) > 0 {
		d := append([]float64(nil), s.readyDur...)
		sort.Float64s(d)
		res.ReadySecondsP50 = Percentile(d, 50)
	}
	for _, r := range s.all {
		o := RequestOutcome{Service: r.svc, TTFT: -1, Finished: r.finish >= 0}
		if r.firstTok >= 0 {
			o.TTFT = r.firstTok - r.arrival
		}
		if o.Finished {
			res.Finished++
			if r.gen > 1 {
				o.TPOT = (r.finish - r.firstTok) / float64(r.gen-1)
			}
		}
		res.Outcomes = append(res.Outcomes, o)
	}
	return res
}

// String is a one-line summary for logs.
func (r Result) String() string {
	return fmt.Sprintf("%s: util %.3f sm %.3f gpu-h %.2f pods %d finished %d/%d", r.Policy.Name, r.GPUUtil.Mean,
		r.SMActive.Mean, r.GPUHours, r.PodsCreated, r.Finished, r.Requests)
}
