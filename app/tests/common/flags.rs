//! Trainer flags for the tiny model of `tiny_lm` that make its experts
//! stream from the SSD.

use std::path::Path;

use strata::backend::BackendKind;
use strata::engine::EngineConfig;
use strata::lm::LmConfig;
use strata_cli::trainer::{self, TrainFlags};
use strata_tiers::Dtype;

use super::tiny_lm::tiny_config;

pub fn small_flags(out: &Path) -> TrainFlags {
    // Room on the device for the dense part, the activations and two
    // expert slots, and on the host for three of the eight records:
    // experts stream from the SSD.
    flags_holding(out, 3)
}

/// `small_flags` for `devices` cpu devices and `micro_batches`, each
/// device with the room its share needs (several also hold the gradient's
/// copy reduced beside the backward).
pub fn small_flags_on(out: &Path, devices: usize, micro_batches: usize) -> TrainFlags {
    flags_on(&tiny_config(), out, 3, devices, micro_batches)
}

/// `small_flags` with host memory for `records` of the eight records.
pub fn flags_holding(out: &Path, records: u64) -> TrainFlags {
    flags_holding_for(&tiny_config(), out, records)
}

/// Flags for `config` with host memory for `records` of its expert records.
/// Where `--backend auto` finds a GPU, which then keeps the dense params'
/// moments too, the device memory counts them.
pub fn flags_holding_for(config: &LmConfig, out: &Path, records: u64) -> TrainFlags {
    flags_on(config, out, records, 1, 2)
}

fn flags_on(
    config: &LmConfig,
    out: &Path,
    records: u64,
    devices: usize,
    micro_batches: usize,
) -> TrainFlags {
    let on_gpu = BackendKind::detect(1, Dtype::Bf16).0 == BackendKind::Cuda;
    let fixed = trainer::plan::plan(&trainer::plan::PlanInput {
        model: config,
        frozen_dense: 0,
        train_experts: true,
        compute_dtype: Dtype::Bf16,
        seq_len: 16,
        batch: 4,
        micro_batches,
        devices,
        ranks: 1,
        device_mem: 1 << 40,
        host_mem: 1 << 40,
        store_dir: None,
        host_stream_slots: EngineConfig::default().host_stream_slots,
        host_cell_slots: 0,
        gpu: on_gpu,
        expert_group: None,
        dense_on_device: on_gpu,
        dense_gemm: Default::default(),
        expert_gemm: Default::default(),
        naive_schedule: false,
        compute_threads: 1,
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
        micro_batches: Some(micro_batches),
        devices: Some(devices),
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
