//! Device health as kubelet sees it: registration lists both DRAResourceHealth versions, and
//! NodeWatchResources on the DRA socket streams a simulated GPU's XID, loss and recovery as the simulated
//! fault file changes, through the same monitor thread the plugin runs.

mod common;

use std::{sync::Arc, time::Duration};

use common::{TestNode, dial, wait_for_socket};
use tessera_kubelet_plugin::gpu::health::sources::SimulatedSource;
use tessera_kubelet_plugin::gpu::health::{Health, spawn_monitor};
use tessera_kubelet_plugin::kubelet::claims::fake::NODE;
use tessera_kubelet_plugin::kubelet::driver::{SocketPaths, StateGate, serve_gated};
use tessera_kubelet_plugin::kubelet::health_service::HealthService;
use tessera_kubelet_plugin::kubelet::registration::RegistrationState;
use tessera_proto::{
    health::{v1, v1alpha1},
    pluginregistration::{InfoRequest, registration_client::RegistrationClient},
};
use tessera_sim_model::faults::{Fault, SimulatedHealth};
use tokio::sync::watch;

/// `(device, healthy, message)` of one response.
type Report = Vec<(String, bool, String)>;

fn v1_report(r: v1::NodeWatchResourcesResponse) -> Report {
    r.devices
        .into_iter()
        .map(|d| {
            let healthy = d.health() == v1::HealthStatus::Healthy;
            let id = d.device.unwrap();
            assert_eq!(id.pool_name, NODE, "the pool is the node's");
            (id.device_name, healthy, d.message)
        })
        .collect()
}

/// The plugin's sockets with the health service, fed from the simulated fault file of `node`.
struct Plugin {
    paths: SocketPaths,
    faults: SimulatedHealth,
    stop: watch::Sender<bool>,
}

async fn start(node: &TestNode) -> Plugin {
    let paths = SocketPaths::new(
        &node.dir.path().join("plugins_registry"),
        &node.dir.path().join("plugins"),
    );
    let health = Health::new(0..2);
    let service = HealthService::new(health.clone(), NODE);
    service.set_devices(Arc::new(|| {
        vec!["gpu-0".into(), "gpu-1".into(), "gpu-1-mig-3g-40gb-4".into()]
    }));
    let faults = SimulatedHealth::new(&node.state_dir(), 2);
    let (stop, stopped) = watch::channel(false);
    spawn_monitor(
        Box::new(SimulatedSource::new(faults.clone(), vec![94])),
        health,
        Arc::new(|_, _| None),
        stopped.clone(),
    )
    .unwrap();
    serve(node, &paths, service, stopped).await;
    Plugin { paths, faults, stop }
}

/// Serves the DRA socket of `node` with `service` as its health service until `stopped` turns true; returns
/// once the registration socket is there.
async fn serve(
    node: &TestNode,
    paths: &SocketPaths,
    service: HealthService,
    mut stopped: watch::Receiver<bool>,
) {
    let (reg_tx, _registration) = watch::channel(RegistrationState::Pending);
    let (serve_paths, state) = (paths.clone(), node.state());
    tokio::spawn(async move {
        serve_gated(
            &serve_paths,
            StateGate::open(state),
            reg_tx,
            Some(service),
            async move {
                let _ = stopped.wait_for(|s| *s).await;
            },
        )
        .await
    });
    wait_for_socket(&paths.registration).await;
}

/// The next response on `stream` that differs from `last`, within `limit`.
async fn next_change(
    stream: &mut tonic::Streaming<v1::NodeWatchResourcesResponse>,
    last: &Report,
    limit: Duration,
) -> Report {
    tokio::time::timeout(limit, async {
        loop {
            let r = v1_report(stream.message().await.unwrap().expect("the stream stays open"));
            if &r != last {
                return r;
            }
        }
    })
    .await
    .expect("no health change reached the stream in time")
}

#[tokio::test(flavor = "multi_thread")]
async fn registration_advertises_the_health_service_in_both_versions_after_the_dra_service() {
    let node = TestNode::with_gpus(2);
    let plugin = start(&node).await;
    let mut reg = RegistrationClient::new(dial(&plugin.paths.registration).await);
    let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(
        info.supported_versions,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth"
        ]
    );
    plugin.stop.send_replace(true);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_injected_xid_makes_the_gpu_and_its_devices_unhealthy_on_the_stream_until_recovery() {
    let node = TestNode::with_gpus(2);
    let plugin = start(&node).await;
    let mut client =
        v1::dra_resource_health_client::DraResourceHealthClient::new(dial(&plugin.paths.dra).await);
    let mut stream = client
        .node_watch_resources(v1::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let healthy: Report = ["gpu-0", "gpu-1", "gpu-1-mig-3g-40gb-4"]
        .map(|d| (d.to_string(), true, String::new()))
        .into();
    let first = next_change(&mut stream, &vec![], Duration::from_secs(5)).await;
    assert_eq!(first, healthy);

    plugin.faults.inject(Fault::xid(1, 79)).unwrap();
    let sick = next_change(&mut stream, &first, Duration::from_secs(5)).await;
    let unhealthy: Vec<&str> = sick.iter().filter(|d| !d.1).map(|d| d.0.as_str()).collect();
    assert_eq!(unhealthy, ["gpu-1", "gpu-1-mig-3g-40gb-4"]);
    assert_eq!(sick[1].2, "critical XID 79 on GPU 1");

    plugin.faults.recover(1).unwrap();
    let well = next_change(&mut stream, &sick, Duration::from_secs(5)).await;
    assert_eq!(well, healthy);

    // An XID declared harmless (`--ignored-xids 94`) and an application XID change nothing.
    plugin.faults.inject(Fault::xid(0, 94)).unwrap();
    plugin.faults.inject(Fault::xid(0, 13)).unwrap();
    plugin.faults.inject(Fault::lost(0)).unwrap();
    let lost = next_change(&mut stream, &well, Duration::from_secs(5)).await;
    assert_eq!(
        lost[0],
        (
            "gpu-0".into(),
            false,
            "GPU 0 is lost (NVML_ERROR_GPU_IS_LOST)".into()
        )
    );
    assert!(lost[1].1, "GPU 1 stays healthy");
    plugin.stop.send_replace(true);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_1_36_kubelet_gets_the_same_stream_on_the_v1alpha1_path() {
    let node = TestNode::with_gpus(2);
    let plugin = start(&node).await;
    plugin.faults.inject(Fault::xid(0, 48)).unwrap();
    let mut client =
        v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(dial(&plugin.paths.dra).await);
    let mut stream = client
        .node_watch_resources(v1alpha1::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let found = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let r = stream.message().await.unwrap().unwrap();
            let gpu0 = r
                .devices
                .iter()
                .find(|d| d.device.as_ref().unwrap().device_name == "gpu-0")
                .cloned();
            if let Some(d) = gpu0.filter(|d| d.health() == v1alpha1::HealthStatus::Unhealthy) {
                return d;
            }
        }
    })
    .await
    .expect("gpu-0 never reported unhealthy on v1alpha1");
    assert_eq!(found.health_check_timeout_seconds, 30);
    assert!(found.last_updated_time > 0);
    plugin.stop.send_replace(true);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_device_of_a_newly_prepared_claim_is_sent_without_waiting_for_the_resend() {
    let node = TestNode::with_gpus(2);
    let paths = SocketPaths::new(
        &node.dir.path().join("plugins_registry"),
        &node.dir.path().join("plugins"),
    );
    let health = Health::new(0..2);
    let service = HealthService::new(health, NODE);
    let devices = Arc::new(std::sync::Mutex::new(vec!["gpu-0".to_string()]));
    let listed = devices.clone();
    service.set_devices(Arc::new(move || listed.lock().unwrap().clone()));
    let (stop, stopped) = watch::channel(false);
    serve(&node, &paths, service, stopped).await;
    let mut client = v1::dra_resource_health_client::DraResourceHealthClient::new(dial(&paths.dra).await);
    let mut stream = client
        .node_watch_resources(v1::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let first = next_change(&mut stream, &vec![], Duration::from_secs(5)).await;
    assert_eq!(first.len(), 1);
    devices.lock().unwrap().push("gpu-1-shared".into());
    // Well inside the 10 s resend: the list is compared every second.
    let second = next_change(&mut stream, &first, Duration::from_secs(4)).await;
    assert_eq!(second[1], ("gpu-1-shared".into(), true, String::new()));
    stop.send_replace(true);
}
