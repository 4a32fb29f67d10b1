//! The decisions of recovery, as plain functions over the checkpoint, the API's claims and the hardware:
//! which records are still in use, which are orphans, which MIG instances two records both claim, and
//! whether a record's devices are still there to be re-adopted.
//!
//! Recovery prefers keeping a running workload's devices over tidiness: a device is only ever undone when
//! no claim allocated to this node and reserved by a pod could be using it.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::ResourceClaim;
use tessera_api::{DRIVER_NAME, GpuInfo};

use crate::gpu::GpuBackend;
use crate::kubelet::claims::{allocated_to, reserved};
use crate::node::cdi::Spec;
use crate::node::checkpoint::{Checkpoint, ClaimRecord, DeviceDetail, MigDetail, Phase, check_gpu_identity};

/// What the API says about the claim a record was made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimUse {
    /// The claim exists with the record's UID, is allocated to this node and reserved by a consumer.
    InUse,
    /// The claim exists with the record's UID and is allocated here or reserved, but not both (e.g. the
    /// pod is gone and kubelet has not unprepared yet, or the scheduler reserved it a moment ago): kept.
    Held,
    /// No claim with the record's UID is allocated to this node or reserved: nothing can be using it.
    Orphaned,
}

/// Classifies the claim `claim` (looked up by the record's namespace and name) for the record of `uid`.
pub fn claim_use(claim: Option<&ResourceClaim>, uid: &str, node: &str) -> ClaimUse {
    let Some(claim) = claim.filter(|c| c.metadata.uid.as_deref() == Some(uid)) else {
        return ClaimUse::Orphaned;
    };
    match (allocated_to(claim, DRIVER_NAME, node), reserved(claim)) {
        (true, true) => ClaimUse::InUse,
        (false, false) => ClaimUse::Orphaned,
        _ => ClaimUse::Held,
    }
}

/// `namespace/name` of a claim, the key recovery indexes listed claims by.
pub fn claim_key(namespace: &str, name: &str) -> String {
    format!("{namespace}/{name}")
}

/// A MIG instance, as `(gpu, gpu instance id)`.
pub type InstanceKey = (u32, u32);

/// The MIG instance a device detail holds, once created.
pub fn mig_instance(detail: &DeviceDetail) -> Option<InstanceKey> {
    let m = match detail {
        DeviceDetail::Mig(m) => m,
        DeviceDetail::Shared(s) => s.mig.as_ref()?,
        DeviceDetail::Gpu { .. } => return None,
    };
    Some((m.gpu, m.gpu_instance?))
}

/// One holder of a MIG instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub uid: String,
    /// The device name the record holds it as; the shares of one shared MIG device all name the same one.
    pub device: String,
    pub exclusive: bool,
}

/// The holders of every MIG instance any record names (both phases: an interrupted prepare holds its
/// instance until rolled back).
pub fn instance_owners(checkpoint: &Checkpoint) -> BTreeMap<InstanceKey, Vec<Owner>> {
    let mut owners: BTreeMap<InstanceKey, Vec<Owner>> = BTreeMap::new();
    for record in checkpoint.claims.values() {
        for d in &record.devices {
            if let Some(key) = mig_instance(&d.detail) {
                owners.entry(key).or_default().push(Owner {
                    uid: record.uid.clone(),
                    device: d.device.clone(),
                    exclusive: matches!(d.detail, DeviceDetail::Mig(_)),
                });
            }
        }
    }
    owners
}

/// Whether a set of holders may legitimately share one instance: only shares of one shared MIG device.
fn compatible(owners: &[Owner]) -> bool {
    owners.len() < 2
        || owners
            .iter()
            .all(|o| !o.exclusive && o.device == owners[0].device)
}

/// Every MIG instance held by records that cannot both hold it, as a sentence for logs and the inventory.
pub fn conflicts(checkpoint: &Checkpoint) -> Vec<String> {
    instance_owners(checkpoint)
        .into_iter()
        .filter(|(_, owners)| !compatible(owners))
        .map(|((gpu, gi), owners)| {
            let holders: Vec<String> = owners
                .iter()
                .map(|o| format!("{} as {}", o.uid, o.device))
                .collect();
            format!(
                "MIG instance {gi} on GPU {gpu} is recorded for more than one claim: {}",
                holders.join(", ")
            )
        })
        .collect()
}

/// Whether undoing `device` of claim `uid` on the hardware would take an instance another record holds
/// (then only the record goes, never the instance).
pub fn instance_held_by_another(
    owners: &BTreeMap<InstanceKey, Vec<Owner>>,
    uid: &str,
    device: &str,
    detail: &DeviceDetail,
) -> bool {
    let Some(key) = mig_instance(detail) else {
        return false;
    };
    let exclusive = matches!(detail, DeviceDetail::Mig(_));
    owners.get(&key).is_some_and(|list| {
        list.iter()
            .any(|o| o.uid != uid && (exclusive || o.exclusive || o.device != device))
    })
}

/// Checks that the MIG instance a completed record names is still on the hardware, with the same ids,
/// placement and UUID (after a reboot the ids may be reused by nothing, or by something else).
pub fn mig_intact(backend: &dyn GpuBackend, m: &MigDetail) -> Result<(), String> {
    let (Some(gi), Some(ci), Some(uuid)) = (m.gpu_instance, m.compute_instance, m.uuid.as_deref()) else {
        return Err(format!(
            "the record of the {} instance on GPU {} has no ids",
            m.profile, m.gpu
        ));
    };
    let live = backend
        .list_gpu_instances(m.gpu)
        .map_err(|e| format!("cannot list the MIG instances of GPU {}: {e}", m.gpu))?;
    let found = live.iter().any(|g| {
        g.id == gi
            && g.placement == m.placement
            && g.compute_instances.iter().any(|c| c.id == ci && c.uuid == uuid)
    });
    if found {
        Ok(())
    } else {
        Err(format!(
            "MIG instance {gi}/{ci} ({uuid}) of GPU {} is no longer on the hardware",
            m.gpu
        ))
    }
}

/// Checks that every device of `record` is on the physical GPU it was prepared on: the GPU its index
/// names now (`gpus`, as discovered) has the UUID the record keeps. Returns the devices judged by index
/// alone (records written before the UUID was kept), for a warning.
pub fn gpus_match(gpus: &BTreeMap<u32, GpuInfo>, record: &ClaimRecord) -> Result<Vec<String>, String> {
    let mut by_index = Vec::new();
    for d in &record.devices {
        let now = gpus.get(&d.detail.gpu()).map(|g| g.uuid.as_str());
        match check_gpu_identity(&d.detail, now) {
            Ok(true) => {}
            Ok(false) => by_index.push(d.device.clone()),
            Err(why) => return Err(format!("device {}: {why}", d.device)),
        }
    }
    Ok(by_index)
}

/// Checks that everything a completed record names on the hardware is still there.
pub fn record_intact(backend: &dyn GpuBackend, record: &ClaimRecord) -> Result<(), String> {
    if record.phase != Phase::PrepareCompleted {
        return Err("its preparation never completed".into());
    }
    for d in &record.devices {
        let mig = match &d.detail {
            DeviceDetail::Mig(m) => Some(m),
            DeviceDetail::Shared(s) => s.mig.as_ref(),
            DeviceDetail::Gpu { .. } => None,
        };
        if let Some(m) = mig {
            mig_intact(backend, m)?;
        }
    }
    Ok(())
}

/// Fills a planned MIG detail with the ids of the live instance at its placement, for a claim whose record
/// was lost but whose CDI spec (which must name the instance's UUID) is still handed to a running pod.
pub fn adopt_mig(
    backend: &dyn GpuBackend,
    gpu: &GpuInfo,
    planned: &MigDetail,
    spec: &str,
) -> Result<MigDetail, String> {
    let profile_id = gpu
        .mig
        .as_ref()
        .and_then(|m| m.profile(&planned.profile))
        .map(|p| p.profile_id)
        .ok_or_else(|| format!("GPU {} has no MIG profile {}", gpu.index, planned.profile))?;
    let live = backend
        .list_gpu_instances(gpu.index)
        .map_err(|e| format!("cannot list the MIG instances of GPU {}: {e}", gpu.index))?;
    let gi = live
        .iter()
        .find(|g| g.placement == planned.placement && g.profile_id == profile_id)
        .ok_or_else(|| {
            format!(
                "no {} instance at placement {} of GPU {}",
                planned.profile, planned.placement.start, gpu.index
            )
        })?;
    let ci = gi
        .compute_instances
        .iter()
        .find(|c| spec.contains(&c.uuid))
        .ok_or_else(|| {
            format!(
                "the {} instance at placement {} of GPU {} is not the one the claim's CDI spec names",
                planned.profile, planned.placement.start, gpu.index
            )
        })?;
    Ok(MigDetail {
        gpu_instance: Some(gi.id),
        compute_instance: Some(ci.id),
        uuid: Some(ci.uuid.clone()),
        ..planned.clone()
    })
}

/// Fills a planned device detail from the hardware and the claim's CDI spec (see [`adopt_mig`]).
pub fn adopt_detail(
    backend: &dyn GpuBackend,
    gpu: &GpuInfo,
    planned: DeviceDetail,
    spec: &Spec,
) -> Result<DeviceDetail, String> {
    let text = serde_json::to_string(spec).unwrap_or_default();
    // The spec was written for the physical GPU the pod got; if the allocation's index now names another
    // GPU (the numbering changed at this boot), rebuilding the record would hand the pod's devices over.
    let gpu_named = || {
        if text.contains(&gpu.uuid) {
            Ok(())
        } else {
            Err(format!(
                "the claim's CDI spec does not name GPU {} ({}): written for another physical GPU, which this \
                 index named before (NVML indices shift when a GPU is missing at boot)",
                gpu.index, gpu.uuid
            ))
        }
    };
    match planned {
        DeviceDetail::Gpu { .. } => gpu_named().map(|()| planned),
        DeviceDetail::Mig(m) => Ok(DeviceDetail::Mig(adopt_mig(backend, gpu, &m, &text)?)),
        DeviceDetail::Shared(mut s) => {
            if let Some(m) = &s.mig {
                let adopted = adopt_mig(backend, gpu, m, &text)?;
                s.uuid = adopted.uuid.clone();
                s.mig = Some(adopted);
            } else {
                gpu_named()?;
                s.uuid = Some(gpu.uuid.clone());
            }
            // The host side of the pipe directory's mount: it names the share's MPS daemon (its namespace's,
            // or the device's one: `sharing::daemon_key_of_share`), so a rebuilt record keeps the daemon its
            // pods use.
            let edits = spec.devices.iter().map(|d| &d.container_edits);
            s.mps_pipe_dir = edits.clone().find_map(|e| {
                let pipe = e
                    .env
                    .iter()
                    .find_map(|v| v.strip_prefix("CUDA_MPS_PIPE_DIRECTORY="))?;
                let mount = e.mounts.iter().find(|m| m.container_path == pipe)?;
                Some(mount.host_path.clone())
            });
            Ok(DeviceDetail::Shared(s))
        }
    }
}
