//! [`DenseOps`]: the operations of a network's dense layers on
//! activations kept where a backend computes them. [`HostOps`] keeps them
//! in host memory and runs each operation as `math` writes it (its GEMMs
//! and attention through the backend's [`DenseKernels`]); a GPU's keeps
//! them in device memory, so that a layer's activations never cross PCIe.
//!
//! Weights and their gradients are slices of the engine's dense params and
//! dense gradient, as [`DenseKernels`] takes them: a backend that keeps
//! them on its device maps each slice to its copy there
//! (`weights_changed`, `grads_begin`/`grads_flush`).

#![allow(clippy::too_many_arguments)]

use std::borrow::Cow;

use super::MoeSaved;
use super::{moe_backward, moe_forward, DenseKernels, ExpertRunner, HeadShape, ModelConfig};
use super::{TokenIds, TokenRows};
use crate::math::attention::{
    embedding_backward, embedding_forward, rope_backward, rope_forward, AttnShape, RopeTable,
};
use crate::math::{
    add_prob_sums, rmsnorm_backward, rmsnorm_forward, sigmoid, silu, silu_grad, Routing,
};
use crate::EngineError;

/// The dense layers' operations on activation buffers of type
/// [`DenseOps::Buf`]. Every buffer is a row-major f32 matrix whose shape
/// the caller gives; outputs named `out` are overwritten, gradients named
/// `dx`, `dw`, `dg`, `db` accumulate.
pub trait DenseOps {
    /// An activation buffer of f32 values.
    type Buf;

    /// The backend's kernels (its timeline spans, and the host's own work
    /// between these operations).
    fn kernels(&self) -> &dyn DenseKernels;

    /// `n` zeros.
    fn zeros(&self, n: usize) -> Result<Self::Buf, EngineError>;
    /// The values x holds.
    fn len(&self, x: &Self::Buf) -> usize;
    /// The rows of `width` values x holds.
    fn rows(&self, x: &Self::Buf, width: usize) -> usize {
        self.len(x) / width.max(1)
    }
    /// A copy of `x`.
    fn duplicate(&self, x: &Self::Buf) -> Result<Self::Buf, EngineError>;
    /// Host values `x`, placed where these operations compute (moved on
    /// the host, copied to a GPU).
    fn place(&self, x: Vec<f32>) -> Result<Self::Buf, EngineError>;
    /// `x`'s values in host memory (borrowed where they are there).
    fn read<'a>(&self, x: &'a Self::Buf) -> Result<Cow<'a, [f32]>, EngineError>;
    /// `x`'s values taken into host memory (moved on the host, copied
    /// from a GPU).
    fn take(&self, x: Self::Buf) -> Result<Vec<f32>, EngineError>;

    /// acc += x, element by element.
    fn add_assign(&self, acc: &mut Self::Buf, x: &Self::Buf) -> Result<(), EngineError>;
    /// Each of x's rows (of b's length) += b.
    fn add_bias(&self, x: &mut Self::Buf, b: &[f32]) -> Result<(), EngineError>;
    /// db += the sum of dx's rows (of db's length), in row order.
    fn bias_grad(&self, db: &mut [f32], dx: &Self::Buf) -> Result<(), EngineError>;
    /// x clamped to [−clip, clip] in place.
    fn clamp(&self, x: &mut Self::Buf, clip: f32) -> Result<(), EngineError>;
    /// grad zeroed where `before` (what `clamp` was given) lies outside
    /// [−clip, clip].
    fn clamp_grad(
        &self,
        grad: &mut Self::Buf,
        before: &Self::Buf,
        clip: f32,
    ) -> Result<(), EngineError>;

    /// `math::rmsnorm_forward` over `rows` rows of `width`.
    /// h = silu(a) ⊙ b, SwiGLU's hidden activation (`math::silu`).
    fn swiglu(&self, a: &Self::Buf, b: &Self::Buf) -> Result<Self::Buf, EngineError>;
    /// (da, db): the gradient of `swiglu` at (a, b) from dh.
    fn swiglu_backward(
        &self,
        dh: &Self::Buf,
        a: &Self::Buf,
        b: &Self::Buf,
    ) -> Result<(Self::Buf, Self::Buf), EngineError>;
    /// x = σ(x), element by element (`math::sigmoid`).
    fn sigmoid(&self, x: &mut Self::Buf) -> Result<(), EngineError>;
    /// y's row i += s_i · x's row i (rows of y's length over s's).
    fn add_scaled_rows(
        &self,
        y: &mut Self::Buf,
        x: &Self::Buf,
        s: &Self::Buf,
    ) -> Result<(), EngineError>;
    /// The backward of `add_scaled_rows(y, out, σ)` from dy, σ a gate
    /// σ(z): (dz, dout), dz_i = σ(1 − σ)·⟨dy_i, out_i⟩ and
    /// dout_i = σ_i · dy_i.
    fn gate_backward(
        &self,
        dy: &Self::Buf,
        out: &Self::Buf,
        sig: &Self::Buf,
    ) -> Result<(Self::Buf, Self::Buf), EngineError>;
    fn rmsnorm_forward(
        &self,
        out: &mut Self::Buf,
        inv_rms: &mut Self::Buf,
        x: &Self::Buf,
        g: &[f32],
        rows: usize,
        width: usize,
        eps: f64,
    ) -> Result<(), EngineError>;
    /// `math::rmsnorm_backward`: dx and dg accumulate.
    fn rmsnorm_backward(
        &self,
        dx: &mut Self::Buf,
        dg: &mut [f32],
        dout: &Self::Buf,
        x: &Self::Buf,
        g: &[f32],
        inv_rms: &Self::Buf,
        rows: usize,
        width: usize,
    ) -> Result<(), EngineError>;

    /// out (M, N) = x (M, K) · w (N, K)ᵀ
    fn linear_forward(
        &self,
        out: &mut Self::Buf,
        x: &Self::Buf,
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError>;
    /// dx (M, K) += dout · w;  dw (N, K) += doutᵀ · x
    fn linear_backward(
        &self,
        dx: &mut Self::Buf,
        dw: &mut [f32],
        dout: &Self::Buf,
        x: &Self::Buf,
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError>;

    /// `math::attention::rope_forward` (`transpose` false) or
    /// `rope_backward` of x (T, heads · head_dim), in place.
    fn rope(
        &self,
        x: &mut Self::Buf,
        table: &RopeTable<f32>,
        seq_len: usize,
        heads: usize,
        transpose: bool,
    ) -> Result<(), EngineError>;

    /// Where these operations keep a batch's inputs and targets besides
    /// the host (a GPU's copies; `()` where they run on the host).
    type DeviceIds;
    /// The inputs and targets of `rows`, on the host and where these
    /// operations read them (a GPU takes the rows up once and splits them
    /// there).
    fn token_ids(&self, rows: TokenRows<'_>) -> Result<TokenIds<Self::DeviceIds>, EngineError>;
    /// h (T, D) = the rows of `table` (V, D) of the inputs of `ids`.
    fn embedding_forward(
        &self,
        table: &[f32],
        ids: &TokenIds<Self::DeviceIds>,
        d: usize,
    ) -> Result<Self::Buf, EngineError>;
    /// dtable += dh's rows at their inputs' ids, in token order.
    fn embedding_backward(
        &self,
        dtable: &mut [f32],
        dh: &Self::Buf,
        ids: &TokenIds<Self::DeviceIds>,
        d: usize,
    ) -> Result<(), EngineError>;
    /// [`DenseKernels::head_loss`] on these buffers: the head's logits of
    /// x, their cross-entropy against the targets of `ids` (returned), dx
    /// (overwritten) and dhead (accumulating).
    fn head_loss(
        &self,
        dx: &mut Self::Buf,
        dhead: &mut [f32],
        x: &Self::Buf,
        head: &[f32],
        ids: &TokenIds<Self::DeviceIds>,
        s: HeadShape,
    ) -> Result<f32, EngineError>;

    /// What a MoE block's forward keeps for its backward.
    type MoeSaved: MoeRouting;

    /// [`moe_forward`](super::moe_forward) of x (T, D): the router
    /// (`router`: its weight and a sigmoid router's correction bias), the
    /// dropless permutation, the experts through `runner`, the weighted
    /// combine; returns y (T, D).
    fn moe_forward(
        &self,
        model: &ModelConfig,
        layer: usize,
        router: (&[f32], Option<&[f32]>),
        x: &Self::Buf,
        t: usize,
        runner: &mut dyn ExpertRunner,
    ) -> Result<(Self::Buf, Self::MoeSaved), EngineError>;

    /// [`moe_backward`](super::moe_backward), `grads` = (dx, dy, x): from
    /// dy (T, D), dx (T, D) and the router's gradient accumulate
    /// (`router`: its weight and gradient), the experts' go through
    /// `runner`; `losses` are the load-balancing and z-loss weights of
    /// this micro-batch.
    fn moe_backward(
        &self,
        model: &ModelConfig,
        layer: usize,
        router: (&[f32], &mut [f32]),
        grads: (&mut Self::Buf, &Self::Buf, &Self::Buf),
        saved: &Self::MoeSaved,
        losses: (f32, f32),
        runner: &mut dyn ExpertRunner,
        last_micro_batch: bool,
    ) -> Result<(), EngineError>;

    /// Each expert's router probabilities (E of them) summed over the
    /// tokens of every block of `saved`, block after block, in f64 and
    /// token order (`math::add_prob_sums` from zeros): the load-balancing
    /// loss over every layer at once reads them.
    fn moe_prob_sums(
        &self,
        saved: &[&Self::MoeSaved],
        experts: usize,
    ) -> Result<Vec<f64>, EngineError>;

    /// A MoE block's saved state is done with: its buffers go back to
    /// `runner` where they came from it.
    fn moe_release(&self, saved: &mut Self::MoeSaved, runner: &mut dyn ExpertRunner);

    /// A MoE block's output `y` is done with, as `moe_release`.
    fn moe_output_done(&self, y: Self::Buf, runner: &mut dyn ExpertRunner);

    /// Runs `f` on x's values in host memory, which then become x's
    /// (in place on the host; downloaded and uploaded back on a GPU).
    fn on_host<R>(
        &self,
        x: &mut Self::Buf,
        f: impl FnOnce(&mut [f32]) -> Result<R, EngineError>,
    ) -> Result<R, EngineError>;

    /// The values `attention_forward` keeps for the backward at `shape`.
    fn attention_saved_len(&self, shape: &AttnShape) -> usize;
    /// [`DenseKernels::attention_forward`] on these buffers.
    fn attention_forward(
        &self,
        out: &mut Self::Buf,
        saved: &mut Self::Buf,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError>;
    /// [`DenseKernels::attention_backward`] on these buffers (dq, dk, dv
    /// start zeroed).
    fn attention_backward(
        &self,
        grads: [&mut Self::Buf; 3],
        dout: &Self::Buf,
        saved: &Self::Buf,
        qkv: [&Self::Buf; 3],
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError>;
}

/// A MoE block's routing, in what its forward keeps (the load-balancing
/// loss over all layers reads and sets it).
pub trait MoeRouting {
    fn routing(&self) -> &Routing<f32>;
    fn routing_mut(&mut self) -> &mut Routing<f32>;
}

impl MoeRouting for MoeSaved {
    fn routing(&self) -> &Routing<f32> {
        &self.routing
    }

    fn routing_mut(&mut self) -> &mut Routing<f32> {
        &mut self.routing
    }
}

/// Activations in host memory, each operation as `math` writes it, the
/// GEMMs and attention through `kernels`: the cpu's dense layers.
pub struct HostOps<'k> {
    kernels: &'k dyn DenseKernels,
}

impl<'k> HostOps<'k> {
    pub fn new(kernels: &'k dyn DenseKernels) -> Self {
        Self { kernels }
    }
}

impl DenseOps for HostOps<'_> {
    type Buf = Vec<f32>;

    fn kernels(&self) -> &dyn DenseKernels {
        self.kernels
    }

    fn zeros(&self, n: usize) -> Result<Vec<f32>, EngineError> {
        Ok(vec![0.0; n])
    }

    fn len(&self, x: &Vec<f32>) -> usize {
        x.len()
    }

    fn duplicate(&self, x: &Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(x.clone())
    }

    fn place(&self, x: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(x)
    }

    fn read<'a>(&self, x: &'a Vec<f32>) -> Result<Cow<'a, [f32]>, EngineError> {
        Ok(Cow::Borrowed(x))
    }

    fn take(&self, x: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(x)
    }

    fn add_assign(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> Result<(), EngineError> {
        assert_eq!(acc.len(), x.len());
        acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn add_bias(&self, x: &mut Vec<f32>, b: &[f32]) -> Result<(), EngineError> {
        for row in x.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
        }
        Ok(())
    }

    fn bias_grad(&self, db: &mut [f32], dx: &Vec<f32>) -> Result<(), EngineError> {
        for row in dx.chunks_exact(db.len()) {
            db.iter_mut().zip(row).for_each(|(d, g)| *d += g);
        }
        Ok(())
    }

    fn clamp(&self, x: &mut Vec<f32>, clip: f32) -> Result<(), EngineError> {
        x.iter_mut().for_each(|x| *x = x.clamp(-clip, clip));
        Ok(())
    }

    fn clamp_grad(
        &self,
        grad: &mut Vec<f32>,
        before: &Vec<f32>,
        clip: f32,
    ) -> Result<(), EngineError> {
        for (g, &x) in grad.iter_mut().zip(before) {
            if !(-clip..=clip).contains(&x) {
                *g = 0.0;
            }
        }
        Ok(())
    }

    fn swiglu(&self, a: &Vec<f32>, b: &Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(a.iter().zip(b).map(|(&a, &b)| silu(a) * b).collect())
    }

    fn swiglu_backward(
        &self,
        dh: &Vec<f32>,
        a: &Vec<f32>,
        b: &Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        let da = (0..dh.len()).map(|i| dh[i] * b[i] * silu_grad(a[i]));
        let db = (0..dh.len()).map(|i| dh[i] * silu(a[i]));
        Ok((da.collect(), db.collect()))
    }

    fn sigmoid(&self, x: &mut Vec<f32>) -> Result<(), EngineError> {
        x.iter_mut().for_each(|v| *v = sigmoid(*v));
        Ok(())
    }

    fn add_scaled_rows(
        &self,
        y: &mut Vec<f32>,
        x: &Vec<f32>,
        s: &Vec<f32>,
    ) -> Result<(), EngineError> {
        let d = y.len() / s.len();
        for ((y, x), &s) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(s) {
            y.iter_mut().zip(x).for_each(|(y, x)| *y += s * x);
        }
        Ok(())
    }

    fn gate_backward(
        &self,
        dy: &Vec<f32>,
        out: &Vec<f32>,
        sig: &Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        let d = dy.len() / sig.len();
        let mut dz = vec![0.0f32; sig.len()];
        let mut dout = vec![0.0f32; dy.len()];
        let rows = dy.chunks_exact(d).zip(out.chunks_exact(d));
        for (i, ((dyi, oi), dout)) in rows.zip(dout.chunks_exact_mut(d)).enumerate() {
            let dot: f32 = dyi.iter().zip(oi).map(|(g, o)| g * o).sum();
            let s = sig[i];
            dz[i] = s * (1.0 - s) * dot;
            dout.iter_mut().zip(dyi).for_each(|(o, g)| *o = s * g);
        }
        Ok((dz, dout))
    }

    fn rmsnorm_forward(
        &self,
        out: &mut Vec<f32>,
        inv_rms: &mut Vec<f32>,
        x: &Vec<f32>,
        g: &[f32],
        rows: usize,
        width: usize,
        eps: f64,
    ) -> Result<(), EngineError> {
        rmsnorm_forward(out, inv_rms, x, g, rows, width, eps);
        Ok(())
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut Vec<f32>,
        dg: &mut [f32],
        dout: &Vec<f32>,
        x: &Vec<f32>,
        g: &[f32],
        inv_rms: &Vec<f32>,
        rows: usize,
        width: usize,
    ) -> Result<(), EngineError> {
        rmsnorm_backward(dx, dg, dout, x, g, inv_rms, rows, width);
        Ok(())
    }

    fn linear_forward(
        &self,
        out: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        self.kernels.forward(out, x, w, m, k, n)
    }

    fn linear_backward(
        &self,
        dx: &mut Vec<f32>,
        dw: &mut [f32],
        dout: &Vec<f32>,
        x: &Vec<f32>,
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        self.kernels.backward(dx, dw, dout, x, w, m, k, n)
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        table: &RopeTable<f32>,
        seq_len: usize,
        heads: usize,
        transpose: bool,
    ) -> Result<(), EngineError> {
        if transpose {
            rope_backward(x, table, seq_len, heads);
        } else {
            rope_forward(x, table, seq_len, heads);
        }
        Ok(())
    }

    type DeviceIds = ();

    fn token_ids(&self, rows: TokenRows<'_>) -> Result<TokenIds<()>, EngineError> {
        let (inputs, targets) = rows.inputs_targets();
        Ok(TokenIds {
            inputs,
            targets,
            device: (),
        })
    }

    fn embedding_forward(
        &self,
        table: &[f32],
        ids: &TokenIds<()>,
        d: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let mut h = vec![0.0f32; ids.inputs.len() * d];
        embedding_forward(&mut h, table, &ids.inputs, d);
        Ok(h)
    }

    fn embedding_backward(
        &self,
        dtable: &mut [f32],
        dh: &Vec<f32>,
        ids: &TokenIds<()>,
        d: usize,
    ) -> Result<(), EngineError> {
        embedding_backward(dtable, dh, &ids.inputs, d);
        Ok(())
    }

    fn head_loss(
        &self,
        dx: &mut Vec<f32>,
        dhead: &mut [f32],
        x: &Vec<f32>,
        head: &[f32],
        ids: &TokenIds<()>,
        s: HeadShape,
    ) -> Result<f32, EngineError> {
        self.kernels.head_loss(dx, dhead, x, head, &ids.targets, s)
    }

    type MoeSaved = MoeSaved;

    fn moe_forward(
        &self,
        model: &ModelConfig,
        layer: usize,
        (router, bias): (&[f32], Option<&[f32]>),
        x: &Vec<f32>,
        t: usize,
        runner: &mut dyn ExpertRunner,
    ) -> Result<(Vec<f32>, MoeSaved), EngineError> {
        moe_forward(model, layer, router, bias, x, t, runner, self.kernels)
    }

    fn moe_backward(
        &self,
        model: &ModelConfig,
        layer: usize,
        (router, router_grad): (&[f32], &mut [f32]),
        (dx, dy, x): (&mut Vec<f32>, &Vec<f32>, &Vec<f32>),
        saved: &MoeSaved,
        (daux, dz): (f32, f32),
        runner: &mut dyn ExpertRunner,
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        let t = dy.len() / model.d_model.max(1);
        moe_backward(
            model,
            layer,
            router,
            router_grad,
            dx,
            dy,
            x,
            saved,
            t,
            daux,
            dz,
            runner,
            last_micro_batch,
            self.kernels,
        )
    }

    fn moe_prob_sums(&self, saved: &[&MoeSaved], experts: usize) -> Result<Vec<f64>, EngineError> {
        let mut sums = vec![0.0f64; experts];
        for block in saved {
            add_prob_sums(&block.routing.probs, &mut sums);
        }
        Ok(sums)
    }

    fn moe_release(&self, saved: &mut MoeSaved, runner: &mut dyn ExpertRunner) {
        runner.give_buffer(std::mem::take(&mut saved.expert_out));
    }

    fn moe_output_done(&self, y: Vec<f32>, runner: &mut dyn ExpertRunner) {
        runner.give_buffer(y);
    }

    fn on_host<R>(
        &self,
        x: &mut Vec<f32>,
        f: impl FnOnce(&mut [f32]) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        f(x)
    }

    fn attention_saved_len(&self, shape: &AttnShape) -> usize {
        self.kernels.attention_saved_len(shape)
    }

    fn attention_forward(
        &self,
        out: &mut Vec<f32>,
        saved: &mut Vec<f32>,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        self.kernels
            .attention_forward(out, saved, q, k, v, starts, shape)
    }

    fn attention_backward(
        &self,
        [dq, dk, dv]: [&mut Vec<f32>; 3],
        dout: &Vec<f32>,
        saved: &Vec<f32>,
        [q, k, v]: [&Vec<f32>; 3],
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        self.kernels
            .attention_backward(dq, dk, dv, dout, saved, q, k, v, starts, shape)
    }
}
