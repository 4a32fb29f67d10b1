//! A share's MPS daemon comes back with its settings after whatever ended it: a restarted supervisor
//! restores every daemon of its record at once (in the pipe directories the clients' containers have
//! mounted), its watchdog restarts a daemon that crashed, SIGTERM makes it quit its daemons and exit at
//! once, and the plugin's watch starts the daemon of a prepared share again (also after a plugin restart,
//! with the defaults its checkpoint kept). Real processes throughout: the simulated daemon is the plugin
//! binary's `mps-control-sim`, the supervisor its `mps-supervisor`.

mod common;

use std::{
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::{Child, Command},
    sync::Arc,
    time::{Duration, Instant},
};

use tessera_api::{DeviceName, config::SharingStrategy};
use tessera_kubelet_plugin::devices::preparers::SharedPreparer;
use tessera_kubelet_plugin::devices::sharing::Sharer;
use tessera_kubelet_plugin::devices::sharing::mps::{Launcher, MpsManager, send_control};
use tessera_kubelet_plugin::devices::sharing::supervisor::{DaemonRecord, RECORD_FILE, Supervisor};
use tessera_kubelet_plugin::devices::sharing::supervisor_protocol;
use tessera_kubelet_plugin::devices::sharing::supervisor_protocol::{DaemonDefaults, Request};
use tessera_kubelet_plugin::gpu::GpuBackend;
use tessera_kubelet_plugin::kubelet::claims::fake::{FakeClaims, NODE, claim};
use tessera_kubelet_plugin::node::state::{ClaimRef, NodeState};
use tessera_sim_model::backend::{NodeSpec, SimulatedBackend};

use common::BOOT_ID as BOOT;
const GPU0: &str = "GPU-0a1b2c3d-0000-1111-2222-333344445555";
const GPU1: &str = "GPU-0a1b2c3d-0000-1111-2222-333344446666";

fn plugin_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"))
}

fn simulated(state: &Path) -> MpsManager {
    MpsManager::new(
        state,
        Launcher::Simulated {
            program: plugin_binary(),
        },
    )
}

/// A supervisor as `mps-supervisor` builds it, over `state`, in this process.
fn supervisor_in(state: &Path, boot: &str) -> Supervisor {
    Supervisor::new(simulated(state).owning_children(false), boot)
}

fn defaults(percentage: u32, pinned_mib: u64) -> DaemonDefaults {
    DaemonDefaults {
        active_thread_percentage: Some(percentage),
        pinned_memory_bytes: Some(pinned_mib << 20),
    }
}

fn start(key: &str, uuid: &str, defaults: DaemonDefaults) -> Request {
    Request::Start {
        key: key.into(),
        uuid: uuid.into(),
        defaults,
    }
}

/// What a client of the daemon of `key` reads through its control socket: the daemon's defaults.
fn settings(state: &Path, key: &str) -> (String, String) {
    let pipe = state.join("mps").join(key).join("pipe");
    (
        send_control(&pipe, "get_default_active_thread_percentage").unwrap_or_default(),
        send_control(&pipe, "get_default_device_pinned_mem_limit 0").unwrap_or_default(),
    )
}

fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()) != Some("Z"))
}

fn kill9(pid: u32) {
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let began = Instant::now();
    while !done() {
        assert!(
            began.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    began.elapsed()
}

/// Kills the daemons and processes a test started, also when an assertion fails half-way.
#[derive(Default)]
struct Cleanup {
    children: Vec<Child>,
    pids: Vec<u32>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for pid in self.pids.iter().copied().filter(|p| alive(*p)) {
            kill9(pid);
        }
    }
}

#[test]
fn a_restarted_supervisor_brings_back_every_recorded_daemon_with_its_settings_in_the_same_pipe_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path();
    let mut cleanup = Cleanup::default();
    let first = supervisor_in(state, BOOT);
    for (key, uuid, d) in [
        ("gpu-0", GPU0, defaults(30, 2048)),
        ("gpu-1", GPU1, defaults(50, 4096)),
    ] {
        let answer = first.handle(&start(key, uuid, d));
        assert_eq!(answer.error, None, "{key}");
        cleanup.pids.extend(answer.pid);
    }
    let record = DaemonRecord::load(&state.join(RECORD_FILE)).unwrap();
    assert_eq!(record.boot_id, BOOT);
    assert_eq!(
        record.daemons.keys().collect::<Vec<_>>(),
        ["gpu-0", "gpu-1"],
        "the record holds every daemon asked for"
    );
    assert_eq!(record.daemons["gpu-1"].defaults, defaults(50, 4096));
    let pipe_inode = fs::metadata(state.join("mps/gpu-0/pipe")).unwrap().ino();

    // The supervisor's container ends: its daemons end with it.
    let old: Vec<u32> = ["gpu-0", "gpu-1"]
        .iter()
        .filter_map(|k| first.manager().pid(k))
        .collect();
    drop(first);
    for pid in &old {
        kill9(*pid);
    }
    wait_for("the old daemons to die", Duration::from_secs(10), || {
        old.iter().all(|p| !alive(*p))
    });

    let second = supervisor_in(state, BOOT);
    let began = Instant::now();
    let restored = second.restore();
    let took = began.elapsed();
    println!("restored {} daemons in {took:?}", restored.serving.len());
    cleanup
        .pids
        .extend(["gpu-0", "gpu-1"].iter().filter_map(|k| second.manager().pid(k)));
    assert_eq!(restored.serving, ["gpu-0", "gpu-1"], "{restored:?}");
    assert!(restored.failed.is_empty(), "{restored:?}");
    assert_eq!(
        settings(state, "gpu-0"),
        ("30.0".into(), "2048M".into()),
        "gpu-0's daemon is back with its defaults"
    );
    assert_eq!(settings(state, "gpu-1"), ("50.0".into(), "4096M".into()));
    assert_eq!(
        fs::metadata(state.join("mps/gpu-0/pipe")).unwrap().ino(),
        pipe_inode,
        "the restored daemon serves from the directory the clients' containers have mounted"
    );
    for key in ["gpu-0", "gpu-1"] {
        let pid = second.manager().pid(key).expect("a restored daemon");
        assert!(!old.contains(&pid), "{key} runs a new daemon");
    }
}

#[test]
fn a_stopped_daemon_leaves_the_record_and_a_start_that_fails_is_not_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path();
    let mut cleanup = Cleanup::default();
    let s = supervisor_in(state, BOOT);
    cleanup
        .pids
        .extend(s.handle(&start("gpu-0", GPU0, DaemonDefaults::default())).pid);
    assert_eq!(s.handle(&Request::Stop { key: "gpu-0".into() }).error, None);
    assert!(
        DaemonRecord::load(&state.join(RECORD_FILE))
            .unwrap()
            .daemons
            .is_empty(),
        "a stopped daemon is not restored"
    );

    let broken = Supervisor::new(
        MpsManager::new(
            state,
            Launcher::Simulated {
                program: state.join("no-such-binary"),
            },
        )
        .owning_children(false),
        BOOT,
    );
    let answer = broken.handle(&start("gpu-1", GPU1, DaemonDefaults::default()));
    assert!(answer.error.is_some(), "{answer:?}");
    assert!(
        broken.desired().is_empty(),
        "a daemon that never served is not restored"
    );
}

#[test]
fn a_record_of_an_earlier_boot_restores_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path();
    let mut cleanup = Cleanup::default();
    let before = supervisor_in(state, BOOT);
    cleanup.pids.extend(
        before
            .handle(&start("gpu-0", GPU0, DaemonDefaults::default()))
            .pid,
    );
    before.shutdown();

    let after_reboot = supervisor_in(state, "99999999-2222-3333-4444-555555555555");
    let restored = after_reboot.restore();
    assert_eq!(restored.dropped, ["gpu-0"]);
    assert!(restored.serving.is_empty());
    assert_eq!(after_reboot.manager().pid("gpu-0"), None);
    assert!(after_reboot.desired().is_empty());
}

#[test]
fn the_watchdog_starts_a_daemon_that_died_on_its_own_again_with_its_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path();
    let mut cleanup = Cleanup::default();
    let s = supervisor_in(state, BOOT);
    let pid = s.handle(&start("gpu-0", GPU0, defaults(25, 1024))).pid.unwrap();
    cleanup.pids.push(pid);
    assert!(s.watch_once().is_empty(), "a running daemon is left alone");
    kill9(pid);
    wait_for("the daemon to die", Duration::from_secs(10), || !alive(pid));
    assert_eq!(s.watch_once(), ["gpu-0"]);
    let again = s.manager().pid("gpu-0").expect("a new daemon");
    cleanup.pids.push(again);
    assert_ne!(again, pid);
    assert_eq!(settings(state, "gpu-0"), ("25.0".into(), "1024M".into()));
}

fn spawn_supervisor(dir: &Path, socket: &Path) -> Child {
    let boot = dir.join("boot_id");
    fs::write(&boot, format!("{BOOT}\n")).unwrap();
    Command::new(plugin_binary())
        .arg("mps-supervisor")
        .arg("--socket")
        .arg(socket)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(["--backend", "simulated"])
        .arg("--boot-id-file")
        .arg(&boot)
        .spawn()
        .unwrap()
}

#[test]
fn the_supervisor_quits_its_daemons_and_exits_at_once_on_sigterm_and_the_next_one_restores_them() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let socket = dir.join("supervisor.sock");
    let mut cleanup = Cleanup::default();
    cleanup.children.push(spawn_supervisor(dir, &socket));
    wait_for("the supervisor's socket", Duration::from_secs(30), || {
        supervisor_protocol::request(&socket, &Request::Running).is_ok()
    });
    let pid = supervisor_protocol::request(&socket, &start("gpu-0", GPU0, defaults(40, 3072)))
        .unwrap()
        .pid
        .unwrap();
    cleanup.pids.push(pid);

    let mut first = cleanup.children.remove(0);
    Command::new("kill")
        .args(["-TERM", &first.id().to_string()])
        .status()
        .unwrap();
    let mut status = None;
    let stopped = wait_for(
        "the supervisor to exit after SIGTERM",
        Duration::from_secs(20),
        || {
            status = first.try_wait().unwrap();
            status.is_some()
        },
    );
    println!("the supervisor exited {stopped:?} after SIGTERM");
    assert!(status.unwrap().success(), "exit status {status:?}");
    assert!(!alive(pid), "its daemon quit with it");

    cleanup.children.push(spawn_supervisor(dir, &socket));
    let began = Instant::now();
    let back = wait_for("the daemon back", Duration::from_secs(30), || {
        settings(&dir.join("state"), "gpu-0").0 == "40.0"
    });
    println!("the next supervisor's daemon answered {back:?} after its start");
    assert_eq!(
        settings(&dir.join("state"), "gpu-0"),
        ("40.0".into(), "3072M".into())
    );
    let again = supervisor_protocol::request(&socket, &Request::Pid { key: "gpu-0".into() })
        .unwrap()
        .pid
        .expect("the restored daemon");
    cleanup.pids.push(again);
    assert!(began.elapsed() < Duration::from_secs(30));
}

// --- the plugin's side ---------------------------------------------------------------------------

/// The daemon the plugin starts for the shares of GPU 0 of the test claims' namespace (`default`):
/// each namespace has its own.
const PLUGIN_DAEMON: &str = "gpu-0@default";

fn share_claim() -> k8s_openapi::api::resource::v1::ResourceClaim {
    claim("share")
        .uid("uid-share")
        .allocated_share("gpu-0-shared", "s1")
        .consumed("compute", "50")
        .config(serde_json::json!({
            "apiVersion": "gpu.tessera.dev/v1alpha1",
            "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {
                "defaultActiveThreadPercentage": 60,
                "defaultPinnedDeviceMemoryLimit": "8Gi",
            }},
        }))
        .build()
}

/// The plugin as the binary assembles it, over `dir`, with daemons it starts itself (no supervisor).
fn plugin(dir: &Path, claims: FakeClaims) -> (Arc<NodeState>, Arc<SharedPreparer>, Arc<SimulatedBackend>) {
    let launcher = Launcher::Simulated {
        program: plugin_binary(),
    };
    common::assembled_plugin(dir, 2, launcher, claims)
}

#[tokio::test]
async fn the_plugin_starts_a_prepared_shares_daemon_again_with_the_defaults_its_checkpoint_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let state_dir = dir.join("state");
    let mut cleanup = Cleanup::default();
    let claims = FakeClaims::new();
    let c = share_claim();
    claims.insert(c.clone());
    let (state, shared, backend) = plugin(dir, claims);
    state.prepare(&ClaimRef::of(&c)).await.unwrap();
    let gpus = backend.discover().unwrap().gpus;
    let mps = shared.sharer.mps().clone();
    let first = mps.pid(PLUGIN_DAEMON).expect("the share's daemon");
    cleanup.pids.push(first);
    assert_eq!(
        settings(&state_dir, PLUGIN_DAEMON),
        ("60.0".into(), "8192M".into())
    );
    let watch = shared.watch_daemons(&gpus, true);
    assert_eq!(watch.up, [PLUGIN_DAEMON], "{watch:?}");

    // The plugin restarts; then the daemon is gone (its supervisor replaced, a crash).
    drop((state, shared));
    let (state, shared, _) = plugin(dir, FakeClaims::new());
    kill9(first);
    wait_for("the daemon to die", Duration::from_secs(10), || !alive(first));
    let watch = shared.watch_daemons(&gpus, true);
    assert_eq!(watch.restarted, [PLUGIN_DAEMON], "{watch:?}");
    let again = mps.pid(PLUGIN_DAEMON).expect("the daemon started again");
    cleanup.pids.push(again);
    assert_ne!(again, first);
    assert_eq!(
        settings(&state_dir, PLUGIN_DAEMON),
        ("60.0".into(), "8192M".into()),
        "the daemon is back with the first share's defaults, from the checkpoint"
    );
    assert!(shared.sharer.daemons_down().is_empty());

    // A daemon no prepared share uses (a stop lost in a crash) is stopped by the watch.
    mps.start("gpu-1", GPU1, DaemonDefaults::default()).unwrap();
    cleanup.pids.extend(mps.pid("gpu-1"));
    let watch = shared.watch_daemons(&gpus, true);
    assert_eq!(watch.stopped, ["gpu-1"], "{watch:?}");
    assert_eq!(mps.pid("gpu-1"), None);

    state.unprepare(&ClaimRef::of(&c)).await.unwrap();
    assert!(mps.running().is_empty());
    let watch = shared.watch_daemons(&gpus, true);
    assert!(watch.restarted.is_empty() && watch.up.is_empty(), "{watch:?}");
}

/// A sharer whose daemons an MPS supervisor (started here, on `socket`) runs, over one simulated H100.
struct Supervised {
    sharer: Sharer,
    mps: MpsManager,
    gpus: Vec<tessera_api::GpuInfo>,
}

fn supervised(dir: &Path, socket: &Path, cleanup: &mut Cleanup) -> Supervised {
    cleanup.children.push(spawn_supervisor(dir, socket));
    wait_for("the supervisor's socket", Duration::from_secs(30), || {
        supervisor_protocol::request(socket, &Request::Running).is_ok()
    });
    let state_dir = dir.join("state");
    let backend = Arc::new(
        SimulatedBackend::from_spec(
            NODE,
            &NodeSpec::default().with_gpus("H100-SXM5-80GB", 1),
            &state_dir,
        )
        .unwrap(),
    );
    let gpus = backend.discover().unwrap().gpus;
    let mps = MpsManager::new(
        &state_dir,
        Launcher::Supervisor {
            socket: socket.to_path_buf(),
        },
    );
    let sharer = Sharer::new(backend, mps.clone(), false);
    Supervised { sharer, mps, gpus }
}

/// SIGKILLs the first supervisor and every daemon started so far (a killed supervisor leaves its daemons
/// orphans here, where no container ends them).
fn kill_supervisor_and_daemons(cleanup: &mut Cleanup) {
    let mut gone = cleanup.children.remove(0);
    gone.kill().unwrap();
    gone.wait().unwrap();
    for pid in cleanup.pids.clone() {
        kill9(pid);
    }
}

/// Starts a new supervisor on `socket` and waits for it to restore GPU 0's daemon from its record.
fn restore_gpu0(dir: &Path, socket: &Path, mps: &MpsManager, cleanup: &mut Cleanup) {
    cleanup.children.push(spawn_supervisor(dir, socket));
    wait_for("the restored daemon", Duration::from_secs(30), || {
        mps.is_running("gpu-0")
    });
    cleanup.pids.extend(mps.pid("gpu-0"));
}

const GPU0_SHARED: DeviceName = DeviceName::SharedGpu { gpu: 0 };

/// Prepares an MPS share of GPU 0 for `holder`, with no config.
fn share_gpu0(sharer: &Sharer, gpus: &[tessera_api::GpuInfo], holder: &str) {
    sharer
        .prepare(&tessera_kubelet_plugin::devices::sharing::ShareRequest {
            holder: holder.into(),
            device: &GPU0_SHARED,
            gpu: &gpus[0],
            uuid: &gpus[0].uuid,
            strategy: SharingStrategy::Mps,
            mps: None,
            interval: Default::default(),
            consumed: &Default::default(),
            tenant: None,
        })
        .unwrap();
}

#[tokio::test]
async fn a_share_whose_daemon_cannot_start_stays_reported_down_until_it_is_back() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut cleanup = Cleanup::default();
    let socket = dir.join("supervisor.sock");
    let Supervised { sharer, mps, gpus } = supervised(dir, &socket, &mut cleanup);
    share_gpu0(&sharer, &gpus, "uid-a/gpu-0-shared");
    cleanup.pids.extend(mps.pid("gpu-0"));

    // The supervisor goes (SIGKILL: its daemon stays an orphan here, so kill it too).
    kill_supervisor_and_daemons(&mut cleanup);
    let watch = sharer.watch_daemons(&gpus, true);
    assert_eq!(watch.down, ["gpu-0"], "{watch:?}");
    let problems = tessera_kubelet_plugin::devices::sharing::daemons_down_problems(&sharer.daemons_down());
    assert_eq!(problems.len(), 1);
    assert!(
        problems[0].contains("the MPS daemon of gpu-0") && problems[0].contains("MPS supervisor"),
        "{problems:?}"
    );

    // A new supervisor restores the daemon from its record; the next watch sees it back.
    restore_gpu0(dir, &socket, &mps, &mut cleanup);
    let watch = sharer.watch_daemons(&gpus, true);
    assert_eq!(watch.up, ["gpu-0"], "{watch:?}");
    assert!(sharer.daemons_down().is_empty());
}

#[tokio::test]
async fn a_daemon_its_supervisor_replaced_between_two_watches_is_reported_replaced_not_up() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut cleanup = Cleanup::default();
    let socket = dir.join("supervisor.sock");
    let Supervised { sharer, mps, gpus } = supervised(dir, &socket, &mut cleanup);
    share_gpu0(&sharer, &gpus, "uid-a/gpu-0-shared");
    cleanup.pids.extend(mps.pid("gpu-0"));
    let watch = sharer.watch_daemons(&gpus, true);
    assert_eq!(watch.up, ["gpu-0"], "{watch:?}");
    let watch = sharer.watch_daemons(&gpus, true);
    assert_eq!(
        watch.up,
        ["gpu-0"],
        "the same daemon twice is up, not replaced: {watch:?}"
    );

    // The supervisor and its daemon go and a new supervisor restores the daemon, all between two watches.
    kill_supervisor_and_daemons(&mut cleanup);
    restore_gpu0(dir, &socket, &mps, &mut cleanup);
    let watch = sharer.watch_daemons(&gpus, true);
    assert_eq!(watch.replaced, ["gpu-0"], "{watch:?}");
    assert!(watch.up.is_empty() && watch.down.is_empty(), "{watch:?}");
    let watch = sharer.watch_daemons(&gpus, true);
    assert_eq!(watch.up, ["gpu-0"], "reported once: {watch:?}");

    // The sharer's own stop and start (last share gone, a new first share) is no replacement.
    sharer
        .unprepare(&gpus[0], &GPU0_SHARED, "uid-a/gpu-0-shared", SharingStrategy::Mps)
        .unwrap();
    share_gpu0(&sharer, &gpus, "uid-b/gpu-0-shared");
    cleanup.pids.extend(mps.pid("gpu-0"));
    let watch = sharer.watch_daemons(&gpus, true);
    assert_eq!(watch.up, ["gpu-0"], "{watch:?}");
}

#[tokio::test]
async fn a_share_slots_daemon_gets_the_slots_size_as_its_defaults_so_a_client_without_env_cannot_exceed_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut cleanup = Cleanup::default();
    let claims = FakeClaims::new();
    // What the controller publishes for one of four equal slots of an 80 GB GPU.
    claims.with_device_capacity(NODE, "gpu-0-share-1", &[("memory", "20Gi"), ("compute", "25")]);
    let c = claim("slot").uid("uid-slot").allocated("gpu-0-share-1").build();
    claims.insert(c.clone());
    let (state, shared, _) = plugin(dir, claims);
    state.prepare(&ClaimRef::of(&c)).await.unwrap();
    cleanup.pids.extend(shared.sharer.mps().pid(PLUGIN_DAEMON));
    assert_eq!(
        settings(&dir.join("state"), PLUGIN_DAEMON),
        ("25.0".into(), "20480M".into()),
        "the daemon's defaults are the slot"
    );
    let checkpoint = state.checkpoint();
    let tessera_kubelet_plugin::node::checkpoint::DeviceDetail::Shared(detail) =
        &checkpoint.claims["uid-slot"].devices[0].detail
    else {
        panic!("a shared device record");
    };
    assert_eq!(
        detail.limits.get("activeThreadPercentage").map(String::as_str),
        Some("25"),
        "the client's own limit is the slot too: {:?}",
        detail.limits
    );
    assert_eq!(
        detail.limits.get("pinnedDeviceMemoryLimit").map(String::as_str),
        Some("20480M")
    );
    state.unprepare(&ClaimRef::of(&c)).await.unwrap();
}
