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

/// On a GPU the routing stays in device memory and the host learns only
/// each expert's count, unless the trace asks for every token's experts:
/// the trace then holds each token's pairs, its margins are the counts the
/// step reports, and asking for it changes no bit of the step.
#[cfg(feature = "cuda")]
#[test]
fn a_gpu_run_traces_the_routing_it_keeps_on_the_device() {
    use common::tiny_lm::tiny_config;
    use strata::backend::BackendKind;
    use strata::lm::{LmConfig, MoeLm, TokenBatch};
    if let Err(e) = BackendKind::Cuda.check(0..1, strata_tiers::Dtype::Bf16) {
        common::cuda_case_skipped(e);
        return;
    }
    let lm = MoeLm::new(LmConfig {
        layers: 3,
        ..tiny_config()
    })
    .unwrap();
    let batch = TokenBatch {
        seq_len: 8,
        tokens: (0..4 * 9u32).map(|i| (i * 37 + 5) % 250).collect(),
        loss_mask: None,
        doc_starts: None,
    };
    let run = |trace_routing| {
        let config = EngineConfig {
            backend: BackendKind::Cuda,
            optimizer_threads: 1,
            trace_routing,
            ..EngineConfig::default()
        };
        let mut engine = Engine::new_network(&lm, config).unwrap();
        let steps: Vec<_> = (0..2)
            .map(|_| engine.step_network(&lm, &batch).unwrap())
            .collect();
        let params = engine.dense_params().unwrap().to_vec();
        (steps, params, engine.routing_trace().cloned())
    };
    let (traced_steps, traced_params, trace) = run(true);
    let (steps, params, none) = run(false);
    assert!(none.is_none());
    let bits =
        |s: &[strata::engine::StepMetrics]| s.iter().map(|m| m.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&traced_steps), bits(&steps), "the losses");
    assert!(traced_params == params, "the params");
    let trace = trace.unwrap();
    let (e, k) = (trace.experts, trace.top_k);
    for (l, pairs) in trace.transitions.iter().enumerate() {
        for a in 0..e {
            let row: u64 = pairs[a * e..(a + 1) * e].iter().sum();
            let col: u64 = (0..e).map(|x| pairs[x * e + a]).sum();
            let counted = |layer: usize| -> u64 {
                traced_steps
                    .iter()
                    .map(|m| m.tokens_per_expert[layer][a] as u64)
                    .sum()
            };
            assert_eq!(row, counted(l) * k as u64, "layer {l}, expert {a}'s pairs");
            assert_eq!(
                col,
                counted(l + 1) * k as u64,
                "layer {}, expert {a}'s pairs",
                l + 1
            );
        }
    }
}
