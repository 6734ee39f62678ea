//! A Hugging Face model directory read into strata: its `config.json`,
//! its dense tensors, and its experts imported into an expert store.

use std::path::Path;

use strata_tiers::ExpertStore;

use super::safetensors_io::{import_experts, Checkpoint, ExpertShape};
use super::{LmConfig, MoeLm};
use crate::engine::{Engine, EngineConfig};
use crate::model::Network;
use crate::EngineError;

/// Reads `DIR/config.json` (any family [`LmConfig::from_hf_json`] reads).
pub fn read_config(dir: &Path) -> Result<LmConfig, EngineError> {
    if !dir.is_dir() {
        return Err(EngineError::Config(format!(
            "model directory {} does not exist (give a directory with config.json and safetensors)",
            dir.display()
        )));
    }
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        EngineError::Config(format!(
            "cannot read {}: {e} (a Hugging Face model directory holds config.json and \
             safetensors)",
            path.display()
        ))
    })?;
    LmConfig::from_hf_json(&text)
        .map_err(|e| EngineError::Config(format!("{}: {}", path.display(), config_text(e))))
}

fn config_text(e: EngineError) -> String {
    match e {
        EngineError::Config(why) => why,
        other => other.to_string(),
    }
}

/// Opens the checkpoint's safetensors and reads every dense tensor of
/// `lm`, by its Hub name, checking names and shapes before anything is
/// returned.
pub fn read_dense(dir: &Path, lm: &MoeLm) -> Result<(Checkpoint, Vec<f32>), EngineError> {
    let in_dir =
        |e: strata_tiers::TierError| EngineError::Config(format!("{}: {e}", dir.display()));
    let ckpt = Checkpoint::open(dir).map_err(in_dir)?;
    let missing: Vec<&str> = lm
        .tensors()
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !ckpt.contains(n))
        .collect();
    if !missing.is_empty() {
        return Err(EngineError::Config(format!(
            "{}: {} dense tensors are missing from the checkpoint, e.g. {}",
            dir.display(),
            missing.len(),
            missing
                .iter()
                .take(3)
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let mut dense = vec![0.0f32; lm.config().dense_params()];
    for t in lm.tensors() {
        ckpt.read_f32(&t.name, &t.shape, &mut dense[t.range.clone()])
            .map_err(in_dir)?;
    }
    Ok((ckpt, dense))
}

/// Imports the checkpoint's experts, named as `config`'s family names
/// them, into `store` (step 0, committed). `progress(done, total)` is
/// called as records land.
pub fn import_store(
    ckpt: &Checkpoint,
    config: &LmConfig,
    store: &ExpertStore,
    progress: impl FnMut(u64, u64),
) -> Result<(), EngineError> {
    let shape = ExpertShape {
        d_model: config.d_model,
        d_ff: config.d_ff,
    };
    import_experts(ckpt, config.expert_names(), shape, store, 0, progress)?;
    Ok(())
}

/// Opens a Hub model directory for fine-tuning: reads its config and its
/// dense tensors, creates the expert store at `config.store_path`, imports
/// every expert into it (`progress(done, total)` as they land), and opens
/// an engine on them. The returned model is the network to step.
///
/// ```no_run
/// use strata::engine::EngineConfig;
/// use strata::lm::{hub, TokenBatch};
///
/// let config = EngineConfig {
///     store_path: Some("/tmp/run/experts.store".into()),
///     ..EngineConfig::default()
/// };
/// let dir = std::path::Path::new("Qwen3-30B-A3B");
/// let (lm, mut engine) = hub::open_engine(dir, config, |_, _| {}).unwrap();
/// let batch = TokenBatch { seq_len: 4, tokens: vec![1, 2, 3, 4, 5], loss_mask: None, doc_starts: None };
/// let metrics = engine.step_network(&lm, &batch).unwrap();
/// println!("loss {}", metrics.loss);
/// ```
pub fn open_engine(
    dir: &Path,
    config: EngineConfig,
    progress: impl FnMut(u64, u64),
) -> Result<(MoeLm, Engine), EngineError> {
    let Some(path) = config.store_path.clone() else {
        return Err(EngineError::Config(
            "opening a Hub model needs EngineConfig::store_path, where its experts are imported"
                .into(),
        ));
    };
    let lm = MoeLm::new(read_config(dir)?)?;
    let (ckpt, dense) = read_dense(dir, &lm)?;
    let layout = Engine::layout(lm.moe(), &config);
    {
        let store = ExpertStore::create(&path, layout, &Engine::file_options(&config))?;
        import_store(&ckpt, lm.config(), &store, progress)?;
    }
    let engine = Engine::open_imported(&lm, config, dense)?;
    Ok((lm, engine))
}
