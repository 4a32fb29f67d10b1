//! MPS daemons owned by the node's supervisor outlive the plugin: with real processes (the supervisor is
//! the plugin binary's `mps-supervisor`, the plugin a child process of this test that is SIGKILLed while a
//! share is prepared), a restarted plugin re-attaches to the daemon and its unprepare stops it.

mod common;

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::Arc,
    time::{Duration, Instant},
};

use k8s_openapi::api::resource::v1::ResourceClaim;
use tessera_kubelet_plugin::devices::preparers::SharedPreparer;
use tessera_kubelet_plugin::devices::sharing::mps::Launcher;
use tessera_kubelet_plugin::devices::sharing::supervisor_protocol;
use tessera_kubelet_plugin::devices::sharing::supervisor_protocol::Request;
use tessera_kubelet_plugin::gpu::{ComputeMode, GpuBackend};
use tessera_kubelet_plugin::kubelet::claims::fake::{FakeClaims, claim};
use tessera_kubelet_plugin::node::state::{ClaimRef, NodeState};
use tessera_sim_model::backend::SimulatedBackend;

/// Set in the child process: it plays the plugin over this directory until it is killed.
const PLUGIN_DIR_ENV: &str = "TESSERA_TEST_PLUGIN_DIR";
const TEST_NAME: &str = "an_mps_daemon_outlives_a_killed_plugin_and_a_restarted_plugin_stops_it";

fn plugin_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"))
}

fn share_claim() -> ResourceClaim {
    claim("share")
        .uid("uid-share")
        .allocated_share("gpu-0-shared", "s1")
        .consumed("compute", "50")
        .build()
}

/// The plugin as the binary assembles it with `--mps-supervisor-socket`, over `dir`.
fn plugin(dir: &Path, claims: FakeClaims) -> (Arc<NodeState>, Arc<SharedPreparer>, Arc<SimulatedBackend>) {
    let launcher = Launcher::Supervisor {
        socket: dir.join("supervisor.sock"),
    };
    common::assembled_plugin(dir, 1, launcher, claims)
}

fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()) != Some("Z"))
}

fn parent_pid(pid: u32) -> Option<u32> {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))?
        .trim()
        .parse()
        .ok()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills what the test started, also when an assertion fails half-way.
struct Cleanup {
    children: Vec<Child>,
    daemon: Option<u32>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(pid) = self.daemon.filter(|p| alive(*p)) {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
    }
}

/// The child process: prepares the share, says so, and waits to be killed.
async fn play_plugin(dir: PathBuf) {
    let claims = FakeClaims::new();
    let c = share_claim();
    let r = ClaimRef::of(&c);
    claims.insert(c);
    let (state, _, _) = plugin(&dir, claims);
    state.prepare(&r).await.unwrap();
    fs::write(dir.join("prepared"), b"yes").unwrap();
    tokio::time::sleep(Duration::from_secs(120)).await;
}

#[tokio::test]
async fn an_mps_daemon_outlives_a_killed_plugin_and_a_restarted_plugin_stops_it() {
    if let Ok(dir) = std::env::var(PLUGIN_DIR_ENV) {
        return play_plugin(PathBuf::from(dir)).await;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let socket = dir.join("supervisor.sock");
    let mut cleanup = Cleanup {
        children: Vec::new(),
        daemon: None,
    };
    let supervisor_process = Command::new(plugin_binary())
        .arg("mps-supervisor")
        .arg("--socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--backend", "simulated"])
        .spawn()
        .unwrap();
    let supervisor_pid = supervisor_process.id();
    cleanup.children.push(supervisor_process);
    wait_for("the supervisor's socket", || socket.exists());

    let plugin_process = Command::new(std::env::current_exe().unwrap())
        .args([TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env(PLUGIN_DIR_ENV, &dir)
        .spawn()
        .unwrap();
    cleanup.children.push(plugin_process);
    let child = &mut cleanup.children[1];
    wait_for("the plugin to prepare the share", || {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the plugin process exited with {status} before preparing the share");
        }
        dir.join("prepared").exists()
    });

    // The share's namespace's own daemon (claims of the fake source are in `default`).
    let daemon = supervisor_protocol::request(
        &socket,
        &Request::Pid {
            key: "gpu-0@default".into(),
        },
    )
    .unwrap()
    .pid
    .expect("a daemon for the share");
    cleanup.daemon = Some(daemon);
    assert_eq!(
        parent_pid(daemon),
        Some(supervisor_pid),
        "the supervisor, not the plugin, owns the daemon"
    );

    // kill -9 the plugin while the share is prepared.
    let mut killed = cleanup.children.remove(1);
    killed.kill().unwrap();
    killed.wait().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(alive(daemon), "the daemon must survive the plugin");

    let (state, shared, backend) = plugin(&dir, FakeClaims::new());
    assert_eq!(shared.sharer.mps().running(), vec!["gpu-0@default".to_string()]);
    assert_eq!(shared.sharer.mps().pid("gpu-0@default"), Some(daemon));
    assert_eq!(backend.compute_mode(0).unwrap(), ComputeMode::ExclusiveProcess);
    state.unprepare(&ClaimRef::of(&share_claim())).await.unwrap();
    wait_for("the daemon to exit", || !alive(daemon));
    assert!(shared.sharer.mps().running().is_empty());
    assert_eq!(backend.compute_mode(0).unwrap(), ComputeMode::Default);
}

#[tokio::test]
async fn a_share_prepared_while_the_supervisor_is_away_is_sent_for_a_retry_and_a_wrong_allocation_is_not() {
    let tmp = tempfile::tempdir().unwrap();
    let claims = FakeClaims::new();
    let share = share_claim();
    let elsewhere = claim("elsewhere").uid("uid-elsewhere").allocated("gpu-9").build();
    let (share_ref, elsewhere_ref) = (ClaimRef::of(&share), ClaimRef::of(&elsewhere));
    claims.insert(share).insert(elsewhere);
    let (sink, mut failed) = tokio::sync::mpsc::unbounded_channel();
    // No supervisor serves the socket: its pod is being replaced.
    let launcher = Launcher::Supervisor {
        socket: tmp.path().join("supervisor.sock"),
    };
    let (state, _, _) = common::assembled_plugin_with(tmp.path(), 1, launcher, claims, |s| {
        s.reporting_failed_prepares(sink)
    });

    let results = state.prepare_all(&[share_ref.clone(), elsewhere_ref]).await;
    let errors: Vec<String> = results
        .iter()
        .map(|(_, r)| r.as_ref().expect_err("both fail").to_string())
        .collect();
    assert!(
        errors[0].contains("cannot reach the MPS supervisor"),
        "{errors:?}"
    );
    assert!(errors[1].contains("gpu-9"), "{errors:?}");
    assert_eq!(
        failed.try_recv().ok(),
        Some(share_ref),
        "the share waits for a retry"
    );
    assert!(
        failed.try_recv().is_err(),
        "a device this node does not have will not appear by retrying"
    );
}
