//! The `strata` command line: the training commands here, the benches in
//! `cli/bench.rs`.

mod bench;
mod bench_args;
mod bench_pipeline;
mod bench_routing;
mod step_table;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

pub use bench_args::BenchCommand;

use crate::trainer::{self, Source, TrainFlags};

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
    /// Train an MoE language model (Mixtral architecture) from scratch (built-in data by default).
    Train(TrainFlags),
    /// Fine-tune a Hugging Face checkpoint: Mixtral, Qwen3-MoE, OLMoE or Qwen2-MoE (config.json + safetensors).
    Finetune(FinetuneArgs),
    /// Print the bytes each tier needs and the offloading mode, or why it cannot fit.
    Plan(PlanArgs),
    /// Write a run's model as safetensors in the Hugging Face layout.
    Export(ExportArgs),
    /// Check a run's checkpoint without training: every expert record and
    /// the dense state; names what is damaged (exit status 1).
    Verify(VerifyArgs),
    /// Draw a run's loss, held-out loss, tokens/s, stalls and learning rate
    /// into one figure (PNG or SVG); works on a run in progress.
    Plot(PlotArgs),
    /// Performance measurements (JSON lines with --json).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Start N ranks of a run on this machine, each a process: `strata
    /// launch --nproc 2 -- train …` runs `mpirun -n 2 strata train …` (a
    /// strata built with --features mpi); with --comm nccl it starts them
    /// itself, one GPU each, over NCCL (--features nccl).
    Launch(LaunchArgs),
}

#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Ranks (processes) to start.
    #[arg(long)]
    pub nproc: usize,
    /// The MPI launcher to run (default: mpirun on PATH).
    #[arg(long)]
    pub mpirun: Option<PathBuf>,
    /// What the ranks talk over: `mpi` (mpirun starts them) or `nccl`
    /// (strata starts them, rank R on GPU R, meeting at MASTER_PORT or a
    /// free port on 127.0.0.1).
    #[arg(long, default_value = "mpi", value_parser = ["mpi", "nccl"])]
    pub comm: String,
    /// What each rank runs: `train …` or `finetune …`, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<std::ffi::OsString>,
}

#[derive(Args, Debug)]
pub struct FinetuneArgs {
    /// The model directory: config.json, *.safetensors (sharded with an index or not).
    #[arg(long)]
    pub model: PathBuf,
    #[command(flatten)]
    pub flags: TrainFlags,
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// A model directory to plan for (default: the --preset).
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub flags: TrainFlags,
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The run directory (a train or finetune --out; for ranks started by
    /// mpirun, the --out holding their rank-R directories).
    #[arg(long)]
    pub run: PathBuf,
    /// Where to write config.json and the safetensors.
    #[arg(long)]
    pub to: PathBuf,
    /// Tensor precision: f32, bf16 or f16 (default: the source checkpoint's,
    /// as its config.json declares it; f32 for a model trained from scratch).
    #[arg(long)]
    pub dtype: Option<String>,
}

#[derive(Args, Debug)]
pub struct PlotArgs {
    /// The run directory (a train or finetune --out), or a step's timeline
    /// (a .json Chrome trace from --timeline-step or bench step --timeline).
    pub run: PathBuf,
    /// The figure: a .png or .svg file (default: RUN/plot.png, or the
    /// timeline's name with .png).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Width in pixels.
    #[arg(long, default_value_t = 1600)]
    pub width: u32,
    /// Height in pixels.
    #[arg(long, default_value_t = 1000)]
    pub height: u32,
}

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The run directory (a train or finetune --out).
    #[arg(long)]
    pub run: PathBuf,
}

/// Runs the parsed command; errors are printed as one line on stderr.
pub fn run(cli: Cli) -> ExitCode {
    match execute(cli) {
        Ok(code) => code,
        // `strata bench … | head`: the reader has what it wanted.
        Err(CliError::StdoutClosed) => ExitCode::SUCCESS,
        Err(CliError::Message(message)) => {
            eprintln!("strata: error: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Why a command failed.
#[derive(Debug)]
enum CliError {
    Message(String),
    /// Standard output was closed under the command (a broken pipe).
    StdoutClosed,
}

impl From<String> for CliError {
    fn from(message: String) -> Self {
        CliError::Message(message)
    }
}

impl From<&str> for CliError {
    fn from(message: &str) -> Self {
        CliError::Message(message.to_string())
    }
}

/// Only for writes to stdout.
impl From<std::io::Error> for CliError {
    fn from(error: std::io::Error) -> Self {
        if error.kind() == std::io::ErrorKind::BrokenPipe {
            CliError::StdoutClosed
        } else {
            CliError::Message(format!("writing to stdout: {error}"))
        }
    }
}

fn train(flags: TrainFlags, source: Source) -> Result<ExitCode, CliError> {
    let interrupt = trainer::interrupt::install();
    let summary = trainer::run(&flags, source, interrupt)?;
    Ok(if summary.stdout_closed {
        // `strata train | head`: the reader has what it wanted, and the
        // run is checkpointed.
        ExitCode::SUCCESS
    } else if summary.interrupted {
        ExitCode::from(trainer::interrupt::exit_status())
    } else {
        ExitCode::SUCCESS
    })
}

fn execute(cli: Cli) -> Result<ExitCode, CliError> {
    match cli.command {
        Command::Train(flags) => train(flags, Source::Scratch),
        Command::Finetune(args) => train(args.flags, Source::Finetune(args.model)),
        Command::Plan(args) => {
            let plan = trainer::plan_command(&args.flags, args.model.as_deref())?;
            writeln!(std::io::stdout(), "{}", plan.describe())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Export(args) => {
            let files = trainer::export_run(&args.run, &args.to, args.dtype.as_deref())?;
            let (count, to) = (files.len(), args.to.display());
            writeln!(std::io::stdout(), "wrote {count} files to {to}")?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench(command) => bench::execute(command).map(|()| ExitCode::SUCCESS),
        Command::Launch(args) => launch(args),
        Command::Verify(args) => verify(&args.run),
        Command::Plot(args) => {
            let size = (args.width, args.height);
            let plotted = crate::plot::plot_run(&args.run, args.out.as_deref(), size)?;
            writeln!(
                std::io::stdout(),
                "wrote {} ({} × {} pixels): {}",
                plotted.out.display(),
                args.width,
                args.height,
                plotted.holds
            )?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `strata launch`: says what it runs, then becomes it (so that signals
/// reach the launcher and its exit status is the run's).
fn launch(args: LaunchArgs) -> Result<ExitCode, CliError> {
    use std::os::unix::process::CommandExt;
    let strata = std::env::current_exe()
        .map_err(|e| format!("strata launch could not find its own executable: {e}"))?;
    if args.comm == "nccl" {
        return launch_nccl(&args, &strata);
    }
    let mut command = crate::launch::Launch {
        nproc: args.nproc,
        mpirun: args.mpirun,
        command: args.command,
    }
    .command(&strata)?;
    eprintln!(
        "strata launch: {} ranks: {}",
        args.nproc,
        crate::launch::describe(&command)
    );
    let e = command.exec();
    Err(format!(
        "{} could not start: {e}",
        command.get_program().to_string_lossy()
    )
    .into())
}

/// `strata launch --comm nccl`: starts the ranks, waits for them all.
fn launch_nccl(args: &LaunchArgs, strata: &std::path::Path) -> Result<ExitCode, CliError> {
    use crate::launch::spawned;
    if args.mpirun.is_some() {
        return Err("--mpirun names MPI's launcher: give it with --comm mpi"
            .to_string()
            .into());
    }
    if !cfg!(feature = "nccl") {
        return Err(
            "strata launch --comm nccl needs a strata built with --features nccl \
                    (NCCL itself is loaded when the ranks start)"
                .to_string()
                .into(),
        );
    }
    crate::launch::check(args.nproc, &args.command)?;
    let port = spawned::master_port()?;
    let mut each = std::process::Command::new(strata);
    each.args(&args.command);
    let n = args.nproc;
    eprintln!(
        "strata launch: {n} ranks over NCCL: RANK=LOCAL_RANK=0..{} WORLD_SIZE={n} \
         MASTER_ADDR=127.0.0.1 MASTER_PORT={port} {}",
        n - 1,
        crate::launch::describe(&each),
    );
    let signals = spawned::install();
    let code = spawned::run(strata, &args.command, args.nproc, port, signals)?;
    Ok(ExitCode::from(code.clamp(0, 255) as u8))
}

/// `strata verify`: the run's checkpoint, or each rank's of a ranks run.
fn verify(run: &std::path::Path) -> Result<ExitCode, CliError> {
    let Some(ranks) = trainer::rank_dirs(run) else {
        return verify_one(run).map(|(code, _)| code);
    };
    let mut steps = Vec::new();
    let mut code = ExitCode::SUCCESS;
    for dir in &ranks {
        let (one, step) = verify_one(dir)?;
        if one != ExitCode::SUCCESS {
            code = one;
        }
        steps.push(step);
    }
    if steps.iter().any(|&s| s != steps[0]) {
        writeln!(
            std::io::stdout().lock(),
            "note: the ranks' checkpoints are at steps {steps:?} (rank 0 first); --resume \
             with as many ranks goes on from the newest step all of them hold"
        )?;
    }
    Ok(code)
}

/// Verifies one run directory's checkpoint, saying what it found: the
/// exit code and the checkpoint's step.
fn verify_one(run: &std::path::Path) -> Result<(ExitCode, u64), CliError> {
    let report = trainer::verify_run(run)?;
    let mut out = std::io::stdout().lock();
    for note in &report.notes {
        writeln!(out, "note: {note}")?;
    }
    for (_, why) in &report.damaged_experts {
        writeln!(out, "damaged: {why}")?;
    }
    if let Some(why) = &report.damaged_dense {
        writeln!(out, "damaged: {why}")?;
    }
    if report.intact() {
        writeln!(
            out,
            "{}: the checkpoint at step {} is intact ({} expert records and the dense state)",
            run.display(),
            report.step,
            report.experts
        )?;
        return Ok((ExitCode::SUCCESS, report.step));
    }
    writeln!(
        out,
        "{}: the checkpoint at step {} is damaged ({} of {} expert records{}); the run cannot \
         resume from it: restore the run directory from a copy, or start the run again",
        run.display(),
        report.step,
        report.damaged_experts.len(),
        report.experts,
        if report.damaged_dense.is_some() {
            ", and the dense state"
        } else {
            ""
        }
    )?;
    Ok((ExitCode::FAILURE, report.step))
}
