//! The health sources: the simulated backend's fault file, and NVML's events plus a probe.

use std::time::Duration;

use tessera_api::inventory::HealthReason;
use tracing::{debug, info, warn};

#[cfg(feature = "simulated")]
use super::xid::classify_xid;
use super::{Failure, HealthSource, Observation, xid::Verdict};
#[cfg(feature = "simulated")]
use tessera_sim_model::faults::{Fault, FaultKind, SimulatedHealth};

#[cfg(feature = "simulated")]
/// Reads the simulated fault file once a second (the running plugin notices an injection within about
/// that), reporting the complete set of failures each time.
pub struct SimulatedSource {
    faults: SimulatedHealth,
    extra_ignored_xids: Vec<u32>,
    started: bool,
    last_error: Option<String>,
    /// The simulated hardware, whose NVLink fabric is read as the NVML source reads a real one.
    fabric: Option<(tessera_sim_model::backend::SimulatedBackend, u32)>,
}

#[cfg(feature = "simulated")]
impl SimulatedSource {
    pub fn new(faults: SimulatedHealth, extra_ignored_xids: Vec<u32>) -> Self {
        Self {
            faults,
            extra_ignored_xids,
            started: false,
            last_error: None,
            fabric: None,
        }
    }

    /// Also reads the NVLink fabric of GPUs `0..gpu_count` of `hardware` every poll ([`fabric_observation`]
    /// of [`crate::gpu::nvml::fabric_verdict`]): a fabric still training (`fabricCompletesAfterMs` in the
    /// node file) or degraded (`simulate degrade-fabric`) is reported as the NVML source reports it.
    pub fn with_fabric(
        mut self,
        hardware: tessera_sim_model::backend::SimulatedBackend,
        gpu_count: u32,
    ) -> Self {
        self.fabric = Some((hardware, gpu_count));
        self
    }

    fn fabric_failures(&self) -> Vec<Failure> {
        let Some((hardware, count)) = &self.fabric else {
            return vec![];
        };
        (0..*count)
            .filter_map(|gpu| {
                let f = hardware.fabric(gpu).ok()??;
                let why = crate::gpu::nvml::fabric_verdict(
                    gpu,
                    f.state,
                    f.status,
                    Some(f.health_summary),
                    Some(f.health_mask),
                );
                match fabric_observation(gpu, why) {
                    Observation::Failed(failure) => Some(failure),
                    _ => None,
                }
            })
            .collect()
    }
}

#[cfg(feature = "simulated")]
/// The failure an injected fault stands for, or `None` for an XID that is not the GPU's fault.
pub fn failure_of(fault: &Fault, extra_ignored_xids: &[u32]) -> Option<Failure> {
    let (reason, message) = match fault.kind {
        FaultKind::Xid => {
            let xid = fault.xid?;
            if classify_xid(xid, extra_ignored_xids) == Verdict::Ignore {
                debug!(gpu = fault.gpu, xid, "application XID: the GPU stays healthy");
                return None;
            }
            (
                HealthReason::Xid,
                format!("critical XID {xid} on GPU {}", fault.gpu),
            )
        }
        FaultKind::DoubleBitEcc => (
            HealthReason::DoubleBitEcc,
            format!("double-bit ECC error on GPU {}", fault.gpu),
        ),
        FaultKind::Lost => (
            HealthReason::GpuLost,
            format!("GPU {} is lost (NVML_ERROR_GPU_IS_LOST)", fault.gpu),
        ),
        // A GPU that answers every call with an NVML error is as unusable as a lost one; the message is the
        // NVML source's, which says what to do.
        FaultKind::LibraryMismatch | FaultKind::DriverNotLoaded | FaultKind::Uninitialized => {
            let code = fault.kind.nvml_error_code().unwrap_or(999);
            let message = unanswered(fault.gpu, code, "")
                .map(|f| f.message)
                .unwrap_or_else(|| format!("GPU {} answers NVML error {code}", fault.gpu));
            (HealthReason::GpuLost, message)
        }
        // They change what the GPU's fabric reports, which [`SimulatedSource::with_fabric`] reads (a GPU
        // without a fabric has nothing to degrade).
        FaultKind::FabricDegraded | FaultKind::FabricUnhealthy => return None,
    };
    Some(Failure {
        gpu: fault.gpu,
        gpu_instance: fault.gpu_instance,
        reason,
        xid: fault.xid.filter(|_| fault.kind == FaultKind::Xid),
        message,
    })
}

#[cfg(feature = "simulated")]
impl HealthSource for SimulatedSource {
    fn poll(&mut self, timeout: Duration) -> Vec<Observation> {
        if self.started {
            std::thread::sleep(timeout);
        }
        self.started = true;
        match self.faults.faults() {
            Ok(faults) => {
                self.last_error = None;
                let mut failures: Vec<Failure> = faults
                    .iter()
                    .filter_map(|f| failure_of(f, &self.extra_ignored_xids))
                    .collect();
                failures.extend(self.fabric_failures());
                vec![Observation::Exactly(failures)]
            }
            Err(e) => {
                // Logged once per distinct error: the poll runs every second.
                let e = e.to_string();
                if self.last_error.as_ref() != Some(&e) {
                    warn!(error = %e, "cannot read the simulated faults; health left as it was");
                    self.last_error = Some(e);
                }
                vec![]
            }
        }
    }
}

/// How often every GPU is asked whether it still answers and how its NVLink fabric is: the probe catches
/// a GPU that fell off the bus without an event, a driver the library no longer matches, is the only sign
/// that a lost GPU is back, and the only way a fabric that completes after the plugin started (or degrades
/// later) is seen: NVML has no event for either.
pub const PROBE_EVERY: Duration = Duration::from_secs(10);

/// The failure of a GPU that answers NVML with `code`, with what to do about it; `None` for codes that
/// leave the GPU usable (an unsupported query, a timeout). GPU_IS_LOST and the three codes NVML gives when
/// the driver under it changed or went away count: a GPU NVML cannot reach is one no claim can use.
/// They all read as [`HealthReason::GpuLost`] (the GPU does not answer), and clear when it answers again.
pub fn unanswered(gpu: u32, code: u32, detail: &str) -> Option<Failure> {
    let what = match code {
        15 => format!(
            "GPU {gpu} is lost (NVML_ERROR_GPU_IS_LOST): it fell off the bus; reset it (`nvidia-smi -r -i \
             {gpu}`) or reboot the node"
        ),
        18 => format!(
            "GPU {gpu} answers NVML_ERROR_LIB_RM_VERSION_MISMATCH (18): the NVIDIA kernel module and the \
             NVML library are of different driver versions, as after a driver upgrade without a reboot; \
             reboot the node (or reload the kernel module), then restart the plugin pod so it loads the \
             new library"
        ),
        9 => format!(
            "GPU {gpu} answers NVML_ERROR_DRIVER_NOT_LOADED (9): the NVIDIA kernel module is not loaded (or \
             was unloaded for a driver upgrade); load it (`modprobe nvidia`, or let the GPU Operator's \
             driver pod finish), then restart the plugin pod"
        ),
        1 => format!(
            "GPU {gpu} answers NVML_ERROR_UNINITIALIZED (1): the plugin's NVML session is no longer \
             initialised (the driver was restarted under it); restart the plugin pod"
        ),
        _ => return None,
    };
    let message = if detail.is_empty() {
        what
    } else {
        format!("{what} ({detail})")
    };
    Some(Failure {
        gpu,
        gpu_instance: None,
        reason: HealthReason::GpuLost,
        xid: None,
        message,
    })
}

/// How often the event set is registered again even when nothing said it went stale: the only cure for
/// a GPU reset made outside the plugin, at the cost of one registration per GPU.
pub const REREGISTER_EVERY: Duration = Duration::from_secs(300);

/// NVML's event set ([`crate::gpu::nvml_events`]) plus a periodic probe.
///
/// The event set is registered again whenever it may have stopped delivering: after the plugin changed a
/// GPU's MIG mode (a toggle may reset the GPU), after an `nvmlEventMigConfigChange`, when a GPU that did
/// not answer the probe answers again, and every [`REREGISTER_EVERY`] (a reset nobody told the plugin of,
/// `nvidia-smi -r` after an XID, drops a GPU's registration too). A GPU that does not answer is left out
/// of the set, so its `GPU_IS_LOST` does not end every wait at once for the others.
pub struct NvmlSource {
    backend: std::sync::Arc<crate::gpu::nvml::NvmlBackend>,
    gpu_count: u32,
    extra_ignored_xids: Vec<u32>,
    events: Option<crate::gpu::nvml_events::NvmlEvents>,
    last_probe: Option<std::time::Instant>,
    registration_error: Option<String>,
    /// GPUs the last probe found not answering.
    not_answering: std::collections::BTreeSet<u32>,
    registered_at: Option<std::time::Instant>,
    reregister_every: Duration,
    /// Set when the set may have stopped delivering (see the type's doc); registered again next poll.
    needs_registration: bool,
    probe_every: Duration,
}

impl NvmlSource {
    pub fn new(
        backend: std::sync::Arc<crate::gpu::nvml::NvmlBackend>,
        gpu_count: u32,
        extra_ignored_xids: Vec<u32>,
    ) -> Self {
        Self {
            backend,
            gpu_count,
            extra_ignored_xids,
            events: None,
            last_probe: None,
            registration_error: None,
            not_answering: Default::default(),
            registered_at: None,
            reregister_every: REREGISTER_EVERY,
            needs_registration: false,
            probe_every: PROBE_EVERY,
        }
    }

    /// Probes every GPU this often instead of every [`PROBE_EVERY`].
    pub fn probe_every(mut self, every: Duration) -> Self {
        self.probe_every = every;
        self
    }

    /// Registers the event set again at least this often (see [`REREGISTER_EVERY`]).
    pub fn reregister_every(mut self, every: Duration) -> Self {
        self.reregister_every = every;
        self
    }

    /// The GPUs the current event set delivers events of (empty before the first poll).
    pub fn registered(&self) -> Vec<u32> {
        self.events
            .as_ref()
            .map(|e| e.registered().collect())
            .unwrap_or_default()
    }

    fn probe(&mut self) -> Vec<Observation> {
        self.last_probe = Some(std::time::Instant::now());
        let mut out = Vec::new();
        let mut changed = false;
        for gpu in 0..self.gpu_count {
            let failure = match crate::gpu::nvml_events::probe(&self.backend, gpu) {
                Ok(()) => None,
                Err(e) => unanswered(gpu, e.code, &e.message).or_else(|| {
                    debug!(gpu, code = e.code, error = %e.message, "probe error that leaves the GPU usable");
                    None
                }),
            };
            match failure {
                Some(f) => {
                    changed |= self.not_answering.insert(gpu);
                    out.push(Observation::Failed(f));
                }
                None => {
                    if self.not_answering.remove(&gpu) {
                        info!(gpu, "the GPU answers again; registering its health events again");
                        changed = true;
                    }
                    out.push(Observation::Answering { gpu });
                    out.push(fabric_observation(gpu, self.backend.fabric_problem(gpu)));
                }
            }
        }
        if changed {
            self.needs_registration = true;
        }
        out
    }

    /// Registers a new event set; the old one (if any) is drained of what it already holds before it is
    /// freed, so no event is lost in the change.
    fn register(&mut self, timeout: Duration, out: &mut Vec<Observation>) -> bool {
        use crate::gpu::nvml_events::NvmlEvents;
        let gpus: Vec<u32> = (0..self.gpu_count)
            .filter(|g| !self.not_answering.contains(g))
            .collect();
        let mask = super::xid::EVENT_MASK | super::xid::EVENT_MIG_CONFIG_CHANGE;
        match NvmlEvents::register(self.backend.clone(), gpus, mask) {
            Ok(events) => {
                for &(gpu, code) in &events.unmonitored {
                    // A GPU that cannot even be registered because it does not answer is reported now,
                    // not at the next probe, and left out until it answers again.
                    if let Some(f) = unanswered(gpu, code, "its health events cannot be registered") {
                        self.not_answering.insert(gpu);
                        out.push(Observation::Failed(f));
                        continue;
                    }
                    warn!(
                        gpu,
                        code, "NVML cannot deliver this GPU's health events; only the probe watches it"
                    );
                }
                self.registration_error = None;
                self.registered_at = Some(std::time::Instant::now());
                if let Some(mut old) = self.events.replace(events) {
                    for _ in 0..64 {
                        match old.wait(0) {
                            crate::gpu::nvml_events::Waited::Event(e) => out.extend(
                                failure_of_event(&e, &self.extra_ignored_xids).map(Observation::Failed),
                            ),
                            _ => break,
                        }
                    }
                }
                true
            }
            Err(e) => {
                let e = e.to_string();
                if self.registration_error.as_ref() != Some(&e) {
                    warn!(error = %e, "cannot create the NVML event set; retrying");
                    self.registration_error = Some(e);
                }
                std::thread::sleep(timeout);
                false
            }
        }
    }
}

/// What the probe reports of a GPU's fabric: [`HealthReason::Fabric`] while `problem` says why it is not
/// fit for work (still training, or reporting itself unhealthy), else that it is ready. A GPU whose fabric
/// is not ready stays published and is tainted `NoSchedule` instead of being left out, so it is offered
/// once its fabric completes and a claim already prepared on it is never pulled from under its pod.
pub fn fabric_observation(gpu: u32, problem: Option<String>) -> Observation {
    match problem {
        Some(message) => Observation::Failed(Failure {
            gpu,
            gpu_instance: None,
            reason: HealthReason::Fabric,
            xid: None,
            message,
        }),
        None => Observation::FabricReady { gpu },
    }
}

/// The failure an NVML event stands for, or `None` when it is only logged.
pub fn failure_of_event(
    event: &crate::gpu::nvml_events::RawEvent,
    extra_ignored_xids: &[u32],
) -> Option<Failure> {
    use super::xid::{EVENT_XID_CRITICAL, classify};
    let Verdict::Unhealthy(reason) = classify(event.event_type, event.data, extra_ignored_xids) else {
        debug!(?event, "NVML event that leaves the device healthy");
        return None;
    };
    let xid = (event.event_type & EVENT_XID_CRITICAL != 0 && reason == HealthReason::Xid)
        .then(|| u32::try_from(event.data).unwrap_or(super::xid::UNKNOWN_XID));
    let message = match (reason, xid) {
        (HealthReason::Xid, Some(xid)) => format!("critical XID {xid} on GPU {}", event.gpu),
        _ => format!("double-bit ECC error on GPU {}", event.gpu),
    };
    Some(Failure {
        gpu: event.gpu,
        gpu_instance: event.gpu_instance,
        reason,
        xid,
        message,
    })
}

/// The failures of an event NVML delivered for a device it could not name (its UUID did not answer):
/// charged to every GPU, as NVIDIA's DRA driver does, rather than dropped.
pub fn failures_of_unattributed(
    event_type: u64,
    data: u64,
    gpus: impl IntoIterator<Item = u32>,
    extra_ignored_xids: &[u32],
) -> Vec<Failure> {
    gpus.into_iter()
        .filter_map(|gpu| {
            let event = crate::gpu::nvml_events::RawEvent {
                gpu,
                event_type,
                data,
                gpu_instance: None,
            };
            let mut f = failure_of_event(&event, extra_ignored_xids)?;
            f.message = format!(
                "{} (NVML could not name the GPU of the event, so every GPU is marked)",
                f.message
            );
            Some(f)
        })
        .collect()
}

impl HealthSource for NvmlSource {
    fn poll(&mut self, timeout: Duration) -> Vec<Observation> {
        use crate::gpu::nvml_events::Waited;
        let mut out = vec![];
        let stale = self.events.as_ref().is_some_and(|e| e.stale());
        if stale {
            info!("a GPU's MIG mode changed; registering the health events again");
        }
        let due = self
            .registered_at
            .is_some_and(|t| t.elapsed() >= self.reregister_every);
        let needed = std::mem::take(&mut self.needs_registration);
        if (self.events.is_none() || stale || due || needed) && !self.register(timeout, &mut out) {
            self.needs_registration = needed;
            return out;
        }
        if self.last_probe.is_none_or(|t| t.elapsed() >= self.probe_every) {
            out.extend(self.probe());
        }
        let Some(events) = self.events.as_mut() else {
            return out;
        };
        match events.wait(timeout.as_millis() as u32) {
            Waited::Event(event) => {
                if event.event_type & super::xid::EVENT_MIG_CONFIG_CHANGE != 0 {
                    info!(
                        gpu = event.gpu,
                        "MIG configuration changed; registering the health events again"
                    );
                    self.needs_registration = true;
                }
                out.extend(failure_of_event(&event, &self.extra_ignored_xids).map(Observation::Failed))
            }
            Waited::Unattributed { event_type, data } => {
                warn!(
                    event_type,
                    data, "NVML event for a device it cannot name; charging every GPU"
                );
                out.extend(
                    failures_of_unattributed(event_type, data, 0..self.gpu_count, &self.extra_ignored_xids)
                        .into_iter()
                        .map(Observation::Failed),
                )
            }
            Waited::Timeout => {}
            // Which GPU is gone only the probe can tell (and it leaves that GPU out of the next set). The
            // wait answers GPU_IS_LOST at once while a lost GPU is in the set: without the pause this loop
            // would spin a core until the node is rebooted.
            Waited::GpuLost => {
                out.extend(self.probe());
                std::thread::sleep(timeout);
            }
            Waited::Failed(code) => {
                warn!(code, "nvmlEventSetWait_v2 failed; probing every GPU");
                out.extend(self.probe());
                std::thread::sleep(timeout);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::nvml_events::RawEvent;

    fn event(event_type: u64, data: u64, gpu_instance: Option<u32>) -> RawEvent {
        RawEvent {
            gpu: 2,
            event_type,
            data,
            gpu_instance,
        }
    }

    #[test]
    fn a_critical_xid_event_keeps_its_number_and_gpu_instance() {
        use crate::gpu::health::xid::EVENT_XID_CRITICAL;
        let f = failure_of_event(&event(EVENT_XID_CRITICAL, 79, Some(3)), &[]).unwrap();
        assert_eq!(
            (f.gpu, f.gpu_instance, f.reason, f.xid),
            (2, Some(3), HealthReason::Xid, Some(79))
        );
        assert_eq!(f.message, "critical XID 79 on GPU 2");
        assert_eq!(failure_of_event(&event(EVENT_XID_CRITICAL, 43, None), &[]), None);
        assert_eq!(
            failure_of_event(&event(EVENT_XID_CRITICAL, 79, None), &[79]),
            None
        );
    }

    #[test]
    fn an_ecc_event_is_a_double_bit_failure_and_a_single_bit_one_is_none() {
        use crate::gpu::health::xid::{EVENT_DOUBLE_BIT_ECC, EVENT_SINGLE_BIT_ECC};
        let f = failure_of_event(&event(EVENT_DOUBLE_BIT_ECC, 0, None), &[]).unwrap();
        assert_eq!((f.reason, f.xid), (HealthReason::DoubleBitEcc, None));
        assert_eq!(failure_of_event(&event(EVENT_SINGLE_BIT_ECC, 0, None), &[]), None);
    }

    #[test]
    fn nvml_errors_after_a_driver_change_make_the_gpu_unhealthy_with_what_to_do() {
        // Defect: only GPU_IS_LOST (15) counted; 18 after a driver upgrade left GPUs published healthy.
        for (code, hint) in [
            (18, "reboot"),
            (9, "modprobe"),
            (1, "restart the plugin"),
            (15, "reset"),
        ] {
            let f = unanswered(3, code, "detail").unwrap();
            assert_eq!((f.gpu, f.reason), (3, HealthReason::GpuLost));
            assert!(
                f.message.contains(&format!("({code})")) || code == 15,
                "{}",
                f.message
            );
            assert!(f.message.contains(hint), "{hint}: {}", f.message);
        }
        assert_eq!(unanswered(3, 3, ""), None, "NOT_SUPPORTED leaves the GPU usable");
    }

    #[test]
    fn a_fabric_not_fit_for_work_is_a_fabric_failure_and_a_fit_one_clears_it() {
        let Observation::Failed(f) = fabric_observation(4, Some("training".into())) else {
            panic!("a fabric problem is a failure");
        };
        assert_eq!(
            (f.gpu, f.gpu_instance, f.reason, f.message.as_str()),
            (4, None, HealthReason::Fabric, "training")
        );
        assert_eq!(fabric_observation(4, None), Observation::FabricReady { gpu: 4 });
    }

    #[test]
    fn an_event_nvml_cannot_attribute_is_charged_to_every_gpu_not_dropped() {
        use crate::gpu::health::xid::EVENT_XID_CRITICAL;
        let f = failures_of_unattributed(EVENT_XID_CRITICAL, 79, 0..3, &[]);
        assert_eq!(f.iter().map(|f| f.gpu).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(f.iter().all(|f| f.xid == Some(79)));
        assert!(failures_of_unattributed(EVENT_XID_CRITICAL, 13, 0..3, &[]).is_empty());
    }

    #[cfg(feature = "simulated")]
    #[test]
    fn simulated_faults_map_like_the_events_they_stand_for() {
        let lost = Fault::lost(1);
        assert_eq!(failure_of(&lost, &[]).unwrap().reason, HealthReason::GpuLost);
        let app = Fault::xid(1, 13);
        assert_eq!(failure_of(&app, &[]), None);
    }

    #[cfg(feature = "simulated")]
    #[test]
    fn the_simulated_source_reports_a_training_fabric_until_it_completes_and_a_degraded_one() {
        use tessera_sim_model::backend::{FabricState, GpuGroup, NodeSpec, SimulatedBackend};
        let dir = tempfile::tempdir().unwrap();
        let spec = NodeSpec::default()
            .with_group(GpuGroup {
                fabric: FabricState::InProgress,
                fabric_completes_after_ms: Some(3_600_000),
                ..GpuGroup::plain("H100-SXM5-80GB")
            })
            .with_gpus("H100-SXM5-80GB", 1);
        let hardware = SimulatedBackend::from_spec("n", &spec, dir.path()).unwrap();
        let faults = SimulatedHealth::new(dir.path(), 2);
        let mut source = SimulatedSource::new(faults.clone(), vec![]).with_fabric(hardware, 2);
        let failures = |source: &mut SimulatedSource| match source.poll(Duration::ZERO).pop() {
            Some(Observation::Exactly(f)) => f,
            other => panic!("{other:?}"),
        };
        let training = failures(&mut source);
        assert_eq!(training.len(), 1, "{training:?}");
        assert_eq!((training[0].gpu, training[0].reason), (0, HealthReason::Fabric));
        assert!(
            training[0].message.contains("in progress"),
            "{}",
            training[0].message
        );

        std::fs::File::options()
            .write(true)
            .open(dir.path().join("kernel.json"))
            .unwrap()
            .set_modified(std::time::SystemTime::now() - Duration::from_secs(7_200))
            .unwrap();
        assert_eq!(failures(&mut source), [], "completed and healthy");
        faults
            .inject(Fault::failing(0, FaultKind::FabricDegraded))
            .unwrap();
        faults
            .inject(Fault::failing(1, FaultKind::FabricDegraded))
            .unwrap();
        let degraded = failures(&mut source);
        assert_eq!(
            degraded.iter().map(|f| f.gpu).collect::<Vec<_>>(),
            [0],
            "GPU 1 has no fabric to degrade"
        );
        assert!(
            degraded[0].message.contains("LIMITED_CAPACITY"),
            "{}",
            degraded[0].message
        );
    }
}
