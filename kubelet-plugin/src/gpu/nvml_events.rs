//! NVML's event set for device health: `nvmlEventSetCreate`, `nvmlDeviceRegisterEvents` per physical
//! GPU, `nvmlEventSetWait_v2` (which, unlike nvml-wrapper's `EventSet::wait`, keeps the GPU-instance id a
//! MIG device's event carries), `nvmlEventSetFree`. MIG device handles cannot be registered; their events
//! arrive on the parent with `gpuInstanceId` set (`gpu-mig-mps.md` 10.1, from `nvml.h`).
//!
//! Runs against a GPU's driver or the simulated driver root's library, like the rest of the NVML backend;
//! the calls follow `nvml_raw`'s pattern (symbols resolved through nvml-wrapper's table, a missing one is
//! an error, return codes checked). An event's GPU is found by the device's UUID, else by the handle it
//! was registered with; an event neither names is returned as [`Waited::Unattributed`], never dropped.
#![allow(
    unsafe_code,
    reason = "raw NVML event calls: nvml-wrapper's EventSet drops the GPU-instance id"
)]

use std::{ffi::CStr, ptr, sync::Arc};

use nvml_wrapper::{error::NvmlError, error::nvml_sym};
use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlReturn_t};

use super::{
    GpuError, Result,
    nvml::{NvmlBackend, code_of},
};

const NVML_SUCCESS: nvmlReturn_t = 0;
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
    /// An event whose device is none of the registered GPUs' by UUID or by handle (its UUID query
    /// failed): kept, not dropped, so a critical XID is never lost; the source charges it to every GPU.
    Unattributed {
        event_type: u64,
        data: u64,
    },
    Timeout,
    /// `NVML_ERROR_GPU_IS_LOST`: some GPU fell off the bus; the probe tells which.
    GpuLost,
    Failed(u32),
}

/// A registered event set; freed on drop.
pub struct NvmlEvents {
    backend: Arc<NvmlBackend>,
    set: nvmlEventSet_t,
    /// The handle each registered GPU had, by index: an event's device handle is matched against them when
    /// its UUID cannot be read.
    registered: Vec<(u32, nvmlDevice_t)>,
    /// The backend's MIG-change count when this set was registered (see [`NvmlEvents::stale`]).
    mig_changes: u64,
    /// GPUs whose events could not be registered, with NVML's return code (3: not supported).
    pub unmonitored: Vec<(u32, u32)>,
}

// SAFETY: an event set is a handle NVML lets any thread wait on (NVML is thread-safe); it is only used
// through `&mut self`, so one thread at a time. The device handles are only compared, never dereferenced.
unsafe impl Send for NvmlEvents {}

impl NvmlEvents {
    /// Registers `mask` (masked by what each GPU supports) on each of `gpus` (indices discovery gave
    /// them; each is resolved by its UUID).
    pub fn register(
        backend: Arc<NvmlBackend>,
        gpus: impl IntoIterator<Item = u32>,
        mask: u64,
    ) -> Result<Self> {
        let nvml = backend.nvml();
        let call = |name: &'static str, code: nvmlReturn_t| GpuError::Nvml { call: name, code };
        let sym_err = |name: &'static str| move |_| call(name, 13);
        let create =
            nvml_sym(nvml.lib().nvmlEventSetCreate.as_ref()).map_err(sym_err("nvmlEventSetCreate"))?;
        let register = nvml_sym(nvml.lib().nvmlDeviceRegisterEvents.as_ref())
            .map_err(sym_err("nvmlDeviceRegisterEvents"))?;
        let supported = nvml_sym(nvml.lib().nvmlDeviceGetSupportedEventTypes.as_ref())
            .map_err(sym_err("nvmlDeviceGetSupportedEventTypes"))?;
        // Read before registering: a MIG change during registration makes the set stale at once.
        let mig_changes = backend.mig_changes();
        let mut set: nvmlEventSet_t = ptr::null_mut();
        // SAFETY: `set` is a valid out pointer.
        let ret = unsafe { create(&mut set) };
        if ret != NVML_SUCCESS {
            return Err(call("nvmlEventSetCreate", ret));
        }
        let mut events = Self {
            backend: backend.clone(),
            set,
            registered: vec![],
            mig_changes,
            unmonitored: vec![],
        };
        for gpu in gpus {
            let device = match backend.device(gpu) {
                Ok(d) => d,
                Err(e) => {
                    events.unmonitored.push((gpu, code_of(&e)));
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
                continue;
            }
            // SAFETY: the handle is only kept for comparison.
            events.registered.push((gpu, unsafe { device.handle() }));
        }
        Ok(events)
    }

    /// The GPUs whose events this set delivers.
    pub fn registered(&self) -> impl Iterator<Item = u32> + '_ {
        self.registered.iter().map(|(gpu, _)| *gpu)
    }

    /// True once the plugin changed a GPU's MIG mode after this set was registered: the change may reset
    /// the GPU, and a reset GPU may stop delivering events until registered again.
    pub fn stale(&self) -> bool {
        self.backend.mig_changes() != self.mig_changes
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
            NVML_SUCCESS => match self.attribute(data.device) {
                Some(gpu) => Waited::Event(RawEvent {
                    gpu,
                    event_type: data.eventType,
                    data: data.eventData,
                    gpu_instance: (data.gpuInstanceId != NO_INSTANCE).then_some(data.gpuInstanceId),
                }),
                None => Waited::Unattributed {
                    event_type: data.eventType,
                    data: data.eventData,
                },
            },
            NVML_ERROR_TIMEOUT => Waited::Timeout,
            NVML_ERROR_GPU_IS_LOST => Waited::GpuLost,
            other => Waited::Failed(other),
        }
    }

    /// The index of the GPU an event names: by the device's UUID (NVIDIA's DRA driver does the same;
    /// NVML's index of the handle may differ from the one discovery gave, and fails more often), else by
    /// the handle it was registered with.
    fn attribute(&self, device: nvmlDevice_t) -> Option<u32> {
        let nvml = self.backend.nvml();
        // A MIG device's handle names its parent through the driver; a GPU's handle is not a MIG handle
        // and the call fails, leaving it as it is.
        let device = nvml_sym(nvml.lib().nvmlDeviceGetDeviceHandleFromMigDeviceHandle.as_ref())
            .ok()
            .and_then(|parent_of| {
                let mut parent: nvmlDevice_t = ptr::null_mut();
                // SAFETY: `device` is the handle NVML just returned; `parent` is a valid out pointer.
                (unsafe { parent_of(device, &mut parent) } == NVML_SUCCESS && !parent.is_null())
                    .then_some(parent)
            })
            .unwrap_or(device);
        let by_uuid = nvml_sym(nvml.lib().nvmlDeviceGetUUID.as_ref())
            .ok()
            .and_then(|get_uuid| {
                let mut buf = [0 as std::os::raw::c_char; 96];
                // SAFETY: `device` is the handle NVML just returned; the buffer is 96 bytes (NVML's
                // NVML_DEVICE_UUID_V2_BUFFER_SIZE is 96) and NUL-terminated by the driver on success.
                let ret = unsafe { get_uuid(device, buf.as_mut_ptr(), buf.len() as u32) };
                (ret == NVML_SUCCESS).then(|| {
                    unsafe { CStr::from_ptr(buf.as_ptr()) }
                        .to_string_lossy()
                        .into_owned()
                })
            })
            .and_then(|uuid| self.backend.index_of(&uuid));
        by_uuid.or_else(|| {
            self.registered
                .iter()
                .find_map(|(gpu, handle)| (*handle == device).then_some(*gpu))
        })
    }

    /// Asks the GPU something only it can answer: `Ok` when it answers, else the error NVML gave.
    pub fn probe(&self, gpu: u32) -> std::result::Result<(), ProbeError> {
        probe(&self.backend, gpu)
    }
}

/// Why a GPU did not answer the probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeError {
    /// NVML's return code (15 lost, 18 library/driver mismatch, 9 driver not loaded, 1 uninitialized, …).
    pub code: u32,
    pub message: String,
}

/// NVML return codes after which a kept handle may name nothing: the GPU fell off the bus (15), needs a
/// reset (16), or the handle or UUID no longer resolves (2, 6).
const HANDLE_MAY_BE_STALE: [u32; 4] = [2, 6, 15, 16];

/// Asks GPU `gpu` (by its kept handle, see [`NvmlBackend::device`]) for its memory info: `Ok` when it
/// answers.
///
/// Not its UUID, nor whether its UUID still finds a handle: a driver may answer both from its cache for a
/// GPU that fell off the bus, and the simulated driver does (`sim-driver/nvml`, `nvmlDeviceGetUUID`).
/// `nvmlDeviceGetMemoryInfo` answers `NVML_ERROR_GPU_IS_LOST` "if the target GPU has fallen off the bus
/// or is otherwise inaccessible" (`nvml.h`), every data-center GPU supports it, with MIG on or off, and it
/// is cheap. A GPU that does not answer loses its kept handle, so that once it is back (after a reset)
/// it is looked up afresh.
pub fn probe(backend: &NvmlBackend, gpu: u32) -> std::result::Result<(), ProbeError> {
    let what = match backend.uuid_of(gpu) {
        Some(uuid) => format!("GPU {gpu} ({uuid})"),
        None => format!("GPU {gpu}"),
    };
    let answer = match backend.device(gpu) {
        Ok(device) => device.memory_info().map(drop).map_err(|e| {
            let message = format!("{what} did not answer nvmlDeviceGetMemoryInfo: {e}");
            let code = match e {
                NvmlError::FailedToLoadSymbol(_) => 13,
                e => nvmlReturn_t::from(e),
            };
            (code, message)
        }),
        Err(e) => Err((code_of(&e), format!("{what} has no NVML handle: {e}"))),
    };
    answer.map_err(|(code, message)| {
        if HANDLE_MAY_BE_STALE.contains(&code) {
            backend.forget_handle(gpu);
        }
        ProbeError { code, message }
    })
}

impl Drop for NvmlEvents {
    fn drop(&mut self) {
        if let Ok(free) = nvml_sym(self.backend.nvml().lib().nvmlEventSetFree.as_ref()) {
            // SAFETY: `set` came from nvmlEventSetCreate and is freed once.
            unsafe { free(self.set) };
        }
    }
}
