//! `kubectl tessera rightsize` against a known synthetic load, read back through the real Prometheus
//! (e2e/bin/autoscaling/prometheus, built by e2e/scripts/build-autoscaling.sh; or $PROMETHEUS_BIN). Without
//! it the test is skipped, unless TESSERA_REQUIRE_PROMETHEUS is set (`make test-bench` sets it after building
//! Prometheus), where a missing binary fails it.
//!
//! The load is the sizing rule's test vector, u_k = 0.004·k and m_k = k · 100 MiB for k = 1..100, split over
//! two pods of the Deployment (a current and a former ReplicaSet's), one sample per second. The page gives
//! each sample its own timestamp (Prometheus keeps a scraped sample's timestamp), so the 50 scrapes land on
//! whole seconds whatever the scrape timing, and the answer is the rule's, exactly: 45 %, ceiling 100 %,
//! 12Gi. Beside them, series the selection must leave out: another Deployment whose name starts the same,
//! the same pod name in another namespace, another request of the same pod.

use std::io::Write;
use std::net::TcpListener as StdListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tessera_controller::rightsize::{Inputs, RightsizeError, cli::report, query::Prometheus, rightsize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SAMPLES_PER_POD: u64 = 50;
const MIB: u64 = 1 << 20;
const CURRENT: &str = "web-7c9d8b6f5-x2x4z";
const FORMER: &str = "web-6b8f7c4d2-qwrtz";

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn prometheus_binary() -> Option<PathBuf> {
    let bin = std::env::var_os("PROMETHEUS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("e2e/bin/autoscaling/prometheus"));
    if bin.is_file() {
        return Some(bin);
    }
    if std::env::var_os("TESSERA_REQUIRE_PROMETHEUS").is_some() {
        panic!(
            "no Prometheus at {}: build it with e2e/scripts/build-autoscaling.sh --prometheus-only",
            bin.display()
        );
    }
    eprintln!(
        "skipped: no Prometheus at {}: build it with e2e/scripts/build-autoscaling.sh --prometheus-only \
         (make test-bench does)",
        bin.display()
    );
    None
}

/// The exposition page of scrape `n` (1-based): sample n of each series, stamped `t0 + n` seconds.
fn page(n: u64, t0: u64) -> String {
    let n = n.min(SAMPLES_PER_POD);
    let ts = (t0 + n) * 1000;
    let mut s = String::new();
    let mut line = |metric: &str, ns: &str, pod: &str, request: &str, value: String| {
        s.push_str(&format!(
            "{metric}{{namespace=\"{ns}\",pod=\"{pod}\",claim=\"{pod}-gpu-abcde\",request=\"{request}\",device=\"gpu-0-shared\"}} {value} {ts}\n"
        ));
    };
    // The current pod has the odd k, the former one the even k.
    for (pod, k) in [(CURRENT, 2 * n - 1), (FORMER, 2 * n)] {
        line(
            "tessera_claim_gpu_utilization_ratio",
            "serving",
            pod,
            "gpu",
            format!("{}", 0.004 * k as f64),
        );
        line(
            "tessera_claim_gpu_memory_used_bytes",
            "serving",
            pod,
            "gpu",
            format!("{}", k * 100 * MIB),
        );
    }
    // Left out: a Deployment `webapp`, the same pod in another namespace, another request of the pod.
    for (ns, pod, request) in [
        ("serving", "webapp-7c9d8b6f5-x2x4z", "gpu"),
        ("staging", CURRENT, "gpu"),
        ("serving", CURRENT, "draft"),
    ] {
        line(
            "tessera_claim_gpu_utilization_ratio",
            ns,
            pod,
            request,
            "0.99".into(),
        );
        line(
            "tessera_claim_gpu_memory_used_bytes",
            ns,
            pod,
            request,
            format!("{}", 70 * 1024 * MIB),
        );
    }
    s
}

/// Serves `page` on a free port; the scrape count advances the load.
async fn serve_load(t0: u64) -> (String, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let scrapes = Arc::new(AtomicU64::new(0));
    let counter = scrapes.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut read = 0;
                while !buf[..read].windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf[read..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(k) => read += k,
                    }
                }
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                let body = page(n, t0);
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(response.as_bytes()).await;
            });
        }
    });
    (addr, scrapes)
}

/// Prometheus, killed when dropped.
struct Running {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn start_prometheus(bin: &PathBuf, target: &str) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "global:\n  scrape_interval: 100ms\n  scrape_timeout: 100ms\nscrape_configs:\n- job_name: tessera\n  \
         honor_labels: true\n  static_configs: [{{targets: [\"{target}\"]}}]\n"
    );
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    // The free port is known only once its listener closes: another process may take it first; then
    // Prometheus exits saying so and is started again on another.
    for attempt in 1.. {
        let listen = format!("127.0.0.1:{}", free_port());
        let log_path = dir.path().join(format!("prometheus-{attempt}.log"));
        let log = std::fs::File::create(&log_path).unwrap();
        let mut child = Command::new(bin)
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join(format!("data-{attempt}")).display()
            ))
            .arg(format!("--web.listen-address={listen}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let url = format!("http://{listen}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                if log.contains("address already in use") && attempt < 3 {
                    break;
                }
                panic!("Prometheus exited ({status}):\n{log}");
            }
            let prometheus = Prometheus::new(&url).unwrap();
            if prometheus.query_matrix("up[1m]", None).await.is_ok() {
                return Running {
                    child,
                    url,
                    _dir: dir,
                };
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!(
                    "Prometheus did not answer in 30s:\n{}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    unreachable!()
}

fn template() -> serde_json::Value {
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "web-gpu", "namespace": "serving"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": "shared.gpu.tessera.dev",
            "capacity": {"requests": {"memory": "40Gi", "compute": "50"}}}}]}}}})
}

fn inputs(namespace: &str, window: &str, t_end: u64) -> Inputs {
    Inputs {
        namespace: namespace.into(),
        deployment: "web".into(),
        current_pods: vec![],
        template: template(),
        request: None,
        window: window.into(),
        step: "1s".into(),
        time: Some(t_end as f64),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rightsize_reads_the_known_load_back_from_prometheus_and_gives_the_rules_answer() {
    let Some(bin) = prometheus_binary() else { return };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    // Whole seconds in the recent past: the subquery's 1s steps land on the samples.
    let t0 = now - 2 * SAMPLES_PER_POD;
    let t_end = t0 + SAMPLES_PER_POD;
    let (target, scrapes) = serve_load(t0).await;
    let running = start_prometheus(&bin, &target).await;
    let prometheus = Prometheus::new(&running.url).unwrap();
    // Until the former pod's 50th sample is stored.
    // 50 scrapes at 100 ms take 5 s; the bound is for a machine far busier than that, not a timing.
    let deadline = Instant::now() + Duration::from_secs(90);
    let probe = format!(
        "tessera_claim_gpu_utilization_ratio{{namespace=\"serving\",pod=\"{FORMER}\",request=\"gpu\"}}[{}s]",
        SAMPLES_PER_POD
    );
    loop {
        let series = prometheus.query_matrix(&probe, Some(t_end as f64)).await.unwrap();
        if series
            .first()
            .is_some_and(|s| s.samples.len() as u64 == SAMPLES_PER_POD)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus stored {:?} samples in 90s ({} scrapes)",
            series.first().map(|s| s.samples.len()),
            scrapes.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let outcome = rightsize(&prometheus, &inputs("serving", "50s", t_end))
        .await
        .unwrap();
    // The table the command prints (controller/README.md shows this run's).
    let table = report(&outcome, &inputs("serving", "50s", t_end));
    eprint!("{table}");
    assert!(table.contains("  compute request 45 %"), "{table}");
    let r = &outcome.recommendation;
    assert_eq!(r.samples, 100, "{r:?}");
    assert!((r.p90_use - 0.36).abs() < 1e-9, "{r:?}");
    assert_eq!(r.max_memory_bytes, (10_000 * MIB) as f64);
    assert_eq!(
        (r.compute_percent, r.ceiling_percent, r.memory_gib),
        (45, 100, 12)
    );
    assert_eq!(
        outcome.pods.iter().map(String::as_str).collect::<Vec<_>>(),
        vec![FORMER, CURRENT]
    );
    assert_eq!(outcome.devices, vec!["gpu-0-shared".to_string()]);
    let requests =
        &outcome.resized["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"];
    assert_eq!(requests, &json!({"compute": "45", "memory": "12Gi"}));
    assert_eq!(outcome.resized["metadata"]["name"], "web-gpu-c45-m12gi");

    // 14 seconds of two pods are 28 samples: too few; 15 seconds are 30: enough.
    let err = rightsize(&prometheus, &inputs("serving", "14s", t_end))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("not enough data: 28 samples, need 30"),
        "{err}"
    );
    assert!(err.is_no_recommendation());
    let last_15 = rightsize(&prometheus, &inputs("serving", "15s", t_end))
        .await
        .unwrap();
    assert_eq!(last_15.recommendation.samples, 30);

    // A namespace without the Deployment's series: refused naming the metric and the scrape to turn on.
    let err = rightsize(&prometheus, &inputs("elsewhere", "50s", t_end))
        .await
        .unwrap_err();
    assert!(matches!(err, RightsizeError::NoSeries { .. }), "{err}");
    let message = err.to_string();
    assert!(
        message.starts_with("no tessera_claim_gpu_utilization_ratio series for"),
        "{message}"
    );
    assert!(message.contains("metrics.serviceMonitor.enabled"), "{message}");
    let _ = std::io::stderr().flush();
}

#[tokio::test]
async fn an_unreachable_prometheus_is_an_error_naming_its_url() {
    let port = free_port();
    let prometheus = Prometheus::new(&format!("http://127.0.0.1:{port}")).unwrap();
    let err = rightsize(&prometheus, &inputs("serving", "1h", 0))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .starts_with(&format!("Prometheus at http://127.0.0.1:{port} is unreachable: ")),
        "{err}"
    );
    assert!(!err.is_no_recommendation());
}

/// Runs the built `kubectl-tessera rightsize` with a template file; (exit code, stdout, stderr).
fn run_binary(template: &serde_json::Value, prometheus: &str) -> (i32, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("template.json");
    std::fs::write(&file, template.to_string()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kubectl-tessera"))
        .args([
            "rightsize",
            "deployment/web",
            "-n",
            "serving",
            "--prometheus",
            prometheus,
            "--template-file",
        ])
        .arg(&file)
        .env_remove("TESSERA_PROMETHEUS_URL")
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_command_refuses_a_whole_gpu_template_with_exit_1_and_an_unreachable_prometheus_with_exit_2() {
    let mut whole = template();
    whole["spec"]["spec"]["devices"]["requests"][0]["exactly"] =
        json!({"deviceClassName": "gpu.tessera.dev"});
    let (code, stdout, stderr) = run_binary(&whole, "http://127.0.0.1:1");
    assert_eq!((code, stdout.as_str()), (1, ""), "{stderr}");
    assert!(
        stderr.starts_with("error: request \"gpu\" is not a tessera share: it asks for a whole GPU"),
        "{stderr}"
    );

    let port = free_port();
    let (code, stdout, stderr) = run_binary(&template(), &format!("http://127.0.0.1:{port}"));
    assert_eq!((code, stdout.as_str()), (2, ""), "{stderr}");
    assert!(stderr.contains("is unreachable"), "{stderr}");
}
