//! A run checkpointed, dropped and resumed ends bit-identical to one that
//! never stopped.

use strata::engine::{Engine, EngineConfig};
use strata::model::{fill_uniform, Batch, ModelConfig};
use strata_tiers::{Dtype, Layout};

fn model() -> ModelConfig {
    ModelConfig {
        layers: 2,
        d_model: 16,
        d_ff: 24,
        experts: 6,
        top_k: 1,
        renormalize: false,
        classes: 8,
        ..ModelConfig::default()
    }
}

fn batch(step: u64) -> Batch {
    let m = model();
    let mut inputs = vec![0.0f32; 32 * m.d_model];
    fill_uniform(&mut inputs, 50 + step, 3, 1.0);
    Batch {
        inputs,
        targets: (0..32)
            .map(|i| ((i as u64 * 7 + step) % 8) as u32)
            .collect(),
    }
}

fn config(path: std::path::PathBuf) -> EngineConfig {
    config_streaming(path, 4, EngineConfig::default().host_stream_slots)
}

/// `slots` host slots for 12 records, `stream` of them streaming.
fn config_streaming(path: std::path::PathBuf, slots: u64, stream: Option<usize>) -> EngineConfig {
    let m = model();
    let expert = m.expert_params() as u64 * 2;
    let record = Layout {
        layers: m.layers as u32,
        experts_per_layer: m.experts as u32,
        params_per_expert: m.expert_params() as u64,
        compute_dtype: Dtype::Bf16,
        moments: true,
    }
    .record_bytes();
    EngineConfig {
        store_path: Some(path),
        compute_dtype: Dtype::Bf16,
        device_budget_bytes: 2 * expert,
        host_budget_bytes: slots * record,
        host_stream_slots: stream,
        ..EngineConfig::default()
    }
}

fn params(engine: &mut Engine) -> (Vec<f32>, Vec<f32>, Vec<u64>) {
    let m = model();
    let mut experts = Vec::new();
    let mut steps = Vec::new();
    for l in 0..m.layers {
        for e in 0..m.experts {
            experts.extend(engine.expert_params(l, e).unwrap());
            steps.push(engine.expert_step(l, e).unwrap());
        }
    }
    (engine.dense_params().unwrap().to_vec(), experts, steps)
}

#[test]
fn a_resumed_run_is_bit_identical_to_an_uninterrupted_one() {
    resumed_run_matches(4, EngineConfig::default().host_stream_slots, 0, 0);
}

/// Records kept in host memory reach the store only at checkpoints: the
/// resumed run still starts from their checkpointed versions.
#[test]
fn a_resumed_run_with_kept_records_is_bit_identical_too() {
    resumed_run_matches(4, Some(3), 1, 0);
}

/// With 4 of 8 host slots kept, the last layer's other 2 experts hold
/// their updates for the next step's forward. The checkpoint applies
/// them first (the uninterrupted run applies them in step 5's forward):
/// the stored records are those of the 5 steps, and the resumed run,
/// which holds nothing at its start, goes on from them.
#[test]
fn a_resumed_run_with_deferred_updates_is_bit_identical_too() {
    resumed_run_matches(8, Some(4), 4, 2);
}

fn resumed_run_matches(slots: u64, stream: Option<usize>, kept: usize, deferred: usize) {
    let config = |path| config_streaming(path, slots, stream);
    let dir = tempfile::tempdir().unwrap();
    let mut straight = Engine::new(model(), config(dir.path().join("a.strata"))).unwrap();
    assert_eq!(straight.host_kept(), kept);
    assert_eq!(straight.deferred_updates(), deferred);
    for s in 0..8 {
        straight.step(&batch(s)).unwrap();
    }
    let expected = params(&mut straight);

    let path = dir.path().join("b.strata");
    let mut first = Engine::new(model(), config(path.clone())).unwrap();
    for s in 0..5 {
        first.step(&batch(s)).unwrap();
    }
    first.checkpoint().unwrap();
    // Steps after the checkpoint are lost with the process.
    first.step(&batch(5)).unwrap();
    drop(first);

    let mut resumed = Engine::resume(model(), config(path.clone())).unwrap();
    assert_eq!(resumed.steps(), 5);
    for s in 5..8 {
        resumed.step(&batch(s)).unwrap();
    }
    let got = params(&mut resumed);
    assert!(got.0 == expected.0, "dense params differ after resume");
    assert!(got.1 == expected.1, "expert params differ after resume");
    assert_eq!(
        got.2, expected.2,
        "per-expert step counts differ after resume"
    );
    // The committed step's dense file is kept, and the previous
    // checkpoint's (should the newest superblock be damaged, the store
    // opens the previous checkpoint), no more.
    let dense_files = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("b.strata.dense-")
        })
        .count();
    assert_eq!(dense_files, 2);
}

#[test]
fn resuming_without_a_store_or_with_another_model_is_refused() {
    let err = Engine::resume(model(), EngineConfig::default())
        .err()
        .unwrap();
    assert!(err.to_string().contains("needs a store_path"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.strata");
    drop(Engine::new(model(), config(path.clone())).unwrap());
    let other = ModelConfig {
        d_ff: 32,
        ..model()
    };
    let err = Engine::resume(other, config(path)).err().unwrap();
    assert!(err.to_string().contains("layout"), "{err}");
}
