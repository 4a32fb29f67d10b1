//! NVIDIA's opaque claim configuration (`resource.nvidia.com/v1beta1` `GpuConfig`, `MigDeviceConfig`) as
//! tessera's (`gpu.tessera.dev/v1alpha1` `GpuConfig`, `MigConfig`; api/README.md).

use serde_norway::{Mapping, Value};
use tessera_api::GROUP_VERSION;

/// NVIDIA's config API version.
pub const NVIDIA_GROUP_VERSION: &str = "resource.nvidia.com/v1beta1";

/// A translated config.
#[derive(Debug, Default)]
pub struct Translated {
    /// The new parameters; `None` when nothing is left to configure (the entry can go).
    pub parameters: Option<Value>,
    pub changes: Vec<String>,
    pub problems: Vec<String>,
}

fn s(v: &str) -> Value {
    Value::String(v.to_string())
}

/// Translates `parameters` of an entry whose driver was NVIDIA's. Fields it does not know are kept and
/// reported: tessera's strict decoder then names them at admission.
pub fn translate(parameters: &Value) -> Translated {
    let mut t = Translated::default();
    let Some(top) = parameters.as_mapping() else {
        t.problems
            .push("parameters is not an object; left as written".into());
        t.parameters = Some(parameters.clone());
        return t;
    };
    let kind = top.get("kind").and_then(Value::as_str).unwrap_or_default();
    let mig = match kind {
        "GpuConfig" => false,
        "MigDeviceConfig" => true,
        other => {
            t.problems.push(format!(
                "kind {other:?} has no tessera equivalent (tessera configures whole GPUs, MIG devices and \
                 their shares only); left as written"
            ));
            t.parameters = Some(parameters.clone());
            return t;
        }
    };
    let mut out = Mapping::new();
    for (k, v) in top {
        match k.as_str() {
            Some("apiVersion") => {
                if v.as_str() != Some(NVIDIA_GROUP_VERSION) {
                    t.problems.push(format!(
                        "apiVersion {v:?} is not {NVIDIA_GROUP_VERSION}; translated as if it were"
                    ));
                }
                out.insert(s("apiVersion"), s(GROUP_VERSION));
            }
            Some("kind") => {
                out.insert(s("kind"), s(if mig { "MigConfig" } else { "GpuConfig" }));
            }
            Some("sharing") => {
                if let Some(sharing) = sharing(v, mig, &mut t) {
                    out.insert(s("sharing"), sharing);
                }
            }
            _ => {
                t.problems
                    .push(format!("parameters.{}: not a field tessera knows; kept", key(k)));
                out.insert(k.clone(), v.clone());
            }
        }
    }
    if out.get("sharing").is_none() && out.len() == 2 && top.get("sharing").is_some() {
        // Only apiVersion and kind are left: the entry configures nothing.
        return t;
    }
    t.changes.push(format!(
        "{NVIDIA_GROUP_VERSION} {kind} → {GROUP_VERSION} {}",
        if mig { "MigConfig" } else { "GpuConfig" }
    ));
    if out.get("sharing").is_some() {
        t.changes.push(
            "the claim's containers and pods share its device as with NVIDIA's driver; for separate claims \
             on one GPU, request memory and compute of shared.gpu.tessera.dev"
                .into(),
        );
    }
    t.parameters = Some(Value::Mapping(out));
    t
}

fn key(k: &Value) -> String {
    k.as_str().map_or_else(|| format!("{k:?}"), str::to_string)
}

fn sharing(v: &Value, mig: bool, t: &mut Translated) -> Option<Value> {
    let Some(m) = v.as_mapping() else {
        t.problems.push("sharing is not an object; kept".into());
        return Some(v.clone());
    };
    let strategy = m.get("strategy").and_then(Value::as_str).unwrap_or_default();
    if mig && strategy == "TimeSlicing" {
        t.changes.push(
            "it configured only sharing.strategy TimeSlicing on a MIG device, and a MIG device has no time-slice setting \
             (NVIDIA's driver accepts it and applies nothing), and the claim's containers take turns on it \
             as they would"
                .into(),
        );
        return None;
    }
    let mut out = Mapping::new();
    for (k, v) in m {
        match k.as_str() {
            Some("strategy") => {
                if !matches!(strategy, "MPS" | "TimeSlicing") {
                    t.problems.push(format!(
                        "sharing.strategy {strategy:?}: tessera shares by MPS or TimeSlicing only; kept"
                    ));
                }
                out.insert(k.clone(), v.clone());
            }
            Some("timeSlicingConfig") => {
                t.changes
                    .push("sharing.timeSlicingConfig → sharing.timeSlicing".into());
                out.insert(s("timeSlicing"), v.clone());
            }
            Some("mpsConfig") => {
                t.changes.push("sharing.mpsConfig → sharing.mps".into());
                out.insert(s("mps"), mps(v, t));
            }
            _ => {
                t.problems
                    .push(format!("sharing.{}: not a field tessera knows; kept", key(k)));
                out.insert(k.clone(), v.clone());
            }
        }
    }
    Some(Value::Mapping(out))
}

fn mps(v: &Value, t: &mut Translated) -> Value {
    let Some(m) = v.as_mapping() else {
        return v.clone();
    };
    let mut out = Mapping::new();
    for (k, v) in m {
        match k.as_str() {
            Some("defaultActiveThreadPercentage") if v.as_u64() == Some(0) => {
                t.problems.push(
                    "sharing.mps.defaultActiveThreadPercentage 0: tessera takes 1 to 100; removed, so the \
                     share's compute request (or no limit) applies"
                        .into(),
                );
            }
            Some("defaultActiveThreadPercentage" | "defaultPinnedDeviceMemoryLimit") => {
                out.insert(k.clone(), v.clone());
            }
            Some("defaultPerDevicePinnedMemoryLimit") => {
                t.problems.push(format!(
                    "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit {}: NVIDIA keys it by the claim's \
                     device index or UUID, tessera's perDevicePinnedMemoryLimit by tessera device name \
                     (gpu-0, gpu-0-shared), which only the allocation knows; removed: use \
                     defaultPinnedDeviceMemoryLimit, or a memory request of a shared.gpu.tessera.dev share",
                    serde_norway::to_string(v)
                        .unwrap_or_default()
                        .trim()
                        .replace('\n', ", ")
                ));
            }
            _ => {
                t.problems.push(format!(
                    "sharing.mpsConfig.{}: not a field tessera knows; kept",
                    key(k)
                ));
                out.insert(k.clone(), v.clone());
            }
        }
    }
    Value::Mapping(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(s: &str) -> Value {
        serde_norway::from_str(s).unwrap()
    }

    fn decoded(v: &Value) -> tessera_api::config::DeviceConfig {
        let json = serde_json::to_value(v).unwrap();
        tessera_api::config::decode(&json).unwrap_or_else(|e| panic!("{e}: {json}"))
    }

    #[test]
    fn an_mps_gpu_config_becomes_tesseras_and_decodes() {
        let t = translate(&yaml(
            "apiVersion: resource.nvidia.com/v1beta1\nkind: GpuConfig\nsharing:\n  strategy: MPS\n  mpsConfig:\n    defaultActiveThreadPercentage: 50\n    defaultPinnedDeviceMemoryLimit: 10Gi\n",
        ));
        assert!(t.problems.is_empty(), "{:?}", t.problems);
        let p = t.parameters.unwrap();
        assert_eq!(
            serde_norway::to_string(&p).unwrap(),
            "apiVersion: gpu.tessera.dev/v1alpha1\nkind: GpuConfig\nsharing:\n  strategy: MPS\n  mps:\n    defaultActiveThreadPercentage: 50\n    defaultPinnedDeviceMemoryLimit: 10Gi\n"
        );
        decoded(&p);
    }

    #[test]
    fn a_time_slicing_interval_keeps_its_value() {
        let t = translate(&yaml(
            "apiVersion: resource.nvidia.com/v1beta1\nkind: GpuConfig\nsharing:\n  strategy: TimeSlicing\n  timeSlicingConfig: {interval: Long}\n",
        ));
        let p = t.parameters.unwrap();
        assert!(matches!(
            decoded(&p),
            tessera_api::config::DeviceConfig::GpuConfig(_)
        ));
        assert_eq!(p["sharing"]["timeSlicing"]["interval"].as_str(), Some("Long"));
    }

    #[test]
    fn a_mig_device_config_becomes_a_mig_config_and_time_slicing_on_it_goes() {
        let t = translate(&yaml(
            "apiVersion: resource.nvidia.com/v1beta1\nkind: MigDeviceConfig\nsharing:\n  strategy: MPS\n  mpsConfig: {defaultActiveThreadPercentage: 25}\n",
        ));
        assert!(matches!(
            decoded(&t.parameters.unwrap()),
            tessera_api::config::DeviceConfig::MigConfig(_)
        ));
        let t = translate(&yaml(
            "apiVersion: resource.nvidia.com/v1beta1\nkind: MigDeviceConfig\nsharing: {strategy: TimeSlicing}\n",
        ));
        assert!(t.parameters.is_none(), "nothing left to configure");
        assert!(t.changes.iter().any(|c| c.contains("no time-slice setting")));
    }

    #[test]
    fn per_device_limits_keyed_by_index_are_dropped_with_the_reason() {
        let t = translate(&yaml(
            "apiVersion: resource.nvidia.com/v1beta1\nkind: GpuConfig\nsharing:\n  strategy: MPS\n  mpsConfig:\n    defaultPerDevicePinnedMemoryLimit: {\"0\": 5Gi}\n",
        ));
        assert!(t.problems[0].contains("tessera device name"), "{:?}", t.problems);
        decoded(&t.parameters.unwrap());
    }

    #[test]
    fn kinds_tessera_lacks_are_left_as_written() {
        let raw = yaml("apiVersion: resource.nvidia.com/v1beta1\nkind: VfioDeviceConfig\n");
        let t = translate(&raw);
        assert_eq!(t.parameters, Some(raw));
        assert!(t.problems[0].contains("VfioDeviceConfig"));
    }
}
