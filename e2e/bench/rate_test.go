package main

import (
	"errors"
	"os"
	"strings"
	"sync/atomic"
	"testing"
)

// rateCell is a fixture builder for one measured cell.
func rateCell(server, policy string, nodes, bound int, seconds float64, timedOut bool) RateCell {
	devices := 8
	if policy == "mig" {
		devices = 208
	}
	return RateCell{Server: server, Policy: policy, Nodes: nodes, Devices: devices, Pods: 2 * nodes, Bound: bound, Seconds: seconds, TimedOut: timedOut, TimeBox: 120}
}

func TestTheRateTablePutsVersionsSideBySideWithTheMigToWholeRatio(t *testing.T) {
	cells := []RateCell{
		rateCell("v1.37.2", "whole", 100, 200, 2, false),
		rateCell("v1.37.2", "mig", 100, 200, 4, false),
		rateCell("v1.36.5", "whole", 100, 200, 2.5, false),
		rateCell("v1.36.5", "mig", 100, 48, 120, true),
	}
	table := RateTable(cells)
	lines := strings.Split(table, "\n")
	if !strings.Contains(lines[0], "v1.36.5 pods/s") || strings.Index(lines[0], "v1.36.5") > strings.Index(lines[0], "v1.37.2") {
		t.Fatalf("header %q: want v1.36.5 then v1.37.2 columns", lines[0])
	}
	var migRow, ratioRow string
	for _, l := range lines {
		if strings.HasPrefix(l, "| 100 | mig |") {
			migRow = l
		}
		if strings.HasPrefix(l, "| 100 | dynamic MIG / whole |") {
			ratioRow = l
		}
	}
	// 1.36.5: 48 pods in the 120 s time box = 0.4 pods/s, said to be time-boxed; 1.37.2: 200 in 4 s.
	if !strings.Contains(migRow, "| 0.4 | 48 / 200 in 120 (time box) | – |") || !strings.Contains(migRow, "| 50.0 | 200 / 200 in 4 | – |") {
		t.Errorf("mig row %q", migRow)
	}
	// whole: 80 pods/s on 1.36.5, 100 on 1.37.2 → 0.4/80 = 0.5 %, 50/100 = 50 %.
	if ratioRow != "| 100 | dynamic MIG / whole | 0.5 % | 50.0 % |" {
		t.Errorf("ratio row %q", ratioRow)
	}
}

func TestACellWithoutAWholeGPURunHasNoRatio(t *testing.T) {
	table := RateTable([]RateCell{rateCell("v1.37.2", "mig", 1000, 10, 120, true)})
	if !strings.Contains(table, "| 1000 | dynamic MIG / whole | – |") {
		t.Errorf("table without a whole-GPU cell:\n%s", table)
	}
}

func TestASizeSkippedForOnePolicyIsMarkedNotRun(t *testing.T) {
	whole := rateCell("v1.37.2", "whole", 1000, 100, 60, true)
	mig := rateCell("v1.37.2", "mig", 100, 200, 20, false)
	table := RateTable([]RateCell{whole, mig})
	if !strings.Contains(table, "| 1000 | mig | – | not run | | |") {
		t.Errorf("table:\n%s", table)
	}
}

func TestATimedOutCellCountsOnlyWhatWasBoundInTheTimeBox(t *testing.T) {
	c := rateCell("v1.36.5", "mig", 1000, 30, 120, true)
	if got := c.PodsPerSecond(); got != 0.25 {
		t.Errorf("pods/s %v, want 30 / 120 = 0.25", got)
	}
	if got := (RateCell{}).PodsPerSecond(); got != 0 {
		t.Errorf("an unmeasured cell has %v pods/s, want 0", got)
	}
}

func TestCPUPerPodIsTheSchedulersCPUTimeOverTheBoundPods(t *testing.T) {
	whole := rateCell("v1.37.2", "whole", 100, 200, 10, false)
	whole.SchedulerCPUSeconds = 2
	mig := rateCell("v1.37.2", "mig", 100, 100, 60, true)
	mig.SchedulerCPUSeconds = 4
	if got := mig.CPUMillisPerPod(); got != 40 {
		t.Errorf("CPU per pod %v ms, want 4 s / 100 pods = 40", got)
	}
	table := RateTable([]RateCell{whole, mig})
	// whole: 20 pods/s at 10 ms each; mig: 1.7 pods/s at 40 ms each → rate 8.3 %, CPU per pod 25 %.
	if !strings.Contains(table, "| 100 | dynamic MIG / whole | 8.3 % (CPU per pod: 25.0 %) |") {
		t.Errorf("table:\n%s", table)
	}
}

func TestProcessCPUSecondsReadsThisProcess(t *testing.T) {
	got, err := processCPUSeconds(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if got < 0 || got > 3600 {
		t.Errorf("this test process used %v s of CPU", got)
	}
	if _, err := processCPUSeconds(-1); err == nil {
		t.Error("no error for a process that does not exist")
	}
}

func TestParallelRunsEveryIndexOnceAndReturnsAFailure(t *testing.T) {
	var seen [50]atomic.Int32
	if err := parallel(len(seen), 4, func(i int) error { seen[i].Add(1); return nil }); err != nil {
		t.Fatal(err)
	}
	for i := range seen {
		if seen[i].Load() != 1 {
			t.Fatalf("index %d ran %d times", i, seen[i].Load())
		}
	}
	boom := errors.New("boom")
	if err := parallel(10, 3, func(i int) error {
		if i == 7 {
			return boom
		}
		return nil
	}); !errors.Is(err, boom) {
		t.Errorf("parallel returned %v, want the failure", err)
	}
}

func TestAWholeGPUPolicyAsksForOneGPUAndTheOthersForTheirSlice(t *testing.T) {
	if p := ratePod(PolicySpec{Name: "whole", Style: StyleWhole}, 100); p.Fractional() || p.NumGPU != 1 {
		t.Errorf("whole-GPU pod %+v", p)
	}
	if p := ratePod(PolicySpec{Name: "mig", Style: StyleMIG}, 100); !p.Fractional() || p.GPUMilli != 100 {
		t.Errorf("MIG pod %+v", p)
	}
}

func TestEveryPartitionedPolicyGetsItsOwnRatioRowAndNotedRunsOfOneVersionStayApart(t *testing.T) {
	cells := []RateCell{
		rateCell("v1.38.0 PreQueueingHints off", "whole", 100, 200, 2, false),
		rateCell("v1.38.0 PreQueueingHints off", "lean-mig", 100, 200, 8, false),
		rateCell("v1.38.0", "whole", 100, 200, 2, false),
		rateCell("v1.38.0", "lean-mig", 100, 200, 4, false),
		rateCell("v1.38.0", "shares", 100, 200, 2, false),
	}
	table := RateTable(cells)
	// Sorted, the plain version comes first: 50 % for it, 25 % for the run with hints off.
	if !strings.Contains(table, "| 100 | lean-mig / whole | 50.0 % | 25.0 % |") {
		t.Errorf("table:\n%s", table)
	}
	if strings.Contains(table, "shares / whole") {
		t.Errorf("shares are not partitioned devices and get no ratio row:\n%s", table)
	}
}
