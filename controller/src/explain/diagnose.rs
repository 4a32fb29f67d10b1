//! [`explain`]: judges every node for a target's pending claims as kube-scheduler's allocator would.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::DeviceClass;

use super::{
    cluster::Cluster,
    error::ExplainError,
    eval::{Candidates, Failure, Outcome, Search, Selectors},
    fragmentation::{self, GpuLayout},
    model::{self, AllocatedState, NodeModel},
    pod,
    report::{AlternativeNode, ClaimReport, DeviceNote, NodeVerdict, Report, RequestNode, RequestReport},
    request::{self, Alternative},
    target::{Target, find, resolve},
};
use crate::cel::Quantity;

fn asks(alt: &Alternative) -> String {
    let mut s = alt.class.clone();
    if alt.all {
        s.push_str(", all matching devices");
    } else {
        let _ = std::fmt::Write::write_fmt(
            &mut s,
            format_args!(", {} device{}", alt.count, if alt.count == 1 { "" } else { "s" }),
        );
    }
    for (name, q) in &alt.capacity {
        let _ = std::fmt::Write::write_fmt(&mut s, format_args!(", {name} {q}"));
    }
    s
}

/// Per device on one node: `None` when free for the request, else its first failed condition.
type Diagnosis = Vec<(usize, Option<Failure>)>;

fn closest_order(model: &NodeModel<'_>, diag: &Diagnosis) -> Vec<usize> {
    let mut order: Vec<usize> = (0..diag.len()).collect();
    let rank = |i: &usize| -> (u8, Quantity) {
        match &diag[*i].1 {
            None => (u8::MAX, Quantity::from_int(0)),
            Some(f @ Failure::CapacityOver { offered, .. }) => (f.stage(), *offered),
            Some(f @ Failure::CapacityLeft { left, .. }) => (f.stage(), *left),
            Some(f) => (f.stage(), Quantity::from_int(0)),
        }
    };
    order.sort_by(|a, b| {
        rank(b).cmp(&rank(a)).then(
            model.devices[diag[*a].0]
                .name()
                .cmp(model.devices[diag[*b].0].name()),
        )
    });
    order
}

fn profile_of(model: &NodeModel<'_>, d: usize) -> Option<String> {
    let dev = &model.devices[d];
    let attrs = dev.device.attributes.as_ref()?;
    let a = attrs
        .get("profile")
        .or_else(|| attrs.get(&format!("{}/profile", dev.id.0)))?;
    a.string.clone()
}

/// The reason shared by the blocked devices of a diagnosis, from the closest of them.
fn grouped_reason(model: &NodeModel<'_>, alt: &Alternative, diag: &Diagnosis) -> String {
    let blocked: Vec<(usize, &Failure)> = diag
        .iter()
        .filter_map(|(d, f)| f.as_ref().map(|f| (*d, f)))
        .collect();
    let order = closest_order(model, diag);
    let Some((d, f)) = order
        .iter()
        .find_map(|i| diag[*i].1.as_ref().map(|f| (diag[*i].0, f)))
    else {
        return format!(
            "no device on this node (0 of {} published here)",
            model.devices.len()
        );
    };
    let name = model.devices[d].name();
    match f {
        _ if f.stage() == 0 => format!("no device of class {} on this node", alt.class),
        Failure::CapacityOver {
            name: cap,
            requested,
            offered,
        } => format!("no device offers {cap} {requested}; the largest is {offered} ({name})"),
        Failure::Tainted { taint } => {
            let n = blocked.iter().filter(|(_, f)| f.stage() == 4).count();
            format!("all {n} matching devices are tainted: {taint}, not tolerated")
        }
        _ if f.stage() == 5 => {
            let held: Vec<usize> = blocked
                .iter()
                .filter(|(_, f)| f.stage() == 5)
                .map(|(d, _)| *d)
                .collect();
            let holders: BTreeSet<String> = blocked
                .iter()
                .filter(|(_, f)| f.stage() == 5)
                .flat_map(|(_, f)| f.holders().iter().cloned())
                .collect();
            let who = if holders.is_empty() {
                "other claims".to_string()
            } else {
                format!("claims {}", holders.into_iter().collect::<Vec<_>>().join(", "))
            };
            let profiles: BTreeSet<Option<String>> = held.iter().map(|d| profile_of(model, *d)).collect();
            match profiles.iter().next() {
                Some(Some(p)) if profiles.len() == 1 => {
                    format!("profile {p}: all {} placements in use by {who}", held.len())
                }
                _ if matches!(f, Failure::CapacityLeft { .. }) => format!("{f} (closest: {name})"),
                _ => format!("all {} matching devices are in use by {who}", held.len()),
            }
        }
        f => format!("{f} (closest: {name})"),
    }
}

/// When every placement of the MIG profile the request needs is blocked by slices other claims hold, yet
/// the GPUs offering it have enough free memory slices between them: which profile, where the free slices
/// are, and which claims to move to free one placement. `None` when that is not why the request waits.
fn fragmented_reason(model: &NodeModel<'_>, diag: &Diagnosis) -> Option<String> {
    let layouts = fragmentation::layouts_of_model(model);
    // The request's devices with their profile and memory slices; the smallest profile is what it needs.
    let matching: Vec<(&Failure, &str, &GpuLayout, u32)> = diag
        .iter()
        .filter_map(|(d, f)| {
            let f = f.as_ref().filter(|f| f.stage() >= 2)?;
            let name = model.devices[*d].name();
            let layout = layouts
                .iter()
                .find(|l| l.placements.iter().any(|p| p.device == name))?;
            let p = layout.placements.iter().find(|p| p.device == name)?;
            Some((f, p.profile.as_str(), layout, p.size))
        })
        .collect();
    let (_, profile, _, size) = matching.iter().min_by_key(|(_, p, _, s)| (*s, *p))?;
    let of_profile: Vec<&(&Failure, &str, &GpuLayout, u32)> =
        matching.iter().filter(|(_, p, _, _)| p == profile).collect();
    // A placement kept off by a taint or a pool being updated is not fragmentation.
    if of_profile.iter().any(|(f, _, _, _)| f.stage() != 5) {
        return None;
    }
    let mut gpus: Vec<&GpuLayout> = of_profile.iter().map(|(_, _, l, _)| *l).collect();
    gpus.sort_by(|a, b| (a.gpu.len(), &a.gpu).cmp(&(b.gpu.len(), &b.gpu)));
    gpus.dedup_by(|a, b| a.gpu == b.gpu);
    let free: usize = gpus.iter().map(|g| g.free().len()).sum();
    if free < *size as usize || gpus.iter().any(|g| g.placements_of(profile).any(|p| g.fits(p))) {
        return None;
    }
    let starts: BTreeSet<u32> = gpus[0].placements_of(profile).map(|p| p.start).collect();
    let starts: Vec<String> = starts.iter().map(ToString::to_string).collect();
    let per_gpu: Vec<String> = gpus
        .iter()
        .filter_map(|g| {
            let unusable = g.unusable_for(profile);
            (!unusable.is_empty()).then(|| {
                format!(
                    "{} {} (slices {})",
                    g.gpu,
                    unusable.len(),
                    fragmentation::slice_list(&unusable)
                )
            })
        })
        .collect();
    let mut out = format!(
        "profile {profile} needs {size} free memory slices at one of its placements (starting at slice {}), \
         but no GPU has them: {free} memory slices are free but fragmented: {}",
        starts.join(" or "),
        per_gpu.join(", ")
    );
    let cheapest = gpus
        .iter()
        .filter_map(|g| g.cheapest_to_free(profile).map(|(p, claims)| (g, p, claims)))
        .min_by_key(|(g, p, claims)| {
            (
                claims.is_empty(),
                claims.len(),
                g.gpu.len(),
                g.gpu.clone(),
                p.start,
            )
        });
    if let Some((g, p, claims)) = cheapest {
        let who = if claims.is_empty() {
            "the claims holding its slices (none recorded)".to_string()
        } else {
            format!(
                "claim{} {}",
                if claims.len() == 1 { "" } else { "s" },
                claims.join(", ")
            )
        };
        out.push_str(&format!(
            "; to free {profile} at slice {} on {}, move {who} (delete and recreate the pod{} so the scheduler \
             places {} elsewhere)",
            p.start,
            g.gpu,
            if claims.len() == 1 { "" } else { "s" },
            if claims.len() == 1 { "it" } else { "them" }
        ));
    }
    Some(out)
}

/// A class that does not exist, with the closest name and the tessera classes there are.
fn missing_class(name: &str, classes: &[DeviceClass]) -> String {
    let tessera: Vec<&str> = classes
        .iter()
        .filter(|c| {
            let named = c
                .metadata
                .name
                .as_deref()
                .is_some_and(|n| n.ends_with(tessera_api::DRIVER_NAME));
            let selects = c
                .spec
                .as_ref()
                .and_then(|s| s.selectors.as_ref())
                .into_iter()
                .flatten()
                .filter_map(|s| s.cel.as_ref())
                .any(|cel| cel.expression.contains(tessera_api::DRIVER_NAME));
            named || selects
        })
        .filter_map(|c| c.metadata.name.as_deref())
        .collect();
    let mut out = format!("DeviceClass {name} does not exist");
    let closest = classes
        .iter()
        .filter_map(|c| c.metadata.name.as_deref())
        .map(|c| (edit_distance(name, c), c))
        .min();
    if let Some((d, c)) = closest
        && d <= name.len().max(c.len()) / 3
    {
        out.push_str(&format!("; did you mean {c}?"));
    }
    if tessera.is_empty() {
        out.push_str(&format!(
            "; no DeviceClass selects {} devices (is tessera's chart installed?)",
            tessera_api::DRIVER_NAME
        ));
    } else {
        out.push_str(&format!("; tessera's classes: {}", tessera.join(", ")));
    }
    out
}

/// Levenshtein distance, for "did you mean".
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The node-level reason an alternative does not fit, from its diagnosis.
fn alternative_reason(
    classes: &[DeviceClass],
    model: &NodeModel<'_>,
    alt: &Alternative,
    class_found: bool,
    diag: &Diagnosis,
    outcome: &Outcome,
    constraints: &[request::Constraint],
) -> String {
    if !class_found {
        return missing_class(&alt.class, classes);
    }
    if let Outcome::Error(message) = outcome {
        return format!("the scheduler stops with an error: {message}");
    }
    if *outcome == Outcome::Undecided {
        return "undecided: the search gave up (too many combinations); the scheduler may still find one"
            .into();
    }
    let free = diag.iter().filter(|(_, f)| f.is_none()).count();
    // Devices that match the request's selectors but cannot be used now.
    let matching: Diagnosis = diag
        .iter()
        .filter(|(_, f)| f.as_ref().is_none_or(|f| f.stage() >= 2))
        .cloned()
        .collect();
    if alt.all {
        if matching.is_empty() {
            return format!(
                "allocationMode All: no device of class {} matches here",
                alt.class
            );
        }
        let order = closest_order(model, &matching);
        return match order
            .iter()
            .find_map(|i| matching[*i].1.as_ref().map(|f| (matching[*i].0, f)))
        {
            Some((d, f)) => format!(
                "allocationMode All needs every matching device; {}: {f}",
                model.devices[d].name()
            ),
            None => "allocationMode All: the matching devices cannot all be allocated together".into(),
        };
    }
    if free >= alt.count {
        let applying: Vec<String> = constraints
            .iter()
            .filter(|c| c.applies_to(alt))
            .map(ToString::to_string)
            .collect();
        let why = if applying.is_empty() {
            "they share counters or capacity".to_string()
        } else {
            format!(
                "they share counters or capacity, or break {}",
                applying.join(", ")
            )
        };
        return format!(
            "{free} matching devices are free one at a time, but no {} of them fit together ({why})",
            alt.count
        );
    }
    if free == 0 {
        return fragmented_reason(model, diag).unwrap_or_else(|| grouped_reason(model, alt, diag));
    }
    let rest: Diagnosis = matching.into_iter().filter(|(_, f)| f.is_some()).collect();
    if rest.is_empty() {
        return format!("count {} > {free} matching devices on this node", alt.count);
    }
    format!(
        "count {} > {free} free matching devices; the rest: {}",
        alt.count,
        grouped_reason(model, alt, &rest)
    )
}

fn diagnose<'a>(
    selectors: &mut Selectors<'_>,
    model: &NodeModel<'a>,
    state: &AllocatedState,
    alt: &Alternative,
) -> (Diagnosis, Candidates) {
    let probe = Search::new(model, state, vec![Vec::new()], Vec::new());
    let mut diag = Vec::new();
    let mut cands = Candidates {
        devices: Vec::new(),
        all: Vec::new(),
        all_blocked: false,
        all_error: None,
    };
    for d in 0..model.devices.len() {
        let dev = &model.devices[d];
        if alt.all && !dev.pool_complete && cands.all_error.is_none() {
            cands.all_error = Some(format!(
                "allocationMode All, but the pool of {} is being updated",
                dev.name()
            ));
        }
        match selectors.static_check(alt, dev) {
            Ok(()) => {
                cands.devices.push((d, None));
                cands.all.push(d);
                diag.push((d, probe.check(alt, d).err()));
            }
            Err(f) => {
                match &f {
                    // `All` counts every device matching the selectors and the static capacity; a taint
                    // then makes the whole request fail rather than leaving the device out.
                    Failure::Tainted { .. } => {
                        cands.all.push(d);
                        cands.all_blocked = true;
                    }
                    Failure::SelectorError { message } if dev.pool_complete => {
                        cands.devices.push((d, Some(message.clone())));
                        if cands.all_error.is_none() {
                            cands.all_error = Some(format!("selector fails on {}: {message}", dev.name()));
                        }
                    }
                    _ => {}
                }
                diag.push((d, Some(f)));
            }
        }
    }
    (diag, cands)
}

/// Explains `target` against `cluster`.
pub fn explain(cluster: &Cluster, target: &Target) -> Result<Report, ExplainError> {
    let resolved = resolve(cluster, target)?;
    let state = AllocatedState::from_claims(&cluster.claims, &resolved.exclude);
    let mut selectors = Selectors::new(&cluster.classes);
    let pod = match target {
        Target::Pod { namespace, name } => find(&cluster.pods, namespace, name),
        _ => None,
    };
    let bound = pod
        .and_then(|p| p.spec.as_ref())
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !n.is_empty());
    // A pod the scheduler has not placed yet is filtered per node before its claims are looked at.
    let unplaced = pod.filter(|_| !bound);
    let mut nodes = model::node_names(&cluster.slices);
    if unplaced.is_some() && resolved.pending.is_empty() && !cluster.nodes.is_empty() {
        nodes = cluster
            .nodes
            .iter()
            .filter_map(|n| n.metadata.name.clone())
            .collect();
        nodes.sort();
    }
    let total_nodes = nodes.len();
    // Per node: why the pod itself cannot go there.
    let mut excluded: Vec<(String, String)> = Vec::new();
    // Reasons that hold on every node, found without Node objects.
    let mut everywhere: Option<String> = None;
    if let Some(pod) = unplaced {
        if cluster.nodes.is_empty() {
            if let Some((resource, need)) = pod::unserved_extended(pod, &cluster.classes).into_iter().next() {
                everywhere = Some(format!(
                    "Insufficient {resource}: the pod asks for {need} and no DeviceClass serves it \
                     (spec.extendedResourceName); add the Nodes to the input to check a device plugin's allocatable"
                ));
            }
        } else {
            nodes.retain(|n| {
                let reason = match cluster
                    .nodes
                    .iter()
                    .find(|o| o.metadata.name.as_deref() == Some(n))
                {
                    Some(node) => pod::node_failure(pod, node, &cluster.classes),
                    None => Some("no Node of this name (its slices outlive it)".into()),
                };
                match reason {
                    Some(r) => {
                        excluded.push((n.clone(), r));
                        false
                    }
                    None => true,
                }
            });
        }
    }
    let prepare = pod
        .filter(|_| bound && resolved.pending.is_empty() && !resolved.allocated.is_empty())
        .and_then(|p| pod::prepare_failure(p, &cluster.events));
    // Prepared, yet not running: kubelet retries the container from the same CDI spec, which fails alike.
    let runtime = pod
        .filter(|_| bound && resolved.pending.is_empty() && prepare.is_none())
        .and_then(|p| pod::runtime_failure(p, &cluster.claims));
    let models: Vec<NodeModel<'_>> = nodes
        .iter()
        .map(|n| NodeModel::build(n, &cluster.slices, &state, &cluster.taint_rules))
        .collect();
    let tessera_only = cluster
        .slices
        .iter()
        .all(|s| s.spec.driver == tessera_api::DRIVER_NAME);

    let mut claims_out: Vec<ClaimReport> = resolved
        .allocated
        .iter()
        .map(|(label, devices)| ClaimReport {
            claim: label.clone(),
            allocated: Some(devices.clone()),
            requests: Vec::new(),
        })
        .collect();
    let mut node_verdicts = Vec::new();
    // Per claim, request, node: the per-alternative diagnoses (for the summary).
    let mut request_reports: Vec<Vec<RequestReport>> = Vec::new();
    // Per (claim, request): the largest amount any device offers of the capacity it lacks, and where.
    let mut best_capacity: BTreeMap<(usize, usize), (Quantity, String, String)> = BTreeMap::new();
    // Per (node, claim, request, alternative): the candidates, kept for the search of all requests together
    // (evaluating selectors is most of explain's time).
    let mut kept: BTreeMap<(usize, usize, usize, usize), Candidates> = BTreeMap::new();

    for (ci, claim) in resolved.pending.iter().enumerate() {
        let mut reqs = Vec::new();
        for (ri, req) in claim.requests.iter().enumerate() {
            let mut per_node = Vec::new();
            // How close each (node, alternative) came: the furthest stage any device reached.
            let mut closeness: Vec<Vec<u8>> = Vec::new();
            for (ni, model) in models.iter().enumerate() {
                let mut alts_out = Vec::new();
                let mut node_closeness = Vec::new();
                let mut fits_node = false;
                for (ai, alt) in req.alternatives.iter().enumerate() {
                    let class_found = selectors.class(&alt.class).is_some();
                    let (diag, cands) = diagnose(&mut selectors, model, &state, alt);
                    kept.insert((ni, ci, ri, ai), cands.clone());
                    for (d, f) in &diag {
                        if let Some(Failure::CapacityOver {
                            name,
                            requested,
                            offered,
                        }) = f
                        {
                            let better = best_capacity
                                .get(&(ci, ri))
                                .is_none_or(|e| offered.compare(&e.0).is_gt());
                            if better {
                                best_capacity.insert(
                                    (ci, ri),
                                    (
                                        *offered,
                                        format!("{} on {}", model.devices[*d].name(), model.name),
                                        format!("{name} {requested}"),
                                    ),
                                );
                            }
                        }
                    }
                    let outcome = if class_found {
                        Search::new(
                            model,
                            &state,
                            vec![claim.constraints.clone()],
                            vec![(0, vec![(alt, cands)])],
                        )
                        .run()
                    } else {
                        Outcome::DoesNotFit
                    };
                    let fits = outcome == Outcome::Fits;
                    fits_node |= fits;
                    let order = closest_order(model, &diag);
                    // Devices of other classes are not "close": they are left out of the list.
                    let closest = order
                        .iter()
                        .filter(|i| !matches!(diag[**i].1, Some(Failure::ClassSelector { .. })))
                        .take(3)
                        .map(|i| DeviceNote {
                            device: model.devices[diag[*i].0].name().to_string(),
                            free: diag[*i].1.is_none(),
                            reason: diag[*i].1.as_ref().map(ToString::to_string),
                        })
                        .collect();
                    node_closeness.push(
                        diag.iter()
                            .map(|(_, f)| f.as_ref().map_or(u8::MAX, Failure::stage))
                            .max()
                            .unwrap_or(0),
                    );
                    alts_out.push(AlternativeNode {
                        name: alt.name.clone(),
                        asks: asks(alt),
                        fits,
                        reason: (!fits).then(|| {
                            alternative_reason(
                                &cluster.classes,
                                model,
                                alt,
                                class_found,
                                &diag,
                                &outcome,
                                &claim.constraints,
                            )
                        }),
                        closest,
                    });
                }
                closeness.push(node_closeness);
                per_node.push(RequestNode {
                    node: model.name.clone(),
                    fits: fits_node,
                    alternatives: alts_out,
                });
            }
            let fit_nodes: Vec<&str> = per_node
                .iter()
                .filter(|n| n.fits)
                .map(|n| n.node.as_str())
                .collect();
            let summary = if !fit_nodes.is_empty() {
                format!("fits on {}", fit_nodes.join(", "))
            } else if let Some((offered, device, asked)) = best_capacity
                .get(&(ci, ri))
                .filter(|_| request_stuck_at_capacity(&per_node))
            {
                let who = if tessera_only { "tessera device" } else { "device" };
                format!("no {who} offers {asked}; the largest is {offered} ({device})")
            } else if per_node.is_empty() && !excluded.is_empty() {
                "no node is left once the pod's own constraints are applied (nodes: below)".to_string()
            } else if per_node.is_empty() {
                "no node publishes devices".to_string()
            } else {
                // The node and alternative that came closest (the first of equals) explain it best.
                let mut first: Option<(&RequestNode, &AlternativeNode, &String, u8)> = None;
                for (n, scores) in per_node.iter().zip(&closeness) {
                    for (a, score) in n.alternatives.iter().zip(scores) {
                        if let Some(r) = &a.reason
                            && first.is_none_or(|f| *score > f.3)
                        {
                            first = Some((n, a, r, *score));
                        }
                    }
                }
                match first {
                    Some((n, a, r, _)) if req.first_available => format!("{}: {} ({})", n.node, r, a.name),
                    Some((n, _, r, _)) => format!("{}: {r}", n.node),
                    None => "does not fit".to_string(),
                }
            };
            reqs.push(RequestReport {
                name: req.name.clone(),
                fits: !fit_nodes.is_empty(),
                summary,
                nodes: per_node,
            });
        }
        request_reports.push(reqs);
    }

    // All pending claims' requests together, per node.
    for (ni, model) in models.iter().enumerate() {
        let mut requests = Vec::new();
        for (ci, claim) in resolved.pending.iter().enumerate() {
            for (ri, req) in claim.requests.iter().enumerate() {
                let alts = req
                    .alternatives
                    .iter()
                    .enumerate()
                    .map(|(ai, alt)| {
                        let cands = kept
                            .remove(&(ni, ci, ri, ai))
                            .expect("every alternative was diagnosed above");
                        (alt, cands)
                    })
                    .collect();
                requests.push((ci, alts));
            }
        }
        let any_missing_class = resolved
            .pending
            .iter()
            .flat_map(|c| c.requests.iter().flat_map(|r| r.alternatives.iter()))
            .any(|a| selectors.class(&a.class).is_none());
        let outcome = if any_missing_class {
            Outcome::DoesNotFit
        } else {
            let constraints = resolved.pending.iter().map(|c| c.constraints.clone()).collect();
            Search::new(model, &state, constraints, requests).run()
        };
        node_verdicts.push(NodeVerdict {
            node: model.name.clone(),
            fits: outcome == Outcome::Fits,
            undecided: outcome == Outcome::Undecided,
            reason: match outcome {
                Outcome::Error(message) => Some(format!("the scheduler stops with an error: {message}")),
                _ => None,
            },
        });
    }
    for (ni, v) in node_verdicts.iter_mut().enumerate() {
        if v.fits || v.reason.is_some() {
            continue;
        }
        let failing: Vec<String> = request_reports
            .iter()
            .flatten()
            .filter(|r| !r.nodes[ni].fits)
            .map(|r| r.name.clone())
            .collect();
        v.reason = Some(if v.undecided {
            "undecided: the search gave up (too many combinations)".into()
        } else if failing.is_empty() {
            let constraints: Vec<String> = resolved
                .pending
                .iter()
                .flat_map(|c| c.constraints.iter().map(ToString::to_string))
                .collect();
            if constraints.is_empty() {
                "each request fits alone, but not all together".into()
            } else {
                format!(
                    "each request fits alone, but not all together under {}",
                    constraints.join(", ")
                )
            }
        } else {
            format!("request {} does not fit", failing.join(", "))
        });
    }

    for (node, reason) in &excluded {
        node_verdicts.push(NodeVerdict {
            node: node.clone(),
            fits: false,
            undecided: false,
            reason: Some(reason.clone()),
        });
    }
    node_verdicts.sort_by(|a, b| a.node.cmp(&b.node));
    let by_reason = group_by_reason(&excluded);

    let label = target.label();
    let pending = !resolved.pending.is_empty();
    let fit_nodes: Vec<&str> = node_verdicts
        .iter()
        .filter(|n| n.fits)
        .map(|n| n.node.as_str())
        .collect();
    let all_excluded = !excluded.is_empty() && models.is_empty();
    let fits = everywhere.is_none()
        && prepare.is_none()
        && runtime.is_none()
        && !all_excluded
        && (!pending || !fit_nodes.is_empty());
    let of_nodes = format!(
        "any of {total_nodes} node{}",
        if total_nodes == 1 { "" } else { "s" }
    );
    let summary = if let Some(p) = &prepare {
        let first = p.message.lines().next().unwrap_or("");
        format!(
            "{label}: every claim is allocated, but kubelet on {} cannot prepare them: {first}",
            p.node
        )
    } else if let Some(r) = &runtime {
        let first = r.message.lines().next().unwrap_or("");
        format!(
            "{label}: every claim is prepared, but the container runtime on {} refuses container {} with \
             tessera's devices ({}): {first}",
            r.node, r.container, r.reason
        )
    } else if let Some(why) = &everywhere {
        format!("{label} does not fit: {why}")
    } else if all_excluded {
        format!("{label} does not fit on {of_nodes}: {by_reason}")
    } else if !pending {
        match (target, resolved.allocated.as_slice()) {
            (Target::Claim { .. }, [(_, devices)]) => format!("{label} is allocated already: {devices}"),
            (_, []) => format!("{label} asks for no devices"),
            _ => format!("{label}: every claim is allocated already"),
        }
    } else if fits {
        format!("{label} fits on {}", fit_nodes.join(", "))
    } else {
        let why = request_reports
            .iter()
            .zip(&resolved.pending)
            .flat_map(|(rs, c)| rs.iter().map(move |r| (r, c)))
            .find(|(r, _)| !r.fits)
            .map(|(r, c)| {
                let claim = if resolved.pending.len() > 1 {
                    format!("{} ", c.label)
                } else {
                    String::new()
                };
                format!("{claim}request {}: {}", r.name, r.summary)
            })
            .unwrap_or_else(|| "each request fits alone, but not all together on one node".into());
        if excluded.is_empty() {
            format!("{label} does not fit on {of_nodes}: {why}")
        } else {
            format!("{label} does not fit on {of_nodes}: {why}; {by_reason}")
        }
    };
    for (claim, reqs) in resolved.pending.iter().zip(request_reports) {
        claims_out.push(ClaimReport {
            claim: claim.label.clone(),
            allocated: None,
            requests: reqs,
        });
    }
    Ok(Report {
        target: label,
        fits,
        summary,
        pod_nodes: !excluded.is_empty(),
        kubelet: prepare
            .map(|p| {
                format!(
                    "kubelet on {} reported FailedPrepareDynamicResources ({} time{}): {}",
                    p.node,
                    p.count,
                    if p.count == 1 { "" } else { "s" },
                    p.message
                )
            })
            .or_else(|| runtime.as_ref().map(runtime_advice)),
        nodes: node_verdicts,
        claims: claims_out,
    })
}

/// What kubelet reports of a container the runtime refuses, and what to do: kubelet's retries read the same
/// spec, so the pod waits until the spec changes, which only a new prepare does.
fn runtime_advice(r: &pod::RuntimeFailure) -> String {
    let specs = if r.claim_uids.is_empty() {
        "the CDI specs of its claims (k8s.gpu.tessera.dev-claim_<claim UID>.json)".to_string()
    } else {
        let files: Vec<String> = r
            .claim_uids
            .iter()
            .map(|uid| format!("k8s.gpu.tessera.dev-claim_{uid}.json"))
            .collect();
        format!("the CDI spec {}", files.join(", "))
    };
    format!(
        "kubelet on {node} reports container {} {}: {}\n\
         Retrying does not help: kubelet creates the container from the same CDI spec each time. Read {specs} \
         in the runtime's CDI directory on {node} (/var/run/cdi by default) and the tessera kubelet plugin's \
         log there. A spec naming one device twice (two shares of one GPU in one claim) comes from a plugin \
         older than this kubectl-tessera: upgrade the plugin. Then delete the pod: kubelet unprepares its \
         claims, and the pod that replaces it gets them prepared anew.",
        r.container,
        r.reason,
        r.message,
        node = r.node,
    )
}

/// `node-a, node-b: reason; node-c: other reason`, the nodes of each reason together, first seen first.
fn group_by_reason(excluded: &[(String, String)]) -> String {
    let mut groups: Vec<(&str, Vec<&str>)> = Vec::new();
    for (node, reason) in excluded {
        match groups.iter_mut().find(|(r, _)| r == reason) {
            Some((_, nodes)) => nodes.push(node),
            None => groups.push((reason, vec![node])),
        }
    }
    groups
        .iter()
        .map(|(r, nodes)| format!("{}: {r}", nodes.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether, on every node and for every alternative, capacity was the furthest any device got.
fn request_stuck_at_capacity(nodes: &[RequestNode]) -> bool {
    nodes.iter().all(|n| {
        n.alternatives.iter().all(|a| {
            a.reason
                .as_deref()
                .is_some_and(|r| r.starts_with("no device offers"))
        })
    })
}
