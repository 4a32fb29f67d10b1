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

/// Server answers recorded from real API servers (tests/fixtures/feature-probes/record.sh sends
/// requests.json, the probes below, exactly as `runtime.rs` does and stores status and body), read back
/// through the same rule `runtime.rs` applies: a created object is the server's answer, a 400 or 422 is a
/// rejected probe. 1.34 and 1.35 control planes are not built here (a cold build takes 20-30 minutes of
/// the shared two cores), so their answers are derived from the recorded 1.36.5 ones by dropping what
/// dra-api.md section 6 says those versions' API servers drop; each derivation names the rule it applies.
#[cfg(test)]
mod recorded {
    use super::*;
    use serde_json::Value;

    const REQUESTS: &str = include_str!("../tests/fixtures/feature-probes/requests.json");
    const V1_37_2: &str = include_str!("../tests/fixtures/feature-probes/v1.37.2.json");
    const V1_36_5: &str = include_str!("../tests/fixtures/feature-probes/v1.36.5.json");
    const V1_36_5_BETA_GATES_OFF: &str =
        include_str!("../tests/fixtures/feature-probes/v1.36.5-beta-gates-off.json");
    const V1_37_2_BETA_GATES_OFF: &str =
        include_str!("../tests/fixtures/feature-probes/v1.37.2-beta-gates-off.json");

    type Answers = Vec<(String, Option<ResourceSlice>)>;

    fn answers(recorded: &str) -> Answers {
        let v: Value = serde_json::from_str(recorded).expect("recorded answers are JSON");
        v["answers"]
            .as_array()
            .expect("recorded answers have an `answers` list")
            .iter()
            .map(|a| {
                let name = a["probe"].as_str().expect("answer names its probe").to_string();
                let slice = match a["code"].as_u64() {
                    Some(200 | 201) => Some(
                        serde_json::from_value(a["body"].clone())
                            .expect("a created probe comes back as a ResourceSlice"),
                    ),
                    Some(400 | 422) => None,
                    other => panic!("probe {name}: status {other:?} would fail the controller's probing"),
                };
                (name, slice)
            })
            .collect()
    }

    fn server(recorded: &str) -> String {
        let v: Value = serde_json::from_str(recorded).unwrap();
        v["server"].as_str().unwrap().to_string()
    }

    /// Which optional resource.k8s.io fields a server keeps (dra-api.md section 6, "Field dropping when a
    /// gate is off").
    struct Gates {
        partitionable: bool,
        consumable: bool,
        taints: bool,
    }

    /// What a server with these gates answers where a 1.36.5 server answered `answers`: the same object with
    /// the disabled gates' fields dropped.
    fn with_gates(mut answers: Answers, g: Gates) -> Answers {
        for s in answers.iter_mut().filter_map(|(_, s)| s.as_mut()) {
            if !g.partitionable {
                s.spec.shared_counters = None;
            }
            for d in s.spec.devices.iter_mut().flatten() {
                if !g.partitionable {
                    d.consumes_counters = None;
                }
                if !g.consumable {
                    d.allow_multiple_allocations = None;
                    for c in d.capacity.iter_mut().flat_map(|c| c.values_mut()) {
                        c.request_policy = None;
                    }
                }
                if !g.taints {
                    d.taints = None;
                }
            }
        }
        answers
    }

    fn rejected(mut answers: Answers, kind: &str) -> Answers {
        for (name, s) in &mut answers {
            if name == &format!("{PROBE_PREFIX}-{kind}") {
                *s = None;
            }
        }
        answers
    }

    #[test]
    fn the_recorded_requests_are_the_probes_the_controller_sends() {
        let recorded: Value = serde_json::from_str(REQUESTS).unwrap();
        assert_eq!(
            serde_json::to_value(probe_slices()).unwrap(),
            recorded,
            "probe_slices() changed: re-record tests/fixtures/feature-probes (record.sh) against 1.36 and 1.37"
        );
    }

    #[test]
    fn a_1_37_2_server_keeps_partitionable_devices_consumable_capacity_and_taints() {
        assert_eq!(server(V1_37_2), "v1.37.2");
        assert_eq!(features_from_probes(&answers(V1_37_2)), ApiFeatures::ALL);
    }

    #[test]
    fn a_1_37_2_server_with_its_beta_gates_off_keeps_taints_and_falls_back_for_mig_and_shares() {
        // Recorded with --feature-gates=DRAPartitionableDevices=false,DRAConsumableCapacity=false (both
        // beta in 1.37; DRADeviceTaints is GA there).
        assert_eq!(
            features_from_probes(&answers(V1_37_2_BETA_GATES_OFF)),
            ApiFeatures {
                partitionable: false,
                consumable: false,
                taints: true,
            }
        );
    }

    #[test]
    fn a_1_36_5_server_keeps_partitionable_devices_consumable_capacity_and_taints() {
        assert_eq!(server(V1_36_5), "v1.36.5");
        assert_eq!(features_from_probes(&answers(V1_36_5)), ApiFeatures::ALL);
    }

    #[test]
    fn a_1_36_5_server_with_its_dra_beta_gates_off_gets_every_fallback() {
        // Recorded with --feature-gates=DRAPartitionableDevices=false,DRAConsumableCapacity=false,
        // DRADeviceTaints=false: the server accepts every probe and silently drops the fields.
        assert!(answers(V1_36_5_BETA_GATES_OFF).iter().all(|(_, s)| s.is_some()));
        assert_eq!(
            features_from_probes(&answers(V1_36_5_BETA_GATES_OFF)),
            ApiFeatures::NONE
        );
    }

    #[test]
    fn a_1_35_server_with_default_gates_gets_static_mig_and_fixed_share_slots() {
        // 1.35 defaults: DRAPartitionableDevices, DRAConsumableCapacity and DRADeviceTaints alpha and off.
        let derived = with_gates(
            answers(V1_36_5),
            Gates {
                partitionable: false,
                consumable: false,
                taints: false,
            },
        );
        assert_eq!(features_from_probes(&derived), ApiFeatures::NONE);
        // The derivation agrees with what a real server with those gates off answered.
        assert_eq!(
            features_from_probes(&derived),
            features_from_probes(&answers(V1_36_5_BETA_GATES_OFF))
        );
    }

    #[test]
    fn a_1_35_server_with_the_alpha_gates_enabled_by_hand_uses_them() {
        // 1.35 has the split-slice counter layout tessera publishes (dra-api.md 2.5) and keeps every field
        // whose gate is on, so it answers like 1.36.
        let derived = with_gates(
            answers(V1_36_5),
            Gates {
                partitionable: true,
                consumable: true,
                taints: true,
            },
        );
        assert_eq!(features_from_probes(&derived), ApiFeatures::ALL);
    }

    #[test]
    fn a_1_34_server_with_default_gates_gets_static_mig_and_fixed_share_slots() {
        // 1.34 defaults are those of 1.35 for these three gates (all alpha and off).
        let derived = with_gates(
            answers(V1_36_5),
            Gates {
                partitionable: false,
                consumable: false,
                taints: false,
            },
        );
        assert_eq!(features_from_probes(&derived), ApiFeatures::NONE);
    }

    #[test]
    fn a_1_34_server_with_partitionable_devices_enabled_still_gets_static_mig() {
        // 1.34 validates counters against the consuming device's own slice (dra-api.md 2.5): it rejects the
        // consumer probe, whose counter set lives in another slice, so tessera keeps static MIG layouts there
        // while using the gates that do work.
        let derived = rejected(
            with_gates(
                answers(V1_36_5),
                Gates {
                    partitionable: true,
                    consumable: true,
                    taints: true,
                },
            ),
            "consumer",
        );
        assert_eq!(
            features_from_probes(&derived),
            ApiFeatures {
                partitionable: false,
                ..ApiFeatures::ALL
            }
        );
    }
}
