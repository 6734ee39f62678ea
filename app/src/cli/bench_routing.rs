//! `strata bench affinity`, `strata bench condense` and `strata bench
//! migrate`: what crosses between devices as tokens go from layer to layer
//! (the experts placed for inter-layer affinity, near-duplicate tokens
//! condensed, sequences rebuilt where their experts ran), as tables or
//! JSON lines.

use std::io::Write;

use super::bench::write_json_lines;
use super::bench_args::{AffinityArgs, CondenseArgs, MigrateArgs};
use super::CliError;
use crate::bench;

pub(super) fn condense(args: CondenseArgs) -> Result<(), CliError> {
    if args.devices.contains(&0) || args.batch == 0 || args.seq_len == 0 {
        return Err("--devices, --batch and --seq-len must be at least 1"
            .to_string()
            .into());
    }
    if let Some(&n) = args.devices.iter().find(|&&n| n > args.batch) {
        return Err(format!(
            "--devices {n}: the captured batch has {} sequences to split; raise --batch",
            args.batch
        )
        .into());
    }
    eprintln!(
        "training {} for {} steps on the built-in text, then condensing one batch…",
        args.preset, args.train_steps
    );
    let (shares, links) = bench::condense::run(&bench::condense::CondenseBench {
        capture: bench::captured::CaptureSpec {
            preset: args.preset,
            train_steps: args.train_steps,
            seq_len: args.seq_len,
            batch: args.batch,
        },
        devices: args.devices,
        link_gb_per_s: args.link_gb_per_s,
        reps: args.reps,
    })?;
    if args.json {
        write_json_lines(&shares)?;
        return write_json_lines(&links);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:>7} {:>5} {:<16} {:<9} {:>6} {:>9} {:>6} {:>7} {:>9}",
        "devices",
        "layer",
        "threshold",
        "search",
        "rows",
        "condensed",
        "share",
        "missed",
        "search ms"
    )?;
    for r in &shares {
        writeln!(
            out,
            "{:>7} {:>5} {:<16} {:<9} {:>6} {:>9} {:>6.3} {:>7} {:>9.3}",
            r.devices,
            r.layer,
            format!("{} ({:.3})", r.threshold, r.threshold_value),
            r.search,
            r.rows,
            r.condensed,
            r.share,
            r.missed_vs_exact.map_or("-".into(), |m| m.to_string()),
            r.search_s * 1e3
        )?;
    }
    writeln!(
        out,
        "\n{:>7} {:<9} {:>13} {:>12} {:>12} {:>14}",
        "devices", "threshold", "rows crossing", "MiB crossing", "expert GFLOP", "modeled step s"
    )?;
    for r in &links {
        writeln!(
            out,
            "{:>7} {:<9} {:>13} {:>12.2} {:>12.3} {:>14.4}",
            r.devices,
            r.threshold,
            r.rows_crossing,
            r.bytes_crossing as f64 / (1 << 20) as f64,
            r.expert_flops / 1e9,
            r.modeled_step_s
        )?;
    }
    Ok(())
}

pub(super) fn migrate(args: MigrateArgs) -> Result<(), CliError> {
    let link = args.link_gb_per_s;
    if args.batch == 0 || args.seq_len == 0 || args.slack.is_nan() || args.slack < 0.0 {
        return Err(
            "--batch and --seq-len must be at least 1, --slack at least 0"
                .to_string()
                .into(),
        );
    }
    if link.is_nan() || link <= 0.0 {
        return Err(format!("--link-gb-per-s {link}: give a rate above 0").into());
    }
    if let Some(&n) = args.devices.iter().find(|&&n| n == 0 || n > args.batch) {
        return Err(format!(
            "--devices {n}: the captured batch has {} sequences to split over 1 to {0} devices; \
             raise --batch",
            args.batch
        )
        .into());
    }
    eprintln!(
        "training {} for {} steps on the built-in text, then following one batch's sequences…",
        args.preset, args.train_steps
    );
    let rows = bench::migrate::run(&bench::migrate::MigrateBench {
        capture: bench::captured::CaptureSpec {
            preset: args.preset,
            train_steps: args.train_steps,
            seq_len: args.seq_len,
            batch: args.batch,
        },
        devices: args.devices,
        slack: args.slack,
        reps: args.reps,
        link_gb_per_s: args.link_gb_per_s,
    })?;
    if args.json {
        return write_json_lines(&rows);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:>7} {:<11} {:<14} {:>9} {:>8} {:>13} {:>7} {:>8} {:>8} {:>6} {:>6} {:>9} {:>9}",
        "devices",
        "placement",
        "planner",
        "dispatch",
        "combine",
        "residual f+b",
        "kv",
        "÷ stay",
        "combine÷",
        "moved",
        "attn",
        "plan ms",
        "link ms"
    )?;
    for r in &rows {
        let planner = match r.candidates {
            0 => r.planner.to_string(),
            q => format!("{} q={q}", r.planner),
        };
        writeln!(
            out,
            "{:>7} {:<11} {:<14} {:>9} {:>8} {:>13} {:>7} {:>8.3} {:>8.3} {:>6} {:>6.3} {:>9.3} {:>9.3}",
            r.devices,
            r.placement,
            planner,
            r.dispatch_rows,
            r.combine_rows,
            format!("{}+{}", r.residual_rows, r.residual_grad_rows),
            r.kv_rows,
            r.rows_vs_stay,
            r.combine_vs_stay,
            r.moved,
            r.attention_max_over_mean,
            r.plan_s * 1e3,
            r.link_s * 1e3
        )?;
    }
    Ok(())
}

/// A routing trace file, or why it is not one.
fn read_trace(path: &std::path::Path) -> Result<strata::engine::RoutingTrace, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| {
        format!(
            "{}: not a routing trace (`strata train --trace-routing` writes one): {e}",
            path.display()
        )
    })
}

pub(super) fn affinity(args: AffinityArgs) -> Result<(), CliError> {
    if let Some(n) = args
        .nodes
        .filter(|&n| n == 0 || args.devices.iter().any(|d| d % n != 0))
    {
        return Err(
            format!("--nodes {n}: give a node count that divides every --devices count").into(),
        );
    }
    let rows = match &args.trace {
        Some(path) => {
            let trace = read_trace(path)?;
            let source = path.display().to_string();
            let slack = args.load_slack;
            bench::affinity::on_trace(&source, &trace, &args.devices, slack, args.nodes)?
        }
        None => bench::affinity::synthetic(args.load_slack)?,
    };
    let drift = match (&args.trace, &args.later) {
        (Some(earlier), Some(later)) => bench::affinity::drift(
            &read_trace(earlier)?,
            &read_trace(later)?,
            &args.devices,
            args.load_slack,
            (args.row_bytes, args.record_bytes, args.horizon),
        )?,
        _ => Vec::new(),
    };
    if args.json {
        write_json_lines(&rows)?;
        return write_json_lines(&drift);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:<18} {:>6} {:>7} {:>7} {:<9} {:>12} {:>8} {:>6} {:>9}",
        "source",
        "layers",
        "experts",
        "devices",
        "policy",
        "transitions",
        "staying",
        "node",
        "seconds"
    )?;
    for r in &rows {
        let source = std::path::Path::new(&r.source)
            .file_name()
            .map_or(r.source.clone(), |n| n.to_string_lossy().into_owned());
        writeln!(
            out,
            "{:<18} {:>6} {:>7} {:>7} {:<9} {:>12} {:>8.3} {:>6} {:>9.3}",
            source,
            r.layers,
            r.experts,
            r.devices,
            r.policy,
            r.transitions,
            r.staying_share,
            r.node_share.map_or("-".into(), |s| format!("{s:.3}")),
            r.seconds
        )?;
    }
    for r in &drift {
        writeln!(
            out,
            "{} devices, steps {}+{}: pairs kept a step {:.0} by the earlier placement, {:.0} \
             placed afresh, moving {} experts: {}",
            r.devices,
            r.steps_before,
            r.steps_after,
            r.kept_a_step_now,
            r.kept_a_step_fresh,
            r.experts_moved,
            if r.replaced {
                format!("pays within {} steps, re-placed", r.horizon_steps)
            } else {
                format!("does not pay within {} steps, kept", r.horizon_steps)
            }
        )?;
    }
    Ok(())
}
