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
