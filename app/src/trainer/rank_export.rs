//! Exporting a run of ranks as processes: the dense params of rank 0
//! (every rank holds the same bits) and each expert from the store of the
//! rank that owns it (`strata::engine::rank_of_expert`). Rank 0 does it at
//! the end of `mpirun … strata train --export`, and `strata export` does
//! it for a ranks run's `--out`. Both read every rank's directory, so they
//! need them all on one file system.

use std::path::{Path, PathBuf};

use strata::engine::Engine;
use strata_tiers::io::FileOptions;
use strata_tiers::ExpertStore;

use super::ranks::rank_out;
use super::run_dir::{export_dtype, export_engine, open_run, store_path};

/// The run directories of a ranks run in `out` (`rank-0`, `rank-1`, … as
/// far as they go), where `out` is one: no run of its own, a `rank-0`
/// with one.
pub fn rank_dirs(out: &Path) -> Option<Vec<PathBuf>> {
    let is_run = |d: &Path| d.join("run.json").is_file();
    if is_run(out) || !is_run(&rank_out(out, 0)) {
        return None;
    }
    Some(
        (0..)
            .map(|r| rank_out(out, r))
            .take_while(|d| is_run(d))
            .collect(),
    )
}

/// For rank 0 of `ranks`, in its run directory `rank0_out`: the stores of
/// ranks 1.., beside it, each at the step of `mine`.
pub(super) fn peer_stores(
    rank0_out: &Path,
    ranks: usize,
    mine: &ExpertStore,
) -> Result<Vec<ExpertStore>, String> {
    let out = rank0_out.parent().unwrap_or(Path::new("."));
    (1..ranks)
        .map(|r| {
            let path = store_path(&rank_out(out, r));
            let store = ExpertStore::open(&path, Some(mine.layout()), &FileOptions::default())
                .map_err(|e| {
                    format!(
                        "--export on ranks reads every rank's store, and rank {r}'s is not \
                         readable here ({}: {e}); run `strata export --run {} --to …` where \
                         every rank's directory is",
                        path.display(),
                        out.display()
                    )
                })?;
            if store.committed_step() != mine.committed_step() {
                return Err(format!(
                    "rank {r}'s store is at step {}, rank 0's at {}: the ranks' checkpoints \
                     differ",
                    store.committed_step(),
                    mine.committed_step()
                ));
            }
            Ok(store)
        })
        .collect()
}

/// `strata export` of a ranks run whose rank directories are `dirs`.
pub(super) fn export_ranks_run(
    dirs: &[PathBuf],
    to: &Path,
    dtype: Option<&str>,
) -> Result<Vec<PathBuf>, String> {
    let runs = dirs
        .iter()
        .map(|d| open_run(d, "export"))
        .collect::<Result<Vec<_>, _>>()?;
    let mut engines = runs
        .iter()
        .zip(dirs)
        .map(|(run, dir)| export_engine(run, dir))
        .collect::<Result<Vec<Engine>, _>>()?;
    let steps: Vec<u64> = engines.iter().map(Engine::steps).collect();
    if steps.iter().any(|&s| s != steps[0]) {
        return Err(format!(
            "the ranks' checkpoints are at steps {steps:?} (rank 0 first): resume the run with \
             as many ranks (`mpirun -n {} strata train --resume --out …`) to bring every rank \
             to one step, then export",
            dirs.len()
        ));
    }
    let dense = engines[0]
        .dense_params()
        .map_err(|e| e.to_string())?
        .to_vec();
    for (r, engine) in engines.iter_mut().enumerate().skip(1) {
        if engine.dense_params().map_err(|e| e.to_string())? != &dense[..] {
            return Err(format!(
                "rank {r}'s dense params differ from rank 0's at step {}: {} and {} are not \
                 ranks of one run",
                steps[0],
                dirs[r].display(),
                dirs[0].display()
            ));
        }
    }
    let stores: Vec<&ExpertStore> = engines.iter().map(Engine::store).collect();
    let source_dir = runs[0]
        .files
        .side_files_dir(&runs[0].options, &runs[0].source);
    super::hf::export(
        to,
        &runs[0].lm,
        &dense,
        &stores,
        export_dtype(dtype, &dirs[0])?,
        2 << 30,
        source_dir,
    )
}
