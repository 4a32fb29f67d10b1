//! What explain prints: a summary line, then per claim, request and node the verdict, the reason and the
//! closest devices. `-o json` prints the same structure.

use std::fmt::Write as _;

use serde::Serialize;

/// The whole answer for one pod, claim or template.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// `pod ns/name`, `claim ns/name` or `template ns/name`.
    pub target: String,
    /// Whether every pending claim fits, all requests together, on at least one node.
    pub fits: bool,
    pub summary: String,
    /// Whether the pod itself (nodeSelector, affinity, taints, extended resources) rules out some nodes;
    /// their verdicts then carry the reason.
    #[serde(skip)]
    pub pod_nodes: bool,
    /// For a pod whose claims are allocated but that does not start: what kubelet reported.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubelet: Option<String>,
    /// The claims together (and the pod's own constraints), per node.
    pub nodes: Vec<NodeVerdict>,
    pub claims: Vec<ClaimReport>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeVerdict {
    pub node: String,
    pub fits: bool,
    /// Set when the search gave up: the verdict is then "does not fit" but unproven.
    pub undecided: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimReport {
    pub claim: String,
    /// Set for a claim that is allocated already (it is not evaluated).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocated: Option<String>,
    pub requests: Vec<RequestReport>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestReport {
    pub name: String,
    /// Whether the request alone fits on some node.
    pub fits: bool,
    pub summary: String,
    pub nodes: Vec<RequestNode>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestNode {
    pub node: String,
    pub fits: bool,
    /// One per `firstAvailable` entry, in order; one for `exactly`.
    pub alternatives: Vec<AlternativeNode>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AlternativeNode {
    pub name: String,
    /// Class, count and capacity, as the request asks.
    pub asks: String,
    pub fits: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub closest: Vec<DeviceNote>,
}

#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceNote {
    pub device: String,
    pub free: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

fn verdict(fits: bool) -> &'static str {
    if fits { "fits" } else { "does not fit" }
}

impl Report {
    /// The text `-o text` prints.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{}", self.summary);
        if let Some(kubelet) = &self.kubelet {
            let _ = writeln!(out, "\n{kubelet}");
        }
        if self.pod_nodes {
            let _ = writeln!(out, "\nnodes:");
            for n in &self.nodes {
                let reason = n.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default();
                let _ = writeln!(out, "  {}: {}{reason}", n.node, verdict(n.fits));
            }
        }
        for claim in &self.claims {
            if let Some(allocated) = &claim.allocated {
                let _ = writeln!(out, "\n{}: allocated: {allocated}", claim.claim);
                continue;
            }
            for r in &claim.requests {
                let _ = writeln!(out, "\n{} request {}: {}", claim.claim, r.name, r.summary);
                for n in &r.nodes {
                    let _ = writeln!(out, "  {}: {}", n.node, verdict(n.fits));
                    for a in &n.alternatives {
                        let reason = a.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default();
                        let _ = writeln!(out, "    {} ({}): {}{reason}", a.name, a.asks, verdict(a.fits));
                        for d in &a.closest {
                            let why = d.reason.as_deref().unwrap_or("free");
                            let _ = writeln!(out, "      {}: {why}", d.device);
                        }
                    }
                }
            }
        }
        // With one request the per-node verdict above is already the whole answer.
        let requests: usize = self.claims.iter().map(|c| c.requests.len()).sum();
        if requests > 1 && !self.nodes.is_empty() && !self.pod_nodes {
            let _ = writeln!(out, "\nall requests together:");
            for n in &self.nodes {
                let reason = n.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default();
                let _ = writeln!(out, "  {}: {}{reason}", n.node, verdict(n.fits));
            }
        }
        out
    }
}
