//! The checkpoint: which claims this node has prepared, surviving plugin restarts.
//!
//! On disk (`<state dir>/checkpoint.json`):
//!
//! ```json
//! {"version": 1, "checksum": "sha256:<hex>", "payload": {"bootId": "...", "claims": {"<uid>": {...}}}}
//! ```
//!
//! * `version` is the format version; a file of another version is refused, never reinterpreted.
//! * `checksum` is the SHA-256 of the payload serialized canonically (serde_json of the parsed payload, whose
//!   object keys come out in one fixed order), so a torn or hand-edited file is detected.
//! * `bootId` is the node's boot id when the checkpoint was written: a checkpoint from an earlier boot
//!   describes MIG instances and CDI specs the reboot already erased, so it is discarded.
//! * Each claim goes through two phases: [`Phase::PrepareStarted`] is written with the devices about to be
//!   prepared *before* any hardware or CDI change, [`Phase::PrepareCompleted`] after, with what the
//!   hardware returned (MIG ids). A record still in the first phase at start-up was interrupted by a crash
//!   and is rolled back; what it cannot name (an instance created before the crash, whose ids were not
//!   written yet) is destroyed by the start-up sweep of MIG instances no completed record holds. A claim
//!   of whole GPUs only changes nothing that needs undoing and is written once, as `PrepareCompleted`.
//!
//! Writes are atomic: temp file, fsync of the temp file, rename. What that buys, and why it is enough:
//!
//! * A process crash (kill -9, OOM, an upgrade) loses nothing: the page cache outlives the process, and
//!   the rename is atomic, so the restarted plugin reads the last checkpoint written, whole. This is the
//!   only case where the checkpoint must be exact, and no fsync is needed for it.
//! * A power loss is a reboot: the boot id changes, so whatever checkpoint the disk holds is of an earlier
//!   boot and is not trusted ([`Loaded::OtherBoot`]: its records are re-adopted only when the API server
//!   says a pod uses the claim and the hardware still has the devices; a missing file, [`Loaded::Missing`],
//!   is rebuilt the same way from the API server, the CDI specs and the hardware). So after a power loss
//!   the file only has to be *parseable or absent*, of any age: a torn or empty one would read as
//!   [`Error::CorruptCheckpoint`] and stop the plugin from serving. The fsync of the temp file before the
//!   rename guarantees that: the name never points at data that is not on disk.
//! * The directory is not fsynced after the rename. That fsync only makes the rename itself durable, i.e.
//!   decides whether a power loss brings back the old file or the new one; both are of the old boot.

use std::{
    collections::BTreeMap,
    fs, io,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tessera_api::MigPlacement;

use crate::node::cdi::{Durability, write_atomically};
use crate::node::error::{Error, Result};

/// Format version written by this plugin.
pub const FORMAT_VERSION: u32 = 1;

/// File name in the state directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";

/// Everything the checkpoint records.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    /// Boot id of the node when written.
    pub boot_id: String,
    /// Claims by UID.
    #[serde(default)]
    pub claims: BTreeMap<String, ClaimRecord>,
    /// Warm devices by warm key ([`crate::node::warm::warm_key`]): partitions kept after their last claim went,
    /// which a claim for the same device takes without making them again. A plugin that predates them
    /// ignores the field, and its start-up sweep destroys what they hold: nothing leaks on a downgrade.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub warm: BTreeMap<String, WarmRecord>,
}

/// A warm device: what a released claim's device left on the GPU (a MIG device with its ids, an MPS
/// daemon with its defaults), kept until `until` for the next claim of that device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WarmRecord {
    /// The device it was released as (`gpu-0-mig-1g-10gb-3`, `gpu-1-shared`, `gpu-1-share-2`).
    pub device: String,
    /// The released device's detail, with the ids of what it holds on the hardware.
    pub detail: DeviceDetail,
    /// When it is destroyed if no claim took it (Unix seconds).
    pub until: u64,
    /// How long making it took, in milliseconds: what the claim that takes it saves.
    #[serde(default)]
    pub cost_ms: u64,
}

/// One claim's preparation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRecord {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub phase: Phase,
    /// In `PrepareStarted`: the devices about to be prepared (details as far as known, updated as devices
    /// complete). In `PrepareCompleted`: what was prepared, as returned to kubelet.
    pub devices: Vec<DeviceRecord>,
    /// Why the last attempt to roll this claim back (at start or in a later reconcile) failed. The record
    /// is kept, so the devices it names stay reserved and the rollback is retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_error: Option<String>,
    /// When the prepare completed (Unix seconds), as this plugin recorded it: kubelet may not have got the
    /// answer of a prepare completed just before the plugin died, and [`crate::kubelet::prepare_retry`] asks it
    /// to retry those too. Absent in records of older plugins and of adopted claims.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<u64>,
}

/// Where a claim's preparation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    PrepareStarted,
    PrepareCompleted,
}

/// One allocated device of a claim.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceRecord {
    /// The allocation result's `request` (`<request>` or `<request>/<subrequest>`).
    pub request: String,
    pub pool: String,
    /// tessera device name (`gpu-0`, `gpu-1-mig-3g-40gb-4`, …).
    pub device: String,
    /// Set for devices allocated through consumable capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// Fully qualified CDI device ids returned to kubelet.
    pub cdi_device_ids: Vec<String>,
    /// What was done on the hardware, enough to undo it after a restart.
    pub detail: DeviceDetail,
    /// How long the device's partition stays warm after the claim goes, in seconds, as its ResourceSlice
    /// published it (`warmSeconds`) when the claim was prepared; absent: destroyed at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_seconds: Option<u64>,
    /// How long making the device's partition (MIG instance, MPS daemon) took, in milliseconds: measured
    /// when this claim made it, inherited when it took a warm one. Absent for devices that make nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_ms: Option<u64>,
}

/// Kind-specific preparation state. Every field a later undo needs is here, because after a restart the
/// checkpoint is the only memory of it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase")]
pub enum DeviceDetail {
    /// A whole GPU: nothing changes on the hardware, only the CDI spec exposes it.
    #[serde(rename_all = "camelCase")]
    Gpu { gpu: u32, uuid: String, minor: u32 },
    /// A MIG device created for the claim.
    Mig(MigDetail),
    /// A share of a GPU or MIG device (MPS or time-slicing).
    Shared(SharedDetail),
}

/// A MIG device: identity known before preparing (GPU, profile, placement) and ids known only after
/// creation (`None` until then, so a crash in between leaves a record that still says where to look).
/// The ids reach the disk with `PrepareCompleted`, or with a record of a rollback that failed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigDetail {
    /// Index of the parent GPU, as discovery numbered it when the record was written: a name only (NVML
    /// indices shift when a GPU is missing at boot); `gpu_uuid` says which GPU it is.
    pub gpu: u32,
    /// `GPU-…` UUID of the parent GPU. Absent in records written before it was kept (judged by `gpu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_uuid: Option<String>,
    pub profile: String,
    pub placement: MigPlacement,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_instance: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_instance: Option<u32>,
    /// `MIG-…` UUID once created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

impl MigDetail {
    /// A MIG device as planned, before any instance exists.
    pub fn planned(gpu: u32, profile: String, placement: MigPlacement) -> Self {
        Self {
            gpu,
            gpu_uuid: None,
            profile,
            placement,
            gpu_instance: None,
            compute_instance: None,
            uuid: None,
        }
    }
}

/// A share of a GPU (or of a MIG device, when `mig` is set).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SharedDetail {
    /// Index of the GPU, a name only (see [`MigDetail::gpu`]).
    pub gpu: u32,
    /// `GPU-…` UUID of the (parent) GPU. Absent in records written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_uuid: Option<String>,
    /// UUID the container sees (`GPU-…` or `MIG-…`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigDetail>,
    /// `MPS` or `TimeSlicing`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
    /// Host directory of the MPS control daemon's pipes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_pipe_dir: Option<String>,
    /// Limits applied to the share (thread percentage, pinned memory, time-slice), by name; for MPS also
    /// the defaults its device's daemon was started with (`mpsDefaultActiveThreadPercentage`,
    /// `mpsDefaultPinnedDeviceMemoryLimit`), so the plugin can start that daemon again after a restart.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub limits: BTreeMap<String, String>,
}

impl DeviceDetail {
    /// Index of the physical GPU the device lives on.
    pub fn gpu(&self) -> u32 {
        match self {
            Self::Gpu { gpu, .. } => *gpu,
            Self::Mig(m) => m.gpu,
            Self::Shared(s) => s.gpu,
        }
    }

    /// `GPU-…` UUID of the physical GPU the device lives on, when the record has it. A share of a whole
    /// GPU written before `gpu_uuid` was kept still names it by the UUID the container sees.
    pub fn gpu_uuid(&self) -> Option<&str> {
        match self {
            Self::Gpu { uuid, .. } => Some(uuid),
            Self::Mig(m) => m.gpu_uuid.as_deref(),
            Self::Shared(s) => s.gpu_uuid.as_deref().or_else(|| {
                s.uuid
                    .as_deref()
                    .filter(|u| s.mig.is_none() && u.starts_with("GPU-"))
            }),
        }
    }

    /// Fills in the parent GPU's UUID where the record lacks it (a record written before it was kept,
    /// or a plan made without it); true when anything changed.
    pub fn set_gpu_uuid(&mut self, uuid: &str) -> bool {
        let fill = |slot: &mut Option<String>| {
            let missing = slot.is_none();
            if missing {
                *slot = Some(uuid.to_string());
            }
            missing
        };
        match self {
            Self::Gpu { .. } => false,
            Self::Mig(m) => fill(&mut m.gpu_uuid),
            Self::Shared(s) => {
                let mut changed = fill(&mut s.gpu_uuid);
                if let Some(m) = &mut s.mig {
                    changed |= fill(&mut m.gpu_uuid);
                }
                changed
            }
        }
    }
}

/// Checks that a recorded device's GPU is the GPU `current_uuid` that index `gpu` names now. `Ok(false)`:
/// the record has no UUID (written before it was kept) and is judged by its index; `Err`: the index now
/// names another physical GPU, and the record must not be applied to it.
pub fn check_gpu_identity(detail: &DeviceDetail, current_uuid: Option<&str>) -> Result<bool, String> {
    let gpu = detail.gpu();
    let Some(recorded) = detail.gpu_uuid() else {
        return Ok(false);
    };
    match current_uuid {
        Some(now) if now == recorded => Ok(true),
        Some(now) => Err(format!(
            "the record names GPU {gpu} as {recorded}, but GPU {gpu} is now {now} (NVML numbers GPUs by \
             position, so indices shift when a GPU is missing at boot); refusing to apply it to another \
             physical GPU"
        )),
        None => Err(format!(
            "the record names GPU {gpu} ({recorded}), which this node no longer has"
        )),
    }
}

/// The on-disk envelope. The payload is kept as a JSON value so the checksum is verified before the payload
/// is interpreted.
#[derive(Serialize, Deserialize)]
struct Envelope {
    version: u32,
    checksum: String,
    payload: serde_json::Value,
}

/// What was found on disk.
#[derive(Debug, PartialEq)]
pub enum Loaded {
    /// No checkpoint: a first start.
    Missing,
    /// A valid checkpoint of this boot.
    Current(Checkpoint),
    /// A valid checkpoint of an earlier boot.
    OtherBoot(Checkpoint),
}

/// The checkpoint file.
#[derive(Clone, Debug)]
pub struct CheckpointStore {
    path: PathBuf,
}

impl CheckpointStore {
    /// The checkpoint in `state_dir`.
    pub fn new(state_dir: &Path) -> Self {
        Self {
            path: state_dir.join(CHECKPOINT_FILE),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads and verifies the checkpoint. A file that is not valid JSON, has another format version, fails
    /// its checksum or does not hold a checkpoint is [`Error::CorruptCheckpoint`].
    pub fn load(&self, boot_id: &str) -> Result<Loaded> {
        let bytes = match fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Loaded::Missing),
            Err(source) => {
                return Err(Error::ReadCheckpoint {
                    path: self.path.clone(),
                    source,
                });
            }
        };
        let corrupt = |reason: String| Error::CorruptCheckpoint {
            path: self.path.clone(),
            reason,
        };
        let envelope: Envelope =
            serde_json::from_slice(&bytes).map_err(|e| corrupt(format!("not a checkpoint file: {e}")))?;
        if envelope.version != FORMAT_VERSION {
            return Err(corrupt(format!(
                "format version {} is not the version {FORMAT_VERSION} this plugin reads",
                envelope.version
            )));
        }
        let actual = checksum(&envelope.payload);
        if actual != envelope.checksum {
            return Err(corrupt(format!(
                "checksum {} does not match the content ({actual})",
                envelope.checksum
            )));
        }
        let checkpoint: Checkpoint = serde_json::from_value(envelope.payload)
            .map_err(|e| corrupt(format!("payload is not a checkpoint: {e}")))?;
        Ok(if checkpoint.boot_id == boot_id {
            Loaded::Current(checkpoint)
        } else {
            Loaded::OtherBoot(checkpoint)
        })
    }

    /// Writes the checkpoint atomically, whole after a power loss (see the module comment for why that is
    /// the durability it needs).
    pub fn save(&self, checkpoint: &Checkpoint) -> Result<()> {
        let err = |source| Error::WriteCheckpoint {
            path: self.path.clone(),
            source,
        };
        let payload = serde_json::to_value(checkpoint).map_err(|e| err(io::Error::other(e)))?;
        let envelope = Envelope {
            version: FORMAT_VERSION,
            checksum: checksum(&payload),
            payload,
        };
        let bytes = serde_json::to_vec_pretty(&envelope).map_err(|e| err(io::Error::other(e)))?;
        if let Some(dir) = self.path.parent() {
            fs::create_dir_all(dir).map_err(err)?;
        }
        let tmp = self.path.with_extension("json.tmp");
        write_atomically(&tmp, &self.path, &bytes, Durability::WholeAfterPowerLoss).map_err(err)
    }
}

/// `sha256:<hex>` of the canonical serialization of `payload`. serde_json writes a `Value`'s keys in its map's
/// order, which is the same on write and on re-read, so the digest is stable.
fn checksum(payload: &serde_json::Value) -> String {
    // Serializing a Value cannot fail: its keys are strings.
    let bytes = serde_json::to_vec(payload).unwrap_or_default();
    let digest = Sha256::digest(&bytes);
    let mut hex = String::with_capacity(7 + 64);
    hex.push_str("sha256:");
    for b in digest {
        hex.push_str(&format!("{b:02x}"));
    }
    hex
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(uid: &str, phase: Phase) -> ClaimRecord {
        ClaimRecord {
            uid: uid.into(),
            namespace: "ns".into(),
            name: "c".into(),
            phase,
            devices: vec![DeviceRecord {
                request: "gpu".into(),
                pool: "node-a".into(),
                device: "gpu-1-mig-3g-40gb-4".into(),
                share_id: None,
                cdi_device_ids: vec![format!("k8s.gpu.tessera.dev/claim={uid}-gpu-1-mig-3g-40gb-4")],
                detail: DeviceDetail::Mig(MigDetail {
                    gpu: 1,
                    gpu_uuid: Some("GPU-1".into()),
                    profile: "3g.40gb".into(),
                    placement: MigPlacement { start: 4, size: 4 },
                    gpu_instance: Some(2),
                    compute_instance: Some(0),
                    uuid: Some("MIG-1".into()),
                }),
                warm_seconds: None,
                cost_ms: None,
            }],
            recovery_error: None,
            completed_at: None,
        }
    }

    #[test]
    fn a_saved_checkpoint_loads_back_equal_in_the_same_boot() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let mut cp = Checkpoint {
            boot_id: "boot-1".into(),
            ..Default::default()
        };
        cp.claims
            .insert("u1".into(), record("u1", Phase::PrepareCompleted));
        cp.claims.insert("u2".into(), record("u2", Phase::PrepareStarted));
        store.save(&cp).unwrap();
        assert_eq!(store.load("boot-1").unwrap(), Loaded::Current(cp.clone()));
        assert_eq!(store.load("boot-2").unwrap(), Loaded::OtherBoot(cp));
    }

    #[test]
    fn a_missing_checkpoint_is_a_first_start() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            CheckpointStore::new(dir.path()).load("b").unwrap(),
            Loaded::Missing
        );
    }

    #[test]
    fn an_edited_payload_fails_the_checksum_and_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let mut cp = Checkpoint {
            boot_id: "b".into(),
            ..Default::default()
        };
        cp.claims
            .insert("u1".into(), record("u1", Phase::PrepareCompleted));
        store.save(&cp).unwrap();
        let text = fs::read_to_string(store.path())
            .unwrap()
            .replace("gpu-1-mig", "gpu-2-mig");
        fs::write(store.path(), text).unwrap();
        let err = store.load("b").unwrap_err().to_string();
        assert!(err.contains("checksum"), "{err}");
        assert!(err.contains(&store.path().display().to_string()), "{err}");
    }

    #[test]
    fn a_checkpoint_of_another_format_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        store
            .save(&Checkpoint {
                boot_id: "b".into(),
                ..Default::default()
            })
            .unwrap();
        let text = fs::read_to_string(store.path())
            .unwrap()
            .replace("\"version\": 1", "\"version\": 2");
        fs::write(store.path(), text).unwrap();
        let err = store.load("b").unwrap_err().to_string();
        assert!(err.contains("format version 2"), "{err}");
    }

    #[test]
    fn a_record_written_before_gpu_uuids_were_kept_still_loads() {
        // A b31ad79 checkpoint: MIG and shared details without `gpuUuid`.
        let old = r#"{"uid":"u","namespace":"ns","name":"c","phase":"PrepareCompleted","devices":[
            {"request":"r","pool":"p","device":"gpu-1-mig-3g-40gb-4","cdiDeviceIds":[],
             "detail":{"kind":"mig","gpu":1,"profile":"3g.40gb","placement":{"start":4,"size":4},
                       "gpuInstance":2,"computeInstance":0,"uuid":"MIG-1"}},
            {"request":"r","pool":"p","device":"gpu-2-shared","cdiDeviceIds":[],
             "detail":{"kind":"shared","gpu":2,"uuid":"GPU-2","strategy":"MPS"}}]}"#;
        let mut r: ClaimRecord = serde_json::from_str(old).unwrap();
        assert_eq!(r.devices[0].detail.gpu_uuid(), None);
        assert_eq!(
            r.devices[1].detail.gpu_uuid(),
            Some("GPU-2"),
            "a whole-GPU share names its GPU"
        );
        assert_eq!(check_gpu_identity(&r.devices[0].detail, Some("GPU-x")), Ok(false));
        assert!(r.devices[0].detail.set_gpu_uuid("GPU-x"));
        assert!(!r.devices[0].detail.set_gpu_uuid("GPU-y"), "filled once");
        assert_eq!(r.devices[0].detail.gpu_uuid(), Some("GPU-x"));
    }

    #[test]
    fn a_record_whose_gpu_index_now_names_another_gpu_is_refused() {
        let r = record("u", Phase::PrepareCompleted);
        let detail = &r.devices[0].detail;
        assert_eq!(check_gpu_identity(detail, Some("GPU-1")), Ok(true));
        let e = check_gpu_identity(detail, Some("GPU-2")).unwrap_err();
        assert!(
            e.contains("GPU-1") && e.contains("GPU-2") && e.contains("refusing"),
            "{e}"
        );
        assert!(check_gpu_identity(detail, None).is_err());
    }

    #[test]
    fn records_serialize_with_a_kind_tag_per_device() {
        let v = serde_json::to_value(record("u", Phase::PrepareStarted)).unwrap();
        assert_eq!(v["phase"], "PrepareStarted");
        assert_eq!(v["devices"][0]["detail"]["kind"], "mig");
        assert_eq!(v["devices"][0]["detail"]["placement"]["start"], 4);
        assert_eq!(v["devices"][0]["detail"]["gpuInstance"], 2);
    }
}
