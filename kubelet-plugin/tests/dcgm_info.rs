//! Issue 41 item 1: `tessera_claim_device_info` on the plugin's `/metrics`, for claims prepared by the
//! plugin's real preparers over a simulated node: a whole GPU, a MIG device and two MPS shares of one GPU,
//! each named by the DCGM entity dcgm-exporter writes for it (`UUID` of the physical GPU, `GPU_I_ID` of a
//! MIG instance), and gone once the claims are unprepared.

mod common;

use std::sync::Arc;

use common::{BOOT_ID, StopDaemons, TestNode, add, instances, start};
use tessera_kubelet_plugin::kubelet::claims::fake::claim;
use tessera_kubelet_plugin::metrics::prometheus::{NodeCollector, metrics};
use tessera_kubelet_plugin::node::state::ClaimRef;

fn whole(node: &TestNode, name: &str, device: &str) -> ClaimRef {
    add(
        node,
        claim(name)
            .namespace("team")
            .allocated(device)
            .reserved_for_pod(&format!("pod-{name}"))
            .build(),
    )
}

fn mps_share(node: &TestNode, name: &str) -> ClaimRef {
    add(
        node,
        claim(name)
            .namespace("team")
            .allocated_share("gpu-2-shared", name)
            .consumed("compute", "40")
            .config(serde_json::json!({
                "apiVersion": "gpu.tessera.dev/v1alpha1",
                "kind": "GpuConfig",
                "sharing": {"strategy": "MPS"},
            }))
            .reserved_for_pod(&format!("pod-{name}"))
            .build(),
    )
}

/// The label sets of the `tessera_claim_device_info` samples in the text, each as `label="value"` pairs.
fn info_samples(text: &str) -> Vec<String> {
    let mut samples: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("tessera_claim_device_info{"))
        .map(|l| {
            let (labels, value) = l.rsplit_once("} ").unwrap();
            assert_eq!(value, "1.0", "an info sample is 1: {l}");
            labels.to_string()
        })
        .collect();
    samples.sort();
    samples
}

#[tokio::test]
async fn a_claims_pods_are_named_on_the_dcgm_entity_of_each_device_until_it_is_unprepared() {
    let node = TestNode::with_gpus(3);
    let _daemons = StopDaemons::new(&node);
    let plugin = start(&node, BOOT_ID).await;
    // The binary installs the sink (prepare reports the claim it read, with the pods it is reserved for)
    // and registers the node's gauges over the committed checkpoint.
    tessera_kubelet_plugin::metrics::sink::install(metrics());
    let state = plugin.state.clone();
    metrics().register_node(NodeCollector::new(
        Arc::new(move || state.checkpoint()),
        node.backend.clone(),
        None,
    ));
    let gpus = node.backend.discover().unwrap().gpus;
    let uuid = |i: usize| gpus[i].uuid.clone();

    let claims = [
        whole(&node, "w", "gpu-1"),
        whole(&node, "m", "gpu-0-mig-1g-10gb-0"),
        mps_share(&node, "a"),
        mps_share(&node, "b"),
    ];
    for c in &claims {
        plugin.state.prepare(c).await.unwrap();
    }
    let made = instances(&node, 0);
    let [(gi, mig_uuid)] = &made[..] else {
        panic!("one MIG instance on GPU 0: {made:?}");
    };

    let sample = |name: &str, device: &str, entity: &str, gi: &str, mig: &str, sharing: &str| {
        format!(
            "namespace=\"team\",pod=\"pod-{name}\",claim=\"{name}\",request=\"gpu\",device=\"{device}\",\
             UUID=\"{entity}\",GPU_I_ID=\"{gi}\",mig_uuid=\"{mig}\",sharing=\"{sharing}\""
        )
    };
    let mut expected = vec![
        sample("w", "gpu-1", &uuid(1), "", "", ""),
        sample(
            "m",
            "gpu-0-mig-1g-10gb-0",
            &uuid(0),
            &gi.to_string(),
            mig_uuid,
            "",
        ),
        // Both shares on GPU 2's one entity: the recording rules count them as two pods of it.
        sample("a", "gpu-2-shared", &uuid(2), "", "", "MPS"),
        sample("b", "gpu-2-shared", &uuid(2), "", "", "MPS"),
    ];
    expected.sort();
    let text = metrics().render();
    assert_eq!(info_samples(&text), expected, "{text}");

    for c in &claims[..2] {
        plugin.state.unprepare(c).await.unwrap();
    }
    let left = info_samples(&metrics().render());
    assert_eq!(left, expected[..2], "only the shares' pods are left");
    for c in &claims[2..] {
        plugin.state.unprepare(c).await.unwrap();
    }
    let text = metrics().render();
    assert_eq!(info_samples(&text), Vec::<String>::new(), "{text}");
}
