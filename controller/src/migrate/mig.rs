//! MIG profile names across GPU models: a profile written for one model (A100 40GB's `1g.5gb`) named as the
//! profile of the target model that has the same share of the GPU's memory slices and at least its compute
//! slices.
//!
//! A profile's name is `<compute slices>g.<memory>gb`, and the memory in the name differs per model, so the
//! memory-slice count (of 8 on all these models but the A30's 4) is what carries over. The tables are the
//! profiles NVIDIA's MIG user guide lists per model ("Supported MIG Profiles").

use std::fmt;

/// A GPU model whose MIG profiles the tables know.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MigModel {
    #[value(name = "a30-24gb")]
    A30,
    #[value(name = "a100-40gb")]
    A100_40,
    #[value(name = "a100-80gb")]
    A100_80,
    #[value(name = "h100-80gb")]
    H100_80,
    #[value(name = "h100-94gb")]
    H100_94,
    #[value(name = "h100-96gb")]
    H100_96,
    #[value(name = "h200-141gb")]
    H200,
    #[value(name = "b200-180gb")]
    B200,
}

/// One profile: its name, compute slices and memory slices.
struct Profile {
    name: &'static str,
    compute: u32,
    memory: u32,
}

const fn p(name: &'static str, compute: u32, memory: u32) -> Profile {
    Profile {
        name,
        compute,
        memory,
    }
}

/// The profiles of an 8-memory-slice model whose smallest slice is `one`, `two` the 2-slice memory size and
/// so on (`+me` adds the media engines to the smallest profile).
macro_rules! eight {
    ($one:literal, $one_me:literal, $two1:literal, $two2:literal, $four3:literal, $four4:literal, $eight:literal) => {{
        const TABLE: &[Profile] = &[
            p($one, 1, 1),
            p($one_me, 1, 1),
            p($two1, 1, 2),
            p($two2, 2, 2),
            p($four3, 3, 4),
            p($four4, 4, 4),
            p($eight, 7, 8),
        ];
        TABLE
    }};
}

impl MigModel {
    /// Every model, in the order readings of an ambiguous name are listed.
    pub const ALL: [MigModel; 8] = [
        Self::A100_40,
        Self::A100_80,
        Self::H100_80,
        Self::H100_94,
        Self::H100_96,
        Self::H200,
        Self::B200,
        Self::A30,
    ];

    fn profiles(self) -> &'static [Profile] {
        match self {
            Self::A30 => {
                const TABLE: &[Profile] = &[
                    p("1g.6gb", 1, 1),
                    p("1g.6gb+me", 1, 1),
                    p("2g.12gb", 2, 2),
                    p("2g.12gb+me", 2, 2),
                    p("4g.24gb", 4, 4),
                ];
                TABLE
            }
            Self::A100_40 => eight!(
                "1g.5gb",
                "1g.5gb+me",
                "1g.10gb",
                "2g.10gb",
                "3g.20gb",
                "4g.20gb",
                "7g.40gb"
            ),
            Self::A100_80 | Self::H100_80 => eight!(
                "1g.10gb",
                "1g.10gb+me",
                "1g.20gb",
                "2g.20gb",
                "3g.40gb",
                "4g.40gb",
                "7g.80gb"
            ),
            Self::H100_94 => eight!(
                "1g.12gb",
                "1g.12gb+me",
                "1g.24gb",
                "2g.24gb",
                "3g.47gb",
                "4g.47gb",
                "7g.94gb"
            ),
            Self::H100_96 => eight!(
                "1g.12gb",
                "1g.12gb+me",
                "1g.24gb",
                "2g.24gb",
                "3g.48gb",
                "4g.48gb",
                "7g.96gb"
            ),
            Self::H200 => eight!(
                "1g.18gb",
                "1g.18gb+me",
                "1g.35gb",
                "2g.35gb",
                "3g.71gb",
                "4g.71gb",
                "7g.141gb"
            ),
            Self::B200 => eight!(
                "1g.23gb",
                "1g.23gb+me",
                "1g.45gb",
                "2g.45gb",
                "3g.90gb",
                "4g.90gb",
                "7g.180gb"
            ),
        }
    }

    /// Memory slices of the whole GPU.
    fn memory_slices(self) -> u32 {
        if self == Self::A30 { 4 } else { 8 }
    }

    /// Compute slices of the whole GPU.
    fn compute_slices(self) -> u32 {
        if self == Self::A30 { 4 } else { 7 }
    }

    /// True when `profile` is one of this model's names.
    pub fn has(self, profile: &str) -> bool {
        self.profiles().iter().any(|p| p.name == profile)
    }
}

impl fmt::Display for MigModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::A30 => "A30 24GB",
            Self::A100_40 => "A100 40GB",
            Self::A100_80 => "A100 80GB",
            Self::H100_80 => "H100 80GB",
            Self::H100_94 => "H100 94GB",
            Self::H100_96 => "H100 96GB",
            Self::H200 => "H200 141GB",
            Self::B200 => "B200 180GB",
        })
    }
}

/// What a profile name becomes on the target model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mapped {
    /// The target has the name: nothing to do.
    Same,
    /// The target's profile for it, and why.
    To { profile: String, why: String },
    /// No known model has the name, or the target has nothing as large.
    Unknown { why: String },
}

/// True when `s` reads as a MIG profile name (`1g.5gb`, `3g.40gb+me`).
pub fn looks_like_profile(s: &str) -> bool {
    let base = s.split('+').next().unwrap_or(s);
    let Some((g, mem)) = base.split_once("g.") else {
        return false;
    };
    !g.is_empty()
        && g.bytes().all(|b| b.is_ascii_digit())
        && mem
            .strip_suffix("gb")
            .is_some_and(|m| !m.is_empty() && m.bytes().all(|b| b.is_ascii_digit()))
}

/// `profile` as the target model names it. Among the models that know the name, the reading with the most
/// memory wins (a claim never gets less memory than it asked for on any of them); the others are named in
/// `why`.
pub fn map_profile(profile: &str, target: MigModel) -> Mapped {
    if target.has(profile) {
        return Mapped::Same;
    }
    let readings: Vec<(MigModel, &Profile)> = MigModel::ALL
        .iter()
        .filter_map(|&m| m.profiles().iter().find(|p| p.name == profile).map(|p| (m, p)))
        .collect();
    // Eighths of the GPU's memory, so an A30's quarters compare with the rest; compute slices as named (the
    // target's profile has at least as many).
    let eighths = |m: MigModel, p: &Profile| (p.memory * 8).div_ceil(m.memory_slices());
    let sevenths = |_: MigModel, p: &Profile| p.compute;
    let Some(&(model, source)) = readings
        .iter()
        .max_by_key(|(m, p)| (eighths(*m, p), sevenths(*m, p)))
    else {
        return Mapped::Unknown {
            why: format!("{profile} is no MIG profile of the models known ({})", known()),
        };
    };
    let (memory, compute) = (eighths(model, source), sevenths(model, source));
    let media = profile.ends_with("+me");
    let pick = target
        .profiles()
        .iter()
        .filter(|t| t.name.ends_with("+me") == media)
        .filter(|t| t.memory * 8 / target.memory_slices() == memory && t.compute >= compute)
        .min_by_key(|t| t.compute);
    let of = |m: MigModel, p: &Profile| {
        format!(
            "{} of {} memory slices and {} of {} compute slices on {m}",
            p.memory,
            m.memory_slices(),
            p.compute,
            m.compute_slices()
        )
    };
    let mut why = format!("{profile} is {}", of(model, source));
    let others: Vec<String> = readings
        .iter()
        .filter(|(m, p)| (eighths(*m, p), sevenths(*m, p)) != (memory, compute))
        .map(|(m, p)| of(*m, p))
        .collect();
    if !others.is_empty() {
        why.push_str(&format!(
            " (the larger reading; it is {} elsewhere)",
            others.join(", ")
        ));
    }
    match pick {
        Some(t) => Mapped::To {
            profile: t.name.to_string(),
            why: format!("{why}; on {target} that is {} ({})", t.name, of(target, t)),
        },
        None => Mapped::Unknown {
            why: format!("{why}; {target} has no profile with that share of memory and compute"),
        },
    }
}

fn known() -> String {
    MigModel::ALL
        .iter()
        .map(|m| m.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to(profile: &str, target: MigModel) -> String {
        match map_profile(profile, target) {
            Mapped::To { profile, .. } => profile,
            other => panic!("{profile}: {other:?}"),
        }
    }

    #[test]
    fn an_a100_40gb_profile_becomes_the_h100_profile_with_as_many_memory_slices() {
        assert_eq!(to("1g.5gb", MigModel::H100_80), "1g.10gb");
        assert_eq!(to("2g.10gb", MigModel::H100_80), "2g.20gb");
        assert_eq!(to("3g.20gb", MigModel::H100_80), "3g.40gb");
        assert_eq!(to("4g.20gb", MigModel::H100_80), "4g.40gb");
        assert_eq!(to("7g.40gb", MigModel::H100_80), "7g.80gb");
        assert_eq!(to("1g.5gb+me", MigModel::H100_80), "1g.10gb+me");
    }

    #[test]
    fn a_name_the_target_has_stays_although_another_model_reads_it_otherwise() {
        // 1g.10gb is 2 slices on an A100 40GB but the H100 80GB's own 1-slice profile.
        assert_eq!(map_profile("1g.10gb", MigModel::H100_80), Mapped::Same);
    }

    #[test]
    fn an_ambiguous_name_takes_the_reading_with_more_memory_and_says_so() {
        let Mapped::To { profile, why } = map_profile("1g.10gb", MigModel::H200) else {
            panic!()
        };
        assert_eq!(profile, "1g.35gb");
        assert!(
            why.contains("2 of 8 memory slices") && why.contains("elsewhere"),
            "{why}"
        );
    }

    #[test]
    fn an_a30_quarter_becomes_two_eighths() {
        assert_eq!(to("1g.6gb", MigModel::H100_80), "1g.20gb");
        assert_eq!(to("2g.12gb", MigModel::H100_80), "3g.40gb");
        assert_eq!(to("4g.24gb", MigModel::H100_80), "7g.80gb");
    }

    #[test]
    fn an_unknown_profile_is_not_guessed() {
        assert!(matches!(
            map_profile("5g.50gb", MigModel::H100_80),
            Mapped::Unknown { .. }
        ));
        assert!(looks_like_profile("5g.50gb") && looks_like_profile("1g.5gb+me"));
        assert!(!looks_like_profile("gpu") && !looks_like_profile("1g.") && !looks_like_profile("g.5gb"));
    }
}
