//! One unit's attention (a sequence's query heads that read one kv head),
//! forward and backward, a query row at a time, with the row's dot
//! products against the keys (q·k, and dout·v in the backward) taken
//! [`KEYS`] keys at a time from the unit's keys and values transposed
//! (head dimension × token): each of the block's keys a vector lane,
//! summed in the same eight partial sums and the same order as
//! [`dot`](super::super::attention::dot) sums one key, so the same bits,
//! at the full width of the vectors rather than one key at a time with a
//! horizontal add. Everything else sums as the plain functions do: the
//! chains over a row's keys (the softmax's sum, the backward's Σ P·dP)
//! one key after the other; a row's output and its dq, key after key,
//! held in registers across the keys; dk's and dv's rows, one query row
//! after the other, vectorized over the head dimension. The forward takes
//! a unit's query heads two at a time, row by row: the two heads read the
//! same keys and values, so their chains of adds (the softmax's sums, the
//! outputs') run side by side, each in its own order, and each value row
//! is read once for both. The backward (`backward.rs`) takes a head's
//! query rows a block at a time.

#![allow(clippy::needless_range_loop)]

mod backward;

pub(super) use backward::backward_unit;

use super::{Kept, Operands};
use crate::math::vector_isa::multiversioned;
use crate::math::{lane_max, Real};

/// Keys whose dot products one pass computes side by side (a 512-bit
/// register of f32 lanes).
const KEYS: usize = 16;

/// Partial sums a dot product keeps (head column c goes to sum c % 8).
const SUMS: usize = 8;

/// A job's working space: rows of probabilities and rows of dP (then dS;
/// in the forward, a second head's probabilities), a row each in the
/// forward and [`ROWS`](backward::ROWS) in the backward,
/// a query row (or dout row) padded with zeros to a multiple of [`SUMS`]
/// columns, and a unit's keys and values transposed where the pass reads
/// them, (hd padded, S + [`KEYS`]) each, the rows and columns past the
/// real ones zero so that a block may run past the last key and the last
/// column. A zero column adds +0 to a sum, which leaves it as it was: a
/// sum that starts at +0 is never −0 (in round-to-nearest, x + y = −0 only
/// where both are −0).
pub(super) struct Scratch<R> {
    row: Vec<R>,
    dp: Vec<R>,
    padded: Vec<R>,
    kt: Vec<R>,
    vt: Vec<R>,
    stride: usize,
}

impl<R: Real> Scratch<R> {
    /// The forward's: the keys transposed, not the values.
    pub(super) fn forward(seq_len: usize, head_dim: usize) -> Self {
        Self::new(seq_len, head_dim, (true, false), 1)
    }

    /// The backward's: the values transposed, and the keys where it
    /// recomputes the probabilities.
    pub(super) fn backward(seq_len: usize, head_dim: usize, kept: Kept) -> Self {
        Self::new(
            seq_len,
            head_dim,
            (kept == Kept::RowStats, true),
            backward::ROWS,
        )
    }

    /// `query_rows` rows of probabilities and of dP.
    fn new(
        seq_len: usize,
        head_dim: usize,
        (keys, values): (bool, bool),
        query_rows: usize,
    ) -> Self {
        let (stride, rows) = (seq_len + KEYS, head_dim.div_ceil(SUMS) * SUMS);
        let transposed = |wanted: bool| vec![R::zero(); if wanted { rows * stride } else { 0 }];
        Self {
            row: vec![R::zero(); query_rows * seq_len],
            dp: vec![R::zero(); query_rows * seq_len],
            padded: vec![R::zero(); rows],
            kt: transposed(keys),
            vt: transposed(values),
            stride,
        }
    }
}

/// `to[c·stride + j]` = token j's column c of kv head g of sequence b in
/// `from` (k or v).
fn transpose_keys<R: Real>(
    x: &Operands<'_, R>,
    (b, g): (usize, usize),
    from: &[R],
    to: &mut [R],
    stride: usize,
) {
    let (s, hd) = (x.shape.seq_len, x.shape.head_dim);
    for j in 0..s {
        let at = x.key(b, g, j);
        for (c, &value) in from[at..at + hd].iter().enumerate() {
            to[c * stride + j] = value;
        }
    }
}

/// `out[j]` = (`a` · key j) · `scale` for j in `keys` (a range of key
/// tokens), the keys' columns read from `transposed` (`padded.len()` rows
/// of `stride`): for each block of [`KEYS`] keys, eight partial sums a
/// key (head column c into sum c % 8, in order of c), added pairwise at
/// the end — `dot`'s sums and order, a key a lane. `padded` receives `a`
/// followed by zeros.
#[inline(always)]
fn dots<R: Real>(
    out: &mut [R],
    (a, padded): (&[R], &mut [R]),
    transposed: &[R],
    stride: usize,
    keys: std::ops::RangeInclusive<usize>,
    scale: R,
) {
    padded[..a.len()].copy_from_slice(a);
    let (first, last) = (*keys.start(), *keys.end());
    let mut j0 = first;
    while j0 <= last {
        // Eight sums, each a variable of its own (so a register: an array
        // of them ends on the stack).
        let zero = [R::zero(); KEYS];
        let (mut s0, mut s1, mut s2, mut s3) = (zero, zero, zero, zero);
        let (mut s4, mut s5, mut s6, mut s7) = (zero, zero, zero, zero);
        for (c0, a) in padded.chunks_exact(SUMS).enumerate() {
            let at = |l: usize| (c0 * SUMS + l) * stride + j0;
            add_product(&mut s0, a[0], &transposed[at(0)..]);
            add_product(&mut s1, a[1], &transposed[at(1)..]);
            add_product(&mut s2, a[2], &transposed[at(2)..]);
            add_product(&mut s3, a[3], &transposed[at(3)..]);
            add_product(&mut s4, a[4], &transposed[at(4)..]);
            add_product(&mut s5, a[5], &transposed[at(5)..]);
            add_product(&mut s6, a[6], &transposed[at(6)..]);
            add_product(&mut s7, a[7], &transposed[at(7)..]);
        }
        // A whole register at a time, then the keys wanted.
        let (low, high) = (
            lanes_add(lanes_add(s0, s4), lanes_add(s1, s5)),
            lanes_add(lanes_add(s2, s6), lanes_add(s3, s7)),
        );
        let mut dots = lanes_add(low, high);
        for d in &mut dots {
            *d *= scale;
        }
        let n = (last + 1 - j0).min(KEYS);
        out[j0..j0 + n].copy_from_slice(&dots[..n]);
        j0 += KEYS;
    }
}

/// `sum[k]` += `w` · `keys[k]` for the first [`KEYS`] keys.
#[inline(always)]
fn add_product<R: Real>(sum: &mut [R; KEYS], w: R, keys: &[R]) {
    let keys: &[R; KEYS] = keys[..KEYS].try_into().expect("KEYS keys");
    for k in 0..KEYS {
        sum[k] += w * keys[k];
    }
}

/// `a` + `b`, lane by lane.
#[inline(always)]
fn lanes_add<R: Real>(mut a: [R; KEYS], b: [R; KEYS]) -> [R; KEYS] {
    for (a, b) in a.iter_mut().zip(b) {
        *a += b;
    }
    a
}

/// `accs[k][c]` += Σ_j `weights[k][j]` · `rows[j·stride + c]` for each of
/// N accumulators (the same width), in order of j for each k and column c
/// (as a loop over the keys adding one product at a time would), the
/// columns held in registers across the keys and each row of `rows` read
/// once for all N: for one accumulator 32 columns at a time (two
/// independent chains of adds), for several 16 at a time (each a chain),
/// then one by one.
#[inline(always)]
fn add_weighted_rows<R: Real, const N: usize>(
    mut accs: [&mut [R]; N],
    weights: [&[R]; N],
    rows: &[R],
    stride: usize,
) {
    let width = accs[0].len();
    debug_assert!(accs.iter().all(|acc| acc.len() == width));
    let mut c0 = 0;
    // 32 columns of two accumulators are not kept in registers (the
    // compiler turns them into scalar adds on the stack).
    while N == 1 && c0 + 2 * KEYS <= width {
        add_weighted_columns::<R, N, { 2 * KEYS }>(&mut accs, c0, weights, rows, stride);
        c0 += 2 * KEYS;
    }
    while c0 + KEYS <= width {
        add_weighted_columns::<R, N, KEYS>(&mut accs, c0, weights, rows, stride);
        c0 += KEYS;
    }
    for (acc, weights) in accs.iter_mut().zip(weights) {
        for c in c0..width {
            for (j, &w) in weights.iter().enumerate() {
                acc[c] += w * rows[j * stride + c];
            }
        }
    }
}

/// [`add_weighted_rows`] for columns c0..c0 + W.
#[inline(always)]
fn add_weighted_columns<R: Real, const N: usize, const W: usize>(
    accs: &mut [&mut [R]; N],
    c0: usize,
    weights: [&[R]; N],
    rows: &[R],
    stride: usize,
) {
    let mut held: [[R; W]; N] =
        std::array::from_fn(|k| accs[k][c0..c0 + W].try_into().expect("W columns"));
    let keys = weights[0].len();
    let weights = weights.map(|w| &w[..keys]);
    for j in 0..keys {
        let at = j * stride + c0;
        let row: &[R; W] = rows[at..at + W].try_into().expect("W columns");
        for (held, weights) in held.iter_mut().zip(weights) {
            let w = weights[j];
            for c in 0..W {
                held[c] += w * row[c];
            }
        }
    }
    for (acc, held) in accs.iter_mut().zip(held) {
        acc[c0..c0 + W].copy_from_slice(&held);
    }
}

/// `dst[c]` += `w` · `src[c]` (a plain loop, which the compiler
/// vectorizes better here than fixed-size arrays).
#[inline(always)]
fn add_scaled<R: Real>(dst: &mut [R], w: R, src: &[R]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d += w * s;
    }
}

multiversioned! {
    /// The forward of one unit, kv head g of sequence b: `out` (S,
    /// group·hd) its heads' outputs, `saved` what they keep.
    pub(super) fn forward_unit<R: Real>(
        x: &Operands<'_, R>,
        unit: (usize, usize),
        out: &mut [R],
        saved: &mut [R],
        scratch: &mut Scratch<R>,
    ) => forward_unit_body;
}

#[inline(always)]
fn forward_unit_body<R: Real>(
    x: &Operands<'_, R>,
    (b, g): (usize, usize),
    out: &mut [R],
    saved: &mut [R],
    scratch: &mut Scratch<R>,
) {
    let group = x.group();
    transpose_keys(x, (b, g), x.k, &mut scratch.kt, scratch.stride);
    // The unit's heads two at a time: a row of each, on the same keys,
    // their chains of adds side by side (each head's own order kept).
    let mut n = 0;
    while n + 2 <= group {
        for i in 0..x.shape.seq_len {
            forward_rows::<R, 2>(x, (b, g), [n, n + 1], i, out, saved, scratch);
        }
        n += 2;
    }
    if n < group {
        for i in 0..x.shape.seq_len {
            forward_rows::<R, 1>(x, (b, g), [n], i, out, saved, scratch);
        }
    }
}

/// Query row i of the unit's heads `heads` (N of them, unit-local): its
/// scores, softmax and output, each head's as [`forward_unit`] computes
/// one alone. The heads' softmax sums and outputs run side by side, each
/// its own chain in key order (the values' rows read once for all).
#[inline(always)]
fn forward_rows<R: Real, const N: usize>(
    x: &Operands<'_, R>,
    (b, g): (usize, usize),
    heads: [usize; N],
    i: usize,
    out: &mut [R],
    saved: &mut [R],
    scratch: &mut Scratch<R>,
) {
    let shape = x.shape;
    let (s, hd, qw) = (shape.seq_len, shape.head_dim, shape.q_width());
    let scale = R::one() / R::from_f64(hd as f64).sqrt();
    let ow = x.group() * hd;
    let first = x.first(b, i);
    let keys = first..=i;
    let Scratch {
        row,
        dp,
        padded,
        kt,
        stride,
        ..
    } = scratch;
    // Each head's row: its kept probabilities, else a scratch row.
    let rows: [&mut [R]; N] = match x.kept {
        Kept::Probabilities => {
            let at = heads.map(|n| (n * s + i) * s..(n * s + i + 1) * s);
            saved[..]
                .get_disjoint_mut(at)
                .expect("distinct heads' rows")
        }
        Kept::RowStats => {
            let mut spare = [&mut row[..], &mut dp[..]].into_iter();
            std::array::from_fn(|_| spare.next().expect("two scratch rows"))
        }
    };
    let mut max = [R::zero(); N];
    for k in 0..N {
        let h = g * x.group() + heads[k];
        let qi_at = (b * s + i) * qw + h * hd;
        let qi = &x.q[qi_at..qi_at + hd];
        dots(rows[k], (qi, padded), kt, *stride, keys.clone(), scale);
        max[k] = lane_max(&rows[k][keys.clone()]);
        for p in &mut rows[k][keys.clone()] {
            *p = (*p - max[k]).exp();
        }
    }
    let mut sum = [R::zero(); N];
    for j in keys.clone() {
        for k in 0..N {
            sum[k] += rows[k][j];
        }
    }
    for k in 0..N {
        for p in &mut rows[k][keys.clone()] {
            *p = *p / sum[k];
        }
    }
    let at = heads.map(|n| i * ow + n * hd..i * ow + (n + 1) * hd);
    let outs = out.get_disjoint_mut(at).expect("distinct heads' columns");
    let weights = std::array::from_fn(|k| &rows[k][keys.clone()]);
    let values = &x.v[x.key(b, g, first)..];
    add_weighted_rows(outs, weights, values, shape.kv_width());
    if x.kept == Kept::RowStats {
        for k in 0..N {
            let r = heads[k] * s + i;
            saved[2 * r] = max[k];
            saved[2 * r + 1] = sum[k];
        }
    }
}
