//! What the `kubectl tessera` subcommands share: a client that finds its cluster as kubectl does.

use std::path::Path;

use kube::{
    Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};

/// A client from `kubeconfig` (KUBECONFIG, then ~/.kube/config, then in-cluster where absent); the
/// error's text is what each subcommand puts in its own error type.
pub async fn client(kubeconfig: Option<&Path>) -> Result<Client, String> {
    let config = match kubeconfig {
        Some(path) => {
            // KUBECONFIG may list several files; kubectl merges them, the first one is enough here.
            let first = std::env::split_paths(path)
                .next()
                .unwrap_or_else(|| path.to_path_buf());
            let kc = Kubeconfig::read_from(&first)
                .map_err(|e| format!("failed to read kubeconfig {}: {e}", first.display()))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| e.to_string())?
        }
        None => Config::infer().await.map_err(|e| e.to_string())?,
    };
    Client::try_from(config).map_err(|e| e.to_string())
}
