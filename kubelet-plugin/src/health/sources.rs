//! The health sources: the simulated backend's fault file, and NVML's events plus a probe.

use std::time::Duration;

use tessera_api::inventory::HealthReason;
use tracing::{debug, warn};

use super::{
    Failure, HealthSource, Observation,
    xid::{Verdict, classify_xid},
};
use crate::gpu::simulated_health::{Fault, FaultKind, SimulatedHealth};

/// Reads the simulated fault file once a second (the running plugin notices an injection within about
/// that), reporting the complete set of failures each time.
pub struct SimulatedSource {
    faults: SimulatedHealth,
    extra_ignored_xids: Vec<u32>,
    started: bool,
    last_error: Option<String>,
}

impl SimulatedSource {
    pub fn new(faults: SimulatedHealth, extra_ignored_xids: Vec<u32>) -> Self {
        Self {
            faults,
            extra_ignored_xids,
            started: false,
            last_error: None,
        }
    }
}

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
    };
    Some(Failure {
        gpu: fault.gpu,
        gpu_instance: fault.gpu_instance,
        reason,
        xid: fault.xid.filter(|_| fault.kind == FaultKind::Xid),
        message,
    })
}

impl HealthSource for SimulatedSource {
    fn poll(&mut self, timeout: Duration) -> Vec<Observation> {
        if self.started {
            std::thread::sleep(timeout);
        }
        self.started = true;
        match self.faults.faults() {
            Ok(faults) => {
                self.last_error = None;
                let failures = faults
                    .iter()
                    .filter_map(|f| failure_of(f, &self.extra_ignored_xids))
                    .collect();
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

/// How often every GPU is asked whether it still answers: the probe catches a GPU that fell off the bus
/// without an event, and the only sign that a lost GPU is back.
pub const PROBE_EVERY: Duration = Duration::from_secs(10);

/// NVML's event set ([`crate::gpu::nvml_events`]) plus a periodic probe.
pub struct NvmlSource {
    backend: std::sync::Arc<crate::gpu::nvml::NvmlBackend>,
    gpu_count: u32,
    extra_ignored_xids: Vec<u32>,
    events: Option<crate::gpu::nvml_events::NvmlEvents>,
    last_probe: Option<std::time::Instant>,
    registration_error: Option<String>,
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
        }
    }

    fn probe(&mut self) -> Vec<Observation> {
        self.last_probe = Some(std::time::Instant::now());
        let Some(events) = &self.events else {
            return vec![];
        };
        (0..self.gpu_count)
            .map(|gpu| match events.probe(gpu) {
                Err(crate::gpu::GpuError::GpuLost(message)) => Observation::Failed(Failure {
                    gpu,
                    gpu_instance: None,
                    reason: HealthReason::GpuLost,
                    xid: None,
                    message,
                }),
                _ => Observation::Answering { gpu },
            })
            .collect()
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

impl HealthSource for NvmlSource {
    fn poll(&mut self, timeout: Duration) -> Vec<Observation> {
        use crate::gpu::nvml_events::{NvmlEvents, Waited};
        if self.events.is_none() {
            match NvmlEvents::register(self.backend.clone(), self.gpu_count, super::xid::EVENT_MASK) {
                Ok(events) => {
                    for (gpu, code) in &events.unmonitored {
                        warn!(
                            gpu,
                            code, "NVML cannot deliver this GPU's health events; only the probe watches it"
                        );
                    }
                    self.events = Some(events);
                }
                Err(e) => {
                    let e = e.to_string();
                    if self.registration_error.as_ref() != Some(&e) {
                        warn!(error = %e, "cannot create the NVML event set; retrying");
                        self.registration_error = Some(e);
                    }
                    std::thread::sleep(timeout);
                    return vec![];
                }
            }
        }
        let mut out = vec![];
        if self.last_probe.is_none_or(|t| t.elapsed() >= PROBE_EVERY) {
            out.extend(self.probe());
        }
        let Some(events) = self.events.as_mut() else {
            return out;
        };
        match events.wait(timeout.as_millis() as u32) {
            Waited::Event(event) => {
                out.extend(failure_of_event(&event, &self.extra_ignored_xids).map(Observation::Failed))
            }
            Waited::Timeout => {}
            // Which GPU is gone only the probe can tell.
            Waited::GpuLost => out.extend(self.probe()),
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
        use crate::health::xid::EVENT_XID_CRITICAL;
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
        use crate::health::xid::{EVENT_DOUBLE_BIT_ECC, EVENT_SINGLE_BIT_ECC};
        let f = failure_of_event(&event(EVENT_DOUBLE_BIT_ECC, 0, None), &[]).unwrap();
        assert_eq!((f.reason, f.xid), (HealthReason::DoubleBitEcc, None));
        assert_eq!(failure_of_event(&event(EVENT_SINGLE_BIT_ECC, 0, None), &[]), None);
    }

    #[test]
    fn simulated_faults_map_like_the_events_they_stand_for() {
        let lost = Fault::lost(1);
        assert_eq!(failure_of(&lost, &[]).unwrap().reason, HealthReason::GpuLost);
        let app = Fault::xid(1, 13);
        assert_eq!(failure_of(&app, &[]), None);
    }
}
