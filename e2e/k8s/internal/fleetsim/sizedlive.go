package fleetsim

import (
	"fmt"
	"time"
)

// The live run of the sized burstable policy (issue 39 item 5, `make bench-fleet TRACE=<file>`): the
// real node replays a trace with Prometheus, KEDA, the HPA and kube-scheduler in the loop, and each
// service's share is sized the way a user would size it, by `kubectl tessera rightsize` against the
// run's own Prometheus, on the schedule and with the rule the offline model's burstable-hpa policy
// uses (DefaultConfig, Rightsize). Every rule here is fixed before the trace is read.

// LiveSizedPolicy is the offline model's burstable-hpa: MPS shares with a 100 % ceiling, requests from
// the sizing rule learned online, scaled by the HPA on concurrent requests.
func LiveSizedPolicy() Policy {
	for _, p := range Policies {
		if p.Name == "burstable-hpa" {
			return p
		}
	}
	panic("fleetsim: Policies lost burstable-hpa")
}

// InitialShare is what a sized service runs on before its first sizing, as the model's size() gives
// it: the whole GPU's compute packed and as ceiling, and the GPU's memory, in whole GiB rounded down
// (a claim asks for whole GiB, and more than the GPU has is never allocated).
var InitialShare = Recommendation{RequestPercent: 100, CeilingPercent: 100, MemoryBytes: int64(GPUMemBytes) / gib * gib}

// LiveSizedServices is how many services a live run of the sized policy has on a node with gpus
// MPS-shared GPUs: the offline model's 24 where the node holds them, else half the GPUs. Every service
// starts on InitialShare (a whole GPU's request), so a service needs one GPU to start; the other half
// is the room the HPA's scale-outs and the re-sizing's make-before-break replacements need before the
// shares shrink (without it a rollout's new pod waits for a GPU the old pod holds, for ever).
func LiveSizedServices(gpus int) int {
	return max(1, min(DefaultConfig().Services, gpus/2))
}

// LiveSizedConfig is DefaultConfig (the offline run's sampling, learning, re-sizing and sizing window,
// HPA target, tolerance and scale-down window) with the services the node holds and a replica cap that
// keeps every service's replicas on its GPUs at their initial size, and no drain: the live run stops
// at the slice's end, and so does the model it is compared with.
func LiveSizedConfig(gpus int) Config {
	cfg := DefaultConfig()
	cfg.Services = LiveSizedServices(gpus)
	cfg.MaxReplicas = max(1, gpus/cfg.Services)
	cfg.DrainSeconds = 0
	return cfg
}

// ResizeSchedule is the model's sizing schedule in wall time at a compression: the first sizing after
// First, then every Every; each reads the samples of the last Window, one per Step.
type ResizeSchedule struct {
	First, Every, Window, Step time.Duration
}

// LiveResizeSchedule compresses cfg's LearnSeconds, ResizeSeconds, SizingWindowSeconds and
// SampleSeconds (trace seconds) by compress, as the live run's trace time is.
func LiveResizeSchedule(cfg Config, compress float64) ResizeSchedule {
	wall := func(traceSeconds float64) time.Duration {
		return time.Duration(traceSeconds / compress * float64(time.Second)).Round(time.Millisecond)
	}
	return ResizeSchedule{First: wall(cfg.LearnSeconds), Every: wall(cfg.ResizeSeconds), Window: wall(cfg.SizingWindowSeconds), Step: wall(cfg.SampleSeconds)}
}

// RightsizeFlags are the schedule's window and step as `kubectl tessera rightsize` takes them
// (PromQL durations, in milliseconds so no compression loses a fraction).
func (r ResizeSchedule) RightsizeFlags() []string {
	return []string{"--window", fmt.Sprintf("%dms", r.Window.Milliseconds()), "--step", fmt.Sprintf("%dms", r.Step.Milliseconds())}
}

// Due is the re-sizings due after elapsed wall time, counting the first at First.
func (r ResizeSchedule) Due(elapsed time.Duration) int {
	if elapsed < r.First {
		return 0
	}
	return 1 + int((elapsed-r.First)/r.Every)
}
