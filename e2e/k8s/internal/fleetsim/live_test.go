package fleetsim

import (
	"testing"

	"tessera.dev/e2e/internal/fleet"
)

func agreementSlice(t *testing.T) []fleet.Request {
	t.Helper()
	reqs, err := fleet.ReadTrace("../fleet/testdata/azure-conv-first-10min.csv")
	if err != nil {
		t.Fatal(err)
	}
	var out []fleet.Request
	for i, r := range reqs {
		if r.At < AgreementSlice && i%AgreementThin == 0 {
			out = append(out, r)
		}
	}
	return out
}

// The live loop's engines are the offline model's: given the replicas Run would place (no HPA: one per
// service, first-fit), stepped in the live loop's one-second ticks at 10x, they account exactly what Run does.
func TestTheLiveModelGivenRunsReplicasAccountsExactlyWhatRunDoes(t *testing.T) {
	slice := agreementSlice(t)
	cfg := AgreementConfig(10)
	p := AgreementPolicy
	p.HPA = false
	want := Run(cfg, slice, p)

	live := NewLive(cfg, slice, p)
	// First-fit of three 50 % shares of 37 GiB: services 0 and 1 on the first GPU, service 2 on the second.
	replicas := []LiveReplica{{ID: "svc-0-a", Service: 0, GPU: 4}, {ID: "svc-1-a", Service: 1, GPU: 4}, {ID: "svc-2-a", Service: 2, GPU: 7}}
	end := slice[len(slice)-1].At.Seconds() + 1
	var gave float64
	for at := 10.0; ; at += 10 {
		for _, u := range live.Step(min(at, end), replicas) {
			gave += u.ClaimUse
		}
		if at >= end {
			break
		}
	}
	got := live.Result()
	if got.SMActive != want.SMActive || got.GPUUtil != want.GPUUtil || got.GPUHours != want.GPUHours ||
		got.Finished != want.Finished || got.PodsCreated != want.PodsCreated || got.MaxGPUs != want.MaxGPUs {
		t.Fatalf("live: %s %+v\nrun:  %s %+v", got, got.SMActive, want, want.SMActive)
	}
	if gave <= 0 {
		t.Fatalf("the live steps reported no claim use")
	}
}

// A replica the caller stops listing retires: its queue goes to the service's other replica and nothing is
// lost; a caller's GPU index maps to one modelled GPU, so two replicas listed on it share it.
func TestALiveReplicaThatDisappearsHandsItsQueueToTheOtherAndSharesItsGPU(t *testing.T) {
	slice := agreementSlice(t)
	cfg := AgreementConfig(10)
	live := NewLive(cfg, slice, AgreementPolicy)
	both := []LiveReplica{{ID: "a", Service: 0, GPU: 0}, {ID: "b", Service: 0, GPU: 0}, {ID: "c", Service: 1, GPU: 1}, {ID: "d", Service: 2, GPU: 1}}
	live.Step(200, both)
	live.Step(400, both[1:])
	end := slice[len(slice)-1].At.Seconds() + 1
	u := live.Step(end+600, both[1:])
	if _, ok := u["a"]; ok {
		t.Fatalf("the retired replica still reports use: %v", u)
	}
	r := live.Result()
	if r.Finished != r.Requests || r.MaxGPUs != 2 || r.PodsCreated != 4 {
		t.Fatalf("got %s, max GPUs %d: want every request finished on 2 GPUs by 4 pods", r, r.MaxGPUs)
	}
}

// The scenario is not trivial: on the slice, the model's HPA scales services out beyond their first
// replicas, and the GPUs it holds are not saturated.
func TestTheAgreementSliceMakesTheModelScaleWithoutSaturating(t *testing.T) {
	r := Run(AgreementConfig(10), agreementSlice(t), AgreementPolicy)
	if r.PodsCreated <= AgreementServices || r.SMActive.Mean >= 0.95 || r.MaxGPUs > 3 {
		t.Fatalf("%s, max GPUs %d: want more than %d pods, SM activity below 0.95, at most the node's 3 shared GPUs",
			r, r.MaxGPUs, AgreementServices)
	}
}

// The sized live run's replicas hold the size their claim was made with: an engine on a small resized
// share admits less KV than the same engine on the initial share (its memory limit is the share's), and
// reports its memory, so the memory tessera exports for the claim is what the next sizing reads.
func TestALiveReplicaOnAResizedShareAdmitsWithinTheSharesMemoryAndReportsIt(t *testing.T) {
	slice := agreementSlice(t)
	peak := func(share Recommendation) float64 {
		live := NewLive(LiveSizedConfig(6), slice, LiveSizedPolicy())
		replicas := []LiveReplica{{ID: "a", Service: 0, GPU: 0, Share: share}, {ID: "b", Service: 1, GPU: 1, Share: InitialShare},
			{ID: "c", Service: 2, GPU: 2, Share: InitialShare}}
		end := slice[len(slice)-1].At.Seconds() + 1
		var p float64
		for at := 10.0; at < end; at += 10 {
			p = max(p, live.Step(at, replicas)["a"].MemoryBytes)
		}
		return p
	}
	small := peak(Recommendation{RequestPercent: 45, CeilingPercent: 100, MemoryBytes: 18 * gib})
	whole := peak(InitialShare)
	if w := Classes[0].WeightBytes; small <= w {
		t.Fatalf("peak engine memory %.2f GiB, not above the weights' %.2f GiB: the replica reported no KV", small/float64(gib), w/float64(gib))
	}
	// The engine admits one request past its limit when its batch is empty (sim.go's admission), so the
	// small share's peak may pass 18 GiB by one request, never reach the initial share's.
	if small >= whole || small > 18.5*float64(gib) {
		t.Fatalf("the 8B engine peaks at %.2f GiB on an 18Gi share and %.2f GiB on the initial share", small/float64(gib), whole/float64(gib))
	}
}
