//! Issue 15: the reconciler renders a node's slices only when what they are rendered from changed or its
//! pool has to be written, and plans exactly the writes that rendering every pool on every tick planned.

mod support;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Mutex,
    time::{Duration as StdDuration, Instant},
};

use chrono::{DateTime, Duration, Utc};
use k8s_openapi::{api::resource::v1::ResourceSlice, apimachinery::pkg::apis::meta::v1::Time};
use tessera_api::{
    NodeInventory,
    policy::{GpuPolicy, GpuPolicyStatus},
};
use tessera_controller::{
    devices::Model,
    features::ApiFeatures,
    fixtures::{GpuModel, fixed_time, gpu, node},
    liveness::{Liveness, Verdict, View},
    policy::Assignments,
    pool::NodeRef,
    pool_diff::{
        Generations, Inputs, Plan, RenderCache, desired_pools, diff, diff_cached, held_pools,
        trim_to_what_diff_reads,
    },
    publisher::{ApiError, ClusterApi, InMemoryApi, Reconciler, Snapshot},
    time::to_k8s_time,
};

/// Nodes, their inventories and the controller's clocks; every plugin heartbeats each step.
struct World {
    inventories: Vec<NodeInventory>,
    nodes: Vec<&'static str>,
    policy: Option<GpuPolicy>,
    start: Instant,
    elapsed: u64,
}

impl World {
    fn with(inventories: Vec<NodeInventory>) -> Self {
        let nodes = ["node-a", "node-b", "node-c"]
            .into_iter()
            .filter(|n| inventories.iter().any(|i| i.spec.node_name == *n))
            .collect();
        Self {
            inventories,
            nodes,
            policy: None,
            start: Instant::now(),
            elapsed: 0,
        }
    }

    fn two_nodes() -> Self {
        Self::with(vec![
            node("node-a").gpus(GpuModel::H100Sxm5_80gb, 8).build(),
            node("node-b").gpus(GpuModel::H200, 2).build(),
        ])
    }

    fn wall(&self) -> DateTime<Utc> {
        fixed_time() + Duration::seconds(5 + self.elapsed as i64)
    }

    fn mono(&self) -> Instant {
        self.start + StdDuration::from_secs(self.elapsed)
    }

    fn node_refs(&self) -> BTreeMap<String, NodeRef> {
        self.nodes
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
            .collect()
    }

    /// The inventories with this second's heartbeat, which is a status change only.
    fn beating(&self) -> Vec<NodeInventory> {
        self.inventories
            .iter()
            .map(|inv| {
                let mut inv = inv.clone();
                let at = fixed_time() + Duration::seconds(self.elapsed as i64);
                inv.status.as_mut().unwrap().last_heartbeat_time = Some(Time(to_k8s_time(at)));
                inv
            })
            .collect()
    }

    fn snapshot(&self, api: &InMemoryApi) -> Snapshot {
        Snapshot {
            inventories: self.beating(),
            node_leases: Default::default(),
            inventory_view: View::Synced { list: 1 },
            nodes: self.node_refs(),
            policy: self.policy.clone(),
            slices: cached(api),
            allocated: Default::default(),
        }
    }
}

/// The slices as the runtime's cache holds them.
fn cached(api: &InMemoryApi) -> Vec<ResourceSlice> {
    api.slices()
        .into_iter()
        .map(|mut s| {
            trim_to_what_diff_reads(&mut s);
            s
        })
        .collect()
}

/// A reconciler that has listed the world once, so the next heartbeats count as renewals.
fn reconciler_for(world: &World, api: &InMemoryApi) -> Reconciler {
    let mut r = Reconciler::new(
        ApiFeatures::ALL,
        Liveness::new(StdDuration::from_secs(40), StdDuration::from_secs(30)),
    );
    r.observe(&world.snapshot(api), world.mono());
    r
}

/// One second on, one reconcile; the number of writes.
async fn step(r: &mut Reconciler, world: &mut World, api: &InMemoryApi) -> usize {
    world.elapsed += 1;
    let before = api.writes();
    r.reconcile(&world.snapshot(api), api, world.wall(), world.mono(), &|| true)
        .await
        .expect("in-memory writes succeed");
    api.writes() - before
}

fn renders(r: &Reconciler) -> u64 {
    r.render_cache().renders()
}

/// An inventory as read from an API server: with uid and generation.
fn stored(mut inv: NodeInventory, generation: i64) -> NodeInventory {
    inv.metadata.uid = Some(format!("inv-uid-{}", inv.spec.node_name));
    inv.metadata.generation = Some(generation);
    inv
}

async fn apply(api: &InMemoryApi, plan: &Plan) {
    for s in &plan.creates {
        api.create_slice(s).await.unwrap();
    }
    for s in &plan.updates {
        api.replace_slice(s).await.unwrap();
    }
    for n in &plan.deletes {
        api.delete_slice(n).await.unwrap();
    }
}

#[tokio::test]
async fn an_unchanged_pool_is_not_rendered_again() {
    let (mut world, api) = (World::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&world, &api);
    assert_eq!(step(&mut r, &mut world, &api).await, 9 + 3);
    assert_eq!(
        renders(&r),
        2,
        "each node once: the render that gave the hashes is the one written"
    );
    for second in 0..10 {
        assert_eq!(step(&mut r, &mut world, &api).await, 0, "second {second}");
    }
    assert_eq!(renders(&r), 2, "ten heartbeats later: no pool rendered again");
}

#[tokio::test]
async fn a_changed_inventory_re_renders_only_that_node() {
    let (mut world, api) = (World::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&world, &api);
    step(&mut r, &mut world, &api).await;
    let a_before: Vec<ResourceSlice> = api
        .slices()
        .into_iter()
        .filter(|s| s.spec.pool.name == "node-a")
        .collect();
    world.inventories[1] = node("node-b")
        .gpus(GpuModel::H200, 1)
        .gpu(gpu(GpuModel::H200, 1).on_node("node-b").unhealthy().build())
        .build();
    assert_eq!(step(&mut r, &mut world, &api).await, 3, "node-b's three slices");
    assert_eq!(renders(&r), 3, "node-b once more, node-a not");
    let a_after: Vec<ResourceSlice> = api
        .slices()
        .into_iter()
        .filter(|s| s.spec.pool.name == "node-a")
        .collect();
    assert_eq!(a_after, a_before);
    assert_eq!(step(&mut r, &mut world, &api).await, 0);
    assert_eq!(renders(&r), 3);
}

#[tokio::test]
async fn a_pool_kubelet_deleted_is_rendered_again_only_to_be_rewritten() {
    let (mut world, api) = (World::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&world, &api);
    step(&mut r, &mut world, &api).await;
    api.delete_where(|s| s.spec.node_name.as_deref() == Some("node-a"));
    assert_eq!(step(&mut r, &mut world, &api).await, 9);
    assert_eq!(
        renders(&r),
        3,
        "node-a's inventory did not change, its slices were needed in full"
    );
    assert_eq!(step(&mut r, &mut world, &api).await, 0);
    assert_eq!(renders(&r), 3);
}

#[tokio::test]
async fn a_policy_change_renders_and_rewrites_every_pool_once() {
    let (mut world, api) = (World::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&world, &api);
    step(&mut r, &mut world, &api).await;
    world.policy = Some(support::policy(
        r#"
apiVersion: gpu.tessera.dev/v1alpha1
kind: GpuPolicy
metadata: {name: default, generation: 1}
spec:
  rules:
  - name: all
    whole: {}
"#,
    ));
    // Per pool the first slice is updated, the others deleted (9 + 3), plus the policy's status.
    assert_eq!(step(&mut r, &mut world, &api).await, 9 + 3 + 1);
    assert_eq!(renders(&r), 4, "both nodes under their new models");
    assert_eq!(api.slices().len(), 2, "one whole-GPU slice per node");
    // As the policy watch would show it: with the status just written.
    world.policy.as_mut().unwrap().status = api.policy_status("default");
    assert_eq!(step(&mut r, &mut world, &api).await, 0);
    assert_eq!(renders(&r), 4);
}

#[tokio::test]
async fn a_held_pool_is_not_rendered() {
    let (mut world, api) = (World::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&world, &api);
    step(&mut r, &mut world, &api).await;
    // A restarted controller holds every pool until it sees a heartbeat change.
    let mut restarted = Reconciler::new(
        ApiFeatures::ALL,
        Liveness::new(StdDuration::from_secs(40), StdDuration::from_secs(30)),
    );
    let decision = restarted.decide(&world.snapshot(&api), world.wall(), world.mono());
    assert_eq!(decision.plan, Some(Plan::default()));
    assert_eq!(
        decision.held,
        BTreeSet::from(["node-a".to_string(), "node-b".to_string()])
    );
    assert_eq!(renders(&restarted), 0);
    assert_eq!(
        step(&mut restarted, &mut world, &api).await,
        0,
        "heartbeats seen changing"
    );
    assert_eq!(renders(&restarted), 2, "each node once, to learn it is unchanged");
}

#[tokio::test]
async fn the_entry_of_a_node_that_vanished_is_removed_from_the_cache() {
    let (mut world, api) = (World::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&world, &api);
    step(&mut r, &mut world, &api).await;
    assert_eq!(r.render_cache().nodes().collect::<Vec<_>>(), ["node-a", "node-b"]);
    world.nodes.retain(|n| *n != "node-b");
    assert_eq!(step(&mut r, &mut world, &api).await, 3, "node-b withdrawn");
    assert_eq!(r.render_cache().nodes().collect::<Vec<_>>(), ["node-a"]);
    world.inventories.retain(|i| i.spec.node_name != "node-a");
    assert_eq!(step(&mut r, &mut world, &api).await, 9, "node-a withdrawn");
    assert_eq!(r.render_cache().nodes().count(), 0);
}

#[tokio::test]
async fn a_stored_inventory_is_rendered_again_when_its_generation_or_uid_changes_not_on_heartbeats() {
    let mut world = World::with(vec![
        stored(node("node-a").gpus(GpuModel::H100Sxm5_80gb, 8).build(), 1),
        stored(node("node-b").gpus(GpuModel::H200, 2).build(), 1),
    ]);
    let api = InMemoryApi::default();
    let mut r = reconciler_for(&world, &api);
    step(&mut r, &mut world, &api).await;
    for _ in 0..3 {
        assert_eq!(step(&mut r, &mut world, &api).await, 0);
    }
    assert_eq!(renders(&r), 2);
    // A spec change: the API server bumps the generation (status subresource).
    world.inventories[1] = stored(node("node-b").gpus(GpuModel::H200, 1).build(), 2);
    assert_eq!(
        step(&mut r, &mut world, &api).await,
        2 + 1,
        "two slices rewritten, the third deleted"
    );
    assert_eq!(renders(&r), 3);
    // Deleted and recreated with the same spec: a new uid at generation 1.
    let mut recreated = stored(node("node-a").gpus(GpuModel::H100Sxm5_80gb, 8).build(), 1);
    recreated.metadata.uid = Some("inv-uid-node-a-2".into());
    world.inventories[0] = recreated;
    assert_eq!(
        step(&mut r, &mut world, &api).await,
        0,
        "same slices, nothing written"
    );
    assert_eq!(renders(&r), 4, "rendered to find that out");
}

/// The cache must not change a single write: the same plans as `diff` of every pool rendered.
#[tokio::test]
async fn the_cached_diff_plans_the_writes_that_rendering_every_pool_plans() {
    let mut world = World::with(vec![
        node("node-a").gpus(GpuModel::H100Sxm5_80gb, 8).build(),
        node("node-b").gpus(GpuModel::H200, 2).build(),
        node("node-c")
            .mig_gpus(GpuModel::A100Sxm4_80gb, 2)
            .gpus(GpuModel::B200, 2)
            .build(),
    ]);
    let api = InMemoryApi::default();
    let mut assignments = Assignments::new();
    let (mut every, mut cached_gens, mut cache) =
        (Generations::new(), Generations::new(), RenderCache::default());
    let held = BTreeSet::new();
    let mut features = ApiFeatures::ALL;
    let mut total_writes = 0;
    for round in 0..8 {
        match round {
            2 => {
                world.inventories[1] = node("node-b")
                    .gpus(GpuModel::H200, 1)
                    .gpu(gpu(GpuModel::H200, 1).on_node("node-b").unhealthy().build())
                    .build()
            }
            3 => api.delete_where(|s| s.metadata.name.as_deref() == Some("node-a-gpu.tessera.dev-3")),
            4 => {
                assignments.insert(("node-c".into(), 0), Model::Whole);
            }
            5 => world.nodes.retain(|n| *n != "node-b"),
            6 => features = ApiFeatures::NONE,
            _ => {}
        }
        let nodes = world.node_refs();
        let inventories = world.beating();
        let verdict = |_: &str| Verdict::Publish;
        let inputs = Inputs {
            inventories: &inventories,
            nodes: &nodes,
            assignments: &assignments,
            features,
            verdict: &verdict,
            health: &|_: &str| Default::default(),
            allocated: &Default::default(),
        };
        let existing = cached(&api);
        let held_now = held_pools(&inputs, &existing);
        assert_eq!(held_now, held, "nothing held: every verdict is publish");
        let desired = desired_pools(&inputs);
        let by_rendering = diff(&desired, &existing, &held, &mut every);
        let (by_cache, names) = diff_cached(&inputs, &existing, &held, &mut cached_gens, &mut cache);
        assert_eq!(by_cache, by_rendering, "round {round}");
        assert_eq!(
            names,
            desired.keys().cloned().collect::<BTreeSet<_>>(),
            "round {round}"
        );
        assert_eq!(cached_gens, every, "round {round}");
        total_writes += by_cache.writes();
        apply(&api, &by_cache).await;
    }
    assert!(total_writes > 9 + 3 + 9, "the rounds did write: {total_writes}");
}

/// A [`ClusterApi`] that records the pool of every slice write, in order.
struct Recording<'a> {
    api: &'a InMemoryApi,
    pools: Mutex<Vec<String>>,
}

impl Recording<'_> {
    fn record(&self, pool: &str) {
        self.pools.lock().unwrap().push(pool.to_string());
    }
}

impl ClusterApi for Recording<'_> {
    async fn create_slice(&self, s: &ResourceSlice) -> Result<(), ApiError> {
        self.record(&s.spec.pool.name);
        self.api.create_slice(s).await
    }
    async fn replace_slice(&self, s: &ResourceSlice) -> Result<(), ApiError> {
        self.record(&s.spec.pool.name);
        self.api.replace_slice(s).await
    }
    async fn delete_slice(&self, n: &str) -> Result<(), ApiError> {
        self.record(n.split("-gpu.tessera.dev-").next().unwrap_or_default());
        self.api.delete_slice(n).await
    }
    async fn patch_policy_status(&self, n: &str, s: &GpuPolicyStatus) -> Result<(), ApiError> {
        self.api.patch_policy_status(n, s).await
    }
}

/// Writing pool after pool is what lets the reconciler render one pool, write it and drop its devices
/// before rendering the next, instead of holding every changed pool's devices at once.
#[tokio::test]
async fn a_policy_change_writes_pool_after_pool_then_the_deletes_and_the_decision_keeps_no_devices() {
    let (mut world, api) = (World::two_nodes(), InMemoryApi::default());
    let mut r = reconciler_for(&world, &api);
    step(&mut r, &mut world, &api).await;
    r.features = ApiFeatures::NONE;
    world.elapsed += 1;
    let recording = Recording {
        api: &api,
        pools: Default::default(),
    };
    let decision = r
        .reconcile(
            &world.snapshot(&api),
            &recording,
            world.wall(),
            world.mono(),
            &|| true,
        )
        .await
        .unwrap();
    let pools = recording.pools.into_inner().unwrap();
    let mut expected = vec!["node-a".to_string(), "node-b".to_string()];
    expected.extend(vec!["node-a".to_string(); 8]);
    expected.extend(vec!["node-b".to_string(); 2]);
    assert_eq!(
        pools, expected,
        "node-a's update, node-b's update, then the deletes: every pool complete after one write each"
    );
    let plan = decision.plan.expect("a valid policy");
    assert_eq!(plan.writes(), 9 + 3);
    assert!(
        plan.creates
            .iter()
            .chain(&plan.updates)
            .all(|s| s.spec.devices.is_none() && s.spec.shared_counters.is_none()),
        "written slices are trimmed to what the diff reads"
    );
    assert!(
        plan.updates
            .iter()
            .all(|s| s.metadata.annotations.is_some() && s.spec.pool.generation == 2),
        "what the runtime waits for in its cache is kept"
    );
}
