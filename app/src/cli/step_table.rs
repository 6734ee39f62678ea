//! `strata bench step`'s table: a row per run, the two ratios, what the
//! steal says about them, the ratios by round, and the balanced token count.

use std::io::Write;

use super::CliError;
use crate::bench::step::{StepBenchRecord, StepBenchSummary};

/// Prints the table on stdout.
pub(super) fn print(
    records: &[StepBenchRecord],
    summary: &StepBenchSummary,
) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    runs(&mut out, records)?;
    ratios(&mut out, summary)?;
    ssd_idle(&mut out, records)?;
    host_tier(&mut out, records)?;
    quiet_steps(&mut out, records, summary)?;
    by_round(&mut out, summary)?;
    balance(&mut out, records, summary)?;
    Ok(())
}

/// A row a run: its step, tokens/s, stalls, bytes and hit rates.
fn runs(out: &mut impl Write, records: &[StepBenchRecord]) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<13} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>7}",
        "run",
        "step_s",
        "tokens/s",
        "compute",
        "upload",
        "ssd",
        "optim",
        "ssd_busy",
        "ssd_mib",
        "min_mib",
        "host_hit",
        "dev_hit",
        "dev_gap",
        "steal"
    )?;
    for r in records {
        writeln!(
                out,
                "{:<13} {:>8.3} {:>10.1} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>8} {:>8} {:>8.3} {:>8.3} {:>8.3} {:>7}",
                r.run,
                r.step_s,
                r.tokens_per_s,
                r.compute_s,
                r.stall_upload_s,
                r.stall_ssd_s,
                r.stall_optimizer_s,
                r.ssd_busy_s,
                (r.bytes_ssd_to_host + r.bytes_host_to_ssd) >> 20,
                r.bytes_ssd_min >> 20,
                r.host_hit_rate,
                r.device_hit_rate,
                r.device_load_gap,
                r.steal_s.map_or("-".to_string(), |s| format!("{s:.3}"))
            )?;
    }
    Ok(())
}

/// The two ratios, and whether the device's compute was modeled.
fn ratios(out: &mut impl Write, summary: &StepBenchSummary) -> std::io::Result<()> {
    writeln!(
        out,
        "expert-wise is {:.2}x the naive schedule; its step is {:.2}x max(compute only, I/O only)",
        summary.expert_wise_over_naive, summary.expert_wise_over_bound
    )?;
    if let Some(gflops) = summary.modeled_device_gflop_per_s {
        writeln!(
            out,
            "(expert compute modeled, not computed: a device at {gflops} GFLOP/s, \
             its time slept on the device's thread)"
        )?;
    }
    Ok(())
}

/// Where the SSD sat idle in each phase of a run that records them.
fn ssd_idle(out: &mut impl Write, records: &[StepBenchRecord]) -> std::io::Result<()> {
    let with_phases: Vec<_> = records
        .iter()
        .filter_map(|r| Some((r.run, r.phases?)))
        .filter(|(run, _)| *run != "compute_only")
        .collect();
    if !with_phases.is_empty() {
        writeln!(
            out,
            "SSD idle in the forward / the turn to the backward / the backward, \
             of each phase's time (s):"
        )?;
        for (run, p) in with_phases {
            writeln!(
                out,
                "  {run:<13} {:.3} of {:.3} / {:.3} of {:.3} / {:.3} of {:.3}",
                p.ssd_idle_forward_s,
                p.forward_s,
                p.ssd_idle_turn_s,
                p.turn_s,
                p.ssd_idle_backward_s,
                p.backward_s
            )?;
        }
    }
    Ok(())
}

/// The expert-wise run's host tier: its slots, kept, streaming, cells
/// and held updates.
fn host_tier(out: &mut impl Write, records: &[StepBenchRecord]) -> std::io::Result<()> {
    if let Some(ew) = records.iter().find(|r| r.run == "expert_wise") {
        writeln!(
            out,
            "expert-wise host tier: {} slots, {} keeping a record resident, {} streaming{}; \
             {} updates held for the next forward",
            ew.host_slots,
            ew.host_kept,
            ew.host_slots - ew.host_kept,
            match ew.host_cells {
                0 => String::new(),
                n => format!(
                    ", and {n} compute cells ({:.1} records moved into them a step)",
                    ew.host_demotions
                ),
            },
            ew.deferred_updates
        )?;
    }
    Ok(())
}

/// The ratios over the quiet steps, or, with none, whose steal spoiled
/// them.
fn quiet_steps(
    out: &mut impl Write,
    records: &[StepBenchRecord],
    summary: &StepBenchSummary,
) -> std::io::Result<()> {
    if let (Some(n), Some(b)) = (
        summary.quiet_expert_wise_over_naive,
        summary.quiet_expert_wise_over_bound,
    ) {
        let counts: Vec<String> = records
            .iter()
            .map(|r| format!("{} {}", r.run, r.quiet_steps))
            .collect();
        writeln!(
            out,
            "over quiet steps ({}): {n:.2}x the naive schedule; {b:.2}x the bound",
            counts.join(", ")
        )?;
    } else {
        let cores = strata::machine_cores() as f64;
        let noisy: Vec<String> = records
            .iter()
            .filter(|r| r.quiet_steps == 0)
            .filter_map(|r| {
                let share = r.steal_share(cores)?;
                Some(format!("{} lost {:.0} %", r.run, 100.0 * share))
            })
            .collect();
        // Steal only in the run that overlaps SSD I/O with compute on
        // every core is that run's own I/O, served by the host on the
        // cores behind this machine's (`strata bench overlap`).
        let own_io = records
            .iter()
            .all(|r| r.quiet_steps > 0 || r.run == "expert_wise");
        if !noisy.is_empty() && own_io {
            writeln!(
                out,
                "no quiet steps: the expert-wise run lost CPU to steal ({}) while the \
                     compute-only and I/O-only runs did not; on a virtual machine whose disk \
                     is served on the cores behind its own, that is the cost of overlapping \
                     this run's I/O with its compute (`strata bench overlap` measures it)",
                noisy.join(", ")
            )?;
        } else if !noisy.is_empty() {
            writeln!(
                out,
                "no quiet steps: other tenants of this machine took its CPU ({}); \
                     the ratios above say little, run again when it is quieter",
                noisy.join(", ")
            )?;
        }
    }
    Ok(())
}

/// The ratios round by round, and the cores the cpu backend used.
fn by_round(out: &mut impl Write, summary: &StepBenchSummary) -> std::io::Result<()> {
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    writeln!(
        out,
        "by round ({}): over naive {}; over the bound {}",
        summary.rounds,
        list(&summary.expert_wise_over_naive_by_round),
        list(&summary.expert_wise_over_bound_by_round)
    )?;
    if summary.compute_threads < summary.machine_cores
        && summary.modeled_device_gflop_per_s.is_none()
    {
        writeln!(
            out,
            "the cpu backend computed on {} of the {} cores (--compute-threads; `all` for every \
             core), every run alike",
            summary.compute_threads, summary.machine_cores
        )?;
    }
    Ok(())
}

/// The balanced token count, what the search tried, and whether the
/// disk drifted from it.
fn balance(
    out: &mut impl Write,
    records: &[StepBenchRecord],
    summary: &StepBenchSummary,
) -> std::io::Result<()> {
    if let Some(balance) = &summary.balance {
        let tried: Vec<String> = balance
            .compute_only_s
            .iter()
            .zip(&balance.io_only_at)
            .map(|((tokens, c), (_, io))| format!("{c:.3} / {io:.3} s at {tokens}"))
            .collect();
        writeln!(
            out,
            "{} tokens a step, balanced: I/O only {:.3} s there; compute only / I/O only {}{}",
            summary.tokens,
            balance.io_only_s,
            tried.join(", "),
            balance
                .unbracketed
                .map_or(String::new(), |why| format!(" ({why})"))
        )?;
        let io_only = records.iter().find(|r| r.run == "io_only");
        if let Some(drift) = io_only.and_then(|r| balance_drift(r.step_s, balance.io_only_s)) {
            writeln!(out, "{drift}")?;
        }
    }
    Ok(())
}

/// How far the I/O-only step's time in the rounds may stray from the
/// balance search's before the table says the runs were not balanced.
const BALANCE_DRIFT_MAX: f64 = 1.25;

/// A line when the I/O-only step took much longer (or shorter) in the
/// rounds than where the search balanced it: the disk changed speed
/// between the two, so the runs sat away from the balance, where the
/// schedules differ least.
fn balance_drift(rounds_s: f64, searched_s: f64) -> Option<String> {
    let ratio = rounds_s / searched_s;
    if !ratio.is_finite() || (1.0 / BALANCE_DRIFT_MAX..=BALANCE_DRIFT_MAX).contains(&ratio) {
        return None;
    }
    Some(format!(
        "the I/O-only step took {rounds_s:.3} s in the rounds against {searched_s:.3} s in the \
         balance search ({ratio:.2}x): the disk changed speed, so these runs are {} the \
         balance; run again, or fix --tokens",
        if ratio > 1.0 {
            "I/O-bound, below"
        } else {
            "compute-bound, above"
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::balance_drift;

    #[test]
    fn a_disk_that_changed_speed_after_the_search_is_named() {
        assert_eq!(balance_drift(0.50, 0.48), None);
        assert_eq!(balance_drift(0.40, 0.48), None);
        let slower = balance_drift(0.793, 0.479).unwrap();
        assert!(
            slower.contains("(1.66x)") && slower.contains("I/O-bound"),
            "{slower}"
        );
        let faster = balance_drift(0.30, 0.48).unwrap();
        assert!(faster.contains("compute-bound"), "{faster}");
        assert_eq!(balance_drift(0.5, 0.0), None);
    }
}
