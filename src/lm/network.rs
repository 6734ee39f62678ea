//! The MoE language model of every family strata trains, as a
//! [`Network`]: token embedding; per layer `h ← h + Attn(RMSNorm(h))`,
//! `h ← h + MoE(RMSNorm(h))` with causal grouped-query attention and rotary
//! embeddings (q, k and v as each family forms them: `qkv`), the MoE
//! block or a dense layer's MLP (`ffn`); final RMSNorm; LM head (tied to the embedding or not);
//! next-token cross-entropy. The dense params are one flat vector whose
//! tensors carry their Hugging Face names (see [`MoeLm::tensors`]).

// Numeric code takes its shapes as arguments, as llm.c does.
#![allow(clippy::too_many_arguments)]

use std::ops::Range;

use super::attention_half::{self, AttentionRanges, AttentionSaved};
use super::config::{AuxLoss, LmConfig, QkNorm};
use super::ffn::{self, FfnGrads, FfnRanges, FfnSaved};
use super::groups::TensorGroup;
use super::mlp::MlpRanges;
use super::qkv::QkvRanges;
pub use super::token_batch::TokenBatch;
use crate::math::attention::{AttnShape, RopeTable};
use crate::math::{cross_entropy_loss, Scoring, IGNORED_TARGET};
use crate::model::{
    fill_uniform, DenseKernels, DenseOps, Evaluation, ExpertRunner, HeadShape, HostOps, Losses,
    ModelConfig, MoeRouting, Network, TokenIds,
};
use crate::EngineError;

/// One dense tensor: its Hugging Face name, shape and place in the vector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DenseTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub range: Range<usize>,
}

/// Where each tensor of one layer is.
#[derive(Clone, Debug)]
struct LayerRanges {
    attention: AttentionRanges,
    moe_norm: Range<usize>,
    ffn: FfnRanges,
}

/// The MoE language model (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE or GLM-4.5, by its config's
/// [`Family`](super::Family)).
#[derive(Clone, Debug)]
pub struct MoeLm {
    config: LmConfig,
    moe: ModelConfig,
    tensors: Vec<DenseTensor>,
    embed: Range<usize>,
    layers: Vec<LayerRanges>,
    final_norm: Range<usize>,
    /// The embedding's range when tied.
    head: Range<usize>,
    /// Dense tensors no optimizer step changes (a sigmoid router's
    /// correction biases), ascending.
    frozen: Vec<Range<usize>>,
}

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
struct MicroBatch<'a> {
    batch: &'a TokenBatch,
    tokens_total: usize,
    micro_batches: usize,
    last_micro_batch: bool,
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
    pub fn new(config: LmConfig) -> Result<Self, EngineError> {
        config.validate()?;
        let (d, v, e) = (config.d_model, config.vocab, config.experts);
        let (q, kv) = (
            config.heads * config.head_dim,
            config.kv_heads * config.head_dim,
        );
        let mut tensors = Vec::new();
        let mut at = 0usize;
        let mut push = |name: String, shape: Vec<usize>| {
            let n: usize = shape.iter().product();
            let range = at..at + n;
            at += n;
            tensors.push(DenseTensor {
                name,
                shape,
                range: range.clone(),
            });
            range
        };
        let embed = push("model.embed_tokens.weight".into(), vec![v, d]);
        let mut layers = Vec::with_capacity(config.layers);
        let moe_block = config.family.moe_block();
        let (q_norm, k_norm) = match config.qk_norm {
            QkNorm::None => (0, 0),
            QkNorm::PerHead => (config.head_dim, config.head_dim),
            QkNorm::Whole => (q, kv),
        };
        let fs = config.shared_expert_ff;
        let mut sparse = 0;
        let mut frozen = Vec::new();
        for l in 0..config.layers {
            let p = format!("model.layers.{l}");
            let attn_norm = push(format!("{p}.input_layernorm.weight"), vec![d]);
            let wq = push(format!("{p}.self_attn.q_proj.weight"), vec![q, d]);
            let wk = push(format!("{p}.self_attn.k_proj.weight"), vec![kv, d]);
            let wv = push(format!("{p}.self_attn.v_proj.weight"), vec![kv, d]);
            let wo = push(format!("{p}.self_attn.o_proj.weight"), vec![d, q]);
            let bias = config.qkv_bias.then(|| {
                [("q", q), ("k", kv), ("v", kv)]
                    .map(|(w, n)| push(format!("{p}.self_attn.{w}_proj.bias"), vec![n]))
            });
            let norm = (q_norm > 0).then(|| {
                [("q", q_norm), ("k", k_norm)]
                    .map(|(w, n)| push(format!("{p}.self_attn.{w}_norm.weight"), vec![n]))
            });
            let moe_norm = push(format!("{p}.post_attention_layernorm.weight"), vec![d]);
            let mlp =
                |push: &mut dyn FnMut(String, Vec<usize>) -> Range<usize>, w: &str, f| MlpRanges {
                    gate: push(format!("{w}.gate_proj.weight"), vec![f, d]),
                    up: push(format!("{w}.up_proj.weight"), vec![f, d]),
                    down: push(format!("{w}.down_proj.weight"), vec![d, f]),
                    scale: None,
                };
            let ffn = if config.dense_layers.binary_search(&l).is_ok() {
                FfnRanges::Dense(mlp(&mut push, &format!("{p}.mlp"), config.dense_ff))
            } else {
                let router = push(format!("{p}.{moe_block}.gate.weight"), vec![e, d]);
                let choice_bias = (config.router_bias_params() > 0).then(|| {
                    let name = format!("{p}.{moe_block}.gate.e_score_correction_bias");
                    let range = push(name, vec![e]);
                    frozen.push(range.clone());
                    range
                });
                let (shared_name, gated) = config.family.shared_expert();
                let shared = (fs > 0).then(|| {
                    let w = format!("{p}.{moe_block}.{shared_name}");
                    let r = mlp(&mut push, &w, fs);
                    MlpRanges {
                        scale: gated.then(|| push(format!("{w}_gate.weight"), vec![1, d])),
                        ..r
                    }
                });
                let moe_layer = sparse;
                sparse += 1;
                FfnRanges::Sparse {
                    moe_layer,
                    router,
                    choice_bias,
                    shared,
                }
            };
            layers.push(LayerRanges {
                attention: AttentionRanges {
                    norm: attn_norm,
                    qkv: QkvRanges {
                        wq,
                        wk,
                        wv,
                        bias,
                        norm,
                    },
                    wo,
                },
                moe_norm,
                ffn,
            });
        }
        let final_norm = push("model.norm.weight".into(), vec![d]);
        let head = if config.tie_embeddings {
            embed.clone()
        } else {
            push("lm_head.weight".into(), vec![v, d])
        };
        debug_assert_eq!(at, config.dense_params());
        Ok(Self {
            moe: config.moe(),
            config,
            tensors,
            embed,
            layers,
            final_norm,
            head,
            frozen,
        })
    }

    pub fn config(&self) -> &LmConfig {
        &self.config
    }

    /// Where layer `l`'s dense tensors lie in the dense vector: from its
    /// first (the attention's norm) to the next layer's first, or to the
    /// final norm.
    fn layer_span(&self, l: usize) -> Range<usize> {
        let end = match self.layers.get(l + 1) {
            Some(next) => next.attention.norm.start,
            None => self.final_norm.start,
        };
        self.layers[l].attention.norm.start..end
    }

    /// The model with only the dense tensors of `groups` trainable: the
    /// others, and every buffer, are frozen (`Network::frozen_dense`;
    /// whether the experts train is the engine's
    /// `EngineConfig::train_experts`).
    ///
    /// ```
    /// use strata::lm::{LmConfig, MoeLm, TensorGroup};
    /// use strata::model::Network;
    ///
    /// let lm = MoeLm::new(LmConfig::preset("tiny").unwrap()).unwrap();
    /// let lm = lm.with_trained(&[TensorGroup::Experts, TensorGroup::Router]);
    /// let frozen: usize = lm.frozen_dense().iter().map(|r| r.len()).sum();
    /// let routers = 2 * 8 * 64; // layers × experts × d_model
    /// assert_eq!(frozen, lm.config().dense_params() - routers);
    /// ```
    pub fn with_trained(mut self, groups: &[TensorGroup]) -> Self {
        self.frozen = self
            .tensors
            .iter()
            .filter(|t| TensorGroup::of_dense(&t.name).is_none_or(|g| !groups.contains(&g)))
            .map(|t| t.range.clone())
            .collect();
        self
    }

    /// The dense tensors, in vector order, with their Hugging Face names.
    pub fn tensors(&self) -> &[DenseTensor] {
        &self.tensors
    }

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
    fn forward_backward_on<O: DenseOps>(
        &self,
        ops: &O,
        dense: &[f32],
        dense_grad: &mut [f32],
        step: MicroBatch<'_>,
        runner: &mut dyn ExpertRunner,
    ) -> Result<Losses, EngineError> {
        let c = &self.config;
        let kernels = ops.kernels();
        let (d, v) = (c.d_model, c.vocab);
        let batch = step.batch;
        let shape = self.attn_shape(batch.sequences(), batch.seq_len);
        let mut f = self.forward(ops, dense, batch, runner)?;
        let t = f.ids.inputs.len();
        // The head, its loss and its backward in one (a GPU keeps the
        // logits on the device, a chunk of rows at a time).
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
        let share = 1.0 / step.micro_batches as f32;
        let total = ce + share * (c.aux_loss_coef * f.aux + c.z_loss_coef * f.z);
        if !total.is_finite() {
            return Err(EngineError::NonFiniteLoss { loss: total });
        }
        // Final norm.
        let span = kernels.host_span("rmsnorm backward");
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
        drop(dnf);
        if step.last_micro_batch {
            // The final norm and an untied head, laid out last.
            runner.dense_grad_final(dense_grad, self.final_norm.start..dense_grad.len());
        }
        let daux = c.aux_loss_coef * share;
        let dz = c.z_loss_coef * share;
        let starts = batch.attention_starts();
        for (l, r) in self.layers.iter().enumerate().rev() {
            let s = &f.layers[l];
            // FFN half: h = h_mid + FFN(RMSNorm(h_mid)).
            let mut dn2 = ops.zeros(t * d)?;
            let grads = FfnGrads {
                dense_grad: &mut dense_grad[..],
                dn: &mut dn2,
                daux,
                dz,
                last_micro_batch: step.last_micro_batch,
            };
            let ffn = (&r.ffn, &s.ffn);
            ffn::backward(ops, c, &self.moe, ffn, dense, (&s.n2, &dh), grads, runner)?;
            let span = kernels.host_span("rmsnorm backward");
            ops.rmsnorm_backward(
                &mut dh,
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
                &mut dh,
                starts.as_deref(),
                &shape,
                &f.rope,
            )?;
            if let Some(moe) = f.layers[l].ffn.moe_mut() {
                ops.moe_release(moe, runner);
            }
            if step.last_micro_batch {
                runner.dense_grad_final(dense_grad, self.layer_span(l));
            }
        }
        let span = kernels.host_span("embedding backward");
        ops.embedding_backward(&mut dense_grad[self.embed.clone()], &dh, &f.ids, d)?;
        drop(span);
        Ok(Losses {
            ce,
            aux: f.aux,
            z: f.z,
            total,
        })
    }

    /// [`Network::forward_eval`] with the dense layers' activations and
    /// operations in `ops`.
    fn evaluate_on<O: DenseOps>(
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
    fn loss_on<O: DenseOps>(
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

    /// The initial dense params: norm gains 1; embedding, projections,
    /// routers and head uniform(±1/√fan_in), each from its own stream;
    /// buffers (correction biases) 0.
    pub fn init_params(&self) -> Vec<f32> {
        let mut p = vec![0.0f32; self.config.dense_params()];
        for (i, t) in self.tensors.iter().enumerate() {
            if TensorGroup::of_dense(&t.name).is_none() {
                continue; // a buffer (a correction bias)
            } else if t.shape.len() == 1 {
                p[t.range.clone()].fill(1.0);
            } else {
                let fan_in = t.shape[1] as f32;
                let tag = (5u64 << 56) ^ i as u64;
                fill_uniform(
                    &mut p[t.range.clone()],
                    self.config.seed,
                    tag,
                    fan_in.sqrt().recip(),
                );
            }
        }
        p
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

impl Network for MoeLm {
    type Batch = TokenBatch;

    fn moe(&self) -> &ModelConfig {
        &self.moe
    }

    fn dense_params(&self) -> usize {
        self.config.dense_params()
    }

    fn init_dense(&self) -> Vec<f32> {
        self.init_params()
    }

    fn validate_batch(&self, batch: &TokenBatch) -> Result<(), EngineError> {
        let s = batch.seq_len;
        if s == 0 || batch.tokens.is_empty() {
            return Err(EngineError::Batch("the batch is empty".into()));
        }
        if s > self.config.max_seq {
            return Err(EngineError::Batch(format!(
                "sequence length {s} exceeds the model's max_position_embeddings {}",
                self.config.max_seq
            )));
        }
        if !batch.tokens.len().is_multiple_of(s + 1) {
            return Err(EngineError::Batch(format!(
                "{} tokens do not make whole sequences of seq_len + 1 = {}",
                batch.tokens.len(),
                s + 1
            )));
        }
        if let Some(&bad) = batch
            .tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab)
        {
            return Err(EngineError::Batch(format!(
                "token id {bad} is out of range (the vocabulary has {} tokens)",
                self.config.vocab
            )));
        }
        for (what, flags) in [
            ("loss mask", &batch.loss_mask),
            ("document starts", &batch.doc_starts),
        ] {
            if let Some(flags) = flags.as_ref().filter(|f| f.len() != batch.tokens.len()) {
                return Err(EngineError::Batch(format!(
                    "the {what} has {} entries for {} tokens",
                    flags.len(),
                    batch.tokens.len()
                )));
            }
        }
        Ok(())
    }

    fn batch_tokens(&self, batch: &TokenBatch) -> usize {
        batch.loss_tokens()
    }

    fn processed_tokens(&self, batch: &TokenBatch) -> usize {
        batch.sequences() * batch.seq_len
    }

    fn frozen_dense(&self) -> Vec<Range<usize>> {
        self.frozen.clone()
    }

    fn split_batch(&self, batch: &TokenBatch, n: usize) -> Vec<TokenBatch> {
        let (b, row) = (batch.sequences(), batch.seq_len + 1);
        let n = n.clamp(1, b.max(1));
        (0..n)
            .map(|i| {
                let rows = i * b / n * row..(i + 1) * b / n * row;
                TokenBatch {
                    seq_len: batch.seq_len,
                    tokens: batch.tokens[rows.clone()].to_vec(),
                    loss_mask: batch.loss_mask.as_ref().map(|m| m[rows.clone()].to_vec()),
                    doc_starts: batch.doc_starts.as_ref().map(|m| m[rows].to_vec()),
                }
            })
            .collect()
    }

    fn forward_backward(
        &self,
        dense: &[f32],
        dense_grad: &mut [f32],
        batch: &TokenBatch,
        tokens_total: usize,
        micro_batches: usize,
        last_micro_batch: bool,
        runner: &mut dyn ExpertRunner,
        kernels: &dyn DenseKernels,
    ) -> Result<Losses, EngineError> {
        let step = MicroBatch {
            batch,
            tokens_total,
            micro_batches,
            last_micro_batch,
        };
        #[cfg(feature = "cuda")]
        if let Some(gpu) = kernels.cuda() {
            let ops = crate::backend::cuda::CudaOps::new(gpu, kernels)?;
            return self.forward_backward_on(&ops, dense, dense_grad, step, runner);
        }
        self.forward_backward_on(&HostOps::new(kernels), dense, dense_grad, step, runner)
    }

    fn forward_eval(
        &self,
        dense: &[f32],
        batch: &TokenBatch,
        runner: &mut dyn ExpertRunner,
        kernels: &dyn DenseKernels,
    ) -> Result<Evaluation, EngineError> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = kernels.cuda() {
            let ops = crate::backend::cuda::CudaOps::new(gpu, kernels)?;
            return self.evaluate_on(&ops, dense, batch, runner);
        }
        self.evaluate_on(&HostOps::new(kernels), dense, batch, runner)
    }

    fn forward_loss(
        &self,
        dense: &[f32],
        batch: &TokenBatch,
        runner: &mut dyn ExpertRunner,
        kernels: &dyn DenseKernels,
    ) -> Result<f32, EngineError> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = kernels.cuda() {
            let ops = crate::backend::cuda::CudaOps::new(gpu, kernels)?;
            return self.loss_on(&ops, dense, batch, runner);
        }
        self.loss_on(&HostOps::new(kernels), dense, batch, runner)
    }
}
