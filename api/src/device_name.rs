//! How tessera spells device names in ResourceSlices, and how the plugin reads them back from allocations.
//!
//! | Device | Name | Example |
//! |---|---|---|
//! | whole GPU | `gpu-<index>` | `gpu-3` |
//! | MIG placement (dynamic or static) | `gpu-<index>-mig-<profile>-<start>` | `gpu-3-mig-3g-40gb-4` |
//! | shared GPU (consumable capacity) | `gpu-<index>-shared` | `gpu-3-shared` |
//! | shared MIG placement | `gpu-<index>-mig-<profile>-<start>-shared` | `gpu-0-mig-3g-40gb-0-shared` |
//! | fixed share slot (fallback without consumable capacity) | `gpu-<index>-share-<slot>` | `gpu-3-share-2` |
//!
//! A profile name such as `1g.10gb+me` is written with `-` for `.`, `-plus-` for `+` and `-minus-` for
//! `-`, so the name stays a DNS label (lowercase alphanumerics and `-`, at most 63) and parses back
//! exactly.

use std::{fmt, str::FromStr};

/// Longest device name the API server accepts (a DNS label).
pub const MAX_DEVICE_NAME_LEN: usize = 63;

/// A device published by tessera, identified by what the plugin needs to prepare it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceName {
    /// A whole GPU.
    Gpu { gpu: u32 },
    /// A MIG GPU instance of `profile` starting at memory slice `start`.
    Mig { gpu: u32, profile: String, start: u32 },
    /// A whole GPU shared between claims through consumable capacity.
    SharedGpu { gpu: u32 },
    /// A MIG placement shared between claims through consumable capacity.
    SharedMig { gpu: u32, profile: String, start: u32 },
    /// One of a fixed number of equal share slots of a GPU.
    ShareSlot { gpu: u32, slot: u32 },
}

/// Why a string is not a tessera device name.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{name:?} is not a tessera device name: {reason}")]
pub struct ParseDeviceNameError {
    pub name: String,
    pub reason: &'static str,
}

impl DeviceName {
    /// The index of the physical GPU this device lives on.
    pub fn gpu(&self) -> u32 {
        match self {
            Self::Gpu { gpu }
            | Self::Mig { gpu, .. }
            | Self::SharedGpu { gpu }
            | Self::SharedMig { gpu, .. }
            | Self::ShareSlot { gpu, .. } => *gpu,
        }
    }

    /// True for devices several claims may hold at once.
    pub fn is_shared(&self) -> bool {
        matches!(
            self,
            Self::SharedGpu { .. } | Self::SharedMig { .. } | Self::ShareSlot { .. }
        )
    }
}

/// Encodes a MIG profile name (`1g.10gb+me`) as DNS-label tokens (`1g-10gb-plus-me`).
pub fn encode_profile(profile: &str) -> String {
    let mut out = String::with_capacity(profile.len() + 8);
    for c in profile.chars() {
        match c {
            '.' => out.push('-'),
            '+' => out.push_str("-plus-"),
            '-' => out.push_str("-minus-"),
            c => out.push(c.to_ascii_lowercase()),
        }
    }
    out
}

/// Inverse of [`encode_profile`].
pub fn decode_profile(encoded: &str) -> Option<String> {
    let mut out = String::with_capacity(encoded.len());
    let mut pending_sep: Option<char> = None;
    for token in encoded.split('-') {
        match token {
            "" => return None,
            "plus" => pending_sep = Some('+'),
            "minus" => pending_sep = Some('-'),
            t => {
                if !out.is_empty() {
                    out.push(pending_sep.unwrap_or('.'));
                } else if pending_sep.is_some() {
                    return None;
                }
                pending_sep = None;
                out.push_str(t);
            }
        }
    }
    (pending_sep.is_none() && !out.is_empty()).then_some(out)
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gpu { gpu } => write!(f, "gpu-{gpu}"),
            Self::Mig { gpu, profile, start } => {
                write!(f, "gpu-{gpu}-mig-{}-{start}", encode_profile(profile))
            }
            Self::SharedGpu { gpu } => write!(f, "gpu-{gpu}-shared"),
            Self::SharedMig { gpu, profile, start } => {
                write!(f, "gpu-{gpu}-mig-{}-{start}-shared", encode_profile(profile))
            }
            Self::ShareSlot { gpu, slot } => write!(f, "gpu-{gpu}-share-{slot}"),
        }
    }
}

fn parse_u32(s: &str) -> Option<u32> {
    // Leading zeros would give two names for one device.
    if s.is_empty() || (s.len() > 1 && s.starts_with('0')) || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

impl FromStr for DeviceName {
    type Err = ParseDeviceNameError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        let err = |reason| ParseDeviceNameError {
            name: name.to_string(),
            reason,
        };
        let rest = name
            .strip_prefix("gpu-")
            .ok_or_else(|| err("does not start with \"gpu-\""))?;
        let (index, rest) = match rest.split_once('-') {
            Some((i, r)) => (i, Some(r)),
            None => (rest, None),
        };
        let gpu = parse_u32(index).ok_or_else(|| err("GPU index is not a number"))?;
        let Some(rest) = rest else {
            return Ok(Self::Gpu { gpu });
        };
        if rest == "shared" {
            return Ok(Self::SharedGpu { gpu });
        }
        if let Some(slot) = rest.strip_prefix("share-") {
            let slot = parse_u32(slot).ok_or_else(|| err("share slot is not a number"))?;
            return Ok(Self::ShareSlot { gpu, slot });
        }
        let mig = rest
            .strip_prefix("mig-")
            .ok_or_else(|| err("unknown device kind after the GPU index"))?;
        let (mig, shared) = match mig.strip_suffix("-shared") {
            Some(m) => (m, true),
            None => (mig, false),
        };
        let (profile, start) = mig
            .rsplit_once('-')
            .ok_or_else(|| err("MIG device without a placement"))?;
        let start = parse_u32(start).ok_or_else(|| err("MIG placement start is not a number"))?;
        let profile = decode_profile(profile).ok_or_else(|| err("malformed MIG profile"))?;
        Ok(if shared {
            Self::SharedMig { gpu, profile, start }
        } else {
            Self::Mig { gpu, profile, start }
        })
    }
}

/// True when `s` is a valid DNS label (RFC 1123): what the API server requires of a device name.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_DEVICE_NAME_LEN
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_kinds(profile: &str) -> Vec<DeviceName> {
        vec![
            DeviceName::Gpu { gpu: 7 },
            DeviceName::Mig {
                gpu: 0,
                profile: profile.into(),
                start: 6,
            },
            DeviceName::SharedGpu { gpu: 12 },
            DeviceName::SharedMig {
                gpu: 1,
                profile: profile.into(),
                start: 4,
            },
            DeviceName::ShareSlot { gpu: 3, slot: 10 },
        ]
    }

    #[test]
    fn every_device_name_round_trips_and_is_a_dns_label() {
        for profile in [
            "1g.10gb",
            "1g.10gb+me",
            "7g.141gb",
            "1g.18gb+me.all",
            "2g.24gb-me",
            "4g.90gb+gfx",
        ] {
            for d in all_kinds(profile) {
                let s = d.to_string();
                assert!(is_dns_label(&s), "{s} is not a DNS label");
                assert_eq!(s.parse::<DeviceName>().unwrap(), d, "{s} did not round-trip");
            }
        }
    }

    #[test]
    fn mig_names_read_like_nvidia_smi_profiles() {
        let d = DeviceName::Mig {
            gpu: 3,
            profile: "3g.40gb".into(),
            start: 4,
        };
        assert_eq!(d.to_string(), "gpu-3-mig-3g-40gb-4");
        let d = DeviceName::Mig {
            gpu: 0,
            profile: "1g.10gb+me".into(),
            start: 2,
        };
        assert_eq!(d.to_string(), "gpu-0-mig-1g-10gb-plus-me-2");
    }

    #[test]
    fn malformed_names_are_rejected_with_a_reason() {
        for bad in [
            "",
            "gpu",
            "gpu-",
            "gpu-x",
            "gpu-01",
            "gpu-1-mig",
            "gpu-1-mig-3g-40gb",
            "gpu-1-mig-3g-40gb-x",
            "gpu-1-mig--3g-0",
            "gpu-1-mig-plus-3g-0",
            "gpu-1-mig-3g-plus-0",
            "gpu-1-share-",
            "gpu-1-whatever",
            "nic-0",
        ] {
            let e = bad.parse::<DeviceName>().expect_err(bad);
            assert_eq!(e.name, bad);
            assert!(!e.reason.is_empty());
        }
    }

    #[test]
    fn dns_label_check_rejects_uppercase_dots_and_long_names() {
        assert!(is_dns_label("gpu-0"));
        assert!(!is_dns_label("GPU-0"));
        assert!(!is_dns_label("gpu.0"));
        assert!(!is_dns_label("-gpu"));
        assert!(!is_dns_label(&"a".repeat(64)));
    }
}
