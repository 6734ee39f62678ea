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
pub(super) use forward::{forward_unit, ForwardScratch};

use super::{Kept, Operands};
use crate::math::Real;

/// Dot products one pass computes side by side (a 512-bit register of f32
/// lanes): the backward's keys against a query row, the forward's query
/// rows against a key.
const KEYS: usize = 16;

/// Partial sums a dot product keeps (head column c goes to sum c % 8).
const SUMS: usize = 8;

/// The backward's working space for a job: [`ROWS`](backward::ROWS) rows
/// of probabilities and of dP (then dS), a query row (or dout row) padded
/// with zeros to a multiple of [`SUMS`] columns, and a unit's keys (where
/// it recomputes the probabilities) and values transposed, (hd padded, S +
/// [`KEYS`]) each, the rows and columns past the real ones zero so that a
/// block may run past the last key and the last column. A zero column adds
/// +0 to a sum, which leaves it as it was: a sum that starts at +0 is
/// never −0 (in round-to-nearest, x + y = −0 only where both are −0).
pub(super) struct Scratch<R> {
    row: Vec<R>,
    dp: Vec<R>,
    padded: Vec<R>,
    kt: Vec<R>,
    vt: Vec<R>,
    stride: usize,
}

impl<R: Real> Scratch<R> {
    pub(super) fn backward(seq_len: usize, head_dim: usize, kept: Kept) -> Self {
        let query_rows = backward::ROWS;
        let (stride, rows) = (seq_len + KEYS, head_dim.div_ceil(SUMS) * SUMS);
        let keys = match kept {
            Kept::RowStats => rows * stride,
            Kept::Probabilities => 0,
        };
        Self {
            row: vec![R::zero(); query_rows * seq_len],
            dp: vec![R::zero(); query_rows * seq_len],
            padded: vec![R::zero(); rows],
            kt: vec![R::zero(); keys],
            vt: vec![R::zero(); rows * stride],
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
        let dots = eight_sums(padded, (&transposed[j0..], stride), scale);
        let n = (last + 1 - j0).min(KEYS);
        out[j0..j0 + n].copy_from_slice(&dots[..n]);
        j0 += KEYS;
    }
}

/// Sixteen dot products side by side, a lane each: lane l's is Σ_c
/// `scalars[c]` · `vectors[c·stride + l]` in eight partial sums (column c
/// into sum c % 8, in order of c) added pairwise, times `scale` — the
/// sums and order of [`dot`](super::super::attention::dot). `scalars` is
/// padded with zeros to a multiple of [`SUMS`], and so are the vectors'
/// columns past it. The backward takes a query row against sixteen keys,
/// the forward sixteen query rows against a key.
#[inline(always)]
fn eight_sums<R: Real>(scalars: &[R], (vectors, stride): (&[R], usize), scale: R) -> [R; KEYS] {
    // Each sum a variable of its own (so a register: an array of them
    // ends on the stack).
    let zero = [R::zero(); KEYS];
    let (mut s0, mut s1, mut s2, mut s3) = (zero, zero, zero, zero);
    let (mut s4, mut s5, mut s6, mut s7) = (zero, zero, zero, zero);
    for (c0, a) in scalars.chunks_exact(SUMS).enumerate() {
        let at = |l: usize| &vectors[(c0 * SUMS + l) * stride..];
        add_product(&mut s0, a[0], at(0));
        add_product(&mut s1, a[1], at(1));
        add_product(&mut s2, a[2], at(2));
        add_product(&mut s3, a[3], at(3));
        add_product(&mut s4, a[4], at(4));
        add_product(&mut s5, a[5], at(5));
        add_product(&mut s6, a[6], at(6));
        add_product(&mut s7, a[7], at(7));
    }
    let mut dots = [R::zero(); KEYS];
    for l in 0..KEYS {
        let low = (s0[l] + s4[l]) + (s1[l] + s5[l]);
        let high = (s2[l] + s6[l]) + (s3[l] + s7[l]);
        dots[l] = (low + high) * scale;
    }
    dots
}

/// `acc[l]` += `w` · `lanes[l]` for the first [`KEYS`] lanes.
#[inline(always)]
fn add_product<R: Real>(acc: &mut [R; KEYS], w: R, lanes: &[R]) {
    let lanes: &[R; KEYS] = lanes[..KEYS].try_into().expect("KEYS lanes");
    for l in 0..KEYS {
        acc[l] += w * lanes[l];
    }
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
