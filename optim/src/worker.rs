//! The optimizer pool's worker threads: each takes tasks off the shared
//! queue — a gradient norm, the start of an update, one chunk of it — and
//! publishes its outcome in the expert's slot, turning a panic inside an
//! update into that expert's error.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crossbeam_channel::{Receiver, TrySendError};

use crate::adamw::{GradRef, RawStep, StepScalars};
use crate::pool::Shared;
use crate::slot::{Phase, Slot};
use crate::{OptimError, UpdateTarget};

/// One unit of work on the pool's queue, naming the slot it is for.
pub(crate) enum Task {
    Norm {
        slot: usize,
    },
    Start {
        slot: usize,
    },
    Chunk {
        slot: usize,
        start: usize,
        len: usize,
    },
    Stop,
}

/// Marks the pool broken if a worker unwinds past its own catch_unwind.
struct DeathNotice<'a>(&'a AtomicBool);

impl Drop for DeathNotice<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

pub(crate) fn worker_loop<T: UpdateTarget>(shared: &Shared<T>, tasks: &Receiver<Task>) {
    let _notice = DeathNotice(&shared.worker_died);
    while let Ok(task) = tasks.recv() {
        match task {
            Task::Stop => break,
            Task::Norm { slot } => run_norm(shared, slot),
            Task::Start { slot } => run_start(shared, slot),
            Task::Chunk { slot, start, len } => run_chunk(shared, slot, start, len),
        }
    }
}

fn run_norm<T: UpdateTarget>(shared: &Shared<T>, slot_index: usize) {
    let slot = &shared.slots[slot_index];
    let key = {
        let mut state = slot.lock();
        assert_eq!(state.phase, Phase::NormQueued);
        state.phase = Phase::NormRunning;
        state.key
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: (2) of target_mut: this thread moved the phase to
        // NormRunning and is the only one touching the target until it
        // publishes NormReady or Done below.
        let target = unsafe { slot.target_mut() }.as_mut().expect("claimed slot");
        let views = target.views();
        if views.grad.len() != views.params.len() {
            return Err(OptimError::LengthMismatch {
                what: "grad",
                expected: views.params.len(),
                got: views.grad.len(),
            });
        }
        Ok(grad_norm_sq(views.grad))
    }));
    let mut state = slot.lock();
    match outcome {
        Ok(Ok(norm_sq)) => {
            state.norm_sq = norm_sq;
            state.phase = Phase::NormReady;
        }
        Ok(Err(e)) => {
            state.error = Some(OptimError::Expert {
                key,
                source: Box::new(e),
            });
            state.finish();
        }
        Err(panic) => {
            state.error = Some(OptimError::UpdatePanicked {
                key,
                message: panic_message(&panic),
            });
            state.finish();
        }
    }
    slot.done.notify_all();
}

fn run_start<T: UpdateTarget>(shared: &Shared<T>, slot_index: usize) {
    let slot = &shared.slots[slot_index];
    let (key, hyper, grad_scale) = {
        let mut state = slot.lock();
        assert_eq!(state.phase, Phase::Queued);
        state.phase = Phase::Running;
        state.started_at = Some(Instant::now());
        (state.key, state.hyper, state.grad_scale)
    };
    let prepared = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: (2) of target_mut: this thread moved the phase to Running;
        // it alone touches the target until Done, and chunk workers use the
        // RawStep pointers taken here.
        let target = unsafe { slot.target_mut() }.as_mut().expect("claimed slot");
        let mut views = target.views();
        let raw =
            RawStep::from_slices(views.params, views.m, views.v, views.grad, &mut views.copy)?;
        *views.step += 1;
        Ok::<_, OptimError>((raw, *views.step))
    }));
    let (raw, step) = match prepared {
        Ok(Ok(prepared)) => prepared,
        Ok(Err(e)) => {
            let error = OptimError::Expert {
                key,
                source: Box::new(e),
            };
            return fail(slot, error);
        }
        Err(panic) => {
            let message = panic_message(&panic);
            return fail(slot, OptimError::UpdatePanicked { key, message });
        }
    };
    let scalars = StepScalars::new(&hyper, step, grad_scale);
    let config = &shared.config;
    let chunk_count = if raw.len >= 2 * config.split_params_min {
        (raw.len / config.split_params_min).clamp(1, 4 * config.threads)
    } else {
        1
    };
    let chunk_len = raw.len.div_ceil(chunk_count);
    {
        let mut state = slot.lock();
        state.raw = Some(raw);
        state.scalars = Some(scalars);
        state.step = step;
        state.chunk_count = chunk_count;
        state.chunks_left = chunk_count;
    }
    for c in 1..chunk_count {
        let start = c * chunk_len;
        let len = chunk_len.min(raw.len - start);
        let task = Task::Chunk {
            slot: slot_index,
            start,
            len,
        };
        // Never block on our own queue: a full queue means run it here.
        match shared.tasks.try_send(task) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                run_chunk(shared, slot_index, start, len)
            }
        }
    }
    run_chunk(shared, slot_index, 0, chunk_len.min(raw.len));
}

fn run_chunk<T: UpdateTarget>(shared: &Shared<T>, slot_index: usize, start: usize, len: usize) {
    let slot = &shared.slots[slot_index];
    let (key, raw, scalars) = {
        let state = slot.lock();
        assert_eq!(state.phase, Phase::Running);
        let raw = state.raw.expect("a running slot has its buffers");
        (
            state.key,
            raw.range(start, len),
            state.scalars.expect("set"),
        )
    };
    let kernel = shared.config.kernel;
    // SAFETY: (1) RawStep invariant: `raw` is a disjoint chunk of exclusive
    // borrows taken in run_start, untouched until the last chunk is Done;
    // (2) the kernel was checked as supported in ExpertOptimizer::new.
    let outcome = catch_unwind(AssertUnwindSafe(|| unsafe { kernel.run(&scalars, &raw) }));
    let mut state = slot.lock();
    if let Err(panic) = outcome {
        let message = panic_message(&panic);
        state
            .error
            .get_or_insert(OptimError::UpdatePanicked { key, message });
    }
    state.chunks_left -= 1;
    if state.chunks_left > 0 {
        return;
    }
    if state.error.is_none() {
        // Off the lock: `finished` may take milliseconds (checksums).
        drop(state);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: (4) of target_mut: every chunk is done (no RawStep
            // pointer is in use) and the phase is still Running, so this
            // thread, which ran the last chunk, is the only one touching
            // the target until it publishes Done below.
            unsafe { slot.target_mut() }
                .as_mut()
                .expect("claimed slot")
                .finished()
        }));
        state = slot.lock();
        if let Err(panic) = outcome {
            let message = panic_message(&panic);
            state.error = Some(OptimError::UpdatePanicked { key, message });
        }
    }
    state.finish();
    slot.done.notify_all();
}

fn fail<T>(slot: &Slot<T>, error: OptimError) {
    let mut state = slot.lock();
    state.error = Some(error);
    state.finish();
    slot.done.notify_all();
}

/// Σ g² in f64, sequentially: the same value for the same gradient, always.
fn grad_norm_sq(grad: GradRef<'_>) -> f64 {
    fn sum(values: impl Iterator<Item = f32>) -> f64 {
        values.map(|g| (g as f64) * (g as f64)).sum()
    }
    match grad {
        GradRef::F32(g) => sum(g.iter().copied()),
        GradRef::Bf16(g) => sum(g.iter().map(|x| x.to_f32())),
        GradRef::F16(g) => sum(g.iter().map(|x| x.to_f32())),
    }
}

pub(crate) fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}
