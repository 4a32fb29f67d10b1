//! What this node's NVIDIA driver does where the simulated driver (`kubelet-plugin/sim-driver`) may be kinder
//! than NVIDIA's: the facts behind `make gpu-check` section 7, one line per fact, then one `verdict` line
//! per simulator rule. Read-only: it changes no MIG mode, compute mode or time slice, creates or destroys no
//! MIG instance, starts no MPS daemon and resets nothing.
//!
//! ```text
//! cargo build -p tessera-kubelet-plugin --example driver_facts
//! target/debug/examples/driver_facts --driver-root /run/nvidia/driver
//! ```
//!
//! Facts (space-separated `key=value`; NVML return codes by name, `MISSING_SYMBOL` where the library lacks
//! the call):
//!
//! - `driver`: the library loaded, driver and NVML versions, GPU count;
//! - `gpu`: per GPU, UUID, name, MIG mode current/pending (`nvmlDeviceGetMigMode`);
//! - `gi_profile`: per GPU and GPU-instance profile index 0..=0x9, the v1 call
//!   (`nvmlDeviceGetGpuInstanceProfileInfo`) and the V call (`nvmlDeviceGetGpuInstanceProfileInfoV`, v3
//!   struct, then v2 on ARGUMENT_VERSION_MISMATCH) (N6);
//! - `process_list` and `process`: `nvmlDeviceGetComputeRunningProcesses_v3` against
//!   `nvmlDeviceGetMPSComputeRunningProcesses_v3`, PIDs and used memory (N7);
//! - `samples`: the PIDs `nvmlDeviceGetProcessUtilization` stamps its samples with (N7: a client's own or
//!   its server's);
//! - `mps_host`: MPS control daemons, servers and likely clients (processes that map `libcuda.so` with
//!   `CUDA_MPS_PIPE_DIRECTORY` in their environment) found in `/proc` (N7);
//! - `fabric`: `nvmlDeviceGetGpuFabricInfoV` (v3, then v2) or `nvmlDeviceGetGpuFabricInfo`: state, status,
//!   clique, `healthMask`, `healthSummary`; read at the start and again after the timing below (N3/N13);
//! - `uuid_lookup`: per GPU, 8 threads calling `nvmlDeviceGetHandleByUUID` for its UUID at once, several
//!   rounds, while another thread runs a usage-like scrape (handle by UUID, utilization, both process
//!   lists) over every GPU: median and max (N8).
//!
//! `verdict` lines are tab-separated: rule, what the simulator does, what this node did, and `CONFIRMED`,
//! `CONTRADICTED` or `NOT SEEN`. A contradiction is a finding for the simulator, not a failure: the program
//! exits 0 when it could ask the driver, 2 when NVML does not load or no GPU answers.
#![allow(
    unsafe_code,
    reason = "raw NVML calls nvml-wrapper does not wrap (GI profile info v1/V, fabric info V), as in \
              kubelet-plugin/src/gpu/nvml_raw.rs"
)]

use std::{
    collections::BTreeSet,
    ffi::OsStr,
    fmt, fs, mem,
    os::raw::c_uint,
    path::PathBuf,
    ptr,
    sync::{
        Barrier,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Parser;
use nvml_wrapper::{Device, Nvml, enums::device::UsedGpuMemory, error::NvmlError, error::nvml_sym};
use nvml_wrapper_sys::bindings::{
    nvmlGpuFabricInfo_t, nvmlGpuFabricInfo_v2_t, nvmlGpuFabricInfoV_t, nvmlGpuInstanceProfileInfo_t,
    nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstanceProfileInfo_v3_t,
};
use tessera_kubelet_plugin::gpu::nvml::library_path;

// === NVML return codes (nvml.h) ===

const SUCCESS: u32 = 0;
const NOT_SUPPORTED: u32 = 3;
const ARGUMENT_VERSION_MISMATCH: u32 = 25;
/// Not NVML's: the driver's library lacks the symbol.
const MISSING_SYMBOL: u32 = u32::MAX;

fn code_name(code: u32) -> String {
    match code {
        0 => "SUCCESS".into(),
        1 => "UNINITIALIZED".into(),
        2 => "INVALID_ARGUMENT".into(),
        3 => "NOT_SUPPORTED".into(),
        4 => "NO_PERMISSION".into(),
        6 => "NOT_FOUND".into(),
        7 => "INSUFFICIENT_SIZE".into(),
        9 => "DRIVER_NOT_LOADED".into(),
        10 => "TIMEOUT".into(),
        13 => "FUNCTION_NOT_FOUND".into(),
        15 => "GPU_IS_LOST".into(),
        18 => "LIB_RM_VERSION_MISMATCH".into(),
        19 => "IN_USE".into(),
        25 => "ARGUMENT_VERSION_MISMATCH".into(),
        999 => "UNKNOWN".into(),
        MISSING_SYMBOL => "MISSING_SYMBOL".into(),
        other => format!("ERROR_{other}"),
    }
}

fn wrapper_code(e: NvmlError) -> u32 {
    match e {
        NvmlError::FailedToLoadSymbol(_) => MISSING_SYMBOL,
        e => e.into(),
    }
}

/// `NVML_STRUCT_VERSION(name, ver)`.
const fn struct_version<T>(version: u32) -> c_uint {
    (mem::size_of::<T>() as u32) | (version << 24)
}

/// GI profile indices asked about: 0..=0x9 covers every H100/H200/A100 profile (`1g` … `7g`, `+me`,
/// `1g.20gb`, `2g+me`).
const GI_PROFILE_INDICES: std::ops::RangeInclusive<u32> = 0..=0x9;

/// `nvmlDeviceGetHandleByUUID` threads per round (the plugin's health probe, scrapes and prepares on an
/// 8-GPU node at once).
const LOOKUP_THREADS: usize = 8;
/// Rounds per GPU, one every [`LOOKUP_SPACING`]: about a second of lookups beside the scrape.
const LOOKUP_ROUNDS: usize = 20;
const LOOKUP_SPACING: Duration = Duration::from_millis(50);
/// A GPU's lookups stop after this long, whatever the rounds left: a driver that takes O(10 s) per lookup
/// would otherwise keep the check for minutes.
const LOOKUP_TIME_BOX: Duration = Duration::from_secs(30);
/// A median lookup at least this slow is slower than the simulator's default (1 ms per concurrent caller,
/// about 8 ms for [`LOOKUP_THREADS`]), and the plugin's whole prepare budget (p99 ≤ 10 ms).
const SLOW_MEDIAN: Duration = Duration::from_millis(10);
/// One lookup at least this slow is NVIDIA's "O(10 s) when done concurrently" showing.
const SLOW_MAX: Duration = Duration::from_secs(1);

// === facts ===

#[derive(Clone, Debug, PartialEq, Eq)]
struct Process {
    pid: u32,
    used_bytes: Option<u64>,
}

/// One GI profile index on one GPU: the v1 call's code, the V call's (v3, or v2 where v3 got
/// ARGUMENT_VERSION_MISMATCH) and the struct version that code is for.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ProfileFacts {
    index: u32,
    v1: u32,
    v: u32,
    v_version: u32,
    name: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Fabric {
    call: &'static str,
    code: u32,
    version: u32,
    state: u8,
    status: u32,
    clique: u32,
    health_mask: Option<u32>,
    health_summary: Option<u8>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Lookups {
    alone: Duration,
    samples: Vec<Duration>,
    failures: Vec<u32>,
    scrapes: u64,
}

impl Lookups {
    fn median(&self) -> Option<Duration> {
        let mut s = self.samples.clone();
        s.sort_unstable();
        s.get(s.len() / 2).copied()
    }

    fn max(&self) -> Option<Duration> {
        self.samples.iter().max().copied()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct GpuFacts {
    index: u32,
    uuid: String,
    /// `(current, pending)`, or the code of `nvmlDeviceGetMigMode` (NOT_SUPPORTED: a GPU without MIG).
    mig: Result<(u32, u32), u32>,
    profiles: Vec<ProfileFacts>,
    compute: Result<Vec<Process>, u32>,
    mps: Result<Vec<Process>, u32>,
    /// The PIDs of `nvmlDeviceGetProcessUtilization`'s samples (NOT_FOUND: none in the driver's buffer).
    samples: Result<Vec<u32>, u32>,
    /// In time order: at the start, after the lookups.
    fabric: Vec<Fabric>,
    lookups: Option<Lookups>,
}

/// MPS processes on the host, from `/proc`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct MpsHost {
    daemons: Vec<u32>,
    servers: Vec<u32>,
    /// Processes that map `libcuda.so` with `CUDA_MPS_PIPE_DIRECTORY` set: an MPS share's workload.
    clients: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq)]
struct Facts {
    gpus: Vec<GpuFacts>,
    mps: MpsHost,
    /// Seconds between the two fabric readings.
    fabric_interval_s: f64,
}

// === verdicts ===

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Confirmed,
    Contradicted,
    NotSeen,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Confirmed => "CONFIRMED",
            Verdict::Contradicted => "CONTRADICTED",
            Verdict::NotSeen => "NOT SEEN",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Row {
    rule: &'static str,
    simulator: &'static str,
    node: String,
    verdict: Verdict,
}

const N6_V: &str = "N6 V call with MIG off";
const N6_V1: &str = "N6 v1 call with MIG off";
const N7: &str = "N7 MPS clients in the MPS list";
const N7_SAMPLES: &str = "N7 MPS clients' utilization samples";
const N8: &str = "N8 UUID lookup under concurrency";
const N3: &str = "N3 fabric";

/// Every rule's row, in the table's order.
fn verdicts(facts: &Facts) -> Vec<Row> {
    let (v, v1) = mig_off_profiles(facts);
    vec![
        v,
        v1,
        mps_clients(facts),
        mps_samples(facts),
        uuid_lookup(facts),
        fabric(facts),
    ]
}

/// `(gpu, profile index)` pairs as `indices 0x0,0x1 on GPU 0,1` (`; `-separated where the GPUs differ).
fn indices(list: &[(u32, u32)]) -> String {
    let mut by_gpu: std::collections::BTreeMap<u32, Vec<String>> = Default::default();
    for (gpu, index) in list {
        by_gpu.entry(*gpu).or_default().push(format!("{index:#x}"));
    }
    let mut groups: Vec<(String, Vec<String>)> = Vec::new();
    for (gpu, idx) in by_gpu {
        let idx = idx.join(",");
        match groups.iter_mut().find(|(i, _)| *i == idx) {
            Some((_, gpus)) => gpus.push(gpu.to_string()),
            None => groups.push((idx, vec![gpu.to_string()])),
        }
    }
    groups
        .into_iter()
        .map(|(idx, gpus)| format!("indices {idx} on GPU {}", gpus.join(",")))
        .collect::<Vec<_>>()
        .join("; ")
}

/// N6: on GPUs that support MIG with MIG mode off, the simulator answers the v1 profile call with the GPU's
/// profiles (nvml.h:12824 refuses it only where the GPU "doesn't support MIG") and refuses the V call with
/// NOT_SUPPORTED (nvml.h:12855: "If device doesn't have MIG mode enabled"). The plugin reads profiles
/// through v1 and asks V for names only with MIG on, so a V that answers with MIG off only makes the
/// simulator stricter than the driver; a v1 that refuses would hide every profile of a MIG-off GPU.
fn mig_off_profiles(facts: &Facts) -> (Row, Row) {
    let sim_v = "refuses every profile (NOT_SUPPORTED) with MIG off, where v1 answers";
    let sim_v1 = "answers the GPU's profiles (SUCCESS) with MIG off";
    let off: Vec<&GpuFacts> = facts
        .gpus
        .iter()
        .filter(|g| matches!(g.mig, Ok((0, _))))
        .collect();
    if off.is_empty() {
        let why = if facts.gpus.iter().any(|g| g.mig.is_ok()) {
            "MIG mode is on on every MIG-capable GPU: nothing to ask with MIG off".to_string()
        } else {
            "no GPU supports MIG (nvmlDeviceGetMigMode answers an error on every GPU)".to_string()
        };
        return (
            Row {
                rule: N6_V,
                simulator: sim_v,
                node: why.clone(),
                verdict: Verdict::NotSeen,
            },
            Row {
                rule: N6_V1,
                simulator: sim_v1,
                node: why,
                verdict: Verdict::NotSeen,
            },
        );
    }
    let gpus = off
        .iter()
        .map(|g| g.index.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut v1_ok = Vec::new();
    let mut v_ok = Vec::new();
    // Indices v1 answers and V refuses, with V's code.
    let mut v_refused: Vec<((u32, u32), u32)> = Vec::new();
    let mut v1_codes = BTreeSet::new();
    for g in &off {
        for p in &g.profiles {
            v1_codes.insert(code_name(p.v1));
            if p.v1 == SUCCESS {
                v1_ok.push((g.index, p.index));
            }
            if p.v == SUCCESS {
                v_ok.push((g.index, p.index));
            } else if p.v1 == SUCCESS && p.v != MISSING_SYMBOL {
                v_refused.push(((g.index, p.index), p.v));
            }
        }
    }
    let v1_row = if v1_ok.is_empty() {
        Row {
            rule: N6_V1,
            simulator: sim_v1,
            node: format!(
                "MIG off on GPU {gpus}: v1 answers {} for every index 0..0x9",
                v1_codes.into_iter().collect::<Vec<_>>().join("/")
            ),
            verdict: Verdict::Contradicted,
        }
    } else {
        Row {
            rule: N6_V1,
            simulator: sim_v1,
            node: format!(
                "MIG off on GPU {gpus}: v1 answers {} profiles ({})",
                v1_ok.len(),
                indices(&v1_ok)
            ),
            verdict: Verdict::Confirmed,
        }
    };
    let other_refusals: Vec<&((u32, u32), u32)> = v_refused
        .iter()
        .filter(|(_, code)| *code != NOT_SUPPORTED)
        .collect();
    let v_row = if !v_ok.is_empty() {
        Row {
            rule: N6_V,
            simulator: sim_v,
            node: format!(
                "MIG off on GPU {gpus}: V answers {} profiles ({}); {} refused",
                v_ok.len(),
                indices(&v_ok),
                v_refused.len()
            ),
            verdict: Verdict::Contradicted,
        }
    } else if !other_refusals.is_empty() {
        let codes: BTreeSet<String> = other_refusals.iter().map(|(_, c)| code_name(*c)).collect();
        let at: Vec<(u32, u32)> = other_refusals.iter().map(|(at, _)| *at).collect();
        Row {
            rule: N6_V,
            simulator: sim_v,
            node: format!(
                "MIG off on GPU {gpus}: V answers {} (not NOT_SUPPORTED) for {} profiles v1 answers ({})",
                codes.into_iter().collect::<Vec<_>>().join("/"),
                at.len(),
                indices(&at)
            ),
            verdict: Verdict::Contradicted,
        }
    } else if !v_refused.is_empty() {
        let at: Vec<(u32, u32)> = v_refused.iter().map(|(at, _)| *at).collect();
        Row {
            rule: N6_V,
            simulator: sim_v,
            node: format!(
                "MIG off on GPU {gpus}: V answers NOT_SUPPORTED for all {} profiles v1 answers ({})",
                at.len(),
                indices(&at)
            ),
            verdict: Verdict::Confirmed,
        }
    } else {
        Row {
            rule: N6_V,
            simulator: sim_v,
            node: format!(
                "MIG off on GPU {gpus}: no profile v1 answers was asked of V (v1 answered none, or the \
                 library lacks the V call), nothing to compare"
            ),
            verdict: Verdict::NotSeen,
        }
    };
    (v_row, v1_row)
}

fn pids(list: &[u32]) -> String {
    if list.is_empty() {
        return "-".into();
    }
    list.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// N7, its second half: the simulator stamps a busy MPS client's utilization samples with the client's own
/// PID, which is what lets tessera charge a share its SM use. nvml.h does not say which PID a real driver
/// puts there under MPS; if it is the server's, MPS shares' utilization reads 0 whatever the lists say.
fn mps_samples(facts: &Facts) -> Row {
    let simulator = "a busy MPS client's utilization samples carry its own PID";
    let mut clients: BTreeSet<u32> = facts.mps.clients.iter().copied().collect();
    let mut sampled = BTreeSet::new();
    for g in &facts.gpus {
        if let Ok(list) = &g.mps {
            clients.extend(list.iter().map(|p| p.pid));
        }
        if let Ok(list) = &g.samples {
            sampled.extend(list.iter().copied());
        }
    }
    let of_clients: Vec<u32> = sampled.iter().copied().filter(|p| clients.contains(p)).collect();
    let of_servers: Vec<u32> = facts
        .mps
        .servers
        .iter()
        .copied()
        .filter(|p| sampled.contains(p))
        .collect();
    let node = format!(
        "samples of clients {}, of servers {}",
        pids(&of_clients),
        pids(&of_servers)
    );
    let (node, verdict) = if clients.is_empty() {
        (
            "no MPS client running: start one busy share and re-run".to_string(),
            Verdict::NotSeen,
        )
    } else if !of_clients.is_empty() {
        (node, Verdict::Confirmed)
    } else if !of_servers.is_empty() {
        (
            format!("{node}: the driver stamps MPS work with the server's PID"),
            Verdict::Contradicted,
        )
    } else {
        (
            format!("{node}: no sample of MPS work; make the share busy and re-run"),
            Verdict::NotSeen,
        )
    };
    Row {
        rule: N7_SAMPLES,
        simulator,
        node,
        verdict,
    }
}

/// N7: the simulator lists an MPS client only in `nvmlDeviceGetMPSComputeRunningProcesses_v3` and, while
/// its clients run, their server in `nvmlDeviceGetComputeRunningProcesses_v3`, as nvml.h (7447-7488) and the
/// MPS server's role (it holds the GPU context) say; tessera's usage gauges read both lists.
fn mps_clients(facts: &Facts) -> Row {
    let simulator = "an MPS client only in nvmlDeviceGetMPSComputeRunningProcesses_v3, \
                     its server in the compute list";
    let mps = &facts.mps;
    let mut in_mps_list = BTreeSet::new();
    let mut mps_errors = BTreeSet::new();
    let mut compute = BTreeSet::new();
    for g in &facts.gpus {
        match &g.mps {
            Ok(list) => in_mps_list.extend(list.iter().map(|p| p.pid)),
            Err(code) => {
                mps_errors.insert(code_name(*code));
            }
        }
        if let Ok(list) = &g.compute {
            compute.extend(list.iter().map(|p| p.pid));
        }
    }
    let servers_listed: Vec<u32> = mps
        .servers
        .iter()
        .copied()
        .filter(|p| compute.contains(p))
        .collect();
    let mut clients_listed: BTreeSet<u32> = mps
        .clients
        .iter()
        .copied()
        .filter(|p| compute.contains(p))
        .collect();
    clients_listed.extend(in_mps_list.iter().copied().filter(|p| compute.contains(p)));
    let clients_listed: Vec<u32> = clients_listed.into_iter().collect();
    let in_mps_list: Vec<u32> = in_mps_list.into_iter().collect();
    let running = format!(
        "daemon {}, server {}, clients {}",
        pids(&mps.daemons),
        pids(&mps.servers),
        pids(&mps.clients)
    );
    if mps.clients.is_empty() && in_mps_list.is_empty() {
        let others = if mps.daemons.is_empty() && mps.servers.is_empty() {
            String::new()
        } else {
            format!(" ({running})")
        };
        return Row {
            rule: N7,
            simulator,
            node: format!("no MPS client running{others}: start one share and re-run"),
            verdict: Verdict::NotSeen,
        };
    }
    let mut against = Vec::new();
    if !clients_listed.is_empty() {
        against.push(format!("clients {} in the compute list", pids(&clients_listed)));
    }
    if in_mps_list.is_empty() {
        let why = if mps_errors.is_empty() {
            String::new()
        } else {
            format!(
                " (it answered {})",
                mps_errors.into_iter().collect::<Vec<_>>().join("/")
            )
        };
        against.push(format!("the MPS list names no client{why}"));
    }
    if !mps.servers.is_empty() && servers_listed.is_empty() {
        against.push("no running server in the compute list".to_string());
    }
    let node = format!(
        "{running}; MPS list: {}; compute list: server {}, clients {}",
        pids(&in_mps_list),
        pids(&servers_listed),
        pids(&clients_listed)
    );
    if against.is_empty() {
        Row {
            rule: N7,
            simulator,
            node,
            verdict: Verdict::Confirmed,
        }
    } else {
        Row {
            rule: N7,
            simulator,
            node: format!("{node}: {}", against.join("; ")),
            verdict: Verdict::Contradicted,
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

/// N8: the simulator's lookup costs `latencies.handleByUuidMs` (1 ms by default) per caller inside it at
/// once, so 8 threads wait about 8 ms each; NVIDIA's DRA driver says O(10 s) under concurrency. A node
/// slower than that default (or failing a lookup of a healthy GPU) shows the simulator kinder than the
/// driver: raise the default.
fn uuid_lookup(facts: &Facts) -> Row {
    let simulator = "1 ms per concurrent caller (8 threads: ~8 ms each); fails only past a lost GPU";
    let timed: Vec<(u32, &Lookups)> = facts
        .gpus
        .iter()
        .filter_map(|g| g.lookups.as_ref().map(|l| (g.index, l)))
        .filter(|(_, l)| !l.samples.is_empty() || !l.failures.is_empty())
        .collect();
    if timed.is_empty() {
        return Row {
            rule: N8,
            simulator,
            node: "no lookup was timed".into(),
            verdict: Verdict::NotSeen,
        };
    }
    let all = Lookups {
        samples: timed
            .iter()
            .flat_map(|(_, l)| l.samples.iter().copied())
            .collect(),
        failures: timed
            .iter()
            .flat_map(|(_, l)| l.failures.iter().copied())
            .collect(),
        alone: timed.iter().map(|(_, l)| l.alone).max().unwrap_or_default(),
        scrapes: timed.iter().map(|(_, l)| l.scrapes).sum(),
    };
    let (median, max) = (all.median().unwrap_or_default(), all.max().unwrap_or_default());
    let slowest = timed
        .iter()
        .max_by_key(|(_, l)| l.max().unwrap_or_default())
        .map(|(g, _)| *g)
        .unwrap_or_default();
    let mut node = format!(
        "{LOOKUP_THREADS} threads x {} GPUs under a scrape loop ({} scrapes): {} lookups, median {}, max {} \
         (GPU {slowest}); alone {}",
        timed.len(),
        all.scrapes,
        all.samples.len(),
        ms(median),
        ms(max),
        ms(all.alone)
    );
    if !all.failures.is_empty() {
        let codes: BTreeSet<String> = all.failures.iter().map(|c| code_name(*c)).collect();
        node.push_str(&format!(
            "; {} lookups failed ({})",
            all.failures.len(),
            codes.into_iter().collect::<Vec<_>>().join("/")
        ));
    }
    let verdict = if !all.failures.is_empty() || median >= SLOW_MEDIAN || max >= SLOW_MAX {
        Verdict::Contradicted
    } else {
        Verdict::Confirmed
    };
    Row {
        rule: N8,
        simulator,
        node,
        verdict,
    }
}

fn fabric_state(state: u8) -> String {
    match state {
        0 => "NOT_SUPPORTED".into(),
        1 => "NOT_STARTED".into(),
        2 => "IN_PROGRESS".into(),
        3 => "COMPLETED".into(),
        s => format!("STATE_{s}"),
    }
}

fn health_summary(summary: u8) -> String {
    match summary {
        0 => "NOT_SUPPORTED".into(),
        1 => "HEALTHY".into(),
        2 => "UNHEALTHY".into(),
        3 => "LIMITED_CAPACITY".into(),
        s => format!("SUMMARY_{s}"),
    }
}

/// N3/N13: the simulator's fabric state is the node file's, moving forward only (IN_PROGRESS or
/// NOT_STARTED to COMPLETED once `fabricCompletesAfterMs` passed), status SUCCESS; a completed fabric
/// answers a real v3 `healthSummary` (HEALTHY, or LIMITED_CAPACITY/UNHEALTHY under an injected fabric
/// fault) and a fabric not completed 0 (NOT_SUPPORTED) with `healthMask` 0 (nvml.h 3890-3893).
fn fabric(facts: &Facts) -> Row {
    let simulator = "node-file state, completing once after fabricCompletesAfterMs and never going back, \
                     status SUCCESS; completed: healthSummary HEALTHY (LIMITED_CAPACITY/UNHEALTHY under a \
                     fabric fault), not completed: healthSummary 0 (NOT_SUPPORTED); NOT_SUPPORTED without \
                     NVSwitch";
    let with_fabric: Vec<&GpuFacts> = facts
        .gpus
        .iter()
        .filter(|g| g.fabric.iter().any(|f| f.code == SUCCESS && f.state != 0))
        .collect();
    if with_fabric.is_empty() {
        let codes: BTreeSet<String> = facts
            .gpus
            .iter()
            .flat_map(|g| g.fabric.iter().map(|f| code_name(f.code)))
            .collect();
        return Row {
            rule: N3,
            simulator,
            node: format!(
                "no NVSwitch fabric: {} on every GPU",
                codes.into_iter().collect::<Vec<_>>().join("/")
            ),
            verdict: Verdict::NotSeen,
        };
    }
    let mut findings = Vec::new();
    let mut states = BTreeSet::new();
    let mut summaries = BTreeSet::new();
    for g in &with_fabric {
        let answered: Vec<&Fabric> = g.fabric.iter().filter(|f| f.code == SUCCESS).collect();
        states.extend(answered.iter().map(|f| fabric_state(f.state)));
        if let (Some(first), Some(last)) = (g.fabric.first(), g.fabric.last())
            && (first.code, first.state) != (last.code, last.state)
        {
            // The simulator's fabric only completes: anything else is news.
            let forward =
                first.code == SUCCESS && last.code == SUCCESS && first.state < last.state && last.state == 3;
            let what = format!(
                "GPU {}: {} became {} within {:.1} s",
                g.index,
                if first.code == SUCCESS {
                    fabric_state(first.state)
                } else {
                    code_name(first.code)
                },
                if last.code == SUCCESS {
                    fabric_state(last.state)
                } else {
                    code_name(last.code)
                },
                facts.fabric_interval_s
            );
            if forward {
                summaries.insert(what);
            } else {
                findings.push(what);
            }
        }
        if let Some(f) = answered.iter().find(|f| f.status != SUCCESS) {
            findings.push(format!("GPU {}: status {}", g.index, code_name(f.status)));
        }
        for f in &answered {
            let Some(summary) = f.health_summary else { continue };
            summaries.insert(format!("healthSummary {}", health_summary(summary)));
            // Completed with no judgement, or judged before completion: not what the simulator answers.
            if (f.state == 3) == (summary == 0) {
                findings.push(format!(
                    "GPU {}: state {}, healthMask {:#x}, healthSummary {}",
                    g.index,
                    fabric_state(f.state),
                    f.health_mask.unwrap_or(0),
                    health_summary(summary)
                ));
                break;
            }
        }
    }
    let seen = format!(
        "{} GPUs with a fabric, state {}{}",
        with_fabric.len(),
        states.into_iter().collect::<Vec<_>>().join("/"),
        summaries
            .into_iter()
            .map(|s| format!(", {s}"))
            .collect::<String>()
    );
    if findings.is_empty() {
        Row {
            rule: N3,
            simulator,
            node: format!("{seen}, status SUCCESS, over {:.1} s", facts.fabric_interval_s),
            verdict: Verdict::Confirmed,
        }
    } else {
        Row {
            rule: N3,
            simulator,
            node: format!("{seen}; {}", findings.join("; ")),
            verdict: Verdict::Contradicted,
        }
    }
}

// === reading the driver ===

#[derive(Parser)]
#[command(about = "Read-only NVML facts for make gpu-check section 7")]
struct Args {
    /// The driver root (`/`, `/run/nvidia/driver`, `/home/kubernetes/bin/nvidia`, …).
    #[arg(long, default_value = "/")]
    driver_root: PathBuf,
    /// `nvmlDeviceGetHandleByUUID` rounds per GPU.
    #[arg(long, default_value_t = LOOKUP_ROUNDS)]
    rounds: usize,
}

/// Quotes a value with spaces, so every fact stays `key=value` separated by spaces.
fn v(s: &str) -> String {
    if s.is_empty() || s.contains(char::is_whitespace) || s.contains('"') {
        format!("{s:?}")
    } else {
        s.to_string()
    }
}

fn gi_profile(nvml: &Nvml, device: &Device<'_>, index: u32) -> ProfileFacts {
    let lib = nvml.lib();
    let mut facts = ProfileFacts {
        index,
        v1: MISSING_SYMBOL,
        v: MISSING_SYMBOL,
        v_version: 3,
        name: None,
    };
    // SAFETY: the handle belongs to a live Device; every struct is plain data the driver fills in, with the
    // version field naming its layout (the v3 struct passed through the binding's v2 pointer type, as
    // nvml.h does and nvml_raw.rs does).
    unsafe {
        let handle = device.handle();
        if let Ok(get_v1) = nvml_sym(lib.nvmlDeviceGetGpuInstanceProfileInfo.as_ref()) {
            let mut v1: nvmlGpuInstanceProfileInfo_t = mem::zeroed();
            facts.v1 = get_v1(handle, index, &mut v1);
        }
        if let Ok(get_v) = nvml_sym(lib.nvmlDeviceGetGpuInstanceProfileInfoV.as_ref()) {
            let mut v3: nvmlGpuInstanceProfileInfo_v3_t = mem::zeroed();
            v3.version = struct_version::<nvmlGpuInstanceProfileInfo_v3_t>(3);
            facts.v = get_v(handle, index, ptr::from_mut(&mut v3).cast());
            if facts.v == SUCCESS {
                facts.name = c_name(&v3.name);
            } else if facts.v == ARGUMENT_VERSION_MISMATCH {
                let mut v2: nvmlGpuInstanceProfileInfo_v2_t = mem::zeroed();
                v2.version = struct_version::<nvmlGpuInstanceProfileInfo_v2_t>(2);
                facts.v = get_v(handle, index, &mut v2);
                facts.v_version = 2;
                if facts.v == SUCCESS {
                    facts.name = c_name(&v2.name);
                }
            }
        }
    }
    facts
}

fn c_name(raw: &[std::os::raw::c_char]) -> Option<String> {
    let bytes: Vec<u8> = raw.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    let name = String::from_utf8(bytes).ok()?;
    let name = name.trim();
    (!name.is_empty()).then(|| name.trim_start_matches("MIG ").to_string())
}

fn fabric_info(nvml: &Nvml, device: &Device<'_>) -> Fabric {
    let lib = nvml.lib();
    // SAFETY: as in `gi_profile`; the v2 struct is the v3 one's prefix.
    unsafe {
        let handle = device.handle();
        if let Ok(get_v) = nvml_sym(lib.nvmlDeviceGetGpuFabricInfoV.as_ref()) {
            let mut v3: nvmlGpuFabricInfoV_t = mem::zeroed();
            v3.version = struct_version::<nvmlGpuFabricInfoV_t>(3);
            let code = get_v(handle, &mut v3);
            if code != ARGUMENT_VERSION_MISMATCH {
                return Fabric {
                    call: "nvmlDeviceGetGpuFabricInfoV",
                    code,
                    version: 3,
                    state: v3.state,
                    status: v3.status,
                    clique: v3.cliqueId,
                    health_mask: Some(v3.healthMask),
                    health_summary: Some(v3.healthSummary),
                };
            }
            let mut v2: nvmlGpuFabricInfo_v2_t = mem::zeroed();
            v2.version = struct_version::<nvmlGpuFabricInfo_v2_t>(2);
            let code = get_v(handle, ptr::from_mut(&mut v2).cast());
            if code != ARGUMENT_VERSION_MISMATCH {
                return Fabric {
                    call: "nvmlDeviceGetGpuFabricInfoV",
                    code,
                    version: 2,
                    state: v2.state,
                    status: v2.status,
                    clique: v2.cliqueId,
                    health_mask: Some(v2.healthMask),
                    health_summary: None,
                };
            }
        }
        let Ok(get_v1) = nvml_sym(lib.nvmlDeviceGetGpuFabricInfo.as_ref()) else {
            return Fabric {
                call: "nvmlDeviceGetGpuFabricInfo",
                code: MISSING_SYMBOL,
                ..Fabric::default()
            };
        };
        let mut v1: nvmlGpuFabricInfo_t = mem::zeroed();
        let code = get_v1(handle, &mut v1);
        Fabric {
            call: "nvmlDeviceGetGpuFabricInfo",
            code,
            version: 1,
            state: v1.state,
            status: v1.status,
            clique: v1.cliqueId,
            health_mask: None,
            health_summary: None,
        }
    }
}

fn print_fabric(gpu: u32, sample: &str, f: &Fabric) {
    let opt = |o: Option<String>| o.unwrap_or_else(|| "-".into());
    println!(
        "fabric gpu={gpu} sample={sample} call={} version={} result={} state={} status={} clique={} \
         health_mask={} health_summary={}",
        f.call,
        f.version,
        code_name(f.code),
        fabric_state(f.state),
        code_name(f.status),
        f.clique,
        opt(f.health_mask.map(|m| format!("{m:#x}"))),
        opt(f.health_summary.map(health_summary)),
    );
}

fn processes(
    result: Result<Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>, NvmlError>,
) -> Result<Vec<Process>, u32> {
    result
        .map(|list| {
            list.into_iter()
                .map(|p| Process {
                    pid: p.pid,
                    used_bytes: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    },
                })
                .collect()
        })
        .map_err(wrapper_code)
}

fn print_processes(nvml: &Nvml, gpu: u32, list: &str, call: &str, result: &Result<Vec<Process>, u32>) {
    match result {
        Ok(procs) => {
            println!(
                "process_list gpu={gpu} list={list} call={call} result=SUCCESS count={}",
                procs.len()
            );
            for p in procs {
                let name = nvml
                    .sys_process_name(p.pid, 256)
                    .ok()
                    .or_else(|| proc_argv0(p.pid))
                    .unwrap_or_else(|| "?".into());
                println!(
                    "process gpu={gpu} list={list} pid={} used_bytes={} name={}",
                    p.pid,
                    p.used_bytes.map_or_else(|| "-".into(), |b| b.to_string()),
                    v(&name)
                );
            }
        }
        Err(code) => println!(
            "process_list gpu={gpu} list={list} call={call} result={} count=-",
            code_name(*code)
        ),
    }
}

// === /proc: MPS processes ===

fn proc_argv0(pid: u32) -> Option<String> {
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let first = cmdline.split(|&b| b == 0).next()?;
    (!first.is_empty()).then(|| String::from_utf8_lossy(first).into_owned())
}

fn basename(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// MPS control daemons and servers by their program name (`comm` is cut at 15 characters, where the two
/// differ, so argv\[0\]), and likely clients: processes that map `libcuda.so` and have
/// `CUDA_MPS_PIPE_DIRECTORY` in their environment (what a tessera share's container gets). Reading
/// another user's `maps` and `environ` needs root; processes that cannot be read are skipped.
fn mps_host() -> MpsHost {
    let mut host = MpsHost::default();
    let me = std::process::id();
    let Ok(entries) = fs::read_dir("/proc") else {
        return host;
    };
    let mut all: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&pid| pid != me)
        .collect();
    all.sort_unstable();
    for pid in all {
        let Some(argv0) = proc_argv0(pid) else {
            continue;
        };
        match basename(&argv0) {
            "nvidia-cuda-mps-control" => host.daemons.push(pid),
            "nvidia-cuda-mps-server" => host.servers.push(pid),
            _ => {
                let maps_cuda = fs::read_to_string(format!("/proc/{pid}/maps"))
                    .map(|m| m.contains("libcuda.so"))
                    .unwrap_or(false);
                let mps_env = || {
                    fs::read(format!("/proc/{pid}/environ"))
                        .map(|e| {
                            e.split(|&b| b == 0)
                                .any(|kv| kv.starts_with(b"CUDA_MPS_PIPE_DIRECTORY="))
                        })
                        .unwrap_or(false)
                };
                if maps_cuda && mps_env() {
                    host.clients.push(pid);
                }
            }
        }
    }
    host
}

// === N8: lookups under a scrape ===

/// What the plugin's usage scrape does per device: the handle by UUID, utilization, the process lists.
fn scrape_once(nvml: &Nvml, uuids: &[String]) {
    for uuid in uuids {
        if let Ok(d) = nvml.device_by_uuid(uuid.as_str()) {
            let _ = d.utilization_rates();
            let _ = d.memory_info();
            let _ = d.running_compute_processes();
            let _ = d.mps_running_compute_processes();
        }
    }
}

fn time_lookups(nvml: &Nvml, uuids: &[String], target: &str, rounds: usize) -> Lookups {
    let started = Instant::now();
    let _ = nvml.device_by_uuid(target);
    let alone = started.elapsed();
    let stop = AtomicBool::new(false);
    let scrapes = AtomicU64::new(0);
    let mut samples = Vec::new();
    let mut failures = Vec::new();
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                scrape_once(nvml, uuids);
                scrapes.fetch_add(1, Ordering::Relaxed);
            }
        });
        // The lookups are to run beside a scrape already going.
        let warm_up = Instant::now();
        while scrapes.load(Ordering::Relaxed) == 0 && warm_up.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let box_start = Instant::now();
        for round in 0..rounds {
            if box_start.elapsed() >= LOOKUP_TIME_BOX {
                break;
            }
            if round > 0 {
                std::thread::sleep(LOOKUP_SPACING);
            }
            let barrier = Barrier::new(LOOKUP_THREADS);
            let results: Vec<Result<Duration, u32>> = std::thread::scope(|round| {
                let handles: Vec<_> = (0..LOOKUP_THREADS)
                    .map(|_| {
                        round.spawn(|| {
                            barrier.wait();
                            let t = Instant::now();
                            nvml.device_by_uuid(target)
                                .map(|_| t.elapsed())
                                .map_err(wrapper_code)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or(Err(999)))
                    .collect()
            });
            for r in results {
                match r {
                    Ok(d) => samples.push(d),
                    Err(c) => failures.push(c),
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    Lookups {
        alone,
        samples,
        failures,
        scrapes: scrapes.into_inner(),
    }
}

fn read_facts(nvml: &Nvml, rounds: usize) -> anyhow::Result<Facts> {
    let count = nvml
        .device_count()
        .map_err(|e| anyhow::anyhow!("nvmlDeviceGetCount: {e}"))?;
    let mut gpus = Vec::new();
    for index in 0..count {
        let device = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => {
                println!("gpu index={index} handle={}", code_name(wrapper_code(e)));
                continue;
            }
        };
        let uuid = device.uuid().unwrap_or_default();
        let name = device.name().unwrap_or_default();
        let mig = device
            .mig_mode()
            .map(|m| (m.current, m.pending))
            .map_err(wrapper_code);
        match &mig {
            Ok((current, pending)) => println!(
                "gpu index={index} uuid={uuid} name={} mig_current={current} mig_pending={pending}",
                v(&name)
            ),
            Err(code) => println!(
                "gpu index={index} uuid={uuid} name={} mig_mode={}",
                v(&name),
                code_name(*code)
            ),
        }
        let mig_word = match mig {
            Ok((0, _)) => "off",
            Ok(_) => "on",
            Err(_) => "unsupported",
        };
        let mut profiles = Vec::new();
        for p in GI_PROFILE_INDICES {
            let f = gi_profile(nvml, &device, p);
            println!(
                "gi_profile gpu={index} index={p:#x} mig={mig_word} v1={} v{}={} name={}",
                code_name(f.v1),
                f.v_version,
                code_name(f.v),
                f.name.as_deref().unwrap_or("-")
            );
            profiles.push(f);
        }
        let compute = processes(device.running_compute_processes());
        print_processes(
            nvml,
            index,
            "compute",
            "nvmlDeviceGetComputeRunningProcesses_v3",
            &compute,
        );
        let mps = processes(device.mps_running_compute_processes());
        print_processes(
            nvml,
            index,
            "mps",
            "nvmlDeviceGetMPSComputeRunningProcesses_v3",
            &mps,
        );
        // 0: every sample still in the driver's buffer.
        let samples = device
            .process_utilization_stats(0)
            .map(|list| list.into_iter().map(|s| s.pid).collect::<Vec<_>>())
            .map_err(wrapper_code);
        match &samples {
            Ok(list) => println!("samples gpu={index} pids={}", pids(list)),
            Err(code) => println!("samples gpu={index} error={}", code_name(*code)),
        }
        let f = fabric_info(nvml, &device);
        print_fabric(index, "start", &f);
        gpus.push(GpuFacts {
            index,
            uuid,
            mig,
            profiles,
            compute,
            mps,
            samples,
            fabric: vec![f],
            lookups: None,
        });
    }
    let mps = mps_host();
    println!(
        "mps_host daemons={} servers={} clients={}",
        pids(&mps.daemons),
        pids(&mps.servers),
        pids(&mps.clients)
    );
    let fabric_start = Instant::now();
    let uuids: Vec<String> = gpus
        .iter()
        .map(|g| g.uuid.clone())
        .filter(|u| !u.is_empty())
        .collect();
    for g in gpus.iter_mut().filter(|g| !g.uuid.is_empty()) {
        let l = time_lookups(nvml, &uuids, &g.uuid, rounds);
        println!(
            "uuid_lookup gpu={} threads={LOOKUP_THREADS} samples={} failures={} alone_us={} median_us={} \
             max_us={} scrapes={}",
            g.index,
            l.samples.len(),
            l.failures.len(),
            l.alone.as_micros(),
            l.median()
                .map_or_else(|| "-".into(), |d| d.as_micros().to_string()),
            l.max().map_or_else(|| "-".into(), |d| d.as_micros().to_string()),
            l.scrapes
        );
        g.lookups = Some(l);
    }
    let fabric_interval_s = fabric_start.elapsed().as_secs_f64();
    for g in &mut gpus {
        if let Ok(device) = nvml.device_by_index(g.index) {
            let f = fabric_info(nvml, &device);
            print_fabric(g.index, "end", &f);
            g.fabric.push(f);
        }
    }
    Ok(Facts {
        gpus,
        mps,
        fabric_interval_s,
    })
}

fn main() {
    let args = Args::parse();
    let library = library_path(&args.driver_root);
    let nvml = match Nvml::builder().lib_path(OsStr::new(library.as_os_str())).init() {
        Ok(n) => n,
        Err(e) => {
            println!("driver library={} init={}", library.display(), v(&e.to_string()));
            std::process::exit(2);
        }
    };
    println!(
        "driver library={} version={} nvml_version={} gpus={}",
        library.display(),
        nvml.sys_driver_version().unwrap_or_else(|_| "?".into()),
        nvml.sys_nvml_version().unwrap_or_else(|_| "?".into()),
        nvml.device_count()
            .map_or_else(|e| code_name(wrapper_code(e)), |c| c.to_string())
    );
    let facts = match read_facts(&nvml, args.rounds) {
        Ok(f) if !f.gpus.is_empty() => f,
        Ok(_) => {
            println!("no GPU answered");
            std::process::exit(2);
        }
        Err(e) => {
            println!("error {}", v(&e.to_string()));
            std::process::exit(2);
        }
    };
    for row in verdicts(&facts) {
        println!(
            "verdict\t{}\t{}\t{}\t{}",
            row.rule, row.simulator, row.node, row.verdict
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(index: u32, v1: u32, v: u32) -> ProfileFacts {
        ProfileFacts {
            index,
            v1,
            v,
            v_version: 3,
            name: None,
        }
    }

    fn gpu(index: u32, mig: Result<(u32, u32), u32>, profiles: Vec<ProfileFacts>) -> GpuFacts {
        GpuFacts {
            index,
            uuid: format!("GPU-{index}"),
            mig,
            profiles,
            compute: Ok(vec![]),
            mps: Err(MISSING_SYMBOL),
            samples: Err(6),
            fabric: vec![],
            lookups: None,
        }
    }

    fn facts(gpus: Vec<GpuFacts>) -> Facts {
        Facts {
            gpus,
            mps: MpsHost::default(),
            fabric_interval_s: 2.0,
        }
    }

    fn row<'a>(rows: &'a [Row], rule: &str) -> &'a Row {
        rows.iter().find(|r| r.rule == rule).unwrap()
    }

    #[test]
    fn profile_indices_are_grouped_by_the_gpus_that_answer_the_same_ones() {
        assert_eq!(
            indices(&[(0, 0), (0, 7), (1, 0), (1, 7), (2, 1)]),
            "indices 0x0,0x7 on GPU 0,1; indices 0x1 on GPU 2"
        );
    }

    #[test]
    fn the_simulators_answers_with_mig_off_confirm_both_profile_rules() {
        // v1 answers, V refuses what v1 answers with NOT_SUPPORTED (nvml.h:12855), as the simulator does.
        let f = facts(vec![gpu(
            0,
            Ok((0, 0)),
            vec![
                profile(0, SUCCESS, NOT_SUPPORTED),
                profile(1, SUCCESS, NOT_SUPPORTED),
                profile(5, NOT_SUPPORTED, NOT_SUPPORTED),
            ],
        )]);
        let rows = verdicts(&f);
        let v = row(&rows, N6_V);
        assert_eq!(v.verdict, Verdict::Confirmed, "{}", v.node);
        assert!(v.node.contains("NOT_SUPPORTED for all 2 profiles"), "{}", v.node);
        assert_eq!(row(&rows, N6_V1).verdict, Verdict::Confirmed);
    }

    #[test]
    fn a_v_call_that_answers_with_mig_off_contradicts_n6() {
        let f = facts(vec![gpu(
            0,
            Ok((0, 0)),
            vec![profile(0, SUCCESS, SUCCESS), profile(1, SUCCESS, SUCCESS)],
        )]);
        let rows = verdicts(&f);
        let v = row(&rows, N6_V);
        assert_eq!(v.verdict, Verdict::Contradicted);
        assert!(v.node.contains("V answers 2 profiles"), "{}", v.node);
        assert_eq!(row(&rows, N6_V1).verdict, Verdict::Confirmed);
    }

    #[test]
    fn a_v_call_that_refuses_with_another_code_contradicts_n6_and_a_missing_one_is_not_seen() {
        let f = facts(vec![gpu(0, Ok((0, 0)), vec![profile(0, SUCCESS, 2)])]);
        let v = row(&verdicts(&f), N6_V).clone();
        assert_eq!(v.verdict, Verdict::Contradicted);
        assert!(
            v.node.contains("INVALID_ARGUMENT (not NOT_SUPPORTED)"),
            "{}",
            v.node
        );
        let f = facts(vec![gpu(
            0,
            Ok((0, 0)),
            vec![profile(0, SUCCESS, MISSING_SYMBOL)],
        )]);
        let v = row(&verdicts(&f), N6_V).clone();
        assert_eq!(v.verdict, Verdict::NotSeen, "{}", v.node);
    }

    #[test]
    fn a_v1_call_that_refuses_every_profile_with_mig_off_contradicts_the_v1_rule() {
        let f = facts(vec![gpu(
            0,
            Ok((0, 1)),
            vec![profile(0, NOT_SUPPORTED, NOT_SUPPORTED)],
        )]);
        let rows = verdicts(&f);
        assert_eq!(row(&rows, N6_V1).verdict, Verdict::Contradicted);
        assert_eq!(row(&rows, N6_V).verdict, Verdict::NotSeen);
    }

    #[test]
    fn mig_on_everywhere_or_no_mig_leaves_the_profile_rules_not_seen() {
        let on = facts(vec![gpu(0, Ok((1, 1)), vec![profile(0, SUCCESS, NOT_SUPPORTED)])]);
        let rows = verdicts(&on);
        assert_eq!(row(&rows, N6_V).verdict, Verdict::NotSeen);
        assert!(row(&rows, N6_V).node.contains("MIG mode is on"));
        let none = facts(vec![gpu(0, Err(NOT_SUPPORTED), vec![])]);
        assert_eq!(row(&verdicts(&none), N6_V1).verdict, Verdict::NotSeen);
    }

    fn running_share() -> Facts {
        let mut f = facts(vec![gpu(0, Ok((0, 0)), vec![])]);
        f.mps = MpsHost {
            daemons: vec![10],
            servers: vec![11],
            clients: vec![12],
        };
        f
    }

    fn listed(pid: u32) -> Process {
        Process {
            pid,
            used_bytes: Some(1 << 20),
        }
    }

    #[test]
    fn a_client_in_the_mps_list_with_its_server_in_the_compute_list_confirms_n7() {
        let mut f = running_share();
        f.gpus[0].compute = Ok(vec![listed(11)]);
        f.gpus[0].mps = Ok(vec![Process {
            pid: 12,
            used_bytes: None,
        }]);
        let n7 = row(&verdicts(&f), N7).clone();
        assert_eq!(n7.verdict, Verdict::Confirmed, "{}", n7.node);
        assert!(n7.node.contains("MPS list: 12"), "{}", n7.node);
        assert!(
            n7.node.contains("compute list: server 11, clients -"),
            "{}",
            n7.node
        );
    }

    #[test]
    fn a_client_in_the_compute_list_or_in_no_list_contradicts_n7_and_no_client_is_not_seen() {
        let mut f = running_share();
        f.gpus[0].compute = Ok(vec![listed(11), listed(12)]);
        f.gpus[0].mps = Ok(vec![]);
        let n7 = row(&verdicts(&f), N7).clone();
        assert_eq!(n7.verdict, Verdict::Contradicted);
        assert!(n7.node.contains("clients 12 in the compute list"), "{}", n7.node);
        assert!(n7.node.contains("the MPS list names no client"), "{}", n7.node);

        let mut f = running_share();
        f.gpus[0].mps = Err(MISSING_SYMBOL);
        let n7 = row(&verdicts(&f), N7).clone();
        assert_eq!(n7.verdict, Verdict::Contradicted);
        assert!(
            n7.node.contains("no running server in the compute list"),
            "{}",
            n7.node
        );
        assert!(n7.node.contains("answered MISSING_SYMBOL"), "{}", n7.node);

        f.mps = MpsHost {
            daemons: vec![10],
            ..MpsHost::default()
        };
        let n7 = row(&verdicts(&f), N7).clone();
        assert_eq!(n7.verdict, Verdict::NotSeen);
        assert!(n7.node.contains("start one share and re-run"), "{}", n7.node);
    }

    #[test]
    fn samples_stamped_with_a_clients_pid_confirm_the_rule_and_only_the_servers_contradict_it() {
        let mut f = running_share();
        f.gpus[0].samples = Ok(vec![12]);
        let row7 = row(&verdicts(&f), N7_SAMPLES).clone();
        assert_eq!(row7.verdict, Verdict::Confirmed, "{}", row7.node);

        f.gpus[0].samples = Ok(vec![11]);
        let row7 = row(&verdicts(&f), N7_SAMPLES).clone();
        assert_eq!(row7.verdict, Verdict::Contradicted, "{}", row7.node);
        assert!(row7.node.contains("server's PID"), "{}", row7.node);

        f.gpus[0].samples = Err(6); // NOT_FOUND
        let row7 = row(&verdicts(&f), N7_SAMPLES).clone();
        assert_eq!(row7.verdict, Verdict::NotSeen, "{}", row7.node);
        assert!(row7.node.contains("make the share busy"), "{}", row7.node);

        let idle = facts(vec![gpu(0, Ok((0, 0)), vec![])]);
        let row7 = row(&verdicts(&idle), N7_SAMPLES).clone();
        assert_eq!(row7.verdict, Verdict::NotSeen);
        assert!(row7.node.contains("no MPS client running"), "{}", row7.node);
    }

    fn timed(samples_ms: &[u64], failures: Vec<u32>) -> Lookups {
        Lookups {
            alone: Duration::from_micros(5),
            samples: samples_ms.iter().map(|&m| Duration::from_millis(m)).collect(),
            failures,
            scrapes: 100,
        }
    }

    #[test]
    fn fast_lookups_confirm_n8_and_slow_or_failing_ones_contradict_it() {
        let mut f = facts(vec![gpu(0, Ok((0, 0)), vec![])]);
        f.gpus[0].lookups = Some(timed(&[0, 0, 1, 0, 0, 0, 0, 3], vec![]));
        assert_eq!(row(&verdicts(&f), N8).verdict, Verdict::Confirmed);
        f.gpus[0].lookups = Some(timed(&[20, 20, 30, 20, 25, 20, 20, 40], vec![]));
        assert_eq!(
            row(&verdicts(&f), N8).verdict,
            Verdict::Contradicted,
            "slow median"
        );
        f.gpus[0].lookups = Some(timed(&[0, 0, 0, 0, 0, 0, 0, 9_000], vec![]));
        assert_eq!(
            row(&verdicts(&f), N8).verdict,
            Verdict::Contradicted,
            "one O(10 s) lookup"
        );
        f.gpus[0].lookups = Some(timed(&[0, 0, 0], vec![10]));
        assert_eq!(
            row(&verdicts(&f), N8).verdict,
            Verdict::Contradicted,
            "a failed lookup"
        );
        f.gpus[0].lookups = None;
        assert_eq!(row(&verdicts(&f), N8).verdict, Verdict::NotSeen);
    }

    fn reading(code: u32, state: u8, health_summary: u8) -> Fabric {
        Fabric {
            call: "nvmlDeviceGetGpuFabricInfoV",
            code,
            version: 3,
            state,
            status: SUCCESS,
            clique: 0,
            health_mask: Some(0),
            health_summary: Some(health_summary),
        }
    }

    #[test]
    fn a_fabric_like_the_simulators_confirms_n3_and_a_silent_or_backward_one_contradicts_it() {
        let mut f = facts(vec![gpu(0, Ok((0, 0)), vec![])]);
        f.gpus[0].fabric = vec![reading(NOT_SUPPORTED, 0, 0), reading(NOT_SUPPORTED, 0, 0)];
        assert_eq!(row(&verdicts(&f), N3).verdict, Verdict::NotSeen, "no NVSwitch");
        f.gpus[0].fabric = vec![reading(SUCCESS, 3, 1), reading(SUCCESS, 3, 1)];
        assert_eq!(row(&verdicts(&f), N3).verdict, Verdict::Confirmed);
        f.gpus[0].fabric = vec![reading(SUCCESS, 2, 0), reading(SUCCESS, 3, 1)];
        let completed = row(&verdicts(&f), N3).clone();
        assert_eq!(completed.verdict, Verdict::Confirmed, "{}", completed.node);
        assert!(
            completed.node.contains("IN_PROGRESS became COMPLETED"),
            "{}",
            completed.node
        );
        f.gpus[0].fabric = vec![reading(SUCCESS, 3, 0), reading(SUCCESS, 3, 0)];
        let silent = row(&verdicts(&f), N3).clone();
        assert_eq!(silent.verdict, Verdict::Contradicted);
        assert!(
            silent.node.contains("healthSummary NOT_SUPPORTED"),
            "{}",
            silent.node
        );
        f.gpus[0].fabric = vec![reading(SUCCESS, 3, 1), reading(SUCCESS, 2, 0)];
        let back = row(&verdicts(&f), N3).clone();
        assert_eq!(back.verdict, Verdict::Contradicted);
        assert!(
            back.node.contains("COMPLETED became IN_PROGRESS"),
            "{}",
            back.node
        );
    }
}
