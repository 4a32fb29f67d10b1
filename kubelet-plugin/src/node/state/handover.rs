//! One plugin instance at a time owns the node state: a lock on `<state dir>/plugin.lock`.
//!
//! During a rolling update with `maxSurge` the old and the new plugin pod run on one node at once, over
//! one state directory (checkpoint, CDI specs, MPS pipe directories) and one set of GPUs. The state
//! machine keeps the checkpoint, the per-GPU locks and each preparer's bookkeeping (how many shares hold
//! an MPS daemon) in memory, loaded at start, so two instances changing the node at once would lose each
//! other's records. The lock makes the handover a plugin restart: the new instance serves kubelet (so kubelet
//! registers it and the old pod can be stopped) but loads the state only once the old instance has
//! finished its calls and exited; the calls kubelet sends it meanwhile wait ([`crate::kubelet::driver::StateGate`]).
//!
//! It is a `flock` (`File::try_lock`): the kernel releases it when the holder exits, however it exits, so
//! a killed instance never leaves the next one waiting. The holder writes who it is into the file, for the
//! log line of whoever waits.

use std::{
    fs::{File, OpenOptions},
    io::{Read, Seek, Write},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use tokio::sync::watch;
use tracing::info;

use crate::node::error::{Error, Result};

/// File name in the state directory.
pub const LOCK_FILE: &str = "plugin.lock";

/// How often a waiting instance tries the lock again. The handover window is the old pod's shutdown
/// (seconds), and calls wait for it, so a tenth of a second adds little.
const RETRY: Duration = Duration::from_millis(100);

/// The held lock; dropping it (or exiting) hands the state to the next instance.
#[derive(Debug)]
pub struct StateLock {
    _file: File,
    path: PathBuf,
}

impl StateLock {
    /// The lock file of `state_dir`.
    pub fn path_in(state_dir: &Path) -> PathBuf {
        state_dir.join(LOCK_FILE)
    }

    /// Takes the lock if no other instance holds it; `Ok(None)` if one does.
    pub fn try_acquire(state_dir: &Path, holder: &str) -> Result<Option<Self>> {
        let path = Self::path_in(state_dir);
        let err = |source| Error::LockState {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(state_dir).map_err(err)?;
        // Not truncated on open: until the lock is ours the file names the instance that holds it.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(err)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Ok(None),
            Err(std::fs::TryLockError::Error(source)) => return Err(err(source)),
        }
        file.set_len(0).map_err(err)?;
        file.rewind().map_err(err)?;
        writeln!(file, "{holder}").map_err(err)?;
        Ok(Some(Self { _file: file, path }))
    }

    /// Waits for the lock (logging who holds it) until it is ours, or `Ok(None)` once `stop` turns true.
    pub async fn acquire(
        state_dir: &Path,
        holder: &str,
        mut stop: watch::Receiver<bool>,
    ) -> Result<Option<Self>> {
        let started = Instant::now();
        let mut logged = false;
        loop {
            if let Some(lock) = Self::try_acquire(state_dir, holder)? {
                if logged {
                    info!(lock = %lock.path.display(), waited_ms = started.elapsed().as_millis() as u64,
                        "the previous plugin instance released the node state; taking over");
                }
                return Ok(Some(lock));
            }
            if !logged {
                info!(lock = %Self::path_in(state_dir).display(), holder = %holder_of(state_dir),
                    "another plugin instance owns the node state; serving kubelet, and its calls wait until \
                     that instance has finished and exited");
                logged = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(RETRY) => {}
                _ = stop.wait_for(|s| *s) => return Ok(None),
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Who holds the lock, as it wrote itself into the file.
fn holder_of(state_dir: &Path) -> String {
    let mut text = String::new();
    match File::open(StateLock::path_in(state_dir)).and_then(|mut f| f.read_to_string(&mut text)) {
        Ok(_) if !text.trim().is_empty() => text.trim().to_string(),
        _ => "unknown".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let first = StateLock::try_acquire(dir.path(), "pod a").unwrap().unwrap();
        assert!(StateLock::try_acquire(dir.path(), "pod b").unwrap().is_none());
        assert_eq!(holder_of(dir.path()), "pod a");
        drop(first);
        let second = StateLock::try_acquire(dir.path(), "pod b").unwrap();
        assert!(second.is_some());
        assert_eq!(holder_of(dir.path()), "pod b");
    }

    #[tokio::test]
    async fn waiting_for_the_lock_ends_when_told_to_stop() {
        let dir = tempfile::tempdir().unwrap();
        let _held = StateLock::try_acquire(dir.path(), "pod a").unwrap().unwrap();
        let (stop, rx) = watch::channel(false);
        let waiting = tokio::spawn({
            let dir = dir.path().to_path_buf();
            async move { StateLock::acquire(&dir, "pod b", rx).await }
        });
        stop.send_replace(true);
        assert!(waiting.await.unwrap().unwrap().is_none());
    }
}
