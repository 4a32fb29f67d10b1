//! How a node's plugin tells the controller it is alive: a small `coordination.k8s.io/v1` Lease per node.
//!
//! The plugin renews `tessera-node-<node>` every heartbeat interval, in the namespace of the controller's
//! leader-election Lease, and rewrites its NodeInventory status only when that status changes. Before,
//! every heartbeat rewrote the NodeInventory status: the API server decoded, stored and sent the whole
//! object (about 23 KB for 8 GPUs with their MIG tables) to the controller's watch, for every node, every
//! interval. A Lease is a few hundred bytes.
//!
//! Upgrades run old and new versions side by side, so both sides accept the old signal too:
//! * the controller counts a node as renewed when either its inventory's `lastHeartbeatTime` or its
//!   Lease's `renewTime` changes;
//! * the plugin keeps rewriting the inventory status every interval unless the current leader says it
//!   reads node Leases: [`READS_NODE_LEASES_ANNOTATION`] on the leader-election Lease, naming the holder.
//!   An older controller that takes the lease over keeps the annotation (it copies the object) but not
//!   the holder, so a stale annotation never counts.

use k8s_openapi::api::coordination::v1::Lease;

/// Prefix of a node's heartbeat Lease name; the rest is the node name.
pub const NODE_LEASE_PREFIX: &str = "tessera-node-";

/// Label on every node heartbeat Lease, which the controller's watch selects on.
pub const HEARTBEAT_LABEL: &str = "gpu.tessera.dev/heartbeat";

/// Value of [`HEARTBEAT_LABEL`] on node heartbeat Leases.
pub const HEARTBEAT_LABEL_VALUE: &str = "node";

/// Annotation on the leader-election Lease: the holder identity of a leader that reads node Leases.
pub const READS_NODE_LEASES_ANNOTATION: &str = "gpu.tessera.dev/reads-node-leases";

/// Longest object name the API server accepts (a DNS subdomain).
const MAX_NAME_LEN: usize = 253;

/// The heartbeat Lease name of `node`, or `None` when the prefix makes it too long for an object name (a
/// node name of over 240 characters); such a node heartbeats through its NodeInventory only.
pub fn node_lease_name(node: &str) -> Option<String> {
    let name = format!("{NODE_LEASE_PREFIX}{node}");
    (name.len() <= MAX_NAME_LEN && !node.is_empty()).then_some(name)
}

/// The node a heartbeat Lease is named after.
pub fn node_of_lease(lease_name: &str) -> Option<&str> {
    lease_name
        .strip_prefix(NODE_LEASE_PREFIX)
        .filter(|node| !node.is_empty())
}

/// True when `leader_lease` is held by a controller that reads node Leases (see the module docs).
pub fn leader_reads_node_leases(leader_lease: &Lease) -> bool {
    let holder = leader_lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or_default();
    let advertised = leader_lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(READS_NODE_LEASES_ANNOTATION))
        .map(String::as_str);
    !holder.is_empty() && advertised == Some(holder)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{api::coordination::v1::LeaseSpec, apimachinery::pkg::apis::meta::v1::ObjectMeta};

    use super::*;

    fn leader(holder: Option<&str>, annotation: Option<&str>) -> Lease {
        Lease {
            metadata: ObjectMeta {
                annotations: annotation
                    .map(|a| [(READS_NODE_LEASES_ANNOTATION.to_string(), a.to_string())].into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_string),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_node_lease_is_named_after_its_node_and_maps_back() {
        let name = node_lease_name("gpu-node-7").unwrap();
        assert_eq!(name, "tessera-node-gpu-node-7");
        assert_eq!(node_of_lease(&name), Some("gpu-node-7"));
        assert_eq!(node_of_lease("tessera-controller"), None);
        assert_eq!(node_of_lease(NODE_LEASE_PREFIX), None);
    }

    #[test]
    fn a_node_name_too_long_for_the_prefix_has_no_lease() {
        assert!(node_lease_name(&"n".repeat(MAX_NAME_LEN - NODE_LEASE_PREFIX.len())).is_some());
        assert_eq!(
            node_lease_name(&"n".repeat(MAX_NAME_LEN - NODE_LEASE_PREFIX.len() + 1)),
            None
        );
        assert_eq!(node_lease_name(""), None);
    }

    #[test]
    fn only_a_leader_that_names_itself_in_the_annotation_reads_node_leases() {
        assert!(leader_reads_node_leases(&leader(Some("c-1"), Some("c-1"))));
        // An older controller took over and copied the object, annotation included.
        assert!(!leader_reads_node_leases(&leader(Some("old-2"), Some("c-1"))));
        assert!(!leader_reads_node_leases(&leader(Some("c-1"), None)));
        // Released: nobody leads, so nobody is known to read the Leases.
        assert!(!leader_reads_node_leases(&leader(None, Some(""))));
        assert!(!leader_reads_node_leases(&leader(Some(""), Some(""))));
    }
}
