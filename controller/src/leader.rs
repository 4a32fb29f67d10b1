//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does it.
//!
//! * The holder renews `renewTime` every [`LeaderElector::renew_interval`].
//! * Another replica takes over only when the lease record has not changed for `leaseDurationSeconds`
//!   **as measured on its own clock** from when it first saw that record (so clock skew between replicas
//!   does not matter), or the holder released it.
//! * A replica that stops cleanly releases the lease (empty holder, as client-go's `ReleaseOnCancel`), so
//!   a rolling update or a drained node hands over at once instead of after a whole lease duration.
//! * A replica considers itself leader for two thirds of the lease duration after its last successful
//!   renewal (client-go's renew deadline), strictly less than the time others wait, so two replicas never
//!   both believe they lead. Writes check [`LeaderElector::is_leader`] right before each call.
//! * Every lease write carries the `resourceVersion` it read; a concurrent change fails with a conflict
//!   and the replica does not lead that round.
//! * While the controller can watch the nodes' heartbeat Leases ([`LeaderElector::set_reads_node_leases`]),
//!   every write as holder names the holder in [`READS_NODE_LEASES_ANNOTATION`], so plugins may stop
//!   rewriting their NodeInventory status every heartbeat ([`tessera_api::heartbeat`]); while it cannot
//!   (RBAC without list/watch on leases), the writes drop that annotation and plugins keep the inventory
//!   heartbeat.

use std::{collections::BTreeMap, sync::Mutex};

use crate::time::to_k8s_time;
use chrono::{DateTime, Utc};
use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use tessera_api::heartbeat::READS_NODE_LEASES_ANNOTATION;

/// Why a lease read or write failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Someone else wrote the lease since it was read.
    #[error("failed to write the lease: it changed concurrently")]
    Conflict,
    /// The API call failed.
    #[error("failed to access the lease: {0}")]
    Api(String),
}

/// Storage of one Lease object.
pub trait LeaseStore: Sync {
    fn get(&self) -> impl Future<Output = Result<Option<Lease>, LeaseError>> + Send;
    fn create(&self, lease: &Lease) -> impl Future<Output = Result<Lease, LeaseError>> + Send;
    /// Replaces the lease if its `resourceVersion` still matches.
    fn replace(&self, lease: &Lease) -> impl Future<Output = Result<Lease, LeaseError>> + Send;
}

/// One replica's view of the election.
#[derive(Debug)]
pub struct LeaderElector {
    identity: String,
    lease_name: String,
    lease_namespace: String,
    lease_duration: chrono::Duration,
    renew_interval: chrono::Duration,
    observed: Option<(LeaseSpec, DateTime<Utc>)>,
    last_renew: Option<DateTime<Utc>>,
    reads_node_leases: bool,
}

impl LeaderElector {
    /// An elector with client-go's defaults: 15 s lease, renewing every 2 s.
    pub fn new(identity: &str, lease_namespace: &str, lease_name: &str) -> Self {
        Self {
            identity: identity.into(),
            lease_name: lease_name.into(),
            lease_namespace: lease_namespace.into(),
            lease_duration: chrono::Duration::seconds(15),
            renew_interval: chrono::Duration::seconds(2),
            observed: None,
            last_renew: None,
            reads_node_leases: false,
        }
    }

    /// Whether this replica's writes tell plugins it reads node Leases (see the module docs); off until set.
    pub fn set_reads_node_leases(&mut self, reads: bool) {
        self.reads_node_leases = reads;
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    pub fn renew_interval(&self) -> chrono::Duration {
        self.renew_interval
    }

    /// True while the last renewal is younger than the renew deadline (2/3 of the lease duration).
    pub fn is_leader(&self, now: DateTime<Utc>) -> bool {
        self.last_renew
            .is_some_and(|t| now < t + self.lease_duration * 2 / 3)
    }

    fn spec(&self, now: DateTime<Utc>, acquire: Option<MicroTime>, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.lease_duration.num_seconds() as i32),
            acquire_time: acquire.or(Some(MicroTime(to_k8s_time(now)))),
            renew_time: Some(MicroTime(to_k8s_time(now))),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }

    /// `annotations` with this replica named as a leader that reads node Leases, or without that
    /// annotation while it does not.
    fn annotated(&self, annotations: Option<BTreeMap<String, String>>) -> BTreeMap<String, String> {
        let mut annotations = annotations.unwrap_or_default();
        if self.reads_node_leases {
            annotations.insert(READS_NODE_LEASES_ANNOTATION.into(), self.identity.clone());
        } else {
            annotations.remove(READS_NODE_LEASES_ANNOTATION);
        }
        annotations
    }

    /// Acquires or renews the lease (skipping the API call while a renewal is fresh) and says whether
    /// this replica leads now.
    pub async fn try_acquire_or_renew<S: LeaseStore>(&mut self, store: &S, now: DateTime<Utc>) -> bool {
        if self.last_renew.is_some_and(|t| now < t + self.renew_interval) {
            return true;
        }
        match self.attempt(store, now).await {
            Ok(true) => {
                self.last_renew = Some(now);
                true
            }
            Ok(false) => {
                self.last_renew = None;
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "lease update failed");
                self.is_leader(now)
            }
        }
    }

    /// Gives the lease up if this replica holds it: clears the holder so another replica acquires it on
    /// its next attempt. Says whether it released anything; a failure is logged and leaves the lease to
    /// expire as if this replica had crashed.
    pub async fn release<S: LeaseStore>(&mut self, store: &S, now: DateTime<Utc>) -> bool {
        self.last_renew = None;
        let lease = match store.get().await {
            Ok(Some(lease)) => lease,
            Ok(None) => return false,
            Err(e) => {
                tracing::warn!(error = %e, "reading the lease to release it failed; it expires instead");
                return false;
            }
        };
        let spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return false;
        }
        let mut released = lease;
        released.spec = Some(LeaseSpec {
            holder_identity: None,
            lease_duration_seconds: Some(1),
            renew_time: Some(MicroTime(to_k8s_time(now))),
            ..spec
        });
        match store.replace(&released).await {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(error = %e, "releasing the lease failed; it expires instead");
                false
            }
        }
    }

    async fn attempt<S: LeaseStore>(&mut self, store: &S, now: DateTime<Utc>) -> Result<bool, LeaseError> {
        let Some(lease) = store.get().await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.lease_name.clone()),
                    namespace: Some(self.lease_namespace.clone()),
                    annotations: Some(self.annotated(None)),
                    ..Default::default()
                },
                spec: Some(self.spec(now, None, 0)),
            };
            return match store.create(&lease).await {
                Ok(_) => Ok(true),
                Err(LeaseError::Conflict) => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        if self.observed.as_ref().is_none_or(|(seen, _)| *seen != spec) {
            self.observed = Some((spec.clone(), now));
        }
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let duration = chrono::Duration::seconds(spec.lease_duration_seconds.unwrap_or(15).into());
        let observed_at = self.observed.as_ref().map_or(now, |(_, t)| *t);
        let transitions = spec.lease_transitions.unwrap_or(0);
        let new_spec = if holder == self.identity {
            self.spec(now, spec.acquire_time.clone(), transitions)
        } else if holder.is_empty() || observed_at + duration <= now {
            self.spec(now, None, transitions + 1)
        } else {
            return Ok(false);
        };
        let mut updated = lease;
        updated.spec = Some(new_spec);
        updated.metadata.annotations = Some(self.annotated(updated.metadata.annotations.take()));
        match store.replace(&updated).await {
            Ok(stored) => {
                self.observed = stored.spec.map(|s| (s, now));
                Ok(true)
            }
            Err(LeaseError::Conflict) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// A Lease kept in memory, with resourceVersion checks: what the API server does for one object.
#[derive(Debug, Default)]
pub struct InMemoryLease {
    lease: Mutex<Option<Lease>>,
}

impl InMemoryLease {
    /// The current holder.
    pub fn holder(&self) -> Option<String> {
        self.lease
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()?
            .spec
            .as_ref()?
            .holder_identity
            .clone()
    }
}

impl LeaseStore for InMemoryLease {
    async fn get(&self) -> Result<Option<Lease>, LeaseError> {
        Ok(self.lease.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    async fn create(&self, lease: &Lease) -> Result<Lease, LeaseError> {
        let mut slot = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return Err(LeaseError::Conflict);
        }
        let mut stored = lease.clone();
        stored.metadata.resource_version = Some("1".into());
        *slot = Some(stored.clone());
        Ok(stored)
    }

    async fn replace(&self, lease: &Lease) -> Result<Lease, LeaseError> {
        let mut slot = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        let current = slot.as_ref().ok_or(LeaseError::Conflict)?;
        if current.metadata.resource_version != lease.metadata.resource_version {
            return Err(LeaseError::Conflict);
        }
        let next: u64 = current
            .metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
            + 1;
        let mut stored = lease.clone();
        stored.metadata.resource_version = Some(next.to_string());
        *slot = Some(stored.clone());
        Ok(stored)
    }
}
