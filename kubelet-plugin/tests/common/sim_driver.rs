//! A simulated driver root built from this repository's artifacts, for tests that drive the real `nvml`
//! backend (and CUDA programs) through the built libraries.
//!
//! ```ignore
//! #[path = "common/sim_driver.rs"]
//! mod sim_driver;
//! let driver = sim_driver::SimDriver::new().mig_gpus("H100-SXM5-80GB", 2).build();
//! let nvml = driver.nvml(); // tessera's NvmlBackend over R/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1
//! ```
//!
//! Each built driver is a temporary directory holding the kernel K (`kernel/`) and the root R (`root/`,
//! with `root/tessera-sim -> ../kernel`). R gets its own *copy* of the library: the dynamic loader loads a
//! file (an inode) once per process, so two tests sharing one file (or a hard link to it) would share one
//! library instance and with it whichever kernel it opened first. Copies keep the tests of one process
//! independent and able to run in parallel, at the cost of copying the library per test.
//!
//! The artifacts are the ones next to the plugin binary cargo built for the tests (`target/<profile>`);
//! [`artifacts_dir`] builds them first.
#![allow(dead_code, reason = "each test file uses the part of the fixture it needs")]

use std::{
    fs,
    path::{Path, PathBuf},
};

use tessera_kubelet_plugin::gpu::nvml::NvmlBackend;
use tessera_sim_model::backend::{GpuGroup, NodeSpec, SimulatedBackend};
use tessera_sim_model::driver_root as sim_driver_root;

/// Where cargo put the plugin binary, and with it the cdylibs and tools of the workspace, built first: they
/// are no dependency of the plugin that cargo knows of, so a plain `cargo test --workspace` on a fresh clone
/// would not have them. cargo releases its build lock while tests run, so a test may call it; once per test
/// process, and a no-op when they are up to date.
pub fn artifacts_dir() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = Path::new(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"));
            let dir = exe.parent().expect("the binary has a directory").to_path_buf();
            let mut cargo = std::process::Command::new(env!("CARGO"));
            cargo.args(["build", "--quiet", "--manifest-path"]);
            cargo.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml"));
            cargo.args([
                "-p",
                "tessera-sim-nvml",
                "-p",
                "tessera-sim-cuda",
                "-p",
                "tessera-sim-tools",
            ]);
            if dir.file_name().is_some_and(|n| n == "release") {
                cargo.arg("--release");
            }
            let out = cargo.output().expect("cargo runs");
            assert!(
                out.status.success(),
                "building the simulated driver's libraries failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                dir.join("libnvidia_ml.so").is_file(),
                "{} has no libnvidia_ml.so after `cargo build -p tessera-sim-nvml`",
                dir.display()
            );
            dir
        })
        .clone()
}

/// Builder of a simulated driver root.
pub struct SimDriver {
    node_name: String,
    spec: NodeSpec,
}

impl Default for SimDriver {
    fn default() -> Self {
        Self::new()
    }
}

impl SimDriver {
    pub fn new() -> Self {
        Self {
            node_name: "node-nvml".to_string(),
            spec: NodeSpec::default(),
        }
    }

    pub fn named(mut self, name: &str) -> Self {
        self.node_name = name.to_string();
        self
    }

    pub fn gpus(mut self, model: &str, count: u32) -> Self {
        self.spec = self.spec.with_gpus(model, count);
        self
    }

    pub fn mig_gpus(mut self, model: &str, count: u32) -> Self {
        self.spec = self.spec.with_mig_gpus(model, count);
        self
    }

    /// GPUs described in full (virtualization mode, fabric, named processes, faults).
    pub fn group(mut self, group: GpuGroup) -> Self {
        self.spec = self.spec.with_group(group);
        self
    }

    pub fn build(self) -> BuiltDriver {
        assert!(
            !Path::new("/dev/nvidiactl").exists(),
            "this host has /dev/nvidiactl, so the simulated libraries would take the tests for a container \
             and show only the GPUs whose /dev nodes exist; run these tests on a host without NVIDIA's driver"
        );
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("kernel");
        let root = dir.path().join("root");
        let model = SimulatedBackend::from_spec(&self.node_name, &self.spec, &kernel).unwrap();
        let artifacts = artifacts_dir();
        sim_driver_root::install_copied(&root, &kernel, &[artifacts]).unwrap();
        fs::create_dir_all(&root).unwrap();
        BuiltDriver {
            dir,
            root,
            kernel,
            model,
        }
    }
}

/// A built driver root R over its kernel K; removed with the test.
pub struct BuiltDriver {
    pub dir: tempfile::TempDir,
    /// R: what `--driver-root` names.
    pub root: PathBuf,
    /// K: the simulated hardware.
    pub kernel: PathBuf,
    /// The hardware model over K, for what a test does to the hardware behind NVML's back (processes,
    /// faults) and for comparing with what NVML reports.
    pub model: SimulatedBackend,
}

impl BuiltDriver {
    /// tessera's `nvml` backend over R's `libnvidia-ml.so.1`: a "plugin start".
    pub fn nvml(&self) -> NvmlBackend {
        NvmlBackend::new(&self.root)
            .unwrap_or_else(|e| panic!("NvmlBackend over {}: {e}", self.root.display()))
    }

    /// R's `libnvidia-ml.so.1`.
    pub fn library(&self) -> PathBuf {
        self.root
            .join(sim_driver_root::LIBRARY_DIR)
            .join("libnvidia-ml.so.1")
    }

    /// nvml-wrapper over R's library, for the calls tessera's backend does not make.
    pub fn nvml_wrapper(&self) -> nvml_wrapper::Nvml {
        nvml_wrapper::Nvml::builder()
            .lib_path(self.library().as_os_str())
            .init()
            .unwrap()
    }

    /// Makes the whole temporary directory readable by other users (a test process running as
    /// another user, see `nvml_lib.rs`'s container tests).
    pub fn open_to_other_users(&self) {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(self.dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        for dir in [&self.kernel, &self.root] {
            fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
}

/// A DCGM-like NVML client in another process (`tessera-kubelet-plugin simulate hold-nvml`): it has
/// `nvmlInit`'d R's library and holds every GPU it sees open until it is dropped (killed, as a crash would
/// end it: the simulated kernel must not need its `nvmlShutdown`).
pub struct NvmlHolder {
    child: std::process::Child,
}

impl BuiltDriver {
    /// Starts an [`NvmlHolder`] over R; returns once it holds the GPUs.
    pub fn hold_nvml(&self) -> NvmlHolder {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"))
            .args(["simulate", "hold-nvml", "--driver-root"])
            .arg(&self.root)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("the plugin binary starts");
        let mut line = String::new();
        // Its one line says the GPUs are held: no polling, no sleep.
        std::io::BufReader::new(child.stdout.take().expect("piped"))
            .read_line(&mut line)
            .unwrap();
        assert!(
            line.starts_with("holding GPUs"),
            "simulate hold-nvml did not start: {line:?} ({:?})",
            child.try_wait()
        );
        NvmlHolder { child }
    }
}

impl NvmlHolder {
    /// Kills the holder and waits until it is gone.
    pub fn kill(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NvmlHolder {
    fn drop(&mut self) {
        self.stop();
    }
}
