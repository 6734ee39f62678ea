//! The trainer as one rank of several processes: `mpirun -n N strata train
//! …` (a strata built with `--features mpi`). Each rank trains its share of
//! every batch on the cpu, in its own run directory `--out/rank-R` (its
//! lock, run.json, metrics and checkpoint: its store holds its own experts
//! up to date), and rank 0 alone speaks. `--resume` resumes each rank from
//! its own directory.

use std::path::{Path, PathBuf};

use strata::comm::Comm;

/// This process's place among the ranks a launcher started.
pub(crate) struct RankWorld {
    pub comm: Box<dyn Comm>,
    pub rank: usize,
    pub size: usize,
    /// This rank among those on its machine: with `--backend cuda`, the
    /// GPU it computes on.
    pub local_rank: usize,
}

/// How many ranks the launcher that started this process started, from
/// its environment: Open MPI's `OMPI_COMM_WORLD_SIZE`, MPICH's (and
/// Slurm's PMI-2) `PMI_SIZE`, and Slurm's `SLURM_STEP_NUM_TASKS` for
/// `srun`, whose PMIx launch leaves the others unset until MPI starts.
fn launched_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"]
        .iter()
        .find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// This process's place among the ranks on its machine, from its
/// launcher's environment: Open MPI's `OMPI_COMM_WORLD_LOCAL_RANK`,
/// MPICH's `MPI_LOCALRANKID`, Slurm's `SLURM_LOCALID`.
#[cfg(feature = "mpi")]
fn local_rank() -> Option<usize> {
    [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|k| std::env::var(k).ok()?.parse().ok())
}

/// MPI's lifetime in this rank: finished where the run ends well, else
/// every rank is stopped ([`end`]).
#[cfg(feature = "mpi")]
pub(crate) type Session = strata::comm::MpiWorld;
/// Without MPI no rank joins a world, so there is no session.
#[cfg(not(feature = "mpi"))]
pub(crate) enum Session {}

/// Joins the other ranks where a launcher started several; `None` for a
/// process on its own.
pub(crate) fn join_world() -> Result<Option<(RankWorld, Session)>, String> {
    let Some(n) = launched_size().filter(|&n| n > 1) else {
        return Ok(None);
    };
    world_of(n)
}

/// Ends this rank's part in the world: MPI finalized where its run ended
/// well (every rank ends at the same step); else its error is printed
/// here, naming the rank, and every rank of the job is stopped, since the
/// others would wait for this one in their next collective.
pub(crate) fn end<T>(session: Session, rank: usize, result: &Result<T, String>) {
    #[cfg(feature = "mpi")]
    match result {
        Ok(_) => session.finish(),
        Err(e) => {
            eprintln!("strata: error: rank {rank}: {e}");
            drop(session); // MPI_Abort: mpirun stops every rank
        }
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = (rank, result);
        match session {}
    }
}

#[cfg(feature = "mpi")]
fn world_of(n: usize) -> Result<Option<(RankWorld, Session)>, String> {
    let (comm, session) = strata::comm::MpiComm::init().map_err(|e| e.to_string())?;
    let (rank, size) = (comm.rank(), comm.size());
    if size != n {
        session.finish();
        return Err(format!(
            "the launcher says {n} ranks, and MPI's world has {size}: start strata with the \
             MPI library it was built against"
        ));
    }
    let world = RankWorld {
        comm: Box::new(comm),
        rank,
        size,
        local_rank: local_rank().unwrap_or(rank),
    };
    Ok(Some((world, session)))
}

#[cfg(not(feature = "mpi"))]
fn world_of(n: usize) -> Result<Option<(RankWorld, Session)>, String> {
    Err(format!(
        "this process is one of {n} ranks started by an MPI launcher, and this strata was \
         built without MPI: build it with `cargo build --release --features mpi` (with Open \
         MPI or MPICH installed), or run the devices in one process with --devices {n}"
    ))
}

/// Rank `rank`'s run directory within `--out`.
pub(crate) fn rank_out(out: &Path, rank: usize) -> PathBuf {
    out.join(format!("rank-{rank}"))
}

/// What ranks as processes cannot yet do with these options.
pub(crate) fn refuse(o: &super::TrainOptions, world: &RankWorld) -> Result<(), String> {
    let n = world.size;
    let clash = [(o.devices > 1, "--devices above 1 (one device a rank)")];
    match clash.iter().find(|(on, _)| *on) {
        Some((_, what)) => Err(format!(
            "{n} ranks as processes with {what}: not supported yet; run the devices in one \
             process (--devices {n}) for it"
        )),
        None if o.micro_batches * n > o.batch => Err(format!(
            "{n} ranks × --micro-batches {} exceeds --batch {} (each rank's micro-batch holds \
             whole sequences): raise --batch or lower the others",
            o.micro_batches, o.batch
        )),
        None => Ok(()),
    }
}
