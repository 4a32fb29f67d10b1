package main

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"
)

// RateLabel marks every object of one rate cell (nodes, slices), so the cell is removed in one call each.
const RateLabel = "bench.tessera.dev/rate-cell"

// RateCell is kube-scheduler's throughput for one policy on one cluster size: how many of the cell's pods
// it bound from the first pod's creation to the last bind, or to the time box.
type RateCell struct {
	Server  string `json:"server"`
	Policy  string `json:"policy"`
	Nodes   int    `json:"nodes"`
	Devices int    `json:"devicesPerNode"`
	Slices  int    `json:"slicesPerNode"`
	Pods    int    `json:"pods"`
	Bound   int    `json:"bound"`
	// Unschedulable counts pods the scheduler marked Unschedulable at least once (none should be: every
	// cell has room for all its pods).
	Unschedulable int `json:"unschedulable"`
	// Seconds runs from the first pod's create call to the last bind seen, or is the time box.
	Seconds  float64 `json:"seconds"`
	TimedOut bool    `json:"timedOut"`
	TimeBox  float64 `json:"timeBoxSeconds"`
	// SchedulerCPUSeconds is the CPU time kube-scheduler used over Seconds (user + system, from
	// /proc/<pid>/stat); 0 when its pid is not known. On a shared machine the rate says how much CPU the
	// scheduler got, this how much each pod cost it.
	SchedulerCPUSeconds float64 `json:"schedulerCpuSeconds"`
}

// CPUMillisPerPod is kube-scheduler's CPU time per bound pod.
func (c RateCell) CPUMillisPerPod() float64 {
	if c.Bound == 0 {
		return 0
	}
	return 1000 * c.SchedulerCPUSeconds / float64(c.Bound)
}

// processCPUSeconds reads a process's user + system CPU time from /proc (clock ticks of 1/100 s, the
// USER_HZ Linux reports to user space).
func processCPUSeconds(pid int) (float64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("failed to read kube-scheduler's CPU time: %w", err)
	}
	// The command name (field 2) may contain spaces; the fields after it are space-separated.
	rest := string(data)
	if i := strings.LastIndexByte(rest, ')'); i >= 0 {
		rest = rest[i+1:]
	}
	f := strings.Fields(rest)
	if len(f) < 13 {
		return 0, fmt.Errorf("failed to parse /proc/%d/stat: %d fields after the command", pid, len(f))
	}
	var utime, stime float64
	if _, err := fmt.Sscan(f[11], &utime); err != nil {
		return 0, fmt.Errorf("failed to parse utime in /proc/%d/stat: %w", pid, err)
	}
	if _, err := fmt.Sscan(f[12], &stime); err != nil {
		return 0, fmt.Errorf("failed to parse stime in /proc/%d/stat: %w", pid, err)
	}
	return (utime + stime) / 100, nil
}

// PodsPerSecond is the cell's scheduling rate.
func (c RateCell) PodsPerSecond() float64 {
	if c.Seconds <= 0 {
		return 0
	}
	return float64(c.Bound) / c.Seconds
}

// RateBench measures kube-scheduler's pods/s on fake nodes publishing tessera's slices. Claims are created
// before the clock starts; pods are then created in bursts of Burst (all of a burst concurrently, the next
// burst as soon as the previous one's creates returned), so the scheduler always has a queue.
type RateBench struct {
	Client kubernetes.Interface
	// Metadata counts slices without transferring them (9 slices of 26 devices per dynamic-MIG node).
	Metadata    metadata.Interface
	Server      string
	PodsPerNode int
	Burst       int
	TimeBox     time.Duration
	// Workers bounds concurrent API calls while setting up and tearing down a cell.
	Workers int
	// SchedulerPID is kube-scheduler's process (same machine), for its CPU time; 0 skips it.
	SchedulerPID int
}

// parallel runs f(i) for i in [0, n) on at most workers goroutines and returns the first error.
func parallel(n, workers int, f func(i int) error) error {
	var (
		next  atomic.Int64
		first error
		once  sync.Once
		wg    sync.WaitGroup
	)
	for range min(workers, n) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				if err := f(i); err != nil {
					once.Do(func() { first = err })
					return
				}
			}
		}()
	}
	wg.Wait()
	return first
}

// Run measures one cell: nodes fake nodes, each publishing c's one node's slices (copied onto each node
// while it is registered: the benchmark never holds every node's slices at once), pod's claim created
// PodsPerNode times per node, then the pods; the cell is removed again.
func (b *RateBench) Run(ctx context.Context, policy PolicySpec, c *Cluster, nodes int, pod TracePod) (RateCell, error) {
	cell := fmt.Sprintf("%s-%d", policy.Name, nodes)
	res := RateCell{Server: b.Server, Policy: policy.Name, Nodes: nodes, Pods: nodes * b.PodsPerNode, TimeBox: b.TimeBox.Seconds()}
	tmpl := c.Nodes[0].Slices
	res.Slices = len(tmpl)
	for _, s := range tmpl {
		res.Devices += len(s.Spec.Devices)
	}
	ns := "rate-" + cell
	if _, err := b.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return res, fmt.Errorf("failed to create namespace %s (the rate benchmark expects a fresh cluster): %w", ns, err)
	}
	setupStart := time.Now()
	if err := b.register(ctx, tmpl, policy.Name, nodes, cell); err != nil {
		return res, err
	}
	defer func() {
		if err := b.remove(context.WithoutCancel(ctx), ns, cell); err != nil {
			slog.Error("rate cell teardown failed", "cell", cell, "error", err)
		}
	}()

	claimNames := make([]string, res.Pods)
	err := parallel(res.Pods, b.Workers, func(i int) error {
		p := pod
		p.Name = fmt.Sprintf("%s-%05d", cell, i)
		claim, err := c.Claims.Claim(p)
		if err != nil {
			return err
		}
		claim.Namespace, claim.UID = ns, ""
		created, err := b.Client.ResourceV1().ResourceClaims(ns).Create(ctx, claim, metav1.CreateOptions{})
		if err != nil {
			return fmt.Errorf("failed to create ResourceClaim %s/%s: %w", ns, claim.Name, err)
		}
		claimNames[i] = created.Name
		return nil
	})
	if err != nil {
		return res, err
	}
	slog.Info("rate cell ready", "cell", cell, "nodes", res.Nodes, "slicesPerNode", res.Slices, "devicesPerNode", res.Devices,
		"claims", res.Pods, "setupSeconds", fmt.Sprintf("%.0f", time.Since(setupStart).Seconds()))

	w, err := watchBinds(ctx, b.Client, ns)
	if err != nil {
		return res, err
	}
	defer w.stop()
	cpu0 := 0.0
	if b.SchedulerPID > 0 {
		if cpu0, err = processCPUSeconds(b.SchedulerPID); err != nil {
			return res, err
		}
	}
	start := time.Now()
	createErr := make(chan error, 1)
	go func() {
		for from := 0; from < res.Pods; from += b.Burst {
			n := min(b.Burst, res.Pods-from)
			err := parallel(n, n, func(i int) error {
				return b.createPod(ctx, ns, cell, claimNames[from+i])
			})
			if err != nil {
				createErr <- err
				return
			}
		}
		createErr <- nil
	}()
	deadline := time.NewTimer(b.TimeBox)
	defer deadline.Stop()
	tick := time.NewTicker(5 * time.Second)
	defer tick.Stop()
	for done := false; !done; {
		select {
		case err := <-createErr:
			if err != nil {
				return res, err
			}
		case <-w.all(res.Pods):
			// Closed at every bind: done only once all pods are bound.
			bound, _, _ := w.snapshot()
			done = bound >= res.Pods
		case <-deadline.C:
			res.TimedOut = true
			done = true
		case <-tick.C:
			bound, _, _ := w.snapshot()
			slog.Info("rate cell", "cell", cell, "bound", bound, "of", res.Pods, "seconds", fmt.Sprintf("%.0f", time.Since(start).Seconds()))
		case <-ctx.Done():
			return res, ctx.Err()
		}
	}
	if b.SchedulerPID > 0 {
		cpu1, err := processCPUSeconds(b.SchedulerPID)
		if err != nil {
			return res, err
		}
		res.SchedulerCPUSeconds = cpu1 - cpu0
	}
	bound, last, unschedulable := w.snapshot()
	res.Bound, res.Unschedulable = bound, unschedulable
	if res.TimedOut {
		res.Seconds = b.TimeBox.Seconds()
	} else {
		res.Seconds = last.Sub(start).Seconds()
	}
	slog.Info("rate cell done", "cell", cell, "bound", res.Bound, "of", res.Pods, "seconds", fmt.Sprintf("%.1f", res.Seconds),
		"podsPerSecond", fmt.Sprintf("%.1f", res.PodsPerSecond()), "timedOut", res.TimedOut,
		"schedulerCPUMillisPerPod", fmt.Sprintf("%.0f", res.CPUMillisPerPod()))
	return res, nil
}

func (b *RateBench) createPod(ctx context.Context, ns, cell, claim string) error {
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: claim, Namespace: ns},
		Spec: v1.PodSpec{
			NodeSelector:                  map[string]string{PolicyLabel: cell},
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			Containers: []v1.Container{{
				Name: "app", Image: "registry.k8s.io/pause:3.10",
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr.To(claim)}},
		},
	}
	if _, err := b.Client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("failed to create pod %s/%s: %w", ns, p.Name, err)
	}
	return nil
}

// register creates the cell's nodes and their slices and waits until the API server lists every slice.
func (b *RateBench) register(ctx context.Context, tmpl []*resourceapi.ResourceSlice, policy string, nodes int, cell string) error {
	reg := &SchedulerSample{Client: b.Client}
	err := parallel(nodes, b.Workers, func(i int) error {
		n := ForNode(tmpl, fmt.Sprintf("%s-%d-%04d", policy, nodes, i))
		if err := reg.createNode(ctx, n.Node, cell); err != nil {
			return err
		}
		for _, obj := range n.Slices {
			// Rendered for an inventory that does not exist here: its owner would be garbage-collected.
			obj.OwnerReferences, obj.ResourceVersion, obj.UID, obj.ManagedFields = nil, "", "", nil
			if obj.Labels == nil {
				obj.Labels = map[string]string{}
			}
			obj.Labels[RateLabel] = cell
			if _, err := b.Client.ResourceV1().ResourceSlices().Create(ctx, obj, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("failed to create ResourceSlice %s: %w", obj.Name, err)
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	want := nodes * len(tmpl)
	err = wait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := b.Metadata.Resource(sliceGVR).List(ctx, metav1.ListOptions{LabelSelector: RateLabel + "=" + cell})
		return err == nil && len(list.Items) >= want, nil
	})
	if err != nil {
		return fmt.Errorf("failed to see the %d ResourceSlices of cell %s listed: %w", want, cell, err)
	}
	// The scheduler's informers deliver the slices shortly after the API server lists them.
	time.Sleep(3 * time.Second)
	return nil
}

var sliceGVR = schema.GroupVersionResource{Group: "resource.k8s.io", Version: "v1", Resource: "resourceslices"}

// remove deletes the cell's pods, claims, slices and nodes, and waits until its slices are gone: left in
// place they would slow every later cell.
func (b *RateBench) remove(ctx context.Context, ns, cell string) error {
	now := metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}
	sel := metav1.ListOptions{LabelSelector: RateLabel + "=" + cell}
	if err := b.Client.CoreV1().Pods(ns).DeleteCollection(ctx, now, metav1.ListOptions{}); err != nil {
		return fmt.Errorf("failed to delete the pods of %s: %w", ns, err)
	}
	if err := b.Client.ResourceV1().ResourceClaims(ns).DeleteCollection(ctx, now, metav1.ListOptions{}); err != nil {
		return fmt.Errorf("failed to delete the claims of %s: %w", ns, err)
	}
	if err := b.Client.ResourceV1().ResourceSlices().DeleteCollection(ctx, now, sel); err != nil {
		return fmt.Errorf("failed to delete the slices of cell %s: %w", cell, err)
	}
	if err := b.Client.CoreV1().Nodes().DeleteCollection(ctx, now, metav1.ListOptions{LabelSelector: PolicyLabel + "=" + cell}); err != nil {
		return fmt.Errorf("failed to delete the nodes of cell %s: %w", cell, err)
	}
	if err := b.Client.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("failed to delete namespace %s: %w", ns, err)
	}
	return wait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := b.Metadata.Resource(sliceGVR).List(ctx, sel)
		return err == nil && len(list.Items) == 0, nil
	})
}

// bindWatcher records when each pod of a namespace was first seen bound.
type bindWatcher struct {
	mu            sync.Mutex
	bound         map[string]bool
	unschedulable map[string]bool
	last          time.Time
	changed       chan struct{}
	cancel        context.CancelFunc
}

func watchBinds(ctx context.Context, client kubernetes.Interface, ns string) (*bindWatcher, error) {
	ctx, cancel := context.WithCancel(ctx)
	w := &bindWatcher{bound: map[string]bool{}, unschedulable: map[string]bool{}, changed: make(chan struct{}), cancel: cancel}
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(ns))
	inf := factory.Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    w.observe,
		UpdateFunc: func(_, obj any) { w.observe(obj) },
	}); err != nil {
		cancel()
		return nil, fmt.Errorf("failed to watch pods: %w", err)
	}
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		cancel()
		return nil, fmt.Errorf("failed to sync the pod informer of %s", ns)
	}
	return w, nil
}

func (w *bindWatcher) observe(obj any) {
	pod, ok := obj.(*v1.Pod)
	if !ok {
		return
	}
	v, ok := verdictOf(pod)
	if !ok {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case v.node != "" && !w.bound[pod.Name]:
		w.bound[pod.Name] = true
		w.last = time.Now()
		close(w.changed)
		w.changed = make(chan struct{})
	case v.unschedulable:
		w.unschedulable[pod.Name] = true
	}
}

// all returns a channel that is closed once n pods are bound; otherwise one that is closed at the next bind.
func (w *bindWatcher) all(n int) <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.bound) >= n {
		done := make(chan struct{})
		close(done)
		return done
	}
	return w.changed
}

func (w *bindWatcher) snapshot() (bound int, last time.Time, unschedulable int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.bound), w.last, len(w.unschedulable)
}

func (w *bindWatcher) stop() { w.cancel() }

// ratePod is the pod every cell of a policy schedules: one whole GPU, or a milli-GPU slice (a MIG instance
// covering it, or a share of that size).
func ratePod(policy PolicySpec, milli int) TracePod {
	if policy.Style == StyleWhole {
		return TracePod{NumGPU: 1, GPUMilli: 1000}
	}
	return TracePod{NumGPU: 1, GPUMilli: milli}
}

// rateArgs are the flags of the rate mode.
type rateArgs struct {
	nodes       []int
	podsPerNode int
	milli       int
	burst       int
	timeBox     time.Duration
	jsonOut     string
	// serverNote tells runs of one server version apart in the table (e.g. "PreQueueingHints off").
	serverNote string
	// migMaxNodes skips dynamic-MIG cells above this size (0: none skipped): 9 slices of 208 devices per
	// node make 1,000 such nodes more than a small machine's API server holds.
	migMaxNodes int
	// schedulerPIDFile holds kube-scheduler's pid (up.sh's pids/kube-scheduler.pid).
	schedulerPIDFile string
}

// runRate measures every (nodes, policy) cell against the cluster's kube-scheduler, writes the cells as JSON
// and prints this server's table.
func runRate(ctx context.Context, a args, ra rateArgs, r *Renderer, policies []PolicySpec, cfg Config) error {
	// Setting up 1,000 nodes and creating pods in bursts: the client must not be what limits the rate.
	restCfg, client, version, err := connect(a.kubeconfig, 1000, 2000)
	if err != nil {
		return err
	}
	meta, err := metadata.NewForConfig(restCfg)
	if err != nil {
		return fmt.Errorf("failed to build a metadata client for %s: %w", restCfg.Host, err)
	}
	server := version.GitVersion
	if ra.serverNote != "" {
		server += " " + ra.serverNote
	}
	b := &RateBench{Client: client, Metadata: meta, Server: server, PodsPerNode: ra.podsPerNode, Burst: ra.burst, TimeBox: ra.timeBox, Workers: 16}
	if ra.schedulerPIDFile != "" {
		data, err := os.ReadFile(ra.schedulerPIDFile)
		if err != nil {
			return fmt.Errorf("failed to read -rate-scheduler-pid-file: %w", err)
		}
		if _, err := fmt.Sscan(string(data), &b.SchedulerPID); err != nil {
			return fmt.Errorf("failed to read a pid from %s: %w", ra.schedulerPIDFile, err)
		}
	}
	var cells []RateCell
	for _, n := range ra.nodes {
		for _, p := range policies {
			if p.Style == StyleMIG && ra.migMaxNodes > 0 && n > ra.migMaxNodes {
				slog.Info("rate cell skipped: more dynamic-MIG nodes than -rate-mig-max-nodes", "policy", p.Name, "nodes", n, "max", ra.migMaxNodes)
				continue
			}
			// One node of the shape: its slices are the template every fake node of the cell publishes.
			tr := &Trace{Pods: []TracePod{ratePod(p, ra.milli)}, Nodes: []TraceNode{{Name: "template", GPUs: 8}}}
			c, err := BuildCluster(r, p, tr, cfg)
			if err != nil {
				return fmt.Errorf("failed to render a node under policy %s: %w", p.Name, err)
			}
			cell, err := b.Run(ctx, p, c, n, ratePod(p, ra.milli))
			if err != nil {
				return fmt.Errorf("rate cell %s × %d nodes: %w", p.Name, n, err)
			}
			cells = append(cells, cell)
		}
	}
	if ra.jsonOut != "" {
		if err := os.MkdirAll(filepath.Dir(ra.jsonOut), 0o755); err != nil {
			return fmt.Errorf("failed to create %s: %w", filepath.Dir(ra.jsonOut), err)
		}
		data, err := json.MarshalIndent(cells, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(ra.jsonOut, data, 0o644); err != nil {
			return fmt.Errorf("failed to write %s: %w", ra.jsonOut, err)
		}
		fmt.Printf("wrote %s\n", ra.jsonOut)
	}
	fmt.Print(RateTable(cells))
	return nil
}

// ReadRateCells reads the JSON files runRate wrote (one per server version).
func ReadRateCells(paths []string) ([]RateCell, error) {
	var all []RateCell
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("failed to read rate results %s: %w", p, err)
		}
		var cells []RateCell
		if err := json.Unmarshal(data, &cells); err != nil {
			return nil, fmt.Errorf("failed to parse rate results %s: %w", p, err)
		}
		all = append(all, cells...)
	}
	return all, nil
}

// RateTable prints the cells with one column group per server version, side by side, and the dynamic-MIG /
// whole-GPU rate ratio for every cluster size and version.
func RateTable(cells []RateCell) string {
	var servers []string
	seen := map[string]bool{}
	byKey := map[string]RateCell{}
	sizes := map[int]bool{}
	var policies []string
	seenPolicy := map[string]bool{}
	for _, c := range cells {
		if !seen[c.Server] {
			seen[c.Server] = true
			servers = append(servers, c.Server)
		}
		if !seenPolicy[c.Policy] {
			seenPolicy[c.Policy] = true
			policies = append(policies, c.Policy)
		}
		sizes[c.Nodes] = true
		byKey[fmt.Sprintf("%s/%s/%d", c.Server, c.Policy, c.Nodes)] = c
	}
	sort.Strings(servers)
	var ns []int
	for n := range sizes {
		ns = append(ns, n)
	}
	sort.Ints(ns)

	var sb strings.Builder
	sb.WriteString("| nodes × 8 H100 | policy | devices/node |")
	for _, s := range servers {
		fmt.Fprintf(&sb, " %s pods/s | %s bound / pods in s | %s scheduler CPU ms/pod |", s, s, s)
	}
	sb.WriteString("\n|---:|---|---:|")
	for range servers {
		sb.WriteString("---:|---:|---:|")
	}
	sb.WriteString("\n")
	for _, n := range ns {
		for _, p := range policies {
			devices := 0
			for _, s := range servers {
				if c, ok := byKey[fmt.Sprintf("%s/%s/%d", s, p, n)]; ok {
					devices = c.Devices
				}
			}
			if devices == 0 {
				// Skipped on every server (-rate-mig-max-nodes): say so rather than print zeros.
				fmt.Fprintf(&sb, "| %d | %s | – |", n, p)
				for range servers {
					sb.WriteString(" not run | | |")
				}
				sb.WriteString("\n")
				continue
			}
			fmt.Fprintf(&sb, "| %d | %s | %d |", n, p, devices)
			for _, s := range servers {
				c, ok := byKey[fmt.Sprintf("%s/%s/%d", s, p, n)]
				if !ok {
					sb.WriteString(" – | – | – |")
					continue
				}
				box := ""
				if c.TimedOut {
					box = " (time box)"
				}
				cpu := "–"
				if c.SchedulerCPUSeconds > 0 {
					cpu = fmt.Sprintf("%.0f", c.CPUMillisPerPod())
				}
				fmt.Fprintf(&sb, " %.1f | %d / %d in %.0f%s | %s |", c.PodsPerSecond(), c.Bound, c.Pods, c.Seconds, box, cpu)
			}
			sb.WriteString("\n")
		}
	}
	sb.WriteString("\n| nodes | ratio |")
	for _, s := range servers {
		fmt.Fprintf(&sb, " %s |", s)
	}
	sb.WriteString("\n|---:|---|")
	for range servers {
		sb.WriteString("---:|")
	}
	sb.WriteString("\n")
	for _, n := range ns {
		for _, p := range policies {
			if p == "whole" || p == "shares" {
				continue
			}
			label := p + " / whole"
			if p == "mig" {
				label = "dynamic MIG / whole"
			}
			fmt.Fprintf(&sb, "| %d | %s |", n, label)
			for _, s := range servers {
				whole, okW := byKey[fmt.Sprintf("%s/whole/%d", s, n)]
				other, okO := byKey[fmt.Sprintf("%s/%s/%d", s, p, n)]
				if !okW || !okO || whole.PodsPerSecond() == 0 {
					sb.WriteString(" – |")
					continue
				}
				cpu := ""
				if other.CPUMillisPerPod() > 0 && whole.CPUMillisPerPod() > 0 {
					cpu = fmt.Sprintf(" (CPU per pod: %.1f %%)", 100*whole.CPUMillisPerPod()/other.CPUMillisPerPod())
				}
				fmt.Fprintf(&sb, " %.1f %%%s |", 100*other.PodsPerSecond()/whole.PodsPerSecond(), cpu)
			}
			sb.WriteString("\n")
		}
	}
	return sb.String()
}
