//! The NVML backend: real GPUs through nvml-wrapper, plus the raw MIG calls of `nvml_raw`.
//!
//! `NvmlBackend::new(driver_root)` loads `libnvidia-ml.so.1` from the driver root as this process sees it
//! (`--container-driver-root`: the host's `/` or a containerised driver such as `/run/nvidia/driver`, mounted
//! at `/driver-root` by the chart), so the plugin works without the library in its own image. It stays one NVML call per step with errors mapped by return code. Besides a node with an NVIDIA
//! driver, it runs in the tests against the simulated driver root's real `libnvidia-ml.so.1` (crate
//! `tessera-sim-nvml`; `tests/nvml_lib.rs`, `tests/nvml_defects.rs`); "needs hardware" below marks what
//! only that library or a GPU can exercise. The pure parts (library lookup, name derivation, sysfs/proc
//! parsing, error mapping) are unit-tested.
//!
//! GPUs are named by the index discovery gave them, and found by their UUID: NVML's indices are positions
//! that shift when a GPU is missing at boot. Each GPU's handle is looked up once per NVML session and
//! kept (discovery keeps the one it enumerated; a GPU discovery did not see is looked up by UUID, or by
//! index once while its UUID is unknown), and one backend's NVML calls on a GPU run one at a time under its
//! session lock (the event wait, on a backend of its own, is not held up by them), as NVIDIA's DRA driver
//! does (`cmd/gpu-kubelet-plugin/nvlib.go`: "Getting a device handle by UUID
//! can take O(10 s) when done concurrently ... cache handles, serialize NVML calls"). The health probe
//! drops the handle its backend kept for a GPU that stops answering (lost, needing a reset), so it is
//! looked up again once the GPU is back ([`NvmlBackend::forget_handle`]); the prepare and scrape backend
//! keeps its handles for its session, as NVIDIA's driver does, and a new session (a plugin restart, which
//! a driver reload forces) starts with none. MIG devices are reached from their parent's handle
//! (`nvmlDeviceGetMigDeviceHandleByIndex`), never by UUID.

use std::{
    collections::{BTreeMap, HashMap},
    ffi::OsStr,
    fmt::Display,
    fs,
    ops::{Deref, DerefMut},
    os::unix::fs::{FileTypeExt, MetadataExt},
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, MutexGuard},
};

use nvml_wrapper::{
    Device, Nvml,
    enum_wrappers::device::{ComputeMode as NvmlComputeMode, GpuVirtualizationMode},
    enums::device::DeviceArchitecture,
    error::NvmlError,
};
use nvml_wrapper_sys::bindings::nvmlReturn_t;
use tessera_api::{GpuInfo, MigPlacement, MigProfileInfo, inventory::MigInfo};
use tracing::{debug, info, warn};

use crate::gpu::driver_root::DriverRoot;

use super::{
    CharDevice, ComputeInstance, ComputeMode, GpuBackend, GpuError, GpuInstance, MigMode, NodeGpus, Result,
    TimeSlice, discover_each, mig_mode_change_outcome, models,
    nvml_raw::{self, NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_NOT_A_MIG_UUID, RawError},
};

const LIBRARY_NAME: &str = "libnvidia-ml.so.1";

/// Where the NVML library is looked for under a driver root, in order (every layout of
/// [`crate::gpu::driver_root::LIBRARY_DIRS`], GKE's `lib64` included, then the root itself); the bare name last
/// lets the dynamic loader search its usual paths.
pub fn library_candidates(driver_root: &Path) -> Vec<PathBuf> {
    let mut out = DriverRoot::new(driver_root).library_candidates(LIBRARY_NAME);
    out.push(PathBuf::from(LIBRARY_NAME));
    out
}

/// The NVML library [`NvmlBackend::new`] loads: the first of [`library_candidates`] that exists, else the
/// bare name for the dynamic loader. A soname link with an absolute target (an Operator rootfs's) dangles
/// in this process's filesystem, so it is followed inside the driver root instead.
pub fn library_path(driver_root: &Path) -> PathBuf {
    let root = DriverRoot::new(driver_root);
    library_candidates(driver_root)
        .into_iter()
        .filter(|p| p.is_absolute())
        .find_map(|p| {
            if p.exists() {
                Some(p)
            } else {
                root.resolve(&p).filter(|r| r.is_file())
            }
        })
        .unwrap_or_else(|| PathBuf::from(LIBRARY_NAME))
}

/// NVML return codes (`nvml.h`) and the [`GpuError`] each maps to.
pub fn error_for_code(call: &'static str, code: u32, context: impl Display) -> GpuError {
    let msg = format!("{context} ({call} returned {code})");
    match code {
        2 => GpuError::InvalidArgument(msg),
        3 => GpuError::NotSupported(msg),
        4 => GpuError::NoPermission(msg),
        6 => GpuError::NotFound(msg),
        c if c == NVML_ERROR_FUNCTION_NOT_FOUND => GpuError::NotSupported(format!(
            "{msg}: the driver's NVML library lacks this function; update the driver"
        )),
        // Not NotSupported: callers read that as "MIG is off, nothing left" and would skip destroys.
        c if c == NVML_ERROR_NOT_A_MIG_UUID => GpuError::InvalidArgument(format!(
            "{msg}: NVML gave the MIG device a UUID that is not `MIG-…` (logged), so CUDA would see the \
             whole parent GPU; the device is not offered"
        )),
        15 => GpuError::GpuLost(msg),
        16 => GpuError::ResetRequired(msg),
        19 => GpuError::InUse(msg),
        23 => GpuError::InsufficientResources(msg),
        code => GpuError::Nvml { call, code },
    }
}

/// The NVML return code a [`GpuError`] of this backend stands for ([`error_for_code`] the other way);
/// `NVML_ERROR_UNKNOWN` (999) for errors that are not NVML's.
pub fn code_of(e: &GpuError) -> u32 {
    match e {
        GpuError::InvalidArgument(_) => 2,
        GpuError::NotSupported(_) => 3,
        GpuError::NoPermission(_) => 4,
        GpuError::NotFound(_) => 6,
        GpuError::GpuLost(_) => 15,
        GpuError::ResetRequired(_) => 16,
        GpuError::InUse(_) => 19,
        GpuError::InsufficientResources(_) => 23,
        GpuError::Nvml { code, .. } => *code,
        _ => 999,
    }
}

fn wrapper_error(call: &'static str, e: NvmlError, context: impl Display) -> GpuError {
    if let NvmlError::FailedToLoadSymbol(_) = e {
        return error_for_code(call, NVML_ERROR_FUNCTION_NOT_FOUND, context);
    }
    error_for_code(call, nvmlReturn_t::from(e), context)
}

fn raw_error(e: RawError, context: impl Display) -> GpuError {
    error_for_code(e.call, e.code, context)
}

/// `NVML_DEVICE_ARCH_HOPPER`.
const ARCH_HOPPER: u32 = 9;
/// `NVML_DEVICE_ARCH_UNKNOWN`.
const ARCH_UNKNOWN: u32 = u32::MAX;

/// Hopper and every later architecture switch MIG mode without a GPU reset (NVIDIA's
/// `supportsMIGModeToggle` is `architecture >= HOPPER`); judged on the raw number so an architecture newer
/// than nvml-wrapper knows counts too.
pub fn mig_toggle_without_reset(raw_arch: u32) -> bool {
    raw_arch >= ARCH_HOPPER && raw_arch != ARCH_UNKNOWN
}

/// The architecture attribute: nvml-wrapper's name where it knows the number, else `Architecture<N>`
/// (never a bare "Unknown" for a GPU the driver does know).
pub fn architecture_name(raw_arch: Option<u32>, known: DeviceArchitecture) -> String {
    match (raw_arch, &known) {
        (Some(n), DeviceArchitecture::Unknown) if n != ARCH_UNKNOWN => format!("Architecture{n}"),
        _ => known.to_string(),
    }
}

/// `nvmlSystemGetCudaDriverVersion` gives `1000 * major + 10 * minor`; e.g. 13000 is `13.0`.
pub fn format_cuda_version(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// NVML prints bus ids as `00000000:3B:00.0`; sysfs and Kubernetes' `pciBusID` use `0000:3b:00.0`.
pub fn normalize_pci_bus_id(bus_id: &str) -> String {
    let lower = bus_id.trim().to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            let trimmed = &domain[domain.len() - 4..];
            format!("{trimmed}:{rest}")
        }
        _ => lower,
    }
}

/// The PCIe root complex (`pci0000:3a`) from a device's canonical sysfs path
/// (`/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0`).
pub fn pcie_root_from_sysfs_path(path: &Path) -> Option<String> {
    path.components()
        .filter_map(|c| c.as_os_str().to_str())
        .find(|c| c.starts_with("pci") && c.contains(':'))
        .map(str::to_string)
}

/// FP32 cores per SM by compute capability, to turn `nvmlDeviceGetNumGpuCores` into an SM count
/// (GA100 has 64 per SM; Hopper, Blackwell and the other Ampere/Ada parts 128).
fn cores_per_sm(major: i32, minor: i32) -> Option<u32> {
    match (major, minor) {
        (7, _) | (8, 0) => Some(64),
        (8, _) | (9, _) | (10, _) | (12, _) => Some(128),
        _ => None,
    }
}

/// Profile name when the driver gives none (MIG off, where only the v1 profile call answers, or a driver
/// without the V call): the built-in table for a known model, else `<slices>g.<GB>gb` plus the suffix of the
/// profile index's variant, the GB as NVIDIA names them ([`mig_memory_gb`]), so that a GPU of a model the
/// table lacks is named alike with MIG off and with MIG on, where the driver's name is used.
pub fn derive_profile_name(
    pci_device_id: u16,
    profile_id: u32,
    index: u32,
    slices: u32,
    memory_mib: u64,
    gpu_memory_bytes: u64,
) -> String {
    if let Some(p) = models::model_by_pci_device_id(pci_device_id).and_then(|m| m.profile_by_id(profile_id)) {
        return p.name.to_string();
    }
    let suffix = match index {
        0x7 | 0x8 => "+me",
        0xA..=0xC | 0x11 => "+gfx",
        0xD | 0xE => "-me",
        0xF | 0x10 => "+me.all",
        _ => "",
    };
    format!(
        "{slices}g.{}gb{suffix}",
        mig_memory_gb(memory_mib, gpu_memory_bytes)
    )
}

/// The GB in a MIG profile's name, by NVIDIA's rule (go-nvlib `pkg/nvlib/device/mig_profile.go`,
/// `getMigMemorySizeGB`, which NVIDIA's DRA driver names profiles with): the profile's share of the GPU's
/// memory rounded up to an eighth, times the GPU's memory in GiB rounded up, rounded to the nearest. Not the
/// profile's own GiB: an H200's `1g.18gb` has 16 GiB. In integers, so no rounding of floats moves a
/// boundary; with no GPU memory known, the profile's GiB rounded up.
fn mig_memory_gb(memory_mib: u64, gpu_memory_bytes: u64) -> u64 {
    if gpu_memory_bytes == 0 {
        return memory_mib.div_ceil(1024);
    }
    let eighths = u128::from(memory_mib << 23).div_ceil(u128::from(gpu_memory_bytes));
    let gpu_gib = u128::from(gpu_memory_bytes.div_ceil(1 << 30));
    // round(eighths / 8 * gpu_gib), halves away from zero as Go's math.Round.
    ((eighths * gpu_gib * 2 + 8) / 16) as u64
}

/// Reads `DeviceFileMinor: N` from a `/proc/driver/nvidia/capabilities/.../access` file; an error naming
/// the file and the likely fix when it is missing or says no minor.
fn access_file_minor(path: &Path) -> Result<u32> {
    let text = fs::read_to_string(path).map_err(|e| {
        GpuError::NotFound(format!(
            "MIG capability file {}: {e}; the driver writes it when the GPU or compute instance exists, so \
             check that the instance exists (`nvidia-smi mig -lgi` / `-lci`) and that the plugin sees the \
             host's /proc/driver/nvidia (the minors are never guessed)",
            path.display()
        ))
    })?;
    text.lines()
        .find_map(|l| l.strip_prefix("DeviceFileMinor:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| {
            GpuError::NotFound(format!(
                "MIG capability file {} has no `DeviceFileMinor:` line (read {:?})",
                path.display(),
                text.trim()
            ))
        })
}

/// GI and CI capability minors from the driver's `/proc` access files. Never computed from
/// `mig-minors`' layout: a minor for a capability the driver did not create would give the container
/// device nodes that grant nothing and hide the real problem (NVIDIA's driver fails the prepare too).
pub fn mig_capability_minors_from_proc(
    proc_root: &Path,
    gpu_minor: u32,
    gpu_instance: u32,
    compute_instance: u32,
) -> Result<(u32, u32)> {
    let gi_dir = proc_root.join(format!(
        "driver/nvidia/capabilities/gpu{gpu_minor}/mig/gi{gpu_instance}"
    ));
    let gi = access_file_minor(&gi_dir.join("access"))?;
    let ci = access_file_minor(&gi_dir.join(format!("ci{compute_instance}/access")))?;
    Ok((gi, ci))
}

/// Where the NVIDIA kernel module's `/proc` files are for a driver root: `/proc`, except for a simulated
/// driver root (`<root>/tessera-sim/kernel.json`, see `driver_root.rs`), whose simulated kernel writes
/// them under `<root>/tessera-sim/proc`.
pub fn proc_root_for(driver_root: &Path) -> PathBuf {
    let sim = driver_root.join("tessera-sim");
    if sim.join("kernel.json").is_file() {
        sim.join("proc")
    } else {
        PathBuf::from("/proc")
    }
}

/// Major number of a driver in `/proc/devices`' "Character devices" section.
fn proc_devices_major(proc_devices: &str, driver: &str) -> Option<u32> {
    proc_devices
        .lines()
        .skip_while(|l| !l.starts_with("Character devices"))
        .take_while(|l| !l.starts_with("Block devices"))
        .find_map(|l| {
            let (major, name) = l.trim().split_once(' ')?;
            (name.trim() == driver).then(|| major.parse().ok()).flatten()
        })
}

/// A character device's numbers: from the node itself when it exists, else from its name and
/// `/proc/devices` (cap nodes need not exist on the host; CDI creates them in the container).
pub fn char_device_from_host(path: &str, proc_root: &Path) -> Result<CharDevice> {
    if let Ok(meta) = fs::metadata(path) {
        if !meta.file_type().is_char_device() {
            return Err(GpuError::InvalidArgument(format!(
                "{path} is not a character device"
            )));
        }
        let rdev = meta.rdev();
        // glibc's gnu_dev_major / gnu_dev_minor.
        let major = (((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0x0000_0fff)) as u32;
        let minor = (((rdev >> 12) & 0xffff_ff00) | (rdev & 0x0000_00ff)) as u32;
        return Ok(CharDevice { major, minor });
    }
    let devices = fs::read_to_string(proc_root.join("devices")).unwrap_or_default();
    let not_found = || GpuError::NotFound(format!("character device {path}"));
    let from_proc = |driver: &str, minor: u32| {
        proc_devices_major(&devices, driver)
            .map(|major| CharDevice { major, minor })
            .ok_or_else(not_found)
    };
    let number = |s: &str| {
        s.parse::<u32>()
            .ok()
            .filter(|_| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
    };
    // The NVIDIA GPU driver's major is fixed at 195.
    match path {
        "/dev/nvidiactl" => Ok(CharDevice {
            major: 195,
            minor: 255,
        }),
        "/dev/nvidia-modeset" => Ok(CharDevice {
            major: 195,
            minor: 254,
        }),
        // CUDA cannot run without it: the error names the fix (driver_watch.rs creates the nodes of a
        // loaded module at start, so only a module that is not loaded gets here).
        "/dev/nvidia-uvm" | "/dev/nvidia-uvm-tools" => {
            let minor = u32::from(path.ends_with("-tools"));
            from_proc("nvidia-uvm", minor).map_err(|_| {
                GpuError::NotFound(format!(
                    "character device {path}: the nvidia-uvm kernel module is not loaded ({} lists no \
                     nvidia-uvm); {}",
                    proc_root.join("devices").display(),
                    crate::gpu::driver_watch::UVM_FIX
                ))
            })
        }
        _ => {
            if let Some(n) = path.strip_prefix("/dev/nvidia-caps/nvidia-cap").and_then(number) {
                from_proc("nvidia-caps", n)
            } else if let Some(n) = path.strip_prefix("/dev/nvidia").and_then(number) {
                Ok(CharDevice { major: 195, minor: n })
            } else {
                Err(not_found())
            }
        }
    }
}

/// Bumped on every MIG mode change any [`NvmlBackend`] of this process makes (the health source has an
/// NVML session of its own): a MIG toggle may reset the GPU and drop its event registration, so the health
/// source registers again when it sees a new value.
static MIG_CHANGES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// What the session lock of an [`NvmlBackend`] guards: the handles looked up so far.
#[derive(Default)]
struct Session {
    /// Handle of each GPU by the index discovery gave it.
    handles: HashMap<u32, nvml_raw::KeptHandle>,
}

/// A GPU's handle with its backend's session lock held: the backend's other NVML calls wait until it is
/// dropped. Dereferences to nvml-wrapper's [`Device`].
pub(super) struct Held<'a> {
    device: Device<'a>,
    session: MutexGuard<'a, Session>,
}

impl Held<'_> {
    /// Keeps this handle as GPU `gpu`'s for the rest of the session.
    fn keep_as(&mut self, gpu: u32) {
        let handle = nvml_raw::KeptHandle::of(&self.device);
        self.session.handles.insert(gpu, handle);
    }
}

impl<'a> Deref for Held<'a> {
    type Target = Device<'a>;
    fn deref(&self) -> &Device<'a> {
        &self.device
    }
}

impl<'a> DerefMut for Held<'a> {
    fn deref_mut(&mut self) -> &mut Device<'a> {
        &mut self.device
    }
}

/// Real GPUs through NVML. Thread-safe: NVML is; the handle cache and the NVML calls that use it are
/// behind the session lock, and the only other local state is the time-slice record.
pub struct NvmlBackend {
    nvml: Nvml,
    /// Held by every NVML call on a GPU (see [`Held`]): calls of this backend run one at a time, and a
    /// handle is looked up by one caller while the others wait for it rather than looking it up too.
    session: Mutex<Session>,
    driver_root: PathBuf,
    library: PathBuf,
    /// The kernel module's `/proc` ([`proc_root_for`]): capability minors, `/proc/devices` majors.
    proc_root: PathBuf,
    /// UUID of each GPU by the index discovery gave it. Every call resolves its GPU by this UUID
    /// (`nvmlDeviceGetHandleByUUID`), so the index is only a name: NVML's indices are PCI-order positions
    /// that shift when a GPU is missing, and a handle by index would then reach another physical GPU.
    uuids: std::sync::RwLock<BTreeMap<u32, String>>,
    /// NVML has no getter for the compute time-slice, so this records what this process last set.
    time_slices: Mutex<HashMap<u32, TimeSlice>>,
}

impl NvmlBackend {
    /// Loads NVML from `driver_root` (see [`library_candidates`]) and initialises it. Fails with
    /// [`GpuError::LibraryNotFound`] naming the paths tried when there is no usable library.
    pub fn new(driver_root: &Path) -> Result<Self> {
        let candidates = library_candidates(driver_root);
        let library = library_path(driver_root);
        let tried = candidates
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(library.as_os_str()))
            .init()
            .map_err(|e| {
                let reason = match e {
                    NvmlError::LibloadingError(e) => format!("{e} (tried {tried})"),
                    NvmlError::DriverNotLoaded => "the NVIDIA kernel driver is not loaded".to_string(),
                    other => other.to_string(),
                };
                GpuError::LibraryNotFound {
                    path: library.display().to_string(),
                    reason,
                }
            })?;
        let proc_root = proc_root_for(driver_root);
        debug!(library = %library.display(), proc_root = %proc_root.display(), "loaded NVML");
        Ok(Self {
            nvml,
            session: Mutex::default(),
            driver_root: driver_root.to_path_buf(),
            library,
            proc_root,
            uuids: Default::default(),
            time_slices: Mutex::new(HashMap::new()),
        })
    }

    /// The NVML handle, for the event set of [`super::nvml_events`].
    pub(super) fn nvml(&self) -> &Nvml {
        &self.nvml
    }

    /// Where the kernel module's `/proc` files are read from.
    pub fn proc_root(&self) -> &Path {
        &self.proc_root
    }

    /// How many MIG mode changes this process has made (see [`MIG_CHANGES`]).
    pub fn mig_changes(&self) -> u64 {
        MIG_CHANGES.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The UUID of the GPU discovery named `gpu`, if it has been seen.
    pub fn uuid_of(&self, gpu: u32) -> Option<String> {
        self.uuids
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&gpu)
            .cloned()
    }

    /// The index discovery gave the GPU with `uuid`.
    pub fn index_of(&self, uuid: &str) -> Option<u32> {
        self.uuids
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find_map(|(i, u)| (u == uuid).then_some(*i))
    }

    /// The GPU discovery named `gpu`, with the session lock held. Its handle is the one kept for it, else
    /// looked up by its UUID (once: the lock makes other callers wait for this lookup rather than repeat
    /// it) and kept; a GPU not yet discovered is looked up by NVML index once and its UUID kept.
    pub(super) fn device(&self, gpu: u32) -> Result<Held<'_>> {
        let session = self.session.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(handle) = session.handles.get(&gpu).copied() {
            let device = handle.device(&self.nvml);
            return Ok(Held { device, session });
        }
        let mut held = match self.uuid_of(gpu) {
            Some(uuid) => {
                let device = self.nvml.device_by_uuid(uuid.as_str()).map_err(|e| match e {
                    NvmlError::NotFound | NvmlError::InvalidArg => GpuError::NotFound(format!(
                        "GPU {gpu} ({uuid}) is no longer on the node; its index may now name another GPU"
                    )),
                    e => wrapper_error("nvmlDeviceGetHandleByUUID", e, format!("GPU {gpu} ({uuid})")),
                })?;
                Held { device, session }
            }
            None => {
                let held = self.device_by_index_locked(gpu, session)?;
                match held.uuid() {
                    Ok(uuid) => self.remember_uuid(gpu, &uuid),
                    // Not kept: without its UUID nothing says the index still names this GPU next time.
                    Err(_) => return Ok(held),
                }
                held
            }
        };
        held.keep_as(gpu);
        Ok(held)
    }

    /// Drops the handle kept for `gpu`, so the next call looks it up again: for a GPU that stopped
    /// answering, whose handle may not survive its reset.
    pub fn forget_handle(&self, gpu: u32) {
        self.session
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .handles
            .remove(&gpu);
    }

    /// Keeps `uuid` as the identity of the GPU named `gpu`.
    pub(super) fn remember_uuid(&self, gpu: u32, uuid: &str) {
        self.uuids
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(gpu, uuid.to_string());
    }

    /// Enumeration only: NVML index `gpu` as the driver numbers GPUs now.
    fn device_by_index(&self, gpu: u32) -> Result<Held<'_>> {
        let session = self.session.lock().unwrap_or_else(|e| e.into_inner());
        self.device_by_index_locked(gpu, session)
    }

    fn device_by_index_locked<'a>(&'a self, gpu: u32, session: MutexGuard<'a, Session>) -> Result<Held<'a>> {
        let device = self.nvml.device_by_index(gpu).map_err(|e| match e {
            NvmlError::InvalidArg => GpuError::NotFound(format!("GPU {gpu}")),
            e => wrapper_error("nvmlDeviceGetHandleByIndex_v2", e, format!("GPU {gpu}")),
        })?;
        Ok(Held { device, session })
    }

    /// GI profiles of a GPU as `(profile id, instance count)`, every index the driver knows
    /// ([`nvml_raw::enumerate_gi_profiles`]); no names, so never the V call.
    fn gi_profiles(&self, device: &Device<'_>) -> Vec<(u32, u32)> {
        nvml_raw::enumerate_gi_profiles(|index| {
            nvml_raw::gpu_instance_profile(&self.nvml, device, index, false)
        })
        .into_iter()
        .filter_map(|(_, p)| p.ok())
        .map(|p| (p.id, p.instance_count))
        .collect()
    }

    /// MIG capability and profiles of one GPU; `None` when it is not MIG-capable. Needs hardware.
    fn mig_info(
        &self,
        gpu: u32,
        device: &Device<'_>,
        pci_device_id: u16,
        raw_arch: Option<u32>,
        gpu_memory_bytes: u64,
    ) -> Option<MigInfo> {
        let mode = match device.mig_mode() {
            Ok(mode) => mode,
            Err(NvmlError::NotSupported) => return None,
            Err(e) => {
                warn!(gpu, error = %e, "cannot read MIG mode; not offering MIG on this GPU");
                return None;
            }
        };
        // In a vGPU guest the host fixes the MIG layout (MIG-backed vGPU profiles): every create would
        // fail, so the GPU is offered whole only (NVIDIA's isDynamicMIGCapable makes the same check).
        if let Ok(GpuVirtualizationMode::Vgpu) = device.virtualization_mode() {
            info!(
                gpu,
                "not offering dynamic MIG: the GPU is a vGPU guest's (nvmlDeviceGetVirtualizationMode = \
                 VGPU), whose MIG layout the host sets"
            );
            return None;
        }
        let mut profiles = Vec::new();
        // Read with MIG off too (the v1 call, as NVIDIA's DRA driver does): a MIG-capable GPU whose MIG
        // mode is off still offers its profiles, and dynamic MIG turns the mode on when a claim needs it.
        let mig_enabled = mode.current == 1;
        let enumerated = nvml_raw::enumerate_gi_profiles(|index| {
            nvml_raw::gpu_instance_profile(&self.nvml, device, index, mig_enabled)
        });
        for (index, info) in enumerated {
            let info = match info {
                Ok(info) => info,
                Err(e) => {
                    warn!(gpu, index, call = e.call, code = e.code, "skipping MIG profile");
                    continue;
                }
            };
            let placements = match nvml_raw::possible_placements(&self.nvml, device, info.id) {
                Ok(p) if !p.is_empty() => p,
                Ok(_) => continue,
                Err(e) => {
                    warn!(
                        gpu,
                        profile_id = info.id,
                        call = e.call,
                        code = e.code,
                        "skipping MIG profile without placements"
                    );
                    continue;
                }
            };
            let name = info.name.clone().unwrap_or_else(|| {
                derive_profile_name(
                    pci_device_id,
                    info.id,
                    index,
                    info.slice_count,
                    info.memory_mib,
                    gpu_memory_bytes,
                )
            });
            profiles.push(MigProfileInfo {
                name,
                profile_id: info.id,
                profile_index: index,
                compute_slices: info.slice_count,
                memory_slices: placements[0].size,
                instance_count: info.instance_count,
                memory_mib: info.memory_mib,
                multiprocessors: info.multiprocessors,
                copy_engines: info.copy_engines,
                decoders: info.decoders,
                encoders: info.encoders,
                jpeg_engines: info.jpeg_engines,
                ofa_engines: info.ofa_engines,
                placements,
            });
        }
        Some(MigInfo {
            enabled: mig_enabled,
            mode_toggle_without_reset: raw_arch.is_some_and(mig_toggle_without_reset),
            memory_slices: profiles
                .iter()
                .flat_map(|p| &p.placements)
                .map(|p| p.start + p.size)
                .max()
                .unwrap_or(0),
            compute_slices: profiles.iter().map(|p| p.compute_slices).max().unwrap_or(0),
            profiles,
        })
    }

    /// SM count: `nvmlDeviceGetNumGpuCores` / cores per SM, else `nvmlDeviceGetAttributes_v2` (documented
    /// for MIG handles only, answered for whole GPUs by some drivers), else the built-in model table.
    /// Needs hardware.
    fn multiprocessors(&self, device: &Device<'_>, cc: (i32, i32), pci_device_id: u16) -> u32 {
        if let (Ok(cores), Some(per_sm)) = (device.num_cores(), cores_per_sm(cc.0, cc.1))
            && cores > 0
        {
            return cores / per_sm;
        }
        if let Ok(attrs) = device.attributes()
            && attrs.multiprocessor_count > 0
        {
            return attrs.multiprocessor_count;
        }
        models::model_by_pci_device_id(pci_device_id)
            .map(|m| m.multiprocessors)
            .unwrap_or(0)
    }

    /// Discovers NVML index `index` (the one place a GPU is looked up by index) and keeps its UUID, by
    /// which a later session finds it, and its handle, which this session's later calls use.
    fn gpu_info(&self, index: u32) -> Result<GpuInfo> {
        let mut device = self.device_by_index(index)?;
        let ctx = |what: &str| format!("read the {what} of GPU {index}");
        let uuid = device
            .uuid()
            .map_err(|e| wrapper_error("nvmlDeviceGetUUID", e, ctx("UUID")))?;
        self.remember_uuid(index, &uuid);
        device.keep_as(index);
        let minor = device
            .minor_number()
            .map_err(|e| wrapper_error("nvmlDeviceGetMinorNumber", e, ctx("minor")))?;
        let product_name = device
            .name()
            .map_err(|e| wrapper_error("nvmlDeviceGetName", e, ctx("name")))?;
        let brand = device
            .brand()
            .map(|b| format!("{b:?}"))
            .unwrap_or_else(|_| "Unknown".to_string());
        let raw_arch = nvml_raw::architecture(&self.nvml, &device).ok();
        let arch = device.architecture().unwrap_or(DeviceArchitecture::Unknown);
        let cc = device
            .cuda_compute_capability()
            .map_err(|e| wrapper_error("nvmlDeviceGetCudaComputeCapability", e, ctx("compute capability")))?;
        let memory = device
            .memory_info()
            .map_err(|e| wrapper_error("nvmlDeviceGetMemoryInfo", e, ctx("memory")))?;
        let pci = device
            .pci_info()
            .map_err(|e| wrapper_error("nvmlDeviceGetPciInfo_v3", e, ctx("PCI info")))?;
        let pci_bus_id = normalize_pci_bus_id(&pci.bus_id);
        let pci_device_id = (pci.pci_device_id >> 16) as u16;
        let sysfs = Path::new("/sys/bus/pci/devices").join(&pci_bus_id);
        let numa_node = fs::read_to_string(sysfs.join("numa_node"))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .or_else(|| device.numa_node_id().ok().map(i64::from))
            .filter(|n| *n >= 0);
        let pcie_root = fs::canonicalize(&sysfs)
            .ok()
            .and_then(|p| pcie_root_from_sysfs_path(&p));
        Ok(GpuInfo {
            index,
            minor,
            uuid,
            product_name,
            brand,
            architecture: architecture_name(raw_arch, arch),
            cuda_compute_capability: format!("{}.{}", cc.major, cc.minor),
            memory_bytes: memory.total,
            multiprocessors: self.multiprocessors(&device, (cc.major, cc.minor), pci_device_id),
            pci_bus_id,
            pcie_root,
            numa_node,
            mig: self.mig_info(index, &device, pci_device_id, raw_arch, memory.total),
            healthy: true,
        })
    }

    /// `nvmlDeviceSetMigMode`, judged by the mode read back (see [`GpuBackend::set_mig_mode`]).
    fn change_mig_mode(&self, gpu: u32, enabled: bool) -> Result<()> {
        let device = self.device(gpu)?;
        let ctx = format!("set MIG mode of GPU {gpu} to {enabled}");
        let status = device
            .set_mig_mode(enabled)
            .map_err(|e| wrapper_error("nvmlDeviceSetMigMode", e, &ctx))?;
        let mode = read_mig_mode(&device, gpu)?;
        match mig_mode_change_outcome(gpu, enabled, status, mode) {
            Err(GpuError::InUse(_)) => {
                let cleared = if mode.pending != mode.current {
                    match device.set_mig_mode(mode.current) {
                        Ok(_) => "the pending mode was set back".to_string(),
                        Err(e) => {
                            warn!(gpu, error = %e, "could not clear the pending MIG mode");
                            format!(
                                "the pending mode could not be set back ({e}); run `nvidia-smi -i {gpu} -mig {}`",
                                u8::from(mode.current)
                            )
                        }
                    }
                } else {
                    "nothing is pending".to_string()
                };
                Err(GpuError::InUse(in_use_message(
                    gpu,
                    enabled,
                    &cleared,
                    &self.holders(&device),
                )))
            }
            other => other,
        }
    }

    /// Why GPU `gpu`'s fabric (NVLink through NVSwitch) keeps it from work now, `None` for a ready, healthy
    /// fabric and for a GPU without one ([`fabric_verdict`]). Read at discovery and by the health probe
    /// ([`crate::gpu::health::sources::NvmlSource`]) every time, so a fabric that completes after the
    /// plugin started, or degrades later, is seen without a restart.
    pub fn fabric_problem(&self, gpu: u32) -> Option<String> {
        let device = self.device(gpu).ok()?;
        match nvml_raw::gpu_fabric_info(&self.nvml, &device) {
            Ok(None) => None,
            Ok(Some(f)) => fabric_verdict(gpu, f.state, f.status, f.health_summary, f.health_mask),
            Err(e) => Some(format!(
                "GPU {gpu}'s fabric state cannot be read ({} returned {}); check that nvidia-fabricmanager \
                 is running (`systemctl status nvidia-fabricmanager`)",
                e.call, e.code
            )),
        }
    }

    /// `pid name` of the processes NVML lists on the GPU (compute and graphics).
    fn holders(&self, device: &Device<'_>) -> Vec<String> {
        let mut procs = device.running_compute_processes().unwrap_or_default();
        procs.extend(device.running_graphics_processes().unwrap_or_default());
        let mut pids: Vec<u32> = procs.iter().map(|p| p.pid).collect();
        pids.sort_unstable();
        pids.dedup();
        pids.into_iter()
            .map(|pid| match self.nvml.sys_process_name(pid, 256) {
                Ok(name) => format!("{pid} {name}"),
                Err(_) => format!("{pid} (name unknown)"),
            })
            .collect()
    }

    fn nvidia_smi(&self) -> Result<PathBuf> {
        let root = DriverRoot::new(&self.driver_root);
        let candidates = root.binary_candidates("nvidia-smi");
        let found = root.find_binary("nvidia-smi").and_then(|p| root.resolve(&p));
        found.ok_or_else(|| GpuError::Tool {
            program: "nvidia-smi".to_string(),
            reason: format!(
                "not found under the driver root (tried {})",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
    }
}

/// `NVML_GPU_FABRIC_STATE_COMPLETED` (nvml.h 3803 of NVIDIA/go-nvml `gen/nvml/nvml.h`).
const FABRIC_STATE_COMPLETED: u8 = 3;
/// `NVML_GPU_FABRIC_HEALTH_SUMMARY_*` (nvml.h 3890-3893); 0 is NOT_SUPPORTED (a driver that does not
/// judge), which is no reason to hold a GPU back.
const FABRIC_HEALTH_UNHEALTHY: u8 = 2;
const FABRIC_HEALTH_LIMITED_CAPACITY: u8 = 3;
/// `NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE` in the mask's lowest two bits (nvml.h 3825-3829).
const FABRIC_MASK_DEGRADED_BW_TRUE: u32 = 1;

/// What happens to a GPU whose fabric is not fit, said once for every message.
const FABRIC_CONSEQUENCE: &str = "the GPU stays published but is reported unhealthy (reason Fabric): the \
     controller taints its devices gpu.tessera.dev/fabric:NoSchedule (or leaves them out where the cluster \
     has no device taints), so no new claim gets it and claims already prepared on it keep running; the \
     health probe reads the fabric every 10 s and the taint goes once it is fit (after the controller's \
     quiet period)";

/// Whether a GPU whose fabric answered `state` / `status` and, where the driver has them, the v3 health
/// summary and the health mask may take work (`None`), else why not. Until fabric manager has registered
/// the GPU (`state` COMPLETED, `status` SUCCESS) CUDA fails on it with error 802 ("system not yet
/// initialized"); a completed fabric whose summary is UNHEALTHY or LIMITED_CAPACITY (or whose mask says
/// degraded bandwidth) has lost NVLink bandwidth or routes that multi-GPU work counts on.
pub fn fabric_verdict(
    gpu: u32,
    state: u8,
    status: u32,
    health_summary: Option<u8>,
    health_mask: Option<u32>,
) -> Option<String> {
    if state == FABRIC_STATE_COMPLETED && status == 0 {
        let degraded_bw = health_mask.is_some_and(|m| m & 3 == FABRIC_MASK_DEGRADED_BW_TRUE);
        let what = match health_summary {
            Some(FABRIC_HEALTH_UNHEALTHY) => "UNHEALTHY",
            Some(FABRIC_HEALTH_LIMITED_CAPACITY) => "LIMITED_CAPACITY",
            _ if degraded_bw => "degraded bandwidth",
            _ => return None,
        };
        let bw = if degraded_bw {
            ", NVLink bandwidth degraded"
        } else {
            ""
        };
        return Some(format!(
            "GPU {gpu}'s NVLink fabric reports health {what}{bw} (nvmlDeviceGetGpuFabricInfoV); check \
             nvidia-fabricmanager and the NVSwitches (`nvidia-smi -q -i {gpu} | grep -A12 Fabric`); \
             {FABRIC_CONSEQUENCE}"
        ));
    }
    let what = match state {
        1 => "not started".to_string(),
        2 => "in progress".to_string(),
        FABRIC_STATE_COMPLETED => format!("completed with error {status}"),
        n => format!("in state {n}"),
    };
    Some(format!(
        "GPU {gpu}'s NVLink fabric registration is {what}, and CUDA fails on it until fabric manager has \
         finished (error 802, system not yet initialized); check that nvidia-fabricmanager is running and \
         healthy (`systemctl status nvidia-fabricmanager`); {FABRIC_CONSEQUENCE}"
    ))
}

/// The error for a MIG mode change answered IN_USE: what was done about the pending mode, the processes
/// NVML lists, and the NVML clients it does not list (DCGM and friends hold the GPU through NVML without a
/// compute context, so `nvidia-smi` shows no process for them).
pub fn in_use_message(gpu: u32, enabled: bool, cleared: &str, processes: &[String]) -> String {
    let wanted = if enabled { "on" } else { "off" };
    let listed = if processes.is_empty() {
        "NVML lists no process on it".to_string()
    } else {
        format!("processes on it: {}", processes.join(", "))
    };
    format!(
        "GPU {gpu} is in use, so MIG mode was not turned {wanted} ({cleared}); {listed}; NVML clients that \
         hold a GPU without being listed are the usual cause: DCGM's nv-hostengine, dcgm-exporter and \
         nvidia-persistenced (the GPU Operator runs the first two: label the node \
         nvidia.com/gpu.deploy.dcgm=false and nvidia.com/gpu.deploy.dcgm-exporter=false to keep them off it); \
         stop them and the claim is prepared on kubelet's next try"
    )
}

/// `nvmlDeviceGetMigMode` of GPU `gpu`'s `device`.
fn read_mig_mode(device: &Device<'_>, gpu: u32) -> Result<MigMode> {
    let mode = device.mig_mode().map_err(|e| {
        wrapper_error(
            "nvmlDeviceGetMigMode",
            e,
            format!("read the MIG mode of GPU {gpu}"),
        )
    })?;
    Ok(MigMode {
        current: mode.current == 1,
        pending: mode.pending == 1,
    })
}

fn to_nvml_mode(mode: ComputeMode) -> NvmlComputeMode {
    match mode {
        ComputeMode::Default => NvmlComputeMode::Default,
        ComputeMode::ExclusiveProcess => NvmlComputeMode::ExclusiveProcess,
        ComputeMode::Prohibited => NvmlComputeMode::Prohibited,
    }
}

impl GpuBackend for NvmlBackend {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn driver_root(&self) -> &Path {
        &self.driver_root
    }

    /// Needs hardware.
    fn discover(&self) -> Result<NodeGpus> {
        let count = self
            .nvml
            .device_count()
            .map_err(|e| wrapper_error("nvmlDeviceGetCount_v2", e, "count GPUs"))?;
        // Entries are overwritten, never cleared first: a prepare running meanwhile keeps finding its GPU.
        let (gpus, unusable) = discover_each(count, |i| self.gpu_info(i));
        // A GPU whose fabric is not fit is kept: the health source reports it (and keeps reading it), which
        // taints it until the fabric completes instead of leaving it out until the plugin restarts.
        for gpu in &gpus {
            if let Some(reason) = self.fabric_problem(gpu.index) {
                warn!(gpu = gpu.index, %reason, "GPU fabric not fit for work yet");
            }
        }
        for u in &unusable {
            warn!(gpu = u.index, reason = %u.reason, "leaving a GPU out of the inventory");
        }
        Ok(NodeGpus {
            driver_version: self.nvml.sys_driver_version().ok(),
            cuda_driver_version: self.nvml.sys_cuda_driver_version().ok().map(format_cuda_version),
            gpus,
            unusable,
        })
    }

    /// Needs hardware.
    fn mig_mode(&self, gpu: u32) -> Result<MigMode> {
        read_mig_mode(&*self.device(gpu)?, gpu)
    }

    /// `activationStatus` can be non-zero on success (gpu-mig-mps.md 3.3), so the outcome is judged by
    /// reading the mode back. Answered IN_USE, the pending mode is set back to the current one (else the
    /// GPU would come up in the new mode at its next reset or reboot, under nobody's control) and the
    /// error names who likely holds the GPU.
    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<()> {
        let result = self.change_mig_mode(gpu, enabled);
        // After the change, so the health source cannot register again before the toggle dropped the
        // registration it replaces.
        MIG_CHANGES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        result
    }

    /// Needs hardware.
    fn create_gpu_instance(&self, gpu: u32, profile_id: u32, placement: MigPlacement) -> Result<u32> {
        let device = self.device(gpu)?;
        nvml_raw::create_gpu_instance(&self.nvml, &device, profile_id, placement).map_err(|e| {
            raw_error(
                e,
                format!(
                    "create GPU instance of profile {profile_id} at {}:{} on GPU {gpu}",
                    placement.start, placement.size
                ),
            )
        })
    }

    /// Needs hardware.
    fn create_compute_instance(&self, gpu: u32, gpu_instance: u32) -> Result<ComputeInstance> {
        let device = self.device(gpu)?;
        let ci = nvml_raw::create_full_compute_instance(&self.nvml, &device, gpu_instance).map_err(|e| {
            raw_error(
                e,
                format!("create compute instance in GPU instance {gpu_instance} on GPU {gpu}"),
            )
        })?;
        Ok(ComputeInstance {
            id: ci.id,
            profile_id: ci.profile_id,
            uuid: ci.uuid,
        })
    }

    /// Needs hardware.
    fn destroy_compute_instance(&self, gpu: u32, gpu_instance: u32, compute_instance: u32) -> Result<()> {
        let device = self.device(gpu)?;
        nvml_raw::destroy_compute_instance(&self.nvml, &device, gpu_instance, compute_instance).map_err(|e| {
            raw_error(
                e,
                format!(
                    "destroy compute instance {compute_instance} of GPU instance {gpu_instance} on GPU {gpu}"
                ),
            )
        })
    }

    /// Needs hardware.
    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance: u32) -> Result<()> {
        let device = self.device(gpu)?;
        nvml_raw::destroy_gpu_instance(&self.nvml, &device, gpu_instance)
            .map_err(|e| raw_error(e, format!("destroy GPU instance {gpu_instance} on GPU {gpu}")))
    }

    /// Needs hardware.
    fn list_gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>> {
        if !self.mig_mode(gpu)?.current {
            return Ok(Vec::new());
        }
        let device = self.device(gpu)?;
        let gis = nvml_raw::gpu_instances(&self.nvml, &device, &self.gi_profiles(&device))
            .map_err(|e| raw_error(e, format!("list GPU instances of GPU {gpu}")))?;
        Ok(gis
            .into_iter()
            .map(|gi| GpuInstance {
                id: gi.id,
                profile_id: gi.profile_id,
                placement: gi.placement,
                compute_instances: gi
                    .compute_instances
                    .into_iter()
                    .map(|ci| ComputeInstance {
                        id: ci.id,
                        profile_id: ci.profile_id,
                        uuid: ci.uuid,
                    })
                    .collect(),
            })
            .collect())
    }

    /// Needs hardware.
    fn compute_mode(&self, gpu: u32) -> Result<ComputeMode> {
        let mode = self.device(gpu)?.compute_mode().map_err(|e| {
            wrapper_error(
                "nvmlDeviceGetComputeMode",
                e,
                format!("read compute mode of GPU {gpu}"),
            )
        })?;
        Ok(match mode {
            NvmlComputeMode::Default => ComputeMode::Default,
            // EXCLUSIVE_THREAD is no longer supported by drivers; it behaves as exclusive.
            NvmlComputeMode::ExclusiveProcess | NvmlComputeMode::ExclusiveThread => {
                ComputeMode::ExclusiveProcess
            }
            NvmlComputeMode::Prohibited => ComputeMode::Prohibited,
        })
    }

    /// Needs hardware.
    fn set_compute_mode(&self, gpu: u32, mode: ComputeMode) -> Result<()> {
        let mut device = self.device(gpu)?;
        device.set_compute_mode(to_nvml_mode(mode)).map_err(|e| {
            wrapper_error(
                "nvmlDeviceSetComputeMode",
                e,
                format!("set compute mode of GPU {gpu} to {mode:?}"),
            )
        })
    }

    fn time_slice(&self, gpu: u32) -> Result<TimeSlice> {
        self.device(gpu)?;
        let slices = self.time_slices.lock().unwrap_or_else(|p| p.into_inner());
        Ok(slices.get(&gpu).copied().unwrap_or(TimeSlice::Default))
    }

    /// Needs hardware and `nvidia-smi` under the driver root. Arguments are passed directly, never through a
    /// shell; `LD_PRELOAD` points nvidia-smi at the driver root's NVML as NVIDIA's driver does.
    fn set_time_slice(&self, gpu: u32, slice: TimeSlice) -> Result<()> {
        let uuid = self
            .device(gpu)?
            .uuid()
            .map_err(|e| wrapper_error("nvmlDeviceGetUUID", e, format!("read the UUID of GPU {gpu}")))?;
        let smi = self.nvidia_smi()?;
        let mut cmd = Command::new(&smi);
        cmd.args([
            "compute-policy",
            "-i",
            &uuid,
            "--set-timeslice",
            &(slice as u32).to_string(),
        ]);
        if self.library.is_absolute() && self.driver_root != Path::new("/") {
            cmd.env("LD_PRELOAD", &self.library);
        }
        let tool_err = |reason: String| GpuError::Tool {
            program: smi.display().to_string(),
            reason,
        };
        let out = cmd.output().map_err(|e| tool_err(e.to_string()))?;
        if !out.status.success() {
            let text = String::from_utf8_lossy(if out.stderr.is_empty() {
                &out.stdout
            } else {
                &out.stderr
            });
            return Err(tool_err(format!("{}: {}", out.status, text.trim())));
        }
        self.time_slices
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(gpu, slice);
        Ok(())
    }

    /// Needs hardware for the GPU minor; the `/proc` parsing is tested.
    fn mig_capability_minors(
        &self,
        gpu: u32,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<(u32, u32)> {
        let minor = self.device(gpu)?.minor_number().map_err(|e| {
            wrapper_error(
                "nvmlDeviceGetMinorNumber",
                e,
                format!("read the minor of GPU {gpu}"),
            )
        })?;
        mig_capability_minors_from_proc(&self.proc_root, minor, gpu_instance, compute_instance)
    }

    fn char_device(&self, path: &str) -> Result<CharDevice> {
        char_device_from_host(path, &self.proc_root)
    }

    /// Needs hardware. On a MIG-enabled GPU the parent's process list carries each process's GI and CI ids.
    fn usage(&self, query: &super::usage::UsageQuery<'_>) -> Result<super::usage::DeviceUsage> {
        self.device_usage(query)
    }

    fn processes(&self, gpu: u32, mig: Option<(u32, u32)>) -> Result<Vec<u32>> {
        let device = self.device(gpu)?;
        let ctx = format!("list processes on GPU {gpu}");
        let mut procs = device
            .running_compute_processes()
            .map_err(|e| wrapper_error("nvmlDeviceGetComputeRunningProcesses_v3", e, &ctx))?;
        match device.running_graphics_processes() {
            Ok(g) => procs.extend(g),
            Err(NvmlError::NotSupported) => {}
            Err(e) => return Err(wrapper_error("nvmlDeviceGetGraphicsRunningProcesses_v3", e, &ctx)),
        }
        let mut pids: Vec<u32> = procs
            .into_iter()
            .filter(|p| match mig {
                None => true,
                Some((gi, ci)) => p.gpu_instance_id == Some(gi) && p.compute_instance_id == Some(ci),
            })
            .map(|p| p.pid)
            .collect();
        pids.sort_unstable();
        pids.dedup();
        Ok(pids)
    }
}

// === impl NvmlBackend: usage ===

impl NvmlBackend {
    /// The MPS clients on `device`: `nvmlDeviceGetMPSComputeRunningProcesses_v3` lists the processes
    /// "utilizing MPS" (nvml.h 7447-7488), which the compute list leaves out: it names their
    /// `nvidia-cuda-mps-server` instead, so without this list no process of an MPS share is found. A
    /// library without the call (FUNCTION_NOT_FOUND) or a GPU without it (NOT_SUPPORTED: pre-Volta) has
    /// none. nvml-wrapper sizes its buffer to the count it asked just before, so a client that starts in
    /// between answers INSUFFICIENT_SIZE: the list is asked again.
    fn mps_clients(
        device: &Device<'_>,
        ctx: &str,
    ) -> Result<Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>> {
        const CALL: &str = "nvmlDeviceGetMPSComputeRunningProcesses_v3";
        const TRIES: usize = 3;
        for _ in 1..TRIES {
            match device.mps_running_compute_processes() {
                Err(NvmlError::InsufficientSize(_)) => continue,
                Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => return Ok(Vec::new()),
                other => return other.map_err(|e| wrapper_error(CALL, e, ctx)),
            }
        }
        device
            .mps_running_compute_processes()
            .map_err(|e| wrapper_error(CALL, e, ctx))
    }

    /// Whole GPU: `nvmlDeviceGetUtilizationRates` and `nvmlDeviceGetMemoryInfo`. MIG device: the memory of
    /// the processes NVML places on its GPU and compute instance, and no utilization (NVML reports none on
    /// MIG-enabled GPUs). Processes: `nvmlDeviceGetComputeRunningProcesses` and
    /// `nvmlDeviceGetMPSComputeRunningProcesses` (memory; see [`Self::mps_clients`]) joined with
    /// `nvmlDeviceGetProcessUtilization` (SM percent, samples since one second ago). NVML's PIDs are the
    /// host's, so owners are left to the metrics, which look them up in the host's `/proc` (`--host-proc`),
    /// not in this process's, which in a pod is another PID namespace. An MPS server stays among the
    /// processes: it runs in the MPS supervisor's pod (or the plugin's), which no claim is reserved for, so
    /// the metrics charge it to none.
    fn device_usage(&self, query: &super::usage::UsageQuery<'_>) -> Result<super::usage::DeviceUsage> {
        use super::usage::{DeviceUsage, ProcessUsage};
        use nvml_wrapper::enums::device::UsedGpuMemory;

        let device = self.device(query.gpu)?;
        let ctx = format!("read the usage of GPU {}", query.gpu);
        let mut procs = device
            .running_compute_processes()
            .map_err(|e| wrapper_error("nvmlDeviceGetComputeRunningProcesses_v3", e, &ctx))?;
        let clients = Self::mps_clients(&device, &ctx)?;
        // Listed once each: a client the driver also put in the compute list keeps its MPS entry.
        procs.retain(|p| !clients.iter().any(|c| c.pid == p.pid));
        procs.extend(clients);
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| (d.as_micros() as u64).saturating_sub(1_000_000))
            .unwrap_or_default();
        // NOT_FOUND: no process ran in the window; NOT_SUPPORTED: MIG mode or an old GPU.
        let samples = device.process_utilization_stats(since).unwrap_or_default();
        let processes: Vec<ProcessUsage> = procs
            .into_iter()
            .filter(|p| match query.mig {
                None => true,
                Some((gi, ci)) => p.gpu_instance_id == Some(gi) && p.compute_instance_id == Some(ci),
            })
            .map(|p| ProcessUsage {
                pid: p.pid,
                sm_percent: samples.iter().filter(|s| s.pid == p.pid).map(|s| s.sm_util).max(),
                memory_used_bytes: match p.used_gpu_memory {
                    UsedGpuMemory::Used(bytes) => Some(bytes),
                    UsedGpuMemory::Unavailable => None,
                },
                owner: None,
            })
            .collect();
        if query.mig.is_some() {
            return Ok(DeviceUsage {
                utilization_percent: None,
                memory_used_bytes: Some(processes.iter().filter_map(|p| p.memory_used_bytes).sum()),
                processes,
            });
        }
        let utilization = device
            .utilization_rates()
            .map_err(|e| wrapper_error("nvmlDeviceGetUtilizationRates", e, &ctx))?;
        let memory = device
            .memory_info()
            .map_err(|e| wrapper_error("nvmlDeviceGetMemoryInfo", e, &ctx))?;
        Ok(DeviceUsage {
            utilization_percent: Some(utilization.gpu),
            memory_used_bytes: Some(memory.used),
            processes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_fails_with_library_not_found_naming_the_paths_tried() {
        let root = tempfile::tempdir().unwrap();
        match NvmlBackend::new(root.path()) {
            Err(e @ GpuError::LibraryNotFound { .. }) => {
                let msg = e.to_string();
                let tried = root.path().join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
                assert!(msg.contains(&tried.display().to_string()), "{msg}");
                assert!(msg.contains("--driver-root"), "{msg}");
            }
            Err(other) => panic!("expected LibraryNotFound, got {other}"),
            // A machine with a system-wide NVIDIA driver loads the bare library name after the root misses.
            Ok(b) => assert_eq!(b.library, PathBuf::from(LIBRARY_NAME)),
        }
    }

    #[test]
    fn the_library_is_looked_for_under_the_driver_root_first() {
        let c = library_candidates(Path::new("/run/nvidia/driver"));
        assert_eq!(
            c[0],
            PathBuf::from("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
        );
        assert_eq!(
            c[1],
            PathBuf::from("/run/nvidia/driver/usr/lib64/libnvidia-ml.so.1")
        );
        assert_eq!(c.last().unwrap(), &PathBuf::from("libnvidia-ml.so.1"));
    }

    #[test]
    fn architectures_newer_than_nvml_wrapper_knows_toggle_mig_without_reset() {
        assert!(!mig_toggle_without_reset(7), "Ampere needs a reset");
        assert!(mig_toggle_without_reset(9) && mig_toggle_without_reset(10));
        assert!(
            mig_toggle_without_reset(11),
            "a future architecture is Hopper or newer"
        );
        assert!(!mig_toggle_without_reset(ARCH_UNKNOWN));
        assert_eq!(
            architecture_name(Some(11), DeviceArchitecture::Unknown),
            "Architecture11"
        );
        assert_eq!(architecture_name(Some(9), DeviceArchitecture::Hopper), "Hopper");
    }

    #[test]
    fn an_errors_nvml_code_is_the_code_it_was_made_from() {
        for code in [2, 3, 4, 6, 15, 16, 19, 23, 1, 9, 18, 999] {
            assert_eq!(code_of(&error_for_code("nvmlX", code, "GPU 0")), code, "{code}");
        }
    }

    #[test]
    fn nvml_return_codes_map_to_the_matching_errors() {
        let e = |code| error_for_code("nvmlX", code, "ctx");
        assert!(matches!(e(23), GpuError::InsufficientResources(_)));
        assert!(matches!(e(19), GpuError::InUse(_)));
        assert!(matches!(e(6), GpuError::NotFound(_)));
        assert!(matches!(e(3), GpuError::NotSupported(_)));
        assert!(matches!(e(2), GpuError::InvalidArgument(_)));
        assert!(matches!(e(4), GpuError::NoPermission(_)));
        assert!(matches!(e(15), GpuError::GpuLost(_)));
        assert!(matches!(e(16), GpuError::ResetRequired(_)));
        assert!(matches!(e(13), GpuError::NotSupported(_)));
        assert!(matches!(
            e(999),
            GpuError::Nvml {
                call: "nvmlX",
                code: 999
            }
        ));
        assert!(e(23).to_string().contains("nvmlX returned 23"));
        assert!(matches!(
            wrapper_error("c", NvmlError::InUse, "x"),
            GpuError::InUse(_)
        ));
        assert!(matches!(
            wrapper_error("c", NvmlError::UnexpectedVariant(23), "x"),
            GpuError::InsufficientResources(_)
        ));
    }

    #[test]
    fn versions_and_bus_ids_are_reported_in_kubernetes_spelling() {
        assert_eq!(format_cuda_version(13000), "13.0");
        assert_eq!(format_cuda_version(12080), "12.8");
        assert_eq!(normalize_pci_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_pci_bus_id("0000:3b:00.0"), "0000:3b:00.0");
        assert_eq!(
            pcie_root_from_sysfs_path(Path::new("/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"))
                .as_deref(),
            Some("pci0000:3a")
        );
        assert_eq!(
            pcie_root_from_sysfs_path(Path::new("/sys/devices/platform/x")),
            None
        );
    }

    #[test]
    fn profile_names_come_from_the_model_table_or_are_derived() {
        const GB80: u64 = 81559 << 20;
        assert_eq!(derive_profile_name(0x2335, 19, 0, 1, 16384, 0), "1g.18gb");
        assert_eq!(derive_profile_name(0x2330, 20, 7, 1, 9984, 0), "1g.10gb+me");
        assert_eq!(derive_profile_name(0x1234, 19, 0, 1, 9984, GB80), "1g.10gb");
        assert_eq!(derive_profile_name(0x1234, 20, 7, 1, 9984, GB80), "1g.10gb+me");
        assert_eq!(derive_profile_name(0x1234, 40, 0xD, 1, 11000, 0), "1g.11gb-me");
        // A GPU the table lacks, of 95830 MiB: a 1g of 11008 MiB (10.75 GiB) is an eighth of it by NVIDIA's
        // rule, 12 GB of 94, where its GiB rounded up would say 11.
        assert_eq!(
            derive_profile_name(0x1234, 19, 0, 1, 11008, 95830 << 20),
            "1g.12gb"
        );
    }

    #[test]
    fn derived_profile_names_are_the_drivers_names_of_every_known_model() {
        // With MIG off the driver gives no name (only v1 answers) and with MIG on it does: a model the table
        // lacks must get the same name both ways, which NVIDIA's rule gives for every profile tessera knows,
        // the H200's 1g.18gb of 16 GiB included.
        for model in models::MODELS {
            for p in model.mig_profiles {
                let derived = derive_profile_name(
                    0xFFFF,
                    p.id,
                    p.index,
                    p.compute_slices,
                    p.memory_mib,
                    model.memory_mib << 20,
                );
                assert_eq!(derived, p.name, "{} index {}", model.name, p.index);
            }
        }
    }

    #[test]
    fn sm_counts_follow_cores_per_sm_of_the_compute_capability() {
        assert_eq!(6912 / cores_per_sm(8, 0).unwrap(), 108);
        assert_eq!(16896 / cores_per_sm(9, 0).unwrap(), 132);
        assert_eq!(18944 / cores_per_sm(10, 0).unwrap(), 148);
        assert_eq!(cores_per_sm(3, 5), None);
    }

    #[test]
    fn capability_minors_come_from_proc_access_files_never_from_a_formula() {
        let proc_root = tempfile::tempdir().unwrap();
        let gi = proc_root.path().join("driver/nvidia/capabilities/gpu1/mig/gi2");
        fs::create_dir_all(gi.join("ci0")).unwrap();
        fs::write(
            gi.join("access"),
            "DeviceFileMinor: 156\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
        )
        .unwrap();
        fs::write(
            gi.join("ci0/access"),
            "DeviceFileMinor: 157\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
        )
        .unwrap();
        assert_eq!(
            mig_capability_minors_from_proc(proc_root.path(), 1, 2, 0).unwrap(),
            (156, 157)
        );
        // Defect: a missing access file fell back to the mig-minors formula ((3, 4) here) in silence.
        let missing = mig_capability_minors_from_proc(proc_root.path(), 0, 0, 0).unwrap_err();
        let msg = missing.to_string();
        let file = proc_root
            .path()
            .join("driver/nvidia/capabilities/gpu0/mig/gi0/access");
        assert!(msg.contains(&file.display().to_string()), "{msg}");
        assert!(msg.contains("nvidia-smi mig -lgi"), "names a way to check: {msg}");
        fs::remove_file(gi.join("ci0/access")).unwrap();
        let no_ci = mig_capability_minors_from_proc(proc_root.path(), 1, 2, 0).unwrap_err();
        assert!(no_ci.to_string().contains("gi2/ci0/access"), "{no_ci}");
        fs::write(gi.join("ci0/access"), "DeviceFileMode: 292\n").unwrap();
        let unparsed = mig_capability_minors_from_proc(proc_root.path(), 1, 2, 0).unwrap_err();
        assert!(unparsed.to_string().contains("DeviceFileMinor"), "{unparsed}");
    }

    #[test]
    fn a_simulated_driver_root_has_its_proc_under_tessera_sim() {
        let root = tempfile::tempdir().unwrap();
        assert_eq!(proc_root_for(root.path()), PathBuf::from("/proc"));
        fs::create_dir_all(root.path().join("tessera-sim")).unwrap();
        fs::write(root.path().join("tessera-sim/kernel.json"), "{}").unwrap();
        assert_eq!(proc_root_for(root.path()), root.path().join("tessera-sim/proc"));
    }

    #[test]
    fn a_gpu_is_offered_only_once_its_fabric_completed_successfully() {
        assert_eq!(fabric_verdict(0, 3, 0, None, None), None);
        for (state, status) in [(1, 0), (2, 0), (3, 1)] {
            let why = fabric_verdict(5, state, status, None, None).unwrap();
            assert!(why.contains("GPU 5") && why.contains("fabric manager"), "{why}");
            assert!(
                why.contains("NoSchedule") && !why.contains("later discovery"),
                "{why}"
            );
        }
    }

    #[test]
    fn a_completed_fabric_is_judged_by_its_v3_health_summary_where_the_driver_gives_one() {
        // nvml.h 3890: 0 is NOT_SUPPORTED, a driver that does not judge; 1 HEALTHY.
        assert_eq!(fabric_verdict(0, 3, 0, Some(0), Some(0)), None);
        assert_eq!(fabric_verdict(0, 3, 0, Some(1), Some(2)), None);
        let limited = fabric_verdict(1, 3, 0, Some(3), Some(1)).unwrap();
        assert!(
            limited.contains("LIMITED_CAPACITY") && limited.contains("bandwidth degraded"),
            "{limited}"
        );
        assert!(
            fabric_verdict(1, 3, 0, Some(2), None)
                .unwrap()
                .contains("UNHEALTHY")
        );
        // A v2-only driver has the mask but no summary.
        assert!(
            fabric_verdict(1, 3, 0, None, Some(1))
                .unwrap()
                .contains("degraded bandwidth")
        );
        assert!(
            fabric_verdict(2, 2, 0, Some(1), None)
                .unwrap()
                .contains("in progress"),
            "the state decides before the summary"
        );
    }

    #[test]
    fn an_in_use_mig_change_names_the_processes_and_the_usual_nvml_clients() {
        let msg = in_use_message(
            2,
            true,
            "the pending mode was set back",
            &["4242 nv-hostengine".into()],
        );
        for want in [
            "4242 nv-hostengine",
            "dcgm-exporter",
            "nvidia-persistenced",
            "set back",
        ] {
            assert!(msg.contains(want), "{want}: {msg}");
        }
        assert!(
            !msg.contains("nvidia-smi -i"),
            "nvidia-smi lists no NVML clients: {msg}"
        );
    }

    #[test]
    fn char_devices_missing_on_the_host_are_numbered_from_proc_devices() {
        let proc_root = tempfile::tempdir().unwrap();
        fs::write(
            proc_root.path().join("devices"),
            "Character devices:\n  1 mem\n195 nvidia-frontend\n236 nvidia-caps\n505 nvidia-uvm\n\nBlock devices:\n  8 sd\n",
        )
        .unwrap();
        let d = |p| char_device_from_host(p, proc_root.path()).map(|c| (c.major, c.minor));
        assert_eq!(d("/dev/nvidia-caps/nvidia-cap21").unwrap(), (236, 21));
        assert_eq!(d("/dev/nvidia-uvm-tools").unwrap(), (505, 1));
        assert_eq!(d("/dev/nvidia7").unwrap(), (195, 7));
        assert!(matches!(d("/dev/nvidia-bogus"), Err(GpuError::NotFound(_))));
        // An existing node is stat'ed: /dev/null is 1:3 on every Linux.
        assert_eq!(d("/dev/null").unwrap(), (1, 3));
        assert!(matches!(d("/"), Err(GpuError::InvalidArgument(_))));
    }

    #[test]
    fn a_missing_uvm_device_of_a_module_that_is_not_loaded_names_the_modprobe_that_fixes_it() {
        let proc_root = tempfile::tempdir().unwrap();
        fs::write(
            proc_root.path().join("devices"),
            "Character devices:\n195 nvidia-frontend\n\nBlock devices:\n",
        )
        .unwrap();
        let got = char_device_from_host("/dev/nvidia-uvm", proc_root.path());
        if Path::new("/dev/nvidia-uvm").exists() {
            // A GPU machine: the node is there and numbered from itself.
            assert!(got.is_ok(), "{got:?}");
            return;
        }
        let e = got.unwrap_err().to_string();
        assert!(
            e.contains("/dev/nvidia-uvm") && e.contains("not loaded") && e.contains("modprobe nvidia-uvm"),
            "{e}"
        );
    }
}
