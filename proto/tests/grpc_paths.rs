//! Serves every generated service on a unix socket, as the plugin will, calls it through the
//! generated clients, as the kubelet will, and records the HTTP/2 paths that crossed the wire.
//! The kubelet routes by these exact paths, so they are checked verbatim.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use hyper_util::rt::TokioIo;
use tessera_proto::dra::{v1, v1beta1};
use tessera_proto::health::v1alpha1;
use tessera_proto::pluginregistration;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::{Stream, StreamExt};
use tonic::codegen::http;
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic::{Request, Response, Status};

const POOL: &str = "node-a";

/// A minimal driver: prepares each claim as one device named after the claim, so responses show
/// that the request really reached the server and came back through the right message types.
struct FakeDriver {
    endpoint: PathBuf,
}

fn claim(uid: &str) -> v1::Claim {
    v1::Claim {
        namespace: "default".to_owned(),
        uid: uid.to_owned(),
        name: format!("claim-{uid}"),
    }
}

fn beta_claim(uid: &str) -> v1beta1::Claim {
    let v1::Claim { namespace, uid, name } = claim(uid);
    v1beta1::Claim { namespace, uid, name }
}

#[tonic::async_trait]
impl v1::dra_plugin_server::DraPlugin for FakeDriver {
    async fn node_prepare_resources(
        &self,
        request: Request<v1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1::NodePrepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims.into_iter().map(|claim| {
            let device = v1::Device {
                pool_name: POOL.to_owned(),
                device_name: claim.name,
                share_id: Some(format!("share-{}", claim.uid)),
                ..Default::default()
            };
            let result = v1::NodePrepareResourceResponse {
                devices: vec![device],
                error: String::new(),
            };
            (claim.uid, result)
        });
        Ok(Response::new(v1::NodePrepareResourcesResponse {
            claims: claims.collect(),
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1::NodeUnprepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims.into_iter().map(|claim| {
            (
                claim.uid,
                v1::NodeUnprepareResourceResponse {
                    error: format!("kept {}", claim.name),
                },
            )
        });
        Ok(Response::new(v1::NodeUnprepareResourcesResponse {
            claims: claims.collect(),
        }))
    }
}

#[tonic::async_trait]
impl v1beta1::dra_plugin_server::DraPlugin for FakeDriver {
    async fn node_prepare_resources(
        &self,
        request: Request<v1beta1::NodePrepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodePrepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims.into_iter().map(|claim| {
            let device = v1beta1::Device {
                pool_name: POOL.to_owned(),
                device_name: claim.name,
                ..Default::default()
            };
            let result = v1beta1::NodePrepareResourceResponse {
                devices: vec![device],
                error: String::new(),
            };
            (claim.uid, result)
        });
        Ok(Response::new(v1beta1::NodePrepareResourcesResponse {
            claims: claims.collect(),
        }))
    }

    async fn node_unprepare_resources(
        &self,
        request: Request<v1beta1::NodeUnprepareResourcesRequest>,
    ) -> Result<Response<v1beta1::NodeUnprepareResourcesResponse>, Status> {
        let claims = request.into_inner().claims.into_iter().map(|claim| {
            (
                claim.uid,
                v1beta1::NodeUnprepareResourceResponse { error: String::new() },
            )
        });
        Ok(Response::new(v1beta1::NodeUnprepareResourcesResponse {
            claims: claims.collect(),
        }))
    }
}

#[tonic::async_trait]
impl pluginregistration::registration_server::Registration for FakeDriver {
    async fn get_info(
        &self,
        _request: Request<pluginregistration::InfoRequest>,
    ) -> Result<Response<pluginregistration::PluginInfo>, Status> {
        Ok(Response::new(pluginregistration::PluginInfo {
            r#type: tessera_proto::DRA_PLUGIN_TYPE.to_owned(),
            name: "gpu.tessera.dev".to_owned(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: vec![
                tessera_proto::DRA_PLUGIN_V1_SERVICE.to_owned(),
                tessera_proto::DRA_PLUGIN_V1BETA1_SERVICE.to_owned(),
                tessera_proto::DRA_HEALTH_V1ALPHA1_SERVICE.to_owned(),
            ],
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<pluginregistration::RegistrationStatus>,
    ) -> Result<Response<pluginregistration::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            Ok(Response::new(pluginregistration::RegistrationStatusResponse {}))
        } else {
            Err(Status::failed_precondition(status.error))
        }
    }
}

type HealthStream = Pin<Box<dyn Stream<Item = Result<v1alpha1::NodeWatchResourcesResponse, Status>> + Send>>;

#[tonic::async_trait]
impl v1alpha1::dra_resource_health_server::DraResourceHealth for FakeDriver {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _request: Request<v1alpha1::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        let update = |health: v1alpha1::HealthStatus, time: i64| {
            Ok(v1alpha1::NodeWatchResourcesResponse {
                devices: vec![v1alpha1::DeviceHealth {
                    device: Some(v1alpha1::DeviceIdentifier {
                        pool_name: POOL.to_owned(),
                        device_name: "gpu-0".to_owned(),
                    }),
                    health: health.into(),
                    last_updated_time: time,
                    health_check_timeout_seconds: 30,
                    message: format!("{health:?}"),
                }],
            })
        };
        let updates = vec![
            update(v1alpha1::HealthStatus::Healthy, 1),
            update(v1alpha1::HealthStatus::Unhealthy, 2),
        ];
        Ok(Response::new(Box::pin(tokio_stream::iter(updates))))
    }
}

/// Serves all services on `<dir>/dra.sock` and returns a channel to it plus the request paths
/// the server has seen so far.
async fn serve(dir: &Path) -> (Channel, Arc<Mutex<Vec<String>>>) {
    let socket = dir.join("dra.sock");
    let listener = UnixListener::bind(&socket).expect("bind unix socket in tempdir");
    let paths = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&paths);
    let recorder = tower::util::MapRequestLayer::new(move |request: http::Request<tonic::body::Body>| {
        seen.lock()
            .expect("path log lock")
            .push(request.uri().path().to_owned());
        request
    });
    let driver = || FakeDriver {
        endpoint: socket.clone(),
    };
    let server = Server::builder()
        .layer(recorder)
        .add_service(v1::dra_plugin_server::DraPluginServer::new(driver()))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(driver()))
        .add_service(pluginregistration::registration_server::RegistrationServer::new(
            driver(),
        ))
        .add_service(v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(driver()))
        .serve_with_incoming(UnixListenerStream::new(listener));
    tokio::spawn(server);

    // The URI is required by the builder but ignored: the connector always dials the socket.
    let channel = Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
        .expect("connect to unix socket");
    (channel, paths)
}

fn recorded(paths: &Mutex<Vec<String>>) -> Vec<String> {
    paths.lock().expect("path log lock").clone()
}

#[tokio::test]
async fn dra_plugin_v1_methods_use_the_kubelet_v1_paths() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (channel, paths) = serve(dir.path()).await;
    let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);

    let prepared = client
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![claim("uid-1")],
        })
        .await
        .expect("prepare")
        .into_inner();
    let unprepared = client
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![claim("uid-1")],
        })
        .await
        .expect("unprepare")
        .into_inner();

    assert_eq!(
        recorded(&paths),
        [
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        ]
    );
    let device = &prepared.claims["uid-1"].devices[0];
    assert_eq!(
        (device.device_name.as_str(), device.share_id.as_deref()),
        ("claim-uid-1", Some("share-uid-1"))
    );
    assert_eq!(unprepared.claims["uid-1"].error, "kept claim-uid-1");
}

#[tokio::test]
async fn dra_plugin_v1beta1_methods_use_the_kubelet_v1beta1_paths() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (channel, paths) = serve(dir.path()).await;
    let mut client = v1beta1::dra_plugin_client::DraPluginClient::new(channel);

    let prepared = client
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
            claims: vec![beta_claim("uid-2")],
        })
        .await
        .expect("prepare")
        .into_inner();
    client
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: vec![beta_claim("uid-2")],
        })
        .await
        .expect("unprepare");

    assert_eq!(
        recorded(&paths),
        [
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        ]
    );
    assert_eq!(prepared.claims["uid-2"].devices[0].device_name, "claim-uid-2");
}

#[tokio::test]
async fn registration_methods_use_the_pluginregistration_paths() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (channel, paths) = serve(dir.path()).await;
    let mut client = pluginregistration::registration_client::RegistrationClient::new(channel);

    let info = client
        .get_info(pluginregistration::InfoRequest {})
        .await
        .expect("get info")
        .into_inner();
    let rejected = client
        .notify_registration_status(pluginregistration::RegistrationStatus {
            plugin_registered: false,
            error: "version not supported".to_owned(),
        })
        .await
        .expect_err("a rejected registration surfaces as an error");

    assert_eq!(
        recorded(&paths),
        [
            "/pluginregistration.Registration/GetInfo",
            "/pluginregistration.Registration/NotifyRegistrationStatus"
        ]
    );
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.endpoint, dir.path().join("dra.sock").display().to_string());
    assert_eq!(
        info.supported_versions,
        ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]
    );
    assert_eq!(rejected.message(), "version not supported");
}

#[tokio::test]
async fn node_watch_resources_streams_every_update_on_the_v1alpha1_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (channel, paths) = serve(dir.path()).await;
    let mut client = v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(channel);

    let stream = client
        .node_watch_resources(v1alpha1::NodeWatchResourcesRequest {})
        .await
        .expect("watch")
        .into_inner();
    let updates: Vec<_> = stream
        .collect::<Result<_, _>>()
        .await
        .expect("stream ends cleanly");

    assert_eq!(
        recorded(&paths),
        ["/v1alpha1.DRAResourceHealth/NodeWatchResources"]
    );
    let healths: Vec<_> = updates
        .iter()
        .map(|u| (u.devices[0].health(), u.devices[0].message.as_str()))
        .collect();
    assert_eq!(
        healths,
        [
            (v1alpha1::HealthStatus::Healthy, "Healthy"),
            (v1alpha1::HealthStatus::Unhealthy, "Unhealthy")
        ]
    );
}

#[test]
fn supported_versions_strings_are_the_last_package_component_and_the_service() {
    let announced = |service_name: &str| {
        let mut parts = service_name.rsplit('.');
        let service = parts.next().expect("service");
        let version = parts.next().expect("package component");
        format!("{version}.{service}")
    };

    assert_eq!(
        announced(v1::dra_plugin_server::SERVICE_NAME),
        tessera_proto::DRA_PLUGIN_V1_SERVICE
    );
    assert_eq!(
        announced(v1beta1::dra_plugin_server::SERVICE_NAME),
        tessera_proto::DRA_PLUGIN_V1BETA1_SERVICE
    );
    assert_eq!(
        announced(v1alpha1::dra_resource_health_server::SERVICE_NAME),
        tessera_proto::DRA_HEALTH_V1ALPHA1_SERVICE
    );
}
