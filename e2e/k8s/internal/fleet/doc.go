// Package fleet turns a real LLM-inference request trace into per-replica GPU busy
// time, for a fleet utilization benchmark of inference services on tessera GPUs.
//
// A live driver calls [New] and then [Fleet.Step] once per tick with the Ready
// replicas of each service (as Kubernetes reports them while Prometheus, KEDA and
// the HPA scale them) and feeds each replica's [Usage.Percent] to the simulated GPU
// driver (`tessera-kubelet-plugin simulate load --pid <its process> --util <0-100>`).
// [Simulate] runs the same model with a simulated autoscaler, so policies can be
// compared offline without a cluster.
//
// # Input (measured)
//
// The Azure LLM inference trace 2023, conversation service (Splitwise, ISCA'24):
// arrival time, prompt tokens and generated tokens of every request over one hour.
// Arrival times and token counts are the only measured inputs. The file holds
// 19,366 data rows (its README says 19,365).
//
// # Services (chosen)
//
// [SplitServices] makes N services (default 8): service k takes every N-th row
// starting at row k and shifts its times by k*span/N, wrapping. Each row is used
// once, so the fleet carries exactly the trace's load; the services share the
// trace's burstiness but peak at different times.
//
// # Service-time model (assumed; constants in model.go)
//
//   - A request holds one batch slot of a WHOLE GPU for
//     W = ContextTokens/10,000 tokens/s (prefill) + GeneratedTokens*25 ms (decode).
//     The model is a 7–8B model on an H100-class GPU. Both rates are assumptions of
//     the right order, not measurements. Checks against public specifications:
//     8B parameters in BF16 are 16 GB of weights, and H100 SXM HBM3 moves
//     3.35 TB/s, so a decode step cannot take less than about 5 ms; 25 ms/token is
//     pessimistic by about 5x. Prefill at 2 FLOP per parameter per token is 16 GFLOP
//     a token; at the H100's 989 dense BF16 TFLOPS, 10k tokens/s is about 16 % of
//     peak. Decode is about 98 % of the trace's work (mean W = 0.115 s prefill +
//     5.28 s decode), so GPU-hours scale almost linearly with the decode constant.
//   - A replica serves up to 8 requests at once (continuous batching at small
//     batch, where decode is memory-bound and a step costs about the same for 1 or
//     8 sequences). A request that finds all slots taken waits FIFO. Prefill is
//     modelled per slot like decode (it is 2 % of the work).
//   - A replica holding fraction f of a GPU's SMs (an MPS share,
//     CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100f) serves at rate f of a whole GPU:
//     each of its slots progresses f times as fast. This is an assumption; memory-
//     bound decode may slow down less than f.
//   - Busy is the mean fraction of a replica's slots in use over a tick. The
//     utilization the plugin reports for the replica's claim is Busy*f of the
//     whole GPU (Busy for a whole GPU). The HPA's target of 0.7 applies to Busy,
//     which is the same as a per-pod target of 0.7*f on the plugin's number.
//
// # Router (chosen)
//
// Each service has a join-shortest-queue router. It sends an arrival, at its exact
// trace time, to the Ready replica with the least outstanding work: the remaining
// work in its batch and queue divided by its capacity (8 slots * f). The router
// knows each request's output length, which a real router does not. A replica that
// disappears has its waiting requests re-routed in arrival order, and its running
// requests start again from zero elsewhere, as a client retry would; they count as
// Restarts. Requests that arrive while a service has no Ready replica wait, and
// are dropped after MaxPending (120 s wall).
//
// # Latency target (chosen)
//
// A request is within target if latency <= 2 * its own service time on the
// replica that served it + 1 s, with latency = queueing + service. This measures
// queueing (slowdown), not the slower service of a small share. The second figure,
// "within whole-GPU target", uses the service time the request would have on a
// whole GPU, so it also charges a share's slower service. Dropped requests count
// as misses in both.
//
// # Time
//
// The model runs in trace time. Config.Compress plays the trace faster and shrinks
// service times by the same factor, so per-tick utilization does not depend on
// compression. Cluster-side durations (Step, SyncPeriod, ReadyDelay, MaxPending)
// are wall time. The stabilization window and the KEDA cooldown default to 300 s of
// trace time (300 s/Compress wall). GPU-hours are in trace time.
//
// # Offline policies (chosen; see simulate.go)
//
//   - whole-peak: per service, ceil(peak 60 s load in GPUs / 0.7) whole GPUs,
//     fixed.
//   - whole-hpa: whole GPUs, the Kubernetes HPA algorithm (hpa.go). Target 0.7,
//     10 % tolerance, sync every 15 s. The metric is each Ready replica's mean
//     Busy since the last sync. There is a 300 s scale-down stabilization window,
//     the default scale-up limit max(+100 %, +4 pods) per sync, min 1 replica (or
//     0 with ScaleToZero: KEDA-style, to 0 after Cooldown with an empty queue, back
//     to 1 at the first sync that sees a request), and max 64. New replicas become
//     Ready after ReadyDelay (default 30 s, an assumption until measured). Scale-down
//     removes not-Ready replicas first, then the newest.
//   - shares-hpa: the same HPA on MPS shares. Each service's share f is the largest
//     of 0.25, 0.5 and 1 with f*0.7 <= its mean load in GPUs (0.25 if none), so one
//     replica at the target carries no more than the typical load. Shares are
//     placed first-fit onto GPUs, never span two GPUs, and never move. A GPU counts
//     as allocated while it holds at least one share.
//
// All policies start warm: their initial replicas are Ready at time 0 (the HPA
// policies start at ceil(mean load / (f*0.7))). Utilization of allocated capacity
// is sampled per tick as the sum of Busy*f over all replicas divided by the GPUs
// allocated. The sample covers the trace's span; Simulate then drains the queues
// for up to DrainLimit, and anything left counts as dropped.
package fleet
