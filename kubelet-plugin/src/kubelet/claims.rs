//! Where ResourceClaims come from: kubelet sends only a claim's namespace, name and UID, so the plugin reads
//! the claim (its allocation) from the API server.
//!
//! [`ClaimSource`] is the seam: [`KubeClaims`] asks the API server, [`fake::FakeClaims`] serves claims built
//! in-process by tests (`claim("c0").allocated("gpu-0")`).

use std::{collections::BTreeMap, sync::Arc};

use futures::future::BoxFuture;
use k8s_openapi::{
    api::resource::v1::{DeviceAllocationConfiguration, ResourceClaim},
    apimachinery::pkg::api::resource::Quantity,
};
use kube::Api;
pub use tessera_api::claim_list::{ClaimList, Unreadable};
use tessera_api::config::SharingStrategy;

/// Error of a claim lookup, opaque to the state machine (it only reports it).
pub type SourceError = Box<dyn std::error::Error + Send + Sync>;

/// Reads ResourceClaims by namespace and name.
pub trait ClaimSource: Send + Sync + 'static {
    /// The claim, or `None` when it does not exist.
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ResourceClaim>, SourceError>>;

    /// Every ResourceClaim of the cluster. Recovery uses it to learn which claims are allocated to this
    /// node and reserved by a pod (there is no field selector for allocation results, so it filters).
    /// A claim that does not decode (any namespace, any driver) is listed as unreadable, never fails the list.
    fn list(&self) -> BoxFuture<'_, Result<ClaimList, SourceError>>;

    /// `device` of `pool` as this driver's ResourceSlices publish it (what the plugin reads of it), or
    /// `None` when no slice lists it. Sources without slices have none.
    fn published_device<'a>(
        &'a self,
        _pool: &'a str,
        _device: &'a str,
    ) -> BoxFuture<'a, Result<Option<Published>, SourceError>> {
        Box::pin(async { Ok(None) })
    }
}

/// What the plugin reads of a device its node's ResourceSlice publishes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Published {
    /// The `sharingStrategy` attribute: the strategy a shared device serves to every claim sharing it.
    pub strategy: Option<SharingStrategy>,
    /// The capacity (`memory`, `compute`): a share slot's allocation carries none, so this is where the
    /// plugin learns the slot's size.
    pub capacity: BTreeMap<String, Quantity>,
    /// The `warmSeconds` attribute: how long the device's partition stays warm after its claim goes.
    pub warm_seconds: Option<u64>,
    /// The `mpsTenancy` attribute: which claims share the device's MPS daemon (absent: a daemon per
    /// namespace).
    pub tenancy: Option<tessera_api::policy::MpsTenancy>,
}

impl Published {
    fn of(device: &k8s_openapi::api::resource::v1::Device) -> Self {
        let attribute = |name: &str| device.attributes.as_ref()?.get(name);
        Self {
            strategy: strategy_attribute(device),
            capacity: device
                .capacity
                .iter()
                .flatten()
                .map(|(name, c)| (name.clone(), c.value.clone()))
                .collect(),
            warm_seconds: attribute(tessera_api::attributes::WARM_SECONDS)
                .and_then(|a| a.int)
                .and_then(|s| u64::try_from(s).ok())
                .filter(|s| *s > 0),
            tenancy: attribute(tessera_api::attributes::MPS_TENANCY)
                .and_then(|a| a.string.as_deref())
                .and_then(tessera_api::policy::MpsTenancy::parse),
        }
    }
}

/// The strategy a published device's `sharingStrategy` attribute names.
fn strategy_attribute(device: &k8s_openapi::api::resource::v1::Device) -> Option<SharingStrategy> {
    let value = device
        .attributes
        .as_ref()?
        .get(tessera_api::attributes::SHARING_STRATEGY)?
        .string
        .as_deref()?;
    [SharingStrategy::Mps, SharingStrategy::TimeSlicing]
        .into_iter()
        .find(|s| s.as_str() == value)
}

/// A failed read of a claim, in words the claim's owner can act on: serde_json's bare `recursion limit
/// exceeded` (a claim whose opaque configuration nests too deep to decode) names the configuration instead.
pub fn read_error(error: kube::Error) -> SourceError {
    if let kube::Error::SerdeError(e) = &error {
        return format!(
            "the ResourceClaim cannot be read: {}",
            tessera_api::claim_list::cause_in_words(e)
        )
        .into();
    }
    match tessera_api::config::too_deep_config_message(&error.to_string()) {
        Some(message) => message.into(),
        None => Box::new(error),
    }
}

/// Logs each claim of `list` that does not decode, once per claim UID for the life of the process: a
/// hostile claim must not write its error every minute on every node, but the operator must see it.
pub fn warn_unreadable_once(list: &ClaimList) {
    static LOGGED: std::sync::OnceLock<std::sync::Mutex<std::collections::BTreeSet<String>>> =
        std::sync::OnceLock::new();
    let logged = LOGGED.get_or_init(Default::default);
    let mut logged = logged.lock().unwrap_or_else(|e| e.into_inner());
    for u in &list.unreadable {
        let id = u.uid.clone().unwrap_or_else(|| u.key());
        if logged.insert(id) {
            tracing::warn!(claim = %u.key(), cause = %u.cause,
                "a ResourceClaim in the cluster cannot be decoded; every other claim is read, and records of \
                 this one, if any, are kept until it can be read");
        }
    }
}

/// Claims read from the API server.
#[derive(Clone)]
pub struct KubeClaims {
    client: kube::Client,
}

impl KubeClaims {
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

impl KubeClaims {
    /// `device` of `pool` as this driver's ResourceSlices publish it.
    async fn slice_device(
        &self,
        pool: &str,
        device: &str,
    ) -> Result<Option<k8s_openapi::api::resource::v1::Device>, SourceError> {
        use k8s_openapi::api::resource::v1::ResourceSlice;
        let api: Api<ResourceSlice> = Api::all(self.client.clone());
        let params = kube::api::ListParams::default().fields(&format!(
            "spec.driver={},spec.nodeName={pool}",
            tessera_api::DRIVER_NAME
        ));
        let slices = api.list(&params).await.map_err(read_error)?;
        Ok(slices
            .items
            .into_iter()
            .filter(|s| s.spec.pool.name == pool)
            .flat_map(|s| s.spec.devices.into_iter().flatten())
            .find(|d| d.name == device))
    }
}

impl ClaimSource for KubeClaims {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ResourceClaim>, SourceError>> {
        Box::pin(async move {
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), namespace);
            api.get_opt(name).await.map_err(read_error)
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<ClaimList, SourceError>> {
        Box::pin(async move {
            tessera_api::claim_list::list_all(&self.client)
                .await
                .map_err(|e| Box::new(e) as SourceError)
        })
    }

    fn published_device<'a>(
        &'a self,
        pool: &'a str,
        device: &'a str,
    ) -> BoxFuture<'a, Result<Option<Published>, SourceError>> {
        Box::pin(async move { Ok(self.slice_device(pool, device).await?.as_ref().map(Published::of)) })
    }
}

impl<T: ClaimSource> ClaimSource for Arc<T> {
    fn get<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<ResourceClaim>, SourceError>> {
        (**self).get(namespace, name)
    }

    fn list(&self) -> BoxFuture<'_, Result<ClaimList, SourceError>> {
        (**self).list()
    }

    fn published_device<'a>(
        &'a self,
        pool: &'a str,
        device: &'a str,
    ) -> BoxFuture<'a, Result<Option<Published>, SourceError>> {
        (**self).published_device(pool, device)
    }
}

/// Whether `claim` has a result of `driver` in `pool` (the claim is allocated, at least partly, to that
/// node's devices).
pub fn allocated_to(claim: &ResourceClaim, driver: &str, pool: &str) -> bool {
    allocated_devices(claim, driver).is_some_and(|devices| devices.iter().any(|d| d.pool == pool))
}

/// Whether a pod (or anything else) has reserved `claim`: kubelet only runs containers of a pod listed in
/// `status.reservedFor`, so an unreserved claim has no running consumer.
pub fn reserved(claim: &ResourceClaim) -> bool {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .is_some_and(|r| !r.is_empty())
}

/// One allocation result of this driver, with the opaque configuration that applies to it.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatedDevice {
    /// `<request>` or `<request>/<subrequest>`.
    pub request: String,
    pub pool: String,
    pub device: String,
    pub share_id: Option<String>,
    /// `parameters` of every `status.allocation.devices.config` entry for this driver that applies to the
    /// request, in the order the API server lists them (class configuration before claim configuration).
    pub configs: Vec<serde_json::Value>,
    /// The same entries whole (source and request list included), for the precedence rules of
    /// [`tessera_api::config::effective_config`].
    pub config_entries: Vec<DeviceAllocationConfiguration>,
    /// Capacity the scheduler assigned to a share (`compute`, `memory`); empty for exclusive devices.
    pub consumed_capacity: BTreeMap<String, Quantity>,
    /// The strategy a shared device is published with (its `sharingStrategy` attribute), which it serves
    /// to every claim sharing it; `None` for exclusive devices and where no slice says.
    pub published_strategy: Option<SharingStrategy>,
    /// Which claims share the device's MPS daemon (its `mpsTenancy` attribute); `None` where no slice
    /// says, which is a daemon per namespace.
    pub published_tenancy: Option<tessera_api::policy::MpsTenancy>,
}

/// This driver's allocation results of `claim`, or `None` when the claim is not allocated.
pub fn allocated_devices(claim: &ResourceClaim, driver: &str) -> Option<Vec<AllocatedDevice>> {
    let devices = claim.status.as_ref()?.allocation.as_ref()?.devices.as_ref();
    let Some(devices) = devices else {
        return Some(Vec::new());
    };
    // Targeting as the claim wrote it, not the allocation's copy with cleared request lists.
    let configs = tessera_api::config::targets_as_written(claim);
    let results = devices.results.as_deref().unwrap_or_default();
    Some(
        results
            .iter()
            .filter(|r| r.driver == driver)
            .map(|r| {
                // A configuration naming `<request>` applies to all its subrequests too.
                let parent = r.request.split('/').next().unwrap_or(&r.request);
                let config_entries: Vec<DeviceAllocationConfiguration> = configs
                    .iter()
                    .filter(|c| match c.requests.as_deref() {
                        None | Some([]) => true,
                        Some(reqs) => reqs.iter().any(|q| q == &r.request || q == parent),
                    })
                    .filter(|c| c.opaque.as_ref().is_some_and(|o| o.driver == driver))
                    .cloned()
                    .collect();
                let configs = config_entries
                    .iter()
                    .filter_map(|c| c.opaque.as_ref())
                    .map(|o| o.parameters.0.clone())
                    .collect();
                AllocatedDevice {
                    request: r.request.clone(),
                    pool: r.pool.clone(),
                    device: r.device.clone(),
                    share_id: r.share_id.clone(),
                    configs,
                    config_entries,
                    consumed_capacity: r.consumed_capacity.clone().unwrap_or_default(),
                    published_strategy: None,
                    published_tenancy: None,
                }
            })
            .collect(),
    )
}

pub mod fake {
    //! In-process claims for tests, built like the API server would return them.

    use std::{
        collections::BTreeMap,
        sync::{Arc, Mutex},
    };

    use futures::future::BoxFuture;
    use k8s_openapi::{
        api::resource::v1::{
            AllocationResult, DeviceAllocationConfiguration, DeviceAllocationResult,
            DeviceRequestAllocationResult, OpaqueDeviceConfiguration, ResourceClaim,
            ResourceClaimConsumerReference, ResourceClaimSpec, ResourceClaimStatus,
        },
        apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::ObjectMeta, runtime::RawExtension},
    };

    use super::{ClaimList, ClaimSource, Published, SourceError, Unreadable};

    /// Pool of the claims [`claim`] builds unless told otherwise; tests name their node this.
    pub const NODE: &str = "node-a";

    /// Claims by `namespace/name`. Cloning shares the store, so a test can add claims after handing the
    /// source to the plugin.
    #[derive(Clone, Default)]
    pub struct FakeClaims {
        claims: Arc<Mutex<BTreeMap<String, ResourceClaim>>>,
        /// When set, every lookup fails with this message (an unreachable API server).
        failing: Arc<Mutex<Option<String>>>,
        /// Claims the API server holds but that do not decode: listed as unreadable, and a get fails.
        unreadable: Arc<Mutex<Vec<Unreadable>>>,
        /// What the ResourceSlices publish of devices, by `pool/device`.
        published: Arc<Mutex<BTreeMap<String, Published>>>,
    }

    impl FakeClaims {
        pub fn new() -> Self {
            Self::default()
        }

        /// Adds or replaces a claim.
        pub fn insert(&self, claim: ResourceClaim) -> &Self {
            let key = format!(
                "{}/{}",
                claim.metadata.namespace.as_deref().unwrap_or_default(),
                claim.metadata.name.as_deref().unwrap_or_default()
            );
            self.claims
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key, claim);
            self
        }

        /// Deletes a claim.
        pub fn remove(&self, namespace: &str, name: &str) {
            self.claims
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&format!("{namespace}/{name}"));
        }

        /// Adds a claim that does not decode (as a lone surrogate in its parameters makes one).
        pub fn insert_unreadable(&self, namespace: &str, name: &str, uid: &str, cause: &str) -> &Self {
            self.unreadable
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Unreadable {
                    namespace: Some(namespace.into()),
                    name: Some(name.into()),
                    uid: Some(uid.into()),
                    cause: cause.into(),
                });
            self
        }

        /// Publishes `capacity` (`(name, quantity)` pairs) for `device` of `pool`, as a ResourceSlice would.
        pub fn with_device_capacity(&self, pool: &str, device: &str, capacity: &[(&str, &str)]) -> &Self {
            self.publish(pool, device, |p| {
                p.capacity = capacity
                    .iter()
                    .map(|(n, q)| (n.to_string(), Quantity(q.to_string())))
                    .collect()
            })
        }

        /// Publishes `device` of `pool` with the `sharingStrategy` attribute `strategy`.
        pub fn with_device_strategy(
            &self,
            pool: &str,
            device: &str,
            strategy: tessera_api::config::SharingStrategy,
        ) -> &Self {
            self.publish(pool, device, |p| p.strategy = Some(strategy))
        }

        /// Publishes `device` of `pool` with the `mpsTenancy` attribute `tenancy`.
        pub fn with_device_tenancy(
            &self,
            pool: &str,
            device: &str,
            tenancy: tessera_api::policy::MpsTenancy,
        ) -> &Self {
            self.publish(pool, device, |p| p.tenancy = Some(tenancy))
        }

        /// Publishes `device` of `pool` with the `warmSeconds` attribute `seconds`.
        pub fn with_device_warm_seconds(&self, pool: &str, device: &str, seconds: u64) -> &Self {
            self.publish(pool, device, |p| p.warm_seconds = Some(seconds))
        }

        fn publish(&self, pool: &str, device: &str, change: impl FnOnce(&mut Published)) -> &Self {
            change(
                self.published
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(format!("{pool}/{device}"))
                    .or_default(),
            );
            self
        }

        /// Makes every lookup fail with `message` (`None` heals it).
        pub fn fail_with(&self, message: Option<&str>) {
            *self.failing.lock().unwrap_or_else(|e| e.into_inner()) = message.map(str::to_string);
        }
    }

    impl ClaimSource for FakeClaims {
        fn get<'a>(
            &'a self,
            namespace: &'a str,
            name: &'a str,
        ) -> BoxFuture<'a, Result<Option<ResourceClaim>, SourceError>> {
            let failing = self.failing.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let claim = self
                .claims
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&format!("{namespace}/{name}"))
                .cloned();
            let unreadable = self
                .unreadable
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .find(|u| u.key() == format!("{namespace}/{name}"))
                .map(|u| u.to_string());
            Box::pin(async move {
                match (failing, unreadable) {
                    (Some(message), _) | (None, Some(message)) => Err(message.into()),
                    (None, None) => Ok(claim),
                }
            })
        }

        fn list(&self) -> BoxFuture<'_, Result<ClaimList, SourceError>> {
            let failing = self.failing.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let list = ClaimList {
                claims: self
                    .claims
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .values()
                    .cloned()
                    .collect(),
                unreadable: self.unreadable.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            };
            Box::pin(async move {
                match failing {
                    Some(message) => Err(message.into()),
                    None => Ok(list),
                }
            })
        }

        fn published_device<'a>(
            &'a self,
            pool: &'a str,
            device: &'a str,
        ) -> BoxFuture<'a, Result<Option<Published>, SourceError>> {
            let failing = self.failing.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let published = self
                .published
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&format!("{pool}/{device}"))
                .cloned();
            Box::pin(async move {
                match failing {
                    Some(message) => Err(message.into()),
                    None => Ok(published),
                }
            })
        }
    }

    /// Starts a claim named `name` in namespace `default` with a fresh UID and no allocation.
    pub fn claim(name: &str) -> ClaimBuilder {
        ClaimBuilder {
            namespace: "default".into(),
            name: name.into(),
            uid: uuid::Uuid::new_v4().to_string(),
            pool: NODE.into(),
            driver: tessera_api::DRIVER_NAME.into(),
            request: "gpu".into(),
            allocated: false,
            results: Vec::new(),
            configs: Vec::new(),
            reserved_for: Vec::new(),
            annotations: BTreeMap::new(),
        }
    }

    /// Builds a [`ResourceClaim`] the way the scheduler leaves it after allocation.
    #[derive(Clone, Debug)]
    pub struct ClaimBuilder {
        namespace: String,
        name: String,
        uid: String,
        pool: String,
        driver: String,
        request: String,
        allocated: bool,
        results: Vec<DeviceRequestAllocationResult>,
        configs: Vec<DeviceAllocationConfiguration>,
        reserved_for: Vec<ResourceClaimConsumerReference>,
        annotations: BTreeMap<String, String>,
    }

    impl ClaimBuilder {
        /// Marks the claim as made from a pod's template for the pod's claim `name`, as the ResourceClaim
        /// controller does.
        pub fn from_template_for(mut self, name: &str) -> Self {
            self.annotations
                .insert("resource.kubernetes.io/pod-claim-name".into(), name.into());
            self
        }

        pub fn namespace(mut self, namespace: &str) -> Self {
            self.namespace = namespace.into();
            self
        }

        pub fn uid(mut self, uid: &str) -> Self {
            self.uid = uid.into();
            self
        }

        /// Pool (node) of the results added after this call.
        pub fn on_node(mut self, pool: &str) -> Self {
            self.pool = pool.into();
            self
        }

        /// Driver of the results added after this call.
        pub fn driver(mut self, driver: &str) -> Self {
            self.driver = driver.into();
            self
        }

        /// Request name of the results added after this call.
        pub fn request(mut self, request: &str) -> Self {
            self.request = request.into();
            self
        }

        /// Adds an allocation result for `device`.
        pub fn allocated(self, device: &str) -> Self {
            self.allocated_result(device, None)
        }

        /// Adds an allocation result for `device` with a consumable-capacity share id.
        pub fn allocated_share(self, device: &str, share_id: &str) -> Self {
            self.allocated_result(device, Some(share_id))
        }

        fn allocated_result(mut self, device: &str, share_id: Option<&str>) -> Self {
            self.allocated = true;
            self.results.push(DeviceRequestAllocationResult {
                request: self.request.clone(),
                driver: self.driver.clone(),
                pool: self.pool.clone(),
                device: device.into(),
                share_id: share_id.map(str::to_string),
                ..Default::default()
            });
            self
        }

        /// An allocation with no results (allocated, but nothing for any driver).
        pub fn allocated_empty(mut self) -> Self {
            self.allocated = true;
            self
        }

        /// Sets the consumed capacity of the last result added (a share the scheduler sized).
        pub fn consumed(mut self, name: &str, quantity: &str) -> Self {
            if let Some(r) = self.results.last_mut() {
                r.consumed_capacity.get_or_insert_with(BTreeMap::new).insert(
                    name.into(),
                    k8s_openapi::apimachinery::pkg::api::resource::Quantity(quantity.into()),
                );
            }
            self
        }

        /// Adds an opaque configuration of this driver that comes from the DeviceClass and names no request.
        pub fn class_config(mut self, parameters: serde_json::Value) -> Self {
            self.configs.push(DeviceAllocationConfiguration {
                source: "FromClass".into(),
                requests: None,
                opaque: Some(OpaqueDeviceConfiguration {
                    driver: self.driver.clone(),
                    parameters: RawExtension(parameters),
                }),
            });
            self
        }

        /// Adds an opaque configuration of this driver for the current request.
        pub fn config(mut self, parameters: serde_json::Value) -> Self {
            self.configs.push(DeviceAllocationConfiguration {
                source: "FromClaim".into(),
                requests: Some(vec![self.request.clone()]),
                opaque: Some(OpaqueDeviceConfiguration {
                    driver: self.driver.clone(),
                    parameters: RawExtension(parameters),
                }),
            });
            self
        }

        /// Reserves the claim for pod `name` (what the scheduler does when it binds the pod).
        pub fn reserved_for_pod(mut self, name: &str) -> Self {
            self.reserved_for.push(ResourceClaimConsumerReference {
                api_group: None,
                resource: "pods".into(),
                name: name.into(),
                uid: uuid::Uuid::new_v4().to_string(),
            });
            self
        }

        pub fn uid_str(&self) -> &str {
            &self.uid
        }

        pub fn build(self) -> ResourceClaim {
            ResourceClaim {
                metadata: ObjectMeta {
                    namespace: Some(self.namespace),
                    name: Some(self.name),
                    uid: Some(self.uid),
                    annotations: (!self.annotations.is_empty()).then_some(self.annotations),
                    ..Default::default()
                },
                spec: Some(ResourceClaimSpec::default()),
                status: self.allocated.then(|| ResourceClaimStatus {
                    allocation: Some(AllocationResult {
                        devices: Some(DeviceAllocationResult {
                            results: Some(self.results),
                            config: (!self.configs.is_empty()).then_some(self.configs),
                        }),
                        ..Default::default()
                    }),
                    reserved_for: (!self.reserved_for.is_empty()).then_some(self.reserved_for),
                    ..Default::default()
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_claim_whose_config_nests_too_deep_reads_as_an_error_naming_the_configuration() {
        let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
        let body = format!(
            r#"{{"apiVersion":"resource.k8s.io/v1","kind":"ResourceClaim","metadata":{{"name":"c"}},"status":{{"allocation":{{"devices":{{"config":[{{"source":"FromClaim","opaque":{{"driver":"gpu.tessera.dev","parameters":{{"x":{deep}}}}}}}]}}}}}}}}"#
        );
        let decode = serde_json::from_str::<super::ResourceClaim>(&body).unwrap_err();
        let message = super::read_error(kube::Error::SerdeError(decode)).to_string();
        assert!(message.contains("opaque configuration"), "{message}");
        assert!(!message.contains("recursion limit exceeded"), "{message}");

        let other = serde_json::from_str::<super::ResourceClaim>("{").unwrap_err();
        let message = super::read_error(kube::Error::SerdeError(other)).to_string();
        assert!(message.contains("EOF"), "{message}");
    }

    use super::{fake::claim, *};

    #[test]
    fn only_this_drivers_results_are_taken_with_their_configs() {
        let c = claim("c")
            .allocated("gpu-0")
            .config(serde_json::json!({"kind": "GpuConfig"}))
            .request("other")
            .driver("net.example.com")
            .allocated("nic-0")
            .build();
        let devices = allocated_devices(&c, tessera_api::DRIVER_NAME).unwrap();
        assert_eq!(devices.len(), 1);
        assert_eq!(devices[0].device, "gpu-0");
        assert_eq!(devices[0].request, "gpu");
        assert_eq!(devices[0].configs, vec![serde_json::json!({"kind": "GpuConfig"})]);
    }

    #[test]
    fn an_unallocated_claim_has_no_results() {
        assert_eq!(
            allocated_devices(&claim("c").build(), tessera_api::DRIVER_NAME),
            None
        );
    }
}
