//! `MpiComm` between processes (`--features mpi`). Each case runs this
//! test binary again under `mpirun -n N`, restricted to itself, with
//! `STRATA_MPI_RANK_CASE` naming it: there the same function plays one
//! rank, and the outer test checks what the job printed and how it ended,
//! under a watchdog.
//!
//! Where mpirun is missing the cases say so and pass, unless
//! `STRATA_REQUIRE_MPI=1` (as in `.ci/run`, which installs Open MPI) makes
//! that a failure.

#![cfg(feature = "mpi")]

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use strata::comm::{Comm, CommError, MpiComm, MpiWorld};
use strata::engine::{Engine, EngineConfig, ExchangeParts};
use strata::lm::MoeLm;
use strata::math::ExpertKind;
use strata::model::Network;

mod common;

use common::process::{output_within, said};
use common::ranks::{self, in_process, resident, script, STEPS};
use common::tiny_lm::{tiny_batch, tiny_config};

const RANK_CASE: &str = "STRATA_MPI_RANK_CASE";

/// Whether this process is one rank of `case`'s job.
fn in_rank(case: &str) -> bool {
    std::env::var(RANK_CASE).is_ok_and(|c| c == case)
}

/// mpirun, or why the case cannot run (a failure where MPI is expected).
fn mpirun() -> Option<&'static str> {
    let found = Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if found {
        return Some("mpirun");
    }
    assert!(
        std::env::var("STRATA_REQUIRE_MPI").as_deref() != Ok("1"),
        "mpirun is missing, and STRATA_REQUIRE_MPI=1 says MPI is expected here \
         (Debian: apt-get install openmpi-bin libopenmpi-dev)"
    );
    eprintln!("mpi case skipped: mpirun is missing");
    None
}

/// This binary, restricted to `case`, as `ranks` processes under mpirun
/// (or one process with no launcher, for `ranks == 0`); killed, and the
/// test failed, past `bound`.
fn launch(case: &str, ranks: usize, bound: Duration) -> Output {
    let me = std::env::current_exe().expect("the test binary's path");
    let mut cmd = if ranks == 0 {
        Command::new(&me)
    } else {
        let mut c = Command::new("mpirun");
        // More ranks than cores is fine for a test; root runs as CI does.
        c.args(["--oversubscribe", "-n", &ranks.to_string()])
            .arg(&me);
        c
    };
    cmd.args(["--exact", case, "--nocapture", "--test-threads", "1"])
        .env(RANK_CASE, case)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    output_within(cmd, &format!("{case} on {ranks} ranks"), bound)
}

const BOUND: Duration = Duration::from_secs(120);

/// A second endpoint's all-reduce on another thread while the first's
/// all-to-all runs (as the engine reduces the dense gradient beside the
/// backward's exchanges): each gives its own results.
fn second_endpoint_beside_the_first(comm: &mut MpiComm) {
    let (r, n) = (comm.rank(), comm.size());
    let mut second = comm
        .second_endpoint()
        .expect("every rank asks")
        .expect("Open MPI grants Multiple threading");
    let mine = vec![r as f32 + 1.0; 1000];
    let reduced = std::thread::scope(|s| {
        let reducer = s.spawn(move || {
            let mut buf = mine;
            second.all_reduce_sum(&mut buf).map(|()| buf)
        });
        let sends = (0..n).map(|j| vec![(10 * r + j) as f32; 3]).collect();
        let got = comm.all_to_all(sends).unwrap();
        for (j, g) in got.iter().enumerate() {
            assert_eq!(g, &vec![(10 * j + r) as f32; 3], "rank {r}: from rank {j}");
        }
        reducer.join().unwrap().unwrap()
    });
    let want: f32 = (1..=n).map(|x| x as f32).sum();
    assert!(
        reduced.iter().all(|&v| v == want),
        "rank {r}: {}",
        reduced[0]
    );
}

#[test]
fn collectives_give_the_in_process_bits() {
    let case = "collectives_give_the_in_process_bits";
    if in_rank(case) {
        let (mut comm, world) = MpiComm::init().expect("MPI starts");
        let (r, n) = (comm.rank(), comm.size());
        let seen = script(&mut comm);
        let expected = &in_process(n)[r];
        assert_eq!(
            seen.len(),
            expected.len(),
            "rank {r}: another count of values"
        );
        assert!(
            seen == *expected,
            "rank {r} of {n}: other bits than in-process"
        );
        second_endpoint_beside_the_first(&mut comm);
        println!(
            "rank {r} of {n}: {} values, the in-process bits",
            seen.len()
        );
        world.finish();
        return;
    }
    if mpirun().is_none() {
        return;
    }
    for ranks in [2, 3] {
        ranks_report(case, ranks, "");
    }
}

#[test]
fn a_process_started_without_a_launcher_is_one_rank() {
    let case = "a_process_started_without_a_launcher_is_one_rank";
    if in_rank(case) {
        let (mut comm, world) = MpiComm::init().expect("MPI starts");
        assert_eq!((comm.rank(), comm.size()), (0, 1));
        let mut buf = vec![2.5f32; 3];
        comm.all_reduce_sum(&mut buf).unwrap();
        assert_eq!(buf, vec![2.5; 3]);
        assert_eq!(comm.all_to_all(vec![vec![7.0]]).unwrap(), vec![vec![7.0]]);
        assert_eq!(
            comm.all_to_all(vec![vec![7.0]; 2]),
            Err(CommError::WrongCount {
                what: "all_to_all",
                got: 2,
                ranks: 1
            })
        );
        // A second communicator in the same process is refused by name.
        let again = MpiComm::init().err().expect("a second init is refused");
        assert!(
            again.to_string().contains("one MpiComm per process"),
            "{again}"
        );
        println!("one rank: ok");
        world.finish();
        return;
    }
    if mpirun().is_none() {
        return;
    }
    let out = launch(case, 0, BOUND);
    let said = said(&out);
    assert!(
        out.status.success() && said.contains("one rank: ok"),
        "{said}"
    );
}

#[test]
fn ranks_out_of_step_are_named() {
    let case = "ranks_out_of_step_are_named";
    if in_rank(case) {
        let (mut comm, world) = MpiComm::init().expect("MPI starts");
        let err = if comm.rank() == 0 {
            comm.all_gather_u32(vec![1]).map(|_| ())
        } else {
            let mut buf = [1.0f32; 2];
            comm.all_reduce_sum(&mut buf)
        }
        .expect_err("ranks out of step fail");
        let other = 1 - comm.rank();
        assert!(
            matches!(err, CommError::OutOfStep { peer, .. } if peer == other),
            "{err}"
        );
        // Out-of-step all-reduces of other lengths are named too.
        let mut buf = vec![1.0f32; 2 + comm.rank()];
        let err = comm.all_reduce_sum(&mut buf).expect_err("lengths differ");
        assert!(
            err.to_string().contains("a buffer of another length"),
            "{err}"
        );
        // And the ranks are in step again after both failures.
        comm.barrier().expect("a barrier after the errors");
        println!("rank {}: {err}", comm.rank());
        world.finish();
        return;
    }
    if mpirun().is_none() {
        return;
    }
    let out = launch(case, 2, BOUND);
    let said = said(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("rank 0: ") && said.contains("rank 1: "),
        "{said}"
    );
}

/// The rank side of a case where rank 1 leaves (`leave`) and rank 0
/// waits for it in an all-reduce.
fn rank_1_leaves(leave: impl FnOnce(MpiWorld)) {
    let (mut comm, world) = MpiComm::init().expect("MPI starts");
    if comm.rank() == 1 {
        leave(world);
        unreachable!("rank 1 has left");
    }
    let mut buf = vec![1.0f32; 4];
    let _ = comm.all_reduce_sum(&mut buf);
    panic!("rank 0 finished an all-reduce that rank 1 never joined");
}

/// The outer side: the job fails within the watchdog's bound, rank 0
/// never going on; returns what it printed.
fn the_job_ends(case: &str, how: &str) -> String {
    let start = Instant::now();
    let out = launch(case, 2, BOUND);
    let said = said(&out);
    assert!(!out.status.success(), "the job succeeded:\n{said}");
    assert!(!said.contains("never joined"), "rank 0 went on:\n{said}");
    println!(
        "mpi case: {how} ended the job in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    said
}

#[test]
fn a_rank_that_dies_ends_the_job_instead_of_hanging_it() {
    let case = "a_rank_that_dies_ends_the_job_instead_of_hanging_it";
    if in_rank(case) {
        rank_1_leaves(|_| std::process::exit(3));
    }
    if mpirun().is_none() {
        return;
    }
    let said = the_job_ends(case, "a rank that died");
    // The launcher names the rank that died and how (Open MPI: "Exit
    // code: 3"; MPICH: "EXIT CODE: 3").
    assert!(
        said.to_lowercase().contains("exit code"),
        "the launcher did not say how the rank ended:\n{said}"
    );
}

#[test]
fn a_rank_that_ends_on_an_error_aborts_the_job_instead_of_hanging_it() {
    let case = "a_rank_that_ends_on_an_error_aborts_the_job_instead_of_hanging_it";
    if in_rank(case) {
        // An error of its own: the rank returns without finishing, and its
        // MpiWorld, dropped, aborts the job (finalizing would wait for rank
        // 0, which waits for it in the all-reduce).
        rank_1_leaves(drop);
    }
    if mpirun().is_none() {
        return;
    }
    the_job_ends(case, "a rank that ended on an error");
}

/// One rank's side of a training case over MPI.
fn rank_trains_as_a_device<N>(
    net: &N,
    config: EngineConfig,
    batch: impl Fn(usize) -> N::Batch + Copy,
) where
    N: Network + Sync,
    N::Batch: Sync,
{
    let (comm, world) = MpiComm::init().expect("MPI starts");
    ranks::rank_trains_as_a_device(net, config, Box::new(comm), batch);
    world.finish();
}

/// The outer side: `case` as `ranks` processes, each reporting
/// "rank R of N: {says}…".
fn ranks_report(case: &str, ranks: usize, says: &str) {
    let out = launch(case, ranks, BOUND);
    let said = said(&out);
    assert!(out.status.success(), "{ranks} ranks:\n{said}");
    for r in 0..ranks {
        assert!(
            said.contains(&format!("rank {r} of {ranks}: {says}")),
            "rank {r} of {ranks} did not report:\n{said}"
        );
    }
    println!("mpi case: {case} on {ranks} ranks, the in-process bits");
}

#[test]
fn ranks_train_the_moe_stack_as_in_process_devices_do() {
    let case = "ranks_train_the_moe_stack_as_in_process_devices_do";
    if in_rank(case) {
        let model = common::model(2, ExpertKind::SwiGlu);
        let size: usize = std::env::var("OMPI_COMM_WORLD_SIZE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2);
        // 48 rows: two micro-batches a rank on 2 ranks, one on 3.
        let micro_batches = if size == 2 { 2 } else { 1 };
        let config = resident(
            model.layers,
            model.experts,
            common::record_bytes(&model),
            micro_batches,
        );
        rank_trains_as_a_device(&model, config, |s| common::batch(&model, s));
        return;
    }
    if mpirun().is_none() {
        return;
    }
    ranks_report(case, 2, &format!("{STEPS} steps"));
    ranks_report(case, 3, &format!("{STEPS} steps"));
}

#[test]
fn ranks_train_the_language_model_as_in_process_devices_do() {
    let case = "ranks_train_the_language_model_as_in_process_devices_do";
    if in_rank(case) {
        let lm = MoeLm::new(tiny_config()).expect("the tiny model");
        let model = lm.moe().clone();
        let record = 16 * (model.expert_params() as u64 * 4).div_ceil(4096) * 4096;
        // 4 sequences: two micro-batches a rank on 2 ranks; every step
        // clipped, which sums the squares of every rank's experts; each
        // layer's exchange in two parts (the wire thread's collectives on
        // MPI beside the dense gradient's buckets on the second endpoint).
        let config = EngineConfig {
            clip_grad_norm: Some(1e-3),
            schedule: strata::engine::ScheduleKind::Naive,
            exchange_parts: ExchangeParts::Fixed(2),
            ..resident(model.layers, model.experts, record, 2)
        };
        rank_trains_as_a_device(&lm, config, |s| tiny_batch(s as u32));
        return;
    }
    if mpirun().is_none() {
        return;
    }
    ranks_report(case, 2, &format!("{STEPS} steps"));
}

#[test]
fn ranks_search_their_part_counts_alike() {
    let case = "ranks_search_their_part_counts_alike";
    if in_rank(case) {
        let lm = MoeLm::new(tiny_config()).expect("the tiny model");
        let model = lm.moe().clone();
        let record = 16 * (model.expert_params() as u64 * 4).div_ceil(4096) * 4096;
        // The search moves on each rank from the ranks' mean times, so
        // every rank runs the same parts: one, then two from the fourth
        // step, then what it settles on.
        let config = EngineConfig {
            exchange_parts: ExchangeParts::Auto,
            ..resident(model.layers, model.experts, record, 1)
        };
        rank_trains_as_a_device(&lm, config, |s| tiny_batch(s as u32));
        return;
    }
    if mpirun().is_none() {
        return;
    }
    ranks_report(case, 2, &format!("{STEPS} steps"));
}

#[test]
fn ranks_that_differ_are_named_when_they_join() {
    let case = "ranks_that_differ_are_named_when_they_join";
    if in_rank(case) {
        let (comm, world) = MpiComm::init().expect("MPI starts");
        let rank = comm.rank();
        let model = common::model(1, ExpertKind::SwiGlu);
        // Rank 1 runs two micro-batches, rank 0 one.
        let config = EngineConfig {
            ranks: 2,
            ..resident(
                model.layers,
                model.experts,
                common::record_bytes(&model),
                1 + rank,
            )
        };
        let mut engine = Engine::new(model, config).expect("the engine opens");
        let err = engine
            .join_ranks(Box::new(comm))
            .expect_err("ranks that differ are refused");
        let other = format!("rank {} runs another", 1 - rank);
        assert!(err.to_string().contains(&other), "{err}");
        println!("rank {rank}: {err}");
        world.finish();
        return;
    }
    if mpirun().is_none() {
        return;
    }
    let out = launch(case, 2, BOUND);
    let said = said(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("rank 0: ") && said.contains("rank 1: "),
        "{said}"
    );
}
