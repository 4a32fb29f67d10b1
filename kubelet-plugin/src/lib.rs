//! tessera's kubelet plugin: the node half of the `gpu.tessera.dev` DRA driver.
//!
//! Its folders are its layers; each imports only the layers below it.
//!
//! ```text
//!  cli        flags, subcommands and `run`, which wires the layers below
//!   │
//!  kubelet    the edges: kubelet's registration, DRA and health sockets, the API server's claims,
//!   │         the NodeInventory and the node Lease, prepare retries, pod events
//!   │
//!  devices    how each device kind is prepared: whole GPUs, MIG devices, MPS and time-sliced shares
//!   │
//!  node       the prepare/unprepare state machine and what it keeps: checkpoint, CDI specs, device
//!   │         metadata, warm partitions
//!   │
//!  gpu        the hardware: the GpuBackend trait, NVML and simulated backends, MIG instances, the
//!             driver's files, device health, usage
//!
//!  metrics    a sink: the layers report events through `metrics::sink`; `metrics::prometheus` renders
//! ```
//!
//! Start with [`node::state::NodeState`]; everything else adapts it to kubelet, the API server, the runtime
//! (CDI) and the hardware.

pub mod cli;
pub mod devices;
pub mod gpu;
pub mod kubelet;
pub mod metrics;
pub mod node;
