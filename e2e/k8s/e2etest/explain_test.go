package e2etest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// kubectlTessera runs `kubectl tessera ARGS...` with kubectl finding the plugin on PATH by its name, as
// a user's shell would; it returns the exit status and the output.
func kubectlTessera(t *testing.T, args ...string) (int, string) {
	t.Helper()
	target := getenv("CARGO_TARGET_DIR", filepath.Join(e.repoRoot, "target"))
	plugin := filepath.Join(target, "debug", "kubectl-tessera")
	if _, err := os.Stat(plugin); err != nil {
		t.Fatalf("%s is missing: run cargo build -p tessera-controller (%v)", plugin, err)
	}
	kubectl := filepath.Join(getenv("E2E_BIN_DIR", filepath.Join(e.repoRoot, "e2e", "bin")), "kubectl")
	if _, err := os.Stat(kubectl); err != nil {
		t.Fatalf("%s is missing: make up builds it (%v)", kubectl, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, kubectl, append([]string{"tessera"}, args...)...)
	cmd.Env = append(os.Environ(),
		"PATH="+filepath.Dir(plugin)+string(os.PathListSeparator)+os.Getenv("PATH"),
		"KUBECONFIG="+filepath.Join(e.runDir, "pki", "admin.kubeconfig"))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, out.String()
	case errors.As(err, &exit):
		return exit.ExitCode(), out.String()
	default:
		t.Fatalf("kubectl tessera %v: %v: %s", args, err, out.String())
		return 0, ""
	}
}

// waitUnschedulable waits until the scheduler has given up on the pod and returns its message.
func waitUnschedulable(t *testing.T, ns, name string) string {
	t.Helper()
	var reason string
	err := wait.PollUntilContextTimeout(ctxFor(t, 2*time.Minute), 500*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		p, err := e.client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		if p.Status.Phase == v1.PodRunning {
			return false, fmt.Errorf("pod %s/%s runs", ns, name)
		}
		for _, c := range p.Status.Conditions {
			if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable {
				reason = c.Message
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("pod %s/%s never reported unschedulable: %v", ns, name, err)
	}
	return reason
}

// Issue 14 item 2: a pod whose 200Gi share no GPU offers stays Pending with the scheduler's terse
// message; `kubectl tessera explain` names the largest share there is and where, and agrees that it does
// not fit, while a pod that runs is reported as allocated.
func TestExplainNamesTheLargestShareForAPendingPodThatAsksForMore(t *testing.T) {
	ns := namespace(t, "explain")
	claimTemplate(t, ns, "big-gpu", "shared.gpu.tessera.dev", capacity(map[string]string{"memory": "200Gi"}))
	claimTemplate(t, ns, "small-gpu", "shared.gpu.tessera.dev", capacity(map[string]string{"memory": "10Gi"}))
	pod(t, ns, "big", "big-gpu", "")
	scheduler := waitUnschedulable(t, ns, "big")
	t.Logf("scheduler: %s", scheduler)

	code, text := kubectlTessera(t, "explain", "pod/big", "-n", ns)
	t.Logf("$ kubectl tessera explain pod/big -n %s\n%s", ns, text)
	if code != 1 {
		t.Errorf("explain of a pending pod exited %d, want 1 (does not fit)", code)
	}
	// gpu-1 is the shared GPU on every node under e2e/manifests/gpupolicy.yaml; its largest share is
	// the memory request policy's maximum.
	want := "request gpu: no tessera device offers memory 200Gi; the largest is 79Gi (gpu-1-shared on " + e.nodes[0] + ")"
	if first, _, _ := strings.Cut(text, "\n"); !strings.Contains(first, want) {
		t.Errorf("explain's summary line %q does not contain %q", first, want)
	}

	code, out := kubectlTessera(t, "explain", "pod/big", "-n", ns, "-o", "json")
	var report struct {
		Fits  bool `json:"fits"`
		Nodes []struct {
			Node string `json:"node"`
			Fits bool   `json:"fits"`
		} `json:"nodes"`
	}
	if err := json.Unmarshal([]byte(out), &report); err != nil {
		t.Fatalf("explain -o json printed no report (exit %d): %v: %s", code, err, out)
	}
	if report.Fits || len(report.Nodes) != len(e.nodes) {
		t.Errorf("explain -o json: fits=%v on %d nodes, want false on all %d", report.Fits, len(report.Nodes), len(e.nodes))
	}

	pod(t, ns, "small", "small-gpu", "")
	waitRunning(t, ns, "small", 2*time.Minute)
	code, text = kubectlTessera(t, "explain", "pod/small", "-n", ns)
	if code != 0 || !strings.Contains(text, "every claim is allocated already") {
		t.Errorf("explain of a running pod exited %d: %s", code, text)
	}

	code, text = kubectlTessera(t, "explain", "pod/missing", "-n", ns)
	if code != 2 || !strings.Contains(text, "Pod "+ns+"/missing not found") {
		t.Errorf("explain of a missing pod exited %d: %s", code, text)
	}
}
