//! `kubectl tessera rightsize`: a Deployment's share sized from what its pods used, read from Prometheus
//! (tessera's per-claim series), by the sizing rule v1 ([`rule`]), as a resized ResourceClaimTemplate.
//!
//! ```text
//!  template ──▶ patch::share_request ──▶ query (PromQL for the pods' series) ──▶ Prometheus
//!                                                    │ samples
//!                                                    ▼
//!                         rule::recommend ──▶ patch::changes ──▶ patch::resized_template
//! ```
//!
//! Everything but [`cli`] (the API server reads) and [`query::Prometheus`] (the GET) is plain Rust.

pub mod cli;
pub mod error;
pub mod patch;
pub mod query;
pub mod rule;
pub mod sizing;

pub use error::RightsizeError;
pub use sizing::{Inputs, Outcome, rightsize};

#[cfg(test)]
mod tests;
