//! MIG devices, shares and opaque configs through the prepare state machine, with the plugin's real
//! preparers on a simulated node (real MPS daemon processes included).

mod common;

use std::{path::PathBuf, sync::Arc};

use common::{BOOT_ID, StopDaemons, TestNode, start};
use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use tessera_api::GROUP_VERSION;
use tessera_kubelet_plugin::devices::preparers::{SharedPreparer, with_preparers};
use tessera_kubelet_plugin::devices::sharing::Sharer;
use tessera_kubelet_plugin::devices::sharing::mps::{Launcher, MpsManager};
use tessera_kubelet_plugin::gpu::ComputeMode;
use tessera_kubelet_plugin::gpu::driver_root::{DriverFiles, DriverRoot};
use tessera_kubelet_plugin::kubelet::claims::fake::claim;
use tessera_kubelet_plugin::node::cdi;
use tessera_kubelet_plugin::node::checkpoint::DeviceDetail;
use tessera_kubelet_plugin::node::state::{ClaimRef, NodeState, Recovery};
use tessera_sim_model::backend::mig_minors_by_formula;
use tessera_sim_model::kernel::SIMULATED_DRIVER_VERSION;

struct Plugin {
    state: Arc<NodeState>,
    shared: Arc<SharedPreparer>,
    recovery: Recovery,
}

/// The MPS daemon of the test shares of GPU 0: their namespace's own (the fake claims are in `default`).
const SHARES_DAEMON: &str = "gpu-0@default";

/// The plugin as `cli/take_over.rs` assembles it, (re)started over `node`.
fn plugin(node: &TestNode) -> Plugin {
    let program = PathBuf::from(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"));
    let mps = MpsManager::new(&node.state_dir(), Launcher::Simulated { program });
    let files = DriverFiles::discover(
        &DriverRoot::new(node.backend.driver_root()),
        Some(SIMULATED_DRIVER_VERSION),
    );
    let shared = Arc::new(SharedPreparer::new(
        Arc::new(Sharer::new(node.backend.clone(), mps, false)),
        files,
    ));
    let state = with_preparers(node.state_unrecovered(BOOT_ID), &shared);
    let recovery = state.recover().unwrap();
    shared.stop_orphaned_daemons(&node.backend.discover().unwrap().gpus);
    Plugin {
        state: Arc::new(state),
        shared,
        recovery,
    }
}

fn add(node: &TestNode, c: ResourceClaim) -> ClaimRef {
    let r = ClaimRef::of(&c);
    node.claims.insert(c);
    r
}

fn env_of(p: &Plugin, r: &ClaimRef) -> Vec<String> {
    p.state.cdi().read(&r.uid).unwrap().unwrap().devices[0]
        .container_edits
        .env
        .clone()
}

#[tokio::test]
async fn a_mig_claim_gets_its_parent_gpu_and_capability_nodes_and_leaves_nothing_behind() {
    let node = TestNode::with_gpus(2);
    let p = plugin(&node);
    let r = add(&node, claim("m").allocated("gpu-1-mig-3g-40gb-4").build());
    p.state.prepare(&r).await.unwrap();

    let DeviceDetail::Mig(detail) = &p.state.checkpoint().claims[&r.uid].devices[0].detail else {
        panic!()
    };
    let (gi, ci, uuid) = (
        detail.gpu_instance.unwrap(),
        detail.compute_instance.unwrap(),
        detail.uuid.clone().unwrap(),
    );
    let spec = p.state.cdi().read(&r.uid).unwrap().unwrap();
    let edits = &spec.devices[0].container_edits;
    assert!(
        edits.env.contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string())
            && edits
                .env
                .contains(&format!("TESSERA_UUID_GPU_1_MIG_3G_40GB_4={uuid}")),
        "{:?}",
        edits.env
    );
    let paths: Vec<&str> = edits.device_nodes.iter().map(|n| n.path.as_str()).collect();
    let (gi_minor, ci_minor) = mig_minors_by_formula(1, gi, ci).unwrap();
    for want in [
        "/dev/nvidia1".to_string(),
        "/dev/nvidiactl".to_string(),
        format!("/dev/nvidia-caps/nvidia-cap{gi_minor}"),
        format!("/dev/nvidia-caps/nvidia-cap{ci_minor}"),
    ] {
        assert!(paths.contains(&want.as_str()), "{want} missing from {paths:?}");
    }
    let cap = edits
        .device_nodes
        .iter()
        .find(|n| n.path.ends_with(&format!("cap{ci_minor}")))
        .unwrap();
    assert_eq!(
        (cap.kind.as_deref(), cap.minor),
        (Some("c"), Some(i64::from(ci_minor)))
    );
    assert_eq!(node.backend.list_gpu_instances(1).unwrap().len(), 1);

    p.state.unprepare(&r).await.unwrap();
    assert!(node.backend.list_gpu_instances(1).unwrap_or_default().is_empty());
    assert!(!node.backend.mig_mode(1).unwrap().current);
}

#[tokio::test]
async fn a_bad_config_fails_the_prepare_with_its_validation_message_and_changes_nothing() {
    let node = TestNode::with_gpus(1);
    let p = plugin(&node);
    let bad = json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 150}}});
    let r = add(&node, claim("bad").allocated("gpu-0-shared").config(bad).build());
    let err = p.state.prepare(&r).await.unwrap_err().to_string();
    assert!(
        err.contains("sharing.mps.defaultActiveThreadPercentage: must be between 1 and 100, got 150"),
        "{err}"
    );
    let wrong_kind =
        json!({"apiVersion": GROUP_VERSION, "kind": "MigConfig", "sharing": {"strategy": "MPS"}});
    let r2 = add(
        &node,
        claim("wrong").allocated("gpu-0").config(wrong_kind).build(),
    );
    let err = p.state.prepare(&r2).await.unwrap_err().to_string();
    assert!(
        err.contains("cannot apply MigConfig to whole GPU gpu-0; use GpuConfig"),
        "{err}"
    );
    let typo =
        json!({"apiVersion": GROUP_VERSION, "kind": "MigConfig", "sharing": {"strategy": "MPS", "mpss": {}}});
    let r3 = add(
        &node,
        claim("typo")
            .allocated("gpu-0-mig-1g-10gb-0")
            .config(typo)
            .build(),
    );
    let err = p.state.prepare(&r3).await.unwrap_err().to_string();
    assert!(
        err.contains("sharing: unknown field \"mpss\"; allowed fields: strategy, mps, timeSlicing"),
        "{err}"
    );

    assert!(p.state.checkpoint().claims.is_empty());
    assert!(p.state.cdi().claim_uids().unwrap().is_empty());
    assert!(p.shared.sharer.mps().running().is_empty());
    assert_eq!(node.backend.compute_mode(0).unwrap(), ComputeMode::Default);
    assert!(!node.backend.mig_mode(0).unwrap().current);
}

#[tokio::test]
async fn a_per_device_limit_for_a_device_this_node_lacks_fails_the_prepare_naming_the_key() {
    let node = TestNode::with_gpus(2);
    let p = plugin(&node);
    let elsewhere = json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"perDevicePinnedMemoryLimit": {"gpu-7-shared": "4Gi"}}}});
    let r = add(
        &node,
        claim("elsewhere")
            .allocated("gpu-0-shared")
            .config(elsewhere)
            .build(),
    );
    let err = p.state.prepare(&r).await.unwrap_err().to_string();
    assert!(err.contains("perDevicePinnedMemoryLimit"), "{err}");
    assert!(err.contains("gpu-7-shared"), "{err}");

    // A key for the node's other GPU is fine: a claim's config may speak of every device it could get.
    let other_gpu = json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mps": {"perDevicePinnedMemoryLimit": {"gpu-1-shared": "4Gi"}}}});
    let ok = add(
        &node,
        claim("other-gpu")
            .allocated("gpu-0-shared")
            .config(other_gpu)
            .build(),
    );
    p.state.prepare(&ok).await.unwrap();
    p.state.unprepare(&ok).await.unwrap();
    assert!(p.state.checkpoint().claims.is_empty());
    assert!(p.shared.sharer.mps().running().is_empty());
}

#[tokio::test]
async fn two_share_claims_get_their_own_limits_and_the_last_unprepare_stops_the_daemon() {
    let node = TestNode::with_gpus(1);
    let p = plugin(&node);
    let a = add(
        &node,
        claim("a")
            .allocated_share("gpu-0-shared", "s1")
            .consumed("compute", "30")
            .consumed("memory", "20Gi")
            .build(),
    );
    let b = add(
        &node,
        claim("b")
            .allocated_share("gpu-0-shared", "s2")
            .consumed("compute", "60")
            .consumed("memory", "40Gi")
            .build(),
    );
    let (pa, pb) = tokio::join!(p.state.prepare(&a), p.state.prepare(&b));
    assert_eq!(pa.unwrap()[0].share_id.as_deref(), Some("s1"));
    pb.unwrap();
    let (ea, eb) = (env_of(&p, &a), env_of(&p, &b));
    assert!(
        ea.contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30".into())
            && ea.contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M".into()),
        "{ea:?}"
    );
    assert!(
        eb.contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60".into())
            && eb.contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40960M".into()),
        "{eb:?}"
    );
    let mps = p.shared.sharer.mps();
    assert_eq!(mps.running(), vec![SHARES_DAEMON.to_string()]);

    p.state.unprepare(&a).await.unwrap();
    assert_eq!(mps.running(), vec![SHARES_DAEMON.to_string()]);
    p.state.unprepare(&b).await.unwrap();
    assert!(mps.running().is_empty());
    assert_eq!(node.backend.compute_mode(0).unwrap(), ComputeMode::Default);
}

#[tokio::test]
async fn a_class_time_slicing_config_sets_the_interval_until_the_last_share_leaves() {
    let node = TestNode::with_gpus(1);
    let p = plugin(&node);
    let ts = json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Medium"}}});
    let a = add(
        &node,
        claim("a")
            .allocated("gpu-0-share-0")
            .class_config(ts.clone())
            .build(),
    );
    let b = add(
        &node,
        claim("b").allocated("gpu-0-share-1").class_config(ts).build(),
    );
    p.state.prepare(&a).await.unwrap();
    p.state.prepare(&b).await.unwrap();
    assert_eq!(
        node.backend.time_slice(0).unwrap(),
        tessera_kubelet_plugin::gpu::TimeSlice::Medium
    );
    assert!(
        !env_of(&p, &a).iter().any(|e| e.starts_with("CUDA_MPS")),
        "{:?}",
        env_of(&p, &a)
    );
    p.state.unprepare(&a).await.unwrap();
    assert_eq!(
        node.backend.time_slice(0).unwrap(),
        tessera_kubelet_plugin::gpu::TimeSlice::Medium
    );
    p.state.unprepare(&b).await.unwrap();
    assert_eq!(
        node.backend.time_slice(0).unwrap(),
        tessera_kubelet_plugin::gpu::TimeSlice::Default
    );
}

#[tokio::test]
async fn a_restarted_plugin_removes_leaked_mig_instances_and_keeps_prepared_claims_and_daemons() {
    let node = TestNode::with_gpus(2);
    let first = plugin(&node);
    let shares: Vec<ClaimRef> = ["a", "b"]
        .map(|n| {
            add(
                &node,
                claim(n)
                    .allocated_share("gpu-0-shared", n)
                    .consumed("compute", "40")
                    .build(),
            )
        })
        .into();
    for s in &shares {
        first.state.prepare(s).await.unwrap();
    }
    let m = add(&node, claim("m").allocated("gpu-1-mig-1g-10gb-6").build());
    first.state.prepare(&m).await.unwrap();
    let daemon = first.shared.sharer.mps().pid(SHARES_DAEMON).unwrap();
    // What a crash between creating an instance and recording it leaves: an instance nobody knows.
    let prof = node.backend.discover().unwrap().gpus[1]
        .mig
        .as_ref()
        .unwrap()
        .profile("3g.40gb")
        .unwrap()
        .profile_id;
    node.backend
        .create_gpu_instance(1, prof, tessera_api::MigPlacement { start: 0, size: 4 })
        .unwrap();
    drop(first);

    let second = plugin(&node);
    assert_eq!(second.recovery.destroyed_mig_instances, 1);
    assert_eq!(second.recovery.prepared, 3);
    assert_eq!(
        node.backend.list_gpu_instances(1).unwrap().len(),
        1,
        "the prepared MIG claim must survive"
    );
    assert_eq!(
        second.shared.sharer.mps().pid(SHARES_DAEMON),
        Some(daemon),
        "the daemon must survive the restart"
    );
    // The restored share count keeps the daemon until the last share goes.
    second.state.unprepare(&shares[0]).await.unwrap();
    assert_eq!(second.shared.sharer.mps().pid(SHARES_DAEMON), Some(daemon));
    second.state.unprepare(&shares[1]).await.unwrap();
    assert!(second.shared.sharer.mps().running().is_empty());
    second.state.unprepare(&m).await.unwrap();
    assert!(node.backend.list_gpu_instances(1).unwrap_or_default().is_empty());
}

#[tokio::test]
async fn shares_of_a_mig_placement_create_the_instance_with_the_first_and_destroy_it_with_the_last() {
    let node = TestNode::with_gpus(1);
    let p = plugin(&node);
    let shares: Vec<ClaimRef> = ["a", "b"]
        .map(|n| {
            add(
                &node,
                claim(n)
                    .allocated_share("gpu-0-mig-3g-40gb-4-shared", n)
                    .consumed("compute", "50")
                    .build(),
            )
        })
        .into();
    for s in &shares {
        p.state.prepare(s).await.unwrap();
    }
    let gis = node.backend.list_gpu_instances(0).unwrap();
    assert_eq!(gis.len(), 1, "one MIG device serves both shares");
    let mig_uuid = &gis[0].compute_instances[0].uuid;
    for s in &shares {
        let env = env_of(&p, s);
        assert!(
            env.contains(&format!("TESSERA_UUID_GPU_0_MIG_3G_40GB_4_SHARED={mig_uuid}")),
            "{env:?}"
        );
    }
    // Other MIG instances of the GPU are not MPS clients: the GPU stays in default compute mode.
    assert_eq!(node.backend.compute_mode(0).unwrap(), ComputeMode::Default);
    p.state.unprepare(&shares[0]).await.unwrap();
    assert_eq!(node.backend.list_gpu_instances(0).unwrap().len(), 1);
    p.state.unprepare(&shares[1]).await.unwrap();
    assert!(node.backend.list_gpu_instances(0).unwrap_or_default().is_empty());
    assert!(!node.backend.mig_mode(0).unwrap().current);
    assert!(p.shared.sharer.mps().running().is_empty());
}

#[tokio::test]
async fn a_restarted_plugin_destroys_a_shared_mig_device_after_its_last_share() {
    let node = TestNode::with_gpus(1);
    let first = plugin(&node);
    let shares: Vec<ClaimRef> = ["a", "b"]
        .map(|n| {
            add(
                &node,
                claim(n).allocated_share("gpu-0-mig-1g-10gb-2-shared", n).build(),
            )
        })
        .into();
    for s in &shares {
        first.state.prepare(s).await.unwrap();
    }
    drop(first);

    let second = plugin(&node);
    assert_eq!(second.recovery.destroyed_mig_instances, 0);
    second.state.unprepare(&shares[0]).await.unwrap();
    assert_eq!(node.backend.list_gpu_instances(0).unwrap().len(), 1);
    second.state.unprepare(&shares[1]).await.unwrap();
    assert!(node.backend.list_gpu_instances(0).unwrap_or_default().is_empty());
    assert!(second.shared.sharer.mps().running().is_empty());
}

/// Share ids as the scheduler gives them (UIDs), one per share of GPU 0 that [`two_shares_of_gpu_0`] holds.
const SMALL_SHARE: &str = "5f0c6a44-1b7e-4d2a-9c61-3e8f2a7b9d10";
const LARGE_SHARE: &str = "a83d2e19-6c4f-47b5-8e02-d1b7c9f4e265";

/// A running pod's claim whose two requests got shares of one GPU (`matchAttribute` on its `uuid`, which
/// consumable capacity allows): 10 % and 5Gi, 30 % and 20Gi.
fn two_shares_of_gpu_0(node: &TestNode) -> ClaimRef {
    add(
        node,
        claim("pair")
            .request("small")
            .allocated_share("gpu-0-shared", SMALL_SHARE)
            .consumed("compute", "10")
            .consumed("memory", "5Gi")
            .request("large")
            .allocated_share("gpu-0-shared", LARGE_SHARE)
            .consumed("compute", "30")
            .consumed("memory", "20Gi")
            .reserved_for_pod("pod-pair")
            .build(),
    )
}

/// The CDI device names of a claim's spec, in order.
fn cdi_names(state: &NodeState, r: &ClaimRef) -> Vec<String> {
    let spec = state.cdi().read(&r.uid).unwrap().expect("the claim's CDI spec");
    spec.devices.into_iter().map(|d| d.name).collect()
}

#[tokio::test]
async fn two_shares_of_one_gpu_in_one_claim_get_a_cdi_device_each_with_its_own_limits_and_go_together() {
    let node = TestNode::with_gpus(1);
    let p = plugin(&node);
    let r = two_shares_of_gpu_0(&node);

    let prepared = p.state.prepare(&r).await.unwrap();

    let names = cdi_names(&p.state, &r);
    assert_eq!(
        names,
        vec![
            format!("{}-gpu-0-shared-{SMALL_SHARE}", r.uid),
            format!("{}-gpu-0-shared-{LARGE_SHARE}", r.uid),
        ],
        "a spec naming one device twice is refused by the runtime"
    );
    let returned: Vec<(Option<&str>, &[String])> = prepared
        .iter()
        .map(|d| (d.share_id.as_deref(), d.cdi_device_ids.as_slice()))
        .collect();
    assert_eq!(
        returned,
        vec![
            (Some(SMALL_SHARE), &[cdi::qualified_name(&names[0])][..]),
            (Some(LARGE_SHARE), &[cdi::qualified_name(&names[1])][..]),
        ]
    );
    let spec = p.state.cdi().read(&r.uid).unwrap().unwrap();
    for (device, (pct, mem)) in spec.devices.iter().zip([("10", "5120M"), ("30", "20480M")]) {
        let env = &device.container_edits.env;
        let limits: Vec<&String> = env
            .iter()
            .filter(|e| e.starts_with("CUDA_MPS_ACTIVE_THREAD") || e.starts_with("CUDA_MPS_PINNED"))
            .collect();
        assert_eq!(
            limits,
            [
                &format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={pct}"),
                &format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={mem}"),
            ],
            "{}: {env:?}",
            device.name
        );
    }
    assert_eq!(
        p.shared.sharer.users().count("gpu-0"),
        2,
        "each share holds the GPU's daemon"
    );
    assert_eq!(
        p.state.prepare(&r).await.unwrap(),
        prepared,
        "kubelet's retry gets the same devices"
    );

    p.state.unprepare(&r).await.unwrap();
    assert!(p.state.cdi().claim_uids().unwrap().is_empty());
    assert!(p.state.checkpoint().claims.is_empty());
    assert!(p.shared.sharer.mps().running().is_empty());
    assert_eq!(node.backend.compute_mode(0).unwrap(), ComputeMode::Default);
}

#[tokio::test]
async fn a_restarted_plugin_keeps_both_shares_of_one_claim_under_their_cdi_names_with_or_without_its_checkpoint()
 {
    let node = TestNode::with_gpus(1);
    let _stop = StopDaemons::new(&node);
    let r = two_shares_of_gpu_0(&node);
    let first = plugin(&node);
    let prepared = first.state.prepare(&r).await.unwrap();
    let spec = first.state.cdi().read(&r.uid).unwrap().unwrap();
    let daemon = first.shared.sharer.mps().pid(SHARES_DAEMON).unwrap();
    assert_eq!(cdi_names(&first.state, &r).len(), 2);
    assert_ne!(prepared[0].cdi_device_ids, prepared[1].cdi_device_ids);
    drop(first);

    let second = plugin(&node);
    assert_eq!(second.recovery.prepared, 1, "{:?}", second.recovery);
    assert_eq!(second.state.prepare(&r).await.unwrap(), prepared);
    assert_eq!(second.state.cdi().read(&r.uid).unwrap().unwrap(), spec);
    assert_eq!(second.shared.sharer.users().count("gpu-0"), 2);
    drop(second);

    // Without its record the claim is rebuilt from the API server and its spec, under the same names.
    let path = node.state_dir().join("checkpoint.json");
    std::fs::rename(&path, node.state_dir().join("checkpoint.json.aside")).unwrap();
    let third = start(&node, BOOT_ID).await;
    assert_eq!(
        third.recovery.adopted,
        vec![r.uid.clone()],
        "{:?}",
        third.recovery
    );
    assert_eq!(third.state.prepare(&r).await.unwrap(), prepared);
    assert_eq!(third.state.cdi().read(&r.uid).unwrap().unwrap(), spec);
    assert_eq!(third.mps.mps().pid(SHARES_DAEMON), Some(daemon));

    third.state.unprepare(&r).await.unwrap();
    assert!(third.state.cdi().claim_uids().unwrap().is_empty());
    assert!(
        third.mps.mps().running().is_empty(),
        "the daemon outlived both shares"
    );
}

/// Issue 39 item 1: the scheduler packs a burstable share's request; the share runs with its class's
/// ceiling, and the per-claim gauges show both. A ceiling below the request, or on a whole GPU, is
/// refused at prepare (a class's config reaches no webhook check against the claim).
#[tokio::test]
async fn a_burstable_share_runs_with_its_classs_ceiling_and_the_gauges_show_request_and_ceiling() {
    use tessera_kubelet_plugin::devices::sharing::{CLIENT_THREAD_LIMIT, COMPUTE_REQUEST};
    use tessera_kubelet_plugin::metrics::prometheus::claim_usage;
    let node = TestNode::with_gpus(2);
    let p = plugin(&node);
    let burstable = |ceiling: u32| {
        json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mps": {"computeCeiling": ceiling}}})
    };
    let a = add(
        &node,
        claim("burst")
            .allocated_share("gpu-0-shared", "s1")
            .consumed("compute", "30")
            .consumed("memory", "10Gi")
            .class_config(burstable(80))
            .build(),
    );
    let b = add(
        &node,
        claim("guaranteed")
            .allocated_share("gpu-0-shared", "s2")
            .consumed("compute", "30")
            .consumed("memory", "10Gi")
            .build(),
    );
    p.state.prepare(&a).await.unwrap();
    p.state.prepare(&b).await.unwrap();
    let (ea, eb) = (env_of(&p, &a), env_of(&p, &b));
    assert!(
        ea.contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=80".into())
            && ea.contains(&"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M".into()),
        "the ceiling, and memory still the request: {ea:?}"
    );
    assert!(
        eb.contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30".into()),
        "{eb:?}"
    );
    let checkpoint = p.state.checkpoint();
    let DeviceDetail::Shared(s) = &checkpoint.claims[&a.uid].devices[0].detail else {
        panic!("not a share: {:?}", checkpoint.claims[&a.uid]);
    };
    assert_eq!(
        (
            s.limits[COMPUTE_REQUEST].as_str(),
            s.limits[CLIENT_THREAD_LIMIT].as_str()
        ),
        ("30", "80")
    );
    let usage = claim_usage(&checkpoint, node.backend.as_ref(), |_| String::new());
    let of = |name: &str| {
        let u = usage.iter().find(|u| u.claim == name).unwrap();
        (u.compute_request_ratio, u.compute_share_ratio)
    };
    assert_eq!(of("burst"), (Some(0.3), Some(0.8)));
    assert_eq!(of("guaranteed"), (Some(0.3), Some(0.3)));

    let below = add(
        &node,
        claim("below")
            .allocated_share("gpu-1-shared", "s3")
            .consumed("compute", "50")
            .class_config(burstable(40))
            .build(),
    );
    let err = p.state.prepare(&below).await.unwrap_err().to_string();
    assert!(
        err.contains("sharing.mps.computeCeiling: 40 is below the share's compute request of 50"),
        "{err}"
    );
    let whole = add(
        &node,
        claim("whole")
            .allocated("gpu-1")
            .class_config(burstable(80))
            .build(),
    );
    let err = p.state.prepare(&whole).await.unwrap_err().to_string();
    assert!(
        err.contains("sharing.mps.computeCeiling: means nothing on whole GPU gpu-1"),
        "{err}"
    );
    p.state.unprepare(&a).await.unwrap();
    p.state.unprepare(&b).await.unwrap();
    assert!(p.shared.sharer.mps().running().is_empty());
}
