//! `simulate`: makes a simulated GPU sick or well, builds simulated driver roots and out-of-band MIG devices.

use std::path::{Path, PathBuf};

use clap::Subcommand;

use crate::cli::error::{Error, Result};
use crate::gpu::GpuBackend;
use tessera_sim_model::backend::SimulatedBackend;

#[derive(Debug, clap::Args)]
pub(super) struct SimulateArgs {
    #[command(subcommand)]
    action: SimulateAction,

    /// State directory of the simulated node (the plugin's `--state-dir`).
    #[arg(
        long,
        env = "TESSERA_STATE_DIR",
        default_value = "/var/lib/tessera",
        global = true
    )]
    state_dir: PathBuf,

    /// Node file of the simulated node (the plugin's), to check the GPU index.
    #[arg(long, env = "TESSERA_SIMULATED_NODE_FILE", global = true)]
    simulated_node_file: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum SimulateAction {
    /// A critical-error event with this XID (an application XID such as 13 leaves the GPU healthy).
    InjectXid {
        #[arg(long)]
        gpu: u32,
        #[arg(long)]
        xid: u32,
        /// Attribute the event to this GPU instance (a MIG device), as NVML's `gpuInstanceId`.
        #[arg(long)]
        gpu_instance: Option<u32>,
    },
    /// A double-bit ECC error event.
    InjectEcc {
        #[arg(long)]
        gpu: u32,
        #[arg(long)]
        gpu_instance: Option<u32>,
    },
    /// The GPU falls off the bus (`NVML_ERROR_GPU_IS_LOST`).
    LoseGpu {
        #[arg(long)]
        gpu: u32,
    },
    /// The GPU was reset and works again: every fault of it is cleared.
    Recover {
        #[arg(long)]
        gpu: u32,
    },
    /// The GPU answers every NVML call with an error: a library/kernel-module mismatch (18, as after a
    /// driver upgrade without a reboot), the driver not loaded (9), or uninitialized (1).
    FailGpu {
        #[arg(long)]
        gpu: u32,
        #[arg(long, value_enum)]
        error: FailingError,
    },
    /// The GPU's NVLink fabric degrades: `nvmlDeviceGetGpuFabricInfoV` answers health summary
    /// LIMITED_CAPACITY with degraded bandwidth, or with `--unhealthy` UNHEALTHY (fabric manager gone, a
    /// route down). `recover` clears it. Only a GPU with `fabric:` in the node file has a fabric to degrade.
    DegradeFabric {
        #[arg(long)]
        gpu: u32,
        #[arg(long)]
        unhealthy: bool,
    },
    /// Print the faults in effect as JSON.
    Show,
    /// Make a simulated kernel K (`kernel.json`, hardware state, `/proc`) for the node file's GPUs and a
    /// driver root R over it, with the libraries and tools this repository builds (`cargo build
    /// --workspace`); the `nvml` backend with `--driver-root R` then drives the simulated GPUs.
    DriverRoot {
        /// The driver root to make (NVIDIA's layout; `R/tessera-sim` links to the kernel).
        #[arg(long)]
        root: PathBuf,
        /// The simulated kernel directory (created; existing hardware state for the same GPUs is kept).
        #[arg(long)]
        kernel: PathBuf,
        /// Node name the GPU UUIDs derive from.
        #[arg(long, env = "NODE_NAME")]
        node_name: String,
        /// Node file, e.g. `gpus: [{model: H100-SXM5-80GB, count: 8}]`.
        #[arg(long)]
        node_file: PathBuf,
        /// Whose driver root to imitate: `host` (usr/lib/x86_64-linux-gnu, usr/bin), `operator` (the GPU
        /// Operator's distribution rootfs, with a decoy libc.so.6 and loader beside NVIDIA's libraries) or
        /// `gke` (lib64/ and bin/ only).
        #[arg(long, value_enum, default_value_t = tessera_sim_model::driver_root::Layout::Host)]
        layout: tessera_sim_model::driver_root::Layout,
    },
    /// Set a synthetic load on a device (utilization and memory, for the per-claim usage metrics).
    Load(tessera_sim_model::load::LoadArgs),
    /// Make a MIG device outside tessera, as mig-manager or `nvidia-smi mig -cgi <profile> -C` would:
    /// MIG mode on, one GPU instance at the placement and one compute instance; prints it as JSON.
    CreateMig {
        #[arg(long)]
        gpu: u32,
        /// GPU-instance profile, e.g. `1g.10gb`.
        #[arg(long)]
        profile: String,
        /// First memory slice of the placement.
        #[arg(long, default_value_t = 0)]
        start: u32,
    },
    /// Hold the GPUs open through NVML until killed, as DCGM's nv-hostengine, dcgm-exporter or GPU
    /// feature discovery do: init the driver root's `libnvidia-ml.so.1`, look up every GPU, print one line
    /// (`holding GPUs [0, 1] as pid 1234`) and sleep. While it runs, a MIG mode change of those GPUs by
    /// any other process stays pending (NVML_ERROR_IN_USE), though `nvidia-smi` lists no process for it.
    HoldNvml {
        /// The driver root whose `libnvidia-ml.so.1` to use (`simulate driver-root --root`).
        #[arg(long)]
        driver_root: PathBuf,
    },
    /// Upgrade a simulated driver root in place to another driver version, as a driver container does:
    /// new `<lib>.so.<version>` files, the soname links repointed, the old files removed, and the
    /// simulated kernel module reporting the new version.
    UpgradeDriver {
        /// The driver root (`simulate driver-root --root`).
        #[arg(long)]
        root: PathBuf,
        /// The new driver version, e.g. `580.200.01`.
        #[arg(long)]
        version: String,
    },
}

/// The NVML errors `simulate fail-gpu` makes a GPU answer.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum FailingError {
    LibraryMismatch,
    DriverNotLoaded,
    Uninitialized,
}

/// `simulate create-mig`: a MIG device no tessera claim owns, on the simulated kernel of `state_dir`.
fn create_mig_out_of_band(state_dir: &Path, gpu: u32, profile: &str, start: u32) -> Result<()> {
    let fail = |reason: String| Error::SimulateCreateMig { reason };
    let kernel = tessera_sim_model::backend::kernel_dir_in(state_dir).map_err(|e| fail(e.to_string()))?;
    let backend = SimulatedBackend::open_kernel(&kernel).map_err(|e| fail(e.to_string()))?;
    let discovered = backend.discover().map_err(|e| fail(e.to_string()))?;
    let info = discovered
        .gpus
        .iter()
        .find(|g| g.index == gpu)
        .ok_or_else(|| fail(format!("--gpu {gpu}: the simulated node has no such GPU")))?;
    let dev = crate::gpu::mig::prepare_mig(&backend, info, profile, start, None)
        .map_err(|e| fail(e.to_string()))?;
    println!("{}", serde_json::to_string_pretty(&dev).unwrap_or_default());
    Ok(())
}

/// `simulate hold-nvml`: an NVML client that holds every GPU it sees until the process is killed.
fn hold_nvml(driver_root: &Path) -> Result<()> {
    use std::io::Write;
    let nvml = crate::gpu::nvml::NvmlBackend::new(driver_root)
        .map_err(|source| Error::SimulateHoldNvml { source })?;
    let gpus: Vec<u32> = nvml
        .discover()
        .map_err(|source| Error::SimulateHoldNvml { source })?
        .gpus
        .iter()
        .map(|g| g.index)
        .collect();
    let mut out = std::io::stdout().lock();
    // One line, flushed: what a test waits for before it expects the GPUs held.
    let _ = writeln!(out, "holding GPUs {gpus:?} as pid {}", std::process::id());
    let _ = out.flush();
    drop(out);
    loop {
        std::thread::park();
    }
}

impl SimulateArgs {
    pub(super) fn run(self) -> Result<()> {
        use tessera_sim_model::faults::{Fault, FaultKind, SimulatedHealth};
        let Self {
            action,
            state_dir,
            simulated_node_file,
        } = self;
        if let SimulateAction::Load(load) = action {
            return tessera_sim_model::backend::kernel_dir_in(&state_dir)
                .and_then(|kernel| load.run(&kernel))
                .map_err(|source| Error::SimulateLoad { source });
        }
        if let SimulateAction::CreateMig { gpu, profile, start } = &action {
            return create_mig_out_of_band(&state_dir, *gpu, profile, *start);
        }
        if let SimulateAction::HoldNvml { driver_root } = &action {
            return hold_nvml(driver_root);
        }
        if let SimulateAction::UpgradeDriver { root, version } = action {
            let done = tessera_sim_model::driver_root::upgrade(&root, &version)
                .map_err(|source| Error::SimulateUpgradeDriver { source })?;
            println!(
                "upgraded {} from {} to {version} (removed {})",
                root.display(),
                done.from.as_deref().unwrap_or("an unversioned driver"),
                done.removed
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            return Ok(());
        }
        if let SimulateAction::DriverRoot {
            root,
            kernel,
            node_name,
            node_file,
            layout,
        } = action
        {
            let make = || -> crate::gpu::Result<()> {
                let spec = tessera_sim_model::backend::NodeSpec::from_file(&node_file)?;
                SimulatedBackend::from_spec(&node_name, &spec, &kernel)?;
                let dirs = tessera_sim_model::driver_root::artifact_dirs();
                tessera_sim_model::driver_root::install_layout(&root, &kernel, &dirs, layout)?
                    .require_complete(&dirs)
            };
            return make().map_err(|source| Error::SimulateDriverRoot { source });
        }
        let file = simulated_node_file.ok_or(Error::MissingSimulatedNodeFile)?;
        let node = tessera_sim_model::backend::NodeSpec::from_file(&file)
            .map_err(|source| Error::SimulateFault { source })?;
        let kernel = tessera_sim_model::backend::kernel_dir_in(&state_dir)
            .map_err(|source| Error::SimulateFault { source })?;
        let faults = SimulatedHealth::new(&kernel, node.gpus.iter().map(|g| g.count).sum());
        let fault = |gpu, gpu_instance, kind, xid| Fault {
            gpu,
            gpu_instance,
            kind,
            xid,
        };
        let done = match action {
            SimulateAction::InjectXid {
                gpu,
                xid,
                gpu_instance,
            } => faults.inject(fault(gpu, gpu_instance, FaultKind::Xid, Some(xid))),
            SimulateAction::InjectEcc { gpu, gpu_instance } => {
                faults.inject(fault(gpu, gpu_instance, FaultKind::DoubleBitEcc, None))
            }
            SimulateAction::LoseGpu { gpu } => faults.inject(fault(gpu, None, FaultKind::Lost, None)),
            SimulateAction::Recover { gpu } => faults.recover(gpu),
            SimulateAction::FailGpu { gpu, error } => faults.inject(Fault::failing(
                gpu,
                match error {
                    FailingError::LibraryMismatch => FaultKind::LibraryMismatch,
                    FailingError::DriverNotLoaded => FaultKind::DriverNotLoaded,
                    FailingError::Uninitialized => FaultKind::Uninitialized,
                },
            )),
            SimulateAction::DegradeFabric { gpu, unhealthy } => faults.inject(Fault::failing(
                gpu,
                if unhealthy {
                    FaultKind::FabricUnhealthy
                } else {
                    FaultKind::FabricDegraded
                },
            )),
            SimulateAction::Show => faults.faults().map(|f| {
                println!("{}", serde_json::to_string_pretty(&f).unwrap_or_default());
            }),
            SimulateAction::Load(_)
            | SimulateAction::DriverRoot { .. }
            | SimulateAction::UpgradeDriver { .. }
            | SimulateAction::HoldNvml { .. }
            | SimulateAction::CreateMig { .. } => {
                unreachable!("handled above")
            }
        };
        done.map_err(|source| Error::SimulateFault { source })
    }
}
