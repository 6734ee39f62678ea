//! Dropless token permutation: a token's K assignments grouped into
//! contiguous per-expert rows in a stable order (no capacity, no padding),
//! and the gathers, scatters and weighted combine that move rows between
//! token order and expert order.

#![allow(clippy::needless_range_loop)]

use super::Real;
use crate::parallel::{for_row_blocks, rows_per_job, run_all};

/// Assignments (t, k) grouped by expert in a stable order: `order` lists
/// assignment indices (t·K + k) expert by expert, token order within each;
/// expert e's are `order[offsets[e]..offsets[e + 1]]`, and assignment a
/// is `order[position[a]]`.
///
/// A layer's experts write their outputs (and the gradients of their
/// inputs) in this order, each expert's rows one contiguous block of a
/// (T·K, D) buffer: row i belongs to assignment `order[i]`. The combine and
/// the gather's backward read them back through `position`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Permutation {
    pub order: Vec<u32>,
    pub offsets: Vec<u32>,
    pub position: Vec<u32>,
}

impl Permutation {
    /// A counting sort of the routing's (T, K) expert choices.
    pub fn from_routing(experts_per_token: &[u32], experts: usize) -> Self {
        let mut offsets = vec![0u32; experts + 1];
        for &e in experts_per_token {
            offsets[e as usize + 1] += 1;
        }
        for e in 0..experts {
            offsets[e + 1] += offsets[e];
        }
        let mut cursor = offsets.clone();
        let mut order = vec![0u32; experts_per_token.len()];
        let mut position = vec![0u32; experts_per_token.len()];
        for (a, &e) in experts_per_token.iter().enumerate() {
            let i = cursor[e as usize];
            order[i as usize] = a as u32;
            position[a] = i;
            cursor[e as usize] += 1;
        }
        Self {
            order,
            offsets,
            position,
        }
    }

    /// The spans alone, from the assignments per expert: `order` and
    /// `position` are empty. What the experts need where the assignments
    /// themselves stay in a GPU's memory: each expert's block of rows.
    pub fn from_counts(counts: &[u32]) -> Self {
        let mut offsets = vec![0u32; counts.len() + 1];
        for (e, &c) in counts.iter().enumerate() {
            offsets[e + 1] = offsets[e] + c;
        }
        Self {
            order: Vec::new(),
            offsets,
            position: Vec::new(),
        }
    }

    /// How many assignments `expert` took.
    pub fn count(&self, expert: usize) -> usize {
        self.span(expert).len()
    }

    /// The positions in `order` of `expert`'s assignments: the rows of an
    /// expert-ordered (T·K, D) buffer that are its.
    pub fn span(&self, expert: usize) -> std::ops::Range<usize> {
        self.offsets[expert] as usize..self.offsets[expert + 1] as usize
    }

    /// `expert`'s block of an expert-ordered (T·K, D) buffer `buf`.
    pub fn block_mut<'b, R>(&self, buf: &'b mut [R], expert: usize, d: usize) -> &'b mut [R] {
        let span = self.span(expert);
        &mut buf[span.start * d..span.end * d]
    }

    pub fn rows(&self, expert: usize) -> &[u32] {
        &self.order[self.span(expert)]
    }
}

/// rows (n, D) = x[token of each assignment]
pub fn gather_forward<R: Real>(rows: &mut [R], x: &[R], assignments: &[u32], k: usize, d: usize) {
    assert_eq!(rows.len(), assignments.len() * d);
    for_row_blocks(rows, d, d, |first, block| {
        for (r, row) in block.chunks_mut(d.max(1)).enumerate() {
            let t = assignments[first + r] as usize / k;
            row.copy_from_slice(&x[t * d..(t + 1) * d]);
        }
    });
}

/// y (T, D) = Σ_k w_tk · out[(t, k)], summed in k order, where assignment
/// a's row of the experts' outputs `expert_rows` (T·K, D) is `position[a]`
/// (a [`Permutation`]'s: expert order).
pub fn combine_forward<R: Real>(
    y: &mut [R],
    expert_rows: &[R],
    position: &[u32],
    weights: &[R],
    t: usize,
    k: usize,
    d: usize,
) {
    assert_eq!(y.len(), t * d);
    assert_eq!(expert_rows.len(), t * k * d);
    assert_eq!(position.len(), t * k);
    for_row_blocks(y, d, k * d, |first, block| {
        for (r, yi) in block.chunks_mut(d.max(1)).enumerate() {
            let i = first + r;
            // Row by row in k order from zero: the same sums, element by
            // element, as one accumulator over k.
            yi.fill(R::zero());
            for s in 0..k {
                let w = weights[i * k + s];
                let row = &expert_rows[position[i * k + s] as usize * d..][..d];
                for (o, &v) in yi.iter_mut().zip(row) {
                    *o += w * v;
                }
            }
        }
    });
}

/// dweights (T·K) = dy · out, each a sum over D in order, with the
/// experts' outputs `expert_rows` as in [`combine_forward`]. The gradient
/// of the assignments' outputs, w · dy, is not formed here: its users take
/// it row by row through [`AssignmentGrads`].
pub fn combine_backward_weights<R: Real>(
    dweights: &mut [R],
    dy: &[R],
    expert_rows: &[R],
    position: &[u32],
    t: usize,
    k: usize,
    d: usize,
) {
    assert_eq!(dweights.len(), t * k);
    assert_eq!(dy.len(), t * d);
    assert_eq!(expert_rows.len(), t * k * d);
    assert_eq!(position.len(), t * k);
    for_row_blocks(dweights, k, 2 * k * d, |first, dw| {
        for r in 0..dw.len() / k.max(1) {
            let i = first + r;
            for s in 0..k {
                let a = i * k + s;
                let row = &expert_rows[position[a] as usize * d..][..d];
                let mut dot = R::zero();
                for j in 0..d {
                    dot += dy[i * d + j] * row[j];
                }
                dw[r * k + s] = dot;
            }
        }
    });
}

/// The gradient of every assignment's output in the combine's backward:
/// row a = t·K + k is `weights[a] · dy[t]`. Held as its two factors (a
/// (T, D) and a (T·K) slice) and formed only for the rows an expert
/// gathers, so no (T·K, D) buffer is written and read back.
#[derive(Clone, Copy, Debug)]
pub struct AssignmentGrads<'a, R> {
    /// (T, D) the gradient of the combine's output
    pub dy: &'a [R],
    /// (T·K) each assignment's combine weight
    pub weights: &'a [R],
    pub k: usize,
    pub d: usize,
}

impl<R: Real> AssignmentGrads<'_, R> {
    /// `dst[r]` (n, D) = `weights[a] · dy[t(a)]` for each r-th assignment
    /// a of `rows`.
    pub fn gather(&self, dst: &mut [R], rows: &[u32]) {
        let (d, k) = (self.d, self.k);
        assert_eq!(dst.len(), rows.len() * d);
        for_row_blocks(dst, d, d, |first, block| {
            for (r, row) in block.chunks_mut(d.max(1)).enumerate() {
                let a = rows[first + r] as usize;
                let (w, t) = (self.weights[a], a / k);
                for (o, &g) in row.iter_mut().zip(&self.dy[t * d..(t + 1) * d]) {
                    *o = w * g;
                }
            }
        });
    }
}

/// dx (T, D) += Σ_k d in[(t, k)], in k order, where assignment a's input
/// gradient is row `position[a]` of `expert_rows` (T·K, D) (a
/// [`Permutation`]'s: expert order).
pub fn gather_backward<R: Real>(
    dx: &mut [R],
    expert_rows: &[R],
    position: &[u32],
    t: usize,
    k: usize,
    d: usize,
) {
    assert_eq!(dx.len(), t * d);
    assert_eq!(expert_rows.len(), t * k * d);
    assert_eq!(position.len(), t * k);
    for_row_blocks(dx, d, k * d, |first, block| {
        for (r, dxi) in block.chunks_mut(d.max(1)).enumerate() {
            let i = first + r;
            for s in 0..k {
                let row = &expert_rows[position[i * k + s] as usize * d..][..d];
                for (o, &v) in dxi.iter_mut().zip(row) {
                    *o += v;
                }
            }
        }
    });
}

/// `dst[a]` (T·K, D) = `src[r]` (n, D) for each r-th assignment a of `rows`:
/// an expert's rows put back in assignment order. The engine has no need
/// of it (its experts write in expert order, read through
/// [`Permutation::position`]); it is the CPU function the GPU kernel
/// `scatter_rows` is held to, and serves callers that want token order.
///
/// An expert's rows from a [`Permutation`] ascend, so blocks of them
/// write disjoint, ascending blocks of `dst`: those are shared over the
/// cores. Rows in any other order are copied on this thread.
pub fn scatter_to_assignments<R: Real>(dst: &mut [R], src: &[R], rows: &[u32], d: usize) {
    assert_eq!(src.len(), rows.len() * d);
    let per = rows_per_job(rows.len(), d);
    if per >= rows.len() || d == 0 || !rows.windows(2).all(|w| w[0] < w[1]) {
        for (r, &a) in rows.iter().enumerate() {
            let a = a as usize;
            dst[a * d..(a + 1) * d].copy_from_slice(&src[r * d..(r + 1) * d]);
        }
        return;
    }
    let mut jobs = Vec::new();
    let mut rest = dst;
    let mut base = 0; // the row of dst where `rest` starts
    for (rows, src) in rows.chunks(per).zip(src.chunks(per * d)) {
        let end = *rows.last().expect("chunks are not empty") as usize + 1;
        let (block, tail) = std::mem::take(&mut rest).split_at_mut((end - base) * d);
        rest = tail;
        let first = base;
        jobs.push(move || {
            for (r, &a) in rows.iter().enumerate() {
                let a = a as usize - first;
                block[a * d..(a + 1) * d].copy_from_slice(&src[r * d..(r + 1) * d]);
            }
        });
        base = end;
    }
    run_all(jobs);
}
