//! rightsize's one error enum.

use super::rule;

/// Every way rightsize refuses or fails; each message names what is wrong and the fix.
#[derive(Debug, thiserror::Error)]
pub enum RightsizeError {
    #[error("target {target:?}: expected deployment/NAME")]
    Target { target: String },
    #[error("{flag}: {value:?} is not a duration (30s, 24h, 1h30m)")]
    Duration { flag: String, value: String },
    #[error("--prometheus {url}: {why}")]
    PrometheusUrl { url: String, why: String },
    #[error("Prometheus at {url} is unreachable: {why}")]
    Unreachable { url: String, why: String },
    #[error("Prometheus refused the query: {message}")]
    Query { message: String },
    #[error("Prometheus' answer does not decode: {message}")]
    Decode { message: String },
    #[error(
        "no {metric} series for {selector} in Prometheus: the plugin's metrics must be scraped (the chart's \
         ServiceMonitor, `--set metrics.serviceMonitor.enabled=true`, or its prometheus.io/scrape pod annotations \
         where Prometheus discovers pods by them) and the Deployment's pods must have run with the claim in the window"
    )]
    NoSeries { metric: String, selector: String },
    #[error("no recommendation for {deployment}: {source} (pods seen: {pods}); widen --window or wait")]
    NotEnoughData {
        deployment: String,
        pods: String,
        source: rule::NotEnoughData,
    },
    #[error("request {request:?} is not a tessera share: {why}")]
    NotAShare { request: String, why: String },
    #[error("the ResourceClaimTemplate: {message}")]
    Template { message: String },
    #[error("{message}")]
    Cluster { message: String },
}

impl RightsizeError {
    /// A refusal for want of data or of a share (exit 1), not an error of input or reach (exit 2).
    pub fn is_no_recommendation(&self) -> bool {
        matches!(
            self,
            Self::NoSeries { .. } | Self::NotEnoughData { .. } | Self::NotAShare { .. }
        )
    }
}
