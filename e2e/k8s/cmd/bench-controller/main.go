// Command bench-controller measures tessera's controller against a real API server at cluster scale: it
// registers N Nodes with NodeInventories (8 GPUs each, as the simulated plugin discovers them), keeps
// every heartbeat fresh itself the way the plugin does (-heartbeat-object: the node's Lease, or the
// NodeInventory status as plugins before the Lease heartbeat did), starts the controller binary and reports how long the controller takes
// to publish every pool, what it writes at steady state, after one node's inventory changes and after a
// policy change that touches every node, and the peak RSS of the controller and of the API server.
//
// It is a benchmark, not a test: it exits non-zero only when the benchmark itself cannot run (the API
// server refuses the objects, the controller dies, a phase never converges within -timeout), never on a
// timing. The table goes to -out and to stdout.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"

	"tessera.dev/e2e/internal/procstat"
)

const driverName = "gpu.tessera.dev"

var (
	inventoryGVR = schema.GroupVersionResource{Group: "gpu.tessera.dev", Version: "v1alpha1", Resource: "nodeinventories"}
	policyGVR    = schema.GroupVersionResource{Group: "gpu.tessera.dev", Version: "v1alpha1", Resource: "gpupolicies"}
)

// shapes are the node shapes the issue names: every node 8 × H100, 8 × H200, and a mix of four models.
var shapes = map[string][]string{
	"h100": {"H100-SXM5-80GB:8"},
	"h200": {"H200-SXM-141GB:8"},
	"mix":  {"A100-SXM4-80GB:2", "H100-SXM5-80GB:2", "H200-SXM-141GB:2", "B200:2"},
}

type options struct {
	kubeconfig        string
	controller        string
	plugin            string
	apiserverPidFile  string
	nodes             int
	shapes            string
	steady            time.Duration
	settle            time.Duration
	heartbeatInterval time.Duration
	heartbeatObject   string
	leaseNamespace    string
	leaseName         string
	timeout           time.Duration
	out               string
	logDir            string
	workers           int
}

func main() {
	var o options
	flag.StringVar(&o.kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "admin kubeconfig of the API server")
	flag.StringVar(&o.controller, "controller", "target/debug/tessera-controller", "tessera-controller binary")
	flag.StringVar(&o.plugin, "plugin", "target/debug/tessera-kubelet-plugin", "tessera-kubelet-plugin binary (its discover command renders the inventories)")
	flag.StringVar(&o.apiserverPidFile, "apiserver-pid-file", "", "pid file of the kube-apiserver, for its RSS (empty: not measured)")
	flag.IntVar(&o.nodes, "nodes", 1000, "number of GPU nodes")
	flag.StringVar(&o.shapes, "shapes", "h100,h200,mix", "node shapes to run, in order (h100, h200, mix)")
	flag.DurationVar(&o.steady, "steady", 5*time.Minute, "steady-state window in which writes are counted")
	flag.DurationVar(&o.settle, "settle", 20*time.Second, "how long writes are counted after one node's inventory changes")
	flag.DurationVar(&o.heartbeatInterval, "heartbeat-interval", 10*time.Second, "how often each node's heartbeat is renewed (the plugin's default)")
	flag.StringVar(&o.heartbeatObject, "heartbeat-object", heartbeatLease, "what each heartbeat writes: lease (the node's Lease, as the plugin does) or inventory (the NodeInventory status, as plugins before the Lease heartbeat did)")
	flag.StringVar(&o.leaseNamespace, "lease-namespace", "tessera-system", "namespace of the controller's leader Lease and the nodes' heartbeat Leases (the controller's --lease-namespace)")
	flag.StringVar(&o.leaseName, "lease-name", "tessera-controller", "the controller's leader Lease (its --lease-name)")
	flag.DurationVar(&o.timeout, "timeout", 10*time.Minute, "give up on a phase that has not converged after this long")
	flag.StringVar(&o.out, "out", "e2e/bench/results/controller.md", "where the table goes")
	flag.StringVar(&o.logDir, "log-dir", os.TempDir(), "where the controller's log goes")
	flag.IntVar(&o.workers, "workers", 8, "parallel API calls while creating and cleaning up objects")
	flag.Parse()
	if o.heartbeatObject != heartbeatLease && o.heartbeatObject != heartbeatInventory {
		fmt.Fprintf(os.Stderr, "bench-controller: -heartbeat-object %q: use %s or %s\n", o.heartbeatObject, heartbeatLease, heartbeatInventory)
		os.Exit(2)
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "bench-controller:", err)
		os.Exit(1)
	}
}

// The values of -heartbeat-object.
const (
	heartbeatLease     = "lease"
	heartbeatInventory = "inventory"
)

// What the plugin's Lease heartbeat uses (api/src/heartbeat.rs): the Lease name prefix, its label, the
// leader Lease's annotation naming a holder that reads node Leases, and the plugin's field manager.
const (
	nodeLeasePrefix           = "tessera-node-"
	heartbeatLabel            = "gpu.tessera.dev/heartbeat"
	readsNodeLeasesAnnotation = "gpu.tessera.dev/reads-node-leases"
	pluginFieldManager        = "tessera-kubelet-plugin"
	// The plugin reads the leader Lease at most this often.
	leaderLeaseReadInterval = 20 * time.Second
)

// bench holds the clients and the slice informer every phase reads.
type bench struct {
	o       options
	client  kubernetes.Interface
	dyn     dynamic.Interface
	slices  cache.SharedIndexInformer
	changes sync.Map // pool -> *atomic.Int64: slice adds, updates and deletes seen
	nodeUID sync.Map // node name -> types.UID, for the heartbeat Lease's ownerReference
	// Heartbeat requests sent, by kind, for the table.
	leaseApplies, statusWrites, leaderReads atomic.Int64
}

// loadAtStart is the machine's load average when the bench started, for the table's header.
var loadAtStart = procstat.LoadAverage()

func run(ctx context.Context, o options) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		return fmt.Errorf("failed to load -kubeconfig %q: %w", o.kubeconfig, err)
	}
	// The bench plays 1,000 plugins at once; client-go's default 5 QPS would make it the bottleneck.
	cfg.QPS, cfg.Burst = 500, 1000
	cfg.UserAgent = "bench-controller"
	b := &bench{o: o}
	if b.client, err = kubernetes.NewForConfig(cfg); err != nil {
		return fmt.Errorf("failed to create a client: %w", err)
	}
	if b.dyn, err = dynamic.NewForConfig(cfg); err != nil {
		return fmt.Errorf("failed to create a dynamic client: %w", err)
	}
	factory := informers.NewSharedInformerFactory(b.client, 0)
	b.slices = factory.Resource().V1().ResourceSlices().Informer()
	count := func(obj any) {
		if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = tomb.Obj
		}
		if s, ok := obj.(*resourcev1.ResourceSlice); ok && s.Spec.Driver == driverName {
			c, _ := b.changes.LoadOrStore(s.Spec.Pool.Name, new(atomic.Int64))
			c.(*atomic.Int64).Add(1)
		}
	}
	if _, err := b.slices.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: count, UpdateFunc: func(_, obj any) { count(obj) }, DeleteFunc: count,
	}); err != nil {
		return fmt.Errorf("failed to watch ResourceSlices: %w", err)
	}
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), b.slices.HasSynced) {
		return errors.New("failed to list ResourceSlices")
	}

	var results []result
	for _, shape := range strings.Split(o.shapes, ",") {
		if _, ok := shapes[shape]; !ok {
			return fmt.Errorf("-shapes: unknown shape %q (known: h100, h200, mix)", shape)
		}
		r, err := b.runShape(ctx, shape)
		if err != nil {
			return fmt.Errorf("shape %s: %w", shape, err)
		}
		results = append(results, r)
		fmt.Fprint(os.Stderr, r.String())
	}
	table := markdown(o, results)
	fmt.Print(table)
	if err := os.MkdirAll(filepath.Dir(o.out), 0o755); err != nil {
		return fmt.Errorf("failed to create the directory of -out: %w", err)
	}
	if err := os.WriteFile(o.out, []byte(table), 0o644); err != nil {
		return fmt.Errorf("failed to write -out %s: %w", o.out, err)
	}
	return nil
}

// result is one shape's measurements.
type result struct {
	shape, models                 string
	nodes, slices, devices        int
	converge                      time.Duration
	steadyWrites                  int64
	steadyRequests                int64
	changeWrites                  int64
	changePools                   []string
	changeRequests                int64
	policyConverge                time.Duration
	policyWrites, policyRequests  int64
	controllerPeak, apiserverPeak int64
	steadyBeats                   beats
}

// beats counts the heartbeat requests the simulated plugins sent in a window.
type beats struct{ leaseApplies, statusWrites, leaderReads int64 }

func (b *bench) beatCount() beats {
	return beats{b.leaseApplies.Load(), b.statusWrites.Load(), b.leaderReads.Load()}
}

func (x beats) minus(y beats) beats {
	return beats{x.leaseApplies - y.leaseApplies, x.statusWrites - y.statusWrites, x.leaderReads - y.leaderReads}
}

func (x beats) String() string {
	return fmt.Sprintf("%d Lease applies, %d NodeInventory status writes, %d leader-Lease GETs", x.leaseApplies, x.statusWrites, x.leaderReads)
}

func (r result) String() string {
	return fmt.Sprintf("%s: %d nodes, %d slices, %d devices; published in %s; steady %d slice changes (%d write requests); "+
		"one inventory changed: %d slice changes in pools %v; policy change converged in %s; controller peak %s, kube-apiserver peak %s\n",
		r.shape, r.nodes, r.slices, r.devices, r.converge.Round(10*time.Millisecond), r.steadyWrites, r.steadyRequests,
		r.changeWrites, r.changePools, r.policyConverge.Round(10*time.Millisecond), mib(r.controllerPeak), mib(r.apiserverPeak))
}

func (b *bench) runShape(ctx context.Context, shape string) (result, error) {
	r := result{shape: shape, models: strings.Join(shapes[shape], " + "), nodes: b.o.nodes}
	fmt.Fprintf(os.Stderr, "==> %s: %d nodes of %s\n", shape, b.o.nodes, r.models)
	spec, err := b.discover(ctx, shape)
	if err != nil {
		return r, err
	}
	names := make([]string, b.o.nodes)
	for i := range names {
		names[i] = fmt.Sprintf("bench-%s-%04d", shape, i)
	}
	if err := b.cleanup(ctx); err != nil {
		return r, err
	}
	t := time.Now()
	if err := b.parallel(ctx, names, func(ctx context.Context, name string) error { return b.createNode(ctx, name, spec) }); err != nil {
		return r, err
	}
	fmt.Fprintf(os.Stderr, "    %d Nodes and NodeInventories created in %s\n", len(names), time.Since(t).Round(time.Millisecond))

	hbCtx, cancelHeartbeats := context.WithCancel(ctx)
	hbDone := make(chan struct{})
	go func() {
		defer close(hbDone)
		b.heartbeats(hbCtx, names)
	}()
	stopHeartbeats := func() {
		cancelHeartbeats()
		<-hbDone
	}
	defer stopHeartbeats()

	rss := newPeaks()
	ctrl, err := b.startController(ctx, shape)
	if err != nil {
		return r, err
	}
	defer ctrl.stop()
	start := ctrl.started
	samplerCtx, stopSampler := context.WithCancel(ctx)
	defer stopSampler()
	go rss.sample(samplerCtx, "controller", func() (int, error) { return ctrl.cmd.Process.Pid, nil })
	if b.o.apiserverPidFile != "" {
		go rss.sample(samplerCtx, "kube-apiserver", func() (int, error) { return readPid(b.o.apiserverPidFile) })
	}

	// 1. Controller start to every pool published.
	if err := b.waitFor(ctx, ctrl, "every pool published", func(p map[string]pool) bool { return allComplete(p, names, nil) }); err != nil {
		return r, err
	}
	r.converge = time.Since(start)
	pools := b.pools()
	for _, n := range names {
		r.slices += pools[n].slices
		r.devices += pools[n].devices
	}
	fmt.Fprintf(os.Stderr, "    every pool published %s after the controller started (%d slices, %d devices)\n", r.converge.Round(time.Millisecond), r.slices, r.devices)

	// 2. Steady state: heartbeats keep arriving, nothing else changes.
	mark := b.snapshot(ctx)
	beatsBefore := b.beatCount()
	if err := procstat.Sleep(ctx, b.o.steady); err != nil {
		return r, err
	}
	if err := ctrl.alive(); err != nil {
		return r, err
	}
	d := b.since(ctx, mark)
	r.steadyWrites, r.steadyRequests = d.changes, d.requests
	r.steadyBeats = b.beatCount().minus(beatsBefore)
	fmt.Fprintf(os.Stderr, "    steady state over %s: %d slice changes, %d ResourceSlice write requests; heartbeats: %s\n", b.o.steady, d.changes, d.requests, r.steadyBeats)

	// 3. One node's inventory changes: its last GPU goes away (a GPU fell off the bus).
	changed := names[len(names)/2]
	mark = b.snapshot(ctx)
	before := b.pools()[changed].devices
	if err := b.dropLastGPU(ctx, changed); err != nil {
		return r, err
	}
	if err := b.waitFor(ctx, ctrl, "the changed pool republished", func(p map[string]pool) bool {
		return p[changed].complete() && p[changed].devices < before
	}); err != nil {
		return r, err
	}
	if err := procstat.Sleep(ctx, b.o.settle); err != nil {
		return r, err
	}
	d = b.since(ctx, mark)
	r.changeWrites, r.changePools, r.changeRequests = d.changes, d.pools, d.requests
	fmt.Fprintf(os.Stderr, "    one inventory changed (%s): %d slice changes in pools %v, %d write requests\n", changed, d.changes, d.pools, d.requests)

	// 4. A policy change that touches every node: every GPU becomes one whole device.
	mark = b.snapshot(ctx)
	t = time.Now()
	if err := b.applyWholePolicy(ctx); err != nil {
		return r, err
	}
	gpus := map[string]int{}
	for _, n := range names {
		gpus[n] = spec.gpus
	}
	gpus[changed] = spec.gpus - 1
	if err := b.waitFor(ctx, ctrl, "every pool republished under the whole-GPU policy", func(p map[string]pool) bool {
		return allComplete(p, names, func(name string, pl pool) bool { return pl.devices == gpus[name] })
	}); err != nil {
		return r, err
	}
	r.policyConverge = time.Since(t)
	// The old generation's slices are deleted after the new one is complete; count those writes too.
	if err := procstat.Sleep(ctx, b.o.settle); err != nil {
		return r, err
	}
	d = b.since(ctx, mark)
	r.policyWrites, r.policyRequests = d.changes, d.requests
	fmt.Fprintf(os.Stderr, "    policy change converged in %s: %d slice changes, %d write requests\n", r.policyConverge.Round(time.Millisecond), d.changes, d.requests)

	stopSampler()
	r.controllerPeak, r.apiserverPeak = rss.max("controller"), rss.max("kube-apiserver")
	ctrl.stop()
	stopHeartbeats()
	return r, b.cleanup(ctx)
}

// inventorySpec is the NodeInventory spec the simulated plugin discovers for one shape.
type inventorySpec struct {
	spec map[string]any
	gpus int
}

// discover renders the shape's inventory with the plugin's own discover command, so the bench publishes
// exactly what a plugin on such a node would.
func (b *bench) discover(ctx context.Context, shape string) (inventorySpec, error) {
	var file bytes.Buffer
	file.WriteString("gpus:\n")
	for _, m := range shapes[shape] {
		model, count, _ := strings.Cut(m, ":")
		fmt.Fprintf(&file, "  - model: %s\n    count: %s\n", model, count)
	}
	dir, err := os.MkdirTemp("", "bench-controller-")
	if err != nil {
		return inventorySpec{}, fmt.Errorf("failed to create a temp dir: %w", err)
	}
	defer os.RemoveAll(dir)
	nodeFile := filepath.Join(dir, "node.yaml")
	if err := os.WriteFile(nodeFile, file.Bytes(), 0o644); err != nil {
		return inventorySpec{}, fmt.Errorf("failed to write %s: %w", nodeFile, err)
	}
	out, err := exec.CommandContext(ctx, b.o.plugin, "discover", "--backend", "simulated", "--simulated-node-file", nodeFile,
		"--node-name", "bench", "--state-dir", filepath.Join(dir, "state")).Output()
	if err != nil {
		return inventorySpec{}, fmt.Errorf("%s discover failed: %w", b.o.plugin, describeExit(err))
	}
	spec := map[string]any{}
	if err := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(out), 4096).Decode(&spec); err != nil {
		return inventorySpec{}, fmt.Errorf("failed to parse what %s discover printed: %w", b.o.plugin, err)
	}
	gpus, _ := spec["gpus"].([]any)
	if len(gpus) == 0 {
		return inventorySpec{}, fmt.Errorf("%s discover printed no gpus for %s", b.o.plugin, shape)
	}
	return inventorySpec{spec: spec, gpus: len(gpus)}, nil
}

func describeExit(err error) error {
	var exit *exec.ExitError
	if errors.As(err, &exit) && len(exit.Stderr) > 0 {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(string(exit.Stderr)))
	}
	return err
}

// createNode registers what a GPU node contributes: the Node (the controller publishes only pools of
// existing Nodes) and its NodeInventory, ready and with a first heartbeat. GPU UUIDs are made unique
// per node, as real ones are.
func (b *bench) createNode(ctx context.Context, name string, s inventorySpec) error {
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name, "bench.tessera.dev/controller": "true"}}}
	node, err := b.client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("failed to create Node %s: %w", name, err)
	}
	b.nodeUID.Store(name, node.UID)
	spec := deepCopy(s.spec)
	spec["nodeName"] = name
	for i, g := range spec["gpus"].([]any) {
		g.(map[string]any)["uuid"] = fmt.Sprintf("GPU-%08x-0000-4000-8000-%012d", hash(name), i)
	}
	inv := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "gpu.tessera.dev/v1alpha1",
		"kind":       "NodeInventory",
		"metadata": map[string]any{
			"name": name,
			"ownerReferences": []any{map[string]any{
				"apiVersion": "v1", "kind": "Node", "name": name, "uid": string(node.UID),
			}},
		},
		"spec": spec,
	}}
	created, err := b.dyn.Resource(inventoryGVR).Create(ctx, inv, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("failed to create NodeInventory %s: %w", name, err)
	}
	return b.heartbeat(ctx, created, s.gpus)
}

func deepCopy(m map[string]any) map[string]any {
	return (&unstructured.Unstructured{Object: m}).DeepCopy().Object
}

func hash(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h = (h ^ uint32(s[i])) * 16777619
	}
	return h
}

// heartbeat writes status the way the plugin does: ready, with the heartbeat time renewed.
func (b *bench) heartbeat(ctx context.Context, inv *unstructured.Unstructured, gpus int) error {
	inv = inv.DeepCopy()
	inv.Object["status"] = map[string]any{
		"ready":             true,
		"gpuCount":          int64(gpus),
		"lastHeartbeatTime": time.Now().UTC().Format(time.RFC3339Nano),
	}
	_, err := b.dyn.Resource(inventoryGVR).UpdateStatus(ctx, inv, metav1.UpdateOptions{})
	if err != nil {
		return fmt.Errorf("failed to renew the heartbeat of %s: %w", inv.GetName(), err)
	}
	return nil
}

// simPlugin is what one simulated plugin remembers between beats: when it last read the leader Lease and
// whether the leader then said it reads node Leases.
type simPlugin struct {
	mu            sync.Mutex
	leaderReadAt  time.Time
	leaderReadsUs bool
}

// heartbeats renews every node's heartbeat once per -heartbeat-interval, spread evenly over it like 1,000
// independent plugins would be. Beats go to a pool of workers, so a slow API server delays a beat but
// never stretches the round (a stretched round would let the controller rightly withdraw pools whose
// heartbeats went stale). A missed beat is retried next round; only a context end stops it.
func (b *bench) heartbeats(ctx context.Context, names []string) {
	work := make(chan string, len(names))
	var failures, late atomic.Int64
	var wg sync.WaitGroup
	plugins := make(map[string]*simPlugin, len(names))
	for _, n := range names {
		plugins[n] = &simPlugin{}
	}
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range work {
				if err := b.beat(ctx, name, plugins[name]); err != nil && ctx.Err() == nil {
					failures.Add(1)
				}
			}
		}()
	}
	defer func() {
		close(work)
		wg.Wait()
		if failures.Load() > 0 || late.Load() > 0 {
			fmt.Fprintf(os.Stderr, "    heartbeats: %d failed, %d skipped because the previous round was still queued\n", failures.Load(), late.Load())
		}
	}()
	tick := time.NewTicker(b.o.heartbeatInterval / time.Duration(len(names)))
	defer tick.Stop()
	for i := 0; ; i = (i + 1) % len(names) {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		select {
		case work <- names[i]:
		default:
			late.Add(1)
		}
	}
}

// beat is one heartbeat of one node's plugin. With -heartbeat-object lease it does what the plugin does
// (kubelet-plugin/src/kubelet/inventory.rs): a server-side apply of the node's small Lease, a GET of the leader
// Lease when the last read is leaderLeaseReadInterval old, and the NodeInventory status rewritten too
// unless that leader said it reads node Leases. With inventory, only the status write, as plugins before
// the Lease heartbeat did.
func (b *bench) beat(ctx context.Context, name string, p *simPlugin) error {
	now := time.Now().UTC()
	writeStatus := true
	if b.o.heartbeatObject == heartbeatLease {
		if err := b.applyNodeLease(ctx, name, now); err != nil {
			return err
		}
		p.mu.Lock()
		if now.Sub(p.leaderReadAt) >= leaderLeaseReadInterval {
			p.leaderReadAt = now
			p.leaderReadsUs = b.leaderReadsNodeLeases(ctx)
		}
		writeStatus = !p.leaderReadsUs
		p.mu.Unlock()
	}
	if !writeStatus {
		return nil
	}
	// One merge patch of the status per beat, as cheap as a status heartbeat can be for the API server.
	patch := fmt.Appendf(nil, `{"status":{"ready":true,"lastHeartbeatTime":%q}}`, now.Format(time.RFC3339Nano))
	_, err := b.dyn.Resource(inventoryGVR).Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	b.statusWrites.Add(1)
	return err
}

// applyNodeLease renews the Lease tessera-node-<name> as the plugin writes it: server-side apply (which
// creates it the first time), holder the node, 4 heartbeat intervals long, owned by the Node.
func (b *bench) applyNodeLease(ctx context.Context, name string, now time.Time) error {
	uid, _ := b.nodeUID.Load(name)
	lease := map[string]any{
		"apiVersion": "coordination.k8s.io/v1",
		"kind":       "Lease",
		"metadata": map[string]any{
			"name":      nodeLeasePrefix + name,
			"namespace": b.o.leaseNamespace,
			"labels":    map[string]any{heartbeatLabel: "node"},
			"ownerReferences": []any{map[string]any{
				"apiVersion": "v1", "kind": "Node", "name": name, "uid": fmt.Sprint(uid),
			}},
		},
		"spec": map[string]any{
			"holderIdentity":       name,
			"leaseDurationSeconds": max(1, int64(4*b.o.heartbeatInterval/time.Second)),
			// A MicroTime: RFC 3339 with microseconds.
			"renewTime": now.Format("2006-01-02T15:04:05.000000Z07:00"),
		},
	}
	body, err := json.Marshal(lease)
	if err != nil {
		return err
	}
	_, err = b.client.CoordinationV1().Leases(b.o.leaseNamespace).Patch(ctx, nodeLeasePrefix+name, types.ApplyPatchType, body,
		metav1.PatchOptions{FieldManager: pluginFieldManager, Force: ptr.To(true)})
	b.leaseApplies.Add(1)
	return err
}

// leaderReadsNodeLeases reads the controller's leader Lease: true when its annotation names the current,
// non-empty holder (an older controller taking over keeps the annotation but changes the holder).
func (b *bench) leaderReadsNodeLeases(ctx context.Context) bool {
	l, err := b.client.CoordinationV1().Leases(b.o.leaseNamespace).Get(ctx, b.o.leaseName, metav1.GetOptions{})
	b.leaderReads.Add(1)
	if err != nil || l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" {
		return false
	}
	return l.Annotations[readsNodeLeasesAnnotation] == *l.Spec.HolderIdentity
}

func (b *bench) dropLastGPU(ctx context.Context, name string) error {
	// The heartbeat loop writes the same object's status meanwhile, so a read-modify-write can meet a newer
	// resourceVersion: read again and retry, as any client of a live object does.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		inv, err := b.dyn.Resource(inventoryGVR).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("failed to get NodeInventory %s: %w", name, err)
		}
		gpus, _, _ := unstructured.NestedSlice(inv.Object, "spec", "gpus")
		if err := unstructured.SetNestedSlice(inv.Object, gpus[:len(gpus)-1], "spec", "gpus"); err != nil {
			return err
		}
		_, err = b.dyn.Resource(inventoryGVR).Update(ctx, inv, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("failed to update NodeInventory %s: %w", name, err)
	}
	return nil
}

func (b *bench) applyWholePolicy(ctx context.Context) error {
	policy := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "gpu.tessera.dev/v1alpha1",
		"kind":       "GpuPolicy",
		"metadata":   map[string]any{"name": "default"},
		"spec":       map[string]any{"rules": []any{map[string]any{"name": "whole", "whole": map[string]any{}}}},
	}}
	if _, err := b.dyn.Resource(policyGVR).Create(ctx, policy, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("failed to create GpuPolicy default: %w", err)
	}
	return nil
}

// cleanup removes what a run created (and what an interrupted earlier run left), then waits for the
// driver's slices to be gone.
func (b *bench) cleanup(ctx context.Context) error {
	err := b.dyn.Resource(policyGVR).Delete(ctx, "default", metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("failed to delete GpuPolicy default: %w", err)
	}
	sel := metav1.ListOptions{LabelSelector: "bench.tessera.dev/controller=true"}
	nodes, err := b.client.CoreV1().Nodes().List(ctx, sel)
	if err != nil {
		return fmt.Errorf("failed to list the bench's Nodes: %w", err)
	}
	var names []string
	for _, n := range nodes.Items {
		names = append(names, n.Name)
	}
	err = b.parallel(ctx, names, func(ctx context.Context, name string) error {
		if err := b.dyn.Resource(inventoryGVR).Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("failed to delete NodeInventory %s: %w", name, err)
		}
		if err := b.client.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("failed to delete Node %s: %w", name, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	err = b.client.ResourceV1().ResourceSlices().DeleteCollection(ctx, metav1.DeleteOptions{},
		metav1.ListOptions{FieldSelector: "spec.driver=" + driverName})
	if err != nil {
		return fmt.Errorf("failed to delete the driver's ResourceSlices: %w", err)
	}
	// The controller keeps its Lease when it stops; the next shape's controller would wait out the
	// lease duration before writing anything, which is failover time, not start-up time.
	err = b.client.CoordinationV1().Leases(b.o.leaseNamespace).Delete(ctx, b.o.leaseName, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("failed to delete the controller's Lease: %w", err)
	}
	// The nodes' heartbeat Leases would go with their Nodes through the garbage collector; without waiting
	// for it, the next shape starts with none.
	err = b.client.CoordinationV1().Leases(b.o.leaseNamespace).DeleteCollection(ctx, metav1.DeleteOptions{},
		metav1.ListOptions{LabelSelector: heartbeatLabel + "=node"})
	if err != nil {
		return fmt.Errorf("failed to delete the nodes' heartbeat Leases: %w", err)
	}
	deadline := time.Now().Add(b.o.timeout)
	for len(b.pools()) > 0 {
		if time.Now().After(deadline) {
			return fmt.Errorf("the driver's ResourceSlices were not gone %s after cleanup", b.o.timeout)
		}
		if err := procstat.Sleep(ctx, 200*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

func (b *bench) parallel(ctx context.Context, names []string, f func(context.Context, string) error) error {
	work := make(chan string)
	errs := make(chan error, b.o.workers)
	var wg sync.WaitGroup
	for range b.o.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range work {
				if err := f(ctx, name); err != nil {
					select {
					case errs <- err:
					default:
					}
				}
			}
		}()
	}
	for _, n := range names {
		select {
		case work <- n:
		case err := <-errs:
			close(work)
			wg.Wait()
			return err
		}
	}
	close(work)
	wg.Wait()
	select {
	case err := <-errs:
		return err
	default:
		return nil
	}
}

// pool is what the slice informer holds for one pool.
type pool struct {
	generation         int64
	slices, sliceCount int // slices at the newest generation, and how many the pool says it has
	devices            int
}

func (p pool) complete() bool { return p.sliceCount > 0 && p.slices == p.sliceCount }

func (b *bench) pools() map[string]pool {
	out := map[string]pool{}
	for _, obj := range b.slices.GetStore().List() {
		s := obj.(*resourcev1.ResourceSlice)
		if s.Spec.Driver != driverName {
			continue
		}
		p := out[s.Spec.Pool.Name]
		switch {
		case s.Spec.Pool.Generation > p.generation:
			p = pool{generation: s.Spec.Pool.Generation}
			fallthrough
		case s.Spec.Pool.Generation == p.generation:
			p.slices++
			p.sliceCount = int(s.Spec.Pool.ResourceSliceCount)
			p.devices += len(s.Spec.Devices)
		}
		out[s.Spec.Pool.Name] = p
	}
	return out
}

func allComplete(pools map[string]pool, names []string, also func(string, pool) bool) bool {
	for _, n := range names {
		p, ok := pools[n]
		if !ok || !p.complete() || (also != nil && !also(n, p)) {
			return false
		}
	}
	return true
}

func (b *bench) waitFor(ctx context.Context, ctrl *controller, what string, done func(map[string]pool) bool) error {
	deadline := time.Now().Add(b.o.timeout)
	for !done(b.pools()) {
		if err := ctrl.alive(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not converged after -timeout %s: %s (controller log: %s)", b.o.timeout, what, ctrl.log)
		}
		// Each check walks every slice in the informer (9,000 at full size); 4 a second keep the bench's
		// own CPU use small beside the controller's on 2 cores.
		if err := procstat.Sleep(ctx, 250*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

// mark is a point to count writes from: slice changes per pool, and the API server's own count of
// ResourceSlice write requests (every create, update, patch and delete, failed or dry-run ones included).
type mark struct {
	changes  map[string]int64
	requests int64
}

type delta struct {
	changes, requests int64
	pools             []string
}

func (b *bench) changesByPool() map[string]int64 {
	out := map[string]int64{}
	b.changes.Range(func(k, v any) bool {
		out[k.(string)] = v.(*atomic.Int64).Load()
		return true
	})
	return out
}

func (b *bench) snapshot(ctx context.Context) mark {
	return mark{changes: b.changesByPool(), requests: b.sliceWriteRequests(ctx)}
}

func (b *bench) since(ctx context.Context, m mark) delta {
	var d delta
	for p, n := range b.changesByPool() {
		if n > m.changes[p] {
			d.changes += n - m.changes[p]
			d.pools = append(d.pools, p)
		}
	}
	sort.Strings(d.pools)
	if len(d.pools) > 5 {
		d.pools = append(d.pools[:5], fmt.Sprintf("… %d pools in all", len(d.pools)))
	}
	d.requests = b.sliceWriteRequests(ctx) - m.requests
	return d
}

// sliceWriteRequests reads apiserver_request_total from the API server's /metrics and sums the
// mutating verbs on resourceslices; -1 when the metrics cannot be read.
func (b *bench) sliceWriteRequests(ctx context.Context) int64 {
	raw, err := b.client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return -1
	}
	var total int64
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "apiserver_request_total{") || !strings.Contains(line, `resource="resourceslices"`) {
			continue
		}
		verb := label(line, "verb")
		if verb != "POST" && verb != "PUT" && verb != "PATCH" && verb != "DELETE" && verb != "DELETECOLLECTION" {
			continue
		}
		fields := strings.Fields(line)
		v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		if err == nil {
			total += int64(v)
		}
	}
	return total
}

func label(line, name string) string {
	_, rest, ok := strings.Cut(line, name+`="`)
	if !ok {
		return ""
	}
	v, _, _ := strings.Cut(rest, `"`)
	return v
}

// controller is the tessera-controller process of one shape.
type controller struct {
	cmd     *exec.Cmd
	log     string
	started time.Time
	exited  chan struct{}
	err     error
	once    sync.Once
}

func (b *bench) startController(ctx context.Context, shape string) (*controller, error) {
	logPath := filepath.Join(b.o.logDir, "bench-controller-"+shape+".log")
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, fmt.Errorf("failed to create the controller log %s: %w", logPath, err)
	}
	cmd := exec.Command(b.o.controller, "--kubeconfig", b.o.kubeconfig)
	cmd.Env = append(os.Environ(), "RUST_LOG=info", "TESSERA_LEASE_NAMESPACE="+b.o.leaseNamespace, "TESSERA_LEASE_NAME="+b.o.leaseName)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	c := &controller{cmd: cmd, log: logPath, exited: make(chan struct{})}
	c.started = time.Now()
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("failed to start %s: %w", b.o.controller, err)
	}
	go func() {
		c.err = cmd.Wait()
		logFile.Close()
		close(c.exited)
	}()
	return c, nil
}

func (c *controller) alive() error {
	select {
	case <-c.exited:
		return fmt.Errorf("tessera-controller exited (%v); its log: %s", c.err, c.log)
	default:
		return nil
	}
}

func (c *controller) stop() {
	c.once.Do(func() {
		select {
		case <-c.exited:
			return
		default:
		}
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.exited:
		case <-time.After(10 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.exited
		}
	})
}

// peaks keeps the highest RSS seen per process while sampling /proc every 100 ms.
type peaks struct {
	mu  sync.Mutex
	rss map[string]int64
}

func newPeaks() *peaks { return &peaks{rss: map[string]int64{}} }

func (p *peaks) sample(ctx context.Context, name string, pid func() (int, error)) {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		if id, err := pid(); err == nil {
			if v, err := procstat.RSS(id); err == nil {
				p.mu.Lock()
				p.rss[name] = max(p.rss[name], v)
				p.mu.Unlock()
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

func (p *peaks) max(name string) int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rss[name]
}

func readPid(path string) (int, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	// common.sh's pid files hold "pid start-time"; the pid is the first field.
	fields := strings.Fields(string(raw))
	if len(fields) == 0 {
		return 0, fmt.Errorf("empty pid file %s", path)
	}
	return strconv.Atoi(fields[0])
}

func mib(b int64) string {
	if b <= 0 {
		return "not measured"
	}
	return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20))
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "**MISSED**"
}

func markdown(o options, rs []result) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Controller at scale: %d GPU nodes on a real kube-apiserver\n\n", o.nodes)
	heartbeat := "a merge patch of its NodeInventory's status per beat (`-heartbeat-object inventory`: the plugins before the Lease heartbeat)"
	if o.heartbeatObject == heartbeatLease {
		heartbeat = fmt.Sprintf("a server-side apply of its Lease `%s<node>` in %s per beat, a GET of the leader Lease `%s` at most every %s, "+
			"and its NodeInventory's status rewritten each beat only until that Lease says the leader reads node Leases (`-heartbeat-object lease`: the plugin's heartbeat)",
			nodeLeasePrefix, o.leaseNamespace, o.leaseName, leaderLeaseReadInterval)
	}
	fmt.Fprintf(&b, "Heartbeat object: **%s**.\n\n", o.heartbeatObject)
	fmt.Fprintf(&b, "`e2e/scripts/bench-controller.sh -nodes %d -shapes %s -steady %s -heartbeat-interval %s -heartbeat-object %s` on %d CPUs, %s. "+
		"Every node is a Node plus the NodeInventory the simulated plugin discovers for its shape, its heartbeat renewed every %s by the bench: %s; "+
		"no GpuPolicy at first (the built-in default: dynamic MIG wherever the GPU can do it). Controller binary `%s`. Load average (1 / 5 / 15 min) at the start %s, at the end %s.\n\n",
		o.nodes, o.shapes, o.steady, o.heartbeatInterval, o.heartbeatObject, runtime.NumCPU(), time.Now().UTC().Format("2006-01-02"),
		o.heartbeatInterval, heartbeat, o.controller, loadAtStart, procstat.LoadAverage())
	b.WriteString("| shape (per node) | slices / devices | controller start → every pool published | steady-state writes | steady-state heartbeat requests | one node's inventory changes | policy change → converged | controller peak RSS | kube-apiserver peak RSS |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rs {
		fmt.Fprintf(&b, "| %s | %d / %d | %.1f s (≤ 60 s %s) | %d slice changes, %d write requests in %s (target 0: %s) | %s | %d slice changes, %d write requests, pools: %s (target: that pool only: %s) | %.1f s (≤ 60 s %s), %d slice changes, %d write requests | %s (≤ 150 MiB %s) | %s |\n",
			r.models, r.slices, r.devices,
			r.converge.Seconds(), verdict(r.converge <= time.Minute),
			r.steadyWrites, r.steadyRequests, o.steady, verdict(r.steadyWrites == 0 && r.steadyRequests == 0), r.steadyBeats,
			r.changeWrites, r.changeRequests, strings.Join(r.changePools, ", "), verdict(len(r.changePools) == 1),
			r.policyConverge.Seconds(), verdict(r.policyConverge <= time.Minute), r.policyWrites, r.policyRequests,
			mib(r.controllerPeak), verdict(r.controllerPeak > 0 && r.controllerPeak <= 150<<20), mib(r.apiserverPeak))
	}
	b.WriteString("\nHow each number is taken: a ResourceSlice informer in the bench counts every add, update and delete of the driver's slices per pool; " +
		"\"write requests\" is the API server's own `apiserver_request_total` for resourceslices (POST, PUT, PATCH, DELETE, DELETECOLLECTION; conflicts and dry runs included). " +
		"A pool counts as published when it has as many slices of its newest generation as `resourceSliceCount` says. " +
		"The controller holds a pool until it has seen one heartbeat change, so \"every pool published\" includes up to one heartbeat interval. " +
		"The inventory change removes the last GPU of one node; its writes are counted for -settle after that pool is republished. The policy change creates GpuPolicy `default` with one `whole` rule (every pool then has one device per GPU); converged when every pool is complete at one device per GPU, its writes counted until -settle after that. " +
		"\"Steady-state heartbeat requests\" are the bench's own counts of what its simulated plugins sent in the steady window. " +
		"RSS is VmRSS sampled every 100 ms over the whole run of a shape.\n")
	return b.String()
}
