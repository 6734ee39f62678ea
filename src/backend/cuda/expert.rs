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

use super::{gpu_error, CudaBackend, Shape, BF16};

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
    w1: CUdeviceptr,
    w3: CUdeviceptr,
    w2: CUdeviceptr,
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
        assert!(out.len == n * d && x.len == n * d);
        // SAFETY: x addresses n·d f32 (the contract, asserted).
        let xb = unsafe { self.to_bf16_raw(x.ptr, n * d)? };
        // SAFETY: the weights per this function's contract.
        let (_, _, h) = unsafe { self.up_and_hidden(kind, &xb, w, n, d, f)? };
        let hb = self.to_bf16(&h)?;
        let (hb_ptr, _rh) = hb.device_ptr(&self.stream);
        // SAFETY: w2 per the contract; `out` holds n·d f32 and hb n·f bf16.
        unsafe { self.linear_forward_at(out.ptr, hb_ptr, w.w2, Shape { m: n, k: f, n: d }, BF16) }
    }

    /// The up projections a = x·w1ᵀ (and b = x·w3ᵀ for SwiGLU) and the
    /// hidden activation h: the forward's first half, which the backward
    /// recomputes from x (the same GEMMs, so the same bits) rather than
    /// have a and b come down after the forward and go back up for it.
    ///
    /// # Safety
    /// As [`Self::ffn_forward`].
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    unsafe fn up_and_hidden(
        &self,
        kind: ExpertKind,
        xb: &CudaSlice<u16>,
        w: Weights,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(CudaSlice<f32>, Option<CudaSlice<f32>>, CudaSlice<f32>), EngineError> {
        let up = Shape { m: n, k: d, n: f };
        let mut a = self.zeros(n * f)?;
        let mut h = self.zeros(n * f)?;
        // SAFETY: w1 (and w3) per the contract; a, b and xb sized from n, d, f.
        unsafe { self.linear_forward(&mut a, xb, w.w1, up, BF16)? };
        let b = match kind {
            ExpertKind::SwiGlu => {
                let mut b = self.zeros(n * f)?;
                // SAFETY: as above.
                unsafe { self.linear_forward(&mut b, xb, w.w3, up, BF16)? };
                self.elementwise(
                    &self.f.swiglu_forward,
                    "swiglu_forward",
                    &[&a, &b],
                    &mut [&mut h],
                )?;
                Some(b)
            }
            ExpertKind::Gelu => {
                self.elementwise(&self.f.gelu_forward, "gelu_forward", &[&a], &mut [&mut h])?;
                None
            }
        };
        Ok((a, b, h))
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
        [dx, dout, x]: [DeviceRows; 3],
        held: Option<&[f32]>,
        w: Weights,
        (n, d, f): (usize, usize, usize),
    ) -> Result<CudaSlice<f32>, EngineError> {
        assert!(dx.len == n * d && dout.len == n * d && x.len == n * d);
        // SAFETY: x and dout address n·d f32 (the contract, asserted).
        let (xb, doutb) = unsafe {
            (
                self.to_bf16_raw(x.ptr, n * d)?,
                self.to_bf16_raw(dout.ptr, n * d)?,
            )
        };
        // SAFETY: the weights per this function's contract.
        let (a, b, h) = unsafe { self.up_and_hidden(kind, &xb, w, n, d, f)? };
        let mut ddx = self.zeros(n * d)?; // dx is overwritten, as on the cpu
        let count = kind.params(d, f);
        let in_len = count - d * f;
        let mut dhidden = self.zeros(n * f)?;
        // The weights' gradients accumulate in one buffer laid out as the
        // params (w1, w3, w2), from zero or from what `held` holds, so that
        // it comes down in one copy.
        let mut grad = match held {
            None => self.zeros(count)?,
            Some(host) => self.upload(&host[..count])?,
        };
        let (g, written) = grad.device_ptr_mut(&self.stream);
        let part = |at: usize| g + (at * std::mem::size_of::<f32>()) as u64;
        let hb = self.to_bf16(&h)?;
        let down = Shape { m: n, k: f, n: d };
        // SAFETY: the weights per this function's contract; w2's gradient
        // is the last D·F of `grad`; every other operand is allocated here
        // from n, d, f.
        unsafe { self.linear_backward(&mut dhidden, part(in_len), &doutb, &hb, w.w2, down, BF16)? };
        let mut da = self.zeros(n * f)?;
        let up = Shape { m: n, k: d, n: f };
        match (kind, b) {
            (ExpertKind::SwiGlu, Some(b)) => {
                let mut db = self.zeros(n * f)?;
                self.elementwise(
                    &self.f.swiglu_backward,
                    "swiglu_backward",
                    &[&a, &b, &dhidden],
                    &mut [&mut da, &mut db],
                )?;
                let (dab, dbb) = (self.to_bf16(&da)?, self.to_bf16(&db)?);
                // SAFETY: w1 and w3 per the contract, their gradients the
                // first two F·D of `grad`; the rest sized here.
                unsafe {
                    self.linear_backward(&mut ddx, part(0), &dab, &xb, w.w1, up, BF16)?;
                    self.linear_backward(&mut ddx, part(f * d), &dbb, &xb, w.w3, up, BF16)?;
                }
            }
            _ => {
                self.elementwise(
                    &self.f.gelu_backward,
                    "gelu_backward",
                    &[&a, &dhidden],
                    &mut [&mut da],
                )?;
                let dab = self.to_bf16(&da)?;
                // SAFETY: w1 per the contract, its gradient the first F·D
                // of `grad`; the rest sized here.
                unsafe { self.linear_backward(&mut ddx, part(0), &dab, &xb, w.w1, up, BF16)? };
            }
        }
        // SAFETY: dx addresses n·d f32 (the contract), as ddx holds.
        unsafe { self.copy_to(dx.ptr, &ddx)? };
        drop(written); // the GEMMs' writes to `grad`, recorded
        Ok(grad)
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
