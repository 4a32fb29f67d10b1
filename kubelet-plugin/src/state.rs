//! The prepare/unprepare state machine, independent of gRPC and of the API server client.
//!
//! ```text
//!  prepare(claim) ─▶ done already? ─yes─▶ saved result
//!        │no
//!        ▼
//!  get claim (ClaimSource) ─▶ check UID ─▶ plan every device (no side effects: bad input writes nothing)
//!        ▼
//!  lock the claim's GPUs (per GPU, in index order) ─▶ checkpoint PrepareStarted(planned devices)
//!        ▼
//!  per device: DevicePreparer::prepare (off the async runtime) ─▶ write CDI spec ─▶ PrepareCompleted
//!        └─ any failure: undo the devices done so far, remove the spec and the record, report the error
//! ```
//!
//! Devices dispatch by [`DeviceKind`] to a [`DevicePreparer`]. This module prepares whole GPUs
//! ([`WholeGpuPreparer`]); MIG and shared devices are rejected with [`ClaimError::NotSupported`] until their
//! preparers are registered with [`NodeState::with_preparer`].
//!
//! Concurrency: claims on different GPUs prepare in parallel; only claims sharing a GPU wait for each
//! other. The checkpoint is one file, so its writes are serialized, but they are short (a few KiB and two
//! fsyncs) and never wait on hardware.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    sync::{Arc, Mutex as SyncMutex},
};

use tessera_api::{DRIVER_NAME, DeviceName, GpuInfo};
use tokio::sync::{Mutex, OwnedMutexGuard};
use tracing::{info, warn};

use crate::{
    cdi::{self, CdiDir, ContainerEdits, DeviceNode},
    checkpoint::{Checkpoint, CheckpointStore, ClaimRecord, DeviceDetail, DeviceRecord, Loaded, Phase},
    claims::{AllocatedDevice, ClaimSource, allocated_devices},
    error::{ClaimError, Error, Result},
    gpu::GpuBackend,
};

/// A claim as kubelet names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
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
}

/// Whole GPUs: the hardware is not touched; the CDI device exposes `/dev/nvidia<minor>` and the control
/// devices, and `NVIDIA_VISIBLE_DEVICES` names the GPU's UUID.
pub struct WholeGpuPreparer;

/// Control devices every CUDA container needs besides its GPU nodes.
pub const CONTROL_DEVICES: [&str; 3] = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

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
        let DeviceDetail::Gpu { minor, uuid, .. } = &planned else {
            return Err(ClaimError::NotSupported {
                device: ctx.device.to_string(),
                kind: "non-GPU",
            });
        };
        let gpu_node = format!("/dev/nvidia{minor}");
        let mut device_nodes = Vec::with_capacity(4);
        for path in std::iter::once(gpu_node.as_str()).chain(CONTROL_DEVICES) {
            let c = ctx
                .backend
                .char_device(path)
                .map_err(|source| ClaimError::PrepareDevice {
                    device: ctx.device.to_string(),
                    source,
                })?;
            device_nodes.push(DeviceNode::char_device(path, c.major, c.minor));
        }
        let edits = ContainerEdits {
            env: vec![format!("NVIDIA_VISIBLE_DEVICES={uuid}")],
            device_nodes,
            mounts: vec![],
        };
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
    /// One lock per GPU, created at start for every discovered GPU (the set is fixed for the plugin's life,
    /// so the map itself needs no lock).
    gpu_locks: BTreeMap<u32, Arc<Mutex<()>>>,
    preparers: BTreeMap<DeviceKind, Arc<dyn DevicePreparer>>,
    cdi: CdiDir,
    store: CheckpointStore,
    checkpoint: SyncMutex<Checkpoint>,
}

/// What the start-up found and did, for logs and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// A checkpoint of an earlier boot was discarded.
    pub discarded_other_boot: bool,
    /// Claims found half prepared and rolled back.
    pub rolled_back: Vec<String>,
    /// CDI specs removed because no completed claim owns them.
    pub removed_cdi_specs: Vec<String>,
    /// Completed claims kept.
    pub prepared: usize,
    /// MIG GPU instances destroyed because no completed claim holds them.
    pub destroyed_mig_instances: usize,
}

impl NodeState {
    /// Opens the node state with the whole-GPU preparer. Call [`NodeState::recover`] before serving.
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
            gpus: gpus.into_iter().map(|g| (g.index, g)).collect(),
            gpu_locks,
            preparers,
            cdi: CdiDir::new(config.cdi_dir),
            store: CheckpointStore::new(&config.state_dir),
            checkpoint: SyncMutex::new(Checkpoint {
                boot_id: config.boot_id,
                claims: BTreeMap::new(),
            }),
        }
    }

    /// Registers the preparer of a device kind (MIG, shares), replacing any earlier one.
    pub fn with_preparer(mut self, kind: DeviceKind, preparer: Arc<dyn DevicePreparer>) -> Self {
        self.preparers.insert(kind, preparer);
        self
    }

    /// Loads the checkpoint and brings the node to a consistent state: discards a checkpoint of an earlier
    /// boot with its CDI specs, rolls back claims a crash left in `PrepareStarted`, and removes CDI specs no
    /// completed claim owns. Fails on a corrupted checkpoint (see [`Error::CorruptCheckpoint`]).
    pub fn recover(&self) -> Result<Recovery> {
        let boot_id = self.lock_checkpoint().boot_id.clone();
        let mut recovery = Recovery::default();
        let mut checkpoint = match self.store.load(&boot_id)? {
            Loaded::Missing => Checkpoint {
                boot_id,
                claims: BTreeMap::new(),
            },
            Loaded::Current(cp) => cp,
            Loaded::OtherBoot(old) => {
                warn!(
                    path = %self.store.path().display(), old_boot_id = %old.boot_id, claims = old.claims.len(),
                    "discarding the checkpoint of an earlier boot: a reboot undid what it records"
                );
                recovery.discarded_other_boot = true;
                Checkpoint {
                    boot_id,
                    claims: BTreeMap::new(),
                }
            }
        };
        for record in checkpoint
            .claims
            .values()
            .filter(|r| r.phase == Phase::PrepareCompleted)
        {
            for d in &record.devices {
                match self.recorded_context(record, d) {
                    Ok((preparer, ctx)) => preparer.restore(&ctx, &d.detail),
                    Err(e) => warn!(claim = %record.uid, error = %e, "cannot restore a prepared device"),
                }
            }
        }
        let started: Vec<ClaimRecord> = checkpoint
            .claims
            .values()
            .filter(|r| r.phase == Phase::PrepareStarted)
            .cloned()
            .collect();
        for record in started {
            warn!(claim = %record.uid, namespace = %record.namespace, name = %record.name,
                "rolling back a claim whose preparation was interrupted");
            self.undo_devices(&record, &record.devices)
                .map_err(|e| Error::RollBack {
                    uid: record.uid.clone(),
                    source: Box::new(e),
                })?;
            self.cdi.remove(&record.uid)?;
            checkpoint.claims.remove(&record.uid);
            recovery.rolled_back.push(record.uid);
        }
        for uid in self.cdi.claim_uids()? {
            if !checkpoint.claims.contains_key(&uid) {
                info!(claim = %uid, "removing a CDI spec no prepared claim owns");
                self.cdi.remove(&uid)?;
                recovery.removed_cdi_specs.push(uid);
            }
        }
        // MIG instances no completed claim holds were left by a crash (or made by hand): destroy them, so the
        // placements the scheduler thinks free are free.
        let gpus: Vec<GpuInfo> = self.gpus.values().cloned().collect();
        let known = crate::mig::known_devices(&checkpoint, &gpus);
        match crate::mig::reconcile_at_start(self.backend.as_ref(), &gpus, &known) {
            Ok(report) => recovery.destroyed_mig_instances = report.gpu_instances.len(),
            Err(e) => warn!(error = %e, "could not remove every unknown MIG instance"),
        }
        recovery.prepared = checkpoint.claims.len();
        self.store.save(&checkpoint)?;
        *self.lock_checkpoint() = checkpoint;
        Ok(recovery)
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
        self.lock_checkpoint().clone()
    }

    /// Prepares a batch of claims concurrently; every claim gets its own result.
    pub async fn prepare_all(
        self: &Arc<Self>,
        claims: &[ClaimRef],
    ) -> Vec<(ClaimRef, Result<Vec<PreparedDevice>, ClaimError>)> {
        let results = futures::future::join_all(claims.iter().map(|c| self.prepare(c))).await;
        claims.iter().cloned().zip(results).collect()
    }

    /// Unprepares a batch of claims concurrently; every claim gets its own result.
    pub async fn unprepare_all(
        self: &Arc<Self>,
        claims: &[ClaimRef],
    ) -> Vec<(ClaimRef, Result<(), ClaimError>)> {
        let results = futures::future::join_all(claims.iter().map(|c| self.unprepare(c))).await;
        claims.iter().cloned().zip(results).collect()
    }

    /// Prepares one claim; idempotent (a prepared claim returns its saved result).
    pub async fn prepare(self: &Arc<Self>, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, ClaimError> {
        if let Some(done) = self.completed(&claim.uid) {
            return Ok(done);
        }
        let planned = self.plan(claim).await?;
        let _guards = self.lock_gpus(planned.iter().map(|p| p.ctx.gpu.index)).await;

        // Another call for the same claim may have finished or failed while this one waited for the GPUs.
        if let Some(done) = self.completed(&claim.uid) {
            return Ok(done);
        }
        if let Some(stale) = self.record(&claim.uid) {
            // A failed attempt whose own rollback failed: undo it before trying again.
            self.undo_blocking(&stale, stale.devices.len()).await?;
            self.cdi.remove(&claim.uid)?;
            self.update_checkpoint(|cp| {
                cp.claims.remove(&claim.uid);
            })?;
        }

        let mut record = ClaimRecord {
            uid: claim.uid.clone(),
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            phase: Phase::PrepareStarted,
            devices: planned.iter().map(|p| p.record.clone()).collect(),
        };
        self.update_checkpoint(|cp| {
            cp.claims.insert(claim.uid.clone(), record.clone());
        })?;

        let mut cdi_devices = Vec::with_capacity(planned.len());
        for (i, p) in planned.iter().enumerate() {
            match self.prepare_device(p).await {
                Ok((detail, edits)) => {
                    cdi_devices.push(cdi::Device {
                        name: p.cdi_name.clone(),
                        container_edits: edits,
                    });
                    if detail != record.devices[i].detail {
                        record.devices[i].detail = detail;
                        // Ids learned from the hardware (MIG instances) must be on disk before the next
                        // step, or a crash now would leave instances nobody knows to destroy.
                        let r = record.clone();
                        if let Err(e) = self.update_checkpoint(|cp| {
                            cp.claims.insert(claim.uid.clone(), r);
                        }) {
                            return Err(self.abort(&record, i + 1, e.into()).await);
                        }
                    }
                }
                Err(e) => return Err(self.abort(&record, i, e).await),
            }
        }

        let spec = cdi::Spec {
            cdi_version: cdi::CDI_VERSION.to_string(),
            kind: cdi::CDI_KIND.to_string(),
            devices: cdi_devices,
            container_edits: ContainerEdits::default(),
        };
        // A claim without devices of this driver needs no spec (CDI rejects specs without devices).
        if !spec.devices.is_empty()
            && let Err(e) = self.cdi.write(&claim.uid, &spec)
        {
            return Err(self.abort(&record, record.devices.len(), e.into()).await);
        }
        record.phase = Phase::PrepareCompleted;
        if let Err(e) = self.update_checkpoint(|cp| {
            cp.claims.insert(claim.uid.clone(), record.clone());
        }) {
            return Err(self.abort(&record, record.devices.len(), e.into()).await);
        }
        info!(claim = %claim.uid, namespace = %claim.namespace, name = %claim.name,
            devices = ?record.devices.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(), "prepared claim");
        Ok(record.devices.iter().map(prepared_device).collect())
    }

    /// Unprepares one claim; idempotent (an unknown claim is success, after removing any CDI spec left for
    /// its UID).
    pub async fn unprepare(self: &Arc<Self>, claim: &ClaimRef) -> Result<(), ClaimError> {
        let Some(record) = self.record(&claim.uid) else {
            self.cdi.remove(&claim.uid)?;
            return Ok(());
        };
        let _guards = self
            .lock_gpus(record.devices.iter().map(|d| d.detail.gpu()))
            .await;
        let Some(record) = self.record(&claim.uid) else {
            return Ok(());
        };
        self.undo_blocking(&record, record.devices.len()).await?;
        self.cdi.remove(&claim.uid)?;
        self.update_checkpoint(|cp| {
            cp.claims.remove(&claim.uid);
        })?;
        info!(claim = %claim.uid, namespace = %claim.namespace, name = %claim.name, "unprepared claim");
        Ok(())
    }

    /// Reads the claim and resolves each of this driver's devices, touching nothing.
    async fn plan(&self, claim: &ClaimRef) -> Result<Vec<Planned>, ClaimError> {
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
        let actual = rc.metadata.uid.clone().unwrap_or_default();
        if actual != claim.uid {
            return Err(ClaimError::UidMismatch {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
                expected: claim.uid.clone(),
                actual,
            });
        }
        let allocated = allocated_devices(&rc, DRIVER_NAME).ok_or_else(|| ClaimError::NotAllocated {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
        })?;
        let mut planned = Vec::with_capacity(allocated.len());
        for allocation in allocated {
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
                claim: claim.clone(),
                device,
                allocation: allocation.clone(),
            };
            let detail = preparer.plan(&ctx)?;
            let cdi_name = cdi::device_name(&claim.uid, &allocation.device);
            let record = DeviceRecord {
                request: allocation.request,
                pool: allocation.pool,
                device: allocation.device,
                share_id: allocation.share_id,
                cdi_device_ids: vec![cdi::qualified_name(&cdi_name)],
                detail,
            };
            planned.push(Planned {
                ctx,
                preparer,
                record,
                cdi_name,
            });
        }
        Ok(planned)
    }

    async fn prepare_device(&self, p: &Planned) -> Result<(DeviceDetail, ContainerEdits), ClaimError> {
        let (ctx, preparer, detail) = (p.ctx.clone(), p.preparer.clone(), p.record.detail.clone());
        let device = p.record.device.clone();
        let (detail, mut edits) = tokio::task::spawn_blocking(move || preparer.prepare(&ctx, detail))
            .await
            .map_err(|e| ClaimError::Task {
                device: device.clone(),
                reason: e.to_string(),
            })??;
        edits.env.push(format!("TESSERA_DEVICE={device}"));
        edits.env.push(format!(
            "TESSERA_CLAIM={}/{}",
            p.ctx.claim.namespace, p.ctx.claim.name
        ));
        Ok((detail, edits))
    }

    /// Undoes the first `done` devices of a failed prepare and drops the record; returns the error to report.
    /// If the undo fails too, the `PrepareStarted` record stays, so the next attempt or start rolls it back.
    async fn abort(self: &Arc<Self>, record: &ClaimRecord, done: usize, error: ClaimError) -> ClaimError {
        let undone = self
            .undo_blocking(record, done)
            .await
            .and_then(|()| self.cdi.remove(&record.uid).map_err(ClaimError::from))
            .and_then(|()| {
                self.update_checkpoint(|cp| {
                    cp.claims.remove(&record.uid);
                })
                .map_err(ClaimError::from)
            });
        if let Err(undo) = undone {
            warn!(claim = %record.uid, error = %undo, "failed to roll back a failed prepare; will retry");
        }
        error
    }

    /// Undoes the first `done` devices of `record` on a blocking thread (the caller holds their GPUs' locks).
    async fn undo_blocking(self: &Arc<Self>, record: &ClaimRecord, done: usize) -> Result<(), ClaimError> {
        let (this, record) = (self.clone(), record.clone());
        tokio::task::spawn_blocking(move || this.undo_devices(&record, &record.devices[..done]))
            .await
            .map_err(|e| ClaimError::Task {
                device: "(rollback)".into(),
                reason: e.to_string(),
            })?
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
            claim: ClaimRef {
                namespace: record.namespace.clone(),
                name: record.name.clone(),
                uid: record.uid.clone(),
            },
            device,
            allocation: AllocatedDevice {
                request: d.request.clone(),
                pool: d.pool.clone(),
                device: d.device.clone(),
                share_id: d.share_id.clone(),
                configs: Vec::new(),
                config_entries: Vec::new(),
                consumed_capacity: BTreeMap::new(),
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
        let cp = self.lock_checkpoint();
        let record = cp
            .claims
            .get(uid)
            .filter(|r| r.phase == Phase::PrepareCompleted)?;
        Some(record.devices.iter().map(prepared_device).collect())
    }

    fn record(&self, uid: &str) -> Option<ClaimRecord> {
        self.lock_checkpoint().claims.get(uid).cloned()
    }

    /// Applies `change` to a copy of the checkpoint, writes it, and only then makes it the in-memory state,
    /// so memory never claims more than the disk.
    fn update_checkpoint(&self, change: impl FnOnce(&mut Checkpoint)) -> Result<()> {
        let mut current = self.lock_checkpoint();
        let mut next = current.clone();
        change(&mut next);
        self.store.save(&next)?;
        *current = next;
        Ok(())
    }

    fn lock_checkpoint(&self) -> std::sync::MutexGuard<'_, Checkpoint> {
        // A panic while holding the lock cannot leave the checkpoint half-changed: changes are made on a copy.
        self.checkpoint.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A device resolved for preparation.
struct Planned {
    ctx: DeviceContext,
    preparer: Arc<dyn DevicePreparer>,
    record: DeviceRecord,
    cdi_name: String,
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
