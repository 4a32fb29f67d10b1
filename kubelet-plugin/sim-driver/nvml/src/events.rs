//! Event sets: `nvmlEventSetCreate`, `nvmlDeviceRegisterEvents`, `nvmlEventSetWait_v2`, `nvmlEventSetFree`.
//!
//! Events come from the simulated node's fault file (`simulated-health.json`), polled while a wait
//! lasts: an XID or double-bit ECC fault that appears after a GPU's registration is delivered once (the
//! XID number as `eventData`, the fault's GPU instance as `gpuInstanceId`, else 0xFFFFFFFF); while a
//! registered GPU is lost every wait answers GPU_IS_LOST at once. A reset of the GPU or a change of its
//! current MIG mode (the model's epoch) drops its registration silently, as the issue observed of real
//! drivers: events stop until the caller registers again.

use std::{
    collections::HashMap,
    ffi::{c_uint, c_ulonglong},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlEventTypeDoubleBitEccError,
    nvmlEventTypeXidCriticalError, nvmlReturn_t,
};
use tessera_sim_model::faults::{Fault, FaultKind};

use crate::{
    GPU_IS_LOST, Handle, INVALID_ARGUMENT, Lib, NO_INSTANCE, NOT_SUPPORTED, Out, R, TIMEOUT, answer, ffi,
    lib, model_err, out,
};

/// Event types the simulated GPUs raise.
const SUPPORTED: c_ulonglong =
    (nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError) as c_ulonglong;
/// How often a wait looks at the fault file: short next to the plugin's waits, long enough that an idle
/// node's waits cost little.
const POLL: Duration = Duration::from_millis(100);

struct Registration {
    gpu: u32,
    mask: c_ulonglong,
    epoch: u64,
    /// Faults already there (or delivered): not delivered again while they last.
    seen: Vec<Fault>,
}

#[derive(Default)]
struct EventSet {
    registrations: Vec<Registration>,
}

/// The event sets of one `nvmlInit`.
#[derive(Default)]
pub(crate) struct EventSets {
    next: Mutex<u32>,
    sets: Mutex<HashMap<u32, Arc<Mutex<EventSet>>>>,
}

impl EventSets {
    fn get(&self, set: nvmlEventSet_t) -> R<Arc<Mutex<EventSet>>> {
        let Some(Handle::EventSet(id)) = Handle::decode(set) else {
            return Err(INVALID_ARGUMENT);
        };
        self.sets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
            .ok_or(INVALID_ARGUMENT)
    }
}

fn faults_of(lib: &Lib) -> Vec<Fault> {
    // A fault file being rewritten or corrupt reads as no faults this round; the next poll sees it.
    lib.sim.health().faults().unwrap_or_default()
}

/// # Safety
/// `set` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let set = unsafe { Out::new(set) };
    answer(set, |lib| {
        let id = {
            let mut next = lib.events.next.lock().unwrap_or_else(|p| p.into_inner());
            *next += 1;
            *next
        };
        lib.events
            .sets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, Arc::default());
        Ok(Handle::EventSet(id).encode())
    })
}

/// # Safety
/// `types` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> nvmlReturn_t {
    // SAFETY: by the caller's contract.
    let types = unsafe { Out::new(types) };
    answer(types, |lib| {
        lib.gpu(device)?;
        Ok(SUPPORTED)
    })
}

/// Registers a whole GPU (MIG device handles cannot be: their events arrive on the parent).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let gpu = lib.gpu_or_not_supported(device)?;
        if types & !SUPPORTED != 0 {
            return Err(NOT_SUPPORTED);
        }
        let set = lib.events.get(set)?;
        let epoch = lib.sim.epoch(gpu).map_err(model_err)?;
        let mut set = set.lock().unwrap_or_else(|p| p.into_inner());
        // Registering a GPU again while its registration holds changes the mask only: an event raised
        // since the last wait stays pending, as it does in a real event set.
        if let Some(reg) = set
            .registrations
            .iter_mut()
            .find(|r| r.gpu == gpu && r.epoch == epoch)
        {
            reg.mask = types;
            return Ok(());
        }
        let seen = faults_of(&lib).into_iter().filter(|f| f.gpu == gpu).collect();
        set.registrations.retain(|r| r.gpu != gpu);
        set.registrations.push(Registration {
            gpu,
            mask: types,
            epoch,
            seen,
        });
        Ok(())
    })
}

/// One look at the faults: an event to deliver, GPU_IS_LOST, or nothing yet.
fn poll(lib: &Lib, set: &mut EventSet) -> R<Option<nvmlEventData_t>> {
    let epochs = lib.sim.epochs().map_err(model_err)?;
    set.registrations
        .retain(|r| epochs.get(r.gpu as usize) == Some(&r.epoch));
    let faults = faults_of(lib);
    for reg in &mut set.registrations {
        let mine: Vec<&Fault> = faults.iter().filter(|f| f.gpu == reg.gpu).collect();
        reg.seen.retain(|s| mine.contains(&s));
        if mine.iter().any(|f| f.kind == FaultKind::Lost) {
            return Err(GPU_IS_LOST);
        }
        for f in mine {
            if reg.seen.contains(f) {
                continue;
            }
            let (event_type, data) = match f.kind {
                FaultKind::Xid => (nvmlEventTypeXidCriticalError, f.xid.unwrap_or(999)),
                FaultKind::DoubleBitEcc => (nvmlEventTypeDoubleBitEccError, 0),
                _ => continue,
            };
            reg.seen.push(f.clone());
            if reg.mask & c_ulonglong::from(event_type) == 0 {
                continue;
            }
            return Ok(Some(nvmlEventData_t {
                device: Handle::Gpu(reg.gpu).encode(),
                eventType: event_type.into(),
                eventData: data.into(),
                gpuInstanceId: f.gpu_instance.unwrap_or(NO_INSTANCE),
                computeInstanceId: NO_INSTANCE,
            }));
        }
    }
    Ok(None)
}

/// # Safety
/// `data` is null or valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let set = lib.events.get(set)?;
        let deadline = Instant::now() + Duration::from_millis(timeout_ms.into());
        loop {
            let found = {
                let mut s = set.lock().unwrap_or_else(|p| p.into_inner());
                poll(&lib, &mut s)?
            };
            if let Some(event) = found {
                // SAFETY: by the caller's contract.
                return unsafe { out(data, event) };
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TIMEOUT);
            }
            std::thread::sleep(POLL.min(deadline - now));
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    ffi(|| {
        let lib = lib()?;
        let Some(Handle::EventSet(id)) = Handle::decode(set) else {
            return Err(INVALID_ARGUMENT);
        };
        lib.events
            .sets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id)
            .map(|_| ())
            .ok_or(INVALID_ARGUMENT)
    })
}
