//! The edges to kubelet and the API server: the DRA, registration and health gRPC services, the
//! claims read from the API server, the NodeInventory and node Lease, prepare retries and pod events.

pub mod claims;
pub mod coexistence;
pub mod driver;
pub mod error;
pub mod health_service;
pub mod inventory;
pub mod mps_events;
pub mod prepare_retry;
pub mod registration;
