//! `strata bench step`: training steps of a MoE stack whose experts live on
//! SSD, with the expert-wise schedule and the naive one, against two
//! bounds measured in the same run: compute only (every expert resident)
//! and I/O only (the same tier traffic, no expert GEMMs).

use std::path::PathBuf;
use std::sync::Arc;

use strata_tiers::{Dtype, Timeline};

use crate::backend::BackendKind;
use crate::engine::{
    available_host_memory, Engine, EngineConfig, ExpertCompute, HostMemoryPlan, ScheduleKind,
};
use crate::math::ExpertKind;
use crate::model::ModelConfig;
use crate::EngineError;

mod arm;
mod balance;
mod phases;
mod record;

use arm::Arm;
pub use balance::Balance;
pub use phases::StepPhases;
pub use record::{StepBenchRecord, StepBenchSummary};

#[derive(Clone, Debug)]
pub struct StepBenchConfig {
    pub model: ModelConfig,
    /// Tokens per step; with `balance_tokens`, where the search starts.
    pub tokens: usize,
    /// Run at the tokens per step where compute-only and I/O-only steps
    /// take as long (found by timing both first; see `balance.rs`).
    pub balance_tokens: bool,
    /// Experts that fit on the device at once.
    pub device_experts: u64,
    /// Share of all experts' records that fit in host memory.
    pub host_fraction: f64,
    /// Timed steps per configuration per round.
    pub steps: usize,
    /// Untimed steps per configuration at the start of each round.
    pub warmup_steps: usize,
    /// Rounds in which the configurations take turns.
    pub rounds: usize,
    pub compute_dtype: Dtype,
    pub dir: PathBuf,
    pub optimizer_threads: usize,
    /// Device workers, each with `device_experts` slots.
    pub devices: usize,
    pub pin_fraction: f64,
    /// The expert-wise runs' streaming host slots (`None`: all stream).
    /// The default, [`BENCH_STREAM_SLOTS`], is one more than the engine's.
    pub host_stream_slots: Option<usize>,
    /// Where records are kept, the last layer's other updates wait for
    /// the next step's forward (`EngineConfig::defer_last_layer_updates`).
    pub defer_updates: bool,
    /// The share of each other layer's experts whose updates wait too
    /// (`EngineConfig::deferred_update_share`); by default
    /// [`BENCH_DEFERRED_SHARE`], where the engine's is 0.
    pub deferred_update_share: f64,
    pub backend: BackendKind,
    /// Model the device instead of computing on `backend` (cpu only): the
    /// expert-wise, naive and compute-only runs skip the expert GEMMs and
    /// hold the device's thread, asleep, for the time a device at this many
    /// FLOP/s takes ([`ExpertCompute::Modeled`]). On a machine without an
    /// accelerator this shows what the schedule's overlap gives where
    /// compute does not take the cores the I/O and the optimizer use.
    /// `None`: the experts are computed.
    pub modeled_device_flops: Option<f64>,
    /// Where to write each run's last timed step as a Chrome trace
    /// (`<run>.json`); `None`: not written. Every run records its steps'
    /// timelines either way, for the records' `phases`.
    pub timeline_dir: Option<PathBuf>,
}

impl Default for StepBenchConfig {
    fn default() -> Self {
        Self {
            model: ModelConfig {
                layers: 4,
                d_model: 512,
                d_ff: 1024,
                experts: 8,
                top_k: 2,
                renormalize: true,
                expert_kind: ExpertKind::SwiGlu,
                classes: 256,
                ..ModelConfig::default()
            },
            tokens: 1024,
            balance_tokens: true,
            device_experts: 2,
            host_fraction: 0.25,
            steps: 2,
            warmup_steps: 1,
            rounds: 3,
            compute_dtype: Dtype::Bf16,
            dir: std::env::temp_dir(),
            optimizer_threads: 1,
            devices: 1,
            pin_fraction: 0.25,
            host_stream_slots: Some(BENCH_STREAM_SLOTS),
            defer_updates: EngineConfig::default().defer_last_layer_updates,
            deferred_update_share: BENCH_DEFERRED_SHARE,
            backend: BackendKind::Cpu,
            modeled_device_flops: None,
            timeline_dir: None,
        }
    }
}

/// The bench's split of its host tier (8 slots at the defaults): 5
/// streaming, 3 keeping a record. With expert compute that leaves the
/// cores free (a GPU's, or `--modeled-device-gflops`), the fifth streaming
/// slot lets the prefetcher run further ahead in the backward, where the
/// next layer's records otherwise wait for the last ones to leave; see
/// docs/performance.md, "A modeled device".
pub const BENCH_STREAM_SLOTS: usize = 5;

/// The bench's share of each layer's updates held for the next forward
/// (`EngineConfig::deferred_update_share`): a quarter (2 of 8 experts a
/// layer), which moves that much of the backward's disk work into the
/// forward; the forward is about a third of the compute.
pub const BENCH_DEFERRED_SHARE: f64 = 0.25;

/// Events a run's timeline keeps between two steps: a step of the default
/// stack records a few hundred (SSD calls, waits, expert loops, updates).
const TIMELINE_EVENTS: usize = 1 << 14;

fn record_bytes(model: &ModelConfig, dtype: Dtype) -> u64 {
    let n = model.expert_params() as u64;
    (n * dtype.bytes() + 64).div_ceil(4096) * 4096 + (12 * n + 64).div_ceil(4096) * 4096
}

/// Runs the four configurations in `rounds` interleaved rounds and returns
/// their records (medians over every round's timed steps) and the summary.
///
/// The four engines live side by side for the whole bench. In each round
/// every configuration in turn (the order rotates a place each round) runs
/// one warm-up step and `steps` timed ones, then waits for its updates in
/// flight, untimed: a slow spell of the (shared) machine then falls on
/// every configuration alike instead of on whichever ran then. Steps are
/// not interleaved one by one: an engine's work spills past its step on
/// purpose (its last updates overlap the next step's forward, its
/// prefetcher loads the next step's first experts), so an interleaved
/// neighbour would be charged for it; the warm-up step of each turn absorbs
/// the loss of that overlap after a switch.
pub fn run(
    config: &StepBenchConfig,
    mut progress: impl FnMut(&str),
) -> Result<(Vec<StepBenchRecord>, StepBenchSummary), EngineError> {
    config.model.validate()?;
    if config.steps == 0 || config.tokens == 0 || config.rounds == 0 {
        return Err(EngineError::Config(
            "--steps, --rounds and --tokens must be at least 1".into(),
        ));
    }
    let expert_compute = match config.modeled_device_flops {
        None => ExpertCompute::Run,
        Some(_) if config.backend != BackendKind::Cpu => {
            return Err(EngineError::Config(
                "a modeled device stands in for the backend's expert compute: leave out \
                 --backend (cpu) or the modeled device's rate"
                    .into(),
            ))
        }
        Some(rate) if rate.is_finite() && rate > 0.0 => {
            ExpertCompute::Modeled { flops_per_s: rate }
        }
        Some(rate) => {
            return Err(EngineError::Config(format!(
                "the modeled device's rate must be a positive number of FLOP/s, not {rate}"
            )))
        }
    };
    let model = &config.model;
    let all = (model.layers * model.experts) as u64;
    let expert_bytes = model.expert_params() as u64 * config.compute_dtype.bytes();
    let record = record_bytes(model, config.compute_dtype);
    let host_slots = ((all as f64 * config.host_fraction).floor() as u64).max(2);
    let base = EngineConfig {
        device_budget_bytes: config.device_experts * expert_bytes,
        host_budget_bytes: host_slots * record,
        compute_dtype: config.compute_dtype,
        optimizer_threads: config.optimizer_threads,
        devices: config.devices,
        pin_fraction: config.pin_fraction,
        host_stream_slots: config.host_stream_slots,
        defer_last_layer_updates: config.defer_updates,
        deferred_update_share: config.deferred_update_share,
        backend: config.backend,
        expert_compute,
        ..EngineConfig::default()
    };
    // One scratch directory for the store files (and their dense-state
    // files), removed whole at the end. A run that was killed left its
    // own (gigabytes) behind: those of processes no longer alive go first.
    for stale in remove_stale_scratch(&config.dir) {
        progress(&format!(
            "removed {}, left by a run that was killed",
            stale.display()
        ));
    }
    let scratch = config
        .dir
        .join(format!("strata-bench-step-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)
        .map_err(|e| EngineError::Config(format!("{}: {e}", scratch.display())))?;
    let store = |name: &str| Some(scratch.join(format!("{name}.store")));
    let runs: Vec<(&'static str, EngineConfig)> = vec![
        (
            "expert_wise",
            EngineConfig {
                store_path: store("ew"),
                ..base.clone()
            },
        ),
        (
            "naive",
            EngineConfig {
                store_path: store("naive"),
                schedule: ScheduleKind::Naive,
                ..base.clone()
            },
        ),
        (
            "compute_only",
            EngineConfig {
                device_budget_bytes: all * expert_bytes,
                host_budget_bytes: all * record,
                ..base.clone()
            },
        ),
        (
            "io_only",
            EngineConfig {
                store_path: store("io"),
                expert_compute: ExpertCompute::Skip,
                ..base
            },
        ),
    ];
    let result = run_rounds(config, runs, &mut progress);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

/// Removes `strata-bench-step-<pid>` directories under `dir` whose
/// process is gone (Linux: no /proc/<pid>); returns them.
fn remove_stale_scratch(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    if !std::path::Path::new("/proc/self").exists() {
        return Vec::new(); // no way to tell a live run from a dead one
    }
    entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let pid: u32 = name
                .to_str()?
                .strip_prefix("strata-bench-step-")?
                .parse()
                .ok()?;
            let alive = std::path::Path::new(&format!("/proc/{pid}")).exists();
            let path = entry.path();
            (!alive && path.is_dir() && std::fs::remove_dir_all(&path).is_ok()).then_some(path)
        })
        .collect()
}

fn run_rounds(
    config: &StepBenchConfig,
    runs: Vec<(&'static str, EngineConfig)>,
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<StepBenchRecord>, StepBenchSummary), EngineError> {
    // The four runs' engines live side by side (they take turns each
    // round), so their host memory adds up.
    let plans: Vec<HostMemoryPlan> = runs
        .iter()
        .map(|(_, c)| HostMemoryPlan::of(&Engine::layout(&config.model, c), c))
        .collect();
    let need: u64 = plans.iter().map(HostMemoryPlan::total).sum();
    if let Some(available) = available_host_memory().filter(|&a| need > a) {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        return Err(EngineError::Config(format!(
            "bench step keeps its {} runs' engines at once, {:.2} GiB of host memory in all \
             ({}), but this machine has {:.2} GiB available: lower --d-model, --d-ff, \
             --experts, --layers or --host-fraction",
            runs.len(),
            gib(need),
            runs.iter()
                .zip(&plans)
                .map(|((name, _), p)| format!("{name} {:.2} GiB", gib(p.total())))
                .collect::<Vec<_>>()
                .join(", "),
            gib(available),
        )));
    }
    let mut arms = Vec::new();
    for (name, mut engine_config) in runs {
        let timeline = Arc::new(Timeline::new(TIMELINE_EVENTS));
        engine_config.timeline = Some(Arc::clone(&timeline));
        let engine = Engine::new(config.model.clone(), engine_config)?;
        for note in engine.notes() {
            progress(&format!("{name}: note: {note}"));
        }
        arms.push(Arm::new(name, engine, Some(timeline)));
    }
    let balance = if config.balance_tokens {
        let [.., compute_only, io_only] = &mut arms[..] else {
            unreachable!("four runs")
        };
        debug_assert_eq!(
            (compute_only.name, io_only.name),
            ("compute_only", "io_only")
        );
        Some(balance::find(config, compute_only, io_only, progress)?)
    } else {
        None
    };
    let config = &StepBenchConfig {
        tokens: balance.as_ref().map_or(config.tokens, |b| b.tokens),
        balance_tokens: false,
        ..config.clone()
    };
    let n = arms.len();
    let mut by_round = Vec::new();
    for round in 0..config.rounds {
        progress(&format!("round {} of {}", round + 1, config.rounds));
        let from = round * config.steps;
        for i in 0..n {
            arms[(round + i) % n].round(config, config.warmup_steps, config.steps, progress)?;
        }
        let step = |run: &str| {
            arms.iter()
                .find(|a| a.name == run)
                .expect("ran")
                .median_since(from)
        };
        by_round.push(ratios(step));
    }
    if let Some(dir) = &config.timeline_dir {
        for arm in &arms {
            let path = dir.join(format!("{}.json", arm.name));
            strata_tiers::timeline::write_chrome_trace_file(arm.last_trace(), &path).map_err(
                |e| EngineError::Config(format!("writing the timeline {}: {e}", path.display())),
            )?;
            progress(&format!(
                "{}: last timed step's timeline in {}",
                arm.name,
                path.display()
            ));
        }
    }
    let records: Vec<StepBenchRecord> = arms.iter().map(|a| a.record(config)).collect();
    let (expert_wise_over_naive, expert_wise_over_bound) =
        ratios(|run: &str| records.iter().find(|r| r.run == run).expect("ran").step_s);
    let quiet = records.iter().all(|r| r.quiet_step_s.is_some()).then(|| {
        ratios(|run: &str| {
            records
                .iter()
                .find(|r| r.run == run)
                .and_then(|r| r.quiet_step_s)
                .expect("every run has quiet steps")
        })
    });
    let summary = StepBenchSummary {
        bench: "step",
        run: "summary",
        rounds: config.rounds,
        tokens: config.tokens,
        modeled_device_gflop_per_s: config.modeled_device_flops.map(|r| r / 1e9),
        balance,
        expert_wise_over_naive,
        expert_wise_over_bound,
        expert_wise_over_naive_by_round: by_round.iter().map(|r| r.0).collect(),
        expert_wise_over_bound_by_round: by_round.iter().map(|r| r.1).collect(),
        quiet_expert_wise_over_naive: quiet.map(|q| q.0),
        quiet_expert_wise_over_bound: quiet.map(|q| q.1),
    };
    Ok((records, summary))
}

/// (naive ÷ expert-wise, expert-wise ÷ max(compute only, I/O only)) step
/// times.
fn ratios(step: impl Fn(&str) -> f64) -> (f64, f64) {
    (
        step("naive") / step("expert_wise"),
        step("expert_wise") / step("compute_only").max(step("io_only")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ModelConfig {
        ModelConfig {
            layers: 2,
            d_model: 16,
            d_ff: 32,
            experts: 8,
            classes: 8,
            ..ModelConfig::default()
        }
    }

    /// A shape whose four engines could not fit in any machine's memory is
    /// refused before anything is allocated or written.
    #[test]
    fn a_stack_too_big_for_host_memory_is_refused_up_front() {
        if available_host_memory().is_none() {
            return eprintln!("skipped: this OS does not say how much memory is available");
        }
        let dir = tempfile::tempdir().unwrap();
        let config = StepBenchConfig {
            model: ModelConfig {
                d_model: 1 << 16,
                d_ff: 1 << 16, // 12.9 G params an expert
                ..tiny()
            },
            tokens: 32,
            balance_tokens: false,
            dir: dir.path().to_path_buf(),
            ..StepBenchConfig::default()
        };
        let err = run(&config, |_| {}).unwrap_err().to_string();
        assert!(
            err.contains("bench step keeps its 4 runs' engines at once"),
            "{err}"
        );
        assert!(err.contains("lower --d-model"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn scratch_left_by_a_dead_run_is_removed_and_a_live_ones_kept() {
        if !std::path::Path::new("/proc/self").exists() {
            return eprintln!("skipped: no /proc to tell live processes from dead ones");
        }
        let dir = tempfile::tempdir().unwrap();
        let dead = (4_000_000u32..)
            .find(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
            .unwrap();
        let named = |name: String| {
            let path = dir.path().join(name);
            std::fs::create_dir(&path).unwrap();
            std::fs::write(path.join("ew.store"), b"records").unwrap();
            path
        };
        let stale = named(format!("strata-bench-step-{dead}"));
        let live = named(format!("strata-bench-step-{}", std::process::id()));
        let other = named("strata-bench-step-notes".to_string());
        assert_eq!(remove_stale_scratch(dir.path()), vec![stale.clone()]);
        assert!(!stale.exists() && live.exists() && other.exists());
        assert!(remove_stale_scratch(dir.path()).is_empty());
    }

    #[test]
    fn a_tiny_stack_runs_every_configuration() {
        let dir = tempfile::tempdir().unwrap();
        let config = StepBenchConfig {
            model: tiny(),
            tokens: 32,
            balance_tokens: false,
            steps: 2,
            rounds: 2,
            dir: dir.path().to_path_buf(),
            ..StepBenchConfig::default()
        };
        let (records, summary) = run(&config, |_| {}).unwrap();
        let runs: Vec<_> = records.iter().map(|r| r.run).collect();
        assert_eq!(runs, ["expert_wise", "naive", "compute_only", "io_only"]);
        assert!(records.iter().all(|r| r.tokens_per_s > 0.0));
        // The SSD runs move records between host and SSD; compute-only does not.
        assert!(records[0].bytes_ssd_to_host > 0);
        assert_eq!(records[2].bytes_ssd_to_host, 0);
        // ...so their SSD is busy a while each step; compute-only's never is.
        for r in [&records[0], &records[1], &records[3]] {
            assert!(r.ssd_busy_s > 0.0, "{}", r.run);
        }
        assert_eq!(records[2].ssd_busy_s, 0.0);
        assert!(summary.expert_wise_over_naive > 0.0);
        assert_eq!(summary.rounds, 2);
        assert_eq!(summary.expert_wise_over_naive_by_round.len(), 2);
        assert!(records.iter().all(|r| r.steps == 4 && r.quiet_steps <= 4));
        assert_eq!(
            summary.quiet_expert_wise_over_naive.is_some(),
            records.iter().all(|r| r.quiet_steps > 0)
        );
        if cfg!(target_os = "linux") {
            assert!(records.iter().all(|r| r.steal_s.is_some_and(|s| s >= 0.0)));
        }
        let mut noisy = records[0].clone();
        (noisy.steal_s, noisy.step_s) = (Some(1.5), 1.5);
        assert_eq!(noisy.steal_share(2.0), Some(0.5));
        noisy.steal_s = None;
        assert_eq!(noisy.steal_share(2.0), None);
        // Every run computes something on this thread, so it uses CPU time.
        assert!(records.iter().all(|r| r.cpu_s.is_some_and(|c| c > 0.0)));
        if cfg!(target_os = "linux") {
            assert!(records
                .iter()
                .all(|r| r.page_faults.is_some_and(|f| f >= 0.0)));
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        assert!(records
            .iter()
            .all(|r| r.devices == 1 && r.device_load_gap == 0.0));
    }

    /// A modeled device: every run but the I/O-only one sleeps its expert
    /// compute, which the records and the summary say; it stands in for the
    /// cpu backend only, and its rate must be a positive number.
    #[test]
    fn a_modeled_device_is_labeled_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let config = StepBenchConfig {
            model: tiny(),
            tokens: 32,
            balance_tokens: false,
            steps: 1,
            rounds: 1,
            modeled_device_flops: Some(1e9),
            dir: dir.path().to_path_buf(),
            ..StepBenchConfig::default()
        };
        let (records, summary) = run(&config, |_| {}).unwrap();
        let labels: Vec<_> = records.iter().map(|r| r.expert_compute).collect();
        assert_eq!(labels, ["modeled", "modeled", "modeled", "skipped"]);
        assert_eq!(summary.modeled_device_gflop_per_s, Some(1.0));
        // 6 FLOPs an expert parameter an assignment, over both layers, at
        // 1 GFLOP/s.
        let model = tiny();
        let slept = (6 * 32 * model.top_k * model.expert_params() * model.layers) as f64 / 1e9;
        assert!(records[2].compute_s >= slept, "{} s", records[2].compute_s);
        for (rate, backend, expected) in [
            (0.0, BackendKind::Cpu, "must be a positive number of FLOP/s"),
            (1e9, BackendKind::Cuda, "leave out --backend (cpu)"),
        ] {
            let config = StepBenchConfig {
                modeled_device_flops: Some(rate),
                backend,
                ..config.clone()
            };
            let err = run(&config, |_| {}).unwrap_err().to_string();
            assert!(err.contains(expected), "{err}");
        }
        let (records, summary) = run(
            &StepBenchConfig {
                modeled_device_flops: None,
                ..config
            },
            |_| {},
        )
        .unwrap();
        let labels: Vec<_> = records.iter().map(|r| r.expert_compute).collect();
        assert_eq!(labels, ["computed", "computed", "computed", "skipped"]);
        assert_eq!(summary.modeled_device_gflop_per_s, None);
    }

    /// Half the records in host memory and the engine's split: 4 of 8
    /// slots keep the last layer's experts 0–3, and its other 4 defer their
    /// updates unless told not to,
    /// in the expert-wise and I/O-only runs alike (the naive one keeps
    /// nothing).
    #[test]
    fn deferred_updates_follow_the_config() {
        let dir = tempfile::tempdir().unwrap();
        for (defer, expected) in [(true, 4), (false, 0)] {
            let config = StepBenchConfig {
                model: tiny(),
                tokens: 32,
                balance_tokens: false,
                host_fraction: 0.5,
                steps: 1,
                rounds: 1,
                host_stream_slots: Some(4),
                deferred_update_share: 0.0,
                defer_updates: defer,
                dir: dir.path().to_path_buf(),
                ..StepBenchConfig::default()
            };
            let (records, _) = run(&config, |_| {}).unwrap();
            let deferred: Vec<_> = records.iter().map(|r| r.deferred_updates).collect();
            assert_eq!(deferred, [expected, 0, 0, expected], "defer {defer}");
            assert_eq!(records[0].host_kept, 4);
        }
        // The bench's own split: 5 streaming slots, so 3 kept; the last
        // layer's other 5 held, and a quarter (2) of layer 0's.
        let config = StepBenchConfig {
            model: tiny(),
            tokens: 32,
            balance_tokens: false,
            host_fraction: 0.5,
            steps: 1,
            rounds: 1,
            dir: dir.path().to_path_buf(),
            ..StepBenchConfig::default()
        };
        let (records, _) = run(&config, |_| {}).unwrap();
        let deferred: Vec<_> = records.iter().map(|r| r.deferred_updates).collect();
        assert_eq!(deferred, [7, 0, 0, 7]);
        assert_eq!(records[0].host_kept, 3);
    }

    /// With `--backend cuda`, wherever a CUDA device answers (a GPU, or
    /// the CPU model of one in CI): every configuration runs, on the GPUs.
    #[cfg(feature = "cuda")]
    #[test]
    fn a_tiny_stack_runs_every_configuration_on_gpus() {
        if let Err(e) = BackendKind::Cuda.check(2, Dtype::Bf16) {
            eprintln!("cuda case skipped: {e}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        for devices in [1, 2] {
            let config = StepBenchConfig {
                model: tiny(),
                tokens: 64,
                balance_tokens: false,
                steps: 2,
                devices,
                device_experts: 4,
                backend: BackendKind::Cuda,
                dir: dir.path().to_path_buf(),
                ..StepBenchConfig::default()
            };
            let (records, summary) = run(&config, |_| {}).unwrap();
            assert!(records
                .iter()
                .all(|r| r.backend == "cuda" && r.devices == devices && r.tokens_per_s > 0.0));
            assert!(summary.expert_wise_over_naive > 0.0);
            eprintln!("cuda case: bench step on {devices} GPU(s) ran every configuration");
        }
    }

    #[test]
    fn balanced_tokens_are_found_first_and_every_run_uses_them() {
        let dir = tempfile::tempdir().unwrap();
        let config = StepBenchConfig {
            model: tiny(),
            tokens: 32,
            steps: 1,
            rounds: 1,
            dir: dir.path().to_path_buf(),
            ..StepBenchConfig::default()
        };
        assert!(config.balance_tokens, "the default balances");
        let mut lines = Vec::new();
        let (records, summary) = run(&config, |l| lines.push(l.to_string())).unwrap();
        let balance = summary.balance.expect("balanced");
        assert_eq!(summary.tokens, balance.tokens);
        assert!(records.iter().all(|r| r.tokens == balance.tokens));
        assert!(balance.tokens % balance::TOKENS_GRAIN == 0);
        assert!((16..=32 * balance::SEARCH_FACTOR_MAX).contains(&balance.tokens));
        assert!(balance.io_only_s > 0.0);
        let (first, _) = balance.compute_only_s[0];
        assert_eq!(first, 32, "the search starts at the given count");
        // Each count tried is twice or half the one before it.
        for pair in balance.compute_only_s.windows(2) {
            let (a, b) = (pair[0].0, pair[1].0);
            assert!(b == 2 * a || 2 * b == a, "{a} then {b}");
        }
        // Both runs were timed at every count tried.
        let counts = |v: &[(usize, f64)]| v.iter().map(|p| p.0).collect::<Vec<_>>();
        assert_eq!(counts(&balance.compute_only_s), counts(&balance.io_only_at));
        if balance.unbracketed.is_none() {
            let excess = balance
                .compute_only_s
                .iter()
                .zip(&balance.io_only_at)
                .map(|(c, io)| c.1 - io.1);
            let below = excess.clone().any(|e| e <= 0.0);
            let above = excess.clone().any(|e| e > 0.0);
            assert!(below && above, "{balance:?}");
            // The I/O-only step at the balance lies between those timed.
            let ios = balance.io_only_at.iter().map(|p| p.1);
            let (lo, hi) = ios.fold((f64::MAX, 0.0f64), |(a, b), s| (a.min(s), b.max(s)));
            assert!((lo..=hi).contains(&balance.io_only_s), "{balance:?}");
        }
        assert!(lines.iter().any(|l| l.starts_with("balance: ")));
        // The probes are not counted as the runs' timed steps.
        assert!(records.iter().all(|r| r.steps == 1));
    }

    #[test]
    fn several_devices_run_every_configuration() {
        let dir = tempfile::tempdir().unwrap();
        let config = StepBenchConfig {
            model: tiny(),
            tokens: 64,
            balance_tokens: false,
            steps: 2,
            devices: 2,
            device_experts: 4,
            dir: dir.path().to_path_buf(),
            ..StepBenchConfig::default()
        };
        let (records, _) = run(&config, |_| {}).unwrap();
        assert!(records
            .iter()
            .all(|r| r.devices == 2 && r.tokens_per_s > 0.0 && !r.device_load_gap.is_nan()));
    }
}
