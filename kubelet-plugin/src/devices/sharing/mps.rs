//! MPS control daemons: one per shared GPU or MIG device and namespace (or per device, for every namespace,
//! under tenancy `Shared`), started with its first MPS share and stopped after the last.
//!
//! Each daemon has a directory `<state dir>/mps/<key>/` (key = the daemon key: the device's share key,
//! `@<namespace>` for a namespace's own daemon) with
//! `pipe/` (the control socket `control` and the pid file), `log/` (`control.log`, and [`DAEMON_LOG`]:
//! the launcher's and daemon's own stdout and stderr and the failures of control commands), `lib/` (see
//! below) and `shm/`. A daemon is
//! its own session leader, not a child the plugin waits on, so it outlives a plugin restart; the plugin finds
//! it again through its pid file and control socket.
//!
//! Where they run: without a supervisor the plugin starts them detached (they outlive the plugin process,
//! not its container); with [`Launcher::Supervisor`] the node's MPS supervisor ([`super::supervisor`])
//! starts them as its own children and every call here is forwarded to it.
//!
//! Two local launchers:
//! * [`Launcher::Nvidia`]: `nvidia-cuda-mps-control -d` with `CUDA_MPS_PIPE_DIRECTORY`,
//!   `CUDA_MPS_LOG_DIRECTORY` and `CUDA_VISIBLE_DEVICES=<uuid>`; commands go to the tool's stdin (never
//!   through a shell).
//!
//! **The library path of NVIDIA's tools.** The daemon, its server and every control command run from the
//! driver root with this process's loader and libc, and find NVIDIA's libraries through
//! `LD_LIBRARY_PATH=<daemon dir>/lib`, a private directory of symlinks to the driver's own libraries only
//! ([`DriverRoot::driver_libraries`]: the [`LIBRARIES`](crate::gpu::driver_root::LIBRARIES) names, versioned
//! files and soname links, resolved inside the root), rebuilt at every start. Never the root's library
//! directories themselves: under the GPU Operator the driver root is a whole Ubuntu/UBI rootfs, and its
//! `libc.so.6` loaded under this image's loader kills the tool before `main`. Why links and not a chroot
//! into the driver root, as NVIDIA's DRA driver does: a chroot needs a complete, runnable rootfs (GKE's
//! `bin`/`lib64` root has no loader, libc or shell), `CAP_SYS_CHROOT`, and the pipe, log and private
//! `/dev/shm` directories inside the root; the links need none of that and work on all three layouts (a
//! host driver in `/`, the Operator's rootfs, GKE's). What it needs instead: this image's glibc must be
//! one NVIDIA's binaries run with (they want `libpthread.so.0`, `libdl.so.2`, `librt.so.1`, `libm.so.6`).
//! `PATH` still starts with the root's binary directories, so the control daemon finds
//! `nvidia-cuda-mps-server`.
//! * [`Launcher::Simulated`]: the plugin binary's hidden `mps-control-sim` subcommand ([`run_sim_daemon`]), a
//!   real process serving the same commands on a unix socket and logging them, for nodes without GPUs.
//!
//! The simulated daemon is [`ControlDaemon`], one implementation behind both the plugin's `mps-control-sim`
//! and the simulated driver's `nvidia-cuda-mps-control` (crate `tessera-sim-tools`), which the plugin
//! drives through [`Launcher::Nvidia`] exactly as it drives NVIDIA's. Besides NVIDIA's control commands it
//! answers [`CLIENT_CONNECT`], which the simulated `libcuda.so.1` sends from `cuCtxCreate`: the daemon
//! starts `nvidia-cuda-mps-server` ([`run_server`]) for its first client and tells every client the
//! server's pid and limits ([`ClientGrant`]).
//!
//! What a share gets ([`client_edits`]): `CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps` with the pipe dir mounted
//! there, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` from its compute share and
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M` from its memory share.
//!
//! Enforcement, honestly:
//! * Thread percentage: the client's env var can only *lower* the server's limit, and a process can unset
//!   it; the daemon's default (a share slot's size, else the config's `defaultActiveThreadPercentage`, else
//!   100) is what an env-less client gets. MPS applies `set_default_*` only to servers spawned later, so the defaults are
//!   fixed by the first share.
//! * Pinned memory: enforced by the MPS server per client context, with the limit the client declares
//!   through its env; a client that unsets it gets the daemon default (a share slot's size, else the
//!   config's `defaultPinnedDeviceMemoryLimit`, else none).
//! * So the per-claim limits bind cooperative workloads; a hostile container on the same device can take
//!   up to the daemon defaults. A fault in one client reaches every client of the daemon.
//! * And every client can talk to the daemon: the control socket a CUDA client needs is the one control
//!   commands go to, so a tenant can `quit` its daemon (the watches start it again) or change the defaults
//!   later servers get. Hence a daemon per namespace by default (key `<device>@<namespace>`, see
//!   [`super::daemon_key`]): what a tenant can do to its daemon stays in its namespace ([`super`]'s table).

use std::{
    collections::HashMap,
    fs,
    io::{BufRead, BufReader, Read, Write},
    os::unix::{
        net::{UnixListener, UnixStream},
        process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tracing::{info, warn};

use super::private_shm;
use super::supervisor_protocol::{self as supervisor, DaemonDefaults};
use crate::gpu::driver_root::DriverRoot;

/// Pid file the daemon writes in its pipe directory.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// Control socket in the pipe directory.
pub const CONTROL_SOCKET: &str = "control";

/// One daemon's control socket, as [`MpsManager::instance`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DaemonInstance {
    dev: u64,
    ino: u64,
    mtime: (i64, i64),
}

/// Where a share's container sees the pipe directory.
pub const CONTAINER_PIPE_DIR: &str = "/tmp/nvidia-mps";
/// Hidden subcommand of the plugin binary that runs a simulated daemon.
pub const SIM_SUBCOMMAND: &str = "mps-control-sim";

/// How long a daemon may take to start serving or to exit after `quit`.
const DAEMON_TIMEOUT: Duration = Duration::from_secs(10);
/// Socket read/write timeout for one command.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
/// The daemon's own output in its log directory: stdout and stderr of the launcher
/// (`nvidia-cuda-mps-control -d`/`-f`) and of the daemon it leaves, and the failures of control commands.
pub const DAEMON_LOG: &str = "daemon.log";
/// How many of [`DAEMON_LOG`]'s last lines a failed start's error carries.
const LOG_TAIL_LINES: usize = 10;

/// A failed daemon operation.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    /// Creating the daemon's directories failed.
    #[error("failed to create MPS directory {path}: {source}")]
    CreateDir { path: PathBuf, source: std::io::Error },
    /// Running the launcher failed.
    #[error("failed to start the MPS control daemon for {key} with {program}: {reason}")]
    Start {
        key: String,
        program: PathBuf,
        reason: String,
    },
    /// The daemon did not answer in time after start (a zero timeout: it exited first). `tail` is the
    /// end of its [`DAEMON_LOG`] (empty, or starting with a newline).
    #[error("MPS control daemon for {key} did not answer within {timeout:?}; see {log}{tail}")]
    NotReady {
        key: String,
        timeout: Duration,
        log: PathBuf,
        tail: String,
    },
    /// Sending a command failed.
    #[error("failed to send {command:?} to the MPS control daemon for {key}: {reason}")]
    Command {
        key: String,
        command: String,
        reason: String,
    },
    /// A control command (or the launcher) did not finish in time; it was killed.
    #[error(
        "{program} did not finish {command:?} for the MPS daemon of {key} within {timeout:?} and was killed; \
         the daemon may be hung: see its control.log"
    )]
    Timeout {
        key: String,
        program: PathBuf,
        command: String,
        timeout: Duration,
    },
    /// The daemon kept running after `quit`.
    #[error("MPS control daemon for {key} (pid {pid}) still runs {timeout:?} after quit")]
    StillRunning {
        key: String,
        pid: u32,
        timeout: Duration,
    },
}

pub type Result<T, E = MpsError> = std::result::Result<T, E>;

/// How daemons are started and spoken to.
#[derive(Clone, Debug)]
pub enum Launcher {
    /// NVIDIA's `nvidia-cuda-mps-control` at this path (under the driver root as this process sees it,
    /// `--container-driver-root`: the daemon runs here, not on the host). The daemon and every
    /// command run with the driver root's binary directories first on `PATH` (the control daemon finds
    /// `nvidia-cuda-mps-server`) and `LD_LIBRARY_PATH` set to the daemon's private directory of links to
    /// the driver's own libraries, never to a library directory of the root (see the module comment).
    Nvidia { control: PathBuf, driver_root: PathBuf },
    /// `<program> mps-control-sim`; `program` is normally the plugin binary itself.
    Simulated { program: PathBuf },
    /// The node's MPS supervisor ([`super::supervisor`]) at this unix socket starts, answers and stops the
    /// daemons; they are its children, so they outlive the plugin. It must use the same state directory.
    Supervisor { socket: PathBuf },
}

/// A daemon's directories.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DaemonDirs {
    pub root: PathBuf,
    pub pipe: PathBuf,
    pub log: PathBuf,
    pub shm: PathBuf,
    /// Links to the driver's libraries, the `LD_LIBRARY_PATH` of NVIDIA's tools.
    pub lib: PathBuf,
}

/// The limits one MPS share gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShareLimits {
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`; `None` = no limit.
    pub active_thread_percentage: Option<u32>,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in bytes; `None` = no limit.
    pub pinned_memory_bytes: Option<u64>,
}

/// Starts, finds and stops MPS control daemons under `<state dir>/mps`.
#[derive(Clone, Debug)]
pub struct MpsManager {
    root: PathBuf,
    launcher: Launcher,
    command_timeout: Duration,
    /// Supervisor mode: daemons run in the foreground as this process's children (reaped by a thread),
    /// by key with their pids.
    owned: Option<Arc<Mutex<HashMap<String, u32>>>>,
    /// Supervisor mode on real GPUs: each daemon gets a tmpfs at `<dir>/shm` as its own `/dev/shm`.
    private_shm: bool,
}

impl MpsManager {
    pub fn new(state_dir: &Path, launcher: Launcher) -> Self {
        Self {
            root: state_dir.join("mps"),
            launcher,
            command_timeout: COMMAND_TIMEOUT,
            owned: None,
            private_shm: false,
        }
    }

    /// The manager inside the supervisor: daemons are its children; with `private_shm`, each runs in its
    /// own mount namespace with a tmpfs of its directory as `/dev/shm` (needs `CAP_SYS_ADMIN`).
    pub fn owning_children(mut self, private_shm: bool) -> Self {
        self.owned = Some(Arc::default());
        self.private_shm = private_shm;
        self
    }

    fn supervisor(&self) -> Option<&Path> {
        match &self.launcher {
            Launcher::Supervisor { socket } => Some(socket),
            _ => None,
        }
    }

    /// How long one control command may take before it is killed (default 5 s).
    pub fn with_command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// The plugin's state directory (the parent of the daemons' directories).
    pub fn state_dir(&self) -> &Path {
        self.root.parent().unwrap_or(&self.root)
    }

    /// The directories of the daemon for device `key`.
    pub fn dirs(&self, key: &str) -> DaemonDirs {
        let root = self.root.join(key);
        DaemonDirs {
            pipe: root.join("pipe"),
            log: root.join("log"),
            shm: root.join("shm"),
            lib: root.join("lib"),
            root,
        }
    }

    /// Pid from the daemon's pid file, if the file exists and the process is alive; in supervisor mode the
    /// pid of the daemon this process started, never the pid file's.
    pub fn pid(&self, key: &str) -> Option<u32> {
        if let Some(socket) = self.supervisor() {
            return supervisor::request(socket, &supervisor::Request::Pid { key: key.into() })
                .ok()?
                .pid;
        }
        if self.owned.is_some() {
            // The supervisor knows its children; the pid file is in the pipe directory every tenant of
            // the daemon mounts read-write, so a number read there may name any process (review N16).
            return self.child_pid(key);
        }
        let pid: u32 = fs::read_to_string(self.dirs(key).pipe.join(PID_FILE))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        process_alive(pid).then_some(pid)
    }

    /// The pid of the daemon of `key` when this manager started it as its child and it runs (supervisor
    /// mode); `None` otherwise. The only pids the supervisor signals.
    pub fn child_pid(&self, key: &str) -> Option<u32> {
        let owned = self.owned.as_ref()?;
        let pid = *owned.lock().unwrap_or_else(|e| e.into_inner()).get(key)?;
        process_alive(pid).then_some(pid)
    }

    /// Keys of the daemon directories under `<state dir>/mps`, running or not (no daemon is asked).
    pub fn known(&self) -> Vec<String> {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut keys: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|k| super::supervisor_protocol::check_daemon_key(k).is_ok())
            .collect();
        keys.sort();
        keys
    }

    /// Which daemon of `key` listens now: its control socket's device, inode and modification time. Each
    /// daemon binds the socket anew, so two answers that differ mean the daemon was replaced in between
    /// (its supervisor was restarted, or restarted it), even where a new supervisor's PID namespace gave
    /// the new daemon the old one's pid. `None` without a socket.
    pub fn instance(&self, key: &str) -> Option<DaemonInstance> {
        use std::os::unix::fs::MetadataExt;
        let meta = fs::symlink_metadata(self.dirs(key).pipe.join(CONTROL_SOCKET)).ok()?;
        Some(DaemonInstance {
            dev: meta.dev(),
            ino: meta.ino(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
        })
    }

    /// True when the daemon answers a cheap query (what NVIDIA's device plugin uses as its health probe).
    pub fn is_running(&self, key: &str) -> bool {
        // A probe fails while a daemon starts and after it stops: not worth a line in its daemon.log.
        self.command(key, "get_default_active_thread_percentage", false)
            .is_ok()
    }

    /// Keys of the daemons found running (after a plugin restart: those started by an earlier plugin).
    pub fn running(&self) -> Vec<String> {
        if let Some(socket) = self.supervisor() {
            return match supervisor::request(socket, &supervisor::Request::Running) {
                Ok(answer) => answer.keys,
                Err(e) => {
                    warn!(error = %e, "cannot ask the MPS supervisor which daemons run");
                    Vec::new()
                }
            };
        }
        let Ok(entries) = fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut keys: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|k| self.pid(k).is_some() && self.is_running(k))
            .collect();
        keys.sort();
        keys
    }

    /// Sends one control command and returns the daemon's answer (trimmed). A failure of NVIDIA's tool is
    /// also written to the daemon's [`DAEMON_LOG`].
    pub fn send(&self, key: &str, command: &str) -> Result<String> {
        self.command(key, command, true)
    }

    fn command(&self, key: &str, command: &str, log_failure: bool) -> Result<String> {
        let dirs = self.dirs(key);
        let log_failure = |line: String| {
            if log_failure {
                log_line(&dirs.log, &line);
            }
        };
        let err = |reason: String| MpsError::Command {
            key: key.to_string(),
            command: command.to_string(),
            reason,
        };
        match &self.launcher {
            Launcher::Supervisor { socket } => {
                let request = supervisor::Request::Send {
                    key: key.into(),
                    command: command.into(),
                };
                supervisor::request(socket, &request)
                    .map(|a| a.answer.unwrap_or_default())
                    .map_err(|e| err(e.to_string()))
            }
            Launcher::Simulated { .. } => sim_send(&dirs.pipe, command).map_err(|e| err(e.to_string())),
            Launcher::Nvidia { control, driver_root } => {
                // A daemon started by an older plugin has no link directory yet, and a driver upgrade
                // leaves dangling links; a key without a daemon directory gets none made (a probe of a
                // stopped daemon must not bring its directory back).
                if dirs.root.is_dir() && !links_usable(&dirs.lib) {
                    link_driver_libraries(&DriverRoot::new(driver_root), &dirs.lib)
                        .map_err(|e| err(format!("cannot link the driver's libraries: {e}")))?;
                }
                let mut cmd = Command::new(control);
                driver_env(&mut cmd, driver_root, &dirs.lib)
                    .env("CUDA_MPS_PIPE_DIRECTORY", &dirs.pipe)
                    .env("CUDA_MPS_LOG_DIRECTORY", &dirs.log);
                let out =
                    run_with_timeout(cmd, Some(command), self.command_timeout).map_err(|e| match e {
                        ToolError::Io(reason) => err(reason),
                        ToolError::TimedOut => {
                            log_failure(format!("{command:?} timed out after {:?}", self.command_timeout));
                            MpsError::Timeout {
                                key: key.to_string(),
                                program: control.clone(),
                                command: command.to_string(),
                                timeout: self.command_timeout,
                            }
                        }
                    })?;
                if !out.status.success() {
                    let stderr = String::from_utf8_lossy(&out.stderr);
                    let stdout = String::from_utf8_lossy(&out.stdout);
                    log_failure(format!(
                        "{command:?} failed: {}: {} {}",
                        out.status,
                        stderr.trim(),
                        stdout.trim()
                    ));
                    return Err(err(format!("{}: {}", out.status, stderr.trim())));
                }
                Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
            }
        }
    }

    /// Starts the daemon for device `key` (UUID `device_uuid`) unless it already runs, then applies
    /// `defaults`. Returns its directories.
    pub fn start(&self, key: &str, device_uuid: &str, defaults: DaemonDefaults) -> Result<DaemonDirs> {
        let dirs = self.dirs(key);
        if let Some(socket) = self.supervisor() {
            let request = supervisor::Request::Start {
                key: key.into(),
                uuid: device_uuid.into(),
                defaults,
            };
            supervisor::request(socket, &request).map_err(|e| MpsError::Start {
                key: key.to_string(),
                program: socket.to_path_buf(),
                reason: e.to_string(),
            })?;
            return Ok(dirs);
        }
        for dir in [&dirs.pipe, &dirs.log, &dirs.shm] {
            fs::create_dir_all(dir).map_err(|source| MpsError::CreateDir {
                path: dir.clone(),
                source,
            })?;
        }
        if self.is_running(key) {
            return Ok(dirs);
        }
        let start_err = |program: &Path, reason: String| MpsError::Start {
            key: key.to_string(),
            program: program.to_path_buf(),
            reason,
        };
        let foreground = self.owned.is_some();
        let (program, mut cmd) = match &self.launcher {
            Launcher::Nvidia { control, driver_root } => {
                link_driver_libraries(&DriverRoot::new(driver_root), &dirs.lib)
                    .map_err(|e| start_err(control, format!("cannot link the driver's libraries: {e}")))?;
                let mut cmd = Command::new(control);
                driver_env(&mut cmd, driver_root, &dirs.lib)
                    .arg(if foreground { "-f" } else { "-d" })
                    .env("CUDA_MPS_PIPE_DIRECTORY", &dirs.pipe)
                    .env("CUDA_MPS_LOG_DIRECTORY", &dirs.log);
                (control, cmd)
            }
            Launcher::Simulated { program } => {
                let mut cmd = Command::new(program);
                cmd.arg(SIM_SUBCOMMAND);
                if !foreground {
                    cmd.arg("--detach");
                }
                cmd.arg("--pipe-dir")
                    .arg(&dirs.pipe)
                    .arg("--log-dir")
                    .arg(&dirs.log);
                (program, cmd)
            }
            Launcher::Supervisor { .. } => unreachable!("forwarded above"),
        };
        cmd.env("CUDA_VISIBLE_DEVICES", device_uuid);
        // The launcher's and the daemon's own output (a loader error, a crash message) go to daemon.log.
        let daemon_log = dirs.log.join(DAEMON_LOG);
        let open_log = || {
            let log = fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&daemon_log)?;
            Ok::<_, std::io::Error>((log.try_clone()?, log))
        };
        let (out, errs) = open_log()
            .map_err(|e| start_err(program, format!("cannot open {}: {e}", daemon_log.display())))?;
        log_line(
            &dirs.log,
            &format!("starting {} for {device_uuid}", program.display()),
        );
        cmd.stdin(Stdio::null()).stdout(out).stderr(errs);
        if let Some(owned) = &self.owned {
            if self.private_shm {
                private_shm::prepare(&mut cmd, &dirs.shm).map_err(|e| start_err(program, e))?;
            }
            let mut child = cmd.spawn().map_err(|e| start_err(program, e.to_string()))?;
            let pid = child.id();
            owned
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key.to_string(), pid);
            // The supervisor reaps its daemons, so a stopped one does not linger as a zombie.
            std::thread::spawn(move || {
                let _ = child.wait();
            });
            return self.await_ready(key, &dirs, defaults, Some(pid));
        }
        // `-d` forks the daemon and returns; a launcher that does not is killed after the timeout.
        let status = match run_with_timeout(cmd, None, DAEMON_TIMEOUT) {
            Ok(out) => out.status,
            Err(ToolError::Io(reason)) => return Err(start_err(program, reason)),
            Err(ToolError::TimedOut) => {
                return Err(MpsError::Timeout {
                    key: key.to_string(),
                    program: program.to_path_buf(),
                    command: "start".into(),
                    timeout: DAEMON_TIMEOUT,
                });
            }
        };
        if !status.success() {
            return Err(start_err(
                program,
                format!("launcher exited with {status}{}", log_tail(&daemon_log)),
            ));
        }
        self.await_ready(key, &dirs, defaults, None)
    }

    /// Waits until a just started daemon answers, then applies `defaults`.
    fn await_ready(
        &self,
        key: &str,
        dirs: &DaemonDirs,
        defaults: DaemonDefaults,
        child: Option<u32>,
    ) -> Result<DaemonDirs> {
        let deadline = Instant::now() + DAEMON_TIMEOUT;
        while !self.is_running(key) {
            let not_ready = |timeout| MpsError::NotReady {
                key: key.to_string(),
                timeout,
                log: dirs.log.join("control.log"),
                tail: log_tail(&dirs.log.join(DAEMON_LOG)),
            };
            if child.is_some_and(|pid| !process_alive(pid)) {
                return Err(not_ready(Duration::ZERO));
            }
            if Instant::now() > deadline {
                return Err(not_ready(DAEMON_TIMEOUT));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(p) = defaults.active_thread_percentage {
            self.send(key, &format!("set_default_active_thread_percentage {p}"))?;
        }
        if let Some(b) = defaults.pinned_memory_bytes {
            // The daemon sees one device (CUDA_VISIBLE_DEVICES), ordinal 0.
            self.send(key, &format!("set_default_device_pinned_mem_limit 0 {}M", mib(b)))?;
        }
        info!(key, pid = ?self.pid(key), "started MPS control daemon");
        Ok(dirs.clone())
    }

    /// Stops the daemon for `key` (`quit`), waits for it to exit and removes its directories. Succeeds when
    /// no daemon runs.
    pub fn stop(&self, key: &str) -> Result<()> {
        if let Some(socket) = self.supervisor() {
            return supervisor::request(socket, &supervisor::Request::Stop { key: key.into() })
                .map(|_| ())
                .map_err(|e| MpsError::Command {
                    key: key.to_string(),
                    command: "quit".into(),
                    reason: e.to_string(),
                });
        }
        self.quit(key)?;
        let dirs = self.dirs(key);
        if self.private_shm {
            private_shm::release(&dirs.shm);
        }
        if let Err(e) = fs::remove_dir_all(&dirs.root)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            warn!(key, error = %e, "could not remove the MPS daemon directory");
        }
        Ok(())
    }

    /// Stops the daemon for `key` (`quit`) and waits for it to exit, keeping its directories: the pipe and
    /// `/dev/shm` directories are bind-mounted into the running clients' containers, so a daemon started
    /// later for the same key (the next supervisor's restore) must serve from the very same directories.
    /// Succeeds when no daemon runs. Local daemons only (not forwarded to a supervisor).
    pub fn quit(&self, key: &str) -> Result<()> {
        let pid = self.pid(key);
        if pid.is_some() || self.is_running(key) {
            if let Err(e) = self.send(key, "quit") {
                // Already exiting or gone: only the process check below says whether that is a problem.
                warn!(key, error = %e, "quit was not acknowledged");
            }
            if let Some(pid) = pid {
                let deadline = Instant::now() + DAEMON_TIMEOUT;
                while process_alive(pid) {
                    if Instant::now() > deadline {
                        return Err(MpsError::StillRunning {
                            key: key.to_string(),
                            pid,
                            timeout: DAEMON_TIMEOUT,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            info!(key, ?pid, "stopped MPS control daemon");
        }
        if let Some(owned) = &self.owned {
            owned.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
        }
        Ok(())
    }
}

/// `PATH` (the driver root's binary directories first) and `LD_LIBRARY_PATH` (`lib_dir`, the daemon's
/// links to the driver's libraries, and nothing else: never a library directory of the root, which on an
/// Operator rootfs holds a libc foreign to this process's loader) for NVIDIA's MPS tools.
fn driver_env<'c>(cmd: &'c mut Command, driver_root: &Path, lib_dir: &Path) -> &'c mut Command {
    cmd.env("PATH", DriverRoot::new(driver_root).path_env())
        .env("LD_LIBRARY_PATH", lib_dir)
}

/// Makes `dir` hold exactly one symlink per driver library of `root` ([`DriverRoot::driver_libraries`]),
/// named as the root names it and pointing at the file it resolves to. Idempotent and safe against a
/// concurrent call (each link is made under a temporary name and renamed over the old one); links of
/// files the root no longer has (an upgraded driver) are removed.
fn link_driver_libraries(root: &DriverRoot, dir: &Path) -> std::io::Result<()> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    fs::create_dir_all(dir)?;
    let wanted = root.driver_libraries();
    for (name, target) in &wanted {
        let link = dir.join(name);
        if fs::read_link(&link).is_ok_and(|t| t == *target) {
            continue;
        }
        let tmp = dir.join(format!(
            ".{name}.{}.{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::os::unix::fs::symlink(target, &tmp)?;
        fs::rename(&tmp, &link)?;
    }
    for entry in fs::read_dir(dir)?.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        // Dot names are another call's links in the making.
        if !name.starts_with('.') && !wanted.iter().any(|(n, _)| *n == *name) {
            let _ = fs::remove_file(entry.path());
        }
    }
    Ok(())
}

/// True when `dir` has links and every one leads to a file.
fn links_usable(dir: &Path) -> bool {
    let Ok(entries) = fs::read_dir(dir) else {
        return false;
    };
    let mut any = false;
    for entry in entries.filter_map(|e| e.ok()) {
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        if !fs::metadata(entry.path()).is_ok_and(|m| m.is_file()) {
            return false;
        }
        any = true;
    }
    any
}

/// Appends one timestamped line to `<log_dir>/daemon.log` when the directory exists (best effort).
fn log_line(log_dir: &Path, line: &str) {
    if !log_dir.is_dir() {
        return;
    }
    if let Ok(mut log) = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_dir.join(DAEMON_LOG))
    {
        let _ = writeln!(log, "[{}] tessera: {line}", timestamp());
    }
}

/// The last lines of `log` for an error message: `"; last lines of <log>:\n  …"`, or `""` when it is empty
/// or unreadable.
fn log_tail(log: &Path) -> String {
    let Ok(text) = fs::read(log) else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return String::new();
    }
    let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
    format!("; last lines of {}:\n  {}", log.display(), tail.join("\n  "))
}

enum ToolError {
    Io(String),
    TimedOut,
}

/// Runs `cmd` (arguments passed directly, never through a shell) with `input` on its stdin, waiting at most
/// `timeout`; a tool still running then is killed. With `input`, output is piped and read after the exit
/// (MPS tools print a line); without, the caller's stdout and stderr are kept.
fn run_with_timeout(
    mut cmd: Command,
    input: Option<&str>,
    timeout: Duration,
) -> std::result::Result<std::process::Output, ToolError> {
    let io = |e: std::io::Error| ToolError::Io(e.to_string());
    let piped = |yes: bool| if yes { Stdio::piped() } else { Stdio::null() };
    cmd.stdin(piped(input.is_some()));
    if input.is_some() {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    let mut child = cmd.spawn().map_err(io)?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        // A tool that exits without reading its command (it printed an error, say) may close the pipe
        // before this write: its exit status and stderr, collected below, say more than EPIPE would.
        match writeln!(stdin, "{text}") {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            written => written.map_err(io)?,
        }
    }
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait().map_err(io)?.is_some() {
            return child.wait_with_output().map_err(io);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ToolError::TimedOut);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn mib(bytes: u64) -> u64 {
    // Rounding down keeps the limit within the share; config validation guarantees at least 1 MiB.
    (bytes >> 20).max(1)
}

/// The container edits of one MPS share on the daemon `dirs`: env and mounts.
pub fn client_edits(
    dirs: &DaemonDirs,
    limits: ShareLimits,
    real_hardware: bool,
) -> (Vec<String>, Vec<(String, String)>) {
    let mut env = vec![format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}")];
    if let Some(p) = limits.active_thread_percentage {
        env.push(format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={p}"));
    }
    if let Some(b) = limits.pinned_memory_bytes {
        env.push(format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={}M", mib(b)));
    }
    // Clients talk to their server through shared memory as well as the pipe: on real hardware the daemon
    // runs in the host's /dev/shm, so the container must see that one.
    let shm = if real_hardware {
        "/dev/shm".to_string()
    } else {
        dirs.shm.display().to_string()
    };
    let mounts = vec![
        (dirs.pipe.display().to_string(), CONTAINER_PIPE_DIR.to_string()),
        (shm, "/dev/shm".to_string()),
    ];
    (env, mounts)
}

/// True when `pid` runs and is not a zombie waiting for a parent that never reaps it.
fn process_alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesized command name, which may contain spaces.
        Ok(stat) => {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                != Some("Z")
        }
        Err(_) => false,
    }
}

/// Sends one command line to the control daemon at `<pipe_dir>/control` and returns its answer (trimmed).
/// The wire protocol of tessera's daemon: one command line per connection, the client shuts down its
/// write half, the daemon writes its answer and closes.
pub fn send_control(pipe_dir: &Path, command: &str) -> std::io::Result<String> {
    let mut stream = UnixStream::connect(pipe_dir.join(CONTROL_SOCKET))?;
    stream.set_read_timeout(Some(COMMAND_TIMEOUT))?;
    stream.set_write_timeout(Some(COMMAND_TIMEOUT))?;
    writeln!(stream, "{command}")?;
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok(answer.trim().to_string())
}

fn sim_send(pipe_dir: &Path, command: &str) -> std::io::Result<String> {
    send_control(pipe_dir, command)
}

/// Runs the simulated MPS control daemon (the `mps-control-sim` subcommand).
///
/// With `detach`, starts `<program> mps-control-sim` (without `--detach`) in a new process group with null
/// stdio, waits until it serves, and returns: the caller exits and the daemon is inherited by init, like
/// `nvidia-cuda-mps-control -d`. Without `detach`, serves until `quit`. The daemon starts
/// `nvidia-cuda-mps-server` for its first client when tessera's simulated tools lie next to `program`;
/// otherwise it answers clients itself (see [`ControlDaemon::server`]).
pub fn run_sim_daemon(program: &Path, pipe_dir: &Path, log_dir: &Path, detach: bool) -> std::io::Result<()> {
    if detach {
        let mut cmd = Command::new(program);
        cmd.args([SIM_SUBCOMMAND, "--pipe-dir"])
            .arg(pipe_dir)
            .arg("--log-dir")
            .arg(log_dir);
        return detach_daemon(cmd, pipe_dir, log_dir);
    }
    ControlDaemon::new(pipe_dir, log_dir)
        .server(sibling_server(program))
        .serve()
}

/// `nvidia-cuda-mps-server` in the directory of `program`, if there is one.
pub fn sibling_server(program: &Path) -> Option<PathBuf> {
    let server = program.parent()?.join(SERVER_PROGRAM);
    server.is_file().then_some(server)
}

/// Starts `cmd` (a control daemon in the foreground) in a new process group, stdin null and its output
/// appended to `<log_dir>/`[`DAEMON_LOG`], and waits until it answers on `<pipe_dir>/control`; it is then
/// left running (init inherits it when the caller exits), as `nvidia-cuda-mps-control -d` leaves its
/// daemon. (Never the caller's stdout: a caller reading it to the end would wait for the daemon's exit.)
pub fn detach_daemon(mut cmd: Command, pipe_dir: &Path, log_dir: &Path) -> std::io::Result<()> {
    fs::create_dir_all(pipe_dir)?;
    fs::create_dir_all(log_dir)?;
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_dir.join(DAEMON_LOG))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()?;
    let deadline = Instant::now() + DAEMON_TIMEOUT;
    loop {
        if send_control(pipe_dir, "get_default_active_thread_percentage").is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            return Err(std::io::Error::other(format!(
                "daemon exited with {status}; see {}",
                log_dir.join("control.log").display()
            )));
        }
        if Instant::now() > deadline {
            return Err(std::io::Error::other(format!(
                "daemon did not serve within {DAEMON_TIMEOUT:?}; see {}",
                log_dir.join("control.log").display()
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The MPS server program a control daemon starts for its first client.
pub const SERVER_PROGRAM: &str = "nvidia-cuda-mps-server";

/// The command with which a CUDA client (tessera's simulated `libcuda.so.1`, in `cuCtxCreate`) attaches to
/// the daemon; not one of NVIDIA's control commands. Arguments `uuid=<device UUID>`, `gpu=<parent GPU
/// UUID>` (the same for a whole GPU) and `pid=<client pid>`; the answer is a [`ClientGrant`] line or
/// `error=<reason>`.
pub const CLIENT_CONNECT: &str = "client_connect";

/// What a client learns from the daemon when it attaches: the server that serves it and that server's
/// limits (the daemon's defaults when the server was started: `set_default_*` only reaches servers
/// started later, as in MPS).
#[derive(Clone, Debug, PartialEq)]
pub struct ClientGrant {
    pub server_pid: u32,
    pub active_thread_percentage: f64,
    /// `<device ordinal or UUID>=<limit>` pairs as set with `set_default_device_pinned_mem_limit`
    /// (`0=1024M`); empty when none is set.
    pub pinned_mem_limits: Vec<(String, String)>,
}

impl ClientGrant {
    /// The answer line: `server_pid=<pid> active_thread_percentage=<p> pinned_mem_limit=<dev>=<v>,…`.
    pub fn to_line(&self) -> String {
        let limits: Vec<String> = self
            .pinned_mem_limits
            .iter()
            .map(|(d, v)| format!("{d}={v}"))
            .collect();
        format!(
            "server_pid={} active_thread_percentage={:.1} pinned_mem_limit={}",
            self.server_pid,
            self.active_thread_percentage,
            limits.join(",")
        )
    }

    /// Parses [`ClientGrant::to_line`]'s output; `Err` carries the daemon's `error=` reason or says what is
    /// malformed.
    pub fn parse(line: &str) -> Result<Self, String> {
        if let Some(reason) = line.strip_prefix("error=") {
            return Err(reason.to_string());
        }
        let mut server_pid = None;
        let mut pct = None;
        let mut pinned = Vec::new();
        for word in line.split_whitespace() {
            match word.split_once('=') {
                Some(("server_pid", v)) => server_pid = v.parse().ok(),
                Some(("active_thread_percentage", v)) => pct = v.parse().ok(),
                Some(("pinned_mem_limit", v)) => {
                    pinned = v
                        .split(',')
                        .filter_map(|pair| pair.split_once('='))
                        .map(|(d, l)| (d.to_string(), l.to_string()))
                        .collect();
                }
                _ => {}
            }
        }
        match (server_pid, pct) {
            (Some(server_pid), Some(active_thread_percentage)) => Ok(Self {
                server_pid,
                active_thread_percentage,
                pinned_mem_limits: pinned,
            }),
            _ => Err(format!("malformed answer {line:?}")),
        }
    }
}

/// Bytes of an MPS memory limit as the control commands and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` write it:
/// an integer with an optional `K`, `M`, `G` or `T` suffix (binary units, an optional trailing `B`);
/// a bare number is bytes.
pub fn parse_mem_limit(value: &str) -> Option<u64> {
    let v = value.trim();
    let v = v.strip_suffix(['B', 'b']).unwrap_or(v);
    let (digits, shift) = match v.chars().last()? {
        'K' | 'k' => (&v[..v.len() - 1], 10),
        'M' | 'm' => (&v[..v.len() - 1], 20),
        'G' | 'g' => (&v[..v.len() - 1], 30),
        'T' | 't' => (&v[..v.len() - 1], 40),
        _ => (v, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// One MPS control daemon: NVIDIA's control commands (the ones tessera and NVIDIA's Kubernetes components
/// send: `get/set_default_active_thread_percentage`, `get/set_default_device_pinned_mem_limit`,
/// `get_server_list`, `quit`) and [`CLIENT_CONNECT`] on `<pipe dir>/control`, a pid file
/// ([`PID_FILE`]) in the pipe directory and `control.log` in the log directory. The one implementation
/// behind both tessera's simulated `nvidia-cuda-mps-control` and the plugin's `mps-control-sim`.
///
/// The devices it serves are its `CUDA_VISIBLE_DEVICES` (UUIDs, as the plugin sets it); a client of
/// another device is refused. It starts its server for the first client and stops it at `quit`.
pub struct ControlDaemon {
    pipe_dir: PathBuf,
    log_dir: PathBuf,
    server: Option<PathBuf>,
}

/// The running server of a daemon: its process, whose stdin the daemon holds (the server exits when it
/// closes, so a killed daemon leaves no server behind), and the limits it was started with.
struct Server {
    child: Option<std::process::Child>,
    grant: ClientGrant,
}

impl ControlDaemon {
    pub fn new(pipe_dir: &Path, log_dir: &Path) -> Self {
        Self {
            pipe_dir: pipe_dir.to_path_buf(),
            log_dir: log_dir.to_path_buf(),
            server: None,
        }
    }

    /// The `nvidia-cuda-mps-server` program to start for the first client. Without one (the plugin's
    /// `mps-control-sim` on an image without tessera's simulated tools) the daemon answers clients itself
    /// and names its own pid as the server's.
    pub fn server(mut self, program: Option<PathBuf>) -> Self {
        self.server = program;
        self
    }

    /// Serves until `quit`.
    pub fn serve(self) -> std::io::Result<()> {
        fs::create_dir_all(&self.pipe_dir)?;
        fs::create_dir_all(&self.log_dir)?;
        let socket = self.pipe_dir.join(CONTROL_SOCKET);
        let pid_file = self.pipe_dir.join(PID_FILE);
        // A socket left by a killed daemon would make bind fail; only one daemon per directory is started.
        let _ = fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)?;
        let tmp = self.pipe_dir.join(format!("{PID_FILE}.tmp"));
        fs::write(&tmp, format!("{}\n", std::process::id()))?;
        fs::rename(&tmp, &pid_file)?;
        let mut log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_dir.join("control.log"))?;
        let devices = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
        writeln!(
            log,
            "[{}] startup pid={} devices={devices}",
            timestamp(),
            std::process::id()
        )?;
        let served: Vec<String> = devices
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(String::from)
            .collect();
        let mut thread_percentage = 100.0f64;
        let mut pinned: std::collections::BTreeMap<String, String> = Default::default();
        let mut server: Option<Server> = None;
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let _ = stream.set_read_timeout(Some(COMMAND_TIMEOUT));
            let mut line = String::new();
            if BufReader::new(&stream).read_line(&mut line).is_err() {
                continue;
            }
            let line = line.trim();
            let words: Vec<&str> = line.split_whitespace().collect();
            let (answer, quit) = match words.as_slice() {
                ["get_default_active_thread_percentage"] => (format!("{thread_percentage:.1}"), false),
                ["set_default_active_thread_percentage", p] => match p.parse::<f64>() {
                    Ok(p) if (0.0..=100.0).contains(&p) => {
                        thread_percentage = p;
                        (String::new(), false)
                    }
                    _ => (format!("Invalid percentage {p}"), false),
                },
                ["set_default_device_pinned_mem_limit", dev, limit] => {
                    if parse_mem_limit(limit).is_some() {
                        pinned.insert(dev.to_string(), limit.to_string());
                        (String::new(), false)
                    } else {
                        (format!("Invalid memory limit {limit}"), false)
                    }
                }
                ["get_default_device_pinned_mem_limit", dev] => {
                    (pinned.get(*dev).cloned().unwrap_or_else(|| "0".into()), false)
                }
                ["get_server_list"] => {
                    let live = server.as_mut().and_then(Server::live_pid);
                    (live.map(|pid| pid.to_string()).unwrap_or_default(), false)
                }
                [CLIENT_CONNECT, args @ ..] => {
                    let arg = |key: &str| {
                        args.iter()
                            .find_map(|a| a.strip_prefix(key).and_then(|v| v.strip_prefix('=')))
                    };
                    let (uuid, gpu) = (arg("uuid").unwrap_or(""), arg("gpu").unwrap_or(""));
                    let answer = if !served.is_empty() && !served.iter().any(|d| d == uuid || d == gpu) {
                        format!("error=device {uuid} is not served by this daemon (devices {devices})")
                    } else {
                        if !server.as_mut().is_some_and(Server::alive) {
                            let grant = ClientGrant {
                                server_pid: std::process::id(),
                                active_thread_percentage: thread_percentage,
                                pinned_mem_limits: pinned.clone().into_iter().collect(),
                            };
                            // A server that cannot start fails this client, not the daemon.
                            server = match self.start_server(grant, &devices, &mut log) {
                                Ok(s) => Some(s),
                                Err(e) => {
                                    writeln!(log, "[{}] {e}", timestamp())?;
                                    None
                                }
                            };
                        }
                        match &server {
                            Some(s) => s.grant.to_line(),
                            None => "error=the MPS server failed to start; see control.log".to_string(),
                        }
                    };
                    let pid = arg("pid").unwrap_or("?");
                    writeln!(log, "[{}] NEW CLIENT pid={pid} device={uuid}", timestamp())?;
                    (answer, false)
                }
                ["quit"] => (String::new(), true),
                _ => (format!("Invalid command {line:?}"), false),
            };
            writeln!(log, "[{}] {line} -> {answer:?}", timestamp())?;
            let _ = writeln!(stream, "{answer}");
            if quit {
                drop(stream);
                if let Some(s) = server.take() {
                    s.stop(&mut log);
                }
                let _ = fs::remove_file(&socket);
                let _ = fs::remove_file(&pid_file);
                writeln!(log, "[{}] exit", timestamp())?;
                return Ok(());
            }
        }
        Ok(())
    }

    /// Starts the server (or, without a server program, lets the daemon itself stand for it).
    fn start_server(
        &self,
        mut grant: ClientGrant,
        devices: &str,
        log: &mut fs::File,
    ) -> std::io::Result<Server> {
        let Some(program) = &self.server else {
            writeln!(
                log,
                "[{}] no {SERVER_PROGRAM}: serving clients in the daemon",
                timestamp()
            )?;
            return Ok(Server { child: None, grant });
        };
        let limits: Vec<String> = grant
            .pinned_mem_limits
            .iter()
            .map(|(d, v)| format!("{d}={v}"))
            .collect();
        let child = Command::new(program)
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log_dir)
            .env("CUDA_VISIBLE_DEVICES", devices)
            .env(
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                format!("{:.1}", grant.active_thread_percentage),
            )
            .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", limits.join(","))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn();
        match child {
            Ok(mut child) => {
                // A server that cannot open the GPU (in EXCLUSIVE_PROCESS mode, held by another MPS
                // server) exits instead of saying it serves: its clients are refused, not granted.
                if let Err(e) = await_server(&mut child) {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(std::io::Error::other(format!(
                        "{} {} did not serve: {e}; see {}",
                        program.display(),
                        child.id(),
                        self.log_dir.join("server.log").display()
                    )));
                }
                grant.server_pid = child.id();
                writeln!(
                    log,
                    "[{}] Starting new server {} for devices {devices}",
                    timestamp(),
                    child.id()
                )?;
                Ok(Server {
                    child: Some(child),
                    grant,
                })
            }
            Err(e) => Err(std::io::Error::other(format!(
                "cannot start {}: {e}",
                program.display()
            ))),
        }
    }
}

impl Server {
    /// The server's pid while it runs.
    fn live_pid(&mut self) -> Option<u32> {
        self.alive().then_some(self.grant.server_pid)
    }

    fn alive(&mut self) -> bool {
        match &mut self.child {
            None => true,
            Some(child) => matches!(child.try_wait(), Ok(None)),
        }
    }

    /// Closes the server's stdin (its signal to exit) and reaps it, killing it after the daemon timeout.
    fn stop(self, log: &mut fs::File) {
        let Some(mut child) = self.child else { return };
        drop(child.stdin.take());
        let deadline = Instant::now() + DAEMON_TIMEOUT;
        while matches!(child.try_wait(), Ok(None)) {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = writeln!(log, "[{}] Server {} exited", timestamp(), child.id());
    }
}

/// What a server prints on its stdout once it serves ([`run_server`]).
pub const SERVER_READY: &str = "ready";

/// Waits for a just started server's [`SERVER_READY`] line: `Err` when it exits (or closes its stdout)
/// first, or says nothing within the daemon timeout.
fn await_server(child: &mut std::process::Child) -> std::io::Result<()> {
    let Some(out) = child.stdout.take() else {
        return Ok(());
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(out).read_line(&mut line);
        let _ = tx.send(line);
    });
    match rx.recv_timeout(DAEMON_TIMEOUT) {
        Ok(line) if line.trim() == SERVER_READY => Ok(()),
        Ok(_) => Err(std::io::Error::other("it exited before serving")),
        Err(_) => Err(std::io::Error::other(format!(
            "it did not serve within {DAEMON_TIMEOUT:?}"
        ))),
    }
}

/// The simulated `nvidia-cuda-mps-server`: started by [`ControlDaemon`] with the pipe and log directories,
/// the devices and its limits in its environment; logs to `server.log` and runs until its stdin (held by
/// the daemon) closes. It does no work: clients are attached by the daemon, and their "kernels" run nowhere.
pub fn run_server() -> std::io::Result<()> {
    let log_dir = std::env::var_os("CUDA_MPS_LOG_DIRECTORY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/log/nvidia-mps"));
    let mut log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_dir.join("server.log"))?;
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    writeln!(
        log,
        "[{}] server pid={} devices={} active_thread_percentage={} pinned_mem_limit={}",
        timestamp(),
        std::process::id(),
        env("CUDA_VISIBLE_DEVICES"),
        env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
    )?;
    println!("{SERVER_READY}");
    let _ = std::io::stdout().flush();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    writeln!(log, "[{}] server exit", timestamp())?;
    Ok(())
}

fn timestamp() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod daemon_tests {
    use super::*;

    #[test]
    fn a_client_grant_round_trips_and_an_error_is_an_error() {
        let grant = ClientGrant {
            server_pid: 42,
            active_thread_percentage: 25.0,
            pinned_mem_limits: vec![("0".into(), "1024M".into())],
        };
        assert_eq!(
            grant.to_line(),
            "server_pid=42 active_thread_percentage=25.0 pinned_mem_limit=0=1024M"
        );
        assert_eq!(ClientGrant::parse(&grant.to_line()), Ok(grant));
        assert_eq!(
            ClientGrant::parse("error=device X is not served").unwrap_err(),
            "device X is not served"
        );
        assert!(ClientGrant::parse("").is_err());
    }

    #[test]
    fn memory_limits_parse_as_mps_writes_them() {
        assert_eq!(parse_mem_limit("1024M"), Some(1 << 30));
        assert_eq!(parse_mem_limit("10G"), Some(10 << 30));
        assert_eq!(parse_mem_limit("512MB"), Some(512 << 20));
        assert_eq!(parse_mem_limit("4096"), Some(4096));
        assert_eq!(parse_mem_limit("lots"), None);
        assert_eq!(parse_mem_limit(""), None);
    }
}
