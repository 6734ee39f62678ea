//! `ExpertCompute::Modeled`: a device modeled by its FLOP rate. Its steps
//! skip the expert GEMMs as the I/O-only run's do, so they change the same
//! bits, and hold the device's thread for at least the modeled time.

mod common;

use common::{batch, hyper, model, record_bytes};
use strata::engine::{Engine, EngineConfig, ExpertCompute};
use strata::math::ExpertKind;
use strata_tiers::Dtype;

fn engine(dir: &std::path::Path, name: &str, expert_compute: ExpertCompute) -> Engine {
    let model = model(2, ExpertKind::SwiGlu);
    let expert_bytes = (model.expert_params() * 4) as u64;
    Engine::new(
        model.clone(),
        EngineConfig {
            store_path: Some(dir.join(format!("{name}.strata"))),
            device_budget_bytes: 2 * expert_bytes,
            host_budget_bytes: 4 * record_bytes(&model),
            compute_dtype: Dtype::F32,
            hyper: hyper(),
            optimizer_threads: 2,
            expert_compute,
            ..EngineConfig::default()
        },
    )
    .unwrap()
}

#[test]
fn a_modeled_device_changes_the_bits_a_skipped_compute_does_and_takes_its_time() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(2, ExpertKind::SwiGlu);
    // The forward's GEMMs are 2·n·params FLOPs, the backward's twice
    // that: 6·params an assignment, over every layer.
    let flops_per_step =
        |tokens: usize| (6 * tokens * model.top_k * model.expert_params() * model.layers) as f64;
    let tokens = batch(&model, 0).targets.len();
    // 25 ms of modeled compute a step.
    let rate = flops_per_step(tokens) / 0.025;
    let mut skipped = engine(dir.path(), "skipped", ExpertCompute::Skip);
    let mut modeled = engine(
        dir.path(),
        "modeled",
        ExpertCompute::Modeled { flops_per_s: rate },
    );
    for step in 0..3 {
        let b = batch(&model, step);
        let s = skipped.step(&b).unwrap();
        let m = modeled.step(&b).unwrap();
        assert_eq!(s.loss.to_bits(), m.loss.to_bits(), "step {step}");
        let slept: f64 = m.expert_compute_s_per_device.iter().sum();
        let none: f64 = s.expert_compute_s_per_device.iter().sum();
        assert!(slept >= 0.025, "step {step}: {slept} s of modeled compute");
        assert_eq!(none, 0.0, "step {step}");
        assert!(m.wall_s >= slept, "step {step}");
    }
    skipped.drain().unwrap();
    modeled.drain().unwrap();
    assert_eq!(
        skipped.dense_params().unwrap(),
        modeled.dense_params().unwrap()
    );
    for layer in 0..model.layers {
        for expert in 0..model.experts {
            let (s, m) = (
                skipped.expert_params(layer, expert).unwrap(),
                modeled.expert_params(layer, expert).unwrap(),
            );
            assert!(
                s.iter().zip(&m).all(|(a, b)| a.to_bits() == b.to_bits()),
                "expert {layer}.{expert}"
            );
        }
    }
}

#[test]
fn a_modeled_device_without_a_positive_rate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = model(2, ExpertKind::SwiGlu);
    for rate in [0.0, -1e9, f64::NAN, f64::INFINITY] {
        let config = EngineConfig {
            store_path: Some(dir.path().join("bad.strata")),
            expert_compute: ExpertCompute::Modeled { flops_per_s: rate },
            ..EngineConfig::default()
        };
        let err = Engine::new(model.clone(), config).err().unwrap();
        assert!(
            err.to_string()
                .contains("the modeled device's rate must be a positive number of FLOP/s"),
            "{err}"
        );
    }
}
