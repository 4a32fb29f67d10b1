//! The decision function, from AdmissionReview JSON as the API server sends it.

use serde_json::{Value, json};

use super::*;

/// A ResourceClaim (or template) as JSON, built request by request.
#[derive(Default)]
struct ClaimBuilder {
    requests: Vec<Value>,
    config: Vec<Value>,
}

fn claim() -> ClaimBuilder {
    ClaimBuilder::default()
}

impl ClaimBuilder {
    fn request(mut self, name: &str, class: &str) -> Self {
        self.requests
            .push(json!({"name": name, "exactly": {"deviceClassName": class, "count": 1}}));
        self
    }

    /// A request asking for `capacity` (`{"memory": "10Gi"}`) of its class.
    fn request_with(mut self, name: &str, class: &str, capacity: Value) -> Self {
        self.requests.push(json!({"name": name, "exactly": {
            "deviceClassName": class, "count": 1, "capacity": {"requests": capacity}}}));
        self
    }

    fn first_available(mut self, name: &str, alternatives: &[(&str, &str)]) -> Self {
        let subs: Vec<Value> = alternatives
            .iter()
            .map(|(n, c)| json!({"name": n, "deviceClassName": c}))
            .collect();
        self.requests.push(json!({"name": name, "firstAvailable": subs}));
        self
    }

    fn config_for(mut self, requests: &[&str], driver: &str, parameters: Value) -> Self {
        let mut entry = json!({"opaque": {"driver": driver, "parameters": parameters}});
        if !requests.is_empty() {
            entry["requests"] = json!(requests);
        }
        self.config.push(entry);
        self
    }

    fn config(self, parameters: Value) -> Self {
        self.config_for(&[], DRIVER_NAME, parameters)
    }

    fn spec(&self) -> Value {
        json!({"devices": {"requests": self.requests, "config": self.config}})
    }

    fn claim_review(&self) -> Value {
        review_json(
            "ResourceClaim",
            "resourceclaims",
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                   "metadata": {"name": "c", "namespace": "ns"}, "spec": self.spec()}),
        )
    }

    fn template_review(&self) -> Value {
        review_json(
            "ResourceClaimTemplate",
            "resourceclaimtemplates",
            json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                   "metadata": {"name": "t", "namespace": "ns"}, "spec": {"spec": self.spec()}}),
        )
    }
}

fn review_json(kind: &str, resource: &str, object: Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": kind},
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": resource},
            "namespace": "ns",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": object,
            "dryRun": false
        }
    })
}

fn mps(extra: Value) -> Value {
    json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
           "sharing": {"strategy": "MPS", "mps": extra}})
}

fn mig_config() -> Value {
    json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigConfig",
           "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": 50}}})
}

/// Classes as the shipped DeviceClasses would be seen on a node with whole GPUs, MIG placements and MPS
/// shares.
fn shipped_classes() -> FixedClasses {
    let offers = |gpu: Option<&str>, mig: Option<&str>, serves: &[&str], unshared: bool| Offers {
        gpu: gpu.map(|d| d.parse().unwrap()),
        mig: mig.map(|d| d.parse().unwrap()),
        serves: serves.iter().map(|s| s.to_string()).collect(),
        unshared,
    };
    FixedClasses(
        [
            ("gpu.tessera.dev", offers(Some("gpu-0"), None, &[], true)),
            (
                "mig.gpu.tessera.dev",
                offers(None, Some("gpu-0-mig-3g-40gb-4"), &[], true),
            ),
            (
                "shared.gpu.tessera.dev",
                offers(Some("gpu-0-shared"), None, &["MPS"], false),
            ),
            (
                "timesliced.example.com",
                offers(Some("gpu-2-shared"), None, &["TimeSlicing"], false),
            ),
            (
                "anything.example.com",
                offers(Some("gpu-0"), Some("gpu-0-mig-3g-40gb-4"), &["MPS"], true),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect(),
    )
}

fn decide(review: &Value, classes: &dyn ClassCatalog) -> AdmissionResponse {
    let body = serde_json::to_vec(review).unwrap();
    review_body(&body, classes)
        .response
        .expect("every review is answered")
}

#[test]
fn a_share_config_asking_for_150_percent_of_the_threads_is_refused_naming_the_field() {
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(mps(json!({"defaultActiveThreadPercentage": 150})))
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(!response.allowed);
    assert_eq!(
        response.result.message,
        "spec.devices.config[0].opaque.parameters: sharing.mps.defaultActiveThreadPercentage: must be between 1 \
         and 100, got 150"
    );
    assert_eq!(response.result.code, 422);
    assert_eq!(response.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
}

#[test]
fn a_template_names_the_field_under_spec_spec() {
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(
            json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
                       "sharing": {"strategy": "NotAStrategy"}}),
        )
        .template_review();
    let response = decide(&review, &shipped_classes());
    assert!(!response.allowed);
    assert_eq!(
        response.result.message,
        "spec.spec.devices.config[0].opaque.parameters: sharing.strategy: must be one of MPS, TimeSlicing, got \
         \"NotAStrategy\""
    );
}

#[test]
fn the_message_is_the_one_prepare_gives_for_the_same_parameters() {
    let parameters = mps(json!({"defaultPinnedDeviceMemoryLimit": "10Gb"}));
    let prepare = config::decode(&parameters).unwrap_err().to_string();
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(parameters)
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert_eq!(
        response.result.message,
        format!("spec.devices.config[0].opaque.parameters: {prepare}")
    );
}

#[test]
fn capacity_asked_of_the_whole_gpu_class_is_allowed_with_a_warning_naming_the_share_class() {
    // A consumable share ported from NVIDIA's driver by renaming gpu.nvidia.com: it would get a whole GPU.
    let review = claim()
        .request_with("gpu", "gpu.tessera.dev", json!({"memory": "2Gi"}))
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(response.allowed, "{}", response.result.message);
    let warnings = response.warnings.unwrap_or_default();
    assert_eq!(
        warnings,
        [
            "spec.devices.requests[0].exactly.capacity.requests: request \"gpu\" names memory of gpu.tessera.dev, \
          whose devices a claim takes whole: it gets a whole device, not that amount of one. For a share of a \
          GPU, use deviceClassName shared.gpu.tessera.dev"
        ]
    );
    let share = claim()
        .request_with(
            "gpu",
            "shared.gpu.tessera.dev",
            json!({"memory": "2Gi", "compute": "10"}),
        )
        .claim_review();
    assert_eq!(
        decide(&share, &shipped_classes()).warnings.unwrap_or_default(),
        Vec::<String>::new()
    );
}

#[test]
fn a_share_that_names_memory_and_no_compute_is_allowed_with_a_warning_that_it_reserves_no_compute() {
    let review = claim()
        .request_with("gpu", "shared.gpu.tessera.dev", json!({"memory": "10Gi"}))
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(response.allowed, "{}", response.result.message);
    let warnings = response.warnings.unwrap_or_default();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with(
            "spec.devices.requests[0].exactly.capacity.requests: request \"gpu\" names memory and no compute"
        ) && warnings[0].contains("compute defaults to 0")
            && warnings[0].contains("Add compute"),
        "{}",
        warnings[0]
    );
}

#[test]
fn a_share_that_names_memory_and_compute_or_a_whole_gpu_request_gets_no_compute_warning() {
    for review in [
        claim()
            .request_with(
                "gpu",
                "shared.gpu.tessera.dev",
                json!({"memory": "10Gi", "compute": "25"}),
            )
            .claim_review(),
        claim()
            .request_with("gpu", "gpu.tessera.dev", json!({"memory": "10Gi"}))
            .claim_review(),
    ] {
        let response = decide(&review, &shipped_classes());
        assert!(response.allowed, "{}", response.result.message);
        // The whole-GPU request gets the warning that it takes a whole GPU, not this one.
        let warnings = response.warnings.unwrap_or_default();
        assert!(warnings.iter().all(|w| !w.contains("no compute")), "{warnings:?}");
    }
}

#[test]
fn a_valid_share_config_is_allowed_without_warnings() {
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(mps(
            json!({"defaultActiveThreadPercentage": 25, "defaultPinnedDeviceMemoryLimit": "10Gi",
                           "perDevicePinnedMemoryLimit": {"gpu-1-shared": "20Gi"}}),
        ))
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(response.allowed, "{}", response.result.message);
    assert_eq!(response.warnings, None);
}

#[test]
fn a_misspelled_field_is_refused_with_the_allowed_fields() {
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(mps(json!({"defaultActiveThreadPercent": 50})))
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(!response.allowed);
    assert!(
        response
            .result
            .message
            .contains("sharing.mps: unknown field \"defaultActiveThreadPercent\"; allowed fields: defaultActiveThreadPercentage"),
        "{}",
        response.result.message
    );
}

#[test]
fn a_per_device_key_that_names_no_device_pattern_is_refused() {
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(mps(json!({"perDevicePinnedMemoryLimit": {"gpu-one": "20Gi"}})))
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(!response.allowed);
    assert!(
        response
            .result
            .message
            .starts_with("spec.devices.config[0].opaque.parameters: sharing.mps.perDevicePinnedMemoryLimit: key \"gpu-one\" is not a tessera device name"),
        "{}",
        response.result.message
    );
}

#[test]
fn every_bad_entry_is_reported_not_only_the_first() {
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(mps(json!({"defaultActiveThreadPercentage": 0})))
        .config(mps(json!({"defaultPinnedDeviceMemoryLimit": "0"})))
        .claim_review();
    let message = decide(&review, &shipped_classes()).result.message;
    assert!(
        message.contains("config[0].opaque.parameters: sharing.mps.defaultActiveThreadPercentage"),
        "{message}"
    );
    assert!(
        message.contains(
            "config[1].opaque.parameters: sharing.mps.defaultPinnedDeviceMemoryLimit: must be at least 1Mi"
        ),
        "{message}"
    );
}

#[test]
fn configs_for_other_drivers_are_not_read() {
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config_for(&[], "other.example.com", json!({"anything": ["goes"]}))
        .claim_review();
    assert!(decide(&review, &shipped_classes()).allowed);
}

#[test]
fn a_mig_config_for_a_request_of_a_whole_gpu_class_is_refused_with_prepares_message() {
    let review = claim()
        .request("gpu", "gpu.tessera.dev")
        .config_for(&["gpu"], DRIVER_NAME, mig_config())
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(!response.allowed);
    assert_eq!(
        response.result.message,
        "spec.devices.config[0]: request \"gpu\" gets devices of DeviceClass \"gpu.tessera.dev\", which offers only \
         devices such as gpu-0: cannot apply MigConfig to whole GPU gpu-0; use GpuConfig"
    );
}

#[test]
fn a_gpu_config_for_a_request_of_a_mig_class_is_refused() {
    let review = claim()
        .request("slice", "mig.gpu.tessera.dev")
        .config_for(&["slice"], DRIVER_NAME, mps(json!({})))
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(!response.allowed);
    assert!(
        response
            .result
            .message
            .ends_with("cannot apply GpuConfig to MIG device gpu-0-mig-3g-40gb-4; use MigConfig"),
        "{}",
        response.result.message
    );
}

#[test]
fn an_untargeted_mig_config_next_to_whole_gpu_requests_is_allowed_as_prepare_skips_it() {
    let review = claim()
        .request("gpu", "gpu.tessera.dev")
        .request("slice", "mig.gpu.tessera.dev")
        .config(mig_config())
        .claim_review();
    assert!(decide(&review, &shipped_classes()).allowed);
}

#[test]
fn a_mig_config_for_a_class_offering_both_kinds_is_allowed() {
    let review = claim()
        .request("gpu", "anything.example.com")
        .config_for(&["gpu"], DRIVER_NAME, mig_config())
        .claim_review();
    assert!(decide(&review, &shipped_classes()).allowed);
}

#[test]
fn a_class_nothing_is_known_about_refuses_nothing_beyond_the_config_itself() {
    let review = claim()
        .request("gpu", "not-created-yet")
        .config_for(&["gpu"], DRIVER_NAME, mig_config())
        .claim_review();
    assert!(decide(&review, &shipped_classes()).allowed);
    assert!(decide(&review, &NoClasses).allowed);
}

#[test]
fn a_mig_config_for_alternatives_of_which_one_fits_is_allowed_with_a_warning() {
    let review = claim()
        .first_available(
            "gpu",
            &[("slice", "mig.gpu.tessera.dev"), ("whole", "gpu.tessera.dev")],
        )
        .config_for(&["gpu"], DRIVER_NAME, mig_config())
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(response.allowed, "{}", response.result.message);
    let warnings = response
        .warnings
        .expect("a warning for the whole-GPU alternative");
    assert_eq!(warnings.len(), 1);
    assert!(warnings[0].contains("request \"gpu/whole\""), "{warnings:?}");
}

#[test]
fn a_mig_config_naming_one_subrequest_is_checked_against_that_subrequest_only() {
    let review = claim()
        .first_available(
            "gpu",
            &[("slice", "mig.gpu.tessera.dev"), ("whole", "gpu.tessera.dev")],
        )
        .config_for(&["gpu/whole"], DRIVER_NAME, mig_config())
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(!response.allowed);
    assert!(
        response.result.message.contains("request \"gpu/whole\""),
        "{}",
        response.result.message
    );
}

#[test]
fn a_delete_is_allowed_without_reading_the_object() {
    let mut review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(mps(json!({"defaultActiveThreadPercentage": 150})))
        .claim_review();
    review["request"]["operation"] = json!("DELETE");
    assert!(decide(&review, &shipped_classes()).allowed);
}

#[test]
fn a_body_that_is_no_admission_review_gets_an_invalid_response() {
    let response = review_body(b"{\"hello\":", &NoClasses).response.unwrap();
    assert!(!response.allowed);
    assert!(
        response.result.message.starts_with("not an AdmissionReview"),
        "{}",
        response.result.message
    );
}

#[test]
fn parameters_nesting_too_deep_to_read_are_refused_with_the_request_uid() {
    let mut deep = json!(1);
    for _ in 0..200 {
        deep = json!([deep]);
    }
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig", "x": deep}))
        .claim_review();
    // serde_json's writer has no depth limit, its reader has.
    let body = serde_json::to_vec(&review).unwrap();
    let response = review_body(&body, &NoClasses).response.unwrap();
    assert!(!response.allowed);
    assert_eq!(response.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
    assert!(
        response.result.message.contains("nests deeper than 128 levels"),
        "{}",
        response.result.message
    );
}

#[test]
fn parameters_holding_a_lone_surrogate_are_refused_with_the_request_uid_and_the_cause() {
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig", "note": "PLACEHOLDER"}))
        .claim_review();
    // serde_json cannot write a lone surrogate; the API server stores the escape as it came.
    let body = serde_json::to_string(&review)
        .unwrap()
        .replace("PLACEHOLDER", "\\ud800");
    let response = review_body(body.as_bytes(), &NoClasses).response.unwrap();
    assert!(!response.allowed);
    assert_eq!(response.uid, "705ab4f5-6393-11e8-b7cc-42010a800002");
    assert!(
        response.result.message.contains("lone UTF-16 surrogate"),
        "{}",
        response.result.message
    );
}

fn time_slicing() -> Value {
    json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
           "sharing": {"strategy": "TimeSlicing"}})
}

/// Issue 23 item 1: a time-slicing claim placed on an MPS-shared GPU locked it against every MPS share.
#[test]
fn a_time_slicing_config_for_a_class_whose_shared_devices_all_serve_mps_is_refused_naming_the_attribute() {
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config_for(&["gpu"], DRIVER_NAME, time_slicing())
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(!response.allowed, "{response:?}");
    let message = &response.result.message;
    assert!(
        message.starts_with(
            "spec.devices.config[0].opaque.parameters.sharing.strategy: request \"gpu\" gets devices of \
             DeviceClass \"shared.gpu.tessera.dev\", whose shared devices serve MPS"
        ),
        "{message}"
    );
    assert!(
        message.contains("sharingStrategy == \"TimeSlicing\""),
        "{message}"
    );

    let swapped = claim()
        .request("gpu", "timesliced.example.com")
        .config_for(&["gpu"], DRIVER_NAME, mps(json!({})))
        .claim_review();
    let response = decide(&swapped, &shipped_classes());
    assert!(!response.allowed, "the strategies swapped: {response:?}");
    assert!(
        response.result.message.contains("serve TimeSlicing"),
        "{}",
        response.result.message
    );
}

#[test]
fn an_untargeted_time_slicing_config_on_a_one_request_mps_share_claim_is_refused_too() {
    // kube-scheduler clears the requests of a config that names every request, so users write either.
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(time_slicing())
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(!response.allowed, "{response:?}");
    assert!(
        response.result.message.contains("whose shared devices serve MPS"),
        "{}",
        response.result.message
    );
}

#[test]
fn an_untargeted_time_slicing_config_next_to_a_mig_request_refuses_nothing_for_the_mig_request() {
    let review = claim()
        .request("gpu", "gpu.tessera.dev")
        .request("slice", "mig.gpu.tessera.dev")
        .config(time_slicing())
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(response.allowed, "{response:?}");
}

#[test]
fn a_strategy_some_selected_device_serves_is_allowed() {
    for (class, config) in [
        ("shared.gpu.tessera.dev", mps(json!({}))),
        ("timesliced.example.com", time_slicing()),
        // An exclusive GPU has one holder, which may use either strategy.
        ("anything.example.com", time_slicing()),
        ("gpu.tessera.dev", time_slicing()),
    ] {
        let review = claim()
            .request("gpu", class)
            .config_for(&["gpu"], DRIVER_NAME, config)
            .claim_review();
        let response = decide(&review, &shipped_classes());
        assert!(response.allowed, "{class}: {response:?}");
    }
}

/// Issue 23 item 3: NVIDIA's config errors appear one at a time, at prepare.
#[test]
fn every_problem_of_one_config_is_reported_in_one_refusal() {
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(mps(
            json!({"defaultActiveThreadPercentage": 150, "defaultPinnedDeviceMemoryLimit": "10GB",
                           "typo": true}),
        ))
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(!response.allowed);
    let message = &response.result.message;
    for want in [
        "spec.devices.config[0].opaque.parameters: sharing.mps: unknown field \"typo\"",
        "spec.devices.config[0].opaque.parameters: sharing.mps.defaultActiveThreadPercentage: must be between 1 and 100",
        "spec.devices.config[0].opaque.parameters: sharing.mps.defaultPinnedDeviceMemoryLimit: invalid quantity",
    ] {
        assert!(message.contains(want), "{want:?} missing from {message}");
    }
}

/// Issue 23 item 3: a config still naming NVIDIA's driver on a tessera claim was ignored without a word.
#[test]
fn a_config_for_nvidias_driver_on_a_request_tessera_serves_is_allowed_with_a_warning_naming_the_fix() {
    let nvidia = json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                        "sharing": {"strategy": "MPS"}});
    let review = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config_for(&[], "gpu.nvidia.com", nvidia.clone())
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(response.allowed, "{response:?}");
    let warnings = response.warnings.unwrap_or_default();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].starts_with(
            "spec.devices.config[0].opaque.driver: \"gpu.nvidia.com\" is not tessera's driver, yet request(s) \
             [\"gpu\"] get tessera's devices"
        ),
        "{}",
        warnings[0]
    );
    assert!(
        warnings[0].contains("kind GpuConfig or MigConfig"),
        "{}",
        warnings[0]
    );

    let elsewhere = claim()
        .request("gpu", "nvidia.example.com")
        .config_for(&["gpu"], "gpu.nvidia.com", nvidia)
        .claim_review();
    let response = decide(&elsewhere, &shipped_classes());
    assert!(
        response.allowed && response.warnings.is_none(),
        "a request tessera does not serve keeps its driver's config quietly: {response:?}"
    );
}

/// Issue 39 item 1: a burstable share's ceiling is at least its request and only where MPS clients are.
#[test]
fn a_ceiling_below_the_shares_compute_request_is_refused_naming_both() {
    let review = claim()
        .request_with(
            "gpu",
            "shared.gpu.tessera.dev",
            json!({"memory": "10Gi", "compute": "30"}),
        )
        .config(mps(json!({"computeCeiling": 20})))
        .claim_review();
    let response = decide(&review, &shipped_classes());
    assert!(!response.allowed);
    assert!(
        response.result.message.starts_with(
            "spec.devices.config[0].opaque.parameters: request \"gpu\" (DeviceClass \"shared.gpu.tessera.dev\"): \
             sharing.mps.computeCeiling: 20 is below the share's compute request of 30"
        ),
        "{}",
        response.result.message
    );
    let burstable = claim()
        .request_with(
            "gpu",
            "shared.gpu.tessera.dev",
            json!({"memory": "10Gi", "compute": "30"}),
        )
        .config(mps(json!({"computeCeiling": 100})))
        .claim_review();
    let response = decide(&burstable, &shipped_classes());
    assert!(response.allowed, "{}", response.result.message);
    assert_eq!(response.warnings, None);
}

#[test]
fn a_ceiling_on_a_class_of_whole_gpus_or_mig_devices_or_above_the_gpu_is_refused() {
    let whole = claim()
        .request("gpu", "gpu.tessera.dev")
        .config_for(&["gpu"], DRIVER_NAME, mps(json!({"computeCeiling": 80})))
        .claim_review();
    let response = decide(&whole, &shipped_classes());
    assert!(!response.allowed);
    assert!(
        response
            .result
            .message
            .contains("sharing.mps.computeCeiling: means nothing on whole GPU gpu-0"),
        "{}",
        response.result.message
    );
    let mig = claim()
        .request("mig", "mig.gpu.tessera.dev")
        .config_for(
            &["mig"],
            DRIVER_NAME,
            json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigConfig",
                   "sharing": {"strategy": "MPS", "mps": {"computeCeiling": 80}}}),
        )
        .claim_review();
    let response = decide(&mig, &shipped_classes());
    assert!(
        response
            .result
            .message
            .contains("sharing.mps.computeCeiling: means nothing on MIG device gpu-0-mig-3g-40gb-4"),
        "{}",
        response.result.message
    );
    let above = claim()
        .request("gpu", "shared.gpu.tessera.dev")
        .config(mps(json!({"computeCeiling": 150})))
        .claim_review();
    let response = decide(&above, &shipped_classes());
    assert_eq!(
        response.result.message,
        "spec.devices.config[0].opaque.parameters: sharing.mps.computeCeiling: must be between 1 and 100, got 150"
    );
    let time_sliced = claim()
        .request("gpu", "timesliced.example.com")
        .config(
            json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
                       "sharing": {"strategy": "TimeSlicing", "mps": {"computeCeiling": 80}}}),
        )
        .claim_review();
    let response = decide(&time_sliced, &shipped_classes());
    assert!(
        response
            .result
            .message
            .contains("sharing.mps: only allowed with strategy MPS, got TimeSlicing"),
        "{}",
        response.result.message
    );
}
