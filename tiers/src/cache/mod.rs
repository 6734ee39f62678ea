//! [`HostCache`]: the host tier. One allocation sized from
//! `host_budget_bytes` is carved into fixed-size slots, one expert record
//! each, and (`HostCacheConfig::cell_slots`) compute cells, each one
//! record's compute part: an expert read for its compute params alone
//! takes a cell instead of a record slot, and the prefetcher moves a clean
//! record that is next read that way into a cell (a host copy, no I/O)
//! when a record slot is wanted, so the record slots carry what is read
//! and written in full. Slots carry a pin count, a writer flag, a dirty
//! step and a state; eviction never touches a pinned, written or in-flight
//! slot, and writes a dirty one back before reuse. Prefetcher threads
//! (`prefetch.rs`) walk the access schedule and load ahead of compute.
//!
//! Slot memory is shared between guards, the prefetcher and write-backs by
//! this protocol (all transitions under the one mutex):
//! - `Loading` / `Evicting`: the I/O thread that set it owns the whole slot;
//! - `Ready` + `writer`: the one `WriteGuard` owns the payloads;
//! - `Ready` + `upgrading`: an I/O thread fills the part the slot lacks:
//!   the state part, while read guards of the compute part go on
//!   (disjoint bytes), or the compute part of a slot loaded with its state
//!   part alone (`Parts::State`, for an update that overwrites the compute
//!   part), which has no guards (readers and writers wait);
//! - `Ready` + `writing_back`: an I/O thread stamps the two 64-byte headers
//!   and reads the payloads; read guards go on (they never see headers);
//! - a demotion: the prefetcher pins the record slot (a reader's share)
//!   and owns the `Loading` cell it copies the compute part into.
//!
//! Each of these holds is a value (`Owned`, `Pinned`, `Upgrading`,
//! `WritingBack`, `Writing`: `slots.rs`), made where the lock sets it and
//! given back where the lock clears it; `slots/memory.rs` reaches a slot's
//! bytes only through one, and is the only code that touches them.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};

use lru::LruCache;

use crate::io::{HostAllocator, HostRegion, PageAllocator};
use crate::record::Parts;
use crate::schedule::Schedule;
use crate::store::ExpertStore;
use crate::timeline::Timeline;
use crate::{ExpertId, TierError};

mod acquire;
mod guards;
mod slots;

pub use guards::{ReadGuard, WriteGuard};
use slots::SlotMeta;
pub(crate) use slots::{
    Demotion, Inner, Owned, Pinned, ReadInto, Shared, SlotKind, SlotState, Upgrading, WriteFrom,
};

/// Slots `HostCache::keep_resident` leaves to stream records through: one
/// for the record being updated and one for the next arriving, at least.
pub const MIN_STREAMING_SLOTS: usize = 2;

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
    /// Prefetcher threads (at least 1 when prefetching). With two, one
    /// plans and issues its next batch while the other's finishes (its
    /// last checksum, marking its slots ready), so the disk is not left
    /// idle between batches.
    pub prefetch_threads: usize,
    /// Record slots of the budget split into compute cells, each as large
    /// as one record's compute part (a seventh of a bf16 record), for
    /// experts read for their compute params alone. None where the record
    /// slots left hold every record.
    pub cell_slots: usize,
    pub allocator: Arc<dyn HostAllocator>,
    /// Where to record every SSD call and every acquire that waited
    /// (`None`: nothing is recorded).
    pub timeline: Option<Arc<Timeline>>,
}

impl Default for HostCacheConfig {
    fn default() -> Self {
        Self {
            host_budget_bytes: 1 << 30,
            policy: EvictionPolicy::ScheduleDistance,
            prefetch_ahead_max: 64,
            prefetch_batch_max: 8,
            prefetch_threads: 2,
            cell_slots: 0,
            allocator: Arc::new(PageAllocator),
            timeline: None,
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
    /// Records whose compute part moved to a compute cell to free their
    /// record slot.
    pub demotions: u64,
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
/// The host tier. See the module docs.
pub struct HostCache {
    shared: Arc<Shared>,
    prefetchers: Vec<std::thread::JoinHandle<()>>,
}

impl HostCache {
    /// Allocates the slots and, if asked, starts the prefetcher.
    pub fn new(store: Arc<ExpertStore>, config: HostCacheConfig) -> Result<Self, TierError> {
        let layout = store.layout();
        let slot_bytes = layout.record_bytes();
        let cell_bytes = layout.compute_part_bytes();
        let budget_slots = config.host_budget_bytes / slot_bytes;
        let record_slots = budget_slots.saturating_sub(config.cell_slots as u64);
        if record_slots == 0 {
            let why = match config.cell_slots {
                0 => "one expert record",
                _ => "one expert record besides the slots split into compute cells",
            };
            return Err(TierError::BudgetTooSmall {
                tier: "host",
                budget_bytes: config.host_budget_bytes,
                needed_bytes: slot_bytes * (config.cell_slots as u64 + 1),
                why,
            });
        }
        // No more slots than experts: extra ones could never be used; and
        // no cells where the record slots hold every record.
        let experts = layout.expert_count();
        let record_slots = record_slots.min(experts) as usize;
        let cells = match record_slots as u64 == experts {
            true => 0,
            false => config.cell_slots * (slot_bytes / cell_bytes) as usize,
        };
        let region = config
            .allocator
            .allocate(record_slots * slot_bytes as usize + cells * cell_bytes as usize)?;
        let registered = store.register_host_region(&region);
        let shared = Arc::new(Shared {
            store,
            region,
            registered,
            evicts: (record_slots as u64) < experts,
            slot_bytes: slot_bytes as usize,
            record_slots,
            cell_bytes: cell_bytes as usize,
            layout,
            policy: config.policy,
            ahead_max: config.prefetch_ahead_max,
            batch_max: config.prefetch_batch_max.max(1),
            timeline: config.timeline,
            inner: Mutex::new(Inner {
                slots: vec![SlotMeta::EMPTY; record_slots + cells],
                by_expert: HashMap::with_capacity((record_slots + cells) * 2),
                recency: LruCache::unbounded(),
                schedule: Schedule::default(),
                keep: HashSet::new(),
                prefetch_failed: HashSet::new(),
                stats: CacheStats::default(),
                stop: false,
            }),
            changed: Condvar::new(),
        });
        let threads = match config.prefetch_ahead_max {
            0 => 0,
            _ => config.prefetch_threads.max(1),
        };
        let mut cache = Self {
            shared,
            prefetchers: Vec::with_capacity(threads),
        };
        for i in 0..threads {
            let shared = Arc::clone(&cache.shared);
            let thread = std::thread::Builder::new()
                .name(format!("strata-prefetch-{i}"))
                .spawn(move || crate::prefetch::run(&shared))
                .map_err(|e| TierError::IoThread(e.to_string()))?;
            cache.prefetchers.push(thread);
        }
        Ok(cache)
    }

    /// Slots that hold a whole record.
    pub fn slot_count(&self) -> usize {
        self.shared.record_slots
    }

    /// Compute cells (`HostCacheConfig::cell_slots`).
    pub fn cell_count(&self) -> usize {
        self.shared.lock().slots.len() - self.shared.record_slots
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

    /// The host region, for registering it with a GPU driver.
    pub fn region(&self) -> &HostRegion {
        &self.shared.region
    }

    /// The order compute will ask for experts, repeated every step.
    pub fn set_schedule(&self, order: Vec<(ExpertId, Parts)>) {
        let mut inner = self.shared.lock();
        inner.schedule = Schedule::new(order);
        drop(inner);
        self.shared.changed.notify_all();
    }

    /// Keeps `experts` resident once loaded: they are never evicted, and
    /// only a flush (or checkpoint) writes them back. The other slots, at
    /// least [`MIN_STREAMING_SLOTS`], stream the rest. Where every record
    /// is streamed through the tier each step, each kept record saves its
    /// read and its write-back a step. Replaces any earlier set; an expert
    /// left out becomes evictable again.
    pub fn keep_resident(&self, experts: &[ExpertId]) -> Result<(), TierError> {
        for &e in experts {
            self.shared.layout.slot_of(e)?;
        }
        let mut inner = self.shared.lock();
        let keep: HashSet<ExpertId> = experts.iter().copied().collect();
        let records = self.shared.record_slots;
        let most = records.saturating_sub(MIN_STREAMING_SLOTS);
        if keep.len() > most {
            return Err(TierError::TooManyKept {
                kept: keep.len(),
                slots: records,
                streaming: MIN_STREAMING_SLOTS,
            });
        }
        for m in inner.slots[..records].iter_mut() {
            m.kept = m.state == SlotState::Ready && m.expert.is_some_and(|e| keep.contains(&e));
        }
        inner.keep = keep;
        drop(inner);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// How many experts `keep_resident` holds.
    pub fn kept_count(&self) -> usize {
        self.shared.lock().keep.len()
    }

    /// The experts `keep_resident` holds.
    pub fn kept(&self) -> HashSet<ExpertId> {
        self.shared.lock().keep.clone()
    }

    pub fn stats(&self) -> CacheStats {
        self.shared.lock().stats
    }

    /// The counters so far, resetting them.
    pub fn take_stats(&self) -> CacheStats {
        std::mem::take(&mut self.shared.lock().stats)
    }

    /// Writes every dirty slot back to the store (not yet durable). Fails
    /// if a dirty expert is still held by a `WriteGuard`.
    pub fn flush(&self) -> Result<(), TierError> {
        let shared = &*self.shared;
        let jobs = shared.begin_flush(shared.lock())?;
        shared.write_back(jobs)
    }

    /// `flush`, then commit the store's checkpoint `step` (durable on return).
    pub fn checkpoint(&self, step: u64) -> Result<(), TierError> {
        self.flush()?;
        self.shared.store.checkpoint(step)
    }

    /// Whether `expert`'s record is in a host slot that an update's writer
    /// (`acquire_to_update`) could take now, without a read or a wait:
    /// its optimizer state loaded, unpinned, not being written back or
    /// taken by another writer. A caller that must not block (one starting
    /// an update ahead of its need) asks first; the answer can go stale,
    /// after which `acquire_to_update_within` still works, waiting or
    /// loading as it must.
    pub fn ready_to_update(&self, expert: ExpertId) -> bool {
        let inner = self.shared.lock();
        inner.by_expert.get(&expert).is_some_and(|&slot| {
            let m = &inner.slots[slot];
            !m.busy_for(Parts::State, true) && m.parts.includes_state()
        })
    }

    /// Which experts sit in compute cells, for tests and reports.
    pub fn cells_resident(&self) -> Vec<ExpertId> {
        let inner = self.shared.lock();
        inner.slots[self.shared.record_slots..]
            .iter()
            .filter(|m| m.state == SlotState::Ready)
            .filter_map(|m| m.expert)
            .collect()
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

impl Drop for HostCache {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        for t in self.prefetchers.drain(..) {
            let _ = t.join();
        }
    }
}
