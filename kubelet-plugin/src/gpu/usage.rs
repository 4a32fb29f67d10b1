//! What runs on a GPU or MIG device now, for the per-claim usage metrics ([`crate::metrics`]).
//!
//! NVML reports usage per physical GPU (`nvmlDeviceGetUtilizationRates`, `nvmlDeviceGetMemoryInfo`) and per
//! process (`nvmlDeviceGetComputeRunningProcesses`: memory; `nvmlDeviceGetProcessUtilization`: SM percent),
//! never per claim. A whole GPU or a MIG device belongs to one claim, so its usage is that claim's. A share
//! is one of several claims on a device, so its usage is the sum over the device's processes that belong to
//! it: a process belongs to the claim and device its container was given, which the plugin's CDI edits put
//! in the container's environment (`TESSERA_CLAIM`, `TESSERA_DEVICE`) and [`owner_of_pid`] reads back from
//! `/proc/<pid>/environ` (the plugin runs in the host's PID namespace, where NVML's PIDs live).

use std::path::Path;

/// The device whose usage is asked for: the physical GPU, the MIG device's GPU- and compute-instance ids,
/// and tessera's name of the device (`gpu-1`, `gpu-0-mig-3g.40gb-4`, `gpu-1-shared`), by which the
/// simulated backend keys its synthetic load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsageQuery<'a> {
    pub gpu: u32,
    pub mig: Option<(u32, u32)>,
    pub device: &'a str,
}

/// Usage of one GPU or MIG device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceUsage {
    /// Percent of the last sample period in which a kernel ran. `None` on MIG devices: NVML does not report
    /// it there ("On MIG-enabled GPUs, querying device utilization rates is not currently supported",
    /// NVML API reference, `nvmlDeviceGetUtilizationRates`).
    pub utilization_percent: Option<u32>,
    /// Framebuffer memory in use, bytes.
    pub memory_used_bytes: Option<u64>,
    /// The processes on the device.
    pub processes: Vec<ProcessUsage>,
}

/// One process on a device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessUsage {
    pub pid: u32,
    /// SM utilization of the process over the last sample period, percent of the whole device.
    pub sm_percent: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    /// Whose container runs it, when that can be told.
    pub owner: Option<ProcessOwner>,
}

/// The claim (`namespace/name`) and device a process's container was prepared with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessOwner {
    pub claim: String,
    pub device: String,
}

/// The owner recorded in a process environment (`/proc/<pid>/environ`: NUL-separated `KEY=value`).
pub fn owner_from_environ(environ: &[u8]) -> Option<ProcessOwner> {
    let mut claim = None;
    let mut device = None;
    for entry in environ.split(|b| *b == 0) {
        if let Some(v) = entry.strip_prefix(b"TESSERA_CLAIM=") {
            claim = Some(String::from_utf8_lossy(v).into_owned());
        } else if let Some(v) = entry.strip_prefix(b"TESSERA_DEVICE=") {
            device = Some(String::from_utf8_lossy(v).into_owned());
        }
    }
    Some(ProcessOwner {
        claim: claim?,
        device: device?,
    })
}

/// The owner of host process `pid`, or `None` when its environment cannot be read (gone, another PID
/// namespace, or no permission: reading another user's environ needs `CAP_SYS_PTRACE`).
pub fn owner_of_pid(proc_root: &Path, pid: u32) -> Option<ProcessOwner> {
    let environ = std::fs::read(proc_root.join(pid.to_string()).join("environ")).ok()?;
    owner_from_environ(&environ)
}

/// Parses a memory amount as Kubernetes quantities spell it: `20Gi`, `512Mi`, `1G`, `1048576`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let units: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (number, factor) = units
        .iter()
        .find_map(|(suffix, factor)| s.strip_suffix(suffix).map(|n| (n, *factor)))
        .unwrap_or((s, 1));
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{s:?} is not a memory amount like 20Gi, 512Mi or 1073741824"))?;
    n.checked_mul(factor).ok_or_else(|| format!("{s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_environment_names_its_claim_and_device() {
        let environ = b"PATH=/bin\0TESSERA_DEVICE=gpu-1-shared\0TESSERA_CLAIM=team-a/app-0-gpu\0";
        assert_eq!(
            owner_from_environ(environ),
            Some(ProcessOwner {
                claim: "team-a/app-0-gpu".into(),
                device: "gpu-1-shared".into()
            })
        );
        assert_eq!(owner_from_environ(b"TESSERA_DEVICE=gpu-1\0"), None);
    }

    #[test]
    fn memory_amounts_read_like_kubernetes_quantities() {
        assert_eq!(parse_bytes("20Gi"), Ok(20 << 30));
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("1G"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        let err = parse_bytes("20GB").unwrap_err();
        assert!(err.contains("20Gi"), "{err}");
    }
}
