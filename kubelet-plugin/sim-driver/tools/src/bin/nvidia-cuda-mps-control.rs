//! tessera's simulated `nvidia-cuda-mps-control`, used as NVIDIA's is:
//!
//! * `nvidia-cuda-mps-control -d`: starts the control daemon in the background and returns once it serves;
//! * `nvidia-cuda-mps-control -f`: runs the daemon in the foreground (until `quit`);
//! * without either: reads commands from stdin, one per line, sends each to the daemon and prints its
//!   answer (`echo get_default_active_thread_percentage | nvidia-cuda-mps-control`).
//!
//! The daemon ([`ControlDaemon`]) is the plugin's: one implementation behind this tool and the plugin's
//! `mps-control-sim`. It lives in `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`: control socket and
//! pid file) and logs to `CUDA_MPS_LOG_DIRECTORY` (default `/var/log/nvidia-mps`: `control.log`), serves
//! the devices of its `CUDA_VISIBLE_DEVICES`, and starts `nvidia-cuda-mps-server` from this program's
//! directory for its first client.

use std::{
    io::BufRead,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use tessera_kubelet_plugin::devices::sharing::mps::{
    ControlDaemon, detach_daemon, send_control, sibling_server,
};
use tessera_sim_model::backend::Latencies;

const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";
const DEFAULT_LOG_DIR: &str = "/var/log/nvidia-mps";

fn dir_from_env(key: &str, default: &str) -> PathBuf {
    std::env::var_os(key)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(default))
}

fn main() -> ExitCode {
    let pipe_dir = dir_from_env("CUDA_MPS_PIPE_DIRECTORY", DEFAULT_PIPE_DIR);
    let log_dir = dir_from_env("CUDA_MPS_LOG_DIRECTORY", DEFAULT_LOG_DIR);
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        ["-d"] => daemonize(&pipe_dir, &log_dir),
        ["-f"] => foreground(&pipe_dir, &log_dir),
        [] => commands(&pipe_dir),
        ["-h" | "--help"] => {
            println!("Usage: nvidia-cuda-mps-control [-d | -f]");
            ExitCode::SUCCESS
        }
        other => {
            eprintln!("Invalid arguments {other:?}\nUsage: nvidia-cuda-mps-control [-d | -f]");
            ExitCode::FAILURE
        }
    }
}

fn self_path() -> Option<PathBuf> {
    std::env::current_exe().ok()
}

fn daemonize(pipe_dir: &Path, log_dir: &Path) -> ExitCode {
    if send_control(pipe_dir, "get_default_active_thread_percentage").is_ok() {
        eprintln!("An instance of this daemon is already running");
        return ExitCode::FAILURE;
    }
    let Some(program) = self_path() else {
        eprintln!("nvidia-cuda-mps-control: cannot find its own path");
        return ExitCode::FAILURE;
    };
    let mut cmd = Command::new(program);
    cmd.arg("-f");
    match detach_daemon(cmd, pipe_dir, log_dir) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvidia-cuda-mps-control: failed to start the daemon: {e}");
            ExitCode::FAILURE
        }
    }
}

fn foreground(pipe_dir: &Path, log_dir: &Path) -> ExitCode {
    // What the daemon spends starting before it serves: the simulated kernel's `mpsDaemonStartMs`.
    if let Some(program) = self_path() {
        Latencies::charge(Latencies::of_kernel_near(&program).mps_daemon_start_ms);
    }
    let server = self_path().as_deref().and_then(sibling_server);
    match ControlDaemon::new(pipe_dir, log_dir).server(server).serve() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvidia-cuda-mps-control: {e}");
            ExitCode::FAILURE
        }
    }
}

fn commands(pipe_dir: &Path) -> ExitCode {
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        match send_control(pipe_dir, command) {
            Ok(answer) => {
                if !answer.is_empty() {
                    println!("{answer}");
                }
            }
            Err(e) => {
                eprintln!(
                    "Cannot find MPS control daemon process ({}: {e})",
                    pipe_dir.join("control").display()
                );
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
