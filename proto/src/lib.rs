//! kubelet's gRPC APIs for DRA drivers, generated at build time from vendored `.proto` files.
//!
//! * [`dra::v1`] and [`dra::v1beta1`]: the `DRAPlugin` service the kubelet calls to prepare and
//!   unprepare ResourceClaims. A 1.34+ kubelet prefers v1; older kubelets know only v1beta1.
//! * [`pluginregistration`]: the `Registration` service through which the kubelet discovers a
//!   plugin in its registry directory.
//! * [`health::v1`] and [`health::v1alpha1`]: the `DRAResourceHealth` service streaming device health
//!   (v1 since Kubernetes 1.37, v1alpha1 for 1.36).
//!
//! Server and client code is generated for every service: the plugin serves them, and tests use
//! the clients to play the kubelet. The proto packages are kept exactly as upstream because the
//! gRPC method paths (`/<package>.<Service>/<Method>`) are derived from them; see `README.md`.

// Generated code documents only what the proto comments document and is not written to clippy's
// taste; lints on it would be noise we cannot fix without editing generated output.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod dra {
    //! The DRA plugin service, `k8s.io.kubelet.pkg.apis.dra.{v1,v1beta1}`.

    /// `k8s.io.kubelet.pkg.apis.dra.v1` (Kubernetes 1.34+; `Device.share_id` since 1.35).
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }

    /// `k8s.io.kubelet.pkg.apis.dra.v1beta1` (the same API without `Device.share_id`).
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
}

/// Plugin registration v1, proto package `pluginregistration`.
// Generated code; see the comment on `dra`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");
}

// Generated code; see the comment on `dra`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod health {
    //! DRA device health, `dra-health` upstream.

    /// Proto package `v1alpha1` (Kubernetes 1.31+; beta and on by default in 1.36).
    pub mod v1alpha1 {
        tonic::include_proto!("v1alpha1");
    }

    /// Proto package `v1` (Kubernetes 1.37: the same messages as v1alpha1, which 1.37 deprecates).
    pub mod v1 {
        tonic::include_proto!("v1");
    }
}

/// `PluginInfo.supported_versions` entry announcing [`dra::v1`]'s `DRAPlugin`.
pub const DRA_PLUGIN_V1_SERVICE: &str = "v1.DRAPlugin";

/// `PluginInfo.supported_versions` entry announcing [`dra::v1beta1`]'s `DRAPlugin`.
pub const DRA_PLUGIN_V1BETA1_SERVICE: &str = "v1beta1.DRAPlugin";

/// `PluginInfo.supported_versions` entry announcing [`health::v1alpha1`]'s `DRAResourceHealth`.
pub const DRA_HEALTH_V1ALPHA1_SERVICE: &str = "v1alpha1.DRAResourceHealth";

/// `PluginInfo.supported_versions` entry announcing [`health::v1`]'s `DRAResourceHealth`. A 1.37 kubelet
/// opens the health stream only when registration lists it or the v1alpha1 entry.
pub const DRA_HEALTH_V1_SERVICE: &str = "v1.DRAResourceHealth";

/// `PluginInfo.type` of a DRA driver.
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";

/// The encoded `FileDescriptorSet` of all vendored protos (with source info), as compiled.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/tessera_proto_descriptor.bin"));
