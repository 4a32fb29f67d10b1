package fleet

import (
	"sort"
	"time"
)

// ReplicaID names one replica (a pod) of a service.
type ReplicaID string

// Replica is a Ready replica as the caller reports it: its ID and the fraction of
// one GPU it holds (1 for a whole GPU, f for an MPS share).
type Replica struct {
	ID       ReplicaID
	Fraction float64
}

// Usage is one replica's load over one tick.
type Usage struct {
	// Busy is the fraction of the replica's own capacity in use over the tick
	// (mean occupied batch slots / slots), 0–1.
	Busy float64
	// GPUUtil is the utilization of the WHOLE GPU the plugin reports for the
	// replica's claim, 0–1: Busy * Fraction (Busy for a whole GPU).
	GPUUtil float64
	// Running and Queued are the requests in service and waiting at the tick's end.
	Running, Queued int
}

// Percent is GPUUtil as the integer percentage `simulate load --util` takes.
func (u Usage) Percent() int {
	p := int(u.GPUUtil*100 + 0.5)
	if p > 100 {
		p = 100
	}
	return p
}

type job struct {
	seq       int
	arrive    float64 // trace seconds
	work      float64 // slot-seconds on a whole GPU
	remaining float64
	restarts  int
}

type replica struct {
	id         ReplicaID
	frac       float64
	slots      int
	active     []*job
	queue      []*job
	queuedWork float64
	clock      float64 // trace seconds this replica has been advanced to
	busy       float64 // slot-occupancy integral over the current tick, seconds
}

// backlog is the time, at this replica's rate, to finish everything it holds.
func (r *replica) backlog() float64 {
	w := r.queuedWork
	for _, j := range r.active {
		w += j.remaining
	}
	return w / (float64(r.slots) * r.frac)
}

func (r *replica) admit(j *job) {
	if len(r.active) < r.slots {
		r.active = append(r.active, j)
		return
	}
	r.queue = append(r.queue, j)
	r.queuedWork += j.work
}

const eps = 1e-9

// advance serves the replica's batch from r.clock to t, calling done for each
// completion at its exact time.
func (r *replica) advance(t float64, done func(j *job, at float64, r *replica)) {
	for r.clock < t-eps {
		if len(r.active) == 0 {
			r.clock = t
			return
		}
		minRem := r.active[0].remaining
		for _, j := range r.active[1:] {
			minRem = min(minRem, j.remaining)
		}
		dt := minRem / r.frac
		if r.clock+dt > t {
			dt = t - r.clock
		}
		for _, j := range r.active {
			j.remaining -= dt * r.frac
		}
		r.busy += dt * float64(len(r.active)) / float64(r.slots)
		r.clock += dt
		kept := r.active[:0]
		var finished []*job
		for _, j := range r.active {
			if j.remaining <= eps {
				finished = append(finished, j)
			} else {
				kept = append(kept, j)
			}
		}
		r.active = kept
		for _, j := range finished {
			done(j, r.clock, r)
		}
		for len(r.active) < r.slots && len(r.queue) > 0 {
			j := r.queue[0]
			r.queue = r.queue[1:]
			r.queuedWork -= j.work
			r.active = append(r.active, j)
		}
	}
	if r.clock < t {
		r.clock = t
	}
}

type service struct {
	name     string
	reqs     []Request
	next     int
	pending  []*job // arrived while the service had no Ready replica
	replicas []*replica
}

// Fleet is the model of a set of services, a join-shortest-queue router per
// service, and their replicas. It is driven tick by tick with Step.
type Fleet struct {
	cfg      Config
	services []*service
	byName   map[string]*service
	clock    float64 // trace seconds
	seq      int

	arrived, served, dropped, withinTarget, withinWhole, restarts int
	queueing, latency                                             []float64
}

// New makes a fleet serving services under cfg (defaults applied). cfg.Trace is
// not used; the services carry their requests.
func New(cfg Config, services []Service) *Fleet {
	cfg = cfg.WithDefaults()
	f := &Fleet{cfg: cfg, byName: map[string]*service{}}
	for _, s := range services {
		st := &service{name: s.Name, reqs: s.Requests}
		f.services = append(f.services, st)
		f.byName[s.Name] = st
	}
	return f
}

// Step advances the model to wall time now (since the run's start) and returns
// each Ready replica's usage over the tick since the previous Step.
//
// replicas lists, per service name, the replicas that are Ready for this tick,
// with their GPU fraction. A replica not seen before starts empty. A replica that
// was listed before and is missing now has disappeared: its waiting requests are
// re-routed (join-shortest-queue, in arrival order) to the service's remaining
// replicas, and the requests it was serving start again from the beginning
// elsewhere (as a client retry would; the lost time counts in their latency). If
// a service has no Ready replica, its requests wait at the service and are routed
// when one appears, or dropped after cfg.MaxPending.
//
// Arrivals are routed at their exact trace times within the tick to the replica
// with the least outstanding work (remaining work of its batch and queue divided
// by its capacity; ties go to the replica listed first).
func (f *Fleet) Step(now time.Duration, replicas map[string][]Replica) map[ReplicaID]Usage {
	t0 := f.clock
	t1 := max(f.cfg.traceSeconds(now), t0)
	slots := f.cfg.Model.BatchSlots
	out := map[ReplicaID]Usage{}

	for _, s := range f.services {
		// Membership: keep listed replicas in the caller's order, collect the work of
		// the ones that disappeared.
		old := map[ReplicaID]*replica{}
		for _, r := range s.replicas {
			old[r.id] = r
		}
		var next []*replica
		seen := map[ReplicaID]bool{}
		for _, rr := range replicas[s.name] {
			if seen[rr.ID] {
				continue
			}
			seen[rr.ID] = true
			frac := rr.Fraction
			if frac <= 0 || frac > 1 {
				frac = 1
			}
			if r, ok := old[rr.ID]; ok {
				r.frac = frac
				next = append(next, r)
				continue
			}
			next = append(next, &replica{id: rr.ID, frac: frac, slots: slots, clock: t0})
		}
		var orphans []*job
		for _, r := range s.replicas {
			if seen[r.id] {
				continue
			}
			for _, j := range r.active {
				j.remaining = j.work
				j.restarts++
				f.restarts++
				orphans = append(orphans, j)
			}
			orphans = append(orphans, r.queue...)
		}
		s.replicas = next
		orphans = append(orphans, s.pending...)
		s.pending = nil
		sort.Slice(orphans, func(a, b int) bool { return orphans[a].seq < orphans[b].seq })
		for _, r := range s.replicas {
			r.busy = 0
		}
		for _, j := range orphans {
			f.route(s, j, t0)
		}

		// Arrivals in [t0, t1).
		for s.next < len(s.reqs) {
			req := s.reqs[s.next]
			at := req.At.Seconds()
			if at >= t1 {
				break
			}
			at = max(at, t0)
			s.next++
			f.arrived++
			w := f.cfg.Model.WorkSeconds(req)
			j := &job{seq: f.seq, arrive: req.At.Seconds(), work: w, remaining: w}
			f.seq++
			f.route(s, j, at)
		}
		for _, r := range s.replicas {
			r.advance(t1, f.complete)
		}

		// Drop requests that have waited too long for any replica.
		if len(s.pending) > 0 {
			limit := t1 - f.cfg.traceSeconds(f.cfg.MaxPending)
			kept := s.pending[:0]
			for _, j := range s.pending {
				if j.arrive < limit {
					f.dropped++
				} else {
					kept = append(kept, j)
				}
			}
			s.pending = kept
		}

		for _, r := range s.replicas {
			var busy float64
			if t1 > t0 {
				busy = min(r.busy/(t1-t0), 1)
			}
			out[r.id] = Usage{Busy: busy, GPUUtil: busy * r.frac, Running: len(r.active), Queued: len(r.queue)}
		}
	}
	f.clock = t1
	return out
}

// route advances the service's replicas to time at and hands j to the one with
// the least outstanding work, or parks it at the service if there is none.
func (f *Fleet) route(s *service, j *job, at float64) {
	if len(s.replicas) == 0 {
		s.pending = append(s.pending, j)
		return
	}
	var best *replica
	bestBacklog := 0.0
	for _, r := range s.replicas {
		r.advance(at, f.complete)
		b := r.backlog()
		if best == nil || b < bestBacklog-eps {
			best, bestBacklog = r, b
		}
	}
	best.admit(j)
}

func (f *Fleet) complete(j *job, at float64, r *replica) {
	f.served++
	lat := at - j.arrive
	svc := j.work / r.frac
	q := max(lat-svc, 0)
	f.latency = append(f.latency, lat)
	f.queueing = append(f.queueing, q)
	if lat <= f.cfg.SLOFactor*svc+f.cfg.SLOSlack.Seconds()+eps {
		f.withinTarget++
	}
	if lat <= f.cfg.SLOFactor*j.work+f.cfg.SLOSlack.Seconds()+eps {
		f.withinWhole++
	}
}

// Outstanding is the number of requests of a service that have arrived and are not
// finished or dropped (waiting at the service, queued or in service).
func (f *Fleet) Outstanding(service string) int {
	s := f.byName[service]
	if s == nil {
		return 0
	}
	n := len(s.pending)
	for _, r := range s.replicas {
		n += len(r.active) + len(r.queue)
	}
	return n
}

// Remaining is the number of a service's requests that have not arrived yet.
func (f *Fleet) Remaining(service string) int {
	s := f.byName[service]
	if s == nil {
		return 0
	}
	return len(s.reqs) - s.next
}

// Done reports whether every request has arrived and finished or been dropped.
func (f *Fleet) Done() bool {
	for _, s := range f.services {
		if f.Remaining(s.name) > 0 || f.Outstanding(s.name) > 0 {
			return false
		}
	}
	return true
}

// Summary is the fleet's request accounting so far. Times are trace time.
type Summary struct {
	// Requests is the number of requests in all services; Arrived of them have
	// arrived, Served finished, Dropped were dropped, InFlight are still held.
	Requests, Arrived, Served, Dropped, InFlight int
	// Restarts counts requests started again because their replica disappeared.
	Restarts int
	// WithinTarget is the fraction of settled requests (served + dropped) that
	// were served within latency <= SLOFactor * own service time (on the replica
	// that served it) + SLOSlack. Dropped requests count as misses.
	WithinTarget float64
	// WithinWholeGPUTarget is the same with the service time the request would
	// have had on a whole GPU, so it also charges a share's slower service.
	WithinWholeGPUTarget float64
	// Queueing delay (latency minus own service time) and latency percentiles.
	QueueP50, QueueP99, LatencyP50, LatencyP99 time.Duration
}

// Summary reports the accounting so far.
func (f *Fleet) Summary() Summary {
	s := Summary{Arrived: f.arrived, Served: f.served, Dropped: f.dropped, Restarts: f.restarts}
	for _, sv := range f.services {
		s.Requests += len(sv.reqs)
		s.InFlight += f.Outstanding(sv.name)
	}
	if settled := f.served + f.dropped; settled > 0 {
		s.WithinTarget = float64(f.withinTarget) / float64(settled)
		s.WithinWholeGPUTarget = float64(f.withinWhole) / float64(settled)
	}
	s.QueueP50 = seconds(percentile(f.queueing, 0.50))
	s.QueueP99 = seconds(percentile(f.queueing, 0.99))
	s.LatencyP50 = seconds(percentile(f.latency, 0.50))
	s.LatencyP99 = seconds(percentile(f.latency, 0.99))
	return s
}

// percentile is the nearest-rank p-quantile of xs (0 for none); xs is not modified.
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	c := append([]float64(nil), xs...)
	sort.Float64s(c)
	k := int(p*float64(len(c))+0.999999999) - 1
	k = min(max(k, 0), len(c)-1)
	return c[k]
}
