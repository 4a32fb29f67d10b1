//! Warm partitions with the plugin's real preparers over a simulated node: a released MIG device or MPS
//! daemon published with `warmSeconds` stays for the next claim of the same device, goes when a claim needs
//! that part of the GPU or its window ends, and survives a restart without leaking.

mod common;

use std::time::Duration;

use common::{BOOT_ID, StopDaemons, TestNode, add, instances, start};
use tessera_kubelet_plugin::gpu::ComputeMode;
use tessera_kubelet_plugin::kubelet::claims::fake::{NODE, claim};
use tessera_kubelet_plugin::node::state::ClaimRef;

/// The MPS daemon of the test shares of GPU 0: their namespace's own (the fake claims are in `default`).
const SHARES_DAEMON: &str = "gpu-0@default";

/// Long enough that no test sees a window end unless it asks for one.
const WINDOW: u64 = 3600;

fn mig_claim(node: &TestNode, name: &str, device: &str) -> ClaimRef {
    add(
        node,
        claim(name)
            .allocated(device)
            .reserved_for_pod(&format!("pod-{name}"))
            .build(),
    )
}

fn share_claim(node: &TestNode, name: &str, thread_percentage: u32) -> ClaimRef {
    add(
        node,
        claim(name)
            .allocated_share("gpu-0-shared", name)
            .consumed("compute", "40")
            .config(serde_json::json!({
                "apiVersion": "gpu.tessera.dev/v1alpha1",
                "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": thread_percentage}},
            }))
            .reserved_for_pod(&format!("pod-{name}"))
            .build(),
    )
}

fn mig_mode_on(node: &TestNode, gpu: u32) -> bool {
    node.backend.mig_mode(gpu).unwrap().current
}

fn warm_keys(state: &tessera_kubelet_plugin::node::state::NodeState) -> Vec<String> {
    state.checkpoint().warm.into_keys().collect()
}

#[tokio::test]
async fn a_released_mig_device_published_warm_stays_and_the_next_claim_of_it_takes_the_same_instance() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    node.claims
        .with_device_warm_seconds(NODE, "gpu-0-mig-1g-10gb-0", WINDOW);
    let plugin = start(&node, BOOT_ID).await;
    let first = mig_claim(&node, "a", "gpu-0-mig-1g-10gb-0");
    plugin.state.prepare(&first).await.unwrap();
    let made = instances(&node, 0);
    assert_eq!(made.len(), 1, "{made:?}");

    plugin.state.unprepare(&first).await.unwrap();
    assert_eq!(instances(&node, 0), made, "the released instance stays warm");
    assert!(mig_mode_on(&node, 0), "MIG mode stays on under a warm instance");
    assert_eq!(warm_keys(&plugin.state), ["gpu-0-mig-1g-10gb-0"]);
    assert!(plugin.state.checkpoint().claims.is_empty());

    let second = mig_claim(&node, "b", "gpu-0-mig-1g-10gb-0");
    let devices = plugin.state.prepare(&second).await.unwrap();
    assert_eq!(
        instances(&node, 0),
        made,
        "the second claim got the warm instance, not a new one"
    );
    assert!(warm_keys(&plugin.state).is_empty(), "taken, so no longer warm");
    let spec = std::fs::read_to_string(plugin.state.cdi().spec_path(&second.uid)).unwrap();
    assert!(
        spec.contains(&made[0].1),
        "the CDI spec names the warm instance's UUID: {spec}"
    );
    let record = &plugin.state.checkpoint().claims[&second.uid];
    assert_eq!(record.devices[0].warm_seconds, Some(WINDOW));
    assert!(
        record.devices[0].cost_ms.is_some(),
        "the time a warm hit saves is carried over"
    );
    assert_eq!(devices.len(), 1);
}

#[tokio::test]
async fn a_mig_device_published_without_warm_seconds_is_destroyed_at_unprepare() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    let plugin = start(&node, BOOT_ID).await;
    let c = mig_claim(&node, "a", "gpu-0-mig-1g-10gb-0");
    plugin.state.prepare(&c).await.unwrap();
    plugin.state.unprepare(&c).await.unwrap();
    assert!(instances(&node, 0).is_empty());
    assert!(!mig_mode_on(&node, 0));
    assert!(warm_keys(&plugin.state).is_empty());
}

#[tokio::test]
async fn a_warm_instance_in_the_way_of_an_overlapping_placement_goes_before_that_device_is_made() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    node.claims
        .with_device_warm_seconds(NODE, "gpu-0-mig-1g-10gb-0", WINDOW)
        .with_device_warm_seconds(NODE, "gpu-0-mig-1g-10gb-6", WINDOW);
    let plugin = start(&node, BOOT_ID).await;
    for (name, device) in [("a", "gpu-0-mig-1g-10gb-0"), ("b", "gpu-0-mig-1g-10gb-6")] {
        let c = mig_claim(&node, name, device);
        plugin.state.prepare(&c).await.unwrap();
        plugin.state.unprepare(&c).await.unwrap();
    }
    let before = instances(&node, 0);
    assert_eq!(before.len(), 2);

    // 3g at slice 0 covers slices 0-3: the warm 1g at 0 is in its way, the one at 6 is not.
    let big = mig_claim(&node, "big", "gpu-0-mig-3g-40gb-0");
    plugin.state.prepare(&big).await.unwrap();
    assert_eq!(warm_keys(&plugin.state), ["gpu-0-mig-1g-10gb-6"]);
    let after = instances(&node, 0);
    assert_eq!(after.len(), 2, "the 3g and the warm 1g at slice 6: {after:?}");
    let kept_6 = plugin.state.checkpoint().warm["gpu-0-mig-1g-10gb-6"].clone();
    let kept_uuid = match kept_6.detail {
        tessera_kubelet_plugin::node::checkpoint::DeviceDetail::Mig(m) => m.uuid.unwrap(),
        other => panic!("{other:?}"),
    };
    assert!(
        after.iter().any(|(_, uuid)| *uuid == kept_uuid),
        "the warm instance at slice 6 is untouched: {after:?}"
    );
}

#[tokio::test]
async fn a_whole_gpu_claim_on_a_gpu_with_warm_instances_gets_it_out_of_mig_mode() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    node.claims
        .with_device_warm_seconds(NODE, "gpu-0-mig-1g-10gb-3", WINDOW);
    let plugin = start(&node, BOOT_ID).await;
    let c = mig_claim(&node, "a", "gpu-0-mig-1g-10gb-3");
    plugin.state.prepare(&c).await.unwrap();
    plugin.state.unprepare(&c).await.unwrap();
    assert!(mig_mode_on(&node, 0));

    let whole = mig_claim(&node, "whole", "gpu-0");
    plugin.state.prepare(&whole).await.unwrap();
    assert!(instances(&node, 0).is_empty());
    assert!(!mig_mode_on(&node, 0), "the whole GPU is usable: MIG mode off");
    assert!(warm_keys(&plugin.state).is_empty());
}

#[tokio::test]
async fn a_warm_instance_whose_window_ended_is_destroyed_and_mig_mode_goes_off() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    node.claims
        .with_device_warm_seconds(NODE, "gpu-1-mig-2g-20gb-2", 1);
    let plugin = start(&node, BOOT_ID).await;
    let c = mig_claim(&node, "a", "gpu-1-mig-2g-20gb-2");
    plugin.state.prepare(&c).await.unwrap();
    plugin.state.unprepare(&c).await.unwrap();
    plugin.state.expire_warm().await;
    assert_eq!(instances(&node, 1).len(), 1, "inside its window it stays");

    tokio::time::sleep(Duration::from_millis(2100)).await;
    plugin.state.expire_warm().await;
    assert!(instances(&node, 1).is_empty());
    assert!(!mig_mode_on(&node, 1));
    assert!(warm_keys(&plugin.state).is_empty());
}

#[tokio::test]
async fn a_warm_instance_survives_a_plugin_restart_inside_its_window_and_is_taken_after_it() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    node.claims
        .with_device_warm_seconds(NODE, "gpu-0-mig-3g-40gb-4", WINDOW);
    let plugin = start(&node, BOOT_ID).await;
    let c = mig_claim(&node, "a", "gpu-0-mig-3g-40gb-4");
    plugin.state.prepare(&c).await.unwrap();
    plugin.state.unprepare(&c).await.unwrap();
    let made = instances(&node, 0);
    drop(plugin);

    let plugin = start(&node, BOOT_ID).await;
    assert_eq!(
        instances(&node, 0),
        made,
        "the start-up sweep keeps what a warm record holds"
    );
    assert_eq!(plugin.recovery.destroyed_mig_instances, 0);
    let again = mig_claim(&node, "b", "gpu-0-mig-3g-40gb-4");
    plugin.state.prepare(&again).await.unwrap();
    assert_eq!(instances(&node, 0), made);
    assert!(warm_keys(&plugin.state).is_empty());
}

#[tokio::test]
async fn a_restart_after_the_window_ended_leaves_no_instance_behind() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    node.claims
        .with_device_warm_seconds(NODE, "gpu-0-mig-1g-10gb-5", 1);
    let plugin = start(&node, BOOT_ID).await;
    let c = mig_claim(&node, "a", "gpu-0-mig-1g-10gb-5");
    plugin.state.prepare(&c).await.unwrap();
    plugin.state.unprepare(&c).await.unwrap();
    drop(plugin);
    tokio::time::sleep(Duration::from_millis(2100)).await;

    let plugin = start(&node, BOOT_ID).await;
    plugin.state.expire_warm().await;
    assert!(instances(&node, 0).is_empty());
    assert!(!mig_mode_on(&node, 0));
    assert!(warm_keys(&plugin.state).is_empty());
}

#[tokio::test]
async fn a_checkpoint_of_another_boot_brings_no_warm_record_and_the_sweep_takes_what_it_held() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    node.claims
        .with_device_warm_seconds(NODE, "gpu-0-mig-1g-10gb-1", WINDOW);
    let plugin = start(&node, BOOT_ID).await;
    let c = mig_claim(&node, "a", "gpu-0-mig-1g-10gb-1");
    plugin.state.prepare(&c).await.unwrap();
    plugin.state.unprepare(&c).await.unwrap();
    node.claims.remove("default", "a");
    drop(plugin);

    // The simulated GPUs keep their instances across the "reboot", which real ones would not: what no
    // record of the new boot holds must still go.
    let plugin = start(&node, "another-boot").await;
    assert!(warm_keys(&plugin.state).is_empty());
    assert!(instances(&node, 0).is_empty());
}

#[tokio::test]
async fn the_last_mps_share_leaves_its_daemon_warm_and_the_next_first_share_uses_that_daemon() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    node.claims.with_device_warm_seconds(NODE, "gpu-0-shared", 1);
    let plugin = start(&node, BOOT_ID).await;
    let a = share_claim(&node, "a", 60);
    plugin.state.prepare(&a).await.unwrap();
    let daemon = plugin.mps.mps().pid(SHARES_DAEMON).expect("the share's daemon");

    plugin.state.unprepare(&a).await.unwrap();
    assert_eq!(
        plugin.mps.mps().pid(SHARES_DAEMON),
        Some(daemon),
        "the daemon stays warm"
    );
    assert_eq!(warm_keys(&plugin.state), ["gpu-0-shared"]);
    assert_eq!(
        node.backend.compute_mode(0).unwrap(),
        ComputeMode::ExclusiveProcess,
        "the GPU stays the MPS server's"
    );
    let watch = plugin
        .mps
        .watch_daemons(&node.backend.discover().unwrap().gpus, true);
    assert!(watch.stopped.is_empty(), "a warm daemon is no orphan: {watch:?}");

    let b = share_claim(&node, "b", 60);
    plugin.state.prepare(&b).await.unwrap();
    assert_eq!(
        plugin.mps.mps().pid(SHARES_DAEMON),
        Some(daemon),
        "the same daemon serves the next share"
    );
    assert!(warm_keys(&plugin.state).is_empty());

    plugin.state.unprepare(&b).await.unwrap();
    tokio::time::sleep(Duration::from_millis(2100)).await;
    plugin.state.expire_warm().await;
    assert_eq!(
        plugin.mps.mps().pid(SHARES_DAEMON),
        None,
        "the window ended: daemon stopped"
    );
    assert_eq!(node.backend.compute_mode(0).unwrap(), ComputeMode::Default);
    assert!(warm_keys(&plugin.state).is_empty());
}

#[tokio::test]
async fn a_warm_daemon_with_other_settings_than_the_next_share_asks_for_is_started_anew() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    node.claims.with_device_warm_seconds(NODE, "gpu-0-shared", WINDOW);
    let plugin = start(&node, BOOT_ID).await;
    let a = share_claim(&node, "a", 60);
    plugin.state.prepare(&a).await.unwrap();
    let daemon = plugin.mps.mps().pid(SHARES_DAEMON).unwrap();
    plugin.state.unprepare(&a).await.unwrap();

    let b = share_claim(&node, "b", 30);
    plugin.state.prepare(&b).await.unwrap();
    let now = plugin
        .mps
        .mps()
        .pid(SHARES_DAEMON)
        .expect("a daemon for the new share");
    assert_ne!(
        now, daemon,
        "a daemon started for 60 % does not serve a share that asks for 30 %"
    );
    let percentage = plugin
        .mps
        .mps()
        .send(SHARES_DAEMON, "get_default_active_thread_percentage")
        .unwrap();
    assert_eq!(percentage, "30.0");
}

#[tokio::test]
async fn a_warm_daemon_survives_a_plugin_restart_and_a_whole_gpu_claim_stops_it() {
    let node = TestNode::with_gpus(2);
    let _daemons = StopDaemons::new(&node);
    node.claims.with_device_warm_seconds(NODE, "gpu-0-shared", WINDOW);
    let plugin = start(&node, BOOT_ID).await;
    let a = share_claim(&node, "a", 50);
    plugin.state.prepare(&a).await.unwrap();
    let daemon = plugin.mps.mps().pid(SHARES_DAEMON).unwrap();
    plugin.state.unprepare(&a).await.unwrap();
    drop(plugin);

    let plugin = start(&node, BOOT_ID).await;
    assert_eq!(
        plugin.mps.mps().pid(SHARES_DAEMON),
        Some(daemon),
        "the start-up sweep of orphaned daemons keeps a warm one"
    );
    let whole = mig_claim(&node, "whole", "gpu-0");
    plugin.state.prepare(&whole).await.unwrap();
    assert_eq!(
        plugin.mps.mps().pid(SHARES_DAEMON),
        None,
        "the whole GPU is not left to a daemon"
    );
    assert_eq!(node.backend.compute_mode(0).unwrap(), ComputeMode::Default);
    assert!(warm_keys(&plugin.state).is_empty());
}
