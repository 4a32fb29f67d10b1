//! Scenarios shared by the integration tests: the simulated nodes and the built-in model policies.
#![allow(dead_code)]

use std::path::PathBuf;

use k8s_openapi::api::resource::v1::{Device, DeviceClass, ResourceSlice};
use tessera_api::{NodeInventory, policy::GpuPolicy};
use tessera_controller::{
    features::ApiFeatures,
    fixtures::{GpuModel, node},
    render::{parse_policy, render},
};

pub fn h100_node() -> NodeInventory {
    node("h100-node").gpus(GpuModel::H100Sxm5_80gb, 8).build()
}

pub fn h200_node() -> NodeInventory {
    node("h200-node").gpus(GpuModel::H200, 8).build()
}

/// Four A100-80GB with MIG mode on (A100 cannot toggle it without a reset) and four B200.
pub fn mixed_node() -> NodeInventory {
    node("mixed-node")
        .mig_gpus(GpuModel::A100Sxm4_80gb, 4)
        .gpus(GpuModel::B200, 4)
        .build()
}

pub fn nodes() -> Vec<(&'static str, NodeInventory)> {
    vec![
        ("h100", h100_node()),
        ("h200", h200_node()),
        ("mixed", mixed_node()),
    ]
}

/// A device model as the golden files name it: policy text (None = built-in default) and features.
pub struct ModelCase {
    pub name: &'static str,
    pub policy: Option<&'static str>,
    pub features: ApiFeatures,
}

const WHOLE: &str = "
apiVersion: gpu.tessera.dev/v1alpha1
kind: GpuPolicy
metadata: {name: default}
spec:
  rules:
  - name: all-whole
    whole: {}
";

const DYNAMIC_MIG: &str = "
apiVersion: gpu.tessera.dev/v1alpha1
kind: GpuPolicy
metadata: {name: default}
spec:
  rules:
  - name: all-mig
    dynamicMig: {}
";

const DYNAMIC_MIG_QUOTA_MEMORY: &str = "
apiVersion: gpu.tessera.dev/v1alpha1
kind: GpuPolicy
metadata: {name: default}
spec:
  rules:
  - name: all-mig
    dynamicMig: {quotaCounters: [memory]}
";

/// Dynamic MIG with `quotaCounters: [memory]` (not a golden file: tests compare it with `dynamic-mig`).
pub fn dynamic_mig_with_memory_counter() -> ModelCase {
    ModelCase {
        name: "dynamic-mig-quota-memory",
        policy: Some(DYNAMIC_MIG_QUOTA_MEMORY),
        features: ApiFeatures::ALL,
    }
}

const SHARED: &str = "
apiVersion: gpu.tessera.dev/v1alpha1
kind: GpuPolicy
metadata: {name: default}
spec:
  rules:
  - name: all-shared
    shared: {strategy: MPS, memoryStep: 1Gi, fallbackSlots: 4}
";

const STATIC_MIG: &str = "
apiVersion: gpu.tessera.dev/v1alpha1
kind: GpuPolicy
metadata: {name: default}
spec:
  rules:
  - name: balanced
    staticMig: {layout: ['1g@0', '1g@1', '2g@2', '3g@4']}
";

pub fn models() -> Vec<ModelCase> {
    vec![
        ModelCase {
            name: "default",
            policy: None,
            features: ApiFeatures::ALL,
        },
        ModelCase {
            name: "whole",
            policy: Some(WHOLE),
            features: ApiFeatures::ALL,
        },
        ModelCase {
            name: "dynamic-mig",
            policy: Some(DYNAMIC_MIG),
            features: ApiFeatures::ALL,
        },
        ModelCase {
            name: "shared",
            policy: Some(SHARED),
            features: ApiFeatures::ALL,
        },
        ModelCase {
            name: "static-mig-fallback",
            policy: Some(STATIC_MIG),
            features: ApiFeatures::NONE,
        },
        ModelCase {
            name: "slot-fallback",
            policy: Some(SHARED),
            features: ApiFeatures::NONE,
        },
    ]
}

pub fn policy(text: &str) -> GpuPolicy {
    parse_policy("test", text).expect("test policies parse")
}

pub fn render_case(inv: &NodeInventory, case: &ModelCase) -> Vec<ResourceSlice> {
    let policy = case.policy.map(policy);
    render(std::slice::from_ref(inv), policy.as_ref(), case.features).expect("test scenarios render")
}

pub fn devices(slices: &[ResourceSlice]) -> Vec<&Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .collect()
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate is in the workspace")
        .to_path_buf()
}

/// The DeviceClasses tessera ships (`deployments/classes/`).
pub fn shipped_classes() -> Vec<DeviceClass> {
    ["gpu.tessera.dev", "mig.gpu.tessera.dev", "shared.gpu.tessera.dev"]
        .iter()
        .map(|c| {
            let path = repo_root().join(format!("deployments/classes/{c}.yaml"));
            let text = std::fs::read_to_string(&path).unwrap();
            serde_norway::from_str::<DeviceClass>(&text).unwrap()
        })
        .collect()
}

/// What the controller renders for the golden case `golden` (e.g. `h100-shared`), as node `node` publishes
/// it: the slices renamed and pooled for that node.
pub fn golden_slices_on(node: &str, golden: &str) -> Vec<ResourceSlice> {
    let path = repo_root().join(format!("controller/tests/golden/{golden}.json"));
    let mut slices: Vec<ResourceSlice> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for (i, s) in slices.iter_mut().enumerate() {
        s.metadata.name = Some(format!("{node}-gpu.tessera.dev-{i}"));
        s.spec.pool.name = node.to_string();
        s.spec.node_name = Some(node.to_string());
    }
    slices
}

/// Compares `actual` with the checked-in file; `TESSERA_BLESS=1` rewrites the file instead.
pub fn check_golden(path: &std::path::Path, actual: &str) {
    if std::env::var_os("TESSERA_BLESS").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}; run with TESSERA_BLESS=1 to create it", path.display()));
    if expected != actual {
        panic!(
            "{} drifted (TESSERA_BLESS=1 accepts the new output):\n{}",
            path.display(),
            line_diff(&expected, actual)
        );
    }
}

/// The first differing region of two texts, with context, in unified-diff style.
pub fn line_diff(expected: &str, actual: &str) -> String {
    let e: Vec<&str> = expected.lines().collect();
    let a: Vec<&str> = actual.lines().collect();
    let first = e
        .iter()
        .zip(&a)
        .position(|(x, y)| x != y)
        .unwrap_or(e.len().min(a.len()));
    let (mut ee, mut ae) = (e.len(), a.len());
    while ee > first && ae > first && e[ee - 1] == a[ae - 1] {
        ee -= 1;
        ae -= 1;
    }
    let from = first.saturating_sub(3);
    let mut out = format!("@@ line {} @@\n", first + 1);
    for l in &e[from..first] {
        out += &format!("  {l}\n");
    }
    for l in e[first..ee].iter().take(40) {
        out += &format!("- {l}\n");
    }
    for l in a[first..ae].iter().take(40) {
        out += &format!("+ {l}\n");
    }
    out
}
