//! `strata launch --comm nccl --nproc 2 -- train …` (`--features nccl`)
//! against `strata train --devices 2`: the ranks, started by strata
//! itself and told their place as torchrun tells it, meet over NCCL and
//! end on the same losses at every step and the same dense params in
//! every rank's checkpoint. In CI they run on the CPU model of the CUDA
//! driver and NCCL (tests/fake_cuda); where neither is found the case says
//! so and passes, unless `STRATA_REQUIRE_CUDA=1` makes that a failure.

#![cfg(feature = "nccl")]

mod common;

use std::process::Command;
use std::time::Duration;

use common::process::{output_within, said};
use common::ranks::{devices_run, ranks_match, FLAGS};

/// The ranks compute on the cpu: what is tested is their transport.
const CPU: &[&str] = &["--backend", "cpu"];

#[test]
fn launch_over_nccl_trains_what_devices_in_one_process_train() {
    let dir = tempfile::tempdir().unwrap();
    let (devices, ranks) = (dir.path().join("devices"), dir.path().join("ranks"));
    let flags: Vec<&str> = FLAGS.iter().chain(CPU).copied().collect();
    let mut launch = Command::new(env!("CARGO_BIN_EXE_strata"));
    launch
        .args(["launch", "--comm", "nccl", "--nproc", "2", "--"])
        .args(&flags)
        .args(["--steps", "20", "--out"])
        .arg(&ranks)
        .env_remove("MASTER_PORT");
    let out = output_within(
        launch,
        "strata launch --comm nccl",
        Duration::from_secs(600),
    );
    let text = said(&out);
    if text.contains("no CUDA driver") || text.contains("no libnccl") {
        assert!(
            std::env::var("STRATA_REQUIRE_CUDA").as_deref() != Ok("1"),
            "cuda case could not run, and STRATA_REQUIRE_CUDA=1 requires it: {text}"
        );
        eprintln!("cuda case skipped: {text}");
        return;
    }
    assert!(out.status.success(), "{text}");
    assert!(text.contains("strata launch: 2 ranks over NCCL"), "{text}");
    assert!(text.contains("ranks as processes (NCCL"), "{text}");
    assert_eq!(text.matches("done: step 20").count(), 1, "{text}");
    devices_run(2, &flags, 20, &devices);
    ranks_match(&devices, &ranks, 2);
    println!("cuda case on nccl: strata launch --comm nccl --nproc 2, the bits of --devices 2");
}

#[test]
fn a_rank_that_fails_ends_the_launch_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let ranks = dir.path().join("ranks");
    // Rank 1's run directory is a file: rank 1 fails as its run starts,
    // while rank 0 goes on to its first collective with it.
    std::fs::create_dir_all(&ranks).unwrap();
    std::fs::write(ranks.join("rank-1"), b"not a directory").unwrap();
    let mut launch = Command::new(env!("CARGO_BIN_EXE_strata"));
    launch
        .args(["launch", "--comm", "nccl", "--nproc", "2", "--"])
        .args(FLAGS)
        .args(CPU)
        .args(["--steps", "5", "--out"])
        .arg(&ranks)
        .env_remove("MASTER_PORT");
    let out = output_within(launch, "a failing rank's launch", Duration::from_secs(300));
    let text = said(&out);
    if text.contains("no CUDA driver") || text.contains("no libnccl") {
        assert!(
            std::env::var("STRATA_REQUIRE_CUDA").as_deref() != Ok("1"),
            "cuda case could not run, and STRATA_REQUIRE_CUDA=1 requires it: {text}"
        );
        eprintln!("cuda case skipped: {text}");
        return;
    }
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("strata: error: rank 1:"), "{text}");
    // Either rank's end may be seen first: rank 0's collective fails as
    // soon as rank 1's process is gone.
    assert!(
        text.contains("strata launch: rank 1 ended")
            || text.contains("strata launch: rank 0 ended"),
        "{text}"
    );
    println!(
        "cuda case on nccl: a failing rank ends the launch: {}",
        out.status
    );
}
