//! Issue 38, defect N7: an MPS share's usage gauges over the simulated driver's real `libnvidia-ml.so.1`.
//! A real driver lists an MPS client only in `nvmlDeviceGetMPSComputeRunningProcesses_v3` and its
//! `nvidia-cuda-mps-server` (in the MPS supervisor's pod) in the compute list (nvml.h 7447-7488), so a
//! plugin that reads the compute list alone finds no process of any MPS share: every share's gauge reads 0.
//!
//! Build the library first: `cargo build -p tessera-sim-nvml && cargo test -p tessera-kubelet-plugin --test
//! mps_usage`.

#[path = "common/sim_driver.rs"]
mod sim_driver;

use sim_driver::SimDriver;
use tessera_gpu_api::usage::{ProcFixture, UsageQuery};
use tessera_kubelet_plugin::gpu::GpuBackend;
use tessera_kubelet_plugin::metrics::prometheus::{Attribution, claim_usage_attributed};
use tessera_kubelet_plugin::node::checkpoint::{Checkpoint, ClaimRecord, DeviceDetail, DeviceRecord, Phase};
use tessera_sim_model::load::{self as simulated_load, LoadEntry};

const SHARE: &str = "gpu-1-shared";
const POD_A: &str = "aaaaaaaa-0000-4000-8000-000000000001";
const POD_B: &str = "bbbbbbbb-0000-4000-8000-000000000002";
const SUPERVISOR_POD: &str = "5e5e5e5e-0000-4000-8000-000000000003";
const CLIENT_A: u32 = 5001;
const CLIENT_B: u32 = 5002;
/// The MPS server's host PID.
const SERVER: u32 = 6001;

/// An MPS share of GPU 1 prepared for claim `name`, as the checkpoint records it.
fn mps_share(uid: &str, name: &str) -> ClaimRecord {
    ClaimRecord {
        uid: uid.into(),
        namespace: "team".into(),
        name: name.into(),
        phase: Phase::PrepareCompleted,
        devices: vec![DeviceRecord {
            request: "gpu".into(),
            pool: "node-a".into(),
            device: SHARE.into(),
            share_id: None,
            cdi_device_ids: vec![],
            detail: DeviceDetail::Shared(
                serde_json::from_value(serde_json::json!({"gpu": 1, "strategy": "MPS"})).unwrap(),
            ),
            warm_seconds: None,
            cost_ms: None,
        }],
        recovery_error: None,
        completed_at: None,
    }
}

/// A process of a share's container, an MPS client of the server the supervisor runs.
fn mps_client(pid: u32, util: u32, memory_bytes: u64) -> LoadEntry {
    LoadEntry {
        device: SHARE.into(),
        utilization_percent: util,
        memory_bytes,
        pid: Some(pid),
        mps_client: true,
        mps_server_pid: Some(SERVER),
        ..LoadEntry::default()
    }
}

#[test]
fn an_mps_clients_usage_is_charged_to_its_claim_and_its_server_to_none() {
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 2).build();
    simulated_load::set(&driver.kernel, mps_client(CLIENT_A, 40, 3 << 30)).unwrap();
    simulated_load::set(&driver.kernel, mps_client(CLIENT_B, 15, 1 << 30)).unwrap();
    // The host's /proc: each client in its share's pod, the server in the MPS supervisor's pod.
    let proc_fx = ProcFixture::new()
        .cgroupfs_v1(CLIENT_A, "burstable", POD_A)
        .systemd_v2(CLIENT_B, "besteffort", POD_B)
        .cgroupfs_v1(SERVER, "burstable", SUPERVISOR_POD)
        .environ(
            SERVER,
            b"CUDA_MPS_PIPE_DIRECTORY=/var/lib/tessera/mps/gpu-1/pipe\0",
        );
    let host = proc_fx.host();
    let nvml = driver.nvml();

    let usage = nvml
        .usage(&UsageQuery {
            gpu: 1,
            mig: None,
            device: SHARE,
        })
        .unwrap();
    let mut pids: Vec<u32> = usage.processes.iter().map(|p| p.pid).collect();
    pids.sort_unstable();
    assert_eq!(
        pids,
        [CLIENT_A, CLIENT_B, SERVER],
        "the clients from the MPS list, the server from the compute list: {usage:?}"
    );

    let mut checkpoint = Checkpoint::default();
    for record in [mps_share("ua", "a"), mps_share("ub", "b")] {
        checkpoint.claims.insert(record.uid.clone(), record);
    }
    // The supervisor's pod holds no claim; each share's pod holds its own.
    let reserved = |claim: &str| -> Vec<String> {
        match claim {
            "ua" => vec![POD_A.into()],
            "ub" => vec![POD_B.into()],
            _ => vec![],
        }
    };
    let attribution = Attribution {
        host_proc: Some(&host),
        pod_uids_of: Some(&reserved),
    };
    let gauges = claim_usage_attributed(&checkpoint, &nvml, |_| String::new(), &attribution);
    let of = |claim: &str| {
        let u = gauges.iter().find(|u| u.claim == claim).unwrap();
        (u.utilization_ratio, u.memory_used_bytes)
    };
    assert_eq!(of("a"), (Some(0.40), Some(3 << 30)), "{gauges:?}");
    assert_eq!(of("b"), (Some(0.15), Some(1 << 30)), "{gauges:?}");
    let charged: u64 = gauges.iter().filter_map(|u| u.memory_used_bytes).sum();
    assert_eq!(
        charged,
        4 << 30,
        "the server's memory (its clients', {:?}) is charged to no claim",
        usage.processes.iter().find(|p| p.pid == SERVER)
    );
}

/// Without a server PID of its own the device's server is a synthetic process (no /proc entry, so in no
/// pod), named as NVIDIA's: a holder of the GPU, no claim's.
#[test]
fn a_synthetic_mps_server_is_named_like_nvidias_and_lists_no_client_twice() {
    let driver = SimDriver::new().gpus("H100-SXM5-80GB", 2).build();
    let client = LoadEntry {
        mps_server_pid: None,
        ..mps_client(CLIENT_A, 30, 2 << 30)
    };
    simulated_load::set(&driver.kernel, client).unwrap();
    let nvml = driver.nvml_wrapper();
    let device = nvml.device_by_index(1).unwrap();
    let compute = device.running_compute_processes().unwrap();
    let mps = device.mps_running_compute_processes().unwrap();
    assert_eq!(mps.iter().map(|p| p.pid).collect::<Vec<_>>(), [CLIENT_A]);
    assert_eq!(compute.len(), 1, "{compute:?}");
    assert_ne!(compute[0].pid, CLIENT_A, "a client is not in the compute list");
    assert_eq!(
        nvml.sys_process_name(compute[0].pid, 64).unwrap(),
        "nvidia-cuda-mps-server"
    );
    assert!(
        nvml.device_by_index(0)
            .unwrap()
            .mps_running_compute_processes()
            .unwrap()
            .is_empty()
    );
}
