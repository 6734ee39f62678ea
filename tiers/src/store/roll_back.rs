//! Going back one checkpoint. A store keeps two: the newest, and the one
//! before it in the other superblock, whose records stay intact until the
//! first write after the newest commit (writes go to the working copies,
//! which are the older checkpoint's). Ranks that must resume from the same
//! step use it: a job stopped while its ranks committed a checkpoint may
//! leave some ranks at the new step and the others at the one before.

use super::{lock, ExpertStore, Meta};
use crate::format::{crc, decode_map, MapEntry, Superblock, BLOCK_BYTES, NEVER_WRITTEN};
use crate::io::AlignedBuf;
use crate::record::Parts;
use crate::{ExpertId, TierError};

impl ExpertStore {
    /// The step of the checkpoint before the newest, where its superblock
    /// and copy map are intact. Whether its records are is known only
    /// once [`ExpertStore::roll_back`] has read them.
    pub fn previous_checkpoint(&self) -> Result<Option<u64>, TierError> {
        let meta = lock(&self.meta);
        Ok(self.older(&meta)?.map(|(sb, _)| sb.committed_step))
    }

    /// Makes the checkpoint before the newest, at `step`, the store's
    /// newest again, for a store opened and not yet written to. Every
    /// record it names that the newest does not is read and checked
    /// first: one overwritten since (by a run that went on after the
    /// newest checkpoint) fails the roll-back and changes nothing. The
    /// roll-back is committed over the newest checkpoint's superblock, so
    /// a crash during it leaves the store at `step` or where it was, and
    /// afterwards no newer checkpoint remains to be opened. `step` already
    /// the newest is a no-op.
    pub fn roll_back(&self, step: u64) -> Result<(), TierError> {
        let (newest, map) = {
            let meta = lock(&self.meta);
            let newest = meta.superblock;
            if newest.committed_step == step {
                return Ok(());
            }
            if meta.pending.iter().any(Option::is_some) {
                return Err(TierError::RollBack(format!(
                    "records were written since its checkpoint at step {}",
                    newest.committed_step
                )));
            }
            let older = self.older(&meta)?;
            match older {
                Some((sb, map)) if sb.committed_step == step => (newest, map),
                other => {
                    return Err(TierError::RollBack(format!(
                        "it holds no checkpoint at step {step}: its newest is at step {}, \
                         and {}",
                        newest.committed_step,
                        match other {
                            Some((sb, _)) =>
                                format!("the one before at step {}", sb.committed_step),
                            None => "the one before is gone or damaged".to_string(),
                        }
                    )));
                }
            }
        };
        self.check_copies(&map, newest.committed_step)?;
        let mut meta = lock(&self.meta);
        if meta.superblock.generation != newest.generation
            || meta.pending.iter().any(Option::is_some)
        {
            return Err(TierError::RollBack(
                "the store was written to while it rolled back".into(),
            ));
        }
        meta.committed = map;
        // Generation + 2 lands in the newest checkpoint's slot, replacing it.
        self.commit(&mut meta, newest.generation + 2, step)
    }

    /// Reads every record `map` names that the committed map does not,
    /// checking each against the step `map` gives it.
    fn check_copies(&self, map: &[MapEntry], newest_step: u64) -> Result<(), TierError> {
        let committed = lock(&self.meta).committed.clone();
        let mut buf = AlignedBuf::zeroed(Parts::Full.bytes(&self.layout) as usize);
        let per_layer = self.layout.experts_per_layer as usize;
        for (slot, (old, new)) in map.iter().zip(&committed).enumerate() {
            if old == new || old.step == NEVER_WRITTEN {
                continue;
            }
            let expert = ExpertId::from_dense_index(slot, per_layer);
            let mut request = [(expert, Parts::Full, buf.as_mut_slice())];
            self.read_copies(&mut request, &[*old]).map_err(|e| {
                TierError::RollBack(format!(
                    "expert {expert}'s record of step {} was overwritten or damaged after the \
                     checkpoint at step {newest_step} ({e})",
                    old.step
                ))
            })?;
        }
        Ok(())
    }

    /// The other superblock and its copy map, where both are intact and
    /// it is older than the newest.
    fn older(&self, meta: &Meta) -> Result<Option<(Superblock, Vec<MapEntry>)>, TierError> {
        let newest = meta.superblock.generation;
        let which = ((newest + 1) % 2) as usize;
        let mut block = AlignedBuf::zeroed(BLOCK_BYTES);
        self.guard("read", || {
            self.device
                .read_at(block.as_mut_slice(), (which * BLOCK_BYTES) as u64)
        })?;
        let sb = match Superblock::decode(block.as_slice()) {
            Ok(Some(sb)) if sb.generation < newest && sb.layout == self.layout => sb,
            _ => return Ok(None),
        };
        let mut map = AlignedBuf::zeroed(self.layout.map_bytes() as usize);
        self.guard("read", || {
            self.device
                .read_at(map.as_mut_slice(), self.layout.map_offset(which))
        })?;
        if crc(map.as_slice()) != sb.map_crc {
            return Ok(None);
        }
        let count = self.layout.expert_count() as usize;
        Ok(decode_map(map.as_slice(), count).ok().map(|m| (sb, m)))
    }
}
