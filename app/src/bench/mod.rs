//! `strata bench …`: performance measurements printed as one JSON object a
//! line (`--json`) or as a table. Figures are medians over timed repetitions
//! interleaved with their reference measurement, so ratios hold on a noisy,
//! shared machine.

pub mod affinity;
pub mod attention;
pub mod captured;
pub mod coherent;
pub mod condense;
pub mod kernels;
pub mod migrate;
pub mod optim;
pub mod overlap;
pub mod pipeline;
pub mod placement;
pub mod step;
pub mod tiers;
pub mod upload;

use std::time::Duration;

/// Median and minimum of a set of timings, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    pub median_s: f64,
    pub min_s: f64,
}

impl Timing {
    /// Panics on an empty set: every bench times at least one repetition.
    pub fn of(samples: &[Duration]) -> Timing {
        let s: Vec<f64> = samples.iter().map(Duration::as_secs_f64).collect();
        let min_s = s.iter().copied().fold(f64::INFINITY, f64::min);
        Timing {
            median_s: median(s),
            min_s,
        }
    }
}

/// The median of `v` (the mean of the middle two for an even count).
/// Panics on an empty set: every bench times at least one repetition.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    assert!(!v.is_empty(), "no samples to summarize");
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

pub(crate) use crate::sys::process_usage;

/// CPU seconds stolen from this (virtual) machine so far, all cores
/// together: the `steal` column of /proc/stat's first line; `None` where
/// there is no such file (not Linux) or column.
pub(crate) fn stolen_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: f64 = stat
        .lines()
        .next()?
        .split_whitespace()
        .nth(8)?
        .parse()
        .ok()?;
    Some(ticks / crate::sys::clock_ticks_per_second()?)
}

/// Parses a count with an optional binary suffix: `1000`, `64K`, `64M`, `1G`.
pub fn parse_count(text: &str) -> Result<usize, String> {
    let t = text.trim();
    let (digits, shift) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 30),
        _ => (t, 0),
    };
    let n: usize = digits
        .parse()
        .map_err(|_| format!("`{text}` is not a count (examples: 1000, 64K, 64M, 1G)"))?;
    n.checked_mul(1usize << shift)
        .ok_or_else(|| format!("`{text}` is too large"))
}

/// Says why a case that needs CUDA (a GPU, or the CPU model of one, with
/// NVRTC and ptxas) could not run. Where CUDA is expected, as in CI's
/// driver-model block, `STRATA_REQUIRE_CUDA=1` makes that a failure
/// instead of a skip that `cargo test` would show as a pass.
#[cfg(all(test, feature = "cuda"))]
pub(crate) fn cuda_case_skipped(why: impl std::fmt::Display) {
    if std::env::var_os("STRATA_REQUIRE_CUDA").is_some_and(|v| v == "1") {
        panic!("cuda case could not run, and STRATA_REQUIRE_CUDA=1 requires it: {why}");
    }
    eprintln!("cuda case skipped: {why}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_take_binary_suffixes() {
        assert_eq!(parse_count("64M"), Ok(67_108_864));
        assert_eq!(parse_count("3k"), Ok(3072));
        assert_eq!(parse_count("1000"), Ok(1000));
        assert!(parse_count("12Q").is_err());
        assert!(parse_count("").is_err());
    }

    #[test]
    fn timing_takes_the_median_and_min() {
        let ms = |v: u64| Duration::from_millis(v);
        let t = Timing::of(&[ms(5), ms(1), ms(3)]);
        assert_eq!(t.median_s, 0.003);
        assert_eq!(t.min_s, 0.001);
        assert_eq!(Timing::of(&[ms(2), ms(4)]).median_s, 0.003);
    }
}
