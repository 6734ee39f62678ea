//! The expert FFN on the GPU (SwiGLU and GELU, forward and backward):
//! cuBLAS bf16 GEMMs with f32 accumulation and the activation kernels,
//! reading the expert's bf16 weights at a device address. Two callers:
//! the host-slice `CudaBackend::expert_ffn_forward` / `_backward` (params
//! uploaded per call, what the tests compare with the CPU math) and
//! [`CudaExpertDevice`](super::CudaExpertDevice) (`expert_device.rs`), the
//! engine's device, whose weights are already in a slot of its GPU device
//! tier. The calls on device rows only queue their work on the compute
//! stream; the calls on host slices end by copying their results to host
//! memory, which waits for it.

use std::sync::Arc;

use cudarc::driver::{sys::CUdeviceptr, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::expert_group::Member;
use super::{gpu_error, CudaBackend};

/// The experts' GEMM inputs: bf16.
use crate::backend::DeviceRows;
use crate::math::{ExpertKind, ExpertSaved};
use crate::EngineError;

/// Where an expert's weight gradients start on the GPU.
#[derive(Clone, Copy)]
pub(super) enum GradStart {
    /// From zero (the engine's gradient, which overwrites what its host
    /// buffer held): nothing to upload.
    Zero,
    /// From what the host buffer held (`Backend`'s `+=` contract).
    Held,
}

/// Device addresses of an expert's bf16 weights: w1 (F, D), w3 (F, D;
/// SwiGLU only), w2 (D, F).
#[derive(Clone, Copy)]
pub(super) struct Weights {
    pub w1: CUdeviceptr,
    pub w3: CUdeviceptr,
    pub w2: CUdeviceptr,
}

impl Weights {
    /// The weights of a `kind` expert whose `count` bf16 params start at
    /// `base` (laid out as `math::ExpertKind` does).
    pub(super) fn at(base: CUdeviceptr, count: usize, d: usize, f: usize) -> Self {
        let bf16 = |elements: usize| (2 * elements) as u64;
        Self {
            w1: base,
            w3: base + bf16(f * d),
            w2: base + bf16(count - d * f),
        }
    }
}

/// Copies an expert's weight gradient `grad` (laid out as its params: w1,
/// w3 for SwiGLU, w2) into `dparams` in pageable host memory, on `stream`;
/// returns once it is done.
pub(super) fn download_expert_grad(
    stream: &Arc<CudaStream>,
    grad: &CudaSlice<f32>,
    dparams: &mut [f32],
) -> Result<(), EngineError> {
    assert_eq!(dparams.len(), grad.len());
    stream
        .memcpy_dtoh(grad, dparams)
        .map_err(|e| gpu_error("an expert gradient's download", e))
}

impl CudaBackend {
    /// # Safety
    /// `w` addresses the expert's weights (see [`Weights`]), alive and
    /// unwritten until this call returns.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn ffn_forward(
        &self,
        kind: ExpertKind,
        out: &mut [f32],
        saved: &mut ExpertSaved<f32>,
        x: &[f32],
        w: Weights,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        let xd = self.upload(x)?;
        let mut y = self.zeros(n * d)?;
        {
            let (x_ptr, _rx) = xd.device_ptr(&self.stream);
            let (y_ptr, _wy) = y.device_ptr_mut(&self.stream);
            let rows = (DeviceRows::new(y_ptr, n * d), DeviceRows::new(x_ptr, n * d));
            // SAFETY: y and x hold n·d f32, alive past the call; the
            // weights per this function's contract.
            unsafe { self.ffn_forward_rows(kind, rows, w, n, d, f)? };
        }
        // The backward recomputes the pre-activations from x (two GEMMs,
        // the same bits) rather than have them come down here and go back
        // up there: 2·n·F f32 each way.
        saved.a.clear();
        saved.b.clear();
        self.download(&y, out)
    }

    /// out (n, D) = expert(x (n, D)), both in GPU memory: `(out, x)`,
    /// queued on the compute stream (the call returns without waiting for
    /// it).
    ///
    /// # Safety
    /// `w` addresses the expert's weights, unwritten until the compute
    /// stream has run what this call queues; `out` and `x` address n·D f32
    /// of this context's memory each, alive until then, `x` not written by
    /// another stream meanwhile.
    pub(super) unsafe fn ffn_forward_rows(
        &self,
        kind: ExpertKind,
        (out, x): (DeviceRows, DeviceRows),
        w: Weights,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        let one = [Member { w, rows: n }];
        // SAFETY: this function's contract, for a group of one.
        unsafe { self.ffn_forward_group(kind, (out, x), &one, (d, f)) }
    }

    /// # Safety
    /// As [`Self::ffn_forward`].
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn ffn_backward(
        &self,
        kind: ExpertKind,
        dx: &mut [f32],
        dparams: &mut [f32],
        dout: &[f32],
        x: &[f32],
        w: Weights,
        n: usize,
        d: usize,
        f: usize,
        grad_from: GradStart,
    ) -> Result<(), EngineError> {
        let (xd, doutd) = (self.upload(x)?, self.upload(dout)?);
        let mut ddx = self.zeros(n * d)?;
        {
            let (x_ptr, _rx) = xd.device_ptr(&self.stream);
            let (dout_ptr, _rd) = doutd.device_ptr(&self.stream);
            let (dx_ptr, _wdx) = ddx.device_ptr_mut(&self.stream);
            let rows = [dx_ptr, dout_ptr, x_ptr].map(|p| DeviceRows::new(p, n * d));
            let held = match grad_from {
                GradStart::Zero => None,
                GradStart::Held => Some(&*dparams),
            };
            // SAFETY: the three hold n·d f32 and live past the call; the
            // weights per this function's contract.
            let grad = unsafe { self.ffn_backward_rows(kind, rows, held, w, (n, d, f))? };
            download_expert_grad(&self.stream, &grad, dparams)?;
        }
        self.download(&ddx, dx)
    }

    /// The backward in GPU memory, `[dx, dout, x]` each (n, D), queued on
    /// the compute stream: dx overwritten, and the expert's gradient left
    /// in GPU memory, summed from zero or from `held` (the expert's params'
    /// count of f32 in host memory).
    ///
    /// # Safety
    /// As [`Self::ffn_forward_rows`], for the three rows.
    pub(super) unsafe fn ffn_backward_rows(
        &self,
        kind: ExpertKind,
        rows: [DeviceRows; 3],
        held: Option<&[f32]>,
        w: Weights,
        (n, d, f): (usize, usize, usize),
    ) -> Result<CudaSlice<f32>, EngineError> {
        let one = [Member { w, rows: n }];
        // SAFETY: this function's contract, for a group of one.
        let mut grads = unsafe { self.ffn_backward_group(kind, rows, held, &one, (d, f))? };
        Ok(grads.pop().expect("one expert's gradient"))
    }

    /// The params uploaded and rounded to bf16 (the host-slice path).
    fn upload_params(&self, params: &[f32]) -> Result<CudaSlice<u16>, EngineError> {
        self.to_bf16(&self.upload(params)?)
    }
}

/// The expert FFN on host slices (params and activations in host memory),
/// which the tests hold to the plain math.
impl CudaBackend {
    pub fn name(&self) -> &'static str {
        "cuda"
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
        assert_eq!(params.len(), kind.params(d, f));
        let wb = self.upload_params(params)?;
        let (base, _read) = wb.device_ptr(&self.stream);
        let w = Weights::at(base, params.len(), d, f);
        // SAFETY: `wb` holds the params and lives past the call, which
        // waits for the compute stream before returning.
        unsafe { self.ffn_forward(kind, out, saved, x, w, n, d, f) }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn expert_ffn_backward(
        &self,
        kind: ExpertKind,
        dx: &mut [f32],
        dparams: &mut [f32],
        dout: &[f32],
        _saved: &ExpertSaved<f32>, // empty: the forward keeps nothing
        x: &[f32],
        params: &[f32],
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        assert_eq!(params.len(), kind.params(d, f));
        assert_eq!(dparams.len(), params.len());
        let wb = self.upload_params(params)?;
        let (base, _read) = wb.device_ptr(&self.stream);
        let w = Weights::at(base, params.len(), d, f);
        // SAFETY: as in the forward.
        unsafe { self.ffn_backward(kind, dx, dparams, dout, x, w, n, d, f, GradStart::Held) }
    }
}
