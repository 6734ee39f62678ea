//! strata against transformers itself, the second, external oracle: for
//! each family a tiny checkpoint in its Hub layout, written by
//! transformers' `save_pretrained` in f32 and in bf16, and what
//! transformers computed on it for one batch (`tests/fixtures/hf/`, made
//! by `scripts/hf-fixtures/run.sh`). strata opens the directory as a user
//! would (`hub::open_engine`), and is compared on:
//! - the logits, to 1e-4 (absolute; they are O(1));
//! - the cross-entropy and the load-balancing loss, to 1e-5 relative;
//! - every tensor's gradient of CE + router_aux_loss_coef · aux, to
//!   1e-4 · max|ref| + 1e-6, element by element.
//!
//! Both sides compute in f32 on the same values (the bf16 cases hold
//! bf16 weights, which transformers computed on in f32, as strata does
//! after importing them), so the differences are f32 rounding in sums of
//! at most 256 terms, in different orders: ~1e-6 relative.
//!
//! The gradients are the engine's own, from a gradient-only pass
//! (`Engine::gradients`), which `oracle_lm` holds to what a step applies.

mod common;

use std::path::{Path, PathBuf};

use strata::engine::EngineConfig;
use strata::lm::safetensors_io::Checkpoint;
use strata::lm::{hub, Family, TokenBatch};
use strata_core::ExpertId;
use strata_tiers::Dtype;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

struct Reference {
    tokens: Vec<u32>,
    seq_len: usize,
    ce: f64,
    aux: f64,
    loss: f64,
    /// The loss with one part a sequence (each part's aux term), where the
    /// fixture holds that reference.
    parts_loss: Option<f64>,
    checkpoint: Checkpoint,
}

impl Reference {
    fn read(case: &Path) -> Self {
        let dir = case.join("reference");
        let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
        let meta: serde_json::Value = serde_json::from_str(&text).unwrap();
        let float = |k: &str| meta[k].as_f64().unwrap();
        Reference {
            tokens: meta["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect(),
            seq_len: meta["seq_len"].as_u64().unwrap() as usize,
            ce: float("ce"),
            aux: float("aux"),
            loss: float("loss"),
            parts_loss: meta["parts"]["loss"].as_f64(),
            checkpoint: Checkpoint::open(&dir).unwrap(),
        }
    }

    fn tensor(&self, name: &str, shape: &[usize]) -> Vec<f32> {
        let mut out = vec![0.0f32; shape.iter().product()];
        self.checkpoint.read_f32(name, shape, &mut out).unwrap();
        out
    }
}

fn engine_config(store: &Path) -> EngineConfig {
    EngineConfig {
        compute_dtype: Dtype::F32,
        optimizer_threads: 2,
        device_budget_bytes: 1 << 24,
        host_budget_bytes: 1 << 26,
        store_path: Some(store.to_path_buf()),
        ..EngineConfig::default()
    }
}

/// Element by element, |got − want| ≤ 1e-4 · max|want| + 1e-6; returns
/// the worst difference relative to max|want|.
fn compare(case: &str, tensor: &str, got: &[f64], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "{case}: {tensor}");
    let scale = want.iter().fold(0.0f64, |m, &w| m.max((w as f64).abs()));
    let bound = 1e-4 * scale + 1e-6;
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let diff = (g - w as f64).abs();
        assert!(
            diff <= bound,
            "{case}: {tensor}[{i}] is {g:e}, transformers' {w:e} (bound {bound:e})"
        );
        worst = worst.max(diff / scale.max(1e-30));
    }
    worst
}

fn case(name: &str, family: Family) {
    case_on(name, family, 1);
}

/// With `devices` device workers, each a sequence of the batch (a part),
/// the load-balancing term is each part's, as transformers computes it on
/// one DDP rank a sequence: the step's loss and gradients are held to the
/// fixture's per-part reference (`parts.grad.*`); the forward, one pass
/// over the batch, to the whole-batch one.
fn case_on(name: &str, family: Family, devices: usize) {
    let case = fixtures().join(name);
    let reference = Reference::read(&case);
    let dir = tempfile::tempdir().unwrap();
    let config = EngineConfig {
        devices,
        ..engine_config(&dir.path().join("experts.store"))
    };
    let (lm, mut engine) = hub::open_engine(&case.join("model"), config, |_, _| {}).unwrap();
    let (grad_prefix, want_loss) = match devices {
        1 => ("grad.", reference.loss),
        _ => (
            "parts.grad.",
            reference.parts_loss.expect("a per-part reference"),
        ),
    };
    let c = lm.config().clone();
    assert_eq!(c.family, family, "{name}");
    let batch = TokenBatch {
        seq_len: reference.seq_len,
        tokens: reference.tokens.clone(),
        loss_mask: None,
        doc_starts: None,
    };

    // Forward: logits, cross-entropy, load-balancing loss.
    let out = engine.forward(&lm, &batch).unwrap();
    let seqs = batch.sequences();
    let logits = reference.tensor("logits", &[seqs, reference.seq_len, c.vocab]);
    let worst_logit = out
        .logits
        .iter()
        .zip(&logits)
        .map(|(&a, &b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst_logit < 1e-4,
        "{name}: logits differ by up to {worst_logit:e}"
    );
    // (Absolute where the reference is zero: GLM-4.5's load-balancing loss.)
    let rel = |got: f64, want: f64| (got - want).abs() / want.abs().max(f64::MIN_POSITIVE);
    let (ce_err, aux_err) = (
        rel(out.loss as f64, reference.ce),
        rel(out.aux_loss as f64, reference.aux),
    );
    assert!(ce_err < 1e-5, "{name}: CE {} vs {}", out.loss, reference.ce);
    assert!(
        aux_err < 1e-5,
        "{name}: aux {} vs {}",
        out.aux_loss,
        reference.aux
    );

    // Every tensor's gradient, from a gradient-only pass.
    let grads = engine.gradients(&lm, &batch).unwrap();
    let loss_err = rel(grads.loss as f64, want_loss);
    assert!(
        loss_err < 1e-5,
        "{name}: loss {} vs {want_loss}",
        grads.loss,
    );
    let mut worst = (0.0f64, String::new());
    let mut track = |tensor: &str, w: f64| {
        if w > worst.0 {
            worst = (w, tensor.to_string());
        }
    };
    for t in lm.tensors() {
        let got: Vec<f64> = grads.dense[t.range.clone()]
            .iter()
            .map(|&g| g as f64)
            .collect();
        let want = reference.tensor(&format!("{grad_prefix}{}", t.name), &t.shape);
        track(&t.name, compare(name, &t.name, &got, &want));
    }
    let (d, f) = (c.d_model, c.d_ff);
    let names = c.expert_names();
    for (l, layer) in grads.experts.iter().enumerate() {
        for (e, grad) in layer.iter().enumerate() {
            let id = ExpertId::new(l as u32, e as u32);
            // No token: transformers' gradient is zero there.
            let got: Vec<f64> = match grad {
                Some(g) => g.iter().map(|&x| x as f64).collect(),
                None => vec![0.0; 3 * d * f],
            };
            // The documented layout: gate (F, D) | up (F, D) | down (D, F).
            let parts = [
                (0..f * d, [f, d]),
                (f * d..2 * f * d, [f, d]),
                (2 * f * d..3 * f * d, [d, f]),
            ];
            for (tensor, (range, shape)) in names.names(id).iter().zip(parts) {
                let want = reference.tensor(&format!("{grad_prefix}{tensor}"), &shape);
                track(tensor, compare(name, tensor, &got[range], &want));
            }
        }
    }
    eprintln!(
        "{name}: logits within {worst_logit:.1e}, CE {ce_err:.1e}, aux {aux_err:.1e}, \
         loss {loss_err:.1e} (relative); worst gradient {:.1e} of its tensor's max ({})",
        worst.0, worst.1
    );
}

#[test]
fn mixtral_matches_transformers() {
    case("mixtral", Family::Mixtral);
}

#[test]
fn mixtral_from_bf16_shards_matches_transformers() {
    case("mixtral-bf16", Family::Mixtral);
}

#[test]
fn qwen3_moe_matches_transformers() {
    case("qwen3_moe", Family::Qwen3Moe);
}

#[test]
fn qwen3_moe_from_bf16_shards_matches_transformers() {
    case("qwen3_moe-bf16", Family::Qwen3Moe);
}

/// Layers 0 and 2 dense (`mlp_only_layers`), the experts' layers 1 and 3.
#[test]
fn qwen3_moe_with_dense_layers_matches_transformers() {
    case("qwen3_moe_dense_layers", Family::Qwen3Moe);
}

/// GLM-4.5: sigmoid routing with a correction bias in groups, scaled
/// weights, a dense first layer, an ungated shared expert, q/k/v biases,
/// per-head q/k norms, half of each head rotated.
#[test]
fn glm4_moe_matches_transformers() {
    case("glm4_moe", Family::Glm4Moe);
}

#[test]
fn glm4_moe_from_bf16_shards_matches_transformers() {
    case("glm4_moe-bf16", Family::Glm4Moe);
}

#[test]
fn olmoe_matches_transformers() {
    case("olmoe", Family::Olmoe);
}

#[test]
fn olmoe_from_bf16_shards_matches_transformers() {
    case("olmoe-bf16", Family::Olmoe);
}

#[test]
fn qwen2_moe_matches_transformers() {
    case("qwen2_moe", Family::Qwen2Moe);
}

#[test]
fn qwen2_moe_from_bf16_shards_matches_transformers() {
    case("qwen2_moe-bf16", Family::Qwen2Moe);
}

#[test]
fn qwen2_moe_on_two_devices_matches_transformers_per_rank() {
    case_on("qwen2_moe", Family::Qwen2Moe, 2);
}

#[test]
fn mixtral_on_two_devices_matches_transformers_per_rank() {
    case_on("mixtral", Family::Mixtral, 2);
}

/// GLM-4.5's correction biases are buffers: steps with weight decay leave
/// them as the checkpoint has them, and move every other tensor.
#[test]
fn glm4_moe_steps_leave_the_correction_bias_as_it_was() {
    let case = fixtures().join("glm4_moe");
    let reference = Reference::read(&case);
    let dir = tempfile::tempdir().unwrap();
    let mut config = engine_config(&dir.path().join("experts.store"));
    config.hyper.weight_decay = 0.1;
    let (lm, mut engine) = hub::open_engine(&case.join("model"), config, |_, _| {}).unwrap();
    let before = engine.dense_params().unwrap().to_vec();
    let batch = TokenBatch {
        seq_len: reference.seq_len,
        tokens: reference.tokens.clone(),
        loss_mask: None,
        doc_starts: None,
    };
    for _ in 0..2 {
        engine.step_network(&lm, &batch).unwrap();
    }
    let after = engine.dense_params().unwrap();
    let mut biases = 0;
    for t in lm.tensors() {
        let (a, b) = (&before[t.range.clone()], &after[t.range.clone()]);
        if t.name.ends_with("e_score_correction_bias") {
            biases += 1;
            assert!(
                a.iter().any(|&x| x != 0.0),
                "{} is the checkpoint's",
                t.name
            );
            assert_eq!(a, b, "{} moved", t.name);
        } else {
            assert_ne!(a, b, "{} did not move", t.name);
        }
    }
    assert_eq!(biases, 2, "one a sparse layer");
}
