//! `NcclComm` between processes (`--features nccl`). Each case runs this
//! test binary again as N processes, restricted to itself, with
//! `STRATA_NCCL_RANK_CASE` naming it and `RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR` and `MASTER_PORT` set as `strata launch --comm nccl` and
//! torchrun set them: there the same function plays one rank, and the
//! outer test checks what each printed and how it ended, each under a
//! watchdog.
//!
//! In CI the ranks run on the CPU model of the CUDA driver and NCCL
//! (tests/fake_cuda: each pair of ranks joined by a socket, every transfer
//! queued on the driver model's streams); on a machine with GPUs and
//! libnccl, on those. Where neither is found the cases say so and pass,
//! unless `STRATA_REQUIRE_CUDA=1` makes that a failure.

#![cfg(feature = "nccl")]

use std::process::{Command, Output};
use std::time::Duration;

use strata::comm::{Comm, CommError, NcclComm, World};
use strata::engine::EngineConfig;
use strata::lm::MoeLm;
use strata::model::Network;

mod common;

use common::process::{said, wait_within};
use common::ranks::{in_process, rank_trains_as_a_device, resident, script, STEPS};
use common::tiny_lm::{tiny_batch, tiny_config};

const RANK_CASE: &str = "STRATA_NCCL_RANK_CASE";
const BOUND: Duration = Duration::from_secs(120);
/// A rank's bound on each collective's wait for its peers.
const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether this process is one rank of `case`.
fn in_rank(case: &str) -> bool {
    std::env::var(RANK_CASE).is_ok_and(|c| c == case)
}

/// This rank's endpoint, on GPU `LOCAL_RANK` (the driver model has 4).
fn join() -> NcclComm {
    let world = World::from_env()
        .expect("the launcher's variables")
        .expect("RANK and WORLD_SIZE are set");
    NcclComm::join(&world, world.local_rank, COLLECTIVE_TIMEOUT).unwrap_or_else(|e| {
        // The outer test reads this line to tell a missing NCCL from a bug.
        println!("nccl missing: {e}");
        std::process::exit(0)
    })
}

/// A port no one listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// `case` as `ranks` processes; every output, in rank order. Each rank is
/// killed, and the test failed, past `BOUND`.
fn launch(case: &str, ranks: usize) -> Vec<Output> {
    let me = std::env::current_exe().expect("the test binary's path");
    let port = free_port().to_string();
    let children: Vec<_> = (0..ranks)
        .map(|r| {
            let mut cmd = Command::new(&me);
            cmd.args(["--exact", case, "--nocapture", "--test-threads", "1"])
                .env(RANK_CASE, case)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", ranks.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            cmd.spawn().expect("a rank starts")
        })
        .collect();
    let waits: Vec<_> = children
        .into_iter()
        .enumerate()
        .map(|(r, child)| {
            let what = format!("{case}, rank {r} of {ranks}");
            std::thread::spawn(move || wait_within(child, &what, BOUND))
        })
        .collect();
    waits
        .into_iter()
        .map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
        .collect()
}

/// Whether the ranks found no CUDA or NCCL (a failure where
/// `STRATA_REQUIRE_CUDA=1` says they are expected).
fn missing(outs: &[Output]) -> bool {
    let Some(why) = outs.iter().find_map(|o| {
        said(o)
            .lines()
            .find(|l| l.contains("nccl missing"))
            .map(str::to_string)
    }) else {
        return false;
    };
    assert!(
        std::env::var("STRATA_REQUIRE_CUDA").as_deref() != Ok("1"),
        "cuda case could not run, and STRATA_REQUIRE_CUDA=1 requires it: {why}"
    );
    eprintln!("cuda case skipped: {why}");
    true
}

/// Whether this machine has a GPU for each of `ranks` (NCCL refuses two
/// ranks on one GPU); where it has one but fewer than `ranks`, the case
/// says so and is not run. Without any, the ranks say why (`missing`).
fn gpus_for(ranks: usize) -> bool {
    let opens = |g: usize| strata_tiers::device_cuda::open_gpu(g).is_ok();
    if !opens(0) || (0..ranks).all(opens) {
        return true;
    }
    println!("cuda case on nccl: {ranks} ranks need {ranks} GPUs, and this machine has fewer");
    false
}

/// Every rank ended well and said `says`.
fn every_rank_says(case: &str, ranks: usize, says: &str) {
    if !gpus_for(ranks) {
        return;
    }
    let outs = launch(case, ranks);
    if missing(&outs) {
        return;
    }
    for (r, out) in outs.iter().enumerate() {
        let text = said(out);
        assert!(out.status.success(), "rank {r} of {ranks}:\n{text}");
        let line = format!("rank {r} of {ranks}: {says}");
        assert!(
            text.contains(&line),
            "rank {r} of {ranks} did not say {line:?}:\n{text}"
        );
    }
    println!("cuda case on nccl: {case} on {ranks} ranks: {says}");
}

#[test]
fn collectives_over_nccl_give_the_in_process_bits() {
    let case = "collectives_over_nccl_give_the_in_process_bits";
    if in_rank(case) {
        let mut comm = join();
        let (r, n) = (comm.rank(), comm.size());
        let seen = script(&mut comm);
        assert!(seen == in_process(n)[r], "rank {r} of {n}: other bits");
        println!("rank {r} of {n}: the in-process bits");
        return;
    }
    // One rank: what a machine with one GPU runs.
    every_rank_says(case, 1, "the in-process bits");
    every_rank_says(case, 2, "the in-process bits");
    every_rank_says(case, 3, "the in-process bits");
}

#[test]
fn ranks_out_of_step_are_named() {
    let case = "ranks_out_of_step_are_named";
    if in_rank(case) {
        let mut comm = join();
        let r = comm.rank();
        let err = if r == 0 {
            comm.all_to_all(vec![vec![1.0], vec![2.0]]).unwrap_err()
        } else {
            comm.all_reduce_sum(&mut [1.0, 2.0]).unwrap_err()
        };
        let other = if r == 0 { "all_reduce" } else { "all_to_all" };
        assert!(
            matches!(&err, CommError::OutOfStep { peer, got, .. } if *peer == 1 - r && *got == other),
            "{err}"
        );
        // A buffer of another length in the same collective, too.
        let mut buf = vec![1.0f32; 3 + r];
        let err = comm.all_reduce_sum(&mut buf).unwrap_err();
        assert!(err.to_string().contains("another length"), "{err}");
        println!("rank {r} of 2: named: {err}");
        return;
    }
    every_rank_says(case, 2, "named");
}

#[test]
fn a_rank_that_dies_fails_its_peers_collective_instead_of_hanging_it() {
    let case = "a_rank_that_dies_fails_its_peers_collective_instead_of_hanging_it";
    if in_rank(case) {
        let mut comm = join();
        let r = comm.rank();
        comm.barrier().expect("both ranks are here");
        if r == 1 {
            std::process::exit(3);
        }
        let err = comm
            .all_to_all(vec![vec![0.0; 1000], vec![1.0; 1000]])
            .unwrap_err();
        assert!(
            matches!(err, CommError::Nccl { .. } | CommError::TimedOut { .. }),
            "{err}"
        );
        // The communicator is aborted: the next collective fails at once.
        let again = comm.barrier().unwrap_err();
        println!("rank 0 of 2: failed: {err}; then: {again}");
        return;
    }
    if !gpus_for(2) {
        return;
    }
    let outs = launch(case, 2);
    if missing(&outs) {
        return;
    }
    assert_eq!(outs[1].status.code(), Some(3), "{}", said(&outs[1]));
    let text = said(&outs[0]);
    assert!(outs[0].status.success(), "{text}");
    assert!(text.contains("rank 0 of 2: failed: NCCL failed"), "{text}");
    println!("cuda case on nccl: {case}");
}

#[test]
fn ranks_train_the_language_model_as_in_process_devices_do() {
    let case = "ranks_train_the_language_model_as_in_process_devices_do";
    if in_rank(case) {
        let comm = join();
        let lm = MoeLm::new(tiny_config()).expect("the tiny model");
        let model = lm.moe().clone();
        let record = 16 * (model.expert_params() as u64 * 4).div_ceil(4096) * 4096;
        // Two micro-batches a rank; the dense gradient reduced after the
        // backward (NCCL's endpoint has no second one).
        let config = EngineConfig {
            ..resident(model.layers, model.experts, record, 2)
        };
        rank_trains_as_a_device(&lm, config, Box::new(comm), |s| tiny_batch(s as u32));
        return;
    }
    every_rank_says(case, 2, &format!("{STEPS} steps"));
}
