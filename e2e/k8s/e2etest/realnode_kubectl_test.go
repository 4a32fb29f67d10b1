package e2etest

// Issue 23 item 5: the local cluster has kubectl's habits on the real node. The API server dials the real
// kubelet at its InternalIP with a client certificate, and verifies its serving certificate
// (e2e/scripts/real-node.sh): `kubectl logs`, `exec` and `port-forward` reach the node's containers, and
// the harness reads container output the same way (podLogs). kube-controller-manager runs the Job
// controller, so a Job with a GPU claim runs to completion there.

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
	"k8s.io/utils/ptr"
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
				ResourceClaims:                []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To(template)}},
				Containers: []v1.Container{{
					Name: "main", Image: probeImage, ImagePullPolicy: v1.PullNever,
					Command:   []string{"sh", "-c", `nvidia-smi -L && ls /dev/nvidia[0-9]*`},
					Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
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
}
