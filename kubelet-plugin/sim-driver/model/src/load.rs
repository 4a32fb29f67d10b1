//! The simulated backend's synthetic load: what `tessera-kubelet-plugin simulate load` sets, so the
//! per-claim usage metrics can be checked against known numbers.
//!
//! Loads live in `<state dir>/simulated-load.json`, next to the simulated hardware state and like it
//! surviving a plugin restart, one entry per device (and claim, for shares). Each entry stands for one
//! process on the device: with `--claim`, one whose environment names the claim and device as a prepared
//! container's would; with `--pid`, a real process of the host (a container's), which the plugin then
//! attributes through the host's `/proc` as it does NVML's PIDs (the simulated NVML reports these too).
//! With `--mps-client` the process is an MPS client, which the simulated NVML lists as a real driver does
//! ([`nvml_lists`]): in the MPS list only, with its MPS server in the compute list.
//! The file has a lock of its own (`state_file`): load changes must not wait behind, or block, MIG
//! operations.

use std::path::Path;

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

/// Synthetic MPS servers (see [`nvml_lists`]) get PIDs from here on, above the synthetic processes'.
const FIRST_SYNTHETIC_MPS_SERVER_PID: u32 = FIRST_SYNTHETIC_PID + (1 << 21);
/// Past the last synthetic MPS server PID.
const END_SYNTHETIC_MPS_SERVER_PID: u32 = FIRST_SYNTHETIC_PID + (1 << 22);
/// What `nvmlSystemGetProcessName` names an MPS server.
pub const MPS_SERVER_NAME: &str = "nvidia-cuda-mps-server";

/// One synthetic process: `utilization_percent` of the device and `memory_bytes` of its memory.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// The process is an MPS client: its work reaches the GPU through its device's MPS server, so NVML lists
    /// it only in `nvmlDeviceGetMPSComputeRunningProcesses_v3` and the server in the compute list.
    #[serde(default, skip_serializing_if = "is_false")]
    pub mps_client: bool,
    /// The host PID of the MPS server an MPS client is attached to (a real process standing for it: the
    /// MPS supervisor's); without one the device's server is a synthetic process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_server_pid: Option<u32>,
    /// An MPS client's active thread percentage (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, as its container's
    /// environment has it); absent, the whole GPU. Only what [`crate::contention`] weighs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_thread_percentage: Option<u32>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct LoadFile {
    loads: Vec<LoadEntry>,
}

fn read(path: &Path) -> Result<LoadFile> {
    state_file::read_or_default(path, |e| {
        format!("not a synthetic load file ({e}); remove it to start without load")
    })
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
    if let (Some(server), false) = (entry.mps_server_pid, entry.mps_client) {
        return Err(GpuError::InvalidArgument(format!(
            "--mps-server-pid {server}: only an MPS client has a server; add --mps-client"
        )));
    }
    if let Some(limit) = entry.active_thread_percentage {
        if !entry.mps_client {
            return Err(GpuError::InvalidArgument(format!(
                "--active-thread-percentage {limit}: only an MPS client has one; add --mps-client"
            )));
        }
        if !(1..=100).contains(&limit) {
            return Err(GpuError::InvalidArgument(format!(
                "--active-thread-percentage {limit}: must be between 1 and 100"
            )));
        }
        // NVIDIA's MPS documentation (gpu-sharing-performance.md §3.1): a client's kernels run on at most its
        // active thread percentage of the SMs, so it cannot keep more of the GPU busy.
        if entry.utilization_percent > limit {
            return Err(GpuError::InvalidArgument(format!(
                "--util {}: above the client's --active-thread-percentage {limit}; an MPS client never keeps \
                 more of the GPU busy than its limit",
                entry.utilization_percent
            )));
        }
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

/// Every load set, read without the lock: for readers that cannot take it (a container's libraries see
/// the kernel directory read-only). The writer replaces the file whole (`state_file::update`), so a
/// reader sees one version or the next, never a mix.
pub fn snapshot(state_dir: &Path) -> Result<Vec<LoadEntry>> {
    Ok(read(&state_dir.join(LOAD_FILE))?.loads)
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

/// One process as NVML's process lists show it (`nvmlProcessInfo_t`'s `pid` and `usedGpuMemory`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListedProcess {
    pub pid: u32,
    pub memory_bytes: u64,
}

/// The two process lists of a GPU under its synthetic load, as a real driver fills them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NvmlLists {
    /// `nvmlDeviceGetComputeRunningProcesses_v3`: the processes with a context of their own, and one MPS
    /// server per device (or per `--mps-server-pid`) with MPS clients.
    pub compute: Vec<ListedProcess>,
    /// `nvmlDeviceGetMPSComputeRunningProcesses_v3`: the MPS clients.
    pub mps: Vec<ListedProcess>,
}

/// What NVML's process lists show of the synthetic load on GPU `gpu` (loads of its MIG devices included,
/// without instance ids, as [`usage`] reports them to the GPU).
///
/// nvml.h (`nvmlDeviceGetMPSComputeRunningProcesses_v3`, lines 7447-7488 of the header go-nvml vendors)
/// lists there the compute processes "utilizing MPS"; `nvmlDeviceGetComputeRunningProcesses_v3` (lines
/// 7361-7401) the processes with a compute context. An MPS client has none of its own: "the MPS server
/// creates the shared GPU context, manages its clients, and issues work to the GPU on behalf of its
/// clients" (`nvidia-cuda-mps-control(1)`). So an MPS client is listed only in the MPS list, and while it
/// runs its server is in the compute list: the process `--mps-server-pid` names, else a synthetic one per
/// device ([`is_synthetic_mps_server`]), named `nvidia-cuda-mps-server`. A server starts with its first
/// client and leaves with its last, as MPS's do. Its `usedGpuMemory` is the sum of its clients' (the
/// simulator's choice, the worst case for a reader that charged the server as well: nvml.h does not say
/// what a server reports).
pub fn nvml_lists(state_dir: &Path, gpu: u32) -> Result<NvmlLists> {
    let loads = list(state_dir)?;
    let mut lists = NvmlLists::default();
    // Servers in the order of their first client: (device, server pid), memory.
    let mut servers: Vec<((String, Option<u32>), ListedProcess)> = Vec::new();
    for (i, l) in loads.iter().enumerate() {
        match l.device.parse::<DeviceName>() {
            Ok(name) if name.gpu() == gpu => {}
            _ => continue,
        }
        let process = ListedProcess {
            pid: l.pid.unwrap_or(FIRST_SYNTHETIC_PID + i as u32),
            memory_bytes: l.memory_bytes,
        };
        if !l.mps_client {
            lists.compute.push(process);
            continue;
        }
        lists.mps.push(process);
        // Clients naming a server share it, whatever their device; the others share their device's.
        let key = match l.mps_server_pid {
            Some(pid) => (String::new(), Some(pid)),
            None => (l.device.clone(), None),
        };
        match servers.iter_mut().find(|(k, _)| *k == key) {
            Some((_, server)) => server.memory_bytes += l.memory_bytes,
            None => {
                let pid = key.1.unwrap_or(FIRST_SYNTHETIC_MPS_SERVER_PID + i as u32);
                servers.push((
                    key,
                    ListedProcess {
                        pid,
                        memory_bytes: l.memory_bytes,
                    },
                ));
            }
        }
    }
    lists
        .compute
        .extend(servers.into_iter().map(|(_, server)| server));
    Ok(lists)
}

/// True for the PID [`nvml_lists`] gives a synthetic MPS server.
pub fn is_synthetic_mps_server(pid: u32) -> bool {
    (FIRST_SYNTHETIC_MPS_SERVER_PID..END_SYNTHETIC_MPS_SERVER_PID).contains(&pid)
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
    /// The process is an MPS client (a share's under the MPS strategy): NVML lists it only in
    /// `nvmlDeviceGetMPSComputeRunningProcesses_v3`, and its MPS server in the compute list.
    #[arg(long, env = "TESSERA_LOAD_MPS_CLIENT")]
    pub mps_client: bool,
    /// The host PID of the MPS server the client is attached to (with `--mps-client`); without it the
    /// simulated driver lists a synthetic `nvidia-cuda-mps-server` of the device.
    #[arg(long, env = "TESSERA_LOAD_MPS_SERVER_PID")]
    pub mps_server_pid: Option<u32>,
    /// The MPS client's active thread percentage (with `--mps-client`; its container's
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`): `--util` may not exceed it, and busy clients of one GPU share
    /// its SMs by it (what a CUDA context's `tesseraSimCtxGetSmShare` reports).
    #[arg(long, env = "TESSERA_LOAD_ACTIVE_THREAD_PERCENTAGE")]
    pub active_thread_percentage: Option<u32>,
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
            mps_client,
            mps_server_pid,
            active_thread_percentage,
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
                    mps_client,
                    mps_server_pid,
                    active_thread_percentage,
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
            ..LoadEntry::default()
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
    fn an_mps_client_is_only_in_the_mps_list_and_its_server_in_the_compute_list() {
        let dir = tempfile::tempdir().unwrap();
        let client = |pid: u32, gib: u64| LoadEntry {
            pid: Some(pid),
            mps_client: true,
            ..load("gpu-1-shared", None, 20, gib)
        };
        set(
            dir.path(),
            LoadEntry {
                pid: Some(7),
                ..load("gpu-1", None, 10, 1)
            },
        )
        .unwrap();
        set(dir.path(), client(4001, 3)).unwrap();
        set(dir.path(), client(4002, 1)).unwrap();
        let mut own_server = client(4003, 2);
        own_server.mps_server_pid = Some(900);
        set(dir.path(), own_server).unwrap();

        let lists = nvml_lists(dir.path(), 1).unwrap();
        let pids = |l: &[ListedProcess]| l.iter().map(|p| p.pid).collect::<Vec<_>>();
        assert_eq!(pids(&lists.mps), [4001, 4002, 4003]);
        let compute = pids(&lists.compute);
        assert_eq!(compute.len(), 3, "{compute:?}");
        assert_eq!(compute[0], 7, "a process with a context of its own");
        assert!(is_synthetic_mps_server(compute[1]), "{compute:?}");
        assert_eq!(
            lists.compute[1].memory_bytes,
            4 << 30,
            "the device's server: its clients' memory"
        );
        assert_eq!(
            lists.compute[2],
            ListedProcess {
                pid: 900,
                memory_bytes: 2 << 30
            }
        );
        assert!(!is_synthetic_mps_server(7) && !is_synthetic_mps_server(FIRST_SYNTHETIC_PID));

        assert_eq!(nvml_lists(dir.path(), 0).unwrap(), NvmlLists::default());
        clear(dir.path(), Some("gpu-1-shared")).unwrap();
        let lists = nvml_lists(dir.path(), 1).unwrap();
        assert_eq!(
            (pids(&lists.compute), lists.mps.len()),
            (vec![7], 0),
            "the server leaves with its last client"
        );
    }

    #[test]
    fn an_mps_client_busier_than_its_active_thread_percentage_is_refused_naming_both_flags() {
        let dir = tempfile::tempdir().unwrap();
        let client = |util: u32, limit: u32, mps_client: bool| LoadEntry {
            mps_client,
            active_thread_percentage: Some(limit),
            ..load("gpu-1-shared", Some("a/c0"), util, 1)
        };
        let err = set(dir.path(), client(90, 80, true)).unwrap_err().to_string();
        assert!(
            err.contains("--util 90") && err.contains("--active-thread-percentage 80"),
            "{err}"
        );
        let err = set(dir.path(), client(10, 80, false)).unwrap_err().to_string();
        assert!(err.contains("--mps-client"), "{err}");
        let err = set(dir.path(), client(0, 0, true)).unwrap_err().to_string();
        assert!(err.contains("between 1 and 100"), "{err}");
        set(dir.path(), client(80, 80, true)).unwrap();
        assert_eq!(snapshot(dir.path()).unwrap(), list(dir.path()).unwrap());
    }

    #[test]
    fn a_server_pid_without_mps_client_is_refused_naming_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let entry = LoadEntry {
            mps_server_pid: Some(900),
            ..load("gpu-1-shared", None, 10, 1)
        };
        let err = set(dir.path(), entry).unwrap_err().to_string();
        assert!(
            err.contains("--mps-server-pid 900") && err.contains("--mps-client"),
            "{err}"
        );
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
