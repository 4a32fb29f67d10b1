//! The simulated driver root: NVIDIA's user-space layout, filled with the libraries and tools this
//! repository builds over the simulated hardware model.
//!
//! ```text
//!  R/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.159.03   (target/<profile>/libnvidia_ml.so, tessera-sim-nvml)
//!  R/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 -> libnvidia-ml.so.580.159.03
//!  R/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.03        (target/<profile>/libcuda.so, tessera-sim-cuda)
//!  R/usr/lib/x86_64-linux-gnu/libcuda.so.1 -> libcuda.so.580.159.03
//!  R/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.580.159.03   (target/<profile>/libnvidia_ptxjitcompiler.so)
//!  R/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.1 -> libnvidia-ptxjitcompiler.so.580.159.03
//!  R/usr/lib/x86_64-linux-gnu/libnvidia-nvvm.so.580.159.03             (target/<profile>/libnvidia_nvvm.so)
//!  R/usr/lib/x86_64-linux-gnu/libnvidia-nvvm.so.4 -> libnvidia-nvvm.so.580.159.03
//!  R/usr/bin/nvidia-smi, nvidia-cuda-mps-control, nvidia-cuda-mps-server   (tessera-sim-tools)
//!  R/tessera-sim -> K                                       (the simulated kernel, see `simulated`)
//! ```
//!
//! The two JIT libraries (built by `sim-driver/cuda/build.rs`) are what NVIDIA's libcuda `dlopen`s by soname
//! when a program loads PTX or links NVVM IR; the simulated libcuda does the same, so a driver root, or a
//! container's spec, without them fails those calls as a real one does.
//!
//! Files are copied, not linked into `target/`: the chart mounts R into containers, where `target/` does
//! not exist, and a rebuild must not change the library under a running process. Each file is written
//! next to its destination and renamed over it, so a process that has the old one mapped keeps it, and a
//! file whose size and modification time already match its artifact is left alone (a plugin restart
//! copies nothing). Copies rather than hard links also keep each driver root's library a file of its own:
//! the dynamic loader loads one inode once per process, so two roots sharing an inode would share one
//! library instance, and with it one kernel.
//!
//! **Layouts** ([`Layout`]), the three a node has its driver in:
//!
//! * `host` (the default, above): the driver installed in the host's `/` by distribution packages;
//! * `operator`: the GPU Operator's driver container rootfs (`/run/nvidia/driver`), a whole distribution:
//!   the same files plus the distribution's own `libc.so.6` and loader beside NVIDIA's libraries in
//!   `usr/lib/x86_64-linux-gnu` (and the loader in `usr/lib64`), merged-/usr links `lib -> usr/lib`,
//!   `lib64 -> usr/lib64`, `bin -> usr/bin`, `sbin -> usr/sbin`, and `etc/os-release`. The libc and loader
//!   are deliberate decoys: copies of the simulated `libcuda.so` under those names, valid shared objects
//!   that define none of glibc's symbol versions, so a program of another glibc that loads them dies at
//!   once, as with a real driver container of another distribution;
//! * `gke`: GKE's `/home/kubernetes/bin/nvidia`: `lib64/` and `bin/` only, no `usr/`, no libc.
//!
//! The artifacts are looked for in [`ARTIFACTS_ENV`] when set, else next to the running executable
//! (`target/debug` holds the plugin and the cdylibs; a test in `target/debug/deps` looks one level up
//! too), else in `<exe dir>/../lib/tessera-sim` (an installed layout).

use std::{
    fs::{self, File},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
};

use tracing::warn;

use tessera_gpu_api::{GpuError, Result};

use crate::kernel::{KERNEL_DIR_NAME, KERNEL_VERSION_FILE, SIMULATED_DRIVER_VERSION, kernel_version_text};

/// Directory of the built artifacts, overriding the executable's directory.
pub const ARTIFACTS_ENV: &str = "TESSERA_SIM_DRIVER_DIR";
/// Where libraries go under the root (Debian's multiarch directory, NVIDIA's default there).
pub const LIBRARY_DIR: &str = "usr/lib/x86_64-linux-gnu";
/// Where programs go under the root.
pub const BINARY_DIR: &str = "usr/bin";

/// Which node's driver root to imitate (see the module comment).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Layout {
    /// Host-installed drivers: `usr/lib/x86_64-linux-gnu`, `usr/bin`.
    #[default]
    Host,
    /// The GPU Operator's driver container: a distribution rootfs with its own (decoy) libc and loader.
    Operator,
    /// GKE's `lib64/` and `bin/`, no libc.
    Gke,
}

impl Layout {
    /// Where the libraries go under the root.
    pub fn library_dir(self) -> &'static str {
        match self {
            Layout::Host | Layout::Operator => LIBRARY_DIR,
            Layout::Gke => "lib64",
        }
    }

    /// Where the programs go under the root.
    pub fn binary_dir(self) -> &'static str {
        match self {
            Layout::Host | Layout::Operator => BINARY_DIR,
            Layout::Gke => "bin",
        }
    }
}

/// The Operator layout's decoys: the distribution's libc and loader, where a Debian-family rootfs has them.
pub const DECOYS: [&str; 3] = [
    "usr/lib/x86_64-linux-gnu/libc.so.6",
    "usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
    "usr/lib64/ld-linux-x86-64.so.2",
];
/// The Operator layout's merged-/usr links.
const MERGED_USR: [(&str, &str); 4] = [
    ("lib", "usr/lib"),
    ("lib64", "usr/lib64"),
    ("bin", "usr/bin"),
    ("sbin", "usr/sbin"),
];

/// One built file and where it goes in the driver root.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Artifact {
    /// File name cargo gives it in `target/<profile>`.
    pub built: &'static str,
    /// Name in the driver root: a library's is versioned (`libnvidia-ml.so.<driver version>`, see
    /// [`Artifact::installed_name`]).
    pub installed: &'static str,
    /// The soname link a library gets (`libnvidia-ml.so.1`); `None` for programs.
    pub soname: Option<&'static str>,
}

/// Everything a simulated driver root holds.
pub const ARTIFACTS: [Artifact; 7] = [
    Artifact {
        built: "libnvidia_ml.so",
        installed: "libnvidia-ml.so",
        soname: Some("libnvidia-ml.so.1"),
    },
    Artifact {
        built: "libcuda.so",
        installed: "libcuda.so",
        soname: Some("libcuda.so.1"),
    },
    Artifact {
        built: "libnvidia_ptxjitcompiler.so",
        installed: "libnvidia-ptxjitcompiler.so",
        soname: Some("libnvidia-ptxjitcompiler.so.1"),
    },
    // NVIDIA's soname for it is `.so.4` (the libNVVM ABI), not `.so.1`.
    Artifact {
        built: "libnvidia_nvvm.so",
        installed: "libnvidia-nvvm.so",
        soname: Some("libnvidia-nvvm.so.4"),
    },
    Artifact {
        built: "nvidia-smi",
        installed: "nvidia-smi",
        soname: None,
    },
    Artifact {
        built: "nvidia-cuda-mps-control",
        installed: "nvidia-cuda-mps-control",
        soname: None,
    },
    Artifact {
        built: "nvidia-cuda-mps-server",
        installed: "nvidia-cuda-mps-server",
        soname: None,
    },
];

impl Artifact {
    /// Path of the installed file relative to the root (host layout).
    pub fn installed_name(&self) -> String {
        self.installed_name_in(Layout::Host)
    }

    /// Path of the installed file relative to a root of `layout`.
    pub fn installed_name_in(&self, layout: Layout) -> String {
        match self.soname {
            Some(_) => format!(
                "{}/{}.{SIMULATED_DRIVER_VERSION}",
                layout.library_dir(),
                self.installed
            ),
            None => format!("{}/{}", layout.binary_dir(), self.installed),
        }
    }
}

/// Where the artifacts are looked for, in order (see the module comment).
pub fn artifact_dirs() -> Vec<PathBuf> {
    if let Some(dir) = std::env::var_os(ARTIFACTS_ENV).filter(|d| !d.is_empty()) {
        return vec![PathBuf::from(dir)];
    }
    let Some(exe_dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    else {
        return Vec::new();
    };
    let mut dirs = vec![exe_dir.clone()];
    if exe_dir.file_name().is_some_and(|n| n == "deps")
        && let Some(parent) = exe_dir.parent()
    {
        dirs.push(parent.to_path_buf());
    }
    dirs.push(exe_dir.join("../lib/tessera-sim"));
    dirs
}

/// What [`install`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Installed {
    /// Artifacts found in none of the directories, by their built name.
    pub missing: Vec<&'static str>,
}

static WARNED: AtomicBool = AtomicBool::new(false);

impl Installed {
    /// Logs the missing artifacts, once per process (unit tests run without the cdylibs; one line says
    /// so without repeating it for every simulated node).
    pub fn warn_once_if_incomplete(&self, dirs: &[PathBuf]) {
        if !self.missing.is_empty() && !WARNED.swap(true, Ordering::Relaxed) {
            warn!(
                missing = ?self.missing,
                searched = %display_dirs(dirs),
                "the simulated driver root lacks built artifacts; run `cargo build --workspace` to get them"
            );
        }
    }

    /// Fails naming the missing artifacts and the fix, for callers that need a whole root.
    pub fn require_complete(self, dirs: &[PathBuf]) -> Result<()> {
        if self.missing.is_empty() {
            return Ok(());
        }
        Err(GpuError::SimulatedState {
            path: display_dirs(dirs),
            reason: format!(
                "the simulated driver root needs {}, which are not built there; run `cargo build --workspace` \
                 (or set {ARTIFACTS_ENV} to the directory that holds them)",
                self.missing.join(", ")
            ),
        })
    }
}

fn display_dirs(dirs: &[PathBuf]) -> String {
    dirs.iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Installs the driver root `root` over the simulated kernel `kernel_dir` from the first of `dirs` that
/// holds each artifact: copies what is found, reports what is not, and points `root/tessera-sim` at the
/// kernel (a relative link when the root lies in the kernel directory, so the pair can move together).
pub fn install(root: &Path, kernel_dir: &Path, dirs: &[PathBuf]) -> Result<Installed> {
    install_as(root, kernel_dir, dirs, Files::LinkedWherePossible, Layout::Host)
}

/// Like [`install`], in the given [`Layout`].
pub fn install_layout(root: &Path, kernel_dir: &Path, dirs: &[PathBuf], layout: Layout) -> Result<Installed> {
    install_as(root, kernel_dir, dirs, Files::LinkedWherePossible, layout)
}

/// Like [`install`] with every file a copy of its own, never a hard link to the artifact. The dynamic
/// loader maps a file (an inode) once per process, so two driver roots that one process loads NVML from
/// (tests running in parallel) must not share an inode, or they share one library instance and its kernel.
pub fn install_copied(root: &Path, kernel_dir: &Path, dirs: &[PathBuf]) -> Result<Installed> {
    install_as(root, kernel_dir, dirs, Files::Copied, Layout::Host)
}

/// How the artifacts become files of the driver root.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Files {
    LinkedWherePossible,
    Copied,
}

fn install_as(
    root: &Path,
    kernel_dir: &Path,
    dirs: &[PathBuf],
    files: Files,
    layout: Layout,
) -> Result<Installed> {
    let err = |path: &Path, e: std::io::Error| GpuError::SimulatedState {
        path: path.display().to_string(),
        reason: format!("cannot install the simulated driver root: {e}"),
    };
    let mut installed = Installed::default();
    for artifact in ARTIFACTS {
        let Some(source) = dirs.iter().map(|d| d.join(artifact.built)).find(|p| p.is_file()) else {
            installed.missing.push(artifact.built);
            continue;
        };
        let dest = root.join(artifact.installed_name_in(layout));
        copy_if_changed(&source, &dest, files).map_err(|e| err(&dest, e))?;
        if let (Some(soname), Some(file)) = (artifact.soname, dest.file_name()) {
            let link = root.join(layout.library_dir()).join(soname);
            replace_symlink(Path::new(file), &link).map_err(|e| err(&link, e))?;
        }
    }
    if layout == Layout::Operator {
        // A decoy needs a shared object that is no glibc: the simulated libcuda (present when the root is
        // complete; `require_complete` reports it otherwise).
        if let Some(decoy) = dirs.iter().map(|d| d.join("libcuda.so")).find(|p| p.is_file()) {
            for name in DECOYS {
                let dest = root.join(name);
                copy_if_changed(&decoy, &dest, Files::Copied).map_err(|e| err(&dest, e))?;
            }
        }
        for dir in ["usr/lib", "usr/lib64", "usr/sbin", "etc"] {
            fs::create_dir_all(root.join(dir)).map_err(|e| err(&root.join(dir), e))?;
        }
        for (link, target) in MERGED_USR {
            replace_symlink(Path::new(target), &root.join(link)).map_err(|e| err(&root.join(link), e))?;
        }
        let release = root.join("etc/os-release");
        fs::write(
            &release,
            "NAME=\"tessera simulated driver container\"\nID=ubuntu\nVERSION_ID=\"24.04\"\n",
        )
        .map_err(|e| err(&release, e))?;
    }
    // The libraries just installed are SIMULATED_DRIVER_VERSION's, and so is the module (again, after an
    // `upgrade`).
    set_kernel_version(kernel_dir, SIMULATED_DRIVER_VERSION)?;
    let link = root.join(KERNEL_DIR_NAME);
    let kernel_abs = fs::canonicalize(kernel_dir).map_err(|e| err(kernel_dir, e))?;
    let root_abs = fs::canonicalize(root).or_else(|_| {
        fs::create_dir_all(root)?;
        fs::canonicalize(root)
    });
    let root_abs = root_abs.map_err(|e| err(root, e))?;
    if root_abs.join(KERNEL_DIR_NAME) != kernel_abs {
        let target = if root_abs.parent() == Some(kernel_abs.as_path()) {
            PathBuf::from("..")
        } else {
            kernel_abs
        };
        replace_symlink(&target, &link).map_err(|e| err(&link, e))?;
    }
    Ok(installed)
}

/// Makes the simulated kernel `kernel_dir` report driver `version` (`proc/driver/nvidia/version`), as
/// loading another kernel module does. Left alone when it already does.
pub fn set_kernel_version(kernel_dir: &Path, version: &str) -> Result<()> {
    let file = kernel_dir.join("proc").join(KERNEL_VERSION_FILE);
    let text = kernel_version_text(version);
    if fs::read_to_string(&file).ok().as_deref() == Some(text.as_str()) {
        return Ok(());
    }
    let write = || -> std::io::Result<()> {
        let dir = file.parent().unwrap_or(Path::new("."));
        fs::create_dir_all(dir)?;
        let tmp = dir.join(format!(".version.{}.tmp", std::process::id()));
        fs::write(&tmp, &text)?;
        fs::rename(&tmp, &file)
    };
    write().map_err(|e| GpuError::SimulatedState {
        path: file.display().to_string(),
        reason: format!("cannot write the simulated kernel module's version: {e}"),
    })
}

/// What [`upgrade`] replaced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upgraded {
    /// The version the soname links pointed at before (`None`: a link's target named no version).
    pub from: Option<String>,
    /// Library files of other versions that were removed.
    pub removed: Vec<PathBuf>,
}

/// Upgrades the simulated driver root `root` in place to driver `version`, as a driver container or a
/// package upgrade does: each library gets a new file `<lib>.so.<version>` (a copy of the one its soname
/// link leads to, so a new inode: a process or container that has the old one mapped or bind mounted keeps
/// it), its soname link is repointed by rename, the other versions' files are removed, and then the
/// simulated kernel module behind `root/tessera-sim` reports `version`. Libraries first: a plugin that
/// reads the root in between sees sources that disagree and waits (`driver_watch`).
///
/// Refused, with nothing changed, while a process holds an NVML session of the simulated kernel: the old
/// module must be unloaded first, and the kernel refuses `delete_module` for a module whose reference count
/// is not 0 (`rmmod`: "Module nvidia is in use"); every process with a `/dev/nvidia*` file open counts.
/// NVIDIA's driver manager unloads it so before a new driver goes in and stops when it cannot
/// (`NVIDIA/k8s-driver-manager`, `cmd/driver-manager/main.go`, `unloadDriver`: "Could not unload NVIDIA
/// driver kernel modules, driver is in use").
pub fn upgrade(root: &Path, version: &str) -> Result<Upgraded> {
    if tessera_gpu_api::driver_version::version_in_name(Path::new(&format!("x.so.{version}")), "x").is_none()
    {
        return Err(GpuError::InvalidArgument(format!(
            "--version {version:?} is not a driver version such as 580.159.03 (digits and dots)"
        )));
    }
    if let Ok(kernel) = fs::canonicalize(root.join(KERNEL_DIR_NAME)) {
        let holders = crate::sessions::live_sessions(&kernel);
        if !holders.is_empty() {
            let names: Vec<String> = holders
                .iter()
                .map(|h| format!("{} (pid {})", h.name, h.pid))
                .collect();
            return Err(GpuError::SimulatedState {
                path: kernel.display().to_string(),
                reason: format!(
                    "rmmod nvidia: Module nvidia is in use: the old kernel module cannot be unloaded while \
                     {} hold NVML sessions of it; stop them (or let them release the driver) first",
                    names.join(", ")
                ),
            });
        }
    }
    let lib_dir = root.join(LIBRARY_DIR);
    let err = |path: &Path, e: std::io::Error| GpuError::SimulatedState {
        path: path.display().to_string(),
        reason: format!("cannot upgrade the simulated driver root: {e}"),
    };
    let mut from = None;
    let mut removed = Vec::new();
    let mut upgraded = 0;
    for artifact in ARTIFACTS {
        let Some(soname) = artifact.soname else {
            continue;
        };
        let stem = artifact.installed.trim_end_matches(".so");
        let link = lib_dir.join(soname);
        let current = match fs::read_link(&link) {
            Ok(target) => lib_dir.join(target),
            // A root made before this library was part of the driver (the JIT libraries) upgrades the
            // libraries it has; a root with none of them is no driver root (below).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && upgraded > 0 => continue,
            Err(e) => {
                return Err(GpuError::SimulatedState {
                    path: link.display().to_string(),
                    reason: format!(
                        "no soname link to upgrade ({e}); make the root with `tessera-kubelet-plugin simulate driver-root` first"
                    ),
                });
            }
        };
        upgraded += 1;
        if from.is_none() {
            from = tessera_gpu_api::driver_version::version_in_name(&current, stem);
        }
        let name = format!("{}.{version}", artifact.installed);
        let new = lib_dir.join(&name);
        if current != new {
            copy_if_changed(&current, &new, Files::Copied).map_err(|e| err(&new, e))?;
        }
        replace_symlink(Path::new(&name), &link).map_err(|e| err(&link, e))?;
        for entry in fs::read_dir(&lib_dir).map_err(|e| err(&lib_dir, e))?.flatten() {
            let path = entry.path();
            let other = tessera_gpu_api::driver_version::version_in_name(&path, stem);
            if other.is_some_and(|v| v != version) && entry.file_type().is_ok_and(|t| t.is_file()) {
                fs::remove_file(&path).map_err(|e| err(&path, e))?;
                removed.push(path);
            }
        }
    }
    let kernel =
        fs::canonicalize(root.join(KERNEL_DIR_NAME)).map_err(|e| err(&root.join(KERNEL_DIR_NAME), e))?;
    set_kernel_version(&kernel, version)?;
    removed.sort();
    Ok(Upgraded { from, removed })
}

/// Copies `source` to `dest` through a temporary file renamed over it, unless `dest` already has
/// `source`'s size and modification time (which the copy takes over).
fn copy_if_changed(source: &Path, dest: &Path, files: Files) -> std::io::Result<()> {
    let src_meta = fs::metadata(source)?;
    if let Ok(dest_meta) = fs::symlink_metadata(dest)
        && dest_meta.is_file()
        && dest_meta.len() == src_meta.len()
        && dest_meta.modified().ok() == src_meta.modified().ok()
    {
        return Ok(());
    }
    let dir = dest.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    let name = dest.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = fs::remove_file(&tmp);
    // A hard link where the artifact is on the same file system (the local cluster's stand-in nodes,
    // tests): a debug build's seven files are about 80 MB, and a node each would be a copy each. It is
    // still a file of its own path, not a link into target/: cargo replaces a rebuilt artifact by a new
    // file, so this one keeps the version it was linked to, as a copy would. Across file systems (the
    // chart's plugin pod installing from its image onto a host directory), a copy.
    if files == Files::Copied || fs::hard_link(source, &tmp).is_err() {
        fs::copy(source, &tmp)?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))?;
        File::options()
            .write(true)
            .open(&tmp)?
            .set_modified(src_meta.modified()?)?;
    }
    fs::rename(&tmp, dest)
}

/// Points `link` at `target`, replacing whatever is there by rename (never a moment without the link).
fn replace_symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    if fs::read_link(link).ok().as_deref() == Some(target) {
        return Ok(());
    }
    let dir = link.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    let name = link.file_name().and_then(|n| n.to_str()).unwrap_or("link");
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)?;
    fs::rename(&tmp, link)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifacts_in(dir: &Path, names: &[&str]) {
        for n in names {
            fs::write(dir.join(n), format!("built {n}")).unwrap();
        }
    }

    #[test]
    fn the_root_gets_versioned_libraries_with_soname_links_and_a_link_to_the_kernel() {
        let built = tempfile::tempdir().unwrap();
        artifacts_in(built.path(), &["libnvidia_ml.so", "libcuda.so", "nvidia-smi"]);
        let kernel = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        let r = root.path().join("R");
        let done = install(&r, kernel.path(), &[built.path().to_path_buf()]).unwrap();
        assert_eq!(
            done.missing,
            [
                "libnvidia_ptxjitcompiler.so",
                "libnvidia_nvvm.so",
                "nvidia-cuda-mps-control",
                "nvidia-cuda-mps-server"
            ]
        );
        let lib = r.join(LIBRARY_DIR);
        assert_eq!(
            fs::read_to_string(lib.join("libnvidia-ml.so.1")).unwrap(),
            "built libnvidia_ml.so"
        );
        assert_eq!(
            fs::read_link(lib.join("libcuda.so.1")).unwrap(),
            Path::new(&format!("libcuda.so.{SIMULATED_DRIVER_VERSION}"))
        );
        assert!(
            !fs::symlink_metadata(lib.join(format!("libcuda.so.{SIMULATED_DRIVER_VERSION}")))
                .unwrap()
                .file_type()
                .is_symlink(),
            "a copy, not a link into target/"
        );
        assert_eq!(
            fs::canonicalize(r.join(KERNEL_DIR_NAME)).unwrap(),
            fs::canonicalize(kernel.path()).unwrap()
        );
        let e = done
            .require_complete(&[built.path().to_path_buf()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("nvidia-cuda-mps-control") && e.contains("cargo build --workspace"),
            "{e}"
        );
    }

    #[test]
    fn the_operator_layout_is_a_distro_rootfs_with_decoys_and_the_gke_layout_has_no_usr() {
        let built = tempfile::tempdir().unwrap();
        artifacts_in(
            built.path(),
            &[
                "libnvidia_ml.so",
                "libcuda.so",
                "libnvidia_ptxjitcompiler.so",
                "libnvidia_nvvm.so",
                "nvidia-smi",
                "nvidia-cuda-mps-control",
                "nvidia-cuda-mps-server",
            ],
        );
        let kernel = tempfile::tempdir().unwrap();
        let roots = tempfile::tempdir().unwrap();
        let dirs = [built.path().to_path_buf()];
        let op = roots.path().join("operator");
        install_layout(&op, kernel.path(), &dirs, Layout::Operator)
            .unwrap()
            .require_complete(&dirs)
            .unwrap();
        for decoy in DECOYS {
            assert_eq!(
                fs::read_to_string(op.join(decoy)).unwrap(),
                "built libcuda.so",
                "{decoy}"
            );
        }
        assert_eq!(fs::read_link(op.join("lib64")).unwrap(), Path::new("usr/lib64"));
        assert!(op.join("bin/nvidia-smi").is_file(), "bin -> usr/bin");
        assert!(op.join(format!("{LIBRARY_DIR}/libcuda.so.1")).is_file());
        let gke = roots.path().join("gke");
        install_layout(&gke, kernel.path(), &dirs, Layout::Gke)
            .unwrap()
            .require_complete(&dirs)
            .unwrap();
        assert_eq!(
            fs::read_link(gke.join("lib64/libnvidia-ml.so.1")).unwrap(),
            Path::new(&format!("libnvidia-ml.so.{SIMULATED_DRIVER_VERSION}"))
        );
        assert!(gke.join("bin/nvidia-cuda-mps-control").is_file());
        assert_eq!(
            fs::read_link(gke.join("lib64/libnvidia-nvvm.so.4")).unwrap(),
            Path::new(&format!("libnvidia-nvvm.so.{SIMULATED_DRIVER_VERSION}")),
            "NVIDIA's NVVM soname is .so.4"
        );
        assert_eq!(
            fs::read_to_string(gke.join("lib64/libnvidia-ptxjitcompiler.so.1")).unwrap(),
            "built libnvidia_ptxjitcompiler.so"
        );
        let top: Vec<String> = fs::read_dir(&gke)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        assert_eq!(top, ["bin", "lib64", KERNEL_DIR_NAME]);
    }

    #[test]
    fn a_reinstall_replaces_a_changed_file_by_rename_so_a_mapped_copy_survives() {
        let built = tempfile::tempdir().unwrap();
        artifacts_in(built.path(), &["libnvidia_ml.so"]);
        let kernel = tempfile::tempdir().unwrap();
        let r = kernel.path().join("driver-root");
        let dirs = [built.path().to_path_buf()];
        install(&r, kernel.path(), &dirs).unwrap();
        let installed = r.join(ARTIFACTS[0].installed_name());
        let held = File::open(&installed).unwrap();
        let old_inode = std::os::unix::fs::MetadataExt::ino(&held.metadata().unwrap());
        install(&r, kernel.path(), &dirs).unwrap();
        assert_eq!(
            std::os::unix::fs::MetadataExt::ino(&fs::metadata(&installed).unwrap()),
            old_inode,
            "an unchanged artifact is not copied again"
        );
        // Replaced as cargo replaces a rebuilt artifact: a new file under the same name.
        fs::write(built.path().join("rebuilt.tmp"), "rebuilt, longer").unwrap();
        fs::rename(
            built.path().join("rebuilt.tmp"),
            built.path().join("libnvidia_ml.so"),
        )
        .unwrap();
        install(&r, kernel.path(), &dirs).unwrap();
        assert_eq!(fs::read_to_string(&installed).unwrap(), "rebuilt, longer");
        assert_eq!(
            std::io::read_to_string(&held).unwrap(),
            "built libnvidia_ml.so",
            "the open file is the old one"
        );
        assert_eq!(
            fs::read_link(r.join(KERNEL_DIR_NAME)).unwrap(),
            Path::new(".."),
            "a root inside its kernel links to it relatively"
        );
    }

    #[test]
    fn an_upgrade_is_refused_while_an_nvml_session_holds_the_module_and_changes_nothing() {
        let built = tempfile::tempdir().unwrap();
        artifacts_in(built.path(), &["libnvidia_ml.so", "libcuda.so"]);
        let kernel = tempfile::tempdir().unwrap();
        let r = kernel.path().join("driver-root");
        install(&r, kernel.path(), &[built.path().to_path_buf()]).unwrap();
        let session = crate::sessions::Session::open(kernel.path(), &[0]).unwrap();
        let e = upgrade(&r, "580.200.01").unwrap_err().to_string();
        assert!(e.contains("Module nvidia is in use"), "{e}");
        assert_eq!(
            crate::kernel::kernel_driver_version(kernel.path()).as_deref(),
            Some(SIMULATED_DRIVER_VERSION)
        );
        assert_eq!(
            fs::read_link(r.join(LIBRARY_DIR).join("libcuda.so.1")).unwrap(),
            Path::new(&format!("libcuda.so.{SIMULATED_DRIVER_VERSION}")),
            "the libraries are left alone too"
        );
        drop(session);
        upgrade(&r, "580.200.01").unwrap();
    }

    #[test]
    fn an_upgrade_in_place_repoints_the_sonames_at_new_files_and_changes_the_kernels_version() {
        use std::os::unix::fs::MetadataExt;
        let built = tempfile::tempdir().unwrap();
        artifacts_in(built.path(), &["libnvidia_ml.so", "libcuda.so"]);
        let kernel = tempfile::tempdir().unwrap();
        let r = kernel.path().join("driver-root");
        install(&r, kernel.path(), &[built.path().to_path_buf()]).unwrap();
        let lib = r.join(LIBRARY_DIR);
        let old = lib.join(format!("libcuda.so.{SIMULATED_DRIVER_VERSION}"));
        let held = File::open(&old).unwrap();
        let version = || crate::kernel::kernel_driver_version(kernel.path());
        assert_eq!(version().as_deref(), Some(SIMULATED_DRIVER_VERSION));

        let done = upgrade(&r, "580.200.01").unwrap();
        assert_eq!(done.from.as_deref(), Some(SIMULATED_DRIVER_VERSION));
        assert_eq!(done.removed.len(), 2, "{:?}", done.removed);
        assert_eq!(
            fs::read_link(lib.join("libcuda.so.1")).unwrap(),
            Path::new("libcuda.so.580.200.01")
        );
        assert!(!old.exists(), "the old version's file is gone from the root");
        let new_ino = fs::metadata(lib.join("libcuda.so.580.200.01")).unwrap().ino();
        assert_ne!(
            new_ino,
            held.metadata().unwrap().ino(),
            "a new file, not the old one renamed"
        );
        assert_eq!(
            std::io::read_to_string(&held).unwrap(),
            "built libcuda.so",
            "the open file still reads"
        );
        assert_eq!(version().as_deref(), Some("580.200.01"));

        // Back again, and a reinstall puts the built version back in the kernel too.
        upgrade(&r, SIMULATED_DRIVER_VERSION).unwrap();
        assert_eq!(version().as_deref(), Some(SIMULATED_DRIVER_VERSION));
        upgrade(&r, "580.200.01").unwrap();
        install(&r, kernel.path(), &[built.path().to_path_buf()]).unwrap();
        assert_eq!(version().as_deref(), Some(SIMULATED_DRIVER_VERSION));

        let e = upgrade(&r, "latest").unwrap_err().to_string();
        assert!(e.contains("--version") && e.contains("latest"), "{e}");
    }
}
