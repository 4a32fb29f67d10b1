//! Publishes the node's `NodeInventory` and keeps its heartbeat fresh.
//!
//! The spec (discovered GPUs) is written once with server-side apply, owned by the Node so it goes with it;
//! the status (`ready`, `lastHeartbeatTime`, `gpuCount`, `message`) every heartbeat interval and whenever
//! registration with kubelet changes. `ready` is true only while kubelet has the plugin registered.
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

use std::time::Duration;

use k8s_openapi::{
    api::core::v1::Node,
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Resource,
    api::{Patch, PatchParams},
};
use tessera_api::{NodeInventory, NodeInventorySpec, inventory::NodeInventoryStatus};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::registration::RegistrationState;

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

/// The inventory object for `spec`, owned by the Node with `node_uid`.
pub fn inventory_object(spec: NodeInventorySpec, node_uid: &str) -> NodeInventory {
    let mut inv = NodeInventory::new(&spec.node_name, spec.clone());
    inv.metadata = ObjectMeta {
        name: Some(spec.node_name.clone()),
        owner_references: Some(vec![OwnerReference {
            api_version: <Node as k8s_openapi::Resource>::API_VERSION.to_string(),
            kind: <Node as k8s_openapi::Resource>::KIND.to_string(),
            name: spec.node_name.clone(),
            uid: node_uid.to_string(),
            ..Default::default()
        }]),
        ..Default::default()
    };
    inv
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
    health: Option<std::sync::Arc<crate::health::Health>>,
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
            health: None,
        }
    }

    /// Publishes `health` in `status.health`, and publishes at once whenever it changes (the controller
    /// taints a sick GPU's devices from it).
    pub fn with_health(mut self, health: std::sync::Arc<crate::health::Health>) -> Self {
        self.health = Some(health);
        self
    }

    /// Reports `problems()` in every status message (see [`with_problems`]).
    pub fn with_problem_source(mut self, problems: Problems) -> Self {
        self.problems = Some(problems);
        self
    }

    /// Publishes until `stop` turns true. Writes nothing on the way out (see the module docs).
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let api: Api<NodeInventory> = Api::all(self.client.clone());
        let name = self.spec.node_name.clone();
        let mut spec_published = false;
        let mut backoff = Backoff::default();
        let mut health_changes = self.health.as_ref().map(|h| h.subscribe());
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
                if let Some(health) = &self.health {
                    status.health = health.status();
                }
                self.publish_status(&api, &status).await?;
                debug!(ready = status.ready, "heartbeat published");
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
        info!(inventory = %name, "stopped heartbeating; the node's slices stay published");
    }

    async fn publish_spec(&self, api: &Api<NodeInventory>) -> Result<(), kube::Error> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = nodes.get(&self.spec.node_name).await?;
        let uid = node.metadata.uid.unwrap_or_default();
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
    fn the_status_patch_carries_type_meta_for_server_side_apply() {
        let s = inventory_status(&spec(), &RegistrationState::Registered, Timestamp::now());
        let v = status_patch("node-a", &s);
        assert_eq!(v["kind"], "NodeInventory");
        assert_eq!(v["metadata"]["name"], "node-a");
        assert_eq!(v["status"]["ready"], true);
        assert!(v["status"]["lastHeartbeatTime"].is_string());
    }
}
