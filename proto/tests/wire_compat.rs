//! v1 and v1beta1 `Device` differ only by `share_id = 5`; a kubelet and a driver that speak
//! different versions must still understand each other's bytes.

use prost::Message;
use tessera_proto::dra::{v1, v1beta1};

fn v1_device_with_share() -> v1::Device {
    v1::Device {
        request_names: vec!["gpu".to_owned()],
        pool_name: "node-a".to_owned(),
        device_name: "gpu-0-shared".to_owned(),
        cdi_device_ids: vec!["k8s.gpu.tessera.dev/claim=uid-1-gpu-0-shared".to_owned()],
        share_id: Some("share-7".to_owned()),
    }
}

#[test]
fn a_v1_device_with_share_id_decodes_as_v1beta1_without_it() {
    let bytes = v1_device_with_share().encode_to_vec();

    let decoded = v1beta1::Device::decode(bytes.as_slice()).expect("v1 bytes decode as v1beta1");

    assert_eq!(
        decoded,
        v1beta1::Device {
            request_names: vec!["gpu".to_owned()],
            pool_name: "node-a".to_owned(),
            device_name: "gpu-0-shared".to_owned(),
            cdi_device_ids: vec!["k8s.gpu.tessera.dev/claim=uid-1-gpu-0-shared".to_owned()],
        }
    );
}

#[test]
fn a_v1beta1_device_decodes_as_v1_with_no_share_id() {
    let beta = v1beta1::Device {
        request_names: vec![],
        pool_name: "node-a".to_owned(),
        device_name: "gpu-1".to_owned(),
        cdi_device_ids: vec!["k8s.gpu.tessera.dev/claim=uid-2-gpu-1".to_owned()],
    };

    let decoded = v1::Device::decode(beta.encode_to_vec().as_slice()).expect("decodes as v1");

    assert_eq!(
        decoded,
        v1::Device {
            request_names: vec![],
            pool_name: "node-a".to_owned(),
            device_name: "gpu-1".to_owned(),
            cdi_device_ids: vec!["k8s.gpu.tessera.dev/claim=uid-2-gpu-1".to_owned()],
            share_id: None,
        }
    );
}

#[test]
fn an_empty_share_id_is_still_sent_because_the_field_is_optional() {
    // `optional` gives explicit presence: Some("") must survive the round trip, unlike a
    // plain proto3 string, so "no share" and "empty share" stay distinguishable.
    let device = v1::Device {
        share_id: Some(String::new()),
        ..v1_device_with_share()
    };

    let decoded = v1::Device::decode(device.encode_to_vec().as_slice()).expect("decodes");

    assert_eq!(decoded.share_id, Some(String::new()));
}

#[test]
fn a_v1_prepare_response_decodes_as_v1beta1_with_the_same_claims() {
    let response = v1::NodePrepareResourcesResponse {
        claims: [(
            "uid-1".to_owned(),
            v1::NodePrepareResourceResponse {
                devices: vec![v1_device_with_share()],
                error: String::new(),
            },
        )]
        .into(),
    };

    let decoded = v1beta1::NodePrepareResourcesResponse::decode(response.encode_to_vec().as_slice())
        .expect("decodes as v1beta1");

    let claim = &decoded.claims["uid-1"];
    assert_eq!(claim.devices.len(), 1);
    assert_eq!(claim.devices[0].device_name, "gpu-0-shared");
    assert_eq!(claim.error, "");
}
