package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"sigs.k8s.io/yaml"
)

// DriverName is tessera's DRA driver name (BRIEF contract).
const DriverName = "gpu.tessera.dev"

// NodeSlices is what one node publishes: its ResourceSlices, already named for the node.
type NodeSlices struct {
	Node   string
	Slices []*resourceapi.ResourceSlice
}

// ForNode copies a rendered template onto another node: pool name, nodeName and slice names follow the
// node, exactly as the controller would have rendered them for it (the pool name is the node name).
func ForNode(template []*resourceapi.ResourceSlice, node string) NodeSlices {
	out := make([]*resourceapi.ResourceSlice, 0, len(template))
	for i, s := range template {
		c := s.DeepCopy()
		c.Name = fmt.Sprintf("%s-%s-%d", node, DriverName, i)
		c.Spec.Pool.Name = node
		if c.Spec.NodeName != nil {
			c.Spec.NodeName = &node
		}
		out = append(out, c)
	}
	return NodeSlices{Node: node, Slices: out}
}

// SliceSource produces the slices of a node shape (GPU model × count) under one policy. The real one runs
// tessera's binaries; tests hand in hand-made slices in the same format.
type SliceSource interface {
	Slices(policy PolicySpec, gpus []string) ([]*resourceapi.ResourceSlice, error)
}

// Renderer runs `tessera-kubelet-plugin discover` to get a simulated node's inventory and
// `tessera-controller render` to turn it into the ResourceSlices the controller would publish. Each distinct
// (policy, shape) is rendered once.
type Renderer struct {
	PluginBin     string
	ControllerBin string
	WorkDir       string
	cache         map[string][]*resourceapi.ResourceSlice
	// inventories keeps each shape's discovered inventory, so every policy renders the same GPUs (the
	// simulated backend draws fresh UUIDs on every discover).
	inventories map[string]string
}

// simulatedNodeFile is the plugin's --simulated-node-file format.
type simulatedNodeFile struct {
	GPUs []simulatedGPU `json:"gpus"`
}

type simulatedGPU struct {
	Model string `json:"model"`
	Count int    `json:"count"`
}

func runBinary(ctx context.Context, bin string, args ...string) ([]byte, error) {
	// Arguments are passed as a vector, never through a shell.
	cmd := exec.CommandContext(ctx, bin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout = &stdout
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("failed to run %s %v: %w: %s", bin, args, err, stderr.String())
	}
	return stdout.Bytes(), nil
}

// Slices renders (once) the slices of a node whose GPUs have the given models, in index order.
func (r *Renderer) Slices(policy PolicySpec, gpus []string) ([]*resourceapi.ResourceSlice, error) {
	if r.cache == nil {
		r.cache = map[string][]*resourceapi.ResourceSlice{}
	}
	key := policy.Name + "/" + shapeKey(gpus)
	if s, ok := r.cache[key]; ok {
		return s, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	nodeName := "shape-" + sanitize(shapeKey(gpus))
	invFile, err := r.inventory(ctx, nodeName, gpus)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(r.WorkDir, sanitize(policy.Name)+"-"+nodeName)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("failed to create render dir %s: %w", dir, err)
	}
	args := []string{"render", "--inventory", invFile}
	if policy.PolicyFile != "" {
		args = append(args, "--policy", policy.PolicyFile)
	}
	out, err := runBinary(ctx, r.ControllerBin, args...)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "slices.json"), out, 0o644); err != nil {
		return nil, fmt.Errorf("failed to keep the rendered slices in %s: %w", dir, err)
	}
	slices, err := ParseSliceList(out)
	if err != nil {
		return nil, fmt.Errorf("failed to read the slices %s render printed for %s: %w", r.ControllerBin, nodeName, err)
	}
	if len(slices) == 0 {
		return nil, fmt.Errorf("failed to render %s under policy %s: render printed no ResourceSlice", nodeName, policy.Name)
	}
	r.cache[key] = slices
	return slices, nil
}

// inventory discovers a simulated node of the given GPUs once and writes it as a ready NodeInventory.
func (r *Renderer) inventory(ctx context.Context, nodeName string, gpus []string) (string, error) {
	if f, ok := r.inventories[nodeName]; ok {
		return f, nil
	}
	dir := filepath.Join(r.WorkDir, nodeName)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("failed to create render dir %s: %w", dir, err)
	}
	var nf simulatedNodeFile
	for _, m := range gpus {
		if n := len(nf.GPUs); n > 0 && nf.GPUs[n-1].Model == m {
			nf.GPUs[n-1].Count++
		} else {
			nf.GPUs = append(nf.GPUs, simulatedGPU{Model: m, Count: 1})
		}
	}
	nodeFile := filepath.Join(dir, "node.yaml")
	if err := writeYAML(nodeFile, nf); err != nil {
		return "", err
	}
	out, err := runBinary(ctx, r.PluginBin, "discover", "--backend", "simulated", "--simulated-node-file", nodeFile, "--node-name", nodeName)
	if err != nil {
		return "", err
	}
	var spec map[string]any
	if err := yaml.Unmarshal(out, &spec); err != nil {
		return "", fmt.Errorf("failed to parse the inventory printed by %s discover: %w", r.PluginBin, err)
	}
	spec["nodeName"] = nodeName
	gpuList, _ := spec["gpus"].([]any)
	inv := map[string]any{
		"apiVersion": "gpu.tessera.dev/v1alpha1",
		"kind":       "NodeInventory",
		"metadata":   map[string]any{"name": nodeName},
		"spec":       spec,
		"status": map[string]any{
			"ready":             true,
			"lastHeartbeatTime": time.Now().UTC().Format(time.RFC3339),
			"gpuCount":          len(gpuList),
		},
	}
	invFile := filepath.Join(dir, "inventory.yaml")
	if err := writeYAML(invFile, inv); err != nil {
		return "", err
	}
	if r.inventories == nil {
		r.inventories = map[string]string{}
	}
	r.inventories[nodeName] = invFile
	return invFile, nil
}

// ParseSliceList reads a JSON (or YAML) `List` of ResourceSlices, or a bare array of them.
func ParseSliceList(data []byte) ([]*resourceapi.ResourceSlice, error) {
	var list struct {
		Items []*resourceapi.ResourceSlice `json:"items"`
	}
	jsonData := bytes.TrimSpace(data)
	if len(jsonData) == 0 || (jsonData[0] != '{' && jsonData[0] != '[') {
		var err error
		if jsonData, err = yaml.YAMLToJSON(data); err != nil {
			return nil, err
		}
	}
	if len(bytes.TrimSpace(jsonData)) > 0 && bytes.TrimSpace(jsonData)[0] == '[' {
		if err := json.Unmarshal(jsonData, &list.Items); err != nil {
			return nil, err
		}
	} else if err := json.Unmarshal(jsonData, &list); err != nil {
		return nil, err
	}
	var out []*resourceapi.ResourceSlice
	for _, s := range list.Items {
		if s != nil && s.Spec.Driver == DriverName {
			out = append(out, s)
		}
	}
	return out, nil
}

func writeYAML(path string, v any) error {
	data, err := yaml.Marshal(v)
	if err != nil {
		return fmt.Errorf("failed to encode %s: %w", path, err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		return fmt.Errorf("failed to write %s: %w", path, err)
	}
	return nil
}

// shapeKey names a node shape by run-length of its GPU models, e.g. `8xH100-SXM5-80GB`.
func shapeKey(gpus []string) string {
	var b bytes.Buffer
	for i := 0; i < len(gpus); {
		j := i
		for j < len(gpus) && gpus[j] == gpus[i] {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte('+')
		}
		fmt.Fprintf(&b, "%dx%s", j-i, gpus[i])
		i = j
	}
	return b.String()
}

// sanitize makes a DNS-label-ish name from a shape key (lowercase alphanumerics and '-').
func sanitize(s string) string {
	var b bytes.Buffer
	last := byte('-')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'A' && c <= 'Z':
			c += 'a' - 'A'
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		default:
			c = '-'
		}
		if c == '-' && last == '-' {
			continue
		}
		b.WriteByte(c)
		last = c
	}
	return string(bytes.TrimRight(b.Bytes(), "-"))
}
