package fleetsim

import (
	"math"
	"strings"
	"testing"
	"time"

	"tessera.dev/e2e/internal/fleet"
)

func TestTheSizingRuleMeetsItsTestVector(t *testing.T) {
	var u, m []float64
	for k := 1; k <= 100; k++ {
		u = append(u, 0.004*float64(k))
		m = append(m, float64(k)*100*(1<<20))
	}
	rec, err := Rightsize(u, m)
	if err != nil {
		t.Fatal(err)
	}
	if rec.RequestPercent != 45 || rec.CeilingPercent != 100 || rec.MemoryBytes != 12*gib {
		t.Fatalf("got %+v, want request 45 %%, ceiling 100 %%, memory 12 GiB", rec)
	}
	_, err = Rightsize(u[:29], m[:29])
	if err == nil || err.Error() != "not enough data: 29 samples, need 30" {
		t.Fatalf("29 samples: got %v, want the not-enough-data error", err)
	}
}

func TestTwoBusyClientsWithCeilingsAboveTheGPUShareItAndALoneClientGetsItsCeiling(t *testing.T) {
	g := WaterFill([]float64{0.8, 0.6})
	if math.Abs(g[0]-0.5) > 1e-9 || math.Abs(g[1]-0.5) > 1e-9 {
		t.Fatalf("two busy clients at 80 %% + 60 %%: got %v, want 0.5 each", g)
	}
	g = WaterFill([]float64{0.2, 1})
	if math.Abs(g[0]-0.2) > 1e-9 || math.Abs(g[1]-0.8) > 1e-9 {
		t.Fatalf("20 %% + 100 %%: got %v, want the small one its ceiling and the rest to the other", g)
	}
	for _, c := range []float64{0.3, 1} {
		if g := WaterFill([]float64{c}); g[0] != math.Min(c, 1) {
			t.Fatalf("a lone client with ceiling %v got %v", c, g[0])
		}
	}
}

func TestDecodeIsFlatInSMsAboveTheKneeAndPrefillScalesWithThem(t *testing.T) {
	m := Classes[0]
	whole, half := m.DecodeStepSeconds(1, 1, 1), m.DecodeStepSeconds(1, 0.5, 1)
	if half/whole > 1.05 {
		t.Fatalf("decode at half the SMs is %.2fx slower; above the knee it should be nearly flat", half/whole)
	}
	if r := m.DecodeStepSeconds(1, BandwidthKnee/2, 1) / whole; r < 1.8 {
		t.Fatalf("decode below the knee is only %.2fx slower", r)
	}
	if r := m.PrefillSeconds(1000, 0.25) / m.PrefillSeconds(1000, 1); math.Abs(r-4) > 1e-9 {
		t.Fatalf("prefill at a quarter of the SMs: %.2fx, want 4x", r)
	}
}

// oneGPU runs one tick of a GPU with the given replicas, each busy with one decoding sequence.
func oneGPU(t *testing.T, p Policy, ceilings ...float64) (*sim, *gpuState) {
	t.Helper()
	s := &sim{cfg: DefaultConfig(), p: p}
	s.cfg.Services = len(ceilings)
	g := &gpuState{}
	s.gpus = []*gpuState{g}
	for k, c := range ceilings {
		s.svcs = append(s.svcs, &serviceState{class: Classes[0]})
		r := &replica{svc: k, ceiling: c, request: c, mem: GPUMemBytes, retireAt: math.Inf(1), mig: MIGProfiles[5]}
		r.active = []*request{{svc: k, ctx: 10, gen: 1 << 20, tokens: 1, firstTok: 0, finish: -1}}
		g.replicas = append(g.replicas, r)
		s.svcs[k].replicas = []*replica{r}
	}
	s.step(g, 0.1)
	return s, g
}

func TestDCGMUtilizationCountsAnyKernelTimeAndSMActivityCountsSMTime(t *testing.T) {
	_, g := oneGPU(t, Policies[3], 0.25)
	// One busy client under MPS with a 25 % ceiling: a kernel runs all the time (GPU_UTIL 1),
	// on a quarter of the SMs (SM active 0.25).
	if g.utilAcc != 1 || math.Abs(g.smAcc-0.25) > 1e-9 {
		t.Fatalf("GPU_UTIL %v, SM active %v; want 1 and 0.25", g.utilAcc, g.smAcc)
	}
	_, g = oneGPU(t, Policies[3], 1, 1)
	if g.utilAcc != 1 || math.Abs(g.smAcc-1) > 1e-9 {
		t.Fatalf("two busy burstable clients: GPU_UTIL %v, SM active %v; want 1 and 1", g.utilAcc, g.smAcc)
	}
}

func TestCoRunningDecodersShareHBMBandwidth(t *testing.T) {
	s1, _ := oneGPU(t, Policies[3], 1)
	s2, _ := oneGPU(t, Policies[3], 1, 1)
	alone := s1.svcs[0].replicas[0].active[0].tokens
	shared := s2.svcs[0].replicas[0].active[0].tokens
	if r := (alone - 1) / (shared - 1); r < 1.8 || r > 2.2 {
		t.Fatalf("a decoder with a co-running decoder made %.1f tokens against %.1f alone; want about half", shared, alone)
	}
}

func TestTheSLOIsSlackTimesTheBaselinesP99AndUnfinishedRequestsMissIt(t *testing.T) {
	var base Result
	for i := 1; i <= 100; i++ {
		base.Outcomes = append(base.Outcomes, RequestOutcome{Service: 0, TTFT: float64(i) / 100, TPOT: 0.01, Finished: true})
	}
	slo := SLOsFrom(base, 1, 2)
	if math.Abs(slo[0].TTFT-1.98) > 1e-9 || math.Abs(slo[0].TPOT-0.02) > 1e-9 {
		t.Fatalf("got %+v, want TTFT 2 × 0.99 s and TPOT 2 × 10 ms", slo[0])
	}
	r := Result{Outcomes: []RequestOutcome{
		{TTFT: 1, TPOT: 0.01, Finished: true},
		{TTFT: 3, TPOT: 0.01, Finished: true},
		{TTFT: 1, TPOT: 0.05, Finished: true},
		{TTFT: -1},
	}}
	a := Attain(r, slo)
	if a.TTFT != 0.5 || a.TPOT != 0.5 || a.Both != 0.25 {
		t.Fatalf("got %+v, want TTFT 0.5, per-token 0.5, both 0.25", a)
	}
}

func TestATinyOfflineRunServesEveryRequestUnderEveryPolicy(t *testing.T) {
	var trace []fleet.Request
	for i := 0; i < 800; i++ {
		trace = append(trace, fleet.Request{At: time.Duration(i) * time.Second, ContextTokens: 500, GeneratedTokens: 50})
	}
	cfg := DefaultConfig()
	cfg.Services = 4
	cfg.Tick = 0.1
	rows, slos := RunAll(cfg, trace, Policies)
	if len(rows) != len(Policies) || len(slos) != 4 {
		t.Fatalf("got %d rows and %d SLOs", len(rows), len(slos))
	}
	for _, r := range rows {
		if r.Requests != 800 || r.Finished != 800 {
			t.Errorf("%s: finished %d of %d", r.Policy.Name, r.Finished, r.Requests)
		}
		if r.GPUUtil.Mean <= 0 || r.GPUUtil.Mean > 1 || r.SMActive.Mean > 1 {
			t.Errorf("%s: GPU_UTIL %v, SM active %v", r.Policy.Name, r.GPUUtil.Mean, r.SMActive.Mean)
		}
	}
	// Whole-peak holds one GPU per service the whole time and creates no pods after the start.
	if rows[0].PodsCreated != 4 || rows[0].MaxGPUs != 4 || rows[0].Attain.Both < 0.99 {
		t.Errorf("whole-peak: %d pods, %d GPUs, attainment %v", rows[0].PodsCreated, rows[0].MaxGPUs, rows[0].Attain.Both)
	}
	// The sized policies resize after the learning period: each replaces its services' pods.
	for _, r := range rows[2:] {
		if r.PodsCreated <= 4 {
			t.Errorf("%s: %d pods created; the online sizing should have replaced the first ones", r.Policy.Name, r.PodsCreated)
		}
	}
	if !strings.Contains(Table(rows), "| burstable-hpa |") || !strings.Contains(SVG("t", rows), "<svg") {
		t.Error("table or plot lacks the policies")
	}
}

func TestGeneratedTracesAreFixedAndAnyServiceAssignmentIsStable(t *testing.T) {
	a, err := Generate("gen:low")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Generate("gen:low")
	if len(a) != len(b) || a[len(a)-1] != b[len(b)-1] || len(a) < 3000 || len(a) > 4200 {
		t.Fatalf("gen:low: %d then %d requests", len(a), len(b))
	}
	if _, err := Generate("gen:nope"); err == nil || !strings.Contains(err.Error(), "gen:low and gen:bursty") {
		t.Fatalf("unknown generated trace: %v", err)
	}
	if ServiceOf(7, 24, 1) != ServiceOf(7, 24, 1) {
		t.Fatal("service assignment is not a function of the row")
	}
}
