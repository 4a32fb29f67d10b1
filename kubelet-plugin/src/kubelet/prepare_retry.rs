//! Asks kubelet to retry the prepares it gave up on while this plugin was away.
//!
//! kubelet calls `NodePrepareResources` from its pod sync; when the call fails (the plugin crashed in the
//! middle of it, or was not registered yet), upstream's `SyncPod` (`pkg/kubelet/kuberuntime/
//! kuberuntime_manager.go`, v1.37.2) records the failure and returns without a sync error, so the pod worker
//! does not back off and retry: the pod waits for its periodic resync, a minute or more. A pod whose object
//! changes is synced at once (`podsDifferSemantically` in `pkg/kubelet/config/config.go` counts annotations).
//!
//! So once kubelet has registered this plugin, it stamps the annotation [`ANNOTATION`] on each pod that has
//! reserved a claim allocated to this node's devices which the checkpoint does not hold as prepared, or
//! holds as prepared so recently that the answer may have been lost with the plugin: kubelet
//! syncs the pod and its retry reaches a plugin that answers. Nothing else of the pod changes, and the
//! chart's `ValidatingAdmissionPolicy` `tessera-pod-prepare-retry-own-node` lets the plugin's identity change
//! only this annotation, only on pods bound to its own node.
//!
//! The same holds for a prepare this plugin answered with a failure whose cause passes on its own (the MPS
//! supervisor's pod being replaced, the API server not answering: [`ClaimError::is_transient`]): kubelet
//! would try again only at its next resync. Such a claim's pods are stamped on a back-off
//! ([`RETRY_AFTER`]) until the claim is prepared, gone, or the back-off is spent ([`RetrySchedule`]).
//!
//! [`ClaimError::is_transient`]: crate::node::error::ClaimError::is_transient

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
    time::Duration,
};

use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaim};
use kube::{
    Api,
    api::{Patch, PatchParams},
};
use tokio::{
    sync::{mpsc, watch},
    time::Instant,
};
use tracing::{info, warn};

use crate::kubelet::claims::{allocated_to, reserved};
use crate::kubelet::registration::RegistrationState;
use crate::node::checkpoint::{Checkpoint, Phase};
use crate::node::state::{ClaimRef, NodeState};

/// The pod annotation whose change makes kubelet sync the pod; its value is when the plugin asked.
pub const ANNOTATION: &str = "gpu.tessera.dev/prepare-retry";

/// A pod to stamp: the consumer of a claim allocated here and not prepared.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PodToRetry {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// How recent a completed prepare may be for kubelet to have missed its answer: the plugin died between
/// recording it and answering (kubelet saw the call fail), and came back within this.
pub const ANSWER_MAYBE_LOST_FOR: u64 = 120;

/// The pods that reserved a claim of `driver` allocated to `node`'s pool whose prepare the checkpoint does
/// not hold as completed, or holds as completed at most [`ANSWER_MAYBE_LOST_FOR`] seconds before `now`
/// (a retry of a prepared claim returns its saved result, so a pod kubelet did get the answer for only
/// syncs once more). Each pod once, in name order.
pub fn pods_to_retry(
    claims: &[ResourceClaim],
    checkpoint: &Checkpoint,
    driver: &str,
    node: &str,
    now: u64,
) -> Vec<PodToRetry> {
    let prepared: BTreeSet<&str> = checkpoint
        .claims
        .values()
        .filter(|r| r.phase == Phase::PrepareCompleted)
        .filter(|r| {
            r.completed_at
                .is_none_or(|at| now.saturating_sub(at) > ANSWER_MAYBE_LOST_FOR)
        })
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
    crate::kubelet::claims::warn_unreadable_once(&list);
    let now = crate::node::state::unix_now();
    let stamped = stamp(
        client,
        &pods_to_retry(&list.claims, checkpoint, driver, node, now),
    )
    .await;
    if stamped > 0 {
        info!(
            pods = stamped,
            "asked kubelet to retry the prepares of pods it gave up on while the plugin \
            was away"
        );
    }
    stamped
}

/// Stamps [`ANNOTATION`] on each of `pods`; a pod that is gone or refuses is logged and skipped. Returns
/// how many pods were stamped.
async fn stamp(client: &kube::Client, pods: &[PodToRetry]) -> usize {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let mut stamped = 0;
    for pod in pods {
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

/// When the pods of a claim whose prepare failed for a passing cause are stamped, counted from the failure
/// and then from each stamp: soon at first (a supervisor pod is replaced in seconds), then less often, about
/// a minute in all, after which kubelet's own resync (a minute or more) is no slower.
pub const RETRY_AFTER: [Duration; 6] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
    Duration::from_secs(8),
    Duration::from_secs(16),
    Duration::from_secs(30),
];

/// How long a claim whose back-off was spent is not scheduled again, so a cause that does not pass costs
/// its pods [`RETRY_AFTER`]'s stamps once per this, not once per kubelet resync.
pub const GIVEN_UP_FOR: Duration = Duration::from_secs(600);

/// Which claims' pods to stamp when: a plain state machine over the failures reported and the clock.
#[derive(Debug, Default)]
pub struct RetrySchedule {
    waiting: BTreeMap<String, Waiting>,
    given_up: BTreeMap<String, Instant>,
}

#[derive(Debug)]
struct Waiting {
    claim: ClaimRef,
    stamps: usize,
    next: Instant,
}

impl RetrySchedule {
    /// A prepare of `claim` failed at `now`. A claim already waiting keeps its place in the back-off (the
    /// failure is most likely kubelet's retry that the last stamp caused); one given up within
    /// [`GIVEN_UP_FOR`] is not scheduled. Returns whether the claim waits now.
    pub fn failed(&mut self, claim: ClaimRef, now: Instant) -> bool {
        self.given_up
            .retain(|_, at| now.duration_since(*at) < GIVEN_UP_FOR);
        if self.waiting.contains_key(&claim.uid) {
            return true;
        }
        if self.given_up.contains_key(&claim.uid) {
            return false;
        }
        let next = now + RETRY_AFTER[0];
        self.waiting.insert(
            claim.uid.clone(),
            Waiting {
                claim,
                stamps: 0,
                next,
            },
        );
        true
    }

    /// The earliest time a claim is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.waiting.values().map(|w| w.next).min()
    }

    /// The claims due at `now`, each moved on to its next stamp (or given up after its last).
    pub fn take_due(&mut self, now: Instant) -> Vec<ClaimRef> {
        let mut due = Vec::new();
        let mut spent = Vec::new();
        for (uid, w) in &mut self.waiting {
            if w.next > now {
                continue;
            }
            due.push(w.claim.clone());
            w.stamps += 1;
            match RETRY_AFTER.get(w.stamps) {
                Some(after) => w.next = now + *after,
                None => spent.push(uid.clone()),
            }
        }
        for uid in spent {
            self.waiting.remove(&uid);
            self.given_up.insert(uid, now);
        }
        due
    }

    /// The claim needs no more stamps: prepared, deleted, or no longer this node's.
    pub fn done(&mut self, uid: &str) {
        self.waiting.remove(uid);
    }

    /// How many claims wait.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

/// Stamps the pods of claims whose prepare failed for a passing cause (reported on `failed` by
/// [`NodeState::reporting_failed_prepares`]) on the [`RetrySchedule`]'s back-off; ends on `stop`.
pub async fn after_failed_prepares(
    client: kube::Client,
    state: Arc<NodeState>,
    driver: String,
    mut failed: mpsc::UnboundedReceiver<ClaimRef>,
    mut stop: watch::Receiver<bool>,
) {
    let mut schedule = RetrySchedule::default();
    loop {
        let due = schedule.next_due();
        // The select only picks; the stamping awaits outside it, where the stop's watch guard is not held.
        let failure = tokio::select! {
            Some(claim) = failed.recv() => Some(claim),
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => None,
            _ = stop.wait_for(|s| *s) => return,
        };
        match failure {
            Some(claim) => {
                let uid = claim.uid.clone();
                if !schedule.failed(claim, Instant::now()) {
                    tracing::debug!(claim = %uid, "prepare failed again after its retries were spent");
                }
            }
            None => {
                for claim in schedule.take_due(Instant::now()) {
                    if !retry_claim(&client, &state, &driver, &claim).await {
                        schedule.done(&claim.uid);
                    }
                }
            }
        }
    }
}

/// Stamps the pods of `claim` unless it is prepared, gone, or not this node's; returns whether it still
/// needs retrying.
async fn retry_claim(client: &kube::Client, state: &NodeState, driver: &str, claim: &ClaimRef) -> bool {
    let name = format!("{}/{}", claim.namespace, claim.name);
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &claim.namespace);
    let object = match api.get_opt(&claim.name).await {
        Ok(Some(object)) if object.metadata.uid.as_deref() == Some(claim.uid.as_str()) => object,
        Ok(_) => return false,
        Err(e) => {
            warn!(claim = %name, error = %e, "cannot read a claim whose prepare failed; asking kubelet \
                to retry it later");
            return true;
        }
    };
    // A failed prepare has no completion to doubt: only a claim the checkpoint does not hold as prepared.
    let pods = pods_to_retry(
        std::slice::from_ref(&object),
        &state.checkpoint(),
        driver,
        state.node_name(),
        u64::MAX,
    );
    if pods.is_empty() {
        return false;
    }
    let stamped = stamp(client, &pods).await;
    info!(claim = %name, pods = stamped, "asked kubelet to retry a prepare that failed for a passing cause");
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::checkpoint::ClaimRecord;

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

    const NOW: u64 = 1_800_000_000;

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
        let pods = pods_to_retry(&claims, &Checkpoint::default(), "gpu.tessera.dev", "node-a", NOW);
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
        assert!(pods_to_retry(&claims, &checkpoint, "gpu.tessera.dev", "node-a", NOW).is_empty());
    }

    #[test]
    fn a_prepare_the_plugin_was_killed_in_is_retried() {
        let claims = [claim("half", "node-a", &[("pods", "p1")])];
        let checkpoint = checkpoint_with("half", Phase::PrepareStarted);
        let pods = pods_to_retry(&claims, &checkpoint, "gpu.tessera.dev", "node-a", NOW);
        assert_eq!(pods.len(), 1, "{pods:?}");
    }

    #[test]
    fn a_prepare_completed_just_before_the_plugin_died_is_retried_and_an_older_one_is_not() {
        let claims = [claim("late", "node-a", &[("pods", "p1")])];
        let mut checkpoint = checkpoint_with("late", Phase::PrepareCompleted);
        let at = |checkpoint: &mut Checkpoint, secs| {
            checkpoint.claims.get_mut("late").unwrap().completed_at = Some(secs);
        };
        at(&mut checkpoint, NOW - 5);
        let pods = pods_to_retry(&claims, &checkpoint, "gpu.tessera.dev", "node-a", NOW);
        assert_eq!(pods.len(), 1, "kubelet may not have got its answer");
        at(&mut checkpoint, NOW - ANSWER_MAYBE_LOST_FOR - 1);
        assert!(pods_to_retry(&claims, &checkpoint, "gpu.tessera.dev", "node-a", NOW).is_empty());
    }

    #[test]
    fn consumers_that_are_not_pods_are_not_patched() {
        let claims = [claim("w", "node-a", &[("workloads", "w1")])];
        assert!(pods_to_retry(&claims, &Checkpoint::default(), "gpu.tessera.dev", "node-a", NOW).is_empty());
    }

    fn claim_ref(uid: &str) -> ClaimRef {
        ClaimRef {
            namespace: "team".into(),
            name: format!("claim-{uid}"),
            uid: uid.into(),
        }
    }

    /// Takes every due claim from `t0` on, second by second, for `secs` seconds; returns the seconds after
    /// `t0` at which `uid` was due.
    fn stamps_of(schedule: &mut RetrySchedule, t0: Instant, secs: u64, uid: &str) -> Vec<u64> {
        (0..=secs)
            .filter(|s| {
                let due = schedule.take_due(t0 + Duration::from_secs(*s));
                due.iter().any(|c| c.uid == uid)
            })
            .collect()
    }

    #[test]
    fn a_failed_claim_is_stamped_on_the_back_off_and_then_given_up() {
        let t0 = Instant::now();
        let mut schedule = RetrySchedule::default();
        assert!(schedule.failed(claim_ref("a"), t0));
        assert_eq!(schedule.next_due(), Some(t0 + Duration::from_secs(1)));
        assert_eq!(stamps_of(&mut schedule, t0, 120, "a"), [1, 3, 7, 15, 31, 61]);
        assert!(schedule.is_empty(), "spent after its last stamp");
        assert!(
            !schedule.failed(claim_ref("a"), t0 + Duration::from_secs(90)),
            "a claim given up is not scheduled again at once"
        );
        assert!(
            schedule.failed(claim_ref("a"), t0 + Duration::from_secs(61) + GIVEN_UP_FOR),
            "but is after a while"
        );
    }

    #[test]
    fn a_failure_of_a_waiting_claim_keeps_its_place_in_the_back_off() {
        let t0 = Instant::now();
        let mut schedule = RetrySchedule::default();
        schedule.failed(claim_ref("a"), t0);
        assert_eq!(schedule.take_due(t0 + Duration::from_secs(1)).len(), 1);
        // kubelet's retry, caused by that stamp, fails again.
        assert!(schedule.failed(claim_ref("a"), t0 + Duration::from_secs(2)));
        assert_eq!(schedule.len(), 1);
        assert_eq!(schedule.next_due(), Some(t0 + Duration::from_secs(3)));
    }

    #[test]
    fn a_claim_done_is_not_stamped_again_and_others_keep_theirs() {
        let t0 = Instant::now();
        let mut schedule = RetrySchedule::default();
        schedule.failed(claim_ref("a"), t0);
        schedule.failed(claim_ref("b"), t0 + Duration::from_secs(1));
        schedule.done("a");
        assert!(schedule.take_due(t0 + Duration::from_secs(1)).is_empty());
        let due = schedule.take_due(t0 + Duration::from_secs(2));
        assert_eq!(due, [claim_ref("b")]);
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
