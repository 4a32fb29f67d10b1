//! The kubelet edge's errors: serving the plugin's sockets.

use std::{io, path::PathBuf};

/// A failed operation on the plugin's unix sockets.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Removing a socket left by an earlier run failed.
    #[error("failed to remove stale socket {path}: {source}")]
    RemoveStaleSocket {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Creating a socket's directory or binding the socket failed.
    #[error("failed to bind socket {path}: {source}")]
    BindSocket {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A gRPC server stopped with an error.
    #[error("failed to serve gRPC on {path}: {source}")]
    Serve {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
