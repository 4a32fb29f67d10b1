//! Turning a `GpuPolicy` into one [`Model`] per GPU.
//!
//! A policy is checked as a whole before it is used: every selector is compiled, then evaluated on every
//! GPU of every inventory (the `cel` crate has no type checker, so this is where type errors surface), and
//! every rule must match at least one GPU unless it is `optional`. Any failure yields a [`PolicyProblem`],
//! which becomes the policy's `Valid=False` condition; the controller then keeps the last valid policy.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use tessera_api::{
    DRIVER_NAME, NodeInventorySpec,
    policy::{self as api, GpuPolicySpec, ModelRef},
};

use crate::{
    cel::{CelEnv, DeviceView, Quantity, Selector, SelectorError},
    devices::{Model, resolve_layout, selector_view},
};

/// Default `memoryStep` of shared GPUs.
pub const DEFAULT_MEMORY_STEP: u64 = 1 << 30;
/// Default `fallbackSlots` of shared GPUs.
pub const DEFAULT_FALLBACK_SLOTS: u32 = 4;
/// Most slots per GPU: 8 GPUs × 32 slots stay within a handful of slices.
pub const MAX_FALLBACK_SLOTS: u32 = 32;

/// Why a policy cannot be used; `reason` is one of the `tessera_api::policy::REASON_*` constants.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct PolicyProblem {
    pub reason: &'static str,
    pub message: String,
}

#[derive(Debug, Clone)]
enum RuleModel {
    Whole,
    DynamicMig {
        profiles: Vec<String>,
        fallback_layout: Vec<String>,
        quota_counters: Vec<api::QuotaCounter>,
    },
    StaticMig {
        layout: Vec<String>,
    },
    Shared {
        strategy: api::SharingStrategy,
        memory_step: u64,
        fallback_slots: u32,
        tenancy: api::MpsTenancy,
    },
}

#[derive(Debug)]
struct CompiledRule {
    name: String,
    selector: Option<Selector>,
    optional: bool,
    /// `warm.window` in seconds; 0 keeps nothing.
    warm_seconds: u64,
    model: RuleModel,
}

/// A policy whose selectors compiled.
#[derive(Debug, Default)]
pub struct CompiledPolicy {
    rules: Vec<CompiledRule>,
}

/// The model of every GPU, keyed by (node name, GPU index).
pub type Assignments = HashMap<(String, u32), Model>;

fn invalid_model(rule: &str, message: impl std::fmt::Display) -> PolicyProblem {
    PolicyProblem {
        reason: api::REASON_INVALID_MODEL,
        message: format!("rule {rule:?}: {message}"),
    }
}

impl CompiledPolicy {
    /// No rules: every GPU gets [`Model::Default`].
    pub fn builtin() -> Self {
        Self::default()
    }

    /// Compiles the selectors and checks each rule's model parameters.
    pub fn compile(spec: &GpuPolicySpec, cel: &CelEnv) -> Result<Self, PolicyProblem> {
        crate::health::HealthConfig::of_spec(spec).map_err(|message| PolicyProblem {
            reason: api::REASON_INVALID_HEALTH,
            message,
        })?;
        let mut rules = vec![];
        for rule in &spec.rules {
            let name = rule.name.clone();
            let model = match rule.model() {
                Ok(ModelRef::Whole) => RuleModel::Whole,
                Ok(ModelRef::DynamicMig(m)) => RuleModel::DynamicMig {
                    profiles: m.profiles.clone(),
                    fallback_layout: m.fallback_layout.clone(),
                    quota_counters: {
                        let mut q = m.quota_counters.clone();
                        q.sort();
                        q.dedup();
                        q
                    },
                },
                Ok(ModelRef::StaticMig(m)) if m.layout.is_empty() => {
                    return Err(invalid_model(&name, "staticMig.layout is empty"));
                }
                Ok(ModelRef::StaticMig(m)) => RuleModel::StaticMig {
                    layout: m.layout.clone(),
                },
                Ok(ModelRef::Shared(m)) => {
                    let memory_step = match &m.memory_step {
                        None => DEFAULT_MEMORY_STEP,
                        Some(q) => Quantity::parse(&q.0)
                            .ok()
                            .and_then(|q| q.as_integer())
                            .filter(|v| *v >= 1 << 20)
                            .ok_or_else(|| {
                                invalid_model(
                                    &name,
                                    format!(
                                        "shared.memoryStep {:?} is not a whole number of bytes >= 1Mi",
                                        q.0
                                    ),
                                )
                            })? as u64,
                    };
                    let fallback_slots = m.fallback_slots.unwrap_or(DEFAULT_FALLBACK_SLOTS);
                    if !(1..=MAX_FALLBACK_SLOTS).contains(&fallback_slots) {
                        return Err(invalid_model(
                            &name,
                            format!(
                                "shared.fallbackSlots must be 1..={MAX_FALLBACK_SLOTS}, is {fallback_slots}"
                            ),
                        ));
                    }
                    // A time-sliced GPU runs no MPS daemon, so a tenancy there would promise what nothing does.
                    if m.tenancy.is_some() && m.strategy != api::SharingStrategy::Mps {
                        return Err(invalid_model(
                            &name,
                            format!(
                                "shared.tenancy applies to strategy MPS only (the daemon it chooses); this rule's \
                                 strategy is {}: remove shared.tenancy",
                                m.strategy.as_str()
                            ),
                        ));
                    }
                    RuleModel::Shared {
                        strategy: m.strategy,
                        memory_step,
                        fallback_slots,
                        tenancy: m.tenancy.unwrap_or_default(),
                    }
                }
                Err(n) => {
                    return Err(invalid_model(
                        &name,
                        format!("names {n} models; set exactly one of whole, dynamicMig, staticMig, shared"),
                    ));
                }
            };
            let warm_seconds = match &rule.warm {
                None => 0,
                Some(_) if matches!(model, RuleModel::Whole) => {
                    return Err(invalid_model(
                        &name,
                        "warm keeps the MIG devices and MPS daemons the plugin makes; a whole GPU makes \
                         neither: set it on a dynamicMig, staticMig or shared rule",
                    ));
                }
                Some(w) => w
                    .seconds()
                    .map_err(|e| invalid_model(&name, format!("warm.window {e}")))?,
            };
            let selector = match rule.selector.as_deref().map(str::trim) {
                None | Some("") => None,
                Some(src) => Some(cel.compile(src).map_err(|e| problem_from_selector(&name, e))?),
            };
            rules.push(CompiledRule {
                name,
                selector,
                optional: rule.optional,
                warm_seconds,
                model,
            });
        }
        Ok(Self { rules })
    }

    /// Picks every GPU's model: the first matching rule's, [`Model::Default`] when none matches.
    /// With `require_matches`, a non-optional rule that matches no GPU is a [`PolicyProblem`].
    pub fn assign<'a>(
        &self,
        cel: &CelEnv,
        inventories: impl IntoIterator<Item = &'a NodeInventorySpec>,
        require_matches: bool,
    ) -> Result<Assignments, PolicyProblem> {
        let mut out = Assignments::new();
        let mut matched = vec![0usize; self.rules.len()];
        let mut gpus = 0usize;
        for node in inventories {
            for gpu in &node.gpus {
                gpus += 1;
                // Built on the first selector: the default policy (no rules) and rules without selectors
                // need no view, and building one per GPU per tick was a third of a steady tick.
                let mut view = None;
                let mut model = None;
                for (i, rule) in self.rules.iter().enumerate() {
                    let hit = match &rule.selector {
                        None => true,
                        Some(sel) => {
                            let view = view.get_or_insert_with(|| {
                                DeviceView::from_device(DRIVER_NAME, &selector_view(node, gpu))
                            });
                            cel.matches(sel, view)
                        }
                        .map_err(|e| {
                            let mut p = problem_from_selector(&rule.name, e);
                            p.message =
                                format!("{} (GPU {} of node {})", p.message, gpu.index, node.node_name);
                            p
                        })?,
                    };
                    if !hit {
                        continue;
                    }
                    matched[i] += 1;
                    if model.is_none() {
                        let at = |e: String| {
                            invalid_model(
                                &rule.name,
                                format!("GPU {} of node {}: {e}", gpu.index, node.node_name),
                            )
                        };
                        model = Some(match &rule.model {
                            RuleModel::Whole => Model::Whole,
                            RuleModel::DynamicMig {
                                profiles,
                                fallback_layout,
                                quota_counters,
                            } => Model::DynamicMig {
                                profiles: profiles.clone(),
                                quota_counters: quota_counters.clone(),
                                fallback_layout: if gpu.mig.is_some() && !fallback_layout.is_empty() {
                                    resolve_layout(gpu, fallback_layout).map_err(at)?
                                } else {
                                    vec![]
                                },
                                warm_seconds: rule.warm_seconds,
                            },
                            RuleModel::StaticMig { layout } => Model::StaticMig {
                                layout: resolve_layout(gpu, layout).map_err(at)?,
                                warm_seconds: rule.warm_seconds,
                            },
                            RuleModel::Shared {
                                strategy,
                                memory_step,
                                fallback_slots,
                                tenancy,
                            } => Model::Shared {
                                strategy: *strategy,
                                memory_step: *memory_step,
                                fallback_slots: *fallback_slots,
                                warm_seconds: rule.warm_seconds,
                                tenancy: *tenancy,
                            },
                        });
                    }
                }
                out.insert(
                    (node.node_name.clone(), gpu.index),
                    model.unwrap_or(Model::Default),
                );
            }
        }
        let unmatched: Vec<&str> = self
            .rules
            .iter()
            .zip(&matched)
            .filter(|(r, n)| **n == 0 && !r.optional)
            .map(|(r, _)| r.name.as_str())
            .collect();
        if require_matches && gpus > 0 && !unmatched.is_empty() {
            return Err(PolicyProblem {
                reason: api::REASON_SELECTS_NOTHING,
                message: format!(
                    "rules {unmatched:?} match none of the cluster's {gpus} GPUs; fix the selector or set optional: true"
                ),
            });
        }
        Ok(out)
    }
}

fn problem_from_selector(rule: &str, e: SelectorError) -> PolicyProblem {
    let reason = match e {
        SelectorError::Syntax { .. } => api::REASON_CEL_SYNTAX_ERROR,
        SelectorError::Type { .. } => api::REASON_CEL_TYPE_ERROR,
        SelectorError::Runtime { .. } => api::REASON_CEL_RUNTIME_ERROR,
    };
    PolicyProblem {
        reason,
        message: format!("rule {rule:?}: {e}"),
    }
}

/// Compiles `spec` and assigns models in one step.
pub fn evaluate<'a>(
    spec: &GpuPolicySpec,
    cel: &CelEnv,
    inventories: impl IntoIterator<Item = &'a NodeInventorySpec>,
) -> Result<(CompiledPolicy, Assignments), PolicyProblem> {
    let policy = CompiledPolicy::compile(spec, cel)?;
    let assignments = policy.assign(cel, inventories, true)?;
    Ok((policy, assignments))
}

/// The `Valid` condition for an evaluation outcome. `previous` keeps `lastTransitionTime` when the status
/// does not change, so an unchanged outcome gives an identical condition (and no status write).
pub fn valid_condition(
    outcome: Result<(), &PolicyProblem>,
    generation: Option<i64>,
    previous: Option<&Condition>,
    now: DateTime<Utc>,
) -> Condition {
    let (status, reason, message) = match outcome {
        Ok(()) => (
            "True",
            api::REASON_VALID,
            "every rule compiled, evaluated to a bool and matched a GPU".to_string(),
        ),
        Err(p) => (
            "False",
            p.reason,
            format!("{}; the last valid policy stays in effect", p.message),
        ),
    };
    let last_transition_time = match previous {
        Some(prev) if prev.status == status => prev.last_transition_time.clone(),
        _ => Time(crate::time::to_k8s_time(now)),
    };
    Condition {
        type_: api::CONDITION_VALID.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: generation,
        last_transition_time,
    }
}
