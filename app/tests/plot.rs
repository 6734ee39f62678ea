//! `strata plot` on a run directory (a fixture of 59 steps of the main
//! job and one held-out evaluation): a PNG and an SVG of the asked size
//! with something drawn in them, a run in progress (its last line torn),
//! and refusals that name the fix.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/plot-run")
}

fn plot(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("plot")
        .args(args)
        .output()
        .expect("strata runs")
}

fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn a_png_of_the_asked_size_shows_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("run.png");
    let run = fixture();
    let args = [run.to_str().unwrap(), "--out", png.to_str().unwrap()];
    let stdout = ok(&plot(
        &[&args[..], &["--width", "900", "--height", "600"]].concat(),
    ));
    assert!(
        stdout.contains("59 steps, 1 held-out evaluations"),
        "{stdout}"
    );
    let image = image::open(&png).unwrap().to_rgb8();
    assert_eq!(image.dimensions(), (900, 600));
    // Lines, text and filled stalls: far from a blank page, and in the
    // colours of the training loss (blue) and the held-out point (red).
    let drawn = image.pixels().filter(|p| p.0 != [255, 255, 255]).count();
    assert!(drawn > 900 * 600 / 20, "{drawn} pixels drawn");
    let near = |c: [u8; 3]| {
        image
            .pixels()
            .filter(|p| p.0.iter().zip(c).all(|(&a, b)| a.abs_diff(b) < 40))
            .count()
    };
    assert!(near([31, 119, 180]) > 500, "the loss line");
    assert!(near([214, 39, 40]) > 10, "the held-out point");
}

#[test]
fn an_svg_of_the_asked_size_names_the_run_and_its_panels() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("run.svg");
    let run = fixture();
    let args = [run.to_str().unwrap(), "--out", svg.to_str().unwrap()];
    ok(&plot(
        &[&args[..], &["--width", "1000", "--height", "700"]].concat(),
    ));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.contains(r#"width="1000" height="700""#),
        "{}",
        &text[..200]
    );
    for label in [
        "plot-run",
        "Loss",
        ">\ntokens\n</text>", // the loss panel's top axis
        "Throughput",
        "Learning rate",
        "preset tiny",
        "16 × 64",
        "host 4 GiB",
    ] {
        assert!(text.contains(label), "{label}");
    }
    assert!(text.matches("<polyline").count() >= 3, "the lines");
}

#[test]
fn a_run_in_progress_plots_its_whole_steps() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["metrics.jsonl", "run.json"] {
        std::fs::copy(fixture().join(name), dir.path().join(name)).unwrap();
    }
    let metrics = dir.path().join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&metrics).unwrap();
    text.push_str(r#"{"step":60,"loss":2.6,"tok"#); // being written
    std::fs::write(&metrics, text).unwrap();
    let stdout = ok(&plot(&[dir.path().to_str().unwrap()]));
    assert!(stdout.contains("59 steps"), "{stdout}");
    assert!(dir.path().join("plot.png").is_file(), "the default --out");
}

#[test]
fn what_cannot_be_plotted_is_refused_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let refused = |args: &[&str], says: &str| {
        let out = plot(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{stderr}");
    };
    let empty = dir.path().to_str().unwrap();
    refused(&[empty], "--out");
    std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
    refused(&[empty], "no finished step yet");
    let run = fixture();
    let run = run.to_str().unwrap();
    refused(
        &[run, "--out", "/tmp/figure.jpg"],
        "end --out in .png or .svg",
    );
    refused(&[run, "--width", "10"], "--width 320–8000");
}

/// A step's timeline (a Chrome trace as `--timeline-step` writes it) is
/// drawn too, beside the trace by default.
#[test]
fn a_timeline_trace_is_drawn_as_a_figure() {
    use std::time::Duration;
    use strata_tiers::TimelineEvent;
    let event = |category, thread: &str, start_ms, ms| TimelineEvent {
        category,
        name: category.into(),
        thread: thread.into(),
        start: Duration::from_millis(start_ms),
        duration: Duration::from_millis(ms),
        detail: String::new(),
    };
    let events = [
        event("step", "main", 0, 50),
        event("dense", "main", 0, 20),
        event("experts", "main", 20, 30),
        event("optimizer", "strata-adamw-0", 30, 15),
    ];
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("timeline-step-3.json");
    strata_tiers::timeline::write_chrome_trace_file(&events, &trace).unwrap();
    let stdout = ok(&plot(&[
        trace.to_str().unwrap(),
        "--width",
        "700",
        "--height",
        "400",
    ]));
    assert!(stdout.contains("4 spans on 2 threads"), "{stdout}");
    let image = image::open(dir.path().join("timeline-step-3.png")).unwrap();
    assert_eq!((image.width(), image.height()), (700, 400));
    std::fs::write(&trace, "{\"traceEvents\": 3}").unwrap();
    let out = plot(&[trace.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("no traceEvents"),
        "{stderr}"
    );
}
