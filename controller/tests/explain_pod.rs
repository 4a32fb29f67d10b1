//! `tessera explain` for a pod's own constraints, as kube-scheduler filters them before its claims
//! (nodeSelector, required node affinity, node taints, extended resources no class serves), DeviceTaintRules,
//! false CEL selectors with the value they saw, missing classes, and kubelet's prepare failures; over the
//! slices tessera really renders (the golden files) and the classes it ships.

mod support;

use k8s_openapi::api::{
    core::v1::{Event, Node, Pod},
    resource::v1::{DeviceTaintRule, ResourceClaim},
};
use serde_json::{Value, json};
use tessera_controller::explain::{Cluster, Target, explain, input, report::Report};

// === fixtures ===

struct ClusterBuilder {
    cluster: Cluster,
}

/// tessera's DeviceClasses, nothing else.
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
    /// A Node (as `node` builds it) publishing what the controller renders for `golden` (8 H100s whole).
    fn node(mut self, node: NodeBuilder, golden: &str) -> Self {
        self.cluster
            .slices
            .extend(support::golden_slices_on(&node.name, golden));
        self.cluster.nodes.push(node.build());
        self
    }

    fn pod(mut self, pod: PodBuilder) -> Self {
        let (p, claims, events) = pod.build();
        self.cluster.pods.push(p);
        self.cluster.claims.extend(claims);
        self.cluster.events.extend(events);
        self
    }

    /// A DeviceTaintRule tainting one device of `pool` NoSchedule.
    fn taint_rule(mut self, name: &str, pool: &str, device: &str, key: &str) -> Self {
        let rule: DeviceTaintRule = serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
            "metadata": {"name": name},
            "spec": {
                "deviceSelector": {"driver": "gpu.tessera.dev", "pool": pool, "device": device},
                "taint": {"key": key, "value": "planned", "effect": "NoSchedule"},
            },
        }))
        .unwrap();
        self.cluster.taint_rules.push(rule);
        self
    }

    fn explain(&self, pod: &str) -> Report {
        explain(
            &self.cluster,
            &Target::parse(&format!("pod/{pod}"), "default").unwrap(),
        )
        .unwrap()
    }
}

/// A Node as a kubelet registers it: hostname label, no taints, cpu and memory allocatable.
struct NodeBuilder {
    name: String,
    labels: Value,
    taints: Vec<Value>,
    allocatable: Value,
}

fn node(name: &str) -> NodeBuilder {
    NodeBuilder {
        name: name.to_string(),
        labels: json!({"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}),
        taints: Vec::new(),
        allocatable: json!({"cpu": "16", "memory": "64Gi", "pods": "110"}),
    }
}

impl NodeBuilder {
    fn label(mut self, key: &str, value: &str) -> Self {
        self.labels[key] = json!(value);
        self
    }
    fn taint(mut self, key: &str, value: &str, effect: &str) -> Self {
        self.taints
            .push(json!({"key": key, "value": value, "effect": effect}));
        self
    }
    fn allocatable(mut self, resource: &str, amount: &str) -> Self {
        self.allocatable[resource] = json!(amount);
        self
    }
    fn build(self) -> Node {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.name, "labels": self.labels},
            "spec": {"taints": self.taints},
            "status": {"allocatable": self.allocatable, "capacity": self.allocatable},
        }))
        .unwrap()
    }
}

/// A pod in `default` whose container uses one claim `gpu` (pending unless `allocated_on`).
struct PodBuilder {
    pod: Value,
    request: Value,
    allocated: Option<(String, String)>,
    events: Vec<Value>,
}

fn pod(name: &str) -> PodBuilder {
    PodBuilder {
        pod: json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
            "spec": {
                "containers": [{"name": "ctr", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": format!("{name}-gpu")}],
            },
            "status": {"phase": "Pending"},
        }),
        request: json!({"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}),
        allocated: None,
        events: Vec::new(),
    }
}

impl PodBuilder {
    fn node_selector(mut self, key: &str, value: &str) -> Self {
        self.pod["spec"]["nodeSelector"][key] = json!(value);
        self
    }
    fn requires(mut self, key: &str, operator: &str, values: &[&str]) -> Self {
        self.pod["spec"]["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchExpressions": [{"key": key, "operator": operator, "values": values}]}]}}});
        self
    }
    fn requires_field(mut self, name: &str) -> Self {
        self.pod["spec"]["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [name]}]}]}}});
        self
    }
    fn tolerating(mut self, key: &str) -> Self {
        self.pod["spec"]["tolerations"] = json!([{"key": key, "operator": "Exists", "effect": "NoSchedule"}]);
        self
    }
    /// The claim's request: a class and CEL selectors.
    fn asking(mut self, class: &str, selectors: &[&str]) -> Self {
        let sel: Vec<Value> = selectors
            .iter()
            .map(|s| json!({"cel": {"expression": s}}))
            .collect();
        self.request = json!({"name": "gpu", "exactly": {"deviceClassName": class, "selectors": sel}});
        self
    }
    fn request_tolerating(mut self, key: &str) -> Self {
        self.request["exactly"]["tolerations"] = json!([{"key": key, "operator": "Exists"}]);
        self
    }
    /// No claim: the container asks for an extended resource instead.
    fn extended(mut self, resource: &str, amount: &str) -> Self {
        self.pod["spec"]["containers"] = json!([{"name": "ctr", "image": "cuda",
            "resources": {"limits": {resource: amount}, "requests": {resource: amount}}}]);
        self.pod["spec"]["resourceClaims"] = json!([]);
        self
    }
    /// Scheduled onto `node` with its claim allocated `device` there.
    fn allocated_on(mut self, node: &str, device: &str) -> Self {
        self.pod["spec"]["nodeName"] = json!(node);
        self.allocated = Some((node.to_string(), device.to_string()));
        self
    }
    /// Container `ctr` waiting with `reason` and kubelet's `message` (the runtime's error).
    fn container_waiting(mut self, reason: &str, message: &str) -> Self {
        self.pod["status"]["containerStatuses"] = json!([{"name": "ctr", "image": "cuda", "imageID": "",
            "ready": false, "restartCount": 0, "state": {"waiting": {"reason": reason, "message": message}}}]);
        self
    }
    fn phase(mut self, phase: &str) -> Self {
        self.pod["status"]["phase"] = json!(phase);
        self
    }
    /// An event about the pod from kubelet, `at` seconds into the day.
    fn event(mut self, kind: &str, reason: &str, message: &str, at: u32) -> Self {
        let name = self.pod["metadata"]["name"].clone();
        let uid = self.pod["metadata"]["uid"].clone();
        let at = format!("2026-12-02T07:{:02}:{:02}Z", at / 60, at % 60);
        self.events.push(json!({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": format!("{}.{}", name.as_str().unwrap(), self.events.len()), "namespace": "default"},
            "involvedObject": {"kind": "Pod", "namespace": "default", "name": name, "uid": uid},
            "reason": reason, "message": message, "type": kind, "count": 3,
            "source": {"component": "kubelet", "host": "gpu-node-0"},
            "firstTimestamp": at, "lastTimestamp": at,
        }));
        self
    }
    fn build(self) -> (Pod, Vec<ResourceClaim>, Vec<Event>) {
        let name = self.pod["metadata"]["name"].as_str().unwrap().to_string();
        let mut claims = Vec::new();
        if self.pod["spec"]["resourceClaims"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
        {
            let mut c = json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": format!("{name}-gpu"), "namespace": "default", "uid": format!("uid-{name}-gpu")},
                "spec": {"devices": {"requests": [self.request]}},
            });
            if let Some((node, device)) = &self.allocated {
                c["status"] = json!({"allocation": {"devices": {"results": [
                    {"request": "gpu", "driver": "gpu.tessera.dev", "pool": node, "device": device}]}}});
            }
            claims.push(serde_json::from_value(c).unwrap());
        }
        let events = self
            .events
            .into_iter()
            .map(|e| serde_json::from_value(e).unwrap())
            .collect();
        (serde_json::from_value(self.pod).unwrap(), claims, events)
    }
}

fn two_nodes() -> ClusterBuilder {
    cluster()
        .node(node("gpu-node-0"), "h100-whole")
        .node(node("gpu-node-1"), "h100-whole")
}

// === tests ===

#[test]
fn a_pod_whose_node_selector_matches_no_node_does_not_fit_and_says_which_label_differs() {
    let c = two_nodes().pod(pod("pinned").node_selector("kubernetes.io/hostname", "gpu-node-9"));

    let report = c.explain("pinned");

    assert!(!report.fits, "{}", report.to_text());
    assert_eq!(
        report.summary,
        "pod default/pinned does not fit on any of 2 nodes: \
         gpu-node-0: didn't match the pod's nodeSelector kubernetes.io/hostname=gpu-node-9 (the node has kubernetes.io/hostname=gpu-node-0); \
         gpu-node-1: didn't match the pod's nodeSelector kubernetes.io/hostname=gpu-node-9 (the node has kubernetes.io/hostname=gpu-node-1)"
    );
    assert!(
        report
            .to_text()
            .contains("\nnodes:\n  gpu-node-0: does not fit: didn't match")
    );
    let text = report.to_text();
    assert!(
        text.contains("request gpu: no node is left once the pod's own constraints are applied"),
        "{text}"
    );
}

#[test]
fn a_pod_pinned_to_a_node_whose_gpus_are_held_names_both_the_held_gpus_and_the_selector() {
    // The issue's case: without the pod's nodeSelector explain said "fits on gpu-node-0, gpu-node-1".
    let mut c = two_nodes().pod(pod("pinned").node_selector("kubernetes.io/hostname", "gpu-node-0"));
    for i in 0..8 {
        c = c.pod(
            pod(&format!("holder-{i}"))
                .allocated_on("gpu-node-0", &format!("gpu-{i}"))
                .phase("Running"),
        );
    }

    let report = c.explain("pinned");

    assert!(!report.fits, "{}", report.to_text());
    assert!(
        report.summary.starts_with(
            "pod default/pinned does not fit on any of 2 nodes: request gpu: gpu-node-0: all 8 matching devices are in use"
        ),
        "{}",
        report.summary
    );
    assert!(
        report.summary.ends_with(
            "; gpu-node-1: didn't match the pod's nodeSelector kubernetes.io/hostname=gpu-node-0 \
             (the node has kubernetes.io/hostname=gpu-node-1)"
        ),
        "{}",
        report.summary
    );
}

#[test]
fn a_pod_whose_required_node_affinity_matches_no_node_shows_the_nodes_value() {
    let c = cluster()
        .node(node("gpu-node-0").label("zone", "a"), "h100-whole")
        .node(node("gpu-node-1"), "h100-whole")
        .pod(pod("zoned").requires("zone", "In", &["b", "c"]));

    let report = c.explain("zoned");

    assert!(!report.fits);
    assert_eq!(
        report.summary,
        "pod default/zoned does not fit on any of 2 nodes: \
         gpu-node-0: didn't match the pod's required node affinity: zone In [b, c] (the node's label is a); \
         gpu-node-1: didn't match the pod's required node affinity: zone In [b, c] (the node has no label zone)"
    );
}

#[test]
fn a_pod_whose_affinity_names_one_node_by_field_fits_only_there() {
    let c = two_nodes().pod(pod("by-name").requires_field("gpu-node-1"));

    let report = c.explain("by-name");

    assert!(report.fits, "{}", report.to_text());
    assert_eq!(report.summary, "pod default/by-name fits on gpu-node-1");
    assert_eq!(
        report.nodes[0].reason.as_deref(),
        Some(
            "didn't match the pod's required node affinity: metadata.name In [gpu-node-1] (the node's field is gpu-node-0)"
        )
    );
}

#[test]
fn a_node_taint_the_pod_does_not_tolerate_rules_the_node_out_and_a_toleration_lets_it_in() {
    let c = cluster()
        .node(
            node("gpu-node-0").taint("nvidia.com/gpu", "present", "NoSchedule"),
            "h100-whole",
        )
        .pod(pod("plain"))
        .pod(pod("tolerant").tolerating("nvidia.com/gpu"));

    let plain = c.explain("plain");
    let tolerant = c.explain("tolerant");

    assert!(!plain.fits);
    assert_eq!(
        plain.summary,
        "pod default/plain does not fit on any of 1 node: gpu-node-0: untolerated taint nvidia.com/gpu=present:NoSchedule"
    );
    assert!(tolerant.fits, "{}", tolerant.to_text());
    assert_eq!(tolerant.summary, "pod default/tolerant fits on gpu-node-0");
}

#[test]
fn a_prefer_no_schedule_taint_does_not_rule_a_node_out() {
    let c = cluster()
        .node(
            node("gpu-node-0").taint("example.com/soft", "x", "PreferNoSchedule"),
            "h100-whole",
        )
        .pod(pod("p"));

    assert!(c.explain("p").fits);
}

#[test]
fn a_device_taint_rule_keeps_a_claim_off_its_device_unless_the_request_tolerates_it() {
    let gpu3 = r#"device.attributes["gpu.tessera.dev"].index == 3"#;
    let c = cluster()
        .node(node("gpu-node-0"), "h100-whole")
        .taint_rule("maintenance", "gpu-node-0", "gpu-3", "example.com/maintenance")
        .pod(pod("plain").asking("gpu.tessera.dev", &[gpu3]))
        .pod(
            pod("tolerant")
                .asking("gpu.tessera.dev", &[gpu3])
                .request_tolerating("example.com/maintenance"),
        )
        .pod(pod("other").asking(
            "gpu.tessera.dev",
            &[r#"device.attributes["gpu.tessera.dev"].index == 4"#],
        ));

    let plain = c.explain("plain");

    assert!(!plain.fits);
    assert_eq!(
        plain.summary,
        "pod default/plain does not fit on any of 1 node: request gpu: gpu-node-0: all 1 matching devices are tainted: \
         example.com/maintenance=planned (NoSchedule, DeviceTaintRule maintenance), not tolerated"
    );
    assert!(c.explain("tolerant").fits);
    assert!(c.explain("other").fits, "the rule names gpu-3 only");
}

#[test]
fn an_extended_resource_no_class_serves_and_no_node_has_does_not_fit() {
    let c = two_nodes().pod(pod("legacy").extended("example.com/fpga", "1"));

    let report = c.explain("legacy");

    assert!(!report.fits, "{}", report.to_text());
    assert_eq!(
        report.summary,
        "pod default/legacy does not fit on any of 2 nodes: gpu-node-0, gpu-node-1: Insufficient example.com/fpga: \
         the pod asks for 1, no DeviceClass serves it (spec.extendedResourceName) and the node has 0 allocatable"
    );
}

#[test]
fn an_extended_resource_a_device_plugin_serves_on_a_node_fits_there() {
    let c = cluster()
        .node(node("gpu-node-0"), "h100-whole")
        .node(
            node("gpu-node-1").allocatable("example.com/fpga", "2"),
            "h100-whole",
        )
        .pod(pod("legacy").extended("example.com/fpga", "2"));

    let report = c.explain("legacy");

    assert!(report.fits, "{}", report.to_text());
    assert_eq!(report.nodes.iter().filter(|n| n.fits).count(), 1);
}

#[test]
fn an_unserved_extended_resource_without_nodes_in_the_input_does_not_fit_and_says_what_to_add() {
    let mut c = cluster().pod(pod("legacy").extended("example.com/fpga", "1"));
    c.cluster.nodes.clear();

    let report = c.explain("legacy");

    assert!(!report.fits);
    assert!(
        report.summary.contains("add the Nodes to the input"),
        "{}",
        report.summary
    );
}

#[test]
fn a_pod_naming_a_missing_class_names_tesseras_classes() {
    let c = two_nodes().pod(pod("typo").asking("gpu.tesera.dev", &[]));

    let report = c.explain("typo");

    assert!(!report.fits);
    assert!(
        report.summary.ends_with(
            "DeviceClass gpu.tesera.dev does not exist; did you mean gpu.tessera.dev?; \
             tessera's classes: gpu.tessera.dev, mig.gpu.tessera.dev, shared.gpu.tessera.dev"
        ),
        "{}",
        report.summary
    );
}

#[test]
fn a_false_cel_selector_shows_the_value_it_saw() {
    let c = two_nodes().pod(pod("big").asking(
        "gpu.tessera.dev",
        &[r#"device.capacity["gpu.tessera.dev"].memory.compareTo(quantity("100Gi")) >= 0"#],
    ));

    let report = c.explain("big");

    assert!(!report.fits);
    assert!(
        report.summary.ends_with(
            r#"selector `device.capacity["gpu.tessera.dev"].memory.compareTo(quantity("100Gi")) >= 0` is false (device.capacity["gpu.tessera.dev"].memory = 81559Mi) (closest: gpu-0)"#
        ),
        "{}",
        report.summary
    );
}

#[test]
fn a_false_attribute_selector_shows_each_attribute_it_names() {
    let c = two_nodes().pod(pod("a100").asking(
        "gpu.tessera.dev",
        &[r#"device.attributes["gpu.tessera.dev"].productName.startsWith("NVIDIA A100") && device.attributes['gpu.tessera.dev'].index < 2"#],
    ));

    let text = c.explain("a100").to_text();

    assert!(
        text.contains(
            r#"(device.attributes["gpu.tessera.dev"].productName = "NVIDIA H100 80GB HBM3", device.attributes["gpu.tessera.dev"].index = 0)"#
        ),
        "{text}"
    );
}

#[test]
fn a_pod_whose_allocated_claim_kubelet_cannot_prepare_does_not_fit_and_quotes_kubelet() {
    let message = "Failed to prepare dynamic resources: NodePrepareResources failed for ResourceClaim p-gpu: \
                   sharing.strategy: unknown variant `NotAStrategy`";
    let c = two_nodes().pod(
        pod("p")
            .allocated_on("gpu-node-0", "gpu-0")
            .event(
                "Normal",
                "Scheduled",
                "Successfully assigned default/p to gpu-node-0",
                1,
            )
            .event("Warning", "FailedPrepareDynamicResources", message, 5),
    );

    let report = c.explain("p");

    assert!(!report.fits);
    assert_eq!(
        report.summary,
        format!(
            "pod default/p: every claim is allocated, but kubelet on gpu-node-0 cannot prepare them: {message}"
        )
    );
    let text = report.to_text();
    assert!(
        text.contains(
            "\nkubelet on gpu-node-0 reported FailedPrepareDynamicResources (3 times): Failed to prepare"
        ),
        "{text}"
    );
}

#[test]
fn a_prepare_failure_followed_by_a_start_is_over() {
    let c = two_nodes().pod(
        pod("p")
            .allocated_on("gpu-node-0", "gpu-0")
            .event(
                "Warning",
                "FailedPrepareDynamicResources",
                "Failed to prepare dynamic resources: busy",
                5,
            )
            .event("Normal", "Started", "Started container ctr", 9),
    );

    let report = c.explain("p");

    assert!(report.fits, "{}", report.to_text());
    assert_eq!(report.summary, "pod default/p: every claim is allocated already");
}

#[test]
fn a_pod_whose_container_the_runtime_refuses_for_a_tessera_device_does_not_fit_and_says_what_to_do() {
    // containerd's error for a spec it could not load: the CDI devices it should have held are unknown.
    let message = "failed to generate container \"4f1d\" spec: failed to apply OCI options: CDI device \
                   injection failed: unresolvable CDI devices k8s.gpu.tessera.dev/claim=uid-p-gpu-gpu-1-shared";
    let c = two_nodes().pod(
        pod("p")
            .allocated_on("gpu-node-0", "gpu-1")
            .event(
                "Normal",
                "Scheduled",
                "Successfully assigned default/p to gpu-node-0",
                1,
            )
            .event("Warning", "Failed", &format!("Error: {message}"), 9)
            .container_waiting("CreateContainerError", message),
    );

    let report = c.explain("p");

    assert!(!report.fits, "{}", report.to_text());
    assert_eq!(
        report.summary,
        format!(
            "pod default/p: every claim is prepared, but the container runtime on gpu-node-0 refuses \
             container ctr with tessera's devices (CreateContainerError): {message}"
        )
    );
    let text = report.to_text();
    for what in [
        &format!("\nkubelet on gpu-node-0 reports container ctr CreateContainerError: {message}\n"),
        "k8s.gpu.tessera.dev-claim_uid-p-gpu.json",
        "upgrade the plugin",
        "delete the pod",
    ] {
        assert!(text.contains(what), "{what:?} missing from:\n{text}");
    }
}

#[test]
fn a_container_the_runtime_refuses_for_something_else_is_not_put_on_tesseras_devices() {
    let c = two_nodes().pod(pod("p").allocated_on("gpu-node-0", "gpu-1").container_waiting(
        "CreateContainerError",
        "failed to create containerd container: mount /data: no such file or directory",
    ));

    let report = c.explain("p");

    assert!(report.fits, "{}", report.to_text());
    assert_eq!(report.summary, "pod default/p: every claim is allocated already");
}

#[test]
fn a_file_with_nodes_events_and_device_taint_rules_is_read_like_the_api_server() {
    let c = cluster()
        .node(
            node("gpu-node-0").taint("nvidia.com/gpu", "present", "NoSchedule"),
            "h100-whole",
        )
        .taint_rule("maintenance", "gpu-node-0", "gpu-3", "example.com/maintenance");
    let mut items: Vec<Value> = Vec::new();
    for s in &c.cluster.slices {
        let mut v = serde_json::to_value(s).unwrap();
        v["apiVersion"] = json!("resource.k8s.io/v1");
        v["kind"] = json!("ResourceSlice");
        items.push(v);
    }
    let mut n = serde_json::to_value(&c.cluster.nodes[0]).unwrap();
    n["apiVersion"] = json!("v1");
    n["kind"] = json!("Node");
    items.push(n);
    let mut r = serde_json::to_value(&c.cluster.taint_rules[0]).unwrap();
    r["apiVersion"] = json!("resource.k8s.io/v1beta2");
    r["kind"] = json!("DeviceTaintRule");
    items.push(r);
    items.push(
        json!({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "e", "namespace": "default"},
        "involvedObject": {"kind": "Pod", "name": "p", "namespace": "default"}, "reason": "Scheduled"}),
    );
    // events.k8s.io Events are another shape: skipped, as other kinds are.
    items.push(
        json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e2"}, "note": "x"}),
    );
    let text = serde_json::to_string(&json!({"apiVersion": "v1", "kind": "List", "items": items})).unwrap();

    let read = input::parse("dump.json", &text).unwrap();

    assert_eq!(read.nodes.len(), 1);
    assert_eq!(read.taint_rules.len(), 1);
    assert_eq!(read.events.len(), 1);
    assert_eq!(
        read.nodes[0].spec.as_ref().unwrap().taints.as_ref().unwrap()[0].key,
        "nvidia.com/gpu"
    );
}

#[test]
fn a_file_without_nodes_leaves_the_pods_node_constraints_out_as_before() {
    let mut c = two_nodes().pod(pod("pinned").node_selector("kubernetes.io/hostname", "gpu-node-9"));
    c.cluster.nodes.clear();

    let report = c.explain("pinned");

    assert!(report.fits, "{}", report.to_text());
}
