package e2etest

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// controllerMetricsURL is where the controller serves /metrics: the host process's TESSERA_HEALTH_ADDR
// (RUN_DIR/procs/controller.sh, written by up.sh), or a chart-installed replica's pod IP and healthPort.
func controllerMetricsURL(t *testing.T) string {
	t.Helper()
	if procAlive("controller") {
		script, err := os.ReadFile(filepath.Join(e.runDir, "procs", "controller.sh"))
		if err != nil {
			t.Fatalf("read the controller's launch script: %v", err)
		}
		addr := healthAddrArg.FindStringSubmatch(string(script))
		if addr == nil {
			t.Fatalf("the host controller has no TESSERA_HEALTH_ADDR (e2e/scripts/up.sh sets it):\n%s", script)
		}
		return "http://" + addr[1] + "/metrics"
	}
	pods, err := podsOf(ctxFor(t, 30*time.Second), "controller")
	if err != nil {
		t.Fatalf("list the chart's controller pods: %v", err)
	}
	for _, p := range pods {
		if p.Status.PodIP != "" && p.DeletionTimestamp == nil {
			return fmt.Sprintf("http://%s:8081/metrics", p.Status.PodIP)
		}
	}
	t.Fatalf("no host controller process and no chart controller pod with an IP in %s", chartNamespace)
	return ""
}

var sampleLine = regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} (\S+)`)
var labelPair = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"`)

// scrapeGauge returns the value of the sample of `name` whose labels include `want` (and its label set),
// or ok=false when the endpoint has no such sample.
func scrapeGauge(url, name string, want map[string]string) (value float64, labels map[string]string, ok bool, err error) {
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(url)
	if err != nil {
		return 0, nil, false, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, nil, false, err
	}
	for _, line := range strings.Split(string(body), "\n") {
		m := sampleLine.FindStringSubmatch(line)
		if m == nil || m[1] != name {
			continue
		}
		got := map[string]string{}
		for _, kv := range labelPair.FindAllStringSubmatch(m[2], -1) {
			got[kv[1]] = kv[2]
		}
		match := true
		for k, v := range want {
			match = match && got[k] == v
		}
		if match {
			v, err := strconv.ParseFloat(m[3], 64)
			return v, got, err == nil, err
		}
	}
	return 0, nil, false, nil
}

// freeMigGPU is the highest-numbered dynamic-MIG GPU of node that no allocated claim holds any of (GPU 1 is
// shared under e2e/manifests/gpupolicy.yaml), so the scenario's layout is the only one on it.
func freeMigGPU(t *testing.T, node string) int {
	t.Helper()
	claims, err := e.client.ResourceV1().ResourceClaims("").List(ctxFor(t, 30*time.Second), metav1.ListOptions{})
	if err != nil {
		t.Fatalf("list ResourceClaims: %v", err)
	}
	used := map[int]bool{}
	gpuIndex := regexp.MustCompile(`^gpu-(\d+)(-|$)`)
	for _, c := range claims.Items {
		if c.Status.Allocation == nil {
			continue
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			if m := gpuIndex.FindStringSubmatch(r.Device); r.Driver == driver && r.Pool == node && m != nil {
				i, _ := strconv.Atoi(m[1])
				used[i] = true
			}
		}
	}
	candidates := []int{0, 2, 3, 4, 5, 6, 7}
	sort.Sort(sort.Reverse(sort.IntSlice(candidates)))
	for _, i := range candidates {
		if countDevices(t, node, regexp.MustCompile(fmt.Sprintf(`^gpu-%d-mig-`, i))) > 0 && !used[i] {
			return i
		}
	}
	t.Fatalf("every dynamic-MIG GPU of %s holds an allocated claim (used: %v)", node, used)
	return 0
}

// Issue 42 item 3: two 1g.10gb instances at memory slices 1 and 5 of one H100 leave 6 of its 8 slices free,
// yet both 3g.40gb placements (slices 0-3 and 4-7) hold one of them. A pending 3g pod for that GPU shows
// (a) on the controller's /metrics as 6 fragmented slices for 3g.40gb, demanded by a pending claim, and
// (b) in `kubectl tessera explain` as fragmentation, naming the free slices and the claim to move.
func TestMigFragmentationIsAControllerMetricAndExplainsAPendingMigPod(t *testing.T) {
	ns := namespace(t, "mig-fragmentation")
	node := e.nodes[0]
	gpu := freeMigGPU(t, node)
	onGPU := fmt.Sprintf(`device.attributes[%q].index == %d`, driver, gpu)
	at := func(start int) string {
		return fmt.Sprintf(`%s && device.attributes[%q].profile == "1g.10gb" && device.attributes[%q].placementStart == %d`,
			onGPU, driver, driver, start)
	}
	claimTemplate(t, ns, "small-1", "mig.gpu.tessera.dev", selector(at(1)))
	claimTemplate(t, ns, "small-5", "mig.gpu.tessera.dev", selector(at(5)))
	claimTemplate(t, ns, "big", "mig.gpu.tessera.dev",
		selector(fmt.Sprintf(`%s && device.attributes[%q].profile.startsWith("3g.")`, onGPU, driver)))
	pod(t, ns, "small-1", "small-1", node)
	pod(t, ns, "small-5", "small-5", node)
	waitRunning(t, ns, "small-1", 2*time.Minute)
	waitRunning(t, ns, "small-5", 2*time.Minute)
	pod(t, ns, "big", "big", node)
	t.Logf("scheduler: %s", waitUnschedulable(t, ns, "big"))

	gpuName := fmt.Sprintf("gpu-%d", gpu)
	url := controllerMetricsURL(t)
	gpuLabels := map[string]string{"node": node, "gpu": gpuName}
	// The controller recomputes at most every 5 s, after the claims it watches change.
	waitFor(t, "tessera_controller_mig_fragmented_slices for "+gpuName+" on "+node, time.Minute, func(context.Context) (bool, string) {
		v, labels, ok, err := scrapeGauge(url, "tessera_controller_mig_fragmented_slices", gpuLabels)
		if err != nil || !ok {
			return false, fmt.Sprintf("scrape %s: ok=%v err=%v", url, ok, err)
		}
		want := v == 6 && labels["profile"] == "3g.40gb" && labels["demand"] == "pending"
		return want, fmt.Sprintf("%v = %v, want 6 with profile=3g.40gb, demand=pending", labels, v)
	})
	if free, _, ok, err := scrapeGauge(url, "tessera_controller_mig_free_slices", gpuLabels); err != nil || !ok || free != 6 {
		t.Errorf("tessera_controller_mig_free_slices{node=%q,gpu=%q} = %v (found %v, %v), want 6", node, gpuName, free, ok, err)
	}

	code, text := kubectlTessera(t, "explain", "pod/big", "-n", ns)
	t.Logf("$ kubectl tessera explain pod/big -n %s\n%s", ns, text)
	if code != 1 {
		t.Errorf("explain of the pending pod exited %d, want 1 (does not fit)", code)
	}
	first, _, _ := strings.Cut(text, "\n")
	for _, want := range []string{
		node + ": profile 3g.40gb needs 4 free memory slices at one of its placements (starting at slice 0 or 4)",
		"6 memory slices are free but fragmented: " + gpuName + " 6 (slices 0, 2-4, 6-7)",
		"to free 3g.40gb at slice 0 on " + gpuName + ", move claim " + ns + "/small-1-",
	} {
		if !strings.Contains(first, want) {
			t.Errorf("explain's summary line %q does not contain %q", first, want)
		}
	}
}
