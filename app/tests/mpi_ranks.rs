//! `mpirun -n 2 strata train` (`--features mpi`) against `strata train
//! --devices 2`: the same losses at every step, the same dense params in
//! every rank's checkpoint, and each rank's experts those of the
//! in-process run, bit for bit. Where mpirun is missing the case says so
//! and passes, unless `STRATA_REQUIRE_MPI=1` (as in `.ci/run`).

#![cfg(feature = "mpi")]

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::process::{output_within, said, wait_within};
use common::ranks::{devices_run, last_checkpoint, losses, ranks_match, CONSTANT_LR, FLAGS};
use common::tiny_lm::run_params_of;
use strata::lm::MoeLm;
use strata_cli::trainer::hf::read_config;

fn mpirun_found() -> bool {
    let found = Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found || std::env::var("STRATA_REQUIRE_MPI").as_deref() != Ok("1"),
        "mpirun is missing, and STRATA_REQUIRE_MPI=1 says MPI is expected here"
    );
    if !found {
        eprintln!("mpi case skipped: mpirun is missing");
    }
    found
}

#[test]
fn mpirun_trains_what_devices_in_one_process_train() {
    if !mpirun_found() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (devices, ranks) = (dir.path().join("devices"), dir.path().join("ranks"));
    let strata = env!("CARGO_BIN_EXE_strata");
    let bound = Duration::from_secs(600);

    let exported = |name: &str| dir.path().join(format!("{name}-export"));
    let (to_devices, to_ranks) = (exported("devices"), exported("ranks"));
    fn export_to(to: &Path) -> Vec<&str> {
        [FLAGS, &["--export", to.to_str().unwrap()]].concat()
    }
    devices_run(2, &export_to(&to_devices), 20, &devices);
    let mpi = mpirun(2, &export_to(&to_ranks), 20, false, &ranks);
    let out = output_within(mpi, "mpirun -n 2 strata train", bound);
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    // Rank 0 alone speaks: one first line, one summary.
    assert_eq!(text.matches("strata train: ").count(), 1, "{text}");
    assert!(text.contains("2 cpu ranks as processes (MPI"), "{text}");
    assert_eq!(text.matches("done: step 20").count(), 1, "{text}");

    let (want, want_evals) = losses(&devices);
    assert_eq!(want.len(), 20);
    let lm = MoeLm::new(read_config(&devices).unwrap()).unwrap();
    let (dense, experts) = run_params_of(&devices, &lm, true);
    for rank in 0..2 {
        let run = ranks.join(format!("rank-{rank}"));
        let (got, got_evals) = losses(&run);
        assert_eq!(got, want, "rank {rank}: other losses than --devices 2");
        assert_eq!(got_evals.len(), want_evals.len());
        for (a, b) in got_evals.iter().zip(&want_evals) {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "rank {rank}: eval {a} against {b}"
            );
        }
        let (rank_dense, rank_experts) = run_params_of(&run, &lm, true);
        assert!(rank_dense == dense, "rank {rank}: other dense params");
        let e_count = lm.config().experts;
        for (i, (got, want)) in rank_experts.iter().zip(&experts).enumerate() {
            if (i % e_count) % 2 == rank {
                assert!(
                    got == want,
                    "rank {rank}: expert {} of layer {}",
                    i % e_count,
                    i / e_count
                );
            }
        }
    }
    // The exports, at the end of the run and by `strata export` after it,
    // are the in-process run's, byte for byte.
    let mut export = Command::new(strata);
    export
        .args(["export", "--run"])
        .arg(&ranks)
        .arg("--to")
        .arg(exported("after"));
    let out = output_within(export, "strata export of the ranks' run", bound);
    assert!(out.status.success(), "{}", said(&out));
    let files = |d: &Path| {
        let mut names: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
    };
    let want = files(&exported("devices"));
    assert!(want
        .iter()
        .any(|n| n.to_string_lossy().ends_with(".safetensors")));
    for got in ["ranks", "after"] {
        assert_eq!(files(&exported(got)), want, "{got}: other files");
        for name in &want {
            let read = |d: &Path| std::fs::read(d.join(name)).unwrap();
            assert!(
                read(&exported(got)) == read(&exported("devices")),
                "{got}: {name:?} differs from --devices 2's"
            );
        }
    }
    println!(
        "mpi case: mpirun -n 2 strata train, the bits of --devices 2 over 20 steps, and its \
         exports' bytes"
    );
}

/// `strata launch --nproc 2 -- train …` starts the ranks itself (mpirun
/// under it, with the flags Open MPI needs, as root too) and trains what
/// `--devices 2` trains, bit for bit.
#[test]
fn launch_trains_what_devices_in_one_process_train() {
    if !mpirun_found() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (devices, ranks) = (dir.path().join("devices"), dir.path().join("ranks"));
    devices_run(2, FLAGS, 20, &devices);
    let mut launch = Command::new(env!("CARGO_BIN_EXE_strata"));
    launch
        .args(["launch", "--nproc", "2", "--"])
        .args(FLAGS)
        .args(["--steps", "20", "--out"])
        .arg(&ranks);
    let out = output_within(launch, "strata launch --nproc 2", Duration::from_secs(600));
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("strata launch: 2 ranks: "), "{text}");
    assert!(text.contains(" -n 2 "), "{text}");
    assert_eq!(text.matches("done: step 20").count(), 1, "{text}");
    ranks_match(&devices, &ranks, 2);
    println!("mpi case: strata launch --nproc 2, the bits of --devices 2 over 20 steps");
}

/// Token condensation with ranks as processes: each rank condenses what it
/// sends, with the adaptive threshold from the losses every rank shares,
/// and `mpirun -n 2` trains what `--devices 2` trains, bit for bit, the
/// ranks together condensing as many assignments at every step.
#[test]
fn condensing_ranks_train_what_condensing_devices_train() {
    if !mpirun_found() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (devices, ranks) = (dir.path().join("devices"), dir.path().join("ranks"));
    let flags = [FLAGS, &["--condense", "adaptive:0.9"]].concat();
    devices_run(2, &flags, 12, &devices);
    let mpi = mpirun(2, &flags, 12, false, &ranks);
    let out = output_within(
        mpi,
        "mpirun -n 2 strata train --condense",
        Duration::from_secs(600),
    );
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("condens"), "the first line names it: {text}");
    ranks_match(&devices, &ranks, 2);
    let condensed = |dir: &Path| -> Vec<u64> {
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        text.lines()
            .filter_map(|l| {
                serde_json::from_str::<serde_json::Value>(l).ok()?["condensed"].as_u64()
            })
            .collect()
    };
    let want = condensed(&devices);
    assert_eq!(want.len(), 12);
    assert!(want.iter().any(|&c| c > 0), "nothing condensed: {want:?}");
    // A rank's metrics other than its loss are its own: their sum is the
    // devices'.
    let (r0, r1) = (
        condensed(&ranks.join("rank-0")),
        condensed(&ranks.join("rank-1")),
    );
    let sum: Vec<u64> = r0.iter().zip(&r1).map(|(a, b)| a + b).collect();
    assert_eq!(sum, want);
    println!("mpi case: condensing ranks, the bits of --devices 2 --condense over 12 steps");
}

/// `strata bench pipeline --mpi` under `mpirun -n 2`: every arm's engine
/// joins the ranks through an endpoint of its own (an `MPI_Comm_dup`), and
/// rank 0 reports each arm over MPI's own transport.
#[test]
fn the_pipeline_bench_measures_its_arms_as_mpi_ranks() {
    if !mpirun_found() {
        return;
    }
    let mut c = Command::new("mpirun");
    c.args(["--oversubscribe", "-n", "2"])
        .arg(env!("CARGO_BIN_EXE_strata"))
        .args([
            "bench", "pipeline", "--mpi", "--links", "none", "--preset", "tiny",
        ])
        .args([
            "--experts",
            "8",
            "--batch",
            "4",
            "--seq-len",
            "16",
            "--rounds",
            "1",
        ])
        .args(["--parts", "1,2", "--json"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    let out = output_within(
        c,
        "mpirun -n 2 strata bench pipeline --mpi",
        Duration::from_secs(600),
    );
    assert!(out.status.success(), "{}", said(&out));
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .filter(|r: &serde_json::Value| r["bench"] == "pipeline")
        .collect();
    // Rank 0 alone reports: the arms 1, 2 and auto, once each.
    let arms: Vec<&str> = rows.iter().map(|r| r["arm"].as_str().unwrap()).collect();
    assert_eq!(arms, ["1", "2", "auto"], "{}", said(&out));
    for r in &rows {
        assert_eq!(r["transport"], "mpi");
        assert_eq!(r["devices"], 2);
        assert!(r["link_gb_per_s"].is_null());
        assert!(r["exchange_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["model_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    println!("mpi case: strata bench pipeline --mpi on 2 ranks, each arm measured");
}

/// The pid of rank `rank` among `mpirun`'s children (Open MPI names each
/// child's rank in its environment).
fn rank_pid(mpirun: u32, rank: usize) -> Option<u32> {
    let children = Command::new("pgrep")
        .args(["-P", &mpirun.to_string()])
        .output()
        .ok()?;
    String::from_utf8_lossy(&children.stdout)
        .lines()
        .filter_map(|l| l.trim().parse::<u32>().ok())
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                env.split(|&b| b == 0)
                    .any(|kv| kv == format!("OMPI_COMM_WORLD_RANK={rank}").as_bytes())
            })
        })
}

/// Sends `signal` to rank 1 of the job `mpirun` once that rank's
/// metrics.jsonl in `ranks` has `lines` lines (it has trained a few steps).
fn signal_rank_1(mpirun: &std::process::Child, ranks: &Path, lines: usize, signal: &str) {
    let start = Instant::now();
    let progress = ranks.join("rank-1").join("metrics.jsonl");
    while std::fs::read_to_string(&progress).map_or(0, |t| t.lines().count()) < lines {
        assert!(
            start.elapsed() < Duration::from_secs(600),
            "the ranks did not start training"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = rank_pid(mpirun.id(), 1).expect("rank 1's process");
    let _ = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status();
}

#[test]
fn a_signalled_rank_stops_every_rank_at_one_step_and_they_resume_exactly() {
    if !mpirun_found() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (devices, ranks) = (dir.path().join("devices"), dir.path().join("ranks"));
    let bound = Duration::from_secs(600);
    devices_run(2, CONSTANT_LR, 150, &devices);

    // SIGTERM to rank 1 alone once the ranks have trained a few steps.
    let mut run = mpirun(2, CONSTANT_LR, 150, false, &ranks);
    let child = run
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    signal_rank_1(&child, &ranks, 3, "TERM");
    let text = said(&wait_within(child, "the ranks after SIGTERM", bound));
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

    let resume = mpirun(2, CONSTANT_LR, 150, true, &ranks);
    let out = output_within(resume, "mpirun -n 2 strata train --resume", bound);
    assert!(out.status.success(), "{}", said(&out));
    ranks_match(&devices, &ranks, 2);
    println!("mpi case: SIGTERM to rank 1 stopped both ranks at step {at}; resumed to --devices 2's bits");
}

/// `mpirun -n ranks strata train` with `flags`, `--steps steps`, in `out`.
fn mpirun(ranks: usize, flags: &[&str], steps: u64, resume: bool, out: &Path) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--oversubscribe", "-n", &ranks.to_string()])
        .arg(env!("CARGO_BIN_EXE_strata"))
        .args(flags)
        .args(["--steps", &steps.to_string()])
        .args(resume.then_some("--resume"))
        .arg("--out")
        .arg(out)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    c
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    let done = Command::new("cp").arg("-a").arg(from).arg(to).status();
    assert!(done.is_ok_and(|s| s.success()), "cp -a {from:?} {to:?}");
}

/// Four ranks, two of them a checkpoint behind the others (as a job
/// killed while its ranks committed leaves them): the resume rolls the
/// two ahead back, and the ranks end on the bits of `--devices 4`, every
/// step's gradient clipped to a global norm over every rank's experts,
/// and the routing trace of every rank's tokens `--devices 4`'s.
#[test]
fn ranks_a_checkpoint_apart_resume_from_the_step_all_of_them_hold() {
    if !mpirun_found() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (devices, ranks) = (dir.path().join("devices"), dir.path().join("ranks"));
    let traced = |name: &str| dir.path().join(format!("{name}-routing.json"));
    let (devices_trace, ranks_trace) = (traced("devices"), traced("ranks"));
    fn with_trace(trace: &Path) -> Vec<&str> {
        [
            CONSTANT_LR,
            &["--checkpoint-every", "0", "--clip-grad-norm", "0.01"],
            &["--trace-routing", trace.to_str().unwrap()],
        ]
        .concat()
    }
    let bound = Duration::from_secs(600);
    devices_run(4, &with_trace(&devices_trace), 12, &devices);

    let flags = with_trace(&ranks_trace);
    let out = output_within(mpirun(4, &flags, 4, false, &ranks), "mpirun -n 4", bound);
    assert!(out.status.success(), "{}", said(&out));
    let behind = |r: usize| dir.path().join(format!("behind-{r}"));
    for r in [1, 3] {
        copy_dir(&ranks.join(format!("rank-{r}")), &behind(r));
    }
    let out = output_within(mpirun(4, &flags, 8, true, &ranks), "a resume to 8", bound);
    assert!(out.status.success(), "{}", said(&out));
    for r in [1, 3] {
        copy_dir(&behind(r), &ranks.join(format!("rank-{r}")));
    }
    // Each rank's checkpoint is intact, and verify says they differ.
    let mut verify = Command::new(env!("CARGO_BIN_EXE_strata"));
    verify.args(["verify", "--run"]).arg(&ranks);
    let out = output_within(verify, "strata verify", bound);
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    for (r, step) in [(0, 8), (1, 4), (2, 8), (3, 4)] {
        assert!(
            text.contains(&format!(
                "rank-{r}: the checkpoint at step {step} is intact"
            )),
            "{text}"
        );
    }
    assert!(
        text.contains("checkpoints are at steps [8, 4, 8, 4]"),
        "{text}"
    );
    // An export needs every rank at one step, and says how to get there.
    let mut export = Command::new(env!("CARGO_BIN_EXE_strata"));
    export
        .args(["export", "--run"])
        .arg(&ranks)
        .arg("--to")
        .arg(dir.path().join("export"));
    let out = output_within(export, "strata export", bound);
    let text = said(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("checkpoints are at steps [8, 4, 8, 4]") && text.contains("--resume"),
        "{text}"
    );
    let out = output_within(mpirun(4, &flags, 12, true, &ranks), "a resume to 12", bound);
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("rank 0: rolled back from its checkpoint at step 8 to step 4"),
        "{text}"
    );
    ranks_match(&devices, &ranks, 4);
    // Rank 0 wrote the routing of every rank's tokens, resumed from the
    // trace of step 4: the in-process devices' trace.
    let read = |p: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    assert_eq!(read(&ranks_trace)["steps"], 12);
    assert!(
        read(&ranks_trace) == read(&devices_trace),
        "the ranks' routing trace differs from --devices 4's"
    );
    println!(
        "mpi case: 4 ranks, two a checkpoint behind, resumed from step 4 to --devices 4's bits"
    );
}

/// SIGKILL to one rank in the middle of a run: mpirun ends every rank
/// within the bound and names the one that died; a resume ends on the
/// bits of `--devices 2`, wherever the kill fell (in a step or in a
/// commit).
#[test]
fn a_killed_rank_ends_the_job_and_the_ranks_resume_exactly() {
    if !mpirun_found() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (devices, ranks) = (dir.path().join("devices"), dir.path().join("ranks"));
    let flags = [CONSTANT_LR, &["--checkpoint-every", "2"]].concat();
    let bound = Duration::from_secs(600);
    devices_run(2, &flags, 40, &devices);

    let mut run = mpirun(2, &flags, 40, false, &ranks);
    let child = run
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    signal_rank_1(&child, &ranks, 9, "KILL");
    let killed = Instant::now();
    let out = wait_within(child, "the job after rank 1 died", Duration::from_secs(60));
    let ended = killed.elapsed();
    let text = said(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("rank 1"), "the end names no rank:\n{text}");

    let out = output_within(mpirun(2, &flags, 40, true, &ranks), "the resume", bound);
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    ranks_match(&devices, &ranks, 2);
    let rolled = if text.contains("rolled back") {
        "rank 0 rolled back one checkpoint"
    } else {
        "both ranks at one checkpoint"
    };
    println!(
        "mpi case: rank 1 killed, the job ended in {ended:?}; {rolled}; resumed to --devices 2's bits"
    );
}

/// GPU ranks: `mpirun -n 2 strata train --backend cuda`, each rank on the
/// GPU of its local rank, the tokens exchanged through host memory over
/// MPI, trains what `--devices 2 --backend cuda` trains in one process,
/// bit for bit. Runs where CUDA is (a GPU, or CI's driver model).
#[cfg(feature = "cuda")]
#[test]
fn gpu_ranks_train_what_gpus_in_one_process_train() {
    if let Err(e) = strata::backend::BackendKind::Cuda.check(0..2, strata_tiers::Dtype::Bf16) {
        common::cuda_case_skipped(e);
        return;
    }
    if !mpirun_found() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (devices, ranks) = (dir.path().join("devices"), dir.path().join("ranks"));
    let flags = [CONSTANT_LR, &["--backend", "cuda"]].concat();
    devices_run(2, &flags, 8, &devices);
    let out = output_within(
        mpirun(2, &flags, 8, false, &ranks),
        "mpirun -n 2 strata train --backend cuda",
        Duration::from_secs(600),
    );
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("2 GPU ranks as processes"), "{text}");
    ranks_match(&devices, &ranks, 2);
    println!("cuda case: mpirun -n 2 strata train --backend cuda, the bits of --devices 2");
}
