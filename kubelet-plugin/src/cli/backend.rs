//! The backend flags the plugin and its subcommands share: opening the GPUs, MPS, health, driver watch.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use clap::ValueEnum;
use tokio::sync::watch;
use tracing::warn;

use crate::cli::error::{Error, Result};
use crate::devices::sharing::mps::Launcher;
use crate::gpu::GpuBackend;
use crate::gpu::driver_root::DriverRoot;
use crate::gpu::nvml::NvmlBackend;
#[cfg(feature = "simulated")]
use tessera_sim_model::backend::SimulatedBackend;

/// Which GPUs the plugin drives.
#[derive(Debug, clap::Args)]
pub(super) struct BackendArgs {
    /// `nvml` for real GPUs, `simulated` for GPUs described by a node file.
    #[arg(long, env = "TESSERA_BACKEND", value_enum, default_value_t = BackendKind::Nvml)]
    pub(super) backend: BackendKind,

    /// Node file of the simulated backend, e.g. `gpus: [{model: H100-SXM5-80GB, count: 8}]`.
    #[arg(long, env = "TESSERA_SIMULATED_NODE_FILE")]
    pub(super) simulated_node_file: Option<PathBuf>,

    /// Root of the NVIDIA driver installation on the host: what CDI specs name (`/`, the GPU Operator's
    /// `/run/nvidia/driver`, GKE's `/home/kubernetes/bin/nvidia`).
    #[arg(long, env = "TESSERA_DRIVER_ROOT", default_value = "/")]
    pub(super) driver_root: PathBuf,

    /// Where this process sees `--driver-root`: NVML, `nvidia-smi`, the MPS tools and every file handed to
    /// containers are read here, and specs name them at their `--driver-root` path. By default the same
    /// path (a plugin on the host); the chart mounts the host's driver root at `/driver-root`.
    #[arg(long, env = "TESSERA_CONTAINER_DRIVER_ROOT")]
    pub(super) container_driver_root: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum BackendKind {
    Nvml,
    Simulated,
}

impl BackendArgs {
    /// Where this process reads the driver root (`--container-driver-root`, else `--driver-root`).
    pub(super) fn read_root(&self) -> &Path {
        self.container_driver_root.as_deref().unwrap_or(&self.driver_root)
    }

    /// The driver root of an opened backend, with the host path specs name: the flags' for NVML; the
    /// simulated backend's own root lies in the state dir, which the chart mounts at its host path.
    pub(super) fn driver_root_of(&self, backend: &dyn GpuBackend) -> DriverRoot {
        match self.backend {
            BackendKind::Nvml => DriverRoot::mounted(&self.driver_root, backend.driver_root()),
            BackendKind::Simulated => DriverRoot::new(backend.driver_root()),
        }
    }

    /// How MPS control daemons are started: NVIDIA's tool from the driver root, or this binary's simulated
    /// daemon.
    pub(super) fn mps_launcher(&self, supervisor: Option<PathBuf>) -> Result<Launcher> {
        if let Some(socket) = supervisor {
            return Ok(Launcher::Supervisor { socket });
        }
        Ok(match self.backend {
            BackendKind::Simulated => Launcher::Simulated {
                program: std::env::current_exe().map_err(|source| Error::MpsControlSim { source })?,
            },
            BackendKind::Nvml => {
                // The daemon runs in this process's filesystem: the read path, never the host's.
                let root = DriverRoot::new(self.read_root());
                Launcher::Nvidia {
                    control: root
                        .find_binary("nvidia-cuda-mps-control")
                        .and_then(|p| root.resolve(&p))
                        .unwrap_or_else(|| self.read_root().join("usr/bin/nvidia-cuda-mps-control")),
                    driver_root: self.read_root().to_path_buf(),
                }
            }
        })
    }

    /// Where device health comes from: the simulated fault file, or NVML's events and probe.
    pub(super) fn health_source(
        &self,
        state_dir: &Path,
        gpu_count: u32,
        ignored_xids: Vec<u32>,
    ) -> Result<Box<dyn crate::gpu::health::HealthSource>> {
        match self.backend {
            #[cfg(not(feature = "simulated"))]
            BackendKind::Simulated => {
                let _ = state_dir;
                Err(Error::SimulatedNotBuilt)
            }
            #[cfg(feature = "simulated")]
            BackendKind::Simulated => {
                let kernel = tessera_sim_model::backend::kernel_dir_in(state_dir).map_err(|source| {
                    Error::OpenBackend {
                        backend: "simulated health".into(),
                        source,
                    }
                })?;
                let source = crate::gpu::health::sources::SimulatedSource::new(
                    tessera_sim_model::faults::SimulatedHealth::new(&kernel, gpu_count),
                    ignored_xids,
                );
                // The NVLink fabric too, as the NVML source reads it; without the hardware model (a kernel
                // directory that does not open) the faults alone are still watched.
                Ok(Box::new(
                    match tessera_sim_model::backend::SimulatedBackend::open_kernel(&kernel) {
                        Ok(hardware) => source.with_fabric(hardware, gpu_count),
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot open the simulated hardware; its NVLink fabric is not watched");
                            source
                        }
                    },
                ))
            }
            BackendKind::Nvml => {
                let backend = NvmlBackend::new(self.read_root()).map_err(|source| Error::OpenBackend {
                    backend: format!("nvml events (driver root {})", self.read_root().display()),
                    source,
                })?;
                Ok(Box::new(crate::gpu::health::sources::NvmlSource::new(
                    Arc::new(backend),
                    gpu_count,
                    ignored_xids,
                )))
            }
        }
    }

    pub(super) fn open(&self, node_name: &str, state_dir: &Path) -> Result<Arc<dyn GpuBackend>> {
        match self.backend {
            #[cfg(not(feature = "simulated"))]
            BackendKind::Simulated => {
                let _ = (node_name, state_dir);
                Err(Error::SimulatedNotBuilt)
            }
            #[cfg(feature = "simulated")]
            BackendKind::Simulated => {
                let file = self
                    .simulated_node_file
                    .as_deref()
                    .ok_or(Error::MissingSimulatedNodeFile)?;
                let backend = tessera_sim_model::backend::kernel_dir_in(state_dir)
                    .and_then(|kernel| SimulatedBackend::new(node_name, file, &kernel))
                    .map_err(|source| Error::OpenBackend {
                        backend: "simulated".into(),
                        source,
                    })?;
                Ok(Arc::new(backend))
            }
            BackendKind::Nvml => {
                let backend = NvmlBackend::new(self.read_root()).map_err(|source| Error::OpenBackend {
                    backend: format!("nvml (driver root {})", self.read_root().display()),
                    source,
                })?;
                Ok(Arc::new(backend))
            }
        }
    }

    /// Creates the `nvidia-uvm` device nodes where a real driver's module is loaded without them, or says
    /// how to load it ([`crate::gpu::driver_watch::check_uvm`]). Nothing for a simulated driver, whose `/proc`
    /// is not the host's.
    pub(super) fn ensure_uvm_nodes(&self) {
        if self.backend != BackendKind::Nvml {
            return;
        }
        let proc_root = crate::gpu::nvml::proc_root_for(self.read_root());
        if proc_root == Path::new("/proc") {
            crate::gpu::driver_watch::check_uvm(Path::new("/dev"), &proc_root);
        }
    }
}

/// The driver upgrade watch of a plugin on the nvml backend (see [`crate::gpu::driver_watch`]): where a change
/// goes and how the plugin is stopped.
pub(super) struct DriverWatchSetup {
    /// Between two reads; zero: no watch.
    pub(super) interval: Duration,
    /// Set by the watch; [`crate::cli::args::Args::run`] returns [`Error::DriverChanged`] after a clean
    /// shutdown.
    pub(super) change: Arc<std::sync::OnceLock<crate::gpu::driver_watch::DriverChange>>,
    pub(super) stop: watch::Sender<bool>,
}

impl DriverWatchSetup {
    /// Starts the watch of the driver the plugin serves (`serving`, NVML's version), unless it is off, the
    /// backend is simulated (no driver root), or NVML reported no version.
    pub(super) fn spawn(
        self,
        backend: &BackendArgs,
        serving: Option<String>,
        stop_rx: watch::Receiver<bool>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        if self.interval.is_zero() || backend.backend != BackendKind::Nvml {
            return None;
        }
        let Some(serving) = serving else {
            warn!("NVML reported no driver version: a driver upgrade under the plugin goes unnoticed");
            return None;
        };
        let root = DriverRoot::mounted(&backend.driver_root, backend.read_root());
        let proc_root = crate::gpu::nvml::proc_root_for(backend.read_root());
        Some(tokio::spawn(async move {
            let change =
                crate::gpu::driver_watch::watch_driver(root, proc_root, serving, self.interval, stop_rx)
                    .await;
            if let Some(change) = change {
                let message = change.message();
                warn!(from = %change.from, to = %change.to, "{message}");
                crate::gpu::driver_watch::write_termination_message(
                    Path::new(crate::gpu::driver_watch::TERMINATION_LOG),
                    &message,
                );
                let _ = self.change.set(change);
                self.stop.send_replace(true);
            }
        }))
    }
}
