//! [`DenseResidence`]: dense params that stay in a backend's own memory
//! between steps, with their AdamW moments, and are updated there.
//!
//! A GPU that runs the dense layers holds each weight it was given (a
//! slice of the engine's dense params) from its first use on. Without
//! residence those uploads are dropped at every update, so each step moves
//! the dense params up and their gradient down. With it, the weights the
//! device holds are stepped on the device (the same AdamW element update
//! as the cpu's, bit for bit), their gradients never leave it, and the
//! host's copy is brought up to date only when asked ([`sync`]: for a
//! checkpoint, or to read the params). The engine steps the rest (what no
//! kernel of the device reads, such as a frozen tensor) on the cpu.
//!
//! [`sync`]: DenseResidence::sync

use std::ops::Range;

use strata_optim::StepScalars;

use crate::EngineError;

/// The dense params a backend keeps and steps in its own memory.
///
/// A step, in resident mode: the kernels sum the weight gradients on the
/// device between `grads_begin` and [`finish_grads`] (which replaces
/// `grads_flush`); the engine steps with AdamW on the host what is not
/// [`held`], and calls [`step`] for the rest. Moments are packed over the
/// trainable runs (the complement of the frozen ranges), as the engine
/// keeps them.
///
/// [`finish_grads`]: DenseResidence::finish_grads
/// [`held`]: DenseResidence::held
/// [`step`]: DenseResidence::step
pub trait DenseResidence {
    /// Ends the step's gradient in place of `grads_flush`. What was summed
    /// on the device for params it does not hold is added into `grad`;
    /// what it holds stays there, and whatever the host wrote into the
    /// held part of `grad` is added to it there and zeroed in `grad`.
    /// Returns the sum of squares (f64) of the held gradient over
    /// `trainable` when `norm` is asked (for clipping), else 0.
    fn finish_grads(
        &self,
        grad: &mut [f32],
        trainable: &[Range<usize>],
        norm: bool,
    ) -> Result<f64, EngineError>;

    /// The params held here, sorted and disjoint: the engine steps the
    /// others on the host.
    fn held(&self) -> Vec<Range<usize>>;

    /// AdamW with `s` on the held params' trainable parts, with the
    /// gradient `finish_grads` ended. A part stepped here for the first
    /// time takes its moments from `m` and `v` (packed over `trainable`).
    fn step(
        &self,
        s: &StepScalars,
        trainable: &[Range<usize>],
        m: &[f32],
        v: &[f32],
    ) -> Result<(), EngineError>;

    /// Copies the held params, and the moments of their trainable parts,
    /// into the host's `params`, `m` and `v`.
    fn sync(
        &self,
        params: &mut [f32],
        trainable: &[Range<usize>],
        m: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), EngineError>;
}

/// The parts of `range` that lie in `trainable` (sorted, disjoint), each
/// with where its moments start in the packed moments.
pub fn trainable_parts(
    range: Range<usize>,
    trainable: &[Range<usize>],
) -> Vec<(Range<usize>, usize)> {
    let mut packed = 0;
    let mut parts = Vec::new();
    for t in trainable {
        let (lo, hi) = (t.start.max(range.start), t.end.min(range.end));
        if lo < hi {
            parts.push((lo..hi, packed + (lo - t.start)));
        }
        packed += t.len();
    }
    parts
}

/// `all` without the sorted, disjoint `held` ranges: what the host steps.
pub fn ranges_without(all: &[Range<usize>], held: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    for r in all {
        let mut start = r.start;
        for h in held.iter().filter(|h| h.start < r.end && h.end > r.start) {
            if h.start > start {
                out.push(start..h.start);
            }
            start = start.max(h.end);
        }
        if start < r.end {
            out.push(start..r.end);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trainable_parts_find_their_packed_moments() {
        let trainable = [0..4, 6..10, 12..20];
        assert_eq!(
            trainable_parts(2..8, &trainable),
            vec![(2..4, 2), (6..8, 4)]
        );
        assert!(trainable_parts(4..6, &trainable).is_empty());
        assert_eq!(trainable_parts(13..30, &trainable), vec![(13..20, 9)]);
    }

    #[test]
    fn held_ranges_are_cut_out_of_the_runs() {
        let runs = [0..10, 12..20];
        assert_eq!(ranges_without(&runs, &[]), vec![0..10, 12..20]);
        assert_eq!(
            ranges_without(&runs, &[2..4, 8..14]),
            vec![0..2, 4..8, 14..20]
        );
        assert!(ranges_without(&runs, &[0..12, 12..20]).is_empty());
        assert_eq!(
            ranges_without(&runs, &[10..12, 19..25]),
            vec![0..10, 12..19]
        );
    }
}
