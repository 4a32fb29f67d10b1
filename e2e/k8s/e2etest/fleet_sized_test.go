package e2etest

// Issue 39 item 5, live: `make bench-fleet TRACE=<file>` runs the offline model's burstable-hpa policy on
// the real node the way a user would run it, with every rule fixed in code before the trace is read
// (fleetsim.LiveSizedConfig, LiveSizedPolicy, InitialShare, LiveResizeSchedule):
//
//   - services: the offline model's 24 where the node holds them, else half its MPS-shared GPUs
//     (fleetsim.LiveSizedServices: each starts on a whole GPU's request; the other half is the room
//     scale-outs and make-before-break replacements need); rows split by fleetsim.ServiceOf;
//   - each service a Deployment on burstable shares (shared.gpu.tessera.dev, sharing.mps.computeCeiling
//     100) starting on the model's initial size (request 100 %, the GPU's memory), with a KEDA
//     ScaledObject on its engines' concurrent requests (the model's target 16, tolerance, 300 s
//     scale-down window compressed);
//   - after the model's learning time (600 s of trace) and every 600 s after, compressed, each service is
//     re-sized by the built `kubectl tessera rightsize` against the run's Prometheus, over the model's
//     sizing window (1800 s) at its sample period (15 s), compressed: its resized ResourceClaimTemplate is
//     created and the Deployment patched as its stderr says, a rollout made make-before-break by the
//     Deployment's strategy (maxUnavailable 0, maxSurge 1, minReadySeconds = the model's time to Ready).
//
// The model's engines (fleetsim.Live) serve the trace on the replicas Kubernetes runs, each at the size
// its claim was made with; each one's claim SM-time and engine memory become its container process's load
// in the simulated driver, so Prometheus holds what rightsize sizes from. Then the offline model runs the
// same slice with the same config (whole-peak for the SLOs, burstable-hpa), and both go to FLEET_OUT.
// Asserted: counts only (every replica holds a share, at least one re-sizing was applied when the slice
// is longer than the learning time, Prometheus saw the load given). Never timings.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"

	"tessera.dev/e2e/internal/fleet"
	"tessera.dev/e2e/internal/fleetsim"
	"tessera.dev/e2e/internal/liveresize"
)

var claimTemplateGVR = schema.GroupVersionResource{Group: "resource.k8s.io", Version: "v1", Resource: "resourceclaimtemplates"}

// resizeEvent is one service's re-sizing: what rightsize answered and what was applied.
type resizeEvent struct {
	at       time.Duration // wall, from the slice's start
	service  string
	template string
	share    fleetsim.Recommendation
	note     string // no recommendation, unchanged, or an error
}

type sizedResult struct {
	services   int
	gpus       int
	pods       int
	gpuHours   float64 // trace time, GPUs with at least one allocated claim
	maxGPUs    int
	smActive   float64 // Prometheus' summed claim use over GPUs held
	engine     fleetsim.Result
	attain     fleetsim.Attainment
	toRunning  []float64 // wall seconds, new pods: creation to Running
	pendingMax int
	resizes    []resizeEvent
	promUse    float64
	gave       float64
	wall       time.Duration
	model      []fleetsim.Row
	requests   int
}

// rightsize runs the built `kubectl tessera rightsize` as its user would; stdout and stderr apart (the
// template is on stdout, the Deployment patch on stderr).
func rightsize(t *testing.T, args ...string) (int, []byte, string) {
	t.Helper()
	target := getenv("CARGO_TARGET_DIR", filepath.Join(e.repoRoot, "target"))
	plugin := filepath.Join(target, "debug", "kubectl-tessera")
	kubectl := filepath.Join(getenv("E2E_BIN_DIR", filepath.Join(e.repoRoot, "e2e", "bin")), "kubectl")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, kubectl, append([]string{"tessera", "rightsize"}, args...)...)
	cmd.Env = append(os.Environ(),
		"PATH="+filepath.Dir(plugin)+string(os.PathListSeparator)+os.Getenv("PATH"),
		"KUBECONFIG="+filepath.Join(e.runDir, "pki", "admin.kubeconfig"))
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, out.Bytes(), errOut.String()
	case errors.As(err, &exit):
		return exit.ExitCode(), out.Bytes(), errOut.String()
	default:
		return -1, nil, err.Error() + ": " + errOut.String()
	}
}

// resizeService is one re-sizing as a user does it: rightsize, `kubectl apply` of the template it
// prints, `kubectl patch` of the Deployment as it says. It returns what happened.
func resizeService(t *testing.T, ns, service, prometheus string, sched fleetsim.ResizeSchedule, current string) resizeEvent {
	ev := resizeEvent{service: service}
	code, stdout, stderr := rightsize(t, append([]string{"deployment/" + service, "-n", ns, "--prometheus", prometheus}, sched.RightsizeFlags()...)...)
	if code != 0 {
		ev.note = fmt.Sprintf("no recommendation (exit %d): %s", code, strings.TrimSpace(lastLine(stderr)))
		return ev
	}
	tpl, err := liveresize.ParseTemplate(stdout)
	if err != nil {
		ev.note = err.Error()
		return ev
	}
	ev.template, ev.share = tpl.Name, tpl.Share
	if tpl.Name == current {
		ev.note = "unchanged"
		return ev
	}
	obj := &unstructured.Unstructured{Object: tpl.Object}
	obj.SetNamespace(ns)
	// What `kubectl apply` leaves to the server.
	obj.SetResourceVersion("")
	obj.SetUID("")
	obj.SetManagedFields(nil)
	obj.SetCreationTimestamp(metav1.Time{})
	if _, err := e.dyn.Resource(claimTemplateGVR).Namespace(ns).Create(ctxFor(t, 30*time.Second), obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		ev.note = fmt.Sprintf("create template %s: %v", tpl.Name, err)
		return ev
	}
	name, pns, patch, err := liveresize.DeploymentPatch(stderr)
	if err != nil {
		ev.note = err.Error()
		return ev
	}
	if _, err := e.client.AppsV1().Deployments(pns).Patch(ctxFor(t, 30*time.Second), name, types.JSONPatchType, patch, metav1.PatchOptions{}); err != nil {
		ev.note = fmt.Sprintf("patch deployment %s/%s: %v", pns, name, err)
	}
	return ev
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

func runFleetSized(t *testing.T, rn realNodeEnv, a autoscalingAddon, loads processLoads, args fleetArgs, gpus int, slice []fleet.Request) sizedResult {
	t.Helper()
	cfg := fleetsim.LiveSizedConfig(gpus)
	policy := fleetsim.LiveSizedPolicy()
	sched := fleetsim.LiveResizeSchedule(cfg, args.compress)
	ns := namespace(t, "fleet-sized")
	engines := startEngineMetrics(t, a, ns)
	init := fleetsim.InitialShare
	ceiling := fmt.Sprintf(`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"computeCeiling":%d}}}`, init.CeilingPercent)

	var mu sync.Mutex // shares, current, res.resizes: the re-sizing goroutine writes them
	shares := map[string]fleetsim.Recommendation{}
	current := map[string]string{} // service -> its Deployment's template
	serviceOf := map[string]int{}
	for k := 0; k < cfg.Services; k++ {
		name := fmt.Sprintf("svc-%d", k)
		serviceOf[name] = k
		template := name + "-gpu"
		shares[template], current[name] = init, template
		claimTemplate(t, ns, template, "shared.gpu.tessera.dev",
			capacity(map[string]string{"memory": fmt.Sprintf("%dGi", init.MemoryBytes>>30), "compute": strconv.Itoa(init.RequestPercent)}),
			opaqueConfig(ceiling))
		coldDeployment(t, ns, name, template, rn.name)
		ready := fleetsim.Classes[k%len(fleetsim.Classes)].ReadySeconds(fleetsim.KindMPS) / args.compress
		// The Deployment controller writes the new object's status meanwhile: read, change, write again.
		if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			d, err := e.client.AppsV1().Deployments(ns).Get(ctxFor(t, 30*time.Second), name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			liveresize.MakeBeforeBreak(d, int32(math.Ceil(ready)))
			_, err = e.client.AppsV1().Deployments(ns).Update(ctxFor(t, 30*time.Second), d, metav1.UpdateOptions{})
			return err
		}); err != nil {
			t.Fatalf("make %s/%s's rollouts make-before-break: %v", ns, name, err)
		}
		scaleTo(t, ns, name, 1)
	}
	startServicesAutoscaling(t, a, ns, cfg, args.compress, 4*time.Minute)

	type replicaState struct {
		service  int
		template string
		pid      int
		device   string
		gpu      int
		created  time.Time
		warm     bool
		loaded   bool
		running  bool
	}
	known := map[string]*replicaState{}
	live := fleetsim.NewLive(cfg, slice, policy)
	span := float64(fleet.TraceSpan(slice)) / float64(time.Second)
	wall := time.Duration(span / args.compress * float64(time.Second))
	res := sizedResult{services: cfg.Services, gpus: gpus, requests: len(slice)}
	var gpuSeconds, gave float64
	ticks, resizes := 0, 0
	var resizing sync.WaitGroup
	began := time.Now()
	for tick := 1; ; tick++ {
		time.Sleep(time.Until(began.Add(time.Duration(tick) * time.Second)))
		elapsed := min(time.Since(began), wall)
		if due := sched.Due(elapsed); due > resizes && elapsed < wall {
			resizes = due
			at := elapsed
			mu.Lock()
			cur := map[string]string{}
			for k, v := range current {
				cur[k] = v
			}
			mu.Unlock()
			resizing.Add(1)
			go func() {
				defer resizing.Done()
				for k := 0; k < cfg.Services; k++ {
					name := fmt.Sprintf("svc-%d", k)
					ev := resizeService(t, ns, name, a.prometheus, sched, cur[name])
					ev.at = at
					mu.Lock()
					if ev.note == "" {
						shares[ev.template], current[name] = ev.share, ev.template
					}
					res.resizes = append(res.resizes, ev)
					mu.Unlock()
					t.Logf("resize at %s: %s -> %s %+v %s", at, name, ev.template, ev.share, ev.note)
				}
			}()
		}
		list, err := e.client.CoreV1().Pods(ns).List(ctxFor(t, 30*time.Second), metav1.ListOptions{})
		if err != nil {
			t.Fatalf("list pods: %v", err)
		}
		var serving []fleetsim.LiveReplica
		held := map[int]bool{}
		present := map[string]bool{}
		pending := 0
		for i := range list.Items {
			p := &list.Items[i]
			st := known[p.Name]
			if st == nil {
				st = &replicaState{service: serviceOf[p.Labels["app"]], created: p.CreationTimestamp.Time, gpu: -1, warm: tick == 1}
				if rc := p.Spec.ResourceClaims; len(rc) == 1 && rc[0].ResourceClaimTemplateName != nil {
					st.template = *rc[0].ResourceClaimTemplateName
				}
				known[p.Name] = st
				if p.CreationTimestamp.Time.Before(began.Add(wall)) {
					res.pods++
				}
			}
			if p.Spec.NodeName == "" && p.DeletionTimestamp == nil {
				pending++
			}
			if st.device == "" && p.Spec.NodeName != "" && len(p.Status.ResourceClaimStatuses) > 0 {
				if _, devices := realAllocations(t, p); len(devices) == 1 {
					st.device = devices[0].Device
					if m := gpuOfDevice.FindStringSubmatch(st.device); m != nil {
						st.gpu, _ = strconv.Atoi(m[1])
					}
					if !sharedName.MatchString(st.device) {
						t.Errorf("replica %s holds %s, not a share", p.Name, st.device)
					}
				}
			}
			if st.gpu >= 0 {
				held[st.gpu] = true
			}
			if p.DeletionTimestamp != nil || p.Status.Phase != v1.PodRunning || st.gpu < 0 {
				continue
			}
			if !st.running {
				st.running = true
				if !st.warm {
					res.toRunning = append(res.toRunning, time.Since(st.created).Seconds())
				}
			}
			if st.pid == 0 {
				st.pid = rn.containerPID(t, p, "serve")
			}
			ready := st.created.Add(time.Duration(fleetsim.Classes[st.service%len(fleetsim.Classes)].ReadySeconds(fleetsim.KindMPS) / args.compress * float64(time.Second)))
			if !st.warm && time.Now().Before(ready) {
				continue
			}
			mu.Lock()
			share, sized := shares[st.template]
			mu.Unlock()
			if !sized {
				continue // a template the re-sizing is still recording (milliseconds); serve at the next tick
			}
			present[p.Name] = true
			serving = append(serving, fleetsim.LiveReplica{ID: p.Name, Service: st.service, GPU: st.gpu, Share: share})
		}
		res.pendingMax = max(res.pendingMax, pending)
		usage := live.Step(elapsed.Seconds()*args.compress, serving)
		for name, st := range known {
			u, ok := usage[name]
			if !ok || !present[name] {
				engines.drop(name)
				if st.loaded {
					loads.set(t, st.device, st.pid, 0, "0")
					st.loaded = false
				}
				continue
			}
			st.loaded = true
			loads.set(t, st.device, st.pid, min(int(math.Round(u.ClaimUse*100)), 100), strconv.FormatInt(int64(u.MemoryBytes), 10))
			engines.set(name, fmt.Sprintf("svc-%d", st.service), u.Requests)
			gave += u.ClaimUse
		}
		gpuSeconds += float64(len(held))
		res.maxGPUs = max(res.maxGPUs, len(held))
		ticks++
		if elapsed >= wall {
			break
		}
	}
	res.wall = time.Since(began)
	resizing.Wait()
	res.engine = live.Result()
	res.gave = gave / float64(ticks)
	q := fmt.Sprintf(`avg_over_time((sum(tessera_claim_gpu_utilization_ratio{namespace=%q}) or vector(0))[%ds:2s])`, ns, int(res.wall.Seconds()))
	if r, err := promQuery(ctxFor(t, 30*time.Second), a.prometheus, q); err == nil && len(r) == 1 {
		res.promUse = r[0].Value
	} else {
		t.Errorf("Prometheus' mean claim use: %v (%d series)", err, len(r))
	}
	loads.clear()
	if gpuSeconds > 0 {
		res.smActive = res.promUse * float64(ticks) / gpuSeconds
	}
	res.gpuHours = gpuSeconds / float64(ticks) * span / 3600 // mean GPUs held × the slice's trace hours
	rows, slos := fleetsim.RunAll(cfg, slice, []fleetsim.Policy{fleetsim.Policies[0], policy})
	res.model = rows
	res.attain = fleetsim.Attain(res.engine, slos)
	return res
}

func sizedTable(args fleetArgs, r sizedResult) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Trace: %s, first %s, every request (%d), %d services on %d MPS-shared GPUs, compressed %gx; real node, %s; %.0f s wall.\n\n",
		filepath.Base(args.trace), args.window, r.requests, r.services, r.gpus, args.compress, time.Now().UTC().Format("2006-01-02"), r.wall.Seconds())
	b.WriteString("| run | policy | GPU_UTIL of GPUs held: mean | p10 | p50 | p90 | SM active: mean | p10 | p50 | p90 | GPU-hours | max GPUs | SLO attainment: TTFT | per-token | both | pods created | to Ready p50 |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	toRunning := append([]float64(nil), r.toRunning...)
	sort.Float64s(toRunning)
	eng := r.engine
	fmt.Fprintf(&b, "| live (Prometheus, KEDA, HPA, kube-scheduler, tessera, `kubectl tessera rightsize`) | burstable-hpa | %.3f | %.3f | %.3f | %.3f | %.3f (Prometheus: %.3f) | %.3f | %.3f | %.3f | %.2f | %d | %.4f | %.4f | %.4f | %d | %.1f s wall to Running (+ the model's %s) |\n",
		eng.GPUUtil.Mean, eng.GPUUtil.P10, eng.GPUUtil.P50, eng.GPUUtil.P90, eng.SMActive.Mean, r.smActive, eng.SMActive.P10, eng.SMActive.P50, eng.SMActive.P90,
		r.gpuHours, r.maxGPUs, r.attain.TTFT, r.attain.TPOT, r.attain.Both, r.pods, fleetsim.Percentile(toRunning, 50), "time to Ready")
	for _, m := range r.model {
		fmt.Fprintf(&b, "| model (fleetsim.Run, same slice and config) | %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f | %d | %.4f | %.4f | %.4f | %d | %.1f s |\n",
			m.Policy.Name, m.GPUUtil.Mean, m.GPUUtil.P10, m.GPUUtil.P50, m.GPUUtil.P90, m.SMActive.Mean, m.SMActive.P10, m.SMActive.P50, m.SMActive.P90,
			m.GPUHours, m.MaxGPUs, m.Attain.TTFT, m.Attain.TPOT, m.Attain.Both, m.PodsCreated, m.ReadySecondsP50)
	}
	fmt.Fprintf(&b, "\nLive GPU_UTIL and SM active: the model's engines on the cluster's replicas and GPUs (fleetsim.Live), per GPU-second of GPUs with a serving replica; "+
		"\"Prometheus\": the namespace's summed tessera_claim_gpu_utilization_ratio over the GPUs with an allocated claim (the load given: %.3f GPUs, Prometheus' mean %.3f). "+
		"GPU-hours and max GPUs: GPUs with an allocated claim, per second, in trace time. Pods Pending at once, at most: %d.\n\n", r.gave, r.promUse, r.pendingMax)
	b.WriteString("Re-sizings (`kubectl tessera rightsize` against the run's Prometheus, applied as its output says):\n\n| wall | service | template | compute request | ceiling | memory | note |\n|---|---|---|---|---|---|---|\n")
	for _, ev := range r.resizes {
		fmt.Fprintf(&b, "| %.0f s | %s | %s | %d %% | %d %% | %.0f GiB | %s |\n", ev.at.Seconds(), ev.service, ev.template,
			ev.share.RequestPercent, ev.share.CeilingPercent, float64(ev.share.MemoryBytes)/float64(1<<30), strings.ReplaceAll(ev.note, "|", "/"))
	}
	return b.String()
}

// fleetSized runs the sized policy live, writes its table (FLEET_OUT) and checks the counts.
func fleetSized(t *testing.T, rn realNodeEnv, a autoscalingAddon, loads processLoads, args fleetArgs, gpus int) {
	t.Helper()
	args.thin = 1
	slice := agreementSlice(t, args)
	r := runFleetSized(t, rn, a, loads, args, gpus, slice)
	table := sizedTable(args, r)
	t.Log("\n" + table)
	if args.out != "" {
		doc := "## The sized burstable policy, live (issue 39 item 5)\n\nWritten by `make bench-fleet TRACE=" + args.trace +
			fmt.Sprintf(" FLEET_MINUTES=%g FLEET_COMPRESS=%g", args.window.Minutes(), args.compress) + "` " +
			"(e2e/k8s/e2etest/fleet_sized_test.go). The trace is the only input; services, the initial share, the HPA target and the " +
			"re-sizing schedule are fixed in code (fleetsim.LiveSizedConfig, InitialShare, LiveResizeSchedule) and the sizes come from " +
			"`kubectl tessera rightsize` on the run's own Prometheus.\n\n" + table
		if err := os.WriteFile(args.out, []byte(doc), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if math.Abs(r.promUse-r.gave) > 0.15*r.gave+0.05 {
		t.Errorf("Prometheus' mean claim use %.3f GPUs, the test gave %.3f", r.promUse, r.gave)
	}
	sched := fleetsim.LiveResizeSchedule(fleetsim.LiveSizedConfig(gpus), args.compress)
	applied := 0
	for _, ev := range r.resizes {
		if ev.note == "" {
			applied++
		}
	}
	if r.wall > sched.First+30*time.Second && applied == 0 {
		t.Errorf("no re-sizing was applied in %s (the first is due at %s): %+v", r.wall, sched.First, r.resizes)
	}
}
