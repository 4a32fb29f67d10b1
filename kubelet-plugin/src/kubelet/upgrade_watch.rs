//! The plugin's watch of its own Node for a driver upgrade under the GPU Operator: a thin layer that feeds
//! the Node's labels to [`UpgradeTracker`] (`gpu::driver_upgrade`, which says which labels mean what).
//!
//! One watch of one object: the request carries the field selector `metadata.name=<node>`, so the API
//! server sends this Node only. The chart's ClusterRole grants `list` and `watch` on nodes for it (RBAC
//! cannot narrow a verb to a field selector); the plugin reads no other node.

use std::collections::BTreeMap;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client,
    runtime::{WatchStreamExt, watcher},
};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::gpu::driver_upgrade::{ReleaseReason, Step, UpgradeSignal, UpgradeTracker};

/// The labels of `node` as the API server sends each change of it (the watch retries with backoff on
/// errors, which are logged).
pub fn node_labels(
    client: Client,
    node: &str,
) -> impl Stream<Item = BTreeMap<String, String>> + Send + use<> {
    let api: Api<Node> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    watcher(api, config)
        .default_backoff()
        .applied_objects()
        .filter_map(|r| async move {
            match r {
                Ok(node) => Some(node.metadata.labels.unwrap_or_default()),
                Err(e) => {
                    warn!(error = %e, "cannot watch this node's labels for a driver upgrade; retrying");
                    None
                }
            }
        })
}

/// The signal `node` shows now (one `get`); `None` when it cannot be read.
pub async fn current_signal(client: Client, node: &str) -> Option<UpgradeSignal> {
    match Api::<Node>::all(client).get(node).await {
        Ok(n) => Some(UpgradeSignal::of(&n.metadata.labels.unwrap_or_default())),
        Err(e) => {
            warn!(node, error = %e, "cannot read this node's labels for a driver upgrade");
            None
        }
    }
}

/// Follows `labels` with `tracker` until it takes a step (a release, or a come-back), or `stop` fires
/// (`None`), or the stream ends (`None`).
pub async fn next_step(
    labels: impl Stream<Item = BTreeMap<String, String>>,
    tracker: &mut UpgradeTracker,
    mut stop: watch::Receiver<bool>,
) -> Option<Step> {
    let mut labels = std::pin::pin!(labels);
    loop {
        tokio::select! {
            next = labels.next() => match tracker.observe(&next?) {
                Step::Stay => continue,
                step => return Some(step),
            },
            _ = stop.wait_for(|s| *s) => return None,
        }
    }
}

/// Waits for the Node to ask the serving plugin to let go of the driver; `None` when stopped first.
pub async fn wait_for_release(
    client: Client,
    node: String,
    stop: watch::Receiver<bool>,
) -> Option<ReleaseReason> {
    info!(
        node,
        "watching this node for a GPU Operator driver upgrade (kubelet-plugin/README.md)"
    );
    let mut tracker = UpgradeTracker::holding();
    match next_step(node_labels(client, &node), &mut tracker, stop).await? {
        Step::Release(reason) => Some(reason),
        _ => None,
    }
}

/// Waits, without the driver, until the Node no longer asks for it to be released; false when stopped
/// first.
pub async fn wait_for_come_back(
    client: Client,
    node: String,
    released: ReleaseReason,
    stop: watch::Receiver<bool>,
) -> bool {
    let mut tracker = UpgradeTracker::released(released);
    matches!(
        next_step(node_labels(client, &node), &mut tracker, stop).await,
        Some(Step::ComeBack)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::driver_upgrade::{PAUSED_FOR_DRIVER_UPGRADE, UPGRADE_STATE_LABEL};

    fn labels(k: &str, v: &str) -> BTreeMap<String, String> {
        [(k.to_string(), v.to_string())].into()
    }

    #[tokio::test]
    async fn the_watch_steps_on_the_first_release_and_then_on_the_come_back() {
        let (_tx, stop) = watch::channel(false);
        let seen = futures::stream::iter([
            labels(UPGRADE_STATE_LABEL, "cordon-required"),
            labels(UPGRADE_STATE_LABEL, "drain-required"),
            labels(UPGRADE_STATE_LABEL, "pod-restart-required"),
            labels("nvidia.com/gpu.deploy.dcgm", PAUSED_FOR_DRIVER_UPGRADE),
            labels(UPGRADE_STATE_LABEL, "validation-required"),
        ]);
        let mut seen = Box::pin(seen);
        let mut tracker = UpgradeTracker::holding();
        let step = next_step(&mut seen, &mut tracker, stop.clone()).await;
        assert!(
            matches!(&step, Some(Step::Release(r)) if r.value == "pod-restart-required"),
            "{step:?}"
        );
        assert_eq!(
            next_step(&mut seen, &mut tracker, stop).await,
            Some(Step::ComeBack)
        );
    }

    #[tokio::test]
    async fn a_stop_ends_the_wait() {
        let (tx, stop) = watch::channel(false);
        tx.send_replace(true);
        let mut tracker = UpgradeTracker::holding();
        assert_eq!(
            next_step(futures::stream::pending(), &mut tracker, stop).await,
            None
        );
    }
}
