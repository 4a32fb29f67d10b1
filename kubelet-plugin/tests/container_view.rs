//! What a container gets from the plugin as the binary assembles it (issue 12): the driver's files, one
//! consistent `NVIDIA_VISIBLE_DEVICES`, and the node-level faults a real GPU node shows (a lost GPU, a busy
//! Hopper, a time-slice left by an earlier plugin, a hung MPS tool), on the simulated backend.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Command,
    sync::Arc,
    time::Duration,
};

#[path = "common/sim_driver.rs"]
mod sim_driver;

use k8s_openapi::api::resource::v1::ResourceClaim;
use serde_json::json;
use tempfile::TempDir;
use tessera_api::GROUP_VERSION;
use tessera_kubelet_plugin::devices::preparers::{SharedPreparer, with_preparers};
use tessera_kubelet_plugin::devices::sharing::Sharer;
use tessera_kubelet_plugin::devices::sharing::mps::{Launcher, MpsError, MpsManager};
use tessera_kubelet_plugin::gpu::driver_root::{DriverFiles, DriverRoot};
use tessera_kubelet_plugin::gpu::{GpuBackend, TimeSlice};
use tessera_kubelet_plugin::kubelet::claims::fake::{FakeClaims, NODE, claim};
use tessera_kubelet_plugin::node::cdi::Spec;
use tessera_kubelet_plugin::node::state::{ClaimRef, NodeState, StateConfig};
use tessera_sim_model::backend::{NodeSpec, SimulatedBackend, SimulatedFault};
use tessera_sim_model::kernel::SIMULATED_DRIVER_VERSION;

const BOOT_ID: &str = "11111111-2222-3333-4444-555555555555";

/// A simulated node: its directories, fake API server claims, and the spec its GPUs come from.
struct Node {
    dir: TempDir,
    spec: NodeSpec,
    claims: FakeClaims,
}

impl Node {
    fn new(spec: NodeSpec) -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            spec,
            claims: FakeClaims::new(),
        }
    }

    fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// The node's GPUs as a freshly started plugin opens them (a new backend: nothing cached), over a driver
    /// root of the built libraries.
    fn backend(&self) -> Arc<SimulatedBackend> {
        sim_driver::artifacts_dir();
        Arc::new(SimulatedBackend::from_spec(NODE, &self.spec, &self.state_dir()).unwrap())
    }

    fn add(&self, c: ResourceClaim) -> ClaimRef {
        let r = ClaimRef {
            namespace: c.metadata.namespace.clone().unwrap(),
            name: c.metadata.name.clone().unwrap(),
            uid: c.metadata.uid.clone().unwrap(),
        };
        self.claims.insert(c);
        r
    }
}

/// The plugin as `cli/take_over.rs` assembles it, (re)started over `backend`.
fn plugin(node: &Node, backend: &Arc<SimulatedBackend>) -> Arc<NodeState> {
    let program = PathBuf::from(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"));
    let mps = MpsManager::new(&node.state_dir(), Launcher::Simulated { program });
    let discovered = backend.discover().unwrap();
    let files = DriverFiles::discover(
        &DriverRoot::new(backend.driver_root()),
        discovered.driver_version.as_deref(),
    );
    let shared = Arc::new(SharedPreparer::new(
        Arc::new(Sharer::new(backend.clone(), mps, false)),
        files,
    ));
    let state = NodeState::new(
        StateConfig {
            node_name: NODE.into(),
            boot_id: BOOT_ID.into(),
            state_dir: node.state_dir(),
            cdi_dir: node.dir.path().join("cdi"),
        },
        backend.clone(),
        discovered.gpus,
        Arc::new(node.claims.clone()),
    );
    let state = with_preparers(state, &shared);
    state.recover().unwrap();
    Arc::new(state)
}

fn spec_of(state: &NodeState, r: &ClaimRef) -> Spec {
    state.cdi().read(&r.uid).unwrap().unwrap()
}

/// The env a container gets from all of a claim's CDI devices: the CDI library applies each device's
/// edits in turn and a later value of a key replaces an earlier one.
fn merged_env(spec: &Spec) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for d in &spec.devices {
        for e in &d.container_edits.env {
            let (k, v) = e.split_once('=').unwrap();
            env.insert(k.to_string(), v.to_string());
        }
    }
    env
}

#[tokio::test]
async fn a_two_gpu_claim_keeps_both_uuids_and_one_nvidia_visible_devices_after_the_cdi_merge() {
    let node = Node::new(NodeSpec::default().with_gpus("H100-SXM5-80GB", 4));
    let backend = node.backend();
    let state = plugin(&node, &backend);
    let r = node.add(claim("two").allocated("gpu-2").allocated("gpu-3").build());
    state.prepare(&r).await.unwrap();

    let gpus = backend.discover().unwrap().gpus;
    let env = merged_env(&spec_of(&state, &r));
    assert_eq!(
        env.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str),
        Some("void"),
        "{env:?}"
    );
    assert_eq!(env.get("TESSERA_UUID_GPU_2"), Some(&gpus[2].uuid), "{env:?}");
    assert_eq!(env.get("TESSERA_UUID_GPU_3"), Some(&gpus[3].uuid), "{env:?}");
}

#[tokio::test]
async fn every_device_mounts_the_driver_libraries_and_an_nvidia_smi_that_lists_the_gpus() {
    let node = Node::new(NodeSpec::default().with_gpus("H100-SXM5-80GB", 2));
    let backend = node.backend();
    let state = plugin(&node, &backend);
    let whole = node.add(claim("whole").allocated("gpu-0").build());
    let mig = node.add(claim("mig").allocated("gpu-1-mig-1g-10gb-0").build());
    let share = node.add(
        claim("share")
            .allocated_share("gpu-1-mig-3g-40gb-4-shared", "s1")
            .build(),
    );
    for r in [&whole, &mig, &share] {
        state.prepare(r).await.unwrap();
    }

    let root = backend.driver_root().to_path_buf();
    assert!(
        root.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").exists(),
        "the simulated driver root lacks the built libraries: run `cargo build --workspace` first"
    );
    for r in [&whole, &mig, &share] {
        let spec = spec_of(&state, r);
        // The driver's files are the spec's own edits, once per claim; a device keeps its nodes and env.
        assert!(
            !spec.devices[0]
                .container_edits
                .mounts
                .iter()
                .any(|m| m.container_path.contains("libcuda")),
            "{}: a device carries the driver's mounts: {:?}",
            r.name,
            spec.devices[0].container_edits
        );
        let mounts = &spec.container_edits.mounts;
        let by_target: BTreeMap<&str, &str> = mounts
            .iter()
            .map(|m| (m.container_path.as_str(), m.host_path.as_str()))
            .collect();
        for lib in ["libcuda", "libnvidia-ml"] {
            for file in [
                format!("{lib}.so.1"),
                format!("{lib}.so.{SIMULATED_DRIVER_VERSION}"),
            ] {
                let target = format!("/usr/lib/x86_64-linux-gnu/{file}");
                let host = by_target
                    .get(target.as_str())
                    .unwrap_or_else(|| panic!("{target} not mounted for {}: {mounts:?}", r.name));
                assert!(Path::new(host).starts_with(&root), "{host}");
                // What the container opens: the runtime bind-mounts the file the host path resolves to,
                // a shared object this repository builds (`tessera_sim_model::driver_root`).
                let content = std::fs::read(host).unwrap();
                assert!(content.starts_with(b"\x7fELF"), "{host} is not a built library");
            }
        }
        let smi = by_target
            .get("/usr/bin/nvidia-smi")
            .unwrap_or_else(|| panic!("nvidia-smi not mounted: {mounts:?}"));
        let m = mounts
            .iter()
            .find(|m| m.container_path == "/usr/bin/nvidia-smi")
            .unwrap();
        assert!(m.options.contains(&"ro".to_string()), "{:?}", m.options);
        // The simulated nvidia-smi loads libnvidia-ml.so.1 by soname, as NVIDIA's does.
        let out = Command::new(smi)
            .arg("-L")
            .env("LD_LIBRARY_PATH", root.join("usr/lib/x86_64-linux-gnu"))
            .output()
            .unwrap();
        let listing = String::from_utf8(out.stdout).unwrap();
        for gpu in backend.discover().unwrap().gpus {
            assert!(listing.contains(&gpu.uuid), "{listing}");
        }
    }
    // Stops the share's MPS daemon, which would otherwise outlive the test.
    for r in [&whole, &mig, &share] {
        state.unprepare(r).await.unwrap();
    }
}

#[tokio::test]
async fn a_restarted_plugin_resets_the_time_slice_its_predecessor_set() {
    let node = Node::new(NodeSpec::default().with_gpus("H100-SXM5-80GB", 1));
    let ts = json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}});
    let r = node.add(claim("ts").allocated("gpu-0-share-0").config(ts).build());
    let first_backend = node.backend();
    let first = plugin(&node, &first_backend);
    first.prepare(&r).await.unwrap();
    assert_eq!(first_backend.hardware_time_slice(0).unwrap(), TimeSlice::Long);
    drop(first);

    // A restart: new process, new backend that cannot read the time-slice back.
    let second_backend = node.backend();
    let second = plugin(&node, &second_backend);
    second.unprepare(&r).await.unwrap();
    assert_eq!(
        second_backend.hardware_time_slice(0).unwrap(),
        TimeSlice::Default,
        "the last share's release must reset the GPU"
    );
}

#[tokio::test]
async fn a_first_share_asking_for_default_resets_a_gpu_left_on_long() {
    let node = Node::new(NodeSpec::default().with_gpus("H100-SXM5-80GB", 1));
    let backend = node.backend();
    // An earlier plugin crashed after setting Long (or an admin did it).
    backend.set_hardware_time_slice(0, TimeSlice::Long).unwrap();
    let state = plugin(&node, &backend);
    let ts = json!({"apiVersion": GROUP_VERSION, "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Default"}}});
    let r = node.add(claim("ts").allocated("gpu-0-share-0").config(ts).build());
    state.prepare(&r).await.unwrap();
    assert_eq!(backend.hardware_time_slice(0).unwrap(), TimeSlice::Default);
}

#[tokio::test]
async fn a_busy_hopper_refuses_a_mig_claim_saying_it_is_in_use_not_that_it_needs_a_reset() {
    let node = Node::new(NodeSpec::default().with_gpus("H100-SXM5-80GB", 1));
    let backend = node.backend();
    let state = plugin(&node, &backend);
    backend.add_process(0, None, 4242).unwrap();
    let r = node.add(claim("m").allocated("gpu-0-mig-3g-40gb-0").build());
    let err = state.prepare(&r).await.unwrap_err().to_string();
    assert!(
        err.contains("is in use") && err.contains("stop the processes"),
        "{err}"
    );
    assert!(!err.contains("reset"), "{err}");
    assert!(!backend.mig_mode(0).unwrap().current);

    backend.remove_process(0, 4242).unwrap();
    state.prepare(&r).await.unwrap();
    assert_eq!(backend.list_gpu_instances(0).unwrap().len(), 1);
    state.unprepare(&r).await.unwrap();
}

#[tokio::test]
async fn a_lost_gpu_and_one_without_memory_info_are_left_out_and_the_others_are_served() {
    let node = Node::new(
        NodeSpec::default()
            .with_gpus("H100-SXM5-80GB", 1)
            .with_faulty_gpus("H100-SXM5-80GB", 1, SimulatedFault::Lost)
            .with_faulty_gpus("H100-SXM5-80GB", 1, SimulatedFault::MemoryNotSupported)
            .with_gpus("H100-SXM5-80GB", 1),
    );
    let backend = node.backend();
    let found = backend.discover().unwrap();
    assert_eq!(found.gpus.iter().map(|g| g.index).collect::<Vec<_>>(), [0, 3]);
    let reasons: Vec<&str> = found.unusable.iter().map(|u| u.reason.as_str()).collect();
    assert!(
        reasons[0].contains("GPU 1") && reasons[0].contains("lost"),
        "{reasons:?}"
    );
    assert!(
        reasons[1].contains("GPU 2") && reasons[1].contains("memory"),
        "{reasons:?}"
    );

    let state = plugin(&node, &backend);
    let ok = node.add(claim("ok").allocated("gpu-3").build());
    state.prepare(&ok).await.unwrap();
    let lost = node.add(claim("lost").allocated("gpu-1").build());
    let err = state.prepare(&lost).await.unwrap_err().to_string();
    assert!(err.contains("gpu-1") && err.contains("not on this node"), "{err}");
}

#[test]
fn an_mps_control_command_that_hangs_is_killed_after_its_timeout() {
    let dir = tempfile::tempdir().unwrap();
    // NVIDIA's tool as a hung daemon leaves it: it never answers. `exec` so the kill reaches the sleeper.
    let tool = dir.path().join("nvidia-cuda-mps-control");
    write_tool(&tool, "#!/bin/sh\nexec sleep 30\n");
    let mps = MpsManager::new(
        dir.path(),
        Launcher::Nvidia {
            control: tool.clone(),
            driver_root: dir.path().to_path_buf(),
        },
    )
    .with_command_timeout(Duration::from_millis(300));
    let err = mps
        .send("gpu-0", "get_default_active_thread_percentage")
        .unwrap_err();
    assert!(matches!(err, MpsError::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("was killed"), "{err}");
}

#[test]
fn discover_cdi_prints_the_spec_a_claim_would_get_and_names_the_gpus_it_leaves_out() {
    let dir = tempfile::tempdir().unwrap();
    let node_file = dir.path().join("node.yaml");
    std::fs::write(
        &node_file,
        "gpus:\n- {model: H100-SXM5-80GB, count: 2}\n- {model: H100-SXM5-80GB, fault: Lost}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"))
        .args([
            "discover",
            "--backend",
            "simulated",
            "--cdi",
            "--simulated-node-file",
        ])
        .arg(&node_file)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let spec: Spec = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["dry-run-gpu-0", "dry-run-gpu-1"]);
    assert!(
        spec.container_edits
            .mounts
            .iter()
            .any(|m| m.container_path == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        "{:?}",
        spec.container_edits
    );
    // Named once, where the plugin installs its hook by default.
    assert!(
        spec.container_edits
            .hooks
            .iter()
            .any(|h| h.path == "/var/lib/tessera/bin/tessera-cdi-hook" && h.args[1] == "update-ldcache"),
        "{:?}",
        spec.container_edits.hooks
    );
    for d in &spec.devices {
        assert!(
            d.container_edits.mounts.is_empty() && d.container_edits.hooks.is_empty(),
            "{d:?}"
        );
        assert!(
            d.container_edits
                .env
                .contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string())
        );
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("GPU 2 is not offered") && stderr.contains("lost"),
        "{stderr}"
    );
}

/// Writes an executable `script` at `path` without this process ever holding it open for writing: another
/// test thread forking a child at that moment would inherit the descriptor until its exec, and running the
/// tool then fails with ETXTBSY ("Text file busy"). `cp` writes it in a process of its own instead.
fn write_tool(path: &Path, script: &str) {
    let source = path.with_extension("source");
    std::fs::write(&source, script).unwrap();
    let copied = std::process::Command::new("cp")
        .arg(&source)
        .arg(path)
        .status()
        .unwrap();
    assert!(copied.success(), "cp {} {}", source.display(), path.display());
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
}

/// A GPU Operator style driver root (tools and libraries not on the plugin's own paths) whose
/// `nvidia-cuda-mps-control` is `script`, and an [`MpsManager`] launching it.
struct FakeControlTool {
    root: tempfile::TempDir,
    _state: tempfile::TempDir,
    mps: MpsManager,
}

impl FakeControlTool {
    fn with_script(script: &str) -> Self {
        let root = tempfile::tempdir().unwrap();
        let bin = root.path().join("usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(root.path().join("usr/lib/x86_64-linux-gnu")).unwrap();
        let tool = bin.join("nvidia-cuda-mps-control");
        write_tool(&tool, script);
        let state = tempfile::tempdir().unwrap();
        let mps = MpsManager::new(
            state.path(),
            Launcher::Nvidia {
                control: tool,
                driver_root: root.path().to_path_buf(),
            },
        );
        Self {
            root,
            _state: state,
            mps,
        }
    }

    fn send(&self) -> Result<String, String> {
        self.mps
            .send("gpu-0", "get_default_active_thread_percentage")
            .map_err(|e| e.to_string())
    }
}

#[test]
fn nvidias_mps_tool_runs_with_the_driver_roots_path_and_libraries() {
    // Prints what the control daemon would use to find nvidia-cuda-mps-server and libcuda.
    let fake = FakeControlTool::with_script(
        "#!/bin/sh\necho \"PATH=$PATH\"\necho \"LD_LIBRARY_PATH=$LD_LIBRARY_PATH\"\n",
    );
    let out = fake.send().unwrap();
    let (bin, lib) = (
        fake.root.path().join("usr/bin"),
        fake.root.path().join("usr/lib/x86_64-linux-gnu"),
    );
    assert!(
        out.contains(&format!("PATH={}", bin.display())),
        "the driver root's binaries must come first: {out}"
    );
    // Never the root's library directories (an Operator rootfs's libc would load): the daemon's links to
    // NVIDIA's libraries only (issue 22; tests/mps_operator_layout.rs starts one on such a root).
    assert!(
        out.ends_with(&format!(
            "\nLD_LIBRARY_PATH={}",
            fake.mps.dirs("gpu-0").lib.display()
        )),
        "{out}"
    );
    assert!(!out.contains(&lib.display().to_string()), "{out}");
}

#[test]
fn a_control_tool_that_exits_without_reading_its_command_reports_its_own_error() {
    // Closes stdin at once, as a control tool that cannot reach its daemon gives up before reading.
    let fake = FakeControlTool::with_script(
        "#!/bin/sh\nexec 0<&-\necho 'Cannot find MPS control daemon process' >&2\nexit 1\n",
    );
    for _ in 0..20 {
        let err = fake.send().unwrap_err();
        assert!(
            err.contains("Cannot find MPS control daemon process"),
            "the tool's own message, not a broken pipe: {err}"
        );
    }
}
