//! The NVML calls nvml-wrapper 0.13 does not wrap (or wraps wrongly), made through its raw function table.
//!
//! This is the crate's only `unsafe` code besides the event set's (`nvml_events.rs`). Every function here follows one pattern: resolve the symbol with
//! `nvml_sym` (a missing symbol is an error, never a crash), pass zero-initialised plain-old-data structs and
//! a device handle borrowed from a live `Device`, check the return code, copy the results out. GPU-instance
//! and compute-instance handles never leave a function: they are re-resolved by id on every call, because
//! a destroy or reset invalidates them (`dra-api.md` 10.3).
//!
//! Without an NVIDIA GPU this runs against the simulated driver root's `libnvidia-ml.so.1` (the tests of
//! `tests/nvml_lib.rs` and `tests/nvml_defects.rs`); it is kept to straight-line calls so review is the
//! check of what that library cannot show. The callers in `nvml.rs` turn [`RawError`] into `GpuError`.
#![allow(
    unsafe_code,
    reason = "raw NVML MIG calls that nvml-wrapper does not wrap; see the module comment"
)]

use std::{mem, os::raw::c_uint, ptr};

use nvml_wrapper::{Device, Nvml, error::nvml_sym};
use nvml_wrapper_sys::bindings::{
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, nvmlComputeInstance_t, nvmlComputeInstanceInfo_t,
    nvmlComputeInstanceProfileInfo_t, nvmlDevice_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlGpuInstanceProfileInfo_v3_t, nvmlReturn_t,
};
use tessera_api::MigPlacement;

const NVML_SUCCESS: nvmlReturn_t = 0;
const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
/// Wrong `version` field in a `…V` struct: the driver is older than the struct version.
pub(super) const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: u32 = 25;
/// Our own code for "the driver's library lacks this symbol"; NVML's FUNCTION_NOT_FOUND.
pub(super) const NVML_ERROR_FUNCTION_NOT_FOUND: u32 = 13;

/// A GPU's device handle kept beyond the `Device` it came from (the plugin's handle cache, see
/// `nvml.rs`): valid until `nvmlShutdown`, only ever given back to NVML.
#[derive(Clone, Copy)]
pub(super) struct KeptHandle(nvmlDevice_t);

// SAFETY: an NVML device handle names a device of the process-wide NVML session, which any thread may use
// (NVML is thread-safe); it is never dereferenced here.
unsafe impl Send for KeptHandle {}

impl KeptHandle {
    /// The handle of `device`, to keep.
    pub(super) fn of(device: &Device<'_>) -> Self {
        // SAFETY: the handle is only stored, to be given back to the NVML it came from.
        Self(unsafe { device.handle() })
    }

    /// A `Device` over the kept handle. `nvml` must be the session the handle came from; the backend that
    /// keeps it owns that session and drops its handles with it.
    pub(super) fn device<'n>(self, nvml: &'n Nvml) -> Device<'n> {
        // SAFETY: a handle of `nvml`'s session (the caller's contract above), still initialised while
        // `nvml` is borrowed.
        unsafe { Device::new(self.0, nvml) }
    }
}

/// A failed raw call: which function and what it returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RawError {
    pub call: &'static str,
    pub code: u32,
}

type RawResult<T> = Result<T, RawError>;

fn check(call: &'static str, ret: nvmlReturn_t) -> RawResult<()> {
    if ret == NVML_SUCCESS {
        Ok(())
    } else {
        Err(RawError { call, code: ret })
    }
}

macro_rules! sym {
    ($nvml:expr, $name:ident) => {
        nvml_sym($nvml.lib().$name.as_ref()).map_err(|_| RawError {
            call: stringify!($name),
            code: NVML_ERROR_FUNCTION_NOT_FOUND,
        })?
    };
}

/// `NVML_STRUCT_VERSION(name, ver)`: the macro is not in the generated bindings.
const fn struct_version<T>(version: u32) -> c_uint {
    (mem::size_of::<T>() as u32) | (version << 24)
}

/// GPU-instance profile information, whichever struct version the driver answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct GiProfile {
    pub id: u32,
    pub slice_count: u32,
    pub instance_count: u32,
    pub multiprocessors: u32,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpeg_engines: u32,
    pub ofa_engines: u32,
    pub memory_mib: u64,
    /// `3g.40gb` (the driver's `MIG 3g.40gb` without the prefix), from the V call; `None` with MIG off or
    /// from a driver without the V call.
    pub name: Option<String>,
}

fn c_name(raw: &[std::os::raw::c_char]) -> Option<String> {
    let bytes: Vec<u8> = raw.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    let name = String::from_utf8(bytes).ok()?;
    let name = name.trim();
    let name = name.strip_prefix("MIG ").unwrap_or(name);
    (!name.is_empty()).then(|| name.to_string())
}

/// GPU-instance profile index `index` as NVIDIA's DRA driver reads it (`cmd/gpu-kubelet-plugin/nvlib.go`
/// 547-556): the v1 `nvmlDeviceGetGpuInstanceProfileInfo`, which answers whatever the MIG mode — nvml.h
/// (go-nvml `gen/nvml/nvml.h`:12824) refuses it only "If device doesn't support MIG". The versioned call
/// answers NOT_SUPPORTED "If device doesn't have MIG mode enabled" (nvml.h:12855), and MIG off is the boot
/// default and the state tessera restores after the last GPU instance goes: reading profiles through it hid
/// every profile of such a GPU and with them dynamic MIG (review N6). It is asked only for what v1 lacks, the
/// driver's profile name, and only with `mig_enabled` (the GPU's current MIG mode).
pub(super) fn gpu_instance_profile(
    nvml: &Nvml,
    device: &Device<'_>,
    index: u32,
    mig_enabled: bool,
) -> RawResult<GiProfile> {
    let get_v1 = sym!(nvml, nvmlDeviceGetGpuInstanceProfileInfo);
    // SAFETY: the handle belongs to a live Device; the struct is plain data the driver fills in.
    let v1 = unsafe {
        let mut v1: nvmlGpuInstanceProfileInfo_t = mem::zeroed();
        check(
            "nvmlDeviceGetGpuInstanceProfileInfo",
            get_v1(device.handle(), index, &mut v1),
        )?;
        v1
    };
    let name = if mig_enabled {
        gpu_instance_profile_name(nvml, device, index, v1.id)
    } else {
        None
    };
    Ok(GiProfile {
        id: v1.id,
        slice_count: v1.sliceCount,
        instance_count: v1.instanceCount,
        multiprocessors: v1.multiprocessorCount,
        copy_engines: v1.copyEngineCount,
        decoders: v1.decoderCount,
        encoders: v1.encoderCount,
        jpeg_engines: v1.jpegCount,
        ofa_engines: v1.ofaCount,
        memory_mib: v1.memorySizeMB,
        name,
    })
}

/// The driver's name of GI profile index `index` (ID `id`, as v1 answered) from
/// `nvmlDeviceGetGpuInstanceProfileInfoV`, v3 then v2 for drivers older than the v3 struct. `None` where
/// the driver lacks the call or refuses it (NOT_SUPPORTED with MIG off, nvml.h:12855): the caller then
/// derives the name, as for v1-only drivers.
fn gpu_instance_profile_name(nvml: &Nvml, device: &Device<'_>, index: u32, id: u32) -> Option<String> {
    let get_v = nvml_sym(nvml.lib().nvmlDeviceGetGpuInstanceProfileInfoV.as_ref()).ok()?;
    // SAFETY: the handle belongs to a live Device; the structs are plain data the driver fills in; the v3
    // struct is passed through the binding's v2 pointer type, as nvml.h does, with the version field
    // telling the driver which layout it got.
    unsafe {
        let handle = device.handle();
        let mut v3: nvmlGpuInstanceProfileInfo_v3_t = mem::zeroed();
        v3.version = struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3);
        match get_v(handle, index, ptr::from_mut(&mut v3).cast()) {
            NVML_SUCCESS if v3.id == id => return c_name(&v3.name),
            NVML_ERROR_ARGUMENT_VERSION_MISMATCH => {}
            _ => return None,
        }
        let mut v2: nvmlGpuInstanceProfileInfo_v2_t = mem::zeroed();
        v2.version = struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2);
        match get_v(handle, index, &mut v2) {
            NVML_SUCCESS if v2.id == id => c_name(&v2.name),
            _ => None,
        }
    }
}

/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2` for GI profile ID `profile_id` (the wrapper's version
/// never sets the vector's length and so always returns nothing).
pub(super) fn possible_placements(
    nvml: &Nvml,
    device: &Device<'_>,
    profile_id: u32,
) -> RawResult<Vec<MigPlacement>> {
    let call = "nvmlDeviceGetGpuInstancePossiblePlacements_v2";
    let get = sym!(nvml, nvmlDeviceGetGpuInstancePossiblePlacements_v2);
    // SAFETY: first call with a null buffer asks for the count; the second gets a buffer of exactly that
    // many initialised entries, and only the `count` entries the driver reports are read back.
    unsafe {
        let handle = device.handle();
        let mut count: c_uint = 0;
        let ret = get(handle, profile_id, ptr::null_mut(), &mut count);
        if ret != NVML_SUCCESS && ret != NVML_ERROR_INSUFFICIENT_SIZE {
            return Err(RawError { call, code: ret });
        }
        let mut buf = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
        check(call, get(handle, profile_id, buf.as_mut_ptr(), &mut count))?;
        buf.truncate(count as usize);
        Ok(buf
            .into_iter()
            .map(|p| MigPlacement {
                start: p.start,
                size: p.size,
            })
            .collect())
    }
}

/// `nvmlDeviceCreateGpuInstanceWithPlacement` then `nvmlGpuInstanceGetInfo`; returns the new GI id.
pub(super) fn create_gpu_instance(
    nvml: &Nvml,
    device: &Device<'_>,
    profile_id: u32,
    placement: MigPlacement,
) -> RawResult<u32> {
    let create = sym!(nvml, nvmlDeviceCreateGpuInstanceWithPlacement);
    let get_info = sym!(nvml, nvmlGpuInstanceGetInfo);
    // SAFETY: the placement is read by the driver only during the call; the GI handle is used at once.
    unsafe {
        let placement = nvmlGpuInstancePlacement_t {
            start: placement.start,
            size: placement.size,
        };
        let mut gi: nvmlGpuInstance_t = ptr::null_mut();
        check(
            "nvmlDeviceCreateGpuInstanceWithPlacement",
            create(device.handle(), profile_id, &placement, &mut gi),
        )?;
        let mut info: nvmlGpuInstanceInfo_t = mem::zeroed();
        check("nvmlGpuInstanceGetInfo", get_info(gi, &mut info))?;
        Ok(info.id)
    }
}

/// Resolves GI `id` to a handle valid until the next destroy or reset.
///
/// # Safety
/// The returned handle must not outlive the calling operation.
unsafe fn gpu_instance_handle(nvml: &Nvml, device: &Device<'_>, id: u32) -> RawResult<nvmlGpuInstance_t> {
    let get = sym!(nvml, nvmlDeviceGetGpuInstanceById);
    let mut gi: nvmlGpuInstance_t = ptr::null_mut();
    // SAFETY: the device handle is live; `gi` is an out-parameter.
    check("nvmlDeviceGetGpuInstanceById", unsafe {
        get(device.handle(), id, &mut gi)
    })?;
    Ok(gi)
}

/// A compute instance as read back from the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct RawComputeInstance {
    pub id: u32,
    pub profile_id: u32,
    pub uuid: String,
}

/// Reads a CI's id and profile, and the UUID of the MIG device it backs.
///
/// `nvmlComputeInstanceInfo_t.device` is documented in `nvml.h` as the *parent* device, so its UUID is the
/// GPU's `GPU-…` one; the MIG device's handle is found by [`mig_device_uuid`] instead.
///
/// # Safety
/// `ci` must be a handle just obtained from the driver, for GI `gpu_instance` of `device`.
unsafe fn compute_instance_info(
    nvml: &Nvml,
    device: &Device<'_>,
    gpu_instance: u32,
    ci: nvmlComputeInstance_t,
) -> RawResult<RawComputeInstance> {
    let get_info = sym!(nvml, nvmlComputeInstanceGetInfo_v2);
    // SAFETY: `info` is plain data the driver fills in.
    let info = unsafe {
        let mut info: nvmlComputeInstanceInfo_t = mem::zeroed();
        check("nvmlComputeInstanceGetInfo_v2", get_info(ci, &mut info))?;
        info
    };
    Ok(RawComputeInstance {
        id: info.id,
        profile_id: info.profileId,
        uuid: mig_device_uuid(nvml, device, gpu_instance, info.id)?,
    })
}

/// `NVML_ERROR_NOT_FOUND`.
const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;

/// The UUID of the MIG device of GI `gpu_instance` / CI `compute_instance` on `device`: the MIG handle
/// whose `nvmlDeviceGetGpuInstanceId` / `nvmlDeviceGetComputeInstanceId` match, among
/// `nvmlDeviceGetMigDeviceHandleByIndex(0..nvmlDeviceGetMaxMigDeviceCount)` (NVIDIA's `FindMigDevBySpec`
/// walks the same way). A UUID that is not `MIG-…` is an error ([`NVML_ERROR_NOT_A_MIG_UUID`]), never
/// passed on: CUDA
/// given a parent's `GPU-…` UUID would run the claim on the whole GPU.
pub(super) fn mig_device_uuid(
    nvml: &Nvml,
    device: &Device<'_>,
    gpu_instance: u32,
    compute_instance: u32,
) -> RawResult<String> {
    let max_count = sym!(nvml, nvmlDeviceGetMaxMigDeviceCount);
    let by_index = sym!(nvml, nvmlDeviceGetMigDeviceHandleByIndex);
    let gi_id = sym!(nvml, nvmlDeviceGetGpuInstanceId);
    let ci_id = sym!(nvml, nvmlDeviceGetComputeInstanceId);
    // SAFETY: the parent handle belongs to a live `Device`; MIG handles are used within this call only;
    // wrapping one in a `Device` borrowed from `nvml` is how nvml-wrapper itself hands out MIG handles.
    unsafe {
        let mut count: c_uint = 0;
        check(
            "nvmlDeviceGetMaxMigDeviceCount",
            max_count(device.handle(), &mut count),
        )?;
        for index in 0..count {
            let mut mig: nvml_wrapper_sys::bindings::nvmlDevice_t = ptr::null_mut();
            // NOT_FOUND: no MIG device at this index (the slots are sparse).
            match by_index(device.handle(), index, &mut mig) {
                NVML_SUCCESS => {}
                NVML_ERROR_NOT_FOUND | 2 => continue,
                code => {
                    return Err(RawError {
                        call: "nvmlDeviceGetMigDeviceHandleByIndex",
                        code,
                    });
                }
            }
            let (mut gi, mut ci): (c_uint, c_uint) = (0, 0);
            if gi_id(mig, &mut gi) != NVML_SUCCESS || gi != gpu_instance {
                continue;
            }
            if ci_id(mig, &mut ci) != NVML_SUCCESS || ci != compute_instance {
                continue;
            }
            let uuid = Device::new(mig, nvml).uuid().map_err(|e| RawError {
                call: "nvmlDeviceGetUUID",
                code: e.into(),
            })?;
            return check_mig_uuid(&uuid).map(|()| uuid);
        }
    }
    Err(RawError {
        call: "nvmlDeviceGetMigDeviceHandleByIndex",
        code: NVML_ERROR_NOT_FOUND,
    })
}

/// Our own code for "the MIG handle's UUID is not a `MIG-…` UUID" (outside NVML's range, like
/// [`NVML_ERROR_FUNCTION_NOT_FOUND`]'s use here); the UUID itself is logged where it is seen.
pub(super) const NVML_ERROR_NOT_A_MIG_UUID: u32 = 0x4D49_4700;

fn check_mig_uuid(uuid: &str) -> RawResult<()> {
    if uuid.starts_with("MIG-") {
        Ok(())
    } else {
        tracing::error!(
            uuid,
            "NVML gave a MIG device handle a UUID that is not MIG-…; refusing it"
        );
        Err(RawError {
            call: "nvmlDeviceGetUUID",
            code: NVML_ERROR_NOT_A_MIG_UUID,
        })
    }
}

/// `nvmlDeviceGetArchitecture` as the raw number, so an architecture newer than nvml-wrapper's enum still
/// reads as itself (Hopper 9, Blackwell 10, later ones higher) instead of "unknown".
pub(super) fn architecture(nvml: &Nvml, device: &Device<'_>) -> RawResult<u32> {
    let get = sym!(nvml, nvmlDeviceGetArchitecture);
    let mut arch: c_uint = 0;
    // SAFETY: the handle is borrowed from a live `Device`; `arch` is a plain out-parameter.
    check("nvmlDeviceGetArchitecture", unsafe {
        get(device.handle(), &mut arch)
    })?;
    Ok(arch)
}

/// A GPU's fabric (NVLink through NVSwitch) as `nvmlDeviceGetGpuFabricInfo[V]` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct FabricInfo {
    /// `nvmlGpuFabricState_t`: 0 not supported, 1 not started, 2 in progress, 3 completed.
    pub state: u8,
    /// The NVML return code of the GPU's fabric registration (0 once it succeeded).
    pub status: u32,
    /// `NVML_GPU_FABRIC_HEALTH_SUMMARY_*` of the v3 struct (nvml.h 3890-3893, 3950); `None` where only v2
    /// or v1 answered.
    pub health_summary: Option<u8>,
    /// `healthMask` (`NVML_GPU_FABRIC_HEALTH_MASK_*`, nvml.h 3824-3885) of the v2 and v3 structs.
    pub health_mask: Option<u32>,
}

/// `nvmlDeviceGetGpuFabricInfoV` (v3, then v2 on a version mismatch), else `nvmlDeviceGetGpuFabricInfo`;
/// `Ok(None)` where the GPU has no fabric (`NOT_SUPPORTED`, the symbol missing, or state NOT_SUPPORTED).
/// nvml-wrapper 0.13 wraps neither call.
pub(super) fn gpu_fabric_info(nvml: &Nvml, device: &Device<'_>) -> RawResult<Option<FabricInfo>> {
    use nvml_wrapper_sys::bindings::{nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t, nvmlGpuFabricInfoV_t};
    const NOT_SUPPORTED: nvmlReturn_t = 3;
    let answered = |state: u8, status: u32, health_summary: Option<u8>, health_mask: Option<u32>| {
        Ok((state != 0).then_some(FabricInfo {
            state,
            status,
            health_summary,
            health_mask,
        }))
    };
    // SAFETY: the handle belongs to a live `Device`; the structs are plain data with the version field
    // telling the driver which layout it got (the v2 struct is a prefix-compatible shorter layout).
    unsafe {
        let handle = device.handle();
        if let Ok(get_v) = nvml_sym(nvml.lib().nvmlDeviceGetGpuFabricInfoV.as_ref()) {
            let mut v3: nvmlGpuFabricInfoV_t = mem::zeroed();
            v3.version = struct_version::<nvmlGpuFabricInfoV_t>(3);
            match get_v(handle, &mut v3) {
                NVML_SUCCESS => {
                    return answered(v3.state, v3.status, Some(v3.healthSummary), Some(v3.healthMask));
                }
                NOT_SUPPORTED => return Ok(None),
                NVML_ERROR_ARGUMENT_VERSION_MISMATCH => {}
                code => {
                    return Err(RawError {
                        call: "nvmlDeviceGetGpuFabricInfoV",
                        code,
                    });
                }
            }
            let mut v2: nvmlGpuFabricInfo_v2_t = mem::zeroed();
            v2.version = struct_version::<nvmlGpuFabricInfo_v2_t>(2);
            match get_v(handle, ptr::from_mut(&mut v2).cast()) {
                NVML_SUCCESS => return answered(v2.state, v2.status, None, Some(v2.healthMask)),
                NOT_SUPPORTED => return Ok(None),
                NVML_ERROR_ARGUMENT_VERSION_MISMATCH => {}
                code => {
                    return Err(RawError {
                        call: "nvmlDeviceGetGpuFabricInfoV",
                        code,
                    });
                }
            }
        }
        let Ok(get_v1) = nvml_sym(nvml.lib().nvmlDeviceGetGpuFabricInfo.as_ref()) else {
            return Ok(None);
        };
        let mut v1: nvmlGpuFabricInfo_t = mem::zeroed();
        match get_v1(handle, &mut v1) {
            NVML_SUCCESS => answered(v1.state, v1.status, None, None),
            NOT_SUPPORTED => Ok(None),
            code => Err(RawError {
                call: "nvmlDeviceGetGpuFabricInfo",
                code,
            }),
        }
    }
}

/// `NVML_GPU_INSTANCE_PROFILE_COUNT` of the nvml.h tessera follows (go-nvml `gen/nvml/nvml.h`:12529),
/// NVIDIA's DRA driver's bound. nvml-wrapper-sys's binding says 17, one short of index 0x11.
pub(super) const NVML_H_GI_PROFILE_COUNT: u32 = 0x12;

/// The most GI profile indices asked about: past [`NVML_H_GI_PROFILE_COUNT`] the enumeration ends at the
/// first `INVALID_ARGUMENT`, and this bound only guards against a driver that never answers it.
pub(super) const GI_PROFILE_INDEX_LIMIT: u32 = 64;

/// Asks `get` for GI profile indices 0, 1, … up to [`GI_PROFILE_INDEX_LIMIT`], skipping `NOT_SUPPORTED` (3,
/// an index the GPU lacks). Below [`NVML_H_GI_PROFILE_COUNT`] an `INVALID_ARGUMENT` (2) is skipped too, as
/// NVIDIA's DRA driver does (`cmd/gpu-kubelet-plugin/nvlib.go`:552-554): a driver answering it for an
/// unused index in the middle must not hide the later profiles (review N12). From that count on, the first
/// `INVALID_ARGUMENT` ends the enumeration — nvml.h:12811, "until the API returns
/// NVML_ERROR_INVALID_ARGUMENT" — so profiles a newer driver knows past the header's count (and past an
/// older binding's 17, like `3g+gfx` at 0x11 on R575+) are still found. Other errors are returned with
/// their index, and the enumeration goes on.
pub(super) fn enumerate_gi_profiles<T>(mut get: impl FnMut(u32) -> RawResult<T>) -> Vec<(u32, RawResult<T>)> {
    let mut out = Vec::new();
    for index in 0..GI_PROFILE_INDEX_LIMIT {
        match get(index) {
            Err(RawError { code: 2, .. }) if index >= NVML_H_GI_PROFILE_COUNT => break,
            Err(RawError { code: 2 | 3, .. }) => continue,
            other => out.push((index, other)),
        }
    }
    out
}

/// Compute-instance profile indices tried when creating the CI that spans a GI, from the largest slice
/// count down: 7, 8, 6, 4, 3, 2, 1 slices. `1_SLICE_REV1` (7) is skipped, as NVIDIA's driver does.
const CI_PROFILE_INDICES_LARGEST_FIRST: [u32; 7] = [4, 5, 6, 3, 2, 1, 0];

/// Compute-instance profile indices listed when reading a GI's CIs: every index of `nvml.h`
/// (`1_SLICE_REV1` = 7 and `7_SLICE_NVL` = 8 included), so CIs made by other tools with those profiles are
/// seen, and can be destroyed, instead of blocking their GI's destroy as invisible "in use".
pub(super) const CI_PROFILE_INDICES_LISTED: [u32; 9] = [4, 5, 6, 3, 2, 1, 0, 7, 8];

/// `nvmlGpuInstanceCreateComputeInstance` with the CI profile spanning the whole GI: the largest CI
/// profile the GI accepts is the one with C == G.
pub(super) fn create_full_compute_instance(
    nvml: &Nvml,
    device: &Device<'_>,
    gpu_instance: u32,
) -> RawResult<RawComputeInstance> {
    let profile_info = sym!(nvml, nvmlGpuInstanceGetComputeInstanceProfileInfo);
    let create = sym!(nvml, nvmlGpuInstanceCreateComputeInstance);
    // SAFETY: handles are resolved here and used only within this call; structs are plain data.
    unsafe {
        let gi = gpu_instance_handle(nvml, device, gpu_instance)?;
        let mut last = RawError {
            call: "nvmlGpuInstanceGetComputeInstanceProfileInfo",
            code: 3,
        };
        for index in CI_PROFILE_INDICES_LARGEST_FIRST {
            let mut prof: nvmlComputeInstanceProfileInfo_t = mem::zeroed();
            let ret = profile_info(gi, index, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &mut prof);
            if ret != NVML_SUCCESS {
                last.code = ret;
                continue;
            }
            let mut ci: nvmlComputeInstance_t = ptr::null_mut();
            check(
                "nvmlGpuInstanceCreateComputeInstance",
                create(gi, prof.id, &mut ci),
            )?;
            return compute_instance_info(nvml, device, gpu_instance, ci);
        }
        Err(last)
    }
}

/// `nvmlComputeInstanceDestroy` of CI `compute_instance` in GI `gpu_instance`.
pub(super) fn destroy_compute_instance(
    nvml: &Nvml,
    device: &Device<'_>,
    gpu_instance: u32,
    compute_instance: u32,
) -> RawResult<()> {
    let get_ci = sym!(nvml, nvmlGpuInstanceGetComputeInstanceById);
    let destroy = sym!(nvml, nvmlComputeInstanceDestroy);
    // SAFETY: handles are resolved here and not used after the destroy.
    unsafe {
        let gi = gpu_instance_handle(nvml, device, gpu_instance)?;
        let mut ci: nvmlComputeInstance_t = ptr::null_mut();
        check(
            "nvmlGpuInstanceGetComputeInstanceById",
            get_ci(gi, compute_instance, &mut ci),
        )?;
        check("nvmlComputeInstanceDestroy", destroy(ci))
    }
}

/// `nvmlGpuInstanceDestroy` of GI `gpu_instance`.
pub(super) fn destroy_gpu_instance(nvml: &Nvml, device: &Device<'_>, gpu_instance: u32) -> RawResult<()> {
    let destroy = sym!(nvml, nvmlGpuInstanceDestroy);
    // SAFETY: the handle is resolved here and not used after the destroy.
    unsafe {
        let gi = gpu_instance_handle(nvml, device, gpu_instance)?;
        check("nvmlGpuInstanceDestroy", destroy(gi))
    }
}

/// A live GPU instance as read back from the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct RawGpuInstance {
    pub id: u32,
    pub profile_id: u32,
    pub placement: MigPlacement,
    pub compute_instances: Vec<RawComputeInstance>,
}

/// Every GI of the given GI profiles (`(profile id, instance count)`), with all its CIs.
/// `nvmlDeviceGetGpuInstances` per profile also finds GIs without CIs, which walking MIG device handles
/// would miss (a crash between creating a GI and its CI leaves one).
pub(super) fn gpu_instances(
    nvml: &Nvml,
    device: &Device<'_>,
    gi_profiles: &[(u32, u32)],
) -> RawResult<Vec<RawGpuInstance>> {
    let get_gis = sym!(nvml, nvmlDeviceGetGpuInstances);
    let gi_info = sym!(nvml, nvmlGpuInstanceGetInfo);
    let ci_profile_info = sym!(nvml, nvmlGpuInstanceGetComputeInstanceProfileInfo);
    let get_cis = sym!(nvml, nvmlGpuInstanceGetComputeInstances);
    let mut out = Vec::new();
    // SAFETY: buffers are sized by the profile's instance count and only `count` entries are read; the
    // handles are used within this call only.
    unsafe {
        for &(profile_id, instance_count) in gi_profiles {
            let mut gis: Vec<nvmlGpuInstance_t> = vec![ptr::null_mut(); instance_count.max(1) as usize];
            let mut count: c_uint = gis.len() as c_uint;
            check(
                "nvmlDeviceGetGpuInstances",
                get_gis(device.handle(), profile_id, gis.as_mut_ptr(), &mut count),
            )?;
            for &gi in &gis[..(count as usize).min(gis.len())] {
                let mut info: nvmlGpuInstanceInfo_t = mem::zeroed();
                check("nvmlGpuInstanceGetInfo", gi_info(gi, &mut info))?;
                let mut cis_out = Vec::new();
                for ci_index in CI_PROFILE_INDICES_LISTED {
                    let mut prof: nvmlComputeInstanceProfileInfo_t = mem::zeroed();
                    if ci_profile_info(
                        gi,
                        ci_index,
                        NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                        &mut prof,
                    ) != NVML_SUCCESS
                    {
                        continue;
                    }
                    let mut cis: Vec<nvmlComputeInstance_t> =
                        vec![ptr::null_mut(); prof.instanceCount.max(1) as usize];
                    let mut ci_count: c_uint = cis.len() as c_uint;
                    check(
                        "nvmlGpuInstanceGetComputeInstances",
                        get_cis(gi, prof.id, cis.as_mut_ptr(), &mut ci_count),
                    )?;
                    for &ci in &cis[..(ci_count as usize).min(cis.len())] {
                        cis_out.push(compute_instance_info(nvml, device, info.id, ci)?);
                    }
                }
                cis_out.sort_by_key(|c| c.id);
                out.push(RawGpuInstance {
                    id: info.id,
                    profile_id: info.profileId,
                    placement: MigPlacement {
                        start: info.placement.start,
                        size: info.placement.size,
                    },
                    compute_instances: cis_out,
                });
            }
        }
    }
    out.sort_by_key(|gi| gi.id);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_compute_instances_covers_every_ci_profile_index_including_rev1() {
        let mut listed = CI_PROFILE_INDICES_LISTED.to_vec();
        listed.sort_unstable();
        assert_eq!(listed, (0..=8).collect::<Vec<_>>());
        assert!(
            !CI_PROFILE_INDICES_LARGEST_FIRST.contains(&7),
            "creation keeps skipping 1_SLICE_REV1"
        );
    }

    #[test]
    fn struct_versions_encode_size_and_version_like_the_nvml_macro() {
        let v3 = struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3);
        assert_eq!(v3 >> 24, 3);
        assert_eq!(
            v3 & 0x00ff_ffff,
            mem::size_of::<nvmlGpuInstanceProfileInfo_v3_t>() as u32
        );
    }

    #[test]
    fn gi_profiles_are_enumerated_until_invalid_argument_past_the_bindings_count() {
        // Defect: enumeration stopped at nvml-wrapper-sys's NVML_GPU_INSTANCE_PROFILE_COUNT (17), so a
        // profile at index 0x11 (3g+gfx, R575+) was never seen; and a newer driver's index past nvml.h's
        // count is found too.
        let known = [0, 1, 0x11, 0x12, 0x13];
        let asked = std::cell::RefCell::new(Vec::new());
        let found = enumerate_gi_profiles(|i| {
            asked.borrow_mut().push(i);
            match i {
                i if known.contains(&i) => Ok(i * 10),
                i if i <= 0x13 => Err(RawError { call: "x", code: 3 }),
                _ => Err(RawError { call: "x", code: 2 }),
            }
        });
        let indices: Vec<u32> = found.iter().map(|(i, _)| *i).collect();
        assert_eq!(indices, [0, 1, 0x11, 0x12, 0x13]);
        assert_eq!(
            *asked.borrow().last().unwrap(),
            0x14,
            "stops at the first INVALID_ARGUMENT past nvml.h's count"
        );
        let never = enumerate_gi_profiles(|_| Err::<u32, _>(RawError { call: "x", code: 3 }));
        assert!(never.is_empty());
        let mut calls = 0;
        enumerate_gi_profiles(|_| {
            calls += 1;
            Err::<u32, _>(RawError { call: "x", code: 3 })
        });
        assert_eq!(
            calls, GI_PROFILE_INDEX_LIMIT,
            "a driver that never says INVALID_ARGUMENT is capped"
        );
    }

    #[test]
    fn an_invalid_argument_below_nvml_h_count_is_skipped_and_the_later_profiles_still_found() {
        // N12: the first INVALID_ARGUMENT ended the enumeration wherever it came, so a driver answering it
        // for an unused index in the middle hid every later profile (NVIDIA's DRA skips it and goes on).
        let asked = std::cell::RefCell::new(Vec::new());
        let found = enumerate_gi_profiles(|i| {
            asked.borrow_mut().push(i);
            match i {
                0 | 7 | 9 | 0x11 => Ok(i),
                5 | 6 | 0xA => Err(RawError { call: "x", code: 2 }),
                i if i < NVML_H_GI_PROFILE_COUNT => Err(RawError { call: "x", code: 3 }),
                _ => Err(RawError { call: "x", code: 2 }),
            }
        });
        let indices: Vec<u32> = found.iter().map(|(i, _)| *i).collect();
        assert_eq!(indices, [0, 7, 9, 0x11]);
        assert_eq!(
            *asked.borrow(),
            (0..=NVML_H_GI_PROFILE_COUNT).collect::<Vec<_>>(),
            "every index up to nvml.h's count, then the first INVALID_ARGUMENT past it ends"
        );
    }

    #[test]
    fn a_uuid_that_is_not_mig_is_refused_as_a_mig_devices_uuid() {
        assert!(check_mig_uuid("MIG-5c89b0e4-2a51-5f7c-9cb8-0b3b0a1b2c3d").is_ok());
        let e = check_mig_uuid("GPU-5c89b0e4-2a51-5f7c-9cb8-0b3b0a1b2c3d").unwrap_err();
        assert_eq!(e.code, NVML_ERROR_NOT_A_MIG_UUID);
    }

    #[test]
    fn driver_profile_names_lose_the_mig_prefix() {
        let mut raw = [0 as std::os::raw::c_char; 96];
        for (i, b) in b"MIG 1g.10gb+me".iter().enumerate() {
            raw[i] = *b as std::os::raw::c_char;
        }
        assert_eq!(c_name(&raw).as_deref(), Some("1g.10gb+me"));
        assert_eq!(c_name(&[0; 96]), None);
    }
}
