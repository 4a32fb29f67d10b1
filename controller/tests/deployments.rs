//! The shipped DeviceClasses, example claims and policies, evaluated offline against the devices tessera
//! publishes for the simulated nodes.

mod support;

use k8s_openapi::api::{
    core::v1::Pod,
    resource::v1::{Device, DeviceClass, ResourceClaimTemplate},
};
use serde::Deserialize;
use tessera_api::{DRIVER_NAME, policy::GpuPolicy};
use tessera_controller::{
    cel::{CelEnv, DeviceView, Quantity},
    features::ApiFeatures,
    render::render,
};

use support::*;

fn read(path: &str) -> String {
    std::fs::read_to_string(repo_root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn class(name: &str) -> DeviceClass {
    serde_norway::from_str(&read(&format!("deployments/classes/{name}.yaml"))).unwrap()
}

fn example(name: &str) -> (ResourceClaimTemplate, Pod) {
    let text = read(&format!("deployments/examples/{name}/{name}.yaml"));
    let mut docs = serde_norway::Deserializer::from_str(&text);
    let template = ResourceClaimTemplate::deserialize(docs.next().unwrap()).unwrap();
    let pod = Pod::deserialize(docs.next().unwrap()).unwrap();
    (template, pod)
}

fn all_selectors_match(cel: &CelEnv, exprs: &[String], d: &Device) -> bool {
    let view = DeviceView::from_device(DRIVER_NAME, d);
    exprs.iter().all(|e| {
        cel.matches(&cel.compile(e).unwrap(), &view)
            .unwrap_or_else(|err| panic!("{e}: {err}"))
    })
}

fn class_selectors(c: &DeviceClass) -> Vec<String> {
    c.spec
        .iter()
        .flat_map(|s| s.selectors.iter().flatten())
        .filter_map(|s| s.cel.as_ref().map(|c| c.expression.clone()))
        .collect()
}

/// Names of the devices a template's single request can be satisfied by.
fn candidates(template: &ResourceClaimTemplate, devices: &[&Device]) -> Vec<String> {
    let cel = CelEnv::new();
    let request = &template
        .spec
        .as_ref()
        .and_then(|t| t.spec.as_ref())
        .expect("every example template has a claim spec")
        .devices
        .as_ref()
        .unwrap()
        .requests
        .as_ref()
        .unwrap()[0];
    let exact = request.exactly.as_ref().unwrap();
    let mut exprs = class_selectors(&class(&exact.device_class_name));
    exprs.extend(
        exact
            .selectors
            .iter()
            .flatten()
            .filter_map(|s| s.cel.as_ref().map(|c| c.expression.clone())),
    );
    let requests = exact
        .capacity
        .as_ref()
        .and_then(|c| c.requests.clone())
        .unwrap_or_default();
    devices
        .iter()
        .filter(|d| all_selectors_match(&cel, &exprs, d))
        .filter(|d| {
            requests.iter().all(|(name, want)| {
                let want = Quantity::parse(&want.0).unwrap();
                d.capacity.as_ref().and_then(|c| c.get(name)).is_some_and(|cap| {
                    let max = cap
                        .request_policy
                        .as_ref()
                        .and_then(|p| p.valid_range.as_ref())
                        .and_then(|r| r.max.clone());
                    let limit = Quantity::parse(&max.unwrap_or(cap.value.clone()).0).unwrap();
                    d.allow_multiple_allocations == Some(true) && want <= limit
                })
            })
        })
        .map(|d| d.name.clone())
        .collect()
}

#[test]
fn each_device_class_selects_exactly_the_devices_of_its_type() {
    let cel = CelEnv::new();
    for (class_name, ty) in [
        ("gpu.tessera.dev", "gpu"),
        ("mig.gpu.tessera.dev", "mig"),
        ("shared.gpu.tessera.dev", "shared"),
    ] {
        let c = class(class_name);
        assert_eq!(c.metadata.name.as_deref(), Some(class_name));
        let exprs = class_selectors(&c);
        for (_, inv) in nodes() {
            for case in models() {
                let slices = render_case(&inv, &case);
                for d in devices(&slices) {
                    let is_type = d.attributes.as_ref().unwrap()["type"].string.as_deref() == Some(ty);
                    assert_eq!(
                        all_selectors_match(&cel, &exprs, d),
                        is_type,
                        "{class_name} on {}",
                        d.name
                    );
                }
            }
        }
    }
}

#[test]
fn every_example_pod_uses_its_template_in_the_examples_namespace() {
    for name in [
        "whole-h100",
        "mig-3g",
        "mig-1g-16gi",
        "shared-10gi-25pct",
        "burstable-share",
        "compute-capability-9",
    ] {
        let (template, pod) = example(name);
        assert_eq!(template.metadata.name.as_deref(), Some(name));
        assert_eq!(template.metadata.namespace.as_deref(), Some("tessera-examples"));
        assert_eq!(pod.metadata.namespace.as_deref(), Some("tessera-examples"));
        let spec = pod.spec.unwrap();
        let claims = spec.resource_claims.unwrap();
        assert_eq!(claims[0].resource_claim_template_name.as_deref(), Some(name));
        let used = spec.containers[0]
            .resources
            .as_ref()
            .unwrap()
            .claims
            .as_ref()
            .unwrap();
        assert_eq!(used[0].name, claims[0].name);
    }
}

#[test]
fn the_examples_select_the_intended_devices() {
    let dynamic = |inv| render_case(&inv, &models()[2]);
    let h100 = dynamic(h100_node());
    let h100 = devices(&h100);
    let whole = candidates(&example("whole-h100").0, &h100);
    assert_eq!(whole, (0..8).map(|i| format!("gpu-{i}")).collect::<Vec<_>>());

    let three_g = candidates(&example("mig-3g").0, &h100);
    assert_eq!(three_g.len(), 8 * 2);
    assert!(three_g.iter().all(|n| n.contains("-mig-3g-40gb-")));

    let one_g = candidates(&example("mig-1g-16gi").0, &h100);
    assert_eq!(one_g.len(), 8 * 4, "only 1g.20gb has 16Gi on an H100");
    assert!(one_g.iter().all(|n| n.contains("-mig-1g-20gb-")));
    let h200 = dynamic(h200_node());
    assert_eq!(
        candidates(&example("mig-1g-16gi").0, &devices(&h200)).len(),
        8 * (7 + 7 + 4),
        "1g.18gb is 16Gi"
    );

    let mixed = render_case(&mixed_node(), &models()[1]);
    let cc9 = candidates(&example("compute-capability-9").0, &devices(&mixed));
    assert_eq!(
        cc9,
        ["gpu-4", "gpu-5", "gpu-6", "gpu-7"],
        "the B200s (10.0), not the A100s (8.0)"
    );

    let shared = render_case(&h100_node(), &models()[3]);
    assert_eq!(
        candidates(&example("shared-10gi-25pct").0, &devices(&shared)).len(),
        8
    );
    assert_eq!(
        candidates(&example("burstable-share").0, &devices(&shared)).len(),
        8
    );
    let slots = render_case(&h100_node(), &models()[5]);
    assert!(
        candidates(&example("shared-10gi-25pct").0, &devices(&slots)).is_empty(),
        "slots are not consumable"
    );
}

#[test]
fn the_policy_examples_are_valid_for_the_simulated_nodes() {
    let invs: Vec<_> = nodes().into_iter().map(|(_, i)| i).collect();
    for file in [
        "mixed",
        "all-whole",
        "shared-mps",
        "static-mig",
        "lean-mig",
        "warm",
    ] {
        let policy: GpuPolicy =
            serde_norway::from_str(&read(&format!("deployments/policies/{file}.yaml"))).unwrap();
        assert_eq!(policy.metadata.name.as_deref(), Some("default"));
        for features in [ApiFeatures::ALL, ApiFeatures::NONE] {
            let slices = render(&invs, Some(&policy), features).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert!(!slices.is_empty(), "{file}");
        }
    }
}

#[test]
fn the_lean_mig_preset_halves_an_h100_nodes_devices_and_keeps_the_small_profiles_and_the_whole_gpu() {
    let lean: GpuPolicy = serde_norway::from_str(&read("deployments/policies/lean-mig.yaml")).unwrap();
    let slices = render(&[h100_node()], Some(&lean), ApiFeatures::ALL).unwrap();
    let every = render(&[h100_node()], None, ApiFeatures::ALL).unwrap();
    let profiles = |slices: &[k8s_openapi::api::resource::v1::ResourceSlice]| {
        let mut seen: Vec<String> = devices(slices)
            .iter()
            .map(|d| match d.attributes.as_ref().and_then(|a| a.get("profile")) {
                Some(v) => v.string.clone().unwrap_or_default(),
                None => "whole".into(),
            })
            .collect();
        seen.sort();
        seen.dedup();
        seen
    };
    assert_eq!(
        devices(&every).len(),
        208,
        "the built-in default: every placement of every profile"
    );
    assert_eq!(
        devices(&slices).len(),
        104,
        "8 × (7 × 1g + 3 × 2g + 2 × 3g + whole)"
    );
    assert_eq!(profiles(&slices), ["1g.10gb", "2g.20gb", "3g.40gb", "whole"]);
    let without = render(&[h100_node()], Some(&lean), ApiFeatures::NONE).unwrap();
    assert_eq!(
        devices(&without).len(),
        8,
        "whole GPUs where partitionable devices are missing"
    );
}

/// Issue 39 item 1: the burstable example's config is one prepare and the webhook accept: a 75 % ceiling
/// over its 25 % request on a GPU share.
#[test]
fn the_burstable_example_runs_its_share_at_a_ceiling_above_its_request() {
    let (template, _) = example("burstable-share");
    let claim = template.spec.unwrap().spec.unwrap();
    let devices = claim.devices.unwrap();
    let request = devices.requests.unwrap()[0].exactly.clone().unwrap();
    let requests = request.capacity.unwrap().requests.unwrap();
    let compute = &requests["compute"];
    let entries = devices.config.unwrap();
    let config = tessera_api::config::decode(&entries[0].opaque.as_ref().unwrap().parameters.0).unwrap();
    let ceiling = config.sharing().unwrap().mps.as_ref().unwrap().compute_ceiling;
    assert_eq!((compute.0.as_str(), ceiling), ("25", Some(75)));
    let share = tessera_api::DeviceName::SharedGpu { gpu: 0 };
    assert_eq!(
        tessera_api::config::check_ceiling(Some(&config), Some(&share), Some(25)),
        Ok(())
    );
}
