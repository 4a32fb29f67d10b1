package main

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// These tests stand a scripted scheduler in for kube-scheduler (the real one runs in `make test-sample`),
// to show that the decision check catches a scheduler that strays from the allocator.

// decide is a scripted scheduler's choice for one claim: a node and an allocation, or "" for unschedulable.
type decide func(claim *resourceapi.ResourceClaim) (string, *resourceapi.AllocationResult)

// fakeScheduler binds every pod created through client the way decide says, writing the claim's allocation
// before the binding as kube-scheduler's PreBind does.
func fakeScheduler(t *testing.T, client *fake.Clientset, d decide) {
	var mu sync.Mutex // one pod at a time, like the real scheduling cycle
	client.PrependReactor("create", "pods", func(action k8stesting.Action) (bool, runtime.Object, error) {
		pod := action.(k8stesting.CreateAction).GetObject().(*v1.Pod).DeepCopy()
		// The reactor runs under the fake's lock: act once the create has gone through.
		go func() {
			mu.Lock()
			defer mu.Unlock()
			ctx := context.Background()
			ns := pod.Namespace
			claim, err := client.ResourceV1().ResourceClaims(ns).Get(ctx, *pod.Spec.ResourceClaims[0].ResourceClaimName, metav1.GetOptions{})
			if err != nil {
				t.Errorf("fake scheduler: %v", err)
				return
			}
			var cur *v1.Pod
			for cur == nil {
				cur, _ = client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
			}
			node, alloc := d(claim)
			if node == "" {
				cur.Status.Conditions = []v1.PodCondition{{Type: v1.PodScheduled, Status: v1.ConditionFalse, Reason: v1.PodReasonUnschedulable, Message: "scripted: no"}}
				if _, err := client.CoreV1().Pods(ns).UpdateStatus(ctx, cur, metav1.UpdateOptions{}); err != nil {
					t.Errorf("fake scheduler: %v", err)
				}
				return
			}
			claim.Status.Allocation = alloc
			if _, err := client.ResourceV1().ResourceClaims(ns).UpdateStatus(ctx, claim, metav1.UpdateOptions{}); err != nil {
				t.Errorf("fake scheduler: %v", err)
				return
			}
			cur.Spec.NodeName = node
			if _, err := client.CoreV1().Pods(ns).Update(ctx, cur, metav1.UpdateOptions{}); err != nil {
				t.Errorf("fake scheduler: %v", err)
			}
		}()
		return false, nil, nil
	})
}

// sampleFixture is two single-H100 nodes under one policy, and the pods to replay.
func sampleFixture(t *testing.T, policy PolicySpec, pods []TracePod) (*Cluster, *Sim) {
	t.Helper()
	tr := RenameNodes(&Trace{Pods: pods, Nodes: twoSingleGPUNodes}, policy.Name+"-")
	cfg := Config{Models: []string{"H100-SXM5-80GB"}, MaxDemand: 10, Checkpoints: []int{100}, SkipGPUsNeeded: true, Classes: tesseraClasses(t)}
	c, err := BuildCluster(fixtureSource{}, policy, tr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return c, NewSim(policy, c)
}

func runSample(t *testing.T, policy PolicySpec, pods []TracePod, d func(*Cluster) decide) SchedulerResult {
	t.Helper()
	c, oracle := sampleFixture(t, policy, pods)
	client := fake.NewClientset()
	fakeScheduler(t, client, d(c))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := &SchedulerSample{Client: client, PodTimeout: 10 * time.Second, Settle: time.Millisecond}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	res, err := s.Run(ctx, policy, c, pods, oracle)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// firstFit is an honest scheduler: the first node where the allocator fits the claim, given what it has
// allocated so far.
func firstFit(t *testing.T) func(*Cluster) decide {
	return func(c *Cluster) decide {
		sim := NewSim(PolicySpec{Name: "scripted"}, c)
		return func(claim *resourceapi.ResourceClaim) (string, *resourceapi.AllocationResult) {
			for _, n := range c.Nodes {
				r, err := sim.AllocateOn(context.Background(), n.Node, claim)
				if err != nil {
					t.Errorf("scripted scheduler: %v", err)
					return "", nil
				}
				if r != nil {
					if err := sim.Commit(n.Node, *r); err != nil {
						t.Errorf("scripted scheduler: %v", err)
					}
					return n.Node, r
				}
			}
			return "", nil
		}
	}
}

var threeWholePods = []TracePod{pod("a", 1, 1000), pod("b", 1, 1000), pod("c", 1, 1000)}

func TestASchedulerThatFollowsTheAllocatorAgreesOnEveryDecision(t *testing.T) {
	res := runSample(t, PolicySpec{Name: "mig", Style: StyleMIG}, []TracePod{pod("a", 1, 300), pod("b", 1, 1000), pod("c", 1, 300), pod("d", 1, 1000)}, firstFit(t))
	// a takes a 3g.40gb on the first node, b the second node's whole GPU, c the first node's other 3g.40gb,
	// and d finds no whole GPU.
	if !res.OK() || res.Decisions != 4 || res.Bound != 3 || res.Scheduler.Failed != 1 {
		t.Fatalf("want 4 agreed decisions (3 bound, 1 unschedulable), got %+v", res)
	}
}

func TestASchedulerThatDoubleBooksAGPUIsCaught(t *testing.T) {
	res := runSample(t, PolicySpec{Name: "whole", Style: StyleWhole}, threeWholePods, func(c *Cluster) decide {
		honest := firstFit(t)(c)
		return func(claim *resourceapi.ResourceClaim) (string, *resourceapi.AllocationResult) {
			node, r := honest(claim)
			if claim.Name == "c" {
				// Both GPUs are taken; hand out the first node's again.
				return c.Nodes[0].Node, &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
					{Request: "gpu", Driver: DriverName, Pool: c.Nodes[0].Node, Device: "gpu-0"},
				}}}
			}
			return node, r
		}
	})
	if res.OK() || res.Agreed != 2 || len(res.Disagreements) != 1 || !strings.Contains(res.Disagreements[0], "finds no room") {
		t.Fatalf("want the third decision flagged as a double booking, got %+v", res)
	}
}

func TestASchedulerThatGivesUpWhileAGPUIsFreeIsCaught(t *testing.T) {
	res := runSample(t, PolicySpec{Name: "whole", Style: StyleWhole}, threeWholePods, func(*Cluster) decide {
		return func(*resourceapi.ResourceClaim) (string, *resourceapi.AllocationResult) { return "", nil }
	})
	// The allocator places a and b (and follows its own placements), then agrees that c fits nowhere.
	if res.OK() || res.Agreed != 1 || len(res.Disagreements) != 2 || !strings.Contains(res.Disagreements[0], "the allocator placed it") {
		t.Fatalf("want a and b flagged, got %+v", res)
	}
}

func TestASchedulerThatPicksOtherDevicesOnTheRightNodeIsCaught(t *testing.T) {
	res := runSample(t, PolicySpec{Name: "mig", Style: StyleMIG}, []TracePod{pod("a", 1, 100)}, func(c *Cluster) decide {
		return func(*resourceapi.ResourceClaim) (string, *resourceapi.AllocationResult) {
			// A 1g.10gb fits a 0.1 pod, but tessera's order makes the allocator take placement 6, not 0.
			return c.Nodes[0].Node, &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{
				{Request: "gpu/mig", Driver: DriverName, Pool: c.Nodes[0].Node, Device: "gpu-0-mig-1g-10gb-0"},
			}}}
		}
	})
	if res.OK() || res.Agreed != 1 || res.SameDevices != 0 || !strings.Contains(res.Disagreements[0], "the allocator gpu/mig:"+DriverName+"/mig-node-a/gpu-0-mig-1g-10gb-6") {
		t.Fatalf("want the device choice flagged, got %+v", res)
	}
}
