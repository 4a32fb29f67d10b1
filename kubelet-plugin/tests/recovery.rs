//! Recovery with pods running: a checkpoint of another boot, a corrupted one, one moved aside, records
//! the API does not know, and claims whose rollback fails. The plugin is assembled with its real preparers
//! over a simulated node (MIG instances in the simulated hardware, real MPS daemon processes); the API
//! server is the fake claim source, which is where the plugin reads claims.

mod common;

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use common::{BOOT_ID, Plugin, StopDaemons, TestNode, add, instances, start};
use tessera_kubelet_plugin::kubelet::claims::fake::{NODE, claim};
use tessera_kubelet_plugin::node::cdi;
use tessera_kubelet_plugin::node::cdi::ContainerEdits;
use tessera_kubelet_plugin::node::checkpoint::{
    Checkpoint, CheckpointStore, ClaimRecord, DeviceDetail, DeviceRecord, Loaded, Phase, SharedDetail,
};
use tessera_kubelet_plugin::node::error::ClaimError;
use tessera_kubelet_plugin::node::state::{
    ClaimRef, DeviceContext, DeviceKind, DevicePreparer, WholeGpuPreparer,
};
use tessera_sim_model::backend::NodeSpec;

/// The MPS daemon of the test shares of GPU 0: their namespace's own (the fake claims are in `default`).
const SHARES_DAEMON: &str = "gpu-0@default";

/// A running pod's claim of a 3g MIG slice on GPU 2.
fn add_mig_slice(node: &TestNode) -> ClaimRef {
    add(
        node,
        claim("slice")
            .allocated("gpu-2-mig-3g-40gb-4")
            .reserved_for_pod("p")
            .build(),
    )
}

/// Three running pods' claims on a 2-GPU node: an exclusive MIG slice, and two MPS shares of GPU 0.
struct Running {
    mig: ClaimRef,
    shares: [ClaimRef; 2],
    mig_instances: Vec<(u32, String)>,
    daemon: u32,
}

async fn run_pods(node: &TestNode, plugin: &Plugin) -> Running {
    let mig = add(
        node,
        claim("m")
            .allocated("gpu-1-mig-3g-40gb-4")
            .reserved_for_pod("pod-m")
            .build(),
    );
    let shares = ["a", "b"].map(|n| {
        add(
            node,
            claim(n)
                .allocated_share("gpu-0-shared", n)
                .consumed("compute", "40")
                .reserved_for_pod(&format!("pod-{n}"))
                .build(),
        )
    });
    for c in std::iter::once(&mig).chain(&shares) {
        plugin.state.prepare(c).await.unwrap();
    }
    Running {
        mig_instances: instances(node, 1),
        daemon: plugin
            .mps
            .mps()
            .pid(SHARES_DAEMON)
            .expect("an MPS daemon for the shares"),
        mig,
        shares,
    }
}

/// Asserts the running pods still have everything they were given.
fn assert_devices_intact(node: &TestNode, plugin: &Plugin, running: &Running) {
    assert_eq!(
        instances(node, 1),
        running.mig_instances,
        "the running pod's MIG instance was destroyed"
    );
    assert_eq!(
        plugin.mps.mps().pid(SHARES_DAEMON),
        Some(running.daemon),
        "the running shares' MPS daemon was stopped"
    );
    for c in std::iter::once(&running.mig).chain(&running.shares) {
        assert!(
            plugin.state.cdi().spec_path(&c.uid).exists(),
            "the CDI spec of running claim {} was removed",
            c.name
        );
        assert_eq!(
            plugin.state.checkpoint().claims[&c.uid].phase,
            Phase::PrepareCompleted,
            "claim {} is not recorded as prepared",
            c.name
        );
    }
}

/// Unprepares every running claim and checks the node is left clean (the re-adopted records were right
/// about what to undo).
async fn unprepare_all_and_assert_clean(node: &TestNode, plugin: &Plugin, running: &Running) {
    for c in std::iter::once(&running.mig).chain(&running.shares) {
        plugin.state.unprepare(c).await.unwrap();
    }
    assert!(instances(node, 1).is_empty(), "MIG instance leaked");
    assert!(plugin.mps.mps().running().is_empty(), "MPS daemon leaked");
    assert!(
        plugin.state.cdi().claim_uids().unwrap().is_empty(),
        "CDI spec leaked"
    );
    assert!(plugin.state.checkpoint().claims.is_empty(), "record leaked");
}

#[tokio::test]
async fn a_checkpoint_of_another_boot_keeps_the_devices_of_running_pods_and_drops_the_rest() {
    let node = TestNode::with_gpus(2);
    let _stop = StopDaemons::new(&node);
    let old = start(&node, "old-boot").await;
    let running = run_pods(&node, &old).await;
    // A claim whose pod is gone (not reserved any more) is not worth keeping.
    let idle = add(&node, claim("idle").allocated("gpu-1-mig-1g-10gb-0").build());
    old.state.prepare(&idle).await.unwrap();
    drop(old);

    let new = start(&node, BOOT_ID).await;
    assert!(new.recovery.discarded_other_boot);
    let mut adopted = new.recovery.adopted.clone();
    adopted.sort();
    let mut expected = vec![
        running.mig.uid.clone(),
        running.shares[0].uid.clone(),
        running.shares[1].uid.clone(),
    ];
    expected.sort();
    assert_eq!(adopted, expected);
    assert_devices_intact(&node, &new, &running);
    assert!(!new.state.checkpoint().claims.contains_key(&idle.uid));
    assert!(!new.state.cdi().spec_path(&idle.uid).exists());
    assert_eq!(
        instances(&node, 1).len(),
        1,
        "the idle claim's instance was not removed"
    );
    assert_eq!(new.state.checkpoint().boot_id, BOOT_ID);
    // kubelet, which still thinks the claims are prepared, gets the same devices back.
    assert_eq!(
        new.state.prepare(&running.mig).await.unwrap()[0].device_name,
        "gpu-1-mig-3g-40gb-4"
    );
    unprepare_all_and_assert_clean(&node, &new, &running).await;
}

#[tokio::test]
async fn a_checkpoint_moved_aside_is_rebuilt_from_the_api_the_cdi_specs_and_the_hardware() {
    let node = TestNode::with_gpus(2);
    let _stop = StopDaemons::new(&node);
    let first = start(&node, BOOT_ID).await;
    let running = run_pods(&node, &first).await;
    let before = first.state.checkpoint();
    drop(first);
    let path = node.state_dir().join("checkpoint.json");
    std::fs::rename(&path, node.state_dir().join("checkpoint.json.corrupt")).unwrap();

    let second = start(&node, BOOT_ID).await;
    assert_eq!(second.recovery.adopted.len(), 3, "{:?}", second.recovery);
    assert_devices_intact(&node, &second, &running);
    // The rebuilt MIG record names the same instance as the lost one.
    assert_eq!(
        second.state.checkpoint().claims[&running.mig.uid].devices[0].detail,
        before.claims[&running.mig.uid].devices[0].detail
    );
    assert!(matches!(
        CheckpointStore::new(&node.state_dir()).load(BOOT_ID).unwrap(),
        Loaded::Current(cp) if cp.claims.len() == 3
    ));
    unprepare_all_and_assert_clean(&node, &second, &running).await;
}

#[tokio::test]
async fn a_corrupted_checkpoint_refuses_prepare_and_unprepare_naming_the_file_and_changes_nothing() {
    let node = TestNode::with_gpus(2);
    let _stop = StopDaemons::new(&node);
    let first = start(&node, BOOT_ID).await;
    let running = run_pods(&node, &first).await;
    drop(first);
    let path = node.state_dir().join("checkpoint.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("gpu-1-mig", "gpu-0-mig");
    std::fs::write(&path, &text).unwrap();

    let second = start(&node, BOOT_ID).await;
    let refused = second
        .recovery
        .refused
        .clone()
        .expect("the corrupted checkpoint was accepted");
    assert!(refused.contains(&path.display().to_string()), "{refused}");
    let fresh = add(
        &node,
        claim("new").allocated("gpu-0").reserved_for_pod("p").build(),
    );
    for err in [
        second.state.prepare(&fresh).await.unwrap_err().to_string(),
        second
            .state
            .unprepare(&running.shares[0])
            .await
            .unwrap_err()
            .to_string(),
    ] {
        assert!(err.contains(&path.display().to_string()), "{err}");
        assert!(err.contains("corrupted") && err.contains("mv "), "{err}");
        assert!(err.contains("plugin's log"), "{err}");
    }
    assert_eq!(second.state.problems(), vec![refused.clone()]);
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        text,
        "the corrupted file was changed"
    );
    assert_eq!(instances(&node, 1), running.mig_instances);
    assert_eq!(second.mps.mps().pid(SHARES_DAEMON), Some(running.daemon));
    for c in std::iter::once(&running.mig).chain(&running.shares) {
        assert!(second.state.cdi().spec_path(&c.uid).exists());
    }

    // The documented fix, without a restart: the next reconcile re-adopts the running pods' devices.
    std::fs::rename(&path, node.state_dir().join("checkpoint.json.corrupt")).unwrap();
    let healed = second.state.reconcile().await;
    assert_eq!(healed.refused, None);
    assert_eq!(healed.adopted.len(), 3, "{healed:?}");
    assert!(second.state.problems().is_empty());
    assert_devices_intact(&node, &second, &running);
    unprepare_all_and_assert_clean(&node, &second, &running).await;
}

#[tokio::test]
async fn an_unreachable_api_server_after_a_lost_checkpoint_destroys_nothing_until_it_answers() {
    let node = TestNode::with_gpus(2);
    let _stop = StopDaemons::new(&node);
    let first = start(&node, BOOT_ID).await;
    let running = run_pods(&node, &first).await;
    drop(first);
    std::fs::remove_file(node.state_dir().join("checkpoint.json")).unwrap();

    node.claims.fail_with(Some("connection refused"));
    let second = start(&node, BOOT_ID).await;
    assert!(second.recovery.api_error.is_some());
    assert_eq!(instances(&node, 1), running.mig_instances);
    assert_eq!(second.mps.mps().pid(SHARES_DAEMON), Some(running.daemon));
    node.claims.fail_with(None);
    let later = second.state.reconcile().await;
    assert_eq!(later.adopted.len(), 3, "{later:?}");
    assert_devices_intact(&node, &second, &running);
}

/// A record as a well-formed checkpoint would hold it, for a claim the API server never saw.
fn forged_record(uid: &str, device: DeviceRecord) -> ClaimRecord {
    ClaimRecord {
        uid: uid.into(),
        namespace: "default".into(),
        name: "ghost".into(),
        phase: Phase::PrepareCompleted,
        devices: vec![device],
        recovery_error: None,
        completed_at: None,
    }
}

#[tokio::test]
async fn a_record_of_a_claim_that_does_not_exist_is_dropped_without_taking_the_live_claims_mig_instance() {
    let node = TestNode::with_gpus(2);
    let _stop = StopDaemons::new(&node);
    let first = start(&node, BOOT_ID).await;
    let running = run_pods(&node, &first).await;
    drop(first);
    // A second, well-formed record owning the live claim's MIG instance.
    let store = CheckpointStore::new(&node.state_dir());
    let Ok(Loaded::Current(mut cp)) = store.load(BOOT_ID) else {
        panic!()
    };
    let mut stolen = cp.claims[&running.mig.uid].devices[0].clone();
    stolen.cdi_device_ids = vec![];
    cp.claims
        .insert("ghost-uid".into(), forged_record("ghost-uid", stolen));
    store.save(&cp).unwrap();

    let second = start(&node, BOOT_ID).await;
    assert_eq!(second.recovery.orphans_cleaned, vec!["ghost-uid".to_string()]);
    assert!(
        second
            .recovery
            .conflicts
            .iter()
            .any(|c| c.contains("ghost-uid") && c.contains(&running.mig.uid)),
        "the doubly-owned instance was not reported: {:?}",
        second.recovery.conflicts
    );
    assert!(!second.state.checkpoint().claims.contains_key("ghost-uid"));
    assert_devices_intact(&node, &second, &running);
}

#[tokio::test]
async fn the_daemon_watch_stops_no_daemon_while_a_checkpoint_of_another_boot_waits_for_the_api() {
    let node = TestNode::with_gpus(2);
    let _stop = StopDaemons::new(&node);
    let old = start(&node, "old-boot").await;
    let running = run_pods(&node, &old).await;
    drop(old);
    // The new boot cannot ask the API yet: nothing says the shares' daemon has no users.
    node.claims.fail_with(Some("connection refused"));
    let new = start(&node, BOOT_ID).await;
    assert!(!new.state.records_settled());
    let gpus = node.backend.discover().unwrap().gpus;
    let watch = new.mps.watch_daemons(&gpus, new.state.records_settled());
    assert!(
        watch.stopped.is_empty(),
        "the watch stopped a running share's daemon: {watch:?}"
    );
    assert_eq!(new.mps.mps().pid(SHARES_DAEMON), Some(running.daemon));

    node.claims.fail_with(None);
    new.state.reconcile().await;
    assert!(new.state.records_settled());
    let watch = new.mps.watch_daemons(&gpus, new.state.records_settled());
    assert!(watch.stopped.is_empty(), "{watch:?}");
    assert_devices_intact(&node, &new, &running);
}

#[tokio::test]
async fn records_are_checked_against_the_api_while_serving() {
    let node = TestNode::with_gpus(2);
    let _stop = StopDaemons::new(&node);
    let plugin = start(&node, BOOT_ID).await;
    let running = run_pods(&node, &plugin).await;
    let reserved_elsewhere = add(&node, claim("kept").allocated("gpu-1-mig-1g-10gb-0").build());
    plugin.state.prepare(&reserved_elsewhere).await.unwrap();

    // A claim deleted while kubelet never unprepared it (its pod went with a node-level failure).
    node.claims.remove("default", "a");
    // A claim deallocated and unreserved: nothing can use it here any more.
    node.claims.insert(claim("m").uid(&running.mig.uid).build());
    // The API server failing: nothing is judged.
    node.claims.fail_with(Some("etcd timeout"));
    let blind = plugin.state.reconcile().await;
    assert!(blind.orphans_cleaned.is_empty() && blind.api_error.is_some());
    node.claims.fail_with(None);

    let r = plugin.state.reconcile().await;
    let mut cleaned = r.orphans_cleaned.clone();
    cleaned.sort();
    let mut expected = vec![running.mig.uid.clone(), running.shares[0].uid.clone()];
    expected.sort();
    assert_eq!(cleaned, expected);
    assert!(
        instances(&node, 1)
            .iter()
            .all(|(_, u)| !running.mig_instances.iter().any(|(_, m)| m == u))
    );
    // The other share still runs on the daemon; the allocated (not yet reserved) claim is kept.
    assert_eq!(plugin.mps.mps().pid(SHARES_DAEMON), Some(running.daemon));
    assert!(
        plugin
            .state
            .checkpoint()
            .claims
            .contains_key(&running.shares[1].uid)
    );
    assert!(
        plugin
            .state
            .checkpoint()
            .claims
            .contains_key(&reserved_elsewhere.uid)
    );
    assert!(!plugin.state.cdi().spec_path(&running.shares[0].uid).exists());
}

#[tokio::test]
async fn a_claim_that_does_not_decode_keeps_its_devices_and_spoils_no_other_claims_check() {
    let node = TestNode::with_gpus(2);
    let _stop = StopDaemons::new(&node);
    let old = start(&node, "old-boot").await;
    let running = run_pods(&node, &old).await;
    drop(old);
    // After a reboot the MIG claim's opaque parameters hold a lone surrogate (the API server accepts it), and
    // a claim of another namespace nests too deep; share "a" was deleted meanwhile.
    node.claims.remove("default", "m");
    node.claims
        .insert_unreadable("default", "m", &running.mig.uid, "a lone UTF-16 surrogate")
        .insert_unreadable("other", "deep", "uid-deep", "nests deeper than 128 levels");
    node.claims.remove("default", "a");

    let new = start(&node, BOOT_ID).await;
    assert_eq!(
        new.recovery.api_error, None,
        "one bad claim failed the whole list"
    );
    assert!(
        new.recovery.adopted.contains(&running.mig.uid),
        "{:?}",
        new.recovery
    );
    assert!(
        new.recovery.adopted.contains(&running.shares[1].uid),
        "{:?}",
        new.recovery
    );
    assert!(
        !new.recovery.adopted.contains(&running.shares[0].uid),
        "a deleted claim was re-adopted"
    );
    assert_eq!(
        instances(&node, 1),
        running.mig_instances,
        "the undecodable claim's MIG instance was destroyed"
    );
    assert!(new.state.cdi().spec_path(&running.mig.uid).exists());
    // Serving, the same: the undecodable claim is never judged orphaned.
    let later = new.state.reconcile().await;
    assert!(later.orphans_cleaned.is_empty(), "{later:?}");
    assert!(new.state.checkpoint().claims.contains_key(&running.mig.uid));
    // kubelet's retry of the prepared claim gets its devices (no read needed), while a new undecodable
    // claim's prepare fails naming the cause, which kubelet shows in the pod's events.
    assert_eq!(
        new.state.prepare(&running.mig).await.unwrap()[0].device_name,
        "gpu-1-mig-3g-40gb-4"
    );
    node.claims
        .insert_unreadable("default", "fresh", "uid-fresh", "a lone UTF-16 surrogate");
    let fresh = ClaimRef {
        namespace: "default".into(),
        name: "fresh".into(),
        uid: "uid-fresh".into(),
    };
    let err = new.state.prepare(&fresh).await.unwrap_err().to_string();
    assert!(
        err.contains("surrogate") && err.contains("default/fresh"),
        "{err}"
    );
}

/// Whole GPUs for the `Shared` kind, with an unprepare that fails while `broken` is set (a GPU that fell
/// off the bus).
#[derive(Default)]
struct FlakyUndo {
    broken: AtomicBool,
}

impl DevicePreparer for FlakyUndo {
    fn plan(&self, ctx: &DeviceContext) -> Result<DeviceDetail, ClaimError> {
        WholeGpuPreparer.plan(ctx)
    }
    fn prepare(
        &self,
        ctx: &DeviceContext,
        planned: DeviceDetail,
    ) -> Result<(DeviceDetail, ContainerEdits), ClaimError> {
        WholeGpuPreparer.prepare(ctx, planned)
    }
    fn unprepare(&self, ctx: &DeviceContext, _: &DeviceDetail) -> Result<(), ClaimError> {
        if self.broken.load(Ordering::SeqCst) {
            return Err(ClaimError::UnprepareDevice {
                device: ctx.device.to_string(),
                source: tessera_kubelet_plugin::gpu::GpuError::InsufficientResources("GPU is lost".into()),
            });
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_claim_whose_rollback_fails_at_start_is_kept_reported_and_retried_while_the_node_serves() {
    let node = TestNode::new();
    let uid = "stuck-share";
    let mut cp = Checkpoint {
        boot_id: BOOT_ID.into(),
        ..Default::default()
    };
    cp.claims.insert(
        uid.into(),
        ClaimRecord {
            phase: Phase::PrepareStarted,
            ..forged_record(
                uid,
                DeviceRecord {
                    request: "gpu".into(),
                    pool: NODE.into(),
                    device: "gpu-6-shared".into(),
                    share_id: Some("s".into()),
                    cdi_device_ids: vec![cdi::qualified_name(&cdi::device_name(uid, "gpu-6-shared"))],
                    detail: DeviceDetail::Shared(SharedDetail {
                        gpu: 6,
                        gpu_uuid: None,
                        uuid: None,
                        mig: None,
                        strategy: Some("MPS".into()),
                        mps_pipe_dir: None,
                        limits: Default::default(),
                    }),
                    warm_seconds: None,
                    cost_ms: None,
                },
            )
        },
    );
    CheckpointStore::new(&node.state_dir()).save(&cp).unwrap();
    let flaky = Arc::new(FlakyUndo::default());
    flaky.broken.store(true, Ordering::SeqCst);
    let state = Arc::new(
        node.state_unrecovered(BOOT_ID)
            .with_preparer(DeviceKind::Shared, flaky.clone()),
    );

    let recovery = state
        .start()
        .await
        .expect("one claim's failed rollback stopped the whole node");
    assert_eq!(recovery.failed.len(), 1, "{recovery:?}");
    assert_eq!(recovery.failed[0].0, uid);
    assert!(
        recovery.failed[0].1.contains("GPU is lost"),
        "{:?}",
        recovery.failed
    );
    let kept = &state.checkpoint().claims[uid];
    assert!(
        kept.recovery_error
            .as_deref()
            .is_some_and(|e| e.contains("GPU is lost"))
    );
    assert!(
        state
            .problems()
            .iter()
            .any(|p| p.contains(uid) && p.contains("GPU is lost"))
    );
    // The rest of the node serves.
    let other = add(
        &node,
        claim("ok").allocated("gpu-2").reserved_for_pod("p").build(),
    );
    state.prepare(&other).await.unwrap();

    // Still broken: retried, still kept. Healed: rolled back.
    assert_eq!(state.reconcile().await.failed.len(), 1);
    flaky.broken.store(false, Ordering::SeqCst);
    let healed = state.reconcile().await;
    assert_eq!(healed.rolled_back, vec![uid.to_string()]);
    assert!(healed.failed.is_empty());
    assert!(!state.checkpoint().claims.contains_key(uid));
    assert!(state.problems().is_empty());
}

#[tokio::test]
async fn a_crash_after_a_mig_instance_was_created_and_before_its_ids_reached_the_disk_is_undone_at_start() {
    let node = TestNode::new();
    let _stop = StopDaemons::new(&node);
    let first = start(&node, BOOT_ID).await;
    let r = add_mig_slice(&node);
    first.state.prepare(&r).await.unwrap();
    assert_eq!(instances(&node, 2).len(), 1);
    drop(first);

    // The disk as a kill -9 after the hardware step and the CDI spec leaves it: the instance exists, the
    // record is still PrepareStarted with the planned device only (the ids are written with
    // PrepareCompleted).
    let store = CheckpointStore::new(&node.state_dir());
    let Loaded::Current(mut cp) = store.load(BOOT_ID).unwrap() else {
        panic!("the checkpoint should be of this boot");
    };
    let record = cp.claims.get_mut(&r.uid).unwrap();
    record.phase = Phase::PrepareStarted;
    let DeviceDetail::Mig(m) = &mut record.devices[0].detail else {
        panic!("a MIG claim records a MIG device: {:?}", record.devices[0].detail);
    };
    (m.gpu_instance, m.compute_instance, m.uuid) = (None, None, None);
    store.save(&cp).unwrap();
    assert!(node.cdi_dir().read_dir().unwrap().count() > 0);

    let restarted = start(&node, BOOT_ID).await;
    assert_eq!(restarted.recovery.rolled_back, vec![r.uid.clone()]);
    assert_eq!(restarted.recovery.destroyed_mig_instances, 1);
    assert_eq!(
        instances(&node, 2),
        Vec::new(),
        "the instance no record names must go"
    );
    assert!(restarted.state.checkpoint().claims.is_empty());
    assert_eq!(restarted.state.cdi().claim_uids().unwrap(), Vec::<String>::new());
    // kubelet, which never got an answer, prepares the claim again: its placement is free.
    restarted.state.prepare(&r).await.unwrap();
    assert_eq!(instances(&node, 2).len(), 1);
    restarted.state.unprepare(&r).await.unwrap();
    assert_eq!(instances(&node, 2), Vec::new());
}

#[tokio::test]
async fn a_prepare_whose_kubelet_call_is_dropped_finishes_and_kubelets_retry_finds_it_prepared() {
    let mut spec = NodeSpec::default().with_gpus("H100-SXM5-80GB", 8);
    spec.latencies.compute_instance_create_ms = 400;
    let node = TestNode::with_spec(spec);
    let _stop = StopDaemons::new(&node);
    let plugin = start(&node, BOOT_ID).await;
    let r = add_mig_slice(&node);
    // kubelet is killed while the compute instance is being made: its connection closes and the server
    // drops the call.
    let call = plugin.state.prepare_all(std::slice::from_ref(&r));
    let dropped = tokio::time::timeout(std::time::Duration::from_millis(150), call).await;
    assert!(dropped.is_err(), "the prepare should still run when kubelet goes");

    // The restarted kubelet's retry.
    let retried = plugin.state.prepare_all(std::slice::from_ref(&r)).await;
    assert!(retried[0].1.is_ok(), "{:?}", retried[0].1);
    assert_eq!(instances(&node, 2).len(), 1, "one MIG instance, the claim's");
    assert_eq!(
        plugin.state.checkpoint().claims[&r.uid].phase,
        Phase::PrepareCompleted
    );
    plugin.state.unprepare(&r).await.unwrap();
    assert_eq!(instances(&node, 2), Vec::new(), "and its unprepare leaves none");
}
