//! The checks the structured allocator makes for one device and one request, each turned into a
//! [`Failure`] that names the condition and its numbers, and the allocator's exhaustive search over a
//! node's devices for all requests together.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use k8s_openapi::api::resource::v1::{DeviceCapacity, DeviceClass, DeviceTaint, DeviceToleration};

use super::{
    model::{Counters, NodeDevice, NodeModel, PoolId},
    request::{Alternative, Constraint, MAX_DEVICES_PER_CLAIM},
};
use crate::cel::{CelEnv, Quantity, Selector};

/// Why a device cannot serve a request, in the order explain reports them: what the device is (selectors,
/// capacity, taints) before what other claims hold.
#[derive(Clone, Debug, PartialEq)]
pub enum Failure {
    ClassSelector {
        class: String,
        expression: String,
    },
    Selector {
        expression: String,
        /// What the device has of the attributes and capacities the expression names, as `name = value`.
        seen: Vec<String>,
    },
    SelectorError {
        message: String,
    },
    PoolIncomplete,
    NoCapacity {
        name: String,
    },
    CapacityOver {
        name: String,
        requested: Quantity,
        offered: Quantity,
    },
    CapacityPolicy {
        name: String,
        requested: Quantity,
    },
    Tainted {
        taint: String,
    },
    InUse {
        claims: Vec<String>,
    },
    Counters {
        set: String,
        counter: String,
        claims: Vec<String>,
    },
    CapacityLeft {
        name: String,
        requested: Quantity,
        left: Quantity,
        claims: Vec<String>,
    },
    /// Only found by the search: the device breaks a claim constraint with the devices chosen before it.
    Constraint {
        constraint: String,
    },
}

impl Failure {
    /// How close the device came: higher is closer.
    pub fn stage(&self) -> u8 {
        match self {
            Failure::ClassSelector { .. } => 0,
            Failure::Selector { .. } | Failure::SelectorError { .. } => 1,
            Failure::PoolIncomplete => 2,
            Failure::NoCapacity { .. } | Failure::CapacityOver { .. } | Failure::CapacityPolicy { .. } => 3,
            Failure::Tainted { .. } => 4,
            Failure::InUse { .. } | Failure::Counters { .. } | Failure::CapacityLeft { .. } => 5,
            Failure::Constraint { .. } => 6,
        }
    }

    /// The other claims that hold what the device needs.
    pub fn holders(&self) -> &[String] {
        match self {
            Failure::InUse { claims }
            | Failure::Counters { claims, .. }
            | Failure::CapacityLeft { claims, .. } => claims,
            _ => &[],
        }
    }
}

fn names(claims: &[String]) -> String {
    if claims.is_empty() {
        "no recorded claim".into()
    } else {
        claims.join(", ")
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::ClassSelector { class, expression } => {
                write!(f, "not in class {class}: selector `{expression}` is false")
            }
            Failure::Selector { expression, seen } if seen.is_empty() => {
                write!(f, "selector `{expression}` is false")
            }
            Failure::Selector { expression, seen } => {
                write!(f, "selector `{expression}` is false ({})", seen.join(", "))
            }
            Failure::SelectorError { message } => write!(f, "selector fails: {message}"),
            Failure::PoolIncomplete => write!(f, "its pool is being updated (not all slices published)"),
            Failure::NoCapacity { name } => write!(f, "has no capacity {name}"),
            Failure::CapacityOver {
                name,
                requested,
                offered,
            } => write!(f, "{name} {requested} > {offered}"),
            Failure::CapacityPolicy { name, requested } => {
                write!(
                    f,
                    "{name} {requested} is not an amount the device's request policy allows"
                )
            }
            Failure::Tainted { taint } => write!(f, "tainted: {taint}, not tolerated"),
            Failure::InUse { claims } => write!(f, "allocated to {}", names(claims)),
            Failure::Counters { set, counter, claims } => {
                write!(
                    f,
                    "shared counter {counter} of {set} used up by {}",
                    names(claims)
                )
            }
            Failure::CapacityLeft {
                name,
                requested,
                left,
                claims,
            } => write!(f, "{name} {requested} > {left} left after {}", names(claims)),
            Failure::Constraint { constraint } => {
                write!(f, "{constraint} differs from the devices chosen with it")
            }
        }
    }
}

// === capacity arithmetic, as consumable_capacity.go does it ===

fn q(k: &k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> Quantity {
    // Published quantities are validated by the API server; an unreadable one counts as zero.
    Quantity::parse(&k.0).unwrap_or(Quantity::from_int(0))
}

/// `Quantity.Value()`: the amount rounded up to a whole unit.
fn whole_up(v: &Quantity) -> i128 {
    v.as_integer()
        .map(i128::from)
        .unwrap_or_else(|| v.as_approximate_float().ceil() as i128)
}

fn from_whole(v: i128) -> Quantity {
    Quantity::from_int(i64::try_from(v).unwrap_or(i64::MAX))
}

/// What a request consumes of one capacity: the request rounded up to the policy, or the default, or all.
fn consumed(requested: Option<&Quantity>, cap: &DeviceCapacity) -> Quantity {
    let Some(req) = requested else {
        return cap
            .request_policy
            .as_ref()
            .and_then(|p| p.default.as_ref())
            .map(q)
            .unwrap_or_else(|| q(&cap.value));
    };
    let Some(policy) = &cap.request_policy else {
        return *req;
    };
    if let Some(range) = &policy.valid_range {
        let min = q(&range.min);
        if req.compare(&min).is_lt() {
            return min;
        }
        let Some(step) = range.step.as_ref().map(q) else {
            return *req;
        };
        let (r, m, s) = (whole_up(req), whole_up(&min), whole_up(&step).max(1));
        let n = (r - m + s - 1).div_euclid(s);
        return from_whole(m + s * n);
    }
    if let Some(values) = &policy.valid_values {
        for v in values.iter().map(q) {
            if req.compare(&v).is_le() {
                return v;
            }
        }
    }
    *req
}

/// Whether the consumed amount breaks the policy, and the largest amount the policy allows.
fn violates(amount: &Quantity, cap: &DeviceCapacity) -> Option<Option<Quantity>> {
    let policy = cap.request_policy.as_ref()?;
    if policy.default.as_ref().map(q) == Some(*amount) {
        return None;
    }
    if let Some(range) = &policy.valid_range {
        if let Some(max) = range.max.as_ref().map(q)
            && amount.compare(&max).is_gt()
        {
            return Some(Some(max));
        }
        if let Some(step) = range.step.as_ref().map(q) {
            let s = whole_up(&step).max(1);
            if (whole_up(amount) - whole_up(&q(&range.min))) % s != 0 {
                return Some(None);
            }
        }
        return None;
    }
    let values: Vec<Quantity> = policy.valid_values.iter().flatten().map(q).collect();
    if !values.is_empty() && !values.contains(amount) {
        return Some(values.iter().max().copied());
    }
    None
}

/// The largest amount of a capacity a single request can get from the device.
pub fn offered(cap: &DeviceCapacity) -> Quantity {
    let value = q(&cap.value);
    let max = cap.request_policy.as_ref().and_then(|p| {
        p.valid_range
            .as_ref()
            .and_then(|r| r.max.as_ref().map(q))
            .or_else(|| p.valid_values.iter().flatten().map(q).max())
    });
    max.map_or(value, |m| if m.compare(&value).is_lt() { m } else { value })
}

/// `CmpRequestOverCapacity`: the request against the device's capacity, given what is already consumed
/// (allocated shares plus this search's own). Returns the consumption on success.
fn capacity_check(
    alt: &Alternative,
    dev: &NodeDevice<'_>,
    already: &[&BTreeMap<String, Quantity>],
    holders: &[String],
) -> Result<BTreeMap<String, Quantity>, Failure> {
    let caps = dev.device.capacity.clone().unwrap_or_default();
    if let Some(name) = alt.capacity.keys().find(|n| !caps.contains_key(*n)) {
        return Err(Failure::NoCapacity { name: name.clone() });
    }
    let mut out = BTreeMap::new();
    for (name, cap) in &caps {
        let amount = consumed(alt.capacity.get(name), cap);
        if let Some(max) = violates(&amount, cap) {
            return Err(match max {
                Some(offered) => Failure::CapacityOver {
                    name: name.clone(),
                    requested: amount,
                    offered,
                },
                None => Failure::CapacityPolicy {
                    name: name.clone(),
                    requested: amount,
                },
            });
        }
        let value = q(&cap.value);
        let mut used = Quantity::from_int(0);
        for a in already {
            if let Some(v) = a.get(name) {
                used = used.checked_add(v).unwrap_or(used);
            }
        }
        let total = amount.checked_add(&used).unwrap_or(amount);
        if total.compare(&value).is_gt() {
            return Err(if used.sign() == 0 {
                Failure::CapacityOver {
                    name: name.clone(),
                    requested: amount,
                    offered: value,
                }
            } else {
                Failure::CapacityLeft {
                    name: name.clone(),
                    requested: amount,
                    left: value.checked_sub(&used).unwrap_or(value),
                    claims: holders.to_vec(),
                }
            });
        }
        out.insert(name.clone(), amount);
    }
    Ok(out)
}

fn tolerates(t: &DeviceToleration, taint: &DeviceTaint) -> bool {
    if let Some(effect) = t.effect.as_deref().filter(|e| !e.is_empty())
        && effect != taint.effect
    {
        return false;
    }
    if let Some(key) = t.key.as_deref().filter(|k| !k.is_empty())
        && key != taint.key
    {
        return false;
    }
    match t.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" | "" => t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
        _ => false,
    }
}

fn untolerated_taint(alt: &Alternative, dev: &NodeDevice<'_>) -> Option<String> {
    // The slice's own taints, then those DeviceTaintRules add (the scheduler sees both alike).
    let own = dev.device.taints.iter().flatten().map(|t| (t, None));
    let ruled = dev.rule_taints.iter().map(|(rule, t)| (t, Some(rule.as_str())));
    own.chain(ruled).find_map(|(taint, rule)| {
        let blocks = matches!(taint.effect.as_str(), "NoSchedule" | "NoExecute");
        let from = rule.map(|r| format!(", DeviceTaintRule {r}")).unwrap_or_default();
        (blocks && !alt.tolerations.iter().any(|t| tolerates(t, taint))).then(|| match &taint.value {
            Some(v) if !v.is_empty() => format!("{}={v} ({}{from})", taint.key, taint.effect),
            _ => format!("{} ({}{from})", taint.key, taint.effect),
        })
    })
}

/// `device.attributes["domain"].name` and `device.capacity["domain"].name` as the expression names them,
/// each with the device's value, so a false selector shows what it compared against.
pub fn referenced_values(expression: &str, dev: &NodeDevice<'_>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for kind in ["attributes", "capacity"] {
        let opener = format!("device.{kind}[");
        let mut rest = expression;
        while let Some(at) = rest.find(&opener) {
            rest = &rest[at + opener.len()..];
            let Some(quote) = rest.chars().next().filter(|c| *c == '"' || *c == '\'') else {
                continue;
            };
            let Some(end) = rest[1..].find(quote) else { break };
            let domain = &rest[1..1 + end];
            let after = &rest[1 + end + 1..];
            let Some(after) = after.strip_prefix("].") else {
                continue;
            };
            let id: String = after
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if id.is_empty() {
                continue;
            }
            let qualified = format!("{domain}/{id}");
            let bare = (domain == dev.id.0).then_some(id.as_str());
            let value = if kind == "attributes" {
                let attrs = dev.device.attributes.as_ref();
                attrs
                    .and_then(|a| a.get(&qualified).or_else(|| bare.and_then(|b| a.get(b))))
                    .map(|a| {
                        if let Some(i) = a.int {
                            i.to_string()
                        } else if let Some(b) = a.bool {
                            b.to_string()
                        } else if let Some(s) = &a.string {
                            format!("{s:?}")
                        } else if let Some(v) = &a.version {
                            format!("version {v}")
                        } else {
                            "(no value)".into()
                        }
                    })
            } else {
                let caps = dev.device.capacity.as_ref();
                caps.and_then(|c| c.get(&qualified).or_else(|| bare.and_then(|b| c.get(b))))
                    .map(|c| c.value.0.clone())
            };
            let shown = format!(
                "device.{kind}[\"{domain}\"].{id} = {}",
                value.unwrap_or_else(|| "(absent)".into())
            );
            if !out.contains(&shown) {
                out.push(shown);
            }
        }
    }
    out
}

/// Compiled selectors, shared by every node and request.
pub struct Selectors<'c> {
    env: CelEnv,
    compiled: HashMap<String, Result<Selector, String>>,
    classes: &'c [DeviceClass],
}

impl<'c> Selectors<'c> {
    pub fn new(classes: &'c [DeviceClass]) -> Self {
        Self {
            env: CelEnv::new(),
            compiled: HashMap::new(),
            classes,
        }
    }

    pub fn class(&self, name: &str) -> Option<&'c DeviceClass> {
        self.classes
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
    }

    fn eval(&mut self, expression: &str, dev: &NodeDevice<'_>) -> Result<bool, String> {
        let compiled = self
            .compiled
            .entry(expression.to_string())
            .or_insert_with(|| self.env.compile(expression).map_err(|e| e.to_string()));
        match compiled {
            Ok(selector) => self.env.matches(selector, &dev.view).map_err(|e| e.to_string()),
            Err(e) => Err(e.clone()),
        }
    }

    /// What does not change while claims come and go: selectors, capacity against an idle device, taints.
    pub fn static_check(&mut self, alt: &Alternative, dev: &NodeDevice<'_>) -> Result<(), Failure> {
        let class = self.class(&alt.class);
        for sel in class
            .and_then(|c| c.spec.as_ref())
            .and_then(|s| s.selectors.as_ref())
            .into_iter()
            .flatten()
        {
            let Some(cel) = &sel.cel else { continue };
            match self.eval(&cel.expression, dev) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(Failure::ClassSelector {
                        class: alt.class.clone(),
                        expression: cel.expression.clone(),
                    });
                }
                Err(message) => return Err(Failure::SelectorError { message }),
            }
        }
        for expression in &alt.selectors {
            match self.eval(expression, dev) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(Failure::Selector {
                        expression: expression.clone(),
                        seen: referenced_values(expression, dev),
                    });
                }
                Err(message) => return Err(Failure::SelectorError { message }),
            }
        }
        if !dev.pool_complete {
            return Err(Failure::PoolIncomplete);
        }
        capacity_check(alt, dev, &[], &[])?;
        if let Some(taint) = untolerated_taint(alt, dev) {
            return Err(Failure::Tainted { taint });
        }
        Ok(())
    }
}

// === the search ===

/// One alternative's candidates on a node: devices passing the static checks, in the allocator's order.
#[derive(Clone, Debug)]
pub struct Candidates {
    /// The devices the search visits, in the allocator's order: those passing the static checks, and
    /// (`Some(message)`) those whose selector fails at runtime, which abort the allocation when visited.
    pub devices: Vec<(usize, Option<String>)>,
    /// For `All`: every device matching the selectors and static capacity, each of which must be free.
    pub all: Vec<usize>,
    /// For `All`: a device matches but cannot be used at all (taint), so the request cannot succeed.
    pub all_blocked: bool,
    /// For `All`: what makes the allocator refuse the claim before searching (a selector failing on some
    /// device, a pool being updated).
    pub all_error: Option<String>,
}

/// What the search over one node found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Fits,
    DoesNotFit,
    /// The search ran out of steps; the allocator may still find (or not find) an assignment.
    Undecided,
    /// The allocator stops with an error (the scheduler reports it and the pod stays pending).
    Error(String),
}

enum Stop {
    OutOfSteps,
    Error(String),
}

/// The search's budget: the allocator itself has no such limit but the scheduler's filter has a timeout.
const MAX_STEPS: u64 = 2_000_000;

/// An attribute value as constraints compare it: scalars by type and value; lists never compare equal.
#[derive(Clone, Debug)]
enum AttrValue {
    Bool(bool),
    Int(i64),
    String(String),
    Version(String),
    Other,
}

impl AttrValue {
    fn same(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Bool(a), Self::Bool(b)) => a == b,
            (Self::Int(a), Self::Int(b)) => a == b,
            (Self::String(a), Self::String(b)) | (Self::Version(a), Self::Version(b)) => a == b,
            _ => false,
        }
    }
}

/// `lookupAttribute`: the fully qualified name, else the bare name when the domain is the driver's.
fn attribute(dev: &NodeDevice<'_>, name: &str) -> Option<AttrValue> {
    let attrs = dev.device.attributes.as_ref()?;
    let a = attrs.get(name).or_else(|| {
        let (domain, id) = name.split_once('/')?;
        (domain == dev.id.0).then(|| attrs.get(id)).flatten()
    })?;
    Some(if let Some(b) = a.bool {
        AttrValue::Bool(b)
    } else if let Some(i) = a.int {
        AttrValue::Int(i)
    } else if let Some(s) = &a.string {
        AttrValue::String(s.clone())
    } else if let Some(v) = &a.version {
        AttrValue::Version(v.clone())
    } else {
        AttrValue::Other
    })
}

/// One constraint during the search, with the values of the devices added under it.
struct ConstraintState {
    constraint: Constraint,
    values: Vec<AttrValue>,
}

impl ConstraintState {
    /// `add` of the allocator's match/distinct constraints; monotonic, as the allocator assumes.
    fn admits(&self, v: &AttrValue) -> bool {
        if self.constraint.distinct {
            self.values.iter().all(|x| match (v, x) {
                (AttrValue::Other, _) => false,
                _ => !v.same(x),
            })
        } else {
            self.values.first().is_none_or(|first| v.same(first))
        }
    }
}

pub struct Search<'n, 'a> {
    node: &'n NodeModel<'a>,
    state: &'n super::model::AllocatedState,
    /// Per request (across claims): (claim index, alternatives with their candidates).
    requests: Vec<(usize, Vec<(&'n Alternative, Candidates)>)>,
    exclusive: BTreeSet<usize>,
    /// Capacity this search has consumed, per device index.
    capacity: BTreeMap<usize, Vec<BTreeMap<String, Quantity>>>,
    /// Counters this search has consumed, per pool.
    counters: BTreeMap<PoolId, Counters>,
    per_claim: Vec<usize>,
    /// Per claim: its constraints.
    constraints: Vec<Vec<ConstraintState>>,
    steps: u64,
}

impl<'n, 'a> Search<'n, 'a> {
    pub fn new(
        node: &'n NodeModel<'a>,
        state: &'n super::model::AllocatedState,
        constraints: Vec<Vec<Constraint>>,
        requests: Vec<(usize, Vec<(&'n Alternative, Candidates)>)>,
    ) -> Self {
        let claims = constraints.len();
        Self {
            constraints: constraints
                .into_iter()
                .map(|cs| {
                    cs.into_iter()
                        .map(|constraint| ConstraintState {
                            constraint,
                            values: Vec::new(),
                        })
                        .collect()
                })
                .collect(),
            node,
            state,
            requests,
            exclusive: BTreeSet::new(),
            capacity: BTreeMap::new(),
            counters: BTreeMap::new(),
            per_claim: vec![0; claims],
            steps: 0,
        }
    }

    pub fn run(mut self) -> Outcome {
        // The allocator sizes every `All` request (every alternative) before it searches.
        let before = self
            .requests
            .iter()
            .flat_map(|(_, alts)| alts.iter())
            .find_map(|(alt, c)| c.all_error.clone().filter(|_| alt.all));
        if let Some(message) = before {
            return Outcome::Error(message);
        }
        match self.solve(0) {
            Ok(true) => Outcome::Fits,
            Ok(false) => Outcome::DoesNotFit,
            Err(Stop::OutOfSteps) => Outcome::Undecided,
            Err(Stop::Error(message)) => Outcome::Error(message),
        }
    }

    fn solve(&mut self, ri: usize) -> Result<bool, Stop> {
        if ri == self.requests.len() {
            return Ok(true);
        }
        for ai in 0..self.requests[ri].1.len() {
            if self.solve_alt(ri, ai, 0, 0)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn solve_alt(&mut self, ri: usize, ai: usize, picked: usize, start: usize) -> Result<bool, Stop> {
        let claim = self.requests[ri].0;
        let (alt, cands) = &self.requests[ri].1[ai];
        let (alt, all) = (*alt, alt.all);
        let need = if all { cands.all.len() } else { alt.count };
        if all && (need == 0 || cands.all_blocked) {
            return Ok(false);
        }
        if picked == need {
            return self.solve(ri + 1);
        }
        if self.per_claim[claim] + (need - picked) > MAX_DEVICES_PER_CLAIM {
            return Ok(false);
        }
        // Fewer usable devices left than still needed: no assignment down this path. Taking a device only
        // uses things up (a device, counters, capacity), so one that cannot be taken now cannot be taken
        // deeper in this branch either; the exception is a shared device that consumes counters, whose
        // counters are charged only by its first share. The allocator has no such cut, so it is taken
        // only where the allocator could not meet a failing selector on the way.
        if !all && cands.devices.iter().all(|(_, e)| e.is_none()) {
            let rest = &cands.devices[start.min(cands.devices.len())..];
            let usable = rest
                .iter()
                .filter(|(d, _)| {
                    let dev = &self.node.devices[*d];
                    let recovers = dev.multi_allocatable() && dev.device.consumes_counters.is_some();
                    recovers || self.check(alt, *d).is_ok()
                })
                .count();
            if usable < need - picked {
                return Ok(false);
            }
        }
        let list: Vec<(usize, Option<String>)> = if all {
            vec![(cands.all[picked], None)]
        } else {
            cands.devices[start.min(cands.devices.len())..].to_vec()
        };
        for (offset, (d, error)) in list.into_iter().enumerate() {
            self.steps += 1;
            if self.steps > MAX_STEPS {
                return Err(Stop::OutOfSteps);
            }
            if let Some(message) = error {
                // The allocator skips a device in use before it evaluates selectors on it.
                let dev = &self.node.devices[d];
                let in_use = !dev.multi_allocatable()
                    && (self.state.exclusive.contains_key(&dev.id) || self.exclusive.contains(&d));
                if alt.admin_access || !in_use {
                    return Err(Stop::Error(format!(
                        "selector fails on {}: {message}",
                        dev.name()
                    )));
                }
                continue;
            }
            let taken = match self.take(alt, d, claim) {
                Ok(taken) => taken,
                // For `All` the allocator treats a constraint that rules out one of the devices as an
                // error in the claim, not as "try something else".
                Err(Failure::Constraint { constraint }) if all => {
                    let name = self.node.devices[d].name();
                    return Err(Stop::Error(format!(
                        "allocationMode All: {name} breaks the claim's {constraint}"
                    )));
                }
                Err(_) => continue,
            };
            self.per_claim[claim] += 1;
            let next = if all { 0 } else { start + offset + 1 };
            let done = self.solve_alt(ri, ai, picked + 1, next);
            self.per_claim[claim] -= 1;
            self.give_back(d, taken);
            if done? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The dynamic checks for one device: in use, counters, capacity left. Also what [`diagnose`] reports.
    pub fn check(&self, alt: &Alternative, d: usize) -> Result<Taken, Failure> {
        let dev = &self.node.devices[d];
        let multi = dev.multi_allocatable();
        if !multi
            && !alt.admin_access
            && (self.state.exclusive.contains_key(&dev.id) || self.exclusive.contains(&d))
        {
            return Err(Failure::InUse {
                claims: self.state.holders(&dev.id),
            });
        }
        let pool: PoolId = (dev.id.0.clone(), dev.id.1.clone());
        let in_capacity_use = self.state.shared.contains_key(&dev.id)
            || self.state.consumed.contains_key(&dev.id)
            || self.capacity.contains_key(&d);
        let mut counters_taken = None;
        if !(multi && in_capacity_use)
            && dev
                .device
                .consumes_counters
                .as_ref()
                .is_some_and(|c| !c.is_empty())
        {
            let mut mine = self.counters.get(&pool).cloned().unwrap_or_default();
            for c in dev.device.consumes_counters.iter().flatten() {
                let set = mine.entry(c.counter_set.clone()).or_default();
                for (name, v) in &c.counters {
                    let e = set.entry(name.clone()).or_insert(Quantity::from_int(0));
                    *e = e.checked_add(&q(&v.value)).unwrap_or(*e);
                }
            }
            // The allocator refuses the device when any counter of the pool is overdrawn. Of those, the
            // one to report is a counter the device itself consumes, a memory slice first: that is the
            // placement overlap a user can act on.
            let consumes = |set: &str, name: &str| {
                dev.device
                    .consumes_counters
                    .iter()
                    .flatten()
                    .any(|c| c.counter_set == set && c.counters.contains_key(name))
            };
            let mut overdrawn: Vec<(u8, &String, &String)> = Vec::new();
            for (set, counters) in self.node.available.get(&pool).into_iter().flatten() {
                for (name, left) in counters {
                    let used = mine
                        .get(set)
                        .and_then(|s| s.get(name))
                        .copied()
                        .unwrap_or(Quantity::from_int(0));
                    if left.compare(&used).is_lt() {
                        let rank = match (consumes(set, name), name.starts_with("memory-slice")) {
                            (true, true) => 0,
                            (true, false) => 1,
                            _ => 2,
                        };
                        overdrawn.push((rank, set, name));
                    }
                }
            }
            if let Some((_, set, name)) = overdrawn.into_iter().min() {
                let claims = self
                    .node
                    .charged_by
                    .get(&(pool.clone(), set.clone(), name.clone()))
                    .cloned()
                    .unwrap_or_default();
                return Err(Failure::Counters {
                    set: set.clone(),
                    counter: name.clone(),
                    claims,
                });
            }
            counters_taken = Some(mine);
        }
        let mut already: Vec<&BTreeMap<String, Quantity>> = Vec::new();
        if let Some(c) = self.state.consumed.get(&dev.id) {
            already.push(c);
        }
        for c in self.capacity.get(&d).into_iter().flatten() {
            already.push(c);
        }
        let holders = self.state.holders(&dev.id);
        let consumption = capacity_check(alt, dev, &already, &holders)?;
        Ok(Taken {
            pool,
            counters: counters_taken,
            capacity: multi.then_some(consumption),
            exclusive: !multi,
        })
    }

    fn take(&mut self, alt: &Alternative, d: usize, claim: usize) -> Result<Undo, Failure> {
        let taken = self.check(alt, d)?;
        // The claim's constraints, after what the device itself needs (as allocateDevice orders them).
        let dev = &self.node.devices[d];
        let mut added = Vec::new();
        for (i, c) in self.constraints[claim].iter().enumerate() {
            if !c.constraint.applies_to(alt) {
                continue;
            }
            match attribute(dev, &c.constraint.attribute) {
                Some(v) if c.admits(&v) => added.push((i, v)),
                _ => {
                    return Err(Failure::Constraint {
                        constraint: c.constraint.to_string(),
                    });
                }
            }
        }
        let constraints: Vec<usize> = added.iter().map(|(i, _)| *i).collect();
        for (i, v) in added {
            self.constraints[claim][i].values.push(v);
        }
        let undo = Undo {
            previous_counters: taken
                .counters
                .as_ref()
                .map(|_| self.counters.get(&taken.pool).cloned()),
            pool: taken.pool.clone(),
            capacity: taken.capacity.is_some(),
            exclusive: taken.exclusive,
            claim,
            constraints,
        };
        if let Some(c) = taken.counters {
            self.counters.insert(taken.pool, c);
        }
        if let Some(c) = taken.capacity {
            self.capacity.entry(d).or_default().push(c);
        }
        if taken.exclusive {
            self.exclusive.insert(d);
        }
        Ok(undo)
    }

    fn give_back(&mut self, d: usize, undo: Undo) {
        for i in &undo.constraints {
            self.constraints[undo.claim][*i].values.pop();
        }
        if undo.exclusive {
            self.exclusive.remove(&d);
        }
        if undo.capacity
            && let Some(list) = self.capacity.get_mut(&d)
        {
            list.pop();
            if list.is_empty() {
                self.capacity.remove(&d);
            }
        }
        match undo.previous_counters {
            Some(Some(previous)) => {
                self.counters.insert(undo.pool, previous);
            }
            Some(None) => {
                self.counters.remove(&undo.pool);
            }
            None => {}
        }
    }
}

/// What one device would take.
pub struct Taken {
    pool: PoolId,
    /// The pool's counters consumed by the search with this device added.
    counters: Option<Counters>,
    capacity: Option<BTreeMap<String, Quantity>>,
    exclusive: bool,
}

struct Undo {
    pool: PoolId,
    previous_counters: Option<Option<Counters>>,
    capacity: bool,
    exclusive: bool,
    claim: usize,
    constraints: Vec<usize>,
}
