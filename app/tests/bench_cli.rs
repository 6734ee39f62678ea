//! `strata bench …` through the binary: `overlap`'s JSON lines, its
//! refusal of a directory that is not there, `step`'s refusal of a token
//! count, its table's line on the host tier and its timelines, its
//! `--compute-threads`, `affinity` on a trace file, `condense`'s rows,
//! `attention`'s two variants, and a quiet exit when the reader of stdout goes away.

use std::process::{Command, Stdio};

fn strata_bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

/// A `--json` bench's stdout, a JSON object a line.
fn json_lines(stdout: &[u8]) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn bench_overlap_prints_three_arms_and_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let out = strata_bin()
        .args(["bench", "overlap", "--json", "--record-mib", "1"])
        .args(["--records", "4", "--rounds", "1", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = json_lines(&out.stdout);
    let arms: Vec<&str> = lines.iter().map(|l| l["arm"].as_str().unwrap()).collect();
    assert_eq!(arms, ["io", "compute", "both", "summary"]);
    assert!(lines[3]["both_over_bound"].as_f64().unwrap() > 0.0);
    assert!(lines[2]["io_s"].as_f64().unwrap() > 0.0);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// `bench step` computes every run on every core but one unless told
/// otherwise (`--compute-threads all`: every core), says so in its
/// summary, and reaches the same losses either way (the splits share out
/// rows, never change a sum); 0, words other than `all` and more than 4
/// threads a core are refused.
#[test]
fn bench_step_computes_on_the_threads_it_is_given() {
    let dir = tempfile::tempdir().unwrap();
    let run = |threads: Option<&str>| {
        let mut cmd = strata_bin();
        // GEMMs of 512 × 128 × 256: large enough to be split over cores.
        cmd.args(["bench", "step", "--json", "--layers", "2", "--experts", "4"])
            .args(["--d-model", "128", "--d-ff", "256", "--tokens", "512"])
            .args(["--rounds", "1", "--steps", "2", "--host-fraction", "0.5"])
            .arg("--dir")
            .arg(dir.path());
        if let Some(n) = threads {
            cmd.args(["--compute-threads", n]);
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        let summary: serde_json::Value = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|l| l["run"] == "summary")
            .unwrap();
        let mut losses: Vec<String> = err
            .lines()
            .filter_map(|l| {
                Some(format!(
                    "{} {}",
                    l.split(" step ").next()?,
                    l.split("loss ").nth(1)?
                ))
            })
            .collect();
        losses.sort();
        assert_eq!(losses.len(), 4 * 3, "{err}");
        (summary, losses)
    };
    let (default, default_losses) = run(None);
    let cores = default["machine_cores"].as_u64().unwrap();
    assert_eq!(
        default["compute_threads"].as_u64(),
        Some(cores.saturating_sub(1).max(1))
    );
    let (all, all_losses) = run(Some("all"));
    assert_eq!(all["compute_threads"].as_u64(), Some(cores));
    assert_eq!(default_losses, all_losses);

    let too_many = (cores * 4 + 1).to_string();
    for (flag, arg, says) in [
        ("--compute-threads", "0", "--compute-threads 0: "),
        ("--compute-threads", "most", "`most`"),
        ("--compute-threads", &too_many, "compute threads: at most"),
        ("--optimizer-threads", &too_many, "--optimizer-threads"),
    ] {
        let out = strata_bin()
            .args(["bench", "step", flag, arg])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{err}");
    }
}

#[test]
fn bench_overlap_names_a_missing_directory() {
    let out = strata_bin()
        .args(["bench", "overlap", "--dir", "/no/such/strata/dir"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--dir /no/such/strata/dir"), "{err}");
}

#[test]
fn bench_output_into_a_closed_pipe_ends_quietly() {
    // The reader is gone before the bench has measured anything, so its
    // first line meets a broken pipe (as with `strata bench … | head -0`).
    let mut child = strata_bin()
        .args(["bench", "placement", "--reps", "2000", "--trials", "5"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bench_step_refuses_counts_and_rates_it_cannot_run() {
    for (flag, bad, says) in [
        ("--tokens", "0", "nor `balanced`"),
        ("--tokens", "many", "nor `balanced`"),
        (
            "--device-experts",
            "0",
            "--device-experts must be at least 1",
        ),
        (
            "--modeled-device-gflops",
            "0",
            "--modeled-device-gflops 0: ",
        ),
    ] {
        let out = strata_bin()
            .args(["bench", "step", flag, bad])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{err}");
    }
}

/// The table says how the expert-wise run's host tier is used: with half
/// the records in host memory and no slot split into compute cells, 3 of
/// 8 slots keep a record resident (the bench streams through 5), and the
/// last layer's other 5 experts hold their updates unless told not to. At
/// the bench's default of one slot split into cells (6 of them at this
/// shape), 2 of the 7 record slots keep a record; the last layer's other 6
/// then do not fit the streaming slots, so no update is held.
#[test]
fn bench_step_table_names_kept_records_and_held_updates() {
    let dir = tempfile::tempdir().unwrap();
    let no_cells = "expert-wise host tier: 8 slots, 3 keeping a record resident, 5 streaming;";
    let cells = "expert-wise host tier: 7 slots, 2 keeping a record resident, 5 streaming, \
                 and 6 compute cells (";
    for (defer, cell_slots, tier, held) in [
        ("on", "0", no_cells, 5),
        ("off", "0", no_cells, 0),
        ("on", "1", cells, 0),
    ] {
        let out = strata_bin()
            .args(["bench", "step", "--layers", "2", "--experts", "8"])
            .args(["--d-model", "16", "--d-ff", "32", "--tokens", "32"])
            .args(["--rounds", "1", "--steps", "1", "--host-fraction", "0.5"])
            .args(["--defer-updates", defer, "--host-cell-slots", cell_slots])
            .arg("--dir")
            .arg(dir.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        let table = String::from_utf8_lossy(&out.stdout);
        let line = table
            .lines()
            .find(|l| l.starts_with("expert-wise host tier"))
            .unwrap_or_else(|| panic!("{table}"));
        assert!(line.starts_with(tier), "{line}");
        let held = format!("; {held} updates held for the next forward");
        assert!(line.ends_with(&held), "{line}");
    }
    let out = strata_bin()
        .args(["bench", "step", "--defer-updates", "maybe"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("neither `on` nor `off`"), "{err}");
}

/// `--timeline DIR` leaves each run's last timed step as a Chrome trace,
/// and every record says where its steps' SSD sat idle.
#[test]
fn bench_step_writes_timelines_and_phases() {
    let dir = tempfile::tempdir().unwrap();
    let traces = dir.path().join("traces");
    let out = strata_bin()
        .args(["bench", "step", "--layers", "2", "--experts", "8"])
        .args(["--d-model", "16", "--d-ff", "32", "--tokens", "32"])
        .args(["--rounds", "1", "--steps", "1", "--json", "--dir"])
        .arg(dir.path())
        .arg("--timeline")
        .arg(&traces)
        .arg("--plot")
        .arg(dir.path().join("steps.png"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let records: Vec<serde_json::Value> = json_lines(&out.stdout)
        .into_iter()
        .filter(|r| r["run"] != "summary")
        .collect();
    assert_eq!(records.len(), 4);
    for r in &records {
        let run = r["run"].as_str().unwrap();
        let phases = &r["phases"];
        let step = r["step_s"].as_f64().unwrap();
        let sum: f64 = ["forward_s", "turn_s", "backward_s"]
            .iter()
            .map(|k| phases[k].as_f64().unwrap())
            .sum();
        assert!(sum > 0.0 && sum <= step * 1.5, "{run}: {phases}");
        let trace: serde_json::Value =
            serde_json::from_slice(&std::fs::read(traces.join(format!("{run}.json"))).unwrap())
                .unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        assert!(events.iter().any(|e| e["cat"] == "step"), "{run}");
        let ssd = events.iter().filter(|e| e["cat"] == "ssd").count();
        // Every record is resident in the compute-only run; the others
        // stream three quarters of them.
        assert_eq!(ssd == 0, run == "compute_only", "{run}: {ssd} SSD calls");
    }
    // `--plot FILE`: the four runs' steps in one figure, a panel each.
    let png = std::fs::read(dir.path().join("steps.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let dims = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    assert_eq!(
        (dims(16), dims(20)),
        (1600, 300 + 260 * 4),
        "IHDR width, height"
    );
}

/// A figure `--plot` cannot write is refused before the runs start.
#[test]
fn bench_step_refuses_a_plot_it_cannot_draw() {
    let out = strata_bin()
        .args(["bench", "step", "--plot", "/tmp/steps.gif"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(".png or .svg"),
        "{err}"
    );
    assert!(!err.contains("round 1"), "refused before running: {err}");
}

/// `bench affinity --trace` reads a trace as `train --trace-routing`
/// writes it: a chain (every token at expert a goes to a + 1 next) is kept
/// whole by the affinity placement and its optimum; a file that is not a
/// trace is named.
#[test]
fn bench_affinity_places_a_trace_and_names_a_file_that_is_not_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut trace = strata::engine::RoutingTrace::new(3, 4, 1);
    for t in &mut trace.transitions {
        for a in 0..4 {
            t[a * 4 + (a + 1) % 4] = 25;
        }
    }
    let path = dir.path().join("trace.json");
    std::fs::write(&path, trace.to_json()).unwrap();
    let out = strata_bin()
        .args(["bench", "affinity", "--json", "--devices", "2", "--trace"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = json_lines(&out.stdout);
    let policies: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(policies, ["balanced", "affinity", "exact"]);
    assert_eq!(rows[1]["staying_share"].as_f64(), Some(1.0));
    assert_eq!(rows[2]["staying_share"].as_f64(), Some(1.0));
    assert_eq!(rows[0]["transitions"].as_u64(), Some(200));

    let other = dir.path().join("metrics.jsonl");
    std::fs::write(&other, "{\"step\":1}\n").unwrap();
    let out = strata_bin()
        .args(["bench", "affinity", "--trace"])
        .arg(&other)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a routing trace"), "{err}");

    // Two nodes of two GPUs: a node share on each row and a two-level row;
    // a later trace whose steps route as the earlier ones moves nothing.
    let mut later = trace.clone();
    later.steps = 2;
    later.add(&trace);
    let later_path = dir.path().join("later.json");
    std::fs::write(&later_path, later.to_json()).unwrap();
    let mut earlier = trace.clone();
    earlier.steps = 1;
    let earlier_path = dir.path().join("earlier.json");
    std::fs::write(&earlier_path, earlier.to_json()).unwrap();
    let out = strata_bin()
        .args([
            "bench",
            "affinity",
            "--json",
            "--devices",
            "4",
            "--nodes",
            "2",
        ])
        .arg("--trace")
        .arg(&earlier_path)
        .arg("--later")
        .arg(&later_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = json_lines(&out.stdout);
    let policies: Vec<&str> = rows.iter().filter_map(|r| r["policy"].as_str()).collect();
    assert_eq!(policies, ["balanced", "affinity", "exact", "two-level"]);
    assert!(rows[..4].iter().all(|r| r["node_share"].as_f64().is_some()));
    assert_eq!(rows[4]["bench"], "affinity-drift");
    assert_eq!(rows[4]["steps_after"], 1);
    assert_eq!(rows[4]["experts_moved"], 0);
    assert_eq!(rows[4]["replaced"], false);

    // A trace is no later than itself.
    let out = strata_bin()
        .args(["bench", "affinity", "--devices", "4", "--trace"])
        .arg(&earlier_path)
        .arg("--later")
        .arg(&earlier_path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no steps beyond"), "{err}");

    let out = strata_bin()
        .args(["bench", "affinity", "--devices", "4", "--nodes", "3"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--nodes 3"), "{err}");
}

/// `bench condense` trains a little, then measures every layer at each
/// threshold with both searches, and the link rows; it refuses a device
/// count the batch cannot split into.
#[test]
fn bench_condense_measures_the_captured_layers_and_refuses_too_many_devices() {
    let out = strata_bin()
        .args(["bench", "condense", "--json", "--train-steps", "2"])
        .args([
            "--seq-len",
            "16",
            "--batch",
            "4",
            "--devices",
            "2",
            "--reps",
            "1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = json_lines(&out.stdout);
    let benches = |name: &str| rows.iter().filter(|r| r["bench"] == name).count();
    // tiny's 2 layers × 4 thresholds × 2 searches; off and 4 thresholds.
    assert_eq!((benches("condense"), benches("condense-link")), (16, 5));
    for r in rows.iter().filter(|r| r["bench"] == "condense") {
        let share = r["share"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&share), "{r}");
    }

    let out = strata_bin()
        .args(["bench", "condense", "--batch", "4", "--devices", "8"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--devices 8") && err.contains("raise --batch"),
        "{err}"
    );
}

/// `bench migrate` trains a little, then follows the captured batch's
/// sequences under every placement and planner; it refuses a device count
/// the batch cannot split into and a negative slack.
#[test]
fn bench_migrate_follows_the_sequences_and_refuses_what_it_cannot_split() {
    let out = strata_bin()
        .args(["bench", "migrate", "--json", "--train-steps", "2"])
        .args(["--seq-len", "16", "--batch", "4", "--devices", "2,4"])
        .args(["--reps", "1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = json_lines(&out.stdout);
    // 2 device counts × 3 placements × (stay, 3 planners × 2 candidates,
    // 2 coherent rules).
    assert_eq!(rows.len(), 2 * 3 * 9);
    for r in &rows {
        assert_eq!(r["bench"], "migrate", "{r}");
        let (moved, back) = (
            r["moved"].as_u64().unwrap(),
            r["residual_grad_rows"].as_u64(),
        );
        if r["planner"].as_str().unwrap().starts_with("coherent") {
            // Tokens move one by one; a residual crosses at most once each.
            assert!(back <= Some(moved), "{r}");
            continue;
        }
        assert_eq!(back, Some(moved * 16), "{r}");
        if r["planner"] == "stay" {
            assert_eq!(r["rows_vs_stay"].as_f64(), Some(1.0), "{r}");
        }
    }

    let out = strata_bin()
        .args(["bench", "migrate", "--batch", "4", "--devices", "8"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--devices 8") && err.contains("raise --batch"),
        "{err}"
    );
    let out = strata_bin()
        .args(["bench", "migrate", "--slack=-0.5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--slack"), "{err}");
}

/// `bench attention` measures the plain attention and the engine's, in
/// each vector set this CPU runs, side by side, or one alone with its peak
/// resident memory, and names a variant it does not know.
#[test]
fn bench_attention_compares_the_engine_s_attention_with_the_plain_one() {
    let out = strata_bin()
        .args(["bench", "attention", "--preset", "tiny", "--seq-len", "64"])
        .args(["--steps", "1", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = json_lines(&out.stdout);
    let variants: Vec<&str> = lines
        .iter()
        .map(|l| l["variant"].as_str().unwrap())
        .collect();
    let here = strata::math::vector_isa::VectorIsa::supported_here();
    let rows: Vec<String> = here
        .iter()
        .rev()
        .map(|isa| format!("rows-{}", isa.name()))
        .collect();
    assert_eq!(variants[0], "plain");
    assert_eq!(variants[1..], rows, "the widest vector set first");
    assert_eq!(variants.last(), Some(&"rows-baseline"));
    let saved = |i: usize| lines[i]["saved_bytes"].as_u64().unwrap();
    // The plain one keeps S × S values a head, the engine's two a row.
    assert_eq!(saved(0), saved(1) * 64 / 2);
    let alone = strata_bin()
        .args(["bench", "attention", "--preset", "tiny", "--seq-len", "64"])
        .args(["--steps", "1", "--json", "--variant", "rows"])
        .output()
        .unwrap();
    let lines = json_lines(&alone.stdout);
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["variant"].as_str(), Some(rows[0].as_str()));
    assert!(lines[0]["peak_rss_bytes"].as_u64().unwrap() > 0);
    let bad = strata_bin()
        .args(["bench", "attention", "--variant", "flash"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("one of: plain, rows"));
}

/// `bench kernels` prints the peaks (the tiles' where the CPU has AMX) and
/// each preset's three shapes, f32 and bf16 on the kernel chosen, as JSON
/// lines, and names a preset or a kernel it does not know.
#[test]
fn bench_kernels_times_the_expert_shapes_against_the_peak() {
    let out = strata_bin()
        .args(["bench", "kernels", "--presets", "tiny", "--tokens", "64"])
        .args(["--steps", "1", "--compute-threads", "1", "--json"])
        .args(["--bf16-kernel", "portable"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = json_lines(&out.stdout);
    let whats: Vec<&str> = lines.iter().map(|l| l["what"].as_str().unwrap()).collect();
    let shapes = ["gemm", "ffn_forward", "ffn_backward"];
    let bf16 = shapes.map(|s| format!("{s}_bf16"));
    let amx = strata::backend::Bf16Kernel::Amx.supported();
    let peaks = ["fma_peak", "bf16_peak", "amx_peak"];
    let peaks = &peaks[..if amx { 3 } else { 2 }];
    let expected: Vec<&str> = peaks
        .iter()
        .copied()
        .chain(shapes)
        .chain(bf16.iter().map(String::as_str))
        .collect();
    assert_eq!(whats, expected);
    assert!(lines.iter().all(|l| l["threads"] == 1));
    let (f32_lines, bf16_lines) = lines[peaks.len()..].split_at(3);
    assert!(f32_lines.iter().all(|l| l["kernel"].is_null()));
    assert!(bf16_lines.iter().all(|l| l["kernel"] == "portable"));
    assert!(lines[peaks.len()..]
        .iter()
        .all(|l| l["gflop_per_s"].as_f64().unwrap() > 0.0));
    let unknown = strata_bin()
        .args(["bench", "kernels", "--bf16-kernel", "avx2", "--steps", "1"])
        .output()
        .unwrap();
    assert!(!unknown.status.success());
    let err = String::from_utf8_lossy(&unknown.stderr);
    assert!(err.contains("avx512-fma, avx2-fma or portable"), "{err}");
    let bad = strata_bin()
        .args(["bench", "kernels", "--presets", "huge", "--steps", "1"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("huge"));
}
