package cluster

import (
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// chartRBAC renders the chart's templates/rbac.yaml with the Helm e2e/scripts/build-helm.sh builds.
func chartRBAC(t *testing.T) []*unstructured.Unstructured {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "..", "..", "..", "..")
	helm := filepath.Join(root, "e2e", "bin", "helm")
	if out, err := exec.Command(filepath.Join(root, "e2e", "scripts", "build-helm.sh")).CombinedOutput(); err != nil {
		t.Fatalf("build-helm.sh: %v\n%s", err, out)
	}
	out, err := exec.Command(helm, "template", "tessera", filepath.Join(root, "deployments", "helm", "tessera"),
		"--namespace", "tessera-system", "--show-only", "templates/rbac.yaml").Output()
	if err != nil {
		t.Fatalf("helm template: %v", err)
	}
	objs, err := Decode(out)
	if err != nil {
		t.Fatal(err)
	}
	return objs
}

func TestTheHostIdentitiesGetTheChartsRolesUnderTheirOwnNames(t *testing.T) {
	chart := chartRBAC(t)
	objs, err := HostRBAC(chart, "tessera-system", "tessera-controller", []string{"tessera-plugin-a", "tessera-plugin-b"})
	if err != nil {
		t.Fatal(err)
	}
	rules := map[string]any{}
	for _, o := range chart {
		rules[o.GetKind()+"/"+o.GetName()] = o.Object["rules"]
	}
	subjects := map[string][]string{}
	for _, o := range objs {
		if !strings.HasPrefix(o.GetName(), HostRolePrefix) {
			t.Errorf("%s %s is not under the %s prefix", o.GetKind(), o.GetName(), HostRolePrefix)
		}
		if k := o.GetKind(); (k == "Role" || k == "RoleBinding") && o.GetNamespace() != "tessera-system" {
			t.Errorf("%s %s in namespace %q, want the lease namespace tessera-system", k, o.GetName(), o.GetNamespace())
		}
		switch o.GetKind() {
		case "ClusterRole", "Role":
			// The chart's rules, unchanged: the host processes may do exactly what the chart's pods may.
			if got, want := o.Object["rules"], rules[o.GetKind()+"/"+strings.TrimPrefix(o.GetName(), HostRolePrefix)]; !reflect.DeepEqual(got, want) {
				t.Errorf("%s %s rules %v, want the chart's %v", o.GetKind(), o.GetName(), got, want)
			}
		case "ClusterRoleBinding", "RoleBinding":
			list, _, _ := unstructured.NestedSlice(o.Object, "subjects")
			for _, s := range list {
				m := s.(map[string]any)
				if m["kind"] != "User" {
					t.Errorf("%s %s binds a %v, want only users", o.GetKind(), o.GetName(), m["kind"])
				}
				subjects[o.GetName()] = append(subjects[o.GetName()], m["name"].(string))
			}
		}
	}
	want := map[string]string{
		HostRolePrefix + "tessera-kubelet-plugin":             "tessera-plugin-a,tessera-plugin-b",
		HostRolePrefix + "tessera-kubelet-plugin-leases":      "tessera-plugin-a,tessera-plugin-b",
		HostRolePrefix + "tessera-controller":                 "tessera-controller",
		HostRolePrefix + "tessera-controller-leader-election": "tessera-controller",
	}
	for name, users := range want {
		if got := strings.Join(subjects[name], ","); got != users {
			t.Errorf("%s binds %q, want %q", name, got, users)
		}
	}
}

func TestAChartWithoutTheControllersRoleIsRefusedNamingIt(t *testing.T) {
	var chart []*unstructured.Unstructured
	for _, o := range chartRBAC(t) {
		if o.GetName() != "tessera-controller" || o.GetKind() != "ClusterRole" {
			chart = append(chart, o)
		}
	}
	_, err := HostRBAC(chart, "tessera-system", "tessera-controller", nil)
	if err == nil || !strings.Contains(err.Error(), "ClusterRole tessera-controller") {
		t.Fatalf("got %v, want an error naming ClusterRole tessera-controller", err)
	}
}
