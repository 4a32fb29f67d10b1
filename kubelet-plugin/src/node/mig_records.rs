//! The checkpoint's view of MIG devices: what a prepared (or planned) MIG device looks like in a
//! [`MigDetail`], and which MIG devices the completed claims hold. Kept apart from [`crate::gpu::mig`] so the
//! MIG operations depend on the GPU backend only.

use tessera_api::GpuInfo;

use crate::gpu::mig::{MigDevice, resolve};
use crate::node::checkpoint::{Checkpoint, DeviceDetail, MigDetail, Phase};

/// The checkpoint detail of a prepared MIG device on `gpu` (whose UUID the record keeps).
pub fn detail_of(dev: &MigDevice, gpu: &GpuInfo) -> MigDetail {
    MigDetail {
        gpu: dev.gpu,
        gpu_uuid: Some(gpu.uuid.clone()),
        profile: dev.profile.clone(),
        placement: dev.placement,
        gpu_instance: Some(dev.gpu_instance),
        compute_instance: Some(dev.compute_instance),
        uuid: Some(dev.uuid.clone()),
    }
}

/// The MIG device a checkpoint detail records, when it records a finished one. Capability minors are not
/// kept in the checkpoint (they follow from the ids) and read back as 0.
pub fn device_of(gpu: &GpuInfo, detail: &MigDetail) -> Option<MigDevice> {
    let (prof, _) = resolve(gpu, &detail.profile, detail.placement.start).ok()?;
    Some(MigDevice {
        gpu: detail.gpu,
        profile: detail.profile.clone(),
        profile_id: prof.profile_id,
        placement: detail.placement,
        gpu_instance: detail.gpu_instance?,
        compute_instance: detail.compute_instance?,
        uuid: detail.uuid.clone()?,
        gi_cap_minor: 0,
        ci_cap_minor: 0,
    })
}

/// The MIG devices the completed claims of `checkpoint` hold (exclusive and shared) and those its warm
/// records keep, for [`crate::gpu::mig::reconcile_at_start`]. A detail whose parent UUID is not the GPU's at
/// its index names nothing on this GPU (its instance is another GPU's, or gone).
pub fn known_devices(checkpoint: &Checkpoint, gpus: &[GpuInfo]) -> Vec<MigDevice> {
    checkpoint
        .claims
        .values()
        .filter(|r| r.phase == Phase::PrepareCompleted)
        .flat_map(|r| r.devices.iter().map(|d| &d.detail))
        .chain(checkpoint.warm.values().map(|w| &w.detail))
        .filter_map(|detail| match detail {
            DeviceDetail::Mig(m) => Some(m),
            DeviceDetail::Shared(s) => s.mig.as_ref(),
            DeviceDetail::Gpu { .. } => None,
        })
        .filter_map(|m| {
            let gpu = gpus.iter().find(|g| g.index == m.gpu)?;
            if m.gpu_uuid.as_ref().is_some_and(|u| *u != gpu.uuid) {
                return None;
            }
            device_of(gpu, m)
        })
        .collect()
}
