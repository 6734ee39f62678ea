//! The engine's configuration: budgets, store, schedule, devices, backend.

use std::path::PathBuf;
use std::sync::Arc;

use strata_optim::AdamWHyper;
use strata_tiers::{Dtype, Timeline};

pub use crate::backend::ExpertCompute;
use crate::backend::{BackendKind, DenseGemm, ExpertGemm};

/// The fewest host slots `host_stream_slots` may stream through: one
/// holding the record being updated, one the record being uploaded, one
/// the next arriving. With two, `bench step`'s I/O-only run read 1008 MiB
/// a step instead of 630 with three: the prefetcher had nowhere to load,
/// and demand loads evicted what it had brought in.
pub const MIN_HOST_STREAM_SLOTS: usize = 3;

/// How experts move and when they are updated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScheduleKind {
    /// Prefetch along the schedule, upload the next expert while this one
    /// computes, update each expert as soon as its backward ends.
    #[default]
    ExpertWise,
    /// ZeRO-Offload at expert granularity: no prefetch, synchronous
    /// uploads, every update after the whole backward pass.
    Naive,
}

impl ScheduleKind {
    /// Whether uploads overlap compute: expert-wise, with a slot for the
    /// expert computing and one for the next arriving.
    pub(crate) fn overlaps(self, device_slots: usize) -> bool {
        self == ScheduleKind::ExpertWise && device_slots >= 2
    }
}

/// Budgets, store and schedule.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The store file; `None` keeps the SSD tier in memory.
    pub store_path: Option<PathBuf>,
    pub device_budget_bytes: u64,
    pub host_budget_bytes: u64,
    pub optimizer_threads: usize,
    pub schedule: ScheduleKind,
    pub hyper: AdamWHyper,
    /// Clip the global gradient norm (every dense and expert gradient of
    /// the step, together) to this, as `torch.nn.utils.clip_grad_norm_`:
    /// each gradient times min(1, max / (norm + 1e-6)). The norm is known
    /// only once the backward ends, so this needs the naive schedule,
    /// which holds every expert's gradient until then (the host memory
    /// plan counts them). `None` (the default): no clipping.
    pub clip_grad_norm: Option<f32>,
    /// Update the experts (`false`: they are frozen, as the dense tensors
    /// a network names in `Network::frozen_dense` are: their gradients are
    /// dropped, no update runs and no record is written back; gradient-only
    /// passes still report them).
    pub train_experts: bool,
    /// Precision of the compute params that travel to the device.
    pub compute_dtype: Dtype,
    /// Micro-batches per step (gradient accumulation).
    pub micro_batches: usize,
    /// Recompute the experts' hidden activations in the backward instead
    /// of keeping them.
    pub recompute_hidden: bool,
    /// Scheduled accesses the prefetcher looks ahead.
    pub prefetch_ahead_max: usize,
    /// Expert-wise schedule, one device, a host tier smaller than the
    /// store: the host slots that stream records through it. The others
    /// keep records resident for the whole run (the last layer's first,
    /// in index order), each of which then saves its read and its
    /// write-back every step (`None`: every slot streams, as the naive
    /// schedule's do). At least [`MIN_HOST_STREAM_SLOTS`].
    pub host_stream_slots: Option<usize>,
    /// Expert-wise schedule, one device, a host tier smaller than the
    /// store: host slots split into compute cells, each the size of one
    /// record's compute part (a seventh of a bf16 record). An expert read
    /// for its compute params alone (the forward's reads, a held update's
    /// backward) then takes a cell instead of a whole record slot, and a
    /// clean record next read that way moves to a cell (a host copy) when
    /// the prefetcher wants its slot for a record read in full; so the
    /// record slots carry the reads and write-backs of full records further
    /// ahead. The slots left hold records: kept ones first (see
    /// `host_stream_slots`), so each split slot keeps one record fewer.
    /// 0 (the default): none.
    pub host_cell_slots: usize,
    /// Where records are kept resident (see `host_stream_slots`) and the
    /// last layer's other experts all fit in the streaming slots: their
    /// updates wait for the next step's forward, which applies them just
    /// before that layer, as its records arrive for it anyway. Their
    /// write-backs then leave the backward, where the disk is the
    /// bottleneck, for the turn from forward to backward, where it idles;
    /// each holds its f32 gradient across the step boundary. The same
    /// update before the same next use: the same bits.
    pub defer_last_layer_updates: bool,
    /// Queue depth of the store's io_uring.
    pub io_queue_depth: u32,
    /// Whether the experts' GEMMs run ([`ExpertCompute::Run`], always in
    /// training); the other two are for benches.
    pub expert_compute: ExpertCompute,
    /// Device workers (cpu devices), each with its own device tier of
    /// `device_budget_bytes`. With more than one, each takes an equal share
    /// of every batch, experts are placed per layer by greedy LPT and the
    /// tokens exchanged (see `multi.rs`).
    pub devices: usize,
    /// With the cuda backend, the GPU of device 0: device i computes on
    /// GPU `first_gpu + i`. Ranks as processes on one machine give each
    /// rank its own (the trainer: the launcher's local rank).
    pub first_gpu: usize,
    /// Several devices: the share of each layer's experts kept resident
    /// (pinned) on a device, chosen by the previous step's load; 0 turns
    /// pinning off. Capped so two slots per device stay free to stream.
    pub pin_fraction: f64,
    /// Which backend computes the experts and the dense layers (device i
    /// uses GPU i with `Cuda`).
    pub backend: BackendKind,
    /// Where to record what each thread does when: SSD calls and the waits
    /// on them, each layer's expert loop, each expert's update (see
    /// [`strata_tiers::Timeline`]; `strata bench step --timeline` writes
    /// one). `None`: nothing is recorded.
    pub timeline: Option<Arc<Timeline>>,
    /// Count, step after step, how tokens move between consecutive MoE
    /// layers' experts ([`RoutingTrace`](super::RoutingTrace),
    /// [`Engine::routing_trace`](super::Engine::routing_trace)); off: no
    /// counting.
    pub trace_routing: bool,
    /// One device, records streaming from the SSD: predict each MoE
    /// layer's experts for the prefetcher from the token pairs counted
    /// between it and the layer before (inter-layer affinity) and that
    /// layer's routing, rather than from its own previous routing
    /// (`routed_io.rs`). Off: on moe-s trained from scratch, whose routing
    /// drifts, it missed fewer experts (125–140 against 164 over 12 steps)
    /// but named twice as many for nothing (401–448 against 197), and moved
    /// more bytes. Results are the same bits either way.
    pub affinity_prefetch: bool,
    /// One device whose dense kernels run on a GPU (`BackendKind::Cuda`):
    /// keep the dense params the GPU computes with, their AdamW moments
    /// and their gradient in its memory and step them there (the GPU's
    /// AdamW is the cpu's element update, bit for bit), so neither params
    /// nor gradient cross PCIe each step; the host's copy is brought up to
    /// date for a checkpoint or a read ([`Engine::dense_params`]). `false`:
    /// the cpu steps them, uploading the params after every update and
    /// downloading the gradient, as it does for several devices. Default:
    /// `true`.
    ///
    /// [`Engine::dense_params`]: super::Engine::dense_params
    pub dense_on_device: bool,
    /// What a GPU's dense GEMMs take as inputs: bf16 (the default, at the
    /// tensor cores' rate) or f32 (the cpu's results to f32 rounding). The
    /// cpu backend ignores it.
    pub dense_gemm: DenseGemm,
    /// What the cpu's expert GEMMs take as inputs where `compute_dtype` is
    /// bf16: the bf16 params as stored with activations rounded to bf16
    /// (the default, `vdpbf16ps` where the CPU has AVX512-BF16), or the
    /// params widened to f32. A GPU computes its experts in bf16 either
    /// way.
    pub expert_gemm: ExpertGemm,
    /// Token condensation (LUFFY; [`crate::condense`]): of the tokens a
    /// device sends to one expert, near duplicates are computed once. It
    /// changes results; `None` (the default) trains exactly. The cpu
    /// backend only, without `trace_routing` or `affinity_prefetch` (which
    /// pair tokens across layers that condensation no longer keeps whole).
    pub condense: Option<crate::condense::CondenseConfig>,
    /// Several devices: their collectives take at least the time this
    /// link would ([`crate::comm::ModeledLink`]; the same results), so
    /// that a slower interconnect can be measured on one machine. `None`
    /// (the default): as fast as the in-process exchange goes.
    pub link: Option<crate::comm::Link>,
    /// Several devices or ranks: the ranges of the dense gradient the
    /// backward has finished are all-reduced beside the rest of the
    /// backward, in buckets of at least this many bytes, so that many
    /// small layers pay a collective's latency a few times a step (1 MiB,
    /// the default; 0: each range alone). The results are the same bits
    /// whatever it is.
    pub dense_bucket_bytes: usize,
    /// With several devices or ranks: each MoE layer's exchange of tokens
    /// in parts, each part's dispatch and combine on the wire while the
    /// experts of another part compute (MPMoE's pipelined all-to-all; a
    /// part is a share of every device's experts, so the results are the
    /// same bits whatever the split). `Fixed(1)` (the default): one
    /// exchange each way.
    pub exchange_parts: ExchangeParts,
    /// Ranks as processes this engine is one of (one process per rank,
    /// started by `mpirun` with `comm::MpiComm`, feature `mpi`), each with one
    /// device worker; it joins the others with
    /// [`Engine::join_ranks`](super::Engine::join_ranks) before its first
    /// step. Each rank owns a fixed share of every layer's experts (expert
    /// e on rank e mod N), whose records live in its own tiers alone, and
    /// takes its share of every batch as a device does; the results are
    /// the bits of `devices = N` in one process. 1 (the default): this
    /// process is the whole world.
    pub ranks: usize,
    /// On one device: how many of a layer's experts a pass stages and
    /// computes at once: on a GPU each of the group's products one grouped
    /// GEMM, on the cpu the group's experts side by side on the compute
    /// threads (where it has at least two a thread; else one at a time,
    /// each GEMM split over them). `None` (the default): the device's own
    /// limit (`ExpertDevice::group_limit`; on the cpu 64 with several
    /// compute threads, 1 with one). Either way at most half of the device's expert slots, and
    /// where the host tier streams records, half of its streaming slots;
    /// several devices or ranks compute one expert at a time. The results
    /// are the same bits whatever the group (each expert's products are
    /// its own).
    pub expert_group: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            store_path: None,
            device_budget_bytes: 1 << 30,
            host_budget_bytes: 4 << 30,
            optimizer_threads: crate::parallel::machine_cores(),
            schedule: ScheduleKind::ExpertWise,
            hyper: AdamWHyper::default(),
            clip_grad_norm: None,
            train_experts: true,
            compute_dtype: Dtype::F32,
            micro_batches: 1,
            recompute_hidden: false,
            prefetch_ahead_max: 16,
            host_stream_slots: Some(4),
            host_cell_slots: 0,
            defer_last_layer_updates: true,
            io_queue_depth: 32,
            expert_compute: ExpertCompute::Run,
            devices: 1,
            first_gpu: 0,
            pin_fraction: 0.25,
            backend: BackendKind::Cpu,
            timeline: None,
            trace_routing: false,
            affinity_prefetch: false,
            dense_on_device: true,
            dense_gemm: DenseGemm::Bf16,
            expert_gemm: ExpertGemm::Bf16,
            condense: None,
            link: None,
            dense_bucket_bytes: 1 << 20,
            exchange_parts: ExchangeParts::Fixed(1),
            ranks: 1,
            expert_group: None,
        }
    }
}

impl EngineConfig {
    /// Device workers in the whole world: this process's, times the ranks.
    pub(crate) fn workers(&self) -> usize {
        self.devices * self.ranks
    }
}

/// How each MoE layer's exchange of tokens is split into parts
/// ([`EngineConfig::exchange_parts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExchangeParts {
    /// Up to this many parts (1: one exchange each way). A layer has at
    /// most as many parts as a device has experts with rows in it.
    Fixed(usize),
    /// For each layer and pass, the count of 1 … 8 parts measured the
    /// fastest over the run's first steps (MPMoE's adaptive search,
    /// `part_search.rs`): 1 part, then 2, 3, … two steps each, until a
    /// count is slower than the one before.
    Auto,
}
