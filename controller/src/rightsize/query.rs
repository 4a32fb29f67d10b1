//! The PromQL for a Deployment's per-claim series, Prometheus' HTTP API answer, and the GET that asks.

use std::collections::BTreeMap;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

use super::error::RightsizeError;

/// GPU use per claim, in whole-GPU units.
pub const USE_METRIC: &str = "tessera_claim_gpu_utilization_ratio";
/// Memory used per claim, in bytes.
pub const MEMORY_METRIC: &str = "tessera_claim_gpu_memory_used_bytes";

/// The characters of a ReplicaSet's `pod-template-hash` and a pod's random suffix (Kubernetes'
/// `rand.SafeEncodeString` alphabet: no vowels, so no word of a longer Deployment's name matches it).
const SAFE: &str = "[bcdfghjklmnpqrstvwxz2456789]";

/// Which series: the Deployment's pods (present and former), one request of their claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub namespace: String,
    pub deployment: String,
    /// Pods the API server lists now, by name (their names may be cut where the Deployment's name is long).
    pub current_pods: Vec<String>,
    /// The request's name in the template, the series' `request` label.
    pub request: String,
}

/// A duration as PromQL writes it (`30s`, `24h`, `1h30m`), checked so a typo is refused here, not by
/// Prometheus.
pub fn duration(flag: &str, value: &str) -> Result<String, RightsizeError> {
    let bad = || RightsizeError::Duration {
        flag: flag.to_string(),
        value: value.to_string(),
    };
    let mut rest = value;
    let mut any = false;
    while !rest.is_empty() {
        let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits == 0 {
            return Err(bad());
        }
        rest = &rest[digits..];
        let unit = ["ms", "s", "m", "h", "d", "w", "y"]
            .into_iter()
            .find(|u| rest.starts_with(u))
            .ok_or_else(bad)?;
        rest = &rest[unit.len()..];
        any = true;
    }
    // `0s` is no window.
    if !any || !value.contains(|c: char| ('1'..='9').contains(&c)) {
        return Err(bad());
    }
    Ok(value.to_string())
}

/// A PromQL string literal.
fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// RE2 with its metacharacters escaped (a Deployment's name may hold `.`).
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The pods' names: `<deployment>-<pod-template-hash>-<suffix>` for every ReplicaSet the Deployment had
/// (so pods of a former rollout count), or a pod the API server lists now.
pub fn pod_regex(s: &Selection) -> String {
    let mut alternatives = vec![format!(
        "{}-{SAFE}{{1,10}}-{SAFE}{{5}}",
        regex_escape(&s.deployment)
    )];
    alternatives.extend(s.current_pods.iter().map(|p| regex_escape(p)));
    alternatives.join("|")
}

/// `metric{namespace="…",pod=~"…",request="…"}`.
pub fn selector(metric: &str, s: &Selection) -> String {
    format!(
        "{metric}{{namespace={},pod=~{},request={}}}",
        quote(&s.namespace),
        quote(&pod_regex(s)),
        quote(&s.request)
    )
}

/// The subquery that samples every matching series each `step` over `window`: evenly spaced samples, so
/// a scrape interval shorter than the step does not weigh a time more.
pub fn subquery(metric: &str, s: &Selection, window: &str, step: &str) -> String {
    format!("{}[{window}:{step}]", selector(metric, s))
}

/// One series of a matrix answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub labels: BTreeMap<String, String>,
    /// (unix seconds, value)
    pub samples: Vec<(f64, f64)>,
}

#[derive(serde::Deserialize)]
struct Answer {
    status: String,
    #[serde(default)]
    data: Option<Data>,
    #[serde(default, rename = "errorType")]
    error_type: Option<String>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(serde::Deserialize)]
struct Data {
    #[serde(rename = "resultType")]
    result_type: String,
    result: serde_json::Value,
}

#[derive(serde::Deserialize)]
struct MatrixSeries {
    metric: BTreeMap<String, String>,
    #[serde(default)]
    values: Vec<(f64, String)>,
}

/// Parses `/api/v1/query`'s answer to a range-vector query (`resultType: matrix`). A value that is not
/// finite (NaN, a staleness marker never reaches here) is left out: it is not a use.
pub fn parse_matrix(body: &str) -> Result<Vec<Series>, RightsizeError> {
    let decode = |message: String| RightsizeError::Decode { message };
    let answer: Answer =
        serde_json::from_str(body).map_err(|e| decode(format!("not Prometheus' JSON: {e}")))?;
    if answer.status != "success" {
        return Err(RightsizeError::Query {
            message: format!(
                "{}: {}",
                answer.error_type.unwrap_or_else(|| "error".into()),
                answer.error.unwrap_or_default()
            ),
        });
    }
    let data = answer
        .data
        .ok_or_else(|| decode("a success without data".into()))?;
    if data.result_type != "matrix" {
        return Err(decode(format!(
            "resultType {:?}, expected matrix",
            data.result_type
        )));
    }
    let raw: Vec<MatrixSeries> =
        serde_json::from_value(data.result).map_err(|e| decode(format!("result: {e}")))?;
    raw.into_iter()
        .map(|s| {
            let samples = s
                .values
                .into_iter()
                .map(|(t, v)| {
                    v.parse::<f64>()
                        .map(|v| (t, v))
                        .map_err(|_| decode(format!("value {v:?} is not a number")))
                })
                .filter(|r| !matches!(r, Ok((_, v)) if !v.is_finite()))
                .collect::<Result<_, _>>()?;
            Ok(Series {
                labels: s.metric,
                samples,
            })
        })
        .collect()
}

/// `application/x-www-form-urlencoded` for a query parameter.
fn form_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => out.push(b as char),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// A Prometheus HTTP API at `base` (`http://prometheus.monitoring:9090`, a path prefix allowed).
#[derive(Debug, Clone)]
pub struct Prometheus {
    base: String,
}

impl Prometheus {
    pub fn new(base: &str) -> Result<Self, RightsizeError> {
        let base = base.trim_end_matches('/');
        if base.starts_with("https://") {
            return Err(RightsizeError::PrometheusUrl {
                url: base.to_string(),
                why: "https is not supported; reach Prometheus over http, e.g. through \
                      `kubectl port-forward -n monitoring svc/prometheus 9090` and --prometheus http://127.0.0.1:9090"
                    .into(),
            });
        }
        if !base.starts_with("http://") {
            return Err(RightsizeError::PrometheusUrl {
                url: base.to_string(),
                why: "must start with http://".into(),
            });
        }
        Ok(Self {
            base: base.to_string(),
        })
    }

    /// Evaluates `query` at `time` (unix seconds; Prometheus' now when absent): the series of a matrix.
    pub async fn query_matrix(&self, query: &str, time: Option<f64>) -> Result<Vec<Series>, RightsizeError> {
        let mut url = format!("{}/api/v1/query?query={}", self.base, form_encode(query));
        if let Some(t) = time {
            url.push_str(&format!("&time={t:.3}"));
        }
        let unreachable = |why: String| RightsizeError::Unreachable {
            url: self.base.clone(),
            why,
        };
        let uri: hyper::Uri = url.parse().map_err(|e| unreachable(format!("bad URL: {e}")))?;
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let response = tokio::time::timeout(std::time::Duration::from_secs(60), client.get(uri))
            .await
            .map_err(|_| unreachable("no answer in 60s".into()))?
            .map_err(|e| unreachable(error_chain(&e)))?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| unreachable(e.to_string()))?
            .to_bytes();
        let body = String::from_utf8_lossy(&body);
        // Prometheus answers a bad query with 400 and its JSON error; anything else that is not JSON is
        // not Prometheus (a proxy's page, a wrong port).
        if !status.is_success() && !body.trim_start().starts_with('{') {
            return Err(unreachable(format!(
                "HTTP {status}: {}",
                body.chars().take(200).collect::<String>()
            )));
        }
        parse_matrix(&body)
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn web() -> Selection {
        Selection {
            namespace: "serving".into(),
            deployment: "web.v2".into(),
            current_pods: vec![],
            request: "gpu".into(),
        }
    }

    #[test]
    fn the_subquery_selects_the_deployments_pods_by_name_and_the_templates_request() {
        assert_eq!(
            subquery(USE_METRIC, &web(), "24h", "30s"),
            r#"tessera_claim_gpu_utilization_ratio{namespace="serving",pod=~"web\\.v2-[bcdfghjklmnpqrstvwxz2456789]{1,10}-[bcdfghjklmnpqrstvwxz2456789]{5}",request="gpu"}[24h:30s]"#
        );
    }

    #[test]
    fn pods_the_api_server_lists_are_matched_by_their_own_names_too() {
        let s = Selection {
            current_pods: vec!["web.v2-abc".into()],
            ..web()
        };
        assert!(pod_regex(&s).ends_with(r"|web\.v2-abc"));
    }

    #[test]
    fn a_quote_in_a_label_value_is_escaped() {
        assert_eq!(quote(r#"a"b\c"#), r#""a\"b\\c""#);
    }

    #[test]
    fn a_matrix_answer_parses_into_series_with_their_labels_and_samples() {
        let body = r#"{"status":"success","data":{"resultType":"matrix","result":[
            {"metric":{"__name__":"tessera_claim_gpu_utilization_ratio","pod":"web-5b7d9-x2x4z","device":"gpu-0-shared"},
             "values":[[1700000000,"0.25"],[1700000030.5,"0.5"],[1700000060,"NaN"]]}]}}"#;
        let series = parse_matrix(body).unwrap();
        assert_eq!(series.len(), 1);
        assert_eq!(series[0].labels["pod"], "web-5b7d9-x2x4z");
        assert_eq!(series[0].samples, vec![(1700000000.0, 0.25), (1700000030.5, 0.5)]);
    }

    #[test]
    fn prometheus_refusing_the_query_is_an_error_with_its_words() {
        let body = r#"{"status":"error","errorType":"bad_data","error":"1:10: parse error: unexpected"}"#;
        assert_eq!(
            parse_matrix(body).unwrap_err().to_string(),
            "Prometheus refused the query: bad_data: 1:10: parse error: unexpected"
        );
    }

    #[test]
    fn an_instant_vector_answer_or_a_page_that_is_not_json_is_refused() {
        let body = r#"{"status":"success","data":{"resultType":"vector","result":[]}}"#;
        assert!(
            parse_matrix(body)
                .unwrap_err()
                .to_string()
                .contains("expected matrix")
        );
        assert!(
            parse_matrix("<html>")
                .unwrap_err()
                .to_string()
                .contains("not Prometheus' JSON")
        );
    }

    #[test]
    fn durations_are_checked_as_promql_writes_them() {
        for ok in ["30s", "24h", "1h30m", "100ms", "7d"] {
            assert_eq!(duration("--window", ok).unwrap(), ok);
        }
        for bad in ["", "24", "h", "1.5h", "24 h", "0s", "-1h"] {
            assert!(duration("--window", bad).is_err(), "{bad}");
        }
        assert_eq!(
            duration("--step", "5x").unwrap_err().to_string(),
            "--step: \"5x\" is not a duration (30s, 24h, 1h30m)"
        );
    }

    #[test]
    fn a_query_is_form_encoded() {
        assert_eq!(
            form_encode("a{b=\"c\"}[1h:30s]"),
            "a%7Bb%3D%22c%22%7D%5B1h%3A30s%5D"
        );
    }
}
