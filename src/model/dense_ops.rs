//! [`DenseOps`]: the operations of a network's dense layers on
//! activations kept where a backend computes them. [`HostOps`](super::HostOps) keeps them
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
use super::{DenseKernels, ExpertRunner, HeadShape, ModelConfig, TokenIds, TokenRows};
use crate::math::attention::{AttnShape, RopeTable};
use crate::math::Routing;
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

    /// The head's cross-entropy of x against the targets of `ids`, forward
    /// only (evaluation), its logits made a block of rows at a time
    /// (`backend::head_block_rows`) so that (T × V) never exist whole.
    fn head_loss_forward(
        &self,
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
