//! What `top` draws, as plain data: per node, per GPU, what is published and who holds it, built from
//! ResourceSlices, ResourceClaims and the plugins' per-claim gauges.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, ResourceClaim, ResourceSlice};
use tessera_api::{
    DRIVER_NAME, DeviceName, GpuInfo, NodeInventorySpec, attributes as attr, config::parse_quantity,
};

use super::metrics::{ClaimKey, Usage};

/// Memory slices of a MIG-capable GPU when its slices publish no counters (static layouts): every
/// MIG-capable GPU tessera supports (A30 excepted, which publishes its counters) has 8.
const DEFAULT_MEMORY_SLICES: u32 = 8;

/// The view of the cluster `top` draws.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fleet {
    pub nodes: Vec<NodeView>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct NodeView {
    pub name: String,
    pub gpus: Vec<GpuView>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct GpuView {
    pub index: u32,
    /// `productName`, empty when not published.
    pub product: String,
    /// The GPU's memory in bytes, where a device of it says (whole or shared device, counters).
    pub memory_bytes: Option<u64>,
    /// Device taints on any of its devices, deduplicated (`key=value:Effect`).
    pub taints: Vec<String>,
    pub layout: Layout,
}

/// How a GPU is published and what is held of it.
#[derive(Clone, Debug, PartialEq)]
pub enum Layout {
    /// Published whole; `holders` empty when free.
    Whole { holders: Vec<Holder> },
    /// MIG (dynamic placements or a static layout): `slices` memory slices, the instances that exist
    /// (held, or a static layout's free ones); `dynamic` when placements are offered on demand.
    Mig {
        slices: u32,
        dynamic: bool,
        instances: Vec<MigInstance>,
    },
    /// Shared between claims (consumable capacity or fixed slots).
    Shared { strategy: String, shares: Vec<Share> },
}

/// A claim holding a device, and the pod it is reserved for.
#[derive(Clone, Debug, PartialEq)]
pub struct Holder {
    pub namespace: String,
    pub claim: String,
    /// The pods of `status.reservedFor`; empty while none is.
    pub pods: Vec<String>,
    pub usage: Usage,
}

impl Holder {
    /// `namespace/pod`, or `namespace/claim:NAME` for an allocated claim no pod uses yet; `+N` for more pods.
    pub fn label(&self) -> String {
        match self.pods.as_slice() {
            [] => format!("{}/claim:{}", self.namespace, self.claim),
            [one] => format!("{}/{one}", self.namespace),
            [first, rest @ ..] => format!("{}/{first} +{}", self.namespace, rest.len()),
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct MigInstance {
    pub profile: String,
    /// First memory slice and how many it spans.
    pub start: u32,
    pub size: u32,
    /// Empty when the instance is free (a static layout's).
    pub holders: Vec<Holder>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Share {
    pub holder: Holder,
    /// Memory the share reserved, bytes.
    pub memory_bytes: Option<u64>,
    /// Compute reserved and the ceiling it may burst to, percent of the GPU's SMs.
    pub request_pct: Option<f64>,
    pub ceiling_pct: Option<f64>,
}

fn attribute<'a>(d: &'a Device, name: &str) -> Option<&'a DeviceAttribute> {
    d.attributes.as_ref()?.get(name)
}

fn string_attribute(d: &Device, name: &str) -> Option<String> {
    attribute(d, name)?.string.clone()
}

fn capacity_bytes(d: &Device, name: &str) -> Option<u64> {
    let c = d.capacity.as_ref()?.get(name)?;
    parse_quantity(&c.value.0).ok()
}

/// The memory slices a device consumes from its GPU's counter set (`memory-slice-<k>`).
fn consumed_slices(d: &Device) -> BTreeSet<u32> {
    d.consumes_counters
        .iter()
        .flatten()
        .flat_map(|c| c.counters.keys())
        .filter_map(|k| k.strip_prefix("memory-slice-")?.parse().ok())
        .collect()
}

/// One allocation result of a claim on a tessera device.
struct Allocated<'a> {
    claim: &'a ResourceClaim,
    request: String,
    consumed: BTreeMap<String, String>,
}

/// The published devices of one GPU of one node, and the slice counters they share.
#[derive(Default)]
struct GpuDevices<'a> {
    devices: Vec<(DeviceName, &'a Device)>,
    counter_slices: u32,
    counter_memory: Option<u64>,
}

fn taint_text(t: &k8s_openapi::api::resource::v1::DeviceTaint) -> String {
    match t.value.as_deref() {
        Some(v) if !v.is_empty() => format!("{}={v}:{}", t.key, t.effect),
        _ => format!("{}:{}", t.key, t.effect),
    }
}

fn holder(claim: &ResourceClaim, request: &str, device: &str, usage: &HashMap<ClaimKey, Usage>) -> Holder {
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    let name = claim.metadata.name.clone().unwrap_or_default();
    let pods = claim
        .status
        .iter()
        .flat_map(|s| s.reserved_for.iter().flatten())
        .filter(|r| r.resource == "pods")
        .map(|r| r.name.clone())
        .collect();
    let key = ClaimKey {
        namespace: namespace.clone(),
        claim: name.clone(),
        request: request.to_string(),
        device: device.to_string(),
    };
    Holder {
        usage: usage.get(&key).cloned().unwrap_or_default(),
        namespace,
        claim: name,
        pods,
    }
}

/// The `computeCeiling` of the opaque tessera config that applies to `request` of `claim`, if any; the
/// last matching entry wins, as the plugin applies them in order.
fn configured_ceiling(claim: &ResourceClaim, request: &str) -> Option<f64> {
    let configs = claim
        .status
        .as_ref()?
        .allocation
        .as_ref()?
        .devices
        .as_ref()?
        .config
        .as_ref()?;
    configs
        .iter()
        .filter(|c| {
            c.requests
                .as_ref()
                .is_none_or(|r| r.is_empty() || r.iter().any(|n| n == request))
        })
        .filter_map(|c| c.opaque.as_ref().filter(|o| o.driver == DRIVER_NAME))
        .filter_map(|o| o.parameters.0.pointer("/sharing/mps/computeCeiling")?.as_f64())
        .next_back()
}

fn share(a: &Allocated<'_>, device: &str, usage: &HashMap<ClaimKey, Usage>, d: &Device) -> Share {
    let h = holder(a.claim, &a.request, device, usage);
    let consumed = |k: &str| a.consumed.get(k).and_then(|q| parse_quantity(q).ok());
    // A fixed slot consumes nothing: it is its whole capacity. A consumable-capacity share is what it
    // consumed; the device's capacity is the whole GPU's.
    let slot = d.allow_multiple_allocations != Some(true);
    let own = |k: &str| consumed(k).or_else(|| slot.then(|| capacity_bytes(d, k)).flatten());
    let memory_bytes = own(attr::MEMORY);
    let request_pct = own(attr::COMPUTE)
        .map(|v| v as f64)
        .or(h.usage.request_ratio.map(|r| r * 100.0));
    let ceiling_pct = h
        .usage
        .ceiling_ratio
        .map(|r| r * 100.0)
        .or_else(|| configured_ceiling(a.claim, &a.request))
        .or(request_pct);
    Share {
        holder: h,
        memory_bytes,
        request_pct,
        ceiling_pct,
    }
}

/// The memory a product name states (`NVIDIA A100-SXM4-80GB` → 80 GiB): only to size a static layout's
/// MIG instances when nothing else says how large the GPU is.
fn memory_in_name(product: &str) -> Option<u64> {
    let upper = product.to_ascii_uppercase();
    let end = upper.find("GB")?;
    let digits: String = upper[..end]
        .chars()
        .rev()
        .take_while(char::is_ascii_digit)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    digits.parse::<u64>().ok().map(|gb| gb << 30)
}

/// Memory slices a MIG device spans: the counters it consumes, else what the node's inventory says of
/// the profile's placement, else its memory over the GPU's per slice, else the profile's `<n>g` (what the
/// slices of a static layout of an unknown GPU come closest to).
fn mig_size(
    d: &Device,
    profile: &str,
    start: u32,
    inventory: Option<&GpuInfo>,
    gpu_memory: Option<u64>,
    slices: u32,
) -> u32 {
    let consumed = consumed_slices(d);
    if !consumed.is_empty() {
        return consumed.len() as u32;
    }
    let known = inventory
        .and_then(|g| g.mig.as_ref())
        .and_then(|m| m.profiles.iter().find(|p| p.name == profile))
        .and_then(|p| {
            p.placements
                .iter()
                .find(|pl| pl.start == start)
                .map(|pl| pl.size)
                .or(Some(p.memory_slices))
        })
        .filter(|n| *n > 0);
    if let Some(n) = known {
        return n;
    }
    if let (Some(mem), Some(total)) = (capacity_bytes(d, attr::MEMORY), gpu_memory)
        && total > 0
    {
        return ((mem as f64 * f64::from(slices) / total as f64).round() as u32).clamp(1, slices);
    }
    profile
        .split_once('g')
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or(1)
}

/// Builds the view of every node (or only `only_node`) from the objects the API server returned (the
/// NodeInventories only size a static layout's MIG instances; empty when unknown) and the per-claim usage
/// the plugins reported.
pub fn build(
    slices: &[ResourceSlice],
    claims: &[ResourceClaim],
    inventories: &[NodeInventorySpec],
    usage: &HashMap<ClaimKey, Usage>,
    only_node: Option<&str>,
) -> Fleet {
    // Only each pool's newest generation counts: an older one is being replaced.
    let mut newest: HashMap<&str, i64> = HashMap::new();
    for s in slices.iter().filter(|s| s.spec.driver == DRIVER_NAME) {
        let g = newest.entry(s.spec.pool.name.as_str()).or_insert(i64::MIN);
        *g = (*g).max(s.spec.pool.generation);
    }
    let mut nodes: BTreeMap<String, BTreeMap<u32, GpuDevices<'_>>> = BTreeMap::new();
    // (pool, device) → (node, GPU index), for the allocation results.
    let mut place: HashMap<(&str, &str), (String, u32)> = HashMap::new();
    for s in slices.iter().filter(|s| {
        s.spec.driver == DRIVER_NAME && newest.get(s.spec.pool.name.as_str()) == Some(&s.spec.pool.generation)
    }) {
        let Some(node) = s.spec.node_name.as_deref() else {
            continue;
        };
        if only_node.is_some_and(|n| n != node) {
            continue;
        }
        let gpus = nodes.entry(node.to_string()).or_default();
        for set in s.spec.shared_counters.iter().flatten() {
            let Some(index) = set
                .name
                .strip_prefix("gpu-")
                .and_then(|r| r.strip_suffix("-counters"))
                .and_then(|i| i.parse().ok())
            else {
                continue;
            };
            let g = gpus.entry(index).or_default();
            g.counter_slices = set
                .counters
                .keys()
                .filter(|k| k.starts_with("memory-slice-"))
                .count() as u32;
            g.counter_memory = set
                .counters
                .get("memory")
                .and_then(|c| parse_quantity(&c.value.0).ok());
        }
        for d in s.spec.devices.iter().flatten() {
            let Ok(name) = d.name.parse::<DeviceName>() else {
                continue;
            };
            place.insert(
                (s.spec.pool.name.as_str(), d.name.as_str()),
                (node.to_string(), name.gpu()),
            );
            gpus.entry(name.gpu()).or_default().devices.push((name, d));
        }
    }
    // (node, GPU, device) → its allocations.
    let mut allocated: HashMap<(String, u32, String), Vec<Allocated<'_>>> = HashMap::new();
    for claim in claims {
        let results = claim
            .status
            .iter()
            .filter_map(|s| s.allocation.as_ref()?.devices.as_ref()?.results.as_ref())
            .flatten();
        for r in results.filter(|r| r.driver == DRIVER_NAME) {
            let Some((node, gpu)) = place.get(&(r.pool.as_str(), r.device.as_str())) else {
                continue;
            };
            allocated
                .entry((node.clone(), *gpu, r.device.clone()))
                .or_default()
                .push(Allocated {
                    claim,
                    request: r.request.clone(),
                    consumed: r
                        .consumed_capacity
                        .iter()
                        .flatten()
                        .map(|(k, v)| (k.clone(), v.0.clone()))
                        .collect(),
                });
        }
    }
    let nodes = nodes
        .into_iter()
        .map(|(node, gpus)| NodeView {
            gpus: gpus
                .into_iter()
                .filter(|(_, g)| !g.devices.is_empty())
                .map(|(index, g)| {
                    let inventory = inventories
                        .iter()
                        .filter(|i| i.node_name == node)
                        .flat_map(|i| &i.gpus)
                        .find(|gpu| gpu.index == index);
                    gpu_view(&node, index, g, inventory, &allocated, usage)
                })
                .collect(),
            name: node,
        })
        .collect();
    Fleet { nodes }
}

fn gpu_view(
    node: &str,
    index: u32,
    g: GpuDevices<'_>,
    inventory: Option<&GpuInfo>,
    allocated: &HashMap<(String, u32, String), Vec<Allocated<'_>>>,
    usage: &HashMap<ClaimKey, Usage>,
) -> GpuView {
    let held = |d: &Device| {
        allocated
            .get(&(node.to_string(), index, d.name.clone()))
            .map(Vec::as_slice)
            .unwrap_or_default()
    };
    let product = g
        .devices
        .iter()
        .find_map(|(_, d)| string_attribute(d, attr::PRODUCT_NAME))
        .or_else(|| inventory.map(|i| i.product_name.clone()))
        .unwrap_or_default();
    let memory_bytes = g
        .devices
        .iter()
        .find(|(n, _)| matches!(n, DeviceName::Gpu { .. } | DeviceName::SharedGpu { .. }))
        .and_then(|(_, d)| capacity_bytes(d, attr::MEMORY))
        .or(g.counter_memory)
        .or(inventory.map(|i| i.memory_bytes).filter(|m| *m > 0));
    let mut taints: Vec<String> = g
        .devices
        .iter()
        .flat_map(|(_, d)| d.taints.iter().flatten().map(taint_text))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    taints.sort();
    let holders_of = |d: &Device| -> Vec<Holder> {
        held(d)
            .iter()
            .map(|a| holder(a.claim, &a.request, &d.name, usage))
            .collect()
    };
    let whole = g
        .devices
        .iter()
        .find(|(n, _)| matches!(n, DeviceName::Gpu { .. }));
    let migs: Vec<_> = g
        .devices
        .iter()
        .filter(|(n, _)| matches!(n, DeviceName::Mig { .. } | DeviceName::SharedMig { .. }))
        .collect();
    let shared: Vec<_> = g
        .devices
        .iter()
        .filter(|(n, _)| matches!(n, DeviceName::SharedGpu { .. } | DeviceName::ShareSlot { .. }))
        .collect();
    let whole_holders = whole.map(|(_, d)| holders_of(d)).unwrap_or_default();
    let layout = if !shared.is_empty() {
        let strategy = shared
            .iter()
            .find_map(|(_, d)| string_attribute(d, attr::SHARING_STRATEGY))
            .unwrap_or_default();
        let shares = shared
            .iter()
            .flat_map(|(_, d)| held(d).iter().map(|a| share(a, &d.name, usage, d)))
            .collect();
        Layout::Shared { strategy, shares }
    } else if migs.is_empty() || !whole_holders.is_empty() {
        Layout::Whole {
            holders: whole_holders,
        }
    } else {
        let dynamic = migs.iter().any(|(_, d)| !consumed_slices(d).is_empty());
        let slices = [
            g.counter_slices,
            inventory
                .and_then(|i| i.mig.as_ref())
                .map_or(0, |m| m.memory_slices),
            DEFAULT_MEMORY_SLICES,
        ]
        .into_iter()
        .find(|n| *n > 0)
        .unwrap_or(DEFAULT_MEMORY_SLICES);
        let mut instances: Vec<MigInstance> = migs
            .iter()
            .filter_map(|(n, d)| {
                let (DeviceName::Mig { profile, start, .. } | DeviceName::SharedMig { profile, start, .. }) =
                    n
                else {
                    return None;
                };
                let holders = holders_of(d);
                // Dynamic placements not held are possibilities, not instances.
                if dynamic && holders.is_empty() {
                    return None;
                }
                let profile = string_attribute(d, attr::MIG_PROFILE).unwrap_or_else(|| profile.clone());
                Some(MigInstance {
                    size: mig_size(
                        d,
                        &profile,
                        *start,
                        inventory,
                        memory_bytes.or_else(|| memory_in_name(&product)),
                        slices,
                    ),
                    profile,
                    start: *start,
                    holders,
                })
            })
            .collect();
        instances.sort_by_key(|i| i.start);
        Layout::Mig {
            slices,
            dynamic,
            instances,
        }
    };
    GpuView {
        index,
        product,
        memory_bytes,
        taints,
        layout,
    }
}
