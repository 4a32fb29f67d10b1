//! The kube-rs layer: watches feed a [`Snapshot`], a single loop ticks the [`Replica`].
//!
//! Each watch mirrors one kind into a store. When a watch fails (API server restarted or unreachable),
//! its view counts as lost until a fresh list has completed: the watch is started over rather than
//! resumed, and [`crate::liveness`] neither withdraws pools nor counts heartbeat age meanwhile. Retries
//! are capped at [`crate::mirror::RELIST_MAX_BACKOFF`] so the view comes back within seconds of the API
//! server.
//!
//! Events from any watch (inventories, nodes, the policy, this driver's slices) wake the loop after a
//! short debounce; a timer wakes it every lease-renew interval so stale heartbeats are noticed and the
//! lease is renewed. The node heartbeat Leases are watched too but wake nothing: a renewal changes no
//! pool, and the timer's next tick (at most 2 s later) sees it, where a wake per renewal would run a
//! reconcile of every node for each of them. Because the slice watch is one of the inputs, slices kubelet deletes (plugin
//! deregistration, kubelet start) are republished at once: a deletion wakes the loop after 20 ms, not the
//! debounce. After writing, the loop waits until
//! the slice cache shows its own writes, so a stale cache never triggers a second round of writes.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use chrono::Utc;
use clap::Args as ClapArgs;
use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::Node,
    resource::v1::{DeviceClass, ResourceClaim, ResourceSlice},
};
use kube::{
    Api, Client, Config,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
    core::PartialObjectMeta,
    runtime::{
        reflector::{self, Store},
        watcher,
    },
};
use tessera_api::{
    DRIVER_NAME, NodeInventory,
    heartbeat::{HEARTBEAT_LABEL, HEARTBEAT_LABEL_VALUE, node_of_lease},
    policy::{DEFAULT_POLICY_NAME, GpuPolicy, GpuPolicyStatus},
};
use tokio::sync::Notify;

use crate::{
    features::{ApiFeatures, features_from_probes, probe_slices},
    leader::{LeaderElector, LeaseError, LeaseStore},
    liveness::{Liveness, View},
    mirror::{Deletions, ViewCell, drop_managed_fields, mirror, mirror_waking},
    pool::{CONTENT_HASH_ANNOTATION, NodeRef},
    pool_diff::{Plan, trim_to_what_diff_reads},
    publisher::{ApiError, ClusterApi, Reconciler, Replica, Snapshot},
};

const FIELD_MANAGER: &str = "tessera-controller";
/// Lets a burst of watch events (a node's inventory and its slices) land before reconciling.
const DEBOUNCE: Duration = Duration::from_millis(200);
/// The debounce after a slice was deleted by someone else: short, since the pool is incomplete meanwhile.
const DELETE_DEBOUNCE: Duration = Duration::from_millis(20);
/// How long to wait for the cache to show the controller's own writes.
const CACHE_SYNC_TIMEOUT: Duration = Duration::from_secs(5);
/// How long start-up waits for the first list of the nodes' heartbeat Leases.
const LEASE_LIST_WAIT: Duration = Duration::from_secs(10);
/// How often the API server's features are probed again.
const REPROBE_EVERY: Duration = Duration::from_secs(300);
/// At most how often the MIG fragmentation gauges are recomputed (only when claims, classes, inventories
/// or the policy's assignment changed): at 1,000 nodes a round evaluates pending requests on every GPU.
const FRAGMENTATION_EVERY: Duration = Duration::from_secs(5);

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
        let created = self.slices.create(&post_params(), slice).await;
        match crate::metrics::metrics().wrote("create", created) {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 && s.reason == "AlreadyExists" => {
                let name = slice.metadata.name.clone().unwrap_or_default();
                Err(Box::new(crate::publisher::SliceExists(name)))
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn replace_slice(&self, slice: &ResourceSlice) -> Result<(), ApiError> {
        let name = slice.metadata.name.clone().unwrap_or_default();
        let replaced = self.slices.replace(&name, &post_params(), slice).await;
        match crate::metrics::metrics().wrote("update", replaced) {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_not_found() => Err(Box::new(crate::publisher::SliceGone(name))),
            Err(e) => Err(e.into()),
        }
    }

    async fn delete_slice(&self, name: &str) -> Result<(), ApiError> {
        let deleted = self.slices.delete(name, &DeleteParams::default()).await;
        let deleted = match deleted {
            Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(()),
            other => crate::metrics::metrics().wrote("delete", other),
        };
        match deleted {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_not_found() => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn patch_policy_status(&self, name: &str, status: &GpuPolicyStatus) -> Result<(), ApiError> {
        let patch = Patch::Merge(serde_json::json!({ "status": status }));
        let patched = self
            .policies
            .patch_status(name, &PatchParams::default(), &patch)
            .await;
        crate::metrics::metrics()
            .wrote("patch_policy_status", patched)
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

pub(crate) async fn client(kubeconfig: Option<&std::path::Path>) -> anyhow::Result<Client> {
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
    node_leases: Store<Lease>,
    claims: Store<ResourceClaim>,
    classes: Store<DeviceClass>,
    inventory_view: ViewCell,
    node_view: ViewCell,
    slice_view: ViewCell,
    lease_view: ViewCell,
    claim_view: ViewCell,
    class_view: ViewCell,
}

/// What the fragmentation gauges were last computed from, and the computation in flight.
#[derive(Default)]
struct FragmentationRound {
    inputs: Option<(u64, u64, u64, usize)>,
    started: Option<Instant>,
    running: Option<tokio::task::JoinHandle<()>>,
    demand: Arc<std::sync::Mutex<crate::fragmentation::DemandCache>>,
}

impl FragmentationRound {
    /// Starts a computation off the loop's thread when the inputs changed, none is running and the last
    /// started at least [`FRAGMENTATION_EVERY`] ago. Without a list of claims (no RBAC on them: an older
    /// chart) there are no gauges.
    fn maybe_start(&mut self, stores: &Stores, snap: &Snapshot, reconciler: &Reconciler) {
        if self.running.as_ref().is_some_and(|r| !r.is_finished())
            || self.started.is_some_and(|t| t.elapsed() < FRAGMENTATION_EVERY)
            || !stores.claim_view.listed_once()
            || !stores.class_view.listed_once()
        {
            return;
        }
        let Some(models) = reconciler.assigned_models() else {
            return;
        };
        let inputs = (
            stores.claim_view.changes(),
            stores.class_view.changes(),
            stores.inventory_view.changes(),
            Arc::as_ptr(&models) as usize,
        );
        if self.inputs == Some(inputs) {
            return;
        }
        self.inputs = Some(inputs);
        self.started = Some(Instant::now());
        let inventories = snap.inventories.clone();
        let claims: Vec<ResourceClaim> = stores.claims.state().iter().map(|c| (**c).clone()).collect();
        let classes: Vec<DeviceClass> = stores.classes.state().iter().map(|c| (**c).clone()).collect();
        let features = reconciler.features;
        let demand = Arc::clone(&self.demand);
        self.running = Some(tokio::task::spawn_blocking(move || {
            let model = |node: &str, gpu: u32| {
                models
                    .get(&(node.to_string(), gpu))
                    .cloned()
                    .unwrap_or(crate::devices::Model::Default)
            };
            let mut demand = demand.lock().unwrap_or_else(|e| e.into_inner());
            let gpus = crate::fragmentation::fragmentation(
                &inventories,
                &model,
                features,
                &claims,
                &classes,
                &mut demand,
            );
            crate::metrics::metrics().set_mig_fragmentation(&gpus);
        }));
    }
}

/// The inventories' view as liveness needs it: lost while either the inventories or the Nodes are
/// (a pool's fate depends on both; the node Leases' view is combined the same way), numbered by the
/// inventories' lists.
fn combined_view(inventories: View, nodes: View) -> View {
    match (inventories, nodes) {
        (View::Lost { since: a }, View::Lost { since: b }) => View::Lost { since: a.min(b) },
        (View::Lost { since }, _) | (_, View::Lost { since }) => View::Lost { since },
        (synced, View::Synced { .. }) => synced,
    }
}

/// The change counts of the kinds a [`Snapshot`] copies in full, as of its last refresh.
#[derive(Debug, Default)]
struct Copied {
    inventories: Option<u64>,
    slices: Option<u64>,
    claims: Option<u64>,
}

impl Stores {
    /// Brings `snap` up to date with the caches. The inventories and slices (at 1,000 nodes, 1,000
    /// objects of ~23 KB and 9,000 slices) are copied only when their watch applied an event since the
    /// last refresh: with heartbeats on node Leases, a steady tick copies neither, where copying and
    /// dropping them was most of a tick's cost.
    fn refresh(&self, snap: &mut Snapshot, copied: &mut Copied) {
        // Counts and views first: a store read after its count was read is at least as new as that count,
        // and a view read as synced was synced before the copies below were taken.
        let (inventory_changes, slice_changes) = (self.inventory_view.changes(), self.slice_view.changes());
        snap.inventory_view = self.view();
        if copied.inventories != Some(inventory_changes) {
            snap.inventories = self.inventories.state().iter().map(|i| (**i).clone()).collect();
            copied.inventories = Some(inventory_changes);
        }
        if copied.slices != Some(slice_changes) {
            snap.slices = self.slices.state().iter().map(|s| (**s).clone()).collect();
            copied.slices = Some(slice_changes);
        }
        let claim_changes = self.claim_view.changes();
        if copied.claims != Some(claim_changes) {
            let claims = self.claims.state();
            snap.allocated = crate::retain::allocated_devices(claims.iter().map(|c| &**c));
            copied.claims = Some(claim_changes);
        }
        snap.nodes = self
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
        snap.node_leases = self
            .node_leases
            .state()
            .iter()
            .filter_map(|l| {
                let node = node_of_lease(l.metadata.name.as_deref()?)?;
                let renewed = l.spec.as_ref()?.renew_time.as_ref()?;
                Some((node.to_string(), serde_json::to_string(renewed).ok()?))
            })
            .collect();
        snap.policy = self
            .policies
            .state()
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(DEFAULT_POLICY_NAME))
            .map(|p| (**p).clone());
    }

    /// The view liveness judges by. The node Leases count once they could be listed: a controller
    /// without list/watch on leases (RBAC of an older chart) judges nodes by their inventory heartbeats
    /// alone, as before them.
    fn view(&self) -> View {
        let view = combined_view(self.inventory_view.get(), self.node_view.get());
        if self.lease_view.listed_once() {
            combined_view(view, self.lease_view.get())
        } else {
            view
        }
    }

    /// True when the cache shows every write of `plan`, counting a written slice deleted since as shown
    /// (the cache saw the write before the delete: one watch, in order).
    fn shows(&self, plan: &Plan, deleted: &Deletions) -> bool {
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
            let name = w.metadata.name.as_deref().unwrap_or_default();
            deleted.seen(name)
                || current
                    .get(name)
                    .is_some_and(|c| c.spec.pool.generation == w.spec.pool.generation && hash(c) == hash(w))
        }) && plan.deletes.iter().all(|n| !current.contains_key(n))
    }
}

/// Live while the runtime answers (a long first publish must not get the controller restarted); ready
/// once every watched kind has been listed since start, so a rolling update waits for a replica that can
/// take over.
fn health_checks(views: [ViewCell; 4]) -> tessera_api::health::Checks {
    const KINDS: [&str; 4] = ["NodeInventory", "Node", "GpuPolicy", "ResourceSlice"];
    let listed = std::sync::Mutex::new([false; 4]);
    tessera_api::health::Checks {
        live: Arc::new(|| Ok(())),
        ready: Arc::new(move || {
            let mut listed = listed.lock().unwrap_or_else(|e| e.into_inner());
            for (seen, view) in listed.iter_mut().zip(&views) {
                *seen |= matches!(view.get(), View::Synced { .. });
            }
            let missing: Vec<&str> = KINDS
                .iter()
                .zip(listed.iter())
                .filter(|(_, seen)| !**seen)
                .map(|(kind, _)| *kind)
                .collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "not listed from the API server yet: {}",
                    missing.join(", ")
                ))
            }
        }),
    }
}

// The flags of `tessera-controller run`, and of the bare command.
#[derive(Debug, Clone, ClapArgs)]
pub struct RunArgs {
    /// Kubeconfig file; in-cluster configuration when absent.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "TESSERA_LEASE_NAMESPACE", default_value = "tessera-system")]
    pub lease_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, env = "TESSERA_LEASE_NAME", default_value = "tessera-controller")]
    pub lease_name: String,
    /// Identity in the Lease; defaults to `<hostname>-<pid>`.
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Seconds without a heartbeat change, as this controller observes it (time during which its watch is
    /// down does not count), after which a node's pool is withdrawn.
    #[arg(long, env = "TESSERA_HEARTBEAT_TIMEOUT", default_value_t = 40)]
    pub heartbeat_timeout: u64,
    /// Seconds a node's plugin may report not ready (a restart, until kubelet registers it again) before
    /// its pool is withdrawn; until then the pool is kept unchanged.
    #[arg(long, env = "TESSERA_NOT_READY_GRACE", default_value_t = 30)]
    pub not_ready_grace: u64,
    /// Skip probing the API server and assume these features (`none`, `all`, or a list of
    /// partitionable, consumable, taints).
    #[arg(long, env = "TESSERA_FEATURES")]
    pub features: Option<ApiFeatures>,
    /// Address for kubelet's probes: `GET /livez` (the runtime answers) and `GET /readyz` (every watched
    /// kind has been listed), e.g. `:8081`. Off when unset.
    #[arg(long, env = "TESSERA_HEALTH_ADDR", value_parser = tessera_api::health::parse_listen_addr)]
    pub health_addr: Option<std::net::SocketAddr>,
}

/// Runs the controller until SIGINT/SIGTERM.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let RunArgs {
        kubeconfig,
        lease_namespace,
        lease_name,
        identity,
        heartbeat_timeout,
        not_ready_grace,
        features,
        health_addr,
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
    let deleted = Arc::new(Deletions::default());
    let (inv_reader, inv_writer) = reflector::store();
    let (node_reader, node_writer) = reflector::store();
    let (pol_reader, pol_writer) = reflector::store();
    let (slice_reader, slice_writer) = reflector::store();
    let (lease_reader, lease_writer) = reflector::store();
    let started = Instant::now();
    let views = [(); 7].map(|()| ViewCell::new(started));
    let (claim_reader, claim_writer) = reflector::store();
    let (class_reader, class_writer) = reflector::store();
    if let Some(addr) = health_addr {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("failed to listen for health probes on {addr} (--health-addr)"))?;
        tracing::info!(%addr, "health probes and metrics: GET /livez, /readyz, /metrics");
        tokio::spawn(tessera_api::health::serve_with_metrics(
            listener,
            // Not the Leases: the controller serves without them (see the Lease wait below).
            health_checks([0, 1, 2, 3].map(|i| views[i].clone())),
            Some(std::sync::Arc::new(|| crate::metrics::metrics().render())),
        ));
    }
    let wc = watcher::Config::default;
    tokio::spawn(mirror(
        "NodeInventory",
        inv_writer,
        Api::<NodeInventory>::all(client.clone()),
        wc(),
        drop_managed_fields,
        views[0].clone(),
        Some(Arc::clone(&notify)),
    ));
    tokio::spawn(mirror(
        "Node",
        node_writer,
        Api::<PartialObjectMeta<Node>>::all(client.clone()),
        wc(),
        drop_managed_fields,
        views[1].clone(),
        Some(Arc::clone(&notify)),
    ));
    tokio::spawn(mirror(
        "GpuPolicy",
        pol_writer,
        Api::<GpuPolicy>::all(client.clone()),
        wc().fields(&format!("metadata.name={DEFAULT_POLICY_NAME}")),
        drop_managed_fields,
        views[2].clone(),
        Some(Arc::clone(&notify)),
    ));
    tokio::spawn(mirror_waking(
        "ResourceSlice",
        slice_writer,
        Api::<ResourceSlice>::all(client.clone()),
        wc().fields(&format!("spec.driver={DRIVER_NAME}")),
        trim_to_what_diff_reads,
        views[3].clone(),
        Some(Arc::clone(&notify)),
        Some(Arc::clone(&deleted)),
    ));
    tokio::spawn(mirror(
        "Lease",
        lease_writer,
        Api::<Lease>::namespaced(client.clone(), &lease_namespace),
        wc().labels(&format!("{HEARTBEAT_LABEL}={HEARTBEAT_LABEL_VALUE}")),
        drop_managed_fields,
        views[4].clone(),
        None,
    ));
    // For the MIG fragmentation gauges and the devices a republish keeps for their claims
    // ([`crate::retain`]). Claim events wake the loop only while a device is kept: then a released claim
    // lets its node's pool drop it; otherwise a claim changes no pool, and a wake per pod would reconcile
    // every node for each. The controller publishes without claims (no RBAC on them: an older chart).
    let claim_events = Arc::new(Notify::new());
    let retaining = Arc::new(std::sync::atomic::AtomicBool::new(false));
    tokio::spawn(mirror(
        "ResourceClaim",
        claim_writer,
        Api::<ResourceClaim>::all(client.clone()),
        wc(),
        drop_managed_fields,
        views[5].clone(),
        Some(Arc::clone(&claim_events)),
    ));
    tokio::spawn({
        let (retaining, notify) = (Arc::clone(&retaining), Arc::clone(&notify));
        async move {
            loop {
                claim_events.notified().await;
                if retaining.load(std::sync::atomic::Ordering::Acquire) {
                    notify.notify_one();
                }
            }
        }
    });
    tokio::spawn(mirror(
        "DeviceClass",
        class_writer,
        Api::<DeviceClass>::all(client.clone()),
        wc(),
        drop_managed_fields,
        views[6].clone(),
        None,
    ));
    let stores = Stores {
        inventories: inv_reader,
        nodes: node_reader,
        policies: pol_reader,
        slices: slice_reader,
        node_leases: lease_reader,
        claims: claim_reader,
        classes: class_reader,
        inventory_view: views[0].clone(),
        node_view: views[1].clone(),
        slice_view: views[3].clone(),
        lease_view: views[4].clone(),
        claim_view: views[5].clone(),
        class_view: views[6].clone(),
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

    // Waited for only so long: without list/watch on leases the controller runs on inventory heartbeats.
    if tokio::time::timeout(LEASE_LIST_WAIT, stores.node_leases.wait_until_ready())
        .await
        .is_err()
    {
        tracing::warn!(
            namespace = %lease_namespace,
            "could not list the nodes' heartbeat Leases within {LEASE_LIST_WAIT:?}; judging nodes by their \
             NodeInventory heartbeats until it can (fix: grant list and watch on leases in that namespace, as \
             the chart's leader-election Role does)"
        );
    }
    // The claims too, for as long: a first publish without them would drop what a policy change made
    // while the controller was down took from allocated devices.
    if tokio::time::timeout(LEASE_LIST_WAIT, stores.claims.wait_until_ready())
        .await
        .is_err()
    {
        tracing::warn!(
            "could not list ResourceClaims within {LEASE_LIST_WAIT:?}; publishing without them, so a policy \
             change may drop allocated devices (fix: grant list and watch on resourceclaims, as the chart's \
             ClusterRole does)"
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
        reconciler: Reconciler::new(
            features,
            Liveness::new(
                Duration::from_secs(heartbeat_timeout),
                Duration::from_secs(not_ready_grace),
            ),
        ),
    };
    let tick_every = replica
        .elector
        .renew_interval()
        .to_std()
        .unwrap_or(Duration::from_secs(2));
    let mut was_leader = false;
    // Kubernetes stops a pod with SIGTERM; a terminal sends SIGINT. Either releases the lease.
    let mut stop = std::pin::pin!(stop_signal()?);
    let mut next_probe = tokio::time::Instant::now() + REPROBE_EVERY;
    let (mut snap, mut copied) = (Snapshot::default(), Copied::default());
    let mut fragmentation = FragmentationRound::default();
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
        stores.refresh(&mut snap, &mut copied);
        replica
            .elector
            .set_reads_node_leases(matches!(stores.lease_view.get(), View::Synced { .. }));
        let was_lost = replica.reconciler.liveness.view_lost();
        // Deletes from here on are of what this round reads or writes.
        deleted.clear();
        let round = Instant::now();
        let ticked = replica.tick(&lease, &api, &snap, &Utc::now, Instant::now()).await;
        crate::metrics::metrics().reconciled(round.elapsed(), ticked.is_ok());
        crate::metrics::metrics().set_leader(matches!(ticked, Ok(Some(_))));
        fragmentation.maybe_start(&stores, &snap, &replica.reconciler);
        let kept = replica.reconciler.render_cache().retained();
        let kept: Vec<(String, usize)> = kept.map(|(n, d)| (n.to_string(), d.len())).collect();
        retaining.store(!kept.is_empty(), std::sync::atomic::Ordering::Release);
        crate::metrics::metrics().set_retained(&kept);
        match ticked {
            Ok(Some(decision)) => {
                if !was_leader {
                    tracing::info!("became leader");
                }
                match (was_lost, replica.reconciler.liveness.view_lost()) {
                    (false, true) => {
                        tracing::warn!("lost the view of NodeInventories or Nodes; holding every pool")
                    }
                    (true, false) => {
                        tracing::info!("NodeInventories and Nodes listed again; judging heartbeats")
                    }
                    _ => {}
                }
                if !decision.held.is_empty() {
                    tracing::debug!(pools = ?decision.held, "holding pools");
                }
                was_leader = true;
                if let Some(problem) = &decision.problem {
                    tracing::warn!(%problem, "GpuPolicy is invalid; keeping the last valid policy");
                }
                if decision.interrupted {
                    // The plan's counts are not writes here; the next leader's round writes the rest.
                    tracing::warn!("lost the lease while publishing; stopped writing");
                } else if let Some(plan) = decision.plan.filter(|p| !p.is_empty()) {
                    tracing::info!(
                        creates = plan.creates.len(),
                        updates = plan.updates.len(),
                        deletes = plan.deletes.len(),
                        pools = ?plan.pools(),
                        "published"
                    );
                    let deadline = tokio::time::Instant::now() + CACHE_SYNC_TIMEOUT;
                    while !stores.shows(&plan, &deleted) && tokio::time::Instant::now() < deadline {
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
        // Biased, in this order: a delete wake must win over the plain wake its event also sent.
        tokio::select! {
            biased;
            _ = &mut stop => {
                // Bounded: with the API server down the lease just expires, as after a crash.
                let release = replica.elector.release(&lease, Utc::now());
                let released = tokio::time::timeout(Duration::from_secs(3), release)
                    .await
                    .unwrap_or(false);
                tracing::info!(released_lease = released, "shutting down");
                return Ok(());
            }
            // A slice deleted behind the controller's back (kubelet wipes its node's at start, in one
            // DeleteCollection whose events arrive together) leaves the pool incomplete until it is written
            // again, and the scheduler may see the node without its GPUs meanwhile: that wake skips most
            // of the debounce.
            _ = deleted.wake.notified() => tokio::time::sleep(DELETE_DEBOUNCE).await,
            // ...also one that arrives during the plain debounce (kubelet's restart changes the node's
            // inventory just before it wipes the slices).
            _ = notify.notified() => tokio::select! {
                _ = tokio::time::sleep(DEBOUNCE) => {}
                _ = deleted.wake.notified() => tokio::time::sleep(DELETE_DEBOUNCE).await,
            },
            _ = tokio::time::sleep(tick_every) => {}
        }
    }
}

/// Resolves on the first SIGTERM or SIGINT. The handlers are installed before it returns, so a signal that
/// arrives while the caller is busy is not lost.
pub fn stop_signal() -> anyhow::Result<impl Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("failed to install the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("failed to install the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_view_liveness_sees_is_lost_while_either_the_inventories_or_the_nodes_are() {
        let t0 = Instant::now();
        let (early, late) = (t0, t0 + Duration::from_secs(3));
        let synced = |list| View::Synced { list };
        let lost = |since| View::Lost { since };
        assert_eq!(
            combined_view(synced(2), synced(5)),
            synced(2),
            "numbered by the inventories' lists"
        );
        assert_eq!(combined_view(lost(late), synced(1)), lost(late));
        assert_eq!(combined_view(synced(1), lost(late)), lost(late));
        assert_eq!(
            combined_view(lost(late), lost(early)),
            lost(early),
            "the earliest loss"
        );
    }

    #[test]
    fn the_controller_is_ready_once_every_kind_was_listed_and_stays_ready_through_a_relist() {
        let t0 = Instant::now();
        let views = [(); 4].map(|()| ViewCell::new(t0));
        let checks = health_checks(views.clone());
        assert_eq!(
            (checks.ready)().unwrap_err(),
            "not listed from the API server yet: NodeInventory, Node, GpuPolicy, ResourceSlice"
        );
        views[0].set(View::Synced { list: 1 });
        views[2].set(View::Synced { list: 1 });
        assert_eq!(
            (checks.ready)().unwrap_err(),
            "not listed from the API server yet: Node, ResourceSlice"
        );
        views[1].set(View::Synced { list: 1 });
        views[3].set(View::Synced { list: 1 });
        assert_eq!((checks.ready)(), Ok(()));
        // An API server restart loses every watch; the replica was ready and liveness holds the pools.
        views.iter().for_each(|v| v.lose(t0 + Duration::from_secs(5)));
        assert_eq!((checks.ready)(), Ok(()));
        assert_eq!((checks.live)(), Ok(()));
    }

    #[test]
    fn the_node_leases_count_towards_the_view_only_once_they_could_be_listed() {
        let t0 = Instant::now();
        let views = [(); 5].map(|()| ViewCell::new(t0));
        let stores = Stores {
            inventories: reflector::store().0,
            nodes: reflector::store().0,
            policies: reflector::store().0,
            slices: reflector::store().0,
            node_leases: reflector::store().0,
            claims: reflector::store().0,
            classes: reflector::store().0,
            inventory_view: views[0].clone(),
            node_view: views[1].clone(),
            slice_view: views[3].clone(),
            lease_view: views[4].clone(),
            claim_view: ViewCell::new(t0),
            class_view: ViewCell::new(t0),
        };
        let view = || stores.view();
        views[0].set(View::Synced { list: 1 });
        views[1].set(View::Synced { list: 1 });
        // Never listed (no list/watch on leases): judged on inventory heartbeats, not held forever.
        assert_eq!(view(), View::Synced { list: 1 });
        views[4].set(View::Synced { list: 1 });
        assert_eq!(view(), View::Synced { list: 1 });
        // Listed once, then lost (an API server restart): nothing is judged until it is back.
        views[4].lose(t0 + Duration::from_secs(3));
        assert_eq!(
            view(),
            View::Lost {
                since: t0 + Duration::from_secs(3)
            }
        );
    }
}
