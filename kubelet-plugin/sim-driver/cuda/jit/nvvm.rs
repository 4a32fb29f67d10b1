//! tessera's simulated `libnvidia-nvvm.so.4`: the driver's NVVM compiler (libNVVM), which the simulated
//! `libcuda.so.1` `dlopen`s by soname when a program links NVVM IR (`cuLinkAddData` with
//! `CU_JIT_INPUT_NVVM`, LTO-IR), as NVIDIA's does. It compiles nothing: it says whether the input is LLVM IR
//! at all (bitcode, bare or wrapped, or text).
//!
//! Built by `../build.rs` with `rustc` directly (soname `libnvidia-nvvm.so.4`).

use std::ffi::c_int;

/// `CUDA_SUCCESS`.
const SUCCESS: c_int = 0;
/// `CUDA_ERROR_INVALID_IMAGE`.
const INVALID_IMAGE: c_int = 200;

/// Not NVIDIA's entry point (libNVVM's API is `nvvmCreateProgram` …): the simulated libcuda's. `ir` is
/// `len` bytes of NVVM IR.
///
/// # Safety
/// `ir` points at `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tesseraSimNvvmCompile(ir: *const u8, len: usize) -> c_int {
    if ir.is_null() {
        return INVALID_IMAGE;
    }
    // SAFETY: the caller's contract.
    let ir = unsafe { std::slice::from_raw_parts(ir, len) };
    // LLVM bitcode ("BC" 0xC0DE), its wrapper (0x0B17C0DE little-endian), or textual IR.
    let bitcode = ir.starts_with(b"BC\xC0\xDE") || ir.starts_with(&[0xDE, 0xC0, 0x17, 0x0B]);
    let text = std::str::from_utf8(ir).is_ok_and(|t| t.contains("target triple") || t.contains("define "));
    if bitcode || text { SUCCESS } else { INVALID_IMAGE }
}
