package e2etest

// Issue 24 item 2: the autoscaling loop with real parts. Prometheus scrapes the chart's plugin pod, KEDA's
// operator turns the example's ScaledObject into an HPA on external metrics, kube-controller-manager's HPA
// controller reads them through the API server's aggregation layer from KEDA's adapter, and the Deployment's
// replicas follow the GPU use of their own shares. The test plays the service's clients: it holds a demand
// (in shares' worth of busy SMs) and spreads it over the replicas that run, as a load balancer would, by
// giving each replica's container process its part as synthetic load (`simulate load --pid`, which the
// simulated driver's NVML reports for that process, as a real driver reports a CUDA process's SM use).
//
// Asserted, as the user sees it: replicas rise when demand rises, each new replica's claim is prepared (its
// pod runs and its CUDA probe makes a context), replicas fall when demand falls, their claims are
// unprepared, scale to zero with the ScaledObject's activation and back from zero on requests waiting at
// the gateway (the second trigger), and nothing is left on the node at the end (no share record, MPS
// daemon beyond what running shares hold, or CDI spec of a gone claim). The reaction times (load step to
// the new pod Running) are printed, never judged.

import (
	"context"
	"encoding/json"
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
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	"tessera.dev/e2e/internal/cluster"
)

var scaledObjectGVR = schema.GroupVersionResource{Group: "keda.sh", Version: "v1alpha1", Resource: "scaledobjects"}

// autoscalingAddon is what e2e/scripts/autoscaling.sh started: Prometheus' URL and the folder of extra
// scrape targets (file_sd) a test may add itself to.
type autoscalingAddon struct {
	prometheus string
	targets    string
}

func autoscaling(t *testing.T) autoscalingAddon {
	t.Helper()
	dir := filepath.Join(e.runDir, "autoscaling")
	url, err := os.ReadFile(filepath.Join(dir, "prometheus.url"))
	if err != nil {
		t.Fatalf("the autoscaling add-on is not running (%v): run through `make e2e` (ADDONS=autoscaling, its default) or `make up ADDONS=autoscaling`", err)
	}
	return autoscalingAddon{prometheus: strings.TrimSpace(string(url)), targets: filepath.Join(dir, "targets")}
}

// gateway stands for the service's request gateway: it serves `inference_requests_waiting` for Prometheus
// to scrape (a file_sd target), the signal that wakes a Deployment KEDA scaled to zero.
type gateway struct {
	mu      sync.Mutex
	waiting int
}

func (g *gateway) setWaiting(n int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.waiting = n
}

func startGateway(t *testing.T, a autoscalingAddon, ns, service string) *gateway {
	t.Helper()
	g := &gateway{}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		g.mu.Lock()
		n := g.waiting
		g.mu.Unlock()
		fmt.Fprintf(w, "# HELP inference_requests_waiting Requests waiting for a replica.\n# TYPE inference_requests_waiting gauge\n")
		fmt.Fprintf(w, "inference_requests_waiting{namespace=%q,service=%q} %d\n", ns, service, n)
	})}
	go func() { _ = srv.Serve(l) }()
	target := filepath.Join(a.targets, ns+".json")
	if err := os.WriteFile(target, fmt.Appendf(nil, `[{"targets": [%q], "labels": {"job": "e2e-gateway"}}]`, l.Addr().String()), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = os.Remove(target)
		_ = srv.Close()
	})
	return g
}

// loadDriver spreads a demand over the replicas that run: each gets demand/replicas of its share's SMs
// (capped at all of them), as its container process's synthetic load.
type loadDriver struct {
	rn       realNodeEnv
	loads    processLoads
	ns, app  string
	share    float64 // the part of a GPU each replica's claim was given
	demand   float64 // in shares' worth of busy SMs
	replicas map[string]replica
}

type replica struct {
	pid      int
	device   string
	claimUID string
	running  time.Time // when its pod first ran, as the test saw it
}

// drive sets every running replica's load for the current demand and returns the replicas it saw running.
func (d *loadDriver) drive(t *testing.T, ctx context.Context) (running []string, pending int) {
	t.Helper()
	list, err := e.client.CoreV1().Pods(d.ns).List(ctx, metav1.ListOptions{LabelSelector: "app=" + d.app})
	if err != nil {
		return nil, 0
	}
	for _, p := range list.Items {
		if p.DeletionTimestamp != nil {
			continue
		}
		if p.Status.Phase != v1.PodRunning {
			pending++
			continue
		}
		if _, ok := d.replicas[p.Name]; !ok {
			claim, devices := realAllocations(t, &p)
			if len(devices) != 1 {
				t.Fatalf("%s: allocated %v, want one shared device", p.Name, deviceNames(devices))
			}
			d.replicas[p.Name] = replica{pid: d.rn.containerPID(t, &p, "serve"), device: devices[0].Device,
				claimUID: string(claim.UID), running: time.Now()}
		}
		running = append(running, p.Name)
	}
	sort.Strings(running)
	if len(running) == 0 {
		return running, pending
	}
	each := int(math.RoundToEven(min(d.demand/float64(len(running)), 1) * d.share * 100))
	for _, name := range running {
		r := d.replicas[name]
		d.loads.set(t, r.device, r.pid, each, "2Gi")
	}
	return running, pending
}

// step sets the demand and waits until `want` replicas run and none is pending, driving the load all the
// while; it returns how long that took.
func (d *loadDriver) step(t *testing.T, demand float64, want int, timeout time.Duration) time.Duration {
	t.Helper()
	d.demand = demand
	began := time.Now()
	waitFor(t, fmt.Sprintf("demand %.2f shares: %d replicas of %s running", demand, want, d.app), timeout, func(ctx context.Context) (bool, string) {
		running, pending := d.drive(t, ctx)
		return len(running) == want && pending == 0, fmt.Sprintf("%d running %v, %d pending, HPA: %s", len(running), running, pending, hpaState(ctx, d.ns))
	})
	return time.Since(began)
}

// hpaState is the HPA KEDA made, in words: its current and desired replicas and what its metrics read.
func hpaState(ctx context.Context, ns string) string {
	list, err := e.client.AutoscalingV2().HorizontalPodAutoscalers(ns).List(ctx, metav1.ListOptions{})
	if err != nil || len(list.Items) == 0 {
		return fmt.Sprintf("no HPA (err %v)", err)
	}
	h := list.Items[0]
	var metrics []string
	for _, m := range h.Status.CurrentMetrics {
		if m.External != nil {
			v := m.External.Current.Value
			if v == nil {
				v = m.External.Current.AverageValue
			}
			if v != nil {
				metrics = append(metrics, fmt.Sprintf("%s=%s", m.External.Metric.Name, v.String()))
			}
		}
	}
	var conds []string
	for _, c := range h.Status.Conditions {
		if c.Status != v1.ConditionTrue {
			conds = append(conds, fmt.Sprintf("%s=%s(%s)", c.Type, c.Status, c.Reason))
		}
	}
	return fmt.Sprintf("%s current %d desired %d %v %v", h.Name, h.Status.CurrentReplicas, h.Status.DesiredReplicas, metrics, conds)
}

// exampleScaledObject is the example's ScaledObject (e2e/manifests/keda/scaledobject.yaml, shown in
// deployments/examples/autoscaling/README.md) for namespace ns and Prometheus at url, with the knobs this
// test shortens to fit a test run: cooldown and scale-down window (60 s and 120 s as shipped).
func exampleScaledObject(t *testing.T, ns, url string) *unstructured.Unstructured {
	t.Helper()
	objs, err := cluster.ReadManifests(filepath.Join(e.repoRoot, "e2e", "manifests", "keda", "scaledobject.yaml"))
	if err != nil || len(objs) != 1 {
		t.Fatalf("read the example ScaledObject: %v (%d objects)", err, len(objs))
	}
	so := objs[0]
	so.SetNamespace(ns)
	triggers, _, _ := unstructured.NestedSlice(so.Object, "spec", "triggers")
	for _, tr := range triggers {
		m := tr.(map[string]any)["metadata"].(map[string]any)
		m["serverAddress"] = url
		m["query"] = strings.ReplaceAll(m["query"].(string), `namespace="tessera-examples"`, fmt.Sprintf("namespace=%q", ns))
	}
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(unstructured.SetNestedSlice(so.Object, triggers, "spec", "triggers"))
	must(unstructured.SetNestedField(so.Object, int64(20), "spec", "cooldownPeriod"))
	must(unstructured.SetNestedField(so.Object, int64(20), "spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleDown", "stabilizationWindowSeconds"))
	return so
}

func TestAutoscalingKEDAScalesGPUSharesOnTheirOwnUseThroughPrometheusAndTheHPA(t *testing.T) {
	rn := realNode(t)
	a := autoscaling(t)
	installChart(t, rn)
	waitChartPods(t, "the plugin and MPS supervisor pods Ready on "+rn.name, "kubelet-plugin", "mps-supervisor")
	waitFor(t, "Prometheus scraping the chart's plugin pod", 2*time.Minute, func(ctx context.Context) (bool, string) {
		r, err := promQuery(ctx, a.prometheus, `up{job="kubernetes-pods", kubernetes_namespace="`+chartNamespace+`"} == 1`)
		return err == nil && len(r) > 0, fmt.Sprintf("%d targets up (err %v)", len(r), err)
	})

	ns := namespace(t, "autoscaling")
	const app = "inference"
	claimTemplate(t, ns, "inference-gpu-share", sharedClass(t), capacity(map[string]string{"memory": "10Gi", "compute": "25"}))
	coldDeployment(t, ns, app, "inference-gpu-share", rn.name)
	scaleTo(t, ns, app, 1)
	gw := startGateway(t, a, ns, app)
	so := exampleScaledObject(t, ns, a.prometheus)
	if _, err := e.dyn.Resource(scaledObjectGVR).Namespace(ns).Create(ctxFor(t, 30*time.Second), so, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create the example ScaledObject: %v", err)
	}

	d := &loadDriver{rn: rn, loads: realNodeLoads(t, rn), ns: ns, app: app, share: 0.25, replicas: map[string]replica{}}
	waitFor(t, "KEDA's HPA reading the share's utilization", 2*time.Minute, func(ctx context.Context) (bool, string) {
		d.drive(t, ctx)
		s := hpaState(ctx, ns)
		return strings.Contains(s, "s0-prometheus="), s
	})

	type reaction struct {
		what string
		took time.Duration
	}
	var reactions []reaction
	// Two shares' worth of busy SMs: one replica reads 1.0 of its share (HPA: ceil(1 × 1.0 / 0.7) = 2), two
	// read 1.0 each (3), three read 0.67 (ceil(3 × 0.67 / 0.7) = 3): it settles at three.
	reactions = append(reactions, reaction{"demand 0 → 2 shares: 1 → 3 replicas running", d.step(t, 2.0, 3, 4*time.Minute)})
	up := map[string]replica{}
	for name, r := range d.replicas {
		up[name] = r
	}
	for _, name := range keys(up) {
		p, err := e.client.CoreV1().Pods(ns).Get(ctxFor(t, 30*time.Second), name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("replica %s: %v", name, err)
		}
		if log, err := podLogs(ctxFor(t, 30*time.Second), p, "serve", false); err != nil || !readyCtx.MatchString(log) {
			t.Errorf("replica %s made no CUDA context through its share (err %v):\n%s", name, err, log)
		}
		if _, ok := observeNode(t, rn.name).records[up[name].claimUID]; !ok {
			t.Errorf("replica %s: the plugin holds no prepared claim %s", name, up[name].claimUID)
		}
	}

	// Half a share: three replicas read 0.17 (HPA: ceil(3 × 0.17 / 0.7) = 1) once the scale-down window ends.
	reactions = append(reactions, reaction{"demand 2 → 0.5 shares: 3 → 1 replica", d.step(t, 0.5, 1, 3*time.Minute)})
	waitFor(t, "the claims of the removed replicas unprepared", 2*time.Minute, func(ctx context.Context) (bool, string) {
		running, _ := d.drive(t, ctx)
		h := observeNode(t, rn.name)
		var held []string
		for name, r := range up {
			if _, recorded := h.records[r.claimUID]; !contains(running, name) && (recorded || contains(h.cdi, r.claimUID)) {
				held = append(held, name)
			}
		}
		return len(held) == 0, fmt.Sprintf("still held for %v", held)
	})

	// The README's scale-to-zero variant: minReplicaCount 0. With no demand and no request waiting both
	// triggers are inactive, and KEDA scales to zero after its cooldown.
	patch := []byte(`{"spec": {"minReplicaCount": 0}}`)
	if _, err := e.dyn.Resource(scaledObjectGVR).Namespace(ns).Patch(ctxFor(t, 30*time.Second), so.GetName(), types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatalf("patch the ScaledObject's minReplicaCount to 0: %v", err)
	}
	reactions = append(reactions, reaction{"demand 0.5 → 0, no request waiting: 1 → 0 replicas", d.step(t, 0, 0, 3*time.Minute)})
	waitFor(t, "nothing of the shares left on the node", 2*time.Minute, func(ctx context.Context) (bool, string) {
		h := observeNode(t, rn.name)
		var held []string
		for name, r := range d.replicas {
			if _, ok := h.records[r.claimUID]; ok || contains(h.cdi, r.claimUID) {
				held = append(held, name)
			}
		}
		return len(held) == 0 && len(h.daemons) == 0, fmt.Sprintf("claims held for %v, MPS daemons %v", held, h.daemons)
	})

	// Requests wait at the gateway: the second trigger activates the ScaledObject, KEDA scales 0 → 1.
	gw.setWaiting(3)
	reactions = append(reactions, reaction{"3 requests waiting: 0 → 1 replica running", d.step(t, 0.5, 1, 3*time.Minute)})
	gw.setWaiting(0)

	t.Logf("reaction times (Prometheus scrape 2 s, KEDA polling 5 s, HPA sync 15 s; load step to the pods Running):")
	for _, r := range reactions {
		t.Logf("  %-55s %6.1f s", r.what, r.took.Seconds())
	}
}

// promQuery runs an instant query against Prometheus' HTTP API and returns the series' values by labels.
func promQuery(ctx context.Context, url, query string) ([]promSample, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/api/v1/query", nil)
	if err != nil {
		return nil, err
	}
	q := req.URL.Query()
	q.Set("query", query)
	req.URL.RawQuery = q.Encode()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			Result []struct {
				Metric map[string]string `json:"metric"`
				Value  [2]any            `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, fmt.Errorf("query %q: %w", query, err)
	}
	if body.Status != "success" {
		return nil, fmt.Errorf("query %q: %s", query, body.Error)
	}
	var out []promSample
	for _, r := range body.Data.Result {
		s, _ := r.Value[1].(string)
		v, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return nil, fmt.Errorf("query %q: value %v: %w", query, r.Value[1], err)
		}
		out = append(out, promSample{Metric: r.Metric, Value: v})
	}
	return out, nil
}

type promSample struct {
	Metric map[string]string
	Value  float64
}
