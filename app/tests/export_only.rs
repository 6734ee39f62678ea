//! `--steps 0` (a fine-tune that only imports and exports) and `--lr 0` (a
//! frozen evaluation) are legitimate runs: both run, neither changes a
//! parameter, and the export of either re-imports to the source's values.

mod common;

use std::sync::atomic::AtomicBool;

use common::tiny_lm::{flags_holding, run_params, tiny_config, write_checkpoint};
use strata_cli::trainer::{self, Source, TrainFlags};

#[test]
fn steps_0_exports_the_imported_model_and_lr_0_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let model = dir.path().join("model");
    write_checkpoint(&model, &config);
    let finetune = |name: &str, flags: TrainFlags, from: &std::path::Path| {
        let out = dir.path().join(name);
        let flags = TrainFlags {
            eval_every: Some(0),
            ..TrainFlags {
                out: Some(out.clone()),
                ..flags
            }
        };
        let summary = trainer::run(
            &flags,
            Source::Finetune(from.to_path_buf()),
            &AtomicBool::new(false),
        )
        .unwrap();
        (summary, run_params(&out, &config))
    };
    let export = dir.path().join("exported");
    let (zero, imported) = finetune(
        "zero",
        TrainFlags {
            steps: Some(0),
            export: Some(export.clone()),
            ..flags_holding(&dir.path().join("zero"), 6)
        },
        &model,
    );
    assert_eq!((zero.steps, zero.last_loss), (0, None));
    assert!(export.join("config.json").is_file());

    let (frozen, after) = finetune(
        "frozen",
        TrainFlags {
            steps: Some(2),
            lr: Some(0.0),
            ..flags_holding(&dir.path().join("frozen"), 6)
        },
        &model,
    );
    assert_eq!(frozen.steps, 2);
    assert!(frozen.last_loss.is_some_and(f32::is_finite));
    assert!(after == imported, "lr 0 changed a parameter");

    // The export of the steps-0 run holds the source's values.
    let (_, again) = finetune(
        "again",
        TrainFlags {
            steps: Some(0),
            ..flags_holding(&dir.path().join("again"), 6)
        },
        &export,
    );
    assert!(again == imported, "the export differs from the source");
}
