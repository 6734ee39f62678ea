//! Each MoE layer's exchange in parts, on the wire while other parts'
//! experts compute (`EngineConfig::exchange_parts`,
//! `engine/exchange/pipelined.rs`): whatever the parts, the same bits as
//! one exchange; a device that fails between its layers fails the step on
//! every device within a bound, and the steps after it are a fresh
//! engine's.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};

use common::hooked::{around_a_failed_step, on_device_1, Hooked, Pass};
use common::tiny_lm::{tiny_batch, tiny_config};
use strata::engine::{Engine, EngineConfig, ExchangeParts, StepMetrics};
use strata::lm::{LmConfig, MoeLm, TokenBatch};
use strata::math::{AssignmentGrads, Permutation};
use strata::model::{ExpertRunner, Losses, ModelConfig, Network};
use strata::EngineError;

/// Eight experts a layer: four a device on two devices, so up to four
/// parts.
fn lm_config() -> LmConfig {
    LmConfig {
        experts: 8,
        ..tiny_config()
    }
}

fn config(devices: usize, micro_batches: usize, parts: usize) -> EngineConfig {
    EngineConfig {
        devices,
        micro_batches,
        exchange_parts: ExchangeParts::Fixed(parts),
        ..EngineConfig::default()
    }
}

#[derive(Debug, PartialEq)]
struct Run {
    losses: Vec<f32>,
    dense: Vec<f32>,
    experts: Vec<Vec<f32>>,
}

fn train(lm: &(impl Network<Batch = TokenBatch> + Sync), config: EngineConfig, steps: u32) -> Run {
    train_counting(lm, config, steps).0
}

/// The run, and each step's token exchanges.
fn train_counting(
    lm: &(impl Network<Batch = TokenBatch> + Sync),
    config: EngineConfig,
    steps: u32,
) -> (Run, Vec<u64>) {
    let (run, metrics) = train_measured(lm, config, steps);
    (run, metrics.iter().map(|m| m.token_exchanges).collect())
}

/// The run, and each step's metrics.
fn train_measured(
    lm: &(impl Network<Batch = TokenBatch> + Sync),
    config: EngineConfig,
    steps: u32,
) -> (Run, Vec<StepMetrics>) {
    let mut engine = Engine::new_network(lm, config).unwrap();
    let metrics: Vec<_> = (0..steps)
        .map(|s| engine.step_network(lm, &tiny_batch(s)).unwrap())
        .collect();
    let run = Run {
        losses: metrics.iter().map(|m| m.loss).collect(),
        dense: engine.dense_params().unwrap().to_vec(),
        experts: experts_of(&mut engine, lm.moe()),
    };
    (run, metrics)
}

/// Every expert's params, layer by layer.
fn experts_of(engine: &mut Engine, moe: &ModelConfig) -> Vec<Vec<f32>> {
    (0..moe.layers)
        .flat_map(|l| (0..moe.experts).map(move |e| (l, e)))
        .map(|(l, e)| engine.expert_params(l, e).unwrap())
        .collect()
}

#[test]
fn any_number_of_parts_trains_the_same_bits() {
    let lm = MoeLm::new(lm_config()).unwrap();
    let layers = lm_config().layers as u64;
    for (devices, micro_batches) in [(2, 1), (2, 2), (3, 1)] {
        let (one, exchanges) = train_counting(&lm, config(devices, micro_batches, 1), 4);
        // Dispatch and combine, forward and backward, a layer and
        // micro-batch.
        let each = 4 * layers * micro_batches as u64;
        assert!(exchanges.iter().all(|&x| x == each), "{exchanges:?}");
        // 8 parts is more than any device has experts: as many as the
        // busiest device has.
        for parts in [2, 3, 8] {
            let (run, metrics) = train_measured(&lm, config(devices, micro_batches, parts), 4);
            let exchanges: Vec<u64> = metrics.iter().map(|m| m.token_exchanges).collect();
            let most = each * parts.min(lm_config().experts) as u64;
            assert!(
                exchanges.iter().all(|&x| x > each && x <= most),
                "{parts} parts: {exchanges:?} exchanges, one exchange each way {each}"
            );
            // Exactly two exchanges a part: with one micro-batch, the
            // parts each layer and pass went in say how many.
            for m in metrics.iter().filter(|_| micro_batches == 1) {
                let split: usize = m.exchange_layer_parts.iter().flatten().sum();
                assert_eq!(m.token_exchanges, 2 * split as u64, "{parts} parts");
                assert!(m.exchange_layer_parts.iter().flatten().all(|&n| n <= parts));
            }
            assert!(
                run == one,
                "{devices} devices, {micro_batches} micro-batches, {parts} parts: {:?} \
                 against {:?}",
                run.losses,
                one.losses
            );
        }
    }
}

#[test]
fn auto_measures_one_part_then_two_and_trains_the_same_bits() {
    let lm = MoeLm::new(lm_config()).unwrap();
    let layers = lm_config().layers;
    let auto = EngineConfig {
        exchange_parts: ExchangeParts::Auto,
        ..config(2, 1, 1)
    };
    let (one, _) = train_measured(&lm, config(2, 1, 1), 6);
    let (run, metrics) = train_measured(&lm, auto, 6);
    assert!(run == one, "{:?} against {:?}", run.losses, one.losses);
    let each = 4 * layers as u64;
    for (step, m) in metrics.iter().enumerate() {
        assert_eq!(m.exchange_layer_s.len(), layers, "{m:?}");
        assert!(m.exchange_layer_s.iter().flatten().all(|&s| s > 0.0));
        let parts = &m.exchange_layer_parts;
        if step < 3 {
            // An uncounted step, then two of one part.
            assert_eq!(m.token_exchanges, each, "step {step}");
            assert!(parts.iter().flatten().all(|&n| n == 1), "{parts:?}");
        } else if step < 5 {
            // Two steps of two parts, wherever a device has two experts
            // with rows (which 4 a device and top-2 routing give here).
            assert!(
                m.token_exchanges > each,
                "step {step}: {}",
                m.token_exchanges
            );
            assert!(parts.iter().flatten().all(|&n| n == 2), "{parts:?}");
        }
    }
    // No prediction without a fitted link.
    assert!(metrics.iter().all(|m| m.exchange_model_s == 0.0));
}

#[test]
fn auto_settles_within_its_bound_on_counts_the_layers_can_take() {
    let lm = MoeLm::new(lm_config()).unwrap();
    let mut engine = Engine::new_network(
        &lm,
        EngineConfig {
            exchange_parts: ExchangeParts::Auto,
            ..config(2, 1, 1)
        },
    )
    .unwrap();
    // An uncounted step, then two steps of each count to 8 at the most.
    for s in 0..17 {
        assert_eq!(engine.auto_parts(), None, "settled before step {s}");
        engine.step_network(&lm, &tiny_batch(s)).unwrap();
        if engine.auto_parts().is_some() {
            break;
        }
    }
    let chosen = engine.auto_parts().expect("settled within 17 steps");
    // Four experts a device: at most four parts.
    assert!(
        chosen.iter().flatten().all(|&n| (1..=4).contains(&n)),
        "{chosen:?}"
    );
    let m = engine.step_network(&lm, &tiny_batch(17)).unwrap();
    for (ran, settled) in m.exchange_layer_parts.iter().zip(&chosen) {
        assert!(
            ran[0] <= settled[0] && ran[1] <= settled[1],
            "{ran:?} {settled:?}"
        );
    }
}

#[test]
fn a_fitted_link_predicts_each_exchange_and_one_device_fits_nothing() {
    let lm = MoeLm::new(lm_config()).unwrap();
    let mut one = Engine::new_network(&lm, config(1, 1, 1)).unwrap();
    assert_eq!(one.calibrate_exchange().unwrap(), None);
    let m = one.step_network(&lm, &tiny_batch(0)).unwrap();
    assert!(m.exchange_layer_s.is_empty() && m.exchange_layer_parts.is_empty());
    let mut two = Engine::new_network(&lm, config(2, 1, 2)).unwrap();
    let fit = two.calibrate_exchange().unwrap().expect("two devices");
    assert!(fit.fixed_s >= 0.0 && fit.s_per_byte >= 0.0, "{fit:?}");
    let m = two.step_network(&lm, &tiny_batch(0)).unwrap();
    assert!(m.exchange_model_s > 0.0 && m.exchange_s > 0.0, "{m:?}");
}

/// The language model, except that device 1's forward fails once (when
/// armed), at its second MoE layer, while its peer is already in that
/// layer's exchange.
fn fails_on_device_1(
    lm: &MoeLm,
    armed: &AtomicBool,
    pass: Pass<'_, TokenBatch>,
    runner: &mut dyn ExpertRunner,
) -> Result<Losses, EngineError> {
    let never = AtomicBool::new(false);
    let mut runner = FailingRunner {
        inner: runner,
        armed: if on_device_1() { armed } else { &never },
    };
    pass.run(lm, &mut runner)
}

/// Passes every call on, except `forward_layer` of layer 1 when armed.
struct FailingRunner<'a> {
    inner: &'a mut dyn ExpertRunner,
    armed: &'a AtomicBool,
}

impl ExpertRunner for FailingRunner<'_> {
    fn forward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        if layer == 1 && self.armed.swap(false, Ordering::SeqCst) {
            return Err(EngineError::Data("device 1's layer 1 failed".into()));
        }
        self.inner.forward_layer(layer, perm, x, out)
    }
    fn backward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        dout: AssignmentGrads<'_, f32>,
        dx: &mut [f32],
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        self.inner
            .backward_layer(layer, perm, x, dout, dx, last_micro_batch)
    }
    fn take_buffer(&mut self, len: usize) -> Vec<f32> {
        self.inner.take_buffer(len)
    }
    fn give_buffer(&mut self, buf: Vec<f32>) {
        self.inner.give_buffer(buf);
    }
    fn dense_grad_final(&mut self, grad: &[f32], range: std::ops::Range<usize>) {
        self.inner.dense_grad_final(grad, range);
    }
}

#[test]
fn a_device_that_fails_while_its_peer_exchanges_in_parts_fails_the_step_and_leaves_nothing_behind()
{
    let lm = MoeLm::new(lm_config()).unwrap();
    let expected = train(&lm, config(2, 1, 4), 3);
    let (err, losses, (dense, experts)) = around_a_failed_step(
        || Hooked::new(MoeLm::new(lm_config()).unwrap(), fails_on_device_1),
        config(2, 1, 4),
        |engine, lm| {
            (
                engine.dense_params().unwrap().to_vec(),
                experts_of(engine, lm.moe()),
            )
        },
    );
    assert!(err.contains("device 1's layer 1 failed"), "{err}");
    let run = Run {
        losses,
        dense,
        experts,
    };
    assert!(
        run == expected,
        "{:?} against {:?}",
        run.losses,
        expected.losses
    );
}
