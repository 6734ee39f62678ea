//! The host tier's slot bookkeeping: each slot's state ([`SlotMeta`]),
//! the tables under the one mutex ([`Inner`]), the holds of the protocol in
//! the parent module's docs as values ([`Owned`], [`Pinned`], …), and
//! [`Shared`], which owns the slot memory (`memory.rs`: the only code that
//! touches it, through those holds), and chooses, claims and releases
//! slots (eviction).
//!
//! Slots `0..record_slots` hold a whole record each; the rest are compute
//! cells, each the size of one record's compute part, which hold an
//! expert's compute params only and are never dirty (`cells`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use lru::LruCache;

use super::{CacheStats, EvictionPolicy};
use crate::format::Layout;
use crate::io::HostRegion;
use crate::record::Parts;
use crate::schedule::Schedule;
use crate::store::ExpertStore;
use crate::timeline::Timeline;
use crate::{ExpertId, TierError};

mod cells;
pub(crate) use cells::Demotion;
mod memory;

pub(crate) use memory::{ReadInto, WriteFrom};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotState {
    Empty,
    Loading,
    Evicting,
    Ready,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotMeta {
    pub expert: Option<ExpertId>,
    /// The expert a slot in `Evicting` will hold next.
    pub incoming: Option<ExpertId>,
    pub state: SlotState,
    pub parts: Parts,
    pub pins: u32,
    pub writer: bool,
    pub upgrading: bool,
    pub writing_back: bool,
    /// The step to write back under, when the slot differs from the store.
    pub dirty: Option<u64>,
    /// The step the headers already carry checksums for (set by
    /// `WriteGuard::seal`), so a write-back of that step skips stamping.
    pub stamped: Option<u64>,
    /// The expert is one the tier keeps resident (`HostCache::keep_resident`):
    /// never evicted, written back only by a flush.
    pub kept: bool,
}

impl SlotMeta {
    pub const EMPTY: SlotMeta = SlotMeta {
        expert: None,
        incoming: None,
        state: SlotState::Empty,
        parts: Parts::Compute,
        pins: 0,
        writer: false,
        upgrading: false,
        writing_back: false,
        dirty: None,
        stamped: None,
        kept: false,
    };

    /// Whether an access to `parts` (a writer's when `write`) must wait:
    /// the slot is loading or evicting, another writer has it, a part it
    /// reads is arriving (the state part, for a full access; the compute
    /// part, for any reader), or (for a writer) it is pinned, being
    /// written back or having a part read in.
    pub fn busy_for(&self, parts: Parts, write: bool) -> bool {
        match self.state {
            SlotState::Loading | SlotState::Evicting => true,
            SlotState::Empty => unreachable!("a mapped slot is not empty"),
            SlotState::Ready => {
                let arriving = match self.parts {
                    Parts::State => true, // its compute part
                    _ => parts == Parts::Full,
                };
                self.writer
                    || (self.upgrading && (write || arriving))
                    || (write && (self.pins > 0 || self.writing_back))
            }
        }
    }

    /// Free to be given to another expert (after a write-back if dirty).
    /// An empty slot with pins is a cell its expert left while read (see
    /// `Shared::leave_cell`): free once its last reader is done.
    pub fn evictable(&self) -> bool {
        match self.state {
            SlotState::Empty => self.pins == 0,
            SlotState::Ready => {
                !self.kept
                    && self.pins == 0
                    && !self.writer
                    && !self.upgrading
                    && !self.writing_back
            }
            SlotState::Loading | SlotState::Evicting => false,
        }
    }
}

pub(crate) struct Inner {
    pub slots: Vec<SlotMeta>,
    pub by_expert: HashMap<ExpertId, usize>,
    /// Slot recency, most recent first.
    pub recency: LruCache<usize, ()>,
    pub schedule: Schedule,
    /// Experts kept resident once loaded (at most the slots less
    /// `MIN_STREAMING_SLOTS`).
    pub keep: HashSet<ExpertId>,
    /// Experts whose last prefetch failed (a damaged record, an I/O
    /// error): the prefetcher leaves them to demand loads, which report
    /// the error, instead of retrying them forever. A load that succeeds
    /// takes its expert off. At most one entry an expert.
    pub prefetch_failed: HashSet<ExpertId>,
    pub stats: CacheStats,
    pub stop: bool,
}

/// The two sizes of slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SlotKind {
    /// A whole record.
    Record,
    /// One record's compute part.
    Cell,
}

/// The slot protocol's holds (`cache` module docs) as values. Each is made
/// only by the function here that sets its state under the lock, and ended
/// by the one that clears it; `memory.rs` reaches a slot's bytes only
/// through one. None is `Clone`.
///
/// The whole slot, for the thread loading it (`Loading`) or writing its
/// old record back before loading it (`Evicting`).
pub(crate) struct Owned {
    slot: usize,
}

/// One of a slot's pins: shared reads of its payloads.
pub(crate) struct Pinned {
    slot: usize,
}

/// The part a slot lacks (its state part, or the compute part of one
/// loaded for an update), for the thread reading it in (`upgrading`).
pub(crate) struct Upgrading {
    slot: usize,
    part: Parts,
}

impl Upgrading {
    /// The part being read in.
    pub fn part(&self) -> Parts {
        self.part
    }
}

/// A slot's headers and reads of its payloads, for the thread writing it
/// back in place (`writing_back`).
pub(crate) struct WritingBack {
    slot: usize,
}

/// A slot's payloads and headers, for its one writer (`writer`).
pub(crate) struct Writing {
    slot: usize,
}

pub(crate) struct Shared {
    pub store: Arc<ExpertStore>,
    pub(super) region: HostRegion,
    pub slot_bytes: usize,
    /// Slots `0..record_slots` hold records; the others are compute cells.
    pub record_slots: usize,
    /// A compute cell's bytes: the layout's compute part.
    pub cell_bytes: usize,
    pub layout: Layout,
    pub policy: EvictionPolicy,
    pub ahead_max: usize,
    pub batch_max: usize,
    pub timeline: Option<Arc<Timeline>>,
    /// Whether `region` is registered with the store's I/O engine.
    pub(super) registered: bool,
    /// Whether records ever leave this tier: it has fewer slots than the
    /// store has records.
    pub(super) evicts: bool,
    pub(super) inner: Mutex<Inner>,
    pub changed: Condvar,
}

impl Drop for Shared {
    fn drop(&mut self) {
        if self.registered {
            // Before `region` is freed: no stale registration may outlive it.
            self.store.unregister_host_region();
        }
    }
}

impl Shared {
    pub fn registered(&self) -> bool {
        self.registered
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn wait<'a>(&self, guard: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        self.changed.wait(guard).unwrap_or_else(|e| e.into_inner())
    }

    /// `wait`, for at most `timeout`.
    pub fn wait_timeout<'a>(
        &self,
        guard: MutexGuard<'a, Inner>,
        timeout: Duration,
    ) -> MutexGuard<'a, Inner> {
        match self.changed.wait_timeout(guard, timeout) {
            Ok((g, _)) => g,
            Err(e) => e.into_inner().0,
        }
    }

    pub fn kind(&self, slot: usize) -> SlotKind {
        if slot < self.record_slots {
            SlotKind::Record
        } else {
            SlotKind::Cell
        }
    }

    /// The bytes a slot spans: a record or a compute part.
    pub fn size_of(&self, slot: usize) -> usize {
        match self.kind(slot) {
            SlotKind::Record => self.slot_bytes,
            SlotKind::Cell => self.cell_bytes,
        }
    }

    /// Dirty slots to write back ahead of their eviction, while the
    /// prefetcher has nothing to load: those whose expert the schedule next
    /// reads (a compute access, or none) rather than updates, so a record
    /// is not written twice for one update where the tier keeps it until
    /// its next one, soonest read first (in a cyclic schedule, the first
    /// to be evicted after it), at most `max`. Marks them `writing_back`
    /// and returns their jobs (slot, expert, step).
    pub fn claim_early_write_backs(
        &self,
        inner: &mut Inner,
        max: usize,
    ) -> Vec<(WritingBack, ExpertId, u64)> {
        if !self.evicts {
            return Vec::new(); // nothing is ever evicted: flushes write
        }
        let mut found: Vec<(usize, usize, ExpertId, u64)> = Vec::new();
        for (slot, m) in inner.slots.iter().enumerate() {
            let (Some(expert), Some(step)) = (m.expert, m.dirty) else {
                continue;
            };
            if m.state != SlotState::Ready || m.writer || m.writing_back || m.upgrading || m.kept {
                continue; // busy, or never evicted: a flush writes it
            }
            let distance = inner.schedule.distance(expert);
            let next = distance.and_then(|d| inner.schedule.upcoming(d));
            if matches!(next, Some((_, Parts::Full | Parts::State))) {
                continue;
            }
            found.push((distance.unwrap_or(usize::MAX), slot, expert, step));
        }
        found.sort_unstable_by_key(|f| f.0);
        found.truncate(max);
        found
            .into_iter()
            .map(|(_, slot, expert, step)| {
                inner.slots[slot].writing_back = true;
                (WritingBack { slot }, expert, step)
            })
            .collect()
    }

    /// Every dirty slot, set `writing_back` for a flush on this thread, once
    /// no load, eviction or write-back is under way. Fails if a dirty
    /// expert is held by a writer.
    pub fn begin_flush<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner>,
    ) -> Result<Vec<(WritingBack, ExpertId, u64)>, TierError> {
        loop {
            let transient = inner.slots.iter().any(|m| {
                matches!(m.state, SlotState::Loading | SlotState::Evicting) || m.writing_back
            });
            if !transient {
                break;
            }
            inner = self.wait(inner);
        }
        if let Some(m) = inner.slots.iter().find(|m| m.dirty.is_some() && m.writer) {
            let expert = m.expert.expect("a dirty slot holds an expert");
            return Err(TierError::DirtyExpertHeld { expert });
        }
        let mut jobs = Vec::new();
        for (slot, m) in inner.slots.iter_mut().enumerate() {
            if let (Some(expert), Some(step)) = (m.expert, m.dirty) {
                m.writing_back = true;
                jobs.push((WritingBack { slot }, expert, step));
            }
        }
        Ok(jobs)
    }

    /// Sets a ready slot `upgrading`: this thread reads in the part it
    /// lacks (its state part where it holds compute params, its compute
    /// part where it holds the state part alone).
    pub fn begin_upgrade(&self, inner: &mut Inner, slot: usize) -> Upgrading {
        let m = &mut inner.slots[slot];
        assert!(m.state == SlotState::Ready && !m.upgrading && !m.writer);
        let part = match m.parts {
            Parts::Compute => Parts::State,
            Parts::State => Parts::Compute,
            Parts::Full => unreachable!("a full record lacks no part"),
        };
        m.upgrading = true;
        Upgrading { slot, part }
    }

    /// Ends an upgrade; with `read`, the slot now holds its full record.
    pub fn end_upgrade(&self, inner: &mut Inner, hold: Upgrading, read: bool) {
        let m = &mut inner.slots[hold.slot];
        m.upgrading = false;
        if read {
            m.parts = Parts::Full;
            inner.stats.loads += 1;
            inner.stats.bytes_read += hold.part.range(&self.layout).len() as u64;
        }
    }

    /// Pins a slot: shared reads of its payloads until `unpin`.
    pub fn pin(&self, inner: &mut Inner, slot: usize) -> Pinned {
        inner.slots[slot].pins += 1;
        Pinned { slot }
    }

    pub fn unpin(&self, inner: &mut Inner, pin: Pinned) {
        let m = &mut inner.slots[pin.slot];
        assert!(m.pins > 0, "unpinning an unpinned slot");
        m.pins -= 1;
    }

    /// Makes this thread the slot's one writer (its payloads are about to
    /// change, so its stamp is stale).
    pub fn take_writer(&self, inner: &mut Inner, slot: usize) -> Writing {
        let m = &mut inner.slots[slot];
        assert!(!m.writer && m.pins == 0, "taking a busy slot's writer");
        m.writer = true;
        m.stamped = None;
        Writing { slot }
    }

    /// Ends a writer's hold; with `sealed`, as `expert`'s record of that
    /// step (dirty, and stamped if `stamped`), every payload written.
    pub fn release_writer(&self, inner: &mut Inner, writer: Writing, sealed: Option<(u64, bool)>) {
        let m = &mut inner.slots[writer.slot];
        assert!(m.writer, "releasing a slot without its writer");
        m.writer = false;
        if let Some((step, stamped)) = sealed {
            m.dirty = Some(step);
            m.stamped = stamped.then_some(step);
            m.parts = Parts::Full;
        }
    }

    /// Marks a writer's slot dirty as of `step`, every payload written.
    pub fn mark_written(&self, inner: &mut Inner, writer: &Writing, step: u64) {
        let m = &mut inner.slots[writer.slot];
        assert!(m.writer, "marking a slot without its writer");
        m.dirty = Some(step);
        m.stamped = None;
        m.parts = Parts::Full;
    }

    /// The slot of `kind` to give to a new expert, by policy, among
    /// evictable slots; with `protect_within`, only slots whose expert is
    /// not needed within that many scheduled accesses.
    pub fn choose_victim(
        &self,
        inner: &Inner,
        protect_within: Option<usize>,
        kind: SlotKind,
    ) -> Option<usize> {
        let range = match kind {
            SlotKind::Record => 0..self.record_slots,
            SlotKind::Cell => self.record_slots..inner.slots.len(),
        };
        let free = |slot: &usize| {
            let m = &inner.slots[*slot];
            m.state == SlotState::Empty && m.evictable()
        };
        if let Some(empty) = range.clone().find(free) {
            return Some(empty);
        }
        let allowed = |slot: usize| {
            let m = &inner.slots[slot];
            if !range.contains(&slot) || !m.evictable() || m.state == SlotState::Empty {
                return false;
            }
            match (protect_within, m.expert) {
                (Some(limit), Some(e)) => inner.schedule.distance(e).is_none_or(|d| d > limit),
                _ => true,
            }
        };
        match self.policy {
            EvictionPolicy::Lru => inner
                .recency
                .iter()
                .rev()
                .map(|(&slot, _)| slot)
                .find(|&slot| allowed(slot)),
            EvictionPolicy::ScheduleDistance => range
                .clone()
                .filter(|&slot| allowed(slot))
                .max_by_key(|&slot| {
                    let e = inner.slots[slot]
                        .expert
                        .expect("ready slots hold an expert");
                    // Never used again sorts after every distance.
                    inner.schedule.distance(e).map_or(usize::MAX, |d| d)
                }),
        }
    }

    /// Gives `slot` to `expert`: `Loading` if it can be read at once, or
    /// `Evicting` (with `expert` incoming) if its dirty contents must be
    /// written back first. Returns the hold and the write-back job (the
    /// old expert and its step), if any.
    pub fn claim(
        &self,
        inner: &mut Inner,
        slot: usize,
        expert: ExpertId,
        parts: Parts,
    ) -> (Owned, Option<(ExpertId, u64)>) {
        let old = inner.slots[slot];
        assert!(old.evictable(), "claiming a busy slot");
        assert!(
            self.kind(slot) == SlotKind::Record || parts == Parts::Compute,
            "a compute cell holds compute params only"
        );
        inner.by_expert.insert(expert, slot);
        if let Some(prev) = old.expert {
            inner.stats.evictions += 1;
            if old.dirty.is_none() {
                inner.by_expert.remove(&prev);
            }
        }
        let meta = &mut inner.slots[slot];
        meta.parts = parts;
        match (old.expert, old.dirty) {
            (Some(prev), Some(step)) => {
                meta.state = SlotState::Evicting;
                meta.incoming = Some(expert);
                (Owned { slot }, Some((prev, step)))
            }
            _ => {
                *meta = SlotMeta {
                    expert: Some(expert),
                    state: SlotState::Loading,
                    parts,
                    ..SlotMeta::EMPTY
                };
                (Owned { slot }, None)
            }
        }
    }

    /// After a write-back: the slot now belongs to its incoming expert.
    pub fn evicted(&self, inner: &mut Inner, hold: &Owned) {
        let slot = hold.slot;
        let meta = inner.slots[slot];
        assert_eq!(meta.state, SlotState::Evicting);
        let prev = meta.expert.expect("an evicting slot holds an expert");
        inner.by_expert.remove(&prev);
        inner.stats.write_backs += 1;
        inner.stats.bytes_written += self.layout.record_bytes();
        inner.slots[slot] = SlotMeta {
            expert: meta.incoming,
            state: SlotState::Loading,
            parts: meta.parts,
            ..SlotMeta::EMPTY
        };
    }

    /// After a load that read `read` (the parts claimed, or their state
    /// part where the compute part was copied from a cell): the slot is
    /// ready.
    pub fn loaded(&self, inner: &mut Inner, hold: Owned, read: Parts) {
        let slot = hold.slot;
        let meta = &mut inner.slots[slot];
        assert_eq!(meta.state, SlotState::Loading);
        meta.state = SlotState::Ready;
        meta.kept = self.kind(slot) == SlotKind::Record
            && meta.expert.is_some_and(|e| inner.keep.contains(&e));
        // Nearly always empty: no hash on the common path.
        if let Some(expert) = meta.expert.filter(|_| !inner.prefetch_failed.is_empty()) {
            inner.prefetch_failed.remove(&expert);
        }
        let bytes = read.range(&self.layout).len() as u64;
        inner.stats.loads += 1;
        inner.stats.bytes_read += bytes;
        inner.recency.put(slot, ());
    }

    /// After a failed load or write-back: the slot is empty again.
    pub fn abandon(&self, inner: &mut Inner, hold: Owned) {
        let slot = hold.slot;
        let meta = inner.slots[slot];
        for e in [meta.expert, meta.incoming].into_iter().flatten() {
            if inner.by_expert.get(&e) == Some(&slot) {
                inner.by_expert.remove(&e);
            }
        }
        inner.slots[slot] = SlotMeta::EMPTY;
        inner.recency.pop(&slot);
    }
}

/// An expert and the parts of its record, as a timeline shows them.
pub(crate) fn expert_detail(expert: ExpertId, parts: Parts) -> String {
    let parts = match parts {
        Parts::Compute => "compute",
        Parts::Full => "full",
        Parts::State => "state",
    };
    format!("{expert} {parts}")
}
