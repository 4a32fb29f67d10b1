package e2etest

// Issue 23 item 4: `kubectl tessera explain` sees the pod, not only its claims. Each scenario leaves a pod
// Pending (or, for the prepare failure, stuck before its containers start) for one reason, reads what the
// scheduler (the pod's PodScheduled condition) or kubelet (the pod's FailedPrepareDynamicResources event)
// says, and checks that explain's first line names the same cause and that it exits 1.

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
)

// explainAgrees runs explain on the pod and checks its exit status and first line; the scheduler's or
// kubelet's own message must contain each of `theirs`, explain's first line each of `ours`.
func explainAgrees(t *testing.T, ns, name, said string, theirs, ours []string) {
	t.Helper()
	t.Logf("scheduler/kubelet: %s", said)
	for _, want := range theirs {
		if !strings.Contains(said, want) {
			t.Errorf("the cluster's own message %q does not contain %q: the scenario did not set up what it means to", said, want)
		}
	}
	code, text := kubectlTessera(t, "explain", "pod/"+name, "-n", ns)
	t.Logf("$ kubectl tessera explain pod/%s -n %s (exit %d)\n%s", name, ns, code, text)
	if code != 1 {
		t.Errorf("explain of a pod that cannot start exited %d, want 1", code)
	}
	first, _, _ := strings.Cut(text, "\n")
	for _, want := range ours {
		if !strings.Contains(first, want) {
			t.Errorf("explain's first line %q does not contain %q", first, want)
		}
	}
}

// plainPod is a pause pod using one claim from the template (none when template is empty); edit adjusts
// its spec before it is created.
func plainPod(t *testing.T, ns, name, template string, edit func(*v1.PodSpec)) {
	t.Helper()
	spec := v1.PodSpec{
		Containers:                    []v1.Container{{Name: "ctr", Image: "registry.k8s.io/pause:3.10"}},
		TerminationGracePeriodSeconds: ptr.To[int64](1),
	}
	if template != "" {
		spec.Containers[0].Resources.Claims = []v1.ResourceClaim{{Name: "gpu"}}
		spec.ResourceClaims = []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To(template)}}
	}
	if edit != nil {
		edit(&spec)
	}
	p := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: spec}
	if _, err := e.client.CoreV1().Pods(ns).Create(ctxFor(t, 30*time.Second), p, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s/%s: %v", ns, name, err)
	}
}

// taintNode adds a NoSchedule taint to the node and removes it when the test ends.
func taintNode(t *testing.T, node, key, value string) {
	t.Helper()
	edit := func(add bool) error {
		return retry.RetryOnConflict(retry.DefaultRetry, func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			n, err := e.client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
			if err != nil {
				return err
			}
			var kept []v1.Taint
			for _, taint := range n.Spec.Taints {
				if taint.Key != key {
					kept = append(kept, taint)
				}
			}
			if add {
				kept = append(kept, v1.Taint{Key: key, Value: value, Effect: v1.TaintEffectNoSchedule})
			}
			n.Spec.Taints = kept
			_, err = e.client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
			return err
		})
	}
	if err := edit(true); err != nil {
		t.Fatalf("taint node %s: %v", node, err)
	}
	t.Cleanup(func() {
		if err := edit(false); err != nil {
			t.Errorf("remove taint %s from node %s: %v", key, node, err)
		}
	})
}

// waitPrepareFailure waits for kubelet's FailedPrepareDynamicResources event on the pod, which must not run.
func waitPrepareFailure(t *testing.T, ns, name string) string {
	t.Helper()
	var msg string
	err := wait.PollUntilContextTimeout(ctxFor(t, 2*time.Minute), time.Second, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		cur, err := e.client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		if cur.Status.Phase == v1.PodRunning {
			return false, fmt.Errorf("pod %s/%s runs", ns, name)
		}
		evs, err := e.client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + name + ",reason=FailedPrepareDynamicResources"})
		if err != nil || len(evs.Items) == 0 {
			return false, nil
		}
		msg = evs.Items[len(evs.Items)-1].Message
		return true, nil
	})
	if err != nil {
		t.Fatalf("no FailedPrepareDynamicResources event for %s/%s: %v", ns, name, err)
	}
	return msg
}

func TestExplainPodNodeSelectorMatchingNoNode(t *testing.T) {
	ns := namespace(t, "explain-selector")
	claimTemplate(t, ns, "gpu", gpuClass(t))
	plainPod(t, ns, "pinned", "gpu", func(s *v1.PodSpec) {
		s.NodeSelector = map[string]string{"e2e.tessera.dev/zone": "nowhere"}
	})
	explainAgrees(t, ns, "pinned", waitUnschedulable(t, ns, "pinned"),
		[]string{"didn't match Pod's node affinity/selector"},
		append([]string{"does not fit on any of", ": didn't match the pod's nodeSelector e2e.tessera.dev/zone=nowhere (the node has no label e2e.tessera.dev/zone)"}, e.nodes...))
}

func TestExplainPodRequiredNodeAffinityMatchingNoNode(t *testing.T) {
	ns := namespace(t, "explain-affinity")
	claimTemplate(t, ns, "gpu", gpuClass(t))
	plainPod(t, ns, "zoned", "gpu", func(s *v1.PodSpec) {
		s.Affinity = &v1.Affinity{NodeAffinity: &v1.NodeAffinity{RequiredDuringSchedulingIgnoredDuringExecution: &v1.NodeSelector{
			NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchExpressions: []v1.NodeSelectorRequirement{
				{Key: "e2e.tessera.dev/node", Operator: v1.NodeSelectorOpIn, Values: []string{"false"}},
			}}},
		}}}
	})
	explainAgrees(t, ns, "zoned", waitUnschedulable(t, ns, "zoned"),
		[]string{"didn't match Pod's node affinity/selector"},
		append([]string{": didn't match the pod's required node affinity: e2e.tessera.dev/node In [false] (the node's label is true)"}, e.nodes...))
}

func TestExplainPodUntoleratedNodeTaint(t *testing.T) {
	ns := namespace(t, "explain-taint")
	for _, n := range e.nodes {
		taintNode(t, n, "e2e.tessera.dev/explain", "held")
	}
	claimTemplate(t, ns, "gpu", gpuClass(t))
	plainPod(t, ns, "plain", "gpu", nil)
	explainAgrees(t, ns, "plain", waitUnschedulable(t, ns, "plain"),
		// The scheduler does not name the taint ("had untolerated taint(s)"); explain does.
		[]string{"untolerated taint"},
		append([]string{": untolerated taint e2e.tessera.dev/explain=held:NoSchedule"}, e.nodes...))

	// The same pod tolerating the taint runs, and explain then reports its claim allocated (exit 0).
	plainPod(t, ns, "tolerant", "gpu", func(s *v1.PodSpec) {
		s.Tolerations = []v1.Toleration{{Key: "e2e.tessera.dev/explain", Operator: v1.TolerationOpExists, Effect: v1.TaintEffectNoSchedule}}
	})
	waitRunning(t, ns, "tolerant", 2*time.Minute)
	if code, text := kubectlTessera(t, "explain", "pod/tolerant", "-n", ns); code != 0 {
		t.Errorf("explain of the running tolerant pod exited %d: %s", code, text)
	}
}

func TestExplainPodDeviceTaintRule(t *testing.T) {
	version := ""
	for _, v := range []string{"v1", "v1beta2", "v1alpha3"} {
		resources, err := e.client.Discovery().ServerResourcesForGroupVersion("resource.k8s.io/" + v)
		if err != nil {
			continue
		}
		for _, r := range resources.APIResources {
			if r.Name == "devicetaintrules" && version == "" {
				version = v
			}
		}
	}
	if version == "" {
		t.Fatalf("the API server serves no DeviceTaintRule (resource.k8s.io v1, v1beta2, v1alpha3); Kubernetes 1.37 serves v1")
	}
	ns := namespace(t, "explain-rule")
	node := e.nodes[0]
	rules := e.dyn.Resource(deviceTaintRuleGVR.GroupResource().WithVersion(version))
	rule := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "resource.k8s.io/" + version, "kind": "DeviceTaintRule",
		"metadata": map[string]any{"name": "e2e-explain"},
		"spec": map[string]any{
			"deviceSelector": map[string]any{"driver": driver, "pool": node, "device": "gpu-7"},
			"taint":          map[string]any{"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"},
		},
	}}
	if _, err := rules.Create(ctxFor(t, 30*time.Second), rule, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create DeviceTaintRule: %v", err)
	}
	t.Cleanup(func() {
		if err := rules.Delete(context.Background(), "e2e-explain", metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete DeviceTaintRule: %v", err)
		}
	})
	claimTemplate(t, ns, "gpu-7", gpuClass(t), selector(fmt.Sprintf(`device.attributes[%q].index == 7`, driver)))
	pod(t, ns, "ruled", "gpu-7", node)
	explainAgrees(t, ns, "ruled", waitUnschedulable(t, ns, "ruled"),
		[]string{"1 cannot allocate all claims", "didn't match Pod's node affinity/selector"},
		[]string{"didn't match the pod's nodeSelector kubernetes.io/hostname=" + node, node + ": all 1 matching devices are tainted: example.com/maintenance=planned (NoSchedule, DeviceTaintRule e2e-explain), not tolerated"})
}

func TestExplainPodUnservedExtendedResource(t *testing.T) {
	ns := namespace(t, "explain-extended")
	plainPod(t, ns, "fpga", "", func(s *v1.PodSpec) {
		q := resource.MustParse("1")
		s.Containers[0].Resources = v1.ResourceRequirements{
			Requests: v1.ResourceList{"example.com/fpga": q}, Limits: v1.ResourceList{"example.com/fpga": q},
		}
	})
	explainAgrees(t, ns, "fpga", waitUnschedulable(t, ns, "fpga"),
		[]string{"Insufficient example.com/fpga"},
		[]string{"Insufficient example.com/fpga: the pod asks for 1, no DeviceClass serves it (spec.extendedResourceName) and the node has 0 allocatable"})
}

func TestExplainPodMissingClass(t *testing.T) {
	ns := namespace(t, "explain-class")
	gpuClass(t)
	claimTemplate(t, ns, "typo", "e2e-gpus")
	pod(t, ns, "typo", "typo", "")
	explainAgrees(t, ns, "typo", waitUnschedulable(t, ns, "typo"),
		[]string{"e2e-gpus"},
		[]string{"DeviceClass e2e-gpus does not exist; did you mean e2e-gpu?; tessera's classes:", "e2e-gpu"})
}

func TestExplainPodFalseCelSelectorShowsTheValue(t *testing.T) {
	ns := namespace(t, "explain-cel")
	claimTemplate(t, ns, "huge", gpuClass(t), selector(fmt.Sprintf(`device.capacity[%q].memory.compareTo(quantity("200Gi")) >= 0`, driver)))
	pod(t, ns, "huge", "huge", "")
	explainAgrees(t, ns, "huge", waitUnschedulable(t, ns, "huge"),
		[]string{"cannot allocate all claims"},
		[]string{"is false (device.capacity[\"" + driver + "\"].memory = "})
}

func TestExplainPodPrepareFailure(t *testing.T) {
	ns := namespace(t, "explain-prepare")
	// make up installs no admission webhook, so the invalid config is admitted and fails at prepare.
	claimTemplate(t, ns, "bad", gpuClass(t), opaqueConfig(
		`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"NotAStrategy"}}`))
	pod(t, ns, "bad", "bad", "")
	msg := waitPrepareFailure(t, ns, "bad")
	firstLine, _, _ := strings.Cut(msg, "\n")
	explainAgrees(t, ns, "bad", msg,
		[]string{"NodePrepareResources failed for ResourceClaim"},
		[]string{"every claim is allocated, but kubelet on", "cannot prepare them: " + firstLine})
}
