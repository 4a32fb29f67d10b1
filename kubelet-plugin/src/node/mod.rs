//! The prepare/unprepare state machine and what it keeps: the checkpoint, CDI specs, device metadata, warm partitions.

pub mod cdi;
pub mod checkpoint;
pub mod device_metadata;
pub mod edits;
pub mod error;
pub mod mig_records;
pub mod state;
pub mod warm;
