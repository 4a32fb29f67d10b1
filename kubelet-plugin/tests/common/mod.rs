//! Fixtures shared by the integration tests: a simulated node in a temp dir, and a kubelet stand-in that
//! talks to the plugin over its real unix sockets.
#![allow(dead_code)] // Each test binary uses a different subset.

use std::{path::Path, sync::Arc};

use hyper_util::rt::TokioIo;
use tempfile::TempDir;
use tessera_kubelet_plugin::gpu::GpuBackend;
use tessera_kubelet_plugin::kubelet::claims::fake::{FakeClaims, NODE};
use tessera_kubelet_plugin::node::state::{NodeState, StateConfig};
use tessera_sim_model::backend::{NodeSpec, SimulatedBackend};
use tonic::transport::{Channel, Endpoint};

pub const BOOT_ID: &str = "11111111-2222-3333-4444-555555555555";

/// A node with 8 simulated H100s and its directories.
pub struct TestNode {
    pub dir: TempDir,
    pub backend: Arc<dyn GpuBackend>,
    pub claims: FakeClaims,
}

impl TestNode {
    pub fn new() -> Self {
        Self::with_gpus(8)
    }

    pub fn with_gpus(count: u32) -> Self {
        Self::with_spec(NodeSpec::default().with_gpus("H100-SXM5-80GB", count))
    }

    /// A node of `spec` (its GPUs, and the time its simulated driver spends in MIG calls).
    pub fn with_spec(spec: NodeSpec) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let backend = SimulatedBackend::from_spec(NODE, &spec, &dir.path().join("state")).unwrap();
        Self {
            dir,
            backend: Arc::new(backend),
            claims: FakeClaims::new(),
        }
    }

    pub fn state_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("state")
    }

    pub fn cdi_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("cdi")
    }

    pub fn config(&self, boot_id: &str) -> StateConfig {
        StateConfig {
            node_name: NODE.into(),
            boot_id: boot_id.into(),
            state_dir: self.state_dir(),
            cdi_dir: self.cdi_dir(),
        }
    }

    /// A fresh plugin state over this node, as after a (re)start, not yet recovered.
    pub fn state_unrecovered(&self, boot_id: &str) -> NodeState {
        let gpus = self.backend.discover().unwrap().gpus;
        NodeState::new(
            self.config(boot_id),
            self.backend.clone(),
            gpus,
            Arc::new(self.claims.clone()),
        )
    }

    /// A fresh, recovered plugin state over this node.
    pub fn state(&self) -> Arc<NodeState> {
        let state = self.state_unrecovered(BOOT_ID);
        state.recover().unwrap();
        Arc::new(state)
    }
}

/// A gRPC channel over a unix socket, the way kubelet dials plugins.
/// Retries for a while (up to 30 s: a plugin process started by a test may take seconds to bind on a
/// loaded 2-core machine), because a test may dial while the plugin is still starting or replacing a
/// stale socket.
pub async fn dial(path: &Path) -> Channel {
    let mut last = None;
    for _ in 0..600 {
        let path = path.to_path_buf();
        // The URI is required by the API but ignored: the connector below always opens the unix socket.
        let connected =
            Endpoint::from_static("http://[::]:50051")
                .connect_with_connector(tower::service_fn(move |_| {
                    let path = path.clone();
                    async move {
                        Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?))
                    }
                }))
                .await;
        match connected {
            Ok(channel) => return channel,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("failed to dial {}: {last:?}", path.display());
}

/// Waits until a socket file exists (the server binds it in the background).
pub async fn wait_for_socket(path: &Path) {
    for _ in 0..500 {
        if path.exists() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!(
        "socket {} never appeared; the plugin likely failed to bind",
        path.display()
    );
}

/// The plugin's state with its real preparers (whole GPUs, MIG, shares with simulated MPS daemons run
/// from `program`, the plugin binary), its orphaned-daemon sweep registered as the binary registers it,
/// over this node with `boot_id`; not yet recovered. Also returns the sharer, to look at the daemons.
pub fn real_plugin(
    node: &TestNode,
    boot_id: &str,
    program: std::path::PathBuf,
) -> (NodeState, Arc<tessera_kubelet_plugin::devices::sharing::Sharer>) {
    use tessera_kubelet_plugin::devices::preparers::{SharedPreparer, with_preparers};
    use tessera_kubelet_plugin::devices::sharing::Sharer;
    use tessera_kubelet_plugin::devices::sharing::mps::{Launcher, MpsManager};
    use tessera_kubelet_plugin::gpu::driver_root::DriverFiles;
    let mps = MpsManager::new(&node.state_dir(), Launcher::Simulated { program });
    let sharer = Arc::new(Sharer::new(node.backend.clone(), mps, false));
    let shared = Arc::new(SharedPreparer::new(sharer.clone(), DriverFiles::default()));
    let sweep = shared.clone();
    let state = with_preparers(node.state_unrecovered(boot_id), &shared)
        .with_orphan_sweep(Arc::new(move |gpus| sweep.stop_orphaned_daemons(gpus)));
    (state, sharer)
}

/// The plugin binary for `node` on the simulated backend (`node_file`) with every directory under `d`
/// (state, registry, plugins, cdi, boot_id) and a kubeconfig for `server` written there: how the process
/// tests start it. Callers add their own flags and environment.
pub fn plugin_command(d: &Path, node: &str, node_file: &Path, server: &str) -> std::process::Command {
    let mut cmd = plugin_command_in(d, node, server);
    cmd.args(["--backend", "simulated"])
        .arg("--simulated-node-file")
        .arg(node_file);
    cmd
}

/// The plugin binary for `node`, its backend not yet chosen, with every directory under `d` (state,
/// registry, plugins, cdi, boot_id) and a kubeconfig for `server` written there.
pub fn plugin_command_in(d: &Path, node: &str, server: &str) -> std::process::Command {
    let kubeconfig = d.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n\
             users: [{{name: u, user: {{token: t}}}}]\ncontexts: [{{name: x, context: {{cluster: c, user: u}}}}]\n\
             current-context: x\n"
        ),
    )
    .unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"));
    cmd.args(["--node-name", node])
        .arg("--state-dir")
        .arg(d.join("state"))
        .arg("--kubelet-registry-dir")
        .arg(d.join("registry"))
        .arg("--kubelet-plugins-dir")
        .arg(d.join("plugins"))
        .arg("--cdi-dir")
        .arg(d.join("cdi"))
        .arg("--boot-id-file")
        .arg(d.join("boot_id"))
        .arg("--kubeconfig")
        .arg(kubeconfig);
    cmd
}

/// The plugin as the binary assembles it over `dir` (state in `dir/state`, CDI specs in `dir/cdi`): `gpus`
/// simulated H100s, the real share preparer with MPS daemons started through `launcher`, locally
/// recovered with [`BOOT_ID`]. Returns the state, the share preparer (its sharer holds the daemons) and the
/// backend.
pub fn assembled_plugin(
    dir: &Path,
    gpus: u32,
    launcher: tessera_kubelet_plugin::devices::sharing::mps::Launcher,
    claims: FakeClaims,
) -> (
    Arc<NodeState>,
    Arc<tessera_kubelet_plugin::devices::preparers::SharedPreparer>,
    Arc<SimulatedBackend>,
) {
    assembled_plugin_with(dir, gpus, launcher, claims, |state| state)
}

/// [`assembled_plugin`], with `finish` applied to the state before it is recovered (to add what the binary
/// adds, such as a sink for failed prepares).
pub fn assembled_plugin_with(
    dir: &Path,
    gpus: u32,
    launcher: tessera_kubelet_plugin::devices::sharing::mps::Launcher,
    claims: FakeClaims,
    finish: impl FnOnce(NodeState) -> NodeState,
) -> (
    Arc<NodeState>,
    Arc<tessera_kubelet_plugin::devices::preparers::SharedPreparer>,
    Arc<SimulatedBackend>,
) {
    use tessera_kubelet_plugin::devices::preparers::{SharedPreparer, with_preparers};
    use tessera_kubelet_plugin::devices::sharing::Sharer;
    use tessera_kubelet_plugin::devices::sharing::mps::MpsManager;
    use tessera_kubelet_plugin::gpu::driver_root::DriverFiles;
    let state_dir = dir.join("state");
    let backend = Arc::new(
        SimulatedBackend::from_spec(
            NODE,
            &NodeSpec::default().with_gpus("H100-SXM5-80GB", gpus),
            &state_dir,
        )
        .unwrap(),
    );
    let mps = MpsManager::new(&state_dir, launcher);
    let shared = Arc::new(SharedPreparer::new(
        Arc::new(Sharer::new(backend.clone(), mps, false)),
        DriverFiles::default(),
    ));
    let state = NodeState::new(
        StateConfig {
            node_name: NODE.into(),
            boot_id: BOOT_ID.into(),
            state_dir,
            cdi_dir: dir.join("cdi"),
        },
        backend.clone(),
        backend.discover().unwrap().gpus,
        Arc::new(claims),
    );
    let state = finish(with_preparers(state, &shared));
    state.recover().unwrap();
    (Arc::new(state), shared, backend)
}

/// The plugin as the binary assembles it, (re)started over `node` with `boot_id`, through its start-up
/// (local recovery, then the API).
pub struct Plugin {
    pub state: Arc<NodeState>,
    pub mps: Arc<tessera_kubelet_plugin::devices::sharing::Sharer>,
    pub recovery: tessera_kubelet_plugin::node::state::Recovery,
}

pub async fn start(node: &TestNode, boot_id: &str) -> Plugin {
    let program = std::path::PathBuf::from(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"));
    let (state, mps) = real_plugin(node, boot_id, program);
    let state = Arc::new(state);
    let recovery = state.start().await.unwrap();
    Plugin { state, mps, recovery }
}

/// Stops, when the test ends, every simulated MPS daemon still running in the node's state directory
/// (tests that restart the plugin leave them running on purpose; the processes must not outlive the test).
/// Declare it after the node, so it runs before the temp dir goes.
pub struct StopDaemons(pub tessera_kubelet_plugin::devices::sharing::mps::MpsManager);

impl StopDaemons {
    pub fn new(node: &TestNode) -> Self {
        let program = std::path::PathBuf::from(env!("CARGO_BIN_EXE_tessera-kubelet-plugin"));
        Self(tessera_kubelet_plugin::devices::sharing::mps::MpsManager::new(
            &node.state_dir(),
            tessera_kubelet_plugin::devices::sharing::mps::Launcher::Simulated { program },
        ))
    }
}

impl Drop for StopDaemons {
    fn drop(&mut self) {
        for key in self.0.running() {
            let _ = self.0.stop(&key);
        }
    }
}

/// Puts claim `c` into the node's API server; its reference, as kubelet names it.
pub fn add(
    node: &TestNode,
    c: k8s_openapi::api::resource::v1::ResourceClaim,
) -> tessera_kubelet_plugin::node::state::ClaimRef {
    let r = tessera_kubelet_plugin::node::state::ClaimRef::of(&c);
    node.claims.insert(c);
    r
}

/// The MIG instances on GPU `gpu` as `(gi, uuid)`.
pub fn instances(node: &TestNode, gpu: u32) -> Vec<(u32, String)> {
    node.backend
        .list_gpu_instances(gpu)
        .unwrap_or_default()
        .into_iter()
        .flat_map(|g| g.compute_instances.into_iter().map(move |c| (g.id, c.uuid)))
        .collect()
}
