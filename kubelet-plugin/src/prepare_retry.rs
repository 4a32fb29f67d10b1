//! Asks kubelet to retry the prepares it gave up on while this plugin was away.
//!
//! kubelet calls `NodePrepareResources` from its pod sync; when the call fails (the plugin crashed in the
//! middle of it, or was not registered yet), upstream's `SyncPod` (`pkg/kubelet/kuberuntime/
//! kuberuntime_manager.go`, v1.37.2) records the failure and returns without a sync error, so the pod worker
//! does not back off and retry: the pod waits for its periodic resync, a minute or more. A pod whose object
//! changes is synced at once (`podsDifferSemantically` in `pkg/kubelet/config/config.go` counts annotations).
//!
//! So once kubelet has registered this plugin, it stamps the annotation [`ANNOTATION`] on each pod that has
//! reserved a claim allocated to this node's devices which the checkpoint does not hold as prepared: kubelet
//! syncs the pod and its retry reaches a plugin that answers. Nothing else of the pod changes, and the
//! chart's `ValidatingAdmissionPolicy` `tessera-pod-prepare-retry-own-node` lets the plugin's identity change
//! only this annotation, only on pods bound to its own node.

use std::{collections::BTreeSet, sync::Arc};

use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaim};
use kube::{
    Api,
    api::{Patch, PatchParams},
};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::{
    checkpoint::{Checkpoint, Phase},
    claims::{allocated_to, reserved},
    registration::RegistrationState,
    state::NodeState,
};

/// The pod annotation whose change makes kubelet sync the pod; its value is when the plugin asked.
pub const ANNOTATION: &str = "gpu.tessera.dev/prepare-retry";

/// A pod to stamp: the consumer of a claim allocated here and not prepared.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodToRetry {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// The pods that reserved a claim of `driver` allocated to `node`'s pool whose prepare the checkpoint does
/// not hold as completed. Each pod once, in name order.
pub fn pods_to_retry(
    claims: &[ResourceClaim],
    checkpoint: &Checkpoint,
    driver: &str,
    node: &str,
) -> Vec<PodToRetry> {
    let prepared: BTreeSet<&str> = checkpoint
        .claims
        .values()
        .filter(|r| r.phase == Phase::PrepareCompleted)
        .map(|r| r.uid.as_str())
        .collect();
    let mut pods = BTreeSet::new();
    for claim in claims {
        let uid = claim.metadata.uid.as_deref().unwrap_or_default();
        if prepared.contains(uid) || !allocated_to(claim, driver, node) || !reserved(claim) {
            continue;
        }
        let namespace = claim.metadata.namespace.clone().unwrap_or_default();
        let consumers = claim.status.as_ref().and_then(|s| s.reserved_for.as_ref());
        for consumer in consumers.into_iter().flatten() {
            // Only pods are synced by kubelet; other consumers (a workload reservation) have no sync.
            if consumer.resource == "pods" && consumer.api_group.as_deref().unwrap_or("").is_empty() {
                pods.insert(PodToRetry {
                    namespace: namespace.clone(),
                    name: consumer.name.clone(),
                    uid: consumer.uid.clone(),
                });
            }
        }
    }
    pods.into_iter().collect()
}

/// The merge patch that stamps [`ANNOTATION`] with `now`, guarded by the pod's UID so a pod deleted and
/// created again under the same name is left alone.
pub fn patch_for(pod: &PodToRetry, now: &str) -> serde_json::Value {
    serde_json::json!({
        "metadata": {
            "uid": pod.uid,
            "annotations": { ANNOTATION: now },
        }
    })
}

/// Stamps every pod of [`pods_to_retry`]; a pod that is gone or refuses is logged and skipped. Returns how
/// many pods were stamped.
pub async fn ask_kubelet_to_retry(
    client: &kube::Client,
    checkpoint: &Checkpoint,
    driver: &str,
    node: &str,
) -> usize {
    let list = match tessera_api::claim_list::list_all(client).await {
        Ok(list) => list,
        Err(e) => {
            warn!(error = %e, "cannot list claims to find pods whose prepare kubelet gave up on; they wait \
                for kubelet's next pod sync");
            return 0;
        }
    };
    crate::claims::warn_unreadable_once(&list);
    let pods = pods_to_retry(&list.claims, checkpoint, driver, node);
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let mut stamped = 0;
    for pod in &pods {
        let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
        match api
            .patch(
                &pod.name,
                &PatchParams::default(),
                &Patch::Merge(patch_for(pod, &now)),
            )
            .await
        {
            Ok(_) => stamped += 1,
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 || e.code == 422 => {
                info!(pod = %format!("{}/{}", pod.namespace, pod.name), "a pod to retry is gone");
            }
            Err(e) => warn!(pod = %format!("{}/{}", pod.namespace, pod.name), error = %e,
                "cannot ask kubelet to retry this pod's prepare; it waits for kubelet's next pod sync"),
        }
    }
    if stamped > 0 {
        info!(
            pods = stamped,
            "asked kubelet to retry the prepares of pods it gave up on while the plugin \
            was away"
        );
    }
    stamped
}

/// Each time kubelet registers the plugin (at start, and again after kubelet restarts), asks it to retry the
/// prepares it gave up on; ends on `stop`.
pub async fn after_each_registration(
    client: kube::Client,
    state: Arc<NodeState>,
    driver: String,
    mut registration: watch::Receiver<RegistrationState>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        if *registration.borrow_and_update() == RegistrationState::Registered {
            ask_kubelet_to_retry(&client, &state.checkpoint(), &driver, state.node_name()).await;
        }
        tokio::select! {
            changed = registration.changed() => if changed.is_err() { return },
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::ClaimRecord;

    fn claim(uid: &str, pool: &str, reserved_for: &[(&str, &str)]) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("claim-{uid}"), "namespace": "team", "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}]}},
            "status": {
                "allocation": {"devices": {"results": [
                    {"request": "gpu", "driver": "gpu.tessera.dev", "pool": pool, "device": "gpu-0"}
                ]}},
                "reservedFor": reserved_for.iter().map(|(resource, name)| serde_json::json!(
                    {"resource": resource, "name": name, "uid": format!("uid-{name}")}
                )).collect::<Vec<_>>(),
            }
        }))
        .unwrap()
    }

    fn checkpoint_with(uid: &str, phase: Phase) -> Checkpoint {
        let mut checkpoint = Checkpoint::default();
        let record: ClaimRecord = serde_json::from_value(serde_json::json!({
            "uid": uid, "namespace": "team", "name": format!("claim-{uid}"), "phase": phase, "devices": []
        }))
        .unwrap();
        checkpoint.claims.insert(uid.into(), record);
        checkpoint
    }

    #[test]
    fn the_pods_of_claims_allocated_here_and_not_prepared_are_retried_once_each() {
        let claims = [
            claim("a", "node-a", &[("pods", "p1"), ("pods", "p2")]),
            claim("b", "node-a", &[("pods", "p1")]),
        ];
        let pods = pods_to_retry(&claims, &Checkpoint::default(), "gpu.tessera.dev", "node-a");
        let names: Vec<_> = pods.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["p1", "p2"]);
        assert_eq!(pods[0].uid, "uid-p1");
        assert_eq!(pods[0].namespace, "team");
    }

    #[test]
    fn prepared_claims_other_nodes_and_unreserved_claims_ask_for_nothing() {
        let claims = [
            claim("done", "node-a", &[("pods", "p1")]),
            claim("elsewhere", "node-b", &[("pods", "p2")]),
            claim("unreserved", "node-a", &[]),
        ];
        let checkpoint = checkpoint_with("done", Phase::PrepareCompleted);
        assert!(pods_to_retry(&claims, &checkpoint, "gpu.tessera.dev", "node-a").is_empty());
    }

    #[test]
    fn a_prepare_the_plugin_was_killed_in_is_retried() {
        let claims = [claim("half", "node-a", &[("pods", "p1")])];
        let checkpoint = checkpoint_with("half", Phase::PrepareStarted);
        let pods = pods_to_retry(&claims, &checkpoint, "gpu.tessera.dev", "node-a");
        assert_eq!(pods.len(), 1, "{pods:?}");
    }

    #[test]
    fn consumers_that_are_not_pods_are_not_patched() {
        let claims = [claim("w", "node-a", &[("workloads", "w1")])];
        assert!(pods_to_retry(&claims, &Checkpoint::default(), "gpu.tessera.dev", "node-a").is_empty());
    }

    #[test]
    fn the_patch_changes_only_the_annotation_and_is_guarded_by_the_pods_uid() {
        let pod = PodToRetry {
            namespace: "team".into(),
            name: "p1".into(),
            uid: "uid-p1".into(),
        };
        let patch = patch_for(&pod, "2026-12-02T00:00:00Z");
        assert_eq!(
            patch,
            serde_json::json!({"metadata": {"uid": "uid-p1", "annotations": {ANNOTATION: "2026-12-02T00:00:00Z"}}})
        );
    }
}
