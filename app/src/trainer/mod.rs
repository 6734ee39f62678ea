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

mod engine_choices;
use engine_choices::{condense_config, dense_gemm, gemms_described, link};
pub mod hf;
pub mod interrupt;
mod metrics_log;
pub mod options;
pub mod plan;
mod rank_export;
mod ranks;
mod routing_file;
mod run_dir;
mod tensorboard;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use strata_tiers::{Dtype, Timeline};

use metrics_log::MetricsLog;
pub use options::{Packing, StreamSlots, TrainFlags, TrainOptions};
use plan::{MemoryPlan, PlanInput};
pub use rank_export::rank_dirs;
use run_dir::{create_run, resume_options, update_record, ModelFiles, RunLock};
pub use run_dir::{export_run, verify_run};
use strata::engine::{Engine, StepMetrics};
use strata::lm::data::{Corpus, DataConfig, Dataset, Tokenizer};
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

/// Plans `o` for `config` (no allocation, nothing written).
pub fn plan_for(o: &TrainOptions, config: &LmConfig) -> Result<MemoryPlan, String> {
    let lm = model_for(o, config)?;
    let frozen_dense = lm.frozen_dense().iter().map(|r| r.len() as u64).sum();
    plan::plan(&PlanInput {
        model: config,
        frozen_dense,
        train_experts: trains_experts(o)?,
        compute_dtype: parse_dtype(&o.compute_dtype)?,
        seq_len: o.seq_len,
        batch: o.batch,
        micro_batches: o.micro_batches,
        devices: o.devices,
        device_mem: o.device_mem,
        host_mem: o.host_mem,
        store_dir: Some(&o.out),
        host_stream_slots: o.host_stream_slots.0,
        host_cell_slots: o.host_cell_slots,
        gpu: o.backend == "cuda",
        dense_on_device: o.backend == "cuda" && !o.dense_on_host,
        dense_gemm: dense_gemm(o)?,
    })
}

/// The model a `strata plan` describes: a preset or a model directory.
pub fn plan_command(flags: &TrainFlags, model: Option<&Path>) -> Result<MemoryPlan, String> {
    let o = flags.resolve()?;
    let source = model.map_or(Source::Scratch, |d| Source::Finetune(d.to_path_buf()));
    let tok = tokenizer_for(&o, &source)?;
    let config = model_config(&o, &source, &tok)?;
    plan_for(&o, &config)
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
    if !(0.0..=1.0).contains(&o.defer_share) {
        return Err(format!(
            "--defer-share {} must be between 0 and 1",
            o.defer_share
        ));
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
    if let Some(n) = o.compute_threads {
        strata::set_compute_threads(n).map_err(|e| format!("--compute-threads {n}: {e}"))?;
    }
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
/// (`created_out`: the lock made it).
fn run_locked(
    o: TrainOptions,
    source: Source,
    files: ModelFiles,
    interrupt: &AtomicBool,
    created_out: bool,
    world: Option<ranks::RankWorld>,
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
    let plan = plan_for(&o, &config)?;
    let lm = model_for(&o, &config)?;
    let mut data = Dataset::open(
        DataConfig {
            corpus: if o.data.is_empty() {
                Corpus::Builtin { documents: 200_000 }
            } else {
                Corpus::Files(o.data.clone())
            },
            seq_len: o.seq_len,
            batch_seqs: o.batch,
            seed: o.seed,
            chat_template: files.chat_template(&o, &source)?,
            documents_apart: o.packing == Some(Packing::Apart),
            ..DataConfig::default()
        },
        tok,
    )
    .map_err(|e| e.to_string())?;
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
    // A closed stdout (`strata train | head`) is no reason to lose the
    // run, nor to go on with no one reading: the run checkpoints after the
    // step in progress and stops, as on Ctrl-C.
    let stdout_closed = AtomicBool::new(false);
    let say = |line: String| {
        if speaks
            && (!o.quiet || !line.starts_with("  "))
            && writeln!(std::io::stdout().lock(), "{line}").is_err()
        {
            stdout_closed.store(true, Ordering::SeqCst);
            interrupt.store(true, Ordering::SeqCst);
        }
    };
    say(format!(
        "strata {}: {} ({:.1}M params, {} layers × {} experts, top-{}), {}{}, backend {}{}{}{}",
        match (&source, o.resume) {
            (_, true) => "resume",
            (Source::Finetune(_), false) => "finetune",
            (Source::Scratch, false) => "train",
        },
        match &source {
            Source::Scratch => format!("preset {}", o.preset),
            Source::Finetune(d) => d.display().to_string(),
        },
        config.total_params() as f64 / 1e6,
        config.layers,
        config.experts,
        config.top_k,
        match &world {
            Some(w) => format!(
                "{} {} ranks as processes (MPI{}; rank R's run in {}), ",
                w.size,
                if o.backend == "cuda" { "GPU" } else { "cpu" },
                if o.backend == "cuda" {
                    ", each on the GPU of its local rank, exchanging through host memory"
                } else {
                    ""
                },
                ranks::rank_out(o.out.parent().unwrap_or(Path::new(".")), 0)
                    .with_file_name("rank-R")
                    .display()
            ),
            None if o.devices > 1 => {
                let over = o.link_gb_per_s.map_or(String::new(), |r| {
                    format!(" over a modeled {r} GB/s link ({} µs)", o.link_latency_us)
                });
                format!("{} {} devices{over}, ", o.devices, o.backend)
            }
            None => String::new(),
        },
        plan.mode.describe(),
        o.backend,
        match &o.backend_chosen {
            Some(found) => format!(" (auto: {found}; --backend cpu or cuda to choose)"),
            None => String::new(),
        },
        gemms_described(&o),
        match &engine_config.condense {
            Some(c) => format!("; {}", c.describe()),
            None => String::new(),
        }
    ));
    if let Some(sized) = &o.device_mem_sized {
        say(sized.clone());
    }
    let trained = trained_groups(&o)?;
    if TensorGroup::ALL.iter().any(|g| !trained.contains(g)) {
        say(format!(
            "training {} alone; the rest is frozen ({} dense params without moments)",
            o.train.join(", "),
            options::show_count(plan.dense_params - plan.dense_trainable)
        ));
    }
    let mut comm = world.map(|w| w.comm);
    let mut engine = if o.resume {
        let condensing = engine_config.condense.is_some();
        // Ranks resume from the newest checkpoint all of them hold.
        let mut engine = match comm.take() {
            Some(comm) => Engine::resume_rank(&lm, engine_config, comm),
            None => Engine::resume_network(&lm, engine_config),
        }
        .map_err(|e| e.to_string())?;
        data.skip_batches(engine.steps())
            .map_err(|e| e.to_string())?;
        if condensing {
            // The adaptive threshold goes on from the losses so far.
            let (first, last) =
                metrics_log::first_and_last_loss(&o.out.join("metrics.jsonl"), engine.steps());
            engine.set_condense_losses(first, last);
        }
        if let Some(path) = &o.trace_routing {
            routing_file::resume(&mut engine, path)?;
        }
        update_record(&o)?;
        engine
    } else {
        create_run(
            &o,
            &source,
            &config,
            &lm,
            engine_config,
            imported,
            created_out,
        )?
    };
    if let Some(comm) = comm {
        engine.join_ranks(comm).map_err(|e| e.to_string())?;
    }
    if let Some(n) = o.compute_threads {
        say(format!(
            "  compute: the cpu backend splits over {n} of the {} cores",
            strata::machine_cores()
        ));
    }
    for note in engine.notes() {
        say(format!("note: {note}"));
    }
    for note in unused_split(&o, engine.host_cells(), engine.deferred_updates()) {
        say(format!("note: {note}"));
    }
    if engine.host_kept() > 0 || engine.host_cells() > 0 {
        let cells = match engine.host_cells() {
            0 => String::new(),
            n => format!(", and {n} compute cells"),
        };
        let kept = match engine.host_kept() {
            0 => "none stays resident, all stream from the SSD".to_string(),
            n => format!(
                "{n} stay resident, the others stream from the SSD through {} slots",
                engine.host_slots() - n
            ),
        };
        say(format!(
            "  host memory: {} expert records; {kept}{cells}",
            engine.host_slots()
        ));
    }
    if engine.deferred_updates() > 0 {
        say(format!(
            "  {} experts' updates wait for the next step's forward",
            engine.deferred_updates()
        ));
    }
    let start_step = engine.steps();
    if let Some(n) = o
        .timeline_step
        .filter(|n| !(start_step + 1..=o.steps).contains(n))
    {
        return Err(format!(
            "--timeline-step {n}: this run goes from step {} to {}; ask for one of those",
            start_step + 1,
            o.steps
        ));
    }
    if o.steps == 0 {
        say("--steps 0: nothing to train".to_string());
    } else if start_step >= o.steps {
        say(format!(
            "the run is already at step {start_step} of {}",
            o.steps
        ));
    }
    let eval = data.eval_batches();
    let mut metrics_log = MetricsLog::open(&o.out.join("metrics.jsonl"), start_step)?;
    let mut tensorboard = match &o.tensorboard {
        Some(dir) => Some(tensorboard::EventWriter::create(dir)?),
        None => None,
    };
    let bar = match speaks {
        true => progress_bar(&o, start_step),
        false => indicatif::ProgressBar::hidden(),
    };
    let log_every = (o.steps / 20).max(1);
    let mut summary = RunSummary {
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
    };
    let mut rates = Vec::new();
    let err = |e: strata::EngineError| e.to_string();
    for step in start_step + 1..=o.steps {
        let lr = lr_at(&o, step);
        engine.set_lr(lr).map_err(err)?;
        let batch = data.next_batch().map_err(err)?;
        let traced = timeline.as_ref().filter(|_| o.timeline_step == Some(step));
        if let Some(timeline) = traced {
            timeline.take(); // this step's events start now
        }
        let m = engine.step_network(&lm, &batch).map_err(err)?;
        if let Some(timeline) = traced {
            engine.drain().map_err(err)?; // its last updates, on the trace
            let path = o.out.join(format!("timeline-step-{step}.json"));
            strata_tiers::timeline::write_chrome_trace_file(&timeline.take().events, &path)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            let line = format!("  step {step}'s timeline: {}", path.display());
            if bar.is_hidden() {
                say(line);
            } else {
                bar.println(line);
            }
        }
        rates.push(m.tokens as f64 / m.wall_s);
        summary.first_loss.get_or_insert(m.loss);
        summary.last_loss = Some(m.loss);
        summary.steps = step;
        metrics_log.append(&metrics_line(&m, lr))?;
        if let Some(tb) = tensorboard.as_mut() {
            tb.step(step, &m, lr)?;
        }
        bar.set_position(step);
        bar.set_message(status(&m));
        let mut line = None;
        if o.eval_every > 0 && step % o.eval_every == 0 && !eval.is_empty() {
            let mut sum = 0.0f64;
            for b in &eval {
                sum += engine.evaluate(&lm, b).map_err(err)? as f64;
            }
            let loss = (sum / eval.len() as f64) as f32;
            summary.last_eval_loss = Some(loss);
            metrics_log.append(&format!("{{\"step\":{step},\"eval_loss\":{loss}}}"))?;
            if let Some(tb) = tensorboard.as_mut() {
                tb.scalars(step, &[("eval/loss", loss)])?;
            }
            line = Some(format!(
                "  step {step:>6}  loss {:.4}  eval {loss:.4}  {}",
                m.loss,
                status(&m)
            ));
        } else if step % log_every == 0 || step == start_step + 1 {
            line = Some(format!(
                "  step {step:>6}  loss {:.4}  {}",
                m.loss,
                status(&m)
            ));
        }
        if let Some(line) = line {
            if bar.is_hidden() {
                say(line);
            } else {
                bar.println(line);
            }
        }
        // Every rank stops at the same step, whichever was signalled.
        let interrupted = engine
            .any_rank(interrupt.load(Ordering::SeqCst))
            .map_err(err)?;
        if interrupted || (o.checkpoint_every > 0 && step % o.checkpoint_every == 0) {
            if let Some(path) = &o.trace_routing {
                routing_file::write(&mut engine, path)?;
            }
            engine.checkpoint().map_err(err)?;
            metrics_log.append(&format!("{{\"step\":{step},\"checkpoint\":true}}"))?;
        }
        if interrupted {
            summary.interrupted = true;
            break;
        }
    }
    bar.finish_and_clear();
    if !summary.interrupted {
        if let Some(path) = &o.trace_routing {
            routing_file::write(&mut engine, path)?;
        }
        engine.checkpoint().map_err(err)?;
    }
    rates.sort_by(f64::total_cmp);
    summary.tokens_per_s = rates.get(rates.len() / 2).copied().unwrap_or(0.0);
    if summary.interrupted {
        let line = format!(
            "interrupted: checkpoint written at step {}; continue with --resume --out {}",
            summary.steps,
            o.out.display()
        );
        summary.stdout_closed = stdout_closed.load(Ordering::SeqCst);
        if summary.stdout_closed {
            let _ = writeln!(std::io::stderr(), "stdout was closed; {line}");
        } else {
            say(line);
        }
        return Ok(summary);
    }
    if let Some(dir) = &o.export {
        // A new run's directory keeps the side files from its start.
        let source_dir = if o.resume {
            files.side_files_dir(&o, &source)
        } else {
            Some(o.out.as_path())
        };
        let rank = engine.rank();
        let (dense, store) = engine.dense_params_and_store().map_err(|e| e.to_string())?;
        // On ranks, rank 0 exports, the other ranks' experts read from
        // their stores (every rank has committed its last checkpoint).
        let peers = match rank {
            Some((0, n)) => rank_export::peer_stores(&o.out, n, store)?,
            _ => Vec::new(),
        };
        if rank.is_none_or(|(r, _)| r == 0) {
            say(format!("exporting to {}", dir.display()));
            let stores: Vec<&strata_tiers::ExpertStore> =
                std::iter::once(store).chain(&peers).collect();
            summary.exported = hf::export(
                dir,
                &lm,
                dense,
                &stores,
                run_dir::export_dtype(None, &o.out)?,
                2 << 30,
                source_dir,
            )?;
        }
    }
    say(format!(
        "done: step {}  loss {} → {}  eval {}  {:.0} tokens/s (median)",
        summary.steps,
        summary.first_loss.map_or("-".into(), |l| format!("{l:.4}")),
        summary.last_loss.map_or("-".into(), |l| format!("{l:.4}")),
        summary
            .last_eval_loss
            .map_or("-".into(), |l| format!("{l:.4}")),
        summary.tokens_per_s
    ));
    Ok(summary)
}

/// What of the host tier's split that `o` asks for does not apply: cells
/// and held updates are only for records streaming from the SSD through
/// one device's host tier, and a share may round to no expert.
fn unused_split(o: &TrainOptions, cells: usize, deferred: usize) -> Vec<String> {
    let mut notes = Vec::new();
    let why = "it applies where expert records stream from the SSD, on one device";
    if o.host_cell_slots > 0 && cells == 0 {
        notes.push(format!(
            "--host-cell-slots {} is not used: {why}",
            o.host_cell_slots
        ));
    }
    if o.defer_share > 0.0 && deferred == 0 {
        notes.push(format!(
            "--defer-share {} holds no update: {why}, where the share of a layer's experts \
             rounds to one or more",
            o.defer_share
        ));
    }
    notes
}

/// A step's line of metrics.jsonl: its metrics, learning rate, and the
/// process's resident memory after it and minor page faults since it
/// started (where the OS tells).
fn metrics_line(m: &StepMetrics, lr: f32) -> String {
    let mut value = serde_json::to_value(m).expect("metrics serialize");
    value["lr"] = serde_json::json!(lr);
    if let Some(rss) = crate::sys::resident_bytes() {
        value["rss_bytes"] = serde_json::json!(rss);
    }
    if let Some((_, faults)) = crate::sys::process_usage() {
        value["minor_faults"] = serde_json::json!(faults as u64);
    }
    value.to_string()
}

/// tokens/s, the share of the step stalled on each tier, the share the
/// SSD was busy (near 100 %: the SSD bounds the step), and what it moved
/// against the least the step's routing needed.
fn status(m: &StepMetrics) -> String {
    let share = |s: f64| 100.0 * s / m.wall_s.max(1e-9);
    let mut line = format!(
        "{:.0} tok/s  stall: ssd {:.0}% upload {:.0}% optimizer {:.0}%  ssd busy {:.0}%",
        m.tokens as f64 / m.wall_s.max(1e-9),
        share(m.stall_ssd_s),
        share(m.stall_upload_s),
        share(m.stall_optimizer_s),
        share(m.ssd_busy_s)
    );
    let moved = m.bytes_ssd_to_host + m.bytes_host_to_ssd;
    if moved > 0 {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        line += &format!(
            "  ssd {:.0} MiB (routing needs {:.0})",
            mib(moved),
            mib(m.bytes_ssd_min)
        );
    }
    line
}

fn progress_bar(o: &TrainOptions, start: u64) -> indicatif::ProgressBar {
    if o.quiet {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(o.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
        )
        .expect("a valid template"),
    );
    bar.set_position(start);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_that_does_not_apply_is_named() {
        let o = TrainFlags::default().resolve().unwrap();
        assert!(unused_split(&o, 0, 0).is_empty());
        let asked = TrainOptions {
            host_cell_slots: 1,
            defer_share: 0.5,
            ..o
        };
        let notes = unused_split(&asked, 0, 0);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(notes[0].starts_with("--host-cell-slots 1 is not used"));
        assert!(notes[1].starts_with("--defer-share 0.5 holds no update"));
        assert!(unused_split(&asked, 6, 4).is_empty());
    }
}
