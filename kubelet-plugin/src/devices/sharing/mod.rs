//! Sharing one GPU (or MIG device) between claims: MPS ([`mps`]) or time-slicing ([`timeslice`]).
//!
//! A shared device has per-device state that must exist while any share is prepared and be undone after
//! the last one: an MPS control daemon, or a non-default time-slice. [`ShareUsers`] counts the holders per
//! device; it is rebuilt from the checkpoint at start, so "first" and "last" survive a plugin restart.
//!
//! What is enforced, and by whom:
//!
//! | Limit | Set by | Enforced by | A hostile container can |
//! |---|---|---|---|
//! | MPS: who shares a daemon | plugin: one daemon per (device, namespace) ([`daemon_key`]), or one per device where the policy publishes `mpsTenancy: Shared` | plugin (each daemon has its own directory, mounted only into its own shares) | reach only its own namespace's daemon (`Shared`: every namespace's on the device) |
//! | MPS: device access | plugin: a whole GPU in `EXCLUSIVE_PROCESS` while exactly one daemon serves it, `DEFAULT` while two or more do (a second namespace's server could not open it otherwise) | driver: only the first MPS server opens an `EXCLUSIVE_PROCESS` GPU | on a whole GPU with one daemon, not open it past the server (but see the control socket); on a whole GPU with daemons of two or more namespaces, and on a MIG device (whose GPU stays `DEFAULT`: a compute mode is the GPU's, and other tenants hold its other MIG devices), open it without the server by unsetting `CUDA_MPS_PIPE_DIRECTORY`, escaping the MPS limits (not the MIG device's) |
//! | MPS: the daemon's control socket (`<pipe dir>/control`, mounted read-write: every CUDA client needs it) | — | nothing: NVIDIA's daemon takes control commands from any client of its user (root in both by default), and `nvidia-cuda-mps-control` is in every container | `quit` its daemon (its namespace's shares of the device lose their server until the plugin's watch or the supervisor's watchdog starts it again, within seconds) or change the defaults its namespace's later servers start with; `Shared`: every namespace's |
//! | MPS: compute share (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) | CDI env from the config's `computeCeiling` (a burstable share), else `compute` capacity, else `defaultActiveThreadPercentage` | MPS server, per client context, as the client declares it | unset it and get the daemon default (a share slot's size, else the config default, else 100%) |
//! | MPS: pinned memory (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<N>M`) | CDI env from `memory` capacity or the config's limits | MPS server, per client context, as the client declares it | unset it and get the daemon default (a share slot's size, else the config default, else none) |
//! | MPS: IPC (`/dev/shm`) | with the supervisor: a tmpfs per daemon (`size=1g`), the daemon's own `/dev/shm`, mounted only into its clients; without it on real GPUs the host's `/dev/shm`; a per-daemon dir on the simulated backend | kernel (mount namespaces) | with the supervisor: see only its own daemon's (its namespace's) segments; without it: other host segments |
//! | MPS: fault isolation | plugin: a server per namespace | none within a server: a fatal fault in one client reaches all clients of the daemon's server | crash its own namespace's shares' work on the device (`Shared`: every share's) |
//! | MPS: the supervisor's signals | supervisor: only its own children's pids, never a pid file (tenant-writable) | supervisor | nothing |
//! | Time-slicing: interval | first share's config (`timeSlicing.interval`), reset after the last | driver scheduler | nothing (no per-share limit exists) |
//! | Time-slicing: memory, compute | — | nothing | use all memory and compute of the GPU |
//! | Strategy per device | plugin: one strategy per device, checked at prepare | plugin | — |
//!
//! So MPS limits bind cooperative tenants only: the tenants of one daemon, a namespace's shares of a device
//! by default, must trust each other (MIG isolates tenants that do not). `kubelet-plugin/README.md` ("MPS
//! tenancy: which claims share a daemon") says the same for users, with what it costs.
//!
//! This module shares a device that exists: a whole GPU, or a MIG device the caller made. It knows neither
//! MIG nor the prepare state machine; [`crate::devices::preparers`] composes "MIG, then share on it".
//!
//! All shares of one device use one strategy: an MPS daemon puts a whole GPU in exclusive-process mode,
//! which locks out a time-sliced client, so a second strategy on the same device is refused. The holders
//! are counted per device ([`ShareUsers`]: strategy, MIG device, the device's setup) and per MPS daemon
//! (a namespace's daemon stops with the namespace's last share of the device).

pub mod mps;
mod private_shm;
pub mod supervisor;
pub mod supervisor_protocol;
pub mod timeslice;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
};

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tessera_api::{
    DeviceName, GpuInfo, attributes,
    config::{MpsConfig, QuantityError, SharingStrategy, TimeSliceInterval, parse_quantity},
};
use tracing::{info, warn};

use crate::gpu::{ComputeMode, GpuBackend, GpuError};
use mps::{MpsError, MpsManager, ShareLimits};
use supervisor_protocol::DaemonDefaults;
pub use supervisor_protocol::{TENANT_SEPARATOR, check_daemon_key, split_daemon_key};
use timeslice::{TimeSliceError, TimeSliceRecord};

/// Why a share could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SharingError {
    /// The device already serves shares of the other strategy. The message counts the other claims
    /// instead of naming them: they may belong to other namespaces, and their UIDs are not this user's.
    #[error(
        "device {device} is already shared with {current} by {holders} other claim(s); this claim asks for \
         {requested} (all shares of a device must use one strategy)"
    )]
    StrategyConflict {
        device: String,
        current: &'static str,
        requested: &'static str,
        holders: usize,
    },
    /// A consumed capacity that is not a quantity.
    #[error("failed to read consumed capacity {name}={value:?}: {source}")]
    ConsumedCapacity {
        name: String,
        value: String,
        source: QuantityError,
    },
    /// The compute share is not a percentage.
    #[error("consumed capacity compute={0} is not a percentage between 0 and 100")]
    ComputeShare(u64),
    /// Setting the GPU's compute mode failed.
    #[error("failed to set the compute mode of GPU {gpu}: {source}")]
    ComputeMode { gpu: u32, source: GpuError },
    /// The MPS daemon could not be started, reached or stopped.
    #[error(transparent)]
    Mps(#[from] MpsError),
    /// The time-slice could not be set.
    #[error(transparent)]
    TimeSlice(#[from] TimeSliceError),
}

/// Holders of each shared device, by device key ([`share_key`]).
#[derive(Debug, Default)]
pub struct ShareUsers {
    devices: Mutex<BTreeMap<String, DeviceShares>>,
}

/// The state of one shared device.
#[derive(Clone, Debug)]
struct DeviceShares {
    strategy: SharingStrategy,
    holders: BTreeSet<String>,
}

impl ShareUsers {
    /// Records `holder` (e.g. `<claim uid>/<device name>`) on `device`; returns true when it is the first.
    /// Adding a holder twice is harmless (a retried prepare).
    pub fn add(&self, device: &str, holder: &str, strategy: SharingStrategy) -> Result<bool, SharingError> {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        let shares = devices.entry(device.to_string()).or_insert_with(|| DeviceShares {
            strategy,
            holders: BTreeSet::new(),
        });
        if shares.strategy != strategy && !shares.holders.is_empty() {
            return Err(SharingError::StrategyConflict {
                device: device.to_string(),
                current: shares.strategy.as_str(),
                requested: strategy.as_str(),
                holders: shares.holders.len(),
            });
        }
        shares.strategy = strategy;
        let first = shares.holders.is_empty();
        shares.holders.insert(holder.to_string());
        Ok(first)
    }

    /// Removes `holder`; returns true when no holder is left on `device` (also when it was never there, so
    /// an unprepare after a crash still cleans up).
    pub fn remove(&self, device: &str, holder: &str) -> bool {
        let mut devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        let Some(shares) = devices.get_mut(device) else {
            return true;
        };
        shares.holders.remove(holder);
        if shares.holders.is_empty() {
            devices.remove(device);
            return true;
        }
        false
    }

    /// Number of holders of `device`.
    pub fn count(&self, device: &str) -> usize {
        let devices = self.devices.lock().unwrap_or_else(|e| e.into_inner());
        devices.get(device).map_or(0, |d| d.holders.len())
    }
}

/// The key of a shared device: every share of a whole GPU (`gpu-<i>-shared` and the slots
/// `gpu-<i>-share-<n>`) shares the GPU, keyed `gpu-<i>`; a shared MIG placement is keyed by its name
/// without `-shared`. Keys name the MPS daemon directory too. An exclusive device (`gpu-<i>`, a MIG
/// placement) whose claim's config asks for sharing among its own containers gets the same key, with that
/// claim as the only holder.
pub fn share_key(device: &DeviceName) -> String {
    match device {
        DeviceName::Gpu { gpu } | DeviceName::SharedGpu { gpu } | DeviceName::ShareSlot { gpu, .. } => {
            format!("gpu-{gpu}")
        }
        DeviceName::SharedMig { gpu, profile, start } | DeviceName::Mig { gpu, profile, start } => {
            DeviceName::Mig {
                gpu: *gpu,
                profile: profile.clone(),
                start: *start,
            }
            .to_string()
        }
    }
}

/// The key of the MPS daemon that serves a share of `device`: the device's [`share_key`] for the device's
/// one daemon (tenancy `Shared`, and every daemon of a plugin before per-namespace daemons), or
/// `<share key>@<namespace>` for the daemon of the claims of one namespace. Keys name the daemon's
/// directory (`<state dir>/mps/<key>/`), so each namespace gets its own pipe, log and `/dev/shm`.
pub fn daemon_key(device: &DeviceName, tenant: Option<&str>) -> String {
    match tenant {
        Some(namespace) => format!("{}{TENANT_SEPARATOR}{namespace}", share_key(device)),
        None => share_key(device),
    }
}

/// The key of the daemon a prepared MPS share uses: the directory its checkpointed pipe directory
/// (`<state dir>/mps/<key>/pipe`) is in, so a share keeps the daemon it was prepared with across restarts
/// and upgrades (a share prepared by a plugin before per-namespace daemons names the device's one
/// daemon); the device's [`share_key`] where the record names no pipe directory.
pub fn daemon_key_of_share(device: &DeviceName, pipe_dir: Option<&str>) -> String {
    pipe_dir
        .map(std::path::Path::new)
        .and_then(|p| p.parent()?.file_name()?.to_str())
        .filter(|key| check_daemon_key(key).is_ok() && split_daemon_key(key).0 == share_key(device))
        .map_or_else(|| share_key(device), str::to_string)
}

/// One share to prepare.
#[derive(Clone, Debug)]
pub struct ShareRequest<'a> {
    /// Unique per share: `<claim uid>/<device name>`, and `/<share id>` for a share allocated through
    /// consumable capacity (one claim may hold two of a device).
    pub holder: String,
    pub device: &'a DeviceName,
    /// The physical GPU.
    pub gpu: &'a GpuInfo,
    /// UUID the share runs on: the GPU's, or that of the MIG device the caller made for a MIG placement.
    pub uuid: &'a str,
    pub strategy: SharingStrategy,
    pub mps: Option<&'a MpsConfig>,
    /// Requested interval (time-slicing of whole GPUs).
    pub interval: TimeSliceInterval,
    /// The allocation result's `consumedCapacity`.
    pub consumed: &'a BTreeMap<String, Quantity>,
    /// MPS: the namespace whose own daemon serves the share (tenancy `Namespace`), or `None` for the
    /// device's one daemon, shared by every namespace (tenancy `Shared`). See [`daemon_key`].
    pub tenant: Option<&'a str>,
}

/// What a prepared share gives its containers and what the checkpoint keeps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PreparedShare {
    /// `GPU-…` or `MIG-…` UUID the containers use.
    pub uuid: String,
    pub env: Vec<String>,
    /// `(host path, container path)` bind mounts.
    pub mounts: Vec<(String, String)>,
    pub mps_pipe_dir: Option<String>,
    /// Applied limits by name (`activeThreadPercentage`, `pinnedDeviceMemoryLimit`, `timeSlice`).
    pub limits: BTreeMap<String, String>,
}

fn on_mig(device: &DeviceName) -> bool {
    matches!(device, DeviceName::SharedMig { .. } | DeviceName::Mig { .. })
}

/// Prepares and unprepares shares: keeps the holder count per device and starts/stops what the first and
/// last share need (MPS daemon and exclusive compute mode, time-slice). Callers hold the GPU's lock.
pub struct Sharer {
    backend: Arc<dyn GpuBackend>,
    mps: MpsManager,
    users: ShareUsers,
    time_slices: TimeSliceRecord,
    /// On real GPUs MPS clients must share the host's /dev/shm with the daemon.
    real_hardware: bool,
    /// The MPS daemon each device with MPS shares needs, by key: what [`Sharer::watch_daemons`] starts
    /// again when it is gone. Also the lock that orders the watch against first prepares and last
    /// unprepares, so the watch never starts a daemon a teardown just stopped.
    daemons: Mutex<BTreeMap<String, DaemonNeed>>,
    /// Devices whose daemon the last watch found down, since when.
    down: Mutex<BTreeMap<String, DaemonDown>>,
    /// The daemon each watch found answering, by key: one that answers the next watch but is another
    /// daemon was replaced in between, an outage shorter than the watch's interval that the clients felt.
    seen: Mutex<BTreeMap<String, mps::DaemonInstance>>,
    /// The holders of each MPS daemon, by daemon key ([`daemon_key`]): a device has one daemon per
    /// namespace of its shares (or one for all), started with its first holder and stopped after its last.
    tenants: Mutex<BTreeMap<String, BTreeSet<String>>>,
}

/// The MPS daemon of a shared device: its device UUID and the defaults it was started with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DaemonNeed {
    pub uuid: String,
    pub defaults: DaemonDefaults,
}

/// A device whose MPS daemon does not answer.
#[derive(Clone, Debug)]
pub struct DaemonDown {
    /// When the watch first found it down.
    pub since: std::time::Instant,
    /// Why the last start failed, if it was tried.
    pub error: Option<String>,
}

/// What one [`Sharer::watch_daemons`] found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DaemonWatch {
    /// Keys whose daemon answered.
    pub up: Vec<String>,
    /// Keys whose daemon was down and was started again.
    pub restarted: Vec<String>,
    /// Keys whose daemon is down and could not be started.
    pub down: Vec<String>,
    /// Keys whose daemon answers but is not the one the previous watch found: it was replaced between the
    /// two (a supervisor restored it, or restarted it after a crash), so the clients' contexts on the old
    /// one are lost although no watch found it down.
    pub replaced: Vec<String>,
    /// Daemons that ran with no prepared share and were stopped.
    pub stopped: Vec<String>,
}

/// The checkpoint's name (in [`PreparedShare::limits`]) of an MPS share's own compute limit
/// (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`).
pub const CLIENT_THREAD_LIMIT: &str = "activeThreadPercentage";
/// The checkpoint's names (in [`PreparedShare::limits`]) of the daemon defaults of a share's device.
pub const DAEMON_THREAD_LIMIT: &str = "mpsDefaultActiveThreadPercentage";
pub const DAEMON_PINNED_LIMIT: &str = "mpsDefaultPinnedDeviceMemoryLimit";

impl DaemonNeed {
    /// The daemon a restored share names in its checkpoint limits (see [`DAEMON_THREAD_LIMIT`]); a
    /// record written before they were kept gives no defaults.
    pub fn from_limits(uuid: &str, limits: &BTreeMap<String, String>) -> Self {
        Self {
            uuid: uuid.to_string(),
            defaults: DaemonDefaults {
                active_thread_percentage: limits.get(DAEMON_THREAD_LIMIT).and_then(|v| v.parse().ok()),
                pinned_memory_bytes: limits
                    .get(DAEMON_PINNED_LIMIT)
                    .and_then(|v| mps::parse_mem_limit(v)),
            },
        }
    }
}

impl Sharer {
    /// The time-slice record lives next to the MPS daemons' directories, in the plugin's state directory.
    pub fn new(backend: Arc<dyn GpuBackend>, mps: MpsManager, real_hardware: bool) -> Self {
        let time_slices = TimeSliceRecord::new(mps.state_dir());
        Self {
            backend,
            mps,
            users: ShareUsers::default(),
            time_slices,
            real_hardware,
            daemons: Mutex::default(),
            down: Mutex::default(),
            seen: Mutex::default(),
            tenants: Mutex::default(),
        }
    }

    fn lock_tenants(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, BTreeSet<String>>> {
        self.tenants.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add_tenant(&self, daemon: &str, holder: &str) {
        self.lock_tenants()
            .entry(daemon.to_string())
            .or_default()
            .insert(holder.to_string());
    }

    /// Removes `holder` from the daemon of `device_key` it holds: that daemon's key, and whether it has no
    /// holder left. `None` when the holder holds none (a time-sliced share, an unprepare after a crash).
    fn remove_tenant(&self, device_key: &str, holder: &str) -> Option<(String, bool)> {
        let mut tenants = self.lock_tenants();
        let key = tenants
            .iter()
            .find(|(k, holders)| split_daemon_key(k).0 == device_key && holders.contains(holder))
            .map(|(k, _)| k.clone())?;
        let holders = tenants.get_mut(&key)?;
        holders.remove(holder);
        let last = holders.is_empty();
        if last {
            tenants.remove(&key);
        }
        Some((key, last))
    }

    /// Number of holders of the MPS daemon `daemon` (a [`daemon_key`]).
    pub fn daemon_holders(&self, daemon: &str) -> usize {
        self.lock_tenants().get(daemon).map_or(0, BTreeSet::len)
    }

    /// The compute mode of a whole GPU follows its daemons: EXCLUSIVE_PROCESS while exactly one serves it
    /// (only its MPS server may open the GPU, so no client bypasses it); DEFAULT with two or more (the
    /// servers of different namespaces must each open the GPU, and a real driver refuses a second process
    /// in EXCLUSIVE_PROCESS, so they time-slice as separate contexts) and with none. MIG devices are left
    /// alone: the mode is the GPU's, and other tenants hold its other MIG devices.
    fn apply_compute_mode(
        &self,
        gpu: &GpuInfo,
        device: &DeviceName,
        daemons: &BTreeMap<String, DaemonNeed>,
    ) -> Result<(), SharingError> {
        if on_mig(device) {
            return Ok(());
        }
        let key = share_key(device);
        // Registered daemons and those of restored shares whose record named no defaults to register.
        let tenants = self.lock_tenants();
        let serving = daemons
            .keys()
            .chain(tenants.keys())
            .filter(|k| split_daemon_key(k).0 == key)
            .collect::<BTreeSet<_>>()
            .len();
        drop(tenants);
        let mode = if serving == 1 {
            ComputeMode::ExclusiveProcess
        } else {
            ComputeMode::Default
        };
        self.backend
            .set_compute_mode(gpu.index, mode)
            .map_err(|source| SharingError::ComputeMode {
                gpu: gpu.index,
                source,
            })
    }

    /// Stops the MPS daemon `daemon` whose last holder went while other shares still hold its device (a
    /// namespace's last share of a GPU other namespaces share too), and sets the GPU's mode for the daemons
    /// left.
    fn stop_daemon(&self, gpu: &GpuInfo, daemon: &str, device: &DeviceName) -> Result<(), SharingError> {
        let mut daemons = self.lock_daemons();
        if self.daemon_holders(daemon) > 0 {
            return Ok(());
        }
        daemons.remove(daemon);
        self.forget_instance(daemon);
        self.mps.stop(daemon)?;
        self.apply_compute_mode(gpu, device, &daemons)
    }

    fn lock_daemons(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, DaemonNeed>> {
        self.daemons.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_seen(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, mps::DaemonInstance>> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records which daemon of `key` listens now; true when another one was recorded before it.
    fn note_instance(&self, key: &str) -> bool {
        let now = self.mps.instance(key);
        let mut seen = self.lock_seen();
        let before = match now {
            Some(now) => seen.insert(key.to_string(), now),
            None => seen.remove(key),
        };
        matches!((before, now), (Some(before), Some(now)) if before != now)
    }

    /// Forgets the daemon of `key`: the sharer itself starts or stops it, so the next one is no replacement.
    fn forget_instance(&self, key: &str) {
        self.lock_seen().remove(key);
    }

    /// Re-registers the MPS daemon of a share prepared before a restart (from its checkpoint record), so
    /// the watch starts it again should it go. The first restored share of a device decides.
    pub fn restore_daemon(&self, device: &DeviceName, need: DaemonNeed) {
        self.restore_daemon_of(&share_key(device), need);
    }

    /// [`Sharer::restore_daemon`] for the daemon `daemon` (a [`daemon_key`], as [`daemon_key_of_share`]
    /// reads it from the share's record).
    pub fn restore_daemon_of(&self, daemon: &str, need: DaemonNeed) {
        self.lock_daemons().entry(daemon.to_string()).or_insert(need);
    }

    /// The devices whose MPS daemon the last watch found down.
    pub fn daemons_down(&self) -> BTreeMap<String, DaemonDown> {
        self.down.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Checks the MPS daemon of every device with prepared MPS shares: one that does not answer (its
    /// supervisor was replaced, it crashed) is started again with the defaults it had, and stays reported
    /// ([`Sharer::daemons_down`], a WARN line when found and when back) until it answers; a daemon that
    /// runs with no prepared share (a stop lost in a crash) is stopped, but only when `stop_orphans`: while
    /// the node's records are not settled ([`crate::node::state::NodeState::records_settled`]: a checkpoint of
    /// another boot awaiting the API, a corrupted one refused) a daemon without a share may be a running
    /// pod's. Call periodically, after the shares were restored.
    pub fn watch_daemons(&self, gpus: &[GpuInfo], stop_orphans: bool) -> DaemonWatch {
        let mut out = DaemonWatch::default();
        let daemons = self.lock_daemons();
        // Never held across a start: the inventory reads it from an async task.
        let down = || self.down.lock().unwrap_or_else(|e| e.into_inner());
        for (key, need) in daemons.iter() {
            if self.daemon_holders(key) == 0 {
                self.forget_instance(key);
                continue;
            }
            if self.mps.is_running(key) {
                let replaced = self.note_instance(key);
                if let Some(was) = down().remove(key) {
                    info!(key, after = ?was.since.elapsed(), "the MPS daemon of a prepared share is back");
                    out.up.push(key.clone());
                } else if replaced {
                    warn!(
                        key,
                        shares = self.daemon_holders(key),
                        "the MPS daemon of prepared shares was replaced since the last check: CUDA contexts \
                         its clients made on the old daemon are lost"
                    );
                    out.replaced.push(key.clone());
                } else {
                    out.up.push(key.clone());
                }
                continue;
            }
            let since = down()
                .entry(key.clone())
                .or_insert_with(|| {
                    warn!(
                        key,
                        shares = self.daemon_holders(key),
                        "the MPS daemon of prepared shares does not answer: their CUDA clients have no \
                         server; starting it again"
                    );
                    DaemonDown {
                        since: std::time::Instant::now(),
                        error: None,
                    }
                })
                .since;
            match self.mps.start(key, &need.uuid, need.defaults) {
                Ok(_) => {
                    info!(key, after = ?since.elapsed(), "started the MPS daemon of prepared shares again");
                    self.note_instance(key);
                    down().remove(key);
                    out.restarted.push(key.clone());
                }
                Err(e) => {
                    let e = e.to_string();
                    if let Some(entry) = down().get_mut(key) {
                        if entry.error.as_deref() != Some(e.as_str()) {
                            warn!(key, error = %e, "cannot start the MPS daemon of prepared shares; retrying");
                        }
                        entry.error = Some(e);
                    }
                    out.down.push(key.clone());
                }
            }
        }
        down().retain(|key, _| daemons.contains_key(key));
        self.lock_seen().retain(|key, _| daemons.contains_key(key));
        if stop_orphans {
            // Under the daemon lock: a prepare cannot start using a daemon while it is judged orphaned.
            out.stopped = self.stop_orphans_locked(&daemons, gpus);
        }
        out
    }

    /// Stops the MPS daemons that neither a prepared share nor a registered need uses; the stopped keys.
    /// The caller holds the daemon lock (`daemons`).
    fn stop_orphans_locked(&self, daemons: &BTreeMap<String, DaemonNeed>, gpus: &[GpuInfo]) -> Vec<String> {
        let mut stopped = Vec::new();
        for key in self.mps.running() {
            if daemons.contains_key(&key) || self.daemon_holders(&key) > 0 {
                continue;
            }
            let Ok(device) = split_daemon_key(&key).0.parse::<DeviceName>() else {
                continue;
            };
            let Some(gpu) = gpus.iter().find(|g| g.index == device.gpu()) else {
                continue;
            };
            info!(key, "stopping an MPS daemon no prepared claim uses");
            self.forget_instance(&key);
            // The GPU's mode then follows the daemons its shares still use (none: DEFAULT).
            let result = self
                .mps
                .stop(&key)
                .map_err(SharingError::from)
                .and_then(|()| self.apply_compute_mode(gpu, &device, daemons));
            match result {
                Ok(()) => stopped.push(key),
                Err(e) => warn!(key, error = %e, "could not stop an orphaned MPS daemon"),
            }
        }
        stopped
    }

    pub fn users(&self) -> &ShareUsers {
        &self.users
    }

    pub fn mps(&self) -> &MpsManager {
        &self.mps
    }

    /// What the plugin set as each GPU's time-slice (persisted: NVML cannot read it back).
    pub fn time_slices(&self) -> &TimeSliceRecord {
        &self.time_slices
    }

    /// Re-registers a share prepared before a restart (from a completed checkpoint record).
    pub fn restore(&self, device: &DeviceName, holder: &str, strategy: SharingStrategy) {
        self.restore_on(device, holder, strategy, None);
    }

    /// [`Sharer::restore`] of an MPS share on the daemon `daemon` (a [`daemon_key`], as
    /// [`daemon_key_of_share`] reads it from the share's record); `None`: the device's one daemon.
    pub fn restore_on(
        &self,
        device: &DeviceName,
        holder: &str,
        strategy: SharingStrategy,
        daemon: Option<&str>,
    ) {
        let key = share_key(device);
        if let Err(e) = self.users.add(&key, holder, strategy) {
            warn!(key, holder, error = %e, "cannot restore a prepared share");
            return;
        }
        if strategy == SharingStrategy::Mps {
            self.add_tenant(daemon.unwrap_or(&key), holder);
        }
    }

    /// Prepares one share. On failure the device is left as it was before the call.
    pub fn prepare(&self, req: &ShareRequest<'_>) -> Result<PreparedShare, SharingError> {
        let key = share_key(req.device);
        let first = self.users.add(&key, &req.holder, req.strategy)?;
        let daemon = daemon_key(req.device, req.tenant);
        if req.strategy == SharingStrategy::Mps {
            self.add_tenant(&daemon, &req.holder);
        }
        let result = self.prepare_registered(req, &key, &daemon, first);
        if result.is_err() {
            let daemon_left = self.remove_tenant(&key, &req.holder);
            let undone = if self.users.remove(&key, &req.holder) {
                self.teardown(req.gpu, &key, req.strategy, req.device)
            } else if let Some((daemon, true)) = daemon_left {
                self.stop_daemon(req.gpu, &daemon, req.device)
            } else {
                Ok(())
            };
            if let Err(e) = undone {
                warn!(key, error = %e, "could not undo the shared device's setup");
            }
        }
        result
    }

    fn prepare_registered(
        &self,
        req: &ShareRequest<'_>,
        key: &str,
        daemon: &str,
        first: bool,
    ) -> Result<PreparedShare, SharingError> {
        let mig = on_mig(req.device);
        let mut out = PreparedShare {
            uuid: req.uuid.to_string(),
            ..Default::default()
        };
        if let Some(p) = compute_request(req.consumed)? {
            out.limits.insert(COMPUTE_REQUEST.into(), p.to_string());
        }
        match req.strategy {
            SharingStrategy::Mps => {
                let limits = share_limits(req.consumed, req.mps, &req.device.to_string())?;
                let mut daemons = self.lock_daemons();
                let wanted = DaemonNeed {
                    uuid: req.uuid.to_string(),
                    defaults: daemon_defaults(req, limits),
                };
                if first {
                    // Daemons the device's last share left warm for other namespaces (or for all): not
                    // this share's, and they must not hold the GPU next to its daemon.
                    let others: Vec<String> = daemons
                        .keys()
                        .filter(|k| split_daemon_key(k).0 == key && *k != daemon)
                        .cloned()
                        .collect();
                    for other in others {
                        info!(key = other, "stopping a warm MPS daemon of another tenancy");
                        self.forget_instance(&other);
                        self.mps.stop(&other)?;
                        daemons.remove(&other);
                    }
                }
                let need = match daemons.get(daemon) {
                    // A daemon kept warm by the last share, started for another device or with other
                    // defaults than this first share gives: not this share's daemon, so a new one.
                    Some(warm) if first && *warm != wanted => {
                        info!(key = daemon, kept = ?warm.defaults, wanted = ?wanted.defaults,
                            "the warm MPS daemon has other settings than this share asks for; starting anew");
                        self.forget_instance(daemon);
                        self.mps.stop(daemon)?;
                        wanted
                    }
                    Some(current) => current.clone(),
                    None => wanted,
                };
                let running = self.mps.is_running(daemon);
                if !running || !daemons.contains_key(daemon) {
                    // The mode for the daemons the GPU will have, before this one's server opens it: a
                    // second namespace's server needs DEFAULT (see `apply_compute_mode`). Also for a daemon
                    // that runs unregistered (left by a crash), which counts from now on.
                    let mut serving = daemons.clone();
                    serving.insert(daemon.to_string(), need.clone());
                    self.apply_compute_mode(req.gpu, req.device, &serving)?;
                }
                if !running {
                    self.forget_instance(daemon);
                    self.mps.start(daemon, &need.uuid, need.defaults)?;
                }
                daemons.insert(daemon.to_string(), need.clone());
                drop(daemons);
                if let Some(p) = need.defaults.active_thread_percentage {
                    out.limits.insert(DAEMON_THREAD_LIMIT.into(), p.to_string());
                }
                if let Some(b) = need.defaults.pinned_memory_bytes {
                    out.limits
                        .insert(DAEMON_PINNED_LIMIT.into(), format!("{}M", b >> 20));
                }
                let dirs = self.mps.dirs(daemon);
                let (env, mounts) = mps::client_edits(&dirs, limits, self.real_hardware);
                out.env = env;
                out.mounts = mounts;
                out.mps_pipe_dir = Some(dirs.pipe.display().to_string());
                if let Some(p) = limits.active_thread_percentage {
                    out.limits.insert(CLIENT_THREAD_LIMIT.into(), p.to_string());
                }
                if let Some(b) = limits.pinned_memory_bytes {
                    out.limits
                        .insert("pinnedDeviceMemoryLimit".into(), format!("{}M", b >> 20));
                }
            }
            SharingStrategy::TimeSlicing => {
                if !mig {
                    let slice = timeslice::acquire(
                        self.backend.as_ref(),
                        &self.time_slices,
                        req.gpu,
                        req.interval,
                        first,
                    )?;
                    out.limits.insert("timeSlice".into(), format!("{slice:?}"));
                }
            }
        }
        Ok(out)
    }

    /// Unprepares one share; after the last share of the device, undoes the device-wide setup and returns
    /// true (the caller then removes what it made for the share, e.g. the MIG device).
    pub fn unprepare(
        &self,
        gpu: &GpuInfo,
        device: &DeviceName,
        holder: &str,
        strategy: SharingStrategy,
    ) -> Result<bool, SharingError> {
        self.release(gpu, device, holder, strategy, false)
    }

    /// [`Sharer::unprepare`], except that with `keep` the last share leaves its device's setup (MPS daemon,
    /// compute mode) as it is, warm for the next first share ([`crate::node::warm`]); still returns true then.
    /// The daemon stays registered, so the watches leave it alone; [`Sharer::destroy_idle`] ends it.
    pub fn release(
        &self,
        gpu: &GpuInfo,
        device: &DeviceName,
        holder: &str,
        strategy: SharingStrategy,
        keep: bool,
    ) -> Result<bool, SharingError> {
        let key = share_key(device);
        let daemon_left = self.remove_tenant(&key, holder);
        if !self.users.remove(&key, holder) {
            // Other shares keep the device; a namespace whose last share of it went loses its daemon.
            if let Some((daemon, true)) = daemon_left {
                self.stop_daemon(gpu, &daemon, device)?;
            }
            return Ok(false);
        }
        if keep {
            info!(key, "the last share of the device went; its setup stays warm");
        } else {
            self.teardown(gpu, &key, strategy, device)?;
        }
        Ok(true)
    }

    /// Tears down what the last share of `key` left warm, unless a share holds the device again (then
    /// false, and nothing changes).
    pub fn destroy_idle(
        &self,
        gpu: &GpuInfo,
        key: &str,
        strategy: SharingStrategy,
        device: &DeviceName,
    ) -> Result<bool, SharingError> {
        let mut daemons = self.lock_daemons();
        if self.users.count(key) > 0 {
            return Ok(false);
        }
        self.teardown_locked(gpu, key, strategy, device, &mut daemons)?;
        Ok(true)
    }

    fn teardown(
        &self,
        gpu: &GpuInfo,
        key: &str,
        strategy: SharingStrategy,
        device: &DeviceName,
    ) -> Result<(), SharingError> {
        let mut daemons = self.lock_daemons();
        self.teardown_locked(gpu, key, strategy, device, &mut daemons)
    }

    /// [`Sharer::teardown`] with the daemon lock held by the caller: stops every MPS daemon of the device
    /// (registered, or with a directory: one of a share this process never knew), then its mode.
    fn teardown_locked(
        &self,
        gpu: &GpuInfo,
        key: &str,
        strategy: SharingStrategy,
        device: &DeviceName,
        daemons: &mut BTreeMap<String, DaemonNeed>,
    ) -> Result<(), SharingError> {
        let index = gpu.index;
        let mig = on_mig(device);
        let of_device = |k: &String| split_daemon_key(k).0 == key;
        let mut keys: BTreeSet<String> = daemons.keys().filter(|k| of_device(k)).cloned().collect();
        daemons.retain(|k, _| !of_device(k));
        match strategy {
            SharingStrategy::Mps => {
                keys.insert(key.to_string());
                keys.extend(self.mps.known().into_iter().filter(of_device));
                for daemon in &keys {
                    self.forget_instance(daemon);
                    self.mps.stop(daemon)?;
                }
                if !mig {
                    self.backend
                        .set_compute_mode(index, ComputeMode::Default)
                        .map_err(|source| SharingError::ComputeMode { gpu: index, source })?;
                }
            }
            SharingStrategy::TimeSlicing if !mig => {
                timeslice::release(self.backend.as_ref(), &self.time_slices, gpu)?
            }
            SharingStrategy::TimeSlicing => {}
        }
        Ok(())
    }

    /// Stops MPS daemons no prepared share uses any more (left by a crash between the last unprepare's
    /// checkpoint write and the daemon's stop). Call after the shares were restored.
    pub fn stop_orphaned_daemons(&self, gpus: &[GpuInfo]) {
        let daemons = self.lock_daemons();
        self.stop_orphans_locked(&daemons, gpus);
    }
}

/// How often the plugin checks the MPS daemons of prepared shares ([`Sharer::watch_daemons`]).
/// Short, so an outage of a second or two (a supervisor's restart) is seen and reported; each watch asks
/// every daemon one cheap query (`get_default_active_thread_percentage`, NVIDIA's own health probe).
pub const DAEMON_WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// One sentence per device whose MPS daemon is down, for the NodeInventory's message.
pub fn daemons_down_problems(down: &BTreeMap<String, DaemonDown>) -> Vec<String> {
    down.iter()
        .map(|(key, d)| {
            let why = d.error.as_deref().map(|e| format!(": {e}")).unwrap_or_default();
            format!(
                "the MPS daemon of {key} has not answered for {}s; its prepared shares have no MPS server{why}",
                d.since.elapsed().as_secs()
            )
        })
        .collect()
}

/// The defaults the MPS daemon of a share's device starts with (the first share's): for a share slot the
/// slot's own limits (all slots of a GPU are equal, so a client that drops its `CUDA_MPS_*` environment
/// still cannot exceed a slot), else the config's `defaultActiveThreadPercentage` and pinned memory
/// limit, else none.
fn daemon_defaults(req: &ShareRequest<'_>, limits: ShareLimits) -> DaemonDefaults {
    if matches!(req.device, DeviceName::ShareSlot { .. }) {
        return DaemonDefaults {
            active_thread_percentage: limits.active_thread_percentage,
            pinned_memory_bytes: limits.pinned_memory_bytes,
        };
    }
    DaemonDefaults {
        active_thread_percentage: req.mps.and_then(|m| m.default_active_thread_percentage),
        pinned_memory_bytes: req
            .mps
            .and_then(|m| m.pinned_limit_bytes(&req.device.to_string())),
    }
}

/// The checkpoint's name (in [`PreparedShare::limits`]) of a share's `compute` request, in percent: what
/// the scheduler packed, which a burstable share's thread limit ([`CLIENT_THREAD_LIMIT`]) exceeds.
pub const COMPUTE_REQUEST: &str = "computeRequest";

/// A share's limits: the allocation's consumed `compute` (percent) and `memory` (bytes) capacity when the
/// scheduler assigned them, else the MPS config's defaults (per device name, then the default). The
/// thread limit is the config's `computeCeiling` where it has one (a burstable share; the config was
/// checked against the request with [`tessera_api::config::check_ceiling`]), else the compute request.
pub fn share_limits(
    consumed: &BTreeMap<String, Quantity>,
    mps: Option<&MpsConfig>,
    device_name: &str,
) -> Result<ShareLimits, SharingError> {
    let compute = compute_request(consumed)?.or_else(|| mps.and_then(|m| m.default_active_thread_percentage));
    let memory = match read_consumed(consumed, attributes::MEMORY)? {
        Some(b) => Some(b),
        None => mps.and_then(|m| m.pinned_limit_bytes(device_name)),
    };
    Ok(ShareLimits {
        active_thread_percentage: mps
            .and_then(|m| m.compute_ceiling)
            .or(compute)
            .filter(|p| *p < 100),
        pinned_memory_bytes: memory,
    })
}

/// The share's consumed `compute` capacity in percent; `None` when it reserved none (0: the claim named
/// memory and no compute, the slice's default, so it reserved none and only its config limits its
/// threads).
pub fn compute_request(consumed: &BTreeMap<String, Quantity>) -> Result<Option<u32>, SharingError> {
    match read_consumed(consumed, attributes::COMPUTE)? {
        Some(p) if (1..=100).contains(&p) => Ok(Some(p as u32)),
        Some(0) | None => Ok(None),
        Some(p) => Err(SharingError::ComputeShare(p)),
    }
}

fn read_consumed(consumed: &BTreeMap<String, Quantity>, name: &str) -> Result<Option<u64>, SharingError> {
    consumed
        .get(name)
        .map(|q| {
            parse_quantity(&q.0).map_err(|source| SharingError::ConsumedCapacity {
                name: name.to_string(),
                value: q.0.clone(),
                source,
            })
        })
        .transpose()
}

/// Strategy of a shared device whose claim has no sharing config; the policy's default too.
pub const DEFAULT_STRATEGY: SharingStrategy = SharingStrategy::Mps;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_and_last_holders_are_reported_and_strategies_do_not_mix() {
        let users = ShareUsers::default();
        assert!(
            users
                .add("GPU-1", "a/gpu-0-shared", SharingStrategy::Mps)
                .unwrap()
        );
        assert!(
            !users
                .add("GPU-1", "b/gpu-0-shared", SharingStrategy::Mps)
                .unwrap()
        );
        assert!(
            !users
                .add("GPU-1", "b/gpu-0-shared", SharingStrategy::Mps)
                .unwrap()
        );
        let err = users
            .add("GPU-1", "c/gpu-0-shared", SharingStrategy::TimeSlicing)
            .unwrap_err();
        assert!(err.to_string().contains("already shared with MPS"), "{err}");
        assert!(!users.remove("GPU-1", "a/gpu-0-shared"));
        assert!(users.remove("GPU-1", "b/gpu-0-shared"));
        assert!(users.remove("GPU-1", "never-added"));
        assert!(
            users
                .add("GPU-1", "c/gpu-0-shared", SharingStrategy::TimeSlicing)
                .unwrap()
        );
    }

    #[test]
    fn a_strategy_conflict_counts_the_other_claims_without_naming_them() {
        let users = ShareUsers::default();
        users
            .add(
                "GPU-1",
                "uid-of-another-namespace/gpu-0-shared",
                SharingStrategy::Mps,
            )
            .unwrap();
        users
            .add(
                "GPU-1",
                "uid-of-a-second-claim/gpu-0-shared",
                SharingStrategy::Mps,
            )
            .unwrap();
        let message = users
            .add("GPU-1", "mine/gpu-0-shared", SharingStrategy::TimeSlicing)
            .unwrap_err()
            .to_string();
        assert!(!message.contains("uid-of"), "{message}");
        assert!(message.contains("by 2 other claim(s)"), "{message}");
    }

    #[test]
    fn a_checkpoint_record_gives_back_the_daemon_defaults_and_an_old_record_none() {
        let limits: BTreeMap<String, String> = [
            ("activeThreadPercentage".to_string(), "25".to_string()),
            (DAEMON_THREAD_LIMIT.to_string(), "40".to_string()),
            (DAEMON_PINNED_LIMIT.to_string(), "20480M".to_string()),
        ]
        .into();
        assert_eq!(
            DaemonNeed::from_limits("GPU-1", &limits),
            DaemonNeed {
                uuid: "GPU-1".into(),
                defaults: DaemonDefaults {
                    active_thread_percentage: Some(40),
                    pinned_memory_bytes: Some(20 << 30),
                },
            }
        );
        let old: BTreeMap<String, String> = [("activeThreadPercentage".to_string(), "25".to_string())].into();
        assert_eq!(
            DaemonNeed::from_limits("GPU-1", &old).defaults,
            DaemonDefaults::default()
        );
    }

    /// Issue 39 item 1: the scheduler packs the request; the share runs with its ceiling.
    #[test]
    fn a_burstable_share_runs_with_its_ceiling_and_a_guaranteed_one_with_its_request() {
        let consumed: BTreeMap<_, _> = [
            ("compute".to_string(), Quantity("30".into())),
            ("memory".to_string(), Quantity("10Gi".into())),
        ]
        .into();
        let burstable = MpsConfig {
            compute_ceiling: Some(80),
            ..Default::default()
        };
        let limits = share_limits(&consumed, Some(&burstable), "gpu-0-shared").unwrap();
        assert_eq!(limits.active_thread_percentage, Some(80));
        assert_eq!(
            limits.pinned_memory_bytes,
            Some(10 << 30),
            "memory stays a hard limit"
        );
        assert_eq!(compute_request(&consumed).unwrap(), Some(30));
        let guaranteed = share_limits(&consumed, Some(&MpsConfig::default()), "gpu-0-shared").unwrap();
        assert_eq!(guaranteed.active_thread_percentage, Some(30));
        let whole = MpsConfig {
            compute_ceiling: Some(100),
            ..Default::default()
        };
        assert_eq!(
            share_limits(&consumed, Some(&whole), "gpu-0-shared")
                .unwrap()
                .active_thread_percentage,
            None,
            "a ceiling of the whole GPU sets no limit"
        );
    }

    #[test]
    fn a_share_keeps_the_daemon_its_pipe_directory_names_and_a_foreign_or_missing_one_names_the_devices() {
        let shared = DeviceName::SharedGpu { gpu: 0 };
        assert_eq!(daemon_key(&shared, Some("team-a")), "gpu-0@team-a");
        assert_eq!(daemon_key(&shared, None), "gpu-0");
        assert_eq!(
            daemon_key_of_share(&shared, Some("/var/lib/tessera/mps/gpu-0@team-a/pipe")),
            "gpu-0@team-a"
        );
        // A record of a plugin before per-namespace daemons.
        assert_eq!(
            daemon_key_of_share(&shared, Some("/var/lib/tessera/mps/gpu-0/pipe")),
            "gpu-0"
        );
        for foreign in [
            Some("/var/lib/tessera/mps/gpu-1@team-a/pipe"),
            Some("/var/lib/tessera/mps/../pipe"),
            Some("/var/lib/tessera/mps/gpu-0@Team_A/pipe"),
            None,
        ] {
            assert_eq!(daemon_key_of_share(&shared, foreign), "gpu-0", "{foreign:?}");
        }
        assert_eq!(check_daemon_key("gpu-0@team-a"), Ok(()));
        assert!(check_daemon_key("gpu-0@").is_err());
        assert!(check_daemon_key("gpu-0@-a").is_err());
        assert!(check_daemon_key("gpu-0@a/b").is_err());
    }

    #[test]
    fn consumed_capacity_wins_over_config_defaults() {
        let mps = MpsConfig {
            default_active_thread_percentage: Some(30),
            default_pinned_device_memory_limit: Some("4Gi".into()),
            ..Default::default()
        };
        let none = BTreeMap::new();
        assert_eq!(
            share_limits(&none, Some(&mps), "gpu-0-shared").unwrap(),
            ShareLimits {
                active_thread_percentage: Some(30),
                pinned_memory_bytes: Some(4 << 30)
            }
        );
        let consumed: BTreeMap<_, _> = [
            ("compute".to_string(), Quantity("25".into())),
            ("memory".to_string(), Quantity("10Gi".into())),
        ]
        .into();
        assert_eq!(
            share_limits(&consumed, Some(&mps), "gpu-0-shared").unwrap(),
            ShareLimits {
                active_thread_percentage: Some(25),
                pinned_memory_bytes: Some(10 << 30)
            }
        );
        let full: BTreeMap<_, _> = [("compute".to_string(), Quantity("100".into()))].into();
        assert_eq!(
            share_limits(&full, None, "gpu-0-shared")
                .unwrap()
                .active_thread_percentage,
            None
        );
        // Memory named, compute not: the slice's default 0 reserves nothing, so only the config caps it.
        let memory_only: BTreeMap<_, _> = [
            ("compute".to_string(), Quantity("0".into())),
            ("memory".to_string(), Quantity("10Gi".into())),
        ]
        .into();
        assert_eq!(
            share_limits(&memory_only, Some(&mps), "gpu-0-shared").unwrap(),
            ShareLimits {
                active_thread_percentage: Some(30),
                pinned_memory_bytes: Some(10 << 30)
            }
        );
        assert_eq!(
            share_limits(&memory_only, None, "gpu-0-shared").unwrap(),
            ShareLimits {
                active_thread_percentage: None,
                pinned_memory_bytes: Some(10 << 30)
            }
        );
        let bad: BTreeMap<_, _> = [("compute".to_string(), Quantity("250".into()))].into();
        assert!(matches!(
            share_limits(&bad, None, "gpu-0-shared"),
            Err(SharingError::ComputeShare(250))
        ));
    }
}
