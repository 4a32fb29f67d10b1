package e2etest

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// Issue 25: cold starts. Deployments on the real node are scaled 0 → N → 0 → N: a whole GPU (the baseline),
// MIG 1g.10gb slices and MPS shares of GPU 1, first under the cluster's GpuPolicy as `make up` applies it
// (every scale-up makes its MIG devices and MPS daemon anew: cold), then with `warm: {window}` on its MIG and
// shared rules (the second scale-up takes what the first left: warm). Each pod's time from the scale command
// to its first CUDA context is split into scheduling (the scheduler's Scheduled event), tessera's prepare
// (the plugin's `prepared claim` line: when it ended and how long it took) and the rest (kubelet's sync, the
// sandbox, the container's start and its first context).
//
// Asserted, as the user sees it: every pod runs and makes a CUDA context; a warm round's MIG pods see the
// MIG UUIDs of the round before (cold rounds new ones) and its shares the MPS daemon of the round before;
// every warm round's MIG device took a warm partition; once the window ends no MIG instance, MPS daemon or
// warm record is left. Times are printed, never judged; `make bench-coldstart` runs it with hardware-like
// latencies and writes the table to COLDSTART_OUT.

// coldStartWindow is the warm window of the scenario: long enough for a scale-down and the next scale-up
// on a loaded 2-core machine, short enough that the test can wait for it to end.
const coldStartWindow = 30 * time.Second

type coldKind struct {
	name     string
	template string
	// partition: the pods' devices make something a warm record can keep.
	partition bool
}

// coldPod is one pod's start, measured.
type coldPod struct {
	name                             string
	schedule, prepare, rest, total   time.Duration
	warm                             bool   // its prepare took a warm partition (the plugin's line says which)
	uuid                             string // the device UUID its CUDA probe saw
	mpsServer                        string // the MPS server its context went through, for shares
	claimUID                         string
	scheduledAt, preparedAt, readyAt time.Time
}

// coldRow is one scale-up of one kind.
type coldRow struct {
	kind  string
	warm  bool // the policy kept partitions warm
	round int
	pods  []coldPod
}

func TestColdStart(t *testing.T) {
	rn := realNode(t)
	replicas := 2
	if n, err := strconv.Atoi(os.Getenv("COLDSTART_REPLICAS")); err == nil && n > 0 {
		replicas = n
	}
	installChart(t, rn)
	waitChartPods(t, "the plugin and MPS supervisor pods Ready on "+rn.name, "kubelet-plugin", "mps-supervisor")
	ns := namespace(t, "coldstart")
	kinds := []coldKind{
		{"whole GPU", claimTemplate(t, ns, "whole", gpuClass(t)), false},
		{"MPS share (10Gi)", claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "10Gi"})), true},
		{"MIG 1g.10gb", claimTemplate(t, ns, "mig", mig1gClass(t), selector(fmt.Sprintf(`device.attributes[%q].profile == "1g.10gb"`, driver))), true},
	}

	var rows []coldRow
	for _, warm := range []bool{false, true} {
		window := time.Duration(0)
		if warm {
			window = coldStartWindow
		}
		setWarmWindow(t, rn, window)
		for _, k := range kinds {
			name := strings.NewReplacer(" ", "-", "(", "", ")", "", ".", "").Replace(strings.ToLower(k.template))
			coldDeployment(t, ns, name, k.template, rn.name)
			var daemon string
			for round := 1; round <= 2; round++ {
				pods := scaleAndTime(t, rn, ns, name, replicas)
				rows = append(rows, coldRow{kind: k.name, warm: warm, round: round, pods: pods})
				if k.template == "share" {
					now := rn.mpsDaemonPID(t, "gpu-1-shared")
					if round == 2 && warm && now != daemon {
						t.Errorf("%s, warm round 2: MPS daemon pid %s, want round 1's %s (kept warm)", k.name, now, daemon)
					}
					if round == 2 && !warm && now == daemon {
						t.Errorf("%s, cold round 2: the same MPS daemon pid %s as round 1, want a new one", k.name, now)
					}
					daemon = now
				}
				scaleToZero(t, rn, ns, name, pods)
			}
			if err := e.client.AppsV1().Deployments(ns).Delete(ctxFor(t, 30*time.Second), name, metav1.DeleteOptions{}); err != nil {
				t.Fatalf("delete Deployment %s: %v", name, err)
			}
		}
	}
	checkColdRows(t, rows, replicas)
	printColdTable(t, rows, replicas)

	// The window ends: nothing kept is left on the node.
	waitFor(t, "the warm partitions destroyed once their window ended", coldStartWindow+90*time.Second, func(context.Context) (bool, string) {
		h := observeNode(t, rn.name)
		if len(h.warm) > 0 || len(h.instances) > 0 || len(h.daemons) > 0 {
			return false, fmt.Sprintf("warm records %v, MIG instances %d, MPS daemons %v", keys(h.warm), len(h.instances), h.daemons)
		}
		return true, ""
	})
}

// changePolicy applies `mutate` to the rules of the cluster's GpuPolicy `default` for the test's length (the
// spec is put back at cleanup).
func changePolicy(t *testing.T, mutate func(rule map[string]any)) {
	t.Helper()
	policies := e.dyn.Resource(policyGVR)
	cur, err := policies.Get(ctxFor(t, 30*time.Second), "default", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get GpuPolicy default: %v", err)
	}
	original := cur.DeepCopy()
	t.Cleanup(func() {
		now, err := policies.Get(context.Background(), "default", metav1.GetOptions{})
		if err == nil {
			now.Object["spec"] = original.Object["spec"]
			_, _ = policies.Update(context.Background(), now, metav1.UpdateOptions{})
		}
	})
	rules, _ := cur.Object["spec"].(map[string]any)["rules"].([]any)
	for _, r := range rules {
		if m, ok := r.(map[string]any); ok {
			mutate(m)
		}
	}
	if _, err := policies.Update(ctxFor(t, 30*time.Second), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("update GpuPolicy: %v", err)
	}
}

// waitDevices waits until every device of node's slices that `which` selects has the attribute `name`
// equal to `want` (compared as printed; absent prints "").
func waitDevices(t *testing.T, node, what string, which func(name string) bool, attr string, want string) {
	t.Helper()
	waitFor(t, what, time.Minute, func(ctx context.Context) (bool, string) {
		slices, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
		if err != nil {
			return false, err.Error()
		}
		seen, wrong := 0, 0
		for _, s := range slices.Items {
			for _, d := range s.Spec.Devices {
				if !which(d.Name) {
					continue
				}
				seen++
				got := ""
				if a, ok := d.Attributes[resourcev1.QualifiedName(attr)]; ok {
					switch {
					case a.IntValue != nil:
						got = strconv.FormatInt(*a.IntValue, 10)
					case a.StringValue != nil:
						got = *a.StringValue
					}
				}
				if got != want {
					wrong++
				}
			}
		}
		return seen > 0 && wrong == 0, fmt.Sprintf("%d of %d devices without %s %q", wrong, seen, attr, want)
	})
}

// setWarmWindow puts `warm: {window}` on the cluster GpuPolicy's MIG and shared rules (a window of 0 takes
// it off), for the test's length, and waits until the real node's devices publish it.
func setWarmWindow(t *testing.T, rn realNodeEnv, window time.Duration) {
	t.Helper()
	changePolicy(t, func(m map[string]any) {
		if m["shared"] == nil && m["dynamicMig"] == nil {
			return
		}
		if window > 0 {
			m["warm"] = map[string]any{"window": fmt.Sprintf("%ds", int(window.Seconds()))}
		} else {
			delete(m, "warm")
		}
	})
	want := ""
	if window > 0 {
		want = strconv.Itoa(int(window.Seconds()))
	}
	partitioned := func(name string) bool { return migDeviceName.MatchString(name) || strings.HasSuffix(name, "-shared") }
	waitDevices(t, rn.name, "the real node's MIG and shared devices published with warmSeconds "+want, partitioned, "warmSeconds", want)
}

// coldDeployment creates a Deployment of 0 replicas on the node whose pods claim from `template` and
// report, once a second, the CUDA probe's device and context lines.
func coldDeployment(t *testing.T, ns, name, template, node string) {
	t.Helper()
	labels := map[string]string{"app": name}
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](0),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: v1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: v1.PodSpec{
					NodeSelector: map[string]string{"kubernetes.io/hostname": node},
					Tolerations:  []v1.Toleration{{Key: "nvidia.com/gpu", Operator: v1.TolerationOpExists, Effect: v1.TaintEffectNoSchedule}},
					Containers: []v1.Container{{
						Name: "serve", Image: probeImage, ImagePullPolicy: v1.PullNever,
						Command:   []string{"sh", "-c", `while true; do echo "ready $(cuda-probe 2>&1 | grep -E '^cuda\.(device|ctx)' | tr '\n' ' ')"; sleep 1; done`},
						Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
					}},
					ResourceClaims:                []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To(template)}},
					TerminationGracePeriodSeconds: ptr.To[int64](1),
				},
			},
		},
	}
	if _, err := e.client.AppsV1().Deployments(ns).Create(ctxFor(t, 30*time.Second), d, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create Deployment %s/%s: %v", ns, name, err)
	}
}

func scaleTo(t *testing.T, ns, name string, n int) time.Time {
	t.Helper()
	at := time.Now()
	s := &autoscalingv1.Scale{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: autoscalingv1.ScaleSpec{Replicas: int32(n)}}
	if _, err := e.client.AppsV1().Deployments(ns).UpdateScale(ctxFor(t, 30*time.Second), name, s, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("scale %s/%s to %d: %v", ns, name, n, err)
	}
	return at
}

var (
	readyUUID   = regexp.MustCompile(`cuda\.device index=0 uuid=(\S+)`)
	readyCtx    = regexp.MustCompile(`cuda\.ctx index=0 rc=0 mps=(\S+)(?: server=(\d+))?`)
	ctxFailures = regexp.MustCompile(`cuda\.ctx index=0 rc=[1-9]`)
)

// scaleAndTime scales the Deployment from 0 to n and times each pod to its first CUDA context.
func scaleAndTime(t *testing.T, rn realNodeEnv, ns, name string, n int) []coldPod {
	t.Helper()
	began := scaleTo(t, ns, name, n)
	var pods []v1.Pod
	ready := map[string]coldPod{}
	waitFor(t, fmt.Sprintf("%d pods of %s making a CUDA context", n, name), 4*time.Minute, func(ctx context.Context) (bool, string) {
		list, err := e.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=" + name})
		if err != nil {
			return false, err.Error()
		}
		pods = list.Items
		var waiting []string
		for _, p := range pods {
			if _, ok := ready[p.Name]; ok {
				continue
			}
			if p.Status.Phase != v1.PodRunning {
				waiting = append(waiting, fmt.Sprintf("%s %s", p.Name, p.Status.Phase))
				continue
			}
			log, err := podLogs(ctx, &p, "serve", false)
			if err != nil {
				waiting = append(waiting, err.Error())
				continue
			}
			for _, line := range strings.Split(log, "\n") {
				at, text, ok := logLine(line)
				if !ok || !strings.HasPrefix(text, "ready ") {
					continue
				}
				if ctxFailures.MatchString(text) {
					t.Errorf("%s: a CUDA context failed: %s", p.Name, text)
				}
				m := readyCtx.FindStringSubmatch(text)
				if m == nil {
					continue
				}
				c := coldPod{name: p.Name, readyAt: at, total: at.Sub(began), mpsServer: m[2]}
				if u := readyUUID.FindStringSubmatch(text); u != nil {
					c.uuid = u[1]
				}
				ready[p.Name] = c
				break
			}
			if _, ok := ready[p.Name]; !ok {
				waiting = append(waiting, p.Name+" no context yet")
			}
		}
		return len(pods) == n && len(ready) == n, fmt.Sprintf("%d pods, %d ready; %s", len(pods), len(ready), strings.Join(waiting, "; "))
	})
	prepared := pluginPrepares(t)
	var out []coldPod
	for _, p := range pods {
		c := ready[p.Name]
		c.scheduledAt = scheduledAt(t, ns, p.Name)
		c.schedule = c.scheduledAt.Sub(began)
		for _, s := range p.Status.ResourceClaimStatuses {
			if s.ResourceClaimName == nil {
				continue
			}
			claim, err := e.client.ResourceV1().ResourceClaims(ns).Get(ctxFor(t, 30*time.Second), *s.ResourceClaimName, metav1.GetOptions{})
			if err != nil {
				t.Fatalf("claim of %s: %v", p.Name, err)
			}
			c.claimUID = string(claim.UID)
		}
		line, ok := prepared[c.claimUID]
		if !ok {
			t.Fatalf("%s: no `prepared claim` line for its claim %s in the plugin's log", p.Name, c.claimUID)
		}
		c.preparedAt, c.prepare, c.warm = line.at, line.took, line.warm
		c.rest = c.total - c.schedule - c.prepare
		out = append(out, c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].name < out[j].name })
	return out
}

// scaleToZero scales the Deployment to 0 and waits until the plugin holds none of the claims of its pods:
// their devices are released (and, under a warm policy, kept) before the next scale-up.
func scaleToZero(t *testing.T, rn realNodeEnv, ns, name string, pods []coldPod) {
	t.Helper()
	scaleTo(t, ns, name, 0)
	waitFor(t, name+" scaled to zero and its claims unprepared", 2*time.Minute, func(ctx context.Context) (bool, string) {
		list, err := e.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: "app=" + name})
		if err != nil || len(list.Items) > 0 {
			return false, fmt.Sprintf("%d pods (err %v)", len(list.Items), err)
		}
		h := observeNode(t, rn.name)
		for _, p := range pods {
			if _, ok := h.records[p.claimUID]; ok {
				return false, "the plugin still holds the claim of " + p.name
			}
		}
		return true, ""
	})
}

func scheduledAt(t *testing.T, ns, pod string) time.Time {
	t.Helper()
	var at time.Time
	waitFor(t, "the Scheduled event of "+pod, 30*time.Second, func(ctx context.Context) (bool, string) {
		evs, err := e.client.EventsV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "regarding.name=" + pod + ",reason=Scheduled"})
		if err != nil || len(evs.Items) == 0 {
			return false, fmt.Sprintf("none (err %v)", err)
		}
		at = evs.Items[0].EventTime.Time
		return !at.IsZero(), "no eventTime"
	})
	return at
}

type prepareLine struct {
	at   time.Time
	took time.Duration
	warm bool
}

// pluginPrepares reads the plugin pod's `prepared claim` lines by claim UID.
func pluginPrepares(t *testing.T) map[string]prepareLine {
	t.Helper()
	pods, err := podsOf(ctxFor(t, 30*time.Second), "kubelet-plugin")
	if err != nil || len(pods) != 1 {
		t.Fatalf("plugin pods: %v (%d)", err, len(pods))
	}
	log, err := podLogs(ctxFor(t, 30*time.Second), &pods[0], "plugin", false)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]prepareLine{}
	for _, line := range strings.Split(log, "\n") {
		at, text, ok := logLine(line)
		if !ok || !strings.Contains(text, `"prepared claim"`) {
			continue
		}
		var entry struct {
			Fields struct {
				Claim  string `json:"claim"`
				Warm   string `json:"warm"`
				TookMs int64  `json:"took_ms"`
			} `json:"fields"`
		}
		if json.Unmarshal([]byte(text), &entry) != nil {
			continue
		}
		out[entry.Fields.Claim] = prepareLine{at: at, took: time.Duration(entry.Fields.TookMs) * time.Millisecond, warm: entry.Fields.Warm != "" && entry.Fields.Warm != "[]"}
	}
	return out
}

// pluginLogLines are the chart's plugin pod's log lines that contain any of `words`, for a failure's message.
func pluginLogLines(t *testing.T, words ...string) []string {
	t.Helper()
	pods, err := podsOf(ctxFor(t, 30*time.Second), "kubelet-plugin")
	if err != nil || len(pods) == 0 {
		return []string{fmt.Sprintf("no plugin pod (%v)", err)}
	}
	log, err := podLogs(ctxFor(t, 30*time.Second), &pods[0], "plugin", false)
	if err != nil {
		return []string{err.Error()}
	}
	var out []string
	for _, line := range strings.Split(log, "\n") {
		for _, w := range words {
			if strings.Contains(line, w) {
				out = append(out, line)
				break
			}
		}
	}
	return out
}

// checkColdRows asserts what the user sees: warm rounds run on the partitions the round before left, cold
// rounds on new ones, and every warm round's MIG device took a warm partition.
func checkColdRows(t *testing.T, rows []coldRow, replicas int) {
	t.Helper()
	byKey := map[string]coldRow{}
	for _, r := range rows {
		if len(r.pods) != replicas {
			t.Errorf("%s, warm %v, round %d: %d pods, want %d", r.kind, r.warm, r.round, len(r.pods), replicas)
		}
		byKey[fmt.Sprintf("%s/%v/%d", r.kind, r.warm, r.round)] = r
	}
	uuids := func(r coldRow) []string {
		var u []string
		for _, p := range r.pods {
			u = append(u, p.uuid)
		}
		sort.Strings(u)
		return u
	}
	for _, warm := range []bool{false, true} {
		first, second := byKey[fmt.Sprintf("MIG 1g.10gb/%v/1", warm)], byKey[fmt.Sprintf("MIG 1g.10gb/%v/2", warm)]
		same := strings.Join(uuids(first), ",") == strings.Join(uuids(second), ",")
		if warm && !same {
			t.Errorf("MIG pods of the warm round 2 see %v, want round 1's %v (the warm instances)", uuids(second), uuids(first))
		}
		if !warm && same {
			t.Errorf("MIG pods of a cold round 2 see round 1's UUIDs %v, want new instances", uuids(first))
		}
		for _, p := range second.pods {
			if p.warm != warm {
				t.Errorf("MIG pod %s (warm policy %v, round 2): its prepare took a warm partition: %v", p.name, warm, p.warm)
			}
		}
	}
}

func durations(pods []coldPod, f func(coldPod) time.Duration) (p50, max time.Duration) {
	var d []time.Duration
	for _, p := range pods {
		d = append(d, f(p))
	}
	return medianAndMax(d)
}

// medianAndMax are the (lower) median and the largest of d, 0 for none; d is not modified.
func medianAndMax(d []time.Duration) (p50, max time.Duration) {
	if len(d) == 0 {
		return 0, 0
	}
	d = slices.Clone(d)
	slices.Sort(d)
	return d[(len(d)-1)/2], d[len(d)-1]
}

func printColdTable(t *testing.T, rows []coldRow, replicas int) {
	t.Helper()
	secs := func(d time.Duration) string { return fmt.Sprintf("%.2f", d.Seconds()) }
	var b strings.Builder
	fmt.Fprintf(&b, "| Deployment | Policy | Scale-up | Pods | To first CUDA context p50 / max s | Scheduling p50 s | tessera prepare p50 / max s | Kubelet, sandbox, container, first context p50 s | Prepares that took a warm partition |\n")
	fmt.Fprintf(&b, "|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		policy := "cold (no warm)"
		if r.warm {
			policy = fmt.Sprintf("warm %ds", int(coldStartWindow.Seconds()))
		}
		total50, totalMax := durations(r.pods, func(p coldPod) time.Duration { return p.total })
		sched50, _ := durations(r.pods, func(p coldPod) time.Duration { return p.schedule })
		prep50, prepMax := durations(r.pods, func(p coldPod) time.Duration { return p.prepare })
		rest50, _ := durations(r.pods, func(p coldPod) time.Duration { return p.rest })
		warmTakes := 0
		for _, p := range r.pods {
			if p.warm {
				warmTakes++
			}
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %d | %s / %s | %s | %s / %s | %s | %d |\n", r.kind, policy, []string{"", "0 → N (first)", "0 → N (after N → 0)"}[r.round],
			len(r.pods), secs(total50), secs(totalMax), secs(sched50), secs(prep50), secs(prepMax), secs(rest50), warmTakes)
	}
	t.Logf("cold starts, %d replicas per scale-up:\n%s", replicas, b.String())
	out := os.Getenv("COLDSTART_OUT")
	if out == "" {
		return
	}
	latencies, _ := os.ReadFile(filepath.Join(e.repoRoot, "e2e", "bench", "hardware-like-latencies.yaml"))
	doc := fmt.Sprintf(`# Cold starts: whole GPU, MIG and MPS replicas, cold and warm

`+"`make bench-coldstart`"+`: the real node (upstream kubelet 1.37 and containerd, the chart's pods, the nvml backend over the
simulated driver root) with hardware-like latencies (REAL_NODE_LATENCIES, %s; estimates, not measurements:
kubelet-plugin/sim-driver/README.md#latencies). Each Deployment is scaled 0 → %d → 0 → %d; each pod's time runs from the
scale command to its first CUDA context (the first report line of its container), split into scheduling (the
scheduler's Scheduled event), tessera's prepare (the plugin's `+"`prepared claim`"+` line: its duration) and the rest
(kubelet's sync before and after the prepare, the sandbox, the container's start, the first context). Under
the warm policy the MIG and shared rules carry `+"`warm: {window: %ds}`"+`. Written %s. Numbers from one run on
this 2-core machine, not pass/fail.

%s`, strings.TrimSpace(string(latencies)), replicas, replicas, int(coldStartWindow.Seconds()), time.Now().UTC().Format(time.RFC3339), b.String())
	if err := os.WriteFile(out, []byte(doc), 0o644); err != nil {
		t.Errorf("write %s: %v", out, err)
	}
}
