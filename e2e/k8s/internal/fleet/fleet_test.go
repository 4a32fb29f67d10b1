package fleet

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// ---- fixtures -------------------------------------------------------------

// realTrace is the Azure trace beside the repository (../shared/data from its root, where the packing
// benchmark finds openb), or FLEET_TRACE.
func realTrace() string {
	if p := os.Getenv("FLEET_TRACE"); p != "" {
		return p
	}
	return filepath.Join("..", "..", "..", "..", "..", "shared", "data", "azure-llm-2023", "AzureLLMInferenceTrace_conv.csv")
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// req is a request arriving at second at with ctx prompt and gen output tokens.
func req(at float64, ctx, gen int) Request {
	return Request{At: secs(at), ContextTokens: ctx, GeneratedTokens: gen}
}

// every is n requests of gen output tokens (no prompt), one each period from start.
func every(start, period float64, n, gen int) []Request {
	out := make([]Request, n)
	for i := range out {
		out[i] = req(start+float64(i)*period, 0, gen)
	}
	return out
}

// oneSlot is a model whose replicas serve one request at a time.
func oneSlot() Model {
	m := DefaultModel()
	m.BatchSlots = 1
	return m
}

func replicasOf(frac float64, ids ...string) []Replica {
	out := make([]Replica, len(ids))
	for i, id := range ids {
		out[i] = Replica{ID: ReplicaID(id), Fraction: frac}
	}
	return out
}

// burstThenQuiet is one service loaded at about 1.25 whole GPUs for its first 600 s
// (a 2.5 s request every 0.25 s on 8-slot replicas), then one request per 10 s
// until 1790 s.
func burstThenQuiet() []Request {
	out := every(0, 0.25, 2400, 100)
	return append(out, every(600, 10, 120, 100)...)
}

// ---- trace ----------------------------------------------------------------

func TestReadTraceGivesArrivalTimesFromTheFirstRowAndTheTokenCounts(t *testing.T) {
	got, err := ReadTrace("testdata/small.csv")
	if err != nil {
		t.Fatal(err)
	}
	want := []Request{
		{0, 374, 44},
		{4314579 * time.Microsecond, 396, 109},
		{4541877 * time.Microsecond, 879, 55},
		{4710427 * time.Microsecond, 91, 16},
		{14319410 * time.Microsecond, 1000, 0},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d requests, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("row %d: got %+v, want %+v", i, got[i], want[i])
		}
	}
}

func TestReadTraceNamesTheLineAndFieldOfABadTimestamp(t *testing.T) {
	readTraceFailsNaming(t, "testdata/bad_timestamp.csv", "a malformed timestamp", "bad_timestamp.csv:4:", "TIMESTAMP")
}

func TestReadTraceNamesTheLineAndFieldOfANegativeTokenCount(t *testing.T) {
	readTraceFailsNaming(t, "testdata/bad_tokens.csv", "a negative token count", "bad_tokens.csv:3:", "GeneratedTokens")
}

// readTraceFailsNaming reads a bad trace and wants an error that names each of wants (its line, its field).
func readTraceFailsNaming(t *testing.T, path, what string, wants ...string) {
	t.Helper()
	_, err := ReadTrace(path)
	if err == nil {
		t.Fatalf("no error for %s", what)
	}
	for _, want := range wants {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
}

// ---- service model --------------------------------------------------------

func TestARequestsServiceTimeGrowsWithItsTokens(t *testing.T) {
	m := DefaultModel()
	if got := m.WorkSeconds(req(0, 10000, 0)); math.Abs(got-1) > 1e-9 {
		t.Errorf("10k prompt tokens: got %.4f s, want 1 s of prefill", got)
	}
	if got := m.WorkSeconds(req(0, 0, 40)); math.Abs(got-1) > 1e-9 {
		t.Errorf("40 generated tokens: got %.4f s, want 40*25 ms", got)
	}
	small, moreCtx, moreGen := m.WorkSeconds(req(0, 500, 50)), m.WorkSeconds(req(0, 1500, 50)), m.WorkSeconds(req(0, 500, 150))
	if !(moreCtx > small && moreGen > small) {
		t.Errorf("work does not grow with tokens: base %.3f, +ctx %.3f, +gen %.3f", small, moreCtx, moreGen)
	}
	r := req(0, 1000, 100)
	if whole, half := m.ServiceTime(r, 1), m.ServiceTime(r, 0.5); half != 2*whole {
		t.Errorf("a half share should serve at half rate: whole %v, half %v", whole, half)
	}
}

func TestSplittingIntoServicesUsesEveryRequestOnceAndShiftsEachServicesPhase(t *testing.T) {
	trace := []Request{req(0, 0, 1), req(1, 0, 2), req(5, 0, 3), req(6, 0, 4)} // span 7 s
	svcs := SplitServices(trace, 2)
	if len(svcs) != 2 || svcs[0].Name != "svc-0" || svcs[1].Name != "svc-1" {
		t.Fatalf("got services %+v", svcs)
	}
	wantFirst := []Request{req(0, 0, 1), req(5, 0, 3)}
	wantSecond := []Request{req(2.5, 0, 4), req(4.5, 0, 2)} // rows 1 and 3 moved by 3.5 s, wrapping at 7 s
	for i, want := range [][]Request{wantFirst, wantSecond} {
		got := svcs[i].Requests
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("service %d: got %v, want %v", i, got, want)
		}
	}
}

// ---- router and replicas --------------------------------------------------

func TestJoinShortestQueueKeepsTwoReplicasBalanced(t *testing.T) {
	svc := Service{Name: "chat", Requests: every(0, 0.5, 100, 30)} // 0.75 s each, 1.5 s of work per s
	f := New(Config{Model: oneSlot()}, []Service{svc})
	var busyA, busyB float64
	for s := 1; s <= 51; s++ { // the last request arrives at 49.5 s and ends at 50.25 s
		u := f.Step(time.Duration(s)*time.Second, map[string][]Replica{"chat": replicasOf(1, "a", "b")})
		busyA += u["a"].Busy
		busyB += u["b"].Busy
	}
	busyA, busyB = busyA/51, busyB/51
	if math.Abs(busyA-busyB) > 0.05 || busyA < 0.6 || busyB < 0.6 {
		t.Errorf("replicas not balanced: a busy %.3f, b busy %.3f (want both about 0.75)", busyA, busyB)
	}
	if s := f.Summary(); s.Served != 100 || s.QueueP99 > time.Second {
		t.Errorf("got %+v, want 100 served with little queueing", s)
	}
}

func TestAQuarterShareReportsAQuarterOfTheWholeGPUsUtilizationForTheSameBusyTime(t *testing.T) {
	services := []Service{
		{Name: "whole", Requests: []Request{req(0, 0, 200)}},  // 5 s at rate 1
		{Name: "quarter", Requests: []Request{req(0, 0, 50)}}, // 1.25 s of work at rate 0.25: 5 s
	}
	f := New(Config{Model: oneSlot()}, services)
	u := f.Step(10*time.Second, map[string][]Replica{
		"whole":   replicasOf(1, "w"),
		"quarter": replicasOf(0.25, "q"),
	})
	w, q := u["w"], u["q"]
	if math.Abs(w.Busy-0.5) > 1e-6 || math.Abs(q.Busy-0.5) > 1e-6 {
		t.Fatalf("both should be busy half the tick: whole %+v, quarter %+v", w, q)
	}
	if math.Abs(w.GPUUtil-0.5) > 1e-6 || math.Abs(q.GPUUtil-0.125) > 1e-6 {
		t.Errorf("GPU utilization: whole %.4f (want 0.5), quarter %.4f (want 0.125)", w.GPUUtil, q.GPUUtil)
	}
	if w.Percent() != 50 || q.Percent() != 13 {
		t.Errorf("plugin percentages: whole %d, quarter %d; want 50 and 13", w.Percent(), q.Percent())
	}
}

func TestAReplicaThatDisappearsHasItsQueueReroutedAndItsRunningRequestRestarted(t *testing.T) {
	// Four 2 s requests at t=0 on two one-slot replicas: a runs r0 and queues r2,
	// b runs r1 and queues r3. At t=1 a disappears: r0 restarts and r2 moves to b.
	svc := Service{Name: "chat", Requests: []Request{req(0, 0, 80), req(0, 0, 80), req(0, 0, 80), req(0, 0, 80)}}
	f := New(Config{Model: oneSlot()}, []Service{svc})
	f.Step(time.Second, map[string][]Replica{"chat": replicasOf(1, "a", "b")})
	onlyB := map[string][]Replica{"chat": replicasOf(1, "b")}
	u := f.Step(2*time.Second, onlyB)
	if _, ok := u["a"]; ok {
		t.Error("a gone replica still reports usage")
	}
	if u["b"].Running != 1 || u["b"].Queued != 2 {
		t.Errorf("b at t=2: %+v, want 1 running and 2 queued (r3, then the re-routed r0 and r2)", u["b"])
	}
	f.Step(7*time.Second, onlyB)
	if got := f.Summary().Served; got != 3 {
		t.Errorf("served by t=7: %d, want 3 (r1 at 2, r3 at 4, r0 at 6)", got)
	}
	f.Step(9*time.Second, onlyB)
	s := f.Summary()
	if s.Served != 4 || s.Dropped != 0 || s.Restarts != 1 || !f.Done() {
		t.Errorf("got %+v, want all 4 served and 1 restart", s)
	}
}

func TestAServiceWithoutReplicasHoldsItsRequestsAndDropsThemAfterMaxPending(t *testing.T) {
	svc := Service{Name: "chat", Requests: []Request{req(0, 0, 4), req(50, 0, 4)}}
	f := New(Config{MaxPending: 60 * time.Second}, []Service{svc})
	none := map[string][]Replica{}
	f.Step(30*time.Second, none)
	if s := f.Summary(); s.Dropped != 0 || s.InFlight != 1 {
		t.Fatalf("at 30 s: %+v, want the first request held", s)
	}
	f.Step(61*time.Second, none)
	if s := f.Summary(); s.Dropped != 1 || s.InFlight != 1 {
		t.Fatalf("at 61 s: %+v, want the first dropped and the second held", s)
	}
	f.Step(70*time.Second, map[string][]Replica{"chat": replicasOf(1, "a")})
	if s := f.Summary(); s.Served != 1 || s.Dropped != 1 || !f.Done() {
		t.Errorf("after a replica appears: %+v, want the held request served", s)
	}
}

// ---- autoscaling ----------------------------------------------------------

func TestTheHPARecommendationFollowsTheKubernetesFormula(t *testing.T) {
	cases := []struct {
		name    string
		current int
		ready   []float64
		unready int
		want    int
	}{
		{"over target scales to ceil(ready*ratio)", 2, []float64{0.9, 0.9}, 0, 3},
		{"within 10% tolerance keeps", 2, []float64{0.74, 0.70}, 0, 2},
		{"under target scales down", 4, []float64{0.2, 0.2, 0.2, 0.2}, 0, 2},
		{"starting pods count as 0 when scaling up", 3, []float64{1.0, 1.0}, 1, 3},
		{"starting pods do not stop a clear scale-up", 3, []float64{1.0, 1.0}, 1, 3},
		{"no metrics keeps", 2, nil, 2, 2},
	}
	cases[4].ready = []float64{1.0, 1.0, 1.0, 1.0}
	cases[4].current, cases[4].want = 5, 6 // 4/5/0.7 = 1.14 -> ceil(1.14*5) = 6
	for _, c := range cases {
		if got := rawRecommendation(c.current, c.ready, c.unready, 0.7, 0.1); got != c.want {
			t.Errorf("%s: got %d, want %d", c.name, got, c.want)
		}
	}
}

func TestHPAScalingRisesWithLoadAndFallsOnlyAfterTheStabilizationWindow(t *testing.T) {
	cfg := Config{Trace: burstThenQuiet(), Services: 1}
	res := Simulate(cfg, WholeHPA)
	at := func(s float64) int { return res.Samples[int(s)].Replicas[0] }
	if at(0) != 1 {
		t.Fatalf("starts with %d replicas, want 1 (mean load about 0.44 GPU)", at(0))
	}
	peak := 0
	for s := 0.0; s < 600; s++ {
		peak = max(peak, at(s))
	}
	if peak < 2 {
		t.Fatalf("never scaled up under a 1.25-GPU load: peak %d replicas", peak)
	}
	firstDrop := -1.0
	for s := 600.0; s < float64(len(res.Samples)); s++ {
		if at(s) < at(599) {
			firstDrop = s
			break
		}
	}
	window := cfg.WithDefaults().StabilizationWindow.Seconds()
	t.Logf("peak %d replicas in the burst, first scale-down at %.0f s, %d scale events", peak, firstDrop, res.ScaleEvents)
	if firstDrop < 0 || firstDrop < 600+window-15 || firstDrop > 600+window+60 {
		t.Errorf("first scale-down at %.0f s, want within a sync or so after 600+%.0f s", firstDrop, window)
	}
	if last := res.Samples[len(res.Samples)-1]; last.Replicas[0] != 1 || last.GPUs != 1 {
		t.Errorf("ends with %d replicas on %d GPUs, want 1 on 1", last.Replicas[0], last.GPUs)
	}
	if res.Served != 2520 || res.Dropped != 0 {
		t.Errorf("served %d, dropped %d; want 2520 and 0", res.Served, res.Dropped)
	}
}

func TestThePeakPolicyNeverScales(t *testing.T) {
	res := Simulate(Config{Trace: burstThenQuiet(), Services: 1}, WholePeak)
	if res.ScaleEvents != 0 || res.PodsCreated != 2 {
		t.Fatalf("scale events %d, pods %d; want 0 and ceil(1.25/0.7) = 2", res.ScaleEvents, res.PodsCreated)
	}
	for _, s := range res.Samples {
		if s.Replicas[0] != 2 || s.GPUs != 2 {
			t.Fatalf("at %v: %d replicas on %d GPUs, want 2 on 2", s.At, s.Replicas[0], s.GPUs)
		}
	}
}

func TestCompressingTimeLeavesAFixedFleetsAccountingUnchanged(t *testing.T) {
	plain := Simulate(Config{Trace: burstThenQuiet(), Services: 1}, WholePeak)
	fast := Simulate(Config{Trace: burstThenQuiet(), Services: 1, Compress: 6}, WholePeak)
	if math.Abs(plain.GPUHours-fast.GPUHours) > 0.01 || plain.Served != fast.Served {
		t.Errorf("1x: %.3f GPU-h, %d served; 6x: %.3f GPU-h, %d served", plain.GPUHours, plain.Served, fast.GPUHours, fast.Served)
	}
	if math.Abs(plain.UtilMean-fast.UtilMean) > 0.02 {
		t.Errorf("mean utilization 1x %.3f vs 6x %.3f", plain.UtilMean, fast.UtilMean)
	}
}

func TestSharesPackFirstFitAndNeverSpanTwoGPUs(t *testing.T) {
	var p packer
	got := []int{p.place(0.5), p.place(0.25), p.place(0.5), p.place(0.25)}
	if fmt.Sprint(got) != "[0 0 1 0]" {
		t.Errorf("placements %v, want [0 0 1 0]", got)
	}
	p.remove(0, 0.5)
	if g := p.place(1); g != 2 {
		t.Errorf("a whole-GPU replica went to GPU %d, want a fresh GPU 2 (GPU 0 is half free)", g)
	}
	if p.gpus() != 3 {
		t.Errorf("GPUs in use %d, want 3", p.gpus())
	}
	for _, c := range []struct{ mean, want float64 }{{0.1, 0.25}, {0.2, 0.25}, {0.466, 0.5}, {2, 1}} {
		if got := shareFraction([]float64{0.25, 0.5, 1}, c.mean, 0.7); got != c.want {
			t.Errorf("mean load %.3f: share %.2f, want %.2f", c.mean, got, c.want)
		}
	}
}

// ---- the real trace -------------------------------------------------------

var (
	realOnce    sync.Once
	realResults []Result
	realCount   int
	realErr     error
)

func realRuns(t *testing.T) ([]Result, int) {
	t.Helper()
	if _, err := os.Stat(realTrace()); err != nil {
		t.Skipf("trace not present (set FLEET_TRACE): %v", err)
	}
	realOnce.Do(func() {
		reqs, err := ReadTrace(realTrace())
		if err != nil {
			realErr = err
			return
		}
		realCount = len(reqs)
		for _, p := range Policies {
			realResults = append(realResults, Simulate(Config{Trace: reqs}, p))
		}
	})
	if realErr != nil {
		t.Fatal(realErr)
	}
	return realResults, realCount
}

func TestOnTheRealTraceEveryRequestIsServedOrDroppedAndSharesUseFewerGPUHoursThanPeak(t *testing.T) {
	results, n := realRuns(t)
	if n < 19000 {
		t.Fatalf("read %d requests from the trace, want about 19,365", n)
	}
	byPolicy := map[Policy]Result{}
	for _, r := range results {
		byPolicy[r.Policy] = r
		if r.Requests != n || r.Served+r.Dropped != n {
			t.Errorf("%s: %d requests, %d served + %d dropped; want %d in all", r.Policy, r.Requests, r.Served, r.Dropped, n)
		}
		if r.GPUHours <= 0 || r.UtilMean <= 0 || r.UtilMean > 1 {
			t.Errorf("%s: GPU-hours %.3f, mean utilization %.3f", r.Policy, r.GPUHours, r.UtilMean)
		}
	}
	peak, shares := byPolicy[WholePeak], byPolicy[SharesHPA]
	if shares.GPUHours >= peak.GPUHours {
		t.Errorf("shares-hpa %.2f GPU-h, whole-peak %.2f: want fewer", shares.GPUHours, peak.GPUHours)
	}
	if shares.WithinTarget < peak.WithinTarget-0.01 {
		t.Errorf("shares-hpa within target %.4f, whole-peak %.4f: want no worse than 0.01 below", shares.WithinTarget, peak.WithinTarget)
	}
	if peak.ScaleEvents != 0 {
		t.Errorf("whole-peak scaled %d times", peak.ScaleEvents)
	}
}

func TestPrintOfflineTable(t *testing.T) {
	results, n := realRuns(t)
	var b strings.Builder
	fmt.Fprintf(&b, "Offline results, %d requests, default Config (8 services, compress 1, step 1 s, target 0.7)\n\n", n)
	b.WriteString("| policy | share f | util mean | p10 | p50 | p90 | GPU-hours | max GPUs | within target | within whole-GPU target | queue p99 | latency p99 | pods created | scale events | restarts | dropped |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	rows := 0
	for _, r := range results {
		if r.GPUHours <= 0 {
			t.Errorf("%s: GPU-hours %.3f, want positive", r.Policy, r.GPUHours)
		}
		fs := map[float64]bool{}
		var shares []string
		for _, f := range r.ShareFractions {
			if !fs[f] {
				fs[f] = true
				shares = append(shares, fmt.Sprint(f))
			}
		}
		fmt.Fprintf(&b, "| %s | %s | %.3f | %.3f | %.3f | %.3f | %.2f | %d | %.4f | %.4f | %.2f s | %.1f s | %d | %d | %d | %d |\n",
			r.Policy, strings.Join(shares, ","), r.UtilMean, r.UtilP10, r.UtilP50, r.UtilP90, r.GPUHours, r.MaxGPUs,
			r.WithinTarget, r.WithinWholeGPUTarget, r.QueueP99.Seconds(), r.LatencyP99.Seconds(),
			r.PodsCreated, r.ScaleEvents, r.Restarts, r.Dropped)
		rows++
	}
	if rows != len(Policies) {
		t.Errorf("%d rows, want one per policy (%d)", rows, len(Policies))
	}
	t.Log("\n" + b.String())
}
