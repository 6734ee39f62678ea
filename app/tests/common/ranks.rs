//! What the trainer's rank cases share, whatever carries the ranks
//! (`mpi_ranks.rs`, `nccl_ranks.rs`): a small run's flags, its losses as
//! written, the in-process devices' run, and the comparison of every rank
//! with it.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use super::process::{output_within, said};
use super::tiny_lm::run_params_of;
use strata::lm::MoeLm;
use strata_cli::trainer::hf::read_config;

pub const FLAGS: &[&str] = &[
    "train",
    "--batch",
    "4",
    "--seq-len",
    "32",
    "--micro-batches",
    "2",
    "--eval-every",
    "10",
    "--threads",
    "1",
];

/// Each step's loss (as written) and each evaluation's, from a run's
/// metrics.jsonl.
pub fn losses(dir: &Path) -> (Vec<String>, Vec<f64>) {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).expect("metrics.jsonl");
    let mut losses = Vec::new();
    let mut evals = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
        if let Some(l) = v.get("eval_loss") {
            evals.push(l.as_f64().expect("a number"));
        } else if let Some(l) = v.get("loss") {
            losses.push(l.to_string());
        }
    }
    (losses, evals)
}

/// `strata train --devices devices` with `flags` for `steps`, in `out`:
/// what the ranks must end on.
pub fn devices_run(devices: usize, flags: &[&str], steps: u64, out: &Path) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.args(flags)
        .args(["--steps", &steps.to_string()])
        .args(["--devices", &devices.to_string(), "--out"])
        .arg(out);
    let done = output_within(c, "strata train --devices", Duration::from_secs(600));
    assert!(done.status.success(), "{}", said(&done));
}

/// Every rank's losses and dense params are those of the devices' run.
pub fn ranks_match(devices: &Path, ranks: &Path, n: usize) {
    let (want, _) = losses(devices);
    let lm = MoeLm::new(read_config(devices).unwrap()).unwrap();
    let (dense, _) = run_params_of(devices, &lm, true);
    for rank in 0..n {
        let run = ranks.join(format!("rank-{rank}"));
        let (got, _) = losses(&run);
        assert_eq!(got, want, "rank {rank}: other losses than --devices {n}");
        assert!(
            run_params_of(&run, &lm, true).0 == dense,
            "rank {rank}: other dense params"
        );
    }
}

/// The step of the last checkpoint a run's metrics.jsonl records.
pub fn last_checkpoint(dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).ok()?;
    text.lines()
        .rev()
        .filter(|l| l.contains("\"checkpoint\""))
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["step"].as_u64())
}

/// Flags whose results do not depend on `--steps` (a constant learning
/// rate), so that a run extended by `--resume --steps` trains what one
/// run of that length trains.
pub const CONSTANT_LR: &[&str] = &[
    "train",
    "--batch",
    "4",
    "--seq-len",
    "16",
    "--eval-every",
    "0",
    "--threads",
    "1",
    "--warmup",
    "0",
    "--min-lr-ratio",
    "1",
];
