package e2etest

// Issue 22 item 6: a share's usage gauges under the chart, whose plugin pod has no hostPID. NVML (here the
// simulated driver's libnvidia-ml, which reports the synthetic per-process load of `simulate load --pid`)
// names host PIDs; the plugin must find each process's pod through the host's /proc the chart mounts at
// /host/proc, and its claim through the claim's reservedFor. Two share pods on one GPU, each with its own
// load on its container's real host PID: each claim's gauge must read its own process, not the other's.
// One of the two processes has an empty environment, so its claim is found through its cgroup alone.
//
// Issue 38 (defect N7): the shares are MPS shares, so each process is registered as an MPS client
// (`simulate load --mps-client`), as a real driver lists it: only in nvmlDeviceGetMPSComputeRunningProcesses,
// with its MPS server in the compute list. The server stands as the MPS supervisor container's process
// (`--mps-server-pid`), in the supervisor's pod, which no claim holds: the gauges must read the clients'
// load exactly, the server's (the sum of its clients') charged to neither. A plugin that reads the compute
// list alone reads 0 for both.

import (
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
)

// containerPID is the host PID of a running container's first process, as containerd reports it
// (`crictl inspect`): found without anything of tessera's.
func (rn realNodeEnv) containerPID(t *testing.T, p *v1.Pod, container string) int {
	t.Helper()
	var id string
	for _, s := range p.Status.ContainerStatuses {
		if s.Name == container {
			id = strings.TrimPrefix(s.ContainerID, "containerd://")
		}
	}
	if id == "" {
		t.Fatalf("pod %s has no container %s in its status: %+v", p.Name, container, p.Status.ContainerStatuses)
	}
	crictl := filepath.Join(getenv("NODE_BIN_DIR", filepath.Join(e.repoRoot, "e2e", "bin", "node")), "crictl")
	out, err := exec.Command(crictl, "--runtime-endpoint", "unix://"+filepath.Join(rn.dir, "containerd", "containerd.sock"),
		"--timeout", "20s", "inspect", id).Output()
	if err != nil {
		t.Fatalf("crictl inspect %s: %v", id, err)
	}
	var inspect struct {
		Info struct {
			PID int `json:"pid"`
		} `json:"info"`
	}
	if err := json.Unmarshal(out, &inspect); err != nil || inspect.Info.PID == 0 {
		t.Fatalf("crictl inspect %s: no pid (%v)\n%s", id, err, out)
	}
	return inspect.Info.PID
}

// processLoads gives the real node's processes synthetic GPU load (`tessera-kubelet-plugin simulate load
// --pid`), which the simulated driver's NVML reports for that host PID as a real driver reports a CUDA
// process's SM use and memory.
type processLoads struct {
	rn  realNodeEnv
	bin string
	// mpsServer is the host PID standing for the MPS server of every share: the MPS supervisor container's
	// first process (see mpsSupervisorPID).
	mpsServer int
}

// realNodeLoads is the real node's load setter; every load it set is cleared when the test ends.
func realNodeLoads(t *testing.T, rn realNodeEnv) processLoads {
	t.Helper()
	bin, _ := pluginLaunch(t, e.nodes[0])
	l := processLoads{rn: rn, bin: bin, mpsServer: rn.mpsSupervisorPID(t)}
	t.Cleanup(l.clear)
	return l
}

// mpsSupervisorPID is the host PID of the MPS supervisor container's first process. A real MPS server is
// the child of a control daemon the supervisor runs, so it is in the supervisor pod's cgroup; this process
// is too, and stands for it (the share pods here run no CUDA, so no simulated server starts).
func (rn realNodeEnv) mpsSupervisorPID(t *testing.T) int {
	t.Helper()
	var supervisor v1.Pod
	waitFor(t, "the MPS supervisor pod Ready on "+rn.name, 3*time.Minute, func(ctx context.Context) (bool, string) {
		pods, err := podsOf(ctx, "mps-supervisor")
		if err != nil {
			return false, err.Error()
		}
		n, states := readyPods(pods)
		if n == 1 && len(pods) == 1 {
			supervisor = pods[0]
		}
		return n == 1 && len(pods) == 1, strings.Join(states, "; ")
	})
	return rn.containerPID(t, &supervisor, "mps-supervisor")
}

// set makes the process pid on device use percent of the whole GPU and memory. On a share it is an MPS
// client (every share of these tests is one: MPS is the default strategy and no test that sets load
// configures another), listed as a real driver lists one (defect N7): only in the MPS process list, with
// the supervisor's process as its server in the compute list.
func (l processLoads) set(t *testing.T, device string, pid, percent int, memory string) {
	t.Helper()
	args := []string{"simulate", "--state-dir", l.rn.stateDir, "load", "--device", device,
		"--pid", fmt.Sprint(pid), "--util", fmt.Sprint(percent), "--memory", memory}
	if sharedName.MatchString(device) {
		args = append(args, "--mps-client", "--mps-server-pid", fmt.Sprint(l.mpsServer))
	}
	out, err := exec.Command(l.bin, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("simulate load on %s for pid %d: %v\n%s", device, pid, err, out)
	}
}

// clear removes every load.
func (l processLoads) clear() {
	_ = exec.Command(l.bin, "simulate", "--state-dir", l.rn.stateDir, "load", "--clear").Run()
}

func TestRealNodeShareUsageGaugesFindEachClaimsProcessesThroughTheHostProcWithoutHostPID(t *testing.T) {
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
	if plugin.Spec.HostPID {
		t.Fatalf("the chart's plugin pod runs with hostPID; this scenario is about doing without it")
	}
	hostProc := false
	for _, v := range plugin.Spec.Volumes {
		hostProc = hostProc || (v.HostPath != nil && v.HostPath.Path == "/proc")
	}
	if !hostProc {
		t.Fatalf("the chart's plugin pod does not mount the host's /proc (kubeletPlugin.hostProc)")
	}
	waitFor(t, "a shared device published on "+rn.name, 2*time.Minute, func(ctx context.Context) (bool, string) {
		n := countDevices(t, rn.name, sharedName)
		return n > 0, fmt.Sprintf("%d shared devices", n)
	})

	ns := namespace(t, "real-node-usage")
	claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "10Gi", "compute": "25"}))
	type share struct {
		pod    *v1.Pod
		claim  string
		device string
		pid    int
	}
	shares := map[string]*share{}
	workloadPod(ns, "share-a", rn.name).withClaimFrom("share").create(t)
	// share-b's process drops its environment (TESSERA_CLAIM, TESSERA_DEVICE): only its cgroup, which names
	// its pod, can tell whose it is. share-a's environment is readable to the privileged nvml plugin.
	b := workloadPod(ns, "share-b", rn.name).withClaimFrom("share")
	b.pod.Spec.Containers[0].Command = []string{"sh", "-c", "exec env -i sleep 3600"}
	b.create(t)
	for _, name := range []string{"share-a", "share-b"} {
		p := waitRunning(t, ns, name, 3*time.Minute)
		claim, devices := realAllocations(t, p)
		if len(devices) != 1 || !sharedName.MatchString(devices[0].Device) {
			t.Fatalf("%s: allocated %v, want one shared device", name, deviceNames(devices))
		}
		shares[name] = &share{pod: p, claim: claim.Name, device: devices[0].Device, pid: rn.containerPID(t, p, "hold")}
	}
	if shares["share-a"].device != shares["share-b"].device {
		t.Logf("the two shares are on different devices (%s, %s); each gauge is still its own process's", shares["share-a"].device, shares["share-b"].device)
	}

	loads := realNodeLoads(t, rn)
	setLoad := func(s *share, util int, memory string) {
		t.Helper()
		loads.set(t, s.device, s.pid, util, memory)
	}
	// No --claim: only the host PID says whose load it is.
	setLoad(shares["share-a"], 40, "3Gi")
	setLoad(shares["share-b"], 15, "1Gi")

	target := fmt.Sprintf("http://%s:8081/metrics", plugin.Status.PodIP)
	want := map[string][2]float64{
		shares["share-a"].claim: {0.40, 3 << 30},
		shares["share-b"].claim: {0.15, 1 << 30},
	}
	got := map[string][2]float64{}
	start := time.Now()
	waitFor(t, "the plugin pod's /metrics give each share its own process's load", 90*time.Second, func(context.Context) (bool, string) {
		got = map[string][2]float64{}
		for i, metric := range []string{"tessera_claim_gpu_utilization_ratio", "tessera_claim_gpu_memory_used_bytes"} {
			r := promcheck(t, []string{target}, fmt.Sprintf("%s{namespace=%q}", metric, ns))
			for _, s := range r.Result {
				v := got[s.Metric["claim"]]
				v[i] = s.Value
				got[s.Metric["claim"]] = v
			}
		}
		for claim, w := range want {
			if g := got[claim]; g[0] < w[0]-0.001 || g[0] > w[0]+0.001 || g[1] != w[1] {
				return false, fmt.Sprintf("scraped %v, want %v", got, want)
			}
		}
		return true, ""
	})
	t.Logf("share gauges through the plugin pod (no hostPID): %v, %s after the loads were set", got, time.Since(start).Round(100*time.Millisecond))

	// The pod label is the claim's reservedFor pod, the gauge's other half an autoscaler selects by.
	r := promcheck(t, []string{target}, fmt.Sprintf("tessera_claim_gpu_utilization_ratio{claim=%q}", shares["share-a"].claim))
	if len(r.Result) != 1 || r.Result[0].Metric["pod"] != "share-a" {
		t.Errorf("share-a's gauge: %+v, want one series with pod=share-a", r.Result)
	}

	// The control: the same chart without the host's /proc (kubeletPlugin.hostProc=false, the chart before
	// issue 22) reads 0 for both, the loads unchanged: the plugin's own /proc is another PID namespace.
	helmRun(t, append([]string{"upgrade", "tessera", chartDir(), "--namespace", chartNamespace},
		helmSetArgs(rn.chartValues("kubeletPlugin.hostProc=false"))...)...)
	waitPluginPodReplaced(t, "the plugin pod without the host's /proc", plugin.Name, 3*time.Minute)
	pods, err := podsOf(ctxFor(t, 30*time.Second), "kubelet-plugin")
	if err != nil || len(pods) != 1 || pods[0].Status.PodIP == "" {
		t.Fatalf("the new plugin pod: %v %+v", err, pods)
	}
	blind := fmt.Sprintf("http://%s:8081/metrics", pods[0].Status.PodIP)
	waitFor(t, "the new plugin pod's /metrics list both shares", time.Minute, func(context.Context) (bool, string) {
		r := promcheck(t, []string{blind}, fmt.Sprintf("tessera_claim_gpu_utilization_ratio{namespace=%q}", ns))
		if len(r.Result) != 2 {
			return false, fmt.Sprintf("%d series", len(r.Result))
		}
		for _, s := range r.Result {
			if s.Value != 0 {
				t.Errorf("without the host's /proc, claim %s reads %v: the gauge is not coming from the host PID lookup", s.Metric["claim"], s.Value)
			}
		}
		return true, ""
	})
	t.Logf("without the host's /proc both share gauges read 0, as the chart did before")
}
