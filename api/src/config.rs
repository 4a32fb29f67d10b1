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
//!     defaultPinnedDeviceMemoryLimit: 10Gi
//!     perDevicePinnedMemoryLimit:        # keyed by tessera device name
//!       gpu-1-shared: 20Gi
//!   # timeSlicing: {interval: Default}   # Default | Short | Medium | Long (GpuConfig only)
//! ```
//!
//! Decoding is strict: an unknown field is an error, so a typo never silently drops a limit. Every error
//! names the field path. The complete list of messages (the `…` parts are filled in; `<path>` is a field
//! path such as `sharing.mps`):
//!
//! | Message | When |
//! |---|---|
//! | `parameters: must be an object, got <type>` | `parameters` is not a JSON object |
//! | `<path>: unknown field "<field>"; allowed fields: <a>, <b>, …` | a misspelled or unsupported field |
//! | `<path>: required field is missing` | `apiVersion`, `kind` or `sharing.strategy` absent |
//! | `<path>: must be <type>, got <type>` | wrong JSON type, e.g. a string where a number belongs |
//! | `apiVersion: must be "gpu.tessera.dev/v1alpha1", got "<v>"` | other API version |
//! | `kind: must be one of GpuConfig, MigConfig, got "<k>"` | other kind |
//! | `sharing.strategy: must be one of MPS, TimeSlicing, got "<s>"` | unknown strategy |
//! | `sharing.timeSlicing.interval: must be one of Default, Short, Medium, Long, got "<i>"` | unknown interval |
//! | `sharing.mps.defaultActiveThreadPercentage: must be between 1 and 100, got <n>` | out of range |
//! | `<quantity path>: invalid quantity "<q>": <reason>` | unparsable quantity |
//! | `<quantity path>: must be at least 1Mi, got "<q>"` | zero or sub-MiB memory limit (MPS counts in MiB) |
//! | `sharing.mps.perDevicePinnedMemoryLimit: key "<k>" is not a tessera device name (gpu-<i>, …)` | bad key |
//! | `sharing.mps: only allowed with strategy MPS, got <s>` | MPS settings with another strategy |
//! | `sharing.timeSlicing: only allowed with strategy TimeSlicing, got <s>` | interval with another strategy |
//! | `sharing.timeSlicing: MIG devices have no time-slice setting; remove it or use GpuConfig` | in `MigConfig` |
//! | `cannot apply <kind> to <device kind> <device>; use <kind>` | kind does not fit the allocated device |
//! | `config source "<s>" is not FromClass or FromClaim` | malformed allocation |
//!
//! Precedence ([`effective_config`]): configs from the DeviceClass rank below configs from the claim; within
//! each, an entry naming the request ranks above an untargeted one; among equals the later entry wins.
//! Untargeted entries of the other kind are skipped (a claim may mix GPU and MIG requests); a targeted entry of
//! the wrong kind is an error.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::DeviceAllocationConfiguration;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::policy::SharingStrategy;
use crate::{DRIVER_NAME, DeviceName, GROUP_VERSION};

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
        got: i64,
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
    /// `timeSlicing` in a `MigConfig`.
    #[error("sharing.timeSlicing: MIG devices have no time-slice setting; remove it or use GpuConfig")]
    TimeSlicingOnMig,
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
            path: path.to_string(),
            field: field.clone(),
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
            got: s.to_string(),
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
            got: api_version.into(),
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
    let pct_path = join(PATH, "defaultActiveThreadPercentage");
    let default_active_thread_percentage = match field(obj, "defaultActiveThreadPercentage") {
        None => None,
        Some(n) => {
            let got = n.as_i64().ok_or(ConfigError::WrongType {
                path: pct_path.clone(),
                expected: "an integer",
                got: type_name(n),
            })?;
            if !(1..=100).contains(&got) {
                return Err(ConfigError::OutOfRange {
                    path: pct_path,
                    min: 1,
                    max: 100,
                    got,
                });
            }
            Some(got as u32)
        }
    };
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
            per_device_pinned_memory_limit.insert(k.clone(), quantity_string(q, &format!("{path}[{k:?}]"))?);
        }
    }
    Ok(MpsConfig {
        default_active_thread_percentage,
        default_pinned_device_memory_limit,
        per_device_pinned_memory_limit,
    })
}

/// Decodes, normalizes and validates one opaque `parameters` object.
pub fn decode(raw: &Value) -> Result<DeviceConfig> {
    let mut config = decode_strict(raw)?;
    config.normalize();
    config.validate()?;
    Ok(config)
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
        if sharing.time_slicing.is_some() {
            if matches!(self, Self::MigConfig(_)) {
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
                got: i64::from(p),
            });
        }
        if let Some(q) = &mps.default_pinned_device_memory_limit {
            memory_limit(q, "sharing.mps.defaultPinnedDeviceMemoryLimit")?;
        }
        let path = "sharing.mps.perDevicePinnedMemoryLimit";
        for (k, q) in &mps.per_device_pinned_memory_limit {
            if k.parse::<DeviceName>().is_err() {
                return Err(ConfigError::BadDeviceKey {
                    path: path.into(),
                    key: k.clone(),
                });
            }
            memory_limit(q, &format!("{path}[{k:?}]"))?;
        }
        Ok(())
    }
}

fn memory_limit(q: &str, path: &str) -> Result<u64> {
    let bytes = parse_quantity(q).map_err(|source| ConfigError::InvalidQuantity {
        path: path.to_string(),
        value: q.to_string(),
        source,
    })?;
    if bytes < MIN_PINNED_MEMORY_BYTES {
        return Err(ConfigError::MemoryLimitTooSmall {
            path: path.to_string(),
            value: q.to_string(),
        });
    }
    Ok(bytes)
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
            other => return Err(ConfigError::UnknownSource(other.to_string())),
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
        other => return Err(QuantityError::UnknownSuffix(other.to_string())),
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
                "unknown field \"sharng\"; allowed fields: apiVersion, kind, sharing",
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
        let c = decode(&mig(json!({"strategy": "TimeSlicing"}))).unwrap();
        assert_eq!(c.sharing().unwrap().time_slicing, None);
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
