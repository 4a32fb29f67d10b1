//! `mps-supervisor` (owns the node's MPS control daemons) and `mps-control-sim` (a simulated control daemon).

use std::path::PathBuf;

use crate::cli::backend::{BackendArgs, BackendKind};
use crate::cli::error::{Error, Result};
use crate::devices::sharing::mps::MpsManager;

#[derive(Debug, clap::Args)]
pub(super) struct MpsSupervisorArgs {
    /// Unix socket the plugin talks to (`--mps-supervisor-socket` of the plugin).
    #[arg(
        long,
        env = "TESSERA_MPS_SUPERVISOR_SOCKET",
        default_value = "/var/lib/tessera/mps-supervisor.sock"
    )]
    socket: PathBuf,

    /// State directory; must be the plugin's (the daemons' pipe directories live there).
    #[arg(long, env = "TESSERA_STATE_DIR", default_value = "/var/lib/tessera")]
    state_dir: PathBuf,

    /// `nvml` runs NVIDIA's daemon from the driver root; `simulated` the plugin binary's simulated one.
    #[arg(long, env = "TESSERA_BACKEND", value_enum, default_value_t = BackendKind::Nvml)]
    backend: BackendKind,

    /// Root of the NVIDIA driver installation on the host.
    #[arg(long, env = "TESSERA_DRIVER_ROOT", default_value = "/")]
    driver_root: PathBuf,

    /// Where this process sees `--driver-root` (the daemons run from here); by default the same path.
    #[arg(long, env = "TESSERA_CONTAINER_DRIVER_ROOT")]
    container_driver_root: Option<PathBuf>,

    /// A writable tmpfs directory: as the plugin's `--driver-params-mask-dir`, so that the MPS daemons this
    /// process starts never create or change device nodes. Off when unset.
    #[arg(long, env = "TESSERA_DRIVER_PARAMS_MASK_DIR")]
    driver_params_mask_dir: Option<PathBuf>,

    /// File holding the node's boot id; daemons recorded under another boot id are not restored.
    #[arg(
        long,
        env = "TESSERA_BOOT_ID_FILE",
        default_value = "/proc/sys/kernel/random/boot_id"
    )]
    boot_id_file: PathBuf,
}

impl MpsSupervisorArgs {
    pub(super) fn run(self) -> Result<()> {
        // Before any daemon starts: they inherit this mount namespace.
        if let Some(dir) = &self.driver_params_mask_dir {
            crate::cli::driver_params::mask(dir)?;
        }
        let backend = BackendArgs {
            backend: self.backend,
            simulated_node_file: None,
            driver_root: self.driver_root,
            container_driver_root: self.container_driver_root,
        };
        // On real GPUs each daemon gets a tmpfs of its own as /dev/shm (needs CAP_SYS_ADMIN), which the
        // plugin hands to the daemon's clients; simulated daemons use no shared memory.
        let private_shm = self.backend == BackendKind::Nvml;
        let manager =
            MpsManager::new(&self.state_dir, backend.mps_launcher(None)?).owning_children(private_shm);
        let boot_id = std::fs::read_to_string(&self.boot_id_file).map_err(|source| Error::ReadBootId {
            path: self.boot_id_file.clone(),
            source,
        })?;
        let supervisor = crate::devices::sharing::supervisor::Supervisor::new(manager, &boot_id);
        crate::devices::sharing::supervisor::serve(&self.socket, supervisor).map_err(|source| {
            Error::MpsSupervisor {
                socket: self.socket.clone(),
                source,
            }
        })
    }
}

#[derive(Debug, clap::Args)]
pub(super) struct MpsControlSimArgs {
    /// Directory of the control socket and pid file.
    #[arg(long, env = "CUDA_MPS_PIPE_DIRECTORY")]
    pipe_dir: PathBuf,
    /// Directory of `control.log`.
    #[arg(long, env = "CUDA_MPS_LOG_DIRECTORY")]
    log_dir: PathBuf,
    /// Start the daemon in the background and return once it serves (like `nvidia-cuda-mps-control -d`).
    #[arg(long, env = "TESSERA_MPS_DETACH")]
    detach: bool,
}

impl MpsControlSimArgs {
    pub(super) fn run(self) -> Result<()> {
        let Self {
            pipe_dir,
            log_dir,
            detach,
        } = self;
        let program = std::env::current_exe().map_err(|source| Error::MpsControlSim { source })?;
        crate::devices::sharing::mps::run_sim_daemon(&program, &pipe_dir, &log_dir, detach)
            .map_err(|source| Error::MpsControlSim { source })
    }
}
