package main

import (
	"fmt"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/utils/ptr"
)

// Hand-made slices in the format `tessera-controller render` prints (controller/src/devices.rs, pool.rs) for
// an H100-SXM5-80GB: device names gpu-<i>, gpu-<i>-mig-<profile>-<start>, gpu-<i>-shared; dynamic MIG with
// one counter set per GPU (memory, multiprocessors and one counter per memory slice; the engine counters
// are left out, the profiles here never exhaust them) in its own slice, MIG devices smallest profile first
// and highest placement first, the whole GPU last; the shared model as one multi-allocatable device per
// GPU with memory (1 GiB steps, default all of it) and compute (percent, default none). The benchmark itself
// only ever uses the real render output.

type fixtureProfile struct {
	name         string
	memorySlices int
	sms          int64
	memoryMiB    int64
	starts       []int
}

// In the controller's order: memory slices, compute slices, memory.
var h100Profiles = []fixtureProfile{
	{"1g.10gb", 1, 16, 9984, []int{6, 5, 4, 3, 2, 1, 0}},
	{"1g.20gb", 2, 26, 20096, []int{6, 4, 2, 0}},
	{"2g.20gb", 2, 32, 20096, []int{4, 2, 0}},
	{"3g.40gb", 4, 60, 40448, []int{4, 0}},
	{"4g.40gb", 4, 64, 40448, []int{0}},
	{"7g.80gb", 8, 132, 81152, []int{0}},
}

const (
	h100MemoryBytes = 85520809984
	h100SMs         = 132
	mib             = 1024 * 1024
	gib             = 1024 * mib
)

type fixtureMode string

const (
	fixtureWhole  fixtureMode = "whole"
	fixtureMIG    fixtureMode = "mig"
	fixtureShared fixtureMode = "shared"
)

// fixtureBuilder builds one node's slices.
type fixtureBuilder struct {
	node string
	gpus int
	mode fixtureMode
}

func fixtureNode(node string, gpus int, mode fixtureMode) fixtureBuilder {
	return fixtureBuilder{node: node, gpus: gpus, mode: mode}
}

func str(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: &s} }

func qty(v int64) resourceapi.DeviceCapacity {
	return resourceapi.DeviceCapacity{Value: *resource.NewQuantity(v, resource.BinarySI)}
}

func counter(v int64) resourceapi.Counter {
	return resourceapi.Counter{Value: *resource.NewQuantity(v, resource.BinarySI)}
}

func migCounters(start, slices int, memory, sms int64) map[string]resourceapi.Counter {
	c := map[string]resourceapi.Counter{"memory": counter(memory), "multiprocessors": counter(sms)}
	for i := start; i < start+slices; i++ {
		c[fmt.Sprintf("memory-slice-%d", i)] = counter(1)
	}
	return c
}

func rangePolicy(def, min, max, step int64) *resourceapi.CapacityRequestPolicy {
	q := func(v int64) *resource.Quantity { return resource.NewQuantity(v, resource.BinarySI) }
	return &resourceapi.CapacityRequestPolicy{
		Default:    q(def),
		ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: q(min), Max: q(max), Step: q(step)},
	}
}

func (b fixtureBuilder) build() []*resourceapi.ResourceSlice {
	var groups [][]resourceapi.Device
	var loose []resourceapi.Device
	var counters []resourceapi.CounterSet
	for g := 0; g < b.gpus; g++ {
		set := fmt.Sprintf("gpu-%d-counters", g)
		attrs := func(t string) map[resourceapi.QualifiedName]resourceapi.DeviceAttribute {
			return map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"type": str(t), "productName": str("NVIDIA H100 80GB HBM3"), "index": {IntValue: ptr.To(int64(g))},
			}
		}
		whole := resourceapi.Device{
			Name:       fmt.Sprintf("gpu-%d", g),
			Attributes: attrs(TypeGPU),
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
				"memory": qty(h100MemoryBytes), "multiprocessors": qty(h100SMs),
			},
		}
		switch b.mode {
		case fixtureWhole:
			loose = append(loose, whole)
		case fixtureMIG:
			all := migCounters(0, 8, h100MemoryBytes, h100SMs)
			counters = append(counters, resourceapi.CounterSet{Name: set, Counters: all})
			var devices []resourceapi.Device
			for _, p := range h100Profiles {
				for _, s := range p.starts {
					a := attrs(TypeMIG)
					a["profile"] = str(p.name)
					a["placementStart"] = resourceapi.DeviceAttribute{IntValue: ptr.To(int64(s))}
					devices = append(devices, resourceapi.Device{
						Name:       fmt.Sprintf("gpu-%d-mig-%s-%d", g, encodeProfile(p.name), s),
						Attributes: a,
						Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
							"memory": qty(p.memoryMiB * mib), "multiprocessors": qty(p.sms),
						},
						ConsumesCounters: []resourceapi.DeviceCounterConsumption{{CounterSet: set, Counters: migCounters(s, p.memorySlices, p.memoryMiB*mib, p.sms)}},
					})
				}
			}
			whole.ConsumesCounters = []resourceapi.DeviceCounterConsumption{{CounterSet: set, Counters: all}}
			groups = append(groups, append(devices, whole))
		case fixtureShared:
			a := attrs(TypeShared)
			a["sharingStrategy"] = str("MPS")
			memory := qty(h100MemoryBytes)
			memMax := int64(h100MemoryBytes) / gib * gib
			memory.RequestPolicy = rangePolicy(memMax, gib, memMax, gib)
			compute := qty(100)
			compute.RequestPolicy = rangePolicy(0, 0, 100, 1)
			loose = append(loose, resourceapi.Device{
				Name:                     fmt.Sprintf("gpu-%d-shared", g),
				Attributes:               a,
				AllowMultipleAllocations: ptr.To(true),
				Capacity:                 map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"memory": memory, "compute": compute},
			})
		}
	}
	if len(loose) > 0 {
		groups = append(groups, loose)
	}
	var slices []*resourceapi.ResourceSlice
	mk := func() *resourceapi.ResourceSlice {
		s := &resourceapi.ResourceSlice{}
		s.Name = fmt.Sprintf("%s-%d", b.node, len(slices))
		s.Spec.Driver = DriverName
		s.Spec.Pool = resourceapi.ResourcePool{Name: b.node, Generation: 1}
		s.Spec.NodeName = ptr.To(b.node)
		return s
	}
	for len(counters) > 0 {
		n := min(len(counters), 8)
		s := mk()
		s.Spec.SharedCounters = counters[:n]
		counters = counters[n:]
		slices = append(slices, s)
	}
	for _, devices := range groups {
		for len(devices) > 0 {
			n := min(len(devices), 64)
			s := mk()
			s.Spec.Devices = devices[:n]
			devices = devices[n:]
			slices = append(slices, s)
		}
	}
	for _, s := range slices {
		s.Spec.Pool.ResourceSliceCount = int64(len(slices))
	}
	return slices
}

func encodeProfile(p string) string {
	out := []byte{}
	for i := 0; i < len(p); i++ {
		switch p[i] {
		case '.':
			out = append(out, '-')
		case '+':
			out = append(out, "-plus-"...)
		default:
			out = append(out, p[i])
		}
	}
	return string(out)
}

// fixtureSource serves hand-made slices per policy, as Renderer serves rendered ones.
type fixtureSource struct{}

func (fixtureSource) Slices(policy PolicySpec, gpus []string) ([]*resourceapi.ResourceSlice, error) {
	mode := map[ClaimStyle]fixtureMode{StyleWhole: fixtureWhole, StyleMIG: fixtureMIG, StyleShares: fixtureShared, StyleAuto: fixtureMIG}[policy.Style]
	return fixtureNode("template", len(gpus), mode).build(), nil
}
