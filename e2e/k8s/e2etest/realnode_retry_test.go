package e2etest

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
)

// The annotation the plugin stamps on a pod whose prepare kubelet gave up on while the plugin was away
// (kubelet-plugin/src/kubelet/prepare_retry.rs).
const prepareRetryAnnotation = "gpu.tessera.dev/prepare-retry"

// Issue 27 item 3: upstream kubelet does not back off and retry a NodePrepareResources that failed because
// the plugin was away; the pod waits for its periodic resync, a minute or more. A burst of pods created
// while the real node's plugin is gone fails to prepare; once the plugin is back, it stamps each such pod
// so kubelet syncs it at once. How long each pod took after the plugin was Ready is printed (a number, not
// a pass/fail threshold); the scenario fails if a pod does not run or none was stamped.
func TestRealNodePodsWhosePrepareFailedWhileThePluginWasAwayRunOnceItIsBack(t *testing.T) {
	rn := realNode(t)
	installChart(t, rn)
	ns := namespace(t, "prepare-retry")
	claimTemplate(t, ns, "whole", gpuClass(t))
	waitFor(t, "plugin pod Ready on "+rn.name, 3*time.Minute, func(ctx context.Context) (bool, string) {
		pods, err := podsOf(ctx, "kubelet-plugin")
		if err != nil {
			return false, err.Error()
		}
		n, states := readyPods(pods)
		return n == 1, strings.Join(states, "; ")
	})

	// The pods must be allocated to the node's devices to reach its kubelet: with the plugin gone before
	// the chart's controller first published the node, the pool is never published (a heartbeat that never
	// changed is not trusted) and the burst stays Pending. After a reinstall that takes up to half a minute.
	waitFor(t, "the real node's pool published", 2*time.Minute, func(ctx context.Context) (bool, string) {
		n, err := driverSlices(ctx, rn.name)
		return err == nil && n > 0, fmt.Sprintf("%d slices (err %v)", n, err)
	})
	// Take the plugin away: the DaemonSet and its pod go (kept to be created again as it was).
	back := pluginAway(t)
	gone := time.Now()

	names := []string{"burst-0", "burst-1", "burst-2"}
	for _, name := range names {
		workloadPod(ns, name, rn.name).withClaimFrom("whole").create(t)
	}
	for _, name := range names {
		msg := waitPrepareFailure(t, ns, name)
		t.Logf("%s while the plugin is away: %s", name, msg)
	}

	recreated := back()
	ready := time.Now()
	t.Logf("plugin away %.1f s; Ready %.1f s after its DaemonSet was created again", ready.Sub(gone).Seconds(), ready.Sub(recreated).Seconds())

	var after []string
	stamped := 0
	for _, name := range names {
		p := waitRunning(t, ns, name, 3*time.Minute)
		started := ready
		for _, c := range p.Status.Conditions {
			if c.Type == v1.PodReady {
				started = c.LastTransitionTime.Time
			}
		}
		after = append(after, fmt.Sprintf("%s %.1f s", name, started.Sub(ready).Seconds()))
		if p.Annotations[prepareRetryAnnotation] != "" {
			stamped++
		}
	}
	sort.Strings(after)
	t.Logf("Ready after the plugin was Ready (pod conditions have 1 s resolution): %s (%d of %d stamped %s)", strings.Join(after, ", "), stamped, len(names), prepareRetryAnnotation)
	if stamped == 0 {
		t.Errorf("no pod whose prepare failed while the plugin was away carries %s: the plugin did not ask kubelet to retry", prepareRetryAnnotation)
	}
}
