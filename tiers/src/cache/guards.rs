//! The guards [`HostCache`](super::HostCache) hands out: [`ReadGuard`], a
//! shared pin of an expert's compute params (and optionally its state),
//! and [`WriteGuard`], the one exclusive hold of a full record that the
//! optimizer updates and seals.

use std::sync::Arc;

use super::Shared;
use crate::format::PART_HEADER_BYTES;
use crate::record::{Parts, RecordMut};
use crate::ExpertId;

/// A shared pin of one expert's compute params (and, for `Parts::Full`,
/// its optimizer state). Dropping it unpins.
pub struct ReadGuard {
    pub(super) shared: Arc<Shared>,
    pub(super) slot: usize,
    pub(super) expert: ExpertId,
    pub(super) parts: Parts,
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
    pub(super) shared: Arc<Shared>,
    pub(super) slot: usize,
    pub(super) expert: ExpertId,
    /// `seal` has handed the slot back.
    pub(super) sealed: bool,
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

    /// The writer is done: marks the record dirty as `step` and gives the
    /// slot back at once. The guard holds nothing afterwards; dropping it
    /// is a no-op.
    ///
    /// Where records get evicted (the host tier holds fewer than all of
    /// them), the record is checksummed into its headers here, on the
    /// calling thread, so that its write-back only submits the bytes.
    /// Where every record stays resident, nothing is written back until a
    /// flush, which checksums what it writes: a record updated every step
    /// is checksummed once a flush, not once a step.
    pub fn seal(&mut self, step: u64) {
        assert!(!self.sealed, "a WriteGuard is sealed once");
        let stamp_now = self.shared.evicts;
        if stamp_now {
            // SAFETY: the writer flag gives this guard the whole slot,
            // headers included: write-backs skip written slots
            // (`evictable`, `flush`).
            unsafe { self.shared.stamp(self.slot, self.expert, step) };
        }
        let mut inner = self.shared.lock();
        let m = &mut inner.slots[self.slot];
        assert!(m.writer, "sealing a slot without its writer");
        m.dirty = Some(step);
        m.stamped = stamp_now.then_some(step);
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
