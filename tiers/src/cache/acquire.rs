//! How a guard is acquired: [`HostCache`]'s `acquire*` methods, which
//! find an expert's slot, wait while it is busy, read in the part it lacks
//! (an upgrade), or load it into a slot of their own (`acquire_slot`).

use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant};

use super::slots::{expert_detail, Inner, Writing};
use super::{
    HostCache, Owned, Pinned, ReadGuard, ReadInto, Shared, SlotKind, SlotState, WriteFrom,
    WriteGuard,
};
use crate::record::Parts;
use crate::{ExpertId, TierError};

impl HostCache {
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
        assert_ne!(parts, Parts::State, "read Compute or Full");
        let Acquired::Pin(pin) = self.acquire_slot(expert, parts, false, pin_wait)? else {
            unreachable!("a reader is given a pin")
        };
        Ok(ReadGuard {
            shared: Arc::clone(&self.shared),
            pin: Some(pin),
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
        self.acquire_writer(expert, Parts::Full, pin_wait)
    }

    /// Pins `expert`'s record exclusively for an update that writes its
    /// compute params whole (from the new master params) before it seals:
    /// where the record is not in host memory, only its optimizer state is
    /// read, and the compute payload holds bytes that are not the
    /// record's until the writer writes them. Saves a compute part's read
    /// an update where the compute params went to the device earlier.
    pub fn acquire_to_update(&self, expert: ExpertId) -> Result<WriteGuard, TierError> {
        self.acquire_to_update_within(expert, Duration::ZERO)
    }

    /// `acquire_to_update`, waiting up to `pin_wait` as `acquire_within`
    /// does.
    pub fn acquire_to_update_within(
        &self,
        expert: ExpertId,
        pin_wait: Duration,
    ) -> Result<WriteGuard, TierError> {
        self.acquire_writer(expert, Parts::State, pin_wait)
    }

    /// The writer's hold of `expert` with `parts` read (Full, or State for
    /// a writer of every payload).
    fn acquire_writer(
        &self,
        expert: ExpertId,
        parts: Parts,
        pin_wait: Duration,
    ) -> Result<WriteGuard, TierError> {
        let Acquired::Writer(writer) = self.acquire_slot(expert, parts, true, pin_wait)? else {
            unreachable!("a writer is given the writer's hold")
        };
        Ok(WriteGuard {
            shared: Arc::clone(&self.shared),
            writer: Some(writer),
            expert,
        })
    }

    /// Finds or loads `expert` with `parts` and hands out a reader's pin
    /// or (`write`) the writer's hold, waiting while its slot is busy and,
    /// where every slot is pinned, up to `pin_wait` for one to be freed.
    fn acquire_slot(
        &self,
        expert: ExpertId,
        parts: Parts,
        write: bool,
        pin_wait: Duration,
    ) -> Result<Acquired, TierError> {
        let shared = &*self.shared;
        shared.layout.slot_of(expert)?;
        let mut ask = Asking {
            expert,
            parts,
            write,
            pin_wait,
            start: Instant::now(),
            waited: false,
            loaded: false,
        };
        let mut inner = shared.lock();
        loop {
            let Some(&slot) = inner.by_expert.get(&expert) else {
                // Not resident: load it here, once a slot can be had.
                match shared.choose_place(&inner, expert, parts, None) {
                    Some(victim) => {
                        inner = self.load_here(inner, victim, expert, parts, None)?;
                        ask.loaded = true;
                    }
                    None => inner = ask.wait_for_place(shared, inner)?,
                }
                continue;
            };
            let m = inner.slots[slot];
            let cell = shared.kind(slot) == SlotKind::Cell;
            if cell && (write || parts != Parts::Compute) && m.state == SlotState::Ready {
                // A cell holds compute params only: the record goes to
                // a record slot, readers of the cell keeping theirs.
                // With one free to evict now, its compute part is
                // copied from the cell (pinned for the copy; the lock
                // is held from here to the claim, so the cell still
                // matches the store) and only its state part is read;
                // else it is read whole once one is (above).
                let place = shared.choose_victim(&inner, None, SlotKind::Record);
                let from_cell = place.map(|_| shared.pin(&mut inner, slot));
                shared.leave_cell(&mut inner, slot);
                if let Some(victim) = place {
                    inner = self.load_here(inner, victim, expert, Parts::Full, from_cell)?;
                    ask.loaded = true;
                }
                continue;
            }
            if m.busy_for(parts, write) {
                ask.waited = true;
                inner = shared.wait(inner);
                continue;
            }
            if parts.missing_from(m.parts).is_some() {
                inner = upgrade_here(shared, inner, slot, expert)?;
                ask.loaded = true;
                continue;
            }
            let held = ask.hand_out(shared, &mut inner, slot);
            drop(inner);
            shared.changed.notify_all();
            return Ok(held);
        }
    }

    /// Gives `victim` to `expert` and loads its `parts` on this thread,
    /// writing the slot's dirty record back first. With `from_cell` (a pin
    /// of the cell holding the expert's compute part), that part is copied
    /// from the cell and only the state part is read; the pin ends here.
    fn load_here<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner>,
        victim: usize,
        expert: ExpertId,
        parts: Parts,
        from_cell: Option<Pinned>,
    ) -> Result<MutexGuard<'a, Inner>, TierError> {
        let shared = &*self.shared;
        let (owned, write_back) = shared.claim(&mut inner, victim, expert, parts);
        drop(inner);
        let result = load_now(
            shared,
            &owned,
            expert,
            parts,
            write_back,
            from_cell.as_ref(),
        );
        let mut inner = shared.lock();
        if let Some(pin) = from_cell {
            shared.unpin(&mut inner, pin);
        }
        shared.changed.notify_all();
        match result {
            Ok(read) => {
                if write_back.is_some() {
                    shared.evicted(&mut inner, &owned);
                }
                shared.loaded(&mut inner, owned, read);
                Ok(inner)
            }
            Err(e) => {
                shared.abandon(&mut inner, owned);
                Err(e)
            }
        }
    }
}

/// What `acquire_slot` hands its caller: a reader's pin or the writer's hold.
enum Acquired {
    Pin(Pinned),
    Writer(Writing),
}

/// One `acquire_slot` call: what it asks for, since when, and whether it
/// has waited or loaded (a late hit, or a miss, in the cache's stats).
struct Asking {
    expert: ExpertId,
    parts: Parts,
    write: bool,
    pin_wait: Duration,
    start: Instant,
    waited: bool,
    loaded: bool,
}

impl Asking {
    /// Where no slot can be had for the load: waits for a load, write-back
    /// or upgrade in flight, or, with none, up to what is left of
    /// `pin_wait` for a pin to end; past that, every slot is pinned.
    fn wait_for_place<'a>(
        &mut self,
        shared: &'a Shared,
        inner: MutexGuard<'a, Inner>,
    ) -> Result<MutexGuard<'a, Inner>, TierError> {
        // Loads, write-backs and upgrades finish on their own.
        let transient = inner.slots.iter().any(|m| {
            matches!(m.state, SlotState::Loading | SlotState::Evicting)
                || m.upgrading
                || m.writing_back
        });
        if transient {
            self.waited = true;
            return Ok(shared.wait(inner));
        }
        // Pins held elsewhere end when their holders drop them.
        if let Some(left) = self
            .pin_wait
            .checked_sub(self.start.elapsed())
            .filter(|d| !d.is_zero())
        {
            self.waited = true;
            return Ok(shared.wait_timeout(inner, left));
        }
        // The slots this load could have taken (`choose_place`).
        let slots = if self.parts == Parts::Compute && !inner.keep.contains(&self.expert) {
            inner.slots.len()
        } else {
            shared.record_slots
        };
        Err(TierError::AllSlotsPinned { slots })
    }

    /// The pin or writer's hold of the ready `slot`, the schedule moved on
    /// past it, and the call counted: a hit, a late hit or a miss, with its
    /// stall (and on the timeline).
    fn hand_out(&self, shared: &Shared, inner: &mut Inner, slot: usize) -> Acquired {
        let held = match self.write {
            true => Acquired::Writer(shared.take_writer(inner, slot)),
            false => Acquired::Pin(shared.pin(inner, slot)),
        };
        inner.recency.put(slot, ());
        let window = shared.ahead_max.max(1) * 4;
        inner.schedule.advance(self.expert, window);
        let stats = &mut inner.stats;
        if self.loaded {
            stats.misses += 1;
        } else if self.waited {
            stats.late += 1;
        } else {
            stats.hits += 1;
        }
        if self.loaded || self.waited {
            stats.stall_ns += self.start.elapsed().as_nanos() as u64;
            if let Some(timeline) = &shared.timeline {
                let name = if self.loaded {
                    "load"
                } else {
                    "wait for record"
                };
                let (expert, parts) = (self.expert, self.parts);
                timeline.record("stall", name, self.start, || expert_detail(expert, parts));
            }
        }
        held
    }
}

/// Reads the part `slot`'s record lacks for `expert` on this thread (an
/// upgrade), the lock released while it reads.
fn upgrade_here<'a>(
    shared: &'a Shared,
    mut inner: MutexGuard<'a, Inner>,
    slot: usize,
    expert: ExpertId,
) -> Result<MutexGuard<'a, Inner>, TierError> {
    let upgrade = shared.begin_upgrade(&mut inner, slot);
    let part = upgrade.part();
    drop(inner);
    let result = shared.read_slots(&[(ReadInto::Upgrading(&upgrade), expert, part)]);
    let mut inner = shared.lock();
    shared.end_upgrade(&mut inner, upgrade, result.is_ok());
    shared.changed.notify_all();
    result?;
    Ok(inner)
}

/// Writes back (if needed) and loads one slot, on the calling thread:
/// `parts`, or its state part after copying the compute part from
/// `from_cell`. Returns the parts read from the store.
fn load_now(
    shared: &Shared,
    slot: &Owned,
    expert: ExpertId,
    parts: Parts,
    write_back: Option<(ExpertId, u64)>,
    from_cell: Option<&Pinned>,
) -> Result<Parts, TierError> {
    if let Some((old, step)) = write_back {
        shared.write_slots(&[(WriteFrom::Owned(slot), old, step)])?;
    }
    let read = match from_cell {
        Some(cell) => {
            shared.copy_compute(expert, cell, slot);
            Parts::State
        }
        None => parts,
    };
    shared.read_slots(&[(ReadInto::Owned(slot), expert, read)])?;
    Ok(read)
}
