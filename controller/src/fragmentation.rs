//! The controller's view of MIG fragmentation (see [`crate::explain::fragmentation`] for the definitions):
//! each dynamic-MIG GPU's placements from its inventory and the policy's model, the slices taken from the
//! allocated ResourceClaims, and the profile in demand from the pending ones. Plain Rust over the objects
//! the controller watches; [`crate::metrics`] exports the result.
//!
//! Reading the placements from the inventory rather than from the published slices keeps the slice cache
//! trimmed as it is ([`crate::pool_diff::trim_to_what_diff_reads`]): it is the same table the devices are
//! rendered from.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};
use tessera_api::{DRIVER_NAME, DeviceName, GpuInfo, NodeInventory, NodeInventorySpec};

use crate::{
    cel::DeviceView,
    devices::{Model, dynamic_mig_profiles, mig_selector_view},
    explain::{
        eval::Selectors,
        fragmentation::{GpuFragmentation, GpuLayout, Placement},
        model::{NodeDevice, claim_key},
        request::{Alternative, ClaimInput},
    },
    features::ApiFeatures,
};

/// The requests of claims that are neither allocated nor being deleted, one per distinct class, selectors
/// and capacity (claims from one template ask alike), leaving out those whose class does not exist (they
/// cannot be allocated anywhere).
pub fn pending_alternatives(claims: &[ResourceClaim], classes: &[DeviceClass]) -> Vec<Alternative> {
    let selectors = Selectors::new(classes);
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for claim in claims {
        let allocated = claim.status.as_ref().is_some_and(|s| s.allocation.is_some());
        if allocated || claim.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let Ok(input) = ClaimInput::from_spec(claim_key(claim), claim.spec.as_ref()) else {
            continue;
        };
        for alt in input.requests.into_iter().flat_map(|r| r.alternatives) {
            let key = format!("{}|{:?}|{:?}", alt.class, alt.selectors, alt.capacity);
            if selectors.class(&alt.class).is_some() && seen.insert(key) {
                out.push(alt);
            }
        }
    }
    out
}

/// Per node and GPU index: the slices allocated claims hold, with the claims.
fn held_slices(
    claims: &[ResourceClaim],
    inventories: &[NodeInventory],
) -> BTreeMap<(String, u32), BTreeMap<u32, Vec<String>>> {
    let gpus: BTreeMap<(&str, u32), &GpuInfo> = inventories
        .iter()
        .flat_map(|i| {
            i.spec
                .gpus
                .iter()
                .map(move |g| ((i.spec.node_name.as_str(), g.index), g))
        })
        .collect();
    let mut out: BTreeMap<(String, u32), BTreeMap<u32, Vec<String>>> = BTreeMap::new();
    for claim in claims {
        let results = claim
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .and_then(|a| a.devices.as_ref())
            .and_then(|d| d.results.as_ref());
        for r in results.into_iter().flatten().filter(|r| r.driver == DRIVER_NAME) {
            let Ok(name) = r.device.parse::<DeviceName>() else {
                continue;
            };
            let Some(gpu) = gpus.get(&(r.pool.as_str(), name.gpu())) else {
                continue;
            };
            let total = gpu.mig.as_ref().map_or(0, |m| m.memory_slices);
            let slices: Vec<u32> = match &name {
                DeviceName::Gpu { .. } => (0..total).collect(),
                DeviceName::Mig { profile, start, .. } | DeviceName::SharedMig { profile, start, .. } => {
                    let size = crate::devices::find_profile(gpu, profile)
                        .and_then(|p| p.placements.iter().find(|pl| pl.start == *start))
                        .map_or(0, |pl| pl.size);
                    (*start..start + size).collect()
                }
                _ => continue,
            };
            let held = out.entry((r.pool.clone(), name.gpu())).or_default();
            for k in slices {
                let holders = held.entry(k).or_default();
                let key = claim_key(claim);
                if !holders.contains(&key) {
                    holders.push(key);
                }
            }
        }
    }
    out
}

/// The GPU's layout under dynamic MIG, or `None` when it is not published as dynamic MIG.
fn layout(
    node: &NodeInventorySpec,
    gpu: &GpuInfo,
    model: &Model,
    features: ApiFeatures,
    held: BTreeMap<u32, Vec<String>>,
) -> Option<GpuLayout> {
    let profiles = dynamic_mig_profiles(gpu, model, features)?;
    let placements = profiles
        .iter()
        .flat_map(|p| {
            p.placements.iter().map(|pl| Placement {
                profile: p.name.clone(),
                start: pl.start,
                size: pl.size,
                device: DeviceName::Mig {
                    gpu: gpu.index,
                    profile: p.name.clone(),
                    start: pl.start,
                }
                .to_string(),
            })
        })
        .collect();
    Some(GpuLayout {
        node: node.node_name.clone(),
        gpu: DeviceName::Gpu { gpu: gpu.index }.to_string(),
        memory_slices: gpu.mig.as_ref().map_or(0, |m| m.memory_slices),
        placements,
        held,
    })
}

/// The attributes whose values differ between GPUs of one product on nodes with one driver.
const PER_GPU_ATTRIBUTES: [&str; 8] = [
    tessera_api::attributes::UUID,
    tessera_api::attributes::INDEX,
    tessera_api::attributes::MINOR,
    tessera_api::attributes::NUMA_NODE,
    tessera_api::attributes::PCI_BUS_ID,
    tessera_api::attributes::PCIE_ROOT,
    tessera_api::attributes::MIG_PLACEMENT_START,
    tessera_api::attributes::MIG_UUID,
];

/// Whether the request's or its class's selectors mention an attribute that tells GPUs of one kind apart
/// (by name anywhere in the expression: a false alarm only costs evaluating per GPU).
fn names_a_gpu_of_its_kind(alt: &Alternative, classes: &[DeviceClass]) -> bool {
    let class = classes
        .iter()
        .filter(|c| c.metadata.name.as_deref() == Some(alt.class.as_str()))
        .flat_map(|c| c.spec.iter().flat_map(|s| s.selectors.iter().flatten()))
        .filter_map(|s| s.cel.as_ref().map(|c| c.expression.as_str()));
    alt.selectors.iter().map(String::as_str).chain(class).any(|e| {
        PER_GPU_ATTRIBUTES
            .iter()
            .any(|a| e.contains(a.rsplit('/').next().unwrap_or(a)))
    })
}

/// The largest profile of the GPU that some pending request asks for there (see the module's definitions).
fn demanded(
    selectors: &mut Selectors<'_>,
    alternatives: &[Alternative],
    node: &NodeInventorySpec,
    gpu: &GpuInfo,
    layout: &GpuLayout,
) -> Option<String> {
    if alternatives.is_empty() {
        return None;
    }
    let mig = gpu.mig.as_ref()?;
    // One device per profile, smallest first: the first a request accepts is what it needs here.
    let devices: Vec<(u32, String, k8s_openapi::api::resource::v1::Device)> = layout
        .profiles()
        .into_iter()
        .filter_map(|(name, size)| {
            let profile = mig.profile(name)?;
            let start = layout.placements_of(name).next()?.start;
            Some((
                size,
                name.to_string(),
                mig_selector_view(node, gpu, profile, start),
            ))
        })
        .collect();
    let mut best: Option<(u32, String)> = None;
    for alt in alternatives {
        let needed = devices.iter().find(|(_, _, device)| {
            let dev = NodeDevice {
                id: (DRIVER_NAME.into(), node.node_name.clone(), device.name.clone()),
                device,
                view: DeviceView::from_device(DRIVER_NAME, device),
                pool_complete: true,
                rule_taints: Vec::new(),
            };
            selectors.static_check(alt, &dev).is_ok()
        });
        if let Some((size, name, _)) = needed
            && best.as_ref().is_none_or(|(s, _)| size > s)
        {
            best = Some((*size, name.clone()));
        }
    }
    best.map(|(_, name)| name)
}

/// The profile in demand per GPU, kept across rounds while the pending requests (as distinct
/// alternatives), the classes and the GPU's profiles are the same: pods made from one template leave the
/// set of distinct requests unchanged however many are pending, so at 1,000 nodes a round then evaluates no
/// selector at all.
#[derive(Debug, Default)]
pub struct DemandCache {
    requests: String,
    /// (node, GPU index, GPU UUID, its published profiles) → the profile in demand.
    per_gpu: HashMap<(String, u32, String, String), Option<String>>,
}

/// Every dynamic-MIG GPU's fragmentation for the profile in demand there, in node and GPU order.
pub fn fragmentation(
    inventories: &[NodeInventory],
    models: &dyn Fn(&str, u32) -> Model,
    features: ApiFeatures,
    claims: &[ResourceClaim],
    classes: &[DeviceClass],
    cache: &mut DemandCache,
) -> Vec<GpuFragmentation> {
    let alternatives = pending_alternatives(claims, classes);
    let requests = format!(
        "{:?}|{:?}",
        alternatives
            .iter()
            .map(|a| (&a.class, &a.selectors, &a.capacity, &a.tolerations))
            .collect::<Vec<_>>(),
        classes
            .iter()
            .map(|c| (&c.metadata.name, &c.spec))
            .collect::<Vec<_>>()
    );
    let mut known = std::mem::take(&mut cache.per_gpu);
    if cache.requests != requests {
        known.clear();
        cache.requests = requests;
    }
    let mut selectors = Selectors::new(classes);
    // Requests that name no attribute telling GPUs of one product apart get the same answer on all of
    // them: evaluated once per product, driver and profile set in this round.
    let per_gpu = alternatives.iter().any(|a| names_a_gpu_of_its_kind(a, classes));
    let mut by_kind: HashMap<String, Option<String>> = HashMap::new();
    let mut held = held_slices(claims, inventories);
    let mut out = Vec::new();
    for inv in inventories {
        let node = &inv.spec;
        for gpu in &node.gpus {
            let taken = held
                .remove(&(node.node_name.clone(), gpu.index))
                .unwrap_or_default();
            let Some(layout) = layout(node, gpu, &models(&node.node_name, gpu.index), features, taken) else {
                continue;
            };
            let profiles: Vec<&str> = layout.profiles().into_iter().map(|(p, _)| p).collect();
            let key = (
                node.node_name.clone(),
                gpu.index,
                gpu.uuid.clone(),
                profiles.join(","),
            );
            let kind = format!(
                "{}|{:?}|{:?}|{}",
                gpu.product_name, node.driver_version, node.cuda_driver_version, key.3
            );
            let profile = match (known.remove(&key), by_kind.get(&kind)) {
                (Some(p), _) => p,
                (None, Some(p)) if !per_gpu => p.clone(),
                (None, _) => {
                    let p = demanded(&mut selectors, &alternatives, node, gpu, &layout);
                    by_kind.insert(kind, p.clone());
                    p
                }
            };
            out.extend(layout.fragmentation(profile.as_deref()));
            cache.per_gpu.insert(key, profile);
        }
    }
    out.sort_by(|a, b| (&a.node, a.gpu.len(), &a.gpu).cmp(&(&b.node, b.gpu.len(), &b.gpu)));
    out
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::resource::v1::{
            AllocationResult, CELDeviceSelector, DeviceAllocationResult, DeviceClaim, DeviceClassSpec,
            DeviceRequest, DeviceRequestAllocationResult, DeviceSelector, ExactDeviceRequest,
            ResourceClaimSpec, ResourceClaimStatus,
        },
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;
    use crate::fixtures::{GpuModel, node};

    fn mig_class() -> DeviceClass {
        DeviceClass {
            metadata: ObjectMeta {
                name: Some("mig.gpu.tessera.dev".into()),
                ..Default::default()
            },
            spec: Some(DeviceClassSpec {
                selectors: Some(vec![DeviceSelector {
                    cel: Some(CELDeviceSelector {
                        expression: r#"device.driver == "gpu.tessera.dev" && device.attributes["gpu.tessera.dev"].type == "mig""#
                            .into(),
                    }),
                }]),
                ..Default::default()
            }),
        }
    }

    /// A claim builder: pending with a selector, or allocated to devices of a node.
    struct ClaimBuilder(ResourceClaim);

    fn claim(name: &str) -> ClaimBuilder {
        ClaimBuilder(ResourceClaim {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            spec: Some(ResourceClaimSpec {
                devices: Some(DeviceClaim {
                    requests: Some(vec![DeviceRequest {
                        name: "gpu".into(),
                        exactly: Some(ExactDeviceRequest {
                            device_class_name: "mig.gpu.tessera.dev".into(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
            }),
            status: None,
        })
    }

    impl ClaimBuilder {
        fn selecting(mut self, expression: &str) -> Self {
            let req = &mut self
                .0
                .spec
                .as_mut()
                .unwrap()
                .devices
                .as_mut()
                .unwrap()
                .requests
                .as_mut()
                .unwrap()[0];
            req.exactly.as_mut().unwrap().selectors = Some(vec![DeviceSelector {
                cel: Some(CELDeviceSelector {
                    expression: expression.into(),
                }),
            }]);
            self
        }

        fn allocated(mut self, node: &str, device: &str) -> Self {
            self.0.status = Some(ResourceClaimStatus {
                allocation: Some(AllocationResult {
                    devices: Some(DeviceAllocationResult {
                        results: Some(vec![DeviceRequestAllocationResult {
                            driver: DRIVER_NAME.into(),
                            pool: node.into(),
                            device: device.into(),
                            request: "gpu".into(),
                            ..Default::default()
                        }]),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            });
            self
        }

        fn build(self) -> ResourceClaim {
            self.0
        }
    }

    fn run(claims: &[ResourceClaim]) -> Vec<GpuFragmentation> {
        let inv = node("n").mig_gpus(GpuModel::H100Sxm5_80gb, 2).build();
        fragmentation(
            &[inv],
            &|_, _| Model::Default,
            ApiFeatures::ALL,
            claims,
            &[mig_class()],
            &mut DemandCache::default(),
        )
    }

    #[test]
    fn a_pending_3g_claim_makes_the_slices_two_1g_instances_strand_count_as_fragmented() {
        let claims = [
            claim("a").allocated("n", "gpu-0-mig-1g-10gb-1").build(),
            claim("b").allocated("n", "gpu-0-mig-1g-10gb-5").build(),
            claim("big")
                .selecting(r#"device.attributes["gpu.tessera.dev"].profile.startsWith("3g.")"#)
                .build(),
        ];
        let f = run(&claims);
        assert_eq!(f.len(), 2);
        assert_eq!(
            (
                f[0].gpu.as_str(),
                f[0].profile.as_str(),
                f[0].pending,
                f[0].free,
                f[0].unusable
            ),
            ("gpu-0", "3g.40gb", true, 6, 6)
        );
        assert_eq!((f[1].gpu.as_str(), f[1].free, f[1].unusable), ("gpu-1", 8, 0));
    }

    #[test]
    fn the_largest_of_the_pending_profiles_is_the_demand_and_each_request_needs_its_smallest_match() {
        let claims = [
            claim("a").allocated("n", "gpu-0-mig-1g-10gb-1").build(),
            // Any MIG device: the smallest, 1g.10gb, is what it gets.
            claim("any").build(),
            claim("half")
                .selecting(r#"device.capacity["gpu.tessera.dev"].memory.compareTo(quantity("30Gi")) >= 0"#)
                .build(),
        ];
        let f = run(&claims);
        assert_eq!((f[0].profile.as_str(), f[0].pending), ("3g.40gb", true));
        assert_eq!(f[0].unusable, 3, "slices 0, 2, 3: 3g@4 still fits");
    }

    #[test]
    fn without_pending_claims_the_largest_profile_stands_in_and_allocated_claims_are_not_demand() {
        let claims = [claim("a").allocated("n", "gpu-1-mig-1g-10gb-6").build()];
        let f = run(&claims);
        assert_eq!(
            (f[1].profile.as_str(), f[1].pending, f[1].free, f[1].unusable),
            ("7g.80gb", false, 7, 7)
        );
    }

    #[test]
    fn the_demand_is_kept_while_the_pending_requests_are_alike_and_redone_when_they_change() {
        let inv = node("n").mig_gpus(GpuModel::H100Sxm5_80gb, 1).build();
        let mut cache = DemandCache::default();
        let mut round = |claims: &[ResourceClaim]| {
            let f = fragmentation(
                std::slice::from_ref(&inv),
                &|_, _| Model::Default,
                ApiFeatures::ALL,
                claims,
                &[mig_class()],
                &mut cache,
            );
            (f[0].profile.clone(), f[0].unusable)
        };
        let three_g = r#"device.attributes["gpu.tessera.dev"].profile.startsWith("3g.")"#;
        let a = claim("a").allocated("n", "gpu-0-mig-1g-10gb-1").build();
        let big = || claim("big").selecting(three_g).build();
        assert_eq!(round(&[a.clone(), big()]), ("3g.40gb".into(), 3));
        // A second pending claim from the same template: same demand; the slices taken are read anew.
        let b = claim("b").allocated("n", "gpu-0-mig-1g-10gb-5").build();
        assert_eq!(
            round(&[a.clone(), b.clone(), big(), big()]),
            ("3g.40gb".into(), 6)
        );
        assert_eq!(round(&[a, b]), ("7g.80gb".into(), 6), "no pending claim left");
    }

    #[test]
    fn a_request_for_one_gpu_by_index_is_demand_on_that_gpu_only() {
        let claims = [
            claim("a").allocated("n", "gpu-0-mig-1g-10gb-1").build(),
            claim("b").allocated("n", "gpu-1-mig-1g-10gb-1").build(),
            claim("big")
                .selecting(
                    r#"device.attributes["gpu.tessera.dev"].index == 1 && device.attributes["gpu.tessera.dev"].profile.startsWith("3g.")"#,
                )
                .build(),
        ];
        let f = run(&claims);
        assert_eq!((f[0].profile.as_str(), f[0].pending), ("7g.80gb", false));
        assert_eq!(
            (f[1].profile.as_str(), f[1].pending, f[1].unusable),
            ("3g.40gb", true, 3)
        );
    }

    #[test]
    fn gpus_not_published_as_dynamic_mig_have_no_fragmentation() {
        let inv = node("n").mig_gpus(GpuModel::H100Sxm5_80gb, 2).build();
        let f = fragmentation(
            &[inv],
            &|_, i| if i == 0 { Model::Whole } else { Model::Default },
            ApiFeatures::ALL,
            &[],
            &[],
            &mut DemandCache::default(),
        );
        assert_eq!(f.iter().map(|g| g.gpu.as_str()).collect::<Vec<_>>(), ["gpu-1"]);
    }
}
