// Package dcgmjoin tests the chart's DCGM recording rules (deployments/prometheus/tessera-dcgm.rules.yaml)
// in a real Prometheus (e2e/bin/autoscaling/prometheus, built by e2e/scripts/build-autoscaling.sh), with no
// cluster: two pages are served on 127.0.0.1, dcgm-exporter's series for one node and the tessera plugin's
// tessera_claim_device_info for the claims on it, scraped every 200 ms, and the recorded per-pod series are
// read back through the HTTP API.
package dcgmjoin

import (
	"encoding/json"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"
)

// The fields of dcgm-exporter's etc/default-counters.csv at d5e5f510a1b6b393f39a43293ccd9dc985defc79
// (2026-05-12), in its order, with their Prometheus type; DCGM_FI_DRIVER_VERSION, of type label, is not a
// series but a label on every one.
var defaultCounters = []struct{ name, typ string }{
	{"DCGM_FI_DEV_SM_CLOCK", "gauge"},
	{"DCGM_FI_DEV_MEM_CLOCK", "gauge"},
	{"DCGM_FI_DEV_MEMORY_TEMP", "gauge"},
	{"DCGM_FI_DEV_GPU_TEMP", "gauge"},
	{"DCGM_FI_DEV_POWER_USAGE", "gauge"},
	{"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter"},
	{"DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter"},
	{"DCGM_FI_DEV_GPU_UTIL", "gauge"},
	{"DCGM_FI_DEV_MEM_COPY_UTIL", "gauge"},
	{"DCGM_FI_DEV_ENC_UTIL", "gauge"},
	{"DCGM_FI_DEV_DEC_UTIL", "gauge"},
	{"DCGM_FI_DEV_XID_ERRORS", "gauge"},
	{"DCGM_FI_DEV_FB_FREE", "gauge"},
	{"DCGM_FI_DEV_FB_USED", "gauge"},
	{"DCGM_FI_DEV_FB_RESERVED", "gauge"},
	{"DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter"},
	{"DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge"},
	{"DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter"},
	{"DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter"},
	{"DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge"},
	{"DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge"},
	{"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge"},
	{"DCGM_FI_PROF_DRAM_ACTIVE", "gauge"},
	{"DCGM_FI_PROF_PCIE_TX_BYTES", "gauge"},
	{"DCGM_FI_PROF_PCIE_RX_BYTES", "gauge"},
}

// Fields DCGM reports per MIG GPU instance; the others only on the GPU (GPU_UTIL reads 0 there: "no plans",
// NVIDIA/DCGM#80).
var perInstance = map[string]bool{
	"DCGM_FI_DEV_GPU_UTIL": true, "DCGM_FI_DEV_FB_FREE": true, "DCGM_FI_DEV_FB_USED": true,
	"DCGM_FI_PROF_GR_ENGINE_ACTIVE": true, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": true, "DCGM_FI_PROF_DRAM_ACTIVE": true,
}

// entity is one DCGM entity on the node: a GPU, or a MIG GPU instance of one (gi set).
type entity struct {
	gpu     int
	uuid    string
	gi      string
	profile string
}

const (
	gpuWhole  = "GPU-0a0a0a0a-0000-4000-8000-000000000000"
	gpuMIG    = "GPU-1b1b1b1b-0000-4000-8000-000000000001"
	gpuShared = "GPU-2c2c2c2c-0000-4000-8000-000000000002"
	gpuIdle   = "GPU-3d3d3d3d-0000-4000-8000-000000000003"
)

var entities = []entity{
	{gpu: 0, uuid: gpuWhole},
	{gpu: 1, uuid: gpuMIG},
	{gpu: 1, uuid: gpuMIG, gi: "1", profile: "3g.40gb"},
	{gpu: 1, uuid: gpuMIG, gi: "9", profile: "1g.10gb"},
	{gpu: 2, uuid: gpuShared},
	{gpu: 3, uuid: gpuIdle},
}

// value is each series' distinct value: the entity's index and the field's, so a join that picks the wrong
// entity (the MIG parent's for an instance's pod, say) reads a different number.
func value(e, field int) float64 { return float64((e+1)*100 + field) }

func fieldIndex(name string) int {
	for i, c := range defaultCounters {
		if c.name == name {
			return i
		}
	}
	panic(name)
}

func entityIndex(uuid, gi string) int {
	for i, e := range entities {
		if e.uuid == uuid && e.gi == gi {
			return i
		}
	}
	panic(uuid + "/" + gi)
}

// dcgmPage is the page dcgm-exporter serves for the node, label for label as its GPU template writes them
// (internal/pkg/rendermetrics/render_metrics.go: gpu, UUID, pci_bus_id, device, modelName, GPU_I_PROFILE and
// GPU_I_ID on a MIG instance's series only, Hostname, then label counters). Hostname is the name up to
// d5e5f51, which renamed it hostname; the rules carry either.
func dcgmPage() string {
	var b strings.Builder
	for f, c := range defaultCounters {
		fmt.Fprintf(&b, "# HELP %s help\n# TYPE %s %s\n", c.name, c.name, c.typ)
		for i, e := range entities {
			if e.gi != "" && !perInstance[c.name] {
				continue
			}
			fmt.Fprintf(&b, `%s{gpu="%d",UUID="%s",pci_bus_id="00000000:%02X:00.0",device="nvidia%d",modelName="NVIDIA H100 80GB HBM3"`,
				c.name, e.gpu, e.uuid, 0x18+e.gpu, e.gpu)
			if e.gi != "" {
				fmt.Fprintf(&b, `,GPU_I_PROFILE="%s",GPU_I_ID="%s"`, e.profile, e.gi)
			}
			fmt.Fprintf(&b, `,Hostname="node-a",DCGM_FI_DRIVER_VERSION="580.95.05"} %g`+"\n", value(i, f))
		}
	}
	return b.String()
}

// info is one tessera_claim_device_info sample as the plugin writes it (kubelet-plugin/src/metrics/dcgm.rs;
// its test pins the line).
type info struct{ pod, claim, device, uuid, gi, mig, sharing string }

var claims = []info{
	{pod: "pod-w", claim: "w", device: "gpu-0", uuid: gpuWhole},
	{pod: "pod-m", claim: "m", device: "gpu-1-mig-1g-10gb-6", uuid: gpuMIG, gi: "9", mig: "MIG-9e9e9e9e-0000-4000-8000-000000000009"},
	// GPU 2 is shared by two pods' MPS claims, and pod-a holds two shares of it (counted once).
	{pod: "pod-a", claim: "a", device: "gpu-2-shared", uuid: gpuShared, sharing: "MPS"},
	{pod: "pod-a", claim: "a2", device: "gpu-2-shared", uuid: gpuShared, sharing: "MPS"},
	{pod: "pod-b", claim: "b", device: "gpu-2-shared", uuid: gpuShared, sharing: "MPS"},
}

func tesseraPage() string {
	var b strings.Builder
	b.WriteString("# HELP tessera_claim_device_info A pod of a claim holding a device, and the DCGM entity it is on (dcgm-exporter's UUID and GPU_I_ID), 1.\n")
	b.WriteString("# TYPE tessera_claim_device_info gauge\n")
	for _, c := range claims {
		fmt.Fprintf(&b, `tessera_claim_device_info{namespace="team",pod="%s",claim="%s",request="gpu",device="%s",UUID="%s",GPU_I_ID="%s",mig_uuid="%s",sharing="%s"} 1.0`+"\n",
			c.pod, c.claim, c.device, c.uuid, c.gi, c.mig, c.sharing)
	}
	b.WriteString("# EOF\n")
	return b.String()
}

func repoRoot(t *testing.T) string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

// prometheusBinary is e2e/bin/autoscaling/prometheus (or $PROMETHEUS_BIN). `make test-bench` builds it
// first and sets TESSERA_REQUIRE_PROMETHEUS, so there a missing binary fails the test.
func prometheusBinary(t *testing.T) string {
	bin := os.Getenv("PROMETHEUS_BIN")
	if bin == "" {
		bin = filepath.Join(repoRoot(t), "e2e", "bin", "autoscaling", "prometheus")
	}
	if _, err := os.Stat(bin); err != nil {
		if os.Getenv("TESSERA_REQUIRE_PROMETHEUS") != "" {
			t.Fatalf("no Prometheus at %s (%v): build it with e2e/scripts/build-autoscaling.sh --prometheus-only", bin, err)
		}
		t.Skipf("no Prometheus at %s: build it with e2e/scripts/build-autoscaling.sh --prometheus-only (make test-bench does)", bin)
	}
	return bin
}

func freePort(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

type sample struct {
	Metric map[string]string `json:"metric"`
	Value  [2]any            `json:"value"`
}

func (s sample) float(t *testing.T) float64 {
	var f float64
	if _, err := fmt.Sscan(s.Value[1].(string), &f); err != nil {
		t.Fatal(err)
	}
	return f
}

type api struct {
	t    *testing.T
	base string
}

func (a api) get(path string, params url.Values, out any) error {
	resp, err := http.Get(a.base + path + "?" + params.Encode())
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var body struct {
		Status string          `json:"status"`
		Error  string          `json:"error"`
		Data   json.RawMessage `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return err
	}
	if body.Status != "success" {
		return fmt.Errorf("%s: %s", path, body.Error)
	}
	return json.Unmarshal(body.Data, out)
}

func (a api) query(q string) []sample {
	a.t.Helper()
	var data struct {
		Result []sample `json:"result"`
	}
	if err := a.get("/api/v1/query", url.Values{"query": {q}}, &data); err != nil {
		a.t.Fatalf("%s: %v", q, err)
	}
	return data.Result
}

// startPrometheus runs Prometheus over the two pages with the shipped rules, and waits until the rules
// have been evaluated over both scrapes.
func startPrometheus(t *testing.T) api {
	bin := prometheusBinary(t)
	rules := filepath.Join(repoRoot(t), "deployments", "prometheus", "tessera-dcgm.rules.yaml")
	serve := func(page, contentType string) *httptest.Server {
		s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", contentType)
			fmt.Fprint(w, page)
		}))
		t.Cleanup(s.Close)
		return s
	}
	dcgm := serve(dcgmPage(), "text/plain; version=0.0.4; charset=utf-8")
	// The plugin's content type (tessera_api::metrics::CONTENT_TYPE).
	tessera := serve(tesseraPage(), "application/openmetrics-text; version=1.0.0; charset=utf-8")
	dir := t.TempDir()
	config := fmt.Sprintf(`global:
  scrape_interval: 200ms
  evaluation_interval: 200ms
rule_files: [%q]
scrape_configs:
- job_name: dcgm-exporter
  static_configs: [{targets: [%q]}]
- job_name: tessera
  honor_labels: true
  static_configs: [{targets: [%q]}]
`, rules, strings.TrimPrefix(dcgm.URL, "http://"), strings.TrimPrefix(tessera.URL, "http://"))
	if err := os.WriteFile(filepath.Join(dir, "prometheus.yml"), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	// The free port is known only once a listener closes it: another process may take it first, and then
	// Prometheus exits saying so and is started again on another.
	for attempt := 1; ; attempt++ {
		a, err := runPrometheus(t, bin, dir, freePort(t))
		if err == nil {
			return a
		}
		if !strings.Contains(err.Error(), "address already in use") || attempt == 3 {
			t.Fatal(err)
		}
	}
}

// runPrometheus starts Prometheus on listen (it is stopped when the test ends) and waits until the rules
// have a value; an error says why not, with Prometheus' log.
func runPrometheus(t *testing.T, bin, dir, listen string) (api, error) {
	logPath := filepath.Join(dir, "prometheus-"+strings.ReplaceAll(listen, ":", "-")+".log")
	log, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	cmd := exec.Command(bin, "--config.file="+filepath.Join(dir, "prometheus.yml"),
		"--storage.tsdb.path="+filepath.Join(dir, "data-"+strings.ReplaceAll(listen, ":", "-")),
		"--web.listen-address="+listen)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	var waitErr error
	go func() { waitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	a := api{t: t, base: "http://" + listen}
	logTail := func() string { b, _ := os.ReadFile(logPath); return string(b) }
	deadline := time.Now().Add(60 * time.Second)
	for {
		select {
		case <-exited:
			return a, fmt.Errorf("Prometheus exited (%v):\n%s", waitErr, logTail())
		default:
		}
		var data struct {
			Result []sample `json:"result"`
		}
		// The last rule of the group: once it has a value, every rule was evaluated over both pages.
		err := a.get("/api/v1/query", url.Values{"query": {"tessera_pod:DCGM_FI_DEV_XID_ERRORS:entity"}}, &data)
		if err == nil && len(data.Result) > 0 {
			return a, nil
		}
		if time.Now().After(deadline) {
			return a, fmt.Errorf("no recorded series after 60s (last error: %v):\n%s", err, logTail())
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestTheShippedRulesGiveDCGMSeriesTheirPodsAndCountASharedGPUOnce(t *testing.T) {
	a := startPrometheus(t)

	var groups struct {
		Groups []struct {
			Rules []struct {
				Name      string `json:"name"`
				Health    string `json:"health"`
				LastError string `json:"lastError"`
			} `json:"rules"`
		} `json:"groups"`
	}
	if err := a.get("/api/v1/rules", nil, &groups); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			n++
			if r.Health != "ok" {
				t.Errorf("rule %s: health %q, %s", r.Name, r.Health, r.LastError)
			}
		}
	}
	if n == 0 {
		t.Fatal("Prometheus loaded no rules from the shipped file")
	}

	// Each pod gets the value of its entity and dcgm-exporter's labels; a MIG pod its instance's
	// (UUID + GPU_I_ID), never its parent GPU's; the idle GPU and the unclaimed instance none.
	const field = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
	entityOf := map[string]int{
		"pod-w": entityIndex(gpuWhole, ""),
		"pod-m": entityIndex(gpuMIG, "9"),
		"pod-a": entityIndex(gpuShared, ""),
		"pod-b": entityIndex(gpuShared, ""),
	}
	got := a.query("tessera_pod:" + field + ":entity")
	if len(got) != len(entityOf) {
		t.Fatalf("%d per-pod series, want one per pod (%d): %v", len(got), len(entityOf), got)
	}
	for _, s := range got {
		pod := s.Metric["pod"]
		e, ok := entityOf[pod]
		if !ok {
			t.Errorf("a series for pod %q: %v", pod, s.Metric)
			continue
		}
		if s.Metric["namespace"] != "team" || s.Metric["UUID"] != entities[e].uuid ||
			s.Metric["GPU_I_ID"] != entities[e].gi || s.Metric["modelName"] != "NVIDIA H100 80GB HBM3" ||
			s.Metric["Hostname"] != "node-a" || s.Metric["device"] != fmt.Sprintf("nvidia%d", entities[e].gpu) {
			t.Errorf("pod %s: labels %v, want entity %+v's", pod, s.Metric, entities[e])
		}
		if pod == "pod-m" && s.Metric["GPU_I_PROFILE"] != "1g.10gb" {
			t.Errorf("pod-m: GPU_I_PROFILE %q, want the instance's", s.Metric["GPU_I_PROFILE"])
		}
		if v, want := s.float(t), value(e, fieldIndex(field)); v != want {
			t.Errorf("pod %s: %s %v, want its entity's %v", pod, field, v, want)
		}
	}

	// GPU 2 holds two pods (pod-a's two claims count once): each pod's split is half, and the split
	// summed over pods is each entity's own value, for every field the rules record.
	pods := a.query(`tessera:dcgm_entity:pods{UUID="` + gpuShared + `"}`)
	if len(pods) != 1 || pods[0].float(t) != 2 {
		t.Fatalf("pods on the shared GPU: %v, want 2", pods)
	}
	split := a.query(`tessera_pod:` + field + `:split{UUID="` + gpuShared + `"}`)
	whole := value(entityIndex(gpuShared, ""), fieldIndex(field))
	for _, s := range split {
		if v := s.float(t); v != whole/2 {
			t.Errorf("%s split for %s: %v, want half of %v", field, s.Metric["pod"], v, whole)
		}
	}
	for _, f := range []string{"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE", field} {
		sums := a.query(`sum by (UUID, GPU_I_ID) (tessera_pod:` + f + `:split)`)
		if len(sums) == 0 {
			t.Errorf("%s: no split series", f)
		}
		for _, s := range sums {
			e := entityIndex(s.Metric["UUID"], s.Metric["GPU_I_ID"])
			if v, want := s.float(t), value(e, fieldIndex(f)); math.Abs(v-want) > 1e-9 {
				t.Errorf("%s summed over the pods of %+v: %v, want the entity's %v", f, entities[e], v, want)
			}
		}
	}
	// A namespace's total counts the shared GPU once: pod-w's GPU, pod-m's instance and GPU 2.
	ns := a.query(`sum by (namespace) (tessera_pod:` + field + `:split)`)
	want := value(entityIndex(gpuWhole, ""), fieldIndex(field)) + value(entityIndex(gpuMIG, "9"), fieldIndex(field)) + whole
	if len(ns) != 1 || math.Abs(ns[0].float(t)-want) > 1e-9 {
		t.Errorf("the namespace's %s: %v, want %v", field, ns, want)
	}

	// The chart README's join for any other field: one group_left from the info series.
	join := a.query(`tessera_claim_device_info * on (UUID, GPU_I_ID) group_left (gpu, modelName)
	  max by (UUID, GPU_I_ID, gpu, modelName) (DCGM_FI_DEV_FB_USED)`)
	var joined []string
	for _, s := range join {
		joined = append(joined, s.Metric["claim"]+"@"+s.Metric["gpu"])
	}
	sort.Strings(joined)
	if strings.Join(joined, " ") != "a2@2 a@2 b@2 m@1 w@0" {
		t.Errorf("the README's join gave %v", joined)
	}
}
