//! Warm partitions: what a claim's device made on its GPU (a MIG device, an MPS control daemon), kept for
//! a while after the claim goes, so that the next claim of the same device takes it instead of making it
//! again. A replica that scales from zero then pays no MIG instance creation or daemon start.
//!
//! ```text
//!  unprepare, device published with warmSeconds = W > 0
//!      └─▶ the preparer keeps the partition (last holder of a share only); one checkpoint write drops the
//!          claim's record and adds WarmRecord { until: now + W }
//!  prepare of device D on GPU g (the claim holds g's lock)
//!      ├─ a warm record under D's key, same GPU and strategy ─▶ taken: one write adds the claim's
//!      │                          PrepareStarted record and drops the warm one; the preparer finds the
//!      │                          partition and makes nothing
//!      └─ warm records on g whose partition D's overlaps ─▶ destroyed first: the scheduler sees them
//!                                 free, so a claim never waits for a window to end
//!  every WARM_SWEEP_INTERVAL: records past `until` ─▶ destroyed (GPU lock), then dropped
//!  start-up: warm records of this boot count as owned (the sweep keeps them) and are registered again;
//!            a checkpoint of another boot brings none (the reboot ended them)
//! ```
//!
//! Warm devices are not published any differently: their devices are free in the scheduler's eyes, because
//! they are. The scheduler does not know which placement is warm, but it tries devices in the order the
//! slice lists them, so a replica scaled back up usually lands on the placement its predecessor released.
//!
//! This module decides; [`crate::node::state::NodeState`] holds the records and the locks, and the preparers
//! ([`crate::node::state::DevicePreparer::release`]) keep and destroy partitions.

use std::{collections::BTreeMap, time::Duration};

use tessera_api::{DeviceName, MigPlacement};

use crate::devices::sharing::share_key;
use crate::node::checkpoint::{DeviceDetail, WarmRecord};

/// How often the plugin destroys warm devices whose window ended.
pub const WARM_SWEEP_INTERVAL: Duration = Duration::from_secs(2);

/// The key a warm device is kept under: the exclusive MIG device's name, or `<share key>-shared` for the
/// partition behind shares (the MPS daemon of a GPU or MIG placement, and that MIG device), which every
/// share of it finds, slots included. `None` for what makes nothing worth keeping (a whole GPU, a
/// time-sliced share of a whole GPU).
pub fn warm_key(device: &DeviceName, detail: &DeviceDetail) -> Option<String> {
    match detail {
        DeviceDetail::Gpu { .. } => None,
        DeviceDetail::Mig(_) => Some(device.to_string()),
        DeviceDetail::Shared(s) if s.mig.is_none() && s.strategy.as_deref() == Some("TimeSlicing") => None,
        DeviceDetail::Shared(_) => Some(format!("{}-shared", share_key(device))),
    }
}

/// The `kind` label of a warm device: `mig` when it holds a MIG device, else `mps`.
pub fn kind(detail: &DeviceDetail) -> &'static str {
    match detail {
        DeviceDetail::Shared(s) if s.mig.is_none() => "mps",
        _ => "mig",
    }
}

/// What part of its GPU a device occupies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Footprint {
    /// The whole GPU (a whole GPU, or a share of one: its MPS daemon sets the GPU's compute mode).
    Whole,
    /// The memory slices of a MIG placement.
    Placement(MigPlacement),
}

fn footprint(detail: &DeviceDetail) -> Footprint {
    match detail {
        DeviceDetail::Gpu { .. } => Footprint::Whole,
        DeviceDetail::Mig(m) => Footprint::Placement(m.placement),
        DeviceDetail::Shared(s) => s
            .mig
            .as_ref()
            .map_or(Footprint::Whole, |m| Footprint::Placement(m.placement)),
    }
}

fn overlap(a: Footprint, b: Footprint) -> bool {
    match (a, b) {
        (Footprint::Placement(a), Footprint::Placement(b)) => a.overlaps(&b),
        _ => true,
    }
}

fn same_gpu(a: &DeviceDetail, b: &DeviceDetail) -> bool {
    match (a.gpu_uuid(), b.gpu_uuid()) {
        (Some(a), Some(b)) => a == b,
        _ => a.gpu() == b.gpu(),
    }
}

fn strategy(detail: &DeviceDetail) -> Option<&str> {
    match detail {
        DeviceDetail::Shared(s) => s.strategy.as_deref(),
        _ => None,
    }
}

/// Whether the planned device `planned` can take `warm`, the warm device under its key: the same GPU and
/// kind of detail, and for a share the same strategy (a policy change may have turned a device's).
pub fn takes(planned: &DeviceDetail, warm: &WarmRecord) -> bool {
    same_gpu(planned, &warm.detail)
        && std::mem::discriminant(planned) == std::mem::discriminant(&warm.detail)
        && strategy(planned) == strategy(&warm.detail)
}

/// Whether `warm` holds part of the GPU the planned device needs, so it must go before the device is
/// prepared.
pub fn in_the_way(warm: &WarmRecord, planned: &DeviceDetail) -> bool {
    same_gpu(&warm.detail, planned) && overlap(footprint(&warm.detail), footprint(planned))
}

/// The keys of the warm devices whose window ended at `now` (Unix seconds).
pub fn expired(warm: &BTreeMap<String, WarmRecord>, now: u64) -> Vec<String> {
    warm.iter()
        .filter(|(_, w)| w.until <= now)
        .map(|(k, _)| k.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::checkpoint::{MigDetail, SharedDetail};

    fn placement(start: u32, size: u32) -> MigPlacement {
        MigPlacement { start, size }
    }

    fn mig(gpu: u32, start: u32, size: u32) -> DeviceDetail {
        DeviceDetail::Mig(MigDetail {
            gpu_uuid: Some(format!("GPU-{gpu}")),
            ..MigDetail::planned(gpu, "1g.10gb".into(), placement(start, size))
        })
    }

    fn share(gpu: u32, strategy: &str, on: Option<(u32, u32)>) -> DeviceDetail {
        DeviceDetail::Shared(SharedDetail {
            gpu,
            gpu_uuid: Some(format!("GPU-{gpu}")),
            uuid: None,
            mig: on.map(|(start, size)| MigDetail::planned(gpu, "3g.40gb".into(), placement(start, size))),
            strategy: Some(strategy.into()),
            mps_pipe_dir: None,
            limits: BTreeMap::new(),
        })
    }

    fn warm(detail: DeviceDetail, until: u64) -> WarmRecord {
        WarmRecord {
            device: "d".into(),
            detail,
            until,
            cost_ms: 0,
        }
    }

    #[test]
    fn exclusive_mig_devices_keep_their_name_and_shares_find_their_partition_under_one_key() {
        let device: DeviceName = "gpu-0-mig-1g-10gb-3".parse().unwrap();
        assert_eq!(
            warm_key(&device, &mig(0, 3, 1)).as_deref(),
            Some("gpu-0-mig-1g-10gb-3")
        );
        let slot: DeviceName = "gpu-1-share-2".parse().unwrap();
        let shared: DeviceName = "gpu-1-shared".parse().unwrap();
        assert_eq!(
            warm_key(&slot, &share(1, "MPS", None)).as_deref(),
            Some("gpu-1-shared")
        );
        assert_eq!(
            warm_key(&shared, &share(1, "MPS", None)).as_deref(),
            Some("gpu-1-shared")
        );
        let on_mig: DeviceName = "gpu-2-mig-3g-40gb-4-shared".parse().unwrap();
        assert_eq!(
            warm_key(&on_mig, &share(2, "TimeSlicing", Some((4, 4)))).as_deref(),
            Some("gpu-2-mig-3g-40gb-4-shared")
        );
    }

    #[test]
    fn whole_gpus_and_time_sliced_whole_gpus_keep_nothing() {
        let gpu: DeviceName = "gpu-0".parse().unwrap();
        let whole = DeviceDetail::Gpu {
            gpu: 0,
            uuid: "GPU-0".into(),
            minor: 0,
        };
        assert_eq!(warm_key(&gpu, &whole), None);
        let shared: DeviceName = "gpu-0-shared".parse().unwrap();
        assert_eq!(warm_key(&shared, &share(0, "TimeSlicing", None)), None);
    }

    #[test]
    fn a_warm_mig_device_is_in_the_way_of_overlapping_placements_and_whole_gpu_uses_only() {
        let w = warm(mig(0, 4, 1), 10);
        assert!(in_the_way(&w, &mig(0, 4, 4)), "3g at 4 covers slice 4");
        assert!(!in_the_way(&w, &mig(0, 0, 4)), "3g at 0 ends before 4");
        assert!(!in_the_way(&w, &mig(1, 4, 4)), "another GPU");
        assert!(in_the_way(&w, &share(0, "MPS", None)), "a share of the whole GPU");
        assert!(in_the_way(
            &w,
            &DeviceDetail::Gpu {
                gpu: 0,
                uuid: "GPU-0".into(),
                minor: 0
            }
        ));
    }

    #[test]
    fn a_warm_mps_daemon_of_a_whole_gpu_is_in_the_way_of_any_other_use_of_it() {
        let w = warm(share(0, "MPS", None), 10);
        assert!(in_the_way(&w, &mig(0, 6, 1)));
        assert!(in_the_way(&w, &share(0, "TimeSlicing", None)));
        assert!(!in_the_way(&w, &mig(1, 6, 1)));
    }

    #[test]
    fn a_share_takes_a_warm_partition_only_of_its_own_strategy() {
        let w = warm(share(0, "MPS", None), 10);
        assert!(takes(&share(0, "MPS", None), &w));
        assert!(!takes(&share(0, "TimeSlicing", None), &w));
        assert!(!takes(&share(1, "MPS", None), &w));
        assert!(!takes(&mig(0, 0, 1), &w));
    }

    #[test]
    fn only_windows_that_ended_expire() {
        let warm = BTreeMap::from([
            ("a".to_string(), warm(mig(0, 0, 1), 100)),
            ("b".to_string(), warm(mig(0, 1, 1), 101)),
        ]);
        assert_eq!(expired(&warm, 99), Vec::<String>::new());
        assert_eq!(expired(&warm, 100), vec!["a".to_string()]);
        assert_eq!(expired(&warm, 500).len(), 2);
    }
}
