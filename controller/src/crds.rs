//! The CustomResourceDefinitions of tessera's own objects, generated from the Rust types.

use kube::CustomResourceExt;
use tessera_api::{NodeInventory, policy::GpuPolicy};

/// `(file name under deployments/crds/, YAML)` for every CRD.
pub fn crd_files() -> Vec<(String, String)> {
    let render = |crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition| {
        let name = crd.metadata.name.clone().unwrap_or_default();
        let yaml = serde_norway::to_string(&crd).expect("a CRD serializes to YAML");
        (format!("{name}.yaml"), yaml)
    };
    vec![render(NodeInventory::crd()), render(GpuPolicy::crd())]
}

/// All CRDs as one YAML stream.
pub fn crds_yaml() -> String {
    crd_files()
        .into_iter()
        .map(|(_, y)| format!("---\n{y}"))
        .collect()
}
