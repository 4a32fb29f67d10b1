package e2etest

// Issue 26 item 3: device metadata (KEP-5304). The plugin writes, per request of a prepared claim, the file
// upstream's readers look for under /var/run/kubernetes.io/dra-device-attributes and mounts it through the
// claim's CDI spec; a container on the real node reads it, and the harness decodes what `kubectl logs`
// shows with upstream's own decoder (k8s.io/dynamic-resource-allocation/devicemetadata), validation on.

import (
	"context"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

const metadataDir = "/var/run/kubernetes.io/dra-device-attributes"

// metadataFiles splits the output of metadataListing into its files' contents by path (relative to
// metadataDir), and returns what followed them.
func metadataFiles(logs string) (map[string]string, string) {
	files := map[string]string{}
	var path string
	var body, rest []string
	for _, line := range strings.Split(logs, "\n") {
		switch {
		case strings.HasPrefix(line, "== ./"):
			path, body = strings.TrimPrefix(line, "== ./"), nil
		case line == "== end" && path != "":
			files[path] = strings.Join(body, "\n")
			path = ""
		case path != "":
			body = append(body, line)
		default:
			rest = append(rest, line)
		}
	}
	return files, strings.Join(rest, "\n")
}

// metadataListing prints every metadata file the container sees, each between "== ./<path>" and "== end",
// then nvidia-smi -L.
const metadataListing = `cd ` + metadataDir + ` && for f in $(find . -type f | sort); do echo "== $f"; cat "$f"; echo "== end"; done; nvidia-smi -L`

func metadataString(d metadataDevice, name string) string {
	if a, ok := d.Attributes[resourcev1.QualifiedName(name)]; ok && a.StringValue != nil {
		return *a.StringValue
	}
	return ""
}

// checkJobReadsItsDeviceMetadata: a Job on the real node with a whole GPU from a template (pod claim
// "gpu") and a 1g MIG device from a claim it names ("meta-mig", request "gpu") reads one file per claim:
// the template's under resourceclaimtemplates/gpu/, the named one under resourceclaims/meta-mig/. Each
// decodes with upstream's decoder, validates, names its claim (name, UID, the pod's claim name), the
// request and the device; the whole GPU's attributes are its slice's (uuid, pciBusID) and its uuid is the
// GPU nvidia-smi lists; the MIG device's `migUUID` is the MIG device nvidia-smi lists.
func checkJobReadsItsDeviceMetadata(t *testing.T, ns, template, node string) {
	t.Helper()
	mig := &resourcev1.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "meta-mig", Namespace: ns},
		Spec: resourcev1.ResourceClaimSpec{Devices: resourcev1.DeviceClaim{
			Requests: []resourcev1.DeviceRequest{{Name: "gpu", Exactly: &resourcev1.ExactDeviceRequest{
				DeviceClassName: mig1gClass(t), AllocationMode: resourcev1.DeviceAllocationModeExactCount, Count: 1,
				Selectors: []resourcev1.DeviceSelector{{CEL: &resourcev1.CELDeviceSelector{
					Expression: fmt.Sprintf(`device.attributes[%q].profile == "1g.10gb"`, driver)}}},
			}}},
		}},
	}
	created, err := e.client.ResourceV1().ResourceClaims(ns).Create(ctxFor(t, 30*time.Second), mig, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create claim %s/%s: %v", ns, mig.Name, err)
	}
	t.Cleanup(func() {
		_ = e.client.ResourceV1().ResourceClaims(ns).Delete(context.Background(), mig.Name, metav1.DeleteOptions{})
	})
	logs := runJob(t, ns, "metadata-job", node, []v1.PodResourceClaim{
		{Name: "gpu", ResourceClaimTemplateName: ptr.To(template)},
		{Name: "slice", ResourceClaimName: ptr.To(mig.Name)},
	}, metadataListing)
	t.Logf("$ kubectl logs job/metadata-job\n%s", logs)
	files, smi := metadataFiles(logs)
	templateFile := "resourceclaimtemplates/gpu/gpu/" + driver + "-metadata.json"
	migFile := "resourceclaims/meta-mig/gpu/" + driver + "-metadata.json"
	var paths []string
	for p := range files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	if want := []string{migFile, templateFile}; strings.Join(paths, " ") != strings.Join(want, " ") {
		t.Fatalf("the container sees metadata files %v under %s, want %v", paths, metadataDir, want)
	}

	// The template's claim is generated as <pod>-<pod claim>-<suffix>. Not compared with the pod's status:
	// once the pod has completed, the ResourceClaim controller deletes that claim and may record another.
	pods, err := e.client.CoreV1().Pods(ns).List(ctxFor(t, 30*time.Second), metav1.ListOptions{LabelSelector: "job-name=metadata-job"})
	if err != nil || len(pods.Items) != 1 {
		t.Fatalf("the Job's pod: %v, %d pods", err, len(pods.Items))
	}
	generated := pods.Items[0].Name + "-gpu-"
	whole := decodeMetadata(t, templateFile, files[templateFile])
	if whole.PodClaimName == nil || *whole.PodClaimName != "gpu" || !strings.HasPrefix(whole.Name, generated) || whole.Namespace != ns || whole.UID == "" {
		t.Errorf("%s names claim %s/%s (uid %q, pod claim %v), want %s/%s… with a UID, from pod claim gpu", templateFile, whole.Namespace, whole.Name, whole.UID, ptr.Deref(whole.PodClaimName, "<none>"), ns, generated)
	}
	if len(whole.Requests) != 1 || whole.Requests[0].Name != "gpu" || len(whole.Requests[0].Devices) != 1 {
		t.Fatalf("%s: requests %+v, want request gpu with one device", templateFile, whole.Requests)
	}
	gpu := whole.Requests[0].Devices[0]
	if gpu.Driver != driver || gpu.Pool != node || !wholeGPUName.MatchString(gpu.Name) {
		t.Errorf("%s: device %s/%s/%s, want a whole GPU of %s in pool %s", templateFile, gpu.Driver, gpu.Pool, gpu.Name, driver, node)
	}
	published := sliceDevice(t, node, gpu.Name)
	for _, name := range []string{"uuid", "resource.kubernetes.io/pciBusID", "productName"} {
		want := attr(published, name).StringValue
		if got := metadataString(gpu, name); want == nil || got != *want {
			t.Errorf("%s: attribute %s = %q, the slice publishes %v", templateFile, name, got, want)
		}
	}
	if uuid := metadataString(gpu, "uuid"); uuid == "" || !strings.Contains(smi, "UUID: "+uuid+")") {
		t.Errorf("%s: uuid %q is not the GPU nvidia-smi lists:\n%s", templateFile, uuid, smi)
	}

	slice := decodeMetadata(t, migFile, files[migFile])
	if slice.PodClaimName != nil || slice.Name != mig.Name || slice.UID != created.UID {
		t.Errorf("%s names claim %s (uid %s, pod claim %v), want %s (uid %s) without a pod claim name", migFile, slice.Name, slice.UID, slice.PodClaimName, mig.Name, created.UID)
	}
	if len(slice.Requests) != 1 || len(slice.Requests[0].Devices) != 1 {
		t.Fatalf("%s: requests %+v, want one device", migFile, slice.Requests)
	}
	device := slice.Requests[0].Devices[0]
	migUUID := metadataString(device, "migUUID")
	listed := regexp.MustCompile(`MIG 1g\.10gb\s+Device\s+\d+: \(UUID: (MIG-[0-9a-fA-F-]+)\)`).FindStringSubmatch(smi)
	if listed == nil || migUUID != listed[1] {
		t.Errorf("%s: migUUID %q, nvidia-smi lists the MIG device %v:\n%s", migFile, migUUID, listed, smi)
	}
	if p := metadataString(device, "profile"); p != "1g.10gb" || !strings.HasPrefix(device.Name, "gpu-") {
		t.Errorf("%s: device %s with profile %q, want a 1g.10gb MIG device", migFile, device.Name, p)
	}
}
