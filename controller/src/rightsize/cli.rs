//! `kubectl tessera rightsize deployment/NAME`: the thin layer (flags, the API server's Deployment, pods
//! and template or a template file, printing, the exit code).

use std::io::Write;
use std::path::PathBuf;

use k8s_openapi::api::{apps::v1::Deployment, core::v1::Pod, resource::v1::ResourceClaimTemplate};
use kube::{Api, Client, api::ListParams};

use super::{
    error::RightsizeError,
    query::Prometheus,
    rule,
    sizing::{Inputs, Outcome, rightsize},
};

/// The exit codes, shown in `--help`.
pub const EXIT_CODES: &str = "\
Exit status: 0 with a recommendation, 1 when there is none (too few samples, no series, not a share), 2 on \
errors (Prometheus or the API server unreachable, a bad flag or file).";

/// How the answer goes to stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// The resized ResourceClaimTemplate, under a new name, for `kubectl apply -f -`.
    Template,
    /// The JSON patch (RFC 6902) from the template as it is, to review or to apply to the template's file
    /// (`kubectl patch --local -f FILE --type json -p … -o yaml`).
    Patch,
}

/// Flags of `kubectl tessera rightsize`.
#[derive(Debug, Clone, clap::Args)]
pub struct RightsizeArgs {
    /// deployment/NAME.
    pub target: String,
    /// Namespace of the Deployment; the kubeconfig context's (or `default`) when absent.
    #[arg(short = 'n', long)]
    pub namespace: Option<String>,
    /// Prometheus' base URL (http), where the plugin's per-claim series are scraped.
    #[arg(long, env = "TESSERA_PROMETHEUS_URL")]
    pub prometheus: String,
    /// How far back the samples go.
    #[arg(long, default_value = "24h")]
    pub window: String,
    /// One sample per series every step (the plugin's scrape interval, or longer).
    #[arg(long, default_value = "30s")]
    pub step: String,
    /// The template's request to size (default: its only shared.gpu.tessera.dev request).
    #[arg(long)]
    pub request: Option<String>,
    /// The pod template's resourceClaims entry whose template is sized (default: the only one naming a
    /// template).
    #[arg(long)]
    pub claim: Option<String>,
    /// Read the ResourceClaimTemplate from this JSON or YAML file instead of the API server (no API server
    /// is read: pods are matched by the Deployment's name only).
    #[arg(long)]
    pub template_file: Option<PathBuf>,
    /// What goes to stdout.
    #[arg(short = 'o', long, value_enum, default_value = "template")]
    pub output: Output,
    /// Kubeconfig file (as kubectl: KUBECONFIG, then ~/.kube/config, then in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

/// `deployment/NAME` (also `deploy/`, `deployments/`, `deployment.apps/`).
pub fn parse_target(target: &str) -> Result<String, RightsizeError> {
    match target.split_once('/') {
        Some(("deployment" | "deploy" | "deployments" | "deployment.apps" | "deployments.apps", name))
            if !name.is_empty() && !name.contains('/') =>
        {
            Ok(name.to_string())
        }
        _ => Err(RightsizeError::Target {
            target: target.into(),
        }),
    }
}

fn cluster_error(e: impl std::fmt::Display) -> RightsizeError {
    RightsizeError::Cluster {
        message: e.to_string(),
    }
}

/// The template a Deployment's pods take their claim from (and the pod template's resourceClaims index
/// naming it), and the pods its selector lists now.
async fn from_cluster(
    client: Client,
    namespace: &str,
    deployment: &str,
    claim: Option<&str>,
) -> Result<(serde_json::Value, usize, Vec<String>), RightsizeError> {
    let d = Api::<Deployment>::namespaced(client.clone(), namespace)
        .get_opt(deployment)
        .await
        .map_err(cluster_error)?
        .ok_or_else(|| {
            cluster_error(format!(
                "deployment {deployment} not found in namespace {namespace}"
            ))
        })?;
    let spec = d.spec;
    let claims = spec
        .template
        .spec
        .and_then(|s| s.resource_claims)
        .unwrap_or_default();
    let with_template: Vec<(usize, String, String)> = claims
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            c.resource_claim_template_name
                .clone()
                .map(|t| (i, c.name.clone(), t))
        })
        .filter(|(_, name, _)| claim.is_none_or(|c| c == name))
        .collect();
    let (index, template_name) = match with_template.as_slice() {
        [(i, _, t)] => (*i, t.clone()),
        [] => {
            return Err(cluster_error(match claim {
                Some(c) => format!(
                    "deployment {deployment}'s pod template has no resourceClaims entry {c:?} naming a resourceClaimTemplateName"
                ),
                None => format!(
                    "deployment {deployment}'s pods take no claim from a ResourceClaimTemplate (spec.template.spec.resourceClaims[].resourceClaimTemplateName)"
                ),
            }));
        }
        several => {
            return Err(cluster_error(format!(
                "deployment {deployment}'s pods take claims from several templates ({}); name the pod template's resourceClaims entry with --claim",
                several
                    .iter()
                    .map(|(_, n, t)| format!("{n}: {t}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    };
    let template = Api::<ResourceClaimTemplate>::namespaced(client.clone(), namespace)
        .get_opt(&template_name)
        .await
        .map_err(cluster_error)?
        .ok_or_else(|| cluster_error(format!("ResourceClaimTemplate {template_name} (named by deployment {deployment}) not found in namespace {namespace}")))?;
    let mut pods = Vec::new();
    if let Some(labels) = spec.selector.match_labels.filter(|l| !l.is_empty()) {
        let selector = labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        match Api::<Pod>::namespaced(client, namespace)
            .list(&ListParams::default().labels(&selector))
            .await
        {
            Ok(list) => pods = list.items.into_iter().filter_map(|p| p.metadata.name).collect(),
            Err(e) => {
                eprintln!("warning: cannot list the Deployment's pods ({e}); they are matched by name only")
            }
        }
    }
    Ok((
        serde_json::to_value(template).map_err(cluster_error)?,
        index,
        pods,
    ))
}

/// A client as kubectl finds its cluster ([`crate::kubectl::client`]).
async fn kube_client(kubeconfig: Option<&std::path::Path>) -> Result<Client, RightsizeError> {
    crate::kubectl::client(kubeconfig).await.map_err(cluster_error)
}

fn read_template(path: &std::path::Path) -> Result<serde_json::Value, RightsizeError> {
    let err = |message: String| RightsizeError::Template {
        message: format!("{}: {message}", path.display()),
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let value: serde_json::Value = serde_norway::from_str(&text).map_err(|e| err(e.to_string()))?;
    if value["kind"] != "ResourceClaimTemplate" {
        return Err(err(format!(
            "kind {}, expected ResourceClaimTemplate",
            value["kind"]
        )));
    }
    Ok(value)
}

/// The human table, for stderr.
pub fn report(outcome: &Outcome, inputs: &Inputs) -> String {
    let r = &outcome.recommendation;
    let gib = r.max_memory_bytes / (1u64 << 30) as f64;
    let mut s = format!(
        "deployment {}/{}, request {}: {} samples over {} every {} from {} pod(s) ({}) on {}\n",
        inputs.namespace,
        inputs.deployment,
        outcome.request.name,
        r.samples,
        inputs.window,
        inputs.step,
        outcome.pods.len(),
        outcome.pods.iter().cloned().collect::<Vec<_>>().join(", "),
        outcome.devices.join(", "),
    );
    s.push_str(&format!(
        "  p{} GPU use     {:.3} of a GPU\n  max memory      {gib:.2} GiB\n",
        rule::PERCENTILE,
        r.p90_use
    ));
    s.push_str(&format!(
        "  compute request {} %   (p{} use at {} % of the request, in steps of 5, 5..100)\n",
        r.compute_percent,
        rule::PERCENTILE,
        rule::TARGET * 100.0
    ));
    s.push_str(&format!(
        "  compute ceiling {} %  (burstable: the share may use what its neighbours leave idle)\n",
        r.ceiling_percent
    ));
    s.push_str(&format!(
        "  memory          {}Gi   (max memory × {}, in whole GiB, at least 1)\n",
        r.memory_gib,
        rule::MEMORY_HEADROOM
    ));
    s.push_str(
        "  rule: tessera's share sizing rule v1 (controller/README.md, \"kubectl tessera rightsize\")\n",
    );
    for note in &outcome.changes.notes {
        s.push_str(&format!("  note: {note}\n"));
    }
    s
}

/// Runs the subcommand; the exit code.
pub async fn run(args: &RightsizeArgs) -> u8 {
    match run_inner(args).await {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            if e.is_no_recommendation() { 1 } else { 2 }
        }
    }
}

async fn run_inner(args: &RightsizeArgs) -> Result<(), RightsizeError> {
    let deployment = parse_target(&args.target)?;
    let prometheus = Prometheus::new(&args.prometheus)?;
    let (namespace, template, claim_index, current_pods) = match &args.template_file {
        Some(path) => {
            let template = read_template(path)?;
            let namespace = args
                .namespace
                .clone()
                .or_else(|| {
                    template
                        .pointer("/metadata/namespace")
                        .and_then(|v| v.as_str())
                        .map(String::from)
                })
                .unwrap_or_else(|| "default".into());
            (namespace, template, None, Vec::new())
        }
        None => {
            let client = kube_client(args.kubeconfig.as_deref()).await?;
            let namespace = args
                .namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_string());
            let (template, index, pods) =
                from_cluster(client, &namespace, &deployment, args.claim.as_deref()).await?;
            (namespace, template, Some(index), pods)
        }
    };
    let inputs = Inputs {
        namespace: namespace.clone(),
        deployment: deployment.clone(),
        current_pods,
        template,
        request: args.request.clone(),
        window: args.window.clone(),
        step: args.step.clone(),
        time: None,
    };
    let outcome = rightsize(&prometheus, &inputs).await?;
    eprint!("{}", report(&outcome, &inputs));
    let new_name = outcome.resized["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let stdout = match args.output {
        Output::Template => {
            let point = match claim_index {
                Some(i) => format!(
                    "kubectl patch deployment {deployment} -n {namespace} --type json -p \
                     '[{{\"op\":\"replace\",\"path\":\"/spec/template/spec/resourceClaims/{i}/resourceClaimTemplateName\",\"value\":\"{new_name}\"}}]'"
                ),
                None => format!("point deployment {deployment}'s spec.template.spec.resourceClaims[].resourceClaimTemplateName at {new_name}"),
            };
            eprintln!(
                "apply: kubectl tessera rightsize … | kubectl apply -f -   (a template's spec cannot change, so \
                 the resized one is a new template, {new_name}), then\n       {point}   (a rollout: new pods get \
                 claims of the new size)"
            );
            serde_json::to_string_pretty(&outcome.resized)
        }
        Output::Patch => serde_json::to_string(&outcome.changes.patch),
    }
    .expect("JSON values serialize");
    // A closed stdout (`| head`) is not an error of the recommendation.
    let _ = writeln!(std::io::stdout(), "{stdout}");
    Ok(())
}
