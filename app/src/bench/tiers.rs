//! `strata bench tiers`: record read and write bandwidth through the SSD
//! tier, per engine (io_uring, pread) and queue depth.
//!
//! A store of `experts` records of about `record_mib` each is created in
//! `dir`; every record is written once (one batch with `queue_depth` writes
//! in flight, then one checkpoint, fsync included in the time) and then read
//! back in full `passes` times, each pass one batch with `queue_depth`
//! reads in flight and every record's checksums verified as it arrives.
//! O_DIRECT keeps the page cache out of it. CPU time is the process's user
//! plus system time over the run, per GB moved.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use strata_tiers::io::{AlignedBuf, EnginePreference, FileOptions, HostRegion};
use strata_tiers::{Dtype, ExpertStore, Layout, Parts, TierError};

/// Host memory the bench may fill with record buffers.
const BUFFER_BYTES_MAX: u64 = 4 << 30;

/// Settings of one `strata bench tiers` run.
#[derive(Clone, Debug)]
pub struct TiersBenchConfig {
    pub dir: PathBuf,
    pub record_mib: u64,
    pub experts: u32,
    pub queue_depths: Vec<u32>,
    pub engines: Vec<EnginePreference>,
    pub passes: u32,
    /// Leave the last store file in place (for reading it with fio).
    pub keep_file: bool,
    /// Read an existing `strata-bench.store` of the same layout instead of
    /// creating and writing one (reads only).
    pub reuse_file: bool,
}

/// One line of output.
#[derive(Clone, Debug, Serialize)]
pub struct TiersBenchRecord {
    pub bench: &'static str,
    pub engine: &'static str,
    pub op: &'static str,
    pub direct: bool,
    /// Whether the buffers were registered with io_uring (fixed buffers).
    pub registered: bool,
    pub record_bytes: u64,
    pub records: u64,
    pub queue_depth: u32,
    pub gb_per_s: f64,
    pub cpu_s_per_gb: f64,
    /// Byte offset of the first record read, and the stride between reads:
    /// what `fio --offset=… --rw=read:<skip>` needs to read the same blocks.
    pub first_offset: u64,
    pub stride_bytes: u64,
    /// The store file (removed after the run unless `keep_file`).
    pub file: String,
}

/// CPU seconds this process has used so far (0 where the OS does not say).
fn cpu_seconds() -> f64 {
    super::process_usage().map_or(0.0, |(cpu_s, _)| cpu_s)
}

/// A one-layer store of `records` records of about `record_mib` MiB each
/// (also the scratch store of `bench overlap`).
pub(crate) fn scratch_layout(record_mib: u64, records: u32) -> Layout {
    // A record holds 2 (bf16) + 12 bytes a param, plus two 4 KiB-rounded headers.
    let params = (record_mib << 20) / 14;
    Layout {
        layers: 1,
        experts_per_layer: records,
        params_per_expert: params.max(1),
        compute_dtype: Dtype::Bf16,
        moments: true,
    }
}

/// One region for every record of `layout` (so it can be registered with
/// io_uring as the host tier's pool is), filled with a byte pattern;
/// refused beyond `BUFFER_BYTES_MAX`, with `why` naming the options that
/// shrink it.
pub(crate) fn scratch_region(layout: Layout, why: &'static str) -> Result<HostRegion, TierError> {
    let buffer_bytes = layout.record_bytes() * layout.expert_count();
    if buffer_bytes > BUFFER_BYTES_MAX {
        return Err(TierError::BudgetTooSmall {
            tier: "bench buffer",
            budget_bytes: BUFFER_BYTES_MAX,
            needed_bytes: buffer_bytes,
            why,
        });
    }
    let mut region = HostRegion::new(AlignedBuf::zeroed(buffer_bytes as usize), false, None);
    region
        .as_mut_slice()
        .iter_mut()
        .enumerate()
        .for_each(|(k, x)| *x = (k % 251) as u8);
    Ok(region)
}

/// Runs the bench; `progress` gets a line per measurement.
pub fn run(
    config: &TiersBenchConfig,
    mut progress: impl FnMut(&str),
) -> Result<Vec<TiersBenchRecord>, TierError> {
    let layout = scratch_layout(config.record_mib, config.experts);
    let mut region = scratch_region(
        layout,
        "one buffer per record; use fewer --experts or a smaller --record-mib",
    )?;
    let mut out = Vec::new();
    for &engine in &config.engines {
        let depths: Vec<u32> = if engine == EnginePreference::Pread {
            vec![1] // synchronous: one op in flight, whatever the batch
        } else {
            config.queue_depths.clone()
        };
        for depth in depths {
            let path = config.dir.join("strata-bench.store");
            if !config.reuse_file {
                let _ = std::fs::remove_file(&path);
            }
            let options = FileOptions {
                engine,
                queue_depth: depth,
                direct: true,
            };
            let result = bench_one(
                &path,
                layout,
                &options,
                depth as usize,
                config.passes,
                config.reuse_file,
                &mut region,
            );
            if !config.keep_file {
                let _ = std::fs::remove_file(&path);
            }
            for r in result? {
                progress(&format!(
                    "{} {} depth {}: {:.2} GB/s, {:.3} CPU s/GB",
                    r.engine, r.op, r.queue_depth, r.gb_per_s, r.cpu_s_per_gb
                ));
                out.push(r);
            }
        }
    }
    Ok(out)
}

fn bench_one(
    path: &Path,
    layout: Layout,
    options: &FileOptions,
    depth: usize,
    passes: u32,
    reuse: bool,
    region: &mut HostRegion,
) -> Result<Vec<TiersBenchRecord>, TierError> {
    let store = if reuse {
        ExpertStore::open(path, Some(layout), options)?
    } else {
        ExpertStore::create(path, layout, options)?
    };
    let registered = store.register_host_region(region);
    let result = bench_store(&store, layout, depth, passes, reuse, region, registered);
    store.unregister_host_region();
    result
}

fn bench_store(
    store: &ExpertStore,
    layout: Layout,
    depth: usize,
    passes: u32,
    reuse: bool,
    region: &mut HostRegion,
    registered: bool,
) -> Result<Vec<TiersBenchRecord>, TierError> {
    let direct = store.notes().iter().all(|n| !n.contains("O_DIRECT"));
    let count = layout.expert_count();
    let record_bytes = layout.record_bytes();
    let gb = |records: u64| (records * record_bytes) as f64 / 1e9;
    let record = |op, seconds: f64, cpu: f64, records: u64| TiersBenchRecord {
        bench: "tiers",
        engine: store.engine(),
        op,
        direct,
        registered,
        record_bytes,
        records,
        queue_depth: depth as u32,
        gb_per_s: gb(records) / seconds,
        cpu_s_per_gb: cpu / gb(records),
        // After one write and a checkpoint, every expert's current record
        // is copy 1; reads skip the other copy.
        first_offset: layout.record_offset(0, 1),
        stride_bytes: 2 * record_bytes,
        file: store
            .path()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
    };

    let mut out = Vec::new();
    if !reuse {
        out.push(write_all(store, layout, region, &record)?);
    }

    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    for _ in 0..passes {
        let mut batch: Vec<_> = region
            .as_mut_slice()
            .chunks_exact_mut(record_bytes as usize)
            .enumerate()
            .map(|(k, b)| (layout.expert_at(k as u64), Parts::Full, b))
            .collect();
        store.read_many(&mut batch)?;
    }
    let reads = count * passes as u64;
    out.push(record(
        "read",
        t0.elapsed().as_secs_f64(),
        cpu_seconds() - cpu0,
        reads,
    ));
    Ok(out)
}

/// Writes every record once (one batch) and commits: the write figure.
fn write_all(
    store: &ExpertStore,
    layout: Layout,
    region: &mut HostRegion,
    record: &dyn Fn(&'static str, f64, f64, u64) -> TiersBenchRecord,
) -> Result<TiersBenchRecord, TierError> {
    let record_bytes = layout.record_bytes();
    let count = layout.expert_count();
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    let mut batch: Vec<_> = region
        .as_mut_slice()
        .chunks_exact_mut(record_bytes as usize)
        .enumerate()
        .map(|(k, b)| (layout.expert_at(k as u64), 1u64, b))
        .collect();
    store.write_many(&mut batch)?;
    drop(batch);
    store.checkpoint(1)?;
    Ok(record(
        "write",
        t0.elapsed().as_secs_f64(),
        cpu_seconds() - cpu0,
        count,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_measures_both_engines() {
        let dir = tempfile::tempdir().unwrap();
        let config = TiersBenchConfig {
            dir: dir.path().to_path_buf(),
            record_mib: 1,
            experts: 8,
            queue_depths: vec![1, 4],
            engines: vec![EnginePreference::Auto, EnginePreference::Pread],
            passes: 1,
            keep_file: false,
            reuse_file: false,
        };
        let records = run(&config, |_| {}).unwrap();
        // auto: 2 depths × (write, read); pread: 1 × (write, read)
        assert_eq!(records.len(), 6);
        assert!(records
            .iter()
            .all(|r| r.gb_per_s > 0.0 && r.record_bytes >= 1 << 20));
        assert!(records.iter().any(|r| r.engine == "pread"));
        // Nothing is left in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
