// Command mini-kubelet stands in for the kubelet of one fake node in tessera's local cluster.
//
// What is kubelet code and what is ours: plugin discovery and registration (pluginmanager), the gRPC
// client that talks v1/v1beta1 to the DRA plugin (cm/dra/plugin) and the whole DRA claim manager
// (cm/dra: reservedFor checks, batching per driver, claim-info checkpoint, CDI ids per container) are
// the kubelet's own packages from k8s.io/kubernetes. This file only replaces what a kubelet does with
// containers: it registers the Node, keeps its Lease fresh, drives the DRA manager for the pods bound to
// the node, resolves the returned CDI ids with the CDI library into an OCI spec instead of starting a
// container, records the result on the pod and fakes the pod's status.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	coordinationv1 "k8s.io/api/coordination/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/wait"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/retry"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	"k8s.io/utils/ptr"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

// EditsAnnotation carries, per container, what CDI injection would give the container. The e2e test
// and `make up` read it; a real kubelet would hand the same OCI edits to the container runtime.
const EditsAnnotation = "e2e.tessera.dev/container-edits"

// The reason strings the real kubelet uses for these events (pkg/kubelet/events).
const (
	reasonFailedPrepare   = "FailedPrepareDynamicResources"
	reasonFailedUnprepare = "FailedUnprepareDynamicResources"
	reasonFailedCDI       = "FailedCDIInjection"
)

type options struct {
	kubeconfig   string
	nodeName     string
	registryDir  string
	cdiDir       string
	stateDir     string
	cpu          string
	memory       string
	maxPods      string
	featureGates string
	labels       string
}

// ContainerEdits is what CDI injection produced for one container.
type ContainerEdits struct {
	CDIDevices  []string     `json:"cdiDevices"`
	Env         []string     `json:"env,omitempty"`
	DeviceNodes []DeviceNode `json:"deviceNodes,omitempty"`
	Mounts      []Mount      `json:"mounts,omitempty"`
}

type DeviceNode struct {
	Path  string `json:"path"`
	Type  string `json:"type"`
	Major int64  `json:"major"`
	Minor int64  `json:"minor"`
}

type Mount struct {
	HostPath      string   `json:"hostPath"`
	ContainerPath string   `json:"containerPath"`
	Options       []string `json:"options,omitempty"`
}

func main() {
	var o options
	klog.InitFlags(nil)
	flag.StringVar(&o.kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig of the API server")
	flag.StringVar(&o.nodeName, "node-name", os.Getenv("NODE_NAME"), "name of the fake node")
	flag.StringVar(&o.registryDir, "registry-dir", "", "plugin registration directory to watch (kubelet's plugins_registry)")
	flag.StringVar(&o.cdiDir, "cdi-dir", "", "CDI spec directory of this node")
	flag.StringVar(&o.stateDir, "state-dir", "", "directory for the DRA manager checkpoint")
	flag.StringVar(&o.cpu, "cpu", "64", "node CPU capacity")
	flag.StringVar(&o.memory, "memory", "512Gi", "node memory capacity")
	flag.StringVar(&o.maxPods, "max-pods", "110", "node pod capacity")
	flag.StringVar(&o.featureGates, "feature-gates", "", "kubelet feature gates (k=v,...)")
	flag.StringVar(&o.labels, "node-labels", "", "extra node labels (k=v,...)")
	flag.Parse()
	if o.nodeName == "" || o.registryDir == "" || o.cdiDir == "" || o.stateDir == "" {
		fmt.Fprintln(os.Stderr, "mini-kubelet: --node-name, --registry-dir, --cdi-dir and --state-dir are required")
		os.Exit(2)
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer cancel()
	if err := run(ctx, o); err != nil {
		klog.ErrorS(err, "mini-kubelet failed")
		klog.Flush()
		os.Exit(1)
	}
	klog.Flush()
}

func run(ctx context.Context, o options) error {
	if o.featureGates != "" {
		if err := utilfeature.DefaultMutableFeatureGate.Set(o.featureGates); err != nil {
			return fmt.Errorf("failed to set --feature-gates: %w", err)
		}
	}
	for _, d := range []string{o.registryDir, o.cdiDir, o.stateDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return fmt.Errorf("failed to create %s: %w", d, err)
		}
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", o.kubeconfig)
	if err != nil {
		return fmt.Errorf("failed to load --kubeconfig %q: %w", o.kubeconfig, err)
	}
	cfg.UserAgent = "mini-kubelet/" + o.nodeName
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("failed to create client: %w", err)
	}

	node, err := registerNode(ctx, client, o)
	if err != nil {
		return err
	}
	klog.InfoS("Node registered and Ready", "node", o.nodeName)
	go keepLease(ctx, client, node)

	broadcaster := record.NewBroadcaster(record.WithContext(ctx))
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	defer broadcaster.Shutdown()
	recorder := broadcaster.NewRecorder(scheme.Scheme, v1.EventSource{Component: "kubelet", Host: o.nodeName})

	cdiCache, err := cdi.NewCache(cdi.WithSpecDirs(o.cdiDir), cdi.WithAutoRefresh(false))
	if err != nil {
		// Spec errors are reported per injection; only a broken cache setup is fatal.
		klog.InfoS("CDI cache reported errors at start", "err", err)
	}

	k := &kubelet{
		client:   client,
		nodeName: o.nodeName,
		recorder: recorder,
		cdi:      cdiCache,
		lastSeen: map[string]*v1.Pod{},
		queue:    workqueue.NewTypedRateLimitingQueue(workqueue.NewTypedItemExponentialFailureRateLimiter[string](500*time.Millisecond, 5*time.Second)),
		nodeGetFn: func(ctx context.Context) (*v1.Node, error) {
			return client.CoreV1().Nodes().Get(ctx, o.nodeName, metav1.GetOptions{})
		},
	}
	defer k.queue.ShutDown()

	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTweakListOptions(func(lo *metav1.ListOptions) {
		lo.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", o.nodeName).String()
	}))
	k.pods = factory.Core().V1().Pods().Informer()
	if _, err := k.pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { k.enqueue(obj) },
		UpdateFunc: func(_, obj any) { k.enqueue(obj) },
		DeleteFunc: func(obj any) { k.enqueue(obj) },
	}); err != nil {
		return fmt.Errorf("failed to add pod handler: %w", err)
	}
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), k.pods.HasSynced) {
		return errors.New("failed to sync the pod informer")
	}

	// The kubelet's DRA manager: the same object the real kubelet's container manager owns.
	manager, err := dra.NewManager(klog.FromContext(ctx), client, o.stateDir)
	if err != nil {
		return fmt.Errorf("failed to create the DRA manager: %w", err)
	}
	sourcesReady := config.NewSourcesReady(func(sets.Set[string]) bool { return true })
	if err := manager.Start(ctx, k.activePods, k.nodeGetFn, sourcesReady); err != nil {
		return fmt.Errorf("failed to start the DRA manager: %w", err)
	}
	k.dra = manager
	go k.watchHealth(ctx)

	plugins := pluginmanager.NewPluginManager(o.registryDir, recorder)
	plugins.AddHandler(registerapi.DRAPlugin, manager.GetWatcherHandler())
	go plugins.Run(ctx, sourcesReady, ctx.Done())
	klog.InfoS("Watching for plugins", "dir", o.registryDir)

	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k.processNext(ctx) {
			}
		}()
	}
	<-ctx.Done()
	k.queue.ShutDown()
	wg.Wait()
	klog.InfoS("mini-kubelet stopped", "node", o.nodeName)
	return nil
}

// registerNode does what test/integration/dra creates for fake nodes: a Ready node with capacity and
// without the not-ready taint that TaintNodesByCondition admission adds at creation.
func registerNode(ctx context.Context, client kubernetes.Interface, o options) (*v1.Node, error) {
	labels := map[string]string{
		"kubernetes.io/hostname": o.nodeName,
		"kubernetes.io/os":       "linux",
		"kubernetes.io/arch":     "amd64",
		"e2e.tessera.dev/node":   "true",
	}
	if o.labels != "" {
		for _, kv := range strings.Split(o.labels, ",") {
			key, value, _ := strings.Cut(kv, "=")
			labels[key] = value
		}
	}
	capacity := v1.ResourceList{}
	for name, value := range map[v1.ResourceName]string{v1.ResourceCPU: o.cpu, v1.ResourceMemory: o.memory, v1.ResourcePods: o.maxPods} {
		q, err := resource.ParseQuantity(value)
		if err != nil {
			return nil, fmt.Errorf("failed to parse %s capacity %q: %w", name, value, err)
		}
		capacity[name] = q
	}
	var node *v1.Node
	err := wait.PollUntilContextTimeout(ctx, time.Second, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		n, err := client.CoreV1().Nodes().Get(ctx, o.nodeName, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			n, err = client.CoreV1().Nodes().Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: o.nodeName, Labels: labels}}, metav1.CreateOptions{})
		}
		if err != nil {
			klog.InfoS("Registering node, retrying", "err", err)
			return false, nil
		}
		now := metav1.Now()
		n.Status.Capacity = capacity
		n.Status.Allocatable = capacity
		n.Status.Phase = v1.NodeRunning
		n.Status.Addresses = []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "127.0.0.1"}, {Type: v1.NodeHostName, Address: o.nodeName}}
		n.Status.NodeInfo = v1.NodeSystemInfo{KubeletVersion: "mini-kubelet", OperatingSystem: "linux", Architecture: "amd64", ContainerRuntimeVersion: "none://cdi-only"}
		n.Status.Conditions = []v1.NodeCondition{
			{Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "KubeletReady", Message: "mini-kubelet is posting ready status", LastHeartbeatTime: now, LastTransitionTime: now},
			{Type: v1.NodeMemoryPressure, Status: v1.ConditionFalse, Reason: "KubeletHasSufficientMemory", LastHeartbeatTime: now, LastTransitionTime: now},
			{Type: v1.NodeDiskPressure, Status: v1.ConditionFalse, Reason: "KubeletHasNoDiskPressure", LastHeartbeatTime: now, LastTransitionTime: now},
			{Type: v1.NodePIDPressure, Status: v1.ConditionFalse, Reason: "KubeletHasSufficientPID", LastHeartbeatTime: now, LastTransitionTime: now},
		}
		n, err = client.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{})
		if err != nil {
			klog.InfoS("Updating node status, retrying", "err", err)
			return false, nil
		}
		if len(n.Spec.Taints) > 0 {
			n.Spec.Taints = nil
			n, err = client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
			if err != nil {
				klog.InfoS("Clearing node taints, retrying", "err", err)
				return false, nil
			}
		}
		node = n
		return true, nil
	})
	if err != nil {
		return nil, fmt.Errorf("failed to register node %s: %w", o.nodeName, err)
	}
	return node, nil
}

// keepLease renews the node's Lease like the kubelet does, so anything watching node health sees a live node.
func keepLease(ctx context.Context, client kubernetes.Interface, node *v1.Node) {
	leases := client.CoordinationV1().Leases(v1.NamespaceNodeLease)
	wait.UntilWithContext(ctx, func(ctx context.Context) {
		now := metav1.NewMicroTime(time.Now())
		lease, err := leases.Get(ctx, node.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			lease = &coordinationv1.Lease{
				ObjectMeta: metav1.ObjectMeta{
					Name:            node.Name,
					OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: node.Name, UID: node.UID}},
				},
				Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(node.Name), LeaseDurationSeconds: ptr.To[int32](40), RenewTime: &now},
			}
			_, err = leases.Create(ctx, lease, metav1.CreateOptions{})
		} else if err == nil {
			lease.Spec.RenewTime = &now
			_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
		}
		if err != nil {
			klog.V(2).InfoS("Renewing node lease failed, retrying", "err", err)
		}
	}, 10*time.Second)
}

type kubelet struct {
	client    kubernetes.Interface
	nodeName  string
	recorder  record.EventRecorder
	cdi       *cdi.Cache
	cdiMu     sync.Mutex
	dra       *dra.Manager
	pods      cache.SharedIndexInformer
	queue     workqueue.TypedRateLimitingInterface[string]
	nodeGetFn func(context.Context) (*v1.Node, error)

	mu sync.Mutex
	// lastSeen keeps the last version of every pod so that a pod deleted behind our back (force
	// delete) still gets its claims unprepared.
	lastSeen map[string]*v1.Pod
}

func (k *kubelet) enqueue(obj any) {
	if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	pod, ok := obj.(*v1.Pod)
	if !ok {
		return
	}
	key := pod.Namespace + "/" + pod.Name
	k.mu.Lock()
	k.lastSeen[key] = pod
	k.mu.Unlock()
	k.queue.Add(key)
}

// activePods is what the DRA manager's reconcile loop uses to unprepare claims of pods that are gone.
func (k *kubelet) activePods() []*v1.Pod {
	var pods []*v1.Pod
	for _, obj := range k.pods.GetStore().List() {
		pod := obj.(*v1.Pod)
		if pod.Status.Phase != v1.PodSucceeded && pod.Status.Phase != v1.PodFailed {
			pods = append(pods, pod)
		}
	}
	return pods
}

func (k *kubelet) processNext(ctx context.Context) bool {
	key, quit := k.queue.Get()
	if quit {
		return false
	}
	defer k.queue.Done(key)
	if err := k.sync(ctx, key); err != nil {
		klog.InfoS("Pod sync failed, retrying", "pod", key, "err", err)
		k.queue.AddRateLimited(key)
		return true
	}
	k.queue.Forget(key)
	return true
}

func (k *kubelet) sync(ctx context.Context, key string) error {
	obj, exists, err := k.pods.GetStore().GetByKey(key)
	if err != nil {
		return err
	}
	if !exists {
		k.mu.Lock()
		last := k.lastSeen[key]
		k.mu.Unlock()
		if last == nil {
			return nil
		}
		if err := k.dra.UnprepareResources(ctx, last); err != nil {
			k.recorder.Eventf(last, v1.EventTypeWarning, reasonFailedUnprepare, "Failed to unprepare dynamic resources: %v", err)
			return err
		}
		klog.InfoS("Pod removed, resources unprepared", "pod", key)
		k.mu.Lock()
		if k.lastSeen[key] == last {
			delete(k.lastSeen, key)
		}
		k.mu.Unlock()
		return nil
	}
	pod := obj.(*v1.Pod)
	if pod.DeletionTimestamp != nil {
		return k.terminate(ctx, pod)
	}
	if pod.Status.Phase == v1.PodRunning || pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed {
		return nil
	}
	return k.start(ctx, pod)
}

// terminate is the kubelet's pod teardown without containers: unprepare first, then remove the pod
// object, so the ResourceClaim controller only frees the devices after the driver released them.
func (k *kubelet) terminate(ctx context.Context, pod *v1.Pod) error {
	if err := k.dra.UnprepareResources(ctx, pod); err != nil {
		k.recorder.Eventf(pod, v1.EventTypeWarning, reasonFailedUnprepare, "Failed to unprepare dynamic resources: %v", err)
		return err
	}
	err := k.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: ptr.To[int64](0),
		Preconditions:      &metav1.Preconditions{UID: &pod.UID},
	})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("failed to remove pod: %w", err)
	}
	klog.InfoS("Pod terminated, resources unprepared", "pod", klog.KObj(pod))
	return nil
}

func (k *kubelet) start(ctx context.Context, pod *v1.Pod) error {
	if err := k.dra.PrepareResources(ctx, pod); err != nil {
		k.recorder.Eventf(pod, v1.EventTypeWarning, reasonFailedPrepare, "Failed to prepare dynamic resources: %v", err)
		return err
	}
	edits := map[string]ContainerEdits{}
	containers := append(append([]v1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...)
	for i := range containers {
		c := &containers[i]
		info, err := k.dra.GetResources(pod, c)
		if err != nil {
			k.recorder.Eventf(pod, v1.EventTypeWarning, reasonFailedPrepare, "Failed to get dynamic resources of container %s: %v", c.Name, err)
			return err
		}
		if len(info.CDIDevices) == 0 {
			continue
		}
		ids := make([]string, 0, len(info.CDIDevices))
		for _, d := range info.CDIDevices {
			ids = append(ids, d.Name)
		}
		e, err := k.inject(ids)
		if err != nil {
			k.recorder.Eventf(pod, v1.EventTypeWarning, reasonFailedCDI, "Failed to inject CDI devices into container %s: %v", c.Name, err)
			return err
		}
		edits[c.Name] = e
		klog.InfoS("Container edits", "pod", klog.KObj(pod), "container", c.Name, "cdiDevices", e.CDIDevices, "env", e.Env, "deviceNodes", e.DeviceNodes, "mounts", e.Mounts)
	}
	raw, err := json.Marshal(edits)
	if err != nil {
		return fmt.Errorf("failed to encode container edits: %w", err)
	}
	patch, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{EditsAnnotation: string(raw)}}})
	if err != nil {
		return fmt.Errorf("failed to encode annotation patch: %w", err)
	}
	if _, err := k.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("failed to annotate pod with container edits: %w", err)
	}
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		current, err := k.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		if current.UID != pod.UID || current.DeletionTimestamp != nil {
			return nil
		}
		setRunning(current)
		k.setResourceHealth(ctx, current, &current.Status)
		_, err = k.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, current, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("failed to mark pod running: %w", err)
	}
	k.recorder.Eventf(pod, v1.EventTypeNormal, "Started", "Resources prepared and CDI devices injected (no container is started)")
	klog.InfoS("Pod running", "pod", klog.KObj(pod))
	return nil
}

// inject resolves CDI ids the way a CDI-enabled runtime (containerd, CRI-O) does, against a minimal OCI
// spec, and returns the resulting container edits.
func (k *kubelet) inject(ids []string) (ContainerEdits, error) {
	k.cdiMu.Lock()
	defer k.cdiMu.Unlock()
	refreshErr := k.cdi.Refresh()
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	unresolved, err := k.cdi.InjectDevices(spec, ids...)
	if err != nil {
		if refreshErr != nil {
			return ContainerEdits{}, fmt.Errorf("%w (unresolved %v; CDI spec errors: %v)", err, unresolved, refreshErr)
		}
		return ContainerEdits{}, fmt.Errorf("%w (unresolved %v)", err, unresolved)
	}
	e := ContainerEdits{CDIDevices: ids, Env: spec.Process.Env}
	for _, d := range spec.Linux.Devices {
		e.DeviceNodes = append(e.DeviceNodes, DeviceNode{Path: d.Path, Type: d.Type, Major: d.Major, Minor: d.Minor})
	}
	for _, m := range spec.Mounts {
		e.Mounts = append(e.Mounts, Mount{HostPath: m.Source, ContainerPath: m.Destination, Options: m.Options})
	}
	sort.Strings(e.Env)
	return e, nil
}

func setRunning(pod *v1.Pod) {
	now := metav1.Now()
	pod.Status.Phase = v1.PodRunning
	pod.Status.HostIP = "127.0.0.1"
	pod.Status.HostIPs = []v1.HostIP{{IP: "127.0.0.1"}}
	if pod.Status.StartTime == nil {
		pod.Status.StartTime = &now
	}
	for _, t := range []v1.PodConditionType{v1.PodReadyToStartContainers, v1.PodInitialized, v1.ContainersReady, v1.PodReady} {
		setCondition(pod, v1.PodCondition{Type: t, Status: v1.ConditionTrue, LastTransitionTime: now})
	}
	pod.Status.ContainerStatuses = nil
	for _, c := range pod.Spec.Containers {
		pod.Status.ContainerStatuses = append(pod.Status.ContainerStatuses, v1.ContainerStatus{
			Name:        c.Name,
			Image:       c.Image,
			ImageID:     c.Image,
			ContainerID: "mini-kubelet://" + filepath.Join(string(pod.UID), c.Name),
			Ready:       true,
			Started:     ptr.To(true),
			State:       v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: now}},
		})
	}
}

func setCondition(pod *v1.Pod, c v1.PodCondition) {
	for i := range pod.Status.Conditions {
		if pod.Status.Conditions[i].Type == c.Type {
			if pod.Status.Conditions[i].Status != c.Status {
				pod.Status.Conditions[i] = c
			}
			return
		}
	}
	pod.Status.Conditions = append(pod.Status.Conditions, c)
}
