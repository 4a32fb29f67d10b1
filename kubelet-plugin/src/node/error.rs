//! The node layer's errors: [`Error`] for the operations on what the node keeps (checkpoint, CDI specs,
//! device metadata, the state lock), which stop the plugin at start; [`ClaimError`] for one claim's prepare
//! or unprepare, which goes into that claim's entry of the kubelet response and never fails the batch.

use std::{io, path::PathBuf};

use crate::gpu::GpuError;

/// A failed node-level operation: the checkpoint, the CDI specs and device metadata, the state lock.
#[derive(Debug, thiserror::Error)]
pub enum Error {
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
    /// Opening or locking the state directory's lock file failed (not: another instance holds it, which is
    /// waited for).
    #[error("failed to lock the state directory with {path}: {source}")]
    LockState {
        path: PathBuf,
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
    /// The installed hook cannot be executed, so the runtime could not run it either and every container
    /// with a tessera device would fail to be created.
    #[error(
        "the CDI hook installed at {path} cannot be executed ({reason}), so every container with a tessera \
        device would fail at createContainer; set the chart value cdiHookDir (--cdi-hook-dir) to a host \
        directory on a filesystem mounted with exec, e.g. /home/kubernetes/bin/tessera on GKE's \
        Container-Optimized OS, whose /var is noexec"
    )]
    CdiHookNotExecutable { path: PathBuf, reason: String },
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
        source: Box<crate::gpu::mig::MigError>,
    },
    /// Setting up or tearing down a share failed. `transient` when its cause can pass by itself (the MPS
    /// supervisor or daemon was away), as the sharing layer that raised it decides.
    #[error("failed to share device {device}: {source}")]
    Sharing {
        device: String,
        transient: bool,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
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
    /// The plugin has let go of the driver for a GPU Operator driver upgrade (`gpu::driver_upgrade`); the
    /// message names the Node label that asked for it.
    #[error("{message}")]
    DriverReleased { message: String },
    /// Node state (checkpoint or CDI spec) could not be written.
    #[error(transparent)]
    State(#[from] Box<Error>),
}

impl ClaimError {
    /// True when the failure's cause can pass without anyone changing the claim: the API server did not
    /// answer, the MPS supervisor or daemon was away (its pod replaced), a preparation task was cancelled,
    /// the state was still held by the instance this one replaces. Such a prepare is worth retrying soon
    /// ([`crate::kubelet::prepare_retry`]); a bad config, a wrong allocation or a refused checkpoint is not.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::GetClaim { .. }
            | Self::Task { .. }
            | Self::HandoverPending { .. }
            | Self::DriverReleased { .. } => true,
            Self::Sharing { transient, .. } => *transient,
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
