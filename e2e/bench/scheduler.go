package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/version"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
)

// PolicyLabel keeps each policy's pods on that policy's nodes: all policies of a scheduler run share one
// cluster, each with its own copy of the sampled nodes.
const PolicyLabel = "bench.tessera.dev/policy"

// SchedulerResult is one policy's sample replayed through the real kube-scheduler, checked decision by
// decision against the structured allocator.
type SchedulerResult struct {
	Policy    string
	Nodes     int
	TotalGPUs int
	// Scheduler is what kube-scheduler did: pods bound (with their claims allocated) or marked Unschedulable.
	Scheduler Snapshot
	// BestFit is the benchmark's own node-selection loop over the structured allocator on the same sample
	// (what the full-trace table uses), for comparison: the scheduler picks among feasible nodes by its own
	// scores, so the two may place different pods; every single decision is checked below.
	BestFit Snapshot
	// Decisions counts the pods checked; Agreed those where the allocator, given the allocations the
	// scheduler had made so far, decides the same: a bound pod's claim fits the scheduler's node, an
	// unschedulable pod's claim fits no node. SameDevices counts bound pods where the allocator also picks
	// exactly the scheduler's devices (and consumed capacity) on that node.
	Decisions, Agreed, Bound, SameDevices int
	// Disagreements describes the first few decisions that differed.
	Disagreements []string
	// UnschedulableMessage is the scheduler's message for the first pod it could not place.
	UnschedulableMessage string
	Elapsed              time.Duration
	SameAs               string
}

// OK reports whether every decision agreed.
func (r SchedulerResult) OK() bool { return r.Agreed == r.Decisions && r.SameDevices == r.Bound }

// SchedulerSample replays sampled pods through a running kube-scheduler. It creates everything itself:
// one namespace per policy, the sampled nodes (Ready, untainted, labelled with the policy), the slices
// tessera renders for them, then for each pod in creation order its ResourceClaim and a Pod using it, and
// waits for the scheduler's verdict before the next pod arrives — the sequential arrival the benchmark's
// replay assumes. Nothing runs on the nodes (there are no kubelets); bound pods stay bound.
type SchedulerSample struct {
	Client kubernetes.Interface
	// PodTimeout bounds the wait for one pod's verdict.
	PodTimeout time.Duration
	// Settle is how long the scheduler's informers get to see the nodes and slices before the first pod.
	Settle time.Duration
	pods   *podWaiter
}

// podVerdict is what the scheduler decided for one pod.
type podVerdict struct {
	node          string
	unschedulable bool
	message       string
}

// podWaiter turns pod updates from an informer into one verdict per waiting pod.
type podWaiter struct {
	mu      sync.Mutex
	waiting map[string]chan podVerdict
}

func (w *podWaiter) expect(key string) chan podVerdict {
	ch := make(chan podVerdict, 1)
	w.mu.Lock()
	w.waiting[key] = ch
	w.mu.Unlock()
	return ch
}

func (w *podWaiter) observe(obj any) {
	pod, ok := obj.(*v1.Pod)
	if !ok {
		return
	}
	v, ok := verdictOf(pod)
	if !ok {
		return
	}
	key := pod.Namespace + "/" + pod.Name
	w.mu.Lock()
	ch := w.waiting[key]
	delete(w.waiting, key)
	w.mu.Unlock()
	if ch != nil {
		ch <- v
	}
}

// verdictOf reads the scheduler's decision from a pod: bound to a node, or PodScheduled=False with reason
// Unschedulable (after its single scheduling attempt: nothing in the sample ever frees capacity).
func verdictOf(pod *v1.Pod) (podVerdict, bool) {
	if pod.Spec.NodeName != "" {
		return podVerdict{node: pod.Spec.NodeName}, true
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable {
			return podVerdict{unschedulable: true, message: c.Message}, true
		}
	}
	return podVerdict{}, false
}

// Start watches pods in every namespace until ctx ends.
func (s *SchedulerSample) Start(ctx context.Context) error {
	s.pods = &podWaiter{waiting: map[string]chan podVerdict{}}
	factory := informers.NewSharedInformerFactory(s.Client, 0)
	inf := factory.Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    s.pods.observe,
		UpdateFunc: func(_, obj any) { s.pods.observe(obj) },
	}); err != nil {
		return fmt.Errorf("failed to watch pods: %w", err)
	}
	factory.Start(ctx.Done())
	for typ, ok := range factory.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("failed to sync the %v informer with the API server", typ)
		}
	}
	return nil
}

// Run replays one policy's sample. c holds the sample's nodes (already prefixed with the policy) and their
// slices; pods are the replay sequence. oracle is a fresh simulator over the same cluster: it follows the
// scheduler's allocations and judges each decision.
func (s *SchedulerSample) Run(ctx context.Context, policy PolicySpec, c *Cluster, pods []TracePod, oracle *Sim) (SchedulerResult, error) {
	start := time.Now()
	res := SchedulerResult{Policy: policy.Name, Nodes: len(c.Nodes), TotalGPUs: oracle.TotalGPUs()}
	ns := "openb-" + policy.Name
	if err := s.setUp(ctx, policy, c, ns); err != nil {
		return res, err
	}
	for i, pod := range pods {
		if err := s.replayPod(ctx, ns, policy, c, pod, oracle, &res); err != nil {
			return res, err
		}
		if (i+1)%100 == 0 {
			slog.Info("scheduler sample", "policy", policy.Name, "pods", i+1, "of", len(pods), "agreed", res.Agreed,
				"allocationRatioPct", fmt.Sprintf("%.1f", res.Scheduler.AllocPct(res.TotalGPUs)))
		}
	}
	res.Elapsed = time.Since(start)
	return res, s.tearDown(ctx, c)
}

// tearDown deletes the policy's slices once its pods have their verdicts. Left in place they would slow
// every later policy: kube-scheduler 1.36 reads every slice carrying shared counters (each dynamic-MIG
// node's counter slice) on every Filter call, for every node.
func (s *SchedulerSample) tearDown(ctx context.Context, c *Cluster) error {
	for _, n := range c.Nodes {
		for _, sl := range n.Slices {
			err := s.Client.ResourceV1().ResourceSlices().Delete(ctx, sl.Name, metav1.DeleteOptions{})
			if err != nil && !apierrors.IsNotFound(err) {
				return fmt.Errorf("failed to delete ResourceSlice %s after the run: %w", sl.Name, err)
			}
		}
	}
	return nil
}

func (s *SchedulerSample) setUp(ctx context.Context, policy PolicySpec, c *Cluster, ns string) error {
	_, err := s.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("failed to create namespace %s (is the cluster fresh? the sample expects an empty one): %w", ns, err)
	}
	for _, n := range c.Nodes {
		if err := s.createNode(ctx, n.Node, policy.Name); err != nil {
			return err
		}
		for _, sl := range n.Slices {
			obj := sl.DeepCopy()
			// Rendered for an inventory that does not exist here: its owner would be garbage-collected.
			obj.OwnerReferences, obj.ResourceVersion, obj.UID, obj.ManagedFields = nil, "", "", nil
			if _, err := s.Client.ResourceV1().ResourceSlices().Create(ctx, obj, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("failed to create ResourceSlice %s: %w", obj.Name, err)
			}
		}
	}
	// The scheduler learns about nodes and slices through its informers; a pod arriving before they have
	// caught up would be judged against a partial cluster. Wait until the API server lists every slice,
	// then give the watch a moment to deliver them.
	want := 0
	for _, n := range c.Nodes {
		want += len(n.Slices)
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		list, err := s.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		got := 0
		for _, sl := range list.Items {
			if sl.Spec.NodeName != nil && strings.HasPrefix(*sl.Spec.NodeName, policy.Name+"-") {
				got++
			}
		}
		return got >= want, nil
	})
	if err != nil {
		return fmt.Errorf("failed to see the %d ResourceSlices of policy %s listed: %w", want, policy.Name, err)
	}
	time.Sleep(s.Settle)
	return nil
}

// createNode registers a Node as the kubelet would: Ready, with room for any number of pods, and without
// the not-ready taint that admission adds at creation.
func (s *SchedulerSample) createNode(ctx context.Context, name, policy string) error {
	nodes := s.Client.CoreV1().Nodes()
	n, err := nodes.Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
		"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", PolicyLabel: policy,
	}}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("failed to create node %s: %w", name, err)
	}
	room := v1.ResourceList{
		v1.ResourceCPU: resource.MustParse("1000"), v1.ResourceMemory: resource.MustParse("4Ti"), v1.ResourcePods: resource.MustParse("10000"),
	}
	now := metav1.Now()
	n.Status.Capacity, n.Status.Allocatable = room, room
	n.Status.Conditions = []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "BenchNode", LastHeartbeatTime: now, LastTransitionTime: now}}
	if n, err = nodes.UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("failed to mark node %s Ready: %w", name, err)
	}
	if len(n.Spec.Taints) > 0 {
		n.Spec.Taints = nil
		if _, err := nodes.Update(ctx, n, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("failed to clear the taints of node %s: %w", name, err)
		}
	}
	return nil
}

// replayPod creates one pod and its claim, waits for the scheduler and judges its decision with the
// allocator, given the same allocated state.
func (s *SchedulerSample) replayPod(ctx context.Context, ns string, policy PolicySpec, c *Cluster, pod TracePod, oracle *Sim, res *SchedulerResult) error {
	claim, err := c.Claims.Claim(pod)
	if err != nil {
		return err
	}
	claim.Namespace, claim.UID = ns, ""
	claims := s.Client.ResourceV1().ResourceClaims(ns)
	created, err := claims.Create(ctx, claim, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("failed to create ResourceClaim %s/%s: %w", ns, claim.Name, err)
	}
	verdictCh := s.pods.expect(ns + "/" + pod.Name)
	p := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: ns},
		Spec: v1.PodSpec{
			NodeSelector:                  map[string]string{PolicyLabel: policy.Name},
			TerminationGracePeriodSeconds: ptr.To[int64](0),
			Containers: []v1.Container{{
				Name: "app", Image: "registry.k8s.io/pause:3.10",
				Resources: v1.ResourceRequirements{Claims: []v1.ResourceClaim{{Name: "gpu"}}},
			}},
			ResourceClaims: []v1.PodResourceClaim{{Name: "gpu", ResourceClaimName: ptr.To(created.Name)}},
		},
	}
	if _, err := s.Client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("failed to create pod %s/%s: %w", ns, pod.Name, err)
	}
	var v podVerdict
	select {
	case v = <-verdictCh:
	case <-time.After(s.PodTimeout):
		return fmt.Errorf("pod %s/%s was neither bound nor marked Unschedulable within %s: is kube-scheduler running (see its log)?", ns, pod.Name, s.PodTimeout)
	case <-ctx.Done():
		return ctx.Err()
	}
	res.Decisions++
	if v.unschedulable {
		res.Scheduler.Record(pod, false)
		if res.UnschedulableMessage == "" {
			res.UnschedulableMessage = v.message
		}
		// The allocator must not find a node either. Place tries every node that may fit (skipping only
		// those that certainly cannot); were it to succeed, the allocation is kept, as the scheduler's would be.
		fits, err := oracle.Place(ctx, pod)
		if err != nil {
			return err
		}
		if fits {
			res.disagree("%s: kube-scheduler found no node (%s), the allocator placed it", pod.Name, v.message)
		} else {
			res.Agreed++
		}
		// An unschedulable pod would be retried on every cluster event; it has had its verdict.
		if err := s.Client.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
			return fmt.Errorf("failed to delete unschedulable pod %s/%s: %w", ns, pod.Name, err)
		}
		if err := claims.Delete(ctx, created.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("failed to delete the claim of unschedulable pod %s/%s: %w", ns, pod.Name, err)
		}
		return nil
	}
	res.Scheduler.Record(pod, true)
	res.Bound++
	// The scheduler writes the claim's allocation (PreBind) before it binds the pod.
	got, err := claims.Get(ctx, created.Name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("failed to read ResourceClaim %s/%s after its pod was bound: %w", ns, created.Name, err)
	}
	if got.Status.Allocation == nil {
		return fmt.Errorf("pod %s/%s is bound to %s but its claim has no allocation", ns, pod.Name, v.node)
	}
	want, err := oracle.AllocateOn(ctx, v.node, got)
	if err != nil {
		return err
	}
	switch {
	case want == nil:
		res.disagree("%s: kube-scheduler bound it to %s (%s), where the allocator finds no room", pod.Name, v.node, describe(got.Status.Allocation.Devices.Results))
	default:
		res.Agreed++
		if sameDevices(want.Devices.Results, got.Status.Allocation.Devices.Results) {
			res.SameDevices++
		} else {
			res.disagree("%s on %s: kube-scheduler allocated %s, the allocator %s", pod.Name, v.node,
				describe(got.Status.Allocation.Devices.Results), describe(want.Devices.Results))
		}
	}
	// The oracle follows the scheduler, so the next decision is judged from the same state.
	return oracle.Commit(v.node, *got.Status.Allocation)
}

func (r *SchedulerResult) disagree(format string, a ...any) {
	if len(r.Disagreements) < 10 {
		r.Disagreements = append(r.Disagreements, fmt.Sprintf(format, a...))
	}
}

// deviceKey is an allocation result without the share ID (which the allocator draws at random).
func deviceKey(r resourceapi.DeviceRequestAllocationResult) string {
	var caps []string
	for name, q := range r.ConsumedCapacity {
		// Compared by value: the scheduler's quantities come back from the API server in canonical form.
		caps = append(caps, fmt.Sprintf("%s=%dm", name, q.MilliValue()))
	}
	sort.Strings(caps)
	k := fmt.Sprintf("%s:%s/%s/%s", r.Request, r.Driver, r.Pool, r.Device)
	if len(caps) > 0 {
		k += "{" + strings.Join(caps, ",") + "}"
	}
	return k
}

func deviceKeys(results []resourceapi.DeviceRequestAllocationResult) []string {
	out := make([]string, len(results))
	for i, r := range results {
		out[i] = deviceKey(r)
	}
	sort.Strings(out)
	return out
}

func sameDevices(a, b []resourceapi.DeviceRequestAllocationResult) bool {
	return slices.Equal(deviceKeys(a), deviceKeys(b))
}

func describe(results []resourceapi.DeviceRequestAllocationResult) string {
	return strings.Join(deviceKeys(results), " ")
}

// connect builds a client for the bench cluster's API server from kubeconfig, with the client-side rate
// limits qps and burst, and checks that the server answers.
func connect(kubeconfig string, qps float32, burst int) (*rest.Config, *kubernetes.Clientset, *version.Info, error) {
	restCfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("failed to load -kubeconfig %s: %w", kubeconfig, err)
	}
	restCfg.QPS, restCfg.Burst = qps, burst
	client, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("failed to build a client for %s: %w", restCfg.Host, err)
	}
	v, err := client.Discovery().ServerVersion()
	if err != nil {
		return nil, nil, nil, fmt.Errorf("failed to reach the API server at %s (is the bench cluster up?): %w", restCfg.Host, err)
	}
	return restCfg, client, v, nil
}

// runSchedulerSample replays a stratified sample of the trace through the cluster's kube-scheduler under
// every policy, checks each decision against the allocator, writes scheduler-sample.md and fails when any
// decision differed.
func runSchedulerSample(ctx context.Context, a args, r *Renderer, tr *Trace, policies []PolicySpec, cfg Config) error {
	// One pod at a time, a few requests each: the default 5 QPS would be the bottleneck.
	_, client, version, err := connect(a.kubeconfig, 200, 400)
	if err != nil {
		return err
	}
	sample, err := Sample(tr, a.sampleEvery)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sched := &SchedulerSample{Client: client, PodTimeout: 2 * time.Minute, Settle: 2 * time.Second}
	if err := sched.Start(ctx); err != nil {
		return err
	}
	cfg.SkipGPUsNeeded = true
	rep := SampleReport{Every: a.sampleEvery, Source: a.openbDir, Trace: tr, Sample: sample, Cfg: cfg, ServerVersion: version.GitVersion}
	fingerprints := map[string]string{}
	for _, p := range policies {
		c, err := BuildCluster(r, p, RenameNodes(sample, p.Name+"-"), cfg)
		if err != nil {
			return fmt.Errorf("failed to build the sampled cluster for policy %s: %w", p.Name, err)
		}
		if prev, ok := fingerprints[c.Fingerprint]; ok {
			slog.Info("same slices and claims as another policy: its scheduler run is reused", "policy", p.Name, "sameAs", prev)
			for _, res := range rep.Results {
				if res.Policy == prev {
					res.Policy, res.SameAs = p.Name, prev
					rep.Results = append(rep.Results, res)
					break
				}
			}
			continue
		}
		fingerprints[c.Fingerprint] = p.Name
		bestFit, err := RunPolicy(ctx, c, p, sample, cfg)
		if err != nil {
			return err
		}
		oracle := NewSim(p, c)
		pods := ReplaySequence(sample.Pods, oracle.TotalGPUs(), cfg.MaxDemand)
		slog.Info("scheduler sample: replaying", "policy", p.Name, "nodes", len(c.Nodes), "gpus", oracle.TotalGPUs(), "pods", len(pods))
		res, err := sched.Run(ctx, p, c, pods, oracle)
		if err != nil {
			return fmt.Errorf("failed to replay the sample through kube-scheduler under policy %s: %w", p.Name, err)
		}
		res.BestFit = bestFit.Final
		slog.Info("scheduler sample: policy done", "policy", p.Name, "decisions", res.Decisions, "agreed", res.Agreed,
			"sameDevices", res.SameDevices, "bound", res.Bound, "schedulerAllocationPct", fmt.Sprintf("%.1f", res.Scheduler.AllocPct(res.TotalGPUs)),
			"bestFitAllocationPct", fmt.Sprintf("%.1f", res.BestFit.AllocPct(res.TotalGPUs)), "seconds", fmt.Sprintf("%.0f", res.Elapsed.Seconds()))
		rep.Results = append(rep.Results, res)
	}
	path := filepath.Join(a.out, "scheduler-sample.md")
	if err := os.MkdirAll(a.out, 0o755); err != nil {
		return fmt.Errorf("failed to create %s: %w", a.out, err)
	}
	if err := os.WriteFile(path, []byte(rep.Markdown()), 0o644); err != nil {
		return fmt.Errorf("failed to write %s: %w", path, err)
	}
	fmt.Print(rep.Markdown())
	fmt.Printf("\nwrote %s\n", path)
	var bad []string
	for _, res := range rep.Results {
		if !res.OK() {
			bad = append(bad, fmt.Sprintf("%s (%d of %d decisions agreed, %d of %d bound pods got the allocator's devices)",
				res.Policy, res.Agreed, res.Decisions, res.SameDevices, res.Bound))
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("kube-scheduler and the structured allocator disagreed under %s; see %s", strings.Join(bad, ", "), path)
	}
	return nil
}
