//! A policy change under running claims, through the reconcile loop against the in-memory API server:
//! the allocated devices the new policy drops stay published (with the counters they consume) until their
//! claims are released, so kube-scheduler, which counts only the devices it finds in the current slices
//! (kubernetes/kubernetes#140802), never sees their memory slices or their GPU as free.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration as StdDuration, Instant},
};

use chrono::{DateTime, Duration, Utc};
use k8s_openapi::{
    api::resource::v1::{Device, ResourceSlice},
    apimachinery::pkg::apis::meta::v1::Time,
};
use tessera_api::{NodeInventory, policy::GpuPolicy};
use tessera_controller::{
    features::ApiFeatures,
    fixtures::{GpuModel, fixed_time, node},
    liveness::{Liveness, View},
    pool::NodeRef,
    pool_diff::trim_to_what_diff_reads,
    publisher::{InMemoryApi, Reconciler, Snapshot},
    retain::RETAINED_TAINT,
    time::to_k8s_time,
};

/// The e2e cluster's policy: GPU 1 shared, the others dynamic MIG.
const BEFORE: &str = r#"
metadata: {name: default, uid: p, generation: 1}
spec:
  rules:
  - name: gpu-1-shared
    optional: true
    selector: device.attributes["gpu.tessera.dev"].index == 1
    shared: {strategy: MPS, memoryStep: 1Gi, fallbackSlots: 4}
  - name: dynamic-mig
    dynamicMig: {}
"#;

/// Only 1g placements on MIG GPUs, and GPU 1 whole: drops a running 3g placement and a running share.
const AFTER: &str = r#"
metadata: {name: default, uid: p, generation: 2}
spec:
  rules:
  - name: gpu-1-whole
    optional: true
    selector: device.attributes["gpu.tessera.dev"].index == 1
    whole: {}
  - name: dynamic-mig
    dynamicMig: {profiles: ["1g.10gb"]}
"#;

const MIG: &str = "gpu-0-mig-3g-40gb-4";
const SHARE: &str = "gpu-1-shared";

/// One node with two H100s whose plugin heartbeats every step.
struct Cluster {
    inventory: NodeInventory,
    policy: GpuPolicy,
    allocated: BTreeSet<String>,
    start: Instant,
    elapsed: u64,
}

impl Cluster {
    fn new() -> Self {
        Self {
            inventory: node("node-a").gpus(GpuModel::H100Sxm5_80gb, 2).build(),
            policy: policy(BEFORE),
            allocated: BTreeSet::new(),
            start: Instant::now(),
            elapsed: 0,
        }
    }

    fn holding(mut self, devices: &[&str]) -> Self {
        self.allocated = devices.iter().map(|d| d.to_string()).collect();
        self
    }

    fn mono(&self) -> Instant {
        self.start + StdDuration::from_secs(self.elapsed)
    }

    fn wall(&self) -> DateTime<Utc> {
        fixed_time() + Duration::seconds(self.elapsed as i64)
    }

    fn snapshot(&self, api: &InMemoryApi) -> Snapshot {
        let mut inv = self.inventory.clone();
        inv.status.as_mut().unwrap().last_heartbeat_time = Some(Time(to_k8s_time(self.wall())));
        Snapshot {
            inventories: vec![inv],
            node_leases: Default::default(),
            inventory_view: View::Synced { list: 1 },
            nodes: [(
                "node-a".to_string(),
                NodeRef {
                    name: "node-a".into(),
                    uid: Some("uid-a".into()),
                },
            )]
            .into(),
            policy: Some(self.policy.clone()),
            // As the runtime's cache holds them: without devices.
            slices: api
                .slices()
                .into_iter()
                .map(|mut s| {
                    trim_to_what_diff_reads(&mut s);
                    s
                })
                .collect(),
            allocated: [("node-a".to_string(), self.allocated.clone())].into(),
        }
    }
}

fn policy(yaml: &str) -> GpuPolicy {
    serde_norway::from_str(yaml).expect("a valid GpuPolicy")
}

fn reconciler(cluster: &Cluster, api: &InMemoryApi) -> Reconciler {
    let mut r = Reconciler::new(
        ApiFeatures::ALL,
        Liveness::new(StdDuration::from_secs(40), StdDuration::from_secs(30)),
    );
    r.observe(&cluster.snapshot(api), cluster.mono());
    r
}

/// Advances the clock a second, reconciles, returns the number of writes.
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
    // The policy's status as the watch would show it next.
    cluster.policy.status = api.policy_status("default");
    api.writes() - before
}

fn devices(api: &InMemoryApi) -> Vec<Device> {
    api.slices()
        .into_iter()
        .flat_map(|s: ResourceSlice| s.spec.devices.unwrap_or_default())
        .collect()
}

fn names(api: &InMemoryApi, gpu: u32) -> Vec<String> {
    let prefix = format!("gpu-{gpu}");
    devices(api)
        .into_iter()
        .map(|d| d.name)
        .filter(|n| *n == prefix || n.starts_with(&format!("{prefix}-")))
        .collect()
}

fn is_retained(d: &Device) -> bool {
    d.taints.iter().flatten().any(|t| t.key == RETAINED_TAINT)
}

/// What kube-scheduler counts as consumed, per (counter set, counter): the consumption of every allocated
/// device it finds in the slices, as published there.
fn consumed(api: &InMemoryApi, allocated: &BTreeSet<String>) -> BTreeMap<(String, String), usize> {
    let mut out = BTreeMap::new();
    for d in devices(api).iter().filter(|d| allocated.contains(&d.name)) {
        for c in d.consumes_counters.iter().flatten() {
            for k in c.counters.keys() {
                *out.entry((c.counter_set.clone(), k.clone())).or_default() += 1;
            }
        }
    }
    out
}

/// The counter sets the slices publish.
fn counter_sets(api: &InMemoryApi) -> BTreeSet<String> {
    api.slices()
        .into_iter()
        .flat_map(|s| s.spec.shared_counters.unwrap_or_default())
        .map(|c| c.name)
        .collect()
}

#[tokio::test]
async fn a_policy_change_keeps_a_running_mig_placement_and_share_published_until_their_claims_are_released() {
    let mut cluster = Cluster::new().holding(&[MIG, SHARE]);
    let api = InMemoryApi::default();
    let mut r = reconciler(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    let before = consumed(&api, &cluster.allocated);
    let memory_slices: Vec<(String, String)> = (4..8)
        .map(|k| ("gpu-0-counters".to_string(), format!("memory-slice-{k}")))
        .collect();
    assert!(
        memory_slices.iter().all(|k| before.get(k) == Some(&1)),
        "{before:?}"
    );
    assert_eq!(names(&api, 1), [SHARE]);

    cluster.policy = policy(AFTER);
    assert!(step(&mut r, &mut cluster, &api).await > 0);
    // The scheduler still sees the 3g placement's memory slices taken, against a counter set that exists.
    assert_eq!(consumed(&api, &cluster.allocated), before);
    assert!(counter_sets(&api).contains("gpu-0-counters"));
    let gpu0 = names(&api, 0);
    assert!(
        gpu0.iter().any(|n| n.starts_with("gpu-0-mig-1g-10gb-")),
        "the new profiles are offered: {gpu0:?}"
    );
    assert!(
        !gpu0.iter().any(|n| n.contains("-2g-") || n.contains("-4g-")),
        "{gpu0:?}"
    );
    // GPU 1 offers nothing new while the share runs: its whole device would hand the GPU out again.
    assert_eq!(names(&api, 1), [SHARE]);
    let kept: Vec<String> = devices(&api)
        .into_iter()
        .filter(is_retained)
        .map(|d| d.name)
        .collect();
    assert_eq!(kept, [MIG, SHARE]);
    assert_eq!(
        r.render_cache().retained().collect::<Vec<_>>(),
        [("node-a", &[MIG.to_string(), SHARE.to_string()][..])]
    );
    assert_eq!(
        step(&mut r, &mut cluster, &api).await,
        0,
        "steady while the claims run"
    );

    // A restarted controller has nothing in memory: it keeps them from the claims alone, writing nothing.
    let mut restarted = reconciler(&cluster, &api);
    assert_eq!(step(&mut restarted, &mut cluster, &api).await, 0);

    // The share's pod ends: GPU 1 takes the new model; the MIG placement stays.
    cluster.allocated.remove(SHARE);
    assert!(step(&mut restarted, &mut cluster, &api).await > 0);
    assert_eq!(names(&api, 1), ["gpu-1"]);
    assert!(names(&api, 0).contains(&MIG.to_string()));

    cluster.allocated.clear();
    assert!(step(&mut restarted, &mut cluster, &api).await > 0);
    assert!(!names(&api, 0).contains(&MIG.to_string()));
    assert!(devices(&api).iter().all(|d| !is_retained(d)));
    assert!(restarted.render_cache().retained().next().is_none());
}

#[tokio::test]
async fn a_policy_change_with_nothing_allocated_publishes_the_new_model_at_once() {
    let mut cluster = Cluster::new();
    let api = InMemoryApi::default();
    let mut r = reconciler(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    cluster.policy = policy(AFTER);
    step(&mut r, &mut cluster, &api).await;
    assert_eq!(names(&api, 1), ["gpu-1"]);
    assert!(!names(&api, 0).iter().any(|n| n.contains("-3g-")));
    assert!(devices(&api).iter().all(|d| !is_retained(d)));
}

#[tokio::test]
async fn a_claim_on_a_device_the_policy_keeps_changes_no_pool() {
    let mut cluster = Cluster::new();
    let api = InMemoryApi::default();
    let mut r = reconciler(&cluster, &api);
    step(&mut r, &mut cluster, &api).await;
    let renders = r.render_cache().renders();
    cluster.allocated = [MIG.to_string()].into();
    assert_eq!(step(&mut r, &mut cluster, &api).await, 0);
    cluster.allocated.clear();
    assert_eq!(step(&mut r, &mut cluster, &api).await, 0);
    assert_eq!(
        r.render_cache().renders(),
        renders,
        "no pool rendered again for claims alone"
    );
}
