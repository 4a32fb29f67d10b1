//! The simulated driver's `libcuda.so.1`, `nvidia-smi` and MPS tools, loaded and run as a CUDA program
//! and an administrator would, from a driver root installed from the built artifacts.
//!
//! The artifacts are built first ([`sim_driver::artifacts_dir`]).
//!
//! The library is `dlopen`ed in a child process (this test binary re-run as [`probe`]), one per check:
//! the environment (`CUDA_VISIBLE_DEVICES`, the test-only `/dev` override) is per process, and glibc loads
//! one inode once per process, so a fresh process is the only clean start.

#[path = "common/sim_driver.rs"]
mod sim_driver;

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::{Command, Output},
    time::Duration,
};

use tessera_api::MigPlacement;
use tessera_gpu_api::models;
use tessera_kubelet_plugin::devices::sharing::mps::{Launcher, MpsManager, send_control};
use tessera_kubelet_plugin::devices::sharing::{ShareRequest, Sharer};
use tessera_kubelet_plugin::gpu::driver_root::{DriverFiles, DriverRoot};
use tessera_kubelet_plugin::gpu::{ComputeMode, GpuBackend, TimeSlice};
use tessera_kubelet_plugin::node::edits::driver_edits;
use tessera_sim_model::backend::{NodeSpec, SimulatedBackend, mig_minors_by_formula};
use tessera_sim_model::driver_root::{LIBRARY_DIR, artifact_dirs, install};
use tessera_sim_model::kernel::{DEV_ROOT_ENV, SIMULATED_DRIVER_VERSION};

const MODEL: &str = "H100-SXM5-80GB";
const PRODUCT: &str = "NVIDIA H100 80GB HBM3";
/// Marks the probe's lines in the child's output (the test harness prints its own).
const MARK: &str = "PROBE ";

/// A simulated kernel K with its installed driver root R, in a temp dir.
struct Driver {
    dir: tempfile::TempDir,
    backend: SimulatedBackend,
}

impl Driver {
    fn new(gpus: u32) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("kernel");
        let spec = NodeSpec::default().with_gpus(MODEL, gpus);
        let backend = SimulatedBackend::from_spec("cuda-node", &spec, &kernel).unwrap();
        sim_driver::artifacts_dir();
        let dirs = artifact_dirs();
        install(&dir.path().join("root"), &kernel, &dirs)
            .unwrap()
            .require_complete(&dirs)
            .expect("build the simulated driver first: cargo build -p tessera-sim-cuda -p tessera-sim-tools -p tessera-sim-nvml");
        Self { dir, backend }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    fn libcuda(&self) -> PathBuf {
        self.root().join("usr/lib/x86_64-linux-gnu/libcuda.so.1")
    }

    fn bin(&self, name: &str) -> PathBuf {
        self.root().join("usr/bin").join(name)
    }

    fn uuid(&self, gpu: u32) -> String {
        self.backend.discover().unwrap().gpus[gpu as usize].uuid.clone()
    }

    /// A container's `/dev` holding the control nodes and `nodes` (`nvidia1`, `nvidia-caps/nvidia-cap12`).
    fn container_dev(&self, nodes: &[String]) -> PathBuf {
        let dev = self
            .dir
            .path()
            .join(format!("dev-{}", nodes.join("+").replace('/', "_")));
        fs::create_dir_all(dev.join("nvidia-caps")).unwrap();
        for n in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
            .into_iter()
            .map(String::from)
            .chain(nodes.iter().cloned())
        {
            fs::write(dev.join(n), b"").unwrap();
        }
        dev
    }

    /// Enables MIG on `gpu` and makes one `profile` MIG device at the first placement; its UUID and
    /// capability minors.
    fn mig_device(&self, gpu: u32, profile: &str) -> (String, (u32, u32)) {
        self.backend.set_mig_mode(gpu, true).unwrap();
        let p = models::model(MODEL).unwrap().profile_by_name(profile).unwrap();
        let placement: MigPlacement = p.placements().next().unwrap();
        let gi = self.backend.create_gpu_instance(gpu, p.id, placement).unwrap();
        let ci = self.backend.create_compute_instance(gpu, gi).unwrap();
        (ci.uuid, mig_minors_by_formula(gpu, gi, ci.id).unwrap())
    }

    /// Runs the probe on this root's libcuda with `env`.
    fn probe(&self, env: &[(&str, &str)]) -> Probe {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "probe", "--nocapture", "--test-threads=1"])
            .env("TESSERA_PROBE_LIB", self.libcuda())
            // A host with the driver installed has its directory in the loader's cache; libcuda loads its
            // JIT libraries from there by soname.
            .env("LD_LIBRARY_PATH", self.root().join(LIBRARY_DIR))
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove(DEV_ROOT_ENV)
            .env_remove("TESSERA_SIM_KERNEL")
            // No daemon there unless a test starts one.
            .env("CUDA_MPS_PIPE_DIRECTORY", self.dir.path().join("no-mps"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "probe failed: {}", text(&out));
        Probe::parse(&text(&out))
    }

    fn smi(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = Command::new(self.bin("nvidia-smi"));
        cmd.args(args)
            .env_remove(DEV_ROOT_ENV)
            .env_remove("TESSERA_SIM_KERNEL");
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// What the probe printed: `init`, then per device `uuid`/`name`/`mem`/`cc`, then the context results.
#[derive(Debug, Default)]
struct Probe {
    fields: BTreeMap<String, String>,
    devices: Vec<BTreeMap<String, String>>,
}

impl Probe {
    fn parse(output: &str) -> Self {
        let mut p = Probe::default();
        // The harness may print `test probe ... ` before the first line.
        for line in output
            .lines()
            .filter_map(|l| l.split_once(MARK).map(|(_, rest)| rest))
        {
            let pairs: BTreeMap<String, String> = line
                .split('\t')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            if pairs.contains_key("dev") {
                p.devices.push(pairs);
            } else {
                p.fields.extend(pairs);
            }
        }
        assert!(
            p.fields.contains_key("init"),
            "the probe printed nothing: {output}"
        );
        p
    }

    fn get(&self, key: &str) -> &str {
        self.fields.get(key).map_or("", String::as_str)
    }

    fn uuids(&self) -> Vec<&str> {
        self.devices.iter().map(|d| d["uuid"].as_str()).collect()
    }
}

/// The probe: when the parent test sets `TESSERA_PROBE_LIB`, `dlopen`s that library and prints what a
/// CUDA program sees; otherwise does nothing (so the plain test run passes it).
#[test]
fn probe() {
    let Some(lib) = std::env::var_os("TESSERA_PROBE_LIB") else {
        return;
    };
    cuda_probe::run(Path::new(&lib));
}

#[allow(
    unsafe_code,
    reason = "the probe calls the library's C ABI through dlsym, as a CUDA program does"
)]
mod cuda_probe {
    use std::{
        ffi::{CStr, CString, c_char, c_int, c_uint, c_void},
        path::Path,
    };

    use super::MARK;

    type Init = unsafe extern "C" fn(c_uint) -> c_int;
    type GetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
    type Get = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
    type GetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
    type GetUuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> c_int;
    type TotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
    type GetAttr = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
    type CtxCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> c_int;
    type CtxDestroy = unsafe extern "C" fn(*mut c_void) -> c_int;
    type ExecAffinity = unsafe extern "C" fn(*mut [c_uint; 2], c_int) -> c_int;
    type MemInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
    type ServerPid = unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int;
    type SmShare = unsafe extern "C" fn(*mut c_void, *mut f64, *mut c_int) -> c_int;
    type ErrorName = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;
    type ModuleLoadData = unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int;
    type ModuleUnload = unsafe extern "C" fn(*mut c_void) -> c_int;
    type LinkCreate = unsafe extern "C" fn(c_uint, *mut c_int, *mut *mut c_void, *mut *mut c_void) -> c_int;
    type LinkAddData = unsafe extern "C" fn(
        *mut c_void,
        c_int,
        *mut c_void,
        usize,
        *const c_char,
        c_uint,
        *mut c_int,
        *mut *mut c_void,
    ) -> c_int;
    type LinkComplete = unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut usize) -> c_int;
    type LinkDestroy = unsafe extern "C" fn(*mut c_void) -> c_int;

    /// The smallest PTX module: one empty kernel.
    const PTX: &CStr =
        c".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry tessera_probe() { ret; }\n";
    /// NVVM IR as text (`CU_JIT_INPUT_NVVM` = 5).
    const NVVM_IR: &[u8] =
        b"target triple = \"nvptx64-nvidia-cuda\"\ndefine void @tessera_probe() { ret void }\n";
    const CU_JIT_INPUT_NVVM: c_int = 5;

    struct Lib(*mut c_void);

    impl Lib {
        fn sym<T: Copy>(&self, name: &str) -> T {
            let c = CString::new(name).unwrap();
            // SAFETY: a handle from dlopen and a NUL-terminated name.
            let p = unsafe { libc::dlsym(self.0, c.as_ptr()) };
            assert!(!p.is_null(), "libcuda.so.1 does not export {name}");
            assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
            // SAFETY: `T` is the function pointer type of the export named `name`.
            unsafe { std::mem::transmute_copy(&p) }
        }
    }

    fn say(fields: &[(&str, String)]) {
        let line: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("{MARK}{}", line.join("\t"));
    }

    fn hyphenated(b: &[u8; 16]) -> String {
        let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
        format!(
            "{}-{}-{}-{}-{}",
            &h[..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..]
        )
    }

    pub fn run(path: &Path) {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: dlopen of a file path.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen {} failed", path.display());
        let lib = Lib(handle);
        // SAFETY (every call below): CUDA's signatures, with valid out-pointers.
        unsafe {
            let rc = lib.sym::<Init>("cuInit")(0);
            let mut name: *const c_char = std::ptr::null();
            lib.sym::<ErrorName>("cuGetErrorName")(rc, &mut name);
            let rc_name = if name.is_null() {
                "?".to_string()
            } else {
                CStr::from_ptr(name).to_string_lossy().into_owned()
            };
            say(&[("init", rc.to_string()), ("init_name", rc_name)]);
            if rc != 0 {
                return;
            }
            let mut n = 0;
            assert_eq!(lib.sym::<GetCount>("cuDeviceGetCount")(&mut n), 0);
            say(&[("count", n.to_string())]);
            for i in 0..n {
                let mut dev = -1;
                assert_eq!(lib.sym::<Get>("cuDeviceGet")(&mut dev, i), 0);
                let mut buf = [0 as c_char; 256];
                assert_eq!(
                    lib.sym::<GetName>("cuDeviceGetName")(buf.as_mut_ptr(), 256, dev),
                    0
                );
                let name = CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
                let mut uuid = [0u8; 16];
                assert_eq!(lib.sym::<GetUuid>("cuDeviceGetUuid_v2")(&mut uuid, dev), 0);
                let mut mem = 0usize;
                assert_eq!(lib.sym::<TotalMem>("cuDeviceTotalMem_v2")(&mut mem, dev), 0);
                let attr = |a: c_int| {
                    let mut v = -1;
                    assert_eq!(lib.sym::<GetAttr>("cuDeviceGetAttribute")(&mut v, a, dev), 0);
                    v
                };
                say(&[
                    ("dev", i.to_string()),
                    ("uuid", hyphenated(&uuid)),
                    ("name", name),
                    ("mem", mem.to_string()),
                    ("cc", format!("{}.{}", attr(75), attr(76))),
                    ("sms", attr(16).to_string()),
                ]);
            }
            let ordinal: c_int = std::env::var("TESSERA_PROBE_CTX")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let mut ctx: *mut c_void = std::ptr::null_mut();
            let rc = lib.sym::<CtxCreate>("cuCtxCreate_v2")(&mut ctx, 0, ordinal);
            say(&[("ctx", rc.to_string())]);
            if rc != 0 {
                return;
            }
            let mut pid = 0;
            let mps = lib.sym::<ServerPid>("tesseraSimCtxGetMpsServerPid")(ctx, &mut pid);
            let mut affinity = [0 as c_uint; 2];
            assert_eq!(
                lib.sym::<ExecAffinity>("cuCtxGetExecAffinity")(&mut affinity, 0),
                0
            );
            let (mut free, mut total) = (0usize, 0usize);
            assert_eq!(lib.sym::<MemInfo>("cuMemGetInfo_v2")(&mut free, &mut total), 0);
            let (mut share, mut busy) = (0f64, 0 as c_int);
            let share_rc = lib.sym::<SmShare>("tesseraSimCtxGetSmShare")(ctx, &mut share, &mut busy);
            say(&[
                ("mps", mps.to_string()),
                ("server_pid", pid.to_string()),
                ("ctx_sms", affinity[1].to_string()),
                ("ctx_mem", total.to_string()),
                ("sm_share_rc", share_rc.to_string()),
                ("sm_share", format!("{share:.3}")),
                ("busy_clients", busy.to_string()),
            ]);
            // What a PyTorch or Triton kernel needs: PTX through the JIT compiler, NVVM IR through NVVM.
            let mut module: *mut c_void = std::ptr::null_mut();
            let module_rc = lib.sym::<ModuleLoadData>("cuModuleLoadData")(&mut module, PTX.as_ptr().cast());
            if module_rc == 0 {
                assert_eq!(lib.sym::<ModuleUnload>("cuModuleUnload")(module), 0);
                assert_eq!(lib.sym::<ModuleUnload>("cuModuleUnload")(module), 400);
            }
            let mut link: *mut c_void = std::ptr::null_mut();
            assert_eq!(
                lib.sym::<LinkCreate>("cuLinkCreate_v2")(
                    0,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    &mut link
                ),
                0
            );
            let nvvm_rc = lib.sym::<LinkAddData>("cuLinkAddData_v2")(
                link,
                CU_JIT_INPUT_NVVM,
                NVVM_IR.as_ptr().cast_mut().cast(),
                NVVM_IR.len(),
                c"probe.ll".as_ptr(),
                0,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            let (mut cubin, mut size) = (std::ptr::null_mut(), 0usize);
            let linked = lib.sym::<LinkComplete>("cuLinkComplete")(link, &mut cubin, &mut size);
            if nvvm_rc == 0 {
                assert_eq!(linked, 0);
                // The linked image loads as a module, with no JIT.
                let mut m: *mut c_void = std::ptr::null_mut();
                assert_eq!(lib.sym::<ModuleLoadData>("cuModuleLoadData")(&mut m, cubin), 0);
            }
            assert_eq!(lib.sym::<LinkDestroy>("cuLinkDestroy")(link), 0);
            say(&[("module", module_rc.to_string()), ("nvvm", nvvm_rc.to_string())]);
            assert_eq!(lib.sym::<CtxDestroy>("cuCtxDestroy_v2")(ctx), 0);
            // Without a context there is nothing to load a module into.
            let mut m: *mut c_void = std::ptr::null_mut();
            assert_eq!(
                lib.sym::<ModuleLoadData>("cuModuleLoadData")(&mut m, PTX.as_ptr().cast()),
                201
            );
            // A destroyed context is gone.
            assert_eq!(lib.sym::<CtxDestroy>("cuCtxDestroy_v2")(ctx), 201);
        }
    }
}

#[test]
fn a_ptx_module_loads_through_the_jit_compiler_the_loader_finds_by_soname() {
    let d = Driver::new(1);
    let p = d.probe(&[]);
    assert_eq!((p.get("module"), p.get("nvvm")), ("0", "0"), "{p:?}");
    // Outside the loader's search path (no cache entry, no LD_LIBRARY_PATH), the libraries beside
    // libcuda.so.1 are not found, as NVIDIA's libcuda does not find them either.
    let elsewhere = d.dir.path().join("elsewhere");
    fs::create_dir_all(&elsewhere).unwrap();
    let p = d.probe(&[("LD_LIBRARY_PATH", elsewhere.to_str().unwrap())]);
    assert_eq!(p.get("ctx"), "0", "{p:?}");
    assert_eq!(
        (p.get("module"), p.get("nvvm")),
        ("221", "221"),
        "CUDA_ERROR_JIT_COMPILER_NOT_FOUND: {p:?}"
    );
    // NVVM alone missing: PTX still loads.
    fs::copy(
        d.root().join(LIBRARY_DIR).join("libnvidia-ptxjitcompiler.so.1"),
        elsewhere.join("libnvidia-ptxjitcompiler.so.1"),
    )
    .unwrap();
    let p = d.probe(&[("LD_LIBRARY_PATH", elsewhere.to_str().unwrap())]);
    assert_eq!((p.get("module"), p.get("nvvm")), ("0", "221"), "{p:?}");
}

/// A container's filesystem as the runtime assembles it from `edits`' mounts, under `dir`: each mount a
/// symlink to its host file (standing for the bind mount), the simulated kernel at `/tessera-sim`. Returns
/// the container's `libcuda.so.1` and its loader search path (the library directories the hook's
/// `update-ldcache` puts in the container's cache).
fn container_from(
    mounts: &[tessera_kubelet_plugin::node::cdi::Mount],
    dir: &Path,
    ld_dirs: &[String],
) -> (PathBuf, String) {
    for m in mounts {
        let at = dir.join(m.container_path.trim_start_matches('/'));
        fs::create_dir_all(at.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&m.host_path, &at).unwrap();
    }
    let search: Vec<String> = ld_dirs
        .iter()
        .map(|d| dir.join(d.trim_start_matches('/')).display().to_string())
        .collect();
    (dir.join(LIBRARY_DIR).join("libcuda.so.1"), search.join(":"))
}

#[test]
fn a_container_from_tesseras_spec_jit_compiles_ptx_and_one_without_the_jit_library_cannot() {
    let d = Driver::new(1);
    let files = DriverFiles::discover(&DriverRoot::new(d.root()), Some(SIMULATED_DRIVER_VERSION));
    let mounts = driver_edits(&files).mounts;
    for soname in ["libnvidia-ptxjitcompiler.so.1", "libnvidia-nvvm.so.4"] {
        assert!(
            mounts
                .iter()
                .any(|m| m.container_path == format!("/{LIBRARY_DIR}/{soname}")),
            "the spec lacks {soname}: {mounts:?}"
        );
    }
    let dirs = files.container_library_dirs();
    let run = |name: &str, mounts: &[tessera_kubelet_plugin::node::cdi::Mount]| {
        let (libcuda, search) = container_from(mounts, &d.dir.path().join(name), &dirs);
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "probe", "--nocapture", "--test-threads=1"])
            .env("TESSERA_PROBE_LIB", &libcuda)
            .env("LD_LIBRARY_PATH", &search)
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove(DEV_ROOT_ENV)
            .env_remove("TESSERA_SIM_KERNEL")
            .env("CUDA_MPS_PIPE_DIRECTORY", d.dir.path().join("no-mps"));
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "probe failed: {}", text(&out));
        Probe::parse(&text(&out))
    };
    let p = run("container", &mounts);
    assert_eq!(p.get("ctx"), "0", "{p:?}");
    assert_eq!((p.get("module"), p.get("nvvm")), ("0", "0"), "{p:?}");

    // The rule's teeth: a spec that forgets the PTX JIT (as one listing only libcuda and NVML would)
    // still gives a working context, and PTX fails as on a real GPU.
    let without: Vec<_> = mounts
        .iter()
        .filter(|m| !m.container_path.contains("libnvidia-ptxjitcompiler"))
        .cloned()
        .collect();
    let p = run("without-jit", &without);
    assert_eq!(p.get("ctx"), "0", "{p:?}");
    assert_eq!(p.get("module"), "221", "CUDA_ERROR_JIT_COMPILER_NOT_FOUND: {p:?}");
    assert_eq!(p.get("nvvm"), "221", "NVVM's PTX needs the JIT too: {p:?}");
}

fn strip(uuid: &str) -> &str {
    uuid.trim_start_matches("GPU-").trim_start_matches("MIG-")
}

#[test]
fn the_host_sees_every_gpu_with_its_uuid_name_and_memory() {
    let d = Driver::new(2);
    let p = d.probe(&[]);
    assert_eq!(p.get("init"), "0", "{p:?}");
    assert_eq!(p.uuids(), [strip(&d.uuid(0)), strip(&d.uuid(1))]);
    let model = models::model(MODEL).unwrap();
    for dev in &p.devices {
        assert_eq!(dev["name"], PRODUCT);
        assert_eq!(dev["mem"], model.memory_bytes().to_string());
        assert_eq!(dev["cc"], "9.0");
        assert_eq!(dev["sms"], model.multiprocessors.to_string());
    }
    // Default compute mode and no MPS daemon: a direct context.
    assert_eq!(p.get("ctx"), "0");
    assert_eq!(p.get("mps"), "801", "a direct context has no MPS server");
}

#[test]
fn cuda_visible_devices_narrows_and_orders_the_devices() {
    let d = Driver::new(3);
    let (g0, g2) = (d.uuid(0), d.uuid(2));
    let p = d.probe(&[("CUDA_VISIBLE_DEVICES", &g2)]);
    assert_eq!(p.uuids(), [strip(&g2)]);
    let p = d.probe(&[("CUDA_VISIBLE_DEVICES", "2,0")]);
    assert_eq!(p.uuids(), [strip(&g2), strip(&g0)]);
    // A prefix names its GPU; an entry naming nothing ends the list.
    let p = d.probe(&[(
        "CUDA_VISIBLE_DEVICES",
        &format!("{},GPU-nonexistent,1", &g0[..12]),
    )]);
    assert_eq!(p.uuids(), [strip(&g0)]);
    let p = d.probe(&[("CUDA_VISIBLE_DEVICES", "")]);
    assert_eq!(
        (p.get("init"), p.get("init_name")),
        ("100", "CUDA_ERROR_NO_DEVICE")
    );
}

#[test]
fn a_container_sees_only_the_gpus_whose_device_nodes_it_holds() {
    let d = Driver::new(3);
    let dev = d.container_dev(&["nvidia1".into()]);
    let p = d.probe(&[(DEV_ROOT_ENV, dev.to_str().unwrap())]);
    assert_eq!(p.uuids(), [strip(&d.uuid(1))]);
    // Its one GPU is ordinal 0; CUDA_VISIBLE_DEVICES cannot reach a GPU the container lacks.
    let p = d.probe(&[
        (DEV_ROOT_ENV, dev.to_str().unwrap()),
        ("CUDA_VISIBLE_DEVICES", &d.uuid(0)),
    ]);
    assert_eq!(p.get("init"), "100");
    // Control nodes alone: no GPU.
    let bare = d.container_dev(&[]);
    assert_eq!(
        d.probe(&[(DEV_ROOT_ENV, bare.to_str().unwrap())]).get("init"),
        "100"
    );
}

#[test]
fn a_mig_device_enumerates_on_its_own_and_needs_its_capability_nodes_in_a_container() {
    let d = Driver::new(2);
    let (mig, (gi_minor, ci_minor)) = d.mig_device(0, "3g.40gb");
    let p = d.probe(&[]);
    // GPU 0 is in MIG mode: its MIG device replaces it; GPU 1 is whole.
    assert_eq!(p.uuids(), [strip(&mig), strip(&d.uuid(1))]);
    let profile = models::model(MODEL).unwrap().profile_by_name("3g.40gb").unwrap();
    assert_eq!(p.devices[0]["name"], format!("{PRODUCT} MIG 3g.40gb"));
    assert_eq!(p.devices[0]["mem"], (profile.memory_mib << 20).to_string());
    assert_eq!(p.devices[0]["sms"], profile.multiprocessors.to_string());

    let caps = [
        "nvidia0".to_string(),
        format!("nvidia-caps/nvidia-cap{gi_minor}"),
        format!("nvidia-caps/nvidia-cap{ci_minor}"),
    ];
    let held = d.container_dev(&caps);
    let p = d.probe(&[(DEV_ROOT_ENV, held.to_str().unwrap())]);
    assert_eq!(p.uuids(), [strip(&mig)]);
    let p = d.probe(&[
        (DEV_ROOT_ENV, held.to_str().unwrap()),
        ("CUDA_VISIBLE_DEVICES", &mig),
    ]);
    assert_eq!(p.uuids(), [strip(&mig)]);
    // The parent's node without the capabilities runs nothing.
    let parent_only = d.container_dev(&caps[..1]);
    assert_eq!(
        d.probe(&[(DEV_ROOT_ENV, parent_only.to_str().unwrap())])
            .get("init"),
        "100"
    );
}

#[test]
fn an_exclusive_process_gpu_refuses_a_context_without_an_mps_server_and_serves_one_through_it() {
    let d = Driver::new(1);
    let gpu = d.uuid(0);
    d.backend
        .set_compute_mode(0, ComputeMode::ExclusiveProcess)
        .unwrap();
    let pipe = d.dir.path().join("mps/pipe");
    let log = d.dir.path().join("mps/log");
    let pipe_s = pipe.to_str().unwrap();

    let p = d.probe(&[("CUDA_MPS_PIPE_DIRECTORY", pipe_s)]);
    assert_eq!(
        p.get("ctx"),
        "46",
        "no MPS server: CUDA_ERROR_DEVICES_UNAVAILABLE: {p:?}"
    );

    let control = |args: &[&str], input: Option<&str>| {
        let mut cmd = Command::new(d.bin("nvidia-cuda-mps-control"));
        cmd.args(args)
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &log)
            .env("CUDA_VISIBLE_DEVICES", &gpu)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        if let Some(text) = input {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
        }
        drop(child.stdin.take());
        child.wait_with_output().unwrap()
    };
    let started = control(&["-d"], None);
    let _quit = QuitOnDrop(pipe.clone());
    assert!(started.status.success(), "{}", text(&started));
    let set = control(
        &[],
        Some("set_default_active_thread_percentage 25\nset_default_device_pinned_mem_limit 0 2048M\n"),
    );
    assert!(set.status.success(), "{}", text(&set));
    let asked = control(
        &[],
        Some("get_default_active_thread_percentage\nget_server_list\n"),
    );
    assert_eq!(
        String::from_utf8_lossy(&asked.stdout).trim(),
        "25.0",
        "no server before a client"
    );

    let p = d.probe(&[("CUDA_MPS_PIPE_DIRECTORY", pipe_s)]);
    assert_eq!((p.get("ctx"), p.get("mps")), ("0", "0"), "{p:?}");
    let server: u32 = p.get("server_pid").parse().unwrap();
    assert!(
        Path::new(&format!("/proc/{server}")).exists(),
        "server {server} runs"
    );
    let listed = control(&[], Some("get_server_list\n"));
    assert_eq!(String::from_utf8_lossy(&listed.stdout).trim(), server.to_string());
    let sms = models::model(MODEL).unwrap().multiprocessors;
    assert_eq!(p.get("ctx_sms"), (sms * 25).div_ceil(100).to_string());
    assert_eq!(p.get("ctx_mem"), (2048u64 << 20).to_string());
    // A second client shares the server; its own env lowers its share only.
    let p2 = d.probe(&[
        ("CUDA_MPS_PIPE_DIRECTORY", pipe_s),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10"),
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G"),
    ]);
    assert_eq!(p2.get("server_pid"), server.to_string());
    assert_eq!(p2.get("ctx_sms"), (sms * 10).div_ceil(100).to_string());
    assert_eq!(p2.get("ctx_mem"), (1u64 << 30).to_string());
    let server_log = fs::read_to_string(log.join("server.log")).unwrap();
    assert!(
        server_log.contains(&format!("server pid={server} devices={gpu}")),
        "{server_log}"
    );

    let quit = control(&[], Some("quit\n"));
    assert!(quit.status.success(), "{}", text(&quit));
    wait_gone(server);
    let p = d.probe(&[("CUDA_MPS_PIPE_DIRECTORY", pipe_s)]);
    assert_eq!(p.get("ctx"), "46", "the server is gone again");
    // A dead pipe with the default compute mode falls back to a direct context, as CUDA does.
    d.backend.set_compute_mode(0, ComputeMode::Default).unwrap();
    let p = d.probe(&[("CUDA_MPS_PIPE_DIRECTORY", pipe_s)]);
    assert_eq!((p.get("ctx"), p.get("mps")), ("0", "801"));
}

/// Issue 39 item 1: a burstable share's context gets its ceiling of the SMs while its GPU's other MPS
/// clients are idle, and shares the SMs when they are busy too (`tessera_sim_model::contention`).
#[test]
fn a_burstable_mps_context_sees_its_ceiling_alone_and_its_contention_beside_a_busy_neighbour() {
    use tessera_sim_model::load::{self as simulated_load, LoadEntry};
    let d = Driver::new(1);
    let gpu = d.uuid(0);
    let pipe = d.dir.path().join("mps/pipe");
    let pipe_s = pipe.to_str().unwrap();
    let started = Command::new(d.bin("nvidia-cuda-mps-control"))
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", d.dir.path().join("mps/log"))
        .env("CUDA_VISIBLE_DEVICES", &gpu)
        .output()
        .unwrap();
    let _quit = QuitOnDrop(pipe.clone());
    assert!(started.status.success(), "{}", text(&started));
    let share_of = |claim: &str| {
        d.probe(&[
            ("CUDA_MPS_PIPE_DIRECTORY", pipe_s),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "80"),
            ("TESSERA_DEVICE", "gpu-0-shared"),
            ("TESSERA_CLAIM", claim),
        ])
    };
    let a = share_of("ns/a");
    assert_eq!(
        (a.get("sm_share_rc"), a.get("sm_share"), a.get("busy_clients")),
        ("0", "0.800", "1"),
        "alone: its ceiling: {a:?}"
    );
    let busy = |claim: &str| LoadEntry {
        device: "gpu-0-shared".into(),
        claim: Some(claim.into()),
        utilization_percent: 80,
        mps_client: true,
        active_thread_percentage: Some(80),
        ..LoadEntry::default()
    };
    let kernel = d.backend.kernel_dir();
    simulated_load::set(kernel, busy("ns/a")).unwrap();
    assert_eq!(
        share_of("ns/a").get("sm_share"),
        "0.800",
        "its own load is itself"
    );
    simulated_load::set(kernel, busy("ns/b")).unwrap();
    for claim in ["ns/a", "ns/b"] {
        let p = share_of(claim);
        assert_eq!(
            (p.get("sm_share"), p.get("busy_clients")),
            ("0.500", "2"),
            "{claim}: two busy 80 % clients share the GPU: {p:?}"
        );
    }
    // A direct context has no MPS limit to weigh.
    let direct = d.probe(&[]);
    assert_eq!(direct.get("sm_share_rc"), "801", "{direct:?}");
}

#[test]
fn a_daemon_refuses_a_client_of_a_device_it_does_not_serve() {
    let d = Driver::new(2);
    let pipe = d.dir.path().join("pipe");
    let started = Command::new(d.bin("nvidia-cuda-mps-control"))
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", d.dir.path().join("log"))
        .env("CUDA_VISIBLE_DEVICES", d.uuid(1))
        .output()
        .unwrap();
    let _quit = QuitOnDrop(pipe.clone());
    assert!(started.status.success(), "{}", text(&started));
    let p = d.probe(&[
        ("CUDA_MPS_PIPE_DIRECTORY", pipe.to_str().unwrap()),
        ("TESSERA_PROBE_CTX", "0"),
    ]);
    assert_eq!(p.get("ctx"), "805", "CUDA_ERROR_MPS_CONNECTION_FAILED: {p:?}");
}

#[test]
fn the_plugins_nvidia_launcher_drives_the_simulated_mps_tools_unchanged() {
    let d = Driver::new(1);
    let state = d.dir.path().join("state");
    let mps = MpsManager::new(
        &state,
        Launcher::Nvidia {
            control: d.bin("nvidia-cuda-mps-control"),
            driver_root: d.root(),
        },
    );
    let defaults = tessera_kubelet_plugin::devices::sharing::supervisor_protocol::DaemonDefaults {
        active_thread_percentage: Some(40),
        pinned_memory_bytes: Some(3 << 30),
    };
    let uuid = d.uuid(0);
    let dirs = mps.start(&uuid, &uuid, defaults).unwrap();
    let _quit = QuitOnDrop(dirs.pipe.clone());
    let pid = mps.pid(&uuid).expect("the daemon's pid file");
    assert_eq!(
        mps.send(&uuid, "get_default_active_thread_percentage").unwrap(),
        "40.0"
    );
    assert_eq!(
        mps.send(&uuid, "get_default_device_pinned_mem_limit 0").unwrap(),
        "3072M"
    );
    assert_eq!(mps.running(), std::slice::from_ref(&uuid));
    // A client in a share container reaches it through the pipe directory.
    let p = d.probe(&[("CUDA_MPS_PIPE_DIRECTORY", dirs.pipe.to_str().unwrap())]);
    assert_eq!((p.get("ctx"), p.get("mps")), ("0", "0"), "{p:?}");
    assert_eq!(p.get("ctx_mem"), (3u64 << 30).to_string());
    let server: u32 = p.get("server_pid").parse().unwrap();
    mps.stop(&uuid).unwrap();
    wait_gone(pid);
    wait_gone(server);
    assert!(mps.running().is_empty());
}

/// Starts a simulated control daemon (`nvidia-cuda-mps-control -d`) for GPU `gpu` in `<dir>/<name>/`;
/// its pipe directory, quit when the guard drops.
fn start_daemon(d: &Driver, name: &str, gpu: u32) -> (PathBuf, QuitOnDrop) {
    let pipe = d.dir.path().join(name).join("pipe");
    let started = Command::new(d.bin("nvidia-cuda-mps-control"))
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", d.dir.path().join(name).join("log"))
        .env("CUDA_VISIBLE_DEVICES", d.uuid(gpu))
        .output()
        .unwrap();
    assert!(started.status.success(), "{}", text(&started));
    (pipe.clone(), QuitOnDrop(pipe))
}

#[test]
fn a_second_mps_server_cannot_open_an_exclusive_process_gpu_another_server_holds() {
    let d = Driver::new(1);
    d.backend
        .set_compute_mode(0, ComputeMode::ExclusiveProcess)
        .unwrap();
    let (first, _quit_first) = start_daemon(&d, "team-a", 0);
    let (second, _quit_second) = start_daemon(&d, "team-b", 0);
    let p = d.probe(&[("CUDA_MPS_PIPE_DIRECTORY", first.to_str().unwrap())]);
    assert_eq!((p.get("ctx"), p.get("mps")), ("0", "0"), "{p:?}");
    let held_by: u32 = p.get("server_pid").parse().unwrap();

    // The second daemon's server cannot open the GPU, so its client is refused.
    let p = d.probe(&[("CUDA_MPS_PIPE_DIRECTORY", second.to_str().unwrap())]);
    assert_eq!(p.get("ctx"), "805", "CUDA_ERROR_MPS_CONNECTION_FAILED: {p:?}");
    let log = fs::read_to_string(d.dir.path().join("team-b/log/server.log")).unwrap();
    assert!(
        log.contains("EXCLUSIVE_PROCESS") && log.contains(&held_by.to_string()),
        "{log}"
    );

    // In DEFAULT mode each server opens the GPU.
    d.backend.set_compute_mode(0, ComputeMode::Default).unwrap();
    let p = d.probe(&[("CUDA_MPS_PIPE_DIRECTORY", second.to_str().unwrap())]);
    assert_eq!((p.get("ctx"), p.get("mps")), ("0", "0"), "{p:?}");
    assert_ne!(p.get("server_pid"), held_by.to_string());

    // PROHIBITED: no server opens it.
    send_control(&second, "quit").unwrap();
    d.backend.set_compute_mode(0, ComputeMode::Prohibited).unwrap();
    let (third, _quit_third) = start_daemon(&d, "team-c", 0);
    let p = d.probe(&[("CUDA_MPS_PIPE_DIRECTORY", third.to_str().unwrap())]);
    assert_eq!(p.get("ctx"), "805", "{p:?}");
}

#[test]
fn the_plugin_lets_the_mps_servers_of_two_namespaces_open_one_gpu() {
    let d = Driver::new(1);
    let state = d.dir.path().join("state");
    let mps = MpsManager::new(
        &state,
        Launcher::Nvidia {
            control: d.bin("nvidia-cuda-mps-control"),
            driver_root: d.root(),
        },
    );
    let backend = std::sync::Arc::new(SimulatedBackend::open_kernel(&d.dir.path().join("kernel")).unwrap());
    let sharer = Sharer::new(backend, mps, false);
    let gpus = d.backend.discover().unwrap().gpus;
    let device = tessera_api::DeviceName::SharedGpu { gpu: 0 };
    let consumed = Default::default();
    let share = |holder: &str, tenant: &str| {
        sharer
            .prepare(&ShareRequest {
                holder: holder.into(),
                device: &device,
                gpu: &gpus[0],
                uuid: &gpus[0].uuid,
                strategy: tessera_api::config::SharingStrategy::Mps,
                mps: None,
                interval: Default::default(),
                consumed: &consumed,
                tenant: Some(tenant),
            })
            .unwrap()
            .mps_pipe_dir
            .unwrap()
    };
    let a = share("uid-a/gpu-0-shared", "team-a");
    let _quit_a = QuitOnDrop(PathBuf::from(&a));
    let b = share("uid-b/gpu-0-shared", "team-b");
    let _quit_b = QuitOnDrop(PathBuf::from(&b));
    let pa = d.probe(&[("CUDA_MPS_PIPE_DIRECTORY", a.as_str())]);
    let pb = d.probe(&[("CUDA_MPS_PIPE_DIRECTORY", b.as_str())]);
    for p in [&pa, &pb] {
        assert_eq!(
            (p.get("ctx"), p.get("mps")),
            ("0", "0"),
            "each namespace's client has a server: {p:?}"
        );
    }
    assert_ne!(pa.get("server_pid"), pb.get("server_pid"));
    for holder in ["uid-a/gpu-0-shared", "uid-b/gpu-0-shared"] {
        sharer
            .unprepare(
                &gpus[0],
                &device,
                holder,
                tessera_api::config::SharingStrategy::Mps,
            )
            .unwrap();
    }
}

/// Sends `quit` to the daemon of a pipe directory when dropped, so a failing test leaves no daemon behind.
struct QuitOnDrop(PathBuf);

impl Drop for QuitOnDrop {
    fn drop(&mut self) {
        let _ = tessera_kubelet_plugin::devices::sharing::mps::send_control(&self.0, "quit");
    }
}

fn wait_gone(pid: u32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // A zombie (exited, not yet reaped by init) counts as gone.
    let alive = || {
        fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| !r.trim_start().starts_with('Z'))
        })
    };
    while alive() {
        assert!(std::time::Instant::now() < deadline, "process {pid} still runs");
        std::thread::sleep(Duration::from_millis(20));
    }
}

// === nvidia-smi ===

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn nvidia_smi_lists_the_hosts_gpus_in_nvidias_format_and_narrows_with_i() {
    let d = Driver::new(2);
    let out = d.smi(&["-L"], &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        stdout(&out),
        format!(
            "GPU 0: {PRODUCT} (UUID: {})\nGPU 1: {PRODUCT} (UUID: {})\n",
            d.uuid(0),
            d.uuid(1)
        )
    );
    for id in ["1".to_string(), d.uuid(1)] {
        let out = d.smi(&["-L", "-i", &id], &[]);
        assert_eq!(
            stdout(&out),
            format!("GPU 1: {PRODUCT} (UUID: {})\n", d.uuid(1)),
            "-i {id}"
        );
    }
    let out = d.smi(&["-L", "-i", "7"], &[]);
    assert_eq!(
        (out.status.code(), stdout(&out).trim()),
        (Some(6), "No devices were found")
    );
}

#[test]
fn nvidia_smi_lists_mig_devices_under_their_gpu_and_queries_a_subset() {
    let d = Driver::new(1);
    let (mig, _) = d.mig_device(0, "3g.40gb");
    let out = d.smi(&["-L"], &[]);
    assert_eq!(
        stdout(&out),
        format!(
            "GPU 0: {PRODUCT} (UUID: {})\n  MIG 3g.40gb     Device  0: (UUID: {mig})\n",
            d.uuid(0)
        ),
        "{}",
        text(&out)
    );
    d.backend
        .set_compute_mode(0, ComputeMode::ExclusiveProcess)
        .unwrap();
    let q = stdout(&d.smi(&["-q", "-i", "0"], &[]));
    for line in [
        "Driver Version                            : 580.159.03".to_string(),
        "CUDA Version                              : 13.0".to_string(),
        format!("    Product Name                          : {PRODUCT}"),
        format!("    GPU UUID                              : {}", d.uuid(0)),
        "    Minor Number                          : 0".to_string(),
        "        Current                           : Enabled".to_string(),
        "        Bus Id                            : 00000000:18:00.0".to_string(),
        "    Compute Mode                          : Exclusive_Process".to_string(),
    ] {
        assert!(q.lines().any(|l| l == line), "missing {line:?} in\n{q}");
    }
}

#[test]
fn nvidia_smi_in_a_container_lists_exactly_the_gpu_it_holds() {
    let d = Driver::new(3);
    let dev = d.container_dev(&["nvidia2".into()]);
    let out = d.smi(&["-L"], &[(DEV_ROOT_ENV, dev.to_str().unwrap())]);
    // NVML indices are positions among the visible GPUs.
    assert_eq!(
        stdout(&out),
        format!("GPU 0: {PRODUCT} (UUID: {})\n", d.uuid(2)),
        "{}",
        text(&out)
    );
    let none = d.container_dev(&[]);
    let out = d.smi(&["-L"], &[(DEV_ROOT_ENV, none.to_str().unwrap())]);
    assert_eq!(
        (out.status.code(), stdout(&out).trim()),
        (Some(6), "No devices were found")
    );
}

#[test]
fn nvidia_smi_without_a_kernel_says_it_cannot_reach_the_driver() {
    let d = Driver::new(1);
    fs::remove_file(d.root().join("tessera-sim")).unwrap();
    let out = d.smi(&["-L"], &[]);
    assert_eq!(out.status.code(), Some(9), "{}", text(&out));
    assert!(
        stdout(&out)
            .starts_with("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"),
        "{}",
        text(&out)
    );
    // libcuda finds no kernel either.
    assert_eq!(d.probe(&[]).get("init"), "100");
}

#[test]
fn nvidia_smi_sets_the_compute_time_slice_through_the_library() {
    let d = Driver::new(2);
    let out = d.smi(&["compute-policy", "-i", &d.uuid(1), "--set-timeslice", "2"], &[]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(d.backend.hardware_time_slice(1).unwrap(), TimeSlice::Medium);
    assert_eq!(d.backend.hardware_time_slice(0).unwrap(), TimeSlice::Default);
    let bad = d.smi(&["compute-policy", "-i", "0", "--set-timeslice", "9"], &[]);
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad));
}

// === The CDI edits of the installed root ===

#[test]
fn the_cdi_edits_of_an_installed_root_mount_its_libraries_tools_and_kernel() {
    use tessera_kubelet_plugin::gpu::driver_root::{DriverFiles, DriverRoot};
    use tessera_kubelet_plugin::node::edits::driver_edits;
    use tessera_sim_model::kernel::SIMULATED_DRIVER_VERSION;
    let d = Driver::new(1);
    let edits = driver_edits(&DriverFiles::discover(
        &DriverRoot::new(d.root()),
        Some(SIMULATED_DRIVER_VERSION),
    ));
    let by_target: BTreeMap<&str, &str> = edits
        .mounts
        .iter()
        .map(|m| (m.container_path.as_str(), m.host_path.as_str()))
        .collect();
    for lib in ["libcuda", "libnvidia-ml"] {
        for file in [
            format!("{lib}.so.1"),
            format!("{lib}.so.{SIMULATED_DRIVER_VERSION}"),
        ] {
            let target = format!("/usr/lib/x86_64-linux-gnu/{file}");
            assert!(
                by_target.contains_key(target.as_str()),
                "{target} not mounted: {by_target:?}"
            );
        }
    }
    for tool in ["nvidia-smi", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"] {
        let target = format!("/usr/bin/{tool}");
        assert!(
            by_target.contains_key(target.as_str()),
            "{target} not mounted: {by_target:?}"
        );
    }
    let kernel = fs::canonicalize(d.dir.path().join("kernel")).unwrap();
    assert_eq!(by_target.get("/tessera-sim").copied(), kernel.to_str());
}
