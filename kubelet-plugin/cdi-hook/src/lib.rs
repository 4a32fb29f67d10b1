//! tessera's CDI hook: what a container needs of the driver beyond its bind mounts, done on the container's
//! root filesystem while the runtime creates it (an OCI `createContainer` hook: the mounts are in place,
//! `pivot_root` has not happened, no process of the container runs yet).
//!
//! Three subcommands, named and argued as NVIDIA's `nvidia-cdi-hook` (NVIDIA/nvidia-container-toolkit,
//! `cmd/nvidia-cdi-hook`), which `nvcdi` always puts in its specs in this order:
//!
//! * `create-symlinks --link <target>::<link>`: `ln -sf <target> <link>` inside the container root, e.g.
//!   `libcuda.so -> libcuda.so.1` for programs that `dlopen("libcuda.so")` or link `-lcuda` at run time
//!   (Triton, `torch.compile`); a link that already points there is left alone.
//! * `enable-cuda-compat --host-driver-version <v>`: when the image ships CUDA's forward-compatibility
//!   driver (`/usr/local/cuda/compat/libcuda.so.<major>.<minor>…`, exactly one) that runs on the host's
//!   driver branch and is newer than its driver (the branches its `.note.cuda.fwd_compatibility` lists, see
//!   [`elfnote`]; without that note, a newer major version),
//!   `/etc/ld.so.conf.d/00-compat-tessera.conf` names that directory, ahead of the driver's
//!   (`00-compat-…` sorts before `00-tessera-driver.conf`). A no-op, as NVIDIA's, without the directory,
//!   without `/etc/ld.so.cache` or `/etc/ld.so.conf.d` in the image (not a glibc image), or with an older or
//!   equal compat driver.
//! * `update-ldcache --folder <dir>…`: `/etc/ld.so.conf.d/00-tessera-driver.conf` names the driver's library
//!   directories that the image does not already search (its `ld.so.conf` with its includes, its system
//!   directories: a directory named again would jump ahead of the image's own order),
//!   `/etc/ld.so.conf.d/zz-tessera-system.conf` names the image's system directories (Debian's multiarch
//!   ones or `/lib64`, `/usr/lib64`, by `/etc/debian_version`), both written whole, by rename;
//!   `/etc/ld.so.conf` is created including `ld.so.conf.d` when the image has none, and the host's
//!   `ldconfig -r <root>` rebuilds `<root>/etc/ld.so.cache`. So the image's own loader finds `libcuda.so.1`
//!   through its cache, whatever directories it searches by default (another distribution family, GKE's
//!   `/usr/local/nvidia/lib64`), and `ldconfig -p` still lists the image's own libraries in the image's
//!   order when the host's ldconfig was built for another family. NVIDIA's rules, see [`update_ldcache`].
//!
//! A fourth, `disable-device-node-modification` ([`params`]), masks the driver's `ModifyDeviceFiles` in the
//! container's `/proc/driver/nvidia/params`, as NVIDIA's hook of that name.
//!
//! **The container root** is read as the runtime hands it: the OCI state on stdin names the bundle, whose
//! `config.json` names `root.path` (relative to the bundle, or absolute). `/` is refused.
//!
//! **A hostile image.** The image's files are not trusted: every path is resolved inside the root
//! ([`Rootfs::resolve`]: an absolute symlink starts again at the root, `..` stops there), files are created
//! with `O_EXCL` under a temporary name and renamed over the target (a symlink there is replaced, never
//! followed), and `ldconfig -r` chroots into the root before it reads a configuration file or writes the
//! cache. Nothing of the image is executed: the ldconfig that runs is the host's (`/sbin/ldconfig.real`,
//! Ubuntu's real binary behind its wrapper script, then `/sbin/ldconfig`, `/usr/sbin/ldconfig`; or
//! `--ldconfig-path`), statically linked on glibc distributions. No process of the container exists yet, so
//! nothing can change the root between a check and its use.

use std::{
    fmt,
    fs::{self, OpenOptions},
    io::{self, Write},
    os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt},
    path::{Component, Path, PathBuf},
    process::Command,
};

use serde::Deserialize;

pub mod elfnote;
pub mod ldconf;
pub mod params;

/// The file `update-ldcache` writes in the container: the driver's directories the image does not search.
pub const DRIVER_CONF: &str = "/etc/ld.so.conf.d/00-tessera-driver.conf";
/// The file `update-ldcache` writes in the container: the image's own system directories, named so that it
/// sorts after the image's files (NVIDIA's `zz-nvcr-*.conf`), as its own ldconfig searches them last.
pub const SYSTEM_CONF: &str = "/etc/ld.so.conf.d/zz-tessera-system.conf";
/// The file `enable-cuda-compat` writes in the container.
pub const COMPAT_CONF: &str = "/etc/ld.so.conf.d/00-compat-tessera.conf";
/// Where CUDA images keep the forward-compatibility driver.
pub const CUDA_COMPAT_DIR: &str = "/usr/local/cuda/compat";
/// The host's ldconfig, in the order tried.
pub const LDCONFIG_CANDIDATES: [&str; 3] = ["/sbin/ldconfig.real", "/sbin/ldconfig", "/usr/sbin/ldconfig"];
/// What a created `/etc/ld.so.conf` says.
const LD_SO_CONF: &str = "include /etc/ld.so.conf.d/*.conf\n";
/// How many symlinks [`Rootfs::resolve`] follows (Linux's `MAXSYMLINKS`).
const MAX_SYMLINKS: u32 = 40;

/// Every way a hook fails; the runtime shows the message when it refuses the container.
#[derive(Debug)]
pub enum Error {
    /// The command line is wrong.
    Usage(String),
    /// The OCI state (stdin or `--container-spec`) could not be read.
    ReadState(io::Error),
    /// The OCI state is not JSON with a `bundle`.
    ParseState(String),
    /// The bundle's `config.json` could not be read.
    ReadConfig { path: PathBuf, source: io::Error },
    /// The bundle's `config.json` has no usable `root.path`.
    ParseConfig { path: PathBuf, reason: String },
    /// The container root is `/` or empty: the hook never edits the host.
    HostRoot(PathBuf),
    /// A path of the container could not be resolved inside its root.
    Resolve { path: String, reason: String },
    /// A file or directory could not be written in the container.
    Write { path: String, source: io::Error },
    /// No ldconfig on the host.
    NoLdconfig(Vec<PathBuf>),
    /// ldconfig ran and failed.
    Ldconfig { program: PathBuf, detail: String },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Usage(m) => write!(f, "{m}"),
            Error::ReadState(e) => write!(f, "cannot read the OCI container state from stdin: {e}"),
            Error::ParseState(e) => write!(f, "the OCI container state is not valid: {e}"),
            Error::ReadConfig { path, source } => {
                write!(f, "cannot read the bundle's {}: {source}", path.display())
            }
            Error::ParseConfig { path, reason } => write!(f, "{}: {reason}", path.display()),
            Error::HostRoot(p) => write!(
                f,
                "the container root is {:?}: refusing to edit the host's files",
                p.display()
            ),
            Error::Resolve { path, reason } => write!(f, "cannot resolve {path} in the container: {reason}"),
            Error::Write { path, source } => write!(f, "cannot write {path} in the container: {source}"),
            Error::NoLdconfig(tried) => write!(
                f,
                "no ldconfig on the host (tried {}); pass --ldconfig-path",
                tried
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Error::Ldconfig { program, detail } => write!(f, "{} failed: {detail}", program.display()),
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// The container's root directory from the OCI state the runtime writes to a hook's stdin.
pub fn container_root(state: &[u8]) -> Result<PathBuf> {
    #[derive(Deserialize)]
    struct State {
        bundle: PathBuf,
    }
    #[derive(Deserialize)]
    struct Config {
        root: Option<Root>,
    }
    #[derive(Deserialize)]
    struct Root {
        path: PathBuf,
    }
    let state: State = serde_json::from_slice(state).map_err(|e| Error::ParseState(e.to_string()))?;
    if state.bundle.as_os_str().is_empty() {
        return Err(Error::ParseState("the state names no bundle".into()));
    }
    let path = state.bundle.join("config.json");
    let bytes = fs::read(&path).map_err(|source| Error::ReadConfig {
        path: path.clone(),
        source,
    })?;
    let config: Config = serde_json::from_slice(&bytes).map_err(|e| Error::ParseConfig {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let root = config.root.ok_or_else(|| Error::ParseConfig {
        path: path.clone(),
        reason: "no root.path".into(),
    })?;
    let root = if root.path.is_absolute() {
        root.path
    } else {
        state.bundle.join(root.path)
    };
    if root.as_os_str().is_empty() || root.components().all(|c| c == Component::RootDir) {
        return Err(Error::HostRoot(root));
    }
    Ok(root)
}

/// A container's root filesystem seen from the host: paths of the container become host paths under the
/// root with every symlink followed inside it.
#[derive(Clone, Debug)]
pub struct Rootfs {
    root: PathBuf,
}

impl Rootfs {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn path(&self) -> &Path {
        &self.root
    }

    /// The host path of the container's `path` (absolute or not, it is taken from the container's `/`):
    /// symlinks followed as the container will see them, an absolute target from the root again, `..`
    /// stopping at the root. Components that do not exist are kept as named, so the result can be created.
    pub fn resolve(&self, path: &Path) -> Result<PathBuf> {
        walk_in_root(&self.root, path, Missing::Keep).map_err(|e| Error::Resolve {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
    }

    /// Whether the container's `path` exists (through its symlinks).
    pub fn exists(&self, path: &Path) -> bool {
        self.resolve(path).is_ok_and(|p| fs::metadata(p).is_ok())
    }

    /// Creates the container's directory `path` and its parents (mode 0755); the host path of it.
    pub fn create_dir_all(&self, path: &Path) -> Result<PathBuf> {
        let dir = self.resolve(path)?;
        let err = |source| Error::Write {
            path: path.display().to_string(),
            source,
        };
        // Every component that exists is a directory or was followed; the rest is created here, and no
        // container process can put a link in between.
        fs::create_dir_all(&dir).map_err(err)?;
        if !fs::symlink_metadata(&dir).map_err(err)?.is_dir() {
            return Err(err(io::Error::other("not a directory")));
        }
        Ok(dir)
    }

    /// Writes the container's file `path` whole: a new file (mode 0644, readable by a container that runs
    /// as another user) under a temporary name, renamed over whatever `path` was (a symlink there is
    /// replaced, never followed).
    pub fn write_file(&self, path: &Path, contents: &[u8]) -> Result<()> {
        let (parent, name) = split(path)?;
        let dir = self.create_dir_all(&parent)?;
        let err = |source| Error::Write {
            path: path.display().to_string(),
            source,
        };
        let tmp = dir.join(format!(".{name}.tessera-tmp"));
        match fs::remove_file(&tmp) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(err(e)),
            _ => {}
        }
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .map_err(err)?;
        file.write_all(contents).map_err(err)?;
        // The umask may have taken bits off.
        file.set_permissions(fs::Permissions::from_mode(0o644))
            .map_err(err)?;
        drop(file);
        fs::rename(&tmp, dir.join(&name)).map_err(err)
    }

    /// `ln -sfn target link` in the container: nothing when `link` already points at `target`, else
    /// whatever is at `link` (a file or a link; never a directory) is replaced.
    pub fn symlink(&self, target: &str, link: &Path) -> Result<()> {
        let (parent, name) = split(link)?;
        let dir = self.create_dir_all(&parent)?;
        let at = dir.join(&name);
        let err = |source| Error::Write {
            path: link.display().to_string(),
            source,
        };
        match fs::symlink_metadata(&at) {
            Ok(meta) if meta.file_type().is_symlink() => {
                if fs::read_link(&at).map_err(err)? == Path::new(target) {
                    return Ok(());
                }
                fs::remove_file(&at).map_err(err)?;
            }
            Ok(meta) if meta.is_dir() => return Err(err(io::Error::other("a directory is in the way"))),
            Ok(_) => fs::remove_file(&at).map_err(err)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
        std::os::unix::fs::symlink(target, &at).map_err(err)
    }
}

/// What [`walk_in_root`] does with a component that does not exist.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Missing {
    /// Keep it as named (the path is about to be created).
    Keep,
    /// Fail with `NotFound`.
    Fail,
}

/// `path` (taken from `root`'s `/`) with every symlink in it followed inside `root`: an absolute target
/// starts again at the root, `..` stops at it, at most [`MAX_SYMLINKS`] links, as a process chrooted into
/// `root` sees it.
fn walk_in_root(root: &Path, path: &Path, missing: Missing) -> io::Result<PathBuf> {
    let mut todo: Vec<std::ffi::OsString> = Vec::new();
    push_components(&mut todo, path);
    let mut done = PathBuf::new();
    let mut links = 0;
    while let Some(name) = todo.pop() {
        if name == ".." {
            done.pop();
            continue;
        }
        let next = root.join(&done).join(&name);
        match fs::symlink_metadata(&next) {
            Ok(meta) if meta.file_type().is_symlink() => {
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(io::Error::other("too many levels of symbolic links"));
                }
                let target = fs::read_link(&next)?;
                if target.is_absolute() {
                    done.clear();
                }
                push_components(&mut todo, &target);
            }
            Ok(_) => done.push(&name),
            Err(e) if e.kind() == io::ErrorKind::NotFound && missing == Missing::Keep => done.push(&name),
            Err(e) => return Err(e),
        }
    }
    Ok(root.join(done))
}

/// `path`, relative to `root`, resolved inside `root` as [`Rootfs::resolve`] does, but only if every
/// component exists: `None` for a missing one, a link loop or an unreadable link. The plugin finds the
/// driver's files in a driver root this way (its soname links, an Operator rootfs's `lib64 -> /usr/lib64`).
pub fn resolve_existing_in(root: &Path, path: &Path) -> Option<PathBuf> {
    walk_in_root(root, path, Missing::Fail).ok()
}

fn push_components(todo: &mut Vec<std::ffi::OsString>, p: &Path) {
    for c in p.components().rev() {
        match c {
            Component::Normal(n) => todo.push(n.to_os_string()),
            Component::ParentDir => todo.push("..".into()),
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
}

/// `path`'s parent and file name; refused without a file name (`/`, `..`).
fn split(path: &Path) -> Result<(PathBuf, String)> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|_| !matches!(path.components().next_back(), Some(Component::ParentDir)))
        .ok_or_else(|| Error::Usage(format!("{} names no file", path.display())))?;
    Ok((
        path.parent().unwrap_or(Path::new("/")).to_path_buf(),
        name.to_string(),
    ))
}

/// A container directory as an argument: absolute, without `..`, and one line (it becomes a line of a
/// configuration file).
pub fn checked_dir(dir: &str) -> Result<&str> {
    let p = Path::new(dir);
    if !p.is_absolute() || p.components().any(|c| c == Component::ParentDir) || dir.contains(['\n', '\r']) {
        return Err(Error::Usage(format!(
            "--folder {dir:?}: want an absolute directory of the container without `..`"
        )));
    }
    Ok(dir)
}

/// `create-symlinks`: each `(target, link)` as `ln -sfn target link` in the container.
pub fn create_symlinks(root: &Rootfs, links: &[(String, String)]) -> Result<()> {
    for (target, link) in links {
        if target.is_empty() || !Path::new(link).is_absolute() {
            return Err(Error::Usage(format!(
                "--link {target}::{link}: want <target>::<absolute link path>"
            )));
        }
        root.symlink(target, Path::new(link))?;
    }
    Ok(())
}

/// A version's numbers (`580.159.03` → [580, 159, 3]); `None` when a part is not a number.
fn version(v: &str) -> Option<Vec<u64>> {
    v.split('.').map(|p| p.parse().ok()).collect()
}

/// Whether version `a` is newer than `b`, number by number, a missing number counting as 0
/// (`590.10` = `590.10.0`).
fn newer(a: &[u64], b: &[u64]) -> bool {
    let at = |v: &[u64], i: usize| v.get(i).copied().unwrap_or(0);
    (0..a.len().max(b.len()))
        .map(|i| at(a, i).cmp(&at(b, i)))
        .find(|o| o.is_ne())
        .is_some_and(|o| o.is_gt())
}

/// What `enable-cuda-compat` decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Compat {
    /// The compat driver's directory goes first: its version, and why.
    Enabled(String, String),
    /// Nothing to do, and why.
    Skipped(String),
}

/// `enable-cuda-compat`: NVIDIA's rule (`cmd/nvidia-cdi-hook/cudacompat`, `UseCompat`), the versions
/// compared as numbers. When the compat `libcuda.so` carries its [`elfnote`] (every one CUDA ships), it is
/// used only on a host driver branch the note lists and when it is newer than the host's driver: on another
/// branch CUDA's minor-version compatibility is what works, and the compat driver would refuse to load.
/// Without the note (an older compat package), only a newer major version enables it.
pub fn enable_cuda_compat(root: &Rootfs, host_driver_version: &str) -> Result<Compat> {
    let skip = |why: &str| Ok(Compat::Skipped(why.to_string()));
    let Ok(dir) = root.resolve(Path::new(CUDA_COMPAT_DIR)) else {
        return skip("no CUDA compat directory");
    };
    if !dir.is_dir() {
        return skip("no CUDA compat directory");
    }
    if !root.exists(Path::new("/etc/ld.so.cache")) || !root.exists(Path::new("/etc/ld.so.conf.d")) {
        return skip("the image has no /etc/ld.so.cache or /etc/ld.so.conf.d");
    }
    // `libcuda.so.<major>.<minor>…`: the versioned file, not the `libcuda.so.1` link.
    let mut versions: Vec<String> = fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| n.strip_prefix("libcuda.so.").map(str::to_string))
        .filter(|v| v.contains('.'))
        .collect();
    if versions.len() != 1 {
        versions.sort();
        return skip(&format!(
            "want exactly one compat libcuda.so.<version>, found {versions:?}"
        ));
    }
    let compat = versions.remove(0);
    let (Some(compat_v), Some(host_v)) = (version(&compat), version(host_driver_version)) else {
        return skip(&format!(
            "cannot compare the compat driver {compat:?} with the host's {host_driver_version:?}"
        ));
    };
    let host_branch = host_v[0];
    let why = match compat_note(root, &compat) {
        Ok(Some(note)) => {
            if !note.driver_branches.iter().any(|&b| u64::from(b) == host_branch) {
                return skip(&format!(
                    "the compat driver {compat} does not run on the host's driver branch {host_branch} \
                     (its {} lists {:?})",
                    elfnote::SECTION,
                    note.driver_branches
                ));
            }
            if !newer(&compat_v, &host_v) {
                return skip(&format!(
                    "the compat driver {compat} is not newer than the host's {host_driver_version}"
                ));
            }
            format!(
                "it is newer than the host's {host_driver_version} and its {} lists branch {host_branch}",
                elfnote::SECTION
            )
        }
        note => {
            let unread = match note {
                Err(e) => format!("its {} is unreadable ({e})", elfnote::SECTION),
                _ => format!("it has no {}", elfnote::SECTION),
            };
            if compat_v[0] <= host_branch {
                return skip(&format!(
                    "{unread} and the compat driver {compat} is not of a newer major version than the \
                     host's {host_driver_version}"
                ));
            }
            format!("{unread} and it is of a newer major version than the host's {host_driver_version}")
        }
    };
    root.write_file(Path::new(COMPAT_CONF), format!("{CUDA_COMPAT_DIR}\n").as_bytes())?;
    Ok(Compat::Enabled(compat, why))
}

/// The note of the image's compat `libcuda.so.<compat>`; only a regular file is opened (a FIFO would hold
/// the hook).
fn compat_note(root: &Rootfs, compat: &str) -> io::Result<Option<elfnote::CompatNote>> {
    let path = root
        .resolve(&Path::new(CUDA_COMPAT_DIR).join(format!("libcuda.so.{compat}")))
        .map_err(|e| io::Error::other(e.to_string()))?;
    if !fs::metadata(&path)?.is_file() {
        return Ok(None);
    }
    elfnote::read(&fs::File::open(path)?)
}

/// The host's ldconfig: `explicit`, else the first of [`LDCONFIG_CANDIDATES`] that exists.
pub fn host_ldconfig(explicit: Option<&Path>) -> Result<PathBuf> {
    let tried: Vec<PathBuf> = match explicit {
        Some(p) => vec![p.to_path_buf()],
        None => LDCONFIG_CANDIDATES.iter().map(PathBuf::from).collect(),
    };
    tried
        .iter()
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file()))
        .cloned()
        .ok_or(Error::NoLdconfig(tried))
}

/// `update-ldcache`: the driver's folders the image does not already search in
/// [`DRIVER_CONF`], the image's own system directories in [`SYSTEM_CONF`], then the container's cache
/// rebuilt by the host's `ldconfig` chrooted into the root.
///
/// NVIDIA's rules (`internal/ldconfig/ldconfig.go`): a folder that the image's configuration (with its
/// includes) or its system directories already name is left out, so the image's order of precedence stays
/// (`/usr/local/lib` ahead of `/usr/lib/x86_64-linux-gnu` on Ubuntu); and the system directories of the
/// container's family ([`ldconf::system_dirs`], Debian or not by `/etc/debian_version`) are written to a
/// file that sorts last, since the host's ldconfig adds the *host's* compiled-in ones, not the image's (a
/// Debian host's misses a UBI image's `/usr/lib64`, and the other way round). An image whose configuration
/// does not include `/etc/ld.so.conf.d/*.conf` gets both lists on ldconfig's command line instead (scanned
/// first).
pub fn update_ldcache(root: &Rootfs, folders: &[String], ldconfig: &Path) -> Result<()> {
    for f in folders {
        checked_dir(f)?;
    }
    let conf = Path::new("/etc/ld.so.conf");
    match root.resolve(conf).map(fs::symlink_metadata) {
        Ok(Ok(_)) => {}
        Ok(Err(e)) if e.kind() == io::ErrorKind::NotFound => {
            root.write_file(conf, LD_SO_CONF.as_bytes())?;
        }
        Ok(Err(source)) => {
            return Err(Error::Write {
                path: conf.display().to_string(),
                source,
            });
        }
        Err(e) => return Err(e),
    }
    let config = ldconf::read_config(root, "/etc/ld.so.conf", &[DRIVER_CONF, SYSTEM_CONF]);
    let system = ldconf::system_dirs(ldconf::is_debian_like(root), std::env::consts::ARCH);
    let tracked: Vec<String> = config.dirs.iter().chain(&system).cloned().collect();
    let driver = ldconf::untracked(root, &tracked, folders);
    let mut args: Vec<String> = Vec::new();
    if config.includes_file(DRIVER_CONF) && config.includes_file(SYSTEM_CONF) {
        root.write_file(Path::new(DRIVER_CONF), lines(&driver).as_bytes())?;
        root.write_file(Path::new(SYSTEM_CONF), lines(&system).as_bytes())?;
    } else {
        args.extend(driver.iter().map(|d| d.to_string()));
        args.extend(
            ldconf::untracked(root, &config.dirs, &system)
                .iter()
                .map(|d| d.to_string()),
        );
    }
    // -r: ldconfig chroots into the root before it reads anything, so the paths below and every link it
    // meets are the container's.
    let output = Command::new(ldconfig)
        .arg("-r")
        .arg(root.path())
        .args(["-f", "/etc/ld.so.conf", "-C", "/etc/ld.so.cache"])
        .args(&args)
        .env_clear()
        .output()
        .map_err(|e| Error::Ldconfig {
            program: ldconfig.to_path_buf(),
            detail: e.to_string(),
        })?;
    if !output.status.success() {
        return Err(Error::Ldconfig {
            program: ldconfig.to_path_buf(),
            detail: format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        });
    }
    Ok(())
}

/// A configuration file's text: one directory a line.
fn lines<S: AsRef<str>>(dirs: &[S]) -> String {
    dirs.iter().map(|d| format!("{}\n", d.as_ref())).collect()
}

/// How big a configuration file of the image the hook reads: a real one is a few lines.
const MAX_CONF_BYTES: u64 = 1 << 20;

/// The container's files seen through [`Rootfs::resolve`], for the loader configuration reader. Only
/// regular files are read, and at most [`MAX_CONF_BYTES`] of each: a hostile image's FIFO or huge file at
/// `/etc/ld.so.conf` does not hold up the container's creation.
impl ldconf::ContainerFiles for Rootfs {
    fn read(&self, path: &Path) -> Option<String> {
        let path = self.resolve(path).ok()?;
        // Before the open: opening a FIFO blocks. No container process exists to swap it in between.
        if !fs::metadata(&path).ok()?.is_file() {
            return None;
        }
        let file = fs::File::open(path).ok()?;
        let mut text = String::new();
        io::Read::read_to_string(&mut io::Read::take(file, MAX_CONF_BYTES), &mut text).ok()?;
        Some(text)
    }

    fn list(&self, dir: &Path) -> Vec<String> {
        let Ok(dir) = self.resolve(dir) else {
            return Vec::new();
        };
        fs::read_dir(dir)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .collect()
    }

    fn identity(&self, dir: &Path) -> Option<(u64, u64)> {
        let meta = fs::metadata(self.resolve(dir).ok()?).ok()?;
        meta.is_dir().then(|| (meta.dev(), meta.ino()))
    }

    fn is_file(&self, path: &Path) -> bool {
        self.resolve(path)
            .is_ok_and(|p| fs::metadata(p).is_ok_and(|m| m.is_file()))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn rootfs() -> (tempfile::TempDir, Rootfs) {
        let dir = tempfile::tempdir().unwrap();
        let root = Rootfs::new(dir.path());
        (dir, root)
    }

    #[test]
    fn the_root_comes_from_the_bundle_named_by_the_state_relative_or_absolute() {
        let bundle = tempfile::tempdir().unwrap();
        let state = format!(
            r#"{{"ociVersion":"1.2.0","id":"c","status":"creating","pid":1,"bundle":"{}"}}"#,
            bundle.path().display()
        );
        fs::write(
            bundle.path().join("config.json"),
            r#"{"root":{"path":"rootfs","readonly":true}}"#,
        )
        .unwrap();
        assert_eq!(
            container_root(state.as_bytes()).unwrap(),
            bundle.path().join("rootfs")
        );
        fs::write(
            bundle.path().join("config.json"),
            r#"{"root":{"path":"/run/c/rootfs"}}"#,
        )
        .unwrap();
        assert_eq!(
            container_root(state.as_bytes()).unwrap(),
            Path::new("/run/c/rootfs")
        );
        fs::write(bundle.path().join("config.json"), r#"{"root":{"path":"/"}}"#).unwrap();
        let e = container_root(state.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("refusing to edit the host"), "{e}");
        fs::write(bundle.path().join("config.json"), r#"{"process":{}}"#).unwrap();
        assert!(
            container_root(state.as_bytes())
                .unwrap_err()
                .to_string()
                .contains("root.path")
        );
        assert!(
            container_root(b"not json")
                .unwrap_err()
                .to_string()
                .contains("OCI container state")
        );
    }

    #[test]
    fn a_hostile_images_links_lead_back_into_its_root_never_to_the_host() {
        let (dir, root) = rootfs();
        let d = dir.path();
        // /etc -> / and /etc/ld.so.conf.d -> ../../../../tmp: both stay in the root.
        symlink("/", d.join("etc")).unwrap();
        symlink("../../../../host-tmp", d.join("ld.so.conf.d")).unwrap();
        assert_eq!(
            root.resolve(Path::new("/etc/ld.so.conf.d/x.conf")).unwrap(),
            d.join("host-tmp/x.conf")
        );
        root.write_file(Path::new(DRIVER_CONF), b"/usr/lib64\n").unwrap();
        assert_eq!(
            fs::read_to_string(d.join("host-tmp/00-tessera-driver.conf")).unwrap(),
            "/usr/lib64\n"
        );
        // A link at the file itself is replaced, not written through.
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        fs::write(&victim, "host file").unwrap();
        fs::remove_file(d.join("host-tmp/00-tessera-driver.conf")).unwrap();
        symlink(&victim, d.join("host-tmp/00-tessera-driver.conf")).unwrap();
        root.write_file(Path::new(DRIVER_CONF), b"/usr/lib\n").unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "host file");
        assert!(
            !fs::symlink_metadata(d.join("host-tmp/00-tessera-driver.conf"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(
            fs::metadata(d.join("host-tmp/00-tessera-driver.conf"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o644
        );
        // Loops end with an error.
        symlink("b", d.join("a")).unwrap();
        symlink("a", d.join("b")).unwrap();
        assert!(
            root.resolve(Path::new("/a/x"))
                .unwrap_err()
                .to_string()
                .contains("symbolic links")
        );
    }

    #[test]
    fn symlinks_are_created_in_the_root_replacing_a_stale_one_and_keeping_a_right_one() {
        let (dir, root) = rootfs();
        let d = dir.path();
        fs::create_dir_all(d.join("usr/lib64")).unwrap();
        symlink("/usr/lib64", d.join("lib64")).unwrap();
        let links = vec![("libcuda.so.1".to_string(), "/lib64/libcuda.so".to_string())];
        create_symlinks(&root, &links).unwrap();
        assert_eq!(
            fs::read_link(d.join("usr/lib64/libcuda.so")).unwrap(),
            Path::new("libcuda.so.1")
        );
        let before = fs::symlink_metadata(d.join("usr/lib64/libcuda.so")).unwrap();
        create_symlinks(&root, &links).unwrap();
        let after = fs::symlink_metadata(d.join("usr/lib64/libcuda.so")).unwrap();
        assert_eq!(
            std::os::unix::fs::MetadataExt::ino(&before),
            std::os::unix::fs::MetadataExt::ino(&after)
        );
        // A stale link or a file of the image is replaced; a directory is not touched.
        fs::remove_file(d.join("usr/lib64/libcuda.so")).unwrap();
        symlink("libcuda.so.470", d.join("usr/lib64/libcuda.so")).unwrap();
        create_symlinks(&root, &links).unwrap();
        assert_eq!(
            fs::read_link(d.join("usr/lib64/libcuda.so")).unwrap(),
            Path::new("libcuda.so.1")
        );
        fs::create_dir(d.join("usr/lib64/libnvidia-ml.so")).unwrap();
        let e = create_symlinks(
            &root,
            &[("libnvidia-ml.so.1".into(), "/usr/lib64/libnvidia-ml.so".into())],
        );
        assert!(e.unwrap_err().to_string().contains("directory is in the way"));
        let e = create_symlinks(&root, &[("x".into(), "relative/link".into())]).unwrap_err();
        assert!(e.to_string().contains("absolute link path"), "{e}");
    }

    fn compat_image(d: &Path, compat: &[&str]) {
        fs::create_dir_all(d.join("etc/ld.so.conf.d")).unwrap();
        fs::write(d.join("etc/ld.so.cache"), b"").unwrap();
        fs::create_dir_all(d.join("usr/local/cuda/compat")).unwrap();
        for f in compat {
            fs::write(d.join("usr/local/cuda/compat").join(f), b"ELF").unwrap();
        }
    }

    /// A compat directory whose `libcuda.so.<version>` carries NVIDIA's note listing `branches`.
    fn noted_compat_image(d: &Path, version: &str, branches: &[u32]) {
        compat_image(d, &[]);
        fs::write(
            d.join("usr/local/cuda/compat")
                .join(format!("libcuda.so.{version}")),
            elfnote::fixture::compat_libcuda(branches),
        )
        .unwrap();
    }

    #[test]
    fn a_compat_driver_with_its_note_is_used_only_on_a_host_branch_it_lists() {
        // CUDA 13.0's compat driver runs on the 535/550/570 branches: not on a 580 host, where minor-version
        // compatibility applies, although its major version is newer.
        let (dir, root) = rootfs();
        noted_compat_image(dir.path(), "590.10.01", &[535, 550, 570]);
        let conf = dir.path().join("etc/ld.so.conf.d/00-compat-tessera.conf");
        match enable_cuda_compat(&root, "580.159.03").unwrap() {
            Compat::Skipped(why) => assert!(
                why.contains("branch 580") && why.contains(".note.cuda.fwd_compatibility"),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
        assert!(!conf.exists());
        assert!(matches!(
            enable_cuda_compat(&root, "570.195.03").unwrap(),
            Compat::Enabled(v, _) if v == "590.10.01"
        ));
        assert_eq!(fs::read_to_string(&conf).unwrap(), "/usr/local/cuda/compat\n");
        // A listed branch, the same major version, a newer driver: enabled, where the major-version rule says
        // no; an older one is not.
        let (dir, root) = rootfs();
        noted_compat_image(dir.path(), "580.200.1", &[535, 580]);
        assert!(matches!(
            enable_cuda_compat(&root, "580.159.03").unwrap(),
            Compat::Enabled(v, _) if v == "580.200.1"
        ));
        assert!(matches!(
            enable_cuda_compat(&root, "580.200.01").unwrap(),
            Compat::Skipped(why) if why.contains("not newer")
        ));
    }

    #[test]
    fn versions_compare_number_by_number() {
        let v = |s: &str| version(s).unwrap();
        assert!(newer(&v("590.10.01"), &v("580.159.03")));
        assert!(newer(&v("580.200"), &v("580.159.03")));
        assert!(!newer(&v("580.159.3"), &v("580.159.03")));
        assert!(!newer(&v("580.159"), &v("580.159.0")));
        assert!(newer(&v("1000.1"), &v("999.99")));
        assert_eq!(version("580.x"), None);
    }

    #[test]
    fn a_newer_major_compat_driver_goes_first_and_an_older_or_equal_one_does_not() {
        let (dir, root) = rootfs();
        compat_image(dir.path(), &["libcuda.so.1", "libcuda.so.590.10.01"]);
        let conf = dir.path().join("etc/ld.so.conf.d/00-compat-tessera.conf");
        assert!(matches!(
            enable_cuda_compat(&root, "580.159.03").unwrap(),
            Compat::Enabled(v, _) if v == "590.10.01"
        ));
        assert_eq!(fs::read_to_string(&conf).unwrap(), "/usr/local/cuda/compat\n");
        fs::remove_file(&conf).unwrap();
        for host in ["590.48.01", "600.1"] {
            assert!(
                matches!(enable_cuda_compat(&root, host).unwrap(), Compat::Skipped(_)),
                "host {host}"
            );
            assert!(!conf.exists());
        }
        // Numbers, not strings: 1000 > 999.
        let (dir, root) = rootfs();
        compat_image(dir.path(), &["libcuda.so.1000.1"]);
        assert!(matches!(
            enable_cuda_compat(&root, "999.1").unwrap(),
            Compat::Enabled(v, _) if v == "1000.1"
        ));
        // Two compat drivers, or none, or an image without a loader cache: nothing.
        let (dir, root) = rootfs();
        compat_image(dir.path(), &["libcuda.so.590.1", "libcuda.so.600.1"]);
        assert!(matches!(
            enable_cuda_compat(&root, "580.1").unwrap(),
            Compat::Skipped(_)
        ));
        let (dir, root) = rootfs();
        compat_image(dir.path(), &[]);
        assert!(matches!(
            enable_cuda_compat(&root, "580.1").unwrap(),
            Compat::Skipped(_)
        ));
        let (dir, root) = rootfs();
        compat_image(dir.path(), &["libcuda.so.590.1"]);
        fs::remove_file(dir.path().join("etc/ld.so.cache")).unwrap();
        assert!(matches!(
            enable_cuda_compat(&root, "580.1").unwrap(),
            Compat::Skipped(_)
        ));
    }

    #[test]
    fn folders_must_be_absolute_container_directories_on_one_line() {
        for bad in ["usr/lib", "/usr/../etc", "/usr/lib\n/etc"] {
            assert!(checked_dir(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            checked_dir("/usr/local/nvidia/lib64").unwrap(),
            "/usr/local/nvidia/lib64"
        );
    }
}
