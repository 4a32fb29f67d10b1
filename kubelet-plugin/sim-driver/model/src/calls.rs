//! Counts of the NVML calls whose number, not only whose answer, matters to a plugin: the handle lookups
//! by UUID, which NVIDIA's DRA driver found to take O(10 s) under concurrency (see
//! [`crate::backend::Latencies::handle_by_uuid_ms`]). The simulated `libnvidia-ml.so.1` adds one per call to
//! `<kernel dir>/simulated-nvml-calls.json`, so a test can say "at most one lookup per GPU" by counting
//! rather than by timing:
//!
//! ```json
//! {"handleByUuid": {"GPU-…": 1}}
//! ```
//!
//! Every process of the node counts into the one file (under its own lock, [`crate::state_file`]). A
//! read-only kernel (a container's mount) counts nothing.

use std::{collections::BTreeMap, path::Path};

use serde::{Deserialize, Serialize};

use tessera_gpu_api::Result;

use crate::state_file;

/// The count file in the kernel directory.
pub const CALLS_FILE: &str = "simulated-nvml-calls.json";
const LOCK_FILE: &str = "simulated-nvml-calls.lock";

/// The calls counted so far.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NvmlCalls {
    /// `nvmlDeviceGetHandleByUUID` calls by the UUID asked for, answered or not.
    #[serde(default)]
    pub handle_by_uuid: BTreeMap<String, u64>,
}

impl NvmlCalls {
    /// The counts of the kernel in `dir`; none before the first counted call.
    pub fn read(dir: &Path) -> Result<Self> {
        state_file::read_or_default(&dir.join(CALLS_FILE), |e| format!("not a call count file: {e}"))
    }

    /// Counts one `nvmlDeviceGetHandleByUUID` for `uuid`.
    pub fn count_handle_by_uuid(dir: &Path, uuid: &str) -> Result<()> {
        state_file::update(
            dir,
            LOCK_FILE,
            CALLS_FILE,
            || Self::read(dir),
            |calls| *calls.handle_by_uuid.entry(uuid.to_string()).or_default() += 1,
        )
    }

    /// Lookups of `uuid` so far.
    pub fn handle_lookups(&self, uuid: &str) -> u64 {
        self.handle_by_uuid.get(uuid).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_are_counted_per_uuid_and_a_kernel_without_any_reads_as_zero() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(NvmlCalls::read(dir.path()).unwrap().handle_lookups("GPU-a"), 0);
        NvmlCalls::count_handle_by_uuid(dir.path(), "GPU-a").unwrap();
        NvmlCalls::count_handle_by_uuid(dir.path(), "GPU-a").unwrap();
        NvmlCalls::count_handle_by_uuid(dir.path(), "GPU-b").unwrap();
        let calls = NvmlCalls::read(dir.path()).unwrap();
        assert_eq!(
            (calls.handle_lookups("GPU-a"), calls.handle_lookups("GPU-b")),
            (2, 1)
        );
    }
}
