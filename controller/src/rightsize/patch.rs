//! What the recommendation changes in a ResourceClaimTemplate: the share request it sizes, the JSON patch
//! (`capacity.requests.compute`/`memory`, the ceiling in the share's opaque config), and the resized
//! template under a new name (the API server refuses changes to a template's `spec`: it is immutable).

use serde_json::{Value, json};

use super::{error::RightsizeError, rule::Recommendation};

/// The DeviceClass of tessera's shares (GPU shares and MIG shares).
pub const SHARE_CLASS: &str = "shared.gpu.tessera.dev";
/// The opaque config's driver.
pub const DRIVER: &str = "gpu.tessera.dev";
const CONFIG_API_VERSION: &str = "gpu.tessera.dev/v1alpha1";

/// The request rightsize sizes: its index in `spec.spec.devices.requests` and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareRequest {
    pub index: usize,
    pub name: String,
}

/// What the recommendation changes.
#[derive(Debug, Clone, PartialEq)]
pub struct Changes {
    /// RFC 6902 operations on the template as it is.
    pub patch: Vec<Value>,
    /// What a user should know about them (a ceiling left out, a config entry added).
    pub notes: Vec<String>,
}

fn requests(template: &Value) -> Result<&Vec<Value>, RightsizeError> {
    template
        .pointer("/spec/spec/devices/requests")
        .and_then(Value::as_array)
        .ok_or_else(|| RightsizeError::Template {
            message: "spec.spec.devices.requests is missing: the template asks for no device".into(),
        })
}

fn name_of(request: &Value) -> String {
    request["name"].as_str().unwrap_or_default().to_string()
}

/// The share request: the one named by `--request`, else the template's only `shared.gpu.tessera.dev`
/// request. A named request that is not a share is refused saying what it is.
pub fn share_request(template: &Value, wanted: Option<&str>) -> Result<ShareRequest, RightsizeError> {
    let requests = requests(template)?;
    let names: Vec<String> = requests.iter().map(name_of).collect();
    let check = |index: usize| -> Result<ShareRequest, RightsizeError> {
        let request = &requests[index];
        let name = names[index].clone();
        if request.get("firstAvailable").is_some() {
            return Err(RightsizeError::NotAShare {
                request: name,
                why: "it lists firstAvailable alternatives; rightsize sizes a request written with `exactly`"
                    .into(),
            });
        }
        let class = request
            .pointer("/exactly/deviceClassName")
            .and_then(Value::as_str)
            .unwrap_or("");
        if class != SHARE_CLASS {
            let what = match class {
                "gpu.tessera.dev" => "a whole GPU".to_string(),
                c if c.starts_with("mig") && c.ends_with(".gpu.tessera.dev") => {
                    "a whole MIG device".to_string()
                }
                "" => "no deviceClassName".to_string(),
                c => format!("DeviceClass {c}"),
            };
            return Err(RightsizeError::NotAShare {
                request: name,
                why: format!(
                    "it asks for {what}, which has no compute or memory to size; rightsize sizes shares \
                     (deviceClassName: {SHARE_CLASS})"
                ),
            });
        }
        Ok(ShareRequest { index, name })
    };
    if let Some(wanted) = wanted {
        let index = names
            .iter()
            .position(|n| n == wanted)
            .ok_or_else(|| RightsizeError::Template {
                message: format!(
                    "no request named {wanted:?}; the template's requests: {}",
                    names.join(", ")
                ),
            })?;
        return check(index);
    }
    let shares: Vec<usize> = (0..requests.len())
        .filter(|&i| {
            requests[i]
                .pointer("/exactly/deviceClassName")
                .and_then(Value::as_str)
                == Some(SHARE_CLASS)
        })
        .collect();
    match shares.as_slice() {
        [one] => check(*one),
        [] if requests.is_empty() => Err(RightsizeError::Template {
            message: "spec.spec.devices.requests is empty: the template asks for no device".into(),
        }),
        // No share: the first request is refused, naming what it asks for.
        [] => check(0),
        several => Err(RightsizeError::Template {
            message: format!(
                "several share requests ({}); name one with --request",
                several
                    .iter()
                    .map(|&i| names[i].as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }),
    }
}

/// The kind of opaque config that applies to the devices the share ran on (their `device` labels):
/// `MigConfig` for shares of MIG devices (`gpu-0-mig-3g-40gb-4-shared`), `GpuConfig` otherwise.
fn config_kind(devices: &[String]) -> Result<&'static str, RightsizeError> {
    let mig = devices.iter().filter(|d| d.contains("-mig-")).count();
    match (mig, devices.len() - mig) {
        (0, _) => Ok("GpuConfig"),
        (_, 0) => Ok("MigConfig"),
        _ => Err(RightsizeError::Template {
            message: format!(
                "the share ran on both GPU and MIG devices ({}); add a tessera config entry for the request \
                 (GpuConfig or MigConfig) to the template and run again",
                devices.join(", ")
            ),
        }),
    }
}

fn is_tessera(entry: &Value) -> bool {
    entry.pointer("/opaque/driver").and_then(Value::as_str) == Some(DRIVER)
}

fn targets(entry: &Value) -> Vec<String> {
    entry["requests"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).map(String::from).collect())
        .unwrap_or_default()
}

/// The patch that sets the request's compute and memory and the share's ceiling.
pub fn changes(
    template: &Value,
    share: &ShareRequest,
    rec: &Recommendation,
    devices: &[String],
) -> Result<Changes, RightsizeError> {
    let base = format!("/spec/spec/devices/requests/{}", share.index);
    let compute = json!(rec.compute_percent.to_string());
    let memory = json!(format!("{}Gi", rec.memory_gib));
    // The test makes the patch fail, rather than size another request, on a template changed since.
    let mut patch = vec![json!({"op": "test", "path": format!("{base}/name"), "value": share.name})];
    let exactly = &requests(template)?[share.index]["exactly"];
    match (exactly.get("capacity"), exactly.pointer("/capacity/requests")) {
        (None, _) => patch.push(json!({"op": "add", "path": format!("{base}/exactly/capacity"),
            "value": {"requests": {"compute": compute, "memory": memory}}})),
        (Some(_), None) => patch.push(
            json!({"op": "add", "path": format!("{base}/exactly/capacity/requests"),
            "value": {"compute": compute, "memory": memory}}),
        ),
        (Some(_), Some(_)) => {
            // `add` on an existing member replaces it (RFC 6902 §4.1).
            patch.push(json!({"op": "add", "path": format!("{base}/exactly/capacity/requests/compute"), "value": compute}));
            patch.push(json!({"op": "add", "path": format!("{base}/exactly/capacity/requests/memory"), "value": memory}));
        }
    }
    let mut notes = Vec::new();
    let ceiling = json!(rec.ceiling_percent);
    let configs = template
        .pointer("/spec/spec/devices/config")
        .and_then(Value::as_array);
    let entries: Vec<(usize, &Value)> = configs
        .map(|c| c.iter().enumerate().filter(|(_, e)| is_tessera(e)).collect())
        .unwrap_or_default();
    // The entry that applies (api/README.md: a targeted entry above an untargeted one, the later among
    // equals); an untargeted one applies only to devices of its kind.
    let kind = config_kind(devices);
    let targeted = entries
        .iter()
        .rev()
        .find(|(_, e)| targets(e).contains(&share.name));
    let untargeted = entries.iter().rev().find(|(_, e)| {
        targets(e).is_empty()
            && kind
                .as_ref()
                .is_ok_and(|k| e.pointer("/opaque/parameters/kind").and_then(Value::as_str) == Some(k))
    });
    let only_request = requests(template)?.len() == 1;
    let new_entry = |parameters: Value| json!({"requests": [share.name], "opaque": {"driver": DRIVER, "parameters": parameters}});
    let config_path = |i: usize| format!("/spec/spec/devices/config/{i}/opaque/parameters");
    let append = |patch: &mut Vec<Value>, entry: Value| match configs {
        Some(_) => patch.push(json!({"op": "add", "path": "/spec/spec/devices/config/-", "value": entry})),
        None => patch.push(json!({"op": "add", "path": "/spec/spec/devices/config", "value": [entry]})),
    };
    let existing = targeted.or(untargeted);
    match existing {
        None => {
            let parameters = json!({"apiVersion": CONFIG_API_VERSION, "kind": kind?,
                "sharing": {"strategy": "MPS", "mps": {"computeCeiling": ceiling}}});
            append(&mut patch, new_entry(parameters));
            notes.push(format!(
                "added a config entry for request {} with strategy MPS (the template had none): the share's \
                 device must serve MPS (its sharingStrategy attribute)",
                share.name
            ));
        }
        Some((i, entry)) => {
            let parameters = &entry["opaque"]["parameters"];
            let sharing = &parameters["sharing"];
            if sharing["strategy"].as_str() == Some("TimeSlicing") {
                notes.push(format!(
                    "no ceiling set: config entry {i} time-slices the share, which takes turns on the whole GPU \
                     (its ceiling is 100 % already)"
                ));
                return Ok(Changes { patch, notes });
            }
            if let Some(d) = sharing
                .pointer("/mps/defaultActiveThreadPercentage")
                .and_then(Value::as_u64)
                && d < u64::from(rec.ceiling_percent)
            {
                return Err(RightsizeError::Template {
                    message: format!(
                        "config entry {i} sets sharing.mps.defaultActiveThreadPercentage {d}, which caps the \
                         share's ceiling below the {} % the rule gives (computeCeiling may not exceed it); \
                         remove it from the entry (a share that requests compute does not use it) and run again",
                        rec.ceiling_percent
                    ),
                });
            }
            let is_targeted = targeted.is_some();
            if is_targeted || only_request {
                let path = config_path(*i);
                if sharing.is_null() {
                    patch.push(json!({"op": "add", "path": format!("{path}/sharing"),
                        "value": {"strategy": "MPS", "mps": {"computeCeiling": ceiling}}}));
                } else if sharing.get("mps").is_none() {
                    patch.push(json!({"op": "add", "path": format!("{path}/sharing/mps"), "value": {"computeCeiling": ceiling}}));
                } else {
                    patch.push(json!({"op": "add", "path": format!("{path}/sharing/mps/computeCeiling"), "value": ceiling}));
                }
            } else {
                // The untargeted entry applies to the template's other requests too, where a ceiling may mean
                // nothing (a whole GPU): a copy aimed at this request carries it, and ranks above.
                let mut parameters = parameters.clone();
                if parameters["sharing"].is_null() {
                    parameters["sharing"] = json!({"strategy": "MPS"});
                }
                if parameters["sharing"].get("mps").is_none() {
                    parameters["sharing"]["mps"] = json!({});
                }
                parameters["sharing"]["mps"]["computeCeiling"] = ceiling;
                append(&mut patch, new_entry(parameters));
                notes.push(format!(
                    "added a copy of config entry {i} aimed at request {} with the ceiling (the entry names no \
                     request, so it applies to the others too)",
                    share.name
                ));
            }
        }
    }
    Ok(Changes { patch, notes })
}

/// Applies `add` and `test` operations (all [`changes`] writes) to a copy of `doc`.
pub fn apply(doc: &Value, patch: &[Value]) -> Result<Value, String> {
    let mut doc = doc.clone();
    for op in patch {
        let path = op["path"].as_str().ok_or("an operation without a path")?;
        let (parent, last) = path.rsplit_once('/').ok_or("a path not starting with /")?;
        let value = op["value"].clone();
        match op["op"].as_str() {
            Some("test") => {
                if doc.pointer(path) != Some(&value) {
                    return Err(format!("test failed at {path}"));
                }
            }
            Some("add") => match doc.pointer_mut(parent).ok_or_else(|| format!("no {parent}"))? {
                Value::Object(map) => {
                    map.insert(last.to_string(), value);
                }
                Value::Array(items) if last == "-" => items.push(value),
                Value::Array(items) => {
                    let i: usize = last.parse().map_err(|_| format!("bad index {last}"))?;
                    items.insert(i, value);
                }
                _ => return Err(format!("{parent} is not a container")),
            },
            other => return Err(format!("unsupported op {other:?}")),
        }
    }
    Ok(doc)
}

/// The new template's name: the old one (a name this gave before stripped) with `-c<compute>-m<memory>gi`,
/// so running it again with the same answer names the same template.
pub fn resized_name(old: &str, rec: &Recommendation) -> String {
    let stem = match old.rsplit_once("-c") {
        Some((stem, tail))
            if tail.split_once("-m").is_some_and(|(c, m)| {
                !c.is_empty()
                    && c.bytes().all(|b| b.is_ascii_digit())
                    && m.strip_suffix("gi")
                        .is_some_and(|m| !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit()))
            }) =>
        {
            stem
        }
        _ => old,
    };
    format!("{stem}-c{}-m{}gi", rec.compute_percent, rec.memory_gib)
}

/// The resized template as `kubectl apply -f -` takes it: the patch applied, the new name, and only the
/// metadata a user wrote (labels, annotations but kubectl's last-applied copy).
pub fn resized_template(
    template: &Value,
    changes: &Changes,
    rec: &Recommendation,
) -> Result<Value, RightsizeError> {
    let mut new = apply(template, &changes.patch).map_err(|message| RightsizeError::Template { message })?;
    let old_name = template
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("template");
    let mut metadata = json!({"name": resized_name(old_name, rec)});
    for field in ["namespace", "labels"] {
        if let Some(v) = template["metadata"].get(field) {
            metadata[field] = v.clone();
        }
    }
    if let Some(Value::Object(a)) = template["metadata"].get("annotations") {
        let mut a = a.clone();
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
        if !a.is_empty() {
            metadata["annotations"] = Value::Object(a);
        }
    }
    new["metadata"] = metadata;
    new["apiVersion"] = json!(template["apiVersion"].as_str().unwrap_or("resource.k8s.io/v1"));
    new["kind"] = json!("ResourceClaimTemplate");
    if let Some(o) = new.as_object_mut() {
        o.remove("status");
    }
    Ok(new)
}
