//! The plugins' per-claim gauges, read from their `/metrics` text (Prometheus or OpenMetrics format).

use std::collections::HashMap;

/// Which claim's device a series is about (the gauges' `namespace`, `claim`, `request`, `device` labels).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct ClaimKey {
    pub namespace: String,
    pub claim: String,
    pub request: String,
    pub device: String,
}

/// What a claim uses of its device, where the plugin reports it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Usage {
    /// 0–1 of the device's SMs (none for MIG devices: NVML has no utilization for them).
    pub utilization: Option<f64>,
    pub memory_used_bytes: Option<u64>,
    /// What a share reserved and may burst to, 0–1 of the GPU.
    pub request_ratio: Option<f64>,
    pub ceiling_ratio: Option<f64>,
}

const UTILIZATION: &str = "tessera_claim_gpu_utilization_ratio";
const MEMORY_USED: &str = "tessera_claim_gpu_memory_used_bytes";
const REQUEST: &str = "tessera_claim_gpu_compute_request_ratio";
const CEILING: &str = "tessera_claim_gpu_compute_ceiling_ratio";

/// `name{a="b",…} value` → name, labels, value; `None` for comments and lines it cannot read.
fn sample(line: &str) -> Option<(&str, HashMap<String, String>, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, rest) = match line.find('{') {
        Some(i) => (&line[..i], &line[i + 1..]),
        None => {
            let (name, value) = line.split_once(' ')?;
            return Some((
                name,
                HashMap::new(),
                value.split_whitespace().next()?.parse().ok()?,
            ));
        }
    };
    let mut labels = HashMap::new();
    let mut chars = rest.char_indices().peekable();
    let end = loop {
        // key
        while chars.peek().is_some_and(|(_, c)| *c == ',' || *c == ' ') {
            chars.next();
        }
        let (start, c) = *chars.peek()?;
        if c == '}' {
            break start;
        }
        let eq = rest[start..].find('=')? + start;
        let key = rest[start..eq].trim().to_string();
        while chars.peek().is_some_and(|(i, _)| *i <= eq) {
            chars.next();
        }
        if chars.next()?.1 != '"' {
            return None;
        }
        let mut value = String::new();
        loop {
            match chars.next()?.1 {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                '"' => break,
                c => value.push(c),
            }
        }
        labels.insert(key, value);
    };
    let value = rest[end + 1..].split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

/// Adds the per-claim gauges of one plugin's `/metrics` text to `into`.
pub fn parse_into(text: &str, into: &mut HashMap<ClaimKey, Usage>) {
    for (name, labels, value) in text.lines().filter_map(sample) {
        let field: fn(&mut Usage, f64) = match name {
            UTILIZATION => |u, v| u.utilization = Some(v),
            MEMORY_USED => |u, v| u.memory_used_bytes = Some(v.max(0.0) as u64),
            REQUEST => |u, v| u.request_ratio = Some(v),
            CEILING => |u, v| u.ceiling_ratio = Some(v),
            _ => continue,
        };
        let label = |k: &str| labels.get(k).cloned().unwrap_or_default();
        let key = ClaimKey {
            namespace: label("namespace"),
            claim: label("claim"),
            request: label("request"),
            device: label("device"),
        };
        field(into.entry(key).or_default(), value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_per_claim_gauges_are_read_by_claim_request_and_device_and_the_rest_is_skipped() {
        let text = r#"# HELP tessera_claim_gpu_utilization_ratio x
# TYPE tessera_claim_gpu_utilization_ratio gauge
tessera_claim_gpu_utilization_ratio{namespace="team",pod="p",claim="c",request="gpu",device="gpu-1-shared"} 0.31
tessera_claim_gpu_memory_used_bytes{namespace="team",pod="p",claim="c",request="gpu",device="gpu-1-shared"} 2147483648
tessera_claim_gpu_compute_ceiling_ratio{namespace="team",pod="p",claim="c",request="gpu",device="gpu-1-shared"} 5.0e-1
tessera_plugin_mps_daemons 1
tessera_claim_device_info{namespace="a\"b",pod="p",claim="c",request="gpu",device="gpu-0",UUID="GPU-1"} 1
# EOF
"#;
        let mut usage = HashMap::new();
        parse_into(text, &mut usage);
        let key = ClaimKey {
            namespace: "team".into(),
            claim: "c".into(),
            request: "gpu".into(),
            device: "gpu-1-shared".into(),
        };
        assert_eq!(
            usage,
            HashMap::from([(
                key,
                Usage {
                    utilization: Some(0.31),
                    memory_used_bytes: Some(2 << 30),
                    request_ratio: None,
                    ceiling_ratio: Some(0.5),
                }
            )])
        );
    }
}
