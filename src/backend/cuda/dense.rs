//! The dense layers' kernels (`kernels.cu`): RMSNorm, rotary embeddings,
//! cross-entropy, and the token permutation's gather and scatter. Each
//! wrapper here takes host slices (uploads, launches, downloads), which is
//! what the tests compare with the CPU functions the kernels mirror.

use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};

use super::{gpu_error, CudaBackend};
use crate::backend::ROW_PARTS;
use crate::EngineError;

/// What [`CudaBackend::row_partials`] sums over each row of a.
#[derive(Clone, Copy)]
pub(super) enum RowSum<'a> {
    /// a²
    Squares,
    /// a · g · x, g one value a column (a norm's backward)
    Scaled {
        x: &'a CudaSlice<f32>,
        g: &'a CudaSlice<f32>,
    },
    /// a · x
    Dot { x: &'a CudaSlice<f32> },
}

pub(super) struct DenseFunctions {
    row_partials: CudaFunction,
    rmsnorm_forward: CudaFunction,
    rmsnorm_backward_dx: CudaFunction,
    column_partials: CudaFunction,
    add_column_partials: CudaFunction,
    rope: CudaFunction,
    logit_partials: CudaFunction,
    cross_entropy_loss: CudaFunction,
    cross_entropy: CudaFunction,
    pub(super) gather_rows: CudaFunction,
    scatter_rows: CudaFunction,
    pub(super) attn_to_heads: CudaFunction,
    pub(super) attn_from_heads: CudaFunction,
    pub(super) attn_softmax_partials: CudaFunction,
    pub(super) attn_softmax_stats: CudaFunction,
    pub(super) attn_softmax: CudaFunction,
    pub(super) attn_softmax_backward_partials: CudaFunction,
    pub(super) attn_softmax_backward: CudaFunction,
    pub(super) add_into: CudaFunction,
    pub(super) add_bias: CudaFunction,
    pub(super) clamp_values: CudaFunction,
    pub(super) clamp_grad: CudaFunction,
    pub(super) combine_rows: CudaFunction,
    pub(super) combine_weights_partials: CudaFunction,
    pub(super) combine_weights_grad: CudaFunction,
    pub(super) weighted_rows: CudaFunction,
    pub(super) gather_rows_backward: CudaFunction,
    pub(super) split_token_rows: CudaFunction,
    pub(super) document_starts: CudaFunction,
    pub(super) token_order_runs: CudaFunction,
    pub(super) token_order_merge: CudaFunction,
    pub(super) embedding_backward: CudaFunction,
    pub(super) sum_in_order: CudaFunction,
    pub(super) square_sums: CudaFunction,
    pub(super) sigmoid_values: CudaFunction,
    pub(super) add_scaled_rows: CudaFunction,
    pub(super) gate_backward: CudaFunction,
}

/// Kernel `name` of the compiled module.
pub(super) fn load_kernel(
    module: &Arc<CudaModule>,
    name: &str,
) -> Result<CudaFunction, EngineError> {
    module
        .load_function(name)
        .map_err(|e| gpu_error(&format!("kernel {name}"), e))
}

impl DenseFunctions {
    pub(super) fn load(module: &Arc<CudaModule>) -> Result<Self, EngineError> {
        let load = |name: &str| load_kernel(module, name);
        Ok(Self {
            row_partials: load("row_partials")?,
            rmsnorm_forward: load("rmsnorm_forward")?,
            rmsnorm_backward_dx: load("rmsnorm_backward_dx")?,
            column_partials: load("column_partials")?,
            add_column_partials: load("add_column_partials")?,
            rope: load("rope")?,
            logit_partials: load("logit_partials")?,
            cross_entropy_loss: load("cross_entropy_loss")?,
            cross_entropy: load("cross_entropy")?,
            gather_rows: load("gather_rows")?,
            scatter_rows: load("scatter_rows")?,
            attn_to_heads: load("attn_to_heads")?,
            attn_from_heads: load("attn_from_heads")?,
            attn_softmax_partials: load("attn_softmax_partials")?,
            attn_softmax_stats: load("attn_softmax_stats")?,
            attn_softmax: load("attn_softmax")?,
            attn_softmax_backward_partials: load("attn_softmax_backward_partials")?,
            attn_softmax_backward: load("attn_softmax_backward")?,
            add_into: load("add_into")?,
            add_bias: load("add_bias")?,
            clamp_values: load("clamp_values")?,
            clamp_grad: load("clamp_grad")?,
            combine_rows: load("combine_rows")?,
            combine_weights_partials: load("combine_weights_partials")?,
            combine_weights_grad: load("combine_weights_grad")?,
            weighted_rows: load("weighted_rows")?,
            gather_rows_backward: load("gather_rows_backward")?,
            split_token_rows: load("split_token_rows")?,
            document_starts: load("document_starts")?,
            token_order_runs: load("token_order_runs")?,
            token_order_merge: load("token_order_merge")?,
            embedding_backward: load("embedding_backward")?,
            sum_in_order: load("sum_in_order")?,
            square_sums: load("square_sums")?,
            sigmoid_values: load("sigmoid_values")?,
            add_scaled_rows: load("add_scaled_rows")?,
            gate_backward: load("gate_backward")?,
        })
    }
}

/// Rows a block of a column sum's first pass adds (`column_partials`).
pub(super) const COLUMN_SUM_ROWS: usize = 64;

/// A launch of one thread for each of `n` values, in blocks of 1024. The
/// kernels index their threads in 32 bits: past that a launch would wrap
/// around and leave values unwritten, so it stops here, naming what to
/// lower.
pub(super) fn threads(n: usize) -> LaunchConfig {
    let n = u32::try_from(n).unwrap_or_else(|_| {
        panic!(
            "a GPU kernel over {n} values, more than its 32-bit thread index reaches: \
             lower the tokens a micro-batch (--batch, --seq-len, or more --micro-batches)"
        )
    });
    LaunchConfig::for_num_elems(n)
}

impl CudaBackend {
    pub(super) fn upload_u32(&self, host: &[u32]) -> Result<CudaSlice<u32>, EngineError> {
        self.upload_values(host)
    }

    /// `math::rmsnorm_forward` on the GPU: (out, inv_rms).
    pub fn rmsnorm_forward_host(
        &self,
        x: &[f32],
        g: &[f32],
        t: usize,
        d: usize,
        eps: f64,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        let (dx, dg) = (self.upload(x)?, self.upload(g)?);
        let (mut out, mut inv) = (self.zeros(t * d)?, self.zeros(t)?);
        self.rmsnorm_forward_device(&mut out, &mut inv, &dx, &dg, (t, d), eps)?;
        let (mut h_out, mut h_inv) = (vec![0.0; t * d], vec![0.0; t]);
        self.download(&out, &mut h_out)?;
        self.download(&inv, &mut h_inv)?;
        Ok((h_out, h_inv))
    }

    /// `math::rmsnorm_forward` of x (t, d) in GPU memory with gain g.
    pub(super) fn rmsnorm_forward_device(
        &self,
        out: &mut CudaSlice<f32>,
        inv: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        (t, d): (usize, usize),
        eps: f64,
    ) -> Result<(), EngineError> {
        assert!(x.len() == t * d && out.len() == t * d && g.len() == d && inv.len() == t);
        let partials = self.row_partials(x, RowSum::Squares, (t, d))?;
        let (t32, d32, eps32) = (t as u32, d as u32, eps as f32);
        let mut launch = self.stream.launch_builder(&self.dense.rmsnorm_forward);
        launch
            .arg(x)
            .arg(g)
            .arg(&partials)
            .arg(out)
            .arg(inv)
            .arg(&t32)
            .arg(&d32)
            .arg(&eps32);
        // SAFETY: x and out hold t·d f32, g holds d, inv t (asserted),
        // partials a row's parts for t rows; one thread an element.
        unsafe { launch.launch(threads(t * d)) }.map_err(|e| gpu_error("rmsnorm_forward", e))?;
        Ok(())
    }

    /// Each of a's t rows (t, d) summed in [`ROW_PARTS`] interleaved parts
    /// (`row_partials`, whose `STRATA_ROW_LANES` is that count): of what
    /// `sum` says.
    pub(super) fn row_partials(
        &self,
        a: &CudaSlice<f32>,
        sum: RowSum<'_>,
        (t, d): (usize, usize),
    ) -> Result<CudaSlice<f32>, EngineError> {
        let mut partials = self.zeros(t * ROW_PARTS)?;
        let (x, g, code) = match sum {
            RowSum::Squares => (a, a, 0u32), // x and g unread
            RowSum::Scaled { x, g } => (x, g, 1),
            RowSum::Dot { x } => (x, x, 2), // g unread
        };
        assert!(a.len() == t * d && x.len() == t * d);
        assert!(code != 1 || g.len() == d);
        let [t32, d32] = [t, d].map(|v| v as u32);
        let mut launch = self.stream.launch_builder(&self.dense.row_partials);
        launch.arg(a).arg(x).arg(g).arg(&mut partials);
        launch.arg(&t32).arg(&d32).arg(&code);
        // SAFETY: a and x hold t·d f32 and, where read, g d (asserted),
        // partials t·ROW_PARTS; one thread a (row, part).
        unsafe { launch.launch(threads(t * ROW_PARTS)) }
            .map_err(|e| gpu_error("row_partials", e))?;
        Ok(partials)
    }

    /// `math::rmsnorm_backward` on the GPU: dx and dg accumulate.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward_host(
        &self,
        dx: &mut [f32],
        dg: &mut [f32],
        dout: &[f32],
        x: &[f32],
        g: &[f32],
        inv_rms: &[f32],
        t: usize,
        d: usize,
    ) -> Result<(), EngineError> {
        let (ddout, dxin, dgain, dinv) = (
            self.upload(dout)?,
            self.upload(x)?,
            self.upload(g)?,
            self.upload(inv_rms)?,
        );
        let (mut ddx, mut ddg) = (self.upload(dx)?, self.upload(dg)?);
        let io = [&ddout, &dxin, &dgain, &dinv];
        self.rmsnorm_backward_device(&mut ddx, &mut ddg, io, (t, d))?;
        self.download(&ddx, dx)?;
        self.download(&ddg, dg)
    }

    /// `math::rmsnorm_backward` in GPU memory, `io` = [dout, x, g, inv_rms]:
    /// dx and dg accumulate.
    pub(super) fn rmsnorm_backward_device(
        &self,
        dx: &mut CudaSlice<f32>,
        dg: &mut CudaSlice<f32>,
        [dout, x, g, inv]: [&CudaSlice<f32>; 4],
        (t, d): (usize, usize),
    ) -> Result<(), EngineError> {
        assert!(dout.len() == t * d && x.len() == t * d && dx.len() == t * d);
        assert!(g.len() == d && dg.len() == d && inv.len() == t);
        let partials = self.row_partials(dout, RowSum::Scaled { x, g }, (t, d))?;
        let (t32, d32) = (t as u32, d as u32);
        let mut launch = self.stream.launch_builder(&self.dense.rmsnorm_backward_dx);
        launch
            .arg(dout)
            .arg(x)
            .arg(g)
            .arg(inv)
            .arg(&partials)
            .arg(dx)
            .arg(&t32)
            .arg(&d32);
        // SAFETY: dout, x, dx hold t·d f32, g d, inv_rms t (asserted),
        // partials a row's parts for t rows; one thread an element.
        unsafe { launch.launch(threads(t * d)) }
            .map_err(|e| gpu_error("rmsnorm_backward_dx", e))?;
        self.column_sums_into(dg, dout, Some((x, inv)), (t, d))
    }

    /// dst (D) += the sum over a's t rows (t, D) of a, or with `norm` =
    /// (x, inv_rms) of a·x·inv_rms (a norm's gain gradient), in two
    /// passes: blocks of [`COLUMN_SUM_ROWS`] rows in row order, then the
    /// blocks in order.
    pub(super) fn column_sums_into(
        &self,
        dst: &mut CudaSlice<f32>,
        a: &CudaSlice<f32>,
        norm: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
        (t, d): (usize, usize),
    ) -> Result<(), EngineError> {
        assert!(a.len() == t * d && dst.len() == d);
        if let Some((x, inv)) = norm {
            assert!(x.len() == t * d && inv.len() == t);
        }
        let blocks = t.div_ceil(COLUMN_SUM_ROWS).max(1);
        let mut partials = self.zeros(blocks * d)?;
        let (x, inv) = norm.unwrap_or((a, a)); // unread without `norm`
        let [t32, d32, rows32, norm32, blocks32] =
            [t, d, COLUMN_SUM_ROWS, norm.is_some() as usize, blocks].map(|v| v as u32);
        let mut launch = self.stream.launch_builder(&self.dense.column_partials);
        launch.arg(a).arg(x).arg(inv).arg(&mut partials);
        launch.arg(&t32).arg(&d32).arg(&rows32).arg(&norm32);
        // SAFETY: a (and with `norm` x) hold t·d f32 and inv t (asserted),
        // partials blocks·d; one thread a (block, column).
        unsafe { launch.launch(threads(blocks * d)) }
            .map_err(|e| gpu_error("column_partials", e))?;
        let mut launch = self.stream.launch_builder(&self.dense.add_column_partials);
        launch.arg(&partials).arg(dst).arg(&blocks32).arg(&d32);
        // SAFETY: partials hold blocks·d f32, dst d (asserted); one thread
        // a column.
        unsafe { launch.launch(threads(d)) }.map_err(|e| gpu_error("add_column_partials", e))?;
        Ok(())
    }

    /// `rope_forward` (`transpose` false) or `rope_backward` on the GPU, in
    /// place on `x` (rows, heads·head_dim), the first 2·half of each head
    /// rotating.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_host(
        &self,
        x: &mut [f32],
        cos: &[f32],
        sin: &[f32],
        seq_len: usize,
        heads: usize,
        (half, head_dim): (usize, usize),
        transpose: bool,
    ) -> Result<(), EngineError> {
        let mut dx = self.upload(x)?;
        let tables = [self.upload(cos)?, self.upload(sin)?];
        self.rope_device(
            &mut dx,
            &tables,
            seq_len,
            heads,
            (half, head_dim),
            transpose,
        )?;
        self.download(&dx, x)
    }

    /// As [`Self::rope_host`] on `x` and the cos and sin `tables` in GPU
    /// memory.
    pub(super) fn rope_device(
        &self,
        x: &mut CudaSlice<f32>,
        [cos, sin]: &[CudaSlice<f32>; 2],
        seq_len: usize,
        heads: usize,
        (half, head_dim): (usize, usize),
        transpose: bool,
    ) -> Result<(), EngineError> {
        assert!(2 * half <= head_dim && x.len().is_multiple_of(heads * head_dim));
        assert!(cos.len() == seq_len * half && sin.len() == seq_len * half);
        let rows = x.len() / (heads * head_dim);
        let [r32, h32, half32, hd32, s32] =
            [rows, heads, half, head_dim, seq_len].map(|x| x as u32);
        let sign = if transpose { -1.0f32 } else { 1.0 };
        let mut launch = self.stream.launch_builder(&self.dense.rope);
        launch
            .arg(x)
            .arg(cos)
            .arg(sin)
            .arg(&r32)
            .arg(&h32)
            .arg(&half32)
            .arg(&hd32)
            .arg(&s32)
            .arg(&sign);
        // SAFETY: x holds rows·heads·head_dim f32 with 2·half ≤ head_dim,
        // the tables seq_len·half (asserted); one thread a (row, head, pair).
        unsafe { launch.launch(threads(rows * heads * half)) }.map_err(|e| gpu_error("rope", e))?;
        Ok(())
    }

    /// `math::cross_entropy_forward_backward` on the GPU: the loss (rows'
    /// shares summed in row order, on the GPU) and d logits.
    pub fn cross_entropy_host(
        &self,
        dlogits: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
        denominator: usize,
    ) -> Result<f32, EngineError> {
        self.bind()?;
        let t = targets.len();
        let (dl, dt) = (self.upload(logits)?, self.upload_u32(targets)?);
        let (mut dd, mut shares) = (self.zeros(t * v)?, self.zeros(t)?);
        let rows = &mut shares.slice_mut(..);
        self.cross_entropy_rows(&dl, &dt.slice(..), Some(&mut dd), rows, v, denominator)?;
        self.download(&dd, dlogits)?;
        self.sum_in_order(&shares)
    }

    /// `sum_in_order` on a host slice, for the kernel checks.
    pub fn sum_in_order_host(&self, x: &[f32]) -> Result<f32, EngineError> {
        self.bind()?;
        let x = self.upload(x)?;
        self.sum_in_order(&x)
    }

    /// The f32 sum of `x` in index order from 0 (as the host folds a
    /// loss's row shares), added on the GPU and downloaded.
    pub(super) fn sum_in_order(&self, x: &CudaSlice<f32>) -> Result<f32, EngineError> {
        let (mut sum, n) = (self.zeros(1)?, x.len() as u32);
        let mut launch = self.stream.launch_builder(&self.dense.sum_in_order);
        launch.arg(x).arg(&n).arg(&mut sum);
        // SAFETY: x holds n f32, sum one; the one thread reads and writes
        // only those.
        unsafe { launch.launch(threads(1)) }.map_err(|e| gpu_error("sum_in_order", e))?;
        let mut host = [0.0f32];
        self.download(&sum, &mut host)?;
        Ok(host[0])
    }

    /// The cross-entropy kernel on logits (T, V) already on the GPU:
    /// writes each row's loss share into `rows` (T), which the caller sums
    /// in row order, and d logits where given.
    pub(super) fn cross_entropy_rows(
        &self,
        logits: &CudaSlice<f32>,
        targets: &CudaView<'_, u32>,
        dlogits: Option<&mut CudaSlice<f32>>,
        rows: &mut CudaViewMut<'_, f32>,
        v: usize,
        denominator: usize,
    ) -> Result<(), EngineError> {
        let t = targets.len();
        assert!(logits.len() == t * v && rows.len() == t);
        assert!(dlogits.as_ref().is_none_or(|d| d.len() == t * v));
        let (t32, v32, scale) = (t as u32, v as u32, 1.0f32 / denominator as f32);
        let mut partials = self.zeros(t * 2 * ROW_PARTS)?;
        for sums in [0u32, 1] {
            let mut launch = self.stream.launch_builder(&self.dense.logit_partials);
            launch
                .arg(logits)
                .arg(&mut partials)
                .arg(&t32)
                .arg(&v32)
                .arg(&sums);
            // SAFETY: logits hold t·v f32 (asserted), partials two parts'
            // values for each row; one thread a (row, part).
            unsafe { launch.launch(threads(t * ROW_PARTS)) }
                .map_err(|e| gpu_error("logit_partials", e))?;
        }
        let mut lse = self.zeros(t)?;
        let mut launch = self.stream.launch_builder(&self.dense.cross_entropy_loss);
        launch.arg(logits).arg(targets).arg(&partials);
        launch.arg(&mut lse).arg(rows);
        launch.arg(&t32).arg(&v32).arg(&scale);
        // SAFETY: as above; targets hold t u32 (each < v or IGNORED_TARGET,
        // as the batch's validation checks), lse and rows t f32 (asserted);
        // one thread a row.
        unsafe { launch.launch(threads(t)) }.map_err(|e| gpu_error("cross_entropy_loss", e))?;
        let Some(dlogits) = dlogits else {
            return Ok(()); // the loss alone
        };
        let mut launch = self.stream.launch_builder(&self.dense.cross_entropy);
        launch.arg(logits).arg(targets).arg(&lse).arg(dlogits);
        launch.arg(&t32).arg(&v32).arg(&scale);
        // SAFETY: as above, dlogits t·v f32 (asserted); one thread an
        // element.
        unsafe { launch.launch(threads(t * v)) }.map_err(|e| gpu_error("cross_entropy", e))?;
        Ok(())
    }

    /// `math::gather_forward` then `math::scatter_to_assignments` on the
    /// GPU: the rows of `assignments` gathered from x (T, D), and those
    /// rows scattered into a (T·K, D) buffer.
    pub fn permute_host(
        &self,
        x: &[f32],
        assignments: &[u32],
        d: usize,
        k: usize,
        t: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        let n = assignments.len();
        let (dx, da) = (self.upload(x)?, self.upload_u32(assignments)?);
        let (mut rows, mut scattered) = (self.zeros(n * d)?, self.zeros(t * k * d)?);
        let (n32, d32, k32) = (n as u32, d as u32, k as u32);
        let mut launch = self.stream.launch_builder(&self.dense.gather_rows);
        launch
            .arg(&dx)
            .arg(&da)
            .arg(&mut rows)
            .arg(&n32)
            .arg(&d32)
            .arg(&k32);
        // SAFETY: x holds t·d f32 and every assignment / k < t; rows n·d;
        // one thread an element.
        unsafe { launch.launch(threads(n * d)) }.map_err(|e| gpu_error("gather_rows", e))?;
        let mut launch = self.stream.launch_builder(&self.dense.scatter_rows);
        launch
            .arg(&rows)
            .arg(&da)
            .arg(&mut scattered)
            .arg(&n32)
            .arg(&d32);
        // SAFETY: every assignment < t·k, so each row lands inside the
        // t·k·d buffer; one thread an element.
        unsafe { launch.launch(threads(n * d)) }.map_err(|e| gpu_error("scatter_rows", e))?;
        let mut h = (vec![0.0; n * d], vec![0.0; t * k * d]);
        self.download(&rows, &mut h.0)?;
        self.download(&scattered, &mut h.1)?;
        Ok(h)
    }
}
