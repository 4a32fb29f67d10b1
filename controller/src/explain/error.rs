//! Why explain could not answer.

/// Why explain could not answer. Each message names the fix.
#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    #[error("{kind} {namespace}/{name} not found{hint}")]
    NotFound {
        kind: &'static str,
        namespace: String,
        name: String,
        hint: String,
    },
    #[error("{given:?} is not a target: give pod/NAME, claim/NAME or template/NAME")]
    BadTarget { given: String },
    #[error("cannot read {path}: {message}")]
    File { path: String, message: String },
    #[error(
        "cannot reach the API server: {message}; set KUBECONFIG or pass --kubeconfig, or explain offline with --from-file"
    )]
    Cluster { message: String },
    #[error("{claim}: request {field}: {message}")]
    BadRequest {
        claim: String,
        field: String,
        message: String,
    },
}
