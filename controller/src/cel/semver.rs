//! Semantic versions as the Kubernetes CEL `semver()` library and `version` attributes use them.

use std::{cmp::Ordering, fmt};

/// A semver 2.0.0 version. Build metadata is kept but ignored in comparisons.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Semver {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
    pub pre: Vec<String>,
    pub build: Vec<String>,
}

/// Why a string is not a semantic version.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not a semantic version: {reason}")]
pub struct ParseSemverError {
    pub input: String,
    pub reason: &'static str,
}

fn numeric(s: &str, strict: bool) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (strict && s.len() > 1 && s.starts_with('0'))
    {
        return None;
    }
    s.parse().ok()
}

fn identifiers(s: &str) -> Option<Vec<String>> {
    let ids: Vec<String> = s.split('.').map(str::to_string).collect();
    ids.iter()
        .all(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
        .then_some(ids)
}

impl Semver {
    /// Strict semver 2.0.0 (what `semver("1.2.3")` and a ResourceSlice `version` attribute accept).
    pub fn parse(input: &str) -> Result<Self, ParseSemverError> {
        Self::parse_inner(input, false)
    }

    /// Lenient form of `semver(s, true)`: a leading `v`, missing minor/patch and leading zeros are accepted
    /// (`v1.02` → `1.2.0`). Also how tessera turns driver-reported versions (`580.159.03`, `9.0`) into
    /// attributes.
    pub fn parse_normalized(input: &str) -> Result<Self, ParseSemverError> {
        Self::parse_inner(input.strip_prefix('v').unwrap_or(input), true)
    }

    fn parse_inner(input: &str, normalize: bool) -> Result<Self, ParseSemverError> {
        let err = |reason| ParseSemverError {
            input: input.to_string(),
            reason,
        };
        let (rest, build) = match input.split_once('+') {
            Some((r, b)) => (r, identifiers(b).ok_or_else(|| err("malformed build metadata"))?),
            None => (input, vec![]),
        };
        let (core, pre) = match rest.split_once('-') {
            Some((c, p)) => (c, identifiers(p).ok_or_else(|| err("malformed pre-release"))?),
            None => (rest, vec![]),
        };
        if pre
            .iter()
            .any(|id| id.bytes().all(|b| b.is_ascii_digit()) && id.len() > 1 && id.starts_with('0'))
        {
            return Err(err("numeric pre-release identifier with a leading zero"));
        }
        let mut parts = core.split('.');
        let mut next = |required: bool| -> Result<u64, ParseSemverError> {
            match parts.next() {
                Some(p) => {
                    numeric(p, !normalize).ok_or_else(|| err("version numbers must be decimal integers"))
                }
                None if !required => Ok(0),
                None => Err(err("expected major.minor.patch")),
            }
        };
        let major = next(true)?;
        let minor = next(!normalize)?;
        let patch = next(!normalize)?;
        if parts.next().is_some() {
            return Err(err("more than three version numbers"));
        }
        Ok(Self {
            major,
            minor,
            patch,
            pre,
            build,
        })
    }

    /// Semver precedence.
    pub fn compare(&self, other: &Self) -> Ordering {
        (self.major, self.minor, self.patch)
            .cmp(&(other.major, other.minor, other.patch))
            .then_with(|| match (self.pre.is_empty(), other.pre.is_empty()) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) => {
                    for (a, b) in self.pre.iter().zip(&other.pre) {
                        let ord = match (a.parse::<u64>(), b.parse::<u64>()) {
                            (Ok(x), Ok(y)) => x.cmp(&y),
                            (Ok(_), Err(_)) => Ordering::Less,
                            (Err(_), Ok(_)) => Ordering::Greater,
                            (Err(_), Err(_)) => a.cmp(b),
                        };
                        if ord != Ordering::Equal {
                            return ord;
                        }
                    }
                    self.pre.len().cmp(&other.pre.len())
                }
            })
    }
}

impl fmt::Display for Semver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)?;
        if !self.pre.is_empty() {
            write!(f, "-{}", self.pre.join("."))?;
        }
        if !self.build.is_empty() {
            write!(f, "+{}", self.build.join("."))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Semver {
        Semver::parse(s).unwrap()
    }

    #[test]
    fn precedence_follows_semver_two() {
        let order = [
            "1.0.0-alpha",
            "1.0.0-alpha.1",
            "1.0.0-alpha.beta",
            "1.0.0-beta",
            "1.0.0-beta.2",
            "1.0.0-beta.11",
            "1.0.0-rc.1",
            "1.0.0",
            "1.0.1",
            "1.10.0",
            "550.0.0",
        ];
        for pair in order.windows(2) {
            assert_eq!(
                v(pair[0]).compare(&v(pair[1])),
                Ordering::Less,
                "{} < {}",
                pair[0],
                pair[1]
            );
        }
        assert_eq!(v("1.0.0+build.1").compare(&v("1.0.0")), Ordering::Equal);
    }

    #[test]
    fn strict_parsing_rejects_what_the_api_server_rejects() {
        for bad in [
            "", "1", "1.2", "v1.2.3", "01.2.3", "1.2.3.4", "1.2.x", "1.2.3-", "1.2.3-01",
        ] {
            assert!(Semver::parse(bad).is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn driver_versions_normalize_to_strict_semver() {
        assert_eq!(
            Semver::parse_normalized("580.159.03").unwrap().to_string(),
            "580.159.3"
        );
        assert_eq!(Semver::parse_normalized("9.0").unwrap().to_string(), "9.0.0");
        assert_eq!(Semver::parse_normalized("v13").unwrap().to_string(), "13.0.0");
    }
}
