package e2etest

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	"k8s.io/utils/ptr"
)

// pluginPod is one instance of a node's plugin started as a DaemonSet pod would run it during a roll:
// the node's launch command plus a pod UID (per-pod socket names) and a readiness endpoint.
type pluginPod struct {
	name   string
	uid    string
	health string
}

// startPluginPod runs e2e/scripts/plugin-pod.sh; the process stops with the test, like a pod with its node.
func startPluginPod(t *testing.T, node, name, uid string) pluginPod {
	t.Helper()
	p := pluginPod{name: name, uid: uid, health: fmt.Sprintf("127.0.0.1:%d", freePort(t))}
	port := strings.TrimPrefix(p.health, "127.0.0.1:")
	cmd := exec.Command(filepath.Join(e.repoRoot, "e2e", "scripts", "plugin-pod.sh"), "start", node, name, uid, port)
	cmd.Env = append(os.Environ(), "RUN_DIR="+e.runDir)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("plugin-pod.sh start %s: %v\n%s", name, err, out)
	}
	t.Cleanup(func() {
		if procAlive(name) {
			proc(t, "stop", name)
		}
	})
	return p
}

// waitReady polls GET /readyz as the DaemonSet controller's view of readiness does: the plugin is ready
// once kubelet (here the stand-in's copy of kubelet's plugin manager) has registered it.
func (p pluginPod) waitReady(t *testing.T) {
	t.Helper()
	ctx := ctxFor(t, 70*time.Second)
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		resp, err := http.Get("http://" + p.health + "/readyz")
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
	if err != nil {
		t.Fatalf("plugin %s never became ready (registered by kubelet); see %s", p.name, filepath.Join(e.runDir, "logs", p.name+".log"))
	}
}

// draSockets lists the node's per-pod DRA sockets (the name is the plugin's to choose, short enough for
// a unix socket path: kubelet learns it from GetInfo).
func draSockets(t *testing.T, node string) []string {
	t.Helper()
	socks, err := filepath.Glob(filepath.Join(nodeDir(node), "plugins", driver, "dra-*.sock"))
	if err != nil {
		t.Fatal(err)
	}
	return socks
}

// prepareAt calls NodePrepareResources for a's claim on the DRA socket sock, as kubelet does after a
// restart of its own, bypassing its claim cache.
func prepareAt(t *testing.T, sock string, a allocation) *drapb.NodePrepareResourceResponse {
	t.Helper()
	conn, err := grpc.NewClient("unix:"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("dial %s: %v", sock, err)
	}
	defer conn.Close()
	resp, err := drapb.NewDRAPluginClient(conn).NodePrepareResources(ctxFor(t, 45*time.Second), &drapb.NodePrepareResourcesRequest{
		Claims: []*drapb.Claim{{Namespace: a.claim.Namespace, Uid: string(a.claim.UID), Name: a.claim.Name}},
	})
	if err != nil {
		t.Fatalf("NodePrepareResources on %s: %v", sock, err)
	}
	return resp.Claims[string(a.claim.UID)]
}

// liveMPSDaemons lists the pids of the node's MPS control daemons that are alive.
func liveMPSDaemons(node string) []int {
	var pids []int
	dirs, _ := filepath.Glob(filepath.Join(nodeDir(node), "plugin-state", "mps", "*", "pipe", "nvidia-cuda-mps-control.pid"))
	for _, f := range dirs {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if pid, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil && syscall.Kill(pid, 0) == nil {
			pids = append(pids, pid)
		}
	}
	sort.Ints(pids)
	return pids
}

func prepareFailures(t *testing.T, ns string) []string {
	t.Helper()
	evs, err := e.client.CoreV1().Events(ns).List(ctxFor(t, 30*time.Second), metav1.ListOptions{FieldSelector: "reason=FailedPrepareDynamicResources"})
	if err != nil {
		t.Fatalf("list events: %v", err)
	}
	var out []string
	for _, ev := range evs.Items {
		out = append(out, ev.InvolvedObject.Name+": "+ev.Message)
	}
	return out
}

// A rolling update of the plugin DaemonSet with maxSurge 1, as the chart configures it, on a node whose
// kubelet is the stand-in running kubelet's own plugin manager and DRA manager: the new pod starts beside
// the old one while pods with claims keep arriving, becomes ready once kubelet registered it, then the
// old pod gets SIGTERM. Every pod runs, no prepare fails, the running pods keep their devices and MPS
// daemon, and the new instance unprepares the claims the old one prepared.
func TestSurgeRollOfThePluginFailsNoPrepareAndKeepsRunningPodsDevices(t *testing.T) {
	ns := namespace(t, "e2e-surge")
	node := e.nodes[0]
	claimTemplate(t, ns, "whole", gpuClass(t))
	claimTemplate(t, ns, "mig", mig3gClass(t))
	claimTemplate(t, ns, "share", sharedClass(t), capacity(map[string]string{"memory": "4Gi", "compute": "10"}))
	claimTemplate(t, ns, "stream", sharedClass(t), capacity(map[string]string{"memory": "1Gi", "compute": "5"}))

	// The node's plugin becomes the old pod of the roll: the same process, now with a pod UID.
	proc(t, "stop", "plugin-"+node)
	t.Cleanup(func() { proc(t, "start", "plugin-"+node) })
	old := startPluginPod(t, node, "plugin-"+node+"-old", "5d1c0a6e-0b7a-4f3e-9c21-0e8a7b6d5c01")
	old.waitReady(t)

	var running []allocation
	for _, name := range []string{"whole", "mig", "share"} {
		p := waitRunning(t, ns, pod(t, ns, name, name, node).Name, 2*time.Minute)
		running = append(running, allocations(t, p)[0])
	}
	daemons := liveMPSDaemons(node)
	if len(daemons) == 0 {
		t.Fatalf("no live MPS control daemon on %s for the running share", node)
	}

	// Pods keep arriving through the whole roll: before the new pod starts, while both run, after.
	streamed := make(chan string, 16)
	stop := make(chan struct{})
	go func() {
		defer close(streamed)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(700 * time.Millisecond):
			}
			name := fmt.Sprintf("stream-%d", i)
			if _, err := e.client.CoreV1().Pods(ns).Create(context.Background(), streamPod(ns, name, node), metav1.CreateOptions{}); err != nil {
				t.Errorf("create pod %s: %v", name, err)
				return
			}
			streamed <- name
		}
	}()

	time.Sleep(2 * time.Second)
	next := startPluginPod(t, node, "plugin-"+node+"-new", "a83f2b19-7c4d-4e8a-b6f0-3d2c1e0f9a02")
	next.waitReady(t)
	if socks := draSockets(t, node); len(socks) != 2 {
		t.Fatalf("DRA sockets %v while both pods run, want one per pod", socks)
	}
	// The DaemonSet controller deletes the old pod once the new one is ready; kubelet sends it SIGTERM.
	proc(t, "stop", old.name)
	time.Sleep(3 * time.Second)
	close(stop)

	var names []string
	for name := range streamed {
		names = append(names, name)
	}
	if len(names) < 4 {
		t.Fatalf("only %d pods were created during the roll", len(names))
	}
	for _, name := range names {
		waitRunning(t, ns, name, 2*time.Minute)
	}
	if failures := prepareFailures(t, ns); len(failures) > 0 {
		t.Errorf("prepares failed during the roll:\n%s", strings.Join(failures, "\n"))
	}

	socks := draSockets(t, node)
	if len(socks) != 1 {
		t.Fatalf("DRA sockets %v after the old pod stopped, want only the new pod's", socks)
	}
	for _, a := range running {
		cur, err := e.client.CoreV1().Pods(ns).Get(ctxFor(t, 30*time.Second), a.pod.Name, metav1.GetOptions{})
		if err != nil || cur.Status.Phase != v1.PodRunning {
			t.Errorf("pod %s not Running after the roll (%v)", a.pod.Name, err)
			continue
		}
		if files := cdiSpecsMentioning(t, node, string(a.claim.UID)); len(files) == 0 {
			t.Errorf("%s: CDI spec of claim %s gone after the roll", a.pod.Name, a.claim.UID)
		}
		got := prepareAt(t, socks[0], a)
		var ids []string
		for _, d := range got.Devices {
			ids = append(ids, d.CdiDeviceIds...)
		}
		if got.Error != "" || strings.Join(ids, ",") != strings.Join(a.edits.CDIDevices, ",") {
			t.Errorf("%s: the new instance prepares it as %v (error %q), the old one gave %v", a.pod.Name, ids, got.Error, a.edits.CDIDevices)
		}
	}
	if after := liveMPSDaemons(node); fmt.Sprint(after) != fmt.Sprint(daemons) {
		t.Errorf("MPS control daemons %v before the roll, %v after", daemons, after)
	}

	// The old instance is gone, so only the new one can unprepare what the old one prepared.
	whole := running[0]
	deletePod(t, ns, whole.pod.Name)
	waitGone(t, ns, whole.pod.Name, time.Minute)
	if files := cdiSpecsMentioning(t, node, string(whole.claim.UID)); len(files) > 0 {
		t.Errorf("claim %s of the deleted pod still has CDI specs %v", whole.claim.UID, files)
	}
}

// streamPod is the pod the stream creates (not through pod(), which may stop the test from its goroutine).
func streamPod(ns, name, node string) *v1.Pod {
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			Containers: []v1.Container{{
				Name: "ctr", Image: "registry.k8s.io/pause:3.10",
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims:                []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To("stream")}},
			TerminationGracePeriodSeconds: ptr.To[int64](1),
			NodeSelector:                  map[string]string{"kubernetes.io/hostname": node},
		},
	}
}
