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

use super::gemm::{gemm_backward, gemm_forward, Write};
use crate::math::{gelu, gelu_grad, sigmoid, silu, ExpertKind, ExpertSaved};
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

/// `buf` resized to `len`, keeping its allocation and old values, for an
/// output every element of which is written.
pub(super) fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len, 0.0);
    buf
}

/// Below this many hidden elements an activation pass stays on the calling
/// thread (about 0.1 ms of sigmoids; a spawn costs tens of microseconds).
const PARALLEL_MIN_ELEMENTS: usize = 1 << 15;

/// An activation element (a sigmoid or a tanh) as elements of the
/// streaming work `parallel` shares out, so that a job holds at least
/// `PARALLEL_MIN_ELEMENTS` of them.
const ACTIVATION_WORK: usize = crate::parallel::MIN_JOB_WORK / PARALLEL_MIN_ELEMENTS;

/// Runs `body(start, part)` on each part of `out` (`start`: the index of
/// its first element), each on its own thread. Each element is computed
/// alone, so the cut changes no bit of the result.
pub(super) fn for_parts(out: &mut [f32], body: impl Fn(usize, &mut [f32]) + Sync) {
    crate::parallel::for_row_blocks(out, 1, ACTIVATION_WORK, body);
}

/// `for_parts` over two outputs of the same length, cut alike.
pub(super) fn for_part_pairs(
    out: &mut [f32],
    out2: &mut [f32],
    body: impl Fn(usize, &mut [f32], &mut [f32]) + Sync,
) {
    assert_eq!(out.len(), out2.len());
    crate::parallel::for_row_block_pairs(out, 1, out2, 1, ACTIVATION_WORK, body);
}

/// The hidden activation h = silu(a)·b (SwiGLU) or gelu(a) into `h`; with
/// `sig`, also σ(a) (SwiGLU), which the backward reuses for silu′.
pub(super) fn hidden_into(
    kind: ExpertKind,
    saved: &ExpertSaved<f32>,
    h: &mut Vec<f32>,
    sig: Option<&mut Vec<f32>>,
) {
    let n = saved.a.len();
    let (a, b) = (&saved.a, &saved.b);
    let h = sized(h, n);
    match (kind, sig) {
        (ExpertKind::SwiGlu, Some(sig)) => for_part_pairs(h, sized(sig, n), |at, h, sig| {
            for i in 0..h.len() {
                let s = sigmoid(a[at + i]);
                sig[i] = s;
                // silu(a) = a·σ(a), the same operations.
                h[i] = a[at + i] * s * b[at + i];
            }
        }),
        (ExpertKind::SwiGlu, None) => for_parts(h, |at, h| {
            for i in 0..h.len() {
                h[i] = silu(a[at + i]) * b[at + i];
            }
        }),
        (ExpertKind::Gelu, _) => for_parts(h, |at, h| {
            for i in 0..h.len() {
                h[i] = gelu(a[at + i]);
            }
        }),
    }
}

/// SwiGLU's hidden gradients from dh = ∂L/∂h, h = silu(a)·b: db = dh·silu(a)
/// and da = dh·b·silu′(a), from σ(a) with the operations of `math::silu`
/// and `math::silu_grad` (so the same bits, for one sigmoid instead of
/// two).
#[inline(always)]
pub(super) fn swiglu_grads(
    da: &mut [f32],
    db: &mut [f32],
    dh: &[f32],
    a: &[f32],
    b: &[f32],
    sig: &[f32],
) {
    for i in 0..da.len() {
        let s = sig[i];
        db[i] = dh[i] * (a[i] * s);
        da[i] = dh[i] * b[i] * (s * (1.0 + a[i] * (1.0 - s)));
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
    gemm_forward(&mut saved.a, x, &params[..f * d], n, d, f);
    if kind == ExpertKind::SwiGlu {
        saved.b.resize(n * f, 0.0);
        gemm_forward(&mut saved.b, x, &params[f * d..2 * f * d], n, d, f);
    } else {
        saved.b.clear();
    }
    hidden_into(kind, saved, &mut scratch.h, None);
    gemm_forward(out, &scratch.h, &params[params.len() - d * f..], n, f, d);
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
    let (h, w2) = (&scratch.h, &params[split..]);
    gemm_backward(dh, dw2, [Write::Set, dparams_write], dout, h, w2, n, f, d);
    let dh = &*dh;
    let w1 = &params[..f * d];
    let da = sized(&mut scratch.da, n * f);
    match kind {
        ExpertKind::SwiGlu => {
            let db = sized(&mut scratch.db, n * f);
            let (a, b, sig) = (&saved.a, &saved.b, &scratch.sig);
            for_part_pairs(da, db, |at, da, db| {
                let r = at..at + da.len();
                swiglu_grads(
                    da,
                    db,
                    &dh[r.clone()],
                    &a[r.clone()],
                    &b[r.clone()],
                    &sig[r],
                );
            });
            let (dw1, dw3) = dw_in.split_at_mut(f * d);
            let (da, db, w3) = (&scratch.da, &scratch.db, &params[f * d..2 * f * d]);
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
            gemm_backward(dx, dw_in, writes, &scratch.da, x, w1, n, d, f);
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
    fn ranges_cover_every_element_once() {
        for n in [
            0,
            1,
            7,
            PARALLEL_MIN_ELEMENTS - 1,
            PARALLEL_MIN_ELEMENTS + 3,
        ] {
            // Each visit adds the element's index + 1, as its part says.
            let visit = |at: usize, part: &mut [f32]| {
                part.iter_mut()
                    .enumerate()
                    .for_each(|(i, h)| *h += (at + i + 1) as f32)
            };
            let (mut hits, mut hits2) = (vec![0.0f32; n], vec![0.0f32; n]);
            for_parts(&mut hits, visit);
            assert!((0..n).all(|i| hits[i] == (i + 1) as f32));
            hits.fill(0.0);
            for_part_pairs(&mut hits, &mut hits2, |at, part, part2| {
                visit(at, part);
                visit(at, part2);
            });
            assert!((0..n).all(|i| hits[i] == (i + 1) as f32 && hits2[i] == (i + 1) as f32));
        }
    }

    /// The activations of a layer large enough to be split over threads,
    /// and the σ(a) the backward reuses, are bit for bit the formulas of
    /// `math` (which the reference trainer uses).
    #[test]
    fn split_activations_equal_the_math_formulas_bit_for_bit() {
        let n = PARALLEL_MIN_ELEMENTS * 2 + 5;
        let wave = |i: usize, k: usize| ((i * k % 1009) as f32 / 1009.0 - 0.5) * 12.0;
        let saved = ExpertSaved {
            a: (0..n).map(|i| wave(i, 37)).collect(),
            b: (0..n).map(|i| wave(i, 53)).collect(),
        };
        let (mut h, mut sig) = (Vec::new(), Vec::new());
        hidden_into(ExpertKind::SwiGlu, &saved, &mut h, Some(&mut sig));
        for i in 0..n {
            let (a, b) = (saved.a[i], saved.b[i]);
            assert_eq!(h[i].to_bits(), (silu(a) * b).to_bits());
            assert_eq!(sig[i].to_bits(), sigmoid(a).to_bits());
        }
        let dh: Vec<f32> = (0..n).map(|i| wave(i, 11)).collect();
        let (mut da, mut db) = (vec![0.0; n], vec![0.0; n]);
        swiglu_grads(&mut da, &mut db, &dh, &saved.a, &saved.b, &sig);
        for i in 0..n {
            let (a, b) = (saved.a[i], saved.b[i]);
            assert_eq!(db[i].to_bits(), (dh[i] * silu(a)).to_bits());
            let da_math = dh[i] * b * crate::math::silu_grad(a);
            assert_eq!(da[i].to_bits(), da_math.to_bits());
        }
        hidden_into(ExpertKind::SwiGlu, &saved, &mut h, None);
        assert!((0..n).all(|i| h[i].to_bits() == (silu(saved.a[i]) * saved.b[i]).to_bits()));
        hidden_into(ExpertKind::Gelu, &saved, &mut h, None);
        assert!((0..n).all(|i| h[i].to_bits() == gelu(saved.a[i]).to_bits()));
    }

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
