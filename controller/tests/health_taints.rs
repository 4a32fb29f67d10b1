//! Health taints through the reconcile loop against the in-memory API server: a GPU the plugin reports
//! sick is tainted on every device carved from it, the taint stays for the quiet period after the GPU is
//! reported healthy (on the controller's clock), and without device taints the GPU is left out.

use std::time::{Duration as StdDuration, Instant};

use chrono::{DateTime, Duration, Utc};
use k8s_openapi::{
    api::resource::v1::{Device, ResourceSlice},
    apimachinery::pkg::apis::meta::v1::Time,
};
use tessera_api::{
    NodeInventory,
    inventory::{DeviceHealth, HealthReason, MigDeviceRef},
    policy::GpuPolicy,
};
use tessera_controller::{
    features::ApiFeatures,
    fixtures::{GpuModel, fixed_time, node, sick},
    liveness::{Liveness, View},
    pool::NodeRef,
    publisher::{InMemoryApi, Reconciler, Snapshot},
    time::to_k8s_time,
};

/// One node with two H200s whose plugin heartbeats every step, reporting `health`.
struct Cluster {
    inventory: NodeInventory,
    health: Vec<DeviceHealth>,
    policy: Option<GpuPolicy>,
    start: Instant,
    elapsed: u64,
}

impl Cluster {
    fn new() -> Self {
        Self {
            inventory: node("node-a").gpus(GpuModel::H200, 2).build(),
            health: vec![],
            policy: None,
            start: Instant::now(),
            elapsed: 0,
        }
    }

    fn with_policy(mut self, yaml: &str) -> Self {
        self.policy = Some(serde_norway::from_str(yaml).expect("a valid GpuPolicy"));
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
        let status = inv.status.as_mut().unwrap();
        status.last_heartbeat_time = Some(Time(to_k8s_time(self.wall())));
        status.health = self.health.clone();
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
            policy: self.policy.clone(),
            slices: api.slices(),
            allocated: Default::default(),
        }
    }
}

fn reconciler(cluster: &Cluster, api: &InMemoryApi, features: ApiFeatures) -> Reconciler {
    let mut r = Reconciler::new(
        features,
        Liveness::new(StdDuration::from_secs(40), StdDuration::from_secs(30)),
    );
    r.observe(&cluster.snapshot(api), cluster.mono());
    r
}

/// Advances the clock by `secs`, reconciles, returns the number of writes.
async fn step(secs: u64, r: &mut Reconciler, cluster: &mut Cluster, api: &InMemoryApi) -> usize {
    cluster.elapsed += secs;
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

fn devices(api: &InMemoryApi) -> Vec<Device> {
    api.slices()
        .into_iter()
        .flat_map(|s: ResourceSlice| s.spec.devices.unwrap_or_default())
        .collect()
}

/// `(key, value, effect)` of every taint on devices of GPU `gpu`, and how many devices carry it.
fn taints_of(api: &InMemoryApi, gpu: u32) -> (usize, Vec<(String, Option<String>, String)>) {
    let prefix = format!("gpu-{gpu}");
    let of_gpu: Vec<Device> = devices(api)
        .into_iter()
        .filter(|d| d.name == prefix || d.name.starts_with(&format!("{prefix}-")))
        .collect();
    let tainted = of_gpu.iter().filter(|d| d.taints.is_some()).count();
    let mut all: Vec<_> = of_gpu
        .iter()
        .flat_map(|d| d.taints.iter().flatten())
        .map(|t| (t.key.clone(), t.value.clone(), t.effect.clone()))
        .collect();
    all.sort();
    all.dedup();
    (tainted, all)
}

#[tokio::test]
async fn an_xid_taints_every_device_of_the_gpu_and_recovery_clears_it_after_the_quiet_period() {
    let mut cluster =
        Cluster::new().with_policy("metadata: {name: default}\nspec: {health: {quietPeriod: 20s}}");
    let api = InMemoryApi::default();
    let mut r = reconciler(&cluster, &api, ApiFeatures::ALL);
    step(1, &mut r, &mut cluster, &api).await;
    assert_eq!(taints_of(&api, 1).0, 0);

    cluster.health = vec![sick(1, HealthReason::Xid, Some(79))];
    assert!(step(1, &mut r, &mut cluster, &api).await > 0);
    let (tainted, taints) = taints_of(&api, 1);
    assert_eq!(tainted, 26, "the whole GPU and its 25 MIG placements");
    assert_eq!(
        taints,
        [(
            "gpu.tessera.dev/xid".into(),
            Some("79".into()),
            "NoSchedule".into()
        )]
    );
    assert_eq!(taints_of(&api, 0).0, 0, "the other GPU is untouched");

    cluster.health = vec![];
    step(1, &mut r, &mut cluster, &api).await;
    step(18, &mut r, &mut cluster, &api).await;
    assert_eq!(
        taints_of(&api, 1).0,
        26,
        "19 s after recovery: inside the quiet period"
    );
    assert!(step(1, &mut r, &mut cluster, &api).await > 0);
    assert_eq!(taints_of(&api, 1).0, 0, "20 s after recovery the taint is gone");
    let before = api.slices();
    step(1, &mut r, &mut cluster, &api).await;
    assert_eq!(api.slices(), before, "and no slice is written again");
}

#[tokio::test]
async fn a_lost_gpu_is_no_execute_and_the_policy_can_change_each_effect() {
    let mut cluster = Cluster::new();
    let api = InMemoryApi::default();
    let mut r = reconciler(&cluster, &api, ApiFeatures::ALL);
    cluster.health = vec![sick(0, HealthReason::GpuLost, None)];
    step(1, &mut r, &mut cluster, &api).await;
    assert_eq!(
        taints_of(&api, 0).1,
        [("gpu.tessera.dev/gpu-lost".into(), None, "NoExecute".into())]
    );
    cluster.policy = Some(
        serde_norway::from_str("metadata: {name: default}\nspec: {health: {taints: {gpuLost: NoSchedule}}}")
            .unwrap(),
    );
    step(1, &mut r, &mut cluster, &api).await;
    assert_eq!(taints_of(&api, 0).1[0].2, "NoSchedule");
}

#[tokio::test]
async fn a_mig_device_failure_taints_only_that_placement() {
    let mut cluster = Cluster::new();
    let api = InMemoryApi::default();
    let mut r = reconciler(&cluster, &api, ApiFeatures::ALL);
    let mut entry = sick(1, HealthReason::Xid, Some(94));
    entry.mig = Some(MigDeviceRef {
        profile: "3g.71gb".into(),
        start: 4,
    });
    cluster.health = vec![entry];
    step(1, &mut r, &mut cluster, &api).await;
    let tainted: Vec<String> = devices(&api)
        .into_iter()
        .filter(|d| d.taints.is_some())
        .map(|d| d.name)
        .collect();
    assert_eq!(tainted, ["gpu-1-mig-3g-71gb-4"]);
}

#[tokio::test]
async fn without_device_taints_a_sick_gpu_is_left_out_until_it_recovers() {
    let mut cluster =
        Cluster::new().with_policy("metadata: {name: default}\nspec: {health: {quietPeriod: 0s}}");
    let api = InMemoryApi::default();
    let mut r = reconciler(&cluster, &api, ApiFeatures::NONE);
    step(1, &mut r, &mut cluster, &api).await;
    let names = |api: &InMemoryApi| devices(api).into_iter().map(|d| d.name).collect::<Vec<_>>();
    assert_eq!(names(&api), ["gpu-0", "gpu-1"]);
    cluster.health = vec![sick(1, HealthReason::DoubleBitEcc, None)];
    step(1, &mut r, &mut cluster, &api).await;
    assert_eq!(names(&api), ["gpu-0"]);
    cluster.health = vec![];
    step(1, &mut r, &mut cluster, &api).await;
    assert_eq!(names(&api), ["gpu-0", "gpu-1"]);
}

#[tokio::test]
async fn a_quiet_period_that_is_not_a_duration_makes_the_policy_invalid_naming_the_field() {
    let mut cluster =
        Cluster::new().with_policy("metadata: {name: default}\nspec: {health: {quietPeriod: soon}}");
    let api = InMemoryApi::default();
    let mut r = reconciler(&cluster, &api, ApiFeatures::ALL);
    cluster.elapsed += 1;
    let decision = r.decide(&cluster.snapshot(&api), cluster.wall(), cluster.mono());
    let problem = decision.problem.expect("the policy is refused");
    assert_eq!(problem.reason, "InvalidHealth");
    assert!(
        problem.message.starts_with("spec.health.quietPeriod:"),
        "{problem}"
    );
}

#[tokio::test]
async fn a_device_carries_one_taint_per_key_when_its_gpu_and_the_mig_device_both_failed() {
    let mut cluster = Cluster::new();
    let api = InMemoryApi::default();
    let mut r = reconciler(&cluster, &api, ApiFeatures::ALL);
    let mut mig = sick(1, HealthReason::Xid, Some(94));
    mig.mig = Some(MigDeviceRef {
        profile: "3g.71gb".into(),
        start: 4,
    });
    cluster.health = vec![sick(1, HealthReason::Xid, Some(79)), mig];
    step(1, &mut r, &mut cluster, &api).await;
    let device = devices(&api)
        .into_iter()
        .find(|d| d.name == "gpu-1-mig-3g-71gb-4")
        .unwrap();
    let taints = device.taints.unwrap();
    assert_eq!(taints.len(), 1, "{taints:?}");
    assert_eq!(
        taints[0].value.as_deref(),
        Some("79"),
        "the GPU's taint stands for both"
    );
}
