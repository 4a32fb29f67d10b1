//! kubelet's `DRAResourceHealth` service, in both versions: `v1` (Kubernetes 1.37) and `v1alpha1` (1.36).
//!
//! `NodeWatchResources` streams the complete list of the node's devices that kubelet may know (every whole
//! GPU and every device of a prepared claim) with their health: at once, on every change and every
//! [`RESEND_EVERY`]. kubelet matches the entries by pool and device name to the claims of its pods and
//! writes `status.containerStatuses[].allocatedResourcesStatus`. A device that joins the list (a claim was
//! just prepared) is sent within [`DEVICES_CHECK_EVERY`]. An entry not renewed within
//! [`HEALTH_TIMEOUT_SECONDS`] becomes `Unknown` there (kubelet `pkg/kubelet/cm/dra/healthinfo.go`).
//! A 1.37 kubelet opens the stream only because registration lists the service
//! ([`crate::kubelet::registration`]).

use std::{
    pin::Pin,
    sync::{Arc, OnceLock},
    time::Duration,
};

use tessera_api::DeviceName;
use tessera_proto::health::{v1, v1alpha1};
use tokio::sync::mpsc;
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tonic::{Request, Response, Status};

use crate::gpu::health::Health;

/// How often the full list is sent again without a change, well inside [`HEALTH_TIMEOUT_SECONDS`].
pub const RESEND_EVERY: Duration = Duration::from_secs(10);

/// How often the list of reported devices is compared with the last one sent.
pub const DEVICES_CHECK_EVERY: Duration = Duration::from_secs(1);

fn same_but_time(a: &[Entry], b: &[Entry]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            (&x.pool, &x.device, x.healthy, &x.message) == (&y.pool, &y.device, y.healthy, &y.message)
        })
}

/// `health_check_timeout_seconds` of every entry: three resends may be missed before kubelet says Unknown.
pub const HEALTH_TIMEOUT_SECONDS: i64 = 30;

/// Names of the devices to report, in the node's pool.
pub type DeviceList = Arc<dyn Fn() -> Vec<String> + Send + Sync>;

/// One device's entry, before it is put in a version's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub pool: String,
    pub device: String,
    pub healthy: bool,
    pub message: String,
    pub at: i64,
}

/// The health service; cheap to clone (one per version is served).
#[derive(Clone)]
pub struct HealthService {
    health: Arc<Health>,
    pool: String,
    /// Set once the plugin owns the node state; until then the list is empty (the service is served from
    /// the start, like the DRA service behind its gate).
    devices: Arc<OnceLock<DeviceList>>,
}

impl HealthService {
    /// Reports the devices of the pool `pool` (the node name) from `health`, once [`Self::set_devices`]
    /// said which.
    pub fn new(health: Arc<Health>, pool: impl Into<String>) -> Self {
        Self {
            health,
            pool: pool.into(),
            devices: Arc::new(OnceLock::new()),
        }
    }

    /// Which devices to report from now on; later calls are ignored.
    pub fn set_devices(&self, devices: DeviceList) {
        let _ = self.devices.set(devices);
        // Wakes the open streams so kubelet hears of the devices without waiting for the resend.
        self.health.touch();
    }

    /// The entries to send now.
    pub fn report(&self) -> Vec<Entry> {
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or_default();
        let mut names = self.devices.get().map(|d| d()).unwrap_or_default();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|device| {
                let problem = device
                    .parse::<DeviceName>()
                    .ok()
                    .and_then(|name| self.health.device(&name));
                Entry {
                    pool: self.pool.clone(),
                    healthy: problem.is_none(),
                    message: problem.map(|(_, m)| m).unwrap_or_default(),
                    device,
                    at,
                }
            })
            .collect()
    }

    /// Entries now, on every change and every [`RESEND_EVERY`], until the receiver goes away.
    fn updates<T: Send + 'static>(
        &self,
        convert: fn(Vec<Entry>) -> T,
    ) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>> {
        let (tx, rx) = mpsc::channel(4);
        let this = self.clone();
        let mut changes = self.health.subscribe();
        tokio::spawn(async move {
            // What was sent last, without the timestamps: a newly prepared claim's devices are sent within
            // a [`DEVICES_CHECK_EVERY`], so kubelet knows their health before the next resend.
            let mut sent: Option<Vec<Entry>> = None;
            let mut sent_at = tokio::time::Instant::now();
            loop {
                let report = this.report();
                let unchanged = sent.as_ref().is_some_and(|s| same_but_time(s, &report));
                if !unchanged || sent_at.elapsed() >= RESEND_EVERY {
                    sent = Some(report.clone());
                    sent_at = tokio::time::Instant::now();
                    if tx.send(Ok(convert(report))).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    changed = changes.changed() => if changed.is_err() { return },
                    _ = tokio::time::sleep(DEVICES_CHECK_EVERY) => {}
                    _ = tx.closed() => return,
                }
            }
        });
        Box::pin(ReceiverStream::new(rx))
    }
}

macro_rules! impl_version {
    ($module:ident, $convert:ident) => {
        fn $convert(entries: Vec<Entry>) -> $module::NodeWatchResourcesResponse {
            $module::NodeWatchResourcesResponse {
                devices: entries
                    .into_iter()
                    .map(|e| $module::DeviceHealth {
                        device: Some($module::DeviceIdentifier {
                            pool_name: e.pool,
                            device_name: e.device,
                        }),
                        health: if e.healthy {
                            $module::HealthStatus::Healthy
                        } else {
                            $module::HealthStatus::Unhealthy
                        }
                        .into(),
                        last_updated_time: e.at,
                        health_check_timeout_seconds: HEALTH_TIMEOUT_SECONDS,
                        message: e.message,
                    })
                    .collect(),
            }
        }

        #[tonic::async_trait]
        impl $module::dra_resource_health_server::DraResourceHealth for HealthService {
            type NodeWatchResourcesStream =
                Pin<Box<dyn Stream<Item = Result<$module::NodeWatchResourcesResponse, Status>> + Send>>;

            async fn node_watch_resources(
                &self,
                _request: Request<$module::NodeWatchResourcesRequest>,
            ) -> Result<Response<Self::NodeWatchResourcesStream>, Status> {
                Ok(Response::new(self.updates($convert)))
            }
        }
    };
}

impl_version!(v1, to_v1);
impl_version!(v1alpha1, to_v1alpha1);

/// The `v1` server.
pub fn v1_server(
    service: HealthService,
) -> v1::dra_resource_health_server::DraResourceHealthServer<HealthService> {
    v1::dra_resource_health_server::DraResourceHealthServer::new(service)
}

/// The `v1alpha1` server (Kubernetes 1.36 kubelets).
pub fn v1alpha1_server(
    service: HealthService,
) -> v1alpha1::dra_resource_health_server::DraResourceHealthServer<HealthService> {
    v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(service)
}
