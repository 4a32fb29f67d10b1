//go:build k8s_1_36

package e2etest

// Device metadata as Kubernetes 1.36's module reads it: v1alpha1 only, and a decoder that neither validates
// nor says which version it chose. The file's v1beta1 object comes first in the stream, so decoding into
// v1alpha1 also proves that a 1.36 reader finds the object meant for it.

import (
	"encoding/json"
	"strings"
	"testing"

	metadatav1alpha1 "k8s.io/dynamic-resource-allocation/api/metadata/v1alpha1"
	"k8s.io/dynamic-resource-allocation/devicemetadata"
)

type deviceMetadata = metadatav1alpha1.DeviceMetadata

type metadataDevice = metadatav1alpha1.Device

func decodeMetadata(t *testing.T, path, content string) deviceMetadata {
	t.Helper()
	var dm deviceMetadata
	if err := devicemetadata.DecodeMetadataFromStream(json.NewDecoder(strings.NewReader(content)), &dm); err != nil {
		t.Fatalf("%s: upstream's 1.36 decoder refuses it: %v\n%s", path, err, content)
	}
	return dm
}
