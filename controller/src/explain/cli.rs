//! `kubectl-tessera`: the kubectl plugin (`kubectl tessera explain …` finds it on PATH by its name).
//! The thin layer: flags, reading the objects (file or API server), printing, the exit code.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::api::{
    core::v1::{Event, Node, Pod},
    resource::v1::{DeviceClass, DeviceTaintRule, ResourceClaimTemplate, ResourceSlice},
};
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, GroupVersionKind, ListParams},
};

use super::{cluster::Cluster, diagnose::explain, error::ExplainError, input, target::Target};

/// What explain leaves out, shown in `--help`.
pub const NOT_MODELLED: &str = "\
Scope: each node is evaluated on its own, as the scheduler's filter does: for a pod not yet placed, first \
its own constraints (nodeName, a cordoned node, nodeSelector, required node affinity, node taints against \
its tolerations, extended resources no DeviceClass serves against the node's allocatable), then every \
request alone (with its firstAvailable alternatives in order), then all pending claims of the pod together \
(with their matchAttribute and distinctAttribute constraints), with the devices, shared counters (MIG \
placements), consumable capacity (shares) that allocated claims already hold, and the taints of \
DeviceTaintRules (where the API server serves them; their driver, pool and device selector). For a pod whose \
claims are allocated but that does not start, the FailedPrepareDynamicResources event kubelet last reported, \
or a container the runtime refuses for tessera's CDI devices (CreateContainerError and the like). \
Not modelled: slices selected by nodeSelector or per-device node selection (only nodeName and allNodes \
slices count), v1alpha3 DeviceTaintRules' class and CEL selectors, binding conditions, claims the scheduler \
has reserved but not yet written, cpu, memory and pod-count fit, inter-pod affinity, topology spread, and \
other pods' use of a device plugin's extended resource (a pod asking for one a DeviceClass serves through \
extendedResourceName is explained as the claim the scheduler makes from that class). A selector that fails \
at runtime (a missing attribute) ends a node's evaluation with that error where the allocator would \
evaluate it, as the scheduler does; the device is listed with the error.";

const EXIT_CODES: &str = "\
Exit status: 0 when everything fits on some node (or is allocated already), 1 when something does not \
fit or the pod cannot start (its own constraints rule out every node, kubelet cannot prepare its \
allocated claims, or the runtime refuses a container for tessera's devices), 2 on errors (object not found, \
API server unreachable, malformed file).";

/// tessera's kubectl plugin.
#[derive(Debug, Parser)]
#[command(name = "kubectl-tessera", version, after_help = EXIT_CODES)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Why a pod, claim or template does (not) fit: per request and node, the closest devices and the
    /// first condition each fails.
    #[command(after_help = format!("{NOT_MODELLED}\n\n{EXIT_CODES}"))]
    Explain(ExplainArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ExplainArgs {
    /// pod/NAME, claim/NAME or template/NAME.
    pub target: String,
    /// Namespace of the target; the kubeconfig context's (or `default`) when absent.
    #[arg(short = 'n', long)]
    pub namespace: Option<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "text")]
    pub output: Output,
    /// Read DeviceClasses, ResourceSlices, ResourceClaims, Pods and ResourceClaimTemplates (and, when
    /// given, Nodes, Events and DeviceTaintRules) from this JSON or YAML List instead of the API server.
    #[arg(long)]
    pub from_file: Option<PathBuf>,
    /// Kubeconfig file (as kubectl: KUBECONFIG, then ~/.kube/config, then in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

fn cluster_error(e: impl std::fmt::Display) -> ExplainError {
    ExplainError::Cluster {
        message: e.to_string(),
    }
}

async fn client(kubeconfig: Option<&std::path::Path>) -> Result<Client, ExplainError> {
    crate::kubectl::client(kubeconfig).await.map_err(cluster_error)
}

async fn list<K>(api: Api<K>) -> Result<Vec<K>, ExplainError>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api
        .list(&ListParams::default())
        .await
        .map_err(cluster_error)?
        .items)
}

/// Reads what explaining `target` needs from the API server.
async fn from_cluster(client: Client, target: &Target) -> Result<Cluster, ExplainError> {
    let namespace = match target {
        Target::Pod { namespace, .. }
        | Target::Claim { namespace, .. }
        | Target::Template { namespace, .. } => namespace.clone(),
    };
    let mut cluster = Cluster {
        classes: list(Api::<DeviceClass>::all(client.clone())).await?,
        slices: list(Api::<ResourceSlice>::all(client.clone())).await?,
        // Every namespace: other namespaces' allocations hold devices too.
        claims: Vec::new(),
        templates: list(Api::<ResourceClaimTemplate>::namespaced(
            client.clone(),
            &namespace,
        ))
        .await?,
        pods: Vec::new(),
        nodes: Vec::new(),
        events: Vec::new(),
        taint_rules: taint_rules(&client).await,
    };
    // One claim that does not decode (a lone surrogate, too deep a nesting, in any namespace) must not make
    // explain fail for everyone: it is left out, and said so.
    let listed = tessera_api::claim_list::list_all(&client)
        .await
        .map_err(cluster_error)?;
    for u in &listed.unreadable {
        let named = match target {
            Target::Claim { namespace, name } => {
                u.namespace.as_deref() == Some(namespace) && u.name.as_deref() == Some(name)
            }
            _ => false,
        };
        if named {
            return Err(cluster_error(u.to_string()));
        }
        eprintln!("warning: {u}; the devices it holds, if any, are counted as free");
    }
    cluster.claims = listed.claims;
    if let Target::Pod { name, .. } = target {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
        if let Some(pod) = pods.get_opt(name).await.map_err(cluster_error)? {
            cluster.pods.push(pod);
        }
        // Nodes and events are what a pod's own constraints and kubelet's word need; a user who may not
        // read them still gets the claims' answer, told what is left out.
        match list(Api::<Node>::all(client.clone())).await {
            Ok(nodes) => cluster.nodes = nodes,
            Err(e) => eprintln!(
                "warning: cannot list nodes ({e}); the pod's nodeSelector, affinity, tolerations and extended \
                 resources are not checked"
            ),
        }
        let events: Api<Event> = Api::namespaced(client, &namespace);
        let params =
            ListParams::default().fields(&format!("involvedObject.kind=Pod,involvedObject.name={name}"));
        match events.list(&params).await {
            Ok(list) => cluster.events = list.items,
            Err(e) => {
                eprintln!("warning: cannot list the pod's events ({e}); a prepare failure is not shown")
            }
        }
    }
    Ok(cluster)
}

/// The DeviceTaintRules, from the newest `resource.k8s.io` version the API server lists them in; none
/// where it serves none (before 1.33, or its feature off), so nothing is guessed.
async fn taint_rules(client: &Client) -> Vec<DeviceTaintRule> {
    for version in ["v1", "v1beta2", "v1alpha3"] {
        let gv = format!("resource.k8s.io/{version}");
        let Ok(resources) = client.list_api_group_resources(&gv).await else {
            continue;
        };
        if !resources.resources.iter().any(|r| r.name == "devicetaintrules") {
            continue;
        }
        let gvk = GroupVersionKind::gvk("resource.k8s.io", version, "DeviceTaintRule");
        let api: Api<DynamicObject> = Api::all_with(
            client.clone(),
            &ApiResource::from_gvk_with_plural(&gvk, "devicetaintrules"),
        );
        let listed = match api.list(&ListParams::default()).await {
            Ok(l) => l.items,
            Err(e) => {
                eprintln!("warning: cannot list DeviceTaintRules ({e}); the taints they add are not counted");
                return Vec::new();
            }
        };
        // The older versions' selector and taint have the same fields explain reads (driver, pool,
        // device; key, value, effect).
        return listed
            .into_iter()
            .filter_map(|o| {
                let name = o.metadata.name.clone();
                serde_json::to_value(&o)
                    .ok()
                    .and_then(|mut v| {
                        v["apiVersion"] = serde_json::Value::String("resource.k8s.io/v1".into());
                        serde_json::from_value::<DeviceTaintRule>(v).ok()
                    })
                    .or_else(|| {
                        eprintln!(
                            "warning: DeviceTaintRule {name:?} does not decode; its taint is not counted"
                        );
                        None
                    })
            })
            .collect();
    }
    Vec::new()
}

/// Runs explain; returns the exit status (0 fits, 1 does not fit, 2 error), having printed the answer.
pub async fn run(args: Args) -> u8 {
    match run_inner(args).await {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("error: {e}");
            2
        }
    }
}

async fn run_inner(args: Args) -> Result<bool, ExplainError> {
    let Command::Explain(args) = args.command;
    let (cluster, target) = match &args.from_file {
        Some(path) => {
            let cluster = input::read(path)?;
            let target = Target::parse(&args.target, args.namespace.as_deref().unwrap_or("default"))?;
            (cluster, target)
        }
        None => {
            let client = client(args.kubeconfig.as_deref()).await?;
            let namespace = args
                .namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_string());
            let target = Target::parse(&args.target, &namespace)?;
            (from_cluster(client, &target).await?, target)
        }
    };
    let report = explain(&cluster, &target)?;
    match args.output {
        Output::Text => print!("{}", report.to_text()),
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&report)
                .expect("a report serializes: it holds only strings and bools")
        ),
    }
    Ok(report.fits)
}
