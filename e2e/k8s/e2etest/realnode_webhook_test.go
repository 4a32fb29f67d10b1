package e2etest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The chart's ValidatingWebhookConfiguration and the Secret its webhook keeps its certificate in
// (deployments/helm/tessera/templates/webhook.yaml).
const (
	chartWebhookConfig = "tessera-claims"
	chartWebhookSecret = "tessera-webhook-tls"
)

// checkChartWebhookCertificate waits until the webhook the chart installed has made its certificate and
// put its CA into the configuration's caBundle, as the API server reads them, and returns the served
// certificate (PEM).
func checkChartWebhookCertificate(t *testing.T) string {
	t.Helper()
	var cert string
	waitFor(t, "the webhook's certificate in Secret "+chartWebhookSecret+" and its CA in "+chartWebhookConfig+"'s caBundle", 2*time.Minute, func(ctx context.Context) (bool, string) {
		s, err := e.client.CoreV1().Secrets(chartNamespace).Get(ctx, chartWebhookSecret, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		ca, crt := s.Data["ca.crt"], s.Data["tls.crt"]
		if len(ca) == 0 || len(crt) == 0 || len(s.Data["tls.key"]) == 0 {
			return false, "the Secret has no ca.crt, tls.crt or tls.key yet"
		}
		cfg, err := e.client.AdmissionregistrationV1().ValidatingWebhookConfigurations().Get(ctx, chartWebhookConfig, metav1.GetOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, w := range cfg.Webhooks {
			if !bytes.Contains(w.ClientConfig.CABundle, bytes.TrimSpace(ca)) {
				return false, "webhook " + w.Name + "'s caBundle lacks the Secret's ca.crt"
			}
		}
		cert = string(crt)
		return true, ""
	})
	return cert
}

// chartWebhookRefusesBadConfigs creates a claim of each class-independent bad config of the webhook table
// in ns and wants each refused at create by the webhook, with prepare's message; a good one is created.
func chartWebhookRefusesBadConfigs(t *testing.T, ns string) {
	t.Helper()
	shared := sharedClass(t)
	first := badConfigs[0]
	// The first create also waits for the webhook's replicas to serve.
	waitRefusedByWebhook(t, shareClaim(ns, "first", shared, first.parameters), first.message)
	for _, bc := range badConfigs {
		if bc.class != "shared" {
			continue
		}
		c := shareClaim(ns, "bad-"+bc.name, shared, bc.parameters)
		var err error
		if bc.requests != nil {
			// Judged on what the class selects, which the webhook learns from its watches.
			err = waitRefusedByWebhook(t, c, bc.message)
		} else {
			err = createClaim(ctxFor(t, 30*time.Second), c)
		}
		if err == nil || !strings.Contains(err.Error(), webhookN) || !strings.Contains(err.Error(), bc.message) {
			t.Errorf("claim with config %s: %v\nwant a refusal from the webhook with %q", bc.parameters, err, bc.message)
		}
	}
	good := `{` + gpuV1 + `,"kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"defaultActiveThreadPercentage":25}}}`
	if err := createClaim(ctxFor(t, 30*time.Second), shareClaim(ns, "good", shared, good)); err != nil {
		t.Errorf("a good config was refused: %v", err)
	}
	kubectlWarnsAboutAnotherDriversConfig(t, ns, shared)
}

// kubectlWarnsAboutAnotherDriversConfig: `kubectl create` of a claim for tessera's shared class whose
// config still names NVIDIA's driver (a spec ported from NVIDIA's quickstart) succeeds, and kubectl prints
// the webhook's admission warning, which names the foreign driver and the fix.
func kubectlWarnsAboutAnotherDriversConfig(t *testing.T, ns, class string) {
	t.Helper()
	c := shareClaim(ns, "nvidia-config", class, `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`)
	c.Spec.Devices.Config[0].Opaque.Driver = "gpu.nvidia.com"
	c.TypeMeta = metav1.TypeMeta{APIVersion: "resource.k8s.io/v1", Kind: "ResourceClaim"}
	manifest, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	cmd := kubectl(ctxFor(t, time.Minute), "create", "-f", "-")
	cmd.Stdin = bytes.NewReader(manifest)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("kubectl create of a claim with NVIDIA's config: %v\n%s%s", err, stdout.String(), stderr.String())
	}
	t.Logf("$ kubectl create -f nvidia-config.json\n%s%s", stdout.String(), stderr.String())
	warning := regexp.MustCompile(`(?m)^Warning: spec\.devices\.config\[0\]\.opaque\.driver: "gpu\.nvidia\.com" is not tessera's driver.*GpuConfig or MigConfig`)
	if !warning.MatchString(stderr.String()) {
		t.Errorf("kubectl printed no admission warning naming gpu.nvidia.com and tessera's config kinds:\n%s", stderr.String())
	}
}

// waitChartWebhookServing waits until both replicas of the chart's webhook are Ready: with failurePolicy
// Fail no claim can be created before (the plugin, waiting for its driver, may not be ready, so this is no
// `helm install --wait`).
func waitChartWebhookServing(t *testing.T) {
	t.Helper()
	waitFor(t, "the chart's two webhook replicas Ready", 3*time.Minute, func(ctx context.Context) (bool, string) {
		pods, err := podsOf(ctx, "webhook")
		if err != nil {
			return false, err.Error()
		}
		n, states := readyPods(pods)
		return n == 2, strings.Join(states, "; ")
	})
}

// The webhook's own certificate rotates under load without refusing a call for the wrong reason: with a
// 30 s validity (the shortest the webhook takes) it stages a new CA at 20 s and serves the new certificate
// 5 s later. For 50 s (one renewal with 25 s to spare) a bad claim is created four times a second; every answer must be the webhook's refusal (an x509 or "failed
// calling webhook" error would be an interruption), and the served certificate must have changed.
func TestRealNodeChartWebhookRotatesItsCertificateWithoutRefusingACall(t *testing.T) {
	rn := realNode(t)
	installChart(t, rn, "webhook.certValidity=30s")
	ns := namespace(t, "webhook-rotation")
	shared := sharedClass(t)
	bad := badConfigs[1]
	waitRefusedByWebhook(t, shareClaim(ns, "first", shared, bad.parameters), bad.message)

	served := map[string]bool{checkChartWebhookCertificate(t): true}
	calls, interrupted := 0, 0
	var lastOdd string
	end := time.Now().Add(50 * time.Second)
	nextLook := time.Now()
	for time.Now().Before(end) {
		err := createClaim(ctxFor(t, 10*time.Second), shareClaim(ns, "rotating", shared, bad.parameters))
		calls++
		if err == nil || !strings.Contains(err.Error(), webhookN) || !strings.Contains(err.Error(), bad.message) {
			interrupted++
			lastOdd = fmt.Sprint(err)
		}
		if time.Now().After(nextLook) {
			s, err := e.client.CoreV1().Secrets(chartNamespace).Get(ctxFor(t, 10*time.Second), chartWebhookSecret, metav1.GetOptions{})
			if err == nil && len(s.Data["tls.crt"]) > 0 {
				served[string(s.Data["tls.crt"])] = true
			}
			nextLook = time.Now().Add(time.Second)
		}
		time.Sleep(250 * time.Millisecond)
	}
	// The configuration trusts the certificate served at the end.
	checkChartWebhookCertificate(t)
	t.Logf("%d creates during 50 s of a 30 s certificate lifetime: %d refused by the webhook as they should be, %d otherwise; %d certificates served",
		calls, calls-interrupted, interrupted, len(served))
	if interrupted > 0 {
		t.Errorf("%d of %d calls during the rotation were not the webhook's refusal; the last: %s", interrupted, calls, lastOdd)
	}
	if len(served) < 2 {
		t.Errorf("the serving certificate never changed in 50 s of a 30 s lifetime: no rotation happened")
	}
}

func podNames(pods []v1.Pod) []string {
	names := make([]string, 0, len(pods))
	for _, p := range pods {
		names = append(names, p.Name)
	}
	return names
}

// anyNewPod: whether now holds a pod that before did not.
func anyNewPod(before, now []v1.Pod) bool {
	old := map[string]bool{}
	for _, p := range before {
		old[p.Name] = true
	}
	for _, p := range now {
		if !old[p.Name] {
			return true
		}
	}
	return false
}
