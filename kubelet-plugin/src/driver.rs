//! The gRPC edge: thin adapters from kubelet's `DRAPlugin` services (v1 and v1beta1) to [`NodeState`], and
//! the two unix sockets they are served on.
//!
//! Each adapter converts the request into [`ClaimRef`]s, lets the state machine prepare or unprepare them
//! (each claim independently), and converts the per-claim results back; a claim's failure becomes that
//! claim's `error` string, never a gRPC error, because kubelet ignores a whole response on a gRPC error.

use std::{
    future::Future,
    path::{Path, PathBuf},
    sync::Arc,
};

use tessera_api::DRIVER_NAME;
use tessera_proto::{
    dra::{v1, v1beta1},
    pluginregistration::registration_server::RegistrationServer,
};
use tokio::{net::UnixListener, sync::watch};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status, transport::Server};
use tracing::{info, warn};

use crate::{
    error::{Error, Result},
    registration::{RegistrationService, RegistrationState},
    state::{ClaimRef, NodeState, PreparedDevice},
};

/// File name of the registration socket in kubelet's registry directory.
pub fn registration_socket_name() -> String {
    format!("{DRIVER_NAME}-reg.sock")
}

/// The two sockets of the plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketPaths {
    /// `<registry dir>/gpu.tessera.dev-reg.sock`, where kubelet discovers the plugin.
    pub registration: PathBuf,
    /// `<plugins dir>/gpu.tessera.dev/dra.sock`, where kubelet calls `DRAPlugin`.
    pub dra: PathBuf,
}

impl SocketPaths {
    /// The standard paths under kubelet's registry and plugins directories. Relative directories are made
    /// absolute, because the DRA path goes to kubelet as the endpoint and kubelet has another working
    /// directory.
    pub fn new(registry_dir: &Path, plugins_dir: &Path) -> Self {
        let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        Self {
            registration: absolute(registry_dir).join(registration_socket_name()),
            dra: absolute(plugins_dir).join(DRIVER_NAME).join("dra.sock"),
        }
    }
}

/// Serves the DRA services and the registration service until `shutdown` completes, then stops both and
/// removes the sockets. The DRA socket is bound first, so the endpoint exists by the time kubelet, woken
/// by the registration socket, asks for it.
pub async fn serve(
    paths: &SocketPaths,
    state: Arc<NodeState>,
    registration: watch::Sender<RegistrationState>,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        // An error means the sender is gone, which also means stop.
        let _ = rx.wait_for(|stop| *stop).await;
    };

    let dra_incoming = bind(&paths.dra)?;
    let dra = Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(DraV1 {
            state: state.clone(),
        }))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(DraV1beta1 {
            v1: DraV1 { state },
        }))
        .serve_with_incoming_shutdown(dra_incoming, stopped(stop_rx.clone()));
    let dra = tokio::spawn(dra);

    let reg_incoming = match bind(&paths.registration) {
        Ok(incoming) => incoming,
        Err(e) => {
            let _ = stop_tx.send(true);
            let _ = dra.await;
            remove_socket(&paths.dra);
            return Err(e);
        }
    };
    let reg = Server::builder()
        .add_service(RegistrationServer::new(RegistrationService::new(
            DRIVER_NAME,
            &paths.dra,
            registration,
        )))
        .serve_with_incoming_shutdown(reg_incoming, stopped(stop_rx));
    let reg = tokio::spawn(reg);
    info!(registration = %paths.registration.display(), dra = %paths.dra.display(), "serving kubelet");

    shutdown.await;
    info!("shutting down the kubelet sockets");
    let _ = stop_tx.send(true);
    // The registration socket goes first, so kubelet stops routing new calls to a plugin on its way out.
    let reg_result = reg.await;
    remove_socket(&paths.registration);
    let dra_result = dra.await;
    remove_socket(&paths.dra);
    for (path, result) in [(&paths.registration, reg_result), (&paths.dra, dra_result)] {
        match result {
            Ok(Ok(())) => {}
            Ok(Err(source)) => {
                return Err(Error::Serve {
                    path: path.clone(),
                    source,
                });
            }
            Err(e) => warn!(socket = %path.display(), error = %e, "gRPC server task ended abnormally"),
        }
    }
    Ok(())
}

/// Binds a unix socket, removing whatever an earlier run left at the path (a crashed plugin leaves its
/// socket behind, and binding over it fails with "address in use").
fn bind(path: &Path) -> Result<UnixListenerStream> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| Error::BindSocket {
            path: path.to_path_buf(),
            source,
        })?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => info!(socket = %path.display(), "removed a stale socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(Error::RemoveStaleSocket {
                path: path.to_path_buf(),
                source,
            });
        }
    }
    let listener = UnixListener::bind(path).map_err(|source| Error::BindSocket {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(UnixListenerStream::new(listener))
}

fn remove_socket(path: &Path) {
    if let Err(e) = std::fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        warn!(socket = %path.display(), error = %e, "failed to remove socket");
    }
}

// === impl DraV1 ===

/// `k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`.
pub struct DraV1 {
    state: Arc<NodeState>,
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for DraV1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let claims: Vec<ClaimRef> = request
            .into_inner()
            .claims
            .into_iter()
            .map(claim_ref_v1)
            .collect();
        let results = self.state.prepare_all(&claims).await;
        let claims = results
            .into_iter()
            .map(|(claim, result)| {
                let response = match result {
                    Ok(devices) => v1::NodePrepareResourceResponse {
                        devices: devices.into_iter().map(device_v1).collect(),
                        error: String::new(),
                    },
                    Err(e) => {
                        warn!(claim = %claim.uid, error = %e, "failed to prepare claim");
                        v1::NodePrepareResourceResponse {
                            devices: vec![],
                            error: e.to_string(),
                        }
                    }
                };
                (claim.uid, response)
            })
            .collect();
        Ok(Response::new(v1::NodePrepareResourcesResponse { claims }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let claims: Vec<ClaimRef> = request
            .into_inner()
            .claims
            .into_iter()
            .map(claim_ref_v1)
            .collect();
        let results = self.state.unprepare_all(&claims).await;
        let claims = results
            .into_iter()
            .map(|(claim, result)| {
                let error = result.err().map(|e| {
                    warn!(claim = %claim.uid, error = %e, "failed to unprepare claim");
                    e.to_string()
                });
                (
                    claim.uid,
                    v1::NodeUnprepareResourceResponse {
                        error: error.unwrap_or_default(),
                    },
                )
            })
            .collect();
        Ok(Response::new(v1::NodeUnprepareResourcesResponse { claims }))
    }
}

fn claim_ref_v1(c: v1::Claim) -> ClaimRef {
    ClaimRef {
        namespace: c.namespace,
        name: c.name,
        uid: c.uid,
    }
}

fn device_v1(d: PreparedDevice) -> v1::Device {
    v1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
        share_id: d.share_id,
    }
}

// === impl DraV1beta1 ===

/// `k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`, for 1.32/1.33 kubelets.
///
/// v1beta1 is v1 on the wire minus `Device.share_id` (field 5), so each message is re-encoded and the v1
/// code runs: one implementation of prepare semantics, and a v1beta1 kubelet simply never sees share ids
/// (prost skips the unknown field when decoding the v1 response as v1beta1).
pub struct DraV1beta1 {
    v1: DraV1,
}

fn transcode<From: prost::Message, To: prost::Message + Default>(message: From) -> Result<To, Status> {
    To::decode(message.encode_to_vec().as_slice()).map_err(|e| {
        Status::internal(format!(
            "failed to convert between DRA v1beta1 and v1 messages: {e}"
        ))
    })
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for DraV1beta1 {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        use v1::dra_plugin_server::DraPlugin as _;
        let request: v1::NodePrepareResourcesRequest = transcode(request.into_inner())?;
        let response = self.v1.node_prepare_resources(Request::new(request)).await?;
        Ok(Response::new(transcode(response.into_inner())?))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        use v1::dra_plugin_server::DraPlugin as _;
        let request: v1::NodeUnprepareResourcesRequest = transcode(request.into_inner())?;
        let response = self.v1.node_unprepare_resources(Request::new(request)).await?;
        Ok(Response::new(transcode(response.into_inner())?))
    }
}
