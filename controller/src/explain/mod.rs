//! `tessera explain`: why a pod, claim or template does (not) fit, evaluated the way kube-scheduler's
//! structured allocator evaluates it, with the first condition each device fails.
//!
//! ```text
//!  [ List file | API server ] ──▶ Cluster ──▶ targets (pod → its pending claims; claim; template)
//!                                    │
//!                                    ▼ per node: model (pools, counters left, who holds what)
//!              per request: static checks per device ─▶ diagnosis, closest devices
//!              all requests together: the allocator's exhaustive search ─▶ verdict per node
//! ```
//!
//! Everything here is plain Rust over k8s-openapi types; [`cli`] is the thin kube layer. What is not
//! modelled is listed in the binary's `--help` ([`cli::NOT_MODELLED`]).

pub mod cli;
mod cluster;
mod diagnose;
mod error;
pub mod eval;
pub mod fragmentation;
pub mod input;
pub mod model;
pub mod pod;
pub mod report;
pub mod request;
mod target;

pub use self::{cluster::Cluster, diagnose::explain, error::ExplainError, target::Target};
