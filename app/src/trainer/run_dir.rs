//! The run directory (`--out`): its record `run.json`, created with the
//! store on a new run and read back on `--resume` and by `strata export`,
//! and the model files a resume or an export needs (`config.json`, the
//! tokenizer and a fine-tune's other side files), copied there, so that
//! neither depends on the model directory or the `--tokenizer` file it
//! started from.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use strata_tiers::io::FileOptions;
use strata_tiers::{ExpertStore, Layout};

use super::{
    hf, model_config, parse_dtype, tokenizer_for, tokenizer_path, Source, TrainFlags, TrainOptions,
};
use strata::engine::{Engine, EngineConfig};
use strata::lm::chat::ChatTemplate;
use strata::lm::data::Tokenizer;
use strata::lm::{LmConfig, MoeLm};

/// What `run.json` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RunRecord {
    options: TrainOptions,
    source: Source,
    /// The model's `config.json` text.
    model: String,
    /// What the directory keeps of the model's files; absent from a record
    /// written before it kept them, whose resume reads the source again.
    #[serde(default)]
    kept: Option<KeptFiles>,
}

/// The model files a run directory holds beside its record.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
struct KeptFiles {
    /// `tokenizer.json`: the run's data was tokenized with it (else bytes).
    tokenizer: bool,
}

/// Where a run's model config, tokenizer and side files are read from.
#[derive(Clone, Debug)]
pub(super) enum ModelFiles {
    /// The run directory: the record's config (`from_hf_json` of what
    /// `to_hf_json` wrote, the seed being the options'), and
    /// `tokenizer.json` there where `tokenizer` (else bytes).
    RunDir {
        config: Box<LmConfig>,
        tokenizer: bool,
    },
    /// The source: the preset or the model directory, and `--tokenizer`.
    Source,
}

impl ModelFiles {
    /// The tokenizer and the model config of the run `o` in `source`.
    pub(super) fn read(
        &self,
        o: &TrainOptions,
        source: &Source,
    ) -> Result<(Tokenizer, LmConfig), String> {
        match self {
            ModelFiles::RunDir { config, tokenizer } => {
                let tok = if *tokenizer {
                    let path = o.out.join("tokenizer.json");
                    if !path.is_file() {
                        return Err(format!(
                            "{} is missing: the run's data was tokenized with it; put it back \
                             (a copy of the tokenizer the run started with)",
                            path.display()
                        ));
                    }
                    Tokenizer::from_file(&path).map_err(|e| format!("{}: {e}", path.display()))?
                } else {
                    Tokenizer::bytes_for(config.vocab)
                };
                let config = LmConfig {
                    seed: o.seed,
                    ..(**config).clone()
                };
                Ok((tok, config))
            }
            ModelFiles::Source => {
                let tok = tokenizer_for(o, source)?;
                let config = model_config(o, source, &tok)?;
                Ok((tok, config))
            }
        }
    }

    /// The chat template `messages` data is rendered through: the one in
    /// the directory the tokenizer comes from (the run directory once it
    /// keeps the files, else the model directory or `--tokenizer`'s).
    pub(super) fn chat_template(
        &self,
        o: &TrainOptions,
        source: &Source,
    ) -> Result<Option<ChatTemplate>, String> {
        let dir = match self {
            ModelFiles::RunDir { .. } => Some(o.out.clone()),
            ModelFiles::Source => match (&o.tokenizer, source) {
                (Some(file), _) => file.parent().map(Path::to_path_buf),
                (None, Source::Finetune(dir)) => Some(dir.clone()),
                (None, Source::Scratch) => None,
            },
        };
        match dir {
            Some(dir) => ChatTemplate::from_dir(&dir).map_err(|e| e.to_string()),
            None => Ok(None),
        }
    }

    /// Where an export finds the side files to copy: the run directory
    /// once it keeps them (every new run), else a fine-tune's model
    /// directory.
    pub(super) fn side_files_dir<'a>(
        &self,
        o: &'a TrainOptions,
        source: &'a Source,
    ) -> Option<&'a Path> {
        match (self, source) {
            (ModelFiles::RunDir { .. }, _) => Some(&o.out),
            (ModelFiles::Source, Source::Finetune(dir)) => Some(dir),
            (ModelFiles::Source, Source::Scratch) => None,
        }
    }
}

pub(super) fn store_path(out: &Path) -> PathBuf {
    out.join("experts.strata")
}

/// `--resume`: the saved options, with `--steps`, `--export`,
/// `--tensorboard`, `--trace-routing`, `--quiet`,
/// `--timeline-step`, the thread counts and the host tier's split
/// (`--host-stream-slots`, `--host-cell-slots`, which change no
/// result) taken from the command line when given.
pub(super) fn resume_options(
    flags: &TrainFlags,
) -> Result<(TrainOptions, Source, ModelFiles), String> {
    let out = flags.resolve()?.out;
    let record = read_record(&out, "resume", "--out")?;
    let files = record.model_files()?;
    let recorded_out = record.options.out.clone();
    // The directory given now, not the one recorded: a run directory may
    // have been moved, or --out be relative to another working directory.
    let mut o = TrainOptions {
        out,
        ..record.options
    };
    if let Some(steps) = flags.steps {
        o.steps = steps;
    }
    if flags.export.is_some() {
        o.export = flags.export.clone();
    } else if let Some(export) = o.export.take() {
        o.export = follow_export(&recorded_out, &o.out, export);
    }
    if let Some(stream) = flags.host_stream_slots {
        o.host_stream_slots = stream;
    }
    o.host_cell_slots = flags.host_cell_slots.unwrap_or(o.host_cell_slots);
    o.threads = flags.threads.unwrap_or(o.threads);
    if flags.compute_threads.is_some() {
        o.compute_threads = flags.compute_threads;
    }
    if flags.tensorboard.is_some() {
        o.tensorboard = flags.tensorboard.clone();
    }
    if flags.trace_routing.is_some() {
        o.trace_routing = flags.trace_routing.clone();
    }
    o.affinity_prefetch |= flags.affinity_prefetch;
    o.dense_on_host |= flags.dense_on_host;
    if let Some(gemm) = &flags.dense_gemm {
        o.dense_gemm = gemm.clone();
    }
    if let Some(gemm) = &flags.expert_gemm {
        o.expert_gemm = gemm.clone();
    }
    if flags.expert_group.is_some() {
        o.expert_group = flags.expert_group;
    }
    if let Some(kernel) = &flags.bf16_kernel {
        o.bf16_kernel = kernel.clone();
    }
    o.quiet = flags.quiet;
    o.timeline_step = flags.timeline_step;
    o.resume = true;
    Ok((o, record.source, files))
}

/// The recorded `--export` of a run resumed from `now`, recorded in `was`.
/// In place, it stands. Moved (or copied), an export inside the run
/// directory moves with it; one outside is not written by this copy unless
/// named again, so that a copy never overwrites the original's export.
fn follow_export(was: &Path, now: &Path, export: PathBuf) -> Option<PathBuf> {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    if same(was, now) {
        return Some(export);
    }
    if let Ok(inside) = export.strip_prefix(was) {
        return Some(now.join(inside));
    }
    let _ = writeln!(
        std::io::stderr(),
        "note: this run was recorded in {} and is resumed from {}: its --export {} is not \
         written by this copy; give --export again to write it",
        was.display(),
        now.display(),
        export.display()
    );
    None
}

impl RunRecord {
    fn model_files(&self) -> Result<ModelFiles, String> {
        Ok(match self.kept {
            Some(kept) => ModelFiles::RunDir {
                config: Box::new(
                    LmConfig::from_hf_json(&self.model)
                        .map_err(|e| format!("run.json's model: {e}"))?,
                ),
                tokenizer: kept.tokenizer,
            },
            None => ModelFiles::Source,
        })
    }
}

/// Replaces `DIR/run.json` whole (a crash leaves the old or the new).
fn write_record(dir: &Path, record: &RunRecord) -> Result<(), String> {
    let text = serde_json::to_string_pretty(record).expect("plain JSON");
    let tmp = dir.join(".run.json.partial");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, dir.join("run.json")))
        .map_err(|e| format!("cannot write the run record in {}: {e}", dir.display()))
}

/// A resumed run's record: the options it goes on with (the directory it
/// is in now, `--steps`, `--export`, the threads and the split given on
/// the command line), so that the next `--resume` takes them.
pub(super) fn update_record(o: &TrainOptions) -> Result<(), String> {
    let record = read_record(&o.out, "resume", "--out")?;
    let options = TrainOptions {
        resume: false,
        ..o.clone()
    };
    write_record(&o.out, &RunRecord { options, ..record })
}

/// Copies into the new run's directory the tokenizer it uses (`--tokenizer`,
/// else a fine-tune's `tokenizer.json`) and a fine-tune's other side files;
/// says whether there was a tokenizer to copy.
fn keep_model_files(o: &TrainOptions, source: &Source) -> Result<bool, String> {
    let model_dir = match source {
        Source::Finetune(dir) => Some(dir.as_path()),
        Source::Scratch => None,
    };
    let tokenizer = tokenizer_path(o, source);
    let mut copies: Vec<(PathBuf, &str)> = tokenizer
        .iter()
        .map(|from| (from.clone(), "tokenizer.json"))
        .collect();
    if let Some(dir) = model_dir {
        copies.extend(
            hf::SIDE_FILES
                .iter()
                .filter(|name| **name != "tokenizer.json")
                .map(|name| (dir.join(name), *name))
                .filter(|(from, _)| from.is_file()),
        );
    }
    for (from, name) in copies {
        let to = o.out.join(name);
        // A file given from inside the run directory is there already.
        let same = from.canonicalize().ok() == to.canonicalize().ok() && to.exists();
        if !same {
            std::fs::copy(&from, &to)
                .map_err(|e| format!("cannot copy {} to {}: {e}", from.display(), to.display()))?;
        }
    }
    Ok(tokenizer.is_some())
}

/// The export's precision: `given` (f32, bf16 or f16), else what the run's
/// kept `config.json` declares.
pub(super) fn export_dtype(
    given: Option<&str>,
    run_dir: &Path,
) -> Result<strata_tiers::Dtype, String> {
    match given {
        Some(name) => parse_dtype(name).map_err(|e| e.replace("--compute-dtype", "--dtype")),
        None => {
            let kept = std::fs::read_to_string(run_dir.join("config.json")).ok();
            Ok(hf::declared_dtype(kept.as_deref()))
        }
    }
}

/// A fine-tune's source `config.json`, verbatim: the run directory keeps
/// it, every key included, for `--resume` and for the export's config.
fn source_config_text(source: &Source) -> Option<String> {
    match source {
        Source::Finetune(dir) => std::fs::read_to_string(dir.join("config.json")).ok(),
        Source::Scratch => None,
    }
}

/// `DIR/run.json`; where it cannot be read, the error says what could not
/// `verb` and which `flag` named the directory.
fn read_record(dir: &Path, verb: &str, flag: &str) -> Result<RunRecord, String> {
    let path = dir.join("run.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "cannot {verb}: {} is not readable ({e}); is {flag} the run's directory?",
            path.display()
        )
    })?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// A finished or stopped run, opened to be read (`strata verify`, `strata
/// export`): locked, so no trainer commits to its store meanwhile and no
/// other reader runs, with its options, source, model files and model.
pub(super) struct OpenedRun {
    _lock: RunLock,
    pub options: TrainOptions,
    pub source: Source,
    pub files: ModelFiles,
    pub lm: MoeLm,
}

pub(super) fn open_run(run_dir: &Path, verb: &str) -> Result<OpenedRun, String> {
    let record = read_record(run_dir, verb, "--run")?;
    let lock = RunLock::take(run_dir)?;
    let files = record.model_files()?;
    let options = TrainOptions {
        out: run_dir.to_path_buf(),
        resume: true,
        ..record.options
    };
    let (_, config) = files.read(&options, &record.source)?;
    let lm = super::model_for(&options, &config)?;
    Ok(OpenedRun {
        _lock: lock,
        options,
        source: record.source,
        files,
        lm,
    })
}

/// Checks the run in `run_dir` without training: its store's committed
/// checkpoint, record by record, and the dense state beside it
/// (`strata verify`).
pub fn verify_run(run_dir: &Path) -> Result<strata::engine::CheckpointReport, String> {
    let run = open_run(run_dir, "verify")?;
    strata::engine::verify_checkpoint(&store_path(run_dir), run.lm.config().dense_params())
        .map_err(|e| format!("{}: {e}", store_path(run_dir).display()))
}

/// `strata export`: the run's last checkpoint as a Hugging Face model.
/// `dtype` None: the precision the source declares (`torch_dtype`), f32 for
/// a model trained from scratch. A run of ranks as processes (`--out`
/// holding `rank-R` directories) is exported whole, each expert from the
/// rank that owns it.
pub fn export_run(run_dir: &Path, to: &Path, dtype: Option<&str>) -> Result<Vec<PathBuf>, String> {
    if let Some(ranks) = super::rank_export::rank_dirs(run_dir) {
        return super::rank_export::export_ranks_run(&ranks, to, dtype);
    }
    let run = open_run(run_dir, "export")?;
    let mut engine = export_engine(&run, run_dir)?;
    let source_dir = run.files.side_files_dir(&run.options, &run.source);
    let (dense, store) = engine.dense_params_and_store().map_err(|e| e.to_string())?;
    hf::export(
        to,
        &run.lm,
        dense,
        &[store],
        export_dtype(dtype, run_dir)?,
        2 << 30,
        source_dir,
    )
}

/// An engine that reads `run`'s checkpoint for an export: room for one
/// expert in each tier.
pub(super) fn export_engine(run: &OpenedRun, run_dir: &Path) -> Result<Engine, String> {
    let (o, lm) = (&run.options, &run.lm);
    let engine_config = EngineConfig {
        store_path: Some(store_path(run_dir)),
        device_budget_bytes: 2 * lm.config().expert_params() as u64 * 4,
        host_budget_bytes: 2 * Layout {
            layers: 1,
            experts_per_layer: 1,
            params_per_expert: lm.config().expert_params() as u64,
            compute_dtype: parse_dtype(&o.compute_dtype)?,
            moments: super::trains_experts(o)?,
        }
        .record_bytes(),
        compute_dtype: parse_dtype(&o.compute_dtype)?,
        train_experts: super::trains_experts(o)?,
        optimizer_threads: 1,
        ..EngineConfig::default()
    };
    Engine::resume_network(lm, engine_config).map_err(|e| e.to_string())
}

/// Makes the run directory, its record and its store (initialized or
/// imported). On failure, what this call created is removed again.
pub(super) fn create_run(
    o: &TrainOptions,
    source: &Source,
    config: &LmConfig,
    lm: &MoeLm,
    engine_config: EngineConfig,
    imported: Option<(strata::lm::safetensors_io::Checkpoint, Vec<f32>)>,
    created: bool,
) -> Result<Engine, String> {
    let result = (|| {
        let tokenizer = keep_model_files(o, source)?;
        let record = RunRecord {
            options: o.clone(),
            source: source.clone(),
            model: source_config_text(source).unwrap_or_else(|| config.to_hf_json()),
            kept: Some(KeptFiles { tokenizer }),
        };
        let engine = match imported {
            None => Engine::new_network(lm, engine_config).map_err(|e| e.to_string())?,
            Some((ckpt, dense)) => {
                let layout = Layout {
                    layers: config.moe().layers as u32,
                    experts_per_layer: config.experts as u32,
                    params_per_expert: config.expert_params() as u64,
                    compute_dtype: engine_config.compute_dtype,
                    moments: engine_config.train_experts,
                };
                let path = store_path(&o.out);
                {
                    let store = ExpertStore::create(&path, layout, &FileOptions::default())
                        .map_err(|e| e.to_string())?;
                    // A closed stdout is seen by the trainer's next line.
                    let _ = writeln!(
                        std::io::stdout(),
                        "importing {} experts …",
                        layout.expert_count()
                    );
                    let bar = indicatif::ProgressBar::new(layout.expert_count());
                    hf::import_store(&ckpt, config, &store, |done, _| bar.set_position(done))?;
                    bar.finish_and_clear();
                }
                Engine::open_imported(lm, engine_config, dense).map_err(|e| e.to_string())?
            }
        };
        std::fs::write(o.out.join("config.json"), &record.model)
            .map_err(|e| format!("cannot write config.json in {}: {e}", o.out.display()))?;
        write_record(&o.out, &record)?;
        Ok(engine)
    })();
    if result.is_err() {
        if created {
            let _ = std::fs::remove_dir_all(&o.out);
        } else {
            let _ = std::fs::remove_file(store_path(&o.out));
        }
    }
    result
}

/// The run directory, locked for this process: `.lock` in it, held with an
/// exclusive lock for as long as the value lives. The OS drops the lock
/// when the process ends, however it ends, so a crash leaves no stale lock.
pub(crate) struct RunLock {
    dir: PathBuf,
    file: std::fs::File,
    /// This process made the directory.
    created: bool,
}

impl RunLock {
    /// Creates `dir` if needed and locks it, or says which process holds
    /// it.
    pub fn take(dir: &Path) -> Result<RunLock, String> {
        let created = !dir.exists();
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let path = dir.join(".lock");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {
                // Who holds it, for the message of the next one to try.
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_string())
                    .unwrap_or_default();
                let _ = file.set_len(0);
                let _ = writeln!(file, "pid {} on {host}", std::process::id());
                Ok(RunLock {
                    dir: dir.to_path_buf(),
                    file,
                    created,
                })
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                let holder = match holder.trim() {
                    "" => "another strata process".to_string(),
                    who => format!("another strata process ({who})"),
                };
                Err(format!(
                    "{} is in use: {holder} is training or exporting there. Wait for it to \
                     finish (Ctrl-C or SIGTERM stops a run with a checkpoint), or choose another \
                     run directory",
                    dir.display()
                ))
            }
            Err(std::fs::TryLockError::Error(e)) => {
                // A file system without locks (some network ones): the run
                // goes on, and says it is not guarded.
                let _ = writeln!(
                    std::io::stderr(),
                    "note: {} cannot be locked ({e}); make sure no other strata process \
                     trains in {}",
                    path.display(),
                    dir.display()
                );
                Ok(RunLock {
                    dir: dir.to_path_buf(),
                    file,
                    created,
                })
            }
        }
    }

    pub fn created(&self) -> bool {
        self.created
    }

    /// After a failed start: the directory this process made goes again
    /// if nothing but the lock was written to it.
    pub fn remove_if_unused(self) {
        let only_the_lock = std::fs::read_dir(&self.dir)
            .map(|entries| entries.flatten().all(|e| e.file_name() == ".lock"))
            .unwrap_or(false);
        if self.created && only_the_lock {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        drop(self.file);
    }
}
