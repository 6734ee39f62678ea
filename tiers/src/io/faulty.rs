//! A fault-injecting store file for crash tests.
//!
//! It keeps two images: `live` (what reads see) and `durable` (what a sync
//! has made permanent). Writes since the last sync are kept in order; a
//! "crash" builds a new image from `durable` plus each unsynced write either
//! lost, landed whole, or torn at a 512-byte sector boundary, as a real disk
//! may do. A plan makes the Nth operation or the Nth sync fail, after which
//! the device is dead (every call fails), as after a power cut.

use std::sync::Mutex;

use super::{ReadOp, RecordDevice, WriteOp};
use crate::TierError;

const SECTOR_BYTES: usize = 512;

/// When to fail.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Operation number (reads, writes and syncs, counted from 0) that fails.
    pub fail_at_op: Option<u64>,
    /// Sync number (counted from 0) that fails.
    pub fail_at_sync: Option<u64>,
    /// Decides, at `crash_image`, how unsynced writes land.
    pub tear_seed: u64,
}

struct State {
    live: Vec<u8>,
    durable: Vec<u8>,
    unsynced: Vec<(u64, Vec<u8>)>,
    ops: u64,
    syncs: u64,
    dead: bool,
    plan: FaultPlan,
}

pub struct FaultyFile {
    state: Mutex<State>,
}

fn injected(op: &'static str, offset: u64) -> TierError {
    TierError::io(op, offset, std::io::Error::other("injected fault"))
}

impl FaultyFile {
    pub fn new(plan: FaultPlan) -> Self {
        Self::from_image(Vec::new(), plan)
    }

    /// A device whose durable and live images are `image`.
    pub fn from_image(image: Vec<u8>, plan: FaultPlan) -> Self {
        Self {
            state: Mutex::new(State {
                live: image.clone(),
                durable: image,
                unsynced: Vec::new(),
                ops: 0,
                syncs: 0,
                dead: false,
                plan,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_plan(&self, plan: FaultPlan) {
        self.lock().plan = plan;
    }

    /// Operations and syncs so far.
    pub fn counts(&self) -> (u64, u64) {
        let s = self.lock();
        (s.ops, s.syncs)
    }

    pub fn is_dead(&self) -> bool {
        self.lock().dead
    }

    /// What the disk holds after a power cut now.
    pub fn crash_image(&self) -> Vec<u8> {
        let s = self.lock();
        let mut image = s.durable.clone();
        let mut rng = s.plan.tear_seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for (offset, bytes) in &s.unsynced {
            let keep = match next() % 3 {
                0 => 0,
                1 => bytes.len(),
                _ => {
                    let sectors = bytes.len().div_ceil(SECTOR_BYTES);
                    (next() as usize % sectors.max(1)) * SECTOR_BYTES
                }
            };
            let keep = keep.min(bytes.len());
            let start = *offset as usize;
            if image.len() < start + keep {
                image.resize(start + keep, 0);
            }
            image[start..start + keep].copy_from_slice(&bytes[..keep]);
        }
        image
    }

    /// Counts one operation; errors if it is the planned failure or the
    /// device is already dead.
    fn begin(s: &mut State, op: &'static str, offset: u64) -> Result<(), TierError> {
        if s.dead {
            return Err(injected(op, offset));
        }
        let n = s.ops;
        s.ops += 1;
        if s.plan.fail_at_op == Some(n) {
            s.dead = true;
            return Err(injected(op, offset));
        }
        Ok(())
    }
}

impl RecordDevice for FaultyFile {
    fn engine(&self) -> &'static str {
        "faulty"
    }

    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Result<(), TierError> {
        let mut s = self.lock();
        for op in ops.iter_mut() {
            Self::begin(&mut s, "read", op.offset)?;
            let start = op.offset as usize;
            let end = start + op.buf.len();
            if end > s.live.len() {
                return Err(TierError::io(
                    "read",
                    op.offset,
                    std::io::ErrorKind::UnexpectedEof.into(),
                ));
            }
            op.buf.copy_from_slice(&s.live[start..end]);
        }
        Ok(())
    }

    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Result<(), TierError> {
        let mut s = self.lock();
        for op in ops {
            Self::begin(&mut s, "write", op.offset)?;
            let start = op.offset as usize;
            let end = start + op.buf.len();
            if s.live.len() < end {
                s.live.resize(end, 0);
            }
            s.live[start..end].copy_from_slice(op.buf);
            s.unsynced.push((op.offset, op.buf.to_vec()));
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), TierError> {
        let mut s = self.lock();
        Self::begin(&mut s, "fsync", 0)?;
        let n = s.syncs;
        s.syncs += 1;
        if s.plan.fail_at_sync == Some(n) {
            s.dead = true;
            return Err(injected("fsync", 0));
        }
        s.durable = s.live.clone();
        s.unsynced.clear();
        Ok(())
    }

    fn len_bytes(&self) -> Result<u64, TierError> {
        Ok(self.lock().live.len() as u64)
    }

    fn set_len_bytes(&self, bytes: u64) -> Result<(), TierError> {
        let mut s = self.lock();
        Self::begin(&mut s, "truncate", bytes)?;
        s.live.resize(bytes as usize, 0);
        // A length change is metadata: durable at once in this model, as
        // the store syncs before relying on it anyway.
        s.durable.resize(bytes as usize, 0);
        Ok(())
    }
}
