//! The dense layers' heavy kernels on the GPU ([`DenseKernels`]): GEMMs
//! with bf16 inputs and f32 accumulation by default ([`DenseGemm`]: the
//! activations and output gradients rounded to bf16 per call, each weight's
//! bf16 copy kept beside its upload until the weight changes), or with f32
//! inputs (cuBLAS without tensor-core rounding), which agree with the cpu's
//! to f32 rounding of another summation order; causal attention and
//! cross-entropy (`kernels.cu`, the cpu loops' order of sums). Weights that
//! are slices of the engine's dense params are uploaded once between
//! updates (`weights.rs`); these host-slice calls upload their
//! activations and download their results, for what still runs on host
//! activations (a shared expert's and a dense layer's MLP, a MoE block
//! whose devices exchange tokens). The language model's layers otherwise
//! run on device activations (`ops.rs`, `moe.rs`).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtrMut};

use super::expert::GradStart;
use super::gemm::{blas_type, GemmInput};
use super::{CudaBackend, Shape};
use crate::backend::DenseGemm;
use crate::math::attention::AttnShape;
use crate::model::{DenseKernels, DenseResidence, HeadShape};
use crate::EngineError;

impl DenseKernels for CudaBackend {
    fn narrow_kernels(&self) -> &dyn DenseKernels {
        // The router's (T × E) logits: cuBLAS would need its (T × D) input
        // up and, in the backward, dx up and down, 100 MB a layer at
        // moe-s's 8192 tokens, for a product the host's cores do in
        // milliseconds.
        &crate::backend::NarrowCpuKernels
    }

    fn cuda(&self) -> Option<&CudaBackend> {
        Some(self)
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
        assert!(out.len() == m * n && x.len() == m * k && w.len() == n * k);
        self.bind()?;
        let dx = self.upload(x)?;
        let mut dout = self.zeros(m * n)?;
        self.dense_forward(self.dense_gemm, &mut dout, &dx, w, Shape { m, k, n })?;
        self.download(&dout, out)
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
        assert!(dx.len() == m * k && dw.len() == n * k && dout.len() == m * n);
        assert!(x.len() == m * k && w.len() == n * k);
        self.bind()?;
        let (ddout, dxin) = (self.upload(dout)?, self.upload(x)?);
        // dx accumulates into what it held; dw into the step's GPU
        // accumulator for its slice of the dense gradient (added to the
        // host at `grads_flush`), or, for any other slice, into what it
        // held, uploaded and downloaded here.
        let mut ddx = self.upload(dx)?;
        let shape = Shape { m, k, n };
        self.with_grad(dw, |acc| {
            self.dense_backward(self.dense_gemm, &mut ddx, acc, &ddout, &dxin, w, shape)
        })?;
        self.download(&ddx, dx)
    }

    fn grads_begin(&self, grad: &[f32]) {
        self.grads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .begin(grad);
    }

    fn grads_on_device(&self) -> bool {
        true
    }

    fn grads_flush(&self, grad: &mut [f32]) -> Result<(), EngineError> {
        self.bind()?;
        let sums = self
            .grads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .finish(grad);
        self.add_sums_to_host(grad, sums)
    }

    fn head_loss(
        &self,
        dx: &mut [f32],
        dhead: &mut [f32],
        x: &[f32],
        head: &[f32],
        targets: &[u32],
        s: HeadShape,
    ) -> Result<f32, EngineError> {
        let block = crate::backend::head_block_rows(s.v);
        self.head_loss_in_blocks(dx, dhead, x, head, targets, s, block)
    }

    fn pcie_other_bytes(&self) -> u64 {
        CudaBackend::pcie_other_bytes(self)
    }

    fn weights_changed(&self, dense: &[f32]) {
        self.weights
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .reset(dense);
        self.drop_bf16_weights();
        self.resident
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .reset();
    }

    fn residence(&self) -> Option<&dyn DenseResidence> {
        Some(self)
    }

    fn attention_saved_len(&self, shape: &AttnShape) -> usize {
        super::attention_stats_len(shape)
    }

    fn attention_forward(
        &self,
        out: &mut [f32],
        saved: &mut [f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        self.attention_forward_host(out, saved, q, k, v, starts, shape)
    }

    fn attention_backward(
        &self,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        dout: &[f32],
        saved: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        debug_assert!(
            [&*dq, &*dk, &*dv]
                .iter()
                .all(|g| g.iter().all(|&x| x == 0.0)),
            "dq, dk and dv must start zeroed"
        );
        // The gradients start from zero on the GPU: the zeroed buffers are
        // not uploaded.
        let grads = [dq, dk, dv];
        let inputs = [dout, saved, q, k, v];
        let blocks = super::attention::ATTENTION_BLOCK_BYTES;
        self.attention_backward_from(grads, inputs, starts, shape, GradStart::Zero, blocks)
    }

    fn cross_entropy(
        &self,
        dlogits: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
        denominator: usize,
    ) -> Result<f32, EngineError> {
        self.cross_entropy_host(dlogits, logits, targets, v, denominator)
    }
}

impl CudaBackend {
    /// Adds each GPU sum into its (offset, length) of the host's `grad`.
    pub(super) fn add_sums_to_host(
        &self,
        grad: &mut [f32],
        sums: Vec<((usize, usize), CudaSlice<f32>)>,
    ) -> Result<(), EngineError> {
        let mut host = Vec::new();
        for ((offset, len), sum) in sums {
            host.resize(len, 0.0f32);
            self.download(&sum, &mut host)?;
            for (g, s) in grad[offset..offset + len].iter_mut().zip(&host) {
                *g += s;
            }
        }
        Ok(())
    }

    /// Runs `f` on the GPU accumulator of `grad`, a slice of the dense
    /// gradient registered by `grads_begin` (summed on the GPU until
    /// `grads_flush`), or, for any other slice, on a copy of it that is
    /// then downloaded back.
    pub(super) fn with_grad<R>(
        &self,
        grad: &mut [f32],
        f: impl FnOnce(&mut CudaSlice<f32>) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let mut grads = self.grads.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(acc) = grads.accumulator(grad, |len| self.zeros(len))? {
            return f(acc);
        }
        drop(grads);
        let mut dev = self.upload(grad)?;
        let result = f(&mut dev)?;
        self.download(&dev, grad)?;
        Ok(result)
    }

    /// `w` on the GPU: the cached upload when it is a slice of the dense
    /// params registered by `weights_changed`, else a fresh upload.
    pub(super) fn weight(&self, w: &[f32]) -> Result<std::sync::Arc<CudaSlice<f32>>, EngineError> {
        self.weights
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get_or_upload(w, |w| self.upload(w))
    }

    /// out (M, N) = x (M, K) · w (N, K)ᵀ for a dense weight `w` (a slice of
    /// the host's params, read from its upload), the inputs as `gemm` says.
    pub(super) fn dense_forward(
        &self,
        gemm: DenseGemm,
        out: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &[f32],
        s: Shape,
    ) -> Result<(), EngineError> {
        assert!(w.len() == s.n * s.k && x.len() == s.m * s.k && out.len() == s.m * s.n);
        let (w, x) = (self.gemm_weight(gemm, w)?, self.gemm_rows(gemm, x)?);
        let (w_ptr, _rw) = w.device_ptr(&self.stream);
        let (x_ptr, _rx) = x.device_ptr(&self.stream);
        let (out_ptr, _wo) = out.device_ptr_mut(&self.stream);
        // SAFETY: the weight holds N·K and the rows M·K values of `gemm`'s
        // type, out M·N f32 (asserted); each is borrowed, and its use
        // recorded by its guard, until the product is queued on this
        // stream, so a later write from any stream waits for it.
        unsafe { self.linear_forward_at(out_ptr, x_ptr, w_ptr, s, blas_type(gemm)) }
    }

    /// dx (M, K) += dout (M, N) · w; dw (N, K, in GPU memory) += doutᵀ · x,
    /// for a dense weight `w` as in [`Self::dense_forward`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dense_backward(
        &self,
        gemm: DenseGemm,
        dx: &mut CudaSlice<f32>,
        dw: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &[f32],
        s: Shape,
    ) -> Result<(), EngineError> {
        assert!(w.len() == s.n * s.k && dw.len() == s.n * s.k);
        assert!(x.len() == s.m * s.k && dx.len() == s.m * s.k && dout.len() == s.m * s.n);
        let w = self.gemm_weight(gemm, w)?;
        let (dout, x) = (self.gemm_rows(gemm, dout)?, self.gemm_rows(gemm, x)?);
        let (w_ptr, _rw) = w.device_ptr(&self.stream);
        let (dout_ptr, _rd) = dout.device_ptr(&self.stream);
        let (x_ptr, _rx) = x.device_ptr(&self.stream);
        let (dx_ptr, _wdx) = dx.device_ptr_mut(&self.stream);
        let (dw_ptr, _wdw) = dw.device_ptr_mut(&self.stream);
        // SAFETY: as in `dense_forward`; dx and dw hold M·K and N·K f32
        // (asserted), their writes recorded on this stream by the guards.
        unsafe {
            self.linear_backward_at(
                [dx_ptr, dw_ptr],
                [dout_ptr, x_ptr],
                w_ptr,
                s,
                blas_type(gemm),
            )
        }
    }

    /// Dense weight `w` as a GEMM taking `gemm` inputs reads it.
    pub(super) fn gemm_weight(
        &self,
        gemm: DenseGemm,
        w: &[f32],
    ) -> Result<GemmInput<'static>, EngineError> {
        Ok(match gemm {
            DenseGemm::F32 => GemmInput::HeldF32(self.weight(w)?),
            DenseGemm::Bf16 => GemmInput::HeldBf16(self.weight_bf16(w)?),
        })
    }

    /// Rows of activations or gradients as a GEMM taking `gemm` inputs
    /// reads them: as they are, or a bf16 copy.
    pub(super) fn gemm_rows<'a>(
        &self,
        gemm: DenseGemm,
        x: &'a CudaSlice<f32>,
    ) -> Result<GemmInput<'a>, EngineError> {
        Ok(match gemm {
            DenseGemm::F32 => GemmInput::F32(x),
            DenseGemm::Bf16 => GemmInput::Bf16(self.to_bf16(x)?),
        })
    }

    /// `w` in bf16 on the GPU: the copy kept beside its upload when it is a
    /// held slice of the params (made at its first bf16 GEMM since the
    /// weights last changed), else a copy for this call alone. Bound: one
    /// copy a held slice, 2 bytes a dense param at most.
    pub(super) fn weight_bf16(&self, w: &[f32]) -> Result<Arc<CudaSlice<u16>>, EngineError> {
        let held = || {
            self.weights
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .held_key(w)
        };
        let copies = || self.weights_bf16.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(copy) = held().and_then(|key| copies().get(&key).cloned()) {
            return Ok(copy);
        }
        let copy = Arc::new(self.to_bf16(&*self.weight(w)?)?);
        if let Some(key) = held() {
            copies().insert(key, Arc::clone(&copy));
        }
        Ok(copy)
    }

    /// The held weights changed: their bf16 copies go, remade at their next
    /// use (in stream order, after what changed them).
    pub(super) fn drop_bf16_weights(&self) {
        self.weights_bf16
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

/// bf16 copies of held dense weights, by their (offset, length) in the
/// params.
pub(super) type Bf16Copies = std::collections::HashMap<(usize, usize), Arc<CudaSlice<u16>>>;
