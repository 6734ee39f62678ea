//! A run directory keeps what its `--resume` and `strata export` need:
//! the model's config, the tokenizer its data was tokenized with and a
//! fine-tune's side files, copied in when the run starts. A fine-tune
//! resumed after its model directory is gone ends on the bits of one that
//! never stopped, and exports the same side files; a kept tokenizer that
//! went missing is refused rather than replaced by bytes.

mod common;

use std::path::Path;
use std::sync::atomic::AtomicBool;

use common::tiny_lm::{flags_holding, run_params, tiny_config, write_checkpoint};
use strata_cli::trainer::{self, Source, TrainFlags};

/// A word-level tokenizer (whitespace-split, unknown words one token) of
/// a few tokens, within the tiny model's vocabulary.
fn write_tokenizer(path: &Path) {
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "[UNK]",
                  "vocab": {"+": 0, "=": 1, "</s>": 2, "[UNK]": 3, "1": 4, "2": 5}}
    });
    std::fs::write(path, json.to_string()).unwrap();
}

#[test]
fn a_finetune_resumes_and_exports_without_its_model_directory() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let model = dir.path().join("model");
    write_checkpoint(&model, &config);
    write_tokenizer(&model.join("tokenizer.json"));
    let generation = r#"{"eos_token_id": 2}"#;
    std::fs::write(model.join("generation_config.json"), generation).unwrap();
    let finetune = |out: &Path, interrupt: bool| {
        trainer::run(
            &flags_holding(out, 6),
            Source::Finetune(model.clone()),
            &AtomicBool::new(interrupt),
        )
        .unwrap()
    };

    let straight = dir.path().join("straight");
    let done = finetune(&straight, false);
    assert_eq!(done.steps, 6);
    let stopped = dir.path().join("stopped");
    assert_eq!(finetune(&stopped, true).steps, 1);
    for name in ["tokenizer.json", "generation_config.json", "config.json"] {
        assert!(stopped.join(name).is_file(), "{name} is kept");
    }

    std::fs::rename(&model, dir.path().join("model-gone")).unwrap();
    let resume = |steps: u64| {
        trainer::run(
            &TrainFlags {
                resume: true,
                steps: Some(steps),
                ..flags_holding(&stopped, 6)
            },
            Source::Scratch,
            &AtomicBool::new(false),
        )
    };
    let resumed = resume(6).unwrap();
    assert_eq!(resumed.last_loss, done.last_loss);
    assert!(
        run_params(&stopped, &config) == run_params(&straight, &config),
        "the params differ"
    );

    let export = dir.path().join("export");
    trainer::export_run(&stopped, &export, Some("f32")).unwrap();
    assert_eq!(
        std::fs::read_to_string(export.join("generation_config.json")).unwrap(),
        generation
    );
    assert_eq!(
        std::fs::read(export.join("tokenizer.json")).unwrap(),
        std::fs::read(stopped.join("tokenizer.json")).unwrap()
    );

    std::fs::remove_file(stopped.join("tokenizer.json")).unwrap();
    let err = resume(7).unwrap_err();
    assert!(err.contains("tokenizer.json is missing"), "{err}");
}

/// A copied run directory, resumed, never writes the original's export: an
/// `--export` outside the run directory is left until named again, one
/// inside it moves with the copy.
#[test]
fn a_copied_run_does_not_export_over_the_original_run_s_export() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_checkpoint(&model, &tiny_config());
    let copy_dir = |from: &Path, to: &Path| {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_file() {
                std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
            }
        }
    };
    let resume = |out: &Path| {
        let flags = TrainFlags {
            resume: true,
            steps: Some(3),
            ..flags_holding(out, 6)
        };
        trainer::run(&flags, Source::Scratch, &AtomicBool::new(false)).unwrap();
    };
    let outside = dir.path().join("exported");
    for (run, export) in [("a", outside.clone()), ("b", dir.path().join("b/model"))] {
        let original = dir.path().join(run);
        let flags = TrainFlags {
            steps: Some(2),
            export: Some(export.clone()),
            ..flags_holding(&original, 6)
        };
        trainer::run(
            &flags,
            Source::Finetune(model.clone()),
            &AtomicBool::new(false),
        )
        .unwrap();
        assert!(export.join("config.json").is_file());
        std::fs::remove_dir_all(&export).unwrap();
        let copy = dir.path().join(format!("{run}-copy"));
        copy_dir(&original, &copy);
        resume(&copy);
        assert!(
            !export.exists(),
            "the copy of run {run} wrote the original's export"
        );
        if run == "b" {
            assert!(
                copy.join("model/config.json").is_file(),
                "the inside export moves"
            );
        }
    }
    // In place, the recorded export stands.
    resume(&dir.path().join("a"));
    assert!(outside.join("config.json").is_file());
}
