//! tessera's simulated `libcuda.so.1`: the part of the CUDA driver API a probe uses, with CUDA's
//! signatures and error codes, over the one hardware model ([`SimulatedBackend`]).
//!
//! ```text
//!  probe ──dlopen("libcuda.so.1")──▶ this library ──dladdr: own path──▶ walk up to <dir>/tessera-sim
//!                                        │                               (TESSERA_SIM_KERNEL overrides)
//!                                        └──▶ SimulatedBackend::open_kernel(K) (read-only in a container)
//! ```
//!
//! What a process sees (`cuDeviceGetCount`): without `/dev/nvidiactl`, every GPU of the kernel (the host);
//! with it, the GPUs whose `/dev/nvidia<minor>` exist, and on a MIG-enabled GPU the MIG devices whose GI
//! and CI capability nodes (`/dev/nvidia-caps/nvidia-cap<minor>`) exist. A MIG-enabled GPU enumerates its
//! MIG devices instead of itself, each a device of its own (`MIG-…` UUID, name `<GPU> MIG <profile>`).
//! `CUDA_VISIBLE_DEVICES` then narrows and orders the list as CUDA does: ordinals, `GPU-…` and `MIG-…`
//! UUIDs (unique prefixes allowed); the list stops at the first entry that names nothing.
//!
//! `cuCtxCreate` talks to an MPS control daemon at `$CUDA_MPS_PIPE_DIRECTORY/control` (default
//! `/tmp/nvidia-mps`, as CUDA): one that accepts the client makes the context an MPS client, with the
//! server's active thread percentage (lowered by `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) and pinned memory
//! limit (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, else the daemon's default), seen through
//! `cuCtxGetExecAffinity` and `cuMemGetInfo`. Without a daemon, a GPU in `EXCLUSIVE_PROCESS` (or
//! `PROHIBITED`) compute mode refuses the context with `CUDA_ERROR_DEVICES_UNAVAILABLE`; in `DEFAULT`
//! mode the context is direct.
//!
//! Modules: `cuModuleLoadData(Ex)` takes a cubin or fatbin as it is, and PTX through the PTX JIT compiler,
//! which it `dlopen`s by soname (`libnvidia-ptxjitcompiler.so.1`) through the loader's own search as
//! NVIDIA's libcuda does: without it in the process's library path (a container whose spec left it out)
//! the load fails with `CUDA_ERROR_JIT_COMPILER_NOT_FOUND`. `cuLinkAddData` of NVVM IR needs
//! `libnvidia-nvvm.so.4` likewise. Both libraries are built by `build.rs` from `jit/`.
//!
//! Every export catches panics (a panic across the C ABI would abort the caller) and answers
//! `CUDA_ERROR_UNKNOWN` instead. `TESSERA_SIM_DEBUG=1` prints why `cuInit` failed to stderr.

#![allow(
    unsafe_code,
    reason = "a C ABI library: every export takes raw pointers from its C callers"
)]
#![allow(non_snake_case, reason = "the exports carry CUDA's names")]
#![allow(
    clippy::missing_safety_doc,
    reason = "the safety contract of every export is CUDA's: valid pointers of the documented types"
)]

use std::{
    cell::Cell,
    collections::HashMap,
    ffi::{c_char, c_int, c_uint, c_void},
    panic::AssertUnwindSafe,
    path::{Path, PathBuf},
    sync::{Mutex, OnceLock},
};

use tessera_gpu_api::{ComputeMode, GpuBackend};
use tessera_kubelet_plugin::devices::sharing::mps::{
    CLIENT_CONNECT, ClientGrant, parse_mem_limit, send_control,
};
use tessera_sim_model::backend::{
    DeviceView, Latencies, SimulatedBackend, locate_kernel, mig_minors_by_formula,
};
use tessera_sim_model::kernel::{
    DEV_ROOT_ENV, SIMULATED_CUDA_DRIVER_VERSION, kernel_driver_version, library_driver_version, mapped_inode,
};

/// `CUresult`.
pub type CUresult = c_int;
/// `CUdevice`: an ordinal.
pub type CUdevice = c_int;
/// `CUcontext`: an opaque pointer (never dereferenced by callers; here a handle number).
pub type CUcontext = *mut c_void;

/// `CUmodule`: an opaque pointer (here a handle number, never dereferenced).
pub type CUmodule = *mut c_void;
/// `CUlinkState`: an opaque pointer (here a handle number, never dereferenced).
pub type CUlinkState = *mut c_void;

/// `CUuuid`: 16 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUuuid {
    pub bytes: [c_char; 16],
}

/// `CUexecAffinityParam` (`type` + a union whose only member is `CUexecAffinitySmCount { unsigned val }`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CUexecAffinityParam {
    pub kind: c_int,
    pub sm_count: c_uint,
}

/// CUDA's error codes (`cuda.h`, `cudaError_enum`), the ones this library answers.
pub mod code {
    use std::ffi::c_int;
    pub const CUDA_SUCCESS: c_int = 0;
    pub const CUDA_ERROR_INVALID_VALUE: c_int = 1;
    pub const CUDA_ERROR_OUT_OF_MEMORY: c_int = 2;
    pub const CUDA_ERROR_NOT_INITIALIZED: c_int = 3;
    pub const CUDA_ERROR_DEINITIALIZED: c_int = 4;
    pub const CUDA_ERROR_DEVICES_UNAVAILABLE: c_int = 46;
    pub const CUDA_ERROR_NO_DEVICE: c_int = 100;
    pub const CUDA_ERROR_INVALID_DEVICE: c_int = 101;
    pub const CUDA_ERROR_INVALID_IMAGE: c_int = 200;
    pub const CUDA_ERROR_INVALID_CONTEXT: c_int = 201;
    pub const CUDA_ERROR_INVALID_PTX: c_int = 218;
    pub const CUDA_ERROR_JIT_COMPILER_NOT_FOUND: c_int = 221;
    pub const CUDA_ERROR_INVALID_HANDLE: c_int = 400;
    pub const CUDA_ERROR_NOT_FOUND: c_int = 500;
    pub const CUDA_ERROR_NOT_SUPPORTED: c_int = 801;
    pub const CUDA_ERROR_SYSTEM_NOT_READY: c_int = 802;
    pub const CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: c_int = 803;
    pub const CUDA_ERROR_MPS_CONNECTION_FAILED: c_int = 805;
    pub const CUDA_ERROR_MPS_SERVER_NOT_READY: c_int = 807;
    pub const CUDA_ERROR_UNKNOWN: c_int = 999;
}
use code::*;

/// `cuGetErrorName` / `cuGetErrorString` texts, NUL-terminated statics as CUDA returns them.
const ERRORS: &[(CUresult, &str, &str)] = &[
    (CUDA_SUCCESS, "CUDA_SUCCESS\0", "no error\0"),
    (
        CUDA_ERROR_INVALID_VALUE,
        "CUDA_ERROR_INVALID_VALUE\0",
        "invalid argument\0",
    ),
    (
        CUDA_ERROR_OUT_OF_MEMORY,
        "CUDA_ERROR_OUT_OF_MEMORY\0",
        "out of memory\0",
    ),
    (
        CUDA_ERROR_NOT_INITIALIZED,
        "CUDA_ERROR_NOT_INITIALIZED\0",
        "initialization error\0",
    ),
    (
        CUDA_ERROR_DEINITIALIZED,
        "CUDA_ERROR_DEINITIALIZED\0",
        "driver shutting down\0",
    ),
    (
        CUDA_ERROR_DEVICES_UNAVAILABLE,
        "CUDA_ERROR_DEVICES_UNAVAILABLE\0",
        "CUDA-capable device(s) is/are busy or unavailable\0",
    ),
    (
        CUDA_ERROR_NO_DEVICE,
        "CUDA_ERROR_NO_DEVICE\0",
        "no CUDA-capable device is detected\0",
    ),
    (
        CUDA_ERROR_INVALID_DEVICE,
        "CUDA_ERROR_INVALID_DEVICE\0",
        "invalid device ordinal\0",
    ),
    (
        CUDA_ERROR_INVALID_IMAGE,
        "CUDA_ERROR_INVALID_IMAGE\0",
        "device kernel image is invalid\0",
    ),
    (
        CUDA_ERROR_INVALID_CONTEXT,
        "CUDA_ERROR_INVALID_CONTEXT\0",
        "invalid device context\0",
    ),
    (
        CUDA_ERROR_INVALID_PTX,
        "CUDA_ERROR_INVALID_PTX\0",
        "a PTX JIT compilation failed\0",
    ),
    (
        CUDA_ERROR_JIT_COMPILER_NOT_FOUND,
        "CUDA_ERROR_JIT_COMPILER_NOT_FOUND\0",
        "PTX JIT compiler library not found\0",
    ),
    (
        CUDA_ERROR_INVALID_HANDLE,
        "CUDA_ERROR_INVALID_HANDLE\0",
        "invalid resource handle\0",
    ),
    (
        CUDA_ERROR_NOT_FOUND,
        "CUDA_ERROR_NOT_FOUND\0",
        "named symbol not found\0",
    ),
    (
        CUDA_ERROR_NOT_SUPPORTED,
        "CUDA_ERROR_NOT_SUPPORTED\0",
        "operation not supported\0",
    ),
    (
        CUDA_ERROR_SYSTEM_NOT_READY,
        "CUDA_ERROR_SYSTEM_NOT_READY\0",
        "system not yet initialized\0",
    ),
    (
        CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
        "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH\0",
        "system has unsupported display driver / cuda driver combination\0",
    ),
    (
        CUDA_ERROR_MPS_CONNECTION_FAILED,
        "CUDA_ERROR_MPS_CONNECTION_FAILED\0",
        "MPS client failed to connect to the MPS control daemon or the MPS server\0",
    ),
    (
        CUDA_ERROR_MPS_SERVER_NOT_READY,
        "CUDA_ERROR_MPS_SERVER_NOT_READY\0",
        "MPS server is not ready to accept new MPS client requests\0",
    ),
    (CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN\0", "unknown error\0"),
];

/// `CUdevice_attribute` values answered by `cuDeviceGetAttribute`.
mod attr {
    pub const MAX_THREADS_PER_BLOCK: i32 = 1;
    pub const WARP_SIZE: i32 = 10;
    pub const MULTIPROCESSOR_COUNT: i32 = 16;
    pub const INTEGRATED: i32 = 18;
    pub const COMPUTE_MODE: i32 = 20;
    pub const ECC_ENABLED: i32 = 32;
    pub const PCI_BUS_ID: i32 = 33;
    pub const PCI_DEVICE_ID: i32 = 34;
    pub const MAX_THREADS_PER_MULTIPROCESSOR: i32 = 39;
    pub const UNIFIED_ADDRESSING: i32 = 41;
    pub const PCI_DOMAIN_ID: i32 = 50;
    pub const COMPUTE_CAPABILITY_MAJOR: i32 = 75;
    pub const COMPUTE_CAPABILITY_MINOR: i32 = 76;
    pub const MANAGED_MEMORY: i32 = 83;
}

/// `CU_EXEC_AFFINITY_TYPE_SM_COUNT`.
const EXEC_AFFINITY_SM_COUNT: c_int = 0;

/// One CUDA device: a whole GPU or a MIG device.
#[derive(Clone, Debug)]
struct Device {
    /// `GPU-…` or `MIG-…`.
    uuid: String,
    /// The GPU's UUID (the same as `uuid` for a whole GPU).
    gpu_uuid: String,
    /// Kernel index of the GPU.
    gpu: u32,
    name: String,
    memory_bytes: u64,
    multiprocessors: u32,
    compute_capability: (i32, i32),
    pci: (i32, i32, i32),
    pci_bus_id: String,
}

struct Driver {
    kernel: SimulatedBackend,
    devices: Vec<Device>,
}

static DRIVER: OnceLock<Result<Driver, CUresult>> = OnceLock::new();

/// An MPS client's view: the server that serves it and its limits.
#[derive(Clone, Debug)]
struct Mps {
    server_pid: u32,
    active_thread_percentage: f64,
    pinned_memory_bytes: Option<u64>,
}

struct Context {
    device: CUdevice,
    mps: Option<Mps>,
}

/// Live contexts by handle; handles are small numbers dressed as pointers, never dereferenced.
static CONTEXTS: Mutex<(usize, Option<HashMap<usize, Context>>)> = Mutex::new((0, None));

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

fn debug(msg: &str) {
    if std::env::var_os("TESSERA_SIM_DEBUG").is_some_and(|v| v == "1") {
        eprintln!("tessera libcuda: {msg}");
    }
}

/// Runs `f`, turning a panic into `CUDA_ERROR_UNKNOWN`.
fn guard(f: impl FnOnce() -> Result<(), CUresult>) -> CUresult {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

fn driver() -> Result<&'static Driver, CUresult> {
    match DRIVER.get() {
        Some(Ok(d)) => Ok(d),
        Some(Err(code)) => Err(*code),
        None => Err(CUDA_ERROR_NOT_INITIALIZED),
    }
}

fn device(ordinal: CUdevice) -> Result<&'static Device, CUresult> {
    let d = driver()?;
    usize::try_from(ordinal)
        .ok()
        .and_then(|i| d.devices.get(i))
        .ok_or(CUDA_ERROR_INVALID_DEVICE)
}

/// Writes `value` through `ptr`, or `CUDA_ERROR_INVALID_VALUE` for a null pointer.
fn put<T>(ptr: *mut T, value: T) -> Result<(), CUresult> {
    if ptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null and, by CUDA's contract, pointing at a writable `T`.
    unsafe { ptr.write(value) };
    Ok(())
}

/// Copies `text` NUL-terminated into `buf` of `len` bytes, truncating as CUDA does.
fn put_str(buf: *mut c_char, len: c_int, text: &str) -> Result<(), CUresult> {
    if buf.is_null() || len <= 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let n = text.len().min(len as usize - 1);
    // SAFETY: `buf` holds `len` bytes by contract; `n + 1 <= len`.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf, n);
        buf.add(n).write(0);
    }
    Ok(())
}

// === The kernel and what this process sees ===

/// The path this library was loaded from (`dladdr` on one of its own functions).
fn own_path() -> Option<PathBuf> {
    // SAFETY: `Dl_info` is plain data; all-zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let addr = cuInit as *const c_void;
    // SAFETY: `dladdr` only reads the address and fills `info`.
    let found = unsafe { libc::dladdr(addr, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: `dli_fname` is a NUL-terminated string owned by the loader.
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
    use std::os::unix::ffi::OsStrExt;
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

/// The process's `/dev` (the test-only override of the model, else `/dev`).
fn dev_root() -> PathBuf {
    std::env::var_os(DEV_ROOT_ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev"))
}

fn init() -> Result<Driver, CUresult> {
    let path = own_path().unwrap_or_default();
    let Some(dir) = locate_kernel(&path) else {
        debug(&format!(
            "no simulated kernel (tessera-sim/kernel.json) above {}",
            path.display()
        ));
        return Err(CUDA_ERROR_NO_DEVICE);
    };
    // The kernel module and the library must be the same driver version, as with NVIDIA's: after a
    // driver upgrade a container that still has the old library fails here.
    let own = library_driver_version(&path, mapped_inode(cuInit as *const c_void as usize), "libcuda");
    if let Some(kernel) = kernel_driver_version(&dir)
        && kernel != own
    {
        debug(&format!(
            "the kernel module in {} is driver {kernel}, this library {own}",
            dir.display()
        ));
        return Err(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH);
    }
    let kernel = SimulatedBackend::open_kernel(&dir).map_err(|e| {
        debug(&format!(
            "cannot open the simulated kernel {}: {e}",
            dir.display()
        ));
        CUDA_ERROR_NO_DEVICE
    })?;
    let all = enumerate(&kernel, &dev_root()).map_err(|e| {
        debug(&format!("cannot enumerate devices: {e}"));
        CUDA_ERROR_UNKNOWN
    })?;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let devices = narrow(all, visible.as_deref());
    if devices.is_empty() {
        debug("no device is visible to this process");
        return Err(CUDA_ERROR_NO_DEVICE);
    }
    Ok(Driver { kernel, devices })
}

fn compute_capability(cc: &str) -> (i32, i32) {
    let (major, minor) = cc.split_once('.').unwrap_or((cc, "0"));
    (major.parse().unwrap_or(0), minor.parse().unwrap_or(0))
}

/// `0000:18:00.0` → (domain, bus, device).
fn pci_numbers(bus_id: &str) -> (i32, i32, i32) {
    let mut parts = bus_id.split([':', '.']);
    let mut next = || {
        parts
            .next()
            .and_then(|p| i32::from_str_radix(p, 16).ok())
            .unwrap_or(0)
    };
    (next(), next(), next())
}

/// Every device this process's `/dev` shows, in enumeration order (GPUs by bus order; a MIG-enabled
/// GPU's MIG devices by GPU-instance then compute-instance id).
fn enumerate(kernel: &SimulatedBackend, dev: &Path) -> tessera_gpu_api::Result<Vec<Device>> {
    let view = DeviceView::at(dev);
    let cap = |minor: u32| dev.join(format!("nvidia-caps/nvidia-cap{minor}")).exists();
    let mut out = Vec::new();
    for gpu in kernel.visible_gpus(&view) {
        // A GPU that fails every call (lost, or a driver fault) does not enumerate.
        if kernel.failing_code(gpu).is_some() {
            continue;
        }
        let g = kernel.gpu(gpu)?;
        let model = g.model;
        let whole = Device {
            uuid: g.uuid.clone(),
            gpu_uuid: g.uuid.clone(),
            gpu,
            name: model.product_name.to_string(),
            memory_bytes: model.memory_bytes(),
            multiprocessors: model.multiprocessors,
            compute_capability: compute_capability(model.compute_capability),
            pci: pci_numbers(&g.pci_bus_id),
            pci_bus_id: g.pci_bus_id.clone(),
        };
        if !kernel.mig_mode(gpu)?.current {
            out.push(whole);
            continue;
        }
        // Running work on a MIG device needs its GI and CI capabilities (`mig/monitor` does not do).
        for mig in kernel.mig_devices(gpu, &DeviceView::host())? {
            let (gi_minor, ci_minor) =
                mig_minors_by_formula(g.minor, mig.gpu_instance, mig.compute_instance)?;
            if view.is_container() && !(cap(gi_minor) && cap(ci_minor)) {
                continue;
            }
            let Some(profile) = model.profile_by_id(mig.gi_profile_id) else {
                continue;
            };
            out.push(Device {
                uuid: mig.uuid.clone(),
                name: format!("{} MIG {}", model.product_name, profile.name),
                memory_bytes: profile.memory_mib << 20,
                multiprocessors: profile.multiprocessors,
                ..whole.clone()
            });
        }
    }
    Ok(out)
}

/// `CUDA_VISIBLE_DEVICES` applied to `all`: ordinals and UUIDs (unique prefixes), in the order given; the
/// first entry naming no device (or more than one) ends the list; repeats are dropped.
fn narrow(all: Vec<Device>, visible: Option<&str>) -> Vec<Device> {
    let Some(visible) = visible else { return all };
    let mut out: Vec<Device> = Vec::new();
    for entry in visible.split(',').map(str::trim) {
        let picked: Vec<&Device> = if let Ok(i) = entry.parse::<usize>() {
            all.get(i).into_iter().collect()
        } else if entry.starts_with("MIG-") {
            let m: Vec<&Device> = all.iter().filter(|d| d.uuid.starts_with(entry)).collect();
            if m.len() == 1 { m } else { Vec::new() }
        } else if entry.starts_with("GPU-") {
            // A GPU UUID names the GPU, or on a MIG-enabled GPU its MIG devices; the prefix must name one GPU.
            let m: Vec<&Device> = all.iter().filter(|d| d.gpu_uuid.starts_with(entry)).collect();
            let gpus: std::collections::BTreeSet<u32> = m.iter().map(|d| d.gpu).collect();
            if gpus.len() == 1 { m } else { Vec::new() }
        } else {
            Vec::new()
        };
        if picked.is_empty() {
            break;
        }
        for d in picked {
            if !out.iter().any(|o| o.uuid == d.uuid) {
                out.push(d.clone());
            }
        }
    }
    out
}

/// `GPU-xxxxxxxx-…` / `MIG-…` → the 16 bytes of the UUID.
fn uuid_bytes(uuid: &str) -> Option<[u8; 16]> {
    let hex: String = uuid
        .strip_prefix("GPU-")
        .or_else(|| uuid.strip_prefix("MIG-"))?
        .chars()
        .filter(|c| *c != '-')
        .collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

// === Initialization and devices ===

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    guard(|| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        DRIVER.get_or_init(init).as_ref().map(|_| ()).map_err(|c| *c)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    guard(|| {
        let (major, minor) = compute_capability(SIMULATED_CUDA_DRIVER_VERSION);
        put(version, major * 1000 + minor * 10)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    guard(|| put(count, driver()?.devices.len() as c_int))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    guard(|| {
        device(ordinal)?;
        put(dev, ordinal)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    guard(|| put_str(name, len, &device(dev)?.name))
}

fn get_uuid(out: *mut CUuuid, dev: CUdevice) -> Result<(), CUresult> {
    let bytes = uuid_bytes(&device(dev)?.uuid).ok_or(CUDA_ERROR_UNKNOWN)?;
    put(
        out,
        CUuuid {
            bytes: bytes.map(|b| b as c_char),
        },
    )
}

/// For a MIG device, the MIG UUID, like `_v2` (the simulated driver has no GPU-instance UUIDs for v1 to
/// return).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    guard(|| get_uuid(uuid, dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) -> CUresult {
    guard(|| get_uuid(uuid, dev))
}

/// The pre-3.2 ABI with a 32-bit size (saturated); `cuda.h` maps `cuDeviceTotalMem` to `_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) -> CUresult {
    guard(|| {
        put(
            bytes,
            c_uint::try_from(device(dev)?.memory_bytes).unwrap_or(c_uint::MAX),
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    guard(|| put(bytes, device(dev)?.memory_bytes as usize))
}

fn compute_mode_of(gpu: u32) -> Result<ComputeMode, CUresult> {
    driver()?.kernel.compute_mode(gpu).map_err(|_| CUDA_ERROR_UNKNOWN)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(value: *mut c_int, attrib: c_int, dev: CUdevice) -> CUresult {
    guard(|| {
        let d = device(dev)?;
        let v = match attrib {
            attr::MAX_THREADS_PER_BLOCK => 1024,
            attr::WARP_SIZE => 32,
            attr::MULTIPROCESSOR_COUNT => d.multiprocessors as c_int,
            attr::INTEGRATED => 0,
            attr::COMPUTE_MODE => match compute_mode_of(d.gpu)? {
                ComputeMode::Default => 0,
                ComputeMode::Prohibited => 2,
                ComputeMode::ExclusiveProcess => 3,
            },
            attr::ECC_ENABLED => 1,
            attr::PCI_BUS_ID => d.pci.1,
            attr::PCI_DEVICE_ID => d.pci.2,
            attr::PCI_DOMAIN_ID => d.pci.0,
            attr::MAX_THREADS_PER_MULTIPROCESSOR => 2048,
            attr::UNIFIED_ADDRESSING | attr::MANAGED_MEMORY => 1,
            attr::COMPUTE_CAPABILITY_MAJOR => d.compute_capability.0,
            attr::COMPUTE_CAPABILITY_MINOR => d.compute_capability.1,
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        put(value, v)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceComputeCapability(
    major: *mut c_int,
    minor: *mut c_int,
    dev: CUdevice,
) -> CUresult {
    guard(|| {
        let (ma, mi) = device(dev)?.compute_capability;
        put(major, ma)?;
        put(minor, mi)
    })
}

/// `dddd:bb:dd.f`, as CUDA prints it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(bus_id: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    guard(|| put_str(bus_id, len, &device(dev)?.pci_bus_id))
}

// === Contexts ===

/// Attaches to the MPS control daemon of `$CUDA_MPS_PIPE_DIRECTORY` for `d`: `Ok(None)` when no daemon
/// answers (none runs there), `Err` when one answers but refuses the client.
fn mps_connect(d: &Device, ordinal: CUdevice) -> Result<Option<Mps>, CUresult> {
    let pipe = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/nvidia-mps"));
    let command = format!(
        "{CLIENT_CONNECT} uuid={} gpu={} pid={}",
        d.uuid,
        d.gpu_uuid,
        std::process::id()
    );
    let Ok(answer) = send_control(&pipe, &command) else {
        return Ok(None);
    };
    let grant = ClientGrant::parse(&answer).map_err(|reason| {
        debug(&format!(
            "MPS daemon at {} refused the client: {reason}",
            pipe.display()
        ));
        CUDA_ERROR_MPS_CONNECTION_FAILED
    })?;
    // The client's own limits can only lower the server's thread percentage; its pinned limit (keyed by
    // its device ordinal) replaces the daemon's default.
    let mut pct = grant.active_thread_percentage;
    if let Some(own) = std::env::var("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
    {
        pct = pct.min(own.clamp(0.0, 100.0));
    }
    let client_limit = std::env::var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
        .ok()
        .and_then(|v| {
            v.split(',').find_map(|pair| {
                let (dev, limit) = pair.split_once('=')?;
                (dev.trim() == ordinal.to_string() || dev.trim() == d.uuid).then(|| parse_mem_limit(limit))?
            })
        });
    let daemon_limit = grant
        .pinned_mem_limits
        .iter()
        .find(|(dev, _)| *dev == d.uuid)
        .or_else(|| grant.pinned_mem_limits.iter().find(|(dev, _)| dev == "0"))
        .and_then(|(_, v)| parse_mem_limit(v))
        .filter(|b| *b > 0);
    Ok(Some(Mps {
        server_pid: grant.server_pid,
        active_thread_percentage: pct,
        pinned_memory_bytes: client_limit.or(daemon_limit),
    }))
}

fn ctx_create(pctx: *mut CUcontext, dev: CUdevice) -> Result<(), CUresult> {
    if pctx.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let d = device(dev)?;
    let mps = mps_connect(d, dev)?;
    if mps.is_none() {
        match compute_mode_of(d.gpu)? {
            ComputeMode::Default => {}
            // The GPU is reserved for an MPS server (or closed to compute) and none answers.
            ComputeMode::ExclusiveProcess | ComputeMode::Prohibited => {
                return Err(CUDA_ERROR_DEVICES_UNAVAILABLE);
            }
        }
    }
    // A process's first context is the slow one (the driver sets the GPU up for it); the model's
    // `firstContextMs`, once per process.
    static FIRST: std::sync::Once = std::sync::Once::new();
    let first_context_ms = driver()?.kernel.latencies().first_context_ms;
    FIRST.call_once(|| Latencies::charge(first_context_ms));
    let mut contexts = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    contexts.0 += 1;
    // Pointer-looking, non-null, never dereferenced.
    let handle = 0x7e55_0000_0000 + contexts.0 * 0x10;
    contexts
        .1
        .get_or_insert_with(HashMap::new)
        .insert(handle, Context { device: dev, mps });
    drop(contexts);
    CURRENT.with(|c| c.set(handle));
    put(pctx, handle as CUcontext)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate(pctx: *mut CUcontext, _flags: c_uint, dev: CUdevice) -> CUresult {
    guard(|| ctx_create(pctx, dev))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(pctx: *mut CUcontext, _flags: c_uint, dev: CUdevice) -> CUresult {
    guard(|| ctx_create(pctx, dev))
}

/// With execution-affinity parameters, which are accepted and ignored.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    _params: *mut CUexecAffinityParam,
    _num_params: c_int,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    guard(|| ctx_create(pctx, dev))
}

/// CUDA 13's `cuCtxCreate` (`CUctxCreateParams*`, accepted and ignored).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    _params: *mut c_void,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    guard(|| ctx_create(pctx, dev))
}

fn ctx_destroy(ctx: CUcontext) -> Result<(), CUresult> {
    driver()?;
    let handle = ctx as usize;
    let mut contexts = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    contexts
        .1
        .as_mut()
        .and_then(|m| m.remove(&handle))
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    CURRENT.with(|c| {
        if c.get() == handle {
            c.set(0);
        }
    });
    Ok(())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy(ctx: CUcontext) -> CUresult {
    guard(|| ctx_destroy(ctx))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    guard(|| ctx_destroy(ctx))
}

/// Runs `f` on the calling thread's current context.
fn with_current<T>(f: impl FnOnce(&Context) -> Result<T, CUresult>) -> Result<T, CUresult> {
    driver()?;
    let handle = CURRENT.with(Cell::get);
    let contexts = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = contexts
        .1
        .as_ref()
        .and_then(|m| m.get(&handle))
        .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    f(ctx)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    guard(|| {
        driver()?;
        put(pctx, CURRENT.with(Cell::get) as CUcontext)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    guard(|| {
        let d = with_current(|c| Ok(c.device))?;
        put(dev, d)
    })
}

/// The SMs the current context may use: all of the device's, or under MPS its active thread percentage
/// of them (rounded up), as CUDA reports the MPS limit.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetExecAffinity(param: *mut CUexecAffinityParam, kind: c_int) -> CUresult {
    guard(|| {
        if kind != EXEC_AFFINITY_SM_COUNT {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (dev, mps) = with_current(|c| Ok((c.device, c.mps.clone())))?;
        let sms = device(dev)?.multiprocessors;
        let count = match mps {
            Some(m) => ((f64::from(sms) * m.active_thread_percentage / 100.0).ceil() as u32).clamp(1, sms),
            None => sms,
        };
        put(
            param,
            CUexecAffinityParam {
                kind,
                sm_count: count,
            },
        )
    })
}

fn mem_info() -> Result<(u64, u64), CUresult> {
    let (dev, mps) = with_current(|c| Ok((c.device, c.mps.clone())))?;
    let total = device(dev)?.memory_bytes;
    let total = mps
        .and_then(|m| m.pinned_memory_bytes)
        .map_or(total, |limit| limit.min(total));
    // Nothing is ever allocated on a simulated GPU.
    Ok((total, total))
}

/// Free and total memory of the current context's device: under MPS with a pinned memory limit, the limit.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    guard(|| {
        let (f, t) = mem_info()?;
        put(free, f as usize)?;
        put(total, t as usize)
    })
}

/// The 32-bit pre-3.2 ABI (saturated).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) -> CUresult {
    guard(|| {
        let (f, t) = mem_info()?;
        put(free, c_uint::try_from(f).unwrap_or(c_uint::MAX))?;
        put(total, c_uint::try_from(t).unwrap_or(c_uint::MAX))
    })
}

// === Modules and the JIT ===

/// A driver library that libcuda loads when a program first needs it, by soname.
struct JitLibrary {
    soname: &'static std::ffi::CStr,
    /// The simulated library's entry point (`jit/`): `(bytes, len) -> CUresult`.
    entry: &'static std::ffi::CStr,
}

/// NVIDIA's libcuda `dlopen`s `libnvidia-ptxjitcompiler.so.1` by soname to compile PTX, and answers
/// `CUDA_ERROR_JIT_COMPILER_NOT_FOUND` (cuda.h: "This indicates that the PTX JIT compiler library was not
/// found") without it; NVIDIA's CDI generator mounts it for that reason (nvidia-container-toolkit
/// `pkg/nvcdi/driver-nvml.go`, every `*.so.<driver version>`).
const PTX_JIT: JitLibrary = JitLibrary {
    soname: c"libnvidia-ptxjitcompiler.so.1",
    entry: c"tesseraSimPtxJitCompile",
};
/// The NVVM compiler the driver `dlopen`s for NVVM IR (LTO-IR), soname `.so.4` as NVIDIA ships it.
const NVVM: JitLibrary = JitLibrary {
    soname: c"libnvidia-nvvm.so.4",
    entry: c"tesseraSimNvvmCompile",
};

type Compile = unsafe extern "C" fn(*const u8, usize) -> CUresult;

/// Loads `lib` through the dynamic loader's search (`LD_LIBRARY_PATH`, `/etc/ld.so.cache`, the default
/// directories), never from a path of its own: the directory libcuda lies in is not searched unless the
/// loader searches it, as with NVIDIA's. The handle is kept for the process (never closed).
fn jit(lib: &JitLibrary) -> Result<Compile, CUresult> {
    // SAFETY: a NUL-terminated soname; dlopen runs no code of ours.
    let handle = unsafe { libc::dlopen(lib.soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a loader-owned string or null.
        let why = unsafe { libc::dlerror() };
        let why = if why.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated.
            unsafe { std::ffi::CStr::from_ptr(why) }
                .to_string_lossy()
                .into_owned()
        };
        debug(&format!("cannot load {}: {why}", lib.soname.to_string_lossy()));
        return Err(CUDA_ERROR_JIT_COMPILER_NOT_FOUND);
    }
    // SAFETY: a live handle and a NUL-terminated name.
    let entry = unsafe { libc::dlsym(handle, lib.entry.as_ptr()) };
    if entry.is_null() {
        debug(&format!(
            "{} has no {}: not the simulated driver's",
            lib.soname.to_string_lossy(),
            lib.entry.to_string_lossy()
        ));
        return Err(CUDA_ERROR_JIT_COMPILER_NOT_FOUND);
    }
    // SAFETY: the symbol is the JIT library's `Compile` (jit/*.rs).
    Ok(unsafe { std::mem::transmute::<*mut c_void, Compile>(entry) })
}

/// Compiles `bytes` with `lib`, loading it first.
fn jit_compile(lib: &JitLibrary, bytes: &[u8]) -> Result<(), CUresult> {
    let compile = jit(lib)?;
    // SAFETY: `bytes` is a live slice.
    match unsafe { compile(bytes.as_ptr(), bytes.len()) } {
        CUDA_SUCCESS => Ok(()),
        code => Err(code),
    }
}

/// What `cuModuleLoadData` was given.
enum Image<'a> {
    /// A cubin (ELF) or fatbin: loaded as it is.
    Binary,
    /// NUL-terminated PTX text, without its NUL.
    Ptx(&'a [u8]),
}

/// ELF, fatbin (`0xBA55ED50`) and the fatbin wrapper of `__cudaRegisterFatBinary` (`0x466243B1`).
const BINARY_MAGICS: [&[u8]; 3] = [b"\x7fELF", &[0x50, 0xed, 0x55, 0xba], &[0xb1, 0x43, 0x62, 0x46]];

/// Whether the bytes at `image` begin with `magic`, read one at a time and stopping at the first that
/// differs, so a PTX string shorter than the magic is never read past its NUL (no magic byte is 0).
fn starts_with(image: *const u8, magic: &[u8]) -> bool {
    magic.iter().enumerate().all(|(i, m)| {
        // SAFETY: every byte before `i` matched a non-zero magic byte, so the image (a NUL-terminated
        // string at the shortest) holds byte `i`.
        unsafe { image.add(i).read() == *m }
    })
}

fn classify<'a>(image: *const c_void) -> Result<Image<'a>, CUresult> {
    if image.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let bytes = image.cast::<u8>();
    if BINARY_MAGICS.iter().any(|m| starts_with(bytes, m)) {
        return Ok(Image::Binary);
    }
    // SAFETY: not a binary, so by cuda.h PTX: "a NULL-terminated text string".
    let text = unsafe { std::ffi::CStr::from_ptr(image.cast::<c_char>()) };
    Ok(Image::Ptx(text.to_bytes()))
}

/// Live modules and link states by handle (pointer-looking numbers, never dereferenced).
struct Loaded {
    next: usize,
    modules: Vec<usize>,
    links: HashMap<usize, Link>,
}

/// A `cuLinkCreate` state: the image `cuLinkComplete` hands out lives as long as the state.
struct Link {
    inputs: usize,
    cubin: Vec<u8>,
}

static LOADED: Mutex<Option<Loaded>> = Mutex::new(None);

fn with_loaded<T>(f: impl FnOnce(&mut Loaded) -> T) -> T {
    let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    f(loaded.get_or_insert_with(|| Loaded {
        next: 0,
        modules: Vec::new(),
        links: HashMap::new(),
    }))
}

fn new_handle(loaded: &mut Loaded, base: usize) -> usize {
    loaded.next += 1;
    base + loaded.next * 0x10
}

fn module_load(module: *mut CUmodule, image: *const c_void) -> Result<(), CUresult> {
    if module.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // A module belongs to the current context.
    with_current(|_| Ok(()))?;
    match classify(image)? {
        Image::Binary => {}
        Image::Ptx(text) => jit_compile(&PTX_JIT, text)?,
    }
    let handle = with_loaded(|l| {
        let h = new_handle(l, 0x7e56_0000_0000);
        l.modules.push(h);
        h
    });
    put(module, handle as CUmodule)
}

/// A cubin or fatbin as it is; PTX through `libnvidia-ptxjitcompiler.so.1` ([`PTX_JIT`]):
/// `CUDA_ERROR_JIT_COMPILER_NOT_FOUND` (221) when the loader cannot find it, `CUDA_ERROR_INVALID_PTX`
/// (218) for text that is no PTX. Needs a current context (`CUDA_ERROR_INVALID_CONTEXT`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult {
    guard(|| module_load(module, image))
}

/// As [`cuModuleLoadData`]; the JIT options are accepted and ignored.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    module: *mut CUmodule,
    image: *const c_void,
    _num_options: c_uint,
    _options: *mut c_int,
    _option_values: *mut *mut c_void,
) -> CUresult {
    guard(|| module_load(module, image))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleUnload(module: CUmodule) -> CUresult {
    guard(|| {
        driver()?;
        with_loaded(|l| {
            let before = l.modules.len();
            l.modules.retain(|m| *m != module as usize);
            if l.modules.len() == before {
                Err(CUDA_ERROR_INVALID_HANDLE)
            } else {
                Ok(())
            }
        })
    })
}

/// `CUjitInputType`.
mod jit_input {
    pub const CUBIN: i32 = 0;
    pub const PTX: i32 = 1;
    pub const FATBINARY: i32 = 2;
    pub const OBJECT: i32 = 3;
    pub const LIBRARY: i32 = 4;
    pub const NVVM: i32 = 5;
}

fn link_create(state: *mut CUlinkState) -> Result<(), CUresult> {
    if state.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    with_current(|_| Ok(()))?;
    let handle = with_loaded(|l| {
        let h = new_handle(l, 0x7e57_0000_0000);
        l.links.insert(
            h,
            Link {
                inputs: 0,
                cubin: Vec::new(),
            },
        );
        h
    });
    put(state, handle as CUlinkState)
}

/// JIT options are accepted and ignored.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLinkCreate_v2(
    _num_options: c_uint,
    _options: *mut c_int,
    _option_values: *mut *mut c_void,
    state: *mut CUlinkState,
) -> CUresult {
    guard(|| link_create(state))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLinkCreate(
    num_options: c_uint,
    options: *mut c_int,
    option_values: *mut *mut c_void,
    state: *mut CUlinkState,
) -> CUresult {
    // SAFETY: the same contract.
    unsafe { cuLinkCreate_v2(num_options, options, option_values, state) }
}

fn link_add(state: CUlinkState, kind: c_int, data: *const c_void, size: usize) -> Result<(), CUresult> {
    driver()?;
    if data.is_null() || size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if !with_loaded(|l| l.links.contains_key(&(state as usize))) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    // SAFETY: `data` holds `size` bytes by CUDA's contract.
    let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), size) };
    // PTX's size may count its NUL.
    let text = bytes.strip_suffix(&[0]).unwrap_or(bytes);
    match kind {
        jit_input::PTX => jit_compile(&PTX_JIT, text)?,
        // NVVM compiles the IR to PTX, which the PTX JIT then compiles: both libraries are needed.
        jit_input::NVVM => {
            jit_compile(&NVVM, bytes)?;
            jit(&PTX_JIT)?;
        }
        jit_input::CUBIN | jit_input::FATBINARY | jit_input::OBJECT | jit_input::LIBRARY => {}
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    }
    with_loaded(|l| {
        if let Some(link) = l.links.get_mut(&(state as usize)) {
            link.inputs += 1;
        }
    });
    Ok(())
}

/// PTX through `libnvidia-ptxjitcompiler.so.1`, NVVM IR (`CU_JIT_INPUT_NVVM`) through
/// `libnvidia-nvvm.so.4` and then the PTX JIT; either missing: `CUDA_ERROR_JIT_COMPILER_NOT_FOUND`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLinkAddData_v2(
    state: CUlinkState,
    kind: c_int,
    data: *mut c_void,
    size: usize,
    _name: *const c_char,
    _num_options: c_uint,
    _options: *mut c_int,
    _option_values: *mut *mut c_void,
) -> CUresult {
    guard(|| link_add(state, kind, data, size))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLinkAddData(
    state: CUlinkState,
    kind: c_int,
    data: *mut c_void,
    size: usize,
    name: *const c_char,
    num_options: c_uint,
    options: *mut c_int,
    option_values: *mut *mut c_void,
) -> CUresult {
    // SAFETY: the same contract.
    unsafe { cuLinkAddData_v2(state, kind, data, size, name, num_options, options, option_values) }
}

/// The linked image: an ELF header only (nothing runs on a simulated GPU), which `cuModuleLoadData`
/// takes as a cubin; it lives until `cuLinkDestroy`. Nothing added: `CUDA_ERROR_INVALID_VALUE`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLinkComplete(
    state: CUlinkState,
    cubin: *mut *mut c_void,
    size: *mut usize,
) -> CUresult {
    guard(|| {
        driver()?;
        if cubin.is_null() || size.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (ptr, len) = with_loaded(|l| {
            let link = l
                .links
                .get_mut(&(state as usize))
                .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            if link.inputs == 0 {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            link.cubin = b"\x7fELF\x02\x01\x01\x33".to_vec();
            Ok((link.cubin.as_mut_ptr(), link.cubin.len()))
        })?;
        put(cubin, ptr.cast::<c_void>())?;
        put(size, len)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLinkDestroy(state: CUlinkState) -> CUresult {
    guard(|| {
        driver()?;
        with_loaded(|l| l.links.remove(&(state as usize)))
            .map(|_| ())
            .ok_or(CUDA_ERROR_INVALID_HANDLE)
    })
}

// === Errors ===

fn error_text(
    code: CUresult,
    pick: fn(&(CUresult, &'static str, &'static str)) -> &'static str,
    out: *mut *const c_char,
) -> Result<(), CUresult> {
    match ERRORS.iter().find(|e| e.0 == code) {
        Some(e) => put(out, pick(e).as_ptr().cast()),
        None => {
            put(out, std::ptr::null())?;
            Err(CUDA_ERROR_INVALID_VALUE)
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, name: *mut *const c_char) -> CUresult {
    guard(|| error_text(error, |e| e.1, name))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, text: *mut *const c_char) -> CUresult {
    guard(|| error_text(error, |e| e.2, text))
}

// === tessera's own export ===

/// Not CUDA: the pid of the MPS server serving context `ctx` (`CUDA_ERROR_NOT_SUPPORTED` for a direct
/// context), so a probe can show which server it is attached to.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tesseraSimCtxGetMpsServerPid(ctx: CUcontext, pid: *mut c_int) -> CUresult {
    guard(|| {
        driver()?;
        let contexts = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
        let c = contexts
            .1
            .as_ref()
            .and_then(|m| m.get(&(ctx as usize)))
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        let server = c.mps.as_ref().ok_or(CUDA_ERROR_NOT_SUPPORTED)?.server_pid;
        drop(contexts);
        put(pid, server as c_int)
    })
}

/// Not CUDA: the part of the GPU's SMs (0–1) the kernels of MPS context `ctx` get while it is busy, beside
/// the other busy MPS clients of its GPU (the synthetic load, `simulate load --mps-client`), and how many
/// busy clients that is, itself included (`tessera_sim_model::contention`). A real driver has no such
/// call; a probe reads it to show its ceiling alone and its contention beside busy neighbours. The
/// context's device and claim are those tessera's CDI spec names in `TESSERA_DEVICE` and `TESSERA_CLAIM`;
/// without `TESSERA_DEVICE` no neighbour is known. `CUDA_ERROR_NOT_SUPPORTED` for a direct context.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tesseraSimCtxGetSmShare(
    ctx: CUcontext,
    share: *mut f64,
    busy_clients: *mut c_int,
) -> CUresult {
    guard(|| {
        let d = driver()?;
        let contexts = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
        let c = contexts
            .1
            .as_ref()
            .and_then(|m| m.get(&(ctx as usize)))
            .ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        let limit = c
            .mps
            .as_ref()
            .ok_or(CUDA_ERROR_NOT_SUPPORTED)?
            .active_thread_percentage;
        drop(contexts);
        let device = std::env::var("TESSERA_DEVICE").unwrap_or_default();
        let claim = std::env::var("TESSERA_CLAIM").ok();
        let seen = tessera_sim_model::contention::context_share(
            d.kernel.kernel_dir(),
            &device,
            claim.as_deref(),
            limit,
        )
        .map_err(|e| {
            debug(&format!("cannot read the synthetic load: {e}"));
            CUDA_ERROR_UNKNOWN
        })?;
        put(share, seen.share)?;
        put(busy_clients, seen.busy_clients as c_int)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(uuid: &str, gpu_uuid: &str, gpu: u32) -> Device {
        Device {
            uuid: uuid.into(),
            gpu_uuid: gpu_uuid.into(),
            gpu,
            name: String::new(),
            memory_bytes: 0,
            multiprocessors: 0,
            compute_capability: (9, 0),
            pci: (0, 0, 0),
            pci_bus_id: String::new(),
        }
    }

    fn uuids(devices: &[Device]) -> Vec<&str> {
        devices.iter().map(|d| d.uuid.as_str()).collect()
    }

    #[test]
    fn cuda_visible_devices_narrows_orders_and_stops_at_the_first_bad_entry() {
        let all = vec![
            dev("GPU-aaaa1111", "GPU-aaaa1111", 0),
            dev("MIG-bbbb", "GPU-cccc2222", 1),
            dev("MIG-dddd", "GPU-cccc2222", 1),
        ];
        assert_eq!(uuids(&narrow(all.clone(), None)).len(), 3);
        assert_eq!(uuids(&narrow(all.clone(), Some(""))), Vec::<&str>::new());
        assert_eq!(
            uuids(&narrow(all.clone(), Some("2,0"))),
            ["MIG-dddd", "GPU-aaaa1111"]
        );
        assert_eq!(uuids(&narrow(all.clone(), Some("MIG-bb"))), ["MIG-bbbb"]);
        assert_eq!(
            uuids(&narrow(all.clone(), Some("GPU-cccc"))),
            ["MIG-bbbb", "MIG-dddd"]
        );
        assert_eq!(uuids(&narrow(all.clone(), Some("0,7,1"))), ["GPU-aaaa1111"]);
        assert_eq!(uuids(&narrow(all.clone(), Some("GPU-,0"))), Vec::<&str>::new());
        assert_eq!(uuids(&narrow(all, Some("0,0,GPU-aaaa"))), ["GPU-aaaa1111"]);
    }

    #[test]
    fn uuids_become_their_sixteen_bytes() {
        let b = uuid_bytes("GPU-00112233-4455-6677-8899-aabbccddeeff").unwrap();
        assert_eq!(b[0], 0x00);
        assert_eq!(b[15], 0xff);
        assert!(uuid_bytes("MIG-0011").is_none());
        assert!(uuid_bytes("00112233-4455-6677-8899-aabbccddeeff").is_none());
    }

    #[test]
    fn error_names_and_strings_are_cudas() {
        let mut p: *const c_char = std::ptr::null();
        assert_eq!(unsafe { cuGetErrorName(46, &mut p) }, CUDA_SUCCESS);
        let s = unsafe { std::ffi::CStr::from_ptr(p) };
        assert_eq!(s.to_str().unwrap(), "CUDA_ERROR_DEVICES_UNAVAILABLE");
        assert_eq!(
            unsafe { cuGetErrorString(12345, &mut p) },
            CUDA_ERROR_INVALID_VALUE
        );
        assert!(p.is_null());
    }

    #[test]
    fn images_are_told_apart_by_their_magic_and_short_ptx_is_not_read_past_its_nul() {
        assert!(matches!(
            classify(b"\x7fELF\x02".as_ptr().cast()),
            Ok(Image::Binary)
        ));
        assert!(matches!(
            classify([0x50u8, 0xed, 0x55, 0xba, 1].as_ptr().cast()),
            Ok(Image::Binary)
        ));
        // One byte and its NUL: the ELF check stops at the first byte that differs.
        match classify(c"\x7f".as_ptr().cast()) {
            Ok(Image::Ptx(text)) => assert_eq!(text, b"\x7f"),
            _ => panic!("a one-byte string is text"),
        }
        match classify(c".version 7.0".as_ptr().cast()) {
            Ok(Image::Ptx(text)) => assert_eq!(text, b".version 7.0"),
            _ => panic!("PTX is text"),
        }
        assert!(matches!(
            classify(std::ptr::null()),
            Err(CUDA_ERROR_INVALID_VALUE)
        ));
    }

    #[test]
    fn a_missing_jit_library_is_jit_compiler_not_found() {
        let absent = JitLibrary {
            soname: c"libtessera-no-such-jit.so.1",
            entry: c"tesseraSimPtxJitCompile",
        };
        assert_eq!(jit(&absent).err(), Some(CUDA_ERROR_JIT_COMPILER_NOT_FOUND));
        let mut p: *const c_char = std::ptr::null();
        assert_eq!(unsafe { cuGetErrorName(221, &mut p) }, CUDA_SUCCESS);
        let s = unsafe { std::ffi::CStr::from_ptr(p) };
        assert_eq!(s.to_str().unwrap(), "CUDA_ERROR_JIT_COMPILER_NOT_FOUND");
    }

    #[test]
    fn calls_before_cuinit_say_not_initialized() {
        let mut n = 0;
        assert_eq!(unsafe { cuDeviceGetCount(&mut n) }, CUDA_ERROR_NOT_INITIALIZED);
        let mut v = 0;
        assert_eq!(unsafe { cuDriverGetVersion(&mut v) }, CUDA_SUCCESS);
        assert_eq!(v, 13000);
    }
}
