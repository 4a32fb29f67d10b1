//! Attribute and capacity names published on every device.
//!
//! The unqualified names live in the driver's domain (`gpu.tessera.dev`), so a DeviceClass selector reads
//! `device.attributes["gpu.tessera.dev"].productName`. They match the names NVIDIA's driver publishes,
//! so selectors users already wrote keep working.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::DeviceAttribute;

use crate::inventory::GpuInfo;

/// `string`: `gpu`, `mig` or `shared`.
pub const TYPE: &str = "type";
/// `string`: GPU UUID (`GPU-…`); for MIG devices the parent's UUID.
pub const UUID: &str = "uuid";
/// `string`: e.g. `NVIDIA H100 80GB HBM3`.
pub const PRODUCT_NAME: &str = "productName";
/// `string`: e.g. `Nvidia`.
pub const BRAND: &str = "brand";
/// `string`: e.g. `Hopper`.
pub const ARCHITECTURE: &str = "architecture";
/// `version`: e.g. `9.0.0`.
pub const CUDA_COMPUTE_CAPABILITY: &str = "cudaComputeCapability";
/// `version`: e.g. `580.159.0`.
pub const DRIVER_VERSION: &str = "driverVersion";
/// `version`: e.g. `13.0.0`.
pub const CUDA_DRIVER_VERSION: &str = "cudaDriverVersion";
/// `int`: index of the GPU on its node (NVML index).
pub const INDEX: &str = "index";
/// `int`: minor number of `/dev/nvidiaN`.
pub const MINOR: &str = "minor";
/// `int`: NUMA node of the GPU, when the platform reports one. Deprecated for new selectors: the same
/// value is published as [`STANDARD_NUMA_NODE`], which other drivers' devices (NICs) carry too, so
/// `matchAttribute` can align a GPU with them. Kept for the selectors already written against it.
pub const NUMA_NODE: &str = "numaNode";
/// `string`: MIG profile name, e.g. `3g.40gb` (MIG devices only).
pub const MIG_PROFILE: &str = "profile";
/// `int`: first memory slice of the MIG placement (MIG devices only).
pub const MIG_PLACEMENT_START: &str = "placementStart";
/// `string`: the UUID of the GPU a MIG device is part of (MIG devices only): the same value as its
/// [`UUID`], under the name NVIDIA's DRA driver publishes it by, so CEL and `matchAttribute` written for
/// that driver (and tools that read its attributes) find it here too.
pub const PARENT_UUID: &str = "parentUUID";
/// `string`: sharing strategy of a shared device: `MPS` or `TimeSlicing`.
pub const SHARING_STRATEGY: &str = "sharingStrategy";
/// `int`: seconds the device's partition (a MIG device, an MPS daemon) stays warm after its last claim
/// goes, for the next claim of the same device to take without making it again (the policy rule's
/// `warm.window`); absent when the rule keeps nothing warm. MIG and shared devices only.
pub const WARM_SECONDS: &str = "warmSeconds";
/// `string`: which claims share an MPS device's control daemon (the policy rule's `shared.tenancy`):
/// `Shared` for one daemon across namespaces; absent means `Namespace`, a daemon per namespace. Shared
/// MPS devices only.
pub const MPS_TENANCY: &str = "mpsTenancy";
/// Standard attribute: PCI bus id, `0000:3b:00.0`.
pub const PCI_BUS_ID: &str = "resource.kubernetes.io/pciBusID";
/// Standard attribute: PCIe root complex, `pci0000:3a`.
pub const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
/// Standard attribute (KEP-6072, Kubernetes 1.37): NUMA node, as [`NUMA_NODE`].
pub const STANDARD_NUMA_NODE: &str = "resource.kubernetes.io/numaNode";

/// Capacity: bytes of GPU memory.
pub const MEMORY: &str = "memory";
/// Capacity: streaming multiprocessors.
pub const MULTIPROCESSORS: &str = "multiprocessors";
/// Capacity: percent of the GPU's compute a share may use (shared devices only).
pub const COMPUTE: &str = "compute";
/// Capacity: copy engines (MIG).
pub const COPY_ENGINES: &str = "copyEngines";
/// Capacity: video decoders (MIG).
pub const DECODERS: &str = "decoders";
/// Capacity: video encoders (MIG).
pub const ENCODERS: &str = "encoders";
/// Capacity: JPEG engines (MIG).
pub const JPEG_ENGINES: &str = "jpegEngines";
/// Capacity: optical-flow accelerators (MIG).
pub const OFA_ENGINES: &str = "ofaEngines";

/// Value of [`TYPE`] on a whole GPU.
pub const TYPE_GPU: &str = "gpu";
/// Value of [`TYPE`] on a MIG device.
pub const TYPE_MIG: &str = "mig";
/// Value of [`TYPE`] on a device offered to several claims at once.
pub const TYPE_SHARED: &str = "shared";

/// `string`: the `MIG-…` UUID of a MIG device, once made. Only in a claim's device metadata (the file the
/// kubelet plugin mounts into the claim's containers, KEP-5304): a published MIG device does not exist yet,
/// so its slice carries the parent's [`UUID`] alone.
pub const MIG_UUID: &str = "migUUID";

/// A `string` attribute.
pub fn string(s: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.into()),
        ..Default::default()
    }
}

/// An `int` attribute.
pub fn int(i: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(i),
        ..Default::default()
    }
}

/// The driver's versions on the node, as its inventory reports them (`580.159.03`, `13.0`).
#[derive(Clone, Copy, Debug, Default)]
pub struct DriverVersions<'a> {
    pub driver: Option<&'a str>,
    pub cuda_driver: Option<&'a str>,
}

/// The attributes every device of `gpu` carries, `kind` being [`TYPE_GPU`], [`TYPE_MIG`] or [`TYPE_SHARED`].
/// `version` turns a reported version into a semantic version (`9.0` → `9.0.0`), or leaves the attribute
/// out when it cannot. The controller publishes these in ResourceSlices and the plugin writes the same in a
/// claim's device metadata, so a workload reads what its class's selectors saw.
pub fn of_gpu(
    gpu: &GpuInfo,
    versions: DriverVersions<'_>,
    kind: &str,
    version: impl Fn(&str) -> Option<String>,
) -> BTreeMap<String, DeviceAttribute> {
    let version = |raw: &str| {
        version(raw).map(|v| DeviceAttribute {
            version: Some(v),
            ..Default::default()
        })
    };
    let mut a = BTreeMap::new();
    a.insert(TYPE.into(), string(kind));
    a.insert(UUID.into(), string(&gpu.uuid));
    a.insert(PRODUCT_NAME.into(), string(&gpu.product_name));
    a.insert(BRAND.into(), string(&gpu.brand));
    a.insert(ARCHITECTURE.into(), string(&gpu.architecture));
    a.insert(INDEX.into(), int(gpu.index.into()));
    a.insert(MINOR.into(), int(gpu.minor.into()));
    a.insert(PCI_BUS_ID.into(), string(&gpu.pci_bus_id));
    if let Some(v) = version(&gpu.cuda_compute_capability) {
        a.insert(CUDA_COMPUTE_CAPABILITY.into(), v);
    }
    if let Some(v) = versions.driver.and_then(version) {
        a.insert(DRIVER_VERSION.into(), v);
    }
    if let Some(v) = versions.cuda_driver.and_then(version) {
        a.insert(CUDA_DRIVER_VERSION.into(), v);
    }
    if let Some(n) = gpu.numa_node {
        a.insert(NUMA_NODE.into(), int(n));
        a.insert(STANDARD_NUMA_NODE.into(), int(n));
    }
    if let Some(root) = &gpu.pcie_root {
        a.insert(PCIE_ROOT.into(), string(root));
    }
    a
}

/// A MIG device's own attributes, added to its GPU's ([`of_gpu`]).
pub fn add_mig(a: &mut BTreeMap<String, DeviceAttribute>, profile: &str, placement_start: u32) {
    a.insert(MIG_PROFILE.into(), string(profile));
    a.insert(MIG_PLACEMENT_START.into(), int(placement_start.into()));
    if let Some(parent) = a.get(UUID).cloned() {
        a.insert(PARENT_UUID.into(), parent);
    }
}

/// A version of dot-separated decimal numbers (`580.159.03`, `v9.0`) as a semantic version (`580.159.3`,
/// `9.0.0`); `None` for anything else (more than three numbers, pre-releases, letters).
pub fn numeric_version(raw: &str) -> Option<String> {
    let raw = raw.strip_prefix('v').unwrap_or(raw);
    let parts = raw
        .split('.')
        .map(|p| {
            (!p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
                .then(|| p.parse::<u64>().ok())
                .flatten()
        })
        .collect::<Option<Vec<_>>>()?;
    if parts.is_empty() || parts.len() > 3 {
        return None;
    }
    let at = |i: usize| parts.get(i).copied().unwrap_or(0);
    Some(format!("{}.{}.{}", at(0), at(1), at(2)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mig_device_carries_its_gpus_uuid_as_uuid_and_as_parent_uuid() {
        let mut a = BTreeMap::new();
        a.insert(UUID.to_string(), string("GPU-1"));
        add_mig(&mut a, "3g.40gb", 4);
        assert_eq!(a.get(PARENT_UUID), Some(&string("GPU-1")));
        assert_eq!(a.get(UUID), Some(&string("GPU-1")));
        assert_eq!(a.get(MIG_PLACEMENT_START), Some(&int(4)));
    }

    #[test]
    fn numeric_versions_are_padded_and_lose_their_leading_zeros() {
        assert_eq!(numeric_version("580.159.03").as_deref(), Some("580.159.3"));
        assert_eq!(numeric_version("9.0").as_deref(), Some("9.0.0"));
        assert_eq!(numeric_version("v13").as_deref(), Some("13.0.0"));
    }

    #[test]
    fn anything_but_up_to_three_numbers_is_no_version() {
        for raw in [
            "",
            "1.2.3.4",
            "1.x",
            "1..2",
            "1.2-rc1",
            "+1",
            "99999999999999999999",
        ] {
            assert_eq!(numeric_version(raw), None, "{raw:?}");
        }
    }
}
