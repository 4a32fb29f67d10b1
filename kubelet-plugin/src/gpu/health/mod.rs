//! Device health: what NVML (or the simulated backend) says about the node's GPUs, kept as
//! [`model::HealthModel`] and published twice.
//!
//! ```text
//!  HealthSource (a blocking thread: NVML events + probe, or the simulated fault file)
//!        │ Observation
//!        ▼
//!  [`Health`] ──▶ NodeInventory.status.health   (the controller taints the devices)
//!             └─▶ DRAResourceHealth stream      ([`crate::kubelet::health_service`]: kubelet sets the pod's allocatedResourcesStatus)
//! ```

pub mod model;
pub mod sources;
pub mod xid;

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::jiff::Timestamp;
use tessera_api::{
    DeviceName,
    inventory::{DeviceHealth, HealthReason, MigDeviceRef},
};
use tokio::sync::watch;
use tracing::{info, warn};

pub use model::{Failure, HealthModel, Observation};

/// How long one [`HealthSource::poll`] may block, so a stop request is noticed within about a second.
pub const POLL_TIMEOUT: Duration = Duration::from_secs(1);

/// Where observations come from. Runs on a thread of its own: NVML's event wait blocks.
pub trait HealthSource: Send + 'static {
    /// Waits at most `timeout` and returns what was seen meanwhile (nothing is fine).
    fn poll(&mut self, timeout: Duration) -> Vec<Observation>;
}

/// Maps `(gpu, gpu instance)` to the MIG device a prepared claim holds there.
pub type MigMap = Arc<dyn Fn(u32, u32) -> Option<MigDeviceRef> + Send + Sync>;

/// The node's device health, shared by the monitor thread, the inventory publisher and the health
/// stream. Every change bumps a version on a watch channel.
pub struct Health {
    model: Mutex<HealthModel>,
    version: watch::Sender<u64>,
}

impl Health {
    /// Every GPU in `gpus` healthy.
    pub fn new(gpus: impl IntoIterator<Item = u32>) -> Arc<Self> {
        Arc::new(Self {
            model: Mutex::new(HealthModel::new(gpus, Timestamp::now())),
            version: watch::Sender::new(0),
        })
    }

    fn model(&self) -> std::sync::MutexGuard<'_, HealthModel> {
        // The model is replaced field by field under the lock; a panic elsewhere leaves it usable.
        self.model.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies one observation; true (and subscribers woken) when a device's health changed.
    pub fn observe(&self, observation: Observation, mig_of: model::MigLookup<'_>) -> bool {
        let changed = self.model().apply(observation, Timestamp::now(), mig_of);
        if changed {
            self.version.send_modify(|v| *v += 1);
        }
        changed
    }

    /// The node's GPUs, once discovered (all healthy until a source says otherwise).
    pub fn set_gpus(&self, gpus: impl IntoIterator<Item = u32>) {
        *self.model() = HealthModel::new(gpus, Timestamp::now());
        self.touch();
    }

    /// Wakes subscribers without a change, e.g. when the list of reported devices changed.
    pub fn touch(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// What goes into `NodeInventory.status.health`.
    pub fn status(&self) -> Vec<DeviceHealth> {
        self.model().status()
    }

    /// Why a published device is unhealthy, or `None`.
    pub fn device(&self, name: &DeviceName) -> Option<(HealthReason, String)> {
        self.model().device(name).map(|(r, m)| (r, m.to_string()))
    }

    /// Woken on every change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }
}

/// Runs `source` on a thread until `stop` turns true, feeding `health`. The first poll runs before this
/// returns, so what the inventory publishes first already holds what the source sees at start: a GPU
/// whose NVLink fabric is still training is never published healthy for a moment.
pub fn spawn_monitor(
    mut source: Box<dyn HealthSource>,
    health: Arc<Health>,
    mig_of: MigMap,
    stop: watch::Receiver<bool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let apply = move |observations: Vec<Observation>, health: &Health, mig_of: &MigMap| {
        for observation in observations {
            let what = format!("{observation:?}");
            if health.observe(observation, mig_of.as_ref()) {
                let unhealthy: Vec<String> = health
                    .status()
                    .iter()
                    .filter(|h| h.reason.is_some())
                    .map(|h| format!("gpu {} {:?}", h.gpu, h.reason))
                    .collect();
                if unhealthy.is_empty() {
                    info!(observation = %what, "every device is healthy");
                } else {
                    warn!(observation = %what, ?unhealthy, "device health changed");
                }
            }
        }
    };
    apply(source.poll(Duration::ZERO), &health, &mig_of);
    std::thread::Builder::new()
        .name("health-monitor".into())
        .spawn(move || {
            while !*stop.borrow() {
                apply(source.poll(POLL_TIMEOUT), &health, &mig_of);
            }
        })
}
