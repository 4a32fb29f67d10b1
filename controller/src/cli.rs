//! Command-line interface: every flag also reads an environment variable.

use std::path::PathBuf;

use clap::{Args as ClapArgs, Parser, Subcommand};

use crate::features::ApiFeatures;

/// Publishes every node's GPUs as ResourceSlices under the cluster's GpuPolicy.
#[derive(Debug, Parser)]
#[command(name = "tessera-controller", version, args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the controller (the default).
    Run(RunArgs),
    /// Print the ResourceSlices the controller would publish, as a JSON List; needs no cluster.
    Render(RenderArgs),
    /// Print the CRDs of NodeInventory and GpuPolicy as YAML.
    Crds,
    /// Serve the validating admission webhook for ResourceClaims and ResourceClaimTemplates (HTTPS,
    /// `POST /validate`); reads DeviceClasses and ResourceSlices, writes nothing.
    Webhook(WebhookArgs),
    /// Remove what the controller published, before its chart is deleted (the chart's pre-delete hook):
    /// scale the controller to zero, wait for its pods, delete every ResourceSlice of the driver and the
    /// leader Lease.
    Uninstall(UninstallArgs),
}

#[derive(Debug, Clone, ClapArgs)]
pub struct UninstallArgs {
    /// Kubeconfig file; in-cluster configuration when absent.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The release namespace: the controller's Deployment and its leader Lease.
    #[arg(long, env = "TESSERA_LEASE_NAMESPACE", default_value = "tessera-system")]
    pub namespace: String,
    /// The controller's Deployment.
    #[arg(
        long,
        env = "TESSERA_CONTROLLER_DEPLOYMENT",
        default_value = "tessera-controller"
    )]
    pub deployment: String,
    /// Label selector of the controller's pods.
    #[arg(
        long,
        env = "TESSERA_CONTROLLER_SELECTOR",
        default_value = "app.kubernetes.io/name=tessera,app.kubernetes.io/component=controller"
    )]
    pub selector: String,
    /// The leader-election Lease.
    #[arg(long, env = "TESSERA_LEASE_NAME", default_value = "tessera-controller")]
    pub lease_name: String,
    /// Seconds to wait for the controller's pods to be gone.
    #[arg(long, env = "TESSERA_UNINSTALL_WAIT", default_value_t = 60)]
    pub wait: u64,
}

#[derive(Debug, Clone, ClapArgs)]
pub struct RunArgs {
    /// Kubeconfig file; in-cluster configuration when absent.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "TESSERA_LEASE_NAMESPACE", default_value = "tessera-system")]
    pub lease_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, env = "TESSERA_LEASE_NAME", default_value = "tessera-controller")]
    pub lease_name: String,
    /// Identity in the Lease; defaults to `<hostname>-<pid>`.
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Seconds without a heartbeat change, as this controller observes it (time during which its watch is
    /// down does not count), after which a node's pool is withdrawn.
    #[arg(long, env = "TESSERA_HEARTBEAT_TIMEOUT", default_value_t = 40)]
    pub heartbeat_timeout: u64,
    /// Seconds a node's plugin may report not ready (a restart, until kubelet registers it again) before
    /// its pool is withdrawn; until then the pool is kept unchanged.
    #[arg(long, env = "TESSERA_NOT_READY_GRACE", default_value_t = 30)]
    pub not_ready_grace: u64,
    /// Skip probing the API server and assume these features (`none`, `all`, or a list of
    /// partitionable, consumable, taints).
    #[arg(long, env = "TESSERA_FEATURES")]
    pub features: Option<ApiFeatures>,
    /// Address for kubelet's probes: `GET /livez` (the runtime answers) and `GET /readyz` (every watched
    /// kind has been listed), e.g. `:8081`. Off when unset.
    #[arg(long, env = "TESSERA_HEALTH_ADDR", value_parser = tessera_api::health::parse_listen_addr)]
    pub health_addr: Option<std::net::SocketAddr>,
}

#[derive(Debug, Clone, ClapArgs)]
pub struct RenderArgs {
    /// YAML or JSON file with a NodeInventory, a List of them, or an inventory spec.
    #[arg(long, env = "TESSERA_INVENTORY")]
    pub inventory: PathBuf,
    /// GpuPolicy file; the built-in default when absent.
    #[arg(long, env = "TESSERA_POLICY")]
    pub policy: Option<PathBuf>,
    /// API features to render for (`partitionable,consumable,taints`, `all` or `none`).
    #[arg(long, env = "TESSERA_FEATURES", default_value = "all")]
    pub features: ApiFeatures,
}

#[derive(Debug, Clone, ClapArgs)]
pub struct WebhookArgs {
    /// Address to serve HTTPS on.
    #[arg(long, env = "TESSERA_WEBHOOK_LISTEN", default_value = "0.0.0.0:8443")]
    pub listen: std::net::SocketAddr,
    /// PEM serving certificate (chain), e.g. cert-manager's; re-read when it changes. Without it the
    /// webhook makes and rotates its own (--cert-secret).
    #[arg(
        long,
        env = "TESSERA_WEBHOOK_TLS_CERT",
        requires = "tls_key_file",
        required_unless_present = "cert_secret"
    )]
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key of the serving certificate; re-read when it changes.
    #[arg(long, env = "TESSERA_WEBHOOK_TLS_KEY", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// Secret (in --namespace, created by the chart) that holds the serving certificate the webhook
    /// makes itself, its CA, and the next and previous CA during a rotation. Needs --webhook-configuration
    /// and --service.
    #[arg(
        long,
        env = "TESSERA_WEBHOOK_CERT_SECRET",
        conflicts_with = "tls_cert_file",
        requires_all = ["webhook_configuration", "service"]
    )]
    pub cert_secret: Option<String>,
    /// ValidatingWebhookConfiguration whose caBundle the webhook keeps to its own CAs (--cert-secret).
    #[arg(long, env = "TESSERA_WEBHOOK_CONFIGURATION")]
    pub webhook_configuration: Option<String>,
    /// Service the API server calls the webhook through: the certificate names
    /// `<service>.<namespace>.svc` (--cert-secret).
    #[arg(long, env = "TESSERA_WEBHOOK_SERVICE")]
    pub service: Option<String>,
    /// Namespace of --cert-secret and --service.
    #[arg(long, env = "TESSERA_WEBHOOK_NAMESPACE", default_value = "tessera-system")]
    pub namespace: String,
    /// Lifetime of each CA and serving certificate the webhook makes (`<n>s`, `<n>m` or `<n>h`, at
    /// least 30s); a rotation starts with a third of it left.
    #[arg(long, env = "TESSERA_WEBHOOK_CERT_VALIDITY", default_value = "8760h", value_parser = parse_validity)]
    pub cert_validity: std::time::Duration,
    /// Kubeconfig file; in-cluster configuration when absent.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

/// `<n>s`, `<n>m` or `<n>h`, at least 30 s (a rotation needs time to stage the new CA).
pub fn parse_validity(s: &str) -> Result<std::time::Duration, String> {
    let unit = match s.chars().last() {
        Some('s') => 1,
        Some('m') => 60,
        Some('h') => 3600,
        _ => {
            return Err(format!(
                "{s:?}: want a number of seconds, minutes or hours such as 8760h, 90m or 45s"
            ));
        }
    };
    let n: u64 = s[..s.len() - 1].parse().map_err(|_| {
        format!("{s:?}: want a number of seconds, minutes or hours such as 8760h, 90m or 45s")
    })?;
    let d = std::time::Duration::from_secs(n.saturating_mul(unit));
    if d < std::time::Duration::from_secs(30) {
        return Err(format!(
            "{s:?}: at least 30s, so a rotation can stage the new CA before the old one expires"
        ));
    }
    Ok(d)
}

impl Args {
    pub async fn run(self) -> anyhow::Result<()> {
        let Self { command, run } = self;
        match command {
            None => crate::runtime::run(run).await,
            Some(Command::Run(run)) => crate::runtime::run(run).await,
            Some(Command::Render(RenderArgs {
                inventory,
                policy,
                features,
            })) => {
                let list = crate::render::render_files(&inventory, policy.as_deref(), features)?;
                // Compact: a 500-node dynamic-MIG cluster is ~100k devices.
                println!("{}", serde_json::to_string(&list)?);
                Ok(())
            }
            Some(Command::Crds) => {
                print!("{}", crate::crds::crds_yaml());
                Ok(())
            }
            Some(Command::Webhook(args)) => Ok(crate::webhook::server::run(args).await?),
            Some(Command::Uninstall(args)) => {
                let client = crate::runtime::client(args.kubeconfig.as_deref()).await?;
                let run = crate::uninstall::Uninstall {
                    namespace: args.namespace,
                    deployment: args.deployment,
                    selector: args.selector,
                    lease_name: args.lease_name,
                    wait: std::time::Duration::from_secs(args.wait),
                };
                let report = run.run(client).await?;
                println!(
                    "tessera uninstall: controller scaled to 0: {}; ResourceSlices of {} deleted: {}; leader Lease \
                     {}/{} deleted: {}",
                    report.scaled_down,
                    tessera_api::DRIVER_NAME,
                    report.slices_deleted,
                    run.namespace,
                    run.lease_name,
                    report.lease_deleted
                );
                Ok(())
            }
        }
    }
}
