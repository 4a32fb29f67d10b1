//! Sharing one GPU (or MIG device) between claims: MPS ([`mps`]) or time-slicing ([`timeslice`]).
//!
//! A shared device has per-device state that must exist while any share is prepared and be undone after
//! the last one: an MPS control daemon, or a non-default time-slice. [`ShareUsers`] counts the holders per
//! device; it is rebuilt from the checkpoint at start, so "first" and "last" survive a plugin restart.
//!
//! What is enforced, and by whom:
//!
//! | Limit | Set by | Enforced by | A hostile container can |
//! |---|---|---|---|
//! | MPS: device access | plugin: GPU in `EXCLUSIVE_PROCESS` while the daemon runs (whole GPUs) | driver: only the MPS server opens the GPU | nothing more: every CUDA process goes through the server |
//! | MPS: compute share (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) | CDI env from `compute` capacity or `defaultActiveThreadPercentage` | MPS server, per client context | unset it and get the daemon default (config default, else 100%) |
//! | MPS: pinned memory (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<N>M`) | CDI env from `memory` capacity or the config's limits | MPS server, per client context | unset it and get the daemon default (config default, else none) |
//! | MPS: IPC (`/dev/shm`) | plugin mounts the host's `/dev/shm` on real GPUs (the daemon runs in it); a per-daemon dir on the simulated backend | — | see other host shared-memory segments (real GPUs) |
//! | MPS: fault isolation | — | none: a fatal fault in one client reaches all clients of the daemon | crash the other shares' work |
//! | Time-slicing: interval | first share's config (`timeSlicing.interval`), reset after the last | driver scheduler | nothing (no per-share limit exists) |
//! | Time-slicing: memory, compute | — | nothing | use all memory and compute of the GPU |
//! | Strategy per device | plugin: one strategy per device, checked at prepare | plugin | — |
//!
//! All shares of one device use one strategy: an MPS daemon puts a whole GPU in exclusive-process mode,
//! which locks out a time-sliced client, so a second strategy on the same device is refused.

pub mod mps;
pub mod timeslice;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
};

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tessera_api::{
    DeviceName, GpuInfo, attributes,
    config::{
        self, DeviceConfig, MpsConfig, QuantityError, SharingStrategy, TimeSliceInterval, parse_quantity,
    },
};
use tracing::{info, warn};

use crate::{
    cdi::{ContainerEdits, Mount},
    checkpoint::{DeviceDetail, MigDetail, SharedDetail},
    error::ClaimError,
    gpu::{ComputeMode, GpuBackend, GpuError},
    mig::{self, MigDevice, MigError},
    state::{DeviceContext, DeviceKind, DevicePreparer, NodeState, WholeGpuPreparer},
};
use mps::{DaemonDefaults, MpsError, MpsManager};
use timeslice::TimeSliceError;

/// Why a share could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SharingError {
    /// The device already serves shares of the other strategy.
    #[error(
        "device {device} is already shared with {current} by claims {holders:?}; this claim asks for {requested} \
         (all shares of a device must use one strategy)"
    )]
    StrategyConflict {
        device: String,
        current: &'static str,
        requested: &'static str,
        holders: Vec<String>,
    },
    /// A consumed capacity that is not a quantity.
    #[error("failed to read consumed capacity {name}={value:?}: {source}")]
    ConsumedCapacity {
        name: String,
        value: String,
        source: QuantityError,
    },
    /// The compute share is not a percentage.
    #[error("consumed capacity compute={0} is not a percentage between 1 and 100")]
    ComputeShare(u64),
    /// Setting the GPU's compute mode failed.
    #[error("failed to set the compute mode of GPU {gpu}: {source}")]
    ComputeMode { gpu: u32, source: GpuError },
    /// The MPS daemon could not be started, reached or stopped.
    #[error(transparent)]
    Mps(#[from] MpsError),
    /// The time-slice could not be set.
    #[error(transparent)]
    TimeSlice(#[from] TimeSliceError),
    /// The MIG device behind a shared MIG placement could not be made or removed.
    #[error(transparent)]
    Mig(#[from] MigError),
}

/// Holders of each shared device, by device key ([`share_key`]).
#[derive(Debug, Default)]
pub struct ShareUsers {
    devices: Mutex<BTreeMap<String, DeviceShares>>,
}

/// The state of one shared device.
#[derive(Clone, Debug)]
struct DeviceShares {
    strategy: SharingStrategy,
    holders: BTreeSet<String>,
    /// The MIG device behind a shared MIG placement, made by its first share.
    mig: Option<MigDevice>,
}

impl ShareUsers {
    /// Records `holder` (e.g. `<claim uid>/<device name>`) on `device`; returns true when it is the first.
    /// Adding a holder twice is harmless (a retried prepare).
    pub fn add(&self, device: &str, holder: &str, strategy: SharingStrategy) -> Result<bool, SharingError> {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        let shares = devices.entry(device.to_string()).or_insert_with(|| DeviceShares {
            strategy,
            holders: BTreeSet::new(),
            mig: None,
        });
        if shares.strategy != strategy && !shares.holders.is_empty() {
            return Err(SharingError::StrategyConflict {
                device: device.to_string(),
                current: shares.strategy.as_str(),
                requested: strategy.as_str(),
                holders: shares.holders.iter().cloned().collect(),
            });
        }
        shares.strategy = strategy;
        let first = shares.holders.is_empty();
        shares.holders.insert(holder.to_string());
        Ok(first)
    }

    /// Removes `holder`; returns true when no holder is left on `device` (also when it was never there, so
    /// an unprepare after a crash still cleans up).
    pub fn remove(&self, device: &str, holder: &str) -> bool {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        let Some(shares) = devices.get_mut(device) else {
            return true;
        };
        shares.holders.remove(holder);
        if shares.holders.is_empty() {
            devices.remove(device);
            return true;
        }
        false
    }

    /// Number of holders of `device`.
    pub fn count(&self, device: &str) -> usize {
        let devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        devices.get(device).map_or(0, |d| d.holders.len())
    }

    fn mig(&self, device: &str) -> Option<MigDevice> {
        let devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        devices.get(device).and_then(|d| d.mig.clone())
    }

    fn set_mig(&self, device: &str, mig: Option<MigDevice>) {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = devices.get_mut(device) {
            d.mig = mig;
        }
    }

    /// MIG devices behind shared MIG placements that still have holders.
    pub fn mig_devices(&self) -> Vec<MigDevice> {
        let devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        devices.values().filter_map(|d| d.mig.clone()).collect()
    }
}

/// The key of a shared device: every share of a whole GPU (`gpu-<i>-shared` and the slots
/// `gpu-<i>-share-<n>`) shares the GPU, keyed `gpu-<i>`; a shared MIG placement is keyed by its name
/// without `-shared`. Keys name the MPS daemon directory too. An exclusive device (`gpu-<i>`, a MIG
/// placement) whose claim's config asks for sharing among its own containers gets the same key, with that
/// claim as the only holder.
pub fn share_key(device: &DeviceName) -> String {
    match device {
        DeviceName::Gpu { gpu } | DeviceName::SharedGpu { gpu } | DeviceName::ShareSlot { gpu, .. } => {
            format!("gpu-{gpu}")
        }
        DeviceName::SharedMig { gpu, profile, start } | DeviceName::Mig { gpu, profile, start } => {
            DeviceName::Mig {
                gpu: *gpu,
                profile: profile.clone(),
                start: *start,
            }
            .to_string()
        }
    }
}

/// One share to prepare.
#[derive(Clone, Debug)]
pub struct ShareRequest<'a> {
    /// Unique per claim and device: `<claim uid>/<device name>`.
    pub holder: String,
    pub device: &'a DeviceName,
    /// The physical GPU.
    pub gpu: &'a GpuInfo,
    pub strategy: SharingStrategy,
    pub mps: Option<&'a MpsConfig>,
    /// Requested interval (time-slicing of whole GPUs).
    pub interval: TimeSliceInterval,
    /// The allocation result's `consumedCapacity`.
    pub consumed: &'a BTreeMap<String, Quantity>,
}

/// What a prepared share gives its containers and what the checkpoint keeps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PreparedShare {
    /// `GPU-…` or `MIG-…` UUID the containers use.
    pub uuid: String,
    /// The MIG device behind a shared MIG placement.
    pub mig: Option<MigDevice>,
    pub env: Vec<String>,
    /// `(host path, container path)` bind mounts.
    pub mounts: Vec<(String, String)>,
    pub mps_pipe_dir: Option<String>,
    /// Applied limits by name (`activeThreadPercentage`, `pinnedDeviceMemoryLimit`, `timeSlice`).
    pub limits: BTreeMap<String, String>,
}

/// Prepares and unprepares shares: keeps the holder count per device and starts/stops what the first and
/// last share need (MPS daemon and exclusive compute mode, time-slice, the MIG device of a shared MIG
/// placement). Callers hold the GPU's lock.
pub struct Sharer {
    backend: Arc<dyn GpuBackend>,
    mps: MpsManager,
    users: ShareUsers,
    /// On real GPUs MPS clients must share the host's /dev/shm with the daemon.
    real_hardware: bool,
}

impl Sharer {
    pub fn new(backend: Arc<dyn GpuBackend>, mps: MpsManager, real_hardware: bool) -> Self {
        Self {
            backend,
            mps,
            users: ShareUsers::default(),
            real_hardware,
        }
    }

    pub fn users(&self) -> &ShareUsers {
        &self.users
    }

    pub fn mps(&self) -> &MpsManager {
        &self.mps
    }

    /// Re-registers a share prepared before a restart (from a completed checkpoint record).
    pub fn restore(
        &self,
        device: &DeviceName,
        holder: &str,
        strategy: SharingStrategy,
        mig: Option<MigDevice>,
    ) {
        let key = share_key(device);
        if self.users.add(&key, holder, strategy).is_ok() && mig.is_some() {
            self.users.set_mig(&key, mig);
        }
    }

    /// Prepares one share. On failure the device is left as it was before the call.
    pub fn prepare(&self, req: &ShareRequest<'_>) -> Result<PreparedShare, SharingError> {
        let key = share_key(req.device);
        let first = self.users.add(&key, &req.holder, req.strategy)?;
        let result = self.prepare_registered(req, &key, first);
        if result.is_err() {
            let mig = self.users.mig(&key);
            if self.users.remove(&key, &req.holder)
                && let Err(e) = self.teardown(req.gpu, &key, req.strategy, req.device, mig)
            {
                warn!(key, error = %e, "could not undo the shared device's setup");
            }
        }
        result
    }

    fn prepare_registered(
        &self,
        req: &ShareRequest<'_>,
        key: &str,
        first: bool,
    ) -> Result<PreparedShare, SharingError> {
        let gpu = req.gpu.index;
        let mig = match req.device {
            DeviceName::SharedMig { profile, start, .. } | DeviceName::Mig { profile, start, .. } => {
                let recorded = self.users.mig(key);
                let dev =
                    mig::prepare_mig(self.backend.as_ref(), req.gpu, profile, *start, recorded.as_ref())?;
                self.users.set_mig(key, Some(dev.clone()));
                Some(dev)
            }
            _ => {
                if first {
                    mig::ensure_whole_gpu(self.backend.as_ref(), req.gpu)?;
                }
                None
            }
        };
        let uuid = mig
            .as_ref()
            .map_or_else(|| req.gpu.uuid.clone(), |m| m.uuid.clone());
        let mut out = PreparedShare {
            uuid: uuid.clone(),
            mig: mig.clone(),
            ..Default::default()
        };
        match req.strategy {
            SharingStrategy::Mps => {
                let limits = share_limits(req.consumed, req.mps, &req.device.to_string())?;
                if !self.mps.is_running(key) {
                    if mig.is_none() {
                        // Only the MPS server may own the GPU, so clients cannot bypass it.
                        self.backend
                            .set_compute_mode(gpu, ComputeMode::ExclusiveProcess)
                            .map_err(|source| SharingError::ComputeMode { gpu, source })?;
                    }
                    let defaults = DaemonDefaults {
                        active_thread_percentage: req.mps.and_then(|m| m.default_active_thread_percentage),
                        pinned_memory_bytes: req
                            .mps
                            .and_then(|m| m.pinned_limit_bytes(&req.device.to_string())),
                    };
                    self.mps.start(key, &uuid, defaults)?;
                }
                let dirs = self.mps.dirs(key);
                let (env, mounts) = mps::client_edits(&dirs, limits, self.real_hardware);
                out.env = env;
                out.mounts = mounts;
                out.mps_pipe_dir = Some(dirs.pipe.display().to_string());
                if let Some(p) = limits.active_thread_percentage {
                    out.limits.insert("activeThreadPercentage".into(), p.to_string());
                }
                if let Some(b) = limits.pinned_memory_bytes {
                    out.limits
                        .insert("pinnedDeviceMemoryLimit".into(), format!("{}M", b >> 20));
                }
            }
            SharingStrategy::TimeSlicing => {
                if mig.is_none() {
                    let slice = timeslice::acquire(self.backend.as_ref(), gpu, req.interval, first)?;
                    out.limits.insert("timeSlice".into(), format!("{slice:?}"));
                }
            }
        }
        Ok(out)
    }

    /// Unprepares one share; after the last share of the device, undoes the device-wide setup.
    pub fn unprepare(
        &self,
        gpu: &GpuInfo,
        device: &DeviceName,
        holder: &str,
        strategy: SharingStrategy,
    ) -> Result<(), SharingError> {
        let key = share_key(device);
        let mig = self.users.mig(&key);
        if self.users.remove(&key, holder) {
            return self.teardown(gpu, &key, strategy, device, mig);
        }
        Ok(())
    }

    pub(crate) fn teardown(
        &self,
        gpu: &GpuInfo,
        key: &str,
        strategy: SharingStrategy,
        device: &DeviceName,
        mig: Option<MigDevice>,
    ) -> Result<(), SharingError> {
        let index = gpu.index;
        let is_mig = matches!(device, DeviceName::SharedMig { .. } | DeviceName::Mig { .. });
        match strategy {
            SharingStrategy::Mps => {
                self.mps.stop(key)?;
                if !is_mig {
                    self.backend
                        .set_compute_mode(index, ComputeMode::Default)
                        .map_err(|source| SharingError::ComputeMode { gpu: index, source })?;
                }
            }
            SharingStrategy::TimeSlicing if !is_mig => {
                timeslice::release(self.backend.as_ref(), index, true)?
            }
            SharingStrategy::TimeSlicing => {}
        }
        if let DeviceName::SharedMig { profile, start, .. } | DeviceName::Mig { profile, start, .. } = device
        {
            // The MIG device lives as long as its shares: the last one destroys it. Without a record (a crash
            // before it was known) the start-up reconcile removes it instead.
            if let Some(dev) = mig.filter(|d| &d.profile == profile && d.placement.start == *start) {
                mig::unprepare_mig(self.backend.as_ref(), gpu, &dev)?;
            }
        }
        Ok(())
    }
}

/// The limits one MPS share gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShareLimits {
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`; `None` = no limit.
    pub active_thread_percentage: Option<u32>,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in bytes; `None` = no limit.
    pub pinned_memory_bytes: Option<u64>,
}

/// A share's limits: the allocation's consumed `compute` (percent) and `memory` (bytes) capacity when the
/// scheduler assigned them, else the MPS config's defaults (per device name, then the default).
pub fn share_limits(
    consumed: &BTreeMap<String, Quantity>,
    mps: Option<&MpsConfig>,
    device_name: &str,
) -> Result<ShareLimits, SharingError> {
    let read = |name: &str| -> Result<Option<u64>, SharingError> {
        consumed
            .get(name)
            .map(|q| {
                parse_quantity(&q.0).map_err(|source| SharingError::ConsumedCapacity {
                    name: name.to_string(),
                    value: q.0.clone(),
                    source,
                })
            })
            .transpose()
    };
    let compute = match read(attributes::COMPUTE)? {
        Some(p) if (1..=100).contains(&p) => Some(p as u32),
        Some(p) => return Err(SharingError::ComputeShare(p)),
        None => mps.and_then(|m| m.default_active_thread_percentage),
    };
    let memory = match read(attributes::MEMORY)? {
        Some(b) => Some(b),
        None => mps.and_then(|m| m.pinned_limit_bytes(device_name)),
    };
    Ok(ShareLimits {
        active_thread_percentage: compute.filter(|p| *p < 100),
        pinned_memory_bytes: memory,
    })
}

/// Strategy of a shared device whose claim has no sharing config; the policy's default too.
pub const DEFAULT_STRATEGY: SharingStrategy = SharingStrategy::Mps;

/// The opaque configuration that applies to the context's device, validated; `None` when the allocation
/// has none for it (and during crash recovery, where only the checkpoint is known).
pub fn device_config(ctx: &DeviceContext) -> Result<Option<DeviceConfig>, ClaimError> {
    config::effective_config(
        &ctx.allocation.config_entries,
        &ctx.allocation.request,
        &ctx.device,
    )
    .map_err(|source| ClaimError::InvalidConfig {
        request: ctx.allocation.request.clone(),
        device: ctx.device.to_string(),
        source: Box::new(source),
    })
}

fn strategy_of(detail: &SharedDetail) -> SharingStrategy {
    match detail.strategy.as_deref() {
        Some("TimeSlicing") => SharingStrategy::TimeSlicing,
        _ => SharingStrategy::Mps,
    }
}

fn holder(ctx: &DeviceContext) -> String {
    format!("{}/{}", ctx.claim.uid, ctx.device)
}

/// Registers a preparer for every device kind: whole GPUs and MIG devices (each of which becomes a
/// one-holder share when its config asks for sharing) and shared devices. The binary and the restart
/// tests assemble the plugin through this one function, so they cannot drift apart.
pub fn with_preparers(state: NodeState, shared: &Arc<SharedPreparer>) -> NodeState {
    state
        .with_preparer(
            DeviceKind::Gpu,
            Arc::new(GpuPreparer {
                shared: shared.clone(),
            }),
        )
        .with_preparer(
            DeviceKind::Mig,
            Arc::new(mig::MigPreparer {
                shared: shared.clone(),
            }),
        )
        .with_preparer(DeviceKind::Shared, shared.clone())
}

/// Prepares shares of GPUs and MIG placements (`gpu-<i>-shared`, `gpu-<i>-share-<n>`,
/// `gpu-<i>-mig-<p>-<s>-shared`), and exclusive devices whose config asks for sharing among the claim's
/// own containers.
pub struct SharedPreparer {
    pub sharer: Arc<Sharer>,
}

impl SharedPreparer {
    /// Stops MPS daemons no prepared share uses any more (left by a crash between the last unprepare's
    /// checkpoint write and the daemon's stop). Call after [`crate::state::NodeState::recover`].
    pub fn stop_orphaned_daemons(&self, gpus: &[GpuInfo]) {
        for key in self.sharer.mps().running() {
            if self.sharer.users().count(&key) > 0 {
                continue;
            }
            let Ok(device) = key.parse::<DeviceName>() else {
                continue;
            };
            let Some(gpu) = gpus.iter().find(|g| g.index == device.gpu()) else {
                continue;
            };
            info!(key, "stopping an MPS daemon no prepared claim uses");
            if let Err(e) = self
                .sharer
                .teardown(gpu, &key, SharingStrategy::Mps, &device, None)
            {
                warn!(key, error = %e, "could not stop an orphaned MPS daemon");
            }
        }
    }
}

impl DevicePreparer for SharedPreparer {
    fn plan(&self, ctx: &DeviceContext) -> Result<DeviceDetail, ClaimError> {
        let config = device_config(ctx)?;
        let sharing = config.as_ref().and_then(|c| c.sharing());
        let strategy = sharing.map_or(DEFAULT_STRATEGY, |s| s.strategy);
        let err = |source: SharingError| ClaimError::Sharing {
            device: ctx.device.to_string(),
            source: Box::new(source),
        };
        let mig = match &ctx.device {
            DeviceName::SharedMig { profile, start, .. } | DeviceName::Mig { profile, start, .. } => {
                let (_, placement) = mig::resolve(&ctx.gpu, profile, *start).map_err(|e| err(e.into()))?;
                Some(MigDetail::planned(ctx.gpu.index, profile.clone(), placement))
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
            .map_err(err)?;
        }
        Ok(DeviceDetail::Shared(SharedDetail {
            gpu: ctx.gpu.index,
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
        let req = ShareRequest {
            holder: holder(ctx),
            device: &ctx.device,
            gpu: &ctx.gpu,
            strategy: strategy_of(&planned),
            mps: sharing.and_then(|s| s.mps.as_ref()),
            interval: sharing
                .and_then(|s| s.time_slicing)
                .map(|t| t.interval)
                .unwrap_or_default(),
            consumed: &ctx.allocation.consumed_capacity,
        };
        let device = ctx.device.to_string();
        let share = self.sharer.prepare(&req).map_err(|source| ClaimError::Sharing {
            device: device.clone(),
            source: Box::new(source),
        })?;
        let mut edits = match mig::device_edits(ctx.backend.as_ref(), &ctx.gpu, share.mig.as_ref()) {
            Ok(edits) => edits,
            Err(source) => {
                let _ = self
                    .sharer
                    .unprepare(&ctx.gpu, &ctx.device, &req.holder, req.strategy);
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
            uuid: Some(share.uuid),
            mig: share.mig.as_ref().map(mig::detail_of),
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
        self.sharer
            .unprepare(&ctx.gpu, &ctx.device, &holder(ctx), strategy_of(d))
            .map_err(|source| ClaimError::Sharing {
                device: ctx.device.to_string(),
                source: Box::new(source),
            })
    }

    fn restore(&self, ctx: &DeviceContext, detail: &DeviceDetail) {
        let DeviceDetail::Shared(d) = detail else { return };
        let mig = d.mig.as_ref().and_then(|m| mig::device_of(&ctx.gpu, m));
        self.sharer
            .restore(&ctx.device, &holder(ctx), strategy_of(d), mig);
    }
}

/// Whole GPUs: [`WholeGpuPreparer`], after turning an idle Hopper out of MIG mode; a claim whose
/// `GpuConfig` asks for sharing among its own containers goes to the shared preparer.
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
        mig::ensure_whole_gpu(ctx.backend.as_ref(), &ctx.gpu).map_err(|source| ClaimError::Mig {
            device: ctx.device.to_string(),
            source: Box::new(source),
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_and_last_holders_are_reported_and_strategies_do_not_mix() {
        let users = ShareUsers::default();
        assert!(
            users
                .add("GPU-1", "a/gpu-0-shared", SharingStrategy::Mps)
                .unwrap()
        );
        assert!(
            !users
                .add("GPU-1", "b/gpu-0-shared", SharingStrategy::Mps)
                .unwrap()
        );
        assert!(
            !users
                .add("GPU-1", "b/gpu-0-shared", SharingStrategy::Mps)
                .unwrap()
        );
        let err = users
            .add("GPU-1", "c/gpu-0-shared", SharingStrategy::TimeSlicing)
            .unwrap_err();
        assert!(err.to_string().contains("already shared with MPS"), "{err}");
        assert!(!users.remove("GPU-1", "a/gpu-0-shared"));
        assert!(users.remove("GPU-1", "b/gpu-0-shared"));
        assert!(users.remove("GPU-1", "never-added"));
        assert!(
            users
                .add("GPU-1", "c/gpu-0-shared", SharingStrategy::TimeSlicing)
                .unwrap()
        );
    }

    #[test]
    fn consumed_capacity_wins_over_config_defaults() {
        let mps = MpsConfig {
            default_active_thread_percentage: Some(30),
            default_pinned_device_memory_limit: Some("4Gi".into()),
            ..Default::default()
        };
        let none = BTreeMap::new();
        assert_eq!(
            share_limits(&none, Some(&mps), "gpu-0-shared").unwrap(),
            ShareLimits {
                active_thread_percentage: Some(30),
                pinned_memory_bytes: Some(4 << 30)
            }
        );
        let consumed: BTreeMap<_, _> = [
            ("compute".to_string(), Quantity("25".into())),
            ("memory".to_string(), Quantity("10Gi".into())),
        ]
        .into();
        assert_eq!(
            share_limits(&consumed, Some(&mps), "gpu-0-shared").unwrap(),
            ShareLimits {
                active_thread_percentage: Some(25),
                pinned_memory_bytes: Some(10 << 30)
            }
        );
        let full: BTreeMap<_, _> = [("compute".to_string(), Quantity("100".into()))].into();
        assert_eq!(
            share_limits(&full, None, "gpu-0-shared")
                .unwrap()
                .active_thread_percentage,
            None
        );
        let bad: BTreeMap<_, _> = [("compute".to_string(), Quantity("250".into()))].into();
        assert!(matches!(
            share_limits(&bad, None, "gpu-0-shared"),
            Err(SharingError::ComputeShare(250))
        ));
    }
}
