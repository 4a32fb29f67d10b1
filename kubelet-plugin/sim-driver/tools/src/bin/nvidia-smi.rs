//! tessera's simulated `nvidia-smi`: like NVIDIA's, a program over `libnvidia-ml.so.1`, which it loads by
//! soname (the loader's path, `LD_PRELOAD`, its cache), else from the driver root's library directory next
//! to it ([`open_nvml`]). It sees
//! what the library shows the process: on the node every GPU, in a container the GPUs whose device nodes
//! it was given.
//!
//! Supported: `-L` / `--list-gpus`; `-q` / `--query` (a subset: driver and CUDA version, and per GPU the
//! product name, brand, architecture, UUID, minor number, PCI bus id, MIG mode current/pending, compute
//! mode, MIG devices); `-i` / `--id <index|UUID|PCI bus id>[,…]` to narrow either; `compute-policy -i <id>
//! --set-timeslice <0..3>`. Without arguments it prints the `-L` list under a version header. Exit codes
//! and messages follow NVIDIA's: 6 "No devices were found", 9 driver not loaded, 12 library not found,
//! 2 invalid argument.

use std::{ffi::OsStr, process::ExitCode};

use nvml_wrapper::{Device, Nvml, enum_wrappers::device::ComputeMode, error::NvmlError};

/// NVML's soname, as NVIDIA's nvidia-smi loads it.
const NVML_SONAME: &str = "libnvidia-ml.so.1";

/// `nvidia-smi`'s documented return values.
mod exit {
    pub const INVALID_ARGUMENT: u8 = 2;
    pub const NO_PERMISSION: u8 = 4;
    pub const NOT_FOUND: u8 = 6;
    pub const DRIVER_NOT_LOADED: u8 = 9;
    pub const LIBRARY_NOT_FOUND: u8 = 12;
    pub const FUNCTION_NOT_FOUND: u8 = 13;
    pub const GPU_LOST: u8 = 15;
    pub const OTHER: u8 = 255;
}

struct Failure {
    code: u8,
    message: String,
}

type Outcome = Result<(), Failure>;

fn fail(code: u8, message: impl Into<String>) -> Failure {
    Failure {
        code,
        message: message.into(),
    }
}

impl From<NvmlError> for Failure {
    fn from(e: NvmlError) -> Self {
        match e {
            NvmlError::LibloadingError(_) | NvmlError::LibraryNotFound => fail(
                exit::LIBRARY_NOT_FOUND,
                "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the \
                 NVIDIA Display Driver is properly installed and present in your system.\nPlease also try \
                 adding directory that contains libnvidia-ml.so to your system PATH.",
            ),
            NvmlError::DriverNotLoaded => fail(
                exit::DRIVER_NOT_LOADED,
                "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that \
                 the latest NVIDIA driver is installed and running.",
            ),
            NvmlError::NoPermission => fail(exit::NO_PERMISSION, "Insufficient Permissions"),
            NvmlError::GpuLost => fail(
                exit::GPU_LOST,
                "Unable to determine the device handle for GPU: GPU is lost",
            ),
            NvmlError::FailedToLoadSymbol(s) => fail(
                exit::FUNCTION_NOT_FOUND,
                format!("Local version of NVML doesn't implement this function: {s}"),
            ),
            other => fail(exit::OTHER, format!("{other}")),
        }
    }
}

/// What the command line asks for.
#[derive(Debug, Default)]
struct Request {
    list: bool,
    query: bool,
    ids: Option<Vec<String>>,
    compute_policy: bool,
    set_timeslice: Option<u32>,
}

fn parse(args: &[String]) -> Result<Request, Failure> {
    let mut req = Request::default();
    let mut it = args.iter();
    let invalid = |a: &str| {
        fail(
            exit::INVALID_ARGUMENT,
            format!("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n({a})"),
        )
    };
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let mut value = |name: &str| {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| invalid(&format!("{name} needs a value")))
        };
        match flag {
            "-L" | "--list-gpus" => req.list = true,
            "-q" | "--query" => req.query = true,
            "-i" | "--id" => {
                let ids = value(flag)?;
                req.ids = Some(ids.split(',').map(|s| s.trim().to_string()).collect());
            }
            "compute-policy" if !req.compute_policy => req.compute_policy = true,
            "--set-timeslice" if req.compute_policy => {
                let v = value(flag)?;
                match v.parse::<u32>() {
                    Ok(n) if n <= 3 => req.set_timeslice = Some(n),
                    _ => {
                        return Err(invalid(&format!(
                            "timeslice {v}: expected 0 (default), 1 (short), 2 (medium) or 3 (long)"
                        )));
                    }
                }
            }
            other => return Err(invalid(other)),
        }
    }
    if req.compute_policy && req.set_timeslice.is_none() {
        return Err(invalid("compute-policy: only --set-timeslice is supported"));
    }
    Ok(req)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match parse(&args).and_then(|req| run(&req)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            // NVIDIA's nvidia-smi prints its failures on stdout.
            println!("{}", f.message);
            ExitCode::from(f.code)
        }
    }
}

/// One GPU to print, and which of its MIG devices (all, or those named by `-i`).
struct Selected<'n> {
    index: u32,
    device: Device<'n>,
    mig_filter: Option<Vec<String>>,
}

fn run(req: &Request) -> Outcome {
    let nvml = open_nvml()?;
    let count = nvml.device_count()?;
    if count == 0 {
        return Err(fail(exit::NOT_FOUND, "No devices were found"));
    }
    let selected = select(&nvml, count, req.ids.as_deref())?;
    if req.compute_policy {
        return set_timeslice(&selected, req.set_timeslice.unwrap_or(0));
    }
    if req.query {
        return query(&nvml, &selected);
    }
    if !req.list {
        let driver = nvml.sys_driver_version()?;
        let cuda = cuda_version(nvml.sys_cuda_driver_version()?);
        println!("NVIDIA-SMI {driver}    Driver Version: {driver}    CUDA Version: {cuda}");
    }
    list(&selected)
}

fn select<'n>(nvml: &'n Nvml, count: u32, ids: Option<&[String]>) -> Result<Vec<Selected<'n>>, Failure> {
    let not_found = || fail(exit::NOT_FOUND, "No devices were found");
    let Some(ids) = ids else {
        return (0..count)
            .map(|index| {
                Ok(Selected {
                    index,
                    device: nvml.device_by_index(index)?,
                    mig_filter: None,
                })
            })
            .collect();
    };
    let mut out: Vec<Selected<'n>> = Vec::new();
    for id in ids {
        let (device, mig) = if let Ok(index) = id.parse::<u32>() {
            (nvml.device_by_index(index).map_err(|_| not_found())?, None)
        } else if id.starts_with("MIG-") {
            let mig = nvml.device_by_uuid(id.as_str()).map_err(|_| not_found())?;
            (
                mig.mig_parent_device().map_err(|_| not_found())?,
                Some(id.clone()),
            )
        } else if id.starts_with("GPU-") {
            (nvml.device_by_uuid(id.as_str()).map_err(|_| not_found())?, None)
        } else if id.contains(':') {
            (
                nvml.device_by_pci_bus_id(id.as_str()).map_err(|_| not_found())?,
                None,
            )
        } else {
            return Err(not_found());
        };
        let index = device.index()?;
        match out.iter_mut().find(|s| s.index == index) {
            Some(s) => match (&mut s.mig_filter, mig) {
                (Some(f), Some(m)) => f.push(m),
                (f, _) => *f = None,
            },
            None => out.push(Selected {
                index,
                device,
                mig_filter: mig.map(|m| vec![m]),
            }),
        }
    }
    out.sort_by_key(|s| s.index);
    Ok(out)
}

/// A GPU's MIG devices in NVML order, `(index, profile name, UUID)`; none without MIG mode.
fn mig_devices(s: &Selected<'_>) -> Result<Vec<(u32, String, String)>, Failure> {
    let enabled = match s.device.mig_mode() {
        Ok(m) => m.current == 1,
        Err(NvmlError::NotSupported) => false,
        Err(e) => return Err(e.into()),
    };
    if !enabled {
        return Ok(Vec::new());
    }
    let max = s.device.mig_device_count()?;
    let mut out = Vec::new();
    for i in 0..max {
        let mig = match s.device.mig_device_by_index(i) {
            Ok(m) => m,
            Err(NvmlError::NotFound) => continue,
            Err(e) => return Err(e.into()),
        };
        let uuid = mig.uuid()?;
        if s.mig_filter.as_ref().is_some_and(|f| !f.contains(&uuid)) {
            continue;
        }
        // NVML names a MIG device `<GPU name> MIG <profile>`.
        let name = mig.name()?;
        let profile = name
            .rsplit_once(" MIG ")
            .map_or(name.as_str(), |(_, p)| p)
            .to_string();
        out.push((i, profile, uuid));
    }
    Ok(out)
}

fn list(selected: &[Selected<'_>]) -> Outcome {
    for s in selected {
        println!(
            "GPU {}: {} (UUID: {})",
            s.index,
            s.device.name()?,
            s.device.uuid()?
        );
        for (i, profile, uuid) in mig_devices(s)? {
            println!("  MIG {profile:<11} Device {i:>2}: (UUID: {uuid})");
        }
    }
    Ok(())
}

fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// A `-q` line: the key padded to column 42 as NVIDIA prints it.
fn field(indent: usize, key: &str, value: impl std::fmt::Display) {
    let key = format!("{:indent$}{key}", "");
    println!("{key:<42}: {value}");
}

fn section(indent: usize, name: &str) {
    println!("{:indent$}{name}", "");
}

fn query(nvml: &Nvml, selected: &[Selected<'_>]) -> Outcome {
    println!("\n==============NVSMI LOG==============\n");
    field(0, "Driver Version", nvml.sys_driver_version()?);
    field(0, "CUDA Version", cuda_version(nvml.sys_cuda_driver_version()?));
    println!();
    field(0, "Attached GPUs", nvml.device_count()?);
    for s in selected {
        let d = &s.device;
        let pci = d.pci_info()?;
        println!("GPU {}", pci.bus_id);
        field(4, "Product Name", d.name()?);
        field(4, "Product Brand", format!("{:?}", d.brand()?).to_uppercase());
        field(4, "Product Architecture", format!("{:?}", d.architecture()?));
        section(4, "MIG Mode");
        let (current, pending) = match d.mig_mode() {
            Ok(m) => (on_off(m.current), on_off(m.pending)),
            Err(NvmlError::NotSupported) => ("N/A", "N/A"),
            Err(e) => return Err(e.into()),
        };
        field(8, "Current", current);
        field(8, "Pending", pending);
        let migs = mig_devices(s)?;
        if !migs.is_empty() {
            section(4, "MIG Devices");
            for (i, profile, uuid) in migs {
                section(8, &format!("MIG Device {i}"));
                field(12, "Profile", profile);
                field(12, "UUID", uuid);
            }
        }
        field(4, "GPU UUID", d.uuid()?);
        field(4, "Minor Number", d.minor_number()?);
        section(4, "PCI");
        field(8, "Bus", format!("0x{:02X}", pci.bus));
        field(8, "Device", format!("0x{:02X}", pci.device));
        field(8, "Domain", format!("0x{:04X}", pci.domain));
        field(8, "Bus Id", &pci.bus_id);
        let mode = match d.compute_mode()? {
            ComputeMode::Default => "Default",
            ComputeMode::ExclusiveThread => "Exclusive_Thread",
            ComputeMode::Prohibited => "Prohibited",
            ComputeMode::ExclusiveProcess => "Exclusive_Process",
        };
        field(4, "Compute Mode", mode);
    }
    Ok(())
}

fn on_off(v: u32) -> &'static str {
    if v == 1 { "Enabled" } else { "Disabled" }
}

/// `compute-policy --set-timeslice`: NVML has no public call for it (NVIDIA's tool uses a private one);
/// tessera's library exports `tesseraSimSetTimeSlice(nvmlDevice_t, unsigned int) -> nvmlReturn_t`.
fn set_timeslice(selected: &[Selected<'_>], slice: u32) -> Outcome {
    type SetTimeSlice = unsafe extern "C" fn(nvml_wrapper_sys::bindings::nvmlDevice_t, u32) -> u32;
    let symbol = nvml_private_symbol("tesseraSimSetTimeSlice").ok_or_else(|| {
        fail(
            exit::FUNCTION_NOT_FOUND,
            "Setting the compute time-slice is not supported by this libnvidia-ml.so.1",
        )
    })?;
    // SAFETY: the symbol comes from tessera's libnvidia-ml.so.1, which defines it with this signature.
    #[allow(unsafe_code, reason = "calling a private export of the loaded NVML library")]
    let set: SetTimeSlice = unsafe { std::mem::transmute::<*mut libc::c_void, SetTimeSlice>(symbol) };
    for s in selected {
        // SAFETY: a live handle of the initialised library, passed back to it.
        #[allow(
            unsafe_code,
            reason = "passing an NVML handle to the library's private export"
        )]
        let code = unsafe { set(s.device.handle(), slice) };
        if code != 0 {
            return Err(fail(
                exit::OTHER,
                format!(
                    "Failed to set the timeslice for GPU {}: NVML error {code}",
                    s.device.pci_info()?.bus_id
                ),
            ));
        }
        println!("Set timeslice to {slice} for GPU {}", s.device.pci_info()?.bus_id);
    }
    Ok(())
}

/// NVML by soname, where the loader finds it (`LD_LIBRARY_PATH`, its cache, its default directories), as
/// NVIDIA's nvidia-smi loads it; failing that, the driver root's own library next to this program
/// (`R/usr/bin` → `R/usr/lib/x86_64-linux-gnu`, GKE's `bin` → `lib64`), opened by path. Not a run path:
/// a run path would also apply to this program's own `libc.so.6`, and the library directory of a GPU
/// Operator rootfs holds the distribution's, which kills a program of another glibc before `main`.
fn open_nvml() -> Result<Nvml, NvmlError> {
    let err = match Nvml::builder().lib_path(OsStr::new(NVML_SONAME)).init() {
        Err(e @ (NvmlError::LibloadingError(_) | NvmlError::LibraryNotFound)) => e,
        other => return other,
    };
    let Some(bin) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|p| p.to_path_buf()))
    else {
        return Err(err);
    };
    ["../lib/x86_64-linux-gnu", "../lib64", "../lib"]
        .iter()
        .map(|d| bin.join(d).join(NVML_SONAME))
        .find(|p| p.is_file())
        .map_or(Err(err), |lib| Nvml::builder().lib_path(lib.as_os_str()).init())
}

/// A symbol of the already loaded NVML library (looked up by soname, without loading another copy).
fn nvml_private_symbol(name: &str) -> Option<*mut libc::c_void> {
    let soname = std::ffi::CString::new(NVML_SONAME).ok()?;
    let name = std::ffi::CString::new(name).ok()?;
    // SAFETY: plain libc calls with NUL-terminated strings; RTLD_NOLOAD only finds a loaded library.
    #[allow(unsafe_code, reason = "dlopen/dlsym of the loaded NVML library")]
    unsafe {
        let handle = libc::dlopen(soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if handle.is_null() {
            return None;
        }
        let sym = libc::dlsym(handle, name.as_ptr());
        (!sym.is_null()).then_some(sym)
    }
}
