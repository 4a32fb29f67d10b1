//! tessera's cluster controller: publishes every node's GPUs as ResourceSlices under the cluster's
//! `GpuPolicy`.
//!
//! ```text
//!  [ NodeInventory ] ──▶ policy (CEL rules → one Model per GPU) ──▶ devices (per model) ──▶ pool (slices)
//!  [ Node ]  └──▶ liveness (heartbeat renewals seen; publish / hold / withdraw per node) ──────┤
//!  [ ResourceSlice ] ──────────────────────────────▶ pool_diff::diff ◀─────────────────────────┘
//!                                                          │ only while holding the Lease
//!                                                          ▼
//!                                          publisher: create / update / delete
//! ```
//!
//! Start with [`publisher::Reconciler`]: everything up to the API calls is plain Rust, tested without a
//! cluster; [`runtime`] is the thin kube-rs layer that feeds it snapshots from watches.

pub mod cel;
pub mod cli;
pub mod crds;
pub mod devices;
pub mod explain;
pub mod features;
pub mod fixtures;
pub mod fragmentation;
pub mod health;
pub mod kubectl;
pub mod leader;
pub mod liveness;
pub mod metrics;
pub mod migrate;
pub mod mirror;
pub mod policy;
pub mod pool;
pub mod pool_diff;
pub mod publisher;
pub mod render;
pub mod retain;
pub mod rightsize;
pub mod runtime;
pub mod time;
pub mod top;
pub mod uninstall;
pub mod validate;
pub mod webhook;
