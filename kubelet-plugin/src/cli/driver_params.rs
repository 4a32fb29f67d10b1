//! `--driver-params-mask-dir`: the plugin's and the MPS supervisor's own view of the driver's
//! `/proc/driver/nvidia/params` with `ModifyDeviceFiles: 0`, so that NVML and the MPS daemons in these
//! privileged containers, which have the host's `/dev`, never create or change its device nodes (the specs
//! do the same for every claim's container: `tessera-cdi-hook disable-device-node-modification`).

use std::path::Path;

use tessera_cdi_hook::params::{DRIVER_PARAMS, Params, mask_in_own_namespace};
use tracing::info;

use crate::cli::error::{Error, Result};

/// Masks the params of this process's mount namespace with a copy in `dir` (a tmpfs), before anything
/// opens NVML; nothing without the driver's params file.
pub(super) fn mask(dir: &Path) -> Result<()> {
    let outcome =
        mask_in_own_namespace(Path::new(DRIVER_PARAMS), dir).map_err(|e| Error::MaskDriverParams {
            dir: dir.to_path_buf(),
            reason: e.to_string(),
        })?;
    match outcome {
        Params::Masked => info!(
            params = DRIVER_PARAMS,
            "device node modification is off in this container"
        ),
        Params::Unchanged => info!(
            params = DRIVER_PARAMS,
            "the driver already forbids device node modification"
        ),
        Params::NoDriver => info!(
            params = DRIVER_PARAMS,
            "no driver params to mask (no NVIDIA module loaded)"
        ),
    }
    Ok(())
}
