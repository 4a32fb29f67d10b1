//! MIG devices on the simulated backend, through `mig.rs`, the way the prepare state machine uses it.

use std::{
    sync::{Arc, Mutex},
    thread,
};

use tessera_api::{GpuInfo, MigPlacement};
use tessera_gpu_api::models::MODELS;
use tessera_kubelet_plugin::gpu::mig::{MigDevice, MigError};
use tessera_kubelet_plugin::gpu::{GpuBackend, mig};
use tessera_sim_model::backend::{NodeSpec, SimulatedBackend};

struct Node {
    _dir: tempfile::TempDir,
    backend: SimulatedBackend,
    gpus: Vec<GpuInfo>,
}

/// A simulated node; `mig_on` GPUs start in MIG mode (an A100 whose InfoROM has it on).
fn node(model: &str, count: u32, mig_on: bool) -> Node {
    let dir = tempfile::tempdir().unwrap();
    let spec = if mig_on {
        NodeSpec::default().with_mig_gpus(model, count)
    } else {
        NodeSpec::default().with_gpus(model, count)
    };
    let backend = SimulatedBackend::from_spec("node-a", &spec, dir.path()).unwrap();
    let gpus = backend.discover().unwrap().gpus;
    Node {
        _dir: dir,
        backend,
        gpus,
    }
}

fn toggles(gpu: &GpuInfo) -> bool {
    gpu.mig.as_ref().unwrap().mode_toggle_without_reset
}

#[test]
fn every_profile_and_placement_of_every_model_prepares_and_unprepares_cleanly() {
    let mut combos = 0;
    for model in MODELS {
        let n = node(model.name, 1, true);
        let gpu = &n.gpus[0];
        for profile in &gpu.mig.as_ref().unwrap().profiles {
            for placement in &profile.placements {
                let dev = mig::prepare_mig(&n.backend, gpu, &profile.name, placement.start, None)
                    .unwrap_or_else(|e| panic!("{} {}@{}: {e}", model.name, profile.name, placement.start));
                assert_eq!(dev.placement, *placement);
                assert!(dev.uuid.starts_with("MIG-"), "{}", dev.uuid);
                let live = n.backend.list_gpu_instances(0).unwrap();
                assert_eq!(
                    live.len(),
                    1,
                    "{} {}@{}",
                    model.name,
                    profile.name,
                    placement.start
                );
                assert_eq!(live[0].id, dev.gpu_instance);
                assert_eq!(live[0].placement, *placement);
                assert_eq!(live[0].compute_instances[0].uuid, dev.uuid);
                assert_eq!(
                    n.backend
                        .mig_capability_minors(0, dev.gpu_instance, dev.compute_instance)
                        .unwrap(),
                    (dev.gi_cap_minor, dev.ci_cap_minor)
                );
                mig::unprepare_mig(&n.backend, gpu, &dev).unwrap();
                assert!(n.backend.list_gpu_instances(0).unwrap_or_default().is_empty());
                // Hopper and newer leave MIG mode after the last instance; A100 keeps it (a reset is needed).
                assert_eq!(
                    n.backend.mig_mode(0).unwrap().current,
                    !toggles(gpu),
                    "{}",
                    model.name
                );
                combos += 1;
            }
        }
    }
    assert!(
        combos > 50,
        "only {combos} profile/placement combinations were exercised"
    );
}

#[test]
fn hopper_turns_mig_mode_on_for_the_first_instance() {
    let n = node("H100-SXM5-80GB", 1, false);
    assert!(!n.backend.mig_mode(0).unwrap().current);
    let dev = mig::prepare_mig(&n.backend, &n.gpus[0], "3g.40gb", 4, None).unwrap();
    assert!(n.backend.mig_mode(0).unwrap().current);
    mig::unprepare_mig(&n.backend, &n.gpus[0], &dev).unwrap();
    assert!(!n.backend.mig_mode(0).unwrap().current);
}

#[test]
fn an_a100_with_mig_mode_off_gives_a_clear_error_and_stays_untouched() {
    let n = node("A100-SXM4-40GB", 1, false);
    let err = mig::prepare_mig(&n.backend, &n.gpus[0], "1g.5gb", 0, None).unwrap_err();
    assert!(matches!(err, MigError::MigModeNeedsReset { gpu: 0 }), "{err}");
    assert!(err.to_string().contains("nvidia-smi -i 0 -mig 1"), "{err}");
    let mode = n.backend.mig_mode(0).unwrap();
    assert!(!mode.current && !mode.pending);
}

#[test]
fn unknown_profiles_and_placements_are_rejected_before_touching_the_gpu() {
    let n = node("H100-SXM5-80GB", 1, false);
    let err = mig::prepare_mig(&n.backend, &n.gpus[0], "5g.50gb", 0, None).unwrap_err();
    assert!(
        err.to_string()
            .contains("has no MIG profile \"5g.50gb\"; supported: "),
        "{err}"
    );
    let err = mig::prepare_mig(&n.backend, &n.gpus[0], "3g.40gb", 2, None).unwrap_err();
    assert!(err.to_string().contains("valid starts: [0, 4]"), "{err}");
    assert!(!n.backend.mig_mode(0).unwrap().current);
}

#[test]
fn a_placement_already_taken_gives_insufficient_resources_and_changes_nothing() {
    let n = node("H100-SXM5-80GB", 1, false);
    let gpu = &n.gpus[0];
    let held = mig::prepare_mig(&n.backend, gpu, "3g.40gb", 0, None).unwrap();
    let before = n.backend.list_gpu_instances(0).unwrap();
    let err = mig::prepare_mig(&n.backend, gpu, "1g.10gb", 2, None).unwrap_err();
    assert!(err.to_string().contains("insufficient resources"), "{err}");
    assert_eq!(n.backend.list_gpu_instances(0).unwrap(), before);
    // The same placement again without the checkpoint's record is someone else's instance, not ours.
    assert!(mig::prepare_mig(&n.backend, gpu, "3g.40gb", 0, None).is_err());
    mig::unprepare_mig(&n.backend, gpu, &held).unwrap();
}

#[test]
fn preparing_again_with_the_recorded_device_returns_it_unchanged() {
    let n = node("H200-SXM-141GB", 1, false);
    let gpu = &n.gpus[0];
    let dev = mig::prepare_mig(&n.backend, gpu, "2g.35gb", 2, None).unwrap();
    let again = mig::prepare_mig(&n.backend, gpu, "2g.35gb", 2, Some(&dev)).unwrap();
    assert_eq!(again, dev);
    assert_eq!(n.backend.list_gpu_instances(0).unwrap().len(), 1);
    // Only the compute instance lost (a crash between its destroy and the GI's): it is recreated.
    n.backend
        .destroy_compute_instance(0, dev.gpu_instance, dev.compute_instance)
        .unwrap();
    let redone = mig::prepare_mig(&n.backend, gpu, "2g.35gb", 2, Some(&dev)).unwrap();
    assert_eq!(redone.gpu_instance, dev.gpu_instance);
    assert_ne!(redone.uuid, dev.uuid);
    mig::unprepare_mig(&n.backend, gpu, &redone).unwrap();
}

#[test]
fn unpreparing_twice_is_harmless_and_never_destroys_a_newer_instance_with_the_same_ids() {
    let n = node("H100-SXM5-80GB", 1, false);
    let gpu = &n.gpus[0];
    let old = mig::prepare_mig(&n.backend, gpu, "7g.80gb", 0, None).unwrap();
    mig::unprepare_mig(&n.backend, gpu, &old).unwrap();
    let newer = mig::prepare_mig(&n.backend, gpu, "7g.80gb", 0, None).unwrap();
    assert_eq!(
        (newer.gpu_instance, newer.compute_instance),
        (old.gpu_instance, old.compute_instance)
    );
    mig::unprepare_mig(&n.backend, gpu, &old).unwrap();
    let live = n.backend.list_gpu_instances(0).unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].compute_instances[0].uuid, newer.uuid);
    mig::unprepare_mig(&n.backend, gpu, &newer).unwrap();
    assert!(!n.backend.mig_mode(0).unwrap().current);
}

#[test]
fn concurrent_prepares_on_one_gpu_never_overlap() {
    let n = Arc::new(node("H100-SXM5-80GB", 1, false));
    // The per-GPU lock the prepare state machine holds around MIG work.
    let gpu_lock = Arc::new(Mutex::new(()));
    let history = Arc::new(Mutex::new(Vec::<MigDevice>::new()));
    let workers: Vec<_> = [
        ("1g.10gb", 0),
        ("1g.10gb", 1),
        ("2g.20gb", 2),
        ("1g.10gb", 4),
        ("1g.10gb", 5),
        ("1g.10gb", 6),
    ]
    .into_iter()
    .map(|(profile, start)| {
        let (n, gpu_lock, history) = (n.clone(), gpu_lock.clone(), history.clone());
        thread::spawn(move || {
            for _ in 0..4 {
                let dev = {
                    let _g = gpu_lock.lock().unwrap();
                    let dev = mig::prepare_mig(&n.backend, &n.gpus[0], profile, start, None).unwrap();
                    let live = n.backend.list_gpu_instances(0).unwrap();
                    for (i, a) in live.iter().enumerate() {
                        for b in &live[i + 1..] {
                            assert!(!a.placement.overlaps(&b.placement), "{a:?} overlaps {b:?}");
                        }
                    }
                    dev
                };
                history.lock().unwrap().push(dev.clone());
                thread::yield_now();
                let _g = gpu_lock.lock().unwrap();
                mig::unprepare_mig(&n.backend, &n.gpus[0], &dev).unwrap();
            }
        })
    })
    .collect();
    for w in workers {
        w.join().unwrap();
    }
    let history = history.lock().unwrap();
    assert_eq!(history.len(), 24);
    let mut uuids: Vec<_> = history.iter().map(|d| d.uuid.clone()).collect();
    uuids.sort();
    uuids.dedup();
    assert_eq!(uuids.len(), 24, "a MIG UUID was handed out twice");
    assert!(n.backend.list_gpu_instances(0).unwrap_or_default().is_empty());
    assert!(!n.backend.mig_mode(0).unwrap().current);
}

#[test]
fn reconcile_at_start_destroys_unknown_and_half_made_instances_and_keeps_known_ones() {
    let n = node("H100-SXM5-80GB", 2, false);
    let b = &n.backend;
    let known = mig::prepare_mig(b, &n.gpus[0], "3g.40gb", 0, None).unwrap();
    // A finished device no completed claim owns, a GI without a CI (crash between the two creates), and a
    // stray CI next to a known one cannot be told apart from leaks: all go.
    let leaked = mig::prepare_mig(b, &n.gpus[0], "1g.10gb", 4, None).unwrap();
    let half = b
        .create_gpu_instance(
            0,
            n.gpus[0]
                .mig
                .as_ref()
                .unwrap()
                .profile("1g.10gb")
                .unwrap()
                .profile_id,
            MigPlacement { start: 5, size: 1 },
        )
        .unwrap();
    let other_gpu = mig::prepare_mig(b, &n.gpus[1], "7g.80gb", 0, None).unwrap();

    let report = mig::reconcile_at_start(b, &n.gpus, std::slice::from_ref(&known)).unwrap();
    let mut gis = report.gpu_instances.clone();
    gis.sort();
    let mut want = vec![(0, leaked.gpu_instance), (0, half), (1, other_gpu.gpu_instance)];
    want.sort();
    assert_eq!(gis, want);
    assert_eq!(report.mig_disabled, vec![1]);
    let live = b.list_gpu_instances(0).unwrap();
    assert_eq!(live.len(), 1);
    assert_eq!(live[0].compute_instances[0].uuid, known.uuid);
    assert!(!b.mig_mode(1).unwrap().current);
    // Nothing left to do on a second run.
    assert_eq!(
        mig::reconcile_at_start(b, &n.gpus, &[known])
            .unwrap()
            .gpu_instances,
        vec![]
    );
}

#[test]
fn a_prepare_interrupted_after_any_step_is_rolled_back_by_reconcile() {
    // The simulated hardware state lives in files, so stopping between backend calls leaves exactly what
    // a SIGKILL there would (the example `mig_fault_injection` does the real kills).
    let n = node("H100-SXM5-80GB", 1, false);
    let gpu = &n.gpus[0];
    let prof = gpu.mig.as_ref().unwrap().profile("2g.20gb").unwrap().clone();
    let placement = prof.placements[1];
    for steps in 0..=4 {
        let b = &n.backend;
        if steps >= 1 {
            b.set_mig_mode(0, true).unwrap();
        }
        let gi = (steps >= 2).then(|| b.create_gpu_instance(0, prof.profile_id, placement).unwrap());
        if steps >= 3 {
            b.create_compute_instance(0, gi.unwrap()).unwrap();
        }
        if steps >= 4 {
            b.destroy_compute_instance(0, gi.unwrap(), 0).unwrap();
        }
        mig::reconcile_at_start(b, &n.gpus, &[]).unwrap();
        assert!(
            b.list_gpu_instances(0).unwrap_or_default().is_empty(),
            "after {steps} steps"
        );
        assert!(!b.mig_mode(0).unwrap().current, "after {steps} steps");
    }
}

#[test]
fn a_whole_gpu_claim_turns_an_idle_hopper_out_of_mig_mode_but_not_a_busy_one() {
    let n = node("H100-SXM5-80GB", 1, true);
    mig::ensure_whole_gpu(&n.backend, &n.gpus[0]).unwrap();
    assert!(!n.backend.mig_mode(0).unwrap().current);
    let dev = mig::prepare_mig(&n.backend, &n.gpus[0], "1g.10gb", 0, None).unwrap();
    let err = mig::ensure_whole_gpu(&n.backend, &n.gpus[0]).unwrap_err();
    assert!(matches!(err, MigError::MigModeOn { gpu: 0 }), "{err}");
    mig::unprepare_mig(&n.backend, &n.gpus[0], &dev).unwrap();
    // An A100 cannot leave MIG mode without a reset, so it is never handed out whole while in it.
    let a100 = node("A100-SXM4-40GB", 1, true);
    let err = mig::ensure_whole_gpu(&a100.backend, &a100.gpus[0]).unwrap_err();
    assert!(matches!(err, MigError::MigModeOn { gpu: 0 }), "{err}");
}
