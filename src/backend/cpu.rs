//! The cpu backend: GEMMs through `matrixmultiply`'s sgemm, split over
//! scoped threads (`gemm.rs`), activations from `math`.
//!
//! Chosen by measurement on the 2-core development machine. On an expert's
//! GEMM alone (512 × 512 × 1024 f32, 2 threads) faer was fastest:
//! 112–141 GFLOP/s, against 83–102 for matrixmultiply and 60–88 for gemm.
//! But in `strata bench step`, where the GEMMs share the cores with the
//! prefetcher, the checksum verifier and the optimizer, faer's rayon workers
//! made the expert-wise step 1.8–2.3 s (1.43–1.63× the naive schedule),
//! against 1.6–1.9 s (1.82–1.85×) with matrixmultiply; compute alone was
//! 1.28 s with faer and 1.32–1.53 s with matrixmultiply.

#![allow(clippy::too_many_arguments)]

use super::activations::{for_parts, hidden_into, sized, swiglu_input_grads};
use super::gemm::{gemm_backward, gemm_forward, Write};
use crate::math::{gelu_grad, resize_exact_overwritten, ExpertKind, ExpertSaved};
use crate::EngineError;

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

/// Buffers the expert FFN reuses from call to call: the hidden activation,
/// the gate's sigmoid and the hidden layer's gradients, n × F each (what
/// would otherwise be allocated and faulted in for every expert of every
/// pass).
#[derive(Debug, Default)]
pub struct FfnScratch {
    pub(super) h: Vec<f32>,
    pub(super) sig: Vec<f32>,
    pub(super) dh: Vec<f32>,
    pub(super) da: Vec<f32>,
    pub(super) db: Vec<f32>,
}

/// out (n, D) = expert(x (n, D)) with f32 params; `saved` keeps what the
/// backward needs.
pub(crate) fn ffn_forward(
    kind: ExpertKind,
    out: &mut [f32],
    saved: &mut ExpertSaved<f32>,
    x: &[f32],
    params: &[f32],
    n: usize,
    d: usize,
    f: usize,
    scratch: &mut FfnScratch,
) {
    assert_eq!(params.len(), kind.params(d, f));
    resize_exact_overwritten(&mut saved.a, n * f, 0.0);
    gemm_forward(&mut saved.a, x, &params[..f * d], n, d, f);
    if kind == ExpertKind::SwiGlu {
        resize_exact_overwritten(&mut saved.b, n * f, 0.0);
        gemm_forward(&mut saved.b, x, &params[f * d..2 * f * d], n, d, f);
    } else {
        saved.b.clear();
    }
    hidden_into(kind, saved, &mut scratch.h, None);
    gemm_forward(
        out,
        &scratch.h[..n * f],
        &params[params.len() - d * f..],
        n,
        f,
        d,
    );
}

/// dx (n, D) = …, dparams += … or = … as `dparams_write` says (dx is
/// overwritten; neither output is read first when set).
pub(crate) fn ffn_backward(
    kind: ExpertKind,
    dx: &mut [f32],
    dparams: &mut [f32],
    dparams_write: Write,
    dout: &[f32],
    saved: &ExpertSaved<f32>,
    x: &[f32],
    params: &[f32],
    n: usize,
    d: usize,
    f: usize,
    scratch: &mut FfnScratch,
) {
    hidden_into(kind, saved, &mut scratch.h, Some(&mut scratch.sig));
    let split = dparams.len() - d * f;
    let (dw_in, dw2) = dparams.split_at_mut(split);
    let dh = sized(&mut scratch.dh, n * f);
    let (h, w2) = (&scratch.h[..n * f], &params[split..]);
    gemm_backward(dh, dw2, [Write::Set, dparams_write], dout, h, w2, n, f, d);
    let dh = &*dh;
    let w1 = &params[..f * d];
    let da = sized(&mut scratch.da, n * f);
    match kind {
        ExpertKind::SwiGlu => {
            let db = sized(&mut scratch.db, n * f);
            swiglu_input_grads(da, db, dh, saved, &scratch.sig[..n * f]);
            let (dw1, dw3) = dw_in.split_at_mut(f * d);
            let (da, db, w3) = (&*da, &*db, &params[f * d..2 * f * d]);
            gemm_backward(dx, dw1, [Write::Set, dparams_write], da, x, w1, n, d, f);
            gemm_backward(dx, dw3, [Write::Add, dparams_write], db, x, w3, n, d, f);
        }
        ExpertKind::Gelu => {
            let a = &saved.a;
            for_parts(da, |at, da| {
                for i in 0..da.len() {
                    da[i] = dh[at + i] * gelu_grad(a[at + i]);
                }
            });
            let writes = [Write::Set, dparams_write];
            gemm_backward(dx, dw_in, writes, da, x, w1, n, d, f);
        }
    }
}

/// The expert FFN on host slices (params and activations in host memory),
/// which the tests hold to the plain math.
impl CpuBackend {
    pub fn name(&self) -> &'static str {
        "cpu"
    }

    #[allow(clippy::too_many_arguments)]
    pub fn expert_ffn_forward(
        &self,
        kind: ExpertKind,
        out: &mut [f32],
        saved: &mut ExpertSaved<f32>,
        x: &[f32],
        params: &[f32],
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        let scratch = &mut FfnScratch::default();
        ffn_forward(kind, out, saved, x, params, n, d, f, scratch);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub fn expert_ffn_backward(
        &self,
        kind: ExpertKind,
        dx: &mut [f32],
        dparams: &mut [f32],
        dout: &[f32],
        saved: &ExpertSaved<f32>,
        x: &[f32],
        params: &[f32],
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        let scratch = &mut FfnScratch::default();
        ffn_backward(
            kind,
            dx,
            dparams,
            Write::Add,
            dout,
            saved,
            x,
            params,
            n,
            d,
            f,
            scratch,
        );
        Ok(())
    }
}

impl crate::model::DenseKernels for CpuBackend {
    fn narrow_kernels(&self) -> &dyn crate::model::DenseKernels {
        &super::NarrowCpuKernels
    }

    fn forward(
        &self,
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        gemm_forward(out, x, w, m, k, n);
        Ok(())
    }

    fn backward(
        &self,
        dx: &mut [f32],
        dw: &mut [f32],
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        gemm_backward(dx, dw, [Write::Add; 2], dout, x, w, m, k, n);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math::{expert_ffn_backward, expert_ffn_forward};

    #[test]
    fn gemm_experts_match_the_plain_loops() {
        for kind in [ExpertKind::SwiGlu, ExpertKind::Gelu] {
            let (n, d, f) = (7, 16, 24);
            let x: Vec<f32> = (0..n * d)
                .map(|i| ((i * 37 % 101) as f32 / 101.0) - 0.5)
                .collect();
            let p: Vec<f32> = (0..kind.params(d, f))
                .map(|i| ((i * 53 % 97) as f32 / 97.0) - 0.5)
                .collect();
            let dout: Vec<f32> = (0..n * d)
                .map(|i| ((i * 11 % 89) as f32 / 89.0) - 0.5)
                .collect();
            let (mut o1, mut o2) = (vec![0.0; n * d], vec![0.0; n * d]);
            let (mut s1, mut s2) = (ExpertSaved::default(), ExpertSaved::default());
            CpuBackend
                .expert_ffn_forward(kind, &mut o1, &mut s1, &x, &p, n, d, f)
                .unwrap();
            expert_ffn_forward(kind, &mut o2, &mut s2, &x, &p, n, d, f);
            let (mut dx1, mut dx2) = (vec![0.0; n * d], vec![0.0; n * d]);
            let (mut dp1, mut dp2) = (vec![0.0; p.len()], vec![0.0; p.len()]);
            CpuBackend
                .expert_ffn_backward(kind, &mut dx1, &mut dp1, &dout, &s1, &x, &p, n, d, f)
                .unwrap();
            expert_ffn_backward(kind, &mut dx2, &mut dp2, &dout, &s2, &x, &p, n, d, f);
            // Different summation orders: agreement to a few f32 ulps of
            // sums of O(10) terms of size O(1).
            for (a, b) in o1
                .iter()
                .zip(&o2)
                .chain(dx1.iter().zip(&dx2))
                .chain(dp1.iter().zip(&dp2))
            {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{a} vs {b} ({})",
                    kind.name()
                );
            }
        }
    }
}
