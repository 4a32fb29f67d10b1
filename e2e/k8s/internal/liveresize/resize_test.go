package liveresize

import (
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"tessera.dev/e2e/internal/fleetsim"
)

// rightsizeStderr is what `kubectl tessera rightsize deployment/svc-0 -n fleet` writes on stderr
// (controller/src/rightsize/cli.rs: the report, then the apply hint).
const rightsizeStderr = `deployment fleet/svc-0, request gpu: 120 samples over 300s every 2500ms from 1 pod(s) (svc-0-6b8f7c4d2-qwrtz) on gpu-0-shared
  p90 GPU use     0.360 of a GPU
  max memory      17.20 GiB
  compute request 45 %   (p90 use at 80 % of the request, in steps of 5, 5..100)
  compute ceiling 100 %  (burstable: the share may use what its neighbours leave idle)
  memory          20Gi   (max memory × 1.15, in whole GiB, at least 1)
  rule: tessera's share sizing rule v1 (controller/README.md, "kubectl tessera rightsize")
apply: kubectl tessera rightsize … | kubectl apply -f -   (a template's spec cannot change, so the resized one is a new template, svc-0-gpu-c45-m20gi), then
       kubectl patch deployment svc-0 -n fleet --type json -p '[{"op":"replace","path":"/spec/template/spec/resourceClaims/0/resourceClaimTemplateName","value":"svc-0-gpu-c45-m20gi"}]'   (a rollout: new pods get claims of the new size)
`

// rightsizeStdout is its -o template answer for the live run's initial template.
const rightsizeStdout = `{
  "apiVersion": "resource.k8s.io/v1",
  "kind": "ResourceClaimTemplate",
  "metadata": {"name": "svc-0-gpu-c45-m20gi", "namespace": "fleet"},
  "spec": {"spec": {"devices": {
    "requests": [{"name": "gpu", "exactly": {"deviceClassName": "e2e-shared", "capacity": {"requests": {"compute": "45", "memory": "20Gi"}}}}],
    "config": [{"opaque": {"driver": "gpu.tessera.dev", "parameters": {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mps": {"computeCeiling": 100}}}}}]
  }}}
}`

func aServiceDeployment(name, template string) *appsv1.Deployment {
	return &appsv1.Deployment{
		TypeMeta:   metav1.TypeMeta{APIVersion: "apps/v1", Kind: "Deployment"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "fleet"},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](2),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": name}},
			Template: v1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": name}},
				Spec: v1.PodSpec{
					Containers:     []v1.Container{{Name: "serve", Image: "probe", Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}}}},
					ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: ptr.To(template)}},
				},
			},
		},
	}
}

func TestRightsizesDeploymentPatchPointsTheServicesPodsAtTheResizedTemplateAndChangesNothingElse(t *testing.T) {
	name, ns, patch, err := DeploymentPatch(rightsizeStderr)
	if err != nil {
		t.Fatal(err)
	}
	if name != "svc-0" || ns != "fleet" {
		t.Fatalf("the patch names deployment %s/%s, want fleet/svc-0", ns, name)
	}
	d := aServiceDeployment("svc-0", "svc-0-gpu")
	MakeBeforeBreak(d, 4)
	got, err := Apply(d, patch)
	if err != nil {
		t.Fatal(err)
	}
	if n := *got.Spec.Template.Spec.ResourceClaims[0].ResourceClaimTemplateName; n != "svc-0-gpu-c45-m20gi" {
		t.Errorf("the pods' claim template is %s, want svc-0-gpu-c45-m20gi", n)
	}
	if *got.Spec.Replicas != 2 || got.Spec.MinReadySeconds != 4 || got.Spec.Strategy.RollingUpdate.MaxUnavailable.IntValue() != 0 ||
		got.Spec.Template.Spec.Containers[0].Resources.Claims[0].Name != "gpu" {
		t.Errorf("the patch changed more than the template's name: %+v", got.Spec)
	}
}

func TestAPatchForAClaimTheDeploymentDoesNotHaveIsRefusedNamingTheDeployment(t *testing.T) {
	_, _, patch, err := DeploymentPatch(strings.ReplaceAll(rightsizeStderr, "resourceClaims/0/", "resourceClaims/3/"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Apply(aServiceDeployment("svc-0", "svc-0-gpu"), patch); err == nil || !strings.Contains(err.Error(), "fleet/svc-0") {
		t.Fatalf("err = %v, want a refusal naming deployment fleet/svc-0", err)
	}
}

func TestStderrWithoutAnApplyHintIsRefusedWithWhatRightsizeSaid(t *testing.T) {
	said := "no recommendation for svc-0: not enough data: 28 samples, need 30\n"
	if _, _, _, err := DeploymentPatch(said); err == nil || !strings.Contains(err.Error(), "not enough data") {
		t.Fatalf("err = %v, want one quoting rightsize's stderr", err)
	}
}

func TestTheResizedTemplatesShareIsReadFromItsCapacityAndCeiling(t *testing.T) {
	tpl, err := ParseTemplate([]byte(rightsizeStdout))
	if err != nil {
		t.Fatal(err)
	}
	want := fleetsim.Recommendation{RequestPercent: 45, CeilingPercent: 100, MemoryBytes: 20 << 30}
	if tpl.Name != "svc-0-gpu-c45-m20gi" || tpl.Share != want {
		t.Fatalf("got %s %+v, want svc-0-gpu-c45-m20gi %+v", tpl.Name, tpl.Share, want)
	}
	if tpl.Object["kind"] != "ResourceClaimTemplate" {
		t.Errorf("the object to create is a %v", tpl.Object["kind"])
	}
}

// The live run re-sizes on the offline model's schedule, compressed: the same constants, not copies.
func TestTheLiveRunsResizeScheduleIsTheOfflineModelsCompressed(t *testing.T) {
	cfg := fleetsim.LiveSizedConfig(6)
	d := fleetsim.DefaultConfig()
	if cfg.LearnSeconds != d.LearnSeconds || cfg.ResizeSeconds != d.ResizeSeconds || cfg.SizingWindowSeconds != d.SizingWindowSeconds ||
		cfg.SampleSeconds != d.SampleSeconds || cfg.HPATarget != d.HPATarget || cfg.ScaleDownWindow != d.ScaleDownWindow {
		t.Fatalf("the live run's config %+v departs from the offline model's %+v", cfg, d)
	}
	s := fleetsim.LiveResizeSchedule(cfg, 6)
	want := fleetsim.ResizeSchedule{First: 100 * time.Second, Every: 100 * time.Second, Window: 300 * time.Second, Step: 2500 * time.Millisecond}
	if s != want {
		t.Fatalf("schedule at 6x %+v, want %+v", s, want)
	}
	if f := strings.Join(s.RightsizeFlags(), " "); f != "--window 300000ms --step 2500ms" {
		t.Errorf("rightsize flags %q", f)
	}
	for _, c := range []struct {
		elapsed time.Duration
		due     int
	}{{99 * time.Second, 0}, {100 * time.Second, 1}, {199 * time.Second, 1}, {200 * time.Second, 2}} {
		if got := s.Due(c.elapsed); got != c.due {
			t.Errorf("Due(%s) = %d, want %d", c.elapsed, got, c.due)
		}
	}
}

func TestTheLiveRunHasTheOfflineModelsServicesWhereTheNodeHoldsThemAndHalfItsGPUsOtherwise(t *testing.T) {
	for _, c := range []struct{ gpus, services, maxReplicas int }{{6, 3, 2}, {48, 24, 2}, {64, 24, 2}, {1, 1, 1}} {
		cfg := fleetsim.LiveSizedConfig(c.gpus)
		if cfg.Services != c.services || cfg.MaxReplicas != c.maxReplicas {
			t.Errorf("%d GPUs: %d services of up to %d replicas, want %d of %d", c.gpus, cfg.Services, cfg.MaxReplicas, c.services, c.maxReplicas)
		}
	}
	if s := fleetsim.InitialShare; s.RequestPercent != 100 || s.CeilingPercent != 100 || s.MemoryBytes != 74<<30 {
		t.Errorf("initial share %+v, want 100 %%, 100 %%, 74Gi (the model's 80 GB in whole GiB)", s)
	}
}
