//! Command line and start-up: every flag has an environment fallback (the DaemonSet sets env), and
//! [`Args::run`] wires the parts together.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use clap::{Parser, Subcommand, ValueEnum};
use tessera_api::NodeInventorySpec;
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::watch,
};
use tracing::{info, warn};

use crate::cli::error::{Error, Result};
use crate::devices::preparers;
use crate::devices::preparers::SharedPreparer;
use crate::devices::sharing::Sharer;
use crate::devices::sharing::mps::{Launcher, MpsManager};
use crate::gpu::GpuBackend;
use crate::gpu::driver_root::{CdiHook, DriverFiles, DriverRoot};
use crate::gpu::health::Health;
use crate::gpu::nvml::NvmlBackend;
use crate::gpu::simulated::SimulatedBackend;
use crate::kubelet::claims::KubeClaims;
use crate::kubelet::coexistence::CoexistenceMode;
use crate::kubelet::driver;
use crate::kubelet::driver::SocketPaths;
use crate::kubelet::health_service::HealthService;
use crate::kubelet::inventory::{InventoryPublisher, LeaseConfig};
use crate::kubelet::registration::RegistrationState;
use crate::node::state::{NodeState, RECONCILE_INTERVAL, StateConfig, StateLock};

/// tessera's kubelet plugin: discovers the node's NVIDIA GPUs, publishes them as a NodeInventory, and
/// prepares DRA ResourceClaims for kubelet (CDI specs, MIG devices, shares).
#[derive(Debug, Parser)]
#[command(
    name = "tessera-kubelet-plugin",
    version,
    about,
    subcommand_negates_reqs = true
)]
pub struct Args {
    #[command(subcommand)]
    command: Option<Command>,

    /// Name of this node (the downward API's spec.nodeName); also the pool name of its devices.
    #[arg(long, env = "NODE_NAME", required = true)]
    node_name: Option<String>,

    #[command(flatten)]
    backend: BackendArgs,

    /// Directory of the prepared-claims checkpoint and the simulated hardware state.
    #[arg(long, env = "TESSERA_STATE_DIR", default_value = "/var/lib/tessera")]
    state_dir: PathBuf,

    /// kubelet's plugin registry directory, where the registration socket goes.
    #[arg(
        long,
        env = "TESSERA_KUBELET_REGISTRY_DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    kubelet_registry_dir: PathBuf,

    /// kubelet's plugins directory; the DRA socket is `<dir>/gpu.tessera.dev/dra.sock`.
    #[arg(
        long,
        env = "TESSERA_KUBELET_PLUGINS_DIR",
        default_value = "/var/lib/kubelet/plugins"
    )]
    kubelet_plugins_dir: PathBuf,

    /// UID of the plugin's pod (the downward API's metadata.uid). With it the sockets get names of their
    /// own, so the new pod of a rolling update (maxSurge) registers beside the old one and takes the node
    /// state over when the old one exits; without it the fixed names (one instance per node: a host
    /// process, the local cluster).
    #[arg(long, env = "POD_UID")]
    pod_uid: Option<String>,

    /// Directory the container runtime reads CDI specs from.
    #[arg(long, env = "TESSERA_CDI_DIR", default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,

    /// Unix socket of the node's MPS supervisor (`mps-supervisor`); without it the plugin starts MPS
    /// daemons itself, and they die with the plugin's container.
    #[arg(long, env = "TESSERA_MPS_SUPERVISOR_SOCKET")]
    mps_supervisor_socket: Option<PathBuf>,

    /// Host path of NVIDIA's `nvidia-cdi-hook` (NVIDIA container toolkit), to run instead of tessera's own
    /// hook: the specs then call it for `create-symlinks`, `enable-cuda-compat` and `update-ldcache`, and
    /// nothing is installed.
    #[arg(long, env = "TESSERA_CDI_HOOK")]
    cdi_hook: Option<PathBuf>,

    /// Host directory tessera's CDI hook (`tessera-cdi-hook`, shipped next to this binary) is installed
    /// into at start, and which CDI specs name; this process must see it at its host path (the chart's
    /// stateDir is). Default: `<state dir>/bin`.
    #[arg(long, env = "TESSERA_CDI_HOOK_DIR")]
    cdi_hook_dir: Option<PathBuf>,

    /// kubeconfig file; without it the in-cluster configuration is used.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,

    /// Address for kubelet's probes: `GET /livez` (the plugin's runtime answers) and `GET /readyz` (kubelet
    /// has registered the plugin), e.g. `:8081`. Off when unset.
    #[arg(long, env = "TESSERA_HEALTH_ADDR", value_parser = tessera_api::health::parse_listen_addr)]
    health_addr: Option<std::net::SocketAddr>,

    /// XIDs to treat as harmless on top of NVIDIA's application XIDs (13, 31, 43, 45, 68, 109), e.g.
    /// `94,119`; an XID listed here never makes a GPU unhealthy.
    #[arg(long, env = "TESSERA_IGNORED_XIDS", value_delimiter = ',')]
    ignored_xids: Vec<u32>,

    /// Seconds between heartbeats, each a renewal of the node's Lease (the controller's timeout defaults
    /// to 40).
    #[arg(long, env = "TESSERA_HEARTBEAT_INTERVAL", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    heartbeat_interval: u64,

    /// Namespace of the node's heartbeat Lease: the controller's lease namespace (the chart's release
    /// namespace).
    #[arg(long, env = "TESSERA_LEASE_NAMESPACE", default_value = "tessera-system")]
    lease_namespace: String,

    /// Name of the controller's leader-election Lease, read to learn whether the leader reads node Leases.
    #[arg(long, env = "TESSERA_LEASE_NAME", default_value = "tessera-controller")]
    controller_lease: String,

    /// File holding the node's boot id; a checkpoint written under another boot id is discarded.
    #[arg(
        long,
        env = "TESSERA_BOOT_ID_FILE",
        default_value = "/proc/sys/kernel/random/boot_id"
    )]
    boot_id_file: PathBuf,

    /// What to do when another GPU manager is on the node: `refuse` publishes no devices next to a device
    /// plugin that advertises `nvidia.com/gpu` or `nvidia.com/mig-*`, and leaves a MIG layout that
    /// mig-manager (`nvidia.com/mig.config`) or GKE owns alone; `warn` serves as if alone. Either way the
    /// NodeInventory's `Coexistence` condition says what was found.
    #[arg(long, env = "TESSERA_COEXISTENCE", value_enum, default_value_t = CoexistenceMode::Refuse)]
    coexistence: CoexistenceMode,

    /// The host's `/proc` as this process sees it, where NVML's PIDs are: a share's processes are found
    /// there (their cgroup names their pod). The chart mounts it read-only at `/host/proc`, so the plugin
    /// needs no `hostPID`.
    #[arg(long, env = "TESSERA_HOST_PROC", default_value = "/proc")]
    host_proc: PathBuf,

    /// Seconds between two reads of the driver root's version (nvml backend): a driver upgrade under the
    /// running plugin makes it exit so that kubelet restarts it on the new driver (kubelet-plugin/README.md,
    /// "Driver upgrades"). 0 turns the watch off.
    #[arg(long, env = "TESSERA_DRIVER_WATCH_INTERVAL", default_value_t = crate::gpu::driver_watch::DEFAULT_WATCH_INTERVAL.as_secs())]
    driver_watch_interval: u64,

    /// Write device metadata (KEP-5304) for each prepared claim: a JSON file per request, under
    /// `<state dir>/device-metadata`, that the claim's containers read at
    /// `/var/run/kubernetes.io/dra-device-attributes/…/gpu.tessera.dev-metadata.json` (kubelet-plugin/README.md,
    /// "Device metadata").
    #[arg(long, env = "TESSERA_DEVICE_METADATA", default_value_t = true, action = clap::ArgAction::Set)]
    device_metadata: bool,

    /// Log format.
    #[arg(long, env = "TESSERA_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the node's GPUs (the NodeInventory spec) as YAML and exit; needs no cluster.
    Discover(DiscoverArgs),
    /// Run a simulated MPS control daemon (what the simulated backend starts per shared device).
    #[command(name = "mps-control-sim", hide = true)]
    MpsControlSim(MpsControlSimArgs),
    /// Run the node's MPS supervisor: owns the MPS control daemons so they outlive plugin restarts (its
    /// own container; see the README).
    MpsSupervisor(MpsSupervisorArgs),
    /// Make a simulated GPU sick or well again (an XID, a double-bit ECC error, a lost GPU, a recovery);
    /// the running plugin notices within about a second.
    Simulate(SimulateArgs),
    /// Wait until the NVIDIA driver is installed under the driver root (its `libnvidia-ml.so.1` and the
    /// loaded kernel module), printing what is missing at intervals: the chart's init container.
    WaitForDriver(WaitForDriverArgs),
}

#[derive(Debug, clap::Args)]
struct SimulateArgs {
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
        #[arg(long, value_enum, default_value_t = crate::gpu::sim_driver_root::Layout::Host)]
        layout: crate::gpu::sim_driver_root::Layout,
    },
    /// Set a synthetic load on a device (utilization and memory, for the per-claim usage metrics).
    Load(crate::gpu::simulated_load::LoadArgs),
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
    let kernel = crate::gpu::simulated::kernel_dir_in(state_dir).map_err(|e| fail(e.to_string()))?;
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

impl SimulateArgs {
    fn run(self) -> Result<()> {
        use crate::gpu::simulated_health::{Fault, FaultKind, SimulatedHealth};
        let Self {
            action,
            state_dir,
            simulated_node_file,
        } = self;
        if let SimulateAction::Load(load) = action {
            return crate::gpu::simulated::kernel_dir_in(&state_dir)
                .and_then(|kernel| load.run(&kernel))
                .map_err(|source| Error::SimulateLoad { source });
        }
        if let SimulateAction::CreateMig { gpu, profile, start } = &action {
            return create_mig_out_of_band(&state_dir, *gpu, profile, *start);
        }
        if let SimulateAction::UpgradeDriver { root, version } = action {
            let done = crate::gpu::sim_driver_root::upgrade(&root, &version)
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
                let spec = crate::gpu::simulated::NodeSpec::from_file(&node_file)?;
                SimulatedBackend::from_spec(&node_name, &spec, &kernel)?;
                let dirs = crate::gpu::sim_driver_root::artifact_dirs();
                crate::gpu::sim_driver_root::install_layout(&root, &kernel, &dirs, layout)?
                    .require_complete(&dirs)
            };
            return make().map_err(|source| Error::SimulateDriverRoot { source });
        }
        let file = simulated_node_file.ok_or(Error::MissingSimulatedNodeFile)?;
        let node = crate::gpu::simulated::NodeSpec::from_file(&file)
            .map_err(|source| Error::SimulateFault { source })?;
        let kernel = crate::gpu::simulated::kernel_dir_in(&state_dir)
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
            SimulateAction::Show => faults.faults().map(|f| {
                println!("{}", serde_json::to_string_pretty(&f).unwrap_or_default());
            }),
            SimulateAction::Load(_)
            | SimulateAction::DriverRoot { .. }
            | SimulateAction::UpgradeDriver { .. }
            | SimulateAction::CreateMig { .. } => {
                unreachable!("handled above")
            }
        };
        done.map_err(|source| Error::SimulateFault { source })
    }
}

#[derive(Debug, clap::Args)]
struct MpsSupervisorArgs {
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

    /// File holding the node's boot id; daemons recorded under another boot id are not restored.
    #[arg(
        long,
        env = "TESSERA_BOOT_ID_FILE",
        default_value = "/proc/sys/kernel/random/boot_id"
    )]
    boot_id_file: PathBuf,
}

impl MpsSupervisorArgs {
    fn run(self) -> Result<()> {
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
struct MpsControlSimArgs {
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
    fn run(self) -> Result<()> {
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

#[derive(Debug, clap::Args)]
struct DiscoverArgs {
    #[command(flatten)]
    backend: BackendArgs,

    /// Node name to print in the spec.
    #[arg(long, env = "NODE_NAME", default_value = "localhost")]
    node_name: String,

    /// State directory of the simulated backend; by default a fresh one (GPUs as the node file describes
    /// them, MIG mode as configured there).
    #[arg(long, env = "TESSERA_STATE_DIR")]
    state_dir: Option<PathBuf>,

    /// Print, instead of the inventory, the CDI spec a claim of all the node's whole GPUs would get
    /// (device nodes, driver libraries and binaries found under the driver root). Reads only: nothing is
    /// written and no GPU setting changes.
    #[arg(long)]
    cdi: bool,

    /// Print, instead of the inventory, every MIG device that exists now (GPU index, GPU and compute
    /// instance ids, profile, placement and the `MIG-…` UUID as the plugin reads it), one per line. Reads
    /// only: no MIG mode changes and no instance is created (`make gpu-check` compares it with
    /// `nvidia-smi -L`).
    #[arg(long, conflicts_with = "cdi")]
    mig_devices: bool,

    /// With `--cdi`: the host path of `nvidia-cdi-hook`, as the plugin's `--cdi-hook`; without it the spec
    /// names tessera's hook where the plugin installs it by default (`/var/lib/tessera/bin`).
    #[arg(long, env = "TESSERA_CDI_HOOK")]
    cdi_hook: Option<PathBuf>,
}

/// Which GPUs the plugin drives.
#[derive(Debug, clap::Args)]
struct BackendArgs {
    /// `nvml` for real GPUs, `simulated` for GPUs described by a node file.
    #[arg(long, env = "TESSERA_BACKEND", value_enum, default_value_t = BackendKind::Nvml)]
    backend: BackendKind,

    /// Node file of the simulated backend, e.g. `gpus: [{model: H100-SXM5-80GB, count: 8}]`.
    #[arg(long, env = "TESSERA_SIMULATED_NODE_FILE")]
    simulated_node_file: Option<PathBuf>,

    /// Root of the NVIDIA driver installation on the host: what CDI specs name (`/`, the GPU Operator's
    /// `/run/nvidia/driver`, GKE's `/home/kubernetes/bin/nvidia`).
    #[arg(long, env = "TESSERA_DRIVER_ROOT", default_value = "/")]
    driver_root: PathBuf,

    /// Where this process sees `--driver-root`: NVML, `nvidia-smi`, the MPS tools and every file handed to
    /// containers are read here, and specs name them at their `--driver-root` path. By default the same
    /// path (a plugin on the host); the chart mounts the host's driver root at `/driver-root`.
    #[arg(long, env = "TESSERA_CONTAINER_DRIVER_ROOT")]
    container_driver_root: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    Nvml,
    Simulated,
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

impl Args {
    /// Installs the tracing subscriber (`RUST_LOG` filters, `info` by default).
    pub fn init_tracing(&self) {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        // Colors only on a terminal: escape codes in a pod's log file are noise.
        let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_ansi(ansi);
        match self.log_format {
            LogFormat::Text => builder.init(),
            LogFormat::Json => builder.json().init(),
        }
    }

    /// Runs the plugin (or the `discover` subcommand) until SIGTERM or SIGINT.
    pub async fn run(self) -> Result<()> {
        // Every layer's events count from here on.
        crate::metrics::sink::install(crate::metrics::prometheus::metrics());
        let Self {
            command,
            node_name,
            backend,
            state_dir,
            kubelet_registry_dir,
            kubelet_plugins_dir,
            pod_uid,
            cdi_dir,
            cdi_hook,
            cdi_hook_dir,
            mps_supervisor_socket,
            kubeconfig,
            heartbeat_interval,
            lease_namespace,
            controller_lease,
            health_addr,
            boot_id_file,
            ignored_xids,
            coexistence,
            host_proc,
            driver_watch_interval,
            device_metadata,
            log_format: _,
        } = self;
        match command {
            Some(Command::Discover(args)) => return args.run(),
            Some(Command::MpsControlSim(args)) => return args.run(),
            Some(Command::MpsSupervisor(args)) => return args.run(),
            Some(Command::Simulate(args)) => return args.run(),
            Some(Command::WaitForDriver(args)) => return args.run(),
            None => {}
        }
        let node_name = node_name.ok_or(Error::MissingNodeName)?;
        let pod_uid = pod_uid.map(checked_pod_uid).transpose()?;
        let paths = SocketPaths::for_pod(&kubelet_registry_dir, &kubelet_plugins_dir, pod_uid.as_deref());
        let holder = match &pod_uid {
            Some(uid) => format!("pod {uid} (pid {})", std::process::id()),
            None => format!("pid {}", std::process::id()),
        };

        let (stop_tx, stop_rx) = watch::channel(false);
        let driver_change = Arc::new(std::sync::OnceLock::new());
        let mut sigterm = signal(SignalKind::terminate()).map_err(Error::Signals)?;
        let mut sigint = signal(SignalKind::interrupt()).map_err(Error::Signals)?;
        let signal_stop = stop_tx.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = sigterm.recv() => info!("received SIGTERM"),
                _ = sigint.recv() => info!("received SIGINT"),
            }
            signal_stop.send_replace(true);
        });

        let (registration_tx, registration_rx) = watch::channel(RegistrationState::Pending);
        if let Some(addr) = health_addr {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| Error::BindHealth { addr, source })?;
            info!(%addr, "health probes and metrics: GET /livez, /readyz, /metrics");
            tokio::spawn(tessera_api::health::serve_with_metrics(
                listener,
                health_checks(registration_rx.clone()),
                Some(Arc::new(|| crate::metrics::prometheus::metrics().render())),
            ));
        }

        // With the fixed socket names there is one instance per node: it owns the state before it binds,
        // so a second one started by mistake waits instead of taking over the first one's sockets. With
        // names of its own, the new pod of a rolling update serves (and gets registered) first and takes the
        // state over once the old pod, stopped because this one is ready, has exited (state/handover.rs).
        let mut lock = None;
        if pod_uid.is_none() {
            match StateLock::acquire(&state_dir, &holder, stop_rx.clone()).await? {
                Some(l) => lock = Some(l),
                None => return Ok(()),
            }
        }
        for path in driver::remove_stale_sockets(&paths) {
            info!(socket = %path.display(), "cleaned up after a plugin instance that was killed");
        }
        let (gate_tx, gate) = driver::StateGate::closed(StateLock::path_in(&state_dir));
        // Served from the start like the DRA service; it reports devices once the state is owned.
        let health = Health::new(std::iter::empty());
        let health_service = HealthService::new(health.clone(), node_name.clone());
        let mut serving = {
            let (paths, mut stopped) = (paths.clone(), stop_rx.clone());
            let health_service = health_service.clone();
            tokio::spawn(async move {
                driver::serve_gated(&paths, gate, registration_tx, Some(health_service), async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
            })
        };
        if pod_uid.is_some() {
            wait_for_fixed_name_instance(&paths, stop_rx.clone()).await;
            // A socket that cannot be bound ends the serving task: report it now, not after a handover.
            tokio::select! {
                acquired = StateLock::acquire(&state_dir, &holder, stop_rx.clone()) => lock = acquired?,
                served = &mut serving => return Ok(served.unwrap_or(Ok(()))?),
            }
        }

        let owned = match lock {
            Some(_) => {
                let setup = NodeSetup {
                    node_name,
                    backend,
                    state_dir,
                    cdi_dir,
                    cdi_hook,
                    cdi_hook_dir,
                    mps_supervisor_socket,
                    kubeconfig,
                    heartbeat_interval,
                    leases: LeaseConfig {
                        namespace: lease_namespace,
                        controller_lease,
                    },
                    boot_id_file,
                    health,
                    health_service,
                    ignored_xids,
                    coexistence,
                    host_proc,
                    device_metadata,
                    driver_watch: DriverWatchSetup {
                        interval: Duration::from_secs(driver_watch_interval),
                        change: driver_change.clone(),
                        stop: stop_tx.clone(),
                    },
                };
                setup.take_over(gate_tx, registration_rx, stop_rx.clone()).await
            }
            // Stopped while waiting for the old instance: nothing of the node was touched, and the calls
            // waiting at the gate fail at once.
            None => {
                drop(gate_tx);
                Ok(Vec::new())
            }
        };
        if owned.is_err() {
            stop_tx.send_replace(true);
        }
        let served = serving.await.unwrap_or_else(|e| {
            warn!(error = %e, "the kubelet sockets' task ended abnormally");
            Ok(())
        });
        // Also on a serve error, so the inventory is marked not ready before exiting.
        stop_tx.send_replace(true);
        for task in owned? {
            if let Err(e) = task.await {
                warn!(error = %e, "a background task ended abnormally");
            }
        }
        // The lock goes last: the calls in flight and the reconcile have finished, so the next instance
        // loads a checkpoint nothing changes any more.
        drop(lock);
        if let Some(change) = driver_change.get() {
            return Err(Error::DriverChanged {
                from: change.from.clone(),
                to: change.to.clone(),
            });
        }
        Ok(served?)
    }
}

/// Waits while a plugin without a pod UID (a version from before per-pod socket names) serves on this
/// node: it takes no state lock, so the new pod must not load the state before that one is gone.
async fn wait_for_fixed_name_instance(paths: &SocketPaths, mut stop: watch::Receiver<bool>) {
    let fixed = paths.fixed_registration();
    let mut logged = false;
    while driver::socket_is_live(&fixed) {
        if !logged {
            info!(socket = %fixed.display(), "a plugin instance without per-pod socket names serves on this \
                node; waiting for it to exit before taking over the node state");
            logged = true;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// A pod UID as the downward API gives it; refused otherwise, as it becomes part of socket file names.
fn checked_pod_uid(uid: String) -> Result<String> {
    let valid =
        !uid.is_empty() && uid.len() <= 64 && uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
    if valid {
        Ok(uid)
    } else {
        Err(Error::InvalidPodUid { uid })
    }
}

/// The hook the specs call: NVIDIA's at `nvidia` when given, else tessera's own, installed into `dir` from
/// next to this executable. Without a shipped hook (a build without the `tessera-cdi-hook` crate) the specs
/// carry mounts only, which the log says.
fn cdi_hook_of(nvidia: Option<PathBuf>, dir: PathBuf) -> Result<Option<CdiHook>> {
    if let Some(path) = nvidia {
        return Ok(Some(CdiHook::nvidia(path)));
    }
    let Some(source) = crate::node::cdi::shipped_hook() else {
        warn!(looked_next_to = ?std::env::current_exe().ok(),
            "tessera-cdi-hook is not shipped next to this binary: containers get no ld.so.cache update, no \
             libcuda.so link and no CUDA compat; build it (cargo build -p tessera-cdi-hook) or set --cdi-hook");
        return Ok(None);
    };
    let path = crate::node::cdi::install_hook(&source, &dir)?;
    info!(hook = %path.display(), from = %source.display(), "installed the CDI hook on the host");
    Ok(Some(CdiHook::tessera(path)))
}

/// What the plugin needs to load the node state, once it owns it.
struct NodeSetup {
    node_name: String,
    backend: BackendArgs,
    state_dir: PathBuf,
    cdi_dir: PathBuf,
    cdi_hook: Option<PathBuf>,
    cdi_hook_dir: Option<PathBuf>,
    mps_supervisor_socket: Option<PathBuf>,
    kubeconfig: Option<PathBuf>,
    heartbeat_interval: u64,
    leases: LeaseConfig,
    boot_id_file: PathBuf,
    health: Arc<Health>,
    health_service: HealthService,
    ignored_xids: Vec<u32>,
    coexistence: CoexistenceMode,
    host_proc: PathBuf,
    device_metadata: bool,
    driver_watch: DriverWatchSetup,
}

impl NodeSetup {
    /// Discovers the GPUs, loads and recovers the checkpoint, opens the gate for kubelet's calls and starts
    /// the inventory publisher and the periodic reconcile; returns their tasks, which end on `stop`.
    async fn take_over(
        self,
        gate: watch::Sender<Option<Arc<NodeState>>>,
        registration_rx: watch::Receiver<RegistrationState>,
        stop_rx: watch::Receiver<bool>,
    ) -> Result<Vec<tokio::task::JoinHandle<()>>> {
        let Self {
            node_name,
            backend,
            state_dir,
            cdi_dir,
            cdi_hook,
            cdi_hook_dir,
            mps_supervisor_socket,
            kubeconfig,
            heartbeat_interval,
            leases,
            boot_id_file,
            health,
            health_service,
            ignored_xids,
            coexistence,
            host_proc,
            device_metadata,
            driver_watch,
        } = self;
        backend.ensure_uvm_nodes();
        let gpu_backend = backend.open(&node_name, &state_dir)?;
        let health_state_dir = state_dir.clone();
        let discovered = gpu_backend.discover().map_err(|source| Error::Discover {
            backend: gpu_backend.name(),
            source,
        })?;
        let spec = NodeInventorySpec {
            node_name: node_name.clone(),
            backend: gpu_backend.name().to_string(),
            driver_version: discovered.driver_version,
            cuda_driver_version: discovered.cuda_driver_version,
            gpus: discovered.gpus,
        };
        info!(node = %node_name, backend = gpu_backend.name(), gpus = spec.gpus.len(), "discovered GPUs");
        let driver_watcher = driver_watch.spawn(&backend, spec.driver_version.clone(), stop_rx.clone());
        for u in &discovered.unusable {
            warn!(gpu = u.index, reason = %u.reason, "a GPU is left out of the inventory");
        }

        let boot_id = std::fs::read_to_string(&boot_id_file)
            .map_err(|source| Error::ReadBootId {
                path: boot_id_file.clone(),
                source,
            })?
            .trim()
            .to_string();
        let client = kube_client(kubeconfig.as_deref()).await?;
        // Another GPU manager on the node decides which GPUs are served and published (coexistence.rs).
        let verdict = crate::kubelet::coexistence::read_and_decide(&client, &node_name, coexistence).await;
        crate::kubelet::coexistence::log(&verdict);
        let served_gpus = verdict.served_gpus(&spec.gpus);
        let mut spec = spec;
        spec.gpus = verdict.published_gpus(&spec.gpus);

        let sharer = Sharer::new(
            gpu_backend.clone(),
            MpsManager::new(&state_dir, backend.mps_launcher(mps_supervisor_socket.clone())?),
            // Clients share the host's /dev/shm with daemons the plugin starts itself on real GPUs; a
            // supervisor gives each daemon its own.
            backend.backend == BackendKind::Nvml && mps_supervisor_socket.is_none(),
        );
        let driver_root = backend.driver_root_of(gpu_backend.as_ref());
        let hook = cdi_hook_of(cdi_hook, cdi_hook_dir.unwrap_or_else(|| state_dir.join("bin")))?;
        let files = DriverFiles::discover(&driver_root, spec.driver_version.as_deref()).with_hook(hook);
        info!(
            driver_root = %driver_root.host_path().display(),
            read_at = %driver_root.path().display(),
            libraries = files.libraries.len(),
            binaries = files.binaries.len(),
            hook = ?files.hook.as_ref().map(|h| &h.path),
            "found the driver files every container gets"
        );
        if files.libraries.is_empty() {
            warn!(driver_root = %driver_root.host_path().display(), read_at = %driver_root.path().display(),
                "no driver libraries found under the driver root: containers will see GPUs but not load CUDA; \
                 set --driver-root to the host directory that holds the driver (e.g. /run/nvidia/driver) and \
                 --container-driver-root to where this process has it mounted");
        }
        let shared = Arc::new(SharedPreparer::new(Arc::new(sharer), files));
        let mps_daemons = MpsManager::new(&state_dir, backend.mps_launcher(mps_supervisor_socket.clone())?);
        let usage_backend = gpu_backend.clone();
        let metadata_dir = state_dir.join("device-metadata");
        let state = NodeState::new(
            StateConfig {
                node_name: node_name.clone(),
                boot_id,
                state_dir,
                cdi_dir,
            },
            gpu_backend,
            served_gpus,
            Arc::new(KubeClaims::new(client.clone())),
        );
        let state = match device_metadata {
            true => state.with_device_metadata(
                metadata_dir,
                spec.driver_version.clone(),
                spec.cuda_driver_version.clone(),
            ),
            false => state,
        };
        let state = match verdict.keep_unowned_mig {
            true => state.keeping_unowned_mig(verdict.summary().2),
            false => state,
        };
        let sweep = shared.clone();
        let state = preparers::with_preparers(state, &shared)
            .with_orphan_sweep(Arc::new(move |gpus| sweep.stop_orphaned_daemons(gpus)));
        let (failed_tx, failed_rx) = tokio::sync::mpsc::unbounded_channel();
        let state = state.reporting_failed_prepares(failed_tx);
        // Recovery asks the API server which claims running pods use before anything is removed.
        let state = Arc::new(state);
        let recovery = state.start().await?;
        info!(?recovery, "loaded the checkpoint");

        gate.send_replace(Some(state.clone()));
        let spec_gpus = spec.gpus.clone();
        let event_client = client.clone();
        health.set_gpus(spec.gpus.iter().map(|g| g.index));
        health_service.set_devices(reported_devices(state.clone()));
        if !crate::gpu::usage::HostProc::new(&host_proc).looks_like_proc() {
            warn!(host_proc = %host_proc.display(), "--host-proc shows no processes: shares' usage gauges \
                will read 0; mount the host's /proc there read-only (the chart does, at /host/proc)");
        }
        let committed = state.clone();
        crate::metrics::prometheus::metrics().register_node(
            crate::metrics::prometheus::NodeCollector::new(
                Arc::new(move || committed.checkpoint()),
                usage_backend,
                Some(mps_daemons),
            )
            .with_health(health.clone())
            .with_host_proc(crate::gpu::usage::HostProc::new(&host_proc)),
        );
        let gpu_count = spec.gpus.iter().map(|g| g.index + 1).max().unwrap_or(0);
        let source = backend.health_source(&health_state_dir, gpu_count, ignored_xids)?;
        crate::gpu::health::spawn_monitor(source, health.clone(), mig_map(state.clone()), stop_rx.clone())
            .map_err(Error::HealthMonitor)?;
        let condition: crate::kubelet::coexistence::SharedCondition = Arc::new(std::sync::Mutex::new(
            crate::kubelet::coexistence::next_condition(None, &verdict, k8s_openapi::jiff::Timestamp::now()),
        ));
        let recheck = tokio::spawn(crate::kubelet::coexistence::recheck(
            client.clone(),
            node_name.clone(),
            coexistence,
            verdict,
            condition.clone(),
            stop_rx.clone(),
        ));
        // kubelet does not back off and retry a prepare that failed while the plugin was away; see
        // prepare_retry.
        let retry = tokio::spawn(crate::kubelet::prepare_retry::after_each_registration(
            client.clone(),
            state.clone(),
            tessera_api::DRIVER_NAME.to_string(),
            registration_rx.clone(),
            stop_rx.clone(),
        ));
        // Nor one this plugin failed for a cause that passes (the MPS supervisor's pod replaced).
        let retry_failed = tokio::spawn(crate::kubelet::prepare_retry::after_failed_prepares(
            client.clone(),
            state.clone(),
            tessera_api::DRIVER_NAME.to_string(),
            failed_rx,
            stop_rx.clone(),
        ));
        let publisher = InventoryPublisher::new(
            client,
            spec,
            Duration::from_secs(heartbeat_interval),
            registration_rx,
        )
        .with_problem_source({
            let (state, shared) = (state.clone(), shared.clone());
            Arc::new(move || {
                let mut problems = state.problems();
                problems.extend(crate::devices::sharing::daemons_down_problems(
                    &shared.sharer.daemons_down(),
                ));
                problems
            })
        })
        .with_condition_source({
            let condition = condition.clone();
            Arc::new(move || vec![condition.lock().unwrap_or_else(|e| e.into_inner()).clone()])
        })
        .with_health(health)
        .with_leases(leases);
        let publisher = tokio::spawn(publisher.run(stop_rx.clone()));
        let watch = tokio::spawn(crate::kubelet::mps_events::watch_and_report(
            shared.sharer.clone(),
            state.clone(),
            Some(crate::kubelet::mps_events::DaemonEvents::new(
                event_client,
                &node_name,
            )),
            spec_gpus,
            crate::devices::sharing::DAEMON_WATCH_INTERVAL,
            stop_rx.clone(),
        ));
        let warm = tokio::spawn(
            state
                .clone()
                .expire_warm_periodically(crate::node::warm::WARM_SWEEP_INTERVAL, stop_rx.clone()),
        );
        let reconcile = tokio::spawn(state.reconcile_periodically(RECONCILE_INTERVAL, stop_rx));
        Ok([publisher, reconcile, warm, watch, recheck, retry, retry_failed]
            .into_iter()
            .chain(driver_watcher)
            .collect())
    }
}

/// The devices kubelet may ask the health of: every whole GPU and every device of a prepared claim.
fn reported_devices(state: Arc<NodeState>) -> crate::kubelet::health_service::DeviceList {
    Arc::new(move || {
        let mut names: Vec<String> = state.gpus().map(|g| format!("gpu-{}", g.index)).collect();
        for claim in state.checkpoint().claims.values() {
            if claim.phase == crate::node::checkpoint::Phase::PrepareCompleted {
                names.extend(claim.devices.iter().map(|d| d.device.clone()));
            }
        }
        names
    })
}

/// The MIG device behind a GPU instance, from the prepared claims: NVML attributes a MIG device's events
/// to its parent GPU and GPU-instance id.
fn mig_map(state: Arc<NodeState>) -> crate::gpu::health::MigMap {
    Arc::new(move |gpu, gpu_instance| {
        state.checkpoint().claims.values().find_map(|claim| {
            claim.devices.iter().find_map(|d| match &d.detail {
                crate::node::checkpoint::DeviceDetail::Mig(m)
                    if m.gpu == gpu && m.gpu_instance == Some(gpu_instance) =>
                {
                    Some(tessera_api::inventory::MigDeviceRef {
                        profile: m.profile.clone(),
                        start: m.placement.start,
                    })
                }
                _ => None,
            })
        })
    })
}

/// Live while the runtime answers; ready once kubelet has registered the plugin, so a rolling update
/// (maxSurge) stops the old pod only after the new one serves.
fn health_checks(registration: watch::Receiver<RegistrationState>) -> tessera_api::health::Checks {
    tessera_api::health::Checks {
        live: Arc::new(|| Ok(())),
        ready: Arc::new(move || match &*registration.borrow() {
            RegistrationState::Registered => Ok(()),
            RegistrationState::Pending => Err("waiting for kubelet to register the plugin".into()),
            RegistrationState::Failed(reason) => Err(format!("kubelet rejected the plugin: {reason}")),
        }),
    }
}

impl DiscoverArgs {
    fn run(self) -> Result<()> {
        let Self {
            backend,
            node_name,
            state_dir,
            cdi,
            mig_devices,
            cdi_hook,
        } = self;
        // A throwaway state directory: discovery must not need (or change) the plugin's state.
        let scratch = std::env::temp_dir().join(format!("tessera-discover-{}", std::process::id()));
        let dir = state_dir.unwrap_or_else(|| scratch.clone());
        let result = backend.open(&node_name, &dir).and_then(|b| {
            let found = b.discover().map_err(|source| Error::Discover {
                backend: b.name(),
                source,
            })?;
            for u in &found.unusable {
                eprintln!("warning: {}", u.reason);
            }
            if mig_devices {
                return print_mig_devices(b.as_ref(), &found);
            }
            if cdi {
                let root = backend.driver_root_of(b.as_ref());
                let spec = dry_run_cdi_spec(b.as_ref(), &root, &found, cdi_hook)?;
                let json = serde_json::to_string_pretty(&spec).map_err(|e| Error::DryRunCdi {
                    device: "(spec)".into(),
                    source: crate::gpu::GpuError::InvalidArgument(e.to_string()),
                })?;
                println!("{json}");
                return Ok(());
            }
            let spec = NodeInventorySpec {
                node_name,
                backend: b.name().to_string(),
                driver_version: found.driver_version,
                cuda_driver_version: found.cuda_driver_version,
                gpus: found.gpus,
            };
            let yaml = serde_norway::to_string(&spec).map_err(Error::PrintInventory)?;
            print!("{yaml}");
            Ok(())
        });
        let _ = std::fs::remove_dir_all(&scratch);
        result
    }
}

/// One line per live MIG device. The parent's UUID is left out on purpose: a `GPU-` UUID in this output is
/// a MIG device read with its parent's identity, which `make gpu-check` reports.
fn print_mig_devices(backend: &dyn GpuBackend, found: &crate::gpu::NodeGpus) -> Result<()> {
    let mut count = 0;
    for gpu in &found.gpus {
        let instances = backend
            .list_gpu_instances(gpu.index)
            .map_err(|source| Error::Discover {
                backend: backend.name(),
                source,
            })?;
        for gi in instances {
            for ci in &gi.compute_instances {
                count += 1;
                println!(
                    "GPU {} GI {} CI {} profile {} placement {}:{} {}",
                    gpu.index, gi.id, ci.id, gi.profile_id, gi.placement.start, gi.placement.size, ci.uuid
                );
            }
        }
    }
    if count == 0 {
        println!("no MIG device exists on this node");
    }
    Ok(())
}

/// The CDI spec a claim of every discovered whole GPU would get, built as the preparers build it.
fn dry_run_cdi_spec(
    backend: &dyn GpuBackend,
    driver_root: &DriverRoot,
    found: &crate::gpu::NodeGpus,
    cdi_hook: Option<PathBuf>,
) -> Result<crate::node::cdi::Spec> {
    let hook = match cdi_hook {
        Some(path) => CdiHook::nvidia(path),
        None => CdiHook::tessera(Path::new("/var/lib/tessera/bin").join(crate::node::cdi::HOOK_BINARY)),
    };
    let files = DriverFiles::discover(driver_root, found.driver_version.as_deref()).with_hook(Some(hook));
    let mut devices = Vec::with_capacity(found.gpus.len());
    for gpu in &found.gpus {
        let device = format!("gpu-{}", gpu.index);
        let edits =
            crate::node::edits::device_edits(backend, gpu, None, &device, &gpu.uuid).map_err(|source| {
                Error::DryRunCdi {
                    device: device.clone(),
                    source,
                }
            })?;
        devices.push(crate::node::cdi::Device {
            name: crate::node::cdi::device_name("dry-run", &device),
            container_edits: edits,
        });
    }
    Ok(crate::node::cdi::Spec {
        cdi_version: crate::node::cdi::CDI_VERSION.to_string(),
        kind: crate::node::cdi::CDI_KIND.to_string(),
        devices,
        container_edits: crate::node::edits::driver_edits(&files),
    })
}

impl BackendArgs {
    /// Where this process reads the driver root (`--container-driver-root`, else `--driver-root`).
    fn read_root(&self) -> &Path {
        self.container_driver_root.as_deref().unwrap_or(&self.driver_root)
    }

    /// The driver root of an opened backend, with the host path specs name: the flags' for NVML; the
    /// simulated backend's own root lies in the state dir, which the chart mounts at its host path.
    fn driver_root_of(&self, backend: &dyn GpuBackend) -> DriverRoot {
        match self.backend {
            BackendKind::Nvml => DriverRoot::mounted(&self.driver_root, backend.driver_root()),
            BackendKind::Simulated => DriverRoot::new(backend.driver_root()),
        }
    }

    /// How MPS control daemons are started: NVIDIA's tool from the driver root, or this binary's simulated
    /// daemon.
    fn mps_launcher(&self, supervisor: Option<PathBuf>) -> Result<Launcher> {
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
    fn health_source(
        &self,
        state_dir: &Path,
        gpu_count: u32,
        ignored_xids: Vec<u32>,
    ) -> Result<Box<dyn crate::gpu::health::HealthSource>> {
        match self.backend {
            BackendKind::Simulated => {
                let kernel =
                    crate::gpu::simulated::kernel_dir_in(state_dir).map_err(|source| Error::OpenBackend {
                        backend: "simulated health".into(),
                        source,
                    })?;
                Ok(Box::new(crate::gpu::health::sources::SimulatedSource::new(
                    crate::gpu::simulated_health::SimulatedHealth::new(&kernel, gpu_count),
                    ignored_xids,
                )))
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

    fn open(&self, node_name: &str, state_dir: &Path) -> Result<Arc<dyn GpuBackend>> {
        match self.backend {
            BackendKind::Simulated => {
                let file = self
                    .simulated_node_file
                    .as_deref()
                    .ok_or(Error::MissingSimulatedNodeFile)?;
                let backend = crate::gpu::simulated::kernel_dir_in(state_dir)
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
}

/// A client from the kubeconfig file, or the in-cluster configuration. Connecting is lazy: an unreachable
/// API server shows up as failed requests (retried), not as a failed start.
async fn kube_client(kubeconfig: Option<&Path>) -> Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| Error::KubeConfig(Box::new(e)))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| Error::KubeConfig(Box::new(e)))?
        }
        None => kube::Config::incluster().map_err(|e| Error::KubeConfig(Box::new(e)))?,
    };
    kube::Client::try_from(config).map_err(|e| Error::KubeClient(Box::new(e)))
}

/// The driver upgrade watch of a plugin on the nvml backend (see [`crate::gpu::driver_watch`]): where a change
/// goes and how the plugin is stopped.
struct DriverWatchSetup {
    /// Between two reads; zero: no watch.
    interval: Duration,
    /// Set by the watch; [`Args::run`] returns [`Error::DriverChanged`] after a clean shutdown.
    change: Arc<std::sync::OnceLock<crate::gpu::driver_watch::DriverChange>>,
    stop: watch::Sender<bool>,
}

impl DriverWatchSetup {
    /// Starts the watch of the driver the plugin serves (`serving`, NVML's version), unless it is off, the
    /// backend is simulated (no driver root), or NVML reported no version.
    fn spawn(
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

impl BackendArgs {
    /// Creates the `nvidia-uvm` device nodes where a real driver's module is loaded without them, or says
    /// how to load it ([`crate::gpu::driver_watch::check_uvm`]). Nothing for a simulated driver, whose `/proc`
    /// is not the host's.
    fn ensure_uvm_nodes(&self) {
        if self.backend != BackendKind::Nvml {
            return;
        }
        let proc_root = crate::gpu::nvml::proc_root_for(self.read_root());
        if proc_root == Path::new("/proc") {
            crate::gpu::driver_watch::check_uvm(Path::new("/dev"), &proc_root);
        }
    }
}

#[derive(Debug, clap::Args)]
struct WaitForDriverArgs {
    #[command(flatten)]
    backend: BackendArgs,

    /// Give up (exit 1) after this many seconds; 0, the default, waits as long as it takes (a driver
    /// container may need minutes to build and load its module).
    #[arg(long, env = "TESSERA_WAIT_FOR_DRIVER_TIMEOUT", default_value_t = 0)]
    timeout: u64,

    /// Seconds between two waiting messages in the log.
    #[arg(long, env = "TESSERA_WAIT_FOR_DRIVER_REPORT_INTERVAL", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    report_interval: u64,
}

impl WaitForDriverArgs {
    fn run(self) -> Result<()> {
        if self.backend.backend != BackendKind::Nvml {
            println!(
                "the {:?} backend needs no driver: nothing to wait for",
                self.backend.backend
            );
            return Ok(());
        }
        let root = DriverRoot::mounted(&self.backend.driver_root, self.backend.read_root());
        let proc_root = || crate::gpu::nvml::proc_root_for(self.backend.read_root());
        let options = crate::gpu::driver_watch::WaitOptions {
            report_every: Duration::from_secs(self.report_interval),
            timeout: (self.timeout > 0).then(|| Duration::from_secs(self.timeout)),
            ..Default::default()
        };
        // Plain lines on stdout: what `kubectl logs -c wait-for-driver` shows.
        match crate::gpu::driver_watch::wait_for_driver(&root, proc_root, options, |m| println!("{m}")) {
            Ok(found) => {
                println!(
                    "the NVIDIA driver {} is installed: {} found, the kernel module is loaded",
                    found.kernel.as_deref().unwrap_or("?"),
                    found
                        .nvml_library
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                );
                Ok(())
            }
            Err(last) => Err(Error::WaitForDriver {
                root: self.backend.driver_root.clone(),
                waited_secs: self.timeout,
                missing: last.missing(),
            }),
        }
    }
}
