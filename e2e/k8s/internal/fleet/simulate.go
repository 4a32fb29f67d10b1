package fleet

import (
	"fmt"
	"math"
	"sort"
	"time"
)

// Policy is an offline autoscaling policy.
type Policy string

const (
	// WholePeak gives each service a fixed number of whole GPUs, enough for its
	// peak: ceil(peak load / target utilization), where the peak load is the largest
	// whole-GPU load (Model.PeakLoadGPUs) over any PeakWindow of its trace.
	WholePeak Policy = "whole-peak"
	// WholeHPA scales whole-GPU replicas with the HPA algorithm (hpa.go) on the
	// replicas' average busy fraction.
	WholeHPA Policy = "whole-hpa"
	// SharesHPA scales MPS-share replicas of fraction f per service with the same
	// HPA; shares are packed first-fit onto GPUs and never span two.
	SharesHPA Policy = "shares-hpa"
)

// Policies lists the offline policies in table order.
var Policies = []Policy{WholePeak, WholeHPA, SharesHPA}

// Sample is the fleet at one tick.
type Sample struct {
	At          time.Duration // trace time at the tick's start
	Replicas    []int         // per service, Ready or starting
	GPUs        int           // GPUs holding at least one replica
	Busy        float64       // sum of GPUUtil over Ready replicas, in whole GPUs
	Utilization float64       // Busy / GPUs
}

// Result is one policy's offline run. Times are trace time.
type Result struct {
	Policy Policy
	// ShareFractions is the GPU fraction each service's replicas hold.
	ShareFractions []float64
	// Utilization of allocated GPU capacity, sampled per tick over the trace
	// (total GPU busy / GPUs allocated at that tick).
	UtilMean, UtilP10, UtilP50, UtilP90 float64
	// GPUHours is the integral of GPUs allocated over the trace's span, trace time.
	GPUHours float64
	// MaxGPUs is the most GPUs allocated at any tick.
	MaxGPUs int
	// Request accounting (Summary): within-target fractions count drops as misses.
	Requests, Served, Dropped, Restarts int
	WithinTarget, WithinWholeGPUTarget  float64
	QueueP50, QueueP99, LatencyP99      time.Duration
	// PodsCreated counts every replica ever made (the initial ones included);
	// ScaleEvents counts (service, sync) pairs whose replica count changed.
	PodsCreated, ScaleEvents int
	Samples                  []Sample
}

type simReplica struct {
	id       ReplicaID
	frac     float64
	created  float64 // trace seconds
	readyAt  float64 // trace seconds
	gpu      int
	busySum  float64 // sum of per-tick Busy since the last sync, while Ready
	busyTick int
}

type simService struct {
	name     string
	frac     float64
	replicas []*simReplica
	hpa      *hpa
	lastBusy float64 // trace seconds when it last had outstanding requests
}

// packer places replicas first-fit onto GPUs; a replica never spans two GPUs and
// a placed replica never moves.
type packer struct{ used []float64 }

func (p *packer) place(frac float64) int {
	for i, u := range p.used {
		if u+frac <= 1+eps {
			p.used[i] += frac
			return i
		}
	}
	p.used = append(p.used, frac)
	return len(p.used) - 1
}

func (p *packer) remove(gpu int, frac float64) {
	p.used[gpu] -= frac
	if p.used[gpu] < eps {
		p.used[gpu] = 0
	}
}

func (p *packer) gpus() int {
	n := 0
	for _, u := range p.used {
		if u > eps {
			n++
		}
	}
	return n
}

// shareFraction picks a service's share: the largest size s with s*target <=
// mean load (in whole GPUs), so that one replica at the target carries no more
// than the service's typical load and the service runs at least one replica at
// or under the target at its mean; the smallest size if even that is too big.
func shareFraction(sizes []float64, meanLoad, target float64) float64 {
	s := append([]float64(nil), sizes...)
	sort.Float64s(s)
	best := s[0]
	for _, f := range s {
		if f*target <= meanLoad+eps {
			best = f
		}
	}
	return best
}

// Simulate runs one policy over cfg.Trace split into cfg.Services services.
// Every replica present at the start is Ready at time 0 (a warm start): whole-peak
// at its fixed count, the HPA policies at ceil(mean load / (f * target)).
// Plan is how a policy starts one service: the GPU fraction of each replica (1, or the MPS share's f) and
// the replicas it starts with.
type Plan struct {
	Service  Service
	Fraction float64
	Replicas int
}

// Plans sizes every service of cfg's trace for policy: whole-peak its peak window's load over the target,
// the autoscaled policies its mean load over the target (in replicas of its fraction), at least 1.
func Plans(cfg Config, policy Policy) []Plan {
	cfg = cfg.WithDefaults()
	m, target := cfg.Model, cfg.TargetUtilization
	var out []Plan
	for _, sv := range SplitServices(cfg.Trace, cfg.Services) {
		p := Plan{Service: sv, Fraction: 1}
		mean := m.LoadGPUs(sv.Requests, TraceSpan(cfg.Trace))
		switch policy {
		case WholePeak:
			p.Replicas = int(math.Ceil(m.PeakLoadGPUs(sv.Requests, cfg.PeakWindow)/target - eps))
		case SharesHPA:
			p.Fraction = shareFraction(cfg.ShareSizes, mean, target)
			fallthrough
		default:
			p.Replicas = int(math.Ceil(mean/(p.Fraction*target) - eps))
		}
		p.Replicas = min(max(p.Replicas, 1), cfg.MaxReplicas)
		out = append(out, p)
	}
	return out
}

func Simulate(cfg Config, policy Policy) Result {
	cfg = cfg.WithDefaults()
	services := SplitServices(cfg.Trace, cfg.Services)
	span := TraceSpan(cfg.Trace).Seconds()
	fl := New(cfg, services)
	target := cfg.TargetUtilization

	res := Result{Policy: policy}
	var pk packer
	sims := make([]*simService, len(services))
	nextID := 0
	create := func(s *simService, now, readyAt float64) {
		r := &simReplica{id: ReplicaID(fmt.Sprintf("%s-%d", s.name, nextID)), frac: s.frac, created: now, readyAt: readyAt}
		nextID++
		r.gpu = pk.place(r.frac)
		s.replicas = append(s.replicas, r)
		res.PodsCreated++
	}
	minReplicas := 1
	if cfg.ScaleToZero {
		minReplicas = 0
	}
	for i, plan := range Plans(cfg, policy) {
		s := &simService{name: plan.Service.Name, frac: plan.Fraction}
		if policy != WholePeak {
			s.hpa = &hpa{target: target, tolerance: cfg.Tolerance, min: minReplicas, max: cfg.MaxReplicas,
				window: cfg.traceSeconds(cfg.StabilizationWindow)}
		}
		for range plan.Replicas {
			create(s, 0, 0)
		}
		sims[i] = s
		res.ShareFractions = append(res.ShareFractions, s.frac)
	}

	step := cfg.traceSeconds(cfg.Step)
	syncTicks := max(int(math.Round(float64(cfg.SyncPeriod)/float64(cfg.Step))), 1)
	readyDelay := cfg.traceSeconds(cfg.ReadyDelay)
	cooldown := cfg.traceSeconds(cfg.Cooldown)
	var util []float64
	var gpuSeconds float64

	for k := 0; ; k++ {
		now := float64(k) * step
		if k > 0 && k%syncTicks == 0 && policy != WholePeak {
			for _, s := range sims {
				current := len(s.replicas)
				var ready []float64
				unready := 0
				for _, r := range s.replicas {
					if r.readyAt <= now && r.busyTick > 0 {
						ready = append(ready, r.busySum/float64(r.busyTick))
					} else {
						unready++ // not Ready yet, or no metric yet
					}
					r.busySum, r.busyTick = 0, 0
				}
				var desired int
				switch {
				case cfg.ScaleToZero && current == 0:
					if fl.Outstanding(s.name) > 0 {
						desired = 1
					}
				case cfg.ScaleToZero && now-s.lastBusy >= cooldown:
					desired = 0
				default:
					desired = s.hpa.decide(now, current, ready, unready)
					if cfg.ScaleToZero {
						desired = max(desired, 1)
					}
				}
				if desired == current {
					continue
				}
				res.ScaleEvents++
				for range desired - current {
					create(s, now, now+readyDelay)
				}
				if desired < current {
					// Remove not-Ready replicas first, then the newest.
					sort.SliceStable(s.replicas, func(a, b int) bool {
						ra, rb := s.replicas[a], s.replicas[b]
						if (ra.readyAt > now) != (rb.readyAt > now) {
							return ra.readyAt <= now
						}
						return ra.created < rb.created
					})
					for _, r := range s.replicas[desired:] {
						pk.remove(r.gpu, r.frac)
					}
					s.replicas = s.replicas[:desired]
				}
			}
		}

		readyMap := map[string][]Replica{}
		for _, s := range sims {
			for _, r := range s.replicas {
				if r.readyAt <= now {
					readyMap[s.name] = append(readyMap[s.name], Replica{ID: r.id, Fraction: r.frac})
				}
			}
		}
		usage := fl.Step(time.Duration(k+1)*cfg.Step, readyMap)

		var busy float64
		counts := make([]int, len(sims))
		for i, s := range sims {
			counts[i] = len(s.replicas)
			if fl.Outstanding(s.name) > 0 {
				s.lastBusy = now + step
			}
			for _, r := range s.replicas {
				if u, ok := usage[r.id]; ok {
					r.busySum += u.Busy
					r.busyTick++
					busy += u.GPUUtil
				}
			}
		}
		if now < span {
			g := pk.gpus()
			dt := min(step, span-now)
			gpuSeconds += float64(g) * dt
			res.MaxGPUs = max(res.MaxGPUs, g)
			u := 0.0
			if g > 0 {
				u = busy / float64(g)
			}
			util = append(util, u)
			res.Samples = append(res.Samples, Sample{At: seconds(now), Replicas: counts, GPUs: g, Busy: busy, Utilization: u})
		}
		end := now + step
		if end >= span && fl.Done() {
			break
		}
		if end >= span+cfg.DrainLimit.Seconds() {
			break
		}
	}

	sum := fl.Summary()
	res.Requests, res.Served, res.Restarts = sum.Requests, sum.Served, sum.Restarts
	res.Dropped = sum.Dropped + sum.InFlight + (sum.Requests - sum.Arrived)
	settled := res.Served + res.Dropped
	if settled > 0 && sum.Served+sum.Dropped > 0 {
		// Re-base the fractions so requests never settled count as misses too.
		scale := float64(sum.Served+sum.Dropped) / float64(settled)
		res.WithinTarget = sum.WithinTarget * scale
		res.WithinWholeGPUTarget = sum.WithinWholeGPUTarget * scale
	}
	res.QueueP50, res.QueueP99, res.LatencyP99 = sum.QueueP50, sum.QueueP99, sum.LatencyP99
	res.GPUHours = gpuSeconds / 3600
	var total float64
	for _, u := range util {
		total += u
	}
	if len(util) > 0 {
		res.UtilMean = total / float64(len(util))
	}
	res.UtilP10, res.UtilP50, res.UtilP90 = percentile(util, 0.10), percentile(util, 0.50), percentile(util, 0.90)
	return res
}
