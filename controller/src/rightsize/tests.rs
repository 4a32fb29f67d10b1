//! The template side of rightsize: which request, and what the patch and the resized template hold.

use serde_json::{Value, json};

use super::{error::RightsizeError, patch, rule::Recommendation};

fn rec() -> Recommendation {
    Recommendation {
        samples: 100,
        p90_use: 0.36,
        max_memory_bytes: 10_000.0 * 1024.0 * 1024.0,
        compute_percent: 45,
        ceiling_percent: 100,
        memory_gib: 12,
    }
}

/// A template builder: requests (name, class) and config entries.
struct Template {
    requests: Vec<Value>,
    config: Option<Vec<Value>>,
}

impl Template {
    fn share() -> Self {
        Self {
            requests: vec![
                json!({"name": "gpu", "exactly": {"deviceClassName": "shared.gpu.tessera.dev",
                "capacity": {"requests": {"memory": "40Gi", "compute": "50"}}}}),
            ],
            config: None,
        }
    }
    fn request(mut self, name: &str, class: &str) -> Self {
        self.requests
            .push(json!({"name": name, "exactly": {"deviceClassName": class}}));
        self
    }
    fn config(mut self, requests: Option<&[&str]>, parameters: Value) -> Self {
        let mut entry = json!({"opaque": {"driver": "gpu.tessera.dev", "parameters": parameters}});
        if let Some(r) = requests {
            entry["requests"] = json!(r);
        }
        self.config.get_or_insert_with(Vec::new).push(entry);
        self
    }
    fn build(self) -> Value {
        let mut t = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "half-a-gpu", "namespace": "serving", "uid": "u-1", "resourceVersion": "7",
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "team": "search"}},
            "spec": {"spec": {"devices": {"requests": self.requests}}}});
        if let Some(c) = self.config {
            t["spec"]["spec"]["devices"]["config"] = json!(c);
        }
        t
    }
}

fn mps(extra: Value) -> Value {
    json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "MPS", "mps": extra}})
}

fn resized(t: &Value, devices: &[&str]) -> (patch::Changes, Value) {
    let share = patch::share_request(t, None).unwrap();
    let devices: Vec<String> = devices.iter().map(|d| d.to_string()).collect();
    let changes = patch::changes(t, &share, &rec(), &devices).unwrap();
    let new = patch::resized_template(t, &changes, &rec()).unwrap();
    (changes, new)
}

#[test]
fn a_share_without_config_gets_its_request_sized_and_a_gpu_config_with_the_full_ceiling() {
    let t = Template::share().build();
    let (changes, new) = resized(&t, &["gpu-0-shared"]);
    let r = &new["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"];
    assert_eq!(r, &json!({"compute": "45", "memory": "12Gi"}));
    assert_eq!(
        new["spec"]["spec"]["devices"]["config"],
        json!([{"requests": ["gpu"], "opaque": {"driver": "gpu.tessera.dev", "parameters":
            {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
             "sharing": {"strategy": "MPS", "mps": {"computeCeiling": 100}}}}}])
    );
    assert_eq!(
        changes.patch[0],
        json!({"op": "test", "path": "/spec/spec/devices/requests/0/name", "value": "gpu"})
    );
    assert!(changes.notes[0].contains("added a config entry"));
}

#[test]
fn the_resized_template_has_a_new_name_and_only_the_metadata_a_user_wrote() {
    let (_, new) = resized(&Template::share().build(), &["gpu-0-shared"]);
    assert_eq!(
        new["metadata"],
        json!({"name": "half-a-gpu-c45-m12gi", "namespace": "serving", "annotations": {"team": "search"}})
    );
    // Run again on the resized template: the same name, not a suffix on a suffix.
    assert_eq!(
        patch::resized_name("half-a-gpu-c45-m12gi", &rec()),
        "half-a-gpu-c45-m12gi"
    );
    assert_eq!(patch::resized_name("a-c-m", &rec()), "a-c-m-c45-m12gi");
}

#[test]
fn a_share_of_a_mig_device_gets_a_mig_config() {
    let (_, new) = resized(&Template::share().build(), &["gpu-0-mig-3g-40gb-4-shared"]);
    assert_eq!(
        new["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["kind"],
        "MigConfig"
    );
}

#[test]
fn an_mps_config_aimed_at_the_request_keeps_its_settings_and_gains_the_ceiling() {
    let t = Template::share()
        .config(
            Some(&["gpu"]),
            mps(json!({"defaultPinnedDeviceMemoryLimit": "10Gi", "computeCeiling": 60})),
        )
        .build();
    let (_, new) = resized(&t, &["gpu-0-shared"]);
    assert_eq!(
        new["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"]["mps"],
        json!({"defaultPinnedDeviceMemoryLimit": "10Gi", "computeCeiling": 100})
    );
    assert_eq!(
        new["spec"]["spec"]["devices"]["config"].as_array().unwrap().len(),
        1
    );
}

#[test]
fn an_untargeted_config_shared_with_a_whole_gpu_request_is_copied_for_the_share_not_changed() {
    let t = Template::share()
        .request("trainer", "gpu.tessera.dev")
        .config(None, mps(json!({"defaultPinnedDeviceMemoryLimit": "10Gi"})))
        .build();
    let (changes, new) = resized(&t, &["gpu-0-shared"]);
    let config = new["spec"]["spec"]["devices"]["config"].as_array().unwrap();
    assert_eq!(config[0], t["spec"]["spec"]["devices"]["config"][0]);
    assert_eq!(config[1]["requests"], json!(["gpu"]));
    assert_eq!(
        config[1]["opaque"]["parameters"]["sharing"]["mps"],
        json!({"defaultPinnedDeviceMemoryLimit": "10Gi", "computeCeiling": 100})
    );
    assert!(changes.notes[0].contains("copy of config entry 0"));
}

#[test]
fn a_time_sliced_share_is_sized_without_a_ceiling_and_told_why() {
    let t = Template::share()
        .config(
            Some(&["gpu"]),
            json!({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing"}}),
        )
        .build();
    let (changes, new) = resized(&t, &["gpu-0-shared"]);
    assert_eq!(
        new["spec"]["spec"]["devices"]["config"],
        t["spec"]["spec"]["devices"]["config"]
    );
    assert!(changes.notes[0].starts_with("no ceiling set: config entry 0 time-slices"));
}

#[test]
fn a_daemon_default_below_the_ceiling_is_refused_naming_the_field() {
    let t = Template::share()
        .config(Some(&["gpu"]), mps(json!({"defaultActiveThreadPercentage": 50})))
        .build();
    let share = patch::share_request(&t, None).unwrap();
    let err = patch::changes(&t, &share, &rec(), &["gpu-0-shared".into()]).unwrap_err();
    assert!(
        err.to_string()
            .contains("sets sharing.mps.defaultActiveThreadPercentage 50, which caps"),
        "{err}"
    );
}

#[test]
fn a_whole_gpu_or_mig_template_is_refused_as_not_a_share() {
    for (class, what) in [
        ("gpu.tessera.dev", "a whole GPU"),
        ("mig.gpu.tessera.dev", "a whole MIG device"),
    ] {
        let t = Template {
            requests: vec![],
            config: None,
        }
        .request("gpu", class)
        .build();
        let err = patch::share_request(&t, None).unwrap_err();
        assert!(matches!(err, RightsizeError::NotAShare { .. }));
        assert_eq!(
            err.to_string(),
            format!(
                "request \"gpu\" is not a tessera share: it asks for {what}, which has no compute or memory to \
                 size; rightsize sizes shares (deviceClassName: shared.gpu.tessera.dev)"
            )
        );
        assert!(err.is_no_recommendation());
    }
}

#[test]
fn several_shares_need_request_and_a_named_request_must_exist() {
    let t = Template::share()
        .request("draft", "shared.gpu.tessera.dev")
        .build();
    assert_eq!(
        patch::share_request(&t, None).unwrap_err().to_string(),
        "the ResourceClaimTemplate: several share requests (gpu, draft); name one with --request"
    );
    assert_eq!(patch::share_request(&t, Some("draft")).unwrap().index, 1);
    assert!(
        patch::share_request(&t, Some("nope"))
            .unwrap_err()
            .to_string()
            .contains("no request named \"nope\"")
    );
}

#[test]
fn a_request_without_capacity_gets_one() {
    let t = Template {
        requests: vec![],
        config: None,
    }
    .request("gpu", "shared.gpu.tessera.dev")
    .build();
    let (_, new) = resized(&t, &["gpu-0-shared"]);
    assert_eq!(
        new["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"],
        json!({"requests": {"compute": "45", "memory": "12Gi"}})
    );
}
