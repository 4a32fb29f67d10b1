//go:build !k8s_1_36

package e2etest

// Device metadata as Kubernetes 1.37 and later read it: v1beta1 first, upstream's validation on. The 1.36
// module has only v1alpha1 and a decoder without options (realnode_metadata_decode_136_test.go, built with
// -tags k8s_1_36 by build-k8s.sh).

import (
	"encoding/json"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"
	metadatav1alpha1 "k8s.io/dynamic-resource-allocation/api/metadata/v1alpha1"
	metadatav1beta1 "k8s.io/dynamic-resource-allocation/api/metadata/v1beta1"
	"k8s.io/dynamic-resource-allocation/devicemetadata"
)

type deviceMetadata = metadatav1beta1.DeviceMetadata

type metadataDevice = metadatav1beta1.Device

// decodeMetadata decodes a metadata file as an application would (the first version it knows), with
// upstream's validation, and checks the older version the stream carries decodes too.
func decodeMetadata(t *testing.T, path, content string) deviceMetadata {
	t.Helper()
	var dm deviceMetadata
	var gvk schema.GroupVersionKind
	var invalid error
	if err := devicemetadata.DecodeMetadataFromStream(json.NewDecoder(strings.NewReader(content)), &dm,
		devicemetadata.DecodeMetadataStoreGVKResult(&gvk), devicemetadata.DecodeMetadataWithValidationResult(&invalid)); err != nil {
		t.Fatalf("%s: upstream's decoder refuses it: %v\n%s", path, err, content)
	}
	if invalid != nil {
		t.Errorf("%s: upstream's validation: %v\n%s", path, invalid, content)
	}
	if gvk.Version != "v1beta1" || gvk.Kind != "DeviceMetadata" {
		t.Errorf("%s: decoded %s, want the v1beta1 DeviceMetadata first", path, gvk)
	}
	var old metadatav1alpha1.DeviceMetadata
	if err := devicemetadata.DecodeMetadataFromStream(json.NewDecoder(strings.NewReader(content)), &old); err != nil {
		t.Errorf("%s: no v1alpha1 object for 1.36's readers: %v", path, err)
	}
	return dm
}
