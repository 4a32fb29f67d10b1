//! MIG devices created on demand: one GPU instance at the allocated placement and one compute instance
//! spanning it, per claim.
//!
//! ```text
//!  prepare_mig:   MIG mode on? ─no─▶ Hopper+: enable │ A100: error (needs a reset the plugin will not do)
//!                     ▼
//!                 create GI at placement ─▶ create CI ─▶ capability minors ─▶ MigDevice
//!                     └─ any later step fails: destroy what this call created (and MIG mode back off)
//!  unprepare_mig: destroy CI ─▶ destroy GI (NotFound = already gone) ─▶ last GI gone and Hopper+: MIG off
//!  reconcile_at_start: destroy every GI/CI that no completed claim owns; MIG off where nothing is left
//!                      (skipped where another tool owns the MIG layout: crate::kubelet::coexistence)
//! ```
//!
//! Callers serialize operations per GPU (the prepare state machine holds a per-GPU lock): MIG mode changes
//! and "was that the last GI?" checks are only correct when nothing else changes the GPU meanwhile.
//!
//! Identity: NVML does not say "already exists" and GI ids are not a function of the placement, so an
//! instance is recognized by `(GPU, GI id, profile id, placement)` and, for compute instances, the MIG UUID
//! (new on every creation). An instance is ours only when the checkpoint names it; one merely sitting at
//! "our" placement is someone else's and is never reused or destroyed outside [`reconcile_at_start`].
//!
//! This module knows MIG and the GPU backend only: the checkpoint's view of MIG devices is in
//! [`crate::node::mig_records`], and "MIG, then share on it" is composed in [`crate::devices::preparers`].

use serde::{Deserialize, Serialize};
use tessera_api::{GpuInfo, MigPlacement, MigProfileInfo};
use tracing::{info, warn};

use crate::gpu::{GpuBackend, GpuError};

/// A prepared MIG device: what the checkpoint records and the CDI spec is built from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigDevice {
    /// Index of the parent GPU.
    pub gpu: u32,
    /// Profile name, e.g. `3g.40gb`.
    pub profile: String,
    /// GI profile id (`info.id`).
    pub profile_id: u32,
    pub placement: MigPlacement,
    pub gpu_instance: u32,
    pub compute_instance: u32,
    /// `MIG-…` UUID.
    pub uuid: String,
    /// Minor of `/dev/nvidia-caps/nvidia-cap<N>` granting access to the GPU instance.
    pub gi_cap_minor: u32,
    /// Minor of `/dev/nvidia-caps/nvidia-cap<N>` granting access to the compute instance.
    pub ci_cap_minor: u32,
}

/// A failed MIG operation; each names the GPU and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum MigError {
    /// The GPU has no MIG support.
    #[error("GPU {gpu} is not MIG-capable; allocate it as a whole GPU")]
    NotMigCapable { gpu: u32 },
    /// The profile is not one the GPU supports.
    #[error("GPU {gpu} has no MIG profile {profile:?}; supported: {supported}")]
    UnknownProfile {
        gpu: u32,
        profile: String,
        supported: String,
    },
    /// The placement is not one of the profile's placements.
    #[error(
        "MIG profile {profile} on GPU {gpu} cannot start at memory slice {start}; valid starts: {valid:?}"
    )]
    InvalidPlacement {
        gpu: u32,
        profile: String,
        start: u32,
        valid: Vec<u32>,
    },
    /// Reading the MIG mode failed.
    #[error("failed to read the MIG mode of GPU {gpu}: {source}")]
    ReadMigMode { gpu: u32, source: GpuError },
    /// MIG mode is off on a GPU that needs a reset to turn it on.
    #[error(
        "MIG mode is off on GPU {gpu} and this GPU needs a reset to turn it on, which the plugin does not do; \
         run `nvidia-smi -i {gpu} -mig 1` and reset the GPU when it is idle"
    )]
    MigModeNeedsReset { gpu: u32 },
    /// Turning MIG mode on failed.
    #[error("failed to enable MIG mode on GPU {gpu}: {source}")]
    EnableMigMode { gpu: u32, source: GpuError },
    /// Turning MIG mode off failed.
    #[error("failed to disable MIG mode on GPU {gpu}: {source}")]
    DisableMigMode { gpu: u32, source: GpuError },
    /// A whole-GPU claim on a GPU that stays in MIG mode.
    #[error(
        "GPU {gpu} is in MIG mode (MIG instances exist, or leaving MIG mode needs a GPU reset), so it cannot be \
         used as a whole GPU"
    )]
    MigModeOn { gpu: u32 },
    /// Listing the GPU's instances failed.
    #[error("failed to list the MIG instances of GPU {gpu}: {source}")]
    ListInstances { gpu: u32, source: GpuError },
    /// Creating the GPU instance failed (`insufficient resources`: the placement is taken).
    #[error("failed to create a {profile} GPU instance at memory slice {start} on GPU {gpu}: {source}")]
    CreateGpuInstance {
        gpu: u32,
        profile: String,
        start: u32,
        source: GpuError,
    },
    /// Creating the compute instance failed.
    #[error("failed to create a compute instance in GPU instance {gpu_instance} on GPU {gpu}: {source}")]
    CreateComputeInstance {
        gpu: u32,
        gpu_instance: u32,
        source: GpuError,
    },
    /// Reading the capability minors failed.
    #[error(
        "failed to read the MIG capability minors of GPU {gpu} GI {gpu_instance} CI {compute_instance}: {source}"
    )]
    CapabilityMinors {
        gpu: u32,
        gpu_instance: u32,
        compute_instance: u32,
        source: GpuError,
    },
    /// Destroying the compute instance failed (`in use`: processes still run on it).
    #[error(
        "failed to destroy compute instance {compute_instance} of GPU instance {gpu_instance} on GPU {gpu}: {source}"
    )]
    DestroyComputeInstance {
        gpu: u32,
        gpu_instance: u32,
        compute_instance: u32,
        source: GpuError,
    },
    /// Destroying the GPU instance failed.
    #[error("failed to destroy GPU instance {gpu_instance} on GPU {gpu}: {source}")]
    DestroyGpuInstance {
        gpu: u32,
        gpu_instance: u32,
        source: GpuError,
    },
}

pub type Result<T, E = MigError> = std::result::Result<T, E>;

/// The profile and placement of a MIG device on `gpu`, checked against what discovery found.
pub fn resolve<'g>(
    gpu: &'g GpuInfo,
    profile: &str,
    start: u32,
) -> Result<(&'g MigProfileInfo, MigPlacement)> {
    let mig = gpu
        .mig
        .as_ref()
        .ok_or(MigError::NotMigCapable { gpu: gpu.index })?;
    let prof = mig.profile(profile).ok_or_else(|| MigError::UnknownProfile {
        gpu: gpu.index,
        profile: profile.to_string(),
        supported: mig
            .profiles
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    let placement = prof
        .placements
        .iter()
        .find(|p| p.start == start)
        .copied()
        .ok_or_else(|| MigError::InvalidPlacement {
            gpu: gpu.index,
            profile: profile.to_string(),
            start,
            valid: prof.placements.iter().map(|p| p.start).collect(),
        })?;
    Ok((prof, placement))
}

fn toggles_without_reset(gpu: &GpuInfo) -> bool {
    gpu.mig.as_ref().is_some_and(|m| m.mode_toggle_without_reset)
}

/// Turns MIG mode on if it is off; returns whether this call turned it on.
fn ensure_mig_mode(backend: &dyn GpuBackend, gpu: &GpuInfo) -> Result<bool> {
    let index = gpu.index;
    let mode = backend
        .mig_mode(index)
        .map_err(|source| MigError::ReadMigMode { gpu: index, source })?;
    if mode.current {
        return Ok(false);
    }
    if !toggles_without_reset(gpu) {
        return Err(MigError::MigModeNeedsReset { gpu: index });
    }
    backend
        .set_mig_mode(index, true)
        .map_err(|source| MigError::EnableMigMode { gpu: index, source })?;
    info!(gpu = index, "enabled MIG mode");
    Ok(true)
}

/// Creates the MIG device of `profile` at memory slice `start` on `gpu`.
///
/// `recorded` is what the checkpoint holds for this claim's device, if anything: when that exact instance
/// (same GI id, profile and placement) still exists, it is returned as is (creating the compute instance if
/// only that is missing) instead of failing on the occupied placement.
///
/// On failure nothing this call created is left behind.
pub fn prepare_mig(
    backend: &dyn GpuBackend,
    gpu: &GpuInfo,
    profile: &str,
    start: u32,
    recorded: Option<&MigDevice>,
) -> Result<MigDevice> {
    let (prof, placement) = resolve(gpu, profile, start)?;
    let index = gpu.index;
    let enabled_now = ensure_mig_mode(backend, gpu)?;
    let undo_mode = |err: MigError| {
        if enabled_now {
            // Best effort: leave the GPU as we found it, so a failed MIG prepare does not block whole-GPU use.
            let _ = maybe_disable_mig_mode(backend, gpu);
        }
        err
    };

    if let Some(rec) =
        recorded.filter(|r| r.gpu == index && r.profile_id == prof.profile_id && r.placement == placement)
    {
        let live = backend
            .list_gpu_instances(index)
            .map_err(|source| MigError::ListInstances { gpu: index, source })?;
        if let Some(gi) = live.iter().find(|gi| {
            gi.id == rec.gpu_instance && gi.profile_id == rec.profile_id && gi.placement == placement
        }) {
            if gi
                .compute_instances
                .iter()
                .any(|ci| ci.id == rec.compute_instance && ci.uuid == rec.uuid)
            {
                return Ok(rec.clone());
            }
            if gi.compute_instances.is_empty() {
                return finish(backend, index, prof, placement, gi.id).inspect_err(|_| {
                    let _ = backend.destroy_gpu_instance(index, gi.id);
                });
            }
        }
    }

    let gi = crate::metrics::sink::mig_operation("create_gpu_instance", || {
        backend.create_gpu_instance(index, prof.profile_id, placement)
    })
    .map_err(|source| {
        undo_mode(MigError::CreateGpuInstance {
            gpu: index,
            profile: profile.to_string(),
            start,
            source,
        })
    })?;
    finish(backend, index, prof, placement, gi).map_err(|err| {
        if let Err(e) = backend.destroy_gpu_instance(index, gi) {
            warn!(gpu = index, gpu_instance = gi, error = %e, "could not roll back a half-created GPU instance");
        }
        undo_mode(err)
    })
}

/// Creates the compute instance in GI `gi` and reads what the CDI spec needs; on failure destroys the
/// compute instance it created (the caller destroys the GI).
fn finish(
    backend: &dyn GpuBackend,
    gpu: u32,
    prof: &MigProfileInfo,
    placement: MigPlacement,
    gi: u32,
) -> Result<MigDevice> {
    let ci = crate::metrics::sink::mig_operation("create_compute_instance", || {
        backend.create_compute_instance(gpu, gi)
    })
    .map_err(|source| MigError::CreateComputeInstance {
        gpu,
        gpu_instance: gi,
        source,
    })?;
    let (gi_cap_minor, ci_cap_minor) = backend.mig_capability_minors(gpu, gi, ci.id).map_err(|source| {
        let _ = backend.destroy_compute_instance(gpu, gi, ci.id);
        MigError::CapabilityMinors {
            gpu,
            gpu_instance: gi,
            compute_instance: ci.id,
            source,
        }
    })?;
    info!(gpu, gpu_instance = gi, compute_instance = ci.id, uuid = %ci.uuid, profile = %prof.name, "created MIG device");
    Ok(MigDevice {
        gpu,
        profile: prof.name.clone(),
        profile_id: prof.profile_id,
        placement,
        gpu_instance: gi,
        compute_instance: ci.id,
        uuid: ci.uuid,
        gi_cap_minor,
        ci_cap_minor,
    })
}

/// Destroys a MIG device made by [`prepare_mig`], then turns MIG mode off when it was the GPU's last GPU
/// instance and the GPU can toggle without a reset. Succeeds when the device is already gone; never touches
/// an instance that reuses the ids but is not the recorded one.
pub fn unprepare_mig(backend: &dyn GpuBackend, gpu: &GpuInfo, dev: &MigDevice) -> Result<()> {
    destroy_recorded(
        backend,
        dev.gpu,
        dev.gpu_instance,
        Some((dev.compute_instance, &dev.uuid)),
        dev.placement,
    )?;
    maybe_disable_mig_mode(backend, gpu)
}

/// Destroys the recorded GI (and its CI when `ci` is given) if they still are the recorded ones.
pub fn destroy_recorded(
    backend: &dyn GpuBackend,
    gpu: u32,
    gi: u32,
    ci: Option<(u32, &str)>,
    placement: MigPlacement,
) -> Result<()> {
    let live = match backend.list_gpu_instances(gpu) {
        Ok(live) => live,
        // MIG turned off out of band: every instance is gone.
        Err(GpuError::NotSupported(_)) => return Ok(()),
        Err(source) => return Err(MigError::ListInstances { gpu, source }),
    };
    let Some(live_gi) = live.iter().find(|g| g.id == gi && g.placement == placement) else {
        return Ok(());
    };
    // The GI holds ours only if the CI (when we know it) is still the one we made; a GI id reused by a newer
    // claim after ours vanished must be left alone.
    if let Some((ci_id, uuid)) = ci {
        match live_gi.compute_instances.iter().find(|c| c.id == ci_id) {
            Some(c) if c.uuid != uuid => return Ok(()),
            Some(_) => destroy_ci(backend, gpu, gi, ci_id)?,
            None if !live_gi.compute_instances.is_empty() => return Ok(()),
            None => {}
        }
    }
    destroy_gi(backend, gpu, gi)
}

fn destroy_ci(backend: &dyn GpuBackend, gpu: u32, gi: u32, ci: u32) -> Result<()> {
    match crate::metrics::sink::mig_operation("destroy_compute_instance", || {
        backend.destroy_compute_instance(gpu, gi, ci)
    }) {
        Ok(()) | Err(GpuError::NotFound(_) | GpuError::NotSupported(_)) => Ok(()),
        Err(source) => Err(MigError::DestroyComputeInstance {
            gpu,
            gpu_instance: gi,
            compute_instance: ci,
            source,
        }),
    }
}

fn destroy_gi(backend: &dyn GpuBackend, gpu: u32, gi: u32) -> Result<()> {
    match crate::metrics::sink::mig_operation("destroy_gpu_instance", || {
        backend.destroy_gpu_instance(gpu, gi)
    }) {
        Ok(()) | Err(GpuError::NotFound(_) | GpuError::NotSupported(_)) => {
            info!(gpu, gpu_instance = gi, "destroyed GPU instance");
            Ok(())
        }
        Err(source) => Err(MigError::DestroyGpuInstance {
            gpu,
            gpu_instance: gi,
            source,
        }),
    }
}

/// Turns MIG mode off when the GPU has no GPU instances left and can toggle without a reset (Hopper and
/// newer), so the whole GPU is usable again. On A100 MIG mode stays on: turning it off needs a reset.
pub fn maybe_disable_mig_mode(backend: &dyn GpuBackend, gpu: &GpuInfo) -> Result<()> {
    if !toggles_without_reset(gpu) {
        return Ok(());
    }
    let index = gpu.index;
    let mode = backend
        .mig_mode(index)
        .map_err(|source| MigError::ReadMigMode { gpu: index, source })?;
    if !mode.current {
        return Ok(());
    }
    let live = backend
        .list_gpu_instances(index)
        .map_err(|source| MigError::ListInstances { gpu: index, source })?;
    if !live.is_empty() {
        return Ok(());
    }
    backend
        .set_mig_mode(index, false)
        .map_err(|source| MigError::DisableMigMode { gpu: index, source })?;
    info!(gpu = index, "disabled MIG mode: no GPU instances left");
    Ok(())
}

/// What [`reconcile_at_start`] destroyed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    /// `(gpu, gi, ci)` of every compute instance destroyed.
    pub compute_instances: Vec<(u32, u32, u32)>,
    /// `(gpu, gi)` of every GPU instance destroyed.
    pub gpu_instances: Vec<(u32, u32)>,
    /// GPUs whose MIG mode was turned off.
    pub mig_disabled: Vec<u32>,
}

/// Makes the hardware match the checkpoint after a (re)start: every GPU or compute instance on `gpus` that
/// is not one of `known` (the MIG devices of completed claims) is destroyed, which also rolls back claims
/// whose prepare was interrupted. MIG mode is then turned off where no instance is left (Hopper and newer).
///
/// MIG layouts made by hand are removed too: on a node served by tessera, MIG instances exist only for
/// claims. A layout another tool owns (mig-manager's `nvidia.com/mig.config`, GKE's partitions) is never
/// passed here: the node state then keeps unowned instances ([`crate::node::state::NodeState::keeping_unowned_mig`])
/// and serves its GPUs without MIG capability ([`crate::kubelet::coexistence`]). Instances that cannot be destroyed (processes still run on them) are logged and
/// left; the error of the first such failure is returned after every other GPU was handled.
pub fn reconcile_at_start(
    backend: &dyn GpuBackend,
    gpus: &[GpuInfo],
    known: &[MigDevice],
) -> Result<ReconcileReport> {
    let mut report = ReconcileReport::default();
    let mut first_err = None;
    for gpu in gpus.iter().filter(|g| g.mig.is_some()) {
        let index = gpu.index;
        let mode = backend
            .mig_mode(index)
            .map_err(|source| MigError::ReadMigMode { gpu: index, source })?;
        if !mode.current {
            continue;
        }
        let live = backend
            .list_gpu_instances(index)
            .map_err(|source| MigError::ListInstances { gpu: index, source })?;
        for gi in &live {
            let owner = known
                .iter()
                .find(|k| k.gpu == index && k.gpu_instance == gi.id && k.placement == gi.placement);
            let mut keep_gi = owner.is_some();
            for ci in &gi.compute_instances {
                if owner.is_some_and(|k| k.compute_instance == ci.id && k.uuid == ci.uuid) {
                    continue;
                }
                match destroy_ci(backend, index, gi.id, ci.id) {
                    Ok(()) => report.compute_instances.push((index, gi.id, ci.id)),
                    Err(e) => {
                        warn!(error = %e, "could not destroy an unknown compute instance");
                        keep_gi = true;
                        first_err.get_or_insert(e);
                    }
                }
            }
            if keep_gi {
                continue;
            }
            match destroy_gi(backend, index, gi.id) {
                Ok(()) => report.gpu_instances.push((index, gi.id)),
                Err(e) => {
                    warn!(error = %e, "could not destroy an unknown GPU instance");
                    first_err.get_or_insert(e);
                }
            }
        }
        let left = backend
            .list_gpu_instances(index)
            .map_err(|source| MigError::ListInstances { gpu: index, source })?;
        if left.is_empty() && toggles_without_reset(gpu) {
            match maybe_disable_mig_mode(backend, gpu) {
                Ok(()) => report.mig_disabled.push(index),
                Err(e) => {
                    warn!(error = %e, "could not turn MIG mode off");
                    first_err.get_or_insert(e);
                }
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(report),
    }
}

/// Readies a GPU for whole-GPU use: on Hopper and newer, MIG mode is turned off if no GPU instances exist.
/// Fails when GPU instances remain (a MIG claim still holds part of the GPU).
pub fn ensure_whole_gpu(backend: &dyn GpuBackend, gpu: &GpuInfo) -> Result<()> {
    if gpu.mig.is_none() {
        return Ok(());
    }
    maybe_disable_mig_mode(backend, gpu)?;
    let mode = backend
        .mig_mode(gpu.index)
        .map_err(|source| MigError::ReadMigMode {
            gpu: gpu.index,
            source,
        })?;
    if mode.current {
        // Either instances remain or the GPU needs a reset to leave MIG mode; both make CUDA see no GPU.
        return Err(MigError::MigModeOn { gpu: gpu.index });
    }
    Ok(())
}
