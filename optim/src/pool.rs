//! [`ExpertOptimizer`]: a fixed pool of threads that runs each expert's AdamW
//! update as soon as its gradient is submitted.
//!
//! `submit(key, target)` hands over the expert's buffers and returns at once
//! (it blocks only while the bounded task queue is full). `wait(key)` blocks on
//! that expert alone and hands the buffers back. An expert larger than
//! `split_params_min` is cut into chunks that every thread can take; smaller
//! ones run whole on one thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::adamw::{AdamWHyper, CopyOut, GradRef, Kernel};
use crate::worker::{panic_message, worker_loop, Task};
use crate::worker::{Phase, Slot};
use crate::{ExpertId, OptimError};

/// The buffers of one expert's update, lent to the pool for its duration.
pub struct UpdateViews<'a> {
    /// f32 master params, updated in place.
    pub params: &'a mut [f32],
    /// First moment, updated in place.
    pub m: &'a mut [f32],
    /// Second moment, updated in place.
    pub v: &'a mut [f32],
    pub grad: GradRef<'a>,
    /// Where the new compute copy goes, if anywhere.
    pub copy: CopyOut<'a>,
    /// This expert's own step counter: incremented by the update, and used
    /// for bias correction. Left alone when the step is skipped.
    pub step: &'a mut u64,
}

/// Something that owns (or pins) an expert's buffers: a host-tier slot
/// guard, or plain vectors. It is moved into the pool on `submit` and
/// returned by `wait`; the pool never moves it in between.
pub trait UpdateTarget: Send + 'static {
    /// Called on a worker before each [`Self::views`] that reads the
    /// gradient (twice under [`GradientPolicy::GlobalNorm`]: for the norm,
    /// then for the update): where a gradient is still arriving (a
    /// download from a GPU), the wait for it, which returns at once once
    /// it has arrived. An error fails the update
    /// ([`OptimError::GradientUnavailable`]).
    fn prepare(&mut self) -> Result<(), String> {
        Ok(())
    }

    fn views(&mut self) -> UpdateViews<'_>;

    /// Called once the update has been applied (not when it failed or the
    /// step was skipped), on the worker that ran its last chunk, before
    /// `wait` can return the target: where a target finishes its buffers
    /// (checksums, handing a slot back) off the submitter's thread.
    fn finished(&mut self) {}
}

/// When updates may run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum GradientPolicy {
    /// Each expert is stepped as soon as it is submitted (the default).
    #[default]
    PerExpert,
    /// Options that need every gradient before any update. Updates are
    /// **delayed** until `finish_gradients()`, which computes the global L2
    /// norm over every submitted gradient (in f64, in key order, so the
    /// result does not depend on thread timing) and then releases them all:
    /// - `clip_max_norm`: scale every gradient by
    ///   `min(1, max_norm / (norm + 1e-6))`, as `torch.nn.utils.clip_grad_norm_`;
    /// - `skip_nonfinite`: if any gradient holds an inf or NaN, skip the whole
    ///   step (no param, moment or step-counter changes), as a loss scaler does.
    GlobalNorm {
        clip_max_norm: Option<f32>,
        skip_nonfinite: bool,
    },
}

/// The most threads a pool (and the engine's compute split) takes for each
/// core of the machine: threads past the cores only take turns, and each
/// costs a stack.
pub const MAX_THREADS_PER_CORE: usize = 4;

/// Whether `threads` is within [`MAX_THREADS_PER_CORE`] a core of this
/// machine; the refusal says the limit and why, for the caller to prefix
/// with what it counts (`--threads 64: at most 8 on …`).
pub fn check_thread_count(threads: usize) -> Result<(), String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let most = cores * MAX_THREADS_PER_CORE;
    if threads <= most {
        return Ok(());
    }
    Err(format!(
        "at most {most} on this machine of {cores} cores ({MAX_THREADS_PER_CORE} a core; threads \
         past the cores only take turns)"
    ))
}

/// Pool configuration; every bound is fixed at construction.
#[derive(Clone, Debug)]
pub struct OptimizerConfig {
    /// Optimizer threads (≥ 1).
    pub threads: usize,
    /// Capacity of the task queue; `submit` blocks while it is full.
    pub queue_len_max: usize,
    /// Experts submitted and not yet waited for, at most.
    pub in_flight_max: usize,
    /// Experts with at least twice this many params are split into chunks
    /// of at least this many, up to `4 × threads` chunks.
    pub split_params_min: usize,
    pub kernel: Kernel,
    pub hyper: AdamWHyper,
    pub policy: GradientPolicy,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            threads,
            queue_len_max: 1024,
            in_flight_max: 4096,
            split_params_min: 1 << 18,
            kernel: Kernel::detect(),
            hyper: AdamWHyper::default(),
            policy: GradientPolicy::PerExpert,
        }
    }
}

/// What one update cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateReport {
    pub key: ExpertId,
    /// The expert's step counter after this update (unchanged if skipped).
    pub step: u64,
    /// From `submit` (or, under a global-norm policy, from the release) to
    /// the first chunk starting.
    pub queue_ns: u64,
    /// From the first chunk starting to the last one ending.
    pub run_ns: u64,
    pub chunks: usize,
    /// True when a global-norm policy skipped the step.
    pub skipped: bool,
}

/// The outcome of `finish_gradients`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradientSummary {
    pub experts: usize,
    pub global_norm: f64,
    /// The factor every gradient was multiplied by (1 when not clipped).
    pub grad_scale: f32,
    pub skipped: bool,
}

struct Index {
    by_key: HashMap<ExpertId, usize>,
    free: Vec<usize>,
}

pub(crate) struct Shared<T> {
    pub(crate) slots: Box<[Slot<T>]>,
    index: Mutex<Index>,
    /// Global-norm policy: the slots submitted since the last release.
    deferred: Mutex<Vec<(ExpertId, usize)>>,
    hyper: Mutex<AdamWHyper>,
    pub(crate) config: OptimizerConfig,
    pub(crate) tasks: Sender<Task>,
    pub(crate) worker_died: AtomicBool,
}

/// A fixed pool of AdamW threads fed by a bounded queue. See the module docs.
pub struct ExpertOptimizer<T: UpdateTarget> {
    shared: Arc<Shared<T>>,
    workers: Vec<JoinHandle<()>>,
}

impl<T: UpdateTarget> ExpertOptimizer<T> {
    pub fn new(config: OptimizerConfig) -> Result<Self, OptimError> {
        let invalid = |s: &str| Err(OptimError::InvalidConfig(s.to_string()));
        if config.threads == 0 {
            return invalid("threads must be at least 1");
        }
        check_thread_count(config.threads)
            .map_err(|e| OptimError::InvalidConfig(format!("{} threads: {e}", config.threads)))?;
        if config.queue_len_max == 0 {
            return invalid("queue_len_max must be at least 1");
        }
        if config.in_flight_max == 0 {
            return invalid("in_flight_max must be at least 1");
        }
        if config.split_params_min == 0 {
            return invalid("split_params_min must be at least 1");
        }
        if !config.kernel.is_supported() {
            return Err(OptimError::KernelUnsupported {
                kernel: config.kernel.name(),
            });
        }
        if let GradientPolicy::GlobalNorm {
            clip_max_norm: Some(max),
            ..
        } = config.policy
        {
            if !(max.is_finite() && max > 0.0) {
                return invalid("clip_max_norm must be finite and positive");
            }
        }
        config.hyper.validate()?;
        let (sender, receiver) = bounded(config.queue_len_max);
        let slots = (0..config.in_flight_max).map(|_| Slot::new()).collect();
        let shared = Arc::new(Shared {
            slots,
            index: Mutex::new(Index {
                by_key: HashMap::with_capacity(config.in_flight_max),
                free: (0..config.in_flight_max).rev().collect(),
            }),
            deferred: Mutex::new(Vec::with_capacity(config.in_flight_max)),
            hyper: Mutex::new(config.hyper),
            config: config.clone(),
            tasks: sender,
            worker_died: AtomicBool::new(false),
        });
        let mut workers = Vec::with_capacity(config.threads);
        for n in 0..config.threads {
            let shared = Arc::clone(&shared);
            let receiver: Receiver<Task> = receiver.clone();
            let handle = std::thread::Builder::new()
                .name(format!("strata-adamw-{n}"))
                .spawn(move || worker_loop(&shared, &receiver))
                .map_err(|e| OptimError::InvalidConfig(format!("spawning a worker: {e}")))?;
            workers.push(handle);
        }
        Ok(Self { shared, workers })
    }

    pub fn config(&self) -> &OptimizerConfig {
        &self.shared.config
    }

    /// Hyper-parameters for updates submitted from now on (e.g. a new lr).
    pub fn set_hyper(&self, hyper: AdamWHyper) -> Result<(), OptimError> {
        hyper.validate()?;
        *lock(&self.shared.hyper) = hyper;
        Ok(())
    }

    /// The hyperparameters `submit` gives an update now (`set_hyper`).
    pub fn hyper(&self) -> AdamWHyper {
        *lock(&self.shared.hyper)
    }

    /// Hands over one expert's buffers for its update and returns at once;
    /// blocks only while the bounded task queue is full. The update runs
    /// with the hyperparameters set now.
    pub fn submit(&self, key: ExpertId, target: T) -> Result<(), OptimError> {
        self.submit_with(key, target, self.hyper())
    }

    /// `submit`, with `hyper` for this update: one whose gradient was held
    /// past a `set_hyper` (a learning-rate schedule's next step) runs with
    /// those of the step that computed it.
    pub fn submit_with(
        &self,
        key: ExpertId,
        target: T,
        hyper: AdamWHyper,
    ) -> Result<(), OptimError> {
        hyper.validate()?;
        let shared = &*self.shared;
        let slot_index = {
            let mut index = lock(&shared.index);
            if index.by_key.contains_key(&key) {
                return Err(OptimError::AlreadySubmitted { key });
            }
            let Some(slot_index) = index.free.pop() else {
                return Err(OptimError::InFlightFull {
                    in_flight_max: shared.config.in_flight_max,
                });
            };
            index.by_key.insert(key, slot_index);
            slot_index
        };
        let deferred = matches!(shared.config.policy, GradientPolicy::GlobalNorm { .. });
        let slot = &shared.slots[slot_index];
        {
            let mut state = slot.lock();
            let phase = if deferred {
                Phase::NormQueued
            } else {
                Phase::Queued
            };
            state.claim(key, phase, hyper, target);
        }
        let task = if deferred {
            lock(&shared.deferred).push((key, slot_index));
            Task::Norm { slot: slot_index }
        } else {
            Task::Start { slot: slot_index }
        };
        shared.tasks.send(task).map_err(|_| OptimError::ShutDown)
    }

    /// Blocks until `key`'s update is done and returns its buffers. An error
    /// or panic in the update is returned here (the buffers are dropped).
    pub fn wait(&self, key: ExpertId) -> Result<(T, UpdateReport), OptimError> {
        self.wait_inner(key, true)
            .map(|done| done.expect("a blocking wait returns an update"))
    }

    /// Like `wait`, but returns `Ok(None)` at once if the update is still
    /// queued or running (or waits for the global norm).
    pub fn try_wait(&self, key: ExpertId) -> Result<Option<(T, UpdateReport)>, OptimError> {
        self.wait_inner(key, false)
    }

    fn wait_inner(
        &self,
        key: ExpertId,
        block: bool,
    ) -> Result<Option<(T, UpdateReport)>, OptimError> {
        let shared = &*self.shared;
        let slot_index = *lock(&shared.index)
            .by_key
            .get(&key)
            .ok_or(OptimError::NotSubmitted { key })?;
        let slot = &shared.slots[slot_index];
        let mut state = slot.lock();
        assert_eq!(state.key, key);
        if !block && state.phase != Phase::Done {
            return Ok(None);
        }
        loop {
            match state.phase {
                Phase::Done => break,
                Phase::NormQueued | Phase::NormRunning | Phase::NormReady if !state.released => {
                    return Err(OptimError::AwaitingGradientNorm { key });
                }
                Phase::Free => unreachable!("an indexed slot is never free"),
                _ => {}
            }
            if shared.worker_died.load(Ordering::Acquire) {
                return Err(OptimError::WorkerPanicked {
                    message: format!("while expert {key} was in flight"),
                });
            }
            // A bounded wait, so a worker that died outside catch_unwind is
            // noticed (above) instead of hanging this thread.
            state = state.wait_timeout(Duration::from_millis(100));
        }
        let report = UpdateReport {
            key,
            step: state.step,
            queue_ns: nanos_between(state.submitted_at, state.started_at),
            run_ns: state
                .started_at
                .map_or(0, |s| nanos_between(s, state.finished_at)),
            chunks: state.chunk_count,
            skipped: state.skipped,
        };
        let error = state.error.take();
        let target = state.release();
        drop(state);
        {
            let mut index = lock(&shared.index);
            index.by_key.remove(&key);
            index.free.push(slot_index);
        }
        match error {
            Some(e) => Err(e),
            None => Ok(Some((
                target.expect("a done slot holds its target"),
                report,
            ))),
        }
    }

    /// Global-norm policy only: waits for the norm of every gradient
    /// submitted since the last call, then clips or skips and releases all of
    /// those updates. Errors under the per-expert policy.
    pub fn finish_gradients(&self) -> Result<GradientSummary, OptimError> {
        let shared = &*self.shared;
        let GradientPolicy::GlobalNorm {
            clip_max_norm,
            skip_nonfinite,
        } = shared.config.policy
        else {
            return Err(OptimError::InvalidConfig(
                "finish_gradients() needs GradientPolicy::GlobalNorm".to_string(),
            ));
        };
        let mut pending = std::mem::take(&mut *lock(&shared.deferred));
        // Key order fixes the summation order, whatever the submit order.
        pending.sort_unstable();
        for &(_, slot_index) in &pending {
            shared.slots[slot_index].lock().released = true;
        }
        let (norm_sq, failure) = self.wait_for_norms(&pending)?;
        let global_norm = norm_sq.sqrt();
        let skip = failure.is_some() || (skip_nonfinite && !global_norm.is_finite());
        let grad_scale = match clip_max_norm {
            Some(max) => {
                let coef = max as f64 / (global_norm + 1e-6);
                if coef < 1.0 {
                    coef as f32
                } else {
                    1.0
                }
            }
            None => 1.0,
        };
        let release = match (skip, &failure) {
            (false, _) => Release::Scaled(grad_scale),
            (true, cause) => Release::Skipped(cause.as_ref()),
        };
        self.release_norms(&pending, release)?;
        if let Some(cause) = failure {
            return Err(cause);
        }
        Ok(GradientSummary {
            experts: pending.len(),
            global_norm,
            grad_scale,
            skipped: skip,
        })
    }

    /// Waits for the norm of each of `pending`'s gradients (a bounded
    /// wait, which learns if a worker died): the sum of their squares, in
    /// `pending`'s order, and the first error a norm ended on.
    fn wait_for_norms(
        &self,
        pending: &[(ExpertId, usize)],
    ) -> Result<(f64, Option<OptimError>), OptimError> {
        let shared = &*self.shared;
        let mut norm_sq = 0.0f64;
        let mut failure: Option<OptimError> = None;
        for &(_, slot_index) in pending {
            let slot = &shared.slots[slot_index];
            let mut state = slot.lock();
            while matches!(state.phase, Phase::NormQueued | Phase::NormRunning) {
                if shared.worker_died.load(Ordering::Acquire) {
                    return Err(OptimError::WorkerPanicked {
                        message: "while gradient norms were computed".to_string(),
                    });
                }
                state = state.wait_timeout(Duration::from_millis(100));
            }
            if state.phase == Phase::Done {
                let cause = state
                    .error
                    .clone()
                    .expect("a norm only ends early on error");
                failure.get_or_insert(cause);
            } else {
                norm_sq += state.norm_sq;
            }
        }
        Ok((norm_sq, failure))
    }

    /// Releases each of `pending`'s updates whose norm is ready: queued
    /// with its gradient scaled, or finished without an update (with
    /// the cause, if a norm failed).
    fn release_norms(
        &self,
        pending: &[(ExpertId, usize)],
        release: Release<'_>,
    ) -> Result<(), OptimError> {
        let shared = &*self.shared;
        for &(key, slot_index) in pending {
            let slot = &shared.slots[slot_index];
            let mut state = slot.lock();
            if state.phase != Phase::NormReady {
                continue; // failed during its norm; its error is in place
            }
            let grad_scale = match release {
                Release::Scaled(scale) => scale,
                Release::Skipped(cause) => {
                    if let Some(cause) = cause {
                        state.error = Some(OptimError::Expert {
                            key,
                            source: Box::new(cause.clone()),
                        });
                    }
                    state.skipped = true;
                    state.finish();
                    state.notify();
                    continue;
                }
            };
            state.grad_scale = grad_scale;
            state.phase = Phase::Queued;
            state.submitted_at = Instant::now();
            drop(state);
            shared
                .tasks
                .send(Task::Start { slot: slot_index })
                .map_err(|_| OptimError::ShutDown)?;
        }
        Ok(())
    }

    /// Stops the threads after the queued work and reports a worker panic.
    pub fn shutdown(mut self) -> Result<(), OptimError> {
        self.stop_workers()
    }

    fn stop_workers(&mut self) -> Result<(), OptimError> {
        for _ in 0..self.workers.len() {
            // The receivers live as long as the workers; a send can only
            // fail once every worker is gone, and then there is no one to stop.
            let _ = self.shared.tasks.send(Task::Stop);
        }
        let mut result = Ok(());
        for worker in self.workers.drain(..) {
            if let Err(panic) = worker.join() {
                result = Err(OptimError::WorkerPanicked {
                    message: panic_message(&panic),
                });
            }
        }
        result
    }
}

impl<T: UpdateTarget> Drop for ExpertOptimizer<T> {
    fn drop(&mut self) {
        let _ = self.stop_workers();
    }
}

fn nanos_between(from: Instant, to: Option<Instant>) -> u64 {
    to.map_or(0, |t| t.saturating_duration_since(from).as_nanos() as u64)
}

fn lock<V>(m: &Mutex<V>) -> std::sync::MutexGuard<'_, V> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What [`ExpertOptimizer::finish_gradients`] does with the updates whose
/// norms are in.
#[derive(Clone, Copy)]
enum Release<'a> {
    /// Each queued with its gradient scaled by this.
    Scaled(f32),
    /// Each finished without an update, with the norm's error if one
    /// failed.
    Skipped(Option<&'a OptimError>),
}
