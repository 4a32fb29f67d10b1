//! Fault injection for MIG prepare/unprepare: a child process prepares and unprepares MIG devices on a
//! simulated H100 in a loop, recording each claim in a checkpoint file the way the plugin does
//! (`started` before touching the GPU, `completed` after); the parent SIGKILLs it at a random moment, runs
//! the start-up recovery (`reconcile_at_start` with the completed devices, then kubelet's retried unprepare)
//! and checks that no MIG instance leaked and that a device held by another claim survived.
//!
//! ```text
//! cargo run -p tessera-kubelet-plugin --example mig_fault_injection -- [rounds]   # default 120
//! ```
//!
//! Prints how often each crash state was hit and the leak count; exits non-zero on any leak.

use std::{
    collections::BTreeMap,
    fs,
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use rand::Rng;
use serde::{Deserialize, Serialize};
use tessera_api::GpuInfo;
use tessera_kubelet_plugin::gpu::mig::MigDevice;
use tessera_kubelet_plugin::gpu::{GpuBackend, mig};
use tessera_sim_model::backend::{NodeSpec, SimulatedBackend};

const MODEL: &str = "H100-SXM5-80GB";
/// Placements the child cycles through; the held device sits at 7g-free slice 0 (1g.10gb@0).
const PLACEMENTS: &[(&str, u32)] = &[("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 4), ("1g.10gb", 6)];

#[derive(Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "camelCase")]
enum Record {
    Started { profile: String, start: u32 },
    Completed { device: MigDevice },
}

fn backend(dir: &Path) -> (SimulatedBackend, Vec<GpuInfo>) {
    let b = SimulatedBackend::from_spec("fault-node", &NodeSpec::default().with_gpus(MODEL, 1), dir).unwrap();
    let gpus = b.discover().unwrap().gpus;
    (b, gpus)
}

fn write_record(path: &Path, record: Option<&Record>) {
    match record {
        None => {
            let _ = fs::remove_file(path);
        }
        Some(r) => {
            let tmp = path.with_extension("tmp");
            fs::write(&tmp, serde_json::to_vec(r).unwrap()).unwrap();
            fs::rename(tmp, path).unwrap();
        }
    }
}

fn read_record(path: &Path) -> Option<Record> {
    serde_json::from_slice(&fs::read(path).ok()?).ok()
}

/// The child: prepare/unprepare forever, as the plugin's state machine would, until killed.
fn child(dir: &Path) {
    let (b, gpus) = backend(dir);
    let record = dir.join("claim.json");
    println!("ready");
    for i in 0.. {
        let (profile, start) = PLACEMENTS[i % PLACEMENTS.len()];
        write_record(
            &record,
            Some(&Record::Started {
                profile: profile.into(),
                start,
            }),
        );
        let dev = mig::prepare_mig(&b, &gpus[0], profile, start, None).unwrap();
        write_record(&record, Some(&Record::Completed { device: dev.clone() }));
        mig::unprepare_mig(&b, &gpus[0], &dev).unwrap();
        write_record(&record, None);
    }
}

/// Names the state the kill left behind.
fn classify(b: &SimulatedBackend, record: &Option<Record>, held: &MigDevice) -> &'static str {
    let live: Vec<_> = b
        .list_gpu_instances(0)
        .unwrap()
        .into_iter()
        .filter(|g| g.id != held.gpu_instance)
        .collect();
    let gi = !live.is_empty();
    let ci = live.iter().any(|g| !g.compute_instances.is_empty());
    match (record, gi, ci) {
        (None, false, _) => "idle (between claims)",
        (None, true, _) => "unrecorded instance",
        (Some(Record::Started { .. }), false, _) => "started, nothing created",
        (Some(Record::Started { .. }), true, false) => "started, GI without CI",
        (Some(Record::Started { .. }), true, true) => "started, GI+CI not yet recorded",
        (Some(Record::Completed { .. }), true, true) => "completed",
        (Some(Record::Completed { .. }), true, false) => "completed, CI destroyed by unprepare",
        (Some(Record::Completed { .. }), false, _) => "completed, all destroyed by unprepare",
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        child(Path::new(&args[2]));
        return;
    }
    let rounds: usize = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(120);
    let dir = tempfile::tempdir().unwrap();
    let state: PathBuf = dir.path().to_path_buf();
    let (b, gpus) = backend(&state);
    // Another claim's device, prepared before and untouched by the crashing one: recovery must keep it.
    let held = mig::prepare_mig(&b, &gpus[0], "1g.10gb", 0, None).unwrap();
    let record_path = state.join("claim.json");
    let exe = std::env::current_exe().unwrap();
    let mut rng = rand::rng();
    let mut states: BTreeMap<&str, usize> = BTreeMap::new();
    let (mut destroyed_gis, mut leaks, mut held_lost) = (0usize, 0usize, 0usize);
    for _ in 0..rounds {
        let mut c = Command::new(&exe)
            .arg("child")
            .arg(&state)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(c.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        std::thread::sleep(Duration::from_micros(rng.random_range(0..40_000)));
        c.kill().unwrap(); // SIGKILL
        c.wait().unwrap();

        let record = read_record(&record_path);
        *states.entry(classify(&b, &record, &held)).or_default() += 1;
        // Recovery as the plugin does it at start: devices of completed claims are known, the rest goes.
        let mut known = vec![held.clone()];
        if let Some(Record::Completed { device }) = &record {
            known.push(device.clone());
        }
        let report = mig::reconcile_at_start(&b, &gpus, &known).unwrap();
        destroyed_gis += report.gpu_instances.len();
        // kubelet then retries the unprepare of the completed claim; a started one was rolled back.
        if let Some(Record::Completed { device }) = &record {
            mig::unprepare_mig(&b, &gpus[0], device).unwrap();
        }
        write_record(&record_path, None);
        let live = b.list_gpu_instances(0).unwrap();
        if !live
            .iter()
            .any(|g| g.id == held.gpu_instance && g.compute_instances.iter().any(|c| c.uuid == held.uuid))
        {
            held_lost += 1;
        }
        leaks += live.iter().filter(|g| g.id != held.gpu_instance).count();
    }
    mig::unprepare_mig(&b, &gpus[0], &held).unwrap();
    let final_mig = b.mig_mode(0).unwrap().current;
    println!("rounds: {rounds}");
    println!("crash states hit:");
    for (s, n) in &states {
        println!("  {n:>4}  {s}");
    }
    println!("GPU instances destroyed by reconcile_at_start: {destroyed_gis}");
    println!("leaked instances after recovery: {leaks}");
    println!("other claim's device lost: {held_lost}");
    println!("MIG mode on after the last unprepare: {final_mig}");
    if leaks > 0 || held_lost > 0 || final_mig {
        std::process::exit(1);
    }
}
