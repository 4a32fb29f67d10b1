package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
)

type fileSource struct{}

func (fileSource) Slices(policy PolicySpec, gpus []string) ([]*resourceapi.ResourceSlice, error) {
	data, err := os.ReadFile(filepath.Join("/tmp/bench-real2/render", policy.Name+"-shape-"+sanitize(shapeKey(gpus)), "slices.json"))
	if err != nil {
		return nil, err
	}
	return ParseSliceList(data)
}

func TestZZFull(t *testing.T) {
	if os.Getenv("ZZ") == "" {
		t.Skip()
	}
	tr, err := LoadTrace("/work/shared/data/openb/openb_pod_list_default.csv", "/work/shared/data/openb/openb_node_list_gpu_node.csv")
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{Models: []string{"H100-SXM5-80GB"}, MaxDemand: 1, Checkpoints: []int{50, 90, 100}, SkipGPUsNeeded: os.Getenv("ZZ") == "skip", Classes: tesseraClasses(t)}
	for _, p := range []PolicySpec{{Name: "mig", Style: StyleMIG}} {
		c, err := BuildCluster(fileSource{}, p, tr, cfg)
		if err != nil {
			t.Fatal(err)
		}
		res, err := RunPolicy(context.Background(), c, p, tr, cfg)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Printf("%s: %.2f%% placed %d failed %d needed %d calls %d %.1fs\n", p.Name, res.Final.AllocPct(res.TotalGPUs), res.Final.Placed, res.Final.Failed, res.GPUsNeeded, res.AllocateCalls, res.Elapsed.Seconds())
	}
}
