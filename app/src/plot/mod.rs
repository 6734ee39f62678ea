//! `strata plot`: one figure of a run, drawn from what it leaves in its
//! directory — `metrics.jsonl` (a line a step, eval lines) and `run.json`
//! (its options and model) — with the training and held-out loss, tokens
//! a second, the share of each step spent waiting on the SSD, the uploads
//! and the optimizer, and the learning rate, against the step. A run in
//! progress plots as far as it has gone (a line still being written is
//! left out). PNG or SVG, by the output's extension.

mod draw;
mod timeline;

pub use timeline::plot_timelines;

use std::path::{Path, PathBuf};

use serde_json::Value;

/// One training step, as `metrics.jsonl` records it.
#[derive(Clone, Debug, PartialEq)]
pub struct StepPoint {
    pub step: u64,
    pub loss: f64,
    pub tokens: f64,
    pub wall_s: f64,
    pub stall_ssd_s: f64,
    pub stall_upload_s: f64,
    pub stall_optimizer_s: f64,
    pub lr: Option<f64>,
}

/// What a figure shows of one run.
#[derive(Clone, Debug)]
pub struct RunSeries {
    /// The run directory's name.
    pub name: String,
    /// The model, backend, tokens a step and learning rate, on one line.
    pub summary: String,
    pub steps: Vec<StepPoint>,
    /// (step, held-out loss).
    pub evals: Vec<(u64, f64)>,
}

/// Where the figure went and what it holds.
#[derive(Debug)]
pub struct Plotted {
    pub out: PathBuf,
    /// "59 steps, 1 held-out evaluations"; "189 spans on 9 threads".
    pub holds: String,
}

/// Draws `run`'s figure into `out` (`.png` or `.svg`), `size` pixels
/// (width, height); `out` defaults to `RUN/plot.png`. A `run` that is a
/// `.json` file is a step's timeline (`strata train --timeline-step`, or
/// `bench step --timeline`), drawn as `bench step --plot` draws one; its
/// figure defaults to the trace's name with `.png`.
pub fn plot_run(run: &Path, out: Option<&Path>, size: (u32, u32)) -> Result<Plotted, String> {
    let trace = run.is_file() && run.extension().is_some_and(|e| e == "json");
    let out = match out {
        Some(out) => out.to_path_buf(),
        None if trace => run.with_extension("png"),
        None => run.join("plot.png"),
    };
    let format = draw::Format::of(&out)?;
    let (w, h) = size;
    if !(320..=8000).contains(&w) || !(240..=8000).contains(&h) {
        return Err(format!(
            "a figure of {w} × {h} pixels: give --width 320–8000 and --height 240–8000"
        ));
    }
    if trace {
        return plot_trace(run, out, size);
    }
    let series = read_run(run)?;
    draw::figure(&series, &out, format, size)?;
    Ok(Plotted {
        out,
        holds: format!(
            "{} steps, {} held-out evaluations",
            series.steps.len(),
            series.evals.len()
        ),
    })
}

fn plot_trace(path: &Path, out: PathBuf, size: (u32, u32)) -> Result<Plotted, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the timeline {}: {e}", path.display()))?;
    let events = strata_tiers::timeline::read_chrome_trace(&text)
        .map_err(|why| format!("{}: {why}", path.display()))?;
    let name = path
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let title = format!("{name}: one step's timeline");
    plot_timelines(&[(name.as_str(), &events)], &title, &out, size)?;
    let threads: std::collections::BTreeSet<&str> =
        events.iter().map(|e| e.thread.as_str()).collect();
    Ok(Plotted {
        out,
        holds: format!("{} spans on {} threads", events.len(), threads.len()),
    })
}

/// Whether `out` names a figure strata can write (`.png` or `.svg`), so a
/// command can refuse it before its work rather than after.
pub fn check_figure_path(out: &Path) -> Result<(), String> {
    draw::Format::of(out).map(|_| ())
}

/// Reads a run directory's metrics and options.
pub fn read_run(run: &Path) -> Result<RunSeries, String> {
    let metrics = run.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).map_err(|e| {
        format!(
            "cannot read {} ({e}): give the directory a `strata train` or `strata finetune` \
             wrote (its --out)",
            metrics.display()
        )
    })?;
    let (steps, evals) = parse_metrics(&text);
    if steps.is_empty() {
        return Err(format!(
            "{} has no finished step yet: plot the run once it has trained a step",
            metrics.display()
        ));
    }
    let name = run
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| run.display().to_string());
    let options = std::fs::read_to_string(run.join("run.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok());
    let summary = options
        .as_ref()
        .map(|o| summarize(o, &steps))
        .unwrap_or_else(|| format!("{} tokens a step (no run.json)", steps[0].tokens));
    Ok(RunSeries {
        name,
        summary,
        steps,
        evals,
    })
}

/// The step and eval lines of a `metrics.jsonl`; lines that are not
/// whole JSON objects (the one a running trainer is writing) are skipped,
/// and a step that appears twice keeps its last line.
pub fn parse_metrics(text: &str) -> (Vec<StepPoint>, Vec<(u64, f64)>) {
    let (mut steps, mut evals) = (Vec::new(), Vec::new());
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let Some(step) = v.get("step").and_then(Value::as_u64) else {
            continue;
        };
        let num = |k: &str| v.get(k).and_then(Value::as_f64);
        if let Some(loss) = num("eval_loss") {
            evals.push((step, loss));
        } else if let (Some(loss), Some(tokens), Some(wall_s)) =
            (num("loss"), num("tokens"), num("wall_s"))
        {
            steps.push(StepPoint {
                step,
                loss,
                tokens,
                wall_s,
                stall_ssd_s: num("stall_ssd_s").unwrap_or(0.0),
                stall_upload_s: num("stall_upload_s").unwrap_or(0.0),
                stall_optimizer_s: num("stall_optimizer_s").unwrap_or(0.0),
                lr: num("lr"),
            });
        }
    }
    steps.sort_by_key(|p| p.step); // stable: a step's lines keep their order
    steps.dedup_by(|later, kept| {
        let same = later.step == kept.step;
        if same {
            std::mem::swap(later, kept);
        }
        same
    });
    evals.sort_by_key(|e| e.0);
    evals.dedup_by_key(|e| e.0);
    (steps, evals)
}

/// 8 MiB, 4 GiB.
fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64),
        b => format!("{:.3} MiB", b as f64 / (1u64 << 20) as f64),
    }
    .replace(".000", "")
}

/// "mixtral, 2 layers × 8 experts (top-2) · cpu · 16 × 64 tokens a step ·
/// lr 0.003 · host 4 GiB · device 1 GiB · preset tiny".
fn summarize(run: &Value, steps: &[StepPoint]) -> String {
    let o = &run["options"];
    let model: Value = run["model"]
        .as_str()
        .and_then(|m| serde_json::from_str(m).ok())
        .unwrap_or(Value::Null);
    let int = |v: &Value, k: &str| v.get(k).and_then(Value::as_u64);
    let experts = int(&model, "num_local_experts").or(int(&model, "num_experts"));
    let mut parts = Vec::new();
    if let (Some(kind), Some(layers), Some(experts), Some(k)) = (
        model.get("model_type").and_then(Value::as_str),
        int(&model, "num_hidden_layers"),
        experts,
        int(&model, "num_experts_per_tok"),
    ) {
        parts.push(format!(
            "{kind}, {layers} layers × {experts} experts (top-{k})"
        ));
    }
    if let Some(backend) = o.get("backend").and_then(Value::as_str) {
        parts.push(backend.to_string());
    }
    match (int(o, "batch"), int(o, "seq_len")) {
        (Some(b), Some(s)) => parts.push(format!("{b} × {s} tokens a step")),
        _ => parts.push(format!("{} tokens a step", steps[0].tokens)),
    }
    if let Some(lr) = o.get("lr").and_then(Value::as_f64) {
        parts.push(format!("lr {lr}"));
    }
    if let (Some(host), Some(device)) = (int(o, "host_mem"), int(o, "device_mem")) {
        parts.push(format!("host {} · device {}", bytes(host), bytes(device)));
    }
    match &run["source"] {
        Value::String(s) if s == "Scratch" => {
            if let Some(p) = o.get("preset").and_then(Value::as_str) {
                parts.push(format!("preset {p}"));
            }
        }
        Value::Object(m) => {
            if let Some(path) = m.get("Finetune").and_then(Value::as_str) {
                parts.push(format!("fine-tune of {path}"));
            }
        }
        _ => {}
    }
    parts.join(" · ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torn_last_line_and_a_repeated_step_are_read_as_a_resume_leaves_them() {
        let text = concat!(
            r#"{"step":1,"loss":5.0,"tokens":64,"wall_s":0.5,"stall_ssd_s":0.25,"lr":0.001}"#,
            "\n",
            r#"{"step":2,"loss":4.0,"tokens":64,"wall_s":0.5}"#,
            "\n",
            r#"{"step":2,"eval_loss":4.5}"#,
            "\n",
            r#"{"step":2,"checkpoint":true}"#,
            "\n",
            r#"{"step":2,"loss":3.5,"tokens":64,"wall_s":0.4}"#,
            "\n",
            r#"{"step":3,"loss":3.0,"tok"#,
        );
        let (steps, evals) = parse_metrics(text);
        assert_eq!(steps.len(), 2);
        assert_eq!((steps[0].stall_ssd_s, steps[0].lr), (0.25, Some(0.001)));
        assert_eq!((steps[1].step, steps[1].loss), (2, 3.5), "the later line");
        assert_eq!(evals, vec![(2, 4.5)]);
    }
}
