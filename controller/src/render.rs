//! `tessera-controller render`: the slices the controller would publish for some inventories, without a
//! cluster. Used by the golden tests and the packing benchmark.

use std::{collections::BTreeMap, path::Path};

use k8s_openapi::api::resource::v1::ResourceSlice;
use serde::Deserialize;
use tessera_api::{NodeInventory, NodeInventorySpec, policy::GpuPolicy};

use crate::{
    cel::CelEnv,
    features::ApiFeatures,
    health::{HealthConfig, HealthTracker},
    policy::{CompiledPolicy, PolicyProblem},
    pool::{NodeRef, node_slices_with_health},
    pool_diff::{Generations, diff},
};

/// Why rendering failed.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    /// An input file could not be read.
    #[error("failed to read {path}: {source}")]
    ReadFile { path: String, source: std::io::Error },
    /// An input file is neither a NodeInventory, a list of them, nor a NodeInventory spec.
    #[error("failed to parse {path} as NodeInventory, list of NodeInventory or inventory spec: {message}")]
    ParseInventory { path: String, message: String },
    /// The policy file is not a GpuPolicy.
    #[error("failed to parse {path} as a GpuPolicy: {message}")]
    ParsePolicy { path: String, message: String },
    /// The policy is invalid for these inventories (the condition the controller would set).
    #[error("failed to apply the policy: {0}")]
    Policy(#[from] PolicyProblem),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum InventoryDoc {
    List { items: Vec<NodeInventory> },
    Array(Vec<NodeInventory>),
    One(Box<NodeInventory>),
    Spec(NodeInventorySpec),
}

/// Reads inventories from YAML or JSON text: one NodeInventory, a `List`, an array, or a bare spec
/// (what `tessera-kubelet-plugin discover` prints, when it carries `nodeName`). Several YAML documents
/// may be separated by `---`.
pub fn parse_inventories(path: &str, text: &str) -> Result<Vec<NodeInventory>, RenderError> {
    let err = |message: String| RenderError::ParseInventory {
        path: path.to_string(),
        message,
    };
    let mut out = vec![];
    for doc in serde_norway::Deserializer::from_str(text) {
        let value = serde_norway::Value::deserialize(doc).map_err(|e| err(e.to_string()))?;
        if value.is_null() {
            continue;
        }
        match serde_norway::from_value::<InventoryDoc>(value).map_err(|e| err(e.to_string()))? {
            InventoryDoc::List { items } | InventoryDoc::Array(items) => out.extend(items),
            InventoryDoc::One(inv) => out.push(*inv),
            InventoryDoc::Spec(spec) => out.push(NodeInventory::new(&spec.node_name.clone(), spec)),
        }
    }
    Ok(out)
}

/// Reads a GpuPolicy from YAML or JSON text.
pub fn parse_policy(path: &str, text: &str) -> Result<GpuPolicy, RenderError> {
    serde_norway::from_str(text).map_err(|e| RenderError::ParsePolicy {
        path: path.into(),
        message: e.to_string(),
    })
}

/// The slices for `inventories` under `policy` (built-in default without one), as first published
/// (generation 1). Readiness and heartbeats are ignored: every inventory is rendered, with the health
/// taints its status reports now (no quiet period).
pub fn render(
    inventories: &[NodeInventory],
    policy: Option<&GpuPolicy>,
    features: ApiFeatures,
) -> Result<Vec<ResourceSlice>, RenderError> {
    let cel = CelEnv::new();
    let compiled = match policy {
        Some(p) => CompiledPolicy::compile(&p.spec, &cel)?,
        None => CompiledPolicy::builtin(),
    };
    let assignments = compiled.assign(&cel, inventories.iter().map(|i| &i.spec), true)?;
    // `compile` above already refused a policy whose health settings are unusable.
    let health = HealthTracker::snapshot(
        inventories,
        policy
            .and_then(|p| HealthConfig::of_spec(&p.spec).ok())
            .unwrap_or_default(),
    );
    let mut desired = BTreeMap::new();
    for inv in inventories {
        let node = NodeRef {
            name: inv.spec.node_name.clone(),
            uid: None,
        };
        let models = |index: u32| {
            assignments
                .get(&(node.name.clone(), index))
                .cloned()
                .unwrap_or(crate::devices::Model::Default)
        };
        desired.insert(
            node.name.clone(),
            node_slices_with_health(&node, &inv.spec, &models, features, &health.taints(&node.name)),
        );
    }
    Ok(diff(&desired, &[], &Default::default(), &mut Generations::new()).creates)
}

/// [`render`] from files, as a `v1` `List` in JSON.
pub fn render_files(
    inventory: &Path,
    policy: Option<&Path>,
    features: ApiFeatures,
) -> Result<serde_json::Value, RenderError> {
    let read = |p: &Path| {
        std::fs::read_to_string(p).map_err(|source| RenderError::ReadFile {
            path: p.display().to_string(),
            source,
        })
    };
    let inventories = parse_inventories(&inventory.display().to_string(), &read(inventory)?)?;
    let policy = policy
        .map(|p| parse_policy(&p.display().to_string(), &read(p)?))
        .transpose()?;
    let slices = render(&inventories, policy.as_ref(), features)?;
    Ok(serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": slices }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{GpuModel, node};

    #[test]
    fn discover_output_and_multi_document_streams_parse_as_inventories() {
        let a = serde_norway::to_string(&node("a").gpus(GpuModel::H200, 1).build().spec).unwrap();
        let b = serde_norway::to_string(&node("b").gpus(GpuModel::B200, 2).build()).unwrap();
        let invs = parse_inventories("x", &format!("{a}---\n{b}")).unwrap();
        let names: Vec<&str> = invs.iter().map(|i| i.spec.node_name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(invs[0].metadata.name.as_deref(), Some("a"));
        assert!(parse_inventories("x", "gpus: 3").is_err());
    }
}
