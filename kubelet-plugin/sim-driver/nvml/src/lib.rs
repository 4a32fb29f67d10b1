//! `libnvidia-ml.so.1` for the simulated driver root: NVML's C ABI over tessera's one hardware model,
//! [`SimulatedBackend`].
//!
//! ```text
//!  nvml-wrapper / nvidia-smi / a CUDA probe
//!        │ dlopen("…/libnvidia-ml.so.1"), nvmlInit_v2, nvmlDevice…
//!        ▼
//!  this library ── finds K: <dir>/tessera-sim/kernel.json above its own path (or $TESSERA_SIM_KERNEL)
//!        │ SimulatedBackend::open_kernel(K)   (read-only where K is mounted read-only)
//!        ▼
//!  K/simulated-gpus.json, simulated-health.json, proc/   (shared with the plugin and every other process)
//! ```
//!
//! Each function marshals its arguments, asks the model, and answers with NVML's return code and struct
//! layout (the structs are nvml-wrapper-sys's bindings, so the layouts are `nvml.h`'s). No state of its
//! own beyond what a process's NVML keeps: the GPUs visible at `nvmlInit` (see [`DeviceView`]), the
//! event sets, and the session that holds the GPUs open (`tessera_sim_model::sessions`). Handles are
//! opaque numbers naming (GPU, GPU instance, compute instance) and the instance's generation, never
//! pointers to memory: a handle whose instance was destroyed answers INVALID_ARGUMENT, even once another
//! instance has its ids (see [`Handle`]). A panic never crosses the C boundary: every export runs under
//! `catch_unwind` and answers NVML_ERROR_UNKNOWN instead.
//!
//! Where this library differs from NVIDIA's is listed in the plugin README (section "The simulated
//! driver root").
#![allow(
    unsafe_code,
    reason = "a C ABI: every export reads and writes caller-owned memory through raw pointers"
)]

mod events;
mod mig;
mod test_profiles;

use std::{
    ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void},
    mem,
    panic::{AssertUnwindSafe, catch_unwind},
    path::{Path, PathBuf},
    ptr,
    sync::{Arc, Mutex},
};

use nvml_wrapper_sys::bindings::{
    nvmlBrandType_t, nvmlComputeMode_t, nvmlDevice_t, nvmlDeviceArchitecture_t, nvmlDeviceAttributes_t,
    nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t, nvmlGpuFabricInfo_v3_t, nvmlGpuVirtualizationMode_t,
    nvmlMemory_t, nvmlMemory_v2_t, nvmlPciInfo_t, nvmlProcessInfo_t, nvmlProcessInfo_v1_t,
    nvmlProcessUtilizationSample_t, nvmlReturn_t, nvmlUtilization_t,
};
use tessera_gpu_api::models::{Architecture, GpuModel};
use tessera_gpu_api::usage::{ProcessUsage, UsageQuery};
use tessera_gpu_api::{ComputeMode, GpuBackend, GpuError, TimeSlice};
use tessera_sim_model::backend::{
    DeviceView, FabricReport, MigDevice, SimulatedBackend, SimulatedFault, SimulatedGpu, locate_kernel,
};
use tessera_sim_model::kernel::{
    SIMULATED_CUDA_DRIVER_VERSION, kernel_driver_version, library_driver_version, mapped_inode,
};
use tessera_sim_model::load;
use tessera_sim_model::sessions::{NVML_INIT_FLAG_NO_ATTACH, Session};

// === NVML return codes (nvml.h) ===

pub(crate) type Ret = nvmlReturn_t;
pub(crate) const SUCCESS: Ret = 0;
pub(crate) const UNINITIALIZED: Ret = 1;
pub(crate) const INVALID_ARGUMENT: Ret = 2;
pub(crate) const NOT_SUPPORTED: Ret = 3;
pub(crate) const NO_PERMISSION: Ret = 4;
pub(crate) const NOT_FOUND: Ret = 6;
pub(crate) const INSUFFICIENT_SIZE: Ret = 7;
pub(crate) const DRIVER_NOT_LOADED: Ret = 9;
pub(crate) const TIMEOUT: Ret = 10;
pub(crate) const GPU_IS_LOST: Ret = 15;
pub(crate) const RESET_REQUIRED: Ret = 16;
pub(crate) const LIB_RM_VERSION_MISMATCH: Ret = 18;
pub(crate) const IN_USE: Ret = 19;
pub(crate) const INSUFFICIENT_RESOURCES: Ret = 23;
pub(crate) const ARGUMENT_VERSION_MISMATCH: Ret = 25;
pub(crate) const UNKNOWN: Ret = 999;

/// `NVML_VALUE_NOT_AVAILABLE` for a process's used memory: the model tracks no per-process memory.
const VALUE_NOT_AVAILABLE: c_ulonglong = c_ulonglong::MAX;
/// `gpuInstanceId` / `computeInstanceId` of something not on a MIG device.
pub(crate) const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

pub(crate) type R<T = ()> = Result<T, Ret>;

/// Runs one export: its error code, or UNKNOWN if it panicked (a panic must not unwind into C).
pub(crate) fn ffi(f: impl FnOnce() -> R) -> Ret {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(code)) => code,
        Err(_) => UNKNOWN,
    }
}

/// The NVML return code of a model error: the model keeps NVML's meanings (see `GpuError`).
pub(crate) fn code(e: &GpuError) -> Ret {
    match e {
        GpuError::InvalidArgument(_) => INVALID_ARGUMENT,
        GpuError::NotSupported(_) => NOT_SUPPORTED,
        GpuError::NoPermission(_) => NO_PERMISSION,
        GpuError::NotFound(_) => NOT_FOUND,
        GpuError::InUse(_) => IN_USE,
        GpuError::InsufficientResources(_) => INSUFFICIENT_RESOURCES,
        GpuError::ResetRequired(_) => RESET_REQUIRED,
        GpuError::GpuLost(_) => GPU_IS_LOST,
        GpuError::Nvml { code, .. } => *code,
        _ => UNKNOWN,
    }
}

pub(crate) fn model_err(e: GpuError) -> Ret {
    code(&e)
}

// === Handles ===

/// What an opaque handle names. Encoded in the pointer's bits: ids in bits 0..40, the tag in bits 40..44,
/// and for GPU-instance, compute-instance and MIG device handles the instance's *generation* in bits
/// 44..63: its creation serial in the model ([`SimulatedBackend::instance_serial`]), truncated. NVIDIA's
/// handles are pointers to the driver's objects, which die with the instance; a generation makes ours die
/// too, so a handle kept across a destroy answers INVALID_ARGUMENT even after an instance with the same
/// ids was created (`nvml.h`, e.g. `nvmlGpuInstanceGetInfo`: "NVML_ERROR_INVALID_ARGUMENT If
/// \a gpuInstance or \a info are invalid").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Handle {
    Gpu(u32),
    Mig {
        gpu: u32,
        gi: u32,
        ci: u32,
        generation: u32,
    },
    GpuInstance {
        gpu: u32,
        gi: u32,
        generation: u32,
    },
    ComputeInstance {
        gpu: u32,
        gi: u32,
        ci: u32,
        generation: u32,
    },
    EventSet(u32),
}

const TAG_SHIFT: u32 = 40;
const GENERATION_SHIFT: u32 = 44;
const NONE_ID: usize = 0xFF;

/// The generation a handle carries for an instance of creation serial `serial`.
pub(crate) fn generation(serial: u64) -> u32 {
    (serial & ((1 << (63 - GENERATION_SHIFT)) - 1)) as u32
}

impl Handle {
    /// The device handle of MIG device `m` of GPU `gpu`.
    pub(crate) fn of_mig(gpu: u32, m: &MigDevice) -> Self {
        Self::Mig {
            gpu,
            gi: m.gpu_instance,
            ci: m.compute_instance,
            generation: generation(m.serial),
        }
    }

    pub(crate) fn encode<T>(self) -> *mut T {
        let (tag, a, b, c, g) = match self {
            Self::Gpu(gpu) => (1, gpu as usize, NONE_ID, NONE_ID, 0),
            Self::Mig {
                gpu,
                gi,
                ci,
                generation,
            } => (1, gpu as usize, gi as usize, ci as usize, generation),
            Self::GpuInstance { gpu, gi, generation } => (2, gpu as usize, gi as usize, NONE_ID, generation),
            Self::ComputeInstance {
                gpu,
                gi,
                ci,
                generation,
            } => (3, gpu as usize, gi as usize, ci as usize, generation),
            Self::EventSet(id) => (4, id as usize, NONE_ID, NONE_ID, 0),
        };
        ptr::without_provenance_mut(
            ((g as usize) << GENERATION_SHIFT) | (tag << TAG_SHIFT) | (a << 16) | (b << 8) | c,
        )
    }

    pub(crate) fn decode<T>(p: *mut T) -> Option<Self> {
        let v = p.addr();
        let generation = (v >> GENERATION_SHIFT) as u32;
        let (tag, a, b, c) = (
            (v >> TAG_SHIFT) & 0xF,
            (v >> 16) & 0xFF_FFFF,
            (v >> 8) & 0xFF,
            v & 0xFF,
        );
        let (a, bi, ci) = (a as u32, b as u32, c as u32);
        if generation != self::generation(u64::from(generation)) {
            return None;
        }
        match (tag, b, c) {
            (1, NONE_ID, NONE_ID) if generation == 0 => Some(Self::Gpu(a)),
            (1, _, _) if b != NONE_ID && c != NONE_ID => Some(Self::Mig {
                gpu: a,
                gi: bi,
                ci,
                generation,
            }),
            (2, _, NONE_ID) if b != NONE_ID => Some(Self::GpuInstance {
                gpu: a,
                gi: bi,
                generation,
            }),
            (3, _, _) if b != NONE_ID && c != NONE_ID => Some(Self::ComputeInstance {
                gpu: a,
                gi: bi,
                ci,
                generation,
            }),
            (4, NONE_ID, NONE_ID) if generation == 0 => Some(Self::EventSet(a)),
            _ => None,
        }
    }
}

// === The library's state ===

/// What one `nvmlInit` (until the matching `nvmlShutdown`) holds.
pub(crate) struct Lib {
    pub(crate) sim: SimulatedBackend,
    pub(crate) view: DeviceView,
    /// Kernel indices of the GPUs this process sees; the NVML index is the position here.
    pub(crate) visible: Vec<u32>,
    pub(crate) events: events::EventSets,
    /// This process's hold on the GPUs it attached, which makes another process's MIG toggle IN_USE
    /// (`tessera_sim_model::sessions`); released by the last `nvmlShutdown`, or by the kernel when the
    /// process exits. `None` where it attached none or the kernel directory is read-only here.
    _session: Option<Session>,
}

struct Global {
    init_count: u32,
    lib: Option<Arc<Lib>>,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global {
    init_count: 0,
    lib: None,
});

fn global() -> std::sync::MutexGuard<'static, Global> {
    GLOBAL.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn lib() -> R<Arc<Lib>> {
    global().lib.clone().ok_or(UNINITIALIZED)
}

/// Path of this library file, from the dynamic loader.
fn own_path() -> Option<PathBuf> {
    // SAFETY: dladdr only reads the address and fills `info`, whose strings belong to the loader.
    unsafe {
        let mut info: libc::Dl_info = mem::zeroed();
        let addr = nvmlInit_v2 as *const c_void;
        if libc::dladdr(addr, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let name = CStr::from_ptr(info.dli_fname).to_str().ok()?;
        Some(PathBuf::from(name))
    }
}

/// The driver version of this library file, fixed at its first use (see `library_driver_version`): the
/// version `nvmlSystemGetDriverVersion` reports, which a plugin names in its CDI specs.
fn own_version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| {
        let own = own_path().unwrap_or_default();
        library_driver_version(
            &own,
            mapped_inode(nvmlInit_v2 as *const c_void as usize),
            "libnvidia-ml",
        )
    })
}

fn init(flags: c_uint) -> R {
    let mut g = global();
    if g.init_count > 0 {
        g.init_count += 1;
        return Ok(());
    }
    let kernel = own_path()
        .and_then(|p| locate_kernel(&p))
        .ok_or(DRIVER_NOT_LOADED)?;
    // As NVIDIA's: a library of another driver version than the loaded kernel module refuses to start
    // ("Driver/library version mismatch"), which is what a container keeps after a driver upgrade.
    if kernel_driver_version(&kernel).is_some_and(|k| k != own_version()) {
        return Err(LIB_RM_VERSION_MISMATCH);
    }
    let sim = SimulatedBackend::open_kernel(&kernel).map_err(|e| match e {
        GpuError::SimulatedState { .. } if !kernel.exists() => DRIVER_NOT_LOADED,
        _ => UNKNOWN,
    })?;
    let view = DeviceView::of_this_process();
    let visible = sim.visible_gpus(&view);
    // NVML attaches every GPU it sees at init unless told not to; an attached GPU is held open until
    // shutdown, which is what keeps a MIG mode change of another process pending.
    let session = (flags & NVML_INIT_FLAG_NO_ATTACH == 0)
        .then(|| Session::open(&kernel, &visible).ok())
        .flatten();
    g.lib = Some(Arc::new(Lib {
        sim,
        view,
        visible,
        events: events::EventSets::default(),
        _session: session,
    }));
    g.init_count = 1;
    Ok(())
}

/// A device handle resolved: the GPU's kernel index and, for a MIG device handle, the MIG device.
pub(crate) struct Dev {
    pub(crate) gpu: u32,
    pub(crate) mig: Option<MigDevice>,
}

impl Lib {
    /// Resolves a device handle to a GPU this process sees, or fails with the GPU's fault code.
    pub(crate) fn dev(&self, device: nvmlDevice_t) -> R<Dev> {
        self.resolve(device, false)
    }

    /// [`Lib::dev`] for the calls a lost GPU still answers from the driver's cache (see
    /// [`nvmlDeviceGetUUID`]): a GPU that fell off the bus resolves; the other faults still fail.
    pub(crate) fn dev_cached(&self, device: nvmlDevice_t) -> R<Dev> {
        self.resolve(device, true)
    }

    fn resolve(&self, device: nvmlDevice_t, lost_answers: bool) -> R<Dev> {
        let (gpu, mig) = match Handle::decode(device) {
            Some(Handle::Gpu(g)) => (g, None),
            Some(Handle::Mig {
                gpu,
                gi,
                ci,
                generation,
            }) => (gpu, Some((gi, ci, generation))),
            _ => return Err(INVALID_ARGUMENT),
        };
        if !self.visible.contains(&gpu) {
            return Err(INVALID_ARGUMENT);
        }
        match self.sim.failing_code(gpu) {
            Some(GPU_IS_LOST) if lost_answers => {}
            Some(code) => return Err(code),
            None => {}
        }
        let mig = match mig {
            None => None,
            Some((gi, ci, g)) => {
                let m = self.mig_device(gpu, gi, ci)?;
                // A MIG device handle of an instance destroyed since: another one may have the same ids.
                if generation(m.serial) != g {
                    return Err(INVALID_ARGUMENT);
                }
                Some(m)
            }
        };
        Ok(Dev { gpu, mig })
    }

    /// A whole-GPU handle (MIG device handles are refused with INVALID_ARGUMENT).
    pub(crate) fn gpu(&self, device: nvmlDevice_t) -> R<u32> {
        let d = self.dev(device)?;
        if d.mig.is_some() {
            return Err(INVALID_ARGUMENT);
        }
        Ok(d.gpu)
    }

    /// [`Lib::gpu`] for calls NVML answers NOT_SUPPORTED rather than INVALID_ARGUMENT when given a MIG
    /// device handle (or anything else that is not a whole GPU): compute mode, minor number, events…
    pub(crate) fn gpu_or_not_supported(&self, device: nvmlDevice_t) -> R<u32> {
        self.gpu(device)
            .map_err(|e| if e == INVALID_ARGUMENT { NOT_SUPPORTED } else { e })
    }

    /// The model's record of GPU `gpu`.
    pub(crate) fn info(&self, gpu: u32) -> R<SimulatedGpu> {
        self.sim.gpu(gpu).map_err(model_err)
    }

    pub(crate) fn mig_device(&self, gpu: u32, gi: u32, ci: u32) -> R<MigDevice> {
        self.sim
            .mig_devices(gpu, &self.view)
            .map_err(model_err)?
            .into_iter()
            .find(|m| m.gpu_instance == gi && m.compute_instance == ci)
            .ok_or(INVALID_ARGUMENT)
    }

    pub(crate) fn model(&self, gpu: u32) -> R<&'static GpuModel> {
        Ok(self.info(gpu)?.model)
    }

    fn handle_of_index(&self, index: u32) -> R<nvmlDevice_t> {
        let gpu = *self.visible.get(index as usize).ok_or(INVALID_ARGUMENT)?;
        let g = self.info(gpu)?;
        if g.node_fault == Some(SimulatedFault::Lost) {
            return Err(GPU_IS_LOST);
        }
        if let Some(code) = self.sim.failing_code(gpu) {
            return Err(code);
        }
        Ok(Handle::Gpu(gpu).encode())
    }
}

// === Out-parameters ===

/// Where an export's one answer goes: a caller's out-parameter, whose null check waits until the answer
/// is written (NVML reports a bad handle or a model error first).
pub(crate) trait OutParam {
    type Value;
    fn put(self, v: Self::Value) -> R;
}

/// A caller's `T *` out-parameter. Holding one is the promise that it is null or writable, made once
/// in [`Out::new`] so that the code computing the answer needs no `unsafe`.
pub(crate) struct Out<T>(*mut T);

impl<T> Out<T> {
    /// # Safety
    /// `p` is null or valid for a write of `T` until the export returns.
    pub(crate) unsafe fn new(p: *mut T) -> Self {
        Self(p)
    }
}

impl<T> OutParam for Out<T> {
    type Value = T;
    fn put(self, v: T) -> R {
        // SAFETY: promised in `Out::new`.
        unsafe { out(self.0, v) }
    }
}

/// A caller's `char *` buffer of `len` bytes, filled as [`out_str`] does (INSUFFICIENT_SIZE if too small).
pub(crate) struct OutStr {
    buf: *mut c_char,
    len: c_uint,
}

impl OutStr {
    /// # Safety
    /// `buf` is null or valid for `len` bytes until the export returns.
    pub(crate) unsafe fn new(buf: *mut c_char, len: c_uint) -> Self {
        Self { buf, len }
    }
}

impl OutParam for OutStr {
    type Value = String;
    fn put(self, s: String) -> R {
        // SAFETY: promised in `OutStr::new`.
        unsafe { out_str(self.buf, self.len, &s) }
    }
}

/// Runs an export that answers one value: `f` resolves its handle and asks the model, and the value goes
/// to `dst`. The checks keep NVML's order — UNINITIALIZED, then whatever `f` fails with (a bad or
/// faulted handle, a model error), a null `dst` only after those — and the whole runs under [`ffi`], so
/// a panic in `f` answers UNKNOWN.
pub(crate) fn answer<O: OutParam>(dst: O, f: impl FnOnce(&Lib) -> R<O::Value>) -> Ret {
    ffi(|| dst.put(f(&*lib()?)?))
}

/// Writes `v` to a caller's out-parameter.
///
/// # Safety
/// `p` is null or valid for a write of `T`.
pub(crate) unsafe fn out<T>(p: *mut T, v: T) -> R {
    if p.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and valid by the caller's contract.
    unsafe { p.write(v) };
    Ok(())
}

/// A caller's NUL-terminated string argument; null or not UTF-8 is INVALID_ARGUMENT.
///
/// # Safety
/// `p` is null or a NUL-terminated string that outlives the export.
pub(crate) unsafe fn in_str<'a>(p: *const c_char) -> R<&'a str> {
    if p.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null, and a C string by the caller's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| INVALID_ARGUMENT)
}

/// Copies `s` NUL-terminated into a caller's buffer of `len` bytes.
///
/// # Safety
/// `buf` is null or valid for `len` bytes.
pub(crate) unsafe fn out_str(buf: *mut c_char, len: c_uint, s: &str) -> R {
    if buf.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    if s.len() + 1 > len as usize {
        return Err(INSUFFICIENT_SIZE);
    }
    // SAFETY: the buffer holds `len` > s.len() bytes.
    unsafe {
        ptr::copy_nonoverlapping(s.as_ptr().cast::<c_char>(), buf, s.len());
        buf.add(s.len()).write(0);
    }
    Ok(())
}

/// Copies `s` into a fixed C array, NUL-terminated and cut to fit.
pub(crate) fn fill_c<const N: usize>(dst: &mut [c_char; N], s: &str) {
    for (d, b) in dst
        .iter_mut()
        .zip(s.bytes().take(N - 1).chain(std::iter::once(0)))
    {
        *d = b as c_char;
    }
}

/// Fills a caller's array of `*count` entries with `items` (NVML's two-call pattern): with too small a
/// buffer (or none), `*count` is set to the number needed and INSUFFICIENT_SIZE returned.
///
/// # Safety
/// `count` is null or valid; `buf` is null or valid for `*count` entries.
pub(crate) unsafe fn out_array<T>(buf: *mut T, count: *mut c_uint, items: Vec<T>) -> R {
    if count.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null count, valid by contract.
    let capacity = unsafe { *count } as usize;
    let n = items.len();
    // SAFETY: as above.
    unsafe { *count = n as c_uint };
    if n == 0 {
        return Ok(());
    }
    if buf.is_null() || capacity < n {
        return Err(INSUFFICIENT_SIZE);
    }
    for (i, item) in items.into_iter().enumerate() {
        // SAFETY: i < n <= capacity entries of the caller's buffer.
        unsafe { buf.add(i).write(item) };
    }
    Ok(())
}

/// [`out_array`] for the calls where a null buffer asks only for the count: `*count` is set and the
/// answer is SUCCESS, not INSUFFICIENT_SIZE (`nvmlDeviceGetGpuInstancePossiblePlacements_v2` does so).
///
/// # Safety
/// As [`out_array`].
pub(crate) unsafe fn out_array_or_count<T>(buf: *mut T, count: *mut c_uint, items: Vec<T>) -> R {
    if buf.is_null() {
        // SAFETY: by the caller's contract.
        return unsafe { out(count, items.len() as c_uint) };
    }
    // SAFETY: by the caller's contract.
    unsafe { out_array(buf, count, items) }
}

/// Writes `items` to a caller's array whose size NVML fixes by contract rather than by `*count` (the
/// GPU- and compute-instance lists: the buffer holds the profile's instance count), and sets `*count`.
/// A null `count`, or a null buffer with something to write, is INVALID_ARGUMENT.
///
/// # Safety
/// `count` is null or valid; `buf` is null or valid for `items.len()` entries.
pub(crate) unsafe fn out_fixed_array<T>(buf: *mut T, count: *mut c_uint, items: Vec<T>) -> R {
    if count.is_null() || (buf.is_null() && !items.is_empty()) {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: `count` is non-null, and the buffer holds `items.len()` entries, by the caller's contract.
    unsafe {
        *count = items.len() as c_uint;
        for (i, item) in items.into_iter().enumerate() {
            buf.add(i).write(item);
        }
    }
    Ok(())
}

/// `NVML_STRUCT_VERSION(T, v)`.
pub(crate) const fn struct_version<T>(version: u32) -> c_uint {
    (mem::size_of::<T>() as u32) | (version << 24)
}

/// The `version` field of a caller's versioned struct (INVALID_ARGUMENT for a null one). The caller may
/// have passed any version of the struct, so only this field is read: it leads every version.
///
/// # Safety
/// `p` is null or valid for a read of the struct's first field.
pub(crate) unsafe fn version_of<T>(p: *const T) -> R<c_uint> {
    if p.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: non-null and valid by the caller's contract; every versioned struct in `nvml.h` starts
    // with `unsigned int version`, so its first four bytes are that field whichever version it is.
    Ok(unsafe { p.cast::<c_uint>().read() })
}

/// [`version_of`], refused with ARGUMENT_VERSION_MISMATCH unless it is one of `accepted`.
///
/// # Safety
/// As [`version_of`].
pub(crate) unsafe fn accepted_version<T>(p: *const T, accepted: &[c_uint]) -> R<c_uint> {
    // SAFETY: by the caller's contract.
    let version = unsafe { version_of(p) }?;
    if accepted.contains(&version) {
        Ok(version)
    } else {
        Err(ARGUMENT_VERSION_MISMATCH)
    }
}

// === Init, shutdown, system queries ===

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    ffi(|| init(0))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> nvmlReturn_t {
    ffi(|| init(0))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(flags: c_uint) -> nvmlReturn_t {
    ffi(|| init(flags))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    ffi(|| {
        let mut g = global();
        match g.init_count {
            0 => Err(UNINITIALIZED),
            1 => {
                g.init_count = 0;
                g.lib = None;
                Ok(())
            }
            _ => {
                g.init_count -= 1;
                Ok(())
            }
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let s: &'static CStr = match result {
        SUCCESS => c"Success",
        UNINITIALIZED => c"Uninitialized",
        INVALID_ARGUMENT => c"Invalid Argument",
        NOT_SUPPORTED => c"Not Supported",
        NO_PERMISSION => c"Insufficient Permissions",
        NOT_FOUND => c"Not Found",
        INSUFFICIENT_SIZE => c"Insufficient Size",
        DRIVER_NOT_LOADED => c"Driver Not Loaded",
        TIMEOUT => c"Timeout",
        GPU_IS_LOST => c"GPU is lost",
        RESET_REQUIRED => c"GPU requires reset",
        LIB_RM_VERSION_MISMATCH => c"RM has detected an NVML/RM version mismatch.",
        IN_USE => c"In use by another client",
        INSUFFICIENT_RESOURCES => c"Insufficient resources",
        ARGUMENT_VERSION_MISMATCH => c"Version mismatch between the argument and the API",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

/// # Safety
/// `version` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let version = unsafe { OutStr::new(version, length) };
    answer(version, |_| Ok(own_version().to_string()))
}

/// # Safety
/// `version` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    ffi(|| {
        // NVML's version is the CUDA major before the driver version, e.g. 13.580.159.03.
        let major = SIMULATED_CUDA_DRIVER_VERSION.split('.').next().unwrap_or("13");
        // SAFETY: by the caller's contract.
        unsafe { out_str(version, length, &format!("{major}.{}", own_version())) }
    })
}

fn cuda_version() -> c_int {
    let mut parts = SIMULATED_CUDA_DRIVER_VERSION.split('.');
    let major: c_int = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let minor: c_int = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    major * 1000 + minor * 10
}

/// # Safety
/// `version` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    ffi(|| unsafe { out(version, cuda_version()) })
}

/// # Safety
/// `version` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    ffi(|| unsafe { out(version, cuda_version()) })
}

/// A synthetic MPS server of the load is `nvidia-cuda-mps-server`; then named processes of the node file
/// (DCGM's `nv-hostengine`), else the host's `/proc/<pid>/comm`.
///
/// # Safety
/// `name` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetProcessName(
    pid: c_uint,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let name = unsafe { OutStr::new(name, length) };
    answer(name, |lib| {
        let synthetic_server = load::is_synthetic_mps_server(pid).then(|| load::MPS_SERVER_NAME.to_string());
        let found = synthetic_server
            .or_else(|| lib.sim.process_name(pid))
            .or_else(|| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .ok()
                    .map(|s| s.trim_end().to_string())
            });
        let found = found.ok_or(NOT_FOUND)?;
        // NVML crops the name to the buffer rather than failing.
        Ok(found.chars().take((length as usize).saturating_sub(1)).collect())
    })
}

// === Device handles ===

/// # Safety
/// `count` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let count = unsafe { Out::new(count) };
    answer(count, |lib| Ok(lib.visible.len() as c_uint))
}

/// # Safety
/// `count` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(count: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetCount_v2(count) }
}

/// # Safety
/// `device` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let device = unsafe { Out::new(device) };
    answer(device, |lib| lib.handle_of_index(index))
}

/// # Safety
/// `device` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetHandleByIndex_v2(index, device) }
}

/// Callers inside [`nvmlDeviceGetHandleByUUID`] at this moment, in this process.
static LOOKUPS_IN_FLIGHT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One caller inside [`nvmlDeviceGetHandleByUUID`]: entering costs `per_caller_ms` times the callers
/// inside at that moment (this one included), as NVIDIA's DRA driver found the real call slow when done
/// concurrently (see `Latencies::handle_by_uuid_ms`).
struct LookupCost;

impl LookupCost {
    fn enter(per_caller_ms: u64) -> Self {
        use std::sync::atomic::Ordering::SeqCst;
        let callers = LOOKUPS_IN_FLIGHT.fetch_add(1, SeqCst) + 1;
        tessera_sim_model::backend::Latencies::charge(per_caller_ms.saturating_mul(callers));
        Self
    }
}

impl Drop for LookupCost {
    fn drop(&mut self) {
        LOOKUPS_IN_FLIGHT.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A `GPU-…` UUID of a visible GPU, or the `MIG-…` UUID of a visible MIG device.
///
/// No kinder than NVIDIA's, whose `nvml.h` says the call "may initialize additional GPUs as it searches
/// for the target GPU" and answers `NVML_ERROR_GPU_IS_LOST` "if any GPU has fallen off the bus":
/// - it costs time, more the more threads are inside it at once (`latencies.handleByUuidMs` per caller;
///   NVIDIA's DRA driver, `cmd/gpu-kubelet-plugin/nvlib.go`: "Getting a device handle by UUID can take
///   O(10 s) when done concurrently ... cache handles, serialize NVML calls"), and each call is counted in
///   the kernel's `simulated-nvml-calls.json` ([`tessera_sim_model::calls`]);
/// - the search goes through the GPUs in NVML's order, and one that fell off the bus *before* the target
///   fails the search with `GPU_IS_LOST`: a lookup of a healthy GPU can fail because another is lost;
/// - the lost GPU itself is still found: its UUID is in the driver's cache, so a lookup (and
///   [`nvmlDeviceGetUUID`] on its handle) does not tell that it is lost.
///
/// A real driver likely does one of the last two for a given GPU, not both; which is not documented, so
/// both are the rule here.
///
/// # Safety
/// `uuid` is a NUL-terminated string; `device` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        // SAFETY: by the caller's contract.
        let wanted = unsafe { in_str(uuid) }?;
        if !lib.sim.is_read_only() {
            // Counting is for the tests; a failure to count must not fail the call.
            let _ = tessera_sim_model::calls::NvmlCalls::count_handle_by_uuid(lib.sim.kernel_dir(), wanted);
        }
        let _cost = LookupCost::enter(lib.sim.latencies().handle_by_uuid_ms);
        let passed_lost = |position: usize| lib.visible[..position].iter().any(|&g| lib.sim.is_lost(g));
        if let Some(gpu) = lib.sim.gpu_by_uuid(wanted).filter(|g| lib.visible.contains(g)) {
            let position = lib.visible.iter().position(|&g| g == gpu).unwrap_or(0);
            if passed_lost(position) {
                return Err(GPU_IS_LOST);
            }
            match lib.sim.failing_code(gpu) {
                // Found by its cached UUID (see above).
                Some(GPU_IS_LOST) | None => {}
                Some(code) => return Err(code),
            }
            // SAFETY: by the caller's contract.
            return unsafe { out(device, Handle::Gpu(gpu).encode()) };
        }
        for (position, &gpu) in lib.visible.iter().enumerate() {
            let Ok(migs) = lib.sim.mig_devices(gpu, &lib.view) else {
                continue;
            };
            if let Some(m) = migs.into_iter().find(|m| m.uuid == wanted) {
                if passed_lost(position) {
                    return Err(GPU_IS_LOST);
                }
                // SAFETY: by the caller's contract.
                return unsafe { out(device, Handle::of_mig(gpu, &m).encode()) };
            }
        }
        Err(NOT_FOUND)
    })
}

/// Bus ids in NVML's spelling (`00000000:18:00.0`) or the short one (`0000:18:00.0`), any case.
fn same_bus_id(a: &str, b: &str) -> bool {
    let norm = |s: &str| -> Option<(u32, String)> {
        let (domain, rest) = s.trim().split_once(':')?;
        Some((u32::from_str_radix(domain, 16).ok()?, rest.to_ascii_lowercase()))
    };
    norm(a).is_some() && norm(a) == norm(b)
}

/// # Safety
/// `bus_id` is a NUL-terminated string; `device` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        // SAFETY: by the caller's contract.
        let wanted = unsafe { in_str(bus_id) }?;
        let gpu = lib
            .visible
            .iter()
            .copied()
            .find(|&g| {
                lib.sim
                    .gpu(g)
                    .is_ok_and(|info| same_bus_id(&info.pci_bus_id, wanted))
            })
            .ok_or(NOT_FOUND)?;
        if let Some(code) = lib.sim.failing_code(gpu) {
            return Err(code);
        }
        // SAFETY: by the caller's contract.
        unsafe { out(device, Handle::Gpu(gpu).encode()) }
    })
}

/// The NVML index of a GPU (its position among the visible GPUs); for a MIG device handle, the MIG
/// device's position under its parent (as `nvmlDeviceGetMigDeviceHandleByIndex` counts).
///
/// # Safety
/// `index` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let index = unsafe { Out::new(index) };
    answer(index, |lib| {
        let d = lib.dev(device)?;
        let i = match &d.mig {
            None => lib.visible.iter().position(|&g| g == d.gpu),
            Some(m) => lib
                .sim
                .mig_devices(d.gpu, &lib.view)
                .map_err(model_err)?
                .iter()
                .position(|x| x.uuid == m.uuid),
        };
        Ok(i.ok_or(INVALID_ARGUMENT)? as c_uint)
    })
}

// === Device identity and capacities ===

/// A GPU that fell off the bus still answers with its UUID: the driver keeps it from before, so this call
/// cannot tell that a GPU is lost (no kinder than a real driver, which may serve it from that cache; a
/// caller that wants to know asks something only the GPU can answer, e.g. `nvmlDeviceGetMemoryInfo`,
/// which answers `GPU_IS_LOST` "if the target GPU has fallen off the bus", `nvml.h`). Every other call
/// on a lost GPU's handle answers `GPU_IS_LOST`, as do the other faults' codes here.
///
/// # Safety
/// `uuid` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let uuid = unsafe { OutStr::new(uuid, length) };
    answer(uuid, |lib| {
        let d = lib.dev_cached(device)?;
        Ok(match d.mig {
            Some(m) => m.uuid,
            None => lib.info(d.gpu)?.uuid,
        })
    })
}

/// `NVIDIA H100 80GB HBM3`; a MIG device is `<parent name> MIG <profile>`.
///
/// # Safety
/// `name` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let name = unsafe { OutStr::new(name, length) };
    answer(name, |lib| {
        let d = lib.dev(device)?;
        let model = lib.model(d.gpu)?;
        Ok(match &d.mig {
            None => model.product_name.to_string(),
            Some(m) => {
                let prof = model.profile_by_id(m.gi_profile_id).ok_or(UNKNOWN)?;
                format!("{} MIG {}", model.product_name, prof.name)
            }
        })
    })
}

/// # Safety
/// `brand` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(
    device: nvmlDevice_t,
    brand: *mut nvmlBrandType_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let brand = unsafe { Out::new(brand) };
    answer(brand, |lib| {
        lib.dev(device)?;
        // NVML_BRAND_NVIDIA: what data-center GPUs of these generations report.
        Ok(14)
    })
}

/// # Safety
/// `minor` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(device: nvmlDevice_t, minor: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let minor = unsafe { Out::new(minor) };
    answer(minor, |lib| {
        // A MIG device has no /dev/nvidia<minor> of its own: callers take the parent's.
        Ok(lib.info(lib.gpu_or_not_supported(device)?)?.minor)
    })
}

fn nvml_architecture(a: Architecture) -> nvmlDeviceArchitecture_t {
    match a {
        Architecture::Ampere => 7,
        Architecture::Hopper => 9,
        Architecture::Blackwell => 10,
    }
}

/// # Safety
/// `arch` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: nvmlDevice_t,
    arch: *mut nvmlDeviceArchitecture_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let arch = unsafe { Out::new(arch) };
    answer(arch, |lib| {
        Ok(nvml_architecture(lib.model(lib.dev(device)?.gpu)?.architecture))
    })
}

fn compute_capability(model: &GpuModel) -> (c_int, c_int) {
    let (major, minor) = model.compute_capability.split_once('.').unwrap_or(("0", "0"));
    (major.parse().unwrap_or(0), minor.parse().unwrap_or(0))
}

/// # Safety
/// `major` and `minor` are null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let d = lib.dev(device)?;
        let (ma, mi) = compute_capability(lib.model(d.gpu)?);
        // SAFETY: by the caller's contract.
        unsafe {
            out(major, ma)?;
            out(minor, mi)
        }
    })
}

/// Total memory of a GPU or MIG device, and what is not in use (the model tracks no allocations).
fn memory(lib: &Lib, d: &Dev) -> R<(u64, u64)> {
    let g = lib.info(d.gpu)?;
    if g.node_fault == Some(SimulatedFault::MemoryNotSupported) {
        return Err(NOT_SUPPORTED);
    }
    let total = match &d.mig {
        None => g.model.memory_bytes(),
        Some(m) => {
            let prof = g.model.profile_by_id(m.gi_profile_id).ok_or(UNKNOWN)?;
            prof.memory_mib * 1024 * 1024
        }
    };
    Ok((total, 0))
}

/// # Safety
/// `mem` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    mem: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let mem = unsafe { Out::new(mem) };
    answer(mem, |lib| {
        let (total, used) = memory(lib, &lib.dev(device)?)?;
        Ok(nvmlMemory_t {
            total,
            free: total - used,
            used,
        })
    })
}

/// # Safety
/// `mem` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    mem: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let dst = unsafe { Out::new(mem) };
    answer(dst, |lib| {
        // SAFETY: by the caller's contract.
        let version = unsafe { accepted_version(mem, &[struct_version::<nvmlMemory_v2_t>(2)]) }?;
        let (total, used) = memory(lib, &lib.dev(device)?)?;
        Ok(nvmlMemory_v2_t {
            version,
            total,
            reserved: 0,
            free: total - used,
            used,
        })
    })
}

/// # Safety
/// `pci` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let pci = unsafe { Out::new(pci) };
    answer(pci, |lib| {
        let g = lib.info(lib.dev(device)?.gpu)?;
        let mut parts = g.pci_bus_id.split([':', '.']);
        let mut next = || u32::from_str_radix(parts.next().unwrap_or("0"), 16).unwrap_or(0);
        let (domain, bus, dev) = (next(), next(), next());
        // SAFETY: plain data; every field is set below or zero.
        let mut info: nvmlPciInfo_t = unsafe { mem::zeroed() };
        info.domain = domain;
        info.bus = bus;
        info.device = dev;
        info.pciDeviceId = (u32::from(g.model.pci_device_id) << 16) | 0x10DE;
        info.pciSubSystemId = 0x16C1_10DE;
        fill_c(&mut info.busId, &format!("{domain:08X}:{bus:02X}:{dev:02X}.0"));
        fill_c(
            &mut info.busIdLegacy,
            &format!("{domain:04X}:{bus:02X}:{dev:02X}.0"),
        );
        Ok(info)
    })
}

/// # Safety
/// `node` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumaNodeId(device: nvmlDevice_t, node: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let node = unsafe { Out::new(node) };
    answer(
        node,
        |lib| Ok(lib.info(lib.dev(device)?.gpu)?.numa_node as c_uint),
    )
}

/// CUDA cores: SMs × cores per SM of the compute capability (64 on 8.0, 128 on Hopper and Blackwell).
///
/// # Safety
/// `cores` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNumGpuCores(device: nvmlDevice_t, cores: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let cores = unsafe { Out::new(cores) };
    answer(cores, |lib| {
        let d = lib.dev(device)?;
        let model = lib.model(d.gpu)?;
        let per_sm = if compute_capability(model) == (8, 0) {
            64
        } else {
            128
        };
        let sms = match &d.mig {
            None => model.multiprocessors,
            Some(m) => {
                model
                    .profile_by_id(m.gi_profile_id)
                    .ok_or(UNKNOWN)?
                    .multiprocessors
            }
        };
        Ok(sms * per_sm)
    })
}

/// Documented for MIG device handles; a whole GPU answers NOT_SUPPORTED.
///
/// # Safety
/// `attributes` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let attributes = unsafe { Out::new(attributes) };
    answer(attributes, |lib| {
        let d = lib.dev(device)?;
        let m = d.mig.as_ref().ok_or(NOT_SUPPORTED)?;
        let prof = lib.model(d.gpu)?.profile_by_id(m.gi_profile_id).ok_or(UNKNOWN)?;
        Ok(nvmlDeviceAttributes_t {
            multiprocessorCount: prof.multiprocessors,
            sharedCopyEngineCount: prof.copy_engines,
            sharedDecoderCount: prof.decoders,
            sharedEncoderCount: prof.encoders,
            sharedJpegCount: prof.jpeg_engines,
            sharedOfaCount: prof.ofa_engines,
            gpuInstanceSliceCount: prof.compute_slices,
            computeInstanceSliceCount: prof.compute_slices,
            memorySizeMB: prof.memory_mib,
        })
    })
}

/// # Safety
/// `mode` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetVirtualizationMode(
    device: nvmlDevice_t,
    mode: *mut nvmlGpuVirtualizationMode_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let mode = unsafe { Out::new(mode) };
    answer(mode, |lib| {
        Ok(lib.info(lib.dev(device)?.gpu)?.virtualization_mode.nvml_value())
    })
}

/// The GPU's fabric now ([`SimulatedBackend::fabric`]: the node file's state, completed once its
/// `fabricCompletesAfterMs` passed, degraded by an injected fabric fault); a GPU without one (`fabric: None`)
/// answers NOT_SUPPORTED.
fn fabric(lib: &Lib, device: nvmlDevice_t) -> R<(FabricReport, [u8; 16])> {
    let d = lib.dev(device)?;
    let report = lib.sim.fabric(d.gpu).map_err(model_err)?.ok_or(NOT_SUPPORTED)?;
    // One NVLink domain per node: the cluster UUID is the node's.
    let mut cluster = [0u8; 16];
    for (i, b) in lib.sim.node_name().bytes().enumerate() {
        cluster[i % 16] ^= b;
    }
    Ok((report, cluster))
}

/// # Safety
/// `info` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfo(
    device: nvmlDevice_t,
    info: *mut nvmlGpuFabricInfo_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let info = unsafe { Out::new(info) };
    answer(info, |lib| {
        let (f, cluster_uuid) = fabric(lib, device)?;
        Ok(nvmlGpuFabricInfo_t {
            clusterUuid: cluster_uuid,
            status: f.status,
            cliqueId: 0,
            state: f.state,
        })
    })
}

/// Versions 2 (`healthMask`) and 3 (`healthSummary`) of the struct. The summary is a real value: HEALTHY
/// (1) for a completed, healthy fabric, LIMITED_CAPACITY or UNHEALTHY under an injected fabric fault, and
/// 0 only while the fabric has not completed; nvml.h reads 0 as NOT_SUPPORTED, not as healthy (lines
/// 3890-3893 and the v3 struct's `healthSummary` at 3950 of NVIDIA/go-nvml `gen/nvml/nvml.h`).
///
/// # Safety
/// `info` is null or valid for the struct its `version` names.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfoV(
    device: nvmlDevice_t,
    info: *mut nvmlGpuFabricInfo_v3_t,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        // SAFETY: by the caller's contract. The version is refused only after the device is resolved,
        // as NVML orders the checks.
        let version = unsafe { version_of(info) }?;
        let (f, cluster_uuid) = fabric(&lib, device)?;
        if version == struct_version::<nvmlGpuFabricInfo_v3_t>(3) {
            let v = nvmlGpuFabricInfo_v3_t {
                version,
                clusterUuid: cluster_uuid,
                status: f.status,
                cliqueId: 0,
                state: f.state,
                healthMask: f.health_mask,
                healthSummary: f.health_summary,
            };
            // SAFETY: the caller passed a v3 struct.
            unsafe { out(info, v) }
        } else if version == struct_version::<nvmlGpuFabricInfo_v2_t>(2) {
            let v = nvmlGpuFabricInfo_v2_t {
                version,
                clusterUuid: cluster_uuid,
                status: f.status,
                cliqueId: 0,
                state: f.state,
                healthMask: f.health_mask,
            };
            // SAFETY: the caller passed a v2 struct.
            unsafe { out(info.cast::<nvmlGpuFabricInfo_v2_t>(), v) }
        } else {
            Err(ARGUMENT_VERSION_MISMATCH)
        }
    })
}

// === Compute mode, processes, utilization ===

/// # Safety
/// `mode` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: nvmlDevice_t,
    mode: *mut nvmlComputeMode_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let mode = unsafe { Out::new(mode) };
    answer(mode, |lib| {
        let d = lib.dev(device)?;
        Ok(match lib.sim.compute_mode(d.gpu).map_err(model_err)? {
            ComputeMode::Default => 0,
            ComputeMode::Prohibited => 2,
            ComputeMode::ExclusiveProcess => 3,
        })
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceSetComputeMode(device: nvmlDevice_t, mode: nvmlComputeMode_t) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let gpu = lib.gpu_or_not_supported(device)?;
        let m = match mode {
            0 => ComputeMode::Default,
            2 => ComputeMode::Prohibited,
            3 => ComputeMode::ExclusiveProcess,
            // EXCLUSIVE_THREAD is gone from current drivers.
            1 => return Err(NOT_SUPPORTED),
            _ => return Err(INVALID_ARGUMENT),
        };
        lib.sim.set_compute_mode(gpu, m).map_err(model_err)
    })
}

/// The synthetic load's processes on GPU `gpu` (`tessera-kubelet-plugin simulate load`, in the kernel's
/// `simulated-load.json`): each stands for a process (`--pid`: a real one of the host, as NVML names host
/// PIDs) using its memory and SM share of the whole GPU. Loads set on MIG devices show here too, without
/// their instance ids. MPS clients included: their utilization samples carry their own PIDs (which PID a
/// real driver stamps a client's work with is not documented; the MPS server issues it). A load file that
/// cannot be read is no load.
fn load_processes(lib: &Lib, gpu: u32) -> Vec<ProcessUsage> {
    let query = UsageQuery {
        gpu,
        mig: None,
        device: "",
    };
    lib.sim.usage(&query).map(|u| u.processes).unwrap_or_default()
}

/// NVML's two process lists of the synthetic load on GPU `gpu` (see [`load::nvml_lists`]: an MPS client
/// only in the MPS list, its server in the compute list). A load file that cannot be read is no load.
fn load_lists(lib: &Lib, gpu: u32) -> load::NvmlLists {
    load::nvml_lists(lib.sim.kernel_dir(), gpu).unwrap_or_default()
}

/// A listed process of the synthetic load, on the whole GPU (loads carry no MIG instance ids).
fn load_info(p: load::ListedProcess) -> nvmlProcessInfo_t {
    nvmlProcessInfo_t {
        pid: p.pid,
        usedGpuMemory: p.memory_bytes,
        gpuInstanceId: NO_INSTANCE,
        computeInstanceId: NO_INSTANCE,
    }
}

/// Processes with a compute context of their own on a GPU (each with its MIG device's ids) or on one MIG
/// device: the model's, the synthetic load's, and the MPS servers of the load's MPS clients.
fn processes(lib: &Lib, device: nvmlDevice_t) -> R<Vec<nvmlProcessInfo_t>> {
    let d = lib.dev(device)?;
    let all = lib.sim.running_processes(d.gpu).map_err(model_err)?;
    let mut out: Vec<nvmlProcessInfo_t> = all
        .into_iter()
        .filter(|p| match &d.mig {
            None => true,
            Some(m) => p.mig == Some((m.gpu_instance, m.compute_instance)),
        })
        .map(|p| nvmlProcessInfo_t {
            pid: p.pid,
            usedGpuMemory: VALUE_NOT_AVAILABLE,
            gpuInstanceId: p.mig.map_or(NO_INSTANCE, |(gi, _)| gi),
            computeInstanceId: p.mig.map_or(NO_INSTANCE, |(_, ci)| ci),
        })
        .collect();
    if d.mig.is_none() {
        out.extend(load_lists(lib, d.gpu).compute.into_iter().map(load_info));
    }
    Ok(out)
}

/// The MPS clients of the synthetic load on a GPU; none on a MIG device handle (loads carry no instance
/// ids, as in [`processes`]).
fn mps_processes(lib: &Lib, device: nvmlDevice_t) -> R<Vec<nvmlProcessInfo_t>> {
    let d = lib.dev(device)?;
    if d.mig.is_some() {
        return Ok(Vec::new());
    }
    Ok(load_lists(lib, d.gpu).mps.into_iter().map(load_info).collect())
}

fn v1(p: nvmlProcessInfo_t) -> nvmlProcessInfo_v1_t {
    nvmlProcessInfo_v1_t {
        pid: p.pid,
        usedGpuMemory: p.usedGpuMemory,
    }
}

/// # Safety
/// `count` is valid; `infos` is null or valid for `*count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let procs = processes(&*lib()?, device)?;
        // SAFETY: by the caller's contract.
        unsafe { out_array(infos, count, procs) }
    })
}

/// Same layout as v3 (`nvmlProcessInfo_v2_t`).
///
/// # Safety
/// As [`nvmlDeviceGetComputeRunningProcesses_v3`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetComputeRunningProcesses_v3(device, count, infos) }
}

/// # Safety
/// `count` is valid; `infos` is null or valid for `*count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_v1_t,
) -> nvmlReturn_t {
    ffi(|| {
        let procs = processes(&*lib()?, device)?.into_iter().map(v1).collect();
        // SAFETY: by the caller's contract.
        unsafe { out_array(infos, count, procs) }
    })
}

/// The processes "utilizing MPS" (nvml.h, `nvmlDeviceGetMPSComputeRunningProcesses_v3`): the MPS clients,
/// which the compute list leaves out (it names their server). Every simulated GPU is Volta or newer, where
/// nvml.h supports the call.
///
/// # Safety
/// `count` is valid; `infos` is null or valid for `*count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        let procs = mps_processes(&*lib()?, device)?;
        // SAFETY: by the caller's contract.
        unsafe { out_array(infos, count, procs) }
    })
}

/// Same layout as v3 (`nvmlProcessInfo_v2_t`; nvml.h keeps `_v2` for older callers, go-nvml looks it up).
///
/// # Safety
/// As [`nvmlDeviceGetMPSComputeRunningProcesses_v3`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v2(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetMPSComputeRunningProcesses_v3(device, count, infos) }
}

/// The unversioned call of old callers, `nvmlProcessInfo_v1_t` entries.
///
/// # Safety
/// `count` is valid; `infos` is null or valid for `*count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_v1_t,
) -> nvmlReturn_t {
    ffi(|| {
        let procs = mps_processes(&*lib()?, device)?.into_iter().map(v1).collect();
        // SAFETY: by the caller's contract.
        unsafe { out_array(infos, count, procs) }
    })
}

/// The simulated GPUs run compute work only: no graphics processes.
///
/// # Safety
/// `count` is valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        lib()?.dev(device)?;
        // SAFETY: by the caller's contract.
        unsafe { out_array(infos, count, Vec::new()) }
    })
}

/// # Safety
/// As [`nvmlDeviceGetGraphicsRunningProcesses_v3`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGraphicsRunningProcesses_v2(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: same contract.
    unsafe { nvmlDeviceGetGraphicsRunningProcesses_v3(device, count, infos) }
}

/// One sample per process of the synthetic load (its SM share), stamped now; NOT_FOUND without load, as
/// NVML answers when no process ran in the window.
///
/// # Safety
/// Pointers are null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    utilization: *mut nvmlProcessUtilizationSample_t,
    count: *mut c_uint,
    _last_seen: c_ulonglong,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let gpu = lib.gpu(device)?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as c_ulonglong)
            .unwrap_or_default();
        let samples: Vec<nvmlProcessUtilizationSample_t> = load_processes(&lib, gpu)
            .into_iter()
            .filter_map(|p| {
                Some(nvmlProcessUtilizationSample_t {
                    pid: p.pid,
                    timeStamp: now,
                    smUtil: p.sm_percent?,
                    memUtil: 0,
                    encUtil: 0,
                    decUtil: 0,
                })
            })
            .collect();
        if samples.is_empty() {
            // SAFETY: by the caller's contract.
            unsafe { out(count, 0)? };
            return Err(NOT_FOUND);
        }
        // SAFETY: by the caller's contract.
        unsafe { out_array(utilization, count, samples) }
    })
}

/// The synthetic load's SM use (idle without one); NOT_SUPPORTED on a MIG-enabled GPU (NVML reports no
/// utilization there).
///
/// # Safety
/// `utilization` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let utilization = unsafe { Out::new(utilization) };
    answer(utilization, |lib| {
        let gpu = lib.gpu_or_not_supported(device)?;
        if lib.sim.mig_mode(gpu).map_err(model_err)?.current {
            return Err(NOT_SUPPORTED);
        }
        let busy: u32 = load_processes(lib, gpu).iter().filter_map(|p| p.sm_percent).sum();
        Ok(nvmlUtilization_t {
            gpu: busy.min(100),
            memory: 0,
        })
    })
}

// === MIG mode ===

/// # Safety
/// `current` and `pending` are null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let gpu = lib.gpu_or_not_supported(device)?;
        let m = lib.sim.mig_mode(gpu).map_err(model_err)?;
        // SAFETY: by the caller's contract.
        unsafe {
            out(current, c_uint::from(m.current))?;
            out(pending, c_uint::from(m.pending))
        }
    })
}

/// Succeeds and reports the activation status as the driver does (IN_USE when processes hold the GPU;
/// the mode is then pending); fails with IN_USE while GPU instances exist. A vGPU guest cannot change
/// MIG mode (NOT_SUPPORTED), nor can a process without write access to the kernel (NO_PERMISSION).
///
/// # Safety
/// `activation_status` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: nvmlDevice_t,
    mode: c_uint,
    activation_status: *mut nvmlReturn_t,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let activation_status = unsafe { Out::new(activation_status) };
    answer(activation_status, |lib| {
        let gpu = lib.gpu(device)?;
        let enabled = match mode {
            0 => false,
            1 => true,
            _ => return Err(INVALID_ARGUMENT),
        };
        if lib.info(gpu)?.virtualization_mode == tessera_sim_model::backend::VirtualizationMode::Vgpu {
            return Err(NOT_SUPPORTED);
        }
        lib.sim.set_mig_mode_nvml(gpu, enabled).map_err(model_err)
    })
}

// === Private exports for this repository's tools (not NVML) ===

/// Sets the GPU's compute time-slice (`nvidia-smi compute-policy --set-timeslice`; NVML has no public
/// call for it): 0 default, 1 short, 2 medium, 3 long.
#[unsafe(no_mangle)]
pub extern "C" fn tesseraSimSetTimeSlice(device: nvmlDevice_t, slice: c_uint) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let gpu = lib.gpu(device)?;
        let s = match slice {
            0 => TimeSlice::Default,
            1 => TimeSlice::Short,
            2 => TimeSlice::Medium,
            3 => TimeSlice::Long,
            _ => return Err(INVALID_ARGUMENT),
        };
        lib.sim.set_hardware_time_slice(gpu, s).map_err(model_err)
    })
}

/// The GPU's compute time-slice (`nvidia-smi compute-policy -l`).
///
/// # Safety
/// `slice` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tesseraSimGetTimeSlice(device: nvmlDevice_t, slice: *mut c_uint) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let slice = unsafe { Out::new(slice) };
    answer(slice, |lib| {
        Ok(lib.sim.hardware_time_slice(lib.gpu(device)?).map_err(model_err)? as c_uint)
    })
}

/// The simulated kernel directory this process's library opened.
///
/// # Safety
/// `path` is valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tesseraSimKernelDir(path: *mut c_char, length: c_uint) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let path = unsafe { OutStr::new(path, length) };
    answer(path, |lib| {
        let dir: &Path = lib.sim.kernel_dir();
        Ok(dir.display().to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_foreign_pointers_name_nothing() {
        for h in [
            Handle::Gpu(31),
            Handle::Mig {
                gpu: 3,
                gi: 14,
                ci: 7,
                generation: generation(u64::MAX),
            },
            Handle::GpuInstance {
                gpu: 0,
                gi: 0,
                generation: 0,
            },
            Handle::ComputeInstance {
                gpu: 7,
                gi: 2,
                ci: 0,
                generation: 12,
            },
            Handle::EventSet(9),
        ] {
            assert_eq!(Handle::decode(h.encode::<c_void>()), Some(h));
        }
        assert_eq!(Handle::decode(ptr::null_mut::<c_void>()), None);
        let on_the_heap = Box::into_raw(Box::new(0u64));
        assert_eq!(Handle::decode(on_the_heap), None);
        // SAFETY: the pointer came from Box::into_raw just above.
        drop(unsafe { Box::from_raw(on_the_heap) });
    }

    #[test]
    fn a_panic_inside_an_export_answers_unknown_instead_of_unwinding_into_c() {
        assert_eq!(ffi(|| panic!("bug")), UNKNOWN);
        assert_eq!(ffi(|| Err(NOT_FOUND)), NOT_FOUND);
        assert_eq!(ffi(|| Ok(())), SUCCESS);
    }

    #[test]
    fn calls_before_init_are_uninitialized() {
        let mut count = 0;
        // SAFETY: a valid out pointer.
        assert_eq!(unsafe { nvmlDeviceGetCount_v2(&mut count) }, UNINITIALIZED);
        assert_eq!(nvmlShutdown(), UNINITIALIZED);
    }

    #[test]
    fn the_three_array_conventions_differ_only_where_nvml_does() {
        let mut buf = [0u32; 2];
        let mut count: c_uint = 1;
        // SAFETY: `buf` holds 2 entries and `count` is a valid out pointer in every call.
        unsafe {
            // A buffer too small for `*count`: the two-call pattern's INSUFFICIENT_SIZE, count set.
            assert_eq!(
                out_array(buf.as_mut_ptr(), &mut count, vec![7, 8]),
                Err(INSUFFICIENT_SIZE)
            );
            assert_eq!(count, 2);
            assert_eq!(
                out_array(ptr::null_mut::<u32>(), &mut count, vec![7, 8]),
                Err(INSUFFICIENT_SIZE)
            );
            // A null buffer is a question for the count.
            count = 0;
            assert_eq!(
                out_array_or_count(ptr::null_mut::<u32>(), &mut count, vec![7, 8]),
                Ok(())
            );
            assert_eq!(count, 2);
            // The buffer is sized by contract, so `*count` is not read; a null one is INVALID_ARGUMENT.
            count = 0;
            assert_eq!(out_fixed_array(buf.as_mut_ptr(), &mut count, vec![7, 8]), Ok(()));
            assert_eq!((count, buf), (2, [7, 8]));
            assert_eq!(
                out_fixed_array(ptr::null_mut::<u32>(), &mut count, vec![7]),
                Err(INVALID_ARGUMENT)
            );
            assert_eq!(
                out_fixed_array(buf.as_mut_ptr(), ptr::null_mut(), vec![7]),
                Err(INVALID_ARGUMENT)
            );
        }
    }

    #[test]
    fn strings_that_do_not_fit_are_insufficient_size() {
        let mut buf = [0 as c_char; 8];
        // SAFETY: the buffer holds 8 bytes.
        unsafe {
            assert_eq!(out_str(buf.as_mut_ptr(), 8, "580.159.03"), Err(INSUFFICIENT_SIZE));
            assert_eq!(out_str(buf.as_mut_ptr(), 8, "1234567"), Ok(()));
            assert_eq!(CStr::from_ptr(buf.as_ptr()).to_str().unwrap(), "1234567");
        }
    }
}
