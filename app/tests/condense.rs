//! `--condense`: recorded in run.json, resumed with the adaptive threshold
//! of a run that never stopped (the same losses, bit for bit), and refused
//! where it cannot run, before anything is written.

mod common;

use std::path::Path;
use std::sync::atomic::AtomicBool;

use common::tiny_lm::{flags_holding, tiny_config, write_checkpoint};
use strata_cli::trainer::{self, Source, TrainFlags};

/// Each step's (step, loss, condensed, threshold) from metrics.jsonl.
fn steps(out: &Path) -> Vec<(u64, f64, u64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter(|v| v.get("loss").is_some()) // not the checkpoints' lines
        .map(|v| {
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap(),
                v["condensed"].as_u64().unwrap(),
                v["condense_threshold"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn a_condensed_run_resumes_to_the_bits_of_one_that_never_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_checkpoint(&model, &tiny_config());
    let from = Source::Finetune(model);
    let flags = |out: &Path, steps| TrainFlags {
        steps: Some(steps),
        eval_every: Some(0),
        checkpoint_every: Some(3),
        // Within the warmup the learning rate is the same whatever the
        // run's length, so a run of 3 steps is the start of one of 6.
        warmup: Some(10),
        backend: Some("cpu".into()),
        condense: Some("adaptive:0.5".into()),
        out: Some(out.to_path_buf()),
        ..flags_holding(out, 6)
    };
    let whole = dir.path().join("whole");
    trainer::run(&flags(&whole, 6), from.clone(), &AtomicBool::new(false)).unwrap();
    let split = dir.path().join("split");
    trainer::run(&flags(&split, 3), from.clone(), &AtomicBool::new(false)).unwrap();
    let resumed = TrainFlags {
        resume: true,
        ..flags(&split, 6)
    };
    trainer::run(&resumed, from, &AtomicBool::new(false)).unwrap();

    let (a, b) = (steps(&whole), steps(&split));
    assert_eq!(a, b);
    assert_eq!(a.len(), 6);
    assert!(a.iter().all(|s| s.2 > 0), "every step condenses: {a:?}");
    // The threshold falls with the loss after the first step.
    assert_eq!(a[0].3, 0.5);
    assert!(a[5].3 < a[1].3, "{a:?}");
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(whole.join("run.json")).unwrap()).unwrap();
    assert_eq!(record["options"]["condense"], "adaptive:0.5");
}

#[test]
fn settings_condensation_cannot_run_with_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_checkpoint(&model, &tiny_config());
    let out = dir.path().join("run");
    let refused = |flags: TrainFlags, what: &str| {
        let e = trainer::run(
            &TrainFlags {
                backend: Some("cpu".into()),
                ..flags
            },
            Source::Finetune(model.clone()),
            &AtomicBool::new(false),
        )
        .unwrap_err();
        assert!(e.contains(what), "{e}");
        assert!(!out.join("run.json").exists(), "{what}: a run was written");
    };
    let with = |condense: &str| TrainFlags {
        condense: Some(condense.into()),
        ..flags_holding(&out, 6)
    };
    refused(with("banana"), "--condense \"banana\"");
    refused(with("adaptive:x"), "--condense \"adaptive:x\"");
    refused(with("1.5"), "threshold of 1.5");
    refused(
        TrainFlags {
            condense_cap: Some(2.0),
            ..with("0.9")
        },
        "share cap of 2",
    );
    refused(
        TrainFlags {
            condense_search: Some("hash".into()),
            ..with("0.9")
        },
        "--condense-search \"hash\"",
    );
    refused(
        TrainFlags {
            trace_routing: Some(dir.path().join("trace.json")),
            ..with("0.9")
        },
        "--trace-routing",
    );
    // The modeled link (measured beside condensation) is between devices.
    refused(
        TrainFlags {
            link_gb_per_s: Some(10.0),
            ..flags_holding(&out, 6)
        },
        "give --devices 2 or more",
    );
    refused(
        TrainFlags {
            link_gb_per_s: Some(-1.0),
            devices: Some(2),
            ..flags_holding(&out, 6)
        },
        "-1 GB/s",
    );
}
