//! How NVIDIA driver versions are written: in the kernel module's version file and in library file names.

use std::path::Path;

/// The driver version in the kernel module's version file: the first word of its `NVRM version` line that
/// is a version number (`NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Sun …` → `580.95.05`;
/// the open module's `… Open Kernel Module for x86_64  580.95.05  Release Build …` too).
pub fn parse_kernel_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|w| is_version(w))
        .map(str::to_string)
}

/// `580.95.05`, `550.54`: digits and dots, starting with a digit, with at least one dot.
fn is_version(word: &str) -> bool {
    word.starts_with(|c: char| c.is_ascii_digit())
        && word.contains('.')
        && word.chars().all(|c| c.is_ascii_digit() || c == '.')
}

/// The version a library file's name carries: `libcuda.so.580.95.05` → `580.95.05` for stem `libcuda`;
/// `None` for a soname (`libcuda.so.1`) or another library.
pub fn version_in_name(file: &Path, stem: &str) -> Option<String> {
    let name = file.file_name()?.to_str()?;
    let rest = name.strip_prefix(stem)?.strip_prefix(".so.")?;
    is_version(rest).then(|| rest.to_string())
}
