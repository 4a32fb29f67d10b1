//! The webhook's own serving certificate, without cert-manager: made, stored in one Secret the chart
//! creates (empty) and this process alone writes, trusted through the `caBundle` of one
//! ValidatingWebhookConfiguration it patches, and rotated with overlap ([`super::rotation`]). Every
//! replica reads the same Secret, so they serve one certificate; concurrent writers are ordered by the
//! Secret's resourceVersion (a conflict re-reads). RBAC: get, list, watch, update of that Secret and get,
//! list, watch, patch of that configuration, both by name; no create, so nothing else can be minted.

use std::{
    collections::BTreeMap,
    sync::{Arc, RwLock},
    time::{Duration, SystemTime},
};

use futures::StreamExt;
use k8s_openapi::{
    ByteString,
    api::{admissionregistration::v1::ValidatingWebhookConfiguration, core::v1::Secret},
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
    runtime::{WatchStreamExt, watcher},
};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::{
    crypto::CryptoProvider,
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};

use super::rotation::{self, Policy, Step, Times};

/// The served certificate and key, and the CA that signed it (kubernetes.io/tls names).
pub const CERT: &str = "tls.crt";
pub const KEY: &str = "tls.key";
pub const CA: &str = "ca.crt";
/// The staged pair, served once the API server trusts its CA.
pub const NEXT_CERT: &str = "next.crt";
pub const NEXT_KEY: &str = "next.key";
pub const NEXT_CA: &str = "next-ca.crt";
/// The CA of the certificate served before the current one, trusted until it expires.
pub const PREVIOUS_CA: &str = "previous-ca.crt";

/// Certificates are valid from this long before they are made: API servers with a clock behind ours
/// must not see a certificate from the future.
const BACKDATE: Duration = Duration::from_secs(300);
/// Retry after a failed read or write.
const RETRY: Duration = Duration::from_secs(2);
/// Look again at least this often, whatever the watches say.
const RECHECK: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("failed to make a certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("the serving certificate does not load: {0}")]
    Unusable(String),
    #[error("failed to read Secret {namespace}/{name}: {source}")]
    ReadSecret {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "Secret {namespace}/{name} does not exist: the chart creates it (`helm upgrade` recreates a deleted one); \
         the webhook may only update it"
    )]
    NoSecret { namespace: String, name: String },
    #[error("failed to write Secret {namespace}/{name}: {source}")]
    WriteSecret {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("failed to read ValidatingWebhookConfiguration {name}: {source}")]
    ReadConfig {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("failed to patch the caBundle of ValidatingWebhookConfiguration {name}: {source}")]
    PatchConfig {
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// A CA and the one serving certificate it signed (PEM).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    pub ca: String,
    pub cert: String,
    pub key: String,
}

/// What the Secret holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stored {
    pub current: Option<Pair>,
    pub next: Option<Pair>,
    pub previous_ca: Option<String>,
}

fn text(data: &BTreeMap<String, ByteString>, key: &str) -> Option<String> {
    data.get(key)
        .and_then(|v| String::from_utf8(v.0.clone()).ok())
        .filter(|s| !s.trim().is_empty())
}

impl Stored {
    pub fn from_data(data: &BTreeMap<String, ByteString>) -> Self {
        let pair = |ca, cert, key| {
            Some(Pair {
                ca: text(data, ca)?,
                cert: text(data, cert)?,
                key: text(data, key)?,
            })
        };
        Self {
            current: pair(CA, CERT, KEY),
            next: pair(NEXT_CA, NEXT_CERT, NEXT_KEY),
            previous_ca: text(data, PREVIOUS_CA),
        }
    }

    pub fn to_data(&self) -> BTreeMap<String, ByteString> {
        let mut data = BTreeMap::new();
        let mut put = |k: &str, v: &str| {
            data.insert(k.to_string(), ByteString(v.as_bytes().to_vec()));
        };
        if let Some(p) = &self.current {
            put(CA, &p.ca);
            put(CERT, &p.cert);
            put(KEY, &p.key);
        }
        if let Some(p) = &self.next {
            put(NEXT_CA, &p.ca);
            put(NEXT_CERT, &p.cert);
            put(NEXT_KEY, &p.key);
        }
        if let Some(ca) = &self.previous_ca {
            put(PREVIOUS_CA, ca);
        }
        data
    }

    /// The lifetimes [`rotation::plan`] decides on; a certificate that does not parse counts as none.
    pub fn times(&self, names: &[String], next_trusted_since: Option<SystemTime>) -> Times {
        let current = self.current.as_ref().and_then(|p| {
            let info = cert_info(&p.cert)?;
            Some((info, expiry_of(&p.ca)?))
        });
        Times {
            current: current.as_ref().map(|((expiry, _), ca)| (*expiry).min(*ca)),
            current_names_ok: current
                .as_ref()
                .is_some_and(|((_, dns), _)| names.iter().all(|n| dns.contains(n))),
            next: self
                .next
                .as_ref()
                .and_then(|p| Some(cert_info(&p.cert)?.0.min(expiry_of(&p.ca)?))),
            next_trusted_since,
            previous: self.previous_ca.as_deref().and_then(expiry_of),
        }
    }

    /// The webhook configuration's caBundle: the CAs [`rotation::bundle`] keeps, current first.
    pub fn bundle(&self, names: &[String], now: SystemTime) -> String {
        let keep = rotation::bundle(&self.times(names, None), now);
        let mut out = String::new();
        let cas = [
            (keep.current, self.current.as_ref().map(|p| p.ca.as_str())),
            (keep.next, self.next.as_ref().map(|p| p.ca.as_str())),
            (keep.previous, self.previous_ca.as_deref()),
        ];
        for (kept, ca) in cas {
            if let (true, Some(ca)) = (kept, ca) {
                out.push_str(ca.trim_end());
                out.push('\n');
            }
        }
        out
    }
}

fn parse_pem(pem: &str) -> Option<x509_parser::pem::Pem> {
    x509_parser::pem::parse_x509_pem(pem.as_bytes())
        .ok()
        .map(|(_, p)| p)
}

fn expiry_of(pem: &str) -> Option<SystemTime> {
    cert_info(pem).map(|(t, _)| t)
}

/// A certificate's expiry and DNS names.
fn cert_info(pem: &str) -> Option<(SystemTime, Vec<String>)> {
    let pem = parse_pem(pem)?;
    let cert = pem.parse_x509().ok()?;
    let secs = u64::try_from(cert.validity().not_after.timestamp()).ok()?;
    let mut names = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(d) = n {
                names.push(d.to_string());
            }
        }
    }
    Some((SystemTime::UNIX_EPOCH + Duration::from_secs(secs), names))
}

/// The DNS names the API server may dial for `service` in `namespace` (it dials `<service>.<namespace>.svc`).
pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// A new CA and a serving certificate for `names` it signs, both valid for `validity` from `now`. The
/// CA's key is dropped here: it signs nothing else.
pub fn issue(names: &[String], validity: Duration, now: SystemTime) -> Result<Pair, rcgen::Error> {
    let not_before = now.checked_sub(BACKDATE).unwrap_or(now);
    let not_after = now + validity;
    let stamp = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();

    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, format!("tessera-webhook-ca-{stamp}"));
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = not_before.into();
    ca.not_after = not_after.into();
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);

    let key = KeyPair::generate()?;
    let mut leaf = CertificateParams::new(names.to_vec())?;
    leaf.distinguished_name.push(
        DnType::CommonName,
        names.get(2).or(names.first()).cloned().unwrap_or_default(),
    );
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.not_before = not_before.into();
    leaf.not_after = not_after.into();
    let cert = leaf.signed_by(&key, &issuer)?;
    Ok(Pair {
        ca: ca_cert.pem(),
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// `Stored` after `step` (Issue, Stage, Promote, DropPrevious), given new pairs from `fresh`.
pub fn apply(
    stored: &Stored,
    step: Step,
    names: &[String],
    now: SystemTime,
    fresh: impl FnOnce() -> Result<Pair, rcgen::Error>,
) -> Result<Stored, rcgen::Error> {
    let times = stored.times(names, None);
    let live_ca = |expiry: Option<SystemTime>, ca: Option<&Pair>| {
        ca.filter(|_| expiry.is_some_and(|t| t > now))
            .map(|p| p.ca.clone())
    };
    Ok(match step {
        Step::Issue => Stored {
            current: Some(fresh()?),
            ..Stored::default()
        },
        Step::Stage => Stored {
            next: Some(fresh()?),
            ..stored.clone()
        },
        Step::Promote => Stored {
            current: stored.next.clone(),
            next: None,
            previous_ca: live_ca(times.current, stored.current.as_ref()),
        },
        Step::DropPrevious => Stored {
            previous_ca: None,
            ..stored.clone()
        },
        Step::Wait(_) => stored.clone(),
    })
}

/// The key rustls serves for `pair`.
pub fn certified(provider: &CryptoProvider, pair: &Pair) -> Result<CertifiedKey, CertError> {
    let chain = CertificateDer::pem_slice_iter(pair.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError::Unusable(e.to_string()))?;
    let der =
        PrivateKeyDer::from_pem_slice(pair.key.as_bytes()).map_err(|e| CertError::Unusable(e.to_string()))?;
    let signing = provider
        .key_provider
        .load_private_key(der)
        .map_err(|e| CertError::Unusable(e.to_string()))?;
    let key = CertifiedKey::new(chain, signing);
    key.keys_match().map_err(|e| CertError::Unusable(e.to_string()))?;
    Ok(key)
}

/// The certificate the rotation last promoted; every handshake gets the latest.
#[derive(Debug)]
pub struct SharedCert {
    key: RwLock<(Arc<CertifiedKey>, String)>,
}

impl SharedCert {
    fn new(key: CertifiedKey, pem: String) -> Self {
        Self {
            key: RwLock::new((Arc::new(key), pem)),
        }
    }

    /// Serves `pair` from the next handshake on, when it is not served already.
    fn set(&self, provider: &CryptoProvider, pair: &Pair) -> Result<(), CertError> {
        if self.key.read().unwrap_or_else(|e| e.into_inner()).1 == pair.cert {
            return Ok(());
        }
        let key = certified(provider, pair)?;
        *self.key.write().unwrap_or_else(|e| e.into_inner()) = (Arc::new(key), pair.cert.clone());
        tracing::info!("serving the rotated certificate");
        Ok(())
    }
}

impl ResolvesServerCert for SharedCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.key.read().unwrap_or_else(|e| e.into_inner()).0.clone())
    }
}

/// The Secret and the webhook configuration one rotation keeps.
pub struct Managed {
    pub secrets: Api<Secret>,
    pub configs: Api<ValidatingWebhookConfiguration>,
    pub namespace: String,
    pub secret: String,
    pub config: String,
    pub names: Vec<String>,
    pub policy: Policy,
    pub provider: Arc<CryptoProvider>,
    /// The staged CA this process has seen trusted, and since when.
    trusted: Option<(String, SystemTime)>,
}

fn conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

impl Managed {
    pub fn new(
        client: Client,
        namespace: &str,
        secret: &str,
        config: &str,
        service: &str,
        policy: Policy,
        provider: Arc<CryptoProvider>,
    ) -> Self {
        Self {
            secrets: Api::namespaced(client.clone(), namespace),
            configs: Api::all(client),
            namespace: namespace.to_string(),
            secret: secret.to_string(),
            config: config.to_string(),
            names: service_names(service, namespace),
            policy,
            provider,
            trusted: None,
        }
    }

    /// One pass: plan on the Secret, write what the plan changes (until it says wait), bring the
    /// configuration's caBundle to the Secret's bundle. Returns the pair to serve and how long nothing
    /// needs doing.
    pub async fn reconcile(&mut self) -> Result<(Pair, Duration), CertError> {
        loop {
            let now = SystemTime::now();
            let secret = self
                .secrets
                .get_opt(&self.secret)
                .await
                .map_err(|source| CertError::ReadSecret {
                    namespace: self.namespace.clone(),
                    name: self.secret.clone(),
                    source,
                })?
                .ok_or_else(|| CertError::NoSecret {
                    namespace: self.namespace.clone(),
                    name: self.secret.clone(),
                })?;
            let stored = Stored::from_data(&secret.data.clone().unwrap_or_default());
            let bundle = self.ensure_bundle(&stored, now).await?;
            match &stored.next {
                Some(next) if bundle.contains(next.ca.trim_end()) => {
                    if self.trusted.as_ref().is_none_or(|(ca, _)| *ca != next.ca) {
                        self.trusted = Some((next.ca.clone(), now));
                    }
                }
                _ => self.trusted = None,
            }
            let since = self.trusted.as_ref().map(|(_, t)| *t);
            let step = rotation::plan(&stored.times(&self.names, since), now, &self.policy);
            if let (Step::Wait(wait), Some(current)) = (step, &stored.current) {
                return Ok((current.clone(), wait));
            }
            let validity = self.policy.validity;
            let names = self.names.clone();
            let changed = apply(&stored, step, &self.names, now, || issue(&names, validity, now))?;
            tracing::info!(?step, secret = %self.secret, "serving certificate rotation");
            let mut write = secret;
            write.data = Some(changed.to_data());
            write.string_data = None;
            match self
                .secrets
                .replace(&self.secret, &PostParams::default(), &write)
                .await
            {
                Ok(_) => {}
                // Another replica wrote first: plan again on what it wrote.
                Err(e) if conflict(&e) => {}
                Err(source) => {
                    return Err(CertError::WriteSecret {
                        namespace: self.namespace.clone(),
                        name: self.secret.clone(),
                        source,
                    });
                }
            }
        }
    }

    /// Patches every webhook of the configuration whose caBundle is not `stored`'s bundle; returns the
    /// bundle the configuration holds now (empty when it does not exist: then nothing can be staged
    /// into it, and the rotation waits).
    async fn ensure_bundle(&self, stored: &Stored, now: SystemTime) -> Result<String, CertError> {
        let want = stored.bundle(&self.names, now);
        let Some(config) =
            self.configs
                .get_opt(&self.config)
                .await
                .map_err(|source| CertError::ReadConfig {
                    name: self.config.clone(),
                    source,
                })?
        else {
            return Ok(String::new());
        };
        let webhooks = config.webhooks.unwrap_or_default();
        let stale: Vec<_> = webhooks
            .iter()
            .filter(|w| w.client_config.ca_bundle.as_ref().map(|b| b.0.as_slice()) != Some(want.as_bytes()))
            .map(|w| w.name.clone())
            .collect();
        if stale.is_empty() {
            return Ok(if webhooks.is_empty() { String::new() } else { want });
        }
        let ca = ByteString(want.as_bytes().to_vec());
        let patch = serde_json::json!({
            "webhooks": stale.iter().map(|name| serde_json::json!({
                "name": name, "clientConfig": {"caBundle": ca}
            })).collect::<Vec<_>>()
        });
        self.configs
            .patch(&self.config, &PatchParams::default(), &Patch::Strategic(&patch))
            .await
            .map_err(|source| CertError::PatchConfig {
                name: self.config.clone(),
                source,
            })?;
        tracing::info!(config = %self.config, webhooks = ?stale, "caBundle patched");
        Ok(want)
    }

    /// Reconciles until a certificate can be served (the process serves nothing before: its readiness
    /// probe fails meanwhile), then keeps it rotated in the background.
    pub async fn start(mut self) -> Arc<SharedCert> {
        let (served, wait) = loop {
            match self.reconcile().await {
                Ok((pair, wait)) => match certified(&self.provider, &pair) {
                    Ok(key) => break (Arc::new(SharedCert::new(key, pair.cert)), wait),
                    Err(e) => tracing::warn!(error = %e, "the Secret's certificate does not load; retrying"),
                },
                Err(e) => tracing::warn!(error = %e, "no serving certificate yet; retrying"),
            }
            tokio::time::sleep(RETRY).await;
        };
        tokio::spawn(self.run(served.clone(), wait));
        served
    }

    async fn run(mut self, served: Arc<SharedCert>, mut wait: Duration) {
        let by_name = |name: &str| watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut secret_events = watcher(self.secrets.clone(), by_name(&self.secret))
            .default_backoff()
            .boxed();
        let mut config_events = watcher(self.configs.clone(), by_name(&self.config))
            .default_backoff()
            .boxed();
        loop {
            tokio::select! {
                _ = secret_events.next() => {}
                _ = config_events.next() => {}
                _ = tokio::time::sleep(wait.min(RECHECK)) => {}
            }
            wait = match self.reconcile().await {
                Ok((pair, wait)) => match served.set(&self.provider, &pair) {
                    Ok(()) => wait,
                    Err(e) => {
                        tracing::warn!(error = %e, "the Secret's certificate does not load; serving the previous one");
                        RETRY
                    }
                },
                Err(e) => {
                    tracing::warn!(error = %e, "serving certificate rotation failed; serving the current one");
                    RETRY
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        service_names("tessera-webhook", "tessera-system")
    }

    #[test]
    fn an_issued_pair_names_the_service_and_expires_after_its_validity() {
        let now = SystemTime::now();
        let pair = issue(&names(), Duration::from_secs(3600), now).unwrap();
        let stored = Stored {
            current: Some(pair.clone()),
            ..Stored::default()
        };
        let t = stored.times(&names(), None);
        assert!(t.current_names_ok);
        let left = t.current.unwrap().duration_since(now).unwrap();
        assert!(
            left <= Duration::from_secs(3600) && left > Duration::from_secs(3590),
            "{left:?}"
        );
        let provider = rustls::crypto::ring::default_provider();
        certified(&provider, &pair).unwrap();
        assert_eq!(Stored::from_data(&stored.to_data()), stored);
    }

    #[test]
    fn a_rotation_trusts_both_cas_while_staged_and_keeps_the_old_one_after_the_promotion() {
        let now = SystemTime::now();
        let n = names();
        let first = apply(&Stored::default(), Step::Issue, &n, now, || {
            issue(&n, Duration::from_secs(600), now)
        })
        .unwrap();
        let old_ca = first.current.as_ref().unwrap().ca.clone();
        assert_eq!(first.bundle(&n, now), format!("{}\n", old_ca.trim_end()));

        let staged = apply(&first, Step::Stage, &n, now, || {
            issue(&n, Duration::from_secs(600), now)
        })
        .unwrap();
        let new_ca = staged.next.as_ref().unwrap().ca.clone();
        assert_eq!(
            staged.current, first.current,
            "staging keeps serving the old certificate"
        );
        let bundle = staged.bundle(&n, now);
        assert!(
            bundle.contains(old_ca.trim_end()) && bundle.contains(new_ca.trim_end()),
            "{bundle}"
        );

        let promoted = apply(&staged, Step::Promote, &n, now, || unreachable!()).unwrap();
        assert_eq!(promoted.current, staged.next);
        assert_eq!(promoted.previous_ca.as_deref(), Some(old_ca.as_str()));
        let bundle = promoted.bundle(&n, now);
        assert!(
            bundle.starts_with(new_ca.trim_end()) && bundle.contains(old_ca.trim_end()),
            "{bundle}"
        );

        let dropped = apply(&promoted, Step::DropPrevious, &n, now, || unreachable!()).unwrap();
        assert_eq!(dropped.bundle(&n, now), format!("{}\n", new_ca.trim_end()));
    }

    #[test]
    fn a_certificate_for_another_service_is_not_accepted_as_the_current_one() {
        let now = SystemTime::now();
        let other = service_names("old-name", "tessera-system");
        let stored = Stored {
            current: Some(issue(&other, Duration::from_secs(600), now).unwrap()),
            ..Stored::default()
        };
        assert!(!stored.times(&names(), None).current_names_ok);
        assert_eq!(
            rotation::plan(
                &stored.times(&names(), None),
                now,
                &Policy::for_validity(Duration::from_secs(600))
            ),
            Step::Stage
        );
    }

    #[test]
    fn an_expired_previous_ca_leaves_the_bundle() {
        let now = SystemTime::now();
        let n = names();
        let old = issue(&n, Duration::from_secs(60), now - Duration::from_secs(120)).unwrap();
        let stored = Stored {
            current: Some(issue(&n, Duration::from_secs(600), now).unwrap()),
            previous_ca: Some(old.ca.clone()),
            ..Stored::default()
        };
        assert!(!stored.bundle(&n, now).contains(old.ca.trim_end()));
    }
}
