//! `disable-device-node-modification`, as NVIDIA's hook of that name (NVIDIA/nvidia-container-toolkit,
//! `cmd/nvidia-cdi-hook/disable-device-node-modification`): the container sees the driver's
//! `/proc/driver/nvidia/params` with `ModifyDeviceFiles: 0`, so the driver's user-space libraries in the
//! container never create, chmod or chown device nodes (`nvidia-modprobe` from CUDA or NVML): the container
//! gets the nodes its spec names and nothing else, even where it could reach the others' (a privileged
//! container, host `/dev`).
//!
//! The changed copy lives on a tmpfs of its own, bind-mounted read-only over the file in the container's
//! `/proc` (the runtime refuses spec mounts inside `/proc`, so a hook does it, in the container's mount
//! namespace while the runtime creates it). The tmpfs is then detached from its temporary directory, which
//! is removed: the bind mount keeps the file, and nothing is left behind on the host.

use std::{
    ffi::CString,
    fs::{self, OpenOptions},
    io::{self, Write},
    os::unix::{
        ffi::OsStrExt,
        fs::{DirBuilderExt, OpenOptionsExt},
    },
    path::{Path, PathBuf},
};

use crate::{Error, Result, Rootfs};

/// The driver's parameters, on the host and in the container.
pub const DRIVER_PARAMS: &str = "/proc/driver/nvidia/params";

/// What [`disable_device_node_modification`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Params {
    /// The container's params file now says `ModifyDeviceFiles: 0`.
    Masked,
    /// The host's already says `ModifyDeviceFiles: 0`, or names no such parameter: nothing to change.
    Unchanged,
    /// No NVIDIA driver is loaded on the host (no params file): nothing to mask.
    NoDriver,
}

/// The params file `params` with device node modification off, as NVIDIA's hook writes it: the line
/// `ModifyDeviceFiles: 1` becomes `ModifyDeviceFiles: 0`, every other line is kept (each ending in `\n`).
/// `None` where nothing changes: the line says 0 already, or there is none.
pub fn without_device_node_modification(params: &str) -> Option<String> {
    let mut out = String::with_capacity(params.len() + 1);
    let mut changed = false;
    for line in params.lines() {
        match line {
            "ModifyDeviceFiles: 0" => return None,
            "ModifyDeviceFiles: 1" => {
                out.push_str("ModifyDeviceFiles: 0");
                changed = true;
            }
            other => out.push_str(other),
        }
        out.push('\n');
    }
    changed.then_some(out)
}

/// Masks `/proc/driver/nvidia/params` in this process's own mount namespace (the plugin's and the MPS
/// supervisor's containers, privileged), as [`disable_device_node_modification`] does in a container's: the
/// changed copy is written into `dir`, a tmpfs the caller already has (an `emptyDir` of medium `Memory`: a
/// read-only root filesystem has nowhere to mount one), and bind-mounted read-only over the file. Processes
/// started later in the namespace (NVML's, the MPS daemons) read `ModifyDeviceFiles: 0`.
pub fn mask_in_own_namespace(host_params: &Path, dir: &Path) -> Result<Params> {
    let params = match read_host_params(host_params)? {
        Some(p) => p,
        None => return Ok(Params::NoDriver),
    };
    let Some(masked) = without_device_node_modification(&params) else {
        return Ok(Params::Unchanged);
    };
    let file = dir.join("nvidia-params");
    let write = || -> io::Result<()> {
        let _ = fs::remove_file(&file);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o444)
            .open(&file)?;
        f.write_all(masked.as_bytes())?;
        drop(f);
        bind_read_only(&file, host_params)
    };
    write().map_err(write_err)?;
    Ok(Params::Masked)
}

fn read_host_params(host_params: &Path) -> Result<Option<String>> {
    match fs::read_to_string(host_params) {
        Ok(p) => Ok(Some(p)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(write_err(io::Error::new(
            e.kind(),
            format!("reading {}: {e}", host_params.display()),
        ))),
    }
}

/// Masks the container's `/proc/driver/nvidia/params` (see the module comment) with the host's file at
/// `host_params` (the hook's own `/proc`, which is the host's: the driver's procfs entries are not
/// namespaced). Needs `CAP_SYS_ADMIN` in the container's mount namespace, which a runtime's hook has.
pub fn disable_device_node_modification(root: &Rootfs, host_params: &Path) -> Result<Params> {
    let params = match read_host_params(host_params)? {
        Some(p) => p,
        None => return Ok(Params::NoDriver),
    };
    let Some(masked) = without_device_node_modification(&params) else {
        return Ok(Params::Unchanged);
    };
    let target = root.resolve(Path::new(DRIVER_PARAMS))?;
    if fs::metadata(&target).is_err() {
        // The runtime mounts the container's /proc before createContainer hooks; without the file there
        // (no procfs, a driver unloaded since) there is nothing the container could read.
        return Ok(Params::NoDriver);
    }
    let dir = std::env::temp_dir().join(format!("tessera-params-{}", std::process::id()));
    // An empty one left by a hook of the same pid that was killed: its tmpfs lived in that container only.
    let _ = fs::remove_dir(&dir);
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(write_err)?;
    let result = mask_with_tmpfs(&dir, &target, masked.as_bytes());
    // Detached whatever happened: the bind mount, if made, keeps the file; the directory is the hook's own.
    let _ = umount_detach(&dir);
    let _ = fs::remove_dir(&dir);
    result.map_err(write_err)?;
    Ok(Params::Masked)
}

fn write_err(source: io::Error) -> Error {
    Error::Write {
        path: DRIVER_PARAMS.to_string(),
        source,
    }
}

/// A tmpfs at `dir` holding `contents` as a read-only file, bind-mounted read-only over `target`.
fn mask_with_tmpfs(dir: &Path, target: &Path, contents: &[u8]) -> io::Result<()> {
    let nosuid_nodev_noexec = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // A page more than the file: the tmpfs holds nothing else.
    let size = format!("size={},mode=0755", contents.len() + 4096);
    mount(
        Some(Path::new("tmpfs")),
        dir,
        Some("tmpfs"),
        nosuid_nodev_noexec,
        Some(&size),
    )?;
    let file: PathBuf = dir.join("params");
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o444)
        .open(&file)?;
    f.write_all(contents)?;
    drop(f);
    bind_read_only(&file, target)
}

/// `file` bind-mounted over `target`, read-only, nosuid, nodev, noexec.
fn bind_read_only(file: &Path, target: &Path) -> io::Result<()> {
    mount(Some(file), target, None, libc::MS_BIND, None)?;
    // A bind mount takes its flags only on a remount.
    mount(
        None,
        target,
        None,
        libc::MS_BIND
            | libc::MS_REMOUNT
            | libc::MS_RDONLY
            | libc::MS_NOSUID
            | libc::MS_NODEV
            | libc::MS_NOEXEC,
        None,
    )
}

fn cstring(p: &[u8]) -> io::Result<CString> {
    CString::new(p).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

#[allow(unsafe_code, reason = "mount(2): std has no call that mounts")]
fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let source = source.map(|s| cstring(s.as_os_str().as_bytes())).transpose()?;
    let target = cstring(target.as_os_str().as_bytes())?;
    let fstype = fstype.map(|t| cstring(t.as_bytes())).transpose()?;
    let data = data.map(|d| cstring(d.as_bytes())).transpose()?;
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is null or a NUL-terminated string that outlives the call.
    let rc = unsafe {
        libc::mount(
            ptr(&source),
            target.as_ptr(),
            ptr(&fstype),
            flags,
            ptr(&data).cast(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[allow(unsafe_code, reason = "umount2(2): std has no call that unmounts")]
fn umount_detach(dir: &Path) -> io::Result<()> {
    let dir = cstring(dir.as_os_str().as_bytes())?;
    // SAFETY: `dir` is a NUL-terminated path that outlives the call.
    if unsafe { libc::umount2(dir.as_ptr(), libc::MNT_DETACH) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARAMS: &str =
        "ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 1\nDeviceFileUID: 0\nDeviceFileMode: 438\n";

    #[test]
    fn modify_device_files_1_becomes_0_and_every_other_line_is_kept() {
        assert_eq!(
            without_device_node_modification(PARAMS).as_deref(),
            Some(
                "ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 0\nDeviceFileUID: 0\nDeviceFileMode: 438\n"
            )
        );
    }

    #[test]
    fn params_that_already_forbid_modification_or_do_not_name_it_are_left_alone() {
        assert_eq!(
            without_device_node_modification("ModifyDeviceFiles: 0\nDeviceFileUID: 0\n"),
            None
        );
        assert_eq!(without_device_node_modification("DeviceFileUID: 0\n"), None);
        // Only the exact values NVIDIA's hook knows are rewritten.
        assert_eq!(without_device_node_modification("ModifyDeviceFiles: 2\n"), None);
    }

    #[test]
    fn a_host_without_the_driver_has_nothing_to_mask_and_mounts_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let root = Rootfs::new(dir.path());
        let got = disable_device_node_modification(&root, &dir.path().join("no-params")).unwrap();
        assert_eq!(got, Params::NoDriver);
    }

    /// Moves the calling test's thread into a mount namespace of its own with private propagation, so its
    /// mounts reach neither the host nor the other tests (a namespace belongs to a thread, and CLONE_NEWNS
    /// needs no single-threaded process). False without CAP_SYS_ADMIN: the caller says so and stops, as on a
    /// developer's unprivileged machine; CI runs as root (its real node needs it), so there these run.
    #[allow(unsafe_code, reason = "unshare(2): std has no call for it")]
    fn in_a_private_mount_namespace(test: &str) -> bool {
        // SAFETY: a plain syscall with a constant argument; nothing borrowed.
        if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
            let why = io::Error::last_os_error();
            eprintln!("{test}: skipped, no CAP_SYS_ADMIN to make a mount namespace: {why}");
            return false;
        }
        mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE, None)
            .expect("making / private in the test's own mount namespace");
        true
    }

    /// The mounts themselves, in a mount namespace of the test's own.
    #[test]
    fn the_containers_params_file_is_masked_read_only_and_nothing_is_left_on_the_host() {
        if !in_a_private_mount_namespace("the_containers_params_file_is_masked") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().join("host-params");
        fs::write(&host, PARAMS).unwrap();
        let root = dir.path().join("root");
        let target = root.join("proc/driver/nvidia/params");
        fs::create_dir_all(target.parent().unwrap()).unwrap();
        fs::write(&target, PARAMS).unwrap();

        let got = disable_device_node_modification(&Rootfs::new(&root), &host).unwrap();
        assert_eq!(got, Params::Masked);
        let seen = fs::read_to_string(&target).unwrap();
        assert!(
            seen.contains("ModifyDeviceFiles: 0\n") && seen.contains("DeviceFileMode: 438\n"),
            "{seen}"
        );
        let e = fs::write(&target, "ModifyDeviceFiles: 1\n").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EROFS), "the mask is read-only: {e}");
        assert!(
            !std::env::temp_dir()
                .join(format!("tessera-params-{}", std::process::id()))
                .exists(),
            "the tmpfs's directory is removed"
        );
        assert_eq!(
            fs::read_to_string(&host).unwrap(),
            PARAMS,
            "the host's file is not touched"
        );
        umount_detach(&target).unwrap();
    }

    /// As above, in a mount namespace of the test's own.
    #[test]
    fn a_process_masks_the_params_of_its_own_namespace_with_a_file_in_its_tmpfs() {
        if !in_a_private_mount_namespace("a_process_masks_the_params") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        // The params file stands in for /proc's: the same path read and then masked.
        let params = dir.path().join("params");
        fs::write(&params, PARAMS).unwrap();
        let tmpfs = dir.path().join("tmpfs");
        fs::create_dir(&tmpfs).unwrap();
        assert_eq!(mask_in_own_namespace(&params, &tmpfs).unwrap(), Params::Masked);
        let seen = fs::read_to_string(&params).unwrap();
        assert!(seen.contains("ModifyDeviceFiles: 0\n"), "{seen}");
        assert!(fs::write(&params, PARAMS).is_err(), "the mask is read-only");
        umount_detach(&params).unwrap();
        assert_eq!(
            fs::read_to_string(&params).unwrap(),
            PARAMS,
            "the file under the mask is unchanged"
        );
        assert_eq!(
            mask_in_own_namespace(&dir.path().join("none"), &tmpfs).unwrap(),
            Params::NoDriver
        );
    }

    #[test]
    fn a_host_that_already_forbids_modification_mounts_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let host = dir.path().join("params");
        fs::write(&host, "ModifyDeviceFiles: 0\n").unwrap();
        let got = disable_device_node_modification(&Rootfs::new(dir.path().join("root")), &host).unwrap();
        assert_eq!(got, Params::Unchanged);
    }
}
