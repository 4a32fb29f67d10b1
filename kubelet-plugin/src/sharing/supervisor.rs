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
//!                                                                       in log/daemon.log, own /dev/shm
//!                                                                       on real GPUs)
//! ```
//!
//! The supervisor trusts nothing it is sent: keys must be tessera device names, UUIDs `GPU-`/`MIG-` hex,
//! commands one of the MPS control verbs with numeric or UUID arguments; nothing reaches a shell (the
//! daemons and tools are executed directly). The socket is created mode 0600.

use std::{
    fs,
    io::{BufRead, BufReader, Write},
    os::unix::{
        fs::PermissionsExt,
        net::{UnixListener, UnixStream},
    },
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use serde::{Deserialize, Serialize};
use tessera_api::DeviceName;
use tracing::{info, warn};

use super::mps::{DaemonDefaults, MpsManager};

/// One request to the supervisor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase", deny_unknown_fields)]
pub enum Request {
    /// Start the daemon of `key` on device `uuid` unless it runs; apply `defaults`.
    Start {
        key: String,
        uuid: String,
        defaults: DaemonDefaults,
    },
    /// `quit` the daemon of `key`, wait for it, remove its directories.
    Stop { key: String },
    /// Send one control command.
    Send { key: String, command: String },
    /// The daemon's pid, if it runs.
    Pid { key: String },
    /// Keys of the running daemons.
    Running,
}

/// The supervisor's answer; `error` set means the request failed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Answer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<String>,
}

/// A failed exchange with the supervisor.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    /// The socket could not be used.
    #[error(
        "cannot reach the MPS supervisor at {socket}: {reason}; is the mps-supervisor container running and \
         sharing the plugin's state directory?"
    )]
    Unreachable { socket: PathBuf, reason: String },
    /// The supervisor answered with an error.
    #[error("the MPS supervisor refused {op}: {reason}")]
    Refused { op: &'static str, reason: String },
}

/// Starting a daemon may take up to its own start timeout (10 s) plus the default settings.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

fn op_name(req: &Request) -> &'static str {
    match req {
        Request::Start { .. } => "start",
        Request::Stop { .. } => "stop",
        Request::Send { .. } => "send",
        Request::Pid { .. } => "pid",
        Request::Running => "running",
    }
}

/// Sends one request and returns the answer.
pub fn request(socket: &Path, req: &Request) -> Result<Answer, SupervisorError> {
    let unreachable = |e: std::io::Error| SupervisorError::Unreachable {
        socket: socket.to_path_buf(),
        reason: e.to_string(),
    };
    let mut stream = UnixStream::connect(socket).map_err(unreachable)?;
    stream
        .set_read_timeout(Some(REQUEST_TIMEOUT))
        .map_err(unreachable)?;
    stream
        .set_write_timeout(Some(REQUEST_TIMEOUT))
        .map_err(unreachable)?;
    let line = serde_json::to_string(req).map_err(|e| unreachable(std::io::Error::other(e)))?;
    writeln!(stream, "{line}").map_err(unreachable)?;
    stream.shutdown(std::net::Shutdown::Write).map_err(unreachable)?;
    let mut reply = String::new();
    BufReader::new(&stream)
        .read_line(&mut reply)
        .map_err(unreachable)?;
    let answer: Answer = serde_json::from_str(reply.trim())
        .map_err(|e| unreachable(std::io::Error::other(format!("unreadable answer {reply:?}: {e}"))))?;
    match answer.error {
        Some(reason) => Err(SupervisorError::Refused {
            op: op_name(req),
            reason,
        }),
        None => Ok(answer),
    }
}

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
    match key.parse::<DeviceName>() {
        Ok(d) if d.to_string() == key => Ok(()),
        _ => Err(format!(
            "key {key:?} is not a tessera device name (e.g. gpu-0, gpu-1-mig-3g-40gb-4)"
        )),
    }
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
        Request::Running => Ok(()),
    }
}

/// Handles one request with `manager` (which owns the daemons as children).
pub fn handle(manager: &MpsManager, req: &Request) -> Answer {
    let failed = |error: String| Answer {
        error: Some(error),
        ..Default::default()
    };
    if let Err(e) = validate(req) {
        return failed(e);
    }
    match req {
        Request::Start { key, uuid, defaults } => match manager.start(key, uuid, *defaults) {
            Ok(_) => Answer {
                pid: manager.pid(key),
                ..Default::default()
            },
            Err(e) => failed(e.to_string()),
        },
        Request::Stop { key } => match manager.stop(key) {
            Ok(()) => Answer::default(),
            Err(e) => failed(e.to_string()),
        },
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

/// Serves requests on `socket` until the process is stopped. Starts and stops are serialized (they are
/// rare and short); queries run concurrently.
pub fn serve(socket: &Path, manager: MpsManager) -> std::io::Result<()> {
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
    info!(socket = %socket.display(), "MPS supervisor serving");
    let manager = Arc::new(manager);
    let changes = Arc::new(Mutex::new(()));
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let (manager, changes) = (manager.clone(), changes.clone());
        std::thread::spawn(move || {
            if let Err(e) = serve_one(&manager, &changes, stream) {
                warn!(error = %e, "MPS supervisor request failed");
            }
        });
    }
    Ok(())
}

fn serve_one(manager: &MpsManager, changes: &Mutex<()>, stream: UnixStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
    let answer = match serde_json::from_str::<Request>(line.trim()) {
        Ok(req) => {
            let _guard = matches!(req, Request::Start { .. } | Request::Stop { .. })
                .then(|| changes.lock().unwrap_or_else(|e| e.into_inner()));
            let answer = handle(manager, &req);
            if let Some(e) = &answer.error {
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
