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

use super::attention::{dot, seqs_per_part, AttnShape};
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

/// One query row's scores in `row[first..=i]` (scaled q·k), returning
/// their max.
#[inline]
fn scores<R: Real>(
    row: &mut [R],
    qi: &[R],
    keys: impl Fn(usize) -> usize,
    k: &[R],
    hd: usize,
    first: usize,
    i: usize,
    scale: R,
) -> R {
    let mut max = R::from_f64(f64::NEG_INFINITY);
    for j in first..=i {
        let at = keys(j);
        row[j] = dot(qi, &k[at..at + hd]) * scale;
        if row[j] > max {
            max = row[j];
        }
    }
    max
}

/// out (T, H·hd) = softmax(q kᵀ / √hd, causal) v per sequence and head,
/// each token within its document where `starts` says where documents
/// begin; `saved` (`kept.len(shape)` values) receives what the backward
/// needs.
pub fn attention_rows_forward<R: Real>(
    out: &mut [R],
    saved: &mut [R],
    kept: Kept,
    q: &[R],
    k: &[R],
    v: &[R],
    starts: Option<&[u32]>,
    shape: &AttnShape,
) {
    let AttnShape {
        seqs,
        seq_len: s,
        heads,
        kv_heads,
        head_dim: hd,
    } = *shape;
    assert_eq!(saved.len(), kept.len(shape), "what the backward needs");
    let (qw, kw) = (shape.q_width(), shape.kv_width());
    let group = heads / kv_heads;
    let scale = R::one() / R::from_f64(hd as f64).sqrt();
    out.fill(R::zero());
    if kept == Kept::Probabilities {
        saved.fill(R::zero());
    }
    let mut scratch = vec![R::zero(); s];
    for b in 0..seqs {
        for h in 0..heads {
            let g = h / group;
            let key = |j: usize| (b * s + j) * kw + g * hd;
            for i in 0..s {
                let ti = b * s + i;
                let first = starts.map_or(0, |st| st[ti] as usize).min(i);
                let qi = &q[ti * qw + h * hd..ti * qw + (h + 1) * hd];
                let r = (b * heads + h) * s + i;
                let row = match kept {
                    Kept::Probabilities => &mut saved[r * s..(r + 1) * s],
                    Kept::RowStats => &mut scratch[..],
                };
                let max = scores(row, qi, key, k, hd, first, i, scale);
                let mut sum = R::zero();
                for j in first..=i {
                    row[j] = (row[j] - max).exp();
                    sum += row[j];
                }
                for p in &mut row[first..=i] {
                    *p = *p / sum;
                }
                let oi = &mut out[ti * qw + h * hd..ti * qw + (h + 1) * hd];
                for j in first..=i {
                    let vj = &v[key(j)..key(j) + hd];
                    let p = row[j];
                    for (o, &vc) in oi.iter_mut().zip(vj) {
                        *o += p * vc;
                    }
                }
                if kept == Kept::RowStats {
                    saved[2 * r] = max;
                    saved[2 * r + 1] = sum;
                }
            }
        }
    }
}

/// dq, dk, dv += the gradients of [`attention_rows_forward`] from dout,
/// given what it kept and the same `starts`.
pub fn attention_rows_backward<R: Real>(
    dq: &mut [R],
    dk: &mut [R],
    dv: &mut [R],
    dout: &[R],
    saved: &[R],
    kept: Kept,
    q: &[R],
    k: &[R],
    v: &[R],
    starts: Option<&[u32]>,
    shape: &AttnShape,
) {
    let AttnShape {
        seqs,
        seq_len: s,
        heads,
        kv_heads,
        head_dim: hd,
    } = *shape;
    assert_eq!(saved.len(), kept.len(shape), "what the forward kept");
    let (qw, kw) = (shape.q_width(), shape.kv_width());
    let group = heads / kv_heads;
    let scale = R::one() / R::from_f64(hd as f64).sqrt();
    let (mut scratch, mut dp) = (vec![R::zero(); s], vec![R::zero(); s]);
    for b in 0..seqs {
        for h in 0..heads {
            let g = h / group;
            let key = |j: usize| (b * s + j) * kw + g * hd;
            for i in 0..s {
                let ti = b * s + i;
                let first = starts.map_or(0, |st| st[ti] as usize).min(i);
                let qi_at = ti * qw + h * hd;
                let qi = &q[qi_at..qi_at + hd];
                let r = (b * heads + h) * s + i;
                let row: &[R] = match kept {
                    Kept::Probabilities => &saved[r * s..(r + 1) * s],
                    Kept::RowStats => {
                        let row = &mut scratch[..];
                        scores(row, qi, key, k, hd, first, i, scale);
                        let (max, sum) = (saved[2 * r], saved[2 * r + 1]);
                        for p in &mut row[first..=i] {
                            *p = (*p - max).exp();
                        }
                        for p in &mut row[first..=i] {
                            *p = *p / sum;
                        }
                        row
                    }
                };
                let doi = &dout[qi_at..qi_at + hd];
                // dP_ij = dout_i · v_j;  dv_j += P_ij dout_i
                let mut weighted = R::zero();
                for j in first..=i {
                    let vj = &v[key(j)..key(j) + hd];
                    let dot = dot(doi, vj);
                    dp[j] = dot;
                    weighted += row[j] * dot;
                    let p = row[j];
                    for (d, &o) in dv[key(j)..key(j) + hd].iter_mut().zip(doi) {
                        *d += p * o;
                    }
                }
                // dScore_ij = P_ij (dP_ij − Σ_j' P_ij' dP_ij') · scale
                let dqi = &mut dq[qi_at..qi_at + hd];
                for j in first..=i {
                    let ds = row[j] * (dp[j] - weighted) * scale;
                    let kj = &k[key(j)..key(j) + hd];
                    let dkj = &mut dk[key(j)..key(j) + hd];
                    for ((dqc, dkc), (&kc, &qc)) in dqi.iter_mut().zip(dkj).zip(kj.iter().zip(qi)) {
                        *dqc += ds * kc;
                        *dkc += ds * qc;
                    }
                }
            }
        }
    }
}

/// [`attention_rows_forward`] with the sequences split over up to
/// `threads` threads: the same bits.
pub fn attention_rows_forward_split<R: Real>(
    out: &mut [R],
    saved: &mut [R],
    kept: Kept,
    q: &[R],
    k: &[R],
    v: &[R],
    starts: Option<&[u32]>,
    shape: &AttnShape,
    threads: usize,
) {
    let per = seqs_per_part(shape, threads);
    if per >= shape.seqs {
        return attention_rows_forward(out, saved, kept, q, k, v, starts, shape);
    }
    let (s, qw, kw) = (shape.seq_len, shape.q_width(), shape.kv_width());
    let jobs: Vec<_> = out
        .chunks_mut(per * s * qw)
        .zip(saved.chunks_mut(per * kept.per_seq(shape)))
        .zip(q.chunks(per * s * qw))
        .zip(k.chunks(per * s * kw).zip(v.chunks(per * s * kw)))
        .enumerate()
        .map(|(i, (((out, saved), q), (k, v)))| {
            let part = AttnShape {
                seqs: q.len() / (s * qw),
                ..*shape
            };
            let tokens = i * per * s..i * per * s + part.tokens();
            let starts = starts.map(|st| &st[tokens]);
            move || attention_rows_forward(out, saved, kept, q, k, v, starts, &part)
        })
        .collect();
    crate::parallel::run_all(jobs);
}

/// [`attention_rows_backward`] with the sequences split over up to
/// `threads` threads: the same bits.
pub fn attention_rows_backward_split<R: Real>(
    dq: &mut [R],
    dk: &mut [R],
    dv: &mut [R],
    dout: &[R],
    saved: &[R],
    kept: Kept,
    q: &[R],
    k: &[R],
    v: &[R],
    starts: Option<&[u32]>,
    shape: &AttnShape,
    threads: usize,
) {
    let per = seqs_per_part(shape, threads);
    if per >= shape.seqs {
        return attention_rows_backward(dq, dk, dv, dout, saved, kept, q, k, v, starts, shape);
    }
    let (s, qw, kw) = (shape.seq_len, shape.q_width(), shape.kv_width());
    let (qn, kn, sn) = (per * s * qw, per * s * kw, per * kept.per_seq(shape));
    let jobs: Vec<_> = dq
        .chunks_mut(qn)
        .zip(dk.chunks_mut(kn).zip(dv.chunks_mut(kn)))
        .zip(dout.chunks(qn).zip(saved.chunks(sn)))
        .zip(q.chunks(qn).zip(k.chunks(kn).zip(v.chunks(kn))))
        .enumerate()
        .map(|(i, (((dq, (dk, dv)), (dout, saved)), (q, (k, v))))| {
            let part = AttnShape {
                seqs: q.len() / (s * qw),
                ..*shape
            };
            let tokens = i * per * s..i * per * s + part.tokens();
            let starts = starts.map(|st| &st[tokens]);
            move || attention_rows_backward(dq, dk, dv, dout, saved, kept, q, k, v, starts, &part)
        })
        .collect();
    crate::parallel::run_all(jobs);
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
    /// tokens (enough work to be split, a ragged last part), 4 query heads
    /// over 2 kv heads, with and without documents packed in a sequence,
    /// gradients added to what they held, serial and split over threads.
    #[test]
    fn the_engine_s_attention_gives_the_plain_one_s_bits() {
        let shape = AttnShape {
            seqs: 7,
            seq_len: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
        };
        assert!(seqs_per_part(&shape, 3) < shape.seqs, "big enough to split");
        let (t, qw, kw) = (shape.tokens(), shape.q_width(), shape.kv_width());
        let (q, k, v) = (filled(t * qw, 1), filled(t * kw, 2), filled(t * kw, 3));
        let dout = filled(t * qw, 4);
        let grads = || (filled(t * qw, 5), filled(t * kw, 6), filled(t * kw, 7));
        // Documents of 20 tokens, packed.
        let starts: Vec<u32> = (0..t).map(|i| ((i % 64) / 20 * 20) as u32).collect();
        for starts in [None, Some(&starts[..])] {
            let mut want = vec![0.0f32; t * qw];
            let mut probs = vec![0.0f32; shape.probs_len()];
            attention_forward(&mut want, &mut probs, &q, &k, &v, starts, &shape);
            let (mut wq, mut wk, mut wv) = grads();
            attention_backward(&mut wq, &mut wk, &mut wv, &dout, &probs, &q, &k, &v, &shape);
            for (kept, threads) in [1, 2, 3, 8]
                .map(|n| (Kept::RowStats, n))
                .into_iter()
                .chain([(Kept::Probabilities, 1), (Kept::Probabilities, 3)])
            {
                let what = format!("{kept:?}, {threads} threads");
                let mut out = vec![7.0f32; t * qw];
                let mut saved = vec![3.0f32; kept.len(&shape)];
                attention_rows_forward_split(
                    &mut out, &mut saved, kept, &q, &k, &v, starts, &shape, threads,
                );
                assert_eq!(bits(&out), bits(&want), "out, {what}");
                if kept == Kept::Probabilities {
                    assert_eq!(bits(&saved), bits(&probs), "probabilities, {what}");
                }
                let (mut gq, mut gk, mut gv) = grads();
                attention_rows_backward_split(
                    &mut gq, &mut gk, &mut gv, &dout, &saved, kept, &q, &k, &v, starts, &shape,
                    threads,
                );
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
