//! NVML clients: which processes hold which GPUs open, in the simulated kernel directory.
//!
//! A real driver refuses a MIG mode change while any other client holds the GPU open, whether or not
//! `nvidia-smi` lists it as a compute process: DCGM's `nv-hostengine`, dcgm-exporter, GPU feature
//! discovery, a second plugin's NVML session. NVIDIA's MIG manager stops exactly those before it changes
//! the mode (`NVIDIA/mig-parted`, `deployments/systemd/hooks.sh`: `pre-apply-mode` stops
//! `nvidia-dcgm.service`, `nvsm.service`, `dcgm-exporter.service` and the `k8s-device-plugin`,
//! `gpu-feature-discovery` and `dcgm-exporter` containers).
//!
//! Every `nvmlInit` of the simulated library that attaches GPUs (all but `NVML_INIT_FLAG_NO_ATTACH`, which
//! `nvml.h` documents as "Don't attach GPUs") records a session `<kernel>/nvml-sessions/<pid>-<n>.json`
//! naming the process and the kernel indices of the GPUs it attached; `nvmlShutdown` removes it. The
//! session file stays locked (`flock`) by its process while it lives: the kernel drops the lock when the
//! process exits however it exits, so a crashed holder holds nothing, and the check works across PID
//! namespaces (a container's PID means nothing in the plugin's `/proc`) and survives PID reuse. A session
//! whose lock can be taken is stale, and is removed by whoever finds it.
//!
//! A process never holds a GPU against itself: the plugin's own NVML sessions (its backend, its health
//! source) do not stop its own MIG toggle. A process is named by its PID and its PID namespace, which the
//! simulated library and the plugin's own copy of this crate read alike.

use std::{
    fs::{self, File, OpenOptions},
    io::Write,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
};

use serde::{Deserialize, Serialize};

/// The directory of the kernel directory that holds the sessions.
pub const SESSIONS_DIR: &str = "nvml-sessions";

/// `NVML_INIT_FLAG_NO_ATTACH` (`nvml.h`): "Don't attach GPUs".
pub const NVML_INIT_FLAG_NO_ATTACH: u32 = 2;

/// What a session file says.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionRecord {
    /// The PID as the process sees itself (in its own PID namespace).
    pub pid: u32,
    /// The inode of the process's PID namespace (`/proc/self/ns/pid`), 0 where unreadable.
    pub pid_namespace: u64,
    /// `/proc/self/comm`: what an error or a test names.
    pub name: String,
    /// Kernel indices of the GPUs the session attached.
    pub gpus: Vec<u32>,
}

impl SessionRecord {
    fn is_this_process(&self) -> bool {
        self.pid == std::process::id() && self.pid_namespace == own_pid_namespace()
    }
}

fn own_pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// One live NVML session of this process: its file, locked until dropped.
#[derive(Debug)]
pub struct Session {
    path: PathBuf,
    file: File,
}

impl Session {
    /// Records a session of this process holding `gpus` in kernel directory `kernel`. Fails where the
    /// directory cannot be written (a container's read-only mount): such a process holds nothing here.
    pub fn open(kernel: &Path, gpus: &[u32]) -> std::io::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = kernel.join(SESSIONS_DIR);
        fs::create_dir_all(&dir)?;
        let record = SessionRecord {
            pid: std::process::id(),
            pid_namespace: own_pid_namespace(),
            name: fs::read_to_string("/proc/self/comm")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            gpus: gpus.to_vec(),
        };
        let stem = format!(
            "{}-{}-{}",
            record.pid,
            record.pid_namespace,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        // Written and locked under a temporary name, then renamed: a session is never seen unlocked.
        let tmp = dir.join(format!(".{stem}.tmp"));
        let path = dir.join(format!("{stem}.json"));
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&tmp)?;
        file.lock()?;
        file.write_all(&serde_json::to_vec(&record).map_err(std::io::Error::other)?)?;
        fs::rename(&tmp, &path)?;
        Ok(Self { path, file })
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Removed before unlocking, so no checker takes the lock of a file this process still names.
        let _ = fs::remove_file(&self.path);
        let _ = self.file.unlock();
    }
}

/// The live NVML sessions of other processes that hold GPU `gpu` of kernel directory `kernel`. Stale
/// sessions (their process gone) are removed on the way.
pub fn other_holders(kernel: &Path, gpu: u32) -> Vec<SessionRecord> {
    let Ok(entries) = fs::read_dir(kernel.join(SESSIONS_DIR)) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.filter_map(|e| e.ok()) {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let Some(record) = fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<SessionRecord>(&b).ok())
        else {
            continue;
        };
        if record.is_this_process() {
            continue;
        }
        if !is_live(&path) {
            let _ = fs::remove_file(&path);
            continue;
        }
        if record.gpus.contains(&gpu) {
            out.push(record);
        }
    }
    out.sort_by_key(|r| r.pid);
    out
}

/// Every live NVML session of kernel directory `kernel`, this process's included: what keeps the kernel
/// module in use (each holds `/dev/nvidiactl` open on a real driver). Stale sessions are removed on the way.
pub fn live_sessions(kernel: &Path) -> Vec<SessionRecord> {
    let Ok(entries) = fs::read_dir(kernel.join(SESSIONS_DIR)) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for path in entries.filter_map(|e| e.ok()).map(|e| e.path()) {
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let Some(record) = fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<SessionRecord>(&b).ok())
        else {
            continue;
        };
        if is_live(&path) {
            out.push(record);
        } else {
            let _ = fs::remove_file(&path);
        }
    }
    out.sort_by_key(|r| r.pid);
    out
}

/// Whether the session file at `path` is still locked by its process.
fn is_live(path: &Path) -> bool {
    let Ok(file) = File::open(path) else {
        return false;
    };
    match file.try_lock_shared() {
        Ok(()) => {
            let _ = file.unlock();
            false
        }
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_never_holds_a_gpu_against_itself() {
        let dir = tempfile::tempdir().unwrap();
        let session = Session::open(dir.path(), &[0, 1]).unwrap();
        assert!(other_holders(dir.path(), 0).is_empty());
        drop(session);
        assert_eq!(fs::read_dir(dir.path().join(SESSIONS_DIR)).unwrap().count(), 0);
    }

    #[test]
    fn a_session_whose_process_is_gone_holds_nothing_and_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let sessions = dir.path().join(SESSIONS_DIR);
        fs::create_dir_all(&sessions).unwrap();
        // What a crashed holder leaves: its file, unlocked, naming another process.
        let stale = sessions.join("4200001-1-0.json");
        let record = SessionRecord {
            pid: 4_200_001,
            pid_namespace: 1,
            name: "nv-hostengine".into(),
            gpus: vec![0],
        };
        fs::write(&stale, serde_json::to_vec(&record).unwrap()).unwrap();
        assert!(other_holders(dir.path(), 0).is_empty());
        assert!(!stale.exists());
    }

    #[test]
    fn a_locked_session_of_another_process_holds_its_gpus_only() {
        let dir = tempfile::tempdir().unwrap();
        let sessions = dir.path().join(SESSIONS_DIR);
        fs::create_dir_all(&sessions).unwrap();
        let path = sessions.join("4200002-1-0.json");
        let record = SessionRecord {
            pid: 4_200_002,
            pid_namespace: 1,
            name: "nv-hostengine".into(),
            gpus: vec![1],
        };
        fs::write(&path, serde_json::to_vec(&record).unwrap()).unwrap();
        // Another open file description's lock conflicts as another process's would.
        let held = File::open(&path).unwrap();
        held.lock().unwrap();
        assert_eq!(other_holders(dir.path(), 1), [record]);
        assert!(other_holders(dir.path(), 0).is_empty());
        held.unlock().unwrap();
        assert!(other_holders(dir.path(), 1).is_empty());
    }
}
