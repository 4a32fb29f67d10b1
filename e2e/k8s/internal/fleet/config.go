package fleet

import "time"

// Config holds every knob of the model, the live driver and the offline simulator.
//
// Time bases: the fleet model runs in TRACE time (the trace's own clock). A run
// compressed by Compress plays trace second t at wall second t/Compress, and all
// service times shrink by the same factor, so per-tick utilization is the same at
// any compression. Durations marked "wall" are what the cluster sees (the live
// driver's clock, the HPA's sync period, the pod ready delay); they are multiplied
// by Compress when the model needs them in trace time. Durations marked "trace"
// are in trace time.
type Config struct {
	// Trace is the request trace (ReadTrace). Used by Simulate; New takes services.
	Trace []Request
	// Services is the number of services SplitServices makes (default 8).
	Services int
	// Compress is the time compression factor: one trace hour plays in
	// 60/Compress wall minutes (default 1: the trace's own clock).
	Compress float64
	// Step is the wall duration of one tick (default 1 s).
	Step time.Duration
	// Model is the service-time model (zero value: DefaultModel).
	Model Model

	// TargetUtilization is the HPA average-utilization target, as a fraction of
	// each replica's own capacity (default 0.7). The whole-peak policy sizes for
	// its peak at the same target.
	TargetUtilization float64
	// Tolerance is the HPA tolerance (default 0.1; negative means none).
	Tolerance float64
	// SyncPeriod is the HPA sync period, wall (default 15 s, the
	// kube-controller-manager default).
	SyncPeriod time.Duration
	// StabilizationWindow is the HPA scale-down stabilization window, wall
	// (default 300 s of trace time, i.e. 300s/Compress wall).
	StabilizationWindow time.Duration
	// ReadyDelay is how long a new replica takes to become Ready, wall
	// (default 30 s, an assumption until measured on the cluster; negative means 0).
	ReadyDelay time.Duration
	// MaxReplicas caps each service (default 64).
	MaxReplicas int
	// ScaleToZero turns on KEDA-style activation: min replicas 0; a service whose
	// queue has been empty for Cooldown goes to 0; the first request activates it.
	ScaleToZero bool
	// Cooldown is KEDA's cooldownPeriod, wall (default 300 s of trace time).
	Cooldown time.Duration

	// PeakWindow is the trace-time window the whole-peak policy takes its peak
	// load over (default 60 s).
	PeakWindow time.Duration
	// ShareSizes are the MPS share fractions shares-hpa may choose from (default
	// 0.25, 0.5, 1).
	ShareSizes []float64

	// SLOFactor and SLOSlack define the per-request latency target, trace time:
	// latency <= SLOFactor * own service time + SLOSlack (defaults 2 and 1 s).
	SLOFactor float64
	SLOSlack  time.Duration
	// MaxPending is how long a request may wait for a service with no Ready
	// replica before it is dropped, wall (default 120 s).
	MaxPending time.Duration
	// DrainLimit is how long, in trace time, Simulate keeps running after the last
	// arrival to let queues empty; what is left then counts as dropped (default 1 h).
	DrainLimit time.Duration
}

// WithDefaults returns cfg with every zero field set to its default.
func (cfg Config) WithDefaults() Config {
	if cfg.Services <= 0 {
		cfg.Services = 8
	}
	if cfg.Compress <= 0 {
		cfg.Compress = 1
	}
	if cfg.Step <= 0 {
		cfg.Step = time.Second
	}
	cfg.Model = cfg.Model.withDefaults()
	if cfg.TargetUtilization <= 0 {
		cfg.TargetUtilization = 0.7
	}
	if cfg.Tolerance == 0 {
		cfg.Tolerance = 0.1
	} else if cfg.Tolerance < 0 {
		cfg.Tolerance = 0
	}
	if cfg.SyncPeriod <= 0 {
		cfg.SyncPeriod = 15 * time.Second
	}
	if cfg.StabilizationWindow <= 0 {
		cfg.StabilizationWindow = time.Duration(float64(300*time.Second) / cfg.Compress)
	}
	if cfg.ReadyDelay < 0 {
		cfg.ReadyDelay = 0
	} else if cfg.ReadyDelay == 0 {
		cfg.ReadyDelay = 30 * time.Second
	}
	if cfg.MaxReplicas <= 0 {
		cfg.MaxReplicas = 64
	}
	if cfg.Cooldown <= 0 {
		cfg.Cooldown = time.Duration(float64(300*time.Second) / cfg.Compress)
	}
	if cfg.PeakWindow <= 0 {
		cfg.PeakWindow = 60 * time.Second
	}
	if len(cfg.ShareSizes) == 0 {
		cfg.ShareSizes = []float64{0.25, 0.5, 1}
	}
	if cfg.SLOFactor <= 0 {
		cfg.SLOFactor = 2
	}
	if cfg.SLOSlack <= 0 {
		cfg.SLOSlack = time.Second
	}
	if cfg.MaxPending <= 0 {
		cfg.MaxPending = 120 * time.Second
	}
	if cfg.DrainLimit <= 0 {
		cfg.DrainLimit = time.Hour
	}
	return cfg
}

// traceSeconds converts a wall duration to trace seconds.
func (cfg Config) traceSeconds(wall time.Duration) float64 { return wall.Seconds() * cfg.Compress }
