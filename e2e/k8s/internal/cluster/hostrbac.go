package cluster

import (
	"fmt"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// HostRolePrefix renames the chart's roles for the host processes, so a `helm install` of the chart in the
// same cluster (the real-node scenarios) neither collides with them nor takes them away on uninstall.
const HostRolePrefix = "e2e-host-"

// The chart's roles (deployments/helm/tessera/templates/rbac.yaml) the host processes are bound to.
const (
	chartPluginRole      = "tessera-kubelet-plugin"
	chartPluginLeaseRole = "tessera-kubelet-plugin-leases"
	chartControllerRole  = "tessera-controller"
	chartLeaderRole      = "tessera-controller-leader-election"
)

// HostRBAC turns the chart's rendered RBAC into what `make up`'s host processes run with: the chart's
// ClusterRoles and its Roles in the release namespace (the controller's leader election, the plugins'
// heartbeat Leases) under HostRolePrefix names, bound to the controller's user and to each stand-in
// plugin's user. Their tokens carry no group, so these roles are all they may do. namespace must be the
// one the host controller and plugins are given as their lease namespace.
func HostRBAC(chart []*unstructured.Unstructured, namespace, controllerUser string, pluginUsers []string) ([]*unstructured.Unstructured, error) {
	roles := map[string]*unstructured.Unstructured{}
	for _, o := range chart {
		if o.GetKind() == "ClusterRole" || o.GetKind() == "Role" {
			roles[o.GetKind()+"/"+o.GetName()] = o
		}
	}
	var out []*unstructured.Unstructured
	bind := func(kind, name string, users []string) error {
		role, ok := roles[kind+"/"+name]
		if !ok {
			return fmt.Errorf("the chart's RBAC has no %s %s (deployments/helm/tessera/templates/rbac.yaml renamed it?)", kind, name)
		}
		role = role.DeepCopy()
		role.SetName(HostRolePrefix + name)
		role.SetLabels(map[string]string{"app.kubernetes.io/part-of": "tessera-e2e"})
		role.SetAnnotations(nil)
		bindingKind := "ClusterRoleBinding"
		if kind == "Role" {
			role.SetNamespace(namespace)
			bindingKind = "RoleBinding"
		}
		var subjects []any
		for _, u := range users {
			subjects = append(subjects, map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": u})
		}
		binding := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "rbac.authorization.k8s.io/v1",
			"kind":       bindingKind,
			"metadata":   map[string]any{"name": HostRolePrefix + name, "labels": map[string]any{"app.kubernetes.io/part-of": "tessera-e2e"}},
			"roleRef":    map[string]any{"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": HostRolePrefix + name},
			"subjects":   subjects,
		}}
		if kind == "Role" {
			binding.SetNamespace(namespace)
		}
		out = append(out, role, binding)
		return nil
	}
	if len(pluginUsers) > 0 {
		if err := bind("ClusterRole", chartPluginRole, pluginUsers); err != nil {
			return nil, err
		}
		if err := bind("Role", chartPluginLeaseRole, pluginUsers); err != nil {
			return nil, err
		}
	}
	if err := bind("ClusterRole", chartControllerRole, []string{controllerUser}); err != nil {
		return nil, err
	}
	if err := bind("Role", chartLeaderRole, []string{controllerUser}); err != nil {
		return nil, err
	}
	return out, nil
}
