//! `strata launch --comm nccl --nproc 2 -- train …` (`--features nccl`)
//! against `strata train --devices 2`: the ranks, started by strata
//! itself and told their place as torchrun tells it, meet over NCCL and
//! end on the same losses at every step and the same dense params in
//! every rank's checkpoint. In CI they run on the CPU model of the CUDA
//! driver and NCCL (tests/fake_cuda); where neither is found the case says
//! so and passes, unless `STRATA_REQUIRE_CUDA=1` makes that a failure.

#![cfg(feature = "nccl")]

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::process::{output_within, said, wait_within};
use common::ranks::{devices_run, last_checkpoint, ranks_match, CONSTANT_LR, FLAGS};

/// The ranks compute on the cpu: what is tested is their transport.
const CPU: &[&str] = &["--backend", "cpu"];

/// Whether the launch found no CUDA or NCCL (a failure where
/// `STRATA_REQUIRE_CUDA=1` says they are expected).
fn missing(out: &Output) -> bool {
    let text = said(out);
    if !(text.contains("no CUDA driver") || text.contains("no libnccl")) {
        return false;
    }
    assert!(
        std::env::var("STRATA_REQUIRE_CUDA").as_deref() != Ok("1"),
        "cuda case could not run, and STRATA_REQUIRE_CUDA=1 requires it: {text}"
    );
    eprintln!("cuda case skipped: {text}");
    true
}

/// `strata launch --comm nccl --nproc 2 -- <flags> --steps steps` in `out`.
fn launch(flags: &[&str], steps: u64, resume: bool, out: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.args(["launch", "--comm", "nccl", "--nproc", "2", "--"])
        .args(flags)
        .args(CPU)
        .args(["--steps", &steps.to_string()])
        .args(resume.then_some("--resume"))
        .arg("--out")
        .arg(out)
        .env_remove("MASTER_PORT");
    c
}

#[test]
fn launch_over_nccl_trains_what_devices_in_one_process_train() {
    let dir = tempfile::tempdir().unwrap();
    let (devices, ranks) = (dir.path().join("devices"), dir.path().join("ranks"));
    let flags: Vec<&str> = FLAGS.iter().chain(CPU).copied().collect();
    let launch = launch(FLAGS, 20, false, &ranks);
    let out = output_within(
        launch,
        "strata launch --comm nccl",
        Duration::from_secs(600),
    );
    if missing(&out) {
        return;
    }
    let text = said(&out);
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
    let launch = launch(FLAGS, 5, false, &ranks);
    let out = output_within(launch, "a failing rank's launch", Duration::from_secs(300));
    if missing(&out) {
        return;
    }
    let text = said(&out);
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

/// Ctrl-C to `strata launch` alone (the ranks run in a process group of
/// their own): it passes one SIGTERM to each rank, both checkpoint at the
/// same step and stop, the launch ends with 130, and `--resume` ends on
/// `--devices 2`'s bits.
#[test]
fn ctrl_c_to_the_launch_stops_every_rank_at_one_step_and_they_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (devices, ranks) = (dir.path().join("devices"), dir.path().join("ranks"));
    let bound = Duration::from_secs(600);
    let child = launch(CONSTANT_LR, 150, false, &ranks)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once rank 1 has trained a few steps (or the launch has ended).
    let progress = ranks.join("rank-1").join("metrics.jsonl");
    let start = Instant::now();
    while std::fs::read_to_string(&progress).map_or(0, |t| t.lines().count()) < 3
        && start.elapsed() < Duration::from_secs(120)
        && Path::new(&format!("/proc/{}", child.id())).exists()
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    common::signal(&child, "INT");
    let out = wait_within(child, "the launch after Ctrl-C", bound);
    if missing(&out) {
        return;
    }
    let text = said(&out);
    assert_eq!(out.status.code(), Some(130), "{text}");
    assert!(text.contains("asked to stop"), "{text}");
    let stopped: Vec<Option<u64>> = (0..2)
        .map(|r| last_checkpoint(&ranks.join(format!("rank-{r}"))))
        .collect();
    assert!(stopped[0].is_some(), "rank 0 wrote no checkpoint:\n{text}");
    assert_eq!(
        stopped[0], stopped[1],
        "the ranks stopped at different steps:\n{text}"
    );
    let at = stopped[0].unwrap();
    assert!(at < 150, "the run ended before the signal came:\n{text}");
    let resumed = output_within(launch(CONSTANT_LR, 150, true, &ranks), "the resume", bound);
    assert!(resumed.status.success(), "{}", said(&resumed));
    let flags: Vec<&str> = CONSTANT_LR.iter().chain(CPU).copied().collect();
    devices_run(2, &flags, 150, &devices);
    ranks_match(&devices, &ranks, 2);
    println!("cuda case on nccl: Ctrl-C to the launch stopped both ranks at step {at}; resumed to --devices 2's bits");
}
