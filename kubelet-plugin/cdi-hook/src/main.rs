//! `tessera-cdi-hook <create-symlinks|enable-cuda-compat|update-ldcache|disable-device-node-modification>
//! [options]`: run by the container runtime on the host as a `createContainer` hook of tessera's CDI specs, with the OCI state on stdin. See
//! the library's documentation for what each does.

use std::{
    io::Read,
    path::{Path, PathBuf},
    process::ExitCode,
};

use tessera_cdi_hook::{
    Compat, Error, Result, Rootfs, container_root, create_symlinks, enable_cuda_compat, host_ldconfig,
    update_ldcache,
};

const USAGE: &str = "usage: tessera-cdi-hook create-symlinks --link <target>::<link>...
       tessera-cdi-hook enable-cuda-compat --host-driver-version <version>
       tessera-cdi-hook update-ldcache --folder <dir>... [--ldconfig-path <host path>]
       tessera-cdi-hook disable-device-node-modification
  (each reads the OCI container state from stdin, or from --container-spec <file>)";

#[derive(Default)]
struct Options {
    links: Vec<(String, String)>,
    folders: Vec<String>,
    host_driver_version: Option<String>,
    ldconfig: Option<PathBuf>,
    state_file: Option<PathBuf>,
}

fn parse(args: &[String]) -> Result<(String, Options)> {
    let usage = |m: String| Error::Usage(format!("{m}\n{USAGE}"));
    let (command, rest) = args.split_first().ok_or_else(|| usage("no subcommand".into()))?;
    let mut o = Options::default();
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        // `--flag value` and `--flag=value`, as NVIDIA's hook takes them.
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (flag.as_str(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| usage(format!("{name} needs a value")))
        };
        match name {
            "--link" => {
                let v = value()?;
                let (target, link) = v
                    .split_once("::")
                    .ok_or_else(|| usage(format!("--link {v:?}: want <target>::<link>")))?;
                o.links.push((target.to_string(), link.to_string()));
            }
            "--folder" => o.folders.push(value()?),
            "--host-driver-version" => o.host_driver_version = Some(value()?),
            "--ldconfig-path" => o.ldconfig = Some(PathBuf::from(value()?)),
            "--container-spec" => {
                o.state_file = Some(PathBuf::from(value()?)).filter(|p| p != Path::new("-"))
            }
            other => return Err(usage(format!("unknown option {other:?}"))),
        }
    }
    Ok((command.clone(), o))
}

fn run(args: &[String]) -> Result<()> {
    if matches!(args.first().map(String::as_str), Some("-h" | "--help" | "help")) {
        println!("{USAGE}");
        return Ok(());
    }
    let (command, o) = parse(args)?;
    if !matches!(
        command.as_str(),
        "create-symlinks" | "enable-cuda-compat" | "update-ldcache" | "disable-device-node-modification"
    ) {
        return Err(Error::Usage(format!("unknown subcommand {command:?}\n{USAGE}")));
    }
    let state = match &o.state_file {
        Some(path) => std::fs::read(path).map_err(Error::ReadState)?,
        None => {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf).map_err(Error::ReadState)?;
            buf
        }
    };
    let root = Rootfs::new(container_root(&state)?);
    match command.as_str() {
        "create-symlinks" => create_symlinks(&root, &o.links),
        "enable-cuda-compat" => {
            let version = o.host_driver_version.ok_or_else(|| {
                Error::Usage(format!("enable-cuda-compat needs --host-driver-version\n{USAGE}"))
            })?;
            if let Compat::Enabled(v, why) = enable_cuda_compat(&root, &version)? {
                eprintln!("tessera-cdi-hook: CUDA compat driver {v} enabled: {why}");
            }
            Ok(())
        }
        "disable-device-node-modification" => {
            let host = Path::new(tessera_cdi_hook::params::DRIVER_PARAMS);
            tessera_cdi_hook::params::disable_device_node_modification(&root, host).map(drop)
        }
        _ => update_ldcache(&root, &o.folders, &host_ldconfig(o.ldconfig.as_deref())?),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tessera-cdi-hook: {e}");
            ExitCode::FAILURE
        }
    }
}
