//! Fine-tunes at the edges a user meets: `--steps 0` (import and export
//! only) and `--lr 0` (a frozen evaluation), which change no parameter; an
//! export that keeps the source's config.json and precision; and a model of
//! 256 tokens without a tokenizer of its own.

mod common;

use std::sync::atomic::AtomicBool;

use common::tiny_lm::{
    flags_holding, flags_holding_for, run_params, run_params_of, tiny_config, write_checkpoint,
};
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

/// The dtype of every tensor in the safetensors files of `dir`.
fn tensor_dtypes(dir: &std::path::Path) -> std::collections::BTreeSet<String> {
    let mut found = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        for (name, info) in header.as_object().unwrap() {
            if name != "__metadata__" {
                found.insert(info["dtype"].as_str().unwrap().to_string());
            }
        }
    }
    found
}

/// An export keeps the source's config.json, every key of it (token ids,
/// coefficients as written), and its precision, unless told another.
#[test]
fn an_export_keeps_the_source_config_and_precision() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let model = dir.path().join("model");
    write_checkpoint(&model, &config);
    let path = model.join("config.json");
    let mut source: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let extra = serde_json::json!({
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        "output_router_logits": true, "router_aux_loss_coef": 0.02,
        "initializer_range": 0.02, "use_cache": true
    });
    for (k, v) in extra.as_object().unwrap() {
        source[k] = v.clone();
    }
    std::fs::write(&path, serde_json::to_string_pretty(&source).unwrap()).unwrap();

    let out = dir.path().join("run");
    let export = dir.path().join("exported");
    let flags = TrainFlags {
        steps: Some(1),
        eval_every: Some(0),
        export: Some(export.clone()),
        ..flags_holding(&out, 6)
    };
    trainer::run(
        &flags,
        Source::Finetune(model.clone()),
        &AtomicBool::new(false),
    )
    .unwrap();
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(export.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(
        written, source,
        "the exported config.json differs from the source's"
    );
    assert_eq!(tensor_dtypes(&export), ["BF16".to_string()].into());

    // `strata export`: the same by default, another precision when asked.
    let again = dir.path().join("again");
    trainer::export_run(&out, &again, None).unwrap();
    assert_eq!(tensor_dtypes(&again), ["BF16".to_string()].into());
    let wide = dir.path().join("wide");
    trainer::export_run(&out, &wide, Some("f32")).unwrap();
    assert_eq!(tensor_dtypes(&wide), ["F32".to_string()].into());
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(wide.join("config.json")).unwrap()).unwrap();
    assert_eq!(written["torch_dtype"], "float32");
    assert_eq!(written["eos_token_id"], 2);
}

/// A checkpoint whose vocabulary is the 256 bytes alone, with no
/// tokenizer.json, fine-tunes on bytes without an end-of-document token
/// (which it has no id for), and resumes the same way.
#[test]
fn a_256_token_model_without_a_tokenizer_fine_tunes_on_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let config = strata::lm::LmConfig {
        vocab: 256,
        ..tiny_config()
    };
    let model = dir.path().join("model");
    write_checkpoint(&model, &config);
    let out = dir.path().join("run");
    let flags = TrainFlags {
        steps: Some(2),
        eval_every: Some(0),
        ..flags_holding(&out, 6)
    };
    let done = trainer::run(&flags, Source::Finetune(model), &AtomicBool::new(false)).unwrap();
    assert!(done.last_loss.is_some_and(f32::is_finite));
    let more = TrainFlags {
        resume: true,
        steps: Some(3),
        ..flags
    };
    let resumed = trainer::run(&more, Source::Scratch, &AtomicBool::new(false)).unwrap();
    assert_eq!(resumed.steps, 3);
}

/// A Qwen3-MoE checkpoint as transformers writes it (the parity fixture:
/// per-head q/k norms, head_dim × heads ≠ hidden_size, `mlp.experts.E.*`
/// names) fine-tunes with its experts streaming from the SSD, its loss
/// falls, and its export has the source's tensor names and config, and
/// holds the run's parameters.
#[test]
fn a_qwen3_moe_checkpoint_fine_tunes_from_the_ssd_and_exports_in_its_layout() {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf/qwen3_moe/model");
    let config = strata::lm::hub::read_config(&model).unwrap();
    assert_eq!(config.family, strata::lm::Family::Qwen3Moe);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let export = dir.path().join("exported");
    let flags = TrainFlags {
        steps: Some(12),
        lr: Some(3e-3),
        eval_every: Some(0),
        export: Some(export.clone()),
        // Host memory for 2 of the 8 records: the rest stream.
        ..flags_holding_for(&config, &out, 2)
    };
    let done = trainer::run(
        &flags,
        Source::Finetune(model.clone()),
        &AtomicBool::new(false),
    )
    .unwrap();
    let (first, last) = (done.first_loss.unwrap(), done.last_loss.unwrap());
    assert!(last < first - 0.5, "the loss went from {first} to {last}");
    assert!(
        done.plan.describe().contains("SSD"),
        "{}",
        done.plan.describe()
    );
    let names = |dir: &std::path::Path| {
        let ckpt = strata::lm::safetensors_io::Checkpoint::open(dir).unwrap();
        let mut names: Vec<String> = ckpt.tensor_names().map(str::to_string).collect();
        names.sort();
        names
    };
    assert_eq!(names(&export), names(&model));
    let read = |dir: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
    };
    assert_eq!(read(&export), read(&model));
    // The export, imported again, holds what the run trained.
    let again = dir.path().join("again");
    let flags = TrainFlags {
        steps: Some(0),
        eval_every: Some(0),
        ..flags_holding_for(&config, &again, 2)
    };
    trainer::run(&flags, Source::Finetune(export), &AtomicBool::new(false)).unwrap();
    assert!(
        run_params(&again, &config) == run_params(&out, &config),
        "the export differs from the run"
    );
}

/// A Qwen3-MoE checkpoint fine-tunes on conversations rendered through its
/// own chat template (a ChatML one, in its tokenizer_config.json), with
/// its experts streaming from the SSD: the loss (on the assistant's turns
/// alone; `lm::data` and `tests/loss_mask.rs` test the mask) falls, and
/// the export carries the template along.
#[test]
fn a_qwen3_moe_checkpoint_fine_tunes_on_chat_data() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf/qwen3_moe/model");
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let from = entry.unwrap().path();
        std::fs::copy(&from, model.join(from.file_name().unwrap())).unwrap();
    }
    let chatml = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content.strip() \
                  + '<|im_end|>\\n' }}{% endfor %}";
    let tokenizer_config = serde_json::json!({"chat_template": chatml, "eos_token": "<|im_end|>"});
    std::fs::write(
        model.join("tokenizer_config.json"),
        tokenizer_config.to_string(),
    )
    .unwrap();
    let data = dir.path().join("chat.jsonl");
    let lines: Vec<String> = (0..400u32)
        .map(|i| {
            let (a, b) = (i * 7 % 50, i * 13 % 50);
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("{a}+{b}?")},
                {"role": "assistant", "content": format!(" {} ", a + b)},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let config = strata::lm::hub::read_config(&model).unwrap();
    let out = dir.path().join("run");
    let export = dir.path().join("exported");
    let flags = TrainFlags {
        steps: Some(30),
        lr: Some(3e-3),
        eval_every: Some(0),
        data: Some(vec![data]),
        export: Some(export.clone()),
        ..flags_holding_for(&config, &out, 2)
    };
    trainer::run(&flags, Source::Finetune(model), &AtomicBool::new(false)).unwrap();
    // A batch of packed conversations holds few answer tokens, so one
    // step's loss is noisy: compare the first ten steps with the last ten.
    let losses = metric(&out, "loss");
    assert_eq!(losses.len(), 30);
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    let (first, last) = (mean(&losses[..10]), mean(&losses[20..]));
    eprintln!("chat fine-tune: mean loss {first:.3} over steps 1-10, {last:.3} over 21-30");
    assert!(last < first - 1.0, "the loss went from {first} to {last}");
    assert!(export.join("tokenizer_config.json").is_file());
    // A resume renders the conversations through the template the run
    // keeps, and packs them apart as the run did.
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(record["options"]["packing"], "apart");
    let more = TrainFlags {
        resume: true,
        steps: Some(32),
        ..flags
    };
    let resumed = trainer::run(&more, Source::Scratch, &AtomicBool::new(false)).unwrap();
    assert_eq!(resumed.steps, 32);
}

/// `--clip-grad-norm` (TRL's max_grad_norm): the run clips, and
/// metrics.jsonl reports each step's global norm before clipping (and
/// `--tensorboard` writes the steps as event files); a bound that is not
/// positive is refused.
#[test]
fn clip_grad_norm_clips_and_reports_the_norm() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let model = dir.path().join("model");
    write_checkpoint(&model, &config);
    let out = dir.path().join("run");
    let flags = TrainFlags {
        steps: Some(3),
        eval_every: Some(0),
        clip_grad_norm: Some(0.5),
        tensorboard: Some(dir.path().join("tb")),
        ..flags_holding(&out, 6)
    };
    trainer::run(
        &flags,
        Source::Finetune(model.clone()),
        &AtomicBool::new(false),
    )
    .unwrap();
    let norms = metric(&out, "grad_norm");
    assert_eq!(norms.len(), 3);
    assert!(norms.iter().all(|n| n.is_finite() && *n > 0.0), "{norms:?}");
    // The same steps as TensorBoard event files (their format is tested in
    // the trainer's tensorboard module).
    let events: Vec<_> = std::fs::read_dir(dir.path().join("tb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(events.len(), 1);
    assert!(std::fs::metadata(&events[0]).unwrap().len() > 3 * 100);
    let bad = TrainFlags {
        clip_grad_norm: Some(0.0),
        out: Some(dir.path().join("bad")),
        ..flags
    };
    let err = trainer::run(&bad, Source::Finetune(model), &AtomicBool::new(false)).unwrap_err();
    assert!(err.contains("--clip-grad-norm 0"), "{err}");
}

/// `key`'s numbers in the run's metrics.jsonl, line by line.
fn metric(out: &std::path::Path, key: &str) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get(key).and_then(serde_json::Value::as_f64))
        .collect()
}

/// `--train router,norms`: the routers and norm gains train, and nothing
/// else moves (experts, attention, embeddings); the store's records hold
/// no moments; the run resumes with the same groups, and a bad group is
/// refused by name.
#[test]
fn train_updates_the_groups_it_names_and_nothing_else() {
    use strata::lm::{MoeLm, TensorGroup};
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let model = dir.path().join("model");
    let (dense0, experts0) = write_checkpoint(&model, &config);
    let out = dir.path().join("run");
    let flags = |steps| TrainFlags {
        steps: Some(steps),
        eval_every: Some(0),
        train: Some(vec!["router".into(), "norms".into()]),
        out: Some(out.clone()),
        ..flags_holding(&out, 6)
    };
    let from = Source::Finetune(model.clone());
    trainer::run(&flags(2), from.clone(), &AtomicBool::new(false)).unwrap();
    let resumed = TrainFlags {
        resume: true,
        ..flags(3)
    };
    let summary = trainer::run(&resumed, from.clone(), &AtomicBool::new(false)).unwrap();
    assert_eq!(summary.steps, 3);
    let lm = MoeLm::new(config.clone())
        .unwrap()
        .with_trained(&[TensorGroup::Router, TensorGroup::Norms]);
    let (dense, experts) = run_params_of(&out, &lm, false);
    assert!(experts == experts0, "a frozen expert moved");
    let store = strata_tiers::ExpertStore::open(
        &out.join("experts.strata"),
        None,
        &strata_tiers::io::FileOptions::default(),
    )
    .unwrap();
    assert!(
        !store.layout().moments,
        "frozen experts' records hold moments"
    );
    for t in lm.tensors() {
        let (was, now) = (&dense0[t.range.clone()], &dense[t.range.clone()]);
        match TensorGroup::of_dense(&t.name) {
            Some(TensorGroup::Router | TensorGroup::Norms) => {
                assert!(was != now, "{} did not train", t.name)
            }
            _ => assert!(was == now, "{} is frozen but moved", t.name),
        }
    }

    let bad = TrainFlags {
        train: Some(vec!["heads".into()]),
        out: Some(dir.path().join("bad")),
        ..flags(1)
    };
    let err = trainer::run(&bad, from, &AtomicBool::new(false)).unwrap_err();
    assert!(err.contains("--train: `heads` is not a group"), "{err}");
}
