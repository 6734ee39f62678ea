//! `config.json` read and written in the keys of each family strata trains
//! (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GLM-4.5), with each family's
//! transformers defaults; what strata cannot compute is refused by name.

use serde_json::{json, Map, Value};

use super::config::{AuxLoss, Family, LmConfig, QkNorm};
use crate::math::Scoring;
use crate::EngineError;

/// A `config.json`'s keys, read as the config's fields need them.
struct Keys<'a> {
    map: &'a Map<String, Value>,
}

impl Keys<'_> {
    fn int(&self, key: &str) -> Result<usize, EngineError> {
        self.map
            .get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| {
                EngineError::Config(format!(
                    "config.json: {key} is missing or not a non-negative integer"
                ))
            })
    }

    /// The first of several names a key goes by (transformers maps
    /// num_experts and num_local_experts onto each other).
    fn int_of(&self, keys: &[&str]) -> Result<usize, EngineError> {
        match keys
            .iter()
            .find(|k| self.map.get(**k).is_some_and(|v| !v.is_null()))
        {
            Some(key) => self.int(key),
            None => self.int(keys[0]),
        }
    }

    fn uint_or(&self, key: &str, default: usize) -> usize {
        self.map
            .get(key)
            .and_then(Value::as_u64)
            .map_or(default, |v| v as usize)
    }

    fn float(&self, key: &str, default: f64) -> f64 {
        self.map.get(key).and_then(Value::as_f64).unwrap_or(default)
    }

    fn flag(&self, key: &str, default: bool) -> bool {
        self.map
            .get(key)
            .and_then(Value::as_bool)
            .unwrap_or(default)
    }

    /// An expert's hidden size, under its family's key.
    fn expert_ff(&self, family: Family) -> Result<usize, EngineError> {
        match family {
            Family::Qwen3Moe | Family::Qwen2Moe | Family::Glm4Moe => {
                self.int("moe_intermediate_size")
            }
            Family::Mixtral | Family::Olmoe => self.int("intermediate_size"),
        }
    }

    /// The shared expert's hidden size (0: none): Qwen2-MoE's own key,
    /// GLM-4.5's shared experts side by side.
    fn shared_expert_ff(&self, family: Family) -> Result<usize, EngineError> {
        Ok(match family {
            Family::Qwen2Moe => self.int("shared_expert_intermediate_size")?,
            Family::Glm4Moe => {
                self.int("moe_intermediate_size")? * self.uint_or("n_shared_experts", 1)
            }
            _ => 0,
        })
    }

    /// The router's scoring: GLM-4.5's grouped sigmoid, else softmax.
    fn scoring(&self, family: Family) -> Scoring {
        match family {
            Family::Glm4Moe => Scoring::SigmoidGrouped {
                groups: self.uint_or("n_group", 1),
                kept_groups: self.uint_or("topk_group", 1),
                scale: self.float("routed_scaling_factor", 1.0) as f32,
            },
            _ => Scoring::Softmax,
        }
    }

    /// The family's own rule: the load-balancing term is part of the
    /// training loss only with `output_router_logits`. (GLM-4.5 has none:
    /// its balance is the correction bias.)
    fn aux_loss_coef(&self, family: Family, default: f64) -> f32 {
        match self.flag("output_router_logits", false) && family != Family::Glm4Moe {
            true => self.float("router_aux_loss_coef", default) as f32,
            false => 0.0,
        }
    }
}

impl LmConfig {
    /// Reads a Hugging Face `config.json`'s text.
    pub fn from_hf_json(text: &str) -> Result<Self, EngineError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| EngineError::Config(format!("config.json is not valid JSON: {e}")))?;
        let map = value
            .as_object()
            .ok_or_else(|| EngineError::Config("config.json is not a JSON object".into()))?;
        let model_type = map.get("model_type").and_then(Value::as_str).unwrap_or("");
        let family = Family::from_model_type(model_type).ok_or_else(|| unsupported_family(map))?;
        refuse_unsupported(map, family)?;
        let defaults = FamilyDefaults::of(family);
        let keys = Keys { map };
        let d_model = keys.int("hidden_size")?;
        let heads = keys.int("num_attention_heads")?;
        let head_dim = match map.get("head_dim").and_then(Value::as_u64) {
            Some(h) => h as usize,
            None if heads > 0 => d_model / heads,
            None => 0,
        };
        let dense_layers = dense_layers(map, family)?;
        let config = LmConfig {
            family,
            vocab: keys.int("vocab_size")?,
            d_model,
            layers: keys.int("num_hidden_layers")?,
            heads,
            kv_heads: keys.uint_or("num_key_value_heads", heads),
            head_dim,
            d_ff: keys.expert_ff(family)?,
            experts: keys.int_of(&["num_experts", "num_local_experts", "n_routed_experts"])?,
            top_k: keys.int("num_experts_per_tok")?,
            // Mixtral renormalizes its top-k weights (transformers' class
            // has no key for it; strata's own configs write one).
            renormalize: keys.flag(
                "norm_topk_prob",
                matches!(family, Family::Mixtral | Family::Glm4Moe),
            ),
            rope_theta: rope_theta(map, defaults.rope_theta)?,
            rms_eps: keys.float("rms_norm_eps", defaults.rms_eps),
            tie_embeddings: keys.flag("tie_word_embeddings", false),
            max_seq: keys.uint_or("max_position_embeddings", defaults.max_positions),
            aux_loss_coef: keys.aux_loss_coef(family, defaults.aux_loss_coef),
            // transformers' form, unless the config is strata's own (a run
            // directory's, or an export of a model trained from scratch).
            aux_loss: match map.get(STRATA_AUX_LOSS_KEY).and_then(Value::as_str) {
                Some("per_layer") => AuxLoss::PerLayer,
                _ => AuxLoss::AllLayers,
            },
            z_loss_coef: keys.float("router_z_loss_coef", 0.0) as f32,
            clip_qkv: match family {
                Family::Olmoe => map
                    .get("clip_qkv")
                    .and_then(Value::as_f64)
                    .map(|c| c as f32),
                _ => None,
            },
            // Qwen2MoeConfig's qkv_bias defaults to true (transformers 4
            // had no key, and always a bias).
            qkv_bias: match family {
                Family::Qwen2Moe => keys.flag("qkv_bias", true),
                Family::Glm4Moe => keys.flag("attention_bias", false),
                _ => false,
            },
            shared_expert_ff: keys.shared_expert_ff(family)?,
            dense_ff: match dense_layers.is_empty() {
                true => 0,
                false => keys.int("intermediate_size")?,
            },
            dense_layers,
            qk_norm: match family {
                Family::Glm4Moe if keys.flag("use_qk_norm", false) => QkNorm::PerHead,
                _ => family.qk_norm(),
            },
            partial_rotary: match family {
                Family::Glm4Moe => partial_rotary_factor(map),
                _ => 1.0,
            },
            scoring: keys.scoring(family),
            seed: 0,
        };
        config.validate()?;
        Ok(config)
    }

    /// A `config.json` for this shape in its family's keys (what
    /// `export` writes for a model without a source config, and what a
    /// run directory keeps): `from_hf_json` reads it back to the same
    /// config, but for the seed, which is strata's own.
    pub fn to_hf_json(&self) -> String {
        // The Qwen families name the experts' width moe_intermediate_size,
        // and intermediate_size is their dense layers'.
        let intermediate_size = match self.dense_ff {
            0 => self.d_ff,
            f => f,
        };
        let mut value = json!({
            "architectures": [self.family.architecture()],
            "model_type": self.family.model_type(),
            "vocab_size": self.vocab,
            "hidden_size": self.d_model,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
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
            "attention_bias": false,
            "attention_dropout": 0.0,
        });
        self.add_family_keys(value.as_object_mut().expect("an object"));
        serde_json::to_string_pretty(&value).expect("plain JSON")
    }

    /// The keys of `to_hf_json` that only this config's family has (or
    /// that it names its own way).
    fn add_family_keys(&self, map: &mut serde_json::Map<String, Value>) {
        let mut set = |key: &str, v: Value| {
            map.insert(key.into(), v);
        };
        match self.family {
            Family::Mixtral => {
                set("num_local_experts", self.experts.into());
                set("sliding_window", Value::Null);
            }
            Family::Qwen3Moe => {
                set("num_experts", self.experts.into());
                set("moe_intermediate_size", self.d_ff.into());
                set("decoder_sparse_step", 1.into());
                set("mlp_only_layers", json!(self.dense_layers));
                set("use_sliding_window", false.into());
                set("sliding_window", Value::Null);
            }
            Family::Olmoe => {
                set("num_experts", self.experts.into());
                set("clip_qkv", self.clip_qkv.map(decimal).into());
            }
            Family::Qwen2Moe => {
                set("num_experts", self.experts.into());
                set("moe_intermediate_size", self.d_ff.into());
                set(
                    "shared_expert_intermediate_size",
                    self.shared_expert_ff.into(),
                );
                set("qkv_bias", self.qkv_bias.into());
                set("decoder_sparse_step", 1.into());
                set("mlp_only_layers", json!(self.dense_layers));
                set("use_sliding_window", false.into());
                set("sliding_window", Value::Null);
                // Its biases are named by qkv_bias.
                map.remove("attention_bias");
            }
            Family::Glm4Moe => {
                let Scoring::SigmoidGrouped {
                    groups,
                    kept_groups,
                    scale,
                } = self.scoring
                else {
                    unreachable!("a validated GLM-4.5 config routes by sigmoid")
                };
                set("n_routed_experts", self.experts.into());
                set("moe_intermediate_size", self.d_ff.into());
                set(
                    "n_shared_experts",
                    (self.shared_expert_ff / self.d_ff).into(),
                );
                set("first_k_dense_replace", self.dense_layers.len().into());
                set("n_group", groups.into());
                set("topk_group", kept_groups.into());
                set("routed_scaling_factor", decimal(scale).into());
                set("attention_bias", self.qkv_bias.into());
                set("use_qk_norm", (self.qk_norm == QkNorm::PerHead).into());
                set(
                    "rope_parameters",
                    json!({ "rope_type": "default", "rope_theta": self.rope_theta,
                            "partial_rotary_factor": self.partial_rotary }),
                );
            }
        }
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
    rms_eps: f64,
    aux_loss_coef: f64,
    max_positions: usize,
}

impl FamilyDefaults {
    fn of(family: Family) -> Self {
        match family {
            // MixtralConfig.
            Family::Mixtral => FamilyDefaults {
                rope_theta: 1e6,
                rms_eps: 1e-5,
                aux_loss_coef: 0.001,
                max_positions: 4096 * 32,
            },
            // Qwen3MoeConfig, Qwen2MoeConfig.
            Family::Qwen3Moe | Family::Qwen2Moe => FamilyDefaults {
                rope_theta: 1e4,
                rms_eps: 1e-6,
                aux_loss_coef: 0.001,
                max_positions: 32_768,
            },
            // Glm4MoeConfig (it has no load-balancing loss).
            Family::Glm4Moe => FamilyDefaults {
                rope_theta: 1e4,
                rms_eps: 1e-5,
                aux_loss_coef: 0.0,
                max_positions: 131_072,
            },
            // OlmoeConfig.
            Family::Olmoe => FamilyDefaults {
                rope_theta: 1e4,
                rms_eps: 1e-5,
                aux_loss_coef: 0.01,
                max_positions: 4096,
            },
        }
    }
}

/// The decoder layers whose MLP is dense, by the Qwen families' rule: a
/// layer has experts unless it is in `mlp_only_layers` or its number,
/// counted from one, is not a multiple of `decoder_sparse_step` (default
/// 1). The other families have experts in every layer.
fn dense_layers(map: &Map<String, Value>, family: Family) -> Result<Vec<usize>, EngineError> {
    let layers = map
        .get("num_hidden_layers")
        .and_then(Value::as_u64)
        .unwrap_or(0) as usize;
    if family == Family::Glm4Moe {
        // GLM-4.5: the first `first_k_dense_replace` (default 1) layers.
        let first = match map.get("first_k_dense_replace") {
            None | Some(Value::Null) => 1,
            Some(v) => v.as_u64().ok_or_else(|| {
                EngineError::Config(format!(
                    "config.json: first_k_dense_replace = {v} is not a layer count"
                ))
            })? as usize,
        };
        return Ok((0..first.min(layers)).collect());
    }
    if !matches!(family, Family::Qwen3Moe | Family::Qwen2Moe) {
        return Ok(Vec::new());
    }
    let bad = |key: &str, why: &str| {
        EngineError::Config(format!("config.json: {key} = {} {why}", map[key]))
    };
    let step = match map.get("decoder_sparse_step") {
        None | Some(Value::Null) => 1,
        Some(v) => match v.as_u64() {
            Some(s) if s > 0 => s as usize,
            _ => return Err(bad("decoder_sparse_step", "is not a positive integer")),
        },
    };
    let mlp_only: Vec<usize> = match map.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_u64().map(|l| l as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("mlp_only_layers", "is not a list of layer numbers"))?,
        Some(_) => return Err(bad("mlp_only_layers", "is not a list of layer numbers")),
    };
    if let Some(&l) = mlp_only.iter().find(|&&l| l >= layers) {
        return Err(bad(
            "mlp_only_layers",
            &format!("names layer {l}, past num_hidden_layers {layers}"),
        ));
    }
    Ok((0..layers)
        .filter(|&l| mlp_only.contains(&l) || !(l + 1).is_multiple_of(step))
        .collect())
}

/// GLM-4.5's share of each head that RoPE rotates, `partial_rotary_factor`
/// in `rope_parameters` (transformers ≥ 5) or at the top level
/// (transformers 4); its class's default, 0.5, where neither has it.
fn partial_rotary_factor(map: &Map<String, Value>) -> f64 {
    let key = "partial_rotary_factor";
    map.get("rope_parameters")
        .and_then(|p| p.get(key))
        .or_else(|| map.get(key))
        .and_then(Value::as_f64)
        .unwrap_or(0.5)
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

/// The refusal of a `model_type` strata does not train, naming what in it
/// strata lacks where that is known.
fn unsupported_family(map: &Map<String, Value>) -> EngineError {
    let model_type = map.get("model_type").and_then(Value::as_str).unwrap_or("");
    let why = match model_type {
        "deepseek_v2" | "deepseek_v3" => {
            "its attention is multi-head latent attention (kv_lora_rank), \
             which strata does not model; "
        }
        _ => "",
    };
    EngineError::Config(format!(
        "config.json: model_type {model_type:?} is not supported: {why}strata trains \
         model_type \"mixtral\", \"qwen3_moe\", \"olmoe\", \"qwen2_moe\" and \"glm4_moe\"; the experts of a \
         Mixtral-, Qwen- or OLMoE-named checkpoint alone can be imported with \
         strata::lm::safetensors_io::import_experts"
    ))
}

/// Keys whose values change the computation in ways strata does not model,
/// refused by name.
fn refuse_unsupported(map: &Map<String, Value>, family: Family) -> Result<(), EngineError> {
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
    // Qwen3-MoE's config names a window that applies only with
    // use_sliding_window.
    let qwen = matches!(family, Family::Qwen3Moe | Family::Qwen2Moe);
    let key = match qwen {
        true => "use_sliding_window",
        false => "sliding_window",
    };
    if truthy(key) {
        return refuse(key, "attention is full causal attention");
    }
    if truthy("kv_lora_rank") {
        return refuse(
            "kv_lora_rank",
            "multi-head latent attention is not modelled",
        );
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
    if !matches!(family, Family::Qwen2Moe | Family::Glm4Moe) && truthy("attention_bias") {
        return refuse("attention_bias", "the attention projections have no bias");
    }
    Ok(())
}

#[cfg(test)]
mod tests;
