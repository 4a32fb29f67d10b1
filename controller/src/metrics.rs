//! The controller's Prometheus metrics, served on `--health-addr` as `GET /metrics`.
//!
//! | Metric | Labels | What |
//! |---|---|---|
//! | `tessera_controller_reconcile_duration_seconds` | `result` (`success`, `error`) | histogram of one round: lease, render, writes |
//! | `tessera_controller_slice_writes_total` | `operation` (`create`, `update`, `delete`) | ResourceSlice writes the API server accepted |
//! | `tessera_controller_api_errors_total` | `operation` (the above, `patch_policy_status`) | writes it refused or that failed |
//! | `tessera_controller_leader` | | 1 while this replica holds the Lease and publishes |
//! | `tessera_controller_mig_free_slices` | `node`, `gpu` | memory slices of a dynamic-MIG GPU no allocated claim holds |
//! | `tessera_controller_mig_fragmented_slices` | `node`, `gpu`, `profile`, `demand` (`pending`, `none`) | of those, the ones no placement of `profile` that fits now can use: `profile` is the largest a pending claim asks for on that GPU (`demand="pending"`), else the GPU's largest (`none`) |
//! | `tessera_controller_retained_devices` | `node` | allocated devices kept published although the policy drops them, until their claims are released ([`crate::retain`]) |
//!
//! The MIG gauges ([`crate::fragmentation`]) need the controller to read ResourceClaims and DeviceClasses;
//! per node: `sum by (node) (tessera_controller_mig_fragmented_slices)`.
//!
//! The registry is process-wide ([`metrics`]), so the kube-rs layer records with one line per call site.

use std::{
    sync::{LazyLock, Mutex},
    time::Duration,
};

use prometheus_client::{
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::{Registry, Unit},
};
use tessera_api::metrics::duration_buckets;

use crate::explain::fragmentation::GpuFragmentation;

type Labels = Vec<(&'static str, String)>;

/// The controller's metrics and the registry they render from.
pub struct ControllerMetrics {
    registry: Mutex<Registry>,
    reconciles: Family<Labels, Histogram, fn() -> Histogram>,
    writes: Family<Labels, Counter>,
    api_errors: Family<Labels, Counter>,
    leader: Gauge,
    mig_free: Family<Labels, Gauge>,
    mig_fragmented: Family<Labels, Gauge>,
    retained: Family<Labels, Gauge>,
}

static METRICS: LazyLock<ControllerMetrics> = LazyLock::new(ControllerMetrics::new);

/// The process's metrics.
pub fn metrics() -> &'static ControllerMetrics {
    &METRICS
}

fn new_histogram() -> Histogram {
    Histogram::new(duration_buckets())
}

impl ControllerMetrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("tessera_controller");
        // Help texts without a final period: prometheus-client adds one to what it registers.
        let reconciles = Family::new_with_constructor(new_histogram as fn() -> Histogram);
        registry.register_with_unit(
            "reconcile_duration",
            "Time of one reconcile round (lease renewal, rendering and the ResourceSlice writes)",
            Unit::Seconds,
            reconciles.clone(),
        );
        let writes = Family::<Labels, Counter>::default();
        registry.register(
            "slice_writes",
            "ResourceSlice creates, updates and deletes the API server accepted",
            writes.clone(),
        );
        let api_errors = Family::<Labels, Counter>::default();
        registry.register(
            "api_errors",
            "Writes to the API server that failed, by operation",
            api_errors.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease and publishes, else 0",
            leader.clone(),
        );
        let mig_free = Family::<Labels, Gauge>::default();
        registry.register(
            "mig_free_slices",
            "Memory slices of a dynamic-MIG GPU that no allocated ResourceClaim holds",
            mig_free.clone(),
        );
        let mig_fragmented = Family::<Labels, Gauge>::default();
        registry.register(
            "mig_fragmented_slices",
            "Free memory slices of a dynamic-MIG GPU that no placement of the profile in demand can use now \
             (demand=pending: the largest profile a pending claim asks for there; none: the GPU's largest)",
            mig_fragmented.clone(),
        );
        let retained = Family::<Labels, Gauge>::default();
        registry.register(
            "retained_devices",
            "Allocated devices kept published (tainted gpu.tessera.dev/retained) although the policy drops \
             them, until their claims are released",
            retained.clone(),
        );
        Self {
            registry: Mutex::new(registry),
            reconciles,
            writes,
            api_errors,
            leader,
            mig_free,
            mig_fragmented,
            retained,
        }
    }

    /// Replaces the retained-devices gauge with `(node, count)` per node that keeps any.
    pub fn set_retained(&self, nodes: &[(String, usize)]) {
        let _scrape = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        self.retained.clear();
        for (node, count) in nodes {
            self.retained
                .get_or_create(&vec![("node", node.clone())])
                .set(*count as i64);
        }
    }

    /// Records one reconcile round.
    pub fn reconciled(&self, took: Duration, ok: bool) {
        let result = if ok { "success" } else { "error" };
        self.reconciles
            .get_or_create(&vec![("result", result.to_string())])
            .observe(took.as_secs_f64());
    }

    /// Records the outcome of one write (`create`, `update`, `delete`, `patch_policy_status`); passes the
    /// result through.
    pub fn wrote<T, E>(&self, operation: &'static str, result: Result<T, E>) -> Result<T, E> {
        let labels = vec![("operation", operation.to_string())];
        match &result {
            Ok(_) if operation != "patch_policy_status" => {
                self.writes.get_or_create(&labels).inc();
            }
            Ok(_) => {}
            Err(_) => {
                self.api_errors.get_or_create(&labels).inc();
            }
        }
        result
    }

    /// Whether this replica leads now.
    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// Replaces the MIG gauges with `gpus` (GPUs gone since the last call drop out).
    pub fn set_mig_fragmentation(&self, gpus: &[GpuFragmentation]) {
        // Under the registry's lock, so a scrape never sees the families half rebuilt.
        let _scrape = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        self.mig_free.clear();
        self.mig_fragmented.clear();
        for g in gpus {
            let at = vec![("node", g.node.clone()), ("gpu", g.gpu.clone())];
            self.mig_free.get_or_create(&at).set(i64::from(g.free));
            let mut labels = at;
            labels.push(("profile", g.profile.clone()));
            let demand = if g.pending { "pending" } else { "none" };
            labels.push(("demand", demand.to_string()));
            self.mig_fragmented
                .get_or_create(&labels)
                .set(i64::from(g.unusable));
        }
    }

    /// The metrics as OpenMetrics text.
    pub fn render(&self) -> String {
        tessera_api::metrics::render(&self.registry.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_errors_rounds_and_leadership_render_with_their_names_and_labels() {
        let m = ControllerMetrics::new();
        m.reconciled(Duration::from_millis(30), true);
        let _ = m.wrote::<(), ()>("create", Ok(()));
        let _ = m.wrote::<(), ()>("create", Ok(()));
        let _ = m.wrote::<(), ()>("delete", Err(()));
        let _ = m.wrote::<(), ()>("patch_policy_status", Ok(()));
        m.set_leader(true);

        let text = m.render();
        let parsed = tessera_api::metrics::exposition::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let value = |name, labels: &[(&str, &str)]| {
            let found = parsed.find(name, labels);
            assert_eq!(found.len(), 1, "{name} {labels:?} in\n{text}");
            found[0].value
        };
        assert_eq!(
            value(
                "tessera_controller_slice_writes_total",
                &[("operation", "create")]
            ),
            2.0
        );
        assert!(
            parsed
                .find(
                    "tessera_controller_slice_writes_total",
                    &[("operation", "patch_policy_status")]
                )
                .is_empty()
        );
        assert_eq!(
            value("tessera_controller_api_errors_total", &[("operation", "delete")]),
            1.0
        );
        assert_eq!(
            value(
                "tessera_controller_reconcile_duration_seconds_count",
                &[("result", "success")]
            ),
            1.0
        );
        assert_eq!(
            value(
                "tessera_controller_reconcile_duration_seconds_bucket",
                &[("result", "success"), ("le", "0.032")]
            ),
            1.0
        );
        assert_eq!(value("tessera_controller_leader", &[]), 1.0);
    }

    #[test]
    fn mig_gauges_show_each_gpus_free_and_fragmented_slices_and_drop_gpus_that_are_gone() {
        let m = ControllerMetrics::new();
        let gpu = |gpu: &str, pending, free, unusable| GpuFragmentation {
            node: "n".into(),
            gpu: gpu.into(),
            profile: "3g.40gb".into(),
            pending,
            free,
            unusable,
        };
        m.set_mig_fragmentation(&[gpu("gpu-0", true, 6, 6), gpu("gpu-2", false, 8, 0)]);
        let text = m.render();
        let parsed = tessera_api::metrics::exposition::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let fragmented = parsed.find(
            "tessera_controller_mig_fragmented_slices",
            &[
                ("node", "n"),
                ("gpu", "gpu-0"),
                ("profile", "3g.40gb"),
                ("demand", "pending"),
            ],
        );
        assert_eq!(fragmented.len(), 1, "{text}");
        assert_eq!(fragmented[0].value, 6.0);
        let free = parsed.find("tessera_controller_mig_free_slices", &[("gpu", "gpu-2")]);
        assert_eq!(free.len(), 1, "{text}");
        assert_eq!(free[0].value, 8.0);

        m.set_mig_fragmentation(&[gpu("gpu-0", true, 6, 6)]);
        let text = m.render();
        let parsed = tessera_api::metrics::exposition::parse(&text).unwrap();
        assert!(
            parsed
                .find("tessera_controller_mig_free_slices", &[("gpu", "gpu-2")])
                .is_empty(),
            "{text}"
        );
    }
}
