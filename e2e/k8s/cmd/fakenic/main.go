// Command fakenic is a second DRA driver for the e2e scenarios, a fake NIC: it lets a claim span tessera
// and another driver on the real node (issue 41 item 5). It is built on upstream's kubelet-plugin helper
// (k8s.io/dynamic-resource-allocation/kubeletplugin), as third-party drivers are, so what kubelet sees is
// what such a driver does:
//
//   - it publishes one ResourceSlice for its node through the helper: devices nic-0 .. nic-<n-1>, each with
//     the attributes `model` and `index`;
//   - it registers with the kubelet (the registrar and DRA sockets in the kubelet's root dir);
//   - NodePrepareResources writes a CDI spec (in the directory containerd reads) whose device sets
//     FAKE_NIC=<device> in the container, and records the claim in its state file; NodeUnprepareResources
//     removes both, and is a no-op for a claim it never prepared (kubelet unprepares every driver of a
//     claim, prepared or not);
//   - an opaque config for this driver in the claim, {"failPrepare": true}, makes prepare of that claim
//     fail with an error naming the driver and the config: failure injection without a shell.
//
// It is test code, never shipped: the product is the Rust plugin.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"sync"
	"syscall"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
)

// DriverName is the fake NIC's DRA driver name; the e2e scenario's DeviceClass selects it.
const DriverName = "nic.e2e.tessera.dev"

// cdiKind is the CDI kind of its devices: ids are "nic.e2e.tessera.dev/nic=<claim uid>-<device>".
const cdiKind = DriverName + "/nic"

// Config is the opaque configuration this driver takes from a claim (driver nic.e2e.tessera.dev).
type Config struct {
	// FailPrepare makes NodePrepareResources fail for the claim (e2e failure injection).
	FailPrepare bool `json:"failPrepare"`
}

// record is what the state file keeps per prepared claim: enough to unprepare after a restart.
type record struct {
	Namespace string   `json:"namespace"`
	Name      string   `json:"name"`
	Devices   []string `json:"devices"`
	CDISpec   string   `json:"cdiSpec"`
}

type driver struct {
	cdiDir    string
	stateFile string
	mu        sync.Mutex
}

func main() {
	klog.InitFlags(nil)
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the driver's identity (may write only this driver's ResourceSlices)")
	nodeName := flag.String("node-name", "", "the node this driver runs on")
	nodeUID := flag.String("node-uid", "", "the node's UID (owner of the ResourceSlice)")
	kubeletDir := flag.String("kubelet-dir", "/var/lib/kubelet", "kubelet's --root-dir (plugins/ and plugins_registry/)")
	cdiDir := flag.String("cdi-dir", "/var/run/cdi", "directory the container runtime reads CDI specs from")
	stateDir := flag.String("state-dir", "", "directory of the driver's state file (claims.json)")
	devices := flag.Int("devices", 4, "how many fake NICs to publish")
	flag.Parse()
	if *kubeconfig == "" || *nodeName == "" || *stateDir == "" {
		fmt.Fprintln(os.Stderr, "fakenic: --kubeconfig, --node-name and --state-dir are required")
		os.Exit(2)
	}
	if err := run(*kubeconfig, *nodeName, types.UID(*nodeUID), *kubeletDir, *cdiDir, *stateDir, *devices); err != nil {
		fmt.Fprintf(os.Stderr, "fakenic: %v\n", err)
		os.Exit(1)
	}
}

func run(kubeconfig, nodeName string, nodeUID types.UID, kubeletDir, cdiDir, stateDir string, n int) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("load %s: %w", kubeconfig, err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	pluginDir := filepath.Join(kubeletDir, "plugins", DriverName)
	for _, dir := range []string{cdiDir, stateDir, pluginDir} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	d := &driver{cdiDir: cdiDir, stateFile: filepath.Join(stateDir, "claims.json")}
	helper, err := kubeletplugin.Start(ctx, d,
		kubeletplugin.DriverName(DriverName),
		kubeletplugin.KubeClient(client),
		kubeletplugin.NodeName(nodeName),
		kubeletplugin.NodeUID(nodeUID),
		kubeletplugin.RegistrarDirectoryPath(filepath.Join(kubeletDir, "plugins_registry")),
		kubeletplugin.PluginDataDirectoryPath(pluginDir),
		kubeletplugin.HealthService(false),
	)
	if err != nil {
		return fmt.Errorf("start the kubelet plugin helper: %w", err)
	}
	defer helper.Stop()
	var devs []resourceapi.Device
	for i := range n {
		devs = append(devs, resourceapi.Device{
			Name: fmt.Sprintf("nic-%d", i),
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"model": {StringValue: ptr.To("fake-nic")},
				"index": {IntValue: ptr.To(int64(i))},
			},
		})
	}
	if err := helper.PublishResources(ctx, resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		nodeName: {Slices: []resourceslice.Slice{{Devices: devs}}},
	}}); err != nil {
		return fmt.Errorf("publish ResourceSlice: %w", err)
	}
	klog.InfoS("fake NIC driver serving", "driver", DriverName, "node", nodeName, "devices", n, "cdiDir", cdiDir, "state", d.stateFile)
	<-ctx.Done()
	return nil
}

func (d *driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	state, err := d.load()
	if err != nil {
		return nil, err
	}
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		devices, err := d.prepare(c, state)
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devices, Err: err}
	}
	return out, d.save(state)
}

func (d *driver) prepare(c *resourceapi.ResourceClaim, state map[types.UID]record) ([]kubeletplugin.Device, error) {
	if c.Status.Allocation == nil {
		return nil, fmt.Errorf("%s: ResourceClaim %s/%s is not allocated", DriverName, c.Namespace, c.Name)
	}
	cfg, err := configOf(c)
	if err != nil {
		return nil, err
	}
	if cfg.FailPrepare {
		return nil, fmt.Errorf("%s refuses to prepare ResourceClaim %s/%s: its opaque config for this driver sets failPrepare (e2e failure injection)", DriverName, c.Namespace, c.Name)
	}
	var devices []kubeletplugin.Device
	var names []string
	spec := map[string]any{"cdiVersion": "0.5.0", "kind": cdiKind}
	var cdiDevices []map[string]any
	for _, r := range c.Status.Allocation.Devices.Results {
		// Other drivers' results (tessera's GPU) are theirs to prepare.
		if r.Driver != DriverName {
			continue
		}
		name := fmt.Sprintf("%s-%s", c.UID, r.Device)
		cdiDevices = append(cdiDevices, map[string]any{
			"name":           name,
			"containerEdits": map[string]any{"env": []string{"FAKE_NIC=" + r.Device}},
		})
		devices = append(devices, kubeletplugin.Device{
			Requests: []string{r.Request}, PoolName: r.Pool, DeviceName: r.Device,
			CDIDeviceIDs: []string{cdiKind + "=" + name},
		})
		names = append(names, r.Device)
	}
	spec["devices"] = cdiDevices
	file := filepath.Join(d.cdiDir, fmt.Sprintf("%s-%s.json", DriverName, c.UID))
	data, err := json.MarshalIndent(spec, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := writeAtomically(file, data); err != nil {
		return nil, fmt.Errorf("%s: write CDI spec: %w", DriverName, err)
	}
	sort.Strings(names)
	state[c.UID] = record{Namespace: c.Namespace, Name: c.Name, Devices: names, CDISpec: file}
	return devices, nil
}

// configOf decodes this driver's opaque config of the claim, refusing unknown fields.
func configOf(c *resourceapi.ResourceClaim) (Config, error) {
	var cfg Config
	for _, entry := range c.Status.Allocation.Devices.Config {
		if entry.Opaque == nil || entry.Opaque.Driver != DriverName {
			continue
		}
		dec := json.NewDecoder(bytes.NewReader(entry.Opaque.Parameters.Raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&cfg); err != nil {
			return cfg, fmt.Errorf("%s: ResourceClaim %s/%s: invalid opaque config %s (the only field is failPrepare, a bool): %w",
				DriverName, c.Namespace, c.Name, entry.Opaque.Parameters.Raw, err)
		}
	}
	return cfg, nil
}

func (d *driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	state, err := d.load()
	if err != nil {
		return nil, err
	}
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		file := filepath.Join(d.cdiDir, fmt.Sprintf("%s-%s.json", DriverName, c.UID))
		if err := os.Remove(file); err != nil && !errors.Is(err, os.ErrNotExist) {
			out[c.UID] = fmt.Errorf("%s: remove CDI spec: %w", DriverName, err)
			continue
		}
		delete(state, c.UID)
		out[c.UID] = nil
	}
	return out, d.save(state)
}

func (d *driver) HandleError(ctx context.Context, err error, msg string) {
	klog.FromContext(ctx).Error(err, msg)
}

func (d *driver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}

func (d *driver) load() (map[types.UID]record, error) {
	state := map[types.UID]record{}
	data, err := os.ReadFile(d.stateFile)
	if errors.Is(err, os.ErrNotExist) {
		return state, nil
	}
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(data, &state); err != nil {
		return nil, fmt.Errorf("%s: state file %s: %w", DriverName, d.stateFile, err)
	}
	return state, nil
}

func (d *driver) save(state map[types.UID]record) error {
	data, err := json.MarshalIndent(state, "", "  ")
	if err != nil {
		return err
	}
	return writeAtomically(d.stateFile, data)
}

func writeAtomically(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
