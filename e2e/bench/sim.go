package main

import (
	"context"
	"fmt"
	"sort"
	"strings"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
)

// Features are the allocator features kube-scheduler 1.37 enables by default for what tessera publishes
// (pkg/scheduler/framework/plugins/dynamicresources, AllocatorFeatures): partitionable devices (dynamic MIG
// counters), consumable capacity (shares), prioritized lists (firstAvailable), device taints, admin access
// and binding conditions with device status. Consumable capacity is beyond the "stable" allocator, so this
// set selects the "incubating" one, as the 1.37 scheduler's does; the incubating allocator carries the
// partitionable-devices speed-up of kubernetes#138917.
var Features = structured.Features{
	AdminAccess:            true,
	PartitionableDevices:   true,
	ConsumableCapacity:     true,
	PrioritizedList:        true,
	DeviceTaints:           true,
	DeviceBindingAndStatus: true,
}

type classLister struct{ classes []*resourceapi.DeviceClass }

func (l classLister) List() ([]*resourceapi.DeviceClass, error) { return l.classes, nil }

func (l classLister) Get(name string) (*resourceapi.DeviceClass, error) {
	for _, c := range l.classes {
		if c.Name == name {
			return c, nil
		}
	}
	return nil, fmt.Errorf("device class %q not found", name)
}

// node is one simulated node: its slices (never change) and what is allocated on it.
type node struct {
	name    string
	obj     *v1.Node
	slices  []*resourceapi.ResourceSlice
	devices map[string]DeviceInfo
	// gpuMemory per GPU index, from its largest published device.
	gpuMemory []int64
	// used is the fraction of each GPU held by allocations: 1 for a whole GPU, the instance's share of the
	// GPU's memory for MIG, the consumed compute percent for a share. Only the node filter and the best-fit
	// order read it; the allocator decides.
	used []float64
	// held names what each GPU holds (a MIG profile, "whole GPU" or "share" per allocation), for the end
	// state the report breaks down.
	held [][]string
	// state is the node's AllocatedState, kept incrementally as the scheduler keeps it from allocated
	// claims: dedicated devices, shared device IDs and their aggregated consumed capacity.
	state structured.AllocatedState
	// version counts allocations, so a cached "does not fit" stays valid until the node changes.
	version int
}

func newNode(ns NodeSlices) *node {
	n := &node{
		name:    ns.Node,
		obj:     &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: ns.Node}},
		slices:  ns.Slices,
		devices: map[string]DeviceInfo{},
		state: structured.AllocatedState{
			AllocatedDevices:         sets.New[structured.DeviceID](),
			AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
			AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
		},
	}
	for _, d := range Devices(ns.Slices) {
		n.devices[d.Name] = d
		for len(n.gpuMemory) <= d.GPU {
			n.gpuMemory = append(n.gpuMemory, 0)
		}
		n.gpuMemory[d.GPU] = max(n.gpuMemory[d.GPU], d.Memory)
	}
	n.used = make([]float64, len(n.gpuMemory))
	n.held = make([][]string, len(n.gpuMemory))
	return n
}

func (n *node) free() float64 {
	f := 0.0
	for _, u := range n.used {
		f += 1 - u
	}
	return f
}

const eps = 1e-9

// mayFit is a necessary condition for the claim to fit, so skipping a node that fails it never changes the
// outcome: k whole GPUs need k untouched GPUs; a fraction f needs a GPU with at least f of it free (a MIG
// instance covering f of the memory uses at least f of the memory slices; a share uses exactly f of
// compute), and at least the memory share of the smallest MIG instance that could serve it. `used` counts
// a MIG instance by its memory, never more than its memory slices, so the estimate of free never falls
// below the truth.
func (n *node) mayFit(wholeGPUs int, milli int, minMemory int64) bool {
	if wholeGPUs > 0 {
		c := 0
		for _, u := range n.used {
			if u < eps {
				c++
			}
		}
		return c >= wholeGPUs
	}
	for g, u := range n.used {
		need := float64(milli) / 1000
		if minMemory > 0 && n.gpuMemory[g] > 0 {
			need = max(need, float64(minMemory)/float64(n.gpuMemory[g]))
		}
		if 1-u >= need-eps {
			return true
		}
	}
	return false
}

// commit records an allocation the way the scheduler's AllocatedState tracks allocated claims.
func (n *node) commit(result resourceapi.AllocationResult) error {
	for _, r := range result.Devices.Results {
		if r.Pool != n.name {
			return fmt.Errorf("failed to commit an allocation on node %s: device %s is from pool %s", n.name, r.Device, r.Pool)
		}
		id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
		if r.ShareID == nil {
			n.state.AllocatedDevices.Insert(id)
		} else {
			n.state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, r.ShareID))
			if r.ConsumedCapacity != nil {
				n.state.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, r.ConsumedCapacity))
			}
		}
		d, ok := n.devices[r.Device]
		if !ok {
			return fmt.Errorf("failed to commit an allocation on node %s: unknown device %s", n.name, r.Device)
		}
		var frac float64
		held := "whole GPU"
		switch {
		case r.ShareID != nil:
			frac, held = shareFraction(d, r.ConsumedCapacity), "share"
		case d.Type == TypeMIG && n.gpuMemory[d.GPU] > 0:
			frac, held = float64(d.Memory)/float64(n.gpuMemory[d.GPU]), d.Profile
		default:
			frac = 1
		}
		n.used[d.GPU] = min(1, n.used[d.GPU]+frac)
		n.held[d.GPU] = append(n.held[d.GPU], held)
	}
	n.version++
	return nil
}

// shareFraction is the largest part of the shared device's consumable capacities the share holds. Compute
// is exact (percent); memory is rounded down to its step, so for a fractional share it never exceeds the
// compute part and the estimate of what is free stays at or above the truth. A whole-GPU claim takes the
// device's defaults, all the memory and no compute: only its memory says the GPU is taken.
func shareFraction(d DeviceInfo, consumed map[resourceapi.QualifiedName]resource.Quantity) float64 {
	frac, found := 0.0, false
	for _, name := range []string{"compute", "memory"} {
		total, ok := capacity(d.Device, name)
		if !ok || total.Value.IsZero() {
			continue
		}
		c, ok := consumed[resourceapi.QualifiedName(name)]
		if !ok {
			c, ok = consumed[resourceapi.QualifiedName(DriverName+"/"+name)]
		}
		if ok {
			frac, found = max(frac, c.AsApproximateFloat64()/total.Value.AsApproximateFloat64()), true
		}
	}
	if !found {
		return 1
	}
	return frac
}

// Sim replays pods onto nodes under one policy.
type Sim struct {
	Policy  PolicySpec
	Claims  *ClaimBuilder
	nodes   []*node
	classes classLister
	cache   *cel.Cache
	// Grow, when set, adds a node when a pod fits nowhere (the "GPUs needed" run).
	Grow   func(i int) (NodeSlices, error)
	grown  int
	failed map[failKey]int
	// AllocateCalls counts structured allocator calls (printed with the timing).
	AllocateCalls int
}

type failKey struct {
	node  int
	claim string
}

// NewSim builds a simulator over the given nodes. The CEL cache is bigger than the scheduler's 10 entries
// because every demand size has its own MIG selectors; the cache only saves compilation time.
func NewSim(policy PolicySpec, c *Cluster) *Sim {
	s := &Sim{
		Policy:  policy,
		Claims:  c.Claims,
		classes: classLister{classes: c.Classes},
		cache:   cel.NewCache(4096, cel.Features{EnableConsumableCapacity: true}),
		failed:  map[failKey]int{},
	}
	for _, ns := range c.Nodes {
		s.nodes = append(s.nodes, newNode(ns))
	}
	return s
}

// Place tries to allocate the pod's claim. Node selection, documented in the README: every node that may
// fit (mayFit) is tried in best-fit order — least free GPU capacity first, ties by trace order — and the
// pod goes to the first node where the structured allocator, given only that node's slices and allocated
// state, returns a result. This is what a MostAllocated-scored scheduler converges to, without scoring every
// node.
func (s *Sim) Place(ctx context.Context, pod TracePod) (bool, error) {
	claim, err := s.Claims.Claim(pod)
	if err != nil {
		return false, err
	}
	whole := s.Claims.WholeGPUs(pod)
	minMemory := s.Claims.MinMemory(pod)
	key := s.Claims.Key(pod)
	type cand struct {
		i    int
		free float64
	}
	var cands []cand
	for i, n := range s.nodes {
		if v, ok := s.failed[failKey{i, key}]; ok && v == n.version {
			continue
		}
		if n.mayFit(whole, pod.GPUMilli, minMemory) {
			cands = append(cands, cand{i, n.free()})
		}
	}
	sort.SliceStable(cands, func(a, b int) bool { return cands[a].free < cands[b].free-eps })
	for _, c := range cands {
		ok, err := s.tryNode(ctx, c.i, claim, key)
		if err != nil || ok {
			return ok, err
		}
	}
	if s.Grow != nil {
		ns, err := s.Grow(s.grown)
		if err != nil {
			return false, err
		}
		s.grown++
		s.nodes = append(s.nodes, newNode(ns))
		i := len(s.nodes) - 1
		if !s.nodes[i].mayFit(whole, pod.GPUMilli, minMemory) {
			return false, nil
		}
		ok, err := s.tryNode(ctx, i, claim, key)
		if err != nil || ok {
			return ok, err
		}
		// An empty node did not fit it: no number of extra nodes will.
		return false, nil
	}
	return false, nil
}

func (s *Sim) tryNode(ctx context.Context, i int, claim *resourceapi.ResourceClaim, key string) (bool, error) {
	n := s.nodes[i]
	result, err := s.allocate(ctx, n, claim)
	if err != nil || result == nil {
		if err == nil {
			s.failed[failKey{i, key}] = n.version
		}
		return false, err
	}
	if err := n.commit(*result); err != nil {
		return false, err
	}
	return true, nil
}

// AllocateOn asks the structured allocator for the claim on one named node, given that node's allocated
// state, without recording the result: the scheduler-sample check compares it with the scheduler's choice.
// A nil result means the claim does not fit there.
func (s *Sim) AllocateOn(ctx context.Context, nodeName string, claim *resourceapi.ResourceClaim) (*resourceapi.AllocationResult, error) {
	n, err := s.node(nodeName)
	if err != nil {
		return nil, err
	}
	return s.allocate(ctx, n, claim)
}

// allocate runs the structured allocator on one node with only that node's slices and allocated state, as
// the scheduler's Filter does.
func (s *Sim) allocate(ctx context.Context, n *node, claim *resourceapi.ResourceClaim) (*resourceapi.AllocationResult, error) {
	s.AllocateCalls++
	alloc, err := structured.NewAllocator(ctx, Features, n.state, s.classes, n.slices, s.cache)
	if err != nil {
		return nil, fmt.Errorf("failed to create the structured allocator for node %s: %w", n.name, err)
	}
	results, err := alloc.Allocate(ctx, n.obj, []*resourceapi.ResourceClaim{claim})
	if err != nil {
		return nil, fmt.Errorf("failed to allocate claim %s on node %s: %w", claim.Name, n.name, err)
	}
	if len(results) == 0 {
		return nil, nil
	}
	return &results[0], nil
}

// Commit records an allocation made elsewhere (by kube-scheduler) on the named node.
func (s *Sim) Commit(nodeName string, result resourceapi.AllocationResult) error {
	n, err := s.node(nodeName)
	if err != nil {
		return err
	}
	return n.commit(result)
}

func (s *Sim) node(name string) (*node, error) {
	for _, n := range s.nodes {
		if n.name == name {
			return n, nil
		}
	}
	return nil, fmt.Errorf("failed to find node %s in the simulated cluster", name)
}

// GPUsInUse counts GPUs holding at least one allocation.
func (s *Sim) GPUsInUse() int {
	c := 0
	for _, n := range s.nodes {
		for _, u := range n.used {
			if u > eps {
				c++
			}
		}
	}
	return c
}

// Holdings counts the GPUs by what they hold: "free", "whole GPU", or the MIG profiles (largest first) or
// shares on them, e.g. "4g.40gb + 3g.40gb" or "3 × share". It tells where a policy's capacity went: a
// GPU holding only a 4g.40gb has its top half free, which only a 3g.40gb or smaller can use.
func (s *Sim) Holdings() map[string]int {
	out := map[string]int{}
	for _, n := range s.nodes {
		for _, h := range n.held {
			out[holdingLabel(h)]++
		}
	}
	return out
}

func holdingLabel(held []string) string {
	if len(held) == 0 {
		return "free"
	}
	count := map[string]int{}
	for _, h := range held {
		count[h]++
	}
	names := make([]string, 0, len(count))
	for h := range count {
		names = append(names, h)
	}
	sort.Sort(sort.Reverse(sort.StringSlice(names)))
	parts := make([]string, len(names))
	for i, h := range names {
		parts[i] = h
		if count[h] > 1 {
			parts[i] = fmt.Sprintf("%d × %s", count[h], h)
		}
	}
	return strings.Join(parts, " + ")
}

// TotalGPUs counts the GPUs of every node (grown ones included).
func (s *Sim) TotalGPUs() int {
	c := 0
	for _, n := range s.nodes {
		c += len(n.used)
	}
	return c
}
