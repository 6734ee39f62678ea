//! The routing trace (`EngineConfig::trace_routing`): every token's k × k
//! transitions between consecutive MoE layers, summed over steps, the same
//! whatever the devices and micro-batches.

mod common;

use strata::engine::{Engine, EngineConfig, RoutingTrace};
use strata::math::ExpertKind;

fn traced(devices: usize, micro_batches: usize) -> RoutingTrace {
    let model = strata::model::ModelConfig {
        layers: 3,
        ..common::model(2, ExpertKind::SwiGlu)
    };
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            devices,
            micro_batches,
            optimizer_threads: 1,
            trace_routing: true,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    for step in 0..2 {
        let batch = common::batch(&model, step);
        engine.step(&batch).unwrap();
        // An evaluation routes too, and is not counted.
        engine.evaluate(&model, &batch).unwrap();
    }
    engine.routing_trace().unwrap().clone()
}

#[test]
fn every_token_adds_its_pairs_whatever_the_devices_and_micro_batches() {
    let one = traced(1, 1);
    let model = common::model(2, ExpertKind::SwiGlu);
    let tokens = common::batch(&model, 0).targets.len() as u64;
    assert_eq!((one.steps, one.transitions.len()), (2, 2));
    for pairs in &one.transitions {
        assert_eq!(pairs.iter().sum::<u64>(), 2 * tokens * 2 * 2);
    }
    for l in 0..2 {
        let p = one.conditional(l);
        for row in p.chunks_exact(one.experts) {
            let sum: f64 = row.iter().sum();
            assert!(sum == 0.0 || (sum - 1.0).abs() < 1e-12, "{sum}");
        }
    }
    assert_eq!(traced(1, 2), one, "two micro-batches");
    assert_eq!(traced(2, 1), one, "two devices");

    // A resumed run continues its trace; a trace of another shape is refused.
    let json: serde_json::Value = serde_json::from_str(&one.to_json()).unwrap();
    assert_eq!(json["conditional"].as_array().unwrap().len(), 2);
    let back: RoutingTrace = serde_json::from_value(json).unwrap();
    assert_eq!(back, one);
    let model3 = strata::model::ModelConfig {
        layers: 3,
        ..model.clone()
    };
    let mut engine = Engine::new(
        model3,
        EngineConfig {
            trace_routing: true,
            optimizer_threads: 1,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    engine.set_routing_trace(back).unwrap();
    let other = RoutingTrace::new(2, 8, 2);
    let err = engine.set_routing_trace(other).unwrap_err().to_string();
    assert!(err.contains("does not continue"), "{err}");
}
