//! The serving certificate: read again when its files change, so a rotated Secret (cert-manager's
//! renewal) is served without a restart; or made and rotated by the webhook itself ([`managed`]).

use std::{
    fmt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use rustls::{
    ServerConfig,
    crypto::CryptoProvider,
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};

use super::WebhookError;

pub mod managed;
pub mod rotation;

/// How often, at most, a handshake looks at the files again.
pub const RELOAD_CHECK_EVERY: Duration = Duration::from_secs(1);

/// What identifies a version of a file without reading it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Stamp(Option<(SystemTime, u64)>);

impl Stamp {
    fn of(path: &Path) -> Self {
        // metadata() follows symlinks: a Secret volume's `..data` swap changes the stamp.
        Self(
            std::fs::metadata(path)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len()))),
        )
    }
}

/// Reads a certificate chain and its key into what rustls serves.
pub fn load(provider: &CryptoProvider, cert: &Path, key: &Path) -> Result<CertifiedKey, WebhookError> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|source| WebhookError::ReadCertificate {
            path: cert.to_path_buf(),
            source,
        })?;
    if chain.is_empty() {
        return Err(WebhookError::NoCertificate {
            path: cert.to_path_buf(),
        });
    }
    let der = PrivateKeyDer::from_pem_file(key).map_err(|source| WebhookError::ReadKey {
        path: key.to_path_buf(),
        source,
    })?;
    let signing =
        provider
            .key_provider
            .load_private_key(der)
            .map_err(|source| WebhookError::UnusableKey {
                path: key.to_path_buf(),
                source,
            })?;
    let certified = CertifiedKey::new(chain, signing);
    certified
        .keys_match()
        .map_err(|source| WebhookError::KeyDoesNotMatch {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            source,
        })?;
    Ok(certified)
}

struct Current {
    key: Arc<CertifiedKey>,
    stamps: (Stamp, Stamp),
    checked: Instant,
}

/// Serves the certificate in `cert`/`key`, re-read when either file changes. A change that does not load
/// (the files are half written, or the key does not match yet) keeps the previous certificate and is
/// tried again on the next check.
pub struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    provider: Arc<CryptoProvider>,
    current: Mutex<Current>,
}

impl fmt::Debug for ReloadingCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadingCert")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl ReloadingCert {
    /// Loads the files now; an error here is a startup error.
    pub fn new(provider: Arc<CryptoProvider>, cert: &Path, key: &Path) -> Result<Self, WebhookError> {
        let stamps = (Stamp::of(cert), Stamp::of(key));
        let loaded = load(&provider, cert, key)?;
        Ok(Self {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            provider,
            current: Mutex::new(Current {
                key: Arc::new(loaded),
                stamps,
                checked: Instant::now(),
            }),
        })
    }

    fn refresh(&self) -> Arc<CertifiedKey> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current.checked.elapsed() < RELOAD_CHECK_EVERY {
            return current.key.clone();
        }
        current.checked = Instant::now();
        let stamps = (Stamp::of(&self.cert), Stamp::of(&self.key));
        if stamps == current.stamps {
            return current.key.clone();
        }
        match load(&self.provider, &self.cert, &self.key) {
            Ok(loaded) => {
                tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                current.key = Arc::new(loaded);
                current.stamps = stamps;
            }
            Err(e) => {
                tracing::warn!(error = %e, "serving certificate changed but does not load yet; serving the previous one")
            }
        }
        current.key.clone()
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.refresh())
    }
}

/// The rustls configuration serving `cert`/`key` (reloaded on change), HTTP/2 and HTTP/1.1.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, WebhookError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let resolver = ReloadingCert::new(provider.clone(), cert, key)?;
    config_with(provider, Arc::new(resolver))
}

/// The rustls configuration serving what `resolver` hands out (the webhook's own rotated certificate).
pub fn config_with(
    provider: Arc<CryptoProvider>,
    resolver: Arc<dyn ResolvesServerCert>,
) -> Result<Arc<ServerConfig>, WebhookError> {
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(WebhookError::Tls)?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
