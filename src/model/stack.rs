//! One MoE layer, forward and backward (router, dropless permutation, the
//! runner's experts, the weighted combine), and the plain stack of them
//! that the engine's own tests and benches train: L layers of
//! `h ← h + MoE(RMSNorm(h))`, then a linear head and cross-entropy.

// Numeric kernels index rows and columns explicitly and take their shapes
// as arguments, as llm.c does.
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use super::{
    Batch, DenseKernels, Evaluation, ExpertRunner, Losses, ModelConfig, Network, PlainKernels,
};
use crate::math::{
    combine_backward_weights, combine_forward, cross_entropy_loss, gather_backward,
    rmsnorm_backward, rmsnorm_forward, route_logits, router_logits_grad, AssignmentGrads,
    Permutation, Routing,
};
use crate::EngineError;

/// What a MoE layer's forward keeps for its backward.
#[derive(Clone, Debug, Default)]
pub struct MoeSaved {
    pub routing: Routing<f32>,
    pub perm: Permutation,
    /// (T·K, D) the experts' outputs in expert order: row i is assignment
    /// `perm.order[i]`'s
    pub expert_out: Vec<f32>,
}

/// One MoE layer, forward: router, dropless permutation, experts, and the
/// weighted combine. `x` (T, D) is the (normed) input; returns y (T, D).
/// `choice_bias`: the layer's correction bias of a sigmoid router
/// (`Scoring::SigmoidGrouped`), `None` for zeros.
pub fn moe_forward(
    model: &ModelConfig,
    layer: usize,
    router_w: &[f32],
    choice_bias: Option<&[f32]>,
    x: &[f32],
    t: usize,
    runner: &mut dyn ExpertRunner,
    kernels: &dyn DenseKernels,
) -> Result<(Vec<f32>, MoeSaved), EngineError> {
    let (d, k, e) = (model.d_model, model.top_k, model.experts);
    let mut s = MoeSaved::default();
    {
        let _span = kernels.host_span("router");
        let mut logits = vec![0.0f32; t * e];
        kernels
            .narrow_kernels()
            .forward(&mut logits, x, router_w, t, d, e)?;
        route_logits(&model.router(), &mut s.routing, &logits, choice_bias, t);
        s.perm = Permutation::from_routing(&s.routing.experts, model.experts);
        s.expert_out = runner.take_buffer(t * k * d);
    }
    runner.forward_layer(layer, &s.perm, x, &mut s.expert_out)?;
    let _span = kernels.host_span("combine");
    let mut y = runner.take_buffer(t * d); // the combine writes it whole
    let (out, position, weights) = (&s.expert_out, &s.perm.position, &s.routing.weights);
    combine_forward(&mut y, out, position, weights, t, k, d);
    Ok((y, s))
}

/// One MoE layer, backward: from dy (T, D), accumulates dx (T, D) and the
/// router's gradient; the experts' gradients go through the runner.
/// `daux` and `dz` are the loss coefficients times the micro-batch share.
pub fn moe_backward(
    model: &ModelConfig,
    layer: usize,
    router_w: &[f32],
    router_grad: &mut [f32],
    dx: &mut [f32],
    dy: &[f32],
    x: &[f32],
    s: &MoeSaved,
    t: usize,
    daux: f32,
    dz: f32,
    runner: &mut dyn ExpertRunner,
    last_micro_batch: bool,
    kernels: &dyn DenseKernels,
) -> Result<(), EngineError> {
    let (d, k, e) = (model.d_model, model.top_k, model.experts);
    let span = kernels.host_span("combine backward");
    let mut dweights = vec![0.0f32; t * k];
    combine_backward_weights(&mut dweights, dy, &s.expert_out, &s.perm.position, t, k, d);
    drop(span);
    let dout = AssignmentGrads {
        dy,
        weights: &s.routing.weights,
        k,
        d,
    };
    let mut dxa = runner.take_buffer(t * k * d);
    runner.backward_layer(layer, &s.perm, x, dout, &mut dxa, last_micro_batch)?;
    let _span = kernels.host_span("gather backward and router backward");
    gather_backward(dx, &dxa, &s.perm.position, t, k, d);
    runner.give_buffer(dxa);
    let dlogits = router_logits_grad(&model.router(), &dweights, daux, dz, &s.routing, t);
    let narrow = kernels.narrow_kernels();
    narrow.backward(dx, router_grad, &dlogits, x, router_w, t, d, e)
}

/// What a layer of the plain stack keeps for its backward.
struct StackSaved {
    h_in: Vec<f32>,
    normed: Vec<f32>,
    inv_rms: Vec<f32>,
    moe: MoeSaved,
}

/// The plain stack's forward up to the head input, and each layer's saved
/// state; (aux, z) summed over layers.
fn stack_forward(
    model: &ModelConfig,
    dense: &[f32],
    batch: &Batch,
    runner: &mut dyn ExpertRunner,
) -> Result<(Vec<f32>, Vec<StackSaved>, f32, f32), EngineError> {
    let (t, d) = (batch.tokens(), model.d_model);
    let mut saved = Vec::with_capacity(model.layers);
    let mut h = runner.take_buffer(t * d);
    crate::parallel::copy_into(&mut h, &batch.inputs);
    let (mut aux_sum, mut z_sum) = (0.0f32, 0.0f32);
    for l in 0..model.layers {
        let mut normed = runner.take_buffer(t * d); // the norm writes it whole
        let mut inv_rms = vec![0.0; t];
        let g = &dense[model.norm_range(l)];
        rmsnorm_forward(&mut normed, &mut inv_rms, &h, g, t, d, model.rms_eps);
        let router_w = &dense[model.router_range(l)];
        // The plain stack's router stays plain loops: the reference it is
        // held to bit for bit computes the same.
        let (y, moe) = moe_forward(model, l, router_w, None, &normed, t, runner, &PlainKernels)?;
        // The residual: this layer's input is kept for its backward, and
        // the next layer's is written beside it (the add writes it whole).
        let h_in = std::mem::replace(&mut h, runner.take_buffer(t * d));
        crate::parallel::add_into(&mut h, &h_in, &y);
        runner.give_buffer(y);
        aux_sum += moe.routing.aux_loss;
        z_sum += moe.routing.z_loss;
        saved.push(StackSaved {
            h_in,
            normed,
            inv_rms,
            moe,
        });
    }
    Ok((h, saved, aux_sum, z_sum))
}

/// The plain stack: L layers of `h ← h + MoE(RMSNorm(h))`, a linear head
/// and cross-entropy over `classes`.
impl Network for ModelConfig {
    type Batch = Batch;

    fn moe(&self) -> &ModelConfig {
        self
    }

    fn dense_params(&self) -> usize {
        ModelConfig::dense_params(self)
    }

    fn init_dense(&self) -> Vec<f32> {
        ModelConfig::init_dense(self)
    }

    fn validate_batch(&self, batch: &Batch) -> Result<(), EngineError> {
        batch.validate(self)
    }

    fn batch_tokens(&self, batch: &Batch) -> usize {
        batch.tokens()
    }

    fn split_batch(&self, batch: &Batch, n: usize) -> Vec<Batch> {
        batch.split(n, self.d_model)
    }

    fn forward_backward(
        &self,
        dense: &[f32],
        dense_grad: &mut [f32],
        batch: &Batch,
        tokens_total: usize,
        micro_batches: usize,
        last_micro_batch: bool,
        runner: &mut dyn ExpertRunner,
        kernels: &dyn DenseKernels,
    ) -> Result<Losses, EngineError> {
        forward_backward(
            self,
            dense,
            dense_grad,
            batch,
            tokens_total,
            micro_batches,
            last_micro_batch,
            runner,
            kernels,
        )
    }

    fn forward_eval(
        &self,
        dense: &[f32],
        batch: &Batch,
        runner: &mut dyn ExpertRunner,
        kernels: &dyn DenseKernels,
    ) -> Result<Evaluation, EngineError> {
        let (t, d, v) = (batch.tokens(), self.d_model, self.classes);
        let (h, saved, aux_loss, _) = stack_forward(self, dense, batch, runner)?;
        let mut logits = vec![0.0f32; t * v];
        kernels.forward(&mut logits, &h, &dense[self.head_range()], t, d, v)?;
        runner.give_buffer(h);
        for s in saved {
            for buf in [s.h_in, s.normed, s.moe.expert_out] {
                runner.give_buffer(buf);
            }
        }
        let loss = cross_entropy_loss(&logits, &batch.targets, v, t);
        Ok(Evaluation {
            logits,
            targets: batch.targets.clone(),
            width: v,
            loss,
            aux_loss,
        })
    }
}

/// Forward, loss and backward of one micro-batch through the plain stack.
/// `dense_grad` accumulates; `tokens_total` and `micro_batches` scale the
/// losses so micro-batches add up to the full batch.
pub fn forward_backward(
    model: &ModelConfig,
    dense: &[f32],
    dense_grad: &mut [f32],
    batch: &Batch,
    tokens_total: usize,
    micro_batches: usize,
    last_micro_batch: bool,
    runner: &mut dyn ExpertRunner,
    kernels: &dyn DenseKernels,
) -> Result<Losses, EngineError> {
    let (t, d, v) = (batch.tokens(), model.d_model, model.classes);
    let (h, mut saved, aux_sum, z_sum) = stack_forward(model, dense, batch, runner)?;
    let head = &dense[model.head_range()];
    let mut logits = vec![0.0f32; t * v];
    kernels.forward(&mut logits, &h, head, t, d, v)?;
    let mut dlogits = vec![0.0f32; t * v];
    let ce = kernels.cross_entropy(&mut dlogits, &logits, &batch.targets, v, tokens_total)?;
    let share = 1.0 / micro_batches as f32;
    let total = ce + share * (model.aux_loss_coef * aux_sum + model.z_loss_coef * z_sum);
    if !total.is_finite() {
        return Err(EngineError::NonFiniteLoss { loss: total });
    }
    let mut dh = runner.take_buffer(t * d);
    crate::parallel::fill_zeros(&mut dh);
    let head_grad = &mut dense_grad[model.head_range()];
    kernels.backward(&mut dh, head_grad, &dlogits, &h, head, t, d, v)?;
    runner.give_buffer(h);
    let daux = model.aux_loss_coef * share;
    let dz = model.z_loss_coef * share;
    for l in (0..model.layers).rev() {
        let s = &mut saved[l];
        let mut dnormed = runner.take_buffer(t * d);
        crate::parallel::fill_zeros(&mut dnormed); // the backward adds into it
        let wr = &dense[model.router_range(l)];
        moe_backward(
            model,
            l,
            wr,
            &mut dense_grad[model.router_range(l)],
            &mut dnormed,
            &dh,
            &s.normed,
            &s.moe,
            t,
            daux,
            dz,
            runner,
            last_micro_batch,
            &PlainKernels,
        )?;
        runner.give_buffer(std::mem::take(&mut s.moe.expert_out));
        let g = &dense[model.norm_range(l)];
        let mut dh_in = runner.take_buffer(t * d);
        crate::parallel::copy_into(&mut dh_in, &dh); // the residual path
        let norm_grad = &mut dense_grad[model.norm_range(l)];
        rmsnorm_backward(
            &mut dh_in, norm_grad, &dnormed, &s.h_in, g, &s.inv_rms, t, d,
        );
        for buf in [
            std::mem::replace(&mut dh, dh_in),
            dnormed,
            std::mem::take(&mut s.normed),
            std::mem::take(&mut s.h_in),
        ] {
            runner.give_buffer(buf);
        }
    }
    runner.give_buffer(dh);
    Ok(Losses {
        ce,
        aux: aux_sum,
        z: z_sum,
        total,
    })
}
