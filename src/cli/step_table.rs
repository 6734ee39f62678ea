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
    writeln!(
        out,
        "{:<13} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8} {:>7}",
        "run",
        "step_s",
        "tokens/s",
        "compute",
        "upload",
        "ssd",
        "optim",
        "ssd_busy",
        "ssd_mib",
        "host_hit",
        "dev_hit",
        "dev_gap",
        "steal"
    )?;
    for r in records {
        writeln!(
                out,
                "{:<13} {:>8.3} {:>10.1} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>8} {:>8.3} {:>8.3} {:>8.3} {:>7}",
                r.run,
                r.step_s,
                r.tokens_per_s,
                r.compute_s,
                r.stall_upload_s,
                r.stall_ssd_s,
                r.stall_optimizer_s,
                r.ssd_busy_s,
                (r.bytes_ssd_to_host + r.bytes_host_to_ssd) >> 20,
                r.host_hit_rate,
                r.device_hit_rate,
                r.device_load_gap,
                r.steal_s.map_or("-".to_string(), |s| format!("{s:.3}"))
            )?;
    }
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
        let cores = crate::parallel::machine_cores() as f64;
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
    }
    Ok(())
}
