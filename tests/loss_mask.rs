//! Targets that carry no loss (the prompt of an instruction example): the
//! cross-entropy is the mean over the targets that do, and a masked
//! target changes nothing — not the loss, not a gradient, not a bit of
//! the parameters after a step, with micro-batches or without.

mod common;

use common::tiny_lm::tiny_config;
use strata::engine::{Engine, EngineConfig};
use strata::lm::{MoeLm, TokenBatch};
use strata_tiers::Dtype;

const SEQ: usize = 10;

fn config(micro_batches: usize) -> EngineConfig {
    EngineConfig {
        hyper: common::hyper(),
        micro_batches,
        compute_dtype: Dtype::F32,
        optimizer_threads: 2,
        ..EngineConfig::default()
    }
}

/// Four rows; in each, the first half of the targets is a prompt (no
/// loss) and the rest a response. `last` is every row's final token: a
/// target only, never an input.
fn batch(last: u32, masked: bool) -> TokenBatch {
    let mut tokens = Vec::new();
    let mut mask = Vec::new();
    for r in 0..4u32 {
        for i in 0..=SEQ as u32 {
            tokens.push(if i == SEQ as u32 {
                last
            } else {
                (r * 31 + i * 7 + 5) % 250
            });
            // The final token is masked too, so that it changes nothing.
            mask.push(i > SEQ as u32 / 2 && i < SEQ as u32);
        }
    }
    TokenBatch {
        seq_len: SEQ,
        tokens,
        loss_mask: masked.then_some(mask),
        doc_starts: None,
    }
}

#[test]
fn the_loss_is_the_mean_over_the_targets_that_carry_it() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let mut engine = Engine::new_network(&lm, config(1)).unwrap();
    let masked = batch(9, true);
    let plain = batch(9, false);
    assert_eq!(masked.loss_tokens(), 4 * (SEQ / 2 - 1));
    let all = engine.forward(&lm, &plain).unwrap();
    let log_probs = all.target_log_probs();
    let mask = masked.loss_mask.as_ref().unwrap();
    let counted: Vec<f64> = mask
        .chunks_exact(SEQ + 1)
        .flat_map(|row| row[1..].to_vec())
        .zip(&log_probs)
        .filter(|(m, _)| *m)
        .map(|(_, &l)| l as f64)
        .collect();
    let want = -counted.iter().sum::<f64>() / counted.len() as f64;
    let out = engine.forward(&lm, &masked).unwrap();
    assert!(
        (out.loss as f64 - want).abs() < 1e-5 * want,
        "{} vs {want}",
        out.loss
    );
    // A masked target has no log-probability to report.
    let reported = out.target_log_probs();
    assert!(reported[0].is_nan() && !reported[SEQ / 2 + 1].is_nan());
    // The step's loss is the same cross-entropy, plus the aux term.
    let metrics = engine.step_network(&lm, &masked).unwrap();
    let aux = lm.config().aux_loss_coef * out.aux_loss;
    assert!(
        (metrics.loss - (out.loss + aux)).abs() < 1e-5,
        "{} vs {} + {aux}",
        metrics.loss,
        out.loss
    );
    // Throughput counts every token run, not only those with loss.
    assert_eq!(metrics.tokens, 4 * SEQ);
}

/// `Engine::evaluate` (the trainer's held-out loss) takes the head's
/// logits a block of rows at a time and never keeps them whole, and gives
/// the bits of the loss `Engine::forward` computes from every logit, with
/// a mask and without.
#[test]
fn the_held_out_loss_is_the_whole_forward_s() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let mut engine = Engine::new_network(&lm, config(1)).unwrap();
    for masked in [false, true] {
        let b = batch(9, masked);
        let whole = engine.forward(&lm, &b).unwrap().loss;
        let held_out = engine.evaluate(&lm, &b).unwrap();
        assert_eq!(held_out.to_bits(), whole.to_bits(), "masked {masked}");
    }
}

#[test]
fn a_masked_target_changes_no_bit() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    for micro_batches in [1, 2] {
        let run = |last: u32| {
            let mut engine = Engine::new_network(&lm, config(micro_batches)).unwrap();
            let mut losses = Vec::new();
            for _ in 0..2 {
                losses.push(engine.step_network(&lm, &batch(last, true)).unwrap().loss);
            }
            let mut params = engine.dense_params().unwrap().to_vec();
            for l in 0..lm.config().layers {
                for e in 0..lm.config().experts {
                    params.extend(engine.expert_params(l, e).unwrap());
                }
            }
            (losses, params)
        };
        let (a, b) = (run(3), run(200));
        assert_eq!(a.0, b.0, "micro-batches {micro_batches}: losses");
        assert!(a.1 == b.1, "micro-batches {micro_batches}: params differ");
        // Unmasked, the same change moves the loss.
        let lm_engine = |last| {
            let mut engine = Engine::new_network(&lm, config(micro_batches)).unwrap();
            engine.step_network(&lm, &batch(last, false)).unwrap().loss
        };
        assert_ne!(lm_engine(3), lm_engine(200));
    }
}

/// Two documents packed apart in one row give each document's logits as
/// it would alone (RoPE is relative, so only rounding differs), and the
/// first token of the second is no target of the first.
#[test]
fn documents_packed_apart_match_each_document_alone() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let mut engine = Engine::new_network(&lm, config(1)).unwrap();
    let a: Vec<u32> = vec![11, 42, 7, 99, 3];
    let b: Vec<u32> = vec![200, 5, 61, 17, 8, 150];
    let alone = |engine: &mut Engine, doc: &[u32]| {
        let batch = TokenBatch {
            seq_len: doc.len() - 1,
            tokens: doc.to_vec(),
            loss_mask: None,
            doc_starts: None,
        };
        engine.forward(&lm, &batch).unwrap()
    };
    let (ea, eb) = (alone(&mut engine, &a), alone(&mut engine, &b));
    let tokens: Vec<u32> = a.iter().chain(&b).copied().collect();
    let mut starts = vec![false; tokens.len()];
    starts[a.len()] = true;
    let mut mask = vec![true; tokens.len()];
    mask[a.len()] = false;
    let packed = TokenBatch {
        seq_len: tokens.len() - 1,
        tokens,
        loss_mask: Some(mask),
        doc_starts: Some(starts),
    };
    let ep = engine.forward(&lm, &packed).unwrap();
    let v = ep.width;
    let worst = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0.0f32, f32::max)
    };
    let rows = |e: &strata::model::Evaluation, from: usize, n: usize| {
        e.logits[from * v..(from + n) * v].to_vec()
    };
    let (na, nb) = (a.len() - 1, b.len() - 1);
    assert!(worst(&rows(&ep, 0, na), &ea.logits) < 1e-5);
    let db = worst(&rows(&ep, a.len(), nb), &eb.logits);
    assert!(db < 1e-4, "the second document's logits differ by {db}");
    // The loss is the mean over both documents' own targets.
    let want = (ea.loss as f64 * na as f64 + eb.loss as f64 * nb as f64) / (na + nb) as f64;
    assert!(
        (ep.loss as f64 - want).abs() < 1e-5,
        "{} vs {want}",
        ep.loss
    );
    // Without doc_starts, the second document sees the first.
    let across = TokenBatch {
        doc_starts: None,
        ..packed
    };
    let ex = engine.forward(&lm, &across).unwrap();
    assert!(worst(&rows(&ex, a.len(), nb), &eb.logits) > 1e-3);
}
