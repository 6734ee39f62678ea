//! Causal grouped-query attention as the engine runs it on the cpu, one
//! query row at a time, keeping for the backward either every probability
//! (B·H·S², as [`attention_forward`](super::attention::attention_forward)
//! does) or, where those would take more than
//! [`KEPT_PROBABILITIES_MAX_BYTES`], each query row's softmax max and sum
//! (2·B·H·S), from which the backward recomputes the probabilities row by
//! row: a long sequence then costs memory in proportion to its length,
//! not its square (at S = 2048 and 8 heads, 128 KiB a sequence rather
//! than 128 MiB), for one more q·kᵀ and exp in the backward.
//!
//! Either way the same bits as the plain functions, which stay as the
//! oracle: a row's scores are the same dot products, its probabilities the
//! same `exp(score − max) / sum`, and every gradient sums its terms in the
//! same order. The plain backward also adds, for the keys before a
//! token's document, zero-probability terms (±0), which change no sum that
//! starts from +0; here they are skipped.

#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use super::attention::{dot, AttnShape};
use crate::math::Real;

/// Above this many bytes of probabilities (B·H·S² f32, one call's) the
/// attention keeps each row's max and sum instead: below it, keeping them
/// spares the backward a q·kᵀ and an exp a probability (its backward ran
/// 1.7–1.8× the plain one's time on the development machine), at a cost
/// in memory that the rest of a layer's activations dwarf (small's
/// default batch); above it, the probabilities would grow with the square
/// of the sequence (64 MiB a layer for small's heads at 2048 tokens).
pub const KEPT_PROBABILITIES_MAX_BYTES: usize = 16 << 20;

/// What the attention keeps for its backward at a shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kept {
    /// Every probability, (B, H, S, S) (zero above the diagonal and
    /// outside a token's document, as written by the forward).
    Probabilities,
    /// Each query row's softmax max and sum, (B, H, S, 2).
    RowStats,
}

impl Kept {
    /// What the engine's attention keeps at `shape`.
    pub fn at(shape: &AttnShape) -> Self {
        match 4 * shape.probs_len() <= KEPT_PROBABILITIES_MAX_BYTES {
            true => Kept::Probabilities,
            false => Kept::RowStats,
        }
    }

    /// The values kept at `shape`.
    pub fn len(self, shape: &AttnShape) -> usize {
        match self {
            Kept::Probabilities => shape.probs_len(),
            Kept::RowStats => row_stats_len(shape),
        }
    }

    /// Values kept a sequence.
    fn per_seq(self, shape: &AttnShape) -> usize {
        self.len(&AttnShape { seqs: 1, ..*shape })
    }
}

/// The values the engine's attention keeps at `shape`.
pub fn saved_len(shape: &AttnShape) -> usize {
    Kept::at(shape).len(shape)
}

/// Each query row's softmax max and sum: (B, H, S, 2).
pub fn row_stats_len(shape: &AttnShape) -> usize {
    2 * shape.seqs * shape.heads * shape.seq_len
}

/// Below this many multiply-adds (about 1 ms on one core) attention is
/// not split over threads.
const SPLIT_MIN_MACS: usize = 2 << 20;

/// At most this many threads an attention call.
const MAX_ATTENTION_THREADS: usize = 8;

/// The jobs an attention call at `shape` runs as, on up to `threads`
/// threads: one where it is too small to be worth splitting, else at most
/// one a unit (a sequence's heads that share a kv head).
fn jobs(shape: &AttnShape, threads: usize) -> usize {
    let s = shape.seq_len;
    let macs = shape.seqs * shape.heads * s * s * shape.head_dim;
    let units = shape.seqs * shape.kv_heads;
    match macs < SPLIT_MIN_MACS {
        true => 1,
        false => threads.clamp(1, MAX_ATTENTION_THREADS).min(units).max(1),
    }
}

/// The read-only operands of a call, and its shape.
struct Operands<'a, R> {
    q: &'a [R],
    k: &'a [R],
    v: &'a [R],
    starts: Option<&'a [u32]>,
    shape: &'a AttnShape,
    kept: Kept,
}

impl<R: Real> Operands<'_, R> {
    /// Query heads a kv head serves.
    fn group(&self) -> usize {
        self.shape.heads / self.shape.kv_heads
    }

    /// Where token j of sequence b's kv head g starts in k and v.
    fn key(&self, b: usize, g: usize, j: usize) -> usize {
        let s = self.shape;
        (b * s.seq_len + j) * s.kv_width() + g * s.head_dim
    }

    /// The first key token i of sequence b attends to.
    fn first(&self, b: usize, i: usize) -> usize {
        let ti = b * self.shape.seq_len + i;
        self.starts.map_or(0, |st| st[ti] as usize).min(i)
    }

    /// Query head h's scores of token i of sequence b in `row[first..=i]`
    /// (scaled q·k); returns their max.
    fn scores(&self, row: &mut [R], b: usize, h: usize, i: usize) -> R {
        let s = self.shape;
        let hd = s.head_dim;
        let scale = R::one() / R::from_f64(hd as f64).sqrt();
        let qi_at = (b * s.seq_len + i) * s.q_width() + h * hd;
        let qi = &self.q[qi_at..qi_at + hd];
        let g = h / self.group();
        let mut max = R::from_f64(f64::NEG_INFINITY);
        for j in self.first(b, i)..=i {
            let at = self.key(b, g, j);
            row[j] = dot(qi, &self.k[at..at + hd]) * scale;
            if row[j] > max {
                max = row[j];
            }
        }
        max
    }

    /// Values kept for one unit (a sequence's heads of one kv head).
    fn kept_per_unit(&self) -> usize {
        self.kept.per_seq(self.shape) / self.shape.kv_heads
    }
}

/// The forward of one unit, kv head g of sequence b: `out` (S, group·hd)
/// its heads' outputs, `saved` what they keep.
fn forward_unit<R: Real>(
    x: &Operands<'_, R>,
    (b, g): (usize, usize),
    out: &mut [R],
    saved: &mut [R],
    scratch: &mut [R],
) {
    let (s, hd, group) = (x.shape.seq_len, x.shape.head_dim, x.group());
    let ow = group * hd;
    for (n, h) in (g * group..(g + 1) * group).enumerate() {
        for i in 0..s {
            let first = x.first(b, i);
            let r = n * s + i; // this unit's row
            let row = match x.kept {
                Kept::Probabilities => &mut saved[r * s..(r + 1) * s],
                Kept::RowStats => &mut scratch[..],
            };
            let max = x.scores(row, b, h, i);
            let mut sum = R::zero();
            for j in first..=i {
                row[j] = (row[j] - max).exp();
                sum += row[j];
            }
            for p in &mut row[first..=i] {
                *p = *p / sum;
            }
            let oi = &mut out[i * ow + n * hd..i * ow + (n + 1) * hd];
            for j in first..=i {
                let at = x.key(b, g, j);
                let p = row[j];
                for (o, &vc) in oi.iter_mut().zip(&x.v[at..at + hd]) {
                    *o += p * vc;
                }
            }
            if x.kept == Kept::RowStats {
                saved[2 * r] = max;
                saved[2 * r + 1] = sum;
            }
        }
    }
}

/// The backward of one unit: `dq` (S, group·hd) and `dk`, `dv` (S, hd)
/// its slices, added to.
fn backward_unit<R: Real>(
    x: &Operands<'_, R>,
    (b, g): (usize, usize),
    dout: &[R],
    saved: &[R],
    [dq, dk, dv]: [&mut [R]; 3],
    [scratch, dp]: [&mut [R]; 2],
) {
    let s = x.shape;
    let (sl, hd, group, qw) = (s.seq_len, s.head_dim, x.group(), s.q_width());
    let scale = R::one() / R::from_f64(hd as f64).sqrt();
    let ow = group * hd;
    for (n, h) in (g * group..(g + 1) * group).enumerate() {
        for i in 0..sl {
            let first = x.first(b, i);
            let r = n * sl + i;
            let row: &[R] = match x.kept {
                Kept::Probabilities => &saved[r * sl..(r + 1) * sl],
                Kept::RowStats => {
                    x.scores(scratch, b, h, i);
                    let (max, sum) = (saved[2 * r], saved[2 * r + 1]);
                    for p in &mut scratch[first..=i] {
                        *p = (*p - max).exp();
                    }
                    for p in &mut scratch[first..=i] {
                        *p = *p / sum;
                    }
                    scratch
                }
            };
            let qi_at = (b * sl + i) * qw + h * hd;
            let doi = &dout[qi_at..qi_at + hd];
            // dP_ij = dout_i · v_j;  dv_j += P_ij dout_i
            let mut weighted = R::zero();
            for j in first..=i {
                let at = x.key(b, g, j);
                let dot = dot(doi, &x.v[at..at + hd]);
                dp[j] = dot;
                weighted += row[j] * dot;
                let p = row[j];
                for (d, &o) in dv[j * hd..(j + 1) * hd].iter_mut().zip(doi) {
                    *d += p * o;
                }
            }
            // dScore_ij = P_ij (dP_ij − Σ_j' P_ij' dP_ij') · scale
            let qi = &x.q[qi_at..qi_at + hd];
            let dqi = &mut dq[i * ow + n * hd..i * ow + (n + 1) * hd];
            for j in first..=i {
                let ds = row[j] * (dp[j] - weighted) * scale;
                let at = x.key(b, g, j);
                let kj = &x.k[at..at + hd];
                let dkj = &mut dk[j * hd..(j + 1) * hd];
                for ((dqc, dkc), (&kc, &qc)) in dqi.iter_mut().zip(dkj).zip(kj.iter().zip(qi)) {
                    *dqc += ds * kc;
                    *dkc += ds * qc;
                }
            }
        }
    }
}

/// Runs `work(unit, slices, scratch)` for every unit (kv head g of
/// sequence b, sequence-major), the units shared out in order over `jobs`
/// jobs; each of `parts` (a buffer and its values a unit) is cut into one
/// slice a unit, and each job lends its units one scratch of two rows of
/// keys (2·S values).
fn for_units<R: Real>(
    shape: &AttnShape,
    jobs: usize,
    parts: Vec<(&mut [R], usize)>,
    work: impl Fn((usize, usize), &mut [&mut [R]], &mut [R]) + Sync,
) {
    let (units, kv) = (shape.seqs * shape.kv_heads, shape.kv_heads);
    let per = units.div_ceil(jobs.max(1)).max(1);
    let lens: Vec<usize> = parts.iter().map(|p| p.1).collect();
    assert!(
        parts
            .iter()
            .all(|(p, len)| *len > 0 && p.len() == units * len),
        "a slice a unit"
    );
    let mut chunks: Vec<_> = parts
        .into_iter()
        .map(|(p, len)| p.chunks_mut(per * len).collect::<Vec<_>>().into_iter())
        .collect();
    let work = &work;
    let job_list: Vec<_> = (0..units.div_ceil(per))
        .map(|j| {
            let mine: Vec<&mut [R]> = chunks
                .iter_mut()
                .map(|c| c.next().expect("a chunk a job"))
                .collect();
            let lens = lens.clone();
            move || {
                let mut scratch = vec![R::zero(); 2 * shape.seq_len];
                let mut slices: Vec<_> = mine
                    .into_iter()
                    .zip(&lens)
                    .map(|(c, &len)| c.chunks_mut(len))
                    .collect();
                for unit in j * per..((j + 1) * per).min(units) {
                    let mut mine: Vec<&mut [R]> = slices
                        .iter_mut()
                        .map(|c| c.next().expect("a slice a unit"))
                        .collect();
                    work((unit / kv, unit % kv), &mut mine, &mut scratch);
                }
            }
        })
        .collect();
    crate::parallel::run_all(job_list);
}

/// Moves between a (T, width) buffer and its units' column blocks, each
/// unit (b, g) the columns g·cols..(g + 1)·cols of sequence b's S rows,
/// laid out unit after unit: `to_units` copies them out, else back in.
fn unit_columns<R: Real>(
    full: &mut [R],
    units: &mut [R],
    shape: &AttnShape,
    cols: usize,
    to_units: bool,
) {
    let (s, kv) = (shape.seq_len, shape.kv_heads);
    let width = kv * cols;
    for (u, block) in units.chunks_mut(s * cols).enumerate() {
        let (b, g) = (u / kv, u % kv);
        for (i, row) in block.chunks_mut(cols).enumerate() {
            let at = (b * s + i) * width + g * cols;
            match to_units {
                true => row.copy_from_slice(&full[at..at + cols]),
                false => full[at..at + cols].copy_from_slice(row),
            }
        }
    }
}

/// out (T, H·hd) = softmax(q kᵀ / √hd, causal) v per sequence and head,
/// each token within its document where `starts` says where documents
/// begin; `saved` (`kept.len(shape)` values) receives what the backward
/// needs. The units (a sequence's heads that share a kv head) are shared
/// out over up to `threads` threads; each is computed as on one thread,
/// so the result is the same bits however they are shared.
pub fn attention_rows_forward<R: Real>(
    out: &mut [R],
    saved: &mut [R],
    kept: Kept,
    (q, k, v): (&[R], &[R], &[R]),
    starts: Option<&[u32]>,
    shape: &AttnShape,
    threads: usize,
) {
    assert_eq!(saved.len(), kept.len(shape), "what the backward needs");
    assert_eq!(out.len(), shape.tokens() * shape.q_width(), "out (T, H·hd)");
    let x = Operands {
        q,
        k,
        v,
        starts,
        shape,
        kept,
    };
    let (s, cols) = (shape.seq_len, x.group() * shape.head_dim);
    if kept == Kept::Probabilities {
        saved.fill(R::zero());
    }
    let mut outs = vec![R::zero(); out.len()];
    let parts = vec![(&mut outs[..], s * cols), (saved, x.kept_per_unit())];
    for_units(shape, jobs(shape, threads), parts, |unit, bufs, scratch| {
        let [out, saved] = bufs else {
            unreachable!("two parts")
        };
        forward_unit(&x, unit, out, saved, &mut scratch[..s]);
    });
    unit_columns(out, &mut outs, shape, cols, false);
}

/// dq, dk, dv += the gradients of [`attention_rows_forward`] from dout,
/// given what it kept and the same `starts`; shared out as the forward.
pub fn attention_rows_backward<R: Real>(
    [dq, dk, dv]: [&mut [R]; 3],
    dout: &[R],
    saved: &[R],
    kept: Kept,
    (q, k, v): (&[R], &[R], &[R]),
    starts: Option<&[u32]>,
    shape: &AttnShape,
    threads: usize,
) {
    assert_eq!(saved.len(), kept.len(shape), "what the forward kept");
    let x = Operands {
        q,
        k,
        v,
        starts,
        shape,
        kept,
    };
    let (s, hd) = (shape.seq_len, shape.head_dim);
    let cols = x.group() * hd;
    let per_unit = x.kept_per_unit();
    let mut grads = [(dq, cols), (dk, hd), (dv, hd)].map(|(full, cols)| {
        let mut units = vec![R::zero(); full.len()];
        unit_columns(full, &mut units, shape, cols, true);
        (full, units, cols)
    });
    let [gq, gk, gv] = &mut grads;
    let parts = vec![
        (&mut gq.1[..], s * gq.2),
        (&mut gk.1[..], s * hd),
        (&mut gv.1[..], s * hd),
    ];
    for_units(
        shape,
        jobs(shape, threads),
        parts,
        |(b, g), bufs, scratch| {
            let [dq, dk, dv] = bufs else {
                unreachable!("three parts")
            };
            let unit = b * shape.kv_heads + g;
            let saved = &saved[unit * per_unit..(unit + 1) * per_unit];
            let (row, dp) = scratch.split_at_mut(s);
            backward_unit(&x, (b, g), dout, saved, [dq, dk, dv], [row, dp]);
        },
    );
    for (full, mut units, cols) in grads {
        unit_columns(full, &mut units, shape, cols, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math::attention::{attention_backward, attention_forward};

    fn filled(len: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
            })
            .collect()
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Against the plain functions, bit for bit, keeping either the
    /// probabilities or each row's max and sum: seven sequences of 64
    /// tokens and one of 300 (enough work to be split over units, a
    /// ragged last job), 4 query heads over 2 kv heads, with and without
    /// documents packed in a sequence, gradients added to what they held,
    /// on one thread and on several.
    #[test]
    fn the_engine_s_attention_gives_the_plain_one_s_bits() {
        for (seqs, seq_len) in [(7, 64), (1, 300)] {
            let shape = AttnShape {
                seqs,
                seq_len,
                heads: 4,
                kv_heads: 2,
                head_dim: 32,
            };
            assert!(jobs(&shape, 3) > 1, "big enough to split");
            same_bits_as_the_plain_one(&shape);
        }
    }

    fn same_bits_as_the_plain_one(shape: &AttnShape) {
        let (t, qw, kw) = (shape.tokens(), shape.q_width(), shape.kv_width());
        let (q, k, v) = (filled(t * qw, 1), filled(t * kw, 2), filled(t * kw, 3));
        let dout = filled(t * qw, 4);
        let grads = || (filled(t * qw, 5), filled(t * kw, 6), filled(t * kw, 7));
        // Documents of 20 tokens, packed.
        let s = shape.seq_len;
        let starts: Vec<u32> = (0..t).map(|i| ((i % s) / 20 * 20) as u32).collect();
        let kept_threads = [1, 2, 3, 8]
            .map(|n| (Kept::RowStats, n))
            .into_iter()
            .chain([(Kept::Probabilities, 1), (Kept::Probabilities, 3)]);
        for starts in [None, Some(&starts[..])] {
            let mut want = vec![0.0f32; t * qw];
            let mut probs = vec![0.0f32; shape.probs_len()];
            attention_forward(&mut want, &mut probs, &q, &k, &v, starts, shape);
            let (mut wq, mut wk, mut wv) = grads();
            attention_backward(&mut wq, &mut wk, &mut wv, &dout, &probs, &q, &k, &v, shape);
            for (kept, threads) in kept_threads.clone() {
                let what = format!("{}×{s}, {kept:?}, {threads} threads", shape.seqs);
                let mut out = vec![7.0f32; t * qw];
                let mut saved = vec![3.0f32; kept.len(shape)];
                let qkv = (&q[..], &k[..], &v[..]);
                attention_rows_forward(&mut out, &mut saved, kept, qkv, starts, shape, threads);
                assert_eq!(bits(&out), bits(&want), "out, {what}");
                if kept == Kept::Probabilities {
                    assert_eq!(bits(&saved), bits(&probs), "probabilities, {what}");
                }
                let (mut gq, mut gk, mut gv) = grads();
                let grads = [&mut gq[..], &mut gk[..], &mut gv[..]];
                attention_rows_backward(grads, &dout, &saved, kept, qkv, starts, shape, threads);
                assert_eq!(bits(&gq), bits(&wq), "dq, {what}");
                assert_eq!(bits(&gk), bits(&wk), "dk, {what}");
                assert_eq!(bits(&gv), bits(&wv), "dv, {what}");
            }
        }
    }

    /// The probabilities are kept up to the bound, each row's max and sum
    /// past it.
    #[test]
    fn long_sequences_keep_two_values_a_row() {
        let shape = |seq_len| AttnShape {
            seqs: 1,
            seq_len,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
        };
        // 4 heads × S² × 4 bytes = 16 MiB at S = 1024.
        assert_eq!(Kept::at(&shape(1024)), Kept::Probabilities);
        assert_eq!(saved_len(&shape(1024)), 4 * 1024 * 1024);
        assert_eq!(Kept::at(&shape(1025)), Kept::RowStats);
        assert_eq!(saved_len(&shape(2048)), 2 * 4 * 2048);
    }
}
