//! One node's pool: the GPUs' devices and counter sets laid out in ResourceSlices.
//!
//! Layout (the 1.35+ rules, also valid on 1.36):
//! * counter sets in their own slices, at most 8 per slice ([`MAX_COUNTER_SETS_PER_SLICE`]);
//! * the devices of a GPU that consumes counters in a slice of their own: the scheduler keeps the device
//!   order inside a slice but not the order of slices, and the first-fit order of
//!   [`crate::devices::dynamic_mig`] only works within one slice;
//! * all other devices packed in GPU order, at most [`MAX_DEVICES_PER_SLICE`] per slice.
//!
//! Slice names are stable (`<node>-gpu.tessera.dev-<k>`) so the controller can compare and update them
//! in place. Every slice carries [`CONTENT_HASH_ANNOTATION`], a hash of everything the controller decides
//! except the pool generation, so "unchanged" does not depend on how the API server normalizes
//! quantities or drops gated fields (which would otherwise cause endless rewrites).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::{
    api::resource::v1::{CounterSet, Device, ResourcePool, ResourceSlice, ResourceSliceSpec},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference},
};
use sha2::{Digest, Sha256};
use tessera_api::{DRIVER_NAME, NodeInventorySpec};

use crate::{
    devices::{GpuDevices, Model, publish_with_health},
    features::ApiFeatures,
    health::NodeTaints,
};

/// Annotation holding the content hash of a slice.
pub const CONTENT_HASH_ANNOTATION: &str = "gpu.tessera.dev/content-hash";
/// Label on every slice tessera's controller writes.
pub const MANAGED_BY_LABEL: (&str, &str) = ("app.kubernetes.io/managed-by", "tessera-controller");
/// 1.35+: at most 8 counter sets per slice.
pub const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
/// 1.35+: at most 64 devices in a slice where any device consumes counters or has taints. Used for every
/// slice, which keeps one rule for all layouts.
pub const MAX_DEVICES_PER_SLICE: usize = 64;

/// The Node a pool belongs to, as ownerReference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRef {
    pub name: String,
    pub uid: Option<String>,
}

/// Stable slice name prefix for a node; shortened with a hash when the node name is too long for a
/// 253-character object name.
pub fn slice_prefix(node: &str) -> String {
    let prefix = format!("{node}-{DRIVER_NAME}");
    if prefix.len() <= 240 {
        return prefix;
    }
    let hash = hex(&Sha256::digest(node.as_bytes()))[..10].to_string();
    format!(
        "{}-{hash}-{DRIVER_NAME}",
        node[..200].trim_end_matches(['-', '.'])
    )
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Hash of what the controller decides for a slice, excluding `pool.generation` and
/// `pool.resourceSliceCount` (which the reconciler sets).
pub fn content_hash(slice: &ResourceSlice) -> String {
    let mut spec = slice.spec.clone();
    spec.pool.generation = 0;
    spec.pool.resource_slice_count = 0;
    let content = serde_json::json!({
        "name": slice.metadata.name,
        "labels": slice.metadata.labels,
        "ownerReferences": slice.metadata.owner_references,
        "spec": spec,
    });
    hex(&Sha256::digest(content.to_string().as_bytes()))[..32].to_string()
}

/// The slices of `node`'s pool for the given per-GPU models, with `generation` 0 and the slice count
/// filled in. Returns no slices when nothing is published.
pub fn node_slices(
    node: &NodeRef,
    inventory: &NodeInventorySpec,
    models: &dyn Fn(u32) -> Model,
    features: ApiFeatures,
) -> Vec<ResourceSlice> {
    node_slices_with_health(node, inventory, models, features, &NodeTaints::new())
}

/// [`node_slices`] with the health taints of the node's devices (see [`crate::health`]).
pub fn node_slices_with_health(
    node: &NodeRef,
    inventory: &NodeInventorySpec,
    models: &dyn Fn(u32) -> Model,
    features: ApiFeatures,
    taints: &NodeTaints,
) -> Vec<ResourceSlice> {
    node_slices_retaining(node, inventory, models, features, taints, &BTreeSet::new()).0
}

/// [`node_slices_with_health`], keeping the devices of `allocated` (this node's allocated devices) that
/// the models drop ([`crate::retain`]); also returns the names of the devices kept that way.
pub fn node_slices_retaining(
    node: &NodeRef,
    inventory: &NodeInventorySpec,
    models: &dyn Fn(u32) -> Model,
    features: ApiFeatures,
    taints: &NodeTaints,
    allocated: &BTreeSet<String>,
) -> (Vec<ResourceSlice>, Vec<String>) {
    let per_gpu: Vec<GpuDevices> = inventory
        .gpus
        .iter()
        .map(|gpu| publish_with_health(inventory, gpu, &models(gpu.index), features, taints))
        .collect();
    let (per_gpu, kept) = crate::retain::retain(inventory, per_gpu, allocated, features, taints);
    (layout(node, per_gpu), kept)
}

/// Lays one node's devices and counter sets out in slices (the module's rules).
fn layout(node: &NodeRef, per_gpu: Vec<GpuDevices>) -> Vec<ResourceSlice> {
    let counter_sets: Vec<CounterSet> = per_gpu.iter().filter_map(|g| g.counter_set.clone()).collect();
    let mut device_groups: Vec<Vec<Device>> = vec![];
    let mut loose: Vec<Device> = vec![];
    for g in per_gpu {
        if g.devices.iter().any(|d| d.consumes_counters.is_some()) {
            device_groups.extend(g.devices.chunks(MAX_DEVICES_PER_SLICE).map(<[Device]>::to_vec));
        } else {
            loose.extend(g.devices);
        }
    }
    device_groups.extend(loose.chunks(MAX_DEVICES_PER_SLICE).map(<[Device]>::to_vec));

    let mut specs: Vec<ResourceSliceSpec> = vec![];
    for sets in counter_sets.chunks(MAX_COUNTER_SETS_PER_SLICE) {
        specs.push(ResourceSliceSpec {
            shared_counters: Some(sets.to_vec()),
            ..Default::default()
        });
    }
    for devices in device_groups.into_iter().filter(|d| !d.is_empty()) {
        specs.push(ResourceSliceSpec {
            devices: Some(devices),
            ..Default::default()
        });
    }
    let count = specs.len() as i64;
    let prefix = slice_prefix(&node.name);
    specs
        .into_iter()
        .enumerate()
        .map(|(k, spec)| {
            let mut slice = ResourceSlice {
                metadata: ObjectMeta {
                    name: Some(format!("{prefix}-{k}")),
                    labels: Some(BTreeMap::from([(
                        MANAGED_BY_LABEL.0.to_string(),
                        MANAGED_BY_LABEL.1.to_string(),
                    )])),
                    owner_references: node.uid.as_ref().map(|uid| {
                        vec![OwnerReference {
                            api_version: "v1".into(),
                            kind: "Node".into(),
                            name: node.name.clone(),
                            uid: uid.clone(),
                            controller: Some(true),
                            block_owner_deletion: None,
                        }]
                    }),
                    ..Default::default()
                },
                spec: ResourceSliceSpec {
                    driver: DRIVER_NAME.into(),
                    node_name: Some(node.name.clone()),
                    pool: ResourcePool {
                        name: node.name.clone(),
                        generation: 0,
                        resource_slice_count: count,
                    },
                    ..spec
                },
            };
            let hash = content_hash(&slice);
            slice.metadata.annotations = Some(BTreeMap::from([(CONTENT_HASH_ANNOTATION.to_string(), hash)]));
            slice
        })
        .collect()
}
