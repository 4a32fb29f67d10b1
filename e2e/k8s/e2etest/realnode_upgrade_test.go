package e2etest

// The driver's life under the chart on the real node (issue 22, "Upgrades and boot"; issue 38 item 4): at
// boot the node pods wait in their init container while the driver root is empty and start once a driver is
// mounted there, as a GPU Operator driver container does. An upgrade goes as under the Operator: the
// simulated module cannot be swapped (`tessera-kubelet-plugin simulate upgrade-driver`: "Module nvidia is in
// use") while the plugin holds NVML; the node is labelled as the Operator's upgrade controller does when it
// restarts the driver pod (`nvidia.com/gpu-driver-upgrade-state=pod-restart-required`), the plugin lets go
// (exit 75, restarted, waiting without the driver), the swap goes through (new versioned libraries, soname
// links repointed, the kernel module's version changed), the label moves on (`upgrade-done`) and the plugin
// serves on the new driver; new pods get the new libraries, and a pod that runs through it keeps its own.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
)

// upgradedDriverVersion is the version the scenario upgrades the simulated driver to.
const upgradedDriverVersion = "580.200.01"

// driverChangedExitCode is the plugin's exit status when the driver changed under it or it let go of the
// driver for an upgrade (kubelet-plugin/src/gpu/driver_watch.rs, DRIVER_CHANGED_EXIT_CODE; driver_upgrade.rs,
// RELEASED_EXIT_CODE).
const driverChangedExitCode = 75

// upgradeStateLabel is the GPU Operator upgrade controller's node label (NVIDIA/k8s-operator-libs,
// pkg/upgrade/consts.go).
const upgradeStateLabel = "nvidia.com/gpu-driver-upgrade-state"

// tryUpgradeDriver is upgradeDriver that reports the refusal instead of failing the test.
func (rn realNodeEnv) tryUpgradeDriver(version string) (string, error) {
	out, err := exec.Command(filepath.Join(e.repoRoot, "target", "debug", "tessera-kubelet-plugin"), "simulate", "upgrade-driver", "--root", rn.driverRoot, "--version", version).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

var nvrmVersion = regexp.MustCompile(`Kernel Module\s+(\d+(?:\.\d+)+)`)

// kernelDriverVersion is the version the simulated kernel module reports (its /proc/driver/nvidia/version).
func (rn realNodeEnv) kernelDriverVersion(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(rn.kernel, "proc", "driver", "nvidia", "version"))
	if err != nil {
		t.Fatalf("the simulated kernel module's version: %v", err)
	}
	m := nvrmVersion.FindStringSubmatch(string(data))
	if m == nil {
		t.Fatalf("no version in the simulated kernel's version file:\n%s", data)
	}
	return m[1]
}

func pluginBinary(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(e.repoRoot, "target", "debug", "tessera-kubelet-plugin")
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("the debug plugin binary: %v (cargo build --workspace)", err)
	}
	return bin
}

// upgradeDriver upgrades the real node's simulated driver root in place to `version`.
func (rn realNodeEnv) upgradeDriver(t *testing.T, version string) {
	t.Helper()
	out, err := exec.Command(pluginBinary(t), "simulate", "upgrade-driver", "--root", rn.driverRoot, "--version", version).CombinedOutput()
	if err != nil {
		t.Fatalf("simulate upgrade-driver --version %s: %v\n%s", version, err, out)
	}
	t.Logf("%s", strings.TrimSpace(string(out)))
}

func runCmd(t *testing.T, name string, args ...string) {
	t.Helper()
	if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
}

// containerLog is `kubectl logs` of one instance of a container of a pod on the real node: its current
// instance when restart is the restart count p shows, `kubectl logs -p` for the one before (the kubelet
// keeps no older ones). What went wrong reading it, if anything, in its place.
func (rn realNodeEnv) containerLog(p *v1.Pod, container string, restart int32) string {
	var current *int32
	for _, s := range append(append([]v1.ContainerStatus{}, p.Status.InitContainerStatuses...), p.Status.ContainerStatuses...) {
		if s.Name == container {
			current = &s.RestartCount
		}
	}
	if current == nil {
		return fmt.Sprintf("pod %s has no status for container %s", p.Name, container)
	}
	if restart != *current && restart != *current-1 {
		return fmt.Sprintf("pod %s container %s: instance %d is gone (restart count %d; kubectl logs keeps the current and the previous one)", p.Name, container, restart, *current)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	log, err := podLogs(ctx, p, container, restart != *current)
	if err != nil {
		return err.Error()
	}
	return log
}

func chartPluginPod(ctx context.Context) (*v1.Pod, error) {
	pods, err := podsOf(ctx, "kubelet-plugin")
	if err != nil {
		return nil, err
	}
	if len(pods) != 1 {
		return nil, fmt.Errorf("%d plugin pods", len(pods))
	}
	return &pods[0], nil
}

func containerStatus(p *v1.Pod, name string) *v1.ContainerStatus {
	for i := range p.Status.ContainerStatuses {
		if p.Status.ContainerStatuses[i].Name == name {
			return &p.Status.ContainerStatuses[i]
		}
	}
	return nil
}

// probeDriverVersion is what the CUDA probe's NVML said the driver is (`nvml.driver rc=0 version=…`).
func probeDriverVersion(v seen) string {
	for _, l := range v.probeLines {
		if strings.HasPrefix(l, "nvml.driver rc=0 version=") {
			return strings.TrimPrefix(l, "nvml.driver rc=0 version=")
		}
	}
	return ""
}

// specLibcuda is the host path the claim's CDI specs mount libcuda.so.<version> from, by version.
func (rn realNodeEnv) specLibcudas(t *testing.T, uid types.UID) []string {
	t.Helper()
	var out []string
	for _, f := range rn.cdiSpecsFor(t, uid) {
		data, err := os.ReadFile(filepath.Join(rn.cdiDir, f))
		if err != nil {
			t.Fatalf("read %s: %v", f, err)
		}
		var spec struct {
			ContainerEdits struct {
				Mounts []struct {
					HostPath string `json:"hostPath"`
				} `json:"mounts"`
			} `json:"containerEdits"`
			Devices []struct {
				ContainerEdits struct {
					Mounts []struct {
						HostPath string `json:"hostPath"`
					} `json:"mounts"`
				} `json:"containerEdits"`
			} `json:"devices"`
		}
		if err := json.Unmarshal(data, &spec); err != nil {
			t.Fatalf("parse %s: %v", f, err)
		}
		paths := []string{}
		for _, m := range spec.ContainerEdits.Mounts {
			paths = append(paths, m.HostPath)
		}
		for _, d := range spec.Devices {
			for _, m := range d.ContainerEdits.Mounts {
				paths = append(paths, m.HostPath)
			}
		}
		for _, p := range paths {
			if base := filepath.Base(p); strings.HasPrefix(base, "libcuda.so.") && strings.Count(base, ".") > 2 {
				out = append(out, base)
			}
		}
	}
	return out
}

func TestRealNodeDriverUpgradeAndBootThePluginWaitsForTheDriverAndRestartsOnANewOne(t *testing.T) {
	rn := realNode(t)
	start := time.Now()
	original := rn.kernelDriverVersion(t)
	if original == upgradedDriverVersion {
		t.Fatalf("the real node's driver is already %s: a run before this one left it upgraded", original)
	}

	// Boot: the driver root is empty when the chart is installed, as /run/nvidia/driver is until the GPU
	// Operator's driver container mounts its root there. The driver's files stay reachable at a private
	// bind mount beside it; an empty tmpfs goes over the root (shared, as the root is: the chart's pods mount
	// it with HostToContainer propagation), and "the driver container" later bind mounts the files on top.
	real := filepath.Join(rn.dir, "driver-root-real")
	if err := os.MkdirAll(real, 0o755); err != nil {
		t.Fatal(err)
	}
	runCmd(t, "mount", "--bind", rn.driverRoot, real)
	runCmd(t, "mount", "--make-private", real)
	runCmd(t, "mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tessera-empty-driver-root", rn.driverRoot)
	runCmd(t, "mount", "--make-rshared", rn.driverRoot)
	mounted := false
	t.Cleanup(func() {
		// Deepest first: the driver's bind (once mounted), the tmpfs, then the private view.
		if mounted {
			_ = exec.Command("umount", rn.driverRoot).Run()
		}
		_ = exec.Command("umount", rn.driverRoot).Run()
		_ = exec.Command("umount", real).Run()
		if got, err := os.Stat(filepath.Join(rn.driverRoot, "tessera-sim")); err != nil || got == nil {
			t.Errorf("the real node's driver root is not back after the scenario: %v", err)
		}
	})
	// The driver the scenarios after this one expect, after the chart is gone (cleanups run last first).
	t.Cleanup(func() {
		if v := rn.kernelDriverVersion(t); v != original {
			rn.upgradeDriver(t, original)
		}
	})
	installChart(t, rn)

	ok := t.Run("boot: the node pods wait in wait-for-driver while the driver root is empty and start once the driver is mounted", func(t *testing.T) {
		var waiting *v1.Pod
		waitFor(t, "the plugin pod waiting in its init container with a message", 2*time.Minute, func(ctx context.Context) (bool, string) {
			p, err := chartPluginPod(ctx)
			if err != nil {
				return false, err.Error()
			}
			if len(p.Status.InitContainerStatuses) != 1 || p.Status.InitContainerStatuses[0].State.Running == nil {
				return false, fmt.Sprintf("phase %s, init statuses %+v", p.Status.Phase, p.Status.InitContainerStatuses)
			}
			waiting = p
			log := rn.containerLog(p, "wait-for-driver", 0)
			return strings.Contains(log, "waiting for the NVIDIA driver under /driver-root"), "init log: " + log
		})
		// Waiting is not failing: a while later it still waits, unrestarted, and nothing else started.
		time.Sleep(5 * time.Second)
		ctx := ctxFor(t, time.Minute)
		p, err := e.client.CoreV1().Pods(chartNamespace).Get(ctx, waiting.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		init := p.Status.InitContainerStatuses[0]
		if p.Status.Phase != v1.PodPending || init.State.Running == nil || init.RestartCount != 0 {
			t.Errorf("plugin pod while the driver root is empty: phase %s, init %+v; want Pending (Init:0/1), the init container running, no restart", p.Status.Phase, init)
		}
		log := rn.containerLog(p, "wait-for-driver", 0)
		t.Logf("wait-for-driver while the root is empty:\n%s", log)
		for _, want := range []string{"libnvidia-ml.so.1 in none of /driver-root/", "the nvidia module is not loaded", "the driver root is empty", "host " + rn.driverRoot} {
			if !strings.Contains(log, want) {
				t.Errorf("the init container's log does not say %q:\n%s", want, log)
			}
		}
		sups, err := podsOf(ctx, "mps-supervisor")
		if err != nil || len(sups) != 1 || len(sups[0].Status.InitContainerStatuses) != 1 || sups[0].Status.InitContainerStatuses[0].State.Running == nil {
			t.Errorf("the MPS supervisor pod while the driver root is empty: %v %+v; want it waiting in wait-for-driver too", err, sups)
		}

		appeared := time.Now()
		runCmd(t, "mount", "--bind", real, rn.driverRoot)
		mounted = true
		waitFor(t, "the plugin pod Ready once the driver is mounted", 2*time.Minute, func(ctx context.Context) (bool, string) {
			p, err := e.client.CoreV1().Pods(chartNamespace).Get(ctx, waiting.Name, metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			n, states := readyPods([]v1.Pod{*p})
			return n == 1, strings.Join(states, "; ")
		})
		t.Logf("the plugin pod was Ready %s after the driver appeared", time.Since(appeared).Round(100*time.Millisecond))
		if log := rn.containerLog(waiting, "wait-for-driver", 0); !strings.Contains(log, "the NVIDIA driver "+original+" is installed") {
			t.Errorf("the init container's log does not say the driver %s is installed:\n%s", original, log)
		}
		waitFor(t, "the MPS supervisor pod Running", time.Minute, func(ctx context.Context) (bool, string) {
			pods, err := podsOf(ctx, "mps-supervisor")
			if err != nil {
				return false, err.Error()
			}
			n, states := readyPods(pods)
			return n == 1, strings.Join(states, "; ")
		})
		waitFor(t, "NodeInventory "+rn.name+" ready", time.Minute, func(ctx context.Context) (bool, string) {
			hb, ready := heartbeat(t, rn.name)
			return ready, "lastHeartbeatTime " + hb
		})
	})
	if !ok {
		return
	}

	t.Run("upgrade: the plugin lets go of the driver for the Operator's swap and serves on the new one, new pods get its libraries, and a running pod keeps its own", func(t *testing.T) {
		ctx := ctxFor(t, 8*time.Minute)
		ns := namespace(t, "driver-upgrade")
		claimTemplate(t, ns, "whole", gpuClass(t))
		// The holding container lists the driver libraries it has and reads its libcuda.so.1 every second.
		running := workloadPod(ns, "through-upgrade", rn.name).withClaimFrom("whole")
		running.pod.Spec.Containers[0].Command = []string{"sh", "-c",
			`while true; do echo "sees $(ls /usr/lib/x86_64-linux-gnu | grep -E '^lib(cuda|nvidia-ml)\.so\.' | sort | tr '\n' ' ')` +
				`reads $(cat /usr/lib/x86_64-linux-gnu/libcuda.so.1 | wc -c)"; sleep 1; done`}
		before := waitRunning(t, ns, running.create(t).Name, 3*time.Minute)
		beforeClaim, devices := realAllocations(t, before)
		v := insideView(t, before)
		rn.checkInside(t, before, v, devices)
		if got := probeDriverVersion(v); got != original {
			t.Errorf("before the upgrade the probe's NVML reports driver %q, want %s\n%s", got, original, strings.Join(v.probeLines, "\n"))
		}
		if got := rn.specLibcudas(t, beforeClaim.UID); len(got) == 0 || got[0] != "libcuda.so."+original {
			t.Errorf("before the upgrade the claim's CDI spec mounts %v, want libcuda.so.%s", got, original)
		}
		report, _ := rn.lastReport(t, before)
		if !strings.Contains(report, "libcuda.so."+original+" ") {
			t.Errorf("the running pod does not see libcuda.so.%s: %s", original, report)
		}

		plugin, err := chartPluginPod(ctx)
		if err != nil {
			t.Fatal(err)
		}
		restarts := containerStatus(plugin, "plugin").RestartCount

		// The plugin holds NVML: the module cannot be swapped, as rmmod refuses on a real node.
		if out, err := rn.tryUpgradeDriver(upgradedDriverVersion); err == nil || !strings.Contains(out, "Module nvidia is in use") {
			t.Fatalf("the driver swap under the serving plugin: %v %s; want it refused with \"Module nvidia is in use\"", err, out)
		}
		// The Operator restarts the driver pod: the plugin lets go and the swap goes through.
		t.Cleanup(func() { patchNode(t, rn.name, `{"metadata":{"labels":{"`+upgradeStateLabel+`":null}}}`) })
		upgraded := time.Now()
		patchNode(t, rn.name, `{"metadata":{"labels":{"`+upgradeStateLabel+`":"pod-restart-required"}}}`)
		waitFor(t, "the driver swap once the plugin released the driver", 2*time.Minute, func(context.Context) (bool, string) {
			out, err := rn.tryUpgradeDriver(upgradedDriverVersion)
			return err == nil, out
		})
		t.Logf("the driver was swapped %s after the node was labelled", time.Since(upgraded).Round(100*time.Millisecond))
		// Restarted, and waiting without the driver (still registered with kubelet, so it may show Ready).
		// kubelet restarts the container a moment after the driver is free, so the label moves on only
		// once the new process is seen waiting: moved on earlier, it would start on the new driver at once.
		waitFor(t, "the restarted plugin waiting without the driver", 2*time.Minute, func(ctx context.Context) (bool, string) {
			p, err := chartPluginPod(ctx)
			if err != nil {
				return false, err.Error()
			}
			s := containerStatus(p, "plugin")
			if s == nil || s.RestartCount <= restarts {
				return false, fmt.Sprintf("restarts %v (before %d)", s, restarts)
			}
			log := rn.containerLog(p, "plugin", s.RestartCount)
			return strings.Contains(log, "waiting without the driver"), tail(log, 10)
		})
		patchNode(t, rn.name, `{"metadata":{"labels":{"`+upgradeStateLabel+`":"upgrade-done"}}}`)
		var after *v1.Pod
		waitFor(t, "the plugin container restarted and Ready on the new driver", 2*time.Minute, func(ctx context.Context) (bool, string) {
			p, err := chartPluginPod(ctx)
			if err != nil {
				return false, err.Error()
			}
			after = p
			s := containerStatus(p, "plugin")
			n, states := readyPods([]v1.Pod{*p})
			return p.Name == plugin.Name && s != nil && s.RestartCount > restarts && s.Ready && n == 1,
				fmt.Sprintf("%s, restarts %d", strings.Join(states, "; "), s.RestartCount)
		})
		t.Logf("the plugin was restarted and Ready %s after the upgrade", time.Since(upgraded).Round(100*time.Millisecond))
		s := containerStatus(after, "plugin")
		if term := s.LastTerminationState.Terminated; term == nil || term.ExitCode != driverChangedExitCode ||
			!strings.Contains(term.Message, upgradeStateLabel+"=pod-restart-required") {
			t.Errorf("the plugin's last termination %+v; want exit code %d and a message naming %s=pod-restart-required",
				term, driverChangedExitCode, upgradeStateLabel)
		}
		if log := rn.containerLog(after, "plugin", restarts); !strings.Contains(log, "releasing the driver") {
			t.Errorf("the stopped plugin's log does not say why it stopped:\n%s", tail(log, 20))
		}
		waitFor(t, "the restarted plugin's log saying it waited for the upgrade and came back", time.Minute, func(context.Context) (bool, string) {
			log := rn.containerLog(after, "plugin", s.RestartCount)
			return strings.Contains(log, "waiting without the driver") && strings.Contains(log, "the driver upgrade moved on and the driver is installed"), tail(log, 20)
		})
		waitFor(t, "NodeInventory "+rn.name+" names the new driver", time.Minute, func(ctx context.Context) (bool, string) {
			inv, err := e.dyn.Resource(inventoryGVR).Get(ctx, rn.name, metav1.GetOptions{})
			if err != nil {
				return false, err.Error()
			}
			got, _, _ := unstructured.NestedString(inv.Object, "spec", "driverVersion")
			_, ready := heartbeat(t, rn.name)
			return got == upgradedDriverVersion && ready, fmt.Sprintf("driverVersion %q, ready %v", got, ready)
		})

		fresh := waitRunning(t, ns, workloadPod(ns, "after-upgrade", rn.name).withClaimFrom("whole").create(t).Name, 3*time.Minute)
		freshClaim, freshDevices := realAllocations(t, fresh)
		fv := insideView(t, fresh)
		t.Logf("after the upgrade cuda-probe printed:\n  %s", strings.Join(fv.probeLines, "\n  "))
		rn.checkInside(t, fresh, fv, freshDevices)
		if got := probeDriverVersion(fv); got != upgradedDriverVersion {
			t.Errorf("a pod made after the upgrade: the probe's NVML reports driver %q, want %s", got, upgradedDriverVersion)
		}
		if got := rn.specLibcudas(t, freshClaim.UID); len(got) == 0 || got[0] != "libcuda.so."+upgradedDriverVersion {
			t.Errorf("a claim prepared after the upgrade: its CDI spec mounts %v, want libcuda.so.%s", got, upgradedDriverVersion)
		} else {
			rn.checkSpecsNameHostPaths(t, "after-upgrade", rn.cdiSpecsFor(t, freshClaim.UID))
		}

		// The pod that ran through it: same container, still Running, still reading the old library it has.
		now, err := e.client.CoreV1().Pods(ns).Get(ctx, before.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if now.Status.Phase != v1.PodRunning || now.Status.ContainerStatuses[0].RestartCount != 0 {
			t.Errorf("the pod running through the upgrade: phase %s, restarts %d; want Running, 0", now.Status.Phase, now.Status.ContainerStatuses[0].RestartCount)
		}
		waitFor(t, "the running pod reports after the upgrade", 30*time.Second, func(context.Context) (bool, string) {
			_, ts := rn.lastReport(t, before)
			return ts.After(time.Now().Add(-2 * time.Second)), "last report " + ts.String()
		})
		got, _ := rn.lastReport(t, before)
		if got != report {
			t.Errorf("the running pod's driver files changed under it:\nbefore: %s\nafter:  %s", report, got)
		}
		if !strings.Contains(got, "libcuda.so."+original+" ") || strings.Contains(got, upgradedDriverVersion) || strings.Contains(got, "reads 0") {
			t.Errorf("the running pod should keep (and read) libcuda.so.%s, and see nothing of %s: %s", original, upgradedDriverVersion, got)
		}
		if len(rn.cdiSpecsFor(t, beforeClaim.UID)) == 0 {
			t.Errorf("the running pod's claim lost its CDI spec in the plugin's restart")
		}
	})
	t.Logf("driver boot and upgrade scenario: %s", time.Since(start).Round(time.Second))
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// Both node DaemonSets (nvml) start with wait-for-driver, which reads the driver root as the plugin does
// (HostToContainer, so a driver mounted later shows through) with no capability; the driver root's hostPath
// is created if missing (a driver container mounts it later); the plugin watches the driver; the simulated
// backend, which has no driver to wait for, gets no init container.
func TestTheChartsNodePodsWaitForTheDriverAndThePluginWatchesIt(t *testing.T) {
	helm := helmBinary(t)
	objs := renderChart(t, helm, "backend=nvml", "driver.waitTimeout=600", "driver.watchInterval=7")
	for _, name := range []string{"tessera-kubelet-plugin", "tessera-mps-supervisor"} {
		ds := daemonSet(t, objs, name)
		inits := ds.Spec.Template.Spec.InitContainers
		if len(inits) != 1 || inits[0].Name != "wait-for-driver" || strings.Join(inits[0].Command, " ") != "/usr/bin/tessera-kubelet-plugin wait-for-driver" {
			t.Fatalf("%s: init containers %+v, want wait-for-driver running `tessera-kubelet-plugin wait-for-driver`", name, inits)
		}
		c := inits[0]
		env := envSources(c)
		if env["TESSERA_WAIT_FOR_DRIVER_TIMEOUT"] != "600" || env["TESSERA_CONTAINER_DRIVER_ROOT"] != "/driver-root" || env["TESSERA_BACKEND"] != "nvml" {
			t.Errorf("%s: wait-for-driver's env %v, want the timeout 600, the backend and /driver-root", name, env)
		}
		var driverMount bool
		for _, m := range c.VolumeMounts {
			if m.Name == "driver-root" {
				driverMount = m.MountPath == "/driver-root" && m.ReadOnly && m.MountPropagation != nil && *m.MountPropagation == "HostToContainer"
			}
		}
		if !driverMount {
			t.Errorf("%s: wait-for-driver mounts %+v, want the driver root read-only at /driver-root with HostToContainer", name, c.VolumeMounts)
		}
		sc := c.SecurityContext
		if sc == nil || (sc.Privileged != nil && *sc.Privileged) || sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" || len(sc.Capabilities.Add) != 0 {
			t.Errorf("%s: wait-for-driver's securityContext %+v, want unprivileged with every capability dropped", name, sc)
		}
		for _, v := range ds.Spec.Template.Spec.Volumes {
			if v.Name == "driver-root" && (v.HostPath == nil || v.HostPath.Type == nil || *v.HostPath.Type != "DirectoryOrCreate") {
				t.Errorf("%s: driver-root volume %+v, want a hostPath of type DirectoryOrCreate", name, v.VolumeSource)
			}
		}
		checkDriverRootMount(t, ds, "/run/nvidia/driver")
	}
	if got := containerEnv(daemonSet(t, objs, "tessera-kubelet-plugin"))["TESSERA_DRIVER_WATCH_INTERVAL"]; got != "7" {
		t.Errorf("the plugin's TESSERA_DRIVER_WATCH_INTERVAL=%q, want the chart's driver.watchInterval 7", got)
	}
	if got := containerEnv(daemonSet(t, objs, "tessera-kubelet-plugin"))["TESSERA_RELEASE_FOR_DRIVER_UPGRADES"]; got != "true" {
		t.Errorf("the plugin's TESSERA_RELEASE_FOR_DRIVER_UPGRADES=%q, want the chart's driver.releaseForUpgrades true", got)
	}
	sim := renderChart(t, helm, "backend=simulated")
	if inits := daemonSet(t, sim, "tessera-kubelet-plugin").Spec.Template.Spec.InitContainers; len(inits) != 0 {
		t.Errorf("backend=simulated: init containers %+v, want none (no driver to wait for)", inits)
	}
}
