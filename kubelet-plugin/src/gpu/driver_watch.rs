//! The driver's life under a running node: waiting for it at boot, noticing an upgrade, and the
//! `nvidia-uvm` device nodes.
//!
//! **Boot.** A driver container (the GPU Operator's) installs the driver minutes after the node's pods
//! start, and until then the plugin would only crash-loop. The chart's node pods therefore start with an
//! init container, `tessera-kubelet-plugin wait-for-driver`, which returns once the driver root holds
//! `libnvidia-ml.so.1` (found by the plugin's own discovery, [`DriverRoot::find_library`]) and the kernel
//! module is loaded (`/proc/driver/nvidia/version`, or the simulated kernel's copy of it), printing what
//! it still waits for at intervals; the pod shows `Init:0/1` meanwhile ([`wait_for_driver`]).
//!
//! **Upgrades.** The plugin loads NVML once and names `<lib>.so.<version>` of the version NVML reported in
//! every CDI spec it writes; after a driver upgrade both are the old driver's. So the running plugin reads,
//! every [`DEFAULT_WATCH_INTERVAL`], the version the driver root now holds (the files
//! `libnvidia-ml.so.1` and `libcuda.so.1` resolve to, and the kernel module's version file;
//! [`DriverOnDisk`]) and compares it with the one it serves ([`DriverWatch`]). A different version that
//! every source agrees on, seen [`SETTLE_OBSERVATIONS`] times in a row, is an upgrade: the plugin logs
//! why, writes it to its termination message, stops serving (the registration socket goes first) and
//! exits with [`DRIVER_CHANGED_EXIT_CODE`]; kubelet starts the container again, and the new process loads
//! the new libraries. Prepared claims survive it through the checkpoint like any restart. While the
//! sources disagree or the libraries are missing (a driver container half way through), the plugin serves
//! on with what it has loaded, since that is all a restart could do too.
//!
//! Polling rather than inotify: a driver container replaces the whole root by mounting over it, which
//! inotify on the old directory never reports, and a handful of `readlink`s every five seconds costs
//! nothing.
//!
//! **`nvidia-uvm`.** CUDA opens `/dev/nvidia-uvm`. Where the module is loaded but the node lacks its device
//! nodes (nothing ran `nvidia-modprobe -u`, which CUDA calls on a host but cannot in a container), the
//! plugin creates `/dev/nvidia-uvm` and `/dev/nvidia-uvm-tools` as `nvidia-modprobe` and NVIDIA's
//! container toolkit (`nvidia-ctk system create-device-nodes --control-devices`) do: character devices of
//! the module's major from `/proc/devices`, minors 0 and 1, mode 0666 ([`ensure_uvm_device_nodes`]). Where
//! the module is not loaded at all, loading a kernel module is the node's business: the plugin says so,
//! naming `modprobe nvidia-uvm`.

use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};
use tessera_gpu_api::driver_version::{parse_kernel_version, version_in_name};

use tokio::sync::watch;
use tracing::{info, warn};

use crate::gpu::driver_root::DriverRoot;

/// The NVML library the plugin loads, and whose presence means the driver's user space is installed.
pub const NVML_LIBRARY: &str = "libnvidia-ml.so.1";
/// The CUDA driver library containers load.
pub const CUDA_LIBRARY: &str = "libcuda.so.1";
/// The kernel module's version file under a `/proc` root.
pub const KERNEL_VERSION_FILE: &str = "driver/nvidia/version";
/// How often the running plugin reads the driver root's version (`--driver-watch-interval`).
pub const DEFAULT_WATCH_INTERVAL: Duration = Duration::from_secs(5);
/// How many polls in a row must see the same new version before the plugin restarts: one poll may land
/// between a driver container's writes.
pub const SETTLE_OBSERVATIONS: u32 = 2;
/// The exit status of a plugin that stops because the driver changed under it: `EX_TEMPFAIL` of
/// `sysexits.h` ("try again"), non-zero so that every supervisor restarts it (kubelet always does; systemd's
/// `Restart=on-failure` too) and distinct from a crash (1) in the pod's `lastState`.
pub const DRIVER_CHANGED_EXIT_CODE: i32 = 75;
/// Where kubelet reads a container's termination message from (the pod's default
/// `terminationMessagePath`).
pub const TERMINATION_LOG: &str = "/dev/termination-log";

/// Which driver the driver root holds now, by each of the three sources.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverOnDisk {
    /// The version in the name of the file `libnvidia-ml.so.1` resolves to; `None` when it is missing or
    /// its target's name carries none.
    pub nvml: Option<String>,
    /// The same for `libcuda.so.1`.
    pub cuda: Option<String>,
    /// The kernel module's version (`/proc/driver/nvidia/version`); `None` when the file is missing.
    pub kernel: Option<String>,
    /// Whether `libnvidia-ml.so.1` exists at all (a root whose soname files are plain files has no
    /// version in their names).
    pub nvml_found: bool,
}

impl DriverOnDisk {
    /// Reads the three sources under `root` (as this process sees it) and the kernel's `proc_root`
    /// ([`crate::gpu::nvml::proc_root_for`]: the simulated kernel's for a simulated driver).
    pub fn read(root: &DriverRoot, proc_root: &Path) -> Self {
        let versioned = |soname: &str, stem: &str| {
            root.find_library(soname)
                .and_then(|p| root.resolve(&p))
                .and_then(|file| version_in_name(&file, stem))
        };
        Self {
            nvml: versioned(NVML_LIBRARY, "libnvidia-ml"),
            cuda: versioned(CUDA_LIBRARY, "libcuda"),
            kernel: fs::read_to_string(proc_root.join(KERNEL_VERSION_FILE))
                .ok()
                .and_then(|t| parse_kernel_version(&t)),
            nvml_found: root.find_library(NVML_LIBRARY).is_some(),
        }
    }

    /// The version every source that names one agrees on, provided NVML's library names one; `None` while
    /// they disagree or the library is missing.
    pub fn version(&self) -> Option<&str> {
        let nvml = self.nvml.as_deref()?;
        [&self.cuda, &self.kernel]
            .into_iter()
            .flatten()
            .all(|v| v == nvml)
            .then_some(nvml)
    }

    /// For libraries of one version over a kernel module of another (a host driver upgraded by its
    /// packages without a reboot): what to do, since no restart of the plugin helps then.
    pub fn mismatch_hint(&self) -> Option<String> {
        let (libs, kernel) = (self.nvml.as_deref()?, self.kernel.as_deref()?);
        (libs != kernel).then(|| {
            format!(
                "the driver's libraries are {libs} but the loaded kernel module is {kernel}: a driver upgraded \
                 without reloading its module; reboot the node (or reload the nvidia modules) to finish it"
            )
        })
    }

    /// One line for the log: each source's version.
    pub fn describe(&self) -> String {
        let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "none".into());
        format!(
            "{NVML_LIBRARY} -> {}, {CUDA_LIBRARY} -> {}, kernel module {}",
            if self.nvml_found || self.nvml.is_some() {
                show(&self.nvml)
            } else {
                "missing".into()
            },
            show(&self.cuda),
            show(&self.kernel)
        )
    }
}

/// A driver version change under the running plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverChange {
    /// The version the plugin loaded (NVML's at start) and names in its specs.
    pub from: String,
    /// The version the driver root holds now.
    pub to: String,
    /// What the last poll read.
    pub on_disk: DriverOnDisk,
}

impl DriverChange {
    /// The message of the log line and of the termination message.
    pub fn message(&self) -> String {
        format!(
            "the NVIDIA driver changed from {} to {} under the running plugin ({}); exiting so that kubelet \
             restarts the plugin, which then loads the new driver's libraries and names them in new CDI specs \
             (prepared claims are kept)",
            self.from,
            self.to,
            self.on_disk.describe()
        )
    }
}

/// What one poll concluded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observed {
    /// The root holds the version the plugin serves.
    Serving,
    /// The root holds no consistent version (missing libraries, sources that disagree): a driver being
    /// installed. The plugin serves on with what it loaded.
    Unsettled,
    /// A new version, not yet seen [`SETTLE_OBSERVATIONS`] times in a row.
    Settling { version: String, seen: u32 },
    /// A new version, settled: restart.
    Changed(DriverChange),
}

/// The upgrade detector: the version served, and the candidate new version with how often it was seen in
/// a row. A plain state machine; [`watch_driver`] feeds it a [`DriverOnDisk`] per poll.
#[derive(Clone, Debug)]
pub struct DriverWatch {
    serving: String,
    settle: u32,
    candidate: Option<(String, u32)>,
}

impl DriverWatch {
    /// A detector for a plugin that serves `serving` (NVML's version at start).
    pub fn new(serving: impl Into<String>) -> Self {
        Self {
            serving: serving.into(),
            settle: SETTLE_OBSERVATIONS,
            candidate: None,
        }
    }

    /// Restarts after `n` polls in a row (at least one) instead of [`SETTLE_OBSERVATIONS`].
    pub fn settling_after(mut self, n: u32) -> Self {
        self.settle = n.max(1);
        self
    }

    /// The version served.
    pub fn serving(&self) -> &str {
        &self.serving
    }

    /// One poll's reading.
    pub fn observe(&mut self, disk: &DriverOnDisk) -> Observed {
        let Some(version) = disk.version() else {
            self.candidate = None;
            return Observed::Unsettled;
        };
        if version == self.serving {
            self.candidate = None;
            return Observed::Serving;
        }
        let seen = match &self.candidate {
            Some((v, n)) if v == version => n + 1,
            _ => 1,
        };
        self.candidate = Some((version.to_string(), seen));
        if seen >= self.settle {
            Observed::Changed(DriverChange {
                from: self.serving.clone(),
                to: version.to_string(),
                on_disk: disk.clone(),
            })
        } else {
            Observed::Settling {
                version: version.to_string(),
                seen,
            }
        }
    }
}

/// Polls the driver root every `interval` until its version changes ([`DriverWatch`]) or `stop` fires;
/// logs each change of what it sees. Returns the change, or `None` when stopped.
pub async fn watch_driver(
    root: DriverRoot,
    proc_root: PathBuf,
    serving: String,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) -> Option<DriverChange> {
    let mut detector = DriverWatch::new(serving);
    info!(
        driver_root = %root.path().display(),
        serving = detector.serving(),
        interval_secs = interval.as_secs_f64(),
        "watching the driver root for a driver upgrade"
    );
    let mut last = Observed::Serving;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.wait_for(|s| *s) => return None,
        }
        let (root2, proc2) = (root.clone(), proc_root.clone());
        let Ok(disk) = tokio::task::spawn_blocking(move || DriverOnDisk::read(&root2, &proc2)).await else {
            continue;
        };
        let seen = detector.observe(&disk);
        match &seen {
            Observed::Changed(change) => return Some(change.clone()),
            Observed::Unsettled if last != Observed::Unsettled => match disk.mismatch_hint() {
                Some(hint) => warn!(serving = detector.serving(), found = %disk.describe(), "{hint}"),
                None => info!(
                    serving = detector.serving(),
                    found = %disk.describe(),
                    "the driver root holds no consistent driver version (a driver being installed?); serving \
                     on with the loaded driver until it settles"
                ),
            },
            Observed::Settling { version, .. } => info!(
                serving = detector.serving(),
                new = %version,
                found = %disk.describe(),
                "the driver root holds another driver version; restarting once it is seen again"
            ),
            Observed::Serving if last != Observed::Serving => {
                info!(
                    serving = detector.serving(),
                    "the driver root holds the served driver again"
                )
            }
            _ => {}
        }
        last = seen;
    }
}

/// Writes `message` to the container's termination message file when there is one (never creates it:
/// outside a container `/dev` is the host's).
pub fn write_termination_message(path: &Path, message: &str) {
    use std::io::Write;
    if let Ok(mut f) = fs::OpenOptions::new().write(true).truncate(true).open(path) {
        let _ = f.write_all(message.as_bytes());
    }
}

// === Boot: waiting for the driver ===

/// What [`wait_for_driver`] found of the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverPresence {
    /// `libnvidia-ml.so.1` as the driver root names it, once found.
    pub nvml_library: Option<PathBuf>,
    /// The kernel module's version, once its version file exists.
    pub kernel: Option<String>,
    /// The version file looked for.
    pub kernel_file: PathBuf,
    /// Where `libnvidia-ml.so.1` is looked for, in order.
    pub searched: Vec<PathBuf>,
    /// The top-level entries of the driver root (an empty root is the common case: not mounted yet).
    pub root_entries: Vec<String>,
}

impl DriverPresence {
    /// Looks once.
    pub fn check(root: &DriverRoot, proc_root: &Path) -> Self {
        let kernel_file = proc_root.join(KERNEL_VERSION_FILE);
        let mut root_entries: Vec<String> = fs::read_dir(root.path())
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        root_entries.sort();
        Self {
            nvml_library: root.find_library(NVML_LIBRARY),
            kernel: fs::read_to_string(&kernel_file)
                .ok()
                .and_then(|t| parse_kernel_version(&t)),
            kernel_file,
            searched: root.library_candidates(NVML_LIBRARY),
            root_entries,
        }
    }

    /// The driver's library is there and its kernel module is loaded.
    pub fn ready(&self) -> bool {
        self.nvml_library.is_some() && self.kernel.is_some()
    }

    /// What is still missing, as a sentence for the pod's log.
    pub fn missing(&self) -> String {
        let mut parts = Vec::new();
        if self.nvml_library.is_none() {
            let dirs: Vec<String> = self
                .searched
                .iter()
                .filter_map(|p| p.parent().map(|d| d.display().to_string()))
                .collect();
            parts.push(format!("{NVML_LIBRARY} in none of {}", dirs.join(", ")));
        }
        if self.kernel.is_none() {
            parts.push(format!(
                "no kernel module version in {} (the nvidia module is not loaded)",
                self.kernel_file.display()
            ));
        }
        parts.join("; ")
    }
}

/// How [`wait_for_driver`] waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitOptions {
    /// Between two looks.
    pub poll: Duration,
    /// Between two waiting messages (the first is printed at once).
    pub report_every: Duration,
    /// Give up after this long; `None`: wait as long as it takes (a driver container may take minutes).
    pub timeout: Option<Duration>,
}

impl Default for WaitOptions {
    fn default() -> Self {
        Self {
            poll: Duration::from_secs(2),
            report_every: Duration::from_secs(30),
            timeout: None,
        }
    }
}

/// Waits until the driver under `root` is [`DriverPresence::ready`], calling `report` with a waiting
/// message at once and every `report_every` (and whenever what is missing changes). `proc_root` is asked
/// at every look: which `/proc` the module shows in depends on the root's contents (a simulated driver's
/// kernel comes with it, see [`crate::gpu::nvml::proc_root_for`]). `Err` with the last look once `timeout`
/// has passed.
pub fn wait_for_driver(
    root: &DriverRoot,
    proc_root: impl Fn() -> PathBuf,
    options: WaitOptions,
    mut report: impl FnMut(&str),
) -> Result<DriverPresence, DriverPresence> {
    let start = Instant::now();
    let mut last_report: Option<(Instant, String)> = None;
    loop {
        let presence = DriverPresence::check(root, &proc_root());
        if presence.ready() {
            return Ok(presence);
        }
        let missing = presence.missing();
        let due = match &last_report {
            None => true,
            Some((at, what)) => at.elapsed() >= options.report_every || *what != missing,
        };
        if due {
            let entries = if presence.root_entries.is_empty() {
                "empty".to_string()
            } else {
                presence.root_entries.join(" ")
            };
            report(&format!(
                "waiting for the NVIDIA driver under {} (host {}), {}s so far: {missing}; the driver root is {entries}",
                root.path().display(),
                root.host_path().display(),
                start.elapsed().as_secs(),
            ));
            last_report = Some((Instant::now(), missing));
        }
        if options.timeout.is_some_and(|t| start.elapsed() >= t) {
            return Err(presence);
        }
        std::thread::sleep(options.poll);
    }
}

// === nvidia-uvm ===

/// Major of the `nvidia-uvm` module in `/proc/devices` (it is dynamic), when loaded.
pub fn uvm_major(proc_root: &Path) -> Option<u32> {
    let devices = fs::read_to_string(proc_root.join("devices")).ok()?;
    devices
        .lines()
        .skip_while(|l| !l.starts_with("Character devices"))
        .take_while(|l| !l.starts_with("Block devices"))
        .find_map(|l| {
            let (major, name) = l.trim().split_once(' ')?;
            (name.trim() == "nvidia-uvm")
                .then(|| major.parse().ok())
                .flatten()
        })
}

/// What [`ensure_uvm_device_nodes`] found or did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UvmNodes {
    /// Both nodes exist.
    Present,
    /// The module is loaded and these nodes were missing and are created now.
    Created(Vec<PathBuf>),
    /// The module is not loaded (not in `/proc/devices`): nothing to create; see [`UVM_FIX`].
    ModuleNotLoaded,
}

/// The fix for [`UvmNodes::ModuleNotLoaded`], as the plugin logs it.
pub const UVM_FIX: &str = "load it on the node with `modprobe nvidia-uvm` (or `nvidia-modprobe -u -c=0`, which \
     also creates its device nodes); NVIDIA's installer and the GPU Operator's driver container load it";

/// The `nvidia-uvm` device nodes under `dev_root` (`/dev`), with the minors `nvidia-modprobe` gives them.
pub const UVM_NODES: [(&str, u32); 2] = [("nvidia-uvm", 0), ("nvidia-uvm-tools", 1)];

/// Creates `dev_root/nvidia-uvm` and `dev_root/nvidia-uvm-tools` where the module is loaded and they are
/// missing (see the module comment). A node that exists is left alone, whatever it is.
pub fn ensure_uvm_device_nodes(dev_root: &Path, proc_root: &Path) -> std::io::Result<UvmNodes> {
    let Some(major) = uvm_major(proc_root) else {
        return Ok(UvmNodes::ModuleNotLoaded);
    };
    let mut created = Vec::new();
    for (name, minor) in UVM_NODES {
        let path = dev_root.join(name);
        if fs::symlink_metadata(&path).is_ok() {
            continue;
        }
        mknod_char(&path, major, minor)?;
        created.push(path);
    }
    Ok(if created.is_empty() {
        UvmNodes::Present
    } else {
        UvmNodes::Created(created)
    })
}

/// A character device node of mode 0666 (as `nvidia-modprobe` makes them; the umask would narrow it).
#[allow(unsafe_code, reason = "mknod(2): std has no call that makes a device node")]
fn mknod_char(path: &Path, major: u32, minor: u32) -> std::io::Result<()> {
    use std::os::unix::{ffi::OsStrExt, fs::PermissionsExt};
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call; mknod reads nothing else.
    let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(major, minor)) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            return Ok(());
        }
        return Err(e);
    }
    fs::set_permissions(path, fs::Permissions::from_mode(0o666))
}

/// Makes sure of the `nvidia-uvm` nodes at plugin start and logs the outcome: created, or the fix when the
/// module is not loaded.
pub fn check_uvm(dev_root: &Path, proc_root: &Path) {
    match ensure_uvm_device_nodes(dev_root, proc_root) {
        Ok(UvmNodes::Present) => {}
        Ok(UvmNodes::Created(paths)) => info!(
            nodes = ?paths,
            "created the missing nvidia-uvm device nodes (the module is loaded), as nvidia-modprobe -u does; CUDA needs them"
        ),
        Ok(UvmNodes::ModuleNotLoaded) => warn!(
            proc = %proc_root.join("devices").display(),
            "the nvidia-uvm kernel module is not loaded, so containers get no /dev/nvidia-uvm and CUDA fails in \
             them (cuInit: no CUDA-capable device); {UVM_FIX}"
        ),
        Err(e) => warn!(
            dev = %dev_root.display(),
            error = %e,
            "the nvidia-uvm module is loaded but its device nodes are missing and cannot be created here; \
             create them on the node with `nvidia-modprobe -u -c=0`"
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, symlink};

    use super::*;

    const OLD: &str = "580.159.03";
    const NEW: &str = "580.200.01";

    /// A driver root in a temp dir with a `/proc` beside it, built version by version.
    struct Node {
        dir: tempfile::TempDir,
    }

    impl Node {
        fn new() -> Self {
            let node = Self {
                dir: tempfile::tempdir().unwrap(),
            };
            fs::create_dir_all(node.root_dir()).unwrap();
            fs::create_dir_all(node.proc_dir()).unwrap();
            node
        }

        fn root_dir(&self) -> PathBuf {
            self.dir.path().join("root")
        }

        fn proc_dir(&self) -> PathBuf {
            self.dir.path().join("proc")
        }

        fn lib_dir(&self) -> PathBuf {
            self.root_dir().join("usr/lib/x86_64-linux-gnu")
        }

        /// `<lib>.so.<version>` and its soname link, for NVML and CUDA (or only the ones named).
        fn libraries(self, version: &str, libs: &[&str]) -> Self {
            fs::create_dir_all(self.lib_dir()).unwrap();
            for lib in libs {
                fs::write(self.lib_dir().join(format!("{lib}.so.{version}")), version).unwrap();
                let link = self.lib_dir().join(format!("{lib}.so.1"));
                let _ = fs::remove_file(&link);
                symlink(format!("{lib}.so.{version}"), link).unwrap();
            }
            self
        }

        fn driver(self, version: &str) -> Self {
            self.libraries(version, &["libnvidia-ml", "libcuda"])
                .kernel(version)
        }

        fn kernel(self, version: &str) -> Self {
            let f = self.proc_dir().join(KERNEL_VERSION_FILE);
            fs::create_dir_all(f.parent().unwrap()).unwrap();
            fs::write(
                f,
                format!("NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Sun Sep 28 2025\nGCC version:  gcc 12\n"),
            )
            .unwrap();
            self
        }

        fn root(&self) -> DriverRoot {
            DriverRoot::mounted("/run/nvidia/driver", self.root_dir())
        }

        fn on_disk(&self) -> DriverOnDisk {
            DriverOnDisk::read(&self.root(), &self.proc_dir())
        }
    }

    #[test]
    fn the_kernel_version_is_read_from_the_proprietary_and_the_open_modules_lines() {
        assert_eq!(
            parse_kernel_version(
                "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
            )
            .as_deref(),
            Some("535.104.05")
        );
        assert_eq!(
            parse_kernel_version(
                "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U22)\nGCC version: 12\n"
            )
            .as_deref(),
            Some("580.95.05")
        );
        assert_eq!(parse_kernel_version("GCC version: 12.3.0\n"), None);
    }

    #[test]
    fn a_versioned_file_name_gives_its_version_and_a_soname_gives_none() {
        assert_eq!(
            version_in_name(Path::new("/x/libcuda.so.580.95.05"), "libcuda").as_deref(),
            Some("580.95.05")
        );
        assert_eq!(version_in_name(Path::new("/x/libcuda.so.1"), "libcuda"), None);
        assert_eq!(
            version_in_name(Path::new("/x/libcudadebugger.so.580.1"), "libcuda"),
            None
        );
    }

    #[test]
    fn the_driver_on_disk_is_the_version_its_libraries_and_kernel_agree_on() {
        let node = Node::new().driver(OLD);
        let disk = node.on_disk();
        assert_eq!(disk.version(), Some(OLD), "{disk:?}");
        assert_eq!(disk.kernel.as_deref(), Some(OLD));

        // Half way through an upgrade: the libraries are new, the module is still the old one.
        let node = node.libraries(NEW, &["libnvidia-ml", "libcuda"]);
        assert_eq!(node.on_disk().version(), None, "{:?}", node.on_disk());
        let hint = node
            .on_disk()
            .mismatch_hint()
            .expect("libraries over another module");
        assert!(
            hint.contains(NEW) && hint.contains(OLD) && hint.contains("reboot"),
            "{hint}"
        );
        let node = node.kernel(NEW);
        assert_eq!(node.on_disk().version(), Some(NEW));
    }

    #[test]
    fn a_root_without_nvml_holds_no_version() {
        let node = Node::new().kernel(OLD);
        let disk = node.on_disk();
        assert_eq!(disk.version(), None);
        assert!(
            disk.describe().contains("libnvidia-ml.so.1 -> missing"),
            "{}",
            disk.describe()
        );
    }

    #[test]
    fn a_new_version_restarts_only_once_it_is_seen_twice_in_a_row() {
        let mut watch = DriverWatch::new(OLD);
        let node = Node::new().driver(OLD);
        assert_eq!(watch.observe(&node.on_disk()), Observed::Serving);
        let node = node.driver(NEW);
        assert_eq!(
            watch.observe(&node.on_disk()),
            Observed::Settling {
                version: NEW.into(),
                seen: 1
            }
        );
        match watch.observe(&node.on_disk()) {
            Observed::Changed(change) => {
                assert_eq!((change.from.as_str(), change.to.as_str()), (OLD, NEW));
                let msg = change.message();
                assert!(
                    msg.contains(OLD) && msg.contains(NEW) && msg.contains("restarts"),
                    "{msg}"
                );
            }
            other => panic!("want a change, got {other:?}"),
        }
    }

    #[test]
    fn a_driver_being_installed_resets_the_count_and_never_restarts_the_plugin() {
        let mut watch = DriverWatch::new(OLD);
        let node = Node::new().driver(NEW);
        assert!(matches!(
            watch.observe(&node.on_disk()),
            Observed::Settling { .. }
        ));
        // The driver container unmounted its root: nothing there.
        let empty = Node::new();
        for _ in 0..5 {
            assert_eq!(watch.observe(&empty.on_disk()), Observed::Unsettled);
        }
        // Back with the new version: counted from one again.
        assert_eq!(
            watch.observe(&node.on_disk()),
            Observed::Settling {
                version: NEW.into(),
                seen: 1
            }
        );
    }

    #[test]
    fn the_same_driver_reinstalled_is_no_change() {
        let mut watch = DriverWatch::new(OLD).settling_after(1);
        let node = Node::new().driver(OLD);
        assert_eq!(watch.observe(&Node::new().on_disk()), Observed::Unsettled);
        assert_eq!(watch.observe(&node.on_disk()), Observed::Serving);
    }

    #[tokio::test]
    async fn the_watch_reports_the_upgrade_and_stops_when_told() {
        let node = Node::new().driver(OLD);
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(watch_driver(
            node.root(),
            node.proc_dir(),
            OLD.into(),
            Duration::from_millis(20),
            stop.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let node = node.driver(NEW);
        let change = tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the upgrade is seen")
            .unwrap()
            .expect("a change");
        assert_eq!(change.to, NEW);

        let stopped = tokio::spawn(watch_driver(
            node.root(),
            node.proc_dir(),
            NEW.into(),
            Duration::from_millis(20),
            stop,
        ));
        stop_tx.send_replace(true);
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(10), stopped)
                .await
                .unwrap()
                .unwrap(),
            None
        );
    }

    #[test]
    fn the_termination_message_is_written_only_where_the_file_exists() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("termination-log");
        write_termination_message(&log, "gone");
        assert!(!log.exists(), "never created");
        fs::write(&log, "").unwrap();
        write_termination_message(&log, "the driver changed");
        assert_eq!(fs::read_to_string(&log).unwrap(), "the driver changed");
    }

    #[test]
    fn waiting_for_an_empty_root_reports_what_is_missing_and_times_out_when_asked() {
        let node = Node::new();
        let mut messages = Vec::new();
        let options = WaitOptions {
            poll: Duration::from_millis(10),
            report_every: Duration::from_secs(60),
            timeout: Some(Duration::from_millis(50)),
        };
        let last = wait_for_driver(
            &node.root(),
            || node.proc_dir(),
            options,
            |m| messages.push(m.to_string()),
        )
        .unwrap_err();
        assert!(!last.ready());
        assert_eq!(
            messages.len(),
            1,
            "one message until what is missing changes: {messages:?}"
        );
        let m = &messages[0];
        for want in [
            "libnvidia-ml.so.1",
            "usr/lib/x86_64-linux-gnu",
            "not loaded",
            "empty",
            "/run/nvidia/driver",
        ] {
            assert!(m.contains(want), "{want:?} in {m}");
        }
    }

    #[test]
    fn waiting_returns_once_the_driver_appears_under_the_root() {
        let node = Node::new();
        let (root_dir, proc_dir) = (node.root_dir(), node.proc_dir());
        let appear = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            let lib = root_dir.join("lib64");
            fs::create_dir_all(&lib).unwrap();
            fs::write(lib.join(format!("libnvidia-ml.so.{OLD}")), "").unwrap();
            symlink(format!("libnvidia-ml.so.{OLD}"), lib.join("libnvidia-ml.so.1")).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            let f = proc_dir.join(KERNEL_VERSION_FILE);
            fs::create_dir_all(f.parent().unwrap()).unwrap();
            fs::write(
                f,
                format!("NVRM version: NVIDIA UNIX x86_64 Kernel Module  {OLD}  x\n"),
            )
            .unwrap();
        });
        let mut messages = Vec::new();
        let options = WaitOptions {
            poll: Duration::from_millis(10),
            report_every: Duration::from_secs(60),
            timeout: Some(Duration::from_secs(20)),
        };
        let found = wait_for_driver(
            &node.root(),
            || node.proc_dir(),
            options,
            |m| messages.push(m.to_string()),
        )
        .expect("the driver appears");
        appear.join().unwrap();
        assert_eq!(found.kernel.as_deref(), Some(OLD));
        assert!(found.nvml_library.unwrap().ends_with("lib64/libnvidia-ml.so.1"));
        // Empty, then library found but no module: two messages, the second without the library.
        assert_eq!(messages.len(), 2, "{messages:?}");
        assert!(
            !messages[1].contains("libnvidia-ml.so.1 in none"),
            "{}",
            messages[1]
        );
    }

    #[test]
    fn a_loaded_uvm_module_gets_its_missing_device_nodes_with_nvidia_modprobes_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let (dev, proc) = (dir.path().join("dev"), dir.path().join("proc"));
        fs::create_dir_all(&dev).unwrap();
        fs::create_dir_all(&proc).unwrap();
        assert_eq!(
            ensure_uvm_device_nodes(&dev, &proc).unwrap(),
            UvmNodes::ModuleNotLoaded
        );
        fs::write(
            proc.join("devices"),
            "Character devices:\n  1 mem\n195 nvidia-frontend\n507 nvidia-uvm\n\nBlock devices:\n  8 sd\n",
        )
        .unwrap();
        assert_eq!(
            ensure_uvm_device_nodes(&dev, &proc).unwrap(),
            UvmNodes::Created(vec![dev.join("nvidia-uvm"), dev.join("nvidia-uvm-tools")])
        );
        for (name, minor) in UVM_NODES {
            let meta = fs::metadata(dev.join(name)).unwrap();
            assert!(meta.file_type().is_char_device(), "{name}");
            assert_eq!(meta.rdev(), libc::makedev(507, minor), "{name}");
            assert_eq!(meta.mode() & 0o777, 0o666, "{name}");
        }
        assert_eq!(ensure_uvm_device_nodes(&dev, &proc).unwrap(), UvmNodes::Present);
    }
}
