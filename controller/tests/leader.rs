//! Leader election handover: a replica that stops cleanly gives the Lease up, so its successor leads on
//! its next attempt instead of waiting out the lease duration.

use chrono::{DateTime, Duration, TimeZone, Utc};
use tessera_controller::leader::{InMemoryLease, LeaderElector, LeaseStore};

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 12, 1, 9, 0, 0).unwrap()
}

fn elector(identity: &str) -> LeaderElector {
    LeaderElector::new(identity, "tessera-system", "tessera-controller")
}

#[tokio::test]
async fn a_replica_that_stops_cleanly_hands_the_lease_over_at_once() {
    let lease = InMemoryLease::default();
    let (mut a, mut b) = (elector("a"), elector("b"));
    assert!(a.try_acquire_or_renew(&lease, t0()).await);
    assert!(
        !b.try_acquire_or_renew(&lease, t0()).await,
        "b must not lead while a holds a fresh lease"
    );

    assert!(a.release(&lease, t0() + Duration::seconds(1)).await);
    assert!(
        !a.is_leader(t0() + Duration::seconds(1)),
        "a released, so it must not believe it leads"
    );
    assert_eq!(lease.holder(), None);

    // One second later, far inside the 15 s lease duration a crash would make b wait.
    assert!(b.try_acquire_or_renew(&lease, t0() + Duration::seconds(2)).await);
    assert_eq!(lease.holder().as_deref(), Some("b"));
}

#[tokio::test]
async fn releasing_a_lease_held_by_another_replica_changes_nothing() {
    let lease = InMemoryLease::default();
    let (mut a, mut b) = (elector("a"), elector("b"));
    assert!(a.try_acquire_or_renew(&lease, t0()).await);
    assert!(!b.release(&lease, t0()).await);
    assert_eq!(lease.holder().as_deref(), Some("a"));
    assert!(
        !b.try_acquire_or_renew(&lease, t0() + Duration::seconds(1)).await,
        "a still holds a fresh lease"
    );
}

#[tokio::test]
async fn a_replica_that_crashes_is_replaced_only_after_the_lease_duration() {
    let lease = InMemoryLease::default();
    let (mut a, mut b) = (elector("a"), elector("b"));
    assert!(a.try_acquire_or_renew(&lease, t0()).await);
    assert!(!b.try_acquire_or_renew(&lease, t0() + Duration::seconds(1)).await);
    assert!(!b.try_acquire_or_renew(&lease, t0() + Duration::seconds(15)).await);
    assert!(b.try_acquire_or_renew(&lease, t0() + Duration::seconds(16)).await);
}

#[tokio::test]
async fn the_leader_tells_plugins_it_reads_node_leases_and_a_released_or_copied_claim_does_not_count() {
    use tessera_api::heartbeat::{READS_NODE_LEASES_ANNOTATION, leader_reads_node_leases};
    let lease = InMemoryLease::default();
    let (mut a, mut b) = (elector("a"), elector("b"));
    a.set_reads_node_leases(true);
    b.set_reads_node_leases(true);
    assert!(a.try_acquire_or_renew(&lease, t0()).await);
    let stored = lease.get().await.unwrap().unwrap();
    assert!(leader_reads_node_leases(&stored), "created by a");
    assert!(a.try_acquire_or_renew(&lease, t0() + Duration::seconds(3)).await);
    assert!(
        leader_reads_node_leases(&lease.get().await.unwrap().unwrap()),
        "renewed by a"
    );

    assert!(a.release(&lease, t0() + Duration::seconds(4)).await);
    assert!(
        !leader_reads_node_leases(&lease.get().await.unwrap().unwrap()),
        "nobody leads"
    );
    assert!(b.try_acquire_or_renew(&lease, t0() + Duration::seconds(5)).await);
    let taken = lease.get().await.unwrap().unwrap();
    assert!(leader_reads_node_leases(&taken));
    assert_eq!(
        taken.metadata.annotations.unwrap()[READS_NODE_LEASES_ANNOTATION],
        "b"
    );

    // An older controller takes over by replacing the spec of the object it read, annotation and all.
    let mut old = lease.get().await.unwrap().unwrap();
    old.spec.as_mut().unwrap().holder_identity = Some("old-version".into());
    lease.replace(&old).await.unwrap();
    assert!(!leader_reads_node_leases(&lease.get().await.unwrap().unwrap()));
}

#[tokio::test]
async fn a_leader_that_cannot_watch_node_leases_takes_its_word_back_so_plugins_keep_the_inventory_heartbeat()
{
    use tessera_api::heartbeat::leader_reads_node_leases;
    let lease = InMemoryLease::default();
    let mut a = elector("a");
    assert!(a.try_acquire_or_renew(&lease, t0()).await);
    assert!(
        !leader_reads_node_leases(&lease.get().await.unwrap().unwrap()),
        "not before it watches them"
    );
    a.set_reads_node_leases(true);
    assert!(a.try_acquire_or_renew(&lease, t0() + Duration::seconds(2)).await);
    assert!(leader_reads_node_leases(&lease.get().await.unwrap().unwrap()));
    // Its Lease watch is refused or lost: the next renewal drops the annotation.
    a.set_reads_node_leases(false);
    assert!(a.try_acquire_or_renew(&lease, t0() + Duration::seconds(4)).await);
    assert!(!leader_reads_node_leases(&lease.get().await.unwrap().unwrap()));
}
