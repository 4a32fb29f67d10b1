//! Shared GPUs with real daemon processes: the simulated MPS control daemon is the plugin binary's hidden
//! `mps-control-sim` subcommand, started detached, as on a node.

use std::{collections::BTreeMap, fs, path::PathBuf, sync::Arc};

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tessera_api::{
    DeviceName, GpuInfo,
    config::{MpsConfig, SharingStrategy, TimeSliceInterval},
};
use tessera_kubelet_plugin::devices::sharing::mps::{Launcher, MpsManager};
use tessera_kubelet_plugin::devices::sharing::supervisor_protocol::DaemonDefaults;
use tessera_kubelet_plugin::devices::sharing::{ShareRequest, Sharer, SharingError};
use tessera_kubelet_plugin::gpu::{ComputeMode, GpuBackend, TimeSlice};
use tessera_sim_model::backend::{NodeSpec, SimulatedBackend};

fn plugin_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"))
}

fn manager(state: &std::path::Path) -> MpsManager {
    MpsManager::new(
        state,
        Launcher::Simulated {
            program: plugin_binary(),
        },
    )
}

struct Node {
    dir: tempfile::TempDir,
    backend: Arc<SimulatedBackend>,
    gpus: Vec<GpuInfo>,
}

fn node(model: &str) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(
        SimulatedBackend::from_spec("node-a", &NodeSpec::default().with_gpus(model, 1), dir.path()).unwrap(),
    );
    let gpus = backend.discover().unwrap().gpus;
    Node { dir, backend, gpus }
}

fn sharer(n: &Node) -> Sharer {
    Sharer::new(n.backend.clone(), manager(n.dir.path()), false)
}

fn consumed(compute: &str, memory: &str) -> BTreeMap<String, Quantity> {
    [
        ("compute".to_string(), Quantity(compute.into())),
        ("memory".to_string(), Quantity(memory.into())),
    ]
    .into()
}

fn request<'a>(
    holder: &str,
    device: &'a DeviceName,
    gpu: &'a GpuInfo,
    strategy: SharingStrategy,
    consumed: &'a BTreeMap<String, Quantity>,
    mps: Option<&'a MpsConfig>,
) -> ShareRequest<'a> {
    ShareRequest {
        holder: holder.to_string(),
        device,
        gpu,
        uuid: &gpu.uuid,
        strategy,
        mps,
        interval: TimeSliceInterval::Default,
        consumed,
        tenant: None,
    }
}

fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()) != Some("Z"))
}

#[test]
fn the_simulated_daemon_outlives_its_manager_and_is_found_again_by_a_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let first = manager(dir.path());
    let defaults = DaemonDefaults {
        active_thread_percentage: Some(40),
        pinned_memory_bytes: Some(3 << 30),
    };
    first.start("gpu-0", "GPU-test", defaults).unwrap();
    let pid = first.pid("gpu-0").unwrap();
    drop(first);

    let second = manager(dir.path());
    assert_eq!(second.running(), vec!["gpu-0".to_string()]);
    assert_eq!(second.pid("gpu-0"), Some(pid));
    assert_eq!(
        second
            .send("gpu-0", "get_default_active_thread_percentage")
            .unwrap(),
        "40.0"
    );
    assert_eq!(
        second
            .send("gpu-0", "get_default_device_pinned_mem_limit 0")
            .unwrap(),
        "3072M"
    );
    // Starting again finds the running daemon instead of starting a second one.
    second
        .start("gpu-0", "GPU-test", DaemonDefaults::default())
        .unwrap();
    assert_eq!(second.pid("gpu-0"), Some(pid));
    let log = fs::read_to_string(second.dirs("gpu-0").log.join("control.log")).unwrap();
    assert!(log.contains("devices=GPU-test"), "{log}");
    assert!(log.contains("set_default_active_thread_percentage 40"), "{log}");

    second.stop("gpu-0").unwrap();
    assert!(!alive(pid), "daemon {pid} still runs after quit");
    assert!(second.running().is_empty());
    assert!(!second.dirs("gpu-0").root.exists());
    second.stop("gpu-0").unwrap();
}

#[test]
fn two_mps_shares_on_one_gpu_get_their_own_limits_and_the_last_unprepare_stops_the_daemon() {
    let n = node("H100-SXM5-80GB");
    let s = sharer(&n);
    let gpu = &n.gpus[0];
    let dev = DeviceName::SharedGpu { gpu: 0 };
    let (small, large) = (consumed("25", "10Gi"), consumed("50", "40Gi"));
    let a = s
        .prepare(&request(
            "uid-a/gpu-0-shared",
            &dev,
            gpu,
            SharingStrategy::Mps,
            &small,
            None,
        ))
        .unwrap();
    let pid = s.mps().pid("gpu-0").expect("daemon started with the first share");
    assert_eq!(n.backend.compute_mode(0).unwrap(), ComputeMode::ExclusiveProcess);
    let b = s
        .prepare(&request(
            "uid-b/gpu-0-shared",
            &dev,
            gpu,
            SharingStrategy::Mps,
            &large,
            None,
        ))
        .unwrap();
    assert_eq!(
        s.mps().pid("gpu-0"),
        Some(pid),
        "the second share must reuse the daemon"
    );

    for (share, pct, mem) in [(&a, "25", "10240M"), (&b, "50", "40960M")] {
        assert!(
            share
                .env
                .contains(&"CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps".to_string()),
            "{:?}",
            share.env
        );
        assert!(
            share
                .env
                .contains(&format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct}")),
            "{:?}",
            share.env
        );
        assert!(
            share
                .env
                .contains(&format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={mem}")),
            "{:?}",
            share.env
        );
        assert_eq!(share.uuid, gpu.uuid);
        let pipe = s.mps().dirs("gpu-0").pipe.display().to_string();
        assert!(
            share.mounts.contains(&(pipe, "/tmp/nvidia-mps".to_string())),
            "{:?}",
            share.mounts
        );
    }

    s.unprepare(gpu, &dev, "uid-a/gpu-0-shared", SharingStrategy::Mps)
        .unwrap();
    assert!(alive(pid), "the daemon must stay while a share remains");
    s.unprepare(gpu, &dev, "uid-b/gpu-0-shared", SharingStrategy::Mps)
        .unwrap();
    assert!(!alive(pid), "the last unprepare must stop the daemon");
    assert_eq!(n.backend.compute_mode(0).unwrap(), ComputeMode::Default);
}

#[test]
fn a_restarted_plugin_counts_the_shares_from_its_checkpoint_before_stopping_the_daemon() {
    let n = node("H100-SXM5-80GB");
    let gpu = &n.gpus[0];
    let dev = DeviceName::SharedGpu { gpu: 0 };
    let c = consumed("30", "8Gi");
    let before = sharer(&n);
    before
        .prepare(&request(
            "uid-a/gpu-0-shared",
            &dev,
            gpu,
            SharingStrategy::Mps,
            &c,
            None,
        ))
        .unwrap();
    before
        .prepare(&request(
            "uid-b/gpu-0-shared",
            &dev,
            gpu,
            SharingStrategy::Mps,
            &c,
            None,
        ))
        .unwrap();
    let pid = before.mps().pid("gpu-0").unwrap();
    drop(before);

    let after = sharer(&n);
    after.restore(&dev, "uid-a/gpu-0-shared", SharingStrategy::Mps);
    after.restore(&dev, "uid-b/gpu-0-shared", SharingStrategy::Mps);
    after
        .unprepare(gpu, &dev, "uid-a/gpu-0-shared", SharingStrategy::Mps)
        .unwrap();
    assert!(alive(pid));
    after
        .unprepare(gpu, &dev, "uid-b/gpu-0-shared", SharingStrategy::Mps)
        .unwrap();
    assert!(!alive(pid));
}

#[test]
fn mps_shares_of_a_mig_device_run_on_its_uuid_and_leave_the_gpu_compute_mode_alone() {
    let n = node("H100-SXM5-80GB");
    let s = sharer(&n);
    let gpu = &n.gpus[0];
    // The caller (the preparers) makes the MIG device; sharing only shares it.
    let mig =
        tessera_kubelet_plugin::gpu::mig::prepare_mig(n.backend.as_ref(), gpu, "3g.40gb", 4, None).unwrap();
    let dev = DeviceName::SharedMig {
        gpu: 0,
        profile: "3g.40gb".into(),
        start: 4,
    };
    let c = consumed("50", "10Gi");
    let on_mig = |holder: &str| {
        let mut r = request(holder, &dev, gpu, SharingStrategy::Mps, &c, None);
        r.uuid = &mig.uuid;
        s.prepare(&r).unwrap()
    };
    let (a, b) = (on_mig("uid-a/x"), on_mig("uid-b/x"));
    assert_eq!(
        (a.uuid.as_str(), b.uuid.as_str()),
        (mig.uuid.as_str(), mig.uuid.as_str())
    );
    assert_eq!(s.mps().running(), vec!["gpu-0-mig-3g-40gb-4".to_string()]);
    // The GPU stays in default compute mode: other MIG instances of it are not MPS clients.
    assert_eq!(n.backend.compute_mode(0).unwrap(), ComputeMode::Default);
    assert!(!s.unprepare(gpu, &dev, "uid-a/x", SharingStrategy::Mps).unwrap());
    assert_eq!(s.mps().running().len(), 1);
    assert!(
        s.unprepare(gpu, &dev, "uid-b/x", SharingStrategy::Mps).unwrap(),
        "the last share must say so, for the caller to destroy the MIG device"
    );
    assert!(s.mps().running().is_empty());
    assert_eq!(
        n.backend.list_gpu_instances(0).unwrap().len(),
        1,
        "sharing never destroys MIG devices"
    );
    tessera_kubelet_plugin::gpu::mig::unprepare_mig(n.backend.as_ref(), gpu, &mig).unwrap();
}

#[test]
fn time_slicing_sets_the_interval_with_the_first_share_and_resets_it_after_the_last() {
    let n = node("A100-SXM4-80GB");
    let s = sharer(&n);
    let gpu = &n.gpus[0];
    let dev = DeviceName::ShareSlot { gpu: 0, slot: 1 };
    let dev2 = DeviceName::ShareSlot { gpu: 0, slot: 2 };
    let none = BTreeMap::new();
    let mut long = request(
        "uid-a/gpu-0-share-1",
        &dev,
        gpu,
        SharingStrategy::TimeSlicing,
        &none,
        None,
    );
    long.interval = TimeSliceInterval::Long;
    let a = s.prepare(&long).unwrap();
    assert_eq!(a.limits.get("timeSlice").map(String::as_str), Some("Long"));
    assert_eq!(n.backend.time_slice(0).unwrap(), TimeSlice::Long);
    // A later share asking for another interval runs with the current one.
    let mut short = request(
        "uid-b/gpu-0-share-2",
        &dev2,
        gpu,
        SharingStrategy::TimeSlicing,
        &none,
        None,
    );
    short.interval = TimeSliceInterval::Short;
    assert_eq!(
        s.prepare(&short)
            .unwrap()
            .limits
            .get("timeSlice")
            .map(String::as_str),
        Some("Long")
    );
    assert!(a.env.is_empty());
    // MPS cannot join a time-sliced GPU.
    let err = s
        .prepare(&request(
            "uid-c/gpu-0-shared",
            &DeviceName::SharedGpu { gpu: 0 },
            gpu,
            SharingStrategy::Mps,
            &none,
            None,
        ))
        .unwrap_err();
    assert!(matches!(err, SharingError::StrategyConflict { .. }), "{err}");
    s.unprepare(gpu, &dev, "uid-a/gpu-0-share-1", SharingStrategy::TimeSlicing)
        .unwrap();
    assert_eq!(n.backend.time_slice(0).unwrap(), TimeSlice::Long);
    s.unprepare(gpu, &dev2, "uid-b/gpu-0-share-2", SharingStrategy::TimeSlicing)
        .unwrap();
    assert_eq!(n.backend.time_slice(0).unwrap(), TimeSlice::Default);
}

#[test]
fn config_defaults_apply_when_the_allocation_names_no_capacity() {
    let n = node("H200-SXM-141GB");
    let s = sharer(&n);
    let gpu = &n.gpus[0];
    let dev = DeviceName::ShareSlot { gpu: 0, slot: 0 };
    let none = BTreeMap::new();
    let mps = MpsConfig {
        default_active_thread_percentage: Some(20),
        default_pinned_device_memory_limit: Some("2Gi".into()),
        ..Default::default()
    };
    let share = s
        .prepare(&request(
            "uid-a/gpu-0-share-0",
            &dev,
            gpu,
            SharingStrategy::Mps,
            &none,
            Some(&mps),
        ))
        .unwrap();
    assert!(
        share
            .env
            .contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20".to_string()),
        "{:?}",
        share.env
    );
    assert!(
        share
            .env
            .contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M".to_string()),
        "{:?}",
        share.env
    );
    // The daemon's own defaults (what a client that drops its env gets) come from the config too.
    assert_eq!(
        s.mps()
            .send("gpu-0", "get_default_active_thread_percentage")
            .unwrap(),
        "20.0"
    );
    s.unprepare(gpu, &dev, "uid-a/gpu-0-share-0", SharingStrategy::Mps)
        .unwrap();
    assert!(s.mps().running().is_empty());
}
