package e2etest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"tessera.dev/e2e/internal/cluster"
)

// webhookProc is a running `tessera-controller webhook` on 127.0.0.1.
type webhookProc struct {
	cmd  *exec.Cmd
	url  string
	ca   []byte
	done chan struct{}
}

func controllerBin() string {
	if b := os.Getenv("CONTROLLER_BIN"); b != "" {
		return b
	}
	return filepath.Join(getenv("CARGO_TARGET_DIR", filepath.Join(e.repoRoot, "target")), "debug", "tessera-controller")
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startWebhook runs the webhook with a serving certificate for 127.0.0.1 from a CA of its own, reading
// DeviceClasses and slices as the admin, and waits until it serves /healthz.
func startWebhook(t *testing.T) *webhookProc {
	t.Helper()
	dir := t.TempDir()
	cert, err := cluster.WriteServingCert(dir, "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	log, err := os.Create(filepath.Join(e.runDir, "logs", fmt.Sprintf("webhook-%d.log", port)))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(controllerBin(), "webhook",
		"--listen", fmt.Sprintf("127.0.0.1:%d", port),
		"--tls-cert-file", cert.CertFile, "--tls-key-file", cert.KeyFile,
		"--kubeconfig", filepath.Join(e.runDir, "pki", "admin.kubeconfig"))
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Env = append(os.Environ(), "RUST_LOG=info")
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", controllerBin(), err)
	}
	w := &webhookProc{cmd: cmd, url: fmt.Sprintf("https://127.0.0.1:%d/validate", port), ca: cert.CAPEM, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(w.done); log.Close() }()
	t.Cleanup(w.stop)

	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(cert.CAPEM)
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	err = wait.PollUntilContextTimeout(ctxFor(t, time.Minute), 200*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		select {
		case <-w.done:
			return false, fmt.Errorf("the webhook exited (log: %s)", log.Name())
		default:
		}
		resp, err := client.Get(fmt.Sprintf("https://127.0.0.1:%d/healthz", port))
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
	if err != nil {
		t.Fatalf("webhook not serving /healthz: %v", err)
	}
	return w
}

func (w *webhookProc) stop() {
	select {
	case <-w.done:
		return
	default:
	}
	_ = w.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-w.done:
	case <-time.After(5 * time.Second):
		_ = w.cmd.Process.Kill()
		<-w.done
	}
}

// registerWebhook creates the chart's ValidatingWebhookConfiguration (deployments/helm/tessera,
// templates/webhook.yaml, as helm renders it), pointed at url and limited to namespace ns so the other
// scenarios' deliberately bad claims are not judged.
func registerWebhook(t *testing.T, ns, url string, ca []byte, policy admissionv1.FailurePolicyType) string {
	t.Helper()
	var cfg admissionv1.ValidatingWebhookConfiguration
	rendered := findObject(t, renderChart(t, helmBinary(t)), "ValidatingWebhookConfiguration", chartWebhookConfig)
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(rendered.Object, &cfg); err != nil {
		t.Fatalf("the chart's ValidatingWebhookConfiguration: %v", err)
	}
	if len(cfg.Webhooks) != 1 {
		t.Fatalf("the chart's ValidatingWebhookConfiguration has %d webhooks, want 1", len(cfg.Webhooks))
	}
	cfg.ObjectMeta = metav1.ObjectMeta{}
	cfg.Name = "e2e-" + ns
	wh := &cfg.Webhooks[0]
	wh.ClientConfig = admissionv1.WebhookClientConfig{URL: ptr.To(url), CABundle: ca}
	wh.FailurePolicy = ptr.To(policy)
	wh.NamespaceSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": ns}}
	api := e.client.AdmissionregistrationV1().ValidatingWebhookConfigurations()
	if _, err := api.Create(ctxFor(t, 30*time.Second), &cfg, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create ValidatingWebhookConfiguration: %v", err)
	}
	t.Cleanup(func() {
		_ = api.Delete(context.Background(), cfg.Name, metav1.DeleteOptions{})
	})
	return cfg.Name
}

func setFailurePolicy(t *testing.T, name string, policy admissionv1.FailurePolicyType) {
	t.Helper()
	api := e.client.AdmissionregistrationV1().ValidatingWebhookConfigurations()
	cur, err := api.Get(ctxFor(t, 30*time.Second), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cur.Webhooks[0].FailurePolicy = ptr.To(policy)
	if _, err := api.Update(ctxFor(t, 30*time.Second), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// shareClaim is a ResourceClaim of one request "gpu" with one opaque tessera config.
func shareClaim(ns, name, class, parameters string, requests ...string) *resourcev1.ResourceClaim {
	return &resourcev1.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{{Name: "gpu", Exactly: &resourcev1.ExactDeviceRequest{
				DeviceClassName: class, AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: 1,
			}}},
			Config: []resourcev1.DeviceClaimConfiguration{{
				Requests: requests,
				DeviceConfiguration: resourcev1.DeviceConfiguration{Opaque: &resourcev1.OpaqueDeviceConfiguration{
					Driver: driver, Parameters: runtime.RawExtension{Raw: []byte(parameters)},
				}},
			}},
		}},
	}
}

func createClaim(ctx context.Context, c *resourcev1.ResourceClaim) error {
	_, err := e.client.ResourceV1().ResourceClaims(c.Namespace).Create(ctx, c, metav1.CreateOptions{})
	return err
}

// waitRefusedByWebhook creates c until the API server calls the webhook for it (a new configuration takes
// the API server a moment to load) and returns the refusal; a create that succeeds first is a failure.
func waitRefusedByWebhook(t *testing.T, c *resourcev1.ResourceClaim, why string) error {
	t.Helper()
	var refusal error
	err := wait.PollUntilContextTimeout(ctxFor(t, time.Minute), 250*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		err := createClaim(ctx, c)
		if err == nil {
			_ = e.client.ResourceV1().ResourceClaims(c.Namespace).Delete(ctx, c.Name, metav1.DeleteOptions{})
			return false, nil
		}
		if strings.Contains(err.Error(), why) {
			refusal = err
			return true, nil
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("claim %s was never refused with %q", c.Name, why)
	}
	return refusal
}

const (
	gpuV1    = `"apiVersion":"gpu.tessera.dev/v1alpha1"`
	webhookN = `admission webhook "claims.gpu.tessera.dev" denied the request`
)

// Each bad config of the invalid-config scenario and the api crate's validation tests, with the message
// prepare gives for it.
var badConfigs = []struct {
	name, class, parameters, message string
	requests                         []string
}{
	{"strategy", "shared", `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"NotAStrategy"}}`,
		`spec.devices.config[0].opaque.parameters: sharing.strategy: must be one of MPS, TimeSlicing, got "NotAStrategy"`, nil},
	{"percentage", "shared", `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"defaultActiveThreadPercentage":150}}}`,
		`spec.devices.config[0].opaque.parameters: sharing.mps.defaultActiveThreadPercentage: must be between 1 and 100, got 150`, nil},
	{"typo", "shared", `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"defaultActiveThreadPercent":50}}}`,
		`spec.devices.config[0].opaque.parameters: sharing.mps: unknown field "defaultActiveThreadPercent"; allowed fields: defaultActiveThreadPercentage, defaultPinnedDeviceMemoryLimit, perDevicePinnedMemoryLimit`, nil},
	{"zero-memory", "shared", `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"defaultPinnedDeviceMemoryLimit":"0"}}}`,
		`spec.devices.config[0].opaque.parameters: sharing.mps.defaultPinnedDeviceMemoryLimit: must be at least 1Mi, got "0"`, nil},
	{"bad-quantity", "shared", `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"defaultPinnedDeviceMemoryLimit":"10Gb"}}}`,
		`spec.devices.config[0].opaque.parameters: sharing.mps.defaultPinnedDeviceMemoryLimit: invalid quantity "10Gb"`, nil},
	{"device-key", "shared", `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"perDevicePinnedMemoryLimit":{"gpu-one":"20Gi"}}}}`,
		`spec.devices.config[0].opaque.parameters: sharing.mps.perDevicePinnedMemoryLimit: key "gpu-one" is not a tessera device name`, nil},
	{"api-version", "shared", `{"apiVersion":"gpu.tessera.dev/v1","kind":"GpuConfig"}`,
		`spec.devices.config[0].opaque.parameters: apiVersion: must be "gpu.tessera.dev/v1alpha1", got "gpu.tessera.dev/v1"`, nil},
	{"mps-with-timeslicing", "shared", `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","mps":{}}}`,
		`spec.devices.config[0].opaque.parameters: sharing.mps: only allowed with strategy MPS, got TimeSlicing`, nil},
	{"timeslicing-on-mps-share", "shared", `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"TimeSlicing"}}`,
		`spec.devices.config[0].opaque.parameters.sharing.strategy: request "gpu" gets devices of DeviceClass`, []string{"gpu"}},
	{"timeslicing-on-mig", "mig", `{` + gpuV1 + `,"kind":"MigConfig","sharing":{"strategy":"TimeSlicing","timeSlicing":{"interval":"Short"}}}`,
		`spec.devices.config[0].opaque.parameters: sharing.timeSlicing: MIG devices have no time-slice setting; remove it or use GpuConfig`, nil},
	{"mig-config-on-whole-gpu", "gpu", `{` + gpuV1 + `,"kind":"MigConfig"}`,
		`spec.devices.config[0]: request "gpu" gets devices of DeviceClass "e2e-gpu", which offers only devices such as gpu-`, []string{"gpu"}},
}

// The webhook registered with the real API server refuses each bad config at create, with prepare's
// message, for claims and templates; a good one is created and its pod runs.
func TestTheWebhookRefusesBadConfigsAtCreateWithPreparesMessage(t *testing.T) {
	ns := namespace(t, "e2e-webhook")
	classes := map[string]string{"gpu": gpuClass(t), "mig": mig3gClass(t), "shared": sharedClass(t)}
	w := startWebhook(t)
	registerWebhook(t, ns, w.url, w.ca, admissionv1.Fail)

	// The first refusal also waits for the API server to load the configuration.
	first := badConfigs[0]
	waitRefusedByWebhook(t, shareClaim(ns, "first", classes[first.class], first.parameters), first.message)

	for _, bc := range badConfigs {
		t.Run(bc.name, func(t *testing.T) {
			ctx := ctxFor(t, 30*time.Second)
			c := shareClaim(ns, "bad-"+bc.name, classes[bc.class], bc.parameters, bc.requests...)
			var err error
			if bc.requests != nil {
				// What the class offers is known once the webhook has listed DeviceClasses and slices,
				// which it does after it starts serving.
				err = waitRefusedByWebhook(t, c, bc.message)
			} else if err = createClaim(ctx, c); err == nil {
				t.Fatalf("claim with config %s was created", bc.parameters)
			}
			t.Logf("refused: %v", err)
			if !strings.Contains(err.Error(), webhookN) || !strings.Contains(err.Error(), bc.message) {
				t.Errorf("refusal %q\nwant it from the webhook with %q", err, bc.message)
			}
			if _, err := e.client.ResourceV1().ResourceClaims(ns).Get(ctx, "bad-"+bc.name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				t.Errorf("refused claim exists: %v", err)
			}
		})
	}

	t.Run("template", func(t *testing.T) {
		c := shareClaim(ns, "bad-template", classes["shared"], badConfigs[1].parameters)
		tmpl := &resourcev1.ResourceClaimTemplate{
			ObjectMeta: c.ObjectMeta,
			Spec:       resourcev1.ResourceClaimTemplateSpec{Spec: c.Spec},
		}
		_, err := e.client.ResourceV1().ResourceClaimTemplates(ns).Create(ctxFor(t, 30*time.Second), tmpl, metav1.CreateOptions{})
		want := strings.Replace(badConfigs[1].message, "spec.devices", "spec.spec.devices", 1)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("template with a bad config: %v, want a refusal with %q", err, want)
		}
	})

	t.Run("good config", func(t *testing.T) {
		good := `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"defaultActiveThreadPercentage":25,"defaultPinnedDeviceMemoryLimit":"10Gi"}}}`
		claimTemplate(t, ns, "good", classes["shared"], capacity(map[string]string{"memory": "10Gi", "compute": "25"}), opaqueConfig(good))
		p := pod(t, ns, "good", "good", "")
		waitRunning(t, ns, p.Name, 90*time.Second)
	})
}

// With the webhook down, failurePolicy Ignore lets a claim through unchecked and Fail refuses it.
func TestTheWebhookDownLetsClaimsThroughWithIgnoreAndRefusesThemWithFail(t *testing.T) {
	ns := namespace(t, "e2e-webhook-down")
	class := sharedClass(t)
	w := startWebhook(t)
	name := registerWebhook(t, ns, w.url, w.ca, admissionv1.Ignore)
	bad := badConfigs[1]
	waitRefusedByWebhook(t, shareClaim(ns, "while-up", class, bad.parameters), bad.message)

	w.stop()
	err := wait.PollUntilContextTimeout(ctxFor(t, time.Minute), 250*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		return createClaim(ctx, shareClaim(ns, "while-down", class, bad.parameters)) == nil, nil
	})
	if err != nil {
		t.Fatalf("with the webhook down and failurePolicy Ignore, the claim was never created")
	}

	setFailurePolicy(t, name, admissionv1.Fail)
	refusal := waitRefusedByWebhook(t, shareClaim(ns, "while-down-fail", class, bad.parameters), `failed calling webhook "claims.gpu.tessera.dev"`)
	t.Logf("refused: %v", refusal)
}
