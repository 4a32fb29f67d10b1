//! The thin kube-rs layer against a scripted API server: the requests it sends and how it reads answers.

use std::{
    convert::Infallible,
    sync::{Arc, Mutex},
};

use http::{Request, Response};
use kube::{Client, client::Body};
use tessera_controller::{
    features::{ApiFeatures, PROBE_PREFIX},
    runtime::probe_features,
};

/// A client whose API server answers with `answer(method, path+query, body)` and records the requests.
fn scripted(
    answer: impl Fn(&str, &str, &serde_json::Value) -> (u16, serde_json::Value) + Send + Sync + 'static,
) -> (Client, Arc<Mutex<Vec<String>>>) {
    let seen = Arc::new(Mutex::new(vec![]));
    let log = Arc::clone(&seen);
    let answer = Arc::new(answer);
    let service = tower::service_fn(move |req: Request<Body>| {
        let (log, answer) = (Arc::clone(&log), Arc::clone(&answer));
        async move {
            let method = req.method().to_string();
            let uri = req.uri().to_string();
            let bytes = http_body_util_collect(req.into_body()).await;
            let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
            log.lock().unwrap().push(format!("{method} {uri}"));
            let (code, reply) = answer(&method, &uri, &body);
            Ok::<_, Infallible>(
                Response::builder()
                    .status(code)
                    .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                    .unwrap(),
            )
        }
    });
    (Client::new(service, "default"), seen)
}

async fn http_body_util_collect(body: Body) -> Vec<u8> {
    body.collect_bytes().await.map(|b| b.to_vec()).unwrap_or_default()
}

fn status(code: u16, reason: &str) -> serde_json::Value {
    serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason, "message": reason})
}

#[tokio::test]
async fn probes_are_dry_run_creates_and_dropped_fields_mean_unsupported() {
    // A 1.35 server without gates: partitionable and consumable fields dropped, taints kept, and the
    // consumer probe rejected outright.
    let (client, seen) = scripted(|_, _, body| {
        let name = body["metadata"]["name"].as_str().unwrap_or_default().to_string();
        let mut echoed = body.clone();
        if name.ends_with("consumer") {
            return (422, status(422, "Invalid"));
        }
        echoed["spec"].as_object_mut().unwrap().remove("sharedCounters");
        for d in echoed["spec"]["devices"].as_array_mut().into_iter().flatten() {
            d.as_object_mut().unwrap().remove("allowMultipleAllocations");
        }
        (201, echoed)
    });
    let features = probe_features(&client).await.unwrap();
    assert_eq!(
        features,
        ApiFeatures {
            partitionable: false,
            consumable: false,
            taints: true
        }
    );
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 4);
    assert!(
        seen.iter()
            .all(|r| r.starts_with("POST /apis/resource.k8s.io/v1/resourceslices?")
                && r.contains("dryRun=All")),
        "{seen:?}"
    );
}

#[tokio::test]
async fn a_server_error_makes_the_probe_inconclusive_instead_of_downgrading() {
    let (client, _) = scripted(|_, _, body| {
        if body["metadata"]["name"] == format!("{PROBE_PREFIX}-shared") {
            (503, status(503, "ServiceUnavailable"))
        } else {
            (201, body.clone())
        }
    });
    assert!(probe_features(&client).await.is_err());
}

#[tokio::test]
async fn a_lease_another_replica_just_renewed_is_not_taken_and_a_missing_one_is_created() {
    use tessera_controller::{leader::LeaderElector, runtime::KubeLease};
    let now = chrono::Utc::now();
    let held = serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "tessera-controller", "namespace": "tessera-system", "resourceVersion": "7"},
        "spec": {"holderIdentity": "other", "leaseDurationSeconds": 15, "renewTime": now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)}
    });
    let (client, seen) = scripted(move |method, _, _| match method {
        "GET" => (200, held.clone()),
        _ => (409, status(409, "Conflict")),
    });
    let mut elector = LeaderElector::new("me", "tessera-system", "tessera-controller");
    assert!(
        !elector
            .try_acquire_or_renew(
                &KubeLease::new(&client, "tessera-system", "tessera-controller"),
                now
            )
            .await
    );
    assert_eq!(
        *seen.lock().unwrap(),
        ["GET /apis/coordination.k8s.io/v1/namespaces/tessera-system/leases/tessera-controller"]
    );

    let (client, seen) = scripted(|method, _, body| match method {
        "GET" => (404, status(404, "NotFound")),
        _ => {
            assert_eq!(body["spec"]["holderIdentity"], "me");
            let mut created = body.clone();
            created["metadata"]["resourceVersion"] = "1".into();
            (201, created)
        }
    });
    assert!(
        elector
            .try_acquire_or_renew(
                &KubeLease::new(&client, "tessera-system", "tessera-controller"),
                now
            )
            .await
    );
    let create = seen.lock().unwrap()[1].clone();
    assert!(
        create.starts_with("POST /apis/coordination.k8s.io/v1/namespaces/tessera-system/leases?"),
        "{create}"
    );
    assert!(create.contains("fieldManager=tessera-controller"), "{create}");
}

#[tokio::test]
async fn a_reconcile_through_kube_creates_slices_and_patches_the_policy_status() {
    use tessera_controller::{
        fixtures::{GpuModel, fixed_time, node},
        pool::NodeRef,
        publisher::{Reconciler, Snapshot},
        runtime::KubeApi,
    };
    let (client, seen) = scripted(|method, _, body| match method {
        "PATCH" => {
            assert_eq!(body["status"]["conditions"][0]["reason"], "Valid");
            let stored = serde_json::json!({
                "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuPolicy",
                "metadata": {"name": "default"}, "spec": {"rules": []}, "status": body["status"],
            });
            (200, stored)
        }
        _ => (201, body.clone()),
    });
    let policy: tessera_api::policy::GpuPolicy = serde_norway::from_str(
        "apiVersion: gpu.tessera.dev/v1alpha1\nkind: GpuPolicy\nmetadata: {name: default}\nspec: {rules: [{name: w, whole: {}}]}\n",
    )
    .unwrap();
    let snap = Snapshot {
        inventories: vec![node("n1").gpus(GpuModel::H100Sxm5_80gb, 2).build()],
        node_leases: Default::default(),
        inventory_view: Default::default(),
        nodes: [(
            "n1".to_string(),
            NodeRef {
                name: "n1".into(),
                uid: Some("u1".into()),
            },
        )]
        .into(),
        policy: Some(policy),
        slices: vec![],
        allocated: Default::default(),
    };
    let mut r = Reconciler::new(
        ApiFeatures::ALL,
        tessera_controller::liveness::Liveness::new(
            std::time::Duration::from_secs(40),
            std::time::Duration::from_secs(30),
        ),
    );
    // Seen twice with a changed heartbeat: live.
    let start = std::time::Instant::now();
    r.observe(&snap, start);
    let mut renewed = snap.clone();
    renewed.inventories = vec![
        node("n1")
            .gpus(GpuModel::H100Sxm5_80gb, 2)
            .heartbeat_at(fixed_time() + chrono::Duration::seconds(10))
            .build(),
    ];
    r.reconcile(&renewed, &KubeApi::new(&client), fixed_time(), start, &|| true)
        .await
        .unwrap();
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(
        seen[0].starts_with("PATCH /apis/gpu.tessera.dev/v1alpha1/gpupolicies/default/status"),
        "{seen:?}"
    );
    assert!(
        seen[1].starts_with("POST /apis/resource.k8s.io/v1/resourceslices?"),
        "{seen:?}"
    );
}

/// Issue 16 item 1: after a watch failure the view counts as lost until a fresh list, not until the
/// watch is resumed from the old resourceVersion (which replays a cache that may be far behind).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_watch_loses_the_view_until_a_fresh_list_completes() {
    use std::time::{Duration, Instant};

    use tessera_controller::{
        fixtures::{GpuModel, node},
        liveness::View,
        mirror::{ViewCell, mirror},
    };
    let lists = Arc::new(Mutex::new(0u32));
    let counted = Arc::clone(&lists);
    let (client, seen) = scripted(move |_, uri, _| {
        if uri.contains("watch=true") {
            // The API server is restarting; the pause lets the test see the synced view in between.
            std::thread::sleep(Duration::from_millis(150));
            return (503, status(503, "ServiceUnavailable"));
        }
        let mut n = counted.lock().unwrap();
        *n += 1;
        let inv = node(&format!("node-{n}")).gpus(GpuModel::H200, 1).build();
        (
            200,
            serde_json::json!({
                "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "NodeInventoryList",
                "metadata": {"resourceVersion": format!("{n}0")}, "items": [inv],
            }),
        )
    });
    let (store, writer) = kube::runtime::reflector::store::<tessera_api::NodeInventory>();
    let started = Instant::now();
    let view = ViewCell::new(started);
    let task = tokio::spawn(mirror(
        "NodeInventory",
        writer,
        kube::Api::all(client),
        kube::runtime::watcher::Config::default(),
        tessera_controller::mirror::drop_managed_fields,
        view.clone(),
        Some(Arc::new(tokio::sync::Notify::new())),
    ));
    let mut views = vec![];
    let deadline = Instant::now() + Duration::from_secs(10);
    while *lists.lock().unwrap() < 3 && Instant::now() < deadline {
        let v = view.get();
        if views.last() != Some(&v) {
            views.push(v);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    task.abort();
    let synced: Vec<u64> = views
        .iter()
        .filter_map(|v| match v {
            View::Synced { list } => Some(*list),
            View::Lost { .. } => None,
        })
        .collect();
    assert!(synced.starts_with(&[1, 2]), "views: {views:?}");
    let lost_between = views.windows(3).any(|w| {
        w[0] == View::Synced { list: 1 }
            && matches!(w[1], View::Lost { .. })
            && w[2] == View::Synced { list: 2 }
    });
    assert!(lost_between, "lost between the lists: {views:?}");
    // The store holds what the latest list returned: the old object was replaced, not merged.
    let names: Vec<String> = store.state().iter().map(|i| i.spec.node_name.clone()).collect();
    assert!(names.len() == 1 && names[0] != "node-1", "{names:?}");
    let seen = seen.lock().unwrap();
    let watches = seen.iter().filter(|r| r.contains("watch=true")).count();
    assert!(
        watches >= 2,
        "each list was followed by a watch attempt: {seen:?}"
    );
}
