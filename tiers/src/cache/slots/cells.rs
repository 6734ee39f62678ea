//! Compute cells: where a compute-only load goes, and how a clean
//! record's compute part moves into a cell (a demotion) to free its
//! record slot, or an expert leaves its cell for a record slot.

use super::{Inner, Owned, Pinned, Shared, SlotKind, SlotMeta, SlotState};
use crate::record::Parts;
use crate::ExpertId;

/// A record's compute part on its way from a record slot (pinned) to a
/// compute cell (loading) (`Shared::plan_demotion`).
pub(crate) struct Demotion {
    pub expert: ExpertId,
    pub from: Pinned,
    pub to: Owned,
}

impl Shared {
    /// Where a load of `expert`'s `parts` goes: a compute cell for compute
    /// params alone (when the tier has cells and the expert is not one it
    /// keeps), else a record slot; the victim as `choose_victim` picks it,
    /// falling back to a record slot when no cell is free.
    pub fn choose_place(
        &self,
        inner: &Inner,
        expert: ExpertId,
        parts: Parts,
        protect_within: Option<usize>,
    ) -> Option<usize> {
        let cell = parts == Parts::Compute
            && self.record_slots < inner.slots.len()
            && !inner.keep.contains(&expert);
        cell.then(|| self.choose_victim(inner, protect_within, SlotKind::Cell))
            .flatten()
            .or_else(|| self.choose_victim(inner, protect_within, SlotKind::Record))
    }

    /// Takes `expert` out of its compute cell, for an access that needs a
    /// record slot (its full record, or a writer). The cell is free at
    /// once if unpinned; else it is left empty with its pins, and free
    /// when its last reader drops its guard (readers keep the bytes they
    /// pinned; the record slot is loaded from the store, which the cell
    /// matches, as cells are never written).
    pub fn leave_cell(&self, inner: &mut Inner, slot: usize) {
        let m = inner.slots[slot];
        assert!(self.kind(slot) == SlotKind::Cell && m.state == SlotState::Ready);
        if let Some(e) = m.expert {
            inner.by_expert.remove(&e);
        }
        inner.slots[slot] = SlotMeta {
            pins: m.pins,
            ..SlotMeta::EMPTY
        };
        inner.recency.pop(&slot);
    }

    /// Plans to make room in the record slots for a record needed
    /// `distance` accesses ahead, where none is free to evict: a clean
    /// record whose expert is next read for its compute params only (and
    /// sooner than `distance`), and not in full until after it, moves them
    /// to a compute cell, whose own expert is needed later still, and gives
    /// up its record slot. Of those, the one needed last. (A record wanted
    /// in full before the one it makes room for would take its slot back,
    /// and the two would trade places for ever.) The record slot is pinned
    /// for the copy and the cell `Loading`; `finish_demotion` ends it.
    pub fn plan_demotion(&self, inner: &mut Inner, distance: usize) -> Option<Demotion> {
        if self.record_slots == inner.slots.len() {
            return None;
        }
        let (from, expert, next) = (0..self.record_slots)
            .filter_map(|slot| {
                let m = &inner.slots[slot];
                let e = m.expert?;
                let clean = m.state == SlotState::Ready
                    && m.evictable()
                    && m.dirty.is_none()
                    && m.parts.includes_compute();
                let d = inner.schedule.distance(e)?;
                let compute_next = inner.schedule.upcoming(d) == Some((e, Parts::Compute));
                let full_later = inner.schedule.full_distance(e).is_none_or(|f| f > distance);
                (clean && compute_next && full_later && d < distance).then_some((slot, e, d))
            })
            .max_by_key(|c| c.2)?;
        let to = self.choose_victim(inner, Some(next), SlotKind::Cell)?;
        if let Some(prev) = inner.slots[to].expert {
            inner.by_expert.remove(&prev);
            inner.stats.evictions += 1;
        }
        inner.recency.pop(&to);
        inner.slots[to] = SlotMeta {
            expert: Some(expert),
            state: SlotState::Loading,
            ..SlotMeta::EMPTY
        };
        let from = self.pin(inner, from);
        Some(Demotion {
            expert,
            from,
            to: Owned { slot: to },
        })
    }

    /// Ends a demotion: the expert now reads from its cell and the record
    /// slot is empty, unless the record was pinned, written or changed
    /// meanwhile, in which case it stays and the cell is emptied.
    pub fn finish_demotion(&self, inner: &mut Inner, demotion: Demotion) -> bool {
        let Demotion { expert, from, to } = demotion;
        let (from, to) = (from.slot, to.slot);
        let m = &mut inner.slots[from];
        m.pins -= 1;
        let intact = m.state == SlotState::Ready
            && m.expert == Some(expert)
            && m.evictable()
            && m.dirty.is_none();
        if !intact {
            inner.slots[to] = SlotMeta::EMPTY;
            return false;
        }
        inner.slots[from] = SlotMeta::EMPTY;
        inner.recency.pop(&from);
        inner.by_expert.insert(expert, to);
        inner.slots[to].state = SlotState::Ready;
        inner.recency.put(to, ());
        inner.stats.demotions += 1;
        true
    }
}
