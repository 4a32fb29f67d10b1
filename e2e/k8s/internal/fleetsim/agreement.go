package fleetsim

import "time"

// The live loop's agreement scenario (issue 39 item 6): the real node replays a slice of a trace
// with Prometheus, KEDA, the HPA, kube-scheduler and tessera's burstable shares in the loop, and the
// model runs the same slice with the same parameters (AgreementConfig, AgreementPolicy). Both sides
// count pods created and the SM activity of the GPUs held; they must agree within the bounds below.
// The parameters are fixed here, for both sides, before any run.
const (
	// AgreementServices: one service per model class (8B, 13B, 34B), rows split by ServiceOf.
	AgreementServices = 3
	// AgreementThin keeps 1 in AgreementThin requests of the slice. With AgreementHPATarget, the
	// conversation trace's first 10 minutes then make the services scale out and in (the model
	// creates 5 pods, 3 of them at the start) and keep the GPUs held below saturation; all
	// requests, or a target of 2, saturate every service at its cap, and pods created would agree
	// trivially.
	AgreementThin = 2
	// AgreementHPATarget is the HPA's target of concurrent requests (queued + running) per replica
	// (the benchmark's 16 would leave every service at its first replica on this slice).
	AgreementHPATarget = 4
	// AgreementMaxReplicas per service: 3 services × 2 replicas × 50 % shares fill the real node's 3
	// MPS-shared GPUs exactly, so the model never needs a GPU the node does not have.
	AgreementMaxReplicas = 2
)

// AgreementShare is every replica's burstable share: 50 % of the compute packed, a 100 % ceiling
// (sharing.mps.computeCeiling), and 37 GiB of memory (two fit in an 80 GB GPU; 34B FP8's weights,
// 33.7 GB, plus 2 GB of engine overhead leave ~4 GB of KV cache).
var AgreementShare = Recommendation{RequestPercent: 50, CeilingPercent: 100, MemoryBytes: 37 * gib}

// AgreementPolicy is burstable shares of fixed size, scaled by the HPA.
var AgreementPolicy = Policy{Name: "burstable-fixed-hpa", Kind: KindMPS, HPA: true, Overcommit: 1, Fixed: AgreementShare}

// AgreementConfig is DefaultConfig with the scenario's services, HPA target and replica cap, the
// HPA's sync period (15 s of wall time on the cluster) in trace time at compression compress, and
// no drain: both sides stop at the slice's end.
func AgreementConfig(compress float64) Config {
	cfg := DefaultConfig()
	cfg.Services = AgreementServices
	cfg.HPATarget = AgreementHPATarget
	cfg.MaxReplicas = AgreementMaxReplicas
	cfg.SampleSeconds = 15 * compress
	cfg.DrainSeconds = 0
	return cfg
}

// AgreementBounds: how far the live loop's counts may be from the model's.
//
//   - Pods created: |live − model| ≤ 2 + 25 % of the model's. The two HPAs run the same algorithm on
//     the same metric, but the cluster's syncs fall at an arbitrary phase of the trace (one sync is
//     15 s wall = 150 s of trace at 10x), and its metric arrives through a 2 s Prometheus scrape and a
//     5 s KEDA poll (up to 70 s of trace late): a burst the model's sync catches the cluster's may
//     catch one sync later or not at all, and a scale-down may slip out of the slice. Each such slip
//     moves the count by one pod per service; two are allowed, plus a quarter for longer runs.
//   - SM activity of the GPUs held (mean over GPU-seconds of Σ claims' SM-time on the GPU): within
//     ±0.10. Both sides compute it with the same engines; what differs is when replicas exist (the
//     above) and where the cluster's number comes from (Prometheus' per-claim gauge, sampled every
//     2 s, of the load the simulated driver reports). A replica that exists one sync longer on one
//     side changes the GPUs held by up to one of three for up to a quarter of the slice.
const (
	AgreementPodsSlack    = 2
	AgreementPodsFraction = 0.25
	AgreementSMActiveDiff = 0.10
)

// AgreementSlice is the slice both sides replay: the trace's first 10 minutes.
const AgreementSlice = 10 * time.Minute
