package e2etest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"
)

// rawClaim creates a ResourceClaim from raw JSON through the REST client: Go strings cannot hold a lone
// UTF-16 surrogate, so the hostile escapes must reach the API server as written.
func rawClaim(t *testing.T, ns, body string) {
	t.Helper()
	err := e.client.ResourceV1().RESTClient().Post().Namespace(ns).Resource("resourceclaims").
		Body([]byte(body)).Do(ctxFor(t, 30*time.Second)).Error()
	if err != nil {
		t.Fatalf("the API server refused a claim the scenario relies on it accepting: %v", err)
	}
}

// claimJSON is a one-request claim of class `class` with one opaque configuration for `drv` whose
// parameters are `params`, raw JSON.
func claimJSON(name, class, drv, params string) string {
	return fmt.Sprintf(`{"apiVersion":"resource.k8s.io/v1","kind":"ResourceClaim","metadata":{"name":%q},
"spec":{"devices":{"requests":[{"name":"gpu","exactly":{"deviceClassName":%q}}],
"config":[{"opaque":{"driver":%q,"parameters":%s}}]}}}`, name, class, drv, params)
}

// logSince is the part of a host process's log written after `offset` bytes.
func logSince(t *testing.T, name string, offset int64) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(e.runDir, "logs", name+".log"))
	if err != nil {
		t.Fatalf("read the log of %s: %v", name, err)
	}
	if offset > int64(len(data)) {
		offset = 0
	}
	return string(data[offset:])
}

func logSize(name string) int64 {
	fi, err := os.Stat(filepath.Join(e.runDir, "logs", name+".log"))
	if err != nil {
		return 0
	}
	return fi.Size()
}

// Claims the API server accepts but serde_json cannot decode — a lone surrogate, a nesting of 1,000 levels —
// in another namespace, for another driver, must not switch off any plugin's check of its records, nor
// explain; the bad claim aimed at tessera fails its own pod with a message naming the cause.
func TestHostileClaimsHarmOnlyThemselves(t *testing.T) {
	other := namespace(t, "hostile-other")
	ns := namespace(t, "hostile-own")
	class := gpuClass(t)
	node := e.nodes[0]
	plugin := "plugin-" + node

	rawClaim(t, other, claimJSON("surrogate", class, "other.example.com", `{"note":"\ud800"}`))
	rawClaim(t, other, claimJSON("deep", class, "other.example.com", `{"x":`+strings.Repeat("[", 1000)+strings.Repeat("]", 1000)+`}`))
	rawClaim(t, ns, claimJSON("bad", class, driver,
		`{"apiVersion":"gpu.tessera.dev/v1alpha1","kind":"GpuConfig","note":"\ud800"}`))

	// The plugin lists every claim at start (recovery) and every minute after; a restart makes that list
	// happen now.
	offset := logSize(plugin)
	proc(t, "stop", plugin)
	proc(t, "start", plugin)
	waitPluginRegistered(t, node, time.Now().Add(-time.Second))

	// A good pod on the same node runs: the plugin serves.
	claimTemplate(t, ns, "whole", class)
	pod(t, ns, "good", "whole", node)
	waitRunning(t, ns, "good", 2*time.Minute)

	// The bad claim's own pod: kubelet's event carries the plugin's reason, in words.
	bad := podUsing(t, ns, "bad-pod", node, v1.PodResourceClaim{Name: "gpu", ResourceClaimName: ptr.To("bad")})
	msg := waitWarning(t, bad, "surrogate", 90*time.Second)
	if !strings.Contains(msg, "surrogate") {
		t.Fatalf("the pod of the undecodable claim got no event naming the lone surrogate; last warning: %q", msg)
	}
	t.Logf("the bad claim's pod sees: %s", msg)

	log := logSince(t, plugin, offset)
	if strings.Contains(log, "cannot list ResourceClaims") {
		t.Fatalf("one undecodable claim failed the plugin's whole claim list:\n%s", lines(log, "cannot list ResourceClaims"))
	}
	for _, want := range []string{"hostile-other/surrogate", "hostile-other/deep"} {
		if !strings.Contains(log, want) {
			t.Fatalf("the plugin did not name the undecodable claim %s in its log (see %s)", want, filepath.Join(e.runDir, "logs", plugin+".log"))
		}
	}
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, "hostile-other/") && len(l) > 2000 {
			t.Fatalf("an unbounded log line about an undecodable claim (%d bytes)", len(l))
		}
	}

	// explain still answers (exit 0: fits, 1: does not fit; 2 is an error), and says what it left out.
	code, out := kubectlTessera(t, "explain", "-n", ns, "pod/good")
	if code == 2 {
		t.Fatalf("kubectl tessera explain failed on a cluster holding undecodable claims:\n%s", out)
	}
	if !strings.Contains(out, "hostile-other/deep cannot be read") {
		t.Fatalf("explain did not say which claim it could not read:\n%s", out)
	}
}

// lines is the lines of s that hold substr.
func lines(s, substr string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, substr) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
