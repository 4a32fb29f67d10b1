//! The DRA CEL environment, against the examples of the Kubernetes documentation and an H100's device.

use tessera_api::DRIVER_NAME;
use tessera_controller::{
    cel::{CelEnv, DeviceView, SelectorError},
    devices::selector_view,
    fixtures::{GpuModel, node},
};

fn h100() -> DeviceView {
    let inv = node("n").gpus(GpuModel::H100Sxm5_80gb, 1).build();
    DeviceView::from_device(DRIVER_NAME, &selector_view(&inv.spec, &inv.spec.gpus[0]))
}

fn eval(src: &str) -> Result<bool, SelectorError> {
    let cel = CelEnv::new();
    let sel = cel.compile(src)?;
    cel.matches(&sel, &h100())
}

#[test]
fn the_kubernetes_documentation_examples_hold_on_an_h100() {
    for src in [
        r#"device.capacity["gpu.tessera.dev"].memory.compareTo(quantity("40Gi")) >= 0"#,
        r#"device.attributes["gpu.tessera.dev"].driverVersion.isGreaterThan(semver("550.0.0"))"#,
        r#"device.driver == "gpu.tessera.dev""#,
        r#"device.attributes["gpu.tessera.dev"].productName == "NVIDIA H100 80GB HBM3""#,
        r#"device.attributes["gpu.tessera.dev"].cudaComputeCapability.compareTo(semver("9.0.0")) >= 0"#,
        r#"device.attributes["gpu.tessera.dev"].driverVersion.major() == 580"#,
        r#"device.attributes["gpu.tessera.dev"].driverVersion.minor() == 159 && device.attributes["gpu.tessera.dev"].driverVersion.patch() == 3"#,
        r#"device.capacity["gpu.tessera.dev"].multiprocessors.asInteger() == 132"#,
        r#"device.capacity["gpu.tessera.dev"].memory.isInteger()"#,
        r#"device.capacity["gpu.tessera.dev"].memory.isGreaterThan(quantity("79Gi"))"#,
        r#"device.capacity["gpu.tessera.dev"].memory.isLessThan(quantity("80Gi"))"#,
        r#"device.capacity["gpu.tessera.dev"].memory.sub(quantity("79Gi")).isLessThan(quantity("1Gi"))"#,
        r#"quantity("1Gi").add(quantity("1Gi")).compareTo(quantity("2048Mi")) == 0"#,
        r#"quantity("1").add(1).asInteger() == 2"#,
        r#"semver("1.2.3").isLessThan(semver("1.10.0"))"#,
        r#"isQuantity("10Gi") && !isQuantity("10GB") && isSemver("1.0.0") && !isSemver("1.0")"#,
        r#"device.attributes["gpu.tessera.dev"].productName.startsWith("NVIDIA H100")"#,
        r#"device.attributes["resource.kubernetes.io"].pciBusID.startsWith("0000:")"#,
        r#"has(device.attributes["gpu.tessera.dev"].numaNode) && !has(device.attributes["gpu.tessera.dev"].profile)"#,
        r#"!("profile" in device.attributes["gpu.tessera.dev"])"#,
        r#"device.attributes["gpu.tessera.dev"].?profile.orValue("none") == "none""#,
        r#"device.attributes["gpu.tessera.dev"].architecture.lowerAscii() == "hopper""#,
        r#"device.allowMultipleAllocations == false"#,
    ] {
        assert_eq!(eval(src), Ok(true), "{src}");
    }
}

#[test]
fn an_unknown_domain_is_an_empty_map_and_an_unknown_attribute_an_error() {
    assert_eq!(
        eval(r#"size(device.attributes["other.example.com"]) == 0"#),
        Ok(true)
    );
    assert_eq!(eval(r#""x" in device.capacity["other.example.com"]"#), Ok(false));
    let err = eval(r#"device.attributes["gpu.tessera.dev"].nonexistent == "x""#).unwrap_err();
    assert!(matches!(err, SelectorError::Runtime { .. }), "{err:?}");
    assert!(err.to_string().contains("nonexistent"), "{err}");
}

#[test]
fn a_non_bool_result_or_a_wrong_type_is_a_type_error() {
    let e = eval(r#"device.attributes["gpu.tessera.dev"].index"#).unwrap_err();
    assert!(matches!(e, SelectorError::Type { .. }), "{e:?}");
    let e = eval(r#"device.capacity["gpu.tessera.dev"].memory.major() == 1"#).unwrap_err();
    assert!(matches!(e, SelectorError::Type { .. }), "{e:?}");
    let e = eval(r#"dev.attributes["gpu.tessera.dev"].index == 0"#).unwrap_err();
    assert!(matches!(e, SelectorError::Type { .. }), "{e:?}");
}

#[test]
fn a_syntax_error_is_reported_at_compile_time() {
    let e = CelEnv::new()
        .compile(r#"device.attributes["gpu.tessera.dev"].productName == "#)
        .unwrap_err();
    assert!(matches!(e, SelectorError::Syntax { .. }), "{e:?}");
}

#[test]
fn malformed_quantity_and_semver_literals_fail_at_run_time() {
    assert!(matches!(
        eval(r#"quantity("10GB").isInteger()"#),
        Err(SelectorError::Runtime { .. })
    ));
    assert!(matches!(
        eval(r#"semver("v1").major() == 1"#),
        Err(SelectorError::Runtime { .. })
    ));
}
