package e2etest

// Issue 23 item 5: the local cluster has kubectl's habits on the real node. The API server dials the real
// kubelet at its InternalIP with a client certificate, and verifies its serving certificate
// (e2e/scripts/real-node.sh): `kubectl logs`, `exec` and `port-forward` reach the node's containers, and
// the harness reads container output the same way (podLogs). kube-controller-manager runs the Job
// controller, so a Job with a GPU claim runs to completion there; CoreDNS on the node's bridge address is
// the kubelet's cluster DNS, so its pod resolves Service names.

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/utils/ptr"

	"tessera.dev/e2e/internal/cluster"
)

// podLogs is `kubectl logs --timestamps [-p]` of one container: the pods/log subresource, which the API
// server serves from the container's kubelet. Each line is "<RFC3339Nano> <text>".
func podLogs(ctx context.Context, p *v1.Pod, container string, previous bool) (string, error) {
	data, err := e.client.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &v1.PodLogOptions{
		Container: container, Previous: previous, Timestamps: true,
	}).DoRaw(ctx)
	if err != nil {
		return "", fmt.Errorf("logs of %s/%s container %s (previous %v): %w", p.Namespace, p.Name, container, previous, err)
	}
	return string(data), nil
}

// logLine splits a timestamped log line into its time and text.
func logLine(line string) (time.Time, string, bool) {
	ts, text, ok := strings.Cut(line, " ")
	if !ok {
		return time.Time{}, "", false
	}
	at, err := time.Parse(time.RFC3339Nano, ts)
	return at, text, err == nil
}

// kubectl runs the kubectl make up built, with the cluster's admin kubeconfig, as a user would.
func kubectl(ctx context.Context, args ...string) *exec.Cmd {
	bin := filepath.Join(getenv("E2E_BIN_DIR", filepath.Join(e.repoRoot, "e2e", "bin")), "kubectl")
	return exec.CommandContext(ctx, bin, append([]string{"--kubeconfig", filepath.Join(e.runDir, "pki", "admin.kubeconfig")}, args...)...)
}

func kubectlOut(t *testing.T, args ...string) string {
	t.Helper()
	out, err := kubectl(ctxFor(t, time.Minute), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// checkKubectlReachesThePod: `kubectl exec` runs nvidia-smi in the pod's running container, which lists
// the GPU allocated to it by the slice's UUID, and `kubectl port-forward` reaches a server started in
// that container by `kubectl exec`, serving what it printed.
func checkKubectlReachesThePod(t *testing.T, p *v1.Pod, container, uuid string) {
	t.Helper()
	smi := kubectlOut(t, "exec", "-n", p.Namespace, p.Name, "-c", container, "--", "nvidia-smi", "-L")
	t.Logf("$ kubectl exec %s -c %s -- nvidia-smi -L\n%s", p.Name, container, smi)
	if !strings.Contains(smi, uuid) {
		t.Errorf("kubectl exec %s -- nvidia-smi -L does not list the allocated GPU %s:\n%s", p.Name, uuid, smi)
	}

	// busybox httpd forks into the background, so the exec returns while it serves.
	kubectlOut(t, "exec", "-n", p.Namespace, p.Name, "-c", container, "--", "sh", "-c",
		"mkdir -p /tmp/www && nvidia-smi -L > /tmp/www/index.html && httpd -p 127.0.0.1:8080 -h /tmp/www")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pf := kubectl(ctx, "port-forward", "-n", p.Namespace, "pod/"+p.Name, ":8080")
	stdout, err := pf.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	pf.Stderr = &stderr
	if err := pf.Start(); err != nil {
		t.Fatalf("kubectl port-forward: %v", err)
	}
	defer func() { cancel(); _ = pf.Wait() }()
	// "Forwarding from 127.0.0.1:<port> -> 8080"
	forwarding := regexp.MustCompile(`Forwarding from 127\.0\.0\.1:(\d+) -> 8080`)
	var port string
	lines := bufio.NewScanner(stdout)
	for port == "" && lines.Scan() {
		if m := forwarding.FindStringSubmatch(lines.Text()); m != nil {
			port = m[1]
		}
	}
	if port == "" {
		t.Fatalf("kubectl port-forward pod/%s :8080 printed no local port\n%s", p.Name, stderr.String())
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	resp, err := http.Get("http://127.0.0.1:" + port + "/index.html")
	if err != nil {
		t.Fatalf("GET through kubectl port-forward: %v\n%s", err, stderr.String())
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), uuid) {
		t.Errorf("GET through kubectl port-forward to pod/%s: %s\n%s\nwant 200 and the page naming %s", p.Name, resp.Status, body, uuid)
	}
}

// runGPUJob runs a Job whose pod claims a whole GPU on the real node and prints what it sees, waits for
// it to complete, and returns `kubectl logs job/<name>`.
func runGPUJob(t *testing.T, ns, name, template, node string) string {
	t.Helper()
	// The cluster DNS answers the kubernetes Service by its name (dnsPolicy ClusterFirst).
	return runJob(t, ns, name, node,
		[]v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To(template)}},
		`nvidia-smi -L && ls /dev/nvidia[0-9]* && grep -E '^(nameserver|search) ' /etc/resolv.conf && nslookup -type=A kubernetes.default.svc.cluster.local`)
}

// runJob runs a Job on the real node whose one container uses every claim of `claims` and runs `command`,
// waits for it to complete, and returns `kubectl logs job/<name>`.
func runJob(t *testing.T, ns, name, node string, claims []v1.PodResourceClaim, command string) string {
	t.Helper()
	var uses []v1.ResourceClaim
	for _, c := range claims {
		uses = append(uses, v1.ResourceClaim{Name: c.Name})
	}
	job := &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: batchv1.JobSpec{
			BackoffLimit: ptr.To[int32](0),
			Template: v1.PodTemplateSpec{Spec: v1.PodSpec{
				RestartPolicy: v1.RestartPolicyNever,
				NodeSelector:  map[string]string{"kubernetes.io/hostname": node},
				// The real node carries the taint GKE puts on GPU nodes.
				Tolerations:                   []v1.Toleration{{Key: "nvidia.com/gpu", Operator: v1.TolerationOpExists, Effect: v1.TaintEffectNoSchedule}},
				TerminationGracePeriodSeconds: ptr.To[int64](1),
				ResourceClaims:                claims,
				Containers: []v1.Container{{
					Name: "main", Image: probeImage, ImagePullPolicy: v1.PullNever,
					Command:   []string{"sh", "-c", command},
					Resources: v1.ResourceRequirements{Claims: uses},
				}},
			}},
		},
	}
	ctx := ctxFor(t, 3*time.Minute)
	if _, err := e.client.BatchV1().Jobs(ns).Create(ctx, job, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create job %s/%s: %v", ns, name, err)
	}
	t.Cleanup(func() {
		_ = e.client.BatchV1().Jobs(ns).Delete(context.Background(), name, metav1.DeleteOptions{PropagationPolicy: ptr.To(metav1.DeletePropagationForeground)})
	})
	waitFor(t, "job "+name+" Complete", 2*time.Minute, func(ctx context.Context) (bool, string) {
		j, err := e.client.BatchV1().Jobs(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, c := range j.Status.Conditions {
			if c.Status != v1.ConditionTrue {
				continue
			}
			if c.Type == batchv1.JobFailed {
				t.Fatalf("job %s failed: %s: %s\n%s", name, c.Reason, c.Message, kubectlOut(t, "describe", "pods", "-n", ns, "-l", "job-name="+name))
			}
			if c.Type == batchv1.JobComplete {
				return true, ""
			}
		}
		return false, fmt.Sprintf("active %d, succeeded %d, failed %d, conditions %+v", j.Status.Active, j.Status.Succeeded, j.Status.Failed, j.Status.Conditions)
	})
	return kubectlOut(t, "logs", "-n", ns, "job/"+name)
}

// wholeGPUUUIDs are the UUIDs of the whole GPUs the node publishes.
func wholeGPUUUIDs(t *testing.T, node string) map[string]string {
	t.Helper()
	slices, err := e.client.ResourceV1().ResourceSlices().List(ctxFor(t, 30*time.Second), metav1.ListOptions{FieldSelector: "spec.nodeName=" + node + ",spec.driver=" + driver})
	if err != nil {
		t.Fatalf("list slices: %v", err)
	}
	out := map[string]string{}
	for _, s := range slices.Items {
		for _, d := range s.Spec.Devices {
			if u := attr(d, "uuid").StringValue; u != nil && wholeGPUName.MatchString(d.Name) {
				out[*u] = d.Name
			}
		}
	}
	return out
}

// checkGPUJobRuns: a Job with a whole-GPU claim completes on the real node, and `kubectl logs job/...`
// shows nvidia-smi listing exactly one of the node's GPUs and its device node.
func checkGPUJobRuns(t *testing.T, ns, template, node string) {
	t.Helper()
	logs := runGPUJob(t, ns, "gpu-job", template, node)
	t.Logf("$ kubectl logs job/gpu-job\n%s", logs)
	uuids := wholeGPUUUIDs(t, node)
	seen := regexp.MustCompile(`UUID: (GPU-[0-9a-fA-F-]+)`).FindAllStringSubmatch(logs, -1)
	if len(seen) != 1 || uuids[seen[0][1]] == "" {
		t.Errorf("kubectl logs job/gpu-job: nvidia-smi listed %v, want exactly one of %s's GPUs %v", seen, node, uuids)
	}
	if !regexp.MustCompile(`(?m)^/dev/nvidia\d+$`).MatchString(logs) {
		t.Errorf("kubectl logs job/gpu-job: no /dev/nvidia<N> device node listed")
	}
	checkClusterDNS(t, ns, logs)
}

// checkClusterDNS: the Job's pod was given the cluster DNS (its resolv.conf searches the namespace's
// cluster.local domain), kubernetes.default.svc.cluster.local resolved to the Service's ClusterIP, and
// kubelet warned no pod of the namespace about a missing cluster DNS.
func checkClusterDNS(t *testing.T, ns, logs string) {
	t.Helper()
	if !strings.Contains(logs, "search "+ns+".svc.cluster.local") {
		t.Errorf("kubectl logs job/gpu-job: resolv.conf does not search %s.svc.cluster.local (dnsPolicy ClusterFirst):\n%s", ns, logs)
	}
	svc, err := e.client.CoreV1().Services("default").Get(ctxFor(t, 30*time.Second), "kubernetes", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("get service default/kubernetes: %v", err)
	}
	if !regexp.MustCompile(`(?m)^Address:\s+` + regexp.QuoteMeta(svc.Spec.ClusterIP) + `\s*$`).MatchString(logs) {
		t.Errorf("kubectl logs job/gpu-job: nslookup kubernetes.default.svc.cluster.local did not answer the Service's ClusterIP %s:\n%s", svc.Spec.ClusterIP, logs)
	}
	events, err := e.client.CoreV1().Events(ns).List(ctxFor(t, 30*time.Second), metav1.ListOptions{FieldSelector: "reason=MissingClusterDNS"})
	if err != nil {
		t.Fatalf("list events: %v", err)
	}
	for _, ev := range events.Items {
		t.Errorf("event %s on %s/%s: %s", ev.Reason, ev.InvolvedObject.Kind, ev.InvolvedObject.Name, ev.Message)
	}
}

// checkExamplesRunOn applies deployments/examples as `make up` does, every pod pinned to `node`, waits
// for each of their pods to run there, and checks that `kubectl logs` of each names exactly the devices
// allocated to it (TESSERA_DEVICES) and lists a GPU device node.
func checkExamplesRunOn(t *testing.T, node string) {
	t.Helper()
	files, err := cluster.ManifestFiles(filepath.Join(e.repoRoot, "deployments", "examples"))
	if err != nil {
		t.Fatal(err)
	}
	objs, err := cluster.ReadManifests(files...)
	if err != nil {
		t.Fatal(err)
	}
	if err := cluster.PinToNode(objs, node); err != nil {
		t.Fatal(err)
	}
	want := 0
	for _, o := range objs {
		switch o.GetKind() {
		case "Pod":
			want++
		case "Deployment":
			want += replicasOf(o)
		}
	}
	applier, err := cluster.NewApplier(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		// The namespace stays: the stand-in scenarios apply the examples into it after this.
		var workloads []*unstructured.Unstructured
		for _, o := range objs {
			if o.GetKind() != "Namespace" {
				workloads = append(workloads, o)
			}
		}
		if err := applier.Delete(ctx, workloads, "default"); err != nil {
			t.Errorf("delete examples: %v", err)
		}
		waitFor(t, "the examples' pods gone", 2*time.Minute, func(ctx context.Context) (bool, string) {
			pods, err := e.client.CoreV1().Pods(examplesNamespace).List(ctx, metav1.ListOptions{})
			if err != nil {
				return false, err.Error()
			}
			return len(pods.Items) == 0, fmt.Sprintf("%d left", len(pods.Items))
		})
	})
	if err := applier.Apply(ctxFor(t, time.Minute), objs, "default"); err != nil {
		t.Fatalf("examples rejected: %v", err)
	}
	var running []v1.Pod
	waitFor(t, fmt.Sprintf("the examples' %d pods Running on %s", want, node), 3*time.Minute, func(ctx context.Context) (bool, string) {
		pods, err := e.client.CoreV1().Pods(examplesNamespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		running = running[:0]
		var states []string
		for _, p := range pods.Items {
			if p.Status.Phase == v1.PodRunning && p.Spec.NodeName == node {
				running = append(running, p)
			}
			states = append(states, fmt.Sprintf("%s %s on %q", p.Name, p.Status.Phase, p.Spec.NodeName))
		}
		return len(running) == want, strings.Join(states, "; ")
	})
	for i := range running {
		p := &running[i]
		claims, err := cluster.PodClaims(ctxFor(t, 30*time.Second), e.client, p)
		if err != nil {
			t.Fatal(err)
		}
		var devices []string
		for _, c := range claims {
			if c.Status.Allocation == nil {
				t.Fatalf("claim %s of running pod %s is not allocated", c.Name, p.Name)
			}
			for _, r := range c.Status.Allocation.Devices.Results {
				devices = append(devices, r.Device)
			}
		}
		logs := kubectlOut(t, "logs", "-n", p.Namespace, p.Name)
		t.Logf("$ kubectl logs -n %s %s\n%s", p.Namespace, p.Name, logs)
		if !regexp.MustCompile(`(?m)^TESSERA_DEVICES=` + regexp.QuoteMeta(strings.Join(devices, ",")) + `$`).MatchString(logs) {
			t.Errorf("kubectl logs %s: no line TESSERA_DEVICES=%s (its allocation)", p.Name, strings.Join(devices, ","))
		}
		if !regexp.MustCompile(`(?m)^/dev/nvidia\d+$`).MatchString(logs) {
			t.Errorf("kubectl logs %s: no /dev/nvidia<N> device node listed", p.Name)
		}
	}
}

// examplesNamespace is where deployments/examples put their objects.
const examplesNamespace = "tessera-examples"

// replicasOf is a Deployment manifest's spec.replicas (1 when unset); YAML numbers may decode as int64 or
// float64.
func replicasOf(o *unstructured.Unstructured) int {
	v, found, _ := unstructured.NestedFieldNoCopy(o.Object, "spec", "replicas")
	switch n := v.(type) {
	case int64:
		return int(n)
	case float64:
		return int(n)
	}
	if !found {
		return 1
	}
	return 0
}
