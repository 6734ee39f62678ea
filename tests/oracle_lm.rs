//! The engine's language model against an oracle that shares no code with
//! it (`tests/oracle`, plain f64 written from the model's definition):
//! one step's loss, and every tensor's gradient, compared tensor by
//! tensor, on one device and several, with micro-batches, with experts
//! resident and streaming from the SSD.
//!
//! The gradient is read through the update, with the optimizer set so
//! that the update keeps the gradient's scale: AdamW with β1 = β2 = 0, no
//! weight decay and ε = 1 moves a parameter at its first step by
//! Δ = −lr · g / (|g| + ε), which is lr · g to within |g| (and exactly that
//! formula here), so a gradient off by any factor moves Δ by nearly that
//! factor. (With the default ε = 1e-8, Δ = −lr · sign(g) and a wrong
//! factor would not show.) lr = 64 lifts Δ well above the rounding of a
//! parameter to f32 (|p| < 1, so ≤ 6e-8), which then costs at most
//! 6e-8 / (64 |g|) of a gradient as small as 1e-5: 1e-4.
//!
//! Bounds. The engine computes in f32 (unit roundoff u = 6e-8). A
//! gradient is a chain of a few dozen products and sums of at most
//! max(T, D, V, S) = 48 terms; each such sum's error is bounded by
//! n · u · Σ|terms| and is typically √n · u of it, so an element carries
//! ~1e-6 relative error where its terms do not cancel. Per tensor we
//! compare ‖Δ_engine − Δ_oracle‖ / ‖Δ_oracle‖, which weighs elements by
//! size, so a few cancelling elements cannot dominate: 1e-4 is ~100× the
//! error the chains allow and ~10⁴× smaller than what a wrong factor of
//! 2 gives (≈ 0.5–1). The loss is a sum of 48 rows' log-sum-exps, each
//! within ~V · u: 1e-5 relative.

mod common;
mod oracle;

use oracle::{Expert, Params, Part, Shape};
use strata::engine::{Engine, EngineConfig, Gradients};
use strata::lm::{AuxLoss, Family, LmConfig, MoeLm, TokenBatch};
use strata::model::Network;
use strata_optim::AdamWHyper;
use strata_tiers::Dtype;

const LR: f32 = 64.0;
const EPS: f32 = 1.0;
const GRAD_TOLERANCE: f64 = 1e-5;
const LOSS_TOLERANCE: f64 = 1e-5;

fn lm(top_k: usize, renormalize: bool, tied: bool) -> LmConfig {
    LmConfig {
        family: Family::Mixtral,
        clip_qkv: None,
        qkv_bias: false,
        shared_expert_ff: 0,
        dense_layers: Vec::new(),
        dense_ff: 0,
        qk_norm: strata::lm::QkNorm::None,
        partial_rotary: 1.0,
        scoring: strata::math::Scoring::Softmax,
        vocab: 48,
        d_model: 16,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        d_ff: 24,
        experts: 4,
        top_k,
        renormalize,
        rope_theta: 500.0,
        rms_eps: 1e-5,
        tie_embeddings: tied,
        max_seq: 32,
        aux_loss_coef: 0.05,
        aux_loss: AuxLoss::PerLayer,
        z_loss_coef: 0.01,
        seed: 3,
    }
}

fn shape_of(c: &LmConfig) -> Shape {
    Shape {
        vocab: c.vocab,
        d: c.d_model,
        layers: c.layers,
        heads: c.heads,
        kv_heads: c.kv_heads,
        hd: c.head_dim,
        ff: c.d_ff,
        experts: c.experts,
        top_k: c.top_k,
        renormalize: c.renormalize,
        theta: c.rope_theta,
        eps: c.rms_eps,
        tied: c.tie_embeddings,
        aux_coef: c.aux_loss_coef as f64,
        aux_all_layers: c.aux_loss == AuxLoss::AllLayers,
        z_coef: c.z_loss_coef as f64,
    }
}

/// `seqs` sequences of `seq_len + 1` token ids.
fn tokens(vocab: usize, seqs: usize, seq_len: usize, seed: u64) -> Vec<u32> {
    common::values(seqs * (seq_len + 1), seed, 1.0)
        .iter()
        .map(|x| ((x + 1.0) / 2.0 * vocab as f64) as u32 % vocab as u32)
        .collect()
}

/// The engine's parameters as the oracle's, by Hugging Face name.
fn params_of(lm: &MoeLm, engine: &mut Engine) -> Params {
    let c = lm.config();
    let shape = shape_of(c);
    let mut p = Params::zeros(&shape);
    let dense = engine.dense_params().unwrap().to_vec();
    let mut named = p.named_mut();
    for t in lm.tensors() {
        let (_, slot) = named
            .iter_mut()
            .find(|(n, _)| *n == t.name)
            .unwrap_or_else(|| panic!("the oracle has no tensor {}", t.name));
        assert_eq!(slot.len(), t.range.len(), "{}", t.name);
        for (o, &x) in slot.iter_mut().zip(&dense[t.range.clone()]) {
            *o = x as f64;
        }
    }
    let (d, f) = (c.d_model, c.d_ff);
    for l in 0..c.layers {
        for e in 0..c.experts {
            let flat: Vec<f64> = engine
                .expert_params(l, e)
                .unwrap()
                .iter()
                .map(|&x| x as f64)
                .collect();
            // The documented layout: w1 (F, D) | w3 (F, D) | w2 (D, F).
            p.layers[l].experts[e] = Expert {
                w1: flat[..f * d].to_vec(),
                w3: flat[f * d..2 * f * d].to_vec(),
                w2: flat[2 * f * d..].to_vec(),
            };
        }
    }
    p
}

fn engine_config(devices: usize, micro_batches: usize) -> EngineConfig {
    EngineConfig {
        hyper: AdamWHyper {
            lr: LR,
            beta1: 0.0,
            beta2: 0.0,
            eps: EPS,
            weight_decay: 0.0,
        },
        devices,
        micro_batches,
        compute_dtype: Dtype::F32,
        optimizer_threads: 2,
        device_budget_bytes: 1 << 24,
        host_budget_bytes: 1 << 26,
        // Several devices: each layer's dense gradient is its own bucket,
        // reduced as the backward leaves the layer.
        dense_bucket_bytes: 0,
        ..EngineConfig::default()
    }
}

/// One engine step against the oracle: the loss, then every tensor's
/// update against the one the oracle's gradient gives.
fn case(name: &str, c: &LmConfig, config: EngineConfig, seqs: usize, seq_len: usize) {
    let parts = config.devices * config.micro_batches;
    let lm = MoeLm::new(c.clone()).unwrap();
    let mut engine = Engine::new_network(&lm, config).unwrap();
    let before = params_of(&lm, &mut engine);
    let batch = TokenBatch {
        seq_len,
        tokens: tokens(c.vocab, seqs, seq_len, 17),
        loss_mask: None,
        doc_starts: None,
    };
    // The gradient-only pass first: it must leave everything as it was.
    let direct = engine.gradients(&lm, &batch).unwrap();
    assert!(
        params_of(&lm, &mut engine).named() == before.named(),
        "{name}: gradients() moved a parameter"
    );
    let metrics = engine.step_network(&lm, &batch).unwrap();
    let after = params_of(&lm, &mut engine);
    assert_eq!(direct.loss, metrics.loss, "{name}: the two passes' losses");

    let shape = shape_of(c);
    // The engine splits sequences into parts as evenly as it can, in order.
    let split = lm.split_batch(&batch, parts);
    assert_eq!(split.len(), parts);
    let parts: Vec<Part> = split
        .into_iter()
        .map(|b| Part {
            seq_len: b.seq_len,
            tokens: b.tokens,
        })
        .collect();
    let mut grads = Params::zeros(&shape);
    let losses = oracle::step(&shape, &before, &parts, Some(&mut grads));
    assert!(
        losses.routing_margin > 1e-4,
        "{name}: the routing is {} from a tie, within f32's reach; pick other tokens",
        losses.routing_margin
    );
    let loss_err = (metrics.loss as f64 - losses.total).abs() / losses.total.abs();
    eprintln!(
        "{name}: loss {} vs oracle {} (ce {:.4} aux {:.4} z {:.4}): rel {loss_err:.1e}",
        metrics.loss, losses.total, losses.ce, losses.aux, losses.z
    );
    assert!(
        loss_err < LOSS_TOLERANCE,
        "{name}: loss off by {loss_err:e}"
    );

    check_direct_gradients(name, &lm, &direct, &grads);
    let (b, a, g) = (before.named(), after.named(), grads.named());
    let mut worst = (0.0f64, String::new());
    let mut untouched = 0;
    for ((tensor, pb), ((_, pa), (_, gr))) in b.iter().zip(a.iter().zip(&g)) {
        let expected: Vec<f64> = gr
            .iter()
            .map(|&x| -(LR as f64) * x / (x.abs() + EPS as f64))
            .collect();
        let got: Vec<f64> = pa.iter().zip(pb).map(|(x, y)| x - y).collect();
        let norm = expected.iter().map(|x| x * x).sum::<f64>().sqrt();
        let diff = got
            .iter()
            .zip(&expected)
            .map(|(x, y)| (x - y).powi(2))
            .sum::<f64>()
            .sqrt();
        if norm == 0.0 {
            // An expert no token reached: not stepped at all.
            assert_eq!(diff, 0.0, "{name}: {tensor} moved without a gradient");
            untouched += 1;
            continue;
        }
        let rel = diff / norm;
        assert!(
            rel < GRAD_TOLERANCE,
            "{name}: {tensor}: the update is {rel:.3e} (relative) from the oracle's; \
             ‖Δ‖ {:.3e} against {norm:.3e}",
            got.iter().map(|x| x * x).sum::<f64>().sqrt()
        );
        if rel > worst.0 {
            worst = (rel, tensor.clone());
        }
    }
    eprintln!(
        "{name}: {} tensors, {untouched} without a gradient; worst relative difference {:.2e} ({})",
        b.len(),
        worst.0,
        worst.1
    );
}

/// `Engine::gradients` tensor by tensor against the oracle's gradient, with
/// the bound of the update's comparison.
fn check_direct_gradients(name: &str, lm: &MoeLm, direct: &Gradients, oracle: &Params) {
    let c = lm.config();
    let (d, f) = (c.d_model, c.d_ff);
    let mut engine: Vec<(String, Vec<f64>)> = lm
        .tensors()
        .iter()
        .map(|t| {
            let g = direct.dense[t.range.clone()].iter().map(|&x| x as f64);
            (t.name.clone(), g.collect())
        })
        .collect();
    for (l, layer) in direct.experts.iter().enumerate() {
        for (e, grad) in layer.iter().enumerate() {
            let g: Vec<f64> = match grad {
                Some(g) => g.iter().map(|&x| x as f64).collect(),
                None => vec![0.0; 3 * d * f],
            };
            let q = format!("model.layers.{l}.block_sparse_moe.experts.{e}");
            for (w, part) in ["w1", "w3", "w2"].iter().zip(g.chunks_exact(d * f)) {
                engine.push((format!("{q}.{w}"), part.to_vec()));
            }
        }
    }
    let want = oracle.named();
    assert_eq!(engine.len(), want.len(), "{name}: tensor count");
    let mut worst = 0.0f64;
    for (tensor, w) in &want {
        let (_, got) = engine
            .iter()
            .find(|(n, _)| n == tensor)
            .unwrap_or_else(|| panic!("{name}: no gradient for {tensor}"));
        let norm = w.iter().map(|x| x * x).sum::<f64>().sqrt();
        let diff = got
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f64>()
            .sqrt();
        if norm == 0.0 {
            assert_eq!(
                diff, 0.0,
                "{name}: {tensor} has a gradient the oracle has not"
            );
            continue;
        }
        let rel = diff / norm;
        assert!(
            rel < GRAD_TOLERANCE,
            "{name}: {tensor}: gradients() is {rel:e} off"
        );
        worst = worst.max(rel);
    }
    eprintln!("{name}: gradients() within {worst:.2e} of the oracle, tensor by tensor");
}

/// `Engine::forward`'s logits and target log-probabilities against the
/// oracle's forward: the same bound as the loss (48 rows of ≤ 48-term
/// sums, ~1e-6 relative).
#[test]
fn the_forward_s_logits_match_the_oracle() {
    let c = lm(2, true, false);
    let lm = MoeLm::new(c.clone()).unwrap();
    let mut engine = Engine::new_network(&lm, engine_config(1, 1)).unwrap();
    let params = params_of(&lm, &mut engine);
    let (seqs, seq_len) = (3, 8);
    let batch = TokenBatch {
        seq_len,
        tokens: tokens(c.vocab, seqs, seq_len, 29),
        loss_mask: None,
        doc_starts: None,
    };
    let out = engine.forward(&lm, &batch).unwrap();
    assert_eq!((out.tokens(), out.width), (seqs * seq_len, c.vocab));
    let part = Part {
        seq_len,
        tokens: batch.tokens.clone(),
    };
    let want = oracle::logits(&shape_of(&c), &params, &part);
    let diff: f64 = out
        .logits
        .iter()
        .zip(&want)
        .map(|(&a, b)| (a as f64 - b).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|b| b * b).sum();
    let rel = (diff / norm).sqrt();
    eprintln!("logits vs oracle: {rel:.2e} norm-wise relative");
    assert!(
        rel < LOSS_TOLERANCE,
        "logits differ from the oracle's by {rel:e}"
    );
    for (i, (&lp, &target)) in out.target_log_probs().iter().zip(&out.targets).enumerate() {
        let row = &want[i * c.vocab..(i + 1) * c.vocab];
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
        let expected = row[target as usize] - lse;
        assert!(
            (lp as f64 - expected).abs() < 1e-5,
            "token {i}: {lp} vs {expected}"
        );
    }
}

#[test]
fn one_device_top2_resident() {
    let c = lm(2, true, false);
    let config = engine_config(1, 1);
    case("one device, top-2", &c, config, 3, 16);
}

#[test]
fn micro_batches_top1_tied_streaming_from_the_ssd() {
    let c = lm(1, false, true);
    let dir = tempfile::tempdir().unwrap();
    let moe = c.moe();
    let all = (c.layers * c.experts) as u64;
    let config = EngineConfig {
        device_budget_bytes: 2 * (moe.expert_params() * 4) as u64,
        host_budget_bytes: all / 2 * common::record_bytes(&moe),
        store_path: Some(dir.path().join("experts.strata")),
        ..engine_config(1, 2)
    };
    case("two micro-batches, top-1, tied, SSD", &c, config, 4, 12);
}

/// transformers' load-balancing loss (one term over all layers' router
/// logits, `AuxLoss::AllLayers`, what a Hub config trains with), on two
/// devices × two micro-batches, each part taking its own term.
#[test]
fn all_layers_aux_two_devices_two_micro_batches() {
    let c = LmConfig {
        aux_loss: AuxLoss::AllLayers,
        aux_loss_coef: 0.5,
        ..lm(2, true, false)
    };
    case(
        "all-layers aux, two devices × two micro-batches",
        &c,
        engine_config(2, 2),
        4,
        12,
    );
}

#[test]
fn two_devices_two_micro_batches_top2() {
    let c = lm(2, true, false);
    let config = engine_config(2, 2);
    case("two devices × two micro-batches, top-2", &c, config, 4, 12);
}

/// The oracle's own backward against central differences of its own
/// forward, for every parameter of a small model (top-2 renormalized and
/// untied; top-1 plain and tied), over two parts. f64 with step 1e-6: the
/// truncation error is ~1e-12 |f'''| and the rounding ~1e-16 / 1e-6, so a
/// relative 1e-6 (floored at 1e-2 in the denominator) holds for a smooth
/// loss, which this one is away from a routing tie (the margin is checked).
#[test]
fn the_oracle_backward_matches_its_own_central_differences() {
    for (top_k, renormalize, tied, aux_loss) in [
        (2, true, false, AuxLoss::PerLayer),
        (1, false, true, AuxLoss::PerLayer),
        (2, true, false, AuxLoss::AllLayers),
    ] {
        let c = LmConfig {
            aux_loss,
            vocab: 12,
            d_model: 8,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            d_ff: 6,
            ..lm(top_k, renormalize, tied)
        };
        let shape = shape_of(&c);
        let mut params = Params::zeros(&shape);
        for (i, (_, t)) in params.named_mut().into_iter().enumerate() {
            let n = t.len();
            *t = common::values(n, 100 + i as u64, 0.6);
        }
        let parts: Vec<Part> = (0..2)
            .map(|i| Part {
                seq_len: 5,
                tokens: tokens(c.vocab, 2, 5, 40 + i),
            })
            .collect();
        let mut grads = Params::zeros(&shape);
        let base = oracle::step(&shape, &params, &parts, Some(&mut grads));
        assert!(base.routing_margin > 1e-3, "margin {}", base.routing_margin);
        let h = 1e-6;
        let mut worst = 0.0f64;
        let mut checked = 0;
        let analytic = grads.named();
        for (ti, (name, g)) in analytic.iter().enumerate() {
            for (i, &analytic) in g.iter().enumerate() {
                let at = |delta: f64| {
                    let mut p = params.clone();
                    p.named_mut()[ti].1[i] += delta;
                    oracle::step(&shape, &p, &parts, None).total
                };
                let numeric = (at(h) - at(-h)) / (2.0 * h);
                let err = (numeric - analytic).abs() / numeric.abs().max(analytic.abs()).max(1e-2);
                assert!(
                    err < 1e-6,
                    "{name}[{i}]: numeric {numeric} analytic {analytic}"
                );
                worst = worst.max(err);
                checked += 1;
            }
        }
        eprintln!("top-{top_k}, tied {tied}: {checked} params, worst relative error {worst:.1e}");
    }
}
