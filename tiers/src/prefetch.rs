//! The prefetcher: background threads (two by default: one plans and
//! issues its batch while the other's ends) that walk the access schedule
//! ahead of the cursor and load what is not resident, in batches (so
//! io_uring can keep several reads in flight), into slots whose experts
//! are needed later than the one being loaded. It never evicts an expert
//! the schedule needs sooner than the one it brings in, so following the
//! schedule never makes it fight compute. With nothing to load, it writes
//! back the dirty records that will be evicted unchanged, so the loads
//! that evict them later only read. An update's access (`Parts::State`)
//! reads the record's optimizer state alone, as the update writes its
//! compute part whole. Where a record is wanted and every
//! record slot holds one needed sooner, it moves a clean one that is next
//! read for its compute params alone into a compute cell.

use std::sync::MutexGuard;

use crate::cache::{
    Demotion, Inner, Owned, Pinned, ReadInto, Shared, SlotKind, SlotState, Upgrading, WriteFrom,
};
use crate::record::Parts;
use crate::ExpertId;

/// One load the prefetcher planned: the slot it holds, what it reads,
/// where the compute part comes from if a cell holds it, and the old record
/// to write back first.
struct Load {
    slot: Owned,
    expert: ExpertId,
    parts: Parts,
    from_cell: Option<Pinned>,
    write_back: Option<(ExpertId, u64)>,
}

impl Load {
    /// The parts read from the store: from a cell, the compute part is
    /// copied over and the state part alone is read.
    fn reads(&self) -> Parts {
        match self.from_cell {
            Some(_) => Parts::State,
            None => self.parts,
        }
    }
}

/// What one look over the schedule's window plans: loads into slots,
/// records to read the part they lack into (upgrades), and, where no
/// record slot could be had, a record to move into a compute cell.
#[derive(Default)]
struct Plan {
    loads: Vec<Load>,
    upgrades: Vec<(Upgrading, ExpertId)>,
    demotion: Option<Demotion>,
}

pub(crate) fn run(shared: &Shared) {
    let mut inner = shared.lock();
    loop {
        if inner.stop {
            return;
        }
        let plan = plan(shared, &mut inner);
        let demoted = plan.demotion.is_some();
        if let Some(demotion) = plan.demotion {
            drop(inner);
            shared.copy_compute(demotion.expert, &demotion.from, &demotion.to);
            inner = shared.lock();
            shared.finish_demotion(&mut inner, demotion);
            shared.changed.notify_all();
        }
        if plan.loads.is_empty() && plan.upgrades.is_empty() {
            if demoted {
                continue; // a record slot is free now: plan its load
            }
            inner = write_back_early(shared, inner);
            continue;
        }
        drop(inner);
        let ready = write_back_evicted(shared, plan.loads);
        inner = read_batch(shared, ready, plan.upgrades);
        shared.changed.notify_all();
    }
}

/// Walks the schedule's window ahead of the cursor and claims slots for
/// what is not resident, up to a batch.
fn plan(shared: &Shared, inner: &mut Inner) -> Plan {
    let mut plan = Plan::default();
    let ahead = shared.ahead_max.min(inner.schedule.len());
    for distance in 0..ahead {
        if plan.loads.len() + plan.upgrades.len() >= shared.batch_max {
            break;
        }
        let (expert, parts) = inner.schedule.upcoming(distance).expect("non-empty");
        if inner.prefetch_failed.contains(&expert) {
            continue; // its demand load reads it and reports the error
        }
        let resident = inner.by_expert.get(&expert).copied();
        if let Some(slot) = resident {
            let m = inner.slots[slot];
            if shared.kind(slot) == SlotKind::Record {
                // A record loaded for its update gets its compute part
                // from the update, if that comes first.
                let lacks = parts.missing_from(m.parts).is_some()
                    && !(m.parts == Parts::State
                        && (0..distance).any(|earlier| {
                            inner.schedule.upcoming(earlier) == Some((expert, Parts::State))
                        }));
                if m.state == SlotState::Ready && lacks && !m.upgrading && !m.writer {
                    plan.upgrades
                        .push((shared.begin_upgrade(inner, slot), expert));
                }
                continue;
            }
            // In a compute cell: enough unless its full record is
            // wanted, which is read into a record slot below.
            if parts == Parts::Compute || m.state != SlotState::Ready {
                continue;
            }
        }
        // If the window shows this expert's full record needed soon,
        // read it whole now rather than its compute part and then its
        // state in a second read. (Not for an update's state access:
        // that one is asked for where the compute part is elsewhere.)
        // From a cell, the compute part is copied over: the record is
        // whole.
        let wanted_whole = |later| inner.schedule.upcoming(later) == Some((expert, Parts::Full));
        let parts = if resident.is_some()
            || (parts == Parts::Compute && (distance + 1..ahead).any(wanted_whole))
        {
            Parts::Full
        } else {
            parts
        };
        // Only slots whose experts are needed after this one.
        let Some(victim) = shared.choose_place(inner, expert, parts, Some(distance)) else {
            if parts != Parts::Compute {
                // A clean record next read for its compute params
                // alone can give its record slot up for a cell.
                plan.demotion = shared.plan_demotion(inner, distance);
            }
            break;
        };
        // From a cell, only the state part is read: the compute part
        // is copied over from the cell, pinned until then.
        let from_cell = resident.map(|cell| {
            let pin = shared.pin(inner, cell);
            shared.leave_cell(inner, cell);
            pin
        });
        let (slot, write_back) = shared.claim(inner, victim, expert, parts);
        plan.loads.push(Load {
            slot,
            expert,
            parts,
            from_cell,
            write_back,
        });
    }
    plan
}

/// With nothing to load: writes back what will be evicted dirty later,
/// so those loads need not wait for the write; or, with none of those
/// either, waits for a change.
fn write_back_early<'a>(
    shared: &'a Shared,
    mut inner: MutexGuard<'a, Inner>,
) -> MutexGuard<'a, Inner> {
    let early = shared.claim_early_write_backs(&mut inner, shared.batch_max);
    if early.is_empty() {
        return shared.wait(inner);
    }
    drop(inner);
    let written = shared.write_back(early);
    let inner = shared.lock();
    if written.is_err() {
        // The store has latched the error, and the next load reports
        // it; the slots stay dirty. Retry only once something changes,
        // rather than spin on the latch.
        return shared.wait(inner);
    }
    inner
}

/// Writes back the records the loads evict (unlocked), then returns the
/// loads whose slots are free to read into; where the write failed, their
/// slots are given up (the store has latched the error, which demand
/// loads report).
fn write_back_evicted(shared: &Shared, loads: Vec<Load>) -> Vec<Load> {
    let write_backs: Vec<_> = loads
        .iter()
        .filter_map(|l| {
            let (old, step) = l.write_back?;
            Some((WriteFrom::Owned(&l.slot), old, step))
        })
        .collect();
    let written = write_backs.is_empty() || shared.write_slots(&write_backs).is_ok();
    drop(write_backs);
    let mut inner = shared.lock();
    let mut ready = Vec::with_capacity(loads.len());
    for load in loads {
        match (load.write_back, written) {
            (None, _) => ready.push(load),
            (Some(_), true) => {
                shared.evicted(&mut inner, &load.slot);
                ready.push(load);
            }
            (Some(_), false) => {
                shared.abandon(&mut inner, load.slot);
                if let Some(pin) = load.from_cell {
                    shared.unpin(&mut inner, pin);
                }
            }
        }
    }
    ready
}

/// Reads the batch (unlocked): each load's parts (the compute part
/// copied from its cell first) and each upgrade's missing part; then,
/// locked, marks them loaded, or, where the read failed, gives the slots
/// up and leaves those experts to their demand loads.
fn read_batch<'a>(
    shared: &'a Shared,
    ready: Vec<Load>,
    upgrades: Vec<(Upgrading, ExpertId)>,
) -> MutexGuard<'a, Inner> {
    let mut jobs = Vec::with_capacity(ready.len() + upgrades.len());
    for load in &ready {
        if let Some(cell) = &load.from_cell {
            shared.copy_compute(load.expert, cell, &load.slot);
        }
        jobs.push((ReadInto::Owned(&load.slot), load.expert, load.reads()));
    }
    for (upgrade, expert) in &upgrades {
        jobs.push((ReadInto::Upgrading(upgrade), *expert, upgrade.part()));
    }
    let read = shared.read_slots(&jobs).is_ok();
    drop(jobs);
    let mut inner = shared.lock();
    for load in ready {
        if read {
            let reads = load.reads();
            shared.loaded(&mut inner, load.slot, reads);
        } else {
            // Demand loads retry these and report the error themselves;
            // the prefetcher does not, or it would hold their slots
            // Loading again and again while the demand load waits.
            inner.prefetch_failed.insert(load.expert);
            shared.abandon(&mut inner, load.slot);
        }
        if let Some(pin) = load.from_cell {
            shared.unpin(&mut inner, pin);
        }
    }
    for (upgrade, expert) in upgrades {
        shared.end_upgrade(&mut inner, upgrade, read);
        if read {
            inner.prefetch_failed.remove(&expert);
        } else {
            inner.prefetch_failed.insert(expert);
        }
    }
    inner
}
