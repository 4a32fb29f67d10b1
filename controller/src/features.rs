//! What the API server supports, found out from the server itself.
//!
//! The API server silently drops fields whose feature gate is off (dra-api.md section 6), so a version
//! number says nothing about a cluster that enabled gates by hand, or disabled them. The controller
//! therefore creates probe ResourceSlices with server-side dry run and checks which fields come back:
//!
//! | probe | fields | feature |
//! |---|---|---|
//! | counters | `sharedCounters` (alone in its slice, the 1.35+ layout) | partitionable |
//! | consumer | a device with `consumesCounters` of a set in another slice | partitionable |
//! | shared | `allowMultipleAllocations` + `capacity.requestPolicy` | consumable |
//! | tainted | `taints` | taints |
//!
//! A rejected probe (a 1.34 server refuses counters consumed from another slice) counts as unsupported:
//! tessera only publishes the 1.35+ split layout.

use std::{fmt, str::FromStr};

use k8s_openapi::{
    api::resource::v1::{
        CapacityRequestPolicy, CapacityRequestPolicyRange, Counter, CounterSet, Device, DeviceCapacity,
        DeviceCounterConsumption, DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
    },
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::ObjectMeta},
};
use serde::Serialize;
use tessera_api::DRIVER_NAME;

/// Optional resource.k8s.io features tessera can use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ApiFeatures {
    /// KEP-4815 partitionable devices (`sharedCounters` / `consumesCounters`), split-slice layout.
    pub partitionable: bool,
    /// KEP-5075 consumable capacity (`allowMultipleAllocations`, `requestPolicy`).
    pub consumable: bool,
    /// KEP-5055 device taints.
    pub taints: bool,
}

impl ApiFeatures {
    pub const ALL: Self = Self {
        partitionable: true,
        consumable: true,
        taints: true,
    };
    pub const NONE: Self = Self {
        partitionable: false,
        consumable: false,
        taints: false,
    };
}

/// A `--features` value that is not `none`, `all` or a list of `partitionable`, `consumable`, `taints`.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown feature {0:?}: use `none`, `all` or a comma-separated list of partitionable, consumable, taints"
)]
pub struct ParseFeaturesError(String);

impl FromStr for ApiFeatures {
    type Err = ParseFeaturesError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "none" | "" => return Ok(Self::NONE),
            "all" => return Ok(Self::ALL),
            _ => {}
        }
        let mut f = Self::NONE;
        for part in s.split(',').map(str::trim) {
            match part {
                "partitionable" => f.partitionable = true,
                "consumable" => f.consumable = true,
                "taints" => f.taints = true,
                other => return Err(ParseFeaturesError(other.to_string())),
            }
        }
        Ok(f)
    }
}

impl fmt::Display for ApiFeatures {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = [
            (self.partitionable, "partitionable"),
            (self.consumable, "consumable"),
            (self.taints, "taints"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        f.write_str(if names.is_empty() { "none" } else { "" })?;
        f.write_str(&names.join(","))
    }
}

/// Name prefix of the probe slices (never stored: dry run).
pub const PROBE_PREFIX: &str = "tessera-feature-probe";
const PROBE_SET: &str = "probe-counters";

fn probe_slice(kind: &str, spec: ResourceSliceSpec) -> ResourceSlice {
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(format!("{PROBE_PREFIX}-{kind}")),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER_NAME.to_string(),
            pool: ResourcePool {
                name: format!("{PROBE_PREFIX}-{kind}"),
                generation: 1,
                resource_slice_count: 1,
            },
            ..spec
        },
    }
}

fn one_counter() -> std::collections::BTreeMap<String, Counter> {
    [(
        "c".to_string(),
        Counter {
            value: Quantity("1".into()),
        },
    )]
    .into()
}

/// The probe slices, keyed by what they detect: `counters`, `consumer`, `shared`, `tainted`.
pub fn probe_slices() -> Vec<ResourceSlice> {
    let device = |name: &str| Device {
        name: name.into(),
        ..Default::default()
    };
    vec![
        probe_slice(
            "counters",
            ResourceSliceSpec {
                all_nodes: Some(true),
                shared_counters: Some(vec![CounterSet {
                    name: PROBE_SET.into(),
                    counters: one_counter(),
                }]),
                ..Default::default()
            },
        ),
        probe_slice(
            "consumer",
            ResourceSliceSpec {
                all_nodes: Some(true),
                devices: Some(vec![Device {
                    consumes_counters: Some(vec![DeviceCounterConsumption {
                        counter_set: PROBE_SET.into(),
                        counters: one_counter(),
                        ..Default::default()
                    }]),
                    ..device("probe")
                }]),
                ..Default::default()
            },
        ),
        probe_slice(
            "shared",
            ResourceSliceSpec {
                all_nodes: Some(true),
                devices: Some(vec![Device {
                    allow_multiple_allocations: Some(true),
                    capacity: Some(
                        [(
                            "memory".to_string(),
                            DeviceCapacity {
                                value: Quantity("2Gi".into()),
                                request_policy: Some(CapacityRequestPolicy {
                                    default: Some(Quantity("1Gi".into())),
                                    valid_range: Some(CapacityRequestPolicyRange {
                                        min: Quantity("1Gi".into()),
                                        max: Some(Quantity("2Gi".into())),
                                        step: Some(Quantity("1Gi".into())),
                                    }),
                                    valid_values: None,
                                }),
                            },
                        )]
                        .into(),
                    ),
                    ..device("probe")
                }]),
                ..Default::default()
            },
        ),
        probe_slice(
            "tainted",
            ResourceSliceSpec {
                all_nodes: Some(true),
                devices: Some(vec![Device {
                    taints: Some(vec![DeviceTaint {
                        key: format!("{DRIVER_NAME}/probe"),
                        effect: "NoSchedule".into(),
                        ..Default::default()
                    }]),
                    ..device("probe")
                }]),
                ..Default::default()
            },
        ),
    ]
}

/// Reads the features off the dry-run results of [`probe_slices`]: `None` where the server rejected a
/// probe, otherwise the object it returned.
pub fn features_from_probes(results: &[(String, Option<ResourceSlice>)]) -> ApiFeatures {
    let get = |kind: &str| {
        results
            .iter()
            .find(|(name, _)| name == &format!("{PROBE_PREFIX}-{kind}"))
            .and_then(|(_, s)| s.as_ref())
    };
    let first_device = |kind: &str| get(kind).and_then(|s| s.spec.devices.as_ref()?.first().cloned());
    let counters =
        get("counters").is_some_and(|s| s.spec.shared_counters.as_ref().is_some_and(|c| !c.is_empty()));
    let consumer =
        first_device("consumer").is_some_and(|d| d.consumes_counters.is_some_and(|c| !c.is_empty()));
    let consumable = first_device("shared").is_some_and(|d| {
        d.allow_multiple_allocations == Some(true)
            && d.capacity
                .as_ref()
                .and_then(|c| c.get("memory"))
                .is_some_and(|c| c.request_policy.is_some())
    });
    let taints = first_device("tainted").is_some_and(|d| d.taints.is_some_and(|t| !t.is_empty()));
    ApiFeatures {
        partitionable: counters && consumer,
        consumable,
        taints,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echo(strip: impl Fn(&mut ResourceSlice)) -> Vec<(String, Option<ResourceSlice>)> {
        probe_slices()
            .into_iter()
            .map(|mut s| {
                strip(&mut s);
                (s.metadata.name.clone().unwrap(), Some(s))
            })
            .collect()
    }

    #[test]
    fn a_server_that_keeps_every_field_supports_everything() {
        assert_eq!(features_from_probes(&echo(|_| {})), ApiFeatures::ALL);
    }

    #[test]
    fn fields_dropped_by_a_disabled_gate_turn_the_feature_off() {
        let dropped = echo(|s| {
            s.spec.shared_counters = None;
            for d in s.spec.devices.iter_mut().flatten() {
                d.consumes_counters = None;
                d.allow_multiple_allocations = None;
                d.taints = None;
                for c in d.capacity.iter_mut().flat_map(|c| c.values_mut()) {
                    c.request_policy = None;
                }
            }
        });
        assert_eq!(features_from_probes(&dropped), ApiFeatures::NONE);
    }

    #[test]
    fn a_rejected_consumer_probe_means_no_partitionable_devices() {
        let mut results = echo(|_| {});
        results
            .iter_mut()
            .find(|(n, _)| n.ends_with("consumer"))
            .unwrap()
            .1 = None;
        assert_eq!(
            features_from_probes(&results),
            ApiFeatures {
                partitionable: false,
                ..ApiFeatures::ALL
            }
        );
    }

    #[test]
    fn feature_lists_parse_and_print_back() {
        assert_eq!("none".parse::<ApiFeatures>().unwrap(), ApiFeatures::NONE);
        let f: ApiFeatures = "partitionable,taints".parse().unwrap();
        assert_eq!(
            f,
            ApiFeatures {
                partitionable: true,
                consumable: false,
                taints: true
            }
        );
        assert_eq!(f.to_string(), "partitionable,taints");
        assert_eq!(ApiFeatures::NONE.to_string(), "none");
        assert!("partitionable,mig".parse::<ApiFeatures>().is_err());
    }
}
