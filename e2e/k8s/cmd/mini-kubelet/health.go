package main

// Device health in the pod status, as kubelet does it: the DRA manager (kubelet's own code) reads the
// plugin's DRAResourceHealth stream into its health cache and sends the UIDs of the pods whose devices
// changed on Updates(); kubelet then regenerates the pod status, whose containerStatuses get
// allocatedResourcesStatus from Manager.UpdateAllocatedResourcesStatus (pkg/kubelet/kubelet_pods.go calls
// it from convertToAPIContainerStatuses). The stand-in has no status manager, so it writes the status
// itself when an update arrives and when it marks a pod Running.

import (
	"context"
	"reflect"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
)

// The manager's method took no logger before 1.36; asking through an interface keeps the stand-in
// building against both releases the harness supports.
type healthStatusWithLogger interface {
	UpdateAllocatedResourcesStatus(logger klog.Logger, pod *v1.Pod, status *v1.PodStatus)
}

type healthStatusWithoutLogger interface {
	UpdateAllocatedResourcesStatus(pod *v1.Pod, status *v1.PodStatus)
}

// setResourceHealth fills status.containerStatuses[].allocatedResourcesStatus from the manager's cache.
func (k *kubelet) setResourceHealth(ctx context.Context, pod *v1.Pod, status *v1.PodStatus) {
	switch m := any(k.dra).(type) {
	case healthStatusWithLogger:
		m.UpdateAllocatedResourcesStatus(klog.FromContext(ctx), pod, status)
	case healthStatusWithoutLogger:
		m.UpdateAllocatedResourcesStatus(pod, status)
	}
}

// watchHealth rewrites the status of every running pod the manager names on Updates().
func (k *kubelet) watchHealth(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case update := <-k.dra.Updates():
			for _, uid := range update.PodUIDs {
				if err := k.refreshResourceHealth(ctx, uid); err != nil {
					klog.InfoS("Failed to update the pod's resource health", "podUID", uid, "err", err)
				}
			}
		}
	}
}

func (k *kubelet) refreshResourceHealth(ctx context.Context, uid string) error {
	var found *v1.Pod
	for _, obj := range k.pods.GetStore().List() {
		if pod := obj.(*v1.Pod); string(pod.UID) == uid {
			found = pod
			break
		}
	}
	if found == nil {
		return nil
	}
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		current, err := k.client.CoreV1().Pods(found.Namespace).Get(ctx, found.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if current.UID != found.UID || current.Status.Phase != v1.PodRunning {
			return nil
		}
		status := current.Status.DeepCopy()
		k.setResourceHealth(ctx, current, status)
		if reflect.DeepEqual(status.ContainerStatuses, current.Status.ContainerStatuses) {
			return nil
		}
		current.Status = *status
		if _, err := k.client.CoreV1().Pods(current.Namespace).UpdateStatus(ctx, current, metav1.UpdateOptions{}); err != nil {
			return err
		}
		klog.InfoS("Resource health updated", "pod", klog.KObj(current))
		return nil
	})
}
