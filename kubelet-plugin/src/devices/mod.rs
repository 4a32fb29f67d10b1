//! How each device kind is prepared for the state machine: whole GPUs, MIG devices, MPS and time-sliced shares.

pub mod preparers;
pub mod sharing;
