package e2etest

// The fault suite's real-node rows (issue 27): an operator's bad day on the real node — upstream kubelet
// and containerd, the chart's plugin, MPS supervisor and controller, the nvml backend over the simulated
// driver root — counted as the stand-in rows are (faults_test.go), plus two numbers of its own: the longest
// stretch the node's pool was incomplete, and the time from the fault to every pod Running again. One chart
// install serves every row; each row is a subtest, so a failing one leaves the others measured.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"
)

// --- the pool, sampled every 25 ms ------------------------------------------------------------------

// poolWatch samples a node's ResourceSlices every 25 ms and records each stretch during which fewer than
// `want` of them exist: the time a scheduling cycle could see the node without (some of) its GPUs.
type poolWatch struct {
	mu      sync.Mutex
	gaps    []time.Duration
	open    time.Time
	samples int
	cancel  context.CancelFunc
	done    chan struct{}
}

func watchPool(node string, want int) *poolWatch {
	ctx, cancel := context.WithCancel(context.Background())
	w := &poolWatch{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for ctx.Err() == nil {
			n, err := driverSlices(ctx, node)
			now := time.Now()
			if err == nil {
				w.mu.Lock()
				w.samples++
				switch {
				case n < want && w.open.IsZero():
					w.open = now
				case n >= want && !w.open.IsZero():
					w.gaps = append(w.gaps, now.Sub(w.open))
					w.open = time.Time{}
				}
				w.mu.Unlock()
			}
			time.Sleep(25 * time.Millisecond)
		}
	}()
	return w
}

// stop ends the sampling; a stretch still open counts up to now.
func (w *poolWatch) stop() (gaps []time.Duration, samples int) {
	w.cancel()
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.open.IsZero() {
		w.gaps = append(w.gaps, time.Since(w.open))
	}
	return w.gaps, w.samples
}

func longest(gaps []time.Duration) time.Duration {
	var m time.Duration
	for _, g := range gaps {
		m = max(m, g)
	}
	return m
}

// driverSlices counts the ResourceSlices of tessera's driver, all of them or those of one node.
func driverSlices(ctx context.Context, node string) (int, error) {
	selector := "spec.driver=" + driver
	if node != "" {
		selector += ",spec.nodeName=" + node
	}
	list, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: selector})
	if err != nil {
		return 0, err
	}
	return len(list.Items), nil
}

// --- the rows' shared parts -------------------------------------------------------------------------

// realFault is what the real-node rows share: the node, a namespace of pods Running through every fault
// (checked for lost devices after each round), and the node's whole pool.
type realFault struct {
	rn   realNodeEnv
	held string // namespace of the pods Running throughout
	pool int    // the node's slices with the chart's plugin serving
}

// realFaultTemplates: a MIG 1g slice (GPUs 0-3), an MPS share of GPU 1 and a whole GPU (4 or 5), so a
// round's pods and the held ones always fit the real node's six GPUs together.
func realFaultTemplates(t *testing.T, ns string) {
	t.Helper()
	claimTemplate(t, ns, "mig", mig1gClass(t), selector(fmt.Sprintf(`device.attributes[%q].index <= 3`, driver)))
	claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "4Gi", "compute": "10"}))
	claimTemplate(t, ns, "whole", gpuClass(t), selector(fmt.Sprintf(`device.attributes[%q].index >= 4`, driver)))
}

// realPods creates one pod per kind on the real node, names suffixed with tag.
func (f *realFault) realPods(t *testing.T, ns, tag string) {
	t.Helper()
	for _, kind := range []string{"mig", "share", "whole"} {
		workloadPod(ns, fmt.Sprintf("%s-%s", kind, tag), f.rn.name).withClaimFrom(kind).create(t)
	}
}

// untilAllRunning waits until ns has pods and every one is Running, and returns how long after `since`
// that was seen (sampled every 200 ms), or false when timeout passed first (checkPods then counts them).
func untilAllRunning(t *testing.T, ns string, since time.Time, timeout time.Duration) (time.Duration, bool) {
	t.Helper()
	var at time.Duration
	err := wait.PollUntilContextTimeout(ctxFor(t, timeout+10*time.Second), 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		pods, err := e.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil || len(pods.Items) == 0 {
			return false, nil
		}
		for _, p := range pods.Items {
			if p.DeletionTimestamp != nil || p.Status.Phase != v1.PodRunning {
				return false, nil
			}
		}
		at = time.Since(since)
		return true, nil
	})
	return at, err == nil
}

// waitChartPods waits until each named component of the chart has exactly one Ready pod on the node.
func waitChartPods(t *testing.T, what string, components ...string) {
	t.Helper()
	waitFor(t, what, 4*time.Minute, func(ctx context.Context) (bool, string) {
		var states []string
		for _, component := range components {
			pods, err := podsOf(ctx, component)
			if err != nil {
				return false, err.Error()
			}
			n, s := readyPods(pods)
			states = append(states, s...)
			if n != 1 || len(pods) != 1 {
				return false, strings.Join(states, "; ")
			}
		}
		return true, ""
	})
}

// waitNodeReadySince waits for the node's Ready condition with a heartbeat after `since`.
func waitNodeReadySince(t *testing.T, node string, since time.Time) {
	t.Helper()
	waitFor(t, "node "+node+" Ready again", 2*time.Minute, func(ctx context.Context) (bool, string) {
		n, err := e.client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, c := range n.Status.Conditions {
			if c.Type == v1.NodeReady {
				return c.Status == v1.ConditionTrue && c.LastHeartbeatTime.After(since), "Ready " + string(c.Status)
			}
		}
		return false, "no Ready condition"
	})
}

// settled waits until the node serves again as before a fault: the plugin and the MPS supervisor Ready,
// the whole pool published and every MPS daemon a prepared share needs answering. A row's counts are
// taken after it, so they show what stayed broken, not the moment of the fault.
func (f *realFault) settled(t *testing.T) {
	t.Helper()
	waitChartPods(t, "the plugin and MPS supervisor pods Ready on "+f.rn.name, "kubelet-plugin", "mps-supervisor")
	waitFor(t, "the real node's whole pool published", 2*time.Minute, func(ctx context.Context) (bool, string) {
		n, err := driverSlices(ctx, f.rn.name)
		return err == nil && n == f.pool, fmt.Sprintf("%d of %d slices (err %v)", n, f.pool, err)
	})
	waitFor(t, "the MPS daemons of prepared shares answering", 90*time.Second, func(context.Context) (bool, string) {
		h := observeNode(t, f.rn.name)
		for _, devices := range liveClaims(t, f.rn.name) {
			for _, d := range devices {
				if k := shareKey(d); k != "" && !contains(h.daemons, k) {
					return false, "no daemon answers for " + d
				}
			}
		}
		return true, ""
	})
}

// faultRow is one real-node row: `fault` runs once the round's pods are created and returns when the
// fault happened (what recovery counts from); `duringDelete`, if set, runs while the round's pods are
// being deleted.
type faultRow struct {
	ns           string // the rounds' namespace
	scenario     string
	rounds       int  // in the full run (FAULT_ROUNDS >= 100); 1 otherwise
	disturbed    bool // the fault restarts or removes the node's kubelet or plugin (its slice gaps are reported, not judged)
	standIns     bool // the fault also withdraws the stand-in nodes' slices (the uninstall)
	poolMeasured bool
	fault        func(t *testing.T, ns, tag string) time.Time
	duringDelete func(t *testing.T)
	afterRound   func(t *testing.T)
}

func (f *realFault) run(t *testing.T, row faultRow) {
	ns := namespace(t, row.ns)
	realFaultTemplates(t, ns)
	c := faultCounts{Scenario: "real node: " + row.scenario}
	rounds := 1
	if full(t) {
		rounds = row.rounds
	}
	began := time.Now()
	gaps := sampleGaps(f.rn.name)
	pool := watchPool(f.rn.name, f.pool)
	var recovery time.Duration
	for round := range rounds {
		tag := fmt.Sprintf("r%d", round)
		f.realPods(t, ns, tag)
		at := row.fault(t, ns, tag)
		took, ok := untilAllRunning(t, ns, at, 4*time.Minute)
		if ok {
			recovery = max(recovery, took)
			t.Logf("round %d/%d: every pod Running %.2f s after the fault", round+1, rounds, took.Seconds())
		}
		f.settled(t)
		checkPods(t, &c, ns)
		checkPods(t, &c, f.held)

		if err := e.client.CoreV1().Pods(ns).DeleteCollection(ctxFor(t, 30*time.Second), metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
			t.Fatalf("delete the round's pods: %v", err)
		}
		if row.duringDelete != nil {
			row.duringDelete(t)
		}
		deleteAll(t, ns, 3*time.Minute)
		f.settled(t)
		checkLeaks(t, &c, f.rn.name)
		if row.afterRound != nil {
			row.afterRound(t)
		}
		c.Rounds++
	}
	f.settled(t)
	windows, samples := pool.stop()
	disturbed := []string{}
	if row.disturbed {
		disturbed = append(disturbed, f.rn.name)
	}
	if row.standIns {
		disturbed = append(disturbed, e.nodes...)
	}
	gaps.stop(&c, disturbed...)
	if row.poolMeasured {
		c.LongestIncomplete = ptr.To(longest(windows).Seconds())
		var each []string
		for _, w := range windows {
			each = append(each, fmt.Sprintf("%.2f", w.Seconds()))
		}
		t.Logf("pool incomplete %d time(s), longest %.3f s (%d samples at 25 ms): %s s", len(windows), longest(windows).Seconds(), samples, strings.Join(each, ", "))
	}
	if c.Rounds > 0 {
		c.Recovery = ptr.To(recovery.Seconds())
	}
	c.Seconds = int(time.Since(began).Seconds())
	record(t, c)
}

// --- the rows ---------------------------------------------------------------------------------------

func TestFaultsRealNode(t *testing.T) {
	rn := realNode(t)
	installChart(t, rn)
	waitChartPods(t, "the plugin and MPS supervisor pods Ready on "+rn.name, "kubelet-plugin", "mps-supervisor")
	f := &realFault{rn: rn, held: namespace(t, "fault-real-held")}
	realFaultTemplates(t, f.held)
	f.realPods(t, f.held, "held")
	if _, ok := untilAllRunning(t, f.held, time.Now(), 4*time.Minute); !ok {
		t.Fatalf("the held pods did not start: %v", podProblems(t, f.held))
	}
	// The pool is what the node publishes with its plugin serving: constant under any allocation
	// (every placement is published), read once it has stayed the same for a second.
	waitFor(t, "the real node's pool published and stable", 2*time.Minute, func(ctx context.Context) (bool, string) {
		n, err := driverSlices(ctx, rn.name)
		stable := err == nil && n > 0 && n == f.pool
		f.pool = n
		time.Sleep(time.Second)
		return stable, fmt.Sprintf("%d slices (err %v)", n, err)
	})
	kubelet := "kubelet-" + rn.name

	t.Run("KubeletKilledDuringABurst", func(t *testing.T) {
		f.run(t, faultRow{ns: "fault-real-kubelet", scenario: "kubelet kill -9 during a pod burst", rounds: 20, disturbed: true, poolMeasured: true,
			fault: func(t *testing.T, _, _ string) time.Time {
				time.Sleep(jitter(1500 * time.Millisecond))
				at := time.Now()
				kill9(t, kubelet)
				proc(t, "start", kubelet)
				waitNodeReadySince(t, rn.name, at)
				return at
			}})
	})

	t.Run("ContainerdKilledDuringABurst", func(t *testing.T) {
		// Running containers keep running (their shims do not depend on containerd); the plugin is never
		// away, so its slices must stay: the node counts as healthy.
		f.run(t, faultRow{ns: "fault-real-containerd", scenario: "containerd kill -9 during a pod burst", rounds: 10, poolMeasured: true,
			fault: func(t *testing.T, _, _ string) time.Time {
				time.Sleep(jitter(1500 * time.Millisecond))
				at := time.Now()
				kill9(t, "containerd-real")
				proc(t, "start", "containerd-real")
				return at
			}})
	})

	killPlugin := func(t *testing.T) time.Time {
		p, err := chartPluginPod(ctxFor(t, 30*time.Second))
		if err != nil {
			t.Fatalf("the chart's plugin pod: %v", err)
		}
		pid := rn.containerPID(t, p, "plugin")
		at := time.Now()
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatalf("kill -9 the plugin container's process %d: %v", pid, err)
		}
		return at
	}
	t.Run("PluginKilledMidPrepare", func(t *testing.T) {
		// kubelet restarts a crashed container at once the first time and backs off after that (10 s,
		// 20 s, ... up to 5 min, reset after 10 min of running), which is kubelet's policy, not the
		// plugin's: each round starts on a fresh plugin pod so every round measures the same first crash
		// (and the unprepare kill its second).
		f.run(t, faultRow{ns: "fault-real-plugin", scenario: "plugin container kill -9 mid-prepare and mid-unprepare", rounds: 5, disturbed: true, poolMeasured: true,
			fault: func(t *testing.T, _, _ string) time.Time {
				time.Sleep(jitter(1000 * time.Millisecond))
				return killPlugin(t)
			},
			duringDelete: func(t *testing.T) {
				waitChartPods(t, "the plugin Ready before the unprepare kill", "kubelet-plugin")
				time.Sleep(jitter(1000 * time.Millisecond))
				killPlugin(t)
			},
			afterRound: func(t *testing.T) {
				p, err := chartPluginPod(ctxFor(t, 30*time.Second))
				if err != nil {
					t.Fatalf("the chart's plugin pod: %v", err)
				}
				if err := e.client.CoreV1().Pods(chartNamespace).Delete(ctxFor(t, 30*time.Second), p.Name, metav1.DeleteOptions{}); err != nil {
					t.Fatalf("replace the plugin pod %s: %v", p.Name, err)
				}
				waitPluginPodReplaced(t, "a fresh plugin pod Ready", p.Name, 3*time.Minute)
			}})
	})

	t.Run("MpsSupervisorDeletedDuringABurst", func(t *testing.T) {
		f.run(t, faultRow{ns: "fault-real-mps", scenario: "MPS supervisor pod deleted during a pod burst", rounds: 10, poolMeasured: true,
			fault: func(t *testing.T, _, _ string) time.Time {
				time.Sleep(jitter(1500 * time.Millisecond))
				ctx := ctxFor(t, time.Minute)
				sup, err := podsOf(ctx, "mps-supervisor")
				if err != nil || len(sup) != 1 {
					t.Fatalf("MPS supervisor pods: %d (%v)", len(sup), err)
				}
				at := time.Now()
				if err := e.client.CoreV1().Pods(chartNamespace).Delete(ctx, sup[0].Name, metav1.DeleteOptions{}); err != nil {
					t.Fatalf("delete the MPS supervisor pod: %v", err)
				}
				return at
			}})
	})

	t.Run("WarmPartitionsThroughPluginRestarts", func(t *testing.T) { f.warmRow(t, killPlugin) })

	t.Run("UninstallAndReinstallWithPodsRunning", func(t *testing.T) {
		f.run(t, faultRow{ns: "fault-real-uninstall", scenario: "helm uninstall and reinstall with pods running", rounds: 5, disturbed: true, standIns: true,
			fault: func(t *testing.T, ns, tag string) time.Time { return f.uninstallAndReinstall(t, ns, tag) }})
	})
}

// uninstallAndReinstall uninstalls the chart under the round's running pods, checks that nothing of the
// driver is left to allocate (slices, the leader Lease, the webhook configuration), deletes one pod while
// tessera is gone, and installs the chart again; it returns when the reinstall began.
func (f *realFault) uninstallAndReinstall(t *testing.T, ns, tag string) time.Time {
	t.Helper()
	if _, ok := untilAllRunning(t, ns, time.Now(), 4*time.Minute); !ok {
		t.Fatalf("the round's pods did not start before the uninstall: %v", podProblems(t, ns))
	}
	before, err := driverSlices(ctxFor(t, 30*time.Second), "")
	if err != nil || before == 0 {
		t.Fatalf("no slices of %s before the uninstall (%d, %v)", driver, before, err)
	}
	began := time.Now()
	helmRun(t, "uninstall", "tessera", "--namespace", chartNamespace, "--wait", "--timeout", "120s")
	took := time.Since(began)
	ctx := ctxFor(t, 5*time.Minute)
	if left, err := driverSlices(ctx, ""); err != nil || left != 0 {
		t.Errorf("%d of %d ResourceSlices of %s outlived helm uninstall (err %v): the scheduler would keep allocating them", left, before, driver, err)
	}
	if _, err := e.client.CoordinationV1().Leases(chartNamespace).Get(ctx, "tessera-controller", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("the leader Lease outlived helm uninstall (get: %v)", err)
	}
	// A webhook configuration without its webhook, failing closed, would refuse every claim of the cluster.
	if _, err := e.client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctx, chartWebhookConfig, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("ValidatingWebhookConfiguration %s outlived helm uninstall (get: %v)", chartWebhookConfig, err)
	}
	// kubelet cannot unprepare without the driver: the pod stays Terminating until the reinstall.
	deleted := "whole-" + tag
	if err := e.client.CoreV1().Pods(ns).Delete(ctx, deleted, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](1)}); err != nil {
		t.Fatalf("delete %s while tessera is uninstalled: %v", deleted, err)
	}

	reinstalled := time.Now()
	helmInstall(t, f.rn)
	var published time.Duration
	waitFor(t, "the reinstall publishes the real node's whole pool", 3*time.Minute, func(ctx context.Context) (bool, string) {
		n, err := driverSlices(ctx, f.rn.name)
		published = time.Since(reinstalled)
		return err == nil && n == f.pool, fmt.Sprintf("%d of %d slices (err %v)", n, f.pool, err)
	})
	waitGone(t, ns, deleted, 3*time.Minute)
	waitChartWebhookServing(t)
	t.Logf("helm uninstall took %.1f s, left 0 of %d slices; the reinstall published the real node in %.1f s and %s, deleted meanwhile, was gone %.1f s after it",
		took.Seconds(), before, published.Seconds(), deleted, time.Since(reinstalled).Seconds())
	return reinstalled
}

// podProblems is why each pod of ns that is not Running is not.
func podProblems(t *testing.T, ns string) []string {
	t.Helper()
	c := faultCounts{quiet: true}
	checkPods(t, &c, ns)
	return c.raw
}

// warmFaultWindow is the warm window of the warm row: past a round's delete and the plugin's restart, and
// short enough to wait out with the plugin away.
const warmFaultWindow = 20 * time.Second

// warmRow (issue 25): under a policy that keeps MIG devices and MPS daemons warm, each round's pods go and
// leave their partitions warm; the plugin is killed (kill -9, restarted by kubelet inside the window) and the
// next pods must take what was kept, and not wait on it; they go too, and the plugin is then kept away
// (its DaemonSet deleted) until the window has ended, so the restarted plugin finds warm records past their
// window. Leaks are counted as in every row, a warm record kept past its window among them.
func (f *realFault) warmRow(t *testing.T, killPlugin func(*testing.T) time.Time) {
	setWarmWindow(t, f.rn, warmFaultWindow)
	ns := namespace(t, "fault-real-warm")
	realFaultTemplates(t, ns)
	c := faultCounts{Scenario: "real node: warm partitions kept through a plugin kill -9 inside the window and a plugin away past it"}
	rounds := 1
	if full(t) {
		rounds = 5
	}
	began := time.Now()
	gaps := sampleGaps(f.rn.name)
	var recovery time.Duration
	warmTakes := 0
	for round := range rounds {
		f.realPods(t, ns, fmt.Sprintf("a%d", round))
		if _, ok := untilAllRunning(t, ns, time.Now(), 4*time.Minute); !ok {
			t.Fatalf("round %d: the first pods did not start: %v", round, podProblems(t, ns))
		}
		f.releaseAll(t, ns)
		// The round's MIG device is kept; its share's daemon is not, since the held share still uses it.
		waitFor(t, "the released MIG device kept warm", time.Minute, func(context.Context) (bool, string) {
			h := observeNode(t, f.rn.name)
			for key := range h.warm {
				if migDeviceName.MatchString(key) {
					return true, ""
				}
			}
			return false, fmt.Sprintf("warm records %v; the plugin's lines on claims: %s", keys(h.warm),
				strings.Join(pluginLogLines(t, "prepared claim", "unprepared claim", "kept warm", "warm device"), " | "))
		})

		// Killed while warm, restarted by kubelet inside the window: the next pods take what was kept.
		at := killPlugin(t)
		waitChartPods(t, "the plugin back after its kill", "kubelet-plugin")
		f.realPods(t, ns, fmt.Sprintf("b%d", round))
		took, ok := untilAllRunning(t, ns, at, 4*time.Minute)
		if ok {
			recovery = max(recovery, took)
		}
		checkPods(t, &c, ns)
		checkPods(t, &c, f.held)
		for _, line := range pluginPrepares(t) {
			if line.at.After(at) && line.warm {
				warmTakes++
			}
		}

		// Released again, and the plugin kept away until the window has ended.
		f.releaseAll(t, ns)
		back := pluginAway(t)
		time.Sleep(warmFaultWindow + 2*time.Second)
		back()
		f.settled(t)
		checkLeaks(t, &c, f.rn.name)
		c.Rounds++
	}
	if warmTakes == 0 {
		t.Errorf("no prepare after a kill -9 inside the window took a warm partition: the warm records did not survive the restart")
	}
	t.Logf("prepares that took a warm partition after the kill: %d in %d round(s)", warmTakes, rounds)
	f.settled(t)
	gaps.stop(&c, f.rn.name)
	c.Recovery = ptr.To(recovery.Seconds())
	c.Seconds = int(time.Since(began).Seconds())
	record(t, c)
}

// releaseAll deletes the namespace's pods and waits until they are gone and the plugin holds none of their
// claims (with a warm policy, their partitions are kept then).
func (f *realFault) releaseAll(t *testing.T, ns string) {
	t.Helper()
	if err := e.client.CoreV1().Pods(ns).DeleteCollection(ctxFor(t, 30*time.Second), metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil {
		t.Fatalf("delete the round's pods: %v", err)
	}
	deleteAll(t, ns, 3*time.Minute)
	waitFor(t, "the released claims unprepared", 2*time.Minute, func(context.Context) (bool, string) {
		live := liveClaims(t, f.rn.name)
		h := observeNode(t, f.rn.name)
		for uid := range h.records {
			if _, ok := live[uid]; !ok {
				return false, "the plugin still holds claim " + uid
			}
		}
		return true, ""
	})
}

// pluginAway deletes the chart's plugin DaemonSet and waits for its pod to go; the returned function
// creates it again as it was, waits for its pod to be Ready and returns when it created it.
func pluginAway(t *testing.T) func() time.Time {
	t.Helper()
	ctx := ctxFor(t, 5*time.Minute)
	sets := e.client.AppsV1().DaemonSets(chartNamespace)
	ds, err := sets.Get(ctx, "tessera-kubelet-plugin", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := sets.Delete(ctx, ds.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the plugin pod gone", 2*time.Minute, func(ctx context.Context) (bool, string) {
		pods, err := podsOf(ctx, "kubelet-plugin")
		return err == nil && len(pods) == 0, fmt.Sprintf("%d plugin pods (err %v)", len(pods), err)
	})
	return func() time.Time {
		again := &appsv1.DaemonSet{
			ObjectMeta: metav1.ObjectMeta{Name: ds.Name, Namespace: ds.Namespace, Labels: ds.Labels, Annotations: ds.Annotations},
			Spec:       ds.Spec,
		}
		if _, err := sets.Create(ctxFor(t, 30*time.Second), again, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create the plugin DaemonSet again: %v", err)
		}
		recreated := time.Now()
		waitChartPods(t, "the plugin pod back", "kubelet-plugin")
		return recreated
	}
}
