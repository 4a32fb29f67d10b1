//! tessera's simulated `libnvidia-ptxjitcompiler.so.1`: the driver's PTX JIT compiler, which the simulated
//! `libcuda.so.1` `dlopen`s by soname when a program loads a PTX module, as NVIDIA's does. It compiles
//! nothing: it says whether the text is PTX at all (a `.version` and a `.target` directive).
//!
//! Built by `../build.rs` with `rustc` directly (soname `libnvidia-ptxjitcompiler.so.1`).

use std::ffi::c_int;

/// `CUDA_SUCCESS`.
const SUCCESS: c_int = 0;
/// `CUDA_ERROR_INVALID_PTX` (cuda.h: "a PTX JIT compilation failed").
const INVALID_PTX: c_int = 218;

/// Not NVIDIA's entry point (the real library's is private to the driver): the simulated libcuda's.
/// `ptx` is `len` bytes of PTX text.
///
/// # Safety
/// `ptx` points at `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tesseraSimPtxJitCompile(ptx: *const u8, len: usize) -> c_int {
    if ptx.is_null() {
        return INVALID_PTX;
    }
    // SAFETY: the caller's contract.
    let text = unsafe { std::slice::from_raw_parts(ptx, len) };
    let Ok(text) = std::str::from_utf8(text) else {
        return INVALID_PTX;
    };
    let directive = |name: &str| text.lines().any(|l| l.trim_start().starts_with(name));
    if directive(".version") && directive(".target") {
        SUCCESS
    } else {
        INVALID_PTX
    }
}
