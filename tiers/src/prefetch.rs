//! The prefetcher: background threads (two by default: one plans and
//! issues its batch while the other's ends) that walk the access schedule
//! ahead of the cursor and load what is not resident, in batches (so
//! io_uring can keep several reads in flight), into slots whose experts
//! are needed later than the one being loaded. It never evicts an expert
//! the schedule needs sooner than the one it brings in, so following the
//! schedule never makes it fight compute. With nothing to load, it writes
//! back the dirty records that will be evicted unchanged, so the loads
//! that evict them later only read. Where a record is wanted and every
//! record slot holds one needed sooner, it moves a clean one that is next
//! read for its compute params alone into a compute cell.

use crate::cache::{Shared, SlotKind, SlotState};
use crate::record::Parts;

pub(crate) fn run(shared: &Shared) {
    let mut inner = shared.lock();
    loop {
        if inner.stop {
            return;
        }
        let mut loads = Vec::new();
        let mut write_backs = Vec::new();
        let mut upgrades = Vec::new();
        let mut demotion = None;
        let ahead = shared.ahead_max.min(inner.schedule.len());
        for distance in 0..ahead {
            if loads.len() + upgrades.len() >= shared.batch_max {
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
                    let needs_state = parts == Parts::Full && m.parts == Parts::Compute;
                    if m.state == SlotState::Ready && needs_state && !m.upgrading && !m.writer {
                        inner.slots[slot].upgrading = true;
                        upgrades.push((slot, expert, Parts::State));
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
            // state in a second read.
            let parts = if parts == Parts::Compute
                && (distance + 1..ahead)
                    .any(|later| inner.schedule.upcoming(later) == Some((expert, Parts::Full)))
            {
                Parts::Full
            } else {
                parts
            };
            // Only slots whose experts are needed after this one.
            let Some(victim) = shared.choose_place(&inner, expert, parts, Some(distance)) else {
                if parts != Parts::Compute {
                    // A clean record next read for its compute params
                    // alone can give its record slot up for a cell.
                    demotion = shared.plan_demotion(&mut inner, distance);
                }
                break;
            };
            // From a cell, only the state part is read: the compute part
            // is copied over from the cell, pinned until then.
            let from_cell = resident.inspect(|&cell| {
                inner.slots[cell].pins += 1;
                shared.leave_cell(&mut inner, cell);
            });
            if let Some(job) = shared.claim(&mut inner, victim, expert, parts) {
                write_backs.push(job);
            }
            loads.push((victim, expert, parts, from_cell));
        }
        if let Some(demotion) = &demotion {
            drop(inner);
            // SAFETY: `plan_demotion` pinned the record slot and set the
            // cell Loading for this thread; it is finished just below.
            unsafe { shared.copy_compute(demotion.expert, demotion.from, demotion.to) };
            inner = shared.lock();
            shared.finish_demotion(&mut inner, demotion);
            shared.changed.notify_all();
        }
        if loads.is_empty() && upgrades.is_empty() {
            if demotion.is_some() {
                continue; // a record slot is free now: plan its load
            }
            // Nothing to load: write back what will be evicted dirty
            // later, so those loads need not wait for the write.
            let early = shared.claim_early_write_backs(&mut inner, shared.batch_max);
            if early.is_empty() {
                inner = shared.wait(inner);
                continue;
            }
            drop(inner);
            // SAFETY: `claim_early_write_backs` set these slots
            // `writing_back` for this thread.
            let written = unsafe { shared.write_back(&early) };
            inner = shared.lock();
            if written.is_err() {
                // The store has latched the error, and the next load
                // reports it; the slots stay dirty. Retry only once
                // something changes, rather than spin on the latch.
                inner = shared.wait(inner);
            }
            continue;
        }
        drop(inner);

        // SAFETY: every write-back slot was set Evicting for this thread by
        // `claim` above.
        let written = write_backs.is_empty() || unsafe { shared.write_slots(&write_backs) }.is_ok();
        inner = shared.lock();
        for &(slot, _, _) in &write_backs {
            if written {
                shared.evicted(&mut inner, slot);
            } else {
                // The store has latched the error; demand loads report it.
                shared.abandon(&mut inner, slot);
                for l in loads.iter().filter(|l| l.0 == slot) {
                    if let Some(cell) = l.3 {
                        inner.slots[cell].pins -= 1;
                    }
                }
                loads.retain(|l| l.0 != slot);
            }
        }
        drop(inner);

        let mut jobs = Vec::with_capacity(loads.len() + upgrades.len());
        for &(slot, expert, parts, from_cell) in &loads {
            match from_cell {
                Some(cell) => {
                    // SAFETY: the cell is pinned by this thread and the
                    // slot Loading for it.
                    unsafe { shared.copy_compute(expert, cell, slot) };
                    jobs.push((slot, expert, Parts::State));
                }
                None => jobs.push((slot, expert, parts)),
            }
        }
        jobs.extend_from_slice(&upgrades);
        // SAFETY: load slots are Loading for this thread (claim/evicted);
        // upgrade slots are `upgrading`, which gives it their state part.
        let read = unsafe { shared.read_slots(&jobs) }.is_ok();
        inner = shared.lock();
        for (&(slot, expert, _, from_cell), &(_, _, read_parts)) in loads.iter().zip(&jobs) {
            if read {
                shared.loaded(&mut inner, slot, read_parts);
            } else {
                // Demand loads retry these and report the error themselves;
                // the prefetcher does not, or it would hold their slots
                // Loading again and again while the demand load waits.
                inner.prefetch_failed.insert(expert);
                shared.abandon(&mut inner, slot);
            }
            if let Some(cell) = from_cell {
                inner.slots[cell].pins -= 1;
            }
        }
        for &(slot, expert, _) in &upgrades {
            let m = &mut inner.slots[slot];
            m.upgrading = false;
            if read {
                m.parts = Parts::Full;
                inner.stats.loads += 1;
                inner.stats.bytes_read += shared.layout.state_part_bytes();
                inner.prefetch_failed.remove(&expert);
            } else {
                inner.prefetch_failed.insert(expert);
            }
        }
        shared.changed.notify_all();
    }
}
