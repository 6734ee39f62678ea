//! One in-flight expert update: its phase, its timings, and the caller's
//! buffers, held in place (never moved) from `submit` until `wait`.

use std::cell::UnsafeCell;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::adamw::{AdamWHyper, RawStep, StepScalars};
use crate::{ExpertId, OptimError};

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
    pub done: Condvar,
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
    pub fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
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
    pub unsafe fn target_mut(&self) -> &mut Option<T> {
        // SAFETY: exclusivity is the caller's contract (1–4 above).
        unsafe { &mut *self.target.get() }
    }
}
