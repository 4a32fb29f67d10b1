//! What the scheduler checks of a pod before its claims, per node, in the order its filter plugins run:
//! NodeUnschedulable, NodeAffinity (nodeSelector and required node affinity), TaintToleration, then
//! NodeResourcesFit for extended resources no DeviceClass serves. And, for a pod whose claims are all
//! allocated but that does not start, the prepare failure kubelet reported, or the container the runtime
//! refuses for tessera's devices.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Event, Node, NodeSelectorRequirement, NodeSelectorTerm, Pod, Taint, Toleration,
};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim};

use crate::cel::Quantity;

/// Why the pod cannot go to a node, before any of its claims is looked at.
pub fn node_failure(pod: &Pod, node: &Node, classes: &[DeviceClass]) -> Option<String> {
    let spec = pod.spec.as_ref()?;
    let name = node.metadata.name.as_deref().unwrap_or("");
    if let Some(wanted) = spec.node_name.as_deref().filter(|n| !n.is_empty())
        && wanted != name
    {
        return Some(format!("the pod's nodeName is {wanted}"));
    }
    let labels = node.metadata.labels.clone().unwrap_or_default();
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let tolerations = spec.tolerations.clone().unwrap_or_default();
    let unschedulable = node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
    let tolerates_unschedulable = tolerations.iter().any(|t| {
        tolerates(
            t,
            &Taint {
                key: "node.kubernetes.io/unschedulable".into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            },
        )
    });
    if unschedulable && !tolerates_unschedulable {
        return Some("the node is unschedulable (cordoned)".into());
    }
    for (key, value) in spec.node_selector.iter().flatten() {
        match labels.get(key) {
            Some(v) if v == value => {}
            Some(v) => {
                return Some(format!(
                    "didn't match the pod's nodeSelector {key}={value} (the node has {key}={v})"
                ));
            }
            None => {
                return Some(format!(
                    "didn't match the pod's nodeSelector {key}={value} (the node has no label {key})"
                ));
            }
        }
    }
    let terms = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref())
        .map(|r| r.node_selector_terms.as_slice())
        .unwrap_or_default();
    // The terms are ORed; a node matching none fails on the first unmet requirement of each.
    if !terms.is_empty() {
        let misses: Vec<String> = terms
            .iter()
            .map(|t| term_miss(t, &labels, name))
            .collect::<Option<Vec<_>>>()
            .unwrap_or_default();
        if !misses.is_empty() {
            return Some(format!(
                "didn't match the pod's required node affinity: {}",
                misses.join("; or ")
            ));
        }
    }
    if let Some(taint) = taints.iter().find(|taint| {
        matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute")
            && !tolerations.iter().any(|t| tolerates(t, taint))
    }) {
        return Some(format!("untolerated taint {}", show_taint(taint)));
    }
    let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
    for (resource, need) in unserved_extended(pod, classes) {
        let have = allocatable
            .and_then(|a| a.get(&resource))
            .and_then(|q| Quantity::parse(&q.0).ok())
            .and_then(|q| q.as_integer())
            .unwrap_or(0);
        if have < need {
            return Some(format!(
                "Insufficient {resource}: the pod asks for {need}, no DeviceClass serves it \
                 (spec.extendedResourceName) and the node has {have} allocatable"
            ));
        }
    }
    None
}

fn show_taint(t: &Taint) -> String {
    match t.value.as_deref().filter(|v| !v.is_empty()) {
        Some(v) => format!("{}={v}:{}", t.key, t.effect),
        None => format!("{}:{}", t.key, t.effect),
    }
}

/// `ToleratesTaint` of k8s.io/api/core/v1.
fn tolerates(t: &Toleration, taint: &Taint) -> bool {
    if let Some(effect) = t.effect.as_deref().filter(|e| !e.is_empty())
        && effect != taint.effect
    {
        return false;
    }
    let key = t.key.as_deref().unwrap_or("");
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match t.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" | "" => t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
        _ => false,
    }
}

/// `None` when the node matches the term, else the first requirement it does not meet.
fn term_miss(term: &NodeSelectorTerm, labels: &BTreeMap<String, String>, node: &str) -> Option<String> {
    // A term with neither list matches nothing.
    if term.match_expressions.as_deref().unwrap_or_default().is_empty()
        && term.match_fields.as_deref().unwrap_or_default().is_empty()
    {
        return Some("an empty term matches no node".into());
    }
    for r in term.match_expressions.iter().flatten() {
        if let Some(miss) = requirement_miss(r, labels.get(&r.key).map(String::as_str), "label") {
            return Some(miss);
        }
    }
    for r in term.match_fields.iter().flatten() {
        let value = (r.key == "metadata.name").then_some(node);
        if let Some(miss) = requirement_miss(r, value, "field") {
            return Some(miss);
        }
    }
    None
}

fn requirement_miss(r: &NodeSelectorRequirement, value: Option<&str>, what: &str) -> Option<String> {
    let values = r.values.clone().unwrap_or_default();
    let ok = match (r.operator.as_str(), value) {
        ("In", Some(v)) => values.iter().any(|x| x == v),
        ("NotIn", Some(v)) => !values.iter().any(|x| x == v),
        ("NotIn", None) | ("DoesNotExist", None) => true,
        ("Exists", Some(_)) => true,
        ("Gt" | "Lt", Some(v)) => match (
            v.parse::<i64>(),
            values.first().and_then(|x| x.parse::<i64>().ok()),
        ) {
            (Ok(v), Some(x)) => (r.operator == "Gt" && v > x) || (r.operator == "Lt" && v < x),
            _ => false,
        },
        _ => false,
    };
    if ok {
        return None;
    }
    let shown = match value {
        Some(v) => format!("the node's {what} is {v}"),
        None => format!("the node has no {what} {}", r.key),
    };
    Some(format!(
        "{} {} [{}] ({shown})",
        r.key,
        r.operator,
        values.join(", ")
    ))
}

/// Whether the scheduler treats the resource as extended (`IsExtendedResourceName`): a qualified name
/// outside the `kubernetes.io` namespace, not a `requests.` quota name, not hugepages.
fn is_extended(name: &str) -> bool {
    name.contains('/') && !name.contains("kubernetes.io/") && !name.starts_with("requests.")
}

/// The amounts of each resource the pod needs at once: its containers together, or its largest init
/// container if that is more (the scheduler's effective request).
pub fn pod_needs(pod: &Pod) -> BTreeMap<String, i64> {
    let Some(spec) = pod.spec.as_ref() else {
        return BTreeMap::new();
    };
    let amounts = |c: &k8s_openapi::api::core::v1::Container| -> BTreeMap<String, i64> {
        let r = c.resources.as_ref();
        let mut out = BTreeMap::new();
        for list in [
            r.and_then(|r| r.requests.as_ref()),
            r.and_then(|r| r.limits.as_ref()),
        ] {
            for (k, q) in list.into_iter().flatten() {
                if let Some(v) = Quantity::parse(&q.0).ok().and_then(|q| q.as_integer()) {
                    let e = out.entry(k.clone()).or_insert(0);
                    *e = (*e).max(v);
                }
            }
        }
        out
    };
    let mut need: BTreeMap<String, i64> = BTreeMap::new();
    for c in &spec.containers {
        for (k, v) in amounts(c) {
            *need.entry(k).or_insert(0) += v;
        }
    }
    for c in spec.init_containers.iter().flatten() {
        for (k, v) in amounts(c) {
            let e = need.entry(k).or_insert(0);
            *e = (*e).max(v);
        }
    }
    need.retain(|_, v| *v > 0);
    need
}

/// The DeviceClass that serves an extended resource, as the scheduler finds it.
pub fn class_serving<'c>(classes: &'c [DeviceClass], resource: &str) -> Option<&'c DeviceClass> {
    classes.iter().find(|c| {
        let Some(class) = c.metadata.name.as_deref() else {
            return false;
        };
        c.spec.as_ref().and_then(|s| s.extended_resource_name.as_deref()) == Some(resource)
            || resource == format!("deviceclass.resource.kubernetes.io/{class}")
    })
}

/// Extended resources the pod asks for that no DeviceClass serves: only a device plugin's allocatable
/// can satisfy them.
pub fn unserved_extended(pod: &Pod, classes: &[DeviceClass]) -> Vec<(String, i64)> {
    pod_needs(pod)
        .into_iter()
        .filter(|(r, _)| {
            (is_extended(r) || r.starts_with("deviceclass.resource.kubernetes.io/"))
                && class_serving(classes, r).is_none()
        })
        .collect()
}

/// The prepare failure kubelet last reported for the pod, if it has not started since.
#[derive(Clone, Debug)]
pub struct PrepareFailure {
    pub node: String,
    pub message: String,
    pub count: i32,
}

pub fn prepare_failure(pod: &Pod, events: &[Event]) -> Option<PrepareFailure> {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if !matches!(phase, None | Some("Pending")) {
        return None;
    }
    let name = pod.metadata.name.as_deref()?;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    let uid = pod.metadata.uid.as_deref();
    let when = |e: &Event| {
        e.last_timestamp
            .as_ref()
            .map(|t| t.0)
            .or_else(|| e.event_time.as_ref().map(|t| t.0))
            .or_else(|| e.first_timestamp.as_ref().map(|t| t.0))
    };
    let of_pod = |e: &&Event| {
        let o = &e.involved_object;
        o.kind.as_deref() == Some("Pod")
            && o.name.as_deref() == Some(name)
            && o.namespace.as_deref().unwrap_or("default") == namespace
            // An earlier pod of the same name is someone else.
            && (uid.is_none() || o.uid.is_none() || o.uid.as_deref() == uid)
    };
    // The latest word from kubelet on this pod decides: a prepare failure followed by a start is over.
    let latest = events
        .iter()
        .filter(of_pod)
        .filter(|e| {
            e.source.as_ref().and_then(|s| s.component.as_deref()) == Some("kubelet")
                || e.reporting_component.as_deref() == Some("kubelet")
                || e.reason.as_deref() == Some("FailedPrepareDynamicResources")
        })
        .max_by_key(|e| when(e))?;
    if latest.type_.as_deref() != Some("Warning")
        || latest.reason.as_deref() != Some("FailedPrepareDynamicResources")
    {
        return None;
    }
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .or_else(|| latest.source.as_ref().and_then(|s| s.host.clone()))
        .unwrap_or_else(|| "its node".into());
    Some(PrepareFailure {
        node,
        message: latest.message.clone().unwrap_or_default(),
        count: latest.count.unwrap_or(1),
    })
}

/// A container of a bound pod that the container runtime refuses because of tessera's devices: its claims
/// are allocated and prepared, so nothing the scheduler or kubelet's prepare reports says why it waits.
#[derive(Clone, Debug)]
pub struct RuntimeFailure {
    pub node: String,
    pub container: String,
    /// Kubelet's reason: `CreateContainerError`, `RunContainerError`, `StartError`, ...
    pub reason: String,
    pub message: String,
    /// UIDs of the claims whose CDI devices the message names, for the spec file on the node.
    pub claim_uids: Vec<String>,
}

/// Reasons kubelet gives a container the runtime refused: a CDI device it cannot resolve or inject fails
/// the create, a CDI hook that fails fails the start.
const RUNTIME_REASONS: &[&str] = &[
    "CreateContainerError",
    "RunContainerError",
    "StartError",
    "ContainerCannotRun",
];

/// What ties a runtime's message to tessera: the vendor of its CDI devices, or the hook its specs run.
const TESSERA_MARKS: &[&str] = &["k8s.gpu.tessera.dev", "tessera-cdi-hook"];

/// The first container (init containers first) the runtime refuses for tessera's devices, with the claims
/// (of `claims`) the message names.
pub fn runtime_failure(pod: &Pod, claims: &[ResourceClaim]) -> Option<RuntimeFailure> {
    let status = pod.status.as_ref()?;
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return None;
    }
    let mut statuses = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten());
    let (container, reason, message) = statuses.find_map(|s| {
        let refused = |reason: Option<&String>, message: Option<&String>| {
            let (reason, message) = (reason?, message?);
            (RUNTIME_REASONS.contains(&reason.as_str()) && TESSERA_MARKS.iter().any(|m| message.contains(m)))
                .then(|| (s.name.clone(), reason.clone(), message.clone()))
        };
        let state = s.state.as_ref();
        let waiting = state.and_then(|st| st.waiting.as_ref())?;
        // A container in back-off after a failed start waits as CrashLoopBackOff; its last state says why.
        refused(waiting.reason.as_ref(), waiting.message.as_ref()).or_else(|| {
            let last = s.last_state.as_ref()?.terminated.as_ref()?;
            refused(last.reason.as_ref(), last.message.as_ref())
        })
    })?;
    let claim_uids = claims
        .iter()
        .filter_map(|c| c.metadata.uid.clone())
        .filter(|uid| !uid.is_empty() && message.contains(uid.as_str()))
        .collect();
    Some(RuntimeFailure {
        node: pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_else(|| "its node".into()),
        container,
        reason,
        message,
        claim_uids,
    })
}
