//! The hook as the runtime runs it: the binary, the OCI state on stdin, a container root on disk and the
//! host's own ldconfig. The "driver library" is a copy of the host's libm (any ELF library with a soname
//! does: ldconfig reads the soname from the file), mounted where GKE's layout puts the driver.

use std::{
    fs,
    io::Write,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

fn hook() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tessera-cdi-hook"))
}

/// A bundle whose config.json names `rootfs` (relative, as containerd writes it).
fn bundle() -> (tempfile::TempDir, PathBuf, String) {
    let bundle = tempfile::tempdir().unwrap();
    fs::write(
        bundle.path().join("config.json"),
        r#"{"ociVersion":"1.2.0","root":{"path":"rootfs"}}"#,
    )
    .unwrap();
    let root = bundle.path().join("rootfs");
    fs::create_dir_all(&root).unwrap();
    let state = format!(
        r#"{{"ociVersion":"1.2.0","id":"t","status":"creating","pid":4242,"bundle":"{}"}}"#,
        bundle.path().display()
    );
    (bundle, root, state)
}

/// The hook as the runtime starts it: as root. A test run without root runs it in a user namespace of its
/// own (`unshare -r`), where `ldconfig -r` may chroot.
fn hook_command() -> Command {
    let uid = Command::new("id").arg("-u").output().unwrap();
    if String::from_utf8_lossy(&uid.stdout).trim() == "0" {
        return Command::new(hook());
    }
    let mut cmd = Command::new("unshare");
    cmd.arg("-r").arg(hook());
    cmd
}

fn run(args: &[&str], state: &str) -> std::process::Output {
    let mut child = hook_command()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A hook that refuses its arguments exits before it reads the state.
    let _ = child.stdin.take().unwrap().write_all(state.as_bytes());
    child.wait_with_output().unwrap()
}

/// A library of the host with a soname (libm.so.6 on every glibc distribution).
fn host_library() -> PathBuf {
    [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib64/libm.so.6",
        "/lib64/libm.so.6",
        "/usr/lib/libm.so.6",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
    .expect("a glibc host has libm.so.6")
}

/// Whether the cache file `cache` (a host path) holds the string `entry`.
fn cache_names(cache: &Path, entry: &str) -> bool {
    let cache = fs::read(cache).unwrap_or_default();
    cache.windows(entry.len()).any(|w| w == entry.as_bytes())
}

#[test]
fn update_ldcache_puts_a_non_default_driver_directory_in_the_containers_own_cache() {
    let (_bundle, root, state) = bundle();
    let lib = root.join("usr/local/nvidia/lib64");
    fs::create_dir_all(&lib).unwrap();
    fs::copy(host_library(), lib.join("libm.so.6")).unwrap();
    // The image's own loader configuration, reached through an absolute link as some images have it.
    fs::create_dir_all(root.join("usr/etc/ld.so.conf.d")).unwrap();
    fs::write(
        root.join("usr/etc/ld.so.conf"),
        "include /etc/ld.so.conf.d/*.conf\n",
    )
    .unwrap();
    symlink("/usr/etc", root.join("etc")).unwrap();
    let out = run(&["update-ldcache", "--folder", "/usr/local/nvidia/lib64"], &state);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        fs::read_to_string(root.join("usr/etc/ld.so.conf.d/00-tessera-driver.conf")).unwrap(),
        "/usr/local/nvidia/lib64\n"
    );
    assert!(
        cache_names(
            &root.join("usr/etc/ld.so.cache"),
            "/usr/local/nvidia/lib64/libm.so.6"
        ),
        "the container's /etc/ld.so.cache does not name the driver directory's library"
    );
}

#[test]
fn an_image_without_ld_so_conf_gets_one_that_includes_the_driver_conf() {
    let (_bundle, root, state) = bundle();
    let lib = root.join("opt/driver/lib");
    fs::create_dir_all(&lib).unwrap();
    fs::copy(host_library(), lib.join("libm.so.6")).unwrap();
    let out = run(&["update-ldcache", "--folder=/opt/driver/lib"], &state);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        fs::read_to_string(root.join("etc/ld.so.conf")).unwrap(),
        "include /etc/ld.so.conf.d/*.conf\n"
    );
    assert!(cache_names(
        &root.join("etc/ld.so.cache"),
        "/opt/driver/lib/libm.so.6"
    ));
}

#[test]
fn create_symlinks_then_update_ldcache_gives_the_unversioned_name_a_cache_entry() {
    let (_bundle, root, state) = bundle();
    let lib = root.join("usr/local/nvidia/lib64");
    fs::create_dir_all(&lib).unwrap();
    fs::copy(host_library(), lib.join("libm.so.6")).unwrap();
    let out = run(
        &[
            "create-symlinks",
            "--link",
            "libm.so.6::/usr/local/nvidia/lib64/libm.so",
        ],
        &state,
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        fs::read_link(lib.join("libm.so")).unwrap(),
        Path::new("libm.so.6")
    );
    let out = run(&["update-ldcache", "--folder", "/usr/local/nvidia/lib64"], &state);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // What Triton's `ldconfig -p | grep libcuda.so` relies on.
    assert!(cache_names(
        &root.join("etc/ld.so.cache"),
        "/usr/local/nvidia/lib64/libm.so\0"
    ));
}

#[test]
fn a_wrong_call_fails_with_a_message_naming_the_fix() {
    let (_bundle, _root, state) = bundle();
    let out = run(&["update-ldcache", "--folder", "lib64"], &state);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("want an absolute directory"));
    let out = run(&["frobnicate"], &state);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown subcommand"));
    let out = run(&["enable-cuda-compat"], &state);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--host-driver-version"));
    let out = run(&["create-symlinks", "--link", "x"], "{}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("<target>::<link>"));
    let out = run(
        &["update-ldcache", "--folder", "/usr/lib"],
        r#"{"bundle":"/nonexistent-bundle"}"#,
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));
}

/// The host's ldconfig, as the hook picks it.
fn host_ldconfig() -> PathBuf {
    tessera_cdi_hook::host_ldconfig(None).expect("a glibc host has ldconfig")
}

/// The paths the cache file `cache` (a host path) gives for `soname`, in the cache's order: the first is the
/// one the loader takes, and the one `ldconfig -p` shows first.
fn cache_paths(cache: &Path, soname: &str) -> Vec<String> {
    let out = Command::new(host_ldconfig())
        .arg("-p")
        .arg("-C")
        .arg(cache)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.trim_start().starts_with(&format!("{soname} ")))
        .filter_map(|l| l.split(" => ").nth(1).map(str::to_string))
        .collect()
}

/// Debian's multiarch directory on this machine's architecture (`/usr/lib/x86_64-linux-gnu`).
fn multiarch() -> String {
    format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH)
}

/// An image root built file by file.
struct Image<'a>(&'a Path);

impl Image<'_> {
    fn file(&self, path: &str, text: &str) -> &Self {
        let at = self.0.join(path.trim_start_matches('/'));
        fs::create_dir_all(at.parent().unwrap()).unwrap();
        fs::write(at, text).unwrap();
        self
    }
    /// A copy of the host's libm at `dir/libm.so.6`.
    fn library(&self, dir: &str) -> &Self {
        let at = self.0.join(dir.trim_start_matches('/'));
        fs::create_dir_all(&at).unwrap();
        fs::copy(host_library(), at.join("libm.so.6")).unwrap();
        self
    }
    fn link(&self, path: &str, target: &str) -> &Self {
        symlink(target, self.0.join(path.trim_start_matches('/'))).unwrap();
        self
    }
    /// Ubuntu's loader configuration: `/usr/local/lib` (libc.conf) ahead of the multiarch directories.
    fn ubuntu(&self) -> &Self {
        let triplet = format!("{}-linux-gnu", std::env::consts::ARCH);
        self.file("/etc/debian_version", "trixie/sid\n")
            .file("/etc/ld.so.conf", "include /etc/ld.so.conf.d/*.conf\n\n")
            .file(
                "/etc/ld.so.conf.d/libc.conf",
                "# libc default configuration\n/usr/local/lib\n",
            )
            .file(
                &format!("/etc/ld.so.conf.d/{triplet}.conf"),
                &format!(
                    "# Multiarch support\n/usr/local/lib/{triplet}\n/lib/{triplet}\n/usr/lib/{triplet}\n"
                ),
            )
    }
    /// UBI's: a relative include and nothing in it; the libraries in `/usr/lib64`, `/lib64` a link to it.
    fn ubi(&self) -> &Self {
        fs::create_dir_all(self.0.join("usr/lib64")).unwrap();
        self.file(
            "/etc/redhat-release",
            "Red Hat Enterprise Linux release 9.6 (Plow)\n",
        )
        .file("/etc/ld.so.conf", "include ld.so.conf.d/*.conf\n")
        .file("/etc/ld.so.conf.d/.keep", "")
        .link("/lib64", "usr/lib64")
    }
}

#[test]
fn a_driver_in_the_images_system_directory_keeps_usr_local_lib_ahead_of_the_distros_copy() {
    let (_bundle, root, state) = bundle();
    // A source-built library in /usr/local/lib (OpenMPI, UCX, NCCL) over the distribution's copy, and the
    // host's driver mounted at its host path, the image's multiarch directory.
    Image(&root)
        .ubuntu()
        .library("/usr/local/lib")
        .library(&multiarch());
    let folder = multiarch();
    for run_number in 0..2 {
        let out = run(&["update-ldcache", "--folder", &folder], &state);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(
            cache_paths(&root.join("etc/ld.so.cache"), "libm.so.6"),
            vec![
                "/usr/local/lib/libm.so.6".to_string(),
                format!("{folder}/libm.so.6")
            ],
            "run {run_number}: the image's /usr/local/lib must stay ahead of its multiarch directory"
        );
    }
    assert_eq!(
        fs::read_to_string(root.join("etc/ld.so.conf.d/00-tessera-driver.conf")).unwrap(),
        "",
        "a directory the image already searches is not named again"
    );
}

/// The cross-family tests need a host whose ldconfig does not search `/usr/lib64` by itself; elsewhere they
/// say so and pass.
fn on_a_debian_family_host() -> bool {
    let debian = Path::new("/etc/debian_version").exists();
    if !debian {
        eprintln!("skipped: the host's ldconfig searches /usr/lib64 itself on a non-Debian host");
    }
    debian
}

#[test]
fn a_ubi_image_on_a_debian_family_host_keeps_its_usr_lib64_libraries_in_the_cache() {
    if !on_a_debian_family_host() {
        return;
    }
    let (_bundle, root, state) = bundle();
    Image(&root)
        .ubi()
        .library("/usr/lib64")
        .library("/usr/local/nvidia/lib64");
    let out = run(&["update-ldcache", "--folder", "/usr/local/nvidia/lib64"], &state);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        cache_paths(&root.join("etc/ld.so.cache"), "libm.so.6"),
        vec![
            "/usr/local/nvidia/lib64/libm.so.6".to_string(),
            // The image's /usr/lib64, under the first name that reaches it, as UBI's own ldconfig lists it.
            "/lib64/libm.so.6".to_string()
        ],
        "the host's ldconfig does not search a UBI image's /usr/lib64 by itself"
    );
    let system = fs::read_to_string(root.join("etc/ld.so.conf.d/zz-tessera-system.conf")).unwrap();
    assert!(system.lines().any(|l| l == "/usr/lib64"), "{system}");
    assert!(!system.contains("-linux-gnu"), "{system}");
}

#[test]
fn an_image_whose_configuration_skips_ld_so_conf_d_gets_both_lists_on_the_command_line() {
    if !on_a_debian_family_host() {
        return;
    }
    let (_bundle, root, state) = bundle();
    Image(&root)
        .ubi()
        .file("/etc/ld.so.conf", "/opt/app/lib\n")
        .library("/usr/lib64")
        .library("/usr/local/nvidia/lib64");
    let out = run(&["update-ldcache", "--folder", "/usr/local/nvidia/lib64"], &state);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cache = root.join("etc/ld.so.cache");
    assert_eq!(
        cache_paths(&cache, "libm.so.6"),
        vec![
            "/usr/local/nvidia/lib64/libm.so.6".to_string(),
            // The image's /usr/lib64, under the first name that reaches it, as UBI's own ldconfig lists it.
            "/lib64/libm.so.6".to_string()
        ]
    );
    // Nothing written where the image's configuration would not read it.
    assert!(!root.join("etc/ld.so.conf.d/00-tessera-driver.conf").exists());
    assert!(!root.join("etc/ld.so.conf.d/zz-tessera-system.conf").exists());
}
