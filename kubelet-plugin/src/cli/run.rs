//! [`Args::run`]: the plugin's start-up, which wires the layers as `lib.rs` draws them, and its shutdown.

use std::{
    net::SocketAddr,
    path::Path,
    sync::{Arc, OnceLock},
    time::Duration,
};

use tokio::{
    signal::unix::{SignalKind, signal},
    sync::watch,
    task::JoinHandle,
};
use tracing::{info, warn};

use crate::cli::args::{Args, Command};
use crate::cli::backend::{BackendKind, DriverWatchSetup};
use crate::cli::driver_upgrade::UpgradeSetup;
use crate::cli::error::{Error, Result};
use crate::cli::take_over::NodeSetup;
use crate::gpu::driver_root::DriverRoot;
use crate::gpu::driver_upgrade::ReleaseReason;
use crate::gpu::driver_watch::DriverChange;
use crate::gpu::health::Health;
use crate::kubelet::driver;
use crate::kubelet::driver::{DriverReleased, SocketPaths};
use crate::kubelet::health_service::HealthService;
use crate::kubelet::inventory::LeaseConfig;
use crate::kubelet::registration::RegistrationState;
use crate::node::state::{NodeState, StateLock};

impl Args {
    /// Runs the plugin (or the `discover` subcommand) until SIGTERM or SIGINT.
    pub async fn run(self) -> Result<()> {
        // Every layer's events count from here on.
        crate::metrics::sink::install(crate::metrics::prometheus::metrics());
        let Self {
            command,
            node_name,
            backend,
            state_dir,
            kubelet_registry_dir,
            kubelet_plugins_dir,
            pod_uid,
            cdi_dir,
            cdi_hook,
            cdi_hook_features,
            cdi_hook_dir,
            driver_params_mask_dir,
            mps_supervisor_socket,
            kubeconfig,
            heartbeat_interval,
            lease_namespace,
            controller_lease,
            health_addr,
            boot_id_file,
            ignored_xids,
            coexistence,
            host_proc,
            driver_watch_interval,
            release_for_driver_upgrades,
            device_metadata,
            log_format: _,
        } = self;
        if let Some(command) = command {
            return command.run();
        }

        // This instance: its node, its sockets' names, how it is stopped, and kubelet's probes.
        let node_name = node_name.ok_or(Error::MissingNodeName)?;
        // Before NVML is opened: it reads the params when it loads.
        if let Some(dir) = &driver_params_mask_dir {
            crate::cli::driver_params::mask(dir)?;
        }
        let pod_uid = pod_uid.map(checked_pod_uid).transpose()?;
        let paths = SocketPaths::for_pod(&kubelet_registry_dir, &kubelet_plugins_dir, pod_uid.as_deref());
        let holder = match &pod_uid {
            Some(uid) => format!("pod {uid} (pid {})", std::process::id()),
            None => format!("pid {}", std::process::id()),
        };
        let (stop_tx, stop_rx) = watch::channel(false);
        let driver_change = Arc::new(OnceLock::new());
        let released = Arc::new(OnceLock::new());
        stop_on_signals(stop_tx.clone())?;
        let (registration_tx, registration_rx) = watch::channel(RegistrationState::Pending);
        if let Some(addr) = health_addr {
            serve_probes(addr, registration_rx.clone()).await?;
        }

        // With the fixed socket names there is one instance per node: it owns the state before it binds,
        // so a second one started by mistake waits instead of taking over the first one's sockets. With
        // names of its own, the new pod of a rolling update serves (and gets registered) first and takes the
        // state over once the old pod, stopped because this one is ready, has exited (state/handover.rs).
        let mut lock = None;
        if pod_uid.is_none() {
            match StateLock::acquire(&state_dir, &holder, stop_rx.clone()).await? {
                Some(l) => lock = Some(l),
                None => return Ok(()),
            }
        }
        // kubelet: its sockets serve before the node state is owned; their calls wait at the gate.
        let KubeletSockets {
            gate,
            mut serving,
            health,
            health_service,
            driver_released,
        } = KubeletSockets::serve(&paths, &state_dir, &node_name, registration_tx, &stop_rx);
        if pod_uid.is_some() {
            wait_for_fixed_name_instance(&paths, stop_rx.clone()).await;
            // A socket that cannot be bound ends the serving task: report it now, not after a handover.
            tokio::select! {
                acquired = StateLock::acquire(&state_dir, &holder, stop_rx.clone()) => lock = acquired?,
                served = &mut serving => return Ok(served.unwrap_or(Ok(()))?),
            }
        }

        // The node, once owned: GPUs, node state with preparers, then health, metrics and the inventory
        // (take_over.rs).
        let upgrade_client = match release_for_driver_upgrades && backend.backend == BackendKind::Nvml {
            true => crate::cli::take_over::kube_client(kubeconfig.as_deref())
                .await
                .inspect_err(|e| warn!(error = %e, "no API server client: driver upgrades go unwatched"))
                .ok(),
            false => None,
        };
        let upgrade = upgrade_client.map(|client| UpgradeSetup {
            node_name: node_name.clone(),
            client,
            supervisor: mps_supervisor_socket.clone(),
            driver_root: DriverRoot::mounted(&backend.driver_root, backend.read_root()),
            proc_root: crate::gpu::nvml::proc_root_for(backend.read_root()),
            released: released.clone(),
            stop: stop_tx.clone(),
        });
        // Under a driver upgrade the driver is not opened until it moves on (driver_upgrade.rs).
        let held = match (&lock, &upgrade) {
            (Some(_), Some(u)) => u.hold_while_released(&driver_released, stop_rx.clone()).await,
            _ => true,
        };
        let owned = match lock.as_ref().filter(|_| held) {
            Some(_) => {
                let setup = NodeSetup {
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
                    leases: LeaseConfig {
                        namespace: lease_namespace,
                        controller_lease,
                    },
                    boot_id_file,
                    health,
                    health_service,
                    ignored_xids,
                    coexistence,
                    host_proc,
                    device_metadata,
                    driver_watch: DriverWatchSetup {
                        interval: Duration::from_secs(driver_watch_interval),
                        change: driver_change.clone(),
                        stop: stop_tx.clone(),
                    },
                    upgrade,
                };
                setup.take_over(gate, registration_rx, stop_rx.clone()).await
            }
            // Stopped while waiting for the old instance: nothing of the node was touched, and the calls
            // waiting at the gate fail at once.
            None => {
                drop(gate);
                Ok(Vec::new())
            }
        };

        shut_down(owned, serving, stop_tx, lock, &driver_change, &released).await
    }
}

impl Command {
    /// Runs a subcommand to its end.
    fn run(self) -> Result<()> {
        match self {
            Command::Discover(args) => args.run(),
            Command::MpsControlSim(args) => args.run(),
            Command::MpsSupervisor(args) => args.run(),
            #[cfg(feature = "simulated")]
            Command::Simulate(args) => args.run(),
            Command::WaitForDriver(args) => args.run(),
        }
    }
}

/// A pod UID as the downward API gives it; refused otherwise, as it becomes part of socket file names.
fn checked_pod_uid(uid: String) -> Result<String> {
    let valid =
        !uid.is_empty() && uid.len() <= 64 && uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
    if valid {
        Ok(uid)
    } else {
        Err(Error::InvalidPodUid { uid })
    }
}

/// Turns `stop` true on SIGTERM or SIGINT.
fn stop_on_signals(stop: watch::Sender<bool>) -> Result<()> {
    let mut sigterm = signal(SignalKind::terminate()).map_err(Error::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(Error::Signals)?;
    tokio::spawn(async move {
        tokio::select! {
            _ = sigterm.recv() => info!("received SIGTERM"),
            _ = sigint.recv() => info!("received SIGINT"),
        }
        stop.send_replace(true);
    });
    Ok(())
}

/// Serves kubelet's probes and the metrics at `addr` (`--health-addr`).
async fn serve_probes(addr: SocketAddr, registration: watch::Receiver<RegistrationState>) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::BindHealth { addr, source })?;
    info!(%addr, "health probes and metrics: GET /livez, /readyz, /metrics");
    tokio::spawn(tessera_api::health::serve_with_metrics(
        listener,
        health_checks(registration),
        Some(Arc::new(|| crate::metrics::prometheus::metrics().render())),
    ));
    Ok(())
}

/// Live while the runtime answers; ready once kubelet has registered the plugin, so a rolling update
/// (maxSurge) stops the old pod only after the new one serves.
fn health_checks(registration: watch::Receiver<RegistrationState>) -> tessera_api::health::Checks {
    tessera_api::health::Checks {
        live: Arc::new(|| Ok(())),
        ready: Arc::new(move || match &*registration.borrow() {
            RegistrationState::Registered => Ok(()),
            RegistrationState::Pending => Err("waiting for kubelet to register the plugin".into()),
            RegistrationState::Failed(reason) => Err(format!("kubelet rejected the plugin: {reason}")),
        }),
    }
}

/// kubelet's sockets (registration, DRA and device health), served before the node state is owned: its
/// calls wait at the gate until the state is sent through `gate`.
struct KubeletSockets {
    gate: watch::Sender<Option<Arc<NodeState>>>,
    serving: JoinHandle<crate::kubelet::error::Result<()>>,
    health: Arc<Health>,
    health_service: HealthService,
    driver_released: DriverReleased,
}

impl KubeletSockets {
    /// Removes the sockets of killed instances and serves this one's until `stop` turns true.
    fn serve(
        paths: &SocketPaths,
        state_dir: &Path,
        node_name: &str,
        registration: watch::Sender<RegistrationState>,
        stop: &watch::Receiver<bool>,
    ) -> Self {
        for path in driver::remove_stale_sockets(paths) {
            info!(socket = %path.display(), "cleaned up after a plugin instance that was killed");
        }
        let (gate_tx, gate) = driver::StateGate::closed(StateLock::path_in(state_dir));
        let driver_released = gate.released();
        // Served from the start like the DRA service; it reports devices once the state is owned.
        let health = Health::new(std::iter::empty());
        let health_service = HealthService::new(health.clone(), node_name.to_string());
        let serving = {
            let (paths, mut stopped) = (paths.clone(), stop.clone());
            let health_service = health_service.clone();
            tokio::spawn(async move {
                driver::serve_gated(&paths, gate, registration, Some(health_service), async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
            })
        };
        Self {
            gate: gate_tx,
            serving,
            health,
            health_service,
            driver_released,
        }
    }
}

/// Waits while a plugin without a pod UID (a version from before per-pod socket names) serves on this
/// node: it takes no state lock, so the new pod must not load the state before that one is gone.
async fn wait_for_fixed_name_instance(paths: &SocketPaths, mut stop: watch::Receiver<bool>) {
    let fixed = paths.fixed_registration();
    let mut logged = false;
    while driver::socket_is_live(&fixed) {
        if !logged {
            info!(socket = %fixed.display(), "a plugin instance without per-pod socket names serves on this \
                node; waiting for it to exit before taking over the node state");
            logged = true;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// Waits for kubelet's sockets to close (on a signal or a driver change; at once after a failed take-over),
/// then stops the node's tasks and waits for them, and lets the state lock go last. After a driver change
/// the result is [`Error::DriverChanged`].
async fn shut_down(
    owned: Result<Vec<JoinHandle<()>>>,
    serving: JoinHandle<crate::kubelet::error::Result<()>>,
    stop: watch::Sender<bool>,
    lock: Option<StateLock>,
    driver_change: &OnceLock<DriverChange>,
    released: &OnceLock<ReleaseReason>,
) -> Result<()> {
    if owned.is_err() {
        stop.send_replace(true);
    }
    let served = serving.await.unwrap_or_else(|e| {
        warn!(error = %e, "the kubelet sockets' task ended abnormally");
        Ok(())
    });
    // Also on a serve error, so the inventory is marked not ready before exiting.
    stop.send_replace(true);
    for task in owned? {
        if let Err(e) = task.await {
            warn!(error = %e, "a background task ended abnormally");
        }
    }
    // The lock goes last: the calls in flight and the reconcile have finished, so the next instance
    // loads a checkpoint nothing changes any more.
    drop(lock);
    if let Some(reason) = released.get() {
        return Err(Error::ReleasedForDriverUpgrade {
            label: reason.describe(),
        });
    }
    if let Some(change) = driver_change.get() {
        return Err(Error::DriverChanged {
            from: change.from.clone(),
            to: change.to.clone(),
        });
    }
    Ok(served?)
}
