//! Hugging Face model directories in and out: `config.json`, safetensors
//! (single or sharded with an index), and the tokenizer files, so an
//! exported model loads where the original did.

use std::path::{Path, PathBuf};

use strata::lm::safetensors_io::{
    expert_tensor_specs, import_experts, write_safetensors, Checkpoint, ExpertNaming, ExpertShape,
    TensorSpec,
};
use strata_tiers::encode_compute;
use strata_tiers::io::AlignedBuf;
use strata_tiers::{record_mut, Dtype, ExpertStore, Parts};

use strata::lm::{LmConfig, MixtralLm};

/// Files copied along with the weights when present.
pub(super) const SIDE_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
];

/// Reads `DIR/config.json`.
pub fn read_config(dir: &Path) -> Result<LmConfig, String> {
    if !dir.is_dir() {
        return Err(format!(
            "model directory {} does not exist (give a directory with config.json and safetensors)",
            dir.display()
        ));
    }
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "cannot read {}: {e} (--model takes a Hugging Face model directory: \
                 config.json and safetensors)",
            path.display()
        )
    })?;
    LmConfig::from_hf_json(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Opens the checkpoint's safetensors and reads every dense tensor,
/// checking names and shapes before anything is written.
pub fn read_dense(dir: &Path, lm: &MixtralLm) -> Result<(Checkpoint, Vec<f32>), String> {
    let ckpt = Checkpoint::open(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let missing: Vec<&str> = lm
        .tensors()
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !ckpt.contains(n))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{}: {} dense tensors are missing from the checkpoint, e.g. {}",
            dir.display(),
            missing.len(),
            missing
                .iter()
                .take(3)
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let mut dense = vec![0.0f32; lm.config().dense_params()];
    for t in lm.tensors() {
        ckpt.read_f32(&t.name, &t.shape, &mut dense[t.range.clone()])
            .map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    Ok((ckpt, dense))
}

/// Imports the checkpoint's experts into `store` (step 0, committed).
pub fn import_store(
    ckpt: &Checkpoint,
    config: &LmConfig,
    store: &ExpertStore,
    progress: impl FnMut(u64, u64),
) -> Result<(), String> {
    let shape = ExpertShape {
        d_model: config.d_model,
        d_ff: config.d_ff,
    };
    import_experts(ckpt, ExpertNaming::Mixtral, shape, store, 0, progress)
        .map_err(|e| e.to_string())
}

/// Writes the model — dense params from `dense`, experts' master params
/// from `store` — as safetensors shards of at most `shard_bytes_max` in
/// `dtype`, with its `config.json` and the side files of `source_dir`.
/// Everything is written under temporary names and renamed at the end.
pub fn export(
    dir: &Path,
    lm: &MixtralLm,
    dense: &[f32],
    store: &ExpertStore,
    dtype: Dtype,
    shard_bytes_max: u64,
    source_dir: Option<&Path>,
) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let config = lm.config();
    let shape = ExpertShape {
        d_model: config.d_model,
        d_ff: config.d_ff,
    };
    let mut specs: Vec<TensorSpec> = lm
        .tensors()
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dtype,
            shape: t.shape.clone(),
        })
        .collect();
    let dense_count = specs.len();
    specs.extend(expert_tensor_specs(
        store,
        ExpertNaming::Mixtral,
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
            encode_compute(dtype, &dense[tensors[i].range.clone()], out);
            return Ok(());
        }
        let slot = ((i - dense_count) / 3) as u64;
        if loaded != Some(slot) {
            store.read(layout.expert_at(slot), Parts::Full, record.as_mut_slice())?;
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
    files.push(write("config.json", config.to_hf_json().as_bytes())?);
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
