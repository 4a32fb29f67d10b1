// Command bench-packing replays the openb production GPU trace (Alibaba, FGD ATC'23) through Kubernetes'
// structured allocator against the ResourceSlices tessera publishes under each policy, and reports how much
// of the cluster's GPUs each policy can hand out. See README.md.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"
)

// gpuChoices are the -gpu shortcuts; the names are the simulated backend's model names.
var gpuChoices = map[string][]string{
	"h100": {"H100-SXM5-80GB"},
	"a100": {"A100-SXM4-80GB"},
	"h200": {"H200-SXM-141GB"},
	"mix":  {"H100-SXM5-80GB", "A100-SXM4-80GB", "H200-SXM-141GB"},
}

type args struct {
	openbDir      string
	controllerBin string
	pluginBin     string
	policyDir     string
	classesDir    string
	out           string
	gpu           string
	maxDemand     float64
	policies      string
	skipNeeded    bool
	kubeconfig    string
	sampleEvery   int
	skipFull      bool
	rate          rateArgs
	rateReport    string
	rateMarkdown  string
}

// env gives each flag an environment fallback.
func env(name, def string) string {
	if v, ok := os.LookupEnv(name); ok {
		return v
	}
	return def
}

func parseArgs() (args, error) {
	var a args
	flag.StringVar(&a.openbDir, "openb-dir", env("BENCH_OPENB_DIR", "../../../shared/data/openb"), "folder with openb_pod_list_default.csv and openb_node_list_gpu_node.csv (env BENCH_OPENB_DIR)")
	flag.StringVar(&a.controllerBin, "controller", env("BENCH_CONTROLLER", "../../target/debug/tessera-controller"), "tessera-controller binary (env BENCH_CONTROLLER)")
	flag.StringVar(&a.pluginBin, "plugin", env("BENCH_PLUGIN", "../../target/debug/tessera-kubelet-plugin"), "tessera-kubelet-plugin binary (env BENCH_PLUGIN)")
	flag.StringVar(&a.policyDir, "policy-dir", env("BENCH_POLICY_DIR", "policies"), "folder with the GpuPolicy YAMLs whole.yaml, mig.yaml, shares.yaml (env BENCH_POLICY_DIR)")
	flag.StringVar(&a.classesDir, "classes-dir", env("BENCH_CLASSES_DIR", "../../deployments/classes"), "tessera's DeviceClass YAMLs the claims name (env BENCH_CLASSES_DIR)")
	flag.StringVar(&a.out, "out", env("BENCH_OUT", "../../bench-results"), "results folder (env BENCH_OUT)")
	flag.StringVar(&a.gpu, "gpu", env("BENCH_GPU", "h100"), "GPU every trace GPU is re-imaged as: h100, a100, h200 or mix (nodes round-robin) (env BENCH_GPU)")
	demand := env("BENCH_MAX_DEMAND", "1.0")
	flag.StringVar(&a.policies, "policies", env("BENCH_POLICIES", "whole,mig,shares,default"), "policies to compare (env BENCH_POLICIES)")
	flag.BoolVar(&a.skipNeeded, "skip-gpus-needed", env("BENCH_SKIP_GPUS_NEEDED", "") == "true", "skip the elastic run that counts the GPUs every pod needs (env BENCH_SKIP_GPUS_NEEDED)")
	flag.StringVar(&a.kubeconfig, "kubeconfig", env("BENCH_KUBECONFIG", ""), "a running cluster (kube-apiserver + kube-scheduler, nothing else on it): replay a stratified sample of the trace through its scheduler and check every decision against the allocator (env BENCH_KUBECONFIG)")
	every := env("BENCH_SAMPLE_EVERY", "10")
	flag.Func("sample-every", "the scheduler sample keeps 1 in N nodes and pods of each stratum (default 10) (env BENCH_SAMPLE_EVERY)", func(s string) error {
		every = s
		return nil
	})
	flag.BoolVar(&a.skipFull, "skip-full", env("BENCH_SKIP_FULL", "") == "true", "skip the full-trace replay (only the scheduler sample) (env BENCH_SKIP_FULL)")
	flag.Func("max-demand", "arrived demand to replay up to, as a fraction of the cluster's GPUs (default 1.0) (env BENCH_MAX_DEMAND)", func(s string) error {
		demand = s
		return nil
	})
	rateNodes := env("BENCH_RATE_NODES", "")
	flag.StringVar(&rateNodes, "rate-nodes", rateNodes, "scheduler rate mode: cluster sizes to measure kube-scheduler's pods/s on, e.g. 100,1000 (needs -kubeconfig; env BENCH_RATE_NODES)")
	flag.IntVar(&a.rate.podsPerNode, "rate-pods-per-node", 2, "scheduler rate mode: pods per node in every cell")
	flag.IntVar(&a.rate.milli, "rate-milli", 100, "scheduler rate mode: the slice of one GPU a MIG or shares pod asks for, in thousandths (whole-GPU pods take one GPU)")
	flag.IntVar(&a.rate.burst, "rate-burst", 100, "scheduler rate mode: pods created concurrently per burst")
	flag.DurationVar(&a.rate.timeBox, "rate-time-box", 120*time.Second, "scheduler rate mode: a cell stops this long after its first pod and reports what was bound by then")
	flag.IntVar(&a.rate.migMaxNodes, "rate-mig-max-nodes", 0, "scheduler rate mode: skip dynamic-MIG cells with more nodes than this (0: measure every size)")
	flag.StringVar(&a.rate.schedulerPIDFile, "rate-scheduler-pid-file", "", "scheduler rate mode: file with kube-scheduler's pid (same machine), to report its CPU time per pod")
	flag.StringVar(&a.rate.serverNote, "rate-server-note", "", "scheduler rate mode: words after the server version in the table's column names, e.g. the feature gates the run had")
	flag.StringVar(&a.rate.jsonOut, "rate-json", "", "scheduler rate mode: write the cells to this JSON file")
	flag.StringVar(&a.rateReport, "rate-report", "", "comma-separated -rate-json files (one per Kubernetes version): print them as one table, versions side by side")
	flag.StringVar(&a.rateMarkdown, "rate-markdown", "", "with -rate-report: also write the table to this file")
	flag.Parse()
	for _, f := range strings.Split(rateNodes, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return a, fmt.Errorf("failed to read -rate-nodes %q: want node counts such as 100,1000", rateNodes)
		}
		a.rate.nodes = append(a.rate.nodes, n)
	}
	if len(a.rate.nodes) > 0 && a.kubeconfig == "" {
		return a, fmt.Errorf("-rate-nodes measures a running kube-scheduler: give its cluster with -kubeconfig")
	}
	if a.rate.podsPerNode < 1 || a.rate.burst < 1 || a.rate.timeBox <= 0 || a.rate.milli < 1 || a.rate.milli >= 1000 {
		return a, fmt.Errorf("-rate-pods-per-node and -rate-burst must be at least 1, -rate-time-box positive, -rate-milli in 1..999")
	}
	v, err := strconv.ParseFloat(demand, 64)
	if err != nil || v <= 0 {
		return a, fmt.Errorf("failed to read -max-demand %q: want a positive fraction such as 1.0", demand)
	}
	a.maxDemand = v
	n, err := strconv.Atoi(every)
	if err != nil || n < 1 {
		return a, fmt.Errorf("failed to read -sample-every %q: want a whole number of at least 1, such as 10", every)
	}
	a.sampleEvery = n
	if a.skipFull && a.kubeconfig == "" {
		return a, fmt.Errorf("-skip-full leaves nothing to do without -kubeconfig (the scheduler sample)")
	}
	return a, nil
}

func main() {
	// The allocator allocates heavily per call; trading memory for fewer collections saves a third of the
	// run on 2 cores.
	debug.SetGCPercent(400)
	a, err := parseArgs()
	if err == nil {
		err = run(a)
	}
	if err != nil {
		slog.Error("bench-packing failed", "error", err)
		os.Exit(1)
	}
}

func run(a args) error {
	start := time.Now()
	if a.rateReport != "" {
		cells, err := ReadRateCells(strings.Split(a.rateReport, ","))
		if err != nil {
			return err
		}
		table := RateTable(cells)
		fmt.Print(table)
		if a.rateMarkdown != "" {
			return os.WriteFile(a.rateMarkdown, []byte(table), 0o644)
		}
		return nil
	}
	models, ok := gpuChoices[a.gpu]
	if !ok {
		return fmt.Errorf("failed to read -gpu %q: want h100, a100, h200 or mix", a.gpu)
	}
	// The rate mode makes its own uniform cluster and pods; everything else replays the trace.
	var tr *Trace
	if len(a.rate.nodes) == 0 {
		var err error
		tr, err = LoadTrace(filepath.Join(a.openbDir, "openb_pod_list_default.csv"), filepath.Join(a.openbDir, "openb_node_list_gpu_node.csv"))
		if err != nil {
			return err
		}
		slog.Info("trace loaded", "gpuPods", len(tr.Pods), "cpuOnlyPodsExcluded", tr.CPUOnlyPods, "nodes", len(tr.Nodes), "gpus", tr.TotalGPUs())
	}

	var policies []PolicySpec
	for _, name := range strings.Split(a.policies, ",") {
		p, err := policyByName(strings.TrimSpace(name), a.policyDir)
		if err != nil {
			return err
		}
		policies = append(policies, p)
	}
	checkpoints := []int{10, 20, 30, 40, 50, 60, 70, 80, 90, 95, 100}
	classes, err := LoadClasses(a.classesDir)
	if err != nil {
		return err
	}
	cfg := Config{Models: models, MaxDemand: a.maxDemand, Checkpoints: checkpoints, SkipGPUsNeeded: a.skipNeeded, Classes: classes}
	for _, c := range checkpoints {
		if float64(c) > 100*a.maxDemand {
			cfg.Checkpoints = nil
			for _, c := range checkpoints {
				if float64(c) <= 100*a.maxDemand {
					cfg.Checkpoints = append(cfg.Checkpoints, c)
				}
			}
			break
		}
	}

	renderDir := filepath.Join(a.out, "render")
	r := &Renderer{PluginBin: a.pluginBin, ControllerBin: a.controllerBin, WorkDir: renderDir}
	if len(a.rate.nodes) > 0 {
		if err := runRate(context.Background(), a, a.rate, r, policies, cfg); err != nil {
			return err
		}
		fmt.Printf("\ndone in %.1f s\n", time.Since(start).Seconds())
		return nil
	}
	if !a.skipFull {
		if err := runFull(r, tr, policies, cfg, a.out); err != nil {
			return err
		}
	}
	if a.kubeconfig != "" {
		if err := runSchedulerSample(context.Background(), a, r, tr, policies, cfg); err != nil {
			return err
		}
	}
	fmt.Printf("\ndone in %.1f s\n", time.Since(start).Seconds())
	return nil
}

// runFull replays the whole trace under every policy and writes the report.
func runFull(r *Renderer, tr *Trace, policies []PolicySpec, cfg Config, out string) error {
	start := time.Now()
	clusters := make([]*Cluster, len(policies))
	for i, p := range policies {
		c, err := BuildCluster(r, p, tr, cfg)
		if err != nil {
			return fmt.Errorf("failed to build the cluster for policy %s: %w", p.Name, err)
		}
		clusters[i] = c
		slog.Info("slices rendered", "policy", p.Name, "nodes", len(c.Nodes), "renderDir", r.WorkDir)
	}

	// Policies are independent: replay them side by side, one per core. A policy whose slices and claims
	// are identical to an earlier one's (same fingerprint) would replay identically: its result is copied.
	results := make([]RunResult, len(policies))
	errs := make([]error, len(policies))
	sameAs := make([]int, len(policies))
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for i := range policies {
		sameAs[i] = -1
		for j := range i {
			if sameAs[j] < 0 && clusters[j].Fingerprint == clusters[i].Fingerprint {
				sameAs[i] = j
				break
			}
		}
		if sameAs[i] >= 0 {
			slog.Info("same slices and claims as another policy: its replay is reused", "policy", policies[i].Name, "sameAs", policies[sameAs[i]].Name)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			results[i], errs[i] = RunPolicy(context.Background(), clusters[i], policies[i], tr, cfg)
			if errs[i] == nil {
				res := results[i]
				slog.Info("policy done", "policy", res.Policy, "allocationRatioPct", fmt.Sprintf("%.2f", res.Final.AllocPct(res.TotalGPUs)),
					"placed", res.Final.Placed, "failed", res.Final.Failed, "gpusNeeded", res.GPUsNeeded, "allocateCalls", res.AllocateCalls,
					"seconds", fmt.Sprintf("%.1f", res.Elapsed.Seconds()))
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	for i, j := range sameAs {
		if j >= 0 {
			results[i] = results[j]
			results[i].Policy = policies[i].Name
			results[i].SameAs = policies[j].Name
			results[i].AllocateCalls, results[i].Elapsed = 0, 0
		}
	}
	rep := Report{Results: results, Trace: tr, Cfg: cfg, Checkpoints: cfg.Checkpoints}
	files, err := rep.Write(out)
	if err != nil {
		return err
	}
	fmt.Print(rep.Markdown())
	fmt.Printf("\nwrote %s in %.1f s\n", strings.Join(files, ", "), time.Since(start).Seconds())
	if misses := rep.TargetMisses(); len(misses) > 0 {
		fmt.Printf("targets missed: %s\n", strings.Join(misses, "; "))
	}
	return nil
}

// policyByName maps a policy name to its GpuPolicy file and claim style. `default` renders with no policy
// file: the controller's built-in default.
func policyByName(name, dir string) (PolicySpec, error) {
	switch name {
	case "whole":
		return PolicySpec{Name: name, PolicyFile: filepath.Join(dir, "whole.yaml"), Style: StyleWhole}, nil
	case "mig":
		return PolicySpec{Name: name, PolicyFile: filepath.Join(dir, "mig.yaml"), Style: StyleMIG}, nil
	case "shares":
		return PolicySpec{Name: name, PolicyFile: filepath.Join(dir, "shares.yaml"), Style: StyleShares}, nil
	case "mig-1g":
		// Dynamic MIG with one profile: how the scheduler's cost per MIG pod follows the devices per node.
		return PolicySpec{Name: name, PolicyFile: filepath.Join(dir, "mig-1g.yaml"), Style: StyleMIG}, nil
	case "lean-mig":
		// The chart's lean-mig preset (a link to deployments/policies/lean-mig.yaml).
		return PolicySpec{Name: name, PolicyFile: filepath.Join(dir, "lean-mig.yaml"), Style: StyleMIG}, nil
	case "default":
		return PolicySpec{Name: name, Style: StyleAuto}, nil
	}
	return PolicySpec{}, fmt.Errorf("failed to read -policies: unknown policy %q (want whole, mig, mig-1g, lean-mig, shares, default)", name)
}
