//! `tessera-kubelet-plugin simulate`: the injection command the e2e scenarios and operators use, run as a
//! process against a simulated node's state directory.

use std::{path::Path, process::Command};

const BIN: &str = env!("CARGO_BIN_EXE_tessera-kubelet-plugin");

/// `simulate <args>` on a 4-GPU node in `dir`, without the plugin's environment.
fn simulate(dir: &Path, args: &[&str]) -> std::process::Output {
    let node_file = dir.join("node.yaml");
    std::fs::write(&node_file, "gpus: [{model: H100-SXM5-80GB, count: 4}]\n").unwrap();
    Command::new(BIN)
        .arg("simulate")
        .args(args)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--simulated-node-file")
        .arg(&node_file)
        .env_remove("TESSERA_STATE_DIR")
        .env_remove("TESSERA_SIMULATED_NODE_FILE")
        .output()
        .unwrap()
}

fn faults(dir: &Path) -> serde_json::Value {
    let out = simulate(dir, &["show"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn injected_faults_are_written_to_the_simulated_kernel_and_recover_clears_them() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["inject-xid", "--gpu", "3", "--xid", "79"][..],
        &["inject-ecc", "--gpu", "2", "--gpu-instance", "1"],
        &["lose-gpu", "--gpu", "0"],
        &["degrade-fabric", "--gpu", "1"],
        &["degrade-fabric", "--gpu", "1", "--unhealthy"],
    ] {
        let out = simulate(dir.path(), args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(
        faults(dir.path()),
        serde_json::json!([
            {"gpu": 3, "kind": "Xid", "xid": 79},
            {"gpu": 2, "gpuInstance": 1, "kind": "DoubleBitEcc"},
            {"gpu": 0, "kind": "Lost"},
            {"gpu": 1, "kind": "FabricDegraded"},
            {"gpu": 1, "kind": "FabricUnhealthy"},
        ])
    );
    assert!(
        dir.path()
            .join("state/simulated-kernel/simulated-health.json")
            .exists()
    );
    assert!(simulate(dir.path(), &["recover", "--gpu", "3"]).status.success());
    assert_eq!(faults(dir.path()).as_array().unwrap().len(), 4);
}

#[test]
fn a_gpu_the_node_does_not_have_is_refused_naming_the_gpus_it_has() {
    let dir = tempfile::tempdir().unwrap();
    let out = simulate(dir.path(), &["lose-gpu", "--gpu", "4"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("GPU 4") && stderr.contains("GPUs 0 to 3"),
        "{stderr}"
    );
}

#[test]
fn without_a_node_file_the_error_names_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["simulate", "recover", "--gpu", "0", "--state-dir"])
        .arg(dir.path())
        .env_remove("TESSERA_SIMULATED_NODE_FILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--simulated-node-file"), "{stderr}");
}
