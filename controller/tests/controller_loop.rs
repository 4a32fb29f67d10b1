//! The reconcile loop against an in-memory API server: write counts, pool lifecycle, leader election and
//! policy conditions.

mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration as StdDuration, Instant},
};

use chrono::{DateTime, Duration, Utc};
use k8s_openapi::{api::resource::v1::ResourceSlice, apimachinery::pkg::apis::meta::v1::Time};
use tessera_api::{
    NodeInventory,
    policy::{
        GpuPolicy, GpuPolicyStatus, REASON_CEL_RUNTIME_ERROR, REASON_CEL_SYNTAX_ERROR, REASON_CEL_TYPE_ERROR,
        REASON_INVALID_MODEL, REASON_SELECTS_NOTHING, REASON_VALID,
    },
};
use tessera_controller::{
    features::ApiFeatures,
    fixtures::{GpuModel, fixed_time, gpu, node},
    leader::{InMemoryLease, LeaderElector},
    liveness::{Liveness, View},
    pool::NodeRef,
    pool_diff::trim_to_what_diff_reads,
    publisher::{ApiError, ClusterApi, InMemoryApi, Reconciler, Replica, Snapshot},
    time::to_k8s_time,
    validate::validate_pool,
};

fn now() -> DateTime<Utc> {
    fixed_time() + Duration::seconds(5)
}

/// The cluster as the watches would show it, one step per second of the controller's monotonic clock;
/// slices always come from the API. Every node's plugin heartbeats each step unless silenced.
struct Cluster {
    inventories: Vec<NodeInventory>,
    nodes: Vec<&'static str>,
    policy: Option<GpuPolicy>,
    /// The controller's monotonic clock at step 0.
    start: Instant,
    /// Seconds since `start`.
    elapsed: u64,
    /// Nodes whose plugin stopped heartbeating, with the second of their last heartbeat.
    silent: BTreeMap<String, u64>,
    /// What the watch shows.
    view: View,
    /// How far each plugin's clock is off the controller's.
    skew: BTreeMap<String, Duration>,
    /// Nodes whose plugin heartbeats through its node Lease: their inventory heartbeat stands still.
    on_leases: BTreeSet<String>,
}

impl Cluster {
    fn two_nodes() -> Self {
        Self {
            inventories: vec![
                node("node-a").gpus(GpuModel::H100Sxm5_80gb, 8).build(),
                node("node-b").gpus(GpuModel::H200, 2).build(),
            ],
            nodes: vec!["node-a", "node-b"],
            policy: None,
            start: Instant::now(),
            elapsed: 0,
            silent: BTreeMap::new(),
            view: View::Synced { list: 1 },
            skew: BTreeMap::new(),
            on_leases: BTreeSet::new(),
        }
    }

    /// The controller's wall clock: it advances with the steps, so a judgment by wall-clock heartbeat age
    /// (the code before issue 16) would withdraw frozen heartbeats.
    fn wall(&self) -> DateTime<Utc> {
        now() + Duration::seconds(self.elapsed as i64)
    }

    fn mono(&self) -> Instant {
        self.start + StdDuration::from_secs(self.elapsed)
    }

    /// Stops `node`'s heartbeat at its current value.
    fn silence(&mut self, node: &str) {
        self.silent.insert(node.to_string(), self.elapsed);
    }

    fn snapshot(&self, api: &InMemoryApi) -> Snapshot {
        let inventories = self
            .inventories
            .iter()
            .map(|inv| {
                let mut inv = inv.clone();
                let second = self
                    .silent
                    .get(&inv.spec.node_name)
                    .copied()
                    .unwrap_or(self.elapsed);
                let skew = self.skew.get(&inv.spec.node_name).copied().unwrap_or_default();
                let at = fixed_time() + Duration::seconds(second as i64) + skew;
                let on_lease = self.on_leases.contains(&inv.spec.node_name);
                let inventory_beat = if on_lease { fixed_time() } else { at };
                inv.status.as_mut().unwrap().last_heartbeat_time = Some(Time(to_k8s_time(inventory_beat)));
                inv
            })
            .collect();
        let node_leases = self
            .on_leases
            .iter()
            .map(|n| {
                let second = self.silent.get(n).copied().unwrap_or(self.elapsed);
                (n.clone(), format!("renewed at second {second}"))
            })
            .collect();
        Snapshot {
            inventories,
            node_leases,
            inventory_view: self.view,
            nodes: self
                .nodes
                .iter()
                .map(|n| {
                    (
                        n.to_string(),
                        NodeRef {
                            name: n.to_string(),
                            uid: Some(format!("uid-{n}")),
                        },
                    )
                })
                .collect(),
            policy: self.policy.clone(),
            // As the runtime's cache holds them: without devices, so every test here also checks that the
            // diff needs nothing the cache drops.
            slices: api
                .slices()
                .into_iter()
                .map(|mut s| {
                    trim_to_what_diff_reads(&mut s);
                    s
                })
                .collect(),
            allocated: Default::default(),
        }
    }
}

fn liveness() -> Liveness {
    Liveness::new(StdDuration::from_secs(40), StdDuration::from_secs(30))
}

/// A reconciler that has already listed the cluster once (at step 0), so the heartbeats of the first step
/// count as renewals.
fn reconciler_for(cluster: &Cluster, api: &InMemoryApi) -> Reconciler {
    let mut r = Reconciler::new(ApiFeatures::ALL, liveness());
    r.observe(&cluster.snapshot(api), cluster.mono());
    r
}

fn reconciler() -> Reconciler {
    Reconciler::new(ApiFeatures::ALL, liveness())
}

/// Advances the clock by a second (the plugins heartbeat), reconciles, and returns the number of writes.
async fn step(r: &mut Reconciler, cluster: &mut Cluster, api: &InMemoryApi) -> usize {
    cluster.elapsed += 1;
    let before = api.writes();
    r.reconcile(
        &cluster.snapshot(api),
        api,
        cluster.wall(),
        cluster.mono(),
        &|| true,
    )
    .await
    .expect("in-memory writes succeed");
    api.writes() - before
}

/// `n` steps; the total number of writes.
async fn steps(n: u64, r: &mut Reconciler, cluster: &mut Cluster, api: &InMemoryApi) -> usize {
    let mut writes = 0;
    for _ in 0..n {
        writes += step(r, cluster, api).await;
    }
    writes
}

fn pools(api: &InMemoryApi) -> BTreeMap<String, Vec<ResourceSlice>> {
    let mut out: BTreeMap<String, Vec<ResourceSlice>> = BTreeMap::new();
    for s in api.slices() {
        out.entry(s.spec.pool.name.clone()).or_default().push(s);
    }
    out
}

fn generation(api: &InMemoryApi, pool: &str) -> i64 {
    pools(api)[pool][0].spec.pool.generation
}

/// The UIDs of every published slice, by name.
fn uids(api: &InMemoryApi) -> BTreeMap<String, String> {
    api.slices()
        .into_iter()
        .map(|s| (s.metadata.name.unwrap(), s.metadata.uid.unwrap()))
        .collect()
}

#[tokio::test]
async fn the_first_round_publishes_every_ready_node_and_the_second_writes_nothing() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    assert_eq!(
        step(&mut r, &mut cluster, &api).await,
        9 + 3,
        "node-a: 1 counter + 8 device slices; node-b: 1 + 2"
    );
    let pools = pools(&api);
    assert_eq!(pools.keys().collect::<Vec<_>>(), ["node-a", "node-b"]);
    for slices in pools.values() {
        assert!(validate_pool(slices).is_empty(), "{:?}", validate_pool(slices));
    }
    for _ in 0..3 {
        assert_eq!(
            step(&mut r, &mut cluster, &api).await,
            0,
            "steady state makes no API writes"
        );
    }
}

#[tokio::test]
async fn a_change_on_one_node_rewrites_only_that_nodes_pool_under_a_new_generation() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    let a_before = pools(&api)["node-a"].clone();
    let b_gen = generation(&api, "node-b");
    cluster.inventories[1] = node("node-b")
        .gpus(GpuModel::H200, 1)
        .gpu(gpu(GpuModel::H200, 1).on_node("node-b").unhealthy().build())
        .build();
    let writes = step(&mut r, &mut cluster, &api).await;
    assert_eq!(writes, 3, "all three slices of node-b, nothing of node-a");
    assert_eq!(pools(&api)["node-a"], a_before);
    let b = &pools(&api)["node-b"];
    assert!(
        b.iter()
            .all(|s| s.spec.pool.generation == b_gen + 1 && s.spec.pool.resource_slice_count == 3)
    );
    let tainted = b
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter(|d| d.taints.is_some())
        .count();
    assert_eq!(tainted, 26, "every device of the unhealthy GPU carries the taint");
    assert_eq!(step(&mut r, &mut cluster, &api).await, 0);
}

#[tokio::test]
async fn a_removed_node_or_inventory_takes_its_pool_with_it() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    cluster.nodes.retain(|n| *n != "node-b");
    assert_eq!(step(&mut r, &mut cluster, &api).await, 3);
    assert!(!pools(&api).contains_key("node-b"));
    cluster.inventories.retain(|i| i.spec.node_name != "node-a");
    assert_eq!(step(&mut r, &mut cluster, &api).await, 9);
    assert!(api.slices().is_empty());
    assert_eq!(step(&mut r, &mut cluster, &api).await, 0);
}

#[tokio::test]
async fn a_heartbeat_unchanged_for_the_timeout_or_a_plugin_not_ready_past_the_grace_withdraws_the_pool() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    cluster.silence("node-b");
    assert_eq!(
        steps(39, &mut r, &mut cluster, &api).await,
        0,
        "39 s without a change: still published"
    );
    assert_eq!(step(&mut r, &mut cluster, &api).await, 3, "40 s: withdrawn");
    assert!(!pools(&api).contains_key("node-b"));
    cluster.silent.clear();
    assert_eq!(
        step(&mut r, &mut cluster, &api).await,
        3,
        "a changed heartbeat republishes"
    );
    cluster.inventories[0] = node("node-a")
        .gpus(GpuModel::H100Sxm5_80gb, 8)
        .not_ready()
        .build();
    assert_eq!(
        steps(30, &mut r, &mut cluster, &api).await,
        0,
        "held through the grace"
    );
    assert_eq!(
        step(&mut r, &mut cluster, &api).await,
        9,
        "withdrawn after 30 s not ready"
    );
    assert_eq!(pools(&api).keys().collect::<Vec<_>>(), ["node-b"]);
}

#[tokio::test]
async fn nodes_heartbeating_through_their_leases_stay_published_and_a_silent_lease_withdraws_its_pool() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    assert_eq!(step(&mut r, &mut cluster, &api).await, 12, "both published");
    // Upgraded plugins: the Leases renew, the inventories' heartbeat stops changing.
    cluster.on_leases = ["node-a".to_string(), "node-b".to_string()].into();
    assert_eq!(
        steps(60, &mut r, &mut cluster, &api).await,
        0,
        "a minute on Leases alone: nothing withdrawn, nothing rewritten"
    );
    cluster.silence("node-b");
    assert_eq!(steps(39, &mut r, &mut cluster, &api).await, 0);
    assert_eq!(
        step(&mut r, &mut cluster, &api).await,
        3,
        "40 s without a renewal: withdrawn"
    );
    assert_eq!(pools(&api).keys().collect::<Vec<_>>(), ["node-a"]);
    cluster.silent.clear();
    assert_eq!(
        step(&mut r, &mut cluster, &api).await,
        3,
        "a renewed Lease republishes"
    );
}

#[tokio::test]
async fn steady_ticks_reuse_the_policys_models_until_the_policy_or_an_inventory_spec_changes() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    // As read from the API server: uid and generation, which a spec change bumps.
    for (i, inv) in cluster.inventories.iter_mut().enumerate() {
        inv.metadata.uid = Some(format!("inv-{i}"));
        inv.metadata.generation = Some(1);
    }
    let versioned = |rule: &str, generation: i64| {
        let mut p = support::policy(&format!(
            "apiVersion: gpu.tessera.dev/v1alpha1\nkind: GpuPolicy\nmetadata: {{name: default}}\n\
             spec: {{rules: [{rule}]}}\n"
        ));
        p.metadata.uid = Some("policy-uid".into());
        p.metadata.generation = Some(generation);
        p
    };
    cluster.policy = Some(versioned(
        r#"{name: h100-whole, selector: 'device.attributes["gpu.tessera.dev"].productName.startsWith("NVIDIA H100")', whole: {}}"#,
        1,
    ));
    // The watch shows the status the controller wrote, so steady ticks write nothing.
    let status_seen = |cluster: &mut Cluster, api: &InMemoryApi| {
        if let Some(p) = cluster.policy.as_mut() {
            p.status = api.policy_status("default");
        }
    };
    let mut r = reconciler_for(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    status_seen(&mut cluster, &api);
    let after_first = r.policy_evaluations();
    assert_eq!(steps(10, &mut r, &mut cluster, &api).await, 0);
    assert_eq!(
        r.policy_evaluations(),
        after_first,
        "nothing changed: no evaluation"
    );

    cluster.policy = Some(versioned("{name: all-shared, shared: {strategy: MPS}}", 2));
    assert!(
        step(&mut r, &mut cluster, &api).await > 0,
        "a new policy generation rewrites the pools"
    );
    status_seen(&mut cluster, &api);
    assert_eq!(r.policy_evaluations(), after_first + 1);

    cluster.inventories[1] = node("node-b").gpus(GpuModel::H200, 1).build();
    cluster.inventories[1].metadata.uid = Some("inv-1".into());
    cluster.inventories[1].metadata.generation = Some(2);
    assert!(
        step(&mut r, &mut cluster, &api).await > 0,
        "the changed node is rewritten"
    );
    assert_eq!(r.policy_evaluations(), after_first + 2);
    assert_eq!(steps(5, &mut r, &mut cluster, &api).await, 0);
    assert_eq!(r.policy_evaluations(), after_first + 2);
}

/// Issue 16 items 1 and 2: the controller judged heartbeats by wall-clock age from a cache that had not
/// caught up after API server restarts, and withdrew healthy nodes' pools (`deletes=9`).
#[tokio::test]
async fn an_api_server_outage_longer_than_the_timeout_withdraws_nothing() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    let published = uids(&api);
    // The API server goes away: the watch fails, the plugins cannot write, the cache stays as it was.
    cluster.silence("node-a");
    cluster.silence("node-b");
    cluster.view = View::Lost {
        since: cluster.mono(),
    };
    assert_eq!(
        steps(50, &mut r, &mut cluster, &api).await,
        0,
        "50 s without a view: nothing withdrawn"
    );
    // Back and re-listed, but the plugins' next heartbeats (retry backoff) have not landed yet.
    cluster.view = View::Synced { list: 2 };
    assert_eq!(
        steps(5, &mut r, &mut cluster, &api).await,
        0,
        "the old heartbeat is 1 to 6 s old as the controller saw it, not 56 s"
    );
    cluster.silent.clear();
    assert_eq!(steps(45, &mut r, &mut cluster, &api).await, 0);
    assert_eq!(uids(&api), published, "the same slices throughout");
}

/// Issue 16 item 2: heartbeat age is not the difference of two clocks.
#[tokio::test]
async fn a_plugin_whose_clock_is_an_hour_behind_stays_published_while_it_heartbeats() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    cluster.skew.insert("node-b".into(), -Duration::hours(1));
    let mut r = reconciler_for(&cluster, &api);
    assert_eq!(step(&mut r, &mut cluster, &api).await, 9 + 3, "published at once");
    assert_eq!(steps(45, &mut r, &mut cluster, &api).await, 0, "never withdrawn");
}

/// Issue 16 item 3: every plugin restart deleted and recreated the node's slices (new UIDs).
#[tokio::test]
async fn a_plugin_restart_that_reports_not_ready_keeps_the_pools_slices_and_their_uids() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    let published = uids(&api);
    // SIGTERM: the plugin may still write "not ready"; kill -9: the heartbeat just stops. Either way the
    // new instance reports not ready until kubelet registers it again, then ready with the same GPUs.
    let ready = cluster.inventories[0].clone();
    cluster.inventories[0] = node("node-a")
        .gpus(GpuModel::H100Sxm5_80gb, 8)
        .not_ready()
        .build();
    cluster.silence("node-a");
    assert_eq!(steps(3, &mut r, &mut cluster, &api).await, 0);
    cluster.silent.clear();
    assert_eq!(
        steps(5, &mut r, &mut cluster, &api).await,
        0,
        "the new instance, not yet registered"
    );
    cluster.inventories[0] = ready.clone();
    assert_eq!(steps(5, &mut r, &mut cluster, &api).await, 0, "registered");
    // A rolling upgrade: two instances heartbeat, the new one not ready until registered.
    for second in 0..20 {
        cluster.inventories[0] = if second % 2 == 0 {
            node("node-a")
                .gpus(GpuModel::H100Sxm5_80gb, 8)
                .not_ready()
                .build()
        } else {
            ready.clone()
        };
        assert_eq!(step(&mut r, &mut cluster, &api).await, 0, "second {second}");
    }
    assert_eq!(uids(&api), published, "no slice was recreated");
}

/// Issue 16 item 3, controller side: a restarted controller lists heartbeats it cannot date yet.
#[tokio::test]
async fn a_restarted_controller_keeps_existing_pools_until_it_sees_heartbeats_change() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    let published = uids(&api);
    let mut restarted = reconciler();
    cluster.silence("node-a");
    cluster.silence("node-b");
    assert_eq!(
        step(&mut restarted, &mut cluster, &api).await,
        0,
        "first list: held, not withdrawn and not rewritten"
    );
    cluster.silent.remove("node-a");
    assert_eq!(
        steps(45, &mut restarted, &mut cluster, &api).await,
        3,
        "node-b never renewed: withdrawn"
    );
    assert!(!pools(&api).contains_key("node-b"));
    assert!(
        uids(&api)
            .iter()
            .all(|(name, uid)| published.get(name) == Some(uid)),
        "node-a's slices are the ones the previous controller wrote"
    );
}

#[tokio::test]
async fn slices_kubelet_deletes_are_republished_once_under_a_higher_generation() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    let before = generation(&api, "node-a");
    api.delete_where(|s| s.spec.node_name.as_deref() == Some("node-a"));
    assert_eq!(step(&mut r, &mut cluster, &api).await, 9);
    assert!(
        generation(&api, "node-a") > before,
        "consumers must not mix the new slices with cached old ones"
    );
    assert_eq!(step(&mut r, &mut cluster, &api).await, 0, "no write loop");
    // Only part of the pool deleted: the rest is rewritten under a new generation too.
    api.delete_where(|s| s.metadata.name.as_deref() == Some("node-a-gpu.tessera.dev-3"));
    assert_eq!(step(&mut r, &mut cluster, &api).await, 9);
    assert!(validate_pool(&pools(&api)["node-a"]).is_empty());
}

#[tokio::test]
async fn slices_deleted_before_the_watch_says_so_are_created_in_the_same_pass_as_the_updates() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    // node-a's inventory changes, and kubelet (starting) deletes node-a's slices; the controller's cache still
    // shows them, so it plans updates of slices that are gone.
    cluster.inventories[0] = node("node-a").gpus(GpuModel::H200, 8).build();
    cluster.elapsed += 1;
    let stale = cluster.snapshot(&api);
    api.delete_where(|s| s.spec.node_name.as_deref() == Some("node-a"));
    r.reconcile(&stale, &api, cluster.wall(), cluster.mono(), &|| true)
        .await
        .expect("an update of a deleted slice creates it instead of failing the pass");
    let published = pools(&api);
    assert!(
        published.contains_key("node-a"),
        "node-a's pool was not republished in the same pass"
    );
    assert!(validate_pool(&published["node-a"]).is_empty());
    assert_eq!(
        step(&mut r, &mut cluster, &api).await,
        0,
        "no write loop after the recovery"
    );
}

#[tokio::test]
async fn a_different_feature_set_changes_the_model_of_every_pool() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    r.features = ApiFeatures::NONE;
    // Per pool: the first slice is updated in place, the others deleted: node-a 1 + 8, node-b 1 + 2.
    assert_eq!(
        step(&mut r, &mut cluster, &api).await,
        9 + 3,
        "two whole-GPU slices replace twelve"
    );
    assert_eq!(api.slices().len(), 2);
}

/// A [`ClusterApi`] that counts one replica's writes into a shared API.
struct Counted<'a> {
    api: &'a InMemoryApi,
    writes: AtomicUsize,
}

impl ClusterApi for Counted<'_> {
    async fn create_slice(&self, s: &ResourceSlice) -> Result<(), ApiError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.api.create_slice(s).await
    }
    async fn replace_slice(&self, s: &ResourceSlice) -> Result<(), ApiError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.api.replace_slice(s).await
    }
    async fn delete_slice(&self, n: &str) -> Result<(), ApiError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.api.delete_slice(n).await
    }
    async fn patch_policy_status(&self, n: &str, s: &GpuPolicyStatus) -> Result<(), ApiError> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.api.patch_policy_status(n, s).await
    }
}

#[tokio::test]
async fn of_two_replicas_only_the_lease_holder_writes_until_it_stops_renewing() {
    let (mut cluster, api, lease) = (
        Cluster::two_nodes(),
        InMemoryApi::default(),
        InMemoryLease::default(),
    );
    let mut replicas = [("a", reconciler()), ("b", reconciler())].map(|(id, r)| Replica {
        elector: LeaderElector::new(id, "tessera-system", "tessera-controller"),
        reconciler: r,
    });
    let counters = [
        Counted {
            api: &api,
            writes: AtomicUsize::new(0),
        },
        Counted {
            api: &api,
            writes: AtomicUsize::new(0),
        },
    ];
    let clock = Mutex::new(now());
    let read = || *clock.lock().unwrap();
    for round in 0..20 {
        // Change node-b now and then so the leader has work.
        if round % 5 == 4 {
            let count = 1 + (round / 5) as u32 % 2;
            cluster.inventories[1] = node("node-b")
                .gpus(GpuModel::H200, count)
                .heartbeat_at(read())
                .build();
            cluster.inventories[0] = node("node-a")
                .gpus(GpuModel::H100Sxm5_80gb, 8)
                .heartbeat_at(read())
                .build();
        }
        for (replica, counter) in replicas.iter_mut().zip(&counters) {
            replica
                .tick(&lease, counter, &cluster.snapshot(&api), &read, cluster.mono())
                .await
                .unwrap();
        }
        *clock.lock().unwrap() += Duration::seconds(1);
        cluster.elapsed += 1;
    }
    let (a, b) = (
        counters[0].writes.load(Ordering::SeqCst),
        counters[1].writes.load(Ordering::SeqCst),
    );
    assert!(a > 0 && b == 0, "a wrote {a}, b wrote {b}");
    assert_eq!(lease.holder().as_deref(), Some("a"));

    // "a" stops (crash): "b" waits out the lease as it observed it, then takes over and writes.
    cluster.inventories[1] = node("node-b")
        .gpus(GpuModel::H200, 2)
        .heartbeat_at(read())
        .build();
    let mut took_over_after = None;
    for second in 0..30 {
        let fresh = |n: &str, m, c| node(n).gpus(m, c).heartbeat_at(*clock.lock().unwrap()).build();
        cluster.inventories = vec![
            fresh("node-a", GpuModel::H100Sxm5_80gb, 8),
            fresh("node-b", GpuModel::H200, 1),
        ];
        let before = counters[1].writes.load(Ordering::SeqCst);
        if replicas[1]
            .tick(
                &lease,
                &counters[1],
                &cluster.snapshot(&api),
                &read,
                cluster.mono(),
            )
            .await
            .unwrap()
            .is_some()
            && took_over_after.is_none()
        {
            took_over_after = Some(second);
            assert!(
                counters[1].writes.load(Ordering::SeqCst) > before,
                "the new leader converges the pools"
            );
        }
        assert!(
            !replicas[0].elector.is_leader(read()) || second < 10,
            "a must consider itself deposed"
        );
        *clock.lock().unwrap() += Duration::seconds(1);
        cluster.elapsed += 1;
    }
    // "a" last renewed at t=18 (every 2 s from t=0); "b" saw that record then and takes over once it has
    // stayed unchanged for the 15 s lease duration: t=33, the 13th second of this phase (which starts at 20).
    let t = took_over_after.expect("b takes over");
    assert_eq!(t, 13, "b took over {t}s into the outage");
    assert_eq!(lease.holder().as_deref(), Some("b"));
}

fn policy_with_selector(selector: &str) -> GpuPolicy {
    support::policy(&format!(
        r#"
apiVersion: gpu.tessera.dev/v1alpha1
kind: GpuPolicy
metadata: {{name: default, generation: 3}}
spec:
  rules:
  - name: h100
    selector: '{selector}'
    whole: {{}}
"#
    ))
}

#[tokio::test]
async fn an_invalid_policy_gets_a_condition_naming_the_error_and_publishing_does_not_change() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    cluster.policy = Some(policy_with_selector(
        r#"device.attributes["gpu.tessera.dev"].productName.startsWith("NVIDIA H1")"#,
    ));
    step(&mut r, &mut cluster, &api).await;
    let status = api.policy_status("default").expect("status written");
    assert_eq!(status.conditions[0].reason, REASON_VALID);
    assert_eq!(status.conditions[0].status, "True");
    assert_eq!(status.observed_generation, Some(3));
    let published = api.slices();
    assert_eq!(
        published.len(),
        1 + 3,
        "node-a whole (1 slice), node-b dynamic MIG (1 counter + 2 device slices)"
    );

    for (selector, reason, needle) in [
        (
            r#"device.attributes["gpu.tessera.dev"].productName == "#,
            REASON_CEL_SYNTAX_ERROR,
            "syntax error",
        ),
        (
            r#"device.attributes["gpu.tessera.dev"].index"#,
            REASON_CEL_TYPE_ERROR,
            "must return a bool",
        ),
        (
            r#"device.attributes["gpu.tessera.dev"].vendor == "x""#,
            REASON_CEL_RUNTIME_ERROR,
            "vendor",
        ),
        (
            r#"device.attributes["gpu.tessera.dev"].productName == "NVIDIA H900""#,
            REASON_SELECTS_NOTHING,
            "h100",
        ),
    ] {
        cluster.policy = Some(policy_with_selector(selector));
        let writes = step(&mut r, &mut cluster, &api).await;
        assert_eq!(writes, 1, "{reason}: only the status is written");
        let status = api.policy_status("default").unwrap();
        let c = &status.conditions[0];
        assert_eq!(
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
            ("Valid", "False", reason)
        );
        assert!(c.message.contains(needle), "{reason}: {}", c.message);
        assert_eq!(api.slices(), published, "{reason}: publishing did not change");
        // The stored status now matches: the next round writes nothing.
        cluster.policy.as_mut().unwrap().status = Some(status);
        assert_eq!(
            step(&mut r, &mut cluster, &api).await,
            0,
            "{reason}: no status write loop"
        );
    }
    // Node changes still apply under the last valid policy.
    cluster.nodes.retain(|n| *n != "node-b");
    assert_eq!(step(&mut r, &mut cluster, &api).await, 3);
}

#[tokio::test]
async fn an_invalid_policy_seen_first_freezes_publishing() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    cluster.policy = Some(support::policy(
        "
apiVersion: gpu.tessera.dev/v1alpha1
kind: GpuPolicy
metadata: {name: default}
spec:
  rules:
  - name: two-models
    whole: {}
    shared: {strategy: MPS}
",
    ));
    assert_eq!(step(&mut r, &mut cluster, &api).await, 1, "only the status");
    assert_eq!(
        api.policy_status("default").unwrap().conditions[0].reason,
        REASON_INVALID_MODEL
    );
    assert!(api.slices().is_empty());
}

#[tokio::test]
async fn a_static_layout_that_does_not_fit_a_gpu_is_an_invalid_model() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    cluster.policy = Some(support::policy(
        "
apiVersion: gpu.tessera.dev/v1alpha1
kind: GpuPolicy
metadata: {name: default}
spec:
  rules:
  - name: overlapping
    staticMig: {layout: ['3g@0', '4g@0']}
",
    ));
    step(&mut r, &mut cluster, &api).await;
    let c = &api.policy_status("default").unwrap().conditions[0];
    assert_eq!(c.reason, REASON_INVALID_MODEL);
    assert!(c.message.contains("overlap"), "{}", c.message);
}

#[tokio::test]
async fn the_cache_keeps_of_a_slice_what_the_diff_reads_and_drops_its_devices() {
    let (mut cluster, api) = (Cluster::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&cluster, &api);
    steps(2, &mut r, &mut cluster, &api).await;
    let full = api.slices();
    assert!(
        full.iter()
            .any(|s| s.spec.devices.as_ref().is_some_and(|d| !d.is_empty())),
        "the fixture publishes devices"
    );
    for original in full {
        let mut cached = original.clone();
        trim_to_what_diff_reads(&mut cached);
        assert_eq!(cached.spec.devices, None);
        assert_eq!(cached.spec.shared_counters, None);
        assert_eq!(cached.metadata.name, original.metadata.name);
        assert_eq!(
            cached.metadata.resource_version,
            original.metadata.resource_version
        );
        assert_eq!(cached.metadata.annotations, original.metadata.annotations);
        assert_eq!(cached.spec.pool, original.spec.pool);
        assert_eq!(cached.spec.driver, original.spec.driver);
        assert_eq!(cached.spec.node_name, original.spec.node_name);
        let (size_full, size_cached) = (
            serde_json::to_vec(&original).unwrap().len(),
            serde_json::to_vec(&cached).unwrap().len(),
        );
        assert!(
            size_cached * 10 < size_full || original.spec.devices.is_none(),
            "{}: cached {size_cached} bytes of {size_full}",
            original.metadata.name.as_deref().unwrap_or_default()
        );
    }
    assert_eq!(
        step(&mut r, &mut cluster, &api).await,
        0,
        "nothing changed, nothing written"
    );
}

/// A [`ClusterApi`] whose every write takes a second of the shared clock, as slice writes do on a loaded
/// API server during a start on a large cluster.
struct Slow<'a> {
    api: &'a InMemoryApi,
    clock: &'a Mutex<DateTime<Utc>>,
}

impl Slow<'_> {
    fn tick(&self) {
        *self.clock.lock().unwrap() += Duration::seconds(1);
    }
}

impl ClusterApi for Slow<'_> {
    async fn create_slice(&self, s: &ResourceSlice) -> Result<(), ApiError> {
        self.tick();
        self.api.create_slice(s).await
    }
    async fn replace_slice(&self, s: &ResourceSlice) -> Result<(), ApiError> {
        self.tick();
        self.api.replace_slice(s).await
    }
    async fn delete_slice(&self, n: &str) -> Result<(), ApiError> {
        self.tick();
        self.api.delete_slice(n).await
    }
    async fn patch_policy_status(&self, n: &str, s: &GpuPolicyStatus) -> Result<(), ApiError> {
        self.tick();
        self.api.patch_policy_status(n, s).await
    }
}

#[tokio::test]
async fn a_leader_whose_publish_outlasts_the_renew_deadline_renews_between_writes_and_finishes_it() {
    let (mut cluster, api, lease) = (
        Cluster::two_nodes(),
        InMemoryApi::default(),
        InMemoryLease::default(),
    );
    let clock = Mutex::new(now());
    let read = || *clock.lock().unwrap();
    let mut replica = Replica {
        elector: LeaderElector::new("a", "tessera-system", "tessera-controller"),
        reconciler: reconciler_for(&cluster, &api),
    };
    // One heartbeat later, so every pool is published rather than held.
    cluster.elapsed += 1;
    let slow = Slow {
        api: &api,
        clock: &clock,
    };
    let started = read();
    let decision = replica
        .tick(&lease, &slow, &cluster.snapshot(&api), &read, cluster.mono())
        .await
        .unwrap()
        .expect("the only replica leads");
    assert!(!decision.interrupted, "the gate never refused a write");
    let plan = decision.plan.expect("a valid policy");
    let writes = plan.creates.len() + plan.updates.len() + plan.deletes.len();
    let took = read() - started;
    assert!(
        writes > 10,
        "the fixture must need more than the 10 s renew deadline of writes, plans {writes}"
    );
    assert_eq!(
        api.slices().len(),
        writes,
        "every slice of the plan is written in one round (took {} s)",
        took.num_seconds()
    );
    assert!(
        replica.elector.is_leader(read()),
        "the lease was renewed on the way"
    );
    let mut other = LeaderElector::new("b", "tessera-system", "tessera-controller");
    assert!(
        !other.try_acquire_or_renew(&lease, read()).await,
        "the renewed lease keeps another replica out"
    );
}
