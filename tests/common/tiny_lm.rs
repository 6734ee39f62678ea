//! A tiny Mixtral-layout model for the trainer's tests: its config, a
//! checkpoint of it written as Hugging Face does, trainer flags that make
//! its experts stream from the SSD, and a run's params read back.

use std::path::Path;

use strata::engine::{Engine, EngineConfig};
use strata::lm::{LmConfig, MixtralLm};
use strata::model::Network;
use strata::trainer::{self, TrainFlags};
use strata_tiers::safetensors_io::{encode_compute, write_safetensors, TensorSpec};
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

/// Writes a Mixtral-layout checkpoint: config.json and safetensors shards
/// of at most 64 KiB (so there is an index), f32.
pub fn write_checkpoint(dir: &Path, config: &LmConfig) -> (Vec<f32>, Vec<Vec<f32>>) {
    std::fs::create_dir_all(dir).unwrap();
    let lm = MixtralLm::new(config.clone()).unwrap();
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

pub fn small_flags(out: &Path) -> TrainFlags {
    // Room on the device for the dense part, the activations and two
    // expert slots, and on the host for three of the eight records:
    // experts stream from the SSD.
    flags_holding(out, 3)
}

/// `small_flags` with host memory for `records` of the eight records.
pub fn flags_holding(out: &Path, records: u64) -> TrainFlags {
    let config = tiny_config();
    let fixed = trainer::plan::plan(&trainer::plan::PlanInput {
        model: &config,
        compute_dtype: Dtype::Bf16,
        seq_len: 16,
        batch: 4,
        micro_batches: 2,
        devices: 1,
        device_mem: 1 << 40,
        host_mem: 1 << 40,
        store_dir: None,
        host_stream_slots: EngineConfig::default().host_stream_slots,
        host_cell_slots: 0,
    })
    .unwrap();
    let slot = 2 * config.expert_params() as u64;
    let device = fixed.dense_device_bytes + fixed.activation_bytes + 2 * slot;
    let record = fixed.expert_host_bytes / fixed.expert_count;
    let host = fixed.dense_host_bytes + records * record;
    TrainFlags {
        out: Some(out.to_path_buf()),
        steps: Some(6),
        seq_len: Some(16),
        batch: Some(4),
        micro_batches: Some(2),
        eval_every: Some(3),
        checkpoint_every: Some(2),
        device_mem: Some(device.to_string()),
        host_mem: Some(host.to_string()),
        threads: Some(2),
        warmup: Some(2),
        quiet: true,
        ..TrainFlags::default()
    }
}

/// The params of the run in `out`, read back through a resumed engine.
pub fn run_params(out: &Path, config: &LmConfig) -> (Vec<f32>, Vec<Vec<f32>>) {
    let lm = MixtralLm::new(config.clone()).unwrap();
    let mut engine = Engine::resume_network(
        &lm,
        EngineConfig {
            store_path: Some(out.join("experts.strata")),
            compute_dtype: Dtype::Bf16,
            device_budget_bytes: 1 << 20,
            host_budget_bytes: 4 << 20,
            optimizer_threads: 1,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let dense = engine.dense_params().to_vec();
    let mut experts = Vec::new();
    for l in 0..config.layers {
        for e in 0..config.experts {
            experts.push(engine.expert_params(l, e).unwrap());
        }
    }
    (dense, experts)
}
