//! The memory plan: bytes each tier needs for a model, batch and budgets,
//! the offloading mode that follows (adaptive offloading, ES-MoE §4.3),
//! and a refusal naming the shortfall when the run cannot fit — all
//! computed before anything is allocated.
//!
//! What lives where:
//! - device: dense params and their gradients (f32), the activations a
//!   micro-batch keeps for its backward, and expert slots holding compute
//!   copies (at least one; two let the next expert's upload overlap);
//! - host: the dense Adam moments, and expert records (f32 master params,
//!   both moments, the compute copy) that the CPU optimizer updates;
//! - SSD: the store file (two copies of every record, so a checkpoint is
//!   never overwritten in place) and the dense checkpoint files;
//! - besides the budgets, in host memory: the expert gradients on their
//!   way to the optimizer (the engine's own count) and, on the cpu, what it
//!   computes with; `report.rs` adds up the whole.

use std::path::Path;

use strata_tiers::{Dtype, Layout};

use super::options::show_bytes;
use strata::backend::{BackendKind, DenseGemm, ExpertGemm};
use strata::engine::{
    cpu_expert_group_bound, gradient_buffers, host_cell_slot_count, host_kept_count,
    scratch_buffers_kept, EngineConfig, ScheduleKind, MIN_HOST_STREAM_SLOTS,
};
use strata::lm::data::DataConfig;
use strata::lm::LmConfig;

mod activations;
mod report;
pub use activations::{
    activation_bytes, cpu_workspace_bytes, gpu_activation_bytes, gpu_widest_launch,
};

/// Where the experts end up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffloadMode {
    /// Every expert's compute copy stays on the device; records in host
    /// memory; the SSD holds checkpoints only.
    AllOnDevice,
    /// Experts stream host → device; every record fits in host memory.
    HostOffload,
    /// Records stream SSD → host → device.
    HostAndSsd,
}

impl OffloadMode {
    pub fn describe(self) -> &'static str {
        match self {
            OffloadMode::AllOnDevice => "all on device (a device slot for every expert)",
            OffloadMode::HostOffload => "host offload (experts stream from host memory)",
            OffloadMode::HostAndSsd => "host + SSD offload (expert records stream from the SSD)",
        }
    }
}

/// What a run needs, and what its budgets leave for the experts.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    pub mode: OffloadMode,
    /// Devices; the device figures below are each device's.
    pub devices: u64,
    pub dense_params: u64,
    /// Of `dense_params`, those with Adam moments (the others are frozen).
    pub dense_trainable: u64,
    pub expert_count: u64,
    pub expert_params: u64,
    pub dense_device_bytes: u64,
    pub activation_bytes: u64,
    /// Device bytes given to expert slots.
    pub expert_device_bytes: u64,
    pub device_slots: u64,
    /// On one GPU, the experts computed at once that the activations
    /// were counted for (`EngineConfig::expert_group`): 1 elsewhere.
    pub expert_group: usize,
    pub dense_host_bytes: u64,
    /// Host bytes given to expert records.
    pub expert_host_bytes: u64,
    pub host_slots: u64,
    /// Of `host_slots`, those split into compute cells
    /// (`EngineConfig::host_cell_slots`).
    pub host_cell_slots: u64,
    /// Of the other host slots, those keeping a record resident for the
    /// whole run (`EngineConfig::host_stream_slots`); the rest stream.
    pub host_kept: u64,
    pub ssd_bytes: u64,
    pub ssd_free_bytes: Option<u64>,
    /// Store bytes the experts' Adam moments would take were they trained
    /// (both copies of every record); 0 where they train.
    pub frozen_expert_moment_bytes: u64,
    /// Expert gradients (f32) the engine holds at most besides the
    /// budgets (`strata::engine::gradient_buffers`), and their bytes.
    pub gradient_buffers: u64,
    pub gradient_bytes: u64,
    /// On the cpu backend (`None` on a GPU), what each device computes
    /// with besides the activations it keeps ([`cpu_workspace_bytes`]).
    pub cpu_workspace_bytes: Option<u64>,
    /// This process's resident memory when it planned (the program, the
    /// tokenizer and the model's files read so far) with the rest of its
    /// code, which training pages in, where known.
    pub process_bytes: Option<u64>,
    /// The data's sequences held at once (its shuffle buffer and held-out
    /// set: `DataConfig::buffered_bytes`).
    pub data_bytes: u64,
}

/// The inputs of a plan.
pub struct PlanInput<'a> {
    pub model: &'a LmConfig,
    /// Dense params no step changes (`--train` leaves them out, or they
    /// are buffers): they have no Adam moments.
    pub frozen_dense: u64,
    /// Whether the experts train; frozen, their records hold no moments.
    pub train_experts: bool,
    pub compute_dtype: Dtype,
    pub seq_len: usize,
    pub batch: usize,
    pub micro_batches: usize,
    /// Devices, each with `device_mem`; they share the host memory.
    pub devices: usize,
    /// Ranks as processes this run is one of (1: the whole world).
    pub ranks: usize,
    pub device_mem: u64,
    pub host_mem: u64,
    /// Where the store will be (for its file system's free space).
    pub store_dir: Option<&'a Path>,
    /// `EngineConfig::host_stream_slots` and `host_cell_slots`: how the
    /// host slots split where records stream.
    pub host_stream_slots: Option<usize>,
    pub host_cell_slots: usize,
    /// The devices are GPUs (`--backend cuda`): activations as
    /// [`gpu_activation_bytes`] counts them.
    pub gpu: bool,
    /// `EngineConfig::expert_group`: on one GPU, the experts a pass
    /// computes at once (`None`: the GPU's default for these experts,
    /// `strata::backend::gpu_expert_group`), whose rows and gradients its
    /// workspace holds.
    pub expert_group: Option<usize>,
    /// One GPU keeps the dense params it computes with, and steps them
    /// there (`EngineConfig::dense_on_device` with `--backend cuda`): their
    /// Adam moments take device memory too.
    pub dense_on_device: bool,
    /// What the GPU's dense GEMMs take (`EngineConfig::dense_gemm`): with
    /// bf16, each weight's bf16 copy takes 2 bytes a dense param.
    pub dense_gemm: DenseGemm,
    /// What the cpu's expert GEMMs take (`EngineConfig::expert_gemm`):
    /// f32 GEMMs on bf16 params widen each expert's params first.
    pub expert_gemm: ExpertGemm,
    /// The naive schedule (`--clip-grad-norm`), which holds every expert
    /// gradient to the end of the backward.
    pub naive_schedule: bool,
    /// The cpu's compute threads, each with its buffers.
    pub compute_threads: usize,
}

/// Plans a run, or says what is short and by how much.
pub fn plan(input: &PlanInput) -> Result<MemoryPlan, String> {
    let m = input.model;
    let layout = Layout {
        layers: m.moe().layers as u32,
        experts_per_layer: m.experts as u32,
        params_per_expert: m.expert_params() as u64,
        compute_dtype: input.compute_dtype,
        moments: input.train_experts,
    };
    let experts = layout.expert_count();
    let dense = m.dense_params() as u64;
    let dense_trainable = dense - input.frozen_dense.min(dense);
    let devices = input.devices.max(1);
    let device = device_share(input, &layout, dense_trainable)?;
    let host = host_share(input, &layout, dense_trainable)?;
    let (ssd, ssd_free) = store_share(input, &layout)?;
    let engine = engine_view(input, &layout, [device.slots, host.slots], device.group);
    let gradients = gradient_buffers(&layout, &engine) as u64;
    // Records that do not all fit in host memory stream from the SSD for
    // their updates, however many experts the device holds.
    let mode = if host.slots < experts {
        OffloadMode::HostAndSsd
    } else if device.slots == experts {
        OffloadMode::AllOnDevice
    } else {
        OffloadMode::HostOffload
    };
    Ok(MemoryPlan {
        mode,
        devices: devices as u64,
        dense_params: dense,
        dense_trainable,
        expert_count: experts,
        expert_params: m.expert_params() as u64,
        dense_device_bytes: device.dense,
        activation_bytes: device.activations,
        expert_device_bytes: device.slots * layout.compute_payload_bytes(),
        device_slots: device.slots,
        expert_group: device.group,
        dense_host_bytes: host.dense,
        expert_host_bytes: host.slots * layout.record_bytes(),
        host_slots: host.slots,
        host_cell_slots: host.cell_slots,
        host_kept: host.kept,
        ssd_bytes: ssd,
        ssd_free_bytes: ssd_free,
        frozen_expert_moment_bytes: match input.train_experts {
            true => 0,
            false => 2 * experts * 8 * layout.params_per_expert,
        },
        gradient_buffers: gradients,
        gradient_bytes: gradients * 4 * layout.params_per_expert,
        cpu_workspace_bytes: (!input.gpu).then(|| {
            let seqs = input.batch.div_ceil(input.micro_batches.max(1) * devices);
            let t = (seqs * input.seq_len) as u64;
            let widened =
                input.expert_gemm == ExpertGemm::F32 && input.compute_dtype == Dtype::Bf16;
            let scratch = scratch_buffers_kept(cpu_expert_group_bound(&layout, &engine));
            cpu_workspace_bytes(m, t, input.compute_threads as u64, widened, scratch as u64)
        }),
        process_bytes: None,
        data_bytes: DataConfig {
            seq_len: input.seq_len,
            ..DataConfig::default()
        }
        .buffered_bytes(),
    })
}

/// The engine's configuration as far as its host memory goes, with
/// `slots` (the device's expert slots, the host's record slots) and
/// `group` experts computed at once on one GPU: what the engine's own
/// counts of it read.
fn engine_view(input: &PlanInput, layout: &Layout, slots: [u64; 2], group: usize) -> EngineConfig {
    let [device_slots, host_slots] = slots;
    EngineConfig {
        device_budget_bytes: device_slots * layout.compute_payload_bytes(),
        host_budget_bytes: host_slots * layout.record_bytes(),
        devices: input.devices.max(1),
        ranks: input.ranks.max(1),
        micro_batches: input.micro_batches.max(1),
        schedule: match input.naive_schedule {
            true => ScheduleKind::Naive,
            false => ScheduleKind::ExpertWise,
        },
        backend: match input.gpu {
            true => BackendKind::Cuda,
            false => BackendKind::Cpu,
        },
        expert_group: match input.gpu {
            true => Some(group),
            false => input.expert_group,
        },
        host_stream_slots: input.host_stream_slots,
        host_cell_slots: input.host_cell_slots,
        ..EngineConfig::default()
    }
}

/// The most experts one GPU would compute at once (`--expert-group`, else
/// the GPU's default for these experts, within a layer's experts): 1 on
/// the cpu and on several devices or ranks.
fn most_group(input: &PlanInput) -> usize {
    if !input.gpu || input.devices.max(1) * input.ranks.max(1) > 1 {
        return 1;
    }
    let params = input.model.expert_params() as u64;
    input
        .expert_group
        .unwrap_or_else(|| strata::backend::gpu_expert_group(params))
        .clamp(1, input.model.experts.max(1))
}

/// Each device's bytes: the dense params, what the activations keep and
/// their largest workspace, and the expert slots the rest holds; and the
/// experts computed at once the workspace was counted for.
struct DeviceShare {
    dense: u64,
    activations: u64,
    slots: u64,
    group: usize,
}

/// The device's share of `input` with the largest group of experts
/// computed at once (up to [`most_group`]) whose rows and gradients leave
/// the device two groups' slots (one computes while the next one's
/// uploads land), else with one expert at a time; or what is short.
fn device_share(
    input: &PlanInput,
    layout: &Layout,
    dense_trainable: u64,
) -> Result<DeviceShare, String> {
    for group in (2..=most_group(input)).rev() {
        let share = device_share_with(input, layout, dense_trainable, group).ok();
        if let Some(share) = share.filter(|s| s.slots >= 2 * group as u64) {
            return Ok(share);
        }
    }
    device_share_with(input, layout, dense_trainable, 1)
}

/// The device's share of `input`, `group` experts computed at once, or
/// what is short: one expert slot at least besides the dense params and
/// activations.
fn device_share_with(
    input: &PlanInput,
    layout: &Layout,
    dense_trainable: u64,
    group: usize,
) -> Result<DeviceShare, String> {
    let m = input.model;
    let dense = m.dense_params() as u64;
    let devices = input.devices.max(1);
    // Params and gradient, and, stepped there, the moments.
    let kept = input.dense_on_device && devices == 1;
    let bf16_copies = input.gpu && input.dense_gemm == DenseGemm::Bf16;
    // Several cpu devices (or ranks) reduce the gradient in buckets beside
    // the backward: a copy of it, at most, is on its way.
    let buckets = (devices > 1 || input.ranks > 1) && !input.gpu;
    let dense_device = 8 * dense
        + if kept { 8 * dense_trainable } else { 0 }
        + if bf16_copies { 2 * dense } else { 0 }
        + if buckets { 4 * dense } else { 0 };
    let seqs = input.batch.div_ceil(input.micro_batches.max(1) * devices);
    let activations = match input.gpu {
        true => gpu_activation_bytes(m, input.seq_len, seqs, group),
        false => activation_bytes(m, input.seq_len, seqs),
    };
    let tokens = (seqs * input.seq_len) as u64;
    if input.gpu && gpu_widest_launch(m, tokens) > u32::MAX as u64 {
        return Err(format!(
            "does not fit: {tokens} tokens a micro-batch make GPU kernels over {} values, \
             more than their 32-bit thread index reaches ({}). Raise --micro-batches or \
             --devices, or lower --batch / --seq-len",
            gpu_widest_launch(m, tokens),
            u32::MAX
        ));
    }
    let slot = layout.compute_payload_bytes();
    let fixed_device = dense_device + activations;
    let need_device = fixed_device + slot;
    if input.device_mem < need_device {
        return Err(format!(
            "does not fit: the device needs at least {} (dense params, grads, their \
             bf16 copies with bf16 GEMMs, the grads' copy reduced beside the backward \
             with several cpu devices or ranks and, stepped there, moments {}, \
             activations {} for {seqs} sequences of {} tokens, one expert slot {}) but \
             --device-mem (per device) is {}: {} short. Raise --device-mem, or lower \
             --batch / raise --micro-batches or --devices / lower --seq-len",
            show_bytes(need_device),
            show_bytes(dense_device),
            show_bytes(activations),
            input.seq_len,
            show_bytes(slot),
            show_bytes(input.device_mem),
            show_bytes(need_device - input.device_mem),
        ));
    }
    Ok(DeviceShare {
        dense: dense_device,
        activations,
        slots: ((input.device_mem - fixed_device) / slot).min(layout.expert_count()),
        group,
    })
}

/// Host memory's bytes: the dense moments, and the expert record slots
/// the rest holds, split into cells and kept records as asked.
struct HostShare {
    dense: u64,
    slots: u64,
    cell_slots: u64,
    kept: u64,
}

/// The host's share of `input`, or what is short: two expert records at
/// least besides the dense moments, and enough record slots left to
/// stream beside the compute cells.
fn host_share(
    input: &PlanInput,
    layout: &Layout,
    dense_trainable: u64,
) -> Result<HostShare, String> {
    let experts = layout.expert_count();
    let record = layout.record_bytes();
    let dense_host = 8 * dense_trainable;
    let host_min_slots = 2u64.min(experts);
    let need_host = dense_host + host_min_slots * record;
    if input.host_mem < need_host {
        return Err(format!(
            "does not fit: host memory needs at least {} (dense Adam moments {}, \
             {host_min_slots} expert records of {}) but --host-mem is {}: {} short. \
             Raise --host-mem",
            show_bytes(need_host),
            show_bytes(dense_host),
            show_bytes(record),
            show_bytes(input.host_mem),
            show_bytes(need_host - input.host_mem),
        ));
    }
    let host_slots = ((input.host_mem - dense_host) / record).min(experts);
    let split = EngineConfig {
        devices: input.devices.max(1),
        host_stream_slots: input.host_stream_slots,
        host_cell_slots: input.host_cell_slots,
        ..EngineConfig::default()
    };
    let cell_slots = host_cell_slot_count(&split, host_slots as usize, experts as usize) as u64;
    let record_slots = host_slots - cell_slots.min(host_slots);
    if cell_slots > 0 && record_slots < MIN_HOST_STREAM_SLOTS as u64 {
        return Err(format!(
            "does not fit: --host-cell-slots {cell_slots} leaves {record_slots} of the {host_slots} \
             host slots for expert records, and at least {MIN_HOST_STREAM_SLOTS} must hold records \
             to stream them. Lower --host-cell-slots, or raise --host-mem by {}",
            show_bytes((MIN_HOST_STREAM_SLOTS as u64 - record_slots) * record)
        ));
    }
    Ok(HostShare {
        dense: dense_host,
        slots: host_slots,
        cell_slots,
        kept: host_kept_count(&split, record_slots as usize, experts as usize) as u64,
    })
}

/// The store's bytes on disk and the free bytes where it goes, or what is
/// short there.
fn store_share(input: &PlanInput, layout: &Layout) -> Result<(u64, Option<u64>), String> {
    let dense = input.model.dense_params() as u64;
    let experts = layout.expert_count();
    // Store file: superblocks and maps, then two copies of each record;
    // plus two dense checkpoint files (params and moments) during a commit.
    let ssd = layout.data_offset() + 2 * experts * layout.record_bytes() + 2 * 12 * dense;
    // A store that is already there (a resume) needs only what it lacks.
    let existing = input
        .store_dir
        .and_then(|d| std::fs::metadata(d.join("experts.strata")).ok())
        .map_or(0, |m| m.len());
    let ssd_free = input.store_dir.and_then(free_bytes);
    if let Some(free) = ssd_free {
        let needed = ssd.saturating_sub(existing);
        if free < needed {
            return Err(format!(
                "does not fit: the store needs {} more on disk but {} has {} free: {} short. \
                 Free space there, or (for a new run) choose another --out",
                show_bytes(needed),
                input
                    .store_dir
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                show_bytes(free),
                show_bytes(needed - free),
            ));
        }
    }
    Ok((ssd, ssd_free))
}

/// Free bytes of the file system holding `dir` (or its nearest existing
/// ancestor).
pub fn free_bytes(dir: &Path) -> Option<u64> {
    let mut at = Some(dir);
    while let Some(p) = at {
        if p.exists() {
            return crate::sys::file_system_free_bytes(p);
        }
        at = p.parent().filter(|q| !q.as_os_str().is_empty());
        if at.is_none() && p.is_relative() {
            at = Some(Path::new("."));
            if p == Path::new(".") {
                return None;
            }
        }
    }
    None
}

/// A plan's inputs for tests: `m` at 8 × 64 tokens on one cpu device,
/// trained, bf16 compute copies, with these budgets.
#[cfg(test)]
pub(crate) fn test_input(m: &LmConfig, device_mem: u64, host_mem: u64) -> PlanInput<'_> {
    PlanInput {
        model: m,
        frozen_dense: 0,
        train_experts: true,
        compute_dtype: Dtype::Bf16,
        seq_len: 64,
        batch: 8,
        micro_batches: 1,
        devices: 1,
        ranks: 1,
        device_mem,
        host_mem,
        store_dir: None,
        host_stream_slots: EngineConfig::default().host_stream_slots,
        host_cell_slots: 0,
        gpu: false,
        expert_group: None,
        dense_on_device: false,
        dense_gemm: DenseGemm::Bf16,
        expert_gemm: ExpertGemm::Bf16,
        naive_schedule: false,
        compute_threads: 1,
    }
}

#[cfg(test)]
mod tests;
