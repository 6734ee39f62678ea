//! The guards [`HostCache`](super::HostCache) hands out: [`ReadGuard`], a
//! shared pin of an expert's compute params (and optionally its state),
//! and [`WriteGuard`], the one exclusive hold of a full record that the
//! optimizer updates and seals.

use std::sync::Arc;

use super::slots::{Pinned, Writing};
use super::Shared;
use crate::format::PART_HEADER_BYTES;
use crate::record::{Parts, RecordMut};
use crate::ExpertId;

/// A shared pin of one expert's compute params (and, for `Parts::Full`,
/// its optimizer state). Dropping it unpins.
pub struct ReadGuard {
    pub(super) shared: Arc<Shared>,
    /// `None` only while dropping.
    pub(super) pin: Option<Pinned>,
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
        self.shared
            .pinned_bytes(self.pinned(), PART_HEADER_BYTES..PART_HEADER_BYTES + n)
    }

    fn pinned(&self) -> &Pinned {
        self.pin.as_ref().expect("a live guard holds its pin")
    }

    /// Master params, m and v (only for a `Parts::Full` guard).
    pub fn state(&self) -> Option<(&[f32], &[f32], &[f32])> {
        if self.parts != Parts::Full {
            return None;
        }
        let layout = &self.shared.layout;
        let at = layout.compute_part_bytes() as usize + PART_HEADER_BYTES;
        let n = layout.params_per_expert as usize;
        // A Full pin means the state part is loaded.
        let len = layout.state_payload_bytes() as usize;
        let bytes = self.shared.pinned_bytes(self.pinned(), at..at + len);
        let floats: &[f32] = bytemuck::cast_slice(bytes);
        // Without moments, m and v are empty.
        let (master, moments) = floats.split_at(n);
        let (m, v) = moments.split_at(moments.len() / 2);
        Some((master, m, v))
    }
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        if let Some(pin) = self.pin.take() {
            self.shared.unpin(&mut self.shared.lock(), pin);
            self.shared.changed.notify_all();
        }
    }
}

/// An exclusive pin of one expert's full record. From
/// [`HostCache::acquire_to_update`](super::HostCache::acquire_to_update),
/// the compute payload may hold bytes that are not the record's until
/// the writer writes it: [`Self::seal`] and [`Self::mark_dirty`] declare
/// every payload written.
pub struct WriteGuard {
    pub(super) shared: Arc<Shared>,
    /// `None` once `seal` has handed the slot back.
    pub(super) writer: Option<Writing>,
    pub(super) expert: ExpertId,
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
        let writer = self
            .writer
            .as_mut()
            .expect("a sealed WriteGuard no longer holds its slot");
        let bytes = self.shared.written_bytes(writer);
        crate::record::record_mut(&self.shared.layout, bytes).expect("a slot holds a full record")
    }

    /// Records that the slot now differs from the store, every payload
    /// written; it is written back (with `step` in its headers) before
    /// eviction and at `flush`.
    pub fn mark_dirty(&mut self, step: u64) {
        let writer = self
            .writer
            .as_ref()
            .expect("a sealed WriteGuard no longer holds its slot");
        self.shared
            .mark_written(&mut self.shared.lock(), writer, step);
    }

    /// The writer is done, every payload written: marks the record dirty
    /// as `step` and gives the slot back at once. The guard holds nothing afterwards; dropping it
    /// is a no-op.
    ///
    /// Where records get evicted (the host tier holds fewer than all of
    /// them), the record is checksummed into its headers here, on the
    /// calling thread, so that its write-back only submits the bytes.
    /// Where every record stays resident, nothing is written back until a
    /// flush, which checksums what it writes: a record updated every step
    /// is checksummed once a flush, not once a step.
    pub fn seal(&mut self, step: u64) {
        let mut writer = self.writer.take().expect("a WriteGuard is sealed once");
        let stamp_now = self.shared.evicts;
        if stamp_now {
            self.shared.stamp_written(&mut writer, self.expert, step);
        }
        let sealed = Some((step, stamp_now));
        self.shared
            .release_writer(&mut self.shared.lock(), writer, sealed);
        self.shared.changed.notify_all();
    }
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        if let Some(writer) = self.writer.take() {
            self.shared
                .release_writer(&mut self.shared.lock(), writer, None);
            self.shared.changed.notify_all();
        }
    }
}
