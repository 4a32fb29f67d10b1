package main

import (
	"fmt"
	"testing"
)

func TestTheSampleKeepsOneInEveryOfEachStratumAndTheCreationOrder(t *testing.T) {
	tr := &Trace{}
	// 25 8-GPU nodes and 3 1-GPU nodes; 30 whole-GPU pods and 12 pods of 0.4 GPU, interleaved.
	for i := range 25 {
		tr.Nodes = append(tr.Nodes, TraceNode{Name: fmt.Sprintf("big-%02d", i), GPUs: 8})
	}
	for i := range 3 {
		tr.Nodes = append(tr.Nodes, TraceNode{Name: fmt.Sprintf("small-%d", i), GPUs: 1})
	}
	for i := range 42 {
		p := pod(fmt.Sprintf("p-%02d", i), 1, 1000)
		if i%7 == 3 || i%7 == 5 {
			p.GPUMilli = 400
		}
		p.CreationTime = int64(i)
		tr.Pods = append(tr.Pods, p)
	}
	s, err := Sample(tr, 10)
	if err != nil {
		t.Fatal(err)
	}
	nodes, pods := Strata(s)
	if nodes[8] != 3 || nodes[1] != 1 || pods["gpus-1"] != 3 || pods["milli-4"] != 2 {
		t.Fatalf("want 3 big + 1 small node, 3 whole + 2 fractional pods; got nodes %v pods %v", nodes, pods)
	}
	for i := 1; i < len(s.Pods); i++ {
		if s.Pods[i].CreationTime < s.Pods[i-1].CreationTime {
			t.Fatalf("sample out of creation order: %v", s.Pods)
		}
	}
	if s.Nodes[0].Name != "big-00" || s.Nodes[1].Name != "big-10" || s.Pods[0].Name != "p-00" || s.Pods[1].Name != "p-03" {
		t.Fatalf("want the first of every ten in each stratum, got %v / %v", s.Nodes, s.Pods)
	}
}

func TestASampleOfOneInOneIsTheWholeTrace(t *testing.T) {
	tr := &Trace{Nodes: twoSingleGPUNodes, Pods: []TracePod{pod("a", 1, 300), pod("b", 2, 1000)}}
	s, err := Sample(tr, 1)
	if err != nil || len(s.Nodes) != 2 || len(s.Pods) != 2 {
		t.Fatalf("want the whole trace, got %+v, %v", s, err)
	}
	if _, err := Sample(tr, 0); err == nil {
		t.Fatal("want an error for -sample-every 0")
	}
}
