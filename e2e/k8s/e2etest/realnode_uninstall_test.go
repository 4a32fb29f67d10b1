package e2etest

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// driverSlices counts the ResourceSlices of tessera's driver, all of them or those of one node.
func driverSlices(ctx context.Context, node string) (int, error) {
	selector := "spec.driver=" + driver
	if node != "" {
		selector += ",spec.nodeName=" + node
	}
	list, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: selector})
	if err != nil {
		return 0, err
	}
	return len(list.Items), nil
}

// `helm uninstall` runs the chart's pre-delete hook, which leaves no ResourceSlice of the driver (the
// stand-in nodes' included, which kubelet never deletes) and no leader Lease, so a reinstall publishes as
// soon as its controller starts instead of waiting out a deleted pod's Lease.
func TestRealNodeUninstallLeavesNoDeviceAndAReinstallLeadsAtOnce(t *testing.T) {
	rn := realNode(t)
	kubeconfig := filepath.Join(e.runDir, "pki", "admin.kubeconfig")
	proc(t, "stop", "controller")
	t.Cleanup(func() {
		cmd := exec.Command(helmBinary(t), "uninstall", "tessera", "--namespace", chartNamespace, "--wait", "--timeout", "120s",
			"--ignore-not-found", "--kubeconfig", kubeconfig)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("helm uninstall: %v\n%s", err, out)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = e.dyn.Resource(inventoryGVR).Delete(ctx, rn.name, metav1.DeleteOptions{})
		_ = e.client.CoordinationV1().Leases(chartNamespace).Delete(ctx, "tessera-node-"+rn.name, metav1.DeleteOptions{})
		proc(t, "start", "controller")
		waitStandInsPublished(t)
	})
	install := func() time.Time {
		helmRun(t, append([]string{"install", "tessera", chartDir(), "--namespace", chartNamespace}, helmSetArgs(rn.chartValues())...)...)
		at := time.Now()
		waitChartWebhookServing(t)
		return at
	}
	published := func(what string, since time.Time) time.Duration {
		waitFor(t, what, 3*time.Minute, func(ctx context.Context) (bool, string) {
			n, err := driverSlices(ctx, rn.name)
			return err == nil && n > 0, fmt.Sprintf("%d slices of %s (err %v)", n, rn.name, err)
		})
		return time.Since(since)
	}

	installed := install()
	first := published("the first install publishes the real node", installed)
	before, err := driverSlices(ctxFor(t, 30*time.Second), "")
	if err != nil || before == 0 {
		t.Fatalf("no slices of %s before the uninstall (%d, %v)", driver, before, err)
	}

	began := time.Now()
	helmRun(t, "uninstall", "tessera", "--namespace", chartNamespace, "--wait", "--timeout", "120s")
	took := time.Since(began)
	left, err := driverSlices(ctxFor(t, 30*time.Second), "")
	if err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Fatalf("%d of %d ResourceSlices of %s outlived helm uninstall: the scheduler would keep allocating them", left, before, driver)
	}
	_, err = e.client.CoordinationV1().Leases(chartNamespace).Get(ctxFor(t, 30*time.Second), "tessera-controller", metav1.GetOptions{})
	if !apierrors.IsNotFound(err) {
		t.Fatalf("the leader Lease outlived helm uninstall (get: %v)", err)
	}
	// A webhook configuration without its webhook, failing closed, would refuse every claim of the cluster.
	_, err = e.client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctxFor(t, 30*time.Second), chartWebhookConfig, metav1.GetOptions{})
	if !apierrors.IsNotFound(err) {
		t.Fatalf("ValidatingWebhookConfiguration %s outlived helm uninstall (get: %v)", chartWebhookConfig, err)
	}

	reinstalled := install()
	again := published("the reinstall publishes the real node", reinstalled)
	t.Logf("slices of the driver before uninstall: %d, after: 0; helm uninstall took %.1f s; first install published the real node in %.1f s, the reinstall in %.1f s",
		before, took.Seconds(), first.Seconds(), again.Seconds())
}
