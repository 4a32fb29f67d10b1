//! The MPS daemon on a GPU Operator style driver root: a whole distro rootfs whose own `libc.so.6` sits in
//! a library directory beside NVIDIA's libraries. The plugin runs NVIDIA's `nvidia-cuda-mps-control` (here
//! the simulated one, installed from the built artifacts) with its own loader; were that directory on the
//! tool's library path, the loader would take the rootfs's libc and the tool would die before `main`.
//!
//! Needs the artifacts (built first, [`sim_driver::artifacts_dir`]) and a C compiler `cc` (the one cargo
//! links with) for the decoy libc.
//!
//! Where the decoy lies: `R/lib/x86_64-linux-gnu/libc.so.6`, where a non-merged-/usr Ubuntu (the 20.04
//! driver containers) has its libc, with NVIDIA's libraries in `R/usr/lib/x86_64-linux-gnu`. Not in
//! `R/usr/lib/x86_64-linux-gnu` itself: tessera's simulated tools carry a run path
//! (`$ORIGIN/../lib/x86_64-linux-gnu:$ORIGIN/../lib64:$ORIGIN/../lib`, see `sim-driver/tools/build.rs`), which
//! the loader searches after `LD_LIBRARY_PATH`, so a libc there kills them whatever the plugin does; NVIDIA's
//! binaries have no run path.

#[path = "common/sim_driver.rs"]
mod sim_driver;

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use tessera_kubelet_plugin::devices::sharing::mps::{
    CLIENT_CONNECT, ClientGrant, DAEMON_LOG, Launcher, MpsManager, send_control,
};
use tessera_kubelet_plugin::devices::sharing::supervisor_protocol::DaemonDefaults;
use tessera_kubelet_plugin::gpu::GpuBackend;
use tessera_kubelet_plugin::gpu::driver_root::DriverRoot;
use tessera_sim_model::backend::{NodeSpec, SimulatedBackend};
use tessera_sim_model::driver_root::{artifact_dirs, install};

/// Where the rootfs's own libc goes (see the module comment).
const DISTRO_LIB_DIR: &str = "lib/x86_64-linux-gnu";

/// A simulated driver root R over its kernel, turned into an Operator-layout rootfs with a decoy libc.
struct OperatorRoot {
    dir: tempfile::TempDir,
    uuid: String,
}

impl OperatorRoot {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("kernel");
        let spec = NodeSpec::default().with_gpus("H100-SXM5-80GB", 1);
        let backend = SimulatedBackend::from_spec("operator-node", &spec, &kernel).unwrap();
        sim_driver::artifacts_dir();
        let dirs = artifact_dirs();
        install(&dir.path().join("root"), &kernel, &dirs)
            .unwrap()
            .require_complete(&dirs)
            .expect("build the simulated driver first: cargo build --workspace");
        let uuid = backend.discover().unwrap().gpus[0].uuid.clone();
        let root = Self { dir, uuid };
        root.add_decoy_libc();
        root
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    fn control(&self) -> PathBuf {
        self.root().join("usr/bin/nvidia-cuda-mps-control")
    }

    /// A shared object named `libc.so.6` that defines nothing a program needs: a process whose loader
    /// picks it fails with "symbol lookup error … __libc_start_main" (exit 127).
    fn add_decoy_libc(&self) {
        let lib = self.root().join(DISTRO_LIB_DIR);
        fs::create_dir_all(&lib).unwrap();
        let source = self.dir.path().join("decoy.c");
        fs::write(&source, "int tessera_decoy_libc = 1;\n").unwrap();
        let out = Command::new("cc")
            .args(["-shared", "-fPIC", "-nostdlib", "-Wl,-soname,libc.so.6", "-o"])
            .arg(lib.join("libc.so.6"))
            .arg(&source)
            .output()
            .expect("a C compiler `cc` for the decoy libc");
        assert!(
            out.status.success(),
            "cc: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn manager(&self, state: &str) -> MpsManager {
        MpsManager::new(
            &self.dir.path().join(state),
            Launcher::Nvidia {
                control: self.control(),
                driver_root: self.root(),
            },
        )
    }
}

/// The environment of a running process.
fn environ(pid: u32) -> Vec<(String, String)> {
    fs::read(format!("/proc/{pid}/environ"))
        .unwrap()
        .split(|b| *b == 0)
        .filter_map(|kv| {
            let kv = String::from_utf8_lossy(kv);
            let (k, v) = kv.split_once('=')?;
            Some((k.to_string(), v.to_string()))
        })
        .collect()
}

fn env_of(env: &[(String, String)], key: &str) -> String {
    env.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no {key} in {env:?}"))
}

fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
    })
}

fn wait_gone(pid: u32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        assert!(std::time::Instant::now() < deadline, "process {pid} still runs");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `quit` to the daemon of a pipe directory when dropped, so a failing test leaves no daemon behind.
struct QuitOnDrop(PathBuf);

impl Drop for QuitOnDrop {
    fn drop(&mut self) {
        let _ = send_control(&self.0, "quit");
    }
}

/// Every file name in `dir` is one of NVIDIA's driver libraries (and there is no libc among them).
fn only_driver_libraries(dir: &Path) {
    for entry in fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().to_string();
        assert!(
            tessera_kubelet_plugin::gpu::driver_root::LIBRARIES
                .iter()
                .any(|lib| name.starts_with(&format!("{lib}.so"))),
            "{name} in the daemon's library path {}",
            dir.display()
        );
    }
}

#[test]
fn the_decoy_libc_kills_a_tool_given_the_roots_library_directories() {
    // The fixture's own check: the decoy is what the loader picks from the root's library directories
    // (what the plugin put on LD_LIBRARY_PATH before), and the tool then cannot start.
    let r = OperatorRoot::new();
    let dirs = DriverRoot::new(r.root()).ld_library_path();
    assert!(dirs.contains(DISTRO_LIB_DIR), "{dirs}");
    let out = Command::new(r.control())
        .env("LD_LIBRARY_PATH", &dirs)
        .env("CUDA_MPS_PIPE_DIRECTORY", r.dir.path().join("pipe"))
        .env("CUDA_MPS_LOG_DIRECTORY", r.dir.path().join("log"))
        .arg("-d")
        .output()
        .unwrap();
    let _quit = QuitOnDrop(r.dir.path().join("pipe"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(127), "{stderr}");
    assert!(
        stderr.contains("libc.so.6") || stderr.contains("__libc_start_main"),
        "{stderr}"
    );
}

#[test]
fn an_mps_daemon_starts_answers_and_stops_on_an_operator_rootfs_with_its_own_libc() {
    let r = OperatorRoot::new();
    // The plugin's own daemons (`-d`, detached) and the supervisor's (`-f`, its children).
    for (state, mps) in [
        ("plugin", r.manager("plugin")),
        ("supervisor", r.manager("supervisor").owning_children(false)),
    ] {
        let defaults = DaemonDefaults {
            active_thread_percentage: Some(30),
            pinned_memory_bytes: Some(2 << 30),
        };
        let dirs = mps
            .start(&r.uuid, &r.uuid, defaults)
            .unwrap_or_else(|e| panic!("{state}: {e}"));
        let _quit = QuitOnDrop(dirs.pipe.clone());
        let pid = mps.pid(&r.uuid).expect("the daemon's pid");
        assert_eq!(
            mps.send(&r.uuid, "get_default_active_thread_percentage").unwrap(),
            "30.0",
            "{state}"
        );
        assert_eq!(
            mps.send(&r.uuid, "get_default_device_pinned_mem_limit 0")
                .unwrap(),
            "2048M",
            "{state}"
        );

        // The daemon's library path: its private links to NVIDIA's libraries, nothing of the rootfs.
        let env = environ(pid);
        let ld_path = env_of(&env, "LD_LIBRARY_PATH");
        assert_eq!(ld_path, dirs.lib.display().to_string(), "{state}");
        only_driver_libraries(&dirs.lib);
        let cuda = fs::read_link(dirs.lib.join("libcuda.so.1")).unwrap();
        assert_eq!(
            cuda,
            r.root().join("usr/lib/x86_64-linux-gnu/libcuda.so.580.159.03"),
            "{state}: the soname link leads to the versioned file"
        );
        // PATH still leads the daemon to nvidia-cuda-mps-server.
        assert!(
            env_of(&env, "PATH").starts_with(&r.root().join("usr/bin").display().to_string()),
            "{state}: {env:?}"
        );

        // A client starts the server, which runs under the same library path.
        let answer = send_control(
            &dirs.pipe,
            &format!(
                "{CLIENT_CONNECT} uuid={0} gpu={0} pid={1}",
                r.uuid,
                std::process::id()
            ),
        )
        .unwrap();
        let grant = ClientGrant::parse(&answer).unwrap_or_else(|e| panic!("{state}: {e}"));
        assert_ne!(grant.server_pid, pid, "{state}: a server of its own");
        assert!(alive(grant.server_pid), "{state}");
        assert_eq!(grant.active_thread_percentage, 30.0);

        // The daemon's own output has a file, and names the start.
        let log = fs::read_to_string(dirs.log.join(DAEMON_LOG)).unwrap();
        assert!(log.contains("starting"), "{state}: {log}");

        mps.stop(&r.uuid).unwrap();
        wait_gone(pid);
        wait_gone(grant.server_pid);
        assert!(mps.running().is_empty(), "{state}");
        assert!(
            !dirs.root.exists(),
            "{state}: the daemon's directory, links included, is removed"
        );
    }
}

/// Writes an executable `script` without this process holding it open for writing (another test thread's
/// fork would inherit the descriptor and the exec would fail with ETXTBSY): `cp` writes it.
fn write_tool(path: &Path, script: &str) {
    let source = path.with_extension("source");
    fs::write(&source, script).unwrap();
    let copied = Command::new("cp").arg(&source).arg(path).status().unwrap();
    assert!(copied.success());
    fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

#[test]
fn a_failed_start_names_the_daemon_log_and_quotes_its_last_lines() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("root/usr/bin");
    fs::create_dir_all(&bin).unwrap();
    let tool = bin.join("nvidia-cuda-mps-control");
    write_tool(
        &tool,
        "#!/bin/sh\necho 'nvidia-cuda-mps-control: cannot load libcuda.so.1' >&2\nexit 1\n",
    );
    let launcher = Launcher::Nvidia {
        control: tool,
        driver_root: dir.path().join("root"),
    };
    for (state, mps) in [
        (
            "plugin",
            MpsManager::new(&dir.path().join("plugin"), launcher.clone()),
        ),
        (
            "supervisor",
            MpsManager::new(&dir.path().join("supervisor"), launcher.clone()).owning_children(false),
        ),
    ] {
        let err = mps
            .start(
                "gpu-0",
                "GPU-00000000-0000-0000-0000-000000000000",
                DaemonDefaults::default(),
            )
            .unwrap_err()
            .to_string();
        assert!(err.contains(DAEMON_LOG), "{state}: {err}");
        assert!(err.contains("cannot load libcuda.so.1"), "{state}: {err}");
        let log = fs::read_to_string(mps.dirs("gpu-0").log.join(DAEMON_LOG)).unwrap();
        assert!(log.contains("cannot load libcuda.so.1"), "{state}: {log}");
    }
}
