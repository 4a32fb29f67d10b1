//! Events on the pods of MPS shares whose daemon is down, so `kubectl describe pod` says why their CUDA
//! contexts fail: a `Warning MpsDaemonDown` when the plugin's watch ([`Sharer::watch_daemons`]) first finds
//! the device's daemon not answering, a `Normal MpsDaemonBack` once it answers again. The pods are those in
//! `status.reservedFor` of each claim with a prepared share of the device (read from the API server once
//! per transition, not per watch).
//!
//! Events go through `events.k8s.io/v1` in the pods' namespaces, which needs `create` (and `patch`, for a
//! repeated event's series) on events there; nothing else is written.

use std::{collections::BTreeSet, sync::Arc};

use k8s_openapi::api::{core::v1::ObjectReference, resource::v1::ResourceClaim};
use kube::{
    Api,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tokio::sync::Mutex;
use tracing::warn;

use crate::devices::sharing::{DaemonWatch, Sharer, daemon_key_of_share};
use crate::node::checkpoint::{DeviceDetail, Phase};
use crate::node::state::NodeState;

/// Posts the events of daemon transitions; remembers which devices it reported down.
pub struct DaemonEvents {
    client: kube::Client,
    recorder: Recorder,
    reported: Mutex<BTreeSet<String>>,
}

impl DaemonEvents {
    pub fn new(client: kube::Client, node: &str) -> Self {
        let reporter = Reporter {
            controller: "gpu.tessera.dev/kubelet-plugin".into(),
            instance: Some(node.to_string()),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            reported: Mutex::default(),
        }
    }

    /// Posts what `watch` changed: down for devices found down (started again or not), back for devices
    /// reported down that answer now.
    pub async fn report(&self, state: &NodeState, watch: &DaemonWatch) {
        let (down, back) = transitions(&mut *self.reported.lock().await, watch);
        for key in down {
            let note = if watch.replaced.contains(&key) {
                format!(
                    "The MPS control daemon of {key} was replaced (its supervisor restarted it): this pod's \
                     CUDA contexts made on the old daemon are lost."
                )
            } else {
                format!(
                    "The MPS control daemon of {key} does not answer: this pod's CUDA contexts on it have no \
                     MPS server. tessera is starting it again."
                )
            };
            self.post(state, &key, EventType::Warning, "MpsDaemonDown", note)
                .await;
        }
        for key in back {
            let note =
                format!("The MPS control daemon of {key} answers again; new CUDA contexts get a server.");
            self.post(state, &key, EventType::Normal, "MpsDaemonBack", note)
                .await;
        }
    }

    async fn post(&self, state: &NodeState, key: &str, type_: EventType, reason: &str, note: String) {
        for pod in self.pods_of(state, key).await {
            let event = Event {
                type_,
                reason: reason.into(),
                note: Some(note.clone()),
                action: "WatchMpsDaemon".into(),
                secondary: None,
            };
            if let Err(e) = self.recorder.publish(&event, &pod).await {
                warn!(key, pod = ?pod.name, error = %e, "cannot post an event on an MPS share's pod");
            }
        }
    }

    /// The pods the claims with a prepared MPS share of `key` are reserved for.
    async fn pods_of(&self, state: &NodeState, key: &str) -> Vec<ObjectReference> {
        let mut pods = Vec::new();
        let claims: Vec<_> = state
            .checkpoint()
            .claims
            .into_values()
            .filter(|c| c.phase == Phase::PrepareCompleted)
            .filter(|c| {
                c.devices.iter().any(|d| {
                    // Only the pods of the daemon's own shares: a namespace's daemon is its own business.
                    matches!(&d.detail, DeviceDetail::Shared(s) if s.strategy.as_deref() != Some("TimeSlicing")
                        && d.device.parse().is_ok_and(|n| daemon_key_of_share(&n, s.mps_pipe_dir.as_deref()) == key))
                })
            })
            .collect();
        for record in claims {
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &record.namespace);
            let claim = match api.get_opt(&record.name).await {
                Ok(Some(c)) if c.metadata.uid.as_deref() == Some(record.uid.as_str()) => c,
                Ok(_) => continue,
                Err(e) => {
                    warn!(claim = %record.name, error = %e, "cannot read an MPS share's claim for its pods");
                    continue;
                }
            };
            let reserved = claim.status.and_then(|s| s.reserved_for).unwrap_or_default();
            pods.extend(
                reserved
                    .into_iter()
                    .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or_default().is_empty())
                    .map(|r| ObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        namespace: Some(record.namespace.clone()),
                        name: Some(r.name),
                        uid: Some(r.uid),
                        ..Default::default()
                    }),
            );
        }
        pods
    }
}

/// The devices `watch` found down that were not reported yet, and the reported ones that answer now (a
/// daemon the watch started again, or found replaced since the last watch, is both); updates `reported`.
pub fn transitions(reported: &mut BTreeSet<String>, watch: &DaemonWatch) -> (Vec<String>, Vec<String>) {
    let found_down = watch.down.iter().chain(&watch.restarted).chain(&watch.replaced);
    let down: Vec<String> = found_down
        .filter(|k| reported.insert((*k).clone()))
        .cloned()
        .collect();
    let back: Vec<String> = reported
        .iter()
        .filter(|k| watch.up.contains(k) || watch.restarted.contains(k) || watch.replaced.contains(k))
        .cloned()
        .collect();
    // Back, or no longer watched (its last share went).
    reported.retain(|k| watch.down.contains(k));
    (down, back)
}

/// Runs [`Sharer::watch_daemons`] every `every` until `stop` turns true, posting `events` of each watch.
pub async fn watch_and_report(
    sharer: Arc<Sharer>,
    state: Arc<NodeState>,
    events: Option<DaemonEvents>,
    gpus: Vec<tessera_api::GpuInfo>,
    every: std::time::Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let gpus = Arc::new(gpus);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        let (s, g) = (sharer.clone(), gpus.clone());
        let settled = state.records_settled();
        match tokio::task::spawn_blocking(move || s.watch_daemons(&g, settled)).await {
            Ok(watch) => {
                if let Some(events) = &events {
                    events.report(&state, &watch).await;
                }
            }
            Err(e) => warn!(error = %e, "the MPS daemon watch failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch(up: &[&str], restarted: &[&str], down: &[&str]) -> DaemonWatch {
        let v = |l: &[&str]| l.iter().map(|s| s.to_string()).collect();
        DaemonWatch {
            up: v(up),
            restarted: v(restarted),
            down: v(down),
            ..Default::default()
        }
    }

    #[test]
    fn a_daemon_is_reported_down_once_and_back_once() {
        let mut reported = BTreeSet::new();
        assert_eq!(
            transitions(&mut reported, &watch(&["gpu-0"], &[], &[])),
            (vec![], vec![])
        );
        assert_eq!(
            transitions(&mut reported, &watch(&[], &[], &["gpu-0"])),
            (vec!["gpu-0".to_string()], vec![])
        );
        assert_eq!(
            transitions(&mut reported, &watch(&[], &[], &["gpu-0"])),
            (vec![], vec![])
        );
        assert_eq!(
            transitions(&mut reported, &watch(&["gpu-0"], &[], &[])),
            (vec![], vec!["gpu-0".to_string()])
        );
        assert!(reported.is_empty());
    }

    #[test]
    fn a_daemon_replaced_between_two_watches_is_down_and_back_in_one_round() {
        let mut reported = BTreeSet::new();
        let replaced = DaemonWatch {
            replaced: vec!["gpu-2".to_string()],
            ..Default::default()
        };
        let both = vec!["gpu-2".to_string()];
        assert_eq!(transitions(&mut reported, &replaced), (both.clone(), both));
        assert!(reported.is_empty());
        assert_eq!(
            transitions(&mut reported, &watch(&["gpu-2"], &[], &[])),
            (vec![], vec![])
        );
    }

    #[test]
    fn a_daemon_the_watch_started_again_is_down_and_back_in_one_round() {
        let mut reported = BTreeSet::new();
        let both = vec!["gpu-1".to_string()];
        assert_eq!(
            transitions(&mut reported, &watch(&[], &["gpu-1"], &[])),
            (both.clone(), both)
        );
        assert!(reported.is_empty());
    }
}
