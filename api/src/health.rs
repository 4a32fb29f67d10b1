//! Liveness and readiness over plain HTTP, for kubelet's probes of both binaries: `GET /livez` (also
//! `/healthz`) and `GET /readyz` answer `200 ok` or `503` with the reason, one line of text, so
//! `kubectl describe pod` shows why a probe failed.
//!
//! The same listener serves `GET /metrics` when the binary gives it a [`crate::metrics::Render`]: one port
//! for probes and scraping, so the chart opens one port per pod and the probes prove the scrape target is up.

use std::{convert::Infallible, sync::Arc};

use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode, body::Bytes, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// One check: `Ok` when healthy, else why not.
pub type Check = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// What each endpoint checks.
#[derive(Clone)]
pub struct Checks {
    /// `/livez`: failing restarts the container, so only for what a restart fixes (a stuck loop).
    pub live: Check,
    /// `/readyz`: failing takes the pod out of a rollout's count of available pods.
    pub ready: Check,
}

/// Parses a listen address as Kubernetes components spell it: `:8081` (every interface) or `host:port`.
pub fn parse_listen_addr(s: &str) -> Result<std::net::SocketAddr, String> {
    let full = if s.starts_with(':') {
        format!("0.0.0.0{s}")
    } else {
        s.to_string()
    };
    full.parse()
        .map_err(|e| format!("{s:?} is not an address like :8081 or 127.0.0.1:8081: {e}"))
}

/// Serves `checks` on `listener` until the task is dropped. A failed accept is logged and retried: the
/// probes must not take the process down.
pub async fn serve(listener: TcpListener, checks: Checks) {
    serve_with_metrics(listener, checks, None).await
}

/// [`serve`], plus `GET /metrics` from `metrics`. Rendering runs on a blocking thread: collectors may ask
/// the GPUs (NVML) for usage, which must not stall the probes sharing the runtime.
pub async fn serve_with_metrics(
    listener: TcpListener,
    checks: Checks,
    metrics: Option<crate::metrics::Render>,
) {
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "health endpoint: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        let checks = checks.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                let scrape = match (req.method(), req.uri().path(), &metrics) {
                    (&Method::GET, "/metrics", Some(render)) => Some(render.clone()),
                    _ => None,
                };
                let response = scrape.is_none().then(|| answer(&req, &checks));
                async move {
                    Ok::<_, Infallible>(match (response, scrape) {
                        (Some(response), _) => response,
                        (None, Some(render)) => scrape_response(render).await,
                        (None, None) => unreachable!("either answered or scraped"),
                    })
                }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service)
                .await
            {
                tracing::debug!(%peer, error = %e, "health connection ended with an error");
            }
        });
    }
}

fn answer<B>(req: &Request<B>, checks: &Checks) -> Response<Full<Bytes>> {
    let check = match (req.method(), req.uri().path()) {
        (&Method::GET | &Method::HEAD, "/livez" | "/healthz") => &checks.live,
        (&Method::GET | &Method::HEAD, "/readyz") => &checks.ready,
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                "not found: GET /livez, /healthz, /readyz or /metrics\n".into(),
            );
        }
    };
    match check() {
        Ok(()) => text(StatusCode::OK, "ok\n".into()),
        Err(reason) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{reason}\n")),
    }
}

async fn scrape_response(render: crate::metrics::Render) -> Response<Full<Bytes>> {
    match tokio::task::spawn_blocking(move || render()).await {
        Ok(body) => {
            let mut response = text(StatusCode::OK, body);
            response.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
            );
            response
        }
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering the metrics failed: {e}\n"),
        ),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use std::{
        io::{Read, Write},
        sync::atomic::{AtomicBool, Ordering},
    };

    use super::*;

    /// A blocking HTTP/1.1 GET with `Connection: close`: status code and body.
    fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut raw = String::new();
        stream.read_to_string(&mut raw).unwrap();
        let status = raw.split_whitespace().nth(1).unwrap().parse().unwrap();
        let body = raw
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        (status, body)
    }

    #[test]
    fn a_listen_address_may_leave_out_the_host() {
        assert_eq!(parse_listen_addr(":8081").unwrap().to_string(), "0.0.0.0:8081");
        assert_eq!(
            parse_listen_addr("127.0.0.1:9").unwrap().to_string(),
            "127.0.0.1:9"
        );
        let err = parse_listen_addr("8081").unwrap_err();
        assert!(err.contains(":8081"), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_endpoint_answers_its_own_check_with_the_reason_when_it_fails() {
        let ready = Arc::new(AtomicBool::new(false));
        let checks = Checks {
            live: Arc::new(|| Ok(())),
            ready: {
                let ready = ready.clone();
                Arc::new(move || {
                    if ready.load(Ordering::SeqCst) {
                        Ok(())
                    } else {
                        Err("waiting for kubelet to register the plugin".into())
                    }
                })
            },
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, checks));
        let probe = move |path: &'static str| tokio::task::spawn_blocking(move || get(addr, path));

        assert_eq!(probe("/livez").await.unwrap(), (200, "ok\n".into()));
        assert_eq!(probe("/healthz").await.unwrap(), (200, "ok\n".into()));
        assert_eq!(
            probe("/readyz").await.unwrap(),
            (503, "waiting for kubelet to register the plugin\n".into())
        );
        ready.store(true, Ordering::SeqCst);
        assert_eq!(probe("/readyz").await.unwrap(), (200, "ok\n".into()));
        let (status, body) = probe("/metrics").await.unwrap();
        assert_eq!(status, 404);
        assert!(body.contains("/readyz"), "{body}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_probe_listener_also_serves_metrics_when_given_a_registry() {
        let checks = Checks {
            live: Arc::new(|| Ok(())),
            ready: Arc::new(|| Ok(())),
        };
        let render: crate::metrics::Render =
            Arc::new(|| "# TYPE tessera_up gauge\ntessera_up 1\n# EOF\n".to_string());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_with_metrics(listener, checks, Some(render)));
        let (status, body) = tokio::task::spawn_blocking(move || get(addr, "/metrics"))
            .await
            .unwrap();
        assert_eq!(status, 200);
        let parsed = crate::metrics::exposition::parse(&body).unwrap();
        assert_eq!(parsed.find("tessera_up", &[])[0].value, 1.0);
        let (status, _) = tokio::task::spawn_blocking(move || get(addr, "/readyz"))
            .await
            .unwrap();
        assert_eq!(status, 200);
    }
}
