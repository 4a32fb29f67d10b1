//! NVML's event set for device health: `nvmlEventSetCreate`, `nvmlDeviceRegisterEvents` per physical
//! GPU, `nvmlEventSetWait_v2` (which, unlike nvml-wrapper's `EventSet::wait`, keeps the GPU-instance id a
//! MIG device's event carries), `nvmlEventSetFree`. MIG device handles cannot be registered; their events
//! arrive on the parent with `gpuInstanceId` set (`gpu-mig-mps.md` 10.1, from `nvml.h`).
//!
//! Needs hardware, like the rest of the NVML backend; the calls follow `nvml_raw`'s pattern (symbols
//! resolved through nvml-wrapper's table, a missing one is an error, return codes checked).
#![allow(
    unsafe_code,
    reason = "raw NVML event calls: nvml-wrapper's EventSet drops the GPU-instance id"
)]

use std::{ptr, sync::Arc};

use nvml_wrapper::{error::NvmlError, error::nvml_sym};
use nvml_wrapper_sys::bindings::{nvmlEventData_t, nvmlEventSet_t, nvmlReturn_t};

use super::{GpuError, Result, nvml::NvmlBackend};

const NVML_SUCCESS: nvmlReturn_t = 0;
const NVML_ERROR_NOT_SUPPORTED: nvmlReturn_t = 3;
const NVML_ERROR_TIMEOUT: nvmlReturn_t = 10;
/// `NVML_ERROR_GPU_IS_LOST`.
pub const NVML_ERROR_GPU_IS_LOST: nvmlReturn_t = 15;
/// `gpuInstanceId` of an event not attributable to a MIG device.
const NO_INSTANCE: u32 = 0xFFFF_FFFF;

/// One event as NVML delivered it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawEvent {
    pub gpu: u32,
    pub event_type: u64,
    pub data: u64,
    pub gpu_instance: Option<u32>,
}

/// What one wait returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waited {
    Event(RawEvent),
    Timeout,
    /// `NVML_ERROR_GPU_IS_LOST`: some GPU fell off the bus; the probe tells which.
    GpuLost,
    Failed(u32),
}

/// A registered event set; freed on drop.
pub struct NvmlEvents {
    backend: Arc<NvmlBackend>,
    set: nvmlEventSet_t,
    /// GPUs whose events could not be registered, with NVML's return code (3: not supported).
    pub unmonitored: Vec<(u32, u32)>,
}

// SAFETY: an event set is a handle NVML lets any thread wait on (NVML is thread-safe); it is only used
// through `&mut self`, so one thread at a time.
unsafe impl Send for NvmlEvents {}

impl NvmlEvents {
    /// Registers `mask` (masked by what each GPU supports) on GPUs `0..gpu_count`.
    pub fn register(backend: Arc<NvmlBackend>, gpu_count: u32, mask: u64) -> Result<Self> {
        let nvml = backend.nvml();
        let call = |name: &'static str, code: nvmlReturn_t| GpuError::Nvml { call: name, code };
        let sym_err = |name: &'static str| move |_| call(name, 13);
        let create =
            nvml_sym(nvml.lib().nvmlEventSetCreate.as_ref()).map_err(sym_err("nvmlEventSetCreate"))?;
        let register = nvml_sym(nvml.lib().nvmlDeviceRegisterEvents.as_ref())
            .map_err(sym_err("nvmlDeviceRegisterEvents"))?;
        let supported = nvml_sym(nvml.lib().nvmlDeviceGetSupportedEventTypes.as_ref())
            .map_err(sym_err("nvmlDeviceGetSupportedEventTypes"))?;
        let mut set: nvmlEventSet_t = ptr::null_mut();
        // SAFETY: `set` is a valid out pointer.
        let ret = unsafe { create(&mut set) };
        if ret != NVML_SUCCESS {
            return Err(call("nvmlEventSetCreate", ret));
        }
        let mut events = Self {
            backend: backend.clone(),
            set,
            unmonitored: vec![],
        };
        for gpu in 0..gpu_count {
            let device = match nvml.device_by_index(gpu) {
                Ok(d) => d,
                Err(_) => {
                    events.unmonitored.push((gpu, NVML_ERROR_GPU_IS_LOST));
                    continue;
                }
            };
            let mut types: u64 = 0;
            // SAFETY: the handle is borrowed from a live `Device`; `types` is a valid out pointer.
            let ret = unsafe { supported(device.handle(), &mut types) };
            if ret != NVML_SUCCESS {
                events.unmonitored.push((gpu, ret));
                continue;
            }
            // SAFETY: as above; `set` was created above and is not freed before `events` drops.
            let ret = unsafe { register(device.handle(), mask & types, set) };
            if ret != NVML_SUCCESS {
                events.unmonitored.push((gpu, ret));
            }
        }
        Ok(events)
    }

    /// Waits up to `timeout_ms` for the next event.
    pub fn wait(&mut self, timeout_ms: u32) -> Waited {
        let nvml = self.backend.nvml();
        let Ok(wait) = nvml_sym(nvml.lib().nvmlEventSetWait_v2.as_ref()) else {
            return Waited::Failed(13);
        };
        // SAFETY: plain-old-data, zero is a valid bit pattern.
        let mut data: nvmlEventData_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is live for `self`'s lifetime; `data` is a valid out pointer.
        let ret = unsafe { wait(self.set, &mut data, timeout_ms) };
        match ret {
            NVML_SUCCESS => {
                let gpu = nvml_sym(nvml.lib().nvmlDeviceGetIndex.as_ref())
                    .ok()
                    .and_then(|index| {
                        let mut i = 0;
                        // SAFETY: `data.device` is the handle NVML just returned; `i` is a valid out pointer.
                        (unsafe { index(data.device, &mut i) } == NVML_SUCCESS).then_some(i)
                    });
                match gpu {
                    Some(gpu) => Waited::Event(RawEvent {
                        gpu,
                        event_type: data.eventType,
                        data: data.eventData,
                        gpu_instance: (data.gpuInstanceId != NO_INSTANCE).then_some(data.gpuInstanceId),
                    }),
                    None => Waited::Failed(NVML_ERROR_NOT_SUPPORTED),
                }
            }
            NVML_ERROR_TIMEOUT => Waited::Timeout,
            NVML_ERROR_GPU_IS_LOST => Waited::GpuLost,
            other => Waited::Failed(other),
        }
    }

    /// Asks the GPU for its UUID: `Err(GpuLost)` when it fell off the bus, `Ok` when it answers.
    pub fn probe(&self, gpu: u32) -> Result<()> {
        let nvml = self.backend.nvml();
        match nvml.device_by_index(gpu).and_then(|d| d.uuid()) {
            Ok(_) => Ok(()),
            Err(NvmlError::GpuLost) => Err(GpuError::GpuLost(format!(
                "GPU {gpu} did not answer nvmlDeviceGetUUID"
            ))),
            Err(e) => Err(GpuError::Tool {
                program: "nvmlDeviceGetUUID".into(),
                reason: e.to_string(),
            }),
        }
    }
}

impl Drop for NvmlEvents {
    fn drop(&mut self) {
        if let Ok(free) = nvml_sym(self.backend.nvml().lib().nvmlEventSetFree.as_ref()) {
            // SAFETY: `set` came from nvmlEventSetCreate and is freed once.
            unsafe { free(self.set) };
        }
    }
}
