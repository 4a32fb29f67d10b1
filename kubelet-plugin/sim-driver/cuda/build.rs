//! The library's soname is CUDA's, so a program that links `-lcuda` or `dlopen`s `libcuda.so.1` finds it
//! under that name in NVIDIA's layout (`libcuda.so.<version>` plus the `libcuda.so.1` link).
//!
//! It also builds the two JIT libraries the real `libcuda.so.1` `dlopen`s by soname when a program loads
//! PTX or NVVM IR (`jit/`): `libnvidia_ptxjitcompiler.so` (soname `libnvidia-ptxjitcompiler.so.1`) and
//! `libnvidia_nvvm.so` (soname `libnvidia-nvvm.so.4`), next to `libcuda.so` in `target/<profile>`, where the
//! simulated driver root takes its artifacts from (`tessera_sim_model::driver_root`). They are built here,
//! by `rustc` directly, because a package has one library target and each needs its own soname.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

/// (source under `jit/`, file name cargo's convention gives it, soname).
const JIT_LIBRARIES: [(&str, &str, &str); 2] = [
    (
        "ptxjitcompiler.rs",
        "libnvidia_ptxjitcompiler.so",
        "libnvidia-ptxjitcompiler.so.1",
    ),
    ("nvvm.rs", "libnvidia_nvvm.so", "libnvidia-nvvm.so.4"),
];

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rerun-if-changed=build.rs");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // OUT_DIR is <target>/<profile>/build/<package>-<hash>/out: the artifacts go to <target>/<profile>.
    let profile_dir = out_dir
        .ancestors()
        .nth(3)
        .expect("OUT_DIR lies under the profile directory")
        .to_path_buf();
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let release = env::var("PROFILE").is_ok_and(|p| p == "release");
    for (source, file, soname) in JIT_LIBRARIES {
        let source = Path::new("jit").join(source);
        println!("cargo:rerun-if-changed={}", source.display());
        let built = out_dir.join(file);
        let mut cmd = Command::new(&rustc);
        cmd.args(["--edition", "2024", "--crate-type", "cdylib", "--crate-name"])
            .arg(file.trim_start_matches("lib").trim_end_matches(".so"))
            .arg("-C")
            .arg(format!("link-arg=-Wl,-soname,{soname}"))
            .arg("-o")
            .arg(&built)
            .arg(&source);
        if release {
            cmd.args(["-C", "opt-level=2", "-C", "strip=debuginfo"]);
        }
        if let (Ok(target), Ok(host)) = (env::var("TARGET"), env::var("HOST"))
            && target != host
        {
            cmd.args(["--target", &target]);
        }
        let status = cmd.status().expect("rustc runs");
        assert!(status.success(), "building {} failed", source.display());
        // Through a temporary name renamed over the old one, as cargo replaces its own artifacts.
        let tmp = profile_dir.join(format!(".{file}.tmp"));
        std::fs::copy(&built, &tmp).expect("copy the JIT library next to libcuda.so");
        std::fs::rename(&tmp, profile_dir.join(file)).expect("rename the JIT library into place");
    }
}
