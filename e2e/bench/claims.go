package main

import (
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"
)

// ClaimStyle is how the pods of a policy ask for GPUs.
type ClaimStyle string

const (
	// StyleWhole: every GPU request is whole GPUs, a fractional pod takes one GPU (integer counts today).
	StyleWhole ClaimStyle = "whole"
	// StyleMIG: a fractional pod asks for a MIG instance with at least its memory and its SMs; tessera's
	// device order makes that the smallest covering profile (see migSelector).
	StyleMIG ClaimStyle = "mig"
	// StyleShares: a fractional pod asks for its memory and compute share of a shared GPU.
	StyleShares ClaimStyle = "shares"
	// StyleAuto: a fractional pod takes whatever the slices offer: a covering MIG instance, else (through
	// firstAvailable) a share when shared devices are published, else a whole GPU. Used against tessera's
	// built-in default policy.
	StyleAuto ClaimStyle = "auto"
)

// PolicySpec is one column of the comparison: a GpuPolicy the controller renders slices under and the
// claims users write against those slices.
type PolicySpec struct {
	Name string
	// PolicyFile is a GpuPolicy YAML for `tessera-controller render --policy`; empty renders with the
	// controller's built-in default.
	PolicyFile string
	Style      ClaimStyle
}

// The DeviceClasses tessera ships (deployments/classes): one per device type, selecting on the driver and
// the `type` attribute. Claims name the class and add only what the pod needs.
const (
	ClassGPU    = "gpu.tessera.dev"
	ClassMIG    = "mig.gpu.tessera.dev"
	ClassShared = "shared.gpu.tessera.dev"
)

// LoadClasses reads every DeviceClass YAML in dir (tessera's deployments/classes).
func LoadClasses(dir string) ([]*resourceapi.DeviceClass, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		return nil, fmt.Errorf("failed to find DeviceClass YAML files in %s (the -classes-dir flag)", dir)
	}
	var out []*resourceapi.DeviceClass
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("failed to read DeviceClass file %s: %w", f, err)
		}
		c := &resourceapi.DeviceClass{}
		if err := yaml.UnmarshalStrict(data, c); err != nil {
			return nil, fmt.Errorf("failed to parse DeviceClass file %s: %w", f, err)
		}
		out = append(out, c)
	}
	for _, want := range []string{ClassGPU, ClassMIG, ClassShared} {
		found := false
		for _, c := range out {
			found = found || c.Name == want
		}
		if !found {
			return nil, fmt.Errorf("failed to find DeviceClass %s in %s", want, dir)
		}
	}
	return out, nil
}

// Device types (attribute `type`).
const (
	TypeGPU    = "gpu"
	TypeMIG    = "mig"
	TypeShared = "shared"
)

// DeviceInfo is what the benchmark reads from one published device.
type DeviceInfo struct {
	Name    string
	GPU     int
	Type    string
	Profile string
	Memory  int64
	SMs     int64
	Device  *resourceapi.Device
}

var gpuIndexRe = regexp.MustCompile(`^gpu-(0|[1-9][0-9]*)(-|$)`)

// gpuOf reads the GPU index from a tessera device name (`gpu-<i>...`).
func gpuOf(name string) (int, bool) {
	m := gpuIndexRe.FindStringSubmatch(name)
	if m == nil {
		return 0, false
	}
	i, err := strconv.Atoi(m[1])
	return i, err == nil
}

func attr(d *resourceapi.Device, name string) (resourceapi.DeviceAttribute, bool) {
	if a, ok := d.Attributes[resourceapi.QualifiedName(name)]; ok {
		return a, true
	}
	a, ok := d.Attributes[resourceapi.QualifiedName(DriverName+"/"+name)]
	return a, ok
}

func capacity(d *resourceapi.Device, name string) (resourceapi.DeviceCapacity, bool) {
	if c, ok := d.Capacity[resourceapi.QualifiedName(name)]; ok {
		return c, true
	}
	c, ok := d.Capacity[resourceapi.QualifiedName(DriverName+"/"+name)]
	return c, ok
}

func capValue(d *resourceapi.Device, name string) int64 {
	c, ok := capacity(d, name)
	if !ok {
		return 0
	}
	return c.Value.Value()
}

// Devices lists the tessera devices of a node's slices.
func Devices(slices []*resourceapi.ResourceSlice) []DeviceInfo {
	var out []DeviceInfo
	for _, s := range slices {
		for i := range s.Spec.Devices {
			d := &s.Spec.Devices[i]
			gpu, ok := gpuOf(d.Name)
			if !ok {
				continue
			}
			info := DeviceInfo{Name: d.Name, GPU: gpu, Device: d, Memory: capValue(d, "memory"), SMs: capValue(d, "multiprocessors")}
			if a, ok := attr(d, "type"); ok && a.StringValue != nil {
				info.Type = *a.StringValue
			}
			if a, ok := attr(d, "profile"); ok && a.StringValue != nil {
				info.Profile = *a.StringValue
			}
			out = append(out, info)
		}
	}
	return out
}

// RefGPU is the GPU a fractional demand is measured against: gpu_milli/1000 of its memory and its SMs.
type RefGPU struct {
	Memory int64
	SMs    int64
}

// MemoryFor is the memory a demand of milli thousandths asks for, rounded up to a byte.
func (r RefGPU) MemoryFor(milli int) int64 { return ceilDiv(r.Memory*int64(milli), 1000) }

// SMsFor is the SMs a demand asks for, rounded up: a pod given 0.47 of a 132-SM GPU needs 63 SMs.
func (r RefGPU) SMsFor(milli int) int64 { return ceilDiv(r.SMs*int64(milli), 1000) }

func ceilDiv(a, b int64) int64 { return (a + b - 1) / b }

// migProfile is one MIG profile size the slices offer. A name can come in several sizes across GPU models
// (A100 and H100 `1g.10gb` differ in SMs); each size is kept, so the bounds derived from them stay exact.
type migProfile struct {
	Name   string
	Memory int64
	SMs    int64
}

// sharedCaps is the consumable capacity of the reference GPU's shared device.
type sharedCaps map[resourceapi.QualifiedName]resourceapi.DeviceCapacity

// ClaimBuilder writes the ResourceClaim a pod of the trace would carry under one policy.
type ClaimBuilder struct {
	Style ClaimStyle
	Ref   RefGPU
	mig   []migProfile
	// shared is nil when no shared device is published.
	shared sharedCaps
	// hasWhole is true when whole GPUs are published as `type == "gpu"` devices. The shared model publishes
	// only the shared device; a whole-GPU pod then asks for shared devices without capacity requests, whose
	// defaults are the whole GPU.
	hasWhole bool
}

// NewClaimBuilder looks at every slice a policy publishes (all node shapes) to learn the MIG profiles and
// the shared capacities it offers; refSlices is the reference GPU's node, whose whole GPU and shared device
// size the demands.
func NewClaimBuilder(style ClaimStyle, ref RefGPU, refSlices []*resourceapi.ResourceSlice, all [][]*resourceapi.ResourceSlice) *ClaimBuilder {
	b := &ClaimBuilder{Style: style, Ref: ref}
	profiles := map[migProfile]bool{}
	for _, slices := range append(all, refSlices) {
		for _, d := range Devices(slices) {
			if d.Type == TypeMIG && d.Profile != "" {
				profiles[migProfile{Name: d.Profile, Memory: d.Memory, SMs: d.SMs}] = true
			}
		}
	}
	for p := range profiles {
		b.mig = append(b.mig, p)
	}
	// Smallest first: SMs, then memory, then name (so `1g.10gb` comes before `1g.10gb+me`).
	sort.Slice(b.mig, func(i, j int) bool {
		x, y := b.mig[i], b.mig[j]
		if x.SMs != y.SMs {
			return x.SMs < y.SMs
		}
		if x.Memory != y.Memory {
			return x.Memory < y.Memory
		}
		return x.Name < y.Name
	})
	for _, d := range Devices(refSlices) {
		if d.Type == TypeGPU {
			b.hasWhole = true
		}
	}
	for _, d := range Devices(refSlices) {
		if d.Type == TypeShared && d.Device.AllowMultipleAllocations != nil && *d.Device.AllowMultipleAllocations {
			b.shared = sharedCaps(d.Device.Capacity)
			break
		}
	}
	return b
}

func sel(expr string) []resourceapi.DeviceSelector {
	return []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{Expression: expr}}}
}

// migSelector matches every MIG instance with at least the demand's memory and SMs. tessera publishes
// each GPU's MIG devices smallest profile first (controller/src/devices.rs), and the allocator takes the
// first free matching device in slice order, so this one selector gets the smallest covering profile that
// is free on the first GPU with room — what a user asking for "a MIG device with 38 GB and 63 SMs" gets.
// (A firstAvailable list with one subrequest per profile picks the same profile; it costs the allocator one
// pass over the node's devices per profile, which made the benchmark several times slower.)
func (b *ClaimBuilder) migSelector(milli int) string {
	return fmt.Sprintf(`device.capacity[%q].memory.compareTo(quantity("%d")) >= 0 && device.capacity[%q].multiprocessors.compareTo(quantity("%d")) >= 0`,
		DriverName, b.Ref.MemoryFor(milli), DriverName, b.Ref.SMsFor(milli))
}

// migCandidates are the profiles covering both the demand's memory and its SMs, smallest first.
func (b *ClaimBuilder) migCandidates(milli int) []migProfile {
	var out []migProfile
	for _, p := range b.mig {
		if p.Memory >= b.Ref.MemoryFor(milli) && p.SMs >= b.Ref.SMsFor(milli) {
			out = append(out, p)
		}
	}
	return out
}

// shareRequests asks for milli/1000 of every consumable capacity of the shared device. Amounts are rounded
// down to the capacity's step: a user asking for "47 % of the GPU" writes a round number, and rounding down
// keeps two shares that add up to exactly one GPU (0.47 + 0.53) placeable on one GPU. `compute` is a
// percent and every trace demand is a multiple of 10 thousandths, so compute is exact.
func (b *ClaimBuilder) shareRequests(milli int) map[resourceapi.QualifiedName]resource.Quantity {
	req := map[resourceapi.QualifiedName]resource.Quantity{}
	for name, c := range b.shared {
		if c.RequestPolicy != nil && c.RequestPolicy.Default != nil && !proportional(name) {
			continue
		}
		total := big.NewInt(c.Value.Value())
		v := new(big.Int).Div(new(big.Int).Mul(total, big.NewInt(int64(milli))), big.NewInt(1000)).Int64()
		if c.RequestPolicy != nil && c.RequestPolicy.ValidRange != nil {
			r := c.RequestPolicy.ValidRange
			if r.Step != nil && r.Step.Value() > 0 {
				min := int64(0)
				if r.Min != nil {
					min = r.Min.Value()
				}
				step := r.Step.Value()
				if v > min {
					v = min + (v-min)/step*step
				}
			}
			if r.Min != nil && v < r.Min.Value() {
				v = r.Min.Value()
			}
		}
		req[name] = *resource.NewQuantity(v, resource.DecimalSI)
	}
	return req
}

// proportional names the capacities a share must always ask for explicitly, even when the device has a
// default: the pod's share of memory and compute is the point of the policy.
func proportional(name resourceapi.QualifiedName) bool {
	switch string(name) {
	case "memory", "compute", DriverName + "/memory", DriverName + "/compute":
		return true
	}
	return false
}

// Key identifies pods whose claims ask for the same thing, for the simulator's "does not fit" cache.
func (b *ClaimBuilder) Key(pod TracePod) string {
	if !pod.Fractional() || b.Style == StyleWhole {
		return fmt.Sprintf("whole-%d", pod.NumGPU)
	}
	if b.Style == StyleMIG || (b.Style == StyleAuto && b.shared == nil) {
		// The selector matches exactly the instances of the covering profile sizes (and the fallback whole
		// GPU), so demands with the same covering sizes fit or fail alike.
		key := "mig"
		for _, p := range b.migCandidates(pod.GPUMilli) {
			key += fmt.Sprintf("-%s/%d/%d", p.Name, p.Memory, p.SMs)
		}
		return key
	}
	return fmt.Sprintf("milli-%d", pod.GPUMilli)
}

// WholeGPUs is the number of whole GPUs the claim asks for (0 for a fractional claim).
func (b *ClaimBuilder) WholeGPUs(pod TracePod) int {
	if !pod.Fractional() || b.Style == StyleWhole {
		return pod.NumGPU
	}
	if (b.Style == StyleMIG || b.Style == StyleAuto) && len(b.migCandidates(pod.GPUMilli)) == 0 && (b.Style == StyleMIG || b.shared == nil) {
		return 1
	}
	return 0
}

// MinMemory is a lower bound on the memory a fractional claim takes from a GPU: its smallest MIG candidate
// when only MIG instances can serve it, else 0 (a share takes exactly its fraction).
func (b *ClaimBuilder) MinMemory(pod TracePod) int64 {
	if b.WholeGPUs(pod) > 0 || b.Style == StyleShares || (b.Style == StyleAuto && b.shared != nil) {
		return 0
	}
	// A whole GPU (the fallback) is more than any MIG instance, so the smallest instance stays a bound.
	var m int64
	for i, p := range b.migCandidates(pod.GPUMilli) {
		if i == 0 || p.Memory < m {
			m = p.Memory
		}
	}
	return m
}

// Claim is the ResourceClaim the pod carries under this policy.
func (b *ClaimBuilder) Claim(pod TracePod) (*resourceapi.ResourceClaim, error) {
	claim := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "openb", Name: pod.Name, UID: types.UID("claim-" + pod.Name)},
	}
	whole := func(n int) resourceapi.DeviceRequest {
		class := ClassGPU
		if !b.hasWhole && b.shared != nil {
			class = ClassShared
		}
		return resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
			DeviceClassName: class,
			AllocationMode:  resourceapi.DeviceAllocationModeExactCount, Count: int64(n),
		}}
	}
	if !pod.Fractional() || b.Style == StyleWhole {
		claim.Spec.Devices.Requests = []resourceapi.DeviceRequest{whole(pod.NumGPU)}
		return claim, nil
	}
	share := func() resourceapi.DeviceSubRequest {
		return resourceapi.DeviceSubRequest{
			Name: "share", DeviceClassName: ClassShared,
			AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
			Capacity: &resourceapi.CapacityRequirements{Requests: b.shareRequests(pod.GPUMilli)},
		}
	}
	switch b.Style {
	case StyleShares:
		if b.shared == nil {
			return nil, fmt.Errorf("failed to write a shares claim for %s: the policy publishes no shared device", pod.Name)
		}
		s := share()
		claim.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
			DeviceClassName: s.DeviceClassName, Selectors: s.Selectors, AllocationMode: s.AllocationMode, Count: 1, Capacity: s.Capacity,
		}}}
		return claim, nil
	case StyleMIG, StyleAuto:
		// Smallest isolation first: a covering MIG instance, then (auto, when offered) a share, then a whole
		// GPU. The whole GPU only matters on nodes without dynamic MIG (an A100 under the built-in default):
		// where a GPU is free, a covering MIG instance on it is free too.
		var subs []resourceapi.DeviceSubRequest
		if len(b.migCandidates(pod.GPUMilli)) > 0 {
			subs = append(subs, resourceapi.DeviceSubRequest{
				Name: "mig", DeviceClassName: ClassMIG, Selectors: sel(b.migSelector(pod.GPUMilli)),
				AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: 1,
			})
		}
		if b.Style == StyleAuto && b.shared != nil {
			subs = append(subs, share())
		}
		w := whole(1).Exactly
		if w.DeviceClassName == ClassGPU {
			subs = append(subs, resourceapi.DeviceSubRequest{
				Name: "gpu", DeviceClassName: w.DeviceClassName, AllocationMode: w.AllocationMode, Count: 1,
			})
		}
		if len(subs) == 1 {
			s := subs[0]
			claim.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: s.DeviceClassName, Selectors: s.Selectors, AllocationMode: s.AllocationMode, Count: 1, Capacity: s.Capacity,
			}}}
			return claim, nil
		}
		claim.Spec.Devices.Requests = []resourceapi.DeviceRequest{{Name: "gpu", FirstAvailable: subs}}
		return claim, nil
	}
	return nil, fmt.Errorf("failed to write a claim for %s: unknown claim style %q", pod.Name, b.Style)
}
