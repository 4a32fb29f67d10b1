package main

import (
	"fmt"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// Sample is a stratified 1-in-every subset of the trace, small enough to replay through the real
// kube-scheduler: nodes are grouped by GPU count and pods by what they ask for (num_gpu, and for a
// fractional pod its tenth of a GPU), and the first of every `every` members of each group (in trace order)
// is kept. Each group keeps its share of the whole, the small groups included (1-GPU nodes, 4-GPU pods:
// a group with any member keeps at least one), and pods stay in creation order.
func Sample(tr *Trace, every int) (*Trace, error) {
	if every < 1 {
		return nil, fmt.Errorf("failed to sample the trace: -sample-every %d must be at least 1", every)
	}
	out := &Trace{CPUOnlyPods: tr.CPUOnlyPods, FileOrder: tr.FileOrder}
	seen := map[int]int{}
	for _, n := range tr.Nodes {
		if seen[n.GPUs]%every == 0 {
			out.Nodes = append(out.Nodes, n)
		}
		seen[n.GPUs]++
	}
	seenPods := map[string]int{}
	for _, p := range tr.Pods {
		k := podStratum(p)
		if seenPods[k]%every == 0 {
			out.Pods = append(out.Pods, p)
		}
		seenPods[k]++
	}
	return out, nil
}

// podStratum is the group a pod is sampled within: whole-GPU pods by GPU count, fractional pods by tenth.
func podStratum(p TracePod) string {
	if p.Fractional() {
		return fmt.Sprintf("milli-%d", p.GPUMilli/100)
	}
	return fmt.Sprintf("gpus-%d", p.NumGPU)
}

// Strata summarizes a trace by stratum (for the report: the sample must look like the whole).
func Strata(tr *Trace) (nodes map[int]int, pods map[string]int) {
	nodes, pods = map[int]int{}, map[string]int{}
	for _, n := range tr.Nodes {
		nodes[n.GPUs]++
	}
	for _, p := range tr.Pods {
		pods[podStratum(p)]++
	}
	return nodes, pods
}

// RenameNodes prefixes every node name, so the policies of one scheduler run live side by side in one
// cluster without sharing nodes.
func RenameNodes(tr *Trace, prefix string) *Trace {
	out := *tr
	out.Nodes = make([]TraceNode, len(tr.Nodes))
	for i, n := range tr.Nodes {
		n.Name = prefix + n.Name
		out.Nodes[i] = n
	}
	return &out
}

func sortedKeys[K int | string, V any](m map[K]V) []K {
	out := make([]K, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// SampleReport is scheduler-sample.md: the sample, and per policy what kube-scheduler did next to what the
// allocator says.
type SampleReport struct {
	Every int
	// Source is the folder the trace was read from.
	Source        string
	Trace, Sample *Trace
	Cfg           Config
	ServerVersion string
	Results       []SchedulerResult
}

func (r SampleReport) Markdown() string {
	var b strings.Builder
	fmt.Fprintf(&b, "# kube-scheduler sample: 1 in %d of the trace in %s through kube-scheduler (%s), checked against the structured allocator\n\n",
		r.Every, filepath.Base(r.Source), r.ServerVersion)
	fmt.Fprintf(&b, "GPUs re-imaged as %s. Sample by stratum (sampled / whole):\n\n", strings.Join(r.Cfg.Models, " / "))
	tn, tp := Strata(r.Trace)
	sn, sp := Strata(r.Sample)
	b.WriteString("| nodes with | sampled | of |\n|---|---|---|\n")
	for _, k := range sortedKeys(tn) {
		fmt.Fprintf(&b, "| %s | %d | %d |\n", plural(k, "GPU"), sn[k], tn[k])
	}
	fmt.Fprintf(&b, "| **all** | **%d nodes, %d GPUs** | %d nodes, %d GPUs |\n\n", len(r.Sample.Nodes), r.Sample.TotalGPUs(), len(r.Trace.Nodes), r.Trace.TotalGPUs())
	b.WriteString("| pods asking for | sampled | of |\n|---|---|---|\n")
	for _, k := range sortedKeys(tp) {
		fmt.Fprintf(&b, "| %s | %d | %d |\n", stratumLabel(k), sp[k], tp[k])
	}
	fmt.Fprintf(&b, "| **all** | **%d** | %d |\n\n", len(r.Sample.Pods), len(r.Trace.Pods))
	fmt.Fprintf(&b, "Pods arrive one at a time in %s (repeated up to %.0f %% arrived demand); each waits for the scheduler's verdict. "+
		"A decision agrees when the allocator, given the allocations the scheduler made before it, decides the same: a bound pod's claim fits "+
		"the node the scheduler chose, and with the same devices; an unschedulable pod's claim fits no node.\n\n", r.Trace.Order(), 100*r.Cfg.MaxDemand)
	b.WriteString("| policy | nodes / GPUs | pods | kube-scheduler: placed / failed | allocation ratio | allocator, best-fit loop: placed / failed | allocation ratio | decisions agreed | same devices | time |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, res := range r.Results {
		s, f := res.Scheduler, res.BestFit
		elapsed := fmt.Sprintf("%.0f s (%.1f pods/s)", res.Elapsed.Seconds(), float64(s.Arrived)/res.Elapsed.Seconds())
		if res.SameAs != "" {
			elapsed = "same slices and claims as " + res.SameAs
		}
		fmt.Fprintf(&b, "| %s | %d / %d | %d | %d / %d | **%.1f %%** | %d / %d | %.1f %% | %d of %d | %d of %d | %s |\n",
			res.Policy, res.Nodes, res.TotalGPUs, s.Arrived, s.Placed, s.Failed, s.AllocPct(res.TotalGPUs), f.Placed, f.Failed,
			f.AllocPct(res.TotalGPUs), res.Agreed, res.Decisions, res.SameDevices, res.Bound, elapsed)
	}
	for _, res := range r.Results {
		if res.UnschedulableMessage != "" && res.SameAs == "" {
			fmt.Fprintf(&b, "\n%s, the scheduler's verdict on its first unplaceable pod: `%s`\n", res.Policy, res.UnschedulableMessage)
		}
		for _, d := range res.Disagreements {
			fmt.Fprintf(&b, "\n- **disagreement** (%s): %s", res.Policy, d)
		}
	}
	b.WriteString("\n")
	return b.String()
}

func stratumLabel(k string) string {
	if rest, ok := strings.CutPrefix(k, "milli-"); ok {
		t, _ := strconv.Atoi(rest)
		return fmt.Sprintf("gpu_milli %d–%d", 100*t, 100*t+99)
	}
	n, _ := strconv.Atoi(strings.TrimPrefix(k, "gpus-"))
	return plural(n, "whole GPU")
}

func plural(n int, what string) string {
	if n == 1 {
		return fmt.Sprintf("1 %s", what)
	}
	return fmt.Sprintf("%d %ss", n, what)
}
