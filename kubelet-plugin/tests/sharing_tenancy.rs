//! Issue 38 item 3 (review N14): MPS tenancy. The shares of each namespace on a GPU get an MPS control
//! daemon of their own (pipe directory, logs, `/dev/shm`), so a tenant's `quit` or `set_default_*` reaches
//! its own namespace only; the GPU's compute mode follows the number of daemons; the policy's `Shared`
//! tenancy keeps one daemon for every namespace. Over real simulated daemon processes (the plugin binary's
//! `mps-control-sim`).
//!
//! `cargo test -p tessera-kubelet-plugin --test sharing_tenancy`; the cost of a daemon start is printed by
//! `cargo test -p tessera-kubelet-plugin --test sharing_tenancy -- --nocapture the_cost`.

mod common;

use std::{collections::BTreeMap, fs, path::PathBuf, sync::Arc, time::Instant};

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tessera_api::{
    DeviceName, GpuInfo,
    config::{SharingStrategy, TimeSliceInterval},
    policy::MpsTenancy,
};
use tessera_kubelet_plugin::devices::sharing::mps::{Launcher, MpsManager, send_control};
use tessera_kubelet_plugin::devices::sharing::supervisor::{
    DaemonRecord, DaemonSpec, RECORD_FILE, Supervisor,
};
use tessera_kubelet_plugin::devices::sharing::supervisor_protocol::{DaemonDefaults, Request};
use tessera_kubelet_plugin::devices::sharing::{
    PreparedShare, ShareRequest, Sharer, daemon_key, daemon_key_of_share,
};
use tessera_kubelet_plugin::gpu::{ComputeMode, GpuBackend};
use tessera_kubelet_plugin::kubelet::claims::fake::{FakeClaims, NODE, claim};
use tessera_kubelet_plugin::node::state::ClaimRef;
use tessera_sim_model::backend::{NodeSpec, SimulatedBackend};

const SHARED: DeviceName = DeviceName::SharedGpu { gpu: 0 };

fn plugin_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"))
}

fn simulated() -> Launcher {
    Launcher::Simulated {
        program: plugin_binary(),
    }
}

struct Node {
    dir: tempfile::TempDir,
    backend: Arc<SimulatedBackend>,
    gpus: Vec<GpuInfo>,
    sharer: Sharer,
}

fn node() -> Node {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(
        SimulatedBackend::from_spec(
            "node-a",
            &NodeSpec::default().with_gpus("H100-SXM5-80GB", 1),
            dir.path(),
        )
        .unwrap(),
    );
    let gpus = backend.discover().unwrap().gpus;
    let sharer = Sharer::new(backend.clone(), MpsManager::new(dir.path(), simulated()), false);
    Node {
        dir,
        backend,
        gpus,
        sharer,
    }
}

impl Node {
    /// Prepares an MPS share of GPU 0 for `holder` on the daemon of `tenant` (`None`: the GPU's one daemon).
    fn share(&self, holder: &str, tenant: Option<&str>) -> PreparedShare {
        let consumed: BTreeMap<String, Quantity> = [("compute".to_string(), Quantity("25".into()))].into();
        self.sharer
            .prepare(&ShareRequest {
                holder: holder.into(),
                device: &SHARED,
                gpu: &self.gpus[0],
                uuid: &self.gpus[0].uuid,
                strategy: SharingStrategy::Mps,
                mps: None,
                interval: TimeSliceInterval::Default,
                consumed: &consumed,
                tenant,
            })
            .unwrap()
    }

    fn unshare(&self, holder: &str) {
        self.sharer
            .unprepare(&self.gpus[0], &SHARED, holder, SharingStrategy::Mps)
            .unwrap();
    }

    fn mode(&self) -> ComputeMode {
        self.backend.compute_mode(0).unwrap()
    }

    fn daemon_pid(&self, tenant: Option<&str>) -> Option<u32> {
        self.sharer.mps().pid(&daemon_key(&SHARED, tenant))
    }
}

/// The host side of a share's mount at `container`.
fn mounted(share: &PreparedShare, container: &str) -> String {
    share
        .mounts
        .iter()
        .find(|(_, c)| c == container)
        .map(|(host, _)| host.clone())
        .unwrap_or_else(|| panic!("no mount at {container}: {:?}", share.mounts))
}

fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()) != Some("Z"))
}

#[test]
fn shares_of_two_namespaces_on_one_gpu_get_their_own_daemon_pipe_directory_and_shm() {
    let n = node();
    let a = n.share("uid-a/gpu-0-shared", Some("team-a"));
    let a2 = n.share("uid-a2/gpu-0-shared", Some("team-a"));
    let b = n.share("uid-b/gpu-0-shared", Some("team-b"));
    let (pid_a, pid_b) = (
        n.daemon_pid(Some("team-a")).unwrap(),
        n.daemon_pid(Some("team-b")).unwrap(),
    );
    assert_ne!(pid_a, pid_b, "each namespace must get its own daemon");
    assert_eq!(
        mounted(&a, "/tmp/nvidia-mps"),
        mounted(&a2, "/tmp/nvidia-mps"),
        "the shares of one namespace share its daemon"
    );
    for container in ["/tmp/nvidia-mps", "/dev/shm"] {
        assert_ne!(
            mounted(&a, container),
            mounted(&b, container),
            "{container} of two namespaces"
        );
    }
    assert_eq!(
        a.mps_pipe_dir.as_deref(),
        Some(mounted(&a, "/tmp/nvidia-mps").as_str())
    );

    // A namespace's last share stops its own daemon only.
    n.unshare("uid-b/gpu-0-shared");
    assert!(!alive(pid_b), "team-b's daemon must stop with its last share");
    assert!(alive(pid_a), "team-a's daemon serves its shares");
    n.unshare("uid-a/gpu-0-shared");
    n.unshare("uid-a2/gpu-0-shared");
    assert!(!alive(pid_a));
}

#[test]
fn quit_through_one_namespaces_pipe_directory_leaves_the_other_namespaces_daemon_serving() {
    let n = node();
    let a = n.share("uid-a/gpu-0-shared", Some("team-a"));
    let b = n.share("uid-b/gpu-0-shared", Some("team-b"));
    let pid_b = n.daemon_pid(Some("team-b")).unwrap();
    // What `echo quit | nvidia-cuda-mps-control` does in a team-a container: the control socket of the
    // pipe directory mounted there.
    let pipe_a = PathBuf::from(mounted(&a, "/tmp/nvidia-mps"));
    send_control(&pipe_a, "quit").unwrap();
    send_control(&pipe_a, "set_default_active_thread_percentage 100").unwrap_err();

    let pipe_b = PathBuf::from(mounted(&b, "/tmp/nvidia-mps"));
    send_control(&pipe_b, "get_default_active_thread_percentage").expect("team-b's daemon must still serve");
    assert!(alive(pid_b));
    // The watch starts team-a's daemon again; team-b's is left as it is.
    let watch = n.sharer.watch_daemons(&n.gpus, true);
    assert_eq!(
        watch.restarted,
        [daemon_key(&SHARED, Some("team-a"))],
        "{watch:?}"
    );
    assert_eq!(n.daemon_pid(Some("team-b")), Some(pid_b));
    n.unshare("uid-a/gpu-0-shared");
    n.unshare("uid-b/gpu-0-shared");
}

#[test]
fn the_gpu_is_exclusive_to_one_daemon_and_in_default_mode_while_two_namespaces_share_it() {
    let n = node();
    n.share("uid-a/gpu-0-shared", Some("team-a"));
    assert_eq!(
        n.mode(),
        ComputeMode::ExclusiveProcess,
        "one daemon: only its server opens the GPU"
    );
    n.share("uid-a2/gpu-0-shared", Some("team-a"));
    assert_eq!(n.mode(), ComputeMode::ExclusiveProcess, "still one daemon");
    n.share("uid-b/gpu-0-shared", Some("team-b"));
    assert_eq!(
        n.mode(),
        ComputeMode::Default,
        "a second namespace's MPS server must be able to open the GPU"
    );
    n.unshare("uid-b/gpu-0-shared");
    assert_eq!(n.mode(), ComputeMode::ExclusiveProcess, "back to one daemon");
    n.unshare("uid-a/gpu-0-shared");
    n.unshare("uid-a2/gpu-0-shared");
    assert_eq!(n.mode(), ComputeMode::Default, "no daemon");
}

#[test]
fn a_share_of_an_older_plugin_keeps_the_gpus_one_daemon_next_to_a_namespaces_own() {
    let n = node();
    // Prepared before per-namespace daemons: the GPU's one daemon, as the checkpoint's pipe directory says.
    let old = n.share("uid-old/gpu-0-shared", None);
    let old_pid = n.daemon_pid(None).unwrap();
    let pipe = old.mps_pipe_dir.clone().unwrap();
    assert_eq!(daemon_key_of_share(&SHARED, Some(&pipe)), "gpu-0");

    // The plugin is upgraded and restarts: the share is restored onto the daemon its record names.
    let after = Sharer::new(
        n.backend.clone(),
        MpsManager::new(n.dir.path(), simulated()),
        false,
    );
    after.restore_on(
        &SHARED,
        "uid-old/gpu-0-shared",
        SharingStrategy::Mps,
        Some(&daemon_key_of_share(&SHARED, Some(&pipe))),
    );
    let consumed = BTreeMap::new();
    let new = after
        .prepare(&ShareRequest {
            holder: "uid-new/gpu-0-shared".into(),
            device: &SHARED,
            gpu: &n.gpus[0],
            uuid: &n.gpus[0].uuid,
            strategy: SharingStrategy::Mps,
            mps: None,
            interval: TimeSliceInterval::Default,
            consumed: &consumed,
            tenant: Some("team-a"),
        })
        .unwrap();
    assert_ne!(new.mps_pipe_dir.as_deref(), Some(pipe.as_str()));
    assert!(alive(old_pid), "the old share's daemon keeps serving it");
    assert_eq!(n.mode(), ComputeMode::Default, "two daemons on the GPU");
    after
        .unprepare(&n.gpus[0], &SHARED, "uid-old/gpu-0-shared", SharingStrategy::Mps)
        .unwrap();
    assert!(!alive(old_pid), "the old daemon goes with its last share");
    assert_eq!(n.mode(), ComputeMode::ExclusiveProcess);
    after
        .unprepare(&n.gpus[0], &SHARED, "uid-new/gpu-0-shared", SharingStrategy::Mps)
        .unwrap();
}

#[test]
fn a_supervisor_restores_the_daemons_of_every_namespace_and_of_an_older_record() {
    let tmp = tempfile::tempdir().unwrap();
    let keys = ["gpu-0", "gpu-0@team-a", "gpu-0@team-b"];
    let record = DaemonRecord {
        boot_id: common::BOOT_ID.into(),
        daemons: keys
            .iter()
            .map(|k| {
                (
                    k.to_string(),
                    DaemonSpec {
                        uuid: "GPU-0a1b".into(),
                        defaults: DaemonDefaults::default(),
                    },
                )
            })
            .collect(),
        paused: None,
    };
    record.save(&tmp.path().join(RECORD_FILE)).unwrap();
    let supervisor = Supervisor::new(
        MpsManager::new(tmp.path(), simulated()).owning_children(false),
        common::BOOT_ID,
    );
    let restored = supervisor.restore();
    let mut serving = restored.serving.clone();
    serving.sort();
    assert_eq!(serving, keys, "{restored:?}");
    let pids: Vec<u32> = keys
        .iter()
        .map(|k| supervisor.manager().child_pid(k).unwrap())
        .collect();
    supervisor.shutdown();
    assert!(pids.iter().all(|p| !alive(*p)));
}

#[test]
fn a_pid_file_a_tenant_wrote_is_neither_a_running_daemon_nor_what_the_supervisor_signals() {
    let tmp = tempfile::tempdir().unwrap();
    let supervisor = Supervisor::new(
        MpsManager::new(tmp.path(), simulated()).owning_children(false),
        common::BOOT_ID,
    );
    let key = "gpu-0@team-a";
    let started = supervisor.handle(&Request::Start {
        key: key.into(),
        uuid: "GPU-0a1b".into(),
        defaults: DaemonDefaults::default(),
    });
    assert_eq!(started.error, None);
    let manager = supervisor.manager();
    let pipe = manager.dirs(key).pipe;
    // A tenant quits its daemon and leaves a pid file in its mounted pipe directory naming another process.
    let mut victim = std::process::Command::new("sleep").arg("60").spawn().unwrap();
    send_control(&pipe, "quit").unwrap();
    while manager.child_pid(key).is_some() {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    fs::write(
        pipe.join(tessera_kubelet_plugin::devices::sharing::mps::PID_FILE),
        format!("{}\n", victim.id()),
    )
    .unwrap();
    assert_eq!(
        manager.pid(key),
        None,
        "a number in the pipe directory is no daemon"
    );
    assert_eq!(
        supervisor.watch_once(),
        [key],
        "the watchdog starts the daemon again"
    );
    fs::write(
        pipe.join(tessera_kubelet_plugin::devices::sharing::mps::PID_FILE),
        format!("{}\n", victim.id()),
    )
    .unwrap();
    supervisor.shutdown();
    assert!(
        alive(victim.id()),
        "the process the pid file named must be left alone"
    );
    victim.kill().unwrap();
    victim.wait().unwrap();
}

/// Through the whole plugin: claims of two namespaces on one published shared GPU.
async fn two_namespaces_through_the_plugin(tenancy: Option<MpsTenancy>) -> (usize, ComputeMode) {
    let tmp = tempfile::tempdir().unwrap();
    let claims = FakeClaims::new();
    if let Some(t) = tenancy {
        claims.with_device_tenancy(NODE, "gpu-0-shared", t);
    }
    let a = claim("a")
        .namespace("team-a")
        .uid("uid-a")
        .allocated_share("gpu-0-shared", "s1")
        .consumed("compute", "25")
        .build();
    let b = claim("b")
        .namespace("team-b")
        .uid("uid-b")
        .allocated_share("gpu-0-shared", "s2")
        .consumed("compute", "25")
        .build();
    claims.insert(a.clone());
    claims.insert(b.clone());
    let (state, shared, backend) = common::assembled_plugin(tmp.path(), 1, simulated(), claims);
    state.prepare(&ClaimRef::of(&a)).await.unwrap();
    state.prepare(&ClaimRef::of(&b)).await.unwrap();
    let daemons = shared.sharer.mps().running().len();
    let mode = backend.compute_mode(0).unwrap();
    state.unprepare(&ClaimRef::of(&a)).await.unwrap();
    state.unprepare(&ClaimRef::of(&b)).await.unwrap();
    assert!(shared.sharer.mps().running().is_empty());
    (daemons, mode)
}

#[tokio::test]
async fn the_plugin_gives_each_namespace_a_daemon_unless_the_policy_publishes_shared_tenancy() {
    assert_eq!(
        two_namespaces_through_the_plugin(None).await,
        (2, ComputeMode::Default),
        "default tenancy: a daemon per namespace"
    );
    assert_eq!(
        two_namespaces_through_the_plugin(Some(MpsTenancy::Namespace)).await,
        (2, ComputeMode::Default)
    );
    assert_eq!(
        two_namespaces_through_the_plugin(Some(MpsTenancy::Shared)).await,
        (1, ComputeMode::ExclusiveProcess),
        "Shared tenancy: one daemon for every namespace"
    );
}

/// The cost of per-namespace daemons in daemon starts: eight namespaces start eight daemons, a second
/// share of a namespace joins its running one. Prints the time of each start of a simulated daemon (the
/// plugin's `mps-control-sim`, started detached as on a node without a supervisor) and the resident memory
/// of a running one; the times are printed, never judged.
#[test]
fn eight_namespaces_start_eight_daemons_and_a_second_share_joins_its_own_printing_the_cost() {
    let n = node();
    let mut times = Vec::new();
    for i in 0..8 {
        let began = Instant::now();
        n.share(&format!("uid-{i}/gpu-0-shared"), Some(&format!("team-{i}")));
        times.push(began.elapsed());
    }
    let rss_kib: Vec<u64> = (0..8)
        .filter_map(|i| n.daemon_pid(Some(&format!("team-{i}"))))
        .filter_map(|pid| {
            fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()?
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))?
                .trim()
                .trim_end_matches(" kB")
                .parse()
                .ok()
        })
        .collect();
    let pids: std::collections::BTreeSet<u32> = (0..8)
        .filter_map(|i| n.daemon_pid(Some(&format!("team-{i}"))))
        .collect();
    assert_eq!(pids.len(), 8, "one running daemon per namespace: {pids:?}");
    let team0 = n.daemon_pid(Some("team-0"));
    let began = Instant::now();
    n.share("uid-same/gpu-0-shared", Some("team-0"));
    let joined = began.elapsed();
    assert_eq!(
        n.daemon_pid(Some("team-0")),
        team0,
        "a second share of team-0 joins its daemon"
    );
    println!("daemon starts (first share of a namespace on the GPU): {times:?}");
    println!("a share joining its namespace's running daemon: {joined:?}");
    println!("RSS of each simulated control daemon (KiB): {rss_kib:?}");
    for i in 0..8 {
        n.unshare(&format!("uid-{i}/gpu-0-shared"));
    }
    n.unshare("uid-same/gpu-0-shared");
}
