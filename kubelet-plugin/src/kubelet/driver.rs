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

use crate::kubelet::error::{Error, Result};
use crate::kubelet::health_service::HealthService;
use crate::kubelet::registration::{RegistrationService, RegistrationState};
use crate::node::error::ClaimError;
use crate::node::state::{ClaimRef, NodeState, PreparedDevice};

/// File name of the registration socket in kubelet's registry directory when the plugin runs without a pod
/// UID (a host process, the local cluster): one instance per node.
pub fn registration_socket_name() -> String {
    format!("{DRIVER_NAME}-reg.sock")
}

/// `sun_path` holds 108 bytes including the terminating NUL, so a socket path has at most 107.
const MAX_SOCKET_PATH: usize = 107;

/// File name of the registration socket of the plugin instance in pod `pod_uid`, so that two instances (the
/// old and the new pod of a rolling update) register side by side. The names are the ones the Go
/// `kubeletplugin` helper uses with its `RollingUpdate(uid)` option, so an operator sees the same files
/// for tessera as for other drivers; in order of preference, the first whose path fits:
///
/// 1. `gpu.tessera.dev-<pod uid>-reg.sock`
/// 2. `gpu.tessera.dev-<base64url(SHA-256(pod uid)[..8])>-reg.sock`
/// 3. `dra-<base64url(SHA-256("gpu.tessera.dev" NUL pod uid)[..16])>-reg.sock`
///
/// Source: `RollingUpdateRegistrarSocketFile` in k8s.io/dynamic-resource-allocation v0.37.2,
/// `kubeletplugin/draplugin.go` (which allows 108 bytes; 107 is what `bind` accepts).
pub fn rolling_registration_socket_name(registry_dir: &Path, pod_uid: &str) -> String {
    use sha2::{Digest, Sha256};
    let uid_hash = Sha256::digest(pod_uid.as_bytes());
    let driver_uid_hash = Sha256::digest(format!("{DRIVER_NAME}\0{pod_uid}").as_bytes());
    let candidates = [
        format!("{DRIVER_NAME}-{pod_uid}-reg.sock"),
        format!("{DRIVER_NAME}-{}-reg.sock", base64_url(&uid_hash[..8])),
        format!("dra-{}-reg.sock", base64_url(&driver_uid_hash[..16])),
    ];
    let fits = |name: &String| registry_dir.join(name).as_os_str().len() <= MAX_SOCKET_PATH;
    let last = candidates[candidates.len() - 1].clone();
    candidates.into_iter().find(fits).unwrap_or(last)
}

/// File name of the DRA socket of the instance in pod `pod_uid`: `dra-<pod uid>.sock` as the Go helper
/// names it (`"dra" + uidPart + ".sock"`, same file), or, where that path would not fit, the pod UID's
/// hash as in [`rolling_registration_socket_name`] (`dra-<base64url(SHA-256(pod uid)[..8])>.sock`): the
/// helper has no such fallback, but this driver's plugin directory is its own, so nothing else reads the
/// name, and kubelet learns it from `GetInfo`.
pub fn rolling_dra_socket_name(plugin_dir: &Path, pod_uid: &str) -> String {
    use sha2::{Digest, Sha256};
    let full = format!("dra-{pod_uid}.sock");
    if plugin_dir.join(&full).as_os_str().len() <= MAX_SOCKET_PATH {
        return full;
    }
    format!(
        "dra-{}.sock",
        base64_url(&Sha256::digest(pod_uid.as_bytes())[..8])
    )
}

/// Unpadded base64url (RFC 4648 section 5), Go's `base64.RawURLEncoding`.
fn base64_url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

/// The two sockets of the plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketPaths {
    /// `<registry dir>/gpu.tessera.dev-reg.sock` (or the pod's name, see
    /// [`rolling_registration_socket_name`]), where kubelet discovers the plugin.
    pub registration: PathBuf,
    /// `<plugins dir>/gpu.tessera.dev/dra.sock` (`dra-<pod uid>.sock` in a pod), where kubelet calls
    /// `DRAPlugin`.
    pub dra: PathBuf,
}

impl SocketPaths {
    /// The standard paths under kubelet's registry and plugins directories. Relative directories are made
    /// absolute, because the DRA path goes to kubelet as the endpoint and kubelet has another working
    /// directory.
    pub fn new(registry_dir: &Path, plugins_dir: &Path) -> Self {
        Self::for_pod(registry_dir, plugins_dir, None)
    }

    /// The paths of the instance in pod `pod_uid`: names of its own, so that kubelet (1.33 and later)
    /// registers the new pod of a rolling update beside the old one and sends new calls to the newer
    /// (kubelet's `DRAPluginManager.get` in pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go, v1.37.2: the
    /// most recently registered instance that is connected). Without a UID, the fixed names.
    pub fn for_pod(registry_dir: &Path, plugins_dir: &Path, pod_uid: Option<&str>) -> Self {
        let absolute = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
        let (registry_dir, plugin_dir) = (absolute(registry_dir), absolute(plugins_dir).join(DRIVER_NAME));
        match pod_uid {
            None => Self {
                registration: registry_dir.join(registration_socket_name()),
                dra: plugin_dir.join("dra.sock"),
            },
            Some(uid) => Self {
                registration: registry_dir.join(rolling_registration_socket_name(&registry_dir, uid)),
                dra: plugin_dir.join(rolling_dra_socket_name(&plugin_dir, uid)),
            },
        }
    }

    /// The registration socket an instance without a pod UID (a plugin from before per-pod names) serves
    /// in the same registry directory.
    pub fn fixed_registration(&self) -> PathBuf {
        self.registration.with_file_name(registration_socket_name())
    }
}

/// Whether something listens on the unix socket at `path`. A socket file whose process is gone refuses
/// connections; one that is still bound accepts them (into its backlog) even before its server runs.
pub fn socket_is_live(path: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(path).is_ok()
}

/// Removes this driver's sockets of other instances that are gone (killed without their shutdown, which
/// removes them): registration sockets `gpu.tessera.dev-*reg.sock` in the registry directory and DRA
/// sockets `dra*.sock` in the driver's plugin directory, but only those that refuse connections, so a
/// live instance's socket is never touched (the old pod of a rolling update still serves). kubelet never
/// removes a registration socket itself; its plugin watcher deregisters an instance when the file goes
/// (pkg/kubelet/pluginmanager/pluginwatcher/plugin_watcher.go, v1.37.2), so a dead instance's socket left
/// in place stays registered, as not connected. The hashed `dra-…-reg.sock` fallback name is left alone:
/// it does not say which driver it belongs to. Returns what was removed.
pub fn remove_stale_sockets(own: &SocketPaths) -> Vec<PathBuf> {
    let ours_in = |dir: Option<&Path>, ours: fn(&str) -> bool| -> Vec<PathBuf> {
        let Some(entries) = dir.and_then(|d| std::fs::read_dir(d).ok()) else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_str().is_some_and(ours))
            .filter(|e| {
                use std::os::unix::fs::FileTypeExt;
                e.file_type().is_ok_and(|t| t.is_socket())
            })
            .map(|e| e.path())
            .filter(|p| *p != own.registration && *p != own.dra)
            .collect()
    };
    let mut candidates = ours_in(own.registration.parent(), |name| {
        name.starts_with(&format!("{DRIVER_NAME}-")) && name.ends_with("reg.sock")
    });
    candidates.extend(ours_in(own.dra.parent(), |name| {
        name.starts_with("dra") && name.ends_with(".sock")
    }));
    let refused = |path: &Path| {
        matches!(std::os::unix::net::UnixStream::connect(path),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused)
    };
    let mut removed = Vec::new();
    for path in candidates {
        // Asked twice: an instance starting this very moment has bound its socket but may not listen yet.
        if !refused(&path) {
            continue;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        if !refused(&path) {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {
                info!(socket = %path.display(), "removed the socket of a plugin instance that is gone");
                removed.push(path);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => warn!(socket = %path.display(), error = %e, "failed to remove a stale socket"),
        }
    }
    removed
}

/// The node state as the DRA services reach it. An instance that replaces another (a rolling update)
/// serves kubelet before it owns the state, so that kubelet can register it and the old pod can be
/// stopped; the calls it gets meanwhile wait here until the old instance has finished and released the
/// state directory ([`crate::node::state::StateLock`]).
#[derive(Clone)]
pub struct StateGate {
    state: watch::Receiver<Option<Arc<NodeState>>>,
    lock_path: PathBuf,
    released: DriverReleased,
}

/// Set while this instance waits, without the driver, for a GPU Operator driver upgrade to move on
/// (`gpu::driver_upgrade`): calls at the gate fail at once with its message (kubelet retries them) instead
/// of waiting for a state that comes only after the upgrade.
#[derive(Clone, Debug, Default)]
pub struct DriverReleased(Arc<std::sync::RwLock<Option<String>>>);

impl DriverReleased {
    /// Sets (or with `None` clears) the message the calls get.
    pub fn set(&self, message: Option<String>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = message;
    }

    fn get(&self) -> Option<String> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// How long a call waits for the handover: below kubelet's default 45 s deadline for a DRA call
/// (`defaultClientCallTimeout`, pkg/kubelet/cm/dra/plugin/dra_plugin.go, v1.37.2), so kubelet records this
/// plugin's reason rather than a bare deadline.
pub const HANDOVER_WAIT: std::time::Duration = std::time::Duration::from_secs(40);

impl StateGate {
    /// A gate that is open: the state is owned already.
    pub fn open(state: Arc<NodeState>) -> Self {
        let (tx, state) = watch::channel(Some(state));
        // The receiver keeps the last value after the sender is gone.
        drop(tx);
        Self {
            state,
            lock_path: PathBuf::new(),
            released: DriverReleased::default(),
        }
    }

    /// A closed gate, opened by sending the state once this instance owns the state directory whose lock
    /// file is `lock_path`. Dropping the sender unopened fails the waiting calls at once.
    pub fn closed(lock_path: PathBuf) -> (watch::Sender<Option<Arc<NodeState>>>, Self) {
        let (tx, state) = watch::channel(None);
        (
            tx,
            Self {
                state,
                lock_path,
                released: DriverReleased::default(),
            },
        )
    }

    /// The switch that makes the calls at this gate fail at once while the driver is released.
    pub fn released(&self) -> DriverReleased {
        self.released.clone()
    }

    /// The state, once owned; `None` when the handover did not finish within [`HANDOVER_WAIT`] or this
    /// instance stopped before it owned the state.
    async fn state(&self) -> Option<Arc<NodeState>> {
        let mut rx = self.state.clone();
        if let Some(state) = rx.borrow().clone() {
            return Some(state);
        }
        if self.released.get().is_some() {
            return None;
        }
        match tokio::time::timeout(HANDOVER_WAIT, rx.wait_for(|s| s.is_some())).await {
            Ok(Ok(state)) => state.clone(),
            _ => None,
        }
    }

    fn pending(&self) -> ClaimError {
        if let Some(message) = self.released.get() {
            return ClaimError::DriverReleased { message };
        }
        ClaimError::HandoverPending {
            path: self.lock_path.clone(),
            waited_secs: HANDOVER_WAIT.as_secs(),
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
    serve_gated(paths, StateGate::open(state), registration, None, shutdown).await
}

/// [`serve`] with a state that may not be owned yet: calls wait at the gate (see [`StateGate`]). On
/// shutdown the registration socket goes first, so kubelet sends new calls elsewhere, and calls in flight
/// finish before this returns.
pub async fn serve_gated(
    paths: &SocketPaths,
    state: StateGate,
    registration: watch::Sender<RegistrationState>,
    health: Option<HealthService>,
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
        // The health stream shares the DRA socket, as kubelet expects.
        .add_optional_service(health.clone().map(crate::kubelet::health_service::v1_server))
        .add_optional_service(
            health
                .clone()
                .map(crate::kubelet::health_service::v1alpha1_server),
        )
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
        .add_service(RegistrationServer::new({
            let service = RegistrationService::new(DRIVER_NAME, &paths.dra, registration);
            if health.is_some() {
                service.with_health()
            } else {
                service
            }
        }))
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
    state: StateGate,
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
        let results = match self.state.state().await {
            Some(state) => state.prepare_all(&claims).await,
            None => each_waits(claims, &self.state),
        };
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
        let results = match self.state.state().await {
            Some(state) => state.unprepare_all(&claims).await,
            None => each_waits(claims, &self.state),
        };
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

/// The handover error for every claim of a call, as per-claim errors (kubelet ignores a whole failed call).
fn each_waits<T>(claims: Vec<ClaimRef>, gate: &StateGate) -> Vec<(ClaimRef, Result<T, ClaimError>)> {
    claims.into_iter().map(|c| (c, Err(gate.pending()))).collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0d6f6a2e-5b7c-4e4f-9a7e-3c1f2b8e9d10";

    #[tokio::test]
    async fn calls_at_a_gate_of_a_released_driver_fail_at_once_naming_the_upgrade_and_wait_again_after_it() {
        use futures::FutureExt;
        let (_tx, gate) = StateGate::closed(PathBuf::from("/var/lib/tessera/plugin.lock"));
        let released = gate.released();
        released.set(Some(
            "the node's NVIDIA driver is being upgraded (nvidia.com/gpu-driver-upgrade-state=pod-restart-required)"
                .into(),
        ));
        // Answered without waiting for a state that comes only after the upgrade.
        assert_eq!(gate.state().now_or_never().map(|s| s.is_none()), Some(true));
        let e = gate.pending();
        assert!(e.is_transient(), "kubelet retries it");
        assert!(e.to_string().contains("pod-restart-required"), "{e}");
        released.set(None);
        assert!(
            gate.state().now_or_never().is_none(),
            "back to waiting for the handover"
        );
        assert!(matches!(gate.pending(), ClaimError::HandoverPending { .. }));
    }

    /// A registry directory whose path is `len` bytes long.
    fn dir_of_len(len: usize) -> PathBuf {
        let mut dir = String::from("/r");
        while dir.len() < len {
            dir.push('x');
        }
        PathBuf::from(dir)
    }

    #[test]
    fn a_pod_gets_its_own_socket_names_and_no_pod_gets_the_fixed_ones() {
        let fixed = SocketPaths::new(Path::new("/reg"), Path::new("/plugins"));
        assert_eq!(fixed.registration, Path::new("/reg/gpu.tessera.dev-reg.sock"));
        assert_eq!(fixed.dra, Path::new("/plugins/gpu.tessera.dev/dra.sock"));
        let pod = SocketPaths::for_pod(Path::new("/reg"), Path::new("/plugins"), Some(UID));
        assert_eq!(
            pod.registration,
            Path::new("/reg").join(format!("gpu.tessera.dev-{UID}-reg.sock"))
        );
        assert_eq!(
            pod.dra,
            Path::new("/plugins/gpu.tessera.dev").join(format!("dra-{UID}.sock"))
        );
        assert_eq!(pod.fixed_registration(), fixed.registration);
    }

    // The expected hashes were computed independently (Python's hashlib and urlsafe_b64encode), the way
    // the Go helper computes them.
    #[test]
    fn long_registry_paths_fall_back_to_the_go_helpers_hashed_names() {
        let uid_hash = rolling_registration_socket_name(&dir_of_len(60), UID);
        assert_eq!(uid_hash, "gpu.tessera.dev-EPelJdOvFx8-reg.sock");
        let driver_hash = rolling_registration_socket_name(&dir_of_len(71), UID);
        assert_eq!(driver_hash, "dra-Jf7lat0I86K2flxRVcHiNg-reg.sock");
        assert!(dir_of_len(71).join(&driver_hash).as_os_str().len() <= MAX_SOCKET_PATH);
        assert_eq!(
            rolling_dra_socket_name(&dir_of_len(80), UID),
            "dra-EPelJdOvFx8.sock"
        );
        assert_eq!(
            rolling_dra_socket_name(Path::new("/p"), UID),
            format!("dra-{UID}.sock")
        );
    }

    #[test]
    fn base64_url_is_unpadded_with_the_url_alphabet() {
        assert_eq!(base64_url(&[0xfb, 0xff]), "-_8");
        assert_eq!(base64_url(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_url(b"fo"), "Zm8");
    }

    #[test]
    fn only_the_sockets_of_gone_instances_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let own = SocketPaths::for_pod(&dir.path().join("reg"), &dir.path().join("plugins"), Some("new"));
        let other =
            |uid: &str| SocketPaths::for_pod(&dir.path().join("reg"), &dir.path().join("plugins"), Some(uid));
        std::fs::create_dir_all(own.dra.parent().unwrap()).unwrap();
        std::fs::create_dir_all(own.registration.parent().unwrap()).unwrap();
        let (live, dead) = (other("live"), other("dead"));
        let _live_reg = std::os::unix::net::UnixListener::bind(&live.registration).unwrap();
        let _live_dra = std::os::unix::net::UnixListener::bind(&live.dra).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&dead.registration).unwrap());
        drop(std::os::unix::net::UnixListener::bind(&dead.dra).unwrap());
        // Another driver's socket in the shared registry directory is never ours to judge.
        let foreign = dir.path().join("reg/other.example.com-reg.sock");
        drop(std::os::unix::net::UnixListener::bind(&foreign).unwrap());

        let mut removed = remove_stale_sockets(&own);
        removed.sort();
        let mut expected = vec![dead.registration.clone(), dead.dra.clone()];
        expected.sort();
        assert_eq!(removed, expected);
        assert!(live.registration.exists() && live.dra.exists() && foreign.exists());
    }
}
