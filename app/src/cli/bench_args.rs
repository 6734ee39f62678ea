//! `strata bench …`'s commands and their arguments, as clap parses them.

use clap::{Args, Subcommand};
use strata_optim::Kernel;

use crate::bench;
use crate::trainer::StreamSlots;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// The CPU AdamW step (fp32 and mixed bf16) against the memory-bandwidth ceiling.
    Optim(OptimArgs),
    /// Expert record read/write bandwidth through the SSD tier (io_uring and pread).
    Tiers(TiersArgs),
    /// Whether this machine can hide SSD traffic behind compute: record I/O alone,
    /// GEMMs on every core alone, and the two at once.
    Overlap(OverlapArgs),
    /// Training steps with experts on SSD: expert-wise vs naive schedule, against
    /// compute-only and I/O-only runs measured in the same invocation.
    Step(StepArgs),
    /// Per-layer expert placement: LPT latency, and load balance of LPT vs round-robin
    /// under uniform and Zipf token counts.
    Placement(PlacementArgs),
    /// Host → GPU expert uploads through the GPU device tier against a plain pinned
    /// memcpy (needs --features cuda and a GPU).
    Upload(UploadArgs),
    /// Inter-layer expert affinity: the share of token transitions between
    /// consecutive MoE layers that stay on their device, with experts placed
    /// per layer for balance against placed for affinity (heuristic, and the
    /// exact integer program where small enough), on a `train --trace-routing`
    /// file or, without one, on synthetic traces.
    Affinity(AffinityArgs),
    /// Each MoE layer's exchange in 1, 2, 4 and 8 parts (MPMoE's pipelined
    /// all-to-all) and in the parts `--pipeline auto` chooses, over modeled
    /// links: the exchanges' time, the cost model's prediction, the choice
    /// against the best measured.
    Pipeline(PipelineArgs),
    /// Token condensation (LUFFY) on hidden states from training a preset
    /// on the built-in text: the share of each layer's expert rows
    /// condensed at fixed thresholds and the adaptive one, the exact search
    /// against the signature search (time, rows missed), and the rows and
    /// bytes crossing between devices with the step over a modeled link.
    Condense(CondenseArgs),
    /// Sequence migration (LUFFY) on the routing of a preset trained on the
    /// built-in text: the rows crossing between devices (dispatch, the
    /// combine's expert outputs, the residual rows of moved sequences) and
    /// the attention's balance, with sequences staying or rebuilt where the
    /// paper's planner or the exact planner says, over round-robin, LPT
    /// and affinity placements; beside them ExFlow's context-coherent
    /// exchange (tokens rebuilt one by one, with the keys and values their
    /// attention then needs).
    Migrate(MigrateArgs),
    /// The cpu's causal attention as the engine runs it (each row's softmax
    /// max and sum kept, the probabilities recomputed in the backward)
    /// against the plain one that keeps every probability: time and memory.
    Attention(AttentionArgs),
    /// The cpu backend's expert FFN and its GEMM at the presets' expert
    /// shapes, against this machine's f32 fused multiply-add, bf16 dot
    /// product and AMX tile peaks measured in the same run.
    Kernels(KernelsArgs),
}

#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// Presets whose expert shapes to time (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "tiny,small,moe-s")]
    pub presets: Vec<String>,
    /// Tokens a step; each expert gets tokens × top-k / experts rows.
    #[arg(long, default_value_t = 1024)]
    pub tokens: usize,
    /// Timed repetitions (after 1 warm-up).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Threads the cpu backend's compute splits over, as `train`'s flag
    /// (default: every core); the peak loop runs on as many.
    #[arg(long, value_name = "N", value_parser = parse_compute_threads)]
    pub compute_threads: Option<usize>,
    /// The bf16 GEMMs' kernel, as `train`'s flag (default auto: the
    /// fastest this CPU runs).
    #[arg(
        long,
        value_name = "auto|amx-bf16|avx512-bf16|avx512-fma|avx2-fma|portable",
        default_value = "auto"
    )]
    pub bf16_kernel: String,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct AttentionArgs {
    /// The preset whose attention heads and head width to take.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Tokens a sequence.
    #[arg(long, default_value_t = 2048)]
    pub seq_len: usize,
    /// Sequences.
    #[arg(long, default_value_t = 1)]
    pub seqs: usize,
    /// Threads the engine's attention splits its sequences over (the plain
    /// one runs on one).
    #[arg(long, default_value_t = default_threads(), value_parser = parse_threads)]
    pub threads: usize,
    /// Timed repetitions of each variant (after 1 warm-up).
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Only this variant: `plain`, `rows` (the engine's, in the widest
    /// vectors this CPU has) or `rows-baseline|avx2|avx512` (default: the
    /// plain one and the engine's in each vector set this CPU runs,
    /// alternated); alone, its peak resident memory is reported too.
    #[arg(long, value_parser = bench::attention::Variant::from_name)]
    pub variant: Option<bench::attention::Variant>,
    /// What the engine's attention keeps for its backward: `row-stats`
    /// (each row's max and sum, the probabilities recomputed: the engine's
    /// choice past 16 MiB of them) or `probabilities` (its choice below).
    #[arg(long, default_value = "row-stats", value_parser = parse_kept)]
    pub kept: strata::math::attention_rows::Kept,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct PipelineArgs {
    /// The preset to train.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Experts a layer (a layer splits into at most as many parts as a
    /// device has experts).
    #[arg(long, default_value_t = 16)]
    pub experts: usize,
    /// Devices in this process exchanging tokens.
    #[arg(long, default_value_t = 2)]
    pub devices: usize,
    /// Sequences a step.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Tokens a sequence.
    #[arg(long, default_value_t = 128)]
    pub seq_len: usize,
    /// Modeled links, GB/s each way, or `none` (the transport as it is)
    /// (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    pub links: Vec<String>,
    /// The arms' engines as ranks of an MPI job, one device a rank (a
    /// strata built with --features mpi, under `mpirun -n N`; with
    /// `--links none`, over MPI's own transport); rank 0 reports.
    #[arg(long)]
    pub mpi: bool,
    /// Each collective's latency on the modeled links, µs.
    #[arg(long, default_value_t = 10.0)]
    pub latency_us: f64,
    /// Part counts to run beside auto (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    pub parts: Vec<usize>,
    /// Steps of every arm not counted, first.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Counted steps of every arm (the arms take turns).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// The projection (the model alone, for another machine): device
    /// counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "8,64")]
    pub project_devices: Vec<usize>,
    /// The projection's links, GB/s each way (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "100,400")]
    pub project_links: Vec<f64>,
    /// The projection's collective latency, µs.
    #[arg(long, default_value_t = 20.0)]
    pub project_latency_us: f64,
    /// The projected layer (default: Qwen3-30B-A3B's): d_model, an
    /// expert's hidden width, experts, top-k.
    #[arg(long, default_value_t = 2048)]
    pub project_d_model: usize,
    #[arg(long, default_value_t = 768)]
    pub project_d_ff: usize,
    #[arg(long, default_value_t = 128)]
    pub project_experts: usize,
    #[arg(long, default_value_t = 8)]
    pub project_top_k: usize,
    /// Tokens each projected device routes a step.
    #[arg(long, default_value_t = 8192)]
    pub project_tokens: usize,
    /// The projected devices' expert GEMM rate, TFLOP/s.
    #[arg(long, default_value_t = 400.0)]
    pub project_tflops: f64,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct CondenseArgs {
    /// The preset to train.
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Training steps before the hidden states are taken.
    #[arg(long, default_value_t = 300)]
    pub train_steps: u64,
    /// Tokens a sequence.
    #[arg(long, default_value_t = 64)]
    pub seq_len: usize,
    /// Sequences a step.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Device counts the captured batch's sequences are split over
    /// (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub devices: Vec<usize>,
    /// The modeled link between devices, GB/s.
    #[arg(long, default_value_t = 10.0)]
    pub link_gb_per_s: f64,
    /// Timed repetitions of each search.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct MigrateArgs {
    /// The preset to train.
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Training steps before the routing is taken.
    #[arg(long, default_value_t = 300)]
    pub train_steps: u64,
    /// Tokens a sequence.
    #[arg(long, default_value_t = 64)]
    pub seq_len: usize,
    /// Sequences a step.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Device counts the batch's sequences are split over
    /// (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    pub devices: Vec<usize>,
    /// How far a device's attention cost may go over its balanced share
    /// (0.25: 25 %).
    #[arg(long, default_value_t = 0.0)]
    pub slack: f64,
    /// The modeled link between devices, GB/s.
    #[arg(long, default_value_t = 10.0)]
    pub link_gb_per_s: f64,
    /// Timed repetitions of each plan.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct AffinityArgs {
    /// A routing trace written by `strata train --trace-routing`.
    #[arg(long)]
    pub trace: Option<std::path::PathBuf>,
    /// Device counts to place for (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    pub devices: Vec<usize>,
    /// How far over the balanced placement's busiest device a device's
    /// tokens may go in a layer (0.1: 10 %).
    #[arg(long, default_value_t = 0.1)]
    pub load_slack: f64,
    /// The devices are GPUs in this many nodes: each placement's share of
    /// pairs kept within a node, and the two-level placement (nodes
    /// first, then GPUs within each).
    #[arg(long)]
    pub nodes: Option<usize>,
    /// A later trace of the same run (written at a later checkpoint): the
    /// earlier trace's placement against one made afresh on the steps in
    /// between, and whether moving the records it moves pays.
    #[arg(long, requires = "trace")]
    pub later: Option<std::path::PathBuf>,
    /// With --later: the bytes of a token's row on the link (d_model × 4
    /// for f32 rows; default Mixtral-8x7B's).
    #[arg(long, default_value_t = 16384)]
    pub row_bytes: u64,
    /// With --later: the bytes of one expert's record that a move copies
    /// (default Mixtral-8x7B's: 176 M params × 14 bytes, the f32 master
    /// and moments and the bf16 copy).
    #[arg(long, default_value_t = 2_466_250_752)]
    pub record_bytes: u64,
    /// With --later: the steps a new placement has to pay for its moves.
    #[arg(long, default_value_t = 1000)]
    pub horizon: u64,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct UploadArgs {
    /// Timed repetitions per expert size.
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct PlacementArgs {
    /// Timed placements per (experts, devices) pair.
    #[arg(long, default_value_t = 20_000)]
    pub reps: usize,
    /// Token-count draws per distribution.
    #[arg(long, default_value_t = 50)]
    pub trials: usize,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct StepArgs {
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    #[arg(long, default_value_t = 8)]
    pub experts: usize,
    #[arg(long, default_value_t = 512)]
    pub d_model: usize,
    #[arg(long, default_value_t = 1024)]
    pub d_ff: usize,
    #[arg(long, default_value_t = 2)]
    pub top_k: usize,
    /// Tokens per step, or `balanced`: the count at which compute-only and
    /// I/O-only steps take as long, found by timing both first (from 1024).
    #[arg(long, default_value = "balanced", value_parser = parse_tokens)]
    pub tokens: StepTokens,
    /// Experts that fit on the device at once.
    #[arg(long, default_value_t = 2)]
    pub device_experts: u64,
    /// Share of all expert records that fit in host memory (the rest stream from SSD).
    #[arg(long, default_value_t = 0.25)]
    pub host_fraction: f64,
    /// Timed steps per configuration per round (after one warm-up step).
    #[arg(long, default_value_t = 2)]
    pub steps: usize,
    /// Rounds in which the four configurations take turns (each round rotates their order).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Device workers (cpu devices), each with --device-experts slots.
    #[arg(long, default_value_t = 1)]
    pub devices: usize,
    /// Several devices: share of each layer's experts pinned (0: off).
    #[arg(long, default_value_t = 0.25)]
    pub pin_fraction: f64,
    /// Host slots the expert-wise runs stream records through; the others
    /// keep records resident for the whole run. `all`: keep none.
    /// [default: 5, one more than the engine's]
    #[arg(long, value_parser = StreamSlots::parse)]
    pub host_stream_slots: Option<StreamSlots>,
    /// Host slots the expert-wise runs split into compute cells, each one
    /// record's compute part, for experts read for their compute params
    /// alone; the record slots left keep records first.
    #[arg(long, default_value_t = crate::bench::step::BENCH_CELL_SLOTS, value_name = "N")]
    pub host_cell_slots: usize,
    /// Where records are kept resident, hold the last layer's other
    /// updates for the next step's forward (`on`) or apply each as its
    /// backward ends (`off`).
    #[arg(long, default_value = "on", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    pub defer_updates: bool,
    /// Threads the cpu backend's expert and dense compute split over, or
    /// `all` (default: every core but one, left to the SSD tier's I/O and
    /// the optimizer as a GPU leaves them every core; on one core, that
    /// core). Every run uses the same count, and no result changes by a
    /// bit.
    #[arg(long, value_name = "N", value_parser = parse_compute_threads)]
    pub compute_threads: Option<usize>,
    /// Expert compute: cpu, or cuda (--features cuda and a GPU per device).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Threads running the experts' AdamW updates (one leaves the other
    /// cores to the cpu backend's GEMMs).
    #[arg(long, default_value_t = 1, value_parser = parse_threads)]
    pub optimizer_threads: usize,
    /// Model the device instead of computing the experts: every run but
    /// the I/O-only one skips the expert GEMMs and waits, asleep, for as
    /// long as a device at this many GFLOP/s would take. On a machine
    /// without a GPU it shows what the schedule's overlap gives where
    /// compute leaves the cores to the I/O and the optimizer, as a GPU's
    /// does. Its figures are a model's, not a GPU's.
    #[arg(long, value_name = "GFLOPS")]
    pub modeled_device_gflops: Option<f64>,
    /// Directory for the SSD tier's store files.
    #[arg(long, default_value = "/tmp")]
    pub dir: std::path::PathBuf,
    /// Write each run's last timed step as a Chrome trace, `<run>.json` in
    /// this directory (open it in https://ui.perfetto.dev): every SSD call,
    /// wait, expert loop and update, on its thread.
    #[arg(long, value_name = "DIR")]
    pub timeline: Option<std::path::PathBuf>,
    /// Draw each run's last timed step into one figure (.png or .svg): a
    /// panel a run, a lane a thread, every SSD call, wait, expert loop
    /// and update as a bar in time.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<std::path::PathBuf>,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct OverlapArgs {
    /// Directory on the disk to measure (a scratch store is made and removed there).
    #[arg(long, default_value = "/tmp")]
    pub dir: std::path::PathBuf,
    /// Approximate bytes of one record, in MiB (24: a `bench step` default expert).
    #[arg(long, default_value_t = 24)]
    pub record_mib: u64,
    /// Records in the scratch store; each I/O pass reads and writes them all.
    #[arg(long, default_value_t = 32)]
    pub records: u32,
    /// Rounds in which the three arms take turns.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Threads the compute arm's GEMMs split over, or `all` (default:
    /// every core); fewer leave cores to the I/O.
    #[arg(long, value_name = "N", value_parser = parse_compute_threads)]
    pub compute_threads: Option<usize>,
    /// How long the compute arm lasts, as a multiple of the I/O arm (1: balanced).
    #[arg(long, default_value_t = 1.0)]
    pub compute_over_io: f64,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct TiersArgs {
    /// Directory on the file system to measure (a scratch file is made and removed there).
    #[arg(long)]
    pub dir: std::path::PathBuf,
    /// Approximate bytes of one expert record, in MiB.
    #[arg(long, default_value_t = 8)]
    pub record_mib: u64,
    /// Records in the scratch store.
    #[arg(long, default_value_t = 128)]
    pub experts: u32,
    /// io_uring queue depths to measure, comma-separated.
    #[arg(long, default_value = "1,4,16,32", value_delimiter = ',')]
    pub queue_depths: Vec<u32>,
    /// Read passes over every record.
    #[arg(long, default_value_t = 2)]
    pub passes: u32,
    /// Engines: io_uring, pread (comma-separated).
    #[arg(long, default_value = "io_uring,pread", value_delimiter = ',', value_parser = parse_engine)]
    pub engines: Vec<strata_tiers::io::EnginePreference>,
    /// Keep the last scratch store file (`DIR/strata-bench.store`), e.g. to read it with fio.
    #[arg(long)]
    pub keep_file: bool,
    /// Only read: reuse `DIR/strata-bench.store` left by --keep-file (same --record-mib and --experts).
    #[arg(long)]
    pub reuse_file: bool,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `bench step --tokens`: a count, or `balanced`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepTokens {
    Balanced,
    Fixed(usize),
}

fn parse_tokens(value: &str) -> Result<StepTokens, String> {
    if value == "balanced" {
        return Ok(StepTokens::Balanced);
    }
    match value.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(StepTokens::Fixed(n)),
        _ => Err(format!(
            "`{value}` is neither a token count (1 or more) nor `balanced`"
        )),
    }
}

fn parse_on_off(value: &str) -> Result<bool, String> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("`{other}` is neither `on` nor `off`")),
    }
}

/// A thread count, at most [`strata::MAX_THREADS_PER_CORE`] a core (0 is
/// left to the bench, which names what must be at least 1).
fn parse_threads(value: &str) -> Result<usize, String> {
    let n: usize = value
        .parse()
        .map_err(|_| format!("`{value}` is not a thread count"))?;
    strata_optim::check_thread_count(n)?;
    Ok(n)
}

/// `--compute-threads`: a count, or `all` for every core of the machine.
fn parse_compute_threads(value: &str) -> Result<usize, String> {
    match value {
        "all" => Ok(strata::machine_cores()),
        n => n
            .parse()
            .map_err(|_| format!("`{n}` is neither a thread count nor `all`")),
    }
}

fn parse_engine(name: &str) -> Result<strata_tiers::io::EnginePreference, String> {
    use strata_tiers::io::EnginePreference;
    match name {
        "io_uring" | "uring" => Ok(EnginePreference::Uring),
        "pread" => Ok(EnginePreference::Pread),
        other => Err(format!("unknown engine `{other}`; one of: io_uring, pread")),
    }
}

#[derive(Args, Debug)]
pub struct OptimArgs {
    /// Params in the stepped expert (suffixes K, M, G are powers of 2).
    #[arg(long, default_value = "64M", value_parser = bench::parse_count)]
    pub params: usize,
    /// Optimizer threads (and ceiling-sweep threads).
    #[arg(long, default_value_t = default_threads(), value_parser = parse_threads)]
    pub threads: usize,
    /// Timed repetitions (after 2 warm-ups).
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// AdamW kernel: scalar, avx2_fma, avx512, neon (default: the fastest this CPU has).
    #[arg(long, value_parser = parse_kernel)]
    pub kernel: Option<Kernel>,
    /// One JSON object a line on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn default_threads() -> usize {
    strata::machine_cores()
}

fn parse_kernel(name: &str) -> Result<Kernel, String> {
    let kernel = Kernel::from_name(name).ok_or_else(|| {
        format!("unknown kernel `{name}`; one of: scalar, avx2_fma, avx512, neon")
    })?;
    if !kernel.is_supported() {
        return Err(format!(
            "this CPU cannot run the `{name}` kernel; the fastest it has is `{}`",
            Kernel::detect().name()
        ));
    }
    Ok(kernel)
}

fn parse_kept(name: &str) -> Result<strata::math::attention_rows::Kept, String> {
    use strata::math::attention_rows::Kept;
    match name {
        "row-stats" => Ok(Kept::RowStats),
        "probabilities" => Ok(Kept::Probabilities),
        other => Err(format!(
            "unknown `{other}`; one of: row-stats, probabilities"
        )),
    }
}
