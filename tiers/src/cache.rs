//! [`HostCache`]: the host tier. One allocation sized from
//! `host_budget_bytes` is carved into fixed-size slots, one expert record
//! each. Slots carry a pin count, a writer flag, a dirty step and a state;
//! eviction never touches a pinned, written or in-flight slot, and writes a
//! dirty one back before reuse. A prefetcher thread (`prefetch.rs`) walks
//! the access schedule and loads ahead of compute.
//!
//! Slot memory is shared between guards, the prefetcher and write-backs by
//! this protocol (all transitions under the one mutex):
//! - `Loading` / `Evicting`: the I/O thread that set it owns the whole slot;
//! - `Ready` + `writer`: the one `WriteGuard` owns the payloads;
//! - `Ready` + `upgrading`: an I/O thread fills the state part, while read
//!   guards of the compute part go on (disjoint bytes);
//! - `Ready` + `writing_back`: an I/O thread stamps the two 64-byte headers
//!   and reads the payloads; read guards go on (they never see headers).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lru::LruCache;

use crate::format::{Layout, PART_HEADER_BYTES};
use crate::io::{HostAllocator, HostRegion, PageAllocator};
use crate::record::{Parts, RecordMut};
use crate::schedule::Schedule;
use crate::store::{stamp_headers, ExpertStore};
use crate::{ExpertId, TierError};

/// How to choose what to evict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Least recently used: for access patterns the schedule does not know.
    Lru,
    /// The expert whose next scheduled use is furthest away (Belady's
    /// choice, exact when the schedule is followed).
    #[default]
    ScheduleDistance,
}

/// Host tier configuration; every bound is fixed at construction.
#[derive(Clone)]
pub struct HostCacheConfig {
    pub host_budget_bytes: u64,
    pub policy: EvictionPolicy,
    /// How many scheduled accesses the prefetcher looks ahead of the
    /// cursor; 0 disables the prefetcher. Free slots bound it further.
    pub prefetch_ahead_max: usize,
    /// Loads the prefetcher issues as one I/O batch.
    pub prefetch_batch_max: usize,
    pub allocator: Arc<dyn HostAllocator>,
}

impl Default for HostCacheConfig {
    fn default() -> Self {
        Self {
            host_budget_bytes: 1 << 30,
            policy: EvictionPolicy::ScheduleDistance,
            prefetch_ahead_max: 64,
            prefetch_batch_max: 8,
            allocator: Arc::new(PageAllocator),
        }
    }
}

/// Counters since construction (or the last `take_stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Acquires that found their parts ready.
    pub hits: u64,
    /// Acquires that found their expert on its way in and waited.
    pub late: u64,
    /// Acquires that had to load (some of) their parts themselves.
    pub misses: u64,
    /// Time acquires spent waiting for or doing loads.
    pub stall_ns: u64,
    pub loads: u64,
    pub bytes_read: u64,
    pub write_backs: u64,
    pub bytes_written: u64,
    pub evictions: u64,
}

impl CacheStats {
    pub fn acquires(&self) -> u64 {
        self.hits + self.late + self.misses
    }

    /// Share of acquires served without waiting; 1.0 when there were none.
    pub fn hit_rate(&self) -> f64 {
        match self.acquires() {
            0 => 1.0,
            n => self.hits as f64 / n as f64,
        }
    }
}

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
}

impl SlotMeta {
    const EMPTY: SlotMeta = SlotMeta {
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
    };

    /// Free to be given to another expert (after a write-back if dirty).
    pub fn evictable(&self) -> bool {
        match self.state {
            SlotState::Empty => true,
            SlotState::Ready => {
                self.pins == 0 && !self.writer && !self.upgrading && !self.writing_back
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
    pub stats: CacheStats,
    pub stop: bool,
}

pub(crate) struct Shared {
    pub store: Arc<ExpertStore>,
    region: HostRegion,
    pub slot_bytes: usize,
    pub layout: Layout,
    pub policy: EvictionPolicy,
    pub ahead_max: usize,
    pub batch_max: usize,
    /// Whether `region` is registered with the store's I/O engine.
    registered: bool,
    inner: Mutex<Inner>,
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

// SAFETY: slot memory is only reached through the protocol in the module
// docs, every step of which is ordered by the `inner` mutex.
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

    fn slot_ptr(&self, slot: usize) -> *mut u8 {
        assert!(slot * self.slot_bytes + self.slot_bytes <= self.region.len());
        // SAFETY: in bounds of the region (asserted above).
        unsafe { self.region.as_ptr().add(slot * self.slot_bytes) }
    }

    /// A byte range of a slot.
    ///
    /// # Safety
    /// The caller holds the access the module-docs protocol gives for
    /// exactly this range, and no `&mut` to it exists meanwhile.
    pub unsafe fn bytes(&self, slot: usize, range: std::ops::Range<usize>) -> &[u8] {
        assert!(range.end <= self.slot_bytes);
        // SAFETY: in bounds (asserted); aliasing is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(slot).add(range.start), range.len()) }
    }

    /// A mutable byte range of a slot.
    ///
    /// # Safety
    /// The caller owns exactly this range under the module-docs protocol:
    /// no other reference to it exists while the result lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, slot: usize, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(range.end <= self.slot_bytes);
        // SAFETY: in bounds (asserted); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(slot).add(range.start), range.len()) }
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
        self.store.read_many(&mut requests).map(|_| ())
    }

    /// Stamps headers and writes `jobs` (slot, expert, step) back.
    ///
    /// # Safety
    /// Each slot is `writing_back` or `Evicting` for the caller: it owns the
    /// two header ranges and may read the payloads.
    pub unsafe fn write_slots(&self, jobs: &[(usize, ExpertId, u64)]) -> Result<(), TierError> {
        let end = self.layout.record_bytes() as usize;
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

    /// Checksums `slot`'s payloads into its two headers as `expert`'s
    /// record of `step`.
    ///
    /// # Safety
    /// The caller owns the slot's two header ranges and may read its
    /// payloads (no one writes them meanwhile).
    unsafe fn stamp(&self, slot: usize, expert: ExpertId, step: u64) {
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

    /// The slot to give to a new expert, by policy, among evictable slots;
    /// with `protect_within`, only slots whose expert is not needed within
    /// that many scheduled accesses.
    pub fn choose_victim(&self, inner: &Inner, protect_within: Option<usize>) -> Option<usize> {
        if let Some(empty) = inner.slots.iter().position(|m| m.state == SlotState::Empty) {
            return Some(empty);
        }
        let allowed = |slot: usize| {
            let m = &inner.slots[slot];
            if !m.evictable() {
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
            EvictionPolicy::ScheduleDistance => (0..inner.slots.len())
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

    /// After a load: the slot is ready.
    pub fn loaded(&self, inner: &mut Inner, slot: usize) {
        let meta = &mut inner.slots[slot];
        assert_eq!(meta.state, SlotState::Loading);
        meta.state = SlotState::Ready;
        let bytes = meta.parts.range(&self.layout).len() as u64;
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

/// The host tier. See the module docs.
pub struct HostCache {
    shared: Arc<Shared>,
    prefetcher: Option<std::thread::JoinHandle<()>>,
}

impl HostCache {
    /// Allocates the slots and, if asked, starts the prefetcher.
    pub fn new(store: Arc<ExpertStore>, config: HostCacheConfig) -> Result<Self, TierError> {
        let layout = store.layout();
        let slot_bytes = layout.record_bytes();
        let slot_count = config.host_budget_bytes / slot_bytes;
        if slot_count == 0 {
            return Err(TierError::BudgetTooSmall {
                tier: "host",
                budget_bytes: config.host_budget_bytes,
                needed_bytes: slot_bytes,
                why: "one expert record",
            });
        }
        // No more slots than experts: extra ones could never be used.
        let slot_count = slot_count.min(layout.expert_count()) as usize;
        let region = config
            .allocator
            .allocate(slot_count * slot_bytes as usize)?;
        // SAFETY: the region lives in `Shared`, whose Drop unregisters it
        // before the region itself is dropped.
        let registered = unsafe { store.register_host_region(region.as_ptr(), region.len()) };
        let shared = Arc::new(Shared {
            store,
            region,
            registered,
            slot_bytes: slot_bytes as usize,
            layout,
            policy: config.policy,
            ahead_max: config.prefetch_ahead_max,
            batch_max: config.prefetch_batch_max.max(1),
            inner: Mutex::new(Inner {
                slots: vec![SlotMeta::EMPTY; slot_count],
                by_expert: HashMap::with_capacity(slot_count * 2),
                recency: LruCache::unbounded(),
                schedule: Schedule::default(),
                stats: CacheStats::default(),
                stop: false,
            }),
            changed: Condvar::new(),
        });
        let prefetcher = if config.prefetch_ahead_max > 0 {
            let shared = Arc::clone(&shared);
            Some(
                std::thread::Builder::new()
                    .name("strata-prefetch".to_string())
                    .spawn(move || crate::prefetch::run(&shared))
                    .map_err(|e| TierError::IoThread(e.to_string()))?,
            )
        } else {
            None
        };
        Ok(Self { shared, prefetcher })
    }

    pub fn slot_count(&self) -> usize {
        self.shared.lock().slots.len()
    }

    pub fn store(&self) -> &Arc<ExpertStore> {
        &self.shared.store
    }

    /// Whether the host allocation is registered with io_uring (fixed buffers).
    pub fn io_registered(&self) -> bool {
        self.shared.registered()
    }

    /// Whether the host allocation is page-locked (pinned for DMA).
    pub fn page_locked(&self) -> bool {
        self.shared.region.page_locked
    }

    /// The host region, for registering it with an I/O or GPU driver.
    pub fn region_ptr_len(&self) -> (*mut u8, usize) {
        (self.shared.region.as_ptr(), self.shared.region.len())
    }

    /// The order compute will ask for experts, repeated every step.
    pub fn set_schedule(&self, order: Vec<(ExpertId, Parts)>) {
        let mut inner = self.shared.lock();
        inner.schedule = Schedule::new(order);
        drop(inner);
        self.shared.changed.notify_all();
    }

    pub fn stats(&self) -> CacheStats {
        self.shared.lock().stats
    }

    /// The counters so far, resetting them.
    pub fn take_stats(&self) -> CacheStats {
        std::mem::take(&mut self.shared.lock().stats)
    }

    /// Pins `expert` with `parts` ready (Compute or Full) and returns a
    /// shared guard; blocks only while a load is late or a writer holds it.
    pub fn acquire(&self, expert: ExpertId, parts: Parts) -> Result<ReadGuard, TierError> {
        self.acquire_within(expert, parts, Duration::ZERO)
    }

    /// `acquire`, but when every slot is pinned it waits up to `pin_wait`
    /// for a guard to be dropped (by another thread: an upload completing)
    /// before it reports `AllSlotsPinned`.
    pub fn acquire_within(
        &self,
        expert: ExpertId,
        parts: Parts,
        pin_wait: Duration,
    ) -> Result<ReadGuard, TierError> {
        assert_ne!(parts, Parts::State, "acquire Compute or Full");
        let slot = self.acquire_slot(expert, parts, false, pin_wait)?;
        Ok(ReadGuard {
            shared: Arc::clone(&self.shared),
            slot,
            expert,
            parts,
        })
    }

    /// Pins `expert` with its full record, exclusively, for the optimizer.
    pub fn acquire_mut(&self, expert: ExpertId) -> Result<WriteGuard, TierError> {
        self.acquire_mut_within(expert, Duration::ZERO)
    }

    /// `acquire_mut`, waiting up to `pin_wait` as `acquire_within` does.
    pub fn acquire_mut_within(
        &self,
        expert: ExpertId,
        pin_wait: Duration,
    ) -> Result<WriteGuard, TierError> {
        let slot = self.acquire_slot(expert, Parts::Full, true, pin_wait)?;
        Ok(WriteGuard {
            shared: Arc::clone(&self.shared),
            slot,
            expert,
            sealed: false,
        })
    }

    fn acquire_slot(
        &self,
        expert: ExpertId,
        parts: Parts,
        write: bool,
        pin_wait: Duration,
    ) -> Result<usize, TierError> {
        let shared = &*self.shared;
        shared.layout.slot_of(expert)?;
        let start = Instant::now();
        let mut inner = shared.lock();
        let mut waited = false;
        let mut loaded = false;
        loop {
            if let Some(&slot) = inner.by_expert.get(&expert) {
                let m = inner.slots[slot];
                let busy = match m.state {
                    SlotState::Loading | SlotState::Evicting => true,
                    SlotState::Empty => unreachable!("a mapped slot is not empty"),
                    SlotState::Ready => {
                        m.writer
                            || (parts == Parts::Full && m.upgrading)
                            || (write && (m.pins > 0 || m.writing_back))
                    }
                };
                if busy {
                    waited = true;
                    inner = shared.wait(inner);
                    continue;
                }
                if parts == Parts::Full && m.parts == Parts::Compute {
                    inner.slots[slot].upgrading = true;
                    drop(inner);
                    // SAFETY: `upgrading` gives this thread the state part;
                    // compute readers keep to the compute part.
                    let result = unsafe { shared.read_slots(&[(slot, expert, Parts::State)]) };
                    inner = shared.lock();
                    inner.slots[slot].upgrading = false;
                    shared.changed.notify_all();
                    result?;
                    inner.slots[slot].parts = Parts::Full;
                    inner.stats.loads += 1;
                    inner.stats.bytes_read += Parts::State.range(&shared.layout).len() as u64;
                    loaded = true;
                    continue;
                }
                let m = &mut inner.slots[slot];
                if write {
                    m.writer = true;
                    m.stamped = None; // the payloads are about to change
                } else {
                    m.pins += 1;
                }
                inner.recency.put(slot, ());
                let window = shared.ahead_max.max(1) * 4;
                inner.schedule.advance(expert, window);
                let stats = &mut inner.stats;
                if loaded {
                    stats.misses += 1;
                } else if waited {
                    stats.late += 1;
                } else {
                    stats.hits += 1;
                }
                if loaded || waited {
                    stats.stall_ns += start.elapsed().as_nanos() as u64;
                }
                drop(inner);
                shared.changed.notify_all();
                return Ok(slot);
            }
            // Not resident: load it here.
            let Some(victim) = shared.choose_victim(&inner, None) else {
                // Loads, write-backs and upgrades finish on their own.
                let transient = inner.slots.iter().any(|m| {
                    matches!(m.state, SlotState::Loading | SlotState::Evicting)
                        || m.upgrading
                        || m.writing_back
                });
                if transient {
                    waited = true;
                    inner = shared.wait(inner);
                    continue;
                }
                // Pins held elsewhere end when their holders drop them.
                if let Some(left) = pin_wait
                    .checked_sub(start.elapsed())
                    .filter(|d| !d.is_zero())
                {
                    waited = true;
                    inner = shared.wait_timeout(inner, left);
                    continue;
                }
                return Err(TierError::AllSlotsPinned {
                    slots: inner.slots.len(),
                });
            };
            let write_back = shared.claim(&mut inner, victim, expert, parts);
            drop(inner);
            let result = load_now(shared, victim, expert, parts, write_back);
            inner = shared.lock();
            shared.changed.notify_all();
            match result {
                Ok(()) => {
                    if write_back.is_some() {
                        shared.evicted(&mut inner, victim);
                    }
                    shared.loaded(&mut inner, victim);
                    loaded = true;
                }
                Err(e) => {
                    shared.abandon(&mut inner, victim);
                    return Err(e);
                }
            }
        }
    }

    /// Writes every dirty slot back to the store (not yet durable). Fails
    /// if a dirty expert is still held by a `WriteGuard`.
    pub fn flush(&self) -> Result<(), TierError> {
        let shared = &*self.shared;
        let mut inner = shared.lock();
        loop {
            let transient = inner.slots.iter().any(|m| {
                matches!(m.state, SlotState::Loading | SlotState::Evicting) || m.writing_back
            });
            if !transient {
                break;
            }
            inner = shared.wait(inner);
        }
        let mut jobs = Vec::new();
        for (slot, m) in inner.slots.iter_mut().enumerate() {
            if let (Some(expert), Some(step)) = (m.expert, m.dirty) {
                if m.writer {
                    return Err(TierError::DirtyExpertHeld { expert });
                }
                m.writing_back = true;
                jobs.push((slot, expert, step));
            }
        }
        drop(inner);
        // SAFETY: each job's slot is `writing_back` for this thread.
        let result = unsafe { shared.write_slots(&jobs) };
        let mut inner = shared.lock();
        for &(slot, _, step) in &jobs {
            let m = &mut inner.slots[slot];
            m.writing_back = false;
            if result.is_ok() && m.dirty == Some(step) {
                m.dirty = None;
            }
        }
        if result.is_ok() {
            inner.stats.write_backs += jobs.len() as u64;
            inner.stats.bytes_written += jobs.len() as u64 * shared.layout.record_bytes();
        }
        drop(inner);
        shared.changed.notify_all();
        result
    }

    /// `flush`, then commit the store's checkpoint `step` (durable on return).
    pub fn checkpoint(&self, step: u64) -> Result<(), TierError> {
        self.flush()?;
        self.shared.store.checkpoint(step)
    }

    /// Which experts are resident, for tests and reports.
    pub fn resident(&self) -> Vec<(ExpertId, Parts, bool)> {
        let inner = self.shared.lock();
        inner
            .slots
            .iter()
            .filter(|m| m.state == SlotState::Ready)
            .map(|m| (m.expert.expect("ready"), m.parts, m.dirty.is_some()))
            .collect()
    }
}

/// Writes back (if needed) and loads one slot, on the calling thread.
fn load_now(
    shared: &Shared,
    slot: usize,
    expert: ExpertId,
    parts: Parts,
    write_back: Option<(usize, ExpertId, u64)>,
) -> Result<(), TierError> {
    if let Some(job) = write_back {
        // SAFETY: the slot is Evicting for this thread (claim).
        unsafe { shared.write_slots(&[job])? };
    }
    // SAFETY: the slot is Loading (or Evicting, about to be) for this thread.
    unsafe { shared.read_slots(&[(slot, expert, parts)]) }
}

impl Drop for HostCache {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(t) = self.prefetcher.take() {
            let _ = t.join();
        }
    }
}

/// A shared pin of one expert's compute params (and, for `Parts::Full`,
/// its optimizer state). Dropping it unpins.
pub struct ReadGuard {
    shared: Arc<Shared>,
    slot: usize,
    expert: ExpertId,
    parts: Parts,
}

impl ReadGuard {
    pub fn expert(&self) -> ExpertId {
        self.expert
    }

    pub fn parts(&self) -> Parts {
        self.parts
    }

    /// The compute params, in the store's dtype, as little-endian bytes.
    pub fn compute(&self) -> &[u8] {
        let n = self.shared.layout.compute_payload_bytes() as usize;
        // SAFETY: a pin gives shared access to the payloads; writers and
        // loads of this slot wait for pins to drop.
        unsafe {
            self.shared
                .bytes(self.slot, PART_HEADER_BYTES..PART_HEADER_BYTES + n)
        }
    }

    /// Master params, m and v (only for a `Parts::Full` guard).
    pub fn state(&self) -> Option<(&[f32], &[f32], &[f32])> {
        if self.parts != Parts::Full {
            return None;
        }
        let layout = &self.shared.layout;
        let at = layout.compute_part_bytes() as usize + PART_HEADER_BYTES;
        let n = layout.params_per_expert as usize;
        // SAFETY: as in `compute`; a Full pin means the state part is loaded.
        let bytes = unsafe { self.shared.bytes(self.slot, at..at + 12 * n) };
        let floats: &[f32] = bytemuck::cast_slice(bytes);
        Some((&floats[..n], &floats[n..2 * n], &floats[2 * n..]))
    }
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        let mut inner = self.shared.lock();
        let m = &mut inner.slots[self.slot];
        assert!(m.pins > 0, "unpinning an unpinned slot");
        m.pins -= 1;
        drop(inner);
        self.shared.changed.notify_all();
    }
}

/// An exclusive pin of one expert's full record.
pub struct WriteGuard {
    shared: Arc<Shared>,
    slot: usize,
    expert: ExpertId,
    /// `seal` has handed the slot back.
    sealed: bool,
}

impl WriteGuard {
    pub fn expert(&self) -> ExpertId {
        self.expert
    }

    /// Every payload, mutably.
    ///
    /// # Panics
    /// After `seal`, which gave the slot back.
    pub fn record_mut(&mut self) -> RecordMut<'_> {
        assert!(!self.sealed, "a sealed WriteGuard no longer holds its slot");
        let end = self.shared.layout.record_bytes() as usize;
        // SAFETY: the writer flag gives this guard every payload; headers
        // are only touched by write-backs, which skip written slots.
        let bytes = unsafe { self.shared.bytes_mut(self.slot, 0..end) };
        crate::record::record_mut(&self.shared.layout, bytes).expect("a slot holds a full record")
    }

    /// Records that the slot now differs from the store; it is written back
    /// (with `step` in its headers) before eviction and at `flush`.
    pub fn mark_dirty(&mut self, step: u64) {
        assert!(!self.sealed, "a sealed WriteGuard no longer holds its slot");
        let mut inner = self.shared.lock();
        let m = &mut inner.slots[self.slot];
        m.dirty = Some(step);
        m.stamped = None;
    }

    /// The writer is done: checksums the record into its headers as
    /// `step` (on the calling thread, so a later write-back only submits
    /// the bytes), marks it dirty and gives the slot back at once. The
    /// guard holds nothing afterwards; dropping it is a no-op.
    pub fn seal(&mut self, step: u64) {
        assert!(!self.sealed, "a WriteGuard is sealed once");
        // SAFETY: the writer flag gives this guard the whole slot, headers
        // included: write-backs skip written slots (`evictable`, `flush`).
        unsafe { self.shared.stamp(self.slot, self.expert, step) };
        let mut inner = self.shared.lock();
        let m = &mut inner.slots[self.slot];
        assert!(m.writer, "sealing a slot without its writer");
        m.dirty = Some(step);
        m.stamped = Some(step);
        m.writer = false;
        drop(inner);
        self.sealed = true;
        self.shared.changed.notify_all();
    }
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        if self.sealed {
            return;
        }
        let mut inner = self.shared.lock();
        let m = &mut inner.slots[self.slot];
        assert!(m.writer, "releasing a slot without its writer");
        m.writer = false;
        drop(inner);
        self.shared.changed.notify_all();
    }
}
