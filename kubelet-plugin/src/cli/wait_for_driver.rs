//! `wait-for-driver`: waits until the NVIDIA driver is installed under the driver root (the init container).

use std::time::Duration;

use crate::cli::backend::{BackendArgs, BackendKind};
use crate::cli::error::{Error, Result};
use crate::gpu::driver_root::DriverRoot;

#[derive(Debug, clap::Args)]
pub(super) struct WaitForDriverArgs {
    #[command(flatten)]
    backend: BackendArgs,

    /// Give up (exit 1) after this many seconds; 0, the default, waits as long as it takes (a driver
    /// container may need minutes to build and load its module).
    #[arg(long, env = "TESSERA_WAIT_FOR_DRIVER_TIMEOUT", default_value_t = 0)]
    timeout: u64,

    /// Seconds between two waiting messages in the log.
    #[arg(long, env = "TESSERA_WAIT_FOR_DRIVER_REPORT_INTERVAL", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    report_interval: u64,
}

impl WaitForDriverArgs {
    pub(super) fn run(self) -> Result<()> {
        if self.backend.backend != BackendKind::Nvml {
            println!(
                "the {:?} backend needs no driver: nothing to wait for",
                self.backend.backend
            );
            return Ok(());
        }
        let root = DriverRoot::mounted(&self.backend.driver_root, self.backend.read_root());
        let proc_root = || crate::gpu::nvml::proc_root_for(self.backend.read_root());
        let options = crate::gpu::driver_watch::WaitOptions {
            report_every: Duration::from_secs(self.report_interval),
            timeout: (self.timeout > 0).then(|| Duration::from_secs(self.timeout)),
            ..Default::default()
        };
        // Plain lines on stdout: what `kubectl logs -c wait-for-driver` shows.
        match crate::gpu::driver_watch::wait_for_driver(&root, proc_root, options, |m| println!("{m}")) {
            Ok(found) => {
                println!(
                    "the NVIDIA driver {} is installed: {} found, the kernel module is loaded",
                    found.kernel.as_deref().unwrap_or("?"),
                    found
                        .nvml_library
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                );
                Ok(())
            }
            Err(last) => Err(Error::WaitForDriver {
                root: self.backend.driver_root.clone(),
                waited_secs: self.timeout,
                missing: last.missing(),
            }),
        }
    }
}
