//! Driver upgrades under the NVIDIA GPU Operator: when to let go of the driver so that its kernel module
//! can be unloaded, and when to come back. A plain function of the Node's labels ([`UpgradeSignal::of`]);
//! the watch of the Node is `kubelet::upgrade_watch`, and what the plugin does is
//! kubelet-plugin/README.md, "Driver upgrades under the GPU Operator".
//!
//! **Why.** The Operator's driver container unloads the old kernel module (`rmmod nvidia`) before it loads
//! the new one, and the kernel refuses while any process holds a `/dev/nvidia*` file open ("Module nvidia is
//! in use"). The plugin's NVML sessions and the MPS supervisor's daemons are such holders; unreleased, they
//! stall the upgrade.
//!
//! **The two documented signals** (both read from the plugin's own Node):
//!
//! * The Operator's upgrade controller walks each node through the states of the label
//!   `nvidia.com/gpu-driver-upgrade-state` (`NVIDIA/k8s-operator-libs`, `pkg/upgrade/consts.go`:
//!   `UpgradeStateLabelKeyFmt = "nvidia.com/%s-driver-upgrade-state"` with the driver name `gpu`):
//!   `upgrade-required`, `cordon-required`, `wait-for-jobs-required`, `pod-deletion-required`,
//!   `drain-required`, then `pod-restart-required` ("the driver pod on the node is scheduled for restart"),
//!   `validation-required` (the new driver runs and is being validated), `uncordon-required`,
//!   `upgrade-done`, or `upgrade-failed`; with a maintenance operator, `node-maintenance-required` and
//!   `post-maintenance-required` in place of the drain and the restart.
//! * The driver container's init container, NVIDIA's `k8s-driver-manager` (`NVIDIA/k8s-driver-manager`,
//!   `cmd/driver-manager/main.go`: `evictAllGPUOperatorComponents`, `maybeSetPaused`, `unloadDriver`),
//!   sets every `nvidia.com/gpu.deploy.<operand>` label it manages, and the label named by its
//!   `NODE_LABEL_FOR_GPU_POD_EVICTION`, to `paused-for-driver-upgrade` (or appends `_paused-for-driver-upgrade`
//!   to another value), waits for those pods to go, unloads the modules, and sets the labels back
//!   (`rescheduleGPUOperatorComponents`). It pauses the operator validator's label on every node where a
//!   driver is loaded, so this signal comes with every driver pod restart, with or without the upgrade
//!   controller.
//!
//! **Which states release.** The plugin must still serve while pods are being evicted: kubelet calls
//! `NodeUnprepareResources` for each, and a MIG device or an MPS daemon is taken down through the driver
//! (NVIDIA's driver manager drains its own DRA plugin last for the same reason: `evictKubeletPlugin`, "it
//! services NodeUnprepareResources for every claim-holder, so it must outlive them"). So the cordon, the
//! wait for jobs, the pod deletion and the drain keep it serving, and it releases only where the module is
//! about to be unloaded: `pod-restart-required` and `post-maintenance-required`, or any label at
//! `paused-for-driver-upgrade`. Every other state (none, `validation-required` and after, `upgrade-failed`)
//! and the labels set back mean "come back": the plugin loads the driver that is there then (it waits for
//! it as at boot).

use std::collections::BTreeMap;

/// The upgrade controller's state label on the Node (`pkg/upgrade/consts.go`, driver name `gpu`).
pub const UPGRADE_STATE_LABEL: &str = "nvidia.com/gpu-driver-upgrade-state";
/// The value `k8s-driver-manager` gives an operand's deploy label while it unloads the driver
/// (`cmd/driver-manager/main.go`, `pausedStr`).
pub const PAUSED_FOR_DRIVER_UPGRADE: &str = "paused-for-driver-upgrade";
/// Upgrade states in which the driver pod is restarted and its kernel module unloaded: the plugin lets go.
pub const RELEASE_STATES: [&str; 2] = ["pod-restart-required", "post-maintenance-required"];
/// The exit status of a plugin that let go of the driver for an upgrade: `EX_TEMPFAIL`, as for a driver
/// change ([`crate::gpu::driver_watch::DRIVER_CHANGED_EXIT_CODE`]); kubelet restarts it, and the new process
/// waits, without the driver, for the upgrade to move on.
pub const RELEASED_EXIT_CODE: i32 = 75;

/// What the Node's labels say the plugin should do with the driver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpgradeSignal {
    /// No upgrade, or one that still needs the plugin (cordon, drain), or one that is over: hold the
    /// driver and serve.
    Serve,
    /// The driver is being unloaded: let go of it (no NVML session, no MPS daemon) until the signal ends.
    Release(ReleaseReason),
}

/// The label that asked for the release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReleaseReason {
    pub label: String,
    pub value: String,
}

impl ReleaseReason {
    /// `label=value`, for logs and errors.
    pub fn describe(&self) -> String {
        format!("{}={}", self.label, self.value)
    }

    /// The error a prepare gets while the driver is released: retryable, and naming the upgrade.
    pub fn prepare_refusal(&self) -> String {
        format!(
            "the node's NVIDIA driver is being upgraded ({}): tessera has released the driver so that its \
             kernel module can be unloaded and prepares no claims until the upgrade moves on; kubelet retries \
             this prepare",
            self.describe()
        )
    }
}

impl UpgradeSignal {
    /// The signal of a Node with `labels`. The upgrade controller's state comes first: of two releasing
    /// labels the log names that one.
    pub fn of(labels: &BTreeMap<String, String>) -> Self {
        if let Some(state) = labels.get(UPGRADE_STATE_LABEL)
            && RELEASE_STATES.contains(&state.as_str())
        {
            return Self::Release(ReleaseReason {
                label: UPGRADE_STATE_LABEL.into(),
                value: state.clone(),
            });
        }
        // `maybeSetPaused` writes the bare value or appends `_paused-for-driver-upgrade` to a custom one.
        labels
            .iter()
            .find(|(_, v)| v.split('_').any(|part| part == PAUSED_FOR_DRIVER_UPGRADE))
            .map_or(Self::Serve, |(k, v)| {
                Self::Release(ReleaseReason {
                    label: k.clone(),
                    value: v.clone(),
                })
            })
    }

    pub fn is_release(&self) -> bool {
        matches!(self, Self::Release(_))
    }
}

/// What the plugin does next, from the signal it last acted on and the one the Node shows now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Nothing changes.
    Stay,
    /// Let go of the driver now.
    Release(ReleaseReason),
    /// The upgrade moved on: load the driver again (once it is there) and serve.
    ComeBack,
}

/// The plugin's side of an upgrade: whether it holds the driver, and what a new reading of the labels
/// asks of it. A plain state machine; `kubelet::upgrade_watch` feeds it the Node's labels.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UpgradeTracker {
    released: Option<ReleaseReason>,
}

impl UpgradeTracker {
    /// A plugin that holds the driver.
    pub fn holding() -> Self {
        Self::default()
    }

    /// A plugin that has let go of the driver (a process started while the Node still asks for it).
    pub fn released(reason: ReleaseReason) -> Self {
        Self {
            released: Some(reason),
        }
    }

    pub fn is_released(&self) -> bool {
        self.released.is_some()
    }

    /// One reading of the Node's labels.
    pub fn observe(&mut self, labels: &BTreeMap<String, String>) -> Step {
        match (UpgradeSignal::of(labels), &self.released) {
            (UpgradeSignal::Release(reason), None) => {
                self.released = Some(reason.clone());
                Step::Release(reason)
            }
            // Still released, perhaps by another label (the controller's state after the manager's pause).
            (UpgradeSignal::Release(reason), Some(_)) => {
                self.released = Some(reason);
                Step::Stay
            }
            (UpgradeSignal::Serve, Some(_)) => {
                self.released = None;
                Step::ComeBack
            }
            (UpgradeSignal::Serve, None) => Step::Stay,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn state(value: &str) -> BTreeMap<String, String> {
        labels(&[(UPGRADE_STATE_LABEL, value), ("nvidia.com/gpu.present", "true")])
    }

    #[test]
    fn the_upgrade_controller_releases_only_where_the_driver_pod_restarts() {
        for serving in [
            "",
            "upgrade-required",
            "cordon-required",
            "wait-for-jobs-required",
            "pod-deletion-required",
            "drain-required",
            "node-maintenance-required",
            "validation-required",
            "uncordon-required",
            "upgrade-done",
            "upgrade-failed",
        ] {
            assert_eq!(
                UpgradeSignal::of(&state(serving)),
                UpgradeSignal::Serve,
                "{serving:?}"
            );
        }
        for releasing in ["pod-restart-required", "post-maintenance-required"] {
            let signal = UpgradeSignal::of(&state(releasing));
            assert_eq!(
                signal,
                UpgradeSignal::Release(ReleaseReason {
                    label: UPGRADE_STATE_LABEL.into(),
                    value: releasing.into()
                })
            );
        }
    }

    #[test]
    fn a_deploy_label_paused_by_the_driver_manager_releases_bare_or_appended() {
        let bare = labels(&[(
            "nvidia.com/gpu.deploy.operator-validator",
            "paused-for-driver-upgrade",
        )]);
        assert!(UpgradeSignal::of(&bare).is_release());
        let custom = labels(&[("example.com/tessera", "pool-a_paused-for-driver-upgrade")]);
        match UpgradeSignal::of(&custom) {
            UpgradeSignal::Release(r) => {
                assert_eq!(
                    r.describe(),
                    "example.com/tessera=pool-a_paused-for-driver-upgrade"
                )
            }
            other => panic!("{other:?}"),
        }
        // Set back by rescheduleGPUOperatorComponents, or a value that merely resembles it.
        for serving in ["true", "false", "pool-a", "paused-for-driver-upgrades"] {
            let l = labels(&[("nvidia.com/gpu.deploy.operator-validator", serving)]);
            assert_eq!(UpgradeSignal::of(&l), UpgradeSignal::Serve, "{serving:?}");
        }
    }

    #[test]
    fn the_tracker_releases_once_and_comes_back_when_the_upgrade_moves_on() {
        let mut t = UpgradeTracker::holding();
        assert_eq!(t.observe(&state("drain-required")), Step::Stay);
        assert!(matches!(
            t.observe(&state("pod-restart-required")),
            Step::Release(_)
        ));
        assert!(t.is_released());
        // The driver manager pauses its labels meanwhile: still released, nothing new to do.
        let mut both = state("pod-restart-required");
        both.insert(
            "nvidia.com/gpu.deploy.dcgm".into(),
            PAUSED_FOR_DRIVER_UPGRADE.into(),
        );
        assert_eq!(t.observe(&both), Step::Stay);
        assert_eq!(t.observe(&state("validation-required")), Step::ComeBack);
        assert!(!t.is_released());
        assert_eq!(t.observe(&state("upgrade-done")), Step::Stay);
    }

    #[test]
    fn a_process_started_during_the_upgrade_comes_back_when_the_labels_are_set_back() {
        let reason = ReleaseReason {
            label: "nvidia.com/gpu.deploy.operator-validator".into(),
            value: PAUSED_FOR_DRIVER_UPGRADE.into(),
        };
        let mut t = UpgradeTracker::released(reason.clone());
        assert!(
            reason
                .prepare_refusal()
                .contains("nvidia.com/gpu.deploy.operator-validator=paused")
        );
        let paused = labels(&[(
            "nvidia.com/gpu.deploy.operator-validator",
            PAUSED_FOR_DRIVER_UPGRADE,
        )]);
        assert_eq!(t.observe(&paused), Step::Stay);
        let back = labels(&[("nvidia.com/gpu.deploy.operator-validator", "true")]);
        assert_eq!(t.observe(&back), Step::ComeBack);
    }
}
