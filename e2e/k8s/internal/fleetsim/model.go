package fleetsim

import "math"

// GPU constants: H100 SXM5 80GB. Sources: ../shared/reference/gpu-sharing-performance.md §5.1
// (glennklockwood.com/garden/processors/h100, Baseten).
const (
	GPUSMs        = 132
	GPUMemBytes   = 80e9
	GPUHBMBytesPS = 3.35e12 // HBM3 peak bandwidth
	GPUBF16Flops  = 989.4e12
	GPUFP8Flops   = 1978.9e12

	// MBU is the achieved fraction of peak HBM bandwidth in decode. §5.3: NIM 70B TP2 at batch 1,
	// 18.58 ms against a 10.5 ms weight-read bound ≈ 57 %; Databricks reports ~60 % on 2×H100.
	MBU = 0.6
	// MFU is the achieved fraction of peak FLOP/s in prefill and in decode's compute term. §5.2:
	// LLaMA 7B FP8, 2048 prompt tokens in 36 ms ≈ 0.76 PFLOPS ≈ 38 % of FP8 peak. 0.4 is used.
	MFU = 0.4
	// BandwidthKnee is the SM fraction below which a memory-bound decode kernel can no longer keep
	// HBM busy: bandwidth achieved with SM fraction s is min(1, s/BandwidthKnee) of the whole GPU's.
	// ASSUMPTION: no published H100 curve of decode speed against the MPS active-thread percentage
	// exists (§3.2, §8); MuxServe Fig. 3 and Nexus say decode latency is flat in SMs down to a
	// model-dependent knee (§3.4). 0.3 is chosen, not measured.
	BandwidthKnee = 0.3
	// MaxBatch is the engine's concurrent-sequence limit (continuous batching; vLLM's
	// max_num_seqs is 256 by default, 64 is chosen so that per-token time stays near batch 1).
	MaxBatch = 64
	// TimeSliceOverhead is the fraction of GPU time lost to context switches when more than one
	// time-sliced context has work. ASSUMPTION, not measured.
	TimeSliceOverhead = 0.05
)

// ModelClass is an LLM served by one replica on one device.
type ModelClass struct {
	Name        string
	Params      float64 // parameters
	WeightBytes float64 // bytes of weights read per decode step
	Flops       float64 // peak dense FLOP/s in the served precision
	// KVBytesPerToken: 2 (K, V) × layers × KV heads × head dim × bytes per element.
	KVBytesPerToken float64
}

// Classes are the served models; service k gets Classes[k % len(Classes)].
var Classes = []ModelClass{
	// Llama-3-8B BF16: 32 layers, 8 KV heads, head dim 128 → 2·32·8·128·2 = 131,072 B/token.
	{Name: "8B-bf16", Params: 8.03e9, WeightBytes: 16.06e9, Flops: GPUBF16Flops, KVBytesPerToken: 131072},
	// Llama-2-13B BF16: 40 layers, 40 KV heads (no GQA), head dim 128 → 819,200 B/token.
	{Name: "13B-bf16", Params: 13.0e9, WeightBytes: 26.0e9, Flops: GPUBF16Flops, KVBytesPerToken: 819200},
	// CodeLlama-34B FP8 (weights and KV cache): 48 layers, 8 KV heads, head dim 128 → 98,304 B/token.
	{Name: "34B-fp8", Params: 33.7e9, WeightBytes: 33.7e9, Flops: GPUFP8Flops, KVBytesPerToken: 98304},
}

// engineOverheadBytes is the CUDA context, activations and allocator slack of one engine (assumed).
const engineOverheadBytes = 2e9

// PrefillSeconds is the time to prefill ctx tokens with SM fraction s (compute-bound: 2·N FLOP per
// token at MFU, ∝ 1/s).
func (m ModelClass) PrefillSeconds(ctx int, s float64) float64 {
	if ctx < 1 {
		ctx = 1
	}
	return 2 * m.Params * float64(ctx) / (m.Flops * MFU * s)
}

// DecodeStepSeconds is one decode step for a batch of b sequences with SM fraction s and bw the
// fraction of the GPU's HBM bandwidth available to the client (1 alone; less under MIG or when
// co-runners also read memory). Weight reads: W/(BW·MBU·min(bw, s/knee)); compute: 2·N·b/(F·MFU·s).
func (m ModelClass) DecodeStepSeconds(b int, s, bw float64) float64 {
	eff := math.Min(bw, s/BandwidthKnee)
	return m.WeightBytes/(GPUHBMBytesPS*MBU*eff) + 2*m.Params*float64(b)/(m.Flops*MFU*s)
}

// MemoryBytes is what an engine holds with tokens resident in its KV cache.
func (m ModelClass) MemoryBytes(tokens float64) float64 {
	return m.WeightBytes + engineOverheadBytes + m.KVBytesPerToken*tokens
}

// ReadySeconds is the time from pod creation to Ready: the infrastructure part measured in
// e2e/bench/results/coldstart.md (to first CUDA context, p50: whole GPU and MPS share ≈ 1.5 s,
// MIG 1g.10gb cold ≈ 5.5 s) plus loading the weights at an ASSUMED 2 GB/s (local NVMe/page cache)
// plus an ASSUMED 10 s of engine start (graph capture, warm-up).
func (m ModelClass) ReadySeconds(kind DeviceKind) float64 {
	infra := 1.5
	if kind == KindMIG {
		infra = 5.5
	}
	return infra + m.WeightBytes/2e9 + 10
}

// MIGProfile is an H100 SXM 80GB MIG profile (gpu-mig-mps.md §4.3; gpu-sharing-performance.md §4).
type MIGProfile struct {
	Name        string
	SMs         int
	MemSlices   int // of 8
	ComputeG    int // of 7
	MemoryBytes float64
}

// MIGProfiles in ascending size. Bandwidth of a slice is ASSUMED proportional to its memory
// slices (§4: no measured per-slice bandwidth found).
var MIGProfiles = []MIGProfile{
	{"1g.10gb", 16, 1, 1, 10e9},
	{"1g.20gb", 26, 2, 1, 20e9},
	{"2g.20gb", 32, 2, 2, 20e9},
	{"3g.40gb", 60, 4, 3, 40e9},
	{"4g.40gb", 64, 4, 4, 40e9},
	{"7g.80gb", 132, 8, 7, 80e9},
}

// SmallestMIGProfile is the smallest profile whose memory covers memBytes and whose SM share
// covers computePercent of the GPU; the whole 7g.80gb when none does.
func SmallestMIGProfile(memBytes float64, computePercent int) MIGProfile {
	for _, p := range MIGProfiles {
		if p.MemoryBytes >= memBytes && float64(p.SMs)/GPUSMs*100 >= float64(computePercent) {
			return p
		}
	}
	return MIGProfiles[len(MIGProfiles)-1]
}
