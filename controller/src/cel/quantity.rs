//! Kubernetes resource quantities (`80Gi`, `1.5`, `100m`, `1e3`), exact to the nano unit.
//!
//! Used for the CEL `quantity()` library and for the quantities tessera publishes. Values are kept as
//! `i128` nano units: the largest suffix (`Ei`, 2^60) times 10^9 still fits with room to add.

use std::{cmp::Ordering, fmt};

const NANO: i128 = 1_000_000_000;

/// A parsed quantity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Quantity {
    nanos: i128,
}

/// Why a string is not a quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not a Kubernetes quantity: {reason}")]
pub struct ParseQuantityError {
    pub input: String,
    pub reason: &'static str,
}

impl Quantity {
    /// `value` whole units.
    pub fn from_int(value: i64) -> Self {
        Self {
            nanos: value as i128 * NANO,
        }
    }

    /// Parses the Kubernetes serialization: a signed decimal number, then a binary suffix (`Ki` … `Ei`), a
    /// decimal suffix (`n`, `u`, `m`, `k`, `M`, `G`, `T`, `P`, `E`) or an exponent (`e3`, `E-2`).
    pub fn parse(input: &str) -> Result<Self, ParseQuantityError> {
        let err = |reason| ParseQuantityError {
            input: input.to_string(),
            reason,
        };
        let (negative, rest) = match input.as_bytes().first() {
            Some(b'-') => (true, &input[1..]),
            Some(b'+') => (false, &input[1..]),
            Some(_) => (false, input),
            None => return Err(err("empty")),
        };
        let number_len = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.')
            .count();
        let (number, suffix) = rest.split_at(number_len);
        let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
        if (int_part.is_empty() && frac_part.is_empty()) || frac_part.contains('.') {
            return Err(err("no number"));
        }
        // (multiplier numerator, power of ten) so that value = number * mult * 10^pow10.
        let (mult, pow10): (i128, i32) = match suffix {
            "" => (1, 0),
            "Ki" => (1 << 10, 0),
            "Mi" => (1 << 20, 0),
            "Gi" => (1 << 30, 0),
            "Ti" => (1 << 40, 0),
            "Pi" => (1 << 50, 0),
            "Ei" => (1 << 60, 0),
            "n" => (1, -9),
            "u" => (1, -6),
            "m" => (1, -3),
            "k" => (1, 3),
            "M" => (1, 6),
            "G" => (1, 9),
            "T" => (1, 12),
            "P" => (1, 15),
            "E" => (1, 18),
            s if s.starts_with(['e', 'E']) => {
                let exp: i32 = s[1..].parse().map_err(|_| err("malformed exponent"))?;
                if !(-30..=30).contains(&exp) {
                    return Err(err("exponent out of range"));
                }
                (1, exp)
            }
            _ => return Err(err("unknown suffix")),
        };
        let digits = format!("{int_part}{frac_part}");
        if digits.len() > 30 {
            return Err(err("too many digits"));
        }
        let mantissa: i128 = if digits.is_empty() {
            0
        } else {
            digits.parse().map_err(|_| err("no number"))?
        };
        // value in nanos = mantissa * mult * 10^(pow10 + 9 - frac_len)
        let scale = pow10 + 9 - frac_part.len() as i32;
        let mut nanos = mantissa.checked_mul(mult).ok_or_else(|| err("too large"))?;
        if scale >= 0 {
            nanos = 10i128
                .checked_pow(scale as u32)
                .and_then(|p| nanos.checked_mul(p))
                .ok_or_else(|| err("too large"))?;
        } else {
            // Kubernetes rounds sub-nano precision up.
            let p = 10i128.pow((-scale) as u32);
            nanos = nanos / p + i128::from(nanos % p != 0);
        }
        if nanos > (i64::MAX as i128) * NANO * 1024 {
            return Err(err("too large"));
        }
        Ok(Self {
            nanos: if negative { -nanos } else { nanos },
        })
    }

    /// True when the quantity is a whole number of units.
    pub fn is_integer(&self) -> bool {
        self.nanos % NANO == 0
    }

    /// The whole number of units, when it is one and fits an `i64`.
    pub fn as_integer(&self) -> Option<i64> {
        self.is_integer()
            .then(|| i64::try_from(self.nanos / NANO).ok())
            .flatten()
    }

    pub fn as_approximate_float(&self) -> f64 {
        self.nanos as f64 / NANO as f64
    }

    pub fn sign(&self) -> i64 {
        self.nanos.signum() as i64
    }

    pub fn checked_add(&self, other: &Self) -> Option<Self> {
        self.nanos.checked_add(other.nanos).map(|nanos| Self { nanos })
    }

    pub fn checked_sub(&self, other: &Self) -> Option<Self> {
        self.nanos.checked_sub(other.nanos).map(|nanos| Self { nanos })
    }

    pub fn compare(&self, other: &Self) -> Ordering {
        self.nanos.cmp(&other.nanos)
    }
}

impl fmt::Display for Quantity {
    /// Integers print with the largest exact binary suffix from `Ki` on (`80Gi`, `9984Mi`), as the API
    /// server prints quantities given that way; anything else prints as a plain decimal.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(v) = self.as_integer() {
            return f.write_str(&format_binary(v));
        }
        let whole = self.nanos / NANO;
        let frac = (self.nanos % NANO).abs();
        let sign = if self.nanos < 0 && whole == 0 { "-" } else { "" };
        let frac = format!("{frac:09}");
        write!(f, "{sign}{whole}.{}", frac.trim_end_matches('0'))
    }
}

/// `value` with the largest binary suffix that keeps it exact (`85899345920` → `80Gi`); values that are not
/// multiples of 1024 stay plain.
pub fn format_binary(value: i64) -> String {
    const SUFFIXES: [&str; 6] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    if value == 0 {
        return "0".into();
    }
    let mut v = value;
    let mut suffix = "";
    for s in SUFFIXES {
        if v % 1024 != 0 {
            break;
        }
        v /= 1024;
        suffix = s;
    }
    format!("{v}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    #[test]
    fn binary_and_decimal_suffixes_scale_as_kubernetes_does() {
        assert_eq!(q("40Gi").as_integer(), Some(40 << 30));
        assert_eq!(q("1Ki").as_integer(), Some(1024));
        assert_eq!(q("1k").as_integer(), Some(1000));
        assert_eq!(q("1.5G").as_integer(), Some(1_500_000_000));
        assert_eq!(q("1e3").as_integer(), Some(1000));
        assert_eq!(q("+7").as_integer(), Some(7));
        assert_eq!(q("-2Mi").as_integer(), Some(-(2 << 20)));
        assert_eq!(q(".5").as_integer(), None);
        assert!(!q("100m").is_integer());
        assert_eq!(q("100m").as_approximate_float(), 0.1);
    }

    #[test]
    fn equal_amounts_compare_equal_whatever_their_spelling() {
        assert_eq!(q("1Gi").compare(&q("1024Mi")), Ordering::Equal);
        assert_eq!(q("1G").compare(&q("1Gi")), Ordering::Less);
        assert_eq!(q("0.5").compare(&q("500m")), Ordering::Equal);
    }

    #[test]
    fn malformed_quantities_are_rejected() {
        for bad in ["", "Gi", "1.2.3", "1GB", "1 Gi", "1e", "--1", "1e99"] {
            assert!(Quantity::parse(bad).is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn integers_print_with_the_largest_exact_binary_suffix() {
        assert_eq!(q("85899345920").to_string(), "80Gi");
        assert_eq!(format_binary(9984 << 20), "9984Mi");
        assert_eq!(format_binary(1000), "1000");
        assert_eq!(q("100m").to_string(), "0.1");
        assert_eq!(q("1").checked_add(&q("500m")).unwrap().to_string(), "1.5");
    }
}
