package e2etest

// Issue 22 item 5: tessera next to another GPU manager on the same node. On two stand-in nodes (their
// plugins are host processes over the simulated backend, restarted with proc.sh): one whose Node shows a
// device plugin's nvidia.com/gpu allocatable, one labelled nvidia.com/mig.config (mig-manager owns the MIG
// layout) with a MIG device made outside tessera. What a user sees is checked: the NodeInventory's
// Coexistence condition in `kubectl get`, the published devices, a pod that is (not) scheduled, and the
// MIG device in the simulated hardware state across plugin restarts.

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// coexistence is the Coexistence condition of a node's inventory and the GPUs its spec publishes.
type coexistence struct {
	status, reason, message string
	gpus                    []struct {
		Index int             `json:"index"`
		Mig   json.RawMessage `json:"mig"`
	}
}

func coexistenceOf(ctx context.Context, node string) (coexistence, error) {
	u, err := e.dyn.Resource(inventoryGVR).Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return coexistence{}, err
	}
	var inv struct {
		Spec struct {
			GPUs []struct {
				Index int             `json:"index"`
				Mig   json.RawMessage `json:"mig"`
			} `json:"gpus"`
		} `json:"spec"`
		Status struct {
			Conditions []struct {
				Type, Status, Reason, Message string
			} `json:"conditions"`
		} `json:"status"`
	}
	data, _ := json.Marshal(u.Object)
	if err := json.Unmarshal(data, &inv); err != nil {
		return coexistence{}, err
	}
	c := coexistence{gpus: inv.Spec.GPUs}
	for _, cond := range inv.Status.Conditions {
		if cond.Type == "Coexistence" {
			c.status, c.reason, c.message = cond.Status, cond.Reason, cond.Message
		}
	}
	return c, nil
}

// waitCoexistence waits for the node's Coexistence condition to have reason.
func waitCoexistence(t *testing.T, node, reason string) coexistence {
	t.Helper()
	var c coexistence
	waitFor(t, fmt.Sprintf("NodeInventory %s: Coexistence %s", node, reason), 90*time.Second, func(ctx context.Context) (bool, string) {
		var err error
		c, err = coexistenceOf(ctx, node)
		if err != nil {
			return false, err.Error()
		}
		return c.reason == reason, fmt.Sprintf("%s %s: %s", c.status, c.reason, c.message)
	})
	return c
}

// kubectlTable is `kubectl get <args>` as a user runs it, with the cluster's admin kubeconfig.
func kubectlTable(t *testing.T, args ...string) string {
	t.Helper()
	args = append([]string{"--kubeconfig", filepath.Join(e.runDir, "pki", "admin.kubeconfig"), "get"}, args...)
	out, err := exec.Command(filepath.Join(getenv("E2E_BIN_DIR", filepath.Join(e.repoRoot, "e2e", "bin")), "kubectl"), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// patchNode merge-patches a Node, or its status with subresource "status".
func patchNode(t *testing.T, node, patch string, subresource ...string) {
	t.Helper()
	if _, err := e.client.CoreV1().Nodes().Patch(ctxFor(t, 30*time.Second), node, types.MergePatchType, []byte(patch), metav1.PatchOptions{}, subresource...); err != nil {
		t.Fatalf("patch node %s with %s: %v", node, patch, err)
	}
}

func restartStandInPlugin(t *testing.T, node string) {
	t.Helper()
	proc(t, "restart", "plugin-"+node)
}

var anyDevice = regexp.MustCompile(`.`)

func TestCoexistenceWithADevicePluginOrAMigManagerNeverHandsAGPUOutTwiceNorDestroysTheirMigLayout(t *testing.T) {
	if len(e.nodes) < 2 {
		t.Fatalf("needs two stand-in nodes, the cluster has %v", e.nodes)
	}

	t.Run("a node whose device plugin advertises nvidia.com/gpu publishes no devices until the plugin is gone", func(t *testing.T) {
		node := e.nodes[0]
		ns := namespace(t, "e2e-coexist-dp")
		class := gpuClass(t)
		if before := countDevices(t, node, anyDevice); before == 0 {
			t.Fatalf("%s publishes no devices before the device plugin appears", node)
		}
		// What NVIDIA's device plugin makes kubelet report (kubelet keeps extended resources in the status;
		// the stand-in kubelet never rewrites it).
		patchNode(t, node, `{"status":{"capacity":{"nvidia.com/gpu":"8"},"allocatable":{"nvidia.com/gpu":"8"}}}`, "status")
		t.Cleanup(func() {
			patchNode(t, node, `{"status":{"capacity":{"nvidia.com/gpu":null},"allocatable":{"nvidia.com/gpu":null}}}`, "status")
			restartStandInPlugin(t, node)
			waitCoexistence(t, node, "NoOtherGPUManager")
		})
		restartStandInPlugin(t, node)

		c := waitCoexistence(t, node, "DevicePluginAdvertisesGPUs")
		if c.status != "False" || !strings.Contains(c.message, "nvidia.com/gpu: 8") || !strings.Contains(c.message, "devicePlugin.enabled=false") {
			t.Errorf("condition %s %s: %q, want False naming the resource and the fix", c.status, c.reason, c.message)
		}
		if len(c.gpus) != 0 {
			t.Errorf("the inventory still publishes %d GPUs next to the device plugin", len(c.gpus))
		}
		out := kubectlTable(t, "nodeinventory", node)
		if !strings.Contains(out, "COEXISTENCE") || !strings.Contains(out, "DevicePluginAdvertisesGPUs") {
			t.Errorf("kubectl get nodeinventory %s does not show the condition:\n%s", node, out)
		}
		t.Logf("kubectl get nodeinventory %s:\n%s", node, out)
		waitFor(t, "the controller withdraws "+node+"'s devices", time.Minute, func(ctx context.Context) (bool, string) {
			n := countDevices(t, node, anyDevice)
			return n == 0, fmt.Sprintf("%d devices published", n)
		})

		// A claim on this node cannot get a GPU the device plugin may hand out too.
		tmpl := claimTemplate(t, ns, "one-gpu", class)
		pod(t, ns, "held", tmpl, node)
		time.Sleep(15 * time.Second)
		p, err := e.client.CoreV1().Pods(ns).Get(ctxFor(t, 30*time.Second), "held", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if p.Spec.NodeName != "" || p.Status.Phase != v1.PodPending {
			t.Errorf("pod %s was scheduled onto %q (%s) while the device plugin advertises the node's GPUs", p.Name, p.Spec.NodeName, p.Status.Phase)
		}

		// Device plugin gone (GPU Operator: devicePlugin.enabled=false): the same pod runs.
		patchNode(t, node, `{"status":{"capacity":{"nvidia.com/gpu":null},"allocatable":{"nvidia.com/gpu":null}}}`, "status")
		restartStandInPlugin(t, node)
		if c := waitCoexistence(t, node, "NoOtherGPUManager"); c.status != "True" || len(c.gpus) == 0 {
			t.Errorf("without the device plugin: condition %s, %d GPUs published", c.status, len(c.gpus))
		}
		waitRunning(t, ns, "held", 2*time.Minute)
	})

	t.Run("a mig-manager node keeps its MIG layout across plugin restarts and offers no MIG devices", func(t *testing.T) {
		node := e.nodes[1]
		bin, _ := pluginLaunch(t, node)
		stateDir := filepath.Join(e.runDir, "nodes", node, "plugin-state")
		inv, err := coexistenceOf(ctxFor(t, 30*time.Second), node)
		if err != nil {
			t.Fatal(err)
		}
		if len(inv.gpus) == 0 || len(inv.gpus[0].Mig) == 0 {
			t.Fatalf("%s publishes no MIG-capable GPU 0: %+v", node, inv.gpus)
		}
		// mig-manager's part: the label, then a layout it applies (here: one 1g.10gb device on GPU 0, made
		// as `nvidia-smi mig -cgi 1g.10gb -C` would, not by tessera).
		patchNode(t, node, `{"metadata":{"labels":{"nvidia.com/mig.config":"custom-1g"}}}`)
		t.Cleanup(func() {
			patchNode(t, node, `{"metadata":{"labels":{"nvidia.com/mig.config":null}}}`)
			restartStandInPlugin(t, node)
			waitCoexistence(t, node, "NoOtherGPUManager")
		})
		out, err := exec.Command(bin, "simulate", "--state-dir", stateDir, "create-mig", "--gpu", "0", "--profile", "1g.10gb", "--start", "0").CombinedOutput()
		if err != nil {
			t.Fatalf("simulate create-mig: %v\n%s", err, out)
		}
		theirs, ok := simulatedGPUInstance(t, node, 0, 0)
		if !ok || len(theirs.ComputeInstances) != 1 {
			t.Fatalf("the out-of-band MIG device is not in the hardware state: %s", out)
		}

		for round := 1; round <= 2; round++ {
			after := time.Now()
			restartStandInPlugin(t, node)
			// The new process runs its start-up clean-up before it publishes a ready status.
			waitFreshHeartbeat(t, node, after, time.Minute)
			c := waitCoexistence(t, node, "MigLayoutOwnedByMigManager")
			gi, ok := simulatedGPUInstance(t, node, 0, 0)
			if !ok || gi.ID != theirs.ID || len(gi.ComputeInstances) != 1 || gi.ComputeInstances[0].UUID != theirs.ComputeInstances[0].UUID {
				t.Fatalf("restart %d: mig-manager's MIG device (GI %d, %s) is gone or replaced: %+v", round, theirs.ID, theirs.ComputeInstances[0].UUID, gi)
			}
			for _, g := range c.gpus {
				if g.Index == 0 {
					t.Errorf("restart %d: GPU 0, in mig-manager's MIG mode, is published", round)
				}
				if len(g.Mig) != 0 && string(g.Mig) != "null" {
					t.Errorf("restart %d: GPU %d is published MIG-capable; tessera would make MIG devices on mig-manager's GPUs", round, g.Index)
				}
			}
			if len(c.gpus) == 0 {
				t.Errorf("restart %d: no GPU published; the GPUs out of MIG mode should be", round)
			}
			if !strings.Contains(c.message, "nvidia.com/mig.config=custom-1g") {
				t.Errorf("condition message %q does not name the label", c.message)
			}
			t.Logf("restart %d: the MIG device survives (GI %d, %s); condition %s %s", round, gi.ID, gi.ComputeInstances[0].UUID, c.status, c.reason)
		}
		if n := countDevices(t, node, regexp.MustCompile(`-mig-`)); n != 0 {
			t.Errorf("%d MIG devices of tessera's still published on a mig-manager node", n)
		}
		t.Logf("kubectl get nodeinventory %s:\n%s", node, kubectlTable(t, "nodeinventory", node))

		// Without the label the layout is tessera's again, and its start-up removes what no claim holds:
		// what the label prevented.
		patchNode(t, node, `{"metadata":{"labels":{"nvidia.com/mig.config":null}}}`)
		restartStandInPlugin(t, node)
		waitCoexistence(t, node, "NoOtherGPUManager")
		waitFor(t, "tessera's start-up removes the unowned MIG device once no label protects it", time.Minute, func(ctx context.Context) (bool, string) {
			_, ok := simulatedGPUInstance(t, node, 0, 0)
			return !ok, "the GPU instance at slice 0 is still there"
		})
	})
}
