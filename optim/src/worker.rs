//! The optimizer pool's worker threads and the slots they work in.
//!
//! A worker takes tasks off the shared queue — a gradient norm, the start of
//! an update, one chunk of it — and publishes its outcome in the expert's
//! slot, turning a panic inside an update into that expert's error. A slot
//! holds one in-flight update: its phase, its timings, and the caller's
//! buffers, held in place (never moved) from `submit` until `wait`. Which
//! thread may touch those buffers is decided by the phase protocol below;
//! this file is the only one that touches them.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TrySendError};

use crate::adamw::{AdamWHyper, GradRef, RawStep, StepScalars};
use crate::pool::Shared;
use crate::{ExpertId, OptimError, UpdateTarget};

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
        target.prepare().map_err(OptimError::GradientUnavailable)?;
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
    state.notify();
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
        target.prepare().map_err(OptimError::GradientUnavailable)?;
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
    state.notify();
}

fn fail<T>(slot: &Slot<T>, error: OptimError) {
    let mut state = slot.lock();
    state.error = Some(error);
    state.finish();
    state.notify();
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

/// Where an update is. Transitions (each under the slot's lock):
///
/// ```text
/// Free → Queued → Running → Done → Free                       (per-expert policy)
/// Free → NormQueued → NormRunning → NormReady → Queued → …   (global-norm policy)
///                                   NormReady → Done (skipped or abandoned)
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Free,
    NormQueued,
    NormRunning,
    NormReady,
    Queued,
    Running,
    Done,
}

pub(crate) struct SlotState {
    pub key: ExpertId,
    pub phase: Phase,
    /// Set by `finish_gradients` as it takes over a global-norm slot, so a
    /// concurrent `wait` blocks instead of reporting `AwaitingGradientNorm`.
    pub released: bool,
    pub hyper: AdamWHyper,
    pub grad_scale: f32,
    pub raw: Option<RawStep>,
    pub scalars: Option<StepScalars>,
    pub chunks_left: usize,
    pub chunk_count: usize,
    pub error: Option<OptimError>,
    pub skipped: bool,
    pub norm_sq: f64,
    pub step: u64,
    pub submitted_at: Instant,
    pub started_at: Option<Instant>,
    pub finished_at: Option<Instant>,
}

impl SlotState {
    fn empty() -> Self {
        Self {
            key: ExpertId::new(u32::MAX, u32::MAX),
            phase: Phase::Free,
            released: false,
            hyper: AdamWHyper::default(),
            grad_scale: 1.0,
            raw: None,
            scalars: None,
            chunks_left: 0,
            chunk_count: 0,
            error: None,
            skipped: false,
            norm_sq: 0.0,
            step: 0,
            submitted_at: Instant::now(),
            started_at: None,
            finished_at: None,
        }
    }

    /// Resets every field for a new submission of `key`.
    pub fn claim(&mut self, key: ExpertId, phase: Phase, hyper: AdamWHyper) {
        assert_eq!(self.phase, Phase::Free, "claiming a busy slot");
        *self = Self::empty();
        self.key = key;
        self.phase = phase;
        self.hyper = hyper;
    }

    /// Marks the update finished (successfully or not).
    pub fn finish(&mut self) {
        assert_ne!(self.phase, Phase::Free);
        assert_ne!(self.phase, Phase::Done);
        self.phase = Phase::Done;
        self.raw = None;
        self.finished_at = Some(Instant::now());
    }
}

pub(crate) struct Slot<T> {
    state: Mutex<SlotState>,
    done: Condvar,
    target: UnsafeCell<Option<T>>,
}

// SAFETY: the target is only touched by the one thread the phase protocol
// names at a time (see `target_mut`), and every hand-over goes through the
// state mutex, which orders those accesses; T itself is Send.
unsafe impl<T: Send> Sync for Slot<T> {}

impl<T> Slot<T> {
    pub fn new() -> Self {
        Self {
            state: Mutex::new(SlotState::empty()),
            done: Condvar::new(),
            target: UnsafeCell::new(None),
        }
    }

    /// Locks the state. A poisoned lock only means a panic elsewhere while it
    /// was held; the state itself is always left consistent, so go on.
    pub fn lock(&self) -> SlotGuard<'_, T> {
        SlotGuard {
            slot: self,
            state: self.state.lock().unwrap_or_else(|e| e.into_inner()),
        }
    }

    /// The caller's buffers.
    ///
    /// # Safety
    /// The caller is the one thread the phase protocol gives the target to:
    /// 1. the submitter, while it claims a `Free` slot (phase set under lock);
    /// 2. the worker that moved the phase to `NormRunning` or `Running`, until
    ///    it publishes the phase change that ends its turn;
    /// 3. the waiter that saw `Done` and has not yet set `Free`;
    /// 4. the worker whose chunk brought `chunks_left` to 0 (with no error),
    ///    until it publishes `Done`.
    ///
    /// Chunk workers never call this while chunks run: they use the
    /// `RawStep` pointers taken under (2), which stay valid because the
    /// target is not moved or touched until (4) or (3).
    #[allow(clippy::mut_from_ref)]
    unsafe fn target_mut(&self) -> &mut Option<T> {
        // SAFETY: exclusivity is the caller's contract (1–4 above).
        unsafe { &mut *self.target.get() }
    }
}

/// A slot's locked state, tied to its slot: the handovers of the target
/// that happen under the lock (claim, release) are methods of the guard.
pub(crate) struct SlotGuard<'a, T> {
    slot: &'a Slot<T>,
    state: MutexGuard<'a, SlotState>,
}

impl<T> SlotGuard<'_, T> {
    /// Claims this Free slot for `key` and moves the caller's buffers in.
    pub fn claim(&mut self, key: ExpertId, phase: Phase, hyper: AdamWHyper, target: T) {
        self.state.claim(key, phase, hyper);
        // SAFETY: (1) of target_mut: the slot was Free (asserted by
        // `SlotState::claim`) under this lock, so no worker holds it, and no
        // task naming it can have been sent yet.
        unsafe { *self.slot.target_mut() = Some(target) };
    }

    /// Frees this Done slot and moves its buffers out.
    pub fn release(&mut self) -> Option<T> {
        assert_eq!(
            self.state.phase,
            Phase::Done,
            "releasing an unfinished slot"
        );
        // SAFETY: (3) of target_mut: the phase is Done and this thread holds
        // the lock; it sets Free below before anyone else can claim it.
        let target = unsafe { self.slot.target_mut().take() };
        self.state.phase = Phase::Free;
        target
    }

    /// Waits for a phase change (`notify`), at most `bound`.
    pub fn wait_timeout(self, bound: Duration) -> Self {
        let slot = self.slot;
        let state = slot
            .done
            .wait_timeout(self.state, bound)
            .unwrap_or_else(|e| e.into_inner())
            .0;
        SlotGuard { slot, state }
    }

    /// Wakes every thread waiting on this slot.
    pub fn notify(&self) {
        self.slot.done.notify_all();
    }
}

impl<T> std::ops::Deref for SlotGuard<'_, T> {
    type Target = SlotState;
    fn deref(&self) -> &SlotState {
        &self.state
    }
}

impl<T> std::ops::DerefMut for SlotGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut SlotState {
        &mut self.state
    }
}
