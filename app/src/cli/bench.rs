//! `strata bench …`: runs each bench and prints its results as a table or
//! as JSON lines (the arguments are in `bench_args.rs`).

use std::io::Write;

use strata_optim::Kernel;

use super::bench_args::{
    AttentionArgs, BenchCommand, KernelsArgs, OptimArgs, OverlapArgs, PlacementArgs, StepArgs,
    StepTokens, TiersArgs, UploadArgs,
};
use super::CliError;
use super::{bench_pipeline, bench_routing, step_table};
use crate::bench;

/// Runs one bench and prints its results on stdout, its progress on stderr.
pub(super) fn execute(command: BenchCommand) -> Result<(), CliError> {
    match command {
        BenchCommand::Optim(args) => bench_optim(args),
        BenchCommand::Tiers(args) => bench_tiers(args),
        BenchCommand::Overlap(args) => bench_overlap(args),
        BenchCommand::Step(args) => bench_step(args),
        BenchCommand::Placement(args) => bench_placement(args),
        BenchCommand::Upload(args) => bench_upload(args),
        BenchCommand::Affinity(args) => bench_routing::affinity(args),
        BenchCommand::Condense(args) => bench_routing::condense(args),
        BenchCommand::Migrate(args) => bench_routing::migrate(args),
        BenchCommand::Pipeline(args) => bench_pipeline::pipeline(args),
        BenchCommand::Attention(args) => bench_attention(args),
        BenchCommand::Kernels(args) => bench_kernels(args),
    }
}

fn bench_kernels(args: KernelsArgs) -> Result<(), CliError> {
    set_compute_threads(args.compute_threads)?;
    crate::trainer::choose_bf16_kernel(&args.bf16_kernel)?;
    eprintln!(
        "# bf16 GEMMs: the {} kernel",
        strata::backend::Bf16Kernel::in_use().name()
    );
    let config = bench::kernels::KernelsBenchConfig {
        presets: args.presets,
        tokens: args.tokens,
        steps: args.steps.max(1),
        peak_time: std::time::Duration::from_millis(300),
    };
    let records = bench::kernels::run(&config, |line| eprintln!("# {line}"))?;
    if args.json {
        return write_json_lines(&records);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:<17} {:<7} {:>6} {:>6} {:>6} {:>8} {:>10} {:>9} {:>8}",
        "what", "preset", "rows", "d", "f", "threads", "median_ms", "GFLOP/s", "of_peak"
    )?;
    for r in &records {
        let share = r
            .share_of_peak
            .map_or("-".to_string(), |s| format!("{:.0}%", 100.0 * s));
        writeln!(
            out,
            "{:<17} {:<7} {:>6} {:>6} {:>6} {:>8} {:>10.3} {:>9.1} {:>8}",
            r.what,
            r.preset.as_deref().unwrap_or("-"),
            r.rows,
            r.d_model,
            r.d_ff,
            r.threads,
            1e3 * r.median_s,
            r.gflop_per_s,
            share
        )?;
    }
    Ok(())
}

fn bench_attention(args: AttentionArgs) -> Result<(), CliError> {
    let m = strata::lm::LmConfig::preset(&args.preset).map_err(|e| e.to_string())?;
    let config = bench::attention::AttentionBenchConfig {
        shape: strata::math::attention::AttnShape {
            seqs: args.seqs,
            seq_len: args.seq_len,
            heads: m.heads,
            kv_heads: m.kv_heads,
            head_dim: m.head_dim,
        },
        threads: args.threads,
        steps: args.steps.max(1),
        kept: args.kept,
        only: args.variant,
    };
    let records = bench::attention::run(&config, |line| eprintln!("# {line}"))?;
    if args.json {
        return write_json_lines(&records);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:<13} {:>8} {:>12} {:>12} {:>12} {:>13}",
        "variant", "threads", "forward_ms", "backward_ms", "saved_MiB", "peak_rss_MiB"
    )?;
    for r in &records {
        let rss = r
            .peak_rss_bytes
            .map_or("-".to_string(), |b| format!("{:.1}", b as f64 / 1048576.0));
        writeln!(
            out,
            "{:<13} {:>8} {:>12.1} {:>12.1} {:>12.2} {:>13}",
            r.variant,
            r.threads,
            r.forward_median_s * 1e3,
            r.backward_median_s * 1e3,
            r.saved_bytes as f64 / 1048576.0,
            rss
        )?;
    }
    writeln!(
        out,
        "preset {} attention: {} sequence(s) of {} tokens, {} heads over {} kv heads of {}; \
         the engine's keeping {:?}; medians of {} alternated repetitions",
        args.preset,
        config.shape.seqs,
        config.shape.seq_len,
        config.shape.heads,
        config.shape.kv_heads,
        config.shape.head_dim,
        config.kept,
        config.steps
    )?;
    Ok(())
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

/// `bench step`'s compute threads where none are asked for: every core
/// but one, which serves the SSD tier's I/O and the optimizer beside the
/// cpu backend's compute (a virtual machine's disk is served on its own
/// cores' time: with every core computing, the I/O takes it from them);
/// one on a one-core machine.
fn step_default_compute_threads() -> usize {
    strata::machine_cores().saturating_sub(1).max(1)
}

fn bench_step(args: StepArgs) -> Result<(), CliError> {
    require_dir(&args.dir)?;
    set_compute_threads(Some(
        args.compute_threads
            .unwrap_or_else(step_default_compute_threads),
    ))?;
    if !(args.host_fraction > 0.0 && args.host_fraction <= 1.0) {
        return Err("--host-fraction must be in (0, 1]".into());
    }
    if let Some(g) = args
        .modeled_device_gflops
        .filter(|g| !(g.is_finite() && *g > 0.0))
    {
        return Err(format!(
            "--modeled-device-gflops {g}: give the device's rate, a positive number"
        )
        .into());
    }
    if args.device_experts == 0 {
        return Err(
            "--device-experts must be at least 1: a device computes an expert from a slot \
             of its own"
                .into(),
        );
    }
    let defaults = bench::step::StepBenchConfig::default();
    let config = bench::step::StepBenchConfig {
        model: strata::model::ModelConfig {
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
        backend: strata::backend::BackendKind::parse(&args.backend)?,
        modeled_device_flops: args.modeled_device_gflops.map(|g| g * 1e9),
        optimizer_threads: args.optimizer_threads,
        dir: args.dir,
        timeline_dir: args.timeline,
        plot: args.plot,
        ..defaults
    };
    if let Some(path) = &config.plot {
        crate::plot::check_figure_path(path)?;
    }
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
            strata::set_compute_threads(n).map_err(|e| format!("--compute-threads {n}: {e}").into())
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
pub(super) fn write_json_lines<T: serde::Serialize>(
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
