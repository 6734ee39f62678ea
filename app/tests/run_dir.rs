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
    trainer::export_run(&stopped, &export, "f32").unwrap();
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
