// Package liveresize applies what `kubectl tessera rightsize` prints the way its user would (issue 39
// item 5's live run): the resized ResourceClaimTemplate it writes on stdout is created, and the
// Deployment is pointed at it by the JSON patch it names on stderr, a rollout the Deployment's strategy
// makes make-before-break (MakeBeforeBreak). The fleet benchmark's live loop
// (e2e/k8s/e2etest/fleet_sized_test.go) runs the built binary against the run's Prometheus on
// fleetsim's schedule; this package is the part that needs no cluster, tested here.
package liveresize

import (
	"encoding/json"
	"fmt"
	"regexp"

	jsonpatch "gopkg.in/evanphx/json-patch.v4"
	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/intstr"

	"tessera.dev/e2e/internal/fleetsim"
)

// patchLine is rightsize's "apply:" hint for the Deployment: `kubectl patch deployment NAME -n NS
// --type json -p '<RFC 6902 patch>'`.
var patchLine = regexp.MustCompile(`kubectl patch deployment (\S+) -n (\S+) --type json -p '(\[[^']*\])'`)

// DeploymentPatch is the JSON patch rightsize's stderr tells its user to apply to the Deployment, and
// the Deployment it names.
func DeploymentPatch(stderr string) (deployment, namespace string, patch []byte, err error) {
	m := patchLine.FindStringSubmatch(stderr)
	if m == nil {
		return "", "", nil, fmt.Errorf("rightsize's stderr names no `kubectl patch deployment … --type json -p '…'` to apply:\n%s", stderr)
	}
	if _, err := jsonpatch.DecodePatch([]byte(m[3])); err != nil {
		return "", "", nil, fmt.Errorf("rightsize's Deployment patch %s is not an RFC 6902 patch: %w", m[3], err)
	}
	return m[1], m[2], []byte(m[3]), nil
}

// Apply applies an RFC 6902 patch to a Deployment, as the API server does for `kubectl patch --type json`.
func Apply(d *appsv1.Deployment, patch []byte) (*appsv1.Deployment, error) {
	p, err := jsonpatch.DecodePatch(patch)
	if err != nil {
		return nil, fmt.Errorf("decode patch: %w", err)
	}
	doc, err := json.Marshal(d)
	if err != nil {
		return nil, err
	}
	out, err := p.Apply(doc)
	if err != nil {
		return nil, fmt.Errorf("apply %s to deployment %s/%s: %w", patch, d.Namespace, d.Name, err)
	}
	var nd appsv1.Deployment
	if err := json.Unmarshal(out, &nd); err != nil {
		return nil, err
	}
	return &nd, nil
}

// Template is the resized ResourceClaimTemplate rightsize prints on stdout (-o template), as the API
// object to create, and the share it asks for.
type Template struct {
	Object map[string]any
	Name   string
	Share  fleetsim.Recommendation
}

// ParseTemplate reads rightsize's stdout: the template's name, its first request's compute and memory
// capacity, and the MPS ceiling (sharing.mps.computeCeiling) of the tessera config entry that sets one.
func ParseTemplate(stdout []byte) (Template, error) {
	var t struct {
		Metadata struct {
			Name string `json:"name"`
		} `json:"metadata"`
		Spec struct {
			Spec struct {
				Devices struct {
					Requests []struct {
						Exactly struct {
							Capacity struct {
								Requests map[string]string `json:"requests"`
							} `json:"capacity"`
						} `json:"exactly"`
					} `json:"requests"`
					Config []struct {
						Opaque struct {
							Parameters struct {
								Sharing struct {
									MPS struct {
										ComputeCeiling int `json:"computeCeiling"`
									} `json:"mps"`
								} `json:"sharing"`
							} `json:"parameters"`
						} `json:"opaque"`
					} `json:"config"`
				} `json:"devices"`
			} `json:"spec"`
		} `json:"spec"`
	}
	if err := json.Unmarshal(stdout, &t); err != nil {
		return Template{}, fmt.Errorf("rightsize's stdout is not a ResourceClaimTemplate: %w", err)
	}
	reqs := t.Spec.Spec.Devices.Requests
	if t.Metadata.Name == "" || len(reqs) == 0 {
		return Template{}, fmt.Errorf("rightsize's template has no metadata.name or no spec.spec.devices.requests")
	}
	capReqs := reqs[0].Exactly.Capacity.Requests
	compute, err := resource.ParseQuantity(capReqs["compute"])
	if err != nil {
		return Template{}, fmt.Errorf("template %s: capacity.requests.compute %q: %w", t.Metadata.Name, capReqs["compute"], err)
	}
	mem, err := resource.ParseQuantity(capReqs["memory"])
	if err != nil {
		return Template{}, fmt.Errorf("template %s: capacity.requests.memory %q: %w", t.Metadata.Name, capReqs["memory"], err)
	}
	share := fleetsim.Recommendation{RequestPercent: int(compute.Value()), MemoryBytes: mem.Value()}
	for _, c := range t.Spec.Spec.Devices.Config {
		if c := c.Opaque.Parameters.Sharing.MPS.ComputeCeiling; c > 0 {
			share.CeilingPercent = c
		}
	}
	if share.CeilingPercent == 0 {
		return Template{}, fmt.Errorf("template %s sets no sharing.mps.computeCeiling", t.Metadata.Name)
	}
	var obj map[string]any
	if err := json.Unmarshal(stdout, &obj); err != nil {
		return Template{}, err
	}
	return Template{Object: obj, Name: t.Metadata.Name, Share: share}, nil
}

// MakeBeforeBreak makes a Deployment's rollouts start each new pod before stopping an old one (the
// model's replacement: the old replica serves until the new is Ready), and count a new pod available
// only after minReady (the engine's start, which a pod without a readiness probe does not show).
func MakeBeforeBreak(d *appsv1.Deployment, minReadySeconds int32) {
	zero, one := intstr.FromInt32(0), intstr.FromInt32(1)
	d.Spec.Strategy = appsv1.DeploymentStrategy{Type: appsv1.RollingUpdateDeploymentStrategyType,
		RollingUpdate: &appsv1.RollingUpdateDeployment{MaxUnavailable: &zero, MaxSurge: &one}}
	d.Spec.MinReadySeconds = minReadySeconds
}
