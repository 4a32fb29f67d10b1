//! `kubectl tessera migrate`: specs written for NVIDIA's DRA driver (`gpu.nvidia.com`) or device plugin
//! rewritten for tessera, with a note for each change and for each thing that could not be translated.
//!
//! What is rewritten, object by object:
//!
//! | Input | Output |
//! |---|---|
//! | request of `gpu.nvidia.com` | `gpu.tessera.dev`; with `capacity.requests` (a consumable share) `shared.gpu.tessera.dev` |
//! | request of `mig.nvidia.com` | `mig.gpu.tessera.dev` |
//! | CEL over `device.attributes["gpu.nvidia.com"]` / `capacity[…]` | tessera's domain; `parentUUID` → `uuid`; MIG profile names of another model → the target model's ([`mig`]) |
//! | `matchAttribute` / `distinctAttribute` `gpu.nvidia.com/<name>` | `gpu.tessera.dev/<name>` (`parentUUID` → `uuid`) |
//! | opaque config of `gpu.nvidia.com` | tessera's `GpuConfig` / `MigConfig` ([`config`]) |
//! | `resource.k8s.io/v1beta1`/`v1beta2` claims, templates, classes | `resource.k8s.io/v1` (`exactly` requests) |
//! | NVIDIA's own DeviceClasses | removed: tessera ships its own (`deployments/classes/`) |
//! | `nvidia.com/gpu` in a container's resources | unchanged: `gpu.tessera.dev` serves it (`extendedResourceName`) |
//! | `nvidia.com/mig-<profile>` | the target model's profile name; served by `deployments/classes/mig-profiles/` |
//!
//! Other kinds pass through unchanged. YAML comments are not kept.

pub mod cel;
pub mod cli;
pub mod config;
pub mod mig;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Deserialize;
use serde_norway::{Mapping, Value};

use mig::{Mapped, MigModel, map_profile};

/// NVIDIA's driver name, attribute domain and whole-GPU class.
pub const NVIDIA_DRIVER: &str = "gpu.nvidia.com";
/// NVIDIA's MIG class.
pub const NVIDIA_MIG_CLASS: &str = "mig.nvidia.com";
/// tessera's driver name and attribute domain.
pub const TESSERA_DRIVER: &str = tessera_api::DRIVER_NAME;
/// tessera's whole-GPU class.
pub const GPU_CLASS: &str = "gpu.tessera.dev";
/// tessera's MIG class.
pub const MIG_CLASS: &str = "mig.gpu.tessera.dev";
/// tessera's class of GPU shares.
pub const SHARED_CLASS: &str = "shared.gpu.tessera.dev";

/// The DeviceClasses NVIDIA's chart installs.
const NVIDIA_CLASSES: &[&str] = &[
    NVIDIA_DRIVER,
    NVIDIA_MIG_CLASS,
    "vfio.gpu.nvidia.com",
    "compute-domain-daemon.nvidia.com",
    "compute-domain-default-channel.nvidia.com",
];

/// Why migrate produced nothing.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("cannot read {path}: {message}")]
    Read { path: String, message: String },
    #[error("{path}: document {document} is not YAML: {message}")]
    Yaml {
        path: String,
        document: usize,
        message: String,
    },
}

/// What a note says about its field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Rewritten.
    Changed,
    /// Left as written (or removed), because tessera has no equivalent: the user decides.
    NotTranslated,
    /// Works on tessera as written.
    NothingNeeded,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Self::Changed => "changed",
            Self::NotTranslated => "NOT TRANSLATED",
            Self::NothingNeeded => "unchanged",
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// 1-based number of the input document.
    pub document: usize,
    /// `Kind namespace/name`.
    pub object: String,
    /// Field path in the object, as written in the output.
    pub field: String,
    pub outcome: Outcome,
    pub message: String,
}

impl fmt::Display for Note {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} (document {})",
            self.outcome.label(),
            self.object,
            self.document
        )?;
        if !self.field.is_empty() {
            write!(f, " {}", self.field)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// How to translate.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// The GPU model MIG profile names are rewritten for.
    pub target: MigModel,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            target: MigModel::H100_80,
        }
    }
}

/// The translated documents and the notes.
#[derive(Clone, Debug)]
pub struct Migration {
    pub yaml: String,
    pub notes: Vec<Note>,
}

impl Migration {
    /// The report: a summary line, then one line per note.
    pub fn report(&self) -> String {
        let count = |o| self.notes.iter().filter(|n| n.outcome == o).count();
        let mut out = format!(
            "kubectl tessera migrate: {} changed, {} not translated, {} unchanged (work as written)\n",
            count(Outcome::Changed),
            count(Outcome::NotTranslated),
            count(Outcome::NothingNeeded)
        );
        for n in &self.notes {
            out.push_str(&n.to_string());
            out.push('\n');
        }
        out
    }
}

/// Translates every document of `text` (`source` names it in errors).
pub fn migrate(text: &str, source: &str, opts: Options) -> Result<Migration, MigrateError> {
    let mut docs = Vec::new();
    for (i, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let v = Value::deserialize(doc).map_err(|e| MigrateError::Yaml {
            path: source.to_string(),
            document: i + 1,
            message: e.to_string(),
        })?;
        if !v.is_null() {
            docs.push(v);
        }
    }
    // Classes the input defines itself are the user's: requests naming them are not reported.
    let own_classes: BTreeSet<String> = docs
        .iter()
        .filter(|d| d.get("kind").and_then(Value::as_str) == Some("DeviceClass"))
        .filter_map(|d| name_of(d).1)
        .filter(|n| !NVIDIA_CLASSES.contains(&n.as_str()))
        .collect();
    // Extended resources the input's own classes serve (by their name as written).
    let own_resources: BTreeMap<String, String> = docs
        .iter()
        .filter(|d| d.get("kind").and_then(Value::as_str) == Some("DeviceClass"))
        .filter_map(|d| {
            let ext = d.get("spec")?.get("extendedResourceName")?.as_str()?;
            Some((ext.to_string(), name_of(d).1?))
        })
        .collect();
    let mut notes = Vec::new();
    let mut out = Vec::new();
    for (i, mut doc) in docs.into_iter().enumerate() {
        let mut w = Walker {
            document: i + 1,
            object: String::new(),
            notes: &mut notes,
            opts,
            own_classes: &own_classes,
            own_resources: &own_resources,
        };
        if w.object(&mut doc) {
            out.push(serde_norway::to_string(&doc).expect("a YAML value read from YAML serializes back"));
        }
    }
    Ok(Migration {
        yaml: out.join("---\n"),
        notes,
    })
}

fn name_of(v: &Value) -> (Option<String>, Option<String>) {
    let meta = v.get("metadata");
    let get = |k| {
        meta.and_then(|m| m.get(k))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    (get("namespace"), get("name"))
}

fn s(v: &str) -> Value {
    Value::String(v.to_string())
}

struct Walker<'a> {
    document: usize,
    object: String,
    notes: &'a mut Vec<Note>,
    opts: Options,
    own_classes: &'a BTreeSet<String>,
    own_resources: &'a BTreeMap<String, String>,
}

impl Walker<'_> {
    fn note(&mut self, outcome: Outcome, field: &str, message: impl Into<String>) {
        self.notes.push(Note {
            document: self.document,
            object: self.object.clone(),
            field: field.to_string(),
            outcome,
            message: message.into(),
        });
    }

    fn changed(&mut self, field: &str, message: impl Into<String>) {
        self.note(Outcome::Changed, field, message);
    }

    fn untranslated(&mut self, field: &str, message: impl Into<String>) {
        self.note(Outcome::NotTranslated, field, message);
    }

    /// Translates one object in place; `false` when it is to be left out of the output.
    fn object(&mut self, v: &mut Value) -> bool {
        let kind = v
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let (ns, name) = name_of(v);
        self.object = match (&ns, &name) {
            (Some(ns), Some(n)) => format!("{kind} {ns}/{n}"),
            (None, Some(n)) => format!("{kind} {n}"),
            _ => kind.clone(),
        };
        let pod_spec_at: &[&str] = match kind.as_str() {
            "List" => {
                let object = self.object.clone();
                if let Some(items) = v.get_mut("items").and_then(Value::as_sequence_mut) {
                    items.retain_mut(|item| self.object(item));
                }
                self.object = object;
                return true;
            }
            "DeviceClass" => return self.device_class(v, name.as_deref().unwrap_or_default()),
            "ResourceClaim" | "ResourceClaimTemplate" => {
                let v1beta1 = self.upgrade(v);
                let path: &[&str] = if kind == "ResourceClaim" {
                    &["spec"]
                } else {
                    &["spec", "spec"]
                };
                if let Some(spec) = at(v, path) {
                    self.claim_spec(spec, &path.join("."), v1beta1);
                }
                return true;
            }
            "Pod" => &["spec"],
            "PodTemplate" => &["template", "spec"],
            "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "ReplicationController" | "Job" => {
                &["spec", "template", "spec"]
            }
            "CronJob" => &["spec", "jobTemplate", "spec", "template", "spec"],
            _ => return true,
        };
        if let Some(spec) = at(v, pod_spec_at) {
            self.pod_spec(spec, &pod_spec_at.join("."));
        }
        true
    }

    /// `resource.k8s.io` beta versions → `v1`; `true` when the object was v1beta1 (flat requests).
    fn upgrade(&mut self, v: &mut Value) -> bool {
        let Some(version) = v.get("apiVersion").and_then(Value::as_str).map(str::to_string) else {
            return false;
        };
        if !matches!(
            version.as_str(),
            "resource.k8s.io/v1beta1" | "resource.k8s.io/v1beta2" | "resource.k8s.io/v1alpha3"
        ) {
            return false;
        }
        v["apiVersion"] = s("resource.k8s.io/v1");
        self.changed(
            "apiVersion",
            format!("{version} → resource.k8s.io/v1 (the version tessera's classes and examples use)"),
        );
        version != "resource.k8s.io/v1beta2"
    }

    fn device_class(&mut self, v: &mut Value, name: &str) -> bool {
        if NVIDIA_CLASSES.contains(&name) {
            if name == NVIDIA_DRIVER || name == NVIDIA_MIG_CLASS {
                let ours = if name == NVIDIA_DRIVER {
                    GPU_CLASS
                } else {
                    MIG_CLASS
                };
                self.changed(
                    "",
                    format!(
                        "NVIDIA's own class removed: tessera ships {ours} (deployments/classes/{ours}.yaml), \
                         which requests are rewritten to{}",
                        if name == NVIDIA_DRIVER {
                            "; both carry extendedResourceName nvidia.com/gpu, which only one class may"
                        } else {
                            ""
                        }
                    ),
                );
                return false;
            }
            self.untranslated(
                "",
                "tessera has no VFIO passthrough or ComputeDomain (IMEX) devices; left as written",
            );
            return true;
        }
        self.upgrade(v);
        let Some(spec) = v.get_mut("spec").and_then(Value::as_mapping_mut) else {
            return true;
        };
        let text = serde_norway::to_string(&spec.get("selectors")).unwrap_or_default();
        let mig = text.contains("'mig'") || text.contains("\"mig\"");
        if let Some(sels) = spec.get_mut("selectors") {
            self.selectors(sels, "spec.selectors", mig, false);
        }
        if let Some(config) = spec.get_mut("config") {
            self.configs(config, "spec.config");
        }
        drop_null(spec, "config");
        if let Some(ext) = spec
            .get("extendedResourceName")
            .and_then(Value::as_str)
            .map(str::to_string)
            && let Some(new) = self.extended_resource(&ext, "spec.extendedResourceName", true)
        {
            spec.insert(s("extendedResourceName"), s(&new));
        }
        true
    }

    /// A `nvidia.com/…` extended resource name: the new name when it changes.
    fn extended_resource(&mut self, name: &str, field: &str, in_class: bool) -> Option<String> {
        if name == "nvidia.com/gpu" {
            self.note(
                Outcome::NothingNeeded,
                field,
                "nvidia.com/gpu needs no change: tessera's gpu.tessera.dev DeviceClass carries \
                 extendedResourceName nvidia.com/gpu (Kubernetes 1.36+, KEP-5004), so the scheduler gives \
                 such a container whole tessera GPUs through a claim it makes; the node must not also run \
                 NVIDIA's device plugin (deployments/classes/README.md)",
            );
            return None;
        }
        let Some(profile) = name.strip_prefix("nvidia.com/mig-") else {
            if name.starts_with("nvidia.com/") {
                self.untranslated(
                    field,
                    format!(
                        "{name} is a resource of NVIDIA's device plugin that no tessera class serves \
                         (time-sliced replicas are renamed `.shared`): ask for a claim of \
                         {SHARED_CLASS} instead"
                    ),
                );
            }
            return None;
        };
        let own = self.own_resources.get(name).cloned();
        let served = |p: &str| match &own {
            Some(_) if in_class => "pods asking for it are rewritten to match".to_string(),
            Some(class) => format!("served by this input's DeviceClass {class}, translated with it"),
            None => format!(
                "served once deployments/classes/mig-profiles/mig-{p}.gpu.tessera.dev.yaml is applied \
                 (opt-in, one class per H100 80GB profile)"
            ),
        };
        match map_profile(profile, self.opts.target) {
            Mapped::Same => {
                self.note(
                    Outcome::NothingNeeded,
                    field,
                    format!("{name}: {}", served(profile)),
                );
                None
            }
            Mapped::To { profile: new, why } => {
                let new_name = format!("nvidia.com/mig-{new}");
                self.changed(field, format!("{name} → {new_name}: {why}; {}", served(&new)));
                Some(new_name)
            }
            Mapped::Unknown { why } => {
                self.untranslated(field, format!("{name}: {why}"));
                None
            }
        }
    }

    fn pod_spec(&mut self, spec: &mut Value, path: &str) {
        for list in ["initContainers", "containers"] {
            let Some(ctrs) = spec.get_mut(list).and_then(Value::as_sequence_mut) else {
                continue;
            };
            for (i, c) in ctrs.iter_mut().enumerate() {
                let Some(res) = c.get_mut("resources").and_then(Value::as_mapping_mut) else {
                    continue;
                };
                // Limits and requests carry the same names: one note per name.
                let mut seen = BTreeSet::new();
                for part in ["limits", "requests"] {
                    let Some(m) = res.get_mut(part).and_then(Value::as_mapping_mut) else {
                        continue;
                    };
                    let names: Vec<String> = m
                        .keys()
                        .filter_map(Value::as_str)
                        .filter(|k| k.starts_with("nvidia.com/"))
                        .map(str::to_string)
                        .collect();
                    for name in names {
                        let field = format!("{path}.{list}[{i}].resources.{part}");
                        let new = if seen.insert(name.clone()) {
                            self.extended_resource(&name, &field, false)
                        } else {
                            match map_profile(name.trim_start_matches("nvidia.com/mig-"), self.opts.target) {
                                Mapped::To { profile, .. } if name.starts_with("nvidia.com/mig-") => {
                                    Some(format!("nvidia.com/mig-{profile}"))
                                }
                                _ => None,
                            }
                        };
                        if let Some(new) = new {
                            rename_key(m, &name, &new);
                        }
                    }
                }
            }
        }
    }

    fn claim_spec(&mut self, spec: &mut Value, path: &str, v1beta1: bool) {
        let Some(devices) = spec.get_mut("devices").and_then(Value::as_mapping_mut) else {
            return;
        };
        let path = format!("{path}.devices");
        let mut mig = false;
        if let Some(reqs) = devices.get_mut("requests").and_then(Value::as_sequence_mut) {
            for (i, req) in reqs.iter_mut().enumerate() {
                let Some(req) = req.as_mapping_mut() else { continue };
                let at = format!("{path}.requests[{i}]");
                if v1beta1 || req.contains_key("deviceClassName") {
                    flatten_to_exactly(req);
                    self.changed(&at, "request fields moved under exactly (resource.k8s.io/v1)");
                }
                if let Some(exact) = req.get_mut("exactly").and_then(Value::as_mapping_mut) {
                    mig |= self.exact(exact, &format!("{at}.exactly"));
                }
                if let Some(subs) = req.get_mut("firstAvailable").and_then(Value::as_sequence_mut) {
                    for (j, sub) in subs.iter_mut().enumerate() {
                        if let Some(sub) = sub.as_mapping_mut() {
                            mig |= self.exact(sub, &format!("{at}.firstAvailable[{j}]"));
                        }
                    }
                }
            }
        }
        if let Some(cons) = devices.get_mut("constraints").and_then(Value::as_sequence_mut) {
            for (i, c) in cons.iter_mut().enumerate() {
                for key in ["matchAttribute", "distinctAttribute"] {
                    let Some(attr) = c.get(key).and_then(Value::as_str).map(str::to_string) else {
                        continue;
                    };
                    let Some(name) = attr.strip_prefix(&format!("{NVIDIA_DRIVER}/")) else {
                        continue;
                    };
                    let field = format!("{path}.constraints[{i}].{key}");
                    match cel::attribute(name, mig) {
                        Ok(new) => {
                            let new = format!("{TESSERA_DRIVER}/{}", new.unwrap_or(name));
                            let why = if name == "parentUUID" {
                                " (tessera's MIG devices carry their GPU's UUID as uuid)"
                            } else {
                                ""
                            };
                            self.changed(&field, format!("{attr} → {new}{why}"));
                            c[key] = s(&new);
                        }
                        Err(why) => self.untranslated(&field, why),
                    }
                }
            }
        }
        if let Some(config) = devices.get_mut("config") {
            self.configs(config, &format!("{path}.config"));
        }
        drop_null(devices, "config");
    }

    /// One exact request or subrequest; `true` when it asks for MIG devices.
    fn exact(&mut self, req: &mut Mapping, path: &str) -> bool {
        let class = req
            .get("deviceClassName")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let has_capacity = req
            .get("capacity")
            .and_then(|c| c.get("requests"))
            .and_then(Value::as_mapping)
            .is_some_and(|m| !m.is_empty());
        let field = format!("{path}.deviceClassName");
        let mig = class == NVIDIA_MIG_CLASS;
        let new_class = match class.as_str() {
            NVIDIA_DRIVER if has_capacity => {
                self.changed(
                    &field,
                    format!(
                        "{class} → {SHARED_CLASS}: the request names capacity, a consumable share of a \
                         GPU; on {GPU_CLASS} it would get the whole GPU"
                    ),
                );
                Some(SHARED_CLASS)
            }
            NVIDIA_DRIVER => {
                self.changed(&field, format!("{class} → {GPU_CLASS}"));
                Some(GPU_CLASS)
            }
            NVIDIA_MIG_CLASS => {
                self.changed(&field, format!("{class} → {MIG_CLASS}"));
                if has_capacity {
                    self.untranslated(
                        &format!("{path}.capacity"),
                        "tessera's MIG devices are not consumable: a share of a MIG device is a \
                         shared.gpu.tessera.dev device with a profile attribute; left as written",
                    );
                }
                Some(MIG_CLASS)
            }
            c if c.ends_with("nvidia.com") && !self.own_classes.contains(c) => {
                self.untranslated(
                    &field,
                    format!("{c} is an NVIDIA class tessera has no counterpart of; left as written"),
                );
                None
            }
            _ => None,
        };
        if let Some(new) = new_class {
            req.insert(s("deviceClassName"), s(new));
        }
        if new_class == Some(SHARED_CLASS) {
            self.share_capacity(req, path);
        }
        if let Some(sels) = req.get_mut("selectors") {
            self.selectors(
                sels,
                &format!("{path}.selectors"),
                mig,
                new_class == Some(SHARED_CLASS),
            );
        }
        mig
    }

    fn share_capacity(&mut self, req: &mut Mapping, path: &str) {
        let field = format!("{path}.capacity.requests");
        let Some(reqs) = req
            .get_mut("capacity")
            .and_then(|c| c.get_mut("requests"))
            .and_then(Value::as_mapping_mut)
        else {
            return;
        };
        if reqs.remove("shares").is_some() {
            self.untranslated(
                &field,
                "shares removed: tessera's shares have no share count; their capacities are memory and \
                 compute (percent of the SMs)",
            );
        }
        for k in reqs
            .keys()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect::<Vec<_>>()
        {
            if !matches!(k.as_str(), "memory" | "compute") {
                self.untranslated(
                    &field,
                    format!("{k}: tessera's shares have no such capacity; kept"),
                );
            }
        }
        if reqs.contains_key("memory") && !reqs.contains_key("compute") {
            self.note(
                Outcome::NothingNeeded,
                &field,
                "memory alone consumes no compute: the share is not held to a part of the SMs (as with \
                 NVIDIA's consumable shares); add compute: \"<percent>\" to reserve and cap them \
                 (deployments/classes/README.md)",
            );
        }
        if reqs.is_empty() {
            req.remove("capacity");
        }
    }

    fn selectors(&mut self, sels: &mut Value, path: &str, mig: bool, shared: bool) {
        let Some(sels) = sels.as_sequence_mut() else {
            return;
        };
        let env = crate::cel::CelEnv::new();
        for (i, sel) in sels.iter_mut().enumerate() {
            let Some(expr) = sel
                .get("cel")
                .and_then(|c| c.get("expression"))
                .and_then(Value::as_str)
                .map(str::to_string)
            else {
                continue;
            };
            let field = format!("{path}[{i}].cel.expression");
            let r = cel::rewrite(
                &expr,
                cel::Context {
                    mig,
                    shared,
                    target: self.opts.target,
                },
            );
            if !r.changes.is_empty() {
                self.changed(&field, r.changes.join("; "));
                sel["cel"]["expression"] = s(&r.expression);
            }
            for p in r.problems {
                self.untranslated(&field, p);
            }
            if let Err(e) = env.compile(&r.expression) {
                self.untranslated(&field, format!("does not compile for tessera: {e}"));
            }
        }
    }

    fn configs(&mut self, config: &mut Value, path: &str) {
        let Some(entries) = config.as_sequence_mut() else {
            return;
        };
        let mut keep = Vec::with_capacity(entries.len());
        for (i, entry) in entries.iter_mut().enumerate() {
            let field = format!("{path}[{i}].opaque");
            let Some(opaque) = entry.get_mut("opaque").and_then(Value::as_mapping_mut) else {
                keep.push(true);
                continue;
            };
            if opaque.get("driver").and_then(Value::as_str) != Some(NVIDIA_DRIVER) {
                keep.push(true);
                continue;
            }
            let t = config::translate(opaque.get("parameters").unwrap_or(&Value::Null));
            for p in &t.problems {
                self.untranslated(&field, p.clone());
            }
            match t.parameters {
                Some(params) => {
                    opaque.insert(s("driver"), s(TESSERA_DRIVER));
                    opaque.insert(s("parameters"), params);
                    let mut msg = format!("driver {NVIDIA_DRIVER} → {TESSERA_DRIVER}");
                    for c in &t.changes {
                        msg.push_str("; ");
                        msg.push_str(c);
                    }
                    self.changed(&field, msg);
                    keep.push(true);
                }
                None => {
                    self.changed(&field, format!("entry removed: {}", t.changes.join("; ")));
                    keep.push(false);
                }
            }
        }
        let mut k = keep.into_iter();
        entries.retain(|_| k.next().unwrap_or(true));
        if entries.is_empty() {
            *config = Value::Null;
        }
    }
}

/// Removes `key` from `m` when its value is null (a list whose entries were all removed).
fn drop_null(m: &mut Mapping, key: &str) {
    if m.get(key).is_some_and(Value::is_null) {
        m.shift_remove(key);
    }
}

/// The value at `path` of nested mappings.
fn at<'v>(v: &'v mut Value, path: &[&str]) -> Option<&'v mut Value> {
    path.iter().try_fold(v, |v, k| v.get_mut(*k))
}

/// v1beta1's flat request fields moved under `exactly`, as `resource.k8s.io/v1` has them.
fn flatten_to_exactly(req: &mut Mapping) {
    const EXACT: &[&str] = &[
        "deviceClassName",
        "selectors",
        "allocationMode",
        "count",
        "adminAccess",
        "tolerations",
        "capacity",
    ];
    let mut exact = Mapping::new();
    for k in EXACT {
        if let Some(v) = req.shift_remove(*k) {
            exact.insert(s(k), v);
        }
    }
    if !exact.is_empty() {
        req.insert(s("exactly"), Value::Mapping(exact));
    }
}

/// Renames a key of `m` in place, keeping its position.
fn rename_key(m: &mut Mapping, old: &str, new: &str) {
    let entries: Vec<(Value, Value)> = std::mem::take(m).into_iter().collect();
    for (k, v) in entries {
        if k.as_str() == Some(old) {
            m.insert(s(new), v);
        } else {
            m.insert(k, v);
        }
    }
}

#[cfg(test)]
mod tests;
