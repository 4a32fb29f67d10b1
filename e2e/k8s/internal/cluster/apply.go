package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
)

// FieldManager is the server-side-apply manager of everything the harness applies.
const FieldManager = "tessera-e2e"

// Applier applies manifests with server-side apply, like `kubectl apply --server-side`.
type Applier struct {
	// DryRun asks the API server to validate (schema, CEL, admission) without persisting.
	DryRun bool
	dyn    dynamic.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
}

func NewApplier(cfg *rest.Config) (*Applier, error) {
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("failed to create dynamic client: %w", err)
	}
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("failed to create discovery client: %w", err)
	}
	return &Applier{dyn: dyn, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))}, nil
}

// ManifestFiles expands paths (files or directories, searched recursively) into YAML/JSON files in
// lexical order.
func ManifestFiles(paths ...string) ([]string, error) {
	var files []string
	for _, p := range paths {
		info, err := os.Stat(p)
		if err != nil {
			return nil, fmt.Errorf("failed to read manifest path %s: %w", p, err)
		}
		if !info.IsDir() {
			files = append(files, p)
			continue
		}
		err = filepath.WalkDir(p, func(path string, d os.DirEntry, err error) error {
			if err != nil {
				return err
			}
			ext := filepath.Ext(path)
			if !d.IsDir() && (ext == ".yaml" || ext == ".yml" || ext == ".json") {
				files = append(files, path)
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("failed to walk %s: %w", p, err)
		}
	}
	sort.Strings(files)
	return files, nil
}

// Decode splits a multi-document YAML or JSON file into objects (a List is flattened).
func Decode(data []byte) ([]*unstructured.Unstructured, error) {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	var objs []*unstructured.Unstructured
	for {
		var raw map[string]any
		if err := dec.Decode(&raw); err != nil {
			if errors.Is(err, io.EOF) {
				return objs, nil
			}
			return nil, err
		}
		if len(raw) == 0 {
			continue
		}
		u := &unstructured.Unstructured{Object: raw}
		if u.IsList() {
			list, err := u.ToList()
			if err != nil {
				return nil, err
			}
			for i := range list.Items {
				objs = append(objs, &list.Items[i])
			}
			continue
		}
		objs = append(objs, u)
	}
}

// podSpecPaths: where each workload kind keeps the spec of the pods it makes.
var podSpecPaths = map[string][]string{
	"Pod":         {"spec"},
	"Deployment":  {"spec", "template", "spec"},
	"ReplicaSet":  {"spec", "template", "spec"},
	"StatefulSet": {"spec", "template", "spec"},
	"DaemonSet":   {"spec", "template", "spec"},
	"Job":         {"spec", "template", "spec"},
	"CronJob":     {"spec", "jobTemplate", "spec", "template", "spec"},
}

// PinToNode gives every pod the objects make the nodeSelector kubernetes.io/hostname=node, beside what the
// manifest selects already: `make up` runs the examples on its real node, where their containers run.
func PinToNode(objs []*unstructured.Unstructured, node string) error {
	for _, o := range objs {
		path, ok := podSpecPaths[o.GetKind()]
		if !ok {
			continue
		}
		field := append(append([]string{}, path...), "nodeSelector", "kubernetes.io/hostname")
		if err := unstructured.SetNestedField(o.Object, node, field...); err != nil {
			return fmt.Errorf("failed to pin %s %s to node %s: %w", o.GetKind(), o.GetName(), node, err)
		}
	}
	return nil
}

// ReadManifests decodes every object of the given files.
func ReadManifests(files ...string) ([]*unstructured.Unstructured, error) {
	var all []*unstructured.Unstructured
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("failed to read %s: %w", f, err)
		}
		objs, err := Decode(data)
		if err != nil {
			return nil, fmt.Errorf("failed to parse %s: %w", f, err)
		}
		for _, o := range objs {
			if o.GetAnnotations() == nil {
				o.SetAnnotations(map[string]string{})
			}
			ann := o.GetAnnotations()
			ann["e2e.tessera.dev/source"] = f
			o.SetAnnotations(ann)
		}
		all = append(all, objs...)
	}
	return all, nil
}

// kindOrder applies what others depend on first.
func kindOrder(u *unstructured.Unstructured) int {
	switch u.GetKind() {
	case "Namespace":
		return 0
	case "CustomResourceDefinition":
		return 1
	case "ServiceAccount", "ConfigMap", "Secret", "DeviceClass":
		return 2
	case "ResourceClaimTemplate", "ResourceClaim":
		return 3
	case "Pod", "Deployment", "Job", "StatefulSet", "DaemonSet", "ReplicaSet":
		return 5
	default:
		return 4
	}
}

// Apply server-side-applies objects in dependency order; CRDs are waited for until Established so
// that custom resources in the same batch can be mapped.
func (a *Applier) Apply(ctx context.Context, objs []*unstructured.Unstructured, defaultNamespace string) error {
	sorted := append([]*unstructured.Unstructured{}, objs...)
	sort.SliceStable(sorted, func(i, j int) bool { return kindOrder(sorted[i]) < kindOrder(sorted[j]) })
	var crds []string
	for i, obj := range sorted {
		if i > 0 && kindOrder(sorted[i-1]) <= 1 && kindOrder(obj) > 1 && len(crds) > 0 && !a.DryRun {
			if err := a.waitEstablished(ctx, crds); err != nil {
				return err
			}
			crds = nil
		}
		if err := a.ApplyOne(ctx, obj, defaultNamespace); err != nil {
			return err
		}
		if obj.GetKind() == "CustomResourceDefinition" {
			crds = append(crds, obj.GetName())
		}
	}
	if len(crds) > 0 && !a.DryRun {
		return a.waitEstablished(ctx, crds)
	}
	return nil
}

func (a *Applier) resource(obj *unstructured.Unstructured, defaultNamespace string) (dynamic.ResourceInterface, error) {
	gvk := obj.GroupVersionKind()
	mapping, err := a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if err != nil {
		// A CRD applied a moment ago may not be in the cached discovery yet.
		a.mapper.Reset()
		mapping, err = a.mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			return nil, fmt.Errorf("failed to map %s: %w", gvk, err)
		}
	}
	if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
		ns := obj.GetNamespace()
		if ns == "" {
			ns = defaultNamespace
			obj.SetNamespace(ns)
		}
		return a.dyn.Resource(mapping.Resource).Namespace(ns), nil
	}
	return a.dyn.Resource(mapping.Resource), nil
}

// ApplyOne applies a single object; the error names the object and where it came from.
func (a *Applier) ApplyOne(ctx context.Context, obj *unstructured.Unstructured, defaultNamespace string) error {
	ri, err := a.resource(obj, defaultNamespace)
	if err != nil {
		return fmt.Errorf("%s: %w", Describe(obj), err)
	}
	opts := metav1.ApplyOptions{FieldManager: FieldManager, Force: true}
	if a.DryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	if _, err := ri.Apply(ctx, obj.GetName(), obj, opts); err != nil {
		return fmt.Errorf("failed to apply %s: %w", Describe(obj), err)
	}
	return nil
}

// Delete deletes objects (ignoring ones already gone) with foreground propagation off: pods go through
// the kubelet stand-in's graceful path.
func (a *Applier) Delete(ctx context.Context, objs []*unstructured.Unstructured, defaultNamespace string) error {
	for i := len(objs) - 1; i >= 0; i-- {
		ri, err := a.resource(objs[i], defaultNamespace)
		if err != nil {
			return err
		}
		if err := ri.Delete(ctx, objs[i].GetName(), metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("failed to delete %s: %w", Describe(objs[i]), err)
		}
	}
	return nil
}

func (a *Applier) waitEstablished(ctx context.Context, names []string) error {
	gvr := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	for _, name := range names {
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
			u, err := a.dyn.Resource(gvr).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, nil
			}
			var crd apiextensionsv1.CustomResourceDefinition
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &crd); err != nil {
				return false, err
			}
			for _, c := range crd.Status.Conditions {
				if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
					return true, nil
				}
			}
			return false, nil
		})
		if err != nil {
			return fmt.Errorf("CRD %s not Established: %w", name, err)
		}
	}
	a.mapper.Reset()
	return nil
}

// Describe names an object for messages: Kind ns/name (from file).
func Describe(obj *unstructured.Unstructured) string {
	name := obj.GetName()
	if ns := obj.GetNamespace(); ns != "" {
		name = ns + "/" + name
	}
	s := obj.GetKind() + " " + name
	if src := obj.GetAnnotations()["e2e.tessera.dev/source"]; src != "" {
		s += " (" + src + ")"
	}
	return s
}
