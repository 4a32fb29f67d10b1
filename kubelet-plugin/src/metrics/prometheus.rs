//! The plugin's Prometheus metrics, served on `--health-addr` as `GET /metrics`.
//!
//! | Metric | Labels | What |
//! |---|---|---|
//! | `tessera_plugin_claim_operations_total` | `operation` (`prepare`, `unprepare`), `result` (`success`, `error`) | claims kubelet asked for |
//! | `tessera_plugin_claim_errors_total` | `operation`, `reason` (the error's kind, e.g. `claim_not_found`) | failures by reason |
//! | `tessera_plugin_claim_operation_duration_seconds` | `operation` | histogram, per claim |
//! | `tessera_plugin_mig_operation_duration_seconds` | `operation` (`create_gpu_instance`, `create_compute_instance`, `destroy_compute_instance`, `destroy_gpu_instance`) | histogram of the NVML calls |
//! | `tessera_plugin_prepared_claims` | | claims prepared on the node |
//! | `tessera_plugin_prepared_devices` | `kind` (`gpu`, `mig`, `shared`) | devices of those claims |
//! | `tessera_plugin_device_prepare_duration_seconds` | `kind` (`mig`, `mps`), `start` (`warm`: took a warm partition; `cold`: did not) | histogram, per device that makes a partition |
//! | `tessera_plugin_warm_takes_total` | `kind`, `result` (`hit`, `miss`) | prepares of devices published with `warmSeconds` (a miss found nothing warm to take) |
//! | `tessera_plugin_warm_saved_seconds_total` | `kind` | what making the partitions that hits took would have cost (each one's measured making time) |
//! | `tessera_plugin_warm_destroyed_total` | `kind`, `reason` (`expired`, `in_the_way`) | warm partitions destroyed |
//! | `tessera_plugin_warm_devices` | `kind` | warm partitions held now |
//! | `tessera_plugin_mps_daemons` | | MPS control daemons answering |
//! | `tessera_plugin_mps_daemon_up` | `device` (the shared device's key: `gpu-0`, `gpu-1-mig-3g-40gb-4`) | 1 while the MPS daemon of a device with prepared MPS shares answers, 0 while those shares have no server |
//! | `tessera_claim_gpu_utilization_ratio` | `namespace`, `pod`, `claim`, `request`, `device` | 0–1 of the device the claim runs on |
//! | `tessera_claim_gpu_memory_used_bytes` | the same | memory the claim's processes use |
//! | `tessera_claim_gpu_compute_share_ratio` | the same | the part of the GPU's SMs the claim's device was given: 1 for a whole GPU, an MPS share's active-thread percentage / 100; absent for MIG devices and time-sliced shares |
//! | `tessera_claim_device_info` | `namespace`, `pod` (one sample per pod), `claim`, `request`, `device`, `UUID`, `GPU_I_ID`, `mig_uuid`, `sharing` | 1: the DCGM entity a claim's device is on, in dcgm-exporter's label names ([`super::dcgm`]) |
//! | `tessera_claim_gpu_compute_ceiling_ratio` | the same | what the claim may burst to: the same value as `compute_share_ratio` (its active-thread percentage / 100), named beside the request |
//! | `tessera_claim_gpu_compute_request_ratio` | the same | what the scheduler packed: 1 for a whole GPU, a share's consumed `compute` capacity / 100; absent where none was reserved (a share naming only memory) and on MIG devices |
//! | `tessera_claim_gpu_request_utilization_ratio` | the same | utilization / request: how busy the claim is relative to what it reserved, above 1 while a burstable share uses more than its request (as CPU utilization of a container above its request) |
//!
//! `sum(tessera_claim_gpu_utilization_ratio) / sum(tessera_claim_gpu_compute_share_ratio)` over a
//! Deployment's pods is how busy the GPU capacity given to it is: the signal to scale shares on (a fully
//! busy 25 % share reads 0.25 utilization and 0.25 share).
//!
//! The per-claim gauges are read from the GPU backend on every scrape ([`GpuBackend::usage`]): a whole GPU
//! or MIG device reports its own usage (MIG: memory only, NVML has no utilization there), a share the sum
//! of its own processes. A process is a share's when its environment names the claim (readable in the
//! host's PID namespace with `CAP_SYS_PTRACE`), or else when its cgroup in the host's `/proc`
//! (`--host-proc`) puts it in a pod the claim is reserved for and that pod has no other claim on the device
//! ([`tessera_gpu_api::usage`]). `pod` is the pod (or pods, comma-separated) in the claim's `status.reservedFor`,
//! learned from the claim the plugin already reads at prepare and from the claim list of every reconcile
//! (a minute apart, and at start): no request of its own reaches the API server.
//!
//! The registry is process-wide ([`metrics`]) and is the plugin's [`Sink`]: the layers report events
//! through [`crate::metrics::sink`] and never see this file. The gauges read the checkpoint the node last
//! committed, through the view the start-up wiring hands [`NodeCollector`], never the state machine itself.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, LazyLock, Mutex},
    time::Duration,
};

use k8s_openapi::api::resource::v1::ResourceClaim;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::Counter, family::Family, gauge::ConstGauge, histogram::Histogram},
    registry::{Registry, Unit},
};
use tessera_api::metrics::duration_buckets;

use crate::devices::sharing::mps::MpsManager;
use crate::gpu::GpuBackend;
use crate::metrics::sink::Sink;
use crate::node::checkpoint::{Checkpoint, DeviceDetail, Phase};
use tessera_gpu_api::usage::{DeviceUsage, HostProc, ProcessIdentity, ProcessUsage, UsageQuery};

/// The checkpoint the node last committed: what the gauges are read from on each scrape.
pub type CheckpointView = Arc<dyn Fn() -> Checkpoint + Send + Sync>;

type Labels = Vec<(&'static str, String)>;
type Histograms = Family<Labels, Histogram, fn() -> Histogram>;

fn new_histogram() -> Histogram {
    Histogram::new(duration_buckets())
}

/// The plugin's metrics and the registry they render from.
pub struct PluginMetrics {
    registry: Mutex<Registry>,
    operations: Family<Labels, Counter>,
    errors: Family<Labels, Counter>,
    durations: Histograms,
    mig: Histograms,
    devices: Histograms,
    warm_takes: Family<Labels, Counter>,
    warm_saved: Family<Labels, Counter<f64>>,
    warm_destroyed: Family<Labels, Counter>,
    /// Pods reserving each claim, by claim UID (see the module comment).
    pods: Mutex<HashMap<String, Vec<ReservedPod>>>,
}

/// A pod in a claim's `status.reservedFor`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ReservedPod {
    name: String,
    uid: String,
}

static METRICS: LazyLock<PluginMetrics> = LazyLock::new(PluginMetrics::new);

/// The process's metrics.
pub fn metrics() -> &'static PluginMetrics {
    &METRICS
}

/// The error's kind as a label value: its variant name in snake case (`ClaimNotFound { .. }` becomes
/// `claim_not_found`), so every error enum gets a bounded label without a list to keep in step.
pub fn reason_label(error: &impl std::fmt::Debug) -> String {
    let debug = format!("{error:?}");
    let variant = debug
        .split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
        .next()
        .unwrap_or_default();
    let mut label = String::with_capacity(variant.len() + 4);
    for (i, c) in variant.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                label.push('_');
            }
            label.push(c.to_ascii_lowercase());
        } else {
            label.push(c);
        }
    }
    label
}

impl PluginMetrics {
    fn new() -> Self {
        // Collectors sit at the root, unprefixed, so the per-claim gauges can be named apart from the rest.
        let mut root = Registry::default();
        let registry = root.sub_registry_with_prefix("tessera_plugin");
        let operations = Family::<Labels, Counter>::default();
        // Help texts without a final period: prometheus-client adds one to what it registers.
        registry.register(
            "claim_operations",
            "Claims kubelet asked the plugin to prepare or unprepare, by result",
            operations.clone(),
        );
        let errors = Family::<Labels, Counter>::default();
        registry.register(
            "claim_errors",
            "Failed claim prepares and unprepares, by the kind of error",
            errors.clone(),
        );
        let durations = Histograms::new_with_constructor(new_histogram as fn() -> Histogram);
        registry.register_with_unit(
            "claim_operation_duration",
            "Time to prepare or unprepare one claim",
            Unit::Seconds,
            durations.clone(),
        );
        let mig = Histograms::new_with_constructor(new_histogram as fn() -> Histogram);
        registry.register_with_unit(
            "mig_operation_duration",
            "Time of the NVML calls that create and destroy MIG devices",
            Unit::Seconds,
            mig.clone(),
        );
        let devices = Histograms::new_with_constructor(new_histogram as fn() -> Histogram);
        registry.register_with_unit(
            "device_prepare_duration",
            "Time to prepare one device that makes a partition (MIG device, MPS daemon), warm or cold",
            Unit::Seconds,
            devices.clone(),
        );
        let warm_takes = Family::<Labels, Counter>::default();
        registry.register(
            "warm_takes",
            "Prepares of devices kept warm by policy: hit when a warm partition was taken, miss when none was there",
            warm_takes.clone(),
        );
        let warm_saved = Family::<Labels, Counter<f64>>::default();
        registry.register_with_unit(
            "warm_saved",
            "What making the partitions that warm hits took had cost when they were made",
            Unit::Seconds,
            warm_saved.clone(),
        );
        let warm_destroyed = Family::<Labels, Counter>::default();
        registry.register(
            "warm_destroyed",
            "Warm partitions destroyed: their window ended, or a claim needed that part of the GPU",
            warm_destroyed.clone(),
        );
        Self {
            registry: Mutex::new(root),
            operations,
            errors,
            durations,
            mig,
            devices,
            warm_takes,
            warm_saved,
            warm_destroyed,
            pods: Mutex::new(HashMap::new()),
        }
    }

    /// Remembers which pods reserve `claim`, for the `pod` label of its usage.
    pub fn observe_claim(&self, claim: &ResourceClaim) {
        let Some(uid) = claim.metadata.uid.clone() else {
            return;
        };
        let pods: Vec<ReservedPod> = claim
            .status
            .iter()
            .flat_map(|s| s.reserved_for.iter().flatten())
            .filter(|r| r.resource == "pods")
            .map(|r| ReservedPod {
                name: r.name.clone(),
                uid: r.uid.to_ascii_lowercase(),
            })
            .collect();
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(uid, pods);
    }

    fn pods_of(&self, uid: &str) -> String {
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(uid)
            .map(|pods| pods.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(","))
            .unwrap_or_default()
    }

    fn pod_uids_of(&self, uid: &str) -> Vec<String> {
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(uid)
            .map(|pods| pods.iter().map(|p| p.uid.clone()).collect())
            .unwrap_or_default()
    }

    fn forget_claims_not_in(&self, checkpoint: &Checkpoint) {
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|uid, _| checkpoint.claims.contains_key(uid));
    }

    /// Adds the node's gauges, read on every scrape.
    pub fn register_node(&self, node: NodeCollector) {
        self.registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .register_collector(Box::new(node));
    }

    /// The metrics as OpenMetrics text.
    pub fn render(&self) -> String {
        tessera_api::metrics::render(&self.registry.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Sink for PluginMetrics {
    fn claim_operation(&self, operation: &'static str, took: Duration, error: Option<&dyn std::fmt::Debug>) {
        self.durations
            .get_or_create(&vec![("operation", operation.to_string())])
            .observe(took.as_secs_f64());
        let outcome = if error.is_none() { "success" } else { "error" };
        self.operations
            .get_or_create(&vec![
                ("operation", operation.to_string()),
                ("result", outcome.to_string()),
            ])
            .inc();
        if let Some(e) = error {
            self.errors
                .get_or_create(&vec![
                    ("operation", operation.to_string()),
                    ("reason", reason_label(&e)),
                ])
                .inc();
        }
    }

    fn mig_operation(&self, operation: &'static str, took: Duration) {
        self.mig
            .get_or_create(&vec![("operation", operation.to_string())])
            .observe(took.as_secs_f64());
    }

    fn device_prepared(&self, kind: &'static str, warm: bool, took: Duration) {
        let start = if warm { "warm" } else { "cold" };
        self.devices
            .get_or_create(&vec![("kind", kind.to_string()), ("start", start.to_string())])
            .observe(took.as_secs_f64());
    }

    fn warm_taken(&self, kind: &'static str, saved_ms: Option<u64>) {
        let result = if saved_ms.is_some() { "hit" } else { "miss" };
        self.warm_takes
            .get_or_create(&vec![("kind", kind.to_string()), ("result", result.to_string())])
            .inc();
        if let Some(ms) = saved_ms {
            self.warm_saved
                .get_or_create(&vec![("kind", kind.to_string())])
                .inc_by(ms as f64 / 1000.0);
        }
    }

    fn warm_destroyed(&self, kind: &'static str, reason: &'static str) {
        self.warm_destroyed
            .get_or_create(&vec![("kind", kind.to_string()), ("reason", reason.to_string())])
            .inc();
    }

    fn claim_seen(&self, claim: &ResourceClaim) {
        self.observe_claim(claim);
    }
}

/// The node's gauges: prepared claims and devices, MPS daemons, and per-claim GPU usage.
pub struct NodeCollector {
    checkpoint: CheckpointView,
    backend: Arc<dyn GpuBackend>,
    mps: Option<MpsManager>,
    health: Option<Arc<crate::gpu::health::Health>>,
    host_proc: Option<HostProc>,
}

impl std::fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCollector")
            .field("backend", &self.backend.name())
            .finish_non_exhaustive()
    }
}

impl NodeCollector {
    /// `mps` counts the node's MPS daemons (`None` leaves that gauge out).
    pub fn new(checkpoint: CheckpointView, backend: Arc<dyn GpuBackend>, mps: Option<MpsManager>) -> Self {
        Self {
            checkpoint,
            backend,
            mps,
            health: None,
            host_proc: None,
        }
    }

    /// Attributes shares' processes through the host's `/proc` at `host_proc` (see the module comment).
    pub fn with_host_proc(mut self, host_proc: HostProc) -> Self {
        self.host_proc = Some(host_proc);
        self
    }

    /// Adds `tessera_plugin_device_healthy` from the device health model.
    pub fn with_health(mut self, health: Arc<crate::gpu::health::Health>) -> Self {
        self.health = Some(health);
        self
    }
}

/// `tessera_plugin_mps_daemon_up` samples: one per device with completed MPS shares in `checkpoint`.
fn mps_daemons_up(checkpoint: &crate::node::checkpoint::Checkpoint, mps: &MpsManager) -> Vec<(Labels, f64)> {
    let keys: std::collections::BTreeSet<String> = checkpoint
        .claims
        .values()
        .filter(|c| c.phase == crate::node::checkpoint::Phase::PrepareCompleted)
        .flat_map(|c| &c.devices)
        .filter_map(|d| match &d.detail {
            DeviceDetail::Shared(s) if s.strategy.as_deref() != Some("TimeSlicing") => {
                let device = d.device.parse().ok()?;
                // Each namespace's daemon of the device, as the share's pipe directory names it.
                Some(crate::devices::sharing::daemon_key_of_share(
                    &device,
                    s.mps_pipe_dir.as_deref(),
                ))
            }
            _ => None,
        })
        .collect();
    keys.into_iter()
        .map(|key| {
            let up = if mps.is_running(&key) { 1.0 } else { 0.0 };
            (vec![("device", key)], up)
        })
        .collect()
}

/// One claim device's usage, ready to be a sample.
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimUsage {
    pub namespace: String,
    pub pod: String,
    pub claim: String,
    pub request: String,
    pub device: String,
    pub utilization_ratio: Option<f64>,
    pub memory_used_bytes: Option<u64>,
    /// The part of the GPU's SMs the device was given (see [`compute_share`]): its ceiling.
    pub compute_share_ratio: Option<f64>,
    /// The part of the GPU's SMs the scheduler packed for it (see [`compute_request`]).
    pub compute_request_ratio: Option<f64>,
}

impl ClaimUsage {
    fn labels(&self) -> Labels {
        vec![
            ("namespace", self.namespace.clone()),
            ("pod", self.pod.clone()),
            ("claim", self.claim.clone()),
            ("request", self.request.clone()),
            ("device", self.device.clone()),
        ]
    }
}

/// The usage of every device of every prepared claim in `checkpoint` (see the module comment for how usage
/// is attributed). A device whose usage cannot be read is left out, and logged.
pub fn claim_usage(
    checkpoint: &Checkpoint,
    backend: &dyn GpuBackend,
    pods_of: impl Fn(&str) -> String,
) -> Vec<ClaimUsage> {
    claim_usage_attributed(checkpoint, backend, pods_of, &Attribution::default())
}

/// UIDs of the pods a claim (by UID) is reserved for.
pub type PodUidsOf<'a> = &'a dyn Fn(&str) -> Vec<String>;

/// How a share's processes are told apart when the backend names no owner (NVML never does).
#[derive(Default)]
pub struct Attribution<'a> {
    /// The host's `/proc`, where NVML's PIDs are.
    pub host_proc: Option<&'a HostProc>,
    pub pod_uids_of: Option<PodUidsOf<'a>>,
}

impl Attribution<'_> {
    /// True when process `p` is claim `record`'s on `device`: its environment says so, or its pod is one
    /// the claim is reserved for and no other claim of that pod holds the device (then the claim is
    /// ambiguous, and the process counts for none).
    fn owns(
        &self,
        p: &ProcessUsage,
        identity: &ProcessIdentity,
        record: &crate::node::checkpoint::ClaimRecord,
        device: &str,
        checkpoint: &Checkpoint,
    ) -> bool {
        let claim_key = format!("{}/{}", record.namespace, record.name);
        if let Some(o) = p.owner.as_ref().or(identity.owner.as_ref()) {
            return o.claim == claim_key && o.device == device;
        }
        let (Some(pod), Some(pod_uids_of)) = (&identity.pod_uid, self.pod_uids_of) else {
            return false;
        };
        let mut holders = checkpoint
            .claims
            .values()
            .filter(|r| r.phase == Phase::PrepareCompleted)
            .filter(|r| r.devices.iter().any(|d| d.device == device))
            .filter(|r| pod_uids_of(&r.uid).contains(pod));
        matches!((holders.next(), holders.next()), (Some(only), None) if only.uid == record.uid)
    }
}

/// [`claim_usage`] with shares' processes attributed through the host's `/proc` (see [`Attribution`]).
pub fn claim_usage_attributed(
    checkpoint: &Checkpoint,
    backend: &dyn GpuBackend,
    pods_of: impl Fn(&str) -> String,
    attribution: &Attribution<'_>,
) -> Vec<ClaimUsage> {
    let mut identities: HashMap<u32, ProcessIdentity> = HashMap::new();
    /// GPU, MIG ids and device name: what one backend read answers.
    type Target = (u32, Option<(u32, u32)>, String);
    let mut read: BTreeMap<Target, Option<DeviceUsage>> = BTreeMap::new();
    let mut out = Vec::new();
    for record in checkpoint
        .claims
        .values()
        .filter(|r| r.phase == Phase::PrepareCompleted)
    {
        for device in &record.devices {
            let (gpu, mig, shared) = match &device.detail {
                DeviceDetail::Gpu { gpu, .. } => (*gpu, None, false),
                DeviceDetail::Mig(m) => match (m.gpu_instance, m.compute_instance) {
                    (Some(gi), Some(ci)) => (m.gpu, Some((gi, ci)), false),
                    _ => continue,
                },
                DeviceDetail::Shared(s) => {
                    let mig = s
                        .mig
                        .as_ref()
                        .and_then(|m| Some((m.gpu_instance?, m.compute_instance?)));
                    (s.gpu, mig, true)
                }
            };
            // Several shares of one device are read once per scrape.
            let usage = read
                .entry((gpu, mig, device.device.clone()))
                .or_insert_with(|| {
                    let query = UsageQuery {
                        gpu,
                        mig,
                        device: &device.device,
                    };
                    backend
                        .usage(&query)
                        .inspect_err(|e| {
                            tracing::debug!(device = %device.device, error = %e, "cannot read the device's usage")
                        })
                        .ok()
                })
                .clone();
            let Some(usage) = usage else { continue };
            let (utilization_ratio, memory_used_bytes) = if shared {
                let own: Vec<_> = usage
                    .processes
                    .iter()
                    .filter(|p| {
                        let identity = match (&p.owner, attribution.host_proc) {
                            (None, Some(host)) => identities
                                .entry(p.pid)
                                .or_insert_with(|| host.identify(p.pid))
                                .clone(),
                            _ => ProcessIdentity::default(),
                        };
                        attribution.owns(p, &identity, record, &device.device, checkpoint)
                    })
                    .collect();
                (
                    usage.utilization_percent.map(|_| {
                        own.iter().filter_map(|p| p.sm_percent).sum::<u32>().min(100) as f64 / 100.0
                    }),
                    Some(own.iter().filter_map(|p| p.memory_used_bytes).sum()),
                )
            } else {
                (
                    usage.utilization_percent.map(|p| p as f64 / 100.0),
                    usage.memory_used_bytes,
                )
            };
            out.push(ClaimUsage {
                namespace: record.namespace.clone(),
                pod: pods_of(&record.uid),
                claim: record.name.clone(),
                request: device.request.clone(),
                device: device.device.clone(),
                utilization_ratio,
                memory_used_bytes,
                compute_share_ratio: compute_share(&device.detail),
                compute_request_ratio: compute_request(&device.detail),
            });
        }
    }
    out
}

/// The part of its GPU's SMs a prepared device was given, as a fraction: 1 for a whole GPU; for an MPS
/// share of a whole GPU its client limit (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`), else its daemon's default,
/// else all of it. None where no fixed part was given or none is measured beside it: MIG devices (NVML
/// reports no utilization there) and time-sliced shares (they take turns at the whole GPU).
pub fn compute_share(detail: &DeviceDetail) -> Option<f64> {
    match detail {
        DeviceDetail::Gpu { .. } => Some(1.0),
        DeviceDetail::Mig(_) => None,
        DeviceDetail::Shared(s) if s.mig.is_some() => None,
        DeviceDetail::Shared(s) => {
            if s.strategy.as_deref() != Some(tessera_api::policy::SharingStrategy::Mps.as_str()) {
                return None;
            }
            let percent = |name: &str| s.limits.get(name).and_then(|v| v.parse::<f64>().ok());
            let p = percent(crate::devices::sharing::CLIENT_THREAD_LIMIT)
                .or_else(|| percent(crate::devices::sharing::DAEMON_THREAD_LIMIT))
                .unwrap_or(100.0);
            Some((p / 100.0).clamp(0.0, 1.0))
        }
    }
}

/// The part of its GPU's SMs the scheduler packed for a prepared device, as a fraction: 1 for a whole GPU;
/// for a share of a whole GPU its consumed `compute` capacity ([`crate::devices::sharing::COMPUTE_REQUEST`]
/// in its checkpoint record). None where nothing was reserved (a share naming only memory, a share
/// prepared before the request was recorded) and on MIG devices (no utilization to relate to it).
pub fn compute_request(detail: &DeviceDetail) -> Option<f64> {
    match detail {
        DeviceDetail::Gpu { .. } => Some(1.0),
        DeviceDetail::Mig(_) => None,
        DeviceDetail::Shared(s) if s.mig.is_some() => None,
        DeviceDetail::Shared(s) => s
            .limits
            .get(crate::devices::sharing::COMPUTE_REQUEST)
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|p| *p > 0.0)
            .map(|p| (p / 100.0).clamp(0.0, 1.0)),
    }
}

/// One sample per device the health model knows: `device` as published (`gpu-1`, `gpu-0-mig-3g.40gb-4`).
fn device_health(status: &[tessera_api::inventory::DeviceHealth]) -> Vec<(Labels, f64)> {
    status
        .iter()
        .map(|d| {
            let device = match &d.mig {
                Some(m) => format!("gpu-{}-mig-{}-{}", d.gpu, m.profile, m.start),
                None => format!("gpu-{}", d.gpu),
            };
            let reason = d.reason.as_ref().map(reason_label).unwrap_or_default();
            let healthy = d.state == tessera_api::inventory::HealthState::Healthy;
            (
                vec![("device", device), ("reason", reason)],
                if healthy { 1.0 } else { 0.0 },
            )
        })
        .collect()
}

fn gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    samples: &[(Labels, f64)],
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, unit, ConstGauge::new(0.0).metric_type())?;
    for (labels, value) in samples {
        ConstGauge::new(*value).encode(metric.encode_family(labels)?)?;
    }
    Ok(())
}

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let checkpoint = (self.checkpoint)();
        let completed: Vec<_> = checkpoint
            .claims
            .values()
            .filter(|r| r.phase == Phase::PrepareCompleted)
            .collect();
        gauge(
            &mut encoder,
            "tessera_plugin_prepared_claims",
            "Claims prepared on this node.",
            None,
            &[(vec![], completed.len() as f64)],
        )?;
        let mut kinds = BTreeMap::from([("gpu", 0u32), ("mig", 0), ("shared", 0)]);
        for device in completed.iter().flat_map(|r| &r.devices) {
            let kind = match device.detail {
                DeviceDetail::Gpu { .. } => "gpu",
                DeviceDetail::Mig(_) => "mig",
                DeviceDetail::Shared(_) => "shared",
            };
            *kinds.entry(kind).or_default() += 1;
        }
        let by_kind: Vec<(Labels, f64)> = kinds
            .into_iter()
            .map(|(kind, n)| (vec![("kind", kind.to_string())], n as f64))
            .collect();
        gauge(
            &mut encoder,
            "tessera_plugin_prepared_devices",
            "Devices of the claims prepared on this node, by kind.",
            None,
            &by_kind,
        )?;
        let mut warm = BTreeMap::from([("mig", 0u32), ("mps", 0)]);
        for w in checkpoint.warm.values() {
            *warm.entry(crate::node::warm::kind(&w.detail)).or_default() += 1;
        }
        let warm: Vec<(Labels, f64)> = warm
            .into_iter()
            .map(|(kind, n)| (vec![("kind", kind.to_string())], n as f64))
            .collect();
        gauge(
            &mut encoder,
            "tessera_plugin_warm_devices",
            "Warm partitions held on this node for the next claim of their device, by kind.",
            None,
            &warm,
        )?;
        if let Some(mps) = &self.mps {
            gauge(
                &mut encoder,
                "tessera_plugin_mps_daemons",
                "MPS control daemons on this node that answer a query.",
                None,
                &[(vec![], mps.running().len() as f64)],
            )?;
            gauge(
                &mut encoder,
                "tessera_plugin_mps_daemon_up",
                "1 while the MPS daemon of a device with prepared MPS shares answers, 0 while it does not.",
                None,
                &mps_daemons_up(&(self.checkpoint)(), mps),
            )?;
        }

        if let Some(health) = &self.health {
            gauge(
                &mut encoder,
                "tessera_plugin_device_healthy",
                "1 while a GPU or MIG device is healthy, 0 while unhealthy (reason: xid, double_bit_ecc, gpu_lost, fabric).",
                None,
                &device_health(&health.status()),
            )?;
        }

        let m = metrics();
        m.forget_claims_not_in(&checkpoint);
        let pod_uids_of = |uid: &str| m.pod_uids_of(uid);
        let attribution = Attribution {
            host_proc: self.host_proc.as_ref(),
            pod_uids_of: Some(&pod_uids_of),
        };
        let usage = claim_usage_attributed(
            &checkpoint,
            self.backend.as_ref(),
            |uid| m.pods_of(uid),
            &attribution,
        );
        encode_claim_usage(&mut encoder, &usage)?;
        let pods_of = |uid: &str| {
            m.pods_of(uid)
                .split(',')
                .filter(|p| !p.is_empty())
                .map(String::from)
                .collect()
        };
        super::dcgm::encode(
            &mut encoder,
            &super::dcgm::claim_device_info(&checkpoint, pods_of),
        )
    }
}

/// The per-claim gauges: the autoscaling signal, named without the plugin prefix like the container
/// metrics (`container_*`) users already query.
fn encode_claim_usage(
    claims: &mut DescriptorEncoder<'_>,
    usage: &[ClaimUsage],
) -> Result<(), std::fmt::Error> {
    let utilization: Vec<(Labels, f64)> = usage
        .iter()
        .filter_map(|u| Some((u.labels(), u.utilization_ratio?)))
        .collect();
    gauge(
        claims,
        "tessera_claim_gpu_utilization_ratio",
        "GPU utilization of a claim's device, 0 to 1 of the device (a share: its own processes' SM use).",
        None,
        &utilization,
    )?;
    let memory: Vec<(Labels, f64)> = usage
        .iter()
        .filter_map(|u| Some((u.labels(), u.memory_used_bytes? as f64)))
        .collect();
    gauge(
        claims,
        "tessera_claim_gpu_memory_used",
        "GPU memory a claim's processes use on its device.",
        Some(&Unit::Bytes),
        &memory,
    )?;
    let share: Vec<(Labels, f64)> = usage
        .iter()
        .filter_map(|u| Some((u.labels(), u.compute_share_ratio?)))
        .collect();
    gauge(
        claims,
        "tessera_claim_gpu_compute_share_ratio",
        "The part of its GPU's SMs a claim's device was given: 1 for a whole GPU, an MPS share's active-thread percentage / 100.",
        None,
        &share,
    )?;
    gauge(
        claims,
        "tessera_claim_gpu_compute_ceiling_ratio",
        "What a claim's device may burst to, part of its GPU's SMs: 1 for a whole GPU, an MPS share's active-thread percentage / 100.",
        None,
        &share,
    )?;
    let request: Vec<(Labels, f64)> = usage
        .iter()
        .filter_map(|u| Some((u.labels(), u.compute_request_ratio?)))
        .collect();
    gauge(
        claims,
        "tessera_claim_gpu_compute_request_ratio",
        "The part of its GPU's SMs the scheduler packed for a claim's device: 1 for a whole GPU, a share's compute request / 100.",
        None,
        &request,
    )?;
    let of_request: Vec<(Labels, f64)> = usage
        .iter()
        .filter_map(|u| {
            let request = u.compute_request_ratio.filter(|r| *r > 0.0)?;
            Some((u.labels(), u.utilization_ratio? / request))
        })
        .collect();
    gauge(
        claims,
        "tessera_claim_gpu_request_utilization_ratio",
        "GPU utilization of a claim's device relative to its compute request; above 1 while a burstable share uses more than it reserved.",
        None,
        &of_request,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::checkpoint::{ClaimRecord, DeviceRecord};
    use crate::node::error::ClaimError;
    use tessera_sim_model::backend::{NodeSpec, SimulatedBackend};
    use tessera_sim_model::load as simulated_load;
    use tessera_sim_model::load::LoadEntry;

    /// A prepared claim of `devices` (`(request, device, detail)`), as the checkpoint records it.
    fn prepared(
        uid: &str,
        namespace: &str,
        name: &str,
        devices: Vec<(&str, &str, DeviceDetail)>,
    ) -> ClaimRecord {
        ClaimRecord {
            uid: uid.into(),
            namespace: namespace.into(),
            name: name.into(),
            phase: Phase::PrepareCompleted,
            devices: devices
                .into_iter()
                .map(|(request, device, detail)| DeviceRecord {
                    request: request.into(),
                    pool: "node-a".into(),
                    device: device.into(),
                    share_id: None,
                    cdi_device_ids: vec![],
                    detail,
                    warm_seconds: None,
                    cost_ms: None,
                })
                .collect(),
            recovery_error: None,
            completed_at: None,
        }
    }

    fn share_of(gpu: u32) -> DeviceDetail {
        DeviceDetail::Shared(
            serde_json::from_value(serde_json::json!({"gpu": gpu, "strategy": "MPS"})).unwrap(),
        )
    }

    fn load(device: &str, claim: Option<&str>, util: u32, memory_bytes: u64) -> LoadEntry {
        LoadEntry {
            device: device.into(),
            claim: claim.map(Into::into),
            utilization_percent: util,
            memory_bytes,
            ..LoadEntry::default()
        }
    }

    #[test]
    fn a_whole_gpu_reports_its_own_use_and_each_share_only_its_processes() {
        let dir = tempfile::tempdir().unwrap();
        let backend = SimulatedBackend::from_spec(
            "node-a",
            &NodeSpec::default().with_gpus("H100-SXM5-80GB", 2),
            dir.path(),
        )
        .unwrap();
        simulated_load::set(dir.path(), load("gpu-0", None, 60, 20 << 30)).unwrap();
        simulated_load::set(dir.path(), load("gpu-1-shared", Some("team/a"), 30, 4 << 30)).unwrap();
        simulated_load::set(dir.path(), load("gpu-1-shared", Some("team/b"), 15, 2 << 30)).unwrap();
        let mut checkpoint = Checkpoint::default();
        for record in [
            prepared(
                "u0",
                "team",
                "whole",
                vec![(
                    "gpu",
                    "gpu-0",
                    DeviceDetail::Gpu {
                        gpu: 0,
                        uuid: "GPU-0".into(),
                        minor: 0,
                    },
                )],
            ),
            prepared("ua", "team", "a", vec![("gpu", "gpu-1-shared", share_of(1))]),
            prepared("ub", "team", "b", vec![("gpu", "gpu-1-shared", share_of(1))]),
        ] {
            checkpoint.claims.insert(record.uid.clone(), record);
        }
        let usage = claim_usage(&checkpoint, &backend, |uid| format!("pod-of-{uid}"));

        let of = |claim: &str| usage.iter().find(|u| u.claim == claim).unwrap();
        assert_eq!(of("whole").utilization_ratio, Some(0.6));
        assert_eq!(of("whole").memory_used_bytes, Some(20 << 30));
        assert_eq!(of("a").utilization_ratio, Some(0.3));
        assert_eq!(of("a").memory_used_bytes, Some(4 << 30));
        assert_eq!(of("b").utilization_ratio, Some(0.15));
        assert_eq!(of("b").pod, "pod-of-ub");
    }

    /// Issue 22 item 6: NVML names PIDs only; the chart's plugin has no host PID namespace, so a share's
    /// processes are found through the host's /proc mounted into the pod and their pods' cgroups.
    #[test]
    fn a_shares_processes_are_found_by_their_pods_cgroup_under_either_driver_and_ambiguity_counts_for_none() {
        use tessera_gpu_api::usage::ProcFixture;
        let (pod_a, pod_b, pod_ab) = (
            "aaaaaaaa-0000-4000-8000-000000000001",
            "bbbbbbbb-0000-4000-8000-000000000002",
            "abababab-0000-4000-8000-000000000003",
        );
        let proc_fx = ProcFixture::new()
            .cgroupfs_v1(5001, "burstable", pod_a)
            .systemd_v2(5002, "besteffort", pod_b)
            .cgroupfs_v1(5003, "guaranteed", pod_ab)
            .file(5004, "cgroup", b"0::/system.slice/other.service\n");
        let host = proc_fx.host();
        let dir = tempfile::tempdir().unwrap();
        let backend = SimulatedBackend::from_spec(
            "node-a",
            &NodeSpec::default().with_gpus("H100-SXM5-80GB", 2),
            dir.path(),
        )
        .unwrap();
        for (pid, util, gib) in [(5001, 30, 4u64), (5002, 15, 2), (5003, 20, 1), (5004, 25, 8)] {
            let entry = LoadEntry {
                pid: Some(pid),
                ..load("gpu-1-shared", None, util, gib << 30)
            };
            simulated_load::set(dir.path(), entry).unwrap();
        }
        let mut checkpoint = Checkpoint::default();
        for (uid, name) in [("ua", "a"), ("ub", "b"), ("uc", "c"), ("ud", "d")] {
            let record = prepared(uid, "team", name, vec![("gpu", "gpu-1-shared", share_of(1))]);
            checkpoint.claims.insert(record.uid.clone(), record);
        }
        // Claims c and d are both reserved for pod_ab: its process could be either's.
        let reserved = |claim: &str| -> Vec<String> {
            match claim {
                "ua" => vec![pod_a.into()],
                "ub" => vec![pod_b.into()],
                "uc" | "ud" => vec![pod_ab.into()],
                _ => vec![],
            }
        };
        let attribution = Attribution {
            host_proc: Some(&host),
            pod_uids_of: Some(&reserved),
        };
        let usage = claim_usage_attributed(&checkpoint, &backend, |_| String::new(), &attribution);
        let of = |claim: &str| usage.iter().find(|u| u.claim == claim).unwrap().clone();
        assert_eq!(of("a").utilization_ratio, Some(0.3), "cgroupfs, cgroup v1");
        assert_eq!(of("a").memory_used_bytes, Some(4 << 30));
        assert_eq!(of("b").utilization_ratio, Some(0.15), "systemd, cgroup v2");
        assert_eq!(of("c").utilization_ratio, Some(0.0));
        assert_eq!(of("d").memory_used_bytes, Some(0));

        // Without the host's /proc (the chart before issue 22) every share reads 0.
        let blind = claim_usage(&checkpoint, &backend, |_| String::new());
        assert!(
            blind.iter().all(|u| u.utilization_ratio == Some(0.0)),
            "{blind:?}"
        );
    }

    #[test]
    fn per_claim_gauges_render_with_the_labels_an_autoscaler_selects_by() {
        #[derive(Debug)]
        struct Fixed(Vec<ClaimUsage>);
        impl Collector for Fixed {
            fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
                encode_claim_usage(&mut encoder, &self.0)
            }
        }
        let usage = ClaimUsage {
            namespace: "team".into(),
            pod: "app-0".into(),
            claim: "app-0-gpu-x1".into(),
            request: "gpu".into(),
            device: "gpu-1-shared".into(),
            utilization_ratio: Some(0.4),
            memory_used_bytes: Some(6 << 30),
            compute_share_ratio: Some(0.5),
            compute_request_ratio: Some(0.25),
        };
        let mig = ClaimUsage {
            device: "gpu-0-mig-3g.40gb-4".into(),
            utilization_ratio: None,
            compute_share_ratio: None,
            compute_request_ratio: None,
            ..usage.clone()
        };
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Fixed(vec![usage, mig])));
        let text = tessera_api::metrics::render(&registry);
        let parsed = tessera_api::metrics::exposition::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));

        let labels = [
            ("namespace", "team"),
            ("pod", "app-0"),
            ("claim", "app-0-gpu-x1"),
            ("request", "gpu"),
        ];
        let util = parsed.find("tessera_claim_gpu_utilization_ratio", &labels);
        assert_eq!(util.len(), 1, "a MIG device has no utilization series:\n{text}");
        assert_eq!(util[0].labels["device"], "gpu-1-shared");
        assert_eq!(util[0].value, 0.4);
        let memory = parsed.find("tessera_claim_gpu_memory_used_bytes", &labels);
        assert_eq!(memory.len(), 2, "{text}");
        assert_eq!(parsed.types["tessera_claim_gpu_utilization_ratio"], "gauge");
        assert_eq!(parsed.types["tessera_claim_gpu_memory_used_bytes"], "gauge");
        let share = parsed.find("tessera_claim_gpu_compute_share_ratio", &labels);
        assert_eq!(
            share.len(),
            1,
            "a MIG device has no compute share series:\n{text}"
        );
        assert_eq!(share[0].value, 0.5);
        let ceiling = parsed.find("tessera_claim_gpu_compute_ceiling_ratio", &labels);
        let request = parsed.find("tessera_claim_gpu_compute_request_ratio", &labels);
        let of_request = parsed.find("tessera_claim_gpu_request_utilization_ratio", &labels);
        assert_eq!(
            (ceiling.len(), request.len(), of_request.len()),
            (1, 1, 1),
            "{text}"
        );
        assert_eq!((ceiling[0].value, request[0].value), (0.5, 0.25));
        assert_eq!(
            of_request[0].value, 1.6,
            "a burstable share using 0.4 of the GPU on a 0.25 request reads above 1"
        );
    }

    #[test]
    fn a_devices_compute_request_is_its_consumed_compute_and_absent_where_none_was_reserved() {
        let share = |limits: &[(&str, &str)]| {
            let DeviceDetail::Shared(mut s) = share_of(1) else {
                unreachable!()
            };
            s.limits = limits
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            DeviceDetail::Shared(s)
        };
        let whole = DeviceDetail::Gpu {
            gpu: 0,
            uuid: "GPU-0".into(),
            minor: 0,
        };
        assert_eq!(compute_request(&whole), Some(1.0));
        let burstable = share(&[
            (crate::devices::sharing::COMPUTE_REQUEST, "30"),
            (crate::devices::sharing::CLIENT_THREAD_LIMIT, "80"),
        ]);
        assert_eq!(compute_request(&burstable), Some(0.3));
        assert_eq!(compute_share(&burstable), Some(0.8), "its ceiling");
        assert_eq!(compute_request(&share(&[])), None);
    }

    #[test]
    fn a_devices_compute_share_is_its_mps_limit_else_its_daemons_default_else_the_whole_gpu() {
        let mps = |limits: &[(&str, &str)]| {
            let DeviceDetail::Shared(mut s) = share_of(1) else {
                unreachable!()
            };
            s.strategy = Some("MPS".into());
            s.mps_pipe_dir = Some("/run/mps/gpu-1/pipe".into());
            s.limits = limits
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            DeviceDetail::Shared(s)
        };
        let whole = DeviceDetail::Gpu {
            gpu: 0,
            uuid: "GPU-0".into(),
            minor: 0,
        };
        assert_eq!(compute_share(&whole), Some(1.0));
        assert_eq!(
            compute_share(&mps(&[("activeThreadPercentage", "25")])),
            Some(0.25)
        );
        assert_eq!(
            compute_share(&mps(&[(crate::devices::sharing::DAEMON_THREAD_LIMIT, "50")])),
            Some(0.5),
            "without a limit of its own a client gets the daemon's default"
        );
        assert_eq!(compute_share(&mps(&[])), Some(1.0));
        let DeviceDetail::Shared(mut sliced) = share_of(1) else {
            unreachable!()
        };
        sliced.strategy = Some("TimeSlicing".into());
        assert_eq!(
            compute_share(&DeviceDetail::Shared(sliced)),
            None,
            "time slices give no fixed part"
        );
    }

    #[test]
    fn an_error_is_labelled_by_its_kind_in_snake_case() {
        let e = ClaimError::ClaimNotFound {
            namespace: "a".into(),
            name: "b".into(),
        };
        assert_eq!(reason_label(&e), "claim_not_found");
        assert_eq!(reason_label(&std::io::ErrorKind::NotFound), "not_found");
    }

    #[test]
    fn claim_operations_are_counted_by_result_and_reason_and_timed() {
        let m = PluginMetrics::new();
        let took = Duration::from_millis(3);
        Sink::claim_operation(&m, "prepare", took, None);
        let failed = ClaimError::ClaimNotFound {
            namespace: "a".into(),
            name: "b".into(),
        };
        Sink::claim_operation(&m, "prepare", took, Some(&failed));
        Sink::mig_operation(&m, "create_gpu_instance", took);
        let text = m.render();
        let parsed = tessera_api::metrics::exposition::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let ops = |result| {
            parsed.find(
                "tessera_plugin_claim_operations_total",
                &[("operation", "prepare"), ("result", result)],
            )[0]
            .value
        };
        assert_eq!((ops("success"), ops("error")), (1.0, 1.0), "{text}");
        let errors = parsed.find(
            "tessera_plugin_claim_errors_total",
            &[("operation", "prepare"), ("reason", "claim_not_found")],
        );
        assert_eq!(errors[0].value, 1.0, "{text}");
        let count = parsed.find(
            "tessera_plugin_claim_operation_duration_seconds_count",
            &[("operation", "prepare")],
        );
        assert_eq!(count[0].value, 2.0, "{text}");
        let mig = parsed.find(
            "tessera_plugin_mig_operation_duration_seconds_count",
            &[("operation", "create_gpu_instance")],
        );
        assert_eq!(mig[0].value, 1.0, "{text}");
    }
}
