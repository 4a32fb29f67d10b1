//! The cluster GPU policy: which device model each GPU is published as.
//!
//! One cluster-scoped `GpuPolicy`; the controller uses the one named [`DEFAULT_POLICY_NAME`]. Its rules are
//! ordered and the first rule whose CEL `selector` matches a GPU decides the GPU's model. The selector sees
//! the GPU exactly as a DeviceClass selector sees its whole-GPU device (`device.driver`,
//! `device.attributes["gpu.tessera.dev"].productName`, `device.capacity["gpu.tessera.dev"].memory`, …), with
//! the Kubernetes `quantity()` and `semver()` libraries.
//!
//! ```yaml
//! apiVersion: gpu.tessera.dev/v1alpha1
//! kind: GpuPolicy
//! metadata: {name: default}
//! spec:
//!   rules:
//!   - name: hopper-mig
//!     selector: device.attributes["gpu.tessera.dev"].architecture == "Hopper"
//!     dynamicMig: {profiles: ["1g.10gb", "3g.40gb"]}
//!   - name: everything-else
//!     whole: {}
//! ```
//!
//! A GPU no rule matches gets the built-in default: a whole GPU plus dynamic MIG where the GPU and the
//! cluster support it. A policy the controller cannot use (CEL syntax or type error, a rule matching no GPU,
//! a rule naming no model or two) gets the condition `Valid=False` carrying the error, and the controller
//! keeps publishing what the last valid policy said.

use k8s_openapi::apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::Condition};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Name of the policy object the controller reads.
pub const DEFAULT_POLICY_NAME: &str = "default";

/// Condition type set on every policy the controller has looked at.
pub const CONDITION_VALID: &str = "Valid";

/// `Valid=True`: every rule compiled, evaluated to a bool on every GPU and matched at least one GPU.
pub const REASON_VALID: &str = "Valid";
/// `Valid=False`: a selector is not valid CEL (message: the parser's error).
pub const REASON_CEL_SYNTAX_ERROR: &str = "CelSyntaxError";
/// `Valid=False`: a selector returned a non-bool or applied an operator or function to the wrong type.
pub const REASON_CEL_TYPE_ERROR: &str = "CelTypeError";
/// `Valid=False`: a selector failed while evaluating on a GPU, e.g. a missing attribute.
pub const REASON_CEL_RUNTIME_ERROR: &str = "CelRuntimeError";
/// `Valid=False`: a rule without `optional: true` matched no GPU in the cluster (usually a typo).
pub const REASON_SELECTS_NOTHING: &str = "SelectsNothing";
/// `Valid=False`: a rule names no model or several, or its model's parameters are unusable.
pub const REASON_INVALID_MODEL: &str = "InvalidModel";
/// `Valid=False`: `spec.health` is unusable (e.g. a `quietPeriod` that is not a duration).
pub const REASON_INVALID_HEALTH: &str = "InvalidHealth";

/// Ordered rules that choose a device model per GPU.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpu.tessera.dev",
    version = "v1alpha1",
    kind = "GpuPolicy",
    plural = "gpupolicies",
    shortname = "gpupol",
    status = "GpuPolicyStatus",
    printcolumn = r#"{"name":"Valid","type":"string","jsonPath":".status.conditions[?(@.type==\"Valid\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Valid\")].reason"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct GpuPolicySpec {
    /// Evaluated in order for every GPU; the first match wins.
    #[serde(default)]
    pub rules: Vec<PolicyRule>,
    /// How the controller taints the devices of a GPU (or MIG device) its plugin reports unhealthy;
    /// the defaults below apply when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<HealthPolicy>,
}

/// Device taints for sick GPUs.
///
/// ```yaml
/// health:
///   taints: {xid: NoSchedule, doubleBitEcc: NoSchedule, gpuLost: NoExecute}
///   quietPeriod: 60s
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HealthPolicy {
    /// The taint effect per kind of failure.
    #[serde(default)]
    pub taints: HealthTaints,
    /// How long a device must stay healthy after a failure before its taint is removed, as a duration
    /// (`90s`, `5m`, `1m30s`); default [`DEFAULT_QUIET_PERIOD_SECS`] seconds. `0s` removes it at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quiet_period: Option<String>,
}

/// Default of `health.quietPeriod`: long enough that a GPU throwing an XID every few seconds does not
/// flap between tainted and schedulable.
pub const DEFAULT_QUIET_PERIOD_SECS: u64 = 60;

/// Effect of the taint per failure; each defaults as documented on its field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HealthTaints {
    /// A critical XID (`gpu.tessera.dev/xid=<xid>`); default `NoSchedule`: the GPU may recover after its
    /// work is restarted, so running pods are left to decide.
    #[serde(default = "no_schedule")]
    pub xid: TaintEffect,
    /// A double-bit ECC error (`gpu.tessera.dev/ecc`); default `NoSchedule`.
    #[serde(default = "no_schedule")]
    pub double_bit_ecc: TaintEffect,
    /// A lost GPU (`gpu.tessera.dev/gpu-lost`); default `NoExecute`: its pods cannot make progress, so
    /// the device-taint eviction controller evicts them.
    #[serde(default = "no_execute")]
    pub gpu_lost: TaintEffect,
}

impl Default for HealthTaints {
    fn default() -> Self {
        Self {
            xid: TaintEffect::NoSchedule,
            double_bit_ecc: TaintEffect::NoSchedule,
            gpu_lost: TaintEffect::NoExecute,
        }
    }
}

fn no_schedule() -> TaintEffect {
    TaintEffect::NoSchedule
}

fn no_execute() -> TaintEffect {
    TaintEffect::NoExecute
}

/// A device taint effect (`resource.k8s.io/v1` `DeviceTaint.effect`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum TaintEffect {
    /// No new allocations; allocated devices stay.
    NoSchedule,
    /// No new allocations, and pods using the device are evicted.
    NoExecute,
    /// Informational only (Kubernetes 1.35+).
    #[serde(rename = "None")]
    Informational,
}

impl TaintEffect {
    /// The spelling of `DeviceTaint.effect`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoSchedule => "NoSchedule",
            Self::NoExecute => "NoExecute",
            Self::Informational => "None",
        }
    }
}

/// Reads a duration as Kubernetes spells it in its objects (`90s`, `5m`, `1h`, `1m30s`, `0s`): whole
/// numbers of `h`, `m` and `s`, largest first. Errors say what was wrong and show a valid spelling.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let text = s.trim();
    if text.is_empty() {
        return Err("is empty; write a duration such as 60s or 1m30s".into());
    }
    let mut secs: u64 = 0;
    let mut digits = String::new();
    let mut last_unit = u64::MAX;
    for c in text.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            'h' => 3600,
            'm' => 60,
            's' => 1,
            _ => {
                return Err(format!(
                    "{s:?} has the unit {c:?}; use h, m or s, e.g. 60s or 1m30s"
                ));
            }
        };
        if digits.is_empty() && c == 's' && last_unit == 60 {
            return Err(format!("{s:?} is in milliseconds; write whole seconds, e.g. 1s"));
        }
        if digits.is_empty() {
            return Err(format!(
                "{s:?} has a unit without a number; write e.g. 60s or 1m30s"
            ));
        }
        if unit >= last_unit {
            return Err(format!(
                "{s:?} repeats or reorders units; write the largest first, e.g. 1m30s"
            ));
        }
        last_unit = unit;
        let n: u64 = digits.parse().map_err(|_| format!("{s:?} is too large"))?;
        secs = n
            .checked_mul(unit)
            .and_then(|v| secs.checked_add(v))
            .ok_or_else(|| format!("{s:?} is too large"))?;
        digits.clear();
    }
    if !digits.is_empty() {
        return Err(format!("{s:?} ends without a unit; write e.g. {digits}s"));
    }
    Ok(std::time::Duration::from_secs(secs))
}

impl HealthPolicy {
    /// `quietPeriod`, or the default when unset.
    pub fn quiet_period(&self) -> Result<std::time::Duration, String> {
        match &self.quiet_period {
            None => Ok(std::time::Duration::from_secs(DEFAULT_QUIET_PERIOD_SECS)),
            Some(s) => parse_duration(s),
        }
    }
}

/// One rule: a selector and exactly one model.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyRule {
    /// Shown in status messages.
    pub name: String,
    /// CEL expression over `device` (as in a DeviceClass selector); absent matches every GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// When true, matching no GPU is not an error (a rule for hardware the cluster does not have yet).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optional: bool,
    /// Publish the GPU as one device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub whole: Option<WholeModel>,
    /// Publish every MIG placement of the allowed profiles plus the whole GPU, sharing counters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic_mig: Option<DynamicMigModel>,
    /// Publish a fixed MIG layout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub static_mig: Option<StaticMigModel>,
    /// Offer the GPU to several claims at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<SharedModel>,
    /// Keep what the plugin made for a claim (a MIG device, an MPS daemon) after the claim goes, for the
    /// next claim of the same device to take: a replica scaled back up skips MIG instance creation or the
    /// daemon's start. Off unless set; only with `dynamicMig`, `staticMig` or `shared`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<WarmPolicy>,
}

/// Warm partitions for the GPUs a rule matches.
///
/// ```yaml
/// warm: {window: 10m}
/// ```
///
/// The plugin keeps a released MIG device (its GPU and compute instance) or a share's MPS daemon for
/// `window`, then destroys it. A kept partition never makes a claim wait: the devices stay published as
/// free, and a claim that needs that part of the GPU otherwise (a larger profile, the whole GPU) has it
/// destroyed first. Published to the plugin as each device's `warmSeconds` attribute.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WarmPolicy {
    /// How long a released partition is kept, as a duration (`90s`, `10m`, `1h`); at most `24h`. `0s`
    /// keeps nothing.
    pub window: String,
}

/// The longest `warm.window`: a day. A partition idle for longer is a layout, which `staticMig` states.
pub const MAX_WARM_WINDOW_SECS: u64 = 24 * 3600;

impl WarmPolicy {
    /// The window in seconds, or why it is unusable.
    pub fn seconds(&self) -> Result<u64, String> {
        let secs = parse_duration(&self.window)?.as_secs();
        if secs > MAX_WARM_WINDOW_SECS {
            return Err(format!(
                "{:?} is longer than a day ({MAX_WARM_WINDOW_SECS}s); a partition kept that long is a \
                 layout: use staticMig",
                self.window
            ));
        }
        Ok(secs)
    }
}

/// One device per GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WholeModel {}

/// Partitionable devices (KEP-4815): one device per (profile × placement) and the whole GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DynamicMigModel {
    /// Profile names offered (e.g. `3g.40gb`, or `3g` for every 3-slice profile); empty offers all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<String>,
    /// Layout (`profile@start`) published instead when the API server lacks partitionable devices; empty
    /// publishes the whole GPU then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fallback_layout: Vec<String>,
    /// Counters each GPU's counter set also publishes, for a quota system that charges MIG devices by
    /// counter (Kueue's counter sources, `deviceClassMappings[].sources[].counter`): `memory` puts the GPU's
    /// memory (bytes, the counter name NVIDIA's DRA driver uses) in the set, and every placement and the
    /// whole GPU consume their memory from it. Off unless listed: it never changes what fits on a GPU (the
    /// memory slices decide that), and each device/counter pair costs kube-scheduler time on every pod.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quota_counters: Vec<QuotaCounter>,
}

/// A counter `dynamicMig.quotaCounters` adds to each GPU's counter set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
pub enum QuotaCounter {
    /// The device's memory in bytes (a placement: its profile's memory; the whole GPU: all of it).
    #[serde(rename = "memory")]
    Memory,
}

/// A fixed MIG layout.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StaticMigModel {
    /// MIG instances as `profile@start`, e.g. `3g.40gb@4` or `1g@0`; `<n>g` names the GPU's smallest
    /// `<n>g.` profile without media extensions. Placements must exist and must not overlap.
    pub layout: Vec<String>,
}

/// A GPU shared between claims.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SharedModel {
    /// How the plugin isolates the claims sharing the GPU.
    pub strategy: SharingStrategy,
    /// Granularity of memory requests (consumable capacity); default `1Gi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_step: Option<Quantity>,
    /// Number of equal slots per GPU when the API server lacks consumable capacity; default 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_slots: Option<u32>,
    /// Which claims share one MPS control daemon (MPS only): `Namespace` (the default) gives the claims
    /// of each namespace a daemon, pipe directory and `/dev/shm` of their own, so no tenant can stop,
    /// reconfigure or read another namespace's MPS work; `Shared` runs one daemon per GPU for every
    /// namespace, for namespaces that trust each other (their work then runs concurrently instead of
    /// time-sliced). Published as the `mpsTenancy` attribute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenancy: Option<MpsTenancy>,
}

/// Which claims of a shared GPU share one MPS control daemon (`shared.tenancy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum MpsTenancy {
    /// One daemon per namespace: a namespace's claims share it, other namespaces cannot reach it.
    #[default]
    Namespace,
    /// One daemon for every claim of the GPU, whatever its namespace.
    Shared,
}

impl MpsTenancy {
    /// The attribute value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Namespace => "Namespace",
            Self::Shared => "Shared",
        }
    }

    /// The tenancy an `mpsTenancy` attribute value names.
    pub fn parse(value: &str) -> Option<Self> {
        [Self::Namespace, Self::Shared]
            .into_iter()
            .find(|t| t.as_str() == value)
    }
}

/// Sharing strategy, published as the `sharingStrategy` attribute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum SharingStrategy {
    /// CUDA MPS with per-client memory and thread-percentage limits.
    #[default]
    #[serde(rename = "MPS")]
    Mps,
    /// Time-slicing without isolation.
    TimeSlicing,
}

impl SharingStrategy {
    /// The attribute value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Mps => "MPS",
            Self::TimeSlicing => "TimeSlicing",
        }
    }
}

/// What the controller made of the policy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuPolicyStatus {
    /// `metadata.generation` the conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Valid` (see the `REASON_*` constants).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The model a rule names.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ModelRef<'a> {
    Whole,
    DynamicMig(&'a DynamicMigModel),
    StaticMig(&'a StaticMigModel),
    Shared(&'a SharedModel),
}

impl PolicyRule {
    /// The one model this rule names, or how many it names when that is not exactly one.
    pub fn model(&self) -> Result<ModelRef<'_>, usize> {
        let mut models = Vec::with_capacity(1);
        if self.whole.is_some() {
            models.push(ModelRef::Whole);
        }
        if let Some(m) = &self.dynamic_mig {
            models.push(ModelRef::DynamicMig(m));
        }
        if let Some(m) = &self.static_mig {
            models.push(ModelRef::StaticMig(m));
        }
        if let Some(m) = &self.shared {
            models.push(ModelRef::Shared(m));
        }
        match models.as_slice() {
            [one] => Ok(*one),
            many => Err(many.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_reads_from_the_documented_yaml() {
        let policy: GpuPolicy = serde_norway::from_str(
            r#"
apiVersion: gpu.tessera.dev/v1alpha1
kind: GpuPolicy
metadata: {name: default}
spec:
  rules:
  - name: hopper-mig
    selector: device.attributes["gpu.tessera.dev"].architecture == "Hopper"
    dynamicMig: {profiles: ["1g.10gb", "3g.40gb"]}
  - name: shares
    optional: true
    shared: {strategy: TimeSlicing, memoryStep: 2Gi, fallbackSlots: 8}
  - name: everything-else
    whole: {}
"#,
        )
        .unwrap();
        let rules = &policy.spec.rules;
        assert_eq!(
            rules[0].model(),
            Ok(ModelRef::DynamicMig(&DynamicMigModel {
                profiles: vec!["1g.10gb".into(), "3g.40gb".into()],
                ..Default::default()
            }))
        );
        let ModelRef::Shared(shared) = rules[1].model().unwrap() else {
            panic!("not shared")
        };
        assert_eq!(shared.strategy, SharingStrategy::TimeSlicing);
        assert_eq!(shared.memory_step, Some(Quantity("2Gi".into())));
        assert!(rules[1].optional);
        assert_eq!(rules[2].model(), Ok(ModelRef::Whole));
    }

    #[test]
    fn health_settings_default_to_no_schedule_for_errors_and_no_execute_for_a_lost_gpu() {
        let spec: GpuPolicySpec =
            serde_norway::from_str("health: {taints: {xid: NoExecute}, quietPeriod: 1m30s}").unwrap();
        let health = spec.health.unwrap();
        assert_eq!(health.taints.xid, TaintEffect::NoExecute);
        assert_eq!(health.taints.double_bit_ecc, TaintEffect::NoSchedule);
        assert_eq!(health.taints.gpu_lost, TaintEffect::NoExecute);
        assert_eq!(health.quiet_period(), Ok(std::time::Duration::from_secs(90)));
        assert_eq!(
            HealthPolicy::default().quiet_period(),
            Ok(std::time::Duration::from_secs(DEFAULT_QUIET_PERIOD_SECS))
        );
        let none: HealthTaints = serde_norway::from_str("xid: None").unwrap();
        assert_eq!(none.xid.as_str(), "None");
    }

    #[test]
    fn durations_read_as_kubernetes_spells_them_and_bad_ones_say_how_to_write_them() {
        let secs = |s| parse_duration(s).map(|d| d.as_secs());
        assert_eq!(secs("0s"), Ok(0));
        assert_eq!(secs("5m"), Ok(300));
        assert_eq!(secs("1h2m3s"), Ok(3723));
        assert!(secs("60").unwrap_err().contains("60s"));
        assert!(secs("1s1m").unwrap_err().contains("largest first"));
        assert!(secs("10ms").unwrap_err().contains("whole seconds"));
        assert!(secs("2d").unwrap_err().contains("use h, m or s"));
        assert!(secs("").unwrap_err().contains("empty"));
    }

    #[test]
    fn a_rule_must_name_exactly_one_model() {
        let none = PolicyRule {
            name: "r".into(),
            ..Default::default()
        };
        assert_eq!(none.model(), Err(0));
        let two = PolicyRule {
            name: "r".into(),
            whole: Some(WholeModel {}),
            shared: Some(SharedModel::default()),
            ..Default::default()
        };
        assert_eq!(two.model(), Err(2));
    }

    #[test]
    fn sharing_strategies_use_the_attribute_spelling() {
        assert_eq!(serde_json::to_value(SharingStrategy::Mps).unwrap(), "MPS");
        assert_eq!(
            serde_json::to_value(SharingStrategy::TimeSlicing).unwrap(),
            "TimeSlicing"
        );
        assert_eq!(SharingStrategy::Mps.as_str(), "MPS");
    }
}
