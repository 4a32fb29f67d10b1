//! The plugin as kubelet sees it: real unix sockets in a temp dir, kubelet's calls in kubelet's order.

mod common;

use std::{sync::Arc, time::Duration};

use common::{TestNode, dial, wait_for_socket};
use tessera_kubelet_plugin::kubelet::claims::fake::{NODE, claim};
use tessera_kubelet_plugin::kubelet::driver::{SocketPaths, serve};
use tessera_kubelet_plugin::kubelet::registration::RegistrationState;
use tessera_kubelet_plugin::node::state::NodeState;
use tessera_proto::{
    dra::{v1, v1beta1},
    pluginregistration::{InfoRequest, RegistrationStatus, registration_client::RegistrationClient},
};
use tokio::{sync::watch, task::JoinHandle};

/// A plugin serving in the background.
struct Running {
    paths: SocketPaths,
    registration: watch::Receiver<RegistrationState>,
    stop: watch::Sender<bool>,
    task: JoinHandle<tessera_kubelet_plugin::kubelet::error::Result<()>>,
}

async fn start(node: &TestNode, state: Arc<NodeState>) -> Running {
    let paths = SocketPaths::new(
        &node.dir.path().join("plugins_registry"),
        &node.dir.path().join("plugins"),
    );
    let (reg_tx, registration) = watch::channel(RegistrationState::Pending);
    let (stop, mut stopped) = watch::channel(false);
    let serve_paths = paths.clone();
    let task = tokio::spawn(async move {
        serve(&serve_paths, state, reg_tx, async move {
            let _ = stopped.wait_for(|s| *s).await;
        })
        .await
    });
    wait_for_socket(&paths.registration).await;
    Running {
        paths,
        registration,
        stop,
        task,
    }
}

impl Running {
    async fn shut_down(self) {
        self.stop.send_replace(true);
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("the plugin did not shut down; serve likely ignores the shutdown signal")
            .unwrap()
            .unwrap();
    }
}

/// kubelet's registration handshake: GetInfo on the registration socket, then NotifyRegistrationStatus.
async fn register(running: &mut Running) -> String {
    let mut reg = RegistrationClient::new(dial(&running.paths.registration).await);
    let info = reg.get_info(InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.tessera.dev");
    assert_eq!(info.supported_versions, vec!["v1.DRAPlugin", "v1beta1.DRAPlugin"]);
    assert!(
        info.endpoint.starts_with('/'),
        "endpoint {} is not absolute",
        info.endpoint
    );
    assert!(
        info.endpoint.ends_with("/plugins/gpu.tessera.dev/dra.sock"),
        "{}",
        info.endpoint
    );
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: true,
        error: String::new(),
    })
    .await
    .unwrap();
    running
        .registration
        .wait_for(|s| *s == RegistrationState::Registered)
        .await
        .unwrap();
    info.endpoint
}

#[tokio::test]
async fn kubelet_v1_registers_prepares_and_unprepares_a_whole_gpu_over_the_sockets() {
    let node = TestNode::new();
    let c = claim("train").namespace("ml").allocated("gpu-3").build();
    let uid = c.metadata.uid.clone().unwrap();
    node.claims.insert(c);
    let mut running = start(&node, node.state()).await;

    let endpoint = register(&mut running).await;
    let mut dra = v1::dra_plugin_client::DraPluginClient::new(dial(endpoint.as_ref()).await);
    let kubelet_claim = v1::Claim {
        namespace: "ml".into(),
        uid: uid.clone(),
        name: "train".into(),
    };

    let response = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: vec![kubelet_claim.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    let prepared = &response.claims[&uid];
    assert_eq!(prepared.error, "");
    assert_eq!(
        prepared.devices,
        vec![v1::Device {
            request_names: vec!["gpu".into()],
            pool_name: NODE.into(),
            device_name: "gpu-3".into(),
            cdi_device_ids: vec![format!("k8s.gpu.tessera.dev/claim={uid}-gpu-3")],
            share_id: None,
        }]
    );
    assert!(
        node.cdi_dir()
            .join(format!("k8s.gpu.tessera.dev-claim_{uid}.json"))
            .exists()
    );

    let response = dra
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
            claims: vec![kubelet_claim],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.claims[&uid].error, "");
    assert!(
        !node
            .cdi_dir()
            .join(format!("k8s.gpu.tessera.dev-claim_{uid}.json"))
            .exists()
    );

    let paths = running.paths.clone();
    running.shut_down().await;
    assert!(!paths.registration.exists(), "registration socket left behind");
    assert!(!paths.dra.exists(), "DRA socket left behind");
}

#[tokio::test]
async fn kubelet_v1beta1_prepares_and_unprepares_over_the_same_socket() {
    let node = TestNode::new();
    let c = claim("infer").allocated("gpu-0").allocated("gpu-7").build();
    let uid = c.metadata.uid.clone().unwrap();
    node.claims.insert(c);
    let mut running = start(&node, node.state()).await;

    let endpoint = register(&mut running).await;
    let mut dra = v1beta1::dra_plugin_client::DraPluginClient::new(dial(endpoint.as_ref()).await);
    let kubelet_claim = v1beta1::Claim {
        namespace: "default".into(),
        uid: uid.clone(),
        name: "infer".into(),
    };
    let response = dra
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest {
            claims: vec![kubelet_claim.clone()],
        })
        .await
        .unwrap()
        .into_inner();
    let prepared = &response.claims[&uid];
    assert_eq!(prepared.error, "");
    let names: Vec<_> = prepared.devices.iter().map(|d| d.device_name.as_str()).collect();
    assert_eq!(names, ["gpu-0", "gpu-7"]);
    assert_eq!(
        prepared.devices[1].cdi_device_ids,
        vec![format!("k8s.gpu.tessera.dev/claim={uid}-gpu-7")]
    );

    let response = dra
        .node_unprepare_resources(v1beta1::NodeUnprepareResourcesRequest {
            claims: vec![kubelet_claim],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(response.claims[&uid].error, "");
    running.shut_down().await;
}

#[tokio::test]
async fn one_bad_claim_fails_alone_and_the_rest_of_the_batch_is_prepared() {
    let node = TestNode::new();
    let good = claim("good").allocated("gpu-1").build();
    let bad = claim("bad").allocated("gpu-42").build();
    let (good_uid, bad_uid) = (
        good.metadata.uid.clone().unwrap(),
        bad.metadata.uid.clone().unwrap(),
    );
    node.claims.insert(good).insert(bad);
    let mut running = start(&node, node.state()).await;
    let endpoint = register(&mut running).await;
    let mut dra = v1::dra_plugin_client::DraPluginClient::new(dial(endpoint.as_ref()).await);

    let claims = vec![
        v1::Claim {
            namespace: "default".into(),
            uid: good_uid.clone(),
            name: "good".into(),
        },
        v1::Claim {
            namespace: "default".into(),
            uid: bad_uid.clone(),
            name: "bad".into(),
        },
        v1::Claim {
            namespace: "default".into(),
            uid: "no-such-uid".into(),
            name: "missing".into(),
        },
    ];
    let response = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        response.claims.len(),
        3,
        "every claim must have an entry, or kubelet retries it"
    );
    assert_eq!(response.claims[&good_uid].error, "");
    assert_eq!(response.claims[&good_uid].devices.len(), 1);
    assert!(
        response.claims[&bad_uid].error.contains("gpu-42"),
        "{}",
        response.claims[&bad_uid].error
    );
    assert!(response.claims[&bad_uid].devices.is_empty());
    assert!(
        response.claims["no-such-uid"].error.contains("not found"),
        "{}",
        response.claims["no-such-uid"].error
    );
    running.shut_down().await;
}

#[tokio::test]
async fn a_share_id_from_the_allocation_reaches_v1_kubelets() {
    // The shared-device preparer is not wired yet, so a stand-in preparer that exposes the GPU is registered
    // for the Shared kind; what is tested is that the share id travels from the allocation to kubelet.
    use tessera_kubelet_plugin::node::state::{DeviceKind, WholeGpuPreparer};
    let node = TestNode::new();
    let c = claim("s").allocated_share("gpu-2-shared", "share-abc").build();
    let uid = c.metadata.uid.clone().unwrap();
    node.claims.insert(c);
    struct AsWholeGpu;
    impl tessera_kubelet_plugin::node::state::DevicePreparer for AsWholeGpu {
        fn plan(
            &self,
            ctx: &tessera_kubelet_plugin::node::state::DeviceContext,
        ) -> Result<
            tessera_kubelet_plugin::node::checkpoint::DeviceDetail,
            tessera_kubelet_plugin::node::error::ClaimError,
        > {
            WholeGpuPreparer.plan(ctx)
        }
        fn prepare(
            &self,
            ctx: &tessera_kubelet_plugin::node::state::DeviceContext,
            planned: tessera_kubelet_plugin::node::checkpoint::DeviceDetail,
        ) -> Result<
            (
                tessera_kubelet_plugin::node::checkpoint::DeviceDetail,
                tessera_kubelet_plugin::node::cdi::ContainerEdits,
            ),
            tessera_kubelet_plugin::node::error::ClaimError,
        > {
            WholeGpuPreparer.prepare(ctx, planned)
        }
        fn unprepare(
            &self,
            _: &tessera_kubelet_plugin::node::state::DeviceContext,
            _: &tessera_kubelet_plugin::node::checkpoint::DeviceDetail,
        ) -> Result<(), tessera_kubelet_plugin::node::error::ClaimError> {
            Ok(())
        }
    }
    let state = node
        .state_unrecovered(common::BOOT_ID)
        .with_preparer(DeviceKind::Shared, Arc::new(AsWholeGpu));
    state.recover().unwrap();
    let mut running = start(&node, Arc::new(state)).await;
    let endpoint = register(&mut running).await;

    let claims = vec![v1::Claim {
        namespace: "default".into(),
        uid: uid.clone(),
        name: "s".into(),
    }];
    let mut dra = v1::dra_plugin_client::DraPluginClient::new(dial(endpoint.as_ref()).await);
    let response = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: claims.clone(),
        })
        .await
        .unwrap();
    assert_eq!(
        response.get_ref().claims[&uid].devices[0].share_id.as_deref(),
        Some("share-abc")
    );

    // v1beta1 has no share id field; the device is still returned.
    let mut beta = v1beta1::dra_plugin_client::DraPluginClient::new(dial(endpoint.as_ref()).await);
    let claims = vec![v1beta1::Claim {
        namespace: "default".into(),
        uid: uid.clone(),
        name: "s".into(),
    }];
    let response = beta
        .node_prepare_resources(v1beta1::NodePrepareResourcesRequest { claims })
        .await
        .unwrap();
    assert_eq!(
        response.get_ref().claims[&uid].devices[0].device_name,
        "gpu-2-shared"
    );
    running.shut_down().await;
}

#[tokio::test]
async fn a_rejected_registration_is_published_with_kubelets_reason() {
    let node = TestNode::new();
    let mut running = start(&node, node.state()).await;
    let mut reg = RegistrationClient::new(dial(&running.paths.registration).await);
    reg.notify_registration_status(RegistrationStatus {
        plugin_registered: false,
        error: "unsupported versions".into(),
    })
    .await
    .unwrap();
    let state = running
        .registration
        .wait_for(|s| *s != RegistrationState::Pending)
        .await
        .unwrap()
        .clone();
    assert_eq!(state, RegistrationState::Failed("unsupported versions".into()));
    running.shut_down().await;
}

#[tokio::test]
async fn stale_sockets_from_a_crashed_run_are_replaced_at_start() {
    let node = TestNode::new();
    let paths = SocketPaths::new(
        &node.dir.path().join("plugins_registry"),
        &node.dir.path().join("plugins"),
    );
    for p in [&paths.registration, &paths.dra] {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        // A socket file nobody listens on, as a SIGKILLed plugin leaves it.
        drop(std::os::unix::net::UnixListener::bind(p).unwrap());
        assert!(p.exists());
    }
    let mut running = start(&node, node.state()).await;
    register(&mut running).await;
    running.shut_down().await;
}

/// HPACK "literal header field without indexing, new name" (RFC 7541 6.2.2), no Huffman coding.
fn hpack_literal(block: &mut Vec<u8>, name: &str, value: &str) {
    fn string(block: &mut Vec<u8>, s: &str) {
        // 7-bit prefix integer (RFC 7541 5.1) with the Huffman bit clear.
        let mut len = s.len();
        if len < 127 {
            block.push(len as u8);
        } else {
            block.push(127);
            len -= 127;
            while len >= 128 {
                block.push((len % 128 + 128) as u8);
                len /= 128;
            }
            block.push(len as u8);
        }
        block.extend_from_slice(s.as_bytes());
    }
    block.push(0x00);
    string(block, name);
    string(block, value);
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// kubelet 1.36's plugin manager dials the registration socket by its bare path, and grpc-go then sends
/// the path, percent-encoded, as `:authority`. Upstream h2 resets such a stream with PROTOCOL_ERROR, so
/// kubelet never registers the plugin; tessera patches h2 (third_party/README.md). The request is written
/// frame by frame because Rust HTTP clients refuse to send such an authority at all.
#[tokio::test]
async fn get_info_is_answered_when_the_authority_is_the_percent_encoded_socket_path_as_grpc_go_sends_it() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let node = TestNode::with_gpus(1);
    let running = start(&node, node.state()).await;
    let authority = running.paths.registration.to_string_lossy().replace('/', "%2F");

    let mut block = Vec::new();
    for (name, value) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/pluginregistration.Registration/GetInfo"),
        (":authority", authority.as_str()),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ] {
        hpack_literal(&mut block, name, value);
    }
    let mut request = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    request.extend(frame(0x4, 0, 0, &[])); // SETTINGS
    request.extend(frame(0x1, 0x4, 1, &block)); // HEADERS, END_HEADERS
    request.extend(frame(0x0, 0x1, 1, &[0, 0, 0, 0, 0])); // DATA: empty InfoRequest, END_STREAM

    let mut conn = tokio::net::UnixStream::connect(&running.paths.registration)
        .await
        .unwrap();
    conn.write_all(&request).await.unwrap();

    let mut answer = Vec::new();
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let mut header = [0u8; 9];
            conn.read_exact(&mut header).await?;
            let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
            let (kind, flags) = (header[3], header[4]);
            let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
            let mut payload = vec![0u8; len];
            conn.read_exact(&mut payload).await?;
            match (kind, stream) {
                (0x4, 0) if flags & 0x1 == 0 => conn.write_all(&frame(0x4, 0x1, 0, &[])).await?,
                (0x3, 1) => return Ok::<_, std::io::Error>(Err(payload)),
                (0x0, 1) => answer.extend_from_slice(&payload),
                (0x1, 1) if flags & 0x1 != 0 => return Ok(Ok(())), // trailers end the call
                _ => {}
            }
        }
    })
    .await
    .expect("no answer within 10 s")
    .expect("connection failed");
    if let Err(code) = outcome {
        panic!(
            "the stream was reset with error code {code:?}; is the h2 patch in third_party/ still applied?"
        );
    }
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.contains("gpu.tessera.dev"),
        "GetInfo answer lacks the driver name: {text:?}"
    );
    assert!(
        text.contains("v1.DRAPlugin"),
        "GetInfo answer lacks the services: {text:?}"
    );
    // Graceful shutdown waits for open connections.
    drop(conn);
    running.shut_down().await;
}

#[tokio::test]
async fn with_a_corrupted_checkpoint_the_plugin_registers_and_each_claim_error_names_the_file_and_the_fix() {
    let node = TestNode::new();
    let c = claim("train").namespace("ml").allocated("gpu-3").build();
    let uid = c.metadata.uid.clone().unwrap();
    node.claims.insert(c);
    let checkpoint = node.state_dir().join("checkpoint.json");
    std::fs::create_dir_all(node.state_dir()).unwrap();
    std::fs::write(&checkpoint, b"{\"version\": 1, \"checks").unwrap();
    let state = Arc::new(node.state_unrecovered(common::BOOT_ID));
    state.start().await.unwrap();
    let mut running = start(&node, state).await;

    // kubelet would otherwise say "driver gpu.tessera.dev is not registered" and nothing more.
    let endpoint = register(&mut running).await;
    let mut dra = v1::dra_plugin_client::DraPluginClient::new(dial(endpoint.as_ref()).await);
    let claims = vec![v1::Claim {
        namespace: "ml".into(),
        uid: uid.clone(),
        name: "train".into(),
    }];
    let prepared = dra
        .node_prepare_resources(v1::NodePrepareResourcesRequest {
            claims: claims.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    let unprepared = dra
        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims })
        .await
        .unwrap()
        .into_inner();
    for error in [&prepared.claims[&uid].error, &unprepared.claims[&uid].error] {
        assert!(error.contains(&checkpoint.display().to_string()), "{error}");
        assert!(error.contains("corrupted") && error.contains("mv "), "{error}");
        assert!(error.contains("plugin's log"), "{error}");
    }
    assert!(prepared.claims[&uid].devices.is_empty());
    assert!(node.cdi_dir().read_dir().map_or(true, |mut d| d.next().is_none()));
    running.shut_down().await;
}
