package e2etest

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	"tessera.dev/e2e/internal/cluster"
)

// The chart's release namespace in these scenarios: the one `make up` creates for tessera.
const chartNamespace = "tessera-system"

// helmBinary builds (or finds up to date) the pinned Helm and returns its path.
func helmBinary(t *testing.T) string {
	t.Helper()
	build := exec.Command(filepath.Join(e.repoRoot, "e2e", "scripts", "build-helm.sh"))
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("e2e/scripts/build-helm.sh: %v\n%s", err, out)
	}
	return filepath.Join(e.repoRoot, "e2e", "bin", "helm")
}

func chartDir() string { return filepath.Join(e.repoRoot, "deployments", "helm", "tessera") }

// helmTemplate renders the chart as `helm install` would for the cluster's own Kubernetes version.
func helmTemplate(t *testing.T, helm string, set ...string) ([]byte, error) {
	t.Helper()
	version, err := e.client.Discovery().ServerVersion()
	if err != nil {
		t.Fatalf("server version: %v", err)
	}
	args := []string{"template", "tessera", chartDir(), "--namespace", chartNamespace, "--include-crds",
		"--kube-version", version.GitVersion}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	var stderr bytes.Buffer
	cmd := exec.Command(helm, args...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("helm %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return out, nil
}

func renderChart(t *testing.T, helm string, set ...string) []*unstructured.Unstructured {
	t.Helper()
	out, err := helmTemplate(t, helm, set...)
	if err != nil {
		t.Fatal(err)
	}
	objs, err := cluster.Decode(out)
	if err != nil {
		t.Fatalf("helm template output does not parse: %v\n%s", err, out)
	}
	return objs
}

func kindsOf(objs []*unstructured.Unstructured) map[string]int {
	kinds := map[string]int{}
	for _, o := range objs {
		kinds[o.GetKind()]++
	}
	return kinds
}

func findObject(t *testing.T, objs []*unstructured.Unstructured, kind, name string) *unstructured.Unstructured {
	t.Helper()
	for _, o := range objs {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	t.Fatalf("the chart renders no %s %s (has %v)", kind, name, kindsOf(objs))
	return nil
}

func daemonSet(t *testing.T, objs []*unstructured.Unstructured, name string) appsv1.DaemonSet {
	t.Helper()
	var ds appsv1.DaemonSet
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(findObject(t, objs, "DaemonSet", name).Object, &ds); err != nil {
		t.Fatalf("DaemonSet %s: %v", name, err)
	}
	return ds
}

func containerEnv(ds appsv1.DaemonSet) map[string]string {
	env := map[string]string{}
	for _, v := range ds.Spec.Template.Spec.Containers[0].Env {
		env[v.Name] = v.Value
	}
	return env
}

func hostPaths(ds appsv1.DaemonSet) []string {
	var paths []string
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath != nil {
			paths = append(paths, v.HostPath.Path)
		}
	}
	sort.Strings(paths)
	return paths
}

// Every object the chart renders, for both backends, is accepted by the real API server (schema, CEL,
// admission) in a server-side dry run; nothing is persisted.
func TestTheChartRendersObjectsTheAPIServerAcceptsForBothBackends(t *testing.T) {
	helm := helmBinary(t)
	applier, err := cluster.NewApplier(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	applier.DryRun = true

	backends := map[string][]string{
		"nvml":      {"backend=nvml"},
		"simulated": {"backend=simulated", "simulated.gpus[0].model=H200-SXM-141GB", "simulated.gpus[0].count=4", "deviceClasses.migProfiles=true", "gpuPolicy.preset=mixed"},
	}
	for backend, set := range backends {
		t.Run(backend, func(t *testing.T) {
			objs := renderChart(t, helm, set...)
			kinds := kindsOf(objs)
			want := map[string]int{
				// The uninstall hook brings one ServiceAccount, ClusterRole(Binding), Role(Binding) and Pod; the
				// admission webhook one of each too, its Deployment, PodDisruptionBudget, Service, empty
				// certificate Secret and ValidatingWebhookConfiguration.
				"CustomResourceDefinition": 2, "ServiceAccount": 4, "ClusterRole": 4, "ClusterRoleBinding": 4,
				"Role": 4, "RoleBinding": 4, "ValidatingAdmissionPolicy": 3, "ValidatingAdmissionPolicyBinding": 3,
				"Deployment": 2, "PodDisruptionBudget": 2, "DaemonSet": 2, "GpuPolicy": 1, "Pod": 1,
				"Service": 1, "Secret": 1, "ValidatingWebhookConfiguration": 1,
				// Issue 38 (N2): the quota that admits system-node-critical pods outside kube-system (GKE).
				"ResourceQuota": 1,
			}
			for kind, n := range want {
				if kinds[kind] != n {
					t.Errorf("%d %s objects, want %d (all: %v)", kinds[kind], kind, n, kinds)
				}
			}
			if backend == "simulated" {
				if kinds["DeviceClass"] != 3+6 || kinds["ConfigMap"] != 1 {
					t.Errorf("simulated with MIG profile classes: %d DeviceClasses (want 9), %d ConfigMaps (want 1)", kinds["DeviceClass"], kinds["ConfigMap"])
				}
			} else if kinds["DeviceClass"] != 3 || kinds["ConfigMap"] != 0 {
				t.Errorf("nvml: %d DeviceClasses (want 3), %d ConfigMaps (want 0)", kinds["DeviceClass"], kinds["ConfigMap"])
			}

			// A dry run persists nothing, so the hook Pod's ServiceAccount admission needs the account itself.
			hookSA := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "tessera-uninstall", Namespace: chartNamespace}}
			if _, err := e.client.CoreV1().ServiceAccounts(chartNamespace).Create(ctxFor(t, 30*time.Second), hookSA, metav1.CreateOptions{}); err == nil {
				t.Cleanup(func() {
					_ = e.client.CoreV1().ServiceAccounts(chartNamespace).Delete(context.Background(), hookSA.Name, metav1.DeleteOptions{})
				})
			}
			start := time.Now()
			for _, o := range objs {
				if err := applier.ApplyOne(ctxFor(t, 30*time.Second), o, chartNamespace); err != nil {
					t.Errorf("the API server rejects the chart's %s/%s: %v", o.GetKind(), o.GetName(), err)
				}
			}
			t.Logf("%s: %d objects accepted in a server-side dry run (%s)", backend, len(objs), time.Since(start).Round(time.Millisecond))
		})
	}
}

// What a user installing on GPU nodes gets: the plugin on GPU nodes only, at kubelet's host paths, rolled
// with a surge; the MPS supervisor never restarted by an upgrade; the controller non-root and spread.
func TestTheChartsNodeComponentsUseTheHostPathsAndRollWithASurge(t *testing.T) {
	helm := helmBinary(t)
	objs := renderChart(t, helm, "backend=nvml", "driverRoot=/run/nvidia/driver")

	plugin := daemonSet(t, objs, "tessera-kubelet-plugin")
	ru := plugin.Spec.UpdateStrategy.RollingUpdate
	if plugin.Spec.UpdateStrategy.Type != appsv1.RollingUpdateDaemonSetStrategyType || ru == nil ||
		ru.MaxSurge.String() != "1" || ru.MaxUnavailable.String() != "0" {
		t.Errorf("plugin update strategy %+v, want RollingUpdate maxSurge 1 maxUnavailable 0", plugin.Spec.UpdateStrategy)
	}
	wantPaths := []string{"/dev", "/proc", "/run/nvidia/driver", "/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/lib/tessera", "/var/run/cdi"}
	if got := hostPaths(plugin); strings.Join(got, ",") != strings.Join(wantPaths, ",") {
		t.Errorf("plugin host paths %v, want %v", got, wantPaths)
	}
	// GPU nodes however they are labelled: GPU feature discovery, node feature discovery (vendor, and its
	// default class+vendor labels, issue 38 row 28), GKE (ORed terms).
	var terms []string
	if a := plugin.Spec.Template.Spec.Affinity; a != nil && a.NodeAffinity != nil && a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution != nil {
		for _, term := range a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
			for _, e := range term.MatchExpressions {
				terms = append(terms, e.Key+" "+string(e.Operator)+" "+strings.Join(e.Values, ","))
			}
		}
	}
	wantTerms := []string{"nvidia.com/gpu.present In true", "feature.node.kubernetes.io/pci-10de.present In true",
		"feature.node.kubernetes.io/pci-0302_10de.present In true", "feature.node.kubernetes.io/pci-0300_10de.present In true",
		"cloud.google.com/gke-accelerator Exists "}
	if strings.Join(terms, "|") != strings.Join(wantTerms, "|") {
		t.Errorf("plugin node affinity terms %q, want %q", terms, wantTerms)
	}
	if len(plugin.Spec.Template.Spec.NodeSelector) != 0 {
		t.Errorf("plugin node selector %v, want none (the affinity picks GPU nodes)", plugin.Spec.Template.Spec.NodeSelector)
	}
	env := containerEnv(plugin)
	for k, v := range map[string]string{
		"TESSERA_BACKEND": "nvml", "TESSERA_DRIVER_ROOT": "/run/nvidia/driver",
		"TESSERA_KUBELET_PLUGINS_DIR": "/var/lib/kubelet/plugins", "TESSERA_KUBELET_REGISTRY_DIR": "/var/lib/kubelet/plugins_registry",
		"TESSERA_CDI_DIR": "/var/run/cdi", "TESSERA_STATE_DIR": "/var/lib/tessera",
		"TESSERA_MPS_SUPERVISOR_SOCKET": "/var/lib/tessera/mps-supervisor.sock",
		// Issue 22 items 5 and 6: refuse next to another GPU manager; shares' PIDs through the host's /proc.
		"TESSERA_COEXISTENCE": "refuse", "TESSERA_HOST_PROC": "/host/proc",
		// Issue 26 item 3: device metadata for every prepared claim.
		"TESSERA_DEVICE_METADATA": "true",
		// Issue 38 (N1): the hook where the plugin installs it, under the state dir off GKE.
		"TESSERA_CDI_HOOK_DIR": "/var/lib/tessera/bin",
	} {
		if env[k] != v {
			t.Errorf("plugin env %s=%q, want %q", k, env[k], v)
		}
	}
	if plugin.Spec.Template.Spec.HostPID {
		t.Errorf("plugin pod has hostPID: the host's /proc, mounted read-only, is all the usage gauges need")
	}
	for _, m := range plugin.Spec.Template.Spec.Containers[0].VolumeMounts {
		if m.MountPath == "/host/proc" && !m.ReadOnly {
			t.Errorf("the host's /proc is mounted read-write at /host/proc")
		}
	}

	// The surge needs both: sockets named after the pod (else the new pod's collide with the old one's), and
	// readiness once kubelet registered the new pod (else the old one is stopped before the new one serves).
	podUID := ""
	for _, v := range plugin.Spec.Template.Spec.Containers[0].Env {
		if v.Name == "POD_UID" && v.ValueFrom != nil && v.ValueFrom.FieldRef != nil {
			podUID = v.ValueFrom.FieldRef.FieldPath
		}
	}
	if podUID != "metadata.uid" {
		t.Errorf("plugin env POD_UID from field %q, want the downward API's metadata.uid", podUID)
	}
	if rp := plugin.Spec.Template.Spec.Containers[0].ReadinessProbe; rp == nil || rp.HTTPGet == nil || rp.HTTPGet.Path != "/readyz" {
		t.Errorf("plugin readiness probe %+v, want GET /readyz (ready once kubelet registered the plugin)", rp)
	}

	supervisor := daemonSet(t, objs, "tessera-mps-supervisor")
	for _, ds := range []appsv1.DaemonSet{plugin, supervisor} {
		checkDriverRootMount(t, ds, "/run/nvidia/driver")
	}
	if supervisor.Spec.UpdateStrategy.Type != appsv1.OnDeleteDaemonSetStrategyType {
		t.Errorf("MPS supervisor update strategy %s, want OnDelete", supervisor.Spec.UpdateStrategy.Type)
	}
	// Every MPS server of the node runs in the supervisor's container: one memory limit over all of them
	// would let one OOM kill end every share.
	if lim := supervisor.Spec.Template.Spec.Containers[0].Resources.Limits; !lim.Memory().IsZero() {
		t.Errorf("MPS supervisor memory limit %s, want none (a request only)", lim.Memory())
	}
	if got := containerEnv(supervisor)["TESSERA_MPS_SUPERVISOR_SOCKET"]; got != env["TESSERA_MPS_SUPERVISOR_SOCKET"] {
		t.Errorf("supervisor socket %q, plugin's %q", got, env["TESSERA_MPS_SUPERVISOR_SOCKET"])
	}

	var controller appsv1.Deployment
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(findObject(t, objs, "Deployment", "tessera-controller").Object, &controller); err != nil {
		t.Fatal(err)
	}
	sc := controller.Spec.Template.Spec.Containers[0].SecurityContext
	if *controller.Spec.Replicas != 2 || sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		controller.Spec.Template.Spec.SecurityContext.RunAsNonRoot == nil || !*controller.Spec.Template.Spec.SecurityContext.RunAsNonRoot {
		t.Errorf("controller: %d replicas, container security %+v, pod security %+v; want 2, read-only root, non-root",
			*controller.Spec.Replicas, sc, controller.Spec.Template.Spec.SecurityContext)
	}
}

// checkDriverRootMount checks that a node DaemonSet mounts the host's driverRoot read-only at /driver-root,
// where later host mounts show through (a driver container started after the pod, an upgraded driver), and
// tells the binary both paths: it reads at /driver-root and names host paths in CDI specs.
func checkDriverRootMount(t *testing.T, ds appsv1.DaemonSet, driverRoot string) {
	t.Helper()
	var host string
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.Name == "driver-root" && v.HostPath != nil {
			host = v.HostPath.Path
		}
	}
	if host != driverRoot {
		t.Errorf("%s: driver-root volume from host path %q, want %q", ds.Name, host, driverRoot)
	}
	var mount *corev1.VolumeMount
	for i, m := range ds.Spec.Template.Spec.Containers[0].VolumeMounts {
		if m.Name == "driver-root" {
			mount = &ds.Spec.Template.Spec.Containers[0].VolumeMounts[i]
		}
	}
	if mount == nil || mount.MountPath != "/driver-root" || !mount.ReadOnly || mount.MountPropagation == nil ||
		*mount.MountPropagation != corev1.MountPropagationHostToContainer {
		t.Errorf("%s: driver-root mount %+v, want read-only at /driver-root with HostToContainer propagation", ds.Name, mount)
	}
	env := containerEnv(ds)
	if env["TESSERA_DRIVER_ROOT"] != driverRoot || env["TESSERA_CONTAINER_DRIVER_ROOT"] != "/driver-root" {
		t.Errorf("%s: TESSERA_DRIVER_ROOT=%q TESSERA_CONTAINER_DRIVER_ROOT=%q, want %q and /driver-root",
			ds.Name, env["TESSERA_DRIVER_ROOT"], env["TESSERA_CONTAINER_DRIVER_ROOT"], driverRoot)
	}
}

// A driver installed on the host (EKS/AKS GPU images, DGX OS, distribution packages, the GPU Operator with
// driver.enabled=false) is `driverRoot: /`: the host's root is mounted at /driver-root, not over the
// container's own, and the API server accepts both DaemonSets.
func TestTheChartMountsAHostInstalledDriverAtDriverRoot(t *testing.T) {
	objs := renderChart(t, helmBinary(t), "backend=nvml", "driverRoot=/")
	applier, err := cluster.NewApplier(e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	applier.DryRun = true
	for _, name := range []string{"tessera-kubelet-plugin", "tessera-mps-supervisor"} {
		checkDriverRootMount(t, daemonSet(t, objs, name), "/")
		if err := applier.ApplyOne(ctxFor(t, 30*time.Second), findObject(t, objs, "DaemonSet", name), chartNamespace); err != nil {
			t.Errorf("the API server rejects the DaemonSet %s with driverRoot=/: %v", name, err)
		}
	}
}

// The heartbeat Leases: the plugins renew theirs in the namespace the controller watches and read the
// controller's leader Lease by its name, so both components must get the same namespace and lease name; the
// plugin may write Leases there (patch: server-side apply), the controller may list and watch them.
func TestTheChartsPluginsHeartbeatWhereTheControllerWatches(t *testing.T) {
	objs := renderChart(t, helmBinary(t), "backend=simulated")
	plugin := daemonSet(t, objs, "tessera-kubelet-plugin")
	var controller appsv1.Deployment
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(findObject(t, objs, "Deployment", "tessera-controller").Object, &controller); err != nil {
		t.Fatal(err)
	}
	pluginEnv, controllerEnv := envSources(plugin.Spec.Template.Spec.Containers[0]), envSources(controller.Spec.Template.Spec.Containers[0])
	for _, k := range []string{"TESSERA_LEASE_NAMESPACE", "TESSERA_LEASE_NAME"} {
		if pluginEnv[k] == "" || pluginEnv[k] != controllerEnv[k] {
			t.Errorf("%s: plugin %q, controller %q; want one value in both", k, pluginEnv[k], controllerEnv[k])
		}
	}
	if got := pluginEnv["TESSERA_LEASE_NAMESPACE"]; got != "field metadata.namespace" {
		t.Errorf("plugin TESSERA_LEASE_NAMESPACE from %q, want the release namespace (field metadata.namespace)", got)
	}

	role := findObject(t, objs, "Role", "tessera-kubelet-plugin-leases")
	if role.GetNamespace() != chartNamespace || strings.Join(leaseVerbs(role), ",") != "get,create,patch,update" {
		t.Errorf("plugin lease Role in %q with lease verbs %v, want get,create,patch,update in %s", role.GetNamespace(), leaseVerbs(role), chartNamespace)
	}
	binding := findObject(t, objs, "RoleBinding", "tessera-kubelet-plugin-leases")
	subjects, _, _ := unstructured.NestedSlice(binding.Object, "subjects")
	if len(subjects) != 1 || subjects[0].(map[string]any)["name"] != "tessera-kubelet-plugin" {
		t.Errorf("plugin lease RoleBinding subjects %v, want the plugin's ServiceAccount only", subjects)
	}
	leader := findObject(t, objs, "Role", "tessera-controller-leader-election")
	if got := leaseVerbs(leader); !contains(got, "list") || !contains(got, "watch") {
		t.Errorf("controller lease verbs %v, want list and watch (it watches the plugins' heartbeat Leases)", got)
	}
	findObject(t, objs, "ValidatingAdmissionPolicy", "tessera-node-lease-own-node")
	findObject(t, objs, "ValidatingAdmissionPolicyBinding", "tessera-node-lease-own-node")
}

// envSources is each variable's value, or "field <path>" for one the downward API fills in.
func envSources(c corev1.Container) map[string]string {
	env := map[string]string{}
	for _, v := range c.Env {
		env[v.Name] = v.Value
		if v.ValueFrom != nil && v.ValueFrom.FieldRef != nil {
			env[v.Name] = "field " + v.ValueFrom.FieldRef.FieldPath
		}
	}
	return env
}

// leaseVerbs are the verbs a Role's rules grant on coordination.k8s.io leases.
func leaseVerbs(role *unstructured.Unstructured) []string {
	rules, _, _ := unstructured.NestedSlice(role.Object, "rules")
	var verbs []string
	for _, r := range rules {
		m := r.(map[string]any)
		if fmt.Sprint(m["apiGroups"]) == "[coordination.k8s.io]" && fmt.Sprint(m["resources"]) == "[leases]" {
			for _, v := range m["verbs"].([]any) {
				verbs = append(verbs, v.(string))
			}
		}
	}
	return verbs
}

// Issue 38 (N1, N10): on GKE (driverRoot /home/kubernetes/bin/nvidia) the hook goes where Container-Optimized
// OS can execute it, not on its noexec /var, and that host directory is mounted into the plugin at its host
// path; cdiHookDir overrides; with NVIDIA's hook nothing is installed and the specs call only the
// subcommands cdiHookFeatures names.
func TestTheChartInstallsTheCDIHookWhereTheNodeCanExecuteIt(t *testing.T) {
	helm := helmBinary(t)
	hookMount := func(ds appsv1.DaemonSet) (host, at string) {
		for _, v := range ds.Spec.Template.Spec.Volumes {
			if v.Name == "cdi-hook" && v.HostPath != nil {
				host = v.HostPath.Path
			}
		}
		for _, m := range ds.Spec.Template.Spec.Containers[0].VolumeMounts {
			if m.Name == "cdi-hook" {
				at = m.MountPath
			}
		}
		return host, at
	}
	for _, c := range []struct {
		set                []string
		wantDir, wantMount string
	}{
		{[]string{"backend=nvml", "driverRoot=/home/kubernetes/bin/nvidia"}, "/home/kubernetes/bin/tessera", "/home/kubernetes/bin/tessera"},
		{[]string{"backend=nvml", "driverRoot=/home/kubernetes/bin/nvidia", "cdiHookDir=/opt/tessera/bin"}, "/opt/tessera/bin", "/opt/tessera/bin"},
		// Under stateDir, which is mounted anyway.
		{[]string{"backend=nvml", "driverRoot=/"}, "/var/lib/tessera/bin", ""},
		{[]string{"backend=nvml", "stateDir=/home/kubernetes/bin/tessera-state"}, "/home/kubernetes/bin/tessera-state/bin", ""},
	} {
		plugin := daemonSet(t, renderChart(t, helm, c.set...), "tessera-kubelet-plugin")
		if got := containerEnv(plugin)["TESSERA_CDI_HOOK_DIR"]; got != c.wantDir {
			t.Errorf("--set %v: TESSERA_CDI_HOOK_DIR=%q, want %q", c.set, got, c.wantDir)
		}
		if host, at := hookMount(plugin); host != c.wantMount || at != c.wantMount {
			t.Errorf("--set %v: cdi-hook volume from host path %q mounted at %q, want both %q", c.set, host, at, c.wantMount)
		}
	}

	nvidia := daemonSet(t, renderChart(t, helm, "backend=nvml", "cdiHook=/usr/local/nvidia/toolkit/nvidia-cdi-hook",
		"cdiHookFeatures={enable-cuda-compat,disable-device-node-modification}"), "tessera-kubelet-plugin")
	env := containerEnv(nvidia)
	if env["TESSERA_CDI_HOOK"] != "/usr/local/nvidia/toolkit/nvidia-cdi-hook" ||
		env["TESSERA_CDI_HOOK_FEATURES"] != "enable-cuda-compat,disable-device-node-modification" {
		t.Errorf("with NVIDIA's hook: TESSERA_CDI_HOOK=%q TESSERA_CDI_HOOK_FEATURES=%q", env["TESSERA_CDI_HOOK"], env["TESSERA_CDI_HOOK_FEATURES"])
	}
	if _, ok := env["TESSERA_CDI_HOOK_DIR"]; ok {
		t.Errorf("with NVIDIA's hook nothing is installed, yet TESSERA_CDI_HOOK_DIR=%q", env["TESSERA_CDI_HOOK_DIR"])
	}
	if _, err := helmTemplate(t, helm, "cdiHook=/usr/bin/nvidia-cdi-hook", "cdiHookFeatures={enable-compat}"); err == nil ||
		!strings.Contains(err.Error(), "cdiHookFeatures") {
		t.Errorf("a misspelt cdiHookFeatures renders or does not name the value: %v", err)
	}
}

// Issue 38 (N2): GKE admits system-node-critical pods outside kube-system only in a namespace with a
// ResourceQuota scoped to that PriorityClass; the chart brings one to its namespace (none in kube-system,
// which has GKE's own), and priorityQuota.create=false leaves it out.
func TestTheChartAdmitsItsNodeCriticalPodsWithAPriorityClassQuota(t *testing.T) {
	helm := helmBinary(t)
	var quota corev1.ResourceQuota
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(findObject(t, renderChart(t, helm), "ResourceQuota", "tessera-critical-pods").Object, &quota); err != nil {
		t.Fatal(err)
	}
	var scopes []string
	if quota.Spec.ScopeSelector != nil {
		for _, e := range quota.Spec.ScopeSelector.MatchExpressions {
			scopes = append(scopes, string(e.ScopeName)+" "+string(e.Operator)+" "+strings.Join(e.Values, ","))
		}
	}
	if want := "PriorityClass In system-node-critical,system-cluster-critical"; strings.Join(scopes, "|") != want || quota.Namespace != chartNamespace {
		t.Errorf("quota %s/%s scopes %q, want %q in %s", quota.Namespace, quota.Name, scopes, want, chartNamespace)
	}
	if pods := quota.Spec.Hard[corev1.ResourcePods]; pods.Value() < 1_000_000 {
		t.Errorf("quota pods %s: it must admit, not limit", pods.String())
	}
	if kinds := kindsOf(renderChart(t, helm, "priorityQuota.create=false")); kinds["ResourceQuota"] != 0 {
		t.Errorf("priorityQuota.create=false renders %d ResourceQuotas", kinds["ResourceQuota"])
	}
}

// Issue 38 (row 26): with kubeletPlugin.maskDriverParams both node pods get a tmpfs for the copy of the
// driver's params they mount over their own /proc/driver/nvidia/params, and are told where it is; off by
// default, and never with the simulated backend (no driver module).
func TestTheChartsNodePodsMaskTheDriversParamsOnlyWhenAsked(t *testing.T) {
	helm := helmBinary(t)
	masked := func(ds appsv1.DaemonSet) bool {
		var tmpfs, mounted bool
		for _, v := range ds.Spec.Template.Spec.Volumes {
			if v.Name == "driver-params" && v.EmptyDir != nil && v.EmptyDir.Medium == corev1.StorageMediumMemory {
				tmpfs = true
			}
		}
		for _, m := range ds.Spec.Template.Spec.Containers[0].VolumeMounts {
			if m.Name == "driver-params" && m.MountPath == "/run/tessera-params" && !m.ReadOnly {
				mounted = true
			}
		}
		return tmpfs && mounted && containerEnv(ds)["TESSERA_DRIVER_PARAMS_MASK_DIR"] == "/run/tessera-params"
	}
	for _, c := range []struct {
		set  []string
		want bool
	}{
		{[]string{"backend=nvml"}, false},
		{[]string{"backend=nvml", "kubeletPlugin.maskDriverParams=true"}, true},
		{[]string{"backend=simulated", "kubeletPlugin.maskDriverParams=true"}, false},
	} {
		objs := renderChart(t, helm, c.set...)
		for _, name := range []string{"tessera-kubelet-plugin", "tessera-mps-supervisor"} {
			if got := masked(daemonSet(t, objs, name)); got != c.want {
				t.Errorf("--set %v: %s masks the driver's params: %v, want %v", c.set, name, got, c.want)
			}
		}
	}
}

// Values the chart cannot honour fail at `helm template`/`helm install` time, naming the value.
func TestTheChartRejectsBadValuesNamingThem(t *testing.T) {
	helm := helmBinary(t)
	for _, c := range []struct {
		set  []string
		want []string
	}{
		{[]string{"backend=cuda"}, []string{"backend", "nvml", "simulated"}},
		{[]string{"backend=simulated", "simulated.gpus[0].model=H100"}, []string{"model"}},
		{[]string{"gpuPolicy.preset=fancy"}, []string{"preset"}},
		{[]string{"driverRoot=run/nvidia/driver"}, []string{"driverRoot"}},
		{[]string{"kubeletPlugin.heartbeatInterval=60"}, []string{"heartbeatInterval", "heartbeatTimeout"}},
		{[]string{"stateDir=var/lib/tessera"}, []string{"stateDir"}},
	} {
		_, err := helmTemplate(t, helm, c.set...)
		if err == nil {
			t.Errorf("--set %v renders; want an error naming %v", c.set, c.want)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("--set %v: error does not mention %q: %v", c.set, w, err)
			}
		}
	}
}

// The chart reads deployments/crds, deployments/classes and deployments/policies through links, so the
// plain manifests the other tests and `make up` use are the chart's own; a copy would drift.
func TestTheChartsManifestsAreTheDeploymentsDirectories(t *testing.T) {
	for link, target := range map[string]string{
		"crds": "deployments/crds", "files/classes": "deployments/classes", "files/policies": "deployments/policies",
	} {
		resolved, err := filepath.EvalSymlinks(filepath.Join(chartDir(), link))
		if err != nil {
			t.Errorf("chart %s: %v", link, err)
			continue
		}
		want, _ := filepath.EvalSymlinks(filepath.Join(e.repoRoot, target))
		if resolved != want {
			t.Errorf("chart %s resolves to %s, want %s", link, resolved, want)
		}
		if fi, err := os.Lstat(filepath.Join(chartDir(), link)); err != nil || fi.Mode()&os.ModeSymlink == 0 {
			t.Errorf("chart %s is not a link to %s (a copy drifts)", link, target)
		}
	}
}
