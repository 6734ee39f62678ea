//! One unit's backward, a head's query rows a block at a time. The
//! backward cannot pair heads as the forward does: two heads add into the
//! same dk and dv rows, whose order is one head's rows, then the next's.
//! It takes [`ROWS`] query rows of one head at once instead, where they
//! attend from the same first key: their chains (Σ P·dP, dq) run side by
//! side, each in key order, and each of dk's and dv's rows is read and
//! written once for the block, its terms added row after row as one row at
//! a time would add them. Rows whose first keys differ (a document starts
//! among them) go one at a time.

#![allow(clippy::needless_range_loop)]

use super::{add_scaled, add_weighted_rows, dots, transpose_keys, Scratch, KEYS};
use crate::math::attention_rows::{Kept, Operands};
use crate::math::vector_isa::multiversioned;
use crate::math::Real;

/// Query rows of one head the backward takes at a time.
pub(super) const ROWS: usize = 4;

multiversioned! {
    /// The backward of one unit: `dq` (S, group·hd) and `dk`, `dv` (S, hd)
    /// its slices, added to.
    pub(in crate::math::attention_rows) fn backward_unit<R: Real>(
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
    let sl = x.shape.seq_len;
    if x.kept == Kept::RowStats {
        transpose_keys(x, (b, g), x.k, &mut scratch.kt, scratch.stride);
    }
    transpose_keys(x, (b, g), x.v, &mut scratch.vt, scratch.stride);
    for n in 0..x.group() {
        let mut i = 0;
        while i < sl {
            let block = i + ROWS <= sl && (i..i + ROWS).all(|r| x.first(b, r) == x.first(b, i));
            let grads = [&mut dq[..], &mut dk[..], &mut dv[..]];
            if block {
                backward_rows::<R, ROWS>(x, (b, g, n), i, dout, saved, grads, scratch);
                i += ROWS;
            } else {
                backward_rows::<R, 1>(x, (b, g, n), i, dout, saved, grads, scratch);
                i += 1;
            }
        }
    }
}

/// Query rows i0..i0 + N of the unit's head n, which attend from the same
/// first key: each row's gradients as the plain backward sums them, the
/// rows' chains (Σ P·dP, dq) side by side, and dk's and dv's rows read
/// and written once for the N rows, their terms added row after row.
#[inline(always)]
fn backward_rows<R: Real, const N: usize>(
    x: &Operands<'_, R>,
    (b, g, n): (usize, usize, usize),
    i0: usize,
    dout: &[R],
    saved: &[R],
    [dq, dk, dv]: [&mut [R]; 3],
    scratch: &mut Scratch<R>,
) {
    let s = x.shape;
    let (sl, hd, qw) = (s.seq_len, s.head_dim, s.q_width());
    let scale = R::one() / R::from_f64(hd as f64).sqrt();
    let first = x.first(b, i0);
    let Scratch {
        row: recomputed,
        dp,
        padded,
        kt,
        vt,
        stride,
    } = scratch;
    let stride = *stride;
    let q_at = |k: usize| (b * sl + i0 + k) * qw + (g * x.group() + n) * hd;
    let qs: [&[R]; N] = std::array::from_fn(|k| &x.q[q_at(k)..q_at(k) + hd]);
    let dos: [&[R]; N] = std::array::from_fn(|k| &dout[q_at(k)..q_at(k) + hd]);
    let scratch = (&mut padded[..], &kt[..], stride);
    let rows = probability_rows::<R, N>(x, (b, g, n), (first, i0), saved, recomputed, scratch);
    // dP_ij = dout_i · v_j
    for (k, dp) in dp.chunks_exact_mut(sl).take(N).enumerate() {
        dots(dp, (dos[k], padded), vt, stride, first..=i0 + k, R::one());
    }
    let mut dps = dp.chunks_exact_mut(sl);
    let dp: [&mut [R]; N] = std::array::from_fn(|_| dps.next().expect("a dP row a query row"));
    // Σ_j P_ij dP_ij, each row's chain in key order.
    let mut weighted = [R::zero(); N];
    for j in first..=i0 {
        for k in 0..N {
            weighted[k] += rows[k][j] * dp[k][j];
        }
    }
    for k in 1..N {
        for j in i0 + 1..=i0 + k {
            weighted[k] += rows[k][j] * dp[k][j];
        }
    }
    // dv_j += P_ij dout_i
    add_rows_scaled(dv, hd, (first, i0), &rows, dos);
    // dScore_ij = P_ij (dP_ij − Σ_j' P_ij' dP_ij') · scale
    for k in 0..N {
        let keys = first..=i0 + k;
        for (ds, &p) in dp[k][keys.clone()].iter_mut().zip(&rows[k][keys]) {
            *ds = p * (*ds - weighted[k]) * scale;
        }
    }
    let ds: [&[R]; N] = dp.map(|ds| &*ds);
    add_dq_rows(x, (b, g, n), (first, i0), &ds, dq);
    // dk_j += dScore_ij q_i
    add_rows_scaled(dk, hd, (first, i0), &ds, qs);
}

/// Query rows i0..i0 + N of the unit's head n, attending from key
/// `first`: the kept probabilities, else each recomputed into a row of
/// `recomputed` from its max and sum.
#[inline(always)]
fn probability_rows<'a, R: Real, const N: usize>(
    x: &Operands<'_, R>,
    (b, g, n): (usize, usize, usize),
    (first, i0): (usize, usize),
    saved: &'a [R],
    recomputed: &'a mut [R],
    (padded, kt, stride): (&mut [R], &[R], usize),
) -> [&'a [R]; N] {
    let s = x.shape;
    let (sl, hd, qw) = (s.seq_len, s.head_dim, s.q_width());
    let scale = R::one() / R::from_f64(hd as f64).sqrt();
    let kept = |k: usize| (n * sl + i0 + k) * sl;
    if x.kept == Kept::Probabilities {
        return std::array::from_fn(|k| &saved[kept(k)..kept(k) + sl]);
    }
    // (A loop rather than `array::from_fn`, whose closure is compiled
    // apart from this function's vector set: it ran 3–4 times slower.)
    let h = g * x.group() + n;
    for (k, row) in recomputed.chunks_exact_mut(sl).take(N).enumerate() {
        let (i, r) = (i0 + k, n * sl + i0 + k);
        let qi_at = (b * sl + i) * qw + h * hd;
        dots(
            row,
            (&x.q[qi_at..qi_at + hd], padded),
            kt,
            stride,
            first..=i,
            scale,
        );
        let (max, sum) = (saved[2 * r], saved[2 * r + 1]);
        for p in &mut row[first..=i] {
            *p = (*p - max).exp();
        }
        for p in &mut row[first..=i] {
            *p = *p / sum;
        }
    }
    let mut rows = recomputed.chunks_exact(sl);
    std::array::from_fn(|_| rows.next().expect("a scratch row a query row"))
}

/// dq_i += Σ_j dScore_ij k_j for query rows i0..i0 + N of the unit's head
/// n (`ds[k]` row i0 + k's dScore): the keys all N rows share, two rows at
/// a time, then each row's own.
#[inline(always)]
fn add_dq_rows<R: Real, const N: usize>(
    x: &Operands<'_, R>,
    (b, g, n): (usize, usize, usize),
    (first, i0): (usize, usize),
    ds: &[&[R]; N],
    dq: &mut [R],
) {
    let (hd, kw) = (x.shape.head_dim, x.shape.kv_width());
    let ow = x.group() * hd;
    let at: [_; N] = std::array::from_fn(|k| {
        let i = i0 + k;
        i * ow + n * hd..i * ow + (n + 1) * hd
    });
    let mut dqs = dq.get_disjoint_mut(at).expect("distinct query rows");
    let shared: [&[R]; N] = std::array::from_fn(|k| &ds[k][first..=i0]);
    let keys = |j: usize| &x.k[x.key(b, g, j)..];
    // Four rows' columns held at once are not kept in registers (the
    // compiler turns them into scalar adds on the stack); two are.
    for k in (0..N).step_by(2) {
        match dqs.get_disjoint_mut([k, k + 1]) {
            Ok([a, c]) => {
                let pair = [shared[k], shared[k + 1]];
                add_weighted_rows([&mut **a, &mut **c], pair, keys(first), kw);
            }
            Err(_) => add_weighted_rows([&mut *dqs[k]], [shared[k]], keys(first), kw),
        }
    }
    for k in 1..N {
        let own = [&ds[k][i0 + 1..=i0 + k]];
        add_weighted_rows([&mut *dqs[k]], own, keys(i0 + 1), kw);
    }
}

/// `dst`'s rows j (each `hd` wide) += Σ_k `weights[k][j]` · `srcs[k]`
/// over the keys j that query row i0 + k attends to (first..=i0 + k), the
/// terms of a row j added in order of k, as row after row would add them.
#[inline(always)]
fn add_rows_scaled<R: Real, const N: usize>(
    dst: &mut [R],
    hd: usize,
    (first, i0): (usize, usize),
    weights: &[&[R]; N],
    srcs: [&[R]; N],
) {
    let srcs = srcs.map(|src| &src[..hd]);
    for j in first..=i0 {
        let w: [R; N] = std::array::from_fn(|k| weights[k][j]);
        let dst = &mut dst[j * hd..(j + 1) * hd];
        // Held in an array of its own, which the compiler knows no source
        // overlaps, so that it vectorizes.
        let mut c0 = 0;
        while c0 + KEYS <= hd {
            let mut held: [R; KEYS] = dst[c0..c0 + KEYS].try_into().expect("KEYS columns");
            for k in 0..N {
                let src: &[R; KEYS] = srcs[k][c0..c0 + KEYS].try_into().expect("KEYS columns");
                for c in 0..KEYS {
                    held[c] += w[k] * src[c];
                }
            }
            dst[c0..c0 + KEYS].copy_from_slice(&held);
            c0 += KEYS;
        }
        for c in c0..hd {
            for k in 0..N {
                dst[c] += w[k] * srcs[k][c];
            }
        }
    }
    for j in i0 + 1..i0 + N {
        for k in j - i0..N {
            add_scaled(&mut dst[j * hd..(j + 1) * hd], weights[k][j], srcs[k]);
        }
    }
}
