//! The `strata` command line.

use std::io::Write;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use strata_optim::Kernel;

use crate::bench;

#[derive(Parser, Debug)]
#[command(
    name = "strata",
    version,
    about = "Train Mixture-of-Experts models larger than GPU memory"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Performance measurements (JSON lines with --json).
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// The CPU AdamW step (fp32 and mixed bf16) against the memory-bandwidth ceiling.
    Optim(OptimArgs),
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
    std::thread::available_parallelism().map_or(1, |n| n.get())
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

/// Runs the parsed command; errors are printed as one line on stderr.
pub fn run(cli: Cli) -> ExitCode {
    match execute(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("strata: error: {message}");
            ExitCode::FAILURE
        }
    }
}

fn execute(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Bench(BenchCommand::Optim(args)) => bench_optim(args),
    }
}

fn bench_optim(args: OptimArgs) -> Result<(), String> {
    let config = bench::optim::OptimBenchConfig {
        params: args.params,
        threads: args.threads,
        steps: args.steps,
        kernel: args.kernel.unwrap_or_else(Kernel::detect),
    };
    let records =
        bench::optim::run(&config, |line| eprintln!("# {line}")).map_err(|e| e.to_string())?;
    let mut out = std::io::stdout().lock();
    if args.json {
        for r in &records {
            let line = serde_json::to_string(r).map_err(|e| e.to_string())?;
            writeln!(out, "{line}").map_err(|e| e.to_string())?;
        }
    } else {
        writeln!(
            out,
            "{:<16} {:>9} {:>9} {:>12} {:>8} {:>9}",
            "variant", "median_ms", "min_ms", "Gparams/s", "GB/s", "ceiling"
        )
        .map_err(|e| e.to_string())?;
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
            )
            .map_err(|e| e.to_string())?;
        }
        writeln!(
            out,
            "kernel {}, {} params, {} threads, {} timed steps; ceiling = read-4/write-3 f32 sweep, same run",
            config.kernel.name(), config.params, config.threads, config.steps
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}
