//! The real `nvml` backend (`gpu/nvml.rs`, through nvml-wrapper) against the simulated driver root's
//! `libnvidia-ml.so.1` (crate `tessera-sim-nvml`): every call below crosses the C ABI into the built
//! library, which answers from the simulated hardware model.
//!
//! Needs the library built first: `cargo build -p tessera-sim-nvml && cargo test -p
//! tessera-kubelet-plugin --test nvml_lib`. Each test builds its own driver root with its own copy of the
//! library (see `common/sim_driver.rs`), so tests run in parallel without sharing a library instance.
//!
//! What a container sees, and a kernel it cannot write, are checked in a child process: the view is
//! decided by the process's `/dev` (overridden for tests through `TESSERA_SIM_DEV_ROOT`, which the library
//! reads at `nvmlInit`) and the kernel's writability by the process's user, neither of which a test can
//! change for its own process without affecting the others.
#![allow(
    unsafe_code,
    reason = "a few NVML calls tessera's backend does not make are checked through nvml-wrapper's raw table"
)]

#[path = "common/sim_driver.rs"]
mod sim_driver;

use std::{fs, mem, path::Path, process::Command, ptr};

use nvml_wrapper::error::nvml_sym;
use nvml_wrapper_sys::bindings::{
    nvmlEventData_t, nvmlEventSet_t, nvmlEventTypeXidCriticalError, nvmlGpuFabricInfo_t,
    nvmlGpuInstanceInfo_t, nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlGpuInstanceProfileInfo_v3_t,
};
use sim_driver::SimDriver;
use tessera_api::MigPlacement;
use tessera_kubelet_plugin::gpu::{ComputeMode, GpuBackend, GpuError, NodeGpus};
use tessera_sim_model::backend::{FabricState, GpuGroup, NamedProcess, VirtualizationMode};
use tessera_sim_model::faults::{Fault, FaultKind};

fn placement(start: u32, size: u32) -> MigPlacement {
    MigPlacement { start, size }
}

/// Discovery without the fields NVML reads from the host's sysfs (NUMA node, PCIe root), which the
/// library cannot fake: the simulated GPUs' bus ids may name real devices of the test host.
fn without_sysfs(mut found: NodeGpus) -> NodeGpus {
    for g in &mut found.gpus {
        g.numa_node = None;
        g.pcie_root = None;
    }
    found
}

const fn struct_version<T>(version: u32) -> u32 {
    (mem::size_of::<T>() as u32) | (version << 24)
}

#[test]
fn discovery_through_nvml_reports_what_the_simulated_model_holds() {
    let driver = SimDriver::new()
        .gpus("H100-SXM5-80GB", 2)
        .mig_gpus("A100-SXM4-40GB", 1)
        .gpus("B200", 1)
        .build();
    let through_nvml = without_sysfs(driver.nvml().discover().unwrap());
    let direct = without_sysfs(driver.model.discover().unwrap());
    assert_eq!(through_nvml.gpus.len(), 4);
    assert_eq!(through_nvml, direct);
    let a100 = &through_nvml.gpus[2];
    assert_eq!(a100.product_name, "NVIDIA A100-SXM4-40GB");
    assert_eq!(a100.multiprocessors, 108);
    let mig = a100.mig.as_ref().unwrap();
    assert!(mig.enabled && !mig.mode_toggle_without_reset);
    assert_eq!(
        mig.profile("3g.20gb").unwrap().placements,
        [placement(0, 4), placement(4, 4)]
    );
}

#[test]
fn gpu_and_compute_instances_of_every_h100_profile_are_created_listed_and_destroyed_through_nvml() {
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 1).build();
    let nvml = driver.nvml();
    nvml.set_mig_mode(0, true).unwrap();
    assert!(nvml.mig_mode(0).unwrap().current);
    let profiles = nvml.discover().unwrap().gpus[0].mig.clone().unwrap().profiles;
    assert_eq!(profiles.len(), 7);
    for prof in &profiles {
        for &pl in &prof.placements {
            let gi = nvml
                .create_gpu_instance(0, prof.profile_id, pl)
                .unwrap_or_else(|e| panic!("{} {pl:?}: {e}", prof.name));
            let ci = nvml.create_compute_instance(0, gi).unwrap();
            let listed = nvml.list_gpu_instances(0).unwrap();
            let held = driver.model.list_gpu_instances(0).unwrap();
            assert_eq!(listed.len(), 1);
            let ids = |gis: &[tessera_kubelet_plugin::gpu::GpuInstance]| {
                gis.iter()
                    .map(|g| {
                        let cis: Vec<(u32, u32)> =
                            g.compute_instances.iter().map(|c| (c.id, c.profile_id)).collect();
                        (g.id, g.profile_id, g.placement, cis)
                    })
                    .collect::<Vec<_>>()
            };
            assert_eq!(ids(&listed), ids(&held), "{} {pl:?}", prof.name);
            assert_eq!(listed[0].compute_instances[0].id, ci.id);
            nvml.destroy_compute_instance(0, gi, ci.id).unwrap();
            nvml.destroy_gpu_instance(0, gi).unwrap();
            assert!(nvml.list_gpu_instances(0).unwrap().is_empty());
        }
    }
}

#[test]
fn a_mig_device_handle_carries_the_mig_uuid_and_the_compute_instance_info_names_the_parent() {
    let driver = SimDriver::new().mig_gpus("H200-SXM-141GB", 1).build();
    let gi = driver.model.create_gpu_instance(0, 9, placement(4, 4)).unwrap();
    let ci = driver.model.create_compute_instance(0, gi).unwrap();
    let nvml = driver.nvml_wrapper();
    let parent = nvml.device_by_index(0).unwrap();
    let mig = parent.mig_device_by_index(0).unwrap();
    assert_eq!(mig.uuid().unwrap(), ci.uuid);
    assert!(mig.mig_is_mig_device_handle().unwrap());
    assert_eq!(mig.name().unwrap(), "NVIDIA H200 MIG 3g.71gb");
    assert_eq!(mig.memory_info().unwrap().total, 71168 * 1024 * 1024);
    assert_eq!(
        mig.mig_parent_device().unwrap().uuid().unwrap(),
        parent.uuid().unwrap()
    );
    assert_eq!(
        nvml.device_by_uuid(ci.uuid.as_str()).unwrap().uuid().unwrap(),
        ci.uuid
    );
    let lib = nvml.lib();
    // SAFETY: handles come from the library just above; the structs are plain data it fills in.
    unsafe {
        let get_gi = nvml_sym(lib.nvmlDeviceGetGpuInstanceById.as_ref()).unwrap();
        let get_ci = nvml_sym(lib.nvmlGpuInstanceGetComputeInstanceById.as_ref()).unwrap();
        let info = nvml_sym(lib.nvmlComputeInstanceGetInfo_v2.as_ref()).unwrap();
        let mut gi_handle = ptr::null_mut();
        assert_eq!(get_gi(parent.handle(), gi, &mut gi_handle), 0);
        let mut ci_handle = ptr::null_mut();
        assert_eq!(get_ci(gi_handle, ci.id, &mut ci_handle), 0);
        let mut ci_info = mem::zeroed();
        assert_eq!(info(ci_handle, &mut ci_info), 0);
        // nvml.h: `device` is the parent device; the MIG device's UUID is not read from it.
        assert_eq!(ci_info.device, parent.handle());
        assert_eq!((ci_info.id, ci_info.profileId), (ci.id, ci.profile_id));
        assert_eq!(get_ci(gi_handle, ci.id + 1, &mut ci_handle), 6, "NOT_FOUND");
        assert_eq!(get_gi(parent.handle(), 14, &mut gi_handle), 6, "NOT_FOUND");
    }
}

/// NVIDIA's GI, CI and MIG device handles point to the driver's objects, which die with the instance: a
/// handle kept across a destroy is invalid even after an instance with the same ids was created, and
/// must never reach the new one (`nvml.h`: INVALID_ARGUMENT "if \a gpuInstance ... is invalid").
#[test]
fn handles_kept_across_a_destroy_are_refused_though_an_instance_with_the_same_ids_was_created() {
    const INVALID_ARGUMENT: u32 = 2;
    let driver = SimDriver::new().mig_gpus("H100-SXM5-80GB", 1).build();
    let nvml = driver.nvml_wrapper();
    let parent = nvml.device_by_index(0).unwrap();
    let lib = nvml.lib();
    // SAFETY: handles come from the library (the stale ones are only given back to it, which is what is
    // checked); the structs are plain data it fills in.
    unsafe {
        let create_gi = nvml_sym(lib.nvmlDeviceCreateGpuInstanceWithPlacement.as_ref()).unwrap();
        let gi_info = nvml_sym(lib.nvmlGpuInstanceGetInfo.as_ref()).unwrap();
        let destroy_gi = nvml_sym(lib.nvmlGpuInstanceDestroy.as_ref()).unwrap();
        let create_ci = nvml_sym(lib.nvmlGpuInstanceCreateComputeInstance.as_ref()).unwrap();
        let ci_info = nvml_sym(lib.nvmlComputeInstanceGetInfo_v2.as_ref()).unwrap();
        let destroy_ci = nvml_sym(lib.nvmlComputeInstanceDestroy.as_ref()).unwrap();
        let mig_by_index = nvml_sym(lib.nvmlDeviceGetMigDeviceHandleByIndex.as_ref()).unwrap();
        let uuid = nvml_sym(lib.nvmlDeviceGetUUID.as_ref()).unwrap();
        // One 1g.10gb device (GI profile 19, CI profile 0) at slice 0, made twice with the same ids.
        let make = || {
            let pl = nvml_wrapper_sys::bindings::nvmlGpuInstancePlacement_t { start: 0, size: 1 };
            let (mut gi, mut ci, mut mig) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
            assert_eq!(create_gi(parent.handle(), 19, &pl, &mut gi), 0);
            assert_eq!(create_ci(gi, 0, &mut ci), 0);
            assert_eq!(mig_by_index(parent.handle(), 0, &mut mig), 0);
            (gi, ci, mig)
        };
        let ids = |gi, ci| {
            let (mut g, mut c) = (mem::zeroed::<nvmlGpuInstanceInfo_t>(), mem::zeroed());
            assert_eq!(gi_info(gi, &mut g), 0);
            assert_eq!(ci_info(ci, &mut c), 0);
            (g.id, c.id)
        };
        let mut buf = [0 as std::ffi::c_char; 96];
        let (old_gi, old_ci, old_mig) = make();
        let old_ids = ids(old_gi, old_ci);
        assert_eq!(destroy_ci(old_ci), 0);
        assert_eq!(destroy_gi(old_gi), 0);
        let (new_gi, new_ci, new_mig) = make();
        assert_eq!(ids(new_gi, new_ci), old_ids, "the same ids again");
        let mut info = mem::zeroed::<nvmlGpuInstanceInfo_t>();
        assert_eq!(gi_info(old_gi, &mut info), INVALID_ARGUMENT);
        let mut info = mem::zeroed();
        assert_eq!(ci_info(old_ci, &mut info), INVALID_ARGUMENT);
        assert_eq!(uuid(old_mig, buf.as_mut_ptr(), 96), INVALID_ARGUMENT);
        // A stale handle destroys nothing: the new instance is still there.
        assert_eq!(destroy_ci(old_ci), INVALID_ARGUMENT);
        assert_eq!(destroy_gi(old_gi), INVALID_ARGUMENT);
        assert_eq!(ids(new_gi, new_ci), old_ids);
        assert_eq!(uuid(new_mig, buf.as_mut_ptr(), 96), 0);
    }
}

/// A real driver keeps a MIG mode change pending (activation status IN_USE) while another process holds
/// the GPU open through NVML, though `nvidia-smi` lists no process for it; a holder that dies, however it
/// dies, holds nothing.
#[test]
fn another_processes_nvml_session_keeps_a_mig_mode_change_pending_until_that_process_is_gone() {
    const IN_USE: u32 = 19;
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 1).build();
    let nvml = driver.nvml_wrapper();
    let device = nvml.device_by_index(0).unwrap();
    let holder = driver.hold_nvml();
    assert!(device.running_compute_processes().unwrap().is_empty());
    assert_eq!(device.set_mig_mode(true).unwrap(), IN_USE);
    let mode = device.mig_mode().unwrap();
    assert_eq!((mode.current, mode.pending), (0, 1), "pending only");
    holder.kill();
    assert_eq!(device.set_mig_mode(true).unwrap(), 0);
    assert_eq!(device.mig_mode().unwrap().current, 1);
}

#[test]
fn profile_indices_past_the_last_known_are_invalid_argument_and_ones_the_gpu_lacks_not_supported() {
    // MIG on: the V call refuses every index with MIG off (the next test).
    let driver = SimDriver::new().mig_gpus("H100-SXM5-80GB", 1).build();
    let nvml = driver.nvml_wrapper();
    let device = nvml.device_by_index(0).unwrap();
    let lib = nvml.lib();
    // SAFETY: a live device handle and zeroed plain-data structs with the version nvml.h asks for.
    unsafe {
        let get_v = nvml_sym(lib.nvmlDeviceGetGpuInstanceProfileInfoV.as_ref()).unwrap();
        let get_v1 = nvml_sym(lib.nvmlDeviceGetGpuInstanceProfileInfo.as_ref()).unwrap();
        let v3 = |index: u32| {
            let mut info: nvmlGpuInstanceProfileInfo_v3_t = mem::zeroed();
            info.version = struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3);
            let ret = get_v(device.handle(), index, ptr::from_mut(&mut info).cast());
            (ret, info)
        };
        let (ret, info) = v3(9);
        assert_eq!(
            (ret, info.id, info.sliceCount, info.memorySizeMB),
            (0, 15, 1, 20096)
        );
        let name: Vec<u8> = info
            .name
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        assert_eq!(name, b"MIG 1g.20gb");
        assert_eq!(v3(0x5).0, 3, "8_SLICE: NOT_SUPPORTED on an H100");
        assert_eq!(v3(0x11).0, 3, "3_SLICE_GFX: the last known index, not on an H100");
        assert_eq!(
            v3(0x12).0,
            2,
            "past the last index: INVALID_ARGUMENT ends the enumeration"
        );
        let mut v2: nvmlGpuInstanceProfileInfo_v2_t = mem::zeroed();
        v2.version = struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2);
        assert_eq!(get_v(device.handle(), 0, &mut v2), 0);
        assert_eq!((v2.id, v2.instanceCount), (19, 7));
        v2.version = struct_version::<nvmlGpuInstanceProfileInfo_t>(1);
        assert_eq!(
            get_v(device.handle(), 0, &mut v2),
            25,
            "ARGUMENT_VERSION_MISMATCH"
        );
        let mut v1: nvmlGpuInstanceProfileInfo_t = mem::zeroed();
        assert_eq!(get_v1(device.handle(), 4, &mut v1), 0);
        assert_eq!((v1.id, v1.multiprocessorCount), (0, 132));
    }
}

/// nvml.h:12855: the V call answers NOT_SUPPORTED "If device doesn't have MIG mode enabled"; nvml.h:12824:
/// v1 only if the device "doesn't support MIG". MIG off is the boot default.
#[test]
fn with_mig_off_the_v_profile_call_refuses_and_the_v1_call_answers() {
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 1).build();
    let nvml = driver.nvml_wrapper();
    let device = nvml.device_by_index(0).unwrap();
    let lib = nvml.lib();
    // SAFETY: a live device handle and zeroed plain-data structs with the version nvml.h asks for.
    unsafe {
        let get_v = nvml_sym(lib.nvmlDeviceGetGpuInstanceProfileInfoV.as_ref()).unwrap();
        let get_v1 = nvml_sym(lib.nvmlDeviceGetGpuInstanceProfileInfo.as_ref()).unwrap();
        let mut v3: nvmlGpuInstanceProfileInfo_v3_t = mem::zeroed();
        v3.version = struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3);
        assert_eq!(
            get_v(device.handle(), 0, ptr::from_mut(&mut v3).cast()),
            3,
            "v3: NOT_SUPPORTED with MIG off"
        );
        let mut v2: nvmlGpuInstanceProfileInfo_v2_t = mem::zeroed();
        v2.version = struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2);
        assert_eq!(
            get_v(device.handle(), 0, &mut v2),
            3,
            "v2: NOT_SUPPORTED with MIG off"
        );
        let mut v1: nvmlGpuInstanceProfileInfo_t = mem::zeroed();
        assert_eq!(get_v1(device.handle(), 0, &mut v1), 0);
        assert_eq!((v1.id, v1.instanceCount, v1.memorySizeMB), (19, 7, 9984));
        assert_eq!(
            get_v1(device.handle(), 0x12, &mut v1),
            2,
            "v1 still ends at INVALID_ARGUMENT"
        );
    }
}

#[test]
fn an_overlapping_placement_is_refused_with_insufficient_resources() {
    let driver = SimDriver::new().mig_gpus("H100-SXM5-80GB", 1).build();
    let nvml = driver.nvml();
    nvml.create_gpu_instance(0, 9, placement(4, 4)).unwrap();
    for (profile, pl) in [(9, placement(4, 4)), (19, placement(5, 1)), (0, placement(0, 8))] {
        let e = nvml.create_gpu_instance(0, profile, pl).unwrap_err();
        assert!(
            matches!(e, GpuError::InsufficientResources(_)),
            "{profile} {pl:?}: {e}"
        );
    }
    let e = nvml.create_gpu_instance(0, 9, placement(2, 4)).unwrap_err();
    assert!(matches!(e, GpuError::InvalidArgument(_)), "{e}");
    nvml.create_gpu_instance(0, 5, placement(0, 4)).unwrap();
}

#[test]
fn the_compute_mode_set_through_nvml_is_the_hardwares() {
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 2).build();
    let nvml = driver.nvml();
    nvml.set_compute_mode(1, ComputeMode::ExclusiveProcess).unwrap();
    assert_eq!(nvml.compute_mode(1).unwrap(), ComputeMode::ExclusiveProcess);
    assert_eq!(
        driver.model.compute_mode(1).unwrap(),
        ComputeMode::ExclusiveProcess
    );
    assert_eq!(nvml.compute_mode(0).unwrap(), ComputeMode::Default);
    driver.model.set_compute_mode(0, ComputeMode::Prohibited).unwrap();
    assert_eq!(nvml.compute_mode(0).unwrap(), ComputeMode::Prohibited);
}

#[test]
fn processes_are_listed_per_gpu_and_per_mig_device_and_named_ones_by_their_name() {
    let mut dcgm = GpuGroup::plain("H100-SXM5-80GB");
    dcgm.mig_enabled = true;
    dcgm.processes = vec![NamedProcess {
        pid: 4_200_001,
        name: "nv-hostengine".into(),
    }];
    let driver = SimDriver::new().group(dcgm).build();
    let nvml = driver.nvml();
    assert_eq!(nvml.processes(0, None).unwrap(), [4_200_001]);
    let gi = nvml.create_gpu_instance(0, 19, placement(2, 1)).unwrap();
    let ci = nvml.create_compute_instance(0, gi).unwrap();
    driver.model.add_process(0, Some((gi, ci.id)), 4_200_077).unwrap();
    assert_eq!(nvml.processes(0, Some((gi, ci.id))).unwrap(), [4_200_077]);
    assert_eq!(nvml.processes(0, None).unwrap(), [4_200_001, 4_200_077]);
    let wrapper = driver.nvml_wrapper();
    assert_eq!(wrapper.sys_process_name(4_200_001, 64).unwrap(), "nv-hostengine");
    // DCGM holds the GPU: a MIG mode change is only pending, with IN_USE as its activation status.
    driver.model.destroy_compute_instance(0, gi, ci.id).unwrap_err();
    driver.model.remove_process(0, 4_200_077).unwrap();
    nvml.destroy_compute_instance(0, gi, ci.id).unwrap();
    nvml.destroy_gpu_instance(0, gi).unwrap();
    let e = nvml.set_mig_mode(0, false).unwrap_err();
    assert!(matches!(e, GpuError::InUse(_)), "{e}");
    assert!(nvml.mig_mode(0).unwrap().current);
}

/// Issue 22 item 6: `simulate load --pid` stands for a container's process, which NVML names by its host
/// PID with its memory and SM share; the backend leaves the owner to the metrics' host /proc lookup.
#[test]
fn a_synthetic_load_on_a_host_pid_is_reported_through_nvml_with_its_memory_and_sm_samples() {
    use tessera_gpu_api::usage::UsageQuery;
    use tessera_sim_model::load as simulated_load;
    use tessera_sim_model::load::LoadEntry;
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 2).build();
    let pid = std::process::id();
    let entry = LoadEntry {
        device: "gpu-1-shared".into(),
        claim: None,
        utilization_percent: 40,
        memory_bytes: 3 << 30,
        pid: Some(pid),
        ..LoadEntry::default()
    };
    simulated_load::set(&driver.kernel, entry).unwrap();
    let nvml = driver.nvml();
    let query = |gpu| UsageQuery {
        gpu,
        mig: None,
        device: "gpu-1-shared",
    };
    let usage = nvml.usage(&query(1)).unwrap();
    assert_eq!(usage.utilization_percent, Some(40));
    assert_eq!(usage.processes.len(), 1, "{usage:?}");
    let p = &usage.processes[0];
    assert_eq!(
        (p.pid, p.sm_percent, p.memory_used_bytes),
        (pid, Some(40), Some(3 << 30))
    );
    assert_eq!(p.owner, None, "NVML names PIDs only");
    let idle = nvml.usage(&query(0)).unwrap();
    assert_eq!((idle.utilization_percent, idle.processes.len()), (Some(0), 0));
}

#[test]
fn mig_state_survives_a_plugin_restart_on_a_new_nvml_backend() {
    let driver = SimDriver::new().mig_gpus("B200", 2).build();
    let (gi, ci) = {
        let first = driver.nvml();
        let gi = first.create_gpu_instance(1, 14, placement(2, 2)).unwrap();
        (gi, first.create_compute_instance(1, gi).unwrap())
    };
    let restarted = driver.nvml();
    let listed = restarted.list_gpu_instances(1).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].id, listed[0].placement), (gi, placement(2, 2)));
    assert_eq!(listed[0].compute_instances[0].id, ci.id);
    assert_eq!(
        driver.model.list_gpu_instances(1).unwrap()[0].compute_instances[0].uuid,
        {
            let w = driver.nvml_wrapper();
            w.device_by_index(1)
                .unwrap()
                .mig_device_by_index(0)
                .unwrap()
                .uuid()
                .unwrap()
        }
    );
}

#[test]
fn fabric_state_and_virtualization_mode_come_from_the_node_file() {
    let mut nvswitch = GpuGroup::plain("H100-SXM5-80GB");
    nvswitch.fabric = FabricState::InProgress;
    let mut guest = GpuGroup::plain("H100-SXM5-80GB");
    guest.virtualization_mode = VirtualizationMode::Vgpu;
    let driver = SimDriver::new().group(nvswitch).group(guest).build();
    let nvml = driver.nvml_wrapper();
    let lib = nvml.lib();
    let fabric = |i: u32| {
        let d = nvml.device_by_index(i).unwrap();
        // SAFETY: a live handle and a zeroed plain-data struct.
        unsafe {
            let get = nvml_sym(lib.nvmlDeviceGetGpuFabricInfo.as_ref()).unwrap();
            let mut info: nvmlGpuFabricInfo_t = mem::zeroed();
            (get(d.handle(), &mut info), info.state)
        }
    };
    assert_eq!(fabric(0), (0, 2), "IN_PROGRESS");
    assert_eq!(fabric(1).0, 3, "no fabric: NOT_SUPPORTED");
    use nvml_wrapper::enum_wrappers::device::GpuVirtualizationMode;
    assert_eq!(
        nvml.device_by_index(1).unwrap().virtualization_mode().unwrap(),
        GpuVirtualizationMode::Vgpu
    );
    assert_eq!(
        nvml.device_by_index(0).unwrap().virtualization_mode().unwrap(),
        GpuVirtualizationMode::Bare
    );
}

#[test]
fn a_gpu_whose_library_and_kernel_module_mismatch_answers_18_and_is_left_out_of_discovery() {
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 3).build();
    driver
        .model
        .health()
        .inject(Fault::failing(1, FaultKind::LibraryMismatch))
        .unwrap();
    driver
        .model
        .health()
        .inject(Fault::failing(2, FaultKind::DriverNotLoaded))
        .unwrap();
    let nvml = driver.nvml_wrapper();
    assert!(matches!(
        nvml.device_by_index(1),
        Err(nvml_wrapper::error::NvmlError::LibRmVersionMismatch)
    ));
    assert!(matches!(
        nvml.device_by_index(2),
        Err(nvml_wrapper::error::NvmlError::DriverNotLoaded)
    ));
    let found = driver.nvml().discover().unwrap();
    assert_eq!(found.gpus.iter().map(|g| g.index).collect::<Vec<_>>(), [0]);
    assert_eq!(found.unusable.iter().map(|u| u.index).collect::<Vec<_>>(), [1, 2]);
    driver.model.health().recover(1).unwrap();
    assert_eq!(driver.nvml().discover().unwrap().gpus.len(), 2);
}

#[test]
fn an_xid_is_delivered_once_and_a_reset_drops_the_gpus_event_registration() {
    let driver = SimDriver::new().mig_gpus("H100-SXM5-80GB", 2).build();
    let nvml = driver.nvml_wrapper();
    let lib = nvml.lib();
    // SAFETY: the set and handles come from the library; the event data is plain data it fills in.
    unsafe {
        let create = nvml_sym(lib.nvmlEventSetCreate.as_ref()).unwrap();
        let register = nvml_sym(lib.nvmlDeviceRegisterEvents.as_ref()).unwrap();
        let wait = nvml_sym(lib.nvmlEventSetWait_v2.as_ref()).unwrap();
        let free = nvml_sym(lib.nvmlEventSetFree.as_ref()).unwrap();
        let mut set: nvmlEventSet_t = ptr::null_mut();
        assert_eq!(create(&mut set), 0);
        let xid = u64::from(nvmlEventTypeXidCriticalError);
        for i in 0..2 {
            assert_eq!(register(nvml.device_by_index(i).unwrap().handle(), xid, set), 0);
        }
        let next = |timeout| {
            let mut data: nvmlEventData_t = mem::zeroed();
            (wait(set, &mut data, timeout), data)
        };
        assert_eq!(next(0).0, 10, "nothing yet: TIMEOUT");
        let health = driver.model.health();
        let mut on_gi = Fault::xid(1, 79);
        on_gi.gpu_instance = Some(3);
        health.inject(on_gi).unwrap();
        let (ret, data) = next(2_000);
        assert_eq!(ret, 0);
        assert_eq!((data.eventType, data.eventData), (xid, 79));
        assert_eq!((data.gpuInstanceId, data.computeInstanceId), (3, 0xFFFF_FFFF));
        assert_eq!(data.device, nvml.device_by_index(1).unwrap().handle());
        assert_eq!(next(200).0, 10, "delivered once");
        // Registering a GPU again keeps what it raised since the last wait.
        health.inject(Fault::xid(1, 31)).unwrap();
        assert_eq!(register(nvml.device_by_index(1).unwrap().handle(), xid, set), 0);
        assert_eq!(next(2_000).1.eventData, 31);
        // A reset of GPU 0 drops its registration: its next XID is not delivered.
        driver.model.reset_gpu(0).unwrap();
        health.inject(Fault::xid(0, 48)).unwrap();
        assert_eq!(next(300).0, 10);
        assert_eq!(register(nvml.device_by_index(0).unwrap().handle(), xid, set), 0);
        health.recover(0).unwrap();
        health.inject(Fault::xid(0, 94)).unwrap();
        let (ret, data) = next(2_000);
        assert_eq!(
            (ret, data.eventData),
            (0, 94),
            "registered again, delivered again"
        );
        health.inject(Fault::lost(1)).unwrap();
        assert_eq!(next(2_000).0, 15, "GPU_IS_LOST");
        assert_eq!(next(2_000).0, 15, "on every wait while the GPU is lost");
        assert_eq!(free(set), 0);
    }
}

// === A container's view and a read-only kernel, in a child process ===

const CHILD_ENV: &str = "TESSERA_NVML_LIB_CHILD";
const CHILD_ROOT_ENV: &str = "TESSERA_NVML_LIB_CHILD_ROOT";
const CHILD_EXPECT_ENV: &str = "TESSERA_NVML_LIB_CHILD_EXPECT";
/// `nobody` on Debian-like systems: a user that cannot write a root-owned kernel directory.
const NOBODY: u32 = 65534;

/// Runs [`child`] in a new process with `dev_root` as its `/dev`, as a user who cannot write the kernel
/// (nobody when the tests run as root; otherwise the kernel's lock file is made read-only).
fn run_child(driver: &sim_driver::BuiltDriver, scenario: &str, dev_root: &Path, expect: &str) {
    driver.open_to_other_users();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, scenario)
        .env(CHILD_ROOT_ENV, &driver.root)
        .env(CHILD_EXPECT_ENV, expect)
        .env("TESSERA_SIM_DEV_ROOT", dev_root);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        use std::os::unix::process::CommandExt;
        cmd.uid(NOBODY).gid(NOBODY);
    } else {
        use std::os::unix::fs::PermissionsExt;
        let lock = driver.kernel.join("simulated-gpus.lock");
        fs::set_permissions(lock, fs::Permissions::from_mode(0o444)).unwrap();
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child {scenario} failed:\n{text}");
    assert!(text.contains("1 passed"), "the child test did not run:\n{text}");
}

/// The child side: does nothing in an ordinary test run.
#[test]
fn child() {
    let Ok(scenario) = std::env::var(CHILD_ENV) else {
        return;
    };
    let root = std::path::PathBuf::from(std::env::var(CHILD_ROOT_ENV).unwrap());
    let expect = std::env::var(CHILD_EXPECT_ENV).unwrap();
    let nvml = tessera_kubelet_plugin::gpu::nvml::NvmlBackend::new(&root).unwrap();
    match scenario.as_str() {
        "read-only" => {
            assert_eq!(nvml.discover().unwrap().gpus.len(), 2, "the host view: every GPU");
            for e in [
                nvml.set_mig_mode(0, false).unwrap_err(),
                nvml.create_gpu_instance(0, 19, placement(0, 1)).unwrap_err(),
                nvml.destroy_gpu_instance(1, expect.parse().unwrap()).unwrap_err(),
            ] {
                assert!(matches!(e, GpuError::NoPermission(_)), "{e}");
            }
            assert_eq!(nvml.list_gpu_instances(1).unwrap().len(), 1, "reads still work");
        }
        "container" => {
            let (gpu_uuid, mig_uuid) = expect.split_once(' ').unwrap();
            let found = nvml.discover().unwrap();
            assert_eq!(found.gpus.len(), 1, "only the GPU whose /dev node exists");
            assert_eq!(
                (found.gpus[0].index, found.gpus[0].minor),
                (0, 1),
                "NVML index 0 is GPU minor 1"
            );
            assert_eq!(found.gpus[0].uuid, gpu_uuid);
            assert_eq!(
                nvml.list_gpu_instances(0).unwrap().len(),
                1,
                "only the GI whose cap exists"
            );
            let lib = root.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
            let w = nvml_wrapper::Nvml::builder()
                .lib_path(lib.as_os_str())
                .init()
                .unwrap();
            let parent = w.device_by_index(0).unwrap();
            assert_eq!(parent.mig_device_by_index(0).unwrap().uuid().unwrap(), mig_uuid);
            assert!(parent.mig_device_by_index(1).is_err());
        }
        other => panic!("unknown scenario {other}"),
    }
}

#[test]
fn a_read_only_kernel_refuses_mig_changes_with_no_permission() {
    let driver = SimDriver::new().mig_gpus("H100-SXM5-80GB", 2).build();
    let gi = driver.model.create_gpu_instance(1, 19, placement(3, 1)).unwrap();
    let host_dev = tempfile::tempdir().unwrap();
    run_child(&driver, "read-only", host_dev.path(), &gi.to_string());
    assert_eq!(
        driver.model.list_gpu_instances(1).unwrap().len(),
        1,
        "nothing changed"
    );
}

#[test]
fn a_container_sees_only_the_gpus_and_mig_devices_whose_device_nodes_it_was_given() {
    let driver = SimDriver::new().mig_gpus("H100-SXM5-80GB", 3).build();
    let model = &driver.model;
    let mine = model.create_gpu_instance(1, 9, placement(0, 4)).unwrap();
    let ci = model.create_compute_instance(1, mine).unwrap();
    let other = model.create_gpu_instance(1, 9, placement(4, 4)).unwrap();
    model.create_compute_instance(1, other).unwrap();
    model.create_gpu_instance(0, 0, placement(0, 8)).unwrap();
    let dev = tempfile::tempdir().unwrap();
    fs::write(dev.path().join("nvidiactl"), "").unwrap();
    fs::write(dev.path().join("nvidia1"), "").unwrap();
    fs::create_dir(dev.path().join("nvidia-caps")).unwrap();
    let (gi_minor, ci_minor) = model.mig_capability_minors(1, mine, ci.id).unwrap();
    for minor in [gi_minor, ci_minor] {
        fs::write(dev.path().join(format!("nvidia-caps/nvidia-cap{minor}")), "").unwrap();
    }
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dev.path(), fs::Permissions::from_mode(0o755)).unwrap();
    }
    let gpu_uuid = model.gpu(1).unwrap().uuid;
    run_child(
        &driver,
        "container",
        dev.path(),
        &format!("{gpu_uuid} {}", ci.uuid),
    );
}

// === `tessera-kubelet-plugin simulate driver-root` ===

fn plugin_cli() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"))
}

#[test]
fn the_driver_root_the_cli_makes_is_driven_by_the_nvml_backend() {
    let dir = tempfile::tempdir().unwrap();
    // The NVML library as built; the other artifacts (other crates') stand in as placeholders.
    let artifacts = dir.path().join("artifacts");
    fs::create_dir(&artifacts).unwrap();
    fs::copy(
        sim_driver::artifacts_dir().join("libnvidia_ml.so"),
        artifacts.join("libnvidia_ml.so"),
    )
    .unwrap();
    for other in [
        "libcuda.so",
        "libnvidia_ptxjitcompiler.so",
        "libnvidia_nvvm.so",
        "nvidia-smi",
        "nvidia-cuda-mps-control",
        "nvidia-cuda-mps-server",
    ] {
        fs::write(artifacts.join(other), "placeholder").unwrap();
    }
    let node_file = dir.path().join("node.yaml");
    fs::write(&node_file, "gpus: [{model: H200-SXM-141GB, count: 2}]\n").unwrap();
    let (root, kernel) = (dir.path().join("R"), dir.path().join("K"));
    let out = plugin_cli()
        .args(["simulate", "driver-root", "--node-name", "real-node"])
        .arg("--root")
        .arg(&root)
        .arg("--kernel")
        .arg(&kernel)
        .arg("--node-file")
        .arg(&node_file)
        .env("TESSERA_SIM_DRIVER_DIR", &artifacts)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let nvml = tessera_kubelet_plugin::gpu::nvml::NvmlBackend::new(&root).unwrap();
    let found = nvml.discover().unwrap();
    assert_eq!(found.gpus.len(), 2);
    assert_eq!(found.gpus[1].product_name, "NVIDIA H200");
    assert_eq!(found.driver_version.as_deref(), Some("580.159.03"));
    assert!(kernel.join("proc/driver/nvidia/version").is_file());
}

#[test]
fn a_driver_root_read_at_its_container_path_gets_a_spec_that_names_its_host_path() {
    // As in the chart: the host's root (here /srv/host-driver) is mounted where the plugin reads it (R).
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 2).build();
    let out = plugin_cli()
        .args(["discover", "--backend", "nvml", "--cdi"])
        .args(["--driver-root", "/srv/host-driver", "--container-driver-root"])
        .arg(&driver.root)
        .arg("--state-dir")
        .arg(driver.dir.path().join("state"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let spec: tessera_kubelet_plugin::node::cdi::Spec = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(spec.devices.len(), 2, "NVML was loaded from the container path");
    let mounts = &spec.container_edits.mounts;
    let host_of = |target: &str| {
        mounts
            .iter()
            .find(|m| m.container_path == target)
            .map(|m| m.host_path.as_str())
            .unwrap_or_else(|| panic!("{target} not mounted: {mounts:?}"))
    };
    assert_eq!(
        host_of("/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        "/srv/host-driver/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.03"
    );
    assert_eq!(
        host_of("/usr/bin/nvidia-smi"),
        "/srv/host-driver/usr/bin/nvidia-smi"
    );
    assert_eq!(host_of("/tessera-sim"), "/srv/host-driver/tessera-sim");
    let root = driver.root.display().to_string();
    assert!(
        mounts.iter().all(|m| !m.host_path.starts_with(&root)),
        "a spec names a path of the plugin's view: {mounts:?}"
    );
}

#[test]
fn nvml_loads_through_a_soname_link_whose_absolute_target_is_inside_the_driver_root() {
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 1).build();
    let link = driver.library();
    fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.159.03", &link).unwrap();
    assert!(!link.exists(), "the link dangles in this process's filesystem");
    let found = driver.nvml().discover().unwrap();
    assert_eq!(found.gpus.len(), 1);
}

#[test]
fn the_cli_names_the_artifacts_it_lacks_and_how_to_build_them() {
    let dir = tempfile::tempdir().unwrap();
    let node_file = dir.path().join("node.yaml");
    fs::write(&node_file, "gpus: [{model: B200, count: 1}]\n").unwrap();
    let out = plugin_cli()
        .args(["simulate", "driver-root", "--node-name", "n"])
        .arg("--root")
        .arg(dir.path().join("R"))
        .arg("--kernel")
        .arg(dir.path().join("K"))
        .arg("--node-file")
        .arg(&node_file)
        .env("TESSERA_SIM_DRIVER_DIR", dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("libnvidia_ml.so")
            && err.contains("nvidia-cuda-mps-server")
            && err.contains("cargo build --workspace"),
        "{err}"
    );
}
