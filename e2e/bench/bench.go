package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"time"

	resourceapi "k8s.io/api/resource/v1"
)

// Config is what one benchmark run compares.
type Config struct {
	// Models re-image the trace's GPUs: one model for all, or several assigned to nodes round-robin in trace
	// order (a mixed cluster). Models[0] is the reference GPU fractional demands are measured against.
	Models []string
	// MaxDemand is how far arrived demand grows, as a fraction of the cluster's GPUs.
	MaxDemand float64
	// Checkpoints are the arrived-demand percentages reported in the table.
	Checkpoints []int
	// SkipGPUsNeeded leaves out the elastic run.
	SkipGPUsNeeded bool
	// Classes are the DeviceClasses claims refer to (tessera's deployments/classes).
	Classes []*resourceapi.DeviceClass
}

// nodeModels lists the GPU models of trace node i.
func (c Config) nodeModels(i, gpus int) []string {
	m := c.Models[i%len(c.Models)]
	out := make([]string, gpus)
	for g := range out {
		out[g] = m
	}
	return out
}

// Cluster is the trace's nodes as one policy publishes them.
type Cluster struct {
	Nodes   []NodeSlices
	Claims  *ClaimBuilder
	Classes []*resourceapi.DeviceClass
	// Fingerprint digests the rendered slices and every claim of the trace: two policies with the same
	// fingerprint replay identically (the built-in default is dynamic MIG on an H100, like the mig policy).
	Fingerprint string
	// Grow makes extra nodes (8 reference GPUs each) for the elastic run.
	Grow func(i int) (NodeSlices, error)
}

// BuildCluster renders each distinct node shape once and copies it onto every node of that shape.
func BuildCluster(src SliceSource, policy PolicySpec, tr *Trace, cfg Config) (*Cluster, error) {
	nodes := tr.Nodes
	c := &Cluster{Classes: cfg.Classes}
	digest := sha256.New()
	var all [][]*resourceapi.ResourceSlice
	shapes := map[string]bool{}
	for i, n := range nodes {
		models := cfg.nodeModels(i, n.GPUs)
		tmpl, err := src.Slices(policy, models)
		if err != nil {
			return nil, err
		}
		if k := shapeKey(models); !shapes[k] {
			shapes[k] = true
			all = append(all, tmpl)
			if err := json.NewEncoder(digest).Encode(tmpl); err != nil {
				return nil, fmt.Errorf("failed to digest the slices of %s: %w", k, err)
			}
		}
		c.Nodes = append(c.Nodes, ForNode(tmpl, n.Name))
	}
	refSlices, err := src.Slices(policy, cfg.Models[:1])
	if err != nil {
		return nil, err
	}
	ref, err := refGPU(refSlices)
	if err != nil {
		return nil, fmt.Errorf("failed to size fractional demands under policy %s: %w", policy.Name, err)
	}
	c.Claims = NewClaimBuilder(policy.Style, ref, refSlices, all)
	seen := map[[2]int]bool{}
	for _, p := range tr.Pods {
		k := [2]int{p.NumGPU, p.GPUMilli}
		if seen[k] {
			continue
		}
		seen[k] = true
		claim, err := c.Claims.Claim(TracePod{Name: "fingerprint", NumGPU: p.NumGPU, GPUMilli: p.GPUMilli})
		if err != nil {
			return nil, err
		}
		if err := json.NewEncoder(digest).Encode(claim.Spec); err != nil {
			return nil, fmt.Errorf("failed to digest a claim: %w", err)
		}
	}
	c.Fingerprint = hex.EncodeToString(digest.Sum(nil))
	grow := make([]string, 8)
	for g := range grow {
		grow[g] = cfg.Models[0]
	}
	// Rendered here, not in Grow, so replays can run concurrently without touching the renderer.
	growTmpl, err := src.Slices(policy, grow)
	if err != nil {
		return nil, err
	}
	c.Grow = func(i int) (NodeSlices, error) {
		return ForNode(growTmpl, fmt.Sprintf("extra-%04d", i)), nil
	}
	return c, nil
}

// refGPU reads the reference GPU's memory and SMs from its largest published devices (the whole GPU, or a
// shared device, which carries the whole GPU's memory but no SM count: only MIG claims need SMs).
func refGPU(slices []*resourceapi.ResourceSlice) (RefGPU, error) {
	var r RefGPU
	for _, d := range Devices(slices) {
		if d.GPU == 0 && d.Memory > r.Memory {
			r.Memory = d.Memory
		}
		if d.GPU == 0 && d.SMs > r.SMs {
			r.SMs = d.SMs
		}
	}
	if r.Memory == 0 {
		return r, fmt.Errorf("failed to find GPU 0's memory capacity in the rendered slices")
	}
	return r, nil
}

// RunPolicy replays the trace under one policy, then (unless skipped) measures the GPUs it needs.
func RunPolicy(ctx context.Context, c *Cluster, policy PolicySpec, tr *Trace, cfg Config) (RunResult, error) {
	start := time.Now()
	sim := NewSim(policy, c)
	pods := ReplaySequence(tr.Pods, sim.TotalGPUs(), cfg.MaxDemand)
	res, err := Replay(ctx, sim, pods, cfg.Checkpoints)
	if err != nil {
		return res, fmt.Errorf("failed to replay the trace under policy %s: %w", policy.Name, err)
	}
	if b := c.Claims; b.Style == StyleMIG || (b.Style == StyleAuto && b.shared == nil) {
		if bound, ok := MIGSliceBound(b, pods, sim.TotalGPUs()); ok {
			res.Bound = &bound
		}
	}
	if !cfg.SkipGPUsNeeded {
		elastic := NewSim(policy, c)
		elastic.Grow = c.Grow
		needed, unplaceable, calls, err := GPUsNeeded(ctx, elastic, tr.Pods)
		if err != nil {
			return res, fmt.Errorf("failed to count the GPUs policy %s needs: %w", policy.Name, err)
		}
		res.GPUsNeeded, res.Unplaceable = needed, unplaceable
		res.AllocateCalls += calls
	}
	res.Elapsed = time.Since(start)
	return res, nil
}
