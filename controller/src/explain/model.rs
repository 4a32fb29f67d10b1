//! What the allocator sees on one node: the devices of the pools that target it, the counters left in
//! each counter set after the claims already allocated, and which claims hold which device.
//!
//! Mirrors `k8s.io/dynamic-resource-allocation/structured` (the incubating allocator kube-scheduler 1.37
//! runs): only the newest generation of a pool counts, an incomplete pool offers no device, counters are
//! charged by every allocated device of the pool (whether or not its slice targets the node).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, DeviceTaint, DeviceTaintRule, ResourceClaim, ResourceSlice};

use crate::cel::{DeviceView, Quantity};

/// (driver, pool, device).
pub type DeviceId = (String, String, String);

/// (driver, pool).
pub type PoolId = (String, String);

/// One device the node can use.
pub struct NodeDevice<'a> {
    pub id: DeviceId,
    pub device: &'a Device,
    pub view: DeviceView,
    /// Whether the device's pool is complete (all its slices of the newest generation are present).
    pub pool_complete: bool,
    /// Taints DeviceTaintRules put on the device, with the rule's name.
    pub rule_taints: Vec<(String, DeviceTaint)>,
}

impl NodeDevice<'_> {
    pub fn name(&self) -> &str {
        &self.id.2
    }

    pub fn multi_allocatable(&self) -> bool {
        self.device.allow_multiple_allocations.unwrap_or(false)
    }
}

/// Counter sets of one pool: set name → counter name → amount.
pub type Counters = BTreeMap<String, BTreeMap<String, Quantity>>;

/// What allocated claims hold.
#[derive(Default)]
pub struct AllocatedState {
    /// Devices held whole, with the claims holding them.
    pub exclusive: BTreeMap<DeviceId, Vec<String>>,
    /// Multi-allocatable devices with at least one share, with the claims holding shares.
    pub shared: BTreeMap<DeviceId, Vec<String>>,
    /// Capacity consumed by shares, per device.
    pub consumed: BTreeMap<DeviceId, BTreeMap<String, Quantity>>,
}

impl AllocatedState {
    /// The state every allocated claim in `claims` adds up to, leaving out `except` (namespace/name).
    pub fn from_claims(claims: &[ResourceClaim], except: &BTreeSet<String>) -> Self {
        let mut state = Self::default();
        for claim in claims {
            let key = claim_key(claim);
            if except.contains(&key) {
                continue;
            }
            let results = claim
                .status
                .as_ref()
                .and_then(|s| s.allocation.as_ref())
                .and_then(|a| a.devices.as_ref())
                .and_then(|d| d.results.as_ref());
            for r in results.into_iter().flatten() {
                let id = (r.driver.clone(), r.pool.clone(), r.device.clone());
                if r.share_id.is_none() {
                    state.exclusive.entry(id).or_default().push(key.clone());
                    continue;
                }
                state.shared.entry(id.clone()).or_default().push(key.clone());
                let consumed = state.consumed.entry(id).or_default();
                for (name, q) in r.consumed_capacity.iter().flatten() {
                    if let Ok(q) = Quantity::parse(&q.0) {
                        let total = consumed.entry(name.clone()).or_insert(Quantity::from_int(0));
                        *total = total.checked_add(&q).unwrap_or(*total);
                    }
                }
            }
        }
        state
    }

    /// Whether the allocator counts the device as allocated (whole or shared) when charging counters.
    pub fn is_allocated(&self, id: &DeviceId) -> bool {
        self.exclusive.contains_key(id) || self.shared.contains_key(id)
    }

    /// The claims holding the device, whole or shared.
    pub fn holders(&self, id: &DeviceId) -> Vec<String> {
        let mut out: Vec<String> = self.exclusive.get(id).into_iter().flatten().cloned().collect();
        out.extend(self.shared.get(id).into_iter().flatten().cloned());
        out
    }
}

/// `namespace/name` of a claim.
pub fn claim_key(claim: &ResourceClaim) -> String {
    format!(
        "{}/{}",
        claim.metadata.namespace.as_deref().unwrap_or("default"),
        claim.metadata.name.as_deref().unwrap_or("")
    )
}

/// One node as the allocator sees it.
pub struct NodeModel<'a> {
    pub name: String,
    pub devices: Vec<NodeDevice<'a>>,
    /// Counters left per pool after the allocated claims.
    pub available: BTreeMap<PoolId, Counters>,
    /// Per pool, set and counter: the allocated claims charging it.
    pub charged_by: BTreeMap<(PoolId, String, String), Vec<String>>,
}

/// The newest generation of each pool: (slices, complete).
fn pools(slices: &[ResourceSlice]) -> BTreeMap<PoolId, (Vec<&ResourceSlice>, bool)> {
    let mut newest: BTreeMap<PoolId, i64> = BTreeMap::new();
    for s in slices {
        let id = (s.spec.driver.clone(), s.spec.pool.name.clone());
        let g = newest.entry(id).or_insert(s.spec.pool.generation);
        *g = (*g).max(s.spec.pool.generation);
    }
    let mut out: BTreeMap<PoolId, (Vec<&ResourceSlice>, bool)> = BTreeMap::new();
    for s in slices {
        let id = (s.spec.driver.clone(), s.spec.pool.name.clone());
        if newest.get(&id) == Some(&s.spec.pool.generation) {
            out.entry(id).or_default().0.push(s);
        }
    }
    for (slices, complete) in out.values_mut() {
        // The allocator visits a pool's slices by name.
        slices.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let want = slices.first().map_or(0, |s| s.spec.pool.resource_slice_count);
        *complete = slices.len() as i64 == want;
    }
    out
}

/// The nodes the slices name, in order.
pub fn node_names(slices: &[ResourceSlice]) -> Vec<String> {
    let set: BTreeSet<String> = slices.iter().filter_map(|s| s.spec.node_name.clone()).collect();
    set.into_iter().collect()
}

/// The taints of the rules whose selector (driver, pool, device; each optional) names the device.
pub fn rule_taints(rules: &[DeviceTaintRule], id: &DeviceId) -> Vec<(String, DeviceTaint)> {
    rules
        .iter()
        .filter(|r| {
            let s = r.spec.device_selector.as_ref();
            let is = |want: Option<&String>, have: &str| want.is_none_or(|w| w == have);
            is(s.and_then(|s| s.driver.as_ref()), &id.0)
                && is(s.and_then(|s| s.pool.as_ref()), &id.1)
                && is(s.and_then(|s| s.device.as_ref()), &id.2)
        })
        .map(|r| (r.metadata.name.clone().unwrap_or_default(), r.spec.taint.clone()))
        .collect()
}

fn targets(slice: &ResourceSlice, node: &str) -> bool {
    slice.spec.node_name.as_deref() == Some(node) || slice.spec.all_nodes == Some(true)
}

impl<'a> NodeModel<'a> {
    pub fn build(
        node: &str,
        slices: &'a [ResourceSlice],
        state: &AllocatedState,
        rules: &[DeviceTaintRule],
    ) -> Self {
        let mut model = NodeModel {
            name: node.to_string(),
            devices: Vec::new(),
            available: BTreeMap::new(),
            charged_by: BTreeMap::new(),
        };
        for (pool_id, (pool_slices, complete)) in pools(slices) {
            if !pool_slices.iter().any(|s| targets(s, node)) {
                continue;
            }
            let mut counters = Counters::new();
            for s in &pool_slices {
                for set in s.spec.shared_counters.iter().flatten() {
                    let entry = counters.entry(set.name.clone()).or_default();
                    for (name, c) in &set.counters {
                        if let Ok(q) = Quantity::parse(&c.value.0) {
                            entry.insert(name.clone(), q);
                        }
                    }
                }
            }
            for s in &pool_slices {
                for d in s.spec.devices.iter().flatten() {
                    let id = (pool_id.0.clone(), pool_id.1.clone(), d.name.clone());
                    if state.is_allocated(&id) {
                        for consumption in d.consumes_counters.iter().flatten() {
                            let Some(set) = counters.get_mut(&consumption.counter_set) else {
                                continue;
                            };
                            for (name, c) in &consumption.counters {
                                let (Some(left), Ok(q)) = (set.get_mut(name), Quantity::parse(&c.value.0))
                                else {
                                    continue;
                                };
                                *left = left.checked_sub(&q).unwrap_or(*left);
                                model
                                    .charged_by
                                    .entry((pool_id.clone(), consumption.counter_set.clone(), name.clone()))
                                    .or_default()
                                    .extend(state.holders(&id));
                            }
                        }
                    }
                    if targets(s, node) {
                        model.devices.push(NodeDevice {
                            view: DeviceView::from_device(&pool_id.0, d),
                            rule_taints: rule_taints(rules, &id),
                            id,
                            device: d,
                            pool_complete: complete,
                        });
                    }
                }
            }
            model.available.insert(pool_id, counters);
        }
        for claims in model.charged_by.values_mut() {
            claims.sort();
            claims.dedup();
        }
        model
    }
}
