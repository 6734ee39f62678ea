//! Token condensation (LUFFY, `../shared/papers/004_…` §V): of the tokens
//! one device sends to one expert, those whose layer inputs are near
//! duplicates (cosine similarity at or above a threshold) are sent and
//! computed once. The expert's output for the group's representative is
//! copied back to every member, and in the backward the members' output
//! gradients are summed into the representative's, so the expert's
//! parameter gradient and the representative's input gradient are those
//! of the condensed computation; a condensed token's input gets no
//! gradient through that expert (its output was the representative's).
//!
//! It changes results, so it is off unless asked for
//! ([`CondenseConfig`]). This module finds the groups ([`condense_rows`]);
//! the engine's runner (`engine::condensing`) applies them.
//!
//! Never across experts: the groups are formed within one expert's rows.
//! Never more than [`CondenseConfig::max_share`] of an expert's rows
//! condensed. Two searches, measured against each other by
//! `strata bench condense`:
//! - [`Search::AllPairs`]: each row is compared with every representative
//!   found before it (the exact greedy grouping).
//! - [`Search::Lsh`]: random-hyperplane signatures (SimHash) in several
//!   tables; a row is compared only with the representatives that share
//!   a signature with it in some table. Faster where groups are few, and
//!   it may miss a pair the exact search would group.
//!
//! A row joins the representative most similar to it at or above the
//! threshold, or becomes one: every group's members are within the
//! threshold of its representative, whichever search found them.

mod search;

pub use search::{condense_rows, inverse_norms, RowGroups, SignatureTables};

use std::fmt;

/// The similarity at or above which two rows are one: fixed, or adapted to
/// the training's progress.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Threshold {
    /// The same cosine threshold every step.
    Fixed(f32),
    /// LUFFY's schedule (eq. 2) on the distance 1 − h: with l_norm =
    /// (l_first − l_{t−1}) / l_first, from the first step's loss and the
    /// last one's, 1 − h_t = (1 − start) · (1 + exp(l_norm)) / 2. It
    /// starts at `start` and falls as the loss does, the distance growing
    /// by the factor the paper's threshold shrinks by (to 1.86 × where the
    /// loss has fallen to nothing). The paper scales the threshold itself,
    /// h_t = 1 / (1 + exp(l_norm)); a model whose expert inputs are as
    /// alike as strata's presets' (most pairs above 0.9) then condenses
    /// every row it may from the first steps (docs/performance.md).
    Adaptive { start: f32 },
}

impl Threshold {
    /// This step's threshold from the first and the last step's losses
    /// (`None` before any step: the start).
    pub fn at(self, first_loss: Option<f32>, last_loss: Option<f32>) -> f32 {
        match self {
            Threshold::Fixed(h) => h,
            Threshold::Adaptive { start } => {
                let l_norm = match (first_loss, last_loss) {
                    (Some(first), Some(last)) if first > 0.0 && last.is_finite() => {
                        ((first - last) / first).clamp(0.0, 1.0)
                    }
                    _ => 0.0,
                };
                1.0 - (1.0 - start) * (1.0 + l_norm.exp()) / 2.0
            }
        }
    }
}

/// Where an adaptive threshold starts unless told: LUFFY's schedule scaled
/// so that the held-out loss of `strata train` stays within 1 % of exact
/// training's (docs/performance.md, token condensation).
pub const ADAPTIVE_START: f32 = 0.99;

/// Which search finds a row's representative.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Search {
    AllPairs,
    /// `tables` signatures of `bits` bits each.
    Lsh {
        tables: usize,
        bits: usize,
    },
}

impl Search {
    /// The signature search the trainer and `strata bench condense` run:
    /// 8 tables of 6 bits. Two rows at cosine 0.9 share a table's
    /// signature with probability 0.86⁶ ≈ 0.39, so some table's with
    /// 1 − 0.61⁸ ≈ 0.98.
    pub const LSH: Search = Search::Lsh { tables: 8, bits: 6 };

    pub fn name(self) -> &'static str {
        match self {
            Search::AllPairs => "all-pairs",
            Search::Lsh { .. } => "lsh",
        }
    }
}

/// Token condensation as an engine runs it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CondenseConfig {
    pub threshold: Threshold,
    /// The most of an expert's rows (from one device) that may be
    /// condensed into others, 0 to 1.
    pub max_share: f32,
    pub search: Search,
}

impl CondenseConfig {
    /// A threshold and a share cap that a run can use, or why not.
    pub fn check(&self) -> Result<(), CondenseError> {
        let start = match self.threshold {
            Threshold::Fixed(h) | Threshold::Adaptive { start: h } => h,
        };
        if !(start > 0.0 && start <= 1.0) {
            return Err(CondenseError(format!(
                "a condensation threshold of {start}: give a cosine similarity in (0, 1]"
            )));
        }
        if !(0.0..=1.0).contains(&self.max_share) {
            return Err(CondenseError(format!(
                "a condensed share cap of {}: give 0 to 1",
                self.max_share
            )));
        }
        if let Search::Lsh { tables, bits } = self.search {
            if tables == 0 || !(1..=32).contains(&bits) {
                return Err(CondenseError(format!(
                    "{tables} signature tables of {bits} bits: need at least one table of 1 to 32 bits"
                )));
            }
        }
        Ok(())
    }

    /// What the run's first line and run.json say of it.
    pub fn describe(&self) -> String {
        let threshold = match self.threshold {
            Threshold::Fixed(h) => format!("threshold {h}"),
            Threshold::Adaptive { start } => format!("adaptive threshold from {start}"),
        };
        format!(
            "token condensation on ({threshold}, at most {:.0} % of an expert's rows, {} search): results differ from exact training",
            self.max_share * 100.0,
            self.search.name()
        )
    }
}

/// Why a condensation setting cannot run.
#[derive(Clone, Debug, PartialEq)]
pub struct CondenseError(pub String);

impl fmt::Display for CondenseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CondenseError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_adaptive_threshold_starts_high_and_falls_with_the_loss() {
        let t = Threshold::Adaptive { start: 0.9 };
        assert_eq!(t.at(None, None), 0.9);
        assert_eq!(t.at(Some(4.0), Some(4.0)), 0.9);
        // The paper's factor (1 + e^{l_norm}) / 2 on the distance.
        let h = t.at(Some(4.0), Some(2.0));
        assert!(
            (h - (1.0 - 0.1 * (1.0 + 0.5f32.exp()) / 2.0)).abs() < 1e-6,
            "{h}"
        );
        assert!(t.at(Some(4.0), Some(1.0)) < h);
        assert!(t.at(Some(4.0), Some(0.0)) > 1.0 - 0.1 * 1.86);
        // A loss that rose, or one that is not finite, leaves the start.
        assert_eq!(t.at(Some(4.0), Some(5.0)), 0.9);
        assert_eq!(t.at(Some(4.0), Some(f32::NAN)), 0.9);
        assert_eq!(Threshold::Fixed(0.75).at(Some(4.0), Some(1.0)), 0.75);
    }

    #[test]
    fn settings_out_of_range_are_refused_by_name() {
        let ok = CondenseConfig {
            threshold: Threshold::Fixed(0.9),
            max_share: 0.5,
            search: Search::LSH,
        };
        assert_eq!(ok.check(), Ok(()));
        let bad = |c: CondenseConfig, what: &str| {
            let e = c.check().unwrap_err().0;
            assert!(e.contains(what), "{e}");
        };
        let fixed = |h| CondenseConfig {
            threshold: Threshold::Fixed(h),
            ..ok
        };
        bad(fixed(0.0), "threshold of 0");
        bad(fixed(1.5), "threshold of 1.5");
        bad(fixed(f32::NAN), "threshold of NaN");
        bad(
            CondenseConfig {
                max_share: 1.5,
                ..ok
            },
            "share cap of 1.5",
        );
        bad(
            CondenseConfig {
                search: Search::Lsh { tables: 0, bits: 6 },
                ..ok
            },
            "0 signature tables",
        );
        assert!(ok.describe().contains("results differ"));
    }
}
