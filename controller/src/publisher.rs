//! The reconcile step shared by the cluster runtime and the tests: a [`Snapshot`] of the watched objects
//! in, slice writes and a policy status out, through a [`ClusterApi`].
//!
//! ```text
//!  [ NodeInventory ]  [ Node ]  [ GpuPolicy ]  [ ResourceSlice (ours) ]
//!          └──────────────┴──────────┴──────────────────┘
//!                              Snapshot
//!                                 │ Reconciler::decide  (pure)
//!                                 ▼
//!            Plan (creates/updates/deletes)  +  GpuPolicy status
//!                                 │ Reconciler::apply   (only while leading)
//!                                 ▼
//!                              ClusterApi
//! ```

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::Instant,
};

use chrono::{DateTime, Utc};
use k8s_openapi::api::resource::v1::ResourceSlice;
use tessera_api::{
    NodeInventory,
    policy::{CONDITION_VALID, GpuPolicy, GpuPolicyStatus},
};

use crate::{
    cel::CelEnv,
    features::ApiFeatures,
    health::{HealthConfig, HealthTracker},
    leader::{LeaderElector, LeaseStore},
    liveness::{Liveness, View},
    policy::{Assignments, CompiledPolicy, PolicyProblem, valid_condition},
    pool::NodeRef,
    pool_diff::{
        Generations, Inputs, Plan, PoolCursor, RenderCache, SpecVersion, held_pools, trim_to_what_diff_reads,
    },
};

/// Error of an API call, as the runtime reports it.
pub type ApiError = Box<dyn std::error::Error + Send + Sync>;

/// Why a reconcile step failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Creating a slice failed.
    #[error("failed to create ResourceSlice {name}: {source}")]
    CreateSlice { name: String, source: ApiError },
    /// Replacing a slice failed (a conflict means the cache was stale; the next round fixes it).
    #[error("failed to update ResourceSlice {name}: {source}")]
    ReplaceSlice { name: String, source: ApiError },
    /// Deleting a slice failed.
    #[error("failed to delete ResourceSlice {name}: {source}")]
    DeleteSlice { name: String, source: ApiError },
    /// Writing the policy's status failed.
    #[error("failed to update the status of GpuPolicy {name}: {source}")]
    PatchPolicyStatus { name: String, source: ApiError },
}

/// What [`ClusterApi::replace_slice`] fails with when the slice no longer exists: deleted behind the
/// controller's back (kubelet deletes its node's driver slices when it starts) before the slice watch told
/// the controller. The writer creates it instead, in the same pass, rather than waiting for a retry while
/// the pool is incomplete.
#[derive(Debug, thiserror::Error)]
#[error("ResourceSlice {0} does not exist")]
pub struct SliceGone(pub String);

/// A create that found the slice there already: the controller's own write of an earlier pass, which
/// its cache had not shown yet when kubelet's wipe made the pass that followed plan a create. The slice
/// is then replaced without a resourceVersion (an unconditional update, which ResourceSlices allow).
#[derive(Debug, thiserror::Error)]
#[error("ResourceSlice {0} exists already")]
pub struct SliceExists(pub String);

/// The writes the controller makes.
pub trait ClusterApi: Sync {
    fn create_slice(&self, slice: &ResourceSlice) -> impl Future<Output = Result<(), ApiError>> + Send;
    fn replace_slice(&self, slice: &ResourceSlice) -> impl Future<Output = Result<(), ApiError>> + Send;
    fn delete_slice(&self, name: &str) -> impl Future<Output = Result<(), ApiError>> + Send;
    fn patch_policy_status(
        &self,
        name: &str,
        status: &GpuPolicyStatus,
    ) -> impl Future<Output = Result<(), ApiError>> + Send;
}

/// Asked before every write: may this replica write now? A leader's gate renews its lease here when the
/// renewal is due, so a publish that takes longer than the renew deadline (a start or a policy change on
/// a large cluster) keeps writing instead of stopping half-way once the deadline passes.
pub trait WriteGate: Send {
    fn may_write(&mut self) -> impl Future<Output = bool> + Send;
}

/// A plain predicate as a gate (tests, and callers that renew elsewhere).
impl<F: Fn() -> bool + Sync> WriteGate for &F {
    async fn may_write(&mut self) -> bool {
        (*self)()
    }
}

/// The gate of a leading replica: renews (or, once lost, fails to reacquire) the lease through the elector,
/// which makes no API call while the last renewal is younger than the renew interval.
struct LeaseGate<'a, S: LeaseStore> {
    elector: &'a mut LeaderElector,
    lease: &'a S,
    clock: &'a (dyn Fn() -> DateTime<Utc> + Sync),
}

impl<S: LeaseStore> WriteGate for LeaseGate<'_, S> {
    async fn may_write(&mut self) -> bool {
        // Fresh renewal: true without a call. Due: one lease write. Failed call: true only until the renew
        // deadline of the last success, so a replica cut off from the API server stops in time.
        self.elector
            .try_acquire_or_renew(self.lease, (self.clock)())
            .await
    }
}

/// Everything the controller watches, at one moment.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub inventories: Vec<NodeInventory>,
    /// The `renewTime` of each node's heartbeat Lease, by node name.
    pub node_leases: BTreeMap<String, String>,
    /// How current `inventories` and `node_leases` are.
    pub inventory_view: View,
    pub nodes: BTreeMap<String, NodeRef>,
    /// The policy named `default`, if any.
    pub policy: Option<GpuPolicy>,
    /// ResourceSlices of this driver.
    pub slices: Vec<ResourceSlice>,
    /// This driver's devices that ResourceClaims hold, by node: a republish keeps those it would drop
    /// ([`crate::retain`]). Empty without a list of claims.
    pub allocated: crate::retain::Allocated,
}

/// What one reconcile step decided.
#[derive(Clone, Debug, Default)]
pub struct Decision {
    /// `None` while the policy is invalid and no valid one was seen since start: nothing is written.
    pub plan: Option<Plan>,
    /// Pools that should exist: nodes that exist and whose plugin is alive, with something to publish.
    /// Names only: the slices of pools being written are in `plan`, the others are never rendered.
    pub desired: BTreeSet<String>,
    /// Pools left as they are this round (see [`crate::liveness::Verdict::Hold`]).
    pub held: BTreeSet<String>,
    /// The policy status to write, when it differs from the stored one.
    pub status: Option<(String, GpuPolicyStatus)>,
    pub problem: Option<PolicyProblem>,
    /// The gate refused a write (the lease was lost mid-way): `plan` was not written in full.
    pub interrupted: bool,
}

/// What an assignment is computed from: the policy's spec (`None`: the built-in default) and every
/// inventory's spec, in the snapshot's order.
#[derive(Clone, Debug, PartialEq)]
struct AssignedFrom {
    policy: Option<SpecVersion>,
    inventories: Vec<(String, SpecVersion)>,
}

impl AssignedFrom {
    fn of(snap: &Snapshot) -> Self {
        Self {
            policy: snap
                .policy
                .as_ref()
                .map(|p| SpecVersion::of_object(&p.metadata, &p.spec)),
            inventories: snap
                .inventories
                .iter()
                .map(|i| (i.spec.node_name.clone(), SpecVersion::of(i)))
                .collect(),
        }
    }
}

/// Turns snapshots into writes, remembering the last valid policy, the pool generations it wrote, what
/// it saw of each node's heartbeat and what each node's pool was last rendered from.
pub struct Reconciler {
    cel: CelEnv,
    pub features: ApiFeatures,
    pub liveness: Liveness,
    last_valid: Option<CompiledPolicy>,
    generations: Generations,
    renders: RenderCache,
    /// The last valid assignment and what it was computed from.
    assigned: Option<(AssignedFrom, Arc<Assignments>)>,
    /// How often the policy was evaluated over every GPU.
    evaluations: u64,
    /// The health taints in force, with their quiet periods ([`crate::health`]).
    pub health: HealthTracker,
}

impl Reconciler {
    pub fn new(features: ApiFeatures, liveness: Liveness) -> Self {
        Self {
            cel: CelEnv::new(),
            features,
            liveness,
            last_valid: None,
            generations: Generations::new(),
            renders: RenderCache::default(),
            assigned: None,
            evaluations: 0,
            health: HealthTracker::default(),
        }
    }

    /// The per-node render cache (for tests and metrics: how often pools were rendered).
    pub fn render_cache(&self) -> &RenderCache {
        &self.renders
    }

    /// The models of the last valid assignment, per (node, GPU index); a GPU missing from it gets
    /// [`crate::devices::Model::Default`], as when publishing.
    pub fn assigned_models(&self) -> Option<Arc<Assignments>> {
        self.assigned.as_ref().map(|(_, a)| Arc::clone(a))
    }

    /// How often the policy was evaluated over every GPU (for tests: steady ticks reuse the last result).
    pub fn policy_evaluations(&self) -> u64 {
        self.evaluations
    }

    /// Records the snapshot's heartbeats at `mono` (the monotonic clock). Idempotent for one snapshot, so
    /// a replica may observe before it knows whether it leads.
    pub fn observe(&mut self, snap: &Snapshot, mono: Instant) {
        self.liveness
            .observe(&snap.inventories, &snap.node_leases, snap.inventory_view, mono);
        // An invalid `spec.health` keeps the settings in force (the policy's condition says why).
        let config = match &snap.policy {
            Some(p) => HealthConfig::of_spec(&p.spec).unwrap_or(self.health.config()),
            None => HealthConfig::default(),
        };
        self.health.observe(&snap.inventories, config, mono);
    }

    /// Every GPU's model under the policy. A model depends only on the policy's spec and the inventories'
    /// specs, so while neither changed (every steady tick) the last valid assignment is reused: compiling
    /// the policy and evaluating its CEL selectors for every GPU of 1,000 nodes took ~190 ms per tick.
    fn assignments(&mut self, snap: &Snapshot) -> (Option<Arc<Assignments>>, Option<PolicyProblem>) {
        let from = AssignedFrom::of(snap);
        if let Some((key, cached)) = &self.assigned
            && *key == from
        {
            return (Some(Arc::clone(cached)), None);
        }
        self.evaluations += 1;
        let (assignments, problem) = self.assign(snap);
        let assignments = assignments.map(Arc::new);
        self.assigned = match (&assignments, &problem) {
            (Some(a), None) => Some((from, Arc::clone(a))),
            _ => None,
        };
        (assignments, problem)
    }

    fn assign(&mut self, snap: &Snapshot) -> (Option<Assignments>, Option<PolicyProblem>) {
        let specs = || snap.inventories.iter().map(|i| &i.spec);
        let Some(policy) = &snap.policy else {
            self.last_valid = Some(CompiledPolicy::builtin());
            return (
                CompiledPolicy::builtin().assign(&self.cel, specs(), true).ok(),
                None,
            );
        };
        match CompiledPolicy::compile(&policy.spec, &self.cel).and_then(|c| {
            let a = c.assign(&self.cel, specs(), true)?;
            Ok((c, a))
        }) {
            Ok((compiled, assignments)) => {
                self.last_valid = Some(compiled);
                (Some(assignments), None)
            }
            Err(problem) => {
                // The last valid policy keeps applying to inventories as they change; a rule of it that
                // no longer matches anything is fine here, it was valid when accepted.
                let fallback = self
                    .last_valid
                    .as_ref()
                    .and_then(|c| c.assign(&self.cel, specs(), false).ok());
                (fallback, Some(problem))
            }
        }
    }

    /// The policy status, and the per-GPU models the plan is made from (`None`: nothing is written).
    fn prepare(
        &mut self,
        snap: &Snapshot,
        now: DateTime<Utc>,
        mono: Instant,
    ) -> (Decision, Option<Arc<Assignments>>) {
        self.observe(snap, mono);
        let (assignments, problem) = self.assignments(snap);
        let status = snap.policy.as_ref().and_then(|p| {
            let previous = p
                .status
                .as_ref()
                .and_then(|s| s.conditions.iter().find(|c| c.type_ == CONDITION_VALID));
            let generation = p.metadata.generation;
            let condition = valid_condition(problem.as_ref().map_or(Ok(()), Err), generation, previous, now);
            let status = GpuPolicyStatus {
                observed_generation: generation,
                conditions: vec![condition],
            };
            (p.status.as_ref() != Some(&status))
                .then(|| (p.metadata.name.clone().unwrap_or_default(), status))
        });
        let decision = Decision {
            plan: None,
            desired: BTreeSet::new(),
            held: BTreeSet::new(),
            status,
            problem,
            interrupted: false,
        };
        (decision, assignments)
    }

    /// The pools held this round, and a cursor over the others.
    fn cursor<'a>(
        &mut self,
        snap: &'a Snapshot,
        assignments: &'a Assignments,
        mono: Instant,
    ) -> (BTreeSet<String>, PoolCursor<'a>) {
        let liveness = &self.liveness;
        let verdict = move |node: &str| liveness.verdict(node, mono);
        let tracker = &self.health;
        let health = move |node: &str| tracker.taints(node);
        let inputs = Inputs {
            inventories: &snap.inventories,
            nodes: &snap.nodes,
            assignments,
            features: self.features,
            verdict: &verdict,
            health: &health,
            allocated: &snap.allocated,
        };
        let held = held_pools(&inputs, &snap.slices);
        let cursor = PoolCursor::new(&inputs, &snap.slices, &held, &mut self.renders);
        (held, cursor)
    }

    /// The pure part: the diff against existing slices, with every slice to write in full, and the
    /// policy status. `now` is the wall clock (condition times), `mono` the monotonic clock (heartbeat
    /// ages).
    pub fn decide(&mut self, snap: &Snapshot, now: DateTime<Utc>, mono: Instant) -> Decision {
        let (mut decision, assignments) = self.prepare(snap, now, mono);
        let Some(assignments) = assignments else {
            return decision;
        };
        let (held, mut cursor) = self.cursor(snap, &assignments, mono);
        let mut plan = Plan::default();
        while let Some(pool) = cursor.next_pool(&mut self.generations, &mut self.renders) {
            plan.extend(pool);
        }
        decision.held = held;
        decision.desired = cursor.desired();
        decision.plan = Some(plan);
        decision
    }

    /// Decides and writes while the gate allows it (asked before every call, or batch of a pool's
    /// creates), one pool at a time: a
    /// pool's slices are rendered, written, and trimmed to what [`crate::pool_diff::diff`] reads before
    /// the next pool is looked at (deletes last, for every pool), so at most one pool's devices are held however many pools change
    /// (every pool does at start and on a policy change). Returns the decision; its plan holds the
    /// trimmed slices of the pools looked at, up to the first write the gate refused.
    pub async fn reconcile<A: ClusterApi, G: WriteGate>(
        &mut self,
        snap: &Snapshot,
        api: &A,
        now: DateTime<Utc>,
        mono: Instant,
        mut gate: G,
    ) -> Result<Decision, Error> {
        let (mut decision, assignments) = self.prepare(snap, now, mono);
        if let Some((name, status)) = &decision.status {
            if !gate.may_write().await {
                return Ok(decision);
            }
            api.patch_policy_status(name, status)
                .await
                .map_err(|source| Error::PatchPolicyStatus {
                    name: name.clone(),
                    source,
                })?;
        }
        let Some(assignments) = assignments else {
            return Ok(decision);
        };
        let (held, mut cursor) = self.cursor(snap, &assignments, mono);
        decision.held = held;
        let mut plan = Plan::default();
        let mut refused = false;
        // Deletes (names only) wait until every pool's new slices are written, as when the whole plan was
        // written at once: a pool is complete for the scheduler once its new generation is, so a policy
        // change makes every pool usable after one write each instead of after all of its deletes.
        let mut deletes = vec![];
        while !refused && let Some(mut pool) = cursor.next_pool(&mut self.generations, &mut self.renders) {
            deletes.append(&mut pool.deletes);
            refused = !write(api, &pool.creates, &pool.updates, &[], &mut gate).await?;
            for s in pool.creates.iter_mut().chain(&mut pool.updates) {
                trim_to_what_diff_reads(s);
            }
            plan.extend(pool);
        }
        plan.deletes = deletes;
        if !refused {
            refused = !write(api, &[], &[], &plan.deletes, &mut gate).await?;
        }
        decision.interrupted = refused;
        decision.desired = cursor.desired();
        decision.plan = Some(plan);
        Ok(decision)
    }
}

/// How many of one pool's creates and updates go to the API server at once.
const CONCURRENT_WRITES: usize = 16;

/// One create or replace of a pool's slice.
enum SliceWrite<'a> {
    Create(&'a ResourceSlice),
    Replace(&'a ResourceSlice),
}

/// Creates and updates, then deletes, while the gate allows; `false` once it did not. A pool's creates
/// and updates go out together, up to [`CONCURRENT_WRITES`] at a time with the gate asked once per batch:
/// a pool whose generation changed is incomplete for the scheduler until its last slice has the new one,
/// and one round trip per slice made that window grow with the node's GPUs (after kubelet's start-up wipe,
/// the recreated slices and the survivors' generation bump took 0.3-0.55 s in sequence on a loaded API
/// server). Deletes wait for the rest: a slice removed first would shrink the pool meanwhile.
async fn write<A: ClusterApi, G: WriteGate>(
    api: &A,
    creates: &[ResourceSlice],
    updates: &[ResourceSlice],
    deletes: &[String],
    gate: &mut G,
) -> Result<bool, Error> {
    let writes: Vec<SliceWrite<'_>> = creates
        .iter()
        .map(SliceWrite::Create)
        .chain(updates.iter().map(SliceWrite::Replace))
        .collect();
    for batch in writes.chunks(CONCURRENT_WRITES) {
        if !gate.may_write().await {
            return Ok(false);
        }
        futures::future::try_join_all(batch.iter().map(|w| async move {
            match w {
                SliceWrite::Create(s) => create(api, s).await,
                SliceWrite::Replace(s) => replace(api, s).await,
            }
        }))
        .await?;
    }
    for n in deletes {
        if !gate.may_write().await {
            return Ok(false);
        }
        api.delete_slice(n).await.map_err(|source| Error::DeleteSlice {
            name: n.clone(),
            source,
        })?;
    }
    Ok(true)
}

fn slice_name(s: &ResourceSlice) -> String {
    s.metadata.name.clone().unwrap_or_default()
}

async fn create<A: ClusterApi>(api: &A, s: &ResourceSlice) -> Result<(), Error> {
    match api.create_slice(s).await {
        Ok(()) => Ok(()),
        Err(exists) if exists.downcast_ref::<SliceExists>().is_some() => {
            let mut unconditional = s.clone();
            unconditional.metadata.resource_version = None;
            api.replace_slice(&unconditional)
                .await
                .map_err(|source| Error::ReplaceSlice {
                    name: slice_name(s),
                    source,
                })
        }
        Err(source) => Err(Error::CreateSlice {
            name: slice_name(s),
            source,
        }),
    }
}

/// Replaces `s`; a slice deleted meanwhile (kubelet's start-up wipe) is created again in the same pass.
async fn replace<A: ClusterApi>(api: &A, s: &ResourceSlice) -> Result<(), Error> {
    match api.replace_slice(s).await {
        Ok(()) => Ok(()),
        Err(gone) if gone.downcast_ref::<SliceGone>().is_some() => {
            let mut fresh = s.clone();
            fresh.metadata.resource_version = None;
            fresh.metadata.uid = None;
            create(api, &fresh).await
        }
        Err(source) => Err(Error::ReplaceSlice {
            name: slice_name(s),
            source,
        }),
    }
}

/// One controller replica: an elector and a reconciler. Only a leading replica reconciles.
pub struct Replica {
    pub elector: LeaderElector,
    pub reconciler: Reconciler,
}

impl Replica {
    /// Observes the snapshot's heartbeats, renews or acquires the lease, then reconciles if leading.
    /// Before every write the lease is renewed when due (`clock` read again), so a long publish keeps its
    /// lease and a replica that lost it mid-way stops writing.
    /// A follower observes too, so on taking over it already knows which heartbeats are alive.
    pub async fn tick<S: LeaseStore, A: ClusterApi>(
        &mut self,
        lease: &S,
        api: &A,
        snap: &Snapshot,
        clock: &(dyn Fn() -> DateTime<Utc> + Sync),
        mono: Instant,
    ) -> Result<Option<Decision>, Error> {
        self.reconciler.observe(snap, mono);
        if !self.elector.try_acquire_or_renew(lease, clock()).await {
            return Ok(None);
        }
        let gate = LeaseGate {
            elector: &mut self.elector,
            lease,
            clock,
        };
        self.reconciler
            .reconcile(snap, api, clock(), mono, gate)
            .await
            .map(Some)
    }
}

/// An in-memory API server for slices and policies: applies writes like the real one (UIDs,
/// resourceVersion checks, AlreadyExists, NotFound) and counts them per writer.
#[derive(Debug, Default)]
pub struct InMemoryApi {
    state: Mutex<InMemoryState>,
}

#[derive(Debug, Default)]
struct InMemoryState {
    slices: BTreeMap<String, ResourceSlice>,
    policy_status: BTreeMap<String, GpuPolicyStatus>,
    next_rv: u64,
    writes: usize,
}

impl InMemoryApi {
    /// Slices as a watch would deliver them.
    pub fn slices(&self) -> Vec<ResourceSlice> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .slices
            .values()
            .cloned()
            .collect()
    }

    /// Number of successful writes so far.
    pub fn writes(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).writes
    }

    /// The last status written for a policy.
    pub fn policy_status(&self, name: &str) -> Option<GpuPolicyStatus> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .policy_status
            .get(name)
            .cloned()
    }

    /// Deletes slices behind the controller's back, as kubelet does for a node's driver slices.
    pub fn delete_where(&self, pred: impl Fn(&ResourceSlice) -> bool) {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .slices
            .retain(|_, s| !pred(s));
    }

    fn write(&self, f: impl FnOnce(&mut InMemoryState) -> Result<(), ApiError>) -> Result<(), ApiError> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut state)?;
        state.writes += 1;
        Ok(())
    }
}

impl InMemoryState {
    fn stamp(&mut self, slice: &ResourceSlice) -> ResourceSlice {
        self.next_rv += 1;
        let mut s = slice.clone();
        s.metadata.resource_version = Some(self.next_rv.to_string());
        s
    }
}

impl ClusterApi for InMemoryApi {
    async fn create_slice(&self, slice: &ResourceSlice) -> Result<(), ApiError> {
        self.write(|st| {
            let name = slice.metadata.name.clone().unwrap_or_default();
            if st.slices.contains_key(&name) {
                return Err(Box::new(SliceExists(name)));
            }
            let mut stored = st.stamp(slice);
            stored.metadata.uid = Some(format!("uid-{}", st.next_rv));
            st.slices.insert(name, stored);
            Ok(())
        })
    }

    async fn replace_slice(&self, slice: &ResourceSlice) -> Result<(), ApiError> {
        self.write(|st| {
            let name = slice.metadata.name.clone().unwrap_or_default();
            let current = st.slices.get(&name).ok_or_else(|| SliceGone(name.clone()))?;
            // Without a resourceVersion an update is unconditional, as the API server allows for slices.
            if slice.metadata.resource_version.is_some()
                && current.metadata.resource_version != slice.metadata.resource_version
            {
                return Err(format!("conflict updating resourceslices {name:?}").into());
            }
            let uid = current.metadata.uid.clone();
            let mut stored = st.stamp(slice);
            stored.metadata.uid = uid;
            st.slices.insert(name, stored);
            Ok(())
        })
    }

    async fn delete_slice(&self, name: &str) -> Result<(), ApiError> {
        self.write(|st| {
            st.slices
                .remove(name)
                .map(|_| ())
                .ok_or_else(|| format!("resourceslices {name:?} not found").into())
        })
    }

    async fn patch_policy_status(&self, name: &str, status: &GpuPolicyStatus) -> Result<(), ApiError> {
        self.write(|st| {
            st.policy_status.insert(name.to_string(), status.clone());
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    use super::*;

    /// The in-memory API, counting how many writes are under way at once. Each write yields once before
    /// it is applied, so writes sent together are all started before the first one ends.
    #[derive(Default)]
    struct Counting {
        inner: InMemoryApi,
        in_flight: AtomicUsize,
        most: AtomicUsize,
    }

    impl Counting {
        async fn counted<T>(&self, write: impl Future<Output = T>) -> T {
            let now = self.in_flight.fetch_add(1, SeqCst) + 1;
            self.most.fetch_max(now, SeqCst);
            tokio::task::yield_now().await;
            let out = write.await;
            self.in_flight.fetch_sub(1, SeqCst);
            out
        }
    }

    impl ClusterApi for Counting {
        async fn create_slice(&self, slice: &ResourceSlice) -> Result<(), ApiError> {
            self.counted(self.inner.create_slice(slice)).await
        }
        async fn replace_slice(&self, slice: &ResourceSlice) -> Result<(), ApiError> {
            self.counted(self.inner.replace_slice(slice)).await
        }
        async fn delete_slice(&self, name: &str) -> Result<(), ApiError> {
            self.counted(self.inner.delete_slice(name)).await
        }
        async fn patch_policy_status(&self, name: &str, status: &GpuPolicyStatus) -> Result<(), ApiError> {
            self.inner.patch_policy_status(name, status).await
        }
    }

    fn slice(name: &str, generation: i64) -> ResourceSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"driver": tessera_api::DRIVER_NAME, "nodeName": "node-a",
                     "pool": {"name": "node-a", "generation": generation, "resourceSliceCount": 7}}
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn a_wiped_pools_recreated_slices_and_its_survivors_generation_bump_go_out_together() {
        let api = Counting::default();
        for i in 0..3 {
            api.inner.create_slice(&slice(&format!("s{i}"), 1)).await.unwrap();
        }
        // What kubelet left (3 of 7) is replaced at generation 2, the rest created.
        let updates: Vec<ResourceSlice> = api
            .inner
            .slices()
            .into_iter()
            .map(|mut s| {
                s.spec.pool.generation = 2;
                s
            })
            .collect();
        let creates: Vec<ResourceSlice> = (3..7).map(|i| slice(&format!("s{i}"), 2)).collect();
        let allow = || true;
        assert!(write(&api, &creates, &updates, &[], &mut &allow).await.unwrap());
        assert_eq!(api.most.load(SeqCst), 7, "one round trip for the whole pool");
        let now = api.inner.slices();
        assert_eq!(now.len(), 7);
        assert!(now.iter().all(|s| s.spec.pool.generation == 2), "{now:?}");
    }

    #[tokio::test]
    async fn a_survivor_kubelet_deletes_during_the_pass_is_created_again_in_it() {
        let api = Counting::default();
        api.inner.create_slice(&slice("s0", 1)).await.unwrap();
        let mut update = api.inner.slices().remove(0);
        update.spec.pool.generation = 2;
        api.inner.delete_where(|_| true);
        let allow = || true;
        assert!(write(&api, &[], &[update], &[], &mut &allow).await.unwrap());
        let now = api.inner.slices();
        assert_eq!(now.len(), 1);
        assert_eq!(now[0].spec.pool.generation, 2);
    }

    #[tokio::test]
    async fn a_create_that_finds_its_own_earlier_write_replaces_it() {
        let api = Counting::default();
        api.inner.create_slice(&slice("s0", 1)).await.unwrap();
        let allow = || true;
        assert!(
            write(&api, &[slice("s0", 2)], &[], &[], &mut &allow)
                .await
                .unwrap()
        );
        let now = api.inner.slices();
        assert_eq!(now.len(), 1);
        assert_eq!(now[0].spec.pool.generation, 2);
    }

    #[tokio::test]
    async fn a_closed_gate_writes_nothing() {
        let api = Counting::default();
        let deny = || false;
        assert!(
            !write(&api, &[slice("s0", 1)], &[], &[], &mut &deny)
                .await
                .unwrap()
        );
        assert!(api.inner.slices().is_empty());
    }
}
