//! The nvml backend's defects of issue 21, each caught against the simulated driver root's real
//! `libnvidia-ml.so.1` (crate `tessera-sim-nvml`): tessera's `NvmlBackend`, health source and node state
//! call the library through nvml-wrapper exactly as on a GPU node.
//!
//! Each test names the defect it catches, as b31ad79's code behaved. Build the library first:
//! `cargo build -p tessera-sim-nvml && cargo test -p tessera-kubelet-plugin --test nvml_defects`.

#[path = "common/sim_driver.rs"]
mod sim_driver;

use std::{
    fs,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use sim_driver::{BuiltDriver, SimDriver};
use tessera_api::{MigPlacement, inventory::HealthReason};
use tessera_kubelet_plugin::devices::preparers::{SharedPreparer, with_preparers};
use tessera_kubelet_plugin::devices::sharing::Sharer;
use tessera_kubelet_plugin::devices::sharing::mps::{Launcher, MpsManager};
use tessera_kubelet_plugin::gpu::driver_root::{DriverFiles, DriverRoot};
use tessera_kubelet_plugin::gpu::health::sources::NvmlSource;
use tessera_kubelet_plugin::gpu::health::{HealthSource, Observation};
use tessera_kubelet_plugin::gpu::nvml::NvmlBackend;
use tessera_kubelet_plugin::gpu::{ComputeMode, GpuBackend, GpuError};
use tessera_kubelet_plugin::kubelet::claims::fake::{FakeClaims, NODE, claim};
use tessera_kubelet_plugin::node::checkpoint::{CheckpointStore, DeviceDetail, Loaded};
use tessera_kubelet_plugin::node::state::{ClaimRef, NodeState, StateConfig};
use tessera_sim_model::backend::{DeviceView, FabricState, GpuGroup, NamedProcess, VirtualizationMode};
use tessera_sim_model::faults::{Fault, FaultKind};

const H100: &str = "H100-SXM5-80GB";
/// `1g.10gb` on an H100.
const PROFILE_1G: u32 = 19;

fn backend(driver: &BuiltDriver) -> Arc<NvmlBackend> {
    let b = Arc::new(driver.nvml());
    b.discover().unwrap();
    b
}

/// MIG on GPU 0, one `1g.10gb` instance at slice 0 and its compute instance: `(gi, ci, MIG uuid)`.
fn one_mig_device(nvml: &NvmlBackend) -> (u32, u32, String) {
    nvml.set_mig_mode(0, true).unwrap();
    let gi = nvml
        .create_gpu_instance(0, PROFILE_1G, MigPlacement { start: 0, size: 1 })
        .unwrap();
    let ci = nvml.create_compute_instance(0, gi).unwrap();
    (gi, ci.id, ci.uuid)
}

/// Polls `source` until `want` matches an observation or `within` passes.
fn poll_until(
    source: &mut NvmlSource,
    within: Duration,
    want: impl Fn(&Observation) -> bool,
) -> Vec<Observation> {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        let batch = source.poll(Duration::from_millis(100));
        let found = batch.iter().any(&want);
        seen.extend(batch);
        if found {
            return seen;
        }
    }
    panic!("no matching observation within {within:?}; saw {seen:?}");
}

fn failed(o: &Observation) -> Option<&tessera_kubelet_plugin::gpu::health::Failure> {
    match o {
        Observation::Failed(f) => Some(f),
        _ => None,
    }
}

// === 2. MIG device UUID ===

/// Defect 2: `nvmlComputeInstanceGetInfo_v2(...).device` is the parent GPU (nvml.h), and b31ad79 took its
/// UUID as the MIG device's, so every MIG device got the parent's `GPU-…` UUID.
#[test]
fn a_mig_device_made_through_nvml_has_its_own_mig_uuid_not_its_parents() {
    let driver = SimDriver::new().gpus(H100, 1).build();
    let nvml = driver.nvml();
    let gpu_uuid = nvml.discover().unwrap().gpus[0].uuid.clone();
    let (gi, ci, uuid) = one_mig_device(&nvml);
    assert!(uuid.starts_with("MIG-"), "{uuid} (the parent is {gpu_uuid})");
    let model = driver.model.mig_devices(0, &DeviceView::host()).unwrap();
    let made = model
        .iter()
        .find(|d| d.gpu_instance == gi && d.compute_instance == ci)
        .expect("the model has the device");
    assert_eq!(uuid, made.uuid);
    let listed = nvml.list_gpu_instances(0).unwrap();
    assert_eq!(
        listed[0].compute_instances[0].uuid, made.uuid,
        "listing reads the same UUID"
    );
}

// === 3. GPU instance profiles past the binding's count ===

/// Defect 3: b31ad79 asked for GI profile indices `0..NVML_GPU_INSTANCE_PROFILE_COUNT`, nvml-wrapper-sys's
/// 17, so a profile a newer driver has at index 0x11 (`3g+gfx`, R575+) was never offered; `nvml.h` says to
/// enumerate until INVALID_ARGUMENT. The library's test hook gives GPU 0 such a profile (no simulated
/// model has one: see `sim-driver/nvml/src/test_profiles.rs`).
#[test]
fn a_gi_profile_past_the_bindings_profile_count_is_discovered() {
    let driver = SimDriver::new().gpus(H100, 2).build();
    fs::write(
        driver.kernel.join("test-gi-profiles"),
        "0 17 30 3g.40gb+gfx 3 4 60 40448 2 0,4\n",
    )
    .unwrap();
    let found = driver.nvml().discover().unwrap();
    let profile = |gpu: usize, index: u32| {
        found.gpus[gpu]
            .mig
            .as_ref()
            .unwrap()
            .profiles
            .iter()
            .find(|p| p.profile_index == index)
            .cloned()
    };
    let gfx = profile(0, 0x11).expect("index 0x11 is enumerated");
    assert_eq!((gfx.name.as_str(), gfx.profile_id), ("3g.40gb+gfx", 30));
    assert_eq!(gfx.placements.len(), 2);
    assert!(profile(1, 0x11).is_none(), "only the GPU that has it");
    // Everything the model has is still there (NOT_SUPPORTED indices skipped, not ended on).
    let model: Vec<u32> = tessera_gpu_api::models::model(H100)
        .unwrap()
        .mig_profiles
        .iter()
        .map(|p| p.index)
        .collect();
    for index in model {
        assert!(profile(1, index).is_some(), "index {index}");
    }
}

// === N6, N12: GPU instance profiles with MIG off, and an unused index in the middle ===

/// The MIG profiles `found` lists for GPU `gpu`, as `(index, name, profile id, placements)`.
fn listed_profiles(
    found: &tessera_kubelet_plugin::gpu::NodeGpus,
    gpu: usize,
) -> Vec<(u32, String, u32, usize)> {
    found.gpus[gpu]
        .mig
        .as_ref()
        .expect("a MIG-capable GPU")
        .profiles
        .iter()
        .map(|p| (p.profile_index, p.name.clone(), p.profile_id, p.placements.len()))
        .collect()
}

/// The H100 model's profiles as [`listed_profiles`] gives them.
fn h100_profiles() -> Vec<(u32, String, u32, usize)> {
    tessera_gpu_api::models::model(H100)
        .unwrap()
        .mig_profiles
        .iter()
        .map(|p| (p.index, p.name.to_string(), p.id, p.placements().count()))
        .collect()
}

/// N6: profiles were read through `nvmlDeviceGetGpuInstanceProfileInfoV`, which answers NOT_SUPPORTED
/// without MIG mode (nvml.h:12855), so a MIG-capable GPU with MIG off (the boot default, and the state
/// tessera restores after the last GPU instance) listed no profile and dynamic MIG was never offered on it.
/// The v1 call answers with MIG off (nvml.h:12824), as NVIDIA's DRA driver reads it.
#[test]
fn a_mig_disabled_gpu_lists_its_profiles_through_the_v1_call() {
    let driver = SimDriver::new().gpus(H100, 1).build();
    let nvml = driver.nvml();
    let found = nvml.discover().unwrap();
    let mig = found.gpus[0].mig.as_ref().expect("the H100 is MIG-capable");
    assert!(!mig.enabled, "MIG mode is off");
    assert_eq!(listed_profiles(&found, 0), h100_profiles());
    assert_eq!((mig.compute_slices, mig.memory_slices), (7, 8));
    // And dynamic MIG works from there: a device of a profile read with MIG off is made.
    let (_, _, uuid) = one_mig_device(&nvml);
    assert!(uuid.starts_with("MIG-"), "{uuid}");
}

/// With MIG on the profiles and their names are the same as with it off: the V call, asked for the
/// driver's name only, agrees with the names derived for a MIG-off GPU.
#[test]
fn a_gpu_lists_the_same_profiles_with_mig_on_and_off() {
    let driver = SimDriver::new().gpus(H100, 1).mig_gpus(H100, 1).build();
    let found = driver.nvml().discover().unwrap();
    assert!(found.gpus[1].mig.as_ref().unwrap().enabled);
    assert_eq!(listed_profiles(&found, 0), listed_profiles(&found, 1));
}

/// N12: enumeration ended at the first INVALID_ARGUMENT, wherever it came, so a driver answering it for an
/// unused index in the middle hid every later profile (the `+me` and `1g.20gb` ones here, or Blackwell's
/// `+gfx`/`-me`). NVIDIA's DRA driver skips such an index and goes on (`nvlib.go`:552-554). MIG is on, so
/// the code before the N6 fix reads the profiles too and fails on this alone.
#[test]
fn an_invalid_argument_for_a_middle_profile_index_does_not_hide_the_later_profiles() {
    let driver = SimDriver::new().mig_gpus(H100, 2).build();
    // GPU 0: index 5 (8_SLICE, not on an H100) refused as an invalid argument; and a profile at 0x11.
    fs::write(
        driver.kernel.join("test-gi-profiles"),
        "0 5 INVALID_ARGUMENT\n0 17 30 3g.40gb+gfx 3 4 60 40448 2 0,4\n",
    )
    .unwrap();
    let found = driver.nvml().discover().unwrap();
    let listed = listed_profiles(&found, 0);
    let mut want = h100_profiles();
    want.push((0x11, "3g.40gb+gfx".to_string(), 30, 2));
    assert_eq!(listed, want, "every profile after index 5 is still listed");
    assert_eq!(listed_profiles(&found, 1), h100_profiles(), "GPU 1 is untouched");
}

// === 5. NVML errors 18, 9, 1 in the health probe ===

/// Defect 5: the probe called every NVML error but GPU_IS_LOST "answering", so GPUs whose library no
/// longer matched the kernel module (18, after a driver upgrade), whose module was unloaded (9) or whose
/// NVML lost its initialisation (1) stayed published healthy.
#[test]
fn nvml_errors_18_9_and_1_mark_the_gpu_unhealthy_with_what_to_do() {
    let driver = SimDriver::new().gpus(H100, 4).build();
    let nvml = backend(&driver);
    let health = driver.model.health();
    // The driver changes under a running plugin: discovery already happened.
    health
        .inject(Fault::failing(1, FaultKind::LibraryMismatch))
        .unwrap();
    health
        .inject(Fault::failing(2, FaultKind::DriverNotLoaded))
        .unwrap();
    health
        .inject(Fault::failing(3, FaultKind::Uninitialized))
        .unwrap();
    let mut source = NvmlSource::new(nvml, 4, vec![]);
    let seen = source.poll(Duration::from_millis(50));
    let failure = |gpu| {
        seen.iter()
            .filter_map(failed)
            .find(|f| f.gpu == gpu)
            .unwrap_or_else(|| panic!("GPU {gpu} not failed: {seen:?}"))
    };
    for (gpu, code, hint) in [
        (1, 18, "reboot"),
        (2, 9, "modprobe"),
        (3, 1, "restart the plugin"),
    ] {
        let f = failure(gpu);
        assert_eq!(f.reason, HealthReason::GpuLost, "{f:?}");
        assert!(f.message.contains(&format!("({code})")), "{}", f.message);
        assert!(
            f.message.contains(hint),
            "says what to do ({hint}): {}",
            f.message
        );
    }
    assert!(seen.contains(&Observation::Answering { gpu: 0 }), "{seen:?}");
}

// === 4. Events: backoff after GPU lost, re-registration, attribution ===

/// Defect 4 (spin): after GPU_IS_LOST the wait answers at once on every call, and b31ad79 probed and
/// looped without sleeping: a core at 100% until the node is rebooted.
#[test]
fn a_lost_gpu_does_not_make_the_health_loop_spin() {
    let driver = SimDriver::new().gpus(H100, 2).build();
    let mut source = NvmlSource::new(backend(&driver), 2, vec![]);
    source.poll(Duration::from_millis(10));
    driver.model.health().inject(Fault::lost(1)).unwrap();
    let timeout = Duration::from_millis(100);
    let started = Instant::now();
    let mut seen = Vec::new();
    for _ in 0..6 {
        seen.extend(source.poll(timeout));
    }
    let took = started.elapsed();
    assert!(
        took >= timeout * 5,
        "6 polls of {timeout:?} took {took:?}: the loop spins"
    );
    assert!(
        seen.iter()
            .filter_map(failed)
            .any(|f| f.gpu == 1 && f.reason == HealthReason::GpuLost),
        "{seen:?}"
    );
    assert!(
        !source.registered().contains(&1),
        "the lost GPU is left out of the event set"
    );
}

/// Defect 4 (registration): events were registered once; a MIG mode change drops the GPU's registration
/// (the library does what the issue observed of real drivers), so b31ad79 never heard of a later XID.
#[test]
fn events_are_registered_again_after_the_plugin_toggles_mig_mode() {
    let driver = SimDriver::new().gpus(H100, 1).build();
    // The health source has an NVML session of its own, as in the plugin.
    let mut source = NvmlSource::new(backend(&driver), 1, vec![]);
    source.poll(Duration::from_millis(10));
    backend(&driver).set_mig_mode(0, true).unwrap();
    // The XID comes later: an event while no registration exists is lost on a real driver too.
    source.poll(Duration::from_millis(100));
    driver.model.health().inject(Fault::xid(0, 79)).unwrap();
    poll_until(&mut source, Duration::from_secs(5), |o| {
        failed(o).is_some_and(|f| f.gpu == 0 && f.xid == Some(79))
    });
}

/// Defect 4 (registration): a reset nobody told the plugin of (`nvidia-smi -r` after an XID) drops the
/// registration too; the periodic re-registration brings the events back.
#[test]
fn events_come_back_after_a_gpu_reset_the_plugin_did_not_make() {
    let driver = SimDriver::new().gpus(H100, 1).build();
    let mut source =
        NvmlSource::new(backend(&driver), 1, vec![]).reregister_every(Duration::from_millis(300));
    source.poll(Duration::from_millis(10));
    driver.model.reset_gpu(0).unwrap();
    // Some time later, the GPU back in service, it raises an XID.
    for _ in 0..5 {
        source.poll(Duration::from_millis(100));
    }
    driver.model.health().inject(Fault::xid(0, 48)).unwrap();
    poll_until(&mut source, Duration::from_secs(5), |o| {
        failed(o).is_some_and(|f| f.gpu == 0 && f.xid == Some(48))
    });
}

/// Defect 4 (attribution): b31ad79 named an event's GPU with `nvmlDeviceGetIndex(data.device)` and, when
/// that failed, dropped the event. A GPU whose library no longer matches its kernel module (error 18)
/// still raises an XID, and that XID must reach the GPU's health, named by the device it came on.
#[test]
fn an_xid_whose_gpu_index_cannot_be_read_is_not_dropped() {
    let driver = SimDriver::new().gpus(H100, 2).build();
    let mut source = NvmlSource::new(backend(&driver), 2, vec![]);
    source.poll(Duration::from_millis(10));
    let health = driver.model.health();
    health
        .inject(Fault::failing(1, FaultKind::LibraryMismatch))
        .unwrap();
    health.inject(Fault::xid(1, 79)).unwrap();
    poll_until(&mut source, Duration::from_secs(5), |o| {
        failed(o).is_some_and(|f| f.gpu == 1 && f.xid == Some(79))
    });
}

// === 6. SetMigMode answered IN_USE ===

/// Defect 6: on IN_USE b31ad79 left the pending MIG mode set (the GPU would come up in MIG mode at its
/// next reset) and sent the operator to `nvidia-smi`, which lists no process for DCGM and friends.
#[test]
fn a_mig_change_answered_in_use_clears_the_pending_mode_and_names_the_holders() {
    let group = GpuGroup {
        processes: vec![NamedProcess {
            pid: 4242,
            name: "nv-hostengine".into(),
        }],
        ..GpuGroup::plain(H100)
    };
    let driver = SimDriver::new().group(group).build();
    let nvml = backend(&driver);
    let e = nvml.set_mig_mode(0, true).unwrap_err();
    assert!(matches!(e, GpuError::InUse(_)), "{e}");
    let msg = e.to_string();
    for want in ["4242 nv-hostengine", "dcgm-exporter", "nvidia-persistenced"] {
        assert!(msg.contains(want), "names {want}: {msg}");
    }
    assert!(!msg.contains("nvidia-smi -i"), "{msg}");
    let mode = nvml.mig_mode(0).unwrap();
    assert!(
        !mode.current && !mode.pending,
        "the pending mode is cleared: {mode:?}"
    );
}

/// A real driver refuses a MIG mode change while another NVML client holds the GPU open, though
/// `nvidia-smi` lists no process for it (DCGM's nv-hostengine, dcgm-exporter, GPU feature discovery; the
/// simulated library records every `nvmlInit` of another process). The plugin's preparation fails naming
/// them and the fix, leaves nothing pending, and succeeds on the next try once the holder is gone. The
/// plugin's own NVML sessions (this backend, a health source) do not hold the GPU against it.
#[test]
fn a_mig_preparation_fails_naming_dcgm_while_another_nvml_client_holds_the_gpu_and_succeeds_after() {
    let driver = SimDriver::new().gpus(H100, 1).build();
    let nvml = backend(&driver);
    let _health = driver.nvml_wrapper();
    let gpu = nvml.discover().unwrap().gpus.remove(0);
    let holder = driver.hold_nvml();
    let e = tessera_kubelet_plugin::gpu::mig::prepare_mig(&*nvml, &gpu, "1g.10gb", 0, None).unwrap_err();
    let msg = e.to_string();
    for want in [
        "is in use",
        "NVML lists no process on it",
        "nv-hostengine",
        "dcgm-exporter",
        "nvidia.com/gpu.deploy.dcgm=false",
    ] {
        assert!(msg.contains(want), "names {want:?}: {msg}");
    }
    let mode = nvml.mig_mode(0).unwrap();
    assert!(!mode.current && !mode.pending, "nothing pending: {mode:?}");
    holder.kill();
    let dev = tessera_kubelet_plugin::gpu::mig::prepare_mig(&*nvml, &gpu, "1g.10gb", 0, None).unwrap();
    assert!(dev.uuid.starts_with("MIG-"), "{dev:?}");
}

/// The simulated library's GI, CI and MIG device handles die with their instance (as NVIDIA's, which
/// point to the driver's objects): the plugin resolves them afresh in every operation, so a MIG device
/// destroyed and made again with the same ids, through NVML, works on the new instance's handles.
#[test]
fn a_mig_device_made_again_with_the_same_ids_after_an_unprepare_is_prepared_and_unprepared_through_nvml() {
    use tessera_kubelet_plugin::gpu::mig::{prepare_mig, unprepare_mig};
    let driver = SimDriver::new().mig_gpus(H100, 1).build();
    let nvml = backend(&driver);
    let gpu = nvml.discover().unwrap().gpus.remove(0);
    let first = prepare_mig(&*nvml, &gpu, "1g.10gb", 0, None).unwrap();
    unprepare_mig(&*nvml, &gpu, &first).unwrap();
    let second = prepare_mig(&*nvml, &gpu, "1g.10gb", 0, None).unwrap();
    assert_eq!(
        (second.gpu_instance, second.compute_instance),
        (first.gpu_instance, first.compute_instance),
        "the same ids again"
    );
    assert_ne!(second.uuid, first.uuid, "a new MIG device");
    unprepare_mig(&*nvml, &gpu, &second).unwrap();
    assert!(nvml.list_gpu_instances(0).unwrap().is_empty());
}

// === 7. Capability minors and the proc root ===

/// Defect 7: b31ad79 read `/proc` of the host whatever the driver root, and a missing access file fell
/// back to minors computed from the mig-minors layout, in silence.
#[test]
fn mig_capability_minors_come_from_the_drivers_access_files_or_fail_naming_the_file() {
    let driver = SimDriver::new().gpus(H100, 1).build();
    let nvml = driver.nvml();
    nvml.discover().unwrap();
    assert_eq!(nvml.proc_root(), driver.root.join("tessera-sim/proc"));
    let (gi, ci, _) = one_mig_device(&nvml);
    let gi_dir = nvml
        .proc_root()
        .join(format!("driver/nvidia/capabilities/gpu0/mig/gi{gi}"));
    let ci_access = gi_dir.join(format!("ci{ci}/access"));
    // The driver, not a formula, decides: a minor no formula would give is the one used.
    fs::write(
        &ci_access,
        "DeviceFileMinor: 777\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
    )
    .unwrap();
    let (_, ci_minor) = nvml.mig_capability_minors(0, gi, ci).unwrap();
    assert_eq!(ci_minor, 777);
    fs::remove_file(&ci_access).unwrap();
    let e = nvml.mig_capability_minors(0, gi, ci).unwrap_err().to_string();
    assert!(e.contains(&ci_access.display().to_string()), "{e}");
}

/// Defect 7 (the same proc root for majors): `/dev/nvidia-uvm` and the caps nodes are numbered from the
/// simulated kernel's `/proc/devices`, not the test host's (which has no NVIDIA driver).
#[test]
fn char_device_majors_come_from_the_driver_roots_proc_devices() {
    let driver = SimDriver::new().gpus(H100, 1).build();
    let nvml = driver.nvml();
    let devices = fs::read_to_string(nvml.proc_root().join("devices")).unwrap();
    let major = |name: &str| -> u32 {
        devices
            .lines()
            .find_map(|l| {
                let (m, n) = l.trim().split_once(' ')?;
                (n == name).then(|| m.parse().unwrap())
            })
            .unwrap()
    };
    let uvm = nvml.char_device("/dev/nvidia-uvm").unwrap();
    assert_eq!((uvm.major, uvm.minor), (major("nvidia-uvm"), 0));
    let cap = nvml.char_device("/dev/nvidia-caps/nvidia-cap12").unwrap();
    assert_eq!((cap.major, cap.minor), (major("nvidia-caps"), 12));
}

// === 9. vGPU guests ===

/// Defect 9: b31ad79 offered dynamic MIG by architecture alone, so in a vGPU guest (whose MIG layout
/// the host fixes) every MIG claim failed at create.
#[test]
fn a_vgpu_guests_gpu_is_offered_without_mig() {
    let vgpu = GpuGroup {
        virtualization_mode: VirtualizationMode::Vgpu,
        ..GpuGroup::plain(H100)
    };
    let driver = SimDriver::new().gpus(H100, 1).group(vgpu).build();
    let found = driver.nvml().discover().unwrap();
    assert!(found.gpus[0].mig.is_some(), "bare metal keeps MIG");
    assert_eq!(found.gpus[1].mig, None, "{:?}", found.gpus[1].mig);
}

// === 10. Fabric ===

/// Defect 10: b31ad79 never read the fabric state, so GPUs behind NVSwitch were published as fit for work
/// before fabric manager had registered them, and CUDA failed on them with error 802. (9b52720 then left
/// them out instead, for good: issue 38's N3, `tests/fabric_health.rs`.) They are kept and the health
/// probe's first reading reports them unfit, which taints them until the fabric completes.
#[test]
fn gpus_with_a_fabric_are_fit_for_work_only_once_it_completed() {
    let fabric = |state| GpuGroup {
        fabric: state,
        ..GpuGroup::plain(H100)
    };
    let driver = SimDriver::new()
        .group(fabric(FabricState::Completed))
        .group(fabric(FabricState::InProgress))
        .group(fabric(FabricState::NotStarted))
        .gpus(H100, 1)
        .build();
    let nvml = driver.nvml();
    let found = nvml.discover().unwrap();
    let published: Vec<u32> = found.gpus.iter().map(|g| g.index).collect();
    assert_eq!(published, [0, 1, 2, 3], "kept, to be offered once ready");
    assert!(found.unusable.is_empty(), "{:?}", found.unusable);
    assert_eq!(nvml.fabric_problem(0), None, "completed fabric");
    assert_eq!(nvml.fabric_problem(3), None, "no fabric");
    for gpu in [1, 2] {
        let why = nvml.fabric_problem(gpu).unwrap();
        assert!(why.contains("fabric manager"), "{why}");
    }
}

// === N8, N9. Handles: lookups by UUID under concurrency, a lost GPU's cached UUID ===

/// N8: the backend looked every GPU's handle up by UUID (`nvmlDeviceGetHandleByUUID`) on every call, and
/// NVIDIA's DRA driver found that call to take O(10 s) when made concurrently (`nvlib.go`). A usage
/// scrape, prepare-like queries and the health source's probe from 8 threads at once must look each
/// GPU's handle up at most once: counted by the simulated driver, not timed.
#[test]
fn concurrent_scrapes_and_prepares_look_each_gpus_handle_up_by_uuid_at_most_once() {
    const GPUS: u32 = 4;
    let driver = SimDriver::new().gpus(H100, GPUS).build();
    let nvml = backend(&driver);
    // The health source has a session of its own, as in the plugin.
    let mut source = NvmlSource::new(Arc::new(driver.nvml()), GPUS, vec![]);
    std::thread::scope(|threads| {
        for thread in 0..8 {
            let nvml = &nvml;
            threads.spawn(move || {
                for round in 0..3 {
                    for gpu in 0..GPUS {
                        let device = format!("gpu-{gpu}");
                        let query = tessera_kubelet_plugin::gpu::usage::UsageQuery {
                            gpu,
                            mig: None,
                            device: &device,
                        };
                        nvml.usage(&query).unwrap();
                        nvml.processes(gpu, None).unwrap();
                        nvml.mig_mode(gpu).unwrap();
                        if (thread + round) % 2 == 0 {
                            nvml.compute_mode(gpu).unwrap();
                        }
                    }
                }
            });
        }
        for _ in 0..3 {
            source.poll(Duration::from_millis(10));
        }
    });
    let calls = tessera_sim_model::calls::NvmlCalls::read(&driver.kernel).unwrap();
    for gpu in driver.model.discover().unwrap().gpus {
        assert!(
            calls.handle_lookups(&gpu.uuid) <= 1,
            "GPU {} looked up by UUID {} times: {calls:?}",
            gpu.index,
            calls.handle_lookups(&gpu.uuid)
        );
    }
}

/// N9: the probe asked a GPU for its UUID, by a handle it had just looked up by that UUID, and called the
/// GPU lost only when that failed. A driver may answer both from its cache for a GPU that fell off the bus
/// (the simulated one does), so such a GPU stayed published healthy while every event wait answered
/// GPU_IS_LOST.
#[test]
fn a_lost_gpu_whose_uuid_the_driver_still_serves_is_reported_lost() {
    let driver = SimDriver::new().gpus(H100, 2).build();
    let mut source = NvmlSource::new(backend(&driver), 2, vec![]);
    source.poll(Duration::from_millis(10));
    driver.model.health().inject(Fault::lost(1)).unwrap();
    let uuid = driver.model.discover().unwrap().gpus[1].uuid.clone();
    let wrapper = driver.nvml_wrapper();
    let lost = wrapper
        .device_by_uuid(uuid.as_str())
        .expect("the lost GPU is still found by its cached UUID");
    assert_eq!(lost.uuid().unwrap(), uuid, "and still answers its UUID");
    assert!(
        lost.memory_info().is_err(),
        "but nothing the GPU itself must answer"
    );
    let seen = poll_until(&mut source, Duration::from_secs(3), |o| {
        failed(o).is_some_and(|f| f.gpu == 1 && f.reason == HealthReason::GpuLost)
    });
    assert!(
        !seen.iter().filter_map(failed).any(|f| f.gpu == 0),
        "GPU 0 is not lost: {seen:?}"
    );
}

/// N9: a handle lookup by UUID answers GPU_IS_LOST "if any GPU has fallen off the bus" (`nvml.h`), so a
/// probe that looked each GPU up again marked the GPUs NVML searches past a lost one lost too.
#[test]
fn a_lost_gpu_does_not_make_the_gpus_after_it_lost() {
    let driver = SimDriver::new().gpus(H100, 3).build();
    let mut source = NvmlSource::new(backend(&driver), 3, vec![]);
    source.poll(Duration::from_millis(10));
    driver.model.health().inject(Fault::lost(0)).unwrap();
    let mut seen = poll_until(&mut source, Duration::from_secs(3), |o| {
        failed(o).is_some_and(|f| f.gpu == 0 && f.reason == HealthReason::GpuLost)
    });
    for _ in 0..3 {
        seen.extend(source.poll(Duration::from_millis(10)));
    }
    let others_failed: Vec<_> = seen.iter().filter_map(failed).filter(|f| f.gpu != 0).collect();
    assert!(others_failed.is_empty(), "{others_failed:?}");
    for gpu in [1, 2] {
        assert!(
            seen.contains(&Observation::Answering { gpu }),
            "GPU {gpu}: {seen:?}"
        );
    }
}

// === 8. Compute mode of whole GPUs ===

struct Plugin {
    dir: tempfile::TempDir,
    claims: FakeClaims,
}

impl Plugin {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            claims: FakeClaims::new(),
        }
    }

    /// The plugin as `cli/take_over.rs` assembles it over `backend`, started in boot `boot_id`.
    fn start(&self, backend: Arc<NvmlBackend>, boot_id: &str) -> Arc<NodeState> {
        let program = PathBuf::from(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"));
        let state_dir = self.dir.path().join("state");
        let mps = MpsManager::new(&state_dir, Launcher::Simulated { program });
        let discovered = backend.discover().unwrap();
        let files = DriverFiles::discover(
            &DriverRoot::new(backend.driver_root()),
            discovered.driver_version.as_deref(),
        );
        let shared = Arc::new(SharedPreparer::new(
            Arc::new(Sharer::new(backend.clone(), mps, false)),
            files,
        ));
        let state = NodeState::new(
            StateConfig {
                node_name: NODE.into(),
                boot_id: boot_id.into(),
                state_dir,
                cdi_dir: self.dir.path().join("cdi"),
            },
            backend,
            discovered.gpus,
            Arc::new(self.claims.clone()),
        );
        let state = with_preparers(state, &shared);
        state.recover().unwrap();
        Arc::new(state)
    }

    fn add(&self, c: k8s_openapi::api::resource::v1::ResourceClaim) -> ClaimRef {
        let r = ClaimRef {
            namespace: c.metadata.namespace.clone().unwrap(),
            name: c.metadata.name.clone().unwrap(),
            uid: c.metadata.uid.clone().unwrap(),
        };
        self.claims.insert(c);
        r
    }
}

/// Defect 8: a whole-GPU claim on a GPU left in EXCLUSIVE_PROCESS (an MPS supervisor killed, an admin's
/// `nvidia-smi -c 3`) kept that mode under b31ad79, so a second CUDA process of the claim failed with
/// "all CUDA-capable devices are busy or unavailable".
#[tokio::test]
async fn a_whole_gpu_claim_gets_its_gpu_back_in_the_default_compute_mode() {
    let driver = SimDriver::new().gpus(H100, 2).build();
    let nvml = backend(&driver);
    nvml.set_compute_mode(0, ComputeMode::ExclusiveProcess).unwrap();
    nvml.set_compute_mode(1, ComputeMode::Prohibited).unwrap();
    let plugin = Plugin::new();
    let state = plugin.start(nvml.clone(), "boot-1");
    let a = plugin.add(claim("a").allocated("gpu-0").build());
    state.prepare(&a).await.unwrap();
    assert_eq!(nvml.compute_mode(0).unwrap(), ComputeMode::Default);
    // Idempotent: prepared again (kubelet retries), nothing changes and nothing fails.
    state.prepare(&a).await.unwrap();
    assert_eq!(nvml.compute_mode(0).unwrap(), ComputeMode::Default);
    let b = plugin.add(claim("b").allocated("gpu-1").build());
    state.prepare(&b).await.unwrap();
    assert_eq!(nvml.compute_mode(1).unwrap(), ComputeMode::Default);
}

// === 1. GPUs by UUID, not NVML index ===

/// The next boot of `driver`'s node with `spec`: the kernel's inventory rewritten (a GPU missing now,
/// say) and a fresh copy of the library under a new driver root, since a loaded library keeps the GPUs it
/// saw at its first `nvmlInit`, as a process keeps its NVML.
fn reboot(
    driver: &BuiltDriver,
    spec: &tessera_sim_model::backend::NodeSpec,
) -> (tempfile::TempDir, Arc<NvmlBackend>) {
    tessera_sim_model::backend::SimulatedBackend::from_spec("node-nvml", spec, &driver.kernel).unwrap();
    let root = tempfile::tempdir().unwrap();
    tessera_sim_model::driver_root::install(root.path(), &driver.kernel, &[sim_driver::artifacts_dir()])
        .unwrap();
    let b = Arc::new(NvmlBackend::new(root.path()).unwrap());
    b.discover().unwrap();
    (root, b)
}

fn four_h100s(absent: &[u32]) -> GpuGroup {
    GpuGroup {
        count: 4,
        absent: absent.to_vec(),
        ..GpuGroup::plain(H100)
    }
}

/// Defect 1: records named GPUs by NVML index only, and a whole GPU's record of an earlier boot was
/// re-adopted without a look at the hardware. NVML numbers GPUs by position, so after a reboot that lost
/// GPU 1, index 2 is the GPU that was 3, and the pod's claim would be re-adopted onto it (while the pod
/// still runs on the GPU that was 2).
#[tokio::test]
async fn a_record_whose_gpu_index_now_names_another_gpu_is_not_readopted() {
    let driver = SimDriver::new().group(four_h100s(&[])).build();
    let plugin = Plugin::new();
    let before = backend(&driver);
    let uuids: Vec<String> = before
        .discover()
        .unwrap()
        .gpus
        .into_iter()
        .map(|g| g.uuid)
        .collect();
    let first = plugin.start(before, "boot-1");
    let c = plugin.add(claim("train").allocated("gpu-2").reserved_for_pod("p").build());
    first.prepare(&c).await.unwrap();
    drop(first);

    let spec = tessera_sim_model::backend::NodeSpec::default().with_group(four_h100s(&[1]));
    let (_root, after) = reboot(&driver, &spec);
    assert_eq!(
        after.uuid_of(2).as_deref(),
        Some(uuids[3].as_str()),
        "indices shifted"
    );
    let second = plugin.start(after, "boot-2");
    let recovery = second.reconcile().await;
    assert!(!recovery.adopted.contains(&c.uid), "{recovery:?}");
    let (uid, why) = &recovery.wrong_gpu[0];
    assert_eq!(uid, &c.uid);
    assert!(why.contains(&uuids[2]) && why.contains(&uuids[3]), "{why}");
    assert!(
        second.problems().iter().any(|p| p.contains(&c.uid)),
        "the inventory says why: {:?}",
        second.problems()
    );
}

/// Defect 1, without a checkpoint: a claim in use is rebuilt from its allocation and CDI spec, and
/// b31ad79 took the allocation's `gpu-2` for whatever GPU index 2 now is. The spec names the GPU the pod
/// got; when that is not index 2's any more, the claim is not re-adopted.
#[tokio::test]
async fn a_claim_rebuilt_without_a_checkpoint_is_not_readopted_onto_a_shifted_gpu() {
    let driver = SimDriver::new().group(four_h100s(&[])).build();
    let plugin = Plugin::new();
    let first = plugin.start(backend(&driver), "boot-1");
    let c = plugin.add(claim("train").allocated("gpu-2").reserved_for_pod("p").build());
    first.prepare(&c).await.unwrap();
    drop(first);
    fs::remove_file(plugin.dir.path().join("state/checkpoint.json")).unwrap();

    let spec = tessera_sim_model::backend::NodeSpec::default().with_group(four_h100s(&[1]));
    let (_root, after) = reboot(&driver, &spec);
    let second = plugin.start(after, "boot-2");
    let recovery = second.reconcile().await;
    assert!(!recovery.adopted.contains(&c.uid), "{recovery:?}");
    assert!(!second.checkpoint().claims.contains_key(&c.uid));
}

/// Defect 1 (the other half): a record of an earlier boot whose UUID still matches is re-adopted.
#[tokio::test]
async fn a_record_of_an_earlier_boot_on_the_same_gpu_is_readopted() {
    let driver = SimDriver::new().gpus(H100, 2).build();
    let plugin = Plugin::new();
    let first = plugin.start(backend(&driver), "boot-1");
    let c = plugin.add(claim("keep").allocated("gpu-1").reserved_for_pod("p").build());
    first.prepare(&c).await.unwrap();
    drop(first);
    let second = plugin.start(backend(&driver), "boot-2");
    let recovery = second.reconcile().await;
    assert_eq!(recovery.adopted, std::slice::from_ref(&c.uid), "{recovery:?}");
    assert!(recovery.wrong_gpu.is_empty());
}

/// Defect 1 (every record names its GPU by UUID): a MIG device's record kept only the parent's index, so
/// nothing could tell which physical GPU its instance is on. A record written before the UUID was kept
/// (b31ad79's) is read, migrated at the next start of the same boot, and rewritten with it.
#[tokio::test]
async fn a_mig_devices_record_names_its_parent_gpu_by_uuid_and_old_records_are_migrated() {
    let driver = SimDriver::new().gpus(H100, 2).build();
    let nvml = backend(&driver);
    let gpu1 = nvml.uuid_of(1).unwrap();
    let plugin = Plugin::new();
    let first = plugin.start(nvml.clone(), "boot-1");
    let c = plugin.add(claim("m").allocated("gpu-1-mig-1g-10gb-0").build());
    first.prepare(&c).await.unwrap();
    drop(first);
    let store = CheckpointStore::new(&plugin.dir.path().join("state"));
    let mig = |store: &CheckpointStore| {
        let Loaded::Current(cp) = store.load("boot-1").unwrap() else {
            panic!("a checkpoint of this boot")
        };
        let DeviceDetail::Mig(m) = cp.claims[&c.uid].devices[0].detail.clone() else {
            panic!("a MIG device")
        };
        (cp, m)
    };
    let (mut cp, m) = mig(&store);
    assert_eq!(m.gpu_uuid.as_deref(), Some(gpu1.as_str()));
    assert!(m.uuid.as_deref().is_some_and(|u| u.starts_with("MIG-")), "{m:?}");

    // As b31ad79 wrote it: no parent UUID.
    if let DeviceDetail::Mig(m) = &mut cp.claims.get_mut(&c.uid).unwrap().devices[0].detail {
        m.gpu_uuid = None;
    }
    store.save(&cp).unwrap();
    let second = plugin.start(nvml.clone(), "boot-1");
    assert_eq!(second.checkpoint().claims.len(), 1, "the old record is kept");
    let (_, m) = mig(&store);
    assert_eq!(m.gpu_uuid.as_deref(), Some(gpu1.as_str()), "migrated on disk");
    // And the MIG instance it names is still the claim's: not swept as unknown.
    assert_eq!(nvml.list_gpu_instances(1).unwrap().len(), 1);
}
