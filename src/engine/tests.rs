use super::*;
use crate::model::{fill_uniform, Batch};

/// `tokens` tokens of uniform(±1) inputs drawn from `seed`.
fn batch_of(model: &ModelConfig, tokens: usize, seed: u64) -> Batch {
    let mut inputs = vec![0.0f32; tokens * model.d_model];
    fill_uniform(&mut inputs, seed, 1, 1.0);
    let targets = (0..tokens as u32)
        .map(|i| i % model.classes as u32)
        .collect();
    Batch { inputs, targets }
}

#[test]
fn a_step_leaves_its_layer_buffers_for_the_next() {
    let model = ModelConfig {
        layers: 3,
        ..ModelConfig::default()
    };
    let mut engine = Engine::new(model.clone(), EngineConfig::default()).unwrap();
    let batch = batch_of(&model, 40, 5);
    assert_eq!(engine.devices[0].buffers.kept(), 0);
    for _ in 0..2 {
        engine.step(&batch).unwrap();
        // Three per layer (its experts' outputs, its norm's input and
        // output, kept from its forward to its backward) and the
        // step's four besides (the stack's output, which the head
        // reads; the backward's (T·K, D) buffer of its experts' input
        // gradients; the residual gradient in and out), handed back
        // within the bound.
        assert_eq!(engine.devices[0].buffers.kept(), 3 * model.layers + 4);
    }
}

#[test]
fn saved_activations_stay_within_a_quarter_over_a_pass_s_need() {
    let model = ModelConfig {
        layers: 2,
        ..ModelConfig::default()
    };
    let mut engine = Engine::new(model.clone(), EngineConfig::default()).unwrap();
    let held = |engine: &Engine| -> usize {
        let saved = engine.devices[0].saved.iter().flatten();
        saved.map(|s| s.a.capacity() + s.b.capacity()).sum()
    };
    engine.step(&batch_of(&model, 64, 64)).unwrap();
    let large = held(&engine);
    // Two vectors (n, d_ff) an expert, n summing to tokens × top_k.
    let need = |tokens: usize| 2 * tokens * model.top_k * model.d_ff * model.layers;
    assert!(large >= need(64), "{large} values held");
    for _ in 0..3 {
        engine.step(&batch_of(&model, 4, 4)).unwrap();
        let small = held(&engine);
        assert!(
            small <= need(4) * 5 / 4,
            "{small} values held for {}",
            need(4)
        );
    }
    // Tokens growing a little each step: each buffer grows to what its
    // pass needs, not to twice its capacity; then falling by a third:
    // one held over a quarter above its need is let go.
    for tokens in [40, 44, 48, 52, 36] {
        engine.step(&batch_of(&model, tokens, 4)).unwrap();
        let held = held(&engine);
        assert!(
            held <= need(tokens) * 5 / 4,
            "{held} values held for {}",
            need(tokens)
        );
    }
}

/// Experts whose updates take far longer than their backward (many
/// params, a few rows each, one optimizer thread): the updates would
/// pile up behind the backward but for the device's bound on those in
/// flight. In every schedule the gradient buffers the engine makes stay
/// within the host plan's count.
#[test]
fn expert_gradients_alive_stay_within_the_host_plan() {
    let model = ModelConfig {
        layers: 4,
        d_model: 32,
        d_ff: 1024,
        ..ModelConfig::default()
    };
    let base = EngineConfig {
        optimizer_threads: 1,
        ..EngineConfig::default()
    };
    let configs = [
        base.clone(),
        EngineConfig {
            expert_group: Some(1),
            ..base.clone()
        },
        EngineConfig {
            micro_batches: 2,
            ..base.clone()
        },
        EngineConfig {
            schedule: ScheduleKind::Naive,
            ..base.clone()
        },
        EngineConfig {
            devices: 2,
            ..base.clone()
        },
    ];
    // Records streaming through fewer host slots than a layer has
    // experts, on one device and on two.
    let record = Engine::layout(&model, &base).record_bytes();
    let streaming = EngineConfig {
        host_budget_bytes: 3 * record,
        ..base.clone()
    };
    let configs = configs.into_iter().chain([
        streaming.clone(),
        EngineConfig {
            devices: 2,
            ..streaming.clone()
        },
    ]);
    for config in configs {
        let planned = host_plan::gradient_buffers(&Engine::layout(&model, &config), &config);
        let mut engine = Engine::new(model.clone(), config.clone()).unwrap();
        for seed in 0..8 {
            engine.step(&batch_of(&model, 16, seed)).unwrap();
        }
        let made = engine.shared.grads.held_max();
        assert!(
            made <= planned,
            "{made} gradient buffers held, {planned} planned: {config:?}"
        );
    }
}

#[test]
fn trainable_runs_are_the_complement_of_the_frozen_ranges() {
    let runs =
        |frozen: &[std::ops::Range<usize>]| super::trainable_runs(10, frozen).collect::<Vec<_>>();
    let one = |r: std::ops::Range<usize>| vec![r];
    assert_eq!(runs(&[]), one(0..10));
    assert_eq!(runs(&[2..4, 6..7]), [0..2, 4..6, 7..10]);
    assert_eq!(runs(&[0..3, 8..10]), one(3..8));
    assert!(runs(&one(0..10)).is_empty());
}
