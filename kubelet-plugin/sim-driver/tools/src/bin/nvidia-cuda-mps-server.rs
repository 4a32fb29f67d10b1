//! tessera's simulated `nvidia-cuda-mps-server`: started by the control daemon for its first client,
//! it logs its devices and limits to `server.log` and runs until the daemon stops it. See
//! [`tessera_kubelet_plugin::devices::sharing::mps::run_server`].
//!
//! Before it serves, it opens its GPU as a real server does, and the GPU's compute mode decides as on a
//! real one (nvml.h, `nvmlComputeMode_t`): `NVML_COMPUTEMODE_EXCLUSIVE_PROCESS` is "only one context per
//! device", `NVML_COMPUTEMODE_PROHIBITED` "no contexts per device"; NVIDIA's MPS guide sets
//! EXCLUSIVE_PROCESS so that the MPS server is the only process that opens the GPU. So a second MPS server
//! (another control daemon's: another namespace's) on a GPU in EXCLUSIVE_PROCESS mode, while a live server
//! holds it, fails to start, as does any server on a PROHIBITED GPU. The servers holding a
//! GPU are recorded in the simulated kernel (`<kernel>/mps-servers/<GPU uuid>/<pid>`), the model having
//! no other notion of a process holding a GPU.

use std::{
    fs::{self, File},
    io::Write,
    path::PathBuf,
};

use tessera_gpu_api::{ComputeMode, GpuBackend};
use tessera_sim_model::backend::{SimulatedBackend, locate_kernel};

fn main() {
    let held = match open_gpu() {
        Ok(held) => held,
        Err(reason) => {
            log(&format!("cannot open the GPU: {reason}"));
            eprintln!("nvidia-cuda-mps-server: {reason}");
            std::process::exit(1);
        }
    };
    let result = tessera_kubelet_plugin::devices::sharing::mps::run_server();
    drop(held);
    if let Err(e) = result {
        eprintln!("nvidia-cuda-mps-server: {e}");
        std::process::exit(1);
    }
}

/// This server's entry in the kernel's record of the servers holding its GPU; removed at exit.
struct Held(Option<PathBuf>);

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = fs::remove_file(path);
        }
    }
}

/// Opens the GPU of `CUDA_VISIBLE_DEVICES` (a `GPU-` UUID; a MIG device's GPU stays in DEFAULT mode under
/// tessera and is not checked) in the simulated kernel near this program, refusing as a real driver
/// would (see the module comment).
fn open_gpu() -> Result<Held, String> {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
    let uuid = visible.split(',').next().unwrap_or_default().trim().to_string();
    let kernel = std::env::current_exe().ok().and_then(|p| locate_kernel(&p));
    let (Some(kernel), true) = (kernel, uuid.starts_with("GPU-")) else {
        return Ok(Held(None));
    };
    let backend = SimulatedBackend::open_kernel(&kernel).map_err(|e| e.to_string())?;
    let gpus = backend.discover().map_err(|e| e.to_string())?.gpus;
    let Some(gpu) = gpus.iter().find(|g| g.uuid == uuid) else {
        return Err(format!("no GPU {uuid}"));
    };
    let dir = kernel.join("mps-servers").join(&uuid);
    // A kernel directory this process cannot write (mounted read-only) records nothing: the check needs
    // the record, so it is skipped there, which the simulator's README lists.
    if fs::create_dir_all(&dir).is_err() {
        return Ok(Held(None));
    }
    let lock = File::create(dir.join(".lock")).map_err(|e| e.to_string())?;
    lock.lock().map_err(|e| e.to_string())?;
    let me = std::process::id();
    let holders: Vec<u32> = fs::read_dir(&dir)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|pid| *pid != me && alive(*pid))
        .collect();
    match backend.compute_mode(gpu.index).map_err(|e| e.to_string())? {
        ComputeMode::Prohibited => {
            return Err(format!(
                "all CUDA-capable devices are busy or unavailable: GPU {uuid} is in PROHIBITED compute mode"
            ));
        }
        ComputeMode::ExclusiveProcess if !holders.is_empty() => {
            return Err(format!(
                "all CUDA-capable devices are busy or unavailable: GPU {uuid} is in EXCLUSIVE_PROCESS compute \
                 mode and MPS server {holders:?} holds it"
            ));
        }
        _ => {}
    }
    let path = dir.join(me.to_string());
    fs::write(&path, "").map_err(|e| e.to_string())?;
    Ok(Held(Some(path)))
}

fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()) != Some("Z"))
}

/// One line in `$CUDA_MPS_LOG_DIRECTORY/server.log` (best effort).
fn log(line: &str) {
    let dir = std::env::var_os("CUDA_MPS_LOG_DIRECTORY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/log/nvidia-mps"));
    if let Ok(mut f) = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("server.log"))
    {
        let _ = writeln!(f, "server pid={} {line}", std::process::id());
    }
}
