//! Publishes the node's `NodeInventory` and keeps its heartbeat fresh.
//!
//! The spec (discovered GPUs) is written once with server-side apply, owned by the Node so it goes with it;
//! the status (`ready`, `lastHeartbeatTime`, `gpuCount`, `message`) every heartbeat interval and whenever
//! registration with kubelet changes. `ready` is true only while kubelet has the plugin registered; on
//! shutdown it is set to false. An unreachable API server is retried with capped exponential backoff, never
//! fatal: the plugin keeps serving kubelet, and the controller notices the stale heartbeat.

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
const INITIAL_BACKOFF: Duration = Duration::from_secs(1);

/// Longest retry delay: below the controller's default heartbeat timeout (40 s), so one successful retry
/// after an outage lands before the node's pool is withdrawn.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// How long the final "not ready" write may take at shutdown before the plugin exits anyway.
const SHUTDOWN_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

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
    }
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
        }
    }

    /// Publishes until `stop` turns true, then marks the inventory not ready.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let api: Api<NodeInventory> = Api::all(self.client.clone());
        let name = self.spec.node_name.clone();
        let mut spec_published = false;
        let mut backoff = INITIAL_BACKOFF;
        loop {
            let result = async {
                if !spec_published {
                    self.publish_spec(&api).await?;
                    spec_published = true;
                }
                let registration = self.registration.borrow_and_update().clone();
                let status = inventory_status(&self.spec, &registration, Timestamp::now());
                self.publish_status(&api, &status).await?;
                debug!(ready = status.ready, "heartbeat published");
                Ok::<_, kube::Error>(())
            }
            .await;
            let delay = match result {
                Ok(()) => {
                    backoff = INITIAL_BACKOFF;
                    self.heartbeat
                }
                Err(e) => {
                    warn!(inventory = %name, error = %e, retry_in = ?backoff, "failed to publish the node inventory");
                    let delay = backoff;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    delay
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                // A dropped sender means registration can no longer change; the heartbeat timer still runs.
                Ok(()) = self.registration.changed() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        }
        if spec_published {
            let status = NodeInventoryStatus {
                ready: false,
                last_heartbeat_time: Some(Time(Timestamp::now())),
                gpu_count: self.spec.gpus.len() as u32,
                message: Some("the plugin stopped".to_string()),
            };
            match tokio::time::timeout(SHUTDOWN_WRITE_TIMEOUT, self.publish_status(&api, &status)).await {
                Ok(Ok(())) => info!(inventory = %name, "marked the node inventory not ready"),
                Ok(Err(e)) => {
                    warn!(inventory = %name, error = %e, "failed to mark the node inventory not ready")
                }
                Err(_) => warn!(inventory = %name, "timed out marking the node inventory not ready"),
            }
        }
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
