//! A tiny Mixtral-layout model: its config, a checkpoint of it written as
//! Hugging Face does, and a run's params read back. (The trainer flags
//! that make its experts stream from the SSD are in `app/tests/common`.)

use std::path::Path;

use strata::engine::{Engine, EngineConfig};
use strata::lm::safetensors_io::{write_safetensors, TensorSpec};
use strata::lm::{LmConfig, MoeLm, TokenBatch};
use strata::model::Network;
use strata_tiers::encode_compute;
use strata_tiers::Dtype;

pub fn tiny_config() -> LmConfig {
    LmConfig {
        vocab: 260,
        d_model: 16,
        layers: 2,
        heads: 2,
        kv_heads: 1,
        head_dim: 8,
        d_ff: 24,
        experts: 4,
        top_k: 2,
        max_seq: 64,
        seed: 11,
        ..LmConfig::default()
    }
}

/// Step `step`'s batch for [`tiny_config`]: 4 sequences of 8 tokens (and
/// their targets), different each step.
pub fn tiny_batch(step: u32) -> TokenBatch {
    TokenBatch {
        seq_len: 8,
        tokens: (0..4 * 9u32)
            .map(|i| (i * 37 + 5 + 11 * step) % 250)
            .collect(),
        loss_mask: None,
        doc_starts: None,
    }
}

/// Writes a Mixtral-layout checkpoint: config.json and safetensors shards
/// of at most 64 KiB (so there is an index), f32.
pub fn write_checkpoint(dir: &Path, config: &LmConfig) -> (Vec<f32>, Vec<Vec<f32>>) {
    std::fs::create_dir_all(dir).unwrap();
    let lm = MoeLm::new(config.clone()).unwrap();
    let dense = lm.init_dense();
    let moe = lm.moe().clone();
    let (d, f) = (config.d_model, config.d_ff);
    let mut experts = Vec::new();
    let mut specs: Vec<TensorSpec> = lm
        .tensors()
        .iter()
        .map(|t| TensorSpec {
            name: t.name.clone(),
            dtype: Dtype::F32,
            shape: t.shape.clone(),
        })
        .collect();
    for l in 0..config.layers {
        for e in 0..config.experts {
            let mut p = vec![0.0f32; moe.expert_params()];
            moe.init_expert(l, e, &mut p);
            experts.push(p);
            for (w, shape) in [("w1", [f, d]), ("w3", [f, d]), ("w2", [d, f])] {
                specs.push(TensorSpec {
                    name: format!("model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight"),
                    dtype: Dtype::F32,
                    shape: shape.to_vec(),
                });
            }
        }
    }
    let nd = lm.tensors().len();
    let files = write_safetensors(dir, &specs, 64 << 10, |i, out| {
        let values = if i < nd {
            &dense[lm.tensors()[i].range.clone()]
        } else {
            let (x, w) = ((i - nd) / 3, (i - nd) % 3);
            &experts[x][w * d * f..(w + 1) * d * f]
        };
        encode_compute(Dtype::F32, values, out);
        Ok(())
    })
    .unwrap();
    assert!(files.len() > 2, "the checkpoint is sharded with an index");
    std::fs::write(dir.join("config.json"), config.to_hf_json()).unwrap();
    (dense, experts)
}

/// The params of the run in `out`, read back through a resumed engine.
pub fn run_params(out: &Path, config: &LmConfig) -> (Vec<f32>, Vec<Vec<f32>>) {
    run_params_of(out, &MoeLm::new(config.clone()).unwrap(), true)
}

/// `run_params` for the run of `lm` (its frozen tensors those the run
/// froze) that trained its experts or not.
pub fn run_params_of(out: &Path, lm: &MoeLm, train_experts: bool) -> (Vec<f32>, Vec<Vec<f32>>) {
    let config = lm.config();
    let mut engine = Engine::resume_network(
        lm,
        EngineConfig {
            store_path: Some(out.join("experts.strata")),
            compute_dtype: Dtype::Bf16,
            device_budget_bytes: 1 << 20,
            host_budget_bytes: 4 << 20,
            optimizer_threads: 1,
            train_experts,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let dense = engine.dense_params().unwrap().to_vec();
    let mut experts = Vec::new();
    for l in 0..config.layers {
        for e in 0..config.experts {
            experts.push(engine.expert_params(l, e).unwrap());
        }
    }
    (dense, experts)
}
