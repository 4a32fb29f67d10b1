package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
)

// DriverName is tessera's DRA driver.
const DriverName = "gpu.tessera.dev"

// EditsAnnotation is written by the kubelet stand-in: container name -> ContainerEdits.
const EditsAnnotation = "e2e.tessera.dev/container-edits"

// ContainerEdits mirrors what the kubelet stand-in records for one container.
type ContainerEdits struct {
	CDIDevices  []string `json:"cdiDevices"`
	Env         []string `json:"env,omitempty"`
	DeviceNodes []struct {
		Path  string `json:"path"`
		Type  string `json:"type"`
		Major int64  `json:"major"`
		Minor int64  `json:"minor"`
	} `json:"deviceNodes,omitempty"`
	Mounts []struct {
		HostPath      string   `json:"hostPath"`
		ContainerPath string   `json:"containerPath"`
		Options       []string `json:"options,omitempty"`
	} `json:"mounts,omitempty"`
}

// EnvMap turns K=V entries into a map.
func (e ContainerEdits) EnvMap() map[string]string {
	m := map[string]string{}
	for _, kv := range e.Env {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v
	}
	return m
}

// DevicePaths lists the container paths of the injected device nodes.
func (e ContainerEdits) DevicePaths() []string {
	var paths []string
	for _, d := range e.DeviceNodes {
		paths = append(paths, d.Path)
	}
	return paths
}

// Edits decodes the kubelet stand-in's annotation of a pod.
func Edits(pod *v1.Pod) (map[string]ContainerEdits, error) {
	raw, ok := pod.Annotations[EditsAnnotation]
	if !ok {
		return nil, nil
	}
	edits := map[string]ContainerEdits{}
	if err := json.Unmarshal([]byte(raw), &edits); err != nil {
		return nil, fmt.Errorf("failed to decode %s of pod %s/%s: %w", EditsAnnotation, pod.Namespace, pod.Name, err)
	}
	return edits, nil
}

// PodClaims returns the ResourceClaims a pod uses: generated from templates, named directly, and the one
// kube-scheduler created for the pod's extended resources backed by a DeviceClass (KEP-5004), which only
// pod.status.extendedResourceClaimStatus names, as the kubelet's DRA manager reads it.
func PodClaims(ctx context.Context, client kubernetes.Interface, pod *v1.Pod) ([]*resourcev1.ResourceClaim, error) {
	var names []string
	for _, pc := range pod.Spec.ResourceClaims {
		name := ""
		if pc.ResourceClaimName != nil {
			name = *pc.ResourceClaimName
		}
		for _, st := range pod.Status.ResourceClaimStatuses {
			if st.Name == pc.Name && st.ResourceClaimName != nil {
				name = *st.ResourceClaimName
			}
		}
		if name != "" {
			names = append(names, name)
		}
	}
	if st := pod.Status.ExtendedResourceClaimStatus; st != nil && st.ResourceClaimName != "" {
		names = append(names, st.ResourceClaimName)
	}
	var claims []*resourcev1.ResourceClaim
	for _, name := range names {
		claim, err := client.ResourceV1().ResourceClaims(pod.Namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("failed to get ResourceClaim %s/%s: %w", pod.Namespace, name, err)
		}
		claims = append(claims, claim)
	}
	return claims, nil
}

// PodProblem explains why a pod is not running: the scheduler's reason or the latest warning event.
func PodProblem(ctx context.Context, client kubernetes.Interface, pod *v1.Pod) string {
	var parts []string
	for _, c := range pod.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status != v1.ConditionTrue {
			parts = append(parts, fmt.Sprintf("%s: %s", c.Reason, c.Message))
		}
	}
	if ev := LatestWarning(ctx, client, pod); ev != nil {
		parts = append(parts, fmt.Sprintf("%s: %s", ev.Reason, ev.Message))
	}
	return strings.Join(parts, "; ")
}

// LatestWarning returns the most recent Warning event of a pod, if any.
func LatestWarning(ctx context.Context, client kubernetes.Interface, pod *v1.Pod) *v1.Event {
	evs, err := client.CoreV1().Events(pod.Namespace).List(ctx, metav1.ListOptions{FieldSelector: fields.Set{
		"involvedObject.name": pod.Name, "involvedObject.uid": string(pod.UID), "type": v1.EventTypeWarning,
	}.String()})
	if err != nil || len(evs.Items) == 0 {
		return nil
	}
	sort.Slice(evs.Items, func(i, j int) bool { return eventTime(&evs.Items[i]).Before(eventTime(&evs.Items[j])) })
	return &evs.Items[len(evs.Items)-1]
}

func eventTime(e *v1.Event) time.Time {
	if !e.LastTimestamp.IsZero() {
		return e.LastTimestamp.Time
	}
	if !e.EventTime.IsZero() {
		return e.EventTime.Time
	}
	return e.CreationTimestamp.Time
}

// Settled is true when a pod runs, or is stuck for a reason a report can show.
func Settled(ctx context.Context, client kubernetes.Interface, pod *v1.Pod) bool {
	if pod.Status.Phase != v1.PodPending {
		return true
	}
	for _, c := range pod.Status.Conditions {
		if c.Type == v1.PodScheduled && c.Status == v1.ConditionFalse && c.Reason == v1.PodReasonUnschedulable {
			return true
		}
	}
	return LatestWarning(ctx, client, pod) != nil
}

// WaitSettled waits until every pod outside kube-system is Settled.
func WaitSettled(ctx context.Context, client kubernetes.Interface, timeout time.Duration) error {
	return wait.PollUntilContextTimeout(ctx, time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		pods, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for i := range pods.Items {
			if pods.Items[i].Namespace == metav1.NamespaceSystem {
				continue
			}
			if !Settled(ctx, client, &pods.Items[i]) {
				return false, nil
			}
		}
		return true, nil
	})
}

// Report prints, per pod: node, allocated devices, CDI devices, and the env and device nodes each
// container would get. It returns the number of pods that are not Running.
func Report(ctx context.Context, client kubernetes.Interface, w io.Writer) (int, error) {
	pods, err := client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return 0, fmt.Errorf("failed to list pods: %w", err)
	}
	sort.Slice(pods.Items, func(i, j int) bool {
		a, b := &pods.Items[i], &pods.Items[j]
		return a.Namespace+"/"+a.Name < b.Namespace+"/"+b.Name
	})
	notRunning := 0
	for i := range pods.Items {
		pod := &pods.Items[i]
		if pod.Namespace == metav1.NamespaceSystem {
			continue
		}
		node := pod.Spec.NodeName
		if node == "" {
			node = "<none>"
		}
		fmt.Fprintf(w, "pod %s/%s  phase=%s  node=%s\n", pod.Namespace, pod.Name, pod.Status.Phase, node)
		if pod.Status.Phase != v1.PodRunning {
			notRunning++
			if p := PodProblem(ctx, client, pod); p != "" {
				fmt.Fprintf(w, "  why: %s\n", p)
			}
		}
		claims, err := PodClaims(ctx, client, pod)
		if err != nil {
			fmt.Fprintf(w, "  claims: %v\n", err)
		}
		for _, claim := range claims {
			if claim.Status.Allocation == nil {
				fmt.Fprintf(w, "  claim %s: not allocated\n", claim.Name)
				continue
			}
			for _, r := range claim.Status.Allocation.Devices.Results {
				extra := ""
				if r.ShareID != nil {
					extra += " shareID=" + string(*r.ShareID)
				}
				if len(r.ConsumedCapacity) > 0 {
					var caps []string
					for name, q := range r.ConsumedCapacity {
						caps = append(caps, fmt.Sprintf("%s=%s", name, q.String()))
					}
					sort.Strings(caps)
					extra += " consumed[" + strings.Join(caps, ",") + "]"
				}
				fmt.Fprintf(w, "  claim %s request %s: %s/%s/%s%s\n", claim.Name, r.Request, r.Driver, r.Pool, r.Device, extra)
			}
		}
		edits, err := Edits(pod)
		if err != nil {
			fmt.Fprintf(w, "  edits: %v\n", err)
		}
		names := make([]string, 0, len(edits))
		for name := range edits {
			names = append(names, name)
		}
		sort.Strings(names)
		for _, name := range names {
			e := edits[name]
			fmt.Fprintf(w, "  container %s\n", name)
			fmt.Fprintf(w, "    cdi devices:  %s\n", strings.Join(e.CDIDevices, " "))
			fmt.Fprintf(w, "    env:          %s\n", strings.Join(e.Env, " "))
			var nodes []string
			for _, d := range e.DeviceNodes {
				nodes = append(nodes, fmt.Sprintf("%s(%s %d:%d)", d.Path, d.Type, d.Major, d.Minor))
			}
			fmt.Fprintf(w, "    device nodes: %s\n", strings.Join(nodes, " "))
			if len(e.Mounts) > 0 {
				var mounts []string
				for _, m := range e.Mounts {
					mounts = append(mounts, m.HostPath+":"+m.ContainerPath)
				}
				fmt.Fprintf(w, "    mounts:       %s\n", strings.Join(mounts, " "))
			}
		}
	}
	return notRunning, nil
}
