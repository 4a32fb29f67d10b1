//! Gives the cdylib NVML's soname, so programs linked against `libnvidia-ml.so.1` (and the dynamic
//! loader's cache) treat the installed copy as NVIDIA's library.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvidia-ml.so.1");
}
