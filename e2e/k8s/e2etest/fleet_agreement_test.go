package e2etest

// Issue 39 item 6: the live loop agrees with the offline model. The real node replays a slice of an
// Azure-format trace (make e2e: the conversation trace's first 10 minutes, in the repository, compressed
// 10x) with every parameter fixed in code (fleetsim.AgreementConfig, AgreementPolicy: 3 services, one per
// model class; burstable MPS shares of 50 % compute with a 100 % ceiling, sharing.mps.computeCeiling, and
// 37 GiB; a KEDA ScaledObject per service on the engines' concurrent requests, target 4 per replica, 1-2
// replicas). Kubernetes decides which replicas exist and where (Prometheus, KEDA, the HPA,
// kube-scheduler, tessera's prepares); the model's engines (fleetsim.Live: the same engines, routing, MPS
// contention and accounting as the offline run) serve the trace on them, each running replica's container
// process gets its claim's SM-time as synthetic load (`simulate load --pid`), and the test serves each
// engine's concurrent requests for Prometheus to scrape (as vLLM's /metrics would). The offline model then
// runs the same slice with the same parameters and its own HPA and first-fit placement (fleetsim.Run).
//
// Compared, with the same definition on both sides:
//   - pods created during the slice (the live side: pods of the services' Deployments created before the
//     slice's end; the model: replicas started, the 3 warm ones included);
//   - SM activity of the GPUs held: Σ over GPU-seconds of the SM-time of the claims on the GPU, over the
//     GPU-seconds of GPUs holding at least one claim. Live: the numerator is Prometheus' mean of the summed
//     tessera_claim_gpu_utilization_ratio of the namespace (tessera's per-claim gauge of what the simulated
//     driver reports), the denominator the test's per-second count of GPUs with an allocated claim; the
//     model: its per-GPU-second SM activity (fleetsim.Result.SMActive). With 100 % ceilings it equals the
//     model's GPU_UTIL (one busy client takes the whole GPU, two split it), so GPU_UTIL is not compared
//     separately.
// Bounds (fleetsim.AgreementBounds, stated and justified there before the first run): pods within 2 + 25 %
// of the model's, SM activity within ±0.10. Never timings.

import (
	"context"
	"fmt"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"tessera.dev/e2e/internal/fleet"
	"tessera.dev/e2e/internal/fleetsim"
)

// agreementRow is one side's counts.
type agreementRow struct {
	pods     int
	smActive float64
	gpuMean  float64 // mean GPUs held over the slice
}

type agreementResult struct {
	live, model   agreementRow
	engine        fleetsim.Result // the model's engines under the cluster's replicas
	requests      int
	promUse, gave float64 // Prometheus' mean summed claim use, and the test's own, GPUs
	wall          time.Duration
}

// engineMetrics serves each replica's concurrent requests (fleet_engine_requests) for Prometheus.
type engineMetrics struct {
	mu   sync.Mutex
	ns   string
	reqs map[string]float64 // pod -> requests
	svc  map[string]string  // pod -> service
}

func (m *engineMetrics) set(pod, service string, requests float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.reqs[pod], m.svc[pod] = requests, service
}

func (m *engineMetrics) drop(pod string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.reqs, pod)
	delete(m.svc, pod)
}

func startEngineMetrics(t *testing.T, a autoscalingAddon, ns string) *engineMetrics {
	t.Helper()
	m := &engineMetrics{ns: ns, reqs: map[string]float64{}, svc: map[string]string{}}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		m.mu.Lock()
		defer m.mu.Unlock()
		fmt.Fprintf(w, "# HELP fleet_engine_requests Requests queued or running in the replica's engine.\n# TYPE fleet_engine_requests gauge\n")
		pods := make([]string, 0, len(m.reqs))
		for p := range m.reqs {
			pods = append(pods, p)
		}
		sort.Strings(pods)
		for _, p := range pods {
			fmt.Fprintf(w, "fleet_engine_requests{namespace=%q,service=%q,pod=%q} %g\n", m.ns, m.svc[p], p, m.reqs[p])
		}
	})}
	go func() { _ = srv.Serve(l) }()
	target := filepath.Join(a.targets, ns+".json")
	if err := os.WriteFile(target, fmt.Appendf(nil, `[{"targets": [%q], "labels": {"job": "e2e-fleet-engines"}}]`, l.Addr().String()), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = os.Remove(target)
		_ = srv.Close()
	})
	return m
}

// createEngineScaledObject scales one service on its engines' concurrent requests per replica, as the
// model's HPA does: the sum over the service's replicas of each one's mean over the HPA's sync period
// (15 s), over the replicas (metricType AverageValue), against the target.
func createEngineScaledObject(t *testing.T, ns, service, prometheus string, cfg fleetsim.Config, compress float64) {
	t.Helper()
	so := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "keda.sh/v1alpha1",
		"kind":       "ScaledObject",
		"metadata":   map[string]any{"name": service, "namespace": ns},
		"spec": map[string]any{
			"scaleTargetRef":  map[string]any{"name": service},
			"pollingInterval": int64(5),
			"minReplicaCount": int64(1),
			"maxReplicaCount": int64(cfg.MaxReplicas),
			"advanced": map[string]any{"horizontalPodAutoscalerConfig": map[string]any{"behavior": map[string]any{
				"scaleDown": map[string]any{"stabilizationWindowSeconds": int64(math.Max(cfg.ScaleDownWindow/compress, 15))},
			}}},
			"triggers": []any{map[string]any{
				"type":       "prometheus",
				"metricType": "AverageValue",
				"metadata": map[string]any{
					"serverAddress": prometheus,
					"query":         fmt.Sprintf(`sum(avg_over_time(fleet_engine_requests{namespace=%q, service=%q}[15s])) or vector(0)`, ns, service),
					"threshold":     strconv.FormatFloat(cfg.HPATarget, 'f', -1, 64),
				},
			}},
		},
	}}
	if _, err := e.dyn.Resource(scaledObjectGVR).Namespace(ns).Create(ctxFor(t, 30*time.Second), so, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create ScaledObject %s/%s: %v", ns, service, err)
	}
}

// startServicesAutoscaling waits until the first replica of each of the services svc-0..svc-N runs in ns, then
// gives each its ScaledObject on the engines' concurrent requests: the live fleet runs' warm start.
func startServicesAutoscaling(t *testing.T, a autoscalingAddon, ns string, cfg fleetsim.Config, compress float64, timeout time.Duration) {
	t.Helper()
	waitFor(t, "the services' first replicas running", timeout, func(ctx context.Context) (bool, string) {
		list, err := e.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		running := 0
		for _, p := range list.Items {
			if p.Status.Phase == v1.PodRunning {
				running++
			}
		}
		return running == cfg.Services, fmt.Sprintf("%d of %d running", running, cfg.Services)
	})
	for k := 0; k < cfg.Services; k++ {
		createEngineScaledObject(t, ns, fmt.Sprintf("svc-%d", k), a.prometheus, cfg, compress)
	}
}

// agreementSlice is the slice both sides replay: the first window of the trace, 1 in thin requests.
func agreementSlice(t *testing.T, args fleetArgs) []fleet.Request {
	t.Helper()
	var reqs []fleet.Request
	var err error
	if strings.HasPrefix(args.trace, "gen:") {
		reqs, err = fleetsim.Generate(args.trace)
	} else {
		reqs, err = fleet.ReadTrace(args.trace)
	}
	if err != nil {
		t.Fatal(err)
	}
	var out []fleet.Request
	for i, r := range reqs {
		if r.At < args.window && i%args.thin == 0 {
			out = append(out, r)
		}
	}
	if len(out) == 0 {
		t.Fatalf("no request of %s in the first %s", args.trace, args.window)
	}
	return out
}

func runFleetAgreement(t *testing.T, rn realNodeEnv, a autoscalingAddon, loads processLoads, args fleetArgs, slice []fleet.Request) agreementResult {
	t.Helper()
	cfg := fleetsim.AgreementConfig(args.compress)
	policy := fleetsim.AgreementPolicy
	share := policy.Fixed
	ns := namespace(t, "fleet-agreement")
	engines := startEngineMetrics(t, a, ns)
	ceiling := fmt.Sprintf(`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"computeCeiling":%d}}}`, share.CeilingPercent)
	serviceOf := map[string]int{}
	for k := 0; k < cfg.Services; k++ {
		name := fmt.Sprintf("svc-%d", k)
		serviceOf[name] = k
		template := name + "-gpu"
		claimTemplate(t, ns, template, sharedClass(t),
			capacity(map[string]string{"memory": fmt.Sprintf("%dGi", share.MemoryBytes>>30), "compute": strconv.Itoa(share.RequestPercent)}),
			opaqueConfig(ceiling))
		coldDeployment(t, ns, name, template, rn.name)
		scaleTo(t, ns, name, 1)
	}
	// A warm start, as the model's: the first replica of every service runs before the slice begins.
	startServicesAutoscaling(t, a, ns, cfg, args.compress, 3*time.Minute)

	type replicaState struct {
		service int
		pid     int
		device  string
		gpu     int
		created time.Time
		warm    bool
		loaded  bool
	}
	known := map[string]*replicaState{}
	live := fleetsim.NewLive(cfg, slice, policy)
	span := float64(fleet.TraceSpan(slice)) / float64(time.Second)
	wall := time.Duration(span / args.compress * float64(time.Second))
	res := agreementResult{requests: len(slice)}
	var gpuSeconds, gave float64
	ticks := 0
	began := time.Now()
	for tick := 1; ; tick++ {
		time.Sleep(time.Until(began.Add(time.Duration(tick) * time.Second)))
		elapsed := time.Since(began)
		if elapsed > wall {
			elapsed = wall
		}
		list, err := e.client.CoreV1().Pods(ns).List(ctxFor(t, 30*time.Second), metav1.ListOptions{})
		if err != nil {
			t.Fatalf("list pods: %v", err)
		}
		var serving []fleetsim.LiveReplica
		gpus := map[int]bool{}
		present := map[string]bool{}
		for i := range list.Items {
			p := &list.Items[i]
			st := known[p.Name]
			if st == nil {
				st = &replicaState{service: serviceOf[p.Labels["app"]], created: p.CreationTimestamp.Time, gpu: -1, warm: tick == 1}
				known[p.Name] = st
				if p.CreationTimestamp.Time.Before(began.Add(wall)) {
					res.live.pods++
				}
			}
			if st.device == "" && p.Spec.NodeName != "" && len(p.Status.ResourceClaimStatuses) > 0 {
				if _, devices := realAllocations(t, p); len(devices) == 1 {
					st.device = devices[0].Device
					if m := gpuOfDevice.FindStringSubmatch(st.device); m != nil {
						st.gpu, _ = strconv.Atoi(m[1])
					}
					if !sharedName.MatchString(st.device) {
						t.Errorf("replica %s holds %s, not a share", p.Name, st.device)
					}
				}
			}
			if st.gpu >= 0 {
				gpus[st.gpu] = true
			}
			if p.DeletionTimestamp != nil || p.Status.Phase != v1.PodRunning || st.gpu < 0 {
				continue
			}
			if st.pid == 0 {
				st.pid = rn.containerPID(t, p, "serve")
			}
			// A new replica serves once it runs and its engine would have started: the model's time to
			// Ready (weights, engine start) in wall time, counted from the pod's creation.
			ready := st.created.Add(time.Duration(fleetsim.Classes[st.service%len(fleetsim.Classes)].ReadySeconds(fleetsim.KindMPS) / args.compress * float64(time.Second)))
			if !st.warm && time.Now().Before(ready) {
				continue
			}
			present[p.Name] = true
			serving = append(serving, fleetsim.LiveReplica{ID: p.Name, Service: st.service, GPU: st.gpu})
		}
		usage := live.Step(elapsed.Seconds()*args.compress, serving)
		for name, st := range known {
			u, ok := usage[name]
			if !ok || !present[name] {
				engines.drop(name)
				if st.loaded {
					// A replica that stopped serving (its pod is terminating) stops using its GPU.
					loads.set(t, st.device, st.pid, 0, "2Gi")
					st.loaded = false
				}
				continue
			}
			st.loaded = true
			pct := int(math.Round(u.ClaimUse * 100))
			loads.set(t, st.device, st.pid, min(pct, 100), "2Gi")
			engines.set(name, fmt.Sprintf("svc-%d", st.service), u.Requests)
			gave += u.ClaimUse
		}
		gpuSeconds += float64(len(gpus))
		ticks++
		if elapsed >= wall {
			break
		}
	}
	res.wall = time.Since(began)
	res.engine = live.Result()
	res.gave = gave / float64(ticks)
	// What Prometheus saw: the namespace's summed claim use, averaged over the slice.
	q := fmt.Sprintf(`avg_over_time((sum(tessera_claim_gpu_utilization_ratio{namespace=%q}) or vector(0))[%ds:2s])`, ns, int(res.wall.Seconds()))
	if r, err := promQuery(ctxFor(t, 30*time.Second), a.prometheus, q); err == nil && len(r) == 1 {
		res.promUse = r[0].Value
	} else {
		t.Errorf("Prometheus' mean claim use: %v (%d series)", err, len(r))
	}
	loads.clear()
	if gpuSeconds > 0 {
		res.live.smActive = res.promUse * float64(ticks) / gpuSeconds
		res.live.gpuMean = gpuSeconds / float64(ticks)
	}

	model := fleetsim.Run(cfg, slice, policy)
	res.model = agreementRow{pods: model.PodsCreated, smActive: model.SMActive.Mean, gpuMean: model.GPUHours * 3600 / span}
	return res
}

func checkAgreement(t *testing.T, r agreementResult) {
	t.Helper()
	if math.Abs(r.promUse-r.gave) > 0.15*r.gave+0.05 {
		t.Errorf("Prometheus' mean claim use %.3f GPUs, the test gave %.3f", r.promUse, r.gave)
	}
	podBound := float64(fleetsim.AgreementPodsSlack) + fleetsim.AgreementPodsFraction*float64(r.model.pods)
	if math.Abs(float64(r.live.pods-r.model.pods)) > podBound {
		t.Errorf("pods created: live %d, model %d; the bound is ±%.1f", r.live.pods, r.model.pods, podBound)
	}
	if math.Abs(r.live.smActive-r.model.smActive) > fleetsim.AgreementSMActiveDiff {
		t.Errorf("SM activity of GPUs held: live %.3f, model %.3f; the bound is ±%.2f", r.live.smActive, r.model.smActive, fleetsim.AgreementSMActiveDiff)
	}
}

func agreementTable(args fleetArgs, r agreementResult) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Trace: %s, first %s, 1 in %d requests (%d), %d services, compressed %gx; real node, %s; %.0f s wall.\n\n",
		filepath.Base(args.trace), args.window, args.thin, r.requests, fleetsim.AgreementServices, args.compress,
		time.Now().UTC().Format("2006-01-02"), r.wall.Seconds())
	b.WriteString("| side | pods created | SM activity of GPUs held (mean) | GPUs held (mean) |\n|---|---|---|---|\n")
	fmt.Fprintf(&b, "| live (Prometheus, KEDA, HPA, kube-scheduler, tessera) | %d | %.3f | %.2f |\n", r.live.pods, r.live.smActive, r.live.gpuMean)
	fmt.Fprintf(&b, "| model (fleetsim.Run) | %d | %.3f | %.2f |\n", r.model.pods, r.model.smActive, r.model.gpuMean)
	fmt.Fprintf(&b, "| bound | ±%.1f | ±%.2f | (not asserted) |\n\n",
		float64(fleetsim.AgreementPodsSlack)+fleetsim.AgreementPodsFraction*float64(r.model.pods), fleetsim.AgreementSMActiveDiff)
	fmt.Fprintf(&b, "The model's engines under the cluster's replicas (fleetsim.Live): SM activity %.3f, GPU_UTIL %.3f of the GPUs they ran on. "+
		"Prometheus' mean summed claim use %.3f GPUs, the load the test gave %.3f.\n", r.engine.SMActive.Mean, r.engine.GPUUtil.Mean, r.promUse, r.gave)
	return b.String()
}

// fleetAgreement runs the scenario, logs (and with FLEET_OUT writes) its table, and checks the bounds.
func fleetAgreement(t *testing.T, rn realNodeEnv, a autoscalingAddon, loads processLoads, args fleetArgs) {
	t.Helper()
	slice := agreementSlice(t, args)
	r := runFleetAgreement(t, rn, a, loads, args, slice)
	table := agreementTable(args, r)
	t.Log("\n" + table)
	if args.out != "" {
		doc := "## The live loop against the offline model (issue 39 item 6)\n\nWritten by `make bench-fleet TRACE=" + args.trace + "` " +
			"(e2e/k8s/e2etest/fleet_agreement_test.go). The trace is the only input; services, share sizes and ceilings, the HPA " +
			"target, replica caps and the slice's thinning are fixed in code (fleetsim.AgreementConfig, AgreementPolicy).\n\n" + table
		if err := os.WriteFile(args.out, []byte(doc), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	checkAgreement(t, r)
}
