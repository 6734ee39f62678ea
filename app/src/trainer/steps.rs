//! The training loop: a step a batch at its learning rate, each step's
//! metrics written (`metrics.jsonl`, TensorBoard) and shown (the progress
//! bar, a line every twentieth of the run), the held-out loss every
//! `--eval-every` steps, a checkpoint every `--checkpoint-every` steps, at
//! the end and where any rank was interrupted, and the timeline of the
//! step `--timeline-step` names.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use strata::engine::{Engine, StepMetrics};
use strata::lm::data::Dataset;
use strata::lm::MoeLm;
use strata::lm::TokenBatch;
use strata_tiers::Timeline;

use super::announce::Speaker;
use super::metrics_log::MetricsLog;
use super::{lr_at, routing_file, tensorboard, RunSummary, TrainOptions};

/// What a run's loop reads besides the engine and the data.
pub(super) struct StepLoop<'a> {
    pub o: &'a TrainOptions,
    pub lm: &'a MoeLm,
    pub speaker: &'a Speaker<'a>,
    pub interrupt: &'a AtomicBool,
    /// Recording every step until `--timeline-step`'s.
    pub timeline: Option<Arc<Timeline>>,
}

/// Where a step's figures go.
struct Logs {
    metrics: MetricsLog,
    tensorboard: Option<tensorboard::EventWriter>,
    bar: indicatif::ProgressBar,
}

fn engine_error(e: strata::EngineError) -> String {
    e.to_string()
}

impl StepLoop<'_> {
    /// Trains from `summary.start_step` to `--steps`, or to the step
    /// where a rank was interrupted, into `summary` (its steps, losses,
    /// median tokens/s, and whether it was interrupted); the engine has
    /// checkpointed its last step when this returns `Ok`.
    pub fn run(
        &self,
        engine: &mut Engine,
        data: &mut Dataset,
        summary: &mut RunSummary,
    ) -> Result<(), String> {
        let o = self.o;
        let start_step = summary.start_step;
        let eval = data.eval_batches();
        let mut logs = Logs {
            metrics: MetricsLog::open(&o.out.join("metrics.jsonl"), start_step)?,
            tensorboard: match &o.tensorboard {
                Some(dir) => Some(tensorboard::EventWriter::create(dir)?),
                None => None,
            },
            bar: match self.speaker.speaks() {
                true => progress_bar(o, start_step),
                false => indicatif::ProgressBar::hidden(),
            },
        };
        let log_every = (o.steps / 20).max(1);
        let mut rates = Vec::new();
        for step in start_step + 1..=o.steps {
            let lr = lr_at(o, step);
            engine.set_lr(lr).map_err(engine_error)?;
            let batch = data.next_batch().map_err(engine_error)?;
            let m = self.step(engine, &batch, step, &logs.bar)?;
            rates.push(m.tokens as f64 / m.wall_s);
            summary.first_loss.get_or_insert(m.loss);
            summary.last_loss = Some(m.loss);
            summary.steps = step;
            logs.metrics.append(&metrics_line(&m, lr))?;
            if let Some(tb) = logs.tensorboard.as_mut() {
                tb.step(step, &m, lr)?;
            }
            logs.bar.set_position(step);
            logs.bar.set_message(status(&m));
            if o.eval_every > 0 && step % o.eval_every == 0 && !eval.is_empty() {
                let loss = self.evaluate(engine, &eval, step, &mut logs)?;
                summary.last_eval_loss = Some(loss);
                let line = format!(
                    "  step {step:>6}  loss {:.4}  eval {loss:.4}  {}",
                    m.loss,
                    status(&m)
                );
                self.speaker.say_over(&logs.bar, line);
            } else if step % log_every == 0 || step == start_step + 1 {
                let line = format!("  step {step:>6}  loss {:.4}  {}", m.loss, status(&m));
                self.speaker.say_over(&logs.bar, line);
            }
            // Every rank stops at the same step, whichever was signalled.
            let interrupted = engine
                .any_rank(self.interrupt.load(Ordering::SeqCst))
                .map_err(engine_error)?;
            if interrupted || (o.checkpoint_every > 0 && step % o.checkpoint_every == 0) {
                self.checkpoint(engine)?;
                let line = format!("{{\"step\":{step},\"checkpoint\":true}}");
                logs.metrics.append(&line)?;
            }
            if interrupted {
                summary.interrupted = true;
                break;
            }
        }
        logs.bar.finish_and_clear();
        if !summary.interrupted {
            self.checkpoint(engine)?;
        }
        rates.sort_by(f64::total_cmp);
        summary.tokens_per_s = rates.get(rates.len() / 2).copied().unwrap_or(0.0);
        Ok(())
    }

    /// One step on `batch`; the step `--timeline-step` names is recorded
    /// with its last updates and written beside the run.
    fn step(
        &self,
        engine: &mut Engine,
        batch: &TokenBatch,
        step: u64,
        bar: &indicatif::ProgressBar,
    ) -> Result<StepMetrics, String> {
        let traced = self
            .timeline
            .as_ref()
            .filter(|_| self.o.timeline_step == Some(step));
        if let Some(timeline) = traced {
            timeline.take(); // this step's events start now
        }
        let m = engine.step_network(self.lm, batch).map_err(engine_error)?;
        if let Some(timeline) = traced {
            engine.drain().map_err(engine_error)?; // its last updates, on the trace
            let path = self.o.out.join(format!("timeline-step-{step}.json"));
            strata_tiers::timeline::write_chrome_trace_file(&timeline.take().events, &path)
                .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            let line = format!("  step {step}'s timeline: {}", path.display());
            self.speaker.say_over(bar, line);
        }
        Ok(m)
    }

    /// The mean loss over the held-out batches, logged.
    fn evaluate(
        &self,
        engine: &mut Engine,
        eval: &[TokenBatch],
        step: u64,
        logs: &mut Logs,
    ) -> Result<f32, String> {
        let mut sum = 0.0f64;
        for b in eval {
            sum += engine.evaluate(self.lm, b).map_err(engine_error)? as f64;
        }
        let loss = (sum / eval.len() as f64) as f32;
        let line = format!("{{\"step\":{step},\"eval_loss\":{loss}}}");
        logs.metrics.append(&line)?;
        if let Some(tb) = logs.tensorboard.as_mut() {
            tb.scalars(step, &[("eval/loss", loss)])?;
        }
        Ok(loss)
    }

    /// A checkpoint, with the routing trace where one is kept.
    fn checkpoint(&self, engine: &mut Engine) -> Result<(), String> {
        if let Some(path) = &self.o.trace_routing {
            routing_file::write(engine, path)?;
        }
        engine.checkpoint().map_err(engine_error)
    }
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
