//! The MoE language model of every family strata trains, as a
//! [`Network`]: token embedding; per layer `h ← h + Attn(RMSNorm(h))`,
//! `h ← h + MoE(RMSNorm(h))` with causal grouped-query attention and rotary
//! embeddings (q, k and v as each family forms them: `qkv`), the MoE
//! block or a dense layer's MLP (`ffn`); final RMSNorm; LM head (tied to the embedding or not);
//! next-token cross-entropy. The dense params are one flat vector whose
//! tensors carry their Hugging Face names (see [`MoeLm::tensors`]).

// Numeric code takes its shapes as arguments, as llm.c does.
#![allow(clippy::too_many_arguments)]

mod passes;

use std::ops::Range;

use super::attention_half::AttentionRanges;
use super::config::{LmConfig, QkNorm};
use super::ffn::FfnRanges;
use super::groups::TensorGroup;
use super::mlp::MlpRanges;
use super::qkv::QkvRanges;
pub use super::token_batch::TokenBatch;
use crate::model::{
    fill_uniform, DenseKernels, Evaluation, ExpertRunner, HostOps, Losses, ModelConfig, Network,
};
use crate::EngineError;
use passes::MicroBatch;

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

/// The dense vector's tensors as they are laid out, one after another.
#[derive(Default)]
struct TensorLayout {
    tensors: Vec<DenseTensor>,
    at: usize,
}

impl TensorLayout {
    /// The next tensor, `name` of `shape`; returns its range.
    fn push(&mut self, name: String, shape: Vec<usize>) -> Range<usize> {
        let n: usize = shape.iter().product();
        let range = self.at..self.at + n;
        self.at += n;
        self.tensors.push(DenseTensor {
            name,
            shape,
            range: range.clone(),
        });
        range
    }

    /// A gated MLP's three projections under `w`, of hidden width `f`.
    fn mlp(&mut self, w: &str, d: usize, f: usize) -> MlpRanges {
        MlpRanges {
            gate: self.push(format!("{w}.gate_proj.weight"), vec![f, d]),
            up: self.push(format!("{w}.up_proj.weight"), vec![f, d]),
            down: self.push(format!("{w}.down_proj.weight"), vec![d, f]),
            scale: None,
        }
    }

    /// Layer `p`'s attention: its norm, q, k, v and o (with their biases
    /// and q/k norms where the family has them).
    fn attention(&mut self, config: &LmConfig, p: &str) -> AttentionRanges {
        let d = config.d_model;
        let (q, kv) = (
            config.heads * config.head_dim,
            config.kv_heads * config.head_dim,
        );
        let (q_norm, k_norm) = match config.qk_norm {
            QkNorm::None => (0, 0),
            QkNorm::PerHead => (config.head_dim, config.head_dim),
            QkNorm::Whole => (q, kv),
        };
        let norm = self.push(format!("{p}.input_layernorm.weight"), vec![d]);
        let wq = self.push(format!("{p}.self_attn.q_proj.weight"), vec![q, d]);
        let wk = self.push(format!("{p}.self_attn.k_proj.weight"), vec![kv, d]);
        let wv = self.push(format!("{p}.self_attn.v_proj.weight"), vec![kv, d]);
        let wo = self.push(format!("{p}.self_attn.o_proj.weight"), vec![d, q]);
        let bias = config.qkv_bias.then(|| {
            [("q", q), ("k", kv), ("v", kv)]
                .map(|(w, n)| self.push(format!("{p}.self_attn.{w}_proj.bias"), vec![n]))
        });
        let qk_norm = (q_norm > 0).then(|| {
            [("q", q_norm), ("k", k_norm)]
                .map(|(w, n)| self.push(format!("{p}.self_attn.{w}_norm.weight"), vec![n]))
        });
        AttentionRanges {
            norm,
            qkv: QkvRanges {
                wq,
                wk,
                wv,
                bias,
                norm: qk_norm,
            },
            wo,
        }
    }

    /// Sparse layer `moe_layer` (named `p`): its router, the router's
    /// correction bias (added to `frozen`) and its shared expert, where the
    /// family has them.
    fn sparse(
        &mut self,
        config: &LmConfig,
        p: &str,
        moe_layer: usize,
        frozen: &mut Vec<Range<usize>>,
    ) -> FfnRanges {
        let (d, e) = (config.d_model, config.experts);
        let moe_block = config.family.moe_block();
        let router = self.push(format!("{p}.{moe_block}.gate.weight"), vec![e, d]);
        let choice_bias = (config.router_bias_params() > 0).then(|| {
            let name = format!("{p}.{moe_block}.gate.e_score_correction_bias");
            let range = self.push(name, vec![e]);
            frozen.push(range.clone());
            range
        });
        let (shared_name, gated) = config.family.shared_expert();
        let fs = config.shared_expert_ff;
        let shared = (fs > 0).then(|| {
            let w = format!("{p}.{moe_block}.{shared_name}");
            let r = self.mlp(&w, d, fs);
            MlpRanges {
                scale: gated.then(|| self.push(format!("{w}_gate.weight"), vec![1, d])),
                ..r
            }
        });
        FfnRanges::Sparse {
            moe_layer,
            router,
            choice_bias,
            shared,
        }
    }
}

impl MoeLm {
    pub fn new(config: LmConfig) -> Result<Self, EngineError> {
        config.validate()?;
        let (d, v) = (config.d_model, config.vocab);
        let mut lay = TensorLayout::default();
        let embed = lay.push("model.embed_tokens.weight".into(), vec![v, d]);
        let mut layers = Vec::with_capacity(config.layers);
        let mut sparse = 0;
        let mut frozen = Vec::new();
        for l in 0..config.layers {
            let p = format!("model.layers.{l}");
            let attention = lay.attention(&config, &p);
            let moe_norm = lay.push(format!("{p}.post_attention_layernorm.weight"), vec![d]);
            let ffn = if config.dense_layers.binary_search(&l).is_ok() {
                FfnRanges::Dense(lay.mlp(&format!("{p}.mlp"), d, config.dense_ff))
            } else {
                sparse += 1;
                lay.sparse(&config, &p, sparse - 1, &mut frozen)
            };
            layers.push(LayerRanges {
                attention,
                moe_norm,
                ffn,
            });
        }
        let final_norm = lay.push("model.norm.weight".into(), vec![d]);
        let head = if config.tie_embeddings {
            embed.clone()
        } else {
            lay.push("lm_head.weight".into(), vec![v, d])
        };
        debug_assert_eq!(lay.at, config.dense_params());
        Ok(Self {
            moe: config.moe(),
            config,
            tensors: lay.tensors,
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
