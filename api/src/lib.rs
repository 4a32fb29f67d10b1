//! tessera's shared vocabulary.
//!
//! ```text
//!  kubelet plugin ──writes──▶ [ NodeInventory ] ◀──reads── cluster controller ──writes──▶ [ ResourceSlice ]
//!        ▲                      (one per node)                   ▲
//!        │                                                        └──reads── [ GpuPolicy ] (cluster admin)
//!  [ ResourceClaim.status.allocation ] ── device names from [`device_name`], configs from [`config`]
//! ```
//!
//! Everything both sides must agree on lives here: the driver name, attribute and capacity names, how
//! device names are spelled, the node inventory custom resource and the opaque claim configuration.

pub mod attributes;
pub mod claim_list;
pub mod config;
pub mod device_name;
pub mod health;
pub mod heartbeat;
pub mod inventory;
pub mod metrics;
pub mod policy;

pub use device_name::DeviceName;
pub use inventory::{GpuInfo, MigPlacement, MigProfileInfo, NodeInventory, NodeInventorySpec};

/// The DRA driver name, also the domain of every attribute and capacity tessera publishes.
pub const DRIVER_NAME: &str = "gpu.tessera.dev";

/// API group of tessera's custom resources and opaque configuration kinds.
pub const API_GROUP: &str = "gpu.tessera.dev";

/// API version of tessera's custom resources and opaque configuration kinds.
pub const API_VERSION: &str = "v1alpha1";

/// `apiVersion` string of tessera's own objects.
pub const GROUP_VERSION: &str = "gpu.tessera.dev/v1alpha1";

/// Re-exports of the Kubernetes crates, so every tessera crate uses the same versions.
pub mod k8s {
    pub use k8s_openapi;
    pub use kube;
}
