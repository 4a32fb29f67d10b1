//! Command-line interface: every flag also reads an environment variable.

use std::path::PathBuf;

use clap::{Args as ClapArgs, Parser, Subcommand};

use crate::{features::ApiFeatures, runtime::RunArgs, webhook::server::WebhookArgs};

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
