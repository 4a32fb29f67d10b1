//! A claim's requests as the allocator reads them: each request is one alternative (`exactly`) or an
//! ordered list of them (`firstAvailable`).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{
    CapacityRequirements, DeviceSelector, DeviceToleration, ResourceClaimSpec,
};

use super::error::ExplainError;
use crate::cel::Quantity;

/// The devices one claim may hold at most (`AllocationResultsMaxSize`).
pub const MAX_DEVICES_PER_CLAIM: usize = 32;

/// One way to satisfy a request.
#[derive(Clone, Debug)]
pub struct Alternative {
    /// `request` or `request/subrequest`.
    pub name: String,
    /// The request's name, and the subrequest's for a `firstAvailable` entry (constraints name either).
    pub request: String,
    pub sub: Option<String>,
    pub class: String,
    pub selectors: Vec<String>,
    /// `allocationMode: All`.
    pub all: bool,
    pub count: usize,
    pub capacity: BTreeMap<String, Quantity>,
    pub tolerations: Vec<DeviceToleration>,
    pub admin_access: bool,
}

/// One request of a claim.
#[derive(Clone, Debug)]
pub struct Request {
    pub name: String,
    pub alternatives: Vec<Alternative>,
    pub first_available: bool,
}

/// A claim's `matchAttribute` or `distinctAttribute` constraint.
#[derive(Clone, Debug)]
pub struct Constraint {
    /// The requests (or `request/subrequest`s) it applies to; empty for all of them.
    pub requests: Vec<String>,
    /// Fully qualified attribute name.
    pub attribute: String,
    pub distinct: bool,
}

impl Constraint {
    pub fn applies_to(&self, alt: &Alternative) -> bool {
        self.requests.is_empty()
            || self.requests.contains(&alt.request)
            || (alt.sub.is_some() && self.requests.contains(&alt.name))
    }
}

impl std::fmt::Display for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.distinct {
            "distinctAttribute"
        } else {
            "matchAttribute"
        };
        write!(f, "{kind} {}", self.attribute)
    }
}

/// The requests of one claim (or template) to evaluate.
#[derive(Clone, Debug)]
pub struct ClaimInput {
    /// `claim ns/name` or `template ns/name`.
    pub label: String,
    pub requests: Vec<Request>,
    pub constraints: Vec<Constraint>,
}

struct Fields<'a> {
    class: &'a str,
    selectors: Option<&'a Vec<DeviceSelector>>,
    mode: Option<&'a str>,
    count: Option<i64>,
    capacity: Option<&'a CapacityRequirements>,
    tolerations: Option<&'a Vec<DeviceToleration>>,
    admin_access: Option<bool>,
}

fn alternative(
    label: &str,
    request: &str,
    sub: Option<&str>,
    f: Fields<'_>,
) -> Result<Alternative, ExplainError> {
    let name = match sub {
        Some(sub) => format!("{request}/{sub}"),
        None => request.to_string(),
    };
    let bad = |field: &str, message: String| ExplainError::BadRequest {
        claim: label.to_string(),
        field: format!("{name}.{field}"),
        message,
    };
    if f.class.is_empty() {
        return Err(bad("deviceClassName", "is empty; name a DeviceClass".into()));
    }
    let mut selectors = Vec::new();
    for (i, s) in f.selectors.into_iter().flatten().enumerate() {
        let Some(cel) = &s.cel else {
            return Err(bad(&format!("selectors[{i}]"), "has no cel expression".into()));
        };
        selectors.push(cel.expression.clone());
    }
    let all = match f.mode.unwrap_or("ExactCount") {
        "ExactCount" => false,
        "All" => true,
        other => {
            return Err(bad(
                "allocationMode",
                format!("{other:?} is neither ExactCount nor All"),
            ));
        }
    };
    let count = f.count.unwrap_or(1);
    if !all && count < 1 {
        return Err(bad(
            "count",
            format!("{count} is not a positive number of devices"),
        ));
    }
    let mut capacity = BTreeMap::new();
    for (cap, q) in f.capacity.and_then(|c| c.requests.as_ref()).into_iter().flatten() {
        let parsed =
            Quantity::parse(&q.0).map_err(|e| bad(&format!("capacity.requests.{cap}"), e.to_string()))?;
        capacity.insert(cap.clone(), parsed);
    }
    Ok(Alternative {
        name,
        request: request.to_string(),
        sub: sub.map(str::to_string),
        class: f.class.to_string(),
        selectors,
        all,
        count: if all { 0 } else { count as usize },
        capacity,
        tolerations: f.tolerations.cloned().unwrap_or_default(),
        admin_access: f.admin_access.unwrap_or(false),
    })
}

impl ClaimInput {
    /// Reads a claim spec; a request the allocator would refuse is an error naming its field.
    pub fn from_spec(label: String, spec: Option<&ResourceClaimSpec>) -> Result<Self, ExplainError> {
        let mut requests = Vec::new();
        let reqs = spec
            .and_then(|s| s.devices.as_ref())
            .and_then(|d| d.requests.as_ref());
        for r in reqs.into_iter().flatten() {
            let alternatives = match (&r.exactly, &r.first_available) {
                (Some(e), None) => vec![alternative(
                    &label,
                    &r.name,
                    None,
                    Fields {
                        class: &e.device_class_name,
                        selectors: e.selectors.as_ref(),
                        mode: e.allocation_mode.as_deref(),
                        count: e.count,
                        capacity: e.capacity.as_ref(),
                        tolerations: e.tolerations.as_ref(),
                        admin_access: e.admin_access,
                    },
                )?],
                (None, Some(subs)) if !subs.is_empty() => subs
                    .iter()
                    .map(|s| {
                        alternative(
                            &label,
                            &r.name,
                            Some(&s.name),
                            Fields {
                                class: &s.device_class_name,
                                selectors: s.selectors.as_ref(),
                                mode: s.allocation_mode.as_deref(),
                                count: s.count,
                                capacity: s.capacity.as_ref(),
                                tolerations: s.tolerations.as_ref(),
                                admin_access: None,
                            },
                        )
                    })
                    .collect::<Result<_, _>>()?,
                _ => {
                    return Err(ExplainError::BadRequest {
                        claim: label.clone(),
                        field: r.name.clone(),
                        message: "needs exactly one of `exactly` or a non-empty `firstAvailable`".into(),
                    });
                }
            };
            requests.push(Request {
                name: r.name.clone(),
                first_available: r.first_available.is_some(),
                alternatives,
            });
        }
        let mut constraints = Vec::new();
        let given = spec
            .and_then(|s| s.devices.as_ref())
            .and_then(|d| d.constraints.as_ref());
        for (i, c) in given.into_iter().flatten().enumerate() {
            let (attribute, distinct) = match (&c.match_attribute, &c.distinct_attribute) {
                (Some(a), None) => (a.clone(), false),
                (None, Some(a)) => (a.clone(), true),
                _ => {
                    return Err(ExplainError::BadRequest {
                        claim: label.clone(),
                        field: format!("constraints[{i}]"),
                        message: "needs exactly one of matchAttribute or distinctAttribute".into(),
                    });
                }
            };
            constraints.push(Constraint {
                requests: c.requests.clone().unwrap_or_default(),
                attribute,
                distinct,
            });
        }
        Ok(Self {
            label,
            requests,
            constraints,
        })
    }
}
