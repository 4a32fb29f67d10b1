//! Time-slicing: shares of a GPU run side by side under the driver's time-slice scheduler. Nothing is
//! isolated; the only setting is the compute time-slice (`nvidia-smi compute-policy --set-timeslice`), applied
//! when the first time-sliced share of a GPU arrives and reset to `Default` when the last one leaves.
//!
//! The interval of the first share stays while it runs: a later share asking for another interval gets the
//! current one (and a warning in the log), because changing it would change the running shares' behaviour.
//! MIG devices have no time-slice setting; their shares simply share the instance.

use tessera_api::config::TimeSliceInterval;
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
    gpu: u32,
    interval: TimeSliceInterval,
    first: bool,
) -> Result<TimeSlice, TimeSliceError> {
    let want = to_time_slice(interval);
    let mode = backend
        .compute_mode(gpu)
        .map_err(|source| TimeSliceError::Read { gpu, source })?;
    if mode != ComputeMode::Default {
        return Err(TimeSliceError::ExclusiveMode { gpu, mode });
    }
    let current = backend
        .time_slice(gpu)
        .map_err(|source| TimeSliceError::Read { gpu, source })?;
    if !first {
        if current != want {
            warn!(gpu, current = ?current, requested = ?want, "GPU already time-sliced by other shares; keeping its interval");
        }
        return Ok(current);
    }
    if current != want {
        backend
            .set_time_slice(gpu, want)
            .map_err(|source| TimeSliceError::Set {
                gpu,
                slice: want,
                source,
            })?;
        info!(gpu, slice = ?want, "set compute time-slice");
    }
    Ok(want)
}

/// Called when a time-sliced share leaves; `last` says whether it was the last one. Resets the GPU's
/// time-slice to `Default` after the last share.
pub fn release(backend: &dyn GpuBackend, gpu: u32, last: bool) -> Result<(), TimeSliceError> {
    if !last {
        return Ok(());
    }
    let current = backend
        .time_slice(gpu)
        .map_err(|source| TimeSliceError::Read { gpu, source })?;
    if current != TimeSlice::Default {
        backend
            .set_time_slice(gpu, TimeSlice::Default)
            .map_err(|source| TimeSliceError::Set {
                gpu,
                slice: TimeSlice::Default,
                source,
            })?;
        info!(gpu, "reset compute time-slice to Default");
    }
    Ok(())
}
