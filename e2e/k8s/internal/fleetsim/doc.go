// Package fleetsim is the offline fleet model of issue 39: inference services from an
// Azure-format LLM trace served under six GPU policies side by side, with a per-request
// service model, MPS contention, and utilization as DCGM reports it. It runs without a
// cluster and without a GPU (`make bench-fleet-offline TRACE=<file>`); it is a model, and
// its constants are cited or marked ASSUMED in model.go and README.md.
//
// Per tick (50 ms) every GPU held runs its replicas: water-filling of the busy clients'
// MPS ceilings over the SMs (WaterFill), HBM bandwidth shared by co-running decoders,
// prefill first then decode steps of the whole batch (ModelClass.PrefillSeconds,
// DecodeStepSeconds). GPU_UTIL is the fraction of the tick any client had a kernel running;
// SM activity is Σ SM fraction × busy time. Every 15 s each replica's claim use (SM-time in
// whole-GPU units, tessera_claim_gpu_utilization_ratio) and peak memory are sampled; the
// sized policies apply tessera's sizing rule v1 (Rightsize) to them at 10 min and every
// 10 min after, over the last 30 min of samples, and replace a re-sized service's replicas
// make-before-break. The HPA (KEDA-like, fixed target) scales on concurrent requests per
// replica. The SLO of each service is 2 × its p99 TTFT and p99 per-token time under
// whole-peak, the same for every policy.
package fleetsim
