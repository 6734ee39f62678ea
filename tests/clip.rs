//! Clipping the global gradient norm (`EngineConfig::clip_grad_norm`), as
//! torch's `clip_grad_norm_`: the norm over every dense and expert
//! gradient of the step, each gradient times min(1, max / (norm + 1e-6)).
//!
//! The step is read through a scale-keeping AdamW (β1 = β2 = 0, ε = 1, as
//! in `oracle_lm`): Δ = −lr · g' / (|g'| + 1) for the clipped gradient g'.

mod common;

use common::tiny_lm::tiny_config;
use strata::engine::{Engine, EngineConfig, ScheduleKind};
use strata::lm::{MoeLm, TokenBatch};
use strata_optim::AdamWHyper;
use strata_tiers::Dtype;

fn config(clip: Option<f32>) -> EngineConfig {
    EngineConfig {
        hyper: AdamWHyper {
            lr: 1.0,
            beta1: 0.0,
            beta2: 0.0,
            eps: 1.0,
            weight_decay: 0.0,
        },
        schedule: ScheduleKind::Naive,
        clip_grad_norm: clip,
        micro_batches: 2,
        compute_dtype: Dtype::F32,
        optimizer_threads: 2,
        ..EngineConfig::default()
    }
}

fn batch() -> TokenBatch {
    TokenBatch {
        seq_len: 8,
        tokens: (0..4 * 9u32).map(|i| (i * 37 + 5) % 250).collect(),
        loss_mask: None,
        doc_starts: None,
    }
}

/// Every parameter, dense then experts.
fn params(lm: &MoeLm, engine: &mut Engine) -> Vec<f32> {
    let mut p = engine.dense_params().unwrap().to_vec();
    for l in 0..lm.config().layers {
        for e in 0..lm.config().experts {
            p.extend(engine.expert_params(l, e).unwrap());
        }
    }
    p
}

#[test]
fn a_clipped_step_scales_every_gradient_by_the_global_factor() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let c = lm.config();
    let mut probe = Engine::new_network(&lm, config(None)).unwrap();
    let grads = probe.gradients(&lm, &batch()).unwrap();
    let mut flat: Vec<f32> = grads.dense.clone();
    for layer in &grads.experts {
        for g in layer {
            match g {
                Some(g) => flat.extend(g),
                None => flat.extend(vec![0.0; 3 * c.d_model * c.d_ff]),
            }
        }
    }
    let norm = flat
        .iter()
        .map(|&g| g as f64 * g as f64)
        .sum::<f64>()
        .sqrt();
    let max = (norm / 4.0) as f32;
    let scale = (max as f64 / (norm + 1e-6)) as f32;

    let mut engine = Engine::new_network(&lm, config(Some(max))).unwrap();
    let before = params(&lm, &mut engine);
    let metrics = engine.step_network(&lm, &batch()).unwrap();
    let after = params(&lm, &mut engine);
    let reported = metrics.grad_norm.expect("a clipped step reports its norm");
    assert!(
        (reported - norm).abs() < 1e-6 * norm,
        "{reported} vs {norm}"
    );
    let (mut diff, mut size) = (0.0f64, 0.0f64);
    for ((&b, &a), &g) in before.iter().zip(&after).zip(&flat) {
        let g = (scale * g) as f64;
        let want = -g / (g.abs() + 1.0);
        diff += ((a - b) as f64 - want).powi(2);
        size += want * want;
    }
    let rel = (diff / size).sqrt();
    assert!(
        rel < 1e-5,
        "the clipped step is {rel:e} from the expected one"
    );
    // Unclipped, the step differs by about the factor: the test can fail.
    let mut plain = Engine::new_network(&lm, config(None)).unwrap();
    plain.step_network(&lm, &batch()).unwrap();
    let moved: f64 = params(&lm, &mut plain)
        .iter()
        .zip(&before)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    assert!((moved / size).sqrt() > 2.0, "clipping changed nothing");
}

#[test]
fn a_norm_under_the_bound_changes_no_bit() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let run = |clip| {
        let mut engine = Engine::new_network(&lm, config(clip)).unwrap();
        for _ in 0..2 {
            engine.step_network(&lm, &batch()).unwrap();
        }
        params(&lm, &mut engine)
    };
    assert!(run(Some(1e6)) == run(None));
}

#[test]
fn clipping_needs_the_naive_schedule_and_a_positive_bound() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let wise = EngineConfig {
        schedule: ScheduleKind::ExpertWise,
        ..config(Some(1.0))
    };
    let err = Engine::new_network(&lm, wise).err().unwrap().to_string();
    assert!(
        err.contains("clip_grad_norm needs ScheduleKind::Naive"),
        "{err}"
    );
    let err = Engine::new_network(&lm, config(Some(0.0)))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("must be a positive number"), "{err}");
}
