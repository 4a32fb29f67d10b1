//! The objects explain reads, from a file or the API server.

use k8s_openapi::api::{
    core::v1::{Event, Node, Pod},
    resource::v1::{DeviceClass, DeviceTaintRule, ResourceClaim, ResourceClaimTemplate, ResourceSlice},
};

/// The objects explain reads.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    pub classes: Vec<DeviceClass>,
    pub slices: Vec<ResourceSlice>,
    pub claims: Vec<ResourceClaim>,
    pub pods: Vec<Pod>,
    pub templates: Vec<ResourceClaimTemplate>,
    /// The nodes, for a pod's nodeSelector, affinity, taints and extended resources; empty when unknown
    /// (a file without Nodes), and then those checks are left out.
    pub nodes: Vec<Node>,
    /// The target pod's events, for the prepare failure kubelet reports.
    pub events: Vec<Event>,
    /// DeviceTaintRules, where the API server serves them.
    pub taint_rules: Vec<DeviceTaintRule>,
}
