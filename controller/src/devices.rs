//! The devices one GPU is published as, per device model.
//!
//! | model | devices per 7-slice GPU | counters |
//! |---|---|---|
//! | whole | `gpu-<i>` | — |
//! | dynamic MIG | 25 placements + `gpu-<i>` = 26 | one set per GPU: engines, SMs, memory, 8 memory slices |
//! | static MIG | the layout's instances | — |
//! | shared (consumable capacity) | `gpu-<i>-shared` | — |
//! | share slots (fallback) | `gpu-<i>-share-<k>` × N | — |
//!
//! A GPU is published under exactly one model, so whole, MIG and shared devices of one GPU never coexist
//! unless counters make them mutually exclusive (dynamic MIG). Shared GPUs stay out of dynamic MIG: a
//! multi-allocatable device that consumes counters has no documented allocator semantics (is the counter
//! taken once per device or once per share?), and mixing them would risk handing one GPU out twice.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::{Mutex, OnceLock},
};

use k8s_openapi::{
    api::resource::v1::{
        CapacityRequestPolicy, CapacityRequestPolicyRange, Counter, CounterSet, Device, DeviceAttribute,
        DeviceCapacity, DeviceCounterConsumption, DeviceTaint,
    },
    apimachinery::pkg::api::resource::Quantity as K8sQuantity,
};
use tessera_api::{
    DeviceName, GpuInfo, MigPlacement, MigProfileInfo, NodeInventorySpec,
    attributes::{self as attr, int, string},
    policy::{QuotaCounter, SharingStrategy},
};

use crate::{cel::Semver, cel::quantity::format_binary, features::ApiFeatures};

/// Taint put on every device of a GPU the plugin reported unhealthy (when the server supports taints;
/// otherwise such a GPU is not published at all).
pub const UNHEALTHY_TAINT: &str = "gpu.tessera.dev/unhealthy";

const MIB: u64 = 1 << 20;

/// The model a GPU is published under, after the policy picked it and before cluster support is checked.
#[derive(Clone, Debug, PartialEq)]
pub enum Model {
    /// What a GPU gets when no rule matches: dynamic MIG where possible, else whole.
    Default,
    Whole,
    DynamicMig {
        profiles: Vec<String>,
        fallback_layout: Vec<LayoutEntry>,
        /// `warm.window` of the rule in seconds (0: keep nothing), published as `warmSeconds`.
        warm_seconds: u64,
        /// `quotaCounters`: counters added to each GPU's set for quota systems, sorted, no repeats.
        quota_counters: Vec<QuotaCounter>,
    },
    StaticMig {
        layout: Vec<LayoutEntry>,
        warm_seconds: u64,
    },
    Shared {
        strategy: SharingStrategy,
        memory_step: u64,
        fallback_slots: u32,
        warm_seconds: u64,
        /// Which claims share an MPS daemon; published as `mpsTenancy` only when `Shared`.
        tenancy: tessera_api::policy::MpsTenancy,
    },
}

impl Model {
    /// How long the plugin keeps what it made for a released claim of this model's devices (seconds).
    pub fn warm_seconds(&self) -> u64 {
        match self {
            Self::DynamicMig { warm_seconds, .. }
            | Self::StaticMig { warm_seconds, .. }
            | Self::Shared { warm_seconds, .. } => *warm_seconds,
            Self::Default | Self::Whole => 0,
        }
    }
}

/// One MIG instance of a static layout, resolved against the GPU's profiles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutEntry {
    pub profile: String,
    pub start: u32,
}

/// What one GPU contributes to its node's pool.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuDevices {
    pub devices: Vec<Device>,
    pub counter_set: Option<CounterSet>,
}

/// True when the plugin can create MIG instances on demand: MIG is on, or can be turned on without a
/// reset (A100 needs a reset, so it only takes part while an administrator keeps MIG mode on).
pub fn supports_dynamic_mig(gpu: &GpuInfo) -> bool {
    gpu.mig
        .as_ref()
        .is_some_and(|m| (m.enabled || m.mode_toggle_without_reset) && !m.profiles.is_empty())
}

/// Finds `name` among the GPU's profiles: an exact name (`3g.40gb`), or `<n>g` for the `<n>g.` profile
/// with the fewest memory slices and no media-extension suffix.
pub fn find_profile<'a>(gpu: &'a GpuInfo, name: &str) -> Option<&'a MigProfileInfo> {
    let mig = gpu.mig.as_ref()?;
    mig.profile(name).or_else(|| {
        let prefix = format!("{name}.");
        mig.profiles
            .iter()
            .filter(|p| p.name.starts_with(&prefix) && !p.name.contains(['+', '-']))
            .min_by_key(|p| (p.memory_slices, p.memory_mib))
    })
}

/// Parses `profile@start` and checks it against the GPU.
pub fn resolve_layout(gpu: &GpuInfo, layout: &[String]) -> Result<Vec<LayoutEntry>, String> {
    let mut taken: Vec<(MigPlacement, &str)> = vec![];
    let mut entries = vec![];
    for item in layout {
        let (name, start) = item
            .split_once('@')
            .ok_or_else(|| format!("layout entry {item:?} is not profile@start"))?;
        let start: u32 = start
            .parse()
            .map_err(|_| format!("layout entry {item:?}: start is not a number"))?;
        let profile = find_profile(gpu, name).ok_or_else(|| {
            format!(
                "layout entry {item:?}: {} has no MIG profile {name:?}",
                gpu.product_name
            )
        })?;
        let placement = *profile
            .placements
            .iter()
            .find(|p| p.start == start)
            .ok_or_else(|| {
                let starts: Vec<u32> = profile.placements.iter().map(|p| p.start).collect();
                format!(
                    "layout entry {item:?}: {} cannot start at {start} (possible: {starts:?})",
                    profile.name
                )
            })?;
        if let Some((_, other)) = taken.iter().find(|(p, _)| p.overlaps(&placement)) {
            return Err(format!("layout entries {other:?} and {item:?} overlap"));
        }
        let count = taken.iter().filter(|(_, other)| {
            find_profile(gpu, other.split('@').next().unwrap_or_default()).map(|p| &p.name)
                == Some(&profile.name)
        });
        if count.count() as u32 >= profile.instance_count {
            return Err(format!(
                "layout has more than {} instances of {}",
                profile.instance_count, profile.name
            ));
        }
        taken.push((placement, item));
        entries.push(LayoutEntry {
            profile: profile.name.clone(),
            start,
        });
    }
    Ok(entries)
}

fn quantity(v: u64) -> K8sQuantity {
    K8sQuantity(format_binary(v as i64))
}

fn capacity(v: u64) -> DeviceCapacity {
    DeviceCapacity {
        value: quantity(v),
        request_policy: None,
    }
}

/// Attributes every device of `gpu` carries.
fn gpu_attributes(node: &NodeInventorySpec, gpu: &GpuInfo, kind: &str) -> BTreeMap<String, DeviceAttribute> {
    let versions = attr::DriverVersions {
        driver: node.driver_version.as_deref(),
        cuda_driver: node.cuda_driver_version.as_deref(),
    };
    attr::of_gpu(gpu, versions, kind, |raw| {
        Semver::parse_normalized(raw).ok().map(|v| v.to_string())
    })
}

fn whole_device(node: &NodeInventorySpec, gpu: &GpuInfo) -> Device {
    Device {
        name: DeviceName::Gpu { gpu: gpu.index }.to_string(),
        attributes: Some(gpu_attributes(node, gpu, attr::TYPE_GPU)),
        capacity: Some(
            [
                (attr::MEMORY.to_string(), capacity(gpu.memory_bytes)),
                (
                    attr::MULTIPROCESSORS.to_string(),
                    capacity(gpu.multiprocessors.into()),
                ),
            ]
            .into(),
        ),
        ..Default::default()
    }
}

fn mig_device(node: &NodeInventorySpec, gpu: &GpuInfo, profile: &MigProfileInfo, start: u32) -> Device {
    let mut attributes = gpu_attributes(node, gpu, attr::TYPE_MIG);
    attr::add_mig(&mut attributes, &profile.name, start);
    let caps = [
        (attr::MEMORY, profile.memory_mib * MIB),
        (attr::MULTIPROCESSORS, profile.multiprocessors.into()),
        (attr::COPY_ENGINES, profile.copy_engines.into()),
        (attr::DECODERS, profile.decoders.into()),
        (attr::ENCODERS, profile.encoders.into()),
        (attr::JPEG_ENGINES, profile.jpeg_engines.into()),
        (attr::OFA_ENGINES, profile.ofa_engines.into()),
    ];
    Device {
        name: DeviceName::Mig {
            gpu: gpu.index,
            profile: profile.name.clone(),
            start,
        }
        .to_string(),
        attributes: Some(attributes),
        capacity: Some(
            caps.into_iter()
                .map(|(k, v)| (k.to_string(), capacity(v)))
                .collect(),
        ),
        ..Default::default()
    }
}

/// Counter names of a GPU's counter set.
const C_MEMORY: &str = "memory";
const C_SMS: &str = "multiprocessors";
const C_CE: &str = "copy-engines";
const C_DEC: &str = "decoders";
const C_ENC: &str = "encoders";
const C_JPEG: &str = "jpeg-engines";
const C_OFA: &str = "ofa-engines";

fn memory_slice_counter(k: u32) -> String {
    format!("memory-slice-{k}")
}

/// Name of GPU `index`'s counter set (unique in the pool, a DNS label).
pub fn counter_set_name(index: u32) -> String {
    format!("gpu-{index}-counters")
}

fn profile_amounts(p: &MigProfileInfo) -> [(&'static str, u64); 7] {
    [
        (C_MEMORY, p.memory_mib * MIB),
        (C_SMS, p.multiprocessors.into()),
        (C_CE, p.copy_engines.into()),
        (C_DEC, p.decoders.into()),
        (C_ENC, p.encoders.into()),
        (C_JPEG, p.jpeg_engines.into()),
        (C_OFA, p.ofa_engines.into()),
    ]
}

/// The counter set of a GPU and which of its engine/SM/memory counters devices consume.
///
/// Each engine/SM/memory counter is the most that any combination of MIG instances the hardware allows
/// (non-overlapping placements, at most `instanceCount` per profile) can use, and at least the whole GPU's
/// amount. So every combination the hardware allows fits the counters, while the counters still stop what
/// the hardware forbids beyond overlap: two `+me` instances both need the GPU's single OFA.
///
/// The memory-slice counters already refuse overlapping placements. An engine/SM/memory counter that no
/// set of non-overlapping placements can overdraw (on an H100 all but the media engines a `+me` instance
/// takes whole) never decides an allocation, so it is left out of the set and of every device's
/// consumption: kube-scheduler validates each device/counter pair of every candidate node on every pod
/// (`validateDeviceCounterConsumption`, half its CPU time for dynamic-MIG pods at 1,000 nodes on 1.38),
/// and only the pairs that can bind are worth that.
///
/// `quota` (a rule's `quotaCounters`) puts counters in regardless: they never bind either, but a quota
/// system that charges by counter (Kueue's counter sources) reads what each device consumes of them.
fn counter_set(gpu: &GpuInfo, quota: &[QuotaCounter]) -> (CounterSet, BTreeSet<&'static str>) {
    let mig = gpu.mig.as_ref().expect("only called for MIG-capable GPUs");
    let mut max: BTreeMap<&'static str, u64> = BTreeMap::new();
    let whole_engines = mig
        .profiles
        .iter()
        .max_by_key(|p| p.memory_slices)
        .map(profile_amounts);
    for (k, v) in whole_engines.into_iter().flatten() {
        max.insert(k, v);
    }
    max.insert(C_MEMORY, max[C_MEMORY].max(gpu.memory_bytes));
    max.insert(C_SMS, max[C_SMS].max(gpu.multiprocessors.into()));
    // The searches only depend on the profile table; clusters have few distinct tables and many GPUs.
    type Maxima = (BTreeMap<&'static str, u64>, BTreeMap<&'static str, u64>);
    static CACHE: OnceLock<Mutex<HashMap<String, Maxima>>> = OnceLock::new();
    let key = serde_json::to_string(&mig.profiles).unwrap_or_default();
    let cache = CACHE.get_or_init(Default::default);
    let cached = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key).cloned();
    let (allowed, unlimited) = cached.unwrap_or_else(|| {
        let m = (
            combination_maxima(&mig.profiles, true),
            combination_maxima(&mig.profiles, false),
        );
        cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, m.clone());
        m
    });
    for (k, v) in allowed {
        let e = max.entry(k).or_default();
        *e = (*e).max(v);
    }
    let binding: BTreeSet<&'static str> = max
        .iter()
        .filter(|&(k, v)| unlimited.get(k).is_some_and(|u| u > v))
        .map(|(k, _)| *k)
        .chain(quota.iter().map(|q| match q {
            QuotaCounter::Memory => C_MEMORY,
        }))
        .collect();
    let mut counters: BTreeMap<String, Counter> = max
        .into_iter()
        .filter(|(k, _)| binding.contains(k))
        .map(|(k, v)| (k.to_string(), Counter { value: quantity(v) }))
        .collect();
    for k in 0..mig.memory_slices {
        counters.insert(memory_slice_counter(k), Counter { value: quantity(1) });
    }
    (
        CounterSet {
            name: counter_set_name(gpu.index),
            counters,
        },
        binding,
    )
}

/// Per resource, the most any combination of non-overlapping MIG placements uses: with `instance_limits`,
/// only combinations the hardware allows (at most `instanceCount` of each profile); without, every one the
/// memory-slice counters alone would let through.
fn combination_maxima(profiles: &[MigProfileInfo], instance_limits: bool) -> BTreeMap<&'static str, u64> {
    let mut max = BTreeMap::new();
    let placements: Vec<(&MigProfileInfo, MigPlacement)> = profiles
        .iter()
        .flat_map(|p| p.placements.iter().map(move |pl| (p, *pl)))
        .collect();
    fn dfs<'a>(
        placements: &[(&'a MigProfileInfo, MigPlacement)],
        from: usize,
        instance_limits: bool,
        chosen: &mut Vec<(&'a MigProfileInfo, MigPlacement)>,
        max: &mut BTreeMap<&'static str, u64>,
    ) {
        for (k, _) in profile_amounts(placements[0].0) {
            let sum: u64 = chosen
                .iter()
                .map(|(p, _)| {
                    profile_amounts(p)
                        .iter()
                        .find(|(n, _)| *n == k)
                        .map_or(0, |x| x.1)
                })
                .sum();
            let e = max.entry(k).or_default();
            *e = (*e).max(sum);
        }
        for i in from..placements.len() {
            let (p, pl) = placements[i];
            let same_profile = chosen.iter().filter(|(q, _)| q.name == p.name).count() as u32;
            if (instance_limits && same_profile >= p.instance_count)
                || chosen.iter().any(|(_, c)| c.overlaps(&pl))
            {
                continue;
            }
            chosen.push((p, pl));
            dfs(placements, i + 1, instance_limits, chosen, max);
            chosen.pop();
        }
    }
    if !placements.is_empty() {
        dfs(&placements, 0, instance_limits, &mut vec![], &mut max);
    }
    max
}

fn consumption(set: &str, counters: BTreeMap<String, Counter>) -> Option<Vec<DeviceCounterConsumption>> {
    Some(vec![DeviceCounterConsumption {
        counter_set: set.to_string(),
        counters,
        ..Default::default()
    }])
}

/// Whether a dynamic-MIG rule's `profiles` (empty: all) publish the profile `name` (`3g.40gb` or `3g`).
pub fn allows_profile(allowed: &[String], name: &str) -> bool {
    allowed.is_empty()
        || allowed
            .iter()
            .any(|a| a == name || name.starts_with(&format!("{a}.")))
}

/// The profiles a GPU publishes under dynamic MIG with `model`, or `None` when the GPU is not published as
/// dynamic MIG (another model, or a cluster without partitionable devices).
pub fn dynamic_mig_profiles<'a>(
    gpu: &'a GpuInfo,
    model: &Model,
    features: ApiFeatures,
) -> Option<Vec<&'a MigProfileInfo>> {
    let allowed: &[String] = match model {
        Model::Default => &[],
        Model::DynamicMig { profiles, .. } => profiles,
        _ => return None,
    };
    if !features.partitionable || !supports_dynamic_mig(gpu) || (!gpu.healthy && !features.taints) {
        return None;
    }
    let mig = gpu.mig.as_ref()?;
    Some(
        mig.profiles
            .iter()
            .filter(|p| allows_profile(allowed, &p.name))
            .collect(),
    )
}

/// A MIG placement's device as selectors see it (what demand for a profile is judged against).
pub fn mig_selector_view(
    node: &NodeInventorySpec,
    gpu: &GpuInfo,
    profile: &MigProfileInfo,
    start: u32,
) -> Device {
    mig_device(node, gpu, profile, start)
}

/// Dynamic MIG: every placement of the allowed profiles plus the whole GPU, all drawing on one counter set.
///
/// Order matters: the scheduler's allocator takes the first device in slice order that matches and whose
/// counters are free. Devices are ordered
/// 1. by profile size, smallest first, so a request that several profiles satisfy ("a MIG device with at
///    least 16Gi") gets the smallest that fits;
/// 2. within a profile, by placement start, **highest first**, so small instances pack from the top of the
///    GPU (slices 7, 6, …) and keep the bottom half (slices 0–3) free for as long as possible: that is
///    the only place a 4g fits, and one of the two places a 3g fits;
/// 3. the whole GPU last, so it is taken only by requests nothing smaller satisfies.
///
/// `quota` (the rule's `quotaCounters`) adds those counters to the set and to every device's consumption.
pub fn dynamic_mig(
    node: &NodeInventorySpec,
    gpu: &GpuInfo,
    allowed: &[String],
    quota: &[QuotaCounter],
) -> GpuDevices {
    let mig = gpu.mig.as_ref().expect("only called for MIG-capable GPUs");
    let (set, binding) = counter_set(gpu, quota);
    let mut profiles: Vec<&MigProfileInfo> = mig
        .profiles
        .iter()
        .filter(|p| allows_profile(allowed, &p.name))
        .collect();
    profiles.sort_by_key(|p| {
        (
            p.memory_slices,
            p.compute_slices,
            p.memory_mib,
            p.name.contains('+'),
            p.name.clone(),
        )
    });
    let mut devices = vec![];
    for p in profiles {
        let mut placements = p.placements.clone();
        placements.sort_by_key(|pl| std::cmp::Reverse(pl.start));
        for pl in placements {
            let mut counters: BTreeMap<String, Counter> = profile_amounts(p)
                .into_iter()
                .filter(|(k, v)| *v > 0 && binding.contains(k))
                .map(|(k, v)| (k.to_string(), Counter { value: quantity(v) }))
                .collect();
            for k in pl.start..pl.start + pl.size {
                counters.insert(memory_slice_counter(k), Counter { value: quantity(1) });
            }
            devices.push(Device {
                consumes_counters: consumption(&set.name, counters),
                ..mig_device(node, gpu, p, pl.start)
            });
        }
    }
    devices.push(Device {
        consumes_counters: consumption(&set.name, set.counters.clone()),
        ..whole_device(node, gpu)
    });
    GpuDevices {
        devices,
        counter_set: Some(set),
    }
}

/// Static MIG: the layout's instances (already checked by [`resolve_layout`]), no counters needed since
/// they do not overlap.
pub fn static_mig(node: &NodeInventorySpec, gpu: &GpuInfo, layout: &[LayoutEntry]) -> GpuDevices {
    let devices = layout
        .iter()
        .filter_map(|e| find_profile(gpu, &e.profile).map(|p| mig_device(node, gpu, p, e.start)))
        .collect();
    GpuDevices {
        devices,
        counter_set: None,
    }
}

fn shared_attributes(
    node: &NodeInventorySpec,
    gpu: &GpuInfo,
    strategy: SharingStrategy,
) -> BTreeMap<String, DeviceAttribute> {
    let mut a = gpu_attributes(node, gpu, attr::TYPE_SHARED);
    a.insert(attr::SHARING_STRATEGY.into(), string(strategy.as_str()));
    a
}

/// Consumable capacity: one multi-allocatable device per GPU with `memory` (bytes, in steps of
/// `memory_step`) and `compute` (percent, 0 to 100, steps of 1). A claim that names no memory gets all
/// of it: a pod that does not say how much it needs is not squeezed next to others. A claim that names
/// memory and no compute reserves none (default 0) and gets no MPS thread limit from it: a user who asked
/// for 10Gi expects the GPU's other 10Gi shares beside it, which a default of 100 would shut out.
/// Capacities other than these two are left off: on a multi-allocatable device an unrequested capacity
/// without a policy counts as fully consumed, which would make the device exclusive again.
/// The `compute` a share that does not name one consumes: none.
pub const COMPUTE_UNREQUESTED: u64 = 0;

pub fn shared(
    node: &NodeInventorySpec,
    gpu: &GpuInfo,
    strategy: SharingStrategy,
    memory_step: u64,
) -> GpuDevices {
    let step = memory_step.max(MIB);
    let max = (gpu.memory_bytes / step).max(1) * step;
    let policy = |value: u64, default: u64, min: u64, max: u64, step: u64| DeviceCapacity {
        value: quantity(value),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(quantity(default)),
            valid_range: Some(CapacityRequestPolicyRange {
                min: quantity(min),
                max: Some(quantity(max)),
                step: Some(quantity(step)),
            }),
            valid_values: None,
        }),
    };
    let device = Device {
        name: DeviceName::SharedGpu { gpu: gpu.index }.to_string(),
        attributes: Some(shared_attributes(node, gpu, strategy)),
        capacity: Some(
            [
                (
                    attr::MEMORY.to_string(),
                    policy(gpu.memory_bytes, max, step, max, step),
                ),
                (
                    attr::COMPUTE.to_string(),
                    policy(100, COMPUTE_UNREQUESTED, 0, 100, 1),
                ),
            ]
            .into(),
        ),
        allow_multiple_allocations: Some(true),
        ..Default::default()
    };
    GpuDevices {
        devices: vec![device],
        counter_set: None,
    }
}

/// Fallback without consumable capacity: `slots` equal, exclusive slots, each with 1/N of the memory
/// (rounded down to MiB) and of the compute percentage.
pub fn share_slots(
    node: &NodeInventorySpec,
    gpu: &GpuInfo,
    strategy: SharingStrategy,
    slots: u32,
) -> GpuDevices {
    let slots = slots.max(1);
    let memory = gpu.memory_bytes / u64::from(slots) / MIB * MIB;
    let devices = (0..slots)
        .map(|slot| Device {
            name: DeviceName::ShareSlot { gpu: gpu.index, slot }.to_string(),
            attributes: Some(shared_attributes(node, gpu, strategy)),
            capacity: Some(
                [
                    (attr::MEMORY.to_string(), capacity(memory)),
                    (attr::COMPUTE.to_string(), capacity(u64::from(100 / slots))),
                ]
                .into(),
            ),
            ..Default::default()
        })
        .collect();
    GpuDevices {
        devices,
        counter_set: None,
    }
}

/// The health taints of `taints` that go on device `d` of GPU `gpu`: the GPU's, then its MIG placement's.
pub fn health_taints_of(gpu: u32, d: &Device, taints: &crate::health::NodeTaints) -> Vec<DeviceTaint> {
    use crate::health::Target;
    let mut all: Vec<DeviceTaint> = taints.get(&Target::Gpu(gpu)).cloned().unwrap_or_default();
    if let Ok(DeviceName::Mig { profile, start, .. } | DeviceName::SharedMig { profile, start, .. }) =
        d.name.parse::<DeviceName>()
    {
        let mig = tessera_api::inventory::MigDeviceRef { profile, start };
        all.extend(taints.get(&Target::Mig(gpu, mig)).cloned().unwrap_or_default());
    }
    all
}

/// [`publish`], then the health taints of `taints` on the devices they target (see [`crate::health`]).
/// Where the API server has no device taints, a tainted GPU is left out, and so is a tainted MIG device
/// with its shares: the only way left to keep new claims off them.
pub fn publish_with_health(
    node: &NodeInventorySpec,
    gpu: &GpuInfo,
    model: &Model,
    features: ApiFeatures,
    taints: &crate::health::NodeTaints,
) -> GpuDevices {
    use crate::health::Target;
    let mut out = publish(node, gpu, model, features);
    let for_gpu = taints.get(&Target::Gpu(gpu.index));
    let for_device = |d: &Device| health_taints_of(gpu.index, d, taints);
    if !features.taints {
        if for_gpu.is_some() {
            return GpuDevices::default();
        }
        out.devices.retain(|d| for_device(d).is_empty());
        return out;
    }
    for d in &mut out.devices {
        let extra = for_device(d);
        if extra.is_empty() {
            continue;
        }
        let taints = d.taints.get_or_insert_with(Vec::new);
        // One taint per key: the GPU's comes first and stands for a MIG device's failure of the same kind.
        for t in extra {
            if !taints.iter().any(|have| have.key == t.key) {
                taints.push(t);
            }
        }
    }
    out
}

/// The whole-GPU device as selectors see it (policy rules are evaluated against it).
pub fn selector_view(node: &NodeInventorySpec, gpu: &GpuInfo) -> Device {
    whole_device(node, gpu)
}

/// The devices of `gpu` under `model`, downgraded to what the cluster supports:
/// dynamic MIG → the rule's fallback layout → whole GPU; shared → fixed slots.
/// Unhealthy GPUs are tainted where taints work and left out elsewhere.
pub fn publish(node: &NodeInventorySpec, gpu: &GpuInfo, model: &Model, features: ApiFeatures) -> GpuDevices {
    if !gpu.healthy && !features.taints {
        return GpuDevices::default();
    }
    let mut out = match model {
        Model::Default if features.partitionable && supports_dynamic_mig(gpu) => {
            dynamic_mig(node, gpu, &[], &[])
        }
        Model::DynamicMig {
            profiles,
            quota_counters,
            ..
        } if features.partitionable && supports_dynamic_mig(gpu) => {
            dynamic_mig(node, gpu, profiles, quota_counters)
        }
        Model::DynamicMig { fallback_layout, .. } if !fallback_layout.is_empty() && gpu.mig.is_some() => {
            static_mig(node, gpu, fallback_layout)
        }
        Model::StaticMig { layout, .. } => static_mig(node, gpu, layout),
        Model::Shared {
            strategy,
            memory_step,
            ..
        } if features.consumable => shared(node, gpu, *strategy, *memory_step),
        Model::Shared {
            strategy,
            fallback_slots,
            ..
        } => share_slots(node, gpu, *strategy, *fallback_slots),
        Model::Default | Model::Whole | Model::DynamicMig { .. } => GpuDevices {
            devices: vec![whole_device(node, gpu)],
            counter_set: None,
        },
    };
    if let Model::Shared {
        strategy: SharingStrategy::Mps,
        tenancy: tenancy @ tessera_api::policy::MpsTenancy::Shared,
        ..
    } = model
    {
        // Absent means a daemon per namespace, the default: only the opt-in is published.
        for d in &mut out.devices {
            d.attributes
                .get_or_insert_with(Default::default)
                .insert(attr::MPS_TENANCY.into(), string(tenancy.as_str()));
        }
    }
    let warm = model.warm_seconds();
    if warm > 0 {
        // Every device the plugin makes something for: MIG and shared devices, not the whole GPU.
        for d in out
            .devices
            .iter_mut()
            .filter(|d| !matches!(d.name.parse::<DeviceName>(), Ok(DeviceName::Gpu { .. })))
        {
            d.attributes
                .get_or_insert_with(Default::default)
                .insert(attr::WARM_SECONDS.into(), int(warm as i64));
        }
    }
    if !gpu.healthy {
        for d in &mut out.devices {
            d.taints = Some(vec![DeviceTaint {
                key: UNHEALTHY_TAINT.into(),
                value: None,
                effect: "NoSchedule".into(),
                time_added: None,
            }]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{GpuModel, node};

    /// How many placements of the GPU (every profile, itself excluded) share a memory slice with this one:
    /// the instances the hardware could no longer create once it exists.
    fn overlaps(gpu: &GpuInfo, profile: &str, start: u32) -> usize {
        let mig = gpu.mig.as_ref().unwrap();
        let own = mig
            .profiles
            .iter()
            .find(|p| p.name == profile)
            .and_then(|p| p.placements.iter().find(|pl| pl.start == start))
            .unwrap();
        mig.profiles
            .iter()
            .flat_map(|p| p.placements.iter().map(move |pl| (p.name.as_str(), pl)))
            .filter(|(name, pl)| {
                !(*name == profile && pl.start == start)
                    && pl.start < own.start + own.size
                    && own.start < pl.start + pl.size
            })
            .count()
    }

    fn profile_and_start(d: &Device) -> Option<(String, u32)> {
        let a = d.attributes.as_ref()?;
        let profile = a.get("profile")?.string.clone()?;
        let start = a.get("placementStart")?.int?;
        Some((profile, u32::try_from(start).ok()?))
    }

    /// The allocator takes the first free placement in slice order, so within a profile the order is the
    /// placement rule. Highest start first is right only because, on every MIG table tessera knows, the top
    /// placements are the ones that block the fewest other instances (the 4g and one of the 3g placements
    /// sit at the bottom): this pins that reason, so a table where it no longer holds shows up here.
    #[test]
    fn within_each_profile_a_placement_that_blocks_fewer_other_instances_is_offered_first() {
        for model in [
            GpuModel::H100Sxm5_80gb,
            GpuModel::H200,
            GpuModel::A100Sxm4_80gb,
            GpuModel::B200,
        ] {
            let inv = node("n").mig_gpus(model, 1).build();
            let gpu = &inv.spec.gpus[0];
            let devices = dynamic_mig(&inv.spec, gpu, &[], &[]).devices;
            let placed: Vec<(String, u32)> = devices.iter().filter_map(profile_and_start).collect();
            assert!(!placed.is_empty(), "{model:?} publishes no MIG placement");
            for pair in placed.windows(2) {
                let ((p, a), (q, b)) = (&pair[0], &pair[1]);
                if p == q {
                    assert!(
                        overlaps(gpu, p, *a) <= overlaps(gpu, q, *b),
                        "{model:?}: {p} at {a} blocks {} instances and is offered before {b}, which blocks {}",
                        overlaps(gpu, p, *a),
                        overlaps(gpu, q, *b)
                    );
                }
            }
        }
    }
}
