//! `strata train --compute-threads N`: the cpu backend's compute split
//! over fewer threads than the machine's cores changes no bit of a run,
//! nor does resuming under other counts (of compute and optimizer
//! threads); 0 is refused.

use std::path::Path;
use std::process::{Command, Stdio};

fn strata_bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

/// Trains the default `tiny` preset (its GEMMs and attention are large
/// enough to be split over the cores) to `steps` in `out`, with `extra`
/// flags; panics with the run's stderr where it fails.
fn train(out: &Path, steps: u64, extra: &[&str]) {
    let run = strata_bin()
        .args(["train", "--quiet", "--out", out.to_str().unwrap()])
        .args(["--steps", &steps.to_string(), "--eval-every", "3"])
        .args(["--checkpoint-every", "3"])
        .args(extra)
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// Each step's training and held-out loss from `metrics.jsonl`, as the
/// shortest decimal that reads back to the same f32 (so equal strings are
/// equal bits).
fn losses(out: &Path) -> Vec<String> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|m| {
            let loss = m.get("loss").or(m.get("eval_loss"))?;
            Some(format!("{} {loss}", m["step"]))
        })
        .collect()
}

#[test]
fn the_compute_threads_change_no_bit_of_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let every_core = dir.path().join("every-core");
    train(&every_core, 6, &[]);
    let one = dir.path().join("one");
    train(&one, 6, &["--compute-threads", "1"]);
    let resumed = dir.path().join("resumed");
    train(&resumed, 3, &["--compute-threads", "1"]);
    train(
        &resumed,
        6,
        &["--resume", "--compute-threads", "2", "--threads", "1"],
    );

    let expected = losses(&every_core);
    assert_eq!(expected.len(), 6 + 2, "{expected:?}");
    assert_eq!(losses(&one), expected);
    assert_eq!(losses(&resumed), expected);
    let record = std::fs::read_to_string(one.join("run.json")).unwrap();
    assert!(record.contains("\"compute_threads\": 1"), "{record}");

    let refused = strata_bin()
        .args(["train", "--compute-threads", "0", "--out"])
        .arg(dir.path().join("refused"))
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("--compute-threads 0: "), "{err}");
    assert!(!dir.path().join("refused").exists());
}

/// The `small` preset's expert GEMMs are large enough to be split over
/// two threads, and its bf16 expert FFN (the default) runs its GEMM pairs
/// side by side: one thread and every core give the same bits.
#[test]
fn the_bf16_expert_gemms_change_no_bit_with_the_threads() {
    let dir = tempfile::tempdir().unwrap();
    let small = ["--preset", "small", "--expert-gemm", "bf16"];
    let every_core = dir.path().join("every-core");
    train(&every_core, 3, &small);
    let one = dir.path().join("one");
    train(&one, 3, &[&small[..], &["--compute-threads", "1"]].concat());
    let expected = losses(&every_core);
    assert_eq!(expected.len(), 3 + 1, "{expected:?}");
    assert_eq!(losses(&one), expected);
}
