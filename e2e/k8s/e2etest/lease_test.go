package e2etest

// The per-node Lease heartbeat (api/src/heartbeat.rs): every plugin renews tessera-node-<node> in the lease
// namespace, and once the leading controller says it reads those Leases the plugin stops rewriting its
// ~23 KB NodeInventory every beat. Read the way a user would, with kubectl.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

const (
	// The plugin's default heartbeat interval, which up.sh and the chart keep.
	pluginHeartbeatInterval = 10 * time.Second
	// How often a plugin reads the leader Lease to learn whether the leader reads node Leases.
	leaderLeaseReadInterval = 20 * time.Second
	nodeLeaseLabel          = "gpu.tessera.dev/heartbeat=node"
	readsNodeLeases         = "gpu.tessera.dev/reads-node-leases"
	leaderLeaseName         = "tessera-controller"
	// The host controller's --heartbeat-timeout (its default): a pool whose node renewed neither heartbeat
	// for this long is withdrawn.
	controllerHeartbeatTimeout = 40 * time.Second
)

// kubectlGet runs `kubectl get ARGS -o json` with the admin kubeconfig and decodes what it prints into out.
func kubectlGet(t *testing.T, out any, args ...string) error {
	t.Helper()
	kubectl := filepath.Join(getenv("E2E_BIN_DIR", filepath.Join(e.repoRoot, "e2e", "bin")), "kubectl")
	ctx := ctxFor(t, 30*time.Second)
	full := append(append([]string{"--kubeconfig", filepath.Join(e.runDir, "pki", "admin.kubeconfig"), "get"}, args...), "-o", "json")
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, kubectl, full...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("kubectl get %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return json.Unmarshal(stdout.Bytes(), out)
}

// nodeLease is `kubectl get lease -n <lease namespace> tessera-node-<node>`.
func nodeLease(t *testing.T, ns, node string) (*coordinationv1.Lease, error) {
	t.Helper()
	var l coordinationv1.Lease
	if err := kubectlGet(t, &l, "lease", "-n", ns, "tessera-node-"+node); err != nil {
		return nil, err
	}
	return &l, nil
}

func renewTime(l *coordinationv1.Lease) time.Time {
	if l == nil || l.Spec.RenewTime == nil {
		return time.Time{}
	}
	return l.Spec.RenewTime.Time
}

// checkNodeLease asserts what the plugin on `node` writes into its Lease: itself as holder, four intervals
// long, labelled for the controller's watch, owned by the Node (so it goes with the Node).
func checkNodeLease(t *testing.T, l *coordinationv1.Lease, node string) {
	t.Helper()
	if got := ptr.Deref(l.Spec.HolderIdentity, ""); got != node {
		t.Errorf("Lease %s: holderIdentity %q, want the node %s", l.Name, got, node)
	}
	if got, want := ptr.Deref(l.Spec.LeaseDurationSeconds, 0), int32(4*pluginHeartbeatInterval/time.Second); got != want {
		t.Errorf("Lease %s: leaseDurationSeconds %d, want %d (4 heartbeat intervals)", l.Name, got, want)
	}
	if l.Labels["gpu.tessera.dev/heartbeat"] != "node" {
		t.Errorf("Lease %s: labels %v, want %s", l.Name, l.Labels, nodeLeaseLabel)
	}
	owned := false
	for _, o := range l.OwnerReferences {
		owned = owned || (o.Kind == "Node" && o.Name == node && o.UID != "")
	}
	if !owned {
		t.Errorf("Lease %s: ownerReferences %+v, want the Node %s", l.Name, l.OwnerReferences, node)
	}
}

// waitLeaseRenewed waits for `kubectl get lease` to show the node's Lease renewed after `since`.
func waitLeaseRenewed(t *testing.T, ns, node string, since time.Time) *coordinationv1.Lease {
	t.Helper()
	var l *coordinationv1.Lease
	waitFor(t, "Lease tessera-node-"+node+" renewed after "+since.Format(time.RFC3339Nano), 2*pluginHeartbeatInterval+10*time.Second,
		func(context.Context) (bool, string) {
			got, err := nodeLease(t, ns, node)
			if err != nil {
				return false, err.Error()
			}
			l = got
			return renewTime(got).After(since), "renewTime " + renewTime(got).Format(time.RFC3339Nano)
		})
	return l
}

// waitLeaderReadsNodeLeases waits until the controller's leader Lease names its current holder as one that
// reads node Leases.
func waitLeaderReadsNodeLeases(t *testing.T, ns string) {
	t.Helper()
	waitFor(t, "the leader Lease "+leaderLeaseName+" says its holder reads node Leases", time.Minute, func(context.Context) (bool, string) {
		var l coordinationv1.Lease
		if err := kubectlGet(t, &l, "lease", "-n", ns, leaderLeaseName); err != nil {
			return false, err.Error()
		}
		holder := ptr.Deref(l.Spec.HolderIdentity, "")
		return holder != "" && l.Annotations[readsNodeLeases] == holder,
			fmt.Sprintf("holder %q, %s=%q", holder, readsNodeLeases, l.Annotations[readsNodeLeases])
	})
}

// inventoryVersion is the NodeInventory's resourceVersion: any write, status included, changes it.
func inventoryVersion(t *testing.T, node string) string {
	t.Helper()
	var inv metav1.PartialObjectMetadata
	if err := kubectlGet(t, &inv, "nodeinventories.gpu.tessera.dev", node); err != nil {
		t.Fatal(err)
	}
	return inv.ResourceVersion
}

// checkInventoryLeftAloneWhileTheLeaseRenews watches the node for two heartbeat intervals at a time: its
// Lease must be renewed in each interval while its NodeInventory's resourceVersion stays the same. A
// plugin learns that the leader reads node Leases on its next read of the leader Lease (at most
// leaderLeaseReadInterval later), and until then it still rewrites the status; so a window with a write
// is retried until that read is surely behind it.
func checkInventoryLeftAloneWhileTheLeaseRenews(t *testing.T, ns, node string) {
	t.Helper()
	deadline := time.Now().Add(leaderLeaseReadInterval + 2*pluginHeartbeatInterval + 3*2*pluginHeartbeatInterval)
	for {
		rv := inventoryVersion(t, node)
		l, err := nodeLease(t, ns, node)
		if err != nil {
			t.Fatal(err)
		}
		renewals := []time.Time{renewTime(l)}
		for range 2 {
			l = waitLeaseRenewed(t, ns, node, renewals[len(renewals)-1])
			renewals = append(renewals, renewTime(l))
		}
		after := inventoryVersion(t, node)
		if after == rv {
			t.Logf("%s: NodeInventory resourceVersion %s across Lease renewals %v", node, rv, renewals)
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: the NodeInventory was rewritten (resourceVersion %s → %s) while its Lease renewed at %v, "+
				"long after the plugin must have read that the leader reads node Leases", node, rv, after, renewals)
		}
		t.Logf("%s: NodeInventory still rewritten (resourceVersion %s → %s); the plugin may not have read the leader Lease yet", node, rv, after)
	}
}

func TestEachPluginRenewsItsNodesLeaseAndLeavesItsInventoryAloneOnceTheLeaderReadsLeases(t *testing.T) {
	t.Run("kubectl lists a Lease per node, held by the node, owned by its Node, and renewed", func(t *testing.T) {
		var list coordinationv1.LeaseList
		if err := kubectlGet(t, &list, "lease", "-n", leaseNamespace, "-l", nodeLeaseLabel); err != nil {
			t.Fatal(err)
		}
		listed := map[string]bool{}
		for _, l := range list.Items {
			listed[l.Name] = true
		}
		for _, node := range e.nodes {
			if !listed["tessera-node-"+node] {
				t.Errorf("kubectl get lease -n %s -l %s lists %v, not tessera-node-%s", leaseNamespace, nodeLeaseLabel, keysOf(listed), node)
				continue
			}
			l, err := nodeLease(t, leaseNamespace, node)
			if err != nil {
				t.Fatal(err)
			}
			checkNodeLease(t, l, node)
			waitLeaseRenewed(t, leaseNamespace, node, renewTime(l))
		}
	})
	t.Run("with the leader reading node Leases, the inventories stay unwritten across two heartbeats while the Leases renew", func(t *testing.T) {
		waitLeaderReadsNodeLeases(t, leaseNamespace)
		for _, node := range e.nodes {
			checkInventoryLeftAloneWhileTheLeaseRenews(t, leaseNamespace, node)
		}
	})
	t.Run("past the controller's heartbeat timeout with only Lease renewals, every node's GPUs stay published", func(t *testing.T) {
		published := map[string]int{}
		for _, node := range e.nodes {
			published[node] = countDevices(t, node, wholeGPUName)
		}
		for _, node := range e.nodes {
			waitFor(t, node+"'s inventory heartbeat older than the controller's timeout", controllerHeartbeatTimeout+2*leaderLeaseReadInterval,
				func(context.Context) (bool, string) {
					hb, _ := heartbeat(t, node)
					ts, err := time.Parse(time.RFC3339, hb)
					return err == nil && time.Since(ts) > controllerHeartbeatTimeout+pluginHeartbeatInterval, "lastHeartbeatTime " + hb
				})
		}
		for _, node := range e.nodes {
			if got := countDevices(t, node, wholeGPUName); got == 0 || got != published[node] {
				t.Errorf("%s: %d whole GPUs published, %d before its inventory heartbeat went stale: the controller does not count its Lease renewals",
					node, got, published[node])
			}
			if renewed := nodeLeaseRenewed(ctxFor(t, 30*time.Second), node); time.Since(renewed) > 2*pluginHeartbeatInterval {
				t.Errorf("%s: Lease last renewed %s ago; the plugin stopped heartbeating", node, time.Since(renewed).Round(time.Second))
			}
		}
	})
}

func keysOf(m map[string]bool) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}
