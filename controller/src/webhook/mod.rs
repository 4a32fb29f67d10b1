//! Validating admission webhook for ResourceClaims and ResourceClaimTemplates: a claim whose tessera
//! configuration prepare would refuse is refused when it is created, not after it was allocated and its
//! pod waits on `FailedPrepareDynamicResources`.
//!
//! ```text
//!  AdmissionReview ──▶ review() ──▶ check_spec(): every opaque config of gpu.tessera.dev
//!   (server.rs, HTTPS)                  ├─ tessera_api::config::decode (prepare's own decoder and rules)
//!                                       ├─ targeted at a request whose DeviceClass offers only the other
//!                                       │  kind of device (classes.rs)? effective_config on such a device,
//!                                       │  exactly as prepare would call it
//!                                       └─ a compute ceiling: config::check_ceiling against each request's
//!                                          `compute` and, where its class offers no shares, its device
//! ```
//!
//! Everything here is plain Rust; [`server`] is the thin HTTPS layer and [`classes`] reads DeviceClasses
//! and ResourceSlices (get/list/watch only).

pub mod classes;
pub mod server;
pub mod tls;

use k8s_openapi::api::resource::v1::{
    DeviceAllocationConfiguration, DeviceRequest, OpaqueDeviceConfiguration, ResourceClaim,
    ResourceClaimSpec, ResourceClaimTemplate,
};
use kube::core::{
    DynamicObject,
    admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation},
};
use tessera_api::{
    DRIVER_NAME, DeviceName, attributes as attr,
    config::{self, DeviceConfig, SOURCE_FROM_CLAIM},
};

/// Why the webhook cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("failed to read the serving certificate {path}: {source}")]
    ReadCertificate {
        path: std::path::PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("the serving certificate file {path} holds no certificate")]
    NoCertificate { path: std::path::PathBuf },
    #[error("failed to read the serving key {path}: {source}")]
    ReadKey {
        path: std::path::PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("the serving key {path} cannot sign: {source}")]
    UnusableKey {
        path: std::path::PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("the serving key {key} is not the key of the certificate {cert}: {source}")]
    KeyDoesNotMatch {
        cert: std::path::PathBuf,
        key: std::path::PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("failed to configure TLS: {0}")]
    Tls(#[source] rustls::Error),
    #[error("failed to connect to the API server (to read DeviceClasses and ResourceSlices): {message}")]
    Client { message: String },
    #[error("failed to listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to accept a connection: {0}")]
    Accept(#[source] std::io::Error),
}

/// What a DeviceClass can hand out, as far as the published devices show: one example of each kind of
/// device its selectors match. Both `None`: nothing published matches yet, so nothing is known.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Offers {
    /// A MIG device or MIG share the class selects (a `MigConfig` fits it).
    pub mig: Option<DeviceName>,
    /// A whole GPU or GPU share the class selects (a `GpuConfig` fits it).
    pub gpu: Option<DeviceName>,
    /// The `sharingStrategy` attributes of the shared devices the class selects: each serves its
    /// published strategy to every claim sharing it, so a config may only ask for one of these.
    pub serves: std::collections::BTreeSet<String>,
    /// Whether the class also selects devices without a `sharingStrategy` (one holder, any strategy).
    pub unshared: bool,
}

impl Offers {
    /// The strategies a config asking for `asked` could get from this class instead, when no device the
    /// class selects serves `asked`; `None` when one does or nothing is known.
    fn strategy_unserved(&self, asked: &str) -> Option<String> {
        let refused = !self.unshared && !self.serves.is_empty() && !self.serves.contains(asked);
        refused.then(|| self.serves.iter().cloned().collect::<Vec<_>>().join(" or "))
    }

    /// A device of the class `config` cannot apply to, when every device of the class is such; `None`
    /// when some device fits or nothing is known.
    fn only_misfit(&self, config: &DeviceConfig) -> Option<&DeviceName> {
        let (fitting, other) = match config {
            DeviceConfig::MigConfig(_) => (&self.mig, &self.gpu),
            DeviceConfig::GpuConfig(_) => (&self.gpu, &self.mig),
        };
        match (fitting, other) {
            (None, Some(device)) => Some(device),
            _ => None,
        }
    }
}

/// Where the webhook learns what each DeviceClass offers.
pub trait ClassCatalog: Send + Sync {
    /// What `class` offers; `None` when the class is unknown.
    fn offers(&self, class: &str) -> Option<Offers>;
}

/// A catalog that knows no class: the webhook then checks configs on their own only.
#[derive(Clone, Debug, Default)]
pub struct NoClasses;

impl ClassCatalog for NoClasses {
    fn offers(&self, _class: &str) -> Option<Offers> {
        None
    }
}

/// A fixed catalog (tests, benchmarks, offline use).
#[derive(Clone, Debug, Default)]
pub struct FixedClasses(pub std::collections::BTreeMap<String, Offers>);

impl ClassCatalog for FixedClasses {
    fn offers(&self, class: &str) -> Option<Offers> {
        self.0.get(class).cloned()
    }
}

/// The outcome for one object: every problem found (nothing is dropped), and warnings that do not refuse.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Verdict {
    pub problems: Vec<String>,
    pub warnings: Vec<String>,
}

impl Verdict {
    pub fn allowed(&self) -> bool {
        self.problems.is_empty()
    }

    /// The denial message: each problem, in order.
    pub fn message(&self) -> String {
        self.problems.join("; ")
    }
}

/// Checks a claim spec; `path` is where the spec sits in the object (`spec` for a claim, `spec.spec` for
/// a template), so every message names the field as the user wrote it.
pub fn check_spec(spec: &ResourceClaimSpec, path: &str, classes: &dyn ClassCatalog) -> Verdict {
    let mut verdict = Verdict::default();
    let Some(devices) = &spec.devices else {
        return verdict;
    };
    let requests = devices.requests.as_deref().unwrap_or_default();
    for (i, entry) in devices.config.iter().flatten().enumerate() {
        let Some(opaque) = entry.opaque.as_ref().filter(|o| o.driver == DRIVER_NAME) else {
            continue;
        };
        let at = format!("{path}.devices.config[{i}]");
        let config = match config::decode_all(&opaque.parameters.0) {
            Ok(config) => config,
            Err(errors) => {
                // Every problem of the config at once, so it is fixed in one round trip.
                for e in errors {
                    verdict.problems.push(format!("{at}.opaque.parameters: {e}"));
                }
                continue;
            }
        };
        let mut judged = Entry {
            at: &at,
            opaque,
            config: &config,
            targeted: true,
        };
        match entry.requests.as_deref() {
            Some(named) if !named.is_empty() => {
                for named in named {
                    check_target(&mut verdict, &judged, named, requests, classes);
                }
            }
            // An untargeted config applies to every request it fits (prepare skips the others, a claim may
            // mix GPU and MIG requests), but a shared device refuses a strategy it does not serve whoever
            // targets it.
            _ => {
                judged.targeted = false;
                for request in requests {
                    check_target(&mut verdict, &judged, &request.name, requests, classes);
                }
            }
        }
    }
    warn_foreign_configs(&mut verdict, path, devices, classes);
    warn_memory_only_shares(&mut verdict, path, requests, classes);
    warn_capacity_of_whole_devices(&mut verdict, path, requests, classes);
    verdict
}

/// Warns about a request that names capacity of a class whose devices one claim takes whole (whole GPUs,
/// MIG devices): the allocator checks the amount against the device's and gives the whole device, so a
/// consumable share ported from NVIDIA's driver (`gpu.nvidia.com` with `memory: 2Gi`) to
/// `gpu.tessera.dev` silently gets a whole GPU.
fn warn_capacity_of_whole_devices(
    verdict: &mut Verdict,
    path: &str,
    requests: &[DeviceRequest],
    classes: &dyn ClassCatalog,
) {
    let named = |capacity: Option<&k8s_openapi::api::resource::v1::CapacityRequirements>| {
        capacity
            .and_then(|c| c.requests.as_ref())
            .map(|r| r.keys().cloned().collect::<Vec<_>>())
            .filter(|k| !k.is_empty())
    };
    let whole_only = |class: &str| {
        classes
            .offers(class)
            .is_some_and(|o| o.serves.is_empty() && (o.gpu.is_some() || o.mig.is_some()))
    };
    for (i, request) in requests.iter().enumerate() {
        let mut asks = Vec::new();
        if let Some(e) = &request.exactly
            && let Some(keys) = named(e.capacity.as_ref())
            && whole_only(&e.device_class_name)
        {
            asks.push((
                format!("{path}.devices.requests[{i}].exactly"),
                &e.device_class_name,
                keys,
            ));
        }
        for (j, sub) in request.first_available.iter().flatten().enumerate() {
            if let Some(keys) = named(sub.capacity.as_ref())
                && whole_only(&sub.device_class_name)
            {
                asks.push((
                    format!("{path}.devices.requests[{i}].firstAvailable[{j}]"),
                    &sub.device_class_name,
                    keys,
                ));
            }
        }
        for (field, class, keys) in asks {
            verdict.warnings.push(format!(
                "{field}.capacity.requests: request {name:?} names {keys} of {class}, whose devices a claim \
                 takes whole: it gets a whole device, not that amount of one. For a share of a GPU, use \
                 deviceClassName shared.gpu.tessera.dev",
                name = request.name,
                keys = keys.join(", "),
            ));
        }
    }
}

/// Warns about a share request that names `memory` and no `compute`: it reserves no compute (the
/// published default is 0, so the GPU's other shares fit beside it) and so gets no MPS thread limit
/// from the scheduler; a user who wanted a capped share of the SMs learns it at create, not from a
/// neighbour's load.
fn warn_memory_only_shares(
    verdict: &mut Verdict,
    path: &str,
    requests: &[DeviceRequest],
    classes: &dyn ClassCatalog,
) {
    let memory_only = |capacity: Option<&k8s_openapi::api::resource::v1::CapacityRequirements>| {
        capacity
            .and_then(|c| c.requests.as_ref())
            .is_some_and(|r| r.contains_key(attr::MEMORY) && !r.contains_key(attr::COMPUTE))
    };
    let shares = |class: &str| classes.offers(class).is_some_and(|o| !o.serves.is_empty());
    for (i, request) in requests.iter().enumerate() {
        let mut asks: Vec<(String, &str)> = Vec::new();
        if let Some(e) = &request.exactly
            && memory_only(e.capacity.as_ref())
            && shares(&e.device_class_name)
        {
            asks.push((
                format!("{path}.devices.requests[{i}].exactly.capacity.requests"),
                &request.name,
            ));
        }
        for (j, sub) in request.first_available.iter().flatten().enumerate() {
            if memory_only(sub.capacity.as_ref()) && shares(&sub.device_class_name) {
                asks.push((
                    format!("{path}.devices.requests[{i}].firstAvailable[{j}].capacity.requests"),
                    &request.name,
                ));
            }
        }
        for (field, name) in asks {
            verdict.warnings.push(format!(
                "{field}: request {name:?} names memory and no compute, so it reserves no share of the SMs \
                 (compute defaults to {unrequested}) and its MPS server gets no thread limit beyond its config's \
                 defaultActiveThreadPercentage; the GPU's other shares run beside it. Add compute (a percentage) \
                 to cap and reserve its share",
                unrequested = crate::devices::COMPUTE_UNREQUESTED,
            ));
        }
    }
}

/// Drivers whose configs users port to tessera claims; a config for them on a request tessera serves is
/// ignored by every driver, and the user believes the setting is on.
const PORTED_FROM: &[&str] = &["gpu.nvidia.com", "gpu.example.com", "gpu.resource.nvidia.com"];

/// Warns about a config of another GPU driver aimed at a request whose class tessera serves: the scheduler
/// passes it to the driver it names, which allocated nothing there, so it does nothing. A warning, not a
/// refusal: the request's class may also select that driver's devices.
fn warn_foreign_configs(
    verdict: &mut Verdict,
    path: &str,
    devices: &k8s_openapi::api::resource::v1::DeviceClaim,
    classes: &dyn ClassCatalog,
) {
    let requests = devices.requests.as_deref().unwrap_or_default();
    for (i, entry) in devices.config.iter().flatten().enumerate() {
        let Some(opaque) = entry.opaque.as_ref().filter(|o| o.driver != DRIVER_NAME) else {
            continue;
        };
        if !PORTED_FROM.contains(&opaque.driver.as_str()) {
            continue;
        }
        let targets: Vec<&str> = match entry.requests.as_deref() {
            Some(named) if !named.is_empty() => named.iter().map(String::as_str).collect(),
            _ => requests.iter().map(|r| r.name.as_str()).collect(),
        };
        let served: Vec<String> = targets
            .iter()
            .flat_map(|named| classes_named(named, requests))
            .filter(|(_, class)| {
                classes
                    .offers(class)
                    .is_some_and(|o| o.mig.is_some() || o.gpu.is_some())
            })
            .map(|(request, _)| request)
            .collect();
        if served.is_empty() {
            continue;
        }
        verdict.warnings.push(format!(
            "{path}.devices.config[{i}].opaque.driver: {driver:?} is not tessera's driver, yet request(s) {served:?} \
             get tessera's devices ({DRIVER_NAME}); no driver will apply this config to them. Write it for \
             {DRIVER_NAME} (apiVersion {version}, kind GpuConfig or MigConfig; see api/README.md)",
            driver = opaque.driver,
            version = tessera_api::GROUP_VERSION,
        ));
    }
}

/// The DeviceClasses a config entry naming `named` (`<request>` or `<request>/<subrequest>`) may end up
/// applied with: one per alternative the scheduler may pick.
fn classes_named<'r>(named: &str, requests: &'r [DeviceRequest]) -> Vec<(String, &'r str)> {
    let (parent, sub) = match named.split_once('/') {
        Some((p, s)) => (p, Some(s)),
        None => (named, None),
    };
    let Some(request) = requests.iter().find(|r| r.name == parent) else {
        // The API server refuses config entries naming no request; nothing to add.
        return Vec::new();
    };
    if let Some(exactly) = &request.exactly {
        return vec![(request.name.clone(), exactly.device_class_name.as_str())];
    }
    request
        .first_available
        .iter()
        .flatten()
        .filter(|s| sub.is_none_or(|sub| s.name == sub))
        .map(|s| {
            (
                format!("{}/{}", request.name, s.name),
                s.device_class_name.as_str(),
            )
        })
        .collect()
}

/// One config entry of a claim, as [`check_target`] judges it.
struct Entry<'a> {
    /// Its field path (`spec.devices.config[i]`).
    at: &'a str,
    opaque: &'a OpaqueDeviceConfiguration,
    config: &'a DeviceConfig,
    /// Whether it names its requests; an untargeted one applies only where it fits.
    targeted: bool,
}

fn check_target(
    verdict: &mut Verdict,
    entry: &Entry<'_>,
    named: &str,
    requests: &[DeviceRequest],
    classes: &dyn ClassCatalog,
) {
    let Entry {
        at, opaque, config, ..
    } = *entry;
    let alternatives = classes_named(named, requests);
    let mut misfits = Vec::new();
    let mut unserved = Vec::new();
    let mut fits_somewhere = false;
    let asked = config.sharing().map(|s| s.strategy.as_str());
    for (request, class) in &alternatives {
        let offers = classes.offers(class);
        if let Some(device) = offers.as_ref().and_then(|o| o.only_misfit(config)) {
            if entry.targeted {
                misfits.push((request.clone(), *class, device.clone()));
            } else {
                // Prepare skips an untargeted config of the other kind there.
                fits_somewhere = true;
            }
        } else if let Some(serves) = asked.and_then(|a| offers.as_ref()?.strategy_unserved(a)) {
            unserved.push((request.clone(), *class, serves));
        } else {
            fits_somewhere = true;
        }
    }
    check_ceilings(verdict, entry, &alternatives, requests, classes);
    for (request, class, serves) in unserved {
        let asked = asked.unwrap_or_default();
        let text = format!(
            "{at}.opaque.parameters.sharing.strategy: request {request:?} gets devices of DeviceClass {class:?}, \
             whose shared devices serve {serves} (their sharingStrategy attribute) to every claim sharing them, \
             so this claim may not ask for {asked}; ask for {serves}, leave sharing out, or select devices with \
             device.attributes[\"{DRIVER_NAME}\"].sharingStrategy == \"{asked}\""
        );
        if fits_somewhere {
            verdict.warnings.push(format!(
                "{text} (other alternatives of {named:?} fit, so the claim is allowed)"
            ));
        } else {
            verdict.problems.push(text);
        }
    }
    for (request, class, device) in misfits {
        // Prepare's own check on a device the class offers, so the message is the one the pod would get.
        let entry = DeviceAllocationConfiguration {
            source: SOURCE_FROM_CLAIM.into(),
            requests: Some(vec![named.to_string()]),
            opaque: Some(opaque.clone()),
        };
        let Err(e) = config::effective_config(&[entry], &request, &device) else {
            continue;
        };
        let text = format!(
            "{at}: request {request:?} gets devices of DeviceClass {class:?}, which offers only devices such as \
             {device}: {e}"
        );
        if fits_somewhere {
            verdict.warnings.push(format!(
                "{text} (other alternatives of {named:?} fit, so the claim is allowed)"
            ));
        } else {
            verdict.problems.push(text);
        }
    }
}

/// A burstable share's ceiling (`sharing.mps.computeCeiling`) against each alternative the entry may apply
/// to: below that alternative's `compute` request, or on a class that offers no shares at all (whole GPUs,
/// unshared MIG devices), prepare would refuse it ([`config::check_ceiling`], the same check).
fn check_ceilings(
    verdict: &mut Verdict,
    entry: &Entry<'_>,
    alternatives: &[(String, &str)],
    requests: &[DeviceRequest],
    classes: &dyn ClassCatalog,
) {
    for (request, class) in alternatives {
        let offers = classes.offers(class);
        let device = offers
            .as_ref()
            .filter(|o| o.serves.is_empty())
            .and_then(|o| match entry.config {
                DeviceConfig::MigConfig(_) => o.mig.as_ref(),
                DeviceConfig::GpuConfig(_) => o.gpu.as_ref(),
            });
        if let Err(e) =
            config::check_ceiling(Some(entry.config), device, compute_requested(request, requests))
        {
            verdict.problems.push(format!(
                "{}.opaque.parameters: request {request:?} (DeviceClass {class:?}): {e}",
                entry.at
            ));
        }
    }
}

/// The `compute` capacity (percent) the alternative `named` (`<request>` or `<request>/<subrequest>`) asks
/// for; `None` when it asks for none or it does not parse (the API server checks quantities).
fn compute_requested(named: &str, requests: &[DeviceRequest]) -> Option<u64> {
    let (parent, sub) = match named.split_once('/') {
        Some((p, s)) => (p, Some(s)),
        None => (named, None),
    };
    let request = requests.iter().find(|r| r.name == parent)?;
    let capacity = match sub {
        None => request.exactly.as_ref()?.capacity.as_ref(),
        Some(sub) => request
            .first_available
            .iter()
            .flatten()
            .find(|s| s.name == sub)?
            .capacity
            .as_ref(),
    };
    let q = capacity?.requests.as_ref()?.get(attr::COMPUTE)?;
    config::parse_quantity(&q.0).ok()
}

/// Decides one admission request.
pub fn review(request: &AdmissionRequest<DynamicObject>, classes: &dyn ClassCatalog) -> AdmissionResponse {
    let response = AdmissionResponse::from(request);
    if !matches!(request.operation, Operation::Create | Operation::Update) {
        return response;
    }
    let Some(object) = request.object.clone() else {
        return response;
    };
    let kind = request.kind.kind.as_str();
    let verdict = match kind {
        "ResourceClaim" => match object.try_parse::<ResourceClaim>() {
            Ok(claim) => match &claim.spec {
                Some(spec) => check_spec(spec, "spec", classes),
                None => Verdict::default(),
            },
            Err(e) => return response.deny(format!("cannot read the ResourceClaim: {e}")),
        },
        "ResourceClaimTemplate" => match object.try_parse::<ResourceClaimTemplate>() {
            Ok(template) => match template.spec.as_ref().and_then(|s| s.spec.as_ref()) {
                Some(spec) => check_spec(spec, "spec.spec", classes),
                None => Verdict::default(),
            },
            Err(e) => return response.deny(format!("cannot read the ResourceClaimTemplate: {e}")),
        },
        // Registered for claims and templates only; anything else is not ours to judge.
        _ => return response,
    };
    respond(response, verdict)
}

fn respond(mut response: AdmissionResponse, verdict: Verdict) -> AdmissionResponse {
    if !verdict.warnings.is_empty() {
        response.warnings = Some(verdict.warnings.clone());
    }
    if verdict.allowed() {
        response
    } else {
        let mut response = response.deny(verdict.message());
        response.result.code = 422;
        response.result.reason = "Invalid".into();
        response
    }
}

/// Answers one AdmissionReview body. A body that is no AdmissionReview gets an `invalid` response; one
/// whose object nests too deep for the JSON reader is refused with the message prepare would give.
pub fn review_body(body: &[u8], classes: &dyn ClassCatalog) -> AdmissionReview<DynamicObject> {
    match serde_json::from_slice::<AdmissionReview<DynamicObject>>(body) {
        Ok(review_obj) => match TryInto::<AdmissionRequest<DynamicObject>>::try_into(review_obj) {
            Ok(request) => review(&request, classes).into_review(),
            Err(_) => AdmissionResponse::invalid("the AdmissionReview has no request").into_review(),
        },
        Err(e) => match unreadable_message(&e) {
            Some(message) => match uid_of(body) {
                Some(uid) => unreadable(uid, message).into_review(),
                None => AdmissionResponse::invalid(message).into_review(),
            },
            None => AdmissionResponse::invalid(format!("not an AdmissionReview: {e}")).into_review(),
        },
    }
}

/// Why the object cannot be read, when the plugins could not read it either: nesting past the JSON reader's
/// limit, or a lone UTF-16 surrogate (valid JSON the API server stores, but no Unicode string). Admitted,
/// such a claim could never be prepared.
fn unreadable_message(e: &serde_json::Error) -> Option<String> {
    let text = e.to_string();
    if let Some(message) = config::too_deep_config_message(&text) {
        return Some(message);
    }
    (text.contains("surrogate") || text.contains("hex escape"))
        .then(|| tessera_api::claim_list::cause_in_words(e))
}

/// The request's uid from a body too deep (or too odd) to read whole: skipping a value needs no recursion
/// and decodes no string but the uid.
fn uid_of(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Outer {
        request: Inner,
    }
    #[derive(serde::Deserialize)]
    struct Inner {
        uid: String,
    }
    serde_json::from_slice::<Outer>(body).ok().map(|o| o.request.uid)
}

fn unreadable(uid: String, message: String) -> AdmissionResponse {
    // Built through a minimal request so the response carries the uid and the v1 type meta.
    let request: AdmissionRequest<DynamicObject> = serde_json::from_value(serde_json::json!({
        "uid": uid,
        "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
        "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
        "operation": "CREATE",
        "userInfo": {},
    }))
    .expect("a literal request parses");
    let mut response = AdmissionResponse::from(&request).deny(message);
    response.types = kube::core::TypeMeta {
        api_version: kube::core::admission::META_API_VERSION_V1.into(),
        kind: kube::core::admission::META_KIND.into(),
    };
    response.result.code = 422;
    response
}

#[cfg(test)]
mod tests;
