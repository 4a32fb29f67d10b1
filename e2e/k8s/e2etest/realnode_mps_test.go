package e2etest

// MPS on the real node when the supervisor goes: its daemons end with its container, and the next
// supervisor must bring back the daemon of every prepared share at once, with the same settings, in the
// pipe directory the running clients have mounted (kubelet-plugin/src/devices/sharing/supervisor.rs).

import (
	"context"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// mpsControl sends one control command to the MPS control daemon of a shared device, through the socket
// its clients' CUDA_MPS_PIPE_DIRECTORY holds, and returns the answer (the simulated daemon's wire protocol:
// one line, the writer's half closed, the answer until EOF).
func (rn realNodeEnv) mpsControl(t *testing.T, device, command string) string {
	t.Helper()
	conn, err := net.DialTimeout("unix", filepath.Join(rn.mpsDaemonDir(device), "pipe", "control"), 2*time.Second)
	if err != nil {
		t.Fatalf("MPS daemon of %s: %v", device, err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fmt.Fprintln(conn, command); err != nil {
		t.Fatalf("MPS daemon of %s: send %q: %v", device, command, err)
	}
	_ = conn.(*net.UnixConn).CloseWrite()
	answer, err := io.ReadAll(conn)
	if err != nil {
		t.Fatalf("MPS daemon of %s: answer to %q: %v", device, command, err)
	}
	return strings.TrimSpace(string(answer))
}

// mpsSettings are the daemon defaults a client that sets no CUDA_MPS_* variable gets.
func (rn realNodeEnv) mpsSettings(t *testing.T, device string) string {
	return fmt.Sprintf("active_thread_percentage=%s pinned_mem_limit=%s",
		rn.mpsControl(t, device, "get_default_active_thread_percentage"),
		rn.mpsControl(t, device, "get_default_device_pinned_mem_limit 0"))
}

// podLog is `kubectl logs --timestamps` of a container of a pod on the real node; what went wrong reading
// it, if anything, in its place (every caller prints the log it did not like).
func (rn realNodeEnv) podLog(p v1.Pod, container string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	log, err := podLogs(ctx, &p, container, false)
	if err != nil {
		return err.Error()
	}
	return log
}

// serveWatch polls a shared device's control socket and keeps when it stopped and started answering.
type serveWatch struct {
	mu         sync.Mutex
	down, back time.Time
}

func (w *serveWatch) run(ctx context.Context, rn realNodeEnv, device string) {
	for ctx.Err() == nil {
		serves := rn.mpsServes(device)
		now := time.Now()
		w.mu.Lock()
		switch {
		case !serves && w.down.IsZero():
			w.down = now
		case serves && !w.down.IsZero() && w.back.IsZero():
			w.back = now
		}
		w.mu.Unlock()
		time.Sleep(20 * time.Millisecond)
	}
}

func (w *serveWatch) times() (down, back time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.down, w.back
}

// clientOutage reads a reporting pod's log: the last report through an MPS server before `from`, the first
// one without a server after it, and the first one through a server again.
func clientOutage(log string, from time.Time) (lastOK, firstBad, firstBack time.Time) {
	for _, line := range strings.Split(log, "\n") {
		ts, text, ok := logLine(line)
		if !ok || !strings.HasPrefix(text, "sees ") {
			continue
		}
		ok = strings.Contains(text, "mps=yes server=")
		switch {
		case ts.Before(from) && ok:
			lastOK = ts
		case !ts.Before(from) && !ok && firstBad.IsZero():
			firstBad = ts
		case !ts.Before(from) && ok && !firstBad.IsZero() && firstBack.IsZero():
			firstBack = ts
		}
	}
	return
}

func TestRealNodeMpsSharesGetTheirDaemonBackWithItsSettingsWhenTheSupervisorPodIsDeleted(t *testing.T) {
	rn := realNode(t)
	installChart(t, rn)
	waitChartPods(t, "plugin and MPS supervisor pods Ready on "+rn.name, "kubelet-plugin", "mps-supervisor")
	waitFor(t, "ResourceSlices for "+rn.name, 2*time.Minute, func(ctx context.Context) (bool, string) {
		n := countDevices(t, rn.name, wholeGPUName)
		return n == rn.gpus-1, fmt.Sprintf("%d of %d whole GPUs published", n, rn.gpus-1)
	})

	ns := namespace(t, "real-node-mps")
	// Daemon defaults from the claim's config (what a client that drops its CUDA_MPS_* env gets), client
	// limits from the consumed capacity.
	config := `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"defaultActiveThreadPercentage":40,"defaultPinnedDeviceMemoryLimit":"20Gi"}}}`
	claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "10Gi", "compute": "25"}), opaqueConfig(config))
	var pods []*v1.Pod
	for _, name := range []string{"mps-a", "mps-b"} {
		workloadPod(ns, name, rn.name).withClaimFrom("share").reporting().create(t)
	}
	for _, name := range []string{"mps-a", "mps-b"} {
		pods = append(pods, waitRunning(t, ns, name, 3*time.Minute))
	}
	_, devices := realAllocations(t, pods[0])
	_, other := realAllocations(t, pods[1])
	if len(devices) != 1 || len(other) != 1 || devices[0].Device != other[0].Device {
		t.Fatalf("allocated %v and %v, want both shares on one shared GPU", deviceNames(devices), deviceNames(other))
	}
	device := devices[0].Device
	for _, p := range pods {
		waitFor(t, p.Name+" reports a context through the MPS server", 30*time.Second, func(context.Context) (bool, string) {
			r, _ := rn.lastReport(t, p)
			return strings.Contains(r, "mps=yes server="), r
		})
	}
	settings := rn.mpsSettings(t, device)
	if want := "active_thread_percentage=40.0 pinned_mem_limit=20480M"; settings != want {
		t.Fatalf("MPS daemon of %s: %s, want the config's %s", device, settings, want)
	}
	daemon := rn.mpsDaemonPID(t, device)

	ctx := ctxFor(t, 5*time.Minute)
	supervisors, err := podsOf(ctx, "mps-supervisor")
	if err != nil || len(supervisors) != 1 {
		t.Fatalf("MPS supervisor pods: %v (%d)", err, len(supervisors))
	}
	old := supervisors[0]
	grace := int64(30)
	if old.Spec.TerminationGracePeriodSeconds != nil {
		grace = *old.Spec.TerminationGracePeriodSeconds
	}
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	var watch serveWatch
	go watch.run(watchCtx, rn, device)

	deleted := time.Now()
	if err := e.client.CoreV1().Pods(chartNamespace).Delete(ctx, old.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete the MPS supervisor pod %s: %v", old.Name, err)
	}
	var terminated time.Duration
	waitFor(t, "the old supervisor pod gone", time.Duration(grace+30)*time.Second, func(ctx context.Context) (bool, string) {
		_, err := e.client.CoreV1().Pods(chartNamespace).Get(ctx, old.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			terminated = time.Since(deleted)
			return true, ""
		}
		return false, fmt.Sprintf("still there (%v)", err)
	})
	t.Logf("the supervisor pod terminated %.2fs after its deletion (grace period %ds)", terminated.Seconds(), grace)
	if terminated >= time.Duration(grace)*time.Second {
		t.Errorf("the supervisor pod took %s to terminate, the whole %ds grace period: it does not stop on SIGTERM", terminated, grace)
	}

	var started time.Time
	waitFor(t, "a new MPS supervisor pod running", 2*time.Minute, func(ctx context.Context) (bool, string) {
		pods, err := podsOf(ctx, "mps-supervisor")
		if err != nil {
			return false, err.Error()
		}
		_, states := readyPods(pods)
		if len(pods) != 1 || pods[0].Name == old.Name || len(pods[0].Status.ContainerStatuses) == 0 {
			return false, strings.Join(states, "; ")
		}
		run := pods[0].Status.ContainerStatuses[0].State.Running
		if run == nil {
			return false, strings.Join(states, "; ")
		}
		started = run.StartedAt.Time
		return true, ""
	})
	waitFor(t, "the MPS daemon of "+device+" back", time.Minute, func(context.Context) (bool, string) {
		_, back := watch.times()
		return !back.IsZero(), "its control socket does not answer"
	})
	down, back := watch.times()
	stopWatch()
	t.Logf("MPS daemon of %s: down %.2fs after the deletion, back %.2fs later (%.2fs after the new supervisor's container started, to the second)",
		device, down.Sub(deleted).Seconds(), back.Sub(down).Seconds(), back.Sub(started.Truncate(time.Second)).Seconds())
	if back.Sub(started) > 20*time.Second {
		t.Errorf("the daemon came back %s after the new supervisor started, want within seconds", back.Sub(started))
	}
	if got := rn.mpsDaemonPID(t, device); got == daemon {
		t.Errorf("MPS daemon of %s: pid %s before and after, want the new supervisor's daemon", device, got)
	}
	if got := rn.mpsSettings(t, device); got != settings {
		t.Errorf("MPS daemon of %s after the restore: %s, want the settings it had: %s", device, got, settings)
	}

	// The running clients, with no new claim: the same containers reach the restored server through the
	// pipe directory they have mounted.
	for _, p := range pods {
		waitFor(t, p.Name+" reports through an MPS server again", 30*time.Second, func(context.Context) (bool, string) {
			r, ts := rn.lastReport(t, p)
			return ts.After(back) && strings.Contains(r, "mps=yes server="), r
		})
		now, err := e.client.CoreV1().Pods(ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("pod %s: %v", p.Name, err)
		}
		if now.Status.Phase != v1.PodRunning || now.Status.ContainerStatuses[0].RestartCount != 0 {
			t.Errorf("pod %s after the supervisor's restart: phase %s, restarts %d; want Running, 0", p.Name, now.Status.Phase, now.Status.ContainerStatuses[0].RestartCount)
		}
		lastOK, firstBad, firstBack := clientOutage(rn.podLog(*now, "hold"), deleted)
		if firstBad.IsZero() {
			t.Logf("%s: no report without an MPS server (reports once a second; last before the deletion %s)", p.Name, lastOK.Format(time.RFC3339Nano))
		} else {
			t.Logf("%s: CUDA contexts failed from %.2fs to %.2fs after the deletion (reports once a second)",
				p.Name, firstBad.Sub(deleted).Seconds(), firstBack.Sub(deleted).Seconds())
		}
	}
	claims, err := e.client.ResourceV1().ResourceClaims(ns).List(ctx, metav1.ListOptions{})
	if err != nil || len(claims.Items) != 2 {
		t.Errorf("claims in %s: %v (%d), want the two pods' only", ns, err, len(claims.Items))
	}

	// The plugin saw the share without a server, or, when the new supervisor restored it within one of the
	// plugin's 1 s checks, saw another daemon answering, and said so.
	plugins, err := podsOf(ctx, "kubelet-plugin")
	if err != nil || len(plugins) != 1 {
		t.Fatalf("plugin pods: %v", err)
	}
	key := strings.TrimSuffix(device, "-shared")
	waitFor(t, "the plugin's log line on the down daemon", 30*time.Second, func(context.Context) (bool, string) {
		log := rn.podLog(plugins[0], "plugin")
		for _, line := range strings.Split(log, "\n") {
			down := strings.Contains(line, "MPS daemon of prepared shares does not answer")
			replaced := strings.Contains(line, "MPS daemon of prepared shares was replaced")
			if (down || replaced) && strings.Contains(line, key) && strings.Contains(line, "WARN") {
				t.Logf("the plugin's log: %s", line)
				return true, ""
			}
		}
		return false, "no WARN line naming " + key + " in the plugin's log"
	})
	// And on the pods: kubectl describe pod shows the outage and its end.
	for _, p := range pods {
		waitFor(t, "MpsDaemonDown and MpsDaemonBack events on "+p.Name, 30*time.Second, func(ctx context.Context) (bool, string) {
			events, err := e.client.EventsV1().Events(ns).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, err.Error()
			}
			got := map[string]string{}
			for _, ev := range events.Items {
				if ev.Regarding.Kind == "Pod" && ev.Regarding.Name == p.Name && ev.Regarding.UID == p.UID {
					got[ev.Reason] = ev.Type + ": " + ev.Note
				}
			}
			if got["MpsDaemonDown"] == "" || got["MpsDaemonBack"] == "" {
				return false, fmt.Sprintf("events %v", got)
			}
			t.Logf("%s: event %s", p.Name, got["MpsDaemonDown"])
			return strings.HasPrefix(got["MpsDaemonDown"], "Warning: ") && strings.Contains(got["MpsDaemonDown"], key), fmt.Sprintf("events %v", got)
		})
	}
}
