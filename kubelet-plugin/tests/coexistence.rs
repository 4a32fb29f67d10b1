//! Issue 22 item 5 through the plugin's start-up: a MIG layout another tool owns survives the start-up
//! sweep that removes every MIG instance no claim holds, and the node state never sees MIG on its GPUs.

mod common;

use std::{collections::BTreeMap, sync::Arc};

use common::{BOOT_ID, TestNode};
use tessera_kubelet_plugin::gpu::mig;
use tessera_kubelet_plugin::kubelet::coexistence::{
    CoexistenceMode, MIG_CONFIG_LABEL, NodeFacts, Verdict, decide,
};
use tessera_kubelet_plugin::node::state::NodeState;

/// A MIG device made outside tessera (as mig-manager does) on GPU 0 of `node`.
fn foreign_mig_device(node: &TestNode) -> mig::MigDevice {
    let gpus = node.backend.discover().unwrap().gpus;
    mig::prepare_mig(node.backend.as_ref(), &gpus[0], "1g.10gb", 0, None).unwrap()
}

fn instances_on_gpu0(node: &TestNode) -> usize {
    node.backend.list_gpu_instances(0).unwrap_or_default().len()
}

/// The node state as `take_over` builds it for a verdict.
fn state_for(node: &TestNode, verdict: &Verdict) -> Arc<NodeState> {
    let gpus = node.backend.discover().unwrap().gpus;
    let state = NodeState::new(
        node.config(BOOT_ID),
        node.backend.clone(),
        verdict.served_gpus(&gpus),
        Arc::new(node.claims.clone()),
    );
    Arc::new(match verdict.keep_unowned_mig {
        true => state.keeping_unowned_mig(verdict.summary().2),
        false => state,
    })
}

fn labelled(key: &str, value: &str) -> NodeFacts {
    NodeFacts {
        allocatable: BTreeMap::new(),
        labels: [(key.to_string(), value.to_string())].into(),
    }
}

#[tokio::test]
async fn a_mig_manager_layout_survives_the_start_up_sweep_that_removes_it_on_a_node_tessera_owns() {
    let node = TestNode::with_gpus(2);
    let theirs = foreign_mig_device(&node);

    let owned = decide(
        Ok(&labelled(MIG_CONFIG_LABEL, "all-1g.10gb")),
        CoexistenceMode::Refuse,
    );
    let state = state_for(&node, &owned);
    assert!(
        state.gpus().all(|g| g.mig.is_none()),
        "no MIG capability reaches the node state"
    );
    let recovery = state.start().await.unwrap();
    assert_eq!(recovery.destroyed_mig_instances, 0);
    let live = node.backend.list_gpu_instances(0).unwrap();
    assert!(
        live.iter()
            .any(|gi| gi.id == theirs.gpu_instance
                && gi.compute_instances.iter().any(|ci| ci.uuid == theirs.uuid)),
        "mig-manager's instance is gone: {live:?}"
    );
    assert!(node.backend.mig_mode(0).unwrap().current, "MIG mode left on");
    drop(state);

    // `--coexistence warn`, or no label: the same start-up removes the instance no claim holds.
    let alone = decide(
        Ok(&labelled("kubernetes.io/hostname", "node-a")),
        CoexistenceMode::Refuse,
    );
    let recovery = state_for(&node, &alone).start().await.unwrap();
    assert_eq!(recovery.destroyed_mig_instances, 1);
    assert_eq!(instances_on_gpu0(&node), 0);
}

#[tokio::test]
async fn an_unreadable_node_keeps_unowned_mig_instances_but_serves_mig_as_usual() {
    let node = TestNode::with_gpus(1);
    foreign_mig_device(&node);
    let unknown = decide(Err("nodes \"node-a\" is forbidden"), CoexistenceMode::Refuse);
    let state = state_for(&node, &unknown);
    assert!(state.gpus().all(|g| g.mig.is_some()), "MIG is still served");
    let recovery = state.start().await.unwrap();
    assert_eq!(recovery.destroyed_mig_instances, 0);
    assert_eq!(instances_on_gpu0(&node), 1);
}
