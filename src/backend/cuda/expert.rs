//! The expert FFN on the GPU (SwiGLU and GELU, forward and backward):
//! cuBLAS bf16 GEMMs with f32 accumulation and the activation kernels,
//! reading the expert's bf16 weights at a device address. Two callers:
//! the host-slice `CudaBackend::expert_ffn_forward` / `_backward` (params uploaded per call, what the tests
//! compare with the CPU math) and [`CudaExpertDevice`], the engine's device,
//! whose weights are already in a slot of its GPU device tier.
//!
//! Ordering, all on the device: before it reads a slot the compute stream
//! waits for the slot's last upload (`read_after_upload`), and after it has
//! queued its reads it marks the slot (`release_after`), so the next upload
//! into the slot waits for them. The host joins nothing per expert: the
//! calls on device rows return once their work is queued, and the engine
//! waits for the compute stream once a layer's pass
//! (`ExpertDevice::finish_pass`). (With staged uploads the engine also waits
//! for each upload's event on the host, see `orders_uploads`.) The calls on
//! host slices end by copying their results to host memory, which waits for
//! the compute stream.

use std::sync::Arc;

use cudarc::driver::{sys::CUdeviceptr, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use strata_tiers::device_cuda::{register_host, CudaDeviceArena, HostRegistration};
use strata_tiers::io::HostRegion;
use strata_tiers::{DeviceArena, Dtype, Layout};

use super::{gpu_error, CudaBackend, Shape};

/// The experts' GEMM inputs: bf16.
const BF16: cudarc::cublas::sys::cudaDataType = cudarc::cublas::sys::cudaDataType::CUDA_R_16BF;
use crate::backend::{DeviceGradient, DeviceRows, ExpertDevice, SlotParams};
use crate::math::{ExpertKind, ExpertSaved};
use crate::model::DenseKernels;
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
struct Weights {
    w1: CUdeviceptr,
    w3: CUdeviceptr,
    w2: CUdeviceptr,
}

impl Weights {
    /// The weights of a `kind` expert whose `count` bf16 params start at
    /// `base` (laid out as `math::ExpertKind` does).
    fn at(base: CUdeviceptr, count: usize, d: usize, f: usize) -> Self {
        let bf16 = |elements: usize| (2 * elements) as u64;
        Self {
            w1: base,
            w3: base + bf16(f * d),
            w2: base + bf16(count - d * f),
        }
    }
}

/// An expert's weight gradient in GPU memory, as its backward leaves it:
/// laid out as the params (w1, w3 for SwiGLU, w2).
struct ExpertGrad {
    grad: CudaSlice<f32>,
}

impl ExpertGrad {
    /// Copies the gradient into `dparams` in pageable host memory, on
    /// `stream`; returns once it is done.
    fn download(&self, stream: &Arc<CudaStream>, dparams: &mut [f32]) -> Result<(), EngineError> {
        assert_eq!(dparams.len(), self.grad.len());
        stream
            .memcpy_dtoh(&self.grad, dparams)
            .map_err(|e| gpu_error("an expert gradient's download", e))
    }
}

/// An expert's gradient left on the GPU by
/// [`CudaExpertDevice::expert_backward_rows`]: taken, it comes down on the
/// device's gradient stream, which waits for the backward that made it
/// and for nothing queued on the compute stream after it.
struct GradOnGpu {
    grad: ExpertGrad,
    /// Recorded on the compute stream behind the backward.
    ready: CudaEvent,
    stream: Arc<CudaStream>,
}

impl DeviceGradient for GradOnGpu {
    fn take(self: Box<Self>, dparams: &mut [f32]) -> Result<(), EngineError> {
        self.stream
            .wait(&self.ready)
            .map_err(|e| gpu_error("ordering a gradient's download after its backward", e))?;
        self.grad.download(&self.stream, dparams)
    }
}

impl CudaBackend {
    /// # Safety
    /// `w` addresses the expert's weights (see [`Weights`]), alive and
    /// unwritten until this call returns.
    #[allow(clippy::too_many_arguments)]
    unsafe fn ffn_forward(
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
    unsafe fn ffn_forward_rows(
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
    unsafe fn ffn_backward(
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
            grad.download(&self.stream, dparams)?;
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
    unsafe fn ffn_backward_rows(
        &self,
        kind: ExpertKind,
        [dx, dout, x]: [DeviceRows; 3],
        held: Option<&[f32]>,
        w: Weights,
        (n, d, f): (usize, usize, usize),
    ) -> Result<ExpertGrad, EngineError> {
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
        unsafe {
            self.linear_backward_into(&mut dhidden, part(in_len), &doutb, &hb, w.w2, down, BF16)?
        };
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
                    self.linear_backward_into(&mut ddx, part(0), &dab, &xb, w.w1, up, BF16)?;
                    self.linear_backward_into(&mut ddx, part(f * d), &dbb, &xb, w.w3, up, BF16)?;
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
                unsafe { self.linear_backward_into(&mut ddx, part(0), &dab, &xb, w.w1, up, BF16)? };
            }
        }
        // SAFETY: dx addresses n·d f32 (the contract), as ddx holds.
        unsafe { self.copy_to(dx.ptr, &ddx)? };
        drop(written); // the GEMMs' writes to `grad`, recorded
        Ok(ExpertGrad { grad })
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

/// Page-locked staging buffers (one expert each) per GPU when the host
/// tier's memory cannot be page-locked: one for the upload in flight, one
/// being filled for the next.
const STAGING_BUFFERS: usize = 2;

/// One GPU as the engine's device: its device tier ([`CudaDeviceArena`],
/// uploads on their own stream) and the expert FFN reading each expert's
/// params in place from its slot, on the compute stream.
pub struct CudaExpertDevice {
    /// Shared with the engine as this GPU's dense GEMMs.
    backend: Arc<CudaBackend>,
    arena: CudaDeviceArena,
    /// The experts' gradients come down on it, beside the compute stream.
    grad_stream: Arc<CudaStream>,
    /// The host tier's region, page-locked (see `page_lock_host_region`).
    host_region: Option<HostRegistration>,
}

impl CudaExpertDevice {
    /// Opens GPU `ordinal` with `device_budget_bytes` of it carved into
    /// expert slots for `layout`'s compute params (bf16, or f32 rounded to
    /// bf16 per call).
    pub fn new(
        ordinal: usize,
        device_budget_bytes: u64,
        layout: &Layout,
    ) -> Result<Self, EngineError> {
        crate::backend::BackendKind::Cuda.check(0, layout.compute_dtype)?;
        let backend = Arc::new(CudaBackend::new(ordinal)?);
        let arena = CudaDeviceArena::new(
            Arc::clone(backend.context()),
            device_budget_bytes,
            layout.compute_payload_bytes() as usize,
        )?;
        let grad_stream = backend
            .context()
            .new_stream()
            .map_err(|e| gpu_error("creating the gradient stream", e))?;
        Ok(Self {
            backend,
            arena,
            grad_stream,
            host_region: None,
        })
    }

    pub fn backend(&self) -> &CudaBackend {
        &self.backend
    }

    /// Runs `body` on the weights of the expert in `p`'s slot: in place
    /// when they are bf16, else through a bf16 copy made on the compute
    /// stream.
    fn with_weights(
        &self,
        p: SlotParams,
        d: usize,
        f: usize,
        body: impl FnOnce(Weights) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        self.backend.bind()?;
        let stream = &self.backend.stream;
        self.arena.read_after_upload(p.slot, stream)?;
        let slot = self.arena.slot_ptr(p.slot);
        match p.dtype {
            Dtype::Bf16 => body(Weights::at(slot, p.count, d, f))?,
            Dtype::F32 => {
                // SAFETY: the slot holds the expert's `count` f32 params
                // once its upload has landed, which the compute stream
                // waits for above; the next upload into it waits for the
                // compute stream's reads (`release_after` below).
                let wb = unsafe { self.backend.to_bf16_raw(slot, p.count)? };
                let (base, _read) = wb.device_ptr(stream);
                body(Weights::at(base, p.count, d, f))?
            }
            Dtype::F16 => unreachable!("refused when the device was opened"),
        }
        Ok(self.arena.release_after(p.slot, stream)?)
    }
}

impl ExpertDevice for CudaExpertDevice {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn arena(&self) -> &dyn DeviceArena {
        &self.arena
    }

    fn dense_kernels(&self) -> Arc<dyn DenseKernels + Send + Sync> {
        self.backend.clone()
    }

    fn page_lock_host_region(&mut self, region: &HostRegion) -> Option<String> {
        match register_host(self.backend.context(), region.lease()) {
            Ok(registration) => {
                self.host_region = Some(registration);
                None
            }
            Err(e) => Some(e.to_string()),
        }
    }

    fn stage_uploads(&mut self) -> Result<(), EngineError> {
        Ok(self.arena.stage_uploads(STAGING_BUFFERS)?)
    }

    fn backward_recomputes(&self) -> bool {
        true // `up_and_hidden`: the forward keeps nothing in `saved`
    }

    fn orders_uploads(&self) -> bool {
        self.arena.orders_uploads_on_device()
    }

    fn finish_pass(&mut self) -> Result<(), EngineError> {
        self.backend.bind()?;
        self.backend
            .stream
            .synchronize()
            .map_err(|e| gpu_error("the compute stream", e))
    }

    fn expert_forward(
        &mut self,
        kind: ExpertKind,
        out: &mut [f32],
        saved: &mut ExpertSaved<f32>,
        x: &[f32],
        params: SlotParams,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        assert_eq!(params.count, kind.params(d, f));
        let backend = &self.backend;
        self.with_weights(params, d, f, |w| {
            // SAFETY: `w` addresses the slot's expert (or its bf16 copy),
            // which stays unwritten until this call returns.
            unsafe { backend.ffn_forward(kind, out, saved, x, w, n, d, f) }
        })
    }

    fn takes_device_rows(&self) -> bool {
        true
    }

    unsafe fn expert_forward_rows(
        &mut self,
        kind: ExpertKind,
        out: DeviceRows,
        x: DeviceRows,
        params: SlotParams,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        assert_eq!(params.count, kind.params(d, f));
        let backend = &self.backend;
        self.with_weights(params, d, f, |w| {
            // SAFETY: `w` as in `expert_forward`; the rows per this
            // function's contract (this GPU's memory: the network's
            // `CudaOps` on the same backend made them).
            unsafe { backend.ffn_forward_rows(kind, (out, x), w, n, d, f) }
        })
    }

    unsafe fn expert_backward_rows(
        &mut self,
        kind: ExpertKind,
        dx: DeviceRows,
        dout: DeviceRows,
        x: DeviceRows,
        params: SlotParams,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<Box<dyn DeviceGradient>, EngineError> {
        assert_eq!(params.count, kind.params(d, f));
        let backend = &self.backend;
        let mut grad = None;
        self.with_weights(params, d, f, |w| {
            let rows = [dx, dout, x];
            // SAFETY: as in `expert_forward_rows`; the gradient starts
            // from zero.
            grad = Some(unsafe { backend.ffn_backward_rows(kind, rows, None, w, (n, d, f))? });
            Ok(())
        })?;
        let ready = backend
            .stream
            .record_event(None)
            .map_err(|e| gpu_error("recording an expert's backward", e))?;
        Ok(Box::new(GradOnGpu {
            grad: grad.expect("the backward ran"),
            ready,
            stream: Arc::clone(&self.grad_stream),
        }))
    }

    fn expert_backward(
        &mut self,
        kind: ExpertKind,
        dx: &mut [f32],
        dparams: &mut [f32],
        dout: &[f32],
        _saved: &ExpertSaved<f32>, // empty: the forward keeps nothing
        x: &[f32],
        params: SlotParams,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        assert_eq!(params.count, kind.params(d, f));
        assert_eq!(dparams.len(), params.count);
        let backend = &self.backend;
        self.with_weights(params, d, f, |w| {
            // SAFETY: as in the forward. `dparams` is overwritten (the
            // contract): the gradient starts from zero on the GPU and
            // every part of it is downloaded over what `dparams` held.
            unsafe { backend.ffn_backward(kind, dx, dparams, dout, x, w, n, d, f, GradStart::Zero) }
        })
    }
}
