//! Token condensation (`EngineConfig::condense`): a setting that condenses
//! nothing trains to exact training's bits; where tokens are exact
//! duplicates (two sequences repeated in the batch), the condensed step's
//! loss and every gradient are the exact step's, up to f32's reassociation
//! (the representative carries its twin's output gradient, and the twin's
//! input gets none through the expert, which its identical context makes
//! the same sum); on one device and two; and what cannot run is refused.

mod common;

use common::tiny_lm::tiny_config;
use strata::condense::{CondenseConfig, Search, Threshold};
use strata::engine::{Engine, EngineConfig, Gradients};
use strata::lm::{MoeLm, TokenBatch};
use strata::EngineError;

fn config(devices: usize, condense: Option<CondenseConfig>) -> EngineConfig {
    EngineConfig {
        optimizer_threads: 1,
        devices,
        condense,
        ..EngineConfig::default()
    }
}

fn condense(threshold: f32, max_share: f32, search: Search) -> Option<CondenseConfig> {
    Some(CondenseConfig {
        threshold: Threshold::Fixed(threshold),
        max_share,
        search,
    })
}

/// `pairs` pairs of sequences of 8 tokens, each pair's second a copy of
/// its first.
fn twin_batch(pairs: u32, step: u32) -> TokenBatch {
    let seq = |s: u32| (0..9u32).map(move |i| ((s * 9 + i) * 37 + 5 + 11 * step) % 250);
    TokenBatch {
        seq_len: 8,
        tokens: (0..pairs).flat_map(|p| seq(p).chain(seq(p))).collect(),
        loss_mask: None,
        doc_starts: None,
    }
}

/// ‖a − b‖ / ‖b‖.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

fn compare_gradients(lm: &MoeLm, got: &Gradients, want: &Gradients) {
    let loss_rel = ((got.loss - want.loss) / want.loss).abs();
    assert!(loss_rel < 1e-6, "loss {} against {}", got.loss, want.loss);
    for t in lm.tensors() {
        let r = t.range.clone();
        let e = rel(&got.dense[r.clone()], &want.dense[r]);
        assert!(e < 1e-4, "{}: {e:e}", t.name);
    }
    for (l, (a, b)) in got.experts.iter().zip(&want.experts).enumerate() {
        for (x, (ga, gb)) in a.iter().zip(b).enumerate() {
            match (ga, gb) {
                (Some(ga), Some(gb)) => {
                    let e = rel(ga, gb);
                    assert!(e < 1e-4, "expert {l}.{x}: {e:e}");
                }
                (None, None) => {}
                _ => panic!("expert {l}.{x} reached in one run alone"),
            }
        }
    }
}

#[test]
fn a_setting_that_condenses_nothing_trains_to_exact_bits() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let mut exact = Engine::new_network(&lm, config(1, None)).unwrap();
    // A cap of 0 lets no row join another, however similar.
    let none = condense(0.5, 0.0, Search::AllPairs);
    let mut capped = Engine::new_network(&lm, config(1, none)).unwrap();
    for step in 0..3 {
        let batch = twin_batch(2, step);
        let a = exact.step_network(&lm, &batch).unwrap();
        let b = capped.step_network(&lm, &batch).unwrap();
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {step}");
        assert_eq!((a.condensed, b.condensed), (0, 0));
        assert_eq!(
            (a.condense_threshold, b.condense_threshold),
            (None, Some(0.5))
        );
    }
    assert_eq!(
        exact.dense_params().unwrap(),
        capped.dense_params().unwrap()
    );
    for (l, e) in [(0, 0), (1, 3)] {
        assert_eq!(
            exact.expert_params(l, e).unwrap(),
            capped.expert_params(l, e).unwrap()
        );
    }
}

#[test]
fn twin_sequences_condense_and_give_the_exact_gradients() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let batch = twin_batch(2, 0);
    let want = Engine::new_network(&lm, config(1, None))
        .unwrap()
        .gradients(&lm, &batch)
        .unwrap();
    for search in [Search::AllPairs, Search::LSH] {
        let mut engine = Engine::new_network(&lm, config(1, condense(0.999, 1.0, search))).unwrap();
        let got = engine.gradients(&lm, &batch).unwrap();
        compare_gradients(&lm, &got, &want);
        // Every assignment of a twin joins its first (and a few more may).
        let m = engine.step_network(&lm, &batch).unwrap();
        let (layers, k, tokens) = (2, 2, 4 * 8);
        assert!(
            m.condensed >= (layers * k * tokens / 2) as u64,
            "{search:?}: {} condensed",
            m.condensed
        );
        let computed: u32 = m.tokens_per_expert.iter().flatten().sum();
        assert_eq!(computed as u64, (layers * k * tokens) as u64 - m.condensed);
    }
}

#[test]
fn two_devices_condense_what_each_sends() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    // Each device's two sequences are twins.
    let batch = twin_batch(2, 1);
    let want = Engine::new_network(&lm, config(2, None))
        .unwrap()
        .gradients(&lm, &batch)
        .unwrap();
    let on = condense(0.999, 1.0, Search::AllPairs);
    let mut engine = Engine::new_network(&lm, config(2, on)).unwrap();
    let got = engine.gradients(&lm, &batch).unwrap();
    compare_gradients(&lm, &got, &want);
    let m = engine.step_network(&lm, &batch).unwrap();
    assert!(m.condensed >= 2 * 2 * 32 / 2, "{}", m.condensed);
}

#[test]
fn an_adaptive_threshold_starts_at_its_start_and_falls_as_the_loss_does() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let adaptive = Some(CondenseConfig {
        threshold: Threshold::Adaptive { start: 0.9 },
        max_share: 0.5,
        search: Search::LSH,
    });
    let mut engine = Engine::new_network(&lm, config(1, adaptive)).unwrap();
    let first = engine.step_network(&lm, &twin_batch(2, 0)).unwrap();
    assert_eq!(first.condense_threshold, Some(0.9));
    assert_eq!(
        engine.condense_losses(),
        (Some(first.loss), Some(first.loss))
    );
    // As if the loss had halved: 1 − 0.1 · (1 + e^0.5) / 2.
    engine.set_condense_losses(Some(4.0), Some(2.0));
    let m = engine.step_network(&lm, &twin_batch(2, 1)).unwrap();
    let h = m.condense_threshold.unwrap();
    assert!(
        (h - (1.0 - 0.05 * (1.0 + 0.5f32.exp()))).abs() < 1e-6,
        "{h}"
    );
    assert_eq!(engine.condense_losses(), (Some(4.0), Some(m.loss)));
}

#[test]
fn what_condensation_cannot_run_with_is_refused_by_name() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let refused = |c: EngineConfig, what: &str| match Engine::new_network(&lm, c) {
        Err(EngineError::Config(e)) => assert!(e.contains(what), "{e}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("{what} accepted"),
    };
    let on = condense(0.9, 0.5, Search::LSH);
    refused(
        EngineConfig {
            trace_routing: true,
            ..config(1, on)
        },
        "trace_routing",
    );
    refused(
        EngineConfig {
            affinity_prefetch: true,
            ..config(1, on)
        },
        "affinity_prefetch",
    );
    refused(
        config(1, condense(1.5, 0.5, Search::LSH)),
        "threshold of 1.5",
    );
    refused(config(1, condense(0.9, -0.1, Search::LSH)), "share cap");
}
