//! `top` over slices and claims built here: the model and its drawing, golden text.

use std::collections::HashMap;

use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use serde_json::{Value, json};
use tessera_api::NodeInventorySpec;

use super::{
    metrics::{ClaimKey, Usage},
    model::{self, Layout},
    render::{self, WIDTH},
};

const H100: &str = "NVIDIA H100 80GB HBM3";
const GI: u64 = 1 << 30;

fn attrs(index: u32, kind: &str) -> Value {
    json!({
        "index": {"int": index},
        "productName": {"string": H100},
        "type": {"string": kind},
    })
}

/// A whole GPU device.
fn whole(index: u32) -> Value {
    json!({
        "name": format!("gpu-{index}"),
        "attributes": attrs(index, "gpu"),
        "capacity": {"memory": {"value": "80Gi"}},
    })
}

/// A dynamic MIG placement consuming memory slices `start..start+size` of GPU `index`'s counters.
fn placement(index: u32, profile: &str, encoded: &str, start: u32, size: u32) -> Value {
    let mut a = attrs(index, "mig");
    a["profile"] = json!({"string": profile});
    a["placementStart"] = json!({"int": start});
    let counters: serde_json::Map<String, Value> = (start..start + size)
        .map(|k| (format!("memory-slice-{k}"), json!({"value": "1"})))
        .collect();
    json!({
        "name": format!("gpu-{index}-mig-{encoded}-{start}"),
        "attributes": a,
        "capacity": {"memory": {"value": format!("{}Gi", size * 10)}},
        "consumesCounters": [{"counterSet": format!("gpu-{index}-counters"), "counters": counters}],
    })
}

fn counter_set(index: u32) -> Value {
    let mut counters: serde_json::Map<String, Value> = (0..8)
        .map(|k| (format!("memory-slice-{k}"), json!({"value": "1"})))
        .collect();
    counters.insert("memory".into(), json!({"value": "80Gi"}));
    json!({"name": format!("gpu-{index}-counters"), "counters": counters})
}

fn shared(index: u32) -> Value {
    let mut a = attrs(index, "shared");
    a["sharingStrategy"] = json!({"string": "mps"});
    json!({
        "name": format!("gpu-{index}-shared"),
        "attributes": a,
        "allowMultipleAllocations": true,
        "capacity": {"memory": {"value": "80Gi"}, "compute": {"value": "100"}},
    })
}

fn tainted(mut device: Value, key: &str, value: &str) -> Value {
    device["taints"] = json!([{"key": key, "value": value, "effect": "NoSchedule"}]);
    device
}

fn slice(node: &str, devices: Vec<Value>, counters: Vec<Value>) -> ResourceSlice {
    serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": format!("{node}-gpu.tessera.dev")},
        "spec": {
            "driver": "gpu.tessera.dev",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
            "sharedCounters": counters,
        }
    }))
    .expect("a valid slice")
}

/// An allocated claim in namespace `team` reserved for `pod`, holding `device` of `node`'s pool.
struct ClaimBuilder {
    name: String,
    pod: Option<String>,
    results: Vec<Value>,
    config: Vec<Value>,
}

fn claim(name: &str) -> ClaimBuilder {
    ClaimBuilder {
        name: name.into(),
        pod: None,
        results: Vec::new(),
        config: Vec::new(),
    }
}

impl ClaimBuilder {
    fn for_pod(mut self, pod: &str) -> Self {
        self.pod = Some(pod.into());
        self
    }
    fn holds(mut self, node: &str, device: &str, consumed: Value) -> Self {
        self.results.push(json!({
            "request": "gpu", "driver": "gpu.tessera.dev", "pool": node, "device": device,
            "consumedCapacity": consumed,
        }));
        self
    }
    fn ceiling(mut self, percent: u32) -> Self {
        self.config.push(json!({
            "source": "FromClaim",
            "opaque": {"driver": "gpu.tessera.dev", "parameters": {
                "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mps": {"computeCeiling": percent}}}},
        }));
        self
    }
    fn build(self) -> ResourceClaim {
        let reserved: Vec<Value> = self
            .pod
            .iter()
            .map(|p| json!({"resource": "pods", "name": p, "uid": "u"}))
            .collect();
        serde_json::from_value(json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": self.name, "namespace": "team"},
            "spec": {},
            "status": {
                "allocation": {"devices": {"results": self.results, "config": self.config}},
                "reservedFor": reserved,
            }
        }))
        .expect("a valid claim")
    }
}

fn usage(claim: &str, device: &str, u: Usage) -> (ClaimKey, Usage) {
    (
        ClaimKey {
            namespace: "team".into(),
            claim: claim.into(),
            request: "gpu".into(),
            device: device.into(),
        },
        u,
    )
}

fn draw(slices: &[ResourceSlice], claims: &[ResourceClaim], u: &HashMap<ClaimKey, Usage>) -> String {
    let lines = render::render(&model::build(slices, claims, &[], u, None), &[]);
    for l in &lines {
        assert!(l.chars().count() <= WIDTH, "over {WIDTH} columns: {l:?}");
    }
    lines.join("\n") + "\n"
}

#[test]
fn a_held_whole_gpu_shows_its_pod_and_use_and_a_free_one_says_free() {
    let slices = [slice("node-a", vec![whole(0), whole(1)], vec![])];
    let claims = [claim("train-gpu")
        .for_pod("trainer-7f9c")
        .holds("node-a", "gpu-0", json!({}))
        .build()];
    let u = HashMap::from([usage(
        "train-gpu",
        "gpu-0",
        Usage {
            utilization: Some(0.87),
            memory_used_bytes: Some(61 * GI + GI / 2),
            ..Usage::default()
        },
    )]);
    assert_eq!(
        draw(&slices, &claims, &u),
        "\
== node node-a  (2 GPUs)
GPU 0  NVIDIA H100 80GB HBM3                                       80Gi  healthy
  whole GPU  team/trainer-7f9c               util  87%  mem used  61.5Gi
GPU 1  NVIDIA H100 80GB HBM3                                       80Gi  healthy
  whole GPU  free
"
    );
}

#[test]
fn a_mig_gpu_draws_its_instances_as_blocks_of_its_memory_slices() {
    let devices = vec![
        whole(0),
        placement(0, "3g.40gb", "3g-40gb", 0, 4),
        placement(0, "2g.20gb", "2g-20gb", 4, 2),
        placement(0, "2g.20gb", "2g-20gb", 6, 2),
        placement(0, "1g.10gb", "1g-10gb", 6, 1),
    ];
    let slices = [slice("node-a", devices, vec![counter_set(0)])];
    let claims = [
        claim("infer-a")
            .for_pod("infer-a")
            .holds("node-a", "gpu-0-mig-3g-40gb-0", json!({}))
            .build(),
        claim("infer-b")
            .for_pod("infer-b")
            .holds("node-a", "gpu-0-mig-2g-20gb-4", json!({}))
            .build(),
    ];
    let u = HashMap::from([usage(
        "infer-a",
        "gpu-0-mig-3g-40gb-0",
        Usage {
            memory_used_bytes: Some(12 * GI),
            ..Usage::default()
        },
    )]);
    assert_eq!(
        draw(&slices, &claims, &u),
        "\
== node node-a  (1 GPU)
GPU 0  NVIDIA H100 80GB HBM3                                       80Gi  healthy
  MIG [AAAA|AAAA|AAAA|AAAA|BBBB|BBBB|....|....]  2 of 8 slices free
    A 3g.40gb    slices 0-3  team/infer-a                    mem used    12Gi
    B 2g.20gb    slices 4-5  team/infer-b                    mem used       -
"
    );
}

/// A static layout's instance: a MIG device without counters.
fn static_instance(index: u32, profile: &str, encoded: &str, start: u32) -> Value {
    let mut d = placement(index, profile, encoded, start, 1);
    d.as_object_mut().expect("an object").remove("consumesCounters");
    d["capacity"] = json!({"memory": {"value": "40Gi"}});
    d
}

/// A node's inventory whose GPU `index` has the H100's 3g.40gb profile: 4 memory slices at 0 or 4.
fn inventory(node: &str, index: u32) -> NodeInventorySpec {
    let profile = json!({
        "name": "3g.40gb", "profileId": 9, "profileIndex": 9, "computeSlices": 3, "memorySlices": 4,
        "instanceCount": 2, "memoryMib": 40960, "multiprocessors": 60, "copyEngines": 3,
        "decoders": 3, "encoders": 0, "jpegEngines": 3, "ofaEngines": 0,
        "placements": [{"start": 0, "size": 4}, {"start": 4, "size": 4}]
    });
    let mig = json!({
        "enabled": true, "modeToggleWithoutReset": false, "memorySlices": 8, "computeSlices": 7,
        "profiles": [profile]
    });
    let gpu = json!({
        "index": index, "minor": index, "uuid": "GPU-x", "productName": H100, "brand": "Nvidia",
        "architecture": "Hopper", "cudaComputeCapability": "9.0", "memoryBytes": 80 * GI,
        "multiprocessors": 132, "pciBusId": "0000:01:00.0", "healthy": true, "mig": mig
    });
    serde_json::from_value(json!({"nodeName": node, "backend": "nvml", "gpus": [gpu]}))
        .expect("a valid inventory")
}

#[test]
fn a_static_layouts_instances_take_their_size_from_the_nodes_inventory_and_free_ones_are_listed() {
    let devices = vec![
        static_instance(3, "3g.40gb", "3g-40gb", 0),
        static_instance(3, "3g.40gb", "3g-40gb", 4),
    ];
    let claims = [claim("c")
        .for_pod("p")
        .holds("node-a", "gpu-3-mig-3g-40gb-4", json!({}))
        .build()];
    let fleet = model::build(
        &[slice("node-a", devices, vec![])],
        &claims,
        &[inventory("node-a", 3)],
        &HashMap::new(),
        None,
    );
    assert_eq!(
        render::render(&fleet, &[]).join("\n") + "\n",
        "\
== node node-a  (1 GPU)
GPU 3  NVIDIA H100 80GB HBM3                                       80Gi  healthy
  MIG static [AAAA|AAAA|AAAA|AAAA|BBBB|BBBB|BBBB|BBBB]  1 of 2 held
    A 3g.40gb    slices 0-3  free
    B 3g.40gb    slices 4-7  team/p                          mem used       -
"
    );
}

#[test]
fn an_idle_dynamic_mig_gpu_is_free_for_either_use() {
    let devices = vec![whole(0), placement(0, "1g.10gb", "1g-10gb", 0, 1)];
    let fleet = model::build(
        &[slice("node-a", devices, vec![counter_set(0)])],
        &[],
        &[],
        &HashMap::new(),
        None,
    );
    assert_eq!(
        fleet.nodes[0].gpus[0].layout,
        Layout::Mig {
            slices: 8,
            dynamic: true,
            instances: vec![]
        }
    );
    let lines = render::render(&fleet, &[]);
    assert_eq!(lines[2], "  free: whole GPU or MIG on demand (8 memory slices)");
}

#[test]
fn shares_show_request_ceiling_and_use_with_the_pod_of_each() {
    let slices = [slice("node-a", vec![shared(1)], vec![])];
    let claims = [
        claim("share-a")
            .for_pod("share-a-6d8f")
            .holds(
                "node-a",
                "gpu-1-shared",
                json!({"memory": "10Gi", "compute": "25"}),
            )
            .ceiling(50)
            .build(),
        claim("share-b")
            .for_pod("share-b-0")
            .holds(
                "node-a",
                "gpu-1-shared",
                json!({"memory": "20Gi", "compute": "25"}),
            )
            .build(),
    ];
    let u = HashMap::from([
        usage(
            "share-a",
            "gpu-1-shared",
            Usage {
                utilization: Some(0.31),
                memory_used_bytes: Some(2 * GI),
                request_ratio: Some(0.25),
                ceiling_ratio: Some(0.5),
            },
        ),
        usage(
            "share-b",
            "gpu-1-shared",
            Usage {
                utilization: Some(0.05),
                memory_used_bytes: Some(GI),
                ..Usage::default()
            },
        ),
    ]);
    assert_eq!(
        draw(&slices, &claims, &u),
        "\
== node node-a  (1 GPU)
GPU 1  NVIDIA H100 80GB HBM3                                       80Gi  healthy
  shared (mps)  2 shares  memory 30Gi of 80Gi  compute 50% reserved
    share                          memory request ceiling   use mem used
    team/share-a-6d8f                10Gi     25%     50%   31%      2Gi
    team/share-b-0                   20Gi     25%     25%    5%      1Gi
"
    );
}

#[test]
fn a_share_without_metrics_takes_its_ceiling_from_its_claims_config() {
    let claims = [claim("share-a")
        .holds(
            "node-a",
            "gpu-1-shared",
            json!({"memory": "10Gi", "compute": "20"}),
        )
        .ceiling(60)
        .build()];
    let fleet = model::build(
        &[slice("node-a", vec![shared(1)], vec![])],
        &claims,
        &[],
        &HashMap::new(),
        None,
    );
    let Layout::Shared { shares, .. } = &fleet.nodes[0].gpus[0].layout else {
        panic!("not shared: {fleet:?}");
    };
    assert_eq!(
        (shares[0].request_pct, shares[0].ceiling_pct),
        (Some(20.0), Some(60.0))
    );
    assert_eq!(shares[0].holder.label(), "team/claim:share-a");
}

#[test]
fn a_tainted_gpu_says_so_and_lists_each_taint() {
    let slices = [slice(
        "node-a",
        vec![tainted(whole(2), "gpu.tessera.dev/xid", "79")],
        vec![],
    )];
    assert_eq!(
        draw(&slices, &[], &HashMap::new()),
        "\
== node node-a  (1 GPU)
GPU 2  NVIDIA H100 80GB HBM3                                       80Gi  TAINTED
  taint gpu.tessera.dev/xid=79:NoSchedule
  whole GPU  free
"
    );
}

#[test]
fn long_pod_names_are_cut_with_an_ellipsis_to_fit_80_columns() {
    let long = "a-very-long-deployment-name-with-a-replicaset-hash-5d9c7b6f4-x2x9z";
    let slices = [slice(
        "node-with-a-rather-long-name",
        vec![whole(0), shared(1)],
        vec![],
    )];
    let claims = [
        claim("c0")
            .for_pod(long)
            .holds("node-with-a-rather-long-name", "gpu-0", json!({}))
            .build(),
        claim("c1")
            .for_pod(long)
            .holds(
                "node-with-a-rather-long-name",
                "gpu-1-shared",
                json!({"memory": "1Gi"}),
            )
            .build(),
    ];
    let text = draw(&slices, &claims, &HashMap::new());
    assert!(text.contains("team/a-very-long-deployment-n… "), "{text}");
}

#[test]
fn only_the_named_node_is_drawn_and_other_drivers_are_left_out() {
    let mut other = slice("node-b", vec![whole(0)], vec![]);
    other.spec.driver = "nic.example.com".into();
    let slices = [
        slice("node-a", vec![whole(0)], vec![]),
        slice("node-b", vec![whole(1)], vec![]),
        other,
    ];
    let fleet = model::build(&slices, &[], &[], &HashMap::new(), Some("node-b"));
    assert_eq!(fleet.nodes.len(), 1);
    assert_eq!(fleet.nodes[0].name, "node-b");
    assert_eq!(
        fleet.nodes[0].gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
        [1]
    );
}

#[test]
fn the_readme_shows_what_top_draws() {
    let devices = vec![
        whole(0),
        shared(1),
        tainted(whole(2), "gpu.tessera.dev/xid", "79"),
        placement(2, "3g.40gb", "3g-40gb", 0, 4),
        placement(2, "2g.20gb", "2g-20gb", 4, 2),
    ];
    let slices = [slice("node-a", devices, vec![counter_set(2)])];
    let claims = [
        claim("train-gpu")
            .for_pod("trainer-7f9c")
            .holds("node-a", "gpu-0", json!({}))
            .build(),
        claim("share-a")
            .for_pod("share-a-6d8f")
            .holds(
                "node-a",
                "gpu-1-shared",
                json!({"memory": "10Gi", "compute": "25"}),
            )
            .ceiling(50)
            .build(),
        claim("share-b")
            .for_pod("share-b-0")
            .holds(
                "node-a",
                "gpu-1-shared",
                json!({"memory": "20Gi", "compute": "25"}),
            )
            .build(),
        claim("infer-a")
            .for_pod("infer-a")
            .holds("node-a", "gpu-2-mig-3g-40gb-0", json!({}))
            .build(),
        claim("infer-b")
            .for_pod("infer-b")
            .holds("node-a", "gpu-2-mig-2g-20gb-4", json!({}))
            .build(),
    ];
    let mem = |claim, device, used, util| {
        usage(
            claim,
            device,
            Usage {
                utilization: util,
                memory_used_bytes: Some(used),
                ..Usage::default()
            },
        )
    };
    let u = HashMap::from([
        mem("train-gpu", "gpu-0", 61 * GI + GI / 2, Some(0.87)),
        mem("share-a", "gpu-1-shared", 2 * GI, Some(0.31)),
        mem("share-b", "gpu-1-shared", GI, Some(0.05)),
        mem("infer-a", "gpu-2-mig-3g-40gb-0", 12 * GI, None),
    ]);
    let note =
        "use: from 1 of 1 plugin pods' /metrics; '-' where a plugin reports none (MIG devices have no \
                utilization in NVML)"
            .to_string();
    let drawn = render::render(&model::build(&slices, &claims, &[], &u, None), &[note]).join("\n");
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).expect("README.md");
    assert!(
        readme.contains(&format!("$ kubectl tessera top --node node-a\n{drawn}\n```")),
        "README.md's example of `kubectl tessera top` is not what it draws:\n{drawn}"
    );
}
