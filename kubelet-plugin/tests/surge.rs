//! A rolling update with `maxSurge`: two plugin processes (the old and the new pod) on one node, over the
//! same kubelet directories and state directory, each with its own pod UID, as kubelet sees them through
//! their real sockets. The API server is a small HTTP stand-in that serves the claims (and can hold one
//! answer back, to keep a call of the old instance in flight).

mod common;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use k8s_openapi::api::resource::v1::ResourceClaim;
use tessera_kubelet_plugin::kubelet::claims::fake::{NODE, claim};
use tessera_kubelet_plugin::kubelet::driver::SocketPaths;
use tessera_kubelet_plugin::node::checkpoint::{CheckpointStore, Loaded};
use tessera_proto::{
    dra::v1,
    pluginregistration::{InfoRequest, RegistrationStatus, registration_client::RegistrationClient},
};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpListener,
    sync::watch,
};

const BIN: &str = env!("CARGO_BIN_EXE_tessera-kubelet-plugin");
const BOOT_ID: &str = "boot-1";
const OLD_POD: &str = "0b3c1a52-8f0e-4f51-9b43-6a1d1e0c0a01";
const NEW_POD: &str = "7e9d2c44-1c6b-4a4e-8f3a-2b5e9d8c0b02";
const NEXT_POD: &str = "c2a8e1f0-3d5b-4c7e-a9f1-4e6b8d0a1c03";

// === the API server stand-in ===

/// Serves `GET` and `LIST` of ResourceClaims from a map, 404 for everything else (the plugin's inventory
/// writes fail and are retried, which this test does not look at). The claim named in `held` is answered
/// only once `held` is released.
#[derive(Clone)]
struct ApiServer {
    url: String,
    claims: Arc<Mutex<BTreeMap<String, ResourceClaim>>>,
    held: Arc<Mutex<Option<String>>>,
    release: watch::Sender<bool>,
    /// How many requests for the held claim arrived.
    held_asked: watch::Sender<u32>,
}

impl ApiServer {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let server = Self {
            url: format!("http://{}", listener.local_addr().unwrap()),
            claims: Arc::default(),
            held: Arc::default(),
            release: watch::channel(false).0,
            held_asked: watch::channel(0).0,
        };
        let s = server.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(s.clone().serve(conn));
            }
        });
        server
    }

    fn with(self, c: ResourceClaim) -> Self {
        let name = c.metadata.name.clone().unwrap();
        self.claims.lock().unwrap().insert(name, c);
        self
    }

    fn holding(self, name: &str) -> Self {
        *self.held.lock().unwrap() = Some(name.to_string());
        self
    }

    /// HTTP/1.1 with keep-alive, as kube's client speaks it.
    async fn serve(self, conn: tokio::net::TcpStream) {
        let (read, mut write) = conn.into_split();
        let mut read = BufReader::new(read);
        loop {
            let mut request_line = String::new();
            if read.read_line(&mut request_line).await.unwrap_or(0) == 0 {
                return;
            }
            let mut body_len = 0;
            loop {
                let mut header = String::new();
                if read.read_line(&mut header).await.unwrap_or(0) == 0 {
                    return;
                }
                if header == "\r\n" {
                    break;
                }
                if let Some((name, value)) = header.split_once(':')
                    && name.eq_ignore_ascii_case("content-length")
                {
                    body_len = value.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; body_len];
            if read.read_exact(&mut body).await.is_err() {
                return;
            }
            let path = request_line.split_whitespace().nth(1).unwrap_or("/").to_string();
            let (status, json) = self.answer(&path).await;
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{json}",
                json.len()
            );
            if write.write_all(response.as_bytes()).await.is_err() {
                return;
            }
        }
    }

    async fn answer(&self, path: &str) -> (&'static str, String) {
        let path = path.split('?').next().unwrap_or_default();
        let not_found = || {
            (
                "404 Not Found",
                r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404}"#
                    .to_string(),
            )
        };
        if path == "/apis/resource.k8s.io/v1/resourceclaims" {
            let items: Vec<ResourceClaim> = self.claims.lock().unwrap().values().cloned().collect();
            let list = serde_json::json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimList", "metadata": {},
                "items": items,
            });
            return ("200 OK", list.to_string());
        }
        let Some(name) = path.strip_prefix("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/")
        else {
            return not_found();
        };
        if self.held.lock().unwrap().as_deref() == Some(name) {
            self.held_asked.send_modify(|n| *n += 1);
            let _ = self.release.subscribe().wait_for(|r| *r).await;
        }
        match self.claims.lock().unwrap().get(name) {
            Some(c) => ("200 OK", serde_json::to_string(c).unwrap()),
            None => not_found(),
        }
    }
}

// === a plugin process ===

/// One plugin instance: the binary with the simulated backend, every directory under `node_dir`.
struct Plugin {
    child: Child,
    paths: SocketPaths,
}

struct PluginBuilder<'a> {
    node_dir: &'a Path,
    api: &'a ApiServer,
    pod_uid: &'a str,
    log: Option<PathBuf>,
}

fn plugin<'a>(node_dir: &'a Path, api: &'a ApiServer) -> PluginBuilder<'a> {
    PluginBuilder {
        node_dir,
        api,
        pod_uid: OLD_POD,
        log: None,
    }
}

impl PluginBuilder<'_> {
    fn in_pod(mut self, pod_uid: &'static str) -> Self {
        self.pod_uid = pod_uid;
        self
    }

    /// Its log (stderr) goes to `path`, for a test that waits for what the plugin says it does.
    fn logging_to(mut self, path: PathBuf) -> Self {
        self.log = Some(path);
        self
    }

    async fn start(self) -> Plugin {
        let d = self.node_dir;
        std::fs::write(d.join("boot_id"), format!("{BOOT_ID}\n")).unwrap();
        std::fs::write(
            d.join("node.yaml"),
            "gpus:\n  - model: H100-SXM5-80GB\n    count: 8\n",
        )
        .unwrap();
        let child = common::plugin_command(d, NODE, &d.join("node.yaml"), &self.api.url)
            .args(["--heartbeat-interval", "60"])
            .env("POD_UID", self.pod_uid)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(match &self.log {
                Some(path) => Stdio::from(std::fs::File::create(path).unwrap()),
                None => Stdio::null(),
            })
            .spawn()
            .unwrap();
        let paths = SocketPaths::for_pod(&d.join("registry"), &d.join("plugins"), Some(self.pod_uid));
        common::wait_for_socket(&paths.registration).await;
        Plugin { child, paths }
    }
}

impl Plugin {
    /// kubelet's registration handshake; returns the DRA endpoint the plugin announced.
    async fn register(&self) -> String {
        let mut reg = RegistrationClient::new(common::dial(&self.paths.registration).await);
        let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
        assert_eq!(
            info.name, "gpu.tessera.dev",
            "kubelet groups instances by driver name"
        );
        reg.notify_registration_status(RegistrationStatus {
            plugin_registered: true,
            error: String::new(),
        })
        .await
        .unwrap();
        info.endpoint
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Waits for the process to exit (it must, within the test's patience) and returns its status.
    async fn exited(&mut self) -> std::process::ExitStatus {
        for _ in 0..600 {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("plugin {} did not exit", self.paths.registration.display());
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// === kubelet's calls ===

fn kubelet_claim(c: &ResourceClaim) -> v1::Claim {
    v1::Claim {
        namespace: "default".into(),
        name: c.metadata.name.clone().unwrap(),
        uid: c.metadata.uid.clone().unwrap(),
    }
}

async fn dra(endpoint: &str) -> v1::dra_plugin_client::DraPluginClient<tonic::transport::Channel> {
    v1::dra_plugin_client::DraPluginClient::new(common::dial(Path::new(endpoint)).await)
}

/// Prepares one claim and returns its per-claim error text ("" on success).
async fn prepare(endpoint: String, c: v1::Claim) -> String {
    let uid = c.uid.clone();
    let response = dra(&endpoint)
        .await
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims: vec![c] })
        .await
        .unwrap()
        .into_inner();
    response.claims[&uid].error.clone()
}

/// Waits until the plugin's log at `path` says `text`.
async fn logged(path: &Path, text: &str) {
    for _ in 0..600 {
        if std::fs::read_to_string(path).is_ok_and(|l| l.contains(text)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "the plugin never logged {text:?}:\n{}",
        std::fs::read_to_string(path).unwrap_or_default()
    );
}

fn checkpoint_claims(node_dir: &Path) -> Vec<String> {
    match CheckpointStore::new(&node_dir.join("state"))
        .load(BOOT_ID)
        .unwrap()
    {
        Loaded::Current(cp) => cp.claims.into_keys().collect(),
        other => panic!("expected a checkpoint of this boot, found {other:?}"),
    }
}

fn cdi_spec(node_dir: &Path, uid: &str) -> PathBuf {
    node_dir
        .join("cdi")
        .join(format!("k8s.gpu.tessera.dev-claim_{uid}.json"))
}

fn in_use(name: &str, device: &str) -> ResourceClaim {
    claim(name)
        .allocated(device)
        .reserved_for_pod(&format!("pod-{name}"))
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_pod_registers_beside_the_old_one_and_takes_over_its_claims_once_the_old_one_has_finished() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (before, in_flight, during) = (
        in_use("before", "gpu-0"),
        in_use("in-flight", "gpu-1"),
        in_use("during", "gpu-2"),
    );
    let api = ApiServer::start()
        .await
        .with(before.clone())
        .with(in_flight.clone())
        .with(during.clone())
        .holding("in-flight");

    let mut old = plugin(d, &api).in_pod(OLD_POD).start().await;
    let old_endpoint = old.register().await;
    assert_eq!(prepare(old_endpoint.clone(), kubelet_claim(&before)).await, "");
    // A call the old instance is still busy with when it is told to stop: its claim's read is held back.
    let old_call = tokio::spawn(prepare(old_endpoint.clone(), kubelet_claim(&in_flight)));
    let _ = api.held_asked.subscribe().wait_for(|n| *n > 0).await;

    let new = plugin(d, &api).in_pod(NEW_POD).start().await;
    let new_endpoint = new.register().await;
    assert_ne!(new.paths.registration, old.paths.registration);
    assert_ne!(new_endpoint, old_endpoint);
    assert!(old.paths.registration.exists() && Path::new(&old_endpoint).exists());
    assert!(new.paths.registration.exists() && Path::new(&new_endpoint).exists());

    // kubelet sends new calls to the instance registered last; the DaemonSet then stops the old pod.
    let new_call = tokio::spawn(prepare(new_endpoint.clone(), kubelet_claim(&during)));
    old.signal("-TERM");
    for _ in 0..200 {
        if !old.paths.registration.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !old.paths.registration.exists(),
        "the old instance keeps its registration socket after SIGTERM, so kubelet keeps sending it calls"
    );
    assert!(
        old.child.try_wait().unwrap().is_none(),
        "the old instance exited with a call in flight"
    );
    assert!(
        !new_call.is_finished(),
        "the new instance answered while the old one still owned the node state"
    );

    api.release.send_replace(true);
    assert_eq!(
        old_call.await.unwrap(),
        "",
        "the old instance's call in flight failed"
    );
    assert!(old.exited().await.success());
    assert!(
        !Path::new(&old_endpoint).exists(),
        "the old instance left its DRA socket"
    );
    assert_eq!(
        new_call.await.unwrap(),
        "",
        "the prepare sent to the new instance failed"
    );

    let uid = |c: &ResourceClaim| c.metadata.uid.clone().unwrap();
    let mut expected = vec![uid(&before), uid(&in_flight), uid(&during)];
    expected.sort();
    assert_eq!(
        checkpoint_claims(d),
        expected,
        "a claim's record was lost in the handover"
    );

    // The new instance unprepares what the old one prepared.
    let response = dra(&new_endpoint)
        .await
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![kubelet_claim(&before)],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.claims[&uid(&before)].error, "");
    assert!(!cdi_spec(d, &uid(&before)).exists());
    assert!(!checkpoint_claims(d).contains(&uid(&before)));
    assert!(cdi_spec(d, &uid(&during)).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instances_sockets_are_removed_by_the_next_one_and_a_live_ones_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let api = ApiServer::start().await.with(in_use("kept", "gpu-4"));

    let mut killed = plugin(d, &api).in_pod(OLD_POD).start().await;
    let killed_endpoint = killed.register().await;
    killed.signal("-KILL");
    killed.exited().await;
    assert!(
        killed.paths.registration.exists(),
        "SIGKILL runs no cleanup, so the sockets stay"
    );
    assert!(Path::new(&killed_endpoint).exists());

    let live = plugin(d, &api).in_pod(NEW_POD).start().await;
    let live_endpoint = live.register().await;
    assert!(
        !killed.paths.registration.exists(),
        "the dead instance's registration socket is left"
    );
    assert!(
        !Path::new(&killed_endpoint).exists(),
        "the dead instance's DRA socket is left"
    );

    // A third instance (the next roll) finds the second one alive and leaves its sockets alone.
    let next = plugin(d, &api).in_pod(NEXT_POD).start().await;
    next.register().await;
    assert!(live.paths.registration.exists() && Path::new(&live_endpoint).exists());
    assert!(next.paths.registration.exists());
}

#[test]
fn a_pod_uid_that_could_leave_the_socket_directory_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["--node-name", NODE, "--pod-uid", "../../etc/x"])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env_remove("POD_UID")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid --pod-uid / POD_UID \"../../etc/x\""),
        "{stderr}"
    );
    assert!(stderr.contains("metadata.uid"), "{stderr}");
    assert!(
        !dir.path().join("state").exists(),
        "the plugin touched the node before refusing"
    );
}

/// A plugin from before per-pod socket names serves on the fixed name and takes no state lock; here its
/// socket is a listener the test holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_from_before_per_pod_names_is_waited_for_although_it_holds_no_lock() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let c = in_use("after-upgrade", "gpu-5");
    let api = ApiServer::start().await.with(c.clone());
    let legacy_socket = d.join("registry/gpu.tessera.dev-reg.sock");
    std::fs::create_dir_all(legacy_socket.parent().unwrap()).unwrap();
    let legacy = std::os::unix::net::UnixListener::bind(&legacy_socket).unwrap();

    let log = d.join("new.log");
    let new = plugin(d, &api)
        .in_pod(NEW_POD)
        .logging_to(log.clone())
        .start()
        .await;
    let endpoint = new.register().await;
    let call = tokio::spawn(prepare(endpoint, kubelet_claim(&c)));
    logged(
        &log,
        "a plugin instance without per-pod socket names serves on this node",
    )
    .await;
    assert!(
        !call.is_finished(),
        "the new instance answered while the old one still served"
    );
    assert!(
        !d.join("state/checkpoint.json").exists(),
        "the new instance loaded the node state while the old one still served"
    );
    assert!(
        legacy_socket.exists(),
        "the live old instance's socket was removed"
    );

    // The old instance exits: its shutdown removes its socket.
    drop(legacy);
    std::fs::remove_file(&legacy_socket).unwrap();
    assert_eq!(call.await.unwrap(), "");
    assert_eq!(checkpoint_claims(d), vec![c.metadata.uid.clone().unwrap()]);
}
