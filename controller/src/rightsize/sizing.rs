//! The whole of rightsize but the reads of the API server: samples from Prometheus, the rule, the change.

use std::collections::BTreeSet;

use serde_json::Value;

use super::{
    error::RightsizeError,
    patch::{self, Changes, ShareRequest},
    query::{self, MEMORY_METRIC, Prometheus, Selection, USE_METRIC},
    rule::{self, Recommendation},
};

/// What rightsize reads besides Prometheus.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub namespace: String,
    pub deployment: String,
    /// Pods the API server lists now (empty offline).
    pub current_pods: Vec<String>,
    /// The ResourceClaimTemplate the Deployment's pods take their claim from, as JSON.
    pub template: Value,
    /// `--request`.
    pub request: Option<String>,
    pub window: String,
    pub step: String,
    /// The end of the window, unix seconds; Prometheus' now when absent.
    pub time: Option<f64>,
}

/// The answer: the rule's numbers, what they were read from, and the template's change.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub recommendation: Recommendation,
    pub request: ShareRequest,
    /// The pods the samples came from.
    pub pods: BTreeSet<String>,
    /// The devices they ran on (the series' `device` labels).
    pub devices: Vec<String>,
    pub changes: Changes,
    pub resized: Value,
    /// The PromQL of the GPU use query.
    pub use_query: String,
}

/// Reads the samples and applies the rule.
pub async fn rightsize(prometheus: &Prometheus, inputs: &Inputs) -> Result<Outcome, RightsizeError> {
    let window = query::duration("--window", &inputs.window)?;
    let step = query::duration("--step", &inputs.step)?;
    let request = patch::share_request(&inputs.template, inputs.request.as_deref())?;
    let selection = Selection {
        namespace: inputs.namespace.clone(),
        deployment: inputs.deployment.clone(),
        current_pods: inputs.current_pods.clone(),
        request: request.name.clone(),
    };
    let use_query = query::subquery(USE_METRIC, &selection, &window, &step);
    let memory_query = query::subquery(MEMORY_METRIC, &selection, &window, &step);
    let use_series = prometheus.query_matrix(&use_query, inputs.time).await?;
    let memory_series = prometheus.query_matrix(&memory_query, inputs.time).await?;
    for (metric, series) in [(USE_METRIC, &use_series), (MEMORY_METRIC, &memory_series)] {
        if series.iter().all(|s| s.samples.is_empty()) {
            return Err(RightsizeError::NoSeries {
                metric: metric.into(),
                selector: query::selector(metric, &selection),
            });
        }
    }
    let pooled = |series: &[query::Series]| -> Vec<f64> {
        series
            .iter()
            .flat_map(|s| s.samples.iter().map(|&(_, v)| v))
            .collect()
    };
    let label_set = |label: &str| -> BTreeSet<String> {
        use_series
            .iter()
            .chain(&memory_series)
            .filter_map(|s| s.labels.get(label).cloned())
            .collect()
    };
    let pods = label_set("pod");
    let devices: Vec<String> = label_set("device").into_iter().collect();
    let recommendation =
        rule::recommend(&pooled(&use_series), &pooled(&memory_series)).map_err(|source| {
            RightsizeError::NotEnoughData {
                deployment: inputs.deployment.clone(),
                pods: pods.iter().cloned().collect::<Vec<_>>().join(", "),
                source,
            }
        })?;
    let changes = patch::changes(&inputs.template, &request, &recommendation, &devices)?;
    let resized = patch::resized_template(&inputs.template, &changes, &recommendation)?;
    Ok(Outcome {
        recommendation,
        request,
        pods,
        devices,
        changes,
        resized,
        use_query,
    })
}
