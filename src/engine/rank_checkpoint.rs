//! Checkpoints of ranks as processes that every rank can resume from.
//!
//! Each rank commits its own store, so a job stopped while its ranks
//! commit step s (one rank killed mid-commit) may leave some ranks at s
//! and the others at the checkpoint before. Two rules keep that
//! resumable:
//! - A rank goes on after a commit only once every rank has committed
//!   (a barrier). Until then it writes no record, so the checkpoint before
//!   the newest stays intact in its store (`ExpertStore::roll_back`).
//! - A resume first agrees on the newest step every rank holds, and a
//!   rank ahead of it rolls its store back one checkpoint.

use super::{Engine, EngineConfig};
use crate::comm::Comm;
use crate::model::Network;
use crate::EngineError;
use strata_tiers::ExpertStore;

impl Engine {
    /// [`Engine::resume_network`] for one rank of several, then
    /// [`Engine::join_ranks`]: every rank resumes from the newest
    /// checkpoint all of them hold, the ranks ahead of it rolled back one
    /// checkpoint first (with a note saying so). Ranks whose checkpoints do
    /// not meet get an error naming each rank's steps.
    pub fn resume_rank<N: Network>(
        net: &N,
        config: EngineConfig,
        mut comm: Box<dyn Comm>,
    ) -> Result<Self, EngineError> {
        let rolled = agree_on_checkpoint(&mut *comm, net, &config)?;
        let mut engine = Self::resume_network(net, config)?;
        if let Some((from, to)) = rolled {
            engine.notes.push(format!(
                "rank {}: rolled back from its checkpoint at step {from} to step {to}, the \
                 newest every rank holds (the job stopped while its ranks committed)",
                comm.rank()
            ));
        }
        engine.join_ranks(comm)?;
        Ok(engine)
    }

    /// After a commit on ranks: waits until every rank has committed too
    /// (see the module's doc). Without ranks, nothing.
    pub(super) fn every_rank_committed(&mut self) -> Result<(), EngineError> {
        match self.ranks.as_mut() {
            Some(r) => Ok(r.comm.barrier()?),
            None => Ok(()),
        }
    }
}

/// Rolls this rank's store back to the newest checkpoint every rank of
/// `comm` holds, where it is ahead of it: `Some((from, to))` then.
fn agree_on_checkpoint<N: Network>(
    comm: &mut dyn Comm,
    net: &N,
    config: &EngineConfig,
) -> Result<Option<(u64, u64)>, EngineError> {
    let Some(path) = &config.store_path else {
        return Err(EngineError::Config("resume needs a store_path".into()));
    };
    let layout = Engine::layout(net.moe(), config);
    let store = ExpertStore::open(path, Some(layout), &Engine::file_options(config))?;
    let newest = store.committed_step();
    let previous = store.previous_checkpoint()?;
    let mine = [newest, previous.unwrap_or(u64::MAX)]
        .iter()
        .flat_map(|&s| [s as u32, (s >> 32) as u32])
        .collect();
    let held: Vec<[u64; 2]> = comm
        .all_gather_u32(mine)?
        .iter()
        .map(|w| {
            let step = |i: usize| u64::from(w[2 * i]) | u64::from(w[2 * i + 1]) << 32;
            [step(0), step(1)]
        })
        .collect();
    let Some(common) = common_step(&held) else {
        let each: Vec<String> = held
            .iter()
            .enumerate()
            .map(|(rank, [newest, previous])| match *previous {
                u64::MAX => format!("rank {rank} at step {newest}"),
                p => format!("rank {rank} at step {newest} (and {p})"),
            })
            .collect();
        return Err(EngineError::Config(format!(
            "the ranks hold no checkpoint at one step: {}; resume every rank from the same \
             run's directories",
            each.join(", ")
        )));
    };
    if common == newest {
        return Ok(None);
    }
    store.roll_back(common)?;
    Ok(Some((newest, common)))
}

/// The newest step every rank holds, of each rank's (newest, previous).
fn common_step(held: &[[u64; 2]]) -> Option<u64> {
    held.iter()
        .map(|h| h[0])
        .filter(|&s| held.iter().all(|h| h.contains(&s)))
        .max()
}

#[cfg(test)]
mod tests {
    use super::common_step;

    #[test]
    fn the_common_step_is_the_newest_every_rank_holds() {
        const NONE: u64 = u64::MAX;
        assert_eq!(common_step(&[[10, 5], [10, 5]]), Some(10));
        assert_eq!(common_step(&[[10, 5], [5, 0]]), Some(5));
        assert_eq!(common_step(&[[5, 0], [10, 5], [10, 5]]), Some(5));
        assert_eq!(common_step(&[[10, 5], [0, NONE]]), None);
        assert_eq!(common_step(&[[10, 10], [10, 5]]), Some(10));
        assert_eq!(common_step(&[[10, 5], [15, 10], [10, 5]]), Some(10));
        assert_eq!(common_step(&[[15, 10], [5, 0]]), None);
    }
}
