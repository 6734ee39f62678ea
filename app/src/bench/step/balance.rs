//! The tokens per step at which a compute-only step takes as long as an
//! I/O-only one: where compute and tier traffic are balanced, so hiding
//! one behind the other matters most and is hardest.
//!
//! The I/O-only step moves the same records whatever the token count, but
//! its dense passes (norms, router, permutation, combine) grow with it,
//! slowly; the compute-only step grows with it fast. The search times both
//! at token counts a factor of two apart, from the start count up or down,
//! until at one count the compute-only step is the shorter and at another
//! the longer, then interpolates the difference of the two linearly
//! between those counts. (Timing the I/O-only step once, at the start
//! count, put the balance below the true one wherever the passes matter:
//! on an H100 host, at 8–16k tokens.)

use serde::Serialize;

use super::arm::Arm;
use super::StepBenchConfig;
use strata::EngineError;

/// Token counts the search may choose are multiples of this.
pub const TOKENS_GRAIN: usize = 16;

/// How far from the start count the search goes, each way.
pub const SEARCH_FACTOR_MAX: usize = 64;

/// What the search measured and chose.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Balance {
    /// The I/O-only step time at the chosen count, interpolated between
    /// the two counts that bracket it (at the bound where none do).
    pub io_only_s: f64,
    /// (tokens, compute-only step time) for every count tried, in order
    /// (each the smaller of two timed steps).
    pub compute_only_s: Vec<(usize, f64)>,
    /// (tokens, I/O-only step time) at the same counts.
    pub io_only_at: Vec<(usize, f64)>,
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
    let mut tried = Vec::new();
    let mut tokens = start;
    loop {
        let io = io_only.probe(config, tokens, progress)?;
        let compute = compute_only.probe(config, tokens, progress)?;
        progress(&format!(
            "balance: at {tokens} tokens compute-only {compute:.3} s, I/O-only {io:.3} s"
        ));
        tried.push(Probe {
            tokens,
            compute,
            io,
        });
        let next = if compute <= io {
            tokens * 2
        } else {
            tokens / 2
        };
        if bracket(&tried).is_some() || !(fewest..=most).contains(&next) {
            break;
        }
        tokens = next;
    }
    let (tokens, io_only_s, unbracketed) = choose(&tried, fewest, most);
    progress(&format!("balance: {tokens} tokens a step"));
    Ok(Balance {
        io_only_s,
        compute_only_s: tried.iter().map(|p| (p.tokens, p.compute)).collect(),
        io_only_at: tried.iter().map(|p| (p.tokens, p.io)).collect(),
        tokens,
        unbracketed,
    })
}

/// Both runs' step times at one count.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Probe {
    tokens: usize,
    compute: f64,
    io: f64,
}

impl Probe {
    /// Compute-only over I/O-only: at most 0 where compute hides.
    fn excess(&self) -> f64 {
        self.compute - self.io
    }
}

/// The fewest and most tokens the search may try from `start`.
fn bounds(start: usize) -> (usize, usize) {
    let fewest = (start / SEARCH_FACTOR_MAX).max(TOKENS_GRAIN);
    (fewest, (start * SEARCH_FACTOR_MAX).max(fewest))
}

/// The closest pair of tried counts on either side of the balance: the
/// most tokens at which compute-only was no longer than I/O-only, and the
/// fewest at which it was longer.
fn bracket(tried: &[Probe]) -> Option<(Probe, Probe)> {
    let below = tried
        .iter()
        .filter(|p| p.excess() <= 0.0)
        .max_by_key(|p| p.tokens)
        .copied();
    let above = tried
        .iter()
        .filter(|p| p.excess() > 0.0)
        .min_by_key(|p| p.tokens)
        .copied();
    below.zip(above)
}

/// The balanced count from the tried ones (see the module docs), rounded
/// to `TOKENS_GRAIN` within [fewest, most], and the I/O-only step there.
fn choose(tried: &[Probe], fewest: usize, most: usize) -> (usize, f64, Option<&'static str>) {
    let round = |t: f64| {
        let t = (t / TOKENS_GRAIN as f64).round() as usize * TOKENS_GRAIN;
        t.clamp(fewest, most)
    };
    match bracket(tried) {
        Some((lo, hi)) => {
            // hi's excess > 0 >= lo's, so the share lies in [0, 1). Counts
            // where the excess fell as tokens rose (noise) still bracket,
            // and the interpolation stays between them.
            let share = -lo.excess() / (hi.excess() - lo.excess());
            let at = |a: f64, b: f64| a + share * (b - a);
            let tokens = round(at(lo.tokens as f64, hi.tokens as f64));
            (tokens, at(lo.io, hi.io), None)
        }
        None => {
            let (edge, why) = if tried.iter().all(|p| p.excess() > 0.0) {
                (fewest, "compute above I/O at the fewest tokens")
            } else {
                (most, "compute below I/O at the most tokens")
            };
            // The I/O-only step of the count tried nearest the bound.
            let nearest = tried
                .iter()
                .min_by_key(|p| p.tokens.abs_diff(edge))
                .expect("at least one count tried");
            (round(edge as f64), nearest.io, Some(why))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Probe {
        fn with_io(self, io: f64) -> Self {
            Self { io, ..self }
        }
    }

    /// Compute 0.5 s of fixed work plus 1 ms a token; I/O 0.7 s plus
    /// `io_per_token` s a token.
    fn probe(tokens: usize, io_per_token: f64) -> Probe {
        let t = tokens as f64;
        Probe {
            tokens,
            compute: 0.5 + 1e-3 * t,
            io: 0.7 + io_per_token * t,
        }
    }

    #[test]
    fn a_bracketed_balance_is_interpolated_and_rounded() {
        // I/O flat at 0.8 s: 0.5 + t/1000 = 0.8 at t = 300.
        let flat = |tokens| probe(tokens, 0.0).with_io(0.8);
        let tried = [flat(1024), flat(512), flat(256)];
        let (tokens, io, note) = choose(&tried, 16, 65536);
        assert_eq!((tokens, note), (304, None));
        assert!((io - 0.8).abs() < 1e-12);
        // The bracket is the closest pair, whatever the order tried.
        let shuffled = [flat(256), flat(1024), flat(512)];
        assert_eq!(choose(&shuffled, 16, 65536).0, 304);
        assert_eq!(bracket(&shuffled), Some((flat(256), flat(512))));
    }

    #[test]
    fn an_io_only_step_that_grows_with_tokens_moves_the_balance_up() {
        // I/O 0.7 s + 0.5 ms a token: 0.5 + t/1000 = 0.7 + t/2000 at t = 400,
        // where the I/O-only step is 0.9 s (timed once at 256 tokens,
        // 0.828 s, it would have put the balance at 336).
        let tried = [probe(256, 5e-4), probe(512, 5e-4)];
        let (tokens, io, note) = choose(&tried, 16, 65536);
        assert_eq!((tokens, note), (400, None));
        assert!((io - 0.9).abs() < 1e-12, "{io}");
    }

    #[test]
    fn an_unbracketed_search_stops_at_its_bound_and_says_so() {
        let at = |tokens, compute, io| Probe {
            tokens,
            compute,
            io,
        };
        let slow = [at(64, 2.0, 0.5), at(32, 1.9, 0.4), at(16, 1.9, 0.45)];
        assert_eq!(
            choose(&slow, 16, 4096),
            (16, 0.45, Some("compute above I/O at the fewest tokens"))
        );
        let fast = [at(64, 0.1, 0.5), at(4096, 0.2, 0.6)];
        assert_eq!(
            choose(&fast, 16, 4096),
            (4096, 0.6, Some("compute below I/O at the most tokens"))
        );
        assert_eq!(bounds(1024), (16, 65536));
        assert_eq!(bounds(32), (16, 2048));
    }
}
