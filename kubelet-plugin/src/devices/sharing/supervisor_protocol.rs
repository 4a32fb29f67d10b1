//! The MPS supervisor's protocol: one JSON request per connection on its unix socket, and the client
//! side of it that the plugin's daemon manager ([`super::mps`]) uses. The supervisor itself
//! ([`super::supervisor`]) serves it.

use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::{Deserialize, Serialize};
use tessera_api::DeviceName;

/// Separates the device key from the namespace in a per-namespace daemon key (`gpu-0@team-a`): neither a
/// device name nor a namespace (a DNS label) contains it.
pub const TENANT_SEPARATOR: char = '@';

/// The device key and the namespace of a daemon key (`daemon_key`); no namespace for a device's one
/// daemon.
pub fn split_daemon_key(key: &str) -> (&str, Option<&str>) {
    match key.split_once(TENANT_SEPARATOR) {
        Some((device, namespace)) => (device, Some(namespace)),
        None => (key, None),
    }
}

/// Checks a daemon key: a device name as `share_key` writes it, then optionally `@` and a namespace
/// (a DNS label: what the API server allows, and nothing that leaves the daemon's directory).
pub fn check_daemon_key(key: &str) -> Result<(), String> {
    let (device, namespace) = split_daemon_key(key);
    let device_ok = device
        .parse::<DeviceName>()
        .is_ok_and(|d| d.to_string() == device);
    let namespace_ok = namespace.is_none_or(|n| {
        (1..=63).contains(&n.len())
            && n.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !n.starts_with('-')
            && !n.ends_with('-')
    });
    if device_ok && namespace_ok {
        Ok(())
    } else {
        Err(format!(
            "key {key:?} is not a tessera device name (e.g. gpu-0, gpu-1-mig-3g-40gb-4), optionally followed \
             by @<namespace>"
        ))
    }
}

/// Settings applied to a daemon right after start (servers spawned later inherit them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DaemonDefaults {
    pub active_thread_percentage: Option<u32>,
    pub pinned_memory_bytes: Option<u64>,
}

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
    /// Quit every daemon and start none until [`Request::Resume`], keeping each one's settings: the node's
    /// driver is being upgraded and its kernel module cannot be unloaded while a daemon holds the GPU
    /// (`gpu::driver_upgrade`). `reason` names the upgrade in the supervisor's log and refusals.
    Pause { reason: String },
    /// Start again every daemon a [`Request::Pause`] quit, with its settings (on the driver there now).
    Resume,
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
pub(super) const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

pub(super) fn op_name(req: &Request) -> &'static str {
    match req {
        Request::Start { .. } => "start",
        Request::Stop { .. } => "stop",
        Request::Send { .. } => "send",
        Request::Pid { .. } => "pid",
        Request::Running => "running",
        Request::Pause { .. } => "pause",
        Request::Resume => "resume",
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

/// [`Request::Pause`]: the supervisor quits every daemon, keeping their settings, until [`resume`]. Returns
/// the keys paused.
pub fn pause(socket: &Path, reason: &str) -> Result<Vec<String>, SupervisorError> {
    let req = Request::Pause {
        reason: reason.to_string(),
    };
    request(socket, &req).map(|a| a.keys)
}

/// [`Request::Resume`]: the supervisor starts again, with their settings, the daemons a pause quit (none
/// when nothing was paused). Returns the keys that serve.
pub fn resume(socket: &Path) -> Result<Vec<String>, SupervisorError> {
    request(socket, &Request::Resume).map(|a| a.keys)
}
