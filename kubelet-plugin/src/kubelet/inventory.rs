//! Publishes the node's `NodeInventory` and keeps the node's heartbeat fresh.
//!
//! The spec (discovered GPUs) is written once with server-side apply, owned by the Node so it goes with it;
//! the status (`ready`, `lastHeartbeatTime`, `gpuCount`, `message`, `health`) whenever it changes. The
//! heartbeat itself is a small Lease renewed every interval (see [`tessera_api::heartbeat`]); while the
//! leading controller does not say it reads node Leases (an older version during an upgrade), or the
//! Lease cannot be written (an older chart's RBAC), the status is rewritten every interval as well, as
//! before. `ready` is true only while kubelet has the plugin registered.
//!
//! Stopping (SIGTERM) writes nothing: a plain restart or a rolling upgrade must not make the controller
//! withdraw the node's slices, and the controller holds a pool whose plugin is briefly not ready (the
//! new instance, until kubelet registers it). A real uninstall is noticed by the controller when the
//! heartbeat stops changing (its `--heartbeat-timeout`), or at once when the NodeInventory is deleted.
//!
//! Invariant: an unreachable API server is retried, never fatal, and the retry delay never exceeds
//! [`MAX_BACKOFF`] (5 s) nor one attempt [`ATTEMPT_TIMEOUT`], so once the API server is back a heartbeat
//! lands within about 15 s — well inside the controller's 40 s default timeout, even if the server is
//! only up for short windows. The plugin keeps serving kubelet throughout.

use std::time::{Duration, Instant};

use k8s_openapi::{
    api::{
        coordination::v1::{Lease, LeaseSpec},
        core::v1::Node,
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Resource,
    api::{Patch, PatchParams},
};
use tessera_api::{
    NodeInventory, NodeInventorySpec,
    heartbeat::{HEARTBEAT_LABEL, HEARTBEAT_LABEL_VALUE, leader_reads_node_leases, node_lease_name},
    inventory::{InventoryCondition, NodeInventoryStatus},
};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::kubelet::registration::RegistrationState;

/// Field manager of the plugin's server-side apply patches.
pub const FIELD_MANAGER: &str = "tessera-kubelet-plugin";

/// First retry delay after a failed API call.
pub const INITIAL_BACKOFF: Duration = Duration::from_secs(1);

/// Longest retry delay (see the invariant in the module docs): short, so the retries do not miss a
/// window in which the API server is back; the plugin writes only its own small object, so retrying
/// this often costs the server little.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Longest one publishing attempt may take: the client's own read timeout is minutes, which would stall
/// the heartbeat behind a request the server never answers.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Retry delays after failed API calls: 1, 2, 4, then 5 s for as long as the calls keep failing, each
/// shortened by up to a quarter at random so the plugins of many nodes do not retry in lockstep.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            base: INITIAL_BACKOFF,
        }
    }
}

impl Backoff {
    /// Back to the first delay, after a success.
    pub fn reset(&mut self) {
        self.base = INITIAL_BACKOFF;
    }

    /// The next delay; `jitter` in `[0, 1)` picks where in `[3/4 base, base]` it falls.
    pub fn next(&mut self, jitter: f64) -> Duration {
        let base = self.base;
        self.base = (self.base * 2).min(MAX_BACKOFF);
        base.mul_f64(1.0 - jitter.clamp(0.0, 1.0) / 4.0)
    }
}

/// A number in `[0, 1)` that differs between calls and processes (std's randomly keyed hasher).
fn jitter() -> f64 {
    use std::hash::{BuildHasher, RandomState};
    let r = RandomState::new().hash_one(std::time::Instant::now());
    (r % 1_000_000) as f64 / 1_000_000.0
}

/// A reference to the Node `node` with `uid`, so what the plugin writes goes away with its Node.
fn owned_by_node(node: &str, uid: &str) -> Vec<OwnerReference> {
    vec![OwnerReference {
        api_version: <Node as k8s_openapi::Resource>::API_VERSION.to_string(),
        kind: <Node as k8s_openapi::Resource>::KIND.to_string(),
        name: node.to_string(),
        uid: uid.to_string(),
        ..Default::default()
    }]
}

/// The inventory object for `spec`, owned by the Node with `node_uid`.
pub fn inventory_object(spec: NodeInventorySpec, node_uid: &str) -> NodeInventory {
    let mut inv = NodeInventory::new(&spec.node_name, spec.clone());
    inv.metadata = ObjectMeta {
        name: Some(spec.node_name.clone()),
        owner_references: Some(owned_by_node(&spec.node_name, node_uid)),
        ..Default::default()
    };
    inv
}

/// Where the node's heartbeat Lease lives and where the controller's leader-election Lease is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Namespace of both Leases (the controller's `--lease-namespace`).
    pub namespace: String,
    /// Name of the controller's leader-election Lease (its `--lease-name`).
    pub controller_lease: String,
}

/// How often the plugin reads the leader-election Lease to learn whether the leader reads node Leases.
/// A controller of an older version that takes over is noticed within this, and a fresh one holds every
/// pool for its whole heartbeat timeout (40 s by default) before it withdraws any, so the inventory
/// heartbeats resume in time.
pub const LEADER_CHECK_EVERY: Duration = Duration::from_secs(20);

/// The heartbeat Lease of `node` (owned by the Node with `node_uid`, when known), renewed at `now`.
pub fn node_lease(
    name: &str,
    namespace: &str,
    node: &str,
    node_uid: Option<&str>,
    interval: Duration,
    now: Timestamp,
) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(namespace.to_string()),
            labels: Some([(HEARTBEAT_LABEL.to_string(), HEARTBEAT_LABEL_VALUE.to_string())].into()),
            owner_references: node_uid.map(|uid| owned_by_node(node, uid)),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(node.to_string()),
            // Informational: the controller judges renewals by its own `--heartbeat-timeout`.
            lease_duration_seconds: Some(
                i32::try_from(interval.as_secs().saturating_mul(4)).unwrap_or(i32::MAX),
            ),
            renew_time: Some(MicroTime(now)),
            ..Default::default()
        }),
    }
}

/// What the plugin knows about its heartbeat: which writes one round must make.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HeartbeatState {
    /// The last write of the node's Lease succeeded.
    pub lease_renewed: bool,
    /// The last read of the leader-election Lease said the leader reads node Leases.
    pub leader_reads_leases: bool,
    /// When the leader-election Lease was last read.
    pub leader_checked_at: Option<Instant>,
    /// The status last written, without its heartbeat time.
    pub written: Option<NodeInventoryStatus>,
}

/// `status` without its heartbeat time, for comparing what changed.
fn without_time(status: &NodeInventoryStatus) -> NodeInventoryStatus {
    NodeInventoryStatus {
        last_heartbeat_time: None,
        ..status.clone()
    }
}

impl HeartbeatState {
    /// True when the leader-election Lease should be read (again) at `now`.
    pub fn leader_check_due(&self, now: Instant) -> bool {
        self.lease_renewed
            && self
                .leader_checked_at
                .is_none_or(|at| now.saturating_duration_since(at) >= LEADER_CHECK_EVERY)
    }

    /// True when the round must write `status`: it changed, or the inventory still carries the heartbeat.
    pub fn status_write_needed(&self, status: &NodeInventoryStatus) -> bool {
        let lease_heartbeat = self.lease_renewed && self.leader_reads_leases;
        !lease_heartbeat || self.written.as_ref() != Some(&without_time(status))
    }

    /// Records a written status.
    pub fn wrote(&mut self, status: &NodeInventoryStatus) {
        self.written = Some(without_time(status));
    }
}

/// True for an answer that retrying will not change: the Lease is not permitted (an older chart's RBAC)
/// or its namespace does not exist.
fn refused(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 403 || s.code == 404)
}

/// The status to publish for a registration state.
pub fn inventory_status(
    spec: &NodeInventorySpec,
    registration: &RegistrationState,
    now: Timestamp,
) -> NodeInventoryStatus {
    let (ready, message) = match registration {
        RegistrationState::Registered => (true, None),
        RegistrationState::Pending => (
            false,
            Some("waiting for kubelet to register the plugin".to_string()),
        ),
        RegistrationState::Failed(e) => (
            false,
            Some(format!("kubelet rejected the plugin registration: {e}")),
        ),
    };
    NodeInventoryStatus {
        ready,
        last_heartbeat_time: Some(Time(now)),
        gpu_count: spec.gpus.len() as u32,
        message,
        health: vec![],
        conditions: vec![],
    }
}

/// Adds what the plugin's recovery found wrong (a corrupted checkpoint, claims that failed to recover, a
/// MIG instance recorded twice) to the status message, so `kubectl get nodeinventory -o yaml` shows it next
/// to the registration state. Readiness is not changed: the rest of the node serves.
pub fn with_problems(mut status: NodeInventoryStatus, problems: &[String]) -> NodeInventoryStatus {
    if problems.is_empty() {
        return status;
    }
    let mut parts: Vec<String> = status.message.take().into_iter().collect();
    parts.extend(problems.iter().cloned());
    status.message = Some(parts.join("; "));
    status
}

/// What the plugin reports as wrong besides registration (see [`with_problems`]).
pub type Problems = std::sync::Arc<dyn Fn() -> Vec<String> + Send + Sync>;

/// The status conditions to publish (the `Coexistence` condition, [`crate::kubelet::coexistence`]).
pub type Conditions = std::sync::Arc<dyn Fn() -> Vec<InventoryCondition> + Send + Sync>;

/// `status` with `conditions`; a condition that is not `True` is also added to the message, so the one
/// line `kubectl describe` and the controller's logs show says it too.
pub fn with_conditions(
    mut status: NodeInventoryStatus,
    conditions: Vec<InventoryCondition>,
) -> NodeInventoryStatus {
    let loud: Vec<String> = conditions
        .iter()
        .filter(|c| c.status != "True")
        .map(|c| format!("{} {} ({}): {}", c.type_, c.status, c.reason, c.message))
        .collect();
    status.conditions = conditions;
    with_problems(status, &loud)
}

/// Server-side apply body of a status.
fn status_patch(name: &str, status: &NodeInventoryStatus) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": NodeInventory::api_version(&()),
        "kind": NodeInventory::kind(&()),
        "metadata": {"name": name},
        "status": status,
    })
}

/// Keeps one node's inventory current.
pub struct InventoryPublisher {
    client: kube::Client,
    spec: NodeInventorySpec,
    heartbeat: Duration,
    registration: watch::Receiver<RegistrationState>,
    problems: Option<Problems>,
    conditions: Option<Conditions>,
    health: Option<std::sync::Arc<crate::gpu::health::Health>>,
    leases: Option<LeaseConfig>,
    node_uid: Option<String>,
}

impl InventoryPublisher {
    pub fn new(
        client: kube::Client,
        spec: NodeInventorySpec,
        heartbeat: Duration,
        registration: watch::Receiver<RegistrationState>,
    ) -> Self {
        Self {
            client,
            spec,
            heartbeat,
            registration,
            problems: None,
            conditions: None,
            health: None,
            leases: None,
            node_uid: None,
        }
    }

    /// Heartbeats through a node Lease as configured (see the module docs); without it, through the
    /// NodeInventory status only.
    pub fn with_leases(mut self, leases: LeaseConfig) -> Self {
        self.leases = Some(leases);
        self
    }

    /// Publishes `health` in `status.health`, and publishes at once whenever it changes (the controller
    /// taints a sick GPU's devices from it).
    pub fn with_health(mut self, health: std::sync::Arc<crate::gpu::health::Health>) -> Self {
        self.health = Some(health);
        self
    }

    /// Reports `problems()` in every status message (see [`with_problems`]).
    pub fn with_problem_source(mut self, problems: Problems) -> Self {
        self.problems = Some(problems);
        self
    }

    /// Publishes `conditions()` in `status.conditions` (see [`with_conditions`]); a change is written at
    /// the next heartbeat.
    pub fn with_condition_source(mut self, conditions: Conditions) -> Self {
        self.conditions = Some(conditions);
        self
    }

    /// Publishes until `stop` turns true. Writes nothing on the way out (see the module docs).
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let api: Api<NodeInventory> = Api::all(self.client.clone());
        let name = self.spec.node_name.clone();
        let mut spec_published = false;
        let mut backoff = Backoff::default();
        let mut health_changes = self.health.as_ref().map(|h| h.subscribe());
        let mut beat = HeartbeatState::default();
        loop {
            let attempt = tokio::time::timeout(ATTEMPT_TIMEOUT, async {
                if !spec_published {
                    self.publish_spec(&api).await?;
                    spec_published = true;
                }
                let registration = self.registration.borrow_and_update().clone();
                let status = inventory_status(&self.spec, &registration, Timestamp::now());
                let problems = self.problems.as_ref().map(|p| p()).unwrap_or_default();
                let mut status = with_problems(status, &problems);
                if let Some(conditions) = &self.conditions {
                    status = with_conditions(status, conditions());
                }
                if let Some(health) = &self.health {
                    status.health = health.status();
                }
                self.renew_lease(&mut beat).await?;
                if beat.status_write_needed(&status) {
                    self.publish_status(&api, &status).await?;
                    beat.wrote(&status);
                    debug!(ready = status.ready, "inventory status published");
                }
                Ok::<_, kube::Error>(())
            })
            .await;
            let failure = match attempt {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("no answer within {ATTEMPT_TIMEOUT:?}")),
            };
            let delay = match failure {
                None => {
                    backoff.reset();
                    self.heartbeat
                }
                Some(error) => {
                    let delay = backoff.next(jitter());
                    warn!(inventory = %name, %error, retry_in = ?delay, "failed to publish the node inventory");
                    delay
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                // A dropped sender means registration can no longer change; the heartbeat timer still runs.
                Ok(()) = self.registration.changed() => {}
                Some(Ok(())) = async {
                    match health_changes.as_mut() {
                        Some(rx) => Some(rx.changed().await),
                        None => std::future::pending().await,
                    }
                } => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        info!(inventory = %name, "stopped heartbeating; the controller keeps this node's slices until its heartbeat timeout (kubelet deletes them sooner if this plugin does not register again)");
    }

    async fn publish_spec(&mut self, api: &Api<NodeInventory>) -> Result<(), kube::Error> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = nodes.get(&self.spec.node_name).await?;
        let uid = node.metadata.uid.unwrap_or_default();
        self.node_uid = Some(uid.clone()).filter(|u| !u.is_empty());
        let inv = inventory_object(self.spec.clone(), &uid);
        api.patch(
            &self.spec.node_name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&inv),
        )
        .await?;
        info!(inventory = %self.spec.node_name, gpus = self.spec.gpus.len(), "published the node inventory");
        Ok(())
    }

    /// Renews the node's Lease and, when due, reads whether the leader reads node Leases. A refused Lease
    /// write leaves the heartbeat to the inventory status; any other failure fails the round (retried).
    async fn renew_lease(&self, beat: &mut HeartbeatState) -> Result<(), kube::Error> {
        let Some(cfg) = &self.leases else {
            return Ok(());
        };
        let node = &self.spec.node_name;
        let Some(name) = node_lease_name(node) else {
            if beat.written.is_none() {
                warn!(node = %node, "the node name is too long for a heartbeat Lease name; heartbeating through the NodeInventory");
            }
            return Ok(());
        };
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &cfg.namespace);
        let lease = node_lease(
            &name,
            &cfg.namespace,
            node,
            self.node_uid.as_deref(),
            self.heartbeat,
            Timestamp::now(),
        );
        match leases
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&lease),
            )
            .await
        {
            Ok(_) => {
                if !beat.lease_renewed {
                    info!(lease = %name, namespace = %cfg.namespace, "heartbeating through the node's Lease");
                }
                beat.lease_renewed = true;
            }
            Err(e) if refused(&e) => {
                if beat.lease_renewed || beat.written.is_none() {
                    warn!(lease = %name, namespace = %cfg.namespace, error = %e,
                        "cannot write the node's heartbeat Lease; heartbeating through the NodeInventory status \
                         instead. Fix: grant the plugin get, create, patch and update on leases in that namespace \
                         (the chart's Role does), or set --lease-namespace (TESSERA_LEASE_NAMESPACE) to the \
                         controller's lease namespace");
                }
                beat.lease_renewed = false;
                beat.leader_reads_leases = false;
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        let now = Instant::now();
        if beat.leader_check_due(now) {
            let reads = match leases.get_opt(&cfg.controller_lease).await {
                Ok(leader) => leader.as_ref().is_some_and(leader_reads_node_leases),
                Err(e) if refused(&e) => false,
                Err(e) => return Err(e),
            };
            if reads != beat.leader_reads_leases {
                info!(
                    leader_reads_node_leases = reads,
                    "the leading controller changed; {}",
                    if reads {
                        "the inventory status is written only when it changes"
                    } else {
                        "the inventory status carries the heartbeat too"
                    }
                );
            }
            beat.leader_reads_leases = reads;
            beat.leader_checked_at = Some(now);
        }
        Ok(())
    }

    async fn publish_status(
        &self,
        api: &Api<NodeInventory>,
        status: &NodeInventoryStatus,
    ) -> Result<(), kube::Error> {
        let body = status_patch(&self.spec.node_name, status);
        api.patch_status(
            &self.spec.node_name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> NodeInventorySpec {
        NodeInventorySpec {
            node_name: "node-a".into(),
            backend: "simulated".into(),
            gpus: vec![Default::default(), Default::default()],
            ..Default::default()
        }
    }

    #[test]
    fn recovery_problems_are_added_to_the_message_without_changing_readiness() {
        let now = Timestamp::now();
        let ok = inventory_status(&spec(), &RegistrationState::Registered, now);
        assert_eq!(with_problems(ok.clone(), &[]), ok);
        let s = with_problems(ok, &["claim u failed to recover (retried): GPU is lost".into()]);
        assert!(s.ready);
        assert_eq!(
            s.message.as_deref(),
            Some("claim u failed to recover (retried): GPU is lost")
        );
        let pending = inventory_status(&spec(), &RegistrationState::Pending, now);
        let s = with_problems(pending, &["checkpoint corrupted".into()]);
        assert_eq!(
            s.message.as_deref(),
            Some("waiting for kubelet to register the plugin; checkpoint corrupted")
        );
    }

    #[test]
    fn a_condition_that_is_not_true_is_published_and_repeated_in_the_message() {
        let ok = inventory_status(&spec(), &RegistrationState::Registered, Timestamp::now());
        let condition = |status: &str| InventoryCondition {
            type_: "Coexistence".into(),
            status: status.into(),
            reason: "DevicePluginAdvertisesGPUs".into(),
            message: "a device plugin advertises nvidia.com/gpu: 8".into(),
            last_transition_time: None,
        };
        let s = with_conditions(ok.clone(), vec![condition("False")]);
        assert!(s.ready);
        assert_eq!(s.conditions.len(), 1);
        assert_eq!(
            s.message.as_deref(),
            Some(
                "Coexistence False (DevicePluginAdvertisesGPUs): a device plugin advertises nvidia.com/gpu: 8"
            )
        );
        let quiet = with_conditions(ok, vec![condition("True")]);
        assert_eq!(quiet.message, None);
        let v = status_patch("node-a", &s);
        assert_eq!(v["status"]["conditions"][0]["type"], "Coexistence");
    }

    #[test]
    fn the_inventory_is_named_after_and_owned_by_its_node() {
        let inv = inventory_object(spec(), "node-uid-1");
        assert_eq!(inv.metadata.name.as_deref(), Some("node-a"));
        let owner = &inv.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!((owner.api_version.as_str(), owner.kind.as_str()), ("v1", "Node"));
        assert_eq!(
            (owner.name.as_str(), owner.uid.as_str()),
            ("node-a", "node-uid-1")
        );
        let v = serde_json::to_value(&inv).unwrap();
        assert_eq!(v["apiVersion"], "gpu.tessera.dev/v1alpha1");
        assert_eq!(v["kind"], "NodeInventory");
    }

    #[test]
    fn the_node_is_ready_only_while_registered_with_kubelet() {
        let now = Timestamp::now();
        let s = inventory_status(&spec(), &RegistrationState::Registered, now);
        assert!(s.ready);
        assert_eq!(s.gpu_count, 2);
        assert_eq!(s.message, None);
        assert_eq!(s.last_heartbeat_time, Some(Time(now)));
        let s = inventory_status(&spec(), &RegistrationState::Pending, now);
        assert!(!s.ready);
        assert!(s.message.unwrap().contains("waiting for kubelet"));
        let s = inventory_status(&spec(), &RegistrationState::Failed("bad version".into()), now);
        assert!(!s.ready);
        assert!(s.message.unwrap().contains("bad version"));
    }

    /// Issue 16 item 2: the old backoff (1 → 2 → 4 → … → 30 s) left a 101 s heartbeat gap.
    #[test]
    fn retries_grow_to_five_seconds_and_never_beyond_whatever_the_jitter() {
        let mut b = Backoff::default();
        let longest: Vec<Duration> = (0..8).map(|_| b.next(0.0)).collect();
        let secs = |s: &[u64]| s.iter().map(|s| Duration::from_secs(*s)).collect::<Vec<_>>();
        assert_eq!(longest, secs(&[1, 2, 4, 5, 5, 5, 5, 5]));
        let mut b = Backoff::default();
        let shortest: Vec<Duration> = (0..4).map(|_| b.next(0.999_999)).collect();
        assert!(shortest[0] >= Duration::from_millis(750) && shortest[3] >= Duration::from_millis(3750));
        let mut b = Backoff::default();
        for _ in 0..1000 {
            let d = b.next(jitter());
            assert!(d <= MAX_BACKOFF, "{d:?}");
        }
        b.reset();
        assert_eq!(b.next(0.0), INITIAL_BACKOFF, "a success starts over");
        // The invariant the module documents, against the controller's default timeout of 40 s.
        assert!(MAX_BACKOFF + ATTEMPT_TIMEOUT < Duration::from_secs(40) / 2);
    }

    #[test]
    fn the_node_lease_is_labelled_for_the_controller_and_owned_by_its_node() {
        let now = Timestamp::now();
        let lease = node_lease(
            "tessera-node-node-a",
            "tessera-system",
            "node-a",
            Some("uid-1"),
            Duration::from_secs(10),
            now,
        );
        let v = serde_json::to_value(&lease).unwrap();
        assert_eq!(
            (v["apiVersion"].as_str(), v["kind"].as_str()),
            (Some("coordination.k8s.io/v1"), Some("Lease"))
        );
        assert_eq!(v["metadata"]["namespace"], "tessera-system");
        assert_eq!(v["metadata"]["labels"][HEARTBEAT_LABEL], HEARTBEAT_LABEL_VALUE);
        assert_eq!(v["metadata"]["ownerReferences"][0]["kind"], "Node");
        assert_eq!(v["metadata"]["ownerReferences"][0]["uid"], "uid-1");
        assert_eq!(v["spec"]["holderIdentity"], "node-a");
        assert_eq!(v["spec"]["leaseDurationSeconds"], 40);
        assert!(v["spec"]["renewTime"].is_string());
        let unowned = node_lease("l", "ns", "node-a", None, Duration::from_secs(10), now);
        assert_eq!(unowned.metadata.owner_references, None);
    }

    #[test]
    fn the_status_carries_the_heartbeat_until_the_leader_reads_node_leases_then_is_written_on_change_only() {
        let t0 = Instant::now();
        let ready = inventory_status(&spec(), &RegistrationState::Registered, Timestamp::now());
        let mut beat = HeartbeatState::default();
        assert!(beat.status_write_needed(&ready), "nothing written yet");
        beat.wrote(&ready);
        assert!(
            !beat.leader_check_due(t0),
            "no Lease renewed yet: nothing to switch to"
        );
        beat.lease_renewed = true;
        assert!(beat.leader_check_due(t0));
        assert!(
            beat.status_write_needed(&ready),
            "an older leader still needs the inventory heartbeat"
        );

        beat.leader_reads_leases = true;
        beat.leader_checked_at = Some(t0);
        let later = inventory_status(&spec(), &RegistrationState::Registered, Timestamp::now());
        assert!(!beat.status_write_needed(&later), "only the time differs");
        let mut sick = later.clone();
        sick.message = Some("checkpoint corrupted".into());
        assert!(beat.status_write_needed(&sick), "a changed status is written");
        assert!(!beat.leader_check_due(t0 + LEADER_CHECK_EVERY - Duration::from_secs(1)));
        assert!(beat.leader_check_due(t0 + LEADER_CHECK_EVERY));

        // The Lease is refused (an older chart's RBAC): back to the inventory heartbeat.
        beat.lease_renewed = false;
        assert!(beat.status_write_needed(&later));
    }

    #[test]
    fn only_a_forbidden_or_missing_lease_namespace_falls_back_without_retrying() {
        let status = |code| {
            kube::Error::Api(Box::new(kube::core::Status {
                code,
                ..Default::default()
            }))
        };
        assert!(refused(&status(403)));
        assert!(refused(&status(404)));
        assert!(!refused(&status(500)));
        assert!(!refused(&status(409)));
    }

    #[test]
    fn the_status_patch_carries_type_meta_for_server_side_apply() {
        let s = inventory_status(&spec(), &RegistrationState::Registered, Timestamp::now());
        let v = status_patch("node-a", &s);
        assert_eq!(v["kind"], "NodeInventory");
        assert_eq!(v["metadata"]["name"], "node-a");
        assert_eq!(v["status"]["ready"], true);
        assert!(v["status"]["lastHeartbeatTime"].is_string());
    }
}
