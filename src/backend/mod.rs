//! Compute backends. An [`ExpertDevice`] is the one seam the engine
//! drives: a device tier (`strata_tiers::DeviceArena`) and the expert FFN
//! computed from the params in one of its slots, with the dense layers'
//! kernels beside it ([`DenseKernels`](crate::model::DenseKernels)). Its
//! implementations: the cpu device ([`CpuExpertDevice`]), the GPU
//! (`cuda::CudaExpertDevice`) and the modeled device of the benches
//! ([`ModeledExpertDevice`]). [`CpuBackend`] and `cuda::CudaBackend` also
//! offer the expert FFN on host slices, which the tests hold to the plain
//! math. The `cpu` backend runs everywhere and runs every test.

mod activations;
mod bf16_gemm;
mod cpu;
mod cpu_bf16;
mod cpu_device;
#[cfg(feature = "cuda")]
pub mod cuda;
mod expert_device;
mod gemm;
mod modeled;
mod narrow;

pub use bf16_gemm::Bf16Kernel;
/// The packed panels of B each thread of the bf16 GEMMs keeps, in bytes.
pub use bf16_gemm::B_PANELS_BYTES as BF16_GEMM_THREAD_B_BYTES;
#[cfg(target_arch = "x86_64")]
pub use bf16_gemm::{amx_dot_loop, AMX_DOT_LOOP_FLOPS};
pub use cpu::CpuBackend;

/// On a GPU, the most bytes one block of attention scores takes (the
/// backward's d probabilities as much again): the attention's workspace
/// stays bounded at any sequence length.
pub const ATTENTION_BLOCK_BYTES: usize = 256 << 20;

/// On a GPU, the parts a row's sum is taken in by the kernels that read a
/// row a warp at a time (the norms, the attention's softmax, the
/// cross-entropy, the combine's weight gradient): each holds this many
/// partial sums a row (the softmax and the cross-entropy twice as many,
/// maxes and sums) while it runs.
pub const ROW_PARTS: usize = 32;

/// The most experts a GPU computes at once, each of their products one
/// grouped GEMM (`cuda/expert_group.rs`).
pub const GPU_GROUP_MAX: usize = 16;

/// Expert params a GPU's group of experts holds at most: the group's
/// weight gradients (f32) stay on the GPU until the next group's backward
/// is queued, so two groups' worth, 512 MiB, are there at once.
pub const GPU_GROUP_PARAMS: u64 = 1 << 26;

/// How many experts of `params_per_expert` params a GPU computes at once
/// by default: up to [`GPU_GROUP_MAX`] within [`GPU_GROUP_PARAMS`], so that
/// many small experts (fine-grained MoE: OLMoE's 6.3 M params, Qwen3-MoE's
/// 4.7 M) take one launch a product, and large ones (Mixtral's 176 M)
/// one at a time, where a launch is small beside its product.
pub fn gpu_expert_group(params_per_expert: u64) -> usize {
    let fit = GPU_GROUP_PARAMS / params_per_expert.max(1);
    (fit as usize).clamp(1, GPU_GROUP_MAX)
}

/// On a GPU, the tokens' stable order by id (the embedding's backward)
/// is a merge sort: runs of this many tokens ordered alone, in one launch.
pub const TOKEN_RUN: usize = 64;

/// The widths of the sorted runs the GPU's merge passes join in pairs,
/// after the first launch has ordered runs of [`TOKEN_RUN`] tokens: one
/// launch each, ⌈log2(t / TOKEN_RUN)⌉ of them.
pub fn token_order_merge_widths(t: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(TOKEN_RUN), |w| Some(2 * w)).take_while(move |&w| w < t)
}

/// On a GPU, the assignments a thread of the token permutation's kernels
/// scans: each (chunk, expert) pair is a thread, so T·K assignments take
/// T·K / 64 · E threads, each reading at most 64 of them and E + T·K / 64
/// counts.
pub const PERMUTATION_CHUNK: usize = 64;

/// On a GPU, the most bytes the logits of one block of the head's rows
/// take (their gradient as much again; a block holds one row at least).
pub const HEAD_BLOCK_BYTES: usize = 1 << 30;

/// The least free memory, in bytes, of the GPUs `gpus` (at least the
/// first; what a run may size its `--device-mem` from).
#[cfg(feature = "cuda")]
pub fn gpu_free_bytes(gpus: Range<usize>) -> Result<u64, EngineError> {
    let mut least = u64::MAX;
    for ordinal in gpus.start..gpus.end.max(gpus.start + 1) {
        let (ctx, _) = strata_tiers::device_cuda::open_gpu(ordinal)?;
        let (free, _) = ctx.mem_get_info().map_err(|e| EngineError::Device {
            device: ordinal,
            why: format!("its free memory: {e}"),
        })?;
        least = least.min(free as u64);
    }
    Ok(least)
}

/// Without the cuda feature there is no GPU to ask.
#[cfg(not(feature = "cuda"))]
pub fn gpu_free_bytes(_gpus: Range<usize>) -> Result<u64, EngineError> {
    Err(EngineError::Config(
        "this strata was built without --features cuda".into(),
    ))
}

/// Rows a block of the head holds on a GPU for a vocabulary of `v`.
pub fn head_block_rows(v: usize) -> usize {
    (HEAD_BLOCK_BYTES / (4 * v)).max(1)
}
pub use cpu_bf16::gemm_forward_bf16;
pub use cpu_device::{cpu_group_limit, cpu_group_side_by_side, CpuExpertDevice, CPU_GROUP_MAX};
pub use expert_device::{
    ArrivingGradient, DeviceGradient, DeviceRows, Download, ExpertBackward, ExpertBackwardRows,
    ExpertDevice, ExpertForward, ExpertForwardRows, SlotParams, GRADIENT_DOWNLOAD_BUFFERS,
};
pub use gemm::gemm_forward;
pub use modeled::{ExpertCompute, ModeledExpertDevice};
pub use narrow::NarrowCpuKernels;

use std::ops::Range;
use strata_tiers::{Dtype, Layout};

use crate::EngineError;

/// What the GPU's dense GEMMs (the attention's projections, a dense MLP,
/// a shared expert, the head) take as inputs. The experts' GEMMs are bf16
/// on the GPU either way, the router's logits f32, and the cpu backend
/// computes its dense GEMMs in f32 (its experts' as [`ExpertGemm`] says).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DenseGemm {
    /// Activations, output gradients and weights rounded to bf16 (round to
    /// nearest even), products accumulated and written in f32, the master
    /// weights f32: the tensor cores' rate, as PyTorch's bf16 autocast.
    #[default]
    Bf16,
    /// f32 inputs without tensor-core rounding: the cpu's results to f32
    /// rounding of another order of sums, at the GPU's f32 rate.
    F32,
}

impl DenseGemm {
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "bf16" => Ok(DenseGemm::Bf16),
            "f32" => Ok(DenseGemm::F32),
            other => Err(format!("unknown dense GEMM type {other:?} (bf16 or f32)")),
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            DenseGemm::Bf16 => "bf16",
            DenseGemm::F32 => "f32",
        }
    }
}

/// What the cpu's expert GEMMs take as inputs when the experts' compute
/// params are bf16 (with f32 or f16 params they are f32 either way).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertGemm {
    /// The bf16 params as they are stored, the activations and output
    /// gradients rounded to bf16 (nearest even), products summed in f32
    /// (`vdpbf16ps` where the CPU has AVX512-BF16, else plain code of the
    /// same sums).
    #[default]
    Bf16,
    /// The params widened to f32 and f32 activations: f32 GEMMs.
    F32,
}

impl ExpertGemm {
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "bf16" => Ok(ExpertGemm::Bf16),
            "f32" => Ok(ExpertGemm::F32),
            other => Err(format!("unknown expert GEMM type {other:?} (bf16 or f32)")),
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            ExpertGemm::Bf16 => "bf16",
            ExpertGemm::F32 => "f32",
        }
    }
}

/// Which backend computes the experts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendKind {
    #[default]
    Cpu,
    /// An NVIDIA GPU (needs the `cuda` feature and a driver).
    Cuda,
}

impl BackendKind {
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "cpu" => Ok(BackendKind::Cpu),
            "cuda" => Ok(BackendKind::Cuda),
            other => Err(format!("unknown backend {other:?} (cpu or cuda)")),
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }

    /// The backend for a user who names none: `Cuda` where this build has
    /// the `cuda` feature and `devices` GPUs open with NVRTC and cuBLAS
    /// beside them for params stored as `compute_dtype`, else `Cpu`; with
    /// what it found (the first GPU's name, or why there is none to use).
    pub fn detect(devices: usize, compute_dtype: Dtype) -> (Self, String) {
        #[cfg(feature = "cuda")]
        {
            match BackendKind::Cuda.check(0..devices, compute_dtype) {
                Ok(()) => {
                    let name = strata_tiers::device_cuda::open_gpu(0)
                        .map(|(_, info)| info.name)
                        .unwrap_or_else(|_| "GPU".into());
                    (BackendKind::Cuda, format!("found {devices} × {name}"))
                }
                Err(e) => (BackendKind::Cpu, e.to_string()),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (devices, compute_dtype);
            let why = "this strata was built without --features cuda";
            (BackendKind::Cpu, why.into())
        }
    }

    /// Checks, without building anything, that devices `gpus` of this kind
    /// can be opened (those GPUs for `Cuda`) and compute from expert params
    /// stored as `compute_dtype`.
    pub fn check(self, gpus: Range<usize>, compute_dtype: Dtype) -> Result<(), EngineError> {
        if self == BackendKind::Cuda && compute_dtype == Dtype::F16 {
            return Err(EngineError::Config(
                "the cuda backend computes from bf16 (or f32) expert params: use \
                 --compute-dtype bf16, or the cpu backend for f16"
                    .into(),
            ));
        }
        match self {
            BackendKind::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => {
                for ordinal in gpus.clone() {
                    strata_tiers::device_cuda::open_gpu(ordinal)?;
                }
                match gpus.is_empty() {
                    true => Ok(()),
                    false => cuda::check_libraries(gpus.start),
                }
            }
            #[cfg(not(feature = "cuda"))]
            BackendKind::Cuda => {
                let _ = gpus;
                Err(Self::no_cuda_feature())
            }
        }
    }

    /// Device `ordinal` of this kind with `device_budget_bytes` carved into
    /// expert slots for `layout`'s compute params, its dense GEMMs taking
    /// `dense` inputs on a GPU and its experts' `experts` inputs on the
    /// cpu, or why it cannot be had.
    pub fn open_device(
        self,
        ordinal: usize,
        device_budget_bytes: u64,
        layout: &Layout,
        (dense, experts): (DenseGemm, ExpertGemm),
    ) -> Result<Box<dyn ExpertDevice>, EngineError> {
        match self {
            BackendKind::Cpu => {
                let _ = (ordinal, dense);
                let device = CpuExpertDevice::new(device_budget_bytes, layout, experts)?;
                Ok(Box::new(device))
            }
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => {
                let _ = experts; // bf16 on the GPU whatever this says
                Ok(Box::new(cuda::CudaExpertDevice::new(
                    ordinal,
                    device_budget_bytes,
                    layout,
                    dense,
                )?))
            }
            #[cfg(not(feature = "cuda"))]
            BackendKind::Cuda => {
                let _ = (dense, experts);
                Err(Self::no_cuda_feature())
            }
        }
    }

    #[cfg(not(feature = "cuda"))]
    fn no_cuda_feature() -> EngineError {
        EngineError::Config(
            "this strata was built without the cuda feature: rebuild with \
             `cargo build --release --features cuda`, or use the cpu backend"
                .into(),
        )
    }
}
