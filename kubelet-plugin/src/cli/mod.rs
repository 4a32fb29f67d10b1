//! Flags, subcommands and start-up: `run` wires the layers together as `lib.rs` draws them.

pub mod args;
mod backend;
mod discover;
mod driver_params;
mod driver_upgrade;
pub mod error;
mod mps;
mod run;
#[cfg(feature = "simulated")]
mod simulate;
mod take_over;
mod wait_for_driver;
