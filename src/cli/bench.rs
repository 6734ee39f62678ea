//! `strata bench …`: each bench's arguments, and its results printed as a
//! table or as JSON lines.

use std::io::Write;

use clap::{Args, Subcommand};
use strata_optim::Kernel;

use super::step_table;
use super::CliError;
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
    /// The share of each other layer's experts whose updates are held for
    /// the next step's forward too, so that their records are read and
    /// written in full during the forward (0 to 1; about F / (F + B), the
    /// forward's part of the compute, balances the passes' disk work; the
    /// engine's default is 0).
    #[arg(long, default_value_t = crate::bench::step::BENCH_DEFERRED_SHARE, value_name = "SHARE")]
    pub defer_share: f64,
    /// Threads the cpu backend's expert and dense compute split over
    /// (default: every core). Fewer leave the other cores to the SSD
    /// tier's I/O and the optimizer, as a GPU leaves them all; every run
    /// uses the same count, and no result changes by a bit.
    #[arg(long, value_name = "N")]
    pub compute_threads: Option<usize>,
    /// Expert compute: cpu, or cuda (--features cuda and a GPU per device).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Threads running the experts' AdamW updates (one leaves the other
    /// cores to the cpu backend's GEMMs).
    #[arg(long, default_value_t = 1)]
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
    /// Threads the compute arm's GEMMs split over (default: every core);
    /// fewer leave cores to the I/O.
    #[arg(long, value_name = "N")]
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
    #[arg(long, default_value_t = default_threads())]
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
    crate::parallel::machine_cores()
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

/// Runs one bench and prints its results on stdout, its progress on stderr.
pub(super) fn execute(command: BenchCommand) -> Result<(), CliError> {
    match command {
        BenchCommand::Optim(args) => bench_optim(args),
        BenchCommand::Tiers(args) => bench_tiers(args),
        BenchCommand::Overlap(args) => bench_overlap(args),
        BenchCommand::Step(args) => bench_step(args),
        BenchCommand::Placement(args) => bench_placement(args),
        BenchCommand::Upload(args) => bench_upload(args),
    }
}

fn bench_upload(args: UploadArgs) -> Result<(), CliError> {
    let records = bench::upload::run(args.reps, &bench::upload::DEFAULT_SIZES, |line| {
        eprintln!("# {line}")
    })?;
    if args.json {
        return write_json_lines(&records);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:>12} {:>8} {:>12} {:>12} {:>7} {:>7} {:>12}",
        "expert", "experts", "upload GB/s", "plain GB/s", "ratio", "locked", "staged GB/s"
    )?;
    for r in &records {
        writeln!(
            out,
            "{:>12} {:>8} {:>12.2} {:>12.2} {:>7.3} {:>7} {:>12.2}",
            crate::trainer::options::show_bytes(r.expert_bytes as u64),
            r.experts,
            r.upload_gb_per_s,
            r.plain_gb_per_s,
            r.ratio,
            r.page_locked,
            r.staged_gb_per_s
        )?;
    }
    Ok(())
}

fn bench_placement(args: PlacementArgs) -> Result<(), CliError> {
    if args.reps == 0 || args.trials == 0 {
        return Err("--reps and --trials must be at least 1".into());
    }
    let (latency, balance) = bench::placement::run(args.reps, args.trials);
    if args.json {
        write_json_lines(&latency)?;
        return write_json_lines(&balance);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:>8} {:>8} {:>12}",
        "experts", "devices", "latency ns"
    )?;
    for r in &latency {
        writeln!(
            out,
            "{:>8} {:>8} {:>12.0}",
            r.experts, r.devices, r.latency_ns
        )?;
    }
    writeln!(
        out,
        "{:>8} {:>8} {:>9} {:>12} {:>9} {:>10}",
        "experts", "devices", "tokens", "policy", "load gap", "span/bound"
    )?;
    for r in &balance {
        writeln!(
            out,
            "{:>8} {:>8} {:>9} {:>12} {:>8.1}% {:>10.3}",
            r.experts,
            r.devices,
            r.distribution,
            r.policy,
            100.0 * r.load_gap,
            r.makespan_over_bound
        )?;
    }
    Ok(())
}

fn bench_step(args: StepArgs) -> Result<(), CliError> {
    require_dir(&args.dir)?;
    set_compute_threads(args.compute_threads)?;
    if !(args.host_fraction > 0.0 && args.host_fraction <= 1.0) {
        return Err("--host-fraction must be in (0, 1]".into());
    }
    let defaults = bench::step::StepBenchConfig::default();
    let config = bench::step::StepBenchConfig {
        model: crate::model::ModelConfig {
            layers: args.layers,
            experts: args.experts,
            d_model: args.d_model,
            d_ff: args.d_ff,
            top_k: args.top_k,
            ..defaults.model.clone()
        },
        tokens: match args.tokens {
            StepTokens::Fixed(n) => n,
            StepTokens::Balanced => defaults.tokens,
        },
        balance_tokens: args.tokens == StepTokens::Balanced,
        device_experts: args.device_experts,
        host_fraction: args.host_fraction,
        steps: args.steps,
        rounds: args.rounds,
        devices: args.devices,
        pin_fraction: args.pin_fraction,
        host_stream_slots: args
            .host_stream_slots
            .map_or(defaults.host_stream_slots, |s| s.0),
        host_cell_slots: args.host_cell_slots,
        defer_updates: args.defer_updates,
        deferred_update_share: args.defer_share,
        backend: crate::backend::BackendKind::parse(&args.backend)?,
        modeled_device_flops: args.modeled_device_gflops.map(|g| g * 1e9),
        optimizer_threads: args.optimizer_threads,
        dir: args.dir,
        timeline_dir: args.timeline,
        ..defaults
    };
    let (records, summary) =
        bench::step::run(&config, |line| eprintln!("# {line}")).map_err(|e| e.to_string())?;
    if args.json {
        write_json_lines(&records)?;
        return write_json_lines([&summary]);
    }
    step_table::print(&records, &summary)
}

/// `--compute-threads`, where given: fixed before anything computes.
fn set_compute_threads(threads: Option<usize>) -> Result<(), CliError> {
    match threads {
        Some(n) => {
            crate::set_compute_threads(n).map_err(|e| format!("--compute-threads {n}: {e}").into())
        }
        None => Ok(()),
    }
}

fn bench_overlap(args: OverlapArgs) -> Result<(), CliError> {
    require_dir(&args.dir)?;
    set_compute_threads(args.compute_threads)?;
    let config = bench::overlap::OverlapBenchConfig {
        dir: args.dir,
        record_mib: args.record_mib,
        records: args.records,
        rounds: args.rounds,
        compute_over_io: args.compute_over_io,
    };
    let (records, summary) =
        bench::overlap::run(&config, |line| eprintln!("# {line}")).map_err(|e| e.to_string())?;
    if args.json {
        write_json_lines(&records)?;
        return write_json_lines([&summary]);
    }
    let mut out = std::io::stdout().lock();
    let opt = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |x| format!("{x:.prec$}"));
    writeln!(
        out,
        "{:<8} {:>7} {:>7} {:>9} {:>8} {:>8} {:>8} {:>7}",
        "arm", "wall_s", "io_s", "compute_s", "io_GB/s", "GFLOP/s", "steal_s", "cpu_s"
    )?;
    for r in &records {
        writeln!(
            out,
            "{:<8} {:>7.3} {:>7} {:>9} {:>8} {:>8} {:>8} {:>7}",
            r.arm,
            r.wall_s,
            opt(r.io_s, 3),
            opt(r.compute_s, 3),
            opt(r.io_gb_per_s, 2),
            opt(r.gflop_per_s, 1),
            opt(r.steal_s, 2),
            opt(r.cpu_s, 2),
        )?;
    }
    writeln!(
        out,
        "together they took {:.2}x max(io, compute), where a perfect overlap takes 1.00x \
         and none {:.2}x; by round: {}",
        summary.both_over_bound,
        summary.serial_over_bound,
        summary
            .both_over_bound_by_round
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    )?;
    if let Some(r) = records.first() {
        if r.compute_threads < r.machine_cores {
            writeln!(
                out,
                "the GEMMs split over {} of the {} cores (--compute-threads)",
                r.compute_threads, r.machine_cores
            )?;
        }
    }
    writeln!(
        out,
        "beside each other the I/O ran {:.2}x and the GEMMs {:.2}x their time alone",
        summary.io_slowdown, summary.compute_slowdown
    )?;
    Ok(())
}

fn bench_tiers(args: TiersArgs) -> Result<(), CliError> {
    require_dir(&args.dir)?;
    if args.queue_depths.contains(&0) || args.experts == 0 || args.record_mib == 0 {
        return Err("--queue-depths, --experts and --record-mib must be at least 1".into());
    }
    let config = bench::tiers::TiersBenchConfig {
        dir: args.dir,
        record_mib: args.record_mib,
        experts: args.experts,
        queue_depths: args.queue_depths,
        engines: args.engines,
        passes: args.passes.max(1),
        keep_file: args.keep_file,
        reuse_file: args.reuse_file,
    };
    let records =
        bench::tiers::run(&config, |line| eprintln!("# {line}")).map_err(|e| e.to_string())?;
    if args.json {
        return write_json_lines(&records);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:<9} {:<6} {:>6} {:>12} {:>8} {:>10}",
        "engine", "op", "depth", "record_bytes", "GB/s", "CPU s/GB"
    )?;
    for r in &records {
        writeln!(
            out,
            "{:<9} {:<6} {:>6} {:>12} {:>8.2} {:>10.3}",
            r.engine, r.op, r.queue_depth, r.record_bytes, r.gb_per_s, r.cpu_s_per_gb
        )?;
    }
    Ok(())
}

fn bench_optim(args: OptimArgs) -> Result<(), CliError> {
    let config = bench::optim::OptimBenchConfig {
        params: args.params,
        threads: args.threads,
        steps: args.steps,
        kernel: args.kernel.unwrap_or_else(Kernel::detect),
    };
    let records =
        bench::optim::run(&config, |line| eprintln!("# {line}")).map_err(|e| e.to_string())?;
    if args.json {
        return write_json_lines(&records);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:<16} {:>9} {:>9} {:>12} {:>8} {:>9}",
        "variant", "median_ms", "min_ms", "Gparams/s", "GB/s", "ceiling"
    )?;
    for r in &records {
        writeln!(
            out,
            "{:<16} {:>9.2} {:>9.2} {:>12.3} {:>8.1} {:>9.3}",
            r.variant,
            r.median_s * 1e3,
            r.min_s * 1e3,
            r.params_per_s / 1e9,
            r.gb_per_s,
            r.ceiling_ratio
        )?;
    }
    writeln!(
            out,
            "kernel {}, {} params, {} threads, {} timed steps; ceiling = read-4/write-3 f32 sweep, same run",
            config.kernel.name(), config.params, config.threads, config.steps
        )?;
    Ok(())
}

/// One JSON object a line on stdout; a closed pipe is an error, not a panic.
fn write_json_lines<T: serde::Serialize>(
    records: impl IntoIterator<Item = T>,
) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    for record in records {
        let line = serde_json::to_string(&record).map_err(|e| e.to_string())?;
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// `--dir` must name a directory: the benches make their scratch files there.
fn require_dir(dir: &std::path::Path) -> Result<(), CliError> {
    if dir.is_dir() {
        return Ok(());
    }
    Err(format!(
        "--dir {}: not a directory; give a directory on the disk to measure",
        dir.display()
    )
    .into())
}
