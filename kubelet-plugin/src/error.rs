//! The plugin's errors: [`Error`] for the node-level operations that stop the plugin (sockets, checkpoint,
//! CDI directory, cluster access), [`ClaimError`] for one claim's prepare or unprepare, which goes into that
//! claim's entry of the kubelet response and never fails the batch.

use std::{io, path::PathBuf};

use crate::gpu::GpuError;

/// A failed node-level operation.
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
    /// the new one (exit status [`crate::driver_watch::DRIVER_CHANGED_EXIT_CODE`]).
    #[error(
        "the NVIDIA driver changed from {from} to {to} under the running plugin; restart it to load the new driver"
    )]
    DriverChanged { from: String, to: String },
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
    /// tessera's CDI hook binary could not be installed on the host.
    #[error(
        "failed to install the CDI hook {source_path} at {path}: {source}; the hook directory \
        (--cdi-hook-dir) must be a writable host directory this process sees at its host path"
    )]
    InstallCdiHook {
        source_path: PathBuf,
        path: PathBuf,
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
    /// Reading the checkpoint file failed (not a corrupted file: the read itself).
    #[error("failed to read checkpoint {path}: {source}")]
    ReadCheckpoint {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The checkpoint exists but cannot be trusted. The plugin stays registered but refuses every prepare
    /// and unprepare rather than guess which claims are prepared (a guess could hand out a MIG instance
    /// twice or leak one).
    #[error(
        "checkpoint {path} is corrupted: {reason}. The plugin prepares and unprepares nothing on a checkpoint \
         it cannot trust, and changes nothing on the node meanwhile. To recover, move the file aside \
         (mv {path} {path}.corrupt): within a minute, or at the next start, the plugin re-adopts the devices \
         of running pods from the API server, their CDI specs and the hardware; keep the moved file for \
         diagnosis"
    )]
    CorruptCheckpoint { path: PathBuf, reason: String },
    /// Writing the checkpoint failed.
    #[error("failed to write checkpoint {path}: {source}")]
    WriteCheckpoint {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Writing a CDI spec failed.
    #[error("failed to write CDI spec {path}: {source}")]
    WriteCdiSpec {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Reading a CDI spec failed.
    #[error("failed to read CDI spec {path}: {source}")]
    ReadCdiSpec {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Removing a CDI spec failed.
    #[error("failed to remove CDI spec {path}: {source}")]
    RemoveCdiSpec {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Writing a claim's device metadata file failed.
    #[error("failed to write device metadata {path}: {source}")]
    WriteDeviceMetadata {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Removing a claim's device metadata failed.
    #[error("failed to remove device metadata {path}: {source}")]
    RemoveDeviceMetadata {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Listing the device metadata directory failed.
    #[error("failed to list device metadata directory {path}: {source}")]
    ListDeviceMetadata {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Listing the CDI directory failed.
    #[error("failed to list CDI directory {path}: {source}")]
    ListCdiDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Rolling back a claim left half prepared by a crash failed; the record is kept for the next start.
    #[error("failed to roll back half-prepared claim {uid}: {source}")]
    RollBack {
        uid: String,
        #[source]
        source: Box<ClaimError>,
    },
    /// Removing a socket left by an earlier run failed.
    #[error("failed to remove stale socket {path}: {source}")]
    RemoveStaleSocket {
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
    /// Opening or locking the state directory's lock file failed (not: another instance holds it, which is
    /// waited for).
    #[error("failed to lock the state directory with {path}: {source}")]
    LockState {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Creating a socket's directory or binding the socket failed.
    #[error("failed to bind socket {path}: {source}")]
    BindSocket {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Binding the health endpoint's TCP address failed.
    #[error("failed to listen for health probes on {addr} (--health-addr / TESSERA_HEALTH_ADDR): {source}")]
    BindHealth {
        addr: std::net::SocketAddr,
        #[source]
        source: io::Error,
    },
    /// A gRPC server stopped with an error.
    #[error("failed to serve gRPC on {path}: {source}")]
    Serve {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
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
}

/// A failed prepare or unprepare of one claim; its message becomes the claim's `error` in the response.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The API server could not be asked for the claim.
    #[error("failed to get ResourceClaim {namespace}/{name}: {source}")]
    GetClaim {
        namespace: String,
        name: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The claim does not exist.
    #[error("ResourceClaim {namespace}/{name} not found")]
    ClaimNotFound { namespace: String, name: String },
    /// The claim with that name is not the one kubelet means (deleted and recreated).
    #[error(
        "ResourceClaim {namespace}/{name} has UID {actual} but kubelet asked for UID {expected}; the claim \
         was deleted and recreated"
    )]
    UidMismatch {
        namespace: String,
        name: String,
        expected: String,
        actual: String,
    },
    /// The claim has no allocation.
    #[error("ResourceClaim {namespace}/{name} is not allocated")]
    NotAllocated { namespace: String, name: String },
    /// An allocation result of this driver names another node's pool.
    #[error(
        "allocation result for request {request:?} is in pool {pool:?}, but this node's pool is {node:?}"
    )]
    WrongPool {
        request: String,
        pool: String,
        node: String,
    },
    /// An allocation result names a device this node does not have.
    #[error(
        "allocation result for request {request:?} names device {device:?}, which is not on this node: {reason}"
    )]
    UnknownDevice {
        request: String,
        device: String,
        reason: String,
    },
    /// No preparer is wired for the device's kind.
    #[error("device {device} is a {kind} device, which this plugin version cannot prepare yet")]
    NotSupported { device: String, kind: &'static str },
    /// The hardware operations preparing a device failed.
    #[error("failed to prepare device {device}: {source}")]
    PrepareDevice {
        device: String,
        #[source]
        source: GpuError,
    },
    /// The hardware operations unpreparing a device failed.
    #[error("failed to unprepare device {device}: {source}")]
    UnprepareDevice {
        device: String,
        #[source]
        source: GpuError,
    },
    /// The claim's opaque configuration for the device is invalid. (Sources of the variants below are boxed:
    /// they are large and every preparer call returns this type.)
    #[error("invalid configuration for request {request} (device {device}): {source}")]
    InvalidConfig {
        request: String,
        device: String,
        #[source]
        source: Box<tessera_api::config::ConfigError>,
    },
    /// Creating or destroying a MIG device failed.
    #[error("failed to prepare MIG device {device}: {source}")]
    Mig {
        device: String,
        #[source]
        source: Box<crate::mig::MigError>,
    },
    /// Setting up or tearing down a share failed.
    #[error("failed to share device {device}: {source}")]
    Sharing {
        device: String,
        #[source]
        source: Box<crate::sharing::SharingError>,
    },
    /// A preparation step that runs off the async runtime panicked or was cancelled.
    #[error("failed to run the preparation of device {device}: {reason}")]
    Task { device: String, reason: String },
    /// A claim's prepare or unprepare task panicked or was cancelled before it finished.
    #[error("the prepare or unprepare of ResourceClaim {claim} did not finish: {reason}")]
    Interrupted { claim: String, reason: String },
    /// The plugin found its checkpoint corrupted at start and refuses to change anything on the node
    /// until an operator decides (it stays registered so kubelet shows this text instead of "driver not
    /// registered").
    #[error(
        "the tessera plugin on this node refuses to prepare or unprepare claims: checkpoint {path} is \
         corrupted ({reason}). Fix: move the file aside (mv {path} {path}.corrupt); within a minute, or at \
         the next plugin start, the plugin re-adopts the devices of running pods from the API server and \
         the hardware. See the plugin's log line \"refusing to serve: corrupted checkpoint\""
    )]
    CheckpointRefused { path: PathBuf, reason: String },
    /// During a rolling update this instance got the call, but the instance it replaces still holds the
    /// node state (it finishes its in-flight calls before it exits on SIGTERM).
    #[error(
        "the tessera plugin is taking over this node from the instance it replaces, which still holds \
         {path} after {waited_secs}s; kubelet retries. If no older plugin pod is terminating on this node, \
         see which process holds the file (fuser {path})"
    )]
    HandoverPending { path: PathBuf, waited_secs: u64 },
    /// Node state (checkpoint or CDI spec) could not be written.
    #[error(transparent)]
    State(#[from] Box<Error>),
}

impl Error {
    /// The process's exit status for this error: [`crate::driver_watch::DRIVER_CHANGED_EXIT_CODE`] for a
    /// stop on a driver upgrade (a restart is what it asks for), 1 for every failure.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::DriverChanged { .. } => crate::driver_watch::DRIVER_CHANGED_EXIT_CODE,
            _ => 1,
        }
    }
}

impl ClaimError {
    /// True when the failure's cause can pass without anyone changing the claim: the API server did not
    /// answer, the MPS supervisor or daemon was away (its pod replaced), a preparation task was cancelled,
    /// the state was still held by the instance this one replaces. Such a prepare is worth retrying soon
    /// ([`crate::prepare_retry`]); a bad config, a wrong allocation or a refused checkpoint is not.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::GetClaim { .. } | Self::Task { .. } | Self::HandoverPending { .. } => true,
            Self::Sharing { source, .. } => matches!(**source, crate::sharing::SharingError::Mps(_)),
            _ => false,
        }
    }
}

impl From<Error> for ClaimError {
    fn from(e: Error) -> Self {
        Self::State(Box::new(e))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
