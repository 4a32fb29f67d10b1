//! The binary: `discover` without a cluster, and a plugin run against an API server that is not there.

mod common;

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

/// The plugin for node `node-a` with the simulated backend and every directory under `d`, pointed at
/// an API server address nothing listens on.
fn plugin_in(d: &Path) -> Command {
    std::fs::write(d.join("boot_id"), "boot-1\n").unwrap();
    common::plugin_command(d, "node-a", &node_file(d), "https://127.0.0.1:1")
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
fn cdi_hook_features_are_nvidias_subcommand_names_and_need_cdi_hook() {
    let dir = tempfile::tempdir().unwrap();
    let alone = plugin_in(dir.path())
        .args(["--cdi-hook-features", "enable-cuda-compat"])
        .output()
        .unwrap();
    assert!(!alone.status.success());
    let e = String::from_utf8_lossy(&alone.stderr);
    assert!(e.contains("--cdi-hook <CDI_HOOK>"), "{e}");
    let misspelt = plugin_in(dir.path())
        .args([
            "--cdi-hook",
            "/usr/bin/nvidia-cdi-hook",
            "--cdi-hook-features",
            "enable-compat",
        ])
        .output()
        .unwrap();
    assert!(!misspelt.status.success());
    let e = String::from_utf8_lossy(&misspelt.stderr);
    assert!(
        e.contains("enable-compat")
            && e.contains("enable-cuda-compat")
            && e.contains("disable-device-node-modification"),
        "{e}"
    );
}

#[test]
fn the_plugin_serves_kubelet_without_an_api_server_and_cleans_up_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // An API server address nothing listens on: the publisher must retry, not crash.
    let mut child = plugin_in(d)
        .args(["--heartbeat-interval", "1"])
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

/// A blocking `GET path` on `addr`: the status code and the body.
fn probe(addr: &str, path: &str) -> (u16, String) {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: kubelet\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = String::new();
    stream.read_to_string(&mut raw).unwrap();
    let status = raw.split_whitespace().nth(1).unwrap().parse().unwrap();
    (
        status,
        raw.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default(),
    )
}

/// A free port on 127.0.0.1 (bound and released; the plugin binds it right after).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readiness_probe_fails_with_the_reason_until_kubelet_registers_the_plugin() {
    use tessera_proto::pluginregistration::{
        InfoRequest, RegistrationStatus, registration_client::RegistrationClient,
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let addr = format!("127.0.0.1:{}", free_port());
    let mut child = plugin_in(d)
        .args(["--health-addr", &addr])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let reg = d.join("registry/gpu.tessera.dev-reg.sock");
    common::wait_for_socket(&reg).await;
    let get = |path: &'static str| {
        let addr = addr.clone();
        tokio::task::spawn_blocking(move || probe(&addr, path))
    };
    assert_eq!(get("/livez").await.unwrap(), (200, "ok\n".into()));
    assert_eq!(
        get("/readyz").await.unwrap(),
        (503, "waiting for kubelet to register the plugin\n".into())
    );

    let mut registration = RegistrationClient::new(common::dial(&reg).await);
    registration.get_info(InfoRequest {}).await.unwrap();
    registration
        .notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
    assert_eq!(get("/readyz").await.unwrap(), (200, "ok\n".into()));

    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}
