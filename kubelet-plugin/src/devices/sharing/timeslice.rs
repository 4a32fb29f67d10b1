//! Time-slicing: shares of a GPU run side by side under the driver's time-slice scheduler. Nothing is
//! isolated; the only setting is the compute time-slice (`nvidia-smi compute-policy --set-timeslice`), applied
//! when the first time-sliced share of a GPU arrives and reset to `Default` when the last one leaves.
//!
//! The interval of the first share stays while it runs: a later share asking for another interval gets the
//! current one (and a warning in the log), because changing it would change the running shares' behaviour.
//! MIG devices have no time-slice setting; their shares simply share the instance.
//!
//! NVML cannot read the time-slice back, so what the plugin set is recorded in
//! `<state dir>/time-slices.json` ([`TimeSliceRecord`]), which survives a restart. The first share always
//! sets its interval and the last one always resets to `Default`, without trusting any cached value: after
//! a crash or a manual change the GPU may hold anything, `Default` included as a wish to be written.

use std::{
    collections::BTreeMap,
    fs,
    io::Write,
    path::{Path, PathBuf},
    sync::Mutex,
};

use tessera_api::{GpuInfo, config::TimeSliceInterval};
use tracing::{info, warn};

use crate::gpu::{ComputeMode, GpuBackend, GpuError, TimeSlice};

/// A failed time-slice change.
#[derive(Debug, thiserror::Error)]
pub enum TimeSliceError {
    /// Reading the GPU's compute settings failed.
    #[error("failed to read the time-slice of GPU {gpu}: {source}")]
    Read { gpu: u32, source: GpuError },
    /// Setting the time-slice failed.
    #[error("failed to set the time-slice of GPU {gpu} to {slice:?}: {source}")]
    Set {
        gpu: u32,
        slice: TimeSlice,
        source: GpuError,
    },
    /// The GPU is in a compute mode that admits one process only (an MPS daemon or an admin holds it).
    #[error("failed to time-slice GPU {gpu}: its compute mode is {mode:?}, which admits a single process")]
    ExclusiveMode { gpu: u32, mode: ComputeMode },
    /// The record of set time-slices could not be read or written.
    #[error(
        "failed to access the time-slice record {path}: {reason}; if the file is corrupt, delete it (the next \
         share sets the time-slice again)"
    )]
    Record { path: PathBuf, reason: String },
}

/// What the plugin set as each GPU's time-slice, by GPU UUID, kept in the state directory.
#[derive(Debug)]
pub struct TimeSliceRecord {
    path: PathBuf,
    lock: Mutex<()>,
}

impl TimeSliceRecord {
    pub fn new(state_dir: &Path) -> Self {
        Self {
            path: state_dir.join("time-slices.json"),
            lock: Mutex::new(()),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, reason: impl ToString) -> TimeSliceError {
        TimeSliceError::Record {
            path: self.path.clone(),
            reason: reason.to_string(),
        }
    }

    fn load(&self) -> Result<BTreeMap<String, TimeSlice>, TimeSliceError> {
        match fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| self.err(e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeMap::new()),
            Err(e) => Err(self.err(e)),
        }
    }

    fn store(&self, map: &BTreeMap<String, TimeSlice>) -> Result<(), TimeSliceError> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let tmp = dir.join(".time-slices.json.tmp");
        let write = || -> std::io::Result<()> {
            fs::create_dir_all(dir)?;
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&serde_json::to_vec_pretty(map).map_err(std::io::Error::other)?)?;
            f.sync_all()?;
            fs::rename(&tmp, &self.path)?;
            fs::File::open(dir)?.sync_all()
        };
        write().map_err(|e| self.err(e))
    }

    /// The time-slice recorded for the GPU, if the plugin set one that is not yet reset.
    pub fn get(&self, uuid: &str) -> Result<Option<TimeSlice>, TimeSliceError> {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        Ok(self.load()?.get(uuid).copied())
    }

    fn update(&self, change: impl FnOnce(&mut BTreeMap<String, TimeSlice>)) -> Result<(), TimeSliceError> {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut map = self.load()?;
        change(&mut map);
        self.store(&map)
    }
}

/// The backend's value for an API interval.
pub fn to_time_slice(interval: TimeSliceInterval) -> TimeSlice {
    match interval {
        TimeSliceInterval::Default => TimeSlice::Default,
        TimeSliceInterval::Short => TimeSlice::Short,
        TimeSliceInterval::Medium => TimeSlice::Medium,
        TimeSliceInterval::Long => TimeSlice::Long,
    }
}

/// Called for each time-sliced share of a whole GPU; `first` says whether no other share holds the GPU.
/// Returns the interval the share runs with.
pub fn acquire(
    backend: &dyn GpuBackend,
    record: &TimeSliceRecord,
    gpu: &GpuInfo,
    interval: TimeSliceInterval,
    first: bool,
) -> Result<TimeSlice, TimeSliceError> {
    let index = gpu.index;
    let want = to_time_slice(interval);
    let mode = backend
        .compute_mode(index)
        .map_err(|source| TimeSliceError::Read { gpu: index, source })?;
    if mode != ComputeMode::Default {
        return Err(TimeSliceError::ExclusiveMode { gpu: index, mode });
    }
    if !first {
        let current = record.get(&gpu.uuid)?.unwrap_or(want);
        if current != want {
            warn!(gpu = index, current = ?current, requested = ?want, "GPU already time-sliced by other shares; keeping its interval");
        }
        return Ok(current);
    }
    // Recorded before the change: a crash in between leaves a record the last release resets.
    record.update(|m| {
        m.insert(gpu.uuid.clone(), want);
    })?;
    backend
        .set_time_slice(index, want)
        .map_err(|source| TimeSliceError::Set {
            gpu: index,
            slice: want,
            source,
        })?;
    info!(gpu = index, slice = ?want, "set compute time-slice");
    Ok(want)
}

/// Called when the last time-sliced share of a whole GPU leaves: resets the time-slice to `Default`
/// whatever the GPU is believed to hold, then drops the record.
pub fn release(
    backend: &dyn GpuBackend,
    record: &TimeSliceRecord,
    gpu: &GpuInfo,
) -> Result<(), TimeSliceError> {
    let index = gpu.index;
    backend
        .set_time_slice(index, TimeSlice::Default)
        .map_err(|source| TimeSliceError::Set {
            gpu: index,
            slice: TimeSlice::Default,
            source,
        })?;
    record.update(|m| {
        m.remove(&gpu.uuid);
    })?;
    info!(gpu = index, "reset compute time-slice to Default");
    Ok(())
}
