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

use crate::math::vector_isa::{multiversioned, VectorIsa};
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

    /// Query rows a block of attention takes (the GPU's, in blocks of
    /// query rows) so that its scores, (B·H) × rows × at most S f32, fit
    /// in `bytes`: at least one row, at most S.
    pub fn query_block_rows(&self, bytes: usize) -> usize {
        let row = self.seqs * self.heads * self.seq_len * std::mem::size_of::<f32>();
        (bytes / row.max(1)).clamp(1, self.seq_len.max(1))
    }
}

/// cos and sin of position p and frequency i: (S, r/2) each for a
/// rotary dimension r (the head's whole dimension, or its first r where
/// the rotation is partial, GLM-4.5's `partial_rotary_factor`), Hugging
/// Face's `rotate_half` convention (pairs i and i + r/2 of the first r).
#[derive(Clone, Debug, Default)]
pub struct RopeTable<R> {
    pub cos: Vec<R>,
    pub sin: Vec<R>,
    half: usize,
    head_dim: usize,
}

impl<R: Real> RopeTable<R> {
    /// Every dimension of each head rotates.
    pub fn new(seq_len: usize, head_dim: usize, theta: f64) -> Self {
        Self::partial(seq_len, head_dim, head_dim, theta)
    }

    /// The first `rotary_dim` (even, ≤ `head_dim`) dimensions of each head
    /// rotate, at frequencies θ^(−2i/rotary_dim); the rest pass through.
    pub fn partial(seq_len: usize, head_dim: usize, rotary_dim: usize, theta: f64) -> Self {
        assert!(
            rotary_dim.is_multiple_of(2) && rotary_dim <= head_dim,
            "rotary dimension {rotary_dim} of a head of {head_dim}"
        );
        let half = rotary_dim / 2;
        let mut cos = Vec::with_capacity(seq_len * half);
        let mut sin = Vec::with_capacity(seq_len * half);
        for p in 0..seq_len {
            for i in 0..half {
                let inv_freq = 1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64);
                let angle = p as f64 * inv_freq;
                cos.push(R::from_f64(angle.cos()));
                sin.push(R::from_f64(angle.sin()));
            }
        }
        Self {
            cos,
            sin,
            half,
            head_dim,
        }
    }
}

impl<R> RopeTable<R> {
    /// Half the dimensions of a head that rotate (the table's width).
    pub fn half(&self) -> usize {
        self.half
    }

    /// The dimensions of a head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
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
    rope_rows(VectorIsa::detected(), x, table, seq_len, heads, transpose);
}

multiversioned! {
    /// [`rope_apply`]'s loops, compiled for the widest vectors the CPU has
    /// (the same operations, so the same bits, in each).
    fn rope_rows<R: Real>(
        x: &mut [R],
        table: &RopeTable<R>,
        seq_len: usize,
        heads: usize,
        transpose: bool,
    ) => rope_rows_body;
}

#[inline(always)]
fn rope_rows_body<R: Real>(
    x: &mut [R],
    table: &RopeTable<R>,
    seq_len: usize,
    heads: usize,
    transpose: bool,
) {
    let (half, hd) = (table.half, table.head_dim);
    let rows = x.len() / (heads * hd);
    for t in 0..rows {
        let p = t % seq_len;
        let (cos, sin) = (
            &table.cos[p * half..(p + 1) * half],
            &table.sin[p * half..(p + 1) * half],
        );
        for v in x[t * heads * hd..(t + 1) * heads * hd].chunks_exact_mut(hd) {
            let (low, high) = v.split_at_mut(half);
            let rotating = low
                .iter_mut()
                .zip(&mut high[..half])
                .zip(cos.iter().zip(sin));
            for ((a, b), (&c, &s)) in rotating {
                let s = if transpose { -s } else { s };
                let (x0, x1) = (*a, *b);
                *a = x0 * c - x1 * s;
                *b = x1 * c + x0 * s;
            }
        }
    }
}

/// Σ a[c]·b[c] over one head's dimension (and condensation's cosines over
/// a row), in eight interleaved partial sums (element c goes to sum c % 8)
/// added pairwise at the end. The order
/// is fixed, so every call, thread and split gives the same bits; unlike
/// one running sum (a chain of dependent adds the compiler may not
/// reorder), the eight sums are independent and become SIMD lanes.
#[inline(always)]
pub(crate) fn dot<R: Real>(a: &[R], b: &[R]) -> R {
    debug_assert_eq!(a.len(), b.len());
    const LANES: usize = 8;
    let mut sums = [R::zero(); LANES];
    let whole = a.len() / LANES * LANES;
    for (x, y) in a[..whole]
        .chunks_exact(LANES)
        .zip(b[..whole].chunks_exact(LANES))
    {
        for l in 0..LANES {
            sums[l] += x[l] * y[l];
        }
    }
    for (l, (&x, &y)) in a[whole..].iter().zip(&b[whole..]).enumerate() {
        sums[l] += x * y;
    }
    let [s0, s1, s2, s3, s4, s5, s6, s7] = sums;
    ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7))
}

/// out (T, H·hd) = softmax(q kᵀ / √hd, causal) v per sequence and head;
/// saves the probabilities (B, H, S, S; zero above the diagonal).
///
/// `starts` (T entries), where sequences pack several documents: for each
/// token, the position in its sequence where its document begins. A token
/// attends to the tokens of its own document only; the probabilities of
/// the others stay zero, so [`attention_backward`], which reads them,
/// needs no starts. `None`: one document a sequence.
pub fn attention_forward<R: Real>(
    out: &mut [R],
    probs: &mut [R],
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
                let first = starts.map_or(0, |st| st[ti] as usize).min(i);
                let qi = &q[ti * qw + h * hd..ti * qw + (h + 1) * hd];
                let row =
                    &mut probs[((b * heads + h) * s + i) * s..((b * heads + h) * s + i + 1) * s];
                let mut max = R::from_f64(f64::NEG_INFINITY);
                for j in first..=i {
                    let tj = b * s + j;
                    let kj = &k[tj * kw + g * hd..tj * kw + (g + 1) * hd];
                    row[j] = dot(qi, kj) * scale;
                    if row[j] > max {
                        max = row[j];
                    }
                }
                let mut sum = R::zero();
                for j in first..=i {
                    row[j] = (row[j] - max).exp();
                    sum += row[j];
                }
                for j in first..=i {
                    row[j] = row[j] / sum;
                }
                let oi = &mut out[ti * qw + h * hd..ti * qw + (h + 1) * hd];
                for j in first..=i {
                    let tj = b * s + j;
                    let vj = &v[tj * kw + g * hd..tj * kw + (g + 1) * hd];
                    let p = row[j];
                    for (o, &vc) in oi.iter_mut().zip(vj) {
                        *o += p * vc;
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
                    let dot = dot(doi, vj);
                    dp[j] = dot;
                    weighted += row[j] * dot;
                    let dvj = &mut dv[tj * kw + g * hd..tj * kw + (g + 1) * hd];
                    let p = row[j];
                    for (d, &o) in dvj.iter_mut().zip(doi) {
                        *d += p * o;
                    }
                }
                // dScore_ij = P_ij (dP_ij − Σ_j' P_ij' dP_ij') · scale
                let qi_at = ti * qw + h * hd;
                let qi = &q[qi_at..qi_at + hd];
                let dqi = &mut dq[qi_at..qi_at + hd];
                for j in 0..=i {
                    let ds = row[j] * (dp[j] - weighted) * scale;
                    let tj = b * s + j;
                    let kj_at = tj * kw + g * hd;
                    let kj = &k[kj_at..kj_at + hd];
                    let dkj = &mut dk[kj_at..kj_at + hd];
                    for ((dqc, dkc), (&kc, &qc)) in dqi.iter_mut().zip(dkj).zip(kj.iter().zip(qi)) {
                        *dqc += ds * kc;
                        *dkc += ds * qc;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::fill_uniform;

    fn filled(len: usize, seed: u64) -> Vec<f32> {
        let mut v = vec![0.0; len];
        fill_uniform(&mut v, seed, 0, 1.0);
        v
    }

    #[test]
    fn a_query_block_fits_its_bytes_and_holds_one_to_s_rows() {
        let shape = AttnShape {
            seqs: 2,
            seq_len: 4096,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
        };
        let row = 2 * 32 * 4096 * 4; // one query row's scores, every head
        assert_eq!(shape.query_block_rows(256 << 20), 256);
        assert_eq!(shape.query_block_rows(3 * row - 1), 2);
        assert_eq!(shape.query_block_rows(0), 1);
        assert_eq!(shape.query_block_rows(usize::MAX), 4096);
    }

    /// Every vector set's copy of the rotation gives the bits of the
    /// rotation written out element by element, forward and transposed,
    /// for a whole head and for a partly rotating one (its last columns
    /// passing through).
    #[test]
    fn rope_gives_the_element_by_element_rotation_s_bits() {
        let (seq_len, heads, head_dim) = (5, 3, 20);
        for rotary in [20, 12] {
            let table = RopeTable::<f32>::partial(seq_len, head_dim, rotary, 10_000.0);
            let x = filled(2 * seq_len * heads * head_dim, 3);
            for transpose in [false, true] {
                let mut want = x.clone();
                let half = rotary / 2;
                for (r, v) in want.chunks_exact_mut(head_dim).enumerate() {
                    let p = r / heads % seq_len;
                    for i in 0..half {
                        let (c, s) = (table.cos[p * half + i], table.sin[p * half + i]);
                        let s = if transpose { -s } else { s };
                        let (a, b) = (v[i], v[i + half]);
                        v[i] = a * c - b * s;
                        v[i + half] = b * c + a * s;
                    }
                }
                for isa in VectorIsa::supported_here() {
                    let mut got = x.clone();
                    rope_rows(isa, &mut got, &table, seq_len, heads, transpose);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{isa:?}, {rotary}, {transpose}");
                }
            }
        }
    }

    /// The eight-sum dot product is the plain sum up to rounding, for
    /// every length around the lane count (a ragged tail included), and
    /// exact where every partial sum is.
    #[test]
    fn lane_dot_is_the_dot_product() {
        for len in 0..=27 {
            let (a, b) = (filled(len, 11), filled(len, 12));
            let exact: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            let got = dot(&a, &b) as f64;
            assert!(
                (got - exact).abs() <= 1e-6 * (1.0 + exact.abs()),
                "{len}: {got} vs {exact}"
            );
            let ints: Vec<f32> = (0..len).map(|i| (i % 7) as f32 - 3.0).collect();
            let want: f32 = ints.iter().map(|x| x * x).sum();
            assert_eq!(dot(&ints, &ints), want, "{len}: small integers sum exactly");
        }
    }
}
