package main

import (
	"encoding/json"
	"testing"
)

func TestRenderedListsAreReadAndCopiedOntoEachNode(t *testing.T) {
	tmpl := fixtureNode("shape-1xh100", 1, fixtureMIG).build()
	data, err := json.Marshal(map[string]any{"apiVersion": "v1", "kind": "List", "items": tmpl})
	if err != nil {
		t.Fatal(err)
	}
	parsed, err := ParseSliceList(data)
	if err != nil {
		t.Fatal(err)
	}
	if len(parsed) != len(tmpl) {
		t.Fatalf("read %d slices, want %d", len(parsed), len(tmpl))
	}
	ns := ForNode(parsed, "openb-node-0007")
	for _, s := range ns.Slices {
		if s.Spec.Pool.Name != "openb-node-0007" || s.Spec.NodeName == nil || *s.Spec.NodeName != "openb-node-0007" {
			t.Errorf("slice %s: pool %q nodeName %v, want both openb-node-0007", s.Name, s.Spec.Pool.Name, s.Spec.NodeName)
		}
	}
	if parsed[0].Spec.Pool.Name != "shape-1xh100" {
		t.Errorf("copying changed the template's pool to %q", parsed[0].Spec.Pool.Name)
	}
}

func TestShapeKeysRunLengthTheModels(t *testing.T) {
	got := shapeKey([]string{"H100-SXM5-80GB", "H100-SXM5-80GB", "A100-SXM4-80GB"})
	if got != "2xH100-SXM5-80GB+1xA100-SXM4-80GB" {
		t.Errorf("shape key %q", got)
	}
	if s := sanitize(got); s != "2xh100-sxm5-80gb-1xa100-sxm4-80gb" {
		t.Errorf("sanitized %q", s)
	}
}
