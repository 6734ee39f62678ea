//! The language model's passes: forward (each layer's state kept for the
//! backward), forward and backward of a micro-batch, and the evaluations,
//! on any [`DenseOps`].

// Numeric code takes its shapes as arguments, as llm.c does.
#![allow(clippy::too_many_arguments)]

use super::MoeLm;
use crate::lm::attention_half::{self, AttentionSaved};
use crate::lm::config::AuxLoss;
use crate::lm::ffn::{self, FfnGrads, FfnSaved};
use crate::lm::token_batch::TokenBatch;
use crate::math::attention::{AttnShape, RopeTable};
use crate::math::{cross_entropy_loss, Scoring, IGNORED_TARGET};
use crate::model::{DenseOps, Evaluation, ExpertRunner, HeadShape, Losses, MoeRouting, TokenIds};
use crate::EngineError;

/// What one layer's forward keeps for its backward, in buffers of a
/// [`DenseOps`] (`B`; `M` its MoE blocks' saved state).
struct LayerSaved<B, M> {
    attention: AttentionSaved<B>,
    h_mid: B,
    n2: B,
    inv2: B,
    ffn: FfnSaved<B, M>,
}

/// One micro-batch of a step, as [`Network::forward_backward`] is given it.
#[derive(Clone, Copy)]
pub(super) struct MicroBatch<'a> {
    pub batch: &'a TokenBatch,
    pub tokens_total: usize,
    pub micro_batches: usize,
    pub last_micro_batch: bool,
}

/// What every layer's backward reads alike.
struct LayerBackward<'a> {
    shape: &'a AttnShape,
    /// Each token's document start, where documents are packed apart.
    starts: Option<&'a [u32]>,
    /// Tokens in the micro-batch.
    tokens: usize,
    rope: &'a RopeTable<f32>,
    step: MicroBatch<'a>,
}

struct Forward<B, M, I> {
    /// The batch's inputs and targets, where the operations read them.
    ids: TokenIds<I>,
    layers: Vec<LayerSaved<B, M>>,
    h: B,
    /// The final norm's output, the head's input.
    nf: B,
    invf: B,
    /// The rotary table the forward used (the backward's too).
    rope: RopeTable<f32>,
    aux: f32,
    z: f32,
}

/// The forward's saved state in the buffers of operations `O`.
type ForwardOn<O> =
    Forward<<O as DenseOps>::Buf, <O as DenseOps>::MoeSaved, <O as DenseOps>::DeviceIds>;

impl MoeLm {
    fn attn_shape(&self, seqs: usize, seq_len: usize) -> AttnShape {
        AttnShape {
            seqs,
            seq_len,
            heads: self.config.heads,
            kv_heads: self.config.kv_heads,
            head_dim: self.config.head_dim,
        }
    }

    fn forward<O: DenseOps>(
        &self,
        ops: &O,
        dense: &[f32],
        batch: &TokenBatch,
        runner: &mut dyn ExpertRunner,
    ) -> Result<ForwardOn<O>, EngineError> {
        let c = &self.config;
        let kernels = ops.kernels();
        let d = c.d_model;
        let ids = ops.token_ids(batch.rows())?;
        let t = ids.inputs.len();
        let shape = self.attn_shape(batch.sequences(), batch.seq_len);
        let rope =
            RopeTable::<f32>::partial(batch.seq_len, c.head_dim, c.rotary_dim(), c.rope_theta);
        let span = kernels.host_span("embedding");
        let mut h = ops.embedding_forward(&dense[self.embed.clone()], &ids, d)?;
        drop(span);
        let mut layers = Vec::with_capacity(c.layers);
        let (mut aux, mut z) = (0.0f32, 0.0f32);
        // Where each token's document starts, for every layer's attention.
        let starts = batch.attention_starts();
        for r in &self.layers {
            let attention = attention_half::forward(
                ops,
                c,
                dense,
                &r.attention,
                &mut h,
                starts.as_deref(),
                &shape,
                &rope,
            )?;
            let mut n2 = ops.zeros(t * d)?;
            let mut inv2 = ops.zeros(t)?;
            let span = kernels.host_span("rmsnorm");
            let g2 = &dense[r.moe_norm.clone()];
            ops.rmsnorm_forward(&mut n2, &mut inv2, &h, g2, t, d, c.rms_eps)?;
            let h_mid = ops.duplicate(&h)?;
            drop(span);
            let ffn = ffn::forward(ops, c, &self.moe, &r.ffn, dense, &n2, &mut h, runner)?;
            if let FfnSaved::Sparse { moe, .. } = &ffn {
                aux += moe.routing().aux_loss;
                z += moe.routing().z_loss;
            }
            layers.push(LayerSaved {
                attention,
                h_mid,
                n2,
                inv2,
                ffn,
            });
        }
        if c.scoring != Scoring::Softmax {
            // GLM-4.5 has no load-balancing loss: its correction bias
            // balances the experts.
            aux = 0.0;
        } else if c.aux_loss == AuxLoss::AllLayers {
            aux = all_layers_aux(ops, &mut layers, c.experts, t)?;
        }
        let span = kernels.host_span("rmsnorm");
        let mut nf = ops.zeros(t * d)?;
        let mut invf = ops.zeros(t)?;
        let gf = &dense[self.final_norm.clone()];
        ops.rmsnorm_forward(&mut nf, &mut invf, &h, gf, t, d, c.rms_eps)?;
        drop(span);
        Ok(Forward {
            ids,
            layers,
            h,
            nf,
            invf,
            rope,
            aux,
            z,
        })
    }

    /// [`Network::forward_backward`] with the dense layers' activations
    /// and operations in `ops`.
    pub(super) fn forward_backward_on<O: DenseOps>(
        &self,
        ops: &O,
        dense: &[f32],
        dense_grad: &mut [f32],
        step: MicroBatch<'_>,
        runner: &mut dyn ExpertRunner,
    ) -> Result<Losses, EngineError> {
        let c = &self.config;
        let batch = step.batch;
        let mut f = self.forward(ops, dense, batch, runner)?;
        let (ce, mut dh) = self.head_backward(ops, dense, dense_grad, &f, step)?;
        let share = 1.0 / step.micro_batches as f32;
        let total = ce + share * (c.aux_loss_coef * f.aux + c.z_loss_coef * f.z);
        if !total.is_finite() {
            return Err(EngineError::NonFiniteLoss { loss: total });
        }
        if step.last_micro_batch {
            // The final norm and an untied head, laid out last.
            runner.dense_grad_final(dense_grad, self.final_norm.start..dense_grad.len());
        }
        let shape = self.attn_shape(batch.sequences(), batch.seq_len);
        let starts = batch.attention_starts();
        let context = LayerBackward {
            shape: &shape,
            starts: starts.as_deref(),
            tokens: f.ids.inputs.len(),
            rope: &f.rope,
            step,
        };
        for l in (0..self.layers.len()).rev() {
            let saved = &mut f.layers[l];
            self.layer_backward(
                ops,
                (dense, dense_grad),
                l,
                saved,
                &mut dh,
                &context,
                runner,
            )?;
        }
        let span = ops.kernels().host_span("embedding backward");
        let d = c.d_model;
        ops.embedding_backward(&mut dense_grad[self.embed.clone()], &dh, &f.ids, d)?;
        drop(span);
        Ok(Losses {
            ce,
            aux: f.aux,
            z: f.z,
            total,
        })
    }

    /// The head, its loss and its backward in one (a GPU keeps the logits
    /// on the device, a chunk of rows at a time), then the final norm's
    /// backward: the loss and d h.
    fn head_backward<O: DenseOps>(
        &self,
        ops: &O,
        dense: &[f32],
        dense_grad: &mut [f32],
        f: &ForwardOn<O>,
        step: MicroBatch<'_>,
    ) -> Result<(f32, O::Buf), EngineError> {
        let c = &self.config;
        let (d, v) = (c.d_model, c.vocab);
        let t = f.ids.inputs.len();
        let mut dnf = ops.zeros(t * d)?;
        let ce = ops.head_loss(
            &mut dnf,
            &mut dense_grad[self.head.clone()],
            &f.nf,
            &dense[self.head.clone()],
            &f.ids,
            HeadShape {
                t,
                d,
                v,
                denominator: step.tokens_total,
            },
        )?;
        let span = ops.kernels().host_span("rmsnorm backward");
        let mut dh = ops.zeros(t * d)?;
        ops.rmsnorm_backward(
            &mut dh,
            &mut dense_grad[self.final_norm.clone()],
            &dnf,
            &f.h,
            &dense[self.final_norm.clone()],
            &f.invf,
            t,
            d,
        )?;
        drop(span);
        Ok((ce, dh))
    }

    /// Layer `l`'s backward from `dh` (d of its output, then of its
    /// input): the FFN half, its norm, the attention half; its MoE
    /// block's saved state released, and its gradients handed on after
    /// the step's last micro-batch.
    fn layer_backward<O: DenseOps>(
        &self,
        ops: &O,
        (dense, dense_grad): (&[f32], &mut [f32]),
        l: usize,
        s: &mut LayerSaved<O::Buf, O::MoeSaved>,
        dh: &mut O::Buf,
        context: &LayerBackward<'_>,
        runner: &mut dyn ExpertRunner,
    ) -> Result<(), EngineError> {
        let c = &self.config;
        let r = &self.layers[l];
        let step = context.step;
        let share = 1.0 / step.micro_batches as f32;
        let t = context.tokens;
        let d = c.d_model;
        // FFN half: h = h_mid + FFN(RMSNorm(h_mid)).
        let mut dn2 = ops.zeros(t * d)?;
        let grads = FfnGrads {
            dense_grad: &mut dense_grad[..],
            dn: &mut dn2,
            daux: c.aux_loss_coef * share,
            dz: c.z_loss_coef * share,
            last_micro_batch: step.last_micro_batch,
        };
        let ffn = (&r.ffn, &s.ffn);
        ffn::backward(ops, c, &self.moe, ffn, dense, (&s.n2, &*dh), grads, runner)?;
        let span = ops.kernels().host_span("rmsnorm backward");
        ops.rmsnorm_backward(
            dh,
            &mut dense_grad[r.moe_norm.clone()],
            &dn2,
            &s.h_mid,
            &dense[r.moe_norm.clone()],
            &s.inv2,
            t,
            d,
        )?;
        drop(span);
        attention_half::backward(
            ops,
            c,
            (dense, dense_grad),
            &r.attention,
            &s.attention,
            dh,
            context.starts,
            context.shape,
            context.rope,
        )?;
        if let Some(moe) = s.ffn.moe_mut() {
            ops.moe_release(moe, runner);
        }
        if step.last_micro_batch {
            runner.dense_grad_final(dense_grad, self.layer_span(l));
        }
        Ok(())
    }

    /// [`Network::forward_eval`] with the dense layers' activations and
    /// operations in `ops`.
    pub(super) fn evaluate_on<O: DenseOps>(
        &self,
        ops: &O,
        dense: &[f32],
        batch: &TokenBatch,
        runner: &mut dyn ExpertRunner,
    ) -> Result<Evaluation, EngineError> {
        let f = self.forward(ops, dense, batch, runner)?;
        let (d, v) = (self.config.d_model, self.config.vocab);
        let t = f.ids.targets.len();
        let mut logits = vec![0.0f32; t * v];
        let nf = ops.read(&f.nf)?;
        ops.kernels()
            .forward(&mut logits, &nf, &dense[self.head.clone()], t, d, v)?;
        let targets = f.ids.targets;
        let counted = targets.iter().filter(|&&x| x != IGNORED_TARGET).count();
        let loss = cross_entropy_loss(&logits, &targets, v, counted.max(1));
        Ok(Evaluation {
            logits,
            targets,
            width: v,
            loss,
            aux_loss: f.aux,
        })
    }

    /// [`Network::forward_loss`] with the dense layers' activations and
    /// operations in `ops`: the head's loss a block of rows at a time, so
    /// that (T × V) logits never exist whole.
    pub(super) fn loss_on<O: DenseOps>(
        &self,
        ops: &O,
        dense: &[f32],
        batch: &TokenBatch,
        runner: &mut dyn ExpertRunner,
    ) -> Result<f32, EngineError> {
        let f = self.forward(ops, dense, batch, runner)?;
        let (d, v) = (self.config.d_model, self.config.vocab);
        let t = f.ids.targets.len();
        let counted = f
            .ids
            .targets
            .iter()
            .filter(|&&x| x != IGNORED_TARGET)
            .count();
        let s = HeadShape {
            t,
            d,
            v,
            denominator: counted.max(1),
        };
        ops.head_loss_forward(&f.nf, &dense[self.head.clone()], &f.ids, s)
    }
}

/// transformers' load-balancing loss over every sparse layer's routing at
/// once: E · Σ_e (C_e / N) · (S_e / N), with C_e the assignments expert e
/// took and S_e its router probabilities summed over all L sparse layers
/// and T tokens, N = L·T. Sets each layer's `aux_grad` to ∂aux/∂p =
/// E · C_e / N², the same for every layer and token, and returns the loss.
/// Sums in f64 (`ops` sums each layer's probabilities where they are).
fn all_layers_aux<O: DenseOps>(
    ops: &O,
    layers: &mut [LayerSaved<O::Buf, O::MoeSaved>],
    experts: usize,
    t: usize,
) -> Result<f32, EngineError> {
    let mut sparse: Vec<_> = layers.iter_mut().filter_map(|l| l.ffn.moe_mut()).collect();
    let n = (sparse.len() * t) as f64;
    let mut assigned = vec![0.0f64; experts];
    for moe in sparse.iter() {
        for (e, &count) in moe.routing().counts.iter().enumerate() {
            assigned[e] += count as f64;
        }
    }
    let blocks: Vec<&O::MoeSaved> = sparse.iter().map(|m| &**m).collect();
    let prob = ops.moe_prob_sums(&blocks, experts)?;
    let e = experts as f64;
    let aux = e
        * (0..experts)
            .map(|j| (assigned[j] / n) * (prob[j] / n))
            .sum::<f64>();
    let grad: Vec<f32> = assigned.iter().map(|&c| (e * c / (n * n)) as f32).collect();
    for moe in sparse.iter_mut() {
        moe.routing_mut().aux_grad = Some(grad.clone());
    }
    Ok(aux as f32)
}
