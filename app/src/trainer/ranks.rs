//! The trainer as one rank of several processes: `mpirun -n N strata train
//! …` (a strata built with `--features mpi`), or ranks told their place by
//! `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` (`strata launch
//! --comm nccl`, torchrun; a strata built with `--features nccl`), which
//! join over NCCL, one GPU (`LOCAL_RANK`) each. Each rank trains its share of
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
    /// What the ranks talk over: `MPI` or `NCCL`.
    pub transport: &'static str,
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

/// The world's lifetime in this rank ([`end`]).
pub(crate) enum Session {
    /// MPI: finished where the run ends well, else every rank is stopped.
    #[cfg(feature = "mpi")]
    Mpi(strata::comm::MpiWorld),
    /// NCCL: nothing to finish; a rank that fails ends its process, and
    /// its peers' next collective fails.
    #[cfg(feature = "nccl")]
    Nccl,
}

/// How long a rank over NCCL waits in one collective for its peers before
/// it fails: far above any wait of ranks in step (a step's compute, a
/// checkpoint), finite so that a rank stuck without NCCL noticing ends.
#[cfg(feature = "nccl")]
const NCCL_COLLECTIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1800);

/// Joins the other ranks where a launcher started several; `None` for a
/// process on its own.
pub(crate) fn join_world() -> Result<Option<(RankWorld, Session)>, String> {
    if let Some(n) = launched_size().filter(|&n| n > 1) {
        return world_of(n);
    }
    match strata::comm::World::from_env().map_err(|e| e.to_string())? {
        Some(world) if world.size > 1 => nccl_world(world).map(Some),
        _ => Ok(None),
    }
}

/// Ends this rank's part in the world: where its run failed, its error is
/// printed here, naming the rank, and the job is stopped (MPI: every rank,
/// since the others would wait for this one in their next collective;
/// NCCL: this rank's process, whose peers' collectives then fail, and
/// whose launcher stops them).
pub(crate) fn end<T>(session: Session, rank: usize, result: &Result<T, String>) {
    let _ = (rank, result); // read in the arms a build has
    match session {
        #[cfg(feature = "mpi")]
        Session::Mpi(world) => match result {
            Ok(_) => world.finish(),
            Err(e) => {
                eprintln!("strata: error: rank {rank}: {e}");
                drop(world); // MPI_Abort: mpirun stops every rank
            }
        },
        #[cfg(feature = "nccl")]
        Session::Nccl => {
            if let Err(e) = result {
                eprintln!("strata: error: rank {rank}: {e}");
                std::process::exit(1);
            }
        }
    }
}

#[cfg(feature = "nccl")]
fn nccl_world(world: strata::comm::World) -> Result<(RankWorld, Session), String> {
    let comm = strata::comm::NcclComm::join(&world, world.local_rank, NCCL_COLLECTIVE_TIMEOUT)
        .map_err(|e| format!("rank {} of {}: {e}", world.rank, world.size))?;
    let rank_world = RankWorld {
        comm: Box::new(comm),
        rank: world.rank,
        size: world.size,
        local_rank: world.local_rank,
        transport: "NCCL",
    };
    Ok((rank_world, Session::Nccl))
}

#[cfg(not(feature = "nccl"))]
fn nccl_world(world: strata::comm::World) -> Result<(RankWorld, Session), String> {
    Err(format!(
        "this process is rank {} of {} (RANK, WORLD_SIZE), whose ranks meet over NCCL, and \
         this strata was built without it: build it with `cargo build --release --features \
         nccl`, or start the ranks with mpirun (--features mpi)",
        world.rank, world.size
    ))
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
        transport: "MPI",
    };
    Ok(Some((world, Session::Mpi(session))))
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

/// Refuses a run whose ranks on this machine would together hold more
/// host memory than it has, before any rank allocates: each rank has
/// checked its own count against the memory available (`plan_for`), but
/// ranks started side by side each see the whole machine. Every rank
/// reads what is available, then they exchange their counts (the
/// exchange is the point past which a rank allocates, so no rank reads
/// after another has taken its share); ranks on one machine (the same
/// boot, and the same memory cgroup where that is the bound) add theirs
/// up. On GPUs, whose host side the plan does not count, there is nothing
/// to add.
pub(crate) fn check_machine_memory(
    world: &mut RankWorld,
    plan: &super::plan::MemoryPlan,
) -> Result<(), String> {
    let available = strata::engine::host_memory_available();
    let machine = machine_key(available.as_ref());
    let all = plan.host_in_all().unwrap_or(0);
    let mine = vec![machine, all as u32, (all >> 32) as u32];
    let gathered = world.comm.all_gather_u32(mine).map_err(|e| {
        format!(
            "rank {}: exchanging the ranks' memory plans: {e}",
            world.rank
        )
    })?;
    let counts = gathered
        .iter()
        .enumerate()
        .map(|(rank, w)| match w[..] {
            [machine, b0, b1] => Ok(RankCount {
                machine,
                host_bytes: u64::from(b0) | u64::from(b1) << 32,
            }),
            _ => Err(format!(
                "rank {rank} sent {} words for its memory plan, not 3: run the same strata on \
                 every rank",
                w.len()
            )),
        })
        .collect::<Result<Vec<RankCount>, String>>()?;
    match available {
        Some(available) => ranks_fit_their_machine(world.rank, &counts, &available),
        None => Ok(()),
    }
}

/// One rank's machine ([`machine_key`]) and the host memory it counts.
#[derive(Clone, Copy, Debug)]
struct RankCount {
    machine: u32,
    host_bytes: u64,
}

/// Whether the ranks that share rank `me`'s machine fit in what is
/// `available` there, or what is short and what lowers it.
fn ranks_fit_their_machine(
    me: usize,
    counts: &[RankCount],
    available: &strata::engine::AvailableMemory,
) -> Result<(), String> {
    use super::options::show_bytes;
    let here: Vec<(usize, u64)> = counts
        .iter()
        .enumerate()
        .filter(|(_, c)| c.machine == counts[me].machine)
        .map(|(rank, c)| (rank, c.host_bytes))
        .collect();
    let together: u64 = here.iter().map(|(_, b)| b).sum();
    if here.len() < 2 || together <= available.bytes {
        return Ok(());
    }
    let each = here
        .iter()
        .map(|(rank, bytes)| format!("rank {rank} {}", show_bytes(*bytes)))
        .collect::<Vec<_>>()
        .join(", ");
    Err(format!(
        "does not fit: the {} ranks on this machine would hold {} of host memory together \
         ({each}; each rank's count is in its `strata plan`), but {available}: {} short. \
         Lower --host-mem, --device-mem, --batch or --seq-len, or start fewer ranks on a \
         machine",
        here.len(),
        show_bytes(together),
        show_bytes(together - available.bytes),
    ))
}

/// A number the ranks sharing one machine's memory have alike: its boot
/// (`/proc/sys/kernel/random/boot_id`, else the host name) and, where a
/// memory cgroup bounds what is available, that cgroup's path.
fn machine_key(available: Option<&strata::engine::AvailableMemory>) -> u32 {
    let boot = [
        "/proc/sys/kernel/random/boot_id",
        "/proc/sys/kernel/hostname",
    ]
    .iter()
    .find_map(|p| std::fs::read_to_string(p).ok())
    .unwrap_or_default();
    let cgroup = match available.map(|a| &a.bound) {
        Some(strata::engine::MemoryBound::Cgroup { path, .. }) => path.as_str(),
        _ => "",
    };
    crc32c::crc32c(format!("{}\n{cgroup}", boot.trim()).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata::engine::{AvailableMemory, MemoryBound};

    #[test]
    fn ranks_on_one_machine_add_up_their_host_memory() {
        const MIB: u64 = 1 << 20;
        let count = |machine, host_bytes| RankCount {
            machine,
            host_bytes,
        };
        let available = AvailableMemory {
            bytes: 100 * MIB,
            bound: MemoryBound::Machine,
        };
        // Two ranks of 60 MiB each on one machine, a third elsewhere.
        let counts = [count(7, 60 * MIB), count(9, 60 * MIB), count(7, 60 * MIB)];
        let err = ranks_fit_their_machine(0, &counts, &available).unwrap_err();
        assert!(
            err.contains("the 2 ranks on this machine would hold 120.00 MiB")
                && err.contains("rank 0 60.00 MiB, rank 2 60.00 MiB;")
                && err.contains("but this machine has 100.0 MiB available: 20.00 MiB short")
                && err.contains("start fewer ranks on a machine"),
            "{err}"
        );
        assert!(ranks_fit_their_machine(2, &counts, &available).is_err());
        // The rank alone on its machine fits.
        assert_eq!(ranks_fit_their_machine(1, &counts, &available), Ok(()));
        // Exactly what is there fits.
        let fits = [count(7, 50 * MIB), count(7, 50 * MIB)];
        assert_eq!(ranks_fit_their_machine(1, &fits, &available), Ok(()));
        // GPU ranks count nothing here.
        let gpus = [count(7, 0), count(7, 0)];
        assert_eq!(ranks_fit_their_machine(0, &gpus, &available), Ok(()));
    }

    #[test]
    fn a_machine_s_key_follows_its_boot_and_a_bounding_cgroup() {
        let machine = AvailableMemory {
            bytes: 1,
            bound: MemoryBound::Machine,
        };
        let cgroup = |path: &str| AvailableMemory {
            bytes: 1,
            bound: MemoryBound::Cgroup {
                path: path.into(),
                limit: 2,
                in_use: 1,
            },
        };
        let key = machine_key(Some(&machine));
        assert_eq!(key, machine_key(None));
        assert_eq!(
            machine_key(Some(&cgroup("/a"))),
            machine_key(Some(&cgroup("/a")))
        );
        assert_ne!(
            machine_key(Some(&cgroup("/a"))),
            machine_key(Some(&cgroup("/b")))
        );
        assert_ne!(machine_key(Some(&cgroup("/a"))), key);
    }
}
