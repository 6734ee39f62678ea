//! Ranks as processes over MPI (`--features mpi`): one process per rank,
//! started by `mpirun` or `srun`, each holding one [`MpiComm`] on
//! `MPI_COMM_WORLD`.
//!
//! The collectives are MPI's own (`MPI_Allgather(v)`, `MPI_Alltoall(v)`,
//! `MPI_Barrier`), and they give the bits [`InProcessComm`] gives: the
//! all-reduce gathers every rank's buffer and sums them on every rank,
//! rank 0 first, then 1, …, instead of `MPI_Allreduce`, whose order of
//! additions the library chooses (and may change with the message size).
//! For the few ranks of a node this costs little more than a ring
//! all-reduce: each rank receives (n − 1) buffers instead of 2(n − 1)/n.
//!
//! Every collective begins with a small all-gather of what each rank is
//! calling (which collective, and the length an all-reduce sums), so ranks
//! out of step fail with [`CommError::OutOfStep`] naming the rank, instead
//! of matching the wrong MPI calls. A rank that dies ends the job: the
//! launcher (mpirun, srun) stops the others, as MPI's errors are fatal by
//! default, so no rank waits for it forever. A rank that ends early
//! without dying, on an error of its own, must not finalize MPI (that
//! waits for the others, which wait for it in their next collective): the
//! [`MpiWorld`] it holds aborts the job when dropped unless every rank
//! reached [`MpiWorld::finish`]. A rank that lives on and never calls
//! again is not detected here; its peers wait in MPI, as they would for
//! such a thread with the in-process `Comm`.
//!
//! [`InProcessComm`]: super::InProcessComm

use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator, CommunicatorCollectives};
use mpi::{Count, Threading};

use super::{Comm, CommError};

/// One process's endpoint of `MPI_COMM_WORLD` (see [`MpiComm::init`]), or
/// of a duplicate of it ([`Comm::second_endpoint`]).
pub struct MpiComm {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    /// What the library granted: `Multiple` lets a second endpoint's
    /// collectives run on another thread beside this one's.
    threading: Threading,
}

// SAFETY: an MPI communicator handle may be used from any thread of a
// process whose MPI runs with `Serialized` threading or better (checked in
// `init`), as long as no two threads call MPI at once. Every collective
// takes `&mut self`, so one endpoint is used by one thread at a time; two
// endpoints are used at once only where MPI granted `Multiple`
// (`second_endpoint` refuses otherwise).
unsafe impl Send for MpiComm {}

/// MPI's lifetime in this process: [`MpiWorld::finish`] finalizes it once
/// the rank's work is done; dropped without it (an error, a panic), it
/// aborts every rank of the job (`MPI_Abort`), so that no rank waits for
/// this one forever. Keep it until the process ends; MPI may be
/// initialized only once a process.
pub struct MpiWorld {
    universe: Option<Universe>,
}

impl MpiWorld {
    /// Finalizes MPI: every rank calls it at its end, after its last
    /// collective.
    pub fn finish(mut self) {
        drop(self.universe.take());
    }
}

impl Drop for MpiWorld {
    fn drop(&mut self) {
        if self.universe.is_some() {
            SimpleCommunicator::world().abort(1);
        }
    }
}

/// The collective a rank is calling, agreed before each one.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    AllToAll = 1,
    AllGather = 2,
    AllReduce = 3,
    Barrier = 4,
    Duplicate = 5,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::AllToAll => "all_to_all",
            Kind::AllGather => "all_gather",
            Kind::AllReduce => "all_reduce",
            Kind::Barrier => "barrier",
            Kind::Duplicate => "second_endpoint",
        }
    }

    /// What a peer calling `self` is said to have sent.
    fn called(self) -> &'static str {
        match self {
            Kind::AllToAll => "its all_to_all",
            Kind::AllGather => "its all_gather",
            Kind::AllReduce => "its all_reduce",
            Kind::Barrier => "its barrier",
            Kind::Duplicate => "its second_endpoint",
        }
    }

    fn from_code(code: u64) -> Option<Kind> {
        [
            Kind::AllToAll,
            Kind::AllGather,
            Kind::AllReduce,
            Kind::Barrier,
            Kind::Duplicate,
        ]
        .into_iter()
        .find(|k| *k as u64 == code)
    }
}

impl MpiComm {
    /// Initializes MPI for this process and returns its endpoint of the
    /// world, and the [`MpiWorld`] that ends MPI. A process started
    /// without a launcher is a world of one rank. Asks for `Multiple`
    /// threading (a second endpoint's collectives on another thread) and
    /// needs at least `Serialized` (any one thread at a time, as the
    /// engine's device thread calls them).
    pub fn init() -> Result<(MpiComm, MpiWorld), CommError> {
        let (universe, provided) =
            mpi::initialize_with_threading(Threading::Multiple).ok_or_else(|| CommError::Init {
                why: "MPI is already initialized in this process: create one MpiComm per \
                      process and keep it"
                    .into(),
            })?;
        if provided < Threading::Serialized {
            return Err(CommError::Init {
                why: format!(
                    "this MPI library offers {provided:?} threading, and strata calls MPI from \
                     its device thread, which needs Serialized: use an MPI built with thread \
                     support (Open MPI and MPICH are, as packaged by Debian)"
                ),
            });
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok((
            MpiComm {
                comm: world,
                rank,
                size,
                threading: provided,
            },
            MpiWorld {
                universe: Some(universe),
            },
        ))
    }

    fn world(&self) -> &SimpleCommunicator {
        &self.comm
    }

    /// Every rank's (collective, length), checked: the first rank calling
    /// another collective, or an all-reduce of another length, is named.
    /// Returns every rank's length, by rank.
    fn agree(&self, kind: Kind, len: usize) -> Result<Vec<usize>, CommError> {
        let mine = [kind as u64, len as u64];
        let mut all = vec![0u64; 2 * self.size];
        self.world().all_gather_into(&mine[..], &mut all[..]);
        for (peer, header) in all.chunks_exact(2).enumerate() {
            let theirs = Kind::from_code(header[0]);
            if theirs != Some(kind) {
                return Err(CommError::OutOfStep {
                    peer,
                    expected: kind.name(),
                    got: theirs.map_or("an unknown call", Kind::called),
                });
            }
            if kind == Kind::AllReduce && header[1] != len as u64 {
                return Err(CommError::OutOfStep {
                    peer,
                    expected: "all_reduce of equal lengths",
                    got: "a buffer of another length",
                });
            }
        }
        Ok(all.chunks_exact(2).map(|h| h[1] as usize).collect())
    }
}

/// `len` as an MPI count, or the error naming what is too large.
fn count(what: &'static str, len: usize) -> Result<Count, CommError> {
    Count::try_from(len).map_err(|_| CommError::TooLarge { what, values: len })
}

/// Counts and their displacements (exclusive prefix sums), each within
/// MPI's count range.
fn counts_and_displs(
    what: &'static str,
    lens: &[usize],
) -> Result<(Vec<Count>, Vec<Count>), CommError> {
    let counts = lens
        .iter()
        .map(|&l| count(what, l))
        .collect::<Result<Vec<_>, _>>()?;
    let mut at = 0usize;
    let displs = lens
        .iter()
        .map(|&l| {
            let here = count(what, at);
            at += l;
            here
        })
        .collect::<Result<Vec<_>, _>>()?;
    count(what, at)?;
    Ok((counts, displs))
}

/// `flat` cut into consecutive pieces of `lens`.
fn split<T: Clone>(flat: &[T], lens: &[usize]) -> Vec<Vec<T>> {
    let mut at = 0;
    lens.iter()
        .map(|&l| {
            let piece = flat[at..at + l].to_vec();
            at += l;
            piece
        })
        .collect()
}

impl Comm for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_to_all(&mut self, sends: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CommError> {
        let n = self.size;
        if sends.len() != n {
            return Err(CommError::WrongCount {
                what: "all_to_all",
                got: sends.len(),
                ranks: n,
            });
        }
        self.agree(Kind::AllToAll, 0)?;
        let send_lens: Vec<usize> = sends.iter().map(Vec::len).collect();
        let (send_counts, send_displs) = counts_and_displs("all_to_all's sends", &send_lens)?;
        let mut recv_counts = vec![0 as Count; n];
        self.world()
            .all_to_all_into(&send_counts[..], &mut recv_counts[..]);
        let recv_lens: Vec<usize> = recv_counts.iter().map(|&c| c as usize).collect();
        let (_, recv_displs) = counts_and_displs("all_to_all's receives", &recv_lens)?;
        let flat: Vec<f32> = sends.concat();
        let mut received = vec![0f32; recv_lens.iter().sum()];
        {
            let send = Partition::new(&flat[..], &send_counts[..], &send_displs[..]);
            let mut recv = PartitionMut::new(&mut received[..], &recv_counts[..], &recv_displs[..]);
            self.world().all_to_all_varcount_into(&send, &mut recv);
        }
        Ok(split(&received, &recv_lens))
    }

    fn all_gather_u32(&mut self, mine: Vec<u32>) -> Result<Vec<Vec<u32>>, CommError> {
        let lens = self.agree(Kind::AllGather, mine.len())?;
        let (counts, displs) = counts_and_displs("all_gather", &lens)?;
        let mut gathered = vec![0u32; lens.iter().sum()];
        {
            let mut recv = PartitionMut::new(&mut gathered[..], &counts[..], &displs[..]);
            self.world().all_gather_varcount_into(&mine[..], &mut recv);
        }
        Ok(split(&gathered, &lens))
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let n = self.size;
        if n == 1 {
            return Ok(());
        }
        self.agree(Kind::AllReduce, buf.len())?;
        count("all_reduce", n * buf.len())?;
        let mut all = vec![0f32; n * buf.len()];
        self.world().all_gather_into(&*buf, &mut all[..]);
        // Rank 0's part first, then 1, …: the same additions everywhere.
        let mut parts = all.chunks_exact(buf.len().max(1));
        if let Some(first) = parts.next() {
            buf.copy_from_slice(&first[..buf.len()]);
        }
        for part in parts {
            buf.iter_mut().zip(part).for_each(|(b, p)| *b += p);
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        self.agree(Kind::Barrier, 0)?;
        self.world().barrier();
        Ok(())
    }

    /// A duplicate of this endpoint's communicator (`MPI_Comm_dup`, itself
    /// a collective), where MPI granted `Multiple` threading.
    fn second_endpoint(&mut self) -> Result<Option<Box<dyn Comm>>, CommError> {
        if self.threading < Threading::Multiple {
            return Ok(None);
        }
        self.agree(Kind::Duplicate, 0)?;
        Ok(Some(Box::new(MpiComm {
            comm: self.world().duplicate(),
            ..*self
        })))
    }
}
