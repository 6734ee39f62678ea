//! The cpu's expert FFN on bf16 compute params read as they are stored
//! (`ExpertGemm::Bf16`): every GEMM through `bf16_gemm`, its activations
//! and output gradients rounded to bf16 as they are packed, products summed
//! in f32; the activations between the GEMMs (SwiGLU, GELU and their
//! gradients) stay f32 (`activations.rs`, as in `cpu.rs`, whose f32 FFN
//! this mirrors).

#![allow(clippy::too_many_arguments)]

use super::activations::{for_parts, hidden_into, sized, swiglu_input_grads};
use super::bf16_gemm::{bf16_work, gemm_bf16, gemm_bf16_on, Operand, Values};
use super::cpu::FfnScratch;
use super::gemm::{threads_for, Write};
use crate::math::{gelu_grad, resize_exact_overwritten, ExpertKind, ExpertSaved};
use crate::parallel::{compute_threads, run_all};

/// Runs `a` and `b`, GEMMs of `macs` multiply-adds together, side by side
/// where there are threads for both and the work is worth a split (each
/// then splits its GEMMs over half of the threads), else one after the
/// other on every thread. They write disjoint outputs, and a GEMM's sums do
/// not depend on its threads, so the results are the same bits either way.
fn side_by_side(macs: usize, a: impl FnOnce(usize) + Send, b: impl FnOnce(usize) + Send) {
    let threads = compute_threads();
    if threads_for(bf16_work(macs), threads) < 2 {
        a(threads);
        b(threads);
        return;
    }
    let half = threads.div_ceil(2);
    let jobs: Vec<Box<dyn FnOnce() + Send + '_>> = vec![
        Box::new(move || a(half)),
        Box::new(move || b(threads - half)),
    ];
    run_all(jobs);
}

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
    resize_exact_overwritten(&mut saved.a, n * f, 0.0);
    let up = |threads, out: &mut [f32], w: &[u16]| {
        let w = Operand::rows(Values::Bf16(w));
        gemm_bf16_on(threads, out, Write::Set, rows_f32(x), w, (n, d, f));
    };
    if kind == ExpertKind::SwiGlu {
        resize_exact_overwritten(&mut saved.b, n * f, 0.0);
        let (a, b) = (&mut saved.a, &mut saved.b);
        side_by_side(2 * n * d * f, |t| up(t, a, w.w1), |t| up(t, b, w.w3));
    } else {
        up(compute_threads(), &mut saved.a, w.w1);
        saved.b.clear();
    }
    hidden_into(kind, saved, &mut scratch.h, None);
    let w2 = Operand::rows(Values::Bf16(w.w2));
    gemm_bf16(out, Write::Set, rows_f32(&scratch.h[..n * f]), w2, n, f, d);
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
    // dh (n, F) = dout · w2 (w2 (D, F) is B (F × D) stored transposed),
    // beside dw2 (D, F) = doutᵀ · h (both summed over the tokens).
    let dh = sized(&mut scratch.dh, n * f);
    let w2_t = Operand::k_major(Values::Bf16(w.w2));
    let h = &scratch.h[..n * f];
    side_by_side(
        2 * n * d * f,
        |t| gemm_bf16_on(t, dh, Write::Set, rows_f32(dout), w2_t, (n, d, f)),
        |t| {
            let (dout, h) = (k_major_f32(dout), k_major_f32(h));
            gemm_bf16_on(t, dw2, dparams_write, dout, h, (d, n, f));
        },
    );
    let dh = &*dh;
    let da = sized(&mut scratch.da, n * f);
    let grads = InputGrads {
        x,
        dparams_write,
        shape: (n, d, f),
    };
    match kind {
        ExpertKind::SwiGlu => {
            let db = sized(&mut scratch.db, n * f);
            swiglu_input_grads(da, db, dh, saved, &scratch.sig[..n * f]);
            let (dw1, dw3) = dw_in.split_at_mut(f * d);
            let (da, db) = (&*da, &*db);
            grads.run(dx, vec![(dw1, da, w.w1), (dw3, db, w.w3)]);
        }
        ExpertKind::Gelu => {
            let a = &saved.a;
            for_parts(da, |at, da| {
                for i in 0..da.len() {
                    da[i] = dh[at + i] * gelu_grad(a[at + i]);
                }
            });
            grads.run(dx, vec![(dw_in, &*da, w.w1)]);
        }
    }
}

/// The backward's last GEMMs: from the hidden gradients dz (n, F) of the
/// up projections w (F, D).
struct InputGrads<'a> {
    x: &'a [f32],
    dparams_write: Write,
    /// (n, D, F).
    shape: (usize, usize, usize),
}

impl InputGrads<'_> {
    /// dx (n, D) = Σ dz · w over `terms` (w is B (D × F) stored
    /// transposed), beside each term's dw (F, D) (+)= dzᵀ · x.
    fn run(&self, dx: &mut [f32], terms: Vec<(&mut [f32], &[f32], &[u16])>) {
        let (n, d, f) = self.shape;
        let inputs: Vec<(&[f32], &[u16])> = terms.iter().map(|(_, dz, w)| (*dz, *w)).collect();
        side_by_side(
            2 * terms.len() * n * d * f,
            |t| {
                for (i, (dz, w)) in inputs.iter().enumerate() {
                    let write = if i == 0 { Write::Set } else { Write::Add };
                    let w_t = Operand::k_major(Values::Bf16(w));
                    gemm_bf16_on(t, dx, write, rows_f32(dz), w_t, (n, f, d));
                }
            },
            |t| {
                let x = k_major_f32(self.x);
                for (dw, dz, _) in terms {
                    let dz = k_major_f32(dz);
                    gemm_bf16_on(t, dw, self.dparams_write, dz, x, (f, n, d));
                }
            },
        );
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
