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
//! after the other, vectorized over the head dimension.

#![allow(clippy::needless_range_loop)]

use super::{Kept, Operands};
use crate::math::vector_isa::multiversioned;
use crate::math::Real;

/// Keys whose dot products one pass computes side by side (a 512-bit
/// register of f32 lanes).
const KEYS: usize = 16;

/// Partial sums a dot product keeps (head column c goes to sum c % 8).
const SUMS: usize = 8;

/// A job's working space: a row of probabilities, a row of dP (then dS),
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
        Self::new(seq_len, head_dim, (true, false))
    }

    /// The backward's: the values transposed, and the keys where it
    /// recomputes the probabilities.
    pub(super) fn backward(seq_len: usize, head_dim: usize, kept: Kept) -> Self {
        Self::new(seq_len, head_dim, (kept == Kept::RowStats, true))
    }

    fn new(seq_len: usize, head_dim: usize, (keys, values): (bool, bool)) -> Self {
        let (stride, rows) = (seq_len + KEYS, head_dim.div_ceil(SUMS) * SUMS);
        let transposed = |wanted: bool| vec![R::zero(); if wanted { rows * stride } else { 0 }];
        Self {
            row: vec![R::zero(); seq_len],
            dp: vec![R::zero(); seq_len],
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
        let mut sums = [[R::zero(); KEYS]; SUMS];
        for (c0, a) in padded.chunks_exact(SUMS).enumerate() {
            // Unrolled, l is a constant and each sum a register.
            for (l, sum) in sums.iter_mut().enumerate() {
                let at = (c0 * SUMS + l) * stride + j0;
                let keys: &[R; KEYS] = transposed[at..at + KEYS].try_into().expect("KEYS keys");
                for k in 0..KEYS {
                    sum[k] += a[l] * keys[k];
                }
            }
        }
        // Lane by lane (so the sums stay registers), then the keys wanted.
        let mut dots = [R::zero(); KEYS];
        let [s0, s1, s2, s3, s4, s5, s6, s7] = sums;
        for l in 0..KEYS {
            dots[l] =
                (((s0[l] + s4[l]) + (s1[l] + s5[l])) + ((s2[l] + s6[l]) + (s3[l] + s7[l]))) * scale;
        }
        let n = (last + 1 - j0).min(KEYS);
        out[j0..j0 + n].copy_from_slice(&dots[..n]);
        j0 += KEYS;
    }
}

/// The largest of `row` (its first where several are equal; NaNs
/// skipped), taken [`KEYS`] lanes at a time: the same value as one
/// running maximum (a set of numbers has one largest; +0 and −0, the one
/// pair that compares equal with different bits, give the same `exp(x −
/// max)` for every x).
#[inline(always)]
fn row_max<R: Real>(row: &[R]) -> R {
    let mut lanes = [R::from_f64(f64::NEG_INFINITY); KEYS];
    let mut blocks = row.chunks_exact(KEYS);
    for block in &mut blocks {
        for (m, &v) in lanes.iter_mut().zip(block) {
            if v > *m {
                *m = v;
            }
        }
    }
    let mut max = R::from_f64(f64::NEG_INFINITY);
    for &v in lanes.iter().chain(blocks.remainder()) {
        if v > max {
            max = v;
        }
    }
    max
}

/// `acc[c]` += Σ_j `weights[j]` · `rows[j·stride + c]`, in order of j for
/// each column c (as a loop over the keys adding one product at a time
/// would), the columns held in registers across the keys: 32 at a time
/// (two independent chains of adds), then 16, then one by one.
#[inline(always)]
fn add_weighted_rows<R: Real>(acc: &mut [R], weights: &[R], rows: &[R], stride: usize) {
    let mut c0 = 0;
    while c0 + 2 * KEYS <= acc.len() {
        add_weighted_columns::<R, { 2 * KEYS }>(acc, c0, weights, rows, stride);
        c0 += 2 * KEYS;
    }
    if c0 + KEYS <= acc.len() {
        add_weighted_columns::<R, KEYS>(acc, c0, weights, rows, stride);
        c0 += KEYS;
    }
    for c in c0..acc.len() {
        for (j, &w) in weights.iter().enumerate() {
            acc[c] += w * rows[j * stride + c];
        }
    }
}

/// [`add_weighted_rows`] for columns c0..c0 + W.
#[inline(always)]
fn add_weighted_columns<R: Real, const W: usize>(
    acc: &mut [R],
    c0: usize,
    weights: &[R],
    rows: &[R],
    stride: usize,
) {
    let sums: &mut [R; W] = (&mut acc[c0..c0 + W]).try_into().expect("W columns");
    let mut held = *sums;
    for (j, &w) in weights.iter().enumerate() {
        let at = j * stride + c0;
        let row: &[R; W] = rows[at..at + W].try_into().expect("W columns");
        for k in 0..W {
            held[k] += w * row[k];
        }
    }
    *sums = held;
}

/// `dst[c]` += `w` · `src[c]` (a plain loop, which the compiler
/// vectorizes better here than fixed-size arrays).
#[inline(always)]
fn add_scaled<R: Real>(dst: &mut [R], w: R, src: &[R]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d += w * s;
    }
}

/// `row[j]` = exp(`row[j]` − max); returns their sum, added key after key.
/// The exps run in a loop of their own, which vectorizes; the sum keeps
/// its order.
#[inline(always)]
fn exp_and_sum<R: Real>(row: &mut [R], max: R) -> R {
    for p in row.iter_mut() {
        *p = (*p - max).exp();
    }
    let mut sum = R::zero();
    for &p in row.iter() {
        sum += p;
    }
    sum
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
    let shape = x.shape;
    let (s, hd, group, qw) = (shape.seq_len, shape.head_dim, x.group(), shape.q_width());
    let scale = R::one() / R::from_f64(hd as f64).sqrt();
    let ow = group * hd;
    transpose_keys(x, (b, g), x.k, &mut scratch.kt, scratch.stride);
    for (n, h) in (g * group..(g + 1) * group).enumerate() {
        for i in 0..s {
            let first = x.first(b, i);
            let r = n * s + i; // this unit's row
            let row = match x.kept {
                Kept::Probabilities => &mut saved[r * s..(r + 1) * s],
                Kept::RowStats => &mut scratch.row[..],
            };
            let qi_at = (b * s + i) * qw + h * hd;
            let qi = &x.q[qi_at..qi_at + hd];
            let a = (qi, &mut scratch.padded[..]);
            dots(row, a, &scratch.kt, scratch.stride, first..=i, scale);
            let max = row_max(&row[first..=i]);
            let sum = exp_and_sum(&mut row[first..=i], max);
            for p in &mut row[first..=i] {
                *p = *p / sum;
            }
            let oi = &mut out[i * ow + n * hd..i * ow + (n + 1) * hd];
            let values = &x.v[x.key(b, g, first)..];
            add_weighted_rows(oi, &row[first..=i], values, shape.kv_width());
            if x.kept == Kept::RowStats {
                saved[2 * r] = max;
                saved[2 * r + 1] = sum;
            }
        }
    }
}

multiversioned! {
    /// The backward of one unit: `dq` (S, group·hd) and `dk`, `dv` (S, hd)
    /// its slices, added to.
    pub(super) fn backward_unit<R: Real>(
        x: &Operands<'_, R>,
        unit: (usize, usize),
        dout: &[R],
        saved: &[R],
        grads: [&mut [R]; 3],
        scratch: &mut Scratch<R>,
    ) => backward_unit_body;
}

#[inline(always)]
fn backward_unit_body<R: Real>(
    x: &Operands<'_, R>,
    (b, g): (usize, usize),
    dout: &[R],
    saved: &[R],
    [dq, dk, dv]: [&mut [R]; 3],
    scratch: &mut Scratch<R>,
) {
    let s = x.shape;
    let (sl, hd, group, qw) = (s.seq_len, s.head_dim, x.group(), s.q_width());
    let scale = R::one() / R::from_f64(hd as f64).sqrt();
    let ow = group * hd;
    let Scratch {
        row: recomputed,
        dp,
        padded,
        kt,
        vt,
        stride,
    } = scratch;
    let stride = *stride;
    if x.kept == Kept::RowStats {
        transpose_keys(x, (b, g), x.k, kt, stride);
    }
    transpose_keys(x, (b, g), x.v, vt, stride);
    for (n, h) in (g * group..(g + 1) * group).enumerate() {
        for i in 0..sl {
            let first = x.first(b, i);
            let r = n * sl + i;
            let qi_at = (b * sl + i) * qw + h * hd;
            let qi = &x.q[qi_at..qi_at + hd];
            let row: &[R] = match x.kept {
                Kept::Probabilities => &saved[r * sl..(r + 1) * sl],
                Kept::RowStats => {
                    dots(recomputed, (qi, padded), kt, stride, first..=i, scale);
                    let (max, sum) = (saved[2 * r], saved[2 * r + 1]);
                    for p in &mut recomputed[first..=i] {
                        *p = (*p - max).exp();
                    }
                    for p in &mut recomputed[first..=i] {
                        *p = *p / sum;
                    }
                    recomputed
                }
            };
            let doi = &dout[qi_at..qi_at + hd];
            // dP_ij = dout_i · v_j;  dv_j += P_ij dout_i
            dots(dp, (doi, padded), vt, stride, first..=i, R::one());
            let mut weighted = R::zero();
            for j in first..=i {
                weighted += row[j] * dp[j];
                add_scaled(&mut dv[j * hd..(j + 1) * hd], row[j], doi);
            }
            // dScore_ij = P_ij (dP_ij − Σ_j' P_ij' dP_ij') · scale
            for (ds, &p) in dp[first..=i].iter_mut().zip(&row[first..=i]) {
                *ds = p * (*ds - weighted) * scale;
            }
            let dqi = &mut dq[i * ow + n * hd..i * ow + (n + 1) * hd];
            let keys = &x.k[x.key(b, g, first)..];
            add_weighted_rows(dqi, &dp[first..=i], keys, s.kv_width());
            for j in first..=i {
                add_scaled(&mut dk[j * hd..(j + 1) * hd], dp[j], qi);
            }
        }
    }
}
