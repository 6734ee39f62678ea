//! The host tier's slot bookkeeping: each slot's state ([`SlotMeta`]),
//! the tables under the one mutex ([`Inner`]), and [`Shared`], which owns
//! the slot memory and hands out byte ranges of it under the protocol in
//! the parent module's docs, reads and writes slots through the store, and
//! chooses, claims and releases slots (eviction).
//!
//! Slots `0..record_slots` hold a whole record each; the rest are compute
//! cells, each the size of one record's compute part, which hold an
//! expert's compute params only and are never dirty (`cells`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use lru::LruCache;

use super::{CacheStats, EvictionPolicy};
use crate::format::{Layout, PART_HEADER_BYTES};
use crate::io::HostRegion;
use crate::record::Parts;
use crate::schedule::Schedule;
use crate::store::{stamp_headers, ExpertStore};
use crate::timeline::{Timeline, TimelineSpan};
use crate::{ExpertId, TierError};

mod cells;

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
    /// the slot is loading or evicting, another writer has it, its state
    /// part is arriving for a full access, or (for a writer) it is pinned
    /// or being written back.
    pub fn busy_for(&self, parts: Parts, write: bool) -> bool {
        match self.state {
            SlotState::Loading | SlotState::Evicting => true,
            SlotState::Empty => unreachable!("a mapped slot is not empty"),
            SlotState::Ready => {
                self.writer
                    || (parts == Parts::Full && self.upgrading)
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

// SAFETY: slot memory is only reached through the protocol in the `cache`
// module docs, every step of which is ordered by the `inner` mutex.
unsafe impl Sync for Shared {}
// SAFETY: the region is a plain owned allocation.
unsafe impl Send for Shared {}

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

    fn slot_ptr(&self, slot: usize) -> *mut u8 {
        let offset = match self.kind(slot) {
            SlotKind::Record => slot * self.slot_bytes,
            SlotKind::Cell => {
                self.record_slots * self.slot_bytes + (slot - self.record_slots) * self.cell_bytes
            }
        };
        assert!(offset + self.size_of(slot) <= self.region.len());
        // SAFETY: in bounds of the region (asserted above).
        unsafe { self.region.as_ptr().add(offset) }
    }

    /// A byte range of a slot.
    ///
    /// # Safety
    /// The caller holds the access the slot protocol (`cache` module docs) gives for
    /// exactly this range, and no `&mut` to it exists meanwhile.
    pub unsafe fn bytes(&self, slot: usize, range: std::ops::Range<usize>) -> &[u8] {
        assert!(range.end <= self.size_of(slot));
        // SAFETY: in bounds (asserted); aliasing is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(slot).add(range.start), range.len()) }
    }

    /// A mutable byte range of a slot.
    ///
    /// # Safety
    /// The caller owns exactly this range under the slot protocol (`cache` module docs):
    /// no other reference to it exists while the result lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, slot: usize, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(range.end <= self.size_of(slot));
        // SAFETY: in bounds (asserted); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(slot).add(range.start), range.len()) }
    }

    /// The timeline an SSD call of `jobs` is recorded on (none for no jobs).
    fn timeline_for<T>(&self, jobs: &[T]) -> Option<&Timeline> {
        self.timeline.as_deref().filter(|_| !jobs.is_empty())
    }

    /// Reads `jobs` (slot, expert, parts) into their slots in one batch.
    ///
    /// # Safety
    /// Each slot is in a state that gives the caller its `parts` range
    /// (Loading for a whole load, `upgrading` for the state part).
    pub unsafe fn read_slots(&self, jobs: &[(usize, ExpertId, Parts)]) -> Result<(), TierError> {
        let mut requests: Vec<(ExpertId, Parts, &mut [u8])> = jobs
            .iter()
            .map(|&(slot, expert, parts)| {
                // SAFETY: the caller owns this slot's `parts` range.
                let buf = unsafe { self.bytes_mut(slot, parts.range(&self.layout)) };
                (expert, parts, buf)
            })
            .collect();
        let _span = TimelineSpan::start(self.timeline_for(jobs), "ssd", "read").with_detail(|| {
            let each = jobs.iter().map(|&(_, e, parts)| expert_detail(e, parts));
            each.collect::<Vec<_>>().join(", ")
        });
        self.store.read_many(&mut requests).map(|_| ())
    }

    /// Stamps headers and writes `jobs` (slot, expert, step) back.
    ///
    /// # Safety
    /// Each slot is `writing_back` or `Evicting` for the caller: it owns the
    /// two header ranges and may read the payloads.
    pub unsafe fn write_slots(&self, jobs: &[(usize, ExpertId, u64)]) -> Result<(), TierError> {
        let end = self.layout.record_bytes() as usize;
        let _span =
            TimelineSpan::start(self.timeline_for(jobs), "ssd", "write").with_detail(|| {
                let each = jobs.iter().map(|&(_, e, _)| e.to_string());
                each.collect::<Vec<_>>().join(", ")
            });
        let stamped: Vec<bool> = {
            let inner = self.lock();
            jobs.iter()
                .map(|&(slot, _, step)| inner.slots[slot].stamped == Some(step))
                .collect()
        };
        for (&(slot, expert, step), stamped) in jobs.iter().zip(stamped) {
            if !stamped {
                // SAFETY: the caller owns the headers and may read the
                // payloads (this function's contract).
                unsafe { self.stamp(slot, expert, step) };
            }
        }
        let records: Vec<(ExpertId, u64, &[u8])> = jobs
            .iter()
            // SAFETY: the whole record is only read from here on.
            .map(|&(slot, expert, step)| (expert, step, unsafe { self.bytes(slot, 0..end) }))
            .collect();
        self.store.write_stamped(&records)
    }

    /// Writes dirty slots back in place, as they stay resident: `jobs`
    /// (slot, expert, step) are slots this thread set `writing_back`; each
    /// is clean afterwards unless it changed meanwhile. Wakes waiters.
    ///
    /// # Safety
    /// Each job's slot is `writing_back` for the caller.
    pub unsafe fn write_back(&self, jobs: &[(usize, ExpertId, u64)]) -> Result<(), TierError> {
        // SAFETY: forwarded: the caller owns the headers as `writing_back`.
        let result = unsafe { self.write_slots(jobs) };
        let mut inner = self.lock();
        for &(slot, _, step) in jobs {
            let m = &mut inner.slots[slot];
            m.writing_back = false;
            if result.is_ok() && m.dirty == Some(step) {
                m.dirty = None;
            }
        }
        if result.is_ok() {
            inner.stats.write_backs += jobs.len() as u64;
            inner.stats.bytes_written += jobs.len() as u64 * self.layout.record_bytes();
        }
        drop(inner);
        self.changed.notify_all();
        result
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
    ) -> Vec<(usize, ExpertId, u64)> {
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
                (slot, expert, step)
            })
            .collect()
    }

    /// Checksums `slot`'s payloads into its two headers as `expert`'s
    /// record of `step`.
    ///
    /// # Safety
    /// The caller owns the slot's two header ranges and may read its
    /// payloads (no one writes them meanwhile).
    pub(super) unsafe fn stamp(&self, slot: usize, expert: ExpertId, step: u64) {
        let cpb = self.layout.compute_part_bytes() as usize;
        let end = self.layout.record_bytes() as usize;
        // SAFETY: headers are owned by the caller; payloads are only read
        // (readers may share them); the ranges are disjoint.
        unsafe {
            let compute_header = self.bytes_mut(slot, 0..PART_HEADER_BYTES);
            let compute_payload = self.bytes(slot, PART_HEADER_BYTES..cpb);
            let state_header = self.bytes_mut(slot, cpb..cpb + PART_HEADER_BYTES);
            let state_payload = self.bytes(slot, cpb + PART_HEADER_BYTES..end);
            stamp_headers(
                &self.layout,
                expert,
                step,
                compute_header,
                compute_payload,
                state_header,
                state_payload,
            );
        }
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
    /// written back first. Returns the write-back job, if any.
    pub fn claim(
        &self,
        inner: &mut Inner,
        slot: usize,
        expert: ExpertId,
        parts: Parts,
    ) -> Option<(usize, ExpertId, u64)> {
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
                Some((slot, prev, step))
            }
            _ => {
                *meta = SlotMeta {
                    expert: Some(expert),
                    state: SlotState::Loading,
                    parts,
                    ..SlotMeta::EMPTY
                };
                None
            }
        }
    }

    /// After a write-back: the slot now belongs to its incoming expert.
    pub fn evicted(&self, inner: &mut Inner, slot: usize) {
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
    pub fn loaded(&self, inner: &mut Inner, slot: usize, read: Parts) {
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
    pub fn abandon(&self, inner: &mut Inner, slot: usize) {
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
