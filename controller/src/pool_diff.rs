//! The controller's core, without a cluster: from (inventories, nodes, per-GPU models, features, existing
//! slices) to the desired pools and the writes that get there.
//!
//! Rules:
//! * a node's pool is published while its Node exists and [`crate::liveness`] says its plugin is alive;
//!   it is left exactly as it is while liveness cannot tell yet ([`Verdict::Hold`]: the controller's view
//!   is lost, the plugin is restarting, or the controller has not seen a heartbeat change since it
//!   listed); otherwise, and when the Node is gone, the pool is deleted;
//! * a pool is left alone when every desired slice exists with the same content hash, one generation and
//!   the right slice count: zero writes at steady state;
//! * any change bumps the pool generation (above both what exists and what this controller last wrote,
//!   so a pool kubelet wiped still gets a new generation) and rewrites every slice of that pool, and only
//!   of that pool.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::ResourceSlice;
use tessera_api::{DRIVER_NAME, NodeInventory};

use crate::{
    devices::Model,
    features::ApiFeatures,
    liveness::Verdict,
    policy::Assignments,
    pool::{CONTENT_HASH_ANNOTATION, NodeRef, node_slices},
};

/// Writes that bring the cluster to the desired pools.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub creates: Vec<ResourceSlice>,
    /// Full objects with the existing `resourceVersion`, for a replace.
    pub updates: Vec<ResourceSlice>,
    /// Names of slices to delete.
    pub deletes: Vec<String>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.writes() == 0
    }

    pub fn writes(&self) -> usize {
        self.creates.len() + self.updates.len() + self.deletes.len()
    }

    /// Pools the plan touches.
    pub fn pools(&self) -> BTreeSet<String> {
        self.creates
            .iter()
            .chain(&self.updates)
            .map(|s| s.spec.pool.name.clone())
            .collect()
    }
}

/// The highest generation this controller wrote per pool.
pub type Generations = BTreeMap<String, i64>;

/// Desired slices per pool (pool name = node name).
pub type DesiredPools = BTreeMap<String, Vec<ResourceSlice>>;

fn hash_of(slice: &ResourceSlice) -> Option<&str> {
    slice
        .metadata
        .annotations
        .as_ref()?
        .get(CONTENT_HASH_ANNOTATION)
        .map(String::as_str)
}

/// Drops from an existing slice what [`diff`] never reads: its devices, counters and managed fields.
/// [`diff`] compares names, the content-hash annotation, the pool's generation and slice count, and
/// takes the `resourceVersion` for a replace; the devices are ~99 % of a slice's size, and the controller
/// keeps every slice of the cluster in its cache, so its memory is what it publishes, not what it reads.
pub fn trim_to_what_diff_reads(slice: &mut ResourceSlice) {
    slice.metadata.managed_fields = None;
    slice.spec.devices = None;
    slice.spec.shared_counters = None;
}

/// Compares desired pools with the existing slices of this driver; pools in `held` are not touched.
pub fn diff(
    desired: &DesiredPools,
    existing: &[ResourceSlice],
    held: &BTreeSet<String>,
    generations: &mut Generations,
) -> Plan {
    let mut by_pool: BTreeMap<&str, Vec<&ResourceSlice>> = BTreeMap::new();
    for s in existing.iter().filter(|s| s.spec.driver == DRIVER_NAME) {
        by_pool.entry(s.spec.pool.name.as_str()).or_default().push(s);
    }
    let mut plan = Plan::default();
    let pools: BTreeSet<&str> = desired
        .keys()
        .map(String::as_str)
        .chain(by_pool.keys().copied())
        .filter(|p| !held.contains(*p))
        .collect();
    for pool in pools {
        let have = by_pool.get(pool).map(Vec::as_slice).unwrap_or_default();
        let want = desired.get(pool).map(Vec::as_slice).unwrap_or_default();
        if want.is_empty() {
            plan.deletes
                .extend(have.iter().filter_map(|s| s.metadata.name.clone()));
            continue;
        }
        let have_by_name: BTreeMap<&str, &ResourceSlice> = have
            .iter()
            .filter_map(|s| Some((s.metadata.name.as_deref()?, *s)))
            .collect();
        let generations_seen: BTreeSet<i64> = have.iter().map(|s| s.spec.pool.generation).collect();
        let unchanged = have.len() == want.len()
            && generations_seen.len() == 1
            && have
                .iter()
                .all(|s| s.spec.pool.resource_slice_count == want.len() as i64)
            && want.iter().all(|w| {
                w.metadata
                    .name
                    .as_deref()
                    .and_then(|n| have_by_name.get(n))
                    .is_some_and(|h| hash_of(h) == hash_of(w))
            });
        let max_seen = generations_seen.last().copied().unwrap_or(0);
        if unchanged {
            let g = generations.entry(pool.to_string()).or_default();
            *g = (*g).max(max_seen);
            continue;
        }
        let generation = max_seen.max(generations.get(pool).copied().unwrap_or(0)) + 1;
        generations.insert(pool.to_string(), generation);
        let wanted_names: BTreeSet<&str> = want.iter().filter_map(|w| w.metadata.name.as_deref()).collect();
        for w in want {
            let mut slice = w.clone();
            slice.spec.pool.generation = generation;
            slice.spec.pool.resource_slice_count = want.len() as i64;
            match w.metadata.name.as_deref().and_then(|n| have_by_name.get(n)) {
                Some(existing) => {
                    slice.metadata.resource_version = existing.metadata.resource_version.clone();
                    plan.updates.push(slice);
                }
                None => plan.creates.push(slice),
            }
        }
        plan.deletes.extend(
            have.iter()
                .filter_map(|s| s.metadata.name.clone())
                .filter(|n| !wanted_names.contains(n.as_str())),
        );
    }
    plan
}

/// What the desired pools are built from.
pub struct Inputs<'a> {
    pub inventories: &'a [NodeInventory],
    /// Nodes that exist, by name.
    pub nodes: &'a BTreeMap<String, NodeRef>,
    pub assignments: &'a Assignments,
    pub features: ApiFeatures,
    /// What [`crate::liveness`] says of a node's pool.
    pub verdict: &'a dyn Fn(&str) -> Verdict,
}

/// The pools to leave as they are: those of existing nodes (with slices or an inventory) whose verdict is
/// [`Verdict::Hold`].
pub fn held_pools(inputs: &Inputs<'_>, existing: &[ResourceSlice]) -> BTreeSet<String> {
    inputs
        .inventories
        .iter()
        .map(|i| i.spec.node_name.as_str())
        .chain(existing.iter().map(|s| s.spec.pool.name.as_str()))
        .filter(|n| inputs.nodes.contains_key(*n) && (inputs.verdict)(n) == Verdict::Hold)
        .map(str::to_string)
        .collect()
}

/// The pools that should exist: one per node that exists and whose plugin is alive.
pub fn desired_pools(inputs: &Inputs<'_>) -> DesiredPools {
    let mut pools = DesiredPools::new();
    for inv in inputs.inventories {
        let name = &inv.spec.node_name;
        let Some(node) = inputs.nodes.get(name) else {
            continue;
        };
        if (inputs.verdict)(name) != Verdict::Publish {
            continue;
        }
        let models = |index: u32| {
            inputs
                .assignments
                .get(&(name.clone(), index))
                .cloned()
                .unwrap_or(Model::Default)
        };
        let slices = node_slices(node, &inv.spec, &models, inputs.features);
        if !slices.is_empty() {
            pools.insert(name.clone(), slices);
        }
    }
    pools
}
