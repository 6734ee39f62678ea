//! Opening a run: its data, its engine (created with the run's directory
//! and record, or resumed from its last checkpoint, joined to the other
//! ranks), and, at its end, the export.

use std::path::{Path, PathBuf};

use strata::engine::{Engine, EngineConfig};
use strata::lm::data::{Corpus, DataConfig, Dataset, Tokenizer};
use strata::lm::safetensors_io::Checkpoint;
use strata::lm::{LmConfig, MoeLm};

use super::announce::Speaker;
use super::run_dir::{self, create_run, update_record, ModelFiles};
use super::{hf, metrics_log, rank_export, ranks, routing_file, Packing, Source, TrainOptions};

/// The run's data: `--data`'s files, or the built-in corpus, in batches
/// of `--batch` sequences of `--seq-len` tokens.
pub(super) fn dataset(
    o: &TrainOptions,
    files: &ModelFiles,
    source: &Source,
    tok: Tokenizer,
) -> Result<Dataset, String> {
    let corpus = if o.data.is_empty() {
        Corpus::Builtin { documents: 200_000 }
    } else {
        Corpus::Files(o.data.clone())
    };
    let config = DataConfig {
        corpus,
        seq_len: o.seq_len,
        batch_seqs: o.batch,
        seed: o.seed,
        chat_template: files.chat_template(o, source)?,
        documents_apart: o.packing == Some(Packing::Apart),
        ..DataConfig::default()
    };
    Dataset::open(config, tok).map_err(|e| e.to_string())
}

/// What a run opens its engine from and exports.
pub(super) struct OpenRun<'a> {
    pub o: &'a TrainOptions,
    pub source: &'a Source,
    pub config: &'a LmConfig,
    pub lm: &'a MoeLm,
    /// The run directory was made by this run's lock.
    pub created_out: bool,
}

impl OpenRun<'_> {
    /// A new run's engine (its directory and record written), or the
    /// resumed one with the data skipped to its step; on ranks, joined to
    /// the other ranks.
    pub fn engine(
        &self,
        engine_config: EngineConfig,
        imported: Option<(Checkpoint, Vec<f32>)>,
        world: Option<ranks::RankWorld>,
        data: &mut Dataset,
    ) -> Result<Engine, String> {
        let o = self.o;
        let mut comm = world.map(|w| w.comm);
        let mut engine = if o.resume {
            let condensing = engine_config.condense.is_some();
            // Ranks resume from the newest checkpoint all of them hold.
            let mut engine = match comm.take() {
                Some(comm) => Engine::resume_rank(self.lm, engine_config, comm),
                None => Engine::resume_network(self.lm, engine_config),
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
            update_record(o)?;
            engine
        } else {
            create_run(
                o,
                self.source,
                self.config,
                self.lm,
                engine_config,
                imported,
                self.created_out,
            )?
        };
        if let Some(comm) = comm {
            engine.join_ranks(comm).map_err(|e| e.to_string())?;
        }
        Ok(engine)
    }

    /// `--export`: the model written in Hugging Face form to `dir`, with
    /// the source's side files; on ranks by rank 0, each expert read from
    /// its owner's store (every rank has committed its last checkpoint).
    pub fn export(
        &self,
        engine: &mut Engine,
        dir: &Path,
        files: &ModelFiles,
        speaker: &Speaker<'_>,
    ) -> Result<Vec<PathBuf>, String> {
        let o = self.o;
        // A new run's directory keeps the side files from its start.
        let source_dir = if o.resume {
            files.side_files_dir(o, self.source)
        } else {
            Some(o.out.as_path())
        };
        let rank = engine.rank();
        let (dense, store) = engine.dense_params_and_store().map_err(|e| e.to_string())?;
        let peers = match rank {
            Some((0, n)) => rank_export::peer_stores(&o.out, n, store)?,
            _ => Vec::new(),
        };
        if rank.is_some_and(|(r, _)| r != 0) {
            return Ok(Vec::new());
        }
        speaker.say(format!("exporting to {}", dir.display()));
        let stores: Vec<&strata_tiers::ExpertStore> =
            std::iter::once(store).chain(&peers).collect();
        hf::export(
            dir,
            self.lm,
            dense,
            &stores,
            run_dir::export_dtype(None, &o.out)?,
            2 << 30,
            source_dir,
        )
    }
}
