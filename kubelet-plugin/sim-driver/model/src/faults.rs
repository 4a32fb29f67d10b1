//! Faults of simulated GPUs: what NVML's events and probe would report about sick hardware.
//!
//! Kept in `<state dir>/simulated-health.json` next to the simulated hardware state, written the same way
//! (under an exclusive `flock` of `simulated-health.lock`, temp file, fsync, rename), so an injected fault
//! survives a plugin restart as a broken GPU would, and an injection from another process (the
//! `simulate` subcommand, a test) never tears the file. A file of its own rather than a field of
//! `simulated-gpus.json`: faults are not NVML state the backend's calls change, and the running plugin
//! polls this file every second without taking the hardware lock its prepares need.
//!
//! ```json
//! {"version": 1, "faults": [{"gpu": 3, "kind": "Xid", "xid": 79}, {"gpu": 5, "kind": "Lost"}]}
//! ```

use std::{
    fs,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use tessera_gpu_api::{GpuError, Result};

use crate::state_file;

/// The fault file in the state directory.
pub const HEALTH_FILE: &str = "simulated-health.json";
const LOCK_FILE: &str = "simulated-health.lock";
const VERSION: u32 = 1;

/// What went wrong with a simulated GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FaultKind {
    /// An `nvmlEventTypeXidCriticalError` event carrying `xid`.
    Xid,
    /// An `nvmlEventTypeDoubleBitEccError` event.
    DoubleBitEcc,
    /// `NVML_ERROR_GPU_IS_LOST` from the event wait and every probe.
    Lost,
    /// `NVML_ERROR_LIB_RM_VERSION_MISMATCH` (18) from every call on the GPU: the user-space library and the
    /// kernel module are of different driver versions, as after a driver upgrade without a reboot.
    LibraryMismatch,
    /// `NVML_ERROR_DRIVER_NOT_LOADED` (9) from every call on the GPU.
    DriverNotLoaded,
    /// `NVML_ERROR_UNINITIALIZED` (1) from every call on the GPU.
    Uninitialized,
    /// The GPU's NVLink fabric runs at reduced bandwidth (NVLinks or NVSwitch trunks down): a completed
    /// fabric whose `nvmlDeviceGetGpuFabricInfoV` answers health summary LIMITED_CAPACITY and health mask
    /// DEGRADED_BW_TRUE (nvml.h 3824-3829, 3893 of NVIDIA/go-nvml `gen/nvml/nvml.h`).
    FabricDegraded,
    /// The GPU's NVLink fabric is unhealthy (fabric manager died, a route is down): health summary
    /// UNHEALTHY and mask ROUTE_UNHEALTHY_TRUE (nvml.h 3844-3849, 3892).
    FabricUnhealthy,
}

impl FaultKind {
    /// The NVML return code every call on a GPU with this fault answers, or `None` for faults that are
    /// events (an XID, an ECC error) and leave the GPU answering.
    pub fn nvml_error_code(self) -> Option<u32> {
        match self {
            Self::Xid | Self::DoubleBitEcc | Self::FabricDegraded | Self::FabricUnhealthy => None,
            Self::Lost => Some(15),
            Self::LibraryMismatch => Some(18),
            Self::DriverNotLoaded => Some(9),
            Self::Uninitialized => Some(1),
        }
    }
}

/// One injected fault.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Fault {
    pub gpu: u32,
    /// The GPU instance an event is attributed to (a MIG device's), as NVML's `gpuInstanceId`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_instance: Option<u32>,
    pub kind: FaultKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xid: Option<u32>,
}

impl Fault {
    /// XID `xid` on the whole GPU `gpu`.
    pub fn xid(gpu: u32, xid: u32) -> Self {
        Self {
            gpu,
            gpu_instance: None,
            kind: FaultKind::Xid,
            xid: Some(xid),
        }
    }

    /// GPU `gpu` fell off the bus.
    pub fn lost(gpu: u32) -> Self {
        Self {
            gpu,
            gpu_instance: None,
            kind: FaultKind::Lost,
            xid: None,
        }
    }

    /// GPU `gpu` has the fault `kind` on the whole GPU: for the error kinds, it answers every call with
    /// the error (see [`FaultKind::nvml_error_code`]); for the fabric kinds, its fabric reports that health.
    pub fn failing(gpu: u32, kind: FaultKind) -> Self {
        Self {
            gpu,
            gpu_instance: None,
            kind,
            xid: None,
        }
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultFile {
    version: u32,
    #[serde(default)]
    faults: Vec<Fault>,
}

/// The fault file of one simulated node.
#[derive(Clone, Debug)]
pub struct SimulatedHealth {
    dir: PathBuf,
    gpu_count: u32,
}

impl SimulatedHealth {
    /// The faults of a node with `gpu_count` GPUs whose state lives in `state_dir`.
    pub fn new(state_dir: &Path, gpu_count: u32) -> Self {
        Self {
            dir: state_dir.to_path_buf(),
            gpu_count,
        }
    }

    /// Path of the fault file.
    pub fn file(&self) -> PathBuf {
        self.dir.join(HEALTH_FILE)
    }

    fn err(&self, reason: String) -> GpuError {
        GpuError::SimulatedState {
            path: self.file().display().to_string(),
            reason,
        }
    }

    /// Every fault in effect (none when the file does not exist).
    pub fn faults(&self) -> Result<Vec<Fault>> {
        match fs::read(self.file()) {
            Ok(bytes) => {
                let file: FaultFile = serde_json::from_slice(&bytes).map_err(|e| {
                    self.err(format!(
                        "the file is corrupt ({e}); delete it to make every simulated GPU healthy"
                    ))
                })?;
                if file.version != VERSION {
                    return Err(self.err(format!(
                        "version {} is not the supported version {VERSION}; delete the file",
                        file.version
                    )));
                }
                Ok(file.faults)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(vec![]),
            Err(e) => Err(self.err(e.to_string())),
        }
    }

    fn check_gpu(&self, gpu: u32) -> Result<()> {
        if gpu < self.gpu_count {
            Ok(())
        } else {
            Err(GpuError::NotFound(format!(
                "GPU {gpu}: the simulated node has GPUs 0 to {}",
                self.gpu_count.saturating_sub(1)
            )))
        }
    }

    /// Adds a fault (a second identical one is not added twice).
    pub fn inject(&self, fault: Fault) -> Result<()> {
        self.check_gpu(fault.gpu)?;
        if fault.kind == FaultKind::Xid && fault.xid.is_none() {
            return Err(GpuError::InvalidArgument(
                "an XID fault needs its XID number (--xid)".into(),
            ));
        }
        self.update(|faults| {
            if !faults.contains(&fault) {
                faults.push(fault);
            }
        })
    }

    /// Clears every fault of `gpu`: the GPU was reset and works again.
    pub fn recover(&self, gpu: u32) -> Result<()> {
        self.check_gpu(gpu)?;
        self.update(|faults| faults.retain(|f| f.gpu != gpu))
    }

    fn update(&self, change: impl FnOnce(&mut Vec<Fault>)) -> Result<()> {
        let read = || {
            Ok(FaultFile {
                version: VERSION,
                faults: self.faults()?,
            })
        };
        state_file::update(&self.dir, LOCK_FILE, HEALTH_FILE, read, |file| {
            change(&mut file.faults)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn injected_faults_persist_until_the_gpu_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let h = SimulatedHealth::new(dir.path(), 4);
        assert!(h.faults().unwrap().is_empty());
        h.inject(Fault::xid(3, 79)).unwrap();
        h.inject(Fault::xid(3, 79)).unwrap();
        h.inject(Fault::lost(1)).unwrap();
        let reopened = SimulatedHealth::new(dir.path(), 4);
        assert_eq!(reopened.faults().unwrap().len(), 2);
        reopened.recover(3).unwrap();
        assert_eq!(h.faults().unwrap().iter().map(|f| f.gpu).collect::<Vec<_>>(), [1]);
    }

    #[test]
    fn a_gpu_the_node_lacks_and_an_xid_without_number_are_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let h = SimulatedHealth::new(dir.path(), 2);
        let e = h.inject(Fault::xid(7, 79)).unwrap_err().to_string();
        assert!(e.contains("GPUs 0 to 1"), "{e}");
        let mut no_number = Fault::xid(0, 0);
        no_number.xid = None;
        assert!(h.inject(no_number).unwrap_err().to_string().contains("--xid"));
        fs::write(h.file(), "{").unwrap();
        assert!(h.faults().unwrap_err().to_string().contains("delete it"));
    }
}
