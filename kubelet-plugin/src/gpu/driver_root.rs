//! The NVIDIA driver's user-space files under a driver root, and the CDI edits that hand them to a container.
//!
//! A container with `/dev/nvidia0` but without `libcuda.so.1` cannot run CUDA, and the container runtime
//! adds nothing by itself (NVIDIA's runtime ignores `NVIDIA_VISIBLE_DEVICES` for unprivileged pods in its
//! default configuration). So every tessera device carries, like the specs `nvidia-ctk cdi generate` writes:
//!
//! * read-only bind mounts of the driver's libraries (the versioned file and its soname link, both as
//!   regular files: the runtime resolves the host's symlink) and binaries (`nvidia-smi`, …);
//! * the libraries at the host's library path with the driver root stripped (`/usr/lib/x86_64-linux-gnu`,
//!   `/usr/lib64`, …), or under `/usr/local/nvidia/lib64` (GKE, flat layouts); every `*.so.<driver
//!   version>` file of the driver's library directories is mounted, as NVIDIA's toolkit does, not only the
//!   [`LIBRARIES`] it always looks for;
//! * three `createContainer` hooks of tessera's own hook binary (`kubelet-plugin/cdi-hook`, installed on the
//!   host at start, [`CdiHook`]), in the order NVIDIA's `nvcdi` emits them: `create-symlinks` (`libcuda.so
//!   -> libcuda.so.1` and the other [`DEV_LINKS`]), `enable-cuda-compat` (the image's newer CUDA compat
//!   driver first) and `update-ldcache` (the library directories in the container's `/etc/ld.so.cache`), so
//!   the image's own loader finds the driver through its cache whatever it searches by default. With
//!   `--cdi-hook` NVIDIA's `nvidia-cdi-hook` runs instead, with the same subcommands and arguments.
//!
//! This module only finds files (it is used by the NVML backend too); [`crate::node::edits::driver_edits`] turns
//! them into CDI edits.
//!
//! **Two paths of one root.** The plugin reads the driver where its own filesystem has it (`--container-driver-root`,
//! `/driver-root` in the chart), while a CDI spec is read by the container runtime on the host, so every
//! `hostPath` names the host's path of the same file (`--driver-root`): `host + (file − container root)`
//! ([`DriverRoot::to_host`]). The two are equal for a plugin on the host. Symlinks inside the root (the
//! soname links, an Operator rootfs's `lib64 -> /usr/lib64`) are resolved inside the root
//! ([`DriverRoot::resolve`]), an absolute target taken from the root as the driver's own filesystem sees it:
//! resolved in the plugin's filesystem, `/usr/lib/x86_64-linux-gnu/libcuda.so.580…` would name the plugin
//! image's file (or none), and resolved by the runtime on the host, the host's.
//!
//! Driver-root layouts searched ([`LIBRARY_DIRS`], [`BINARY_DIRS`]): distribution packages (`/` or
//! `/run/nvidia/driver` of the GPU Operator) with `usr/lib/x86_64-linux-gnu`, `usr/lib64`,
//! `usr/lib/aarch64-linux-gnu`, `lib64`, `lib/x86_64-linux-gnu`, `lib/aarch64-linux-gnu`, `usr/lib`, `lib`;
//! GKE's `/home/kubernetes/bin/nvidia` with `lib64` and `bin`; a flat directory holding the libraries itself.
//!
//! **Simulated drivers.** A driver root built by this repository (tessera's own `libcuda.so.1`,
//! `libnvidia-ml.so.1`, `nvidia-smi` and MPS tools over a simulated kernel) is recognised by
//! `R/tessera-sim/kernel.json` ([`SIMULATED_KERNEL_DIR`]). This is the one place the plugin knows a driver
//! is simulated: such a root's files are found and mounted like any other, and its common edits add one
//! read-only bind mount of `R/tessera-sim` at `/tessera-sim` in the container ([`DriverFiles::simulated_kernel`]),
//! where the simulated libraries find the hardware state (a real driver's libraries reach the kernel module
//! through `/dev/nvidiactl` instead). Nothing else in the plugin branches on it.

use std::{
    fs,
    path::{Path, PathBuf},
};

/// Library directories under a driver root, most specific first; the root itself is tried last.
pub const LIBRARY_DIRS: [&str; 8] = [
    "usr/lib/x86_64-linux-gnu",
    "usr/lib64",
    "usr/lib/aarch64-linux-gnu",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "usr/lib",
    "lib",
];

/// Binary directories under a driver root; the root itself is tried last.
pub const BINARY_DIRS: [&str; 5] = ["usr/bin", "bin", "usr/sbin", "sbin", "opt/bin"];

/// GKE installs the driver here (COS and Ubuntu node images) with `lib64/` and `bin/`.
pub const GKE_DRIVER_ROOT: &str = "/home/kubernetes/bin/nvidia";

/// Where libraries of non-standard layouts go in the container (NVIDIA's CUDA images have it in
/// `LD_LIBRARY_PATH`, and GKE's device plugin uses the same place).
pub const FALLBACK_LIBRARY_DIR: &str = "/usr/local/nvidia/lib64";
/// Where binaries of non-standard layouts go in the container.
pub const FALLBACK_BINARY_DIR: &str = "/usr/local/nvidia/bin";

/// The driver libraries a compute, video or management workload may load (the utility, compute and video
/// sets of NVIDIA's container toolkit; graphics libraries are not handed out). Each is looked for as
/// `<name>.so.<driver version>` with the soname links that point at it.
pub const LIBRARIES: [&str; 18] = [
    "libcuda",
    "libcudadebugger",
    "libnvidia-ml",
    "libnvidia-cfg",
    "libnvidia-nscq",
    "libnvidia-ptxjitcompiler",
    "libnvidia-nvvm",
    "libnvidia-gpucomp",
    "libnvidia-allocator",
    "libnvidia-opencl",
    "libnvidia-pkcs11",
    "libnvidia-pkcs11-openssl3",
    "libnvidia-fatbinaryloader",
    "libnvidia-compiler",
    "libnvidia-encode",
    "libnvidia-opticalflow",
    "libnvcuvid",
    "libvdpau_nvidia",
];

/// Driver libraries whose file name carries no driver version, mounted by name pattern (`<prefix>*`):
/// `libnvidia-nvvm70.so.4`, the older NVVM compiler that current drivers ship beside
/// `libnvidia-nvvm.so.<version>` and that CUDA processes load at JIT time beside the PTX JIT compiler.
/// NVIDIA's CDI generator mounts it on its own for that reason (nvidia-container-toolkit
/// `pkg/nvcdi/driver-nvml.go` `getLegacyNVVMLibraryMounts`, `libnvidia-nvvm70.so.*`): the
/// `*.so.<driver version>` rule does not match it.
pub const UNVERSIONED_LIBRARIES: [&str; 1] = ["libnvidia-nvvm70.so."];

/// Libraries that get an unversioned development link in the container (`libcuda.so -> libcuda.so.1`):
/// programs that `dlopen("libcuda.so")` or link `-lcuda` at run time (Triton, `torch.compile`, vLLM) need it,
/// and NVIDIA's `nvcdi` creates the same ones.
pub const DEV_LINKS: [&str; 5] = [
    "libcuda",
    "libnvidia-ml",
    "libnvidia-opticalflow",
    "libnvidia-encode",
    "libnvcuvid",
];

/// Driver binaries handed to containers.
pub const BINARIES: [&str; 5] = [
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
];

/// Mount options of every driver file: read-only, no setuid, no device nodes, private propagation (as
/// nvcdi writes them).
pub const MOUNT_OPTIONS: [&str; 5] = ["ro", "nosuid", "nodev", "rbind", "rprivate"];

/// The simulated kernel's directory under a simulated driver root, and its container path (`/tessera-sim`).
pub const SIMULATED_KERNEL_DIR: &str = "tessera-sim";
/// The file that marks [`SIMULATED_KERNEL_DIR`] as a simulated kernel.
pub const SIMULATED_KERNEL_FILE: &str = "kernel.json";
/// Where a container sees the simulated kernel (the simulated libraries look for it there).
pub const SIMULATED_KERNEL_CONTAINER_PATH: &str = "/tessera-sim";

/// A driver installation: where this process reads it, and where the host (which CDI specs speak for) has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverRoot {
    /// The root as this process sees it: every file is looked for and opened here.
    root: PathBuf,
    /// The same root on the host: what CDI specs name.
    host: PathBuf,
}

impl DriverRoot {
    /// A root this process sees at its host path (a plugin on the host, or a container that mounts it there).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let root = root.into();
        Self {
            host: root.clone(),
            root,
        }
    }

    /// The host's driver root `host`, seen by this process at `container` (the chart mounts it at
    /// `/driver-root`).
    pub fn mounted(host: impl Into<PathBuf>, container: impl Into<PathBuf>) -> Self {
        Self {
            root: container.into(),
            host: host.into(),
        }
    }

    /// Where this process reads the root.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// Where the host has the root.
    pub fn host_path(&self) -> &Path {
        &self.host
    }

    /// The host's path of `file`, a path under [`Self::path`]: `host + (file − root)`; `None` outside the root.
    pub fn to_host(&self, file: &Path) -> Option<PathBuf> {
        let rel = file.strip_prefix(&self.root).ok()?;
        Some(if rel.as_os_str().is_empty() {
            self.host.clone()
        } else {
            self.host.join(rel)
        })
    }

    /// `path` (under [`Self::path`]) with every symlink in it followed inside the root: an absolute target
    /// starts again at the root and `..` stops at it, as a process chrooted into the driver's filesystem
    /// sees it. `None` when a component does not exist or the links loop.
    pub fn resolve(&self, path: &Path) -> Option<PathBuf> {
        let rel = path.strip_prefix(&self.root).ok()?;
        tessera_cdi_hook::resolve_existing_in(&self.root, rel)
    }

    /// The root's library directories that exist, in search order (GKE's `lib64` is in the list).
    pub fn library_dirs(&self) -> Vec<PathBuf> {
        self.existing_dirs(&LIBRARY_DIRS)
    }

    /// The root's binary directories that exist, in search order.
    pub fn binary_dirs(&self) -> Vec<PathBuf> {
        self.existing_dirs(&BINARY_DIRS)
    }

    /// `dirs` under the root, then the root, that are directories once resolved inside the root.
    fn existing_dirs(&self, dirs: &[&str]) -> Vec<PathBuf> {
        dirs.iter()
            .map(|d| self.root.join(d))
            .chain(std::iter::once(self.root.clone()))
            .filter(|d| self.resolve(d).is_some_and(|r| r.is_dir()))
            .collect()
    }

    /// Every path a library file name is looked for at, in order (for error messages and NVML loading).
    pub fn library_candidates(&self, file: &str) -> Vec<PathBuf> {
        candidates(&self.root, &LIBRARY_DIRS, file)
    }

    /// Every path a binary is looked for at, in order.
    pub fn binary_candidates(&self, name: &str) -> Vec<PathBuf> {
        candidates(&self.root, &BINARY_DIRS, name)
    }

    /// The first existing library file named `file` (e.g. `libnvidia-ml.so.1`), as its directory names it;
    /// [`Self::resolve`] gives the file to open.
    pub fn find_library(&self, file: &str) -> Option<PathBuf> {
        self.library_candidates(file)
            .into_iter()
            .find(|p| self.resolve(p).is_some_and(|r| r.exists()))
    }

    /// The first binary named `name`, as its directory names it (the workload's container path comes from
    /// it); [`Self::resolve`] gives the file to run.
    pub fn find_binary(&self, name: &str) -> Option<PathBuf> {
        self.binary_candidates(name)
            .into_iter()
            .find(|p| self.resolve(p).is_some_and(|r| r.is_file()))
    }

    /// `R/tessera-sim` when this root is a simulated driver built by tessera (it holds `kernel.json`). Read
    /// in this process's filesystem: the link leads out of the root to the simulated kernel, which the chart's
    /// plugin pod mounts at its host path.
    pub fn simulated_kernel(&self) -> Option<PathBuf> {
        let dir = self.root.join(SIMULATED_KERNEL_DIR);
        dir.join(SIMULATED_KERNEL_FILE).is_file().then_some(dir)
    }

    /// `PATH` for a process that runs the driver's binaries (the MPS daemon): the root's binary
    /// directories, then the usual system ones.
    pub fn path_env(&self) -> String {
        let mut dirs: Vec<String> = self
            .binary_dirs()
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        for d in [
            "/usr/local/sbin",
            "/usr/local/bin",
            "/usr/sbin",
            "/usr/bin",
            "/sbin",
            "/bin",
        ] {
            if !dirs.iter().any(|x| x == d) {
                dirs.push(d.to_string());
            }
        }
        dirs.join(":")
    }

    /// The driver's own libraries under this root and nothing else of its library directories: every
    /// `<lib>.so`, `<lib>.so.<N>` soname link and `<lib>.so.<driver version>` file of a [`LIBRARIES`]
    /// name, by file name, with the regular file it resolves to inside the root ([`Self::resolve`], so an
    /// absolute soname link of an Operator rootfs is followed there, not in this process's root). The
    /// first library directory holding a name wins; sorted by name. A distro rootfs's `libc.so.6`, `libm`,
    /// loader … are never listed: this is what the MPS daemon's private library directory links to
    /// (`sharing/mps.rs`).
    pub fn driver_libraries(&self) -> Vec<(String, PathBuf)> {
        let mut found: Vec<(String, PathBuf)> = Vec::new();
        for dir in self.library_dirs() {
            // Listed where the root has it: `lib64 -> /usr/lib64` means the rootfs's /usr/lib64.
            let Some(listed) = self.resolve(&dir) else {
                continue;
            };
            let Ok(entries) = fs::read_dir(&listed) else {
                continue;
            };
            for entry in entries.filter_map(|e| e.ok()) {
                let Ok(name) = entry.file_name().into_string() else {
                    continue;
                };
                if !is_driver_library(&name) || found.iter().any(|(n, _)| *n == name) {
                    continue;
                }
                if let Some(file) = self.resolve(&dir.join(&name)).filter(|f| f.is_file()) {
                    found.push((name, file));
                }
            }
        }
        found.sort();
        found
    }

    /// `LD_LIBRARY_PATH` for a process that loads the driver's libraries from this root: every library
    /// directory, so on a distro rootfs (the GPU Operator's) its libc too. Never give it to a process of
    /// this image (see [`Self::driver_libraries`]).
    pub fn ld_library_path(&self) -> String {
        self.library_dirs()
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(":")
    }

    /// Where a file of this root (as this process sees it) appears in the workload's container: the same
    /// path without the driver root when its directory is a standard one, else (and for GKE's layout, at
    /// its path or with its shape: `lib64/` and no `usr/`) the `/usr/local/nvidia` fallback.
    fn container_path(&self, file: &Path, library: bool) -> Option<String> {
        let rel = file.strip_prefix(&self.root).ok()?;
        let dir = rel
            .parent()
            .map(|p| p.to_string_lossy().to_string())
            .unwrap_or_default();
        let name = rel.file_name()?.to_string_lossy().to_string();
        let standard: &[&str] = if library { &LIBRARY_DIRS } else { &BINARY_DIRS };
        // GKE's layout is known by its host path (the plugin may see it at `/driver-root`) or by its shape
        // wherever it lies: `lib64/` without `usr/`, no distribution root, so nothing of it belongs in the
        // image's own /lib64.
        let is_gke = self.host == Path::new(GKE_DRIVER_ROOT)
            || (self.root.join("lib64").is_dir() && !self.root.join("usr").exists());
        if !is_gke && standard.contains(&dir.as_str()) {
            return Some(format!("/{dir}/{name}"));
        }
        let fallback = if library {
            FALLBACK_LIBRARY_DIR
        } else {
            FALLBACK_BINARY_DIR
        };
        Some(format!("{fallback}/{name}"))
    }
}

/// The files of one library: `<lib>.so.<driver version>` and every soname link next to it that resolves to
/// it (`.so.1` for most, `.so.4` for `libnvidia-nvvm`; read from the directory, not assumed), from the
/// first library directory that holds the versioned file. Without a known version, or when no directory
/// has it, the `<lib>.so.1` link alone. Each comes as (its path, the file it resolves to inside the root):
/// the container gets the first, the spec names the host's path of the second.
fn library_files(root: &DriverRoot, lib: &str, driver_version: Option<&str>) -> Vec<(PathBuf, PathBuf)> {
    let dirs = root.library_dirs();
    let regular = |p: &Path| root.resolve(p).filter(|r| r.is_file());
    if let Some(v) = driver_version {
        let versioned = format!("{lib}.so.{v}");
        if let Some((dir, target)) = dirs
            .iter()
            .find_map(|d| regular(&d.join(&versioned)).map(|t| (d, t)))
        {
            let prefix = format!("{lib}.so.");
            let mut links: Vec<PathBuf> = fs::read_dir(dir)
                .into_iter()
                .flatten()
                .filter_map(|e| e.ok())
                .filter(|e| {
                    let name = e.file_name();
                    let name = name.to_string_lossy();
                    name.starts_with(&prefix)
                        && *name != versioned
                        && e.file_type().is_ok_and(|t| t.is_symlink())
                        && root.resolve(&e.path()).as_ref() == Some(&target)
                })
                .map(|e| e.path())
                .collect();
            links.sort();
            let mut files = vec![(dir.join(&versioned), target.clone())];
            files.extend(links.into_iter().map(|l| (l, target.clone())));
            return files;
        }
    }
    let soname = format!("{lib}.so.1");
    dirs.iter()
        .map(|d| d.join(&soname))
        .find_map(|p| regular(&p).map(|t| (p, t)))
        .into_iter()
        .collect()
}

/// Every file named `<prefix>…` (regular, or a link resolving to one inside the root) in the first library
/// directory that has one, sorted: the files of an [`UNVERSIONED_LIBRARIES`] entry.
fn unversioned_library_files(root: &DriverRoot, prefix: &str) -> Vec<(PathBuf, PathBuf)> {
    for dir in root.library_dirs() {
        let Some(listed) = root.resolve(&dir) else {
            continue;
        };
        let mut files: Vec<(PathBuf, PathBuf)> = fs::read_dir(&listed)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|name| name.starts_with(prefix))
            .filter_map(|name| {
                let named = dir.join(&name);
                let file = root.resolve(&named).filter(|f| f.is_file())?;
                Some((named, file))
            })
            .collect();
        if !files.is_empty() {
            files.sort();
            return files;
        }
    }
    Vec::new()
}

/// Every `<stem>.so.<driver version>` regular file in the directories where the driver's own [`LIBRARIES`]
/// are (the toolkit mounts every file of the driver's version it finds there: graphics, NGX, … libraries
/// tessera does not name), by stem, sorted; those of [`LIBRARIES`] left out (they are looked for anyway).
fn versioned_stems(root: &DriverRoot, version: &str, found: &[(PathBuf, PathBuf)]) -> Vec<String> {
    let suffix = format!(".so.{version}");
    let mut dirs: Vec<PathBuf> = Vec::new();
    for (named, _) in found {
        if let Some(dir) = named.parent().and_then(|d| root.resolve(d))
            && !dirs.contains(&dir)
        {
            dirs.push(dir);
        }
    }
    let mut stems: Vec<String> = dirs
        .iter()
        .filter_map(|d| fs::read_dir(d).ok())
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(&suffix).map(str::to_string))
        .filter(|stem| !stem.is_empty() && !LIBRARIES.contains(&stem.as_str()))
        .collect();
    stems.sort();
    stems.dedup();
    stems
}

/// True for a file name of one of NVIDIA's [`LIBRARIES`]: `<lib>.so` or `<lib>.so.<anything>`.
fn is_driver_library(name: &str) -> bool {
    LIBRARIES.iter().any(|lib| {
        name.strip_prefix(lib)
            .and_then(|rest| rest.strip_prefix(".so"))
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    })
}

fn candidates(root: &Path, dirs: &[&str], file: &str) -> Vec<PathBuf> {
    dirs.iter()
        .map(|d| root.join(d).join(file))
        .chain(std::iter::once(root.join(file)))
        .collect()
}

/// NVIDIA's daemons' sockets every container gets where the daemon runs: nvidia-persistenced's and fabric
/// manager's, found under the driver root's `/run` or `/var/run` as NVIDIA's toolkit finds them
/// (`NVIDIA/nvidia-container-toolkit`, `internal/discover/ipc.go`, `NewIPCDiscoverer`; libnvidia-container's
/// `lookup_ipcs`). A daemon that is not running has no socket and nothing is mounted.
pub const IPC_SOCKETS: [&str; 2] = ["nvidia-persistenced/socket", "nvidia-fabricmanager/socket"];
/// Mount options of a socket: not read-only, since `connect(2)` needs write permission on it
/// (libnvidia-container's `mount_ipc` leaves `MS_RDONLY` out; the toolkit's `ipcMounts` likewise).
pub const IPC_MOUNT_OPTIONS: [&str; 5] = ["nosuid", "nodev", "noexec", "rbind", "rprivate"];
/// The driver's GSP firmware directory under the root, per driver version (`lib/firmware/nvidia/<version>`),
/// whose files NVIDIA's toolkit mounts at the same path (`NewDriverFirmwareDiscoverer`).
pub const FIRMWARE_DIR: &str = "lib/firmware/nvidia";

/// The sockets of [`IPC_SOCKETS`] under `root`, each at the first of `/run`, `/var/run` that has it (links
/// followed inside the root: `var/run` is often one to `/run`), named in the container where it was found.
fn ipc_sockets(root: &DriverRoot) -> Vec<DriverFile> {
    let mut out: Vec<DriverFile> = Vec::new();
    for socket in IPC_SOCKETS {
        let found = ["run", "var/run"].into_iter().find_map(|dir| {
            let named = Path::new(dir).join(socket);
            let resolved = root.resolve(&root.path().join(&named))?;
            Some(DriverFile {
                host_path: root.to_host(&resolved)?,
                container_path: format!("/{}", named.display()),
            })
        });
        out.extend(found);
    }
    out
}

/// The files of `lib/firmware/nvidia/<version>` under `root`, sorted, named in the container at that path.
fn firmware_files(root: &DriverRoot, version: &str) -> Vec<DriverFile> {
    let named_dir = Path::new("/").join(FIRMWARE_DIR).join(version);
    let Some(dir) = root.resolve(&root.path().join(FIRMWARE_DIR).join(version)) else {
        return Vec::new();
    };
    let mut files: Vec<DriverFile> = fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| {
            Some(DriverFile {
                host_path: root.to_host(&e.path())?,
                container_path: named_dir.join(e.file_name()).display().to_string(),
            })
        })
        .collect();
    files.sort_by(|a, b| a.container_path.cmp(&b.container_path));
    files
}

/// One driver file and where the container sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverFile {
    /// The file on the host (what the spec's `hostPath` says; symlinks inside the driver root resolved).
    pub host_path: PathBuf,
    pub container_path: String,
}

/// The hook binary CDI specs run on the host (`createContainer`), and which one it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdiHook {
    /// Its path on the host (the runtime runs it outside the container).
    pub path: PathBuf,
    /// `argv[0]` the specs give it: `tessera-cdi-hook`, or `nvidia-cdi-hook` for NVIDIA's (`--cdi-hook`).
    pub program: String,
    /// The subcommands it has besides `create-symlinks` and `update-ldcache`, which every hook has: the
    /// specs call only these (a hook answers an unknown one with an error, and the container fails).
    pub features: Vec<HookFeature>,
}

/// A subcommand only some hooks have. Every `nvidia-cdi-hook` that writes CDI specs has `create-symlinks`
/// and `update-ldcache`; `enable-cuda-compat` came with the container toolkit 1.17.5 (and after
/// CVE-2025-23266 runs only in a fixed toolkit), `disable-device-node-modification` with 1.17.8.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookFeature {
    EnableCudaCompat,
    DisableDeviceNodeModification,
}

impl HookFeature {
    /// Every feature, as tessera's own hook has them.
    pub const ALL: [HookFeature; 2] = [
        HookFeature::EnableCudaCompat,
        HookFeature::DisableDeviceNodeModification,
    ];

    /// The subcommand's name, which `--cdi-hook-features` takes.
    pub fn name(self) -> &'static str {
        match self {
            HookFeature::EnableCudaCompat => "enable-cuda-compat",
            HookFeature::DisableDeviceNodeModification => "disable-device-node-modification",
        }
    }

    /// A feature by its subcommand's name.
    pub fn parse(name: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|f| f.name() == name).ok_or_else(|| {
            format!(
                "unknown hook subcommand {name:?}: want {}",
                Self::ALL.map(HookFeature::name).join(" or ")
            )
        })
    }
}

impl CdiHook {
    /// tessera's own hook, installed at `path` on the host: it has every feature.
    pub fn tessera(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            program: "tessera-cdi-hook".into(),
            features: HookFeature::ALL.to_vec(),
        }
    }

    /// NVIDIA's `nvidia-cdi-hook` at `path` on the host (same subcommands and arguments), with the optional
    /// subcommands `features` (`--cdi-hook-features`; none assumed, as an older toolkit has none).
    pub fn nvidia(path: impl Into<PathBuf>, features: &[HookFeature]) -> Self {
        Self {
            path: path.into(),
            program: "nvidia-cdi-hook".into(),
            features: features.to_vec(),
        }
    }

    /// Whether the specs may call `feature`.
    pub fn has(&self, feature: HookFeature) -> bool {
        self.features.contains(&feature)
    }
}

/// The driver files found under a root, turned into CDI edits common to every device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverFiles {
    pub libraries: Vec<DriverFile>,
    pub binaries: Vec<DriverFile>,
    /// The hook that links, caches and enables CUDA compat in the container; `None` only when no hook
    /// binary could be installed (the plugin warns).
    pub hook: Option<CdiHook>,
    /// The driver's version, which `enable-cuda-compat` compares the image's compat driver with.
    pub driver_version: Option<String>,
    /// A simulated driver's kernel directory (`R/tessera-sim`, see [`DriverFiles::discover`]), mounted
    /// read-only at [`SIMULATED_KERNEL_CONTAINER_PATH`]; `None` for a real driver.
    pub simulated_kernel: Option<DriverFile>,
    /// Whether the host has the driver's `/proc/driver/nvidia/params`, which the hook then masks in each
    /// container (`disable-device-node-modification`, see [`DriverFiles::with_driver_params`]).
    pub driver_params: bool,
    /// The sockets of NVIDIA's daemons that run ([`IPC_SOCKETS`]), mounted writable.
    pub ipc: Vec<DriverFile>,
    /// The driver version's GSP firmware files ([`FIRMWARE_DIR`]), mounted read-only as the toolkit does.
    pub firmware: Vec<DriverFile>,
}

impl DriverFiles {
    /// Finds the libraries of `driver_version` (e.g. `580.159.03`) and the binaries under `root`. A library
    /// is taken from the first directory that holds it; missing ones are skipped (not every driver ships
    /// every library).
    pub fn discover(root: &DriverRoot, driver_version: Option<&str>) -> Self {
        // Every spec path is the host's: a file found here is named at `host + (file − root)`, resolved first
        // (inside the root), so the runtime on the host never follows a link of the driver's filesystem.
        let file = |named: &Path, resolved: &Path, library: bool| {
            Some(DriverFile {
                host_path: root.to_host(resolved)?,
                container_path: root.container_path(named, library)?,
            })
        };
        let mut found: Vec<(PathBuf, PathBuf)> = LIBRARIES
            .iter()
            .flat_map(|lib| library_files(root, lib, driver_version))
            .collect();
        if let Some(v) = driver_version {
            for stem in versioned_stems(root, v, &found) {
                found.extend(library_files(root, &stem, Some(v)));
            }
        }
        for prefix in UNVERSIONED_LIBRARIES {
            found.extend(unversioned_library_files(root, prefix));
        }
        let libraries = found
            .iter()
            .filter_map(|(named, resolved)| file(named, resolved, true))
            .collect();
        let binaries = BINARIES
            .iter()
            .filter_map(|b| root.find_binary(b))
            .filter_map(|named| file(&named, &root.resolve(&named)?, false))
            .collect();
        // `R/tessera-sim` links out of the root, to the kernel under the state dir where `simulate
        // driver-root` made it on the host. A plugin that sees the host names the real directory; one that
        // sees the root mounted elsewhere names the link at its host path, which the runtime follows on the
        // host (resolved here it would be a path of this process's mounts).
        let simulated_kernel = root.simulated_kernel().and_then(|dir| {
            let host_path = if root.path() == root.host_path() {
                fs::canonicalize(&dir).unwrap_or(dir)
            } else {
                root.to_host(&dir)?
            };
            Some(DriverFile {
                host_path,
                container_path: SIMULATED_KERNEL_CONTAINER_PATH.to_string(),
            })
        });
        Self {
            libraries,
            binaries,
            hook: None,
            driver_version: driver_version.map(str::to_string),
            simulated_kernel,
            driver_params: false,
            ipc: ipc_sockets(root),
            firmware: driver_version
                .map(|v| firmware_files(root, v))
                .unwrap_or_default(),
        }
    }

    /// Whether the host has the driver's params file (a loaded NVIDIA kernel module: the plugin checks
    /// its own `/proc/driver/nvidia/params`, the host's, as the driver's procfs is not namespaced). With it
    /// the specs call the hook's `disable-device-node-modification`, so the driver's libraries in the
    /// container never create or change device nodes (NVIDIA's specs do the same).
    pub fn with_driver_params(mut self, present: bool) -> Self {
        self.driver_params = present;
        self
    }

    /// The hook the specs run (see [`CdiHook`]); without one the container gets the mounts only.
    pub fn with_hook(mut self, hook: Option<CdiHook>) -> Self {
        self.hook = hook;
        self
    }

    /// `(target, link)` of every development link to create in the container: `<lib>.so -> <lib>.so.1`
    /// next to each mounted `<lib>.so.1` of [`DEV_LINKS`].
    pub fn dev_links(&self) -> Vec<(String, String)> {
        let mut links = Vec::new();
        for f in &self.libraries {
            let Some((dir, name)) = f.container_path.rsplit_once('/') else {
                continue;
            };
            if let Some(lib) = name.strip_suffix(".so.1")
                && DEV_LINKS.contains(&lib)
            {
                let link = (name.to_string(), format!("{dir}/{lib}.so"));
                if !links.contains(&link) {
                    links.push(link);
                }
            }
        }
        links
    }

    /// Directories of the container that receive libraries.
    pub fn container_library_dirs(&self) -> Vec<String> {
        let mut dirs: Vec<String> = Vec::new();
        for f in &self.libraries {
            if let Some((dir, _)) = f.container_path.rsplit_once('/')
                && !dirs.iter().any(|d| d == dir)
            {
                dirs.push(dir.to_string());
            }
        }
        dirs
    }
}

/// `true` when `path` is an existing file (used to find an optional host tool).
pub fn existing_file(path: &Path) -> Option<PathBuf> {
    fs::metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map(|_| path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    const VERSION: &str = "580.159.03";

    /// A driver root in a temp dir with `libcuda` and `libnvidia-ml` in `lib_dir` and `nvidia-smi` in
    /// `bin_dir`.
    struct Layout {
        dir: tempfile::TempDir,
    }

    impl Layout {
        fn new() -> Self {
            Self {
                dir: tempfile::tempdir().unwrap(),
            }
        }

        fn libs(self, lib_dir: &str) -> Self {
            let d = self.dir.path().join(lib_dir);
            fs::create_dir_all(&d).unwrap();
            for lib in ["libcuda", "libnvidia-ml"] {
                fs::write(d.join(format!("{lib}.so.{VERSION}")), b"stub").unwrap();
                symlink(format!("{lib}.so.{VERSION}"), d.join(format!("{lib}.so.1"))).unwrap();
            }
            self
        }

        fn bin(self, bin_dir: &str) -> Self {
            let d = self.dir.path().join(bin_dir);
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("nvidia-smi"), b"#!/bin/sh\n").unwrap();
            self
        }

        fn root(&self) -> DriverRoot {
            DriverRoot::new(self.dir.path())
        }
    }

    fn container_paths(files: &[DriverFile]) -> Vec<&str> {
        files.iter().map(|f| f.container_path.as_str()).collect()
    }

    #[test]
    fn each_library_layout_nvidia_ships_is_found_and_mounted_at_the_same_path() {
        for dir in [
            "usr/lib/x86_64-linux-gnu",
            "usr/lib64",
            "usr/lib/aarch64-linux-gnu",
            "lib64",
            "lib/x86_64-linux-gnu",
            "lib/aarch64-linux-gnu",
        ] {
            let layout = Layout::new().libs(dir).bin("usr/bin");
            let files = DriverFiles::discover(&layout.root(), Some(VERSION));
            assert_eq!(
                container_paths(&files.libraries),
                vec![
                    format!("/{dir}/libcuda.so.{VERSION}"),
                    format!("/{dir}/libcuda.so.1"),
                    format!("/{dir}/libnvidia-ml.so.{VERSION}"),
                    format!("/{dir}/libnvidia-ml.so.1"),
                ],
                "layout {dir}"
            );
            // The soname link is mounted as the file it resolves to (inside the root): the runtime on the
            // host must not follow a link of the driver's filesystem.
            assert_eq!(
                files.libraries[1].host_path,
                layout.dir.path().join(dir).join(format!("libcuda.so.{VERSION}"))
            );
            assert_eq!(
                layout.root().find_library("libnvidia-ml.so.1").unwrap(),
                layout.dir.path().join(dir).join("libnvidia-ml.so.1"),
                "layout {dir}"
            );
        }
    }

    #[test]
    fn each_binary_layout_is_found() {
        for dir in ["usr/bin", "bin", "usr/sbin", "sbin", "opt/bin"] {
            let layout = Layout::new().libs("usr/lib64").bin(dir);
            let files = DriverFiles::discover(&layout.root(), Some(VERSION));
            assert_eq!(
                container_paths(&files.binaries),
                vec![format!("/{dir}/nvidia-smi")],
                "layout {dir}"
            );
            assert!(
                layout
                    .root()
                    .path_env()
                    .starts_with(&layout.dir.path().join(dir).display().to_string()),
                "{}",
                layout.root().path_env()
            );
        }
    }

    #[test]
    fn a_flat_driver_root_is_found_and_mounted_under_usr_local_nvidia() {
        let layout = Layout::new().libs(".").bin(".");
        let files = DriverFiles::discover(&layout.root(), Some(VERSION));
        assert_eq!(
            container_paths(&files.libraries)[..2],
            [
                format!("{FALLBACK_LIBRARY_DIR}/libcuda.so.{VERSION}"),
                format!("{FALLBACK_LIBRARY_DIR}/libcuda.so.1"),
            ]
        );
        assert_eq!(
            container_paths(&files.binaries),
            vec![format!("{FALLBACK_BINARY_DIR}/nvidia-smi")]
        );
    }

    #[test]
    fn a_gke_shaped_root_elsewhere_maps_to_usr_local_nvidia_too() {
        let layout = Layout::new().libs("lib64").bin("bin");
        let root = DriverRoot::mounted("/srv/gke-like", layout.dir.path());
        let files = DriverFiles::discover(&root, Some(VERSION));
        assert_eq!(
            container_paths(&files.libraries)[1],
            format!("{FALLBACK_LIBRARY_DIR}/libcuda.so.1")
        );
        assert_eq!(
            container_paths(&files.binaries),
            [format!("{FALLBACK_BINARY_DIR}/nvidia-smi")]
        );
        assert_eq!(
            files.libraries[1].host_path,
            PathBuf::from(format!("/srv/gke-like/lib64/libcuda.so.{VERSION}"))
        );
    }

    #[test]
    fn the_gke_layout_maps_to_usr_local_nvidia() {
        let root = DriverRoot::new(GKE_DRIVER_ROOT);
        assert_eq!(
            root.container_path(Path::new("/home/kubernetes/bin/nvidia/lib64/libcuda.so.1"), true),
            Some(format!("{FALLBACK_LIBRARY_DIR}/libcuda.so.1"))
        );
        assert_eq!(
            root.container_path(Path::new("/home/kubernetes/bin/nvidia/bin/nvidia-smi"), false),
            Some(format!("{FALLBACK_BINARY_DIR}/nvidia-smi"))
        );
        assert!(
            root.library_candidates("libnvidia-ml.so.1")
                .contains(&PathBuf::from(
                    "/home/kubernetes/bin/nvidia/lib64/libnvidia-ml.so.1"
                ))
        );
    }

    #[test]
    fn the_gpu_operator_root_is_stripped_from_container_paths() {
        let root = DriverRoot::new("/run/nvidia/driver");
        assert_eq!(
            root.container_path(
                Path::new("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
                true
            ),
            Some("/usr/lib/x86_64-linux-gnu/libcuda.so.1".to_string())
        );
    }

    #[test]
    fn the_legacy_nvvm_library_is_mounted_though_its_name_has_no_driver_version() {
        let layout = Layout::new().libs("usr/lib/x86_64-linux-gnu");
        let d = layout.dir.path().join("usr/lib/x86_64-linux-gnu");
        fs::write(d.join(format!("libnvidia-nvvm.so.{VERSION}")), b"stub").unwrap();
        symlink(
            format!("libnvidia-nvvm.so.{VERSION}"),
            d.join("libnvidia-nvvm.so.4"),
        )
        .unwrap();
        // As NVIDIA's installer lays it out: a regular file under its soname.
        fs::write(d.join("libnvidia-nvvm70.so.4"), b"stub").unwrap();
        let files = DriverFiles::discover(&layout.root(), Some(VERSION));
        let paths = container_paths(&files.libraries);
        for lib in [
            "libnvidia-nvvm.so.4".to_string(),
            format!("libnvidia-nvvm.so.{VERSION}"),
            "libnvidia-nvvm70.so.4".to_string(),
        ] {
            assert!(
                paths.contains(&format!("/usr/lib/x86_64-linux-gnu/{lib}").as_str()),
                "{lib} not mounted: {paths:?}"
            );
        }
        let nvvm70 = files
            .libraries
            .iter()
            .find(|f| f.container_path.ends_with("libnvidia-nvvm70.so.4"))
            .unwrap();
        assert_eq!(nvvm70.host_path, d.join("libnvidia-nvvm70.so.4"));
        // A driver without it (older than 545) mounts nothing in its place.
        fs::remove_file(d.join("libnvidia-nvvm70.so.4")).unwrap();
        let files = DriverFiles::discover(&layout.root(), Some(VERSION));
        assert!(
            !container_paths(&files.libraries)
                .iter()
                .any(|p| p.contains("nvvm70")),
            "{:?}",
            files.libraries
        );
    }

    #[test]
    fn soname_links_are_read_from_the_directory_not_assumed() {
        let layout = Layout::new().libs("usr/lib64");
        let d = layout.dir.path().join("usr/lib64");
        fs::write(d.join(format!("libnvidia-nvvm.so.{VERSION}")), b"stub").unwrap();
        symlink(
            format!("libnvidia-nvvm.so.{VERSION}"),
            d.join("libnvidia-nvvm.so.4"),
        )
        .unwrap();
        // A stale link of an older driver is not mounted.
        symlink("libcuda.so.535.1", d.join("libcuda.so.535")).unwrap();
        let files = DriverFiles::discover(&layout.root(), Some(VERSION));
        let paths = container_paths(&files.libraries);
        assert!(paths.contains(&"/usr/lib64/libnvidia-nvvm.so.4"), "{paths:?}");
        assert!(!paths.iter().any(|p| p.ends_with("libcuda.so.535")), "{paths:?}");
        let unversioned = DriverFiles::discover(&layout.root(), None);
        assert_eq!(
            container_paths(&unversioned.libraries),
            ["/usr/lib64/libcuda.so.1", "/usr/lib64/libnvidia-ml.so.1"]
        );
    }

    #[test]
    fn every_library_of_the_drivers_version_in_its_directory_is_mounted_with_its_soname_links() {
        // As NVIDIA's toolkit: libraries tessera does not name (graphics, NGX, …) come along when they are
        // of the driver's version; another version's, the distro's and an unversioned file do not.
        let layout = Layout::new().libs("usr/lib/x86_64-linux-gnu");
        let d = layout.dir.path().join("usr/lib/x86_64-linux-gnu");
        fs::write(d.join(format!("libnvidia-glcore.so.{VERSION}")), b"stub").unwrap();
        fs::write(d.join(format!("libnvidia-ngx.so.{VERSION}")), b"stub").unwrap();
        symlink(
            format!("libnvidia-ngx.so.{VERSION}"),
            d.join("libnvidia-ngx.so.1"),
        )
        .unwrap();
        fs::write(d.join("libnvidia-glcore.so.535.1"), b"old driver").unwrap();
        fs::write(d.join("libc.so.6"), b"distro").unwrap();
        fs::write(d.join("libfoo.so"), b"unversioned").unwrap();
        // A directory of the root without the driver's own libraries is not listed.
        fs::create_dir_all(layout.dir.path().join("usr/lib64")).unwrap();
        fs::write(
            layout.dir.path().join(format!("usr/lib64/libstray.so.{VERSION}")),
            b"x",
        )
        .unwrap();
        let files = DriverFiles::discover(&layout.root(), Some(VERSION));
        let dir = "/usr/lib/x86_64-linux-gnu";
        assert_eq!(
            container_paths(&files.libraries),
            [
                format!("{dir}/libcuda.so.{VERSION}"),
                format!("{dir}/libcuda.so.1"),
                format!("{dir}/libnvidia-ml.so.{VERSION}"),
                format!("{dir}/libnvidia-ml.so.1"),
                format!("{dir}/libnvidia-glcore.so.{VERSION}"),
                format!("{dir}/libnvidia-ngx.so.{VERSION}"),
                format!("{dir}/libnvidia-ngx.so.1"),
            ]
        );
        assert_eq!(
            files.libraries[6].host_path,
            d.join(format!("libnvidia-ngx.so.{VERSION}"))
        );
    }

    #[test]
    fn the_development_links_name_the_soname_next_to_each_mounted_library() {
        let layout = Layout::new().libs("lib64");
        let gke = DriverRoot::mounted(GKE_DRIVER_ROOT, layout.dir.path());
        let files = DriverFiles::discover(&gke, Some(VERSION));
        assert_eq!(
            files.dev_links(),
            [
                (
                    "libcuda.so.1".to_string(),
                    format!("{FALLBACK_LIBRARY_DIR}/libcuda.so")
                ),
                (
                    "libnvidia-ml.so.1".to_string(),
                    format!("{FALLBACK_LIBRARY_DIR}/libnvidia-ml.so")
                ),
            ]
        );
        assert_eq!(files.container_library_dirs(), [FALLBACK_LIBRARY_DIR]);
        assert_eq!(files.driver_version.as_deref(), Some(VERSION));
    }

    #[test]
    fn a_root_without_a_driver_gives_no_files() {
        let layout = Layout::new();
        let files = DriverFiles::discover(&layout.root(), Some(VERSION));
        assert!(files.libraries.is_empty() && files.binaries.is_empty());
        assert_eq!(files.simulated_kernel, None);
    }

    #[test]
    fn a_simulated_root_is_recognised_by_its_kernel_file_through_a_symlink() {
        let layout = Layout::new().libs("usr/lib/x86_64-linux-gnu");
        let kernel = tempfile::tempdir().unwrap();
        symlink(kernel.path(), layout.dir.path().join(SIMULATED_KERNEL_DIR)).unwrap();
        // A directory without kernel.json is not a simulated kernel (a real root never has one).
        assert_eq!(layout.root().simulated_kernel(), None);
        assert_eq!(
            DriverFiles::discover(&layout.root(), Some(VERSION)).simulated_kernel,
            None
        );
        fs::write(kernel.path().join(SIMULATED_KERNEL_FILE), "{}").unwrap();
        let files = DriverFiles::discover(&layout.root(), Some(VERSION));
        assert_eq!(
            files.simulated_kernel,
            Some(DriverFile {
                host_path: fs::canonicalize(kernel.path()).unwrap(),
                container_path: "/tessera-sim".into(),
            })
        );
    }

    fn host_paths(files: &[DriverFile]) -> Vec<String> {
        files.iter().map(|f| f.host_path.display().to_string()).collect()
    }

    #[test]
    fn a_file_read_under_the_container_root_is_named_at_the_host_root() {
        let root = DriverRoot::mounted("/", "/driver-root");
        assert_eq!(
            root.to_host(Path::new("/driver-root/usr/lib64/libcuda.so.1")),
            Some(PathBuf::from("/usr/lib64/libcuda.so.1"))
        );
        assert_eq!(root.to_host(Path::new("/driver-root")), Some(PathBuf::from("/")));
        let operator = DriverRoot::mounted("/run/nvidia/driver", "/driver-root");
        assert_eq!(
            operator.to_host(Path::new("/driver-root/usr/bin/nvidia-smi")),
            Some(PathBuf::from("/run/nvidia/driver/usr/bin/nvidia-smi"))
        );
        // A path outside the root has no host counterpart this root can vouch for.
        assert_eq!(operator.to_host(Path::new("/usr/bin/nvidia-smi")), None);
        assert_eq!(operator.to_host(Path::new("/driver-rootx/usr")), None);
        // Unmounted, the two paths are one.
        let host = DriverRoot::new("/run/nvidia/driver");
        assert_eq!(host.path(), host.host_path());
    }

    #[test]
    fn a_host_installed_driver_read_at_driver_root_is_named_at_its_host_paths() {
        let layout = Layout::new().libs("usr/lib/x86_64-linux-gnu").bin("usr/bin");
        let root = DriverRoot::mounted("/", layout.dir.path());
        let files = DriverFiles::discover(&root, Some(VERSION));
        assert_eq!(
            host_paths(&files.libraries),
            [
                format!("/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}"),
                format!("/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}"),
                format!("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}"),
                format!("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}"),
            ]
        );
        assert_eq!(
            container_paths(&files.libraries),
            [
                format!("/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}"),
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1".to_string(),
                format!("/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}"),
                "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1".to_string(),
            ]
        );
        assert_eq!(host_paths(&files.binaries), ["/usr/bin/nvidia-smi"]);
        assert_eq!(container_paths(&files.binaries), ["/usr/bin/nvidia-smi"]);
        // What this process runs and loads is still read where it sees the root.
        assert!(
            root.path_env()
                .starts_with(&layout.dir.path().join("usr/bin").display().to_string())
        );
        assert!(
            root.ld_library_path().starts_with(
                &layout
                    .dir
                    .path()
                    .join("usr/lib/x86_64-linux-gnu")
                    .display()
                    .to_string()
            ),
            "{}",
            root.ld_library_path()
        );
    }

    #[test]
    fn the_gpu_operators_rootfs_read_at_driver_root_is_named_under_run_nvidia_driver() {
        // A whole distro rootfs with its own libc and merged /usr, the soname link absolute (as some driver
        // packages make it) and `lib64` an absolute link into the rootfs's own /usr.
        let layout = Layout::new().bin("usr/bin");
        let d = layout.dir.path();
        let lib = d.join("usr/lib/x86_64-linux-gnu");
        fs::create_dir_all(&lib).unwrap();
        fs::write(lib.join("libc.so.6"), b"the rootfs's libc").unwrap();
        fs::write(lib.join(format!("libcuda.so.{VERSION}")), b"stub").unwrap();
        symlink(
            format!("/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}"),
            lib.join("libcuda.so.1"),
        )
        .unwrap();
        fs::create_dir_all(d.join("usr/lib64")).unwrap();
        fs::write(d.join(format!("usr/lib64/libnvidia-ml.so.{VERSION}")), b"stub").unwrap();
        symlink(
            format!("libnvidia-ml.so.{VERSION}"),
            d.join("usr/lib64/libnvidia-ml.so.1"),
        )
        .unwrap();
        symlink("/usr/lib64", d.join("lib64")).unwrap();
        let root = DriverRoot::mounted("/run/nvidia/driver", d);
        let files = DriverFiles::discover(&root, Some(VERSION));
        let pairs: Vec<(&str, String)> = files
            .libraries
            .iter()
            .map(|f| (f.container_path.as_str(), f.host_path.display().to_string()))
            .collect();
        assert_eq!(
            pairs,
            [
                (
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.03",
                    format!("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}")
                ),
                (
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                    format!("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}")
                ),
                (
                    "/usr/lib64/libnvidia-ml.so.580.159.03",
                    format!("/run/nvidia/driver/usr/lib64/libnvidia-ml.so.{VERSION}")
                ),
                (
                    "/usr/lib64/libnvidia-ml.so.1",
                    format!("/run/nvidia/driver/usr/lib64/libnvidia-ml.so.{VERSION}")
                ),
            ]
        );
        assert!(
            !container_paths(&files.libraries)
                .iter()
                .any(|p| p.contains("libc.so"))
        );
        assert_eq!(
            host_paths(&files.binaries),
            ["/run/nvidia/driver/usr/bin/nvidia-smi"]
        );
        // `lib64 -> /usr/lib64` is a directory of the rootfs, not of this process.
        assert_eq!(root.resolve(&d.join("lib64")), Some(d.join("usr/lib64")));
    }

    #[test]
    fn the_driver_libraries_of_an_operator_rootfs_are_nvidias_only() {
        // What the MPS daemon's private library directory links to: never the rootfs's libc or loader.
        let layout = Layout::new().libs("usr/lib/x86_64-linux-gnu");
        let d = layout.dir.path();
        let lib = d.join("usr/lib/x86_64-linux-gnu");
        for distro in [
            "libc.so.6",
            "libm.so.6",
            "ld-linux-x86-64.so.2",
            "libcudart.so.12",
            "libcuda-x.so.1",
        ] {
            fs::write(lib.join(distro), b"distro").unwrap();
        }
        // An absolute soname link, resolved in the rootfs; `lib64 -> /usr/lib64` listed there too.
        fs::create_dir_all(d.join("usr/lib64")).unwrap();
        fs::write(
            d.join(format!("usr/lib64/libnvidia-ptxjitcompiler.so.{VERSION}")),
            b"stub",
        )
        .unwrap();
        symlink(
            format!("/usr/lib64/libnvidia-ptxjitcompiler.so.{VERSION}"),
            d.join("usr/lib64/libnvidia-ptxjitcompiler.so.1"),
        )
        .unwrap();
        fs::write(d.join("usr/lib64/libc.so.6"), b"distro").unwrap();
        symlink("/usr/lib64", d.join("lib64")).unwrap();
        let root = DriverRoot::mounted("/run/nvidia/driver", d);
        let names: Vec<(String, PathBuf)> = root.driver_libraries();
        let ptx = d.join(format!("usr/lib64/libnvidia-ptxjitcompiler.so.{VERSION}"));
        assert_eq!(
            names,
            [
                (
                    "libcuda.so.1".to_string(),
                    lib.join(format!("libcuda.so.{VERSION}"))
                ),
                (
                    format!("libcuda.so.{VERSION}"),
                    lib.join(format!("libcuda.so.{VERSION}"))
                ),
                (
                    "libnvidia-ml.so.1".to_string(),
                    lib.join(format!("libnvidia-ml.so.{VERSION}"))
                ),
                (
                    format!("libnvidia-ml.so.{VERSION}"),
                    lib.join(format!("libnvidia-ml.so.{VERSION}"))
                ),
                ("libnvidia-ptxjitcompiler.so.1".to_string(), ptx.clone()),
                (format!("libnvidia-ptxjitcompiler.so.{VERSION}"), ptx),
            ]
        );
    }

    #[test]
    fn gkes_driver_read_at_driver_root_keeps_the_gke_container_paths() {
        let layout = Layout::new().libs("lib64").bin("bin");
        let root = DriverRoot::mounted(GKE_DRIVER_ROOT, layout.dir.path());
        let files = DriverFiles::discover(&root, Some(VERSION));
        assert_eq!(
            container_paths(&files.libraries)[..2],
            [
                format!("{FALLBACK_LIBRARY_DIR}/libcuda.so.{VERSION}"),
                format!("{FALLBACK_LIBRARY_DIR}/libcuda.so.1"),
            ]
        );
        assert_eq!(
            host_paths(&files.libraries)[..2],
            [
                format!("{GKE_DRIVER_ROOT}/lib64/libcuda.so.{VERSION}"),
                format!("{GKE_DRIVER_ROOT}/lib64/libcuda.so.{VERSION}"),
            ]
        );
        assert_eq!(
            container_paths(&files.binaries),
            [format!("{FALLBACK_BINARY_DIR}/nvidia-smi")]
        );
        assert_eq!(
            host_paths(&files.binaries),
            [format!("{GKE_DRIVER_ROOT}/bin/nvidia-smi")]
        );
    }

    #[test]
    fn an_absolute_soname_link_is_resolved_in_the_driver_root_not_the_plugins() {
        // Today's bug: the link was resolved in the plugin's own root, found nothing, and was dropped.
        let layout = Layout::new();
        let d = layout.dir.path();
        let lib = d.join("usr/lib/x86_64-linux-gnu");
        fs::create_dir_all(&lib).unwrap();
        fs::write(lib.join(format!("libcuda.so.{VERSION}")), b"stub").unwrap();
        let absolute = format!("/usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}");
        symlink(&absolute, lib.join("libcuda.so.1")).unwrap();
        for root in [layout.root(), DriverRoot::mounted("/", d)] {
            let files = DriverFiles::discover(&root, Some(VERSION));
            assert_eq!(
                container_paths(&files.libraries),
                [absolute.clone(), "/usr/lib/x86_64-linux-gnu/libcuda.so.1".into()],
                "root {root:?}"
            );
            assert_eq!(
                files.libraries[1].host_path,
                root.to_host(&lib.join(format!("libcuda.so.{VERSION}"))).unwrap()
            );
            // Without a version the soname link alone is found the same way.
            assert_eq!(
                container_paths(&DriverFiles::discover(&root, None).libraries),
                ["/usr/lib/x86_64-linux-gnu/libcuda.so.1"]
            );
            assert_eq!(root.find_library("libcuda.so.1"), Some(lib.join("libcuda.so.1")));
        }
    }

    #[test]
    fn resolving_inside_the_root_stops_at_the_root_and_at_loops() {
        let layout = Layout::new();
        let d = layout.dir.path();
        fs::create_dir_all(d.join("a")).unwrap();
        fs::write(d.join("a/f"), b"").unwrap();
        // `..` past the root stays at the root, as in a chroot.
        symlink("../../../../a/f", d.join("a/up")).unwrap();
        symlink("loop2", d.join("loop1")).unwrap();
        symlink("loop1", d.join("loop2")).unwrap();
        let root = layout.root();
        assert_eq!(root.resolve(&d.join("a/up")), Some(d.join("a/f")));
        assert_eq!(root.resolve(&d.join("loop1")), None);
        assert_eq!(root.resolve(&d.join("missing")), None);
        assert_eq!(root.resolve(Path::new("/elsewhere")), None);
    }

    #[test]
    fn a_simulated_kernel_seen_through_a_mounted_root_is_named_by_its_link_on_the_host() {
        let layout = Layout::new().libs("usr/lib/x86_64-linux-gnu");
        let kernel = tempfile::tempdir().unwrap();
        fs::write(kernel.path().join(SIMULATED_KERNEL_FILE), "{}").unwrap();
        symlink(kernel.path(), layout.dir.path().join(SIMULATED_KERNEL_DIR)).unwrap();
        let root = DriverRoot::mounted("/srv/driver", layout.dir.path());
        let files = DriverFiles::discover(&root, Some(VERSION));
        // The runtime follows `/srv/driver/tessera-sim` on the host, where `simulate driver-root` made it.
        assert_eq!(
            files.simulated_kernel,
            Some(DriverFile {
                host_path: "/srv/driver/tessera-sim".into(),
                container_path: "/tessera-sim".into(),
            })
        );
    }
}
