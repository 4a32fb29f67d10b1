package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/dynamic-resource-allocation/cel"
	"k8s.io/dynamic-resource-allocation/structured"
	"k8s.io/utils/ptr"
)

// The agreement property: on generated tessera-shaped clusters (slices rendered by tessera's own binaries
// under the whole, shares and default dynamic-MIG policies, some GPUs tainted, some devices already held
// by claims the allocator itself placed) and generated claims (counts, selectors, capacity requests,
// firstAvailable, allocationMode All, tolerations, matchAttribute/distinctAttribute), `kubectl-tessera explain -o json` says a claim fits
// on a node exactly when Kubernetes' structured allocator allocates it there.

const (
	explainCases = 400
	explainSeed  = 14
	explainBin   = "../../target/debug/kubectl-tessera"
)

// explainSettings reads EXPLAIN_SEED and EXPLAIN_CASES, for exploring other seeds by hand; the test as
// make test runs it always uses the defaults.
func explainSettings(t *testing.T) (seed uint64, cases int) {
	seed, cases = explainSeed, explainCases
	if v := os.Getenv("EXPLAIN_SEED"); v != "" {
		if _, err := fmt.Sscan(v, &seed); err != nil {
			t.Fatalf("EXPLAIN_SEED=%q: %v", v, err)
		}
	}
	if v := os.Getenv("EXPLAIN_CASES"); v != "" {
		if _, err := fmt.Sscan(v, &cases); err != nil {
			t.Fatalf("EXPLAIN_CASES=%q: %v", v, err)
		}
	}
	return seed, cases
}

// explainShape is one node's shape: a policy and a number of GPUs.
type explainShape struct {
	policy PolicySpec
	gpus   int
}

func explainPolicies() []PolicySpec {
	return []PolicySpec{
		{Name: "whole", PolicyFile: "policies/whole.yaml", Style: StyleWhole},
		{Name: "shares", PolicyFile: "policies/shares.yaml", Style: StyleShares},
		{Name: "default", Style: StyleAuto},
		// make up's policy: GPU 1 shared, the others dynamic MIG plus whole, on one node.
		{Name: "e2e-mixed", PolicyFile: "../manifests/gpupolicy.yaml", Style: StyleAuto},
	}
}

// explainCase is one generated cluster and claim.
type explainCase struct {
	index  int
	nodes  []NodeSlices
	shapes []explainShape
	held   []*resourceapi.ResourceClaim
	claim  *resourceapi.ResourceClaim
	// second, when set, makes the case a pod with both claims, which the allocator places together.
	second *resourceapi.ResourceClaim
}

func (c *explainCase) slices() []*resourceapi.ResourceSlice {
	var out []*resourceapi.ResourceSlice
	for _, n := range c.nodes {
		out = append(out, n.Slices...)
	}
	return out
}

func (c *explainCase) pending() []*resourceapi.ResourceClaim {
	if c.second == nil {
		return []*resourceapi.ResourceClaim{c.claim}
	}
	return []*resourceapi.ResourceClaim{c.claim, c.second}
}

func (c *explainCase) describe() string {
	var b strings.Builder
	for i, n := range c.nodes {
		fmt.Fprintf(&b, "node %s: %s policy, %d GPU(s)\n", n.Node, c.shapes[i].policy.Name, c.shapes[i].gpus)
	}
	for _, h := range c.held {
		var devs []string
		for _, r := range h.Status.Allocation.Devices.Results {
			devs = append(devs, r.Pool+"/"+r.Device)
		}
		fmt.Fprintf(&b, "held by %s: %s\n", h.Name, strings.Join(devs, ", "))
	}
	for _, claim := range c.pending() {
		spec, _ := json.Marshal(claim.Spec)
		fmt.Fprintf(&b, "claim %s spec: %s\n", claim.Name, spec)
	}
	return b.String()
}

// explainGen draws cases from a seeded RNG.
type explainGen struct {
	rng *rand.Rand
	// present are the classes the current case's nodes publish; most requests name one of them.
	present []string
	src     SliceSource
	models  []string
}

func explainPick[T any](g *explainGen, xs ...T) T { return xs[g.rng.IntN(len(xs))] }

func explainSel(expr string) resourceapi.DeviceSelector {
	return resourceapi.DeviceSelector{CEL: &resourceapi.CELDeviceSelector{Expression: expr}}
}

func (g *explainGen) capacity(class string) *resourceapi.CapacityRequirements {
	req := map[resourceapi.QualifiedName]resource.Quantity{}
	switch class {
	case ClassShared:
		if g.rng.IntN(3) > 0 {
			req["memory"] = resource.MustParse(explainPick(g, "1Gi", "10Gi", "20Gi", "40Gi", "79Gi", "80Gi", "200Gi", "1500Mi"))
		}
		if g.rng.IntN(2) == 0 {
			req["compute"] = resource.MustParse(explainPick(g, "10", "25", "50", "100", "150"))
		}
	default:
		if g.rng.IntN(4) == 0 {
			req["memory"] = resource.MustParse(explainPick(g, "10Gi", "20Gi", "40Gi", "80Gi", "200Gi"))
		}
		if g.rng.IntN(10) == 0 {
			req["compute"] = resource.MustParse("10")
		}
	}
	if len(req) == 0 {
		return nil
	}
	return &resourceapi.CapacityRequirements{Requests: req}
}

func (g *explainGen) selectors(class string) []resourceapi.DeviceSelector {
	if g.rng.IntN(2) == 0 {
		return nil
	}
	attr := `device.attributes["gpu.tessera.dev"]`
	if g.rng.IntN(25) == 0 {
		// Whole GPUs and shares have no profile: a runtime error on them, which the allocator reports
		// as an error and explain as a selector that fails.
		return []resourceapi.DeviceSelector{explainSel(attr + `.profile == "7g.80gb"`)}
	}
	switch class {
	case ClassMIG:
		return []resourceapi.DeviceSelector{explainSel(fmt.Sprintf(`%s.profile == %q`, attr, explainPick(g, "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.18gb", "3g.71gb", "1g.5gb", "3g.20gb")))}
	case ClassGPU:
		return []resourceapi.DeviceSelector{explainPick(g,
			explainSel(fmt.Sprintf(`%s.index == %d`, attr, g.rng.IntN(3))),
			explainSel(fmt.Sprintf(`%s.cudaComputeCapability.isGreaterThan(semver("8.0.0"))`, attr)),
			explainSel(fmt.Sprintf(`%s.productName == "NVIDIA H200"`, attr)),
		)}
	default:
		return []resourceapi.DeviceSelector{explainPick(g,
			explainSel(`device.capacity["gpu.tessera.dev"].memory.compareTo(quantity("100Gi")) >= 0`),
			explainSel(fmt.Sprintf(`%s.index < 1`, attr)),
		)}
	}
}

func (g *explainGen) tolerations() []resourceapi.DeviceToleration {
	if g.rng.IntN(4) != 0 {
		return nil
	}
	return []resourceapi.DeviceToleration{explainPick(g,
		resourceapi.DeviceToleration{Key: "gpu.tessera.dev/unhealthy", Operator: resourceapi.DeviceTolerationOpExists},
		resourceapi.DeviceToleration{Operator: resourceapi.DeviceTolerationOpExists, Effect: resourceapi.DeviceTaintEffectNoExecute},
	)}
}

func (g *explainGen) exact() resourceapi.ExactDeviceRequest {
	class := explainPick(g, ClassGPU, ClassMIG, ClassShared)
	if len(g.present) > 0 && g.rng.IntN(8) > 0 {
		class = explainPick(g, g.present...)
	}
	r := resourceapi.ExactDeviceRequest{
		DeviceClassName: class,
		Selectors:       g.selectors(class),
		Capacity:        g.capacity(class),
		Tolerations:     g.tolerations(),
		AllocationMode:  resourceapi.DeviceAllocationModeExactCount,
		Count:           int64(explainPick(g, 1, 1, 1, 2, 3)),
	}
	if g.rng.IntN(15) == 0 {
		r.AllocationMode, r.Count = resourceapi.DeviceAllocationModeAll, 0
	}
	return r
}

func (g *explainGen) claim(name string, maxRequests int) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID("uid-" + name)}}
	requests := 1
	if g.rng.IntN(3) == 0 {
		requests = maxRequests
	}
	for i := range requests {
		name := fmt.Sprintf("r%d", i)
		if g.rng.IntN(3) == 0 {
			var subs []resourceapi.DeviceSubRequest
			for j := range 2 + g.rng.IntN(2) {
				e := g.exact()
				subs = append(subs, resourceapi.DeviceSubRequest{
					Name: fmt.Sprintf("s%d", j), DeviceClassName: e.DeviceClassName, Selectors: e.Selectors,
					AllocationMode: e.AllocationMode, Count: e.Count, Tolerations: e.Tolerations, Capacity: e.Capacity,
				})
			}
			c.Spec.Devices.Requests = append(c.Spec.Devices.Requests, resourceapi.DeviceRequest{Name: name, FirstAvailable: subs})
			continue
		}
		e := g.exact()
		c.Spec.Devices.Requests = append(c.Spec.Devices.Requests, resourceapi.DeviceRequest{Name: name, Exactly: &e})
	}
	if g.rng.IntN(4) == 0 {
		// A constraint across the claim's requests (or within one request of several devices).
		attr := explainPick(g, "gpu.tessera.dev/index", "gpu.tessera.dev/productName", "resource.kubernetes.io/pcieRoot", "gpu.tessera.dev/profile")
		var requests []string
		if g.rng.IntN(2) == 0 {
			requests = []string{c.Spec.Devices.Requests[0].Name}
			if subs := c.Spec.Devices.Requests[0].FirstAvailable; len(subs) > 0 && g.rng.IntN(2) == 0 {
				requests = []string{c.Spec.Devices.Requests[0].Name + "/" + subs[0].Name}
			}
		}
		constraint := resourceapi.DeviceConstraint{Requests: requests}
		if g.rng.IntN(2) == 0 {
			constraint.MatchAttribute = ptr.To(resourceapi.FullyQualifiedName(attr))
		} else {
			constraint.DistinctAttribute = ptr.To(resourceapi.FullyQualifiedName(attr))
		}
		c.Spec.Devices.Constraints = append(c.Spec.Devices.Constraints, constraint)
	}
	return c
}

// explainTaint marks every device of one GPU of the node the way the controller marks an unhealthy GPU.
func explainTaint(ns NodeSlices, gpu int, effect resourceapi.DeviceTaintEffect) {
	for _, s := range ns.Slices {
		for i := range s.Spec.Devices {
			d := &s.Spec.Devices[i]
			if g, ok := gpuOf(d.Name); ok && g == gpu {
				d.Taints = append(d.Taints, resourceapi.DeviceTaint{Key: "gpu.tessera.dev/unhealthy", Effect: effect})
			}
		}
	}
}

func explainState() structured.AllocatedState {
	return structured.AllocatedState{
		AllocatedDevices:         sets.New[structured.DeviceID](),
		AllocatedSharedDeviceIDs: sets.New[structured.SharedDeviceID](),
		AggregatedCapacity:       structured.NewConsumedCapacityCollection(),
	}
}

func explainRecord(state *structured.AllocatedState, result resourceapi.AllocationResult) {
	for _, r := range result.Devices.Results {
		id := structured.MakeDeviceID(r.Driver, r.Pool, r.Device)
		if r.ShareID == nil {
			state.AllocatedDevices.Insert(id)
			continue
		}
		state.AllocatedSharedDeviceIDs.Insert(structured.MakeSharedDeviceID(id, r.ShareID))
		if r.ConsumedCapacity != nil {
			state.AggregatedCapacity.Insert(structured.NewDeviceConsumedCapacity(id, r.ConsumedCapacity))
		}
	}
}

// explainAllocate runs the structured allocator for a pod's claims on one node, as the scheduler's Filter
// does, and returns the first claim's result.
func explainAllocate(ctx context.Context, classes classLister, cache *cel.Cache, state structured.AllocatedState, slices []*resourceapi.ResourceSlice, node string, claims ...*resourceapi.ResourceClaim) (*resourceapi.AllocationResult, error) {
	alloc, err := structured.NewAllocator(ctx, Features, state, classes, slices, cache)
	if err != nil {
		return nil, err
	}
	results, err := alloc.Allocate(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, claims)
	if err != nil || len(results) == 0 {
		return nil, err
	}
	return &results[0], nil
}

func (g *explainGen) next(ctx context.Context, index int, classes classLister, cache *cel.Cache) (*explainCase, structured.AllocatedState, error) {
	c := &explainCase{index: index}
	state := explainState()
	g.present = nil
	for n := range 1 + g.rng.IntN(2) {
		shape := explainShape{policy: explainPick(g, explainPolicies()...), gpus: 1 + g.rng.IntN(3)}
		var gpus []string
		for range shape.gpus {
			gpus = append(gpus, explainPick(g, g.models...))
		}
		template, err := g.src.Slices(shape.policy, gpus)
		if err != nil {
			return nil, state, err
		}
		ns := ForNode(template, fmt.Sprintf("node-%d", n))
		if g.rng.IntN(5) == 0 {
			explainTaint(ns, g.rng.IntN(shape.gpus), explainPick(g, resourceapi.DeviceTaintEffectNoSchedule, resourceapi.DeviceTaintEffectNoExecute, resourceapi.DeviceTaintEffectNone))
		}
		switch {
		case shape.policy.Name == "e2e-mixed":
			g.present = append(g.present, ClassMIG, ClassShared, ClassGPU)
		case shape.policy.Style == StyleWhole:
			g.present = append(g.present, ClassGPU)
		case shape.policy.Style == StyleShares:
			g.present = append(g.present, ClassShared)
		default:
			g.present = append(g.present, ClassMIG, ClassMIG, ClassGPU)
		}
		c.nodes = append(c.nodes, ns)
		c.shapes = append(c.shapes, shape)
	}
	slices := c.slices()
	// Claims already allocated, placed by the allocator itself so the state is one the scheduler could reach.
	for h := range g.rng.IntN(7) {
		claim := g.claim(fmt.Sprintf("held-%d", h), 1)
		node := c.nodes[g.rng.IntN(len(c.nodes))].Node
		result, err := explainAllocate(ctx, classes, cache, state, slices, node, claim)
		if err != nil || result == nil {
			continue
		}
		explainRecord(&state, *result)
		claim.Status.Allocation = result
		c.held = append(c.held, claim)
	}
	c.claim = g.claim("pending", 2)
	if g.rng.IntN(5) == 0 {
		c.second = g.claim("pending-2", 1)
	}
	return c, state, nil
}

// explainReport is the part of explain's JSON the test reads.
type explainReport struct {
	Fits  bool `json:"fits"`
	Nodes []struct {
		Node      string `json:"node"`
		Fits      bool   `json:"fits"`
		Undecided bool   `json:"undecided"`
	} `json:"nodes"`
	Summary string `json:"summary"`
}

func runExplain(dir string, c *explainCase, classes []*resourceapi.DeviceClass) (*explainReport, string, error) {
	var items []any
	for _, o := range classes {
		o := o.DeepCopy()
		o.APIVersion, o.Kind = "resource.k8s.io/v1", "DeviceClass"
		items = append(items, o)
	}
	for _, o := range c.slices() {
		o := o.DeepCopy()
		o.APIVersion, o.Kind = "resource.k8s.io/v1", "ResourceSlice"
		items = append(items, o)
	}
	for _, o := range append(append([]*resourceapi.ResourceClaim{}, c.held...), c.pending()...) {
		o := o.DeepCopy()
		o.APIVersion, o.Kind = "resource.k8s.io/v1", "ResourceClaim"
		items = append(items, o)
	}
	target := "claim/" + c.claim.Name
	if c.second != nil {
		pod := &v1.Pod{
			TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
			ObjectMeta: metav1.ObjectMeta{Name: "pending-pod", Namespace: "default"},
			Spec: v1.PodSpec{
				Containers: []v1.Container{{Name: "ctr", Image: "pause"}},
				ResourceClaims: []v1.PodResourceClaim{
					{Name: "one", ResourceClaimName: ptr.To(c.claim.Name)},
					{Name: "two", ResourceClaimName: ptr.To(c.second.Name)},
				},
			},
		}
		items = append(items, pod)
		target = "pod/" + pod.Name
	}
	data, err := json.Marshal(map[string]any{"apiVersion": "v1", "kind": "List", "items": items})
	if err != nil {
		return nil, "", err
	}
	file := filepath.Join(dir, fmt.Sprintf("case-%03d.json", c.index))
	if err := os.WriteFile(file, data, 0o644); err != nil {
		return nil, "", err
	}
	cmd := exec.Command(explainBin, "explain", target, "-n", "default", "--from-file", file, "-o", "json")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	var exit *exec.ExitError
	if err != nil && !(errors.As(err, &exit) && exit.ExitCode() == 1) {
		return nil, file, fmt.Errorf("%s explain on %s: %w: %s", explainBin, file, err, stderr.String())
	}
	var rep explainReport
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		return nil, file, fmt.Errorf("failed to read explain's JSON for %s: %w: %s", file, err, stdout.String())
	}
	return &rep, file, nil
}

func TestExplainSaysFitsExactlyWhenTheStructuredAllocatorAllocates(t *testing.T) {
	if _, err := os.Stat(explainBin); err != nil {
		t.Fatalf("%s is missing: run cargo build -p tessera-controller (%v)", explainBin, err)
	}
	for _, bin := range []string{"../../target/debug/tessera-kubelet-plugin", "../../target/debug/tessera-controller"} {
		if _, err := os.Stat(bin); err != nil {
			t.Fatalf("%s is missing: run cargo build -p tessera-kubelet-plugin -p tessera-controller (%v)", bin, err)
		}
	}
	classList, err := LoadClasses("../../deployments/classes")
	if err != nil {
		t.Fatal(err)
	}
	classes := classLister{classes: classList}
	cache := cel.NewCache(4096, cel.Features{EnableConsumableCapacity: true})
	src := &Renderer{PluginBin: "../../target/debug/tessera-kubelet-plugin", ControllerBin: "../../target/debug/tessera-controller", WorkDir: t.TempDir()}
	seed, cases := explainSettings(t)
	gen := &explainGen{rng: rand.New(rand.NewPCG(seed, 0)), src: src, models: []string{"H100-SXM5-80GB", "H200-SXM-141GB", "A100-SXM4-40GB"}}
	ctx := context.Background()
	// Failing cases are kept for reading after the test.
	keep, err := os.MkdirTemp("", "explain-agreement-")
	if err != nil {
		t.Fatal(err)
	}

	type verdict struct {
		c     *explainCase
		want  map[string]bool
		notes map[string]string
	}
	var verdicts []verdict
	for i := range cases {
		c, state, err := gen.next(ctx, i, classes, cache)
		if err != nil {
			t.Fatal(err)
		}
		v := verdict{c: c, want: map[string]bool{}, notes: map[string]string{}}
		for _, n := range c.nodes {
			result, err := explainAllocate(ctx, classes, cache, state, c.slices(), n.Node, c.pending()...)
			// An allocator error (a selector failing at runtime, a pool being updated) leaves the pod
			// pending, as "does not fit" does.
			v.want[n.Node] = err == nil && result != nil
			if err != nil {
				v.notes[n.Node] = err.Error()
			}
		}
		verdicts = append(verdicts, v)
	}

	// Explain runs as a process per case; a few at a time keeps two cores busy.
	reports := make([]*explainReport, len(verdicts))
	files := make([]string, len(verdicts))
	errs := make([]error, len(verdicts))
	var wg sync.WaitGroup
	work := make(chan int)
	for range 3 {
		wg.Go(func() {
			for i := range work {
				reports[i], files[i], errs[i] = runExplain(keep, verdicts[i].c, classList)
			}
		})
	}
	for i := range verdicts {
		work <- i
	}
	close(work)
	wg.Wait()

	fit, notFit, nodeChecks, mismatches, pods := 0, 0, 0, 0, 0
	for i, v := range verdicts {
		if errs[i] != nil {
			t.Fatalf("case %d: %v\n%s", i, errs[i], v.c.describe())
		}
		if v.c.second != nil {
			pods++
		}
		anyFit := false
		for _, n := range reports[i].Nodes {
			want, ok := v.want[n.Node]
			if !ok {
				t.Errorf("case %d: explain reports node %s, which the case does not have", i, n.Node)
				continue
			}
			nodeChecks++
			anyFit = anyFit || want
			if n.Fits != want {
				mismatches++
				t.Errorf("case %d, node %s: explain says fits=%v (undecided=%v), the structured allocator says %v %s\nexplain: %s\nfile: %s\n%s",
					i, n.Node, n.Fits, n.Undecided, want, v.notes[n.Node], reports[i].Summary, files[i], v.c.describe())
			}
		}
		if len(reports[i].Nodes) != len(v.c.nodes) {
			t.Errorf("case %d: explain reports %d nodes, the case has %d (%s)", i, len(reports[i].Nodes), len(v.c.nodes), files[i])
		}
		if reports[i].Fits != anyFit {
			t.Errorf("case %d: explain's overall fits=%v, the allocator fits on some node: %v (%s)", i, reports[i].Fits, anyFit, files[i])
		}
		// EXPLAIN_DEBUG=1 prints every case's summary, to see what the generator exercises.
		if os.Getenv("EXPLAIN_DEBUG") != "" {
			t.Logf("case %d: %s", i, reports[i].Summary)
		}
		if anyFit {
			fit++
		} else {
			notFit++
		}
	}
	t.Logf("explain agreement: %d cases (seed %d, %d of them pods with two claims): %d fit on some node, %d fit nowhere; %d node verdicts compared, %d disagree",
		len(verdicts), seed, pods, fit, notFit, nodeChecks, mismatches)
	if !t.Failed() {
		os.RemoveAll(keep)
	} else {
		t.Logf("the failing cases' files are kept in %s", keep)
	}
	if fit == 0 || notFit == 0 {
		t.Errorf("the generator must produce both outcomes to test anything: %d fit, %d do not", fit, notFit)
	}
}
