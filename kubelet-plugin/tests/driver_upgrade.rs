//! A driver upgrade under the GPU Operator (issue 38, item 4): the Operator unloads the old kernel module
//! before it loads the new one, which the kernel refuses while anything holds the GPU. Over the simulated
//! driver root's real `libnvidia-ml.so.1` (whose sessions the simulated kernel counts as module users) and
//! the MPS supervisor as its own process: a plugin that keeps its NVML session makes the swap fail; one
//! that lets go when the Node's labels say so (`gpu::driver_upgrade`), with the supervisor's daemons paused,
//! lets it through, and both come back on the new driver with the daemons' settings.
//!
//! The second test runs the plugin binary itself (nvml backend over the simulated driver root, an API server
//! stand-in that serves its Node and a watch of it) through a whole upgrade.
//!
//! `cargo test -p tessera-kubelet-plugin --test driver_upgrade` (the fixture builds the libraries first).

#[path = "common/sim_driver.rs"]
mod sim_driver;

mod common;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

use sim_driver::SimDriver;
use tessera_kubelet_plugin::devices::sharing::supervisor_protocol::{
    self, DaemonDefaults, Request, SupervisorError,
};
use tessera_kubelet_plugin::gpu::GpuBackend;
use tessera_kubelet_plugin::gpu::driver_upgrade::{Step, UPGRADE_STATE_LABEL, UpgradeTracker};
use tessera_sim_model::driver_root::upgrade;
use tessera_sim_model::kernel::SIMULATED_DRIVER_VERSION;
use tessera_sim_model::sessions::live_sessions;

const NEW: &str = "580.200.01";

fn state(value: &str) -> BTreeMap<String, String> {
    [(UPGRADE_STATE_LABEL.to_string(), value.to_string())].into()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()) != Some("Z"))
}

/// The node's MPS supervisor as the chart runs it (the plugin binary's `mps-supervisor`), killed with the
/// test.
struct SupervisorProcess {
    child: Child,
    socket: PathBuf,
}

impl SupervisorProcess {
    fn start(dir: &Path) -> Self {
        let socket = dir.join("supervisor.sock");
        let _ = std::fs::remove_file(&socket);
        let child = Command::new(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"))
            .arg("mps-supervisor")
            .arg("--socket")
            .arg(&socket)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["--backend", "simulated"])
            .spawn()
            .unwrap();
        wait_for("the supervisor's socket", || {
            supervisor_protocol::request(&socket, &Request::Running).is_ok()
        });
        Self { child, socket }
    }

    fn pid_of(&self, key: &str) -> Option<u32> {
        supervisor_protocol::request(&self.socket, &Request::Pid { key: key.into() })
            .unwrap()
            .pid
    }

    fn send(&self, key: &str, command: &str) -> Result<String, SupervisorError> {
        let req = Request::Send {
            key: key.into(),
            command: command.into(),
        };
        supervisor_protocol::request(&self.socket, &req).map(|a| a.answer.unwrap_or_default())
    }

    fn running(&self) -> Vec<String> {
        supervisor_protocol::request(&self.socket, &Request::Running)
            .unwrap()
            .keys
    }
}

impl Drop for SupervisorProcess {
    fn drop(&mut self) {
        // SIGTERM: it quits its daemons (keeping its record) before it exits.
        let _ = Command::new("kill").arg(self.child.id().to_string()).status();
        let _ = self.child.wait();
    }
}

#[test]
fn an_operator_driver_upgrade_finds_no_nvml_session_or_mps_daemon_and_tessera_comes_back_on_the_new_driver() {
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 1).build();
    let dir = tempfile::tempdir().unwrap();
    let supervisor = SupervisorProcess::start(dir.path());

    // The plugin serves: NVML open, an MPS share's daemon with the share's settings.
    let plugin = driver.nvml();
    let discovered = plugin.discover().unwrap();
    assert_eq!(
        discovered.driver_version.as_deref(),
        Some(SIMULATED_DRIVER_VERSION)
    );
    let defaults = DaemonDefaults {
        active_thread_percentage: Some(40),
        pinned_memory_bytes: Some(2 << 30),
    };
    supervisor_protocol::request(
        &supervisor.socket,
        &Request::Start {
            key: "gpu-0".into(),
            uuid: discovered.gpus[0].uuid.clone(),
            defaults,
        },
    )
    .unwrap();
    let daemon = supervisor.pid_of("gpu-0").expect("the share's daemon runs");
    let settings = |s: &SupervisorProcess| {
        (
            s.send("gpu-0", "get_default_active_thread_percentage").unwrap(),
            s.send("gpu-0", "get_default_device_pinned_mem_limit 0").unwrap(),
        )
    };
    let before = settings(&supervisor);

    // The drain keeps the plugin serving (kubelet unprepares the evicted pods' claims through it); the
    // restart of the driver pod is where its module is unloaded. A plugin that did not let go then (the
    // old plugin) makes the Operator's unload fail.
    let mut tracker = UpgradeTracker::holding();
    assert_eq!(tracker.observe(&state("drain-required")), Step::Stay);
    let Step::Release(reason) = tracker.observe(&state("pod-restart-required")) else {
        panic!("pod-restart-required must release the driver");
    };
    let refused = upgrade(&driver.root, NEW).unwrap_err().to_string();
    assert!(
        refused.contains("Module nvidia is in use")
            && refused.contains(&format!("pid {}", std::process::id())),
        "{refused}"
    );

    // Letting go: the supervisor pauses its daemons, the plugin's NVML session ends with its process.
    let paused = supervisor_protocol::pause(&supervisor.socket, &reason.describe()).unwrap();
    assert_eq!(paused, ["gpu-0"]);
    wait_for("the paused daemon to exit", || !alive(daemon));
    assert!(supervisor.running().is_empty());
    drop(plugin);
    assert!(
        live_sessions(&driver.kernel).is_empty(),
        "{:?}",
        live_sessions(&driver.kernel)
    );
    // Paused, the supervisor starts nothing: not the watchdog, not a request, not itself restarted.
    let start = Request::Start {
        key: "gpu-0".into(),
        uuid: discovered.gpus[0].uuid.clone(),
        defaults,
    };
    let e = supervisor_protocol::request(&supervisor.socket, &start).unwrap_err();
    assert!(e.to_string().contains("driver upgrade"), "{e}");
    drop(supervisor);
    let supervisor = SupervisorProcess::start(dir.path());
    assert!(
        supervisor.running().is_empty(),
        "a supervisor restarted during the upgrade keeps the daemons stopped"
    );

    // The Operator's swap goes through.
    upgrade(&driver.root, NEW).unwrap();

    // Come back: the plugin loads the new driver, the daemon serves again with the share's settings.
    assert_eq!(tracker.observe(&state("validation-required")), Step::ComeBack);
    let plugin = driver.nvml();
    assert_eq!(plugin.discover().unwrap().driver_version.as_deref(), Some(NEW));
    assert_eq!(
        supervisor_protocol::resume(&supervisor.socket).unwrap(),
        ["gpu-0"]
    );
    let restored = supervisor.pid_of("gpu-0").expect("the daemon runs again");
    assert_ne!(restored, daemon);
    assert_eq!(settings(&supervisor), before);
    assert_eq!(before.0.trim(), "40.0", "{before:?}");
    // A second resume (a plugin restarted later) changes nothing.
    assert_eq!(
        supervisor_protocol::resume(&supervisor.socket).unwrap(),
        ["gpu-0"]
    );
    assert_eq!(supervisor.pid_of("gpu-0"), Some(restored));
}

// === The plugin binary through an upgrade ===

const NODE: &str = "upgrade-node";

/// An API server stand-in: the Node with labels the test sets (`GET`, list, and a watch that sends each
/// change as a `MODIFIED` event), an empty list of ResourceClaims, 404 for everything else (the plugin's
/// inventory and Lease writes fail and are retried, which this test does not look at).
#[derive(Clone)]
struct NodeApi {
    url: String,
    labels: tokio::sync::watch::Sender<(u64, BTreeMap<String, String>)>,
}

impl NodeApi {
    async fn start(labels: BTreeMap<String, String>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let api = Self {
            url: format!("http://{}", listener.local_addr().unwrap()),
            labels: tokio::sync::watch::channel((1, labels)).0,
        };
        let a = api.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(a.clone().serve(conn));
            }
        });
        api
    }

    /// The Operator (or its driver manager) relabels the node.
    fn set(&self, labels: BTreeMap<String, String>) {
        self.labels.send_modify(|(rv, l)| {
            *rv += 1;
            *l = labels;
        });
    }

    fn node(rv: u64, labels: &BTreeMap<String, String>) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE, "uid": "node-uid", "resourceVersion": rv.to_string(), "labels": labels},
        })
    }

    /// HTTP/1.1 with keep-alive, as kube's client speaks it; a watch is answered chunked, for as long as the
    /// connection lasts.
    async fn serve(self, conn: tokio::net::TcpStream) {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
        let (read, mut write) = conn.into_split();
        let mut read = BufReader::new(read);
        loop {
            let mut request_line = String::new();
            if read.read_line(&mut request_line).await.unwrap_or(0) == 0 {
                return;
            }
            let mut body_len = 0;
            loop {
                let mut header = String::new();
                if read.read_line(&mut header).await.unwrap_or(0) == 0 {
                    return;
                }
                if header == "\r\n" {
                    break;
                }
                if let Some((name, value)) = header.split_once(':')
                    && name.eq_ignore_ascii_case("content-length")
                {
                    body_len = value.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; body_len];
            if read.read_exact(&mut body).await.is_err() {
                return;
            }
            let target = request_line.split_whitespace().nth(1).unwrap_or("/").to_string();
            let (path, query) = target.split_once('?').unwrap_or((&target, ""));
            if path == "/api/v1/nodes" && query.split('&').any(|q| q == "watch=true" || q == "watch=1") {
                let head =
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
                if write.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let mut changes = self.labels.subscribe();
                changes.mark_unchanged();
                while changes.changed().await.is_ok() {
                    let (rv, labels) = changes.borrow_and_update().clone();
                    let event = serde_json::json!({"type": "MODIFIED", "object": Self::node(rv, &labels)});
                    let line = format!("{event}\n");
                    let chunk = format!("{:x}\r\n{line}\r\n", line.len());
                    if write.write_all(chunk.as_bytes()).await.is_err() {
                        return;
                    }
                }
                return;
            }
            let (rv, labels) = self.labels.borrow().clone();
            let (status, json) = match path {
                "/api/v1/nodes" => (
                    "200 OK",
                    serde_json::json!({"apiVersion": "v1", "kind": "NodeList",
                        "metadata": {"resourceVersion": rv.to_string()}, "items": [Self::node(rv, &labels)]})
                    .to_string(),
                ),
                p if p == format!("/api/v1/nodes/{NODE}") => ("200 OK", Self::node(rv, &labels).to_string()),
                "/apis/resource.k8s.io/v1/resourceclaims" => (
                    "200 OK",
                    r#"{"apiVersion":"resource.k8s.io/v1","kind":"ResourceClaimList","metadata":{},"items":[]}"#
                        .to_string(),
                ),
                _ => (
                    "404 Not Found",
                    r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}"#
                        .to_string(),
                ),
            };
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{json}",
                json.len()
            );
            if write.write_all(response.as_bytes()).await.is_err() {
                return;
            }
        }
    }
}

/// The plugin binary on the nvml backend over `driver`'s root, with every directory under `d`.
struct PluginProcess {
    child: Child,
    log: PathBuf,
}

impl PluginProcess {
    fn start(d: &Path, driver: &sim_driver::BuiltDriver, api: &NodeApi, n: u32) -> Self {
        std::fs::write(d.join("boot_id"), "boot-1\n").unwrap();
        let log = d.join(format!("plugin-{n}.log"));
        let child = common::plugin_command_in(d, NODE, &api.url)
            .args(["--backend", "nvml", "--heartbeat-interval", "60"])
            .arg("--driver-root")
            .arg(&driver.root)
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Self { child, log }
    }

    fn logged(&self, text: &str) {
        wait_for(&format!("the plugin to log {text:?}"), || {
            std::fs::read_to_string(&self.log).is_ok_and(|l| l.contains(text))
        });
    }

    fn exited(&mut self) -> std::process::ExitStatus {
        let mut status = None;
        wait_for("the plugin to exit", || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        });
        status.unwrap()
    }
}

impl Drop for PluginProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The plugin's NVML sessions of `kernel` (its NVML backend and its health source each hold one).
fn sessions_of(kernel: &Path, pid: u32) -> usize {
    live_sessions(kernel).iter().filter(|s| s.pid == pid).count()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_plugin_lets_go_of_nvml_when_the_operator_restarts_the_driver_and_serves_again_on_the_new_one() {
    use std::os::unix::process::ExitStatusExt;
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 1).build();
    let dir = tempfile::tempdir().unwrap();
    let api = NodeApi::start(state("upgrade-done")).await;

    // Serving: the plugin holds NVML, so the driver cannot be swapped.
    let mut serving = PluginProcess::start(dir.path(), &driver, &api, 1);
    let pid = serving.child.id();
    wait_for("the serving plugin's NVML session", || {
        sessions_of(&driver.kernel, pid) > 0
    });
    serving.logged("watching this node for a GPU Operator driver upgrade");
    assert!(upgrade(&driver.root, NEW).is_err());

    // The drain keeps it serving; the driver pod's restart makes it let go: exit 75, no session left.
    api.set(state("drain-required"));
    api.set(state("pod-restart-required"));
    let status = serving.exited();
    assert_eq!(status.code(), Some(75), "{status:?}");
    assert_eq!(status.signal(), None);
    assert!(
        live_sessions(&driver.kernel).is_empty(),
        "{:?}",
        live_sessions(&driver.kernel)
    );
    drop(serving);

    // kubelet restarts it: it waits without the driver and answers prepares with the upgrade's message.
    let waiting = PluginProcess::start(dir.path(), &driver, &api, 2);
    waiting.logged("waiting without the driver");
    let paths = tessera_kubelet_plugin::kubelet::driver::SocketPaths::for_pod(
        &dir.path().join("registry"),
        &dir.path().join("plugins"),
        None,
    );
    let mut dra =
        tessera_proto::dra::v1::dra_plugin_client::DraPluginClient::new(common::dial(&paths.dra).await);
    let answer = dra
        .node_prepare_resources(tessera_proto::dra::v1::NodePrepareResourcesRequest {
            claims: vec![tessera_proto::dra::v1::Claim {
                namespace: "default".into(),
                name: "c".into(),
                uid: "uid-c".into(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let error = &answer.claims["uid-c"].error;
    assert!(
        error.contains("being upgraded") && error.contains("pod-restart-required"),
        "{error}"
    );
    assert_eq!(sessions_of(&driver.kernel, waiting.child.id()), 0);
    upgrade(&driver.root, NEW).expect("the swap goes through while the plugin waits");

    // The upgrade moves on: the plugin loads the new driver.
    api.set(state("validation-required"));
    waiting.logged("the driver upgrade moved on and the driver is installed");
    wait_for("the plugin's NVML session on the new driver", || {
        sessions_of(&driver.kernel, waiting.child.id()) > 0
    });
    // The driver watch starts with the version NVML reported: the new one.
    waiting.logged("watching the driver root for a driver upgrade");
    let log = std::fs::read_to_string(&waiting.log).unwrap();
    let watch_line = log
        .lines()
        .find(|l| l.contains("watching the driver root for a driver upgrade"))
        .unwrap();
    assert!(watch_line.contains(NEW), "{watch_line}");
}
