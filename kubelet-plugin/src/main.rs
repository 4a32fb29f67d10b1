use clap::Parser;
use tessera_kubelet_plugin::cli::args::Args;

#[tokio::main]
async fn main() {
    let args = Args::parse();
    args.init_tracing();
    if let Err(e) = args.run().await {
        // A stop on a driver upgrade is no failure: the plugin asks to be restarted (driver_watch.rs).
        if e.exit_code() == 1 {
            tracing::error!(error = %e, "tessera-kubelet-plugin failed");
        } else {
            tracing::warn!(error = %e, "tessera-kubelet-plugin stopped to be restarted");
        }
        eprintln!("error: {e}");
        std::process::exit(e.exit_code());
    }
}
