//! The language model's shape: its family, presets, validation and
//! parameter counts. Its Hugging Face `config.json` is read and written in
//! `hf_config`.

use super::safetensors_io::{ExpertNames, ExpertNaming};
use crate::math::{ExpertKind, Scoring};
use crate::model::ModelConfig;
use crate::EngineError;

/// A decoder-only MoE transformer of one of the [`Family`]s.
#[derive(Clone, Debug, PartialEq)]
pub struct LmConfig {
    /// Which Hub family the model is: its tensor names, its `config.json`
    /// keys, and whether its attention normalizes q and k.
    pub family: Family,
    pub vocab: usize,
    pub d_model: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The experts' hidden width.
    pub d_ff: usize,
    pub experts: usize,
    pub top_k: usize,
    /// Renormalize the top-k routing weights (Mixtral) or not.
    pub renormalize: bool,
    pub rope_theta: f64,
    pub rms_eps: f64,
    /// The LM head shares the token embedding's matrix.
    pub tie_embeddings: bool,
    /// Longest sequence the model is meant for (`max_position_embeddings`).
    pub max_seq: usize,
    pub aux_loss_coef: f32,
    /// Which load-balancing loss `aux_loss_coef` weighs.
    pub aux_loss: AuxLoss,
    pub z_loss_coef: f32,
    /// OLMoE's `clip_qkv`: q, k and v are clamped to ±this after their
    /// projections (and q, k after their norms).
    pub clip_qkv: Option<f32>,
    /// The q, k and v projections have biases (Qwen2-MoE's `qkv_bias`).
    pub qkv_bias: bool,
    /// The hidden width of a shared expert that every token goes through
    /// beside its routed ones, behind a sigmoid gate (Qwen2-MoE's
    /// `shared_expert_intermediate_size`); 0: none. A dense tensor, it
    /// stays on the device with the other dense params.
    pub shared_expert_ff: usize,
    /// The decoder layers whose MLP is dense, a SwiGLU of width
    /// `dense_ff` in the dense params, with no router and no experts
    /// (Qwen's `mlp_only_layers` and `decoder_sparse_step`), ascending.
    /// The engine's MoE layers are the others, in order
    /// ([`LmConfig::sparse_layers`]).
    pub dense_layers: Vec<usize>,
    /// The dense layers' MLP width (`intermediate_size`); 0 without them.
    pub dense_ff: usize,
    /// How q and k are normalized before RoPE: the family's own, but for
    /// GLM-4.5, whose `use_qk_norm` chooses per-head norms or none.
    pub qk_norm: QkNorm,
    /// The share of each head's dimensions that RoPE rotates (the first
    /// `rotary_dim()`): 1, but for GLM-4.5's `partial_rotary_factor`.
    pub partial_rotary: f64,
    /// How the router scores experts: softmax, or GLM-4.5's sigmoid with a
    /// correction bias and group-limited choice (the bias a dense tensor
    /// no optimizer step changes).
    pub scoring: Scoring,
    /// Seed of the deterministic initialization.
    pub seed: u64,
}

/// The Hub families strata trains. All are decoder-only transformers with
/// RMSNorm, rotary embeddings, grouped-query attention and SwiGLU experts
/// behind a softmax top-k router; they differ in names, in the
/// attention's q/k normalization and biases, in Qwen2-MoE's shared
/// expert, and in whether some layers' MLPs are dense (the Qwen
/// families').
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `mixtral`: `block_sparse_moe.{gate, experts.E.w1/w3/w2}`.
    Mixtral,
    /// `qwen3_moe`: an RMSNorm on each head of q and k before RoPE, an
    /// explicit `head_dim`, the experts' width `moe_intermediate_size`.
    Qwen3Moe,
    /// `olmoe`: an RMSNorm over the whole q and k projections before the
    /// head split, optional `clip_qkv`.
    Olmoe,
    /// `qwen2_moe`: q/k/v biases, and a gated shared expert in every MoE
    /// block.
    Qwen2Moe,
    /// `glm4_moe` (GLM-4.5): a sigmoid router with a correction bias and
    /// group-limited choice, ungated shared experts, dense first layers,
    /// optional q/k/v biases and per-head q/k norms, partial rotary
    /// embeddings.
    Glm4Moe,
}

/// How a family's attention normalizes q and k before RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// One gain of `head_dim` shared by every head (Qwen3-MoE).
    PerHead,
    /// One gain over the whole projection, `heads · head_dim` (OLMoE).
    Whole,
}

impl Family {
    /// transformers' `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Olmoe => "olmoe",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Glm4Moe => "glm4_moe",
        }
    }

    pub(super) fn from_model_type(model_type: &str) -> Option<Self> {
        [
            Family::Mixtral,
            Family::Qwen3Moe,
            Family::Olmoe,
            Family::Qwen2Moe,
            Family::Glm4Moe,
        ]
        .into_iter()
        .find(|f| f.model_type() == model_type)
    }

    /// transformers' class of the causal LM (`architectures`).
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
            Family::Olmoe => "OlmoeForCausalLM",
            Family::Qwen2Moe => "Qwen2MoeForCausalLM",
            Family::Glm4Moe => "Glm4MoeForCausalLM",
        }
    }

    /// The family's q/k normalization (GLM-4.5's by `use_qk_norm`: this
    /// is its `None` default).
    pub fn qk_norm(self) -> QkNorm {
        match self {
            Family::Mixtral | Family::Qwen2Moe | Family::Glm4Moe => QkNorm::None,
            Family::Qwen3Moe => QkNorm::PerHead,
            Family::Olmoe => QkNorm::Whole,
        }
    }

    /// Its shared experts' name inside the MoE block, and whether a
    /// sigmoid gate (`{name}_gate`) scales them (Qwen2-MoE's `shared_expert`)
    /// or not (GLM-4.5's `shared_experts`).
    pub fn shared_expert(self) -> (&'static str, bool) {
        match self {
            Family::Glm4Moe => ("shared_experts", false),
            _ => ("shared_expert", true),
        }
    }

    /// The MoE block's name inside a layer.
    pub fn moe_block(self) -> &'static str {
        match self {
            Family::Mixtral => "block_sparse_moe",
            Family::Qwen3Moe | Family::Olmoe | Family::Qwen2Moe | Family::Glm4Moe => "mlp",
        }
    }

    /// How its checkpoints name the experts' tensors.
    pub fn expert_naming(self) -> ExpertNaming {
        match self {
            Family::Mixtral => ExpertNaming::Mixtral,
            Family::Qwen3Moe | Family::Olmoe | Family::Qwen2Moe | Family::Glm4Moe => {
                ExpertNaming::QwenOlmoe
            }
        }
    }
}

/// The load-balancing loss, E · Σ_e f_e · P_e (f_e: the share of
/// assignments expert e took, P_e: its mean router probability), in one of
/// two forms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuxLoss {
    /// strata's own (its presets): one Switch Transformer loss a layer,
    /// f_e over that layer's T·k assignments, summed over the layers.
    PerLayer,
    /// transformers' (Mixtral, Qwen-MoE, OLMoE): one loss over every sparse
    /// layer's router logits concatenated (cross-layer terms included),
    /// f_e = assignments / (L·T), not divided by k. What a model read from
    /// a Hub `config.json` trains with.
    AllLayers,
}

impl Default for LmConfig {
    fn default() -> Self {
        Self::preset("tiny").expect("the tiny preset exists")
    }
}

/// Names of the presets, smallest first.
pub const PRESETS: &[&str] = &["tiny", "small", "moe-s", "moe-m", "moe-l"];

impl LmConfig {
    /// `tiny` and `small` train on a CPU in minutes; `moe-s`, `moe-m` and
    /// `moe-l` are the ES-MoE paper's MoE-S/M/L (its Table 4, GPT-3
    /// shapes, vocabulary 51 200, top-1, 8 experts by default).
    pub fn preset(name: &str) -> Result<Self, EngineError> {
        let base = LmConfig {
            family: Family::Mixtral,
            vocab: 256,
            d_model: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            d_ff: 128,
            experts: 8,
            top_k: 2,
            renormalize: true,
            rope_theta: 10_000.0,
            rms_eps: 1e-5,
            tie_embeddings: false,
            max_seq: 256,
            aux_loss_coef: 0.01,
            aux_loss: AuxLoss::PerLayer,
            z_loss_coef: 0.0,
            clip_qkv: None,
            qkv_bias: false,
            shared_expert_ff: 0,
            dense_layers: Vec::new(),
            dense_ff: 0,
            qk_norm: QkNorm::None,
            partial_rotary: 1.0,
            scoring: Scoring::Softmax,
            seed: 0,
        };
        let paper = |layers, d_model: usize, d_ff, heads: usize| LmConfig {
            vocab: 51_200,
            d_model,
            layers,
            heads,
            kv_heads: heads,
            head_dim: d_model / heads,
            d_ff,
            experts: 8,
            top_k: 1,
            max_seq: 1024,
            ..base.clone()
        };
        Ok(match name {
            "tiny" => base,
            "small" => LmConfig {
                d_model: 128,
                layers: 4,
                heads: 4,
                kv_heads: 2,
                head_dim: 32,
                d_ff: 256,
                ..base
            },
            "moe-s" => paper(12, 768, 3072, 12),
            "moe-m" => paper(24, 1024, 4096, 16),
            "moe-l" => paper(24, 1536, 6144, 16),
            other => {
                return Err(EngineError::Config(format!(
                    "unknown preset {other:?}; the presets are {}",
                    PRESETS.join(", ")
                )))
            }
        })
    }

    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |why: String| Err(EngineError::Config(why));
        if self.vocab == 0 || self.d_model == 0 || self.layers == 0 || self.max_seq == 0 {
            return bad("vocab, d_model, layers and max_seq must be at least 1".into());
        }
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "num_attention_heads {} must be a positive multiple of num_key_value_heads {}",
                self.heads, self.kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even (rotary embeddings rotate pairs)",
                self.head_dim
            ));
        }
        if !(self.rope_theta > 0.0 && self.rms_eps >= 0.0) {
            return bad("rope_theta must be positive and rms_norm_eps non-negative".into());
        }
        if let Some(clip) = self.clip_qkv {
            if self.family != Family::Olmoe || !(clip > 0.0 && clip.is_finite()) {
                return bad(format!(
                    "clip_qkv {clip} is OLMoE's, and must be positive and finite there"
                ));
            }
        }
        if (self.qkv_bias || self.shared_expert_ff > 0)
            && !matches!(self.family, Family::Qwen2Moe | Family::Glm4Moe)
        {
            return bad(
                "q/k/v biases and a shared expert are Qwen2-MoE's and GLM-4.5's (qkv_bias, \
                 shared_expert_intermediate_size, attention_bias, n_shared_experts)"
                    .into(),
            );
        }
        let rotary = self.rotary_dim();
        if !(self.partial_rotary > 0.0
            && self.partial_rotary <= 1.0
            && rotary > 0
            && rotary.is_multiple_of(2))
        {
            return bad(format!(
                "partial_rotary_factor {} of head_dim {} rotates {rotary} dimensions: \
                 the factor must be in (0, 1] and the dimensions even and positive",
                self.partial_rotary, self.head_dim
            ));
        }
        if self.scoring != Scoring::Softmax && self.aux_loss_coef != 0.0 {
            return bad(format!(
                "router_aux_loss_coef = {}: a sigmoid router (GLM-4.5) has no load-balancing \
                 loss; its correction bias balances the experts",
                self.aux_loss_coef
            ));
        }
        if (self.scoring != Scoring::Softmax) != (self.family == Family::Glm4Moe) {
            return bad(format!(
                "{}'s router is {}",
                self.family.model_type(),
                match self.family {
                    Family::Glm4Moe => "sigmoid with group-limited choice",
                    _ => "a softmax",
                }
            ));
        }
        self.validate_dense_layers()?;
        if self.family == Family::Olmoe && self.heads * self.head_dim != self.d_model {
            return bad(format!(
                "OLMoE's q norm spans hidden_size {}, so num_attention_heads {} × head_dim {} \
                 must equal it",
                self.d_model, self.heads, self.head_dim
            ));
        }
        self.moe().validate()
    }

    fn validate_dense_layers(&self) -> Result<(), EngineError> {
        let bad = |why: String| Err(EngineError::Config(why));
        let d = &self.dense_layers;
        if !d.windows(2).all(|w| w[0] < w[1]) || d.last().is_some_and(|&l| l >= self.layers) {
            return bad(format!(
                "the dense layers {d:?} must be distinct, ascending and below num_hidden_layers {}",
                self.layers
            ));
        }
        if d.len() == self.layers {
            return bad(format!(
                "all {} layers are dense (mlp_only_layers, decoder_sparse_step):                  strata trains MoE models, at least one layer must have experts",
                self.layers
            ));
        }
        if !d.is_empty()
            && !matches!(
                self.family,
                Family::Qwen3Moe | Family::Qwen2Moe | Family::Glm4Moe
            )
        {
            return bad(format!(
                "dense MLP layers are the Qwen families' and GLM-4.5's (mlp_only_layers, \
                 first_k_dense_replace), not {}'s",
                self.family.model_type()
            ));
        }
        if d.is_empty() != (self.dense_ff == 0) {
            return bad(format!(
                "{} dense layers with a dense MLP width (intermediate_size) of {}: \
                 both or neither must be zero",
                d.len(),
                self.dense_ff
            ));
        }
        Ok(())
    }

    /// The decoder layers with experts, in order: the engine's MoE layer
    /// `i` is decoder layer `sparse_layers()[i]`.
    pub fn sparse_layers(&self) -> Vec<usize> {
        (0..self.layers)
            .filter(|l| self.dense_layers.binary_search(l).is_err())
            .collect()
    }

    /// The dimensions of each head that RoPE rotates, the first ones
    /// (transformers' `int(head_dim * partial_rotary_factor)`).
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary) as usize
    }

    /// How its checkpoints name the experts, layer by layer.
    pub fn expert_names(&self) -> ExpertNames {
        ExpertNames::new(self.family.expert_naming(), self.sparse_layers())
    }

    /// The MoE layers as the engine sees them.
    pub fn moe(&self) -> ModelConfig {
        ModelConfig {
            layers: self.layers - self.dense_layers.len(),
            d_model: self.d_model,
            d_ff: self.d_ff,
            experts: self.experts,
            top_k: self.top_k,
            renormalize: self.renormalize,
            expert_kind: ExpertKind::SwiGlu,
            classes: self.vocab,
            aux_loss_coef: self.aux_loss_coef,
            z_loss_coef: self.z_loss_coef,
            scoring: self.scoring,
            rms_eps: self.rms_eps,
            seed: self.seed,
        }
    }

    /// Parameters of one attention block.
    pub fn attention_params(&self) -> usize {
        let q = self.heads * self.head_dim;
        let kv = self.kv_heads * self.head_dim;
        self.d_model * (2 * q + 2 * kv)
    }

    /// The q and k norms' gains of one layer.
    pub fn qk_norm_params(&self) -> usize {
        match self.qk_norm {
            QkNorm::None => 0,
            QkNorm::PerHead => 2 * self.head_dim,
            QkNorm::Whole => (self.heads + self.kv_heads) * self.head_dim,
        }
    }

    /// The q, k and v biases of one layer.
    pub fn qkv_bias_params(&self) -> usize {
        match self.qkv_bias {
            true => (self.heads + 2 * self.kv_heads) * self.head_dim,
            false => 0,
        }
    }

    /// The shared expert of one layer, with its gate where it has one.
    pub fn shared_expert_params(&self) -> usize {
        let gate = match self.family.shared_expert().1 {
            true => self.d_model,
            false => 0,
        };
        match self.shared_expert_ff {
            0 => 0,
            f => 3 * self.d_model * f + gate,
        }
    }

    /// A sigmoid router's correction bias, a frozen dense tensor of each
    /// sparse layer.
    pub fn router_bias_params(&self) -> usize {
        match self.scoring {
            Scoring::Softmax => 0,
            Scoring::SigmoidGrouped { .. } => self.experts,
        }
    }

    /// Everything but the experts.
    pub fn dense_params(&self) -> usize {
        let per_layer = 2 * self.d_model
            + self.attention_params()
            + self.qkv_bias_params()
            + self.qk_norm_params();
        let per_sparse =
            self.shared_expert_params() + self.experts * self.d_model + self.router_bias_params();
        let per_dense = 3 * self.d_model * self.dense_ff;
        let dense = self.dense_layers.len();
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab * self.d_model
        };
        self.vocab * self.d_model
            + self.layers * per_layer
            + (self.layers - dense) * per_sparse
            + dense * per_dense
            + self.d_model
            + head
    }

    pub fn expert_params(&self) -> usize {
        3 * self.d_model * self.d_ff
    }

    pub fn total_params(&self) -> u64 {
        self.dense_params() as u64
            + (self.moe().layers * self.experts) as u64 * self.expert_params() as u64
    }
}
