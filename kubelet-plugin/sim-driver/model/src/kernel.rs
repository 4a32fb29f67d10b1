//! The simulated kernel module's side: the kernel directory's names, the driver version it reports in its
//! `proc/driver/nvidia/version`, and how a loaded library learns its own version.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// Driver version the simulated node reports.
pub const SIMULATED_DRIVER_VERSION: &str = "580.159.03";
/// CUDA driver version the simulated node reports.
pub const SIMULATED_CUDA_DRIVER_VERSION: &str = "13.0";

/// The kernel file in a simulated kernel directory.
pub const KERNEL_FILE: &str = "kernel.json";
/// Name of the simulated kernel directory (or link to it) at a driver root: `<root>/tessera-sim`.
pub const KERNEL_DIR_NAME: &str = "tessera-sim";
/// Overrides where the NVML and CUDA libraries look for the simulated kernel (tests, tools).
pub const KERNEL_ENV: &str = "TESSERA_SIM_KERNEL";
/// Test-only: the directory the libraries take for `/dev` when deciding what a process sees. A real
/// container has `/dev/nvidiactl`, and tests on a shared host cannot make one; nothing else reads it.
pub const DEV_ROOT_ENV: &str = "TESSERA_SIM_DEV_ROOT";
pub(crate) const KERNEL_VERSION: u32 = 1;
/// `proc/` of the kernel directory, and the file saying which state generation it shows.
pub(crate) const PROC_DIR: &str = "proc";
pub(crate) const PROC_GENERATION_FILE: &str = ".generation";
/// The kernel module's version file under `proc/`, which the libraries compare their own version with.
pub const KERNEL_VERSION_FILE: &str = "driver/nvidia/version";

/// What the simulated kernel module of driver `version` shows in `proc/driver/nvidia/version` (the
/// format of NVIDIA's, which [`tessera_gpu_api::driver_version::parse_kernel_version`] reads).
pub fn kernel_version_text(version: &str) -> String {
    format!(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  (tessera simulated)\nGCC version:  simulated\n"
    )
}

/// The driver version the simulated kernel `dir` reports (its `proc/driver/nvidia/version`), if any.
pub fn kernel_driver_version(dir: &Path) -> Option<String> {
    let text = fs::read_to_string(dir.join(PROC_DIR).join(KERNEL_VERSION_FILE)).ok()?;
    tessera_gpu_api::driver_version::parse_kernel_version(&text)
}

/// The driver version of a simulated library file loaded from `own` (`…/libcuda.so.1` as the loader named
/// it) whose mapped inode is `inode`: the version in the name of the `<stem>.so.<version>` file of its
/// directory that is the same file (a driver root's soname link points at it; a container has both bind
/// mounted from one host file), else the version [`SIMULATED_DRIVER_VERSION`] the artifacts are built as
/// (a library loaded straight from `target/`). Read by the library once, at its first init, so a process
/// keeps the version it loaded when a driver upgrade repoints the links.
pub fn library_driver_version(own: &Path, inode: Option<u64>, stem: &str) -> String {
    use std::os::unix::fs::MetadataExt;
    let file = own.file_name().map(PathBuf::from).unwrap_or_default();
    if let Some(v) = tessera_gpu_api::driver_version::version_in_name(&file, stem) {
        return v;
    }
    let inode = inode.or_else(|| fs::metadata(own).ok().map(|m| m.ino()));
    let from_dir = own.parent().zip(inode).and_then(|(dir, ino)| {
        fs::read_dir(dir).ok()?.filter_map(|e| e.ok()).find_map(|e| {
            let meta = fs::metadata(e.path()).ok()?;
            if meta.ino() != ino {
                return None;
            }
            tessera_gpu_api::driver_version::version_in_name(Path::new(&e.file_name()), stem)
        })
    });
    from_dir.unwrap_or_else(|| SIMULATED_DRIVER_VERSION.to_string())
}

/// The inode of the file mapped at `addr` in this process (`/proc/self/maps`): the library file a function
/// was loaded from, even after its name was repointed or removed.
pub fn mapped_inode(addr: usize) -> Option<u64> {
    let maps = fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut f = line.split_whitespace();
        let (start, end) = f.next()?.split_once('-')?;
        let (start, end) = (
            usize::from_str_radix(start, 16).ok()?,
            usize::from_str_radix(end, 16).ok()?,
        );
        if !(start..end).contains(&addr) {
            return None;
        }
        let inode: u64 = f.nth(3)?.parse().ok()?;
        (inode != 0).then_some(inode)
    })
}
