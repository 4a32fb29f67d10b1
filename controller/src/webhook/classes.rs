//! What each DeviceClass offers, judged by its selectors on the devices tessera has published: the only
//! way to know a class is "whole GPUs only" that holds for any selector an admin writes.

use std::{
    collections::HashMap,
    str::FromStr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::runtime::reflector::{ObjectRef, Store};
use tessera_api::{DRIVER_NAME, DeviceName};

use super::{ClassCatalog, Offers};
use crate::cel::{CelEnv, DeviceView, SelectorError};

/// One example device of each kind `class` selects among `slices`. A device a selector fails on (a
/// missing attribute) is not selected, as the scheduler does not select it either.
pub fn offers_of(
    cel: &CelEnv,
    class: &DeviceClass,
    slices: &[Arc<ResourceSlice>],
) -> Result<Offers, SelectorError> {
    let selectors = class
        .spec
        .iter()
        .flat_map(|s| s.selectors.iter().flatten())
        .filter_map(|s| s.cel.as_ref())
        .map(|c| cel.compile(&c.expression))
        .collect::<Result<Vec<_>, _>>()?;
    let mut offers = Offers::default();
    let devices = slices
        .iter()
        .filter(|s| s.spec.driver == DRIVER_NAME)
        .flat_map(|s| s.spec.devices.iter().flatten());
    for device in devices {
        let Ok(name) = DeviceName::from_str(&device.name) else {
            continue;
        };
        let mig = matches!(name, DeviceName::Mig { .. } | DeviceName::SharedMig { .. });
        let view = DeviceView::from_device(DRIVER_NAME, device);
        if !selectors.iter().all(|s| cel.matches(s, &view).unwrap_or(false)) {
            continue;
        }
        // Every matching device is looked at (not the first of each kind): the strategies shared devices
        // serve differ per GPU under a policy.
        let strategy = device
            .attributes
            .as_ref()
            .and_then(|a| a.get(tessera_api::attributes::SHARING_STRATEGY))
            .and_then(|a| a.string.clone());
        match strategy {
            Some(s) => {
                offers.serves.insert(s);
            }
            None => offers.unshared = true,
        }
        let slot = if mig { &mut offers.mig } else { &mut offers.gpu };
        if slot.is_none() {
            *slot = Some(name);
        }
    }
    Ok(offers)
}

struct Cached {
    generation: u64,
    offers: Option<Offers>,
}

/// [`ClassCatalog`] over watched DeviceClasses and ResourceSlices. Answers are cached until either watch
/// reports a change (`generation`), so a claim costs a map lookup, not a pass over every device.
pub struct ClusterClasses {
    classes: Store<DeviceClass>,
    slices: Store<ResourceSlice>,
    generation: Arc<AtomicU64>,
    cache: Mutex<(CelEnv, HashMap<String, Cached>)>,
}

impl ClusterClasses {
    /// `generation` must change whenever either store does.
    pub fn new(
        classes: Store<DeviceClass>,
        slices: Store<ResourceSlice>,
        generation: Arc<AtomicU64>,
    ) -> Self {
        Self {
            classes,
            slices,
            generation,
            cache: Mutex::new((CelEnv::new(), HashMap::new())),
        }
    }
}

impl ClassCatalog for ClusterClasses {
    fn offers(&self, class: &str) -> Option<Offers> {
        let generation = self.generation.load(Ordering::Acquire);
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let (cel, entries) = &mut *cache;
        if let Some(hit) = entries.get(class).filter(|c| c.generation == generation) {
            return hit.offers.clone();
        }
        let offers = self.classes.get(&ObjectRef::new(class)).and_then(|dc| {
            offers_of(cel, &dc, &self.slices.state())
                .inspect_err(|e| tracing::warn!(class, error = %e, "DeviceClass selector does not compile"))
                .ok()
        });
        entries.insert(
            class.to_string(),
            Cached {
                generation,
                offers: offers.clone(),
            },
        );
        offers
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::resource::v1::{CELDeviceSelector, DeviceClassSpec, DeviceSelector};

    use super::*;
    use crate::{
        features::ApiFeatures,
        fixtures::{GpuModel, node},
        render::render,
    };

    fn class(expression: &str) -> DeviceClass {
        DeviceClass {
            metadata: Default::default(),
            spec: Some(DeviceClassSpec {
                selectors: Some(vec![DeviceSelector {
                    cel: Some(CELDeviceSelector {
                        expression: expression.into(),
                    }),
                }]),
                ..Default::default()
            }),
        }
    }

    fn published() -> Vec<Arc<ResourceSlice>> {
        let inventory = node("gpu-node-0").gpus(GpuModel::H100Sxm5_80gb, 2).build();
        render(&[inventory], None, ApiFeatures::ALL)
            .expect("the built-in policy renders")
            .into_iter()
            .map(Arc::new)
            .collect()
    }

    #[test]
    fn a_class_selecting_the_gpu_type_offers_only_whole_gpus() {
        let offers = offers_of(
            &CelEnv::new(),
            &class(r#"device.attributes["gpu.tessera.dev"].type == "gpu""#),
            &published(),
        )
        .unwrap();
        assert!(offers.mig.is_none(), "{offers:?}");
        assert!(matches!(offers.gpu, Some(DeviceName::Gpu { .. })), "{offers:?}");
    }

    #[test]
    fn a_class_selecting_every_tessera_device_offers_both_kinds() {
        let offers = offers_of(
            &CelEnv::new(),
            &class(r#"device.driver == "gpu.tessera.dev""#),
            &published(),
        )
        .unwrap();
        assert!(offers.mig.is_some() && offers.gpu.is_some(), "{offers:?}");
    }

    #[test]
    fn a_selector_failing_on_a_device_does_not_select_it() {
        let offers = offers_of(
            &CelEnv::new(),
            &class(r#"device.attributes["gpu.tessera.dev"].noSuchAttribute == "x""#),
            &published(),
        )
        .unwrap();
        assert_eq!(offers, Offers::default());
    }

    #[test]
    fn a_selector_that_does_not_parse_is_an_error() {
        let err = offers_of(&CelEnv::new(), &class("device.driver =="), &published()).unwrap_err();
        assert!(matches!(err, SelectorError::Syntax { .. }), "{err}");
    }

    #[test]
    fn a_class_selecting_shares_offers_the_strategies_their_devices_are_published_with() {
        let policy: tessera_api::policy::GpuPolicySpec = serde_json::from_value(serde_json::json!({
            "rules": [{"name": "all-shared", "shared": {"strategy": "MPS"}}]
        }))
        .unwrap();
        let policy = tessera_api::policy::GpuPolicy::new("p", policy);
        let inventory = node("gpu-node-0").gpus(GpuModel::H100Sxm5_80gb, 2).build();
        let slices: Vec<_> = render(&[inventory], Some(&policy), ApiFeatures::ALL)
            .expect("the policy renders")
            .into_iter()
            .map(Arc::new)
            .collect();
        let shares = offers_of(
            &CelEnv::new(),
            &class(r#"device.attributes["gpu.tessera.dev"].type == "shared""#),
            &slices,
        )
        .unwrap();
        assert!(!shares.unshared, "{shares:?}");
        assert_eq!(shares.serves.iter().collect::<Vec<_>>(), ["MPS"], "{shares:?}");
        let whole = offers_of(
            &CelEnv::new(),
            &class(r#"device.attributes["gpu.tessera.dev"].type == "gpu""#),
            &published(),
        )
        .unwrap();
        assert!(whole.unshared && whole.serves.is_empty(), "{whole:?}");
    }
}
