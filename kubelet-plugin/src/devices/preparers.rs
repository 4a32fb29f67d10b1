//! The device preparers the plugin runs: the one place that composes whole GPUs, MIG devices and shares.
//!
//! ```text
//!  gpu-<i>                       GpuPreparer:    MIG off (Hopper+) ─▶ device nodes
//!  gpu-<i>-mig-<p>-<s>           MigPreparer:    create GI + CI (mig) ─▶ device + cap nodes
//!  gpu-<i>-shared, …-share-<n>   SharedPreparer: MIG off on the first share ─▶ share (sharing) ─▶ edits
//!  gpu-<i>-mig-…-shared          SharedPreparer: MIG device first (mig) ─▶ share on its UUID (sharing)
//!                                                 last share gone ─▶ destroy the MIG device
//! ```
//!
//! An exclusive device whose claim config asks for sharing among the claim's own containers goes to the
//! shared preparer as a one-holder share. [`crate::gpu::mig`] and [`crate::devices::sharing`] do not know each other;
//! only this module uses both.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use tessera_api::{
    DeviceName, GpuInfo,
    config::{self, DeviceConfig, SharingStrategy},
};
use tracing::{info, warn};

use crate::devices::sharing::{
    DEFAULT_STRATEGY, DaemonNeed, ShareRequest, Sharer, SharingError, daemon_key_of_share, share_key,
    share_limits,
};
use crate::gpu::driver_root::DriverFiles;
use crate::gpu::mig;
use crate::gpu::mig::{MigDevice, MigError};
use crate::node::cdi::{ContainerEdits, Mount};
use crate::node::checkpoint::{DeviceDetail, MigDetail, SharedDetail};
use crate::node::error::ClaimError;
use crate::node::state::{DeviceContext, DeviceKind, DevicePreparer, NodeState, WholeGpuPreparer};
use crate::node::{edits, mig_records};

/// Registers a preparer for every device kind: whole GPUs and MIG devices (each of which becomes a
/// one-holder share when its config asks for sharing) and shared devices, and the driver's edits as every
/// spec's own (once per claim, not per device). The binary and the restart
/// tests assemble the plugin through this one function, so they cannot drift apart.
pub fn with_preparers(state: NodeState, shared: &Arc<SharedPreparer>) -> NodeState {
    state
        .with_spec_edits(edits::driver_edits(&shared.files))
        .with_preparer(
            DeviceKind::Gpu,
            Arc::new(GpuPreparer {
                shared: shared.clone(),
            }),
        )
        .with_preparer(
            DeviceKind::Mig,
            Arc::new(MigPreparer {
                shared: shared.clone(),
            }),
        )
        .with_preparer(DeviceKind::Shared, shared.clone())
}

/// The opaque configuration that applies to the context's device, validated; `None` when the allocation
/// has none for it (and during crash recovery, where only the checkpoint is known).
pub fn device_config(ctx: &DeviceContext) -> Result<Option<DeviceConfig>, ClaimError> {
    let invalid = |source| ClaimError::InvalidConfig {
        request: ctx.allocation.request.clone(),
        device: ctx.device.to_string(),
        source: Box::new(source),
    };
    let config = config::effective_config(
        &ctx.allocation.config_entries,
        &ctx.allocation.request,
        &ctx.device,
    )
    .map_err(invalid)?;
    // What only this node can tell: device keys that name a device it has, limits within its memory.
    if let Some(config) = &config {
        config
            .check_on_node(&ctx.node_gpus, &ctx.device)
            .map_err(invalid)?;
    }
    // A ceiling from a DeviceClass's config reaches no webhook check against the claim's request.
    let request = crate::devices::sharing::compute_request(&ctx.allocation.consumed_capacity)
        .ok()
        .flatten();
    config::check_ceiling(config.as_ref(), Some(&ctx.device), request.map(u64::from)).map_err(invalid)?;
    Ok(config)
}

fn strategy_of(detail: &SharedDetail) -> SharingStrategy {
    match detail.strategy.as_deref() {
        Some("TimeSlicing") => SharingStrategy::TimeSlicing,
        _ => SharingStrategy::Mps,
    }
}

/// The share `ctx` prepares, as its device's holder: a claim may hold two shares of one device (each with
/// its own share id), and the device's setup must stay until the last of them goes.
fn holder(ctx: &DeviceContext) -> String {
    match &ctx.allocation.share_id {
        Some(id) => format!("{}/{}/{id}", ctx.claim.uid, ctx.device),
        None => format!("{}/{}", ctx.claim.uid, ctx.device),
    }
}

/// The namespace whose own MPS daemon serves the share `ctx` prepares: its claim's, unless the device is
/// published with tenancy `Shared` (one daemon for every namespace, by the cluster's policy). The
/// scheduler cannot see namespaces (no DRA selector names the claim's), so shares of different namespaces
/// do land on one GPU: refusing them here would leave their pods pending, so each gets a daemon instead.
fn tenant(ctx: &DeviceContext) -> Option<&str> {
    match ctx.allocation.published_tenancy {
        Some(tessera_api::policy::MpsTenancy::Shared) => None,
        Some(tessera_api::policy::MpsTenancy::Namespace) | None => {
            Some(ctx.claim.namespace.as_str()).filter(|n| !n.is_empty())
        }
    }
}

fn mig_error(ctx: &DeviceContext) -> impl Fn(MigError) -> ClaimError + '_ {
    move |source| ClaimError::Mig {
        device: ctx.device.to_string(),
        source: Box::new(source),
    }
}

fn sharing_error(ctx: &DeviceContext) -> impl Fn(SharingError) -> ClaimError + '_ {
    move |source| ClaimError::Sharing {
        device: ctx.device.to_string(),
        // The MPS supervisor or daemon being away passes by itself (its pod is replaced); nothing else does.
        transient: matches!(source, SharingError::Mps(_)),
        source: Box::new(source),
    }
}

/// Prepares shares of GPUs and MIG placements (`gpu-<i>-shared`, `gpu-<i>-share-<n>`,
/// `gpu-<i>-mig-<p>-<s>-shared`), and exclusive devices whose config asks for sharing among the claim's
/// own containers. Holds the driver files every spec of the plugin gets.
pub struct SharedPreparer {
    pub sharer: Arc<Sharer>,
    files: DriverFiles,
    /// The MIG device behind each shared MIG placement (by share key), made by its first share.
    migs: Mutex<BTreeMap<String, MigDevice>>,
}

impl SharedPreparer {
    pub fn new(sharer: Arc<Sharer>, files: DriverFiles) -> Self {
        Self {
            sharer,
            files,
            migs: Mutex::new(BTreeMap::new()),
        }
    }

    /// The driver files mounted into every container.
    pub fn files(&self) -> &DriverFiles {
        &self.files
    }

    /// Stops MPS daemons no prepared share uses any more. Call after [`crate::node::state::NodeState::recover`].
    pub fn stop_orphaned_daemons(&self, gpus: &[GpuInfo]) {
        self.sharer.stop_orphaned_daemons(gpus);
    }

    /// [`Sharer::watch_daemons`].
    pub fn watch_daemons(
        &self,
        gpus: &[GpuInfo],
        stop_orphans: bool,
    ) -> crate::devices::sharing::DaemonWatch {
        self.sharer.watch_daemons(gpus, stop_orphans)
    }

    /// MIG devices behind shared MIG placements that still have holders.
    pub fn mig_devices(&self) -> Vec<MigDevice> {
        self.lock_migs().values().cloned().collect()
    }

    fn lock_migs(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, MigDevice>> {
        self.migs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Destroys the MIG device of `key` once no share holds it.
    fn release_mig(&self, ctx: &DeviceContext, key: &str) -> Result<(), MigError> {
        if self.sharer.users().count(key) > 0 {
            return Ok(());
        }
        let Some(dev) = self.lock_migs().remove(key) else {
            // Without a record (a crash before it was known) the start-up reconcile removes it instead.
            return Ok(());
        };
        mig::unprepare_mig(ctx.backend.as_ref(), &ctx.gpu, &dev)
    }

    fn unshare(&self, ctx: &DeviceContext, strategy: SharingStrategy) -> Result<(), ClaimError> {
        let last = self
            .sharer
            .unprepare(&ctx.gpu, &ctx.device, &holder(ctx), strategy)
            .map_err(sharing_error(ctx))?;
        if last {
            self.release_mig(ctx, &share_key(&ctx.device))
                .map_err(mig_error(ctx))?;
        }
        Ok(())
    }
}

impl DevicePreparer for SharedPreparer {
    fn plan(&self, ctx: &DeviceContext) -> Result<DeviceDetail, ClaimError> {
        let config = device_config(ctx)?;
        let sharing = config.as_ref().and_then(|c| c.sharing());
        // A shared device serves the strategy it is published with to every claim on it: a config may
        // only agree, and is refused for this claim alone otherwise, before the GPU is touched.
        let published = ctx.allocation.published_strategy;
        if let Some(serves) = published {
            config::check_strategy(config.as_ref(), serves, &ctx.device).map_err(|source| {
                ClaimError::InvalidConfig {
                    request: ctx.allocation.request.clone(),
                    device: ctx.device.to_string(),
                    source: Box::new(source),
                }
            })?;
        }
        let strategy = sharing
            .map(|s| s.strategy)
            .or(published)
            .unwrap_or(DEFAULT_STRATEGY);
        let mig = match &ctx.device {
            DeviceName::SharedMig { profile, start, .. } | DeviceName::Mig { profile, start, .. } => {
                let (_, placement) = mig::resolve(&ctx.gpu, profile, *start).map_err(mig_error(ctx))?;
                Some(MigDetail {
                    gpu_uuid: Some(ctx.gpu.uuid.clone()),
                    ..MigDetail::planned(ctx.gpu.index, profile.clone(), placement)
                })
            }
            _ => None,
        };
        if strategy == SharingStrategy::Mps {
            // Fail on a malformed capacity now, before anything is touched.
            share_limits(
                &ctx.allocation.consumed_capacity,
                sharing.and_then(|s| s.mps.as_ref()),
                &ctx.device.to_string(),
            )
            .map_err(sharing_error(ctx))?;
        }
        Ok(DeviceDetail::Shared(SharedDetail {
            gpu: ctx.gpu.index,
            gpu_uuid: Some(ctx.gpu.uuid.clone()),
            uuid: None,
            mig,
            strategy: Some(strategy.as_str().to_string()),
            mps_pipe_dir: None,
            limits: BTreeMap::new(),
        }))
    }

    fn prepare(
        &self,
        ctx: &DeviceContext,
        planned: DeviceDetail,
    ) -> Result<(DeviceDetail, ContainerEdits), ClaimError> {
        let DeviceDetail::Shared(planned) = planned else {
            return Err(ClaimError::NotSupported {
                device: ctx.device.to_string(),
                kind: "unshared",
            });
        };
        let config = device_config(ctx)?;
        let sharing = config.as_ref().and_then(|c| c.sharing());
        let key = share_key(&ctx.device);
        let backend = ctx.backend.as_ref();
        let strategy = strategy_of(&planned);

        // MIG first: the share runs on the MIG device's UUID.
        let mig = match &ctx.device {
            DeviceName::SharedMig { profile, start, .. } | DeviceName::Mig { profile, start, .. } => {
                let recorded = self.lock_migs().get(&key).cloned();
                let dev = mig::prepare_mig(backend, &ctx.gpu, profile, *start, recorded.as_ref())
                    .map_err(mig_error(ctx))?;
                self.lock_migs().insert(key.clone(), dev.clone());
                Some(dev)
            }
            _ => {
                if self.sharer.users().count(&key) == 0 {
                    mig::ensure_whole_gpu(backend, &ctx.gpu).map_err(mig_error(ctx))?;
                    // Time-sliced clients are several processes: a mode left by a dead MPS share would
                    // let one in. (MPS sets EXCLUSIVE_PROCESS itself, for its server.)
                    if strategy == SharingStrategy::TimeSlicing {
                        reset_compute_mode(backend, &ctx.gpu).map_err(|source| {
                            ClaimError::PrepareDevice {
                                device: ctx.device.to_string(),
                                source,
                            }
                        })?;
                    }
                }
                None
            }
        };
        let uuid = mig
            .as_ref()
            .map_or_else(|| ctx.gpu.uuid.clone(), |m| m.uuid.clone());
        let req = ShareRequest {
            holder: holder(ctx),
            device: &ctx.device,
            gpu: &ctx.gpu,
            uuid: &uuid,
            strategy,
            mps: sharing.and_then(|s| s.mps.as_ref()),
            interval: sharing
                .and_then(|s| s.time_slicing)
                .map(|t| t.interval)
                .unwrap_or_default(),
            consumed: &ctx.allocation.consumed_capacity,
            tenant: tenant(ctx),
        };
        let share = match self.sharer.prepare(&req) {
            Ok(share) => share,
            Err(e) => {
                if let Err(undo) = self.release_mig(ctx, &key) {
                    warn!(key, error = %undo, "could not remove the MIG device of a failed share");
                }
                return Err(sharing_error(ctx)(e));
            }
        };
        let device = ctx.device.to_string();
        let mig_ids = mig.as_ref().map(|m| (m.gpu_instance, m.compute_instance));
        let mut edits = match edits::device_edits(backend, &ctx.gpu, mig_ids, &device, &uuid) {
            Ok(edits) => edits,
            Err(source) => {
                if let Err(undo) = self.unshare(ctx, strategy) {
                    warn!(key, error = %undo, "could not undo a share whose device nodes are unknown");
                }
                return Err(ClaimError::PrepareDevice { device, source });
            }
        };
        edits.env.extend(share.env.iter().cloned());
        edits
            .mounts
            .extend(share.mounts.iter().map(|(host, container)| Mount {
                host_path: host.clone(),
                container_path: container.clone(),
                options: ["rw", "nosuid", "nodev", "bind"].map(String::from).to_vec(),
            }));
        let detail = SharedDetail {
            gpu: ctx.gpu.index,
            gpu_uuid: Some(ctx.gpu.uuid.clone()),
            uuid: Some(share.uuid),
            mig: mig.as_ref().map(|m| mig_records::detail_of(m, &ctx.gpu)),
            strategy: planned.strategy,
            mps_pipe_dir: share.mps_pipe_dir,
            limits: share.limits,
        };
        Ok((DeviceDetail::Shared(detail), edits))
    }

    fn unprepare(&self, ctx: &DeviceContext, detail: &DeviceDetail) -> Result<(), ClaimError> {
        let DeviceDetail::Shared(d) = detail else {
            return Ok(());
        };
        self.unshare(ctx, strategy_of(d))
    }

    fn restore(&self, ctx: &DeviceContext, detail: &DeviceDetail) {
        let DeviceDetail::Shared(d) = detail else { return };
        // The daemon the share was prepared with, from its pipe directory: a per-namespace one, or the
        // device's one daemon of an older plugin's share (it keeps serving until its last share goes).
        let daemon = daemon_key_of_share(&ctx.device, d.mps_pipe_dir.as_deref());
        self.sharer
            .restore_on(&ctx.device, &holder(ctx), strategy_of(d), Some(&daemon));
        self.restore_warm(ctx, detail);
    }

    fn release(
        &self,
        ctx: &DeviceContext,
        detail: &DeviceDetail,
        keep: bool,
    ) -> Result<Option<DeviceDetail>, ClaimError> {
        let DeviceDetail::Shared(d) = detail else {
            return Ok(None);
        };
        let strategy = strategy_of(d);
        // Only what costs time to make is kept: an MPS daemon, a MIG device.
        let keep = keep && (strategy == SharingStrategy::Mps || d.mig.is_some());
        let last = self
            .sharer
            .release(&ctx.gpu, &ctx.device, &holder(ctx), strategy, keep)
            .map_err(sharing_error(ctx))?;
        if !last {
            return Ok(None);
        }
        if keep {
            return Ok(Some(detail.clone()));
        }
        self.release_mig(ctx, &share_key(&ctx.device))
            .map_err(mig_error(ctx))?;
        Ok(None)
    }

    fn destroy_warm(&self, ctx: &DeviceContext, detail: &DeviceDetail) -> Result<(), ClaimError> {
        let DeviceDetail::Shared(d) = detail else {
            return Ok(());
        };
        let key = share_key(&ctx.device);
        let idle = self
            .sharer
            .destroy_idle(&ctx.gpu, &key, strategy_of(d), &ctx.device)
            .map_err(sharing_error(ctx))?;
        if !idle {
            return Ok(());
        }
        // The MIG device behind it: the one this preparer knows, else the one the record names.
        if let Some(dev) = d.mig.as_ref().and_then(|m| mig_records::device_of(&ctx.gpu, m)) {
            self.lock_migs().entry(key.clone()).or_insert(dev);
        }
        self.release_mig(ctx, &key).map_err(mig_error(ctx))
    }

    fn restore_warm(&self, ctx: &DeviceContext, detail: &DeviceDetail) {
        let DeviceDetail::Shared(d) = detail else { return };
        if strategy_of(d) == SharingStrategy::Mps
            && let Some(uuid) = &d.uuid
        {
            let daemon = daemon_key_of_share(&ctx.device, d.mps_pipe_dir.as_deref());
            self.sharer
                .restore_daemon_of(&daemon, DaemonNeed::from_limits(uuid, &d.limits));
        }
        if let Some(dev) = d.mig.as_ref().and_then(|m| mig_records::device_of(&ctx.gpu, m)) {
            self.lock_migs().insert(share_key(&ctx.device), dev);
        }
    }
}

/// Whole GPUs: [`WholeGpuPreparer`] after turning an idle Hopper out of MIG mode; a
/// claim whose `GpuConfig` asks for sharing among its own containers goes to the shared preparer.
pub struct GpuPreparer {
    pub shared: Arc<SharedPreparer>,
}

impl DevicePreparer for GpuPreparer {
    fn plan(&self, ctx: &DeviceContext) -> Result<DeviceDetail, ClaimError> {
        if device_config(ctx)?.as_ref().and_then(|c| c.sharing()).is_some() {
            return self.shared.plan(ctx);
        }
        WholeGpuPreparer.plan(ctx)
    }

    fn prepare(
        &self,
        ctx: &DeviceContext,
        planned: DeviceDetail,
    ) -> Result<(DeviceDetail, ContainerEdits), ClaimError> {
        if matches!(planned, DeviceDetail::Shared(_)) {
            return self.shared.prepare(ctx, planned);
        }
        mig::ensure_whole_gpu(ctx.backend.as_ref(), &ctx.gpu).map_err(mig_error(ctx))?;
        reset_compute_mode(ctx.backend.as_ref(), &ctx.gpu).map_err(|source| ClaimError::PrepareDevice {
            device: ctx.device.to_string(),
            source,
        })?;
        WholeGpuPreparer.prepare(ctx, planned)
    }

    fn unprepare(&self, ctx: &DeviceContext, detail: &DeviceDetail) -> Result<(), ClaimError> {
        match detail {
            DeviceDetail::Shared(_) => self.shared.unprepare(ctx, detail),
            _ => WholeGpuPreparer.unprepare(ctx, detail),
        }
    }

    fn restore(&self, ctx: &DeviceContext, detail: &DeviceDetail) {
        self.shared.restore(ctx, detail);
    }

    fn release(
        &self,
        ctx: &DeviceContext,
        detail: &DeviceDetail,
        keep: bool,
    ) -> Result<Option<DeviceDetail>, ClaimError> {
        match detail {
            DeviceDetail::Shared(_) => self.shared.release(ctx, detail, keep),
            _ => self.unprepare(ctx, detail).map(|()| None),
        }
    }

    fn destroy_warm(&self, ctx: &DeviceContext, detail: &DeviceDetail) -> Result<(), ClaimError> {
        self.shared.destroy_warm(ctx, detail)
    }

    fn restore_warm(&self, ctx: &DeviceContext, detail: &DeviceDetail) {
        self.shared.restore_warm(ctx, detail);
    }
}

/// Puts a GPU an exclusive whole-GPU claim gets back in the DEFAULT compute mode. A GPU left in
/// EXCLUSIVE_PROCESS (an MPS supervisor that was OOM-killed or restarted, an admin's `nvidia-smi -c 3`) lets
/// only one CUDA process in, so a DataLoader with CUDA workers or several ranks per GPU fails with "all
/// CUDA-capable devices are busy or unavailable"; PROHIBITED lets none in. No share can hold a GPU that is
/// allocated whole, so nothing else relies on its mode. Reads first: a GPU already in DEFAULT is not touched.
pub fn reset_compute_mode(
    backend: &dyn crate::gpu::GpuBackend,
    gpu: &GpuInfo,
) -> Result<(), crate::gpu::GpuError> {
    use crate::gpu::ComputeMode;
    let mode = backend.compute_mode(gpu.index)?;
    if mode == ComputeMode::Default {
        return Ok(());
    }
    warn!(gpu = gpu.index, uuid = %gpu.uuid, ?mode,
        "a whole-GPU claim got a GPU left in a non-default compute mode; setting it back to DEFAULT");
    backend.set_compute_mode(gpu.index, ComputeMode::Default)
}

/// Exclusive MIG devices (`gpu-<i>-mig-<profile>-<start>`): one GPU instance and one compute instance
/// spanning it. A claim whose `MigConfig` asks for sharing between its own
/// containers goes to the shared preparer instead.
pub struct MigPreparer {
    pub shared: Arc<SharedPreparer>,
}

impl DevicePreparer for MigPreparer {
    fn plan(&self, ctx: &DeviceContext) -> Result<DeviceDetail, ClaimError> {
        let DeviceName::Mig { profile, start, .. } = &ctx.device else {
            return Err(ClaimError::NotSupported {
                device: ctx.device.to_string(),
                kind: "non-MIG",
            });
        };
        if device_config(ctx)?.as_ref().and_then(|c| c.sharing()).is_some() {
            return self.shared.plan(ctx);
        }
        let (_, placement) = mig::resolve(&ctx.gpu, profile, *start).map_err(mig_error(ctx))?;
        Ok(DeviceDetail::Mig(MigDetail {
            gpu_uuid: Some(ctx.gpu.uuid.clone()),
            ..MigDetail::planned(ctx.gpu.index, profile.clone(), placement)
        }))
    }

    fn prepare(
        &self,
        ctx: &DeviceContext,
        planned: DeviceDetail,
    ) -> Result<(DeviceDetail, ContainerEdits), ClaimError> {
        let detail = match planned {
            DeviceDetail::Mig(d) => d,
            shared @ DeviceDetail::Shared(_) => return self.shared.prepare(ctx, shared),
            DeviceDetail::Gpu { .. } => {
                return Err(ClaimError::NotSupported {
                    device: ctx.device.to_string(),
                    kind: "whole-GPU",
                });
            }
        };
        let device = ctx.device.to_string();
        let backend = ctx.backend.as_ref();
        let recorded = mig_records::device_of(&ctx.gpu, &detail);
        let dev = mig::prepare_mig(
            backend,
            &ctx.gpu,
            &detail.profile,
            detail.placement.start,
            recorded.as_ref(),
        )
        .map_err(mig_error(ctx))?;
        let ids = Some((dev.gpu_instance, dev.compute_instance));
        match edits::device_edits(backend, &ctx.gpu, ids, &device, &dev.uuid) {
            Ok(edits) => Ok((DeviceDetail::Mig(mig_records::detail_of(&dev, &ctx.gpu)), edits)),
            Err(source) => {
                let _ = mig::unprepare_mig(backend, &ctx.gpu, &dev);
                Err(ClaimError::PrepareDevice { device, source })
            }
        }
    }

    fn unprepare(&self, ctx: &DeviceContext, detail: &DeviceDetail) -> Result<(), ClaimError> {
        let d = match detail {
            DeviceDetail::Mig(d) => d,
            shared @ DeviceDetail::Shared(_) => return self.shared.unprepare(ctx, shared),
            DeviceDetail::Gpu { .. } => return Ok(()),
        };
        // Without a GI id the crash came before the instance was recorded; the start-up reconcile removes
        // whatever it left.
        let Some(gi) = d.gpu_instance else { return Ok(()) };
        let ci = d.compute_instance.zip(d.uuid.as_deref());
        let backend = ctx.backend.as_ref();
        mig::destroy_recorded(backend, d.gpu, gi, ci, d.placement)
            .and_then(|()| mig::maybe_disable_mig_mode(backend, &ctx.gpu))
            .map_err(mig_error(ctx))
    }

    fn release(
        &self,
        ctx: &DeviceContext,
        detail: &DeviceDetail,
        keep: bool,
    ) -> Result<Option<DeviceDetail>, ClaimError> {
        match detail {
            DeviceDetail::Shared(_) => self.shared.release(ctx, detail, keep),
            // A device whose ids are known stays as it is; MIG mode stays on with it.
            DeviceDetail::Mig(d) if keep && d.gpu_instance.is_some() && d.uuid.is_some() => {
                info!(device = %ctx.device, uuid = d.uuid.as_deref().unwrap_or_default(),
                    "keeping the MIG device warm");
                Ok(Some(detail.clone()))
            }
            _ => self.unprepare(ctx, detail).map(|()| None),
        }
    }

    fn destroy_warm(&self, ctx: &DeviceContext, detail: &DeviceDetail) -> Result<(), ClaimError> {
        match detail {
            DeviceDetail::Shared(_) => self.shared.destroy_warm(ctx, detail),
            _ => self.unprepare(ctx, detail),
        }
    }

    fn restore_warm(&self, ctx: &DeviceContext, detail: &DeviceDetail) {
        self.shared.restore_warm(ctx, detail);
    }
}
