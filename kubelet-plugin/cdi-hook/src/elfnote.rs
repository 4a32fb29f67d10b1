//! The note a CUDA forward-compatibility `libcuda.so` carries about the host drivers it runs on: section
//! `.note.cuda.fwd_compatibility`, one ELF note of owner `NVIDIA Corporation` whose description is JSON
//! (`{"Format": 1, "CUDA Version": "13.0", "Driver": [535, 550, 570, 575], "Device": [...]}`), what
//! `readelf -p .note.cuda.fwd_compatibility` prints. Read as NVIDIA's hook reads it
//! (`cmd/nvidia-cdi-hook/cudacompat/cuda-elf-header.go`), with no ELF library: only the section headers,
//! the section names and that one section are read, each bounded, as the library is large and the image's.

use std::{fs::File, io, os::unix::fs::FileExt};

use serde::Deserialize;

/// The section's name.
pub const SECTION: &str = ".note.cuda.fwd_compatibility";
/// The note's owner.
const OWNER: &str = "NVIDIA Corporation";
/// `SHT_NOTE`.
const SHT_NOTE: u32 = 7;
/// The most bytes of section names or of the note that are read: a real library's are a few hundred.
const MAX_SECTION_BYTES: u64 = 1 << 20;

/// What the note says.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct CompatNote {
    /// The CUDA version the compat driver provides.
    #[serde(rename = "CUDA Version", default)]
    pub cuda_version: String,
    /// The host driver branches (major versions) the compat driver runs on.
    #[serde(rename = "Driver", default)]
    pub driver_branches: Vec<u32>,
}

/// The note of the library `file`: `None` when the file is not an ELF file, has no such section, or the
/// section holds no note of NVIDIA's (then the caller falls back to comparing versions, as NVIDIA's hook
/// does); an error when the note is there but unreadable.
pub fn read(file: &File) -> io::Result<Option<CompatNote>> {
    let mut ident = [0u8; 16];
    if file.read_exact_at(&mut ident, 0).is_err() || ident[..4] != *b"\x7fELF" {
        return Ok(None);
    }
    let elf = Elf {
        file,
        wide: match ident[4] {
            1 => false,
            2 => true,
            c => return Err(bad(format!("ELF class {c}"))),
        },
        little: match ident[5] {
            1 => true,
            2 => false,
            d => return Err(bad(format!("ELF data encoding {d}"))),
        },
    };
    // e_shoff, e_shentsize, e_shnum, e_shstrndx.
    let (shoff, shentsize, shnum, shstrndx) = if elf.wide {
        (elf.u64(0x28)?, elf.u16(0x3a)?, elf.u16(0x3c)?, elf.u16(0x3e)?)
    } else {
        (
            u64::from(elf.u32(0x20)?),
            elf.u16(0x2e)?,
            elf.u16(0x30)?,
            elf.u16(0x32)?,
        )
    };
    if shoff == 0 || shnum == 0 || shstrndx >= shnum {
        return Ok(None);
    }
    let section = |i: u16| elf.section(shoff + u64::from(i) * u64::from(shentsize));
    let names = section(shstrndx)?;
    let names = elf.bytes(names.offset, names.size)?;
    for i in 0..shnum {
        let s = section(i)?;
        let name = names.get(s.name as usize..).unwrap_or_default();
        let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
        if s.kind != SHT_NOTE || name != SECTION.as_bytes() {
            continue;
        }
        return parse_note(&elf.bytes(s.offset, s.size)?, s.align, elf.little);
    }
    Ok(None)
}

/// One note (`Elf_Nhdr`: name size, description size, type; then the name and the description, each
/// padded to the section's alignment, as NVIDIA pads them).
fn parse_note(data: &[u8], align: u64, little: bool) -> io::Result<Option<CompatNote>> {
    let word = |at: usize| -> Option<usize> {
        let b: [u8; 4] = data.get(at..at + 4)?.try_into().ok()?;
        Some(if little {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        } as usize)
    };
    let (Some(name_size), Some(desc_size)) = (word(0), word(4)) else {
        return Ok(None);
    };
    if name_size == 0 || desc_size == 0 {
        return Ok(None);
    }
    let align = if matches!(align, 4 | 8) { align as usize } else { 4 };
    let padded = name_size.div_ceil(align) * align;
    let trim = |b: &[u8]| -> Vec<u8> {
        let start = b.iter().position(|&c| c != 0).unwrap_or(b.len());
        let end = b.iter().rposition(|&c| c != 0).map_or(start, |e| e + 1);
        b[start..end.max(start)].to_vec()
    };
    let name = trim(data.get(12..(12 + name_size).min(data.len())).unwrap_or_default());
    if name != OWNER.as_bytes() {
        return Ok(None);
    }
    let desc = data
        .get(12 + padded..12 + padded + desc_size)
        .ok_or_else(|| bad(format!("{SECTION}: the note's description runs past the section")))?;
    serde_json::from_slice(&trim(desc)).map(Some).map_err(|e| {
        bad(format!(
            "{SECTION}: the note's description is not NVIDIA's JSON: {e}"
        ))
    })
}

fn bad(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// A section header's fields that matter here.
struct Section {
    name: u32,
    kind: u32,
    offset: u64,
    size: u64,
    align: u64,
}

struct Elf<'a> {
    file: &'a File,
    wide: bool,
    little: bool,
}

impl Elf<'_> {
    fn bytes(&self, at: u64, len: u64) -> io::Result<Vec<u8>> {
        if len > MAX_SECTION_BYTES {
            return Err(bad(format!("a section of {len} bytes at {at}: too large")));
        }
        let mut buf = vec![0; len as usize];
        self.file.read_exact_at(&mut buf, at)?;
        Ok(buf)
    }
    fn u16(&self, at: u64) -> io::Result<u16> {
        let b: [u8; 2] = self.bytes(at, 2)?.try_into().unwrap_or_default();
        Ok(if self.little {
            u16::from_le_bytes(b)
        } else {
            u16::from_be_bytes(b)
        })
    }
    fn u32(&self, at: u64) -> io::Result<u32> {
        let b: [u8; 4] = self.bytes(at, 4)?.try_into().unwrap_or_default();
        Ok(if self.little {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        })
    }
    fn u64(&self, at: u64) -> io::Result<u64> {
        let b: [u8; 8] = self.bytes(at, 8)?.try_into().unwrap_or_default();
        Ok(if self.little {
            u64::from_le_bytes(b)
        } else {
            u64::from_be_bytes(b)
        })
    }
    /// The section header at `at` (`Elf64_Shdr` or `Elf32_Shdr`).
    fn section(&self, at: u64) -> io::Result<Section> {
        Ok(if self.wide {
            Section {
                name: self.u32(at)?,
                kind: self.u32(at + 4)?,
                offset: self.u64(at + 0x18)?,
                size: self.u64(at + 0x20)?,
                align: self.u64(at + 0x30)?,
            }
        } else {
            Section {
                name: self.u32(at)?,
                kind: self.u32(at + 4)?,
                offset: u64::from(self.u32(at + 0x10)?),
                size: u64::from(self.u32(at + 0x14)?),
                align: u64::from(self.u32(at + 0x20)?),
            }
        })
    }
}

/// A minimal ELF file with the sections named, for tests here and in the crate: what `ld` would write for
/// a library, less everything the reader skips.
#[cfg(test)]
pub(crate) mod fixture {
    /// An ELF64 little-endian file whose sections are `(name, type, contents)`, after the null section and
    /// the section names.
    pub fn elf64(sections: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
        let mut names = vec![0u8];
        let mut name_at = Vec::new();
        for (name, _, _) in sections
            .iter()
            .chain(std::iter::once(&(".shstrtab", 3, Vec::new())))
        {
            name_at.push(names.len() as u32);
            names.extend_from_slice(name.as_bytes());
            names.push(0);
        }
        let mut out = vec![0u8; 64];
        out[..7].copy_from_slice(b"\x7fELF\x02\x01\x01");
        let mut headers = vec![[0u8; 64]];
        let mut add = |out: &mut Vec<u8>, name: u32, kind: u32, data: &[u8]| {
            while !out.len().is_multiple_of(8) {
                out.push(0);
            }
            let mut h = [0u8; 64];
            h[0..4].copy_from_slice(&name.to_le_bytes());
            h[4..8].copy_from_slice(&kind.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&(out.len() as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(data.len() as u64).to_le_bytes());
            h[0x30..0x38].copy_from_slice(&4u64.to_le_bytes());
            out.extend_from_slice(data);
            headers.push(h);
        };
        for (i, (_, kind, data)) in sections.iter().enumerate() {
            add(&mut out, name_at[i], *kind, data);
        }
        add(&mut out, name_at[sections.len()], 3, &names);
        while !out.len().is_multiple_of(8) {
            out.push(0);
        }
        let shoff = out.len() as u64;
        for h in &headers {
            out.extend_from_slice(h);
        }
        out[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        out[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        out[0x3c..0x3e].copy_from_slice(&(headers.len() as u16).to_le_bytes());
        out[0x3e..0x40].copy_from_slice(&((headers.len() - 1) as u16).to_le_bytes());
        out
    }

    /// One note: owner `name`, description `desc`, each padded to 4 bytes.
    pub fn note(name: &str, desc: &str) -> Vec<u8> {
        let pad = |b: &mut Vec<u8>| {
            while !b.len().is_multiple_of(4) {
                b.push(0);
            }
        };
        let mut out = Vec::new();
        out.extend_from_slice(&(name.len() as u32 + 1).to_le_bytes());
        out.extend_from_slice(&(desc.len() as u32 + 1).to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        pad(&mut out);
        out.extend_from_slice(desc.as_bytes());
        out.push(0);
        pad(&mut out);
        out
    }

    /// A compat `libcuda.so` whose note lists `branches` as the host drivers it runs on.
    pub fn compat_libcuda(branches: &[u32]) -> Vec<u8> {
        let desc =
            format!(r#"{{"Format": 1, "CUDA Version": "13.0", "Driver": {branches:?}, "Device": [0]}}"#);
        elf64(&[
            (".text", 1, vec![0x90; 16]),
            (super::SECTION, super::SHT_NOTE, note("NVIDIA Corporation", &desc)),
        ])
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::{fixture::*, *};

    fn file(bytes: &[u8]) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    #[test]
    fn the_note_gives_the_host_branches_the_compat_driver_runs_on() {
        let note = read(&file(&compat_libcuda(&[535, 550, 570]))).unwrap().unwrap();
        assert_eq!(note.driver_branches, vec![535, 550, 570]);
        assert_eq!(note.cuda_version, "13.0");
    }

    #[test]
    fn no_elf_no_section_or_another_owners_note_is_no_note() {
        assert_eq!(read(&file(b"ELF")).unwrap(), None);
        assert_eq!(read(&file(&elf64(&[(".text", 1, vec![0; 8])]))).unwrap(), None);
        let other = elf64(&[(SECTION, SHT_NOTE, note("GNU", r#"{"Driver":[580]}"#))]);
        assert_eq!(read(&file(&other)).unwrap(), None);
        // The section's name, but not a note section.
        let progbits = elf64(&[(SECTION, 1, note("NVIDIA Corporation", r#"{"Driver":[580]}"#))]);
        assert_eq!(read(&file(&progbits)).unwrap(), None);
    }

    #[test]
    fn a_real_library_without_the_section_reads_as_no_note() {
        // The host's libm: a linker's section table, notes of other owners (build id, ABI tag).
        let libm = [
            "/lib/x86_64-linux-gnu/libm.so.6",
            "/lib/aarch64-linux-gnu/libm.so.6",
            "/usr/lib64/libm.so.6",
            "/lib64/libm.so.6",
            "/usr/lib/libm.so.6",
        ]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("a glibc host has libm.so.6");
        assert_eq!(read(&File::open(libm).unwrap()).unwrap(), None);
    }

    #[test]
    fn a_note_of_nvidias_that_is_not_json_is_an_error_naming_the_section() {
        let broken = elf64(&[(SECTION, SHT_NOTE, note("NVIDIA Corporation", "{not json"))]);
        let e = read(&file(&broken)).unwrap_err().to_string();
        assert!(e.contains(SECTION), "{e}");
    }
}
