//! kubelet plugin registration: the `Registration` service kubelet finds in its registry directory.
//!
//! kubelet watches `<registry dir>`, dials `gpu.tessera.dev-reg.sock` (in a pod, a name of the pod's own:
//! [`crate::kubelet::driver::SocketPaths::for_pod`]), calls `GetInfo` to learn the DRA endpoint and API versions,
//! then reports the outcome with `NotifyRegistrationStatus`. The outcome is published on a watch channel;
//! the inventory publisher reports the node ready only once registered. Every instance registers under the
//! driver name, which is how kubelet knows two pods of a rolling update are one driver.

use std::path::Path;

use tessera_proto::{
    DRA_HEALTH_V1_SERVICE, DRA_HEALTH_V1ALPHA1_SERVICE, DRA_PLUGIN_TYPE, DRA_PLUGIN_V1_SERVICE,
    DRA_PLUGIN_V1BETA1_SERVICE,
    pluginregistration::{
        InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
        registration_server::Registration,
    },
};
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{error, info};

/// Where registration with kubelet stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistrationState {
    /// kubelet has not reported yet.
    Pending,
    /// kubelet accepted the plugin.
    Registered,
    /// kubelet rejected the plugin, with its reason.
    Failed(String),
}

/// The `Registration` service.
pub struct RegistrationService {
    info: PluginInfo,
    state: watch::Sender<RegistrationState>,
}

impl RegistrationService {
    /// Announces the DRA service at `dra_socket` (absolute: kubelet dials it as given) in both API versions.
    pub fn new(driver_name: &str, dra_socket: &Path, state: watch::Sender<RegistrationState>) -> Self {
        let info = PluginInfo {
            r#type: DRA_PLUGIN_TYPE.to_string(),
            name: driver_name.to_string(),
            endpoint: dra_socket.display().to_string(),
            // Most preferred first, as kubelet picks the first version it supports.
            supported_versions: vec![
                DRA_PLUGIN_V1_SERVICE.to_string(),
                DRA_PLUGIN_V1BETA1_SERVICE.to_string(),
            ],
        };
        Self { info, state }
    }

    /// Also announces the `DRAResourceHealth` service served on the DRA socket, v1 first: a 1.37 kubelet
    /// opens the health stream only for a version listed here (`pickHealthService` in kubelet's
    /// `pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go`); a 1.36 kubelet tries v1alpha1 regardless.
    pub fn with_health(mut self) -> Self {
        self.info.supported_versions.extend([
            DRA_HEALTH_V1_SERVICE.to_string(),
            DRA_HEALTH_V1ALPHA1_SERVICE.to_string(),
        ]);
        self
    }
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _request: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        info!(endpoint = %self.info.endpoint, "kubelet asked for plugin info");
        Ok(Response::new(self.info.clone()))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        let state = if status.plugin_registered {
            info!("kubelet registered the plugin");
            RegistrationState::Registered
        } else {
            error!(error = %status.error, "kubelet rejected the plugin registration");
            RegistrationState::Failed(status.error)
        };
        self.state.send_replace(state);
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
