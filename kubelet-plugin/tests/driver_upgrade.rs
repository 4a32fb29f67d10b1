//! A driver upgrade under the GPU Operator (issue 38, item 4): the Operator unloads the old kernel module
//! before it loads the new one, which the kernel refuses while anything holds the GPU. Over the simulated
//! driver root's real `libnvidia-ml.so.1` (whose sessions the simulated kernel counts as module users) and
//! the MPS supervisor as its own process: a plugin that keeps its NVML session makes the swap fail; one
//! that lets go when the Node's labels say so (`gpu::driver_upgrade`), with the supervisor's daemons paused,
//! lets it through, and both come back on the new driver with the daemons' settings.
//!
//! Build the libraries first as for `nvml_defects`:
//! `cargo test -p tessera-kubelet-plugin --test driver_upgrade`.

#[path = "common/sim_driver.rs"]
mod sim_driver;

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
