//! What one steady-state tick of the controller costs at fleet size: the loop's work every 2 s (and, with
//! inventory heartbeats, after every heartbeat) when nothing changes. N nodes of 8 H100 under the default
//! policy (or the GpuPolicy in POLICY.yaml) are published into the in-memory API once; then ticks run two ways:
//! * inventory heartbeats: every tick renews every inventory's `lastHeartbeatTime`, so the runtime copies
//!   the inventories and the trimmed slices out of its caches into a new snapshot;
//! * Lease heartbeats: only the node Leases' renew times change; the runtime keeps its snapshot and
//!   replaces that map.
//!
//! Prints the split per tick; asserts nothing.
//!
//! ```sh
//! cargo run --release -p tessera-controller --example steady_tick [-- NODES TICKS [POLICY.yaml]]
//! ```

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use chrono::Utc;
use k8s_openapi::{api::resource::v1::ResourceSlice, apimachinery::pkg::apis::meta::v1::Time};
use tessera_api::{NodeInventory, policy::GpuPolicy};
use tessera_controller::{
    features::ApiFeatures,
    fixtures::{GpuModel, fixed_time, node},
    liveness::{Liveness, View},
    pool::NodeRef,
    pool_diff::trim_to_what_diff_reads,
    publisher::{InMemoryApi, Reconciler, Snapshot},
    time::to_k8s_time,
};

fn main() {
    let mut args = std::env::args().skip(1);
    let nodes: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let ticks: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);
    let policy = args.next().map(|path| {
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("failed to read {path}: {e}"));
        serde_norway::from_str::<GpuPolicy>(&text).unwrap_or_else(|e| panic!("{path} is no GpuPolicy: {e}"))
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    runtime.block_on(run(nodes, ticks, policy));
}

async fn run(nodes: usize, ticks: u32, policy: Option<GpuPolicy>) {
    let inventories: Vec<Arc<NodeInventory>> = (0..nodes)
        .map(|i| {
            let mut inv = node(&format!("node-{i:04}"))
                .gpus(GpuModel::H100Sxm5_80gb, 8)
                .build();
            // As the API server returns it: the render cache keys on uid and generation.
            inv.metadata.uid = Some(format!("inventory-uid-{i}"));
            inv.metadata.generation = Some(1);
            Arc::new(inv)
        })
        .collect();
    let refs: BTreeMap<String, NodeRef> = (0..nodes)
        .map(|i| {
            let name = format!("node-{i:04}");
            (
                name.clone(),
                NodeRef {
                    name,
                    uid: Some(format!("uid-{i}")),
                },
            )
        })
        .collect();
    let api = InMemoryApi::default();
    let mut reconciler = Reconciler::new(
        ApiFeatures::ALL,
        Liveness::new(Duration::from_secs(40), Duration::from_secs(30)),
    );
    let start = Instant::now();
    let cached_slices = |api: &InMemoryApi| -> Vec<Arc<ResourceSlice>> {
        api.slices()
            .into_iter()
            .map(|mut s| {
                trim_to_what_diff_reads(&mut s);
                Arc::new(s)
            })
            .collect()
    };
    let snapshot = |second: i64, slices: &[Arc<ResourceSlice>], policy: &Option<GpuPolicy>| -> Snapshot {
        let at = Time(to_k8s_time(fixed_time() + chrono::Duration::seconds(second)));
        Snapshot {
            inventories: inventories
                .iter()
                .map(|i| {
                    let mut i = (**i).clone();
                    i.status
                        .as_mut()
                        .expect("fixtures have a status")
                        .last_heartbeat_time = Some(at.clone());
                    i
                })
                .collect(),
            node_leases: BTreeMap::new(),
            inventory_view: View::Synced { list: 1 },
            nodes: refs.clone(),
            policy: policy.clone(),
            slices: slices.iter().map(|s| (**s).clone()).collect(),
            allocated: Default::default(),
        }
    };
    // Listed once, then a heartbeat change: every pool is published.
    reconciler.observe(&snapshot(0, &[], &policy), start);
    let first = Instant::now();
    let decision = reconciler
        .reconcile(
            &snapshot(1, &[], &policy),
            &api,
            Utc::now(),
            start + Duration::from_secs(1),
            &|| true,
        )
        .await
        .expect("in-memory writes succeed");
    let published = decision.plan.map_or(0, |p| p.creates.len());
    println!(
        "{nodes} nodes: first round published {published} slices in {:.0} ms",
        first.elapsed().as_secs_f64() * 1e3
    );
    let slices = cached_slices(&api);
    // As the policy watch would show it after the first round: with the status the controller wrote.
    let policy = policy.map(|mut p| {
        p.status = api.policy_status("default");
        p
    });
    let (mut build, mut reconcile) = (Duration::ZERO, Duration::ZERO);
    let writes_before = api.writes();
    for t in 0..ticks {
        let t0 = Instant::now();
        let snap = snapshot(2 + i64::from(t), &slices, &policy);
        let t1 = Instant::now();
        reconciler
            .reconcile(
                &snap,
                &api,
                Utc::now(),
                start + Duration::from_secs(2 + u64::from(t)),
                &|| true,
            )
            .await
            .expect("in-memory writes succeed");
        build += t1 - t0;
        reconcile += t1.elapsed();
        drop(snap);
    }
    report(
        "inventory heartbeats",
        "snapshot copy",
        ticks,
        api.writes() - writes_before,
        build,
        reconcile,
    );

    // The plugins move to Leases: the inventories' heartbeat stands still from here on.
    let offset = 2 + i64::from(ticks);
    let mut snap = snapshot(offset, &slices, &policy);
    let (mut build, mut reconcile) = (Duration::ZERO, Duration::ZERO);
    let writes_before = api.writes();
    for t in 0..ticks {
        let second = offset + 1 + i64::from(t);
        let t0 = Instant::now();
        snap.node_leases = refs
            .keys()
            .map(|n| (n.clone(), format!("renewed at {second}")))
            .collect();
        let t1 = Instant::now();
        let mono = start + Duration::from_secs(u64::try_from(second).unwrap_or_default());
        reconciler
            .reconcile(&snap, &api, Utc::now(), mono, &|| true)
            .await
            .expect("in-memory writes succeed");
        build += t1 - t0;
        reconcile += t1.elapsed();
    }
    report(
        "Lease heartbeats",
        "lease map",
        ticks,
        api.writes() - writes_before,
        build,
        reconcile,
    );
}

/// One line per way of ticking: the mean time of building the snapshot and of reconciling.
fn report(how: &str, build_is: &str, ticks: u32, writes: usize, build: Duration, reconcile: Duration) {
    let per = |d: Duration| d.as_secs_f64() * 1e3 / f64::from(ticks);
    println!(
        "{how}, steady tick ({ticks} ticks, {writes} writes): {build_is} {:.1} ms + reconcile {:.1} ms = {:.1} ms",
        per(build),
        per(reconcile),
        per(build) + per(reconcile)
    );
}
