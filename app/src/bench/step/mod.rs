//! `strata bench step`: training steps of a MoE stack whose experts live on
//! SSD, with the expert-wise schedule and the naive one, against two
//! bounds measured in the same run: compute only (every expert resident)
//! and I/O only (the same tier traffic, no expert GEMMs).

use std::path::PathBuf;
use std::sync::Arc;

use strata_tiers::{Dtype, Timeline};

use strata::backend::BackendKind;
use strata::engine::{
    host_cell_slot_count, host_memory_available, Engine, EngineConfig, ExpertCompute,
    HostMemoryPlan, ScheduleKind, MIN_HOST_STREAM_SLOTS,
};
use strata::math::ExpertKind;
use strata::model::ModelConfig;
use strata::EngineError;

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
    /// The expert-wise runs' host slots split into compute cells
    /// (`EngineConfig::host_cell_slots`); by default [`BENCH_CELL_SLOTS`].
    pub host_cell_slots: usize,
    /// Where records are kept, the last layer's other updates wait for
    /// the next step's forward (`EngineConfig::defer_last_layer_updates`).
    pub defer_updates: bool,
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
    /// Draw every run's last timed step into this figure (.png or .svg).
    pub plot: Option<PathBuf>,
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
            host_cell_slots: BENCH_CELL_SLOTS,
            defer_updates: EngineConfig::default().defer_last_layer_updates,
            backend: BackendKind::Cpu,
            modeled_device_flops: None,
            timeline_dir: None,
            plot: None,
        }
    }
}

/// The bench's split of its host tier's record slots: 5 streaming, the
/// others (2 at the defaults, with one of the 8 slots split into compute
/// cells) keeping a record. With expert compute that leaves the
/// cores free (a GPU's, or `--modeled-device-gflops`), the fifth streaming
/// slot lets the prefetcher run further ahead in the backward, where the
/// next layer's records otherwise wait for the last ones to leave; see
/// docs/performance.md, "A modeled device".
pub const BENCH_STREAM_SLOTS: usize = 5;

/// The bench's host slots split into compute cells
/// (`EngineConfig::host_cell_slots`): one, which leaves 7 record slots at
/// the defaults (2 keeping a record, 5 streaming) and 6 cells. With expert
/// compute off the cores, the record slots then carry the next layer's
/// full records while the last ones compute; see docs/performance.md,
/// "Compute cells".
pub const BENCH_CELL_SLOTS: usize = 1;

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
        // The engine refuses a rate that is not a positive number.
        Some(rate) => ExpertCompute::Modeled { flops_per_s: rate },
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
        host_cell_slots: config.host_cell_slots,
        defer_last_layer_updates: config.defer_updates,
        backend: config.backend,
        expert_compute,
        ..EngineConfig::default()
    };
    check_host_cells(config, &base, host_slots as usize, all as usize)?;
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

/// The engine's refusal of too few record slots beside the compute cells,
/// in the bench's own terms: the flags that set them, and the host share
/// that would do.
fn check_host_cells(
    config: &StepBenchConfig,
    expert_wise: &EngineConfig,
    host_slots: usize,
    records: usize,
) -> Result<(), EngineError> {
    let cells = host_cell_slot_count(expert_wise, host_slots, records);
    let left = host_slots.saturating_sub(cells);
    if cells == 0 || left >= MIN_HOST_STREAM_SLOTS {
        return Ok(());
    }
    // At 1 every record is resident, and no slot is split into cells.
    let fraction = ((MIN_HOST_STREAM_SLOTS + cells) as f64 / records as f64).min(1.0);
    Err(EngineError::Config(format!(
        "--host-fraction {} of the {records} expert records gives {host_slots} host slots, and \
         --host-cell-slots {cells} leaves {left} of them for records, where at least \
         {MIN_HOST_STREAM_SLOTS} must hold records to stream them: raise --host-fraction to \
         {:.2} or more, or give --host-cell-slots 0",
        config.host_fraction,
        (fraction * 100.0).ceil() / 100.0
    )))
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
    if let Some(available) = host_memory_available().filter(|a| need > a.bytes) {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        return Err(EngineError::Config(format!(
            "bench step keeps its {} runs' engines at once, {:.2} GiB of host memory in all \
             ({}), but {available}: lower --d-model, --d-ff, \
             --experts, --layers or --host-fraction",
            runs.len(),
            gib(need),
            runs.iter()
                .zip(&plans)
                .map(|((name, _), p)| format!("{name} {:.2} GiB", gib(p.total())))
                .collect::<Vec<_>>()
                .join(", "),
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
    if let Some(path) = &config.plot {
        let runs: Vec<(&str, &[_])> = arms.iter().map(|a| (a.name, a.last_trace())).collect();
        let title = format!(
            "bench step: the last timed step of each run, {} tokens, {} layers × {} experts",
            config.tokens, config.model.layers, config.model.experts
        );
        crate::plot::plot_timelines(&runs, &title, path, (1600, 300 + 260 * runs.len() as u32))
            .map_err(EngineError::Config)?;
        progress(&format!(
            "the runs' last timed steps drawn in {}",
            path.display()
        ));
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
        compute_threads: strata::compute_threads(),
        machine_cores: strata::machine_cores(),
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
mod tests;
