//! The language model's shape: presets, and Hugging Face `config.json`
//! read and written with Mixtral's keys (OLMoE's and Qwen2-MoE's where
//! they differ; what strata cannot compute is refused by name).

use serde_json::{json, Map, Value};

use crate::math::ExpertKind;
use crate::model::ModelConfig;
use crate::EngineError;

/// A decoder-only MoE transformer with the Mixtral architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct LmConfig {
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
    /// Seed of the deterministic initialization.
    pub seed: u64,
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
        self.moe().validate()
    }

    /// The MoE layers as the engine sees them.
    pub fn moe(&self) -> ModelConfig {
        ModelConfig {
            layers: self.layers,
            d_model: self.d_model,
            d_ff: self.d_ff,
            experts: self.experts,
            top_k: self.top_k,
            renormalize: self.renormalize,
            expert_kind: ExpertKind::SwiGlu,
            classes: self.vocab,
            aux_loss_coef: self.aux_loss_coef,
            z_loss_coef: self.z_loss_coef,
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

    /// Everything but the experts.
    pub fn dense_params(&self) -> usize {
        let per_layer = 2 * self.d_model + self.attention_params() + self.experts * self.d_model;
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab * self.d_model
        };
        self.vocab * self.d_model + self.layers * per_layer + self.d_model + head
    }

    pub fn expert_params(&self) -> usize {
        3 * self.d_model * self.d_ff
    }

    pub fn total_params(&self) -> u64 {
        self.dense_params() as u64
            + (self.layers * self.experts) as u64 * self.expert_params() as u64
    }

    /// Reads a Hugging Face `config.json`'s text.
    pub fn from_hf_json(text: &str) -> Result<Self, EngineError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| EngineError::Config(format!("config.json is not valid JSON: {e}")))?;
        let map = value
            .as_object()
            .ok_or_else(|| EngineError::Config("config.json is not a JSON object".into()))?;
        let model_type = map.get("model_type").and_then(Value::as_str).unwrap_or("");
        refuse_unsupported(map, model_type)?;
        let family = FamilyDefaults::of(model_type);
        let int = |key: &str| -> Result<usize, EngineError> {
            map.get(key)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| {
                    EngineError::Config(format!(
                        "config.json: {key} is missing or not a non-negative integer"
                    ))
                })
        };
        let float = |key: &str, default: f64| -> f64 {
            map.get(key).and_then(Value::as_f64).unwrap_or(default)
        };
        let d_model = int("hidden_size")?;
        let heads = int("num_attention_heads")?;
        let head_dim = match map.get("head_dim").and_then(Value::as_u64) {
            Some(h) => h as usize,
            None if heads > 0 => d_model / heads,
            None => 0,
        };
        let config = LmConfig {
            vocab: int("vocab_size")?,
            d_model,
            layers: int("num_hidden_layers")?,
            heads,
            kv_heads: map
                .get("num_key_value_heads")
                .and_then(Value::as_u64)
                .map_or(heads, |v| v as usize),
            head_dim,
            d_ff: int("intermediate_size")?,
            experts: int("num_local_experts")?,
            top_k: int("num_experts_per_tok")?,
            renormalize: map
                .get("norm_topk_prob")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            rope_theta: rope_theta(map, family.rope_theta)?,
            rms_eps: float("rms_norm_eps", 1e-5),
            tie_embeddings: map
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            max_seq: map
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .map_or(family.max_positions, |v| v as usize),
            // The family's own rule: the load-balancing term is part of
            // the training loss only with `output_router_logits`.
            aux_loss_coef: match map.get("output_router_logits").and_then(Value::as_bool) {
                Some(true) => float("router_aux_loss_coef", family.aux_loss_coef) as f32,
                _ => 0.0,
            },
            // transformers' form, unless the config is strata's own (a run
            // directory's, or an export of a model trained from scratch).
            aux_loss: match map.get(STRATA_AUX_LOSS_KEY).and_then(Value::as_str) {
                Some("per_layer") => AuxLoss::PerLayer,
                _ => AuxLoss::AllLayers,
            },
            z_loss_coef: float("router_z_loss_coef", 0.0) as f32,
            seed: 0,
        };
        config.validate()?;
        Ok(config)
    }

    /// A Mixtral `config.json` for this shape (what `export` writes, and
    /// a run directory keeps): `from_hf_json` reads it back to the same
    /// config, but for the seed, which is strata's own.
    pub fn to_hf_json(&self) -> String {
        let value = json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "vocab_size": self.vocab,
            "hidden_size": self.d_model,
            "intermediate_size": self.d_ff,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_local_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": self.renormalize,
            "rope_theta": self.rope_theta,
            "rope_parameters": { "rope_type": "default", "rope_theta": self.rope_theta },
            "rms_norm_eps": self.rms_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_seq,
            "output_router_logits": self.aux_loss_coef != 0.0,
            STRATA_AUX_LOSS_KEY: match self.aux_loss {
                AuxLoss::PerLayer => "per_layer",
                AuxLoss::AllLayers => "all_layers",
            },
            "router_aux_loss_coef": decimal(self.aux_loss_coef),
            "router_z_loss_coef": decimal(self.z_loss_coef),
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "sliding_window": null,
            "attention_dropout": 0.0,
        });
        serde_json::to_string_pretty(&value).expect("plain JSON")
    }
}

/// The key under which a written config names strata's load-balancing
/// form (transformers ignores it and computes its own, `AuxLoss::AllLayers`).
const STRATA_AUX_LOSS_KEY: &str = "strata_aux_loss";

/// The shortest decimal that reads back as `x`, as f64: `0.01`, not
/// 0.009999999776482582, in a written config.
fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// A model family's defaults for keys a `config.json` may leave out (its
/// transformers configuration class's own defaults).
struct FamilyDefaults {
    rope_theta: f64,
    aux_loss_coef: f64,
    max_positions: usize,
}

impl FamilyDefaults {
    fn of(model_type: &str) -> Self {
        assert_eq!(
            model_type, "mixtral",
            "refuse_unsupported admits Mixtral alone"
        );
        // transformers' MixtralConfig.
        FamilyDefaults {
            rope_theta: 1e6,
            aux_loss_coef: 0.001,
            max_positions: 4096 * 32,
        }
    }
}

/// The RoPE base, from either layout transformers writes: a top-level
/// `rope_theta` (transformers 4), or `rope_parameters` (transformers ≥ 5,
/// which holds `rope_theta` and `rope_type`); the family's default where
/// neither has it. A `rope_type` other than "default" is refused by name.
fn rope_theta(map: &Map<String, Value>, default: f64) -> Result<f64, EngineError> {
    let Some(params) = map.get("rope_parameters").filter(|v| !v.is_null()) else {
        return Ok(map
            .get("rope_theta")
            .and_then(Value::as_f64)
            .unwrap_or(default));
    };
    let params = params.as_object().ok_or_else(|| {
        EngineError::Config(format!(
            "config.json: rope_parameters = {params} is not an object"
        ))
    })?;
    match params.get("rope_type").and_then(Value::as_str) {
        None | Some("default") => {}
        Some(other) => {
            return Err(EngineError::Config(format!(
                "config.json: rope_parameters.rope_type = {other:?} is not supported: \
                 strata implements the default (unscaled) rotary embedding only"
            )))
        }
    }
    Ok(params
        .get("rope_theta")
        .and_then(Value::as_f64)
        .or_else(|| map.get("rope_theta").and_then(Value::as_f64))
        .unwrap_or(default))
}

/// Architectures and keys whose values change the computation in ways
/// strata does not model, refused by name.
fn refuse_unsupported(map: &Map<String, Value>, model_type: &str) -> Result<(), EngineError> {
    match model_type {
        "mixtral" => {}
        "olmoe" => {
            return Err(EngineError::Config(
                "config.json: model_type \"olmoe\" is not supported: its attention \
                 normalizes q and k (q_norm, k_norm), which strata does not model; \
                 its experts alone can be imported with strata_tiers::import_experts"
                    .into(),
            ))
        }
        "qwen2_moe" => {
            return Err(EngineError::Config(
                "config.json: model_type \"qwen2_moe\" is not supported: its attention \
                 has q/k/v biases and its MoE layers a shared expert \
                 (shared_expert_intermediate_size), which strata does not model; \
                 its experts alone can be imported with strata_tiers::import_experts"
                    .into(),
            ))
        }
        other => {
            return Err(EngineError::Config(format!(
                "config.json: model_type {other:?} is not supported (strata trains \
                 the Mixtral architecture, model_type \"mixtral\")"
            )))
        }
    }
    let refuse = |key: &str, why: &str| {
        Err(EngineError::Config(format!(
            "config.json: {key} = {} is not supported: {why}",
            map[key]
        )))
    };
    let truthy = |key: &str| match map.get(key) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(_) => true,
    };
    if let Some(act) = map.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return refuse("hidden_act", "the experts are SwiGLU (silu)");
        }
    }
    if truthy("sliding_window") {
        return refuse("sliding_window", "attention is full causal attention");
    }
    // transformers 4 names a scaled RoPE under `rope_scaling`; an object
    // that asks for the default rotation is the plain one.
    let default_rope = |v: &Value| {
        let kind = v.get("rope_type").or_else(|| v.get("type"));
        kind.and_then(Value::as_str) == Some("default")
    };
    if truthy("rope_scaling") && !map.get("rope_scaling").is_some_and(default_rope) {
        return refuse("rope_scaling", "rotary embeddings are unscaled");
    }
    if truthy("attention_bias") {
        return refuse("attention_bias", "the attention projections have no bias");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_config_reads_back_the_same() {
        for preset in ["tiny", "small", "moe-s"] {
            let config = LmConfig::preset(preset).unwrap();
            let back = LmConfig::from_hf_json(&config.to_hf_json()).unwrap();
            assert_eq!(back, LmConfig { seed: 0, ..config });
        }
        let odd = LmConfig {
            renormalize: false,
            z_loss_coef: 1e-3,
            aux_loss_coef: 0.02,
            tie_embeddings: true,
            rope_theta: 1e6,
            rms_eps: 1e-6,
            seed: 0,
            ..LmConfig::preset("tiny").unwrap()
        };
        assert_eq!(LmConfig::from_hf_json(&odd.to_hf_json()).unwrap(), odd);
    }

    /// The tiny preset's config.json, edited: `drop` keys removed, `set`
    /// keys replaced.
    fn edited(drop: &[&str], set: Value) -> Result<LmConfig, EngineError> {
        let text = LmConfig::preset("tiny").unwrap().to_hf_json();
        let mut value: Value = serde_json::from_str(&text).unwrap();
        let map = value.as_object_mut().unwrap();
        for key in drop {
            map.remove(*key);
        }
        for (key, v) in set.as_object().unwrap() {
            map.insert(key.clone(), v.clone());
        }
        LmConfig::from_hf_json(&value.to_string())
    }

    #[test]
    fn the_rope_base_is_read_from_either_layout_with_the_family_default() {
        let both = ["rope_theta", "rope_parameters"];
        // transformers ≥ 5.
        let v5 = json!({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}});
        assert_eq!(edited(&["rope_theta"], v5).unwrap().rope_theta, 5e5);
        // transformers 4.
        let v4 = json!({"rope_theta": 2e4});
        assert_eq!(edited(&["rope_parameters"], v4).unwrap().rope_theta, 2e4);
        // Neither: MixtralConfig's default, not 1e4.
        assert_eq!(edited(&both, json!({})).unwrap().rope_theta, 1e6);
        let no_theta = json!({"rope_parameters": {"rope_type": "default"}});
        assert_eq!(edited(&both, no_theta).unwrap().rope_theta, 1e6);
        // A scaled rotation is refused by name, in either layout.
        let yarn =
            json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}});
        let err = edited(&[], yarn).unwrap_err().to_string();
        assert!(
            err.contains("rope_parameters.rope_type = \"yarn\""),
            "{err}"
        );
        let linear = json!({"rope_scaling": {"type": "linear", "factor": 2.0}});
        let err = edited(&[], linear).unwrap_err().to_string();
        assert!(err.contains("rope_scaling"), "{err}");
        let plain = json!({"rope_scaling": {"rope_type": "default"}});
        assert_eq!(edited(&[], plain).unwrap().rope_theta, 1e4);
    }

    #[test]
    fn the_load_balancing_term_follows_output_router_logits() {
        let keys = ["output_router_logits", "router_aux_loss_coef"];
        // A Hub config without the flag trains on cross-entropy alone.
        assert_eq!(edited(&keys, json!({})).unwrap().aux_loss_coef, 0.0);
        let off = json!({"output_router_logits": false, "router_aux_loss_coef": 0.02});
        assert_eq!(edited(&[], off).unwrap().aux_loss_coef, 0.0);
        // With it: the config's coefficient, or MixtralConfig's 0.001.
        let on = json!({"output_router_logits": true});
        assert_eq!(edited(&keys, on).unwrap().aux_loss_coef, 0.001);
        let on = json!({"output_router_logits": true, "router_aux_loss_coef": 0.02});
        assert_eq!(edited(&[], on).unwrap().aux_loss_coef, 0.02);
        // A Hub config trains transformers' form of the term; strata's own
        // configs name theirs.
        assert_eq!(
            edited(&["strata_aux_loss"], json!({})).unwrap().aux_loss,
            AuxLoss::AllLayers
        );
        assert_eq!(edited(&[], json!({})).unwrap().aux_loss, AuxLoss::PerLayer);
    }
}
