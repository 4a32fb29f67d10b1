package cluster

import (
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

func TestPinToNodeSelectsTheNodeForPodsAndWorkloadTemplatesAndLeavesTheRest(t *testing.T) {
	obj := func(kind string, fields map[string]any) *unstructured.Unstructured {
		u := &unstructured.Unstructured{Object: fields}
		u.SetKind(kind)
		u.SetName("x")
		return u
	}
	pod := obj("Pod", map[string]any{"spec": map[string]any{"nodeSelector": map[string]any{"gpu": "h100"}}})
	deployment := obj("Deployment", map[string]any{})
	cronJob := obj("CronJob", map[string]any{})
	template := obj("ResourceClaimTemplate", map[string]any{"spec": map[string]any{}})
	if err := PinToNode([]*unstructured.Unstructured{pod, deployment, cronJob, template}, "real-node"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		o    *unstructured.Unstructured
		path []string
	}{
		{pod, []string{"spec"}},
		{deployment, []string{"spec", "template", "spec"}},
		{cronJob, []string{"spec", "jobTemplate", "spec", "template", "spec"}},
	} {
		got, _, _ := unstructured.NestedString(c.o.Object, append(c.path, "nodeSelector", "kubernetes.io/hostname")...)
		if got != "real-node" {
			t.Errorf("%s: nodeSelector kubernetes.io/hostname = %q, want real-node", c.o.GetKind(), got)
		}
	}
	if got, _, _ := unstructured.NestedString(pod.Object, "spec", "nodeSelector", "gpu"); got != "h100" {
		t.Errorf("the pod's own nodeSelector was lost: gpu=%q", got)
	}
	if _, found, _ := unstructured.NestedFieldNoCopy(template.Object, "spec", "nodeSelector"); found {
		t.Errorf("a ResourceClaimTemplate got a nodeSelector")
	}
}
