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
