//! Attribute and capacity names published on every device.
//!
//! The unqualified names live in the driver's domain (`gpu.tessera.dev`), so a DeviceClass selector reads
//! `device.attributes["gpu.tessera.dev"].productName`. They match the names NVIDIA's driver publishes,
//! so selectors users already wrote keep working.

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
/// `string`: sharing strategy of a shared device: `MPS` or `TimeSlicing`.
pub const SHARING_STRATEGY: &str = "sharingStrategy";
/// `int`: seconds the device's partition (a MIG device, an MPS daemon) stays warm after its last claim
/// goes, for the next claim of the same device to take without making it again (the policy rule's
/// `warm.window`); absent when the rule keeps nothing warm. MIG and shared devices only.
pub const WARM_SECONDS: &str = "warmSeconds";
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
