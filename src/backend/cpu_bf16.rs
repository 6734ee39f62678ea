//! The cpu's expert FFN on bf16 compute params read as they are stored
//! (`ExpertGemm::Bf16`): every GEMM through `bf16_gemm`, its activations
//! and output gradients rounded to bf16 as they are packed, products summed
//! in f32; the activations between the GEMMs (SwiGLU, GELU and their
//! gradients) stay f32, as in `cpu.rs`, whose f32 FFN this mirrors.

#![allow(clippy::too_many_arguments)]

use super::bf16_gemm::{gemm_bf16, Operand, Values};
use super::cpu::{for_part_pairs, for_parts, hidden_into, sized, swiglu_grads, FfnScratch};
use super::gemm::Write;
use crate::math::{gelu_grad, ExpertKind, ExpertSaved};

/// `v` as rows of K (X(r, k) at r·K + k).
fn rows_f32(v: &[f32]) -> Operand<'_> {
    Operand::rows(Values::F32(v))
}

/// `v` stored transposed (X(r, k) at k·R + r).
fn k_major_f32(v: &[f32]) -> Operand<'_> {
    Operand::k_major(Values::F32(v))
}

/// An expert's weight matrices, bf16 bits, as the cpu's FFN lays them out:
/// w1 (F, D), w3 (F, D) for SwiGLU, w2 (D, F) last.
struct Weights<'a> {
    w1: &'a [u16],
    w3: &'a [u16],
    w2: &'a [u16],
}

impl<'a> Weights<'a> {
    fn split(kind: ExpertKind, params: &'a [u16], d: usize, f: usize) -> Self {
        assert_eq!(params.len(), kind.params(d, f), "an expert's params");
        let w3 = match kind {
            ExpertKind::SwiGlu => &params[f * d..2 * f * d],
            ExpertKind::Gelu => &[],
        };
        Self {
            w1: &params[..f * d],
            w3,
            w2: &params[params.len() - d * f..],
        }
    }
}

/// out (n, D) = expert(x (n, D)) with bf16 params; `saved` keeps what the
/// backward needs (f32, as the f32 FFN's).
pub(crate) fn ffn_forward_bf16(
    kind: ExpertKind,
    out: &mut [f32],
    saved: &mut ExpertSaved<f32>,
    x: &[f32],
    params: &[u16],
    n: usize,
    d: usize,
    f: usize,
    scratch: &mut FfnScratch,
) {
    let w = Weights::split(kind, params, d, f);
    saved.a.resize(n * f, 0.0);
    let up = |out: &mut [f32], w: &[u16]| {
        let w = Operand::rows(Values::Bf16(w));
        gemm_bf16(out, Write::Set, rows_f32(x), w, n, d, f);
    };
    up(&mut saved.a, w.w1);
    if kind == ExpertKind::SwiGlu {
        saved.b.resize(n * f, 0.0);
        up(&mut saved.b, w.w3);
    } else {
        saved.b.clear();
    }
    hidden_into(kind, saved, &mut scratch.h, None);
    let w2 = Operand::rows(Values::Bf16(w.w2));
    gemm_bf16(out, Write::Set, rows_f32(&scratch.h), w2, n, f, d);
}

/// dx (n, D) = …, dparams += … or = … as `dparams_write` says, as
/// `cpu::ffn_backward` with bf16 params.
pub(crate) fn ffn_backward_bf16(
    kind: ExpertKind,
    dx: &mut [f32],
    dparams: &mut [f32],
    dparams_write: Write,
    dout: &[f32],
    saved: &ExpertSaved<f32>,
    x: &[f32],
    params: &[u16],
    n: usize,
    d: usize,
    f: usize,
    scratch: &mut FfnScratch,
) {
    let w = Weights::split(kind, params, d, f);
    hidden_into(kind, saved, &mut scratch.h, Some(&mut scratch.sig));
    let split = dparams.len() - d * f;
    let (dw_in, dw2) = dparams.split_at_mut(split);
    // dh (n, F) = dout · w2: w2 (D, F) is B (F × D) stored transposed.
    let dh = sized(&mut scratch.dh, n * f);
    let w2_t = Operand::k_major(Values::Bf16(w.w2));
    gemm_bf16(dh, Write::Set, rows_f32(dout), w2_t, n, d, f);
    // dw2 (D, F) = doutᵀ · h: both summed over the tokens.
    let h = &scratch.h;
    gemm_bf16(
        dw2,
        dparams_write,
        k_major_f32(dout),
        k_major_f32(h),
        d,
        n,
        f,
    );
    let dh = &*dh;
    let da = sized(&mut scratch.da, n * f);
    // dx (n, D) (+)= dz · w (w (F, D) is B (D × F) stored transposed) and
    // dw (F, D) (+)= dzᵀ · x.
    let input_grads = |dx: &mut [f32], dx_write, dw: &mut [f32], dz: &[f32], w: &[u16]| {
        let w_t = Operand::k_major(Values::Bf16(w));
        gemm_bf16(dx, dx_write, rows_f32(dz), w_t, n, f, d);
        gemm_bf16(dw, dparams_write, k_major_f32(dz), k_major_f32(x), f, n, d);
    };
    match kind {
        ExpertKind::SwiGlu => {
            let db = sized(&mut scratch.db, n * f);
            let (a, b, sig) = (&saved.a, &saved.b, &scratch.sig);
            for_part_pairs(da, db, |at, da, db| {
                let r = at..at + da.len();
                let (dh, a, b, sig) = (&dh[r.clone()], &a[r.clone()], &b[r.clone()], &sig[r]);
                swiglu_grads(da, db, dh, a, b, sig);
            });
            let (dw1, dw3) = dw_in.split_at_mut(f * d);
            input_grads(dx, Write::Set, dw1, &scratch.da, w.w1);
            input_grads(dx, Write::Add, dw3, &scratch.db, w.w3);
        }
        ExpertKind::Gelu => {
            let a = &saved.a;
            for_parts(da, |at, da| {
                for i in 0..da.len() {
                    da[i] = dh[at + i] * gelu_grad(a[at + i]);
                }
            });
            input_grads(dx, Write::Set, dw_in, &scratch.da, w.w1);
        }
    }
}

/// The expert FFN on host slices with bf16 params (bits), as the cpu
/// device computes it under [`ExpertGemm::Bf16`](super::ExpertGemm).
impl super::CpuBackend {
    pub fn expert_ffn_forward_bf16(
        &self,
        kind: ExpertKind,
        out: &mut [f32],
        saved: &mut ExpertSaved<f32>,
        x: &[f32],
        params: &[u16],
        n: usize,
        d: usize,
        f: usize,
    ) {
        let scratch = &mut FfnScratch::default();
        ffn_forward_bf16(kind, out, saved, x, params, n, d, f, scratch);
    }

    /// dparams += the expert's gradient.
    pub fn expert_ffn_backward_bf16(
        &self,
        kind: ExpertKind,
        dx: &mut [f32],
        dparams: &mut [f32],
        dout: &[f32],
        saved: &ExpertSaved<f32>,
        x: &[f32],
        params: &[u16],
        n: usize,
        d: usize,
        f: usize,
    ) {
        let scratch = &mut FfnScratch::default();
        let add = Write::Add;
        ffn_backward_bf16(
            kind, dx, dparams, add, dout, saved, x, params, n, d, f, scratch,
        );
    }
}

/// out (M, N) = x (M, K) · w (N, K)ᵀ, x rounded to bf16 and w bf16 bits,
/// products summed in f32 (the bf16 counterpart of
/// [`gemm_forward`](super::gemm_forward)).
pub fn gemm_forward_bf16(out: &mut [f32], x: &[f32], w: &[u16], m: usize, k: usize, n: usize) {
    gemm_bf16(
        out,
        Write::Set,
        rows_f32(x),
        Operand::rows(Values::Bf16(w)),
        m,
        k,
        n,
    );
}
