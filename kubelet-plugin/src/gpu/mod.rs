//! The hardware: the GPU backends, MIG instances over them, the driver's files and life, device health.
//!
//! The interface every backend implements, [`GpuBackend`], is the `tessera-gpu-api` crate's, re-exported
//! here. Two implementations: [`nvml`] drives real GPUs through NVML; `tessera_sim_model::backend` (with the
//! `simulated` feature) models the same state machine
//! (MIG profile tables, placements, NVML error codes, state that survives a plugin restart) for kind,
//! laptops and tests. The operations mirror NVML one call each, so a crash between two calls leaves the same
//! half-done state on both backends, and recovery code is exercised by the tests as it runs on hardware.
//!
//! GPU-instance and compute-instance handles are never kept: every call names the GPU by index and the
//! instance by id, the way NVML handles must be re-resolved after a destroy or reset.

pub mod driver_root;
pub mod driver_upgrade;
pub mod driver_watch;
pub mod health;
pub mod mig;
pub mod nvml;
pub mod nvml_events;
mod nvml_raw;

// The interface every backend implements lives in its own crate, shared with the simulated driver.
pub use tessera_gpu_api::*;
