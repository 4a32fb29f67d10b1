//! GPUs behind NVSwitch whose NVLink fabric changes while the plugin runs (issue 38: N3, N13), against the
//! simulated driver root's real `libnvidia-ml.so.1`: the plugin's `NvmlBackend` discovers, and its health
//! source (`NvmlSource`, the probe that reads the fabric) feeds the `Health` the NodeInventory publishes,
//! through the same monitor thread the plugin runs.
//!
//! The simulated fabric completes `fabricCompletesAfterMs` after the driver was loaded (its kernel file's
//! mtime). The tests give it an hour and then move the load time back, so when it completes is up to the
//! test and not to the machine's speed.

#[path = "common/sim_driver.rs"]
mod sim_driver;

use std::{
    fs,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use sim_driver::{BuiltDriver, SimDriver};
use tessera_api::inventory::{DeviceHealth, HealthReason, HealthState};
use tessera_kubelet_plugin::gpu::GpuBackend;
use tessera_kubelet_plugin::gpu::health::sources::NvmlSource;
use tessera_kubelet_plugin::gpu::health::{Health, spawn_monitor};
use tessera_sim_model::backend::{FabricState, GpuGroup};
use tessera_sim_model::faults::{Fault, FaultKind};
use tokio::sync::watch;

const H100: &str = "H100-SXM5-80GB";
const AN_HOUR_MS: u64 = 3_600_000;
/// How often the probe reads the fabric in these tests (10 s in the plugin).
const PROBE: Duration = Duration::from_millis(20);
/// The bound of every wait: generous, since the probe answers within a few of its periods.
const WITHIN: Duration = Duration::from_secs(20);

/// One HGX-like GPU whose fabric is still training at the plugin's start (GPU 0), one without NVSwitch
/// (GPU 1).
fn training_node() -> BuiltDriver {
    SimDriver::new()
        .group(GpuGroup {
            fabric: FabricState::InProgress,
            fabric_completes_after_ms: Some(AN_HOUR_MS),
            ..GpuGroup::plain(H100)
        })
        .gpus(H100, 1)
        .build()
}

/// Fabric manager finishes: the simulated driver was loaded long enough ago for the fabric to complete.
fn let_the_fabric_complete(driver: &BuiltDriver) {
    let two_hours_ago = SystemTime::now() - Duration::from_secs(7_200);
    fs::File::options()
        .write(true)
        .open(driver.kernel.join("kernel.json"))
        .unwrap()
        .set_modified(two_hours_ago)
        .unwrap();
}

/// The plugin's start: discovery, then the health monitor over what discovery found. Returns the GPUs
/// discovered, the health the inventory publishes, and the monitor's stop switch.
fn start(driver: &BuiltDriver) -> (Vec<u32>, Arc<Health>, watch::Sender<bool>) {
    let backend = Arc::new(driver.nvml());
    let found = backend.discover().unwrap();
    let gpus: Vec<u32> = found.gpus.iter().map(|g| g.index).collect();
    let health = Health::new(gpus.clone());
    let count = gpus.iter().map(|g| g + 1).max().unwrap_or(0);
    let source = NvmlSource::new(backend, count, vec![]).probe_every(PROBE);
    let (stop, stopped) = watch::channel(false);
    spawn_monitor(Box::new(source), health.clone(), Arc::new(|_, _| None), stopped).unwrap();
    (gpus, health, stop)
}

fn gpu(health: &Health, gpu: u32) -> DeviceHealth {
    health
        .status()
        .into_iter()
        .find(|h| h.gpu == gpu && h.mig.is_none())
        .unwrap_or_else(|| panic!("GPU {gpu} is not in the published health"))
}

/// Waits (bounded) until GPU `index`'s published health satisfies `want`.
fn wait_for(health: &Health, index: u32, what: &str, want: impl Fn(&DeviceHealth) -> bool) -> DeviceHealth {
    let deadline = Instant::now() + WITHIN;
    loop {
        let h = gpu(health, index);
        if want(&h) {
            return h;
        }
        assert!(
            Instant::now() < deadline,
            "GPU {index} never became {what}: {h:?}"
        );
        std::thread::sleep(PROBE);
    }
}

fn fabric_failure(h: &DeviceHealth) -> bool {
    h.state == HealthState::Unhealthy && h.reason == Some(HealthReason::Fabric)
}

#[test]
fn a_gpu_whose_fabric_completes_after_the_plugin_started_is_offered_without_a_restart() {
    let driver = training_node();
    let (gpus, health, stop) = start(&driver);
    // b31ad79..9b52720 left the GPU out at this one discovery and never looked again: 0 GPUs on an
    // HGX node until the plugin pod was deleted.
    assert_eq!(gpus, [0, 1], "a GPU whose fabric trains is kept, not left out");
    let training = gpu(&health, 0);
    assert!(
        fabric_failure(&training),
        "tainted from the first publication on: {training:?}"
    );
    let message = training.message.unwrap_or_default();
    assert!(
        message.contains("in progress") && message.contains("NoSchedule"),
        "{message}"
    );
    assert_eq!(
        gpu(&health, 1).state,
        HealthState::Healthy,
        "no NVSwitch, nothing to wait for"
    );

    let_the_fabric_complete(&driver);
    wait_for(&health, 0, "healthy", |h| h.state == HealthState::Healthy);
    stop.send_replace(true);
}

#[test]
fn a_gpu_whose_fabric_degrades_is_tainted_and_offered_again_once_it_recovers() {
    let driver = training_node();
    let_the_fabric_complete(&driver);
    let (gpus, health, stop) = start(&driver);
    assert_eq!(gpus, [0, 1]);
    assert_eq!(
        gpu(&health, 0).state,
        HealthState::Healthy,
        "a completed, HEALTHY fabric"
    );

    // N13: the v3 health summary is read, not only the state (which stays COMPLETED).
    let faults = driver.model.health();
    faults
        .inject(Fault::failing(0, FaultKind::FabricDegraded))
        .unwrap();
    let degraded = wait_for(&health, 0, "tainted for its fabric", fabric_failure);
    let message = degraded.message.unwrap_or_default();
    assert!(message.contains("LIMITED_CAPACITY"), "{message}");
    assert_eq!(gpu(&health, 1).state, HealthState::Healthy);

    faults.recover(0).unwrap();
    wait_for(&health, 0, "healthy again", |h| h.state == HealthState::Healthy);

    faults
        .inject(Fault::failing(0, FaultKind::FabricUnhealthy))
        .unwrap();
    let unhealthy = wait_for(&health, 0, "tainted for its fabric", fabric_failure);
    assert!(
        unhealthy.message.unwrap_or_default().contains("UNHEALTHY"),
        "fabric manager gone"
    );
    stop.send_replace(true);
}
