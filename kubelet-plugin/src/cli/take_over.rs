//! Taking the node over once its state is owned: GPUs, node state with preparers, health, metrics, inventory.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use tessera_api::NodeInventorySpec;
use tokio::{sync::watch, task::JoinHandle};
use tracing::{info, warn};

use crate::cli::backend::{BackendArgs, BackendKind, DriverWatchSetup};
use crate::cli::error::{Error, Result};
use crate::devices::preparers;
use crate::devices::preparers::SharedPreparer;
use crate::devices::sharing::Sharer;
use crate::devices::sharing::mps::MpsManager;
use crate::gpu::driver_root::{CdiHook, DriverFiles, DriverRoot, HookFeature};
use crate::gpu::health::Health;
use crate::gpu::{GpuBackend, UnusableGpu};
use crate::kubelet::claims::KubeClaims;
use crate::kubelet::coexistence::{CoexistenceMode, SharedCondition, Verdict};
use crate::kubelet::health_service::HealthService;
use crate::kubelet::inventory::{InventoryPublisher, LeaseConfig};
use crate::kubelet::registration::RegistrationState;
use crate::node::state::{ClaimRef, NodeState, RECONCILE_INTERVAL, StateConfig};

/// What the plugin needs to load the node state, once it owns it.
pub(super) struct NodeSetup {
    pub(super) node_name: String,
    pub(super) backend: BackendArgs,
    pub(super) state_dir: PathBuf,
    pub(super) cdi_dir: PathBuf,
    pub(super) cdi_hook: Option<PathBuf>,
    pub(super) cdi_hook_features: Vec<HookFeature>,
    pub(super) cdi_hook_dir: Option<PathBuf>,
    pub(super) mps_supervisor_socket: Option<PathBuf>,
    pub(super) kubeconfig: Option<PathBuf>,
    pub(super) heartbeat_interval: u64,
    pub(super) leases: LeaseConfig,
    pub(super) boot_id_file: PathBuf,
    pub(super) health: Arc<Health>,
    pub(super) health_service: HealthService,
    pub(super) ignored_xids: Vec<u32>,
    pub(super) coexistence: CoexistenceMode,
    pub(super) host_proc: PathBuf,
    pub(super) device_metadata: bool,
    pub(super) driver_watch: DriverWatchSetup,
    /// The watch of the Node for a GPU Operator driver upgrade, when on.
    pub(super) upgrade: Option<crate::cli::driver_upgrade::UpgradeSetup>,
}

impl NodeSetup {
    /// Discovers the GPUs, loads and recovers the checkpoint, opens the gate for kubelet's calls and starts
    /// the inventory publisher and the periodic reconcile; returns their tasks, which end on `stop`.
    pub(super) async fn take_over(
        self,
        gate: watch::Sender<Option<Arc<NodeState>>>,
        registration_rx: watch::Receiver<RegistrationState>,
        stop_rx: watch::Receiver<bool>,
    ) -> Result<Vec<JoinHandle<()>>> {
        let Self {
            node_name,
            backend,
            state_dir,
            cdi_dir,
            cdi_hook,
            cdi_hook_features,
            cdi_hook_dir,
            mps_supervisor_socket,
            kubeconfig,
            heartbeat_interval,
            leases,
            boot_id_file,
            health,
            health_service,
            ignored_xids,
            coexistence,
            host_proc,
            device_metadata,
            driver_watch,
            upgrade,
        } = self;
        // The hardware: the GPUs, and a watch of the driver under them.
        let (gpu_backend, mut spec, unusable) = discover_gpus(&backend, &node_name, &state_dir)?;
        let driver_watcher = driver_watch.spawn(&backend, spec.driver_version.clone(), stop_rx.clone());
        let upgrade_watcher = upgrade.map(|u| u.spawn_watch(stop_rx.clone()));
        for u in &unusable {
            warn!(gpu = u.index, reason = %u.reason, "a GPU is left out of the inventory");
        }
        let boot_id = read_boot_id(&boot_id_file)?;
        let client = kube_client(kubeconfig.as_deref()).await?;
        // Another GPU manager on the node decides which GPUs are served and published (coexistence.rs).
        let verdict = crate::kubelet::coexistence::read_and_decide(&client, &node_name, coexistence).await;
        crate::kubelet::coexistence::log(&verdict);
        let served_gpus = verdict.served_gpus(&spec.gpus);
        spec.gpus = verdict.published_gpus(&spec.gpus);

        // The devices: MPS and time-sliced sharing, and the driver files every container gets.
        let sharer = Sharer::new(
            gpu_backend.clone(),
            MpsManager::new(&state_dir, backend.mps_launcher(mps_supervisor_socket.clone())?),
            // Clients share the host's /dev/shm with daemons the plugin starts itself on real GPUs; a
            // supervisor gives each daemon its own.
            backend.backend == BackendKind::Nvml && mps_supervisor_socket.is_none(),
        );
        let driver_root = backend.driver_root_of(gpu_backend.as_ref());
        let hook = cdi_hook_of(
            cdi_hook,
            &cdi_hook_features,
            cdi_hook_dir.unwrap_or_else(|| state_dir.join("bin")),
            // The host's /proc shows the hook directory's host mount; a process's own /proc is the host's
            // when the plugin runs on the host itself.
            Some(host_proc.as_path()),
        )?;
        // The params file of a loaded NVIDIA module; a simulated driver has none, whatever the machine has.
        let driver_params = backend.backend == BackendKind::Nvml
            && Path::new(tessera_cdi_hook::params::DRIVER_PARAMS).exists();
        let files = driver_files(&driver_root, spec.driver_version.as_deref(), hook)
            .with_driver_params(driver_params);
        let shared = Arc::new(SharedPreparer::new(Arc::new(sharer), files));
        let mps_daemons = MpsManager::new(&state_dir, backend.mps_launcher(mps_supervisor_socket)?);

        // The node state over the served GPUs, with every device kind's preparer; kubelet's calls wait
        // at the gate until its checkpoint is recovered.
        let usage_backend = gpu_backend.clone();
        let metadata_dir = device_metadata.then(|| state_dir.join("device-metadata"));
        let state = NodeState::new(
            StateConfig {
                node_name: node_name.clone(),
                boot_id,
                state_dir: state_dir.clone(),
                cdi_dir,
            },
            gpu_backend,
            served_gpus,
            Arc::new(KubeClaims::new(client.clone())),
        );
        let (state, failed_rx) = with_options_and_preparers(state, metadata_dir, &spec, &verdict, &shared);
        // Recovery asks the API server which claims running pods use before anything is removed.
        let state = Arc::new(state);
        let recovery = state.start().await?;
        info!(?recovery, "loaded the checkpoint");
        gate.send_replace(Some(state.clone()));

        // Health and metrics.
        health.set_gpus(spec.gpus.iter().map(|g| g.index));
        health_service.set_devices(reported_devices(state.clone()));
        register_metrics(&state, usage_backend, mps_daemons, &health, &host_proc);
        let gpu_count = spec.gpus.iter().map(|g| g.index + 1).max().unwrap_or(0);
        let source = backend.health_source(&state_dir, gpu_count, ignored_xids)?;
        crate::gpu::health::spawn_monitor(source, health.clone(), mig_map(state.clone()), stop_rx.clone())
            .map_err(Error::HealthMonitor)?;

        // The API server: the coexistence condition, prepare retries, the inventory and its Lease, and
        // the MPS daemons' pod events.
        let condition: SharedCondition = Arc::new(std::sync::Mutex::new(
            crate::kubelet::coexistence::next_condition(None, &verdict, k8s_openapi::jiff::Timestamp::now()),
        ));
        let recheck = tokio::spawn(crate::kubelet::coexistence::recheck(
            client.clone(),
            node_name.clone(),
            coexistence,
            verdict,
            condition.clone(),
            stop_rx.clone(),
        ));
        // kubelet does not back off and retry a prepare that failed while the plugin was away; see
        // prepare_retry.
        let retry = tokio::spawn(crate::kubelet::prepare_retry::after_each_registration(
            client.clone(),
            state.clone(),
            tessera_api::DRIVER_NAME.to_string(),
            registration_rx.clone(),
            stop_rx.clone(),
        ));
        // Nor one this plugin failed for a cause that passes (the MPS supervisor's pod replaced).
        let retry_failed = tokio::spawn(crate::kubelet::prepare_retry::after_failed_prepares(
            client.clone(),
            state.clone(),
            tessera_api::DRIVER_NAME.to_string(),
            failed_rx,
            stop_rx.clone(),
        ));
        let (event_client, spec_gpus) = (client.clone(), spec.gpus.clone());
        let publisher = InventoryPublisher::new(
            client,
            spec,
            Duration::from_secs(heartbeat_interval),
            registration_rx,
        )
        .with_problem_source(problems(state.clone(), shared.clone()))
        .with_condition_source(Arc::new(move || {
            vec![condition.lock().unwrap_or_else(|e| e.into_inner()).clone()]
        }))
        .with_health(health)
        .with_leases(leases);
        let publisher = tokio::spawn(publisher.run(stop_rx.clone()));
        let watch = tokio::spawn(crate::kubelet::mps_events::watch_and_report(
            shared.sharer.clone(),
            state.clone(),
            Some(crate::kubelet::mps_events::DaemonEvents::new(
                event_client,
                &node_name,
            )),
            spec_gpus,
            crate::devices::sharing::DAEMON_WATCH_INTERVAL,
            stop_rx.clone(),
        ));

        // The node state's own upkeep: warm partitions expire, and the periodic reconcile.
        let warm = tokio::spawn(
            state
                .clone()
                .expire_warm_periodically(crate::node::warm::WARM_SWEEP_INTERVAL, stop_rx.clone()),
        );
        let reconcile = tokio::spawn(state.reconcile_periodically(RECONCILE_INTERVAL, stop_rx));
        Ok([publisher, reconcile, warm, watch, recheck, retry, retry_failed]
            .into_iter()
            .chain(driver_watcher)
            .chain(upgrade_watcher)
            .collect())
    }
}

/// Opens the backend and discovers the node's GPUs: the NodeInventory spec, and the GPUs left out of it.
fn discover_gpus(
    backend: &BackendArgs,
    node_name: &str,
    state_dir: &Path,
) -> Result<(Arc<dyn GpuBackend>, NodeInventorySpec, Vec<UnusableGpu>)> {
    backend.ensure_uvm_nodes();
    let gpu_backend = backend.open(node_name, state_dir)?;
    let discovered = gpu_backend.discover().map_err(|source| Error::Discover {
        backend: gpu_backend.name(),
        source,
    })?;
    let spec = NodeInventorySpec {
        node_name: node_name.to_string(),
        backend: gpu_backend.name().to_string(),
        driver_version: discovered.driver_version,
        cuda_driver_version: discovered.cuda_driver_version,
        gpus: discovered.gpus,
    };
    info!(node = %node_name, backend = gpu_backend.name(), gpus = spec.gpus.len(), "discovered GPUs");
    Ok((gpu_backend, spec, discovered.unusable))
}

/// The node's boot id; a checkpoint written under another one is discarded.
fn read_boot_id(boot_id_file: &Path) -> Result<String> {
    Ok(std::fs::read_to_string(boot_id_file)
        .map_err(|source| Error::ReadBootId {
            path: boot_id_file.to_path_buf(),
            source,
        })?
        .trim()
        .to_string())
}

/// A client from the kubeconfig file, or the in-cluster configuration. Connecting is lazy: an unreachable
/// API server shows up as failed requests (retried), not as a failed start.
pub(super) async fn kube_client(kubeconfig: Option<&Path>) -> Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).map_err(|e| Error::KubeConfig(Box::new(e)))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| Error::KubeConfig(Box::new(e)))?
        }
        None => kube::Config::incluster().map_err(|e| Error::KubeConfig(Box::new(e)))?,
    };
    kube::Client::try_from(config).map_err(|e| Error::KubeClient(Box::new(e)))
}

/// The hook the specs call: NVIDIA's at `nvidia` when given, else tessera's own, installed into `dir` from
/// next to this executable. Without a shipped hook (a build without the `tessera-cdi-hook` crate) the specs
/// carry mounts only, which the log says.
fn cdi_hook_of(
    nvidia: Option<PathBuf>,
    nvidia_features: &[HookFeature],
    dir: PathBuf,
    host_proc: Option<&Path>,
) -> Result<Option<CdiHook>> {
    if let Some(path) = nvidia {
        return Ok(Some(CdiHook::nvidia(path, nvidia_features)));
    }
    let Some(source) = crate::node::cdi::shipped_hook() else {
        warn!(looked_next_to = ?std::env::current_exe().ok(),
            "tessera-cdi-hook is not shipped next to this binary: containers get no ld.so.cache update, no \
             libcuda.so link and no CUDA compat; build it (cargo build -p tessera-cdi-hook) or set --cdi-hook");
        return Ok(None);
    };
    let path = crate::node::cdi::install_hook(&source, &dir)?;
    // As the runtime will run it: a hook on a noexec mount would fail every container, not this process.
    crate::node::cdi::check_hook_runs(&path, host_proc)?;
    info!(hook = %path.display(), from = %source.display(), "installed the CDI hook on the host");
    Ok(Some(CdiHook::tessera(path)))
}

/// The driver's libraries and binaries under `driver_root` that every container gets, with the hook the
/// specs call; none found is logged, as containers then see GPUs but cannot load CUDA.
fn driver_files(
    driver_root: &DriverRoot,
    driver_version: Option<&str>,
    hook: Option<CdiHook>,
) -> DriverFiles {
    let files = DriverFiles::discover(driver_root, driver_version).with_hook(hook);
    info!(
        driver_root = %driver_root.host_path().display(),
        read_at = %driver_root.path().display(),
        libraries = files.libraries.len(),
        binaries = files.binaries.len(),
        hook = ?files.hook.as_ref().map(|h| &h.path),
        "found the driver files every container gets"
    );
    if files.libraries.is_empty() {
        warn!(driver_root = %driver_root.host_path().display(), read_at = %driver_root.path().display(),
            "no driver libraries found under the driver root: containers will see GPUs but not load CUDA; \
             set --driver-root to the host directory that holds the driver (e.g. /run/nvidia/driver) and \
             --container-driver-root to where this process has it mounted");
    }
    files
}

/// The node state with device metadata (under `metadata_dir`, when on), unowned MIG devices kept where the
/// verdict says so, every device kind's preparer and the sweep of orphaned MPS daemons; failed prepares
/// are reported on the returned channel.
fn with_options_and_preparers(
    state: NodeState,
    metadata_dir: Option<PathBuf>,
    spec: &NodeInventorySpec,
    verdict: &Verdict,
    shared: &Arc<SharedPreparer>,
) -> (NodeState, tokio::sync::mpsc::UnboundedReceiver<ClaimRef>) {
    let state = match metadata_dir {
        Some(dir) => {
            state.with_device_metadata(dir, spec.driver_version.clone(), spec.cuda_driver_version.clone())
        }
        None => state,
    };
    let state = match verdict.keep_unowned_mig {
        true => state.keeping_unowned_mig(verdict.summary().2),
        false => state,
    };
    let sweep = shared.clone();
    let state = preparers::with_preparers(state, shared)
        .with_orphan_sweep(Arc::new(move |gpus| sweep.stop_orphaned_daemons(gpus)));
    let (failed_tx, failed_rx) = tokio::sync::mpsc::unbounded_channel();
    (state.reporting_failed_prepares(failed_tx), failed_rx)
}

/// Registers the node's gauges (claims from the committed checkpoint, usage, MPS daemons, health) with the
/// Prometheus registry; a `--host-proc` without processes is logged, as shares' usage then reads 0.
fn register_metrics(
    state: &Arc<NodeState>,
    usage_backend: Arc<dyn GpuBackend>,
    mps_daemons: MpsManager,
    health: &Arc<Health>,
    host_proc: &Path,
) {
    if !tessera_gpu_api::usage::HostProc::new(host_proc).looks_like_proc() {
        warn!(host_proc = %host_proc.display(), "--host-proc shows no processes: shares' usage gauges \
            will read 0; mount the host's /proc there read-only (the chart does, at /host/proc)");
    }
    let committed = state.clone();
    crate::metrics::prometheus::metrics().register_node(
        crate::metrics::prometheus::NodeCollector::new(
            Arc::new(move || committed.checkpoint()),
            usage_backend,
            Some(mps_daemons),
        )
        .with_health(health.clone())
        .with_host_proc(tessera_gpu_api::usage::HostProc::new(host_proc)),
    );
}

/// The problems the inventory reports: the node state's, and the MPS daemons that are down.
fn problems(state: Arc<NodeState>, shared: Arc<SharedPreparer>) -> crate::kubelet::inventory::Problems {
    Arc::new(move || {
        let mut problems = state.problems();
        problems.extend(crate::devices::sharing::daemons_down_problems(
            &shared.sharer.daemons_down(),
        ));
        problems
    })
}

/// The devices kubelet may ask the health of: every whole GPU and every device of a prepared claim.
fn reported_devices(state: Arc<NodeState>) -> crate::kubelet::health_service::DeviceList {
    Arc::new(move || {
        let mut names: Vec<String> = state.gpus().map(|g| format!("gpu-{}", g.index)).collect();
        for claim in state.checkpoint().claims.values() {
            if claim.phase == crate::node::checkpoint::Phase::PrepareCompleted {
                names.extend(claim.devices.iter().map(|d| d.device.clone()));
            }
        }
        names
    })
}

/// The MIG device behind a GPU instance, from the prepared claims: NVML attributes a MIG device's events
/// to its parent GPU and GPU-instance id.
fn mig_map(state: Arc<NodeState>) -> crate::gpu::health::MigMap {
    Arc::new(move |gpu, gpu_instance| {
        state.checkpoint().claims.values().find_map(|claim| {
            claim.devices.iter().find_map(|d| match &d.detail {
                crate::node::checkpoint::DeviceDetail::Mig(m)
                    if m.gpu == gpu && m.gpu_instance == Some(gpu_instance) =>
                {
                    Some(tessera_api::inventory::MigDeviceRef {
                        profile: m.profile.clone(),
                        start: m.placement.start,
                    })
                }
                _ => None,
            })
        })
    })
}
