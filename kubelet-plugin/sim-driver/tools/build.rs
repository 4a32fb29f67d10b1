//! No run path on purpose (NVIDIA's binaries have none): a run path into the driver root's library
//! directories (`$ORIGIN/../lib/x86_64-linux-gnu`, …) is searched for every library the program needs, its
//! `libc.so.6` too, and on a GPU Operator rootfs that directory holds the distribution's libc, so the tools
//! would load it under another glibc's loader and die before `main`. `nvidia-smi` finds
//! `libnvidia-ml.so.1` by soname, then next to itself by path (`open_nvml`); the MPS tools load no driver
//! library.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
}
