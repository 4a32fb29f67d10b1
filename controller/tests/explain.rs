//! `tessera explain` on the slices tessera really renders (the golden files) and the DeviceClasses it
//! ships: the motivating 200Gi claim, MIG placements held by named claims, taints, firstAvailable, counts,
//! pods and templates, malformed files, and the binary's exit codes.

mod support;

use std::{path::PathBuf, process::Command};

use k8s_openapi::api::{
    core::v1::Pod,
    resource::v1::{ResourceClaim, ResourceClaimTemplate},
};
use serde_json::{Value, json};
use tessera_controller::explain::{Cluster, ExplainError, Target, explain, input, report::Report};

// === fixtures ===

/// A cluster with tessera's DeviceClasses and the nodes, claims and pods added to it.
struct ClusterBuilder {
    cluster: Cluster,
}

fn cluster() -> ClusterBuilder {
    let classes = support::shipped_classes();
    ClusterBuilder {
        cluster: Cluster {
            classes,
            ..Default::default()
        },
    }
}

impl ClusterBuilder {
    /// A node publishing what the controller renders for the golden case (e.g. `h100-shared`: 8 H100s).
    fn node(mut self, node: &str, golden: &str) -> Self {
        self.cluster
            .slices
            .extend(support::golden_slices_on(node, golden));
        self
    }

    /// Every device of GPU `gpu` on `node` tainted the way the controller taints an unhealthy GPU.
    fn unhealthy(mut self, node: &str, gpu: usize) -> Self {
        let prefix = format!("gpu-{gpu}");
        for s in self
            .cluster
            .slices
            .iter_mut()
            .filter(|s| s.spec.node_name.as_deref() == Some(node))
        {
            for d in s.spec.devices.iter_mut().flatten() {
                if d.name == prefix || d.name.starts_with(&format!("{prefix}-")) {
                    d.taints = Some(vec![
                        serde_json::from_value(
                            json!({"key": "gpu.tessera.dev/unhealthy", "effect": "NoSchedule"}),
                        )
                        .unwrap(),
                    ]);
                }
            }
        }
        self
    }

    fn claim(mut self, claim: ClaimBuilder) -> Self {
        self.cluster.claims.push(claim.build());
        self
    }

    fn template(mut self, claim: ClaimBuilder) -> Self {
        let c = claim.build();
        let t: ResourceClaimTemplate = serde_json::from_value(json!({
            "metadata": {"name": c.metadata.name, "namespace": "default"},
            "spec": {"spec": c.spec},
        }))
        .unwrap();
        self.cluster.templates.push(t);
        self
    }

    /// A pod using a claim made from `template` (not generated yet: the pod has not been scheduled).
    fn pod_from_template(mut self, pod: &str, template: &str) -> Self {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": pod, "namespace": "default"},
            "spec": {
                "containers": [{"name": "cuda", "image": "cuda"}],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            },
        }))
        .unwrap();
        self.cluster.pods.push(p);
        self
    }

    /// A device-plugin-era pod: its container asks for `gpus` of the extended resource `nvidia.com/gpu`.
    fn legacy_pod(mut self, pod: &str, gpus: i64) -> Self {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": pod, "namespace": "default"},
            "spec": {"containers": [{"name": "cuda", "image": "cuda",
                "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]},
        }))
        .unwrap();
        self.cluster.pods.push(p);
        self
    }

    fn explain(&self, target: &str) -> Report {
        explain(&self.cluster, &Target::parse(target, "default").unwrap()).unwrap()
    }
}

/// A claim in namespace `default`, one request at a time.
struct ClaimBuilder {
    name: String,
    requests: Vec<Value>,
    constraints: Vec<Value>,
    allocated: Vec<Value>,
}

fn claim(name: &str) -> ClaimBuilder {
    ClaimBuilder {
        name: name.to_string(),
        requests: Vec::new(),
        constraints: Vec::new(),
        allocated: Vec::new(),
    }
}

/// One `exactly` request or `firstAvailable` entry.
struct Ask(Value);

fn ask(class: &str) -> Ask {
    Ask(json!({"deviceClassName": class}))
}

impl Ask {
    fn count(mut self, n: i64) -> Self {
        self.0["count"] = json!(n);
        self
    }
    fn selector(mut self, expression: &str) -> Self {
        let list = self.0["selectors"].as_array().cloned().unwrap_or_default();
        let mut list = list;
        list.push(json!({"cel": {"expression": expression}}));
        self.0["selectors"] = json!(list);
        self
    }
    fn capacity(mut self, name: &str, amount: &str) -> Self {
        self.0["capacity"]["requests"][name] = json!(amount);
        self
    }
    fn tolerating(mut self, key: &str) -> Self {
        self.0["tolerations"] = json!([{"key": key, "operator": "Exists"}]);
        self
    }
}

impl ClaimBuilder {
    fn exactly(mut self, request: &str, a: Ask) -> Self {
        self.requests.push(json!({"name": request, "exactly": a.0}));
        self
    }

    fn first_available(mut self, request: &str, alternatives: Vec<(&str, Ask)>) -> Self {
        let subs: Vec<Value> = alternatives
            .into_iter()
            .map(|(name, a)| {
                let mut v = a.0;
                v["name"] = json!(name);
                v
            })
            .collect();
        self.requests
            .push(json!({"name": request, "firstAvailable": subs}));
        self
    }

    fn constraint(mut self, kind: &str, attribute: &str) -> Self {
        self.constraints.push(json!({kind: attribute}));
        self
    }

    /// Allocated already, holding these devices of `node` whole.
    fn holding(mut self, node: &str, devices: &[&str]) -> Self {
        for d in devices {
            self.allocated
                .push(json!({"request": "gpu", "driver": "gpu.tessera.dev", "pool": node, "device": d}));
        }
        self
    }

    fn build(self) -> ResourceClaim {
        let mut v = json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": self.name, "namespace": "default"},
            "spec": {"devices": {"requests": self.requests, "constraints": self.constraints}},
        });
        if !self.allocated.is_empty() {
            v["status"] = json!({"allocation": {"devices": {"results": self.allocated}}});
        }
        serde_json::from_value(v).unwrap()
    }
}

const GPU0: &str = r#"device.attributes["gpu.tessera.dev"].index == 0"#;

fn profile(p: &str) -> String {
    format!(r#"device.attributes["gpu.tessera.dev"].profile == "{p}""#)
}

// === tests ===

#[test]
fn a_claim_for_more_memory_than_any_share_names_the_largest_share_there_is() {
    let c = cluster()
        .node("gpu-node-0", "h100-shared")
        .node("gpu-node-1", "h100-shared")
        .claim(claim("big").exactly("gpu", ask("shared.gpu.tessera.dev").capacity("memory", "200Gi")));

    let report = c.explain("claim/big");

    assert!(!report.fits);
    assert_eq!(
        report.summary,
        "claim default/big does not fit on any of 2 nodes: request gpu: no tessera device offers memory 200Gi; \
         the largest is 79Gi (gpu-0-shared on gpu-node-0)"
    );
    let alt = &report.claims[0].requests[0].nodes[1].alternatives[0];
    assert_eq!(alt.closest[0].reason.as_deref(), Some("memory 200Gi > 79Gi"));
}

#[test]
fn mig_placements_held_by_other_claims_name_those_claims() {
    // a holds one 3g.40gb placement; b holds a 4g.40gb, whose memory slices 0-3 cover the other one.
    let c = cluster()
        .node("gpu-node-0", "h100-default")
        .claim(claim("a").holding("gpu-node-0", &["gpu-0-mig-3g-40gb-4"]))
        .claim(claim("b").holding("gpu-node-0", &["gpu-0-mig-4g-40gb-0"]))
        .claim(
            claim("c").exactly(
                "gpu",
                ask("mig.gpu.tessera.dev")
                    .selector(GPU0)
                    .selector(&profile("3g.40gb")),
            ),
        );

    let report = c.explain("claim/c");

    assert!(!report.fits);
    let alt = &report.claims[0].requests[0].nodes[0].alternatives[0];
    assert_eq!(
        alt.reason.as_deref(),
        Some("profile 3g.40gb: all 2 placements in use by claims default/a, default/b")
    );
    let reasons: Vec<&str> = alt.closest.iter().filter_map(|d| d.reason.as_deref()).collect();
    assert!(reasons.contains(&"allocated to default/a"), "{reasons:?}");
    assert!(
        reasons
            .iter()
            .any(|r| r.starts_with("shared counter") && r.ends_with("used up by default/b")),
        "{reasons:?}"
    );
}

#[test]
fn a_mig_claim_kept_out_by_fragmented_slices_names_the_free_slices_and_the_claim_to_move() {
    // 1g instances at slices 1 and 5 leave 6 slices free, but each 3g placement (slices 0-3, 4-7) has one.
    let c = cluster()
        .node("gpu-node-0", "h100-default")
        .claim(claim("a").holding("gpu-node-0", &["gpu-0-mig-1g-10gb-1"]))
        .claim(claim("b").holding("gpu-node-0", &["gpu-0-mig-1g-10gb-5"]))
        .claim(
            claim("c").exactly(
                "gpu",
                ask("mig.gpu.tessera.dev")
                    .selector(GPU0)
                    .selector(r#"device.attributes["gpu.tessera.dev"].profile.startsWith("3g.")"#),
            ),
        );

    let report = c.explain("claim/c");

    assert!(!report.fits);
    assert_eq!(
        report.summary,
        "claim default/c does not fit on any of 1 node: request gpu: gpu-node-0: profile 3g.40gb needs 4 free memory \
         slices at one of its placements (starting at slice 0 or 4), but no GPU has them: 6 memory slices are free \
         but fragmented: gpu-0 6 (slices 0, 2-4, 6-7); to free 3g.40gb at slice 0 on gpu-0, move claim default/a \
         (delete and recreate the pod so the scheduler places it elsewhere)"
    );
}

#[test]
fn mig_placements_held_with_too_few_slices_free_are_in_use_not_fragmented() {
    // Slices 0-3 held by a 4g, 4 and 6 by 1g instances: 2 free, fewer than a 3g needs.
    let c = cluster()
        .node("gpu-node-0", "h100-default")
        .claim(claim("a").holding("gpu-node-0", &["gpu-0-mig-4g-40gb-0"]))
        .claim(claim("b").holding("gpu-node-0", &["gpu-0-mig-1g-10gb-4", "gpu-0-mig-1g-10gb-6"]))
        .claim(
            claim("c").exactly(
                "gpu",
                ask("mig.gpu.tessera.dev")
                    .selector(GPU0)
                    .selector(&profile("3g.40gb")),
            ),
        );

    let report = c.explain("claim/c");

    let alt = &report.claims[0].requests[0].nodes[0].alternatives[0];
    assert_eq!(
        alt.reason.as_deref(),
        Some("profile 3g.40gb: all 2 placements in use by claims default/a, default/b")
    );
}

#[test]
fn a_free_mig_placement_next_to_held_ones_fits() {
    let c = cluster()
        .node("gpu-node-0", "h100-default")
        .claim(claim("a").holding("gpu-node-0", &["gpu-0-mig-3g-40gb-4"]))
        .claim(
            claim("c").exactly(
                "gpu",
                ask("mig.gpu.tessera.dev")
                    .selector(GPU0)
                    .selector(&profile("3g.40gb")),
            ),
        );

    let report = c.explain("claim/c");

    assert!(report.fits, "{}", report.to_text());
    assert_eq!(report.summary, "claim default/c fits on gpu-node-0");
}

#[test]
fn a_tainted_gpu_is_offered_only_to_a_request_that_tolerates_the_taint() {
    let c = cluster()
        .node("gpu-node-0", "h100-whole")
        .unhealthy("gpu-node-0", 0)
        .claim(claim("plain").exactly("gpu", ask("gpu.tessera.dev").selector(GPU0)))
        .claim(
            claim("tolerant").exactly(
                "gpu",
                ask("gpu.tessera.dev")
                    .selector(GPU0)
                    .tolerating("gpu.tessera.dev/unhealthy"),
            ),
        );

    let plain = c.explain("claim/plain");
    let tolerant = c.explain("claim/tolerant");

    assert!(!plain.fits);
    assert!(
        plain.summary.ends_with(
            "request gpu: gpu-node-0: all 1 matching devices are tainted: gpu.tessera.dev/unhealthy (NoSchedule), \
             not tolerated"
        ),
        "{}",
        plain.summary
    );
    assert!(tolerant.fits, "{}", tolerant.to_text());
}

#[test]
fn first_available_reports_each_alternative_and_fits_on_the_first_that_does() {
    let c = cluster()
        .node("gpu-node-0", "h100-shared")
        .claim(claim("flex").first_available(
            "gpu",
            vec![
                ("big", ask("shared.gpu.tessera.dev").capacity("memory", "200Gi")),
                ("small", ask("shared.gpu.tessera.dev").capacity("memory", "10Gi")),
            ],
        ));

    let report = c.explain("claim/flex");

    assert!(report.fits);
    let node = &report.claims[0].requests[0].nodes[0];
    assert_eq!(node.alternatives.len(), 2);
    assert_eq!(node.alternatives[0].name, "gpu/big");
    assert!(!node.alternatives[0].fits);
    assert_eq!(
        node.alternatives[0].reason.as_deref(),
        Some("no device offers memory 200Gi; the largest is 79Gi (gpu-0-shared)")
    );
    assert!(node.alternatives[1].fits);
}

#[test]
fn first_available_with_no_fitting_alternative_says_why_for_each() {
    let c = cluster()
        .node("gpu-node-0", "h100-whole")
        .claim(claim("none").first_available(
            "gpu",
            vec![
                ("mig", ask("mig.gpu.tessera.dev")),
                ("nine", ask("gpu.tessera.dev").count(9)),
            ],
        ));

    let report = c.explain("claim/none");

    assert!(!report.fits);
    let alts = &report.claims[0].requests[0].nodes[0].alternatives;
    assert_eq!(
        alts[0].reason.as_deref(),
        Some("no device of class mig.gpu.tessera.dev on this node")
    );
    assert_eq!(
        alts[1].reason.as_deref(),
        Some("count 9 > 8 matching devices on this node")
    );
}

#[test]
fn more_devices_than_a_node_has_free_gives_both_numbers_and_who_holds_the_rest() {
    let c = cluster()
        .node("gpu-node-0", "h100-whole")
        .claim(claim("a").holding("gpu-node-0", &["gpu-0", "gpu-1"]))
        .claim(claim("seven").exactly("gpu", ask("gpu.tessera.dev").count(7)));

    let report = c.explain("claim/seven");

    assert!(!report.fits);
    let alt = &report.claims[0].requests[0].nodes[0].alternatives[0];
    assert_eq!(
        alt.reason.as_deref(),
        Some(
            "count 7 > 6 free matching devices; the rest: all 2 matching devices are in use by claims default/a"
        )
    );
}

#[test]
fn requests_that_fit_one_by_one_but_not_together_are_told_apart() {
    let c = cluster().node("gpu-node-0", "h100-whole").claim(
        claim("two")
            .exactly("a", ask("gpu.tessera.dev").selector(GPU0))
            .exactly("b", ask("gpu.tessera.dev").selector(GPU0)),
    );

    let report = c.explain("claim/two");

    assert!(!report.fits);
    assert!(report.claims[0].requests.iter().all(|r| r.fits));
    assert_eq!(
        report.summary,
        "claim default/two does not fit on any of 1 node: each request fits alone, but not all together on one node"
    );
    assert_eq!(
        report.nodes[0].reason.as_deref(),
        Some("each request fits alone, but not all together")
    );
}

#[test]
fn a_pod_whose_claim_is_not_generated_yet_is_explained_from_its_template() {
    let c = cluster()
        .node("gpu-node-0", "h100-shared")
        .template(claim("big-gpu").exactly("gpu", ask("shared.gpu.tessera.dev").capacity("memory", "200Gi")))
        .pod_from_template("big", "big-gpu");

    let report = c.explain("pod/big");

    assert!(!report.fits);
    assert!(
        report
            .summary
            .starts_with("pod default/big does not fit on any of 1 node: request gpu: no tessera device"),
        "{}",
        report.summary
    );
    assert!(!c.explain("template/big-gpu").fits);
}

#[test]
fn a_claim_naming_a_missing_class_says_the_class_does_not_exist_and_names_tesseras_classes() {
    let c = cluster()
        .node("gpu-node-0", "h100-whole")
        .claim(claim("typo").exactly("gpu", ask("gpus.tessera.dev")));

    let report = c.explain("claim/typo");

    assert!(!report.fits);
    assert!(
        report.summary.ends_with(
            "DeviceClass gpus.tessera.dev does not exist; did you mean gpu.tessera.dev?; \
             tessera's classes: gpu.tessera.dev, mig.gpu.tessera.dev, shared.gpu.tessera.dev"
        ),
        "{}",
        report.summary
    );
}

#[test]
fn an_unknown_target_is_an_error_naming_the_object_and_the_fix() {
    let c = cluster().node("gpu-node-0", "h100-whole");

    let err = explain(&c.cluster, &Target::parse("claim/nope", "default").unwrap()).unwrap_err();

    assert_eq!(
        err.to_string(),
        "ResourceClaim default/nope not found; check the name and -n NAMESPACE"
    );
    let bad = Target::parse("deployment/x", "default").unwrap_err();
    assert!(
        bad.to_string()
            .contains("give pod/NAME, claim/NAME or template/NAME"),
        "{bad}"
    );
}

#[test]
fn a_malformed_file_is_an_error_naming_the_file_and_the_problem() {
    let not_json = input::parse("cluster.json", "{\"kind\": \"List\", \"items\": [").unwrap_err();
    assert!(matches!(not_json, ExplainError::File { .. }));
    assert!(
        not_json
            .to_string()
            .starts_with("cannot read cluster.json: not valid JSON"),
        "{not_json}"
    );

    let old_api = input::parse(
        "cluster.yaml",
        "apiVersion: resource.k8s.io/v1beta1\nkind: ResourceClaim\nmetadata: {name: c}\nspec: {}\n",
    )
    .unwrap_err();
    assert!(
        old_api.to_string().contains("export it as resource.k8s.io/v1"),
        "{old_api}"
    );

    let no_kind = input::parse("cluster.yaml", "metadata: {name: c}\n").unwrap_err();
    assert!(no_kind.to_string().contains("has no `kind`"), "{no_kind}");

    let bad_request = input::parse(
        "cluster.yaml",
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: c}\n\
         spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.tessera.dev, count: 0}}]}}\n",
    )
    .unwrap();
    let err = explain(&bad_request, &Target::parse("claim/c", "default").unwrap()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "claim default/c: request gpu.count: 0 is not a positive number of devices"
    );
}

#[test]
fn a_yaml_list_with_other_kinds_is_read_and_they_are_skipped() {
    let text = "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Node\n  metadata: {name: n}\n\
                - apiVersion: resource.k8s.io/v1\n  kind: DeviceClass\n  metadata: {name: x}\n  spec: {}\n";

    let c = input::parse("cluster.yaml", text).unwrap();

    assert_eq!(c.classes.len(), 1);
    assert!(c.slices.is_empty() && c.pods.is_empty());
}

fn write_list(dir: &std::path::Path, c: &ClusterBuilder) -> PathBuf {
    let mut items: Vec<Value> = Vec::new();
    for x in &c.cluster.classes {
        let mut v = serde_json::to_value(x).unwrap();
        v["apiVersion"] = json!("resource.k8s.io/v1");
        v["kind"] = json!("DeviceClass");
        items.push(v);
    }
    for x in &c.cluster.slices {
        let mut v = serde_json::to_value(x).unwrap();
        v["apiVersion"] = json!("resource.k8s.io/v1");
        v["kind"] = json!("ResourceSlice");
        items.push(v);
    }
    for x in &c.cluster.claims {
        items.push(serde_json::to_value(x).unwrap());
    }
    let path = dir.join("cluster.json");
    std::fs::write(
        &path,
        serde_json::to_string(&json!({"kind": "List", "items": items})).unwrap(),
    )
    .unwrap();
    path
}

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kubectl-tessera"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn the_plugin_exits_0_when_it_fits_1_when_not_and_2_on_errors() {
    let dir = tempfile::tempdir().unwrap();
    let c = cluster()
        .node("gpu-node-0", "h100-shared")
        .claim(claim("big").exactly("gpu", ask("shared.gpu.tessera.dev").capacity("memory", "200Gi")))
        .claim(claim("small").exactly("gpu", ask("shared.gpu.tessera.dev").capacity("memory", "10Gi")));
    let file = write_list(dir.path(), &c);
    let file = file.to_str().unwrap();

    let (fits, text, _) = run(&["explain", "claim/small", "--from-file", file]);
    let (no_fit, json_out, _) = run(&[
        "explain",
        "claim/big",
        "-n",
        "default",
        "--from-file",
        file,
        "-o",
        "json",
    ]);
    let (missing, _, err) = run(&["explain", "claim/gone", "--from-file", file]);
    let (unreadable, _, err2) = run(&["explain", "claim/big", "--from-file", "/nonexistent/cluster.json"]);

    assert_eq!(fits, 0);
    assert!(
        text.starts_with("claim default/small fits on gpu-node-0\n"),
        "{text}"
    );
    assert_eq!(no_fit, 1);
    let v: Value = serde_json::from_str(&json_out).unwrap();
    assert_eq!(v["fits"], json!(false));
    assert_eq!(v["nodes"][0]["node"], json!("gpu-node-0"));
    assert_eq!(missing, 2);
    assert!(err.contains("ResourceClaim default/gone not found"), "{err}");
    assert_eq!(unreadable, 2);
    assert!(
        err2.starts_with("error: cannot read /nonexistent/cluster.json"),
        "{err2}"
    );
}

#[test]
fn help_documents_the_exit_codes_and_what_is_not_modelled() {
    let (code, text, _) = run(&["explain", "--help"]);

    assert_eq!(code, 0);
    assert!(text.contains("Exit status: 0 when everything fits"), "{text}");
    assert!(
        text.contains("Not modelled: slices selected by nodeSelector"),
        "{text}"
    );
}

#[test]
fn a_selector_failing_at_runtime_is_the_error_the_scheduler_stops_with() {
    // Whole GPUs have no `profile` attribute: CEL fails on them, and the allocator with it.
    let c = cluster()
        .node("gpu-node-0", "h100-whole")
        .claim(claim("typo").exactly("gpu", ask("gpu.tessera.dev").selector(&profile("7g.80gb"))));

    let report = c.explain("claim/typo");

    assert!(!report.fits);
    let reason = report.nodes[0].reason.as_deref().unwrap();
    assert!(
        reason.starts_with("the scheduler stops with an error: selector fails on gpu-0: "),
        "{reason}"
    );
    let alt = &report.claims[0].requests[0].nodes[0].alternatives[0];
    assert!(
        alt.closest[0]
            .reason
            .as_deref()
            .unwrap()
            .starts_with("selector fails: "),
        "{alt:?}"
    );
}

#[test]
fn a_match_attribute_constraint_no_two_devices_can_meet_is_named_and_a_distinct_one_fits() {
    // Two whole GPUs never share an index; two different ones always do not.
    let c = cluster()
        .node("gpu-node-0", "h100-whole")
        .claim(
            claim("same")
                .exactly("a", ask("gpu.tessera.dev"))
                .exactly("b", ask("gpu.tessera.dev"))
                .constraint("matchAttribute", "gpu.tessera.dev/index"),
        )
        .claim(
            claim("apart")
                .exactly("a", ask("gpu.tessera.dev"))
                .exactly("b", ask("gpu.tessera.dev"))
                .constraint("distinctAttribute", "gpu.tessera.dev/index"),
        );

    let same = c.explain("claim/same");
    let apart = c.explain("claim/apart");

    assert!(!same.fits);
    assert_eq!(
        same.nodes[0].reason.as_deref(),
        Some("each request fits alone, but not all together under matchAttribute gpu.tessera.dev/index")
    );
    assert!(apart.fits, "{}", apart.to_text());
}

#[test]
fn a_pod_asking_for_nvidia_gpus_is_explained_as_the_claim_the_scheduler_makes_for_it() {
    // gpu.tessera.dev carries extendedResourceName: nvidia.com/gpu.
    let c = cluster()
        .node("gpu-node-0", "h100-whole")
        .legacy_pod("two", 2)
        .legacy_pod("nine", 9);

    let two = c.explain("pod/two");
    let nine = c.explain("pod/nine");

    assert!(two.fits, "{}", two.to_text());
    assert!(!nine.fits);
    assert_eq!(
        nine.summary,
        "pod default/nine does not fit on any of 1 node: request nvidia.com/gpu: gpu-node-0: count 9 > 8 \
         matching devices on this node"
    );
}

#[test]
fn an_allocated_claim_is_reported_with_its_devices_and_fits() {
    let c = cluster().node("gpu-node-0", "h100-whole").claim(
        claim("done")
            .exactly("gpu", ask("gpu.tessera.dev"))
            .holding("gpu-node-0", &["gpu-3"]),
    );

    let report = c.explain("claim/done");

    assert!(report.fits);
    assert_eq!(
        report.summary,
        "claim default/done is allocated already: gpu-node-0/gpu-3"
    );
}
