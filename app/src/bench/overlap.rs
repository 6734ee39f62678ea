//! `strata bench overlap`: whether this machine can hide SSD traffic behind
//! compute, which is what the expert-wise schedule counts on.
//!
//! Three arms take turns in each round (the order rotates):
//! - `io`: a step's kind of SSD traffic: every record of a scratch store
//!   read (checksums verified as they arrive) and written back, through the
//!   SSD tier's own engine (io_uring, O_DIRECT), on one thread as the
//!   prefetch thread does;
//! - `compute`: the cpu backend's expert GEMMs, split over every core (or
//!   `--compute-threads`) as the engine splits them, sized in an untimed first pass to last as long
//!   as `io` alone (the balanced case, where the overlap matters most), or
//!   `compute_over_io` times as long;
//! - `both`: the two at once.
//!
//! `both` ÷ max(io, compute) is then the best step any overlapping schedule
//! can reach on this machine, relative to its bound: 1.0 where the I/O
//! costs the cores nothing, (io + compute) ÷ max(io, compute) (2.0 at an
//! exact balance) where the two together take as long as one after the
//! other. The steal column shows a cost a virtual machine hides
//! from its own CPU counters: where the host serves the virtual disk on the
//! physical cores behind this machine's, I/O while every core computes
//! takes CPU time from those cores.

use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;
use strata_tiers::io::{FileOptions, HostRegion};
use strata_tiers::{ExpertStore, Layout, Parts, TierError};

use super::{median, process_usage, stolen_cpu_s};
use strata::backend::gemm_forward;
use strata::EngineError;

/// The GEMM of the compute arm: (M, K) · (N, K)ᵀ, an expert's first
/// projection at `strata bench step`'s defaults (256 tokens an expert,
/// d_model 512, d_ff 1024).
const GEMM_M: usize = 256;
const GEMM_K: usize = 512;
const GEMM_N: usize = 1024;

/// Settings of one `strata bench overlap` run.
#[derive(Clone, Debug)]
pub struct OverlapBenchConfig {
    /// Directory for the scratch store (on the disk to measure).
    pub dir: PathBuf,
    /// Approximate bytes of one record, in MiB.
    pub record_mib: u64,
    pub records: u32,
    /// Rounds in which the three arms take turns.
    pub rounds: usize,
    /// How long the compute arm is to last, as a multiple of the I/O arm
    /// (1.0: balanced).
    pub compute_over_io: f64,
}

/// One arm's line of output: medians over the rounds.
#[derive(Clone, Debug, Serialize)]
pub struct OverlapRecord {
    pub bench: &'static str,
    /// `io`, `compute` or `both`.
    pub arm: &'static str,
    pub rounds: usize,
    pub wall_s: f64,
    /// Time the I/O took (null in the compute arm).
    pub io_s: Option<f64>,
    /// Time the GEMMs took (null in the I/O arm).
    pub compute_s: Option<f64>,
    /// Bytes read plus bytes written, over `io_s`.
    pub io_gb_per_s: Option<f64>,
    pub gflop_per_s: Option<f64>,
    /// CPU seconds the hypervisor took from this machine during the arm
    /// (/proc/stat's steal, all cores; null where not reported).
    pub steal_s: Option<f64>,
    /// CPU seconds this process used during the arm (user + system).
    pub cpu_s: Option<f64>,
    pub bytes_moved: u64,
    pub gemm_calls: usize,
    /// Whether the store bypassed the page cache (false where the file
    /// system refused O_DIRECT).
    pub direct: bool,
    pub engine: &'static str,
    /// Threads the compute arm's GEMMs split over
    /// ([`strata::set_compute_threads`]), of `machine_cores`.
    pub compute_threads: usize,
    pub machine_cores: usize,
}

/// What the three arms say together.
#[derive(Clone, Debug, Serialize)]
pub struct OverlapSummary {
    pub bench: &'static str,
    pub arm: &'static str,
    /// both ÷ max(io, compute), medians: 1.0 is a perfect overlap,
    /// `serial_over_bound` none.
    pub both_over_bound: f64,
    /// The same ratio round by round.
    pub both_over_bound_by_round: Vec<f64>,
    /// (io + compute) ÷ max(io, compute): the ratio with no overlap at all
    /// (2.0 where the calibration balanced the arms exactly).
    pub serial_over_bound: f64,
    /// The I/O's time beside the compute over its time alone.
    pub io_slowdown: f64,
    /// The GEMMs' time beside the I/O over their time alone.
    pub compute_slowdown: f64,
}

/// One timed run of an arm.
#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    wall_s: f64,
    io_s: Option<f64>,
    compute_s: Option<f64>,
    steal_s: Option<f64>,
    cpu_s: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Arm {
    Io,
    Compute,
    Both,
}

impl Arm {
    const ALL: [Arm; 3] = [Arm::Io, Arm::Compute, Arm::Both];

    fn name(self) -> &'static str {
        match self {
            Arm::Io => "io",
            Arm::Compute => "compute",
            Arm::Both => "both",
        }
    }
}

/// The operands of the compute arm, made once.
struct GemmWork {
    x: Vec<f32>,
    w: Vec<f32>,
    out: Vec<f32>,
}

impl GemmWork {
    fn new() -> Self {
        let fill = |n: usize, salt: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * 7 + salt) % 13) as f32 / 13.0 - 0.5)
                .collect()
        };
        Self {
            x: fill(GEMM_M * GEMM_K, 1),
            w: fill(GEMM_N * GEMM_K, 5),
            out: vec![0.0; GEMM_M * GEMM_N],
        }
    }

    /// Runs `calls` GEMMs; returns the seconds they took.
    fn run(&mut self, calls: usize) -> f64 {
        let t0 = Instant::now();
        for _ in 0..calls {
            gemm_forward(&mut self.out, &self.x, &self.w, GEMM_M, GEMM_K, GEMM_N);
        }
        t0.elapsed().as_secs_f64()
    }

    fn flops(calls: usize) -> f64 {
        2.0 * (GEMM_M * GEMM_K * GEMM_N) as f64 * calls as f64
    }
}

/// The scratch store and the host memory its records pass through (the
/// store is dropped first: fields drop in declaration order).
struct ScratchIo {
    store: ExpertStore,
    layout: Layout,
    region: HostRegion,
}

impl Drop for ScratchIo {
    fn drop(&mut self) {
        self.store.unregister_host_region();
    }
}

impl ScratchIo {
    /// Creates the store in `dir` and writes (and commits) every record once.
    fn create(config: &OverlapBenchConfig, path: &std::path::Path) -> Result<Self, TierError> {
        let layout = super::tiers::scratch_layout(config.record_mib, config.records);
        let region = super::tiers::scratch_region(
            layout,
            "one buffer per record; use fewer --records or a smaller --record-mib",
        )?;
        let store = ExpertStore::create(path, layout, &FileOptions::default())?;
        // Registered with io_uring, as the host tier's slots are.
        store.register_host_region(&region);
        let mut io = Self {
            store,
            layout,
            region,
        };
        io.write_all(1)?;
        io.store.checkpoint(1)?;
        Ok(io)
    }

    fn bytes_moved(&self) -> u64 {
        2 * self.region.len() as u64
    }

    fn write_all(&mut self, step: u64) -> Result<(), TierError> {
        let record_bytes = self.layout.record_bytes() as usize;
        let layout = self.layout;
        let mut writes: Vec<_> = self
            .region
            .as_mut_slice()
            .chunks_exact_mut(record_bytes)
            .enumerate()
            .map(|(k, b)| (layout.expert_at(k as u64), step, b))
            .collect();
        self.store.write_many(&mut writes)
    }

    /// Reads every committed record (verifying it) and writes each back to
    /// its working copy; returns the seconds it took. Nothing is committed,
    /// so every pass reads the same records.
    fn pass(&mut self) -> Result<f64, TierError> {
        let t0 = Instant::now();
        let record_bytes = self.layout.record_bytes() as usize;
        let layout = self.layout;
        let mut reads: Vec<_> = self
            .region
            .as_mut_slice()
            .chunks_exact_mut(record_bytes)
            .enumerate()
            .map(|(k, b)| (layout.expert_at(k as u64), Parts::Full, b))
            .collect();
        self.store.read_many(&mut reads)?;
        drop(reads);
        self.write_all(2)?;
        Ok(t0.elapsed().as_secs_f64())
    }
}

/// Runs `arm` once, with the CPU and steal counters around it.
fn measure(
    arm: Arm,
    io: &mut ScratchIo,
    work: &mut GemmWork,
    calls: usize,
) -> Result<Sample, EngineError> {
    let steal0 = stolen_cpu_s();
    let usage0 = process_usage();
    let t0 = Instant::now();
    let (io_s, compute_s) = match arm {
        Arm::Io => (Some(io.pass()?), None),
        Arm::Compute => (None, Some(work.run(calls))),
        Arm::Both => std::thread::scope(|s| {
            let reader = std::thread::Builder::new()
                .name("strata-overlap-io".into())
                .spawn_scoped(s, || io.pass())
                .map_err(|e| EngineError::Config(format!("starting the I/O thread: {e}")))?;
            let compute_s = work.run(calls);
            let io_s = reader.join().expect("the I/O thread does not panic")?;
            Ok::<_, EngineError>((Some(io_s), Some(compute_s)))
        })?,
    };
    let wall_s = t0.elapsed().as_secs_f64();
    Ok(Sample {
        wall_s,
        io_s,
        compute_s,
        steal_s: steal0.zip(stolen_cpu_s()).map(|(a, b)| b - a),
        cpu_s: usage0.zip(process_usage()).map(|(a, b)| b.0 - a.0),
    })
}

/// The median of the present values, `None` if there are none.
fn median_of(v: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let present: Vec<f64> = v.flatten().collect();
    (!present.is_empty()).then(|| median(present))
}

/// Runs the bench; `progress` gets a line per arm run.
pub fn run(
    config: &OverlapBenchConfig,
    mut progress: impl FnMut(&str),
) -> Result<(Vec<OverlapRecord>, OverlapSummary), EngineError> {
    if config.records == 0 || config.record_mib == 0 || config.rounds == 0 {
        return Err(EngineError::Config(
            "--records, --record-mib and --rounds must be at least 1".into(),
        ));
    }
    if !(config.compute_over_io > 0.0 && config.compute_over_io <= 100.0) {
        return Err(EngineError::Config(format!(
            "--compute-over-io {} is not a ratio in (0, 100] (1: compute as long as the I/O)",
            config.compute_over_io
        )));
    }
    let path = config
        .dir
        .join(format!("strata-bench-overlap-{}.store", std::process::id()));
    let result = run_on(config, &path, &mut progress);
    let _ = std::fs::remove_file(&path);
    result
}

fn run_on(
    config: &OverlapBenchConfig,
    path: &std::path::Path,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<OverlapRecord>, OverlapSummary), EngineError> {
    progress(&format!(
        "writing {} records of {} MiB to {}",
        config.records,
        config.record_mib,
        path.display()
    ));
    let mut io = ScratchIo::create(config, path)?;
    let direct = io.store.notes().iter().all(|n| !n.contains("O_DIRECT"));
    for note in io.store.notes() {
        progress(note);
    }
    let mut work = GemmWork::new();
    // Untimed: two passes of each warm the file and the threads (the first
    // I/O pass runs slower), then the GEMM count is set so that the compute
    // arm lasts `compute_over_io` times the faster I/O pass.
    let io_s = io.pass()?.min(io.pass()?);
    let target_s = io_s * config.compute_over_io;
    work.run(2);
    let probe = 16;
    let per_call = work.run(probe) / probe as f64;
    let mut calls = ((target_s / per_call.max(1e-9)).round() as usize).max(1);
    // Once more at full length, which short probes misjudge.
    let full = work.run(calls);
    calls = ((calls as f64 * target_s / full.max(1e-9)).round() as usize).max(1);
    progress(&format!(
        "I/O pass {io_s:.3} s; {calls} GEMMs of {GEMM_M}x{GEMM_K}x{GEMM_N} to last {target_s:.3} s"
    ));

    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); Arm::ALL.len()];
    for round in 0..config.rounds {
        for i in 0..Arm::ALL.len() {
            let k = (i + round) % Arm::ALL.len();
            let arm = Arm::ALL[k];
            let s = measure(arm, &mut io, &mut work, calls)?;
            progress(&format!(
                "round {}: {} {:.3} s (steal {})",
                round + 1,
                arm.name(),
                s.wall_s,
                s.steal_s.map_or("-".into(), |v| format!("{v:.2} CPU-s"))
            ));
            samples[k].push(s);
        }
    }

    let bytes = io.bytes_moved();
    let records: Vec<OverlapRecord> = Arm::ALL
        .iter()
        .zip(&samples)
        .map(|(&arm, s)| {
            let io_s = median_of(s.iter().map(|x| x.io_s));
            let compute_s = median_of(s.iter().map(|x| x.compute_s));
            OverlapRecord {
                bench: "overlap",
                arm: arm.name(),
                rounds: s.len(),
                wall_s: median(s.iter().map(|x| x.wall_s).collect()),
                io_s,
                compute_s,
                io_gb_per_s: io_s.map(|t| bytes as f64 / 1e9 / t),
                gflop_per_s: compute_s.map(|t| GemmWork::flops(calls) / 1e9 / t),
                steal_s: median_of(s.iter().map(|x| x.steal_s)),
                cpu_s: median_of(s.iter().map(|x| x.cpu_s)),
                bytes_moved: if arm == Arm::Compute { 0 } else { bytes },
                gemm_calls: if arm == Arm::Io { 0 } else { calls },
                direct,
                engine: io.store.engine(),
                compute_threads: strata::compute_threads(),
                machine_cores: strata::machine_cores(),
            }
        })
        .collect();
    let summary = summarize(&samples);
    Ok((records, summary))
}

/// The ratios of the summary from the samples of the three arms (in
/// `Arm::ALL` order).
fn summarize(samples: &[Vec<Sample>]) -> OverlapSummary {
    let [io, compute, both] = [0, 1, 2].map(|k| &samples[k]);
    let wall = |s: &[Sample]| median(s.iter().map(|x| x.wall_s).collect());
    let bound = wall(io).max(wall(compute));
    let both_over_bound = wall(both) / bound;
    let serial_over_bound = (wall(io) + wall(compute)) / bound;
    let both_over_bound_by_round = io
        .iter()
        .zip(compute)
        .zip(both)
        .map(|((i, c), b)| b.wall_s / i.wall_s.max(c.wall_s))
        .collect();
    let io_s = |s: &[Sample]| median_of(s.iter().map(|x| x.io_s)).expect("an I/O arm");
    let compute_s = |s: &[Sample]| median_of(s.iter().map(|x| x.compute_s)).expect("a compute arm");
    OverlapSummary {
        bench: "overlap",
        arm: "summary",
        both_over_bound,
        both_over_bound_by_round,
        serial_over_bound,
        io_slowdown: io_s(both) / io_s(io),
        compute_slowdown: compute_s(both) / compute_s(compute),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(wall_s: f64, io_s: Option<f64>, compute_s: Option<f64>) -> Sample {
        Sample {
            wall_s,
            io_s,
            compute_s,
            ..Sample::default()
        }
    }

    #[test]
    fn the_summary_sets_both_against_the_slower_arm() {
        let samples = vec![
            vec![sample(1.0, Some(1.0), None), sample(1.2, Some(1.2), None)],
            vec![sample(0.5, None, Some(0.5)), sample(0.5, None, Some(0.5))],
            vec![
                sample(1.5, Some(1.5), Some(0.8)),
                sample(1.2, Some(1.1), Some(0.6)),
            ],
        ];
        let s = summarize(&samples);
        assert!((s.both_over_bound - 1.35 / 1.1).abs() < 1e-12);
        assert_eq!(s.both_over_bound_by_round, vec![1.5, 1.0]);
        assert!((s.serial_over_bound - 1.6 / 1.1).abs() < 1e-12);
        assert!((s.io_slowdown - 1.3 / 1.1).abs() < 1e-12);
        assert!((s.compute_slowdown - 0.7 / 0.5).abs() < 1e-12);
    }

    #[test]
    fn a_small_run_measures_three_arms_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let config = OverlapBenchConfig {
            dir: dir.path().to_path_buf(),
            record_mib: 1,
            records: 4,
            rounds: 2,
            compute_over_io: 1.0,
        };
        let mut lines = 0;
        let (records, summary) = run(&config, |_| lines += 1).unwrap();
        let arms: Vec<_> = records.iter().map(|r| r.arm).collect();
        assert_eq!(arms, ["io", "compute", "both"]);
        assert!(records.iter().all(|r| r.rounds == 2 && r.wall_s > 0.0));
        assert!(records[0].io_s.is_some() && records[0].compute_s.is_none());
        assert!(records[1].io_s.is_none() && records[1].gflop_per_s.unwrap() > 0.0);
        assert!(records[2].io_gb_per_s.unwrap() > 0.0 && records[2].gemm_calls >= 1);
        assert!(records[0].bytes_moved >= 8 << 20);
        assert_eq!(summary.both_over_bound_by_round.len(), 2);
        assert!(summary.both_over_bound > 0.0 && summary.io_slowdown > 0.0);
        assert!(
            lines >= 7,
            "progress for the setup and each of six arm runs"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn zero_sizes_are_refused() {
        let config = OverlapBenchConfig {
            dir: std::env::temp_dir(),
            record_mib: 1,
            records: 0,
            rounds: 1,
            compute_over_io: 1.0,
        };
        let err = run(&config, |_| {}).unwrap_err().to_string();
        assert!(err.contains("--records"), "{err}");
        for ratio in [0.0, -1.0, f64::NAN, 1e9] {
            let config = OverlapBenchConfig {
                records: 4,
                compute_over_io: ratio,
                ..config.clone()
            };
            let err = run(&config, |_| {}).unwrap_err().to_string();
            assert!(err.contains("--compute-over-io"), "{err}");
        }
    }
}
