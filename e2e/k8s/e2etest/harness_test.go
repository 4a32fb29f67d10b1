// Package e2etest runs tessera's end-to-end scenarios against the local cluster `make up` starts
// (e2e/scripts/e2e.sh starts a fresh one and runs this binary). Every scenario uses its own namespace
// and cleans up before the next one, so each starts from an empty cluster.
package e2etest

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"

	"tessera.dev/e2e/internal/cluster"
)

const driver = cluster.DriverName

var inventoryGVR = schema.GroupVersionResource{Group: "gpu.tessera.dev", Version: "v1alpha1", Resource: "nodeinventories"}

// env describes the running cluster; e2e.sh exports these, defaults match `make up`.
type env struct {
	repoRoot string
	runDir   string
	cfg      *rest.Config
	client   kubernetes.Interface
	dyn      dynamic.Interface
	nodes    []string
	gpus     int
	model    string
}

var e *env

func TestMain(m *testing.M) {
	var err error
	e, err = loadEnv()
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: %v\n(run through `make e2e`, or `make up` first)\n", err)
		os.Exit(2)
	}
	os.Exit(m.Run())
}

func getenv(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func loadEnv() (*env, error) {
	wd, err := os.Getwd()
	if err != nil {
		return nil, err
	}
	// go test runs in e2e/k8s/e2etest; the compiled binary is run from the repository root.
	root := getenv("E2E_REPO_ROOT", "")
	if root == "" {
		for dir := wd; dir != "/"; dir = filepath.Dir(dir) {
			if _, err := os.Stat(filepath.Join(dir, "e2e", "scripts", "up.sh")); err == nil {
				root = dir
				break
			}
		}
	}
	if root == "" {
		return nil, fmt.Errorf("cannot find the repository root from %s; set E2E_REPO_ROOT", wd)
	}
	runDir := getenv("RUN_DIR", filepath.Join(root, ".run"))
	kubeconfig := filepath.Join(runDir, "pki", "admin.kubeconfig")
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("failed to load %s: %w", kubeconfig, err)
	}
	cfg.QPS, cfg.Burst = 100, 200
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	nodes, err := strconv.Atoi(getenv("NODES", "2"))
	if err != nil {
		return nil, fmt.Errorf("NODES: %w", err)
	}
	gpus, err := strconv.Atoi(getenv("GPUS", "8"))
	if err != nil {
		return nil, fmt.Errorf("GPUS: %w", err)
	}
	prefix := getenv("NODE_PREFIX", "gpu-node-")
	en := &env{repoRoot: root, runDir: runDir, cfg: cfg, client: client, dyn: dyn, gpus: gpus, model: getenv("MODEL", "H100-SXM5-80GB")}
	for i := range nodes {
		en.nodes = append(en.nodes, fmt.Sprintf("%s%d", prefix, i))
	}
	return en, nil
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// proc runs e2e/scripts/proc.sh (restart/stop/start of one cluster process).
func proc(t *testing.T, action, name string) {
	t.Helper()
	cmd := exec.Command(filepath.Join(e.repoRoot, "e2e", "scripts", "proc.sh"), action, name)
	cmd.Env = append(os.Environ(), "RUN_DIR="+e.runDir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("proc.sh %s %s: %v\n%s\nlog: %s", action, name, err, out, filepath.Join(e.runDir, "logs", name+".log"))
	}
}

func procAlive(name string) bool {
	cmd := exec.Command(filepath.Join(e.repoRoot, "e2e", "scripts", "proc.sh"), "status", name)
	cmd.Env = append(os.Environ(), "RUN_DIR="+e.runDir)
	return cmd.Run() == nil
}

// namespace creates a fresh namespace and deletes it (waiting until its pods and claims are gone, so
// devices are free for the next scenario) when the test ends.
func namespace(t *testing.T, name string) string {
	t.Helper()
	ctx := ctxFor(t, 3*time.Minute)
	// A namespace of the same name may still be terminating: deleteNamespace returns once its pods and claims
	// are gone, not the namespace itself.
	err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		ns, err := e.client.CoreV1().Namespaces().Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err) || (err == nil && ns.DeletionTimestamp == nil), nil
	})
	if err != nil {
		t.Fatalf("namespace %s is still terminating from an earlier scenario: %v", name, err)
	}
	_, err = e.client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create namespace %s: %v", name, err)
	}
	t.Cleanup(func() { deleteNamespace(t, name) })
	// ServiceAccount admission refuses pods until kube-controller-manager has created the namespace's
	// `default` ServiceAccount, as on any cluster; wait for it rather than retry every create.
	err = wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		_, err := e.client.CoreV1().ServiceAccounts(name).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	})
	if err != nil {
		t.Fatalf("namespace %s has no default ServiceAccount after a minute (is kube-controller-manager's serviceaccount-controller running?): %v", name, err)
	}
	return name
}

// deleteNamespace deletes a scenario's namespace and returns once its pods and ResourceClaims are gone, which
// is what the next scenario depends on: the kubelet has unprepared the pods' claims and the scheduler sees
// their devices free. The namespace object itself is left to the namespace controller, whose passes over
// every API resource (the add-ons' CRDs included) took 5-10 s per namespace on 2 cores. Deleting the
// namespace first makes the API server refuse new pods in it, so a Deployment's ReplicaSet cannot replace
// the pods deleted here.
func deleteNamespace(t *testing.T, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := e.client.CoreV1().Namespaces().Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete namespace %s: %v", name, err)
		return
	}
	// Each pod keeps its own grace period: the kubelet still stops its containers and unprepares its claims.
	if err := e.client.CoreV1().Pods(name).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete the pods of namespace %s: %v", name, err)
	}
	if err := e.client.ResourceV1().ResourceClaims(name).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete the claims of namespace %s: %v", name, err)
	}
	var pods, claims int
	err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		p, err := e.client.CoreV1().Pods(name).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		c, err := e.client.ResourceV1().ResourceClaims(name).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		pods, claims = len(p.Items), len(c.Items)
		return pods == 0 && claims == 0, nil
	})
	if err != nil {
		t.Errorf("namespace %s still has pods or claims after 2m (pods left: %d, claims left: %d)", name, pods, claims)
	}
}

// --- builders -----------------------------------------------------------------------------------

// deviceClass creates (or keeps) a DeviceClass selecting tessera devices by the contract's `type`
// attribute plus an extra CEL condition. The scenarios use their own classes so they do not depend on
// how deployments/classes names its classes.
func deviceClass(t *testing.T, name, typ, extra string) string {
	t.Helper()
	expr := fmt.Sprintf(`device.driver == %q && device.attributes[%q].type == %q`, driver, driver, typ)
	if extra != "" {
		expr += " && " + extra
	}
	ctx := ctxFor(t, 30*time.Second)
	dc := &resourcev1.DeviceClass{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       resourcev1.DeviceClassSpec{Selectors: []resourcev1.DeviceSelector{{CEL: &resourcev1.CELDeviceSelector{Expression: expr}}}},
	}
	_, err := e.client.ResourceV1().DeviceClasses().Create(ctx, dc, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create DeviceClass %s: %v", name, err)
	}
	return name
}

func gpuClass(t *testing.T) string { return deviceClass(t, "e2e-gpu", "gpu", "") }
func mig3gClass(t *testing.T) string {
	return deviceClass(t, "e2e-mig-3g", "mig", fmt.Sprintf(`device.attributes[%q].profile.startsWith("3g.")`, driver))
}
func sharedClass(t *testing.T) string { return deviceClass(t, "e2e-shared", "shared", "") }

type claimOpt func(*resourcev1.ExactDeviceRequest, *resourcev1.DeviceClaim)

func count(n int64) claimOpt {
	return func(r *resourcev1.ExactDeviceRequest, _ *resourcev1.DeviceClaim) { r.Count = n }
}

func selector(expr string) claimOpt {
	return func(r *resourcev1.ExactDeviceRequest, _ *resourcev1.DeviceClaim) {
		r.Selectors = append(r.Selectors, resourcev1.DeviceSelector{CEL: &resourcev1.CELDeviceSelector{Expression: expr}})
	}
}

func capacity(reqs map[string]string) claimOpt {
	return func(r *resourcev1.ExactDeviceRequest, _ *resourcev1.DeviceClaim) {
		r.Capacity = &resourcev1.CapacityRequirements{Requests: map[resourcev1.QualifiedName]resource.Quantity{}}
		for k, v := range reqs {
			r.Capacity.Requests[resourcev1.QualifiedName(k)] = resource.MustParse(v)
		}
	}
}

// matchAttribute constrains every device of the claim to one value of a (fully qualified) attribute.
func matchAttribute(name string) claimOpt {
	return func(_ *resourcev1.ExactDeviceRequest, c *resourcev1.DeviceClaim) {
		c.Constraints = append(c.Constraints, resourcev1.DeviceConstraint{MatchAttribute: ptr.To(resourcev1.FullyQualifiedName(name))})
	}
}

func opaqueConfig(json string) claimOpt {
	return func(_ *resourcev1.ExactDeviceRequest, c *resourcev1.DeviceClaim) {
		c.Config = append(c.Config, resourcev1.DeviceClaimConfiguration{
			DeviceConfiguration: resourcev1.DeviceConfiguration{Opaque: &resourcev1.OpaqueDeviceConfiguration{
				Driver: driver, Parameters: runtime.RawExtension{Raw: []byte(json)},
			}},
		})
	}
}

// claimTemplate creates a ResourceClaimTemplate with one request "gpu" of the given class.
func claimTemplate(t *testing.T, ns, name, class string, opts ...claimOpt) string {
	t.Helper()
	req := resourcev1.ExactDeviceRequest{DeviceClassName: class, AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: 1}
	spec := resourcev1.DeviceClaim{}
	for _, o := range opts {
		o(&req, &spec)
	}
	spec.Requests = []resourcev1.DeviceRequest{{Name: "gpu", Exactly: &req}}
	tmpl := &resourcev1.ResourceClaimTemplate{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec:       resourcev1.ResourceClaimTemplateSpec{Spec: resourcev1.ResourceClaimSpec{Devices: spec}},
	}
	if _, err := e.client.ResourceV1().ResourceClaimTemplates(ns).Create(ctxFor(t, 30*time.Second), tmpl, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create ResourceClaimTemplate %s/%s: %v", ns, name, err)
	}
	return name
}

// pod creates a pod whose container uses one claim generated from the template; node pins it.
func pod(t *testing.T, ns, name, template, node string) *v1.Pod {
	t.Helper()
	return podUsing(t, ns, name, node, v1.PodResourceClaim{Name: "gpu", ResourceClaimTemplateName: ptr.To(template)})
}

// podUsing is a pause pod (on `node`, if not empty) whose one container uses `claim`, named "gpu".
func podUsing(t *testing.T, ns, name, node string, claim v1.PodResourceClaim) *v1.Pod {
	t.Helper()
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: v1.PodSpec{
			Containers: []v1.Container{{
				Name: "ctr", Image: "registry.k8s.io/pause:3.10",
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims:                []v1.PodResourceClaim{claim},
			TerminationGracePeriodSeconds: ptr.To[int64](1),
		},
	}
	if node != "" {
		p.Spec.NodeSelector = map[string]string{"kubernetes.io/hostname": node}
	}
	created, err := e.client.CoreV1().Pods(ns).Create(ctxFor(t, 30*time.Second), p, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", ns, name, err)
	}
	return created
}

// --- waits and reads ----------------------------------------------------------------------------

func waitRunning(t *testing.T, ns, name string, timeout time.Duration) *v1.Pod {
	t.Helper()
	ctx := ctxFor(t, timeout+10*time.Second)
	var p *v1.Pod
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		var err error
		p, err = e.client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		return p.Status.Phase == v1.PodRunning, nil
	})
	if err != nil {
		why := ""
		if p != nil {
			why = cluster.PodProblem(context.Background(), e.client, p)
		}
		t.Fatalf("pod %s/%s not Running after %s: %s", ns, name, timeout, why)
	}
	return p
}

func waitGone(t *testing.T, ns, name string, timeout time.Duration) {
	t.Helper()
	ctx := ctxFor(t, timeout+10*time.Second)
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		_, err := e.client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	if err != nil {
		t.Fatalf("pod %s/%s still exists after %s", ns, name, timeout)
	}
}

func deletePod(t *testing.T, ns, name string) {
	t.Helper()
	if err := e.client.CoreV1().Pods(ns).Delete(ctxFor(t, 30*time.Second), name, metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete pod %s/%s: %v", ns, name, err)
	}
}

// allocation is one allocated device of a running pod's claim, with what the kubelet stand-in saw.
type allocation struct {
	pod    *v1.Pod
	claim  *resourcev1.ResourceClaim
	result resourcev1.DeviceRequestAllocationResult
	edits  cluster.ContainerEdits
}

func allocations(t *testing.T, p *v1.Pod) []allocation {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	claims, err := cluster.PodClaims(ctx, e.client, p)
	if err != nil {
		t.Fatal(err)
	}
	edits, err := cluster.Edits(p)
	if err != nil {
		t.Fatal(err)
	}
	var out []allocation
	for _, c := range claims {
		if c.Status.Allocation == nil {
			t.Fatalf("claim %s/%s of running pod %s is not allocated", c.Namespace, c.Name, p.Name)
		}
		for _, r := range c.Status.Allocation.Devices.Results {
			if r.Driver != driver {
				continue
			}
			out = append(out, allocation{pod: p, claim: c, result: r, edits: edits[p.Spec.Containers[0].Name]})
		}
	}
	if len(out) == 0 {
		t.Fatalf("pod %s has no %s allocation", p.Name, driver)
	}
	return out
}

// sliceDevice finds a device in the node's ResourceSlices.
func sliceDevice(t *testing.T, node, device string) resourcev1.Device {
	t.Helper()
	slices, err := e.client.ResourceV1().ResourceSlices().List(ctxFor(t, 30*time.Second), metav1.ListOptions{FieldSelector: "spec.nodeName=" + node + ",spec.driver=" + driver})
	if err != nil {
		t.Fatalf("list slices: %v", err)
	}
	for _, s := range slices.Items {
		for _, d := range s.Spec.Devices {
			if d.Name == device {
				return d
			}
		}
	}
	t.Fatalf("device %s not in the ResourceSlices of %s", device, node)
	return resourcev1.Device{}
}

// countDevices counts the node's published devices whose name matches.
func countDevices(t *testing.T, node string, name *regexp.Regexp) int {
	t.Helper()
	slices, err := e.client.ResourceV1().ResourceSlices().List(ctxFor(t, 30*time.Second), metav1.ListOptions{FieldSelector: "spec.nodeName=" + node + ",spec.driver=" + driver})
	if err != nil {
		t.Fatalf("list slices: %v", err)
	}
	n := 0
	for _, s := range slices.Items {
		for _, d := range s.Spec.Devices {
			if name.MatchString(d.Name) {
				n++
			}
		}
	}
	return n
}

func attr(d resourcev1.Device, name string) resourcev1.DeviceAttribute {
	return d.Attributes[resourcev1.QualifiedName(name)]
}

// cdiSpecsMentioning lists CDI spec files in the node's CDI dir that contain s (a claim UID).
func cdiSpecsMentioning(t *testing.T, node, s string) []string {
	t.Helper()
	dir := filepath.Join(e.runDir, "nodes", node, "cdi")
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("read CDI dir %s: %v", dir, err)
	}
	var files []string
	for _, en := range entries {
		data, err := os.ReadFile(filepath.Join(dir, en.Name()))
		if err == nil && strings.Contains(string(data), s) {
			files = append(files, en.Name())
		}
	}
	return files
}

// simGPUInstance is one GPU instance in the simulated backend's hardware state file.
type simGPUInstance struct {
	ID        int `json:"id"`
	ProfileID int `json:"profileId"`
	Placement struct {
		Start int `json:"start"`
		Size  int `json:"size"`
	} `json:"placement"`
	ComputeInstances []struct {
		ID   int    `json:"id"`
		UUID string `json:"uuid"`
	} `json:"computeInstances"`
}

// simulatedGPUInstance reads the node's simulated hardware state (what NVML would report on a real GPU)
// and returns the GPU instance starting at memory slice start on GPU gpu.
func simulatedGPUInstance(t *testing.T, node string, gpu, start int) (simGPUInstance, bool) {
	t.Helper()
	return simulatedGPUInstanceIn(t, filepath.Join(e.runDir, "nodes", node, "plugin-state", "simulated-kernel", "simulated-gpus.json"), gpu, start)
}

// simulatedGPUInstanceIn reads the GPU instance at `start` on GPU `gpu` from a simulated backend's
// hardware state file (`<state dir>/simulated-kernel/simulated-gpus.json`).
func simulatedGPUInstanceIn(t *testing.T, path string, gpu, start int) (simGPUInstance, bool) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	var state struct {
		GPUs []struct {
			GPUInstances []simGPUInstance `json:"gpuInstances"`
		} `json:"gpus"`
	}
	if err := json.Unmarshal(data, &state); err != nil {
		t.Fatalf("parse %s: %v", path, err)
	}
	if gpu >= len(state.GPUs) {
		t.Fatalf("%s has %d GPUs, want index %d", path, len(state.GPUs), gpu)
	}
	for _, gi := range state.GPUs[gpu].GPUInstances {
		if gi.Placement.Start == start {
			return gi, true
		}
	}
	return simGPUInstance{}, false
}

// cdiID is the contract's CDI id for a claim's device.
func cdiID(a allocation) string {
	return fmt.Sprintf("k8s.gpu.tessera.dev/claim=%s-%s", a.claim.UID, a.result.Device)
}

var (
	wholeGPUName = regexp.MustCompile(`^gpu-\d+$`)
	mig3gName    = regexp.MustCompile(`^gpu-\d+-mig-3g-[a-z0-9-]+-\d+$`)
	// migDeviceName captures GPU index, encoded profile and placement start.
	migDeviceName = regexp.MustCompile(`^gpu-(\d+)-mig-([a-z0-9-]+)-(\d+)$`)
	sharedName    = regexp.MustCompile(`^gpu-\d+(-mig-[a-z0-9-]+-\d+)?-shared$|^gpu-\d+-share-\d+$`)
	anyName       = regexp.MustCompile(`^gpu-\d+(-mig-[a-z0-9-]+-\d+)?(-shared)?$|^gpu-\d+-share-\d+$`)
)

// checkPrepared asserts the contract's CDI wiring for one allocation: the CDI id, the spec file on the
// node and the env every tessera device gets.
func checkPrepared(t *testing.T, a allocation) map[string]string {
	t.Helper()
	if a.result.Pool != a.pod.Spec.NodeName {
		t.Errorf("%s: pool %q, want the node name %q", a.pod.Name, a.result.Pool, a.pod.Spec.NodeName)
	}
	if !contains(a.edits.CDIDevices, cdiID(a)) {
		t.Errorf("%s: CDI devices %v do not include %s", a.pod.Name, a.edits.CDIDevices, cdiID(a))
	}
	if files := cdiSpecsMentioning(t, a.pod.Spec.NodeName, string(a.claim.UID)); len(files) == 0 {
		t.Errorf("%s: no CDI spec for claim %s in %s's CDI dir", a.pod.Name, a.claim.UID, a.pod.Spec.NodeName)
	}
	env := a.edits.EnvMap()
	// void on every device: the CDI spec carries everything, NVIDIA's runtime must add nothing, and the env
	// merge of a multi-device claim stays consistent (kubelet-plugin/src/node/edits.rs).
	if env["NVIDIA_VISIBLE_DEVICES"] != "void" {
		t.Errorf("%s: NVIDIA_VISIBLE_DEVICES=%q, want void (env %v)", a.pod.Name, env["NVIDIA_VISIBLE_DEVICES"], a.edits.Env)
	}
	if env[uuidEnvKey(a.result.Device)] == "" {
		t.Errorf("%s: %s not set (env %v)", a.pod.Name, uuidEnvKey(a.result.Device), a.edits.Env)
	}
	if env["TESSERA_DEVICE"] != a.result.Device {
		t.Errorf("%s: TESSERA_DEVICE=%q, want %q", a.pod.Name, env["TESSERA_DEVICE"], a.result.Device)
	}
	return env
}

// uuidEnvKey is the env key the plugin names a device's UUID under: TESSERA_UUID_ + the device name in
// upper case with every other character as _ (gpu-1-mig-3g-40gb-4 → TESSERA_UUID_GPU_1_MIG_3G_40GB_4).
func uuidEnvKey(device string) string {
	var b strings.Builder
	b.WriteString("TESSERA_UUID_")
	for _, c := range device {
		switch {
		case c >= 'a' && c <= 'z':
			b.WriteRune(c - 'a' + 'A')
		case (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'):
			b.WriteRune(c)
		default:
			b.WriteByte('_')
		}
	}
	return b.String()
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func hasPrefix(list []string, prefix string) bool {
	for _, x := range list {
		if strings.HasPrefix(x, prefix) {
			return true
		}
	}
	return false
}

// slicesVersions maps each tessera ResourceSlice to its resourceVersion.
func slicesVersions(t *testing.T) map[string]string {
	t.Helper()
	list, err := e.client.ResourceV1().ResourceSlices().List(ctxFor(t, 30*time.Second), metav1.ListOptions{FieldSelector: "spec.driver=" + driver})
	if err != nil {
		t.Fatalf("list slices: %v", err)
	}
	m := map[string]string{}
	for _, s := range list.Items {
		m[s.Name] = s.ResourceVersion
	}
	return m
}

// stableSlices waits until no tessera ResourceSlice changed for `quiet`, and returns their versions.
// Taken before a restart, it separates churn caused by the restart from reconciling still in flight.
func stableSlices(t *testing.T, quiet, timeout time.Duration) map[string]string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	cur := slicesVersions(t)
	since := time.Now()
	for time.Since(since) < quiet {
		if time.Now().After(deadline) {
			t.Fatalf("ResourceSlices kept changing for %s", timeout)
		}
		time.Sleep(time.Second)
		next := slicesVersions(t)
		if !sameVersions(cur, next) {
			cur, since = next, time.Now()
		}
	}
	return cur
}

func sameVersions(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// heartbeat returns the NodeInventory's status.lastHeartbeatTime and status.ready.
func heartbeat(t *testing.T, node string) (string, bool) {
	t.Helper()
	u, err := e.dyn.Resource(inventoryGVR).Get(ctxFor(t, 30*time.Second), node, metav1.GetOptions{})
	if err != nil {
		return "", false
	}
	status, _ := u.Object["status"].(map[string]any)
	hb, _ := status["lastHeartbeatTime"].(string)
	ready, _ := status["ready"].(bool)
	return hb, ready
}

// waitFreshHeartbeat waits for a ready NodeInventory status written after `after`. A plugin that (re)starts
// writes its status first thing, so this is how a scenario knows the new process is up; a running plugin
// whose leader reads node Leases renews only its Lease (waitRenewed).
func waitFreshHeartbeat(t *testing.T, node string, after time.Time, timeout time.Duration) {
	t.Helper()
	ctx := ctxFor(t, timeout+5*time.Second)
	var last string
	err := wait.PollUntilContextTimeout(ctx, time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		hb, ready := heartbeat(t, node)
		last = hb
		ts, err := time.Parse(time.RFC3339, hb)
		return err == nil && ready && !ts.Before(after.Truncate(time.Second)), nil
	})
	if err != nil {
		t.Fatalf("NodeInventory %s: no ready heartbeat after %s within %s (last %q)", node, after.Format(time.RFC3339), timeout, last)
	}
}

// leaseNamespace is where the controller's leader Lease and the nodes' heartbeat Leases live: up.sh gives
// the host controller and plugins the chart's release namespace as their lease namespace.
const leaseNamespace = chartNamespace

// nodeLeaseRenewed returns the renewTime of the node's heartbeat Lease tessera-node-<node>, zero without one.
func nodeLeaseRenewed(ctx context.Context, node string) time.Time {
	l, err := e.client.CoordinationV1().Leases(leaseNamespace).Get(ctx, "tessera-node-"+node, metav1.GetOptions{})
	if err != nil || l.Spec.RenewTime == nil {
		return time.Time{}
	}
	return l.Spec.RenewTime.Time
}

// waitRenewed waits until the node's plugin has renewed either heartbeat after `after` (its Lease's
// renewTime or its inventory's lastHeartbeatTime, as the controller counts them) with a ready inventory.
func waitRenewed(t *testing.T, node string, after time.Time, timeout time.Duration) {
	t.Helper()
	ctx := ctxFor(t, timeout+5*time.Second)
	var last string
	err := wait.PollUntilContextTimeout(ctx, time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		hb, ready := heartbeat(t, node)
		renewed := nodeLeaseRenewed(ctx, node)
		last = fmt.Sprintf("lastHeartbeatTime %q, Lease renewTime %s, ready %v", hb, renewed.Format(time.RFC3339Nano), ready)
		ts, err := time.Parse(time.RFC3339, hb)
		return ready && ((err == nil && !ts.Before(after.Truncate(time.Second))) || renewed.After(after)), nil
	})
	if err != nil {
		t.Fatalf("node %s: no heartbeat renewed after %s within %s (last: %s)", node, after.Format(time.RFC3339), timeout, last)
	}
}
