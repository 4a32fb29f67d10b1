//! The node inventory: everything a node's plugin discovered about its GPUs.
//!
//! One cluster-scoped `NodeInventory` per node, named after the node and owned by it (so it goes when the
//! Node goes). The plugin writes it; the controller turns it into ResourceSlices under the cluster policy.
//! It carries each MIG-capable GPU's GPU-instance profiles with their placements, so the controller needs
//! no hardware tables of its own.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What one node's plugin discovered.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpu.tessera.dev",
    version = "v1alpha1",
    kind = "NodeInventory",
    plural = "nodeinventories",
    shortname = "gpuinv",
    status = "NodeInventoryStatus",
    printcolumn = r#"{"name":"GPUs","type":"integer","jsonPath":".status.gpuCount"}"#,
    printcolumn = r#"{"name":"Ready","type":"boolean","jsonPath":".status.ready"}"#,
    printcolumn = r#"{"name":"Status-Written","type":"date","jsonPath":".status.lastHeartbeatTime"}"#,
    printcolumn = r#"{"name":"Coexistence","type":"string","jsonPath":".status.conditions[?(@.type==\"Coexistence\")].reason"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct NodeInventorySpec {
    /// The node these GPUs are on (same as the object's name).
    pub node_name: String,
    /// `simulated` or `nvml`.
    pub backend: String,
    /// NVIDIA kernel driver version, e.g. `580.159.03`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    /// Highest CUDA version the driver supports, e.g. `13.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda_driver_version: Option<String>,
    /// The node's GPUs, by index.
    #[serde(default)]
    pub gpus: Vec<GpuInfo>,
}

/// Whether the plugin is serving, and when it last said so.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeInventoryStatus {
    /// True once kubelet has registered the plugin and it can prepare claims. A plugin that is stopped
    /// (SIGTERM, an upgrade) leaves it as it was: the controller keeps the node's slices through a restart
    /// and withdraws them only when the heartbeat stops changing, or after `ready` has been false for
    /// longer than its `--not-ready-grace`.
    #[serde(default)]
    pub ready: bool,
    /// When the plugin wrote this status. Plugins heartbeat through their node's Lease
    /// (`tessera-node-<node>`) and write the status when it changes, or every heartbeat while the leading
    /// controller does not read node Leases. The controller counts a change of it as a heartbeat, judged
    /// by when it saw the value change on its own clock, so the plugin's clock and API server outages do
    /// not make a node look stale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heartbeat_time: Option<Time>,
    /// Number of GPUs in `spec.gpus` (for `kubectl get`).
    #[serde(default)]
    pub gpu_count: u32,
    /// Human-readable reason when not ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Health of every GPU, and of each MIG device that failed on its own, as the plugin last saw it
    /// (NVML events and its periodic probe). The controller taints the published devices of an unhealthy
    /// entry (see `GpuPolicy.spec.health`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub health: Vec<DeviceHealth>,
    /// What the plugin found about the node, as Kubernetes conditions. `Coexistence`: `True` when no other
    /// GPU manager is on the node; `False` when a device plugin advertises NVIDIA GPUs
    /// (`DevicePluginAdvertisesGPUs`: the plugin then publishes no devices, unless `--coexistence warn`) or
    /// another tool owns the MIG layout (`MigLayoutOwnedByMigManager`, `MigLayoutOwnedByGKE`: the plugin
    /// leaves MIG alone); `Unknown` when it could not read its Node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<InventoryCondition>,
}

/// One condition of a node's inventory, shaped like `metav1.Condition`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InventoryCondition {
    /// e.g. `Coexistence`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// One CamelCase word for machines, e.g. `DevicePluginAdvertisesGPUs`.
    pub reason: String,
    /// What was found and what the plugin does about it, for people.
    #[serde(default)]
    pub message: String,
    /// When `status` or `reason` last changed, on the plugin's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
}

/// The health of one GPU (`mig` unset: the GPU and every device carved from it) or of one MIG device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeviceHealth {
    /// NVML index of the GPU.
    pub gpu: u32,
    /// The MIG device, when the problem was attributed to one (an XID event carrying its GPU-instance id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigDeviceRef>,
    /// `Healthy` or `Unhealthy`.
    pub state: HealthState,
    /// Why it is unhealthy; unset when healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<HealthReason>,
    /// The XID number, for `reason: Xid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xid: Option<u32>,
    /// When the device entered this state, on the plugin's clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
    /// What happened, for people (`kubectl get nodeinventory -o yaml`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// A MIG device by what its published name is made of (`gpu-<gpu>-mig-<profile>-<start>`).
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigDeviceRef {
    /// GPU-instance profile, e.g. `3g.40gb`.
    pub profile: String,
    /// First memory slice of its placement.
    pub start: u32,
}

/// Whether a device works.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum HealthState {
    #[default]
    Healthy,
    Unhealthy,
}

/// What made a device unhealthy; each maps to a taint effect in `GpuPolicy.spec.health.taints`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
pub enum HealthReason {
    /// A critical XID error that needs the GPU's work stopped (not one of the application XIDs).
    Xid,
    /// An uncorrectable (double-bit) ECC memory error.
    DoubleBitEcc,
    /// The GPU stopped answering (`NVML_ERROR_GPU_IS_LOST`, fallen off the bus).
    GpuLost,
    /// The GPU's NVLink fabric (NVSwitch) is not fit for work: fabric manager has not registered it yet
    /// (CUDA fails with error 802 until it has), or the fabric reports health UNHEALTHY or
    /// LIMITED_CAPACITY. Always a `NoSchedule` taint: running work keeps its GPU.
    Fabric,
}

/// One physical GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuInfo {
    /// NVML index on the node.
    pub index: u32,
    /// Minor number of `/dev/nvidia<minor>`.
    pub minor: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// e.g. `NVIDIA H100 80GB HBM3`.
    pub product_name: String,
    /// e.g. `Nvidia`.
    pub brand: String,
    /// e.g. `Hopper`.
    pub architecture: String,
    /// e.g. `9.0`.
    pub cuda_compute_capability: String,
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// Streaming multiprocessors.
    pub multiprocessors: u32,
    /// PCI bus id, `0000:3b:00.0`.
    pub pci_bus_id: String,
    /// PCIe root, `pci0000:3a`, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_root: Option<String>,
    /// NUMA node, when the platform reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<i64>,
    /// Present on MIG-capable GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigInfo>,
    /// False when the plugin saw the GPU fail (lost, fatal XID); such a GPU is not offered.
    #[serde(default = "default_true")]
    pub healthy: bool,
}

fn default_true() -> bool {
    true
}

/// MIG capability of one GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigInfo {
    /// Current MIG mode.
    pub enabled: bool,
    /// True when the plugin may turn MIG mode on and off without a GPU reset (Hopper and newer).
    pub mode_toggle_without_reset: bool,
    /// Memory slices of the GPU (8 on A100/H100/H200/B200).
    pub memory_slices: u32,
    /// Compute slices of the GPU (7 on A100/H100/H200/B200).
    pub compute_slices: u32,
    /// GPU-instance profiles the GPU supports.
    pub profiles: Vec<MigProfileInfo>,
}

/// One GPU-instance profile, as `nvidia-smi mig -lgip` / `-lgipp` report it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigProfileInfo {
    /// e.g. `3g.40gb`.
    pub name: String,
    /// GI profile ID (`info.id`: 19, 20, 15, 14, 9, 5, 0 …).
    pub profile_id: u32,
    /// `NVML_GPU_INSTANCE_PROFILE_*` index.
    pub profile_index: u32,
    /// Compute slices.
    pub compute_slices: u32,
    /// Memory slices (the size of each placement).
    pub memory_slices: u32,
    /// Maximum number of instances of this profile.
    pub instance_count: u32,
    /// Memory in MiB (NVML's `memorySizeMB`).
    pub memory_mib: u64,
    pub multiprocessors: u32,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpeg_engines: u32,
    pub ofa_engines: u32,
    /// Possible placements.
    pub placements: Vec<MigPlacement>,
}

/// A MIG placement: memory slices `[start, start + size)`.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub struct MigPlacement {
    pub start: u32,
    pub size: u32,
}

impl MigPlacement {
    /// True when the two placements share a memory slice.
    pub fn overlaps(&self, other: &MigPlacement) -> bool {
        self.start < other.start + other.size && other.start < self.start + self.size
    }
}

impl MigInfo {
    /// The profile named `name`, if the GPU supports it.
    pub fn profile(&self, name: &str) -> Option<&MigProfileInfo> {
        self.profiles.iter().find(|p| p.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_overlap_only_when_they_share_a_memory_slice() {
        let p = |start, size| MigPlacement { start, size };
        assert!(p(0, 4).overlaps(&p(2, 2)));
        assert!(p(0, 8).overlaps(&p(7, 1)));
        assert!(!p(0, 4).overlaps(&p(4, 4)));
        assert!(!p(6, 1).overlaps(&p(4, 2)));
    }

    #[test]
    fn an_inventory_without_health_reads_as_healthy() {
        let gpu: GpuInfo = serde_json::from_value(serde_json::json!({
            "index": 0, "minor": 0, "uuid": "GPU-1", "productName": "p", "brand": "Nvidia",
            "architecture": "Hopper", "cudaComputeCapability": "9.0", "memoryBytes": 1,
            "multiprocessors": 132, "pciBusId": "0000:00:00.0"
        }))
        .unwrap();
        assert!(gpu.healthy);
    }
}
