//! One configuration of `strata bench step` (an arm): its engine, its
//! timed steps, and what each cost the machine.

use std::sync::Arc;

use strata_tiers::{Timeline, TimelineEvent};

use super::phases::StepPhases;
use super::{StepBenchConfig, StepBenchRecord};
use crate::bench::{process_usage, stolen_cpu_s, Timing};
use strata::backend::BackendKind;
use strata::engine::{Engine, ExpertCompute, StepMetrics};
use strata::model::{fill_uniform, Batch, ModelConfig};
use strata::EngineError;

fn batch(model: &ModelConfig, tokens: usize, step: usize) -> Batch {
    let mut inputs = vec![0.0f32; tokens * model.d_model];
    fill_uniform(&mut inputs, 77 + step as u64, 5, 1.0);
    let targets = (0..tokens)
        .map(|i| (i * 31 % model.classes) as u32)
        .collect();
    Batch { inputs, targets }
}

/// A step that lost more than this share of the machine's CPU time (cores
/// × wall time) to steal is left out of the summary's quiet ratios. Where
/// the steal is the run's own I/O (see `StepBenchRecord::steal_s`), the
/// expert-wise run has few quiet steps however quiet the neighbours are.
const QUIET_STEAL_SHARE: f64 = 0.05;

/// Whether a step of `wall_s` that lost `steal_s` CPU seconds on `cores`
/// counts as quiet (every step does where steal is not reported).
fn is_quiet(steal_s: Option<f64>, wall_s: f64, cores: f64) -> bool {
    steal_s.is_none_or(|s| s <= QUIET_STEAL_SHARE * cores * wall_s)
}

/// One configuration under test: its engine, alive for the whole bench,
/// and its timed steps so far.
pub(super) struct Arm {
    pub(super) name: &'static str,
    engine: Engine,
    steps_done: usize,
    metrics: Vec<StepMetrics>,
    /// CPU seconds the hypervisor took from this machine during each timed
    /// step (where the OS reports it).
    steal: Vec<Option<f64>>,
    /// CPU seconds this process used during each timed step.
    cpu: Vec<Option<f64>>,
    /// Minor page faults this process took during each timed step.
    faults: Vec<Option<f64>>,
    /// What the engine records its steps on (`EngineConfig::timeline`).
    timeline: Option<Arc<Timeline>>,
    /// Each timed step's phases, from its timeline.
    phases: Vec<StepPhases>,
    /// The last timed step's timeline.
    last_trace: Vec<TimelineEvent>,
}

impl Arm {
    /// `timeline`: the one `engine` was configured with, if any.
    pub(super) fn new(name: &'static str, engine: Engine, timeline: Option<Arc<Timeline>>) -> Self {
        Self {
            name,
            engine,
            steps_done: 0,
            metrics: Vec::new(),
            steal: Vec::new(),
            cpu: Vec::new(),
            faults: Vec::new(),
            timeline,
            phases: Vec::new(),
            last_trace: Vec::new(),
        }
    }

    /// The last timed step's timeline (empty without one).
    pub(super) fn last_trace(&self) -> &[TimelineEvent] {
        &self.last_trace
    }

    /// One engine step on this arm's next batch of `tokens`.
    fn next_step(
        &mut self,
        model: &ModelConfig,
        tokens: usize,
    ) -> Result<StepMetrics, EngineError> {
        let m = self.engine.step(&batch(model, tokens, self.steps_done))?;
        self.steps_done += 1;
        Ok(m)
    }

    /// Runs `warmup` untimed steps and `timed` timed ones, then waits for
    /// every update in flight (untimed), so the next arm starts on a quiet
    /// machine.
    pub(super) fn round(
        &mut self,
        config: &StepBenchConfig,
        warmup: usize,
        timed: usize,
        progress: &mut dyn FnMut(&str),
    ) -> Result<(), EngineError> {
        for i in 0..warmup + timed {
            if let Some(timeline) = &self.timeline {
                timeline.take(); // this step's events start now
            }
            let stolen_before = stolen_cpu_s();
            let usage_before = process_usage();
            let m = self.next_step(&config.model, config.tokens)?;
            progress(&format!(
                "{} step {}{}: {:.2} s, loss {:.4}",
                self.name,
                self.steps_done,
                if i < warmup { " (warm-up)" } else { "" },
                m.wall_s,
                m.loss
            ));
            if i >= warmup {
                if let Some(timeline) = &self.timeline {
                    let events = timeline.take().events;
                    self.phases.extend(StepPhases::of(&events));
                    self.last_trace = events;
                }
                self.metrics.push(m);
                self.steal
                    .push(stolen_before.zip(stolen_cpu_s()).map(|(a, b)| b - a));
                let used = usage_before.zip(process_usage());
                self.cpu.push(used.map(|(a, b)| b.0 - a.0));
                self.faults.push(used.map(|(a, b)| b.1 - a.1));
            }
        }
        self.engine.drain()
    }

    /// One untimed step and two timed ones at `tokens`, left out of the
    /// arm's records; returns the shorter timed step's wall time, once
    /// every update in flight is done.
    pub(super) fn probe(
        &mut self,
        config: &StepBenchConfig,
        tokens: usize,
        progress: &mut dyn FnMut(&str),
    ) -> Result<f64, EngineError> {
        let mut shortest = f64::INFINITY;
        for i in 0..3 {
            let m = self.next_step(&config.model, tokens)?;
            progress(&format!(
                "{} probe at {tokens} tokens{}: {:.2} s",
                self.name,
                if i == 0 { " (warm-up)" } else { "" },
                m.wall_s
            ));
            if i > 0 {
                shortest = shortest.min(m.wall_s);
            }
        }
        self.engine.drain()?;
        Ok(shortest)
    }

    pub(super) fn record(&self, config: &StepBenchConfig) -> StepBenchRecord {
        let model = &config.model;
        let metrics = &self.metrics;
        let quiet = self.quiet_walls();
        let timing = Timing::of(
            &metrics
                .iter()
                .map(|m| std::time::Duration::from_secs_f64(m.wall_s))
                .collect::<Vec<_>>(),
        );
        let mean =
            |f: fn(&StepMetrics) -> f64| metrics.iter().map(f).sum::<f64>() / metrics.len() as f64;
        let sum =
            |f: fn(&StepMetrics) -> u64| metrics.iter().map(f).sum::<u64>() / metrics.len() as u64;
        StepBenchRecord {
            bench: "step",
            run: self.name,
            layers: model.layers,
            experts: model.experts,
            d_model: model.d_model,
            d_ff: model.d_ff,
            top_k: model.top_k,
            tokens: config.tokens,
            devices: self.engine.devices(),
            backend: match config.backend {
                BackendKind::Cpu => "cpu",
                BackendKind::Cuda => "cuda",
            },
            expert_compute: match self.engine.config().expert_compute {
                ExpertCompute::Run => "computed",
                ExpertCompute::Skip => "skipped",
                ExpertCompute::Modeled { .. } => "modeled",
            },
            host_slots: self.engine.host_slots(),
            host_kept: self.engine.host_kept(),
            host_cells: self.engine.host_cells(),
            host_demotions: mean(|m| m.host_demotions as f64),
            deferred_updates: self.engine.deferred_updates(),
            device_slots: self.engine.device_slots(),
            steps: metrics.len(),
            step_s: timing.median_s,
            min_step_s: timing.min_s,
            tokens_per_s: config.tokens as f64 / timing.median_s,
            compute_s: mean(|m| m.compute_s),
            stall_upload_s: mean(|m| m.stall_upload_s),
            stall_ssd_s: mean(|m| m.stall_ssd_s),
            stall_optimizer_s: mean(|m| m.stall_optimizer_s),
            ssd_busy_s: mean(|m| m.ssd_busy_s),
            bytes_ssd_to_host: sum(|m| m.bytes_ssd_to_host),
            bytes_host_to_ssd: sum(|m| m.bytes_host_to_ssd),
            bytes_ssd_min: sum(|m| m.bytes_ssd_min),
            host_hit_rate: mean(|m| m.host_hit_rate),
            device_hit_rate: mean(|m| m.device_hit_rate),
            device_load_gap: mean(|m| m.device_load_gap()),
            steal_s: mean_of(&self.steal),
            cpu_s: mean_of(&self.cpu),
            page_faults: mean_of(&self.faults),
            quiet_steps: quiet.len(),
            quiet_step_s: (!quiet.is_empty()).then(|| Timing::of(&quiet).median_s),
            phases: StepPhases::mean(&self.phases),
        }
    }

    /// Wall times of the timed steps that lost at most `QUIET_STEAL_SHARE`
    /// of the machine (all of them where steal is not reported).
    fn quiet_walls(&self) -> Vec<std::time::Duration> {
        let cores = strata::machine_cores() as f64;
        self.metrics
            .iter()
            .zip(&self.steal)
            .filter(|(m, &steal)| is_quiet(steal, m.wall_s, cores))
            .map(|(m, _)| std::time::Duration::from_secs_f64(m.wall_s))
            .collect()
    }

    /// Median wall time of the timed steps from `from` on.
    pub(super) fn median_since(&self, from: usize) -> f64 {
        let samples: Vec<_> = self.metrics[from..]
            .iter()
            .map(|m| std::time::Duration::from_secs_f64(m.wall_s))
            .collect();
        Timing::of(&samples).median_s
    }
}

/// The mean of per-step figures, `None` if any step lacks one.
fn mean_of(samples: &[Option<f64>]) -> Option<f64> {
    let n = samples.len() as f64;
    samples.iter().copied().sum::<Option<f64>>().map(|s| s / n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_that_lost_much_cpu_to_steal_are_not_quiet() {
        assert!(is_quiet(None, 1.0, 2.0));
        assert!(is_quiet(Some(0.0), 1.0, 2.0));
        assert!(is_quiet(Some(0.1), 1.0, 2.0));
        assert!(!is_quiet(Some(0.11), 1.0, 2.0));
        assert!(is_quiet(Some(0.3), 3.0, 2.0));
    }
}
