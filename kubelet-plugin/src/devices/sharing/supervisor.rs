//! The MPS supervisor: a node-level process (`tessera-kubelet-plugin mps-supervisor`, its own container)
//! that owns the MPS control daemons, so their lifetime does not depend on the plugin's process or
//! container. A plugin restart or upgrade leaves running MPS clients their server; the restarted plugin
//! asks the supervisor which daemons run and stops them when the last share goes.
//!
//! ```text
//!  plugin ──unix socket, one JSON request per connection──▶ supervisor ──spawns, reaps──▶ daemons
//!         {"op":"start","key":"gpu-0","uuid":"GPU-…","defaults":{…}}   (foreground children, driver-root
//!         {"op":"send","key":"gpu-0","command":"get_default_…"}          PATH, LD_LIBRARY_PATH = links to
//!         {"op":"stop","key":"gpu-0"} · {"op":"pid",…} · {"op":"running"}   NVIDIA's libraries only, output
//!         {"op":"pause","reason":"…"} · {"op":"resume"}
//!                                            │                          in log/daemon.log, own /dev/shm
//!                                            ▼                          on real GPUs)
//!                     <state dir>/mps-supervisor.json: the daemons asked for, with their settings
//! ```
//!
//! **Restarts.** The daemons are the supervisor's children, so they end with its container (a drain, an OOM
//! kill, `kubectl delete pod`). What brings them back is the supervisor's own record of the daemons it was
//! asked to run, [`RECORD_FILE`]: key, device UUID and the daemon defaults (active thread percentage,
//! pinned memory limit) of every `start` not yet followed by a `stop`. A starting supervisor restores every
//! daemon of that record at once (one thread each), before it answers its first request, in the same pipe,
//! log and `/dev/shm` directories: those are bind-mounted into the running clients' containers, so the
//! restored daemon is reachable by the clients that lost the old one, with the same settings. A daemon that
//! exits on its own is restarted by the supervisor's watchdog (every second, backing off to 30 s while its
//! start fails).
//!
//! Why the supervisor keeps its own record instead of reading the plugin's checkpoint: the checkpoint is
//! the plugin's format (versioned, checksummed, phases, rollbacks of interrupted prepares) and says which
//! claims hold a share, not which daemon runs with which defaults; a second reader of it would have to
//! re-derive the plugin's decisions and move in lockstep with its format. The record holds exactly what
//! the supervisor was asked, in one small file it alone writes. It stays right across a crash of either
//! process at any moment:
//!
//! * written atomically (temp file, rename) *before* a daemon is started and *after* one is stopped, so a
//!   supervisor killed in between restores a daemon too many, never one too few;
//! * a daemon too many (its stop never acknowledged, or a prepare that failed while the supervisor was
//!   down) is stopped by the plugin, which knows the shares: its watch ([`crate::devices::sharing::Sharer::watch_daemons`])
//!   stops running daemons no prepared share uses and starts again the daemon of every prepared share
//!   that does not answer (so a record lost with its file is rebuilt too);
//! * a record of an earlier boot (the node's boot id differs) is dropped: a reboot ended the clients.
//!
//! **Driver upgrades.** A running daemon holds the GPU, so the kernel module cannot be unloaded under it.
//! When the node's driver is upgraded (`gpu::driver_upgrade`) the plugin sends `pause`: the record is
//! marked paused, every daemon quits, and none is started (by a request, the watchdog or a restarted
//! supervisor) until `resume`, which starts them again with their recorded settings on the driver there
//! then.
//!
//! **Stopping.** The supervisor is PID 1 of its container, where SIGTERM has no default action, so it
//! waits for SIGTERM and SIGINT itself: it `quit`s every daemon (in parallel; a daemon that does not exit
//! within 10 s is killed), keeps the record, and exits. The daemons end with the container anyway; quitting
//! them lets each stop its server cleanly, and the next supervisor restores them from the record.
//!
//! The supervisor trusts nothing it is sent: keys must be tessera device names, UUIDs `GPU-`/`MIG-` hex,
//! commands one of the MPS control verbs with numeric or UUID arguments; nothing reaches a shell (the
//! daemons and tools are executed directly). The socket is created mode 0600.

use std::{
    collections::{BTreeMap, HashMap},
    fs,
    io::{BufRead, BufReader, Write},
    os::unix::{
        fs::PermissionsExt,
        net::{UnixListener, UnixStream},
    },
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::mps::MpsManager;
use super::supervisor_protocol::{Answer, DaemonDefaults, REQUEST_TIMEOUT, Request, op_name};

/// MPS control verbs the supervisor forwards; `quit` only through [`Request::Stop`].
const VERBS: [&str; 6] = [
    "get_default_active_thread_percentage",
    "set_default_active_thread_percentage",
    "get_default_device_pinned_mem_limit",
    "set_default_device_pinned_mem_limit",
    "get_server_list",
    "get_device_client_list",
];

fn check_key(key: &str) -> Result<(), String> {
    // A device's one daemon (`gpu-0`) or a namespace's (`gpu-0@team-a`); never a path.
    super::supervisor_protocol::check_daemon_key(key)
}

fn check_uuid(uuid: &str) -> Result<(), String> {
    let body = uuid.strip_prefix("GPU-").or_else(|| uuid.strip_prefix("MIG-"));
    match body {
        Some(b) if !b.is_empty() && b.chars().all(|c| c.is_ascii_hexdigit() || c == '-') => Ok(()),
        _ => Err(format!("uuid {uuid:?} is not a GPU-… or MIG-… UUID")),
    }
}

fn check_command(command: &str) -> Result<(), String> {
    let mut words = command.split_whitespace();
    let verb = words.next().unwrap_or_default();
    if !VERBS.contains(&verb) {
        return Err(format!("command {command:?} is not one of {VERBS:?}"));
    }
    let args: Vec<&str> = words.collect();
    let plain = |a: &&str| {
        a.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
    };
    if args.len() > 2 || !args.iter().all(plain) {
        return Err(format!(
            "command {command:?} has arguments other than numbers and UUIDs"
        ));
    }
    Ok(())
}

/// Checks a request before anything runs.
pub fn validate(req: &Request) -> Result<(), String> {
    match req {
        Request::Start { key, uuid, .. } => check_key(key).and_then(|()| check_uuid(uuid)),
        Request::Stop { key } | Request::Pid { key } => check_key(key),
        Request::Send { key, command } => check_key(key).and_then(|()| check_command(command)),
        Request::Running | Request::Resume => Ok(()),
        Request::Pause { reason } if reason.len() > 512 || reason.contains('\n') => {
            Err("a pause reason is one line of at most 512 characters".into())
        }
        Request::Pause { .. } => Ok(()),
    }
}

/// The supervisor's record of the daemons it runs, in the state directory (see the module comment).
pub const RECORD_FILE: &str = "mps-supervisor.json";

/// What [`RECORD_FILE`] holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonRecord {
    /// The node's boot id when written; a record of another boot is not restored.
    pub boot_id: String,
    /// The daemons asked for, by key.
    #[serde(default)]
    pub daemons: BTreeMap<String, DaemonSpec>,
    /// Set while the daemons are stopped for a driver upgrade ([`Request::Pause`]): why. Kept in the
    /// record so that a supervisor restarted meanwhile does not start them on the driver being unloaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<String>,
}

/// One daemon to run: its device and the defaults applied after each start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DaemonSpec {
    pub uuid: String,
    #[serde(default)]
    pub defaults: DaemonDefaults,
}

impl DaemonRecord {
    /// Reads the record at `path`; a missing file is an empty record. Entries that would not pass
    /// [`validate`] are left out (with a warning), so a damaged file restores what it still can.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = match fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        let mut record: Self =
            serde_json::from_str(&text).map_err(|e| format!("cannot parse {}: {e}", path.display()))?;
        record.daemons.retain(|key, spec| {
            let ok = check_key(key).and_then(|()| check_uuid(&spec.uuid));
            if let Err(e) = &ok {
                warn!(path = %path.display(), key, error = %e, "left an entry of the MPS supervisor's record out");
            }
            ok.is_ok()
        });
        Ok(record)
    }

    /// Writes the record atomically (temp file, rename): a crash leaves the old record or the new one.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        fs::write(&tmp, text)?;
        fs::rename(&tmp, path)
    }
}

/// What a supervisor's restore did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Restored {
    /// Keys whose daemon serves (started now, or found running).
    pub serving: Vec<String>,
    /// Keys whose daemon could not be started, with why; the watchdog retries them.
    pub failed: Vec<(String, String)>,
    /// Keys left out because the record is of another boot.
    pub dropped: Vec<String>,
}

/// Watchdog delays for a daemon whose start keeps failing.
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug)]
struct Retry {
    at: Instant,
    delay: Duration,
}

/// The supervisor's state: the manager that owns the daemons as children and the record of what it was
/// asked to run. The record's mutex also serializes starts, stops, restores and the watchdog (all rare and
/// short); queries run concurrently.
pub struct Supervisor {
    manager: MpsManager,
    path: PathBuf,
    boot_id: String,
    record: Mutex<DaemonRecord>,
    retries: Mutex<HashMap<String, Retry>>,
    stopping: AtomicBool,
}

impl Supervisor {
    /// A supervisor over `manager` (which must own its daemons, [`MpsManager::owning_children`]) whose
    /// record lives in the manager's state directory; `boot_id` is the node's.
    pub fn new(manager: MpsManager, boot_id: &str) -> Self {
        let path = manager.state_dir().join(RECORD_FILE);
        Self {
            manager,
            path,
            boot_id: boot_id.trim().to_string(),
            record: Mutex::new(DaemonRecord {
                boot_id: boot_id.trim().to_string(),
                daemons: BTreeMap::new(),
                paused: None,
            }),
            retries: Mutex::default(),
            stopping: AtomicBool::new(false),
        }
    }

    pub fn manager(&self) -> &MpsManager {
        &self.manager
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DaemonRecord> {
        self.record.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The daemons the record asks for.
    pub fn desired(&self) -> BTreeMap<String, DaemonSpec> {
        self.lock().daemons.clone()
    }

    fn save(&self, record: &DaemonRecord) {
        if let Err(e) = record.save(&self.path) {
            // The daemon still runs; only a restart of this supervisor would miss it (the plugin's watch
            // starts it again then).
            warn!(path = %self.path.display(), error = %e, "cannot write the MPS supervisor's record");
        }
    }

    /// Loads the record and starts every daemon it names, all at once; run before serving requests.
    pub fn restore(&self) -> Restored {
        let began = Instant::now();
        let mut record = self.lock();
        let mut out = Restored::default();
        let loaded = match DaemonRecord::load(&self.path) {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "cannot restore the MPS daemons of the last supervisor; the plugin's watch \
                    starts those of prepared shares again");
                DaemonRecord::default()
            }
        };
        if !loaded.daemons.is_empty() && loaded.boot_id != self.boot_id {
            out.dropped = loaded.daemons.keys().cloned().collect();
            info!(keys = ?out.dropped, "not restoring MPS daemons recorded before the node's last boot");
            *record = DaemonRecord {
                boot_id: self.boot_id.clone(),
                daemons: BTreeMap::new(),
                paused: None,
            };
            self.save(&record);
            return out;
        }
        *record = DaemonRecord {
            boot_id: self.boot_id.clone(),
            ..loaded
        };
        if let Some(reason) = &record.paused {
            info!(keys = ?record.daemons.keys().collect::<Vec<_>>(), reason,
                "the MPS daemons stay stopped for a driver upgrade until the plugin resumes them");
            return out;
        }
        let results: Vec<(String, Result<(), String>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = record
                .daemons
                .iter()
                .map(|(key, spec)| {
                    let key = key.clone();
                    scope.spawn(move || {
                        let r = self
                            .manager
                            .start(&key, &spec.uuid, spec.defaults)
                            .map(|_| ())
                            .map_err(|e| e.to_string());
                        (key, r)
                    })
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        for (key, result) in results {
            match result {
                Ok(()) => out.serving.push(key),
                Err(e) => {
                    warn!(key, error = %e, "cannot restore an MPS daemon; retrying");
                    self.schedule_retry(&key, false);
                    out.failed.push((key, e));
                }
            }
        }
        if !record.daemons.is_empty() {
            info!(serving = ?out.serving, failed = out.failed.len(), elapsed = ?began.elapsed(),
                "restored the MPS daemons of prepared shares");
        }
        out
    }

    fn schedule_retry(&self, key: &str, success: bool) {
        let mut retries = self.retries.lock().unwrap_or_else(|e| e.into_inner());
        if success {
            retries.remove(key);
            return;
        }
        let delay = retries
            .get(key)
            .map_or(RETRY_FIRST, |r| (r.delay * 2).min(RETRY_MAX));
        retries.insert(
            key.to_string(),
            Retry {
                at: Instant::now() + delay,
                delay,
            },
        );
    }

    /// Starts again every recorded daemon whose process is gone (it crashed, or was OOM-killed), unless a
    /// failed start of it is waiting for its retry time. Returns the keys started.
    pub fn watch_once(&self) -> Vec<String> {
        if self.stopping.load(Ordering::SeqCst) {
            return Vec::new();
        }
        let record = self.lock();
        let mut started = Vec::new();
        if record.paused.is_some() {
            return started;
        }
        for (key, spec) in &record.daemons {
            if self.manager.pid(key).is_some() {
                continue;
            }
            let due = self
                .retries
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(key)
                .is_none_or(|r| Instant::now() >= r.at);
            if !due {
                continue;
            }
            warn!(
                key,
                "the MPS daemon of a prepared share is gone; starting it again"
            );
            match self.manager.start(key, &spec.uuid, spec.defaults) {
                Ok(_) => {
                    self.schedule_retry(key, true);
                    started.push(key.clone());
                }
                Err(e) => {
                    warn!(key, error = %e, "cannot start the MPS daemon again; retrying");
                    self.schedule_retry(key, false);
                }
            }
        }
        started
    }

    /// Handles one request.
    pub fn handle(&self, req: &Request) -> Answer {
        let failed = |error: String| Answer {
            error: Some(error),
            ..Default::default()
        };
        if let Err(e) = validate(req) {
            return failed(e);
        }
        if self.stopping.load(Ordering::SeqCst) && matches!(req, Request::Start { .. } | Request::Stop { .. })
        {
            return failed("the MPS supervisor is stopping".into());
        }
        let manager = &self.manager;
        match req {
            Request::Pause { reason } => Answer {
                keys: self.pause(reason),
                ..Default::default()
            },
            Request::Resume => match self.resume() {
                Ok(keys) => Answer {
                    keys,
                    ..Default::default()
                },
                Err(e) => failed(e),
            },
            Request::Start { key, uuid, defaults } => {
                let mut record = self.lock();
                if let Some(reason) = &record.paused {
                    return failed(format!(
                        "the MPS daemons are stopped for a driver upgrade ({reason}); the plugin resumes them \
                         once the upgrade moves on"
                    ));
                }
                let spec = DaemonSpec {
                    uuid: uuid.clone(),
                    defaults: *defaults,
                };
                let previous = record.daemons.insert(key.clone(), spec);
                if previous.as_ref() != record.daemons.get(key) {
                    self.save(&record);
                }
                match manager.start(key, uuid, *defaults) {
                    Ok(_) => {
                        self.schedule_retry(key, true);
                        Answer {
                            pid: manager.pid(key),
                            ..Default::default()
                        }
                    }
                    Err(e) => {
                        // A start that never served is not restored; an earlier entry stays.
                        match previous {
                            Some(p) => record.daemons.insert(key.clone(), p),
                            None => record.daemons.remove(key),
                        };
                        self.save(&record);
                        failed(e.to_string())
                    }
                }
            }
            Request::Stop { key } => {
                let mut record = self.lock();
                // Paused: nothing runs; the share is gone, so its daemon is not resumed.
                if record.paused.is_some() {
                    if record.daemons.remove(key).is_some() {
                        self.save(&record);
                    }
                    return Answer::default();
                }
                match manager.stop(key) {
                    Ok(()) => {
                        if record.daemons.remove(key).is_some() {
                            self.save(&record);
                        }
                        self.schedule_retry(key, true);
                        Answer::default()
                    }
                    Err(e) => failed(e.to_string()),
                }
            }
            Request::Send { key, command } => match manager.send(key, command) {
                Ok(answer) => Answer {
                    answer: Some(answer),
                    ..Default::default()
                },
                Err(e) => failed(e.to_string()),
            },
            Request::Pid { key } => Answer {
                pid: manager.pid(key),
                ..Default::default()
            },
            Request::Running => Answer {
                keys: manager.running(),
                ..Default::default()
            },
        }
    }

    /// Quits every recorded daemon (in parallel) and keeps the record, for the next supervisor. A daemon
    /// that does not exit in time is killed. Requests to start or stop are refused from now on.
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let record = self.lock();
        let began = Instant::now();
        std::thread::scope(|scope| {
            for key in record.daemons.keys() {
                scope.spawn(move || {
                    // Only a child this supervisor started: never a pid file's number, which any tenant
                    // of the daemon's pipe directory can write (review N16).
                    let pid = self.manager.child_pid(key);
                    if let Err(e) = self.manager.quit(key) {
                        warn!(key, error = %e, "an MPS daemon did not quit; killing it");
                        if let Some(pid) = pid {
                            kill(pid);
                        }
                    }
                });
            }
        });
        info!(daemons = record.daemons.len(), elapsed = ?began.elapsed(),
            "quit the MPS daemons; the next supervisor restores them");
    }

    /// [`Request::Pause`]: marks the record paused (first, so that a crash meanwhile restores nothing),
    /// quits every daemon and keeps their settings. Returns the keys paused. Pausing again only updates
    /// the reason.
    pub fn pause(&self, reason: &str) -> Vec<String> {
        let mut record = self.lock();
        record.paused = Some(reason.to_string());
        self.save(&record);
        std::thread::scope(|scope| {
            for key in record.daemons.keys() {
                scope.spawn(move || {
                    // No kill by the pid file's number (any tenant of the pipe directory can write it): a
                    // daemon that does not quit is named, and the driver manager's unload says the rest.
                    if let Err(e) = self.manager.quit(key) {
                        warn!(key, error = %e, "an MPS daemon did not quit for the driver upgrade; it keeps the \
                            driver in use");
                    }
                });
            }
        });
        let keys: Vec<String> = record.daemons.keys().cloned().collect();
        info!(keys = ?keys, reason, "stopped the MPS daemons for a driver upgrade; their settings are kept");
        keys
    }

    /// [`Request::Resume`]: starts every daemon a pause stopped, with its settings, and clears the pause.
    /// Returns the keys that serve; one that fails is left to the watchdog, which retries it.
    pub fn resume(&self) -> Result<Vec<String>, String> {
        let mut record = self.lock();
        if record.paused.take().is_none() {
            return Ok(self.manager.running());
        }
        self.save(&record);
        let mut serving = Vec::new();
        for (key, spec) in &record.daemons {
            match self.manager.start(key, &spec.uuid, spec.defaults) {
                Ok(_) => {
                    self.schedule_retry(key, true);
                    serving.push(key.clone());
                }
                Err(e) => {
                    warn!(key, error = %e, "cannot start an MPS daemon again after the driver upgrade; retrying");
                    self.schedule_retry(key, false);
                }
            }
        }
        info!(serving = ?serving, "started the MPS daemons again after the driver upgrade");
        Ok(serving)
    }
}

#[allow(unsafe_code, reason = "kill(2) of a daemon this process started")]
fn kill(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: a plain system call on a pid; no memory is involved.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// Starts a thread that waits for SIGTERM or SIGINT and then runs `on_signal`. PID 1 of a container has no
/// default action for SIGTERM: without a handler the supervisor would sit out the whole termination grace
/// period. The handlers are installed before this returns (a signal from then on is not lost).
fn wait_for_termination(on_signal: impl FnOnce(&'static str) + Send + 'static) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let (mut term, mut int) = {
        let _entered = runtime.enter();
        (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?)
    };
    std::thread::spawn(move || {
        let name = runtime.block_on(async {
            tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            }
        });
        on_signal(name);
    });
    Ok(())
}

/// Serves requests on `socket` until SIGTERM or SIGINT: restores the recorded daemons first (requests
/// that arrive meanwhile wait in the socket's backlog), runs the watchdog, and on the signal quits the
/// daemons and exits the process with status 0.
pub fn serve(socket: &Path, supervisor: Supervisor) -> std::io::Result<()> {
    let supervisor = Arc::new(supervisor);
    {
        let supervisor = supervisor.clone();
        wait_for_termination(move |signal| {
            info!(signal, "MPS supervisor stopping");
            supervisor.shutdown();
            std::process::exit(0);
        })?;
    }
    if let Some(dir) = socket.parent() {
        fs::create_dir_all(dir)?;
    }
    match fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(socket)?;
    fs::set_permissions(socket, fs::Permissions::from_mode(0o600))?;
    supervisor.restore();
    info!(socket = %socket.display(), "MPS supervisor serving");
    {
        let supervisor = supervisor.clone();
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(RETRY_FIRST);
                supervisor.watch_once();
            }
        });
    }
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let supervisor = supervisor.clone();
        std::thread::spawn(move || {
            if let Err(e) = serve_one(&supervisor, stream) {
                warn!(error = %e, "MPS supervisor request failed");
            }
        });
    }
    Ok(())
}

fn serve_one(supervisor: &Supervisor, stream: UnixStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
    let answer = match serde_json::from_str::<Request>(line.trim()) {
        Ok(req) => {
            let answer = supervisor.handle(&req);
            // A command to a daemon that is down is the plugin's probe: it decides what that means.
            if let Some(e) = &answer.error
                && !matches!(req, Request::Send { .. })
            {
                warn!(op = op_name(&req), error = %e, "refused an MPS supervisor request");
            }
            answer
        }
        Err(e) => Answer {
            error: Some(format!("invalid request: {e}")),
            ..Default::default()
        },
    };
    let mut out = &stream;
    writeln!(
        out,
        "{}",
        serde_json::to_string(&answer).map_err(std::io::Error::other)?
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_with_foreign_keys_uuids_or_commands_are_refused_before_anything_runs() {
        let bad = [
            Request::Stop {
                key: "../../etc".into(),
            },
            Request::Start {
                key: "gpu-0".into(),
                uuid: "GPU-1; rm -rf /".into(),
                defaults: DaemonDefaults::default(),
            },
            Request::Send {
                key: "gpu-0".into(),
                command: "quit".into(),
            },
            Request::Send {
                key: "gpu-0".into(),
                command: "set_default_active_thread_percentage $(id)".into(),
            },
            Request::Stop {
                key: "gpu-0@../../etc".into(),
            },
            Request::Stop {
                key: "gpu-0@Team_A".into(),
            },
            Request::Stop { key: "team-a".into() },
        ];
        for req in &bad {
            assert!(validate(req).is_err(), "{req:?} must be refused");
        }
        let good = [
            Request::Start {
                key: "gpu-1-mig-3g-40gb-4".into(),
                uuid: "MIG-0a1b2c3d-0000-1111-2222-333344445555".into(),
                defaults: DaemonDefaults::default(),
            },
            Request::Send {
                key: "gpu-0".into(),
                command: "set_default_device_pinned_mem_limit 0 1024M".into(),
            },
            Request::Start {
                key: "gpu-0@team-a".into(),
                uuid: "GPU-ab".into(),
                defaults: DaemonDefaults::default(),
            },
            Request::Running,
        ];
        for req in &good {
            assert_eq!(validate(req), Ok(()), "{req:?}");
        }
    }

    #[test]
    fn requests_round_trip_as_one_json_line() {
        let req = Request::Start {
            key: "gpu-0".into(),
            uuid: "GPU-ab".into(),
            defaults: DaemonDefaults {
                active_thread_percentage: Some(30),
                pinned_memory_bytes: None,
            },
        };
        let line = serde_json::to_string(&req).unwrap();
        assert!(line.starts_with(r#"{"op":"start","key":"gpu-0""#), "{line}");
        assert_eq!(serde_json::from_str::<Request>(&line).unwrap(), req);
    }
}
