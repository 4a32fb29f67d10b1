//! `/metrics` for both binaries: what they share of Prometheus' exposition.
//!
//! Each binary keeps its own registry (`prometheus-client`, the official Rust client) and serves it in the
//! OpenMetrics text format on its health listener ([`crate::health::serve_with_metrics`]), so one port, the
//! one the probes use, is also the scrape target. [`exposition::parse`] checks rendered text against the
//! format's rules, for the unit tests of every metric name and label.

use std::sync::Arc;

use prometheus_client::registry::Registry;

/// The content type of [`render`]'s output. Prometheus picks its parser from it: OpenMetrics 1.0.0
/// (<https://prometheus.io/docs/specs/om/open_metrics_spec/>), which every Prometheus since 2.5 accepts.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Renders the current metrics as exposition text; called on every scrape.
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// `registry` as OpenMetrics text (ending in `# EOF`).
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail; a collector that fails leaves what it wrote so far.
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, registry) {
        tracing::warn!(error = %e, "a metrics collector failed to encode");
    }
    out
}

/// Histogram buckets for durations of API calls, prepares and MIG operations: 1 ms doubling to 65 s, which
/// spans a whole-GPU prepare (milliseconds) and a MIG mode change on a busy GPU (tens of seconds).
pub fn duration_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 17)
}

pub mod exposition {
    //! A strict reader of the OpenMetrics text format, for tests: every line must be a descriptor
    //! (`# TYPE`, `# HELP`, `# UNIT`), a sample of a declared family with a suffix its type allows, or the
    //! final `# EOF`. Rules from the OpenMetrics 1.0 specification, sections "ABNF" and "Metric types".

    use std::collections::{BTreeMap, BTreeSet};

    /// One sample line.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Sample {
        pub name: String,
        pub labels: BTreeMap<String, String>,
        pub value: f64,
    }

    /// A parsed exposition: families by name (their type) and every sample.
    #[derive(Clone, Debug, Default)]
    pub struct Exposition {
        pub types: BTreeMap<String, String>,
        pub samples: Vec<Sample>,
    }

    impl Exposition {
        /// Samples of `name` whose labels include every `(key, value)` of `labels`.
        pub fn find(&self, name: &str, labels: &[(&str, &str)]) -> Vec<&Sample> {
            self.samples
                .iter()
                .filter(|s| s.name == name)
                .filter(|s| {
                    labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
                })
                .collect()
        }
    }

    fn is_metric_name(s: &str) -> bool {
        let mut chars = s.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    }

    fn is_label_name(s: &str) -> bool {
        let mut chars = s.chars();
        chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
    }

    /// Suffixes a sample of a family of type `kind` may carry.
    fn suffixes(kind: &str) -> &'static [&'static str] {
        match kind {
            "counter" => &["_total", "_created"],
            "gauge" | "unknown" | "stateset" => &[""],
            "histogram" | "gaugehistogram" => &["_bucket", "_sum", "_count", "_created", "_gcount", "_gsum"],
            "summary" => &["", "_sum", "_count", "_created"],
            "info" => &["_info"],
            _ => &[],
        }
    }

    /// `{a="x",b="y"}` (without the braces) into labels; values may escape `\\`, `\"` and `\n` only.
    fn parse_labels(s: &str, line: usize) -> Result<BTreeMap<String, String>, String> {
        let mut labels = BTreeMap::new();
        let mut rest = s;
        while !rest.is_empty() {
            let (name, after) = rest
                .split_once("=\"")
                .ok_or_else(|| format!("line {line}: label without =\"…\" in {s:?}"))?;
            if !is_label_name(name) {
                return Err(format!("line {line}: {name:?} is not a valid label name"));
            }
            let mut value = String::new();
            let mut chars = after.char_indices();
            let end = loop {
                match chars.next() {
                    Some((i, '"')) => break i,
                    Some((_, '\\')) => match chars.next() {
                        Some((_, '\\')) => value.push('\\'),
                        Some((_, '"')) => value.push('"'),
                        Some((_, 'n')) => value.push('\n'),
                        other => return Err(format!("line {line}: bad escape {other:?} in label {name}")),
                    },
                    Some((_, '\n')) => return Err(format!("line {line}: raw newline in label {name}")),
                    Some((_, c)) => value.push(c),
                    None => return Err(format!("line {line}: unterminated value of label {name}")),
                }
            };
            if labels.insert(name.to_string(), value).is_some() {
                return Err(format!("line {line}: label {name} given twice"));
            }
            rest = &after[end + 1..];
            rest = rest.strip_prefix(',').unwrap_or(rest);
        }
        Ok(labels)
    }

    fn parse_value(s: &str, line: usize) -> Result<f64, String> {
        match s {
            "+Inf" => Ok(f64::INFINITY),
            "-Inf" => Ok(f64::NEG_INFINITY),
            "NaN" => Ok(f64::NAN),
            _ => s
                .parse()
                .map_err(|e| format!("line {line}: value {s:?} is not a number: {e}")),
        }
    }

    /// Parses `text`, or says which line breaks which rule.
    pub fn parse(text: &str) -> Result<Exposition, String> {
        let mut exposition = Exposition::default();
        let mut series = BTreeSet::new();
        let mut eof = false;
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            if eof {
                return Err(format!("line {line}: content after # EOF"));
            }
            if raw == "# EOF" {
                eof = true;
                continue;
            }
            if let Some(descriptor) = raw.strip_prefix("# ") {
                let mut parts = descriptor.splitn(3, ' ');
                let (keyword, name, rest) = (parts.next(), parts.next(), parts.next());
                let name = name.ok_or_else(|| format!("line {line}: descriptor without a name"))?;
                if !is_metric_name(name) {
                    return Err(format!("line {line}: {name:?} is not a valid metric name"));
                }
                match keyword {
                    Some("TYPE") => {
                        let kind = rest.unwrap_or_default();
                        if suffixes(kind).is_empty() {
                            return Err(format!("line {line}: unknown type {kind:?} of {name}"));
                        }
                        if exposition
                            .types
                            .insert(name.to_string(), kind.to_string())
                            .is_some()
                        {
                            return Err(format!("line {line}: family {name} declared twice"));
                        }
                    }
                    Some("UNIT") => {
                        let unit = rest.unwrap_or_default();
                        if !name.ends_with(&format!("_{unit}")) {
                            return Err(format!(
                                "line {line}: family {name} does not end in its unit {unit}"
                            ));
                        }
                    }
                    Some("HELP") => {}
                    other => return Err(format!("line {line}: unknown descriptor {other:?}")),
                }
                continue;
            }
            let (series_part, value) = raw
                .rsplit_once(' ')
                .ok_or_else(|| format!("line {line}: sample without a value: {raw:?}"))?;
            let (name, labels) = match series_part.split_once('{') {
                Some((name, labels)) => {
                    let labels = labels
                        .strip_suffix('}')
                        .ok_or_else(|| format!("line {line}: unterminated label set"))?;
                    (name, parse_labels(labels, line)?)
                }
                None => (series_part, BTreeMap::new()),
            };
            if !is_metric_name(name) {
                return Err(format!("line {line}: {name:?} is not a valid metric name"));
            }
            let family = exposition
                .types
                .iter()
                .filter(|(family, kind)| {
                    suffixes(kind)
                        .iter()
                        .any(|suffix| name.strip_suffix(suffix) == Some(family.as_str()))
                })
                .map(|(family, kind)| (family.clone(), kind.clone()))
                .max_by_key(|(family, _)| family.len())
                .ok_or_else(|| {
                    format!("line {line}: sample {name} of no declared family (missing # TYPE)")
                })?;
            if family.1.contains("histogram") && name.ends_with("_bucket") && !labels.contains_key("le") {
                return Err(format!(
                    "line {line}: histogram bucket {name} without an le label"
                ));
            }
            let value = parse_value(value, line)?;
            if !series.insert(format!("{name}{labels:?}")) {
                return Err(format!("line {line}: series {name}{labels:?} given twice"));
            }
            exposition.samples.push(Sample {
                name: name.to_string(),
                labels,
                value,
            });
        }
        if !eof {
            return Err("the exposition does not end in # EOF".into());
        }
        Ok(exposition)
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::{counter::Counter, family::Family, histogram::Histogram};

    use super::*;

    #[test]
    fn a_rendered_registry_parses_with_its_labels_and_values() {
        let mut registry = Registry::with_prefix("tessera_test");
        let ops = Family::<Vec<(&'static str, String)>, Counter>::default();
        registry.register("operations", "Operations.", ops.clone());
        let latency = Histogram::new(duration_buckets());
        registry.register_with_unit(
            "latency",
            "Latency.",
            prometheus_client::registry::Unit::Seconds,
            latency.clone(),
        );
        ops.get_or_create(&vec![("claim", "a \"quoted\" \\ name".to_string())])
            .inc_by(3);
        latency.observe(0.003);

        let text = render(&registry);
        let parsed = exposition::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let total = parsed.find(
            "tessera_test_operations_total",
            &[("claim", "a \"quoted\" \\ name")],
        );
        assert_eq!(total.len(), 1, "{text}");
        assert_eq!(total[0].value, 3.0);
        let buckets = parsed.find("tessera_test_latency_seconds_bucket", &[("le", "0.004")]);
        assert_eq!(buckets[0].value, 1.0, "{text}");
        assert_eq!(parsed.types["tessera_test_latency_seconds"], "histogram");
    }

    #[test]
    fn text_that_breaks_the_format_is_refused_with_the_line() {
        let cases = [
            ("# TYPE a gauge\na 1\n", "EOF"),
            ("b 1\n# EOF\n", "missing # TYPE"),
            ("# TYPE c counter\nc 1\n# EOF\n", "missing # TYPE"),
            ("# TYPE d gauge\nd{0x=\"1\"} 1\n# EOF\n", "label name"),
            ("# TYPE e gauge\ne{a=\"\\t\"} 1\n# EOF\n", "bad escape"),
            ("# TYPE f gauge\nf 1\nf 2\n# EOF\n", "twice"),
            ("# TYPE g histogram\ng_bucket 1\n# EOF\n", "le label"),
            ("# TYPE h_bytes gauge\n# UNIT h_bytes seconds\n# EOF\n", "unit"),
        ];
        for (text, expected) in cases {
            let err = exposition::parse(text).expect_err(text);
            assert!(err.contains(expected), "{text:?}: {err}");
        }
    }
}
