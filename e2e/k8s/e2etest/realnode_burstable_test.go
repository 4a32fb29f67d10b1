package e2etest

// Issue 39 item 1: burstable shares on the real node. Two shares of one GPU from the example template
// deployments/examples/burstable-share (25 % of the compute packed, a 75 % ceiling). The check container's
// environment carries the ceiling as CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; the CUDA probe of each share (the
// simulated libcuda's `cuda.sm_share` line) sees its ceiling while it is the GPU's only busy MPS client, and
// half the GPU once both are busy (their ceilings sum past 100 %, so they compete: the simulated driver's
// SM contention, kubelet-plugin/sim-driver/model/src/contention.rs). "Busy" is each claim's synthetic load
// (`simulate load --claim --mps-client --active-thread-percentage`). The plugin's per-claim gauges show the
// request, the ceiling, and a utilization relative to the request above 1.

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"tessera.dev/e2e/internal/cluster"
)

// burstableTemplate creates the example's ResourceClaimTemplate in ns; its ceiling, in percent.
func burstableTemplate(t *testing.T, ns string) (name string, ceiling int) {
	t.Helper()
	objs, err := cluster.ReadManifests(filepath.Join(e.repoRoot, "deployments", "examples", "burstable-share", "burstable-share.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if o.GetKind() != "ResourceClaimTemplate" {
			continue
		}
		var tmpl resourcev1.ResourceClaimTemplate
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &tmpl); err != nil {
			t.Fatalf("the example's ResourceClaimTemplate: %v", err)
		}
		tmpl.Namespace, tmpl.ResourceVersion = ns, ""
		if _, err := e.client.ResourceV1().ResourceClaimTemplates(ns).Create(ctxFor(t, 30*time.Second), &tmpl, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create the example's ResourceClaimTemplate in %s: %v", ns, err)
		}
		return tmpl.Name, 75
	}
	t.Fatalf("deployments/examples/burstable-share has no ResourceClaimTemplate")
	return "", 0
}

func TestRealNodeBurstableSharesSeeTheirCeilingAloneAndTheirContentionWhenBothAreBusy(t *testing.T) {
	rn := realNode(t)
	installChart(t, rn)
	var plugin v1.Pod
	waitFor(t, "plugin pod Ready on "+rn.name, 3*time.Minute, func(ctx context.Context) (bool, string) {
		pods, err := podsOf(ctx, "kubelet-plugin")
		if err != nil {
			return false, err.Error()
		}
		n, states := readyPods(pods)
		if n == 1 && len(pods) == 1 {
			plugin = pods[0]
		}
		return n == 1 && len(pods) == 1 && pods[0].Status.PodIP != "", strings.Join(states, "; ")
	})
	waitFor(t, "a shared device published on "+rn.name, 2*time.Minute, func(ctx context.Context) (bool, string) {
		n := countDevices(t, rn.name, sharedName)
		return n > 0, fmt.Sprintf("%d shared devices", n)
	})

	ns := namespace(t, "real-node-burstable")
	template, ceiling := burstableTemplate(t, ns)
	names := []string{"burst-a", "burst-b"}
	for _, name := range names {
		w := workloadPod(ns, name, rn.name).withClaimFrom(template)
		w.pod.Spec.Containers[0].Command = []string{"sh", "-c",
			`while true; do echo "sees $(cuda-probe 2>&1 | grep -E '^cuda\.(ctx|sm_share)' | tr '\n' ' ')"; sleep 1; done`}
		w.create(t)
	}
	pods := map[string]*v1.Pod{}
	claims := map[string]string{}
	// The load's process is the container's (its environment names the claim, as the plugin reads it
	// through the host's /proc); --claim tells the simulated driver which contexts are that client's.
	pids := map[string]int{}
	var device string
	for _, name := range names {
		p := waitRunning(t, ns, name, 3*time.Minute)
		claim, devices := realAllocations(t, p)
		if len(devices) != 1 || !sharedName.MatchString(devices[0].Device) {
			t.Fatalf("%s: allocated %v, want one shared device", name, deviceNames(devices))
		}
		if device != "" && devices[0].Device != device {
			t.Fatalf("the shares are on %s and %s, want both on one shared GPU", device, devices[0].Device)
		}
		device = devices[0].Device
		pods[name], claims[name] = p, claim.Name
		pids[name] = rn.containerPID(t, p, "hold")
		if got := insideView(t, p).env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]; got != fmt.Sprint(ceiling) {
			t.Fatalf("%s: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%q, want the ceiling %d (the request is 25)", name, got, ceiling)
		}
	}

	loads := realNodeLoads(t, rn)
	busy := func(name string) {
		t.Helper()
		out, err := exec.Command(loads.bin, "simulate", "--state-dir", rn.stateDir, "load", "--device", device,
			"--claim", ns+"/"+claims[name], "--pid", fmt.Sprint(pids[name]), "--util", fmt.Sprint(ceiling), "--memory", "1Gi", "--mps-client",
			"--mps-server-pid", fmt.Sprint(loads.mpsServer), "--active-thread-percentage", fmt.Sprint(ceiling)).CombinedOutput()
		if err != nil {
			t.Fatalf("simulate load for %s: %v\n%s", name, err, out)
		}
	}
	sees := func(name, want string) {
		t.Helper()
		waitFor(t, name+"'s probe sees "+want, time.Minute, func(context.Context) (bool, string) {
			r, _ := rn.lastReport(t, pods[name])
			return strings.Contains(r, want), r
		})
	}

	// One busy share: its kernels get its ceiling of the SMs; the gauges read 0.75 of the GPU on a 0.25
	// request, 3 times what it reserved.
	busy("burst-a")
	sees("burst-a", "cuda.sm_share index=0 rc=0 share=0.750 busy=1")
	target := fmt.Sprintf("http://%s:8081/metrics", plugin.Status.PodIP)
	want := map[string]float64{
		"tessera_claim_gpu_compute_request_ratio":     0.25,
		"tessera_claim_gpu_compute_ceiling_ratio":     0.75,
		"tessera_claim_gpu_request_utilization_ratio": 3,
	}
	waitFor(t, "the plugin's gauges of burst-a's claim", 90*time.Second, func(context.Context) (bool, string) {
		var got []string
		ok := true
		for metric, w := range want {
			r := promcheck(t, []string{target}, fmt.Sprintf("%s{claim=%q}", metric, claims["burst-a"]))
			if len(r.Result) != 1 || r.Result[0].Value < w-0.001 || r.Result[0].Value > w+0.001 {
				ok = false
			}
			got = append(got, fmt.Sprintf("%s=%+v", metric, r.Result))
		}
		return ok, strings.Join(got, " ")
	})

	// Both busy: their ceilings sum to 150 %, so they share the GPU, half each.
	busy("burst-b")
	for _, name := range names {
		sees(name, "cuda.sm_share index=0 rc=0 share=0.500 busy=2")
	}
}
