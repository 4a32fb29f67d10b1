package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Eight consecutive GPU pods of openb_pod_list_default.csv (creation order) and two of its 1-GPU nodes,
// copied verbatim, plus one CPU-only pod to show it is excluded.
const tracePods = `name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
openb-pod-1548,11908,47104,1,650,,LS,Running,10619480,10620795,10619514
openb-pod-1541,4000,30517,1,230,,BE,Pending,10617694,10617765,
openb-pod-1542,4000,30517,1,230,,BE,Running,10617694,10617896,10617695
openb-pod-1543,4000,22888,1,220,,BE,Running,10617708,10622262,10617708
openb-pod-1544,4000,30517,1,230,,BE,Running,10618001,10618776,10618068
openb-pod-1545,3152,5600,1,1000,,BE,Failed,10618278,10618400,10618278
openb-pod-1546,3152,5600,1,810,,BE,Failed,10619240,10619387,10619240
openb-pod-1547,16000,32768,1,1000,,LS,Running,10619379,10620761,10619381
openb-pod-0042,8000,16384,0,0,,Burstable,Running,0,12902960,0
`

const traceNodes = `sn,cpu_milli,memory_mib,gpu,model
openb-node-0143,8000,32768,1,V100M16
openb-node-0155,8000,32768,1,V100M16
`

// The same eight GPU pods and the CPU-only one as an openb pod list variant with only the five resource
// columns (no creation_time), in the file's own order, which is not sorted by name.
const tracePodsWithoutCreationTime = `name,cpu_milli,memory_mib,num_gpu,gpu_milli
openb-pod-1548,11908,47104,1,650
openb-pod-1541,4000,30517,1,230
openb-pod-0042,8000,16384,0,0
openb-pod-1545,3152,5600,1,1000
openb-pod-1542,4000,30517,1,230
openb-pod-1543,4000,22888,1,220
openb-pod-1547,16000,32768,1,1000
openb-pod-1544,4000,30517,1,230
openb-pod-1546,3152,5600,1,810
`

func writeTrace(t *testing.T) *Trace {
	t.Helper()
	return writeTraceWithPods(t, tracePods)
}

func writeTraceWithPods(t *testing.T, podList string) *Trace {
	t.Helper()
	dir := t.TempDir()
	pods, nodes := filepath.Join(dir, "pods.csv"), filepath.Join(dir, "nodes.csv")
	if err := os.WriteFile(pods, []byte(podList), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(nodes, []byte(traceNodes), 0o644); err != nil {
		t.Fatal(err)
	}
	tr, err := LoadTrace(pods, nodes)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func TestTheTraceIsReadInCreationOrderWithoutCPUOnlyPods(t *testing.T) {
	tr := writeTrace(t)
	if tr.CPUOnlyPods != 1 || len(tr.Pods) != 8 || tr.TotalGPUs() != 2 {
		t.Fatalf("%d GPU pods, %d CPU-only, %d GPUs; want 8, 1, 2", len(tr.Pods), tr.CPUOnlyPods, tr.TotalGPUs())
	}
	if tr.Pods[0].Name != "openb-pod-1541" || tr.Pods[7].Name != "openb-pod-1548" {
		t.Errorf("order %s ... %s, want openb-pod-1541 ... openb-pod-1548", tr.Pods[0].Name, tr.Pods[7].Name)
	}
	if !tr.Pods[0].Fractional() || tr.Pods[0].DemandMilli() != 230 || tr.Pods[4].Fractional() || tr.Pods[4].DemandMilli() != 1000 {
		t.Errorf("demands %+v, %+v", tr.Pods[0], tr.Pods[4])
	}
}

func TestAPodListWithoutCreationTimeIsReplayedInFileOrderAndTheHeaderSaysSo(t *testing.T) {
	tr := writeTraceWithPods(t, tracePodsWithoutCreationTime)
	want := []string{"openb-pod-1548", "openb-pod-1541", "openb-pod-1545", "openb-pod-1542", "openb-pod-1543", "openb-pod-1547", "openb-pod-1544", "openb-pod-1546"}
	var got []string
	for _, p := range tr.Pods {
		got = append(got, p.Name)
	}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("replay order %v, want the file's order %v", got, want)
	}
	if !tr.FileOrder || tr.CPUOnlyPods != 1 || tr.Pods[0].DemandMilli() != 650 || tr.Pods[2].DemandMilli() != 1000 {
		t.Errorf("file order %v, %d CPU-only, demands %d and %d; want true, 1, 650 and 1000", tr.FileOrder, tr.CPUOnlyPods, tr.Pods[0].DemandMilli(), tr.Pods[2].DemandMilli())
	}
	header := Report{Trace: tr}.Markdown()
	if !strings.Contains(header, "8 GPU pods replayed in file order (the pod list has no creation_time column)") {
		t.Errorf("the report's header does not say the pods were replayed in file order:\n%s", header)
	}
	if creation := (Report{Trace: writeTrace(t)}).Markdown(); !strings.Contains(creation, "replayed in creation order") {
		t.Errorf("the report of a trace with creation times does not say creation order:\n%s", creation)
	}
}

func TestAPodListMissingAColumnTheReplayNeedsIsAnErrorNamingIt(t *testing.T) {
	dir := t.TempDir()
	pods, nodes := filepath.Join(dir, "pods.csv"), filepath.Join(dir, "nodes.csv")
	if err := os.WriteFile(pods, []byte("name,cpu_milli,memory_mib,num_gpu\nopenb-pod-0001,4000,1024,1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(nodes, []byte(traceNodes), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := LoadTrace(pods, nodes)
	if err == nil || !strings.Contains(err.Error(), `no column "gpu_milli"`) {
		t.Fatalf("error %v, want one naming the missing column gpu_milli", err)
	}
}

// The slice of the trace on its two 1-GPU nodes, each GPU an H100 (81,559 MiB, 132 SMs). In order:
// 0.23, 0.23, 0.22, 0.23, whole, 0.81, whole, 0.65.
//   - whole: the first two 0.23 pods take the two GPUs; the other six fail: 2 placed.
//   - mig: 0.23 needs 31 SMs, 0.22 needs 30, so each takes a 2g.20gb (32 SMs); best fit keeps filling the
//     first GPU: 2g at 4, 2 and 0 — the third 2g placement is the last one, so the fourth small pod goes to
//     the second GPU. The whole pod finds no untouched GPU; 0.81 and 0.65 need 86+ SMs, a 7g.80gb, i.e. an
//     untouched GPU: none. 4 placed.
//   - shares: 23 + 23 + 22 + 23 = 91 % of the first GPU; the whole pod takes the untouched second GPU;
//     0.81, the second whole pod and 0.65 fit nowhere. 5 placed.
//   - default (the built-in policy: dynamic MIG on an H100): as mig, 4 placed.
func TestEachPolicyPlacesWhatItsPackingAllowsOnASliceOfTheTrace(t *testing.T) {
	tr := writeTrace(t)
	want := map[string]int{"whole": 2, "mig": 4, "shares": 5, "default": 4}
	for _, p := range fixturePolicies() {
		res := replayFixture(t, p, tr.Nodes, tr.Pods)
		if res.Final.Placed != want[p.Name] || res.Final.Failed != 8-want[p.Name] {
			t.Errorf("policy %s placed %d and failed %d of 8, want %d placed", p.Name, res.Final.Placed, res.Final.Failed, want[p.Name])
		}
	}
}
