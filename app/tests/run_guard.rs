//! A run is never lost to what happens around it: SIGTERM checkpoints as
//! Ctrl-C does; a closed stdout (`strata train | head`) checkpoints and
//! stops quietly; a second process in the same run directory is refused
//! before it touches anything, and two fresh runs started together leave
//! one whole run. Every wait here is bounded.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{bounded, signal};

const BOUND: Duration = Duration::from_secs(120);

fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

/// A small run that streams its experts from the SSD; `steps` of them.
fn args(out: &Path, steps: u64) -> Vec<String> {
    [
        "train",
        "--out",
        out.to_str().unwrap(),
        "--steps",
        &steps.to_string(),
        "--seq-len",
        "16",
        "--batch",
        "4",
        "--checkpoint-every",
        "0",
        "--eval-every",
        "0",
        "--device-mem",
        "3MiB",
        "--host-mem",
        "1536KiB",
        "--threads",
        "2",
    ]
    .map(String::from)
    .to_vec()
}

/// Steps recorded in metrics.jsonl (a line each; checkpoints have their own).
fn steps_written(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |t| {
        t.lines().filter(|l| !l.contains("\"checkpoint\"")).count()
    })
}

fn checkpoints(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .map(|t| t.matches("\"checkpoint\":true").count())
        .unwrap_or(0)
}

fn wait_for_steps(out: &Path, n: usize) {
    let deadline = Instant::now() + BOUND;
    while steps_written(out) < n {
        assert!(Instant::now() < deadline, "no {n} steps within {BOUND:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn finish(child: std::process::Child) -> Output {
    bounded("the strata process", BOUND, move || {
        child.wait_with_output().unwrap()
    })
}

/// `--resume` goes on from the checkpoint: the run was not lost.
fn resumes(out: &Path) {
    let mut a = args(out, steps_written(out) as u64 + 2);
    a.push("--resume".into());
    let output = strata().args(&a).output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The params of the run in `out`, read back through a resumed engine.
fn params(out: &Path) -> Vec<f32> {
    let text = std::fs::read_to_string(out.join("config.json")).unwrap();
    let config = strata::lm::LmConfig::from_hf_json(&text).unwrap();
    let (dense, experts) = common::tiny_lm::run_params(out, &config);
    dense
        .into_iter()
        .chain(experts.into_iter().flatten())
        .collect()
}

#[test]
fn sigterm_checkpoints_exits_143_and_resumes_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let child = strata()
        .args(args(&out, 100_000))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_steps(&out, 3);
    signal(&child, "TERM");
    let output = finish(child);
    assert_eq!(output.status.code(), Some(143), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stdout).contains("--resume"));
    assert_eq!(checkpoints(&out), 1);
    resumes(&out);
    // Against a run that never stopped, over as many steps.
    let steps = steps_written(&out) as u64;
    let straight = dir.path().join("straight");
    let done = strata().args(args(&straight, steps)).output().unwrap();
    assert!(done.status.success());
    assert!(params(&out) == params(&straight), "the params differ");
}

#[test]
fn a_timeline_step_out_of_range_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut a = args(&out, 3);
    a.extend(["--timeline-step".to_string(), "99".to_string()]);
    let output = strata().args(&a).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("--timeline-step 99"), "{stderr}");
    assert!(!out.exists(), "the refused run left {}", out.display());
}

#[test]
fn a_closed_stdout_checkpoints_and_stops_without_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut child = strata()
        .args(args(&out, 100_000))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read the first line, then close the pipe, as `head -1` does.
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("strata train"), "{first}");
    let output = finish(child);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("stdout was closed"), "{stderr}");
    assert_eq!(checkpoints(&out), 1, "{stderr}");
    resumes(&out);
}

#[test]
fn a_second_process_in_a_run_directory_is_refused_and_touches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let first = strata()
        .args(args(&out, 100_000))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_steps(&out, 2);
    let store = std::fs::metadata(out.join("experts.strata")).unwrap().len();
    for extra in [vec![], vec!["--resume".to_string()]] {
        let mut a = args(&out, 5);
        a.extend(extra);
        let output = strata().args(&a).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success());
        assert!(
            stderr.contains("is in use") && stderr.contains(&format!("pid {} on ", first.id())),
            "{stderr}"
        );
    }
    // Nor can an export or a verify read the store while it commits.
    let to = dir.path().join("exported");
    let export = [
        "export",
        "--run",
        out.to_str().unwrap(),
        "--to",
        to.to_str().unwrap(),
    ];
    for command in [&export[..], &["verify", "--run", out.to_str().unwrap()][..]] {
        let output = strata().args(command).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{command:?}");
        assert!(stderr.contains("is in use"), "{command:?}: {stderr}");
    }
    assert!(!to.exists());
    assert_eq!(
        std::fs::metadata(out.join("experts.strata")).unwrap().len(),
        store
    );
    signal(&first, "INT");
    let output = finish(first);
    assert_eq!(output.status.code(), Some(130));
    assert_eq!(checkpoints(&out), 1);
    resumes(&out);
}

#[test]
fn two_fresh_runs_started_together_leave_one_whole_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let children: Vec<_> = (0..2)
        .map(|_| {
            strata()
                .args(args(&out, 6))
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<Output> = children.into_iter().map(finish).collect();
    let won = outputs.iter().filter(|o| o.status.success()).count();
    assert_eq!(won, 1, "{outputs:?}");
    let lost = outputs.iter().find(|o| !o.status.success()).unwrap();
    let why = String::from_utf8_lossy(&lost.stderr);
    assert!(
        why.contains("is in use") || why.contains("already holds a run"),
        "{why}"
    );
    // The winner's run is whole: its record, its store, its six steps.
    assert!(out.join("run.json").exists() && out.join("experts.strata").exists());
    assert_eq!(steps_written(&out), 6);
    resumes(&out);
}

/// The step numbers of metrics.jsonl's step lines, in file order.
fn step_numbers(out: &Path) -> Vec<u64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"loss\""))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["step"].as_u64().unwrap()
        })
        .collect()
}

#[test]
fn after_a_kill_and_a_torn_line_a_resumed_run_records_each_step_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut a = args(&out, 100_000);
    let at = a.iter().position(|s| s == "--checkpoint-every").unwrap();
    a[at + 1] = "3".into();
    let mut child = strata().args(&a).stdout(Stdio::null()).spawn().unwrap();
    // Past a checkpoint, and steps beyond it that the resume redoes.
    let deadline = Instant::now() + BOUND;
    while checkpoints(&out) < 1 || steps_written(&out) < 5 {
        assert!(
            Instant::now() < deadline,
            "no checkpoint and 5 steps within {BOUND:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // A line torn by the kill (or a full disk).
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(out.join("metrics.jsonl"))
        .unwrap();
    std::io::Write::write_all(&mut f, b"{\"step\":99,\"lo").unwrap();
    drop(f);
    let target = steps_written(&out) as u64 + 3;
    let mut again = args(&out, target);
    again.push("--resume".into());
    let output = strata().args(&again).output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let steps = step_numbers(&out);
    assert_eq!(steps, (1..=target).collect::<Vec<u64>>());
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(
        text.ends_with('\n') && !text.contains("\"lo\n"),
        "a torn line is left"
    );
}

/// A process that a launcher says is one of several ranks, where this
/// strata cannot join them (built without MPI, or an MPI world that does
/// not match), is refused before it writes anything, naming the ranks.
#[test]
fn a_rank_that_cannot_join_its_world_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut cmd = strata();
    cmd.args(args(&out, 2)).env("PMI_SIZE", "2");
    let done = bounded("a rank refused", BOUND, move || cmd.output().unwrap());
    let said = String::from_utf8_lossy(&done.stderr).to_string();
    assert!(!done.status.success(), "{said}");
    assert!(said.contains("2 ranks"), "{said}");
    assert!(!out.exists(), "a refused rank wrote {}", out.display());
}
