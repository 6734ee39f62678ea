//! The dense gradient all-reduced in buckets beside the backward
//! (`engine/dense_buckets.rs`): whatever the buckets, the same bits; a
//! device that fails with a bucket on its way fails the step, within a
//! bound, and leaves nothing behind for the next.
//!
//! That the bucketed gradient is the right one is `oracle_lm`'s to show
//! (its two-device cases send each layer alone and compare every tensor
//! with the independent oracle).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};

use common::hooked::{around_a_failed_step, on_device_1, Hooked, Pass};
use common::tiny_lm::{tiny_batch, tiny_config};
use strata::engine::{Engine, EngineConfig};
use strata::lm::{MoeLm, TokenBatch};
use strata::model::{ExpertRunner, Losses, Network};
use strata::EngineError;

fn config(bucket_bytes: usize) -> EngineConfig {
    EngineConfig {
        devices: 2,
        dense_bucket_bytes: bucket_bytes,
        ..EngineConfig::default()
    }
}

/// Each step's loss and, at the end, the dense params.
fn train(lm: &(impl Network<Batch = TokenBatch> + Sync), config: EngineConfig, steps: u32) -> Run {
    let mut engine = Engine::new_network(lm, config).unwrap();
    let losses = (0..steps)
        .map(|s| engine.step_network(lm, &tiny_batch(s)).unwrap().loss)
        .collect();
    Run {
        losses,
        dense: engine.dense_params().unwrap().to_vec(),
    }
}

#[derive(Debug, PartialEq)]
struct Run {
    losses: Vec<f32>,
    dense: Vec<f32>,
}

#[test]
fn any_bucket_size_trains_the_same_bits() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let dense_bytes = 4 * lm.dense_params();
    // Each layer alone; a few layers a bucket; everything after the backward.
    let runs: Vec<Run> = [0, dense_bytes / 3, 2 * dense_bytes]
        .into_iter()
        .map(|bytes| train(&lm, config(bytes), 4))
        .collect();
    for run in &runs[1..] {
        assert!(
            *run == runs[0],
            "{:?} against {:?}",
            run.losses,
            runs[0].losses
        );
    }
}

/// The language model, except that device 1's step fails once (when
/// armed), before its forward, after saying its whole dense gradient final:
/// a bucket is on its way to the reducer of a peer that never sends one.
fn fails_on_device_1(
    lm: &MoeLm,
    armed: &AtomicBool,
    pass: Pass<'_, TokenBatch>,
    runner: &mut dyn ExpertRunner,
) -> Result<Losses, EngineError> {
    if on_device_1() && armed.swap(false, Ordering::SeqCst) {
        runner.dense_grad_final(pass.dense_grad, 0..pass.dense_grad.len());
        return Err(EngineError::Data("device 1's step failed".into()));
    }
    pass.run(lm, runner)
}

#[test]
fn a_device_that_fails_with_a_bucket_on_its_way_fails_the_step_and_leaves_nothing_behind() {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let expected = train(&lm, config(0), 3);
    let (err, losses, dense) = around_a_failed_step(
        || Hooked::new(MoeLm::new(tiny_config()).unwrap(), fails_on_device_1),
        config(0),
        |engine, _| engine.dense_params().unwrap().to_vec(),
    );
    assert!(err.contains("device 1's step failed"), "{err}");
    let run = Run { losses, dense };
    assert!(
        run == expected,
        "{:?} against {:?}",
        run.losses,
        expected.losses
    );
}
