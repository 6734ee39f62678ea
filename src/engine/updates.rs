//! What every device of an engine shares: the host and SSD tiers, the CPU
//! optimizer, and each expert's update bookkeeping (its step count, whether
//! its update is in flight, its gradient summed over earlier micro-batches).
//!
//! Each expert is computed by one device per layer and micro-batch, so the
//! bookkeeping is per expert and a short lock keeps devices apart; nothing
//! is held locked while waiting for an update or a record.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use strata_optim::{AdamWHyper, ExpertOptimizer};
use strata_tiers::{ExpertId, HostCache, Layout, TierError, Timeline};

use super::grad_buffers::GradBuffers;
use super::update::{ExpertGradient, ExpertUpdate};
use super::ScheduleKind;
use crate::backend::ArrivingGradient;
use crate::comm::Comm;
use crate::EngineError;

/// How long an acquire waits for other devices to release host slots
/// before it reports the host budget as too small.
const HOST_SLOT_WAIT: Duration = Duration::from_secs(30);

/// When an expert's complete gradient goes to the optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum When {
    /// As the schedule says: now on the expert-wise schedule; at the end
    /// of the backward on the naive one; at the expert's next forward if
    /// its updates are held (`EngineConfig::defer_last_layer_updates`).
    Scheduled,
    /// Now, with the hyperparameters set now.
    Now,
}

/// The updates one device has in flight at most on the expert-wise
/// schedule: a layer's experts (at least 2), so that a layer's updates run
/// beside the next layer's backward. A device past it waits for its
/// oldest update before it submits another (`DeviceRunner::expert_gradient`):
/// each update holds its expert's gradient, and an optimizer slower than
/// the backward would otherwise hold one for every expert of the model.
pub(crate) fn updates_in_flight_max(experts_per_layer: usize) -> usize {
    experts_per_layer.max(2)
}

/// What clipping the global gradient norm needs from the dense side.
pub(crate) struct ClipInput<'a> {
    pub max_norm: f32,
    /// Σ g² over the dense gradient, in f64.
    pub dense_norm_sq: f64,
    /// On ranks as processes, the endpoint to the others, whose experts'
    /// squares count too.
    pub ranks: Option<&'a mut dyn Comm>,
}

/// The global norm and the factor every gradient was multiplied by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Clipped {
    pub norm: f64,
    pub scale: f32,
}

impl ClipInput<'_> {
    /// Sums the experts' squares in key order (so the norm does not depend
    /// on which device finished first, nor on which rank holds an expert),
    /// and scales every expert gradient by min(1, max / (norm + 1e-6)), as
    /// torch's clip_grad_norm_.
    fn apply(self, experts: &mut [(usize, Vec<f32>)]) -> Result<Clipped, EngineError> {
        experts.sort_unstable_by_key(|(key, _)| *key);
        let mut squares: Vec<(usize, f64)> = experts
            .iter()
            .map(|(key, g)| (*key, g.iter().map(|&x| x as f64 * x as f64).sum::<f64>()))
            .collect();
        if let Some(comm) = self.ranks {
            squares = every_ranks_squares(comm, &squares)?;
        }
        let experts_sq: f64 = squares.iter().map(|(_, sq)| sq).sum();
        let norm = (self.dense_norm_sq + experts_sq).sqrt();
        let coef = self.max_norm as f64 / (norm + 1e-6);
        let scale = if coef < 1.0 { coef as f32 } else { 1.0 };
        if scale < 1.0 {
            for (_, g) in experts.iter_mut() {
                g.iter_mut().for_each(|x| *x *= scale);
            }
        }
        Ok(Clipped { norm, scale })
    }
}

/// Every rank's (expert key, Σ g²), in key order.
fn every_ranks_squares(
    comm: &mut dyn Comm,
    mine: &[(usize, f64)],
) -> Result<Vec<(usize, f64)>, EngineError> {
    let words = mine
        .iter()
        .flat_map(|&(key, sq)| {
            let bits = sq.to_bits();
            [key as u32, bits as u32, (bits >> 32) as u32]
        })
        .collect();
    let mut all: Vec<(usize, f64)> = comm
        .all_gather_u32(words)?
        .iter()
        .flat_map(|w| w.chunks_exact(3))
        .map(|w| {
            let bits = u64::from(w[1]) | u64::from(w[2]) << 32;
            (w[0] as usize, f64::from_bits(bits))
        })
        .collect();
    all.sort_unstable_by_key(|&(key, _)| key);
    Ok(all)
}

/// Which held updates [`SharedExperts::release_held`] submits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Held {
    /// Every one: before anything but a forward reads those experts'
    /// params (a drain, a checkpoint).
    All,
    /// `key`'s, if held: just before its forward.
    Of(usize),
    /// `key`'s, if held and its full record is already in host memory,
    /// free to write: an update started ahead of its forward, beside the
    /// compute before it. It never waits for a load.
    OfIfReady(usize),
}

/// Per expert (key = `ExpertId::dense_index`).
pub(crate) struct UpdateBook {
    /// Its AdamW step count: the version of its params.
    pub steps: Vec<u64>,
    /// Submitted to the optimizer and not yet taken back.
    pub pending: Vec<bool>,
    /// Gradient summed over the step's earlier micro-batches.
    pub grad_accum: Vec<Option<Vec<f32>>>,
    /// Naive schedule: updates held until the backward pass is over.
    pub until_backward_ends: Vec<(usize, Vec<f32>)>,
    /// The complete gradients of experts whose updates wait for their next
    /// forward (`EngineConfig::defer_last_layer_updates`), until
    /// `release_held`, each with the hyperparameters of the step that
    /// computed it (a schedule sets the next step's before the held
    /// update runs).
    pub held: Vec<(usize, Vec<f32>, AdamWHyper)>,
    /// While a gradient-only pass runs (`Engine::gradients`): each
    /// expert's complete gradient, kept instead of submitted.
    pub collected: Option<Vec<Option<Vec<f32>>>>,
}

pub(crate) struct SharedExperts {
    pub experts_per_layer: usize,
    /// Device workers sharing these tiers.
    pub devices: usize,
    pub schedule: ScheduleKind,
    pub layout: Layout,
    pub cache: HostCache,
    pub optimizer: ExpertOptimizer<ExpertUpdate>,
    /// Expert gradients, reused once their update (or sum) is done.
    pub grads: GradBuffers,
    /// Where passes and updates are recorded (`EngineConfig::timeline`).
    pub timeline: Option<Arc<Timeline>>,
    /// Whether experts update (`EngineConfig::train_experts`); frozen
    /// experts' gradients are dropped at submission.
    pub train: bool,
    /// Per expert: whether its updates wait for the next step's forward
    /// (set once, before the first step).
    defers: Vec<bool>,
    book: Mutex<UpdateBook>,
}

impl SharedExperts {
    pub fn new(
        experts_per_layer: usize,
        devices: usize,
        schedule: ScheduleKind,
        layout: Layout,
        cache: HostCache,
        optimizer: ExpertOptimizer<ExpertUpdate>,
        steps: Vec<u64>,
    ) -> Self {
        let n = steps.len();
        // At most one gradient per expert is alive outside a backward in
        // progress (summed, held or being applied), plus one per device.
        let grads = GradBuffers::new(layout.params_per_expert as usize, n + devices);
        Self {
            experts_per_layer,
            devices,
            schedule,
            layout,
            cache,
            optimizer,
            grads,
            timeline: None,
            train: true,
            defers: vec![false; n],
            book: Mutex::new(UpdateBook {
                steps,
                pending: vec![false; n],
                grad_accum: vec![None; n],
                until_backward_ends: Vec::new(),
                held: Vec::new(),
                collected: None,
            }),
        }
    }

    pub fn book(&self) -> MutexGuard<'_, UpdateBook> {
        // A device thread that panicked mid-step poisons the lock; its
        // bookkeeping is per expert and was complete before each release.
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The expert of table row `key` (layer-major, as the store numbers
    /// its slots).
    pub fn expert_id(&self, key: usize) -> ExpertId {
        ExpertId::from_dense_index(key, self.experts_per_layer)
    }

    pub fn expert_count(&self) -> usize {
        self.book().steps.len()
    }

    /// An expert's version (step count) once no update of it is in flight.
    pub fn version(&self, key: usize) -> u64 {
        self.book().steps[key]
    }

    /// Keeps in `keys` those whose updates are in flight and not yet
    /// claimed by a wait (one look at the book for all of them).
    pub fn retain_pending(&self, keys: &mut VecDeque<usize>) {
        let book = self.book();
        keys.retain(|&key| book.pending[key]);
    }

    /// Waits for `key`'s update if one is in flight; returns the seconds
    /// waited (0 when none was).
    pub fn wait_update(&self, key: usize) -> Result<f64, EngineError> {
        {
            let mut book = self.book();
            if !book.pending[key] {
                return Ok(0.0);
            }
            // Claimed: no other device waits for it or reaps it.
            book.pending[key] = false;
        }
        let t0 = Instant::now();
        let (target, _) = self.optimizer.wait(self.expert_id(key))?;
        self.book().steps[key] = target.step;
        self.give_gradient(target.grad);
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Takes back every update that has already finished (without waiting),
    /// recording its step; its host slot was handed back as it finished.
    pub fn reap_finished(&self) -> Result<(), EngineError> {
        let mut book = self.book();
        for key in 0..book.pending.len() {
            if !book.pending[key] {
                continue;
            }
            if let Some((target, _)) = self.optimizer.try_wait(self.expert_id(key))? {
                book.pending[key] = false;
                book.steps[key] = target.step;
                self.give_gradient(target.grad);
            }
        }
        Ok(())
    }

    /// A finished update's gradient buffer, back to where it came from.
    fn give_gradient(&self, grad: ExpertGradient) {
        match grad {
            ExpertGradient::Host(grad) => self.grads.give(grad),
            // Its buffer goes back to its device; a sum it was not added
            // onto (the update failed first) to the pool.
            ExpertGradient::Arriving { onto, .. } => {
                onto.into_iter().for_each(|g| self.grads.give(g))
            }
        }
    }

    /// Waits for every update in flight; returns the seconds waited.
    pub fn drain(&self) -> Result<f64, EngineError> {
        let t0 = Instant::now();
        for key in 0..self.expert_count() {
            self.wait_update(key)?;
        }
        Ok(t0.elapsed().as_secs_f64())
    }

    /// Adds this micro-batch's gradient of `key` to the earlier ones (in
    /// micro-batch order); on the last micro-batch returns the sum.
    pub fn accumulate(&self, key: usize, grad: Vec<f32>, last: bool) -> Option<Vec<f32>> {
        let mut book = self.book();
        let grad = match book.grad_accum[key].take() {
            Some(mut sum) => {
                sum.iter_mut().zip(&grad).for_each(|(s, g)| *s += g);
                self.grads.give(grad);
                sum
            }
            None => grad,
        };
        if last {
            Some(grad)
        } else {
            book.grad_accum[key] = Some(grad);
            None
        }
    }

    /// Holds the updates of `experts` from their backward until
    /// `release_held` (see `EngineConfig::defer_last_layer_updates`).
    pub fn defer_updates(&mut self, experts: &[ExpertId]) {
        for e in experts {
            let key = e.dense_index(self.experts_per_layer);
            self.defers[key] = true;
        }
    }

    /// Hands an expert's complete gradient to the optimizer `when` says;
    /// returns the seconds spent waiting for host slots held by updates.
    pub fn submit(&self, key: usize, grad: Vec<f32>, when: When) -> Result<f64, EngineError> {
        if let Some(collected) = self.book().collected.as_mut() {
            collected[key] = Some(grad);
            return Ok(0.0);
        }
        if !self.train {
            self.grads.give(grad); // frozen experts
            return Ok(0.0);
        }
        if when == When::Scheduled {
            let mut book = self.book();
            if self.schedule == ScheduleKind::Naive {
                book.until_backward_ends.push((key, grad));
                return Ok(0.0);
            }
            if self.defers[key] {
                book.held.push((key, grad, self.optimizer.hyper()));
                return Ok(0.0);
            }
        }
        self.submit_with(key, ExpertGradient::Host(grad), self.optimizer.hyper())
    }

    /// Whether `key`'s gradient of its last micro-batch completes it and
    /// goes to the optimizer at once: no holding schedule, no pass
    /// collecting gradients. Such a gradient may be handed over still
    /// arriving ([`Self::submit_arriving`]).
    pub fn submits_at_once(&self, key: usize, last_micro_batch: bool) -> bool {
        if !(last_micro_batch && self.train) || self.schedule == ScheduleKind::Naive {
            return false;
        }
        !self.defers[key] && self.book().collected.is_none()
    }

    /// Hands `key`'s last micro-batch's gradient, still coming down from
    /// its device, to the optimizer, whose worker waits for it and adds it
    /// onto the earlier micro-batches' sum; only where
    /// [`Self::submits_at_once`]. Returns the seconds spent waiting for
    /// host slots held by updates.
    pub fn submit_arriving(
        &self,
        key: usize,
        last: Box<dyn ArrivingGradient>,
    ) -> Result<f64, EngineError> {
        let onto = self.book().grad_accum[key].take();
        let grad = ExpertGradient::Arriving { last, onto };
        self.submit_with(key, grad, self.optimizer.hyper())
    }

    /// Submits the held updates `which` names (each with the
    /// hyperparameters of the step that computed its gradient); returns
    /// the seconds spent waiting for their records' host slots.
    pub fn release_held(&self, which: Held) -> Result<f64, EngineError> {
        let (key, only_if_ready) = match which {
            Held::All => return self.release_all_held(),
            Held::Of(key) => (key, false),
            Held::OfIfReady(key) => (key, true),
        };
        if !self.defers[key] {
            return Ok(0.0); // nothing to look for, and no lock to take
        }
        if only_if_ready && !self.cache.ready_to_update(self.expert_id(key)) {
            return Ok(0.0);
        }
        let (_, grad, hyper) = {
            let mut book = self.book();
            match book.held.iter().position(|(k, ..)| *k == key) {
                Some(i) => book.held.swap_remove(i),
                None => return Ok(0.0),
            }
        };
        self.submit_with(key, ExpertGradient::Host(grad), hyper)
    }

    /// Every held update, in the order their gradients came.
    fn release_all_held(&self) -> Result<f64, EngineError> {
        let mut held = std::mem::take(&mut self.book().held).into_iter();
        let mut stall = 0.0;
        while let Some((key, grad, hyper)) = held.next() {
            match self.submit_with(key, ExpertGradient::Host(grad), hyper) {
                Ok(waited) => stall += waited,
                Err(e) => {
                    // The rest stay held for a later call.
                    self.book().held.extend(held);
                    return Err(e);
                }
            }
        }
        Ok(stall)
    }

    /// Experts whose updates wait for the next step's forward.
    pub fn deferred_count(&self) -> usize {
        self.defers.iter().filter(|&&d| d).count()
    }

    /// The experts whose updates wait for their next forward.
    pub fn deferring(&self) -> HashSet<ExpertId> {
        (0..self.defers.len())
            .filter(|&key| self.defers[key])
            .map(|key| self.expert_id(key))
            .collect()
    }

    /// The experts with an update held now.
    pub fn held(&self) -> HashSet<ExpertId> {
        let book = self.book();
        book.held
            .iter()
            .map(|(key, ..)| self.expert_id(*key))
            .collect()
    }

    /// Acquires through the host tier. When every host slot is pinned it
    /// waits for the updates in flight (which hold theirs) and tries again;
    /// with several devices, other devices' uploads may hold the rest, and
    /// those end on their own, so the retry waits up to `HOST_SLOT_WAIT`
    /// for one to be released. Returns the guard and the seconds waited.
    pub fn acquire<G>(
        &self,
        mut acquire: impl FnMut(&HostCache, Duration) -> Result<G, TierError>,
    ) -> Result<(G, f64), EngineError> {
        match acquire(&self.cache, Duration::ZERO) {
            Err(TierError::AllSlotsPinned { .. }) => {
                let t0 = Instant::now();
                self.drain()?;
                let pin_wait = if self.devices > 1 {
                    HOST_SLOT_WAIT
                } else {
                    Duration::ZERO
                };
                let guard = acquire(&self.cache, pin_wait)?;
                Ok((guard, t0.elapsed().as_secs_f64()))
            }
            other => Ok((other?, 0.0)),
        }
    }

    /// Hands `key`'s gradient to the optimizer now, with `hyper`.
    fn submit_with(
        &self,
        key: usize,
        grad: ExpertGradient,
        hyper: AdamWHyper,
    ) -> Result<f64, EngineError> {
        self.reap_finished()?;
        let expert = self.expert_id(key);
        let (guard, stall) =
            self.acquire(|cache, wait| cache.acquire_to_update_within(expert, wait))?;
        let step = self.book().steps[key];
        let target = ExpertUpdate {
            guard,
            grad,
            step,
            dtype: self.layout.compute_dtype,
            timeline: self.timeline.clone(),
            started: None,
        };
        self.optimizer.submit_with(expert, target, hyper)?;
        self.book().pending[key] = true;
        Ok(stall)
    }

    /// The end of a step's backward: experts touched only by earlier
    /// micro-batches, then (naive schedule) every held update, each
    /// gradient clipped with the dense one's where `clip` says. Returns the
    /// seconds stalled and the clipping (`None` without `clip`).
    pub fn finish_step(
        &self,
        clip: Option<ClipInput<'_>>,
    ) -> Result<(f64, Option<Clipped>), EngineError> {
        let mut stall = 0.0;
        let leftovers: Vec<(usize, Vec<f32>)> = {
            let mut book = self.book();
            (0..book.grad_accum.len())
                .filter_map(|key| book.grad_accum[key].take().map(|g| (key, g)))
                .collect()
        };
        for (key, grad) in leftovers {
            stall += self.submit(key, grad, When::Scheduled)?;
        }
        let mut clipped = None;
        if self.schedule == ScheduleKind::Naive {
            let mut ended = std::mem::take(&mut self.book().until_backward_ends);
            if let Some(clip) = clip {
                let c = clip.apply(&mut ended)?;
                clipped = Some(c);
            }
            for (key, grad) in ended {
                stall += self.submit(key, grad, When::Now)?;
            }
            self.drain()?;
        }
        Ok((stall, clipped))
    }

    /// From now on, complete expert gradients are kept, not submitted.
    pub fn collect_gradients(&self) {
        let n = self.expert_count();
        self.book().collected = Some(vec![None; n]);
    }

    /// The gradients kept since `collect_gradients` (`None`: an expert no
    /// token reached); submitting resumes.
    pub fn take_collected(&self) -> Vec<Option<Vec<f32>>> {
        self.book().collected.take().unwrap_or_default()
    }

    /// A failed step leaves no partial gradient behind for the next.
    pub fn discard_partial(&self) {
        let mut book = self.book();
        let book = &mut *book;
        let summed = book.grad_accum.iter_mut().filter_map(Option::take);
        let held = book.until_backward_ends.drain(..).map(|(_, g)| g);
        summed.chain(held).for_each(|grad| self.grads.give(grad));
        book.collected = None;
    }
}
