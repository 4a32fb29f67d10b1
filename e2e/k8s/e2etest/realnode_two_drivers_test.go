package e2etest

// Issue 41 item 5: one claim that spans tessera and a second DRA driver on the real node. The second driver
// is e2e/k8s/cmd/fakenic, a fake NIC on upstream's kubelet-plugin helper, run as a host process of the
// cluster (procs/fakenic.sh, so `make down` stops it too) with an identity that may write only its own
// ResourceSlices.
//
// What kubelet does with such a claim (pkg/kubelet/cm/dra/manager.go, v1.37.2), which the assertions follow:
//   - prepareResources adds the claim to its cache with the pod's reference and checkpoints that *before*
//     calling any driver, then calls NodePrepareResources once per driver (a map: the order is not fixed)
//     and returns at the first failure. It does not unprepare the drivers that succeeded: the claim stays
//     cached as not prepared, the pod keeps failing with FailedPrepareDynamicResources, and each retry calls
//     the drivers again (prepare must be idempotent).
//   - unprepareResources, when the pod is deleted (or the reconcile loop finds it gone), calls
//     NodeUnprepareResources on every driver of the cached claim, prepared or not, and drops the claim
//     only when all of them succeeded. So "rolled back together" means: once the pod is gone, each
//     driver has unprepared the claim, whether its own prepare ran, succeeded or never happened; and a
//     driver must take an unprepare of a claim it never prepared (tessera: no record, nothing to do).
//     The failure cases make kubelet retry (pokeUntil) until the driver that does not fail has prepared,
//     so what is rolled back at delete is a prepared device of the other driver.
// Each driver must also leave the other's results alone (tessera prepares only gpu.tessera.dev results:
// kubelet-plugin/tests/state.rs results_of_other_drivers_are_left_alone and its unprepare/rollback
// siblings).

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"
)

// fakeNICDriver is cmd/fakenic's driver name.
const fakeNICDriver = "nic.e2e.tessera.dev"

// fakeNIC is the running second driver: where it keeps its record of prepared claims.
type fakeNIC struct{ stateFile string }

// startFakeNIC starts cmd/fakenic for the real node as a process of the cluster, with a ServiceAccount
// token whose RBAC covers ResourceSlices and reading claims, narrowed by a ValidatingAdmissionPolicy to
// slices of its own driver; it waits for its slice, and stops it (and removes what it was given) at the end.
func startFakeNIC(t *testing.T, rn realNodeEnv, ns string) fakeNIC {
	t.Helper()
	ctx := ctxFor(t, time.Minute)
	const sa, role = "fakenic", "e2e-fakenic"
	user := "system:serviceaccount:" + ns + ":" + sa
	if _, err := e.client.CoreV1().ServiceAccounts(ns).Create(ctx, &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create ServiceAccount %s/%s: %v", ns, sa, err)
	}
	cr := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: role}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceslices"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}},
		{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceclaims"}, Verbs: []string{"get"}},
	}}
	crb := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: role},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: role},
		Subjects: []rbacv1.Subject{{Kind: "ServiceAccount", Name: sa, Namespace: ns}}}
	// RBAC cannot tell one driver's slices from another's; this policy can.
	policy := &admissionregistrationv1.ValidatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: role},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionregistrationv1.Fail),
			MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionregistrationv1.RuleWithOperations{
					Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create, admissionregistrationv1.Update, admissionregistrationv1.Delete},
					Rule:       admissionregistrationv1.Rule{APIGroups: []string{"resource.k8s.io"}, APIVersions: []string{"*"}, Resources: []string{"resourceslices"}},
				}}}},
			MatchConditions: []admissionregistrationv1.MatchCondition{{Name: "the-fake-nic", Expression: fmt.Sprintf("request.userInfo.username == %q", user)}},
			Validations: []admissionregistrationv1.Validation{{
				Expression: fmt.Sprintf(`(request.operation == "DELETE" ? oldObject : object).spec.driver == %q`, fakeNICDriver),
				Message:    "the fake NIC driver may write only ResourceSlices of driver " + fakeNICDriver,
			}},
		}}
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: role},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: role,
			ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}}}
	rbac := e.client.RbacV1()
	adm := e.client.AdmissionregistrationV1()
	for what, create := range map[string]func() error{
		"ClusterRole": func() error { _, err := rbac.ClusterRoles().Create(ctx, cr, metav1.CreateOptions{}); return err },
		"ClusterRoleBinding": func() error {
			_, err := rbac.ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{})
			return err
		},
		"ValidatingAdmissionPolicy": func() error {
			_, err := adm.ValidatingAdmissionPolicies().Create(ctx, policy, metav1.CreateOptions{})
			return err
		},
		"ValidatingAdmissionPolicyBinding": func() error {
			_, err := adm.ValidatingAdmissionPolicyBindings().Create(ctx, binding, metav1.CreateOptions{})
			return err
		},
	} {
		if err := create(); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatalf("create %s %s: %v", what, role, err)
		}
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = adm.ValidatingAdmissionPolicyBindings().Delete(ctx, role, metav1.DeleteOptions{})
		_ = adm.ValidatingAdmissionPolicies().Delete(ctx, role, metav1.DeleteOptions{})
		_ = rbac.ClusterRoleBindings().Delete(ctx, role, metav1.DeleteOptions{})
		_ = rbac.ClusterRoles().Delete(ctx, role, metav1.DeleteOptions{})
	})

	tok, err := e.client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3600)}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("token for %s: %v", user, err)
	}
	dir := filepath.Join(rn.dir, "fakenic")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	ca := e.cfg.CAData
	if len(ca) == 0 && e.cfg.CAFile != "" {
		if ca, err = os.ReadFile(e.cfg.CAFile); err != nil {
			t.Fatal(err)
		}
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	kc := clientcmdapi.NewConfig()
	kc.Clusters["e2e"] = &clientcmdapi.Cluster{Server: e.cfg.Host, CertificateAuthorityData: ca}
	kc.AuthInfos[sa] = &clientcmdapi.AuthInfo{Token: tok.Status.Token}
	kc.Contexts["e2e"] = &clientcmdapi.Context{Cluster: "e2e", AuthInfo: sa}
	kc.CurrentContext = "e2e"
	if err := clientcmd.WriteToFile(*kc, kubeconfig); err != nil {
		t.Fatal(err)
	}
	node, err := e.client.CoreV1().Nodes().Get(ctx, rn.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The harness's way to run a host process: a launch script under procs/ that proc.sh starts (setsid,
	// pid file with start time, log under logs/), so `make down` stops it even if this test cannot.
	bin := filepath.Join(getenv("E2E_BIN_DIR", filepath.Join(e.repoRoot, "e2e", "bin")), "fakenic")
	script := fmt.Sprintf("#!/usr/bin/env bash\nexec %q --kubeconfig=%q --node-name=%q --node-uid=%q --kubelet-dir=%q --cdi-dir=%q --state-dir=%q --devices=4\n",
		bin, kubeconfig, rn.name, node.UID, filepath.Join(rn.dir, "kubelet"), rn.cdiDir, dir)
	if err := os.WriteFile(filepath.Join(e.runDir, "procs", "fakenic.sh"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	proc(t, "start", "fakenic")
	t.Cleanup(func() {
		proc(t, "stop", "fakenic")
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = e.client.ResourceV1().ResourceSlices().DeleteCollection(ctx, metav1.DeleteOptions{},
			metav1.ListOptions{FieldSelector: "spec.driver=" + fakeNICDriver})
	})
	waitFor(t, "the fake NIC's ResourceSlice", 30*time.Second, func(ctx context.Context) (bool, string) {
		list, err := e.client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{FieldSelector: "spec.driver=" + fakeNICDriver})
		if err != nil || len(list.Items) != 1 {
			return false, fmt.Sprintf("slices %v (err %v); log %s", len(list.Items), err, filepath.Join(e.runDir, "logs", "fakenic.log"))
		}
		return len(list.Items[0].Spec.Devices) == 4, fmt.Sprintf("%d devices", len(list.Items[0].Spec.Devices))
	})
	// Its identity may not touch another driver's slices.
	nicClient, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	foreign := &resourcev1.ResourceSlice{ObjectMeta: metav1.ObjectMeta{GenerateName: "fakenic-foreign-"},
		Spec: resourcev1.ResourceSliceSpec{Driver: driver, NodeName: ptr.To(rn.name),
			Pool: resourcev1.ResourcePool{Name: rn.name, ResourceSliceCount: 1}, Devices: []resourcev1.Device{{Name: "gpu-99"}}}}
	nicAPI, err := kubernetes.NewForConfig(nicClient)
	if err != nil {
		t.Fatal(err)
	}
	// A dry run passes admission like a real create and leaves nothing; the API server loads a new policy
	// within a second or so, hence the wait.
	waitFor(t, "the fake NIC's identity refused a slice of driver "+driver, 15*time.Second, func(ctx context.Context) (bool, string) {
		_, err := nicAPI.ResourceV1().ResourceSlices().Create(ctx, foreign, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err != nil && (apierrors.IsInvalid(err) || apierrors.IsForbidden(err)), fmt.Sprintf("create answered %v", err)
	})
	return fakeNIC{stateFile: filepath.Join(dir, "claims.json")}
}

// pokeUntil makes kubelet sync the failing pod until done() says the other driver prepared its claim:
// kubelet calls the claim's drivers in map order and stops at the first failure, so whether the one that
// does not fail was called depends on the attempt. An annotation change makes kubelet sync the pod at once
// (rather than after its 10-15 s back-off), each sync a new draw of the order. Go's small maps start their
// iteration at a random one of 8 slots, which favours insertion order; two such maps in a row still put
// either driver first in at least 14 of 64 syncs, so 40 syncs all miss with a chance of 0.78^40 (5e-5).
// Returns the syncs it took.
func pokeUntil(t *testing.T, ns, name, what string, done func() bool) int {
	t.Helper()
	for i := range 40 {
		if done() {
			return i
		}
		patch := fmt.Sprintf(`{"metadata":{"annotations":{"e2e.tessera.dev/poke":"%d"}}}`, i)
		if _, err := e.client.CoreV1().Pods(ns).Patch(ctxFor(t, 10*time.Second), name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
			t.Errorf("poke %s/%s: %v", ns, name, err)
			return i
		}
		time.Sleep(500 * time.Millisecond)
	}
	if !done() {
		t.Errorf("%s/%s: %s in none of 40 kubelet syncs", ns, name, what)
	}
	return 40
}

// records is the fake NIC's state: claim UID → its record.
func (n fakeNIC) records(t *testing.T) map[types.UID]json.RawMessage {
	t.Helper()
	out := map[types.UID]json.RawMessage{}
	data, err := os.ReadFile(n.stateFile)
	if os.IsNotExist(err) {
		return out
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &out); err != nil {
		t.Fatalf("%s: %v", n.stateFile, err)
	}
	return out
}

// tesseraHolds says whether tessera's checkpoint on the real node names the claim.
func (rn realNodeEnv) tesseraHolds(t *testing.T, uid types.UID) bool {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(rn.stateDir, "checkpoint.json"))
	if os.IsNotExist(err) {
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(string(data), string(uid))
}

// twoDriverPod runs the CUDA probe and prints FAKE_NIC, then holds its claim (requests gpu and nic of one
// claim, both in the container).
func twoDriverPod(t *testing.T, ns, name, template, node string) {
	t.Helper()
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			NodeSelector:   map[string]string{"kubernetes.io/hostname": node},
			Tolerations:    []v1.Toleration{{Key: "nvidia.com/gpu", Operator: v1.TolerationOpExists, Effect: v1.TaintEffectNoSchedule}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "devices", ResourceClaimTemplateName: ptr.To(template)}},
			Containers: []v1.Container{{
				Name: "probe", Image: probeImage, ImagePullPolicy: v1.PullNever,
				Command:   []string{"sh", "-c", `echo "FAKE_NIC=$FAKE_NIC"; cuda-probe 2>&1 | grep '^cuda\.device'; exec sleep 3600`},
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "devices"}}},
			}},
			TerminationGracePeriodSeconds: ptr.To[int64](1),
		},
	}
	if _, err := e.client.CoreV1().Pods(ns).Create(ctxFor(t, 30*time.Second), p, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod %s/%s: %v", ns, name, err)
	}
}

// claimOf waits for the pod's generated claim to be allocated and returns it.
func claimOf(t *testing.T, ns, name string) *resourcev1.ResourceClaim {
	t.Helper()
	var c *resourcev1.ResourceClaim
	waitFor(t, "the allocated claim of "+name, time.Minute, func(ctx context.Context) (bool, string) {
		p, err := e.client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil || len(p.Status.ResourceClaimStatuses) == 0 || p.Status.ResourceClaimStatuses[0].ResourceClaimName == nil {
			return false, fmt.Sprintf("no generated claim yet (err %v)", err)
		}
		c, err = e.client.ResourceV1().ResourceClaims(ns).Get(ctx, *p.Status.ResourceClaimStatuses[0].ResourceClaimName, metav1.GetOptions{})
		return err == nil && c.Status.Allocation != nil, fmt.Sprintf("claim not allocated (err %v)", err)
	})
	return c
}

func resultOf(c *resourcev1.ResourceClaim, drv string) resourcev1.DeviceRequestAllocationResult {
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver == drv {
			return r
		}
	}
	return resourcev1.DeviceRequestAllocationResult{}
}

func TestRealNodeClaimsSpanningTesseraAndASecondDriverPrepareTogetherAndRollBackTogether(t *testing.T) {
	rn := realNode(t)
	start := time.Now()
	installChart(t, rn)
	ns := namespace(t, "two-drivers")
	nic := startFakeNIC(t, rn, ns)
	// Runs before the fake NIC stops (cleanups run last first): kubelet needs both drivers to unprepare
	// the pods of a scenario that stopped early.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = e.client.CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
		_ = wait.PollUntilContextCancel(ctx, time.Second, true, func(ctx context.Context) (bool, error) {
			list, err := e.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			return err == nil && len(list.Items) == 0, nil
		})
	})
	waitChartPods(t, "plugin pod Ready on "+rn.name, "kubelet-plugin")
	waitFor(t, "whole GPUs published for "+rn.name, 2*time.Minute, func(ctx context.Context) (bool, string) {
		n := countDevices(t, rn.name, wholeGPUName)
		return n >= 3, fmt.Sprintf("%d whole GPUs published", n)
	})

	setUp := time.Now()
	t.Logf("set-up (chart, fake NIC, slices): %.1f s", setUp.Sub(start).Seconds())
	gpu := gpuClass(t)
	nicClass := "e2e-fakenic"
	dc := &resourcev1.DeviceClass{ObjectMeta: metav1.ObjectMeta{Name: nicClass}, Spec: resourcev1.DeviceClassSpec{
		Selectors: []resourcev1.DeviceSelector{{CEL: &resourcev1.CELDeviceSelector{Expression: fmt.Sprintf("device.driver == %q", fakeNICDriver)}}}}}
	if _, err := e.client.ResourceV1().DeviceClasses().Create(ctxFor(t, 30*time.Second), dc, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create DeviceClass %s: %v", nicClass, err)
	}
	opaque := func(drv, params string, requests ...string) resourcev1.DeviceClaimConfiguration {
		return resourcev1.DeviceClaimConfiguration{Requests: requests, DeviceConfiguration: resourcev1.DeviceConfiguration{
			Opaque: &resourcev1.OpaqueDeviceConfiguration{Driver: drv, Parameters: runtime.RawExtension{Raw: []byte(params)}}}}
	}
	template := func(name string, config ...resourcev1.DeviceClaimConfiguration) {
		req := func(name, class string) resourcev1.DeviceRequest {
			return resourcev1.DeviceRequest{Name: name, Exactly: &resourcev1.ExactDeviceRequest{
				DeviceClassName: class, AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: 1}}
		}
		tmpl := &resourcev1.ResourceClaimTemplate{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
			Spec: resourcev1.ResourceClaimTemplateSpec{Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
				Requests: []resourcev1.DeviceRequest{req("gpu", gpu), req("nic", nicClass)}, Config: config}}}}
		if _, err := e.client.ResourceV1().ResourceClaimTemplates(ns).Create(ctxFor(t, 30*time.Second), tmpl, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create ResourceClaimTemplate %s/%s: %v", ns, name, err)
		}
	}
	template("both")
	template("nic-fails", opaque(fakeNICDriver, `{"failPrepare":true}`, "nic"))
	// tessera's webhook admits this (it cannot know the node's GPUs); prepare refuses it, as it checks the
	// keys against the node (api/src/config.rs check_on_node): the real node has 6 GPUs, no gpu-9.
	template("gpu-fails", opaque(driver, `{`+gpuV1+`,"kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"perDevicePinnedMemoryLimit":{"gpu-9":"10Gi"}}}}`, "gpu"))

	// (a), (b) and (c) at once: their waits overlap.
	twoDriverPod(t, ns, "runs", "both", rn.name)
	twoDriverPod(t, ns, "nic-fails", "nic-fails", rn.name)
	twoDriverPod(t, ns, "gpu-fails", "gpu-fails", rn.name)

	claims := map[string]*resourcev1.ResourceClaim{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	run := func(name string, f func(c *resourcev1.ResourceClaim)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := claimOf(t, ns, name)
			mu.Lock()
			claims[name] = c
			mu.Unlock()
			f(c)
		}()
	}
	// (a) It runs; its log shows the GPU tessera gave it (by UUID) and the NIC the fake driver gave it.
	run("runs", func(c *resourcev1.ResourceClaim) {
		waitRunning(t, ns, "runs", 2*time.Minute)
		gpuDev, nicDev := resultOf(c, driver).Device, resultOf(c, fakeNICDriver).Device
		uuid := attr(sliceDevice(t, rn.name, gpuDev), "uuid").StringValue
		if uuid == nil {
			t.Errorf("device %s has no uuid attribute", gpuDev)
			return
		}
		wantNIC := "FAKE_NIC=" + nicDev
		wantGPU := regexp.MustCompile(`(?m)^cuda\.device index=0 uuid=` + regexp.QuoteMeta(*uuid) + ` `)
		var logs string
		waitFor(t, "the log of pod runs", 30*time.Second, func(ctx context.Context) (bool, string) {
			data, err := e.client.CoreV1().Pods(ns).GetLogs("runs", &v1.PodLogOptions{}).DoRaw(ctx)
			logs = string(data)
			return err == nil && strings.Contains(logs, wantNIC+"\n") && wantGPU.MatchString(logs), fmt.Sprintf("log %q (err %v)", logs, err)
		})
		t.Logf("runs (%s + %s/%s): %s", gpuDev, fakeNICDriver, nicDev, strings.TrimSpace(logs))
		if _, ok := nic.records(t)[c.UID]; !ok {
			t.Errorf("the fake NIC has no record of the running pod's claim %s", c.UID)
		}
		if !rn.tesseraHolds(t, c.UID) {
			t.Errorf("tessera's checkpoint has no record of the running pod's claim %s", c.UID)
		}
		if specs := rn.cdiSpecsFor(t, c.UID); len(specs) != 2 {
			t.Errorf("CDI specs naming claim %s: %v, want tessera's and the fake NIC's", c.UID, specs)
		}
	})
	// (b) The NIC side fails: the pod's event carries the fake driver's error, and tessera's prepare runs
	// too (pokeUntil), so the rollback below covers a GPU tessera prepared.
	run("nic-fails", func(c *resourcev1.ResourceClaim) {
		msg := waitPrepareFailure(t, ns, "nic-fails")
		if !strings.Contains(msg, fakeNICDriver+" refuses to prepare") {
			t.Errorf("nic-fails: FailedPrepareDynamicResources says %q, want the fake NIC's refusal", msg)
		}
		tries := pokeUntil(t, ns, "nic-fails", "tessera prepared its GPU", func() bool { return rn.tesseraHolds(t, c.UID) })
		t.Logf("nic-fails (tessera prepared after %d kubelet syncs): %s", tries, msg)
	})
	// (c) The tessera side fails, and the NIC's prepare runs too (pokeUntil).
	run("gpu-fails", func(c *resourcev1.ResourceClaim) {
		msg := waitPrepareFailure(t, ns, "gpu-fails")
		if !strings.Contains(msg, "gpu-9") {
			t.Errorf("gpu-fails: FailedPrepareDynamicResources says %q, want tessera's refusal of key gpu-9", msg)
		}
		tries := pokeUntil(t, ns, "gpu-fails", "the fake NIC prepared", func() bool {
			_, ok := nic.records(t)[c.UID]
			return ok
		})
		t.Logf("gpu-fails (the NIC prepared after %d kubelet syncs): %s", tries, msg)
	})
	wg.Wait()
	if t.Failed() {
		return
	}
	ran := time.Now()
	t.Logf("(a)-(c): %.1f s", ran.Sub(setUp).Seconds())
	defer func() { t.Logf("delete and unprepare: %.1f s", time.Since(ran).Seconds()) }()

	// (d) and the rollbacks: once each pod is gone, neither driver has a record or a CDI spec of its claim.
	for _, name := range []string{"runs", "nic-fails", "gpu-fails"} {
		deletePod(t, ns, name)
	}
	for _, name := range []string{"runs", "nic-fails", "gpu-fails"} {
		waitGone(t, ns, name, time.Minute)
	}
	waitFor(t, "both drivers unprepared every claim", 30*time.Second, func(ctx context.Context) (bool, string) {
		var left []string
		records := nic.records(t)
		for name, c := range claims {
			if _, ok := records[c.UID]; ok {
				left = append(left, name+": the fake NIC's record")
			}
			if rn.tesseraHolds(t, c.UID) {
				left = append(left, name+": tessera's checkpoint entry")
			}
			if specs := rn.cdiSpecsFor(t, c.UID); len(specs) > 0 {
				left = append(left, fmt.Sprintf("%s: CDI specs %v", name, specs))
			}
		}
		return len(left) == 0, strings.Join(left, "; ")
	})
}
