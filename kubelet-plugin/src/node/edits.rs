//! The CDI edits of one device (its device nodes and env) and of the driver (its files and hook calls,
//! once per spec: [`driver_edits`]); the driver's files come from [`crate::gpu::driver_root`].
//!
//! `NVIDIA_VISIBLE_DEVICES=void` on every device: CDI merges the env of a claim's devices by key, last one
//! wins, so a per-device UUID there names only one GPU of a two-GPU claim (and a container that references
//! one request of a claim must not see the claim's other GPUs either). `void` is the same on every device,
//! so the merge is always consistent, and it tells NVIDIA's runtime (where installed, legacy or CDI mode)
//! to inject nothing of its own: everything the container needs is in tessera's spec. NVIDIA's DRA driver
//! does the same. The device's UUID is in `TESSERA_UUID_<DEVICE>` (a key per device, so the merge keeps
//! each one), e.g. `TESSERA_UUID_GPU_3=GPU-…`.

use tessera_api::GpuInfo;

use crate::gpu::driver_root::{DriverFiles, HookFeature, IPC_MOUNT_OPTIONS, MOUNT_OPTIONS};
use crate::gpu::{GpuBackend, GpuError};
use crate::node::cdi::{ContainerEdits, DeviceNode, Hook, Mount};

/// Control devices every CUDA container needs besides its GPU nodes.
pub const CONTROL_DEVICES: [&str; 3] = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"];

/// The value of `NVIDIA_VISIBLE_DEVICES` on every tessera device.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES=void";

/// The env key that carries a device's UUID: `TESSERA_UUID_` + the device name in upper case with `-` and
/// `.` as `_` (`gpu-1-mig-3g-40gb-4` → `TESSERA_UUID_GPU_1_MIG_3G_40GB_4`).
pub fn uuid_env_key(device: &str) -> String {
    let name: String = device
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("TESSERA_UUID_{name}")
}

/// Device nodes and env of a whole GPU (`mig == None`) or of MIG compute instance `(gi, ci)` on it:
/// `/dev/nvidia<minor>`, the control devices, for MIG the GPU- and compute-instance capability nodes; the
/// env says `NVIDIA_VISIBLE_DEVICES=void` and names `uuid` under the device's own key.
pub fn device_edits(
    backend: &dyn GpuBackend,
    gpu: &GpuInfo,
    mig: Option<(u32, u32)>,
    device: &str,
    uuid: &str,
) -> Result<ContainerEdits, GpuError> {
    let mut device_nodes = Vec::with_capacity(6);
    let gpu_node = format!("/dev/nvidia{}", gpu.minor);
    for path in std::iter::once(gpu_node.as_str()).chain(CONTROL_DEVICES) {
        let c = backend.char_device(path)?;
        device_nodes.push(DeviceNode::char_device(path, c.major, c.minor));
    }
    if let Some((gi, ci)) = mig {
        let (gi_minor, ci_minor) = backend.mig_capability_minors(gpu.index, gi, ci)?;
        for minor in [gi_minor, ci_minor] {
            let path = format!("/dev/nvidia-caps/nvidia-cap{minor}");
            // The caps major is dynamic (`nvidia-caps` in /proc/devices); the minor is the capability's.
            let c = backend.char_device(&path)?;
            device_nodes.push(DeviceNode::char_device(&path, c.major, minor));
        }
    }
    Ok(ContainerEdits {
        env: vec![
            NVIDIA_VISIBLE_DEVICES.to_string(),
            format!("{}={uuid}", uuid_env_key(device)),
        ],
        device_nodes,
        ..Default::default()
    })
}

/// The edits of the driver, the same for every device and so written once per spec (the spec-level
/// `containerEdits`, which the runtime applies when any device of the spec is injected): the driver's
/// libraries and binaries, read-only at their container paths, for a simulated driver its kernel directory
/// at `/tessera-sim` (see [`crate::gpu::driver_root`]), and the hook's `createContainer` calls in the order
/// NVIDIA's `nvcdi` writes them: `create-symlinks` (before the cache is built, so `libcuda.so` gets an
/// entry), `enable-cuda-compat` (its configuration file must exist when the cache is built) and
/// `update-ldcache`, then, where the host has the driver's params file, `disable-device-node-modification`
/// (the container's `/proc/driver/nvidia/params` says `ModifyDeviceFiles: 0`). The optional calls only
/// where the hook has them ([`crate::gpu::driver_root::CdiHook::features`]).
pub fn driver_edits(files: &DriverFiles) -> ContainerEdits {
    let options: Vec<String> = MOUNT_OPTIONS.map(String::from).to_vec();
    let mounts = files
        .libraries
        .iter()
        .chain(&files.binaries)
        .chain(&files.simulated_kernel)
        .chain(&files.firmware)
        .map(|f| Mount {
            host_path: f.host_path.display().to_string(),
            container_path: f.container_path.clone(),
            options: options.clone(),
        })
        .chain(files.ipc.iter().map(|f| Mount {
            host_path: f.host_path.display().to_string(),
            container_path: f.container_path.clone(),
            options: IPC_MOUNT_OPTIONS.map(String::from).to_vec(),
        }))
        .collect();
    let mut hooks = Vec::new();
    if let Some(hook) = &files.hook {
        let call = |args: Vec<String>| Hook {
            hook_name: "createContainer".into(),
            path: hook.path.display().to_string(),
            args: [hook.program.clone()].into_iter().chain(args).collect(),
            env: vec![],
        };
        let links = files.dev_links();
        if !links.is_empty() {
            let mut args = vec!["create-symlinks".to_string()];
            for (target, link) in links {
                args.push("--link".into());
                args.push(format!("{target}::{link}"));
            }
            hooks.push(call(args));
        }
        // Only a hook that has it: an older nvidia-cdi-hook fails every container on an unknown subcommand.
        if let Some(version) = files
            .driver_version
            .as_ref()
            .filter(|_| hook.has(HookFeature::EnableCudaCompat))
        {
            hooks.push(call(vec![
                "enable-cuda-compat".into(),
                "--host-driver-version".into(),
                version.clone(),
            ]));
        }
        let dirs = files.container_library_dirs();
        if !dirs.is_empty() {
            let mut args = vec!["update-ldcache".to_string()];
            for dir in dirs {
                args.push("--folder".into());
                args.push(dir);
            }
            hooks.push(call(args));
        }
        if files.driver_params && hook.has(HookFeature::DisableDeviceNodeModification) {
            hooks.push(call(vec!["disable-device-node-modification".into()]));
        }
    }
    ContainerEdits {
        mounts,
        hooks,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use std::{fs, os::unix::fs::symlink};

    use super::*;
    use crate::gpu::driver_root::{CdiHook, DriverRoot, HookFeature};

    #[test]
    fn the_daemons_sockets_are_mounted_writable_and_the_drivers_firmware_read_only_where_the_root_has_them() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir_all(d.join("usr/lib/x86_64-linux-gnu")).unwrap();
        // A merged-/usr root whose var/run links to /run: the socket is found once, at /run.
        fs::create_dir_all(d.join("run/nvidia-persistenced")).unwrap();
        let socket = d.join("run/nvidia-persistenced/socket");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        fs::create_dir_all(d.join("var")).unwrap();
        symlink("/run", d.join("var/run")).unwrap();
        symlink("usr/lib", d.join("lib")).unwrap();
        let firmware = d.join("usr/lib/firmware/nvidia/580.1");
        fs::create_dir_all(&firmware).unwrap();
        for f in ["gsp_tu10x.bin", "gsp_ga10x.bin"] {
            fs::write(firmware.join(f), b"fw").unwrap();
        }
        fs::create_dir_all(d.join("usr/lib/firmware/nvidia/575.2")).unwrap();
        fs::write(d.join("usr/lib/firmware/nvidia/575.2/gsp_ga10x.bin"), b"old").unwrap();

        let files = DriverFiles::discover(&DriverRoot::mounted("/run/nvidia/driver", d), Some("580.1"));
        let edits = driver_edits(&files);
        let mount = |target: &str| edits.mounts.iter().find(|m| m.container_path == target);
        let sock = mount("/run/nvidia-persistenced/socket").expect("persistenced's socket");
        assert_eq!(
            sock.host_path,
            "/run/nvidia/driver/run/nvidia-persistenced/socket"
        );
        assert!(
            !sock.options.iter().any(|o| o == "ro"),
            "connect(2) needs it writable: {:?}",
            sock.options
        );
        assert!(mount("/var/run/nvidia-persistenced/socket").is_none());
        assert!(
            mount("/run/nvidia-fabricmanager/socket").is_none(),
            "no fabric manager, no socket"
        );
        let fw = mount("/lib/firmware/nvidia/580.1/gsp_ga10x.bin").expect("the driver's firmware");
        assert_eq!(
            fw.host_path,
            "/run/nvidia/driver/usr/lib/firmware/nvidia/580.1/gsp_ga10x.bin"
        );
        assert_eq!(fw.options, MOUNT_OPTIONS.map(String::from));
        assert!(mount("/lib/firmware/nvidia/580.1/gsp_tu10x.bin").is_some());
        assert!(
            !edits.mounts.iter().any(|m| m.container_path.contains("575.2")),
            "another version's firmware is not this driver's"
        );
    }

    #[test]
    fn driver_edits_mount_every_file_read_only_and_call_the_hook_to_link_enable_compat_and_cache() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("usr/lib/x86_64-linux-gnu");
        let bin = dir.path().join("usr/bin");
        fs::create_dir_all(&lib).unwrap();
        fs::create_dir_all(&bin).unwrap();
        fs::write(lib.join("libcuda.so.580.1"), b"stub").unwrap();
        symlink("libcuda.so.580.1", lib.join("libcuda.so.1")).unwrap();
        fs::write(bin.join("nvidia-smi"), b"#!/bin/sh\n").unwrap();
        let files = DriverFiles::discover(&DriverRoot::new(dir.path()), Some("580.1"));
        let edits = driver_edits(&files);
        let targets: Vec<&str> = edits.mounts.iter().map(|m| m.container_path.as_str()).collect();
        assert_eq!(
            targets,
            [
                "/usr/lib/x86_64-linux-gnu/libcuda.so.580.1",
                "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
                "/usr/bin/nvidia-smi"
            ]
        );
        assert!(
            edits
                .mounts
                .iter()
                .all(|m| m.options == MOUNT_OPTIONS.map(String::from))
        );
        assert!(edits.hooks.is_empty(), "no hook binary, no hook calls");
        assert!(
            edits.env.is_empty() && edits.device_nodes.is_empty(),
            "the driver's edits are no device's"
        );
        let hooked = driver_edits(
            &files
                .clone()
                .with_hook(Some(CdiHook::tessera("/var/lib/tessera/bin/tessera-cdi-hook"))),
        );
        let calls: Vec<Vec<&str>> = hooked
            .hooks
            .iter()
            .map(|h| h.args.iter().map(String::as_str).collect())
            .collect();
        assert_eq!(
            calls,
            [
                vec![
                    "tessera-cdi-hook",
                    "create-symlinks",
                    "--link",
                    "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so"
                ],
                vec![
                    "tessera-cdi-hook",
                    "enable-cuda-compat",
                    "--host-driver-version",
                    "580.1"
                ],
                vec![
                    "tessera-cdi-hook",
                    "update-ldcache",
                    "--folder",
                    "/usr/lib/x86_64-linux-gnu"
                ],
            ]
        );
        assert!(
            hooked.hooks.iter().all(
                |h| h.hook_name == "createContainer" && h.path == "/var/lib/tessera/bin/tessera-cdi-hook"
            )
        );
        // NVIDIA's hook takes the same calls under its own name.
        let nvidia = driver_edits(&files.with_hook(Some(CdiHook::nvidia(
            "/usr/bin/nvidia-cdi-hook",
            &HookFeature::ALL,
        ))));
        assert!(
            nvidia
                .hooks
                .iter()
                .all(|h| h.args[0] == "nvidia-cdi-hook" && h.path == "/usr/bin/nvidia-cdi-hook")
        );
        assert_eq!(nvidia.hooks.len(), 3);
        assert!(
            !targets.contains(&"/tessera-sim"),
            "a real driver has no simulated kernel"
        );
    }

    /// A driver root with `libcuda.so.1` of driver 580.1, as the specs' tests need it.
    fn driver_files_of_580() -> (tempfile::TempDir, DriverFiles) {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("usr/lib/x86_64-linux-gnu");
        fs::create_dir_all(&lib).unwrap();
        fs::write(lib.join("libcuda.so.580.1"), b"stub").unwrap();
        symlink("libcuda.so.580.1", lib.join("libcuda.so.1")).unwrap();
        let files = DriverFiles::discover(&DriverRoot::new(dir.path()), Some("580.1"));
        (dir, files)
    }

    fn subcommands(edits: &ContainerEdits) -> Vec<&str> {
        edits.hooks.iter().map(|h| h.args[1].as_str()).collect()
    }

    #[test]
    fn nvidias_hook_is_called_for_enable_cuda_compat_only_where_it_has_that_subcommand() {
        let (_dir, files) = driver_files_of_580();
        let hook = |features: &[HookFeature]| {
            driver_edits(
                &files
                    .clone()
                    .with_hook(Some(CdiHook::nvidia("/usr/bin/nvidia-cdi-hook", features))),
            )
        };
        // An older toolkit's hook answers an unknown subcommand with an error: every container would fail.
        assert_eq!(subcommands(&hook(&[])), ["create-symlinks", "update-ldcache"]);
        assert_eq!(
            subcommands(&hook(&[HookFeature::EnableCudaCompat])),
            ["create-symlinks", "enable-cuda-compat", "update-ldcache"]
        );
        assert_eq!(
            HookFeature::parse("enable-cuda-compat"),
            Ok(HookFeature::EnableCudaCompat)
        );
        let e = HookFeature::parse("enable-compat").unwrap_err();
        assert!(
            e.contains("enable-cuda-compat") && e.contains("disable-device-node-modification"),
            "{e}"
        );
    }

    #[test]
    fn the_hook_masks_the_drivers_params_in_the_container_where_the_host_has_them() {
        let (_dir, files) = driver_files_of_580();
        let tessera = Some(CdiHook::tessera("/var/lib/tessera/bin/tessera-cdi-hook"));
        let with_params = driver_edits(&files.clone().with_hook(tessera.clone()).with_driver_params(true));
        assert_eq!(
            subcommands(&with_params),
            [
                "create-symlinks",
                "enable-cuda-compat",
                "update-ldcache",
                "disable-device-node-modification"
            ]
        );
        let mask = with_params.hooks.last().unwrap();
        assert_eq!(mask.hook_name, "createContainer");
        assert_eq!(
            mask.args,
            ["tessera-cdi-hook", "disable-device-node-modification"]
        );
        // No driver module on the host (a simulated driver): nothing to mask.
        let without = driver_edits(&files.clone().with_hook(tessera).with_driver_params(false));
        assert!(!subcommands(&without).contains(&"disable-device-node-modification"));
        // NVIDIA's hook only where it has the subcommand.
        let nvidia = |features: &[HookFeature]| {
            let hook = Some(CdiHook::nvidia("/usr/bin/nvidia-cdi-hook", features));
            subcommands(&driver_edits(
                &files.clone().with_hook(hook).with_driver_params(true),
            ))
            .contains(&"disable-device-node-modification")
        };
        assert!(!nvidia(&[]));
        assert!(nvidia(&[HookFeature::DisableDeviceNodeModification]));
    }

    #[test]
    fn a_simulated_driver_root_mounts_its_kernel_read_only_at_tessera_sim() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("usr/lib/x86_64-linux-gnu");
        let kernel = dir.path().join("state");
        fs::create_dir_all(&lib).unwrap();
        fs::create_dir_all(&kernel).unwrap();
        fs::write(lib.join("libcuda.so.580.1"), b"ELF").unwrap();
        symlink("libcuda.so.580.1", lib.join("libcuda.so.1")).unwrap();
        fs::write(kernel.join("kernel.json"), "{}").unwrap();
        symlink(&kernel, dir.path().join("tessera-sim")).unwrap();
        let edits = driver_edits(&DriverFiles::discover(
            &DriverRoot::new(dir.path()),
            Some("580.1"),
        ));
        let mount = edits
            .mounts
            .iter()
            .find(|m| m.container_path == "/tessera-sim")
            .expect("the simulated kernel is mounted");
        assert_eq!(
            mount.host_path,
            fs::canonicalize(&kernel).unwrap().display().to_string()
        );
        assert_eq!(mount.options, MOUNT_OPTIONS.map(String::from));
        assert!(mount.options.contains(&"ro".to_string()));
    }

    #[test]
    fn uuid_keys_are_valid_env_names_per_device() {
        assert_eq!(uuid_env_key("gpu-3"), "TESSERA_UUID_GPU_3");
        assert_eq!(
            uuid_env_key("gpu-1-mig-3g-40gb-4"),
            "TESSERA_UUID_GPU_1_MIG_3G_40GB_4"
        );
        assert_ne!(uuid_env_key("gpu-2"), uuid_env_key("gpu-3"));
    }
}
