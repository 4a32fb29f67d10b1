//! Other GPU managers on the node: NVIDIA's device plugin (alone or from the GPU Operator), mig-manager and
//! GKE's GPU partitioning. The plugin reads its own Node at start and every [`RECHECK_EVERY`], decides here
//! (a plain function of the Node's allocatable, its labels and `--coexistence`) and reports the outcome as
//! the NodeInventory's `Coexistence` condition.
//!
//! ```text
//!  found on the Node                          refuse (default)                        warn
//!  ─────────────────────────────────────────  ──────────────────────────────────────  ────────────────────
//!  allocatable nvidia.com/gpu[.*] or          publish no devices; never touch MIG     serve as if alone,
//!  nvidia.com/mig-* > 0 (a device plugin)     (the plugin's pods may use instances)   condition False
//!  label nvidia.com/mig.config (mig-manager)  MIG layout is theirs: GPUs in MIG mode  serve as if alone
//!  label cloud.google.com/gke-gpu-partition-  are not published, the others as whole  (MIG instances no
//!    size (GKE made the MIG partitions)       GPUs and shares only; no MIG mode       claim holds are
//!                                             change, no instance made or destroyed   destroyed at start)
//!  the Node cannot be read                    serve, but leave MIG instances alone    same
//! ```
//!
//! Why refuse rather than warn by default: a device plugin hands out the same physical GPUs through
//! `nvidia.com/gpu`, and the scheduler counts the two allocators apart, so one GPU can go to a pod of each
//! (with tessera's DeviceClass that maps `extendedResourceName: nvidia.com/gpu`, even to two pods that ask
//! for the same resource name). Serving with a warning would still hand out a GPU twice. A MIG layout that
//! mig-manager (or GKE) applied is destroyed by tessera's start-up clean-up and re-applied by its owner:
//! the two would fight over the GPUs forever. `warn` is the explicit "I know" switch, for a device plugin
//! configured to advertise other GPUs than tessera serves, or a migration.
//!
//! A verdict that changes while the plugin runs (a device plugin installed later) is reported at once, and
//! applied when the plugin next starts: the published GPUs and the node state are fixed for a plugin's life.

use std::{collections::BTreeMap, time::Duration};

use clap::ValueEnum;
use k8s_openapi::{api::core::v1::Node, apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use tessera_api::{GpuInfo, inventory::InventoryCondition};

/// The condition type in `NodeInventory.status.conditions`.
pub const CONDITION_TYPE: &str = "Coexistence";

/// Label mig-manager (NVIDIA's GPU Operator) reads the node's MIG layout from.
pub const MIG_CONFIG_LABEL: &str = "nvidia.com/mig.config";

/// Label GKE puts on nodes whose GPUs it partitioned into MIG devices at node creation.
pub const GKE_PARTITION_LABEL: &str = "cloud.google.com/gke-gpu-partition-size";

/// How often the Node is read again.
pub const RECHECK_EVERY: Duration = Duration::from_secs(60);

/// What the plugin does when it finds another GPU manager (`--coexistence`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum CoexistenceMode {
    /// Publish no devices next to a device plugin, and leave another tool's MIG layout alone.
    #[default]
    Refuse,
    /// Serve as if alone, and only report what was found.
    Warn,
}

/// What the plugin reads of its Node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// `status.allocatable`, quantities as written.
    pub allocatable: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
}

impl NodeFacts {
    pub fn of(node: &Node) -> Self {
        Self {
            allocatable: node
                .status
                .as_ref()
                .and_then(|s| s.allocatable.as_ref())
                .map(|a| a.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect())
                .unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
        }
    }
}

/// Another GPU manager the Node shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finding {
    /// Extended resources a device plugin advertises, `(name, quantity)`.
    DevicePlugin(Vec<(String, String)>),
    /// mig-manager owns the MIG layout (the label's value: the mig-parted config it applies).
    MigManager(String),
    /// GKE partitioned the GPUs (the label's value: the partition size).
    GkePartitions(String),
}

/// What the plugin does about the Node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub mode: CoexistenceMode,
    pub findings: Vec<Finding>,
    /// Why the Node could not be read, when it could not.
    pub unreadable: Option<String>,
    /// Publish no devices.
    pub withhold_devices: bool,
    /// MIG is another tool's: no MIG devices published, no MIG mode change, no instance made or destroyed.
    pub foreign_mig_layout: bool,
    /// Start-up keeps the MIG instances no claim holds instead of destroying them (see
    /// [`crate::node::state::NodeState::keeping_unowned_mig`]).
    pub keep_unowned_mig: bool,
}

/// A device plugin's resource names: `nvidia.com/gpu`, its renamed shared form (`nvidia.com/gpu.shared`,
/// time-slicing with `renameByDefault`) and the MIG strategy's `nvidia.com/mig-<profile>`.
fn is_device_plugin_resource(name: &str) -> bool {
    name == "nvidia.com/gpu" || name.starts_with("nvidia.com/gpu.") || name.starts_with("nvidia.com/mig-")
}

/// A quantity above zero (`0`, `0k` and an empty value are zero).
fn positive(quantity: &str) -> bool {
    quantity
        .trim()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .any(|c| ('1'..='9').contains(&c))
}

/// The verdict for a Node (`None`: it could not be read, with why).
pub fn decide(node: Result<&NodeFacts, &str>, mode: CoexistenceMode) -> Verdict {
    let facts = match node {
        Ok(facts) => facts,
        Err(why) => {
            return Verdict {
                mode,
                findings: Vec::new(),
                unreadable: Some(why.to_string()),
                withhold_devices: false,
                foreign_mig_layout: false,
                // Instances nobody can be shown to own are kept rather than destroyed.
                keep_unowned_mig: true,
            };
        }
    };
    let mut findings = Vec::new();
    let advertised: Vec<(String, String)> = facts
        .allocatable
        .iter()
        .filter(|(name, quantity)| is_device_plugin_resource(name) && positive(quantity))
        .map(|(n, q)| (n.clone(), q.clone()))
        .collect();
    if !advertised.is_empty() {
        findings.push(Finding::DevicePlugin(advertised));
    }
    if let Some(config) = facts.labels.get(MIG_CONFIG_LABEL) {
        findings.push(Finding::MigManager(config.clone()));
    }
    if let Some(size) = facts.labels.get(GKE_PARTITION_LABEL) {
        findings.push(Finding::GkePartitions(size.clone()));
    }
    let refuse = mode == CoexistenceMode::Refuse;
    Verdict {
        mode,
        withhold_devices: refuse && findings.iter().any(|f| matches!(f, Finding::DevicePlugin(_))),
        foreign_mig_layout: refuse && !findings.is_empty(),
        keep_unowned_mig: refuse && !findings.is_empty(),
        findings,
        unreadable: None,
    }
}

impl Verdict {
    /// The GPUs the plugin serves: with a foreign MIG layout, without MIG capability, so nothing here
    /// creates, destroys or changes the mode of a MIG instance ([`crate::gpu::mig`] acts on MIG-capable GPUs
    /// only).
    pub fn served_gpus(&self, gpus: &[GpuInfo]) -> Vec<GpuInfo> {
        gpus.iter()
            .cloned()
            .map(|mut g| {
                if self.foreign_mig_layout {
                    g.mig = None;
                }
                g
            })
            .collect()
    }

    /// The GPUs the inventory publishes: none when withheld; with a foreign MIG layout not the GPUs in
    /// MIG mode (their instances are another tool's and a GPU in MIG mode cannot be used whole).
    pub fn published_gpus(&self, gpus: &[GpuInfo]) -> Vec<GpuInfo> {
        if self.withhold_devices {
            return Vec::new();
        }
        let in_mig_mode = |g: &GpuInfo| g.mig.as_ref().is_some_and(|m| m.enabled);
        let kept: Vec<GpuInfo> = gpus
            .iter()
            .filter(|g| !(self.foreign_mig_layout && in_mig_mode(g)))
            .cloned()
            .collect();
        self.served_gpus(&kept)
    }

    /// True when the verdict changes what the plugin serves (so a plugin started under `other` serves
    /// differently from what this verdict asks).
    pub fn serves_differently_from(&self, other: &Verdict) -> bool {
        let effect = |v: &Verdict| (v.withhold_devices, v.foreign_mig_layout, v.keep_unowned_mig);
        effect(self) != effect(other)
    }

    /// `True`, `False` or `Unknown`, a reason, and a message for people.
    pub fn summary(&self) -> (&'static str, &'static str, String) {
        if let Some(why) = &self.unreadable {
            return (
                "Unknown",
                "NodeUnreadable",
                format!(
                    "could not read this node to look for a device plugin or a MIG manager ({why}); serving, \
                     but leaving every MIG instance no claim holds alone. Fix: grant the plugin get on its \
                     Node (the chart's ClusterRole does)"
                ),
            );
        }
        if self.findings.is_empty() {
            return (
                "True",
                "NoOtherGPUManager",
                "no device plugin advertises NVIDIA GPUs here and no MIG manager owns the MIG layout".into(),
            );
        }
        let mut parts = Vec::new();
        let mut reason = "";
        for f in &self.findings {
            match f {
                Finding::DevicePlugin(resources) => {
                    reason = "DevicePluginAdvertisesGPUs";
                    let list: Vec<String> = resources.iter().map(|(n, q)| format!("{n}: {q}")).collect();
                    parts.push(format!(
                        "a device plugin advertises {} on this node (NVIDIA's device plugin or the GPU \
                         Operator's), so the same GPUs could go to its pods and to tessera's claims; {}",
                        list.join(", "),
                        if self.withhold_devices {
                            "tessera publishes no devices here. Fix: disable the device plugin on this node \
                             (GPU Operator: devicePlugin.enabled=false; GKE: node label \
                             gke-no-default-nvidia-gpu-device-plugin=true), or set coexistence=warn if it \
                             advertises other GPUs"
                        } else {
                            "serving anyway (coexistence=warn)"
                        }
                    ));
                }
                Finding::MigManager(config) => {
                    if reason.is_empty() {
                        reason = "MigLayoutOwnedByMigManager";
                    }
                    parts.push(format!(
                        "mig-manager owns the MIG layout ({MIG_CONFIG_LABEL}={config}); {}",
                        self.mig_action("GPU Operator: migManager.enabled=false and remove the label")
                    ));
                }
                Finding::GkePartitions(size) => {
                    if reason.is_empty() {
                        reason = "MigLayoutOwnedByGKE";
                    }
                    parts.push(format!(
                        "GKE partitioned the GPUs ({GKE_PARTITION_LABEL}={size}); {}",
                        self.mig_action("a node pool without gpu-partition-size")
                    ));
                }
            }
        }
        ("False", reason, parts.join("; "))
    }

    fn mig_action(&self, fix: &str) -> String {
        if self.foreign_mig_layout {
            format!(
                "tessera never changes MIG mode or creates or destroys MIG instances here, and publishes \
                 no MIG devices and no GPU in MIG mode. Fix, to let tessera manage MIG: {fix}"
            )
        } else {
            "serving anyway (coexistence=warn): MIG instances no tessera claim holds are destroyed at start"
                .into()
        }
    }

    /// The `Coexistence` condition; `since` is when it last changed status or reason.
    pub fn condition(&self, since: Timestamp) -> InventoryCondition {
        let (status, reason, message) = self.summary();
        InventoryCondition {
            type_: CONDITION_TYPE.into(),
            status: status.into(),
            reason: reason.into(),
            message,
            last_transition_time: Some(Time(since)),
        }
    }
}

/// The condition to publish now: `previous`'s transition time is kept while status and reason stay.
pub fn next_condition(
    previous: Option<&InventoryCondition>,
    verdict: &Verdict,
    now: Timestamp,
) -> InventoryCondition {
    let mut next = verdict.condition(now);
    if let Some(prev) = previous
        && prev.status == next.status
        && prev.reason == next.reason
    {
        next.last_transition_time = prev.last_transition_time.clone();
    }
    next
}

/// How long one read of the Node may take at start before the plugin goes on without it.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads the Node `name` (the plugin's RBAC: get on nodes) and decides; an error or a timeout is an
/// unreadable Node.
pub async fn read_and_decide(client: &kube::Client, name: &str, mode: CoexistenceMode) -> Verdict {
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    let read = match tokio::time::timeout(READ_TIMEOUT, nodes.get(name)).await {
        Ok(Ok(node)) => Ok(NodeFacts::of(&node)),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {READ_TIMEOUT:?}")),
    };
    match &read {
        Ok(facts) => decide(Ok(facts), mode),
        Err(why) => decide(Err(why), mode),
    }
}

/// Logs a verdict: a warning for anything but a node without other GPU managers.
pub fn log(verdict: &Verdict) {
    let (status, reason, message) = verdict.summary();
    if status == "True" {
        tracing::info!(reason, "{message}");
    } else {
        tracing::warn!(status, reason, mode = ?verdict.mode, "{message}");
    }
}

/// The current `Coexistence` condition, shared between the re-check and the inventory publisher.
pub type SharedCondition = std::sync::Arc<std::sync::Mutex<InventoryCondition>>;

/// Reads the Node every [`RECHECK_EVERY`] until `stop`, keeping `condition` current. A verdict that would
/// serve differently from `started` (what this plugin applied at start) is logged and said in the
/// condition's message: it applies at the next start.
pub async fn recheck(
    client: kube::Client,
    name: String,
    mode: CoexistenceMode,
    started: Verdict,
    condition: SharedCondition,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(RECHECK_EVERY) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let now = read_and_decide(&client, &name, mode).await;
        let mut next = {
            let current = condition.lock().unwrap_or_else(|e| e.into_inner());
            next_condition(Some(&current), &now, Timestamp::now())
        };
        if now.serves_differently_from(&started) {
            next.message.push_str(
                "; this differs from what the plugin found at start, and applies when the plugin pod restarts",
            );
        }
        let mut current = condition.lock().unwrap_or_else(|e| e.into_inner());
        if current.reason != next.reason || current.message != next.message {
            log(&now);
        }
        *current = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::inventory::MigInfo;

    /// A Node as the plugin reads it.
    #[derive(Default)]
    struct NodeBuilder(NodeFacts);

    impl NodeBuilder {
        fn allocatable(mut self, name: &str, quantity: &str) -> Self {
            self.0.allocatable.insert(name.into(), quantity.into());
            self
        }
        fn label(mut self, key: &str, value: &str) -> Self {
            self.0.labels.insert(key.into(), value.into());
            self
        }
        fn plain() -> Self {
            Self::default()
                .allocatable("cpu", "16")
                .allocatable("memory", "64Gi")
                .label("kubernetes.io/hostname", "node-a")
        }
    }

    fn gpu(index: u32, mig_mode: Option<bool>) -> GpuInfo {
        GpuInfo {
            index,
            mig: mig_mode.map(|enabled| MigInfo {
                enabled,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_node_without_other_gpu_managers_is_served_whole_with_a_true_condition() {
        let v = decide(Ok(&NodeBuilder::plain().0), CoexistenceMode::Refuse);
        assert!(!v.withhold_devices && !v.foreign_mig_layout);
        let gpus = [gpu(0, Some(true)), gpu(1, Some(false)), gpu(2, None)];
        assert_eq!(v.published_gpus(&gpus), gpus);
        let c = v.condition(Timestamp::UNIX_EPOCH);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "NoOtherGPUManager")
        );
    }

    #[test]
    fn a_device_plugins_gpus_make_the_plugin_publish_nothing_and_say_how_to_fix_it() {
        let node = NodeBuilder::plain().allocatable("nvidia.com/gpu", "8").0;
        let v = decide(Ok(&node), CoexistenceMode::Refuse);
        assert!(v.withhold_devices && v.foreign_mig_layout);
        assert!(v.published_gpus(&[gpu(0, None), gpu(1, Some(false))]).is_empty());
        let c = v.condition(Timestamp::UNIX_EPOCH);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "DevicePluginAdvertisesGPUs")
        );
        assert!(c.message.contains("nvidia.com/gpu: 8"), "{}", c.message);
        assert!(c.message.contains("devicePlugin.enabled=false"), "{}", c.message);

        let mig_strategy = NodeBuilder::plain().allocatable("nvidia.com/mig-1g.10gb", "7").0;
        assert!(decide(Ok(&mig_strategy), CoexistenceMode::Refuse).withhold_devices);
        let time_sliced = NodeBuilder::plain().allocatable("nvidia.com/gpu.shared", "32").0;
        assert!(decide(Ok(&time_sliced), CoexistenceMode::Refuse).withhold_devices);
    }

    #[test]
    fn a_device_plugin_advertising_zero_gpus_or_another_vendors_resource_is_no_conflict() {
        let node = NodeBuilder::plain()
            .allocatable("nvidia.com/gpu", "0")
            .allocatable("amd.com/gpu", "4")
            .allocatable("example.com/nvidia.com-gpu", "1")
            .0;
        let v = decide(Ok(&node), CoexistenceMode::Refuse);
        assert!(v.findings.is_empty(), "{:?}", v.findings);
    }

    #[test]
    fn a_mig_manager_label_keeps_its_layout_and_publishes_only_gpus_out_of_mig_mode_without_mig() {
        let node = NodeBuilder::plain().label(MIG_CONFIG_LABEL, "all-1g.10gb").0;
        let v = decide(Ok(&node), CoexistenceMode::Refuse);
        assert!(!v.withhold_devices && v.foreign_mig_layout);
        let gpus = [gpu(0, Some(true)), gpu(1, Some(false)), gpu(2, None)];
        let published = v.published_gpus(&gpus);
        assert_eq!(
            published.iter().map(|g| g.index).collect::<Vec<_>>(),
            [1, 2],
            "GPU 0 is in MIG mode: its instances are mig-manager's"
        );
        assert!(
            published.iter().all(|g| g.mig.is_none()),
            "no MIG devices offered"
        );
        let served = v.served_gpus(&gpus);
        assert_eq!(
            served.len(),
            3,
            "the node state keeps every GPU, for the claims it holds"
        );
        assert!(
            served.iter().all(|g| g.mig.is_none()),
            "so MIG clean-up skips them all"
        );
        let c = v.condition(Timestamp::UNIX_EPOCH);
        assert_eq!(c.reason, "MigLayoutOwnedByMigManager");
        assert!(
            c.message.contains("nvidia.com/mig.config=all-1g.10gb"),
            "{}",
            c.message
        );

        let gke = NodeBuilder::plain().label(GKE_PARTITION_LABEL, "1g.5gb").0;
        let v = decide(Ok(&gke), CoexistenceMode::Refuse);
        assert!(v.foreign_mig_layout);
        assert_eq!(v.condition(Timestamp::UNIX_EPOCH).reason, "MigLayoutOwnedByGKE");
    }

    #[test]
    fn warn_serves_as_if_alone_but_still_reports_every_finding() {
        let node = NodeBuilder::plain()
            .allocatable("nvidia.com/gpu", "8")
            .label(MIG_CONFIG_LABEL, "all-disabled")
            .0;
        let v = decide(Ok(&node), CoexistenceMode::Warn);
        assert!(!v.withhold_devices && !v.foreign_mig_layout);
        let gpus = [gpu(0, Some(true))];
        assert_eq!(v.published_gpus(&gpus), gpus);
        let c = v.condition(Timestamp::UNIX_EPOCH);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "DevicePluginAdvertisesGPUs")
        );
        assert!(c.message.contains("coexistence=warn"), "{}", c.message);
        assert!(c.message.contains("mig-manager"), "{}", c.message);
    }

    #[test]
    fn an_unreadable_node_is_served_but_no_mig_instance_is_destroyed() {
        let v = decide(Err("nodes \"node-a\" is forbidden"), CoexistenceMode::Refuse);
        assert!(!v.withhold_devices && !v.foreign_mig_layout && v.keep_unowned_mig);
        let gpus = [gpu(0, Some(true))];
        assert_eq!(v.published_gpus(&gpus), gpus, "nothing shows another owner");
        let c = v.condition(Timestamp::UNIX_EPOCH);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("Unknown", "NodeUnreadable")
        );
        assert!(c.message.contains("forbidden") && c.message.contains("get on its Node"));
    }

    #[test]
    fn the_transition_time_moves_only_when_status_or_reason_changes() {
        let t0 = Timestamp::UNIX_EPOCH;
        let t1 = Timestamp::from_second(60).unwrap();
        let plain = decide(Ok(&NodeBuilder::plain().0), CoexistenceMode::Refuse);
        let first = next_condition(None, &plain, t0);
        let again = next_condition(Some(&first), &plain, t1);
        assert_eq!(again.last_transition_time, Some(Time(t0)));
        let dp = decide(
            Ok(&NodeBuilder::plain().allocatable("nvidia.com/gpu", "1").0),
            CoexistenceMode::Refuse,
        );
        let changed = next_condition(Some(&again), &dp, t1);
        assert_eq!(changed.last_transition_time, Some(Time(t1)));
        assert!(dp.serves_differently_from(&plain));
        assert!(!plain.serves_differently_from(&plain.clone()));
    }
}
