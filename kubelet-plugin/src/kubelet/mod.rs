//! The edges to kubelet and the API server: gRPC services, claims, NodeInventory, Lease, events.

pub mod claims;
pub mod coexistence;
pub mod driver;
pub mod error;
pub mod health_service;
pub mod inventory;
pub mod mps_events;
pub mod prepare_retry;
pub mod registration;
pub mod upgrade_watch;
