package e2etest

// The fault suite (`make test-faults`, issue 16): what an operator's bad day does to a node, against the
// local cluster, with counts. Selected with `-run '^TestFaults'` (E2E_RUN=Faults); FAULT_ROUNDS sizes it
// (default 5; `make test-faults` runs 100). Every scenario checks, after each round:
//
//   - leaks on each node: MIG instances, MPS daemons, CDI specs and checkpoint records that no claim
//     allocated to the node accounts for;
//   - overlapping MIG placements on one GPU, and one exclusive device allocated to two claims;
//   - running pods that lost a device (their MIG instance, CDI spec, MPS daemon or checkpoint record);
//   - pods not Running at the end of the round, and why (scheduler condition, latest warning event);
//   - seconds during which a node had no published ResourceSlices (sampled every second), split into
//     nodes whose plugin and kubelet stayed healthy (must be 0) and nodes the round restarted or removed.
//
// The real node's scenarios (faults_realnode_test.go) add two numbers: the longest stretch its pool was
// incomplete (sampled every 25 ms), and the time from the fault to every pod Running again.
//
// A table of every scenario is written to FAULTS_OUT (default <run dir>/faults.md), with its rows as JSON
// beside it (faults.json). Rows of scenarios this run did not run are kept from that file, each with the
// date and FAULT_ROUNDS it was measured at, so `FAULTS_RUN=TestFaultsRealNode make test-faults` re-measures a part of
// the committed table (e2e/bench/results/faults.md) without dropping the rest.

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"

	"tessera.dev/e2e/internal/cluster"
)

var policyGVR = schema.GroupVersionResource{Group: "gpu.tessera.dev", Version: "v1alpha1", Resource: "gpupolicies"}

// faultRounds is FAULT_ROUNDS (the kill rounds of the plugin scenario; the others scale from it).
func faultRounds(t *testing.T) int {
	n, err := strconv.Atoi(getenv("FAULT_ROUNDS", "5"))
	if err != nil || n < 1 {
		t.Fatalf("FAULT_ROUNDS=%q: want a positive number", os.Getenv("FAULT_ROUNDS"))
	}
	return n
}

// full reports whether this is the full run (`make test-faults`), which repeats the slower scenarios.
func full(t *testing.T) bool { return faultRounds(t) >= 100 }

// --- counts and the table -----------------------------------------------------------------------

// faultCounts is one scenario's row.
type faultCounts struct {
	Scenario      string
	Rounds        int
	LeakedMIG     int
	LeakedMPS     int
	LeakedCDI     int
	LeakedRecords int
	Overlaps      int
	LostDevices   int
	NotRunning    int
	GapHealthy    int // seconds a healthy node had no slices
	GapRestarted  int // seconds a restarted or removed node had no slices (reported, not judged)
	// LongestIncomplete is the longest stretch (s) the disturbed node had fewer slices than its whole
	// pool; Recovery the longest time (s) from a fault to every pod Running again. Both reported, not
	// judged; nil where the scenario does not measure them.
	LongestIncomplete *float64 `json:",omitempty"`
	Recovery          *float64 `json:",omitempty"`
	Seconds           int
	Measured          string         // when and at which FAULT_ROUNDS
	Why               map[string]int // not-Running reasons and lost-device details, by text
	quiet             bool           // an intermediate observation: details are kept in raw, not logged
	raw               []string
}

func (c *faultCounts) why(reason string) {
	// The full text (names, UIDs) goes to the test log; the table groups by shape.
	if c.quiet {
		c.raw = append(c.raw, reason)
	} else {
		fmt.Fprintf(os.Stderr, "    fault detail: %s: %s\n", c.Scenario, reason)
	}
	if c.Why == nil {
		c.Why = map[string]int{}
	}
	// Pod and claim names vary per round; the reason's shape is what matters.
	reason = volatile.ReplaceAllString(reason, "…")
	if len(reason) > 300 {
		reason = reason[:300] + "…"
	}
	c.Why[reason]++
}

var volatile = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|fault-[a-z0-9-]+|-r\d+-`)

// tableMu serializes the rewrites of the table and its JSON rows.
var tableMu sync.Mutex

// record adds the scenario's row, rewrites the table file and fails the test on what must be zero.
func record(t *testing.T, c faultCounts) {
	t.Helper()
	c.Measured = fmt.Sprintf("%s, FAULT_ROUNDS=%d", time.Now().UTC().Format("2006-01-02"), faultRounds(t))
	out := getenv("FAULTS_OUT", filepath.Join(e.runDir, "faults.md"))
	sidecar := strings.TrimSuffix(out, filepath.Ext(out)) + ".json"
	tableMu.Lock()
	rows := mergeRows(t, sidecar, c)
	tableMu.Unlock()
	if data, err := json.MarshalIndent(rows, "", "  "); err != nil {
		t.Errorf("encode %s: %v", sidecar, err)
	} else if err := os.WriteFile(sidecar, append(data, '\n'), 0o644); err != nil {
		t.Errorf("write %s: %v", sidecar, err)
	}
	if err := os.WriteFile(out, []byte(renderTable(rows)), 0o644); err != nil {
		t.Errorf("write %s: %v", out, err)
	}
	t.Logf("%s: %d round(s), leaks MIG/MPS/CDI/records %d/%d/%d/%d, overlaps %d, lost devices %d, not Running %d, "+
		"s without slices healthy/disturbed %d/%d, longest incomplete pool %s s, recovery %s s, %d s",
		c.Scenario, c.Rounds, c.LeakedMIG, c.LeakedMPS, c.LeakedCDI, c.LeakedRecords, c.Overlaps, c.LostDevices, c.NotRunning,
		c.GapHealthy, c.GapRestarted, seconds(c.LongestIncomplete), seconds(c.Recovery), c.Seconds)
	bad := map[string]int{
		"leaked MIG instances": c.LeakedMIG, "leaked MPS daemons": c.LeakedMPS, "leaked CDI specs": c.LeakedCDI,
		"leaked checkpoint records": c.LeakedRecords, "overlapping placements": c.Overlaps,
		"running pods that lost a device": c.LostDevices, "pods not Running": c.NotRunning,
		"seconds a healthy node had no slices": c.GapHealthy,
	}
	for what, n := range bad {
		if n != 0 {
			t.Errorf("%s: %d %s (reasons: %v)", c.Scenario, n, what, c.Why)
		}
	}
}

// mergeRows adds c to the rows of the sidecar file (the rows of earlier runs), replacing the row of the
// same scenario; a missing or unreadable file starts a new table.
func mergeRows(t *testing.T, sidecar string, c faultCounts) []faultCounts {
	t.Helper()
	var rows []faultCounts
	if data, err := os.ReadFile(sidecar); err == nil {
		if err := json.Unmarshal(data, &rows); err != nil {
			t.Logf("%s is not a table of earlier rows (%v): starting a new one", sidecar, err)
			rows = nil
		}
	}
	for i := range rows {
		if rows[i].Scenario == c.Scenario {
			rows[i] = c
			return rows
		}
	}
	return append(rows, c)
}

func seconds(v *float64) string {
	if v == nil {
		return "—"
	}
	return strconv.FormatFloat(*v, 'f', 2, 64)
}

func renderTable(rows []faultCounts) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Fault suite\n\n`make test-faults`: %d stand-in node(s) x %d %s and, for the real-node rows, the real node "+
		"(upstream kubelet and containerd, the chart's pods, the nvml backend over the simulated driver root). Written %s.\n\n",
		len(e.nodes), e.gpus, e.model, time.Now().UTC().Format(time.RFC3339))
	b.WriteString("Longest incomplete pool: the longest stretch the disturbed node had fewer ResourceSlices than its whole pool " +
		"(sampled every 25 ms). Recovery: the longest time from the fault to every pod of the round Running (for the uninstall, " +
		"from the reinstall to the node's pool published and the pod deleted meanwhile gone). Both are numbers, not pass/fail.\n\n")
	b.WriteString("| Scenario | Rounds | Leaked MIG | Leaked MPS | Leaked CDI | Leaked records | Overlaps | Running pods that lost a device | Pods not Running | s without slices (healthy node) | s without slices (restarted/removed node) | Longest incomplete pool s | Recovery s (max) | Wall s | Measured |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %d | %d | %d | %d | %d | %d | %d | %d | %d | %d | %s | %s | %d | %s |\n", r.Scenario, r.Rounds,
			r.LeakedMIG, r.LeakedMPS, r.LeakedCDI, r.LeakedRecords, r.Overlaps, r.LostDevices, r.NotRunning,
			r.GapHealthy, r.GapRestarted, seconds(r.LongestIncomplete), seconds(r.Recovery), r.Seconds, r.Measured)
	}
	for _, r := range rows {
		if len(r.Why) == 0 {
			continue
		}
		fmt.Fprintf(&b, "\n**%s** — reasons:\n\n", r.Scenario)
		keys := make([]string, 0, len(r.Why))
		for k := range r.Why {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(&b, "- %d × %s\n", r.Why[k], strings.ReplaceAll(k, "\n", " "))
		}
	}
	return b.String()
}

// --- what a node holds --------------------------------------------------------------------------

type simInstance struct {
	gpu, gi, start, size int
	uuids                []string
}

// nodeHolds is what the node's plugin state and simulated hardware hold.
type nodeHolds struct {
	instances []simInstance
	daemons   []string                    // keys of MPS daemons whose pid is alive
	cdi       []string                    // claim UIDs with a tessera CDI spec
	cdiText   map[string]string           // each of those specs, by claim UID
	records   map[string]checkpointRecord // checkpoint records by claim UID
	warm      map[string]warmRecord       // warm records by warm key (kubelet-plugin/src/node/warm.rs)
	corrupt   string                      // why the checkpoint could not be read, if so
}

// warmRecord is what the fault suite reads of a warm record: the device it was released as, and until when
// it is kept (Unix seconds).
type warmRecord struct {
	Device string `json:"device"`
	Until  int64  `json:"until"`
}

type checkpointRecord struct {
	Phase   string `json:"phase"`
	Devices []struct {
		Device string `json:"device"`
	} `json:"devices"`
}

func nodeDir(node string) string { return filepath.Join(e.runDir, "nodes", node) }

// isRealNode says whether node is the real node (kubelet + containerd, the chart's plugin), whose state
// lives where the chart's stateDir and cdiDir put it rather than under nodes/<name>.
func isRealNode(node string) bool {
	return os.Getenv("REAL_NODE") == "1" && node == realNodePaths().name
}

// nodeLayout is where a node's plugin state (checkpoint, simulated kernel, MPS pipes) and CDI specs are.
func nodeLayout(node string) (state, cdi string) {
	if isRealNode(node) {
		rn := realNodePaths()
		return rn.stateDir, rn.cdiDir
	}
	return filepath.Join(nodeDir(node), "plugin-state"), filepath.Join(nodeDir(node), "cdi")
}

// daemonAnswers says whether the MPS control daemon of a pipe directory runs. On the real node its pid
// file holds a pid of the supervisor's PID namespace, so the control socket is dialled instead.
func daemonAnswers(node, pipe string) bool {
	if isRealNode(node) {
		return controlAnswers(pipe)
	}
	data, err := os.ReadFile(filepath.Join(pipe, "nvidia-cuda-mps-control.pid"))
	if err != nil {
		return false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	return err == nil && syscall.Kill(pid, 0) == nil
}

func observeNode(t *testing.T, node string) nodeHolds {
	t.Helper()
	h := nodeHolds{cdiText: map[string]string{}}
	state, cdiDir := nodeLayout(node)
	if data, err := os.ReadFile(filepath.Join(state, "simulated-kernel", "simulated-gpus.json")); err == nil {
		var s struct {
			GPUs []struct {
				GPUInstances []simGPUInstance `json:"gpuInstances"`
			} `json:"gpus"`
		}
		if err := json.Unmarshal(data, &s); err != nil {
			t.Fatalf("parse simulated GPU state of %s: %v", node, err)
		}
		for i, g := range s.GPUs {
			for _, gi := range g.GPUInstances {
				in := simInstance{gpu: i, gi: gi.ID, start: gi.Placement.Start, size: gi.Placement.Size}
				for _, ci := range gi.ComputeInstances {
					in.uuids = append(in.uuids, ci.UUID)
				}
				h.instances = append(h.instances, in)
			}
		}
	}
	if entries, err := os.ReadDir(filepath.Join(state, "mps")); err == nil {
		for _, en := range entries {
			if daemonAnswers(node, filepath.Join(state, "mps", en.Name(), "pipe")) {
				// By device (shareKey): a namespace's own daemon is `<key>@<namespace>`.
				key, _, _ := strings.Cut(en.Name(), "@")
				h.daemons = append(h.daemons, key)
			}
		}
	}
	if entries, err := os.ReadDir(cdiDir); err == nil {
		for _, en := range entries {
			name := en.Name()
			if uid, ok := strings.CutPrefix(name, "k8s.gpu.tessera.dev-claim_"); ok {
				uid = strings.TrimSuffix(uid, ".json")
				h.cdi = append(h.cdi, uid)
				if data, err := os.ReadFile(filepath.Join(cdiDir, name)); err == nil {
					h.cdiText[uid] = string(data)
				}
			}
		}
	}
	h.records = map[string]checkpointRecord{}
	if data, err := os.ReadFile(filepath.Join(state, "checkpoint.json")); err == nil {
		var cp struct {
			Payload struct {
				Claims map[string]checkpointRecord `json:"claims"`
				Warm   map[string]warmRecord       `json:"warm"`
			} `json:"payload"`
		}
		if err := json.Unmarshal(data, &cp); err != nil {
			h.corrupt = err.Error()
		} else {
			h.records, h.warm = cp.Payload.Claims, cp.Payload.Warm
		}
	}
	return h
}

// liveClaims maps the UID of every claim allocated to node to its tessera device names.
func liveClaims(t *testing.T, node string) map[string][]string {
	t.Helper()
	var list *resourcev1.ResourceClaimList
	err := wait.PollUntilContextTimeout(ctxFor(t, 2*time.Minute), time.Second, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		var err error
		list, err = e.client.ResourceV1().ResourceClaims("").List(ctx, metav1.ListOptions{})
		return err == nil, nil
	})
	if err != nil {
		t.Fatalf("list ResourceClaims: %v", err)
	}
	out := map[string][]string{}
	for _, c := range list.Items {
		if c.Status.Allocation == nil {
			continue
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			if r.Driver == driver && r.Pool == node {
				out[string(c.UID)] = append(out[string(c.UID)], r.Device)
			}
		}
	}
	return out
}

// shareKey is the MPS daemon key of a shared device name ("gpu-1-shared" → "gpu-1"), or "" for exclusive
// devices.
func shareKey(device string) string {
	if k, ok := strings.CutSuffix(device, "-shared"); ok {
		return k
	}
	if i := strings.Index(device, "-share-"); i > 0 {
		return device[:i]
	}
	return ""
}

// migPlacement is the (gpu, start) of a MIG device name, shared or not.
func migPlacement(device string) (gpu, start int, ok bool) {
	m := migDeviceName.FindStringSubmatch(strings.TrimSuffix(device, "-shared"))
	if m == nil {
		return 0, 0, false
	}
	gpu, _ = strconv.Atoi(m[1])
	start, _ = strconv.Atoi(m[3])
	return gpu, start, true
}

// checkLeaks counts what the node holds that no allocated claim accounts for, and overlaps. kubelet
// unprepares a deleted pod's claims after the pod object is gone, and the plugin reconciles records with the
// API every minute, so what counts is what is still there after up to 75 s.
func checkLeaks(t *testing.T, c *faultCounts, node string) {
	t.Helper()
	var last faultCounts
	for deadline := time.Now().Add(75 * time.Second); ; time.Sleep(2 * time.Second) {
		last = faultCounts{Scenario: c.Scenario, quiet: true}
		observeLeaks(t, &last, node)
		clean := last.LeakedMIG+last.LeakedMPS+last.LeakedCDI+last.LeakedRecords+last.Overlaps == 0
		if clean || time.Now().After(deadline) {
			break
		}
	}
	c.LeakedMIG += last.LeakedMIG
	c.LeakedMPS += last.LeakedMPS
	c.LeakedCDI += last.LeakedCDI
	c.LeakedRecords += last.LeakedRecords
	c.Overlaps += last.Overlaps
	for _, why := range last.raw {
		c.why(why)
	}
}

func observeLeaks(t *testing.T, c *faultCounts, node string) {
	t.Helper()
	live := liveClaims(t, node)
	h := observeNode(t, node)
	used := map[[2]int]bool{}
	keys := map[string]bool{}
	exclusive := map[string]int{}
	for _, devices := range live {
		for _, d := range devices {
			if g, s, ok := migPlacement(d); ok {
				used[[2]int{g, s}] = true
			}
			if k := shareKey(d); k != "" {
				keys[k] = true
			} else {
				exclusive[d]++
			}
		}
	}
	// A warm record owns the partition it keeps until its window ends (and the plugin's next sweep, every
	// 2 s, has had a chance); one kept past that is a leak.
	for key, w := range h.warm {
		if g, s, ok := migPlacement(w.Device); ok {
			used[[2]int{g, s}] = true
		}
		if k := shareKey(w.Device); k != "" {
			keys[k] = true
		}
		if over := time.Since(time.Unix(w.Until, 0)); over > 15*time.Second {
			c.LeakedRecords++
			c.why(fmt.Sprintf("%s: warm record %s kept %s past its window", node, key, over.Round(time.Second)))
		}
	}
	for _, in := range h.instances {
		if !used[[2]int{in.gpu, in.start}] {
			c.LeakedMIG++
			c.why(fmt.Sprintf("%s: MIG instance %d at GPU %d placement %d not held by any claim", node, in.gi, in.gpu, in.start))
		}
	}
	for _, k := range h.daemons {
		if !keys[k] {
			c.LeakedMPS++
			c.why(fmt.Sprintf("%s: MPS daemon %s with no share", node, k))
		}
	}
	for _, uid := range h.cdi {
		if _, ok := live[uid]; !ok {
			c.LeakedCDI++
			c.why(fmt.Sprintf("%s: CDI spec of claim %s not allocated here", node, uid))
		}
	}
	if h.corrupt == "" {
		for uid := range h.records {
			if _, ok := live[uid]; !ok {
				c.LeakedRecords++
				c.why(fmt.Sprintf("%s: checkpoint record of claim %s not allocated here", node, uid))
			}
		}
	}
	for i, a := range h.instances {
		for _, b := range h.instances[i+1:] {
			if a.gpu == b.gpu && a.start < b.start+b.size && b.start < a.start+a.size {
				c.Overlaps++
				c.why(fmt.Sprintf("%s: MIG instances %d and %d overlap on GPU %d", node, a.gi, b.gi, a.gpu))
			}
		}
	}
	for d, n := range exclusive {
		if n > 1 {
			c.Overlaps++
			c.why(fmt.Sprintf("%s: exclusive device %s allocated to %d claims", node, d, n))
		}
	}
}

var migUUID = regexp.MustCompile(`MIG-[0-9a-fA-F-]+`)

// checkPods counts the namespace's pods that are not Running, and the Running ones that lost a device.
func checkPods(t *testing.T, c *faultCounts, ns string) {
	t.Helper()
	pods, err := e.client.CoreV1().Pods(ns).List(ctxFor(t, 30*time.Second), metav1.ListOptions{})
	if err != nil {
		t.Fatalf("list pods: %v", err)
	}
	holds := map[string]nodeHolds{}
	for i := range pods.Items {
		p := &pods.Items[i]
		if p.DeletionTimestamp != nil {
			continue
		}
		if p.Status.Phase != v1.PodRunning {
			c.NotRunning++
			c.why(fmt.Sprintf("pod not Running (%s): %s", p.Status.Phase, cluster.PodProblem(context.Background(), e.client, p)))
			continue
		}
		h, ok := holds[p.Spec.NodeName]
		if !ok {
			h = observeNode(t, p.Spec.NodeName)
			holds[p.Spec.NodeName] = h
		}
		if lost := lostDevice(t, p, h); lost != "" {
			c.LostDevices++
			c.why("running pod lost a device: " + lost)
		}
	}
}

// lostDevice says what a running pod no longer has on its node, or "".
func lostDevice(t *testing.T, p *v1.Pod, h nodeHolds) string {
	t.Helper()
	claims, err := cluster.PodClaims(ctxFor(t, 30*time.Second), e.client, p)
	if err != nil {
		return fmt.Sprintf("%s: cannot read its claims: %v", p.Name, err)
	}
	edits, err := cluster.Edits(p)
	if err != nil {
		return fmt.Sprintf("%s: no container edits: %v", p.Name, err)
	}
	env := strings.Join(edits[p.Spec.Containers[0].Name].Env, " ")
	for _, c := range claims {
		uid := string(c.UID)
		if env == "" {
			// A real kubelet records no edits on the pod: the claim's CDI spec holds its environment.
			env = h.cdiText[uid]
		}
		if !contains(h.cdi, uid) {
			return fmt.Sprintf("%s: CDI spec of claim %s removed", p.Name, uid)
		}
		if r, ok := h.records[uid]; h.corrupt == "" && (!ok || r.Phase != "PrepareCompleted") {
			return fmt.Sprintf("%s: the plugin no longer records claim %s as prepared", p.Name, uid)
		}
		if c.Status.Allocation == nil {
			return fmt.Sprintf("%s: claim %s deallocated", p.Name, uid)
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			if r.Driver != driver {
				continue
			}
			if gpu, start, ok := migPlacement(r.Device); ok {
				want := migUUID.FindString(env)
				found := false
				for _, in := range h.instances {
					if in.gpu == gpu && in.start == start && (want == "" || contains(in.uuids, want)) {
						found = true
					}
				}
				if !found {
					return fmt.Sprintf("%s: MIG instance %s (%s) destroyed", p.Name, r.Device, want)
				}
			}
			if k := shareKey(r.Device); k != "" && strings.Contains(env, "CUDA_MPS_PIPE_DIRECTORY") && !contains(h.daemons, k) {
				return fmt.Sprintf("%s: MPS daemon of %s stopped", p.Name, r.Device)
			}
		}
	}
	return ""
}

// --- slice gaps -----------------------------------------------------------------------------------

// gapSampler counts, per node, the seconds at which the API answered and listed no slice of the node.
type gapSampler struct {
	mu     sync.Mutex
	gaps   map[string]int
	cancel context.CancelFunc
	done   chan struct{}
}

// extra nodes (the real node) are sampled beside the stand-ins.
func sampleGaps(extra ...string) *gapSampler {
	ctx, cancel := context.WithCancel(context.Background())
	g := &gapSampler{gaps: map[string]int{}, cancel: cancel, done: make(chan struct{})}
	nodes := append(append([]string(nil), e.nodes...), extra...)
	go func() {
		defer close(g.done)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			call, stop := context.WithTimeout(ctx, 900*time.Millisecond)
			list, err := e.client.ResourceV1().ResourceSlices().List(call, metav1.ListOptions{FieldSelector: "spec.driver=" + driver})
			stop()
			if err != nil {
				continue // the API is down: nothing was published or withdrawn meanwhile
			}
			has := map[string]bool{}
			for _, s := range list.Items {
				if s.Spec.NodeName != nil {
					has[*s.Spec.NodeName] = true
				}
			}
			g.mu.Lock()
			for _, n := range nodes {
				if !has[n] {
					g.gaps[n]++
				}
			}
			g.mu.Unlock()
		}
	}()
	return g
}

// stop ends sampling and adds the gaps to c: `disturbed` nodes count as restarted/removed.
func (g *gapSampler) stop(c *faultCounts, disturbed ...string) {
	g.cancel()
	<-g.done
	g.mu.Lock()
	defer g.mu.Unlock()
	for n, s := range g.gaps {
		if contains(disturbed, n) {
			c.GapRestarted += s
		} else {
			c.GapHealthy += s
			c.why(fmt.Sprintf("node %s (plugin and kubelet healthy) had no slices for %d s", n, s))
		}
	}
}

// --- process faults -------------------------------------------------------------------------------

// kill9 sends SIGKILL to one cluster process and waits for it to be gone.
func kill9(t *testing.T, name string) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(e.runDir, "pids", name+".pid"))
	if err != nil {
		t.Fatalf("pid of %s: %v", name, err)
	}
	// The pid file holds "pid start-time" (common.sh's start_proc); the pid is the first field.
	fields := strings.Fields(string(data))
	if len(fields) == 0 {
		t.Fatalf("pid of %s: empty pid file", name)
	}
	pid, err := strconv.Atoi(fields[0])
	if err != nil {
		t.Fatalf("pid of %s: %v", name, err)
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	for i := 0; i < 100 && syscall.Kill(pid, 0) == nil; i++ {
		time.Sleep(20 * time.Millisecond)
	}
}

func jitter(max time.Duration) time.Duration { return time.Duration(rand.Int64N(int64(max) + 1)) }

// waitPluginRegistered waits for the node's inventory to be ready with a heartbeat after `after`.
func waitPluginRegistered(t *testing.T, node string, after time.Time) {
	t.Helper()
	waitFreshHeartbeat(t, node, after, 90*time.Second)
}

// waitPods waits until every pod of ns is Running (or the timeout passes; checkPods then counts them).
func waitPods(t *testing.T, ns string, timeout time.Duration) {
	t.Helper()
	_ = wait.PollUntilContextTimeout(ctxFor(t, timeout+10*time.Second), time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		pods, err := e.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, p := range pods.Items {
			if p.Status.Phase != v1.PodRunning {
				return false, nil
			}
		}
		return true, nil
	})
}

// deleteAll deletes every pod of ns and waits until they are gone (the kubelet stand-in unprepares first).
func deleteAll(t *testing.T, ns string, timeout time.Duration) {
	t.Helper()
	ctx := ctxFor(t, timeout+30*time.Second)
	_ = wait.PollUntilContextTimeout(ctx, time.Second, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		return e.client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}) == nil, nil
	})
	err := wait.PollUntilContextTimeout(ctx, time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		pods, err := e.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(pods.Items) == 0, nil
	})
	if err != nil {
		t.Errorf("pods of %s not gone after %s", ns, timeout)
	}
}

func mig1gClass(t *testing.T) string {
	return deviceClass(t, "e2e-mig-1g", "mig", fmt.Sprintf(`device.attributes[%q].profile.startsWith("1g.")`, driver))
}

// faultPods creates one pod per kind (MIG 1g, MPS share, whole GPU) on node, names suffixed with tag.
func faultPods(t *testing.T, ns, node, tag string) {
	t.Helper()
	for _, kind := range []string{"mig", "share", "whole"} {
		pod(t, ns, fmt.Sprintf("%s-%s", kind, tag), kind, node)
	}
}

func faultTemplates(t *testing.T, ns string) {
	t.Helper()
	claimTemplate(t, ns, "mig", mig1gClass(t))
	claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "4Gi", "compute": "10"}))
	claimTemplate(t, ns, "whole", gpuClass(t), selector(fmt.Sprintf(`device.attributes[%q].index >= 4`, driver)))
}

// --- scenarios ------------------------------------------------------------------------------------

// kill -9 of the plugin during prepare and during unprepare, at a random moment each round.
func TestFaultsPluginKilledDuringPrepareAndUnprepare(t *testing.T) {
	ns := namespace(t, "fault-kill")
	node := e.nodes[0]
	plugin := "plugin-" + node
	faultTemplates(t, ns)
	c := faultCounts{Scenario: "kill -9 of the plugin during prepare and unprepare"}
	began := time.Now()
	gaps := sampleGaps()
	for round := range faultRounds(t) {
		tag := fmt.Sprintf("r%d", round)
		faultPods(t, ns, node, tag)
		time.Sleep(jitter(1500 * time.Millisecond))
		kill9(t, plugin)
		restarted := time.Now()
		proc(t, "start", plugin)
		waitPluginRegistered(t, node, restarted)
		waitPods(t, ns, 2*time.Minute)
		checkPods(t, &c, ns)

		if err := e.client.CoreV1().Pods(ns).DeleteCollection(ctxFor(t, 30*time.Second), metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
			t.Fatalf("delete pods: %v", err)
		}
		time.Sleep(jitter(1000 * time.Millisecond))
		kill9(t, plugin)
		restarted = time.Now()
		proc(t, "start", plugin)
		waitPluginRegistered(t, node, restarted)
		deleteAll(t, ns, 2*time.Minute)
		checkLeaks(t, &c, node)
		c.Rounds++
	}
	gaps.stop(&c, node)
	c.Seconds = int(time.Since(began).Seconds())
	record(t, c)
}

// A checkpoint of another boot, and a corrupted one, with pods running.
func TestFaultsCheckpointCorruptedOrOfAnotherBootWithPodsRunning(t *testing.T) {
	ns := namespace(t, "fault-checkpoint")
	node := e.nodes[0]
	plugin := "plugin-" + node
	faultTemplates(t, ns)
	c := faultCounts{Scenario: "foreign-boot and corrupted checkpoints with pods running"}
	began := time.Now()
	gaps := sampleGaps()
	rounds := 1
	if full(t) {
		rounds = 3
	}
	checkpoint := filepath.Join(nodeDir(node), "plugin-state", "checkpoint.json")
	for round := range rounds {
		faultPods(t, ns, node, fmt.Sprintf("r%d", round))
		waitPods(t, ns, 2*time.Minute)

		// Another boot id: a node that "rebooted" while its hardware state and pods stayed.
		kill9(t, plugin)
		if err := os.WriteFile(filepath.Join(nodeDir(node), "boot_id"), []byte(fmt.Sprintf("%08x-0000-4000-8000-%012x\n", rand.Uint32(), rand.Uint64()&0xffffffffffff)), 0o644); err != nil {
			t.Fatal(err)
		}
		restarted := time.Now()
		proc(t, "start", plugin)
		waitPluginRegistered(t, node, restarted)
		checkPods(t, &c, ns)
		checkLeaks(t, &c, node)

		// A corrupted checkpoint: the plugin must change nothing and say so to a new pod.
		kill9(t, plugin)
		data, err := os.ReadFile(checkpoint)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(checkpoint, data[:len(data)/2], 0o644); err != nil {
			t.Fatal(err)
		}
		restarted = time.Now()
		proc(t, "start", plugin)
		time.Sleep(3 * time.Second)
		if !procAlive(plugin) {
			// What the counts show so far (e.g. devices lost to the foreign boot id) still goes in the table.
			c.why("the plugin exited on a corrupted checkpoint")
			gaps.stop(&c, node)
			c.Seconds = int(time.Since(began).Seconds())
			record(t, c)
			t.Fatalf("the plugin exited on a corrupted checkpoint; see %s", filepath.Join(e.runDir, "logs", plugin+".log"))
		}
		checkPods(t, &c, ns)
		probe := pod(t, ns, fmt.Sprintf("probe-r%d", round), "whole", node)
		if msg := waitWarning(t, probe, "checkpoint", 60*time.Second); !strings.Contains(msg, checkpoint) {
			c.why("a pod on the node with the corrupted checkpoint did not see the checkpoint's path: " + msg)
			c.NotRunning++
		}
		// The documented fix: move the file aside and restart.
		if err := os.Rename(checkpoint, checkpoint+".corrupt"); err != nil {
			t.Fatal(err)
		}
		kill9(t, plugin)
		restarted = time.Now()
		proc(t, "start", plugin)
		waitPluginRegistered(t, node, restarted)
		waitPods(t, ns, 2*time.Minute)
		checkPods(t, &c, ns)
		checkLeaks(t, &c, node)

		deleteAll(t, ns, 2*time.Minute)
		checkLeaks(t, &c, node)
		c.Rounds++
	}
	gaps.stop(&c, node)
	c.Seconds = int(time.Since(began).Seconds())
	record(t, c)
}

// waitWarning waits for a warning event of p whose message contains substr; returns the last message seen.
func waitWarning(t *testing.T, p *v1.Pod, substr string, timeout time.Duration) string {
	t.Helper()
	var last string
	_ = wait.PollUntilContextTimeout(ctxFor(t, timeout+10*time.Second), time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		cur, err := e.client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		if ev := cluster.LatestWarning(ctx, e.client, cur); ev != nil {
			last = ev.Message
		}
		return strings.Contains(last, substr), nil
	})
	return last
}

// The API server restarted back to back while pods are being created.
func TestFaultsAPIServerRestartedDuringAPodBurst(t *testing.T) {
	ns := namespace(t, "fault-apiserver")
	faultTemplates(t, ns)
	c := faultCounts{Scenario: "API server restarted back to back during a burst of pod creations"}
	restarts, burst := 2, 9
	if full(t) {
		restarts, burst = 5, 15
	}
	began := time.Now()
	gaps := sampleGaps()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		kinds := []string{"mig", "share", "whole"}
		grace := int64(1)
		for i := range burst {
			kind := kinds[i%len(kinds)]
			p := &v1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s-b%d", kind, i), Namespace: ns},
				Spec: v1.PodSpec{
					Containers: []v1.Container{{Name: "ctr", Image: "registry.k8s.io/pause:3.10",
						Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}}}},
					ResourceClaims:                []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &kind}},
					TerminationGracePeriodSeconds: &grace,
				},
			}
			// A user's client retries through the outage.
			_ = wait.PollUntilContextTimeout(context.Background(), 500*time.Millisecond, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
				_, err := e.client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
				return err == nil || apierrors.IsAlreadyExists(err), nil
			})
			time.Sleep(700 * time.Millisecond)
		}
	}()
	for range restarts {
		proc(t, "restart", "kube-apiserver")
		_ = wait.PollUntilContextTimeout(ctxFor(t, 2*time.Minute), 200*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
			body, err := e.client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
			return err == nil && string(body) == "ok", nil
		})
		c.Rounds++
	}
	wg.Wait()
	waitPods(t, ns, 3*time.Minute)
	checkPods(t, &c, ns)
	gaps.stop(&c)
	deleteAll(t, ns, 2*time.Minute)
	for _, n := range e.nodes {
		checkLeaks(t, &c, n)
	}
	c.Seconds = int(time.Since(began).Seconds())
	record(t, c)
}

// The controller killed with -9 during policy changes and while a node leaves and joins.
func TestFaultsControllerKilledDuringPolicyChangesAndNodeJoinsAndLeaves(t *testing.T) {
	if len(e.nodes) < 2 {
		t.Fatalf("needs 2 nodes (NODES=%d)", len(e.nodes))
	}
	ns := namespace(t, "fault-controller")
	faultTemplates(t, ns)
	steady, mover := e.nodes[0], e.nodes[1]
	// Pods on the steady node run throughout; none on GPU 1, whose slices the policy changes rewrite.
	pod(t, ns, "whole-steady", "whole", steady)
	pod(t, ns, "mig-steady", "mig", steady)
	waitPods(t, ns, 2*time.Minute)
	c := faultCounts{Scenario: "controller killed during policy changes and node joins/leaves"}
	rounds := 2
	if full(t) {
		rounds = 10
	}
	policies := e.dyn.Resource(policyGVR)
	original, err := policies.Get(ctxFor(t, 30*time.Second), "default", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get GpuPolicy default: %v", err)
	}
	restore := func() {
		cur, err := policies.Get(context.Background(), "default", metav1.GetOptions{})
		if err == nil {
			cur.Object["spec"] = original.Object["spec"]
			_, _ = policies.Update(context.Background(), cur, metav1.UpdateOptions{})
		}
	}
	t.Cleanup(restore)
	t.Cleanup(func() {
		if !procAlive("kubelet-" + mover) {
			proc(t, "start", "kubelet-"+mover)
		}
		if !procAlive("plugin-" + mover) {
			proc(t, "start", "plugin-"+mover)
		}
		if !procAlive("controller") {
			proc(t, "start", "controller")
		}
	})
	began := time.Now()
	gaps := sampleGaps()
	for round := range rounds {
		// A policy change: the shared GPU's memory step, which rewrites GPU 1's devices on every node.
		cur, err := policies.Get(ctxFor(t, 30*time.Second), "default", metav1.GetOptions{})
		if err != nil {
			t.Fatalf("get GpuPolicy: %v", err)
		}
		step := []string{"2Gi", "1Gi"}[round%2]
		rules, _ := cur.Object["spec"].(map[string]any)["rules"].([]any)
		for _, r := range rules {
			if m, ok := r.(map[string]any); ok && m["shared"] != nil {
				m["shared"].(map[string]any)["memoryStep"] = step
			}
		}
		if _, err := policies.Update(ctxFor(t, 30*time.Second), cur, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("update GpuPolicy: %v", err)
		}
		time.Sleep(jitter(1500 * time.Millisecond))
		kill9(t, "controller")
		proc(t, "start", "controller")

		// A node leaves (kubelet and plugin stop, the Node object and with it its inventory go) and joins
		// again, with the controller killed in between.
		proc(t, "stop", "plugin-"+mover)
		proc(t, "stop", "kubelet-"+mover)
		if err := e.client.CoreV1().Nodes().Delete(ctxFor(t, 30*time.Second), mover, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Fatalf("delete node %s: %v", mover, err)
		}
		time.Sleep(jitter(3 * time.Second))
		kill9(t, "controller")
		proc(t, "start", "controller")
		time.Sleep(jitter(2 * time.Second))
		joined := time.Now()
		proc(t, "start", "kubelet-"+mover)
		_ = wait.PollUntilContextTimeout(ctxFor(t, time.Minute), time.Second, 50*time.Second, true, func(ctx context.Context) (bool, error) {
			_, err := e.client.CoreV1().Nodes().Get(ctx, mover, metav1.GetOptions{})
			return err == nil, nil
		})
		proc(t, "start", "plugin-"+mover)
		waitPluginRegistered(t, mover, joined)
		// The joined node's pool is back once the controller has seen its inventory.
		_ = wait.PollUntilContextTimeout(ctxFor(t, 2*time.Minute), time.Second, 90*time.Second, true, func(ctx context.Context) (bool, error) {
			return countDevices(t, mover, anyName) > 0, nil
		})
		if countDevices(t, mover, anyName) == 0 {
			c.why(fmt.Sprintf("node %s has no slices 90 s after joining again", mover))
			c.NotRunning++
		}
		checkPods(t, &c, ns)
		c.Rounds++
	}
	gaps.stop(&c, mover)
	restore()
	deleteAll(t, ns, 2*time.Minute)
	for _, n := range e.nodes {
		checkLeaks(t, &c, n)
	}
	c.Seconds = int(time.Since(began).Seconds())
	record(t, c)
}
