package e2etest

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

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

// kubelet deletes its node's driver slices when it starts; the controller must put them back at once, and a
// running pod must keep its device. The incomplete-pool window of each restart is printed (a number, not a
// pass/fail threshold); the scenario fails if the pool does not come back or the pod loses its device.
func TestRealNodeKubeletRestartsLeaveItsPoolIncompleteOnlyBriefly(t *testing.T) {
	rn := realNode(t)
	installChart(t, rn)
	ns := namespace(t, "kubelet-restart")
	claimTemplate(t, ns, "whole", gpuClass(t))
	w := workloadPod(ns, "held", rn.name).withClaimFrom("whole").create(t)
	waitRunning(t, ns, w.Name, 3*time.Minute)

	var want int
	waitFor(t, "the real node's pool published and stable", 2*time.Minute, func(ctx context.Context) (bool, string) {
		n, err := driverSlices(ctx, rn.name)
		stable := err == nil && n > 0 && n == want
		want = n
		time.Sleep(time.Second)
		return stable, fmt.Sprintf("%d slices (err %v)", n, err)
	})

	kubelet := "kubelet-" + rn.name
	rounds := 3
	var worst time.Duration
	for round := 1; round <= rounds; round++ {
		pool := watchPool(rn.name, want)
		restarted := time.Now()
		kill9(t, kubelet)
		proc(t, "start", kubelet)
		waitFor(t, fmt.Sprintf("round %d: node %s Ready again", round, rn.name), 2*time.Minute, func(ctx context.Context) (bool, string) {
			node, err := e.client.CoreV1().Nodes().Get(ctx, rn.name, metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			for _, c := range node.Status.Conditions {
				if c.Type == v1.NodeReady {
					return c.Status == v1.ConditionTrue && c.LastHeartbeatTime.After(restarted), "Ready " + string(c.Status)
				}
			}
			return false, "no Ready condition"
		})
		// kubelet wipes the slices once it has synced with the API server; give it time to, then wait for
		// the pool to be whole.
		time.Sleep(5 * time.Second)
		waitFor(t, fmt.Sprintf("round %d: the pool is whole again", round), 2*time.Minute, func(ctx context.Context) (bool, string) {
			n, err := driverSlices(ctx, rn.name)
			return err == nil && n == want, fmt.Sprintf("%d of %d slices (err %v)", n, want, err)
		})
		gaps, samples := pool.stop()
		var total time.Duration
		for _, g := range gaps {
			total += g
		}
		worst = max(worst, longest(gaps))
		t.Logf("kubelet restart %d/%d: pool incomplete %d time(s), %.3f s in all (longest %.3f s), %d samples at 25 ms",
			round, rounds, len(gaps), total.Seconds(), longest(gaps).Seconds(), samples)
	}
	p, err := e.client.CoreV1().Pods(ns).Get(ctxFor(t, 30*time.Second), w.Name, metav1.GetOptions{})
	if err != nil || p.Status.Phase != v1.PodRunning {
		t.Fatalf("the pod holding a GPU did not survive %d kubelet restarts: %v %v", rounds, p.Status.Phase, err)
	}
	for _, s := range p.Status.ContainerStatuses {
		if s.RestartCount > 0 {
			t.Fatalf("container %s of the GPU pod restarted %d time(s) across kubelet restarts", s.Name, s.RestartCount)
		}
	}
	t.Logf("longest incomplete-pool window over %d kubelet restarts: %.3f s", rounds, worst.Seconds())
}

func longest(gaps []time.Duration) time.Duration {
	var m time.Duration
	for _, g := range gaps {
		if g > m {
			m = g
		}
	}
	return m
}
