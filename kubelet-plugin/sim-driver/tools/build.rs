//! The programs find the driver's libraries next to them as well as on the loader's path: a run path of
//! the driver root's library directories relative to the binary (`R/usr/bin` → `R/usr/lib/x86_64-linux-gnu`,
//! GKE's `bin` → `lib64`), so `nvidia-smi` on a node whose driver root is not `/` loads the root's
//! `libnvidia-ml.so.1` without `LD_LIBRARY_PATH`. NVIDIA's binaries have none; `LD_LIBRARY_PATH` and
//! `LD_PRELOAD` still come first (DT_RUNPATH is searched after them).

fn main() {
    println!(
        "cargo:rustc-link-arg-bins=-Wl,-rpath,$ORIGIN/../lib/x86_64-linux-gnu:$ORIGIN/../lib64:$ORIGIN/../lib"
    );
    println!("cargo:rerun-if-changed=build.rs");
}
