//! The command line: the plugin's flags (each with an env fallback the DaemonSet sets) and subcommands.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use crate::cli::backend::BackendArgs;
use crate::cli::discover::DiscoverArgs;
use crate::cli::mps::{MpsControlSimArgs, MpsSupervisorArgs};
#[cfg(feature = "simulated")]
use crate::cli::simulate::SimulateArgs;
use crate::cli::wait_for_driver::WaitForDriverArgs;
use crate::gpu::driver_root::HookFeature;
use crate::kubelet::coexistence::CoexistenceMode;

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
    pub(super) command: Option<Command>,

    /// Name of this node (the downward API's spec.nodeName); also the pool name of its devices.
    #[arg(long, env = "NODE_NAME", required = true)]
    pub(super) node_name: Option<String>,

    #[command(flatten)]
    pub(super) backend: BackendArgs,

    /// Directory of the prepared-claims checkpoint and the simulated hardware state.
    #[arg(long, env = "TESSERA_STATE_DIR", default_value = "/var/lib/tessera")]
    pub(super) state_dir: PathBuf,

    /// kubelet's plugin registry directory, where the registration socket goes.
    #[arg(
        long,
        env = "TESSERA_KUBELET_REGISTRY_DIR",
        default_value = "/var/lib/kubelet/plugins_registry"
    )]
    pub(super) kubelet_registry_dir: PathBuf,

    /// kubelet's plugins directory; the DRA socket is `<dir>/gpu.tessera.dev/dra.sock`.
    #[arg(
        long,
        env = "TESSERA_KUBELET_PLUGINS_DIR",
        default_value = "/var/lib/kubelet/plugins"
    )]
    pub(super) kubelet_plugins_dir: PathBuf,

    /// UID of the plugin's pod (the downward API's metadata.uid). With it the sockets get names of their
    /// own, so the new pod of a rolling update (maxSurge) registers beside the old one and takes the node
    /// state over when the old one exits; without it the fixed names (one instance per node: a host
    /// process, the local cluster).
    #[arg(long, env = "POD_UID")]
    pub(super) pod_uid: Option<String>,

    /// Directory the container runtime reads CDI specs from.
    #[arg(long, env = "TESSERA_CDI_DIR", default_value = "/var/run/cdi")]
    pub(super) cdi_dir: PathBuf,

    /// Unix socket of the node's MPS supervisor (`mps-supervisor`); without it the plugin starts MPS
    /// daemons itself, and they die with the plugin's container.
    #[arg(long, env = "TESSERA_MPS_SUPERVISOR_SOCKET")]
    pub(super) mps_supervisor_socket: Option<PathBuf>,

    /// Host path of NVIDIA's `nvidia-cdi-hook` (NVIDIA container toolkit), to run instead of tessera's own
    /// hook: the specs then call it for `create-symlinks`, `enable-cuda-compat` and `update-ldcache`, and
    /// nothing is installed.
    #[arg(long, env = "TESSERA_CDI_HOOK")]
    pub(super) cdi_hook: Option<PathBuf>,

    /// With `--cdi-hook`: the subcommands NVIDIA's hook has besides `create-symlinks` and `update-ldcache`
    /// (`nvidia-cdi-hook --help` lists them), comma-separated: `enable-cuda-compat` (container toolkit
    /// 1.17.5 and later), `disable-device-node-modification` (1.17.8 and later). The specs call only these;
    /// an older hook would fail every container on an unknown subcommand. tessera's own hook has both.
    #[arg(long, env = "TESSERA_CDI_HOOK_FEATURES", value_delimiter = ',', requires = "cdi_hook",
        value_parser = HookFeature::parse)]
    pub(super) cdi_hook_features: Vec<HookFeature>,

    /// Host directory tessera's CDI hook (`tessera-cdi-hook`, shipped next to this binary) is installed
    /// into at start, and which CDI specs name; this process must see it at its host path (the chart mounts
    /// its cdiHookDir there). The runtime executes the hook from it, so its filesystem must not be mounted
    /// noexec (GKE's Container-Optimized OS mounts /var so): the plugin checks at start, running the
    /// installed hook once, and exits with an error naming this flag if it cannot. Default:
    /// `<state dir>/bin`.
    #[arg(long, env = "TESSERA_CDI_HOOK_DIR")]
    pub(super) cdi_hook_dir: Option<PathBuf>,

    /// A writable tmpfs directory (the chart's `emptyDir` of medium `Memory`): at start the plugin shows
    /// itself `ModifyDeviceFiles: 0` in `/proc/driver/nvidia/params`, a copy written here bind-mounted over
    /// it, so that NVML in this container never creates or changes device nodes. Needs a privileged
    /// container; nothing happens without the driver's params file. Off when unset.
    #[arg(long, env = "TESSERA_DRIVER_PARAMS_MASK_DIR")]
    pub(super) driver_params_mask_dir: Option<PathBuf>,

    /// kubeconfig file; without it the in-cluster configuration is used.
    #[arg(long, env = "KUBECONFIG")]
    pub(super) kubeconfig: Option<PathBuf>,

    /// Address for kubelet's probes: `GET /livez` (the plugin's runtime answers) and `GET /readyz` (kubelet
    /// has registered the plugin), e.g. `:8081`. Off when unset.
    #[arg(long, env = "TESSERA_HEALTH_ADDR", value_parser = tessera_api::health::parse_listen_addr)]
    pub(super) health_addr: Option<std::net::SocketAddr>,

    /// XIDs to treat as harmless on top of NVIDIA's application XIDs (13, 31, 43, 45, 68, 109), e.g.
    /// `94,119`; an XID listed here never makes a GPU unhealthy.
    #[arg(long, env = "TESSERA_IGNORED_XIDS", value_delimiter = ',')]
    pub(super) ignored_xids: Vec<u32>,

    /// Seconds between heartbeats, each a renewal of the node's Lease (the controller's timeout defaults
    /// to 40).
    #[arg(long, env = "TESSERA_HEARTBEAT_INTERVAL", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub(super) heartbeat_interval: u64,

    /// Namespace of the node's heartbeat Lease: the controller's lease namespace (the chart's release
    /// namespace).
    #[arg(long, env = "TESSERA_LEASE_NAMESPACE", default_value = "tessera-system")]
    pub(super) lease_namespace: String,

    /// Name of the controller's leader-election Lease, read to learn whether the leader reads node Leases.
    #[arg(long, env = "TESSERA_LEASE_NAME", default_value = "tessera-controller")]
    pub(super) controller_lease: String,

    /// File holding the node's boot id; a checkpoint written under another boot id is discarded.
    #[arg(
        long,
        env = "TESSERA_BOOT_ID_FILE",
        default_value = "/proc/sys/kernel/random/boot_id"
    )]
    pub(super) boot_id_file: PathBuf,

    /// What to do when another GPU manager is on the node: `refuse` publishes no devices next to a device
    /// plugin that advertises `nvidia.com/gpu` or `nvidia.com/mig-*`, and leaves a MIG layout that
    /// mig-manager (`nvidia.com/mig.config`) or GKE owns alone; `warn` serves as if alone. Either way the
    /// NodeInventory's `Coexistence` condition says what was found.
    #[arg(long, env = "TESSERA_COEXISTENCE", value_enum, default_value_t = CoexistenceMode::Refuse)]
    pub(super) coexistence: CoexistenceMode,

    /// The host's `/proc` as this process sees it, where NVML's PIDs are: a share's processes are found
    /// there (their cgroup names their pod). The chart mounts it read-only at `/host/proc`, so the plugin
    /// needs no `hostPID`.
    #[arg(long, env = "TESSERA_HOST_PROC", default_value = "/proc")]
    pub(super) host_proc: PathBuf,

    /// Seconds between two reads of the driver root's version (nvml backend): a driver upgrade under the
    /// running plugin makes it exit so that kubelet restarts it on the new driver (kubelet-plugin/README.md,
    /// "Driver upgrades"). 0 turns the watch off.
    #[arg(long, env = "TESSERA_DRIVER_WATCH_INTERVAL", default_value_t = crate::gpu::driver_watch::DEFAULT_WATCH_INTERVAL.as_secs())]
    pub(super) driver_watch_interval: u64,

    /// Take part in the GPU Operator's driver upgrades (nvml backend): when this node's labels say its
    /// driver is being unloaded (`nvidia.com/gpu-driver-upgrade-state=pod-restart-required`, or a label
    /// at `paused-for-driver-upgrade`), stop the MPS daemons, release NVML and wait without the driver
    /// until the upgrade moves on (kubelet-plugin/README.md, "Driver upgrades under the GPU Operator").
    /// Needs `list` and `watch` on nodes (the chart grants them).
    #[arg(long, env = "TESSERA_RELEASE_FOR_DRIVER_UPGRADES", default_value_t = true, action = clap::ArgAction::Set)]
    pub(super) release_for_driver_upgrades: bool,

    /// Write device metadata (KEP-5304) for each prepared claim: a JSON file per request, under
    /// `<state dir>/device-metadata`, that the claim's containers read at
    /// `/var/run/kubernetes.io/dra-device-attributes/…/gpu.tessera.dev-metadata.json` (kubelet-plugin/README.md,
    /// "Device metadata").
    #[arg(long, env = "TESSERA_DEVICE_METADATA", default_value_t = true, action = clap::ArgAction::Set)]
    pub(super) device_metadata: bool,

    /// Log format.
    #[arg(long, env = "TESSERA_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub(super) log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
pub(super) enum Command {
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
    #[cfg(feature = "simulated")]
    Simulate(SimulateArgs),
    /// Wait until the NVIDIA driver is installed under the driver root (its `libnvidia-ml.so.1` and the
    /// loaded kernel module), printing what is missing at intervals: the chart's init container.
    WaitForDriver(WaitForDriverArgs),
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
}
