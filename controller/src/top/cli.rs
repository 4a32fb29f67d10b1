//! The thin layer of `kubectl tessera top`: flags, reading slices, claims and the plugins' `/metrics`
//! (through the API server's pod proxy, so no Prometheus is needed), printing.

use std::{collections::HashMap, path::PathBuf};

use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceSlice};
use kube::{Api, Client, api::ListParams};
use tessera_api::NodeInventory;

use super::{
    error::TopError,
    metrics::{self, ClaimKey, Usage},
    model, render,
};

pub const EXIT_CODES: &str = "Exit status: 0 when drawn, 2 on errors (API server unreachable, malformed file, \
a --node that publishes no tessera GPUs).";

/// The plugin pods' labels, as the chart sets them.
const PLUGIN_SELECTOR: &str = "app.kubernetes.io/name=tessera,app.kubernetes.io/component=kubelet-plugin";

#[derive(Debug, Clone, clap::Args)]
pub struct TopArgs {
    /// Draw only this node.
    #[arg(long)]
    pub node: Option<String>,
    /// Do not read the plugins' /metrics (use is then left out).
    #[arg(long)]
    pub no_metrics: bool,
    /// Read ResourceSlices and ResourceClaims from this JSON or YAML List (as `kubectl get … -o json`
    /// prints it) instead of the API server; use is then left out.
    #[arg(long)]
    pub from_file: Option<PathBuf>,
    /// Kubeconfig file (as kubectl: KUBECONFIG, then ~/.kube/config, then in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

fn cluster_error(e: impl std::fmt::Display) -> TopError {
    TopError::Cluster {
        message: e.to_string(),
    }
}

async fn client(kubeconfig: Option<&std::path::Path>) -> Result<Client, TopError> {
    crate::kubectl::client(kubeconfig).await.map_err(cluster_error)
}

/// `GET /api/v1/namespaces/<ns>/pods/<name>:<port>/proxy/metrics`: a pod's `/metrics` through the API
/// server, which reaches pod IPs where this client may not. The collection, the subresource and the name
/// `kube::core::Request::get_subresource` puts together.
fn metrics_target(namespace: &str, pod: &str, port: i32) -> (String, &'static str, String) {
    (
        format!("/api/v1/namespaces/{namespace}/pods"),
        "proxy/metrics",
        format!("{pod}:{port}"),
    )
}

/// The per-claim gauges of every plugin pod (on `node` only, when given), read through the API server's
/// pod proxy; the notes say from how many plugins, or why none.
async fn scrape(client: &Client, node: Option<&str>) -> (HashMap<ClaimKey, Usage>, Vec<String>) {
    let mut usage = HashMap::new();
    let mut params = ListParams::default().labels(PLUGIN_SELECTOR);
    if let Some(node) = node {
        params = params.fields(&format!("spec.nodeName={node}"));
    }
    let pods = match Api::<Pod>::all(client.clone()).list(&params).await {
        Ok(l) => l.items,
        Err(e) => {
            return (
                usage,
                vec![format!(
                    "use: not shown, cannot list the plugin pods ({e}); --no-metrics draws without it"
                )],
            );
        }
    };
    let (mut read, mut failed) = (0, Vec::new());
    for pod in &pods {
        let (Some(ns), Some(name)) = (pod.metadata.namespace.as_deref(), pod.metadata.name.as_deref()) else {
            continue;
        };
        let port = pod
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some("health"))
            .map(|p| p.container_port);
        let Some(port) = port else {
            failed.push(format!("{ns}/{name} (no `health` port)"));
            continue;
        };
        let (collection, subresource, target) = metrics_target(ns, name, port);
        let request = kube::core::Request::new(collection)
            .get_subresource(subresource, &target)
            .expect("a GET with a non-empty name builds");
        match client.request_text(request).await {
            Ok(text) => {
                metrics::parse_into(&text, &mut usage);
                read += 1;
            }
            Err(e) => failed.push(format!("{ns}/{name} ({e})")),
        }
    }
    let mut notes = Vec::new();
    if pods.is_empty() {
        notes.push(format!(
            "use: not shown, no plugin pod ({PLUGIN_SELECTOR}) found{}",
            node.map(|n| format!(" on {n}")).unwrap_or_default()
        ));
    } else {
        notes.push(format!(
            "use: from {read} of {} plugin pods' /metrics; '-' where a plugin reports none (MIG \
             devices have no utilization in NVML)",
            pods.len()
        ));
    }
    if !failed.is_empty() {
        notes.push(format!("use: cannot read {}", failed.join(", ")));
    }
    (usage, notes)
}

/// Runs top; returns the exit status (0 drawn, 2 error), having printed the drawing.
pub async fn run(args: &TopArgs) -> u8 {
    match run_inner(args).await {
        Ok(lines) => {
            for l in lines {
                println!("{l}");
            }
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}

async fn run_inner(args: &TopArgs) -> Result<Vec<String>, TopError> {
    let (slices, claims, inventories, usage, notes) = match &args.from_file {
        Some(path) => {
            let cluster = crate::explain::input::read(path).map_err(|e| TopError::File {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
            let note = "use: not shown, read from a file".to_string();
            (
                cluster.slices,
                cluster.claims,
                Vec::new(),
                HashMap::new(),
                vec![note],
            )
        }
        None => {
            let client = client(args.kubeconfig.as_deref()).await?;
            let slices = Api::<ResourceSlice>::all(client.clone())
                .list(&ListParams::default())
                .await
                .map_err(cluster_error)?
                .items;
            let listed = tessera_api::claim_list::list_all(&client)
                .await
                .map_err(cluster_error)?;
            let mut notes: Vec<String> = listed
                .unreadable
                .iter()
                .map(|u| format!("warning: {u}; the devices it holds, if any, are drawn free"))
                .collect();
            // Only a static layout's instance sizes come from here; without them they are estimated.
            let inventories = match Api::<NodeInventory>::all(client.clone())
                .list(&ListParams::default())
                .await
            {
                Ok(l) => l.items.into_iter().map(|i| i.spec).collect(),
                Err(e) => {
                    notes.push(format!(
                        "warning: cannot list NodeInventories ({e}); static MIG instances are sized by their memory"
                    ));
                    Vec::new()
                }
            };
            let usage = if args.no_metrics {
                notes.push("use: not shown (--no-metrics)".into());
                HashMap::new()
            } else {
                let (usage, more) = scrape(&client, args.node.as_deref()).await;
                notes.extend(more);
                usage
            };
            (slices, listed.claims, inventories, usage, notes)
        }
    };
    let fleet = model::build(&slices, &claims, &inventories, &usage, args.node.as_deref());
    if let Some(node) = &args.node
        && fleet.nodes.is_empty()
    {
        return Err(TopError::NoSuchNode { node: node.clone() });
    }
    Ok(render::render(&fleet, &notes))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_plugin_pods_metrics_are_asked_of_the_api_servers_pod_proxy_at_its_health_port() {
        let (collection, subresource, target) =
            super::metrics_target("tessera", "tessera-kubelet-plugin-x2x9z", 8081);
        let r = kube::core::Request::new(collection)
            .get_subresource(subresource, &target)
            .expect("a request");
        assert_eq!(r.method(), "GET");
        assert_eq!(
            r.uri(),
            "/api/v1/namespaces/tessera/pods/tessera-kubelet-plugin-x2x9z:8081/proxy/metrics"
        );
    }
}
