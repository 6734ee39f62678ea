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
        let map = value.as_object_mut().expect("an object");
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
mod tests {
    use super::*;
    use crate::lm::QkNorm;

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

    /// A Hub config of `family` (the keys its transformers class writes),
    /// tiny.
    fn hub_config(model_type: &str, set: Value) -> Result<LmConfig, EngineError> {
        let mut value = json!({
            "model_type": model_type,
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_experts_per_tok": 2,
        });
        for (key, v) in set.as_object().unwrap() {
            value[key] = v.clone();
        }
        LmConfig::from_hf_json(&value.to_string())
    }

    #[test]
    fn qwen3_moe_configs_are_read_with_their_own_keys_and_defaults() {
        let c = hub_config(
            "qwen3_moe",
            json!({"num_experts": 8, "moe_intermediate_size": 24, "head_dim": 16,
                   "use_sliding_window": false, "sliding_window": 4096,
                   "mlp_only_layers": [], "decoder_sparse_step": 1}),
        )
        .unwrap();
        assert_eq!(c.family, Family::Qwen3Moe);
        assert_eq!((c.experts, c.d_ff, c.head_dim), (8, 24, 16));
        // Qwen3MoeConfig's defaults: no renormalization, θ 1e4, ε 1e-6.
        assert!(!c.renormalize);
        assert_eq!((c.rope_theta, c.rms_eps, c.max_seq), (1e4, 1e-6, 32_768));
        assert_eq!(c.qk_norm, QkNorm::PerHead);
        // transformers 5 writes num_local_experts for it.
        let c5 = hub_config(
            "qwen3_moe",
            json!({"num_local_experts": 8, "moe_intermediate_size": 24, "norm_topk_prob": true}),
        )
        .unwrap();
        assert!(c5.renormalize && c5.experts == 8);
        let base = json!({"num_experts": 8, "moe_intermediate_size": 24});
        for (key, value) in [
            ("use_sliding_window", json!(true)),
            ("mlp_only_layers", json!([2])),
            ("mlp_only_layers", json!(1)),
            ("decoder_sparse_step", json!(0)),
        ] {
            let mut set = base.clone();
            set[key] = value;
            let err = hub_config("qwen3_moe", set).unwrap_err().to_string();
            assert!(err.contains(&format!("config.json: {key} = ")), "{err}");
        }
        let written = LmConfig { seed: 0, ..c };
        assert_eq!(
            LmConfig::from_hf_json(&written.to_hf_json()).unwrap(),
            written
        );
    }

    #[test]
    fn glm4_moe_configs_are_read_with_their_own_keys_and_defaults() {
        let keys = json!({"n_routed_experts": 8, "moe_intermediate_size": 24,
                          "num_hidden_layers": 3, "n_group": 2, "topk_group": 1,
                          "routed_scaling_factor": 2.5, "attention_bias": true,
                          "use_qk_norm": true, "n_shared_experts": 2,
                          "output_router_logits": true});
        let c = hub_config("glm4_moe", keys.clone()).unwrap();
        assert_eq!(c.family, Family::Glm4Moe);
        assert_eq!((c.experts, c.d_ff, c.shared_expert_ff), (8, 24, 48));
        // Glm4MoeConfig's defaults: one dense layer, renormalized, half rotated.
        assert_eq!((c.dense_layers.clone(), c.dense_ff), (vec![0], 48));
        assert!(c.renormalize && c.qkv_bias);
        assert_eq!(
            (c.qk_norm, c.partial_rotary, c.rotary_dim()),
            (QkNorm::PerHead, 0.5, 4)
        );
        assert_eq!(
            c.scoring,
            Scoring::SigmoidGrouped {
                groups: 2,
                kept_groups: 1,
                scale: 2.5
            }
        );
        // No load-balancing loss, even with output_router_logits.
        assert_eq!(c.aux_loss_coef, 0.0);
        assert_eq!((c.rms_eps, c.max_seq), (1e-5, 131_072));
        let written = LmConfig { seed: 0, ..c };
        assert_eq!(
            LmConfig::from_hf_json(&written.to_hf_json()).unwrap(),
            written
        );
        let mut bad_groups = keys.clone();
        bad_groups["n_group"] = json!(3);
        let err = hub_config("glm4_moe", bad_groups).unwrap_err().to_string();
        assert!(
            err.contains("n_group = 3 must divide the 8 experts"),
            "{err}"
        );
        let mut mla = keys;
        mla["kv_lora_rank"] = json!(512);
        let err = hub_config("glm4_moe", mla).unwrap_err().to_string();
        assert!(err.contains("config.json: kv_lora_rank = 512"), "{err}");
    }

    #[test]
    fn qwen_dense_layers_follow_mlp_only_layers_and_decoder_sparse_step() {
        let qwen = |family: &str, set: Value| {
            let mut value = json!({"num_experts": 8, "moe_intermediate_size": 24,
                                   "shared_expert_intermediate_size": 16,
                                   "num_hidden_layers": 6});
            for (key, v) in set.as_object().unwrap() {
                value[key] = v.clone();
            }
            hub_config(family, value)
        };
        for family in ["qwen3_moe", "qwen2_moe"] {
            let c = qwen(family, json!({"mlp_only_layers": [0, 4]})).unwrap();
            assert_eq!((c.dense_layers.clone(), c.dense_ff), (vec![0, 4], 48));
            assert_eq!(c.sparse_layers(), [1, 2, 3, 5]);
            assert_eq!(c.moe().layers, 4);
            // Layers 2, 4 and 6 (from 1) have experts, but for mlp_only_layers.
            let c = qwen(
                family,
                json!({"decoder_sparse_step": 2, "mlp_only_layers": [3]}),
            )
            .unwrap();
            assert_eq!(c.sparse_layers(), [1, 5]);
            let lm = crate::lm::MoeLm::new(c.clone()).unwrap();
            let names: Vec<&str> = lm.tensors().iter().map(|t| t.name.as_str()).collect();
            assert!(names.contains(&"model.layers.0.mlp.up_proj.weight"));
            assert!(names.contains(&"model.layers.1.mlp.gate.weight"));
            assert!(!names.contains(&"model.layers.0.mlp.gate.weight"));
            assert_eq!(
                lm.tensors().last().unwrap().range.end,
                c.dense_params(),
                "{family}"
            );
            let written = LmConfig { seed: 0, ..c };
            assert_eq!(
                LmConfig::from_hf_json(&written.to_hf_json()).unwrap(),
                written
            );
            let all_dense = qwen(family, json!({"decoder_sparse_step": 7}));
            let err = all_dense.unwrap_err().to_string();
            assert!(
                err.contains("at least one layer must have experts"),
                "{err}"
            );
        }
        // The other families' intermediate_size is the experts' width.
        let m = hub_config(
            "mixtral",
            json!({"num_local_experts": 4, "mlp_only_layers": [0]}),
        );
        assert!(m.unwrap().dense_layers.is_empty());
    }

    #[test]
    fn olmoe_configs_are_read_with_their_own_keys_and_defaults() {
        let c = hub_config("olmoe", json!({"num_experts": 8, "clip_qkv": 8.0})).unwrap();
        assert_eq!(c.family, Family::Olmoe);
        assert_eq!((c.experts, c.d_ff, c.clip_qkv), (8, 48, Some(8.0)));
        assert!(!c.renormalize);
        assert_eq!((c.rope_theta, c.rms_eps, c.max_seq), (1e4, 1e-5, 4096));
        assert_eq!(c.qk_norm, QkNorm::Whole);
        // OlmoeConfig's aux coefficient is 0.01.
        let on = json!({"num_experts": 8, "output_router_logits": true});
        assert_eq!(hub_config("olmoe", on).unwrap().aux_loss_coef, 0.01);
        let written = LmConfig { seed: 0, ..c };
        assert_eq!(
            LmConfig::from_hf_json(&written.to_hf_json()).unwrap(),
            written
        );
        // Its q norm spans hidden_size: heads × head_dim must equal it.
        let err = hub_config("olmoe", json!({"num_experts": 8, "head_dim": 16}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("OLMoE's q norm spans hidden_size 32"), "{err}");
        // clip_qkv is OLMoE's alone.
        let mixtral = LmConfig {
            clip_qkv: Some(1.0),
            ..LmConfig::preset("tiny").unwrap()
        };
        assert!(mixtral
            .validate()
            .unwrap_err()
            .to_string()
            .contains("clip_qkv"));
    }

    #[test]
    fn qwen2_moe_configs_are_read_with_biases_and_a_shared_expert() {
        let keys = json!({"num_experts": 8, "moe_intermediate_size": 24,
                          "shared_expert_intermediate_size": 40});
        let c = hub_config("qwen2_moe", keys.clone()).unwrap();
        assert_eq!(c.family, Family::Qwen2Moe);
        assert_eq!((c.d_ff, c.shared_expert_ff, c.qkv_bias), (24, 40, true));
        assert_eq!(c.qk_norm, QkNorm::None);
        let (d, q, kv) = (32, 32, 16);
        assert_eq!(c.qkv_bias_params(), q + 2 * kv);
        assert_eq!(c.shared_expert_params(), 3 * d * 40 + d);
        let written = LmConfig { seed: 0, ..c };
        assert_eq!(
            LmConfig::from_hf_json(&written.to_hf_json()).unwrap(),
            written
        );
        let mut no_bias = keys.clone();
        no_bias["qkv_bias"] = json!(false);
        assert!(!hub_config("qwen2_moe", no_bias).unwrap().qkv_bias);
        let err = hub_config(
            "qwen2_moe",
            json!({"num_experts": 8, "moe_intermediate_size": 24}),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("shared_expert_intermediate_size"), "{err}");
        // Biases and a shared expert are Qwen2-MoE's alone.
        let mixtral = LmConfig {
            shared_expert_ff: 8,
            ..LmConfig::preset("tiny").unwrap()
        };
        assert!(mixtral.validate().is_err());
    }

    #[test]
    fn unsupported_families_and_attention_are_refused_by_name() {
        let err = hub_config("deepseek_v3", json!({}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("kv_lora_rank"), "{err}");
        let err = hub_config("llama", json!({})).unwrap_err().to_string();
        assert!(
            err.contains("model_type \"llama\" is not supported"),
            "{err}"
        );
        let mla = json!({"num_experts": 8, "kv_lora_rank": 512});
        let err = hub_config("olmoe", mla).unwrap_err().to_string();
        assert!(err.contains("config.json: kv_lora_rank = 512"), "{err}");
    }
}
