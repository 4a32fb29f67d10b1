//! Device taints for sick GPUs, from the health each plugin reports in `NodeInventory.status.health`.
//!
//! | reported | taint key | value | effect (default, `GpuPolicy.spec.health.taints`) |
//! |---|---|---|---|
//! | `Xid` | `gpu.tessera.dev/xid` | the XID | `NoSchedule` (`xid`) |
//! | `DoubleBitEcc` | `gpu.tessera.dev/ecc` | `double-bit` | `NoSchedule` (`doubleBitEcc`) |
//! | `GpuLost` | `gpu.tessera.dev/gpu-lost` | — | `NoExecute` (`gpuLost`) |
//! | `Fabric` | `gpu.tessera.dev/fabric` | — | always `NoSchedule` |
//!
//! `Fabric` (an NVLink fabric still training, or reporting itself unhealthy) is never `NoExecute`: on an
//! HGX node every GPU reports it together while fabric manager starts, and running work keeps its GPU.
//!
//! A GPU's taint goes on every device published from it (the whole GPU, its MIG placements, its shares);
//! a MIG device's on that placement and its shares. The keys follow NVIDIA's DRA driver
//! (`gpu.nvidia.com/xid`, `gpu.nvidia.com/gpu-lost`, `cmd/gpu-kubelet-plugin/device_health.go`), which
//! never removes them; tessera does, once the device has been reported healthy for the quiet period
//! (`spec.health.quietPeriod`, default 60 s), timed on the controller's own monotonic clock like
//! heartbeats ([`crate::liveness`]), so a GPU that keeps failing does not flap.
//!
//! Admins' DeviceTaintRules (`resource.k8s.io/v1`, 1.37) act beside these: the scheduler and the eviction
//! controller merge both, and the controller never reads or writes them.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use k8s_openapi::api::resource::v1::DeviceTaint;
use tessera_api::{
    NodeInventory,
    inventory::{DeviceHealth, HealthReason, HealthState, MigDeviceRef},
    policy::{GpuPolicySpec, HealthPolicy, HealthTaints, TaintEffect},
};

/// Taint key of a critical XID; the value is the XID number.
pub const XID_TAINT: &str = "gpu.tessera.dev/xid";
/// Taint key of an uncorrectable ECC error.
pub const ECC_TAINT: &str = "gpu.tessera.dev/ecc";
/// Taint key of a GPU that fell off the bus.
pub const GPU_LOST_TAINT: &str = "gpu.tessera.dev/gpu-lost";
/// Taint key of a GPU whose NVLink fabric is not fit for work.
pub const FABRIC_TAINT: &str = "gpu.tessera.dev/fabric";

/// What the policy says about health, resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HealthConfig {
    pub taints: HealthTaints,
    pub quiet_period: Duration,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self::from_policy(&HealthPolicy::default()).unwrap_or(Self {
            taints: HealthTaints::default(),
            quiet_period: Duration::from_secs(tessera_api::policy::DEFAULT_QUIET_PERIOD_SECS),
        })
    }
}

impl HealthConfig {
    /// `spec.health`, or a message naming the field that is wrong.
    pub fn from_policy(health: &HealthPolicy) -> Result<Self, String> {
        let quiet_period = health
            .quiet_period()
            .map_err(|e| format!("spec.health.quietPeriod: {e}"))?;
        Ok(Self {
            taints: health.taints,
            quiet_period,
        })
    }

    /// The health settings of a policy spec (defaults without `health`).
    pub fn of_spec(spec: &GpuPolicySpec) -> Result<Self, String> {
        spec.health
            .as_ref()
            .map_or(Ok(Self::default()), Self::from_policy)
    }
}

/// The taint a reported failure gets, `None` for a healthy entry.
pub fn taint_for(entry: &DeviceHealth, taints: &HealthTaints) -> Option<DeviceTaint> {
    if entry.state == HealthState::Healthy {
        return None;
    }
    let (key, value, effect) = match entry.reason? {
        HealthReason::Xid => (XID_TAINT, entry.xid.map(|x| x.to_string()), taints.xid),
        HealthReason::DoubleBitEcc => (ECC_TAINT, Some("double-bit".to_string()), taints.double_bit_ecc),
        HealthReason::GpuLost => (GPU_LOST_TAINT, None, taints.gpu_lost),
        HealthReason::Fabric => (FABRIC_TAINT, None, TaintEffect::NoSchedule),
    };
    Some(DeviceTaint {
        key: key.into(),
        value,
        effect: effect.as_str().into(),
        time_added: None,
    })
}

/// Which published devices a taint goes on.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// The GPU and every device carved from it.
    Gpu(u32),
    /// One MIG placement of a GPU and its shares.
    Mig(u32, MigDeviceRef),
}

/// The taints of one node's devices, by target, in a stable order (part of the render cache's key).
pub type NodeTaints = BTreeMap<Target, Vec<DeviceTaint>>;

#[derive(Clone, Debug)]
struct Held {
    taint: DeviceTaint,
    /// When the controller last saw the failure reported.
    last_reported: Instant,
}

/// Per node: the taints in force, kept for the quiet period after the failure stops being reported.
#[derive(Clone, Debug, Default)]
pub struct HealthTracker {
    config: HealthConfig,
    held: BTreeMap<String, BTreeMap<(Target, String), Held>>,
}

fn target(entry: &DeviceHealth) -> Target {
    match &entry.mig {
        Some(mig) => Target::Mig(entry.gpu, mig.clone()),
        None => Target::Gpu(entry.gpu),
    }
}

impl HealthTracker {
    /// Records what `inventories` report at `mono` under `config`. A node without an inventory loses its
    /// taints with its pool.
    pub fn observe(&mut self, inventories: &[NodeInventory], config: HealthConfig, mono: Instant) {
        self.config = config;
        let mut seen = std::collections::BTreeSet::new();
        for inv in inventories {
            let node = inv.spec.node_name.clone();
            seen.insert(node.clone());
            let held = self.held.entry(node).or_default();
            let reported = inv
                .status
                .as_ref()
                .map(|s| s.health.as_slice())
                .unwrap_or_default();
            for entry in reported {
                if let Some(taint) = taint_for(entry, &config.taints) {
                    // One taint per key and target: a new XID replaces the value of the last one.
                    held.insert(
                        (target(entry), taint.key.clone()),
                        Held {
                            taint,
                            last_reported: mono,
                        },
                    );
                }
            }
            // Effects follow the policy also for taints held through their quiet period.
            for ((_, key), h) in held.iter_mut() {
                h.taint.effect = match key.as_str() {
                    XID_TAINT => config.taints.xid,
                    ECC_TAINT => config.taints.double_bit_ecc,
                    FABRIC_TAINT => TaintEffect::NoSchedule,
                    _ => config.taints.gpu_lost,
                }
                .as_str()
                .into();
            }
            held.retain(|_, h| {
                h.last_reported == mono
                    || mono.saturating_duration_since(h.last_reported) < config.quiet_period
            });
        }
        self.held.retain(|node, _| seen.contains(node));
    }

    /// The settings last observed with.
    pub fn config(&self) -> HealthConfig {
        self.config
    }

    /// The taints in force on `node`'s devices.
    pub fn taints(&self, node: &str) -> NodeTaints {
        let mut out = NodeTaints::new();
        for ((target, _), h) in self.held.get(node).into_iter().flatten() {
            out.entry(target.clone()).or_default().push(h.taint.clone());
        }
        out
    }

    /// The taints of a one-off rendering (`tessera-controller render`): what the inventories report now,
    /// without a quiet period.
    pub fn snapshot(inventories: &[NodeInventory], config: HealthConfig) -> Self {
        let mut t = Self::default();
        t.observe(inventories, config, Instant::now());
        t
    }
}

#[cfg(test)]
mod tests {
    use tessera_api::{inventory::NodeInventoryStatus, policy::TaintEffect};

    use super::*;
    use crate::fixtures::{GpuModel, node, sick};

    fn reporting(health: Vec<DeviceHealth>) -> NodeInventory {
        let mut inv = node("node-a").gpus(GpuModel::H200, 2).build();
        inv.status = Some(NodeInventoryStatus {
            health,
            ..inv.status.unwrap_or_default()
        });
        inv
    }

    #[test]
    fn xids_and_ecc_errors_taint_no_schedule_and_a_lost_gpu_no_execute_by_default() {
        let t = HealthTaints::default();
        let xid = taint_for(&sick(0, HealthReason::Xid, Some(79)), &t).unwrap();
        assert_eq!(
            (xid.key.as_str(), xid.value.as_deref(), xid.effect.as_str()),
            (XID_TAINT, Some("79"), "NoSchedule")
        );
        let ecc = taint_for(&sick(0, HealthReason::DoubleBitEcc, None), &t).unwrap();
        assert_eq!((ecc.key.as_str(), ecc.effect.as_str()), (ECC_TAINT, "NoSchedule"));
        let lost = taint_for(&sick(0, HealthReason::GpuLost, None), &t).unwrap();
        assert_eq!(
            (lost.key.as_str(), lost.value, lost.effect.as_str()),
            (GPU_LOST_TAINT, None, "NoExecute")
        );
        let healthy = DeviceHealth {
            gpu: 0,
            ..Default::default()
        };
        assert_eq!(taint_for(&healthy, &t), None);
    }

    #[test]
    fn a_fabric_not_fit_for_work_taints_no_schedule_whatever_the_policy_says_of_lost_gpus() {
        let t = HealthTaints {
            gpu_lost: TaintEffect::NoExecute,
            ..HealthTaints::default()
        };
        let fabric = taint_for(&sick(0, HealthReason::Fabric, None), &t).unwrap();
        assert_eq!(
            (fabric.key.as_str(), fabric.value, fabric.effect.as_str()),
            (FABRIC_TAINT, None, "NoSchedule")
        );
        let config = HealthConfig {
            taints: t,
            ..HealthConfig::default()
        };
        let mut tracker = HealthTracker::default();
        let now = Instant::now();
        tracker.observe(
            &[reporting(vec![sick(1, HealthReason::Fabric, None)])],
            config,
            now,
        );
        let held = tracker.taints("node-a");
        assert_eq!(held[&Target::Gpu(1)][0].effect, "NoSchedule", "{held:?}");
    }

    #[test]
    fn the_policy_chooses_the_effect_of_each_failure() {
        let t = HealthTaints {
            xid: TaintEffect::NoExecute,
            double_bit_ecc: TaintEffect::Informational,
            gpu_lost: TaintEffect::NoSchedule,
        };
        assert_eq!(
            taint_for(&sick(0, HealthReason::Xid, Some(48)), &t)
                .unwrap()
                .effect,
            "NoExecute"
        );
        assert_eq!(
            taint_for(&sick(0, HealthReason::DoubleBitEcc, None), &t)
                .unwrap()
                .effect,
            "None"
        );
        assert_eq!(
            taint_for(&sick(0, HealthReason::GpuLost, None), &t)
                .unwrap()
                .effect,
            "NoSchedule"
        );
    }

    #[test]
    fn a_bad_quiet_period_names_the_field() {
        let e = HealthConfig::from_policy(&HealthPolicy {
            quiet_period: Some("soon".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(e.starts_with("spec.health.quietPeriod:"), "{e}");
    }

    #[test]
    fn a_taint_stays_for_the_quiet_period_after_the_device_recovers_then_goes() {
        let config = HealthConfig {
            taints: HealthTaints::default(),
            quiet_period: Duration::from_secs(30),
        };
        let t0 = Instant::now();
        let mut tracker = HealthTracker::default();
        tracker.observe(
            &[reporting(vec![sick(1, HealthReason::Xid, Some(79))])],
            config,
            t0,
        );
        let taints = tracker.taints("node-a");
        assert_eq!(taints.keys().collect::<Vec<_>>(), [&Target::Gpu(1)]);
        let healthy = reporting(vec![]);
        tracker.observe(
            std::slice::from_ref(&healthy),
            config,
            t0 + Duration::from_secs(5),
        );
        tracker.observe(
            std::slice::from_ref(&healthy),
            config,
            t0 + Duration::from_secs(29),
        );
        assert_eq!(tracker.taints("node-a").len(), 1, "still inside the quiet period");
        tracker.observe(
            std::slice::from_ref(&healthy),
            config,
            t0 + Duration::from_secs(30),
        );
        assert!(tracker.taints("node-a").is_empty(), "quiet for 30 s");
    }

    #[test]
    fn a_failure_reported_again_restarts_the_quiet_period_and_a_zero_period_clears_at_once() {
        let config = HealthConfig {
            taints: HealthTaints::default(),
            quiet_period: Duration::from_secs(30),
        };
        let t0 = Instant::now();
        let sick_node = reporting(vec![sick(0, HealthReason::GpuLost, None)]);
        let healthy = reporting(vec![]);
        let mut tracker = HealthTracker::default();
        tracker.observe(std::slice::from_ref(&sick_node), config, t0);
        tracker.observe(
            std::slice::from_ref(&healthy),
            config,
            t0 + Duration::from_secs(20),
        );
        tracker.observe(
            std::slice::from_ref(&sick_node),
            config,
            t0 + Duration::from_secs(25),
        );
        tracker.observe(
            std::slice::from_ref(&healthy),
            config,
            t0 + Duration::from_secs(50),
        );
        assert_eq!(tracker.taints("node-a").len(), 1, "25 s after the last report");
        let now = HealthConfig {
            quiet_period: Duration::ZERO,
            ..config
        };
        tracker.observe(std::slice::from_ref(&healthy), now, t0 + Duration::from_secs(51));
        assert!(tracker.taints("node-a").is_empty());
        tracker.observe(&[], config, t0 + Duration::from_secs(52));
        assert!(tracker.held.is_empty(), "a node without inventory is forgotten");
    }

    #[test]
    fn a_mig_device_failure_is_its_own_target() {
        let mut entry = sick(1, HealthReason::Xid, Some(94));
        entry.mig = Some(MigDeviceRef {
            profile: "3g.71gb".into(),
            start: 4,
        });
        let tracker = HealthTracker::snapshot(&[reporting(vec![entry])], HealthConfig::default());
        let taints = tracker.taints("node-a");
        assert!(matches!(taints.keys().next(), Some(Target::Mig(1, m)) if m.start == 4));
    }
}
