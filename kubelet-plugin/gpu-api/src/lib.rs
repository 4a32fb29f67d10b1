//! What tessera's kubelet plugin asks of a GPU backend: the [`GpuBackend`] trait with its types and errors,
//! the GPU models tessera knows ([`models`]: identity, capacities, MIG geometry), what runs on a device
//! ([`usage`]) and how driver versions are named ([`driver_version`]).
//!
//! A crate of its own so that the plugin's NVML backend and the simulated driver
//! (`kubelet-plugin/sim-driver/model`, which implements the trait over its hardware model) share it without
//! the simulated driver linking the plugin.
//!
//! Two implementations: the plugin's `gpu::nvml` drives real GPUs through NVML; the simulated driver's
//! `tessera_sim_model::backend` models the same state machine
//! (MIG profile tables, placements, NVML error codes, state that survives a plugin restart) for kind,
//! laptops and tests. The operations mirror NVML one call each, so a crash between two calls leaves the same
//! half-done state on both backends, and recovery code is exercised by the tests as it runs on hardware.
//!
//! GPU-instance and compute-instance handles are never kept: every call names the GPU by index and the
//! instance by id, the way NVML handles must be re-resolved after a destroy or reset.

pub mod driver_version;
pub mod models;
pub mod usage;

use tessera_api::{GpuInfo, MigPlacement};

/// What discovery found on the node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeGpus {
    /// NVIDIA kernel driver version, e.g. `580.159.03`.
    pub driver_version: Option<String>,
    /// Highest CUDA version the driver supports, e.g. `13.0`.
    pub cuda_driver_version: Option<String>,
    pub gpus: Vec<GpuInfo>,
    /// GPUs that answered discovery with an error (lost, or a query the GPU does not support); they are
    /// left out of `gpus` so the others are served.
    pub unusable: Vec<UnusableGpu>,
}

/// A GPU left out of the inventory, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnusableGpu {
    pub index: u32,
    pub reason: String,
}

/// Discovers GPUs `0..count` one by one: a GPU whose discovery fails (`GPU_IS_LOST`, `NOT_SUPPORTED` for its
/// memory, …) is reported in the second list with the error, and the rest are served. One broken GPU must
/// not take the node's other GPUs down with it.
pub fn discover_each(
    count: u32,
    mut info: impl FnMut(u32) -> Result<GpuInfo>,
) -> (Vec<GpuInfo>, Vec<UnusableGpu>) {
    let mut gpus = Vec::new();
    let mut unusable = Vec::new();
    for index in 0..count {
        match info(index) {
            Ok(gpu) => gpus.push(gpu),
            Err(e) => unusable.push(UnusableGpu {
                index,
                reason: format!(
                    "GPU {index} is not offered: {e}; check it with `nvidia-smi -i {index} -q` (a lost GPU needs \
                     a reset or a reboot); the plugin serves the node's other GPUs"
                ),
            }),
        }
    }
    (gpus, unusable)
}

/// `NVML_ERROR_IN_USE`: the activation status `nvmlDeviceSetMigMode` reports for a busy GPU.
pub const NVML_ERROR_IN_USE: u32 = 19;

/// The outcome of `nvmlDeviceSetMigMode(enabled)` that returned success with `activation_status`, given the
/// mode read back afterwards. The call succeeds even when nothing changed: on a busy Hopper the status is
/// `IN_USE` and the mode is only pending, which is not a reset problem but processes to stop.
pub fn mig_mode_change_outcome(
    gpu: u32,
    enabled: bool,
    activation_status: u32,
    after: MigMode,
) -> Result<()> {
    let wanted = if enabled { "on" } else { "off" };
    if after.current == enabled {
        return Ok(());
    }
    if activation_status == NVML_ERROR_IN_USE {
        return Err(GpuError::InUse(format!(
            "GPU {gpu} is in use, so MIG mode was not turned {wanted}; stop the processes using the GPU \
             (`nvidia-smi -i {gpu}` lists them) and the claim is prepared on kubelet's next try"
        )));
    }
    if after.pending == enabled {
        return Err(GpuError::ResetRequired(format!(
            "MIG mode of GPU {gpu} is pending {wanted} until the GPU is reset"
        )));
    }
    Err(GpuError::Nvml {
        call: "nvmlDeviceSetMigMode",
        code: activation_status,
    })
}

/// MIG mode of a GPU; `pending` differs from `current` on Ampere until the GPU is reset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MigMode {
    pub current: bool,
    pub pending: bool,
}

/// A live GPU instance and its compute instances.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInstance {
    /// GPU-instance id (0..=14); not a function of the placement.
    pub id: u32,
    /// GI profile ID (`info.id`, e.g. 9 for 3g).
    pub profile_id: u32,
    pub placement: MigPlacement,
    pub compute_instances: Vec<ComputeInstance>,
}

/// A live compute instance: one MIG device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComputeInstance {
    /// Compute-instance id within its GPU instance (0..=7).
    pub id: u32,
    /// CI profile ID.
    pub profile_id: u32,
    /// `MIG-…` UUID, new on every creation.
    pub uuid: String,
}

/// NVML compute mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ComputeMode {
    Default,
    ExclusiveProcess,
    Prohibited,
}

/// Compute time-slice of a GPU shared by time-slicing (`nvidia-smi compute-policy --set-timeslice`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TimeSlice {
    Default = 0,
    Short = 1,
    Medium = 2,
    Long = 3,
}

/// A failed backend operation. The NVML return codes keep their meaning on both backends, so callers can
/// tell "placement taken" from "instance busy" from "already gone".
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The NVML library could not be loaded (no NVIDIA driver on this machine, or a wrong driver root).
    #[error(
        "failed to load the NVML library {path}: {reason}; install the NVIDIA driver or set --driver-root"
    )]
    LibraryNotFound { path: String, reason: String },
    /// `NVML_ERROR_INVALID_ARGUMENT`: unknown profile, placement not valid for the profile, bad index.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// `NVML_ERROR_NOT_SUPPORTED`: not MIG-capable, or MIG mode disabled for a MIG operation.
    #[error("not supported: {0}")]
    NotSupported(String),
    /// `NVML_ERROR_NO_PERMISSION`.
    #[error("no permission: {0}")]
    NoPermission(String),
    /// `NVML_ERROR_NOT_FOUND`: the GPU, GPU instance or compute instance does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// `NVML_ERROR_IN_USE`: processes or compute instances still hold the object.
    #[error("in use: {0}")]
    InUse(String),
    /// `NVML_ERROR_INSUFFICIENT_RESOURCES`: placement occupied or the profile's instance count exhausted.
    #[error("insufficient resources: {0}")]
    InsufficientResources(String),
    /// `NVML_ERROR_RESET_REQUIRED`: the MIG mode change needs a GPU reset the plugin will not do.
    #[error("reset required: {0}")]
    ResetRequired(String),
    /// `NVML_ERROR_GPU_IS_LOST`.
    #[error("GPU is lost: {0}")]
    GpuLost(String),
    /// The simulated node file is missing, malformed or names an unknown GPU model.
    #[error("failed to read simulated node file {path}: {reason}")]
    SimulatedNodeFile { path: String, reason: String },
    /// Reading or writing the simulated hardware state failed.
    #[error("failed to access simulated GPU state {path}: {reason}")]
    SimulatedState { path: String, reason: String },
    /// Any other NVML return code.
    #[error("NVML call {call} failed with code {code}")]
    Nvml { call: &'static str, code: u32 },
    /// Running an NVIDIA tool (`nvidia-smi`, `nvidia-cuda-mps-control`) failed.
    #[error("failed to run {program}: {reason}")]
    Tool { program: String, reason: String },
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;

/// The operations tessera needs from a node's GPUs. Implementations must be safe to call from several
/// threads at once; callers serialize operations per GPU (see the prepare state machine), not per node.
pub trait GpuBackend: Send + Sync + 'static {
    /// `nvml` or `simulated`; recorded in the node inventory.
    fn name(&self) -> &'static str;

    /// Root of the driver's user-space files as this process reads them (`/`, `/run/nvidia/driver`, GKE's
    /// `/home/kubernetes/bin/nvidia`, or where a container mounts one of them; the simulated driver root for
    /// the simulated backend), whose libraries and binaries every container gets (see
    /// the plugin's `gpu::driver_root`; the host path specs name is the plugin's `--driver-root`).
    fn driver_root(&self) -> &std::path::Path;

    /// Discovers every GPU with its identity, capacities and MIG profiles (with placements). Works whether or
    /// not MIG mode is on.
    fn discover(&self) -> Result<NodeGpus>;

    /// `nvmlDeviceGetMigMode`.
    fn mig_mode(&self, gpu: u32) -> Result<MigMode>;

    /// `nvmlDeviceSetMigMode`. Fails with [`GpuError::InUse`] when GPU instances or processes exist, and with
    /// [`GpuError::ResetRequired`] where the change needs a reset (Ampere: the pending mode changes, the
    /// current one does not).
    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<()>;

    /// `nvmlDeviceCreateGpuInstanceWithPlacement` for the GI profile `profile_id`; returns the new GI id.
    fn create_gpu_instance(&self, gpu: u32, profile_id: u32, placement: MigPlacement) -> Result<u32>;

    /// `nvmlGpuInstanceCreateComputeInstance` with the CI profile that spans the whole GI (C == G).
    fn create_compute_instance(&self, gpu: u32, gpu_instance: u32) -> Result<ComputeInstance>;

    /// `nvmlComputeInstanceDestroy`; [`GpuError::NotFound`] when already gone.
    fn destroy_compute_instance(&self, gpu: u32, gpu_instance: u32, compute_instance: u32) -> Result<()>;

    /// `nvmlGpuInstanceDestroy`; [`GpuError::InUse`] while compute instances remain.
    fn destroy_gpu_instance(&self, gpu: u32, gpu_instance: u32) -> Result<()>;

    /// Every GPU instance on the GPU with its compute instances (empty when MIG mode is off).
    fn list_gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstance>>;

    /// `nvmlDeviceGetComputeMode`.
    fn compute_mode(&self, gpu: u32) -> Result<ComputeMode>;

    /// `nvmlDeviceSetComputeMode`.
    fn set_compute_mode(&self, gpu: u32, mode: ComputeMode) -> Result<()>;

    /// Current compute time-slice.
    fn time_slice(&self, gpu: u32) -> Result<TimeSlice>;

    /// `nvidia-smi compute-policy -i <uuid> --set-timeslice <n>` (NVML has no public call for it).
    fn set_time_slice(&self, gpu: u32, slice: TimeSlice) -> Result<()>;

    /// Minors of the `/dev/nvidia-caps/nvidia-cap<N>` nodes that grant access to a GPU instance and one of
    /// its compute instances (`/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access`).
    fn mig_capability_minors(&self, gpu: u32, gpu_instance: u32, compute_instance: u32)
    -> Result<(u32, u32)>;

    /// Major and minor of a character device the container needs (`/dev/nvidia0`, `/dev/nvidiactl`,
    /// `/dev/nvidia-uvm`, `/dev/nvidia-caps/nvidia-cap12`, ...), so CDI specs carry them explicitly and the
    /// runtime need not stat a host node.
    fn char_device(&self, path: &str) -> Result<CharDevice>;

    /// PIDs of processes running on the GPU, or on one MIG instance of it.
    fn processes(&self, gpu: u32, mig: Option<(u32, u32)>) -> Result<Vec<u32>>;

    /// Utilization and memory of the GPU or MIG device, with its processes and whose claim each belongs to
    /// (see [`usage`]); read on every metrics scrape.
    fn usage(&self, query: &usage::UsageQuery<'_>) -> Result<usage::DeviceUsage>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_gpu_whose_mig_mode_stays_pending_is_in_use_not_reset_required() {
        let pending = MigMode {
            current: false,
            pending: true,
        };
        let e = mig_mode_change_outcome(3, true, NVML_ERROR_IN_USE, pending).unwrap_err();
        assert!(matches!(e, GpuError::InUse(_)), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("stop the processes") && !msg.contains("reset"),
            "{msg}"
        );
        assert!(matches!(
            mig_mode_change_outcome(3, true, 0, pending),
            Err(GpuError::ResetRequired(_))
        ));
        let on = MigMode {
            current: true,
            pending: true,
        };
        assert!(mig_mode_change_outcome(3, true, NVML_ERROR_IN_USE, on).is_ok());
    }

    #[test]
    fn one_gpu_failing_discovery_is_reported_and_the_others_are_served() {
        let (gpus, unusable) = discover_each(3, |i| {
            if i == 1 {
                Err(GpuError::GpuLost("nvmlDeviceGetUUID returned 15".into()))
            } else {
                Ok(GpuInfo {
                    index: i,
                    ..Default::default()
                })
            }
        });
        assert_eq!(gpus.iter().map(|g| g.index).collect::<Vec<_>>(), [0, 2]);
        assert_eq!(unusable.len(), 1);
        assert_eq!(unusable[0].index, 1);
        assert!(
            unusable[0].reason.contains("GPU is lost"),
            "{}",
            unusable[0].reason
        );
    }
}

/// A character device's numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CharDevice {
    pub major: u32,
    pub minor: u32,
}
