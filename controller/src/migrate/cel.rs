//! CEL selectors over NVIDIA's attributes rewritten for tessera's, token by token: only string literals
//! and the attribute names that follow `attributes["gpu.nvidia.com"]` / `capacity["gpu.nvidia.com"]`
//! change, so an identifier or a literal that merely contains the text is left alone, and everything
//! between the tokens (spacing, comments, line breaks) is kept as written.

use super::mig::{Mapped, MigModel, looks_like_profile, map_profile};
use super::{NVIDIA_DRIVER, TESSERA_DRIVER};

/// What the rewriter knows of where an expression sits.
#[derive(Clone, Copy, Debug)]
pub struct Context {
    /// The expression selects MIG devices (`mig.nvidia.com` or a `type == "mig"` class): there NVIDIA's
    /// `uuid` is the MIG device's own.
    pub mig: bool,
    /// The request moved to tessera's share class, whose devices have `type == "shared"`.
    pub shared: bool,
    /// The model MIG profile names are given for.
    pub target: MigModel,
}

/// The rewritten expression, what changed and what could not be translated.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rewrite {
    pub expression: String,
    pub changes: Vec<String>,
    pub problems: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Kind {
    /// A string literal, decoded; `open` is its prefix and opening quote, `close` its closing quote.
    Str {
        value: String,
        open: String,
        close: String,
    },
    Ident(String),
    Punct(char),
    Other,
}

#[derive(Clone, Debug)]
struct Token {
    kind: Kind,
    start: usize,
    end: usize,
}

/// Splits `src` into tokens; `Err` names the first thing that does not lex (an unterminated string).
fn tokens(src: &str) -> Result<Vec<Token>, String> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if src[i..].starts_with("//") {
            i = src[i..].find('\n').map_or(b.len(), |n| i + n);
            continue;
        }
        let start = i;
        // String prefixes: r/R raw, b/B bytes, in either order.
        let mut j = i;
        let mut raw = false;
        while j < b.len() && j - i < 2 && matches!(b[j], b'r' | b'R' | b'b' | b'B') {
            raw |= matches!(b[j], b'r' | b'R');
            j += 1;
        }
        if j < b.len() && matches!(b[j], b'"' | b'\'') {
            let q = b[j] as char;
            let triple: String = std::iter::repeat_n(q, 3).collect();
            let close = if src[j..].starts_with(&triple) {
                triple
            } else {
                q.to_string()
            };
            let body = j + close.len();
            let mut k = body;
            let mut value = String::new();
            loop {
                if k >= b.len() {
                    return Err(format!("unterminated string starting at {start}"));
                }
                if src[k..].starts_with(&close) {
                    break;
                }
                let ch = src[k..].chars().next().expect("k is on a char boundary");
                if ch == '\\' && !raw {
                    let next = src[k + 1..]
                        .chars()
                        .next()
                        .ok_or_else(|| format!("unterminated string starting at {start}"))?;
                    value.push(match next {
                        'n' => '\n',
                        't' => '\t',
                        'r' => '\r',
                        other => other,
                    });
                    k += 1 + next.len_utf8();
                    continue;
                }
                if close.len() == 1 && ch == '\n' {
                    return Err(format!("unterminated string starting at {start}"));
                }
                value.push(ch);
                k += ch.len_utf8();
            }
            let end = k + close.len();
            out.push(Token {
                kind: Kind::Str {
                    value,
                    open: src[start..body].to_string(),
                    close,
                },
                start,
                end,
            });
            i = end;
            continue;
        }
        if c.is_ascii_alphabetic() || c == b'_' {
            let mut k = i;
            while k < b.len() && (b[k].is_ascii_alphanumeric() || b[k] == b'_') {
                k += 1;
            }
            out.push(Token {
                kind: Kind::Ident(src[i..k].to_string()),
                start,
                end: k,
            });
            i = k;
            continue;
        }
        if c.is_ascii_digit() {
            let mut k = i;
            while k < b.len() && (b[k].is_ascii_alphanumeric() || b[k] == b'.') {
                k += 1;
            }
            out.push(Token {
                kind: Kind::Other,
                start,
                end: k,
            });
            i = k;
            continue;
        }
        let ch = src[i..].chars().next().expect("i is on a char boundary");
        out.push(Token {
            kind: Kind::Punct(ch),
            start,
            end: i + ch.len_utf8(),
        });
        i += ch.len_utf8();
    }
    Ok(out)
}

/// Attribute names tessera publishes under the same name and meaning as NVIDIA's driver.
const SAME_ATTRIBUTES: &[&str] = &[
    "type",
    "uuid",
    "productName",
    "brand",
    "architecture",
    "cudaComputeCapability",
    "driverVersion",
    "cudaDriverVersion",
    "index",
    "minor",
    "profile",
];

/// Capacity names tessera publishes under the same name and unit (bytes of memory, counts of engines).
const SAME_CAPACITIES: &[&str] = &[
    "memory",
    "multiprocessors",
    "copyEngines",
    "decoders",
    "encoders",
    "jpegEngines",
    "ofaEngines",
];

/// tessera's name for NVIDIA's attribute `name`: `Ok(None)` when it is the same, `Err` why there is none.
pub fn attribute(name: &str, mig: bool) -> Result<Option<&'static str>, String> {
    match name {
        "parentUUID" => Ok(Some("uuid")),
        "uuid" if mig => Err(
            "uuid of a MIG device is the MIG device's own UUID in NVIDIA's driver; tessera makes the MIG \
             device at prepare, so it has none to select on: select the GPU by uuid (tessera's MIG devices \
             carry their GPU's) or a placement by profile and placementStart"
                .into(),
        ),
        n if SAME_ATTRIBUTES.contains(&n) => Ok(None),
        "addressingMode" => Err("tessera publishes no addressingMode attribute".into()),
        other => Err(format!("tessera publishes no attribute {other:?}")),
    }
}

fn capacity(name: &str) -> Result<(), String> {
    match name {
        n if SAME_CAPACITIES.contains(&n) => Ok(()),
        "shares" => Err(
            "tessera's shares have no \"shares\" capacity: request memory and compute of \
             shared.gpu.tessera.dev"
                .into(),
        ),
        n if n.starts_with("memorySlice") => Err(format!(
            "tessera publishes no {n:?} capacity: a MIG placement's first memory slice is the \
             placementStart attribute"
        )),
        other => Err(format!("tessera publishes no capacity {other:?}")),
    }
}

/// Rewrites one expression; an expression that does not lex is returned as written, with the reason.
pub fn rewrite(src: &str, ctx: Context) -> Rewrite {
    let toks = match tokens(src) {
        Ok(t) => t,
        Err(e) => {
            return Rewrite {
                expression: src.to_string(),
                changes: vec![],
                problems: vec![format!("cannot read the expression ({e}); left as written")],
            };
        }
    };
    // Replacements by token index.
    let mut replace: Vec<Option<String>> = vec![None; toks.len()];
    let mut changes = Vec::new();
    let mut problems = Vec::new();
    let mut profile_used = false;
    let mut type_used = false;
    let is = |i: usize, c: char| toks.get(i).is_some_and(|t| t.kind == Kind::Punct(c));
    let str_at = |i: usize| match toks.get(i).map(|t| &t.kind) {
        Some(Kind::Str { value, .. }) => Some(value.as_str()),
        _ => None,
    };
    for i in 0..toks.len() {
        let Kind::Ident(head) = &toks[i].kind else {
            continue;
        };
        let attrs = head == "attributes";
        if !(attrs || head == "capacity") || !is(i + 1, '[') || !is(i + 3, ']') {
            continue;
        }
        let Some(domain) = str_at(i + 2) else { continue };
        // The name after the domain: `.name` or `["name"]`.
        let name = match (toks.get(i + 5).map(|t| &t.kind), is(i + 4, '.'), is(i + 4, '[')) {
            (Some(Kind::Ident(n)), true, _) => Some((i + 5, n.as_str(), false)),
            (Some(Kind::Str { value, .. }), _, true) if is(i + 6, ']') => Some((i + 5, value.as_str(), true)),
            _ => None,
        };
        if domain == TESSERA_DRIVER {
            profile_used |= attrs && name.is_some_and(|(_, n, _)| n == "profile");
            continue;
        }
        if domain != NVIDIA_DRIVER {
            continue;
        }
        let Some((at, name, quoted)) = name else {
            problems.push(format!(
                "{head}[{NVIDIA_DRIVER:?}] is used without a name after it; its names are not checked"
            ));
            continue;
        };
        if attrs {
            match attribute(name, ctx.mig) {
                Ok(Some(new)) => {
                    replace[at] = Some(if quoted {
                        requote(&toks[at].kind, new)
                    } else {
                        new.to_string()
                    });
                    changes.push(format!(
                        "attribute {name} → {new} (tessera's MIG devices carry their GPU's UUID as uuid)"
                    ));
                    profile_used |= new == "profile";
                }
                Ok(None) => {
                    profile_used |= name == "profile";
                    type_used |= name == "type";
                }
                Err(why) => problems.push(why),
            }
        } else if let Err(why) = capacity(name) {
            problems.push(why);
        }
    }
    let mut driver_renamed = false;
    for (i, t) in toks.iter().enumerate() {
        let Kind::Str { value, .. } = &t.kind else {
            continue;
        };
        if value == NVIDIA_DRIVER {
            replace[i] = Some(requote(&t.kind, TESSERA_DRIVER));
            driver_renamed = true;
        }
    }
    if driver_renamed {
        changes.insert(0, format!("{NVIDIA_DRIVER:?} → {TESSERA_DRIVER:?}"));
    }
    if type_used && ctx.shared {
        for (i, t) in toks.iter().enumerate() {
            if matches!(&t.kind, Kind::Str { value, .. } if value == "gpu") {
                replace[i] = Some(requote(&t.kind, "shared"));
                changes.push(
                    "type \"gpu\" → \"shared\": the request now takes a share, whose devices are of type shared"
                        .into(),
                );
            }
        }
    }
    if profile_used {
        for (i, t) in toks.iter().enumerate() {
            let Kind::Str { value, .. } = &t.kind else {
                continue;
            };
            if !looks_like_profile(value) {
                continue;
            }
            match map_profile(value, ctx.target) {
                Mapped::Same => {}
                Mapped::To { profile, why } => {
                    replace[i] = Some(requote(&t.kind, &profile));
                    changes.push(format!("MIG profile {value:?} → {profile:?}: {why}"));
                }
                Mapped::Unknown { why } => problems.push(format!("MIG profile {value:?}: {why}")),
            }
        }
    }
    let mut out = String::with_capacity(src.len());
    let mut at = 0;
    for (t, r) in toks.iter().zip(&replace) {
        if let Some(r) = r {
            out.push_str(&src[at..t.start]);
            out.push_str(r);
            at = t.end;
        }
    }
    out.push_str(&src[at..]);
    for (t, r) in toks.iter().zip(&replace) {
        if let (Kind::Str { value, .. }, None) = (&t.kind, r)
            && value.contains("nvidia.com")
        {
            problems.push(format!(
                "{value:?} is NVIDIA's name and has no tessera equivalent here"
            ));
        }
    }
    Rewrite {
        expression: out,
        changes,
        problems,
    }
}

/// `value` in the quotes (and prefix) of the literal `kind`; `value` holds no quote or backslash.
fn requote(kind: &Kind, value: &str) -> String {
    match kind {
        Kind::Str { open, close, .. } => format!("{open}{value}{close}"),
        _ => format!("{value:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu() -> Context {
        Context {
            mig: false,
            shared: false,
            target: MigModel::H100_80,
        }
    }

    fn mig() -> Context {
        Context { mig: true, ..gpu() }
    }

    #[test]
    fn the_domain_and_driver_literals_become_tesseras_in_either_quote() {
        let r = rewrite(
            "device.driver == 'gpu.nvidia.com' && device.attributes[\"gpu.nvidia.com\"].productName.startsWith('NVIDIA H100')",
            gpu(),
        );
        assert_eq!(
            r.expression,
            "device.driver == 'gpu.tessera.dev' && device.attributes[\"gpu.tessera.dev\"].productName.startsWith('NVIDIA H100')"
        );
        assert!(r.problems.is_empty(), "{:?}", r.problems);
    }

    #[test]
    fn parent_uuid_becomes_uuid_in_dot_and_index_form() {
        let r = rewrite(
            "device.attributes['gpu.nvidia.com'].parentUUID == 'GPU-1' || device.attributes['gpu.nvidia.com']['parentUUID'] == 'GPU-2'",
            mig(),
        );
        assert_eq!(
            r.expression,
            "device.attributes['gpu.tessera.dev'].uuid == 'GPU-1' || device.attributes['gpu.tessera.dev']['uuid'] == 'GPU-2'"
        );
    }

    #[test]
    fn text_that_only_contains_the_names_is_left_alone() {
        // An identifier named like an attribute and a literal holding the domain as part of a longer text.
        let src = "parentUUID == 'x.gpu.nvidia.com' // gpu.nvidia.com\n";
        let r = rewrite(src, gpu());
        assert_eq!(r.expression, src);
        assert_eq!(r.problems.len(), 1, "the literal names NVIDIA: {:?}", r.problems);
    }

    #[test]
    fn a_profile_of_another_model_is_renamed_only_where_the_profile_attribute_is_compared() {
        let r = rewrite("device.attributes['gpu.nvidia.com'].profile == '1g.5gb'", mig());
        assert_eq!(
            r.expression,
            "device.attributes['gpu.tessera.dev'].profile == '1g.10gb'"
        );
        assert!(
            r.changes.iter().any(|c| c.contains("1 of 8 memory slices")),
            "{:?}",
            r.changes
        );
        let r = rewrite(
            "device.attributes['gpu.nvidia.com'].productName == '1g.5gb'",
            gpu(),
        );
        assert!(r.expression.ends_with("'1g.5gb'"));
    }

    #[test]
    fn attributes_tessera_lacks_are_reported_and_left_as_written() {
        let r = rewrite("device.attributes['gpu.nvidia.com'].uuid == 'MIG-1'", mig());
        assert_eq!(
            r.expression,
            "device.attributes['gpu.tessera.dev'].uuid == 'MIG-1'"
        );
        assert!(
            r.problems[0].contains("MIG device's own UUID"),
            "{:?}",
            r.problems
        );
        let r = rewrite("device.capacity['gpu.nvidia.com'].memorySlice3 == 1", mig());
        assert!(r.problems[0].contains("placementStart"), "{:?}", r.problems);
        let r = rewrite(
            "device.attributes['gpu.nvidia.com'].addressingMode == 'HMM'",
            gpu(),
        );
        assert!(r.problems[0].contains("addressingMode"), "{:?}", r.problems);
    }

    #[test]
    fn raw_triple_and_escaped_literals_are_read_and_an_unterminated_one_is_refused() {
        let r = rewrite(r#"device.attributes[r"""gpu.nvidia.com"""].index == 0"#, gpu());
        assert_eq!(
            r.expression,
            r#"device.attributes[r"""gpu.tessera.dev"""].index == 0"#
        );
        let r = rewrite(
            r#""a\"gpu.nvidia.com" != device.attributes["gpu.nvidia.com"].index"#,
            gpu(),
        );
        assert_eq!(
            r.expression,
            r#""a\"gpu.nvidia.com" != device.attributes["gpu.tessera.dev"].index"#
        );
        let r = rewrite("device.driver == 'gpu.nvidia.com", gpu());
        assert_eq!(r.expression, "device.driver == 'gpu.nvidia.com");
        assert!(r.problems[0].contains("unterminated"), "{:?}", r.problems);
    }

    #[test]
    fn a_type_check_for_whole_gpus_follows_a_request_moved_to_the_share_class() {
        let src = "device.attributes['gpu.nvidia.com'].type == 'gpu'";
        let r = rewrite(
            src,
            Context {
                shared: true,
                ..gpu()
            },
        );
        assert_eq!(
            r.expression,
            "device.attributes['gpu.tessera.dev'].type == 'shared'"
        );
        let r = rewrite(src, gpu());
        assert_eq!(r.expression, "device.attributes['gpu.tessera.dev'].type == 'gpu'");
    }
}
