//! The library's soname is CUDA's, so a program that links `-lcuda` or `dlopen`s `libcuda.so.1` finds it
//! under that name in NVIDIA's layout (`libcuda.so.<version>` plus the `libcuda.so.1` link).

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
