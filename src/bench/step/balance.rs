//! The tokens per step at which a compute-only step takes as long as an
//! I/O-only one: where compute and tier traffic are balanced, so hiding
//! one behind the other matters most and is hardest.
//!
//! The I/O-only step moves the same records whatever the token count; the
//! compute-only step grows with it. The search times compute-only steps at
//! token counts a factor of two apart, from the start count up or down,
//! until one is shorter than the I/O-only step and one longer, then
//! interpolates linearly between those two.

use serde::Serialize;

use super::arm::Arm;
use super::StepBenchConfig;
use crate::EngineError;

/// Token counts the search may choose are multiples of this.
pub const TOKENS_GRAIN: usize = 16;

/// How far from the start count the search goes, each way.
pub const SEARCH_FACTOR_MAX: usize = 64;

/// What the search measured and chose.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Balance {
    /// The I/O-only step time (the smaller of two timed steps).
    pub io_only_s: f64,
    /// (tokens, compute-only step time) for every count tried, in order.
    pub compute_only_s: Vec<(usize, f64)>,
    /// The chosen tokens per step.
    pub tokens: usize,
    /// Where the search stopped without bracketing the balance: "compute
    /// above I/O at the fewest tokens" or "compute below I/O at the most".
    pub unbracketed: Option<&'static str>,
}

/// Searches from `config.tokens`, timing the `compute_only` and `io_only`
/// arms (their steps are not counted in the bench's records).
pub fn find(
    config: &StepBenchConfig,
    compute_only: &mut Arm,
    io_only: &mut Arm,
    progress: &mut dyn FnMut(&str),
) -> Result<Balance, EngineError> {
    let start = config.tokens;
    let (fewest, most) = bounds(start);
    let io_only_s = io_only.probe(config, start, progress)?;
    progress(&format!("balance: I/O-only step {io_only_s:.3} s"));
    let mut tried = Vec::new();
    let mut tokens = start;
    loop {
        let s = compute_only.probe(config, tokens, progress)?;
        progress(&format!(
            "balance: compute-only step {s:.3} s at {tokens} tokens"
        ));
        tried.push((tokens, s));
        let next = if s <= io_only_s {
            tokens * 2
        } else {
            tokens / 2
        };
        if bracket(&tried, io_only_s).is_some() || !(fewest..=most).contains(&next) {
            break;
        }
        tokens = next;
    }
    let (tokens, unbracketed) = choose(&tried, io_only_s, fewest, most);
    progress(&format!("balance: {tokens} tokens a step"));
    Ok(Balance {
        io_only_s,
        compute_only_s: tried,
        tokens,
        unbracketed,
    })
}

/// The fewest and most tokens the search may try from `start`.
fn bounds(start: usize) -> (usize, usize) {
    let fewest = (start / SEARCH_FACTOR_MAX).max(TOKENS_GRAIN);
    (fewest, (start * SEARCH_FACTOR_MAX).max(fewest))
}

/// The closest pair of tried counts whose compute-only times lie on either
/// side of `io_s`: (below, above).
fn bracket(tried: &[(usize, f64)], io_s: f64) -> Option<((usize, f64), (usize, f64))> {
    let below = tried
        .iter()
        .filter(|p| p.1 <= io_s)
        .max_by_key(|p| p.0)
        .copied();
    let above = tried
        .iter()
        .filter(|p| p.1 > io_s)
        .min_by_key(|p| p.0)
        .copied();
    below.zip(above)
}

/// The balanced count from the tried ones (see the module docs), rounded
/// to `TOKENS_GRAIN` within [fewest, most].
fn choose(
    tried: &[(usize, f64)],
    io_s: f64,
    fewest: usize,
    most: usize,
) -> (usize, Option<&'static str>) {
    let round = |t: f64| {
        let t = (t / TOKENS_GRAIN as f64).round() as usize * TOKENS_GRAIN;
        t.clamp(fewest, most)
    };
    match bracket(tried, io_s) {
        Some(((t0, s0), (t1, s1))) => {
            // s1 > io_s >= s0, so the slope is positive. Counts where a
            // longer step came at fewer tokens (noise) still bracket, and
            // the interpolation stays between them.
            let share = (io_s - s0) / (s1 - s0);
            (round(t0 as f64 + share * (t1 as f64 - t0 as f64)), None)
        }
        None if tried.iter().all(|p| p.1 > io_s) => (
            round(fewest as f64),
            Some("compute above I/O at the fewest tokens"),
        ),
        None => (
            round(most as f64),
            Some("compute below I/O at the most tokens"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bracketed_balance_is_interpolated_and_rounded() {
        // 0.5 s of fixed work plus 1 ms a token, against 0.8 s of I/O.
        let tried = [(1024, 1.524), (512, 1.012), (256, 0.756)];
        let (tokens, note) = choose(&tried, 0.8, 16, 65536);
        assert_eq!((tokens, note), (304, None));
        // The bracket is the closest pair, whatever the order tried.
        let shuffled = [(256, 0.756), (1024, 1.524), (512, 1.012)];
        assert_eq!(choose(&shuffled, 0.8, 16, 65536).0, 304);
        assert_eq!(bracket(&shuffled, 0.8), Some(((256, 0.756), (512, 1.012))));
    }

    #[test]
    fn an_unbracketed_search_stops_at_its_bound_and_says_so() {
        let slow = [(64, 2.0), (32, 1.9), (16, 1.9)];
        assert_eq!(
            choose(&slow, 0.5, 16, 4096),
            (16, Some("compute above I/O at the fewest tokens"))
        );
        let fast = [(64, 0.1), (4096, 0.2)];
        assert_eq!(
            choose(&fast, 0.5, 16, 4096),
            (4096, Some("compute below I/O at the most tokens"))
        );
        assert_eq!(bounds(1024), (16, 65536));
        assert_eq!(bounds(32), (16, 2048));
    }
}
