use clap::Parser;
use tessera_kubelet_plugin::args::Args;

#[tokio::main]
async fn main() {
    let args = Args::parse();
    args.init_tracing();
    if let Err(e) = args.run().await {
        tracing::error!(error = %e, "tessera-kubelet-plugin failed");
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
