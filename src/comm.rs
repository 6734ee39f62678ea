//! Collectives between device workers: what the engine needs to run one
//! step on several devices (token exchange, dense gradient reduction, the
//! global token counts placement starts from).
//!
//! [`Comm`] is shaped like NCCL's communicator (one endpoint per rank, every
//! rank calls the same collectives in the same order); [`InProcessComm`]
//! implements it between threads over bounded crossbeam channels. Every
//! reduction has a fixed order (rank 0, then 1, …), so its result does not
//! depend on which thread arrives first.
//!
//! ```
//! use strata::comm::{Comm, InProcessComm};
//!
//! let results: Vec<Vec<f32>> = std::thread::scope(|s| {
//!     let handles: Vec<_> = InProcessComm::endpoints(3)
//!         .into_iter()
//!         .map(|mut c| s.spawn(move || {
//!             let mut grad = vec![c.rank() as f32 + 1.0; 4];
//!             c.all_reduce_sum(&mut grad).unwrap();
//!             grad
//!         }))
//!         .collect();
//!     handles.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! assert!(results.iter().all(|g| g == &vec![6.0; 4]));
//! ```

use crossbeam_channel::{bounded, Receiver, Sender};

mod link;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod rendezvous;
pub use link::{Link, ModeledLink};
#[cfg(feature = "mpi")]
pub use mpi::{MpiComm, MpiWorld};
#[cfg(feature = "nccl")]
pub use nccl::NcclComm;
pub use rendezvous::{rendezvous, World};

/// A collective could not finish: a peer stopped (its step failed) or
/// called a different collective.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    #[error("device {peer} stopped during a collective (its step failed)")]
    PeerStopped { peer: usize },
    #[error(
        "device {peer} sent {got} during {expected}: the devices' collectives are out of step"
    )]
    OutOfStep {
        peer: usize,
        expected: &'static str,
        got: &'static str,
    },
    #[error("{what}: {got} buffers given for {ranks} ranks")]
    WrongCount {
        what: &'static str,
        got: usize,
        ranks: usize,
    },
    #[error(
        "{what}: {values} values are more than MPI can move in one call (2^31 - 1): \
         give the step fewer tokens per rank"
    )]
    TooLarge { what: &'static str, values: usize },
    #[error("the communicator could not start: {why}")]
    Init { why: String },
    #[error("NCCL failed during a collective: {why}")]
    Nccl { why: String },
    #[error("a collective did not finish within {secs} s: a peer stopped, or waits elsewhere")]
    TimedOut { secs: u64 },
}

/// One rank's endpoint. Every rank calls the same collectives in the same
/// order; a rank whose endpoint is dropped makes its peers' collectives
/// fail with [`CommError::PeerStopped`] instead of waiting forever.
pub trait Comm: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;

    /// `sends[j]` goes to rank j (any length, empty included); returns what
    /// each rank sent here, indexed by rank.
    fn all_to_all(&mut self, sends: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CommError>;

    /// Every rank's `mine`, indexed by rank.
    fn all_gather_u32(&mut self, mine: Vec<u32>) -> Result<Vec<Vec<u32>>, CommError>;

    /// `buf` ← Σ over ranks of `buf`, summed rank 0 first, then 1, …, so
    /// every rank holds the same bits whatever the timing.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError>;

    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<(), CommError>;

    /// A second endpoint of the same ranks, whose collectives may run on
    /// another thread while this one's run (the dense gradient's buckets,
    /// reduced beside the backward's all-to-alls), or `None` where this
    /// communicator cannot give one. A collective: every rank calls it at
    /// the same point.
    fn second_endpoint(&mut self) -> Result<Option<Box<dyn Comm>>, CommError> {
        Ok(None)
    }
}

/// An endpoint behind a pointer is one too: borrowed, so an engine can
/// lend the endpoint it keeps to a step; boxed, so an endpoint kept
/// between steps can be lent to a thread and given back.
macro_rules! comm_through_pointer {
    ($($pointer:ty),*) => {$(
        impl<C: Comm + ?Sized> Comm for $pointer {
            fn rank(&self) -> usize {
                (**self).rank()
            }

            fn size(&self) -> usize {
                (**self).size()
            }

            fn all_to_all(&mut self, sends: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CommError> {
                (**self).all_to_all(sends)
            }

            fn all_gather_u32(&mut self, mine: Vec<u32>) -> Result<Vec<Vec<u32>>, CommError> {
                (**self).all_gather_u32(mine)
            }

            fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
                (**self).all_reduce_sum(buf)
            }

            fn barrier(&mut self) -> Result<(), CommError> {
                (**self).barrier()
            }

            fn second_endpoint(&mut self) -> Result<Option<Box<dyn Comm>>, CommError> {
                (**self).second_endpoint()
            }
        }
    )*};
}
comm_through_pointer!(&mut C, Box<C>);

/// What travels between two in-process endpoints.
enum Message {
    F32(Vec<f32>),
    U32(Vec<u32>),
}

impl Message {
    fn kind(&self) -> &'static str {
        match self {
            Message::F32(_) => "f32 values",
            Message::U32(_) => "u32 values",
        }
    }
}

/// The in-process communicator: a full mesh of bounded channels between
/// threads of one process (the cpu devices).
pub struct InProcessComm {
    rank: usize,
    /// `to[j]`: the channel to rank j (`None` for this rank).
    to: Vec<Option<Sender<Message>>>,
    /// `from[j]`: the channel from rank j (`None` for this rank).
    from: Vec<Option<Receiver<Message>>>,
}

/// Messages one endpoint may have queued for another: a rank can be at
/// most one collective ahead of a peer that has not yet received.
const CHANNEL_BOUND: usize = 2;

impl InProcessComm {
    /// Endpoints for `ranks` ranks, index = rank; hand one to each thread.
    pub fn endpoints(ranks: usize) -> Vec<InProcessComm> {
        assert!(ranks >= 1, "a communicator needs at least one rank");
        let mut senders: Vec<Vec<Option<Sender<Message>>>> = (0..ranks)
            .map(|_| (0..ranks).map(|_| None).collect())
            .collect();
        let mut receivers: Vec<Vec<Option<Receiver<Message>>>> = (0..ranks)
            .map(|_| (0..ranks).map(|_| None).collect())
            .collect();
        for (src, row) in senders.iter_mut().enumerate() {
            for (dst, slot) in row.iter_mut().enumerate() {
                if src != dst {
                    let (tx, rx) = bounded(CHANNEL_BOUND);
                    *slot = Some(tx);
                    receivers[dst][src] = Some(rx);
                }
            }
        }
        senders
            .into_iter()
            .zip(receivers)
            .enumerate()
            .map(|(rank, (to, from))| InProcessComm { rank, to, from })
            .collect()
    }

    fn send(&self, peer: usize, message: Message) -> Result<(), CommError> {
        self.to[peer]
            .as_ref()
            .expect("a peer's channel")
            .send(message)
            .map_err(|_| CommError::PeerStopped { peer })
    }

    fn recv(&self, peer: usize) -> Result<Message, CommError> {
        self.from[peer]
            .as_ref()
            .expect("a peer's channel")
            .recv()
            .map_err(|_| CommError::PeerStopped { peer })
    }

    fn recv_f32(&self, peer: usize, expected: &'static str) -> Result<Vec<f32>, CommError> {
        match self.recv(peer)? {
            Message::F32(v) => Ok(v),
            other => Err(CommError::OutOfStep {
                peer,
                expected,
                got: other.kind(),
            }),
        }
    }

    fn recv_u32(&self, peer: usize, expected: &'static str) -> Result<Vec<u32>, CommError> {
        match self.recv(peer)? {
            Message::U32(v) => Ok(v),
            other => Err(CommError::OutOfStep {
                peer,
                expected,
                got: other.kind(),
            }),
        }
    }
}

impl Comm for InProcessComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.to.len()
    }

    fn all_to_all(&mut self, sends: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CommError> {
        let n = self.size();
        if sends.len() != n {
            return Err(CommError::WrongCount {
                what: "all_to_all",
                got: sends.len(),
                ranks: n,
            });
        }
        let mut received: Vec<Vec<f32>> = vec![Vec::new(); n];
        for (peer, buf) in sends.into_iter().enumerate() {
            if peer == self.rank {
                received[peer] = buf;
            } else {
                self.send(peer, Message::F32(buf))?;
            }
        }
        for (peer, slot) in received.iter_mut().enumerate() {
            if peer != self.rank {
                *slot = self.recv_f32(peer, "all_to_all")?;
            }
        }
        Ok(received)
    }

    fn all_gather_u32(&mut self, mine: Vec<u32>) -> Result<Vec<Vec<u32>>, CommError> {
        let n = self.size();
        for peer in 0..n {
            if peer != self.rank {
                self.send(peer, Message::U32(mine.clone()))?;
            }
        }
        let mut gathered = vec![Vec::new(); n];
        for (peer, slot) in gathered.iter_mut().enumerate() {
            *slot = if peer == self.rank {
                mine.clone()
            } else {
                self.recv_u32(peer, "all_gather")?
            };
        }
        Ok(gathered)
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let n = self.size();
        if n == 1 {
            return Ok(());
        }
        for peer in 0..n {
            if peer != self.rank {
                self.send(peer, Message::F32(buf.to_vec()))?;
            }
        }
        let mine = buf.to_vec();
        for peer in 0..n {
            let received;
            let part: &[f32] = if peer == self.rank {
                &mine
            } else {
                received = self.recv_f32(peer, "all_reduce")?;
                &received
            };
            if part.len() != buf.len() {
                return Err(CommError::OutOfStep {
                    peer,
                    expected: "all_reduce of equal lengths",
                    got: "a buffer of another length",
                });
            }
            // Rank 0's part first, then 1, …: the same additions everywhere.
            if peer == 0 {
                buf.copy_from_slice(part);
            } else {
                buf.iter_mut().zip(part).for_each(|(b, p)| *b += p);
            }
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.all_gather_u32(Vec::new()).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send>(ranks: usize, f: impl Fn(InProcessComm) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let f = &f;
            let handles: Vec<_> = InProcessComm::endpoints(ranks)
                .into_iter()
                .map(|c| s.spawn(move || f(c)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_to_all_delivers_variable_sizes_by_rank() {
        let out = run(4, |mut c| {
            let r = c.rank();
            // Rank r sends j copies of 10·r + j to rank j.
            let sends = (0..4).map(|j| vec![(10 * r + j) as f32; j]).collect();
            c.all_to_all(sends).unwrap()
        });
        for (j, received) in out.iter().enumerate() {
            for (r, buf) in received.iter().enumerate() {
                assert_eq!(buf, &vec![(10 * r + j) as f32; j]);
            }
        }
    }

    #[test]
    fn all_reduce_is_bit_identical_on_every_rank_and_in_rank_order() {
        // Values whose float sum depends on the order of addition.
        let parts = [1e8f32, 1.0, -1e8, 1.0];
        let out = run(4, |mut c| {
            let mut buf = vec![parts[c.rank()]; 3];
            c.all_reduce_sum(&mut buf).unwrap();
            buf
        });
        let expected = ((parts[0] + parts[1]) + parts[2]) + parts[3];
        for buf in &out {
            assert_eq!(
                buf.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                vec![expected.to_bits(); 3]
            );
        }
    }

    #[test]
    fn all_gather_and_barrier_in_sequence() {
        let out = run(3, |mut c| {
            let mut seen = Vec::new();
            for round in 0..20u32 {
                let g = c.all_gather_u32(vec![round, c.rank() as u32]).unwrap();
                c.barrier().unwrap();
                seen.push(g);
            }
            seen
        });
        for seen in &out {
            for (round, g) in seen.iter().enumerate() {
                let expected: Vec<Vec<u32>> = (0..3).map(|r| vec![round as u32, r]).collect();
                assert_eq!(g, &expected);
            }
        }
    }

    #[test]
    fn a_stopped_peer_fails_the_collective_instead_of_hanging() {
        let out = run(3, |mut c| {
            if c.rank() == 1 {
                return Ok(()); // drops its endpoint without joining
            }
            c.all_to_all(vec![vec![1.0]; 3]).map(|_| ())
        });
        assert!(out[1].is_ok());
        // Rank 0 meets rank 1's absence; rank 2 meets rank 1's, or rank 0's
        // once rank 0 has failed: either way an error, never a hang.
        assert_eq!(out[0], Err(CommError::PeerStopped { peer: 1 }));
        assert!(matches!(out[2], Err(CommError::PeerStopped { .. })));
    }

    #[test]
    fn mismatched_collectives_are_named() {
        let out = run(2, |mut c| {
            if c.rank() == 0 {
                c.all_gather_u32(vec![1]).map(|_| ())
            } else {
                c.all_to_all(vec![vec![1.0]; 2]).map(|_| ())
            }
        });
        assert!(matches!(out[0], Err(CommError::OutOfStep { peer: 1, .. })));
        assert!(matches!(out[1], Err(CommError::OutOfStep { peer: 0, .. })));
        // Each names what arrived instead.
        let said = |r: &Result<(), CommError>| r.as_ref().unwrap_err().to_string();
        assert!(
            said(&out[0]).contains("sent f32 values"),
            "{}",
            said(&out[0])
        );
        assert!(
            said(&out[1]).contains("sent u32 values"),
            "{}",
            said(&out[1])
        );
    }

    #[test]
    fn a_barrier_returns_only_once_every_rank_has_reached_it() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let arrived = AtomicUsize::new(0);
        let seen = run(3, |mut c| {
            // The last rank comes late: the others must wait for it.
            if c.rank() == 2 {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            arrived.fetch_add(1, Ordering::SeqCst);
            c.barrier().unwrap();
            arrived.load(Ordering::SeqCst)
        });
        assert_eq!(seen, vec![3; 3], "ranks left the barrier before all came");
    }

    #[test]
    fn one_rank_is_the_identity() {
        let mut c = InProcessComm::endpoints(1).pop().unwrap();
        let mut buf = vec![2.5f32; 3];
        c.all_reduce_sum(&mut buf).unwrap();
        assert_eq!(buf, vec![2.5; 3]);
        assert_eq!(c.all_to_all(vec![vec![7.0]]).unwrap(), vec![vec![7.0]]);
        c.barrier().unwrap();
    }
}
