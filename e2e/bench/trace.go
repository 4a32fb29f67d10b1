package main

import (
	"encoding/csv"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
)

// TracePod is one row of openb_pod_list_default.csv that asks for GPUs.
type TracePod struct {
	Name string
	// NumGPU is the trace's num_gpu (1..8).
	NumGPU int
	// GPUMilli is the thousandths of one GPU a sharing task asks for; 1000 for whole-GPU tasks. Only
	// meaningful when NumGPU == 1 (multi-GPU tasks always carry 1000).
	GPUMilli int
	// CreationTime orders the replay (seconds from the start of the trace); zero for every pod of a pod list
	// without the column.
	CreationTime int64
}

// Fractional reports whether the pod asks for part of one GPU (the sharing class of the trace).
func (p TracePod) Fractional() bool { return p.NumGPU == 1 && p.GPUMilli < 1000 }

// DemandMilli is the pod's GPU demand in thousandths of a GPU: num_gpu × 1000, or gpu_milli for a
// fractional pod. This is the unit of every allocation-ratio number the benchmark prints.
func (p TracePod) DemandMilli() int64 {
	if p.Fractional() {
		return int64(p.GPUMilli)
	}
	return int64(p.NumGPU) * 1000
}

// TraceNode is one row of openb_node_list_gpu_node.csv.
type TraceNode struct {
	Name string
	GPUs int
	// Model is the trace's GPU model (P100, T4, G2 ...); the benchmark re-images every GPU and only keeps it
	// for the README's table.
	Model string
}

// Trace is the part of the openb trace the benchmark replays.
type Trace struct {
	// Pods asking for GPUs, in creation order (ties broken by name so the order is stable), or in file order
	// when the pod list has no creation_time column (FileOrder).
	Pods []TracePod
	// FileOrder is set when the pod list carries no creation_time (some openb variants have only name,
	// cpu_milli, memory_mib, num_gpu, gpu_milli): the replay then follows the file, and the report says so.
	FileOrder bool
	// CPUOnlyPods counts the excluded num_gpu == 0 rows.
	CPUOnlyPods int
	Nodes       []TraceNode
}

// Order names the order the pods are replayed in, for the report's header.
func (t *Trace) Order() string {
	if t.FileOrder {
		return "file order (the pod list has no creation_time column)"
	}
	return "creation order"
}

// TotalGPUs is the number of GPUs in the trace's GPU nodes.
func (t *Trace) TotalGPUs() int {
	n := 0
	for _, node := range t.Nodes {
		n += node.GPUs
	}
	return n
}

// csvTable reads a CSV with a header and gives access to columns by name, so the loader fails with the
// column's name when the published files change shape.
type csvTable struct {
	path   string
	header map[string]int
	rows   [][]string
}

func readCSV(path string) (*csvTable, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("failed to open trace file %s: %w", path, err)
	}
	defer f.Close()
	r := csv.NewReader(f)
	head, err := r.Read()
	if err != nil {
		return nil, fmt.Errorf("failed to read the header of %s: %w", path, err)
	}
	t := &csvTable{path: path, header: map[string]int{}}
	for i, h := range head {
		t.header[h] = i
	}
	for {
		row, err := r.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("failed to read %s: %w", path, err)
		}
		t.rows = append(t.rows, row)
	}
	return t, nil
}

func (t *csvTable) has(col string) bool {
	_, ok := t.header[col]
	return ok
}

func (t *csvTable) str(row int, col string) (string, error) {
	i, ok := t.header[col]
	if !ok {
		return "", fmt.Errorf("failed to read %s: no column %q in the header", t.path, col)
	}
	return t.rows[row][i], nil
}

func (t *csvTable) int(row int, col string) (int64, error) {
	s, err := t.str(row, col)
	if err != nil {
		return 0, err
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("failed to parse column %q of row %d in %s: %w", col, row+2, t.path, err)
	}
	return v, nil
}

// LoadTrace reads the two openb CSVs as published. A pod list without creation_time is replayed in file
// order; every other column the replay needs must be there.
func LoadTrace(podsPath, nodesPath string) (*Trace, error) {
	tr := &Trace{}
	pods, err := readCSV(podsPath)
	if err != nil {
		return nil, err
	}
	tr.FileOrder = !pods.has("creation_time")
	for i := range pods.rows {
		name, err := pods.str(i, "name")
		if err != nil {
			return nil, err
		}
		numGPU, err := pods.int(i, "num_gpu")
		if err != nil {
			return nil, err
		}
		milli, err := pods.int(i, "gpu_milli")
		if err != nil {
			return nil, err
		}
		var created int64
		if !tr.FileOrder {
			if created, err = pods.int(i, "creation_time"); err != nil {
				return nil, err
			}
		}
		if numGPU == 0 {
			tr.CPUOnlyPods++
			continue
		}
		if milli <= 0 || milli > 1000 {
			return nil, fmt.Errorf("failed to read pod %s: gpu_milli %d is outside 1..1000", name, milli)
		}
		tr.Pods = append(tr.Pods, TracePod{Name: name, NumGPU: int(numGPU), GPUMilli: int(milli), CreationTime: created})
	}
	// Without creation times every pod ties at zero; the name tie-break would then reorder the file, so the
	// file's own order is kept instead.
	if !tr.FileOrder {
		sort.SliceStable(tr.Pods, func(a, b int) bool {
			if tr.Pods[a].CreationTime != tr.Pods[b].CreationTime {
				return tr.Pods[a].CreationTime < tr.Pods[b].CreationTime
			}
			return tr.Pods[a].Name < tr.Pods[b].Name
		})
	}

	nodes, err := readCSV(nodesPath)
	if err != nil {
		return nil, err
	}
	for i := range nodes.rows {
		name, err := nodes.str(i, "sn")
		if err != nil {
			return nil, err
		}
		gpus, err := nodes.int(i, "gpu")
		if err != nil {
			return nil, err
		}
		model, err := nodes.str(i, "model")
		if err != nil {
			return nil, err
		}
		if gpus <= 0 {
			continue
		}
		tr.Nodes = append(tr.Nodes, TraceNode{Name: name, GPUs: int(gpus), Model: model})
	}
	return tr, nil
}
