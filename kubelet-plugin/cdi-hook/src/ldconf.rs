//! The container's loader configuration read as glibc's `ldconfig` reads it (`elf/ldconfig.c`: `parse_conf`,
//! `parse_conf_include`, `add_dir_1`), and the directories its own `ldconfig` searches without being told
//! (`add_system_dir`), so `update-ldcache` can keep the image's order of precedence (NVIDIA's
//! `internal/ldconfig/ldconfig.go` `filterDirectories`, commit 1bd5242b) and its system directories
//! whatever the host's ldconfig was built with (the same file's `zz-nvcr-*.conf`, commit 6592021c).
//!
//! It reads the container through [`ContainerFiles`], so the rules are tested here on an in-memory image and
//! the hook gives them the container root with every path resolved inside it.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

/// How many configuration files one scan reads at most: an image that includes itself, or thousands of
/// files, ends the scan there instead of the hook (glibc's ldconfig has no bound; a real image has a dozen).
const MAX_CONF_FILES: usize = 1024;

/// What the configuration reader needs of a container's files, every path taken from the container's `/`.
pub trait ContainerFiles {
    /// The text of the container's file `path`; `None` when it is missing or unreadable (ldconfig skips
    /// those silently).
    fn read(&self, path: &Path) -> Option<String>;
    /// The names in the container's directory `dir`, empty when it is missing or not a directory.
    fn list(&self, dir: &Path) -> Vec<String>;
    /// What makes the container's directory `dir` the same as another name of it (device and inode,
    /// through its links); `None` when it does not exist. ldconfig scans a directory once, whatever names
    /// reach it (`add_single_dir`).
    fn identity(&self, dir: &Path) -> Option<(u64, u64)>;
    /// Whether the container's `path` is a regular file (through its links).
    fn is_file(&self, path: &Path) -> bool;
}

/// What a scan of the container's configuration found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoaderConfig {
    /// The directories named, in ldconfig's order, trailing `/` and a `=<type>` suffix taken off.
    pub dirs: Vec<String>,
    /// The `include` patterns met, made absolute as ldconfig makes them (relative to the including file).
    pub includes: Vec<String>,
}

impl LoaderConfig {
    /// Whether ldconfig reads the container's file `path` through an `include` of this configuration.
    pub fn includes_file(&self, path: &str) -> bool {
        self.includes.iter().any(|p| path_matches(p, path))
    }
}

/// The configuration `top` (normally `/etc/ld.so.conf`) and every file it includes, in ldconfig's order: an
/// `include` is read where it stands. Files named in `skip` (the hook's own, from an earlier run) are not
/// read, so a second run decides as the first did.
pub fn read_config(files: &dyn ContainerFiles, top: &str, skip: &[&str]) -> LoaderConfig {
    let mut config = LoaderConfig::default();
    let mut seen = HashSet::new();
    read_one(files, top, skip, &mut seen, &mut config);
    config
}

fn read_one(
    files: &dyn ContainerFiles,
    file: &str,
    skip: &[&str],
    seen: &mut HashSet<String>,
    config: &mut LoaderConfig,
) {
    if skip.contains(&file) || seen.len() >= MAX_CONF_FILES || !seen.insert(file.to_string()) {
        return;
    }
    let Some(text) = files.read(Path::new(file)) else {
        return;
    };
    for line in text.lines() {
        // No quoting in this format: a `#` anywhere ends the line.
        let line = line.split('#').next().unwrap_or("").trim_start();
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = keyword(line, "include") {
            for pattern in rest.split([' ', '\t']).filter(|p| !p.is_empty()) {
                let pattern = if pattern.starts_with('/') {
                    pattern.to_string()
                } else {
                    // ldconfig: relative to the including file's directory.
                    let dir = Path::new(file).parent().unwrap_or(Path::new("/"));
                    dir.join(pattern).to_string_lossy().into_owned()
                };
                config.includes.push(pattern.clone());
                for included in glob(files, &pattern) {
                    read_one(files, &included, skip, seen, config);
                }
            }
        } else if line.get(..5).is_some_and(|w| w.eq_ignore_ascii_case("hwcap"))
            && line[5..].starts_with([' ', '\t'])
        {
            // Ignored by ldconfig since glibc 2.37, and never a directory.
        } else {
            let dir = normalize(line.split('=').next().unwrap_or(""));
            if !dir.is_empty() && !config.dirs.contains(&dir) {
                config.dirs.push(dir);
            }
        }
    }
}

/// `line` after `word` and a blank, as ldconfig recognises a directive (`include\t/x` yes, `includes` no).
fn keyword<'a>(line: &'a str, word: &str) -> Option<&'a str> {
    let rest = line.strip_prefix(word)?;
    rest.starts_with([' ', '\t']).then(|| &rest[1..])
}

/// A directory as ldconfig keeps it: surrounding blanks and trailing slashes off (`/` stays `/`).
pub fn normalize(dir: &str) -> String {
    let dir = dir.trim();
    let trimmed = dir.trim_end_matches('/');
    if trimmed.is_empty() && dir.starts_with('/') {
        "/".to_string()
    } else {
        trimmed.to_string()
    }
}

/// The directories the container's own ldconfig and loader search without configuration, as NVIDIA's hook
/// lists them (`debianSystemSearchPaths`, `nonDebianSystemSearchPaths`; the dynamic loader's
/// `--list-diagnostics` `path.system_dirs`): Debian's multiarch patch searches the triplet directories and
/// then `/lib`, `/usr/lib`; elsewhere glibc's `add_system_dir` adds `/lib`, `/usr/lib` and their `64`
/// (and on x86_64 `x32`) twins. `arch` is [`std::env::consts::ARCH`]: the hook runs on the node, whose
/// architecture the container shares. Other architectures get `/lib` and `/usr/lib`, as NVIDIA's.
pub fn system_dirs(debian_like: bool, arch: &str) -> Vec<String> {
    let mut dirs: Vec<String> = Vec::new();
    let triplet = match arch {
        "x86_64" => Some("x86_64-linux-gnu"),
        "aarch64" => Some("aarch64-linux-gnu"),
        _ => None,
    };
    if debian_like {
        if let Some(t) = triplet {
            dirs.push(format!("/lib/{t}"));
            dirs.push(format!("/usr/lib/{t}"));
        }
        dirs.extend(["/lib".into(), "/usr/lib".into()]);
    } else {
        dirs.extend(["/lib".into(), "/usr/lib".into()]);
        match arch {
            "x86_64" => dirs.extend(["/lib64", "/usr/lib64", "/libx32", "/usr/libx32"].map(String::from)),
            "aarch64" => dirs.extend(["/lib64", "/usr/lib64"].map(String::from)),
            _ => {}
        }
    }
    dirs
}

/// Whether the container is of Debian's family (Debian, Ubuntu, their derivatives): `/etc/debian_version`
/// is a file, NVIDIA's test (`isDebianLike`, read after it pivots into the container root). Not the
/// multiarch directory: the driver's own mounts create `/usr/lib/x86_64-linux-gnu` in a RHEL image on an
/// Ubuntu host.
pub fn is_debian_like(files: &dyn ContainerFiles) -> bool {
    files.is_file(Path::new("/etc/debian_version"))
}

/// The driver's `folders` that the container does not already search: not one of `tracked` (the image's
/// configuration and its system directories), by name or by what the name leads to. Writing a tracked
/// directory again would move it ahead of every directory the image orders before it (`/usr/local/lib`
/// ahead of `/usr/lib/x86_64-linux-gnu` on Ubuntu). In order, once each.
pub fn untracked<'a>(files: &dyn ContainerFiles, tracked: &[String], folders: &'a [String]) -> Vec<&'a str> {
    let mut names: HashSet<String> = tracked.iter().map(|d| normalize(d)).collect();
    let mut ids: HashSet<(u64, u64)> = tracked
        .iter()
        .filter_map(|d| files.identity(Path::new(d)))
        .collect();
    let mut out = Vec::new();
    for f in folders {
        let name = normalize(f);
        let id = files.identity(Path::new(&name));
        if names.contains(&name) || id.is_some_and(|id| ids.contains(&id)) {
            continue;
        }
        names.insert(name);
        ids.extend(id);
        out.push(f.as_str());
    }
    out
}

/// The container's files that `pattern` (absolute) names, as glob(3) without flags expands it: `*`, `?` and
/// `[...]` within one component, a leading `.` matched only by a leading `.`, sorted bytewise (ldconfig sets
/// `LC_COLLATE=C`). A pattern without wildcards names itself.
fn glob(files: &dyn ContainerFiles, pattern: &str) -> Vec<String> {
    let mut found = vec![String::new()];
    for part in pattern.split('/').filter(|p| !p.is_empty()) {
        let mut next = Vec::new();
        for base in &found {
            if !part.contains(['*', '?', '[']) {
                next.push(format!("{base}/{part}"));
                continue;
            }
            let dir = if base.is_empty() { "/" } else { base.as_str() };
            let mut names: Vec<String> = files
                .list(Path::new(dir))
                .into_iter()
                .filter(|n| {
                    (!n.starts_with('.') || part.starts_with('.')) && fnmatch(part.as_bytes(), n.as_bytes())
                })
                .collect();
            names.sort();
            next.extend(names.into_iter().map(|n| format!("{base}/{n}")));
        }
        found = next;
    }
    found.retain(|p| !p.is_empty());
    found
}

/// Whether the container path `path` is one that the absolute glob `pattern` names (component by
/// component; no file is read).
fn path_matches(pattern: &str, path: &str) -> bool {
    let norm = |p: &str| -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for c in PathBuf::from(p).components() {
            if let std::path::Component::Normal(n) = c {
                out.push(n.to_string_lossy().into_owned());
            }
        }
        out
    };
    let (pat, path) = (norm(pattern), norm(path));
    pat.len() == path.len()
        && pat
            .iter()
            .zip(&path)
            .all(|(p, n)| (!n.starts_with('.') || p.starts_with('.')) && fnmatch(p.as_bytes(), n.as_bytes()))
}

/// fnmatch(3) for one path component: `*`, `?`, `[...]` (ranges, `!`/`^` negation, `]` first is literal),
/// `\` quoting the next character.
fn fnmatch(pat: &[u8], name: &[u8]) -> bool {
    match pat.split_first() {
        None => name.is_empty(),
        Some((b'*', rest)) => (0..=name.len()).any(|i| fnmatch(rest, &name[i..])),
        Some((b'?', rest)) => !name.is_empty() && fnmatch(rest, &name[1..]),
        Some((b'[', rest)) => match (name.first(), class(rest)) {
            (Some(&c), Some((set, after))) => set(c) && fnmatch(after, &name[1..]),
            // An unclosed `[` is an ordinary character.
            (Some(&c), None) => c == b'[' && fnmatch(rest, &name[1..]),
            (None, _) => false,
        },
        Some((b'\\', rest)) if !rest.is_empty() => {
            name.first() == Some(&rest[0]) && fnmatch(&rest[1..], &name[1..])
        }
        Some((&c, rest)) => name.first() == Some(&c) && fnmatch(rest, &name[1..]),
    }
}

/// A bracket expression after its `[`: the test it makes and the pattern after its `]`, or `None` when it
/// is not closed.
#[allow(clippy::type_complexity)]
fn class(pat: &[u8]) -> Option<(Box<dyn Fn(u8) -> bool + '_>, &[u8])> {
    let (negate, body) = match pat.first() {
        Some(b'!' | b'^') => (true, &pat[1..]),
        _ => (false, pat),
    };
    // `]` right after `[` or `[!` is a member, not the end.
    let end = body.iter().skip(1).position(|&c| c == b']')? + 1;
    let members = &body[..end];
    let test = move |c: u8| {
        let mut i = 0;
        let mut hit = false;
        while i < members.len() {
            if i + 2 < members.len() && members[i + 1] == b'-' {
                hit |= members[i] <= c && c <= members[i + 2];
                i += 3;
            } else {
                hit |= members[i] == c;
                i += 1;
            }
        }
        hit != negate
    };
    Some((Box::new(test), &body[end + 1..]))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// An image in memory: files with their text, directories, and links as aliases of directories.
    #[derive(Default)]
    struct Image {
        files: HashMap<String, String>,
        dirs: Vec<String>,
        aliases: HashMap<String, String>,
    }

    impl Image {
        fn file(mut self, path: &str, text: &str) -> Self {
            self.files.insert(path.into(), text.into());
            self
        }
        fn dir(mut self, path: &str) -> Self {
            self.dirs.push(path.into());
            self
        }
        fn link(mut self, path: &str, to: &str) -> Self {
            self.aliases.insert(path.into(), to.into());
            self
        }
        fn real<'a>(&'a self, path: &'a str) -> &'a str {
            self.aliases.get(path).map_or(path, String::as_str)
        }
    }

    impl ContainerFiles for Image {
        fn read(&self, path: &Path) -> Option<String> {
            self.files.get(path.to_str()?).cloned()
        }
        fn list(&self, dir: &Path) -> Vec<String> {
            let dir = dir.to_str().unwrap().trim_end_matches('/');
            self.files
                .keys()
                .filter_map(|f| {
                    Path::new(f)
                        .parent()
                        .filter(|p| p.to_str() == Some(dir))
                        .map(|_| f)
                })
                .filter_map(|f| Path::new(f).file_name()?.to_str().map(String::from))
                .collect()
        }
        fn identity(&self, dir: &Path) -> Option<(u64, u64)> {
            let real = self.real(dir.to_str()?);
            self.dirs.iter().position(|d| d == real).map(|i| (1, i as u64))
        }
        fn is_file(&self, path: &Path) -> bool {
            self.files.contains_key(path.to_str().unwrap())
        }
    }

    fn ubuntu() -> Image {
        Image::default()
            .file("/etc/debian_version", "bookworm/sid\n")
            .file("/etc/ld.so.conf", "include /etc/ld.so.conf.d/*.conf\n\n")
            .file("/etc/ld.so.conf.d/libc.conf", "# libc default configuration\n/usr/local/lib\n")
            .file(
                "/etc/ld.so.conf.d/x86_64-linux-gnu.conf",
                "# Multiarch support\n/usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n",
            )
            .dir("/usr/lib/x86_64-linux-gnu")
            .dir("/usr/local/lib")
            .dir("/usr/local/nvidia/lib64")
            .link("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu")
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn ubuntus_configuration_is_read_through_its_include_in_file_name_order() {
        let image = ubuntu()
            .file("/etc/ld.so.conf.d/.hidden.conf", "/hidden\n")
            .file("/etc/ld.so.conf.d/README", "/not-a-conf\n");
        let config = read_config(&image, "/etc/ld.so.conf", &[]);
        assert_eq!(
            config.dirs,
            strings(&[
                "/usr/local/lib",
                "/usr/local/lib/x86_64-linux-gnu",
                "/lib/x86_64-linux-gnu",
                "/usr/lib/x86_64-linux-gnu",
            ])
        );
        assert!(config.includes_file("/etc/ld.so.conf.d/00-tessera-driver.conf"));
        assert!(config.includes_file("/etc/ld.so.conf.d/zz-tessera-system.conf"));
        assert!(!config.includes_file("/etc/ld.so.conf.d/.hidden.conf"));
    }

    #[test]
    fn rhels_relative_include_comments_hwcap_and_type_suffixes_are_read_as_ldconfig_reads_them() {
        let image = Image::default()
            .file("/etc/ld.so.conf", "include ld.so.conf.d/*.conf\n")
            .file(
                "/etc/ld.so.conf.d/a.conf",
                "  /opt/a/lib/   # trailing slash and comment\nhwcap 1 nosegneg\n/opt/b=libc6\n\tinclude\t/etc/more/[a-c]?.conf x.conf\n",
            )
            .file("/etc/more/b1.conf", "/opt/more\n")
            .file("/etc/more/d1.conf", "/opt/not-matched\n")
            .file("/etc/ld.so.conf.d/x.conf", "/opt/x\n");
        let config = read_config(&image, "/etc/ld.so.conf", &[]);
        assert_eq!(
            config.dirs,
            strings(&["/opt/a/lib", "/opt/b", "/opt/more", "/opt/x"])
        );
        assert_eq!(
            config.includes,
            strings(&[
                "/etc/ld.so.conf.d/*.conf",
                "/etc/more/[a-c]?.conf",
                "/etc/ld.so.conf.d/x.conf"
            ])
        );
    }

    #[test]
    fn an_include_loop_or_the_hooks_own_files_are_not_read_again() {
        let image = Image::default()
            .file(
                "/etc/ld.so.conf",
                "include /etc/ld.so.conf\ninclude /etc/ld.so.conf.d/*.conf\n/opt/a\n",
            )
            .file(
                "/etc/ld.so.conf.d/00-tessera-driver.conf",
                "/usr/lib/x86_64-linux-gnu\n",
            )
            .file("/etc/ld.so.conf.d/zz-tessera-system.conf", "/usr/lib64\n");
        let config = read_config(
            &image,
            "/etc/ld.so.conf",
            &[
                "/etc/ld.so.conf.d/00-tessera-driver.conf",
                "/etc/ld.so.conf.d/zz-tessera-system.conf",
            ],
        );
        assert_eq!(config.dirs, strings(&["/opt/a"]));
    }

    #[test]
    fn a_configuration_without_the_conf_d_include_is_told_apart() {
        let image = Image::default().file(
            "/etc/ld.so.conf",
            "/usr/local/lib\ninclude /etc/ld.so.conf.d/*-lib.conf\n",
        );
        let config = read_config(&image, "/etc/ld.so.conf", &[]);
        assert!(!config.includes_file("/etc/ld.so.conf.d/00-tessera-driver.conf"));
        assert!(config.includes_file("/etc/ld.so.conf.d/cuda-lib.conf"));
    }

    #[test]
    fn tracked_driver_directories_are_filtered_by_name_or_by_what_a_link_leads_to() {
        let image = ubuntu();
        let mut tracked = read_config(&image, "/etc/ld.so.conf", &[]).dirs;
        tracked.extend(system_dirs(true, "x86_64"));
        let folders = strings(&[
            "/usr/lib/x86_64-linux-gnu/",
            "/usr/local/nvidia/lib64",
            "/usr/local/nvidia/lib64",
            "/usr/lib",
        ]);
        assert_eq!(
            untracked(&image, &tracked, &folders),
            vec!["/usr/local/nvidia/lib64"]
        );
        // A name the image does not list that is a link to a directory it does.
        let image = ubuntu().link("/usr/lib/nvidia-driver", "/usr/local/lib");
        assert!(untracked(&image, &tracked, &strings(&["/usr/lib/nvidia-driver"])).is_empty());
    }

    #[test]
    fn the_system_directories_are_the_families_own() {
        assert_eq!(
            system_dirs(true, "x86_64"),
            strings(&[
                "/lib/x86_64-linux-gnu",
                "/usr/lib/x86_64-linux-gnu",
                "/lib",
                "/usr/lib"
            ])
        );
        assert_eq!(
            system_dirs(false, "x86_64"),
            strings(&[
                "/lib",
                "/usr/lib",
                "/lib64",
                "/usr/lib64",
                "/libx32",
                "/usr/libx32"
            ])
        );
        assert_eq!(
            system_dirs(true, "aarch64"),
            strings(&[
                "/lib/aarch64-linux-gnu",
                "/usr/lib/aarch64-linux-gnu",
                "/lib",
                "/usr/lib"
            ])
        );
        assert_eq!(
            system_dirs(false, "aarch64"),
            strings(&["/lib", "/usr/lib", "/lib64", "/usr/lib64"])
        );
        assert_eq!(system_dirs(false, "riscv64"), strings(&["/lib", "/usr/lib"]));
        assert!(is_debian_like(&ubuntu()));
        assert!(!is_debian_like(&Image::default().file("/etc/redhat-release", "")));
    }

    #[test]
    fn fnmatch_handles_stars_questions_classes_and_escapes() {
        for (p, n, want) in [
            ("*.conf", "libc.conf", true),
            ("*.conf", "libc.conf.bak", false),
            ("?.conf", "a.conf", true),
            ("[a-c]*", "b", true),
            ("[!a-c]*", "b", false),
            ("[]x]", "]", true),
            ("\\*", "*", true),
            ("\\*", "a", false),
            ("[abc", "[abc", true),
        ] {
            assert_eq!(fnmatch(p.as_bytes(), n.as_bytes()), want, "{p} {n}");
        }
    }
}
