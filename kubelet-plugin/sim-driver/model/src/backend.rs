//! Simulated GPUs: the NVML state machine without the hardware.
//!
//! The node's GPUs come from a YAML node file (`gpus: [{model: H100-SXM5-80GB, count: 8}]`); their mutable
//! hardware state (MIG mode, GPU and compute instances, compute mode, time-slice, running processes) lives in
//! `<state dir>/simulated-gpus.json`. Every operation takes an exclusive `flock` on
//! `<state dir>/simulated-gpus.lock`, re-reads the state file, applies the NVML rules of `gpu-mig-mps.md`
//! 3.8, and on change writes the file atomically (temp file, fsync of it, rename). So the state survives a
//! plugin restart or SIGKILL the way hardware does, several processes (a plugin and a test harness) see one
//! consistent GPU, and a crash between two calls leaves the same half-done state a real GPU would.
//!
//! Durability is the hardware's, no more: a process crash keeps the page cache, so the renamed file is
//! there for the next process without any sync. The fsync of the temp file is for a power loss only, so
//! that the file is whole (an older version or the newer one) and the next start does not stop at a torn
//! file; the directory is not fsynced, because which version comes back after a power loss does not matter
//! to hardware whose MIG instances a reboot erases anyway (the plugin's checkpoint of the old boot is not
//! trusted either, see the plugin's `node::checkpoint`).
//!
//! The state file is also the e2e interface: a harness may add a PID to `processes` of a GPU or compute
//! instance (under the same lock) to make the GPU busy.
//!
//! The backend's own time is the *simulated NVML time*: every call that reads or changes the state (lock,
//! read, parse, the NVML rules, write) is timed, and after each one the totals of this backend since it was
//! opened are written to `<state dir>/simulated-nvml-time.json` as `{"calls": N, "nanos": T}` (temp file and
//! rename, no sync), so a benchmark can subtract exactly the time a real GPU's NVML would have taken
//! instead. Calls answered from memory (canned device numbers) are not counted.
//!
//! ## The simulated kernel
//!
//! The state directory is also a *simulated kernel* directory K: `kernel.json` names the node and its GPUs
//! (the inventory a real kernel module would find on the PCI bus), and `proc/` holds what the NVIDIA kernel
//! module shows in `/proc` (`devices`, `driver/nvidia/version`, and the MIG capability `access` files of
//! every live GPU and compute instance, kept equal to the state under the same lock). The driver root's
//! libraries built from this repository (`libnvidia-ml.so.1`, `libcuda.so.1`, see [`crate::driver_root`])
//! find K by walking up from their own path to `<dir>/tessera-sim/kernel.json` ([`find_kernel_from`]) and
//! open it with [`SimulatedBackend::open_kernel`]: the same model, the same state, the same faults, through
//! NVML's C ABI. Where K cannot be written (a container's read-only mount) the backend is read-only: it
//! takes no lock, and every change fails with [`GpuError::NoPermission`] as NVML does for an unprivileged
//! process.

use std::{
    fs::{self, File, OpenOptions},
    io::Write,
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tessera_api::{GpuInfo, MigPlacement};
use tracing::warn;

use tessera_gpu_api::{
    CharDevice, ComputeInstance, ComputeMode, GpuBackend, GpuError, GpuInstance, MigMode, NodeGpus, Result,
    TimeSlice,
    models::{self, GpuModel, MigProfile},
};

use crate::kernel::{
    DEV_ROOT_ENV, KERNEL_DIR_NAME, KERNEL_ENV, KERNEL_FILE, KERNEL_VERSION, KERNEL_VERSION_FILE, PROC_DIR,
    PROC_GENERATION_FILE, SIMULATED_CUDA_DRIVER_VERSION, SIMULATED_DRIVER_VERSION, kernel_version_text,
};
use crate::sessions::other_holders;

const STATE_FILE: &str = "simulated-gpus.json";
const LOCK_FILE: &str = "simulated-gpus.lock";
/// The backend's own time so far (see the module comment).
pub const NVML_TIME_FILE: &str = "simulated-nvml-time.json";
const STATE_VERSION: u32 = 1;
/// GPU-instance ids run 0..=14, compute-instance ids 0..=7 (`mig-minors` has gi0..gi14, ci0..ci7).
const MAX_GPU_INSTANCE_ID: u32 = 14;
const MAX_COMPUTE_INSTANCE_ID: u32 = 7;

/// The node file: which GPUs the simulated node has.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    pub gpus: Vec<GpuGroup>,
    /// How long the simulated driver takes for MIG reconfiguration (none by default) and for a handle
    /// lookup by UUID (a little by default).
    #[serde(default, skip_serializing_if = "Latencies::is_default")]
    pub latencies: Latencies,
}

/// Time the simulated driver spends in each slow operation, in milliseconds: the MIG reconfiguration
/// calls (while the hardware state's lock is held: a real driver serializes MIG changes too), an MPS
/// control daemon's start (`nvidia-cuda-mps-control`, before it serves), a process's first CUDA context
/// (`libcuda.so.1`) and `nvmlDeviceGetHandleByUUID`. Zero by default but the last, so tests that do not
/// ask pay nothing; the fault suite sets them to kill a plugin inside a prepare, and the cold-start
/// benchmark to [`Latencies::HARDWARE_LIKE`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Latencies {
    #[serde(default)]
    pub mig_mode_change_ms: u64,
    #[serde(default)]
    pub gpu_instance_create_ms: u64,
    #[serde(default)]
    pub gpu_instance_destroy_ms: u64,
    #[serde(default)]
    pub compute_instance_create_ms: u64,
    #[serde(default)]
    pub compute_instance_destroy_ms: u64,
    #[serde(default)]
    pub mps_daemon_start_ms: u64,
    #[serde(default)]
    pub first_context_ms: u64,
    /// What one `nvmlDeviceGetHandleByUUID` costs *per caller inside the call at once* (in this process):
    /// with `n` threads looking handles up together each waits `n` times this. NVIDIA's DRA driver
    /// (`cmd/gpu-kubelet-plugin/nvlib.go`, the comment above `deviceLib.Init`): "Getting a device handle by
    /// UUID can take O(10 s) when done concurrently ... cache handles, serialize NVML calls". Not zero by
    /// default ([`Latencies::DEFAULT_HANDLE_BY_UUID_MS`]), so code that looks handles up again and again
    /// pays for it in every test.
    #[serde(default = "default_handle_by_uuid_ms")]
    pub handle_by_uuid_ms: u64,
}

fn default_handle_by_uuid_ms() -> u64 {
    Latencies::DEFAULT_HANDLE_BY_UUID_MS
}

impl Default for Latencies {
    fn default() -> Self {
        Self {
            mig_mode_change_ms: 0,
            gpu_instance_create_ms: 0,
            gpu_instance_destroy_ms: 0,
            compute_instance_create_ms: 0,
            compute_instance_destroy_ms: 0,
            mps_daemon_start_ms: 0,
            first_context_ms: 0,
            handle_by_uuid_ms: Self::DEFAULT_HANDLE_BY_UUID_MS,
        }
    }
}

impl Latencies {
    /// Estimates of what an H100 costs, for benchmarks: estimates, not measurements. Sources (the plugin
    /// README's "Latencies" section lists them with quotes):
    /// * MIG mode change on Hopper, no reset: ~2 s, the set-mode step of mig-manager logs on A100
    ///   (NVIDIA/gpu-operator#1606, #2376); no Hopper timing is public.
    /// * GPU and compute instance create/destroy: no public number; DCGM shows a new instance "1 or 2
    ///   seconds" after it is made (NVIDIA/DCGM#230), a reporting delay that bounds it. 1 s, 0.5 s, 0.2 s,
    ///   0.1 s are placeholders in that range.
    /// * MPS control daemon start: its log lines share one millisecond (NVIDIA/k8s-dra-driver-gpu#1153,
    ///   NVIDIA/k8s-device-plugin#1614); 10 ms plus the process's launch.
    /// * First CUDA context of a process on a whole GPU with persistence mode on: ~80 ms with one GPU
    ///   visible to cuInit (rapidsai/cudf#627); 500 ms taken, as the usual expectation
    ///   (NVIDIA/nvtrust#113), without a context in that number.
    /// * `nvmlDeviceGetHandleByUUID`: "O(10 s) when done concurrently" (NVIDIA's DRA driver, `nvlib.go`);
    ///   1 s per caller makes 8 concurrent lookups (one per GPU of an HGX node) take 8 s each.
    pub const HARDWARE_LIKE: Self = Self {
        mig_mode_change_ms: 2000,
        gpu_instance_create_ms: 1000,
        gpu_instance_destroy_ms: 500,
        compute_instance_create_ms: 200,
        compute_instance_destroy_ms: 100,
        mps_daemon_start_ms: 10,
        first_context_ms: 500,
        handle_by_uuid_ms: 1000,
    };

    /// The default `handleByUuidMs`: small, but enough that a plugin looking a handle up on every call
    /// under a scrape is slower than one that caches it.
    pub const DEFAULT_HANDLE_BY_UUID_MS: u64 = 1;

    fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Spends `ms` as the driver would, in the calling thread.
    pub fn charge(ms: u64) {
        if ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
    }

    /// The latencies of the simulated kernel found from `program` (a driver-root tool or library, as
    /// [`locate_kernel`] finds it); none when there is no kernel or it does not read.
    pub fn of_kernel_near(program: &Path) -> Self {
        locate_kernel(program)
            .and_then(|dir| KernelSpec::read(&dir).ok())
            .map(|k| k.node.latencies)
            .unwrap_or_default()
    }
}

/// `count` GPUs of one model; several groups make a mixed node, indexed in file order. Every field but
/// `model` is optional and defaults to an ordinary bare-metal GPU.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GpuGroup {
    /// A name from [`models::MODELS`], e.g. `H100-SXM5-80GB`.
    pub model: String,
    #[serde(default = "one")]
    pub count: u32,
    /// MIG mode of these GPUs when the state file is first created (like an A100 whose InfoROM has MIG on).
    #[serde(default, skip_serializing_if = "is_false")]
    pub mig_enabled: bool,
    /// A fault these GPUs answer discovery with, to exercise a node with a broken GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<SimulatedFault>,
    /// `nvmlDeviceGetVirtualizationMode`: `Vgpu` makes these GPUs vGPU guests.
    #[serde(default, skip_serializing_if = "VirtualizationMode::is_none")]
    pub virtualization_mode: VirtualizationMode,
    /// `nvmlDeviceGetGpuFabricInfo`'s state for GPUs behind NVSwitch; `None`: no fabric (the call is not
    /// supported).
    #[serde(default, skip_serializing_if = "FabricState::is_none")]
    pub fabric: FabricState,
    /// With `fabric: NotStarted` or `InProgress`: the registration completes (state COMPLETED, status
    /// SUCCESS, health summary HEALTHY) this many milliseconds after the simulated driver was loaded (its
    /// `kernel.json` written), as fabric manager finishes training the NVSwitches tens of seconds after the
    /// driver. Without it the state stays as given for the node's life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric_completes_after_ms: Option<u64>,
    /// Processes that hold each of these GPUs from the first boot on (DCGM's `nv-hostengine`, say), named
    /// by `nvmlSystemGetProcessName`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<NamedProcess>,
    /// GPUs of this group (0-based within it) that are not on the bus this boot: the node's other GPUs
    /// keep their UUIDs and bus ids, and those after it shift down one NVML index.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub absent: Vec<u32>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// NVML's `nvmlGpuVirtualizationMode_t`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum VirtualizationMode {
    /// Bare metal.
    #[default]
    None,
    /// Passed through to a VM.
    Passthrough,
    /// A vGPU guest: the GPU is a slice of a physical one, and MIG cannot be changed from inside.
    Vgpu,
    /// The host of vGPUs.
    HostVgpu,
    /// The host of vSGA.
    HostVsga,
}

impl VirtualizationMode {
    fn is_none(&self) -> bool {
        *self == Self::None
    }

    /// The `NVML_GPU_VIRTUALIZATION_MODE_*` value.
    pub fn nvml_value(self) -> u32 {
        self as u32
    }
}

/// NVML's `nvmlGpuFabricState_t`, with `None` for a GPU that has no fabric at all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum FabricState {
    /// No NVSwitch fabric: `nvmlDeviceGetGpuFabricInfo` answers NOT_SUPPORTED.
    #[default]
    None,
    NotStarted,
    InProgress,
    Completed,
}

impl FabricState {
    fn is_none(&self) -> bool {
        *self == Self::None
    }

    /// The `NVML_GPU_FABRIC_STATE_*` value (`None` is `NOT_SUPPORTED`, 0).
    pub fn nvml_value(self) -> u8 {
        self as u8
    }
}

/// A fabric as `nvmlDeviceGetGpuFabricInfoV` (v3) reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FabricReport {
    /// `NVML_GPU_FABRIC_STATE_*` (nvml.h 3800-3803 of NVIDIA/go-nvml `gen/nvml/nvml.h`).
    pub state: u8,
    /// The registration's NVML return code: SUCCESS (0) once completed.
    pub status: u32,
    /// `NVML_GPU_FABRIC_HEALTH_MASK_*` fields (nvml.h 3824-3885); 0 (every field NOT_SUPPORTED) until the
    /// fabric completed.
    pub health_mask: u32,
    /// `NVML_GPU_FABRIC_HEALTH_SUMMARY_*` (nvml.h 3890-3893): 0 is NOT_SUPPORTED, not healthy; HEALTHY is 1.
    pub health_summary: u8,
}

/// `NVML_GPU_FABRIC_HEALTH_SUMMARY_*` (nvml.h 3890-3893).
pub const FABRIC_HEALTH_SUMMARY_HEALTHY: u8 = 1;
pub const FABRIC_HEALTH_SUMMARY_UNHEALTHY: u8 = 2;
pub const FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY: u8 = 3;
/// Health-mask fields (value << shift, nvml.h 3824-3875): DEGRADED_BW at 0, ROUTE_RECOVERY at 2,
/// ROUTE_UNHEALTHY at 4, ACCESS_TIMEOUT_RECOVERY at 6 (1 TRUE, 2 FALSE), INCORRECT_CONFIGURATION at 8
/// (1 NONE).
const MASK_DEGRADED_BW_TRUE: u32 = 1;
const MASK_ROUTE_UNHEALTHY_TRUE: u32 = 1 << 4;
const MASK_ALL_WELL: u32 = 2 | (2 << 2) | (2 << 4) | (2 << 6) | (1 << 8);

/// The fabric report of a GPU whose node file says `state` (completing `completes_after` after the driver
/// load, `since_load` ago) and whose injected faults are `faults`; `None` without a fabric.
pub fn fabric_report(
    state: FabricState,
    completes_after: Option<Duration>,
    since_load: Option<Duration>,
    faults: &[crate::faults::FaultKind],
) -> Option<FabricReport> {
    use crate::faults::FaultKind;
    let completed = match (state, completes_after) {
        (FabricState::None, _) => return None,
        (FabricState::Completed, _) => true,
        // A kernel file whose time cannot be read counts as just loaded: training has not finished.
        (_, Some(after)) => since_load.is_some_and(|t| t >= after),
        (_, None) => false,
    };
    if !completed {
        return Some(FabricReport {
            state: state.nvml_value(),
            status: 0,
            health_mask: 0,
            health_summary: 0,
        });
    }
    let (health_mask, health_summary) = if faults.contains(&FaultKind::FabricUnhealthy) {
        (
            (MASK_ALL_WELL & !(3 << 4)) | MASK_ROUTE_UNHEALTHY_TRUE,
            FABRIC_HEALTH_SUMMARY_UNHEALTHY,
        )
    } else if faults.contains(&FaultKind::FabricDegraded) {
        (
            (MASK_ALL_WELL & !3) | MASK_DEGRADED_BW_TRUE,
            FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY,
        )
    } else {
        (MASK_ALL_WELL, FABRIC_HEALTH_SUMMARY_HEALTHY)
    };
    Some(FabricReport {
        state: FabricState::Completed.nvml_value(),
        status: 0,
        health_mask,
        health_summary,
    })
}

/// A process that holds a GPU, with the name NVML reports for it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NamedProcess {
    pub pid: u32,
    pub name: String,
}

/// How a simulated GPU fails discovery, as real ones do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub enum SimulatedFault {
    /// `NVML_ERROR_GPU_IS_LOST` (fell off the bus).
    Lost,
    /// `NVML_ERROR_NOT_SUPPORTED` for `nvmlDeviceGetMemoryInfo`.
    MemoryNotSupported,
}

fn one() -> u32 {
    1
}

impl GpuGroup {
    /// One bare-metal GPU of `model` with every option at its default.
    pub fn plain(model: &str) -> Self {
        Self {
            model: model.to_string(),
            count: 1,
            mig_enabled: false,
            fault: None,
            virtualization_mode: VirtualizationMode::None,
            fabric: FabricState::None,
            fabric_completes_after_ms: None,
            processes: Vec::new(),
            absent: Vec::new(),
        }
    }
}

impl NodeSpec {
    /// Adds a group of GPUs described in full.
    pub fn with_group(mut self, group: GpuGroup) -> Self {
        self.gpus.push(group);
        self
    }

    /// Adds `count` GPUs of `model` (builder for tests and callers without a node file).
    pub fn with_gpus(mut self, model: &str, count: u32) -> Self {
        self.gpus.push(GpuGroup {
            model: model.to_string(),
            count,
            mig_enabled: false,
            fault: None,
            ..GpuGroup::plain(model)
        });
        self
    }

    /// Adds `count` GPUs of `model` that fail discovery with `fault`.
    pub fn with_faulty_gpus(mut self, model: &str, count: u32, fault: SimulatedFault) -> Self {
        self.gpus.push(GpuGroup {
            model: model.to_string(),
            count,
            mig_enabled: false,
            fault: Some(fault),
            ..GpuGroup::plain(model)
        });
        self
    }

    /// Adds `count` GPUs of `model` that start with MIG mode enabled.
    pub fn with_mig_gpus(mut self, model: &str, count: u32) -> Self {
        self.gpus.push(GpuGroup {
            model: model.to_string(),
            count,
            mig_enabled: true,
            fault: None,
            ..GpuGroup::plain(model)
        });
        self
    }

    /// Reads a node file; strict, so a typo in a field name fails instead of silently giving no GPUs.
    pub fn from_file(path: &Path) -> Result<Self> {
        let err = |reason: String| GpuError::SimulatedNodeFile {
            path: path.display().to_string(),
            reason,
        };
        let text = fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        let spec: NodeSpec = serde_norway::from_str(&text).map_err(|e| {
            err(format!(
                "{e}; expected e.g. `gpus: [{{model: H100-SXM5-80GB, count: 8}}]`"
            ))
        })?;
        spec.validate().map_err(err)?;
        Ok(spec)
    }

    fn validate(&self) -> Result<(), String> {
        for g in &self.gpus {
            if models::model(&g.model).is_none() {
                return Err(format!(
                    "unknown GPU model {:?}; known models: {}",
                    g.model,
                    models::known_model_names()
                ));
            }
            if g.count == 0 {
                return Err(format!("count of model {} must be at least 1", g.model));
            }
            if g.fabric_completes_after_ms.is_some()
                && !matches!(g.fabric, FabricState::NotStarted | FabricState::InProgress)
            {
                return Err(format!(
                    "fabricCompletesAfterMs of model {} needs `fabric: InProgress` (or `NotStarted`), the \
                     state the fabric is in until then; it has `fabric: {:?}`",
                    g.model, g.fabric
                ));
            }
            if let Some(a) = g.absent.iter().find(|&&a| a >= g.count) {
                return Err(format!(
                    "absent GPU {a} of model {} is not one of its {} GPUs (0 to {})",
                    g.model,
                    g.count,
                    g.count - 1
                ));
            }
        }
        let total: u32 = self.gpus.iter().map(|g| g.count).sum();
        // /dev/nvidia-caps minors are predetermined for 32 GPUs (`gpu31/gi14/ci7/access 4322`).
        if total > 32 {
            return Err(format!("{total} GPUs requested; at most 32 per node"));
        }
        Ok(())
    }
}

/// Fixed identity of one simulated GPU, derived from the node name so two fake nodes never share a UUID.
#[derive(Clone, Debug)]
struct SimGpu {
    model: &'static GpuModel,
    uuid: String,
    pci_bus_id: String,
    pcie_root: String,
    numa_node: i64,
    initial_mig: bool,
    fault: Option<SimulatedFault>,
    virtualization_mode: VirtualizationMode,
    fabric: FabricState,
    fabric_completes_after: Option<Duration>,
    processes: Vec<NamedProcess>,
}

/// What a simulated GPU is, as the NVML library reports it: fixed for the node's life.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimulatedGpu {
    /// Index in the kernel's GPU list (the host's NVML index when every GPU is visible).
    pub index: u32,
    /// Minor of `/dev/nvidia<minor>` (the kernel index: the simulated driver numbers GPUs in bus order).
    pub minor: u32,
    pub uuid: String,
    pub model: &'static GpuModel,
    /// `0000:18:00.0`.
    pub pci_bus_id: String,
    pub numa_node: i64,
    pub virtualization_mode: VirtualizationMode,
    /// The fabric state of the node file; what NVML reports now is [`SimulatedBackend::fabric`]'s.
    pub fabric: FabricState,
    /// The fault of the node file, if any (a lost GPU, a GPU whose memory query is not supported).
    pub node_fault: Option<SimulatedFault>,
}

/// A process on a GPU, where it runs and what it is called.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunningProcess {
    pub pid: u32,
    /// `(GPU instance, compute instance)` for a process on a MIG device, `None` on the whole GPU.
    pub mig: Option<(u32, u32)>,
}

/// A live MIG device (one compute instance) with its GPU instance's profile and placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MigDevice {
    pub gpu_instance: u32,
    pub gi_profile_id: u32,
    pub placement: MigPlacement,
    pub compute_instance: u32,
    pub ci_profile_id: u32,
    pub uuid: String,
    /// The compute instance's creation serial ([`SimulatedBackend::instance_serial`]).
    pub serial: u64,
}

// PCI buses of a DGX H100's eight GPUs and the root ports above them; more GPUs repeat them in a new domain.
const PCI_BUSES: [(u8, u8); 8] = [
    (0x18, 0x15),
    (0x2a, 0x27),
    (0x3a, 0x37),
    (0x5d, 0x5a),
    (0x9a, 0x97),
    (0xab, 0xa8),
    (0xba, 0xb7),
    (0xdb, 0xd8),
];

fn gpu_uuid(node_name: &str, index: u32, model: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"tessera-simulated-gpu\0")
        .chain_update(node_name.as_bytes())
        .chain_update([0])
        .chain_update(index.to_le_bytes())
        .chain_update(model.as_bytes())
        .finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    format!("GPU-{}", uuid::Uuid::from_bytes(bytes).hyphenated())
}

fn build_gpus(node_name: &str, spec: &NodeSpec) -> Result<Vec<SimGpu>> {
    let total: u32 = spec.gpus.iter().map(|g| g.count).sum();
    let mut gpus = Vec::with_capacity(total as usize);
    let mut slot = 0u32;
    for group in &spec.gpus {
        let model = models::model(&group.model).ok_or_else(|| {
            GpuError::InvalidArgument(format!(
                "unknown GPU model {:?}; known models: {}",
                group.model,
                models::known_model_names()
            ))
        })?;
        for in_group in 0..group.count {
            // The slot on the board names the GPU (UUID, bus); a GPU absent this boot leaves its slot
            // empty, so the GPUs after it keep their UUIDs and move down one index, as on a real node.
            let index = slot;
            slot += 1;
            if group.absent.contains(&in_group) {
                continue;
            }
            let (bus, root) = PCI_BUSES[index as usize % PCI_BUSES.len()];
            let domain = index as usize / PCI_BUSES.len();
            gpus.push(SimGpu {
                model,
                uuid: gpu_uuid(node_name, index, model.name),
                pci_bus_id: format!("{domain:04x}:{bus:02x}:00.0"),
                pcie_root: format!("pci{domain:04x}:{root:02x}"),
                // Half the GPUs on each socket, as on 2-socket HGX boards.
                numa_node: i64::from(index >= total.div_ceil(2)),
                initial_mig: group.mig_enabled,
                fault: group.fault,
                virtualization_mode: group.virtualization_mode,
                fabric: group.fabric,
                fabric_completes_after: group.fabric_completes_after_ms.map(Duration::from_millis),
                processes: group.processes.clone(),
            });
        }
    }
    Ok(gpus)
}

/// Mutable hardware state, persisted as JSON.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct HardwareState {
    version: u32,
    /// Bumped on every write, so `proc/` can tell whether it shows this version (see `sync_proc`).
    #[serde(default)]
    generation: u64,
    gpus: Vec<GpuState>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct GpuState {
    uuid: String,
    model: String,
    mig_current: bool,
    mig_pending: bool,
    compute_mode: ComputeMode,
    time_slice: TimeSlice,
    /// PIDs running on the GPU outside any MIG instance.
    #[serde(default)]
    processes: Vec<u32>,
    #[serde(default)]
    gpu_instances: Vec<GiState>,
    /// Bumped by every reset and every change of the current MIG mode: what drops NVML event
    /// registrations of the GPU.
    #[serde(default)]
    epoch: u64,
    /// GPU and compute instances created on this GPU so far: the serial of the next one (see
    /// [`SimulatedBackend::instance_serial`]). Kept across resets, so no two instances share a serial.
    #[serde(default)]
    instances_created: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct GiState {
    id: u32,
    profile_id: u32,
    placement: MigPlacement,
    #[serde(default)]
    compute_instances: Vec<CiState>,
    #[serde(default)]
    serial: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct CiState {
    id: u32,
    profile_id: u32,
    uuid: String,
    #[serde(default)]
    processes: Vec<u32>,
    #[serde(default)]
    serial: u64,
}

impl GpuState {
    fn fresh(gpu: &SimGpu) -> Self {
        Self {
            uuid: gpu.uuid.clone(),
            model: gpu.model.name.to_string(),
            mig_current: gpu.initial_mig,
            mig_pending: gpu.initial_mig,
            compute_mode: ComputeMode::Default,
            time_slice: TimeSlice::Default,
            processes: gpu.processes.iter().map(|p| p.pid).collect(),
            gpu_instances: Vec::new(),
            epoch: 0,
            instances_created: 0,
        }
    }

    fn all_processes(&self) -> Vec<u32> {
        let mut pids = self.processes.clone();
        for gi in &self.gpu_instances {
            for ci in &gi.compute_instances {
                pids.extend(&ci.processes);
            }
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    fn require_mig(&self, gpu: u32, op: &str) -> Result<()> {
        if self.mig_current {
            Ok(())
        } else {
            Err(GpuError::NotSupported(format!(
                "cannot {op} on GPU {gpu}: MIG mode is disabled"
            )))
        }
    }

    fn gi(&self, gpu: u32, id: u32) -> Result<&GiState> {
        self.gpu_instances
            .iter()
            .find(|gi| gi.id == id)
            .ok_or_else(|| GpuError::NotFound(format!("GPU instance {id} on GPU {gpu}")))
    }

    fn gi_mut(&mut self, gpu: u32, id: u32) -> Result<&mut GiState> {
        self.gpu_instances
            .iter_mut()
            .find(|gi| gi.id == id)
            .ok_or_else(|| GpuError::NotFound(format!("GPU instance {id} on GPU {gpu}")))
    }
}

/// GPU-instance ids roughly by placement size, like the driver (`gpu-mig-mps.md` 3.7): 0 for the whole GPU,
/// halves 1–2, quarters 3–6, eighths 7–14. The lowest free id of the range is taken, so ids are not a
/// function of the placement and callers cannot come to rely on that.
fn gi_id_range(placement: MigPlacement) -> std::ops::RangeInclusive<u32> {
    match placement.size {
        8.. => 0..=0,
        4..=7 => 1..=2,
        2..=3 => 3..=6,
        _ => 7..=MAX_GPU_INSTANCE_ID,
    }
}

/// `kernel.json` of a simulated kernel directory: the node and its GPU inventory.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KernelSpec {
    pub version: u32,
    pub node_name: String,
    pub node: NodeSpec,
}

/// Majors of the dynamic drivers, as [`canned_char_device`] numbers them.
const NVIDIA_UVM_MAJOR: u32 = 510;
const NVIDIA_CAPS_MAJOR: u32 = 508;

/// The simulated kernel's directory inside a plugin state directory. It is a directory of its own, not the
/// state directory itself, because every container of a simulated node gets it mounted (read-only) at
/// `/tessera-sim`: the plugin's checkpoint and the MPS daemons' control sockets (`<state dir>/mps/`) must
/// stay out of tenants' reach — a read-only mount does not stop `connect()` on a unix socket.
pub const KERNEL_SUBDIR: &str = "simulated-kernel";

/// `<state dir>/simulated-kernel`, created if missing, with the hardware files of an older plugin (which
/// kept them in the state directory itself) moved into it, so an upgrade keeps its MIG instances and
/// faults.
pub fn kernel_dir_in(state_dir: &Path) -> Result<PathBuf> {
    let kernel = state_dir.join(KERNEL_SUBDIR);
    let err = |path: &Path, e: std::io::Error| GpuError::SimulatedState {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    fs::create_dir_all(&kernel).map_err(|e| err(&kernel, e))?;
    for file in [STATE_FILE, crate::faults::HEALTH_FILE, crate::load::LOAD_FILE] {
        let old = state_dir.join(file);
        let new = kernel.join(file);
        if old.is_file() && !new.exists() {
            fs::rename(&old, &new).map_err(|e| err(&old, e))?;
        }
    }
    Ok(kernel)
}

impl KernelSpec {
    /// Reads `<dir>/kernel.json`.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(KERNEL_FILE);
        let err = |reason: String| GpuError::SimulatedState {
            path: path.display().to_string(),
            reason,
        };
        let bytes = fs::read(&path).map_err(|e| err(e.to_string()))?;
        let spec: KernelSpec = serde_json::from_slice(&bytes).map_err(|e| {
            err(format!(
                "not a simulated kernel file ({e}); recreate it with `tessera-kubelet-plugin simulate driver-root`"
            ))
        })?;
        if spec.version != KERNEL_VERSION {
            return Err(err(format!(
                "kernel file version {} is not the supported version {KERNEL_VERSION}",
                spec.version
            )));
        }
        spec.node.validate().map_err(err)?;
        Ok(spec)
    }
}

/// The simulated kernel directory for a library at `path`: the first `<dir>/tessera-sim` holding a
/// `kernel.json`, walking up from `path`'s directory to `/`. On the host that is `<driver root>/tessera-sim`;
/// in a container, where the plugin's CDI spec mounts it at `/tessera-sim`, the walk from
/// `/usr/lib/x86_64-linux-gnu` ends there.
pub fn find_kernel_from(path: &Path) -> Option<PathBuf> {
    let walk = |p: &Path| {
        p.ancestors()
            .skip(1)
            .map(|dir| dir.join(KERNEL_DIR_NAME))
            .find(|k| k.join(KERNEL_FILE).is_file())
    };
    walk(path).or_else(|| fs::canonicalize(path).ok().and_then(|p| walk(&p)))
}

/// [`KERNEL_ENV`] when set, else [`find_kernel_from`] `path`: how the libraries find their kernel.
pub fn locate_kernel(path: &Path) -> Option<PathBuf> {
    match std::env::var_os(KERNEL_ENV) {
        Some(dir) if !dir.is_empty() => Some(PathBuf::from(dir)),
        _ => find_kernel_from(path),
    }
}

/// Which GPUs and MIG devices a process sees, judged from its `/dev` as the real driver's access checks
/// would be: without `/dev/nvidiactl` the process is on the host (the plugin, the node's nvidia-smi) and
/// sees every GPU; with it, it is in a container that CDI gave devices to, and sees the GPUs whose
/// `/dev/nvidia<minor>` exist and the MIG devices whose GI and CI capability nodes exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceView {
    dev_root: PathBuf,
    container: bool,
}

impl DeviceView {
    /// The view of this process: `/dev`, or [`DEV_ROOT_ENV`] (tests only).
    pub fn of_this_process() -> Self {
        let dev = std::env::var_os(DEV_ROOT_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/dev"));
        Self::at(&dev)
    }

    /// The view of a process whose `/dev` is `dev_root`.
    pub fn at(dev_root: &Path) -> Self {
        Self {
            container: dev_root.join("nvidiactl").exists(),
            dev_root: dev_root.to_path_buf(),
        }
    }

    /// Every GPU and MIG device: the host's view.
    pub fn host() -> Self {
        Self {
            dev_root: PathBuf::from("/dev"),
            container: false,
        }
    }

    pub fn is_container(&self) -> bool {
        self.container
    }

    pub fn gpu_visible(&self, minor: u32) -> bool {
        !self.container || self.dev_root.join(format!("nvidia{minor}")).exists()
    }

    fn cap(&self, minor: u32) -> bool {
        self.dev_root
            .join(format!("nvidia-caps/nvidia-cap{minor}"))
            .exists()
    }

    /// A MIG device with capability minors `(gi, ci)` on a visible GPU. The `mig/monitor` capability
    /// (minor 2) shows every MIG device, as it does for `nvidia-smi` in a monitoring container.
    pub fn mig_visible(&self, gi_minor: u32, ci_minor: u32) -> bool {
        !self.container || self.cap(2) || (self.cap(gi_minor) && self.cap(ci_minor))
    }

    /// A GPU instance is seen when any of its compute instances is (or with `mig/monitor`).
    pub fn gpu_instance_visible(&self, gi_minor: u32) -> bool {
        !self.container || self.cap(2) || self.cap(gi_minor)
    }
}

/// A node's simulated GPUs. Cheap to share between threads; see the module comment for persistence.
pub struct SimulatedBackend {
    node_name: String,
    gpus: Vec<SimGpu>,
    state_path: PathBuf,
    state_dir: PathBuf,
    /// flock serializes processes; this serializes threads of this process, which share the lock file.
    /// `None`: the kernel directory is read-only here (see the module comment).
    lock_file: Option<Mutex<File>>,
    /// The simulated driver root (`<state dir>/driver-root`), installed on first use.
    driver_root: PathBuf,
    latencies: Latencies,
    install_driver_root: std::sync::Once,
    /// Whether [`GpuBackend::driver_root`] installs the built libraries there (the simulated backend does;
    /// a kernel opened by the libraries themselves does not).
    owns_driver_root: bool,
    /// What this process set as each GPU's time-slice: like NVML, the backend cannot read the hardware's
    /// value back, so a new backend (a restarted plugin) knows nothing ([`GpuBackend::time_slice`] says
    /// `Default`) while the GPU keeps what it was set to ([`SimulatedBackend::hardware_time_slice`]).
    known_time_slices: Mutex<std::collections::HashMap<u32, TimeSlice>>,
    /// Time spent in calls that touch the state, since this backend was opened.
    nvml_time: Mutex<NvmlTime>,
}

/// The simulated NVML time of one backend: how many calls touched the state and how long they took, lock
/// wait included (a real driver serializes MIG changes on a GPU too).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlTime {
    pub calls: u64,
    pub nanos: u64,
}

impl NvmlTime {
    pub fn total(&self) -> Duration {
        Duration::from_nanos(self.nanos)
    }
}

/// Holds the node-wide lock for one operation; releases it on drop, even on panic. Holds nothing for a
/// read-only backend, whose reads rely on the state file being replaced by rename.
struct StateLock<'a> {
    file: Option<MutexGuard<'a, File>>,
}

impl Drop for StateLock<'_> {
    fn drop(&mut self) {
        // Unlocking cannot fail on a valid descriptor; if it did, closing the file on exit releases it.
        if let Some(file) = &self.file {
            let _ = file.unlock();
        }
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    fs::write(&tmp, bytes)?;
    fs::rename(&tmp, path)
}

impl SimulatedBackend {
    /// Opens the simulated node `node_name` described by `node_file`, keeping hardware state in `state_dir`
    /// (created if missing). Existing state for the same GPUs is kept, as hardware keeps MIG instances
    /// across a plugin restart.
    pub fn new(node_name: &str, node_file: &Path, state_dir: &Path) -> Result<Self> {
        Self::from_spec(node_name, &NodeSpec::from_file(node_file)?, state_dir)
    }

    /// Like [`SimulatedBackend::new`] with the node described in code. The state directory becomes a
    /// simulated kernel directory (`kernel.json`, `proc/`), so the built NVML and CUDA libraries see the
    /// same GPUs; its driver root is installed when first asked for ([`GpuBackend::driver_root`]).
    pub fn from_spec(node_name: &str, spec: &NodeSpec, state_dir: &Path) -> Result<Self> {
        spec.validate().map_err(GpuError::InvalidArgument)?;
        let state_err = |reason: String| GpuError::SimulatedState {
            path: state_dir.display().to_string(),
            reason,
        };
        fs::create_dir_all(state_dir)
            .map_err(|e| state_err(format!("cannot create the state directory: {e}")))?;
        let kernel = KernelSpec {
            version: KERNEL_VERSION,
            node_name: node_name.to_string(),
            node: spec.clone(),
        };
        let kernel_path = state_dir.join(KERNEL_FILE);
        let json = serde_json::to_vec_pretty(&kernel).map_err(|e| state_err(e.to_string()))?;
        // Rewritten only when it changed: the libraries of running processes read it when they start.
        if fs::read(&kernel_path).ok().as_deref() != Some(json.as_slice()) {
            write_atomically(&kernel_path, &json).map_err(|e| GpuError::SimulatedState {
                path: kernel_path.display().to_string(),
                reason: format!("cannot write the kernel file: {e}"),
            })?;
        }
        let backend =
            Self::open(node_name, spec, state_dir, true)?.ok_or_else(|| GpuError::SimulatedState {
                path: state_dir.join(LOCK_FILE).display().to_string(),
                reason: "cannot open the lock file for writing".into(),
            })?;
        Ok(backend)
    }

    /// Opens the simulated kernel directory `dir` (what the NVML and CUDA libraries do): read-write when
    /// this process can write its lock file, else read-only, where every change fails with
    /// [`GpuError::NoPermission`].
    pub fn open_kernel(dir: &Path) -> Result<Self> {
        let kernel = KernelSpec::read(dir)?;
        match Self::open(&kernel.node_name, &kernel.node, dir, false)? {
            Some(backend) => Ok(backend),
            None => Self::open_read_only(&kernel.node_name, &kernel.node, dir),
        }
    }

    /// Read-write when the lock file can be opened for writing (`None` when it cannot and `create` is
    /// false).
    fn open(node_name: &str, spec: &NodeSpec, state_dir: &Path, create: bool) -> Result<Option<Self>> {
        let lock_path = state_dir.join(LOCK_FILE);
        let lock_file = match OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
        {
            Ok(f) => f,
            Err(_) if !create => return Ok(None),
            Err(e) => {
                return Err(GpuError::SimulatedState {
                    path: lock_path.display().to_string(),
                    reason: e.to_string(),
                });
            }
        };
        let backend = Self::build(node_name, spec, state_dir, Some(lock_file), create)?;
        // Validates (or creates) the state now, so a corrupt file fails the start, not the first claim;
        // and brings `proc/` up to date with it.
        backend.write(|_| Ok(()))?;
        Ok(Some(backend))
    }

    fn open_read_only(node_name: &str, spec: &NodeSpec, state_dir: &Path) -> Result<Self> {
        let backend = Self::build(node_name, spec, state_dir, None, false)?;
        backend.read(|_| Ok(()))?;
        Ok(backend)
    }

    fn build(
        node_name: &str,
        spec: &NodeSpec,
        state_dir: &Path,
        lock_file: Option<File>,
        owns_driver_root: bool,
    ) -> Result<Self> {
        Ok(Self {
            node_name: node_name.to_string(),
            gpus: build_gpus(node_name, spec)?,
            state_path: state_dir.join(STATE_FILE),
            state_dir: state_dir.to_path_buf(),
            lock_file: lock_file.map(Mutex::new),
            driver_root: state_dir.join(DRIVER_ROOT_DIR),
            latencies: spec.latencies,
            install_driver_root: std::sync::Once::new(),
            owns_driver_root,
            known_time_slices: Mutex::new(Default::default()),
            nvml_time: Mutex::new(NvmlTime::default()),
        })
    }

    /// Path of the JSON hardware state.
    pub fn state_file(&self) -> &Path {
        &self.state_path
    }

    /// The simulated kernel directory (the state directory).
    pub fn kernel_dir(&self) -> &Path {
        &self.state_dir
    }

    /// What the simulated NVIDIA kernel module shows in `/proc` (`<kernel dir>/proc`).
    pub fn proc_dir(&self) -> PathBuf {
        self.state_dir.join(PROC_DIR)
    }

    /// Name of the simulated node.
    /// The time this simulated driver spends in its slow operations.
    pub fn latencies(&self) -> Latencies {
        self.latencies
    }

    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// `true` when the kernel directory could not be opened for writing: changes fail with NO_PERMISSION.
    pub fn is_read_only(&self) -> bool {
        self.lock_file.is_none()
    }

    /// The fault file of this node.
    pub fn health(&self) -> crate::faults::SimulatedHealth {
        crate::faults::SimulatedHealth::new(&self.state_dir, self.gpu_count())
    }

    /// The fault of `gpu` that makes every NVML call on it fail, as NVML's return code: 15 for a lost GPU
    /// (injected, or lost in the node file), 18, 9 or 1 for the fault kinds of those codes.
    pub fn failing_code(&self, gpu: u32) -> Option<u32> {
        if self.gpus.get(gpu as usize)?.fault == Some(SimulatedFault::Lost) {
            return Some(15);
        }
        self.health()
            .faults()
            .ok()?
            .iter()
            .filter(|f| f.gpu == gpu)
            .find_map(|f| f.kind.nvml_error_code())
    }

    /// `true` when `gpu` fell off the bus (lost in the node file, or an injected [`FaultKind::Lost`]).
    ///
    /// [`FaultKind::Lost`]: crate::faults::FaultKind::Lost
    pub fn is_lost(&self, gpu: u32) -> bool {
        self.failing_code(gpu) == Some(15)
    }

    /// What `nvmlDeviceGetGpuFabricInfo[V]` answers for `gpu` now, `None` for a GPU without a fabric
    /// (NOT_SUPPORTED). The node file's state, COMPLETED once `fabricCompletesAfterMs` passed since the
    /// driver was loaded (the mtime of `kernel.json`, written when the simulated driver is set up and only
    /// rewritten when the node changes); a completed fabric's health is what an injected fabric fault says.
    pub fn fabric(&self, gpu: u32) -> Result<Option<FabricReport>> {
        let g = self.sim_gpu(gpu)?;
        let loaded = fs::metadata(self.state_dir.join(KERNEL_FILE))
            .and_then(|m| m.modified())
            .ok();
        let faults: Vec<crate::faults::FaultKind> = match g.fabric {
            FabricState::None => vec![],
            _ => self
                .health()
                .faults()
                .unwrap_or_default()
                .into_iter()
                .filter(|f| f.gpu == gpu)
                .map(|f| f.kind)
                .collect(),
        };
        Ok(fabric_report(
            g.fabric,
            g.fabric_completes_after,
            loaded.and_then(|t| t.elapsed().ok()),
            &faults,
        ))
    }

    /// Identity of GPU `gpu` (its kernel index).
    pub fn gpu(&self, gpu: u32) -> Result<SimulatedGpu> {
        let g = self.sim_gpu(gpu)?;
        Ok(SimulatedGpu {
            index: gpu,
            minor: gpu,
            uuid: g.uuid.clone(),
            model: g.model,
            pci_bus_id: g.pci_bus_id.clone(),
            numa_node: g.numa_node,
            virtualization_mode: g.virtualization_mode,
            fabric: g.fabric,
            node_fault: g.fault,
        })
    }

    /// Kernel index of the GPU with `uuid`.
    pub fn gpu_by_uuid(&self, uuid: &str) -> Option<u32> {
        self.gpus.iter().position(|g| g.uuid == uuid).map(|i| i as u32)
    }

    /// Kernel indices of the GPUs `view` shows, in kernel order: NVML's indices are positions in this list.
    pub fn visible_gpus(&self, view: &DeviceView) -> Vec<u32> {
        (0..self.gpu_count()).filter(|&i| view.gpu_visible(i)).collect()
    }

    /// The live MIG devices of `gpu` that `view` shows, by GPU-instance then compute-instance id (empty
    /// when MIG mode is off).
    pub fn mig_devices(&self, gpu: u32, view: &DeviceView) -> Result<Vec<MigDevice>> {
        let gis = self.read(|state| {
            let g = gpu_state(state, gpu)?;
            Ok(if g.mig_current {
                g.gpu_instances.clone()
            } else {
                Vec::new()
            })
        })?;
        let mut gis = gis;
        gis.sort_by_key(|gi| gi.id);
        let mut out = Vec::new();
        for gi in gis {
            for ci in gi.compute_instances {
                let (gi_minor, ci_minor) = mig_minors_by_formula(gpu, gi.id, ci.id)?;
                if view.mig_visible(gi_minor, ci_minor) {
                    out.push(MigDevice {
                        gpu_instance: gi.id,
                        gi_profile_id: gi.profile_id,
                        placement: gi.placement,
                        compute_instance: ci.id,
                        ci_profile_id: ci.profile_id,
                        uuid: ci.uuid,
                        serial: ci.serial,
                    });
                }
            }
        }
        Ok(out)
    }

    /// The creation serial of GPU instance `gi` of `gpu` (with `ci`: of its compute instance `ci`), `None`
    /// when there is no such instance: what tells an instance from an earlier one destroyed with the
    /// same ids. Serials count up per GPU and never repeat, so a handle that carries one is refused once
    /// its instance is gone, whatever was created since.
    pub fn instance_serial(&self, gpu: u32, gi: u32, ci: Option<u32>) -> Result<Option<u64>> {
        self.read(|state| {
            let g = gpu_state(state, gpu)?;
            let Some(gi) = g.gpu_instances.iter().find(|x| x.id == gi) else {
                return Ok(None);
            };
            Ok(match ci {
                None => Some(gi.serial),
                Some(ci) => gi.compute_instances.iter().find(|x| x.id == ci).map(|x| x.serial),
            })
        })
    }

    /// Every process on `gpu` with the MIG device it runs on.
    pub fn running_processes(&self, gpu: u32) -> Result<Vec<RunningProcess>> {
        self.read(|state| {
            let g = gpu_state(state, gpu)?;
            let mut out: Vec<RunningProcess> = g
                .processes
                .iter()
                .map(|&pid| RunningProcess { pid, mig: None })
                .collect();
            for gi in &g.gpu_instances {
                for ci in &gi.compute_instances {
                    out.extend(ci.processes.iter().map(|&pid| RunningProcess {
                        pid,
                        mig: Some((gi.id, ci.id)),
                    }));
                }
            }
            Ok(out)
        })
    }

    /// The name the node file gives process `pid` (`nv-hostengine`, ...), if any.
    pub fn process_name(&self, pid: u32) -> Option<String> {
        self.gpus
            .iter()
            .flat_map(|g| &g.processes)
            .find(|p| p.pid == pid)
            .map(|p| p.name.clone())
    }

    /// Resets and current-MIG-mode changes of `gpu` so far: an NVML event registration is dropped when
    /// this moves.
    pub fn epoch(&self, gpu: u32) -> Result<u64> {
        self.read(|state| Ok(gpu_state(state, gpu)?.epoch))
    }

    /// [`SimulatedBackend::epoch`] of every GPU, in one read.
    pub fn epochs(&self) -> Result<Vec<u64>> {
        self.read(|state| Ok(state.gpus.iter().map(|g| g.epoch).collect()))
    }

    /// This backend's simulated NVML time so far (also in [`NVML_TIME_FILE`] of the state dir).
    pub fn nvml_time(&self) -> NvmlTime {
        *self.nvml_time.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of simulated GPUs.
    pub fn gpu_count(&self) -> u32 {
        self.gpus.len() as u32
    }

    /// `nvmlDeviceSetMigMode` as the driver answers it: the call fails only when GPU instances exist;
    /// otherwise it records the wish and returns the activation status: `IN_USE` (19) when processes
    /// run on the GPU or another process's NVML session holds it ([`crate::sessions`]; the mode stays pending), 0 otherwise (Hopper and newer switch now, Ampere waits for a
    /// reset). The outcome is judged by reading the mode back ([`tessera_gpu_api::mig_mode_change_outcome`]).
    pub fn set_mig_mode_nvml(&self, gpu: u32, enabled: bool) -> Result<u32> {
        let toggles_now = self.sim_gpu(gpu)?.model.architecture.mig_toggle_without_reset();
        self.write(|state| {
            let g = gpu_state_mut(state, gpu)?;
            if g.mig_current == enabled {
                // Asking for the current mode cancels a pending change and needs no reset.
                g.mig_pending = enabled;
                return Ok(0);
            }
            if !g.gpu_instances.is_empty() {
                return Err(GpuError::InUse(format!(
                    "cannot change MIG mode of GPU {gpu}: {} GPU instances exist",
                    g.gpu_instances.len()
                )));
            }
            Latencies::charge(self.latencies.mig_mode_change_ms);
            g.mig_pending = enabled;
            // Another NVML client holding the GPU open keeps the change pending as a running process does,
            // though `nvidia-smi` lists no process for it (see `crate::sessions`).
            if !g.all_processes().is_empty() || !other_holders(&self.state_dir, gpu).is_empty() {
                return Ok(tessera_gpu_api::NVML_ERROR_IN_USE);
            }
            if toggles_now {
                g.mig_current = enabled;
                g.epoch += 1;
            }
            Ok(0)
        })
    }

    /// Test hook: a process `pid` starts on the GPU (`mig == None`) or on compute instance `(gi, ci)`.
    pub fn add_process(&self, gpu: u32, mig: Option<(u32, u32)>, pid: u32) -> Result<()> {
        self.write(|state| {
            let g = gpu_state_mut(state, gpu)?;
            let pids = match mig {
                None => &mut g.processes,
                Some((gi, ci)) => {
                    g.require_mig(gpu, "run a process on a MIG device")?;
                    let gi_state = g.gi_mut(gpu, gi)?;
                    &mut gi_state
                        .compute_instances
                        .iter_mut()
                        .find(|c| c.id == ci)
                        .ok_or_else(|| {
                            GpuError::NotFound(format!(
                                "compute instance {ci} of GPU instance {gi} on GPU {gpu}"
                            ))
                        })?
                        .processes
                }
            };
            if !pids.contains(&pid) {
                pids.push(pid);
            }
            Ok(())
        })
    }

    /// Test hook: process `pid` exits, wherever on the GPU it ran.
    pub fn remove_process(&self, gpu: u32, pid: u32) -> Result<()> {
        self.write(|state| {
            let g = gpu_state_mut(state, gpu)?;
            let mut found = false;
            let mut drop_pid = |pids: &mut Vec<u32>| {
                let before = pids.len();
                pids.retain(|&p| p != pid);
                found |= pids.len() != before;
            };
            drop_pid(&mut g.processes);
            for gi in &mut g.gpu_instances {
                for ci in &mut gi.compute_instances {
                    drop_pid(&mut ci.processes);
                }
            }
            if found {
                Ok(())
            } else {
                Err(GpuError::NotFound(format!("process {pid} on GPU {gpu}")))
            }
        })
    }

    /// Test hook: the time-slice the GPU really has (what `nvidia-smi compute-policy -l` would print).
    pub fn hardware_time_slice(&self, gpu: u32) -> Result<TimeSlice> {
        self.read(|state| Ok(gpu_state(state, gpu)?.time_slice))
    }

    /// Test hook: someone outside the plugin (an admin, an earlier plugin that crashed) sets the time-slice.
    pub fn set_hardware_time_slice(&self, gpu: u32, slice: TimeSlice) -> Result<()> {
        self.write(|state| {
            gpu_state_mut(state, gpu)?.time_slice = slice;
            Ok(())
        })
    }

    /// Test hook: resets the GPU, as `nvidia-smi -r` or a reboot would. A pending MIG mode takes effect; MIG
    /// instances, compute mode and time-slice are lost. Fails with [`GpuError::InUse`] while processes run.
    pub fn reset_gpu(&self, gpu: u32) -> Result<()> {
        self.write(|state| {
            let g = gpu_state_mut(state, gpu)?;
            let pids = g.all_processes();
            if !pids.is_empty() {
                return Err(GpuError::InUse(format!(
                    "cannot reset GPU {gpu}: processes {pids:?} are running"
                )));
            }
            g.mig_current = g.mig_pending;
            g.gpu_instances.clear();
            g.compute_mode = ComputeMode::Default;
            g.time_slice = TimeSlice::Default;
            g.epoch += 1;
            Ok(())
        })
    }

    fn state_err(&self, reason: String) -> GpuError {
        GpuError::SimulatedState {
            path: self.state_path.display().to_string(),
            reason,
        }
    }

    fn lock(&self) -> Result<StateLock<'_>> {
        let Some(lock_file) = &self.lock_file else {
            return Ok(StateLock { file: None });
        };
        // A poisoned mutex only means another thread panicked mid-operation; the file on disk is still
        // consistent (it is replaced atomically), so the lock stays usable.
        let guard = lock_file.lock().unwrap_or_else(|p| p.into_inner());
        guard.lock().map_err(|e| GpuError::SimulatedState {
            path: self.state_dir.join(LOCK_FILE).display().to_string(),
            reason: e.to_string(),
        })?;
        Ok(StateLock { file: Some(guard) })
    }

    /// Reads the state file and reconciles it with the node file: GPUs are matched by UUID, so a GPU that
    /// left the node file loses its state and a new one starts idle.
    fn load(&self) -> Result<HardwareState> {
        let stored: Option<HardwareState> = match fs::read(&self.state_path) {
            Ok(bytes) => {
                let state: HardwareState = serde_json::from_slice(&bytes).map_err(|e| {
                    self.state_err(format!(
                        "the file is corrupt ({e}); delete it to start with idle simulated GPUs (their MIG \
                         instances are lost, as after a reboot)"
                    ))
                })?;
                if state.version != STATE_VERSION {
                    return Err(self.state_err(format!(
                        "state version {} is not the supported version {STATE_VERSION}; delete the file to start \
                         with idle simulated GPUs",
                        state.version
                    )));
                }
                Some(state)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(self.state_err(e.to_string())),
        };
        let generation = stored.as_ref().map_or(0, |s| s.generation);
        let mut stored_gpus = stored.map(|s| s.gpus).unwrap_or_default();
        let gpus = self
            .gpus
            .iter()
            .map(|gpu| match stored_gpus.iter().position(|s| s.uuid == gpu.uuid) {
                Some(i) => stored_gpus.swap_remove(i),
                None => GpuState::fresh(gpu),
            })
            .collect();
        Ok(HardwareState {
            version: STATE_VERSION,
            generation,
            gpus,
        })
    }

    fn store(&self, state: &mut HardwareState) -> Result<()> {
        state.generation += 1;
        let tmp = self.state_dir.join(format!("{STATE_FILE}.tmp"));
        let json = serde_json::to_vec_pretty(state).map_err(|e| self.state_err(e.to_string()))?;
        let write = || -> std::io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(&json)?;
            // Whole after a power loss; no directory fsync (see the module comment for why neither more
            // nor less).
            f.sync_data()?;
            drop(f);
            fs::rename(&tmp, &self.state_path)
        };
        write().map_err(|e| self.state_err(format!("cannot write the state: {e}")))
    }

    fn read<T>(&self, f: impl FnOnce(&HardwareState) -> Result<T>) -> Result<T> {
        let started = Instant::now();
        let _lock = self.lock()?;
        let out = self.load().and_then(|state| {
            // A writer that died between its state write and its `proc/` write left `proc/` behind:
            // the next caller that holds the lock brings it up to date.
            if !self.is_read_only() && self.proc_generation() != Some(state.generation) {
                self.sync_proc(&state)?;
            }
            f(&state)
        });
        self.account(started.elapsed());
        out
    }

    /// Runs one operation under the lock and persists whatever it changed, also when it fails: a failed
    /// Ampere MIG toggle still changes the pending mode. A read-only backend refuses every change with
    /// NO_PERMISSION, as NVML does for a process without the MIG capabilities.
    fn write<T>(&self, f: impl FnOnce(&mut HardwareState) -> Result<T>) -> Result<T> {
        if self.is_read_only() {
            return Err(GpuError::NoPermission(format!(
                "the simulated kernel {} is read-only in this process (a container's mount); GPU changes \
                 need the host (NVML_ERROR_NO_PERMISSION)",
                self.state_dir.display()
            )));
        }
        let started = Instant::now();
        let _lock = self.lock()?;
        let out = (|| {
            let mut state = self.load()?;
            let on_disk = fs::metadata(&self.state_path).is_ok();
            let before = state.clone();
            let out = f(&mut state);
            if state != before || !on_disk {
                self.store(&mut state)?;
            }
            if self.proc_generation() != Some(state.generation) {
                self.sync_proc(&state)?;
            }
            out
        })();
        self.account(started.elapsed());
        out
    }

    fn proc_generation(&self) -> Option<u64> {
        fs::read_to_string(self.proc_dir().join(PROC_GENERATION_FILE))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Makes `proc/` show `state`: the static files, and one `access` file per live GPU and compute
    /// instance (none for anything else), then records the generation shown. Called under the lock.
    fn sync_proc(&self, state: &HardwareState) -> Result<()> {
        let proc = self.proc_dir();
        let err = |e: std::io::Error| GpuError::SimulatedState {
            path: proc.display().to_string(),
            reason: format!("cannot write the simulated /proc: {e}"),
        };
        let write_if_changed = |path: &Path, content: &str| -> std::io::Result<()> {
            if fs::read_to_string(path).ok().as_deref() == Some(content) {
                return Ok(());
            }
            fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
            write_atomically(path, content.as_bytes())
        };
        let access = |minor: u32, mode: u32| {
            format!("DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n")
        };
        write_if_changed(
            &proc.join("devices"),
            &format!(
                "Character devices:\n  1 mem\n195 nvidia-frontend\n{NVIDIA_CAPS_MAJOR} nvidia-caps\n\
                 {NVIDIA_UVM_MAJOR} nvidia-uvm\n\nBlock devices:\n  8 sd\n"
            ),
        )
        .map_err(err)?;
        // Written once: the module's version is the driver's, which `simulate upgrade-driver` changes
        // (driver_root.rs), not the hardware state's.
        let version_file = proc.join(KERNEL_VERSION_FILE);
        if !version_file.exists() {
            write_if_changed(&version_file, &kernel_version_text(SIMULATED_DRIVER_VERSION)).map_err(err)?;
        }
        let caps = proc.join("driver/nvidia/capabilities");
        write_if_changed(&caps.join("mig/config"), &access(1, 256)).map_err(err)?;
        write_if_changed(&caps.join("mig/monitor"), &access(2, 292)).map_err(err)?;
        for (index, g) in state.gpus.iter().enumerate() {
            let mig_dir = caps.join(format!("gpu{index}/mig"));
            let mut wanted = std::collections::BTreeMap::new();
            for gi in &g.gpu_instances {
                for ci in &gi.compute_instances {
                    let (_, ci_minor) = mig_minors_by_formula(index as u32, gi.id, ci.id)?;
                    wanted.insert(format!("gi{}/ci{}/access", gi.id, ci.id), access(ci_minor, 292));
                }
                let (gi_minor, _) = mig_minors_by_formula(index as u32, gi.id, 0)?;
                wanted.insert(format!("gi{}/access", gi.id), access(gi_minor, 292));
            }
            // Anything the state no longer has goes: a destroyed CI's directory, a reset GPU's GIs.
            if let Ok(entries) = fs::read_dir(&mig_dir) {
                for gi_entry in entries.flatten() {
                    let gi_name = gi_entry.file_name().to_string_lossy().into_owned();
                    let gi_path = gi_entry.path();
                    if !wanted.contains_key(&format!("{gi_name}/access")) {
                        fs::remove_dir_all(&gi_path).map_err(err)?;
                        continue;
                    }
                    for ci_entry in fs::read_dir(&gi_path).map_err(err)?.flatten() {
                        let ci_name = ci_entry.file_name().to_string_lossy().into_owned();
                        if ci_name != "access" && !wanted.contains_key(&format!("{gi_name}/{ci_name}/access"))
                        {
                            fs::remove_dir_all(ci_entry.path()).map_err(err)?;
                        }
                    }
                }
            }
            for (rel, content) in &wanted {
                write_if_changed(&mig_dir.join(rel), content).map_err(err)?;
            }
        }
        write_atomically(
            &proc.join(PROC_GENERATION_FILE),
            state.generation.to_string().as_bytes(),
        )
        .map_err(err)
    }

    /// Adds one call to the simulated NVML time and publishes the totals. Called with the state lock held,
    /// so the totals file is written by one thread at a time. A failed write of it is ignored: it is a
    /// benchmark's reading, and the call it measures has already succeeded or failed on its own.
    fn account(&self, took: Duration) {
        if self.is_read_only() {
            return;
        }
        let totals = {
            let mut t = self.nvml_time.lock().unwrap_or_else(|e| e.into_inner());
            t.calls += 1;
            t.nanos += u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
            *t
        };
        let path = self.state_dir.join(NVML_TIME_FILE);
        let tmp = self.state_dir.join(format!("{NVML_TIME_FILE}.tmp"));
        let json = serde_json::to_vec(&totals).unwrap_or_default();
        let _ = fs::write(&tmp, json).and_then(|()| fs::rename(&tmp, &path));
    }

    fn sim_gpu(&self, gpu: u32) -> Result<&SimGpu> {
        self.gpus
            .get(gpu as usize)
            .ok_or_else(|| GpuError::NotFound(format!("GPU {gpu} (the node has {})", self.gpus.len())))
    }
}

fn gpu_state(state: &HardwareState, gpu: u32) -> Result<&GpuState> {
    state
        .gpus
        .get(gpu as usize)
        .ok_or_else(|| GpuError::NotFound(format!("GPU {gpu}")))
}

fn gpu_state_mut(state: &mut HardwareState, gpu: u32) -> Result<&mut GpuState> {
    state
        .gpus
        .get_mut(gpu as usize)
        .ok_or_else(|| GpuError::NotFound(format!("GPU {gpu}")))
}

fn profile(model: &'static GpuModel, gpu: u32, profile_id: u32) -> Result<&'static MigProfile> {
    model.profile_by_id(profile_id).ok_or_else(|| {
        GpuError::InvalidArgument(format!(
            "GPU {gpu} ({}) has no GPU-instance profile with ID {profile_id}",
            model.name
        ))
    })
}

impl GpuBackend for SimulatedBackend {
    fn name(&self) -> &'static str {
        "simulated"
    }

    /// Installs the driver root on first use (see [`crate::driver_root`]); a failure is logged, and
    /// what could be installed is there.
    fn driver_root(&self) -> &Path {
        if self.owns_driver_root {
            self.install_driver_root.call_once(|| {
                let dirs = crate::driver_root::artifact_dirs();
                match crate::driver_root::install(&self.driver_root, &self.state_dir, &dirs) {
                    Ok(installed) => installed.warn_once_if_incomplete(&dirs),
                    Err(e) => warn!(error = %e, "cannot install the simulated driver root"),
                }
            });
        }
        &self.driver_root
    }

    fn discover(&self) -> Result<NodeGpus> {
        self.read(|state| {
            let (gpus, unusable) = tessera_gpu_api::discover_each(self.gpus.len() as u32, |i| {
                let index = i as usize;
                let (gpu, hw) = (&self.gpus[index], &state.gpus[index]);
                match gpu.fault {
                    Some(SimulatedFault::Lost) => {
                        return Err(GpuError::GpuLost(format!(
                            "GPU {i} fell off the bus (nvmlDeviceGetHandleByIndex_v2 returned 15)"
                        )));
                    }
                    Some(SimulatedFault::MemoryNotSupported) => {
                        return Err(GpuError::NotSupported(format!(
                            "read the memory of GPU {i} (nvmlDeviceGetMemoryInfo returned 3)"
                        )));
                    }
                    None => {}
                }
                Ok(GpuInfo {
                    index: i,
                    minor: i,
                    uuid: gpu.uuid.clone(),
                    product_name: gpu.model.product_name.to_string(),
                    brand: gpu.model.brand.to_string(),
                    architecture: gpu.model.architecture.as_str().to_string(),
                    cuda_compute_capability: gpu.model.compute_capability.to_string(),
                    memory_bytes: gpu.model.memory_bytes(),
                    multiprocessors: gpu.model.multiprocessors,
                    pci_bus_id: gpu.pci_bus_id.clone(),
                    pcie_root: Some(gpu.pcie_root.clone()),
                    numa_node: Some(gpu.numa_node),
                    mig: Some(gpu.model.mig_info(hw.mig_current)),
                    healthy: true,
                })
            });
            Ok(NodeGpus {
                driver_version: Some(SIMULATED_DRIVER_VERSION.to_string()),
                cuda_driver_version: Some(SIMULATED_CUDA_DRIVER_VERSION.to_string()),
                gpus,
                unusable,
            })
        })
    }

    fn mig_mode(&self, gpu: u32) -> Result<MigMode> {
        self.read(|state| {
            let g = gpu_state(state, gpu)?;
            Ok(MigMode {
                current: g.mig_current,
                pending: g.mig_pending,
            })
        })
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<()> {
        let status = self.set_mig_mode_nvml(gpu, enabled)?;
        tessera_gpu_api::mig_mode_change_outcome(gpu, enabled, status, self.mig_mode(gpu)?)
    }

    fn create_gpu_instance(&self, gpu: u32, profile_id: u32, placement: MigPlacement) -> Result<u32> {
        let sim = self.sim_gpu(gpu)?;
        self.write(|state| {
            let g = gpu_state_mut(state, gpu)?;
            g.require_mig(gpu, "create a GPU instance")?;
            let prof = profile(sim.model, gpu, profile_id)?;
            if !prof.placements().any(|p| p == placement) {
                return Err(GpuError::InvalidArgument(format!(
                    "placement {}:{} is not a placement of profile {} (starts {:?}, size {})",
                    placement.start, placement.size, prof.name, prof.placement_starts, prof.memory_slices
                )));
            }
            if let Some(taken) = g
                .gpu_instances
                .iter()
                .find(|gi| gi.placement.overlaps(&placement))
            {
                return Err(GpuError::InsufficientResources(format!(
                    "placement {}:{} on GPU {gpu} overlaps GPU instance {} at {}:{}",
                    placement.start, placement.size, taken.id, taken.placement.start, taken.placement.size
                )));
            }
            let same_profile = g
                .gpu_instances
                .iter()
                .filter(|gi| gi.profile_id == profile_id)
                .count() as u32;
            if same_profile >= prof.instance_count {
                return Err(GpuError::InsufficientResources(format!(
                    "GPU {gpu} already has the maximum of {} {} GPU instances",
                    prof.instance_count, prof.name
                )));
            }
            let used_compute: u32 = g
                .gpu_instances
                .iter()
                .filter_map(|gi| sim.model.profile_by_id(gi.profile_id))
                .map(|p| p.compute_slices)
                .sum();
            if used_compute + prof.compute_slices > sim.model.compute_slices {
                return Err(GpuError::InsufficientResources(format!(
                    "GPU {gpu} has {} free compute slices, {} needs {}",
                    sim.model.compute_slices - used_compute,
                    prof.name,
                    prof.compute_slices
                )));
            }
            let id = gi_id_range(placement)
                .find(|id| g.gpu_instances.iter().all(|gi| gi.id != *id))
                .ok_or_else(|| {
                    GpuError::InsufficientResources(format!("no free GPU-instance id on GPU {gpu}"))
                })?;
            Latencies::charge(self.latencies.gpu_instance_create_ms);
            g.instances_created += 1;
            let serial = g.instances_created;
            g.gpu_instances.push(GiState {
                id,
                profile_id,
                placement,
                compute_instances: Vec::new(),
                serial,
            });
            Ok(id)
        })
    }

    fn create_compute_instance(&self, gpu: u32, gpu_instance: u32) -> Result<ComputeInstance> {
        let sim = self.sim_gpu(gpu)?;
        self.write(|state| {
            let g = gpu_state_mut(state, gpu)?;
            g.require_mig(gpu, "create a compute instance")?;
            let serial = g.instances_created + 1;
            let gi = g.gi_mut(gpu, gpu_instance)?;
            let prof = profile(sim.model, gpu, gi.profile_id)?;
            // tessera only creates the CI spanning the whole GI, so any existing CI uses up its slices.
            if !gi.compute_instances.is_empty() {
                return Err(GpuError::InsufficientResources(format!(
                    "GPU instance {gpu_instance} on GPU {gpu} has no free compute slices"
                )));
            }
            let id = (0..=MAX_COMPUTE_INSTANCE_ID)
                .find(|id| gi.compute_instances.iter().all(|ci| ci.id != *id))
                .ok_or_else(|| {
                    GpuError::InsufficientResources(format!(
                        "no free compute-instance id in GI {gpu_instance}"
                    ))
                })?;
            Latencies::charge(self.latencies.compute_instance_create_ms);
            let ci = CiState {
                id,
                profile_id: prof.full_compute_instance_profile_id(),
                uuid: format!("MIG-{}", uuid::Uuid::new_v4().hyphenated()),
                processes: Vec::new(),
                serial,
            };
            let out = ComputeInstance {
                id: ci.id,
                profile_id: ci.profile_id,
                uuid: ci.uuid.clone(),
            };
            gi.compute_instances.push(ci);
            g.instances_created = serial;
            Ok(out)
        })
    }

    fn destroy_compute_instance(&self, gpu: u32, gpu_instance: u32, compute_instance: u32) -> Result<()> {
        self.write(|state| {
            let g = gpu_state_mut(state, gpu)?;
            g.require_mig(gpu, "destroy a compute instance")?;
            let gi = g.gi_mut(gpu, gpu_instance)?;
            let pos = gi.compute_instances.iter().position(|ci| ci.id == compute_instance).ok_or_else(|| {
                GpuError::NotFound(format!("compute instance {compute_instance} of GPU instance {gpu_instance} on GPU {gpu}"))
            })?;
            let pids = &gi.compute_instances[pos].processes;
            if !pids.is_empty() {
                return Err(GpuError::InUse(format!(
                    "compute instance {compute_instance} of GPU instance {gpu_instance} on GPU {gpu} runs processes {pids:?}"
                )));
            }
            Latencies::charge(self.latencies.compute_instance_destroy_ms);
            gi.compute_instances.remove(pos);
            Ok(())
        })
    }

    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance: u32) -> Result<()> {
        self.write(|state| {
            let g = gpu_state_mut(state, gpu)?;
            g.require_mig(gpu, "destroy a GPU instance")?;
            let gi = g.gi(gpu, gpu_instance)?;
            if !gi.compute_instances.is_empty() {
                let ids: Vec<u32> = gi.compute_instances.iter().map(|ci| ci.id).collect();
                return Err(GpuError::InUse(format!(
                    "GPU instance {gpu_instance} on GPU {gpu} still has compute instances {ids:?}"
                )));
            }
            Latencies::charge(self.latencies.gpu_instance_destroy_ms);
            g.gpu_instances.retain(|gi| gi.id != gpu_instance);
            Ok(())
        })
    }

    fn list_gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>> {
        self.read(|state| {
            let g = gpu_state(state, gpu)?;
            if !g.mig_current {
                return Ok(Vec::new());
            }
            let mut out: Vec<GpuInstance> = g
                .gpu_instances
                .iter()
                .map(|gi| GpuInstance {
                    id: gi.id,
                    profile_id: gi.profile_id,
                    placement: gi.placement,
                    compute_instances: gi
                        .compute_instances
                        .iter()
                        .map(|ci| ComputeInstance {
                            id: ci.id,
                            profile_id: ci.profile_id,
                            uuid: ci.uuid.clone(),
                        })
                        .collect(),
                })
                .collect();
            out.sort_by_key(|gi| gi.id);
            Ok(out)
        })
    }

    fn compute_mode(&self, gpu: u32) -> Result<ComputeMode> {
        self.read(|state| Ok(gpu_state(state, gpu)?.compute_mode))
    }

    fn set_compute_mode(&self, gpu: u32, mode: ComputeMode) -> Result<()> {
        self.write(|state| {
            gpu_state_mut(state, gpu)?.compute_mode = mode;
            Ok(())
        })
    }

    fn time_slice(&self, gpu: u32) -> Result<TimeSlice> {
        self.sim_gpu(gpu)?;
        let known = self.known_time_slices.lock().unwrap_or_else(|e| e.into_inner());
        Ok(known.get(&gpu).copied().unwrap_or(TimeSlice::Default))
    }

    fn set_time_slice(&self, gpu: u32, slice: TimeSlice) -> Result<()> {
        self.write(|state| {
            gpu_state_mut(state, gpu)?.time_slice = slice;
            Ok(())
        })?;
        self.known_time_slices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(gpu, slice);
        Ok(())
    }

    fn mig_capability_minors(
        &self,
        gpu: u32,
        gpu_instance: u32,
        compute_instance: u32,
    ) -> Result<(u32, u32)> {
        self.sim_gpu(gpu)?;
        // The simulated GPU's minor is its index.
        mig_minors_by_formula(gpu, gpu_instance, compute_instance)
    }

    fn char_device(&self, path: &str) -> Result<CharDevice> {
        canned_char_device(path)
    }

    fn usage(
        &self,
        query: &tessera_gpu_api::usage::UsageQuery<'_>,
    ) -> Result<tessera_gpu_api::usage::DeviceUsage> {
        self.sim_gpu(query.gpu)?;
        crate::load::usage(&self.state_dir, query)
    }

    fn processes(&self, gpu: u32, mig: Option<(u32, u32)>) -> Result<Vec<u32>> {
        self.read(|state| {
            let g = gpu_state(state, gpu)?;
            match mig {
                None => Ok(g.all_processes()),
                Some((gi, ci)) => {
                    g.require_mig(gpu, "list processes of a MIG device")?;
                    let ci_state = g
                        .gi(gpu, gi)?
                        .compute_instances
                        .iter()
                        .find(|c| c.id == ci)
                        .ok_or_else(|| {
                            GpuError::NotFound(format!(
                                "compute instance {ci} of GPU instance {gi} on GPU {gpu}"
                            ))
                        })?;
                    Ok(ci_state.processes.clone())
                }
            }
        })
    }
}

/// Minors of `/dev/nvidia-caps/nvidia-cap<N>` from `/proc/driver/nvidia-caps/mig-minors`'s fixed layout
/// (`gpu-mig-mps.md` 5.2): 15 GIs × (1 + 8 CIs) per GPU after `config` (1) and `monitor` (2).
pub fn mig_minors_by_formula(gpu_minor: u32, gpu_instance: u32, compute_instance: u32) -> Result<(u32, u32)> {
    if gpu_instance > MAX_GPU_INSTANCE_ID || compute_instance > MAX_COMPUTE_INSTANCE_ID {
        return Err(GpuError::InvalidArgument(format!(
            "GPU instance {gpu_instance} / compute instance {compute_instance} out of range (0..=14 / 0..=7)"
        )));
    }
    let gi_minor = 3 + 135 * gpu_minor + 9 * gpu_instance;
    Ok((gi_minor, gi_minor + 1 + compute_instance))
}

/// Directory of the simulated driver root under the state directory.
pub const DRIVER_ROOT_DIR: &str = "driver-root";

/// Device numbers of a typical NVIDIA host (`nvidia-caps` and `nvidia-uvm` majors are dynamic on real ones).
fn canned_char_device(path: &str) -> Result<CharDevice> {
    let dev = |major, minor| Ok(CharDevice { major, minor });
    match path {
        "/dev/nvidiactl" => return dev(195, 255),
        "/dev/nvidia-modeset" => return dev(195, 254),
        "/dev/nvidia-uvm" => return dev(510, 0),
        "/dev/nvidia-uvm-tools" => return dev(510, 1),
        _ => {}
    }
    let number = |s: &str| {
        s.parse::<u32>()
            .ok()
            .filter(|_| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
    };
    if let Some(n) = path.strip_prefix("/dev/nvidia-caps/nvidia-cap").and_then(number) {
        return dev(508, n);
    }
    if let Some(n) = path
        .strip_prefix("/dev/nvidia")
        .and_then(number)
        .filter(|n| *n < 255)
    {
        return dev(195, n);
    }
    Err(GpuError::NotFound(format!("character device {path}")))
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeSet, sync::Arc};

    use super::*;

    #[test]
    fn the_latencies_file_the_benchmarks_give_the_real_node_is_the_documented_hardware_like_estimate() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../e2e/bench/hardware-like-latencies.yaml");
        let text = std::fs::read_to_string(&path).unwrap();
        let read: Latencies = serde_norway::from_str(&text).unwrap();
        assert_eq!(read, Latencies::HARDWARE_LIKE, "{}", path.display());
    }

    /// A simulated node in a fresh temporary state directory.
    struct Node {
        dir: tempfile::TempDir,
        backend: SimulatedBackend,
    }

    struct NodeBuilder {
        name: String,
        spec: NodeSpec,
    }

    impl NodeBuilder {
        fn new() -> Self {
            Self {
                name: "node-a".into(),
                spec: NodeSpec::default(),
            }
        }
        fn named(mut self, name: &str) -> Self {
            self.name = name.into();
            self
        }
        fn gpus(mut self, model: &str, count: u32) -> Self {
            self.spec = self.spec.with_gpus(model, count);
            self
        }
        fn mig_gpus(mut self, model: &str, count: u32) -> Self {
            self.spec = self.spec.with_mig_gpus(model, count);
            self
        }
        fn build(self) -> Node {
            let dir = tempfile::tempdir().unwrap();
            let backend = SimulatedBackend::from_spec(&self.name, &self.spec, dir.path()).unwrap();
            Node { dir, backend }
        }
    }

    impl Node {
        fn reopen(&self, spec: &NodeSpec) -> SimulatedBackend {
            SimulatedBackend::from_spec("node-a", spec, self.dir.path()).unwrap()
        }
    }

    fn placement(start: u32, size: u32) -> MigPlacement {
        MigPlacement { start, size }
    }

    fn h100() -> &'static GpuModel {
        models::model("H100-SXM5-80GB").unwrap()
    }

    #[test]
    fn every_profile_and_placement_of_every_model_creates_and_destroys_cleanly() {
        for model in models::MODELS {
            let node = NodeBuilder::new().mig_gpus(model.name, 1).build();
            let b = &node.backend;
            for prof in model.mig_profiles {
                for pl in prof.placements() {
                    let gi = b
                        .create_gpu_instance(0, prof.id, pl)
                        .unwrap_or_else(|e| panic!("{} {} {pl:?}: {e}", model.name, prof.name));
                    let ci = b.create_compute_instance(0, gi).unwrap();
                    assert!(ci.uuid.starts_with("MIG-"), "{}", ci.uuid);
                    assert_eq!(ci.profile_id, prof.full_compute_instance_profile_id());
                    let listed = b.list_gpu_instances(0).unwrap();
                    assert_eq!(listed.len(), 1);
                    assert_eq!(
                        (listed[0].id, listed[0].profile_id, listed[0].placement),
                        (gi, prof.id, pl)
                    );
                    assert_eq!(listed[0].compute_instances, vec![ci.clone()]);
                    b.destroy_compute_instance(0, gi, ci.id).unwrap();
                    b.destroy_gpu_instance(0, gi).unwrap();
                    assert!(b.list_gpu_instances(0).unwrap().is_empty());
                }
            }
        }
    }

    #[test]
    fn a_placement_already_taken_gives_insufficient_resources() {
        let node = NodeBuilder::new().mig_gpus("H100-SXM5-80GB", 1).build();
        let b = &node.backend;
        b.create_gpu_instance(0, 9, placement(4, 4)).unwrap(); // 3g.40gb on slices 4..8
        // 3g again, 1g, 1g.20gb and 7g all touch slices 4..8.
        for (profile, pl) in [
            (9, placement(4, 4)),
            (19, placement(5, 1)),
            (15, placement(6, 2)),
            (0, placement(0, 8)),
        ] {
            let e = b.create_gpu_instance(0, profile, pl).unwrap_err();
            assert!(
                matches!(e, GpuError::InsufficientResources(_)),
                "{profile} {pl:?}: {e}"
            );
        }
        // The other half is still free.
        b.create_gpu_instance(0, 5, placement(0, 4)).unwrap();
    }

    #[test]
    fn the_instance_count_of_a_profile_is_enforced() {
        let node = NodeBuilder::new().mig_gpus("H100-SXM5-80GB", 1).build();
        let b = &node.backend;
        b.create_gpu_instance(0, 20, placement(0, 1)).unwrap(); // 1g.10gb+me: one instance only
        let e = b.create_gpu_instance(0, 20, placement(3, 1)).unwrap_err();
        assert!(matches!(e, GpuError::InsufficientResources(_)), "{e}");
    }

    #[test]
    fn unknown_profiles_and_foreign_placements_are_invalid_arguments() {
        let node = NodeBuilder::new().mig_gpus("H100-SXM5-80GB", 1).build();
        let b = &node.backend;
        assert!(matches!(
            b.create_gpu_instance(0, 7, placement(0, 1)),
            Err(GpuError::InvalidArgument(_))
        ));
        assert!(matches!(
            b.create_gpu_instance(0, 9, placement(2, 4)),
            Err(GpuError::InvalidArgument(_))
        ));
        assert!(matches!(
            b.create_gpu_instance(0, 9, placement(0, 3)),
            Err(GpuError::InvalidArgument(_))
        ));
        assert!(matches!(
            b.create_gpu_instance(1, 9, placement(0, 4)),
            Err(GpuError::NotFound(_))
        ));
    }

    #[test]
    fn mig_operations_with_mig_mode_off_are_not_supported() {
        let node = NodeBuilder::new().gpus("H100-SXM5-80GB", 1).build();
        let b = &node.backend;
        assert!(matches!(
            b.create_gpu_instance(0, 9, placement(0, 4)),
            Err(GpuError::NotSupported(_))
        ));
        assert!(matches!(
            b.create_compute_instance(0, 1),
            Err(GpuError::NotSupported(_))
        ));
        assert!(matches!(
            b.destroy_compute_instance(0, 1, 0),
            Err(GpuError::NotSupported(_))
        ));
        assert!(matches!(
            b.destroy_gpu_instance(0, 1),
            Err(GpuError::NotSupported(_))
        ));
        assert!(b.list_gpu_instances(0).unwrap().is_empty());
    }

    #[test]
    fn instances_in_use_cannot_be_destroyed_and_missing_ones_are_not_found() {
        let node = NodeBuilder::new().mig_gpus("H200-SXM-141GB", 1).build();
        let b = &node.backend;
        let gi = b.create_gpu_instance(0, 14, placement(2, 2)).unwrap();
        let ci = b.create_compute_instance(0, gi).unwrap();
        assert!(matches!(
            b.create_compute_instance(0, gi),
            Err(GpuError::InsufficientResources(_))
        ));
        assert!(matches!(b.destroy_gpu_instance(0, gi), Err(GpuError::InUse(_))));
        b.add_process(0, Some((gi, ci.id)), 4242).unwrap();
        assert_eq!(b.processes(0, Some((gi, ci.id))).unwrap(), [4242]);
        assert_eq!(b.processes(0, None).unwrap(), [4242]);
        assert!(matches!(
            b.destroy_compute_instance(0, gi, ci.id),
            Err(GpuError::InUse(_))
        ));
        assert!(matches!(b.set_mig_mode(0, false), Err(GpuError::InUse(_))));
        b.remove_process(0, 4242).unwrap();
        assert!(matches!(b.remove_process(0, 4242), Err(GpuError::NotFound(_))));
        b.destroy_compute_instance(0, gi, ci.id).unwrap();
        assert!(matches!(
            b.destroy_compute_instance(0, gi, ci.id),
            Err(GpuError::NotFound(_))
        ));
        b.destroy_gpu_instance(0, gi).unwrap();
        assert!(matches!(
            b.destroy_gpu_instance(0, gi),
            Err(GpuError::NotFound(_))
        ));
        assert!(matches!(
            b.create_compute_instance(0, gi),
            Err(GpuError::NotFound(_))
        ));
    }

    #[test]
    fn gpu_instance_ids_follow_placement_size_and_compute_instance_ids_start_at_zero() {
        let node = NodeBuilder::new().mig_gpus("A100-SXM4-80GB", 1).build();
        let b = &node.backend;
        let half = b.create_gpu_instance(0, 9, placement(4, 4)).unwrap();
        let quarter = b.create_gpu_instance(0, 14, placement(2, 2)).unwrap();
        let eighth = b.create_gpu_instance(0, 19, placement(1, 1)).unwrap();
        let eighth2 = b.create_gpu_instance(0, 19, placement(0, 1)).unwrap();
        assert_eq!([half, quarter, eighth, eighth2], [1, 3, 7, 8]);
        assert_eq!(b.create_compute_instance(0, quarter).unwrap().id, 0);
        let whole = NodeBuilder::new().mig_gpus("B200", 1).build();
        assert_eq!(
            whole.backend.create_gpu_instance(0, 0, placement(0, 8)).unwrap(),
            0
        );
    }

    #[test]
    fn every_compute_instance_creation_gets_a_new_mig_uuid() {
        let node = NodeBuilder::new().mig_gpus("H100-SXM5-80GB", 1).build();
        let b = &node.backend;
        let gi = b.create_gpu_instance(0, 19, placement(3, 1)).unwrap();
        let first = b.create_compute_instance(0, gi).unwrap();
        b.destroy_compute_instance(0, gi, first.id).unwrap();
        let second = b.create_compute_instance(0, gi).unwrap();
        assert_eq!(first.id, second.id);
        assert_ne!(first.uuid, second.uuid);
    }

    #[test]
    fn concurrent_creates_on_one_gpu_never_overlap() {
        let node = NodeBuilder::new().mig_gpus("H100-SXM5-80GB", 1).build();
        let spec = NodeSpec::default().with_mig_gpus("H100-SXM5-80GB", 1);
        let all: Vec<(u32, MigPlacement)> = h100()
            .mig_profiles
            .iter()
            .flat_map(|p| p.placements().map(move |pl| (p.id, pl)))
            .collect();
        let created = Arc::new(Mutex::new(Vec::new()));
        std::thread::scope(|s| {
            for t in 0..4 {
                // Separate backends have separate lock descriptors, like separate processes.
                let backend = Arc::new(node.reopen(&spec));
                let created = Arc::clone(&created);
                let all = all.clone();
                s.spawn(move || {
                    for round in 0..3 {
                        for (i, (profile, pl)) in
                            all.iter().enumerate().filter(|(i, _)| (i + t + round) % 2 == 0)
                        {
                            match backend.create_gpu_instance(0, *profile, *pl) {
                                Ok(id) if (i + round) % 3 == 0 => {
                                    backend.destroy_gpu_instance(0, id).unwrap()
                                }
                                Ok(id) => created.lock().unwrap().push((id, *pl)),
                                Err(GpuError::InsufficientResources(_)) => {}
                                Err(e) => panic!("unexpected {e}"),
                            }
                        }
                    }
                });
            }
        });
        let live = node.backend.list_gpu_instances(0).unwrap();
        assert!(!live.is_empty());
        assert_eq!(
            live.len(),
            created.lock().unwrap().len(),
            "every successful create is live exactly once"
        );
        for (i, a) in live.iter().enumerate() {
            for b in &live[i + 1..] {
                assert!(!a.placement.overlaps(&b.placement), "{a:?} overlaps {b:?}");
                assert_ne!(a.id, b.id);
            }
        }
    }

    #[test]
    fn state_survives_reopening_the_backend_from_the_same_state_dir() {
        let node = NodeBuilder::new().mig_gpus("H100-SXM5-80GB", 2).build();
        let b = &node.backend;
        let gi = b.create_gpu_instance(1, 9, placement(0, 4)).unwrap();
        let ci = b.create_compute_instance(1, gi).unwrap();
        b.set_time_slice(0, TimeSlice::Long).unwrap();
        b.set_compute_mode(0, ComputeMode::ExclusiveProcess).unwrap();
        let before = b.discover().unwrap();
        drop(node.backend);
        let reopened = SimulatedBackend::from_spec(
            "node-a",
            &NodeSpec::default().with_gpus("H100-SXM5-80GB", 2),
            node.dir.path(),
        )
        .unwrap();
        assert_eq!(reopened.discover().unwrap(), before);
        let gis = reopened.list_gpu_instances(1).unwrap();
        assert_eq!(gis.len(), 1);
        assert_eq!(gis[0].compute_instances, vec![ci]);
        assert_eq!(reopened.hardware_time_slice(0).unwrap(), TimeSlice::Long);
        // Like NVML, a new backend cannot read the time-slice back: it knows only what it set itself.
        assert_eq!(reopened.time_slice(0).unwrap(), TimeSlice::Default);
        assert_eq!(reopened.compute_mode(0).unwrap(), ComputeMode::ExclusiveProcess);
        assert!(
            reopened.mig_mode(0).unwrap().current,
            "the node file's initial MIG mode does not override state"
        );
    }

    #[test]
    fn every_call_that_touches_the_state_is_counted_in_the_state_dirs_time_file() {
        let node = NodeBuilder::new().mig_gpus("H100-SXM5-80GB", 1).build();
        let b = &node.backend;
        let opened = b.nvml_time();
        let gi = b.create_gpu_instance(0, 9, placement(0, 4)).unwrap();
        b.create_compute_instance(0, gi).unwrap();
        b.list_gpu_instances(0).unwrap();
        // A failing call is NVML time too.
        b.create_gpu_instance(0, 9, placement(0, 4)).unwrap_err();
        // Answered from memory: not a state call.
        b.char_device("/dev/nvidiactl").unwrap();
        let now = b.nvml_time();
        assert_eq!(now.calls, opened.calls + 4);
        assert!(now.nanos > opened.nanos);
        let file: NvmlTime =
            serde_json::from_slice(&fs::read(node.dir.path().join(NVML_TIME_FILE)).unwrap()).unwrap();
        assert_eq!(file, now);
    }

    #[test]
    fn a_corrupt_state_file_names_the_file_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(STATE_FILE), "{\"version\": 1, \"gpus\": [").unwrap();
        let spec = NodeSpec::default().with_gpus("B200", 1);
        let e = SimulatedBackend::from_spec("n", &spec, dir.path())
            .err()
            .expect("corrupt state must fail");
        let msg = e.to_string();
        assert!(matches!(e, GpuError::SimulatedState { .. }));
        assert!(
            msg.contains(&dir.path().join(STATE_FILE).display().to_string()),
            "{msg}"
        );
        assert!(msg.contains("delete it"), "{msg}");
    }

    #[test]
    fn ampere_mig_mode_changes_stay_pending_until_a_reset() {
        let node = NodeBuilder::new().gpus("A100-SXM4-40GB", 1).build();
        let b = &node.backend;
        let e = b.set_mig_mode(0, true).unwrap_err();
        assert!(matches!(e, GpuError::ResetRequired(_)), "{e}");
        assert_eq!(
            b.mig_mode(0).unwrap(),
            MigMode {
                current: false,
                pending: true
            }
        );
        assert!(matches!(
            b.create_gpu_instance(0, 9, placement(0, 4)),
            Err(GpuError::NotSupported(_))
        ));
        assert!(
            !b.discover().unwrap().gpus[0]
                .mig
                .as_ref()
                .unwrap()
                .mode_toggle_without_reset
        );
        b.reset_gpu(0).unwrap();
        assert_eq!(
            b.mig_mode(0).unwrap(),
            MigMode {
                current: true,
                pending: true
            }
        );
        b.create_gpu_instance(0, 9, placement(0, 4)).unwrap();
    }

    #[test]
    fn hopper_mig_mode_changes_apply_at_once_unless_the_gpu_is_busy() {
        let node = NodeBuilder::new().gpus("H100-SXM5-80GB", 1).build();
        let b = &node.backend;
        b.add_process(0, None, 7).unwrap();
        assert!(matches!(b.set_mig_mode(0, true), Err(GpuError::InUse(_))));
        b.remove_process(0, 7).unwrap();
        b.set_mig_mode(0, true).unwrap();
        assert_eq!(
            b.mig_mode(0).unwrap(),
            MigMode {
                current: true,
                pending: true
            }
        );
        let gi = b.create_gpu_instance(0, 19, placement(0, 1)).unwrap();
        assert!(matches!(b.set_mig_mode(0, false), Err(GpuError::InUse(_))));
        b.destroy_gpu_instance(0, gi).unwrap();
        b.set_mig_mode(0, false).unwrap();
        assert_eq!(
            b.mig_mode(0).unwrap(),
            MigMode {
                current: false,
                pending: false
            }
        );
    }

    #[test]
    fn uuids_are_stable_per_node_and_differ_between_nodes() {
        let a = NodeBuilder::new()
            .named("node-a")
            .gpus("H100-SXM5-80GB", 8)
            .build();
        let a2 = NodeBuilder::new()
            .named("node-a")
            .gpus("H100-SXM5-80GB", 8)
            .build();
        let b = NodeBuilder::new()
            .named("node-b")
            .gpus("H100-SXM5-80GB", 8)
            .build();
        let uuids = |n: &Node| {
            n.backend
                .discover()
                .unwrap()
                .gpus
                .into_iter()
                .map(|g| g.uuid)
                .collect::<Vec<_>>()
        };
        assert_eq!(uuids(&a), uuids(&a2));
        let all: BTreeSet<String> = uuids(&a).into_iter().chain(uuids(&b)).collect();
        assert_eq!(all.len(), 16);
        assert!(
            uuids(&a)[0].starts_with("GPU-") && uuids(&a)[0].len() == 40,
            "{}",
            uuids(&a)[0]
        );
    }

    #[test]
    fn discovery_reports_identity_capacities_and_mig_profiles() {
        let node = NodeBuilder::new()
            .gpus("H100-SXM5-80GB", 2)
            .gpus("A100-SXM4-40GB", 2)
            .build();
        let found = node.backend.discover().unwrap();
        assert_eq!(found.driver_version.as_deref(), Some("580.159.03"));
        assert_eq!(found.cuda_driver_version.as_deref(), Some("13.0"));
        assert_eq!(found.gpus.len(), 4);
        let g0 = &found.gpus[0];
        assert_eq!(
            (g0.index, g0.minor, g0.product_name.as_str()),
            (0, 0, "NVIDIA H100 80GB HBM3")
        );
        assert_eq!(
            (g0.architecture.as_str(), g0.cuda_compute_capability.as_str()),
            ("Hopper", "9.0")
        );
        assert_eq!(g0.multiprocessors, 132);
        assert_eq!(g0.pci_bus_id, "0000:18:00.0");
        assert_eq!(g0.numa_node, Some(0));
        let g3 = &found.gpus[3];
        assert_eq!(
            (g3.product_name.as_str(), g3.numa_node),
            ("NVIDIA A100-SXM4-40GB", Some(1))
        );
        let mig = g3.mig.as_ref().unwrap();
        assert!(!mig.enabled);
        assert_eq!(
            mig.profile("3g.20gb").unwrap().placements,
            [placement(0, 4), placement(4, 4)]
        );
        let buses: BTreeSet<&str> = found.gpus.iter().map(|g| g.pci_bus_id.as_str()).collect();
        assert_eq!(buses.len(), 4);
    }

    #[test]
    fn a_node_file_with_an_unknown_model_names_it_and_lists_the_known_ones() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.yaml");
        fs::write(
            &file,
            "gpus: [{model: H100-SXM5-80GB, count: 2}, {model: V100, count: 1}]\n",
        )
        .unwrap();
        let msg = SimulatedBackend::new("n", &file, dir.path())
            .err()
            .unwrap()
            .to_string();
        assert!(
            msg.contains("\"V100\"") && msg.contains("A100-SXM4-40GB, A100-SXM4-80GB"),
            "{msg}"
        );
        assert!(msg.contains(&file.display().to_string()), "{msg}");
        fs::write(&file, "gpus: [{model: B200, cuont: 2}]\n").unwrap();
        let msg = SimulatedBackend::new("n", &file, dir.path())
            .err()
            .unwrap()
            .to_string();
        assert!(msg.contains("cuont"), "{msg}");
    }

    #[test]
    fn a_mixed_node_file_indexes_gpus_in_file_order() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.yaml");
        fs::write(&file, "gpus:\n  - model: B200\n    count: 1\n  - model: H200-SXM-141GB\n    count: 2\n    migEnabled: true\n").unwrap();
        let b = SimulatedBackend::new("n", &file, &dir.path().join("state")).unwrap();
        let gpus = b.discover().unwrap().gpus;
        let names: Vec<&str> = gpus.iter().map(|g| g.product_name.as_str()).collect();
        assert_eq!(names, ["NVIDIA B200", "NVIDIA H200", "NVIDIA H200"]);
        assert_eq!(
            gpus.iter()
                .map(|g| g.mig.as_ref().unwrap().enabled)
                .collect::<Vec<_>>(),
            [false, true, true]
        );
    }

    #[test]
    fn mig_capability_minors_follow_the_mig_minors_layout() {
        let node = NodeBuilder::new().gpus("H100-SXM5-80GB", 8).build();
        let b = &node.backend;
        assert_eq!(b.mig_capability_minors(0, 0, 0).unwrap(), (3, 4));
        assert_eq!(b.mig_capability_minors(0, 1, 1).unwrap(), (12, 14));
        assert_eq!(mig_minors_by_formula(31, 14, 7).unwrap(), (4314, 4322));
        assert!(matches!(
            b.mig_capability_minors(0, 15, 0),
            Err(GpuError::InvalidArgument(_))
        ));
        assert!(matches!(
            b.mig_capability_minors(8, 0, 0),
            Err(GpuError::NotFound(_))
        ));
    }

    #[test]
    fn char_devices_have_the_canned_numbers() {
        let node = NodeBuilder::new().gpus("H100-SXM5-80GB", 1).build();
        let b = &node.backend;
        let d = |p| b.char_device(p).map(|c| (c.major, c.minor)).unwrap();
        assert_eq!(d("/dev/nvidia3"), (195, 3));
        assert_eq!(d("/dev/nvidiactl"), (195, 255));
        assert_eq!(d("/dev/nvidia-modeset"), (195, 254));
        assert_eq!(d("/dev/nvidia-uvm"), (510, 0));
        assert_eq!(d("/dev/nvidia-uvm-tools"), (510, 1));
        assert_eq!(d("/dev/nvidia-caps/nvidia-cap12"), (508, 12));
        assert!(matches!(
            b.char_device("/dev/nvidia-foo"),
            Err(GpuError::NotFound(_))
        ));
        assert!(matches!(b.char_device("/dev/sda"), Err(GpuError::NotFound(_))));
    }

    #[test]
    fn a_kernel_directory_reopens_as_the_same_node_with_the_same_state() {
        let node = NodeBuilder::new()
            .named("node-k")
            .mig_gpus("H100-SXM5-80GB", 2)
            .build();
        let gi = node.backend.create_gpu_instance(1, 9, placement(4, 4)).unwrap();
        let kernel = SimulatedBackend::open_kernel(node.dir.path()).unwrap();
        assert!(!kernel.is_read_only());
        assert_eq!(kernel.node_name(), "node-k");
        assert_eq!(kernel.gpu(1).unwrap().uuid, node.backend.gpu(1).unwrap().uuid);
        assert_eq!(kernel.list_gpu_instances(1).unwrap()[0].id, gi);
        let spec = KernelSpec::read(node.dir.path()).unwrap();
        assert_eq!(spec.node, NodeSpec::default().with_mig_gpus("H100-SXM5-80GB", 2));
    }

    #[test]
    fn a_kernel_whose_lock_cannot_be_written_is_read_only_and_refuses_changes_with_no_permission() {
        let node = NodeBuilder::new().mig_gpus("H100-SXM5-80GB", 1).build();
        node.backend.create_gpu_instance(0, 19, placement(0, 1)).unwrap();
        let lock = node.dir.path().join(LOCK_FILE);
        fs::set_permissions(&lock, std::os::unix::fs::PermissionsExt::from_mode(0o444)).unwrap();
        let opened = SimulatedBackend::open_kernel(node.dir.path());
        fs::set_permissions(&lock, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        let Ok(ro) = opened else { panic!("open failed") };
        // root writes through a 0444 file: only an unprivileged user gets the read-only view here.
        if !ro.is_read_only() {
            return;
        }
        assert_eq!(ro.list_gpu_instances(0).unwrap().len(), 1, "reads work");
        for e in [
            ro.create_gpu_instance(0, 19, placement(1, 1)).unwrap_err(),
            ro.set_mig_mode(0, false).unwrap_err(),
            ro.set_compute_mode(0, ComputeMode::Prohibited).unwrap_err(),
        ] {
            assert!(matches!(e, GpuError::NoPermission(_)), "{e}");
        }
    }

    #[test]
    fn the_kernel_is_found_walking_up_from_a_library_path() {
        let node = NodeBuilder::new().gpus("B200", 1).build();
        let root = tempfile::tempdir().unwrap();
        let lib = root.path().join("usr/lib/x86_64-linux-gnu");
        fs::create_dir_all(&lib).unwrap();
        std::os::unix::fs::symlink(node.dir.path(), root.path().join(KERNEL_DIR_NAME)).unwrap();
        let found = find_kernel_from(&lib.join("libnvidia-ml.so.1")).unwrap();
        assert_eq!(
            fs::canonicalize(found).unwrap(),
            fs::canonicalize(node.dir.path()).unwrap()
        );
        assert_eq!(
            find_kernel_from(Path::new("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")),
            None
        );
    }

    #[test]
    fn proc_access_files_follow_the_instances_and_heal_after_a_crash_between_the_two_writes() {
        let node = NodeBuilder::new().mig_gpus("H100-SXM5-80GB", 2).build();
        let b = &node.backend;
        let caps = node.dir.path().join("proc/driver/nvidia/capabilities");
        let gi = b.create_gpu_instance(1, 14, placement(2, 2)).unwrap();
        let gi_access = caps.join(format!("gpu1/mig/gi{gi}/access"));
        assert_eq!(
            fs::read_to_string(&gi_access).unwrap(),
            format!(
                "DeviceFileMinor: {}\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
                3 + 135 + 9 * gi
            )
        );
        let ci = b.create_compute_instance(1, gi).unwrap();
        let ci_access = caps.join(format!("gpu1/mig/gi{gi}/ci{}/access", ci.id));
        assert!(ci_access.is_file());
        assert!(caps.join("mig/config").is_file());
        assert!(
            fs::read_to_string(node.dir.path().join("proc/devices"))
                .unwrap()
                .contains("508 nvidia-caps")
        );
        // A crash after the state write, before `proc/`: the CI is gone from the state, its file is not.
        b.destroy_compute_instance(1, gi, ci.id).unwrap();
        fs::create_dir_all(ci_access.parent().unwrap()).unwrap();
        fs::write(&ci_access, "stale").unwrap();
        fs::write(node.dir.path().join("proc/.generation"), "0").unwrap();
        b.list_gpu_instances(1).unwrap();
        assert!(
            !ci_access.exists(),
            "the next call removes what the state no longer has"
        );
        assert!(gi_access.is_file());
        b.destroy_gpu_instance(1, gi).unwrap();
        assert!(!gi_access.exists());
    }

    #[test]
    fn a_container_sees_the_gpus_and_mig_devices_whose_device_nodes_it_holds() {
        let node = NodeBuilder::new().mig_gpus("H100-SXM5-80GB", 3).build();
        let b = &node.backend;
        let gi = b.create_gpu_instance(2, 9, placement(0, 4)).unwrap();
        let ci = b.create_compute_instance(2, gi).unwrap();
        let other = b.create_gpu_instance(2, 9, placement(4, 4)).unwrap();
        b.create_compute_instance(2, other).unwrap();
        let dev = tempfile::tempdir().unwrap();
        assert_eq!(
            b.visible_gpus(&DeviceView::at(dev.path())),
            [0, 1, 2],
            "no nvidiactl: the host"
        );
        fs::write(dev.path().join("nvidiactl"), "").unwrap();
        fs::write(dev.path().join("nvidia2"), "").unwrap();
        let view = DeviceView::at(dev.path());
        assert_eq!(b.visible_gpus(&view), [2]);
        assert!(
            b.mig_devices(2, &view).unwrap().is_empty(),
            "no caps, no MIG device"
        );
        let (gi_minor, ci_minor) = b.mig_capability_minors(2, gi, ci.id).unwrap();
        fs::create_dir(dev.path().join("nvidia-caps")).unwrap();
        for m in [gi_minor, ci_minor] {
            fs::write(dev.path().join(format!("nvidia-caps/nvidia-cap{m}")), "").unwrap();
        }
        let seen = b.mig_devices(2, &view).unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].uuid, ci.uuid);
        assert_eq!(b.mig_devices(2, &DeviceView::host()).unwrap().len(), 2);
    }

    #[test]
    fn a_gpu_absent_at_boot_shifts_the_indices_after_it_and_no_uuid_changes() {
        let all = NodeBuilder::new().gpus("H100-SXM5-80GB", 4).build();
        let mut group = GpuGroup::plain("H100-SXM5-80GB");
        group.count = 4;
        group.absent = vec![1];
        let spec = NodeSpec::default().with_group(group);
        let missing_one = SimulatedBackend::from_spec("node-a", &spec, all.dir.path()).unwrap();
        let uuids = |b: &SimulatedBackend| {
            (0..b.gpu_count())
                .map(|i| b.gpu(i).unwrap().uuid)
                .collect::<Vec<_>>()
        };
        let before = uuids(&all.backend);
        assert_eq!(
            uuids(&missing_one),
            [before[0].clone(), before[2].clone(), before[3].clone()]
        );
        assert_eq!(
            missing_one.gpu(1).unwrap().pci_bus_id,
            all.backend.gpu(2).unwrap().pci_bus_id
        );
    }

    #[test]
    fn a_training_fabric_completes_healthy_once_its_delay_after_the_driver_load_passed() {
        use crate::faults::FaultKind;
        let ms = Duration::from_millis;
        let training = |since| fabric_report(FabricState::InProgress, Some(ms(20_000)), since, &[]);
        let not_yet = training(Some(ms(19_999))).unwrap();
        assert_eq!(
            (not_yet.state, not_yet.health_summary),
            (2, 0),
            "0 is NOT_SUPPORTED, not healthy"
        );
        assert_eq!(
            training(None).unwrap().state,
            2,
            "an unreadable load time is no completion"
        );
        let done = training(Some(ms(20_000))).unwrap();
        assert_eq!(
            (done.state, done.status, done.health_summary),
            (3, 0, FABRIC_HEALTH_SUMMARY_HEALTHY)
        );
        assert_eq!(done.health_mask & 3, 2, "DEGRADED_BW_FALSE");
        assert_eq!(
            fabric_report(FabricState::InProgress, None, Some(ms(u64::MAX)), &[])
                .unwrap()
                .state,
            2,
            "a fixed state never changes"
        );
        assert_eq!(fabric_report(FabricState::None, None, None, &[]), None);
        let degraded =
            fabric_report(FabricState::Completed, None, None, &[FaultKind::FabricDegraded]).unwrap();
        assert_eq!(
            (degraded.health_summary, degraded.health_mask & 3),
            (FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY, 1)
        );
        let sick = fabric_report(FabricState::Completed, None, None, &[FaultKind::FabricUnhealthy]).unwrap();
        assert_eq!(
            (sick.health_summary, (sick.health_mask >> 4) & 3),
            (FABRIC_HEALTH_SUMMARY_UNHEALTHY, 1)
        );
        assert_eq!(
            fabric_report(FabricState::NotStarted, None, None, &[FaultKind::FabricUnhealthy])
                .unwrap()
                .state,
            1,
            "health is reported only for a completed fabric"
        );
    }

    #[test]
    fn a_fabric_delay_needs_a_state_that_can_still_complete() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.yaml");
        fs::write(
            &file,
            "gpus:\n  - model: H100-SXM5-80GB\n    fabric: Completed\n    fabricCompletesAfterMs: 20000\n",
        )
        .unwrap();
        let Err(e) = SimulatedBackend::new("n", &file, &dir.path().join("k")) else {
            panic!("a completed fabric with a delay was accepted");
        };
        assert!(e.to_string().contains("fabricCompletesAfterMs"), "{e}");
        fs::write(
            &file,
            "gpus:\n  - model: H100-SXM5-80GB\n    fabric: InProgress\n    fabricCompletesAfterMs: 0\n",
        )
        .unwrap();
        let b = SimulatedBackend::new("n", &file, &dir.path().join("k")).unwrap();
        assert_eq!(
            b.fabric(0).unwrap().unwrap().state,
            3,
            "completed from the kernel file's write on"
        );
    }

    #[test]
    fn a_node_file_describes_virtualization_fabric_and_the_processes_holding_a_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.yaml");
        fs::write(
            &file,
            "gpus:\n  - model: H100-SXM5-80GB\n    count: 2\n    virtualizationMode: Vgpu\n    fabric: InProgress\n    \
             processes: [{pid: 4200001, name: nv-hostengine}]\n",
        )
        .unwrap();
        let b = SimulatedBackend::new("n", &file, &dir.path().join("k")).unwrap();
        let g = b.gpu(1).unwrap();
        assert_eq!(
            (g.virtualization_mode, g.fabric),
            (VirtualizationMode::Vgpu, FabricState::InProgress)
        );
        assert_eq!(b.process_name(4_200_001).as_deref(), Some("nv-hostengine"));
        assert_eq!(
            b.processes(1, None).unwrap(),
            [4_200_001],
            "it holds each GPU of the group"
        );
        let kernel = KernelSpec::read(&dir.path().join("k")).unwrap();
        assert_eq!(
            kernel.node,
            NodeSpec::from_file(&file).unwrap(),
            "kernel.json round-trips the node file"
        );
    }

    #[test]
    fn a_gpu_reset_drops_mig_instances_and_sharing_settings() {
        let node = NodeBuilder::new().mig_gpus("H100-SXM5-80GB", 1).build();
        let b = &node.backend;
        let gi = b.create_gpu_instance(0, 5, placement(0, 4)).unwrap();
        let ci = b.create_compute_instance(0, gi).unwrap();
        b.set_time_slice(0, TimeSlice::Short).unwrap();
        b.add_process(0, Some((gi, ci.id)), 99).unwrap();
        assert!(matches!(b.reset_gpu(0), Err(GpuError::InUse(_))));
        b.remove_process(0, 99).unwrap();
        b.reset_gpu(0).unwrap();
        assert!(b.list_gpu_instances(0).unwrap().is_empty());
        assert_eq!(b.hardware_time_slice(0).unwrap(), TimeSlice::Default);
        assert!(
            b.mig_mode(0).unwrap().current,
            "Hopper keeps MIG on across a reset while the driver is loaded"
        );
    }
}
