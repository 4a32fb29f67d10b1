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

use k8s_openapi::{api::resource::v1::ResourceSlice, apimachinery::pkg::apis::meta::v1::ObjectMeta};
use sha2::{Digest, Sha256};
use tessera_api::{DRIVER_NAME, NodeInventory, NodeInventorySpec};

use crate::{
    devices::Model,
    features::ApiFeatures,
    health::NodeTaints,
    liveness::Verdict,
    policy::Assignments,
    pool::{CONTENT_HASH_ANNOTATION, NodeRef, node_slices_retaining},
    retain::Allocated,
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

    /// Appends `other`'s writes.
    pub fn extend(&mut self, other: Plan) {
        self.creates.extend(other.creates);
        self.updates.extend(other.updates);
        self.deletes.extend(other.deletes);
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

/// What [`diff`] reads of one desired slice to tell whether the pool is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceSummary {
    pub name: Option<String>,
    /// The [`CONTENT_HASH_ANNOTATION`].
    pub hash: Option<String>,
}

/// What [`diff`] reads of a desired pool to tell whether it is unchanged: each slice's name and content
/// hash (the slice count is their number): a few hundred bytes per node, where its slices hold up to 208
/// devices (8 GPUs under dynamic MIG) with their attributes, capacity and counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolSummary {
    pub slices: Vec<SliceSummary>,
}

impl PoolSummary {
    pub fn of(slices: &[ResourceSlice]) -> Self {
        Self {
            slices: slices
                .iter()
                .map(|s| SliceSummary {
                    name: s.metadata.name.clone(),
                    hash: hash_of(s).map(str::to_string),
                })
                .collect(),
        }
    }
}

/// The existing slices of this driver, by pool.
fn existing_by_pool(existing: &[ResourceSlice]) -> BTreeMap<&str, Vec<&ResourceSlice>> {
    let mut by_pool: BTreeMap<&str, Vec<&ResourceSlice>> = BTreeMap::new();
    for s in existing.iter().filter(|s| s.spec.driver == DRIVER_NAME) {
        by_pool.entry(s.spec.pool.name.as_str()).or_default().push(s);
    }
    by_pool
}

/// The writes for one pool. `want` summarizes the desired slices (empty: the pool should not exist);
/// `render` gives them in full and is called only when the pool has to be written.
fn diff_pool(
    pool: &str,
    want: &PoolSummary,
    render: impl FnOnce() -> Vec<ResourceSlice>,
    have: &[&ResourceSlice],
    generations: &mut Generations,
) -> Plan {
    let mut plan = Plan::default();
    if want.slices.is_empty() {
        plan.deletes
            .extend(have.iter().filter_map(|s| s.metadata.name.clone()));
        return plan;
    }
    let have_by_name: BTreeMap<&str, &ResourceSlice> = have
        .iter()
        .filter_map(|s| Some((s.metadata.name.as_deref()?, *s)))
        .collect();
    let generations_seen: BTreeSet<i64> = have.iter().map(|s| s.spec.pool.generation).collect();
    let unchanged = have.len() == want.slices.len()
        && generations_seen.len() == 1
        && have
            .iter()
            .all(|s| s.spec.pool.resource_slice_count == want.slices.len() as i64)
        && want.slices.iter().all(|w| {
            w.name
                .as_deref()
                .and_then(|n| have_by_name.get(n))
                .is_some_and(|h| hash_of(h) == w.hash.as_deref())
        });
    let max_seen = generations_seen.last().copied().unwrap_or(0);
    if unchanged {
        let g = generations.entry(pool.to_string()).or_default();
        *g = (*g).max(max_seen);
        return plan;
    }
    let generation = max_seen.max(generations.get(pool).copied().unwrap_or(0)) + 1;
    generations.insert(pool.to_string(), generation);
    let want = render();
    let count = want.len() as i64;
    let wanted_names: BTreeSet<String> = want.iter().filter_map(|w| w.metadata.name.clone()).collect();
    for mut slice in want {
        slice.spec.pool.generation = generation;
        slice.spec.pool.resource_slice_count = count;
        match slice.metadata.name.as_deref().and_then(|n| have_by_name.get(n)) {
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
            .filter(|n| !wanted_names.contains(n)),
    );
    plan
}

/// Compares desired pools with the existing slices of this driver; pools in `held` are not touched.
pub fn diff(
    desired: &DesiredPools,
    existing: &[ResourceSlice],
    held: &BTreeSet<String>,
    generations: &mut Generations,
) -> Plan {
    let by_pool = existing_by_pool(existing);
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
        plan.extend(diff_pool(
            pool,
            &PoolSummary::of(want),
            || want.to_vec(),
            have,
            generations,
        ));
    }
    plan
}

/// What the desired pools are built from; `'v` is the verdict's, which may be shorter.
pub struct Inputs<'a, 'v> {
    pub inventories: &'a [NodeInventory],
    /// Nodes that exist, by name.
    pub nodes: &'a BTreeMap<String, NodeRef>,
    pub assignments: &'a Assignments,
    pub features: ApiFeatures,
    /// What [`crate::liveness`] says of a node's pool.
    pub verdict: &'v dyn Fn(&str) -> Verdict,
    /// The health taints of a node's devices ([`crate::health`]).
    pub health: &'v dyn Fn(&str) -> NodeTaints,
    /// This driver's allocated devices by node, kept published while the models drop them
    /// ([`crate::retain`]).
    pub allocated: &'a Allocated,
}

/// The pools to leave as they are: those of existing nodes (with slices or an inventory) whose verdict is
/// [`Verdict::Hold`].
pub fn held_pools(inputs: &Inputs<'_, '_>, existing: &[ResourceSlice]) -> BTreeSet<String> {
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
pub fn desired_pools(inputs: &Inputs<'_, '_>) -> DesiredPools {
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
        let allocated = inputs.allocated.get(name).cloned().unwrap_or_default();
        let (slices, _) = node_slices_retaining(
            node,
            &inv.spec,
            &models,
            inputs.features,
            &(inputs.health)(name),
            &allocated,
        );
        if !slices.is_empty() {
            pools.insert(name.clone(), slices);
        }
    }
    pools
}

/// Identifies the inventory spec a pool was rendered from (or a policy's spec), without holding it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpecVersion {
    /// NodeInventory has the status subresource (`deployments/crds/`), so the API server bumps
    /// `metadata.generation` on a spec change and never on the heartbeat (a status write); a recreated
    /// inventory has a new uid. Comparing these is O(1) per node and tick.
    Generation { uid: String, generation: i64 },
    /// An inventory without uid or generation (one not read from an API server, as in tests and
    /// `render`): a hash of its spec.
    SpecHash([u8; 32]),
}

impl SpecVersion {
    pub fn of(inventory: &NodeInventory) -> Self {
        Self::of_object(&inventory.metadata, &inventory.spec)
    }

    /// The version of an object whose spec changes bump `metadata.generation` (a custom resource with
    /// the status subresource).
    pub fn of_object(meta: &ObjectMeta, spec: &impl serde::Serialize) -> Self {
        if let (Some(uid), Some(generation)) = (&meta.uid, meta.generation) {
            return Self::Generation {
                uid: uid.clone(),
                generation,
            };
        }
        // Serializing a spec of derived `Serialize` types cannot fail; an empty hash would only cost a
        // re-render.
        let bytes = serde_json::to_vec(spec).unwrap_or_default();
        Self::SpecHash(Sha256::digest(&bytes).into())
    }
}

/// Everything [`crate::pool::node_slices`] reads for one node.
#[derive(Clone, Debug, PartialEq)]
struct RenderKey {
    node: NodeRef,
    spec: SpecVersion,
    /// The model of each GPU, in inventory order.
    models: Vec<Model>,
    features: ApiFeatures,
    /// Health taints change without the spec's generation (they come from the status).
    health: NodeTaints,
}

/// Per node: the key a pool was last rendered under and what [`diff`] needs of the result. Unchanged
/// pools are then decided without rendering them, and the controller never holds a copy of every
/// published device: full slices exist only for pools being written, until the writes are done.
#[derive(Debug, Default)]
pub struct RenderCache {
    entries: BTreeMap<String, Entry>,
    renders: u64,
}

/// What a node's pool was last rendered from and what [`diff`] needs of it.
#[derive(Debug)]
struct Entry {
    key: RenderKey,
    summary: PoolSummary,
    /// The node's allocated devices the render kept ([`crate::retain`]); while any is, the render also
    /// depends on `allocated`, and is made again once that changes.
    kept: Vec<String>,
    allocated: BTreeSet<String>,
}

impl RenderCache {
    /// How many times a node's slices were rendered ([`crate::pool::node_slices`]) since the cache was made.
    pub fn renders(&self) -> u64 {
        self.renders
    }

    /// Nodes with a cached summary.
    pub fn nodes(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Per node, the allocated devices its last render kept published although the policy drops them
    /// ([`crate::retain`]); nodes without any are left out.
    pub fn retained(&self) -> impl Iterator<Item = (&str, &[String])> {
        self.entries
            .iter()
            .filter(|(_, e)| !e.kept.is_empty())
            .map(|(n, e)| (n.as_str(), e.kept.as_slice()))
    }
}

/// [`crate::pool::node_slices`] for `key`, counted in `renders`.
fn render(
    key: &RenderKey,
    inventory: &NodeInventorySpec,
    allocated: &BTreeSet<String>,
    renders: &mut u64,
) -> (Vec<ResourceSlice>, Vec<String>) {
    *renders += 1;
    let models = |index: u32| {
        inventory
            .gpus
            .iter()
            .position(|g| g.index == index)
            .and_then(|i| key.models.get(i).cloned())
            .unwrap_or(Model::Default)
    };
    node_slices_retaining(
        &key.node,
        inventory,
        &models,
        key.features,
        &key.health,
        allocated,
    )
}

/// [`diff`] of [`desired_pools`] against `existing`, one pool at a time, rendering a node's slices only
/// when what they are rendered from changed since the cache last saw it, or when its pool has to be
/// written. A caller that writes each pool's plan before asking for the next holds the full slices of one
/// pool at a time, not of every pool being written.
pub struct PoolCursor<'a> {
    /// Pools to look at, in name order, with the inventory and Node of those that should be published.
    pools: std::vec::IntoIter<(&'a str, Option<(&'a NodeInventory, &'a NodeRef)>)>,
    existing: BTreeMap<&'a str, Vec<&'a ResourceSlice>>,
    assignments: &'a Assignments,
    features: ApiFeatures,
    health: BTreeMap<&'a str, NodeTaints>,
    allocated: &'a Allocated,
    desired: BTreeSet<String>,
}

impl<'a> PoolCursor<'a> {
    /// Decides which pools to look at (pools in `held` are not) and drops the cache entries of nodes
    /// that are gone (no Node or no inventory).
    pub fn new(
        inputs: &Inputs<'a, '_>,
        existing: &'a [ResourceSlice],
        held: &BTreeSet<String>,
        cache: &mut RenderCache,
    ) -> Self {
        // As in `desired_pools`, the last inventory of a node wins.
        let mut publishing: BTreeMap<&'a str, (&'a NodeInventory, &'a NodeRef)> = BTreeMap::new();
        for inv in inputs.inventories {
            let name = inv.spec.node_name.as_str();
            if let Some(node) = inputs.nodes.get(name)
                && (inputs.verdict)(name) == Verdict::Publish
            {
                publishing.insert(name, (inv, node));
            }
        }
        let with_inventory: BTreeSet<&str> = inputs
            .inventories
            .iter()
            .map(|i| i.spec.node_name.as_str())
            .filter(|n| inputs.nodes.contains_key(*n))
            .collect();
        cache.entries.retain(|n, _| with_inventory.contains(n.as_str()));
        let existing = existing_by_pool(existing);
        let pools: BTreeSet<&'a str> = publishing
            .keys()
            .copied()
            .chain(existing.keys().copied())
            .filter(|p| !held.contains(*p))
            .collect();
        let pools: Vec<_> = pools
            .into_iter()
            .map(|p| (p, publishing.get(p).copied()))
            .collect();
        let health = publishing.keys().map(|n| (*n, (inputs.health)(n))).collect();
        Self {
            pools: pools.into_iter(),
            existing,
            assignments: inputs.assignments,
            features: inputs.features,
            health,
            allocated: inputs.allocated,
            desired: BTreeSet::new(),
        }
    }

    /// The writes for the next pool (empty when it is unchanged); `None` once every pool was looked at.
    pub fn next_pool(&mut self, generations: &mut Generations, cache: &mut RenderCache) -> Option<Plan> {
        let (pool, publish) = self.pools.next()?;
        let have = self.existing.get(pool).map(Vec::as_slice).unwrap_or_default();
        let Some((inv, node)) = publish else {
            return Some(diff_pool(
                pool,
                &PoolSummary::default(),
                Vec::new,
                have,
                generations,
            ));
        };
        let key = RenderKey {
            node: node.clone(),
            spec: SpecVersion::of(inv),
            models: inv
                .spec
                .gpus
                .iter()
                .map(|g| {
                    self.assignments
                        .get(&(pool.to_string(), g.index))
                        .cloned()
                        .unwrap_or(Model::Default)
                })
                .collect(),
            features: self.features,
            health: self.health.get(pool).cloned().unwrap_or_default(),
        };
        let RenderCache { entries, renders } = cache;
        let empty = BTreeSet::new();
        let allocated = self.allocated.get(pool).unwrap_or(&empty);
        // A render made to learn the hashes is kept for the writes, so a changed pool renders once.
        // Allocations matter to a pool only while it keeps a device for them, or when its key changed.
        let mut fresh = None;
        if entries
            .get(pool)
            .is_none_or(|e| e.key != key || (!e.kept.is_empty() && e.allocated != *allocated))
        {
            let (slices, kept) = render(&key, &inv.spec, allocated, renders);
            let was = entries.get(pool).map(|e| e.kept.clone()).unwrap_or_default();
            if kept != was {
                tracing::info!(
                    node = pool,
                    devices = ?kept,
                    "allocated devices the policy drops stay published (tainted {}) until their claims \
                     are released",
                    crate::retain::RETAINED_TAINT
                );
            }
            let entry = Entry {
                key: key.clone(),
                summary: PoolSummary::of(&slices),
                allocated: if kept.is_empty() {
                    BTreeSet::new()
                } else {
                    allocated.clone()
                },
                kept,
            };
            entries.insert(pool.to_string(), entry);
            fresh = Some(slices);
        }
        let Entry {
            summary,
            allocated: used,
            ..
        } = &entries[pool];
        if !summary.slices.is_empty() {
            self.desired.insert(pool.to_string());
        }
        // The allocations the summary was made with: a render from others could hash differently.
        let slices = || fresh.unwrap_or_else(|| render(&key, &inv.spec, used, renders).0);
        Some(diff_pool(pool, summary, slices, have, generations))
    }

    /// The pools that should exist, of those looked at so far.
    pub fn desired(self) -> BTreeSet<String> {
        self.desired
    }
}

/// Every pool of a [`PoolCursor`] at once: the plan and the names of the pools that should exist. Plans
/// the same writes as [`diff`] of [`desired_pools`].
pub fn diff_cached(
    inputs: &Inputs<'_, '_>,
    existing: &[ResourceSlice],
    held: &BTreeSet<String>,
    generations: &mut Generations,
    cache: &mut RenderCache,
) -> (Plan, BTreeSet<String>) {
    let mut cursor = PoolCursor::new(inputs, existing, held, cache);
    let mut plan = Plan::default();
    while let Some(pool) = cursor.next_pool(generations, cache) {
        plan.extend(pool);
    }
    (plan, cursor.desired())
}
