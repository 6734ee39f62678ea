//! Hugging Face model directories in and out: `config.json`, safetensors
//! (single or sharded with an index), and the tokenizer files, so an
//! exported model loads where the original did.

use std::path::{Path, PathBuf};

use strata::lm::hub;
use strata::lm::safetensors_io::{
    expert_tensor_specs, write_safetensors, Checkpoint, ExpertShape, TensorSpec,
};
use strata_tiers::encode_compute;
use strata_tiers::io::AlignedBuf;
use strata_tiers::{record_mut, Dtype, ExpertStore, Parts};

use strata::lm::{LmConfig, MoeLm};
use strata::model::Network;

/// Files copied along with the weights when present.
pub(super) const SIDE_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
];

/// Reads `DIR/config.json`.
pub fn read_config(dir: &Path) -> Result<LmConfig, String> {
    hub::read_config(dir).map_err(|e| e.to_string())
}

/// Opens the checkpoint's safetensors and reads every dense tensor,
/// checking names and shapes before anything is written.
pub fn read_dense(dir: &Path, lm: &MoeLm) -> Result<(Checkpoint, Vec<f32>), String> {
    hub::read_dense(dir, lm).map_err(|e| e.to_string())
}

/// Imports the checkpoint's experts into `store` (step 0, committed).
pub fn import_store(
    ckpt: &Checkpoint,
    config: &LmConfig,
    store: &ExpertStore,
    progress: impl FnMut(u64, u64),
) -> Result<(), String> {
    hub::import_store(ckpt, config, store, progress).map_err(|e| e.to_string())
}

/// Writes the model — dense params from `dense`, experts' master params
/// from `stores` (one; or one a rank, expert e of every layer read from
/// rank e mod N's, the rank that owns it) — as safetensors shards of at most `shard_bytes_max` in
/// `dtype` (frozen tensors, a sigmoid router's correction biases, in f32
/// as transformers keeps them), with its `config.json` and the side files
/// of `source_dir`. Everything is written under temporary names and
/// renamed at the end.
pub fn export(
    dir: &Path,
    lm: &MoeLm,
    dense: &[f32],
    stores: &[&ExpertStore],
    dtype: Dtype,
    shard_bytes_max: u64,
    source_dir: Option<&Path>,
) -> Result<Vec<PathBuf>, String> {
    let store = stores.first().ok_or("no expert store to export from")?;
    if let Some(other) = stores.iter().find(|s| s.layout() != store.layout()) {
        return Err(format!(
            "the ranks' stores differ in layout ({:?} against {:?}): export one run's ranks",
            other.layout(),
            store.layout()
        ));
    }
    let owner = |e: strata_tiers::ExpertId| stores[strata::engine::rank_of_expert(e, stores.len())];
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let config = lm.config();
    let shape = ExpertShape {
        d_model: config.d_model,
        d_ff: config.d_ff,
    };
    let frozen = lm.frozen_dense();
    let mut specs: Vec<TensorSpec> = lm
        .tensors()
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dtype: match frozen.contains(&t.range) {
                true => Dtype::F32,
                false => dtype,
            },
            shape: t.shape.clone(),
        })
        .collect();
    let dense_count = specs.len();
    let specs_dtype: Vec<Dtype> = specs.iter().map(|s| s.dtype).collect();
    specs.extend(expert_tensor_specs(
        store,
        config.expert_names(),
        shape,
        dtype,
    ));
    let layout = store.layout();
    let (d, f) = (config.d_model, config.d_ff);
    let mut record = AlignedBuf::zeroed(layout.record_bytes() as usize);
    let mut loaded: Option<u64> = None;
    let tensors = lm.tensors();
    let mut files = write_safetensors(dir, &specs, shard_bytes_max, |i, out| {
        if i < dense_count {
            encode_compute(specs_dtype[i], &dense[tensors[i].range.clone()], out);
            return Ok(());
        }
        let slot = ((i - dense_count) / 3) as u64;
        if loaded != Some(slot) {
            let e = layout.expert_at(slot);
            owner(e).read(e, Parts::Full, record.as_mut_slice())?;
            loaded = Some(slot);
        }
        let r = record_mut(&layout, record.as_mut_slice())?;
        let w = (i - dense_count) % 3;
        encode_compute(dtype, &r.master[w * d * f..(w + 1) * d * f], out);
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    let write = |name: &str, bytes: &[u8]| -> Result<PathBuf, String> {
        let tmp = dir.join(format!(".{name}.partial"));
        let path = dir.join(name);
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        Ok(path)
    };
    let kept = source_dir.and_then(|d| std::fs::read_to_string(d.join("config.json")).ok());
    files.push(write(
        "config.json",
        export_config(config, kept.as_deref(), dtype).as_bytes(),
    )?);
    if let Some(src) = source_dir {
        for name in SIDE_FILES {
            let from = src.join(name);
            if from.is_file() {
                let bytes = std::fs::read(&from)
                    .map_err(|e| format!("cannot read {}: {e}", from.display()))?;
                files.push(write(name, &bytes)?);
            }
        }
    }
    Ok(files)
}

/// transformers' name of a tensor precision (`torch_dtype`).
fn torch_dtype(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::F32 => "float32",
        Dtype::Bf16 => "bfloat16",
        Dtype::F16 => "float16",
    }
}

/// The precision a model's `config.json` declares for its weights
/// (`torch_dtype`, or transformers 5's `dtype`); f32 where it names none.
pub fn declared_dtype(config_json: Option<&str>) -> Dtype {
    let value: Option<serde_json::Value> = config_json.and_then(|t| serde_json::from_str(t).ok());
    let name = value.as_ref().and_then(|v| {
        v.get("torch_dtype")
            .or_else(|| v.get("dtype"))
            .and_then(serde_json::Value::as_str)
    });
    match name {
        Some("bfloat16") => Dtype::Bf16,
        Some("float16") => Dtype::F16,
        _ => Dtype::F32,
    }
}

/// The exported `config.json`: the source's own (`kept`, the run
/// directory's copy) with every key it had, where it describes this very
/// model, only its precision set to the export's; else strata's own.
pub fn export_config(config: &LmConfig, kept: Option<&str>, dtype: Dtype) -> String {
    let same_model = |text: &str| {
        LmConfig::from_hf_json(text).is_ok_and(|c| {
            c == LmConfig {
                seed: 0,
                ..config.clone()
            }
        })
    };
    let mut value: serde_json::Value = match kept.filter(|t| same_model(t)) {
        Some(text) => serde_json::from_str(text).expect("parsed just above"),
        None => serde_json::from_str(&config.to_hf_json()).expect("plain JSON"),
    };
    if let Some(map) = value.as_object_mut() {
        let key = if map.contains_key("dtype") && !map.contains_key("torch_dtype") {
            "dtype"
        } else {
            "torch_dtype"
        };
        map.insert(key.into(), torch_dtype(dtype).into());
    }
    serde_json::to_string_pretty(&value).expect("plain JSON")
}
