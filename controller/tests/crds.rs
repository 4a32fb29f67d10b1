//! The checked-in CRDs under deployments/crds/ are what the Rust types generate.

mod support;

use support::{check_golden, repo_root};
use tessera_controller::crds::{crd_files, crds_yaml};

#[test]
fn checked_in_crds_match_the_rust_types() {
    let files = crd_files();
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "nodeinventories.gpu.tessera.dev.yaml",
            "gpupolicies.gpu.tessera.dev.yaml"
        ]
    );
    for (name, yaml) in files {
        check_golden(&repo_root().join("deployments/crds").join(name), &yaml);
    }
}

#[test]
fn the_crds_command_prints_both_crds_as_one_stream() {
    let yaml = crds_yaml();
    assert_eq!(yaml.matches("kind: CustomResourceDefinition").count(), 2);
    assert!(yaml.contains("name: gpupolicies.gpu.tessera.dev"));
    assert!(yaml.contains("scope: Cluster"));
}
