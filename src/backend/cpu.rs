//! The cpu backend: GEMMs through `matrixmultiply`'s sgemm, split over
//! scoped threads (`gemm.rs`), activations from `math.rs`.
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

use super::gemm::{linear_backward, linear_forward};
use super::Backend;
use crate::math::{gelu, gelu_grad, silu, silu_grad, ExpertKind, ExpertSaved};
use crate::EngineError;

#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

/// Buffers the expert FFN reuses from call to call: the hidden activation
/// and its gradients, n × F each (what would otherwise be allocated and
/// faulted in for every expert of every pass).
#[derive(Debug, Default)]
pub struct FfnScratch {
    h: Vec<f32>,
    dh: Vec<f32>,
    da: Vec<f32>,
    db: Vec<f32>,
}

/// `buf` resized to `len` zeros, keeping its allocation.
fn zeroed(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.clear();
    buf.resize(len, 0.0);
    buf
}

/// The hidden activation h = silu(a)·b (SwiGLU) or gelu(a) into `h`.
fn hidden_into(kind: ExpertKind, saved: &ExpertSaved<f32>, h: &mut Vec<f32>) {
    h.clear();
    match kind {
        ExpertKind::SwiGlu => h.extend(saved.a.iter().zip(&saved.b).map(|(&a, &b)| silu(a) * b)),
        ExpertKind::Gelu => h.extend(saved.a.iter().map(|&a| gelu(a))),
    }
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
    saved.a.resize(n * f, 0.0);
    linear_forward(&mut saved.a, x, &params[..f * d], n, d, f);
    if kind == ExpertKind::SwiGlu {
        saved.b.resize(n * f, 0.0);
        linear_forward(&mut saved.b, x, &params[f * d..2 * f * d], n, d, f);
    } else {
        saved.b.clear();
    }
    hidden_into(kind, saved, &mut scratch.h);
    linear_forward(out, &scratch.h, &params[params.len() - d * f..], n, f, d);
}

/// dx (n, D) = …, dparams += … (dx is overwritten).
pub(crate) fn ffn_backward(
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
    scratch: &mut FfnScratch,
) {
    dx.fill(0.0);
    hidden_into(kind, saved, &mut scratch.h);
    let split = dparams.len() - d * f;
    let (dw_in, dw2) = dparams.split_at_mut(split);
    let dh = zeroed(&mut scratch.dh, n * f);
    linear_backward(dh, dw2, dout, &scratch.h, &params[split..], n, f, d);
    let w1 = &params[..f * d];
    let da = zeroed(&mut scratch.da, n * f);
    match kind {
        ExpertKind::SwiGlu => {
            let db = zeroed(&mut scratch.db, n * f);
            for i in 0..n * f {
                db[i] = dh[i] * silu(saved.a[i]);
                da[i] = dh[i] * saved.b[i] * silu_grad(saved.a[i]);
            }
            let (dw1, dw3) = dw_in.split_at_mut(f * d);
            linear_backward(dx, dw1, da, x, w1, n, d, f);
            linear_backward(dx, dw3, db, x, &params[f * d..2 * f * d], n, d, f);
        }
        ExpertKind::Gelu => {
            for i in 0..n * f {
                da[i] = dh[i] * gelu_grad(saved.a[i]);
            }
            linear_backward(dx, dw_in, da, x, w1, n, d, f);
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn expert_ffn_forward(
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

    fn expert_ffn_backward(
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
        ffn_backward(kind, dx, dparams, dout, saved, x, params, n, d, f, scratch);
        Ok(())
    }
}

impl crate::model::DenseKernels for CpuBackend {
    fn forward(
        &self,
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        linear_forward(out, x, w, m, k, n);
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
        linear_backward(dx, dw, dout, x, w, m, k, n);
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
