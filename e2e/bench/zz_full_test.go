package main

import (
	"context"
	"fmt"
	"os"
	"testing"
)

func TestZZFull(t *testing.T) {
	if os.Getenv("ZZ") == "" {
		t.Skip()
	}
	tr, err := LoadTrace("/work/shared/data/openb/openb_pod_list_default.csv", "/work/shared/data/openb/openb_node_list_gpu_node.csv")
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{Models: []string{"H100-SXM5-80GB"}, MaxDemand: 1, Checkpoints: []int{50, 90, 100}, SkipGPUsNeeded: os.Getenv("ZZ") == "skip"}
	var results []RunResult
	for _, p := range fixturePolicies() {
		if os.Getenv("ZZP") != "" && os.Getenv("ZZP") != p.Name {
			continue
		}
		c, err := BuildCluster(fixtureSource{}, p, tr.Nodes, cfg)
		if err != nil {
			t.Fatal(err)
		}
		res, err := RunPolicy(context.Background(), c, p, tr, cfg)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("%s: %.2f%% placed %d failed %d needed %d calls %d %.1fs\n", p.Name, res.Final.AllocPct(res.TotalGPUs), res.Final.Placed, res.Final.Failed, res.GPUsNeeded, res.AllocateCalls, res.Elapsed.Seconds())
		results = append(results, res)
	}
	rep := Report{Results: results, Trace: tr, Cfg: cfg, Checkpoints: cfg.Checkpoints}
	fmt.Println(rep.Markdown())
	rep.Write("/tmp/zz")
}
