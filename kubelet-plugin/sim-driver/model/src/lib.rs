//! The simulated NVIDIA hardware: one model of a node's GPUs under a driver root, which the simulated
//! `libnvidia-ml.so.1` and `libcuda.so.1`, `nvidia-smi` and the MPS tools read and change, and which the
//! plugin's `simulated` backend drives directly. See `kubelet-plugin/sim-driver/README.md`.
//!
//! - [`backend`]: the GPUs' state machine (MIG mode, instances, compute mode, processes), kept in a kernel
//!   directory that plays the driver's part, and the [`tessera_gpu_api::GpuBackend`] over it;
//! - [`faults`] and [`load`]: what `tessera-kubelet-plugin simulate` injects (XIDs, lost GPUs; usage);
//! - [`contention`]: the part of the SMs busy MPS clients of one GPU get beside each other;
//! - [`calls`]: how often the NVML calls whose number matters were made (handle lookups by UUID);
//! - [`driver_root`]: NVIDIA's user-space layouts (host, GPU Operator, GKE) filled with the simulated
//!   libraries and tools;
//! - [`kernel`]: the kernel directory's names and the driver version it reports;
//! - [`sessions`]: which processes hold GPUs open through NVML (what makes a MIG toggle IN_USE);
//! - [`state_file`]: the small JSON files those share, changed under a lock.

pub mod backend;
pub mod calls;
pub mod contention;
pub mod driver_root;
pub mod faults;
pub mod kernel;
pub mod load;
pub mod sessions;
pub mod state_file;
