//! Slot memory: the one place the host tier's bytes are touched. Every
//! method here takes the hold that gives it its bytes (`Owned`, `Pinned`,
//! `Upgrading`, `WritingBack`, `Writing`, defined in `slots.rs`), and a hold
//! is made only where the lock sets its state and ended where the lock
//! clears it, so the protocol in the `cache` module docs is what the types
//! say: nothing outside `slots` can make a hold, or reach a slot's bytes
//! without one.

use std::ops::Range;

use super::{Owned, Pinned, Shared, SlotKind, Upgrading, Writing, WritingBack};
use crate::format::PART_HEADER_BYTES;
use crate::record::Parts;
use crate::store::stamp_headers;
use crate::timeline::{Timeline, TimelineSpan};
use crate::{ExpertId, TierError};

use super::expert_detail;

/// A hold that lets a read fill a slot's bytes: a whole slot being loaded,
/// or the part one being upgraded lacks.
pub(crate) enum ReadInto<'a> {
    Owned(&'a Owned),
    Upgrading(&'a Upgrading),
}

/// A hold that lets a write-back stamp a slot's headers and read its
/// payloads: a slot being evicted, or one written back in place.
pub(crate) enum WriteFrom<'a> {
    Owned(&'a Owned),
    WritingBack(&'a WritingBack),
}

impl ReadInto<'_> {
    fn slot(&self) -> usize {
        match self {
            ReadInto::Owned(h) => h.slot,
            ReadInto::Upgrading(h) => h.slot,
        }
    }
}

impl WriteFrom<'_> {
    fn slot(&self) -> usize {
        match self {
            WriteFrom::Owned(h) => h.slot,
            WriteFrom::WritingBack(h) => h.slot,
        }
    }
}

impl Shared {
    fn slot_ptr(&self, slot: usize) -> *mut u8 {
        let offset = match self.kind(slot) {
            SlotKind::Record => slot * self.slot_bytes,
            SlotKind::Cell => {
                self.record_slots * self.slot_bytes + (slot - self.record_slots) * self.cell_bytes
            }
        };
        assert!(offset + self.size_of(slot) <= self.region.len());
        self.region.as_ptr().wrapping_add(offset)
    }

    /// A byte range of a slot.
    ///
    /// # Safety
    /// The caller holds the access the slot protocol gives for exactly this
    /// range, and no `&mut` to it exists while the result lives.
    unsafe fn bytes(&self, slot: usize, range: Range<usize>) -> &[u8] {
        assert!(range.end <= self.size_of(slot));
        // SAFETY: in bounds (asserted), inside the region, which lives as
        // long as `self`; aliasing is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(slot).add(range.start), range.len()) }
    }

    /// A mutable byte range of a slot.
    ///
    /// # Safety
    /// The caller owns exactly this range under the slot protocol: no other
    /// reference to it exists while the result lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, slot: usize, range: Range<usize>) -> &mut [u8] {
        assert!(range.end <= self.size_of(slot));
        // SAFETY: as in `bytes`; exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(slot).add(range.start), range.len()) }
    }

    /// Payload bytes of a pinned slot. Headers are refused: a write-back
    /// stamps them while readers hold pins.
    pub fn pinned_bytes<'a>(&'a self, pin: &'a Pinned, range: Range<usize>) -> &'a [u8] {
        let cpb = self.layout.compute_part_bytes() as usize;
        let in_compute = range.start >= PART_HEADER_BYTES && range.end <= cpb;
        let in_state = range.start >= cpb + PART_HEADER_BYTES;
        assert!(in_compute || in_state, "a pin reads payloads, not headers");
        // SAFETY: a pin gives shared reads of the payloads: writers and
        // loads of this slot wait for its pins to drop, and write-backs
        // only touch the headers, excluded above.
        unsafe { self.bytes(pin.slot, range) }
    }

    /// The whole record of a slot its writer holds.
    pub fn written_bytes<'a>(&'a self, writer: &'a mut Writing) -> &'a mut [u8] {
        let end = self.layout.record_bytes() as usize;
        // SAFETY: the writer flag gives the one `Writing` hold every payload,
        // and its headers: readers are not pinned while it is set (they
        // wait), and write-backs skip written slots. `&mut` on the hold
        // makes this reference the only one.
        unsafe { self.bytes_mut(writer.slot, 0..end) }
    }

    /// Checksums a written slot's payloads into its headers as `expert`'s
    /// record of `step`.
    pub fn stamp_written(&self, writer: &mut Writing, expert: ExpertId, step: u64) {
        // SAFETY: the writer holds the whole slot (see `written_bytes`).
        unsafe { self.stamp(writer.slot, expert, step) }
    }

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

    /// The timeline an SSD call of `jobs` is recorded on (none for no jobs).
    fn timeline_for<T>(&self, jobs: &[T]) -> Option<&Timeline> {
        self.timeline.as_deref().filter(|_| !jobs.is_empty())
    }

    /// Reads `jobs` (hold, expert, parts) into their slots in one batch. A
    /// slot being upgraded takes its state part only.
    pub fn read_slots(&self, jobs: &[(ReadInto<'_>, ExpertId, Parts)]) -> Result<(), TierError> {
        let mut requests: Vec<(ExpertId, Parts, &mut [u8])> = jobs
            .iter()
            .map(|(hold, expert, parts)| {
                if let ReadInto::Upgrading(h) = hold {
                    assert_eq!(*parts, h.part(), "an upgrade reads the part it lacks");
                }
                // SAFETY: `Owned` gives this thread the whole slot;
                // `Upgrading` the part the slot lacks, the only range read
                // then (asserted): readers of a slot holding compute params
                // keep to that part, and a slot holding its state part
                // alone has no readers or writer (they wait).
                let buf = unsafe { self.bytes_mut(hold.slot(), parts.range(&self.layout)) };
                (*expert, *parts, buf)
            })
            .collect();
        let _span = TimelineSpan::start(self.timeline_for(jobs), "ssd", "read").with_detail(|| {
            let each = jobs.iter().map(|&(_, e, parts)| expert_detail(e, parts));
            each.collect::<Vec<_>>().join(", ")
        });
        self.store.read_many(&mut requests).map(|_| ())
    }

    /// Stamps headers and writes `jobs` (hold, expert, step) back.
    pub fn write_slots(&self, jobs: &[(WriteFrom<'_>, ExpertId, u64)]) -> Result<(), TierError> {
        let end = self.layout.record_bytes() as usize;
        let _span =
            TimelineSpan::start(self.timeline_for(jobs), "ssd", "write").with_detail(|| {
                let each = jobs.iter().map(|(_, e, _)| e.to_string());
                each.collect::<Vec<_>>().join(", ")
            });
        let stamped: Vec<bool> = {
            let inner = self.lock();
            jobs.iter()
                .map(|(hold, _, step)| inner.slots[hold.slot()].stamped == Some(*step))
                .collect()
        };
        for ((hold, expert, step), stamped) in jobs.iter().zip(stamped) {
            if !stamped {
                // SAFETY: both holds give this thread the two headers and
                // reads of the payloads (`Owned` the whole slot).
                unsafe { self.stamp(hold.slot(), *expert, *step) };
            }
        }
        let records: Vec<(ExpertId, u64, &[u8])> = jobs
            .iter()
            .map(|(hold, expert, step)| {
                // SAFETY: the whole record is only read from here on, which
                // both holds allow.
                let bytes = unsafe { self.bytes(hold.slot(), 0..end) };
                (*expert, *step, bytes)
            })
            .collect();
        self.store.write_stamped(&records)
    }

    /// Writes dirty slots back in place, as they stay resident, and ends
    /// their holds: each is clean afterwards unless it changed meanwhile.
    /// Wakes waiters.
    pub fn write_back(&self, jobs: Vec<(WritingBack, ExpertId, u64)>) -> Result<(), TierError> {
        let result = {
            let holds: Vec<_> = jobs
                .iter()
                .map(|(hold, e, step)| (WriteFrom::WritingBack(hold), *e, *step))
                .collect();
            self.write_slots(&holds)
        };
        let mut inner = self.lock();
        let count = jobs.len() as u64;
        for (hold, _, step) in jobs {
            let m = &mut inner.slots[hold.slot];
            m.writing_back = false;
            if result.is_ok() && m.dirty == Some(step) {
                m.dirty = None;
            }
        }
        if result.is_ok() {
            inner.stats.write_backs += count;
            inner.stats.bytes_written += count * self.layout.record_bytes();
        }
        drop(inner);
        self.changed.notify_all();
        result
    }

    /// Copies `expert`'s compute part (header and payload) from a pinned
    /// slot to one this thread is loading: a record's into a cell (a
    /// demotion), or a cell's into a record slot whose state part is then
    /// read.
    pub fn copy_compute(&self, expert: ExpertId, from: &Pinned, to: &Owned) {
        let _span = TimelineSpan::start(self.timeline.as_deref(), "host", "copy compute part")
            .with_detail(|| expert.to_string());
        let part = Parts::Compute.range(&self.layout);
        assert_ne!(from.slot, to.slot);
        // SAFETY: the compute header is read here, under a pin: its record
        // is clean (a demotion takes clean records; a cell is never
        // written back), so no write-back stamps it meanwhile. The Owned
        // slot is this thread's alone, and a different slot (asserted).
        unsafe {
            let source = self.bytes(from.slot, part.clone());
            self.bytes_mut(to.slot, part).copy_from_slice(source);
        }
    }
}
