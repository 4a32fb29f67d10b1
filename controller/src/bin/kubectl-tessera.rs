//! `kubectl-tessera`: tessera's kubectl plugin (`kubectl tessera explain pod/NAME`,
//! `kubectl tessera migrate -f FILE`).

use clap::{Parser, Subcommand};
use tessera_controller::explain::cli::{self as explain, Args};
use tessera_controller::migrate::cli::{self as migrate, MigrateArgs};

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
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let code = match Cli::parse().command {
        Top::Explain(command) => explain::run(Args { command }).await,
        Top::Migrate(args) => migrate::run(&args),
    };
    std::process::ExitCode::from(code)
}
