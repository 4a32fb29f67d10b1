//! A `/dev/shm` of its own for each MPS control daemon on real GPUs (supervisor mode): MPS clients and
//! their server exchange data through shared memory as well as the pipe directory, so the daemon and its
//! clients must see the same `/dev/shm`, and nobody else should. The supervisor mounts a tmpfs at
//! `<daemon dir>/shm`, starts the daemon in a new mount namespace with that tmpfs bind-mounted on
//! `/dev/shm`, and hands the same tmpfs to the share's containers as their `/dev/shm` (CDI mount).
//!
//! Needs `CAP_SYS_ADMIN` and, for the containers to see the tmpfs, the state directory mounted with
//! bidirectional propagation; it cannot run in this repository's tests (no root, no GPU), so it stays a few
//! straight-line system calls.
#![allow(
    unsafe_code,
    reason = "mount(2), umount2(2) and unshare(2) through libc; see the module comment"
)]

use std::{
    ffi::CString,
    io,
    os::unix::{ffi::OsStrExt, fs::MetadataExt, process::CommandExt},
    path::Path,
    process::Command,
};

/// The size of each daemon's tmpfs. Without one a tmpfs may take half the node's memory, and its pages
/// are charged to the cgroup of whoever writes them first, so a tenant could pin memory outside its pod's
/// limit through segments it leaves behind. 1 GiB holds MPS's own segments (a few MiB per server) and the
/// NCCL and DataLoader segments of a namespace's shares on one GPU in the common case; a workload that
/// needs more sets an `emptyDir` of `medium: Memory` with its own `sizeLimit` at another path.
pub(crate) const SIZE: &str = "1g";

fn c_path(path: &Path) -> Result<CString, String> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| format!("{} contains a NUL byte", path.display()))
}

/// True when `path` is a mount point (another device than its parent).
fn is_mount_point(path: &Path) -> bool {
    match (path.metadata(), path.parent().map(Path::metadata)) {
        (Ok(me), Some(Ok(parent))) => me.dev() != parent.dev(),
        _ => false,
    }
}

/// Mounts the tmpfs at `shm` (once) and makes `cmd` run in a new mount namespace with it on `/dev/shm`.
pub(crate) fn prepare(cmd: &mut Command, shm: &Path) -> Result<(), String> {
    let source = c_path(shm)?;
    if !is_mount_point(shm) {
        let fstype = CString::new("tmpfs").expect("static");
        let data = CString::new(format!("mode=1777,size={SIZE}")).expect("static");
        // SAFETY: every pointer is a valid NUL-terminated string that outlives the call.
        let rc = unsafe {
            libc::mount(
                fstype.as_ptr(),
                source.as_ptr(),
                fstype.as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                data.as_ptr().cast(),
            )
        };
        if rc != 0 {
            return Err(format!(
                "cannot mount a tmpfs at {}: {} (the supervisor needs CAP_SYS_ADMIN)",
                shm.display(),
                io::Error::last_os_error()
            ));
        }
    }
    let root = CString::new("/").expect("static");
    let dev_shm = CString::new("/dev/shm").expect("static");
    // SAFETY: the closure runs in the forked child before exec and makes only async-signal-safe system
    // calls on strings allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(io::Error::last_os_error());
            }
            // Nothing mounted in the daemon's namespace may propagate back to the host.
            if libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            if libc::mount(
                source.as_ptr(),
                dev_shm.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

/// Unmounts the daemon's tmpfs after its daemon stopped (best effort: the directory is removed next).
pub(crate) fn release(shm: &Path) {
    if !is_mount_point(shm) {
        return;
    }
    if let Ok(path) = c_path(shm) {
        // SAFETY: a valid NUL-terminated path.
        unsafe {
            libc::umount2(path.as_ptr(), libc::MNT_DETACH);
        }
    }
}
