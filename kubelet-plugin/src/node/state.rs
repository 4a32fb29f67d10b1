//! The prepare/unprepare state machine, independent of gRPC and of the API server client.
//!
//! ```text
//!  prepare(claim) ─▶ done already? ─yes─▶ saved result
//!        │no
//!        ▼
//!  get claim (ClaimSource) ─▶ check UID ─▶ plan every device (no side effects: bad input writes nothing)
//!        ▼
//!  lock the claim's GPUs (per GPU, in index order) ─▶ checkpoint PrepareStarted(planned devices)
//!        ▼                                               (skipped when every device is a whole GPU)
//!  per device: DevicePreparer::prepare (off the async runtime) ─▶ write CDI spec ─▶ PrepareCompleted
//!        └─ any failure: undo the devices done so far, remove the spec and the record, report the error
//! ```
//!
//! The `PrepareStarted` record exists so that a crash in the middle leaves a note of what to undo on the
//! hardware. A whole GPU changes nothing that needs undoing (its preparer may turn an idle GPU out of MIG
//! mode, which is what a whole GPU wants anyway, and its unprepare is a no-op), so a claim of whole GPUs
//! only is written once, as `PrepareCompleted`. A crash before that write leaves at most a CDI spec without
//! a record, and start-up removes every spec no record owns ([`NodeState::recover`] on a checkpoint of this
//! boot; after the API server answered otherwise); kubelet, which got no answer, prepares the claim again.
//!
//! Devices dispatch by [`DeviceKind`] to a [`DevicePreparer`]. This module prepares whole GPUs
//! ([`WholeGpuPreparer`]); MIG and shared devices are rejected with [`ClaimError::NotSupported`] until their
//! preparers are registered with [`NodeState::with_preparer`].
//!
//! Concurrency: claims on different GPUs prepare in parallel; only claims sharing a GPU wait for each
//! other. The checkpoint is one file; its writes (a few KiB and one fsync) run on blocking threads and are
//! group-committed, so concurrent prepares share one write instead of queueing for one each
//! (`state/journal.rs`). All of it is one process's: across processes (the two pods of a rolling update)
//! only the holder of the state directory's lock ([`StateLock`]) loads and changes the node state.

mod handover;
mod journal;
mod recovery;
mod warm_devices;

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    path::PathBuf,
    sync::{Arc, Mutex as SyncMutex},
    time::Duration,
};

use k8s_openapi::api::resource::v1::ResourceClaim;
use tessera_api::{DRIVER_NAME, DeviceName, GpuInfo};
use tokio::sync::{Mutex, OwnedMutexGuard, watch};
use tracing::{error, info, warn};

use crate::gpu::GpuBackend;
use crate::kubelet::claims::{AllocatedDevice, ClaimSource, allocated_devices};
use crate::node::cdi;
use crate::node::cdi::{CdiDir, ContainerEdits};
use crate::node::checkpoint::{
    Checkpoint, CheckpointStore, ClaimRecord, DeviceDetail, DeviceRecord, Loaded, Phase,
};
use crate::node::device_metadata::{ClaimIdentity, MetadataDevice, MetadataDir, POD_CLAIM_NAME_ANNOTATION};
use crate::node::error::{ClaimError, Error, Result};
pub use handover::{LOCK_FILE, StateLock};
use journal::{Change, Journal};
use recovery::{ClaimUse, claim_key, claim_use};

/// Runs one claim's prepare or unprepare as a task of its own, so that it finishes even when kubelet's call
/// is dropped (kubelet killed or restarted mid-call closes the connection, and the server drops the
/// handler): a prepare dropped between creating a MIG instance and recording it would leave the instance
/// without an owner, its slot refused to the next claim, until the next start-up sweep. Finished, it is
/// recorded, and kubelet's retry finds it prepared.
async fn run_to_completion<T: Send + 'static>(
    claim: ClaimRef,
    work: impl Future<Output = Result<T, ClaimError>> + Send + 'static,
) -> Result<T, ClaimError> {
    tokio::spawn(work).await.unwrap_or_else(|e| {
        Err(ClaimError::Interrupted {
            claim: format!("{}/{}", claim.namespace, claim.name),
            reason: e.to_string(),
        })
    })
}

/// Seconds since the Unix epoch (0 for a clock before it).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A claim as kubelet names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl ClaimRef {
    /// The names kubelet would send for `claim` (empty where the object lacks them).
    pub fn of(claim: &ResourceClaim) -> Self {
        Self {
            namespace: claim.metadata.namespace.clone().unwrap_or_default(),
            name: claim.metadata.name.clone().unwrap_or_default(),
            uid: claim.metadata.uid.clone().unwrap_or_default(),
        }
    }
}

/// One prepared device, as returned to kubelet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDevice {
    pub request_names: Vec<String>,
    pub pool_name: String,
    pub device_name: String,
    pub cdi_device_ids: Vec<String>,
    pub share_id: Option<String>,
}

/// Which preparer handles a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviceKind {
    /// `gpu-<i>`.
    Gpu,
    /// `gpu-<i>-mig-<profile>-<start>`.
    Mig,
    /// `gpu-<i>-shared`, `gpu-<i>-mig-…-shared`, `gpu-<i>-share-<slot>`.
    Shared,
}

impl DeviceKind {
    pub fn of(device: &DeviceName) -> Self {
        match device {
            DeviceName::Gpu { .. } => Self::Gpu,
            DeviceName::Mig { .. } => Self::Mig,
            DeviceName::SharedGpu { .. } | DeviceName::SharedMig { .. } | DeviceName::ShareSlot { .. } => {
                Self::Shared
            }
        }
    }

    fn of_detail(detail: &DeviceDetail) -> Self {
        match detail {
            DeviceDetail::Gpu { .. } => Self::Gpu,
            DeviceDetail::Mig(_) => Self::Mig,
            DeviceDetail::Shared(_) => Self::Shared,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gpu => "whole-GPU",
            Self::Mig => "MIG",
            Self::Shared => "shared",
        }
    }
}

/// What a preparer is told about the device it works on.
#[derive(Clone)]
pub struct DeviceContext {
    pub backend: Arc<dyn GpuBackend>,
    /// The physical GPU the device lives on, as discovered at start.
    pub gpu: GpuInfo,
    /// Every GPU of the node, as discovered at start: a claim's config may name devices of other GPUs
    /// (`perDevicePinnedMemoryLimit` keys), and such a key must name a device this node has.
    pub node_gpus: Arc<[GpuInfo]>,
    pub claim: ClaimRef,
    /// The device as the allocation names it.
    pub device: DeviceName,
    /// The allocation result (request, pool, share id, this driver's opaque configs for the request).
    /// Empty `configs` and an empty request during crash recovery, where only the checkpoint is known.
    pub allocation: AllocatedDevice,
}

/// Prepares and unprepares devices of one [`DeviceKind`].
///
/// `prepare` and `unprepare` run on a blocking thread with the device's GPU locked, so they may call the
/// (blocking) backend freely and need no locking of their own against other claims on the same GPU.
pub trait DevicePreparer: Send + Sync + 'static {
    /// Resolves the allocated device to what will be prepared, without side effects; an invalid device
    /// (profile the GPU does not have, a share config that does not parse) fails here, before anything is
    /// written. The detail goes into the `PrepareStarted` record, so it must say where to look to undo a
    /// crashed prepare.
    fn plan(&self, ctx: &DeviceContext) -> Result<DeviceDetail, ClaimError>;

    /// Does the hardware work and returns the detail as done (e.g. with MIG instance ids) and the CDI edits
    /// of the device. Env common to all kinds (`TESSERA_DEVICE`, `TESSERA_CLAIM`) is added by the caller.
    fn prepare(
        &self,
        ctx: &DeviceContext,
        planned: DeviceDetail,
    ) -> Result<(DeviceDetail, ContainerEdits), ClaimError>;

    /// Undoes `prepare`. Also called on a `PrepareStarted` record after a crash, so it must accept a
    /// partly done, fully done or never started device and succeed when there is nothing left to undo.
    fn unprepare(&self, ctx: &DeviceContext, detail: &DeviceDetail) -> Result<(), ClaimError>;

    /// Called at start for every device of a completed claim, before interrupted claims are rolled back,
    /// so per-device bookkeeping (how many shares hold a GPU) is whole again before anything is undone.
    fn restore(&self, _ctx: &DeviceContext, _detail: &DeviceDetail) {}

    /// Releases a device of a claim being unprepared. With `keep`, a device whose partition can stay warm
    /// ([`crate::node::warm`]) leaves it on the GPU and returns the detail that names it; a share does so only
    /// as its partition's last holder. Otherwise, and by default, it is [`DevicePreparer::unprepare`].
    fn release(
        &self,
        ctx: &DeviceContext,
        detail: &DeviceDetail,
        _keep: bool,
    ) -> Result<Option<DeviceDetail>, ClaimError> {
        self.unprepare(ctx, detail).map(|()| None)
    }

    /// Destroys a warm device's partition (its window ended, or a claim needs that part of the GPU).
    /// Must succeed when it is already gone.
    fn destroy_warm(&self, ctx: &DeviceContext, detail: &DeviceDetail) -> Result<(), ClaimError> {
        self.unprepare(ctx, detail)
    }

    /// Called at start for every warm device of the checkpoint, as [`DevicePreparer::restore`] is for
    /// prepared ones, so a claim can take it and the sweeps leave it alone.
    fn restore_warm(&self, _ctx: &DeviceContext, _detail: &DeviceDetail) {}
}

/// Whole GPUs: the hardware is not touched; the CDI device exposes `/dev/nvidia<minor>` and the control
/// devices ([`crate::node::edits::device_edits`]). The driver's files go to the spec's own edits
/// ([`NodeState::with_spec_edits`]).
pub struct WholeGpuPreparer;

pub use crate::node::edits::CONTROL_DEVICES;

impl DevicePreparer for WholeGpuPreparer {
    fn plan(&self, ctx: &DeviceContext) -> Result<DeviceDetail, ClaimError> {
        Ok(DeviceDetail::Gpu {
            gpu: ctx.gpu.index,
            uuid: ctx.gpu.uuid.clone(),
            minor: ctx.gpu.minor,
        })
    }

    fn prepare(
        &self,
        ctx: &DeviceContext,
        planned: DeviceDetail,
    ) -> Result<(DeviceDetail, ContainerEdits), ClaimError> {
        let DeviceDetail::Gpu { uuid, .. } = &planned else {
            return Err(ClaimError::NotSupported {
                device: ctx.device.to_string(),
                kind: "non-GPU",
            });
        };
        let device = ctx.device.to_string();
        let edits = crate::node::edits::device_edits(ctx.backend.as_ref(), &ctx.gpu, None, &device, uuid)
            .map_err(|source| ClaimError::PrepareDevice { device, source })?;
        Ok((planned, edits))
    }

    fn unprepare(&self, _ctx: &DeviceContext, _detail: &DeviceDetail) -> Result<(), ClaimError> {
        Ok(())
    }
}

/// Where the node state lives.
#[derive(Clone, Debug)]
pub struct StateConfig {
    /// Node name; also the only pool this plugin serves.
    pub node_name: String,
    /// The node's current boot id.
    pub boot_id: String,
    /// Directory of the checkpoint.
    pub state_dir: PathBuf,
    /// CDI spec directory.
    pub cdi_dir: PathBuf,
}

/// The node's prepared claims and how to prepare more.
pub struct NodeState {
    node_name: String,
    backend: Arc<dyn GpuBackend>,
    claims: Arc<dyn ClaimSource>,
    gpus: BTreeMap<u32, GpuInfo>,
    /// The same GPUs in index order, shared with every [`DeviceContext`].
    node_gpus: Arc<[GpuInfo]>,
    /// One lock per GPU, created at start for every discovered GPU (the set is fixed for the plugin's life,
    /// so the map itself needs no lock).
    gpu_locks: BTreeMap<u32, Arc<Mutex<()>>>,
    preparers: BTreeMap<DeviceKind, Arc<dyn DevicePreparer>>,
    cdi: CdiDir,
    /// Where each prepared claim's device metadata files go (KEP-5304), and the node's driver versions its
    /// attributes name; none when the plugin writes no metadata.
    metadata: Option<MetadataDir>,
    /// The spec-level edits of every claim's CDI spec: the driver's files and hook calls, the same for
    /// every device, so once per spec rather than once per device ([`NodeState::with_spec_edits`]).
    spec_edits: ContainerEdits,
    /// The checkpoint file and its version on disk (what every read sees).
    journal: Arc<Journal>,
    /// Set while the checkpoint on disk is corrupted: every prepare and unprepare is refused with it.
    refused: SyncMutex<Option<Refusal>>,
    /// Recovery that needs the API server before anything may be cleaned (see [`Pending`]).
    pending: SyncMutex<Pending>,
    /// Node-level leftovers other modules own (MPS daemons no share uses), swept after recovery.
    sweeps: Vec<OrphanSweep>,
    /// What the last reconcile found wrong, for the inventory's message.
    problems: SyncMutex<Vec<String>>,
    /// Why MIG instances no claim holds are kept rather than destroyed at start (another tool owns the
    /// layout, or the plugin could not tell: [`crate::kubelet::coexistence`]).
    keep_unowned_mig: Option<String>,
    /// Where prepares that failed for a passing cause go, so kubelet is asked to retry them soon
    /// ([`crate::kubelet::prepare_retry::after_failed_prepares`]); none in tests that do not ask.
    failed_prepares: Option<tokio::sync::mpsc::UnboundedSender<ClaimRef>>,
}

/// A sweep of node-level leftovers over the node's GPUs (see [`NodeState::with_orphan_sweep`]).
pub type OrphanSweep = Arc<dyn Fn(&[GpuInfo]) + Send + Sync>;

/// Why the plugin refuses to change the node.
#[derive(Clone, Debug)]
struct Refusal {
    path: PathBuf,
    reason: String,
}

/// Recovery that waits for the API server: without a trusted checkpoint of this boot, the CDI specs and MIG
/// instances on the node may belong to running pods, and only the API says which.
#[derive(Clone, Debug, Default)]
struct Pending {
    /// The checkpoint was missing or of another boot: rebuild records of in-use claims from the API, the
    /// CDI directory and the hardware, then sweep what no record owns.
    adopt: bool,
    /// Completed records of a checkpoint of another boot, re-adopted when their claim is in use and their
    /// devices are still on the hardware.
    old_records: BTreeMap<String, ClaimRecord>,
}

/// What the start-up (and each reconcile) found and did, for logs and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// A checkpoint of an earlier boot was found; its records were checked against the API and the
    /// hardware instead of being trusted.
    pub discarded_other_boot: bool,
    /// Claims found half prepared and rolled back.
    pub rolled_back: Vec<String>,
    /// CDI specs removed because no completed claim owns them.
    pub removed_cdi_specs: Vec<String>,
    /// Completed claims kept.
    pub prepared: usize,
    /// MIG GPU instances destroyed because no completed claim holds them.
    pub destroyed_mig_instances: usize,
    /// Set when the checkpoint is corrupted: the plugin serves, but refuses every prepare and unprepare
    /// with this message until the file is moved aside.
    pub refused: Option<String>,
    /// Claims in use by a pod whose devices were re-adopted (from a checkpoint of another boot, or rebuilt
    /// from the API, the CDI directory and the hardware when the checkpoint was missing).
    pub adopted: Vec<String>,
    /// Records whose claim is gone or no longer allocated to this node and not reserved: rolled back.
    pub orphans_cleaned: Vec<String>,
    /// Claims whose rollback failed, with the reason: kept in the checkpoint and retried.
    pub failed: Vec<(String, String)>,
    /// MIG instances that more than one record holds.
    pub conflicts: Vec<String>,
    /// Records of an earlier boot not re-adopted because their GPU index now names another physical GPU
    /// (its UUID differs), with the reason.
    pub wrong_gpu: Vec<(String, String)>,
    /// The API server could not be asked; what needs it was left for the next reconcile.
    pub api_error: Option<String>,
}

impl Recovery {
    fn merge(&mut self, other: Recovery) {
        self.discarded_other_boot |= other.discarded_other_boot;
        self.rolled_back.extend(other.rolled_back);
        self.removed_cdi_specs.extend(other.removed_cdi_specs);
        self.prepared = other.prepared;
        self.destroyed_mig_instances += other.destroyed_mig_instances;
        self.refused = other.refused.or(self.refused.take());
        self.adopted.extend(other.adopted);
        self.orphans_cleaned.extend(other.orphans_cleaned);
        self.failed = other.failed;
        self.conflicts = other.conflicts;
        self.wrong_gpu.extend(other.wrong_gpu);
        self.api_error = other.api_error;
    }

    /// One line per thing an operator should know about, empty when all is well.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        out.extend(self.refused.iter().cloned());
        out.extend(
            self.failed
                .iter()
                .map(|(uid, reason)| format!("claim {uid} failed to recover (retried): {reason}")),
        );
        out.extend(self.conflicts.iter().cloned());
        out.extend(
            self.wrong_gpu
                .iter()
                .map(|(uid, reason)| format!("claim {uid} was not re-adopted: {reason}")),
        );
        out
    }
}

/// How long recovery waits for one API call: start-up must not hang on an unreachable API server (the
/// plugin serves kubelet without it, and what needs the API is retried).
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// How often [`NodeState::reconcile_periodically`] checks records against the API by default.
pub const RECONCILE_INTERVAL: Duration = Duration::from_secs(60);

impl NodeState {
    /// Opens the node state with the whole-GPU preparer. Call [`NodeState::start`] (or, without an API
    /// server, [`NodeState::recover`]) before serving.
    pub fn new(
        config: StateConfig,
        backend: Arc<dyn GpuBackend>,
        gpus: Vec<GpuInfo>,
        claims: Arc<dyn ClaimSource>,
    ) -> Self {
        let gpu_locks = gpus.iter().map(|g| (g.index, Arc::new(Mutex::new(())))).collect();
        let mut preparers: BTreeMap<DeviceKind, Arc<dyn DevicePreparer>> = BTreeMap::new();
        preparers.insert(DeviceKind::Gpu, Arc::new(WholeGpuPreparer));
        Self {
            node_name: config.node_name,
            backend,
            claims,
            node_gpus: gpus.iter().cloned().collect(),
            gpus: gpus.into_iter().map(|g| (g.index, g)).collect(),
            gpu_locks,
            preparers,
            cdi: CdiDir::new(config.cdi_dir),
            metadata: None,
            spec_edits: ContainerEdits::default(),
            journal: Arc::new(Journal::new(
                CheckpointStore::new(&config.state_dir),
                Checkpoint {
                    boot_id: config.boot_id,
                    ..Default::default()
                },
            )),
            refused: SyncMutex::new(None),
            pending: SyncMutex::new(Pending::default()),
            sweeps: Vec::new(),
            problems: SyncMutex::new(Vec::new()),
            keep_unowned_mig: None,
            failed_prepares: None,
        }
    }

    /// Sends each claim whose prepare failed for a passing cause ([`ClaimError::is_transient`]) to `sink`.
    pub fn reporting_failed_prepares(mut self, sink: tokio::sync::mpsc::UnboundedSender<ClaimRef>) -> Self {
        self.failed_prepares = Some(sink);
        self
    }

    /// Keeps the MIG instances no claim holds instead of destroying them at start, for `why` (mig-manager
    /// or GKE owns the layout; the Node could not be read to tell). A claim's own instances still go with
    /// its unprepare.
    pub fn keeping_unowned_mig(mut self, why: impl Into<String>) -> Self {
        self.keep_unowned_mig = Some(why.into());
        self
    }

    /// Writes device metadata (KEP-5304) for every prepared claim into `dir` and mounts it into the claim's
    /// containers; `driver_version` and `cuda_driver_version` are the node's, as its inventory reports them.
    pub fn with_device_metadata(
        mut self,
        dir: impl Into<PathBuf>,
        driver_version: Option<String>,
        cuda_driver_version: Option<String>,
    ) -> Self {
        self.metadata = Some(MetadataDir::new(dir, driver_version, cuda_driver_version));
        self
    }

    /// Removes the files a claim's containers are given: its CDI spec and its device metadata. Either gone
    /// already is success.
    fn remove_claim_files(&self, claim_uid: &str) -> Result<()> {
        self.cdi.remove(claim_uid)?;
        if let Some(dir) = &self.metadata {
            dir.remove(claim_uid)?;
        }
        Ok(())
    }

    /// Writes the device metadata of a claim whose devices are prepared and adds each file's mount to the
    /// CDI devices of its request (`cdi_devices[i]` is `planned[i]`'s).
    fn write_metadata(
        &self,
        claim: &ClaimIdentity,
        planned: &[Planned],
        record: &ClaimRecord,
        cdi_devices: &mut [cdi::Device],
    ) -> Result<()> {
        let Some(dir) = &self.metadata else {
            return Ok(());
        };
        let devices: Vec<MetadataDevice> = planned
            .iter()
            .zip(&record.devices)
            .map(|(p, d)| MetadataDevice {
                request: d.request.clone(),
                pool: d.pool.clone(),
                device: d.device.clone(),
                attributes: dir.attributes_of(&p.ctx.gpu, &p.ctx.device, &d.detail),
            })
            .collect();
        let mounts = dir.write(claim, &devices)?;
        for (d, cdi_device) in record.devices.iter().zip(cdi_devices) {
            if let Some(mount) = mounts.get(&d.request) {
                cdi_device.container_edits.mounts.push(mount.clone());
            }
        }
        Ok(())
    }

    /// Registers the preparer of a device kind (MIG, shares), replacing any earlier one.
    pub fn with_preparer(mut self, kind: DeviceKind, preparer: Arc<dyn DevicePreparer>) -> Self {
        self.preparers.insert(kind, preparer);
        self
    }

    /// Sets the edits every claim's spec carries at its top level (the runtime applies them once when any
    /// device of the spec is injected): the driver's mounts and hook calls ([`crate::node::edits::driver_edits`]).
    pub fn with_spec_edits(mut self, edits: ContainerEdits) -> Self {
        self.spec_edits = edits;
        self
    }

    /// Registers a sweep of node-level leftovers (e.g. MPS daemons no share uses). Sweeps run, with every
    /// GPU locked, once the prepared claims are known for sure: after [`NodeState::recover`] on a trusted
    /// checkpoint, or after the API server told which claims are in use.
    pub fn with_orphan_sweep(mut self, sweep: OrphanSweep) -> Self {
        self.sweeps.push(sweep);
        self
    }

    /// Start-up: [`NodeState::recover`], then [`NodeState::reconcile`] against the API server.
    pub async fn start(self: &Arc<Self>) -> Result<Recovery> {
        let mut recovery = self.recover()?;
        let reconciled = self.reconcile().await;
        recovery.merge(reconciled);
        Ok(recovery)
    }

    /// Runs [`NodeState::reconcile`] every `every` until `stop` turns true.
    pub async fn reconcile_periodically(self: Arc<Self>, every: Duration, stop: watch::Receiver<bool>) {
        every_until_stopped(every, stop, || async {
            let r = self.reconcile().await;
            if !r.adopted.is_empty() || !r.orphans_cleaned.is_empty() || !r.rolled_back.is_empty() {
                info!(recovery = ?r, "reconciled the checkpoint with the API server");
            }
        })
        .await
    }

    /// What the last recovery or reconcile found wrong (corrupted checkpoint, claims that failed to
    /// recover, MIG instances recorded twice), one sentence each; empty when all is well.
    pub fn problems(&self) -> Vec<String> {
        self.problems.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Loads the checkpoint and brings the node to a consistent state without the API server.
    ///
    /// * A checkpoint of this boot is trusted: claims a crash left in `PrepareStarted` are rolled back (one
    ///   by one: a claim whose rollback fails is kept, marked and retried, and the rest of the node
    ///   serves), and CDI specs and MIG instances no completed claim owns are removed.
    /// * A missing checkpoint or one of another boot is not enough to tell what running pods use: nothing
    ///   is removed until [`NodeState::reconcile`] has asked the API server (see [`NodeState::start`]).
    /// * A corrupted checkpoint is kept, and every prepare and unprepare is refused with an error naming it
    ///   and the fix, so kubelet shows that instead of "driver not registered"; nothing on the node changes.
    pub fn recover(&self) -> Result<Recovery> {
        let boot_id = self.journal.read().boot_id.clone();
        let mut recovery = Recovery::default();
        let mut pending = Pending::default();
        let mut checkpoint = match self.journal.store().load(&boot_id) {
            Ok(Loaded::Missing) => {
                pending.adopt = true;
                Checkpoint {
                    boot_id,
                    ..Default::default()
                }
            }
            Ok(Loaded::Current(cp)) => cp,
            Ok(Loaded::OtherBoot(old)) => {
                warn!(
                    path = %self.journal.store().path().display(), old_boot_id = %old.boot_id, claims = old.claims.len(),
                    "the checkpoint is of an earlier boot: keeping only the claims running pods still use \
                     and whose devices are still there"
                );
                recovery.discarded_other_boot = true;
                pending.adopt = true;
                let (completed, started): (BTreeMap<_, _>, BTreeMap<_, _>) = old
                    .claims
                    .into_iter()
                    .partition(|(_, r)| r.phase == Phase::PrepareCompleted);
                pending.old_records = completed;
                // Interrupted prepares are rolled back as in this boot: their pod never got the devices.
                Checkpoint {
                    boot_id,
                    claims: started,
                    ..Default::default()
                }
            }
            Err(Error::CorruptCheckpoint { path, reason }) => {
                let refusal = Refusal { path, reason };
                let message = refused_error(&refusal).to_string();
                error!(path = %refusal.path.display(), reason = %refusal.reason,
                    "refusing to serve: corrupted checkpoint; every prepare and unprepare fails until the \
                     file is moved aside (nothing on the node is changed meanwhile)");
                *self.refused.lock().unwrap_or_else(|e| e.into_inner()) = Some(refusal);
                *self.problems.lock().unwrap_or_else(|e| e.into_inner()) = vec![message.clone()];
                recovery.refused = Some(message);
                return Ok(recovery);
            }
            Err(e) => return Err(e),
        };
        for record in checkpoint.claims.values_mut() {
            // In this boot an index names the GPU it named when the record was written; a record of an
            // older plugin, without UUIDs, is migrated to name its GPU by UUID, once.
            match recovery::gpus_match(&self.gpus, record) {
                Ok(by_index) if !by_index.is_empty() => {
                    warn!(claim = %record.uid, devices = ?by_index,
                        "recording the GPU UUIDs of a claim written before they were kept (judged by index)");
                    *record = self.with_gpu_uuids(record);
                }
                Ok(_) => {}
                Err(why) => error!(claim = %record.uid, reason = %why,
                    "a record of this boot names a GPU by an index that now names another GPU; kept as it is, \
                     check the node's GPUs (`nvidia-smi -L`)"),
            }
        }
        for record in checkpoint
            .claims
            .values()
            .filter(|r| r.phase == Phase::PrepareCompleted)
        {
            self.restore_record(record);
        }
        self.restore_warm(&mut checkpoint);
        let started: Vec<ClaimRecord> = checkpoint
            .claims
            .values()
            .filter(|r| r.phase == Phase::PrepareStarted)
            .cloned()
            .collect();
        for record in started {
            warn!(claim = %record.uid, namespace = %record.namespace, name = %record.name,
                "rolling back a claim whose preparation was interrupted");
            match self.roll_back_now(&record, &checkpoint) {
                Ok(()) => {
                    checkpoint.claims.remove(&record.uid);
                    recovery.rolled_back.push(record.uid);
                }
                Err(e) => {
                    let reason = e.to_string();
                    error!(claim = %record.uid, namespace = %record.namespace, name = %record.name,
                        error = %reason, "failed to roll back an interrupted claim; keeping its record and \
                        retrying later, the rest of the node serves");
                    if let Some(r) = checkpoint.claims.get_mut(&record.uid) {
                        r.recovery_error = Some(reason.clone());
                    }
                    recovery.failed.push((record.uid, reason));
                }
            }
        }
        if !pending.adopt {
            self.sweep_unowned(&checkpoint, &mut recovery)?;
        }
        recovery.prepared = checkpoint
            .claims
            .values()
            .filter(|r| r.phase == Phase::PrepareCompleted)
            .count();
        self.journal.replace(checkpoint)?;
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = pending;
        *self.refused.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *self.problems.lock().unwrap_or_else(|e| e.into_inner()) = recovery.problems();
        Ok(recovery)
    }

    /// Checks the records against the API server and finishes what [`NodeState::recover`] left for it:
    ///
    /// * re-adopts the claims running pods use (allocated to this node and reserved): records of another
    ///   boot whose devices are still on the hardware, and, when the checkpoint was lost, records rebuilt
    ///   from the claim, its CDI spec and the live MIG instances; then removes what no record owns;
    /// * rolls back records whose claim is gone or no longer allocated here and not reserved (a MIG
    ///   instance another record also holds is left to that record);
    /// * retries the rollbacks that failed before, and reports MIG instances two records hold.
    ///
    /// Never destroys anything when the API server cannot be asked. Safe to run while serving: it takes
    /// the GPU locks of what it changes and re-reads a claim before rolling it back.
    pub async fn reconcile(self: &Arc<Self>) -> Recovery {
        let mut recovery = Recovery::default();
        if self.refused().is_some() {
            // The operator may have moved the corrupted file aside meanwhile.
            match self.recover() {
                Ok(r) if r.refused.is_none() => recovery.merge(r),
                Ok(r) => return r,
                Err(e) => {
                    recovery.api_error = Some(e.to_string());
                    return recovery;
                }
            }
        }
        let listed = match tokio::time::timeout(API_TIMEOUT, self.claims.list()).await {
            Ok(Ok(list)) => list,
            Ok(Err(e)) => {
                warn!(error = %e, "cannot list ResourceClaims; checking the checkpoint against the API later");
                recovery.api_error = Some(e.to_string());
                recovery.prepared = self.checkpoint().claims.len();
                return recovery;
            }
            Err(_) => {
                let e = format!("listing ResourceClaims took longer than {API_TIMEOUT:?}");
                warn!(error = %e, "cannot list ResourceClaims; checking the checkpoint against the API later");
                recovery.api_error = Some(e.to_string());
                recovery.prepared = self.checkpoint().claims.len();
                return recovery;
            }
        };
        crate::kubelet::claims::warn_unreadable_once(&listed);
        // Claims that exist but do not decode: nothing may be concluded about them, so their records stay.
        let unreadable: std::collections::BTreeSet<String> =
            listed.unreadable.iter().map(|u| u.key()).collect();
        let by_key: BTreeMap<String, ResourceClaim> = listed
            .claims
            .into_iter()
            .filter_map(|c| {
                let key = claim_key(c.metadata.namespace.as_deref()?, c.metadata.name.as_deref()?);
                Some((key, c))
            })
            .collect();
        // Only the claims this node holds are reported, so a cluster's worth of claims never sits in the
        // metrics' memory.
        let held = self.checkpoint();
        for claim in by_key.values() {
            if claim
                .metadata
                .uid
                .as_ref()
                .is_some_and(|uid| held.claims.contains_key(uid))
            {
                crate::metrics::sink::sink().claim_seen(claim);
            }
        }

        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        if pending.adopt {
            let _all = self.lock_gpus(self.gpus.keys().copied()).await;
            if let Err(e) = self.adopt(&pending, &by_key, &unreadable, &mut recovery) {
                warn!(error = %e, "could not finish re-adopting prepared claims; retrying later");
                *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = pending;
                recovery.api_error = Some(e.to_string());
                return recovery;
            }
        }

        // Reported as found, before cleaning may resolve them (an orphan holding a live claim's instance).
        recovery.conflicts = recovery::conflicts(&self.checkpoint());
        self.clean_orphans(&by_key, &unreadable, &mut recovery).await;
        self.retry_failed(&mut recovery).await;

        let checkpoint = self.checkpoint();
        let remaining = recovery::conflicts(&checkpoint);
        for c in &recovery.conflicts {
            if remaining.contains(c) {
                error!(conflict = %c, "two records of claims in use hold one MIG instance; check which pod \
                    really uses it");
            } else {
                warn!(conflict = %c, "two records held one MIG instance; the one whose claim is gone was dropped");
            }
        }
        recovery.failed = checkpoint
            .claims
            .values()
            .filter_map(|r| Some((r.uid.clone(), r.recovery_error.clone()?)))
            .collect();
        recovery.prepared = checkpoint
            .claims
            .values()
            .filter(|r| r.phase == Phase::PrepareCompleted)
            .count();
        let mut problems = recovery.problems();
        problems.retain(|p| !recovery.conflicts.contains(p) || remaining.contains(p));
        *self.problems.lock().unwrap_or_else(|e| e.into_inner()) = problems;
        recovery
    }

    /// Re-adopts in-use claims (caller holds every GPU lock), then sweeps what no record owns.
    fn adopt(
        &self,
        pending: &Pending,
        by_key: &BTreeMap<String, ResourceClaim>,
        unreadable: &std::collections::BTreeSet<String>,
        recovery: &mut Recovery,
    ) -> Result<()> {
        let mut checkpoint = self.checkpoint();
        for (uid, record) in &pending.old_records {
            let key = claim_key(&record.namespace, &record.name);
            let claim = by_key.get(&key);
            // A claim the API server holds but that does not decode may well be in use: kept like one.
            let claim_use = |claim, uid: &str, node: &str| match unreadable.contains(&key) {
                true => ClaimUse::InUse,
                false => claim_use(claim, uid, node),
            };
            if claim_use(claim, uid, &self.node_name) == ClaimUse::InUse {
                // Checked first: a GPU missing at this boot shifts every later index, and the record's
                // devices would be re-adopted onto other physical GPUs, with other pods' work.
                match recovery::gpus_match(&self.gpus, record) {
                    Ok(by_index) if !by_index.is_empty() => warn!(claim = %uid, devices = ?by_index,
                        "the record of an earlier boot does not say which physical GPU its devices are on \
                         (written before GPU UUIDs were kept); judging it by the GPU index once"),
                    Ok(_) => {}
                    Err(why) => {
                        error!(claim = %uid, namespace = %record.namespace, name = %record.name, reason = %why,
                            "not re-adopting a record of an earlier boot: its GPU is not the one that index names now");
                        recovery.wrong_gpu.push((uid.clone(), why));
                        continue;
                    }
                }
            }
            let verdict = match claim_use(claim, uid, &self.node_name) {
                ClaimUse::InUse => recovery::record_intact(self.backend.as_ref(), record)
                    .and_then(|()| self.spec_present(uid)),
                other => Err(format!("its claim is {other:?}")),
            };
            match verdict {
                Ok(()) => {
                    info!(claim = %uid, namespace = %record.namespace, name = %record.name,
                        "re-adopting the devices of a running pod's claim from the checkpoint of an earlier boot");
                    let record = self.with_gpu_uuids(record);
                    self.restore_record(&record);
                    checkpoint.claims.insert(uid.clone(), record);
                    recovery.adopted.push(uid.clone());
                }
                Err(why) => info!(claim = %uid, reason = %why, "dropping a record of an earlier boot"),
            }
        }
        for claim in by_key.values() {
            let Some(uid) = claim.metadata.uid.as_deref() else {
                continue;
            };
            if checkpoint.claims.contains_key(uid)
                || recovery.wrong_gpu.iter().any(|(u, _)| u == uid)
                || claim_use(Some(claim), uid, &self.node_name) != ClaimUse::InUse
            {
                continue;
            }
            let spec = match self.cdi.read(uid) {
                Ok(Some(spec)) => spec,
                // No spec: the claim was never prepared here (or its pod has not started yet).
                Ok(None) => continue,
                Err(e) => {
                    warn!(claim = %uid, error = %e, "cannot read the CDI spec of an in-use claim");
                    continue;
                }
            };
            match self.rebuild_record(claim, &spec) {
                Ok(record) => {
                    info!(claim = %uid, namespace = %record.namespace, name = %record.name,
                        devices = ?record.devices.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(),
                        "re-adopting the devices of a running pod's claim from the API server, its CDI spec \
                         and the hardware (no checkpoint record)");
                    self.restore_record(&record);
                    checkpoint.claims.insert(uid.to_string(), record);
                    recovery.adopted.push(uid.to_string());
                }
                Err(why) => warn!(claim = %uid, reason = %why,
                    "cannot re-adopt an in-use claim's devices; its pod keeps what it has, but they are released"),
            }
        }
        // The re-adopted records are on disk before the sweep removes what no record owns.
        self.journal.replace(checkpoint.clone())?;
        self.sweep_unowned(&checkpoint, recovery)?;
        Ok(())
    }

    /// `record` with the parent GPU's UUID filled in where it lacks one (a record written before UUIDs were
    /// kept, judged by its index), so the next start can tell its GPU by UUID.
    fn with_gpu_uuids(&self, record: &ClaimRecord) -> ClaimRecord {
        let mut record = record.clone();
        for d in &mut record.devices {
            if let Some(gpu) = self.gpus.get(&d.detail.gpu()) {
                d.detail.set_gpu_uuid(&gpu.uuid);
            }
        }
        record
    }

    /// Removes what no record owns: tessera CDI specs, MIG instances, and the registered sweeps' leftovers.
    fn sweep_unowned(&self, checkpoint: &Checkpoint, recovery: &mut Recovery) -> Result<()> {
        for uid in self.cdi.claim_uids()? {
            if !checkpoint.claims.contains_key(&uid) {
                info!(claim = %uid, "removing a CDI spec no prepared claim owns");
                self.cdi.remove(&uid)?;
                recovery.removed_cdi_specs.push(uid);
            }
        }
        if let Some(dir) = &self.metadata {
            // Metadata no record owns, its spec swept above or already gone (a crash between writing the
            // two, or a reboot: the specs live on a tmpfs, the metadata in the state directory).
            for uid in dir.claim_uids()? {
                if !checkpoint.claims.contains_key(&uid) {
                    info!(claim = %uid, "removing device metadata no prepared claim owns");
                    dir.remove(&uid)?;
                }
            }
        }
        // MIG instances no completed claim holds were left by a crash (or made by hand): destroy them, so the
        // placements the scheduler thinks free are free.
        let gpus: Vec<GpuInfo> = self.gpus.values().cloned().collect();
        let known = crate::node::mig_records::known_devices(checkpoint, &gpus);
        match &self.keep_unowned_mig {
            Some(why) => info!(reason = %why, "keeping the MIG instances no claim holds"),
            None => match crate::gpu::mig::reconcile_at_start(self.backend.as_ref(), &gpus, &known) {
                Ok(report) => recovery.destroyed_mig_instances += report.gpu_instances.len(),
                Err(e) => warn!(error = %e, "could not remove every unknown MIG instance"),
            },
        }
        for sweep in &self.sweeps {
            sweep(&gpus);
        }
        Ok(())
    }

    /// A completed record for an in-use claim that lost its record: the devices as planned from the claim,
    /// with the ids of the live MIG instances its CDI spec names.
    fn rebuild_record(&self, claim: &ResourceClaim, spec: &cdi::Spec) -> Result<ClaimRecord, String> {
        let claim_ref = ClaimRef {
            namespace: claim.metadata.namespace.clone().unwrap_or_default(),
            name: claim.metadata.name.clone().unwrap_or_default(),
            uid: claim.metadata.uid.clone().unwrap_or_default(),
        };
        let planned = self.plan_claim(&claim_ref, claim).map_err(|e| e.to_string())?;
        let mut devices = Vec::with_capacity(planned.len());
        for p in planned {
            let mut record = p.record;
            record.detail = recovery::adopt_detail(self.backend.as_ref(), &p.ctx.gpu, record.detail, spec)?;
            devices.push(record);
        }
        Ok(ClaimRecord {
            uid: claim_ref.uid,
            namespace: claim_ref.namespace,
            name: claim_ref.name,
            phase: Phase::PrepareCompleted,
            devices,
            recovery_error: None,
            completed_at: None,
        })
    }

    /// Rolls back completed records whose claim nothing can be using any more.
    async fn clean_orphans(
        self: &Arc<Self>,
        by_key: &BTreeMap<String, ResourceClaim>,
        unreadable: &std::collections::BTreeSet<String>,
        recovery: &mut Recovery,
    ) {
        let candidates: Vec<ClaimRecord> = self
            .checkpoint()
            .claims
            .into_values()
            .filter(|r| r.phase == Phase::PrepareCompleted)
            .filter(|r| !unreadable.contains(&claim_key(&r.namespace, &r.name)))
            .filter(|r| {
                let claim = by_key.get(&claim_key(&r.namespace, &r.name));
                claim_use(claim, &r.uid, &self.node_name) == ClaimUse::Orphaned
            })
            .collect();
        for candidate in candidates {
            // The list may predate a claim prepared since; only a fresh read may condemn a record.
            let get = self.claims.get(&candidate.namespace, &candidate.name);
            let fresh = tokio::time::timeout(API_TIMEOUT, get).await.unwrap_or_else(|_| {
                Err(format!("reading the claim took longer than {API_TIMEOUT:?}").into())
            });
            match fresh {
                Ok(fresh)
                    if claim_use(fresh.as_ref(), &candidate.uid, &self.node_name) == ClaimUse::Orphaned => {}
                Ok(_) => continue,
                Err(e) => {
                    recovery.api_error = Some(e.to_string());
                    continue;
                }
            }
            let _guards = self
                .lock_gpus(candidate.devices.iter().map(|d| d.detail.gpu()))
                .await;
            let Some(record) = self
                .record(&candidate.uid)
                .filter(|r| r.phase == Phase::PrepareCompleted)
            else {
                continue;
            };
            warn!(claim = %record.uid, namespace = %record.namespace, name = %record.name,
                "rolling back a prepared claim that is gone or no longer allocated to this node and that no \
                 pod reserves");
            match self.roll_back_blocking(&record).await {
                Ok(()) => recovery.orphans_cleaned.push(record.uid),
                Err(e) => self.mark_failed(&record.uid, e.to_string()),
            }
        }
    }

    /// Retries the rollbacks that failed at start or in an earlier reconcile.
    async fn retry_failed(self: &Arc<Self>, recovery: &mut Recovery) {
        let failed: Vec<ClaimRecord> = self
            .checkpoint()
            .claims
            .into_values()
            .filter(|r| r.recovery_error.is_some())
            .collect();
        for candidate in failed {
            let _guards = self
                .lock_gpus(candidate.devices.iter().map(|d| d.detail.gpu()))
                .await;
            let Some(record) = self.record(&candidate.uid).filter(|r| r.recovery_error.is_some()) else {
                continue;
            };
            match self.roll_back_blocking(&record).await {
                Ok(()) => {
                    info!(claim = %record.uid, "rolled back a claim whose earlier rollback had failed");
                    recovery.rolled_back.push(record.uid);
                }
                Err(e) => self.mark_failed(&record.uid, e.to_string()),
            }
        }
    }

    fn mark_failed(&self, uid: &str, reason: String) {
        error!(claim = %uid, error = %reason, "failed to roll back a claim; keeping its record and retrying later");
        // Rare (a failed rollback), so written in place, on whatever thread failed.
        let change = Change::MarkFailed {
            uid: uid.to_string(),
            reason,
        };
        if let Err(e) = self.journal.commit(change) {
            warn!(claim = %uid, error = %e, "could not record a failed rollback");
        }
    }

    /// Undoes a record's devices (leaving MIG instances another record holds to that record), removes its
    /// CDI spec and its record. Synchronous: start-up recovery calls it directly.
    fn roll_back_now(&self, record: &ClaimRecord, all: &Checkpoint) -> Result<(), ClaimError> {
        let owners = recovery::instance_owners(all);
        for d in record.devices.iter().rev() {
            if recovery::instance_held_by_another(&owners, &record.uid, &d.device, &d.detail) {
                warn!(claim = %record.uid, device = %d.device,
                    "another record holds this MIG instance: dropping only this claim's record");
                continue;
            }
            let (preparer, ctx) = self.recorded_context(record, d)?;
            preparer.unprepare(&ctx, &d.detail)?;
        }
        self.remove_claim_files(&record.uid)?;
        Ok(())
    }

    /// [`Self::roll_back_now`] on a blocking thread, then the record goes (caller holds the GPU locks).
    async fn roll_back_blocking(self: &Arc<Self>, record: &ClaimRecord) -> Result<(), ClaimError> {
        let (this, r) = (self.clone(), record.clone());
        on_blocking_thread("(rollback)", move || this.roll_back_now(&r, &this.checkpoint())).await?;
        self.commit(Change::Remove(record.uid.clone())).await?;
        Ok(())
    }

    /// Tells each preparer about a completed record's devices (share counts).
    fn restore_record(&self, record: &ClaimRecord) {
        for d in &record.devices {
            match self.recorded_context(record, d) {
                Ok((preparer, ctx)) => preparer.restore(&ctx, &d.detail),
                Err(e) => warn!(claim = %record.uid, error = %e, "cannot restore a prepared device"),
            }
        }
    }

    fn spec_present(&self, uid: &str) -> Result<(), String> {
        match self.cdi.read(uid) {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err("its CDI spec is gone".into()),
            Err(e) => Err(e.to_string()),
        }
    }

    fn refused(&self) -> Option<Refusal> {
        self.refused.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether the records say what runs on the node: false while a checkpoint of another boot (or none)
    /// waits for the API server to tell which claims are in use, and while a corrupted one is refused.
    /// Until then nothing may be judged orphaned: a daemon or instance without a record may be a running
    /// pod's.
    pub fn records_settled(&self) -> bool {
        self.refused().is_none() && !self.pending.lock().unwrap_or_else(|e| e.into_inner()).adopt
    }

    fn check_not_refused(&self) -> Result<(), ClaimError> {
        match self.refused() {
            Some(r) => Err(refused_error(&r)),
            None => Ok(()),
        }
    }

    /// The node's GPUs as discovered at start.
    pub fn gpus(&self) -> impl Iterator<Item = &GpuInfo> {
        self.gpus.values()
    }

    /// The node name (and pool name).
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The CDI directory.
    pub fn cdi(&self) -> &CdiDir {
        &self.cdi
    }

    /// A copy of the in-memory checkpoint.
    pub fn checkpoint(&self) -> Checkpoint {
        self.journal.read().clone()
    }

    /// Prepares a batch of claims concurrently; every claim gets its own result.
    pub async fn prepare_all(
        self: &Arc<Self>,
        claims: &[ClaimRef],
    ) -> Vec<(ClaimRef, Result<Vec<PreparedDevice>, ClaimError>)> {
        let results = self
            .each_to_completion(
                claims,
                "prepare",
                |state, c| async move { state.prepare(&c).await },
            )
            .await;
        if let Some(sink) = &self.failed_prepares {
            for (claim, result) in claims.iter().zip(&results) {
                if result.as_ref().is_err_and(ClaimError::is_transient) {
                    // Only fails once the retry task has stopped, when nothing is left to ask.
                    let _ = sink.send(claim.clone());
                }
            }
        }
        claims.iter().cloned().zip(results).collect()
    }

    /// Unprepares a batch of claims concurrently; every claim gets its own result.
    pub async fn unprepare_all(
        self: &Arc<Self>,
        claims: &[ClaimRef],
    ) -> Vec<(ClaimRef, Result<(), ClaimError>)> {
        let results = self
            .each_to_completion(claims, "unprepare", |state, c| async move {
                state.unprepare(&c).await
            })
            .await;
        claims.iter().cloned().zip(results).collect()
    }

    /// Runs `operation` for each claim concurrently, each to completion ([`run_to_completion`]) and
    /// timed under its name.
    async fn each_to_completion<T, F, Fut>(
        self: &Arc<Self>,
        claims: &[ClaimRef],
        name: &'static str,
        operation: F,
    ) -> Vec<Result<T, ClaimError>>
    where
        T: Send + 'static,
        F: Fn(Arc<Self>, ClaimRef) -> Fut,
        Fut: Future<Output = Result<T, ClaimError>> + Send + 'static,
    {
        futures::future::join_all(claims.iter().map(|c| {
            let work = operation(Arc::clone(self), c.clone());
            run_to_completion(c.clone(), async move {
                crate::metrics::sink::claim_operation(name, work).await
            })
        }))
        .await
    }

    /// Prepares one claim; idempotent (a prepared claim returns its saved result).
    pub async fn prepare(self: &Arc<Self>, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, ClaimError> {
        let started = std::time::Instant::now();
        self.check_not_refused()?;
        if let Some(done) = self.completed(&claim.uid) {
            return Ok(done);
        }
        let (mut planned, identity) = self.plan(claim).await?;
        let _guards = self.lock_gpus(planned.iter().map(|p| p.ctx.gpu.index)).await;

        // Another call for the same claim may have finished or failed while this one waited for the GPUs.
        if let Some(done) = self.completed(&claim.uid) {
            return Ok(done);
        }
        if let Some(stale) = self.record(&claim.uid) {
            // A failed attempt whose own rollback failed: undo it before trying again.
            self.undo_blocking(&stale, stale.devices.len()).await?;
            self.remove_claim_files(&claim.uid)?;
            self.commit(Change::Remove(claim.uid.clone())).await?;
        }
        // Warm partitions: the claim's devices take theirs, and those in their way go first.
        let taken = self.settle_warm(&mut planned).await?;

        let mut record = ClaimRecord {
            uid: claim.uid.clone(),
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            phase: Phase::PrepareStarted,
            devices: planned.iter().map(|p| p.record.clone()).collect(),
            recovery_error: None,
            completed_at: None,
        };
        // Only hardware changes need the note of what to undo (see the module comment).
        let two_phase = planned
            .iter()
            .any(|p| !matches!(p.record.detail, DeviceDetail::Gpu { .. }));
        let warm = taken.clone();
        if !taken.is_empty() {
            // The warm records go in the same write: from here a crash leaves the claim's record, whose
            // rollback destroys what it took.
            self.commit(Change::Take {
                record: record.clone(),
                warm: taken,
            })
            .await?;
        } else if two_phase {
            self.commit(Change::Put(record.clone())).await?;
        }

        let mut cdi_devices = Vec::with_capacity(planned.len());
        // Every device of the claim, for TESSERA_DEVICES: each device's TESSERA_DEVICE names only itself,
        // and in a container holding several the last one wins.
        let all_devices = planned
            .iter()
            .map(|p| p.record.device.as_str())
            .collect::<Vec<_>>()
            .join(",");
        for (i, p) in planned.iter().enumerate() {
            match self.prepare_device(p).await {
                Ok((detail, mut edits, cost)) => {
                    edits.env.push(format!("TESSERA_DEVICES={all_devices}"));
                    cdi_devices.push(cdi::Device {
                        name: p.cdi_name.clone(),
                        container_edits: edits,
                    });
                    // The ids learned from the hardware (MIG instances) go to disk with PrepareCompleted, not
                    // in a write of their own: a crash before that leaves a PrepareStarted record, whose
                    // rollback at start skips what has no ids, and then the start-up sweep destroys every
                    // MIG instance no completed record holds, exactly as it already must for a crash
                    // between creating a GPU instance and its compute instance. Until then the ids are in
                    // memory, where a failed prepare's own rollback ([`Self::abort`]) needs them.
                    record.devices[i].detail = detail;
                    if let Some(cost) = cost {
                        record.devices[i].cost_ms = Some(cost);
                    }
                }
                Err(e) => return Err(self.abort(&record, i, e).await),
            }
        }

        // Before the spec that mounts it: a container never gets a mount of a file not yet written.
        if let Err(e) = self.write_metadata(&identity, &planned, &record, &mut cdi_devices) {
            return Err(self.abort(&record, record.devices.len(), e.into()).await);
        }
        let spec = cdi::Spec {
            cdi_version: cdi::CDI_VERSION.to_string(),
            kind: cdi::CDI_KIND.to_string(),
            devices: cdi_devices,
            container_edits: self.spec_edits.clone(),
        };
        // A claim without devices of this driver needs no spec (CDI rejects specs without devices).
        if !spec.devices.is_empty()
            && let Err(e) = self.cdi.write(&claim.uid, &spec)
        {
            return Err(self.abort(&record, record.devices.len(), e.into()).await);
        }
        record.phase = Phase::PrepareCompleted;
        record.completed_at = Some(unix_now());
        if let Err(e) = self.commit(Change::Put(record.clone())).await {
            return Err(self.abort(&record, record.devices.len(), e.into()).await);
        }
        info!(claim = %claim.uid, namespace = %claim.namespace, name = %claim.name,
            devices = ?record.devices.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(), ?warm,
            took_ms = started.elapsed().as_millis() as u64, "prepared claim");
        Ok(record.devices.iter().map(prepared_device).collect())
    }

    /// Unprepares one claim; idempotent (an unknown claim is success, after removing any CDI spec left for
    /// its UID).
    pub async fn unprepare(self: &Arc<Self>, claim: &ClaimRef) -> Result<(), ClaimError> {
        self.check_not_refused()?;
        let Some(record) = self.record(&claim.uid) else {
            self.remove_claim_files(&claim.uid)?;
            return Ok(());
        };
        let _guards = self
            .lock_gpus(record.devices.iter().map(|d| d.detail.gpu()))
            .await;
        let Some(record) = self.record(&claim.uid) else {
            return Ok(());
        };
        let warm = self.release_blocking(&record).await?;
        self.remove_claim_files(&claim.uid)?;
        let kept: Vec<String> = warm.iter().map(|(key, _)| key.clone()).collect();
        // A failure here keeps the claim's record, so kubelet's retry releases (and keeps) again.
        self.commit(Change::Release {
            uid: claim.uid.clone(),
            warm,
        })
        .await?;
        info!(claim = %claim.uid, namespace = %claim.namespace, name = %claim.name, warm = ?kept, "unprepared claim");
        Ok(())
    }

    /// Reads the claim and resolves each of this driver's devices, touching nothing.
    async fn plan(&self, claim: &ClaimRef) -> Result<(Vec<Planned>, ClaimIdentity), ClaimError> {
        let rc = self
            .claims
            .get(&claim.namespace, &claim.name)
            .await
            .map_err(|source| ClaimError::GetClaim {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                source,
            })?
            .ok_or_else(|| ClaimError::ClaimNotFound {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
            })?;
        crate::metrics::sink::sink().claim_seen(&rc);
        let mut planned = self.plan_claim(claim, &rc)?;
        let identity = ClaimIdentity {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            uid: claim.uid.clone(),
            pod_claim_name: rc
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(POD_CLAIM_NAME_ANNOTATION))
                .cloned(),
        };
        for p in &mut planned {
            // Whole GPUs make nothing and publish nothing the plugin needs: no read for them.
            if matches!(p.ctx.device, DeviceName::Gpu { .. }) {
                continue;
            }
            let published = match self
                .claims
                .published_device(&p.record.pool, &p.record.device)
                .await
            {
                Ok(Some(published)) => published,
                Ok(None) => {
                    if !matches!(p.ctx.device, DeviceName::Mig { .. }) {
                        warn!(device = %p.record.device, "no ResourceSlice of this node lists the shared \
                            device: its config decides its strategy, a share slot gets its config's limits \
                            only, and nothing of it is kept warm");
                    }
                    continue;
                }
                Err(e) => {
                    warn!(device = %p.record.device, error = %e, "cannot read the device's ResourceSlice: \
                        a share's config decides its strategy, a share slot gets its config's limits only, \
                        and nothing of it is kept warm");
                    continue;
                }
            };
            if matches!(
                p.ctx.device,
                DeviceName::SharedGpu { .. } | DeviceName::ShareSlot { .. } | DeviceName::SharedMig { .. }
            ) {
                // The strategy the device serves to every claim sharing it, which a claim's config may
                // only agree with: the scheduler cannot see a config's strategy when it places shares.
                p.ctx.allocation.published_strategy = published.strategy;
                p.ctx.allocation.published_tenancy = published.tenancy;
            }
            // A share slot consumes its whole, fixed size, which only its ResourceSlice names (the
            // allocation carries no capacity for it): the share's limits and its daemon's defaults.
            if matches!(p.ctx.device, DeviceName::ShareSlot { .. })
                && p.ctx.allocation.consumed_capacity.is_empty()
            {
                p.ctx.allocation.consumed_capacity = published.capacity;
            }
            p.record.warm_seconds = published.warm_seconds;
            if p.ctx.allocation.published_strategy.is_some() {
                // Planned before the strategy was known; plan again with it, still touching nothing.
                p.record.detail = p.preparer.plan(&p.ctx)?;
            }
        }
        Ok((planned, identity))
    }

    /// Resolves each of this driver's devices of `rc` (the claim kubelet names as `claim`), touching nothing.
    fn plan_claim(&self, claim: &ClaimRef, rc: &ResourceClaim) -> Result<Vec<Planned>, ClaimError> {
        let actual = rc.metadata.uid.clone().unwrap_or_default();
        if actual != claim.uid {
            return Err(ClaimError::UidMismatch {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                expected: claim.uid.clone(),
                actual,
            });
        }
        let allocated = allocated_devices(rc, DRIVER_NAME).ok_or_else(|| ClaimError::NotAllocated {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
        })?;
        let cdi_names = cdi::device_names(
            &claim.uid,
            allocated
                .iter()
                .map(|a| (a.device.as_str(), a.share_id.as_deref())),
        );
        let mut planned = Vec::with_capacity(allocated.len());
        for (allocation, cdi_name) in allocated.into_iter().zip(cdi_names) {
            if allocation.pool != self.node_name {
                return Err(ClaimError::WrongPool {
                    request: allocation.request,
                    pool: allocation.pool,
                    node: self.node_name.clone(),
                });
            }
            let unknown = |reason: String| ClaimError::UnknownDevice {
                request: allocation.request.clone(),
                device: allocation.device.clone(),
                reason,
            };
            let device: DeviceName = allocation.device.parse().map_err(|e| unknown(format!("{e}")))?;
            let gpu = self.gpus.get(&device.gpu()).ok_or_else(|| {
                unknown(format!(
                    "the node has GPUs {:?}",
                    self.gpus.keys().collect::<Vec<_>>()
                ))
            })?;
            let kind = DeviceKind::of(&device);
            let preparer = self.preparer(kind, &allocation.device)?;
            let ctx = DeviceContext {
                backend: self.backend.clone(),
                gpu: gpu.clone(),
                node_gpus: self.node_gpus.clone(),
                claim: claim.clone(),
                device,
                allocation: allocation.clone(),
            };
            let detail = preparer.plan(&ctx)?;
            let record = DeviceRecord {
                request: allocation.request,
                pool: allocation.pool,
                device: allocation.device,
                share_id: allocation.share_id,
                cdi_device_ids: vec![cdi::qualified_name(&cdi_name)],
                detail,
                warm_seconds: None,
                cost_ms: None,
            };
            planned.push(Planned {
                ctx,
                preparer,
                record,
                cdi_name,
                warm: false,
            });
        }
        Ok(planned)
    }

    /// Prepares one planned device on a blocking thread. Also returns, for a device that made a partition
    /// a warm record could keep, how long that took in milliseconds ([`DeviceRecord::cost_ms`]).
    async fn prepare_device(
        &self,
        p: &Planned,
    ) -> Result<(DeviceDetail, ContainerEdits, Option<u64>), ClaimError> {
        let (ctx, preparer, detail) = (p.ctx.clone(), p.preparer.clone(), p.record.detail.clone());
        let device = p.record.device.clone();
        let started = std::time::Instant::now();
        let (detail, mut edits) =
            on_blocking_thread(device.clone(), move || preparer.prepare(&ctx, detail)).await?;
        let took = started.elapsed();
        let cost = crate::node::warm::warm_key(&p.ctx.device, &detail).map(|_| {
            let kind = crate::node::warm::kind(&detail);
            crate::metrics::sink::sink().device_prepared(kind, p.warm, took);
            if p.warm {
                p.record.cost_ms.unwrap_or_default()
            } else {
                u64::try_from(took.as_millis()).unwrap_or(u64::MAX)
            }
        });
        edits.env.push(format!("TESSERA_DEVICE={device}"));
        edits.env.push(format!(
            "TESSERA_CLAIM={}/{}",
            p.ctx.claim.namespace, p.ctx.claim.name
        ));
        Ok((detail, edits, cost))
    }

    /// Undoes the first `done` devices of a failed prepare and drops the record; returns the error to report.
    /// If the undo fails too, the `PrepareStarted` record stays, so the next attempt or start rolls it back.
    async fn abort(self: &Arc<Self>, record: &ClaimRecord, done: usize, error: ClaimError) -> ClaimError {
        let undone = async {
            self.undo_blocking(record, done).await?;
            self.remove_claim_files(&record.uid)?;
            self.commit(Change::Remove(record.uid.clone())).await?;
            Ok::<(), ClaimError>(())
        }
        .await;
        if let Err(undo) = undone {
            // Recorded, so the periodic reconcile retries it even if kubelet never asks for this claim
            // again: the record as far as the hardware got (with the MIG ids the disk may not have yet),
            // as PrepareStarted so that no retry of the prepare takes it for done.
            error!(claim = %record.uid, error = %undo,
                "failed to roll back a failed prepare; keeping its record and retrying later");
            let failed = ClaimRecord {
                phase: Phase::PrepareStarted,
                recovery_error: Some(undo.to_string()),
                ..record.clone()
            };
            if let Err(e) = self.commit(Change::Put(failed)).await {
                warn!(claim = %record.uid, error = %e, "could not record a failed rollback");
            }
        }
        error
    }

    /// Undoes the first `done` devices of `record` on a blocking thread (the caller holds their GPUs' locks).
    async fn undo_blocking(self: &Arc<Self>, record: &ClaimRecord, done: usize) -> Result<(), ClaimError> {
        let (this, record) = (self.clone(), record.clone());
        on_blocking_thread("(rollback)", move || {
            this.undo_devices(&record, &record.devices[..done])
        })
        .await
    }

    /// Undoes devices in reverse order, synchronously (start-up recovery calls it directly).
    fn undo_devices(&self, record: &ClaimRecord, devices: &[DeviceRecord]) -> Result<(), ClaimError> {
        for d in devices.iter().rev() {
            let (preparer, ctx) = self.recorded_context(record, d)?;
            preparer.unprepare(&ctx, &d.detail)?;
        }
        Ok(())
    }

    /// The preparer and context of a recorded device, as far as the checkpoint knows it (no allocation
    /// configs: they are not recorded, and undoing needs only the detail).
    fn recorded_context(
        &self,
        record: &ClaimRecord,
        d: &DeviceRecord,
    ) -> Result<(Arc<dyn DevicePreparer>, DeviceContext), ClaimError> {
        let claim = ClaimRef {
            namespace: record.namespace.clone(),
            name: record.name.clone(),
            uid: record.uid.clone(),
        };
        self.context_of(claim, d)
    }

    /// The preparer and context of device `d` of `claim`, as far as a record knows it.
    fn context_of(
        &self,
        claim: ClaimRef,
        d: &DeviceRecord,
    ) -> Result<(Arc<dyn DevicePreparer>, DeviceContext), ClaimError> {
        let kind = DeviceKind::of_detail(&d.detail);
        let preparer = self.preparer(kind, &d.device)?;
        let device: DeviceName = d.device.parse().map_err(|e| ClaimError::UnknownDevice {
            request: d.request.clone(),
            device: d.device.clone(),
            reason: format!("{e}"),
        })?;
        let gpu = self.gpus.get(&d.detail.gpu()).cloned().unwrap_or_default();
        let ctx = DeviceContext {
            backend: self.backend.clone(),
            gpu,
            node_gpus: self.node_gpus.clone(),
            claim,
            device,
            allocation: AllocatedDevice {
                request: d.request.clone(),
                pool: d.pool.clone(),
                device: d.device.clone(),
                share_id: d.share_id.clone(),
                configs: Vec::new(),
                config_entries: Vec::new(),
                consumed_capacity: BTreeMap::new(),
                published_strategy: None,
                published_tenancy: None,
            },
        };
        Ok((preparer, ctx))
    }

    fn preparer(&self, kind: DeviceKind, device: &str) -> Result<Arc<dyn DevicePreparer>, ClaimError> {
        self.preparers
            .get(&kind)
            .cloned()
            .ok_or_else(|| ClaimError::NotSupported {
                device: device.to_string(),
                kind: kind.as_str(),
            })
    }

    /// Locks the given GPUs in index order, so two claims on overlapping GPUs cannot deadlock.
    async fn lock_gpus(&self, gpus: impl Iterator<Item = u32>) -> Vec<OwnedMutexGuard<()>> {
        let gpus: BTreeSet<u32> = gpus.collect();
        let mut guards = Vec::with_capacity(gpus.len());
        for gpu in gpus {
            if let Some(lock) = self.gpu_locks.get(&gpu) {
                guards.push(lock.clone().lock_owned().await);
            }
        }
        guards
    }

    fn completed(&self, uid: &str) -> Option<Vec<PreparedDevice>> {
        let cp = self.journal.read();
        let record = cp
            .claims
            .get(uid)
            .filter(|r| r.phase == Phase::PrepareCompleted)?;
        Some(record.devices.iter().map(prepared_device).collect())
    }

    fn record(&self, uid: &str) -> Option<ClaimRecord> {
        self.journal.read().claims.get(uid).cloned()
    }

    /// Commits `change` to the checkpoint on a blocking thread (the write waits for an fsync, which must
    /// not stall the runtime's workers and with them every other gRPC call), together with whatever other
    /// claims committed meanwhile. Returns once the change is on disk and in memory.
    async fn commit(&self, change: Change) -> Result<()> {
        let journal = self.journal.clone();
        tokio::task::spawn_blocking(move || journal.commit(change))
            .await
            .unwrap_or_else(|e| {
                Err(Error::WriteCheckpoint {
                    path: self.journal.store().path().to_path_buf(),
                    source: io::Error::other(format!("the write's thread failed: {e}")),
                })
            })
    }
}

/// A device resolved for preparation.
struct Planned {
    ctx: DeviceContext,
    preparer: Arc<dyn DevicePreparer>,
    record: DeviceRecord,
    cdi_name: String,
    /// The device takes a warm partition ([`crate::node::warm`]): its preparer makes nothing.
    warm: bool,
}

/// Runs `work` on a blocking thread (NVML, MIG and MPS calls block); a panic there is [`ClaimError::Task`]
/// naming `what` (a device, or the operation).
async fn on_blocking_thread<T: Send + 'static>(
    what: impl Into<String>,
    work: impl FnOnce() -> Result<T, ClaimError> + Send + 'static,
) -> Result<T, ClaimError> {
    let what = what.into();
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ClaimError::Task {
            device: what,
            reason: e.to_string(),
        })?
}

/// Runs `tick` every `every` (the first after one period) until `stop` turns true.
async fn every_until_stopped<F, Fut>(every: Duration, mut stop: watch::Receiver<bool>, mut tick: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        tick().await;
    }
}

fn refused_error(r: &Refusal) -> ClaimError {
    ClaimError::CheckpointRefused {
        path: r.path.clone(),
        reason: r.reason.clone(),
    }
}

fn prepared_device(d: &DeviceRecord) -> PreparedDevice {
    PreparedDevice {
        request_names: vec![d.request.clone()],
        pool_name: d.pool.clone(),
        device_name: d.device.clone(),
        cdi_device_ids: d.cdi_device_ids.clone(),
        share_id: d.share_id.clone(),
    }
}
