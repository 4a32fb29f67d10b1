//! `kubectl tessera migrate` over NVIDIA-vocabulary specs (`controller/tests/fixtures/migrate/`): each
//! translation and report matches its checked-in copy, and each translated object is valid for tessera —
//! it deserializes as a `resource.k8s.io/v1` object, the admission webhook allows its claims, every CEL
//! selector compiles, and every request has a device to take on a node of 8 H100s under the e2e cluster's
//! GpuPolicy (`e2e/manifests/gpupolicy.yaml`), as the real node has.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::{
    core::v1::Pod,
    resource::v1::{
        Device, DeviceClass, ExactDeviceRequest, ResourceClaim, ResourceClaimSpec, ResourceClaimTemplate,
        ResourceSlice,
    },
};
use serde::Deserialize;
use tessera_api::DRIVER_NAME;
use tessera_controller::{
    cel::{CelEnv, DeviceView, Quantity},
    features::ApiFeatures,
    migrate::{Migration, Options, Outcome, migrate},
    render::render,
    webhook::{FixedClasses, check_spec, classes::offers_of},
};

use support::*;

const CASES: &[&str] = &[
    "whole-gpus",
    "mig",
    "mps",
    "time-slicing",
    "consumable-shares",
    "extended-resources",
    "cel-attributes",
];

fn fixtures() -> std::path::PathBuf {
    repo_root().join("controller/tests/fixtures/migrate")
}

fn translate(case: &str) -> Migration {
    let path = fixtures().join(format!("{case}.yaml"));
    let text = std::fs::read_to_string(&path).unwrap();
    migrate(&text, &format!("{case}.yaml"), Options::default()).unwrap()
}

/// The devices the real node publishes: 8 H100s (the real node has 6) under the e2e policy.
fn e2e_node_slices() -> Vec<ResourceSlice> {
    let text = std::fs::read_to_string(repo_root().join("e2e/manifests/gpupolicy.yaml")).unwrap();
    render(&[h100_node()], Some(&policy(&text)), ApiFeatures::ALL).unwrap()
}

fn selectors_of(class: &DeviceClass) -> Vec<String> {
    class
        .spec
        .iter()
        .flat_map(|s| s.selectors.iter().flatten())
        .filter_map(|s| s.cel.as_ref().map(|c| c.expression.clone()))
        .collect()
}

struct Cluster {
    cel: CelEnv,
    classes: BTreeMap<String, DeviceClass>,
    slices: Vec<ResourceSlice>,
}

impl Cluster {
    fn new(extra: &[DeviceClass]) -> Self {
        let classes = shipped_classes()
            .into_iter()
            .chain(extra.iter().cloned())
            .map(|c| (c.metadata.name.clone().unwrap(), c))
            .collect();
        Self {
            cel: CelEnv::new(),
            classes,
            slices: e2e_node_slices(),
        }
    }

    fn catalog(&self) -> FixedClasses {
        let slices: Vec<Arc<ResourceSlice>> = self.slices.iter().cloned().map(Arc::new).collect();
        FixedClasses(
            self.classes
                .iter()
                .map(|(n, c)| (n.clone(), offers_of(&self.cel, c, &slices).unwrap()))
                .collect(),
        )
    }

    fn matches(&self, exprs: &[String], d: &Device) -> bool {
        let view = DeviceView::from_device(DRIVER_NAME, d);
        exprs.iter().all(|e| {
            let s = self.cel.compile(e).unwrap_or_else(|err| panic!("{e}: {err}"));
            self.cel.matches(&s, &view).unwrap_or(false)
        })
    }

    /// Devices `req` can take, by its class's and its own selectors and its capacity requests.
    fn candidates(&self, req: &ExactDeviceRequest) -> Vec<String> {
        let class = self
            .classes
            .get(&req.device_class_name)
            .unwrap_or_else(|| panic!("no class {}", req.device_class_name));
        let mut exprs = selectors_of(class);
        exprs.extend(
            req.selectors
                .iter()
                .flatten()
                .filter_map(|s| s.cel.as_ref().map(|c| c.expression.clone())),
        );
        let wants = req
            .capacity
            .as_ref()
            .and_then(|c| c.requests.clone())
            .unwrap_or_default();
        devices(&self.slices)
            .into_iter()
            .filter(|d| self.matches(&exprs, d))
            .filter(|d| {
                wants.iter().all(|(name, want)| {
                    let cap = d.capacity.as_ref().and_then(|c| c.get(name));
                    cap.is_some_and(|cap| {
                        d.allow_multiple_allocations == Some(true)
                            && Quantity::parse(&want.0).unwrap() <= Quantity::parse(&cap.value.0).unwrap()
                    })
                })
            })
            .map(|d| d.name.clone())
            .collect()
    }

    /// Every request of `spec` has a device; the webhook allows the spec.
    fn check_claim(&self, what: &str, spec: &ResourceClaimSpec, path: &str) {
        let verdict = check_spec(spec, path, &self.catalog());
        assert!(
            verdict.allowed(),
            "{what}: the webhook refuses: {}",
            verdict.message()
        );
        for req in &spec
            .devices
            .as_ref()
            .unwrap()
            .requests
            .clone()
            .unwrap_or_default()
        {
            let exact = req
                .exactly
                .as_ref()
                .unwrap_or_else(|| panic!("{what}: {} has no exactly", req.name));
            assert!(
                !self.candidates(exact).is_empty(),
                "{what}: request {} selects no device on the e2e node",
                req.name
            );
        }
    }
}

fn docs(yaml: &str) -> Vec<serde_norway::Value> {
    serde_norway::Deserializer::from_str(yaml)
        .map(|d| serde_norway::Value::deserialize(d).unwrap())
        .collect()
}

fn typed<T: serde::de::DeserializeOwned>(v: &serde_norway::Value) -> T {
    serde_norway::from_value(v.clone()).unwrap_or_else(|e| panic!("{e}: {v:?}"))
}

#[test]
fn each_nvidia_spec_translates_to_its_checked_in_tessera_spec_and_report() {
    for case in CASES {
        let m = translate(case);
        check_golden(&fixtures().join(format!("{case}.tessera.yaml")), &m.yaml);
        check_golden(&fixtures().join(format!("{case}.report.txt")), &m.report());
    }
}

#[test]
fn each_translated_spec_is_allowed_by_the_webhook_and_every_request_finds_a_device_on_the_e2e_node() {
    for case in CASES {
        let m = translate(case);
        let objects = docs(&m.yaml);
        let kind = |v: &serde_norway::Value| v["kind"].as_str().unwrap_or_default().to_string();
        let classes: Vec<DeviceClass> = objects
            .iter()
            .filter(|v| kind(v) == "DeviceClass")
            .map(typed)
            .collect();
        let cluster = Cluster::new(&classes);
        for class in &classes {
            for e in selectors_of(class) {
                cluster
                    .cel
                    .compile(&e)
                    .unwrap_or_else(|err| panic!("{case}: {e}: {err}"));
            }
            assert!(
                devices(&cluster.slices)
                    .iter()
                    .any(|d| cluster.matches(&selectors_of(class), d)),
                "{case}: class {:?} selects nothing",
                class.metadata.name
            );
        }
        for v in &objects {
            assert!(
                !serde_norway::to_string(v).unwrap().contains("gpu.nvidia.com") || case == &"cel-attributes"
            );
            match kind(v).as_str() {
                "ResourceClaimTemplate" => {
                    let t: ResourceClaimTemplate = typed(v);
                    let name = t.metadata.name.clone().unwrap();
                    if name == "not-on-tessera" {
                        continue;
                    }
                    cluster.check_claim(
                        &format!("{case}: {name}"),
                        t.spec.as_ref().and_then(|s| s.spec.as_ref()).unwrap(),
                        "spec.spec",
                    );
                }
                "ResourceClaim" => {
                    let c: ResourceClaim = typed(v);
                    cluster.check_claim(
                        &format!("{case}: {:?}", c.metadata.name),
                        c.spec.as_ref().unwrap(),
                        "spec",
                    );
                }
                "Pod" => {
                    let _: Pod = typed(v);
                }
                "DeviceClass" => {}
                other => panic!("{case}: unexpected {other}"),
            }
        }
    }
}

#[test]
fn only_what_tessera_cannot_serve_is_reported_as_not_translated() {
    for case in CASES {
        let m = translate(case);
        let untranslated: Vec<String> = m
            .notes
            .iter()
            .filter(|n| n.outcome == Outcome::NotTranslated)
            .map(|n| n.to_string())
            .collect();
        if *case == "cel-attributes" {
            assert_eq!(untranslated.len(), 2, "{untranslated:#?}");
            assert!(
                untranslated.iter().all(|n| n.contains("not-on-tessera")),
                "{untranslated:#?}"
            );
        } else {
            assert!(untranslated.is_empty(), "{case}: {untranslated:#?}");
        }
    }
}

#[test]
fn the_plugin_binary_writes_yaml_to_stdout_the_report_to_stderr_and_fails_only_on_unreadable_input() {
    let bin = env!("CARGO_BIN_EXE_kubectl-tessera");
    let out = std::process::Command::new(bin)
        .args(["migrate", "-f"])
        .arg(fixtures().join("mps.yaml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), translate("mps").yaml);
    assert!(
        String::from_utf8(out.stderr)
            .unwrap()
            .starts_with("kubectl tessera migrate: ")
    );

    let out = std::process::Command::new(bin)
        .args(["migrate", "-f", "/nonexistent/spec.yaml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8(out.stderr)
            .unwrap()
            .contains("cannot read /nonexistent/spec.yaml")
    );
}
