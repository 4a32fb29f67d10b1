//! The simulated backend's synthetic load: what `tessera-kubelet-plugin simulate load` sets, so the
//! per-claim usage metrics can be checked against known numbers.
//!
//! Loads live in `<state dir>/simulated-load.json`, next to the simulated hardware state and like it
//! surviving a plugin restart, one entry per device (and claim, for shares). Each entry stands for one
//! process on the device: with `--claim`, one whose environment names the claim and device as a prepared
//! container's would; with `--pid`, a real process of the host (a container's), which the plugin then
//! attributes through the host's `/proc` as it does NVML's PIDs (the simulated NVML reports these too).
//! The file has a lock of its own (`state_file`): load changes must not wait behind, or block, MIG
//! operations.

use std::{fs, path::Path};

use serde::{Deserialize, Serialize};
use tessera_api::DeviceName;

use tessera_gpu_api::{
    GpuError, Result,
    usage::{DeviceUsage, ProcessOwner, ProcessUsage, UsageQuery},
};

use crate::state_file;

/// File of the synthetic load in the state directory.
pub const LOAD_FILE: &str = "simulated-load.json";
const LOCK_FILE: &str = "simulated-load.lock";
/// Synthetic processes get PIDs above Linux's `pid_max` limit (2^22), so they never name a real process.
const FIRST_SYNTHETIC_PID: u32 = 1 << 22;

/// One synthetic process: `utilization_percent` of the device and `memory_bytes` of its memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadEntry {
    /// tessera's device name, e.g. `gpu-1`, `gpu-0-mig-3g.40gb-4`, `gpu-1-shared`.
    pub device: String,
    /// `namespace/name` of the claim whose container runs it; needed for shares, where several claims
    /// use one device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    pub utilization_percent: u32,
    pub memory_bytes: u64,
    /// A real host process to stand for (a container's), instead of a synthetic PID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct LoadFile {
    loads: Vec<LoadEntry>,
}

fn state_err(path: &Path, reason: impl std::fmt::Display) -> GpuError {
    GpuError::SimulatedState {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn read(path: &Path) -> Result<LoadFile> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
            state_err(
                path,
                format!("not a synthetic load file ({e}); remove it to start without load"),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(LoadFile::default()),
        Err(e) => Err(state_err(path, e)),
    }
}

/// Sets the load of `entry.device` (and `entry.claim`), replacing what was set for the same pair.
pub fn set(state_dir: &Path, entry: LoadEntry) -> Result<()> {
    entry
        .device
        .parse::<DeviceName>()
        .map_err(|e| GpuError::InvalidArgument(format!("--device {}: {e}", entry.device)))?;
    if entry.utilization_percent > 100 {
        return Err(GpuError::InvalidArgument(format!(
            "--util {}: must be between 0 and 100 (percent of the device)",
            entry.utilization_percent
        )));
    }
    update(state_dir, |file| {
        file.loads
            .retain(|l| !(l.device == entry.device && l.claim == entry.claim && l.pid == entry.pid));
        file.loads.push(entry);
    })
}

/// Removes every load of `device`, or all loads when `None`.
pub fn clear(state_dir: &Path, device: Option<&str>) -> Result<()> {
    update(state_dir, |file| {
        file.loads.retain(|l| device.is_some_and(|d| l.device != d))
    })
}

fn update(state_dir: &Path, change: impl FnOnce(&mut LoadFile)) -> Result<()> {
    let current = || read(&state_dir.join(LOAD_FILE));
    state_file::update(state_dir, LOCK_FILE, LOAD_FILE, current, change)
}

/// Every load set, in the order they were set.
pub fn list(state_dir: &Path) -> Result<Vec<LoadEntry>> {
    let _lock = state_file::lock(state_dir, LOCK_FILE)?;
    Ok(read(&state_dir.join(LOAD_FILE))?.loads)
}

/// What NVML would report for `query` under the synthetic load: a GPU carries every load on it (its own,
/// its shares', its MIG devices'), capped at 100 %; a MIG device only its own, and, as on NVML, no
/// utilization.
pub fn usage(state_dir: &Path, query: &UsageQuery<'_>) -> Result<DeviceUsage> {
    let loads = list(state_dir)?;
    let on_device = |l: &LoadEntry| match l.device.parse::<DeviceName>() {
        Ok(name) if name.gpu() == query.gpu => query.mig.is_none() || l.device == query.device,
        _ => false,
    };
    let processes: Vec<ProcessUsage> = loads
        .iter()
        .enumerate()
        .filter(|(_, l)| on_device(l))
        .map(|(i, l)| ProcessUsage {
            pid: l.pid.unwrap_or(FIRST_SYNTHETIC_PID + i as u32),
            sm_percent: query.mig.is_none().then_some(l.utilization_percent),
            memory_used_bytes: Some(l.memory_bytes),
            owner: l.claim.as_ref().map(|claim| ProcessOwner {
                claim: claim.clone(),
                device: l.device.clone(),
            }),
        })
        .collect();
    Ok(DeviceUsage {
        utilization_percent: query.mig.is_none().then(|| {
            processes
                .iter()
                .filter_map(|p| p.sm_percent)
                .sum::<u32>()
                .min(100)
        }),
        memory_used_bytes: Some(processes.iter().filter_map(|p| p.memory_used_bytes).sum()),
        processes,
    })
}

/// `simulate load`: sets (or with `--clear` removes) a device's synthetic load.
#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// The device as the claim's allocation names it: `gpu-1`, `gpu-0-mig-3g.40gb-4`, `gpu-1-shared`.
    #[arg(long, env = "TESSERA_LOAD_DEVICE")]
    pub device: Option<String>,
    /// `namespace/name` of the claim whose processes make the load; needed for a share, whose device
    /// several claims use.
    #[arg(long, env = "TESSERA_LOAD_CLAIM")]
    pub claim: Option<String>,
    /// Utilization, percent of the device (0–100).
    #[arg(long, env = "TESSERA_LOAD_UTIL", default_value_t = 0)]
    pub util: u32,
    /// Memory in use, as a quantity (`20Gi`, `512Mi`).
    #[arg(long, env = "TESSERA_LOAD_MEMORY", default_value = "0", value_parser = tessera_gpu_api::usage::parse_bytes)]
    pub memory: u64,
    /// The host PID of the process that makes the load (a container's); the plugin finds its claim
    /// through the host's `/proc` (`--host-proc`), as for NVML's processes.
    #[arg(long, env = "TESSERA_LOAD_PID")]
    pub pid: Option<u32>,
    /// Remove the loads of `--device` (of every device without it) instead of setting one.
    #[arg(long)]
    pub clear: bool,
}

impl LoadArgs {
    /// Applies the command to the state directory, then prints every load in effect as JSON.
    pub fn run(self, state_dir: &Path) -> Result<()> {
        let Self {
            device,
            claim,
            util,
            memory,
            pid,
            clear: remove,
        } = self;
        if remove {
            clear(state_dir, device.as_deref())?;
        } else {
            let device = device.ok_or_else(|| {
                GpuError::InvalidArgument("--device is required to set a load (e.g. --device gpu-1)".into())
            })?;
            set(
                state_dir,
                LoadEntry {
                    device,
                    claim,
                    utilization_percent: util,
                    memory_bytes: memory,
                    pid,
                },
            )?;
        }
        let loads = list(state_dir)?;
        println!("{}", serde_json::to_string_pretty(&loads).unwrap_or_default());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(device: &str, claim: Option<&str>, util: u32, gib: u64) -> LoadEntry {
        LoadEntry {
            device: device.into(),
            claim: claim.map(Into::into),
            utilization_percent: util,
            memory_bytes: gib << 30,
            pid: None,
        }
    }

    #[test]
    fn a_gpu_reports_the_sum_of_its_loads_and_a_mig_device_only_its_own_memory() {
        let dir = tempfile::tempdir().unwrap();
        set(dir.path(), load("gpu-1-shared", Some("a/c0"), 30, 4)).unwrap();
        set(dir.path(), load("gpu-1-shared", Some("a/c1"), 50, 8)).unwrap();
        set(dir.path(), load("gpu-1-shared", Some("a/c1"), 45, 6)).unwrap();
        set(dir.path(), load("gpu-0-mig-3g.40gb-4", None, 70, 10)).unwrap();

        let gpu1 = usage(
            dir.path(),
            &UsageQuery {
                gpu: 1,
                mig: None,
                device: "gpu-1-shared",
            },
        )
        .unwrap();
        assert_eq!(gpu1.utilization_percent, Some(75));
        assert_eq!(gpu1.memory_used_bytes, Some(10 << 30));
        assert_eq!(
            gpu1.processes.len(),
            2,
            "setting a claim's load again replaces it"
        );
        assert_eq!(gpu1.processes[1].owner.as_ref().unwrap().claim, "a/c1");

        let mig = usage(
            dir.path(),
            &UsageQuery {
                gpu: 0,
                mig: Some((2, 0)),
                device: "gpu-0-mig-3g.40gb-4",
            },
        )
        .unwrap();
        assert_eq!(mig.utilization_percent, None);
        assert_eq!(mig.memory_used_bytes, Some(10 << 30));

        clear(dir.path(), Some("gpu-1-shared")).unwrap();
        assert_eq!(list(dir.path()).unwrap().len(), 1);
        clear(dir.path(), None).unwrap();
        assert!(list(dir.path()).unwrap().is_empty());
    }

    #[test]
    fn a_load_of_a_real_process_reports_that_pid_and_names_no_owner() {
        let dir = tempfile::tempdir().unwrap();
        let entry = LoadEntry {
            pid: Some(4242),
            ..load("gpu-1-shared", None, 40, 1)
        };
        set(dir.path(), entry).unwrap();
        let u = usage(
            dir.path(),
            &UsageQuery {
                gpu: 1,
                mig: None,
                device: "gpu-1-shared",
            },
        )
        .unwrap();
        assert_eq!(u.processes.len(), 1);
        assert_eq!(u.processes[0].pid, 4242);
        assert_eq!(u.processes[0].owner, None, "the plugin finds it through /proc");
        assert_eq!(u.utilization_percent, Some(40));
    }

    #[test]
    fn a_load_on_an_unknown_device_or_above_100_percent_is_refused_naming_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let err = set(dir.path(), load("gpu-x", None, 10, 1)).unwrap_err();
        assert!(err.to_string().contains("--device gpu-x"), "{err}");
        let err = set(dir.path(), load("gpu-1", None, 150, 1)).unwrap_err();
        assert!(err.to_string().contains("--util 150"), "{err}");
    }
}
