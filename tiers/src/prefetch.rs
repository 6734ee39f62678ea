//! The prefetcher: background threads (two by default: one plans and
//! issues its batch while the other's ends) that walk the access schedule
//! ahead of the cursor and load what is not resident, in batches (so
//! io_uring can keep several reads in flight), into slots whose experts
//! are needed later than the one being loaded. It never evicts an expert
//! the schedule needs sooner than the one it brings in, so following the
//! schedule never makes it fight compute. With nothing to load, it writes
//! back the dirty records that will be evicted unchanged, so the loads
//! that evict them later only read.

use crate::cache::{Shared, SlotState};
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
        let ahead = shared.ahead_max.min(inner.schedule.len());
        for distance in 0..ahead {
            if loads.len() + upgrades.len() >= shared.batch_max {
                break;
            }
            let (expert, parts) = inner.schedule.upcoming(distance).expect("non-empty");
            if let Some(&slot) = inner.by_expert.get(&expert) {
                let m = inner.slots[slot];
                let needs_state = parts == Parts::Full && m.parts == Parts::Compute;
                if m.state == SlotState::Ready && needs_state && !m.upgrading && !m.writer {
                    inner.slots[slot].upgrading = true;
                    upgrades.push((slot, expert, Parts::State));
                }
                continue;
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
            let Some(victim) = shared.choose_victim(&inner, Some(distance)) else {
                break;
            };
            if let Some(job) = shared.claim(&mut inner, victim, expert, parts) {
                write_backs.push(job);
            }
            loads.push((victim, expert, parts));
        }
        if loads.is_empty() && upgrades.is_empty() {
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
                loads.retain(|&(s, _, _)| s != slot);
            }
        }
        drop(inner);

        let mut jobs = loads.clone();
        jobs.extend_from_slice(&upgrades);
        // SAFETY: load slots are Loading for this thread (claim/evicted);
        // upgrade slots are `upgrading`, which gives it their state part.
        let read = unsafe { shared.read_slots(&jobs) }.is_ok();
        inner = shared.lock();
        for &(slot, _, _) in &loads {
            if read {
                shared.loaded(&mut inner, slot);
            } else {
                // Demand loads retry these and report the error themselves.
                shared.abandon(&mut inner, slot);
            }
        }
        for &(slot, _, _) in &upgrades {
            let m = &mut inner.slots[slot];
            m.upgrading = false;
            if read {
                m.parts = Parts::Full;
                inner.stats.loads += 1;
                inner.stats.bytes_read += shared.layout.state_part_bytes();
            }
        }
        shared.changed.notify_all();
    }
}
