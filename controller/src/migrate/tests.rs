use super::*;

fn run(text: &str) -> Migration {
    migrate(text, "test.yaml", Options::default()).unwrap()
}

fn has(m: &Migration, outcome: Outcome, needle: &str) -> bool {
    m.notes
        .iter()
        .any(|n| n.outcome == outcome && n.to_string().contains(needle))
}

#[test]
fn a_v1beta1_whole_gpu_request_moves_under_exactly_on_tesseras_class() {
    let m = run("apiVersion: resource.k8s.io/v1beta1
kind: ResourceClaimTemplate
metadata: {name: one, namespace: ns}
spec:
  spec:
    devices:
      requests:
      - name: gpu
        deviceClassName: gpu.nvidia.com
        count: 2
");
    assert_eq!(
        m.yaml,
        "apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: one
  namespace: ns
spec:
  spec:
    devices:
      requests:
      - name: gpu
        exactly:
          deviceClassName: gpu.tessera.dev
          count: 2
"
    );
    assert!(
        has(
            &m,
            Outcome::Changed,
            "ResourceClaimTemplate ns/one (document 1) spec.spec.devices.requests[0].exactly.deviceClassName: gpu.nvidia.com → gpu.tessera.dev"
        ),
        "{}",
        m.report()
    );
}

#[test]
fn a_request_with_capacity_becomes_a_share_not_a_whole_gpu() {
    let m = run("apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: c}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.nvidia.com
        capacity: {requests: {memory: 2Gi}}
");
    assert!(
        m.yaml.contains("deviceClassName: shared.gpu.tessera.dev"),
        "{}",
        m.yaml
    );
    assert!(has(
        &m,
        Outcome::NothingNeeded,
        "memory alone consumes no compute"
    ));
}

#[test]
fn a_share_count_has_no_tessera_capacity_and_is_removed_with_a_note() {
    let m = run("apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: c}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.nvidia.com
        capacity: {requests: {shares: 1}}
");
    assert!(!m.yaml.contains("capacity"), "{}", m.yaml);
    assert!(has(&m, Outcome::NotTranslated, "shares removed"));
}

#[test]
fn match_attribute_on_parent_uuid_becomes_uuid() {
    let m = run("apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: c}
spec:
  devices:
    requests:
    - {name: a, exactly: {deviceClassName: mig.nvidia.com}}
    - {name: b, exactly: {deviceClassName: mig.nvidia.com}}
    constraints:
    - {requests: [a, b], matchAttribute: gpu.nvidia.com/parentUUID}
");
    assert!(
        m.yaml.contains("matchAttribute: gpu.tessera.dev/uuid"),
        "{}",
        m.yaml
    );
    assert!(m.yaml.contains("deviceClassName: mig.gpu.tessera.dev"));
}

#[test]
fn nvidias_own_device_classes_are_removed_and_the_users_are_translated() {
    let m = run("apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.nvidia.com}
spec:
  selectors:
  - cel: {expression: \"device.driver == 'gpu.nvidia.com'\"}
  extendedResourceName: nvidia.com/gpu
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: mig-1g.5gb}
spec:
  selectors:
  - cel: {expression: \"device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig' && device.attributes['gpu.nvidia.com'].profile == '1g.5gb'\"}
  extendedResourceName: nvidia.com/mig-1g.5gb
");
    assert!(!m.yaml.contains("name: gpu.nvidia.com"), "{}", m.yaml);
    assert!(m.yaml.contains("profile == '1g.10gb'"), "{}", m.yaml);
    assert!(
        m.yaml.contains("extendedResourceName: nvidia.com/mig-1g.10gb"),
        "{}",
        m.yaml
    );
    assert!(has(&m, Outcome::Changed, "NVIDIA's own class removed"));
}

#[test]
fn a_device_plugin_pod_needs_nothing_and_the_report_says_why() {
    let m = run("apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  containers:
  - name: c
    image: x
    resources: {limits: {nvidia.com/gpu: 1}, requests: {nvidia.com/gpu: 1}}
");
    assert!(m.yaml.contains("nvidia.com/gpu: 1"));
    let notes: Vec<_> = m
        .notes
        .iter()
        .filter(|n| n.outcome == Outcome::NothingNeeded)
        .collect();
    assert_eq!(notes.len(), 1, "one note for limits and requests: {}", m.report());
    assert!(notes[0].message.contains("extendedResourceName nvidia.com/gpu"));
}

#[test]
fn a_mig_resource_of_another_model_is_renamed_in_limits_and_requests() {
    let m = run("apiVersion: batch/v1
kind: Job
metadata: {name: j}
spec:
  template:
    spec:
      containers:
      - name: c
        resources: {limits: {nvidia.com/mig-1g.5gb: 1}, requests: {nvidia.com/mig-1g.5gb: 1}}
");
    assert_eq!(
        m.yaml.matches("nvidia.com/mig-1g.10gb: 1").count(),
        2,
        "{}",
        m.yaml
    );
    assert!(has(&m, Outcome::Changed, "mig-profiles"));
}

#[test]
fn other_kinds_pass_through_and_unreadable_yaml_is_an_error() {
    let m = run("apiVersion: v1\nkind: Namespace\nmetadata: {name: gpu-test1}\n");
    assert_eq!(
        m.yaml,
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: gpu-test1\n"
    );
    assert!(m.notes.is_empty());
    let e = migrate("a: [1\n", "bad.yaml", Options::default()).unwrap_err();
    assert!(
        e.to_string().starts_with("bad.yaml: document 1 is not YAML"),
        "{e}"
    );
}

#[test]
fn a_config_entry_left_with_nothing_to_configure_is_removed_with_its_list() {
    let m = run("apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: c}
spec:
  devices:
    requests:
    - {name: mig, exactly: {deviceClassName: mig.nvidia.com}}
    config:
    - requests: [mig]
      opaque:
        driver: gpu.nvidia.com
        parameters: {apiVersion: resource.nvidia.com/v1beta1, kind: MigDeviceConfig, sharing: {strategy: TimeSlicing}}
");
    assert!(!m.yaml.contains("config"), "{}", m.yaml);
    assert!(has(&m, Outcome::Changed, "entry removed"));
}

#[test]
fn first_available_alternatives_are_each_translated() {
    let m = run("apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: c}
spec:
  devices:
    requests:
    - name: gpu
      firstAvailable:
      - name: big
        deviceClassName: mig.nvidia.com
        selectors:
        - cel: {expression: \"device.attributes['gpu.nvidia.com'].profile == '3g.20gb'\"}
      - {name: whole, deviceClassName: gpu.nvidia.com}
");
    assert!(
        m.yaml.contains("deviceClassName: mig.gpu.tessera.dev"),
        "{}",
        m.yaml
    );
    assert!(m.yaml.contains("profile == '3g.40gb'"), "{}", m.yaml);
    assert!(m.yaml.contains("deviceClassName: gpu.tessera.dev"), "{}", m.yaml);
    assert!(
        m.notes.iter().all(|n| n.field.contains("firstAvailable[")),
        "{}",
        m.report()
    );
}

#[test]
fn a_list_and_a_deployments_init_containers_are_walked() {
    let m = run("apiVersion: v1
kind: List
items:
- apiVersion: apps/v1
  kind: Deployment
  metadata: {name: d, namespace: ns}
  spec:
    template:
      spec:
        initContainers:
        - {name: warm, resources: {limits: {nvidia.com/gpu.shared: 1}}}
        containers:
        - {name: main, resources: {limits: {nvidia.com/gpu: 1}}}
");
    assert!(
        has(
            &m,
            Outcome::NotTranslated,
            "Deployment ns/d (document 1) spec.template.spec.initContainers[0].resources.limits: nvidia.com/gpu.shared"
        ),
        "{}",
        m.report()
    );
    assert!(
        has(&m, Outcome::NothingNeeded, "spec.template.spec.containers[0]"),
        "{}",
        m.report()
    );
}

#[test]
fn the_mig_model_option_picks_the_target_profiles() {
    let text = "apiVersion: v1
kind: Pod
metadata: {name: p}
spec:
  containers:
  - {name: c, resources: {limits: {nvidia.com/mig-3g.40gb: 1}}}
";
    let h100 = run(text);
    assert!(
        h100.yaml.contains("nvidia.com/mig-3g.40gb: 1"),
        "the H100's own name: {}",
        h100.yaml
    );
    let h200 = migrate(
        text,
        "t",
        Options {
            target: mig::MigModel::H200,
        },
    )
    .unwrap();
    assert!(h200.yaml.contains("nvidia.com/mig-3g.71gb: 1"), "{}", h200.yaml);
}
