//! The HTTPS layer: `POST /validate` takes an AdmissionReview and answers with [`super::review_body`];
//! `GET /healthz` is for probes. Nothing else is served.
//!
//! [`run`] starts it with the `webhook` subcommand's flags ([`WebhookArgs`]).

use std::{
    convert::Infallible,
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Args as ClapArgs;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method, Request, Response, StatusCode, body::Bytes, service::service_fn};
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::{
    Api, Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{reflector, watcher},
};
use tessera_api::DRIVER_NAME;
use tokio::{net::TcpListener, sync::Notify};
use tokio_rustls::TlsAcceptor;

use super::{ClassCatalog, WebhookError, classes::ClusterClasses, review_body, tls};
use crate::mirror::{ViewCell, drop_managed_fields, mirror};

/// Largest AdmissionReview read: the API server's own request limit is 3 MiB and a review carries the
/// object (and, on update, the old one).
pub const MAX_BODY_BYTES: usize = 8 << 20;
/// A client that does not finish its TLS handshake within this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the webhook on `listener` until the task is dropped.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    classes: Arc<dyn ClassCatalog>,
) -> Result<(), WebhookError> {
    let acceptor = TlsAcceptor::from(tls);
    loop {
        let (tcp, peer) = listener.accept().await.map_err(WebhookError::Accept)?;
        // Small responses: without it Nagle's algorithm meets the client's delayed ACK during the TLS
        // handshake and a new connection waits ~40 ms.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(%peer, error = %e, "cannot set TCP_NODELAY");
        }
        let acceptor = acceptor.clone();
        let classes = classes.clone();
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => return tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
            };
            let service = service_fn(move |req| handle(req, classes.clone()));
            if let Err(e) = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}

fn reply(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        response.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    response
}

async fn handle(
    req: Request<hyper::body::Incoming>,
    classes: Arc<dyn ClassCatalog>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    const TEXT: &str = "text/plain; charset=utf-8";
    match (req.method(), req.uri().path()) {
        (&Method::POST, "/validate") => {
            let body = match Limited::new(req.into_body(), MAX_BODY_BYTES).collect().await {
                Ok(body) => body.to_bytes(),
                Err(e) => {
                    return Ok(reply(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        TEXT,
                        format!("cannot read the AdmissionReview (at most {MAX_BODY_BYTES} bytes): {e}\n"),
                    ));
                }
            };
            let started = Instant::now();
            let review = review_body(&body, classes.as_ref());
            if let Some(r) = &review.response {
                tracing::debug!(uid = %r.uid, allowed = r.allowed, took = ?started.elapsed(), "reviewed");
                if !r.allowed {
                    tracing::info!(uid = %r.uid, message = %r.result.message, "refused");
                }
            }
            match serde_json::to_vec(&review) {
                Ok(json) => Ok(reply(StatusCode::OK, "application/json", json)),
                Err(e) => Ok(reply(StatusCode::INTERNAL_SERVER_ERROR, TEXT, format!("{e}\n"))),
            }
        }
        (&Method::GET, "/healthz") => Ok(reply(StatusCode::OK, TEXT, "ok\n")),
        (_, "/validate" | "/healthz") => Ok(reply(
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            "method not allowed\n",
        )),
        _ => Ok(reply(
            StatusCode::NOT_FOUND,
            TEXT,
            "not found: POST /validate or GET /healthz\n",
        )),
    }
}

async fn client(kubeconfig: Option<&std::path::Path>) -> Result<Client, WebhookError> {
    let failed = |message: String| WebhookError::Client { message };
    let config = match kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| failed(format!("failed to read kubeconfig {}: {e}", path.display())))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| failed(e.to_string()))?
        }
        None => Config::infer().await.map_err(|e| failed(e.to_string()))?,
    };
    Client::try_from(config).map_err(|e| failed(e.to_string()))
}

/// Watches DeviceClasses and this driver's ResourceSlices (read only) into a [`ClusterClasses`].
async fn watch_classes(kubeconfig: Option<&std::path::Path>) -> Result<Arc<ClusterClasses>, WebhookError> {
    let client = client(kubeconfig).await?;
    let wake = Arc::new(Notify::new());
    let generation = Arc::new(AtomicU64::new(0));
    let (classes, classes_writer) = reflector::store::<DeviceClass>();
    let (slices, slices_writer) = reflector::store::<ResourceSlice>();
    let now = Instant::now();
    tokio::spawn(mirror(
        "DeviceClass",
        classes_writer,
        Api::all(client.clone()),
        watcher::Config::default(),
        drop_managed_fields,
        ViewCell::new(now),
        Some(wake.clone()),
    ));
    tokio::spawn(mirror(
        "ResourceSlice",
        slices_writer,
        Api::all(client),
        watcher::Config::default().fields(&format!("spec.driver={DRIVER_NAME}")),
        // The webhook judges classes by the devices, so it keeps them.
        drop_managed_fields,
        ViewCell::new(now),
        Some(wake.clone()),
    ));
    let bump = generation.clone();
    tokio::spawn(async move {
        loop {
            wake.notified().await;
            bump.fetch_add(1, Ordering::AcqRel);
        }
    });
    Ok(Arc::new(ClusterClasses::new(classes, slices, generation)))
}

// The flags of `tessera-controller webhook`.
#[derive(Debug, Clone, ClapArgs)]
pub struct WebhookArgs {
    /// Address to serve HTTPS on.
    #[arg(long, env = "TESSERA_WEBHOOK_LISTEN", default_value = "0.0.0.0:8443")]
    pub listen: std::net::SocketAddr,
    /// PEM serving certificate (chain), e.g. cert-manager's; re-read when it changes. Without it the
    /// webhook makes and rotates its own (--cert-secret).
    #[arg(
        long,
        env = "TESSERA_WEBHOOK_TLS_CERT",
        requires = "tls_key_file",
        required_unless_present = "cert_secret"
    )]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of the serving certificate; re-read when it changes.
    #[arg(long, env = "TESSERA_WEBHOOK_TLS_KEY", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// Secret (in --namespace, created by the chart) that holds the serving certificate the webhook
    /// makes itself, its CA, and the next and previous CA during a rotation. Needs --webhook-configuration
    /// and --service.
    #[arg(
        long,
        env = "TESSERA_WEBHOOK_CERT_SECRET",
        conflicts_with = "tls_cert_file",
        requires_all = ["webhook_configuration", "service"]
    )]
    pub cert_secret: Option<String>,
    /// ValidatingWebhookConfiguration whose caBundle the webhook keeps to its own CAs (--cert-secret).
    #[arg(long, env = "TESSERA_WEBHOOK_CONFIGURATION")]
    pub webhook_configuration: Option<String>,
    /// Service the API server calls the webhook through: the certificate names
    /// `<service>.<namespace>.svc` (--cert-secret).
    #[arg(long, env = "TESSERA_WEBHOOK_SERVICE")]
    pub service: Option<String>,
    /// Namespace of --cert-secret and --service.
    #[arg(long, env = "TESSERA_WEBHOOK_NAMESPACE", default_value = "tessera-system")]
    pub namespace: String,
    /// Lifetime of each CA and serving certificate the webhook makes (`<n>s`, `<n>m` or `<n>h`, at
    /// least 30s); a rotation starts with a third of it left.
    #[arg(long, env = "TESSERA_WEBHOOK_CERT_VALIDITY", default_value = "8760h", value_parser = parse_validity)]
    pub cert_validity: std::time::Duration,
    /// Kubeconfig file; in-cluster configuration when absent.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

/// `<n>s`, `<n>m` or `<n>h`, at least 30 s (a rotation needs time to stage the new CA).
pub fn parse_validity(s: &str) -> Result<std::time::Duration, String> {
    let unit = match s.chars().last() {
        Some('s') => 1,
        Some('m') => 60,
        Some('h') => 3600,
        _ => {
            return Err(format!(
                "{s:?}: want a number of seconds, minutes or hours such as 8760h, 90m or 45s"
            ));
        }
    };
    let n: u64 = s[..s.len() - 1].parse().map_err(|_| {
        format!("{s:?}: want a number of seconds, minutes or hours such as 8760h, 90m or 45s")
    })?;
    let d = std::time::Duration::from_secs(n.saturating_mul(unit));
    if d < std::time::Duration::from_secs(30) {
        return Err(format!(
            "{s:?}: at least 30s, so a rotation can stage the new CA before the old one expires"
        ));
    }
    Ok(d)
}

/// `tessera-controller webhook`: serves the files it is given (cert-manager's), or a certificate it makes
/// and rotates itself in --cert-secret.
pub async fn run(args: WebhookArgs) -> anyhow::Result<()> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = match (&args.tls_cert_file, &args.tls_key_file, &args.cert_secret) {
        (Some(cert), Some(key), _) => tls::server_config(cert, key)?,
        (None, None, Some(secret)) => {
            let (Some(config), Some(service)) = (&args.webhook_configuration, &args.service) else {
                anyhow::bail!("--cert-secret needs --webhook-configuration and --service");
            };
            let managed = tls::managed::Managed::new(
                client(args.kubeconfig.as_deref()).await?,
                &args.namespace,
                secret,
                config,
                service,
                tls::rotation::Policy::for_validity(args.cert_validity),
                provider.clone(),
            );
            tracing::info!(secret = %secret, config = %config, validity = ?args.cert_validity, "making and rotating the serving certificate");
            tls::config_with(provider, managed.start().await)?
        }
        _ => anyhow::bail!("give --tls-cert-file with --tls-key-file, or --cert-secret"),
    };
    let classes: Arc<dyn ClassCatalog> = watch_classes(args.kubeconfig.as_deref()).await?;
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|source| WebhookError::Bind {
            addr: args.listen,
            source,
        })?;
    let addr: SocketAddr = listener.local_addr().map_err(WebhookError::Accept)?;
    tracing::info!(%addr, "webhook serving POST /validate");
    tokio::select! {
        served = serve(listener, tls, classes) => Ok(served?),
        _ = tokio::signal::ctrl_c() => Ok(()),
    }
}
