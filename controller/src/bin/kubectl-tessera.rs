//! `kubectl-tessera`: tessera's kubectl plugin (`kubectl tessera explain pod/NAME`,
//! `kubectl tessera migrate -f FILE`, `kubectl tessera rightsize deployment/NAME`,
//! `kubectl tessera top [--node NAME]`).

use clap::{Parser, Subcommand};
use tessera_controller::explain::cli::{self as explain, Args};
use tessera_controller::migrate::cli::{self as migrate, MigrateArgs};
use tessera_controller::rightsize::cli::{self as rightsize, RightsizeArgs};
use tessera_controller::top::cli::{self as top, TopArgs};

const EXIT_CODES: &str = "Exit status: see each command's --help.";

/// tessera's kubectl plugin.
#[derive(Debug, Parser)]
#[command(name = "kubectl-tessera", version, after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Top,
}

#[derive(Debug, Subcommand)]
enum Top {
    #[command(flatten)]
    Explain(explain::Command),
    /// Rewrite specs written for NVIDIA's DRA driver or device plugin for tessera: the translated YAML on
    /// stdout, what changed and what could not be translated on stderr.
    #[command(after_help = migrate::EXIT_CODES)]
    Migrate(MigrateArgs),
    /// Size a Deployment's GPU share from what its pods used (tessera's per-claim series in Prometheus)
    /// by tessera's sizing rule v1: the resized ResourceClaimTemplate (or the JSON patch) on stdout, the
    /// numbers on stderr.
    #[command(after_help = rightsize::EXIT_CODES)]
    Rightsize(RightsizeArgs),
    /// Each node's GPUs drawn for an 80-column terminal: whole, MIG layout as blocks of its memory
    /// slices, shares with request / ceiling / use, the pod holding each, taints.
    #[command(name = "top", after_help = top::EXIT_CODES)]
    Gpus(TopArgs),
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let code = match Cli::parse().command {
        Top::Explain(command) => explain::run(Args { command }).await,
        Top::Migrate(args) => migrate::run(&args),
        Top::Rightsize(args) => rightsize::run(&args).await,
        Top::Gpus(args) => top::run(&args).await,
    };
    std::process::ExitCode::from(code)
}
