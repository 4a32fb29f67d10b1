//! The plugin's part in a GPU Operator driver upgrade (`gpu::driver_upgrade` decides from the Node's labels,
//! `kubelet::upgrade_watch` watches them): let go of the driver when the Node asks, wait without it, come
//! back on the driver that is there then.
//!
//! **Letting go.** The serving plugin watches its Node. On a release signal it asks the MPS supervisor to
//! stop its daemons (`pause`: their settings are kept), writes why to its termination message, stops
//! serving and exits with [`crate::gpu::driver_upgrade::RELEASED_EXIT_CODE`]: a process that exits holds no NVML session and no
//! `/dev/nvidia*` file, whatever NVML, its event sets and the health thread had open, which no
//! in-process teardown could promise as surely.
//!
//! **Waiting.** kubelet restarts the container at once. The new process reads its Node before it opens
//! NVML; while the Node still asks for the release it serves kubelet's sockets (so it stays registered) but
//! answers every call with the upgrade's message, which kubelet retries, and opens nothing of the driver.
//!
//! **Coming back.** Once the labels move on it waits for the driver to be installed (its library and a
//! loaded module, as `wait-for-driver` does), asks the supervisor to `resume` (its daemons start again with
//! their settings on the new driver), and takes the node over as at any start: NVML of the new driver, new
//! CDI specs naming its libraries, prepared claims from the checkpoint.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
    time::Duration,
};

use tokio::{sync::watch, task::JoinHandle};
use tracing::{info, warn};

use crate::devices::sharing::supervisor_protocol;
use crate::gpu::driver_root::DriverRoot;
use crate::gpu::driver_upgrade::{ReleaseReason, UpgradeSignal};
use crate::gpu::driver_watch::DriverPresence;
use crate::kubelet::driver::DriverReleased;

/// How often the driver root is read while waiting for the new driver.
const DRIVER_POLL: Duration = Duration::from_secs(1);
/// How often an unreachable MPS supervisor is asked again to resume its daemons.
const RESUME_RETRY: Duration = Duration::from_secs(2);

/// What the plugin needs to take part in driver upgrades (nvml backend, `--release-for-driver-upgrades`).
#[derive(Clone)]
pub(super) struct UpgradeSetup {
    pub(super) node_name: String,
    pub(super) client: kube::Client,
    /// The MPS supervisor's socket, when daemons are the supervisor's.
    pub(super) supervisor: Option<PathBuf>,
    /// The driver root as this process reads it, and the kernel's `/proc` for it.
    pub(super) driver_root: DriverRoot,
    pub(super) proc_root: PathBuf,
    /// Set by the watch when the plugin let go; [`crate::cli::args::Args::run`] then returns
    /// [`crate::cli::error::Error::ReleasedForDriverUpgrade`].
    pub(super) released: Arc<OnceLock<ReleaseReason>>,
    pub(super) stop: watch::Sender<bool>,
}

impl UpgradeSetup {
    /// At start, before NVML is opened: while the Node asks for the driver to be released, waits without
    /// it (the calls at the gate fail with the upgrade's message), then for the driver, and then resumes
    /// the supervisor's daemons. Returns false when stopped meanwhile.
    pub(super) async fn hold_while_released(
        &self,
        gate: &DriverReleased,
        stop: watch::Receiver<bool>,
    ) -> bool {
        if let Some(UpgradeSignal::Release(reason)) =
            crate::kubelet::upgrade_watch::current_signal(self.client.clone(), &self.node_name).await
        {
            warn!(label = %reason.describe(), "the node's NVIDIA driver is being upgraded: waiting without the \
                driver (no NVML, no MPS daemons) until the upgrade moves on; prepares fail meanwhile and are retried");
            gate.set(Some(reason.prepare_refusal()));
            self.pause_supervisor(&reason).await;
            let back = crate::kubelet::upgrade_watch::wait_for_come_back(
                self.client.clone(),
                self.node_name.clone(),
                reason,
                stop.clone(),
            )
            .await;
            if !back || !self.wait_for_driver(stop.clone()).await {
                return false;
            }
            gate.set(None);
        }
        self.spawn_resume(stop);
        true
    }

    /// While serving: watches the Node and lets go of the driver when it asks (see the module comment).
    pub(super) fn spawn_watch(self, stop: watch::Receiver<bool>) -> JoinHandle<()> {
        tokio::spawn(async move {
            let Some(reason) = crate::kubelet::upgrade_watch::wait_for_release(
                self.client.clone(),
                self.node_name.clone(),
                stop,
            )
            .await
            else {
                return;
            };
            let message = format!(
                "the node's NVIDIA driver is being upgraded ({}): releasing the driver so that its kernel module \
                 can be unloaded (MPS daemons stopped with their settings kept, NVML closed by exiting); the \
                 restarted plugin waits without the driver until the upgrade moves on",
                reason.describe()
            );
            warn!("{message}");
            self.pause_supervisor(&reason).await;
            crate::gpu::driver_watch::write_termination_message(
                Path::new(crate::gpu::driver_watch::TERMINATION_LOG),
                &message,
            );
            let _ = self.released.set(reason);
            self.stop.send_replace(true);
        })
    }

    /// Asks the supervisor to stop its daemons, keeping their settings; logged when it cannot.
    async fn pause_supervisor(&self, reason: &ReleaseReason) {
        let Some(socket) = self.supervisor.clone() else {
            return;
        };
        let reason = reason.describe();
        match tokio::task::spawn_blocking(move || supervisor_protocol::pause(&socket, &reason)).await {
            Ok(Ok(keys)) => info!(daemons = ?keys, "the MPS supervisor stopped its daemons for the upgrade"),
            Ok(Err(e)) => {
                warn!(error = %e, "cannot stop the MPS supervisor's daemons for the driver upgrade; \
                they keep the driver in use")
            }
            Err(e) => warn!(error = %e, "the request to the MPS supervisor ended abnormally"),
        }
    }

    /// Asks the supervisor, until it answers, to start the daemons a pause stopped (none is a no-op).
    fn spawn_resume(&self, mut stop: watch::Receiver<bool>) {
        let Some(socket) = self.supervisor.clone() else {
            return;
        };
        tokio::spawn(async move {
            loop {
                let s = socket.clone();
                match tokio::task::spawn_blocking(move || supervisor_protocol::resume(&s)).await {
                    Ok(Ok(keys)) => {
                        if !keys.is_empty() {
                            info!(daemons = ?keys, "the MPS supervisor's daemons serve on this driver");
                        }
                        return;
                    }
                    Ok(Err(e)) => info!(error = %e, "the MPS supervisor is not reachable yet; asking again"),
                    Err(_) => return,
                }
                tokio::select! {
                    _ = tokio::time::sleep(RESUME_RETRY) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        });
    }

    /// Waits until the driver root holds the driver's library and its module is loaded; false when
    /// stopped first.
    async fn wait_for_driver(&self, mut stop: watch::Receiver<bool>) -> bool {
        let mut last = String::new();
        loop {
            let (root, proc_root) = (self.driver_root.clone(), self.proc_root.clone());
            if let Ok(found) =
                tokio::task::spawn_blocking(move || DriverPresence::check(&root, &proc_root)).await
            {
                if found.ready() {
                    info!(
                        version = found.kernel.as_deref().unwrap_or("?"),
                        "the driver upgrade moved on and the driver is installed: loading it"
                    );
                    return true;
                }
                let missing = found.missing();
                if missing != last {
                    info!("the driver upgrade moved on; waiting for the new driver: {missing}");
                    last = missing;
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(DRIVER_POLL) => {}
                _ = stop.wait_for(|s| *s) => return false,
            }
        }
    }
}
