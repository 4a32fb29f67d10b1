//! tessera's cluster controller: publishes every node's GPUs as ResourceSlices under the cluster's
//! `GpuPolicy`.
//!
//! ```text
//!  [ NodeInventory ] ──▶ policy (CEL rules → one Model per GPU) ──▶ devices (per model) ──▶ pool (slices)
//!  [ Node ]                                                                                    │
//!  [ ResourceSlice ] ──────────────────────────────▶ reconcile::diff ◀─────────────────────────┘
//!                                                          │ only while holding the Lease
//!                                                          ▼
//!                                                  create / update / delete
//! ```
//!
//! Start with [`reconciler::Reconciler`]: everything up to the API calls is plain Rust, tested without a
//! cluster; [`runtime`] is the thin kube-rs layer that feeds it snapshots from watches.

pub mod cel;
pub mod cli;
pub mod crds;
pub mod devices;
pub mod features;
pub mod fixtures;
pub mod leader;
pub mod liveness;
pub mod policy;
pub mod pool;
pub mod reconcile;
pub mod reconciler;
pub mod render;
pub mod runtime;
pub mod validate;
