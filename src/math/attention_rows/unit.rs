//! One unit's attention (a sequence's query heads that read one kv head),
//! forward (`forward.rs`: a head's query rows sixteen at a time, a row a
//! vector lane) and backward (`backward.rs`: a query row at a time, or a
//! few side by side). The backward's dot products against the keys (q·k
//! where it recomputes the probabilities, and dout·v) are taken [`KEYS`]
//! keys at a time from the unit's keys and values transposed (head
//! dimension × token): each of the block's keys a vector lane, summed in
//! the same eight partial sums and the same order as
//! [`dot`](super::super::attention::dot) sums one key, so the same bits,
//! at the full width of the vectors rather than one key at a time with a
//! horizontal add. Everything else sums as the plain functions do: the
//! chains over a row's keys (the softmax's sum, the backward's Σ P·dP)
//! one key after the other; a row's output and its dq, key after key,
//! held in registers across the keys; dk's and dv's rows, one query row
//! after the other, vectorized over the head dimension.

#![allow(clippy::needless_range_loop)]

mod backward;
mod forward;

pub(super) use backward::backward_unit;
pub(super) use forward::forward_unit;

use super::{Kept, Operands};
use crate::math::Real;

/// Keys whose dot products one pass computes side by side (a 512-bit
/// register of f32 lanes).
const KEYS: usize = 16;

/// Partial sums a dot product keeps (head column c goes to sum c % 8).
const SUMS: usize = 8;

/// A job's working space. The backward's: [`ROWS`](backward::ROWS) rows
/// of probabilities and of dP (then dS),
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
    /// The forward's: a block of [`LANES`](forward::LANES) rows of
    /// probabilities (a key's lanes side by side), the block's query rows
    /// transposed, and the unit's keys and values as rows padded with
    /// zeros to a multiple of [`SUMS`] columns (`stride` their width).
    pub(super) fn forward(seq_len: usize, head_dim: usize) -> Self {
        let (lanes, width) = (forward::LANES, head_dim.div_ceil(SUMS) * SUMS);
        Self {
            row: vec![R::zero(); lanes * seq_len],
            dp: Vec::new(),
            padded: vec![R::zero(); width * lanes],
            kt: vec![R::zero(); seq_len * width],
            vt: vec![R::zero(); seq_len * width],
            stride: width,
        }
    }

    /// The backward's: the values transposed, and the keys where it
    /// recomputes the probabilities.
    pub(super) fn backward(seq_len: usize, head_dim: usize, kept: Kept) -> Self {
        let (keys, values) = (kept == Kept::RowStats, true);
        let query_rows = backward::ROWS;
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
