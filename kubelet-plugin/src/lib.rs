//! tessera's kubelet plugin: the node half of the `gpu.tessera.dev` DRA driver.
//!
//! ```text
//!  kubelet ──registration socket──▶ [`registration`]   (GetInfo / NotifyRegistrationStatus)
//!     │                                   │ registered?
//!     └──────DRA socket──▶ [`driver`] ──▶ [`state`] ──▶ [`gpu`] backend (NVML or simulated)
//!                                          │   │
//!                            [`claims`] ◀──┘   ├──▶ [`cdi`] specs (one per claim)
//!                  (ResourceClaim from the     └──▶ [`checkpoint`] (prepared claims, two-phase)
//!                        API server)
//!  [`inventory`] ──▶ NodeInventory (spec: discovered GPUs; status: ready + heartbeat)
//! ```
//!
//! Device kinds are prepared by [`preparers`], which composes [`mig`] and [`sharing`] (neither imports the
//! other) and adds the driver's files ([`driver_root`]) to each device's nodes ([`edits`]).
//!
//! Start with [`state::NodeState`]: the prepare/unprepare state machine; everything else adapts it to
//! kubelet, the API server, the runtime (CDI) and the disk.

pub mod args;
pub mod cdi;
pub mod checkpoint;
pub mod claims;
pub mod coexistence;
pub mod device_metadata;
pub mod driver;
pub mod driver_root;
pub mod driver_watch;
pub mod edits;
pub mod error;
pub mod gpu;
pub mod health;
pub mod inventory;
pub mod metrics;
pub mod mig;
pub mod mig_records;
pub mod mps_events;
pub mod prepare_retry;
pub mod preparers;
pub mod registration;
pub mod sharing;
pub mod state;
pub mod warm;
