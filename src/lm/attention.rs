//! Causal grouped-query attention with rotary position embeddings, as
//! Mixtral computes it, written plainly and generically over f32 and f64
//! as mirrored `*_forward` / `*_backward` pairs (held to finite
//! differences in `tests/gradcheck_lm.rs`).
//!
//! Legend: B sequences of S tokens (T = B·S rows, sequence-major), H query
//! heads, G key/value heads (H a multiple of G: query head h reads kv head
//! h / (H/G)), hd the head dimension. q is (T, H·hd), k and v (T, G·hd).

// Numeric kernels index rows and columns explicitly and take their shapes
// as arguments, as llm.c does.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use crate::math::Real;

/// The attention shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub seqs: usize,
    pub seq_len: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    pub fn tokens(&self) -> usize {
        self.seqs * self.seq_len
    }

    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Saved probabilities: (B, H, S, S).
    pub fn probs_len(&self) -> usize {
        self.seqs * self.heads * self.seq_len * self.seq_len
    }
}

/// cos and sin of position p and frequency i: (S, hd/2) each, Hugging
/// Face's `rotate_half` convention (pairs i and i + hd/2).
#[derive(Clone, Debug, Default)]
pub struct RopeTable<R> {
    pub cos: Vec<R>,
    pub sin: Vec<R>,
    half: usize,
}

impl<R: Real> RopeTable<R> {
    pub fn new(seq_len: usize, head_dim: usize, theta: f64) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(seq_len * half);
        let mut sin = Vec::with_capacity(seq_len * half);
        for p in 0..seq_len {
            for i in 0..half {
                let inv_freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
                let angle = p as f64 * inv_freq;
                cos.push(R::from_f64(angle.cos()));
                sin.push(R::from_f64(angle.sin()));
            }
        }
        Self { cos, sin, half }
    }
}

/// Rotates every head of `x` (T, heads·hd) in place by its position.
pub fn rope_forward<R: Real>(x: &mut [R], table: &RopeTable<R>, seq_len: usize, heads: usize) {
    rope_apply(x, table, seq_len, heads, false);
}

/// The transpose rotation: dx from d(rotated x), in place.
pub fn rope_backward<R: Real>(dx: &mut [R], table: &RopeTable<R>, seq_len: usize, heads: usize) {
    rope_apply(dx, table, seq_len, heads, true);
}

fn rope_apply<R: Real>(
    x: &mut [R],
    table: &RopeTable<R>,
    seq_len: usize,
    heads: usize,
    transpose: bool,
) {
    let half = table.half;
    let hd = 2 * half;
    let rows = x.len() / (heads * hd);
    for t in 0..rows {
        let p = t % seq_len;
        for h in 0..heads {
            let v = &mut x[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            for i in 0..half {
                let c = table.cos[p * half + i];
                let s = if transpose {
                    -table.sin[p * half + i]
                } else {
                    table.sin[p * half + i]
                };
                let (a, b) = (v[i], v[i + half]);
                v[i] = a * c - b * s;
                v[i + half] = b * c + a * s;
            }
        }
    }
}

/// out (T, H·hd) = softmax(q kᵀ / √hd, causal) v per sequence and head;
/// saves the probabilities (B, H, S, S; zero above the diagonal).
pub fn attention_forward<R: Real>(
    out: &mut [R],
    probs: &mut [R],
    q: &[R],
    k: &[R],
    v: &[R],
    shape: &AttnShape,
) {
    let AttnShape {
        seqs,
        seq_len: s,
        heads,
        kv_heads,
        head_dim: hd,
    } = *shape;
    let (qw, kw) = (shape.q_width(), shape.kv_width());
    let group = heads / kv_heads;
    let scale = R::one() / R::from_f64(hd as f64).sqrt();
    out.fill(R::zero());
    probs.fill(R::zero());
    for b in 0..seqs {
        for h in 0..heads {
            let g = h / group;
            for i in 0..s {
                let ti = b * s + i;
                let qi = &q[ti * qw + h * hd..ti * qw + (h + 1) * hd];
                let row =
                    &mut probs[((b * heads + h) * s + i) * s..((b * heads + h) * s + i + 1) * s];
                let mut max = R::from_f64(f64::NEG_INFINITY);
                for j in 0..=i {
                    let tj = b * s + j;
                    let kj = &k[tj * kw + g * hd..tj * kw + (g + 1) * hd];
                    let mut dot = R::zero();
                    for c in 0..hd {
                        dot += qi[c] * kj[c];
                    }
                    row[j] = dot * scale;
                    if row[j] > max {
                        max = row[j];
                    }
                }
                let mut sum = R::zero();
                for j in 0..=i {
                    row[j] = (row[j] - max).exp();
                    sum += row[j];
                }
                for j in 0..=i {
                    row[j] = row[j] / sum;
                }
                let oi = &mut out[ti * qw + h * hd..ti * qw + (h + 1) * hd];
                for j in 0..=i {
                    let tj = b * s + j;
                    let vj = &v[tj * kw + g * hd..tj * kw + (g + 1) * hd];
                    for c in 0..hd {
                        oi[c] += row[j] * vj[c];
                    }
                }
            }
        }
    }
}

/// dq, dk, dv += the gradients of `attention_forward` from dout.
pub fn attention_backward<R: Real>(
    dq: &mut [R],
    dk: &mut [R],
    dv: &mut [R],
    dout: &[R],
    probs: &[R],
    q: &[R],
    k: &[R],
    v: &[R],
    shape: &AttnShape,
) {
    let AttnShape {
        seqs,
        seq_len: s,
        heads,
        kv_heads,
        head_dim: hd,
    } = *shape;
    let (qw, kw) = (shape.q_width(), shape.kv_width());
    let group = heads / kv_heads;
    let scale = R::one() / R::from_f64(hd as f64).sqrt();
    let mut dp = vec![R::zero(); s];
    for b in 0..seqs {
        for h in 0..heads {
            let g = h / group;
            for i in 0..s {
                let ti = b * s + i;
                let row = &probs[((b * heads + h) * s + i) * s..((b * heads + h) * s + i + 1) * s];
                let doi = &dout[ti * qw + h * hd..ti * qw + (h + 1) * hd];
                // dP_ij = dout_i · v_j;  dv_j += P_ij dout_i
                let mut weighted = R::zero();
                for j in 0..=i {
                    let tj = b * s + j;
                    let vj = &v[tj * kw + g * hd..tj * kw + (g + 1) * hd];
                    let mut dot = R::zero();
                    for c in 0..hd {
                        dot += doi[c] * vj[c];
                    }
                    dp[j] = dot;
                    weighted += row[j] * dot;
                    let dvj = &mut dv[tj * kw + g * hd..tj * kw + (g + 1) * hd];
                    for c in 0..hd {
                        dvj[c] += row[j] * doi[c];
                    }
                }
                // dScore_ij = P_ij (dP_ij − Σ_j' P_ij' dP_ij') · scale
                let qi_at = ti * qw + h * hd;
                for j in 0..=i {
                    let ds = row[j] * (dp[j] - weighted) * scale;
                    let tj = b * s + j;
                    let kj_at = tj * kw + g * hd;
                    for c in 0..hd {
                        dq[qi_at + c] += ds * k[kj_at + c];
                        dk[kj_at + c] += ds * q[qi_at + c];
                    }
                }
            }
        }
    }
}

/// h (T, D) = rows of the embedding table (V, D) picked by `tokens`.
pub fn embedding_forward<R: Real>(h: &mut [R], table: &[R], tokens: &[u32], d: usize) {
    for (t, &tok) in tokens.iter().enumerate() {
        let at = tok as usize * d;
        h[t * d..(t + 1) * d].copy_from_slice(&table[at..at + d]);
    }
}

/// d table += dh rows, scattered back to their tokens (in token order).
pub fn embedding_backward<R: Real>(dtable: &mut [R], dh: &[R], tokens: &[u32], d: usize) {
    for (t, &tok) in tokens.iter().enumerate() {
        let at = tok as usize * d;
        for c in 0..d {
            dtable[at + c] += dh[t * d + c];
        }
    }
}
