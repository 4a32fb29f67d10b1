//! Flags, subcommands and start-up: `run` wires the layers together as `lib.rs` draws them.

pub mod args;
pub mod error;
