//! `train --resume` on a store with a damaged record stops with an error
//! that names the expert, within a bound (under a watchdog), instead of
//! hanging as it once did (the prefetcher retried the record forever).

mod common;

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use common::tiny_lm::{small_flags, tiny_config, write_checkpoint};
use common::{bounded, damage_record};
use strata_cli::trainer::{self, Source, TrainFlags};

/// Far above what the case takes (well under a second).
const BOUND: Duration = Duration::from_secs(60);

#[test]
fn train_resume_on_a_damaged_record_stops_with_an_error_naming_the_expert() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let model = dir.path().join("model");
    write_checkpoint(&model, &tiny_config());
    let first = TrainFlags {
        steps: Some(2),
        eval_every: Some(0),
        ..small_flags(&out)
    };
    trainer::run(&first, Source::Finetune(model), &AtomicBool::new(false)).unwrap();
    damage_record(&out.join("experts.strata"), 0);
    let again = TrainFlags {
        resume: true,
        steps: Some(4),
        ..small_flags(&out)
    };
    let err = bounded("train --resume on a damaged record", BOUND, move || {
        trainer::run(&again, Source::Scratch, &AtomicBool::new(false))
            .expect_err("the damaged record is read without an error")
    });
    eprintln!("{err}");
    assert!(
        err.contains("expert 0.0") && err.contains("checksum"),
        "the error names neither the expert nor the checksum: {err}"
    );
}

/// `strata verify --run DIR` on `out`: its exit status and stdout.
fn verify(out: &std::path::Path) -> (Option<i32>, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["verify", "--run", out.to_str().unwrap()])
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[test]
fn verify_says_an_intact_run_is_intact_and_names_what_is_damaged() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let model = dir.path().join("model");
    write_checkpoint(&model, &tiny_config());
    let first = TrainFlags {
        steps: Some(2),
        eval_every: Some(0),
        ..small_flags(&out)
    };
    trainer::run(&first, Source::Finetune(model), &AtomicBool::new(false)).unwrap();
    let (code, said) = verify(&out);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains("checkpoint at step 2 is intact (8 expert records"),
        "{said}"
    );

    damage_record(&out.join("experts.strata"), 5);
    let dense = out.join("experts.strata.dense-2");
    let len = std::fs::metadata(&dense).unwrap().len();
    common::flip_byte(&dense, len / 2);
    let (code, said) = verify(&out);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("damaged: expert 1.1: payload checksum mismatch"),
        "{said}"
    );
    assert!(
        said.contains("experts.strata.dense-2: checksum mismatch"),
        "{said}"
    );
    assert!(
        said.contains("(1 of 8 expert records, and the dense state)"),
        "{said}"
    );
}
