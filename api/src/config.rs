//! Opaque claim configuration: the `parameters` of a DeviceClass or ResourceClaim config entry whose
//! `opaque.driver` is `gpu.tessera.dev`.
//!
//! Two kinds, both `apiVersion: gpu.tessera.dev/v1alpha1`:
//!
//! * `GpuConfig` applies to whole GPUs and GPU shares (`gpu-0`, `gpu-0-shared`, `gpu-0-share-1`);
//! * `MigConfig` applies to MIG devices and MIG shares (`gpu-0-mig-3g-40gb-4`, `…-shared`).
//!
//! ```yaml
//! apiVersion: gpu.tessera.dev/v1alpha1
//! kind: GpuConfig
//! sharing:
//!   strategy: MPS                        # or TimeSlicing
//!   mps:
//!     defaultActiveThreadPercentage: 50  # 1..100
//!     computeCeiling: 100                # 1..100: the share may burst to this (default: its compute request)
//!     defaultPinnedDeviceMemoryLimit: 10Gi
//!     perDevicePinnedMemoryLimit:        # keyed by tessera device name
//!       gpu-1-shared: 20Gi
//!   # timeSlicing: {interval: Default}   # Default | Short | Medium | Long (GpuConfig only)
//! ```
//!
//! The user reference, every field with its default, is `api/README.md` (checked against this decoder).
//!
//! Decoding is strict: an unknown field is an error, so a typo never silently drops a limit. Every error
//! names the field path. The complete list of messages (the `…` parts are filled in; `<path>` is a field
//! path such as `sharing.mps`):
//!
//! | Message | When |
//! |---|---|
//! | `parameters: must be an object, got <type>` | `parameters` is not a JSON object |
//! | `<path>: unknown field "<field>"; allowed fields: <a>, <b>, …` | a misspelled or unsupported field (`<path>` is `parameters` at the top level) |
//! | `<path>: required field is missing` | `apiVersion`, `kind` or `sharing.strategy` absent |
//! | `<path>: must be <type>, got <type>` | wrong JSON type, e.g. a string where a number belongs |
//! | `apiVersion: must be "gpu.tessera.dev/v1alpha1", got "<v>"` | other API version |
//! | `kind: must be one of GpuConfig, MigConfig, got "<k>"` | other kind |
//! | `sharing.strategy: must be one of MPS, TimeSlicing, got "<s>"` | unknown strategy |
//! | `sharing.timeSlicing.interval: must be one of Default, Short, Medium, Long, got "<i>"` | unknown interval |
//! | `sharing.mps.defaultActiveThreadPercentage: must be between 1 and 100, got <n>` | out of range |
//! | `sharing.mps.computeCeiling: must be between 1 and 100, got <n>` | out of range |
//! | `sharing.mps.computeCeiling: <c> is above defaultActiveThreadPercentage <d>, …` | a ceiling the config's own daemon default would cut (an MPS client can only lower the daemon's percentage) |
//! | `<quantity path>: invalid quantity "<q>": <reason>` | unparsable quantity |
//! | `<quantity path>: must be at least 1Mi, got "<q>"` | zero or sub-MiB memory limit (MPS counts in MiB) |
//! | `<quantity path>: must be at most 1Ti (more memory than any GPU has), got "<q>"` | absurd memory limit |
//! | `sharing.mps.perDevicePinnedMemoryLimit: key "<k>" is not a tessera device name (gpu-<i>, …)` | bad key |
//! | `sharing.mps: only allowed with strategy MPS, got <s>` | MPS settings with another strategy |
//! | `sharing.timeSlicing: only allowed with strategy TimeSlicing, got <s>` | interval with another strategy |
//! | `sharing.timeSlicing: MIG devices have no time-slice setting; remove it or use GpuConfig` | in `MigConfig` |
//! | `cannot apply <kind> to <device kind> <device>; use <kind>` | kind does not fit the allocated device |
//! | `config source "<s>" is not FromClass or FromClaim` | malformed allocation |
//!
//! At prepare, where the node's GPUs are known, [`DeviceConfig::check_on_node`] adds:
//!
//! | Message | When |
//! |---|---|
//! | `sharing.mps.perDevicePinnedMemoryLimit: key "<k>" names no device on this node: <why>` | e.g. `gpu-9-shared` on an 8-GPU node |
//! | `<quantity path>: "<q>" is more than the <n> MiB of memory of <device>` | a limit above the device's memory |
//!
//! [`check_ceiling`] (at prepare, and in the webhook where the request and its class are known) adds:
//!
//! | Message | When |
//! |---|---|
//! | `sharing.mps.computeCeiling: <c> is below the share's compute request of <r>; …` | a ceiling below what the scheduler reserved |
//! | `sharing.mps.computeCeiling: means nothing on <device kind> <device>: …` | a whole GPU, an unshared MIG device or a share slot |
//!
//! Values a user wrote are echoed cut to [`MAX_ECHO_CHARS`] characters (`…` marks the cut), so a huge
//! value never becomes a huge event.
//! Precedence ([`effective_config`]): configs from the DeviceClass rank below configs from the claim; within
//! each, an entry naming the request ranks above an untargeted one; among equals the later entry wins.
//! Untargeted entries of the other kind are skipped (a claim may mix GPU and MIG requests); a targeted entry of
//! the wrong kind is an error.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::DeviceAllocationConfiguration;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::policy::SharingStrategy;
use crate::{DRIVER_NAME, DeviceName, GROUP_VERSION, GpuInfo};

/// `kind` of the configuration for whole GPUs and GPU shares.
pub const KIND_GPU_CONFIG: &str = "GpuConfig";
/// `kind` of the configuration for MIG devices and MIG shares.
pub const KIND_MIG_CONFIG: &str = "MigConfig";

/// Allocation config `source` of entries copied from the DeviceClass.
pub const SOURCE_FROM_CLASS: &str = "FromClass";
/// Allocation config `source` of entries copied from the claim.
pub const SOURCE_FROM_CLAIM: &str = "FromClaim";

/// Smallest pinned-memory limit: MPS takes limits in whole MiB.
pub const MIN_PINNED_MEMORY_BYTES: u64 = 1 << 20;

/// Largest pinned-memory limit accepted without knowing the device: 1 TiB, more than any GPU has (the
/// largest have 288 GB). The device's own memory is checked at prepare ([`DeviceConfig::check_on_node`]).
pub const MAX_PINNED_MEMORY_BYTES: u64 = 1 << 40;

/// Longest user-written value echoed in a message, in characters.
pub const MAX_ECHO_CHARS: usize = 64;

/// `value` as messages echo it: at most [`MAX_ECHO_CHARS`] characters, `…` where it was cut.
pub fn echo(value: &str) -> String {
    match value.char_indices().nth(MAX_ECHO_CHARS) {
        None => value.to_string(),
        Some((cut, _)) => format!("{}…", &value[..cut]),
    }
}

/// Why a configuration was rejected. Each message starts with the field path it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The value at `path` is not a JSON object.
    #[error("{path}: must be an object, got {got}")]
    NotAnObject { path: String, got: &'static str },
    /// A field the kind does not define.
    #[error("{path}: unknown field {field:?}; allowed fields: {}", allowed.join(", "))]
    UnknownField {
        path: String,
        field: String,
        allowed: &'static [&'static str],
    },
    /// A required field is absent.
    #[error("{path}: required field is missing")]
    MissingField { path: String },
    /// A field of the wrong JSON type.
    #[error("{path}: must be {expected}, got {got}")]
    WrongType {
        path: String,
        expected: &'static str,
        got: &'static str,
    },
    /// A string field outside its set of values.
    #[error("{path}: must be {}, got {got:?}", one_of(allowed))]
    NotOneOf {
        path: String,
        got: String,
        allowed: &'static [&'static str],
    },
    /// A number outside its range.
    #[error("{path}: must be between {min} and {max}, got {got}")]
    OutOfRange {
        path: String,
        min: i64,
        max: i64,
        /// As written (it may be too large for any integer type).
        got: String,
    },
    /// A quantity that does not parse.
    #[error("{path}: invalid quantity {value:?}: {source}")]
    InvalidQuantity {
        path: String,
        value: String,
        #[source]
        source: QuantityError,
    },
    /// A memory limit below [`MIN_PINNED_MEMORY_BYTES`].
    #[error("{path}: must be at least 1Mi, got {value:?}")]
    MemoryLimitTooSmall { path: String, value: String },
    /// A memory limit above [`MAX_PINNED_MEMORY_BYTES`].
    #[error("{path}: must be at most 1Ti (more memory than any GPU has), got {value:?}")]
    MemoryLimitTooLarge { path: String, value: String },
    /// A memory limit above the memory of the device it applies to.
    #[error("{path}: {value:?} is more than the {memory_mib} MiB of memory of {device}")]
    MemoryLimitAboveDevice {
        path: String,
        value: String,
        device: String,
        memory_mib: u64,
    },
    /// A `perDevicePinnedMemoryLimit` key naming a device this node does not have.
    #[error("{path}: key {key:?} names no device on this node: {why}")]
    DeviceNotOnNode { path: String, key: String, why: String },
    /// A `perDevicePinnedMemoryLimit` key that is not a device name.
    #[error(
        "{path}: key {key:?} is not a tessera device name (gpu-<i>, gpu-<i>-shared, gpu-<i>-mig-<profile>-<start>, …)"
    )]
    BadDeviceKey { path: String, key: String },
    /// Strategy-specific settings next to another strategy.
    #[error("{path}: only allowed with strategy {needs}, got {got}")]
    SettingsForOtherStrategy {
        path: String,
        needs: &'static str,
        got: &'static str,
    },
    /// A compute ceiling below the share's compute request: the ceiling is what the share may burst to, so
    /// it is at least what the scheduler reserved for it.
    #[error(
        "sharing.mps.computeCeiling: {ceiling} is below the share's compute request of {request} (the ceiling \
         is what the share may burst to, at least what it reserves); raise computeCeiling to {request} or more, \
         or lower capacity.requests.compute"
    )]
    CeilingBelowRequest { ceiling: u32, request: u64 },
    /// A compute ceiling on a device that has no MPS client limit to set.
    #[error(
        "sharing.mps.computeCeiling: means nothing on {device_kind} {device}: {why}; remove it, or aim the config at a share's request (requests: [...])"
    )]
    CeilingMeansNothing {
        device_kind: &'static str,
        device: String,
        why: &'static str,
    },
    /// A compute ceiling above the same config's daemon default, which caps every client of the daemon.
    #[error(
        "sharing.mps.computeCeiling: {ceiling} is above defaultActiveThreadPercentage {default}, which the \
         device's MPS daemon applies to every client (a client can only lower it); raise \
         defaultActiveThreadPercentage to {ceiling} or more, or leave it out"
    )]
    CeilingAboveDaemonDefault { ceiling: u32, default: u32 },
    /// `timeSlicing` in a `MigConfig`.
    #[error("sharing.timeSlicing: MIG devices have no time-slice setting; remove it or use GpuConfig")]
    TimeSlicingOnMig,
    /// Strategy `TimeSlicing` in a `MigConfig`: tessera has nothing to set on a MIG device for it, so the
    /// config would be accepted and do nothing.
    #[error(
        "sharing.strategy: TimeSlicing cannot be applied to MIG devices (a MIG device has no time-slice \
         setting, and its processes already take turns on it); use strategy MPS for limits, or remove sharing"
    )]
    TimeSlicingStrategyOnMig,
    /// A strategy the shared device is not published with: the device's `sharingStrategy` attribute is
    /// the one it serves, for every claim sharing it.
    #[error(
        "sharing.strategy: device {device} serves {serves} (its sharingStrategy attribute) to every claim \
         sharing it, so this claim may not ask for {asked}; ask for {serves} or leave sharing out of the \
         config, or request a device whose sharingStrategy is {asked} (selector \
         device.attributes[\"gpu.tessera.dev\"].sharingStrategy == \"{asked}\")"
    )]
    StrategyNotServed {
        device: String,
        serves: &'static str,
        asked: &'static str,
    },
    /// A config kind that does not fit the allocated device.
    #[error("cannot apply {kind} to {device_kind} {device}; use {use_kind}")]
    WrongKindForDevice {
        kind: &'static str,
        device_kind: &'static str,
        device: String,
        use_kind: &'static str,
    },
    /// An allocation config entry with an unknown `source`.
    #[error("config source {0:?} is not FromClass or FromClaim")]
    UnknownSource(String),
}

fn one_of(allowed: &[&str]) -> String {
    match allowed {
        [single] => format!("{single:?}"),
        _ => format!("one of {}", allowed.join(", ")),
    }
}

pub type Result<T, E = ConfigError> = std::result::Result<T, E>;

/// A decoded, normalized and validated configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", deny_unknown_fields)]
pub enum DeviceConfig {
    GpuConfig(GpuConfig),
    MigConfig(MigConfig),
}

/// Configuration of a whole GPU or GPU share.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<Sharing>,
}

/// Configuration of a MIG device or MIG share.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MigConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing: Option<Sharing>,
}

/// How the processes of one or several claims share a device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Sharing {
    pub strategy: SharingStrategy,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps: Option<MpsConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_slicing: Option<TimeSlicingConfig>,
}

/// MPS limits. Quantities are kept as written; [`MpsConfig::pinned_limit_bytes`] reads them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MpsConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_active_thread_percentage: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_pinned_device_memory_limit: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub per_device_pinned_memory_limit: BTreeMap<String, String>,
    /// What the share may burst to, in percent of the GPU's SMs: its `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`.
    /// The `compute` capacity request stays what the scheduler packs; absent, the ceiling is the request
    /// (a guaranteed share). See [`check_ceiling`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_ceiling: Option<u32>,
}

/// Time-slicing settings (whole GPUs only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TimeSlicingConfig {
    pub interval: TimeSliceInterval,
}

/// `nvidia-smi compute-policy --set-timeslice` value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimeSliceInterval {
    #[default]
    Default,
    Short,
    Medium,
    Long,
}

const TOP_FIELDS: &[&str] = &["apiVersion", "kind", "sharing"];
const SHARING_FIELDS: &[&str] = &["strategy", "mps", "timeSlicing"];
const MPS_FIELDS: &[&str] = &[
    "defaultActiveThreadPercentage",
    "defaultPinnedDeviceMemoryLimit",
    "perDevicePinnedMemoryLimit",
    "computeCeiling",
];
const TIME_SLICING_FIELDS: &[&str] = &["interval"];
const KINDS: &[&str] = &[KIND_GPU_CONFIG, KIND_MIG_CONFIG];
const STRATEGIES: &[&str] = &["MPS", "TimeSlicing"];
const INTERVALS: &[&str] = &["Default", "Short", "Medium", "Long"];

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

type Object = serde_json::Map<String, Value>;

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_string()
    } else {
        format!("{path}.{field}")
    }
}

/// Checks that `v` is an object with only `allowed` fields.
fn object<'v>(v: &'v Value, path: &str, allowed: &'static [&'static str]) -> Result<&'v Object> {
    let obj = v.as_object().ok_or_else(|| ConfigError::NotAnObject {
        path: if path.is_empty() {
            "parameters".into()
        } else {
            path.into()
        },
        got: type_name(v),
    })?;
    if let Some(field) = obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(ConfigError::UnknownField {
            path: if path.is_empty() {
                "parameters".into()
            } else {
                path.into()
            },
            field: echo(field),
            allowed,
        });
    }
    Ok(obj)
}

/// The field unless absent or `null` (YAML `~`), which both mean "not set".
fn field<'v>(obj: &'v Object, name: &str) -> Option<&'v Value> {
    obj.get(name).filter(|v| !v.is_null())
}

fn string<'v>(v: &'v Value, path: &str) -> Result<&'v str> {
    v.as_str().ok_or_else(|| ConfigError::WrongType {
        path: path.to_string(),
        expected: "a string",
        got: type_name(v),
    })
}

fn enum_value(v: &Value, path: &str, allowed: &'static [&'static str]) -> Result<usize> {
    let s = string(v, path)?;
    allowed
        .iter()
        .position(|a| *a == s)
        .ok_or_else(|| ConfigError::NotOneOf {
            path: path.to_string(),
            got: echo(s),
            allowed,
        })
}

/// Quantities may be written as YAML numbers (`1073741824`) or strings (`1Gi`).
fn quantity_string(v: &Value, path: &str) -> Result<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        other => Err(ConfigError::WrongType {
            path: path.to_string(),
            expected: "a quantity (e.g. 10Gi)",
            got: type_name(other),
        }),
    }
}

/// Decodes one opaque `parameters` object strictly; the result still needs [`DeviceConfig::normalize`] and
/// [`DeviceConfig::validate`] ([`decode`] does all three).
pub fn decode_strict(raw: &Value) -> Result<DeviceConfig> {
    let top = object(raw, "", TOP_FIELDS)?;
    let api_version = field(top, "apiVersion").ok_or(ConfigError::MissingField {
        path: "apiVersion".into(),
    })?;
    let api_version = string(api_version, "apiVersion")?;
    if api_version != GROUP_VERSION {
        return Err(ConfigError::NotOneOf {
            path: "apiVersion".into(),
            got: echo(api_version),
            allowed: &[GROUP_VERSION],
        });
    }
    let kind = field(top, "kind").ok_or(ConfigError::MissingField { path: "kind".into() })?;
    let kind = enum_value(kind, "kind", KINDS)?;
    let sharing = field(top, "sharing").map(decode_sharing).transpose()?;
    Ok(match KINDS[kind] {
        KIND_GPU_CONFIG => DeviceConfig::GpuConfig(GpuConfig { sharing }),
        _ => DeviceConfig::MigConfig(MigConfig { sharing }),
    })
}

fn decode_sharing(v: &Value) -> Result<Sharing> {
    let obj = object(v, "sharing", SHARING_FIELDS)?;
    let strategy = field(obj, "strategy").ok_or(ConfigError::MissingField {
        path: "sharing.strategy".into(),
    })?;
    let strategy = match enum_value(strategy, "sharing.strategy", STRATEGIES)? {
        0 => SharingStrategy::Mps,
        _ => SharingStrategy::TimeSlicing,
    };
    let mps = field(obj, "mps").map(decode_mps).transpose()?;
    let time_slicing = field(obj, "timeSlicing")
        .map(|v| {
            let ts = object(v, "sharing.timeSlicing", TIME_SLICING_FIELDS)?;
            let interval = match field(ts, "interval") {
                None => TimeSliceInterval::Default,
                Some(i) => match enum_value(i, "sharing.timeSlicing.interval", INTERVALS)? {
                    0 => TimeSliceInterval::Default,
                    1 => TimeSliceInterval::Short,
                    2 => TimeSliceInterval::Medium,
                    _ => TimeSliceInterval::Long,
                },
            };
            Ok(TimeSlicingConfig { interval })
        })
        .transpose()?;
    Ok(Sharing {
        strategy,
        mps,
        time_slicing,
    })
}

fn decode_mps(v: &Value) -> Result<MpsConfig> {
    const PATH: &str = "sharing.mps";
    let obj = object(v, PATH, MPS_FIELDS)?;
    let default_active_thread_percentage = percentage(obj, PATH, "defaultActiveThreadPercentage")?;
    let compute_ceiling = percentage(obj, PATH, "computeCeiling")?;
    let default_pinned_device_memory_limit = field(obj, "defaultPinnedDeviceMemoryLimit")
        .map(|q| quantity_string(q, &join(PATH, "defaultPinnedDeviceMemoryLimit")))
        .transpose()?;
    let mut per_device_pinned_memory_limit = BTreeMap::new();
    if let Some(map) = field(obj, "perDevicePinnedMemoryLimit") {
        let path = join(PATH, "perDevicePinnedMemoryLimit");
        let map = map.as_object().ok_or(ConfigError::WrongType {
            path: path.clone(),
            expected: "a map of device name to quantity",
            got: type_name(map),
        })?;
        for (k, q) in map {
            per_device_pinned_memory_limit.insert(k.clone(), quantity_string(q, &keyed(&path, k))?);
        }
    }
    Ok(MpsConfig {
        default_active_thread_percentage,
        default_pinned_device_memory_limit,
        per_device_pinned_memory_limit,
        compute_ceiling,
    })
}

/// An integer percentage field of `obj` (1–100), absent or `null` as `None`.
fn percentage(obj: &Object, parent: &str, name: &str) -> Result<Option<u32>> {
    let path = join(parent, name);
    let Some(n) = field(obj, name) else {
        return Ok(None);
    };
    let out_of_range = |got: String| ConfigError::OutOfRange {
        path: path.clone(),
        min: 1,
        max: 100,
        got,
    };
    let got = match (n.as_i64(), n) {
        (Some(got), _) => got,
        // A whole number past i64 (2^64, 1e30) is a number out of range, not a wrong type.
        (None, Value::Number(num))
            if num.as_u64().is_some() || num.as_f64().is_some_and(|f| f.fract() == 0.0) =>
        {
            return Err(out_of_range(num.to_string()));
        }
        (None, n) => {
            return Err(ConfigError::WrongType {
                path,
                expected: "an integer",
                got: match n {
                    Value::Number(_) => "a fraction",
                    other => type_name(other),
                },
            });
        }
    };
    if !(1..=100).contains(&got) {
        return Err(out_of_range(got.to_string()));
    }
    Ok(Some(got as u32))
}

/// Decodes, normalizes and validates one opaque `parameters` object.
pub fn decode(raw: &Value) -> Result<DeviceConfig> {
    let mut config = decode_strict(raw)?;
    config.normalize();
    config.validate()?;
    Ok(config)
}

/// Decodes like [`decode`], but reports every problem of the config at once instead of the first: after
/// each error the offending field is set aside and the rest is decoded again, so a user fixes a config in
/// one round trip. Stops at a problem nothing else can be judged without (not an object, no or another
/// `apiVersion` or `kind`, no `sharing.strategy`).
pub fn decode_all(raw: &Value) -> Result<DeviceConfig, Vec<ConfigError>> {
    // Each round removes one field, so a config has at most as many rounds as it has fields; the bound
    // only guards against a removal that does not take.
    const MAX_ROUNDS: usize = 64;
    let mut value = raw.clone();
    let mut errors = Vec::new();
    for _ in 0..MAX_ROUNDS {
        match decode(&value) {
            Ok(config) if errors.is_empty() => return Ok(config),
            Ok(_) => return Err(errors),
            Err(e) => {
                let removed = set_aside(&mut value, &e);
                errors.push(e);
                if !removed {
                    break;
                }
            }
        }
    }
    Err(errors)
}

/// Removes what `error` is about from `value`; false when it cannot be removed (a required field, or a
/// name cut short in the message).
fn set_aside(value: &mut Value, error: &ConfigError) -> bool {
    use ConfigError as E;
    const REQUIRED: &[&str] = &["apiVersion", "kind", "sharing.strategy"];
    let path = match error {
        E::UnknownField { path, field, .. } if path == "parameters" => field.clone(),
        E::UnknownField { path, field, .. } => join(path, field),
        E::NotAnObject { path, .. } if path == "parameters" => return false,
        E::BadDeviceKey { path, key } => format!("{path}[{key:?}]"),
        E::TimeSlicingOnMig => "sharing.timeSlicing".into(),
        E::CeilingAboveDaemonDefault { .. } => "sharing.mps.computeCeiling".into(),
        E::NotAnObject { path, .. }
        | E::WrongType { path, .. }
        | E::NotOneOf { path, .. }
        | E::OutOfRange { path, .. }
        | E::InvalidQuantity { path, .. }
        | E::MemoryLimitTooSmall { path, .. }
        | E::MemoryLimitTooLarge { path, .. }
        | E::SettingsForOtherStrategy { path, .. } => path.clone(),
        _ => return false,
    };
    if REQUIRED.contains(&path.as_str()) {
        return false;
    }
    remove_path(value, &path)
}

/// Removes the field at `path` (`a.b.c` or `a.b["key"]`); false when there is none.
fn remove_path(value: &mut Value, path: &str) -> bool {
    let (parent, last) = match path.strip_suffix(']').and_then(|p| p.split_once('[')) {
        Some((parent, key)) => match serde_json::from_str::<String>(key) {
            Ok(key) => (parent.to_string(), key),
            Err(_) => return false,
        },
        None => match path.rsplit_once('.') {
            Some((parent, last)) => (parent.to_string(), last.to_string()),
            None => (String::new(), path.to_string()),
        },
    };
    let mut at = value;
    for segment in parent.split('.').filter(|s| !s.is_empty()) {
        match at.get_mut(segment) {
            Some(next) => at = next,
            None => return false,
        }
    }
    at.as_object_mut().is_some_and(|o| o.remove(&last).is_some())
}

/// The allocation's configuration entries with the request lists the claim wrote. kube-scheduler clears
/// an entry's `requests` in `status.allocation.devices.config` when it names every request of the claim,
/// which would make a config the user aimed at a request look untargeted (and a config of the wrong kind
/// for the device be skipped instead of refused). The claim's own entries (`FromClaim`) are copied in the
/// order of `spec.devices.config`, so the i-th one gets the i-th spec entry's list; a class's entries
/// (`FromClass`) always name the requests of that class, so an empty one named them all.
pub fn targets_as_written(
    claim: &k8s_openapi::api::resource::v1::ResourceClaim,
) -> Vec<DeviceAllocationConfiguration> {
    let allocated = claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.config.clone())
        .unwrap_or_default();
    let spec = claim.spec.as_ref().and_then(|s| s.devices.as_ref());
    let written = spec.and_then(|d| d.config.as_deref()).unwrap_or_default();
    let every_request: Vec<String> = spec
        .and_then(|d| d.requests.as_deref())
        .unwrap_or_default()
        .iter()
        .map(|r| r.name.clone())
        .collect();
    let from_claim = allocated.iter().filter(|e| e.source == SOURCE_FROM_CLAIM).count();
    let mut claim_entries = written.iter();
    allocated
        .into_iter()
        .map(|mut entry| {
            let cleared = entry.requests.as_deref().is_none_or(|r| r.is_empty());
            if entry.source == SOURCE_FROM_CLAIM {
                let as_written = claim_entries.next();
                // Entries that do not line up (an API server copying differently) are left as they are.
                if from_claim == written.len()
                    && let Some(w) = as_written
                {
                    entry.requests = w.requests.clone().filter(|r| !r.is_empty());
                }
            } else if entry.source == SOURCE_FROM_CLASS && cleared && !every_request.is_empty() {
                entry.requests = Some(every_request.clone());
            }
            entry
        })
        .collect()
}

/// Checks the strategy a config asks for against `serves`, the strategy the shared `device` is published
/// with. The published strategy is the one the device serves to every claim sharing it: a claim may only
/// agree with it, so one claim can never switch a GPU that other claims' shares are placed on.
pub fn check_strategy(
    config: Option<&DeviceConfig>,
    serves: SharingStrategy,
    device: &DeviceName,
) -> Result<()> {
    match config.and_then(|c| c.sharing()) {
        Some(sharing) if sharing.strategy != serves => Err(ConfigError::StrategyNotServed {
            device: device.to_string(),
            serves: serves.as_str(),
            asked: sharing.strategy.as_str(),
        }),
        _ => Ok(()),
    }
}

impl DeviceConfig {
    /// The `kind` string.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::GpuConfig(_) => KIND_GPU_CONFIG,
            Self::MigConfig(_) => KIND_MIG_CONFIG,
        }
    }

    pub fn sharing(&self) -> Option<&Sharing> {
        match self {
            Self::GpuConfig(c) => c.sharing.as_ref(),
            Self::MigConfig(c) => c.sharing.as_ref(),
        }
    }

    fn sharing_mut(&mut self) -> Option<&mut Sharing> {
        match self {
            Self::GpuConfig(c) => c.sharing.as_mut(),
            Self::MigConfig(c) => c.sharing.as_mut(),
        }
    }

    /// The config used when none applies: no sharing settings of the right kind for the device.
    pub fn default_for(device: &DeviceName) -> Self {
        if is_mig(device) {
            Self::MigConfig(MigConfig::default())
        } else {
            Self::GpuConfig(GpuConfig::default())
        }
    }

    /// Canonicalizes the config so equal meanings compare equal: quantities trimmed, and the settings block
    /// of the chosen strategy filled in with defaults when absent.
    pub fn normalize(&mut self) {
        let is_gpu = matches!(self, Self::GpuConfig(_));
        let Some(sharing) = self.sharing_mut() else { return };
        if let Some(mps) = sharing.mps.as_mut() {
            if let Some(q) = mps.default_pinned_device_memory_limit.as_mut() {
                *q = q.trim().to_string();
            }
            for q in mps.per_device_pinned_memory_limit.values_mut() {
                *q = q.trim().to_string();
            }
        }
        match sharing.strategy {
            SharingStrategy::Mps if sharing.mps.is_none() => sharing.mps = Some(MpsConfig::default()),
            SharingStrategy::TimeSlicing if is_gpu && sharing.time_slicing.is_none() => {
                sharing.time_slicing = Some(TimeSlicingConfig::default())
            }
            _ => {}
        }
    }

    /// Checks the semantic rules; see the module documentation for the messages.
    pub fn validate(&self) -> Result<()> {
        let Some(sharing) = self.sharing() else {
            return Ok(());
        };
        let mig = matches!(self, Self::MigConfig(_));
        if sharing.time_slicing.is_some() {
            if mig {
                return Err(ConfigError::TimeSlicingOnMig);
            }
            if sharing.strategy != SharingStrategy::TimeSlicing {
                return Err(ConfigError::SettingsForOtherStrategy {
                    path: "sharing.timeSlicing".into(),
                    needs: "TimeSlicing",
                    got: sharing.strategy.as_str(),
                });
            }
        }
        if mig && sharing.strategy == SharingStrategy::TimeSlicing {
            return Err(ConfigError::TimeSlicingStrategyOnMig);
        }
        let Some(mps) = &sharing.mps else { return Ok(()) };
        if sharing.strategy != SharingStrategy::Mps {
            return Err(ConfigError::SettingsForOtherStrategy {
                path: "sharing.mps".into(),
                needs: "MPS",
                got: sharing.strategy.as_str(),
            });
        }
        if let Some(p) = mps.default_active_thread_percentage
            && !(1..=100).contains(&p)
        {
            return Err(ConfigError::OutOfRange {
                path: "sharing.mps.defaultActiveThreadPercentage".into(),
                min: 1,
                max: 100,
                got: p.to_string(),
            });
        }
        if let Some(c) = mps.compute_ceiling
            && !(1..=100).contains(&c)
        {
            return Err(ConfigError::OutOfRange {
                path: "sharing.mps.computeCeiling".into(),
                min: 1,
                max: 100,
                got: c.to_string(),
            });
        }
        if let (Some(ceiling), Some(default)) = (mps.compute_ceiling, mps.default_active_thread_percentage)
            && ceiling > default
        {
            return Err(ConfigError::CeilingAboveDaemonDefault { ceiling, default });
        }
        if let Some(q) = &mps.default_pinned_device_memory_limit {
            memory_limit(q, "sharing.mps.defaultPinnedDeviceMemoryLimit")?;
        }
        let path = "sharing.mps.perDevicePinnedMemoryLimit";
        for (k, q) in &mps.per_device_pinned_memory_limit {
            if k.parse::<DeviceName>().is_err() {
                return Err(ConfigError::BadDeviceKey {
                    path: path.into(),
                    key: echo(k),
                });
            }
            memory_limit(q, &keyed(path, k))?;
        }
        Ok(())
    }
}

/// The path of a map entry, `<path>["<key>"]`, with the key cut as [`echo`] does.
fn keyed(path: &str, key: &str) -> String {
    format!("{path}[{:?}]", echo(key))
}

fn memory_limit(q: &str, path: &str) -> Result<u64> {
    let bytes = parse_quantity(q).map_err(|source| ConfigError::InvalidQuantity {
        path: path.to_string(),
        value: echo(q),
        source,
    })?;
    if bytes < MIN_PINNED_MEMORY_BYTES {
        return Err(ConfigError::MemoryLimitTooSmall {
            path: path.to_string(),
            value: echo(q),
        });
    }
    if bytes > MAX_PINNED_MEMORY_BYTES {
        return Err(ConfigError::MemoryLimitTooLarge {
            path: path.to_string(),
            value: echo(q),
        });
    }
    Ok(bytes)
}

/// Memory of `device` on this node in bytes, or why the node has no such device.
fn device_memory(gpus: &[GpuInfo], device: &DeviceName) -> Result<u64, String> {
    let index = device.gpu();
    let gpu = gpus.iter().find(|g| g.index == index).ok_or_else(|| {
        let have: Vec<String> = gpus.iter().map(|g| format!("gpu-{}", g.index)).collect();
        format!(
            "there is no GPU {index} (the node has {})",
            if have.is_empty() {
                "no GPUs".to_string()
            } else {
                have.join(", ")
            }
        )
    })?;
    match device {
        DeviceName::Mig { profile, start, .. } | DeviceName::SharedMig { profile, start, .. } => {
            let info = gpu
                .mig
                .as_ref()
                .and_then(|m| m.profile(profile))
                .ok_or_else(|| format!("gpu-{index} has no MIG profile {profile}"))?;
            if !info.placements.iter().any(|p| p.start == *start) {
                return Err(format!(
                    "gpu-{index} has no {profile} placement starting at memory slice {start}"
                ));
            }
            Ok(info.memory_mib << 20)
        }
        _ => Ok(gpu.memory_bytes),
    }
}

impl DeviceConfig {
    /// Checks a validated config against the node it is prepared on (`gpus`, as discovered) for
    /// `device`, the device being prepared: every `perDevicePinnedMemoryLimit` key names a device of this
    /// node, and no memory limit is more than the memory of the device it applies to.
    pub fn check_on_node(&self, gpus: &[GpuInfo], device: &DeviceName) -> Result<()> {
        let Some(mps) = self.sharing().and_then(|s| s.mps.as_ref()) else {
            return Ok(());
        };
        const PATH: &str = "sharing.mps.perDevicePinnedMemoryLimit";
        let above = |path: String, q: &str, device: &DeviceName, memory: u64| {
            let bytes = parse_quantity(q).unwrap_or(u64::MAX);
            (bytes > memory).then(|| ConfigError::MemoryLimitAboveDevice {
                path,
                value: echo(q),
                device: device.to_string(),
                memory_mib: memory >> 20,
            })
        };
        for (k, q) in &mps.per_device_pinned_memory_limit {
            let Ok(named) = k.parse::<DeviceName>() else {
                return Err(ConfigError::BadDeviceKey {
                    path: PATH.into(),
                    key: echo(k),
                });
            };
            let memory = device_memory(gpus, &named).map_err(|why| ConfigError::DeviceNotOnNode {
                path: PATH.into(),
                key: echo(k),
                why,
            })?;
            if let Some(e) = above(keyed(PATH, k), q, &named, memory) {
                return Err(e);
            }
        }
        if let (Some(q), Ok(memory)) = (
            &mps.default_pinned_device_memory_limit,
            device_memory(gpus, device),
        ) && !mps
            .per_device_pinned_memory_limit
            .contains_key(&device.to_string())
            && let Some(e) = above(
                "sharing.mps.defaultPinnedDeviceMemoryLimit".into(),
                q,
                device,
                memory,
            )
        {
            return Err(e);
        }
        Ok(())
    }
}

/// Checks the compute ceiling of `config` against the device it applies to and the share's compute
/// request (`request`, percent of the GPU, as `capacity.requests.compute` or the consumed capacity says;
/// `None` or 0 when the share reserved no compute). A ceiling is an MPS client's thread percentage, so it
/// means something only on a share served through MPS: a whole GPU or an unshared MIG device runs its one
/// claim with all of its SMs, and a share slot's MPS daemon starts with the slot's size as its default,
/// which a client can only lower. `device` is `None` where it is not known (the webhook, before
/// allocation, for a class it cannot read); a config that is not MPS has no ceiling (the decoder refuses
/// `sharing.mps` with another strategy).
pub fn check_ceiling(
    config: Option<&DeviceConfig>,
    device: Option<&DeviceName>,
    request: Option<u64>,
) -> Result<()> {
    let Some(ceiling) = config
        .and_then(|c| c.sharing())
        .and_then(|s| s.mps.as_ref())
        .and_then(|m| m.compute_ceiling)
    else {
        return Ok(());
    };
    let why = match device {
        Some(DeviceName::Gpu { .. }) => Some("a whole GPU runs its one claim on all of its SMs"),
        Some(DeviceName::Mig { .. }) => {
            Some("an unshared MIG device runs its one claim on all of its SMs, without MPS")
        }
        Some(DeviceName::ShareSlot { .. }) => Some(
            "a share slot's MPS daemon starts with the slot's size as every client's limit, which a client can only lower",
        ),
        _ => None,
    };
    if let (Some(why), Some(device)) = (why, device) {
        return Err(ConfigError::CeilingMeansNothing {
            device_kind: device_kind(device),
            device: device.to_string(),
            why,
        });
    }
    match request {
        Some(request) if request > u64::from(ceiling) => {
            Err(ConfigError::CeilingBelowRequest { ceiling, request })
        }
        _ => Ok(()),
    }
}

impl MpsConfig {
    /// Pinned device-memory limit in bytes for `device`: its per-device entry, else the default. Call on a
    /// validated config (quantities parse).
    pub fn pinned_limit_bytes(&self, device: &str) -> Option<u64> {
        self.per_device_pinned_memory_limit
            .get(device)
            .or(self.default_pinned_device_memory_limit.as_ref())
            .and_then(|q| parse_quantity(q).ok())
    }
}

impl TimeSliceInterval {
    /// `nvidia-smi compute-policy --set-timeslice` argument.
    pub fn as_index(self) -> u8 {
        self as u8
    }
}

fn is_mig(device: &DeviceName) -> bool {
    matches!(device, DeviceName::Mig { .. } | DeviceName::SharedMig { .. })
}

fn device_kind(device: &DeviceName) -> &'static str {
    match device {
        DeviceName::Gpu { .. } => "whole GPU",
        DeviceName::Mig { .. } => "MIG device",
        DeviceName::SharedGpu { .. } | DeviceName::ShareSlot { .. } => "GPU share",
        DeviceName::SharedMig { .. } => "MIG share",
    }
}

/// True when `config` is the kind for `device`.
pub fn fits(config: &DeviceConfig, device: &DeviceName) -> bool {
    matches!(config, DeviceConfig::MigConfig(_)) == is_mig(device)
}

fn check_fits(config: &DeviceConfig, device: &DeviceName) -> Result<()> {
    if fits(config, device) {
        return Ok(());
    }
    Err(ConfigError::WrongKindForDevice {
        kind: config.kind(),
        device_kind: device_kind(device),
        device: device.to_string(),
        use_kind: if is_mig(device) {
            KIND_MIG_CONFIG
        } else {
            KIND_GPU_CONFIG
        },
    })
}

/// True when a config entry listing `listed` applies to the allocation result of `request`. A result of a
/// subrequest is named `<request>/<subrequest>`; an entry naming the parent request covers it.
fn names_request(listed: &str, request: &str) -> bool {
    listed == request
        || request
            .split_once('/')
            .is_some_and(|(parent, _)| parent == listed)
}

/// The configuration that applies to the device allocated for `request`, from the allocation's
/// `status.allocation.devices.config` entries (in order). `None` when no entry of this driver applies.
///
/// Every applicable entry is decoded and validated, not only the winner, so a broken lower-precedence entry
/// is reported instead of lying in wait.
pub fn effective_config(
    entries: &[DeviceAllocationConfiguration],
    request: &str,
    device: &DeviceName,
) -> Result<Option<DeviceConfig>> {
    let mut best: Option<((u8, u8, usize), DeviceConfig)> = None;
    for (i, entry) in entries.iter().enumerate() {
        let Some(opaque) = &entry.opaque else { continue };
        if opaque.driver != DRIVER_NAME {
            continue;
        }
        let source_rank = match entry.source.as_str() {
            SOURCE_FROM_CLASS => 0,
            SOURCE_FROM_CLAIM => 1,
            other => return Err(ConfigError::UnknownSource(echo(other))),
        };
        let requests = entry.requests.as_deref().unwrap_or_default();
        let targeted = !requests.is_empty();
        if targeted && !requests.iter().any(|r| names_request(r, request)) {
            continue;
        }
        let config = decode(&opaque.parameters.0)?;
        if targeted {
            check_fits(&config, device)?;
        } else if !fits(&config, device) {
            continue;
        }
        let rank = (source_rank, u8::from(targeted), i);
        if best.as_ref().is_none_or(|(r, _)| rank > *r) {
            best = Some((rank, config));
        }
    }
    Ok(best.map(|(_, c)| c))
}

/// serde_json's nesting limit: a ResourceClaim whose opaque parameters nest deeper cannot be read at all.
pub const JSON_NESTING_LIMIT: usize = 128;

/// The message to report when reading a ResourceClaim failed with `error` because its opaque
/// configuration nests too deep (serde_json's `recursion limit exceeded`), naming the configuration;
/// `None` for any other error. The API server stores such claims (it allows far deeper JSON), so the
/// plugin is the first to trip over them, before [`decode`] ever sees the parameters.
pub fn too_deep_config_message(error: &str) -> Option<String> {
    error.contains("recursion limit exceeded").then(|| {
        format!(
            "its opaque configuration (status.allocation.devices.config[].opaque.parameters, from the claim \
             or its DeviceClass) nests deeper than {JSON_NESTING_LIMIT} levels and cannot be read; a {KIND_GPU_CONFIG} \
             or {KIND_MIG_CONFIG} nests at most 4"
        )
    })
}

/// Why a quantity string does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("empty")]
    Empty,
    #[error("must start with a non-negative number")]
    NoNumber,
    #[error("unknown suffix {0:?}; use Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E or none (bytes)")]
    UnknownSuffix(String),
    #[error("too large")]
    Overflow,
}

/// Parses a Kubernetes quantity into a whole number (bytes, or a plain count): binary suffixes `Ki Mi Gi Ti
/// Pi Ei`, decimal suffixes `k M G T P E`, or none; a decimal fraction is allowed (`1.5Gi`) and rounds up,
/// as `Quantity.Value()` does. Milli (`m`) and exponent forms are rejected: a fraction of a byte or percent
/// is never what a user meant.
pub fn parse_quantity(s: &str) -> Result<u64, QuantityError> {
    let s = s.trim();
    if s.is_empty() {
        return Err(QuantityError::Empty);
    }
    let s = s.strip_prefix('+').unwrap_or(s);
    let num_end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(num_end);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') {
        return Err(QuantityError::NoNumber);
    }
    let multiplier: u128 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        other => return Err(QuantityError::UnknownSuffix(echo(other))),
    };
    if frac.len() > 18 || int.len() > 20 {
        return Err(QuantityError::Overflow);
    }
    let int: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| QuantityError::Overflow)?
    };
    let scale = 10u128.pow(frac.len() as u32);
    let frac: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().map_err(|_| QuantityError::NoNumber)?
    };
    let whole = int.checked_mul(multiplier).ok_or(QuantityError::Overflow)?;
    let part = (frac.checked_mul(multiplier).ok_or(QuantityError::Overflow)?).div_ceil(scale);
    u64::try_from(whole + part).map_err(|_| QuantityError::Overflow)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::resource::v1::OpaqueDeviceConfiguration, apimachinery::pkg::runtime::RawExtension,
    };
    use serde_json::json;

    use super::*;

    fn gpu(sharing: Value) -> Value {
        json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig", "sharing": sharing})
    }

    fn mig(sharing: Value) -> Value {
        json!({"apiVersion": GROUP_VERSION, "kind": "MigConfig", "sharing": sharing})
    }

    /// Every documented message, produced by a config that triggers it.
    #[test]
    fn each_bad_config_gives_its_documented_message() {
        let cases: Vec<(Value, &str)> = vec![
            (json!("GpuConfig"), "parameters: must be an object, got a string"),
            (
                json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig", "sharng": {}}),
                "parameters: unknown field \"sharng\"; allowed fields: apiVersion, kind, sharing",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "1Ei"}})),
                "sharing.mps.defaultPinnedDeviceMemoryLimit: must be at most 1Ti (more memory than any GPU \
                 has), got \"1Ei\"",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"activeThreads": 5}})),
                "sharing.mps: unknown field \"activeThreads\"; allowed fields: defaultActiveThreadPercentage, \
                 defaultPinnedDeviceMemoryLimit, perDevicePinnedMemoryLimit",
            ),
            (
                gpu(json!({"strategy": "MPS", "mpsConfig": {}})),
                "sharing: unknown field \"mpsConfig\"; allowed fields: strategy, mps, timeSlicing",
            ),
            (
                gpu(json!({"strategy": "TimeSlicing", "timeSlicing": {"intervl": "Long"}})),
                "sharing.timeSlicing: unknown field \"intervl\"; allowed fields: interval",
            ),
            (
                json!({"kind": "GpuConfig"}),
                "apiVersion: required field is missing",
            ),
            (
                json!({"apiVersion": GROUP_VERSION}),
                "kind: required field is missing",
            ),
            (gpu(json!({})), "sharing.strategy: required field is missing"),
            (gpu(json!("MPS")), "sharing: must be an object, got a string"),
            (
                json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}),
                "apiVersion: must be \"gpu.tessera.dev/v1alpha1\", got \"resource.nvidia.com/v1beta1\"",
            ),
            (
                json!({"apiVersion": GROUP_VERSION, "kind": "MigDeviceConfig"}),
                "kind: must be one of GpuConfig, MigConfig, got \"MigDeviceConfig\"",
            ),
            (
                json!({"apiVersion": GROUP_VERSION, "kind": 3}),
                "kind: must be a string, got a number",
            ),
            (
                gpu(json!({"strategy": "mps"})),
                "sharing.strategy: must be one of MPS, TimeSlicing, got \"mps\"",
            ),
            (
                gpu(json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": 2}})),
                "sharing.timeSlicing.interval: must be a string, got a number",
            ),
            (
                gpu(json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": "VeryLong"}})),
                "sharing.timeSlicing.interval: must be one of Default, Short, Medium, Long, got \"VeryLong\"",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 150}})),
                "sharing.mps.defaultActiveThreadPercentage: must be between 1 and 100, got 150",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 0}})),
                "sharing.mps.defaultActiveThreadPercentage: must be between 1 and 100, got 0",
            ),
            (
                gpu(
                    json!({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 18446744073709551615u64}}),
                ),
                "sharing.mps.defaultActiveThreadPercentage: must be between 1 and 100, got 18446744073709551615",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 1e30}})),
                "sharing.mps.defaultActiveThreadPercentage: must be between 1 and 100, got 1e+30",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 25.5}})),
                "sharing.mps.defaultActiveThreadPercentage: must be an integer, got a fraction",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": "50%"}})),
                "sharing.mps.defaultActiveThreadPercentage: must be an integer, got a string",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "10GB"}})),
                "sharing.mps.defaultPinnedDeviceMemoryLimit: invalid quantity \"10GB\": unknown suffix \"GB\"; \
                 use Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E or none (bytes)",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "-1Gi"}})),
                "sharing.mps.defaultPinnedDeviceMemoryLimit: invalid quantity \"-1Gi\": must start with a \
                 non-negative number",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": "0"}})),
                "sharing.mps.defaultPinnedDeviceMemoryLimit: must be at least 1Mi, got \"0\"",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": true}})),
                "sharing.mps.defaultPinnedDeviceMemoryLimit: must be a quantity (e.g. 10Gi), got a boolean",
            ),
            (
                gpu(
                    json!({"strategy": "MPS", "mps": {"perDevicePinnedMemoryLimit": {"gpu-0-shared": "512Ki"}}}),
                ),
                "sharing.mps.perDevicePinnedMemoryLimit[\"gpu-0-shared\"]: must be at least 1Mi, got \"512Ki\"",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"perDevicePinnedMemoryLimit": {"0": "1Gi"}}})),
                "sharing.mps.perDevicePinnedMemoryLimit: key \"0\" is not a tessera device name",
            ),
            (
                gpu(json!({"strategy": "MPS", "mps": {"perDevicePinnedMemoryLimit": ["1Gi"]}})),
                "sharing.mps.perDevicePinnedMemoryLimit: must be a map of device name to quantity, got a list",
            ),
            (
                gpu(json!({"strategy": "TimeSlicing", "mps": {"defaultActiveThreadPercentage": 50}})),
                "sharing.mps: only allowed with strategy MPS, got TimeSlicing",
            ),
            (
                gpu(json!({"strategy": "MPS", "timeSlicing": {"interval": "Long"}})),
                "sharing.timeSlicing: only allowed with strategy TimeSlicing, got MPS",
            ),
            (
                mig(json!({"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}})),
                "sharing.timeSlicing: MIG devices have no time-slice setting; remove it or use GpuConfig",
            ),
        ];
        for (raw, want) in cases {
            let err = decode(&raw).expect_err(&raw.to_string()).to_string();
            assert!(err.contains(want), "config {raw}\n  got:  {err}\n  want: {want}");
        }
    }

    /// Issue 16 item 6: an unknown top-level field had an empty path (`: unknown field "sharng"`).
    #[test]
    fn an_unknown_top_level_field_is_reported_under_parameters() {
        let err =
            decode(&json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig", "sharng": {}})).unwrap_err();
        assert_eq!(
            err.to_string(),
            "parameters: unknown field \"sharng\"; allowed fields: apiVersion, kind, sharing"
        );
    }

    /// Issue 16 item 6: `1Ei` was accepted and MPS was told `1099511627776M` on an 81,559 MiB GPU.
    #[test]
    fn a_pinned_memory_limit_above_any_gpus_memory_is_rejected_before_the_node_is_known() {
        let limit = |q: &str| gpu(json!({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": q}}));
        assert!(decode(&limit("1Ti")).is_ok(), "the bound itself is allowed");
        for q in ["1Ei", "1025Gi", "2T"] {
            let err = decode(&limit(q)).unwrap_err();
            assert!(
                matches!(err, ConfigError::MemoryLimitTooLarge { .. }),
                "{q}: {err}"
            );
        }
        let per_device =
            gpu(json!({"strategy": "MPS", "mps": {"perDevicePinnedMemoryLimit": {"gpu-0-shared": "1Pi"}}}));
        assert_eq!(
            decode(&per_device).unwrap_err().to_string(),
            "sharing.mps.perDevicePinnedMemoryLimit[\"gpu-0-shared\"]: must be at most 1Ti (more memory than \
             any GPU has), got \"1Pi\""
        );
    }

    /// Two 80 GiB GPUs; GPU 0 offers 3g.40gb at memory slices 0 and 4.
    fn node_gpus() -> Vec<GpuInfo> {
        let mig = crate::inventory::MigInfo {
            enabled: true,
            profiles: vec![crate::MigProfileInfo {
                name: "3g.40gb".into(),
                memory_mib: 40_320,
                placements: vec![
                    crate::MigPlacement { start: 0, size: 4 },
                    crate::MigPlacement { start: 4, size: 4 },
                ],
                ..Default::default()
            }],
            ..Default::default()
        };
        (0..2)
            .map(|index| GpuInfo {
                index,
                memory_bytes: 80 << 30,
                mig: (index == 0).then(|| mig.clone()),
                healthy: true,
                ..Default::default()
            })
            .collect()
    }

    fn on_node(mps: Value, device: &str) -> Result<()> {
        decode(&gpu(json!({"strategy": "MPS", "mps": mps})))
            .expect("statically valid")
            .check_on_node(&node_gpus(), &device.parse().unwrap())
    }

    /// Issue 16 item 6: a `perDevicePinnedMemoryLimit` key for a device not on the node was accepted.
    #[test]
    fn at_prepare_a_key_naming_a_device_not_on_the_node_is_an_error_naming_the_key() {
        let key = |k: &str| json!({"perDevicePinnedMemoryLimit": {k: "10Gi"}});
        for (k, why) in [
            ("gpu-9-shared", "there is no GPU 9 (the node has gpu-0, gpu-1)"),
            ("gpu-0-mig-7g-80gb-0-shared", "gpu-0 has no MIG profile 7g.80gb"),
            (
                "gpu-0-mig-3g-40gb-2-shared",
                "gpu-0 has no 3g.40gb placement starting at memory slice 2",
            ),
            ("gpu-1-mig-3g-40gb-0", "gpu-1 has no MIG profile 3g.40gb"),
        ] {
            let err = on_node(key(k), "gpu-0-shared").unwrap_err().to_string();
            assert_eq!(
                err,
                format!(
                    "sharing.mps.perDevicePinnedMemoryLimit: key {k:?} names no device on this node: {why}"
                )
            );
        }
        assert_eq!(on_node(key("gpu-1-shared"), "gpu-0-shared"), Ok(()));
        assert_eq!(on_node(key("gpu-0-mig-3g-40gb-4-shared"), "gpu-0-shared"), Ok(()));
    }

    #[test]
    fn at_prepare_a_limit_above_the_devices_memory_is_an_error() {
        assert_eq!(
            on_node(
                json!({"perDevicePinnedMemoryLimit": {"gpu-1-shared": "81Gi"}}),
                "gpu-0-shared"
            )
            .unwrap_err()
            .to_string(),
            "sharing.mps.perDevicePinnedMemoryLimit[\"gpu-1-shared\"]: \"81Gi\" is more than the 81920 MiB of \
             memory of gpu-1-shared"
        );
        let default = json!({"defaultPinnedDeviceMemoryLimit": "50Gi"});
        assert_eq!(on_node(default.clone(), "gpu-0-shared"), Ok(()));
        assert_eq!(
            on_node(default.clone(), "gpu-0-mig-3g-40gb-4-shared")
                .unwrap_err()
                .to_string(),
            "sharing.mps.defaultPinnedDeviceMemoryLimit: \"50Gi\" is more than the 40320 MiB of memory of \
             gpu-0-mig-3g-40gb-4-shared"
        );
        // A per-device entry for the prepared device overrides the default, so the default is not checked.
        let both = json!({"defaultPinnedDeviceMemoryLimit": "50Gi",
                          "perDevicePinnedMemoryLimit": {"gpu-0-mig-3g-40gb-4-shared": "20Gi"}});
        assert_eq!(on_node(both, "gpu-0-mig-3g-40gb-4-shared"), Ok(()));
        let time_slicing = decode(&gpu(json!({"strategy": "TimeSlicing"}))).unwrap();
        assert_eq!(
            time_slicing.check_on_node(&[], &DeviceName::Gpu { gpu: 5 }),
            Ok(()),
            "nothing to check without MPS limits"
        );
    }

    /// Issue 16 item 6: a 9,000-character kind became a 9 KB event.
    #[test]
    fn values_a_user_wrote_are_echoed_cut_to_64_characters() {
        let long = "K".repeat(9_000);
        let messages = [
            decode(&json!({"apiVersion": GROUP_VERSION, "kind": long})),
            decode(&json!({"apiVersion": long, "kind": "GpuConfig"})),
            decode(&json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig", long.clone(): 1})),
            decode(&gpu(json!({"strategy": long}))),
            decode(&gpu(
                json!({"strategy": "MPS", "mps": {"defaultPinnedDeviceMemoryLimit": format!("1{long}")}}),
            )),
            decode(&gpu(
                json!({"strategy": "MPS", "mps": {"perDevicePinnedMemoryLimit": {long.clone(): "1Gi"}}}),
            )),
            decode(&gpu(
                json!({"strategy": "MPS", "mps": {"perDevicePinnedMemoryLimit": {long.clone(): true}}}),
            )),
        ]
        .map(|r| r.unwrap_err().to_string());
        for m in messages {
            assert!(m.chars().count() < 300, "{} characters: {m:.200}", m.len());
            assert!(m.contains(&format!("{}…", "K".repeat(63))), "{m}");
        }
        assert_eq!(echo("short"), "short");
        assert_eq!(
            echo(&"é".repeat(65)),
            format!("{}…", "é".repeat(64)),
            "cut at a character"
        );
    }

    /// Issue 16 item 6: a deeply nested config made reading the claim fail with a bare `recursion limit
    /// exceeded`.
    #[test]
    fn a_claim_too_deeply_nested_to_read_gets_a_message_naming_its_opaque_configuration() {
        let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
        let claim = format!(
            r#"{{"apiVersion":"resource.k8s.io/v1","kind":"ResourceClaim","metadata":{{"name":"c"}},
                "spec":{{"devices":{{"config":[{{"opaque":{{"driver":"gpu.tessera.dev","parameters":{{"x":{deep}}}}}}}]}}}}}}"#
        );
        let err = serde_json::from_str::<k8s_openapi::api::resource::v1::ResourceClaim>(&claim).unwrap_err();
        let message = too_deep_config_message(&err.to_string()).expect("recognized");
        assert!(
            message.contains("opaque configuration") && message.contains("128 levels"),
            "{message}"
        );
        let other = serde_json::from_str::<k8s_openapi::api::resource::v1::ResourceClaim>("{").unwrap_err();
        assert_eq!(too_deep_config_message(&other.to_string()), None);
    }

    #[test]
    fn a_full_mps_config_decodes_and_gives_per_device_limits() {
        let c = decode(&gpu(json!({"strategy": "MPS", "mps": {
            "defaultActiveThreadPercentage": 50,
            "defaultPinnedDeviceMemoryLimit": " 10Gi ",
            "perDevicePinnedMemoryLimit": {"gpu-1-shared": 2147483648u64}
        }})))
        .unwrap();
        let mps = c.sharing().unwrap().mps.as_ref().unwrap();
        assert_eq!(mps.default_active_thread_percentage, Some(50));
        assert_eq!(mps.pinned_limit_bytes("gpu-0-shared"), Some(10 << 30));
        // A YAML number is bytes.
        assert_eq!(mps.pinned_limit_bytes("gpu-1-shared"), Some(2 << 30));
    }

    #[test]
    fn normalize_fills_in_the_chosen_strategys_defaults() {
        let c = decode(&gpu(json!({"strategy": "TimeSlicing"}))).unwrap();
        assert_eq!(
            c.sharing().unwrap().time_slicing,
            Some(TimeSlicingConfig {
                interval: TimeSliceInterval::Default
            })
        );
        let c = decode(&mig(json!({"strategy": "MPS"}))).unwrap();
        assert_eq!(c.sharing().unwrap().mps, Some(MpsConfig::default()));
    }

    /// The user reference (api/README.md) cannot drift from the decoder: its table of fields is exactly
    /// the fields [`decode`] accepts, and it names every accepted value.
    #[test]
    fn the_user_reference_lists_every_field_the_decoder_accepts_and_no_other() {
        let readme = include_str!("../README.md");
        let table = readme
            .split("\n## Fields\n")
            .nth(1)
            .and_then(|rest| rest.split("\n## ").next())
            .expect("api/README.md has a ## Fields section");
        let documented: std::collections::BTreeSet<&str> = table
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split('`').next())
            .collect();
        let accepted: std::collections::BTreeSet<String> = TOP_FIELDS
            .iter()
            .map(|f| f.to_string())
            .chain(SHARING_FIELDS.iter().map(|f| format!("sharing.{f}")))
            .chain(MPS_FIELDS.iter().map(|f| format!("sharing.mps.{f}")))
            .chain(
                TIME_SLICING_FIELDS
                    .iter()
                    .map(|f| format!("sharing.timeSlicing.{f}")),
            )
            .collect();
        let accepted: std::collections::BTreeSet<&str> = accepted.iter().map(String::as_str).collect();
        assert_eq!(
            documented, accepted,
            "api/README.md's field table against the decoder"
        );
        for value in KINDS
            .iter()
            .chain(STRATEGIES)
            .chain(INTERVALS)
            .chain([&GROUP_VERSION])
        {
            assert!(
                readme.contains(&format!("`{value}`")),
                "api/README.md never names `{value}`"
            );
        }
    }

    /// Issue 23 item 3: time-slicing on a MIG device was accepted and did nothing.
    #[test]
    fn a_mig_config_asking_for_time_slicing_is_refused_because_nothing_would_apply_it() {
        assert_eq!(
            decode(&mig(json!({"strategy": "TimeSlicing"}))).unwrap_err(),
            ConfigError::TimeSlicingStrategyOnMig
        );
        assert!(decode(&mig(json!({"strategy": "MPS"}))).is_ok());
    }

    /// Issue 23 item 3: NVIDIA's and tessera's config errors came one at a time.
    #[test]
    fn decode_all_reports_every_problem_of_a_config_at_once() {
        let raw = json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig", "sharng": 1, "sharing": {
            "strategy": "MPS",
            "timeSlicing": {"interval": "Long"},
            "mps": {"defaultActiveThreadPercentage": 150, "defaultPinnedDeviceMemoryLimit": "10GB",
                    "perDevicePinnedMemoryLimit": {"gpu-one": "1Gi", "gpu-0-shared": "0"}, "typo": 1}
        }});
        let messages: Vec<String> = decode_all(&raw)
            .unwrap_err()
            .iter()
            .map(|e| e.to_string())
            .collect();
        for want in [
            "parameters: unknown field \"sharng\"",
            "sharing.mps: unknown field \"typo\"",
            "sharing.mps.defaultActiveThreadPercentage: must be between 1 and 100, got 150",
            "sharing.mps.defaultPinnedDeviceMemoryLimit: invalid quantity \"10GB\"",
            "sharing.mps.perDevicePinnedMemoryLimit: key \"gpu-one\" is not a tessera device name",
            "sharing.mps.perDevicePinnedMemoryLimit[\"gpu-0-shared\"]: must be at least 1Mi",
            "sharing.timeSlicing: only allowed with strategy TimeSlicing, got MPS",
        ] {
            assert!(
                messages.iter().any(|m| m.starts_with(want)),
                "{want:?} missing from {messages:#?}"
            );
        }
        assert_eq!(messages.len(), 7, "{messages:#?}");
        assert_eq!(
            decode_all(&gpu(json!({"strategy": "MPS"}))).unwrap(),
            decode(&gpu(json!({"strategy": "MPS"}))).unwrap(),
            "a good config decodes as decode does"
        );
        let no_kind = decode_all(&json!({"apiVersion": GROUP_VERSION, "x": 1})).unwrap_err();
        assert_eq!(
            no_kind.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
            [
                "parameters: unknown field \"x\"; allowed fields: apiVersion, kind, sharing",
                "kind: required field is missing"
            ],
            "stops where nothing else can be judged"
        );
    }

    #[test]
    fn a_claim_asking_for_the_strategy_its_shared_device_does_not_serve_is_refused_naming_both() {
        let ts = decode(&gpu(json!({"strategy": "TimeSlicing"}))).unwrap();
        let device = DeviceName::SharedGpu { gpu: 1 };
        let err = check_strategy(Some(&ts), SharingStrategy::Mps, &device).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with(
                "sharing.strategy: device gpu-1-shared serves MPS (its sharingStrategy attribute) to every \
                 claim sharing it, so this claim may not ask for TimeSlicing"
            ),
            "{text}"
        );
        assert!(text.contains("sharingStrategy == \"TimeSlicing\""), "{text}");
        assert_eq!(
            check_strategy(Some(&ts), SharingStrategy::TimeSlicing, &device),
            Ok(())
        );
        assert_eq!(
            check_strategy(None, SharingStrategy::TimeSlicing, &device),
            Ok(())
        );
        let no_sharing = decode(&json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig"})).unwrap();
        assert_eq!(
            check_strategy(Some(&no_sharing), SharingStrategy::Mps, &device),
            Ok(())
        );
    }

    fn claim_with(
        requests: &[&str],
        written: Vec<Option<Vec<&str>>>,
        allocated: Vec<(&'static str, Option<Vec<&str>>)>,
    ) -> k8s_openapi::api::resource::v1::ResourceClaim {
        let names = |r: Option<Vec<&str>>| r.map(|r| r.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        serde_json::from_value(json!({
            "metadata": {"name": "c"},
            "spec": {"devices": {
                "requests": requests.iter().map(|r| json!({"name": r, "exactly": {"deviceClassName": "x"}}))
                    .collect::<Vec<_>>(),
                "config": written.into_iter().map(|r| json!({"requests": names(r),
                    "opaque": {"driver": DRIVER_NAME, "parameters": {}}})).collect::<Vec<_>>(),
            }},
            "status": {"allocation": {"devices": {"results": [], "config": allocated.into_iter()
                .map(|(source, r)| json!({"source": source, "requests": names(r),
                    "opaque": {"driver": DRIVER_NAME, "parameters": {}}}))
                .collect::<Vec<_>>()}}}
        }))
        .unwrap()
    }

    /// Issue 23 item 3: kube-scheduler clears `requests` of a config naming every request, and the config
    /// was then taken for an untargeted one.
    #[test]
    fn targeting_is_judged_on_the_claims_own_config_not_the_allocations_cleared_copy() {
        let claim = claim_with(
            &["mig"],
            vec![Some(vec!["mig"]), None],
            vec![
                (SOURCE_FROM_CLASS, None),
                (SOURCE_FROM_CLAIM, None),
                (SOURCE_FROM_CLAIM, None),
            ],
        );
        let requests: Vec<_> = targets_as_written(&claim)
            .into_iter()
            .map(|e| (e.source, e.requests))
            .collect();
        assert_eq!(
            requests,
            [
                (SOURCE_FROM_CLASS.to_string(), Some(vec!["mig".to_string()])),
                (SOURCE_FROM_CLAIM.to_string(), Some(vec!["mig".to_string()])),
                (SOURCE_FROM_CLAIM.to_string(), None),
            ]
        );
        // The restored entry is targeted, so a GpuConfig on the MIG device is an error, not skipped.
        let mut entries = targets_as_written(&claim);
        entries[1].opaque.as_mut().unwrap().parameters = RawExtension(pct(50));
        let mig_dev: DeviceName = "gpu-0-mig-1g-10gb-3".parse().unwrap();
        assert!(matches!(
            effective_config(&entries[1..2], "mig", &mig_dev),
            Err(ConfigError::WrongKindForDevice { .. })
        ));
    }

    /// Issue 39 item 1: a burstable share's ceiling is decoded and checked against its request and device.
    #[test]
    fn a_compute_ceiling_decodes_as_a_percentage_and_is_refused_out_of_range_naming_the_field() {
        let c = decode(&gpu(json!({"strategy": "MPS", "mps": {"computeCeiling": 80}}))).unwrap();
        assert_eq!(
            c.sharing().unwrap().mps.as_ref().unwrap().compute_ceiling,
            Some(80)
        );
        for (bad, want) in [
            (
                json!(0),
                "sharing.mps.computeCeiling: must be between 1 and 100, got 0",
            ),
            (
                json!(150),
                "sharing.mps.computeCeiling: must be between 1 and 100, got 150",
            ),
            (
                json!(50.5),
                "sharing.mps.computeCeiling: must be an integer, got a fraction",
            ),
            (
                json!("80"),
                "sharing.mps.computeCeiling: must be an integer, got a string",
            ),
        ] {
            let err = decode(&gpu(json!({"strategy": "MPS", "mps": {"computeCeiling": bad}}))).unwrap_err();
            assert_eq!(err.to_string(), want);
        }
    }

    #[test]
    fn a_compute_ceiling_above_the_configs_own_daemon_default_is_refused_because_clients_can_only_lower_it() {
        let err = decode(&gpu(json!({"strategy": "MPS",
            "mps": {"computeCeiling": 80, "defaultActiveThreadPercentage": 40}})))
        .unwrap_err();
        assert_eq!(
            err,
            ConfigError::CeilingAboveDaemonDefault {
                ceiling: 80,
                default: 40
            }
        );
        assert!(
            err.to_string()
                .starts_with("sharing.mps.computeCeiling: 80 is above defaultActiveThreadPercentage 40")
        );
        assert!(
            decode(&gpu(json!({"strategy": "MPS",
            "mps": {"computeCeiling": 40, "defaultActiveThreadPercentage": 40}})))
            .is_ok()
        );
    }

    #[test]
    fn a_compute_ceiling_below_the_request_or_on_a_device_without_mps_clients_is_refused() {
        let burst = decode(&gpu(json!({"strategy": "MPS", "mps": {"computeCeiling": 60}}))).unwrap();
        let shared = DeviceName::SharedGpu { gpu: 0 };
        assert_eq!(check_ceiling(Some(&burst), Some(&shared), Some(30)), Ok(()));
        assert_eq!(check_ceiling(Some(&burst), Some(&shared), Some(60)), Ok(()));
        assert_eq!(check_ceiling(Some(&burst), None, None), Ok(()));
        let err = check_ceiling(Some(&burst), Some(&shared), Some(70)).unwrap_err();
        assert_eq!(
            err,
            ConfigError::CeilingBelowRequest {
                ceiling: 60,
                request: 70
            }
        );
        assert!(
            err.to_string()
                .starts_with("sharing.mps.computeCeiling: 60 is below the share's compute request of 70")
        );
        let mig_share: DeviceName = "gpu-0-mig-3g-40gb-4-shared".parse().unwrap();
        let burst_mig = decode(&mig(json!({"strategy": "MPS", "mps": {"computeCeiling": 60}}))).unwrap();
        assert_eq!(
            check_ceiling(Some(&burst_mig), Some(&mig_share), Some(20)),
            Ok(())
        );
        for device in ["gpu-0", "gpu-0-mig-3g-40gb-4", "gpu-0-share-1"] {
            let device: DeviceName = device.parse().unwrap();
            let config = if is_mig(&device) { &burst_mig } else { &burst };
            let err = check_ceiling(Some(config), Some(&device), None).unwrap_err();
            assert!(
                matches!(err, ConfigError::CeilingMeansNothing { .. }),
                "{device}: {err}"
            );
            assert!(
                err.to_string()
                    .starts_with("sharing.mps.computeCeiling: means nothing on"),
                "{err}"
            );
        }
        let guaranteed = decode(&gpu(json!({"strategy": "MPS"}))).unwrap();
        assert_eq!(
            check_ceiling(Some(&guaranteed), Some(&DeviceName::Gpu { gpu: 0 }), Some(100)),
            Ok(())
        );
        assert_eq!(check_ceiling(None, Some(&shared), Some(100)), Ok(()));
    }

    #[test]
    fn a_compute_ceiling_with_time_slicing_is_refused_as_mps_settings_of_another_strategy() {
        let err = decode(&gpu(
            json!({"strategy": "TimeSlicing", "mps": {"computeCeiling": 80}}),
        ))
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "sharing.mps: only allowed with strategy MPS, got TimeSlicing"
        );
    }

    #[test]
    fn null_fields_read_as_absent() {
        let c = decode(&json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig", "sharing": null})).unwrap();
        assert_eq!(c, DeviceConfig::GpuConfig(GpuConfig::default()));
    }

    #[test]
    fn a_decoded_config_round_trips_through_the_checkpoint_encoding() {
        let c = decode(&gpu(
            json!({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 25}}),
        ))
        .unwrap();
        let back: DeviceConfig = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    struct Entry {
        source: &'static str,
        requests: Vec<&'static str>,
        driver: &'static str,
        parameters: Value,
    }

    fn entry(source: &'static str, requests: &[&'static str], parameters: Value) -> Entry {
        Entry {
            source,
            requests: requests.to_vec(),
            driver: DRIVER_NAME,
            parameters,
        }
    }

    fn to_k8s(entries: Vec<Entry>) -> Vec<DeviceAllocationConfiguration> {
        entries
            .into_iter()
            .map(|e| DeviceAllocationConfiguration {
                source: e.source.into(),
                requests: (!e.requests.is_empty())
                    .then(|| e.requests.iter().map(|r| r.to_string()).collect()),
                opaque: Some(OpaqueDeviceConfiguration {
                    driver: e.driver.into(),
                    parameters: RawExtension(e.parameters),
                }),
            })
            .collect()
    }

    fn pct(p: u32) -> Value {
        gpu(json!({"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": p}}))
    }

    fn winner_pct(entries: Vec<Entry>, request: &str) -> Option<u32> {
        let device = DeviceName::SharedGpu { gpu: 0 };
        effective_config(&to_k8s(entries), request, &device)
            .unwrap()
            .and_then(|c| c.sharing()?.mps.as_ref()?.default_active_thread_percentage)
    }

    #[test]
    fn claim_config_beats_class_config_and_targeted_beats_untargeted() {
        use SOURCE_FROM_CLAIM as CLAIM;
        use SOURCE_FROM_CLASS as CLASS;
        assert_eq!(
            winner_pct(
                vec![entry(CLAIM, &[], pct(20)), entry(CLASS, &["a"], pct(10))],
                "a"
            ),
            Some(20)
        );
        assert_eq!(
            winner_pct(
                vec![entry(CLASS, &["a"], pct(10)), entry(CLASS, &[], pct(30))],
                "a"
            ),
            Some(10)
        );
        assert_eq!(
            winner_pct(
                vec![entry(CLAIM, &["a"], pct(40)), entry(CLAIM, &[], pct(50))],
                "a"
            ),
            Some(40)
        );
        assert_eq!(
            winner_pct(vec![entry(CLAIM, &[], pct(40)), entry(CLAIM, &[], pct(50))], "a"),
            Some(50)
        );
        assert_eq!(winner_pct(vec![entry(CLAIM, &["b"], pct(40))], "a"), None);
        assert_eq!(winner_pct(vec![entry(CLAIM, &["a"], pct(60))], "a/sub"), Some(60));
        let mut other = entry(CLAIM, &["a"], json!({"anything": "goes"}));
        other.driver = "gpu.nvidia.com";
        assert_eq!(winner_pct(vec![entry(CLASS, &[], pct(70)), other], "a"), Some(70));
    }

    #[test]
    fn a_broken_overridden_entry_is_still_reported() {
        let entries = to_k8s(vec![
            entry(SOURCE_FROM_CLASS, &[], gpu(json!({"strategy": "Magic"}))),
            entry(SOURCE_FROM_CLAIM, &[], pct(50)),
        ]);
        let err = effective_config(&entries, "a", &DeviceName::Gpu { gpu: 0 }).unwrap_err();
        assert!(matches!(err, ConfigError::NotOneOf { .. }), "{err}");
    }

    #[test]
    fn a_targeted_config_of_the_wrong_kind_is_an_error_and_an_untargeted_one_is_skipped() {
        let mig_dev = DeviceName::Mig {
            gpu: 0,
            profile: "1g.10gb".into(),
            start: 3,
        };
        let targeted = to_k8s(vec![entry(SOURCE_FROM_CLAIM, &["a"], pct(50))]);
        assert_eq!(
            effective_config(&targeted, "a", &mig_dev)
                .unwrap_err()
                .to_string(),
            "cannot apply GpuConfig to MIG device gpu-0-mig-1g-10gb-3; use MigConfig"
        );
        let untargeted = to_k8s(vec![entry(SOURCE_FROM_CLAIM, &[], pct(50))]);
        assert_eq!(effective_config(&untargeted, "a", &mig_dev).unwrap(), None);
        let mig_on_gpu = to_k8s(vec![entry(
            SOURCE_FROM_CLAIM,
            &["a"],
            mig(json!({"strategy": "MPS"})),
        )]);
        assert_eq!(
            effective_config(&mig_on_gpu, "a", &DeviceName::Gpu { gpu: 2 })
                .unwrap_err()
                .to_string(),
            "cannot apply MigConfig to whole GPU gpu-2; use GpuConfig"
        );
    }

    #[test]
    fn an_unknown_source_is_an_error() {
        let entries = to_k8s(vec![entry("FromNowhere", &[], pct(50))]);
        let err = effective_config(&entries, "a", &DeviceName::Gpu { gpu: 0 }).unwrap_err();
        assert_eq!(
            err.to_string(),
            "config source \"FromNowhere\" is not FromClass or FromClaim"
        );
    }

    #[test]
    fn quantities_parse_with_binary_and_decimal_suffixes() {
        for (q, want) in [
            ("0", 0),
            ("1", 1),
            ("1024", 1024),
            ("1Ki", 1024),
            ("10Mi", 10 << 20),
            ("10Gi", 10 << 30),
            ("2Ti", 2 << 40),
            ("1k", 1000),
            ("5M", 5_000_000),
            ("80G", 80_000_000_000),
            ("1.5Gi", 3 << 29),
            ("0.5Ki", 512),
            (".5Ki", 512),
            ("1.0001k", 1001),
            ("+3Mi", 3 << 20),
            (" 7Gi ", 7 << 30),
        ] {
            assert_eq!(parse_quantity(q), Ok(want), "{q}");
        }
    }

    #[test]
    fn malformed_quantities_are_rejected_with_a_reason() {
        for (q, want) in [
            ("", QuantityError::Empty),
            ("Gi", QuantityError::NoNumber),
            ("-1", QuantityError::NoNumber),
            ("1.2.3", QuantityError::NoNumber),
            (".", QuantityError::NoNumber),
            ("10GB", QuantityError::UnknownSuffix("GB".into())),
            ("100m", QuantityError::UnknownSuffix("m".into())),
            ("1e3", QuantityError::UnknownSuffix("e3".into())),
            ("100Ei", QuantityError::Overflow),
            ("99999999999999999999999", QuantityError::Overflow),
        ] {
            assert_eq!(parse_quantity(q), Err(want), "{q}");
        }
    }
}
