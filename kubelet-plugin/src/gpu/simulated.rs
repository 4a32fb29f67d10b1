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
//! trusted either, see [`crate::checkpoint`]).
//!
//! The state file is also the e2e interface: a harness may add a PID to `processes` of a GPU or compute
//! instance (under the same lock) to make the GPU busy.
//!
//! The backend's own time is the *simulated NVML time*: every call that reads or changes the state (lock,
//! read, parse, the NVML rules, write) is timed, and after each one the totals of this backend since it was
//! opened are written to `<state dir>/simulated-nvml-time.json` as `{"calls": N, "nanos": T}` (temp file and
//! rename, no sync), so a benchmark can subtract exactly the time a real GPU's NVML would have taken
//! instead. Calls answered from memory (canned device numbers) are not counted.

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

use super::{
    CharDevice, ComputeInstance, ComputeMode, GpuBackend, GpuError, GpuInstance, MigMode, NodeGpus, Result,
    TimeSlice,
    models::{self, GpuModel, MigProfile},
};

/// Driver version the simulated node reports.
pub const SIMULATED_DRIVER_VERSION: &str = "580.159.03";
/// CUDA driver version the simulated node reports.
pub const SIMULATED_CUDA_DRIVER_VERSION: &str = "13.0";

const STATE_FILE: &str = "simulated-gpus.json";
const LOCK_FILE: &str = "simulated-gpus.lock";
/// The backend's own time so far (see the module comment).
pub const NVML_TIME_FILE: &str = "simulated-nvml-time.json";
const STATE_VERSION: u32 = 1;
/// GPU-instance ids run 0..=14, compute-instance ids 0..=7 (`mig-minors` has gi0..gi14, ci0..ci7).
const MAX_GPU_INSTANCE_ID: u32 = 14;
const MAX_COMPUTE_INSTANCE_ID: u32 = 7;

/// The node file: which GPUs the simulated node has.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    pub gpus: Vec<GpuGroup>,
}

/// `count` GPUs of one model; several groups make a mixed node, indexed in file order.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GpuGroup {
    /// A name from [`models::MODELS`], e.g. `H100-SXM5-80GB`.
    pub model: String,
    #[serde(default = "one")]
    pub count: u32,
    /// MIG mode of these GPUs when the state file is first created (like an A100 whose InfoROM has MIG on).
    #[serde(default)]
    pub mig_enabled: bool,
    /// A fault these GPUs answer discovery with, to exercise a node with a broken GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fault: Option<SimulatedFault>,
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

impl NodeSpec {
    /// Adds `count` GPUs of `model` (builder for tests and callers without a node file).
    pub fn with_gpus(mut self, model: &str, count: u32) -> Self {
        self.gpus.push(GpuGroup {
            model: model.to_string(),
            count,
            mig_enabled: false,
            fault: None,
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
    for group in &spec.gpus {
        let model = models::model(&group.model).ok_or_else(|| {
            GpuError::InvalidArgument(format!(
                "unknown GPU model {:?}; known models: {}",
                group.model,
                models::known_model_names()
            ))
        })?;
        for _ in 0..group.count {
            let index = gpus.len() as u32;
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
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct GiState {
    id: u32,
    profile_id: u32,
    placement: MigPlacement,
    #[serde(default)]
    compute_instances: Vec<CiState>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct CiState {
    id: u32,
    profile_id: u32,
    uuid: String,
    #[serde(default)]
    processes: Vec<u32>,
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
            processes: Vec::new(),
            gpu_instances: Vec::new(),
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

/// A node's simulated GPUs. Cheap to share between threads; see the module comment for persistence.
pub struct SimulatedBackend {
    gpus: Vec<SimGpu>,
    state_path: PathBuf,
    state_dir: PathBuf,
    /// flock serializes processes; this serializes threads of this process, which share the lock file.
    lock_file: Mutex<File>,
    /// The simulated driver root (`<state dir>/driver-root`).
    driver_root: PathBuf,
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

/// Holds the node-wide lock for one operation; releases it on drop, even on panic.
struct StateLock<'a> {
    file: MutexGuard<'a, File>,
}

impl Drop for StateLock<'_> {
    fn drop(&mut self) {
        // Unlocking cannot fail on a valid descriptor; if it did, closing the file on exit releases it.
        let _ = self.file.unlock();
    }
}

impl SimulatedBackend {
    /// Opens the simulated node `node_name` described by `node_file`, keeping hardware state in `state_dir`
    /// (created if missing). Existing state for the same GPUs is kept, as hardware keeps MIG instances
    /// across a plugin restart.
    pub fn new(node_name: &str, node_file: &Path, state_dir: &Path) -> Result<Self> {
        Self::from_spec(node_name, &NodeSpec::from_file(node_file)?, state_dir)
    }

    /// Like [`SimulatedBackend::new`] with the node described in code.
    pub fn from_spec(node_name: &str, spec: &NodeSpec, state_dir: &Path) -> Result<Self> {
        spec.validate().map_err(GpuError::InvalidArgument)?;
        let gpus = build_gpus(node_name, spec)?;
        let state_err = |reason: String| GpuError::SimulatedState {
            path: state_dir.display().to_string(),
            reason,
        };
        fs::create_dir_all(state_dir)
            .map_err(|e| state_err(format!("cannot create the state directory: {e}")))?;
        let lock_path = state_dir.join(LOCK_FILE);
        let lock_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| GpuError::SimulatedState {
                path: lock_path.display().to_string(),
                reason: e.to_string(),
            })?;
        let backend = Self {
            gpus,
            state_path: state_dir.join(STATE_FILE),
            state_dir: state_dir.to_path_buf(),
            lock_file: Mutex::new(lock_file),
            driver_root: state_dir.join(DRIVER_ROOT_DIR),
            known_time_slices: Mutex::new(Default::default()),
            nvml_time: Mutex::new(NvmlTime::default()),
        };
        // Validates (or creates) the state now, so a corrupt file fails the start, not the first claim.
        backend.write(|_| Ok(()))?;
        write_driver_root(&backend.driver_root, &backend.gpus).map_err(|e| GpuError::SimulatedState {
            path: backend.driver_root.display().to_string(),
            reason: format!("cannot write the simulated driver root: {e}"),
        })?;
        Ok(backend)
    }

    /// Path of the JSON hardware state.
    pub fn state_file(&self) -> &Path {
        &self.state_path
    }

    /// This backend's simulated NVML time so far (also in [`NVML_TIME_FILE`] of the state dir).
    pub fn nvml_time(&self) -> NvmlTime {
        *self.nvml_time.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of simulated GPUs.
    pub fn gpu_count(&self) -> u32 {
        self.gpus.len() as u32
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
        // A poisoned mutex only means another thread panicked mid-operation; the file on disk is still
        // consistent (it is replaced atomically), so the lock stays usable.
        let guard = self.lock_file.lock().unwrap_or_else(|p| p.into_inner());
        guard.lock().map_err(|e| GpuError::SimulatedState {
            path: self.state_dir.join(LOCK_FILE).display().to_string(),
            reason: e.to_string(),
        })?;
        Ok(StateLock { file: guard })
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
            gpus,
        })
    }

    fn store(&self, state: &HardwareState) -> Result<()> {
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
        let out = self.load().and_then(|state| f(&state));
        self.account(started.elapsed());
        out
    }

    /// Runs one operation under the lock and persists whatever it changed, also when it fails: a failed
    /// Ampere MIG toggle still changes the pending mode.
    fn write<T>(&self, f: impl FnOnce(&mut HardwareState) -> Result<T>) -> Result<T> {
        let started = Instant::now();
        let _lock = self.lock()?;
        let out = (|| {
            let mut state = self.load()?;
            let on_disk = fs::metadata(&self.state_path).is_ok();
            let before = state.clone();
            let out = f(&mut state);
            if state != before || !on_disk {
                self.store(&state)?;
            }
            out
        })();
        self.account(started.elapsed());
        out
    }

    /// Adds one call to the simulated NVML time and publishes the totals. Called with the state lock held,
    /// so the totals file is written by one thread at a time. A failed write of it is ignored: it is a
    /// benchmark's reading, and the call it measures has already succeeded or failed on its own.
    fn account(&self, took: Duration) {
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

    fn driver_root(&self) -> &Path {
        &self.driver_root
    }

    fn discover(&self) -> Result<NodeGpus> {
        self.read(|state| {
            let (gpus, unusable) = super::discover_each(self.gpus.len() as u32, |i| {
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
        let toggles_now = self.sim_gpu(gpu)?.model.architecture.mig_toggle_without_reset();
        self.write(|state| {
            let g = gpu_state_mut(state, gpu)?;
            if g.mig_current == enabled {
                // Asking for the current mode cancels a pending change and needs no reset.
                g.mig_pending = enabled;
                return Ok(());
            }
            if !g.gpu_instances.is_empty() {
                return Err(GpuError::InUse(format!(
                    "cannot change MIG mode of GPU {gpu}: {} GPU instances exist",
                    g.gpu_instances.len()
                )));
            }
            // Like the driver: the call succeeds and records the wish; a busy GPU answers IN_USE in the
            // activation status and stays as it is, Ampere waits for a reset, Hopper and newer switch now.
            g.mig_pending = enabled;
            let status = if !g.all_processes().is_empty() {
                super::NVML_ERROR_IN_USE
            } else {
                if toggles_now {
                    g.mig_current = enabled;
                }
                0
            };
            let after = MigMode {
                current: g.mig_current,
                pending: g.mig_pending,
            };
            super::mig_mode_change_outcome(gpu, enabled, status, after)
        })
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
            g.gpu_instances.push(GiState {
                id,
                profile_id,
                placement,
                compute_instances: Vec::new(),
            });
            Ok(id)
        })
    }

    fn create_compute_instance(&self, gpu: u32, gpu_instance: u32) -> Result<ComputeInstance> {
        let sim = self.sim_gpu(gpu)?;
        self.write(|state| {
            let g = gpu_state_mut(state, gpu)?;
            g.require_mig(gpu, "create a compute instance")?;
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
            let ci = CiState {
                id,
                profile_id: prof.full_compute_instance_profile_id(),
                uuid: format!("MIG-{}", uuid::Uuid::new_v4().hyphenated()),
                processes: Vec::new(),
            };
            let out = ComputeInstance {
                id: ci.id,
                profile_id: ci.profile_id,
                uuid: ci.uuid.clone(),
            };
            gi.compute_instances.push(ci);
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

    fn usage(&self, query: &super::usage::UsageQuery<'_>) -> Result<super::usage::DeviceUsage> {
        self.sim_gpu(query.gpu)?;
        super::simulated_load::usage(&self.state_dir, query)
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

/// Libraries of the simulated driver root, with their soname suffix.
const SIMULATED_LIBRARIES: [(&str, &str); 5] = [
    ("libcuda", "1"),
    ("libnvidia-ml", "1"),
    ("libnvidia-ptxjitcompiler", "1"),
    ("libnvidia-nvvm", "4"),
    ("libnvidia-cfg", "1"),
];

/// Writes a driver root with NVIDIA's layout for the simulated GPUs: stub libraries
/// `usr/lib/x86_64-linux-gnu/<lib>.so.<driver version>` with their soname links, and `usr/bin/nvidia-smi`,
/// a script that prints the GPU list (`nvidia-smi -L` style) fixed when it is written; it reads no input and
/// ignores its arguments. A container that got tessera's CDI edits can run it to prove the mounts.
fn write_driver_root(root: &Path, gpus: &[SimGpu]) -> std::io::Result<()> {
    let lib = root.join("usr/lib/x86_64-linux-gnu");
    let bin = root.join("usr/bin");
    fs::create_dir_all(&lib)?;
    fs::create_dir_all(&bin)?;
    for (name, soname) in SIMULATED_LIBRARIES {
        let file = format!("{name}.so.{SIMULATED_DRIVER_VERSION}");
        fs::write(
            lib.join(&file),
            format!("simulated {name} {SIMULATED_DRIVER_VERSION} (not a real library)\n"),
        )?;
        let link = lib.join(format!("{name}.so.{soname}"));
        match fs::remove_file(&link) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::os::unix::fs::symlink(&file, &link)?;
    }
    let mut listing = String::new();
    for (i, g) in gpus.iter().enumerate() {
        // Product names and UUIDs come from the built-in model table and a hash: no quote can appear.
        listing.push_str(&format!("GPU {i}: {} (UUID: {})\n", g.model.product_name, g.uuid));
    }
    let script = format!(
        "#!/bin/sh\n# Simulated nvidia-smi written by tessera: prints the simulated GPUs, whatever it is asked.\n\
         cat <<'TESSERA_GPUS'\n{listing}TESSERA_GPUS\n"
    );
    let smi = bin.join("nvidia-smi");
    let tmp = bin.join(".nvidia-smi.tmp");
    fs::write(&tmp, script)?;
    fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    fs::rename(&tmp, &smi)
}

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
