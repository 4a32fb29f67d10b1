//! `--from-file`: a JSON or YAML `List` (or several YAML documents) of DeviceClasses, ResourceSlices,
//! ResourceClaims, Pods and ResourceClaimTemplates, as `kubectl get … -o json` prints them, and optionally
//! Nodes (for a pod's nodeSelector, affinity, taints and extended resources), core/v1 Events (for the
//! prepare failure kubelet reported) and DeviceTaintRules. Other kinds are skipped so a whole `kubectl get`
//! dump can be fed in.

use std::path::Path;

use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{cluster::Cluster, error::ExplainError};

fn file_error(path: &str, message: impl ToString) -> ExplainError {
    ExplainError::File {
        path: path.to_string(),
        message: message.to_string(),
    }
}

fn documents(path: &str, text: &str) -> Result<Vec<Value>, ExplainError> {
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        let v: Value = serde_json::from_str(text).map_err(|e| {
            file_error(
                path,
                format!("not valid JSON: {e}; give a List as `kubectl get … -o json` prints it"),
            )
        })?;
        return Ok(vec![v]);
    }
    let mut out = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let v = <Value as serde::Deserialize>::deserialize(doc).map_err(|e| {
            file_error(
                path,
                format!("not valid YAML: {e}; give a List as `kubectl get … -o yaml` prints it"),
            )
        })?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

fn typed<T: DeserializeOwned>(path: &str, what: &str, v: Value) -> Result<T, ExplainError> {
    serde_json::from_value(v).map_err(|e| file_error(path, format!("{what}: {e}")))
}

fn add(cluster: &mut Cluster, path: &str, v: Value, list_kind: Option<&str>) -> Result<(), ExplainError> {
    if let Value::Array(items) = v {
        for item in items {
            add(cluster, path, item, list_kind)?;
        }
        return Ok(());
    }
    let kind = v
        .get("kind")
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| list_kind.map(str::to_string))
        .ok_or_else(|| {
            file_error(
                path,
                "an object has no `kind`; give a List as `kubectl get … -o json` prints it",
            )
        })?;
    if kind == "List" || kind.ends_with("List") {
        // Moved out, not cloned: a cluster's slices can be tens of megabytes.
        let mut v = v;
        let items = v
            .as_object_mut()
            .and_then(|o| o.remove("items"))
            .unwrap_or(Value::Array(Vec::new()));
        let inner = kind.strip_suffix("List").filter(|k| !k.is_empty());
        return add(cluster, path, items, inner);
    }
    let name = v
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("(no name)")
        .to_string();
    let what = format!("{kind} {name}");
    let api_version = v.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    let is_resource = matches!(
        kind.as_str(),
        "DeviceClass" | "ResourceSlice" | "ResourceClaim" | "ResourceClaimTemplate"
    );
    if is_resource && !api_version.is_empty() && api_version != "resource.k8s.io/v1" {
        return Err(file_error(
            path,
            format!(
                "{what} is {api_version}; export it as resource.k8s.io/v1 (kubectl get {}.v1.resource.k8s.io -o json)",
                kind.to_lowercase()
            ),
        ));
    }
    match kind.as_str() {
        "DeviceClass" => cluster.classes.push(typed(path, &what, v)?),
        "ResourceSlice" => cluster.slices.push(typed(path, &what, v)?),
        "ResourceClaim" => cluster.claims.push(typed(path, &what, v)?),
        "ResourceClaimTemplate" => cluster.templates.push(typed(path, &what, v)?),
        "Pod" => cluster.pods.push(typed(path, &what, v)?),
        "Node" => cluster.nodes.push(typed(path, &what, v)?),
        // events.k8s.io/v1 Events name the pod differently (`regarding`); kubectl get events prints v1.
        "Event" if matches!(api_version, "" | "v1") => cluster.events.push(typed(path, &what, v)?),
        "DeviceTaintRule" => {
            if !matches!(
                api_version,
                "" | "resource.k8s.io/v1" | "resource.k8s.io/v1beta2" | "resource.k8s.io/v1alpha3"
            ) {
                return Err(file_error(
                    path,
                    format!("{what} is {api_version}; export it as resource.k8s.io/v1"),
                ));
            }
            // The older versions carry the same selector and taint fields explain reads.
            let mut v = v;
            v["apiVersion"] = Value::String("resource.k8s.io/v1".into());
            cluster.taint_rules.push(typed(path, &what, v)?);
        }
        _ => {}
    }
    Ok(())
}

/// Reads the objects of a JSON or YAML text.
pub fn parse(path: &str, text: &str) -> Result<Cluster, ExplainError> {
    let mut cluster = Cluster::default();
    for doc in documents(path, text)? {
        add(&mut cluster, path, doc, None)?;
    }
    Ok(cluster)
}

/// Reads the objects of a file.
pub fn read(path: &Path) -> Result<Cluster, ExplainError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| file_error(&shown, e))?;
    parse(&shown, &text)
}
