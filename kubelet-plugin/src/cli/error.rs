//! Start-up's errors: everything that stops the plugin or a subcommand, with the lower layers' errors
//! wrapped as they are.

use std::{io, path::PathBuf};

use crate::gpu::GpuError;

/// A failure that ends the process.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Opening the GPU backend (loading NVML, reading the simulated node file) failed.
    #[error("failed to open the {backend} GPU backend: {source}")]
    OpenBackend {
        backend: String,
        #[source]
        source: GpuError,
    },
    /// GPU discovery failed.
    #[error("failed to discover GPUs with the {backend} backend: {source}")]
    Discover {
        backend: &'static str,
        #[source]
        source: GpuError,
    },
    /// `--backend simulated` without `--simulated-node-file`.
    #[error(
        "the simulated backend needs a node file: set --simulated-node-file (TESSERA_SIMULATED_NODE_FILE)"
    )]
    MissingSimulatedNodeFile,
    /// `simulate`: reading the node file or changing the simulated faults failed.
    #[error("failed to change the simulated GPU faults: {source}")]
    SimulateFault {
        #[source]
        source: GpuError,
    },
    /// `simulate driver-root`: the simulated kernel or driver root could not be made.
    #[error("failed to make the simulated driver root: {source}")]
    SimulateDriverRoot {
        #[source]
        source: GpuError,
    },
    /// `simulate upgrade-driver`: the simulated driver root could not be upgraded.
    #[error("failed to upgrade the simulated driver root: {source}")]
    SimulateUpgradeDriver {
        #[source]
        source: GpuError,
    },
    /// The driver under the running plugin changed version: the plugin stopped so that it is restarted on
    /// the new one (exit status [`crate::gpu::driver_watch::DRIVER_CHANGED_EXIT_CODE`]).
    #[error(
        "the NVIDIA driver changed from {from} to {to} under the running plugin; restart it to load the new driver"
    )]
    DriverChanged { from: String, to: String },
    /// The node's driver is being upgraded under the GPU Operator: the plugin let go of it (exit status
    /// [`crate::gpu::driver_upgrade::RELEASED_EXIT_CODE`]) and the restarted one waits for the upgrade.
    #[error(
        "the node's NVIDIA driver is being upgraded ({label}): released the driver so that its kernel module can          be unloaded; the restarted plugin waits for the upgrade to move on"
    )]
    ReleasedForDriverUpgrade { label: String },
    /// `wait-for-driver --timeout` passed without the driver.
    #[error(
        "the NVIDIA driver did not appear under the driver root {root} within {waited_secs}s: {missing}; check the \
         chart's driverRoot (the GPU Operator's is /run/nvidia/driver) and that the driver is installed"
    )]
    WaitForDriver {
        root: PathBuf,
        waited_secs: u64,
        missing: String,
    },
    /// `simulate create-mig`: the out-of-band MIG device could not be made.
    #[error("failed to make the MIG device: {reason}")]
    SimulateCreateMig { reason: String },
    /// `simulate hold-nvml`: NVML could not be opened through the driver root.
    #[error("failed to open NVML to hold the GPUs: {source}")]
    SimulateHoldNvml {
        #[source]
        source: GpuError,
    },
    /// `simulate load`: the synthetic load could not be set.
    #[error("failed to set the simulated GPU load: {source}")]
    SimulateLoad {
        #[source]
        source: GpuError,
    },
    /// The thread that watches device health could not be started.
    #[error("failed to start the device health monitor thread: {0}")]
    HealthMonitor(#[source] io::Error),
    /// The simulated MPS control daemon failed to start or serve.
    #[error("failed to run the simulated MPS control daemon: {source}")]
    MpsControlSim {
        #[source]
        source: io::Error,
    },
    /// The MPS supervisor failed to bind or serve its socket.
    #[error("failed to run the MPS supervisor on {socket}: {source}")]
    MpsSupervisor {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    /// `--node-name` not given.
    #[error("the node name is required: set --node-name or NODE_NAME (the downward API's spec.nodeName)")]
    MissingNodeName,
    /// Reading the boot id failed.
    #[error("failed to read the boot id from {path}: {source}; point --boot-id-file at a readable file")]
    ReadBootId {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// `--pod-uid` is not a pod UID; it becomes part of socket file names, so only what a UID holds is taken.
    #[error(
        "invalid --pod-uid / POD_UID {uid:?}: expected the pod's metadata.uid (letters, digits and '-'), set \
         from the downward API (fieldRef metadata.uid)"
    )]
    InvalidPodUid { uid: String },
    /// Binding the health endpoint's TCP address failed.
    #[error("failed to listen for health probes on {addr} (--health-addr / TESSERA_HEALTH_ADDR): {source}")]
    BindHealth {
        addr: std::net::SocketAddr,
        #[source]
        source: io::Error,
    },
    /// Loading the kubeconfig or the in-cluster configuration failed.
    #[error("failed to load the Kubernetes client configuration (set --kubeconfig or run in a pod): {0}")]
    KubeConfig(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Building the Kubernetes client failed.
    #[error("failed to create the Kubernetes client: {0}")]
    KubeClient(#[source] Box<kube::Error>),
    /// Installing the SIGTERM/SIGINT handlers failed.
    #[error("failed to install the signal handlers: {0}")]
    Signals(#[source] io::Error),
    /// Building the dry-run CDI spec (`discover --cdi`) failed for a device.
    #[error("failed to build the CDI edits of {device}: {source}")]
    DryRunCdi {
        device: String,
        #[source]
        source: GpuError,
    },
    /// Printing the inventory (`discover`) failed.
    #[error("failed to print the inventory as YAML: {0}")]
    PrintInventory(#[source] serde_norway::Error),
    /// `--backend simulated` in a plugin built without the simulated backend.
    #[error(
        "this tessera-kubelet-plugin was built without the simulated backend: use --backend nvml, or build it \
         with the Cargo feature `simulated` (on by default)"
    )]
    SimulatedNotBuilt,
    /// What the node keeps (checkpoint, CDI specs, device metadata, the state lock) could not be read or
    /// written.
    #[error(transparent)]
    Node(#[from] crate::node::error::Error),
    /// The plugin's sockets could not be served.
    #[error(transparent)]
    Kubelet(#[from] crate::kubelet::error::Error),
    /// `--driver-params-mask-dir`: the driver's params could not be masked in this container.
    #[error(
        "failed to mask /proc/driver/nvidia/params with a copy in {dir}: {reason}; the directory must be a \
        writable tmpfs (the chart's emptyDir) and the container privileged, or turn \
        kubeletPlugin.maskDriverParams off (--driver-params-mask-dir unset)"
    )]
    MaskDriverParams { dir: PathBuf, reason: String },
}

impl Error {
    /// The process's exit status for this error: [`crate::gpu::driver_watch::DRIVER_CHANGED_EXIT_CODE`] for a
    /// stop on a driver upgrade (a restart is what it asks for), 1 for every failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::DriverChanged { .. } => crate::gpu::driver_watch::DRIVER_CHANGED_EXIT_CODE,
            Self::ReleasedForDriverUpgrade { .. } => crate::gpu::driver_upgrade::RELEASED_EXIT_CODE,
            _ => 1,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
