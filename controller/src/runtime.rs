//! The kube-rs layer: watches feed a [`Snapshot`], a single loop ticks the [`Replica`].
//!
//! Events from any watch (inventories, nodes, the policy, this driver's slices) wake the loop after a
//! short debounce; a timer wakes it every lease-renew interval so stale heartbeats are noticed and the
//! lease is renewed. Because the slice watch is one of the inputs, slices kubelet deletes (plugin
//! deregistration, kubelet start) are republished on the next tick. After writing, the loop waits until
//! the slice cache shows its own writes, so a stale cache never triggers a second round of writes.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use anyhow::Context as _;
use chrono::Utc;
use futures::{StreamExt, stream};
use k8s_openapi::api::{coordination::v1::Lease, core::v1::Node, resource::v1::ResourceSlice};
use kube::{
    Api, Client, Config,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
    core::PartialObjectMeta,
    runtime::{
        WatchStreamExt,
        reflector::{self, Store},
        watcher,
    },
};
use tessera_api::{
    DRIVER_NAME, NodeInventory,
    policy::{DEFAULT_POLICY_NAME, GpuPolicy, GpuPolicyStatus},
};
use tokio::sync::Notify;

use crate::{
    cli::RunArgs,
    features::{ApiFeatures, features_from_probes, probe_slices},
    leader::{LeaderElector, LeaseError, LeaseStore},
    pool::{CONTENT_HASH_ANNOTATION, NodeRef},
    reconcile::Plan,
    reconciler::{ApiError, ClusterApi, Reconciler, Replica, Snapshot},
};

const FIELD_MANAGER: &str = "tessera-controller";
/// Lets a burst of watch events (a node's inventory and its slices) land before reconciling.
const DEBOUNCE: Duration = Duration::from_millis(200);
/// How long to wait for the cache to show the controller's own writes.
const CACHE_SYNC_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the API server's features are probed again.
const REPROBE_EVERY: Duration = Duration::from_secs(300);

/// [`ClusterApi`] on a kube client.
pub struct KubeApi {
    slices: Api<ResourceSlice>,
    policies: Api<GpuPolicy>,
}

impl KubeApi {
    pub fn new(client: &Client) -> Self {
        Self {
            slices: Api::all(client.clone()),
            policies: Api::all(client.clone()),
        }
    }
}

impl KubeLease {
    pub fn new(client: &Client, namespace: &str, name: &str) -> Self {
        Self {
            api: Api::namespaced(client.clone(), namespace),
            name: name.to_string(),
        }
    }
}

fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}

impl ClusterApi for KubeApi {
    async fn create_slice(&self, slice: &ResourceSlice) -> Result<(), ApiError> {
        self.slices
            .create(&post_params(), slice)
            .await
            .map(|_| ())
            .map_err(Into::into)
    }

    async fn replace_slice(&self, slice: &ResourceSlice) -> Result<(), ApiError> {
        let name = slice.metadata.name.clone().unwrap_or_default();
        self.slices
            .replace(&name, &post_params(), slice)
            .await
            .map(|_| ())
            .map_err(Into::into)
    }

    async fn delete_slice(&self, name: &str) -> Result<(), ApiError> {
        match self.slices.delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn patch_policy_status(&self, name: &str, status: &GpuPolicyStatus) -> Result<(), ApiError> {
        let patch = Patch::Merge(serde_json::json!({ "status": status }));
        self.policies
            .patch_status(name, &PatchParams::default(), &patch)
            .await
            .map(|_| ())
            .map_err(Into::into)
    }
}

/// [`LeaseStore`] on a kube client.
pub struct KubeLease {
    api: Api<Lease>,
    name: String,
}

fn lease_error(e: kube::Error) -> LeaseError {
    match e {
        kube::Error::Api(s) if s.is_conflict() || s.is_already_exists() => LeaseError::Conflict,
        e => LeaseError::Api(e.to_string()),
    }
}

impl LeaseStore for KubeLease {
    async fn get(&self) -> Result<Option<Lease>, LeaseError> {
        self.api.get_opt(&self.name).await.map_err(lease_error)
    }

    async fn create(&self, lease: &Lease) -> Result<Lease, LeaseError> {
        self.api.create(&post_params(), lease).await.map_err(lease_error)
    }

    async fn replace(&self, lease: &Lease) -> Result<Lease, LeaseError> {
        self.api
            .replace(&self.name, &post_params(), lease)
            .await
            .map_err(lease_error)
    }
}

/// Detects partitionable devices, consumable capacity and taints with dry-run probes (see
/// [`crate::features`]). Only a validation rejection (400/422) counts as "unsupported"; any other
/// failure makes the whole probe inconclusive, so a network blip never downgrades every pool.
pub async fn probe_features(client: &Client) -> Result<ApiFeatures, kube::Error> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let params = PostParams {
        dry_run: true,
        field_manager: Some(FIELD_MANAGER.into()),
    };
    let mut results = vec![];
    for slice in probe_slices() {
        let name = slice.metadata.name.clone().unwrap_or_default();
        let returned = match api.create(&params, &slice).await {
            Ok(s) => Some(s),
            Err(kube::Error::Api(s)) if s.code == 400 || s.code == 422 => {
                tracing::info!(probe = %name, reason = %s.message, "feature probe rejected");
                None
            }
            Err(e) => return Err(e),
        };
        results.push((name, returned));
    }
    Ok(features_from_probes(&results))
}

async fn client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("failed to read kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?
        }
        None => Config::infer().await?,
    };
    Ok(Client::try_from(config)?)
}

struct Stores {
    inventories: Store<NodeInventory>,
    nodes: Store<PartialObjectMeta<Node>>,
    policies: Store<GpuPolicy>,
    slices: Store<ResourceSlice>,
}

impl Stores {
    fn snapshot(&self) -> Snapshot {
        let nodes: BTreeMap<String, NodeRef> = self
            .nodes
            .state()
            .iter()
            .filter_map(|n| {
                let name = n.metadata.name.clone()?;
                Some((
                    name.clone(),
                    NodeRef {
                        name,
                        uid: n.metadata.uid.clone(),
                    },
                ))
            })
            .collect();
        Snapshot {
            inventories: self.inventories.state().iter().map(|i| (**i).clone()).collect(),
            nodes,
            policy: self
                .policies
                .state()
                .iter()
                .find(|p| p.metadata.name.as_deref() == Some(DEFAULT_POLICY_NAME))
                .map(|p| (**p).clone()),
            slices: self.slices.state().iter().map(|s| (**s).clone()).collect(),
        }
    }

    /// True when the cache shows every write of `plan`.
    fn shows(&self, plan: &Plan) -> bool {
        let current: BTreeMap<String, Arc<ResourceSlice>> = self
            .slices
            .state()
            .into_iter()
            .filter_map(|s| Some((s.metadata.name.clone()?, s)))
            .collect();
        let hash = |s: &ResourceSlice| {
            s.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(CONTENT_HASH_ANNOTATION).cloned())
        };
        plan.creates.iter().chain(&plan.updates).all(|w| {
            w.metadata
                .name
                .as_ref()
                .and_then(|n| current.get(n))
                .is_some_and(|c| c.spec.pool.generation == w.spec.pool.generation && hash(c) == hash(w))
        }) && plan.deletes.iter().all(|n| !current.contains_key(n))
    }
}

/// Runs the controller until SIGINT/SIGTERM.
/// Keeps `writer`'s store in step with the objects `api` lists and watches; the stream yields once per change
/// (retrying with backoff), which is all the reconcile loop needs to know.
fn mirror<K>(
    writer: reflector::store::Writer<K>,
    api: Api<K>,
    config: watcher::Config,
) -> futures::stream::BoxStream<'static, ()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Default,
{
    reflector::reflector(writer, watcher(api, config))
        .default_backoff()
        .touched_objects()
        .map(|_| ())
        .boxed()
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let RunArgs {
        kubeconfig,
        lease_namespace,
        lease_name,
        identity,
        heartbeat_timeout,
        features,
    } = args;
    let client = client(kubeconfig.as_deref()).await?;
    let pinned_features = features;
    let features = match features {
        Some(f) => f,
        None => loop {
            match probe_features(&client).await {
                Ok(f) => break f,
                Err(e) => {
                    tracing::warn!(error = %e, "probing the API server's features failed; retrying");
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
        },
    };
    let identity = identity.unwrap_or_else(|| {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "tessera".into());
        format!("{}-{}", host.trim(), std::process::id())
    });
    tracing::info!(%features, %identity, "starting");

    let notify = Arc::new(Notify::new());
    let (inv_reader, inv_writer) = reflector::store();
    let (node_reader, node_writer) = reflector::store();
    let (pol_reader, pol_writer) = reflector::store();
    let (slice_reader, slice_writer) = reflector::store();
    let wc = watcher::Config::default;
    let inventories = mirror(inv_writer, Api::<NodeInventory>::all(client.clone()), wc());
    let nodes = mirror(
        node_writer,
        Api::<PartialObjectMeta<Node>>::all(client.clone()),
        wc(),
    );
    let policies = mirror(
        pol_writer,
        Api::<GpuPolicy>::all(client.clone()),
        wc().fields(&format!("metadata.name={DEFAULT_POLICY_NAME}")),
    );
    let slices = mirror(
        slice_writer,
        Api::<ResourceSlice>::all(client.clone()),
        wc().fields(&format!("spec.driver={DRIVER_NAME}")),
    );
    let events = stream::select_all([inventories, nodes, policies, slices]);
    let waker = Arc::clone(&notify);
    tokio::spawn(events.for_each(move |()| {
        waker.notify_one();
        futures::future::ready(())
    }));
    let stores = Stores {
        inventories: inv_reader,
        nodes: node_reader,
        policies: pol_reader,
        slices: slice_reader,
    };
    for (what, ready) in [
        (
            "NodeInventories",
            stores.inventories.wait_until_ready().await.is_ok(),
        ),
        ("Nodes", stores.nodes.wait_until_ready().await.is_ok()),
        ("GpuPolicies", stores.policies.wait_until_ready().await.is_ok()),
        ("ResourceSlices", stores.slices.wait_until_ready().await.is_ok()),
    ] {
        anyhow::ensure!(
            ready,
            "failed to list {what}: the watch ended before its first list"
        );
    }

    let api = KubeApi {
        slices: Api::all(client.clone()),
        policies: Api::all(client.clone()),
    };
    let lease = KubeLease {
        api: Api::namespaced(client.clone(), &lease_namespace),
        name: lease_name.clone(),
    };
    let mut replica = Replica {
        elector: LeaderElector::new(&identity, &lease_namespace, &lease_name),
        reconciler: Reconciler::new(features, chrono::Duration::seconds(heartbeat_timeout as i64)),
    };
    let tick_every = replica
        .elector
        .renew_interval()
        .to_std()
        .unwrap_or(Duration::from_secs(2));
    let mut was_leader = false;
    let mut next_probe = tokio::time::Instant::now() + REPROBE_EVERY;
    loop {
        // Gates change with API server upgrades or restarts; a changed answer republishes every pool.
        if pinned_features.is_none() && tokio::time::Instant::now() >= next_probe {
            next_probe = tokio::time::Instant::now() + REPROBE_EVERY;
            match probe_features(&client).await {
                Ok(probed) if probed != replica.reconciler.features => {
                    tracing::info!(from = %replica.reconciler.features, to = %probed, "API server features changed");
                    replica.reconciler.features = probed;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "re-probing the API server's features failed; keeping them")
                }
            }
        }
        let snap = stores.snapshot();
        match replica.tick(&lease, &api, &snap, &Utc::now).await {
            Ok(Some(decision)) => {
                if !was_leader {
                    tracing::info!("became leader");
                }
                was_leader = true;
                if let Some(problem) = &decision.problem {
                    tracing::warn!(%problem, "GpuPolicy is invalid; keeping the last valid policy");
                }
                if let Some(plan) = decision.plan.filter(|p| !p.is_empty()) {
                    tracing::info!(
                        creates = plan.creates.len(),
                        updates = plan.updates.len(),
                        deletes = plan.deletes.len(),
                        pools = ?plan.pools(),
                        "published"
                    );
                    let deadline = tokio::time::Instant::now() + CACHE_SYNC_TIMEOUT;
                    while !stores.shows(&plan) && tokio::time::Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
            Ok(None) => {
                if was_leader {
                    tracing::warn!("lost leadership");
                }
                was_leader = false;
            }
            Err(e) => {
                tracing::warn!(error = %e, "reconcile failed; retrying");
                tokio::time::sleep(tick_every).await;
            }
        }
        tokio::select! {
            _ = notify.notified() => tokio::time::sleep(DEBOUNCE).await,
            _ = tokio::time::sleep(tick_every) => {}
            _ = tokio::signal::ctrl_c() => {
                tracing::info!("shutting down");
                return Ok(());
            }
        }
    }
}
