//! `discover`: prints the node's GPUs (the NodeInventory spec), its MIG devices or a dry-run CDI spec.

use std::path::{Path, PathBuf};

use tessera_api::NodeInventorySpec;

use crate::cli::backend::BackendArgs;
use crate::cli::error::{Error, Result};
use crate::gpu::GpuBackend;
use crate::gpu::driver_root::{CdiHook, DriverFiles, DriverRoot};

#[derive(Debug, clap::Args)]
pub(super) struct DiscoverArgs {
    #[command(flatten)]
    backend: BackendArgs,

    /// Node name to print in the spec.
    #[arg(long, env = "NODE_NAME", default_value = "localhost")]
    node_name: String,

    /// State directory of the simulated backend; by default a fresh one (GPUs as the node file describes
    /// them, MIG mode as configured there).
    #[arg(long, env = "TESSERA_STATE_DIR")]
    state_dir: Option<PathBuf>,

    /// Print, instead of the inventory, the CDI spec a claim of all the node's whole GPUs would get
    /// (device nodes, driver libraries and binaries found under the driver root). Reads only: nothing is
    /// written and no GPU setting changes.
    #[arg(long)]
    cdi: bool,

    /// Print, instead of the inventory, every MIG device that exists now (GPU index, GPU and compute
    /// instance ids, profile, placement and the `MIG-…` UUID as the plugin reads it), one per line. Reads
    /// only: no MIG mode changes and no instance is created (`make gpu-check` compares it with
    /// `nvidia-smi -L`).
    #[arg(long, conflicts_with = "cdi")]
    mig_devices: bool,

    /// With `--cdi`: the host path of `nvidia-cdi-hook`, as the plugin's `--cdi-hook`; without it the spec
    /// names tessera's hook where the plugin installs it by default (`/var/lib/tessera/bin`).
    #[arg(long, env = "TESSERA_CDI_HOOK")]
    cdi_hook: Option<PathBuf>,
}

impl DiscoverArgs {
    pub(super) fn run(self) -> Result<()> {
        let Self {
            backend,
            node_name,
            state_dir,
            cdi,
            mig_devices,
            cdi_hook,
        } = self;
        // A throwaway state directory: discovery must not need (or change) the plugin's state.
        let scratch = std::env::temp_dir().join(format!("tessera-discover-{}", std::process::id()));
        let dir = state_dir.unwrap_or_else(|| scratch.clone());
        let result = backend.open(&node_name, &dir).and_then(|b| {
            let found = b.discover().map_err(|source| Error::Discover {
                backend: b.name(),
                source,
            })?;
            for u in &found.unusable {
                eprintln!("warning: {}", u.reason);
            }
            if mig_devices {
                return print_mig_devices(b.as_ref(), &found);
            }
            if cdi {
                let root = backend.driver_root_of(b.as_ref());
                let spec = dry_run_cdi_spec(b.as_ref(), &root, &found, cdi_hook)?;
                let json = serde_json::to_string_pretty(&spec).map_err(|e| Error::DryRunCdi {
                    device: "(spec)".into(),
                    source: crate::gpu::GpuError::InvalidArgument(e.to_string()),
                })?;
                println!("{json}");
                return Ok(());
            }
            let spec = NodeInventorySpec {
                node_name,
                backend: b.name().to_string(),
                driver_version: found.driver_version,
                cuda_driver_version: found.cuda_driver_version,
                gpus: found.gpus,
            };
            let yaml = serde_norway::to_string(&spec).map_err(Error::PrintInventory)?;
            print!("{yaml}");
            Ok(())
        });
        let _ = std::fs::remove_dir_all(&scratch);
        result
    }
}

/// One line per live MIG device. The parent's UUID is left out on purpose: a `GPU-` UUID in this output is
/// a MIG device read with its parent's identity, which `make gpu-check` reports.
fn print_mig_devices(backend: &dyn GpuBackend, found: &crate::gpu::NodeGpus) -> Result<()> {
    let mut count = 0;
    for gpu in &found.gpus {
        let instances = backend
            .list_gpu_instances(gpu.index)
            .map_err(|source| Error::Discover {
                backend: backend.name(),
                source,
            })?;
        for gi in instances {
            for ci in &gi.compute_instances {
                count += 1;
                println!(
                    "GPU {} GI {} CI {} profile {} placement {}:{} {}",
                    gpu.index, gi.id, ci.id, gi.profile_id, gi.placement.start, gi.placement.size, ci.uuid
                );
            }
        }
    }
    if count == 0 {
        println!("no MIG device exists on this node");
    }
    Ok(())
}

/// The CDI spec a claim of every discovered whole GPU would get, built as the preparers build it.
fn dry_run_cdi_spec(
    backend: &dyn GpuBackend,
    driver_root: &DriverRoot,
    found: &crate::gpu::NodeGpus,
    cdi_hook: Option<PathBuf>,
) -> Result<crate::node::cdi::Spec> {
    let hook = match cdi_hook {
        Some(path) => CdiHook::nvidia(path, &[]),
        None => CdiHook::tessera(Path::new("/var/lib/tessera/bin").join(crate::node::cdi::HOOK_BINARY)),
    };
    let files = DriverFiles::discover(driver_root, found.driver_version.as_deref()).with_hook(Some(hook));
    let mut devices = Vec::with_capacity(found.gpus.len());
    for gpu in &found.gpus {
        let device = format!("gpu-{}", gpu.index);
        let edits =
            crate::node::edits::device_edits(backend, gpu, None, &device, &gpu.uuid).map_err(|source| {
                Error::DryRunCdi {
                    device: device.clone(),
                    source,
                }
            })?;
        devices.push(crate::node::cdi::Device {
            name: crate::node::cdi::device_name("dry-run", &device),
            container_edits: edits,
        });
    }
    Ok(crate::node::cdi::Spec {
        cdi_version: crate::node::cdi::CDI_VERSION.to_string(),
        kind: crate::node::cdi::CDI_KIND.to_string(),
        devices,
        container_edits: crate::node::edits::driver_edits(&files),
    })
}
