//! Why `top` could not draw.

/// Why `top` could not draw. Each message names the fix.
#[derive(Debug, thiserror::Error)]
pub enum TopError {
    #[error(
        "cannot reach the API server: {message}; set KUBECONFIG or pass --kubeconfig, or draw offline with --from-file"
    )]
    Cluster { message: String },
    #[error("cannot read {path}: {message}")]
    File { path: String, message: String },
    #[error(
        "node {node:?} publishes no tessera GPUs; `kubectl get resourceslices --field-selector spec.nodeName={node}` lists what it publishes"
    )]
    NoSuchNode { node: String },
}
