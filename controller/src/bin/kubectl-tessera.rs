//! `kubectl-tessera`: tessera's kubectl plugin (`kubectl tessera explain pod/NAME`).

use clap::Parser;
use tessera_controller::explain::cli::{Args, run};

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(run(Args::parse()).await)
}
