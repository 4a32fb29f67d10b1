package e2etest

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"

	"tessera.dev/e2e/internal/cluster"
)

// promResult is promcheck's report (e2e/tools/promcheck).
type promResult struct {
	Samples int `json:"samplesScraped"`
	Result  []struct {
		Metric map[string]string `json:"metric"`
		Value  float64           `json:"value"`
	} `json:"result"`
}

var (
	healthAddrArg = regexp.MustCompile(`export TESSERA_HEALTH_ADDR=([0-9.:]+)`)
	pluginBinArg  = regexp.MustCompile(`exec (\S*tessera-kubelet-plugin)`)
)

// pluginLaunch reads the plugin's launch script (RUN_DIR/procs/plugin-<node>.sh, written by up.sh): the
// binary and its metrics URL.
func pluginLaunch(t *testing.T, node string) (bin, metricsURL string) {
	t.Helper()
	script, err := os.ReadFile(filepath.Join(e.runDir, "procs", "plugin-"+node+".sh"))
	if err != nil {
		t.Fatalf("read the plugin's launch script: %v", err)
	}
	addr := healthAddrArg.FindStringSubmatch(string(script))
	b := pluginBinArg.FindStringSubmatch(string(script))
	if addr == nil || b == nil {
		t.Fatalf("the plugin on %s has no TESSERA_HEALTH_ADDR (e2e/scripts/up.sh sets it):\n%s", node, script)
	}
	return b[1], "http://" + addr[1] + "/metrics"
}

// promcheckBin builds e2e/bin/promcheck (once per run; go's cache makes an unchanged build a no-op).
func promcheckBin(t *testing.T) string {
	t.Helper()
	promcheckBuild.Do(func() {
		out, err := exec.Command(filepath.Join(e.repoRoot, "e2e", "scripts", "build-promcheck.sh")).CombinedOutput()
		if err != nil {
			promcheckErr = fmt.Errorf("build promcheck: %v\n%s", err, out)
		}
	})
	if promcheckErr != nil {
		t.Fatal(promcheckErr)
	}
	return filepath.Join(e.repoRoot, "e2e", "bin", "promcheck")
}

var (
	promcheckBuild sync.Once
	promcheckErr   error
)

// promcheck evaluates query after scraping every target.
func promcheck(t *testing.T, targets []string, query string) promResult {
	t.Helper()
	args := []string{"--scrapes", "2", "--interval", "500ms", "--query", query}
	for _, target := range targets {
		args = append(args, "--target", target)
	}
	out, err := exec.Command(promcheckBin(t), args...).Output()
	if err != nil {
		stderr := ""
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("promcheck %q: %v\n%s", query, err, stderr)
	}
	var r promResult
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("promcheck output %q: %v", out, err)
	}
	return r
}

// scaledObjectQuery is the Prometheus query of the example's KEDA trigger on GPU use, with its namespace
// made ns.
func scaledObjectQuery(t *testing.T, obj *unstructured.Unstructured, ns string) string {
	t.Helper()
	triggers, _, _ := unstructured.NestedSlice(obj.Object, "spec", "triggers")
	var query string
	for _, tr := range triggers {
		q, _, _ := unstructured.NestedString(tr.(map[string]any), "metadata", "query")
		if strings.Contains(q, "tessera_claim_gpu_utilization_ratio") {
			query = q
		}
	}
	if query == "" {
		t.Fatalf("the ScaledObject has no trigger on tessera_claim_gpu_utilization_ratio: %v", triggers)
	}
	if !strings.Contains(query, `namespace="tessera-examples"`) {
		t.Fatalf("the ScaledObject's query %q does not select the example's namespace", query)
	}
	return strings.ReplaceAll(query, `namespace="tessera-examples"`, fmt.Sprintf("namespace=%q", ns))
}

func TestMetricsGiveEachClaimsGPUUseAndTheAutoscalingExampleScalesOnIt(t *testing.T) {
	ns := namespace(t, "e2e-metrics")
	claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "10Gi", "compute": "25"}))
	claimTemplate(t, ns, "whole", gpuClass(t))
	pod(t, ns, "inference-0", "share", "")
	pod(t, ns, "trainer-0", "whole", "")
	share := allocations(t, waitRunning(t, ns, "inference-0", 2*time.Minute))[0]
	whole := allocations(t, waitRunning(t, ns, "trainer-0", 2*time.Minute))[0]

	// Synthetic load as a user's processes would make it: the share's own process, and the whole GPU's.
	type load struct {
		a      allocation
		claim  bool
		util   string
		memory string
	}
	for _, l := range []load{{share, true, "20", "6Gi"}, {whole, false, "60", "20Gi"}} {
		node := l.a.pod.Spec.NodeName
		bin, _ := pluginLaunch(t, node)
		args := []string{"simulate", "load", "--state-dir", filepath.Join(e.runDir, "nodes", node, "plugin-state"),
			"--device", l.a.result.Device, "--util", l.util, "--memory", l.memory}
		if l.claim {
			args = append(args, "--claim", l.a.claim.Namespace+"/"+l.a.claim.Name)
		}
		if out, err := exec.Command(bin, args...).CombinedOutput(); err != nil {
			t.Fatalf("simulate load on %s: %v\n%s", l.a.result.Device, err, out)
		}
		t.Cleanup(func() {
			_ = exec.Command(bin, "simulate", "load", "--clear", "--device", l.a.result.Device,
				"--state-dir", filepath.Join(e.runDir, "nodes", node, "plugin-state")).Run()
		})
	}
	var targets []string
	for _, n := range pluginNames() {
		_, url := pluginLaunch(t, strings.TrimPrefix(n, "plugin-"))
		targets = append(targets, url)
	}

	t.Run("the ScaledObject's query reads the share pods' synthetic load", func(t *testing.T) {
		objs, err := cluster.ReadManifests(filepath.Join(e.repoRoot, "e2e", "manifests", "keda", "scaledobject.yaml"))
		if err != nil || len(objs) != 1 {
			t.Fatalf("read the example ScaledObject: %v (%d objects)", err, len(objs))
		}
		readme, err := os.ReadFile(filepath.Join(e.repoRoot, "deployments", "examples", "autoscaling", "README.md"))
		if err != nil {
			t.Fatal(err)
		}
		query := scaledObjectQuery(t, objs[0], "tessera-examples")
		if !strings.Contains(string(readme), query) {
			t.Errorf("the example README does not show the ScaledObject's query %q", query)
		}
		r := promcheck(t, targets, scaledObjectQuery(t, objs[0], ns))
		if len(r.Result) != 1 || math.Abs(r.Result[0].Value-0.80) > 1e-9 {
			t.Fatalf("query gave %+v, want one value 0.80 (inference-0's 20 %% of the GPU over its 25 %% share)", r.Result)
		}
	})

	t.Run("each claim's series names its namespace, pod, claim, request and device", func(t *testing.T) {
		util := promcheck(t, targets, fmt.Sprintf("tessera_claim_gpu_utilization_ratio{namespace=%q}", ns))
		memory := promcheck(t, targets, fmt.Sprintf("tessera_claim_gpu_memory_used_bytes{namespace=%q}", ns))
		want := map[string]struct {
			a            allocation
			util, memory float64
		}{
			"inference-0": {share, 0.20, 6 << 30},
			"trainer-0":   {whole, 0.60, 20 << 30},
		}
		for name, r := range map[string]promResult{"utilization": util, "memory": memory} {
			if len(r.Result) != len(want) {
				t.Fatalf("%s: %d series %+v, want one per pod", name, len(r.Result), r.Result)
			}
			for _, s := range r.Result {
				w, ok := want[s.Metric["pod"]]
				if !ok {
					t.Fatalf("%s: series of an unknown pod: %v", name, s.Metric)
				}
				labels := map[string]string{"claim": w.a.claim.Name, "request": w.a.result.Request, "device": w.a.result.Device}
				for k, v := range labels {
					if s.Metric[k] != v {
						t.Errorf("%s of %s: label %s=%q, want %q", name, s.Metric["pod"], k, s.Metric[k], v)
					}
				}
				value := w.util
				if name == "memory" {
					value = w.memory
				}
				if math.Abs(s.Value-value) > 1e-9 {
					t.Errorf("%s of %s = %v, want %v", name, s.Metric["pod"], s.Value, value)
				}
			}
		}
	})

	t.Run("each claim's compute share is the part of the GPU its device was given", func(t *testing.T) {
		r := promcheck(t, targets, fmt.Sprintf("tessera_claim_gpu_compute_share_ratio{namespace=%q}", ns))
		want := map[string]float64{"inference-0": 0.25, "trainer-0": 1}
		got := map[string]float64{}
		for _, s := range r.Result {
			got[s.Metric["pod"]] = s.Value
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("compute shares by pod %v, want %v (the share's compute: 25, a whole GPU)", got, want)
		}
	})

	t.Run("each claim's device info names its GPU by the UUID dcgm-exporter's series carry", func(t *testing.T) {
		r := promcheck(t, targets, fmt.Sprintf("tessera_claim_device_info{namespace=%q}", ns))
		want := map[string]allocation{"inference-0": share, "trainer-0": whole}
		if len(r.Result) != len(want) {
			t.Fatalf("%d series %+v, want one per pod", len(r.Result), r.Result)
		}
		for _, s := range r.Result {
			a, ok := want[s.Metric["pod"]]
			if !ok {
				t.Fatalf("series of an unknown pod: %v", s.Metric)
			}
			// The UUID the container is given: the physical GPU's, for a whole GPU and a share of one.
			uuid := a.edits.EnvMap()[uuidEnvKey(a.result.Device)]
			sharing := s.Metric["sharing"] != ""
			if uuid == "" || s.Metric["UUID"] != uuid || s.Metric["GPU_I_ID"] != "" || s.Metric["claim"] != a.claim.Name ||
				s.Metric["device"] != a.result.Device || sharing != (a.pod.Name == "inference-0") || s.Value != 1 {
				t.Errorf("%s: %v = %v, want UUID %q, no GPU_I_ID, claim %s, device %s, sharing only for the share, 1",
					a.pod.Name, s.Metric, s.Value, uuid, a.claim.Name, a.result.Device)
			}
		}
	})

	t.Run("every plugin's metric names, labels and help pass promlint", func(t *testing.T) {
		args := []string{"--lint"}
		for _, target := range targets {
			args = append(args, "--target", target)
		}
		if out, err := exec.Command(promcheckBin(t), args...).CombinedOutput(); err != nil {
			t.Fatalf("promlint (what promtool check metrics runs) found problems: %v\n%s", err, out)
		}
	})

	t.Run("the plugin reports its prepares and devices", func(t *testing.T) {
		r := promcheck(t, targets, `sum(tessera_plugin_claim_operations_total{operation="prepare",result="success"})`)
		if len(r.Result) != 1 || r.Result[0].Value < 2 {
			t.Errorf("successful prepares %+v, want at least this test's two", r.Result)
		}
		r = promcheck(t, targets, `sum by (kind) (tessera_plugin_prepared_devices)`)
		got := map[string]float64{}
		for _, s := range r.Result {
			got[s.Metric["kind"]] = s.Value
		}
		if got["gpu"] < 1 || got["shared"] < 1 {
			t.Errorf("prepared devices by kind %v, want at least this test's whole GPU and share", got)
		}
	})

	t.Run("the ScaledObject and the HPA are accepted by the API server KEDA's CRDs extend", func(t *testing.T) {
		ctx := ctxFor(t, 2*time.Minute)
		autoscaling(t) // KEDA's CRDs come with the add-on
		objs, err := cluster.ReadManifests(
			filepath.Join(e.repoRoot, "e2e", "manifests", "keda", "scaledobject.yaml"),
			filepath.Join(e.repoRoot, "deployments", "examples", "autoscaling", "autoscaling.yaml"),
		)
		if err != nil {
			t.Fatal(err)
		}
		var scalers []*unstructured.Unstructured
		for _, o := range objs {
			if o.GetKind() == "ScaledObject" || o.GetKind() == "HorizontalPodAutoscaler" {
				o.SetNamespace(ns)
				scalers = append(scalers, o)
			}
		}
		if len(scalers) != 2 {
			t.Fatalf("found %d of the ScaledObject and the HPA", len(scalers))
		}
		// A fresh applier: its REST mapping must know the kind the CRD just added.
		var lastErr error
		err = wait.PollUntilContextTimeout(ctx, time.Second, time.Minute, true, func(ctx context.Context) (bool, error) {
			dry, err := cluster.NewApplier(e.cfg)
			if err != nil {
				return false, err
			}
			dry.DryRun = true
			lastErr = dry.Apply(ctx, scalers, ns)
			return lastErr == nil, nil
		})
		if err != nil {
			t.Fatalf("the API server did not accept the ScaledObject and the HPA: %v", lastErr)
		}
	})
}
