//! The trainer: `strata train` (from scratch) and `strata finetune`
//! (from a Hugging Face checkpoint) of the MoE language model (`strata::lm`), with
//! warmup + cosine learning rate, gradient accumulation, held-out loss,
//! checkpoints (every N steps, at the end and on Ctrl-C), resume, export,
//! a progress bar and JSON-lines metrics.
//!
//! A run lives in one directory (`--out`, `run_dir`): `run.json` (the
//! resolved options and model), `config.json` (the model, Hugging Face
//! form), the expert store `experts.strata` with its dense checkpoint
//! files, and `metrics.jsonl`.

mod announce;
mod engine_choices;
pub(crate) use engine_choices::choose_bf16_kernel;
use engine_choices::{condense_config, dense_gemm, link};
pub mod hf;
pub mod interrupt;
mod metrics_log;
mod open_run;
pub mod options;
pub mod plan;
mod rank_export;
mod ranks;
mod routing_file;
mod run_dir;
mod steps;
mod tensorboard;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use strata_tiers::{Dtype, Timeline};

pub use options::{Packing, StreamSlots, TrainFlags, TrainOptions};
use plan::{MemoryPlan, PlanInput};
pub use rank_export::rank_dirs;
pub use run_dir::{export_run, verify_run};
use run_dir::{resume_options, ModelFiles, RunLock};
use strata::lm::data::Tokenizer;
use strata::lm::{LmConfig, MoeLm, TensorGroup};
use strata::model::Network;

use strata::backend::BackendKind;

/// Where the model comes from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Source {
    /// A preset, initialized from the seed.
    Scratch,
    /// A Hugging Face model directory.
    Finetune(PathBuf),
}

/// How a run went.
#[derive(Clone, Debug, PartialEq)]
pub struct RunSummary {
    pub plan: MemoryPlan,
    /// Step count at the start (0, or the checkpoint resumed from).
    pub start_step: u64,
    pub steps: u64,
    pub first_loss: Option<f32>,
    pub last_loss: Option<f32>,
    pub last_eval_loss: Option<f32>,
    /// Median over the steps run.
    pub tokens_per_s: f64,
    /// Stopped early, with a checkpoint: on Ctrl-C or SIGTERM, or when
    /// standard output was closed under the run.
    pub interrupted: bool,
    /// Standard output was closed (`strata train | head`): the run
    /// checkpointed and stopped, and printed nothing more.
    pub stdout_closed: bool,
    pub exported: Vec<PathBuf>,
    /// This process's peak resident memory at the run's end, where known.
    pub peak_memory_bytes: Option<u64>,
}

impl RunSummary {
    /// A run about to train from `start_step`.
    fn starting(plan: MemoryPlan, start_step: u64) -> Self {
        Self {
            plan,
            start_step,
            steps: start_step,
            first_loss: None,
            last_loss: None,
            last_eval_loss: None,
            tokens_per_s: 0.0,
            interrupted: false,
            stdout_closed: false,
            exported: Vec::new(),
            peak_memory_bytes: None,
        }
    }
}

/// The learning rate of (1-based) step `step`: linear warmup to `lr`, then
/// a cosine to `lr · min_lr_ratio` at the last step.
pub fn lr_at(o: &TrainOptions, step: u64) -> f32 {
    if o.warmup > 0 && step <= o.warmup {
        return o.lr * step as f32 / o.warmup as f32;
    }
    let span = o.steps.saturating_sub(o.warmup).max(1) as f64;
    let progress = ((step - o.warmup.min(step)) as f64 / span).min(1.0);
    let floor = o.min_lr_ratio as f64;
    let scale = floor + (1.0 - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    (o.lr as f64 * scale) as f32
}

fn parse_dtype(name: &str) -> Result<Dtype, String> {
    match name {
        "bf16" => Ok(Dtype::Bf16),
        "f16" => Ok(Dtype::F16),
        "f32" => Ok(Dtype::F32),
        other => Err(format!("--compute-dtype {other:?}: use bf16, f16 or f32")),
    }
}

/// The tokenizer: `--tokenizer`, else the model directory's
/// `tokenizer.json`, else bytes.
/// The tokenizer file a new run uses: `--tokenizer`, else a fine-tune's
/// `tokenizer.json`; none means bytes.
fn tokenizer_path(o: &TrainOptions, source: &Source) -> Option<PathBuf> {
    let from_model = match source {
        Source::Finetune(dir) => Some(dir.join("tokenizer.json")).filter(|p| p.is_file()),
        Source::Scratch => None,
    };
    o.tokenizer.clone().or(from_model)
}

fn tokenizer_for(o: &TrainOptions, source: &Source) -> Result<Tokenizer, String> {
    match tokenizer_path(o, source) {
        Some(path) => {
            if !path.is_file() {
                return Err(format!("tokenizer file {} does not exist", path.display()));
            }
            Tokenizer::from_file(&path).map_err(|e| e.to_string())
        }
        // Bytes, with an end-of-document token where the model has room.
        None => match source {
            Source::Finetune(dir) => Ok(Tokenizer::bytes_for(hf::read_config(dir)?.vocab)),
            Source::Scratch => Ok(Tokenizer::Bytes),
        },
    }
}

fn model_config(o: &TrainOptions, source: &Source, tok: &Tokenizer) -> Result<LmConfig, String> {
    let config = match source {
        Source::Scratch => {
            let mut c = LmConfig::preset(&o.preset).map_err(|e| e.to_string())?;
            c.vocab = tok.vocab_size();
            c.max_seq = c.max_seq.max(o.seq_len);
            c.seed = o.seed;
            if let Some(e) = o.experts {
                c.experts = e;
            }
            c
        }
        Source::Finetune(dir) => {
            let mut c = hf::read_config(dir)?;
            if o.experts.is_some_and(|e| e != c.experts) {
                return Err(format!(
                    "--experts cannot change a checkpoint's {} experts",
                    c.experts
                ));
            }
            c.seed = o.seed;
            c
        }
    };
    config.validate().map_err(|e| e.to_string())?;
    if tok.vocab_size() > config.vocab {
        return Err(format!(
            "the tokenizer has {} tokens but the model's vocabulary only {}",
            tok.vocab_size(),
            config.vocab
        ));
    }
    if o.seq_len > config.max_seq {
        return Err(format!(
            "--seq-len {} exceeds the model's max_position_embeddings {}",
            o.seq_len, config.max_seq
        ));
    }
    Ok(config)
}

/// The groups of tensors `--train` names.
fn trained_groups(o: &TrainOptions) -> Result<Vec<TensorGroup>, String> {
    let groups = o
        .train
        .iter()
        .map(|g| TensorGroup::parse(g))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("--train: {e}"))?;
    if groups.is_empty() {
        return Err(
            "--train names no group: give some of experts, router, attention, mlp, \
                    embeddings, norms"
                .into(),
        );
    }
    Ok(groups)
}

/// Whether `--train` names the experts.
pub(crate) fn trains_experts(o: &TrainOptions) -> Result<bool, String> {
    Ok(trained_groups(o)?.contains(&TensorGroup::Experts))
}

/// The network of `config`, its dense tensors outside `--train` frozen.
pub(crate) fn model_for(o: &TrainOptions, config: &LmConfig) -> Result<MoeLm, String> {
    let groups = trained_groups(o)?;
    let lm = MoeLm::new(config.clone())
        .map_err(|e| e.to_string())?
        .with_trained(&groups);
    let frozen: usize = lm.frozen_dense().iter().map(|r| r.len()).sum();
    if frozen == config.dense_params() && !groups.contains(&TensorGroup::Experts) {
        return Err(format!(
            "--train {}: this model has no such tensors, so nothing would train",
            o.train.join(",")
        ));
    }
    Ok(lm)
}

/// Plans `o` for `config` as one of `ranks` ranks as processes (no
/// allocation, nothing written).
pub fn plan_for(o: &TrainOptions, config: &LmConfig, ranks: usize) -> Result<MemoryPlan, String> {
    let lm = model_for(o, config)?;
    let frozen_dense = lm.frozen_dense().iter().map(|r| r.len() as u64).sum();
    let plan = plan::plan(&PlanInput {
        model: config,
        frozen_dense,
        train_experts: trains_experts(o)?,
        compute_dtype: parse_dtype(&o.compute_dtype)?,
        seq_len: o.seq_len,
        batch: o.batch,
        micro_batches: o.micro_batches,
        devices: o.devices,
        ranks,
        device_mem: o.device_mem,
        host_mem: o.host_mem,
        store_dir: Some(&o.out),
        host_stream_slots: o.host_stream_slots.0,
        host_cell_slots: o.host_cell_slots,
        gpu: o.backend == "cuda",
        expert_group: o.expert_group,
        dense_on_device: o.backend == "cuda" && !o.dense_on_host,
        dense_gemm: dense_gemm(o)?,
        expert_gemm: engine_choices::expert_gemm(o)?,
        naive_schedule: o.clip_grad_norm.is_some(),
        compute_threads: o.compute_threads.unwrap_or_else(strata::machine_cores),
    })?;
    let plan = MemoryPlan {
        // Resident now, and the code the run will page in as it trains.
        process_bytes: crate::sys::resident_bytes()
            .map(|now| now + crate::sys::code_not_resident_bytes().unwrap_or(0)),
        ..plan
    };
    plan.check_host_memory(strata::engine::host_memory_available().as_ref())?;
    Ok(plan)
}

/// The model a `strata plan` describes: a preset or a model directory.
pub fn plan_command(flags: &TrainFlags, model: Option<&Path>) -> Result<MemoryPlan, String> {
    let o = flags.resolve()?;
    let source = model.map_or(Source::Scratch, |d| Source::Finetune(d.to_path_buf()));
    let tok = tokenizer_for(&o, &source)?;
    let config = model_config(&o, &source, &tok)?;
    // The cpu's groups of experts follow its compute threads.
    set_compute_threads(&o)?;
    plan_for(&o, &config, 1)
}

/// `--compute-threads`, where given, for the whole process.
fn set_compute_threads(o: &TrainOptions) -> Result<(), String> {
    match o.compute_threads {
        Some(n) => {
            strata::set_compute_threads(n).map_err(|e| format!("--compute-threads {n}: {e}"))
        }
        None => Ok(()),
    }
}

fn validate_options(o: &TrainOptions) -> Result<(), String> {
    // --steps 0 is legitimate: a fine-tune that only imports and exports.
    if o.batch == 0 || o.seq_len == 0 || o.micro_batches == 0 || o.threads == 0 || o.devices == 0 {
        return Err(
            "--batch, --seq-len, --micro-batches, --devices and --threads must be at least 1"
                .into(),
        );
    }
    strata_optim::check_thread_count(o.threads)
        .map_err(|e| format!("--threads {}: {e}", o.threads))?;
    // A new run goes from step 1 (a resumed one is checked once its step
    // is known, before it trains).
    if let Some(n) = o
        .timeline_step
        .filter(|n| !o.resume && !(1..=o.steps).contains(n))
    {
        return Err(format!(
            "--timeline-step {n}: this run goes from step 1 to {}; ask for one of those",
            o.steps
        ));
    }
    if let Some(max) = o.clip_grad_norm.filter(|m| !(m.is_finite() && *m > 0.0)) {
        return Err(format!(
            "--clip-grad-norm {max}: give a positive bound (1.0 is TRL's max_grad_norm)"
        ));
    }
    if o.devices * o.micro_batches > o.batch {
        return Err(format!(
            "--devices {} × --micro-batches {} exceeds --batch {} (each device's micro-batch \
             holds whole sequences): raise --batch or lower the others",
            o.devices, o.micro_batches, o.batch
        ));
    }
    BackendKind::parse(&o.backend)
        .map_err(|e| format!("--backend: {e}"))?
        .check(o.gpus(), parse_dtype(&o.compute_dtype)?)
        .map_err(|e| format!("--backend {}: {e}", o.backend))?;
    condense_config(o)?;
    link(o)?;
    // --lr 0 is legitimate: a frozen evaluation (nothing changes).
    if !(o.lr >= 0.0 && o.lr.is_finite() && (0.0..=1.0).contains(&o.min_lr_ratio)) {
        return Err("--lr must be 0 or more and --min-lr-ratio in [0, 1]".into());
    }
    Ok(())
}

/// Refuses a fine-tune whose `--out` (a new run) or `--export` is its
/// model directory: the run would replace the model's config.json, the
/// export its weights.
fn refuse_writing_into(model_dir: &Path, o: &TrainOptions) -> Result<(), String> {
    let model = match model_dir.canonicalize() {
        Ok(model) => model,
        Err(_) => return Ok(()), // not there: nothing to overwrite
    };
    let is_model = |p: &Path| p.canonicalize().is_ok_and(|p| p == model);
    if !o.resume && is_model(&o.out) {
        return Err(format!(
            "--out {} is the model directory: the run writes its store and config.json \
             there; choose another --out",
            o.out.display()
        ));
    }
    if let Some(export) = o.export.as_deref().filter(|e| is_model(e)) {
        return Err(format!(
            "--export {} is the model directory: the export would replace its weights; \
             choose another --export",
            export.display()
        ));
    }
    Ok(())
}

/// Trains (or fine-tunes, or resumes) as `flags` say. `interrupt` set
/// means: checkpoint after the current step and stop.
pub fn run(
    flags: &TrainFlags,
    source: Source,
    interrupt: &AtomicBool,
) -> Result<RunSummary, String> {
    // Started by mpirun as one of several ranks: this rank's run lives in
    // its own directory within --out.
    match ranks::join_world()? {
        Some((world, session)) => {
            let rank = world.rank;
            let result = run_in(flags, source, interrupt, Some(world));
            ranks::end(session, rank, &result);
            result
        }
        None => run_in(flags, source, interrupt, None),
    }
}

/// [`run`] as one of `world`'s ranks, or on its own.
fn run_in(
    flags: &TrainFlags,
    source: Source,
    interrupt: &AtomicBool,
    world: Option<ranks::RankWorld>,
) -> Result<RunSummary, String> {
    let rank_flags;
    let flags = match &world {
        Some(w) => {
            rank_flags = TrainFlags {
                out: Some(ranks::rank_out(&flags.resolve()?.out, w.rank)),
                ..flags.clone()
            };
            &rank_flags
        }
        None => flags,
    };
    let (mut o, source, files) = if flags.resume {
        resume_options(flags)?
    } else {
        (flags.resolve()?, source, ModelFiles::Source)
    };
    if !o.resume {
        // A fine-tune keeps its documents apart; pretraining packs a stream.
        o.packing.get_or_insert(match source {
            Source::Finetune(_) => Packing::Apart,
            Source::Scratch => Packing::Stream,
        });
    }
    if let Some(w) = &world {
        if o.backend == "auto" {
            o.backend = "cpu".into();
            o.backend_chosen =
                Some("ranks as processes run on the cpu unless --backend cuda".into());
        }
        if o.backend == "cuda" {
            o.first_gpu = w.local_rank;
        }
        if w.rank > 0 {
            o.tensorboard = None; // rank 0 writes the run's scalars
        }
        ranks::refuse(&o, w)?;
    }
    if o.backend == "auto" {
        let (kind, found) = BackendKind::detect(o.devices, parse_dtype(&o.compute_dtype)?);
        o.backend = kind.name().into();
        o.backend_chosen = Some(found);
    }
    validate_options(&o)?;
    if o.backend == "cuda" && !flags.resume && !flags.gives_device_mem()? {
        let free = strata::backend::gpu_free_bytes(o.gpus()).map_err(|e| e.to_string())?;
        o.device_mem = free / 10 * 9;
        o.device_mem_sized = Some(format!(
            "--device-mem {}: 90 % of the GPU's {} free (--device-mem to choose)",
            options::show_bytes(o.device_mem),
            options::show_bytes(free)
        ));
    }
    set_compute_threads(&o)?;
    engine_choices::choose_bf16_kernel(&o.bf16_kernel)?;
    if let Source::Finetune(model_dir) = &source {
        refuse_writing_into(model_dir, &o)?;
    }
    // One process at a time in a run directory: a second is refused
    // before it reads or writes anything there.
    let lock = RunLock::take(&o.out)?;
    let result = run_locked(o, source, files, interrupt, lock.created(), world);
    if result.is_err() {
        lock.remove_if_unused();
    }
    result
}

/// [`run`] once the run directory is locked for this process
/// (`created_out`: the lock made it): everything that can be refused is
/// checked, the run says what it is, the engine is created or resumed,
/// the steps run, and the model is exported where asked.
fn run_locked(
    o: TrainOptions,
    source: Source,
    files: ModelFiles,
    interrupt: &AtomicBool,
    created_out: bool,
    mut world: Option<ranks::RankWorld>,
) -> Result<RunSummary, String> {
    let record_path = o.out.join("run.json");
    if !o.resume && record_path.exists() {
        return Err(format!(
            "{} already holds a run; pass --resume to continue it, or choose another --out",
            o.out.display()
        ));
    }
    // Everything that can be refused is checked before anything is written.
    let (tok, config) = files.read(&o, &source)?;
    let plan = plan_for(&o, &config, world.as_ref().map_or(1, |w| w.size))?;
    if let Some(w) = world.as_mut() {
        ranks::check_machine_memory(w, &plan)?;
    }
    let lm = model_for(&o, &config)?;
    let mut data = open_run::dataset(&o, &files, &source, tok)?;
    let imported = match (&source, o.resume) {
        (Source::Finetune(dir), false) => Some(hf::read_dense(dir, &lm)?),
        _ => None,
    };
    // Every step is recorded (a few hundred events) until the one asked
    // for; what did not fit is dropped, and `take` starts that step afresh.
    let timeline = o.timeline_step.map(|_| Arc::new(Timeline::new(1 << 16)));
    let mut engine_config = engine_choices::engine_config(&o, &plan, timeline.clone())?;
    engine_config.ranks = world.as_ref().map_or(1, |w| w.size);
    // Rank 0 speaks for the ranks.
    let speaks = world.as_ref().is_none_or(|w| w.rank == 0);
    let speaker = announce::Speaker::new(speaks, o.quiet, interrupt);
    let first = announce::first_line(&o, &source, &config, world.as_ref(), &plan, &engine_config);
    speaker.say(first);
    if let Some(sized) = &o.device_mem_sized {
        speaker.say(sized.clone());
    }
    let trained = trained_groups(&o)?;
    if TensorGroup::ALL.iter().any(|g| !trained.contains(g)) {
        speaker.say(announce::frozen_line(&o, &plan));
    }
    let opened = open_run::OpenRun {
        o: &o,
        source: &source,
        config: &config,
        lm: &lm,
        created_out,
    };
    let fill = match (o.resume, imported.is_some()) {
        (true, _) => announce::StoreFill::Resume,
        (false, true) => announce::StoreFill::Import,
        (false, false) => announce::StoreFill::Initialize,
    };
    if let Some(line) = announce::setting_up_line(fill, &plan) {
        speaker.say(line);
    }
    let mut engine = opened.engine(engine_config, imported, world, &mut data)?;
    for line in announce::engine_lines(&o, &engine) {
        speaker.say(line);
    }
    let start_step = engine.steps();
    for line in announce::start_lines(&o, start_step)? {
        speaker.say(line);
    }
    let mut summary = RunSummary::starting(plan, start_step);
    let steps = steps::StepLoop {
        o: &o,
        lm: &lm,
        speaker: &speaker,
        interrupt,
        timeline,
    };
    steps.run(&mut engine, &mut data, &mut summary)?;
    if summary.interrupted {
        let line = announce::interrupted_line(&o, &summary);
        summary.stdout_closed = speaker.stdout_closed();
        if summary.stdout_closed {
            let _ = writeln!(std::io::stderr(), "stdout was closed; {line}");
        } else {
            speaker.say(line);
        }
        return Ok(summary);
    }
    if let Some(dir) = &o.export {
        summary.exported = opened.export(&mut engine, dir, &files, &speaker)?;
    }
    summary.peak_memory_bytes = crate::sys::peak_resident_bytes();
    speaker.say(announce::done_line(&summary));
    Ok(summary)
}
