//! Latency of the admission webhook for a typical claim, over HTTPS on 127.0.0.1: the server of
//! `tessera-controller webhook` (same TLS setup, same handler) with a catalog of the shipped classes, and
//! a client that, like the API server, keeps its connection open. Prints percentiles; asserts nothing.
//!
//! ```sh
//! cargo run --release -p tessera-controller --example webhook_bench [-- REQUESTS]
//! ```

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use http_body_util::{BodyExt, Full};
use hyper::{Request, body::Bytes};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::{
    ClientConfig, RootCertStore,
    pki_types::{CertificateDer, ServerName, pem::PemObject},
};
use serde_json::json;
use tessera_controller::webhook::{FixedClasses, Offers, server::serve, tls::server_config};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;

/// A share claim as the examples write it: one request of the shared class, one MPS config.
fn typical_review(i: usize) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": format!("00000000-0000-4000-8000-{i:012}"),
            "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "requestKind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"},
            "requestResource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "name": format!("share-{i}"), "namespace": "tessera-examples", "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:resourceclaim-controller",
                         "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": format!("share-{i}"), "namespace": "tessera-examples",
                             "labels": {"app": "share"},
                             "annotations": {"resource.kubernetes.io/pod-claim-name": "gpu"}},
                "spec": {"devices": {
                    "requests": [{"name": "gpu", "exactly": {
                        "deviceClassName": "shared.gpu.tessera.dev", "allocationMode": "ExactCount", "count": 1,
                        "capacity": {"requests": {"memory": "10Gi", "compute": "25"}}}}],
                    "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.tessera.dev", "parameters": {
                        "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
                        "sharing": {"strategy": "MPS", "mps": {
                            "defaultActiveThreadPercentage": 25, "defaultPinnedDeviceMemoryLimit": "10Gi"}}}}}]
                }}
            },
            "oldObject": null, "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    }))
    .expect("a literal serializes")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn print(label: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{label}: n={} p50={:.3} ms p90={:.3} ms p99={:.3} ms max={:.3} ms",
        samples.len(),
        ms(percentile(&samples, 0.50)),
        ms(percentile(&samples, 0.90)),
        ms(percentile(&samples, 0.99)),
        ms(*samples.last().expect("at least one sample")),
    );
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(addr: std::net::SocketAddr, tls: &TlsConnector) -> Sender {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    let stream = tls
        .connect(ServerName::try_from("127.0.0.1").expect("an IP"), tcp)
        .await
        .expect("TLS handshake");
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("HTTP handshake");
    tokio::spawn(conn);
    sender
}

async fn post(sender: &mut Sender, body: Vec<u8>) {
    let req = Request::post("/validate?timeout=5s")
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("a request");
    sender.ready().await.expect("the connection is open");
    let resp = sender.send_request(req).await.expect("a response");
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.expect("a body").to_bytes();
    let review: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(review["response"]["allowed"], true, "{review}");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let requests: usize = std::env::args()
        .nth(1)
        .map(|n| n.parse().expect("REQUESTS is a number"))
        .unwrap_or(2000);

    let dir = tempfile::tempdir().expect("a temp dir");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("a key")).expect("a CA");
    let key = KeyPair::generate().expect("a key");
    let cert = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .expect("params")
        .signed_by(&key, &ca)
        .expect("a certificate");
    let (cert_file, key_file) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert_file, cert.pem()).expect("write");
    std::fs::write(&key_file, key.serialize_pem()).expect("write");

    let shared: Offers = Offers {
        mig: None,
        gpu: Some("gpu-1-shared".parse().expect("a device name")),
        serves: ["MPS".to_string()].into_iter().collect(),
        unshared: false,
    };
    let classes = FixedClasses(
        [("shared.gpu.tessera.dev".to_string(), shared)]
            .into_iter()
            .collect(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("an address");
    let tls = server_config(&cert_file, &key_file).expect("TLS");
    tokio::spawn(serve(listener, tls, Arc::new(classes)));

    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.pem().as_bytes()) {
        roots.add(c.expect("a certificate")).expect("a root");
    }
    let client = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tls = TlsConnector::from(Arc::new(client));

    let body_len = typical_review(0).len();
    println!(
        "webhook_bench: {requests} AdmissionReviews of a typical share claim ({body_len} bytes) to https://{addr}/validate"
    );
    let mut sender = connect(addr, &tls).await;
    for i in 0..100 {
        post(&mut sender, typical_review(i)).await;
    }
    let mut kept = Vec::with_capacity(requests);
    for i in 0..requests {
        let body = typical_review(i);
        let started = Instant::now();
        post(&mut sender, body).await;
        kept.push(started.elapsed());
    }
    print("one kept-alive connection (as the API server calls)", kept);

    let fresh_n = (requests / 10).max(1);
    let mut fresh = Vec::with_capacity(fresh_n);
    for i in 0..fresh_n {
        let body = typical_review(i);
        let started = Instant::now();
        let mut sender = connect(addr, &tls).await;
        post(&mut sender, body).await;
        fresh.push(started.elapsed());
    }
    print("a new TLS connection per request", fresh);
}
