package e2etest

// Issue 41 item 3 on the real node: every spec written in NVIDIA's vocabulary under
// controller/tests/fixtures/migrate/, as `kubectl tessera migrate` translated it, runs. The translations are
// the checked-in <case>.tessera.yaml files, which controller/tests/migrate.rs keeps equal to the command's
// output. Only the pods' image and command change here (the real node runs the cuda-probe image, never
// pulled, instead of ubuntu with nvidia-smi), and each pod is pinned to the real node. The pods exit after
// the probe, so cases that need more GPUs than the node has at once take them in turn.

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"

	"tessera.dev/e2e/internal/cluster"
)

// migratedSpecs reads every translated fixture, leaving out what the report lists as not translated (the
// template "not-on-tessera" selects on attributes tessera does not publish).
func migratedSpecs(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(e.repoRoot, "controller", "tests", "fixtures", "migrate", "*.tessera.yaml"))
	if err != nil || len(files) != 7 {
		t.Fatalf("the 7 translated fixtures of controller/tests/fixtures/migrate: %v %v", files, err)
	}
	all, err := cluster.ReadManifests(files...)
	if err != nil {
		t.Fatal(err)
	}
	var objs []*unstructured.Unstructured
	for _, o := range all {
		if o.GetName() == "not-on-tessera" {
			continue
		}
		if o.GetKind() == "Pod" {
			ctrs, _, _ := unstructured.NestedSlice(o.Object, "spec", "containers")
			for _, c := range ctrs {
				m := c.(map[string]any)
				m["image"], m["imagePullPolicy"] = probeImage, string(v1.PullNever)
				m["command"] = []any{"sh", "-c", probeThenExit}
				delete(m, "args")
			}
			if err := unstructured.SetNestedSlice(o.Object, ctrs, "spec", "containers"); err != nil {
				t.Fatal(err)
			}
		}
		objs = append(objs, o)
	}
	return objs
}

// waitPodSucceeded polls until the pod has exited 0; an error names its phase and conditions otherwise.
func waitPodSucceeded(ctx context.Context, ns, name string) (*v1.Pod, error) {
	var last *v1.Pod
	err := wait.PollUntilContextCancel(ctx, 500*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		p, err := e.client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		last = p
		if p.Status.Phase == v1.PodFailed {
			return false, fmt.Errorf("pod failed: %s %s", p.Status.Reason, p.Status.Message)
		}
		return p.Status.Phase == v1.PodSucceeded, nil
	})
	if err != nil && last != nil {
		var conds []string
		for _, c := range last.Status.Conditions {
			conds = append(conds, fmt.Sprintf("%s=%s %s", c.Type, c.Status, c.Message))
		}
		return last, fmt.Errorf("%s/%s: %w (phase %s; %s)", ns, name, err, last.Status.Phase, strings.Join(conds, "; "))
	}
	return last, err
}

func TestRealNodeRunsEachMigratedNvidiaSpec(t *testing.T) {
	rn := realNode(t)
	installChart(t, rn)
	waitChartPods(t, "plugin and MPS supervisor pods Ready on "+rn.name, "kubelet-plugin", "mps-supervisor")
	waitFor(t, "ResourceSlices for "+rn.name, 2*time.Minute, func(ctx context.Context) (bool, string) {
		n := countDevices(t, rn.name, wholeGPUName)
		return n == rn.gpus-1, fmt.Sprintf("%d of %d whole GPUs published", n, rn.gpus-1)
	})

	ns := namespace(t, "real-node-migrate")
	objs := migratedSpecs(t)
	if err := cluster.PinToNode(objs, rn.name); err != nil {
		t.Fatal(err)
	}
	applier, err := cluster.NewApplier(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		// The DeviceClass of the extended-resources case is cluster-wide: it goes with the rest.
		if err := applier.Delete(ctx, objs, ns); err != nil {
			t.Errorf("delete the migrated specs: %v", err)
		}
		waitNoPods(t, objs, ns)
	})
	if err := applier.Apply(ctxFor(t, time.Minute), objs, ns); err != nil {
		t.Fatalf("the API server refuses a migrated spec: %v", err)
	}

	var pods []string
	for _, o := range objs {
		if o.GetKind() == "Pod" {
			pods = append(pods, o.GetName())
		}
	}
	ctx := ctxFor(t, 4*time.Minute)
	errs := make([]error, len(pods))
	var wg sync.WaitGroup
	for i, name := range pods {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p, err := waitPodSucceeded(ctx, ns, name)
			if err != nil {
				errs[i] = err
				return
			}
			for _, c := range p.Spec.Containers {
				out, err := podLogs(ctx, p, c.Name, false)
				if err != nil {
					errs[i] = errors.Join(errs[i], err)
					continue
				}
				if !strings.Contains(out, "cuda.device") || !strings.Contains(out, "done") {
					errs[i] = errors.Join(errs[i], fmt.Errorf("pod %s container %s saw no CUDA device:\n%s", name, c.Name, out))
				}
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}
