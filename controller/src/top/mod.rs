//! `kubectl tessera top`: each node's GPUs drawn in the terminal — whole, MIG layout as blocks of its
//! memory slices, shares with request / ceiling / use — with the pod holding each and the GPU's taints.
//!
//! ```text
//!  [ ResourceSlices ] ─┐
//!  [ ResourceClaims ] ─┼─▶ model::build ─▶ Fleet ─▶ render::render ─▶ lines ≤ 80 columns
//!  [ plugin /metrics ] ┘  (through the API server's pod proxy; optional)
//! ```
//!
//! [`model`] and [`render`] are plain Rust, tested without a cluster; [`cli`] is the thin kube layer.

pub mod cli;
mod error;
pub mod metrics;
pub mod model;
pub mod render;
#[cfg(test)]
mod tests;

pub use error::TopError;
