//! Golden output and invariants of every built-in device model on the simulated nodes.

mod support;

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};
use tessera_api::{DeviceName, MigPlacement, NodeInventory};
use tessera_controller::{cel::Quantity, validate::validate_pool};

use support::*;

#[test]
fn rendered_slices_match_the_golden_files() {
    for (node_name, inv) in nodes() {
        for case in models() {
            let slices = render_case(&inv, &case);
            let json = serde_json::to_string_pretty(&slices).unwrap() + "\n";
            let path = repo_root().join(format!("controller/tests/golden/{node_name}-{}.json", case.name));
            check_golden(&path, &json);
        }
    }
}

#[test]
fn every_published_pool_passes_the_v1_validator() {
    for (node_name, inv) in nodes() {
        for case in models().into_iter().chain([dynamic_mig_with_memory_counter()]) {
            let slices = render_case(&inv, &case);
            assert!(!slices.is_empty());
            let problems = validate_pool(&slices);
            assert!(problems.is_empty(), "{node_name}/{}: {problems:#?}", case.name);
        }
    }
}

/// Device count per node for each model (8 GPUs per node).
#[test]
fn each_model_publishes_the_expected_number_of_devices() {
    let expected: BTreeMap<(&str, &str), usize> = [
        // 25 placements + the whole GPU per GPU.
        (("h100", "dynamic-mig"), 8 * 26),
        (("h200", "dynamic-mig"), 8 * 26),
        (("mixed", "dynamic-mig"), 8 * 26),
        (("h100", "default"), 8 * 26),
        (("mixed", "default"), 8 * 26),
        (("h100", "whole"), 8),
        (("mixed", "whole"), 8),
        (("h100", "shared"), 8),
        (("h100", "static-mig-fallback"), 8 * 4),
        (("mixed", "static-mig-fallback"), 8 * 4),
        (("h100", "slot-fallback"), 8 * 4),
        (("h200", "slot-fallback"), 8 * 4),
    ]
    .into();
    for (node_name, inv) in nodes() {
        for case in models() {
            if let Some(n) = expected.get(&(node_name, case.name)) {
                assert_eq!(
                    devices(&render_case(&inv, &case)).len(),
                    *n,
                    "{node_name}/{}",
                    case.name
                );
            }
        }
    }
}

#[test]
fn dynamic_mig_keeps_counters_and_devices_in_separate_slices_with_one_slice_per_gpu() {
    let slices = render_case(&h100_node(), &models()[2]);
    assert_eq!(
        slices.len(),
        1 + 8,
        "one counter slice (8 sets) and one device slice per GPU"
    );
    let counters = &slices[0];
    assert!(counters.spec.devices.is_none());
    assert_eq!(counters.spec.shared_counters.as_ref().unwrap().len(), 8);
    for s in &slices[1..] {
        assert!(s.spec.shared_counters.is_none());
        let gpus: std::collections::BTreeSet<u32> = s
            .spec
            .devices
            .iter()
            .flatten()
            .map(|d| d.name.parse::<DeviceName>().unwrap().gpu())
            .collect();
        assert_eq!(gpus.len(), 1, "{:?} mixes GPUs", s.metadata.name);
    }
    for s in &slices {
        assert_eq!(s.spec.pool.name, "h100-node");
        assert_eq!(s.spec.node_name.as_deref(), Some("h100-node"));
        assert_eq!(s.spec.pool.resource_slice_count, 9);
        assert_eq!(s.spec.pool.generation, 1);
    }
}

fn counters_of(slices: &[ResourceSlice]) -> BTreeMap<String, BTreeMap<String, Quantity>> {
    slices
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .map(|set| {
            let c = set
                .counters
                .iter()
                .map(|(k, v)| (k.clone(), Quantity::parse(&v.value.0).unwrap()))
                .collect();
            (set.name.clone(), c)
        })
        .collect()
}

/// Simulates the allocator's counter check for a set of devices allocated together.
fn fits_together(devices: &[&Device], sets: &BTreeMap<String, BTreeMap<String, Quantity>>) -> bool {
    let mut left = sets.clone();
    for d in devices {
        for c in d.consumes_counters.iter().flatten() {
            let set = left.get_mut(&c.counter_set).expect("counter set exists");
            for (name, v) in &c.counters {
                let have = set.get_mut(name).expect("counter exists");
                *have = have.checked_sub(&Quantity::parse(&v.value.0).unwrap()).unwrap();
                if have.sign() < 0 {
                    return false;
                }
            }
        }
    }
    true
}

fn placement(inv: &NodeInventory, d: &Device) -> Option<(String, MigPlacement, u32)> {
    match d.name.parse::<DeviceName>().ok()? {
        DeviceName::Mig { gpu, profile, start } => {
            let p = inv.spec.gpus[gpu as usize].mig.as_ref()?.profile(&profile)?;
            Some((
                profile.clone(),
                MigPlacement {
                    start,
                    size: p.memory_slices,
                },
                p.instance_count,
            ))
        }
        _ => None,
    }
}

/// For every pair of devices of one GPU: both can be allocated together iff they are MIG placements that
/// do not overlap (and not two instances of a single-instance profile such as `1g.10gb+me`); the whole GPU
/// goes with nothing. Also every device fits alone.
#[test]
fn mig_devices_can_be_allocated_together_exactly_when_their_placements_do_not_overlap() {
    for ((node_name, inv), case) in nodes().into_iter().flat_map(|n| {
        [
            (n.clone(), models().swap_remove(2)),
            (n, dynamic_mig_with_memory_counter()),
        ]
    }) {
        let slices = render_case(&inv, &case);
        let sets = counters_of(&slices);
        let mut by_gpu: BTreeMap<u32, Vec<&Device>> = BTreeMap::new();
        for d in devices(&slices) {
            by_gpu
                .entry(d.name.parse::<DeviceName>().unwrap().gpu())
                .or_default()
                .push(d);
        }
        let mut pairs = 0;
        for devs in by_gpu.values() {
            assert_eq!(devs.len(), 26);
            for (i, a) in devs.iter().enumerate() {
                assert!(fits_together(&[a], &sets), "{} does not fit alone", a.name);
                for b in &devs[i + 1..] {
                    let expected = match (placement(&inv, a), placement(&inv, b)) {
                        (Some((pa, la, max)), Some((pb, lb, _))) => {
                            !(la.overlaps(&lb) || (pa == pb && max == 1))
                        }
                        _ => false,
                    };
                    assert_eq!(
                        fits_together(&[a, b], &sets),
                        expected,
                        "{node_name}/{}: {} + {}",
                        case.name,
                        a.name,
                        b.name
                    );
                    pairs += 1;
                }
            }
        }
        assert_eq!(pairs, 8 * 26 * 25 / 2);
    }
}

/// Beyond pairs: every set of non-overlapping MIG placements on a GPU fits the published counters exactly
/// when it keeps to each profile's `instanceCount`, the hardware's own rule. This is what lets the
/// controller leave out counters no such set can overdraw.
#[test]
fn every_set_of_non_overlapping_placements_fits_exactly_when_the_hardware_allows_it() {
    fn walk<'a>(
        devs: &'a [(&'a Device, String, MigPlacement, u32)],
        from: usize,
        chosen: &mut Vec<&'a (&'a Device, String, MigPlacement, u32)>,
        sets: &BTreeMap<String, BTreeMap<String, Quantity>>,
        checked: &mut usize,
        gpu: &str,
    ) {
        let allowed = chosen
            .iter()
            .all(|(_, p, _, max)| chosen.iter().filter(|(_, q, _, _)| q == p).count() as u32 <= *max);
        let together: Vec<&Device> = chosen.iter().map(|(d, ..)| *d).collect();
        assert_eq!(
            fits_together(&together, sets),
            allowed,
            "{gpu}: {:?}",
            together.iter().map(|d| &d.name).collect::<Vec<_>>()
        );
        *checked += 1;
        for i in from..devs.len() {
            let (_, _, pl, _) = &devs[i];
            if chosen.iter().any(|(_, _, c, _)| c.overlaps(pl)) {
                continue;
            }
            chosen.push(&devs[i]);
            walk(devs, i + 1, chosen, sets, checked, gpu);
            chosen.pop();
        }
    }
    for ((node_name, inv), case) in nodes().into_iter().flat_map(|n| {
        [
            (n.clone(), models().swap_remove(2)),
            (n, dynamic_mig_with_memory_counter()),
        ]
    }) {
        let slices = render_case(&inv, &case);
        let sets = counters_of(&slices);
        let mut by_gpu: BTreeMap<u32, Vec<(&Device, String, MigPlacement, u32)>> = BTreeMap::new();
        for d in devices(&slices) {
            if let Some((profile, pl, max)) = placement(&inv, d) {
                by_gpu
                    .entry(d.name.parse::<DeviceName>().unwrap().gpu())
                    .or_default()
                    .push((d, profile, pl, max));
            }
        }
        let mut checked = 0;
        for (gpu, devs) in &by_gpu {
            walk(
                devs,
                0,
                &mut vec![],
                &sets,
                &mut checked,
                &format!("{node_name}/{} GPU {gpu}", case.name),
            );
        }
        // Thousands of layouts per GPU, not a handful: the walk really enumerated them.
        assert!(checked > 1000 * by_gpu.len(), "{node_name}: only {checked} sets");
    }
}

/// A full hardware layout such as 4g + 3g, or seven 1g, fits the counters.
#[test]
fn full_mig_layouts_fit_the_counters() {
    let inv = h100_node();
    let slices = render_case(&inv, &models()[2]);
    let sets = counters_of(&slices);
    let all = devices(&slices);
    let find = |name: &str| {
        *all.iter()
            .find(|d| d.name == name)
            .unwrap_or_else(|| panic!("{name}"))
    };
    let layouts: [&[&str]; 4] = [
        &["gpu-0-mig-4g-40gb-0", "gpu-0-mig-3g-40gb-4"],
        &[
            "gpu-0-mig-1g-10gb-0",
            "gpu-0-mig-1g-10gb-1",
            "gpu-0-mig-1g-10gb-2",
            "gpu-0-mig-1g-10gb-3",
            "gpu-0-mig-1g-10gb-4",
            "gpu-0-mig-1g-10gb-5",
            "gpu-0-mig-1g-10gb-plus-me-6",
        ],
        &[
            "gpu-0-mig-2g-20gb-0",
            "gpu-0-mig-2g-20gb-2",
            "gpu-0-mig-2g-20gb-4",
            "gpu-0-mig-1g-20gb-6",
        ],
        &[
            "gpu-0-mig-4g-40gb-0",
            "gpu-0-mig-1g-10gb-4",
            "gpu-0-mig-1g-10gb-5",
            "gpu-0-mig-1g-20gb-6",
        ],
    ];
    for layout in layouts {
        let devs: Vec<&Device> = layout.iter().map(|n| find(n)).collect();
        assert!(fits_together(&devs, &sets), "{layout:?}");
    }
}

/// First fit over the device order packs small instances from the top of the GPU, so the bottom half,
/// the only place for a 4g, stays free as long as the small ones fit in the top half.
#[test]
fn first_fit_in_slice_order_keeps_the_bottom_half_free_for_large_profiles() {
    let inv = h100_node();
    let slices = render_case(&inv, &models()[2]);
    let sets = counters_of(&slices);
    let gpu0: Vec<&Device> = slices[1].spec.devices.iter().flatten().collect();
    let first_fit = |requests: &[&str]| -> Vec<&Device> {
        let mut taken: Vec<&Device> = vec![];
        for profile in requests {
            let pick = gpu0
                .iter()
                .copied()
                .find(|d| {
                    let p = d
                        .attributes
                        .as_ref()
                        .and_then(|a| a.get("profile"))
                        .and_then(|p| p.string.as_deref());
                    let mut with = taken.clone();
                    with.push(d);
                    p == Some(*profile)
                        && !taken.iter().any(|t| t.name == d.name)
                        && fits_together(&with, &sets)
                })
                .expect("a placement is free");
            taken.push(pick);
        }
        taken
    };
    let four_g = gpu0
        .iter()
        .copied()
        .find(|d| d.name == "gpu-0-mig-4g-40gb-0")
        .unwrap();
    for (requests, expected) in [
        (
            &["1g.10gb", "1g.10gb", "1g.10gb"][..],
            &[
                "gpu-0-mig-1g-10gb-6",
                "gpu-0-mig-1g-10gb-5",
                "gpu-0-mig-1g-10gb-4",
            ][..],
        ),
        (&["2g.20gb"], &["gpu-0-mig-2g-20gb-4"]),
        (&["3g.40gb"], &["gpu-0-mig-3g-40gb-4"]),
        (
            &["1g.20gb", "1g.10gb"],
            &["gpu-0-mig-1g-20gb-6", "gpu-0-mig-1g-10gb-5"],
        ),
    ] {
        let mut taken = first_fit(requests);
        let names: Vec<&str> = taken.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, expected);
        taken.push(four_g);
        assert!(
            fits_together(&taken, &sets),
            "a 4g no longer fits after {requests:?}"
        );
    }
}

/// "10Gi and 25% of an H100": the scheduler packs four such claims per shared GPU.
#[test]
fn shared_gpus_pack_several_claims_by_memory_and_compute() {
    let slices = render_case(&h100_node(), &models()[3]);
    let d = devices(&slices)
        .into_iter()
        .find(|d| d.name == "gpu-0-shared")
        .unwrap();
    assert_eq!(d.allow_multiple_allocations, Some(true));
    let cap = d.capacity.as_ref().unwrap();
    let mem = Quantity::parse(
        &cap["memory"]
            .request_policy
            .as_ref()
            .unwrap()
            .valid_range
            .as_ref()
            .unwrap()
            .max
            .as_ref()
            .unwrap()
            .0,
    )
    .unwrap();
    let compute = Quantity::parse(&cap["compute"].value.0).unwrap();
    let per_claim_mem = Quantity::parse("10Gi").unwrap();
    let (mut m, mut c, mut claims) = (mem, compute, 0);
    while let (Some(m2), Some(c2)) = (
        m.checked_sub(&per_claim_mem),
        c.checked_sub(&Quantity::from_int(25)),
    ) {
        if m2.sign() < 0 || c2.sign() < 0 {
            break;
        }
        (m, c, claims) = (m2, c2, claims + 1);
    }
    assert_eq!(claims, 4);
    let attrs = d.attributes.as_ref().unwrap();
    assert_eq!(attrs["sharingStrategy"].string.as_deref(), Some("MPS"));
    assert_eq!(attrs["type"].string.as_deref(), Some("shared"));
}

#[test]
fn slots_split_memory_and_compute_equally() {
    let slices = render_case(&h100_node(), &models()[5]);
    let slots: Vec<&Device> = devices(&slices)
        .into_iter()
        .filter(|d| d.name.starts_with("gpu-0-share-"))
        .collect();
    assert_eq!(slots.len(), 4);
    for s in slots {
        let cap = s.capacity.as_ref().unwrap();
        assert_eq!(cap["compute"].value.0, "25");
        assert_eq!(
            Quantity::parse(&cap["memory"].value.0).unwrap().as_integer(),
            Some((81559 / 4) << 20)
        );
        assert!(s.allow_multiple_allocations.is_none());
    }
}

#[test]
fn static_layouts_publish_non_overlapping_instances_without_counters() {
    for (_, inv) in nodes() {
        let slices = render_case(&inv, &models()[4]);
        assert!(slices.iter().all(|s| s.spec.shared_counters.is_none()));
        let devs = devices(&slices);
        for a in &devs {
            assert!(a.consumes_counters.is_none());
            for b in &devs {
                if a.name != b.name
                    && let (Some((_, pa, _)), Some((_, pb, _))) = (placement(&inv, a), placement(&inv, b))
                    && a.name.parse::<DeviceName>().unwrap().gpu()
                        == b.name.parse::<DeviceName>().unwrap().gpu()
                {
                    assert!(!pa.overlaps(&pb), "{} overlaps {}", a.name, b.name);
                }
            }
        }
    }
}

/// A policy of one rule `model` (YAML flow text) with `warm` (a YAML flow text, or none).
fn one_rule(model: &str, warm: Option<&str>) -> String {
    let warm = warm.map(|w| format!("\n    warm: {w}")).unwrap_or_default();
    format!(
        "apiVersion: gpu.tessera.dev/v1alpha1\nkind: GpuPolicy\nmetadata: {{name: default}}\nspec:\n  rules:\n  \
         - name: r\n    {model}{warm}\n"
    )
}

fn warm_seconds(d: &Device) -> Option<i64> {
    d.attributes
        .as_ref()?
        .get(tessera_api::attributes::WARM_SECONDS)?
        .int
}

fn render_policy(text: &str) -> Result<Vec<ResourceSlice>, tessera_controller::render::RenderError> {
    let p = policy(text);
    tessera_controller::render::render(
        std::slice::from_ref(&h100_node()),
        Some(&p),
        tessera_controller::features::ApiFeatures::ALL,
    )
}

#[test]
fn a_warm_rule_publishes_warm_seconds_on_every_device_the_plugin_makes_and_not_on_the_whole_gpu() {
    let slices = render_policy(&one_rule("dynamicMig: {}", Some("{window: 10m}"))).unwrap();
    let all = devices(&slices);
    let (whole, mig): (Vec<&&Device>, Vec<&&Device>) = all
        .iter()
        .partition(|d| matches!(d.name.parse::<DeviceName>(), Ok(DeviceName::Gpu { .. })));
    assert_eq!(whole.len(), 8);
    assert!(whole.iter().all(|d| warm_seconds(d).is_none()));
    assert_eq!(mig.len(), 8 * 25);
    assert!(
        mig.iter().all(|d| warm_seconds(d) == Some(600)),
        "every MIG placement"
    );

    let slices = render_policy(&one_rule("shared: {strategy: MPS}", Some("{window: 90s}"))).unwrap();
    assert!(devices(&slices).iter().all(|d| warm_seconds(d) == Some(90)));
}

#[test]
fn a_rule_without_warm_or_with_a_zero_window_publishes_no_warm_seconds() {
    for warm in [None, Some("{window: 0s}")] {
        let slices = render_policy(&one_rule("dynamicMig: {}", warm)).unwrap();
        assert!(
            devices(&slices).iter().all(|d| warm_seconds(d).is_none()),
            "{warm:?}"
        );
    }
}

#[test]
fn warm_on_a_whole_gpu_rule_or_with_an_unusable_window_is_refused_naming_the_rule_and_the_fix() {
    for (model, warm, says) in [
        (
            "whole: {}",
            "{window: 5m}",
            "set it on a dynamicMig, staticMig or shared rule",
        ),
        ("dynamicMig: {}", "{window: 5 minutes}", "warm.window"),
        ("shared: {strategy: MPS}", "{window: 25h}", "use staticMig"),
    ] {
        let err = render_policy(&one_rule(model, Some(warm)))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rule \"r\"") && err.contains(says),
            "{model} {warm}: {err}"
        );
    }
}

fn mps_tenancy(d: &Device) -> Option<&str> {
    d.attributes
        .as_ref()?
        .get(tessera_api::attributes::MPS_TENANCY)?
        .string
        .as_deref()
}

#[test]
fn a_shared_tenancy_rule_publishes_mps_tenancy_and_the_default_publishes_none() {
    for (model, expected) in [
        ("shared: {strategy: MPS, tenancy: Shared}", Some("Shared")),
        ("shared: {strategy: MPS, tenancy: Namespace}", None),
        ("shared: {strategy: MPS}", None),
    ] {
        let slices = render_policy(&one_rule(model, None)).unwrap();
        let all = devices(&slices);
        assert!(!all.is_empty());
        assert!(all.iter().all(|d| mps_tenancy(d) == expected), "{model}");
    }
}

#[test]
fn a_tenancy_on_a_time_sliced_rule_or_an_unknown_tenancy_is_refused_naming_the_field() {
    let err = render_policy(&one_rule(
        "shared: {strategy: TimeSlicing, tenancy: Shared}",
        None,
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("rule \"r\"") && err.contains("shared.tenancy applies to strategy MPS only"),
        "{err}"
    );
    let unknown = tessera_controller::render::parse_policy(
        "test",
        &one_rule("shared: {strategy: MPS, tenancy: PerPod}", None),
    )
    .unwrap_err()
    .to_string();
    assert!(
        unknown.contains("tenancy") && unknown.contains("Namespace") && unknown.contains("Shared"),
        "{unknown}"
    );
}

fn memory_consumed(d: &Device) -> Option<Quantity> {
    let c = d.consumes_counters.as_ref()?.first()?.counters.get("memory")?;
    Some(Quantity::parse(&c.value.0).unwrap())
}

/// `quotaCounters: [memory]` is for a quota system that charges each device by one counter (Kueue's counter
/// sources take the largest value a matching device consumes): a placement must consume exactly its
/// profile's memory, the whole GPU all of it, and the set must hold the GPU's memory.
#[test]
fn with_memory_as_a_quota_counter_each_placement_consumes_its_profiles_memory_and_the_whole_gpu_all_of_it() {
    for (node_name, inv) in nodes() {
        let slices = render_case(&inv, &dynamic_mig_with_memory_counter());
        let sets = counters_of(&slices);
        let mut seen = 0;
        for d in devices(&slices) {
            let name: DeviceName = d.name.parse().unwrap();
            let gpu = &inv.spec.gpus[name.gpu() as usize];
            let set_memory = &sets[&format!("gpu-{}-counters", gpu.index)]["memory"];
            assert_eq!(
                set_memory,
                &Quantity::from_int(gpu.memory_bytes as i64),
                "{node_name}: GPU {}'s counter set",
                gpu.index
            );
            let want = match &name {
                DeviceName::Mig { profile, .. } => {
                    let p = gpu.mig.as_ref().unwrap().profile(profile).unwrap();
                    Quantity::from_int((p.memory_mib << 20) as i64)
                }
                DeviceName::Gpu { .. } => *set_memory,
                other => panic!("{node_name}: unexpected device {other}"),
            };
            assert_eq!(memory_consumed(d), Some(want), "{node_name}: {}", d.name);
            seen += 1;
        }
        assert_eq!(seen, 8 * 26, "{node_name}");
    }
}

/// The option only adds the `memory` pairs: without them the slices are those of a rule without it, which
/// are the `dynamic-mig` golden files (so a policy that does not ask renders exactly as before, and the
/// scheduler validates no extra device/counter pair).
#[test]
fn memory_as_a_quota_counter_adds_only_the_memory_counter_and_a_rule_without_it_renders_as_before() {
    for (node_name, inv) in nodes() {
        let before = render_case(&inv, &models()[2]);
        let empty = render_policy_on(&inv, &one_rule("dynamicMig: {quotaCounters: []}", None));
        assert_eq!(
            serde_json::to_value(&empty).unwrap(),
            serde_json::to_value(&before).unwrap(),
            "{node_name}: quotaCounters: [] renders as no quotaCounters"
        );
        let mut with = render_case(&inv, &dynamic_mig_with_memory_counter());
        let mut removed = BTreeSet::new();
        for s in &mut with {
            for set in s.spec.shared_counters.iter_mut().flatten() {
                assert!(
                    set.counters.remove("memory").is_some(),
                    "{node_name}: {} has no memory",
                    set.name
                );
                removed.insert(set.name.clone());
            }
            for d in s.spec.devices.iter_mut().flatten() {
                for c in d.consumes_counters.iter_mut().flatten() {
                    assert!(
                        c.counters.remove("memory").is_some(),
                        "{node_name}: {} consumes no memory",
                        d.name
                    );
                }
            }
        }
        assert_eq!(removed.len(), 8, "{node_name}: one set per GPU");
        // The content hash covers the counters, so it differs; everything else must not.
        let unhashed = |slices: &[ResourceSlice]| {
            let mut v = serde_json::to_value(slices).unwrap();
            for s in v.as_array_mut().unwrap() {
                s["metadata"]["annotations"].take();
            }
            v
        };
        assert!(
            unhashed(&with) == unhashed(&before),
            "{node_name}: something beside the memory counter changed"
        );
    }
}

#[test]
fn an_unknown_quota_counter_is_refused_naming_the_field_and_the_counters_it_takes() {
    let err = tessera_controller::render::parse_policy(
        "test",
        &one_rule("dynamicMig: {quotaCounters: [multiprocessors]}", None),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("quotaCounters") && err.contains("memory"), "{err}");
}

fn render_policy_on(inv: &NodeInventory, text: &str) -> Vec<ResourceSlice> {
    tessera_controller::render::render(
        std::slice::from_ref(inv),
        Some(&policy(text)),
        tessera_controller::features::ApiFeatures::ALL,
    )
    .unwrap()
}
