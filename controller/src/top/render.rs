//! Drawing a [`Fleet`] as plain text lines of at most [`WIDTH`] columns, readable without colours.

use super::model::{Fleet, GpuView, Holder, Layout, MigInstance, Share};

/// The narrowest terminal `top` is drawn for.
pub const WIDTH: usize = 80;

/// Columns of a holder's name (`namespace/pod`) before it is cut with an ellipsis.
const HOLDER_WIDTH: usize = 30;

/// Shortens `s` to `width` columns, ending in `…` when cut.
pub fn truncate(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        return s.to_string();
    }
    let mut out: String = s.chars().take(width.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// Bytes as `80Gi`, `12.5Gi`, `512Mi`.
pub fn bytes(v: u64) -> String {
    const GI: f64 = (1u64 << 30) as f64;
    const MI: f64 = (1u64 << 20) as f64;
    let (n, unit) = if v as f64 >= GI {
        (v as f64 / GI, "Gi")
    } else {
        (v as f64 / MI, "Mi")
    };
    let text = format!("{n:.1}");
    format!("{}{unit}", text.strip_suffix(".0").unwrap_or(&text))
}

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{}%", v.round() as i64))
}

fn used(h: &Holder) -> String {
    h.usage.memory_used_bytes.map_or("-".into(), bytes)
}

fn gpu_header(g: &GpuView) -> String {
    let memory = g.memory_bytes.map(bytes).unwrap_or_default();
    let health = if g.taints.is_empty() { "healthy" } else { "TAINTED" };
    let tail = format!("{memory:>7}  {health}");
    let head = format!("GPU {}  ", g.index);
    let room = WIDTH - head.len() - tail.len() - 1;
    let product = truncate(
        if g.product.is_empty() {
            "(unknown model)"
        } else {
            &g.product
        },
        room,
    );
    format!("{head}{product:<room$} {tail}")
}

fn holder_line(indent: &str, what: &str, h: &Holder) -> String {
    format!(
        "{indent}{what}{:<HOLDER_WIDTH$}  util {:>4}  mem used {:>7}",
        truncate(&h.label(), HOLDER_WIDTH),
        pct(h.usage.utilization.map(|u| u * 100.0)),
        used(h)
    )
}

fn whole(lines: &mut Vec<String>, holders: &[Holder]) {
    if holders.is_empty() {
        lines.push("  whole GPU  free".into());
    }
    for h in holders {
        lines.push(holder_line("  ", "whole GPU  ", h));
    }
}

fn mig(lines: &mut Vec<String>, slices: u32, dynamic: bool, instances: &[MigInstance]) {
    if dynamic && instances.is_empty() {
        lines.push(format!(
            "  free: whole GPU or MIG on demand ({slices} memory slices)"
        ));
        return;
    }
    let mut cells = vec!['.'; slices as usize];
    for (i, inst) in instances.iter().enumerate() {
        let letter = (b'A' + (i % 26) as u8) as char;
        for k in inst.start..(inst.start + inst.size).min(slices) {
            cells[k as usize] = letter;
        }
    }
    // Wide cells for a few slices, narrow ones for many, so the bar stays under 50 columns.
    let cell = (48 / slices.max(1) as usize).clamp(1, 4);
    let bar: Vec<String> = cells.iter().map(|c| c.to_string().repeat(cell)).collect();
    // A static layout's instances exist whether held or not: what is free there is instances.
    let summary = if dynamic {
        let free = cells.iter().filter(|c| **c == '.').count();
        format!("MIG [{}]  {free} of {slices} slices free", bar.join("|"))
    } else {
        let held = instances.iter().filter(|i| !i.holders.is_empty()).count();
        format!(
            "MIG static [{}]  {held} of {} held",
            bar.join("|"),
            instances.len()
        )
    };
    lines.push(truncate(&format!("  {summary}"), WIDTH));
    for (i, inst) in instances.iter().enumerate() {
        let letter = (b'A' + (i % 26) as u8) as char;
        let span = if inst.size <= 1 {
            format!("slice {}", inst.start)
        } else {
            format!("slices {}-{}", inst.start, inst.start + inst.size - 1)
        };
        let what = format!("{letter} {:<10} {span:<11} ", truncate(&inst.profile, 10));
        if inst.holders.is_empty() {
            lines.push(format!("    {what}free"));
        }
        for h in &inst.holders {
            lines.push(format!(
                "    {what}{:<HOLDER_WIDTH$}  mem used {:>7}",
                truncate(&h.label(), HOLDER_WIDTH),
                used(h)
            ));
        }
    }
}

fn shared(lines: &mut Vec<String>, strategy: &str, shares: &[Share], gpu_memory: Option<u64>) {
    let strategy = if strategy.is_empty() { "shared" } else { strategy };
    if shares.is_empty() {
        lines.push(format!("  shared ({strategy})  free"));
        return;
    }
    let reserved: u64 = shares.iter().filter_map(|s| s.memory_bytes).sum();
    let compute: f64 = shares.iter().filter_map(|s| s.request_pct).sum();
    let of = gpu_memory
        .map(|m| format!(" of {}", bytes(m)))
        .unwrap_or_default();
    lines.push(truncate(
        &format!(
            "  shared ({strategy})  {} share{}  memory {}{of}  compute {}% reserved",
            shares.len(),
            if shares.len() == 1 { "" } else { "s" },
            bytes(reserved),
            compute.round() as i64
        ),
        WIDTH,
    ));
    lines.push(format!(
        "    {:<HOLDER_WIDTH$} {:>6} {:>7} {:>7} {:>5} {:>8}",
        "share", "memory", "request", "ceiling", "use", "mem used"
    ));
    for s in shares {
        lines.push(format!(
            "    {:<HOLDER_WIDTH$} {:>6} {:>7} {:>7} {:>5} {:>8}",
            truncate(&s.holder.label(), HOLDER_WIDTH),
            s.memory_bytes.map_or("-".into(), bytes),
            pct(s.request_pct),
            pct(s.ceiling_pct),
            pct(s.holder.usage.utilization.map(|u| u * 100.0)),
            used(&s.holder)
        ));
    }
}

/// The lines of `fleet`, then `notes` (where use came from, or why it is missing) as a footer.
pub fn render(fleet: &Fleet, notes: &[String]) -> Vec<String> {
    let mut lines = Vec::new();
    if fleet.nodes.is_empty() {
        lines.push("no node publishes tessera GPUs".to_string());
    }
    for node in &fleet.nodes {
        let count = node.gpus.len();
        lines.push(truncate(
            &format!(
                "== node {}  ({count} GPU{})",
                node.name,
                if count == 1 { "" } else { "s" }
            ),
            WIDTH,
        ));
        for g in &node.gpus {
            lines.push(gpu_header(g));
            for t in &g.taints {
                lines.push(truncate(&format!("  taint {t}"), WIDTH));
            }
            match &g.layout {
                Layout::Whole { holders } => whole(&mut lines, holders),
                Layout::Mig {
                    slices,
                    dynamic,
                    instances,
                } => mig(&mut lines, *slices, *dynamic, instances),
                Layout::Shared { strategy, shares } => shared(&mut lines, strategy, shares, g.memory_bytes),
            }
        }
    }
    if !notes.is_empty() {
        lines.push(String::new());
    }
    for n in notes {
        lines.extend(wrap(n, WIDTH));
    }
    lines
}

/// Word-wraps a footer note.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let word = truncate(word, width);
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            out.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(&word);
    }
    if !line.is_empty() {
        out.push(line);
    }
    out
}
