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
    let yarn = json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}});
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
