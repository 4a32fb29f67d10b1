package e2etest

// Issue 24 item 3: the fleet utilization benchmark with every part in the loop. Inference services whose
// requests come from the Azure LLM inference trace (internal/fleet: the trace, the services, the service-time
// model, the join-shortest-queue router) run as Deployments on the real node under three policies, one after
// the other on the same GPUs and the same arrivals:
//
//   - whole-peak: whole GPUs, replicas fixed for each service's peak (how fleets run today);
//   - whole-hpa: whole GPUs, a KEDA ScaledObject per service on its GPU use;
//   - shares-hpa: MPS shares sized per service, a ScaledObject per service on the use of its shares.
//
// Each second the test asks the model what every Ready replica (a Running pod of the service) did in that
// second of compressed trace time, and gives each replica's container process that GPU use as synthetic load
// (`simulate load --pid`): the simulated driver's NVML reports it, tessera's plugin exports it per claim,
// Prometheus scrapes it, KEDA's HPA scales on it, kube-scheduler places the new replicas and tessera prepares
// their claims. A replica counts as Ready (the model routes to it) once its pod runs.
//
// Measured per policy: the utilization of the allocated GPU capacity (each second: the GPU use of the
// replicas over the capacity their claims hold, a whole GPU 1, a share its fraction; what a share leaves
// free on its GPU is free for other claims), the utilization of the GPUs holding at least one of the
// policy's claims, GPU-hours held (trace time), the model's
// service numbers (requests within the latency target, queueing p99), pods created, and each new replica's
// time to Running (schedule + prepare + start). Asserted (counts only, never timings): every request that
// arrived is served, dropped or in flight; each policy held at least one GPU; the whole-GPU policies' pods
// hold whole GPUs and the shares' pods shares; Prometheus saw the load the test gave (its mean GPU use within
// a tolerance of the test's own). That is the batch-slot path, run only with FLEET_POLICIES
// set (its numbers are history in e2e/bench/results/fleet.md). Without FLEET_POLICIES (`make e2e`, and
// `make bench-fleet TRACE=<file>`) the test is issue 39 item 6: the offline model's engines on the replicas
// Kubernetes runs, against the offline model on the same slice (fleet_agreement_test.go).

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"tessera.dev/e2e/internal/fleet"
	"tessera.dev/e2e/internal/fleetsim"
)

var gpuOfDevice = regexp.MustCompile(`^gpu-(\d+)`)

type fleetArgs struct {
	trace    string
	window   time.Duration // of the trace, from its start
	thin     int           // keep 1 in thin requests
	services int
	compress float64
	runs     []fleetRun // FLEET_POLICIES: the batch-slot model's policies; none: the agreement scenario
	out      string
}

// fleetRun is one policy at one HPA target and, for shares, one share size (FLEET_POLICIES entries `policy`,
// `policy@target` or `shares-hpa@target/size`; by default the model sizes each service's shares).
type fleetRun struct {
	policy fleet.Policy
	target float64
	share  float64
}

func fleetArgsFromEnv(t *testing.T) fleetArgs {
	t.Helper()
	a := fleetArgs{
		trace:    getenv("FLEET_TRACE", filepath.Join(e.repoRoot, "..", "shared", "data", "azure-llm-2023", "AzureLLMInferenceTrace_conv.csv")),
		window:   fleetsim.AgreementSlice,
		thin:     fleetsim.AgreementThin,
		services: 3,
		compress: 10,
		out:      os.Getenv("FLEET_OUT"),
	}
	if _, err := os.Stat(a.trace); err != nil && !strings.HasPrefix(a.trace, "gen:") {
		if os.Getenv("FLEET_TRACE") != "" {
			t.Fatalf("FLEET_TRACE=%s: %v; give an Azure-format CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or gen:low / gen:bursty", a.trace, err)
		}
		// The trace's first 10 minutes are in the repository (CC-BY 4.0, internal/fleet/testdata/README.md).
		a.trace = filepath.Join(e.repoRoot, "e2e", "k8s", "internal", "fleet", "testdata", "azure-conv-first-10min.csv")
	}
	num := func(name string, dst *float64) {
		if v := os.Getenv(name); v != "" {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || f <= 0 {
				t.Fatalf("%s=%q: want a positive number", name, v)
			}
			*dst = f
		}
	}
	window, thin, services := a.window.Minutes(), float64(a.thin), float64(a.services)
	num("FLEET_MINUTES", &window)
	num("FLEET_THIN", &thin)
	num("FLEET_SERVICES", &services)
	num("FLEET_COMPRESS", &a.compress)
	a.window, a.thin, a.services = time.Duration(window*float64(time.Minute)), int(thin), int(services)
	if os.Getenv("FLEET_POLICIES") == "" {
		return a
	}
	if os.Getenv("FLEET_THIN") == "" {
		a.thin = 4 // the batch-slot runs' history
	}
	for _, p := range strings.Split(os.Getenv("FLEET_POLICIES"), ",") {
		name, rest, found := strings.Cut(strings.TrimSpace(p), "@")
		r := fleetRun{policy: fleet.Policy(name), target: 0.7}
		if found {
			target, share, sized := strings.Cut(rest, "/")
			f, err := strconv.ParseFloat(target, 64)
			if err != nil || f <= 0 || f > 1 {
				t.Fatalf("FLEET_POLICIES entry %q: the target after @ must be in (0, 1]", p)
			}
			r.target = f
			if sized {
				f, err := strconv.ParseFloat(share, 64)
				if err != nil || f < 0.01 || f > 1 || r.policy != fleet.SharesHPA {
					t.Fatalf("FLEET_POLICIES entry %q: a share size after / is for shares-hpa, in [0.01, 1]", p)
				}
				r.share = f
			}
		}
		if !slices.Contains(fleet.Policies, r.policy) {
			t.Fatalf("FLEET_POLICIES entry %q: the policy must be one of %v", p, fleet.Policies)
		}
		a.runs = append(a.runs, r)
	}
	return a
}

// fleetRow is one policy's run, measured.
type fleetRow struct {
	policy      fleet.Policy
	target      float64
	fractions   []float64
	samples     []float64 // utilization of the allocated GPU capacity, one per second
	held        []float64 // utilization of the GPUs holding at least one claim, one per second
	capSeconds  float64   // allocated GPU capacity (whole GPUs, shares' fractions) summed over the run's seconds, wall
	gpuSeconds  float64   // GPUs holding at least one of the policy's claims, summed the same way
	busySeconds float64   // GPU use summed the same way
	maxGPUs     int
	podsCreated int
	toRunning   []time.Duration
	summary     fleet.Summary
	promBusy    float64 // Prometheus' mean of the namespace's summed GPU use over the run
	wall        time.Duration
}

func TestFleetBenchOnTheAzureTraceWithPrometheusKEDAAndTheHPAInTheLoop(t *testing.T) {
	rn := realNode(t)
	a := autoscaling(t)
	args := fleetArgsFromEnv(t)
	trace := agreementSlice(t, args) // reads gen:low / gen:bursty too
	cfg := fleet.Config{Trace: trace, Services: args.services, Compress: args.compress}

	// GPUs 0-2 shared through MPS (the shares' GPUs), 3-5 whole (the whole-GPU policies'): one layout for
	// every policy, so each is measured against the same node. The sized run (FLEET_SIZED=1, make
	// bench-fleet) shares every GPU of the real node (REAL_NODE_GPUS, 6 unless set).
	sized := os.Getenv("FLEET_SIZED") == "1" && len(args.runs) == 0
	shared := 3
	selector := `device.attributes["gpu.tessera.dev"].index <= 2`
	if sized {
		n, err := strconv.Atoi(getenv("REAL_NODE_GPUS", "6"))
		if err != nil || n < 1 {
			t.Fatalf("REAL_NODE_GPUS=%q: want the real node's GPU count", os.Getenv("REAL_NODE_GPUS"))
		}
		shared, selector = n, `device.attributes["gpu.tessera.dev"].index >= 0`
	}
	changePolicy(t, func(rule map[string]any) {
		if rule["name"] == "gpu-1-shared" {
			rule["selector"] = selector
		}
	})
	installChart(t, rn)
	waitChartPods(t, "the plugin and MPS supervisor pods Ready on "+rn.name, "kubelet-plugin", "mps-supervisor")
	waitFor(t, fmt.Sprintf("%d shared GPUs published on %s", shared, rn.name), 2*time.Minute, func(ctx context.Context) (bool, string) {
		n := countDevices(t, rn.name, sharedName)
		return n >= shared, fmt.Sprintf("%d shared devices", n)
	})
	loads := realNodeLoads(t, rn)
	if sized {
		fleetSized(t, rn, a, loads, args, shared)
		return
	}
	if len(args.runs) == 0 {
		fleetAgreement(t, rn, a, loads, args)
		return
	}

	var rows []fleetRow
	for _, run := range args.runs {
		c := cfg
		c.TargetUtilization = run.target
		if run.share > 0 {
			c.ShareSizes = []float64{run.share}
		}
		rows = append(rows, runFleetPolicy(t, rn, a, loads, c, run.policy))
	}
	table := fleetTable(args, len(trace), rows)
	t.Log("\n" + table)
	if args.out != "" {
		if err := os.WriteFile(args.out, []byte(table), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func runFleetPolicy(t *testing.T, rn realNodeEnv, a autoscalingAddon, loads processLoads, cfg fleet.Config, policy fleet.Policy) fleetRow {
	t.Helper()
	ns := namespace(t, fmt.Sprintf("fleet-%s-%.0f", policy, cfg.TargetUtilization*100))
	plans := fleet.Plans(cfg, policy)
	row := fleetRow{policy: policy, target: cfg.TargetUtilization}
	services := make([]fleet.Service, 0, len(plans))
	for _, p := range plans {
		services = append(services, p.Service)
		row.fractions = append(row.fractions, p.Fraction)
		template := p.Service.Name + "-gpu"
		if policy == fleet.SharesHPA {
			compute := fmt.Sprintf("%.0f", p.Fraction*100)
			claimTemplate(t, ns, template, sharedClass(t), capacity(map[string]string{"memory": "6Gi", "compute": compute}))
		} else {
			claimTemplate(t, ns, template, gpuClass(t))
		}
		coldDeployment(t, ns, p.Service.Name, template, rn.name)
		scaleTo(t, ns, p.Service.Name, p.Replicas)
		if policy != fleet.WholePeak {
			createFleetScaledObject(t, ns, p.Service.Name, a.prometheus, cfg.Compress, cfg.TargetUtilization)
		}
	}
	// The run starts once every service's first replicas run (a warm start, as the model's).
	waitFor(t, fmt.Sprintf("%s: the services' first replicas running", policy), 4*time.Minute, func(ctx context.Context) (bool, string) {
		list, err := e.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		want := 0
		for _, p := range plans {
			want += p.Replicas
		}
		running := 0
		for _, p := range list.Items {
			if p.Status.Phase == v1.PodRunning {
				running++
			}
		}
		return running == want, fmt.Sprintf("%d of %d running", running, want)
	})

	fl := fleet.New(cfg, services)
	type replicaState struct {
		service  string
		pid      int
		device   string
		gpu      int
		created  time.Time
		running  time.Time
		fraction float64
	}
	known := map[string]*replicaState{}
	fractionOf := map[string]float64{}
	for _, p := range plans {
		fractionOf[p.Service.Name] = p.Fraction
	}
	span := fleet.TraceSpan(cfg.Trace)
	wall := time.Duration(float64(span) / cfg.Compress)
	began := time.Now()
	for tick := 1; ; tick++ {
		at := began.Add(time.Duration(tick) * time.Second)
		time.Sleep(time.Until(at))
		elapsed := time.Since(began)
		ctx := ctxFor(t, 30*time.Second)
		list, err := e.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Logf("list pods: %v", err)
			continue
		}
		ready := map[string][]fleet.Replica{}
		gpus := map[int]bool{}
		allocated := 0.0
		for i := range list.Items {
			p := &list.Items[i]
			if p.DeletionTimestamp != nil {
				continue
			}
			svc := p.Labels["app"]
			st := known[p.Name]
			if st == nil {
				st = &replicaState{service: svc, created: p.CreationTimestamp.Time, gpu: -1, fraction: fractionOf[svc]}
				known[p.Name] = st
				row.podsCreated++
			}
			if st.device == "" && p.Spec.NodeName != "" && len(p.Status.ResourceClaimStatuses) > 0 {
				if _, devices := realAllocations(t, p); len(devices) == 1 {
					st.device = devices[0].Device
					if m := gpuOfDevice.FindStringSubmatch(st.device); m != nil {
						st.gpu, _ = strconv.Atoi(m[1])
					}
				}
			}
			if st.gpu >= 0 {
				gpus[st.gpu] = true
				allocated += st.fraction
			}
			if p.Status.Phase != v1.PodRunning {
				continue
			}
			if st.pid == 0 {
				st.pid = rn.containerPID(t, p, "serve")
				st.running = time.Now()
				if tick > 1 {
					row.toRunning = append(row.toRunning, st.running.Sub(st.created))
				}
			}
			ready[svc] = append(ready[svc], fleet.Replica{ID: fleet.ReplicaID(p.Name), Fraction: st.fraction})
		}
		for svc := range ready {
			sort.Slice(ready[svc], func(i, j int) bool { return ready[svc][i].ID < ready[svc][j].ID })
		}
		usage := fl.Step(elapsed, ready)
		busy := 0.0
		for id, u := range usage {
			st := known[string(id)]
			busy += u.GPUUtil
			loads.set(t, st.device, st.pid, u.Percent(), "2Gi")
		}
		row.capSeconds += allocated
		row.gpuSeconds += float64(len(gpus))
		row.busySeconds += busy
		row.maxGPUs = max(row.maxGPUs, len(gpus))
		if allocated > 0 {
			row.samples = append(row.samples, busy/allocated)
			row.held = append(row.held, busy/float64(len(gpus)))
		}
		if elapsed >= wall && (fl.Done() || elapsed >= wall+time.Duration(float64(10*time.Minute)/cfg.Compress)) {
			break
		}
	}
	row.wall = time.Since(began)
	row.summary = fl.Summary()
	// What Prometheus saw of the same load: the namespace's summed GPU use, averaged over the run.
	q := fmt.Sprintf(`avg_over_time((sum(tessera_claim_gpu_utilization_ratio{namespace=%q}) or vector(0))[%ds:2s])`, ns, int(row.wall.Seconds()))
	if r, err := promQuery(ctxFor(t, 30*time.Second), a.prometheus, q); err == nil && len(r) == 1 {
		row.promBusy = r[0].Value
	} else {
		t.Errorf("%s: Prometheus' mean GPU use: %v (%d series)", policy, err, len(r))
	}
	loads.clear()

	s := row.summary
	if s.Served+s.Dropped+s.InFlight != s.Arrived {
		t.Errorf("%s: %d arrived but %d served + %d dropped + %d in flight", policy, s.Arrived, s.Served, s.Dropped, s.InFlight)
	}
	if s.Arrived == 0 || row.maxGPUs == 0 {
		t.Errorf("%s: %d requests arrived, at most %d GPUs held: the run measured nothing", policy, s.Arrived, row.maxGPUs)
	}
	for name, st := range known {
		shared := sharedName.MatchString(st.device)
		if st.device != "" && shared != (policy == fleet.SharesHPA) {
			t.Errorf("%s: replica %s holds %s", policy, name, st.device)
		}
	}
	if mean := row.busySeconds / row.wall.Seconds(); math.Abs(row.promBusy-mean) > 0.15*mean+0.05 {
		t.Errorf("%s: Prometheus' mean GPU use %.3f GPUs, the test gave %.3f", policy, row.promBusy, mean)
	}
	// Scale to zero before the next policy's run, so its pods start on free GPUs.
	for _, p := range plans {
		if policy != fleet.WholePeak {
			_ = e.dyn.Resource(scaledObjectGVR).Namespace(ns).Delete(ctxFor(t, 30*time.Second), p.Service.Name, metav1.DeleteOptions{})
		}
		scaleTo(t, ns, p.Service.Name, 0)
	}
	waitFor(t, fmt.Sprintf("%s: every replica gone", policy), 3*time.Minute, func(ctx context.Context) (bool, string) {
		list, err := e.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(list.Items) == 0, fmt.Sprintf("%d pods left (err %v)", len(list.Items), err)
	})
	return row
}

// createFleetScaledObject scales one service on the use of its GPU capacity, as the example's ScaledObject
// does, with the HPA's scale-down window (300 s by default) compressed like the trace.
func createFleetScaledObject(t *testing.T, ns, service, prometheus string, compress, target float64) {
	t.Helper()
	sel := fmt.Sprintf(`namespace=%q, pod=~"%s-.*"`, ns, service)
	so := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "keda.sh/v1alpha1",
		"kind":       "ScaledObject",
		"metadata":   map[string]any{"name": service, "namespace": ns},
		"spec": map[string]any{
			"scaleTargetRef":  map[string]any{"name": service},
			"pollingInterval": int64(5),
			"minReplicaCount": int64(1),
			"maxReplicaCount": int64(16),
			"advanced": map[string]any{"horizontalPodAutoscalerConfig": map[string]any{"behavior": map[string]any{
				"scaleDown": map[string]any{"stabilizationWindowSeconds": int64(math.Max(300/compress, 15))},
			}}},
			"triggers": []any{map[string]any{
				"type":       "prometheus",
				"metricType": "Value",
				"metadata": map[string]any{
					"serverAddress": prometheus,
					"query":         fmt.Sprintf("sum(tessera_claim_gpu_utilization_ratio{%s}) / sum(tessera_claim_gpu_compute_share_ratio{%s})", sel, sel),
					"threshold":     strconv.FormatFloat(target, 'f', -1, 64),
				},
			}},
		},
	}}
	if _, err := e.dyn.Resource(scaledObjectGVR).Namespace(ns).Create(ctxFor(t, 30*time.Second), so, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create ScaledObject %s/%s: %v", ns, service, err)
	}
}

func fleetTable(args fleetArgs, requests int, rows []fleetRow) string {
	var b strings.Builder
	b.WriteString(`# Fleet utilization on the Azure LLM inference trace

Written by ` + "`make bench-fleet`" + ` (e2e/k8s/e2etest/fleet_test.go; the model: e2e/k8s/internal/fleet/doc.go).
Inference services whose requests come from the trace run as Deployments on the real node (6 simulated H100s:
GPUs 0-2 shared through MPS, 3-5 whole), one policy after the other on the same arrivals. Each second the
model says what every running replica did in that second of trace time, and the replica's container process
gets that GPU use as synthetic load; tessera's plugin exports it per claim, Prometheus scrapes it, KEDA's HPA
scales the Deployments on it, kube-scheduler places new replicas and tessera prepares their claims. The
service-time model (prefill 10,000 tokens/s, decode 25 ms/token on a whole GPU, 8 batch slots per replica, a
share of fraction f serving at rate f) is assumed, not measured: see doc.go.

Columns: utilization of the allocated capacity (the replicas' GPU use over what their claims hold: a whole
GPU 1, a share its fraction; sampled each second), of the GPUs holding at least one claim, GPU-hours held in
trace time, Prometheus' mean of the summed per-claim GPU use beside the load the test gave (the two must
agree), the fraction of requests within the latency target (≤ 2 × own service time + 1 s, from the model; "whole-GPU
target": ≤ 2 × its service time on a whole GPU + 1 s, which also charges a share's slower service),
the model's queueing delay p99, pods created, and the wall time from a new replica's creation to Running.

`)
	fmt.Fprintf(&b, "Trace: %s, first %s, 1 in %d requests (%d), %d services, compressed %gx; real node, %s.\n\n",
		filepath.Base(args.trace), args.window, args.thin, requests, args.services, args.compress, time.Now().UTC().Format("2006-01-02"))
	b.WriteString("| policy | HPA target | share f | util of allocated capacity: mean | p10 | p50 | p90 | util of GPUs held: mean | GPU-hours held (trace) | max GPUs | Prometheus: mean GPU use / test's | within target | within whole-GPU target | queue p99 (trace) | pods created | to Running p50 / max (wall) |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		util := append([]float64(nil), r.samples...)
		sort.Float64s(util)
		q := func(p float64) float64 {
			if len(util) == 0 {
				return 0
			}
			return util[min(int(p*float64(len(util))), len(util)-1)]
		}
		mean, held := 0.0, 0.0
		if r.capSeconds > 0 {
			mean, held = r.busySeconds/r.capSeconds, r.busySeconds/r.gpuSeconds
		}
		var fr []string
		for _, f := range r.fractions {
			fr = append(fr, strconv.FormatFloat(f, 'g', 3, 64))
		}
		p50, pmax := medianAndMax(r.toRunning)
		target := fmt.Sprintf("%g", r.target)
		if r.policy == fleet.WholePeak {
			target = "(fixed: peak / " + target + ")"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f | %d | %.3f / %.3f | %.4f | %.4f | %.1f s | %d | %.1f / %.1f s |\n",
			r.policy, target, strings.Join(fr, ", "), mean, q(0.10), q(0.50), q(0.90), held,
			r.gpuSeconds*args.compress/3600, r.maxGPUs, r.promBusy, r.busySeconds/r.wall.Seconds(),
			r.summary.WithinTarget, r.summary.WithinWholeGPUTarget, r.summary.QueueP99.Seconds(), r.podsCreated, p50.Seconds(), pmax.Seconds())
	}
	return b.String()
}
