//! tessera's share sizing rule, v1: a pure function of the samples (the canonical text is in
//! `controller/README.md`, "kubectl tessera rightsize"; the fleet model implements the same rule in Go and
//! passes the same test vector).

/// The fewest samples a recommendation is made from.
pub const MIN_SAMPLES: usize = 30;
/// The percentile of GPU use the request is sized on.
pub const PERCENTILE: u32 = 90;
/// The part of the request the p90 use fills.
pub const TARGET: f64 = 0.8;
/// What a burstable share may use while its neighbours are idle, in percent of the GPU.
pub const CEILING_PERCENT: u32 = 100;
/// The headroom on the most memory used: memory is a hard limit, so it is sized on the maximum.
pub const MEMORY_HEADROOM: f64 = 1.15;
const GIB: f64 = (1u64 << 30) as f64;
/// Float error (0.004 · 90 is 0.36000000000000004) must not round a whole multiple up to the next step.
const EPSILON: f64 = 1e-9;

/// The rule's answer and the numbers it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Recommendation {
    /// Samples the rule saw (the fewer of use and memory samples).
    pub samples: usize,
    /// The p90 of GPU use, in whole-GPU units.
    pub p90_use: f64,
    /// The most memory any sample used, in bytes.
    pub max_memory_bytes: f64,
    /// `capacity.requests.compute`: percent of the GPU, a multiple of 5 in 5..=100.
    pub compute_percent: u32,
    /// `sharing.mps.computeCeiling`, percent.
    pub ceiling_percent: u32,
    /// `capacity.requests.memory`, GiB.
    pub memory_gib: u64,
}

/// Fewer samples than [`MIN_SAMPLES`]: no recommendation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not enough data: {samples} samples, need {MIN_SAMPLES}")]
pub struct NotEnoughData {
    pub samples: usize,
}

/// The nearest-rank p-th percentile of sorted samples: `sorted[ceil(p/100 · n) − 1]` (integer arithmetic,
/// so p = 90, n = 100 is rank 90 exactly). `sorted` must not be empty.
pub fn percentile(sorted: &[f64], p: u32) -> f64 {
    let n = sorted.len();
    let rank = (p as usize * n).div_ceil(100).max(1);
    sorted[rank - 1]
}

/// Rounds up to a multiple of 5.
fn ceil5(x: f64) -> u32 {
    ((x - EPSILON) / 5.0).ceil().max(0.0) as u32 * 5
}

/// The rule over every replica's samples pooled: `use_samples` in whole-GPU units (a fully busy 25 % share
/// reads 0.25), `memory_samples` in bytes.
pub fn recommend(use_samples: &[f64], memory_samples: &[f64]) -> Result<Recommendation, NotEnoughData> {
    let samples = use_samples.len().min(memory_samples.len());
    if samples < MIN_SAMPLES {
        return Err(NotEnoughData { samples });
    }
    let mut sorted = use_samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    let p90_use = percentile(&sorted, PERCENTILE);
    let compute_percent = ceil5(100.0 * p90_use / TARGET).clamp(5, 100);
    let max_memory_bytes = memory_samples.iter().copied().fold(0.0, f64::max);
    let memory_gib = ((MEMORY_HEADROOM * max_memory_bytes / GIB) - EPSILON)
        .ceil()
        .max(1.0) as u64;
    Ok(Recommendation {
        samples,
        p90_use,
        max_memory_bytes,
        compute_percent,
        ceiling_percent: CEILING_PERCENT,
        memory_gib,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: f64 = (1u64 << 20) as f64;

    /// u_k = 0.004·k, m_k = k · 100 MiB for k = 1..=n.
    fn test_vector(n: usize) -> (Vec<f64>, Vec<f64>) {
        (1..=n)
            .map(|k| (0.004 * k as f64, k as f64 * 100.0 * MIB))
            .unzip()
    }

    #[test]
    fn the_rule_gives_the_test_vector_45_percent_a_full_ceiling_and_12_gib() {
        let (u, m) = test_vector(100);
        let r = recommend(&u, &m).unwrap();
        assert_eq!(r.samples, 100);
        assert!((r.p90_use - 0.36).abs() < 1e-12, "{}", r.p90_use);
        assert_eq!(r.compute_percent, 45);
        assert_eq!(r.ceiling_percent, 100);
        assert_eq!(r.max_memory_bytes, 10_000.0 * MIB);
        assert_eq!(r.memory_gib, 12);
    }

    #[test]
    fn the_test_vector_cut_to_29_samples_is_not_enough_data() {
        let (u, m) = test_vector(29);
        let err = recommend(&u, &m).unwrap_err();
        assert_eq!(err.to_string(), "not enough data: 29 samples, need 30");
        let (u, m) = test_vector(30);
        assert!(recommend(&u, &m).is_ok());
    }

    #[test]
    fn the_order_of_the_samples_does_not_matter() {
        let (mut u, mut m) = test_vector(100);
        u.reverse();
        m.rotate_left(37);
        assert_eq!(recommend(&u, &m).unwrap().compute_percent, 45);
    }

    #[test]
    fn an_idle_share_gets_the_floor_of_5_percent_and_1_gib_and_a_busy_one_at_most_the_whole_gpu() {
        let idle = recommend(&[0.0; 40], &[0.0; 40]).unwrap();
        assert_eq!((idle.compute_percent, idle.memory_gib), (5, 1));
        let busy = recommend(&[1.0; 40], &[70.0 * GIB; 40]).unwrap();
        assert_eq!((busy.compute_percent, busy.memory_gib), (100, 81));
    }

    #[test]
    fn a_use_just_above_a_step_rounds_up_to_the_next_multiple_of_5() {
        // 0.3208 / 0.8 = 40.1 % → 45; 0.32 / 0.8 = 40 % exactly → 40.
        assert_eq!(recommend(&[0.3208; 30], &[0.0; 30]).unwrap().compute_percent, 45);
        assert_eq!(recommend(&[0.32; 30], &[0.0; 30]).unwrap().compute_percent, 40);
    }

    #[test]
    fn the_nearest_rank_percentile_of_ten_samples_is_the_ninth() {
        let s: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&s, 90), 9.0);
        assert_eq!(percentile(&s[..1], 90), 1.0);
        // ceil(0.9 · 11) = 10.
        let s: Vec<f64> = (1..=11).map(f64::from).collect();
        assert_eq!(percentile(&s, 90), 10.0);
    }
}
