//! What runs on a GPU or MIG device now, for the per-claim usage metrics (the plugin's `metrics::prometheus`).
//!
//! NVML reports usage per physical GPU (`nvmlDeviceGetUtilizationRates`, `nvmlDeviceGetMemoryInfo`) and per
//! process (`nvmlDeviceGetComputeRunningProcesses`, and `nvmlDeviceGetMPSComputeRunningProcesses` for MPS
//! clients, which the compute list leaves out for their server: memory; `nvmlDeviceGetProcessUtilization`:
//! SM percent), never per claim. A whole GPU or a MIG device belongs to one claim, so its usage is that claim's. A share
//! is one of several claims on a device, so its usage is the sum over the device's processes that belong to
//! it: a process belongs to the claim and device its container was given.
//!
//! NVML's PIDs are the host's (the driver knows no PID namespaces), so they are looked up in the host's
//! `/proc` ([`HostProc`]: `--host-proc`, the chart mounts it read-only at `/host/proc`; no `hostPID`):
//!
//! ```text
//!  NVML pid ─▶ <host proc>/<pid>/environ: TESSERA_CLAIM, TESSERA_DEVICE (the claim's CDI edits)  ─▶ owner
//!     │          readable only with CAP_SYS_PTRACE (or the same credentials), so usually not in a pod
//!     └────▶ <host proc>/<pid>/cgroup (world-readable): the kubepods cgroup names the pod's UID
//!              ─▶ the claim reserved for that pod that holds the device (metrics.rs)            ─▶ owner
//! ```
//!
//! Both cgroup drivers and both cgroup versions name the pod: cgroupfs `/kubepods/burstable/pod<uid>/<ctr>`
//! (`/kubepods/pod<uid>` for Guaranteed pods), systemd
//! `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid, - as _>.slice/cri-containerd-<id>.scope`,
//! on a v1 line per controller (`4:memory:/…`) or the one v2 line (`0::/…`).

use std::path::{Path, PathBuf};

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

/// The UID of the pod whose container a process runs in, from its `/proc/<pid>/cgroup` (see the module
/// docs for the path forms); `None` for a process outside kubelet's `kubepods` hierarchy.
pub fn pod_uid_from_cgroup(cgroup: &str) -> Option<String> {
    cgroup.lines().find_map(|line| {
        // `hierarchy-id:controllers:path`; the path may itself hold colons.
        let path = line.splitn(3, ':').nth(2)?;
        pod_uid_in_path(path)
    })
}

fn pod_uid_in_path(path: &str) -> Option<String> {
    let mut under_kubepods = false;
    for segment in path.split('/') {
        // systemd driver: `kubepods-pod<uid>.slice`, `kubepods-<qos>-pod<uid>.slice`, the UID's dashes as `_`.
        if let Some(slice) = segment.strip_suffix(".slice")
            && slice.starts_with("kubepods")
            && let Some((_, uid)) = slice.rsplit_once("-pod")
        {
            return valid_uid(&uid.replace('_', "-"));
        }
        // cgroupfs driver: `…/kubepods[/<qos>]/pod<uid>/…`, possibly below a `cgroupRoot` of kubelet's own.
        if under_kubepods && let Some(uid) = segment.strip_prefix("pod") {
            return valid_uid(uid);
        }
        under_kubepods |= segment == "kubepods" || segment == "kubepods.slice";
    }
    None
}

/// A pod UID as the API server makes them (a UUID) or as kubelet names a static pod (a hex hash).
fn valid_uid(uid: &str) -> Option<String> {
    let ok = !uid.is_empty() && uid.len() <= 64 && uid.chars().all(|c| c.is_ascii_hexdigit() || c == '-');
    ok.then(|| uid.to_ascii_lowercase())
}

/// What the host's `/proc` tells about a process: the owner its environment names, and its pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessIdentity {
    pub owner: Option<ProcessOwner>,
    pub pod_uid: Option<String>,
}

/// The host's `/proc`, where NVML's PIDs are (`--host-proc`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostProc {
    root: PathBuf,
}

impl HostProc {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// What can be read about host process `pid`; a process that is gone (or a synthetic PID) reads as
    /// nothing known.
    pub fn identify(&self, pid: u32) -> ProcessIdentity {
        let cgroup = std::fs::read_to_string(self.root.join(pid.to_string()).join("cgroup")).ok();
        ProcessIdentity {
            owner: owner_of_pid(&self.root, pid),
            pod_uid: cgroup.as_deref().and_then(pod_uid_from_cgroup),
        }
    }

    /// True when `<root>/1` is there: a `/proc` that shows processes at all (a wrong `--host-proc` does
    /// not). It cannot tell the host's PID namespace from a pod's; the pod UIDs it finds can.
    pub fn looks_like_proc(&self) -> bool {
        self.root.join("1").join("cgroup").exists()
    }
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

#[cfg(any(test, feature = "fixtures"))]
/// A fake `/proc`: one directory per process with the files the plugin reads.
pub struct ProcFixture {
    dir: tempfile::TempDir,
}

#[cfg(any(test, feature = "fixtures"))]
impl Default for ProcFixture {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(any(test, feature = "fixtures"))]
impl ProcFixture {
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    pub fn file(self, pid: u32, name: &str, contents: &[u8]) -> Self {
        let dir = self.dir.path().join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), contents).unwrap();
        self
    }

    /// cgroup v1 as the cgroupfs driver writes it: one line per controller.
    pub fn cgroupfs_v1(self, pid: u32, qos: &str, uid: &str) -> Self {
        let pod = match qos {
            "guaranteed" => format!("/kubepods/pod{uid}"),
            qos => format!("/kubepods/{qos}/pod{uid}"),
        };
        let lines = format!(
            "12:pids:{pod}/0a1b2c\n11:memory:{pod}/0a1b2c\n2:cpu,cpuacct:{pod}/0a1b2c\n1:name=systemd:{pod}/0a1b2c\n0::/\n"
        );
        self.file(pid, "cgroup", lines.as_bytes())
    }

    /// cgroup v2 as the systemd driver writes it (containerd's `cri-containerd-<id>.scope`).
    pub fn systemd_v2(self, pid: u32, qos: &str, uid: &str) -> Self {
        let uid = uid.replace('-', "_");
        let path = match qos {
            "guaranteed" => format!("/kubepods.slice/kubepods-pod{uid}.slice"),
            qos => format!("/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid}.slice"),
        };
        self.file(
            pid,
            "cgroup",
            format!("0::{path}/cri-containerd-0a1b2c.scope\n").as_bytes(),
        )
    }

    pub fn environ(self, pid: u32, env: &[u8]) -> Self {
        self.file(pid, "environ", env)
    }

    pub fn host(&self) -> HostProc {
        HostProc::new(self.dir.path())
    }
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

    const UID: &str = "3f1e2d4c-5b6a-4789-8abc-def012345678";

    #[test]
    fn a_process_is_mapped_to_its_pod_under_both_cgroup_drivers_and_every_qos_class() {
        let fx = ProcFixture::new()
            .cgroupfs_v1(10, "burstable", UID)
            .cgroupfs_v1(11, "besteffort", UID)
            .cgroupfs_v1(12, "guaranteed", UID)
            .systemd_v2(20, "burstable", UID)
            .systemd_v2(21, "besteffort", UID)
            .systemd_v2(22, "guaranteed", UID);
        let host = fx.host();
        for pid in [10, 11, 12, 20, 21, 22] {
            assert_eq!(host.identify(pid).pod_uid.as_deref(), Some(UID), "pid {pid}");
        }
    }

    #[test]
    fn a_kubelet_cgroup_root_and_a_systemd_v1_hierarchy_still_name_the_pod() {
        let cgroupfs_below_root = format!("4:memory:/tessera-node/kubepods/burstable/pod{UID}/abc\n");
        assert_eq!(pod_uid_from_cgroup(&cgroupfs_below_root).as_deref(), Some(UID));
        let systemd_v1 = format!(
            "5:devices:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-abc.scope\n",
            UID.replace('-', "_")
        );
        assert_eq!(pod_uid_from_cgroup(&systemd_v1).as_deref(), Some(UID));
        // A static pod's UID is a hash, not a UUID.
        assert_eq!(
            pod_uid_from_cgroup("0::/kubepods/burstable/pod6d3b1a0f9e8c7d6b5a4f3e2d1c0b9a8f/x\n").as_deref(),
            Some("6d3b1a0f9e8c7d6b5a4f3e2d1c0b9a8f")
        );
    }

    #[test]
    fn processes_outside_kubepods_or_gone_have_no_pod() {
        let fx = ProcFixture::new()
            .file(30, "cgroup", b"0::/system.slice/containerd.service\n")
            .file(31, "cgroup", b"3:memory:/user.slice/pod1234\n")
            .file(32, "cgroup", b"0::/kubepods/burstable/pod../../etc\n");
        let host = fx.host();
        assert_eq!(host.identify(30).pod_uid, None);
        assert_eq!(host.identify(31).pod_uid, None, "a pod segment outside kubepods");
        assert_eq!(host.identify(32).pod_uid, None, "not a UID");
        assert_eq!(host.identify(99).pod_uid, None, "gone");
        assert_eq!(host.identify(1 << 22).owner, None, "a synthetic PID");
    }

    #[test]
    fn a_readable_environment_names_the_claim_and_the_cgroup_the_pod() {
        let fx = ProcFixture::new()
            .cgroupfs_v1(40, "burstable", UID)
            .environ(40, b"TESSERA_CLAIM=team-a/c0\0TESSERA_DEVICE=gpu-1-shared\0");
        let id = fx.host().identify(40);
        assert_eq!(id.pod_uid.as_deref(), Some(UID));
        assert_eq!(
            id.owner,
            Some(ProcessOwner {
                claim: "team-a/c0".into(),
                device: "gpu-1-shared".into()
            })
        );
        assert!(!fx.host().looks_like_proc(), "no pid 1 in the fixture");
        let fx = fx.cgroupfs_v1(1, "burstable", UID);
        assert!(fx.host().looks_like_proc());
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
