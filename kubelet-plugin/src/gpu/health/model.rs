//! The node's device health as plain state: which GPU or MIG device failed, why and since when.
//!
//! Fed by observations (an NVML event, the probe's answer, the simulated backend's injected faults) and
//! read twice: as `NodeInventory.status.health` (one entry per GPU plus one per failed MIG device, for the
//! controller's taints) and per published device name, for kubelet's health stream. A GPU-level failure
//! fans out to every device carved from the GPU (the whole GPU, its MIG placements, its shares); a failure
//! attributed to a MIG device stays on that device and its shares.

use std::collections::BTreeMap;

use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use tessera_api::{
    DeviceName,
    inventory::{DeviceHealth, HealthReason, HealthState, MigDeviceRef},
};

/// One failure as a source reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub gpu: u32,
    /// The GPU instance an event was attributed to (NVML's `gpuInstanceId`), if any.
    pub gpu_instance: Option<u32>,
    pub reason: HealthReason,
    pub xid: Option<u32>,
    pub message: String,
}

/// What a health source saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observation {
    /// A device failed.
    Failed(Failure),
    /// The GPU answered the probe: a lost GPU is back (other failures stay).
    Answering { gpu: u32 },
    /// The GPU and everything on it work again (the simulated backend's `recover`).
    Recovered { gpu: u32 },
    /// The GPU's NVLink fabric is fit for work (completed and healthy, or the GPU has none): a
    /// [`HealthReason::Fabric`] failure of the GPU clears (other failures stay).
    FabricReady { gpu: u32 },
    /// The complete set of failures now, from a source that reports state rather than events: anything
    /// not listed has recovered.
    Exactly(Vec<Failure>),
}

/// Maps a GPU instance of a GPU to the MIG device it backs (known from the prepared claims).
pub type MigLookup<'a> = &'a dyn Fn(u32, u32) -> Option<MigDeviceRef>;

#[derive(Clone, Debug, PartialEq, Eq)]
struct Condition {
    reason: HealthReason,
    xid: Option<u32>,
    since: Timestamp,
    message: String,
}

/// A lost GPU outranks an ECC error, which outranks an XID, which outranks a fabric not fit for work (the
/// one that clears by itself): the worst reason decides the taint.
fn severity(reason: HealthReason) -> u8 {
    match reason {
        HealthReason::Fabric => 0,
        HealthReason::Xid => 1,
        HealthReason::DoubleBitEcc => 2,
        HealthReason::GpuLost => 3,
    }
}

type Key = (u32, Option<MigDeviceRef>);

/// The health of one node's GPUs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HealthModel {
    gpus: Vec<u32>,
    conditions: BTreeMap<Key, Condition>,
    /// When each GPU last changed state, for the `since` of healthy entries.
    changed: BTreeMap<u32, Timestamp>,
}

impl HealthModel {
    /// All `gpus` healthy since `now`.
    pub fn new(gpus: impl IntoIterator<Item = u32>, now: Timestamp) -> Self {
        let gpus: Vec<u32> = gpus.into_iter().collect();
        let changed = gpus.iter().map(|g| (*g, now)).collect();
        Self {
            gpus,
            conditions: BTreeMap::new(),
            changed,
        }
    }

    /// Applies what a source saw at `now`; true when the health of any device changed.
    pub fn apply(&mut self, observation: Observation, now: Timestamp, mig_of: MigLookup<'_>) -> bool {
        let before = self.conditions.clone();
        match observation {
            Observation::Failed(f) => self.fail(f, now, mig_of),
            Observation::Answering { gpu } => {
                let lost = (gpu, None);
                if self
                    .conditions
                    .get(&lost)
                    .is_some_and(|c| c.reason == HealthReason::GpuLost)
                {
                    self.conditions.remove(&lost);
                }
            }
            Observation::Recovered { gpu } => self.conditions.retain(|(g, _), _| *g != gpu),
            Observation::FabricReady { gpu } => {
                let whole = (gpu, None);
                if self
                    .conditions
                    .get(&whole)
                    .is_some_and(|c| c.reason == HealthReason::Fabric)
                {
                    self.conditions.remove(&whole);
                }
            }
            Observation::Exactly(failures) => {
                let mut next = BTreeMap::new();
                for f in failures {
                    let key = self.key(&f, mig_of);
                    let kept = self
                        .conditions
                        .get(&key)
                        .filter(|c| c.reason == f.reason && c.xid == f.xid)
                        .cloned();
                    let condition = kept.unwrap_or(Condition {
                        reason: f.reason,
                        xid: f.xid,
                        since: now,
                        message: f.message,
                    });
                    let worse = next
                        .get(&key)
                        .is_some_and(|c: &Condition| severity(c.reason) >= severity(condition.reason));
                    if !worse {
                        next.insert(key, condition);
                    }
                }
                self.conditions = next;
            }
        }
        let changed_gpus: Vec<u32> = before
            .keys()
            .chain(self.conditions.keys())
            .filter(|k| before.get(*k) != self.conditions.get(*k))
            .map(|(g, _)| *g)
            .collect();
        for g in &changed_gpus {
            self.changed.insert(*g, now);
        }
        !changed_gpus.is_empty()
    }

    fn key(&self, f: &Failure, mig_of: MigLookup<'_>) -> Key {
        // An event of a GPU instance no prepared claim holds cannot be pinned on a published device, so
        // the GPU as a whole answers for it.
        let mig = match f.reason {
            HealthReason::GpuLost => None,
            _ => f.gpu_instance.and_then(|gi| mig_of(f.gpu, gi)),
        };
        (f.gpu, mig)
    }

    fn fail(&mut self, f: Failure, now: Timestamp, mig_of: MigLookup<'_>) {
        let key = self.key(&f, mig_of);
        if let Some(c) = self.conditions.get_mut(&key) {
            // A fabric that went from training to degraded says so, without a new `since`.
            if c.reason == f.reason && c.xid == f.xid {
                c.message = f.message;
                return;
            }
            if severity(c.reason) >= severity(f.reason) {
                return;
            }
        }
        self.conditions.insert(
            key,
            Condition {
                reason: f.reason,
                xid: f.xid,
                since: now,
                message: f.message,
            },
        );
    }

    /// `NodeInventory.status.health`: every GPU, then every failed MIG device.
    pub fn status(&self) -> Vec<DeviceHealth> {
        let mut out = Vec::with_capacity(self.gpus.len());
        for &gpu in &self.gpus {
            let since = self.changed.get(&gpu).map(|t| Time(*t));
            out.push(match self.conditions.get(&(gpu, None)) {
                Some(c) => entry(gpu, None, c),
                None => DeviceHealth {
                    gpu,
                    state: HealthState::Healthy,
                    since,
                    ..Default::default()
                },
            });
        }
        for ((gpu, mig), c) in &self.conditions {
            if mig.is_some() {
                out.push(entry(*gpu, mig.clone(), c));
            }
        }
        out
    }

    /// Why the published device `name` is unhealthy, or `None` when it works.
    pub fn device(&self, name: &DeviceName) -> Option<(HealthReason, &str)> {
        let gpu = name.gpu();
        let c = self.conditions.get(&(gpu, None)).or_else(|| match name {
            DeviceName::Mig { profile, start, .. } | DeviceName::SharedMig { profile, start, .. } => {
                self.conditions.get(&(
                    gpu,
                    Some(MigDeviceRef {
                        profile: profile.clone(),
                        start: *start,
                    }),
                ))
            }
            _ => None,
        })?;
        Some((c.reason, c.message.as_str()))
    }

    /// True when any device of the node is unhealthy.
    pub fn any_unhealthy(&self) -> bool {
        !self.conditions.is_empty()
    }
}

fn entry(gpu: u32, mig: Option<MigDeviceRef>, c: &Condition) -> DeviceHealth {
    DeviceHealth {
        gpu,
        mig,
        state: HealthState::Unhealthy,
        reason: Some(c.reason),
        xid: c.xid,
        since: Some(Time(c.since)),
        message: Some(c.message.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xid(gpu: u32, gi: Option<u32>, xid: u32) -> Failure {
        Failure {
            gpu,
            gpu_instance: gi,
            reason: HealthReason::Xid,
            xid: Some(xid),
            message: format!("XID {xid}"),
        }
    }

    fn lost(gpu: u32) -> Failure {
        Failure {
            gpu,
            gpu_instance: None,
            reason: HealthReason::GpuLost,
            xid: None,
            message: "lost".into(),
        }
    }

    fn fabric(gpu: u32, message: &str) -> Failure {
        Failure {
            gpu,
            gpu_instance: None,
            reason: HealthReason::Fabric,
            xid: None,
            message: message.into(),
        }
    }

    fn no_mig(_: u32, _: u32) -> Option<MigDeviceRef> {
        None
    }

    fn gi_3_is_3g_at_4(gpu: u32, gi: u32) -> Option<MigDeviceRef> {
        (gpu == 1 && gi == 3).then(|| MigDeviceRef {
            profile: "3g.40gb".into(),
            start: 4,
        })
    }

    fn name(s: &str) -> DeviceName {
        s.parse().unwrap()
    }

    #[test]
    fn a_gpu_failure_fans_out_to_every_device_carved_from_the_gpu() {
        let now = Timestamp::now();
        let mut m = HealthModel::new(0..2, now);
        assert!(m.apply(Observation::Failed(xid(1, None, 79)), now, &no_mig));
        for d in [
            "gpu-1",
            "gpu-1-shared",
            "gpu-1-share-2",
            "gpu-1-mig-3g-40gb-4",
            "gpu-1-mig-1g-10gb-0-shared",
        ] {
            assert_eq!(m.device(&name(d)).map(|h| h.0), Some(HealthReason::Xid), "{d}");
        }
        assert_eq!(m.device(&name("gpu-0")), None);
        let status = m.status();
        assert_eq!(status.len(), 2);
        assert_eq!(status[0].state, HealthState::Healthy);
        assert_eq!(
            (status[1].state, status[1].reason, status[1].xid),
            (HealthState::Unhealthy, Some(HealthReason::Xid), Some(79))
        );
    }

    #[test]
    fn a_mig_event_taints_only_the_mig_device_its_gpu_instance_backs() {
        let now = Timestamp::now();
        let mut m = HealthModel::new(0..2, now);
        m.apply(Observation::Failed(xid(1, Some(3), 94)), now, &gi_3_is_3g_at_4);
        assert!(m.device(&name("gpu-1-mig-3g-40gb-4")).is_some());
        assert!(m.device(&name("gpu-1-mig-3g-40gb-4-shared")).is_some());
        assert!(m.device(&name("gpu-1-mig-3g-40gb-0")).is_none());
        assert!(m.device(&name("gpu-1")).is_none());
        let status = m.status();
        assert_eq!(status.len(), 3);
        assert_eq!(
            status[2].mig,
            Some(MigDeviceRef {
                profile: "3g.40gb".into(),
                start: 4
            })
        );
        // A GPU instance no claim holds cannot be pinned on a device: the GPU answers for it.
        m.apply(Observation::Failed(xid(1, Some(9), 94)), now, &gi_3_is_3g_at_4);
        assert!(m.device(&name("gpu-1")).is_some());
    }

    #[test]
    fn the_worst_reason_wins_and_the_probe_clears_only_a_lost_gpu() {
        let t0 = Timestamp::now();
        let mut m = HealthModel::new(0..1, t0);
        m.apply(Observation::Failed(lost(0)), t0, &no_mig);
        assert!(!m.apply(Observation::Failed(xid(0, None, 79)), t0, &no_mig));
        assert_eq!(m.device(&name("gpu-0")).unwrap().0, HealthReason::GpuLost);
        assert!(m.apply(Observation::Answering { gpu: 0 }, t0, &no_mig));
        assert!(!m.any_unhealthy());
        m.apply(Observation::Failed(xid(0, None, 79)), t0, &no_mig);
        assert!(!m.apply(Observation::Answering { gpu: 0 }, t0, &no_mig));
        assert!(m.apply(Observation::Recovered { gpu: 0 }, t0, &no_mig));
        assert!(!m.any_unhealthy());
    }

    #[test]
    fn a_state_snapshot_keeps_the_since_of_unchanged_failures_and_recovers_the_rest() {
        let t0 = Timestamp::from_second(1_000).unwrap();
        let t1 = Timestamp::from_second(2_000).unwrap();
        let mut m = HealthModel::new(0..2, t0);
        m.apply(Observation::Exactly(vec![xid(0, None, 79), lost(1)]), t0, &no_mig);
        assert!(!m.apply(Observation::Exactly(vec![xid(0, None, 79), lost(1)]), t1, &no_mig));
        assert_eq!(m.status()[0].since, Some(Time(t0)));
        assert!(m.apply(Observation::Exactly(vec![xid(0, None, 79)]), t1, &no_mig));
        let status = m.status();
        assert_eq!(status[1].state, HealthState::Healthy);
        assert_eq!(status[1].since, Some(Time(t1)), "healthy since it recovered");
    }

    #[test]
    fn a_fabric_failure_clears_when_the_fabric_is_ready_and_never_hides_a_worse_one() {
        let (t0, t1) = (
            Timestamp::from_second(1_000).unwrap(),
            Timestamp::from_second(2_000).unwrap(),
        );
        let mut m = HealthModel::new(0..2, t0);
        assert!(m.apply(Observation::Failed(fabric(0, "in progress")), t0, &no_mig));
        assert!(m.apply(Observation::Failed(fabric(0, "LIMITED_CAPACITY")), t1, &no_mig));
        let status = m.status();
        assert_eq!(
            (status[0].message.as_deref(), status[0].since.clone()),
            (Some("LIMITED_CAPACITY"), Some(Time(t0))),
            "the message follows the fabric, the since stays"
        );
        assert!(!m.apply(Observation::FabricReady { gpu: 1 }, t1, &no_mig));
        assert!(m.apply(Observation::FabricReady { gpu: 0 }, t1, &no_mig));
        assert!(!m.any_unhealthy());
        // An XID outranks the fabric, and the fabric's recovery does not clear it.
        m.apply(Observation::Failed(fabric(0, "in progress")), t1, &no_mig);
        assert!(m.apply(Observation::Failed(xid(0, None, 79)), t1, &no_mig));
        assert!(!m.apply(Observation::Failed(fabric(0, "in progress")), t1, &no_mig));
        assert!(!m.apply(Observation::FabricReady { gpu: 0 }, t1, &no_mig));
        assert_eq!(m.device(&name("gpu-0")).unwrap().0, HealthReason::Xid);
    }
}
