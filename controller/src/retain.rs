//! Allocated devices a republish would drop stay published until their claims are released.
//!
//! kube-scheduler counts a device's counter consumption only while it finds the device in the current
//! slices (kubernetes/kubernetes#140802, open): a policy change that drops an allocated MIG placement
//! frees its memory slices for the next claim while the instance still runs. A device it does not find at
//! all (a whole GPU under a policy that now shares it) is simply forgotten, and the GPU is handed out
//! again. So, per GPU, before the pool is laid out in slices:
//!
//! | the new model of the GPU | what is published while a dropped device is allocated |
//! |---|---|
//! | dynamic MIG, and every dropped device is a MIG placement | the new devices, plus each dropped placement with its counter consumption: the scheduler counts it against the GPU's counter set, so nothing new overlaps it |
//! | anything else (whole, shared, share slots, static MIG, or a dropped whole GPU / share) | only the GPU's allocated devices: the new devices would not share counters with the old ones, so none is offered until the GPU is free |
//!
//! Every device kept this way carries the taint [`RETAINED_TAINT`] (`NoSchedule`) where the API server
//! has device taints, so no new claim takes it; running pods keep it. A kept device is rebuilt from its
//! name and the node's inventory ([`rebuild`]): a MIG placement always with the counter consumption of
//! dynamic MIG (a placement takes its memory slices whatever model published it), which also holds after
//! a controller restart, when nothing of the previous publication is in memory.
//!
//! Once no claim names a kept device, the next reconcile of its node drops it (claim events wake the loop
//! while anything is kept, see [`crate::runtime`]).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{CounterSet, Device, DeviceTaint, ResourceClaim};
use tessera_api::{DRIVER_NAME, DeviceName, GpuInfo, NodeInventorySpec, policy::SharingStrategy};

use crate::{
    devices::{
        GpuDevices, Model, counter_set_name, dynamic_mig, health_taints_of, publish, share_slots, shared,
    },
    features::ApiFeatures,
    health::NodeTaints,
};

/// Taint on a device kept published only because a claim still holds it.
pub const RETAINED_TAINT: &str = "gpu.tessera.dev/retained";

/// This driver's allocated devices, by pool (node) name.
pub type Allocated = BTreeMap<String, BTreeSet<String>>;

/// The devices of this driver that `claims` hold (`status.allocation.devices.results[]`), by pool.
pub fn allocated_devices<'a>(claims: impl IntoIterator<Item = &'a ResourceClaim>) -> Allocated {
    let mut out = Allocated::new();
    for claim in claims {
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_deref())
            .unwrap_or_default();
        for r in results.iter().filter(|r| r.driver == DRIVER_NAME) {
            out.entry(r.pool.clone()).or_default().insert(r.device.clone());
        }
    }
    out
}

fn retained_taint() -> DeviceTaint {
    DeviceTaint {
        key: RETAINED_TAINT.into(),
        value: None,
        effect: "NoSchedule".into(),
        time_added: None,
    }
}

/// An allocated device as it is kept published: its definition under the model its name implies, and
/// the counter set it consumes from. `None` when the node's inventory no longer has what it names (the
/// GPU or the MIG profile is gone: nothing is left to over-commit).
pub fn rebuild(node: &NodeInventorySpec, gpu: &GpuInfo, name: &str) -> Option<(Device, Option<CounterSet>)> {
    let parsed: DeviceName = name.parse().ok()?;
    let everything = ApiFeatures::ALL;
    let pick = |g: GpuDevices| {
        let set = g.counter_set;
        g.devices.into_iter().find(|d| d.name == name).map(|d| (d, set))
    };
    match parsed {
        DeviceName::Gpu { .. } => pick(publish(node, gpu, &Model::Whole, everything)),
        DeviceName::Mig { .. } if gpu.mig.as_ref().is_some_and(|m| !m.profiles.is_empty()) => {
            pick(dynamic_mig(node, gpu, &[], &[]))
        }
        DeviceName::SharedGpu { .. } => pick(shared(node, gpu, SharingStrategy::default(), 1 << 20)),
        DeviceName::ShareSlot { slot, .. } => {
            pick(share_slots(node, gpu, SharingStrategy::default(), slot + 1))
        }
        // Shares of a MIG placement are not published by this controller.
        DeviceName::Mig { .. } | DeviceName::SharedMig { .. } => None,
    }
    .map(|(d, set)| {
        let set = set.filter(|s| consumes_from(&d, &s.name));
        (d, set)
    })
}

fn consumes_from(device: &Device, set: &str) -> bool {
    device
        .consumes_counters
        .iter()
        .flatten()
        .any(|c| c.counter_set == set)
}

fn taint(device: &mut Device, features: ApiFeatures) {
    if !features.taints {
        return;
    }
    let taints = device.taints.get_or_insert_with(Vec::new);
    if !taints.iter().any(|t| t.key == RETAINED_TAINT) {
        taints.push(retained_taint());
    }
}

/// `per_gpu` (the new model's devices, in `node.gpus` order) with every allocated device of `allocated`
/// the new model drops kept as the module's table says, and the names of the devices kept only because
/// they are allocated, in GPU order.
pub fn retain(
    node: &NodeInventorySpec,
    mut per_gpu: Vec<GpuDevices>,
    allocated: &BTreeSet<String>,
    features: ApiFeatures,
    health: &NodeTaints,
) -> (Vec<GpuDevices>, Vec<String>) {
    let mut kept = vec![];
    if allocated.is_empty() {
        return (per_gpu, kept);
    }
    for (gpu, new) in node.gpus.iter().zip(per_gpu.iter_mut()) {
        let on_gpu: Vec<&String> = allocated
            .iter()
            .filter(|n| n.parse::<DeviceName>().is_ok_and(|d| d.gpu() == gpu.index))
            .collect();
        let dropped: Vec<(Device, Option<CounterSet>)> = on_gpu
            .iter()
            .filter(|n| !new.devices.iter().any(|d| d.name == ***n))
            .filter_map(|n| rebuild(node, gpu, n))
            .map(|(mut d, mut set)| {
                // Without partitionable devices the server would drop the counters: withholding the GPU
                // (below) is what keeps new devices off it then.
                if !features.partitionable {
                    d.consumes_counters = None;
                    set = None;
                }
                // A kept device stays as sick as its GPU: a NoExecute health taint still evicts.
                if features.taints {
                    for t in health_taints_of(gpu.index, &d, health) {
                        let taints = d.taints.get_or_insert_with(Vec::new);
                        if !taints.iter().any(|have| have.key == t.key) {
                            taints.push(t);
                        }
                    }
                }
                (d, set)
            })
            .collect();
        if dropped.is_empty() {
            continue;
        }
        let set = counter_set_name(gpu.index);
        let counted = new.counter_set.as_ref().is_some_and(|s| s.name == set)
            && dropped.iter().all(|(d, _)| consumes_from(d, &set));
        if counted {
            // The new placements draw on the same counters: the kept ones' consumption stays visible.
            for (mut d, _) in dropped {
                taint(&mut d, features);
                kept.push(d.name.clone());
                new.devices.push(d);
            }
            continue;
        }
        // Withheld: the GPU publishes what is allocated on it, and nothing new, until it is free.
        let rebuilt_set = dropped.iter().find_map(|(_, s)| s.clone());
        let mut devices: Vec<Device> = vec![];
        for name in &on_gpu {
            let device = new
                .devices
                .iter()
                .find(|d| d.name == **name)
                .cloned()
                .or_else(|| {
                    dropped
                        .iter()
                        .find(|(d, _)| d.name == **name)
                        .map(|(d, _)| d.clone())
                });
            if let Some(mut d) = device {
                taint(&mut d, features);
                kept.push(d.name.clone());
                devices.push(d);
            }
        }
        let needs_set = devices.iter().any(|d| consumes_from(d, &set));
        let counter_set = needs_set
            .then(|| new.counter_set.clone().filter(|s| s.name == set).or(rebuilt_set))
            .flatten();
        *new = GpuDevices { devices, counter_set };
    }
    (per_gpu, kept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        devices::{LayoutEntry, publish},
        fixtures::{GpuModel, node},
    };
    use tessera_api::policy::SharingStrategy;

    const FEATURES: ApiFeatures = ApiFeatures::ALL;

    fn dynamic(profiles: &[&str]) -> Model {
        Model::DynamicMig {
            profiles: profiles.iter().map(|p| p.to_string()).collect(),
            fallback_layout: vec![],
            warm_seconds: 0,
            quota_counters: vec![],
        }
    }

    fn share() -> Model {
        Model::Shared {
            strategy: SharingStrategy::Mps,
            memory_step: 1 << 30,
            fallback_slots: 4,
            warm_seconds: 0,
            tenancy: tessera_api::policy::MpsTenancy::default(),
        }
    }

    /// One H100 node's devices under `model` for every GPU, after retention of `allocated`.
    fn publish_all(
        inv: &NodeInventorySpec,
        model: &Model,
        allocated: &[&str],
    ) -> (Vec<GpuDevices>, Vec<String>) {
        let per_gpu = inv
            .gpus
            .iter()
            .map(|g| publish(inv, g, model, FEATURES))
            .collect();
        let allocated = allocated.iter().map(|s| s.to_string()).collect();
        retain(inv, per_gpu, &allocated, FEATURES, &NodeTaints::new())
    }

    fn names(g: &GpuDevices) -> Vec<&str> {
        g.devices.iter().map(|d| d.name.as_str()).collect()
    }

    fn is_retained(d: &Device) -> bool {
        d.taints
            .iter()
            .flatten()
            .any(|t| t.key == RETAINED_TAINT && t.effect == "NoSchedule")
    }

    /// The memory slices a device consumes from `set`.
    fn slices_of(d: &Device) -> BTreeSet<String> {
        d.consumes_counters
            .iter()
            .flatten()
            .flat_map(|c| {
                c.counters
                    .keys()
                    .filter(|k| k.starts_with("memory-slice-"))
                    .cloned()
            })
            .collect()
    }

    fn h100() -> NodeInventorySpec {
        node("n").mig_gpus(GpuModel::H100Sxm5_80gb, 1).build().spec
    }

    #[test]
    fn a_mig_placement_the_new_profiles_drop_stays_with_its_counters_while_allocated_and_goes_once_released()
    {
        let inv = h100();
        let (before, _) = publish_all(&inv, &dynamic(&[]), &[]);
        let allocated = "gpu-0-mig-3g-40gb-4";
        let was = before[0]
            .devices
            .iter()
            .find(|d| d.name == allocated)
            .unwrap()
            .clone();

        let (after, kept) = publish_all(&inv, &dynamic(&["1g.10gb"]), &[allocated]);
        assert_eq!(kept, [allocated]);
        let d = after[0]
            .devices
            .iter()
            .find(|d| d.name == allocated)
            .expect("kept");
        assert_eq!(
            d.consumes_counters, was.consumes_counters,
            "consumption as published before"
        );
        assert!(is_retained(d));
        let set = after[0].counter_set.as_ref().expect("the GPU's counter set");
        for c in d.consumes_counters.iter().flatten() {
            assert_eq!(c.counter_set, set.name);
            assert!(
                c.counters.keys().all(|k| set.counters.contains_key(k)),
                "{k:?}",
                k = c.counters.keys()
            );
        }
        // The new 1g placements on the same memory slices are published too: the counters keep them apart.
        let overlapping = after[0]
            .devices
            .iter()
            .filter(|o| o.name != allocated && !slices_of(o).is_disjoint(&slices_of(d)))
            .count();
        assert!(overlapping > 0);

        let (released, kept) = publish_all(&inv, &dynamic(&["1g.10gb"]), &[]);
        assert!(kept.is_empty());
        assert!(!names(&released[0]).contains(&allocated));
    }

    #[test]
    fn a_share_a_new_whole_gpu_model_drops_withholds_the_gpu_until_it_is_released() {
        let inv = h100();
        let allocated = "gpu-0-shared";
        let (after, kept) = publish_all(&inv, &Model::Whole, &[allocated]);
        assert_eq!(kept, [allocated]);
        assert_eq!(
            names(&after[0]),
            [allocated],
            "the whole GPU is not offered beside the share"
        );
        assert!(is_retained(&after[0].devices[0]));
        assert_eq!(after[0].devices[0].allow_multiple_allocations, Some(true));

        let (released, kept) = publish_all(&inv, &Model::Whole, &[]);
        assert!(kept.is_empty());
        assert_eq!(names(&released[0]), ["gpu-0"]);
    }

    #[test]
    fn a_whole_gpu_a_new_shared_model_drops_withholds_the_gpu_until_it_is_released() {
        let inv = node("n").gpus(GpuModel::H100Sxm5_80gb, 2).build().spec;
        let (after, kept) = publish_all(&inv, &share(), &["gpu-1"]);
        assert_eq!(kept, ["gpu-1"]);
        assert_eq!(
            names(&after[0]),
            ["gpu-0-shared"],
            "the other GPU takes the new model"
        );
        assert_eq!(names(&after[1]), ["gpu-1"]);
        assert!(is_retained(&after[1].devices[0]));
        let (released, _) = publish_all(&inv, &share(), &[]);
        assert_eq!(names(&released[1]), ["gpu-1-shared"]);
    }

    #[test]
    fn a_mig_placement_a_new_non_mig_model_drops_keeps_its_counter_set_and_nothing_new() {
        let inv = h100();
        let (after, kept) = publish_all(&inv, &share(), &["gpu-0-mig-1g-10gb-6"]);
        assert_eq!(kept, ["gpu-0-mig-1g-10gb-6"]);
        assert_eq!(names(&after[0]), ["gpu-0-mig-1g-10gb-6"]);
        let set = after[0]
            .counter_set
            .as_ref()
            .expect("the counter set it consumes from");
        assert_eq!(set.name, "gpu-0-counters");
    }

    #[test]
    fn a_static_layout_that_overlaps_an_allocated_placement_is_withheld() {
        let inv = h100();
        let layout = Model::StaticMig {
            layout: vec![LayoutEntry {
                profile: "7g.80gb".into(),
                start: 0,
            }],
            warm_seconds: 0,
        };
        let (after, kept) = publish_all(&inv, &layout, &["gpu-0-mig-1g-10gb-6"]);
        assert_eq!(kept, ["gpu-0-mig-1g-10gb-6"]);
        assert_eq!(names(&after[0]), ["gpu-0-mig-1g-10gb-6"]);
    }

    #[test]
    fn nothing_is_kept_when_nothing_is_allocated_or_the_new_model_still_has_the_allocated_device() {
        let inv = h100();
        let plain: Vec<GpuDevices> = inv
            .gpus
            .iter()
            .map(|g| publish(&inv, g, &share(), FEATURES))
            .collect();
        assert_eq!(publish_all(&inv, &share(), &[]), (plain, vec![]));
        // The whole GPU is part of dynamic MIG, and consumes every counter there.
        let (after, kept) = publish_all(&inv, &dynamic(&["1g.10gb"]), &["gpu-0"]);
        assert!(kept.is_empty());
        assert!(after[0].devices.iter().all(|d| !is_retained(d)));
    }

    #[test]
    fn without_device_taints_a_kept_device_is_published_untainted() {
        let inv = h100();
        let mut features = FEATURES;
        features.taints = false;
        let per_gpu = vec![publish(&inv, &inv.gpus[0], &Model::Whole, features)];
        let (after, kept) = retain(
            &inv,
            per_gpu,
            &["gpu-0-shared".to_string()].into(),
            features,
            &NodeTaints::new(),
        );
        assert_eq!(kept, ["gpu-0-shared"]);
        assert!(after[0].devices[0].taints.is_none());
    }

    #[test]
    fn without_partitionable_devices_a_kept_placement_has_no_counters_and_withholds_its_gpu() {
        let inv = h100();
        let features = ApiFeatures::NONE;
        let fallback = Model::DynamicMig {
            profiles: vec![],
            fallback_layout: vec![LayoutEntry {
                profile: "7g.80gb".into(),
                start: 0,
            }],
            warm_seconds: 0,
            quota_counters: vec![],
        };
        let per_gpu = vec![publish(&inv, &inv.gpus[0], &fallback, features)];
        let allocated = ["gpu-0-mig-3g-40gb-4".to_string()].into();
        let (after, kept) = retain(&inv, per_gpu, &allocated, features, &NodeTaints::new());
        assert_eq!(kept, ["gpu-0-mig-3g-40gb-4"]);
        assert_eq!(names(&after[0]), ["gpu-0-mig-3g-40gb-4"]);
        assert!(after[0].devices[0].consumes_counters.is_none());
        assert!(after[0].counter_set.is_none());
    }

    #[test]
    fn a_kept_device_keeps_its_gpus_health_taints() {
        let inv = h100();
        let health: NodeTaints = [(
            crate::health::Target::Gpu(0),
            vec![DeviceTaint {
                key: crate::health::GPU_LOST_TAINT.into(),
                value: None,
                effect: "NoExecute".into(),
                time_added: None,
            }],
        )]
        .into();
        let per_gpu = vec![crate::devices::publish_with_health(
            &inv,
            &inv.gpus[0],
            &Model::Whole,
            FEATURES,
            &health,
        )];
        let (after, _) = retain(
            &inv,
            per_gpu,
            &["gpu-0-shared".to_string()].into(),
            FEATURES,
            &health,
        );
        let keys: Vec<&str> = after[0].devices[0]
            .taints
            .iter()
            .flatten()
            .map(|t| t.key.as_str())
            .collect();
        assert_eq!(keys, [crate::health::GPU_LOST_TAINT, RETAINED_TAINT]);
    }

    #[test]
    fn only_this_drivers_allocations_count() {
        let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "namespace": "ns"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": [
                {"request": "a", "driver": DRIVER_NAME, "pool": "n", "device": "gpu-0"},
                {"request": "b", "driver": "nic.example.com", "pool": "n", "device": "nic-0"}
            ]}}}
        }))
        .unwrap();
        let allocated = allocated_devices([&claim]);
        assert_eq!(
            allocated,
            [("n".to_string(), ["gpu-0".to_string()].into())].into()
        );
    }
}
