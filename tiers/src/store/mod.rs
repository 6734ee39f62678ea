//! [`ExpertStore`]: every expert's record in one file, crash-safe.
//!
//! Each expert has two record copies. Between checkpoints, writes go to the
//! *working* copy, never to the one the committed checkpoint names; a
//! checkpoint syncs those writes, writes a new copy map (which copy of each
//! expert is current, and its step) into the map region the older
//! superblock owns, syncs, then writes that superblock with the next
//! generation and syncs. A crash at any instant therefore leaves one intact
//! superblock whose map names intact records: the last committed checkpoint.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::busy::BusyClock;
use crate::error::Part;
use crate::format::{
    crc, encode_map, Dtype, Layout, MapEntry, PartHeader, Superblock, BLOCK_BYTES, NEVER_WRITTEN,
    PART_HEADER_BYTES,
};
use crate::io::{AlignedBuf, HostRegion, ReadOp, RecordDevice, WriteOp};
use crate::record::Parts;
use crate::verify::{ChunkVerifier, PartsCheck};
use crate::{ExpertId, TierError};

mod open;
mod roll_back;

/// Reads are split into chunks of at most this many bytes (a multiple of
/// the 4096-byte alignment O_DIRECT needs), each checked as it arrives.
const READ_CHUNK_BYTES: usize = 1 << 20;

struct Meta {
    superblock: Superblock,
    /// Per expert (dense index): the committed copy and its step.
    committed: Vec<MapEntry>,
    /// Per expert: the step written to its working copy since the last
    /// checkpoint, if any.
    pending: Vec<Option<u64>>,
}

/// The SSD tier. Thread-safe: reads and writes of different experts may run
/// from several threads; `checkpoint` orders itself after writes that
/// returned before it was called.
pub struct ExpertStore {
    device: Box<dyn RecordDevice>,
    layout: Layout,
    meta: Mutex<Meta>,
    /// The first I/O failure: (operation, message). Once set, every call
    /// fails with `PreviousIo`.
    latch: Mutex<Option<(&'static str, String)>>,
    notes: Vec<String>,
    path: Option<PathBuf>,
    /// Time with a read, write or fsync in flight.
    busy: BusyClock,
    /// Taken for each device call when the engine runs one batch at a time
    /// (`RecordDevice::one_batch_at_a_time`), so that a call waiting for
    /// another's batch to end is not counted as busy.
    turn: Mutex<()>,
}

/// A device call in flight: the engine's turn, where it has one, and the
/// busy clock running.
struct InFlight<'a> {
    _busy: crate::busy::BusyGuard<'a>,
    _turn: Option<MutexGuard<'a, ()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ExpertStore {
    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The step the last committed checkpoint names.
    pub fn committed_step(&self) -> u64 {
        lock(&self.meta).superblock.committed_step
    }

    /// `io_uring`, `pread`, `memory` or `faulty`.
    pub fn engine(&self) -> &'static str {
        self.device.engine()
    }

    /// Why a preferred engine or O_DIRECT was not used, if so.
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Registers a host region with the I/O engine (io_uring fixed buffers)
    /// so reads into and writes from it skip per-operation page pinning.
    /// Returns whether it was registered (only io_uring does; a refusal, e.g.
    /// by the memlock limit, just leaves I/O unregistered). The engine keeps
    /// the region's memory mapped until `unregister_host_region` or drop.
    pub fn register_host_region(&self, region: &HostRegion) -> bool {
        self.device.register_buffers(region)
    }

    pub fn unregister_host_region(&self) {
        self.device.unregister_buffers();
    }

    /// The step the current version of `expert` was written at, or `None`
    /// if it was never written.
    pub fn expert_step(&self, expert: ExpertId) -> Result<Option<u64>, TierError> {
        let slot = self.layout.slot_of(expert)? as usize;
        let meta = lock(&self.meta);
        Ok(match meta.pending[slot] {
            Some(step) => Some(step),
            None => Some(meta.committed[slot].step).filter(|&s| s != NEVER_WRITTEN),
        })
    }

    /// Time with at least one read, write or fsync of this store in flight
    /// since the last call (or since it was opened).
    pub fn take_busy(&self) -> std::time::Duration {
        self.busy.take()
    }

    /// Enters a device call: waits for the engine's turn (where it runs one
    /// batch at a time), then starts the busy clock.
    fn in_flight(&self) -> InFlight<'_> {
        let turn = self.device.one_batch_at_a_time().then(|| lock(&self.turn));
        InFlight {
            _busy: self.busy.enter(),
            _turn: turn,
        }
    }

    fn check_latch(&self) -> Result<(), TierError> {
        match lock(&self.latch).clone() {
            Some((op, message)) => Err(TierError::PreviousIo { op, message }),
            None => Ok(()),
        }
    }

    /// Runs one device call through the I/O latch.
    fn guard<T>(
        &self,
        op: &'static str,
        f: impl FnOnce() -> Result<T, TierError>,
    ) -> Result<T, TierError> {
        self.check_latch()?;
        let _in_flight = self.in_flight();
        f().inspect_err(|e| {
            lock(&self.latch).get_or_insert((op, e.to_string()));
        })
    }

    /// Reads the given parts of several experts in one batch (queue depth
    /// permitting, concurrently) into their buffers, verifying every
    /// checksum. Returns each expert's record step.
    pub fn read_many(
        &self,
        requests: &mut [(ExpertId, Parts, &mut [u8])],
    ) -> Result<Vec<u64>, TierError> {
        let mut located = Vec::with_capacity(requests.len());
        {
            let meta = lock(&self.meta);
            for (expert, _, _) in requests.iter() {
                let slot = self.layout.slot_of(*expert)? as usize;
                located.push(match meta.pending[slot] {
                    Some(step) => MapEntry {
                        step,
                        copy: 1 - meta.committed[slot].copy,
                    },
                    None => {
                        let e = meta.committed[slot];
                        if e.step == NEVER_WRITTEN {
                            return Err(TierError::NeverWritten { expert: *expert });
                        }
                        e
                    }
                });
            }
        }
        self.read_copies(requests, &located)?;
        Ok(located.iter().map(|e| e.step).collect())
    }

    /// Reads `requests` as [`ExpertStore::read_many`] does, each from the
    /// copy `located` names, checked against the step it names.
    fn read_copies(
        &self,
        requests: &mut [(ExpertId, Parts, &mut [u8])],
        located: &[MapEntry],
    ) -> Result<(), TierError> {
        let mut offsets = Vec::with_capacity(requests.len());
        for ((expert, parts, buf), entry) in requests.iter().zip(located) {
            let slot = self.layout.slot_of(*expert)?;
            let need = parts.bytes(&self.layout) as usize;
            if buf.len() < need {
                return Err(TierError::BufferSize {
                    what: "a record read",
                    expected: need,
                    got: buf.len(),
                });
            }
            offsets.push(self.layout.record_offset(slot, entry.copy));
        }
        // Each read is split into chunks, and each chunk checked on a
        // verifier thread as soon as it and those before it have arrived:
        // checksumming overlaps the chunks still in flight, never delays
        // reaping and refilling the queue, and after the batch's last chunk
        // only that chunk's checksum is left to compute. A checksum error
        // is not an I/O failure: it is returned as is and does not latch.
        let mut checks = Vec::with_capacity(requests.len());
        // Per op (chunk): the read it belongs to.
        let mut owner = Vec::new();
        let mut ops: Vec<ReadOp<'_>> = Vec::new();
        let reads = requests.iter_mut().zip(&offsets).zip(located);
        for (r, (((expert, parts, buf), &offset), entry)) in reads.enumerate() {
            checks.push(PartsCheck::new(&self.layout, *expert, *parts, entry.step));
            let range = parts.range(&self.layout);
            let mut at = offset + range.start as u64;
            for chunk in buf[..range.len()].chunks_mut(READ_CHUNK_BYTES) {
                let len = chunk.len() as u64;
                ops.push(ReadOp {
                    offset: at,
                    buf: chunk,
                });
                owner.push(r);
                at += len;
            }
        }
        self.check_latch()?;
        let (result, verify_error) = self.read_verifying(&mut ops, checks, &owner);
        if let Err(e) = result {
            lock(&self.latch).get_or_insert(("read", e.to_string()));
            return Err(e);
        }
        if let Some(e) = verify_error {
            return Err(e);
        }
        Ok(())
    }

    /// Runs `ops` (chunks of reads, `owner[i]` the read of chunk i) as one
    /// batch, each read checked by its `checks` as its chunks arrive (on a
    /// verifier thread where there are several chunks): the batch's
    /// result, and the first check that failed.
    fn read_verifying(
        &self,
        ops: &mut [ReadOp<'_>],
        checks: Vec<PartsCheck>,
        owner: &[usize],
    ) -> (Result<(), TierError>, Option<TierError>) {
        if ops.len() < 2 {
            // At most one read, in one chunk.
            let mut verify_error = None;
            let mut checks = checks.into_iter();
            let _in_flight = self.in_flight();
            let result = self.device.read_batch_each(ops, &mut |_, bytes| {
                let mut check = checks.next().expect("a check per read");
                check.feed(bytes);
                verify_error = check.finish().err();
                Ok(())
            });
            return (result, verify_error);
        }
        std::thread::scope(|scope| {
            let (tx, rx) = crossbeam_channel::bounded::<(usize, &[u8])>(ops.len());
            let verifier = scope.spawn(move || {
                let mut verifier = ChunkVerifier::new(checks, owner);
                for (i, bytes) in rx.iter() {
                    verifier.arrived(i, bytes);
                }
                verifier.into_error()
            });
            let in_flight = self.in_flight();
            let result = self.device.read_batch_each(ops, &mut |i, bytes| {
                // The channel holds every op, so this never blocks.
                let _ = tx.send((i, bytes));
                Ok(())
            });
            drop(in_flight);
            drop(tx);
            let verify_error = verifier.join().unwrap_or_else(|panic| {
                std::panic::resume_unwind(panic);
            });
            (result, verify_error)
        })
    }

    /// Reads one expert's parts into `buf`; returns its record step.
    pub fn read(&self, expert: ExpertId, parts: Parts, buf: &mut [u8]) -> Result<u64, TierError> {
        Ok(self.read_many(&mut [(expert, parts, buf)])?[0])
    }

    /// Stamps headers and checksums into full-record buffers and writes
    /// them, in one batch, to each expert's working copy. Durable only after
    /// the next `checkpoint`.
    pub fn write_many(&self, records: &mut [(ExpertId, u64, &mut [u8])]) -> Result<(), TierError> {
        let record_bytes = self.layout.record_bytes() as usize;
        for (expert, step, buf) in records.iter_mut() {
            self.layout.slot_of(*expert)?;
            if buf.len() < record_bytes {
                return Err(TierError::BufferSize {
                    what: "a record write",
                    expected: record_bytes,
                    got: buf.len(),
                });
            }
            stamp(&self.layout, *expert, *step, buf);
        }
        let stamped: Vec<(ExpertId, u64, &[u8])> =
            records.iter().map(|(e, s, b)| (*e, *s, &b[..])).collect();
        self.write_stamped(&stamped)
    }

    /// Writes records whose headers are already stamped (`stamp_headers`).
    pub(crate) fn write_stamped(
        &self,
        records: &[(ExpertId, u64, &[u8])],
    ) -> Result<(), TierError> {
        let layout = self.layout;
        let record_bytes = layout.record_bytes() as usize;
        let slots = records
            .iter()
            .map(|(e, _, _)| layout.slot_of(*e))
            .collect::<Result<Vec<u64>, _>>()?;
        let offsets: Vec<u64> = {
            let meta = lock(&self.meta);
            slots
                .iter()
                .map(|&s| layout.record_offset(s, 1 - meta.committed[s as usize].copy))
                .collect()
        };
        let ops: Vec<WriteOp<'_>> = records
            .iter()
            .zip(&offsets)
            .map(|((_, _, buf), &offset)| WriteOp {
                offset,
                buf: &buf[..record_bytes],
            })
            .collect();
        self.guard("write", || self.device.write_batch(&ops))?;
        let mut meta = lock(&self.meta);
        for ((_, step, _), &slot) in records.iter().zip(&slots) {
            meta.pending[slot as usize] = Some(*step);
        }
        Ok(())
    }

    /// Writes one expert's full record (see `write_many`).
    pub fn write(&self, expert: ExpertId, step: u64, buf: &mut [u8]) -> Result<(), TierError> {
        self.write_many(&mut [(expert, step, buf)])
    }

    /// Commits every record written so far as checkpoint `step`: fsync the
    /// records, write and fsync the copy map, then write and fsync the
    /// superblock. When this returns, a crash recovers exactly this state.
    pub fn checkpoint(&self, step: u64) -> Result<(), TierError> {
        let mut meta = lock(&self.meta);
        self.guard("fsync", || self.device.sync())?;
        let generation = meta.superblock.generation + 1;
        self.commit(&mut meta, generation, step)
    }

    fn commit(&self, meta: &mut Meta, generation: u64, step: u64) -> Result<(), TierError> {
        let layout = self.layout;
        let next: Vec<MapEntry> = meta
            .committed
            .iter()
            .zip(&meta.pending)
            .map(|(c, p)| match p {
                Some(s) => MapEntry {
                    step: *s,
                    copy: 1 - c.copy,
                },
                None => *c,
            })
            .collect();
        let mut map = AlignedBuf::zeroed(layout.map_bytes() as usize);
        encode_map(&next, map.as_mut_slice());
        let which = (generation % 2) as usize;
        self.guard("write", || {
            self.device
                .write_at(map.as_slice(), layout.map_offset(which))
        })?;
        self.guard("fsync", || self.device.sync())?;
        let superblock = Superblock {
            generation,
            committed_step: step,
            layout,
            map_crc: crc(map.as_slice()),
        };
        let mut block = AlignedBuf::zeroed(BLOCK_BYTES);
        block.as_mut_slice().copy_from_slice(&superblock.encode());
        self.guard("write", || {
            self.device
                .write_at(block.as_slice(), (which * BLOCK_BYTES) as u64)
        })?;
        self.guard("fsync", || self.device.sync())?;
        meta.committed = next;
        meta.pending.iter_mut().for_each(|p| *p = None);
        meta.superblock = superblock;
        Ok(())
    }
}

/// Writes both part headers (with payload checksums) into a record buffer.
pub(crate) fn stamp(layout: &Layout, expert: ExpertId, step: u64, buf: &mut [u8]) {
    let cpb = layout.compute_part_bytes() as usize;
    let (compute_part, state_part) = buf.split_at_mut(cpb);
    let (compute_header, compute_rest) = compute_part.split_at_mut(PART_HEADER_BYTES);
    let (state_header, state_rest) = state_part.split_at_mut(PART_HEADER_BYTES);
    stamp_headers(
        layout,
        expert,
        step,
        compute_header,
        compute_rest,
        state_header,
        state_rest,
    );
}

/// Writes the two 64-byte part headers of a record from its payloads. The
/// payload slices may be longer than the payload (the padding is ignored).
pub(crate) fn stamp_headers(
    layout: &Layout,
    expert: ExpertId,
    step: u64,
    compute_header: &mut [u8],
    compute_payload: &[u8],
    state_header: &mut [u8],
    state_payload: &[u8],
) {
    let compute_bytes = layout.compute_payload_bytes();
    PartHeader {
        part: Part::Compute,
        dtype: layout.compute_dtype,
        expert,
        step,
        payload_bytes: compute_bytes,
        payload_crc: crc(&compute_payload[..compute_bytes as usize]),
    }
    .encode(compute_header);
    let state_bytes = layout.state_payload_bytes();
    PartHeader {
        part: Part::State,
        dtype: Dtype::F32,
        expert,
        step,
        payload_bytes: state_bytes,
        payload_crc: crc(&state_payload[..state_bytes as usize]),
    }
    .encode(state_header);
}

fn describe(l: &Layout) -> String {
    format!(
        "{} layers × {} experts × {} params ({})",
        l.layers,
        l.experts_per_layer,
        l.params_per_expert,
        l.compute_dtype.name()
    )
}
