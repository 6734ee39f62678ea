//! The MoE block with its activations in GPU memory ([`CudaOps`]'
//! `moe_forward` / `moe_backward`): the router's logits and the routing
//! on the device (`router.rs`), the permutation's gather, the experts
//! computing from rows in GPU memory (`ExpertRunner::forward_layer_rows`),
//! and the weighted combine, each with its backward (`kernels.cu`, in the
//! cpu's order of sums). Only what the host decides from crosses: each
//! expert's count of assignments and the layer's two loss sums come down
//! (each token's experts too where the runner reads them), and one value
//! an expert of the load-balancing loss's gradient goes up.
//!
//! Where the runner's experts cannot read GPU memory (several devices
//! exchanging tokens, or a runner of host rows), the block runs on the
//! host as `model::moe_forward` writes it, its input and output copied.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};

use super::dense::threads;
use super::ops::CudaOps;
use super::router::DeviceRouting;
use super::{gpu_error, CudaBackend, Shape};
use crate::backend::ROW_PARTS;
use crate::backend::{DenseGemm, DeviceRows};
use crate::math::{add_prob_sums, aux_prob_grad, Permutation, Routing};
use crate::model::{moe_backward, moe_forward, DenseOps, ExpertRunner, ModelConfig, MoeRouting};
use crate::model::{DenseKernels, MoeSaved};
use crate::EngineError;

/// What a MoE block's forward keeps on a GPU.
pub enum CudaMoeSaved {
    /// The block ran on the host.
    Host(Box<MoeSaved>),
    /// The block ran on the GPU.
    Device(Box<DeviceMoe>),
}

/// A MoE block's routing: what the host keeps of it (each expert's
/// assignments, the losses, each token's experts where the runner reads
/// them), and in GPU memory the rest, with what its backward reads.
pub struct DeviceMoe {
    routing: Routing<f32>,
    perm: Permutation,
    device: DeviceRouting,
    /// (T·K, D) the experts' outputs in expert order.
    expert_out: CudaSlice<f32>,
}

impl CudaBackend {
    /// Each expert's router probabilities summed over the tokens of every
    /// block of `saved`, block after block, in f64 and token order
    /// (`math::add_prob_sums` from zeros). The sums stay on the GPU while
    /// the blocks' probabilities are there: E f64 come down once.
    pub(super) fn prob_sums(
        &self,
        saved: &[&CudaMoeSaved],
        e: usize,
    ) -> Result<Vec<f64>, EngineError> {
        let mut host = vec![0.0f64; e];
        let mut dev = self.alloc::<f64>(e)?;
        for block in saved {
            match block {
                CudaMoeSaved::Device(s) => self.add_prob_sums_on(s.device.probs(), &mut dev)?,
                CudaMoeSaved::Host(s) => {
                    self.download_values(&dev, &mut host)?;
                    add_prob_sums(&s.routing.probs, &mut host);
                    dev = self.upload_values(&host)?;
                }
            }
        }
        self.download_values(&dev, &mut host)?;
        Ok(host)
    }
}

impl MoeRouting for CudaMoeSaved {
    fn routing(&self) -> &Routing<f32> {
        match self {
            CudaMoeSaved::Host(s) => &s.routing,
            CudaMoeSaved::Device(s) => &s.routing,
        }
    }

    fn routing_mut(&mut self) -> &mut Routing<f32> {
        match self {
            CudaMoeSaved::Host(s) => &mut s.routing,
            CudaMoeSaved::Device(s) => &mut s.routing,
        }
    }
}

/// Rows of `x` as the experts see them: its address and length, valid
/// while the returned guard lives (it records the use on the stream).
macro_rules! rows_of {
    ($slice:expr, $stream:expr, $method:ident) => {{
        let len = $slice.len();
        let (ptr, guard) = $slice.$method($stream);
        (DeviceRows::new(ptr, len), guard)
    }};
}

impl CudaOps<'_> {
    /// [`DenseOps::moe_forward`] on the GPU.
    pub(super) fn moe_forward_on_gpu(
        &self,
        model: &ModelConfig,
        layer: usize,
        (router, bias): (&[f32], Option<&[f32]>),
        x: &CudaSlice<f32>,
        t: usize,
        runner: &mut dyn ExpertRunner,
    ) -> Result<(CudaSlice<f32>, CudaMoeSaved), EngineError> {
        let kernels = self.kernels();
        if !runner.takes_device_rows() {
            let x = self.read(x)?;
            let (y, saved) = moe_forward(model, layer, router, bias, &x, t, runner, kernels)?;
            return Ok((self.place(y)?, CudaMoeSaved::Host(Box::new(saved))));
        }
        let gpu = self.gpu();
        let (d, k, e) = (model.d_model, model.top_k, model.experts);
        let span = (kernels.host_span("router"), self.span("router"));
        // The router's logits in f32 whatever the dense GEMMs take: the
        // top-k choices then match the cpu's but for ties within f32's
        // rounding, and its (T × D × E) GEMM is a few percent of the layer.
        let mut logits = self.zeros(t * e)?;
        let router_shape = Shape { m: t, k: d, n: e };
        gpu.dense_forward(DenseGemm::F32, &mut logits, x, router, router_shape)?;
        let assignments = runner.needs_assignments();
        let (device, routing, perm) =
            gpu.route_device(&model.router(), &logits, bias, t, assignments)?;
        drop(span);
        let gathered = self.span("gather");
        let rows = gpu.gather_rows_device(x, &device.order, (t * k, d, k))?;
        let mut expert_out = gpu.zeros(t * k * d)?;
        drop(gathered);
        {
            let _gpu = self.span("experts");
            let (rows, _read) = rows_of!(rows, &gpu.stream, device_ptr);
            let (out, _write) = rows_of!(expert_out, &gpu.stream, device_ptr_mut);
            // SAFETY: the runner takes rows in this GPU's memory (asked
            // above; the engine pairs a GPU's runner with its own
            // backend's kernels); both hold T·K·D f32 and live past the
            // call, used by nothing else meanwhile.
            unsafe { runner.forward_layer_rows(layer, &perm, rows, out)? };
        }
        let _span = (kernels.host_span("combine"), self.span("combine"));
        let weights = &device.scored.weights;
        let y = gpu.combine_device(&expert_out, &device.position, weights, (t, k, d))?;
        let saved = DeviceMoe {
            routing,
            perm,
            device,
            expert_out,
        };
        Ok((y, CudaMoeSaved::Device(Box::new(saved))))
    }

    /// [`DenseOps::moe_backward`] on the GPU.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_backward_on_gpu(
        &self,
        model: &ModelConfig,
        layer: usize,
        (router, router_grad): (&[f32], &mut [f32]),
        (dx, dy, x): (&mut CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        saved: &CudaMoeSaved,
        (daux, dz): (f32, f32),
        runner: &mut dyn ExpertRunner,
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        let kernels: &dyn DenseKernels = self.kernels();
        let (d, k, e) = (model.d_model, model.top_k, model.experts);
        let t = dy.len() / d;
        let s = match saved {
            CudaMoeSaved::Device(s) => s,
            CudaMoeSaved::Host(s) => {
                let (dy, x) = (self.read(dy)?, self.read(x)?);
                return self.on_host(dx, |dx| {
                    moe_backward(
                        model,
                        layer,
                        router,
                        router_grad,
                        dx,
                        &dy,
                        &x,
                        s,
                        t,
                        daux,
                        dz,
                        runner,
                        last_micro_batch,
                        kernels,
                    )
                });
            }
        };
        let gpu = self.gpu();
        let span = (
            kernels.host_span("combine backward"),
            self.span("combine backward"),
        );
        let (order, position) = (&s.device.order, &s.device.position);
        let weights = &s.device.scored.weights;
        let dweights = gpu.combine_weights_grad_device(dy, &s.expert_out, position, (t, k, d))?;
        let n = t * k;
        let dout = gpu.weighted_rows_device(dy, weights, order, (n, d, k))?;
        let rows = gpu.gather_rows_device(x, order, (n, d, k))?;
        let mut dxa = gpu.zeros(n * d)?;
        drop(span);
        {
            let (rows, _r1) = rows_of!(rows, &gpu.stream, device_ptr);
            let (dout, _r2) = rows_of!(dout, &gpu.stream, device_ptr);
            let (dxa, _w) = rows_of!(dxa, &gpu.stream, device_ptr_mut);
            let _gpu = self.span("experts backward");
            // SAFETY: as in the forward, for the three (T·K, D) rows.
            unsafe {
                runner.backward_layer_rows(layer, &s.perm, [rows, dout, dxa], last_micro_batch)?
            };
        }
        let _span = (
            kernels.host_span("gather backward and router backward"),
            self.span("gather backward and router backward"),
        );
        gpu.gather_backward_device(dx, &dxa, position, (t, k, d))?;
        let cfg = model.router();
        // A layer's own load-balancing loss has a gradient made on the GPU
        // from its counts; the loss over every layer gives each layer the
        // same, which goes up once a step.
        let aux = match s.routing.aux_grad {
            Some(_) => self.aux_grad(aux_prob_grad(&cfg, daux, &s.routing, t))?,
            None => {
                let counts = &s.device.counts;
                std::sync::Arc::new(gpu.aux_prob_grad_device(counts, daux, t, cfg.top_k)?)
            }
        };
        let dlogits =
            gpu.router_logits_grad_device(&cfg, &s.device.scored, &aux, &dweights, dz, t)?;
        gpu.with_grad(router_grad, |dw| {
            let shape = Shape { m: t, k: d, n: e };
            gpu.dense_backward(DenseGemm::F32, dx, dw, &dlogits, x, router, shape)
        })
    }
}

impl CudaBackend {
    /// The MoE block's kernels on host slices, what the tests hold to
    /// `math::permute`: from `rows` (T·K, D) in expert order and dy (T,
    /// D), the combine y, the weights' gradient and every row's output
    /// gradient, returned, and the gather's backward added into `dx`.
    /// `[order, position]` as a `Permutation`'s.
    #[allow(clippy::type_complexity)]
    pub fn moe_rows_host(
        &self,
        rows: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        weights: &[f32],
        [order, position]: [&[u32]; 2],
        (t, k, d): (usize, usize, usize),
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>), EngineError> {
        self.bind()?;
        let (rows, dy, weights) = (self.upload(rows)?, self.upload(dy)?, self.upload(weights)?);
        let (order, position) = (self.upload_u32(order)?, self.upload_u32(position)?);
        let mut ddx = self.upload(dx)?;
        let y = self.combine_device(&rows, &position, &weights, (t, k, d))?;
        let dw = self.combine_weights_grad_device(&dy, &rows, &position, (t, k, d))?;
        let dout = self.weighted_rows_device(&dy, &weights, &order, (t * k, d, k))?;
        self.gather_backward_device(&mut ddx, &rows, &position, (t, k, d))?;
        let mut host = (vec![0.0; t * d], vec![0.0; t * k], vec![0.0; t * k * d]);
        self.download(&y, &mut host.0)?;
        self.download(&dw, &mut host.1)?;
        self.download(&dout, &mut host.2)?;
        self.download(&ddx, dx)?;
        Ok(host)
    }

    /// rows (n, D) = x[order[r] / k]: `math::gather_forward`.
    fn gather_rows_device(
        &self,
        x: &CudaSlice<f32>,
        order: &CudaSlice<u32>,
        (n, d, k): (usize, usize, usize),
    ) -> Result<CudaSlice<f32>, EngineError> {
        assert_eq!(order.len(), n);
        assert!(
            x.len() * k >= n * d,
            "every assignment's token is a row of x"
        );
        let mut rows = self.zeros(n * d)?;
        let [n32, d32, k32] = [n, d, k].map(|v| v as u32);
        let mut launch = self.stream.launch_builder(&self.dense.gather_rows);
        launch
            .arg(x)
            .arg(order)
            .arg(&mut rows)
            .arg(&n32)
            .arg(&d32)
            .arg(&k32);
        // SAFETY: rows holds n·d f32 and order n indices, each an
        // assignment t·k + s of a token t of x (the permutation of this
        // routing); one thread an element.
        unsafe { launch.launch(threads(n * d)) }.map_err(|e| gpu_error("gather_rows", e))?;
        Ok(rows)
    }

    /// y (T, D) = Σ_k w · rows[position]: `math::combine_forward`.
    fn combine_device(
        &self,
        rows: &CudaSlice<f32>,
        position: &CudaSlice<u32>,
        weights: &CudaSlice<f32>,
        (t, k, d): (usize, usize, usize),
    ) -> Result<CudaSlice<f32>, EngineError> {
        assert!(rows.len() == t * k * d && position.len() == t * k && weights.len() == t * k);
        let mut y = self.zeros(t * d)?;
        let [t32, k32, d32] = [t, k, d].map(|v| v as u32);
        let mut launch = self.stream.launch_builder(&self.dense.combine_rows);
        launch.arg(rows).arg(position).arg(weights).arg(&mut y);
        launch.arg(&t32).arg(&k32).arg(&d32);
        // SAFETY: sizes asserted; each position < T·K (a permutation);
        // one thread an element of y.
        unsafe { launch.launch(threads(t * d)) }.map_err(|e| gpu_error("combine_rows", e))?;
        Ok(y)
    }

    /// dweights (T·K) = dy · rows[position]: `math::combine_backward_weights`.
    fn combine_weights_grad_device(
        &self,
        dy: &CudaSlice<f32>,
        rows: &CudaSlice<f32>,
        position: &CudaSlice<u32>,
        (t, k, d): (usize, usize, usize),
    ) -> Result<CudaSlice<f32>, EngineError> {
        assert!(dy.len() == t * d && rows.len() == t * k * d && position.len() == t * k);
        let n = t * k;
        let mut partials = self.zeros(n * ROW_PARTS)?;
        let [t32, k32, d32, n32] = [t, k, d, n].map(|v| v as u32);
        let mut launch = self
            .stream
            .launch_builder(&self.dense.combine_weights_partials);
        launch.arg(dy).arg(rows).arg(position).arg(&mut partials);
        launch.arg(&t32).arg(&k32).arg(&d32);
        // SAFETY: sizes asserted; positions < T·K; partials hold an
        // assignment's parts for each; one thread an (assignment, part).
        unsafe { launch.launch(threads(n * ROW_PARTS)) }
            .map_err(|e| gpu_error("combine_weights_partials", e))?;
        let mut dweights = self.zeros(n)?;
        let mut launch = self.stream.launch_builder(&self.dense.combine_weights_grad);
        launch.arg(&partials).arg(&mut dweights).arg(&n32);
        // SAFETY: partials hold n assignments' parts, dweights n; one
        // thread an assignment.
        unsafe { launch.launch(threads(n)) }.map_err(|e| gpu_error("combine_weights_grad", e))?;
        Ok(dweights)
    }

    /// dout (n, D) row r = weights[a] · dy[a / k] for a = order[r]: the
    /// gradients of every expert's outputs (`math::AssignmentGrads`).
    fn weighted_rows_device(
        &self,
        dy: &CudaSlice<f32>,
        weights: &CudaSlice<f32>,
        order: &CudaSlice<u32>,
        (n, d, k): (usize, usize, usize),
    ) -> Result<CudaSlice<f32>, EngineError> {
        assert!(order.len() == n && weights.len() == n && dy.len() * k == n * d);
        let mut dout = self.zeros(n * d)?;
        let [n32, d32, k32] = [n, d, k].map(|v| v as u32);
        let mut launch = self.stream.launch_builder(&self.dense.weighted_rows);
        launch.arg(dy).arg(weights).arg(order).arg(&mut dout);
        launch.arg(&n32).arg(&d32).arg(&k32);
        // SAFETY: sizes asserted; each order entry < n = T·K; one thread
        // an element of dout.
        unsafe { launch.launch(threads(n * d)) }.map_err(|e| gpu_error("weighted_rows", e))?;
        Ok(dout)
    }

    /// dx (T, D) += Σ_k rows[position]: `math::gather_backward`.
    fn gather_backward_device(
        &self,
        dx: &mut CudaSlice<f32>,
        rows: &CudaSlice<f32>,
        position: &CudaSlice<u32>,
        (t, k, d): (usize, usize, usize),
    ) -> Result<(), EngineError> {
        assert!(dx.len() == t * d && rows.len() == t * k * d && position.len() == t * k);
        let [t32, k32, d32] = [t, k, d].map(|v| v as u32);
        let mut launch = self.stream.launch_builder(&self.dense.gather_rows_backward);
        launch.arg(rows).arg(position).arg(dx);
        launch.arg(&t32).arg(&k32).arg(&d32);
        // SAFETY: sizes asserted; positions < T·K; one thread an element
        // of dx.
        unsafe { launch.launch(threads(t * d)) }
            .map_err(|e| gpu_error("gather_rows_backward", e))?;
        Ok(())
    }
}
