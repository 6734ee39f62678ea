//! [`CudaOps`]: the dense layers' operations ([`DenseOps`]) on activations
//! in GPU memory. An activation is made, read and written on the device;
//! only what the network hands to the host (the FFN half's input and
//! output, which the host's router and experts read, and the gradients
//! between them) crosses PCIe, each copy counted in `pcie_other`.
//!
//! Each operation is queued on the backend's compute stream, so they run
//! in the order the network calls them; a download waits for what came
//! before it.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, LaunchArgs, PushKernelArg};

use super::attention::{attention_stats_len, ATTENTION_BLOCK_BYTES};
use super::dense::{threads, RowSum};
use super::gpu_spans::{GpuSpan, GpuSpans};
use super::moe::CudaMoeSaved;
use super::token_ids::DeviceIds;
use super::uploads::AuxGrad;
use super::{gpu_error, CudaBackend, Shape};
use crate::math::attention::{AttnShape, RopeTable};
use crate::model::{DenseKernels, DenseOps, ExpertRunner, HeadShape, ModelConfig};
use crate::model::{TokenIds, TokenRows};
use crate::EngineError;

/// The dense layers' operations on one GPU, for one forward and backward.
pub struct CudaOps<'a> {
    pub(super) gpu: &'a CudaBackend,
    kernels: &'a dyn DenseKernels,
    /// Each operation's GPU time, where the kernels record a timeline.
    spans: Option<GpuSpans>,
    /// The load-balancing loss's gradient of the probabilities last
    /// uploaded, with its host values: the loss over every layer gives
    /// each layer the same, which then goes up once a step.
    pub(super) aux_grad: Mutex<Option<AuxGrad>>,
}

impl<'a> CudaOps<'a> {
    /// The operations of `gpu`, with `kernels` (the engine's, which may
    /// record a timeline) for the host's spans and what stays on the host.
    pub fn new(gpu: &'a CudaBackend, kernels: &'a dyn DenseKernels) -> Result<Self, EngineError> {
        gpu.bind()?;
        let spans = match kernels.timeline() {
            Some(t) => Some(GpuSpans::new(&gpu.stream, Arc::clone(t))?),
            None => None,
        };
        Ok(Self {
            gpu,
            kernels,
            spans,
            aux_grad: Mutex::new(None),
        })
    }

    /// The GPU's time for the work queued until the span is dropped, on
    /// the timeline where one records.
    pub(super) fn span(&self, name: &'static str) -> Option<GpuSpan<'_>> {
        self.spans.as_ref().map(|s| s.start(name))
    }

    /// The GPU these operations run on.
    pub(super) fn gpu(&self) -> &CudaBackend {
        self.gpu
    }

    /// Launches `launch` (kernel `name`), one thread for each of `n`
    /// values.
    ///
    /// # Safety
    /// The arguments pushed on `launch` are buffers holding at least the
    /// values the kernel indexes with `n` threads.
    unsafe fn run(
        &self,
        mut launch: LaunchArgs<'_>,
        name: &str,
        n: usize,
    ) -> Result<(), EngineError> {
        // SAFETY: the caller's contract.
        unsafe { launch.launch(threads(n)) }
            .map(|_| ())
            .map_err(|e| gpu_error(name, e))
    }
}

impl DenseOps for CudaOps<'_> {
    type Buf = CudaSlice<f32>;

    fn kernels(&self) -> &dyn DenseKernels {
        self.kernels
    }

    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, EngineError> {
        self.gpu.zeros(n)
    }

    fn len(&self, x: &CudaSlice<f32>) -> usize {
        x.len()
    }

    fn duplicate(&self, x: &CudaSlice<f32>) -> Result<CudaSlice<f32>, EngineError> {
        let _gpu = self.span("copy");
        self.gpu
            .stream
            .clone_dtod(x)
            .map_err(|e| gpu_error("a copy in GPU memory", e))
    }

    fn place(&self, x: Vec<f32>) -> Result<CudaSlice<f32>, EngineError> {
        self.gpu.upload(&x)
    }

    fn read<'b>(&self, x: &'b CudaSlice<f32>) -> Result<Cow<'b, [f32]>, EngineError> {
        let mut host = vec![0.0f32; x.len()];
        self.gpu.download(x, &mut host)?;
        Ok(Cow::Owned(host))
    }

    fn take(&self, x: CudaSlice<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(self.read(&x)?.into_owned())
    }

    fn add_assign(&self, acc: &mut CudaSlice<f32>, x: &CudaSlice<f32>) -> Result<(), EngineError> {
        let _gpu = self.span("add");
        self.gpu.add_into(acc, x)
    }

    fn add_bias(&self, x: &mut CudaSlice<f32>, b: &[f32]) -> Result<(), EngineError> {
        let _gpu = self.span("bias");
        assert!(x.len().is_multiple_of(b.len()));
        let b = self.gpu.weight(b)?;
        let (n, width) = (x.len() as u32, b.len() as u32);
        let mut launch = self.gpu.stream.launch_builder(&self.gpu.dense.add_bias);
        launch.arg(x).arg(b.as_ref()).arg(&n).arg(&width);
        // SAFETY: x holds n f32 and b width, a divisor of n (asserted).
        unsafe { self.run(launch, "add_bias", n as usize) }
    }

    fn bias_grad(&self, db: &mut [f32], dx: &CudaSlice<f32>) -> Result<(), EngineError> {
        let _gpu = self.span("bias backward");
        assert!(dx.len().is_multiple_of(db.len()));
        let (rows, width) = (dx.len() / db.len(), db.len());
        self.gpu.with_grad(db, |acc| {
            self.gpu.column_sums_into(acc, dx, None, (rows, width))
        })
    }

    fn clamp(&self, x: &mut CudaSlice<f32>, clip: f32) -> Result<(), EngineError> {
        let _gpu = self.span("clamp");
        let n = x.len() as u32;
        let mut launch = self.gpu.stream.launch_builder(&self.gpu.dense.clamp_values);
        launch.arg(x).arg(&n).arg(&clip);
        // SAFETY: x holds n f32.
        unsafe { self.run(launch, "clamp_values", n as usize) }
    }

    fn clamp_grad(
        &self,
        grad: &mut CudaSlice<f32>,
        before: &CudaSlice<f32>,
        clip: f32,
    ) -> Result<(), EngineError> {
        let _gpu = self.span("clamp backward");
        assert_eq!(grad.len(), before.len());
        let n = grad.len() as u32;
        let mut launch = self.gpu.stream.launch_builder(&self.gpu.dense.clamp_grad);
        launch.arg(grad).arg(before).arg(&n).arg(&clip);
        // SAFETY: grad and before hold n f32 (asserted).
        unsafe { self.run(launch, "clamp_grad", n as usize) }
    }

    fn swiglu(
        &self,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
    ) -> Result<CudaSlice<f32>, EngineError> {
        let _gpu = self.span("swiglu");
        assert_eq!(a.len(), b.len());
        let mut h = self.gpu.zeros(a.len())?;
        let n = a.len() as u32;
        let mut launch = self.gpu.stream.launch_builder(&self.gpu.f.swiglu_forward);
        launch.arg(a).arg(b).arg(&mut h).arg(&n);
        // SAFETY: a, b and h hold n f32 (asserted, allocated).
        unsafe { self.run(launch, "swiglu_forward", a.len())? };
        Ok(h)
    }

    fn swiglu_backward(
        &self,
        dh: &CudaSlice<f32>,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>), EngineError> {
        let _gpu = self.span("swiglu backward");
        assert!(a.len() == dh.len() && b.len() == dh.len());
        let (mut da, mut db) = (self.gpu.zeros(dh.len())?, self.gpu.zeros(dh.len())?);
        let n = dh.len() as u32;
        let mut launch = self.gpu.stream.launch_builder(&self.gpu.f.swiglu_backward);
        launch
            .arg(a)
            .arg(b)
            .arg(dh)
            .arg(&mut da)
            .arg(&mut db)
            .arg(&n);
        // SAFETY: every buffer holds n f32 (asserted, allocated).
        unsafe { self.run(launch, "swiglu_backward", dh.len())? };
        Ok((da, db))
    }

    fn sigmoid(&self, x: &mut CudaSlice<f32>) -> Result<(), EngineError> {
        let _gpu = self.span("sigmoid");
        let n = x.len() as u32;
        let mut launch = self
            .gpu
            .stream
            .launch_builder(&self.gpu.dense.sigmoid_values);
        launch.arg(x).arg(&n);
        // SAFETY: x holds n f32.
        unsafe { self.run(launch, "sigmoid_values", n as usize) }
    }

    fn add_scaled_rows(
        &self,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        s: &CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        let _gpu = self.span("gate");
        assert!(y.len() == x.len() && y.len().is_multiple_of(s.len()));
        let (n, d) = (y.len() as u32, (y.len() / s.len()) as u32);
        let mut launch = self
            .gpu
            .stream
            .launch_builder(&self.gpu.dense.add_scaled_rows);
        launch.arg(y).arg(x).arg(s).arg(&n).arg(&d);
        // SAFETY: y and x hold n f32, s one per row of d (asserted).
        unsafe { self.run(launch, "add_scaled_rows", n as usize) }
    }

    fn gate_backward(
        &self,
        dy: &CudaSlice<f32>,
        out: &CudaSlice<f32>,
        sig: &CudaSlice<f32>,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>), EngineError> {
        let _gpu = self.span("gate backward");
        assert!(dy.len() == out.len() && dy.len().is_multiple_of(sig.len()));
        let (t, d) = (sig.len(), dy.len() / sig.len());
        let (mut dz, mut dout) = (self.gpu.zeros(t)?, self.gpu.zeros(dy.len())?);
        let partials = self.gpu.row_partials(dy, RowSum::Dot { x: out }, (t, d))?;
        let (t32, d32) = (t as u32, d as u32);
        let mut launch = self
            .gpu
            .stream
            .launch_builder(&self.gpu.dense.gate_backward);
        launch.arg(&partials).arg(dy).arg(sig);
        launch.arg(&mut dz).arg(&mut dout).arg(&t32).arg(&d32);
        // SAFETY: dy and dout hold t rows of d f32, sig and dz t, partials
        // ROW_PARTS a row (asserted, allocated); one thread an element.
        unsafe { self.run(launch, "gate_backward", t * d)? };
        Ok((dz, dout))
    }

    fn rmsnorm_forward(
        &self,
        out: &mut CudaSlice<f32>,
        inv_rms: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        g: &[f32],
        rows: usize,
        width: usize,
        eps: f64,
    ) -> Result<(), EngineError> {
        let _gpu = self.span("rmsnorm");
        let g = self.gpu.weight(g)?;
        self.gpu
            .rmsnorm_forward_device(out, inv_rms, x, &g, (rows, width), eps)
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut CudaSlice<f32>,
        dg: &mut [f32],
        dout: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        g: &[f32],
        inv_rms: &CudaSlice<f32>,
        rows: usize,
        width: usize,
    ) -> Result<(), EngineError> {
        let _gpu = self.span("rmsnorm backward");
        let g = self.gpu.weight(g)?;
        let io = [dout, x, g.as_ref(), inv_rms];
        self.gpu.with_grad(dg, |dg| {
            self.gpu.rmsnorm_backward_device(dx, dg, io, (rows, width))
        })
    }

    fn linear_forward(
        &self,
        out: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        let _gpu = self.span("gemm");
        assert!(out.len() == m * n && x.len() == m * k && w.len() == n * k);
        let gpu = self.gpu;
        gpu.dense_forward(gpu.dense_gemm, out, x, w, Shape { m, k, n })
    }

    fn linear_backward(
        &self,
        dx: &mut CudaSlice<f32>,
        dw: &mut [f32],
        dout: &CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        let _gpu = self.span("gemm backward");
        assert!(dx.len() == m * k && dw.len() == n * k && dout.len() == m * n);
        assert!(x.len() == m * k && w.len() == n * k);
        let (gpu, shape) = (self.gpu, Shape { m, k, n });
        gpu.with_grad(dw, |dw| {
            gpu.dense_backward(gpu.dense_gemm, dx, dw, dout, x, w, shape)
        })
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        table: &RopeTable<f32>,
        seq_len: usize,
        heads: usize,
        transpose: bool,
    ) -> Result<(), EngineError> {
        let _gpu = self.span("rope");
        let dims = (table.half(), table.head_dim());
        self.with_rope(table, |tables| {
            self.gpu
                .rope_device(x, tables, seq_len, heads, dims, transpose)
        })
    }

    type DeviceIds = DeviceIds;

    // Only the rows' ids (and a loss mask's bits) go up; the host keeps
    // its split for the checks and the evaluation's targets.
    fn token_ids(&self, rows: TokenRows<'_>) -> Result<TokenIds<DeviceIds>, EngineError> {
        let (inputs, targets) = rows.inputs_targets();
        let device = self.gpu.token_ids_device(rows)?;
        Ok(TokenIds {
            inputs,
            targets,
            device,
        })
    }

    // The table is a dense weight like any other (uploaded once between
    // updates, its gradient summed on the GPU).
    fn embedding_forward(
        &self,
        table: &[f32],
        ids: &TokenIds<DeviceIds>,
        d: usize,
    ) -> Result<CudaSlice<f32>, EngineError> {
        let _gpu = self.span("embedding");
        check_tokens(&ids.inputs, table.len() / d)?;
        let table = self.gpu.weight(table)?;
        self.gpu
            .embedding_forward_device(&table, &ids.device.inputs, d)
    }

    fn embedding_backward(
        &self,
        dtable: &mut [f32],
        dh: &CudaSlice<f32>,
        ids: &TokenIds<DeviceIds>,
        d: usize,
    ) -> Result<(), EngineError> {
        let _gpu = self.span("embedding backward");
        check_tokens(&ids.inputs, dtable.len() / d)?;
        self.gpu.with_grad(dtable, |acc| {
            self.gpu
                .embedding_backward_device(acc, dh, &ids.device.inputs, d)
        })
    }

    fn head_loss(
        &self,
        dx: &mut CudaSlice<f32>,
        dhead: &mut [f32],
        x: &CudaSlice<f32>,
        head: &[f32],
        ids: &TokenIds<DeviceIds>,
        s: HeadShape,
    ) -> Result<f32, EngineError> {
        let _gpu = self.span("head and loss");
        let block = crate::backend::head_block_rows(s.v);
        let targets = &ids.device.targets;
        self.gpu
            .head_loss_device(dx, dhead, x, head, targets, s, block)
    }

    fn head_loss_forward(
        &self,
        x: &CudaSlice<f32>,
        head: &[f32],
        ids: &TokenIds<DeviceIds>,
        s: HeadShape,
    ) -> Result<f32, EngineError> {
        let _gpu = self.span("head and loss");
        let block = crate::backend::head_block_rows(s.v);
        let targets = &ids.device.targets;
        self.gpu
            .head_loss_forward_device(x, head, targets, s, block)
    }

    type MoeSaved = CudaMoeSaved;

    fn moe_forward(
        &self,
        model: &ModelConfig,
        layer: usize,
        router: (&[f32], Option<&[f32]>),
        x: &CudaSlice<f32>,
        t: usize,
        runner: &mut dyn ExpertRunner,
    ) -> Result<(CudaSlice<f32>, CudaMoeSaved), EngineError> {
        self.moe_forward_on_gpu(model, layer, router, x, t, runner)
    }

    fn moe_backward(
        &self,
        model: &ModelConfig,
        layer: usize,
        router: (&[f32], &mut [f32]),
        grads: (&mut CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        saved: &CudaMoeSaved,
        losses: (f32, f32),
        runner: &mut dyn ExpertRunner,
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        self.moe_backward_on_gpu(
            model,
            layer,
            router,
            grads,
            saved,
            losses,
            runner,
            last_micro_batch,
        )
    }

    fn moe_prob_sums(&self, saved: &[&CudaMoeSaved], e: usize) -> Result<Vec<f64>, EngineError> {
        self.gpu.prob_sums(saved, e)
    }

    fn moe_release(&self, saved: &mut CudaMoeSaved, runner: &mut dyn ExpertRunner) {
        // A block that ran on the host hands its buffer back; GPU memory is
        // freed as the saved state is dropped.
        if let CudaMoeSaved::Host(s) = saved {
            runner.give_buffer(std::mem::take(&mut s.expert_out));
        }
    }

    fn moe_output_done(&self, y: CudaSlice<f32>, _runner: &mut dyn ExpertRunner) {
        drop(y);
    }

    fn on_host<R>(
        &self,
        x: &mut CudaSlice<f32>,
        f: impl FnOnce(&mut [f32]) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        let mut host = self.read(x)?.into_owned();
        let result = f(&mut host)?;
        self.gpu.count_pcie_other::<f32>(host.len());
        self.gpu
            .stream
            .memcpy_htod(&host, x)
            .map_err(|e| gpu_error("an upload", e))?;
        Ok(result)
    }

    fn attention_saved_len(&self, shape: &AttnShape) -> usize {
        attention_stats_len(shape)
    }

    fn attention_forward(
        &self,
        out: &mut CudaSlice<f32>,
        saved: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        let _gpu = self.span("attention");
        let qkv = [q, k, v];
        self.with_starts(starts, shape, |starts| {
            let blocks = ATTENTION_BLOCK_BYTES;
            self.gpu
                .attention_forward_device(out, saved, qkv, starts, shape, blocks)
        })
    }

    fn attention_backward(
        &self,
        grads: [&mut CudaSlice<f32>; 3],
        dout: &CudaSlice<f32>,
        saved: &CudaSlice<f32>,
        qkv: [&CudaSlice<f32>; 3],
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        let _gpu = self.span("attention backward");
        // The softmax kernel takes the statistics as a buffer it may
        // write; it reads them here, from a copy (2 values a query row).
        let mut stats = self.duplicate(saved)?;
        let blocks = ATTENTION_BLOCK_BYTES;
        self.with_starts(starts, shape, |starts| {
            self.gpu
                .attention_backward_device(grads, dout, &mut stats, qkv, starts, shape, blocks)
        })
    }
}

impl Drop for CudaOps<'_> {
    fn drop(&mut self) {
        if let Some(spans) = &self.spans {
            // A diagnostic: where the stream failed, the operation that
            // queued the failing work has reported it, and its spans are
            // left off the timeline.
            let _ = spans.flush();
        }
    }
}

/// Tokens index rows of a table on the GPU, where nothing checks bounds.
fn check_tokens(tokens: &[u32], vocab: usize) -> Result<(), EngineError> {
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(t) => Err(EngineError::Batch(format!(
            "token {t} is outside the vocabulary of {vocab}"
        ))),
        None => Ok(()),
    }
}
