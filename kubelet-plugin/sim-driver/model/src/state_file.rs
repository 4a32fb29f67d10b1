//! The small JSON files of the simulated backend's state directory that the `simulate` subcommand and the
//! running plugin both change (injected faults, synthetic load): each change runs under an exclusive
//! `flock` of the file's own lock file and replaces the file atomically (temp file, fsync, rename), so it
//! survives a plugin crash as hardware state would, and two processes never lose each other's change or
//! leave a torn file. [`read_or_default`] reads one; what a corrupt one means (the message) stays with each
//! file's module.

use std::{
    fs::{self, File, OpenOptions},
    io::Write,
    path::Path,
};

use serde::{Serialize, de::DeserializeOwned};

use tessera_gpu_api::{GpuError, Result};

fn state_err(path: &Path, reason: impl std::fmt::Display) -> GpuError {
    GpuError::SimulatedState {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// The JSON at `path`, or `T::default()` when there is no file yet; `corrupt` says what a file that does not
/// parse is, and how to get out of it.
pub fn read_or_default<T: DeserializeOwned + Default>(
    path: &Path,
    corrupt: impl FnOnce(serde_json::Error) -> String,
) -> Result<T> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| state_err(path, corrupt(e))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
        Err(e) => Err(state_err(path, e)),
    }
}

/// Holds the exclusive lock `<dir>/<lock>` (created if missing) until the returned file is dropped.
pub fn lock(dir: &Path, lock: &str) -> Result<File> {
    fs::create_dir_all(dir).map_err(|e| state_err(dir, format!("cannot create the state directory: {e}")))?;
    let path = dir.join(lock);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| state_err(&path, e))?;
    file.lock().map_err(|e| state_err(&path, e))?;
    Ok(file)
}

/// Under the lock `<dir>/<lock>`: reads the content with `read`, lets `change` edit it, and writes it back
/// to `<dir>/<file>` atomically.
pub fn update<T: Serialize>(
    dir: &Path,
    lock_name: &str,
    file: &str,
    read: impl FnOnce() -> Result<T>,
    change: impl FnOnce(&mut T),
) -> Result<()> {
    let _lock = lock(dir, lock_name)?;
    let mut content = read()?;
    change(&mut content);
    let path = dir.join(file);
    let json = serde_json::to_vec_pretty(&content).map_err(|e| state_err(&path, e))?;
    let tmp = dir.join(format!("{file}.tmp"));
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(&json)?;
        f.sync_data()?;
        drop(f);
        fs::rename(&tmp, &path)
    };
    write().map_err(|e| state_err(&path, format!("cannot write it: {e}")))
}
