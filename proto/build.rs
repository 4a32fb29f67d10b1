//! Generates the kubelet gRPC bindings with `protox`, a pure-Rust protobuf compiler, so that
//! building needs no system `protoc`.

use std::path::PathBuf;

/// The vendored kubelet protos, relative to this crate's root, which is also the include root:
/// the paths mirror upstream (`k8s.io/kubelet/pkg/apis/...`) so descriptor file names match it.
const PROTO_FILES: &[&str] = &[
    "k8s.io/kubelet/pkg/apis/dra/v1/api.proto",
    "k8s.io/kubelet/pkg/apis/dra/v1beta1/api.proto",
    "k8s.io/kubelet/pkg/apis/pluginregistration/v1/api.proto",
    "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1/api.proto",
    "k8s.io/kubelet/pkg/apis/dra-health/v1/api.proto",
];

/// Name of the encoded `FileDescriptorSet` written to `OUT_DIR`; `lib.rs` embeds it so tests
/// (and gRPC reflection, should anyone want it) can inspect exactly what was compiled.
const DESCRIPTOR_SET_FILE: &str = "tessera_proto_descriptor.bin";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=build.rs");
    for file in PROTO_FILES {
        println!("cargo:rerun-if-changed={file}");
    }

    let mut compiler = protox::Compiler::new(["."])?;
    // Source info carries the proto comments into the generated code as rustdoc.
    compiler.include_source_info(true).include_imports(true);
    compiler.open_files(PROTO_FILES)?;

    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join(DESCRIPTOR_SET_FILE),
        compiler.encode_file_descriptor_set(),
    )?;

    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
