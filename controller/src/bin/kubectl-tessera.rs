//! `kubectl-tessera`: tessera's kubectl plugin (`kubectl tessera explain pod/NAME`,
//! `kubectl tessera migrate -f FILE`, `kubectl tessera rightsize deployment/NAME`).

use clap::{Parser, Subcommand};
use tessera_controller::explain::cli::{self as explain, Args};
use tessera_controller::migrate::cli::{self as migrate, MigrateArgs};
use tessera_controller::rightsize::cli::{self as rightsize, RightsizeArgs};

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
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let code = match Cli::parse().command {
        Top::Explain(command) => explain::run(Args { command }).await,
        Top::Migrate(args) => migrate::run(&args),
        Top::Rightsize(args) => rightsize::run(&args).await,
    };
    std::process::ExitCode::from(code)
}
