//! A validator for published ResourceSlices, written from the `resource.k8s.io/v1` validation rules
//! (dra-api.md sections 2.1–2.6, the strictest of 1.34/1.35/1.36) plus the pool-level rules the
//! scheduler relies on (one generation per pool, the right slice count, counters that exist).
//! Every slice tessera publishes must pass it; tests run it on all golden output.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

use crate::cel::{Quantity, Semver};

pub const MAX_DEVICES: usize = 128;
pub const MAX_DEVICES_ADVANCED: usize = 64;
pub const MAX_ATTRIBUTES_AND_CAPACITIES: usize = 32;
pub const MAX_ATTRIBUTE_VALUE_LEN: usize = 64;
pub const MAX_COUNTER_SETS: usize = 8;
pub const MAX_COUNTERS_PER_SET: usize = 32;
pub const MAX_CONSUMPTIONS_PER_DEVICE: usize = 2;
pub const MAX_TAINTS: usize = 16;
pub const MAX_VALID_VALUES: usize = 10;

fn is_dns_label(s: &str) -> bool {
    tessera_api::device_name::is_dns_label(s)
}

fn is_dns_subdomain(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

fn is_c_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 32
        && !s.as_bytes()[0].is_ascii_digit()
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

fn is_qualified_name(s: &str) -> bool {
    match s.split_once('/') {
        Some((domain, id)) => is_dns_subdomain(domain, 63) && is_c_identifier(id),
        None => is_c_identifier(s),
    }
}

fn quantity(problems: &mut Vec<String>, at: &str, q: &str) -> Option<Quantity> {
    match Quantity::parse(q) {
        Ok(q) => Some(q),
        Err(e) => {
            problems.push(format!("{at}: {e}"));
            None
        }
    }
}

fn validate_device(p: &mut Vec<String>, at: &str, d: &Device) {
    if !is_dns_label(&d.name) {
        p.push(format!("{at}: device name {:?} is not a DNS label", d.name));
    }
    let attrs = d.attributes.as_ref().map_or(0, |a| a.len());
    let caps = d.capacity.as_ref().map_or(0, |c| c.len());
    if attrs + caps > MAX_ATTRIBUTES_AND_CAPACITIES {
        p.push(format!(
            "{at}: {attrs} attributes + {caps} capacities > {MAX_ATTRIBUTES_AND_CAPACITIES}"
        ));
    }
    for (name, a) in d.attributes.iter().flatten() {
        if !is_qualified_name(name) {
            p.push(format!("{at}: attribute name {name:?} is not a qualified name"));
        }
        let set = [
            a.int.is_some(),
            a.bool.is_some(),
            a.string.is_some(),
            a.version.is_some(),
            a.ints.is_some(),
            a.bools.is_some(),
            a.strings.is_some(),
            a.versions.is_some(),
        ]
        .iter()
        .filter(|x| **x)
        .count();
        if set != 1 {
            p.push(format!(
                "{at}: attribute {name} must have exactly one value, has {set}"
            ));
        }
        if let Some(s) = &a.string
            && s.len() > MAX_ATTRIBUTE_VALUE_LEN
        {
            p.push(format!(
                "{at}: attribute {name} longer than {MAX_ATTRIBUTE_VALUE_LEN}"
            ));
        }
        if let Some(v) = &a.version
            && (v.len() > MAX_ATTRIBUTE_VALUE_LEN || Semver::parse(v).is_err())
        {
            p.push(format!(
                "{at}: attribute {name} = {v:?} is not a semantic version of at most 64 characters"
            ));
        }
    }
    let multi = d.allow_multiple_allocations == Some(true);
    for (name, c) in d.capacity.iter().flatten() {
        if !is_qualified_name(name) {
            p.push(format!("{at}: capacity name {name:?} is not a qualified name"));
        }
        let cat = format!("{at}: capacity {name}");
        let Some(value) = quantity(p, &cat, &c.value.0) else {
            continue;
        };
        let Some(policy) = &c.request_policy else { continue };
        if !multi {
            p.push(format!(
                "{cat}: requestPolicy needs allowMultipleAllocations=true"
            ));
        }
        if policy.valid_range.is_some() && policy.valid_values.is_some() {
            p.push(format!("{cat}: at most one of validValues and validRange"));
        }
        let default = policy.default.as_ref().and_then(|q| quantity(p, &cat, &q.0));
        if let Some(values) = &policy.valid_values {
            let qs: Vec<Quantity> = values.iter().filter_map(|q| quantity(p, &cat, &q.0)).collect();
            if qs.len() > MAX_VALID_VALUES || qs.windows(2).any(|w| w[0] >= w[1]) {
                p.push(format!(
                    "{cat}: validValues must be at most 10, strictly ascending"
                ));
            }
            if let Some(d) = default
                && !qs.contains(&d)
            {
                p.push(format!("{cat}: default is not one of validValues"));
            }
            if qs.iter().any(|q| *q > value) {
                p.push(format!("{cat}: a valid value exceeds the capacity"));
            }
        }
        if let Some(r) = &policy.valid_range {
            let min = quantity(p, &cat, &r.min.0);
            let max = r.max.as_ref().and_then(|q| quantity(p, &cat, &q.0));
            let step = r.step.as_ref().and_then(|q| quantity(p, &cat, &q.0));
            if let Some(min) = min {
                if min > value || min.sign() < 0 {
                    p.push(format!("{cat}: validRange.min outside 0..=capacity"));
                }
                if let Some(max) = max
                    && (max < min || max > value)
                {
                    p.push(format!("{cat}: validRange.max must be within min..=capacity"));
                }
                if let Some(step) = step
                    && step.sign() <= 0
                {
                    p.push(format!("{cat}: validRange.step must be positive"));
                }
                if let Some(d) = default {
                    let above_max = max.is_some_and(|m| d > m);
                    let misaligned = step.is_some_and(|s| {
                        let (Some(off), Some(s)) =
                            (d.checked_sub(&min).and_then(|o| o.as_integer()), s.as_integer())
                        else {
                            return false;
                        };
                        s > 0 && off % s != 0
                    });
                    if d < min || above_max || misaligned {
                        p.push(format!("{cat}: default is not a valid value of validRange"));
                    }
                }
            }
        }
    }
    let consumptions = d.consumes_counters.as_deref().unwrap_or_default();
    if consumptions.len() > MAX_CONSUMPTIONS_PER_DEVICE {
        p.push(format!(
            "{at}: {} counter consumptions > {MAX_CONSUMPTIONS_PER_DEVICE}",
            consumptions.len()
        ));
    }
    for c in consumptions {
        if c.counters.len() > MAX_COUNTERS_PER_SET || c.counters.is_empty() {
            p.push(format!(
                "{at}: consumption of {} has {} counters (1..=32)",
                c.counter_set,
                c.counters.len()
            ));
        }
    }
    let taints = d.taints.as_deref().unwrap_or_default();
    if taints.len() > MAX_TAINTS {
        p.push(format!("{at}: more than {MAX_TAINTS} taints"));
    }
    for t in taints {
        if !matches!(t.effect.as_str(), "NoSchedule" | "NoExecute" | "None") {
            p.push(format!("{at}: taint {} has unknown effect {}", t.key, t.effect));
        }
    }
}

/// Problems of one slice on its own.
pub fn validate_slice(slice: &ResourceSlice) -> Vec<String> {
    let mut p = vec![];
    let name = slice.metadata.name.clone().unwrap_or_default();
    let at = format!("slice {name}");
    if !is_dns_subdomain(&name, 253) {
        p.push(format!(
            "{at}: name is not a DNS subdomain of at most 253 characters"
        ));
    }
    let spec = &slice.spec;
    if !is_dns_subdomain(&spec.driver, 63) {
        p.push(format!(
            "{at}: driver {:?} is not a DNS subdomain of at most 63",
            spec.driver
        ));
    }
    if spec.pool.name.len() > 253 || !spec.pool.name.split('/').all(|s| is_dns_subdomain(s, 253)) {
        p.push(format!("{at}: pool name {:?} is invalid", spec.pool.name));
    }
    if spec.pool.resource_slice_count <= 0 || spec.pool.generation < 0 {
        p.push(format!(
            "{at}: pool generation must be >= 0 and resourceSliceCount > 0"
        ));
    }
    let selections = [
        spec.node_name.is_some(),
        spec.node_selector.is_some(),
        spec.all_nodes == Some(true),
        spec.per_device_node_selection == Some(true),
    ]
    .iter()
    .filter(|x| **x)
    .count();
    if selections != 1 {
        p.push(format!(
            "{at}: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection"
        ));
    }
    let devices = spec.devices.as_deref().unwrap_or_default();
    let sets = spec.shared_counters.as_deref().unwrap_or_default();
    if !devices.is_empty() && !sets.is_empty() {
        p.push(format!(
            "{at}: only one of devices and sharedCounters can be set (1.35+)"
        ));
    }
    let advanced = devices
        .iter()
        .any(|d| d.consumes_counters.is_some() || d.taints.is_some());
    let limit = if advanced {
        MAX_DEVICES_ADVANCED
    } else {
        MAX_DEVICES
    };
    if devices.len() > limit {
        p.push(format!("{at}: {} devices > {limit}", devices.len()));
    }
    for d in devices {
        validate_device(&mut p, &format!("{at} device {}", d.name), d);
    }
    if sets.len() > MAX_COUNTER_SETS {
        p.push(format!("{at}: {} counter sets > {MAX_COUNTER_SETS}", sets.len()));
    }
    for s in sets {
        if !is_dns_label(&s.name) {
            p.push(format!("{at}: counter set name {:?} is not a DNS label", s.name));
        }
        if s.counters.is_empty() || s.counters.len() > MAX_COUNTERS_PER_SET {
            p.push(format!(
                "{at}: counter set {} has {} counters (1..=32)",
                s.name,
                s.counters.len()
            ));
        }
        for (c, v) in &s.counters {
            if !is_dns_label(c) {
                p.push(format!("{at}: counter name {c:?} is not a DNS label"));
            }
            quantity(&mut p, &format!("{at}: counter {c}"), &v.value.0);
        }
    }
    p
}

/// Problems of a whole pool: every slice, plus names unique in the pool, one generation, the slice count,
/// and every consumed counter defined with enough capacity for the device alone.
pub fn validate_pool(slices: &[ResourceSlice]) -> Vec<String> {
    let mut p: Vec<String> = slices.iter().flat_map(validate_slice).collect();
    let generations: BTreeSet<i64> = slices.iter().map(|s| s.spec.pool.generation).collect();
    if generations.len() > 1 {
        p.push(format!("pool has several generations: {generations:?}"));
    }
    for s in slices {
        if s.spec.pool.resource_slice_count != slices.len() as i64 {
            p.push(format!(
                "slice {:?}: resourceSliceCount {} but the pool has {} slices",
                s.metadata.name,
                s.spec.pool.resource_slice_count,
                slices.len()
            ));
        }
    }
    let mut device_names = BTreeSet::new();
    let mut sets: BTreeMap<&str, BTreeMap<&str, Quantity>> = BTreeMap::new();
    for s in slices {
        for set in s.spec.shared_counters.iter().flatten() {
            let counters = set
                .counters
                .iter()
                .filter_map(|(k, v)| Quantity::parse(&v.value.0).ok().map(|q| (k.as_str(), q)))
                .collect();
            if sets.insert(set.name.as_str(), counters).is_some() {
                p.push(format!("counter set {} defined twice in the pool", set.name));
            }
        }
    }
    for s in slices {
        for d in s.spec.devices.iter().flatten() {
            if !device_names.insert(d.name.as_str()) {
                p.push(format!("device {} appears twice in the pool", d.name));
            }
            for c in d.consumes_counters.iter().flatten() {
                let Some(set) = sets.get(c.counter_set.as_str()) else {
                    p.push(format!(
                        "device {} consumes from unknown counter set {}",
                        d.name, c.counter_set
                    ));
                    continue;
                };
                for (name, v) in &c.counters {
                    match (set.get(name.as_str()), Quantity::parse(&v.value.0)) {
                        (Some(have), Ok(need)) if need <= *have => {}
                        _ => p.push(format!(
                            "device {} needs more {name} than set {} has",
                            d.name, c.counter_set
                        )),
                    }
                }
            }
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{Counter, CounterSet, DeviceAttribute, DeviceCounterConsumption};

    use super::*;
    use crate::{
        features::ApiFeatures,
        fixtures::{GpuModel, node},
        render::render,
    };

    fn h100_pool() -> Vec<ResourceSlice> {
        render(
            &[node("n").gpus(GpuModel::H100Sxm5_80gb, 2).build()],
            None,
            ApiFeatures::ALL,
        )
        .unwrap()
    }

    fn assert_rejects(slices: &[ResourceSlice], needle: &str) {
        let problems = validate_pool(slices);
        assert!(
            problems.iter().any(|p| p.contains(needle)),
            "expected {needle:?} in {problems:#?}"
        );
    }

    #[test]
    fn a_valid_pool_has_no_problems() {
        assert_eq!(validate_pool(&h100_pool()), Vec::<String>::new());
    }

    #[test]
    fn devices_and_counters_in_one_slice_are_rejected() {
        let mut pool = h100_pool();
        pool[1].spec.shared_counters = pool[0].spec.shared_counters.clone();
        assert_rejects(&pool, "only one of devices and sharedCounters");
    }

    #[test]
    fn more_than_64_devices_with_counters_in_a_slice_are_rejected() {
        let mut pool = h100_pool();
        let extra: Vec<Device> = pool[2].spec.devices.clone().unwrap();
        pool[1]
            .spec
            .devices
            .as_mut()
            .unwrap()
            .extend(extra.iter().cloned().map(|mut d| {
                d.name = format!("x{}", d.name);
                d
            }));
        pool[1]
            .spec
            .devices
            .as_mut()
            .unwrap()
            .extend(extra.into_iter().map(|mut d| {
                d.name = format!("y{}", d.name);
                d
            }));
        assert_rejects(&pool, "78 devices > 64");
    }

    #[test]
    fn long_strings_bad_names_and_unknown_counter_sets_are_rejected() {
        let mut pool = h100_pool();
        let d = &mut pool[1].spec.devices.as_mut().unwrap()[0];
        d.attributes.as_mut().unwrap().insert(
            "productName".into(),
            DeviceAttribute {
                string: Some("x".repeat(65)),
                ..Default::default()
            },
        );
        d.attributes.as_mut().unwrap().insert(
            "driverVersion".into(),
            DeviceAttribute {
                version: Some("580.159.03".into()),
                ..Default::default()
            },
        );
        d.consumes_counters
            .as_mut()
            .unwrap()
            .push(DeviceCounterConsumption {
                counter_set: "nope".into(),
                counters: [(
                    "memory".to_string(),
                    Counter {
                        value: k8s_openapi::apimachinery::pkg::api::resource::Quantity("1".into()),
                    },
                )]
                .into(),
                ..Default::default()
            });
        pool[2].spec.devices.as_mut().unwrap()[0].name = "GPU_1".into();
        assert_rejects(&pool, "longer than 64");
        assert_rejects(&pool, "not a semantic version");
        assert_rejects(&pool, "unknown counter set nope");
        assert_rejects(&pool, "not a DNS label");
    }

    #[test]
    fn too_many_counter_sets_too_many_consumptions_and_a_wrong_slice_count_are_rejected() {
        let mut pool = h100_pool();
        let set = CounterSet {
            name: "s".into(),
            counters: [(
                "c".to_string(),
                Counter {
                    value: k8s_openapi::apimachinery::pkg::api::resource::Quantity("1".into()),
                },
            )]
            .into(),
        };
        let sets = pool[0].spec.shared_counters.as_mut().unwrap();
        for i in 0..7 {
            sets.push(CounterSet {
                name: format!("s{i}"),
                ..set.clone()
            });
        }
        let d = &mut pool[1].spec.devices.as_mut().unwrap()[0];
        let c = d.consumes_counters.clone().unwrap()[0].clone();
        d.consumes_counters.as_mut().unwrap().extend([c.clone(), c]);
        pool[2].spec.pool.resource_slice_count = 7;
        assert_rejects(&pool, "9 counter sets > 8");
        assert_rejects(&pool, "3 counter consumptions > 2");
        assert_rejects(&pool, "resourceSliceCount 7 but the pool has 3 slices");
    }

    #[test]
    fn a_request_policy_outside_its_capacity_is_rejected() {
        let mut pool = render(
            &[node("n").gpus(GpuModel::H100Sxm5_80gb, 1).build()],
            Some(&crate::render::parse_policy("p", "apiVersion: gpu.tessera.dev/v1alpha1\nkind: GpuPolicy\nmetadata: {name: default}\nspec:\n  rules:\n  - name: s\n    shared: {strategy: MPS}\n").unwrap()),
            ApiFeatures::ALL,
        )
        .unwrap();
        assert_eq!(validate_pool(&pool), Vec::<String>::new());
        let d = &mut pool[0].spec.devices.as_mut().unwrap()[0];
        let compute = d.capacity.as_mut().unwrap().get_mut("compute").unwrap();
        compute.request_policy.as_mut().unwrap().default = Some(
            k8s_openapi::apimachinery::pkg::api::resource::Quantity("101".into()),
        );
        d.allow_multiple_allocations = None;
        assert_rejects(&pool, "default is not a valid value");
        assert_rejects(&pool, "requestPolicy needs allowMultipleAllocations");
    }
}
