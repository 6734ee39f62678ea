//! The plain math every fast path is held to, written generically over
//! f32 and f64: the MoE stack's ops here, and the language model's
//! attention, rotary embeddings and embedding in [`attention`]:
//! mirrored `*_forward` / `*_backward` pairs, row-major, no tiers, no
//! scheduling. The reference trainer runs these in f32; the gradient tests
//! run them in f64 against finite differences; the engine's fast paths are
//! held to them by the equivalence tests. The passes over tokens (RMSNorm,
//! the linear layers, the permutation's gathers and scatters, the combine)
//! share their rows over the cores, each output element computed by one
//! job in the order the plain loop sums it: the same bits on any split
//! (`split_tests` holds them to the plain loops).
//!
//! Legend: T tokens, D d_model, F d_ff, E experts, K top-k, V classes.
//! Weights are stored as Hugging Face does, (out, in): `y = x · Wᵀ`.

// Numeric kernels index rows and columns explicitly and take their shapes
// as arguments (T, D, F, …), as llm.c does; the iterator forms these lints
// suggest would hide the shapes.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

pub mod attention;
pub mod attention_rows;
mod cross_entropy;
pub mod fast_exp;
mod permute;
mod router;
pub mod vector_isa;

pub use cross_entropy::{
    cross_entropy_forward_backward, cross_entropy_forward_backward_split, cross_entropy_loss,
    cross_entropy_loss_after, IGNORED_TARGET,
};
pub use permute::{
    combine_backward_weights, combine_forward, gather_backward, gather_forward,
    scatter_to_assignments, AssignmentGrads, Permutation,
};
pub use router::{
    add_prob_sums, aux_prob_grad, balance_loss, route_logits, router_backward, router_forward,
    router_logits_grad, top_k, RouterConfig, Routing, Scoring,
};

/// f32 or f64.
pub trait Real:
    Copy
    + Default
    + PartialOrd
    + Debug
    + Send
    + Sync
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
{
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    /// e^self. For f32 it is [`fast_exp::exp_approx`] (within 2 ulp of
    /// the exact exp, the same bits on every CPU and in the CUDA kernels'
    /// `strata_exp`, and a loop of it vectorizes); for f64, libm's.
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn is_finite(self) -> bool;
    fn zero() -> Self {
        Self::from_f64(0.0)
    }
    fn one() -> Self {
        Self::from_f64(1.0)
    }
}

macro_rules! real_impl {
    ($t:ty, $exp:path) => {
        impl Real for $t {
            #[inline]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn exp(self) -> Self {
                $exp(self)
            }
            #[inline]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
        }
    };
}
real_impl!(f32, crate::math::fast_exp::exp_approx);
real_impl!(f64, f64::exp);

/// out (M, N) = x (M, K) · w (N, K)ᵀ
///
/// Each output is summed over K in order, as a dot product would be; a
/// row's N outputs accumulate side by side (over wᵀ, so the N lanes
/// vectorize) and rows are shared over the cores. Neither changes a bit.
pub fn linear_forward<R: Real>(out: &mut [R], x: &[R], w: &[R], m: usize, k: usize, n: usize) {
    assert_eq!(x.len(), m * k);
    assert_eq!(w.len(), n * k);
    assert_eq!(out.len(), m * n);
    let mut wt = vec![R::zero(); k * n];
    for j in 0..n {
        for p in 0..k {
            wt[p * n + j] = w[j * k + p];
        }
    }
    let wt = &wt;
    crate::parallel::for_row_blocks(out, n, k * n, |first, block| {
        for (r, out_row) in block.chunks_mut(n.max(1)).enumerate() {
            let xi = &x[(first + r) * k..(first + r + 1) * k];
            // Eight outputs at a time in registers, then the rest.
            let mut j0 = 0;
            while j0 + LANES <= n {
                let mut acc = [R::zero(); LANES];
                for p in 0..k {
                    let xp = xi[p];
                    let wp = &wt[p * n + j0..p * n + j0 + LANES];
                    for l in 0..LANES {
                        acc[l] += xp * wp[l];
                    }
                }
                out_row[j0..j0 + LANES].copy_from_slice(&acc);
                j0 += LANES;
            }
            for j in j0..n {
                let mut acc = R::zero();
                for p in 0..k {
                    acc += xi[p] * wt[p * n + j];
                }
                out_row[j] = acc;
            }
        }
    });
}

/// Outputs `linear_forward` accumulates side by side.
const LANES: usize = 8;

/// dx (M, K) += dout · w;  dw (N, K) += doutᵀ · x
///
/// Each element of dx sums over N in order and each of dw over M in
/// order, the same bits as one loop over (i, j, p); dx's rows and dw's
/// rows are each shared over the cores.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<R: Real>(
    dx: &mut [R],
    dw: &mut [R],
    dout: &[R],
    x: &[R],
    w: &[R],
    m: usize,
    k: usize,
    n: usize,
) {
    assert_eq!(dout.len(), m * n);
    assert_eq!(dx.len(), m * k);
    assert_eq!(dw.len(), n * k);
    crate::parallel::for_row_blocks(dx, k, n * k, |first, block| {
        for (r, dxi) in block.chunks_mut(k.max(1)).enumerate() {
            let i = first + r;
            for j in 0..n {
                let g = dout[i * n + j];
                let wj = &w[j * k..(j + 1) * k];
                for p in 0..k {
                    dxi[p] += g * wj[p];
                }
            }
        }
    });
    crate::parallel::for_row_blocks(dw, k, m * k, |first, block| {
        for i in 0..m {
            let xi = &x[i * k..(i + 1) * k];
            for (r, dwj) in block.chunks_mut(k.max(1)).enumerate() {
                let g = dout[i * n + first + r];
                for p in 0..k {
                    dwj[p] += g * xi[p];
                }
            }
        }
    });
}

pub fn sigmoid<R: Real>(x: R) -> R {
    R::one() / (R::one() + (-x).exp())
}

pub fn silu<R: Real>(x: R) -> R {
    x * sigmoid(x)
}

/// d silu / dx
pub fn silu_grad<R: Real>(x: R) -> R {
    let s = sigmoid(x);
    s * (R::one() + x * (R::one() - s))
}

const GELU_K: f64 = 0.797_884_560_802_865_4; // √(2/π)
const GELU_C: f64 = 0.044_715;

/// GELU, tanh approximation (as GPT-2 and llm.c).
pub fn gelu<R: Real>(x: R) -> R {
    let k = R::from_f64(GELU_K);
    let c = R::from_f64(GELU_C);
    let half = R::from_f64(0.5);
    half * x * (R::one() + (k * (x + c * x * x * x)).tanh())
}

pub fn gelu_grad<R: Real>(x: R) -> R {
    let k = R::from_f64(GELU_K);
    let c = R::from_f64(GELU_C);
    let half = R::from_f64(0.5);
    let u = k * (x + c * x * x * x);
    let t = u.tanh();
    let du = k * (R::one() + R::from_f64(3.0) * c * x * x);
    half * (R::one() + t) + half * x * (R::one() - t * t) * du
}

/// log Σ exp(row), shifted by the row's max so it cannot overflow.
pub fn log_sum_exp<R: Real>(row: &[R]) -> R {
    let max = row_max(row);
    let mut sum = R::zero();
    for &z in row {
        sum += (z - max).exp();
    }
    max + sum.ln()
}

/// The largest of `row`, its first where several are equal.
fn row_max<R: Real>(row: &[R]) -> R {
    row.iter()
        .copied()
        .fold(row[0], |a, b| if b > a { b } else { a })
}

/// Expert kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertKind {
    /// Mixtral: `w2 · (silu(w1 x) ⊙ w3 x)`; params w1 (F,D) | w3 (F,D) | w2 (D,F).
    SwiGlu,
    /// `w2 · gelu(w1 x)`; params w1 (F,D) | w2 (D,F).
    Gelu,
}

impl ExpertKind {
    pub fn params(self, d: usize, f: usize) -> usize {
        match self {
            ExpertKind::SwiGlu => 3 * d * f,
            ExpertKind::Gelu => 2 * d * f,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ExpertKind::SwiGlu => "swiglu",
            ExpertKind::Gelu => "gelu",
        }
    }
}

/// What an expert's forward keeps for its backward: the pre-activations.
/// (n, F) each; `b` is empty for GELU.
#[derive(Clone, Debug, Default)]
pub struct ExpertSaved<R> {
    pub a: Vec<R>,
    pub b: Vec<R>,
}

impl<R> ExpertSaved<R> {
    /// Frees a buffer that holds more than a quarter over `len` values.
    /// Kept from pass to pass and grown exactly ([`resize_exact`]), the
    /// buffers then hold at most 1.25 times what a pass needs, rather than
    /// the most the expert ever had routed to it (or twice that, as a
    /// `Vec` grows by doubling).
    pub fn fit(&mut self, len: usize) {
        for v in [&mut self.a, &mut self.b] {
            if v.capacity() > len + len / 4 {
                *v = Vec::new();
            }
        }
    }
}

/// `v` resized to `len` values, its capacity grown to exactly `len` where
/// it is short (a `Vec` would grow to twice its capacity): for buffers
/// kept from pass to pass, whose size follows the routing.
pub fn resize_exact<R: Clone>(v: &mut Vec<R>, len: usize, value: R) {
    if v.capacity() < len {
        v.reserve_exact(len - v.len());
    }
    v.resize(len, value);
}

/// [`resize_exact`] for an output every element of which the caller then
/// writes: where the capacity is short, the old values are dropped rather
/// than copied into the new allocation.
pub(crate) fn resize_exact_overwritten<R: Clone>(v: &mut Vec<R>, len: usize, value: R) {
    if v.capacity() < len {
        *v = Vec::new();
    }
    resize_exact(v, len, value);
}

/// out (n, D) = expert(x (n, D)), with `params` laid out as `ExpertKind` says.
pub fn expert_ffn_forward<R: Real>(
    kind: ExpertKind,
    out: &mut [R],
    saved: &mut ExpertSaved<R>,
    x: &[R],
    params: &[R],
    n: usize,
    d: usize,
    f: usize,
) {
    assert_eq!(params.len(), kind.params(d, f));
    let w1 = &params[..f * d];
    resize_exact(&mut saved.a, n * f, R::zero());
    linear_forward(&mut saved.a, x, w1, n, d, f);
    let mut hidden = vec![R::zero(); n * f];
    let w2 = match kind {
        ExpertKind::SwiGlu => {
            let w3 = &params[f * d..2 * f * d];
            resize_exact(&mut saved.b, n * f, R::zero());
            linear_forward(&mut saved.b, x, w3, n, d, f);
            for i in 0..n * f {
                hidden[i] = silu(saved.a[i]) * saved.b[i];
            }
            &params[2 * f * d..]
        }
        ExpertKind::Gelu => {
            saved.b.clear();
            for i in 0..n * f {
                hidden[i] = gelu(saved.a[i]);
            }
            &params[f * d..]
        }
    };
    linear_forward(out, &hidden, w2, n, f, d);
}

/// dx (n, D) += …, dparams += … for the expert whose forward saved `saved`.
#[allow(clippy::too_many_arguments)]
pub fn expert_ffn_backward<R: Real>(
    kind: ExpertKind,
    dx: &mut [R],
    dparams: &mut [R],
    dout: &[R],
    saved: &ExpertSaved<R>,
    x: &[R],
    params: &[R],
    n: usize,
    d: usize,
    f: usize,
) {
    let (dw_in, dw2) = dparams.split_at_mut(match kind {
        ExpertKind::SwiGlu => 2 * f * d,
        ExpertKind::Gelu => f * d,
    });
    let w1 = &params[..f * d];
    let mut hidden = vec![R::zero(); n * f];
    match kind {
        ExpertKind::SwiGlu => {
            for i in 0..n * f {
                hidden[i] = silu(saved.a[i]) * saved.b[i];
            }
        }
        ExpertKind::Gelu => {
            for i in 0..n * f {
                hidden[i] = gelu(saved.a[i]);
            }
        }
    }
    let w2 = &params[params.len() - d * f..];
    // dhidden (n, F) = dout · w2;  dw2 += doutᵀ · hidden
    let mut dhidden = vec![R::zero(); n * f];
    linear_backward(&mut dhidden, dw2, dout, &hidden, w2, n, f, d);
    let mut da = vec![R::zero(); n * f];
    match kind {
        ExpertKind::SwiGlu => {
            let w3 = &params[f * d..2 * f * d];
            let mut db = vec![R::zero(); n * f];
            for i in 0..n * f {
                db[i] = dhidden[i] * silu(saved.a[i]);
                da[i] = dhidden[i] * saved.b[i] * silu_grad(saved.a[i]);
            }
            let (dw1, dw3) = dw_in.split_at_mut(f * d);
            linear_backward(dx, dw1, &da, x, w1, n, d, f);
            linear_backward(dx, dw3, &db, x, w3, n, d, f);
        }
        ExpertKind::Gelu => {
            for i in 0..n * f {
                da[i] = dhidden[i] * gelu_grad(saved.a[i]);
            }
            linear_backward(dx, dw_in, &da, x, w1, n, d, f);
        }
    }
}

/// RMSNorm forward: out = x / rms(x) · g, rms = √(mean(x²) + ε); saves 1/rms.
pub fn rmsnorm_forward<R: Real>(
    out: &mut [R],
    inv_rms: &mut [R],
    x: &[R],
    g: &[R],
    t: usize,
    d: usize,
    eps: f64,
) {
    assert_eq!(out.len(), t * d);
    assert_eq!(inv_rms.len(), t);
    crate::parallel::for_row_block_pairs(out, d, inv_rms, 1, d, |first, out, inv_rms| {
        for (r, o) in out.chunks_mut(d.max(1)).enumerate() {
            let row = &x[(first + r) * d..(first + r + 1) * d];
            let mut ss = R::zero();
            for &v in row {
                ss += v * v;
            }
            let inv = R::one() / (ss / R::from_f64(d as f64) + R::from_f64(eps)).sqrt();
            inv_rms[r] = inv;
            for j in 0..d {
                o[j] = row[j] * inv * g[j];
            }
        }
    });
}

/// dx += …, dg += … for RMSNorm.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward<R: Real>(
    dx: &mut [R],
    dg: &mut [R],
    dout: &[R],
    x: &[R],
    g: &[R],
    inv_rms: &[R],
    t: usize,
    d: usize,
) {
    assert_eq!(dx.len(), t * d);
    assert_eq!(dg.len(), d);
    // dx row by row; dg (a sum over rows, in row order) column block by
    // column block: the same bits as one pass, each shared over the cores.
    crate::parallel::for_row_blocks(dx, d, d, |first, block| {
        for (r, dxi) in block.chunks_mut(d.max(1)).enumerate() {
            let i = first + r;
            let row = &x[i * d..(i + 1) * d];
            let dy = &dout[i * d..(i + 1) * d];
            let inv = inv_rms[i];
            let mut dot = R::zero();
            for j in 0..d {
                dot += dy[j] * g[j] * row[j];
            }
            // ∂/∂x_j of x_j·inv·g_j with inv = (mean x² + ε)^-½
            let coef = dot * inv * inv * inv / R::from_f64(d as f64);
            for j in 0..d {
                dxi[j] += dy[j] * g[j] * inv - row[j] * coef;
            }
        }
    });
    crate::parallel::for_row_blocks(dg, 1, t, |first, block| {
        for i in 0..t {
            let row = &x[i * d + first..i * d + first + block.len()];
            let dy = &dout[i * d + first..i * d + first + block.len()];
            let inv = inv_rms[i];
            for j in 0..block.len() {
                block[j] += dy[j] * row[j] * inv;
            }
        }
    });
}

#[cfg(test)]
mod split_tests;

#[cfg(test)]
mod tests {
    use super::*;

    /// The shift by the row's largest logit is what keeps log Σ exp finite
    /// where the exponentials themselves overflow f32 (e¹⁰⁰), wherever in
    /// the row the largest one is.
    #[test]
    fn log_sum_exp_stays_finite_past_exp_s_range() {
        for row in [
            [0.0f32, 100.0, -100.0],
            [100.0, 0.0, -100.0],
            [-100.0, 0.0, 100.0],
        ] {
            let lse = log_sum_exp(&row);
            assert!((lse - 100.0).abs() <= 1e-4, "{row:?}: {lse}");
        }
    }
}
