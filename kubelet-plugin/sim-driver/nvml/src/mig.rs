//! MIG: GPU-instance and compute-instance profiles, placements, create/destroy/list, MIG device handles.
//!
//! The rules are the model's (`gpu-mig-mps.md` 3.8, enforced by `SimulatedBackend`); here only NVML's
//! shapes: profile indices versus IDs, struct versions, the two-call array pattern, and which handle
//! each call takes. A container sees the GPU and compute instances whose capability nodes it holds
//! (every one with `mig/monitor`), as [`DeviceView`](tessera_sim_model::backend::DeviceView)
//! decides.

use std::ffi::c_uint;

use nvml_wrapper_sys::bindings::{
    nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlComputeInstancePlacement_t,
    nvmlComputeInstanceProfileInfo_t, nvmlComputeInstanceProfileInfo_v2_t,
    nvmlComputeInstanceProfileInfo_v3_t, nvmlDevice_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlGpuInstanceProfileInfo_v3_t, nvmlReturn_t,
};
use tessera_api::MigPlacement;
use tessera_gpu_api::models::{ComputeInstanceProfile, GpuModel, MigProfile};
use tessera_gpu_api::{ComputeInstance, GpuBackend, GpuInstance};
use tessera_sim_model::backend::{MigDevice, VirtualizationMode, mig_minors_by_formula};

use crate::{
    Handle, INVALID_ARGUMENT, Lib, NOT_FOUND, NOT_SUPPORTED, Out, R, UNKNOWN, accepted_version, answer, ffi,
    fill_c, generation, lib, model_err, out, out_array_or_count, out_fixed_array, struct_version,
};

/// `NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX`, the last GI profile index `nvml.h` knows: past it the
/// library answers INVALID_ARGUMENT (the end of the enumeration), below it NOT_SUPPORTED for a profile
/// the GPU lacks.
const LAST_GI_PROFILE_INDEX: u32 = 0x11;
/// `NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL`, the last CI profile index.
const LAST_CI_PROFILE_INDEX: u32 = 0x8;
/// `NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED`, the only engine profile.
const ENGINE_PROFILE_SHARED: u32 = 0;

fn gi_profile_by_index(model: &'static GpuModel, index: u32) -> R<&'static MigProfile> {
    if index > LAST_GI_PROFILE_INDEX {
        return Err(INVALID_ARGUMENT);
    }
    model
        .mig_profiles
        .iter()
        .find(|p| p.index == index)
        .ok_or(NOT_SUPPORTED)
}

/// [`gi_profile_by_index`], or a profile a test added at that index, or the INVALID_ARGUMENT a test made
/// that index answer ([`crate::test_profiles`]).
fn gi_profile_or_test_profile(lib: &Lib, gpu: u32, index: u32) -> R<&'static MigProfile> {
    if crate::test_profiles::refused(lib.sim.kernel_dir(), gpu, index) {
        return Err(INVALID_ARGUMENT);
    }
    match gi_profile_by_index(lib.model(gpu)?, index) {
        Err(NOT_SUPPORTED) => {
            crate::test_profiles::by_index(lib.sim.kernel_dir(), gpu, index).ok_or(NOT_SUPPORTED)
        }
        other => other,
    }
}

fn profile_name(name: &str) -> String {
    format!("MIG {name}")
}

fn require_mig(lib: &Lib, gpu: u32) -> R {
    if lib.sim.mig_mode(gpu).map_err(model_err)?.current {
        Ok(())
    } else {
        Err(NOT_SUPPORTED)
    }
}

fn require_not_vgpu_guest(lib: &Lib, gpu: u32) -> R {
    if lib.info(gpu)?.virtualization_mode == VirtualizationMode::Vgpu {
        Err(NOT_SUPPORTED)
    } else {
        Ok(())
    }
}

impl Lib {
    /// The GPU instances of `gpu` this process sees (MIG mode must be on).
    fn gpu_instances(&self, gpu: u32) -> R<Vec<GpuInstance>> {
        require_mig(self, gpu)?;
        let gis = self.sim.list_gpu_instances(gpu).map_err(model_err)?;
        Ok(gis
            .into_iter()
            .filter(|gi| {
                mig_minors_by_formula(gpu, gi.id, 0)
                    .is_ok_and(|(gi_minor, _)| self.view.gpu_instance_visible(gi_minor))
            })
            .collect())
    }

    fn ci_visible(&self, gpu: u32, gi: u32, ci: u32) -> bool {
        mig_minors_by_formula(gpu, gi, ci).is_ok_and(|(g, c)| self.view.mig_visible(g, c))
    }

    /// The generation of GPU instance `gi` (with `ci`: of its compute instance `ci`) of `gpu`, as a handle
    /// carries it; INVALID_ARGUMENT when there is no such instance.
    fn generation_of(&self, gpu: u32, gi: u32, ci: Option<u32>) -> R<u32> {
        let serial = self.sim.instance_serial(gpu, gi, ci).map_err(model_err)?;
        serial.map(generation).ok_or(INVALID_ARGUMENT)
    }

    /// The handle of GPU instance `gi` of `gpu`, which dies with the instance.
    fn gi_handle(&self, gpu: u32, gi: u32) -> R<nvmlGpuInstance_t> {
        let generation = self.generation_of(gpu, gi, None)?;
        Ok(Handle::GpuInstance { gpu, gi, generation }.encode())
    }

    /// The handle of compute instance `ci` of GPU instance `gi` of `gpu`, which dies with the instance.
    fn ci_handle(&self, gpu: u32, gi: u32, ci: u32) -> R<nvmlComputeInstance_t> {
        let generation = self.generation_of(gpu, gi, Some(ci))?;
        Ok(Handle::ComputeInstance {
            gpu,
            gi,
            ci,
            generation,
        }
        .encode())
    }

    /// Resolves a GPU-instance handle; the handle of a destroyed instance is INVALID_ARGUMENT, even when
    /// an instance with the same id was created since (see [`Handle`]).
    fn gi(&self, handle: nvmlGpuInstance_t) -> R<(u32, GpuInstance)> {
        let Some(Handle::GpuInstance { gpu, gi, generation }) = Handle::decode(handle) else {
            return Err(INVALID_ARGUMENT);
        };
        self.resolve_gi(gpu, gi, generation)
    }

    fn resolve_gi(&self, gpu: u32, gi: u32, generation: u32) -> R<(u32, GpuInstance)> {
        self.gpu(Handle::Gpu(gpu).encode())?;
        let found = self
            .gpu_instances(gpu)?
            .into_iter()
            .find(|g| g.id == gi)
            .ok_or(INVALID_ARGUMENT)?;
        if self.generation_of(gpu, gi, None)? != generation {
            return Err(INVALID_ARGUMENT);
        }
        Ok((gpu, found))
    }

    /// Resolves a compute-instance handle, with the same rule as [`Lib::gi`].
    fn ci(&self, handle: nvmlComputeInstance_t) -> R<(u32, GpuInstance, ComputeInstance)> {
        let Some(Handle::ComputeInstance {
            gpu,
            gi,
            ci,
            generation,
        }) = Handle::decode(handle)
        else {
            return Err(INVALID_ARGUMENT);
        };
        let gi_generation = self.generation_of(gpu, gi, None)?;
        let (gpu, gpu_instance) = self.resolve_gi(gpu, gi, gi_generation)?;
        let compute_instance = gpu_instance
            .compute_instances
            .iter()
            .find(|c| c.id == ci && self.ci_visible(gpu, gi, ci))
            .cloned()
            .ok_or(INVALID_ARGUMENT)?;
        if self.generation_of(gpu, gi, Some(ci))? != generation {
            return Err(INVALID_ARGUMENT);
        }
        Ok((gpu, gpu_instance, compute_instance))
    }

    fn gi_profile(&self, gpu: u32, gi: &GpuInstance) -> R<&'static MigProfile> {
        self.model(gpu)?.profile_by_id(gi.profile_id).ok_or(UNKNOWN)
    }
}

// === GPU-instance profiles and placements ===

/// Which of versions 2 and 3 of a profile-info struct the caller passed (`V2`, `V3` their layouts): the
/// version, and whether it is 3. Any other is ARGUMENT_VERSION_MISMATCH.
///
/// # Safety
/// As [`accepted_version`].
unsafe fn v2_or_v3<V2, V3>(info: *const V2) -> R<(c_uint, bool)> {
    let v3 = struct_version::<V3>(3);
    // SAFETY: by the caller's contract.
    let version = unsafe { accepted_version(info, &[v3, struct_version::<V2>(2)]) }?;
    Ok((version, version == v3))
}

fn gi_profile_v1(p: &MigProfile) -> nvmlGpuInstanceProfileInfo_t {
    nvmlGpuInstanceProfileInfo_t {
        id: p.id,
        isP2pSupported: 0,
        sliceCount: p.compute_slices,
        instanceCount: p.instance_count,
        multiprocessorCount: p.multiprocessors,
        copyEngineCount: p.copy_engines,
        decoderCount: p.decoders,
        encoderCount: p.encoders,
        jpegCount: p.jpeg_engines,
        ofaCount: p.ofa_engines,
        memorySizeMB: p.memory_mib,
    }
}

/// The profile at NVML index `profile` (not its ID): INVALID_ARGUMENT past the last index, NOT_SUPPORTED
/// for one this GPU lacks. Answered with MIG mode off too: nvml.h (go-nvml `gen/nvml/nvml.h`:12824) refuses
/// it only "If device doesn't support MIG or profile isn't supported", and NVIDIA's DRA driver enumerates
/// profiles with it on GPUs whose MIG mode is off (`cmd/gpu-kubelet-plugin/nvlib.go`:547-556).
///
/// # Safety
/// `info` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfo(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let info = unsafe { Out::new(info) };
    answer(info, |lib| {
        let gpu = lib.gpu(device)?;
        let p = gi_profile_or_test_profile(lib, gpu, profile)?;
        Ok(gi_profile_v1(p))
    })
}

/// Versions 2 and 3 of the struct, told apart by its `version` field; any other is
/// ARGUMENT_VERSION_MISMATCH. NOT_SUPPORTED while the GPU's current MIG mode is off, unlike v1: nvml.h
/// (go-nvml `gen/nvml/nvml.h`:12855) says the V call answers it "If device doesn't have MIG mode enabled",
/// so a plugin that lists profiles through it sees none on a GPU whose MIG mode is off (review N6).
///
/// # Safety
/// `info` is null or valid for the struct version it names.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nvmlDevice_t,
    profile: c_uint,
    info: *mut nvmlGpuInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        // SAFETY: by the caller's contract.
        let (version, v3) = unsafe { v2_or_v3::<_, nvmlGpuInstanceProfileInfo_v3_t>(info) }?;
        let gpu = lib.gpu(device)?;
        require_mig(&lib, gpu)?;
        let p = gi_profile_or_test_profile(&lib, gpu, profile)?;
        let v1 = gi_profile_v1(p);
        let mut name = [0; 96];
        fill_c(&mut name, &profile_name(p.name));
        if v3 {
            let v = nvmlGpuInstanceProfileInfo_v3_t {
                version,
                id: v1.id,
                sliceCount: v1.sliceCount,
                instanceCount: v1.instanceCount,
                multiprocessorCount: v1.multiprocessorCount,
                copyEngineCount: v1.copyEngineCount,
                decoderCount: v1.decoderCount,
                encoderCount: v1.encoderCount,
                jpegCount: v1.jpegCount,
                ofaCount: v1.ofaCount,
                memorySizeMB: v1.memorySizeMB,
                name,
                // No P2P, no graphics on these data-center profiles.
                capabilities: 0,
            };
            // SAFETY: the caller passed a v3 struct (its version says so).
            unsafe { out(info.cast::<nvmlGpuInstanceProfileInfo_v3_t>(), v) }
        } else {
            let v = nvmlGpuInstanceProfileInfo_v2_t {
                version,
                id: v1.id,
                isP2pSupported: 0,
                sliceCount: v1.sliceCount,
                instanceCount: v1.instanceCount,
                multiprocessorCount: v1.multiprocessorCount,
                copyEngineCount: v1.copyEngineCount,
                decoderCount: v1.decoderCount,
                encoderCount: v1.encoderCount,
                jpegCount: v1.jpegCount,
                ofaCount: v1.ofaCount,
                memorySizeMB: v1.memorySizeMB,
                name,
            };
            // SAFETY: the caller passed a v2 struct.
            unsafe { out(info, v) }
        }
    })
}

/// Placements of GI profile ID `profile_id`, whether or not MIG is on. A null buffer asks for the count.
///
/// # Safety
/// `count` is valid; `placements` is null or valid for `*count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let gpu = lib.gpu(device)?;
        let p = lib
            .model(gpu)?
            .profile_by_id(profile_id)
            .or_else(|| crate::test_profiles::by_id(lib.sim.kernel_dir(), gpu, profile_id))
            .ok_or(INVALID_ARGUMENT)?;
        let all: Vec<nvmlGpuInstancePlacement_t> = p
            .placements()
            .map(|pl| nvmlGpuInstancePlacement_t {
                start: pl.start,
                size: pl.size,
            })
            .collect();
        // SAFETY: by the caller's contract.
        unsafe { out_array_or_count(placements, count, all) }
    })
}

// === GPU instances ===

/// # Safety
/// `placement` is valid; `gpu_instance` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nvmlGpuInstancePlacement_t,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let gpu = lib.gpu(device)?;
        require_not_vgpu_guest(&lib, gpu)?;
        if placement.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        // SAFETY: non-null, valid by the caller's contract.
        let pl = unsafe { *placement };
        let id = lib
            .sim
            .create_gpu_instance(
                gpu,
                profile_id,
                MigPlacement {
                    start: pl.start,
                    size: pl.size,
                },
            )
            .map_err(model_err)?;
        let handle = lib.gi_handle(gpu, id)?;
        // SAFETY: by the caller's contract.
        unsafe { out(gpu_instance, handle) }
    })
}

/// The first free placement of the profile, as the driver picks one.
///
/// # Safety
/// `gpu_instance` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstance(
    device: nvmlDevice_t,
    profile_id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let gpu = lib.gpu(device)?;
        require_not_vgpu_guest(&lib, gpu)?;
        let p = lib
            .model(gpu)?
            .profile_by_id(profile_id)
            .ok_or(INVALID_ARGUMENT)?;
        let mut last = crate::INSUFFICIENT_RESOURCES;
        for pl in p.placements() {
            match lib.sim.create_gpu_instance(gpu, profile_id, pl) {
                Ok(id) => {
                    let handle = lib.gi_handle(gpu, id)?;
                    // SAFETY: by the caller's contract.
                    return unsafe { out(gpu_instance, handle) };
                }
                Err(e) => last = model_err(e),
            }
        }
        Err(last)
    })
}

/// GPU instances of GI profile ID `profile_id`; the buffer must hold the profile's `instanceCount`.
///
/// # Safety
/// `count` is valid; `instances` is valid for the profile's instance count.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nvmlDevice_t,
    profile_id: c_uint,
    instances: *mut nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let gpu = lib.gpu(device)?;
        let p = lib
            .model(gpu)?
            .profile_by_id(profile_id)
            .ok_or(INVALID_ARGUMENT)?;
        let handles: Vec<nvmlGpuInstance_t> = lib
            .gpu_instances(gpu)?
            .into_iter()
            .filter(|gi| gi.profile_id == profile_id)
            .map(|gi| lib.gi_handle(gpu, gi.id))
            .collect::<R<_>>()?;
        debug_assert!(handles.len() <= p.instance_count as usize);
        // SAFETY: by the caller's contract the buffer holds `instanceCount` entries, which bounds
        // `handles` (the model enforces the count).
        unsafe { out_fixed_array(instances, count, handles) }
    })
}

/// NOT_SUPPORTED with MIG mode off (callers read that as "MIG disabled out of band"), NOT_FOUND for a
/// missing id.
///
/// # Safety
/// `gpu_instance` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nvmlDevice_t,
    id: c_uint,
    gpu_instance: *mut nvmlGpuInstance_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let gpu_instance = unsafe { Out::new(gpu_instance) };
    answer(gpu_instance, |lib| {
        let gpu = lib.gpu(device)?;
        let gi = lib
            .gpu_instances(gpu)?
            .into_iter()
            .find(|gi| gi.id == id)
            .ok_or(NOT_FOUND)?;
        lib.gi_handle(gpu, gi.id)
    })
}

/// `info.device` is the parent GPU's handle.
///
/// # Safety
/// `info` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpu_instance: nvmlGpuInstance_t,
    info: *mut nvmlGpuInstanceInfo_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let info = unsafe { Out::new(info) };
    answer(info, |lib| {
        let (gpu, gi) = lib.gi(gpu_instance)?;
        let v = nvmlGpuInstanceInfo_t {
            device: Handle::Gpu(gpu).encode(),
            id: gi.id,
            profileId: gi.profile_id,
            placement: nvmlGpuInstancePlacement_t {
                start: gi.placement.start,
                size: gi.placement.size,
            },
        };
        Ok(v)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceDestroy(gpu_instance: nvmlGpuInstance_t) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let (gpu, gi) = lib.gi(gpu_instance)?;
        lib.sim.destroy_gpu_instance(gpu, gi.id).map_err(model_err)
    })
}

// === Compute-instance profiles and compute instances ===

fn ci_profile(
    lib: &Lib,
    gpu: u32,
    gi: &GpuInstance,
    index: u32,
    engine: u32,
) -> R<(&'static MigProfile, ComputeInstanceProfile)> {
    if index > LAST_CI_PROFILE_INDEX || engine != ENGINE_PROFILE_SHARED {
        return Err(INVALID_ARGUMENT);
    }
    let p = lib.gi_profile(gpu, gi)?;
    let c = p
        .compute_instance_profiles()
        .into_iter()
        .find(|c| c.index == index)
        .ok_or(NOT_SUPPORTED)?;
    Ok((p, c))
}

fn ci_profile_v1(gi: &MigProfile, c: &ComputeInstanceProfile) -> nvmlComputeInstanceProfileInfo_t {
    nvmlComputeInstanceProfileInfo_t {
        id: c.id,
        sliceCount: c.compute_slices,
        instanceCount: c.instance_count,
        multiprocessorCount: c.multiprocessors,
        sharedCopyEngineCount: gi.copy_engines,
        sharedDecoderCount: gi.decoders,
        sharedEncoderCount: gi.encoders,
        sharedJpegCount: gi.jpeg_engines,
        sharedOfaCount: gi.ofa_engines,
    }
}

/// # Safety
/// `info` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfo(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let info = unsafe { Out::new(info) };
    answer(info, |lib| {
        let (gpu, gi) = lib.gi(gpu_instance)?;
        let (p, c) = ci_profile(lib, gpu, &gi, profile, eng_profile)?;
        Ok(ci_profile_v1(p, &c))
    })
}

/// Versions 2 and 3 of the struct.
///
/// # Safety
/// `info` is null or valid for the struct version it names.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gpu_instance: nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nvmlComputeInstanceProfileInfo_v2_t,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        // SAFETY: by the caller's contract.
        let (version, v3) = unsafe { v2_or_v3::<_, nvmlComputeInstanceProfileInfo_v3_t>(info) }?;
        let (gpu, gi) = lib.gi(gpu_instance)?;
        let (p, c) = ci_profile(&lib, gpu, &gi, profile, eng_profile)?;
        let v1 = ci_profile_v1(p, &c);
        let mut name = [0; 96];
        fill_c(&mut name, &profile_name(&c.name));
        let v2 = nvmlComputeInstanceProfileInfo_v2_t {
            version,
            id: v1.id,
            sliceCount: v1.sliceCount,
            instanceCount: v1.instanceCount,
            multiprocessorCount: v1.multiprocessorCount,
            sharedCopyEngineCount: v1.sharedCopyEngineCount,
            sharedDecoderCount: v1.sharedDecoderCount,
            sharedEncoderCount: v1.sharedEncoderCount,
            sharedJpegCount: v1.sharedJpegCount,
            sharedOfaCount: v1.sharedOfaCount,
            name,
        };
        if v3 {
            let v = nvmlComputeInstanceProfileInfo_v3_t {
                version,
                id: v2.id,
                sliceCount: v2.sliceCount,
                instanceCount: v2.instanceCount,
                multiprocessorCount: v2.multiprocessorCount,
                sharedCopyEngineCount: v2.sharedCopyEngineCount,
                sharedDecoderCount: v2.sharedDecoderCount,
                sharedEncoderCount: v2.sharedEncoderCount,
                sharedJpegCount: v2.sharedJpegCount,
                sharedOfaCount: v2.sharedOfaCount,
                name,
                capabilities: 0,
            };
            // SAFETY: the caller passed a v3 struct.
            unsafe { out(info.cast::<nvmlComputeInstanceProfileInfo_v3_t>(), v) }
        } else {
            // SAFETY: the caller passed a v2 struct.
            unsafe { out(info, v2) }
        }
    })
}

/// Only the compute instance spanning the whole GPU instance can be created (the model's limit); a
/// smaller listed profile answers NOT_SUPPORTED, an unknown ID INVALID_ARGUMENT.
///
/// # Safety
/// `compute_instance` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let compute_instance = unsafe { Out::new(compute_instance) };
    answer(compute_instance, |lib| {
        let (gpu, gi) = lib.gi(gpu_instance)?;
        let p = lib.gi_profile(gpu, &gi)?;
        if !p.compute_instance_profiles().iter().any(|c| c.id == profile_id) {
            return Err(INVALID_ARGUMENT);
        }
        if profile_id != p.full_compute_instance_profile_id() {
            return Err(NOT_SUPPORTED);
        }
        let ci = lib.sim.create_compute_instance(gpu, gi.id).map_err(model_err)?;
        lib.ci_handle(gpu, gi.id, ci.id)
    })
}

/// # Safety
/// `count` is valid; `instances` is valid for the CI profile's instance count.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpu_instance: nvmlGpuInstance_t,
    profile_id: c_uint,
    instances: *mut nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let (gpu, gi) = lib.gi(gpu_instance)?;
        let handles: Vec<nvmlComputeInstance_t> = gi
            .compute_instances
            .iter()
            .filter(|c| c.profile_id == profile_id && lib.ci_visible(gpu, gi.id, c.id))
            .map(|c| lib.ci_handle(gpu, gi.id, c.id))
            .collect::<R<_>>()?;
        // SAFETY: the buffer holds the profile's instance count, which bounds the CIs of that profile.
        unsafe { out_fixed_array(instances, count, handles) }
    })
}

/// # Safety
/// `compute_instance` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gpu_instance: nvmlGpuInstance_t,
    id: c_uint,
    compute_instance: *mut nvmlComputeInstance_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let compute_instance = unsafe { Out::new(compute_instance) };
    answer(compute_instance, |lib| {
        let (gpu, gi) = lib.gi(gpu_instance)?;
        if !gi
            .compute_instances
            .iter()
            .any(|c| c.id == id && lib.ci_visible(gpu, gi.id, id))
        {
            return Err(NOT_FOUND);
        }
        lib.ci_handle(gpu, gi.id, id)
    })
}

/// `info.device` is the PARENT GPU's handle, as `nvml.h` documents it ("Parent device"); the MIG device
/// handle comes from `nvmlDeviceGetMigDeviceHandleByIndex` or `nvmlDeviceGetHandleByUUID`.
///
/// # Safety
/// `info` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    compute_instance: nvmlComputeInstance_t,
    info: *mut nvmlComputeInstanceInfo_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let info = unsafe { Out::new(info) };
    answer(info, |lib| {
        let (gpu, gi, ci) = lib.ci(compute_instance)?;
        let slices = lib.gi_profile(gpu, &gi)?.compute_slices;
        let v = nvmlComputeInstanceInfo_t {
            device: Handle::Gpu(gpu).encode(),
            gpuInstance: lib.gi_handle(gpu, gi.id)?,
            id: ci.id,
            profileId: ci.profile_id,
            placement: nvmlComputeInstancePlacement_t {
                start: 0,
                size: slices,
            },
        };
        Ok(v)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlComputeInstanceDestroy(compute_instance: nvmlComputeInstance_t) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let (gpu, gi, ci) = lib.ci(compute_instance)?;
        lib.sim
            .destroy_compute_instance(gpu, gi.id, ci.id)
            .map_err(model_err)
    })
}

// === MIG device handles ===

/// # Safety
/// `count` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let count = unsafe { Out::new(count) };
    answer(count, |lib| {
        let gpu = lib.gpu(device)?;
        let n = lib.model(gpu)?.compute_slices;
        Ok(n)
    })
}

/// The `index`-th MIG device this process sees, by GI then CI id: INVALID_ARGUMENT past the maximum,
/// NOT_FOUND where no device is.
///
/// # Safety
/// `mig_device` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig_device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let mig_device = unsafe { Out::new(mig_device) };
    answer(mig_device, |lib| {
        let gpu = lib.gpu(device)?;
        if index >= lib.model(gpu)?.compute_slices {
            return Err(INVALID_ARGUMENT);
        }
        require_mig(lib, gpu).map_err(|_| NOT_FOUND)?;
        let m = lib
            .sim
            .mig_devices(gpu, &lib.view)
            .map_err(model_err)?
            .into_iter()
            .nth(index as usize)
            .ok_or(NOT_FOUND)?;
        Ok(Handle::of_mig(gpu, &m).encode())
    })
}

/// # Safety
/// `is_mig` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let is_mig = unsafe { Out::new(is_mig) };
    answer(is_mig, |lib| {
        let d = lib.dev(device)?;
        Ok(c_uint::from(d.mig.is_some()))
    })
}

/// One of a MIG device handle's instance ids (`pick`); a whole GPU's handle answers NOT_SUPPORTED.
fn mig_device_id(device: nvmlDevice_t, id: Out<c_uint>, pick: fn(&MigDevice) -> c_uint) -> nvmlReturn_t {
    answer(id, |lib| Ok(pick(&lib.dev(device)?.mig.ok_or(NOT_SUPPORTED)?)))
}

/// # Safety
/// `id` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(device: nvmlDevice_t, id: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    mig_device_id(device, unsafe { Out::new(id) }, |m| m.gpu_instance)
}

/// # Safety
/// `id` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nvmlDevice_t,
    id: *mut c_uint,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    mig_device_id(device, unsafe { Out::new(id) }, |m| m.compute_instance)
}

/// # Safety
/// `device` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: nvmlDevice_t,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let device = unsafe { Out::new(device) };
    answer(device, |lib| {
        let d = lib.dev(mig_device)?;
        if d.mig.is_none() {
            return Err(INVALID_ARGUMENT);
        }
        Ok(Handle::Gpu(d.gpu).encode())
    })
}
