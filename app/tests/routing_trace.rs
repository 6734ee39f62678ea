//! `--trace-routing FILE`: written with every checkpoint, continued by a
//! resumed run (from the trace of the checkpoint before where the last
//! one did not commit), its counts and conditional probabilities
//! consistent.

mod common;

use std::sync::atomic::AtomicBool;

use common::tiny_lm::{flags_holding, tiny_config, write_checkpoint};
use strata_cli::trainer::{self, Source, TrainFlags};

fn read(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn the_routing_trace_follows_the_checkpoints_and_the_resume() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let model = dir.path().join("model");
    write_checkpoint(&model, &config);
    let out = dir.path().join("run");
    let trace = dir.path().join("routing.json");
    let flags = |steps| TrainFlags {
        steps: Some(steps),
        eval_every: Some(0),
        checkpoint_every: Some(2),
        trace_routing: Some(trace.clone()),
        out: Some(out.clone()),
        ..flags_holding(&out, 6)
    };
    let from = Source::Finetune(model);
    trainer::run(&flags(3), from.clone(), &AtomicBool::new(false)).unwrap();
    let first = read(&trace);
    assert_eq!(first["steps"], 3);
    let pairs = |v: &serde_json::Value| -> Vec<u64> {
        v["transitions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                l.as_array()
                    .unwrap()
                    .iter()
                    .map(|c| c.as_u64().unwrap())
                    .sum()
            })
            .collect()
    };
    // seq_len 16 × batch 4 tokens a step, top-k × top-k pairs each.
    let k = config.top_k as u64;
    let per_step = 16 * 4 * k * k;
    assert_eq!(pairs(&first), vec![3 * per_step; config.layers - 1]);
    for row in first["conditional"][0]
        .as_array()
        .unwrap()
        .chunks(config.experts)
    {
        let sum: f64 = row.iter().map(|p| p.as_f64().unwrap()).sum();
        assert!(sum == 0.0 || (sum - 1.0).abs() < 1e-9, "{sum}");
    }

    // The trace of the checkpoint before is kept beside it.
    let prev = dir.path().join("routing.json.prev");
    assert_eq!(read(&prev)["steps"], 2);
    // As a run stopped between its trace of step 4 and that checkpoint's
    // commit leaves them: the resume takes the trace of step 3.
    std::fs::rename(&trace, &prev).unwrap();
    let mut ahead = first.clone();
    ahead["steps"] = 4.into();
    std::fs::write(&trace, ahead.to_string()).unwrap();
    let resumed = TrainFlags {
        resume: true,
        ..flags(5)
    };
    trainer::run(&resumed, from, &AtomicBool::new(false)).unwrap();
    let second = read(&trace);
    assert_eq!(second["steps"], 5);
    assert_eq!(pairs(&second), vec![5 * per_step; config.layers - 1]);
}
