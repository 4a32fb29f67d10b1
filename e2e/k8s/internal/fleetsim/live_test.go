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

// The sized live run's replicas hold the size their claim was made with: an engine on a resized share
// keeps its memory (weights, overhead, resident KV) within the share's limit, and reports it, so the
// memory tessera exports for the claim is what the next sizing reads.
func TestALiveReplicaOnAResizedShareKeepsItsEngineWithinTheSharesMemoryAndReportsIt(t *testing.T) {
	slice := agreementSlice(t)
	cfg := LiveSizedConfig(6)
	live := NewLive(cfg, slice, LiveSizedPolicy())
	small := Recommendation{RequestPercent: 45, CeilingPercent: 100, MemoryBytes: 20 * gib}
	replicas := []LiveReplica{{ID: "a", Service: 0, GPU: 0, Share: small}, {ID: "b", Service: 1, GPU: 1, Share: InitialShare},
		{ID: "c", Service: 2, GPU: 2, Share: InitialShare}}
	end := slice[len(slice)-1].At.Seconds() + 1
	var peak float64
	for at := 10.0; at < end; at += 10 {
		u := live.Step(at, replicas)["a"]
		if u.MemoryBytes > float64(small.MemoryBytes) {
			t.Fatalf("at %.0f s the 8B engine on a 20Gi share uses %.1f GiB", at, u.MemoryBytes/float64(gib))
		}
		peak = max(peak, u.MemoryBytes)
	}
	if w := Classes[0].WeightBytes; peak <= w {
		t.Fatalf("peak engine memory %.1f GiB, not above the weights' %.1f GiB: the replica reported no KV", peak/float64(gib), w/float64(gib))
	}
}
