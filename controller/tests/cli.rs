//! The binary's `render` and `crds` subcommands, as the packing benchmark and e2e call them.

mod support;

use std::process::Command;

use tessera_controller::{
    crds::crds_yaml,
    fixtures::{GpuModel, node},
};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tessera-controller"))
}

#[test]
fn render_prints_a_list_of_slices_for_an_inventory_list_file() {
    let dir = tempfile::tempdir().unwrap();
    let inventory = dir.path().join("inv.yaml");
    let list = serde_json::json!({
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            node("a").gpus(GpuModel::H100Sxm5_80gb, 2).build(),
            node("b").gpus(GpuModel::B200, 1).build(),
        ],
    });
    std::fs::write(&inventory, serde_norway::to_string(&list).unwrap()).unwrap();
    let out = bin()
        .args(["render", "--inventory"])
        .arg(&inventory)
        .args(["--features", "none"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rendered: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rendered["kind"], "List");
    let items = rendered["items"].as_array().unwrap();
    assert_eq!(
        items.len(),
        2,
        "one whole-GPU slice per node without partitionable devices"
    );
    assert_eq!(items[0]["spec"]["devices"].as_array().unwrap().len(), 2);

    let out = bin()
        .args(["render", "--inventory"])
        .arg(&inventory)
        .env("TESSERA_FEATURES", "partitionable")
        .output()
        .unwrap();
    let rendered: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        rendered["items"].as_array().unwrap().len(),
        (1 + 2) + (1 + 1),
        "the env fallback applies"
    );
}

#[test]
fn render_reports_an_invalid_policy_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    let inventory = dir.path().join("inv.json");
    std::fs::write(
        &inventory,
        serde_json::to_string(&node("a").gpus(GpuModel::H200, 1).build()).unwrap(),
    )
    .unwrap();
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "apiVersion: gpu.tessera.dev/v1alpha1\nkind: GpuPolicy\nmetadata: {name: default}\nspec:\n  rules:\n  - name: bad\n    selector: 'device.attributes[\"gpu.tessera.dev\"].index'\n    whole: {}\n",
    )
    .unwrap();
    let out = bin()
        .args(["render", "--inventory"])
        .arg(&inventory)
        .arg("--policy")
        .arg(&policy)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("CelTypeError") && stderr.contains("must return a bool"),
        "{stderr}"
    );
}

#[test]
fn crds_prints_the_generated_crds() {
    let out = bin().arg("crds").output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), crds_yaml());
}
