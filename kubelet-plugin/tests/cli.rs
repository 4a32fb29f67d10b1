//! The binary: `discover` without a cluster, and a plugin run against an API server that is not there.

use std::{
    io::Read,
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

const BIN: &str = env!("CARGO_BIN_EXE_tessera-kubelet-plugin");

fn node_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("node.yaml");
    std::fs::write(&path, "gpus:\n  - model: H100-SXM5-80GB\n    count: 8\n").unwrap();
    path
}

#[test]
fn discover_prints_the_inventory_spec_as_yaml_without_a_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args([
            "discover",
            "--backend",
            "simulated",
            "--node-name",
            "gpu-node-1",
            "--simulated-node-file",
        ])
        .arg(node_file(dir.path()))
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let spec: tessera_api::NodeInventorySpec = serde_norway::from_slice(&out.stdout).unwrap();
    assert_eq!(spec.node_name, "gpu-node-1");
    assert_eq!(spec.backend, "simulated");
    assert_eq!(spec.gpus.len(), 8);
    assert!(
        spec.gpus
            .iter()
            .all(|g| g.product_name == "NVIDIA H100 80GB HBM3")
    );
    assert_eq!(
        spec.gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
}

#[test]
fn the_plugin_refuses_to_start_without_a_node_name() {
    let out = Command::new(BIN).env_remove("NODE_NAME").output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--node-name"));
}

#[test]
fn the_plugin_serves_kubelet_without_an_api_server_and_cleans_up_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // An API server address nothing listens on: the publisher must retry, not crash.
    let kubeconfig = d.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n\
         users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n\
         current-context: x\n",
    )
    .unwrap();
    std::fs::write(d.join("boot_id"), "boot-1\n").unwrap();
    let mut child = Command::new(BIN)
        .args([
            "--node-name",
            "node-a",
            "--backend",
            "simulated",
            "--heartbeat-interval",
            "1",
        ])
        .arg("--simulated-node-file")
        .arg(node_file(d))
        .arg("--state-dir")
        .arg(d.join("state"))
        .arg("--kubelet-registry-dir")
        .arg(d.join("registry"))
        .arg("--kubelet-plugins-dir")
        .arg(d.join("plugins"))
        .arg("--cdi-dir")
        .arg(d.join("cdi"))
        .arg("--boot-id-file")
        .arg(d.join("boot_id"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let reg = d.join("registry/gpu.tessera.dev-reg.sock");
    let dra = d.join("plugins/gpu.tessera.dev/dra.sock");
    let start = Instant::now();
    while !(reg.exists() && dra.exists()) {
        assert!(child.try_wait().unwrap().is_none(), "the plugin exited early");
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "sockets never appeared"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Long enough for several failed publish attempts.
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the plugin crashed without an API server"
    );
    assert!(d.join("state/checkpoint.json").exists());

    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let start = Instant::now();
    let exit = loop {
        if let Some(exit) = child.try_wait().unwrap() {
            break exit;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the plugin ignored SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(exit.success(), "exit {exit:?}: {stderr}");
    assert!(
        stderr.contains("failed to publish the node inventory"),
        "{stderr}"
    );
    assert!(!reg.exists() && !dra.exists(), "sockets left behind");
}
