//! The webhook over real HTTPS on 127.0.0.1, as the API server calls it: TLS with a CA bundle, POST of an
//! AdmissionReview, certificate rotation by rewriting the files, and the binary's startup errors.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use http_body_util::{BodyExt, Full};
use hyper::{Request, body::Bytes};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::{ClientConfig, RootCertStore, pki_types::ServerName};
use serde_json::{Value, json};
use tessera_controller::webhook::{
    NoClasses,
    server::serve,
    tls::{RELOAD_CHECK_EVERY, server_config},
};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;

/// A CA and a serving certificate for 127.0.0.1 it signed, written where the webhook reads them.
struct Pki {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

fn pki(name: &str) -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("{name} CA"));
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    Pki {
        ca_pem: ca.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    }
}

impl Pki {
    fn write(&self, dir: &Path) -> (PathBuf, PathBuf) {
        let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
        std::fs::write(&cert, &self.cert_pem).unwrap();
        std::fs::write(&key, &self.key_pem).unwrap();
        (cert, key)
    }

    fn client(&self) -> TlsConnector {
        let mut roots = RootCertStore::empty();
        for c in rustls::pki_types::CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let config = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        TlsConnector::from(Arc::new(config))
    }
}

use rustls::pki_types::pem::PemObject as _;

async fn start(cert: &Path, key: &Path) -> std::net::SocketAddr {
    let tls = server_config(cert, key).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, tls, Arc::new(NoClasses)));
    addr
}

/// One HTTPS request on a new connection; `Err` when the TLS handshake fails.
async fn call(
    addr: std::net::SocketAddr,
    tls: &TlsConnector,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let stream = tls
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    Ok((status, bytes.to_vec()))
}

fn review_of_share_claim(percentage: u32) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "e2f0c1d4-0000-4000-8000-000000000001",
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "namespace": "ns", "operation": "CREATE", "userInfo": {"username": "alice"},
            "object": {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": "share", "namespace": "ns"},
                "spec": {"devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": "shared.gpu.tessera.dev"}}],
                    "config": [{"opaque": {"driver": "gpu.tessera.dev", "parameters": {
                        "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
                        "sharing": {"strategy": "MPS", "mps": {"defaultActiveThreadPercentage": percentage}}}}}]
                }}
            }
        }
    }))
    .unwrap()
}

#[tokio::test]
async fn a_share_claim_with_150_percent_is_refused_over_https_and_one_with_50_is_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki("first");
    let (cert, key) = pki.write(dir.path());
    let addr = start(&cert, &key).await;
    let tls = pki.client();

    let (status, body) = call(addr, &tls, "POST", "/validate", review_of_share_claim(150))
        .await
        .unwrap();
    assert_eq!(status, 200);
    let review: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(review["kind"], "AdmissionReview");
    assert_eq!(review["response"]["uid"], "e2f0c1d4-0000-4000-8000-000000000001");
    assert_eq!(review["response"]["allowed"], false);
    assert_eq!(
        review["response"]["status"]["message"],
        "spec.devices.config[0].opaque.parameters: sharing.mps.defaultActiveThreadPercentage: must be between 1 \
         and 100, got 150"
    );

    let (_, body) = call(addr, &tls, "POST", "/validate", review_of_share_claim(50))
        .await
        .unwrap();
    let review: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(review["response"]["allowed"], true, "{review}");
}

#[tokio::test]
async fn only_post_validate_and_get_healthz_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki("routes");
    let (cert, key) = pki.write(dir.path());
    let addr = start(&cert, &key).await;
    let tls = pki.client();
    assert_eq!(call(addr, &tls, "GET", "/healthz", vec![]).await.unwrap().0, 200);
    assert_eq!(call(addr, &tls, "GET", "/validate", vec![]).await.unwrap().0, 405);
    assert_eq!(call(addr, &tls, "POST", "/mutate", vec![]).await.unwrap().0, 404);
}

#[tokio::test]
async fn a_rotated_certificate_is_served_on_new_connections_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let old = pki("old");
    let (cert, key) = old.write(dir.path());
    let addr = start(&cert, &key).await;
    assert!(call(addr, &old.client(), "GET", "/healthz", vec![]).await.is_ok());

    let new = pki("new");
    new.write(dir.path());
    tokio::time::sleep(RELOAD_CHECK_EVERY + Duration::from_millis(300)).await;
    let served = call(addr, &new.client(), "GET", "/healthz", vec![]).await;
    assert_eq!(served.map(|r| r.0), Ok(200), "the new certificate is not served");
    let refused = call(addr, &old.client(), "GET", "/healthz", vec![]).await;
    assert!(
        refused.is_err(),
        "the old CA still verifies the served certificate"
    );
}

#[tokio::test]
async fn a_half_written_rotation_keeps_serving_the_previous_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let old = pki("old");
    let (cert, _key) = old.write(dir.path());
    let addr = start(&cert, &dir.path().join("tls.key")).await;
    // The certificate changes first and its key only later, as a non-atomic copy would leave them.
    std::fs::write(&cert, pki("new").cert_pem).unwrap();
    tokio::time::sleep(RELOAD_CHECK_EVERY + Duration::from_millis(300)).await;
    let served = call(addr, &old.client(), "GET", "/healthz", vec![]).await;
    assert_eq!(served.map(|r| r.0), Ok(200));
}

#[test]
fn the_binary_refuses_to_start_without_a_readable_certificate_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such.crt");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tessera-controller"))
        .args(["webhook", "--listen", "127.0.0.1:0", "--tls-cert-file"])
        .arg(&missing)
        .arg("--tls-key-file")
        .arg(dir.path().join("no-such.key"))
        .env_remove("KUBECONFIG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "failed to read the serving certificate {}",
            missing.display()
        )),
        "{stderr}"
    );
}

#[test]
fn the_binary_refuses_a_key_that_is_not_the_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = pki("one").write(dir.path());
    std::fs::write(&key, pki("other").key_pem).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tessera-controller"))
        .args(["webhook", "--listen", "127.0.0.1:0", "--tls-cert-file"])
        .arg(&cert)
        .arg("--tls-key-file")
        .arg(&key)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is not the key of the certificate"), "{stderr}");
}
