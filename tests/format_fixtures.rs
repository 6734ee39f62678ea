//! Format compatibility: a store file and its dense-state file written by
//! format version 1 are committed under `tests/fixtures/format-v1/`, and
//! today's code must resume them, bit for bit, and write the very same
//! bytes for the same run. (docs/formats.md describes both files byte by
//! byte.) A change that alters either file fails here: either it is a
//! mistake, or it is a new format version, which bumps the version number,
//! keeps reading version 1 (this test stays), and adds its own fixtures
//! (`cargo test --test format_fixtures -- --ignored` writes them). A change
//! of the arithmetic that leaves the format alone (the values in the files
//! differ, not their layout) rewrites these fixtures, and says so in its
//! commit.

use std::path::{Path, PathBuf};

use strata::engine::{Engine, EngineConfig};
use strata::model::{fill_uniform, Batch, ModelConfig};
use strata_tiers::Dtype;

const FILES: [&str; 2] = ["experts.strata", "experts.strata.dense-2"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format-v1")
}

fn model() -> ModelConfig {
    ModelConfig {
        layers: 1,
        d_model: 4,
        d_ff: 8,
        experts: 2,
        top_k: 1,
        renormalize: false,
        classes: 4,
        seed: 9,
        ..ModelConfig::default()
    }
}

fn config(store: PathBuf) -> EngineConfig {
    EngineConfig {
        store_path: Some(store),
        compute_dtype: Dtype::F32,
        device_budget_bytes: 1 << 20,
        host_budget_bytes: 1 << 20,
        optimizer_threads: 1,
        ..EngineConfig::default()
    }
}

fn batch(step: u64) -> Batch {
    let t = 6;
    let mut inputs = vec![0.0f32; t * 4];
    fill_uniform(&mut inputs, 50 + step, 1, 1.0);
    Batch {
        inputs,
        targets: (0..t as u32).map(|i| i % 4).collect(),
    }
}

/// Two steps, committed: what the fixtures hold.
fn write_run(dir: &Path) {
    let mut engine = Engine::new(model(), config(dir.join(FILES[0]))).unwrap();
    for s in 0..2 {
        engine.step(&batch(s)).unwrap();
    }
    engine.checkpoint().unwrap();
}

/// Everything a resumed engine holds, and the losses of two more steps.
fn state_after_resume(dir: &Path) -> (Vec<f32>, Vec<Vec<f32>>, Vec<u64>, Vec<f32>) {
    let m = model();
    let mut engine = Engine::resume(m.clone(), config(dir.join(FILES[0]))).unwrap();
    assert_eq!(engine.steps(), 2);
    let dense = engine.dense_params().unwrap().to_vec();
    let mut experts = Vec::new();
    let mut steps = Vec::new();
    for e in 0..m.experts {
        experts.push(engine.expert_params(0, e).unwrap());
        steps.push(engine.expert_step(0, e).unwrap());
    }
    let losses = (2..4)
        .map(|s| engine.step(&batch(s)).unwrap().loss)
        .collect();
    (dense, experts, steps, losses)
}

fn copy_fixtures(to: &Path) {
    for f in FILES {
        std::fs::copy(fixtures().join(f), to.join(f))
            .unwrap_or_else(|e| panic!("{}: {e}", fixtures().join(f).display()));
    }
}

#[test]
fn files_of_format_version_1_resume_bit_for_bit() {
    let old = tempfile::tempdir().unwrap();
    copy_fixtures(old.path());
    let today = tempfile::tempdir().unwrap();
    write_run(today.path());
    // Params, per-expert steps and moments (through two more steps' losses).
    assert_eq!(
        state_after_resume(old.path()),
        state_after_resume(today.path()),
        "a run written by format version 1 resumes to another state than today's"
    );
}

#[test]
fn today_s_code_writes_the_bytes_of_format_version_1() {
    let today = tempfile::tempdir().unwrap();
    write_run(today.path());
    for f in FILES {
        let committed = std::fs::read(fixtures().join(f)).unwrap();
        let written = std::fs::read(today.path().join(f)).unwrap();
        assert_eq!(committed.len(), written.len(), "{f}: another length");
        if let Some(at) = committed.iter().zip(&written).position(|(a, b)| a != b) {
            panic!(
                "{f}: byte {at} differs from the committed version-1 file; a format change \
                 needs a new version number (see this file's header)"
            );
        }
    }
}

/// Writes the fixtures (by hand, for a new format version's folder).
#[test]
#[ignore]
fn write_the_fixtures() {
    std::fs::create_dir_all(fixtures()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path());
    for f in FILES {
        std::fs::copy(dir.path().join(f), fixtures().join(f)).unwrap();
    }
}
