//! CDI specs: how a prepared claim's devices reach the container.
//!
//! One spec file per claim, `<cdi dir>/k8s.gpu.tessera.dev-claim_<claim UID>.json`, kind
//! `k8s.gpu.tessera.dev/claim`, one CDI device per allocated device named `<claim UID>-<device name>`
//! (`…-<share id>` for each share of a device the claim holds twice: [`device_names`]).
//! kubelet passes the fully qualified names ([`qualified_name`]) to the runtime, which reads the spec when the
//! container is created. A per-claim file (rather than one node-wide spec) makes prepare and unprepare of
//! different claims independent: no read-modify-write of a shared file.
//!
//! The driver's files and hook calls are the spec's own `containerEdits`, once per claim; a device's edits
//! are its device nodes, env and (for a share) MPS mounts ([`crate::node::edits`]). The hook they call,
//! `tessera-cdi-hook` (`kubelet-plugin/cdi-hook`), is installed on the host by [`install_hook`].

use std::{
    fs,
    io::{self, Write},
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::node::error::{Error, Result};

/// `cdiVersion` written: the minimum that knows every field tessera uses (`hostPath` on device nodes came in
/// 0.5.0), so runtimes built with older CDI libraries still load the specs.
pub const CDI_VERSION: &str = "0.5.0";

/// CDI vendor of tessera's claim specs (`k8s.` + driver name, as kubelet plugins conventionally use).
pub const CDI_VENDOR: &str = "k8s.gpu.tessera.dev";

/// CDI class of tessera's claim specs.
pub const CDI_CLASS: &str = "claim";

/// `kind` of every spec tessera writes.
pub const CDI_KIND: &str = "k8s.gpu.tessera.dev/claim";

/// Prefix of spec file names; only files with this prefix are ever removed by the plugin, so specs of other
/// drivers and hand-written ones in the same directory are safe.
const SPEC_FILE_PREFIX: &str = "k8s.gpu.tessera.dev-claim_";

/// A CDI spec (JSON keys as in the CDI `specs-go` package).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<Device>,
    #[serde(default, skip_serializing_if = "ContainerEdits::is_empty")]
    pub container_edits: ContainerEdits,
}

/// One CDI device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Device {
    pub name: String,
    pub container_edits: ContainerEdits,
}

/// What the runtime changes in the container for a device.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

impl ContainerEdits {
    /// True when the edits change nothing.
    pub fn is_empty(&self) -> bool {
        self.env.is_empty() && self.device_nodes.is_empty() && self.mounts.is_empty() && self.hooks.is_empty()
    }

    /// Appends `other`'s edits to these.
    pub fn extend(&mut self, other: ContainerEdits) {
        self.env.extend(other.env);
        self.device_nodes.extend(other.device_nodes);
        self.mounts.extend(other.mounts);
        self.hooks.extend(other.hooks);
    }
}

/// A device node in the container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `c` for the NVIDIA character devices.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
}

impl DeviceNode {
    /// A character device with explicit numbers, so the runtime need not stat the host node.
    pub fn char_device(path: &str, major: u32, minor: u32) -> Self {
        Self {
            path: path.to_string(),
            host_path: None,
            kind: Some("c".to_string()),
            major: Some(major.into()),
            minor: Some(minor.into()),
        }
    }
}

/// A bind mount into the container (MPS pipe directories, for instance).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// An OCI hook the runtime runs while creating the container (on the host, outside the container).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hook {
    /// `createContainer`, `createRuntime`, `startContainer`, `poststart`, `poststop` or `prestart`.
    pub hook_name: String,
    /// Absolute path of the executable on the host.
    pub path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
}

/// CDI device name of one allocated device of a claim: `<claim UID>-<device name>`.
pub fn device_name(claim_uid: &str, device: &str) -> String {
    format!("{claim_uid}-{device}")
}

/// CDI device names of a claim's allocated devices, in the allocation's order (`(device, share id)` each):
/// [`device_name`], except for a device the claim holds more than once. Consumable capacity lets two
/// requests (or one request's two results) take shares of one device, and a spec naming a device twice is
/// refused by the runtime, so each of those shares is `<claim UID>-<device name>-<share id>`. A name that is
/// unique already stays as it is: runtimes, users and the e2e contract know those names. Both the device and
/// the share id come from the claim's allocation, which does not change while the claim is allocated, so
/// every prepare and every rebuild of a lost record from the claim names the devices alike. A share id
/// that CDI does not allow in a name (or that is missing or repeated, which no scheduler allocates) gives
/// way to the result's index.
pub fn device_names<'a>(
    claim_uid: &str,
    devices: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
) -> Vec<String> {
    let devices: Vec<(&str, Option<&str>)> = devices.into_iter().collect();
    let times = |device: &str| devices.iter().filter(|(d, _)| *d == device).count();
    let names: Vec<Option<String>> = devices
        .iter()
        .map(|&(device, share_id)| {
            if times(device) == 1 {
                return Some(device_name(claim_uid, device));
            }
            let id = share_id.filter(|id| is_name_part(id))?;
            Some(device_name(claim_uid, &format!("{device}-{id}")))
        })
        .collect();
    let once = |name: &String| names.iter().flatten().filter(|n| *n == name).count() == 1;
    names
        .iter()
        .zip(&devices)
        .enumerate()
        .map(|(i, (name, (device, _)))| match name {
            Some(name) if once(name) => name.clone(),
            _ => device_name(claim_uid, &format!("{device}-{i}")),
        })
        .collect()
}

/// Whether `s` may follow `-` in a CDI device name (letters, digits, `_`, `-`, `.`, `:`).
fn is_name_part(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'))
}

/// Fully qualified CDI device name kubelet hands to the runtime: `k8s.gpu.tessera.dev/claim=<name>`.
pub fn qualified_name(cdi_device_name: &str) -> String {
    format!("{CDI_KIND}={cdi_device_name}")
}

/// The CDI spec directory, seen through the files tessera owns in it.
#[derive(Clone, Debug)]
pub struct CdiDir {
    dir: PathBuf,
}

impl CdiDir {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The spec file of a claim.
    pub fn spec_path(&self, claim_uid: &str) -> PathBuf {
        self.dir.join(format!("{SPEC_FILE_PREFIX}{claim_uid}.json"))
    }

    /// Writes a claim's spec atomically: the runtime may read the directory at any moment, so it must see
    /// either no file or a whole one. The temporary name starts with `.` and does not end in `.json`, so CDI
    /// caches never load it.
    ///
    /// Not fsynced (`Durability::ProcessCrash`): a plugin crash (kill -9, OOM, upgrade) keeps the page cache,
    /// so the renamed file is whole for the runtime and for the restarted plugin. Only a power loss can tear
    /// it, and that is a new boot: the checkpoint of the old boot is not trusted, a record is re-adopted only
    /// when its spec still parses (`spec_present`), and every spec no record owns is removed once the API
    /// server has said which claims are in use (`NodeState::recover`, `NodeState::reconcile`). After a
    /// reboot no container holds these specs, and kubelet prepares its claims again, which writes them anew.
    /// (`/var/run/cdi`, the usual directory, is a tmpfs, where there is nothing to sync anyway.)
    pub fn write(&self, claim_uid: &str, spec: &Spec) -> Result<PathBuf> {
        let path = self.spec_path(claim_uid);
        let err = |source| Error::WriteCdiSpec {
            path: path.clone(),
            source,
        };
        fs::create_dir_all(&self.dir).map_err(err)?;
        let tmp = self.dir.join(format!(".{SPEC_FILE_PREFIX}{claim_uid}.json.tmp"));
        let json = serde_json::to_vec_pretty(spec).map_err(|e| err(io::Error::other(e)))?;
        write_atomically(&tmp, &path, &json, Durability::ProcessCrash).map_err(err)?;
        Ok(path)
    }

    /// Reads a claim's spec back (tests and diagnostics).
    pub fn read(&self, claim_uid: &str) -> Result<Option<Spec>> {
        let path = self.spec_path(claim_uid);
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| Error::ReadCdiSpec {
                    path,
                    source: io::Error::other(e),
                }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(Error::ReadCdiSpec { path, source }),
        }
    }

    /// Removes a claim's spec; a spec that is already gone is success, which keeps unprepare idempotent.
    pub fn remove(&self, claim_uid: &str) -> Result<()> {
        let path = self.spec_path(claim_uid);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(Error::RemoveCdiSpec { path, source }),
        }
    }

    /// Claim UIDs of every tessera claim spec in the directory (a missing directory has none).
    pub fn claim_uids(&self) -> Result<Vec<String>> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(Error::ListCdiDir {
                    path: self.dir.clone(),
                    source,
                });
            }
        };
        let mut uids = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| Error::ListCdiDir {
                path: self.dir.clone(),
                source,
            })?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(uid) = name
                .strip_prefix(SPEC_FILE_PREFIX)
                .and_then(|n| n.strip_suffix(".json"))
            {
                uids.push(uid.to_string());
            }
        }
        uids.sort();
        Ok(uids)
    }
}

/// What a write through [`write_atomically`] must survive. Either way the rename makes the change atomic for
/// every reader of this boot: they see the old file or the new one, never a mix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Durability {
    /// A process crash only: the page cache survives it, so nothing is synced. For files that a power loss
    /// (a reboot) makes stale anyway and whose readers after a reboot cope with them torn or missing.
    ProcessCrash,
    /// Also a power loss, in the weak form "parseable, or absent, or an older version": the temp file is
    /// fsynced before the rename, so the name never points at data that did not reach the disk. The
    /// directory is not fsynced: that would only make the rename itself durable, and after a power loss
    /// the old file and the new one are equally from the old boot.
    WholeAfterPowerLoss,
}

/// Writes `bytes` to `path` through `tmp`: write, fsync as `durability` asks, rename.
pub(crate) fn write_atomically(
    tmp: &Path,
    path: &Path,
    bytes: &[u8],
    durability: Durability,
) -> io::Result<()> {
    let mut file = fs::File::create(tmp)?;
    file.write_all(bytes)?;
    if durability == Durability::WholeAfterPowerLoss {
        // fdatasync: the data and the size, which is all "whole" needs; the mtime may stay behind.
        file.sync_data()?;
    }
    drop(file);
    fs::rename(tmp, path)
}

/// File name of tessera's CDI hook binary, shipped next to the plugin's executable (`/usr/bin` in the
/// image) and installed into the hook directory.
pub const HOOK_BINARY: &str = "tessera-cdi-hook";

/// The hook binary shipped with this executable: next to it (the image's `/usr/bin`, cargo's
/// `target/<profile>`; a test in `target/<profile>/deps` looks one level up too).
pub fn shipped_hook() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let mut dirs = vec![dir.to_path_buf()];
    if dir.file_name().is_some_and(|n| n == "deps")
        && let Some(parent) = dir.parent()
    {
        dirs.push(parent.to_path_buf());
    }
    dirs.into_iter()
        .map(|d| d.join(HOOK_BINARY))
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file()))
}

/// Installs the hook binary `source` as `<dir>/tessera-cdi-hook` (the path the specs name: `dir` is seen
/// at its host path) and returns that path. A copy whose bytes already match is kept; otherwise the new
/// file is written under a temporary name, made executable and renamed over the old one, so a runtime that
/// runs the hook meanwhile starts the old binary or the new one, never a part of one.
pub fn install_hook(source: &Path, dir: &Path) -> Result<PathBuf> {
    let path = dir.join(HOOK_BINARY);
    let err = |source_err| Error::InstallCdiHook {
        source_path: source.to_path_buf(),
        path: path.clone(),
        source: source_err,
    };
    let bytes = fs::read(source).map_err(err)?;
    if fs::read(&path).is_ok_and(|old| old == bytes) {
        return Ok(path);
    }
    fs::create_dir_all(dir).map_err(err)?;
    let tmp = dir.join(format!(".{HOOK_BINARY}.{}.tmp", std::process::id()));
    let write = || -> io::Result<()> {
        let _ = fs::remove_file(&tmp);
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o755)
            .open(&tmp)?;
        file.write_all(&bytes)?;
        file.set_permissions(fs::Permissions::from_mode(0o755))?;
        // Synced: a hook torn by a power loss would fail every container start after the reboot.
        file.sync_data()?;
        drop(file);
        fs::rename(&tmp, &path)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        err(e)
    })?;
    Ok(path)
}

/// Checks that the hook installed at `path` can be executed as the runtime will: its directory's
/// filesystem is not mounted noexec, here or on the host, and running it (`--help`, which tessera's hook
/// answers with its usage) succeeds. The runtime executes it on the host, at the same path this process
/// sees (the chart mounts the directory at its host path). This process's own mount may not show the
/// host's noexec: runc remounts a hostPath bind with the container's own flags, which drops it (seen with
/// containerd 2.4.2 and runc 1.5.3 over a noexec stateDir), and the hook then runs here but not there. So
/// the host's mount table, `<host_proc>/1/mountinfo` (the host's init, whose mount namespace the runtime
/// uses), is read too where the host's /proc is mounted.
pub fn check_hook_runs(path: &Path, host_proc: Option<&Path>) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    let run = || {
        std::process::Command::new(path)
            .arg("--help")
            .stdin(std::process::Stdio::null())
            .output()
    };
    // ETXTBSY: a child another thread forked while the file was still open for writing holds that
    // descriptor until it execs; a moment later the file is free.
    let mut result = run();
    for _ in 0..50 {
        match &result {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(std::time::Duration::from_millis(10));
                result = run();
            }
            _ => break,
        }
    }
    let host_noexec = host_proc
        .and_then(|proc| fs::read_to_string(proc.join("1/mountinfo")).ok())
        .and_then(|table| noexec_in_mountinfo(&table, dir));
    let noexec = match (mounted_noexec(dir), host_noexec) {
        (Some(true), _) | (_, Some(true)) => Some(true),
        (here, host) => here.or(host),
    };
    hook_verdict(path, noexec, result)
}

/// Whether the mount holding `dir` in a `/proc/<pid>/mountinfo` table is mounted noexec: the mount
/// point that is the longest path prefix of `dir` (the last such line where mounts are stacked, as the
/// kernel lists them in mount order). `None` where no line parses or names a prefix of `dir`.
pub(crate) fn noexec_in_mountinfo(table: &str, dir: &Path) -> Option<bool> {
    let mut best: Option<(usize, bool)> = None;
    for line in table.lines() {
        // id parent major:minor root mount-point per-mount-options [optional...] - fstype source super-options
        let mut fields = line.split(' ');
        let (Some(point), Some(options)) = (fields.nth(4), fields.next()) else {
            continue;
        };
        let point = PathBuf::from(unescape_mountinfo(point));
        if !dir.starts_with(&point) {
            continue;
        }
        let depth = point.components().count();
        if best.is_none_or(|(d, _)| depth >= d) {
            best = Some((depth, options.split(',').any(|o| o == "noexec")));
        }
    }
    best.map(|(_, noexec)| noexec)
}

/// mountinfo writes space, tab, newline and backslash in paths as octal escapes (`\040`).
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The decision of [`check_hook_runs`] from what it found: `noexec` is the directory's mount flag
/// (`None` where statvfs failed, which is not a reason to refuse), `run` the result of running the hook.
pub(crate) fn hook_verdict(
    path: &Path,
    noexec: Option<bool>,
    run: io::Result<std::process::Output>,
) -> Result<()> {
    let refuse = |reason: String| {
        Err(Error::CdiHookNotExecutable {
            path: path.to_path_buf(),
            reason,
        })
    };
    if noexec == Some(true) {
        return refuse(format!(
            "its directory {} is on a filesystem mounted noexec",
            path.parent().unwrap_or(Path::new("/")).display()
        ));
    }
    match run {
        Err(e) => refuse(format!("exec failed: {e}")),
        Ok(out) if !out.status.success() => refuse(format!(
            "`{} --help` {}: {}",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Ok(_) => Ok(()),
    }
}

/// Whether the filesystem under `dir` is mounted noexec (statvfs's ST_NOEXEC); `None` where statvfs fails.
#[allow(
    unsafe_code,
    reason = "statvfs(2): std has no call that reads a mount's flags"
)]
fn mounted_noexec(dir: &Path) -> Option<bool> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `st` a writable statvfs, both outliving the call.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Some(st.f_flag & libc::ST_NOEXEC != 0)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn only_the_shares_of_a_device_a_claim_holds_twice_get_their_share_id_in_the_name() {
        let names = device_names(
            "U",
            [
                ("gpu-0", None),
                ("gpu-1-shared", Some("a1")),
                ("gpu-2-shared", Some("c3")),
                ("gpu-1-shared", Some("b2")),
            ],
        );
        assert_eq!(
            names,
            [
                "U-gpu-0",
                "U-gpu-1-shared-a1",
                "U-gpu-2-shared",
                "U-gpu-1-shared-b2"
            ]
        );
        // What no scheduler allocates still gets names the runtime takes: the result's index.
        let odd = device_names(
            "U",
            [
                ("gpu-1-shared", Some("x/y")),
                ("gpu-1-shared", Some("s")),
                ("gpu-1-shared", Some("s")),
            ],
        );
        assert_eq!(odd, ["U-gpu-1-shared-0", "U-gpu-1-shared-1", "U-gpu-1-shared-2"]);
    }

    #[test]
    fn the_hook_is_installed_executable_replaced_by_rename_and_kept_when_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("built");
        fs::write(&source, b"hook v1").unwrap();
        let hooks = dir.path().join("state/bin");
        let path = install_hook(&source, &hooks).unwrap();
        assert_eq!(path, hooks.join(HOOK_BINARY));
        assert_eq!(fs::read(&path).unwrap(), b"hook v1");
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o755);
        let first = fs::metadata(&path).unwrap().ino();
        install_hook(&source, &hooks).unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().ino(),
            first,
            "an unchanged hook is not rewritten"
        );
        // A runtime running the old one keeps its file; the name points at the new one.
        let running = fs::File::open(&path).unwrap();
        fs::write(&source, b"hook v2, longer").unwrap();
        install_hook(&source, &hooks).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"hook v2, longer");
        assert_eq!(io::read_to_string(&running).unwrap(), "hook v1");
        assert_eq!(
            fs::read_dir(&hooks).unwrap().count(),
            1,
            "no temporary file is left"
        );
        let e = install_hook(&dir.path().join("missing"), &hooks)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--cdi-hook-dir") && e.contains("missing"), "{e}");
    }

    /// A hook file at `dir/name` with `script` as its text and `mode`.
    fn hook_file(dir: &Path, script: &str, mode: u32) -> PathBuf {
        let path = dir.join(HOOK_BINARY);
        fs::write(&path, script).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn an_installed_hook_that_cannot_be_executed_stops_the_plugin_naming_cdi_hook_dir() {
        let dir = tempfile::tempdir().unwrap();
        // Not executable: exec answers EACCES, as it does on a noexec mount (which needs privileges to make).
        let hook = hook_file(dir.path(), "#!/bin/sh\nexit 0\n", 0o644);
        let e = check_hook_runs(&hook, None).unwrap_err().to_string();
        assert!(
            e.contains("cdiHookDir") && e.contains("--cdi-hook-dir") && e.contains("exec failed"),
            "{e}"
        );
        assert!(e.contains(&hook.display().to_string()), "{e}");

        let runs = hook_file(dir.path(), "#!/bin/sh\n[ \"$1\" = --help ]\n", 0o755);
        check_hook_runs(&runs, None).unwrap();
        let fails = hook_file(dir.path(), "#!/bin/sh\necho broken >&2; exit 3\n", 0o755);
        let e = check_hook_runs(&fails, None).unwrap_err().to_string();
        assert!(e.contains("broken") && e.contains("cdiHookDir"), "{e}");
    }

    #[test]
    fn a_hook_directory_the_host_mounts_noexec_is_refused_though_the_container_can_run_it() {
        let dir = tempfile::tempdir().unwrap();
        let hooks = dir.path().join("var/lib/tessera/bin");
        fs::create_dir_all(&hooks).unwrap();
        let hook = hook_file(&hooks, "#!/bin/sh\n[ \"$1\" = --help ]\n", 0o755);
        // The host's table as the host's init sees it: the stateDir bind-mounted noexec over /var.
        let state = dir.path().join("var/lib/tessera");
        let proc = dir.path().join("host-proc");
        fs::create_dir_all(proc.join("1")).unwrap();
        let table = |state_options: &str| {
            format!(
                "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n\
                 40 22 8:1 /var {var} rw,nosuid,nodev,noexec,relatime shared:20 - ext4 /dev/vda1 rw\n\
                 41 40 8:1 /var/lib/tessera {state} {state_options} shared:21 - ext4 /dev/vda1 rw\n",
                var = dir.path().join("var").display(),
                state = state.display(),
            )
        };
        fs::write(proc.join("1/mountinfo"), table("rw,nosuid,nodev,noexec,relatime")).unwrap();
        let e = check_hook_runs(&hook, Some(&proc)).unwrap_err().to_string();
        assert!(e.contains("noexec") && e.contains("cdiHookDir"), "{e}");
        // Without the host's table this process can only go by its own mount, where the hook runs.
        check_hook_runs(&hook, None).unwrap();
        // The stateDir remounted exec on the host, over a noexec /var: the nearest mount decides.
        fs::write(proc.join("1/mountinfo"), table("rw,nosuid,nodev,relatime")).unwrap();
        check_hook_runs(&hook, Some(&proc)).unwrap();
    }

    #[test]
    fn mountinfo_paths_are_unescaped_and_the_last_of_stacked_mounts_decides() {
        let table = "22 1 8:1 / / rw - ext4 /dev/vda1 rw\n\
                     30 22 0:5 / /home/my\\040dir rw,noexec - tmpfs tmpfs rw\n\
                     31 30 0:5 / /home/my\\040dir rw - tmpfs tmpfs rw\n\
                     32 22 0:6 / /home/other rw,noexec - tmpfs tmpfs rw\n";
        assert_eq!(noexec_in_mountinfo(table, Path::new("/home/my dir/bin")), Some(false));
        assert_eq!(noexec_in_mountinfo(table, Path::new("/home/other/bin")), Some(true));
        assert_eq!(noexec_in_mountinfo(table, Path::new("/home/otherwise")), Some(false));
        assert_eq!(noexec_in_mountinfo("garbage\n", Path::new("/x")), None);
    }

    #[test]
    fn a_hook_directory_on_a_noexec_mount_is_refused_even_before_the_hook_runs() {
        let path = Path::new("/var/lib/tessera/bin/tessera-cdi-hook");
        let ran = || {
            std::process::Command::new("true")
                .output()
                .map_err(|e| panic!("true: {e}"))
        };
        let e = hook_verdict(path, Some(true), ran()).unwrap_err().to_string();
        assert!(
            e.contains("/var/lib/tessera/bin is on a filesystem mounted noexec") && e.contains("cdiHookDir"),
            "{e}"
        );
        hook_verdict(path, Some(false), ran()).unwrap();
        // statvfs failing is no reason to refuse a hook that runs.
        hook_verdict(path, None, ran()).unwrap();
    }
}
