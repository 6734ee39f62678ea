//! One GPU as the engine's device ([`CudaExpertDevice`]): its tier of
//! expert slots and the expert FFN (`expert.rs`) computed from them.
//!
//! Ordering, all on the device: before it reads a slot the compute stream
//! waits for the slot's last upload (`read_after_upload`), and after it has
//! queued its reads it marks the slot (`release_after`), so the next upload
//! into the slot waits for them. The host joins nothing per expert: the
//! calls on device rows return once their work is queued, and the engine
//! waits for the compute stream once a layer's pass
//! (`ExpertDevice::finish_pass`). (With staged uploads the engine also waits
//! for each upload's event on the host, see `orders_uploads`.) An expert's
//! gradient stays on the GPU ([`GradOnGpu`]) until the engine takes it,
//! once the next expert's backward is queued: into a page-locked buffer,
//! waited for by its update (`grad_download.rs`), or into host memory of
//! the engine's, waited for at once.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};
use strata_tiers::device_cuda::{register_host, CudaDeviceArena, HostRegistration};
use strata_tiers::io::HostRegion;
use strata_tiers::{DeviceArena, Dtype, Layout};

use super::expert::{download_expert_grad, GradStart, Weights};
use super::expert_group::{grouped_gemm_available, Member, GROUP_LIMIT};
use super::grad_download::{start_download, GradientBuffers};
use super::{gpu_error, CudaBackend};
use crate::backend::expert_device::{backward_each, forward_each};
use crate::backend::{
    gpu_expert_group, DenseGemm, DeviceGradient, DeviceRows, Download, ExpertBackwardRows,
    ExpertDevice, ExpertForwardRows, SlotParams,
};
use crate::math::{ExpertKind, ExpertSaved};
use crate::model::DenseKernels;
use crate::EngineError;

/// An expert's gradient left on the GPU by
/// [`CudaExpertDevice::expert_backward_rows`]: taken, it comes down on the
/// device's gradient stream, which waits for the backward that made it
/// and for nothing queued on the compute stream after it.
struct GradOnGpu {
    /// Laid out as the expert's params.
    grad: CudaSlice<f32>,
    /// Recorded on the compute stream behind the backward.
    ready: CudaEvent,
    stream: Arc<CudaStream>,
    /// The GPU's page-locked buffers for `start_download`.
    buffers: Arc<GradientBuffers>,
}

impl GradOnGpu {
    fn order_after_backward(&self) -> Result<(), EngineError> {
        self.stream
            .wait(&self.ready)
            .map_err(|e| gpu_error("ordering a gradient's download after its backward", e))
    }
}

impl DeviceGradient for GradOnGpu {
    fn take(self: Box<Self>, dparams: &mut [f32]) -> Result<(), EngineError> {
        self.order_after_backward()?;
        download_expert_grad(&self.stream, &self.grad, dparams)
    }

    fn start_download(self: Box<Self>) -> Result<Download, EngineError> {
        self.order_after_backward()?;
        let Self {
            grad,
            ready,
            stream,
            buffers,
        } = *self;
        start_download(&buffers, &stream, grad, |grad| {
            Download::NoBuffer(Box::new(GradOnGpu {
                grad,
                ready,
                stream: Arc::clone(&stream),
                buffers: Arc::clone(&buffers),
            }))
        })
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
    /// Where the experts' gradients come down to (`grad_download.rs`).
    grad_buffers: Arc<GradientBuffers>,
    /// The most experts computed at once ([`ExpertDevice::group_limit`]).
    group_limit: usize,
}

impl CudaExpertDevice {
    /// Opens GPU `ordinal` with `device_budget_bytes` of it carved into
    /// expert slots for `layout`'s compute params (bf16, or f32 rounded to
    /// bf16 per call), its dense GEMMs taking `dense` inputs.
    pub fn new(
        ordinal: usize,
        device_budget_bytes: u64,
        layout: &Layout,
        dense: DenseGemm,
    ) -> Result<Self, EngineError> {
        crate::backend::BackendKind::Cuda.check(0..0, layout.compute_dtype)?;
        let backend = Arc::new(CudaBackend::new(ordinal, dense)?);
        let arena = CudaDeviceArena::new(
            Arc::clone(backend.context()),
            device_budget_bytes,
            layout.compute_payload_bytes() as usize,
        )?;
        let grad_stream = backend
            .context()
            .new_stream()
            .map_err(|e| gpu_error("creating the gradient stream", e))?;
        let grad_buffers = GradientBuffers::new(Arc::clone(backend.context()));
        // A cuBLAS without the grouped GEMM computes one expert at a time.
        let group_limit = match grouped_gemm_available() {
            true => gpu_expert_group(layout.params_per_expert).min(GROUP_LIMIT),
            false => 1,
        };
        Ok(Self {
            backend,
            arena,
            grad_stream,
            host_region: None,
            grad_buffers,
            group_limit,
        })
    }

    pub fn backend(&self) -> &CudaBackend {
        &self.backend
    }

    /// Runs `body` on the weights of the experts in `params`' slots: in
    /// place when they are bf16, else through bf16 copies made on the
    /// compute stream.
    fn with_weights<R>(
        &self,
        params: &[SlotParams],
        d: usize,
        f: usize,
        body: impl FnOnce(&[Weights]) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        self.backend.bind()?;
        let stream = &self.backend.stream;
        let mut copies = Vec::with_capacity(params.len());
        for p in params {
            self.arena.read_after_upload(p.slot, stream)?;
            copies.push(match p.dtype {
                Dtype::Bf16 => None,
                // SAFETY: the slot holds the expert's `count` f32 params
                // once its upload has landed, which the compute stream
                // waits for above; the next upload into it waits for the
                // compute stream's reads (`release_after` below).
                Dtype::F32 => Some(unsafe {
                    self.backend
                        .to_bf16_raw(self.arena.slot_ptr(p.slot), p.count)?
                }),
                Dtype::F16 => unreachable!("refused when the device was opened"),
            });
        }
        let mut reads = Vec::new();
        let mut weights = Vec::with_capacity(params.len());
        for (p, copy) in params.iter().zip(&copies) {
            let base = match copy {
                None => self.arena.slot_ptr(p.slot),
                Some(wb) => {
                    let (base, read) = wb.device_ptr(stream);
                    reads.push(read);
                    base
                }
            };
            weights.push(Weights::at(base, p.count, d, f));
        }
        let out = body(&weights)?;
        drop(reads);
        for p in params {
            self.arena.release_after(p.slot, stream)?;
        }
        Ok(out)
    }

    /// Each of `grads` (a group's backward's, just queued) as a gradient
    /// the engine takes later, each waited for by an event behind it.
    fn left_on_gpu(
        &self,
        grads: Vec<CudaSlice<f32>>,
    ) -> Result<Vec<Box<dyn DeviceGradient>>, EngineError> {
        grads
            .into_iter()
            .map(|grad| {
                let ready = self
                    .backend
                    .stream
                    .record_event(None)
                    .map_err(|e| gpu_error("recording an expert's backward", e))?;
                Ok(Box::new(GradOnGpu {
                    grad,
                    ready,
                    stream: Arc::clone(&self.grad_stream),
                    buffers: Arc::clone(&self.grad_buffers),
                }) as Box<dyn DeviceGradient>)
            })
            .collect()
    }
}

/// Each weight of `ws` with its expert's count of `rows`.
fn members(ws: &[Weights], rows: impl Iterator<Item = usize>) -> Vec<Member> {
    ws.iter()
        .zip(rows)
        .map(|(&w, rows)| Member { w, rows })
        .collect()
}

/// Where a group's rows in each of K buffers lie back to back, expert
/// after expert in one order in every buffer (a layer's permuted rows,
/// walked forwards or backwards): that order (indices into `rows`, by
/// address) and each buffer's rows of the whole group.
fn back_to_back<const K: usize>(rows: &[[DeviceRows; K]]) -> Option<(Vec<usize>, [DeviceRows; K])> {
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&i| rows[i][0].ptr);
    let first = rows.get(*order.first()?)?;
    let whole: [DeviceRows; K] = std::array::from_fn(|b| {
        let len = order.iter().map(|&i| rows[i][b].len).sum();
        DeviceRows::new(first[b].ptr, len)
    });
    let mut at = [0u64; K];
    for &i in &order {
        for b in 0..K {
            if rows[i][b].ptr != whole[b].ptr + at[b] {
                return None;
            }
            at[b] += (rows[i][b].len * std::mem::size_of::<f32>()) as u64;
        }
    }
    Some((order, whole))
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
        self.with_weights(&[params], d, f, |w| {
            // SAFETY: `w` addresses the slot's expert (or its bf16 copy),
            // which stays unwritten until this call returns.
            unsafe { backend.ffn_forward(kind, out, saved, x, w[0], n, d, f) }
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
        self.with_weights(&[params], d, f, |w| {
            // SAFETY: `w` as in `expert_forward`; the rows per this
            // function's contract (this GPU's memory: the network's
            // `CudaOps` on the same backend made them).
            unsafe { backend.ffn_forward_rows(kind, (out, x), w[0], n, d, f) }
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
        let grad = self.with_weights(&[params], d, f, |w| {
            let rows = [dx, dout, x];
            // SAFETY: as in `expert_forward_rows`; the gradient starts
            // from zero.
            unsafe { backend.ffn_backward_rows(kind, rows, None, w[0], (n, d, f)) }
        })?;
        let mut grads = self.left_on_gpu(vec![grad])?;
        Ok(grads.pop().expect("one gradient"))
    }

    fn group_limit(&self) -> usize {
        self.group_limit
    }

    unsafe fn experts_forward_rows(
        &mut self,
        kind: ExpertKind,
        group: &[ExpertForwardRows],
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        let rows: Vec<[DeviceRows; 2]> = group.iter().map(|e| [e.x, e.out]).collect();
        let Some((order, [x, out])) = back_to_back(&rows).filter(|_| group.len() > 1) else {
            // SAFETY: this function's contract.
            return unsafe { forward_each(self, kind, group, (d, f)) };
        };
        let params: Vec<SlotParams> = order.iter().map(|&i| group[i].params).collect();
        let backend = &self.backend;
        self.with_weights(&params, d, f, |ws| {
            let members = members(ws, order.iter().map(|&i| group[i].x.len / d));
            // SAFETY: each `ws` addresses its slot's expert (or its bf16
            // copy), unwritten until this call returns; the group's rows
            // lie back to back in this GPU's memory (this function's
            // contract), in the members' order.
            unsafe { backend.ffn_forward_group(kind, (out, x), &members, (d, f)) }
        })
    }

    unsafe fn experts_backward_rows(
        &mut self,
        kind: ExpertKind,
        group: &[ExpertBackwardRows],
        d: usize,
        f: usize,
    ) -> Result<Vec<Box<dyn DeviceGradient>>, EngineError> {
        let rows: Vec<[DeviceRows; 3]> = group.iter().map(|e| [e.x, e.dout, e.dx]).collect();
        let Some((order, [x, dout, dx])) = back_to_back(&rows).filter(|_| group.len() > 1) else {
            // SAFETY: this function's contract.
            return unsafe { backward_each(self, kind, group, (d, f)) };
        };
        let params: Vec<SlotParams> = order.iter().map(|&i| group[i].params).collect();
        let backend = &self.backend;
        let grads = self.with_weights(&params, d, f, |ws| {
            let members = members(ws, order.iter().map(|&i| group[i].x.len / d));
            // SAFETY: as in the forward; the gradients start from zero.
            unsafe { backend.ffn_backward_group(kind, [dx, dout, x], None, &members, (d, f)) }
        })?;
        // Back in the group's order.
        let mut in_order: Vec<Option<CudaSlice<f32>>> = (0..group.len()).map(|_| None).collect();
        for (&i, grad) in order.iter().zip(grads) {
            in_order[i] = Some(grad);
        }
        self.left_on_gpu(
            in_order
                .into_iter()
                .map(|g| g.expect("every expert's"))
                .collect(),
        )
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
        self.with_weights(&[params], d, f, |w| {
            // SAFETY: as in the forward. `dparams` is overwritten (the
            // contract): the gradient starts from zero on the GPU and
            // every part of it is downloaded over what `dparams` held.
            unsafe {
                backend.ffn_backward(kind, dx, dparams, dout, x, w[0], n, d, f, GradStart::Zero)
            }
        })
    }
}
