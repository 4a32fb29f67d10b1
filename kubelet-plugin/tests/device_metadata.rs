//! Device metadata (KEP-5304): each request of a prepared claim gets a JSON file its containers see at the
//! path upstream's readers look, holding the device's attributes (a MIG device's `MIG-` UUID included), and
//! the file goes with the claim.

mod common;

use std::{path::PathBuf, sync::Arc};

use common::{BOOT_ID, StopDaemons, TestNode, add, instances};
use serde_json::Value;
use tessera_kubelet_plugin::kubelet::claims::fake::{NODE, claim};
use tessera_kubelet_plugin::node::cdi::Mount;
use tessera_kubelet_plugin::node::state::{ClaimRef, NodeState};

const DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";

fn metadata_dir(node: &TestNode) -> PathBuf {
    node.state_dir().join("device-metadata")
}

/// The plugin as the binary assembles it, writing device metadata, recovered.
fn plugin(node: &TestNode) -> Arc<NodeState> {
    let program = PathBuf::from(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"));
    let (state, _) = common::real_plugin(node, BOOT_ID, program);
    let state =
        state.with_device_metadata(metadata_dir(node), Some("580.159.03".into()), Some("13.0".into()));
    state.recover().unwrap();
    Arc::new(state)
}

/// The metadata mounts of the claim's CDI device for `device`.
fn mounts_of(state: &NodeState, claim: &ClaimRef, device: &str) -> Vec<Mount> {
    let spec = state
        .cdi()
        .read(&claim.uid)
        .unwrap()
        .expect("the claim's CDI spec");
    let name = format!("{}-{device}", claim.uid);
    let d = spec
        .devices
        .iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("no CDI device {name} in {spec:?}"));
    d.container_edits
        .mounts
        .iter()
        .filter(|m| m.container_path.starts_with(DIR))
        .cloned()
        .collect()
}

/// The objects of a metadata file, in order.
fn objects(mount: &Mount) -> Vec<Value> {
    let text = std::fs::read_to_string(&mount.host_path).unwrap();
    serde_json::Deserializer::from_str(&text)
        .into_iter::<Value>()
        .collect::<Result<_, _>>()
        .unwrap()
}

fn attribute<'a>(device: &'a Value, name: &str, kind: &str) -> &'a Value {
    &device["attributes"][name][kind]
}

#[tokio::test]
async fn each_request_of_a_prepared_claim_gets_a_metadata_file_where_upstream_readers_look() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    let state = plugin(&node);
    let gpus = node.backend.discover().unwrap().gpus;
    let c = add(
        &node,
        claim("train")
            .allocated("gpu-0")
            .request("slice")
            .allocated("gpu-1-mig-1g-10gb-0")
            .reserved_for_pod("trainer")
            .build(),
    );
    state.prepare(&c).await.unwrap();

    let whole = mounts_of(&state, &c, "gpu-0");
    assert_eq!(whole.len(), 1, "{whole:?}");
    assert_eq!(
        whole[0].container_path,
        format!("{DIR}/resourceclaims/train/gpu/gpu.tessera.dev-metadata.json")
    );
    assert!(
        whole[0].options.contains(&"ro".to_string()),
        "{:?}",
        whole[0].options
    );
    let stream = objects(&whole[0]);
    let versions: Vec<&str> = stream.iter().map(|o| o["apiVersion"].as_str().unwrap()).collect();
    assert_eq!(
        versions,
        [
            "metadata.resource.k8s.io/v1beta1",
            "metadata.resource.k8s.io/v1alpha1"
        ]
    );
    assert_eq!(stream[0]["kind"], "DeviceMetadata");
    assert_eq!(stream[0]["metadata"]["name"], "train");
    assert_eq!(stream[0]["metadata"]["uid"], c.uid.as_str());
    assert!(stream[0].get("podClaimName").is_none(), "{}", stream[0]);
    assert_eq!(stream[0]["requests"][0]["name"], "gpu");
    let device = &stream[0]["requests"][0]["devices"][0];
    assert_eq!(
        (&device["driver"], &device["pool"], &device["name"]),
        (&"gpu.tessera.dev".into(), &NODE.into(), &"gpu-0".into())
    );
    assert_eq!(attribute(device, "uuid", "string"), gpus[0].uuid.as_str());
    assert_eq!(
        attribute(device, "resource.kubernetes.io/pciBusID", "string"),
        gpus[0].pci_bus_id.as_str()
    );
    assert_eq!(attribute(device, "driverVersion", "version"), "580.159.3");
    assert_eq!(attribute(device, "type", "string"), "gpu");
    assert_eq!(
        stream[1]["requests"], stream[0]["requests"],
        "both versions say the same"
    );

    let mig = mounts_of(&state, &c, "gpu-1-mig-1g-10gb-0");
    assert_eq!(
        mig[0].container_path,
        format!("{DIR}/resourceclaims/train/slice/gpu.tessera.dev-metadata.json")
    );
    let device = objects(&mig[0])[0]["requests"][0]["devices"][0].clone();
    let made = instances(&node, 1);
    assert_eq!(made.len(), 1, "{made:?}");
    assert_eq!(
        attribute(&device, "migUUID", "string"),
        made[0].1.as_str(),
        "the MIG device made for the claim"
    );
    assert_eq!(attribute(&device, "uuid", "string"), gpus[1].uuid.as_str());
    assert_eq!(attribute(&device, "profile", "string"), "1g.10gb");
    assert_eq!(attribute(&device, "placementStart", "int"), 0);
}

#[tokio::test]
async fn a_claim_made_from_a_template_is_found_under_its_pods_claim_name_and_base_request() {
    let node = TestNode::with_gpus(1);
    let state = plugin(&node);
    let c = add(
        &node,
        claim("pod-a-gpu-x7k2q")
            .from_template_for("my-gpu")
            .request("gpu/h100")
            .allocated("gpu-0")
            .reserved_for_pod("pod-a")
            .build(),
    );
    state.prepare(&c).await.unwrap();

    let mounts = mounts_of(&state, &c, "gpu-0");
    assert_eq!(
        mounts[0].container_path,
        format!("{DIR}/resourceclaimtemplates/my-gpu/gpu/gpu.tessera.dev-metadata.json"),
        "a subrequest's file is named by its request"
    );
    let stream = objects(&mounts[0]);
    assert_eq!(stream[0]["podClaimName"], "my-gpu");
    assert_eq!(stream[0]["metadata"]["name"], "pod-a-gpu-x7k2q");
    assert_eq!(stream[0]["requests"][0]["name"], "gpu/h100");
}

#[tokio::test]
async fn unprepare_removes_the_metadata_and_a_restart_sweeps_only_what_no_claim_owns() {
    let node = TestNode::with_gpus(2);
    let state = plugin(&node);
    let kept = add(
        &node,
        claim("kept").allocated("gpu-0").reserved_for_pod("a").build(),
    );
    let gone = add(
        &node,
        claim("gone").allocated("gpu-1").reserved_for_pod("b").build(),
    );
    state.prepare(&kept).await.unwrap();
    state.prepare(&gone).await.unwrap();
    let gone_dir = metadata_dir(&node).join(&gone.uid);
    assert!(gone_dir.is_dir());

    state.unprepare(&gone).await.unwrap();
    assert!(!gone_dir.exists(), "unprepare leaves {}", gone_dir.display());
    state.unprepare(&gone).await.unwrap();

    // What a crash between writing the metadata and the checkpoint leaves.
    let stray = metadata_dir(&node).join("0b6c6f3e-stray").join("gpu");
    std::fs::create_dir_all(&stray).unwrap();
    std::fs::write(stray.join("metadata.json"), "{}").unwrap();
    drop(state);
    let restarted = plugin(&node);
    assert!(!stray.exists(), "the restart keeps metadata no claim owns");
    let mounts = mounts_of(&restarted, &kept, "gpu-0");
    assert!(
        std::path::Path::new(&mounts[0].host_path).is_file(),
        "the restart keeps a prepared claim's file"
    );
}
