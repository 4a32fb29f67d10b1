//! What to explain, and the claims a target comes down to: pending ones and those allocated already.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaim};

use super::{
    cluster::Cluster,
    error::ExplainError,
    model::claim_key,
    pod,
    request::{self, Alternative, ClaimInput},
};

/// What to explain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Pod { namespace: String, name: String },
    Claim { namespace: String, name: String },
    Template { namespace: String, name: String },
}

impl Target {
    /// `pod/NAME`, `claim/NAME`, `template/NAME` (or the long kind names kubectl accepts).
    pub fn parse(given: &str, namespace: &str) -> Result<Self, ExplainError> {
        let bad = || ExplainError::BadTarget {
            given: given.to_string(),
        };
        let (kind, name) = given.split_once('/').ok_or_else(bad)?;
        if name.is_empty() || name.contains('/') {
            return Err(bad());
        }
        let (namespace, name) = (namespace.to_string(), name.to_string());
        Ok(match kind.to_ascii_lowercase().as_str() {
            "pod" | "pods" | "po" => Self::Pod { namespace, name },
            "claim" | "resourceclaim" | "resourceclaims" => Self::Claim { namespace, name },
            "template" | "resourceclaimtemplate" | "resourceclaimtemplates" => {
                Self::Template { namespace, name }
            }
            _ => return Err(bad()),
        })
    }

    pub fn label(&self) -> String {
        match self {
            Self::Pod { namespace, name } => format!("pod {namespace}/{name}"),
            Self::Claim { namespace, name } => format!("claim {namespace}/{name}"),
            Self::Template { namespace, name } => format!("template {namespace}/{name}"),
        }
    }
}

fn ns_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    meta.namespace.as_deref().unwrap_or("default")
}

pub(super) fn find<
    'c,
    T: k8s_openapi::Metadata<Ty = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
>(
    items: &'c [T],
    namespace: &str,
    name: &str,
) -> Option<&'c T> {
    items
        .iter()
        .find(|i| ns_of(i.metadata()) == namespace && i.metadata().name.as_deref() == Some(name))
}

/// A claim to show: pending ones are evaluated, allocated ones only reported.
pub(super) struct Resolved {
    pub(super) pending: Vec<ClaimInput>,
    pub(super) allocated: Vec<(String, String)>,
    /// Claims (namespace/name) whose own allocation must not count against them.
    pub(super) exclude: BTreeSet<String>,
}

fn allocated_on(claim: &ResourceClaim) -> Option<String> {
    let alloc = claim.status.as_ref()?.allocation.as_ref()?;
    let devices: Vec<String> = alloc
        .devices
        .iter()
        .flat_map(|d| d.results.iter().flatten())
        .map(|r| format!("{}/{}", r.pool, r.device))
        .collect();
    Some(devices.join(", "))
}

pub(super) fn resolve(cluster: &Cluster, target: &Target) -> Result<Resolved, ExplainError> {
    let mut out = Resolved {
        pending: Vec::new(),
        allocated: Vec::new(),
        exclude: BTreeSet::new(),
    };
    let add_claim = |out: &mut Resolved, claim: &ResourceClaim| -> Result<(), ExplainError> {
        let key = claim_key(claim);
        out.exclude.insert(key.clone());
        match allocated_on(claim) {
            Some(devices) => out.allocated.push((format!("claim {key}"), devices)),
            None => out.pending.push(ClaimInput::from_spec(
                format!("claim {key}"),
                claim.spec.as_ref(),
            )?),
        }
        Ok(())
    };
    let not_found = |kind, namespace: &str, name: &str, hint: &str| ExplainError::NotFound {
        kind,
        namespace: namespace.to_string(),
        name: name.to_string(),
        hint: hint.to_string(),
    };
    match target {
        Target::Claim { namespace, name } => {
            let claim = find(&cluster.claims, namespace, name).ok_or_else(|| {
                not_found(
                    "ResourceClaim",
                    namespace,
                    name,
                    "; check the name and -n NAMESPACE",
                )
            })?;
            add_claim(&mut out, claim)?;
        }
        Target::Template { namespace, name } => {
            let t = find(&cluster.templates, namespace, name).ok_or_else(|| {
                not_found(
                    "ResourceClaimTemplate",
                    namespace,
                    name,
                    "; check the name and -n NAMESPACE",
                )
            })?;
            out.pending.push(ClaimInput::from_spec(
                format!("template {namespace}/{name}"),
                t.spec.as_ref().and_then(|s| s.spec.as_ref()),
            )?);
        }
        Target::Pod { namespace, name } => {
            let pod = find(&cluster.pods, namespace, name)
                .ok_or_else(|| not_found("Pod", namespace, name, "; check the name and -n NAMESPACE"))?;
            let statuses = pod
                .status
                .as_ref()
                .and_then(|s| s.resource_claim_statuses.as_ref());
            let spec_claims = pod.spec.as_ref().and_then(|s| s.resource_claims.as_ref());
            for pc in spec_claims.into_iter().flatten() {
                let generated = statuses
                    .into_iter()
                    .flatten()
                    .find(|s| s.name == pc.name)
                    .and_then(|s| s.resource_claim_name.clone());
                if let Some(claim_name) = pc.resource_claim_name.clone().or(generated) {
                    let claim = find(&cluster.claims, namespace, &claim_name).ok_or_else(|| {
                        not_found(
                            "ResourceClaim",
                            namespace,
                            &claim_name,
                            &format!(" (pod {name} names it as {:?})", pc.name),
                        )
                    })?;
                    add_claim(&mut out, claim)?;
                } else if let Some(t_name) = &pc.resource_claim_template_name {
                    // Not generated yet: the claim will be the template's.
                    let t = find(&cluster.templates, namespace, t_name).ok_or_else(|| {
                        not_found(
                            "ResourceClaimTemplate",
                            namespace,
                            t_name,
                            &format!(" (pod {name} names it as {:?})", pc.name),
                        )
                    })?;
                    out.pending.push(ClaimInput::from_spec(
                        format!("template {namespace}/{t_name} (pod claim {})", pc.name),
                        t.spec.as_ref().and_then(|s| s.spec.as_ref()),
                    )?);
                }
            }
            let extended = pod
                .status
                .as_ref()
                .and_then(|s| s.extended_resource_claim_status.as_ref());
            match extended {
                Some(st) => {
                    let claim =
                        find(&cluster.claims, namespace, &st.resource_claim_name).ok_or_else(|| {
                            not_found(
                                "ResourceClaim",
                                namespace,
                                &st.resource_claim_name,
                                &format!(" (pod {name}'s extendedResourceClaimStatus names it)"),
                            )
                        })?;
                    add_claim(&mut out, claim)?;
                }
                None => {
                    if let Some(c) = extended_resource_claim(cluster, pod, namespace, name) {
                        out.pending.push(c);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The claim kube-scheduler makes for a pod that asks for an extended resource a DeviceClass serves
/// (`extendedResourceName`, or `deviceclass.resource.kubernetes.io/<class>`): one request of that class per
/// resource, as many devices as the pod needs at once (its containers together, or its largest init
/// container if that is more).
fn extended_resource_claim(cluster: &Cluster, pod: &Pod, namespace: &str, name: &str) -> Option<ClaimInput> {
    let class_for =
        |resource: &str| pod::class_serving(&cluster.classes, resource).and_then(|c| c.metadata.name.clone());
    let need = pod::pod_needs(pod);
    let requests: Vec<request::Request> = need
        .into_iter()
        .filter(|(_, v)| *v > 0)
        .filter_map(|(resource, count)| {
            let class = class_for(&resource)?;
            Some(request::Request {
                name: resource.clone(),
                first_available: false,
                alternatives: vec![Alternative {
                    name: resource.clone(),
                    request: resource,
                    sub: None,
                    class,
                    selectors: Vec::new(),
                    all: false,
                    count: count as usize,
                    capacity: BTreeMap::new(),
                    tolerations: Vec::new(),
                    admin_access: false,
                }],
            })
        })
        .collect();
    (!requests.is_empty()).then(|| ClaimInput {
        label: format!("pod {namespace}/{name}'s extended resources"),
        requests,
        constraints: Vec::new(),
    })
}
