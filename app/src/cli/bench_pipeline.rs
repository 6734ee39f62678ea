//! `strata bench pipeline`'s checks, run and table.

use std::io::Write;

use super::bench::write_json_lines;
use super::bench_args::PipelineArgs;
use super::CliError;
use crate::bench;
use crate::bench::pipeline::{Measured, Transport};

pub(super) fn pipeline(args: PipelineArgs) -> Result<(), CliError> {
    let links = args
        .links
        .iter()
        .map(|l| match l.as_str() {
            "none" => Ok(None),
            r => r.parse::<f64>().map(Some).map_err(|_| {
                format!("--links {r:?}: give rates in GB/s, or none (the transport as it is)")
            }),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if args.devices < 2 && !args.mpi {
        return Err("--devices: the exchange needs 2 devices or more"
            .to_string()
            .into());
    }
    if args.batch < args.devices || args.seq_len == 0 || args.rounds == 0 {
        return Err(format!(
            "--batch {} --seq-len {} --rounds {}: give at least a sequence a device, a token \
             a sequence and a round",
            args.batch, args.seq_len, args.rounds
        )
        .into());
    }
    let positive = |x: f64| x.is_finite() && x > 0.0;
    if args.project_devices.contains(&0)
        || args.project_experts == 0
        || args.project_top_k == 0
        || !positive(args.project_tflops)
        || !args.project_links.iter().all(|&r| positive(r))
    {
        return Err(
            "--project-*: give device counts, experts, top-k, TFLOP/s and links \
                    above 0"
                .to_string()
                .into(),
        );
    }
    if args.parts.is_empty() || args.parts.contains(&0) {
        return Err("--parts: give part counts of 1 or more (1,2,4,8)"
            .to_string()
            .into());
    }
    let cfg = bench::pipeline::PipelineBench {
        preset: args.preset.clone(),
        experts: Some(args.experts),
        devices: args.devices,
        batch: args.batch,
        seq_len: args.seq_len,
        links_gb_per_s: links,
        latency_us: args.latency_us,
        parts: args.parts.clone(),
        warmup: args.warmup,
        rounds: args.rounds,
    };
    let Some((rows, choices)) = measure(&cfg, args.mpi)? else {
        return Ok(()); // a rank other than 0: rank 0 reports
    };
    let projection = bench::pipeline::project(&bench::pipeline::Projection {
        d_model: args.project_d_model,
        d_ff: args.project_d_ff,
        experts: args.project_experts,
        top_k: args.project_top_k,
        tokens_per_device: args.project_tokens,
        tflops: args.project_tflops,
        devices: args.project_devices,
        links_gb_per_s: args.project_links,
        latency_us: args.project_latency_us,
        value_bytes: 4,
    });
    if args.json {
        write_json_lines(&rows)?;
        write_json_lines(&choices)?;
        return write_json_lines(&projection);
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:>8} {:>5} {:>6} {:>11} {:>9} {:>7} {:>8} {:>9} {:>9}",
        "GB/s", "arm", "parts", "exchange_s", "model_s", "model/", "step_s", "fit_us", "fit_GB/s"
    )?;
    let rate = |l: Option<f64>| l.map_or("none".to_string(), |r| r.to_string());
    let link = |l: Option<f64>| l.map_or("no modeled link".to_string(), |r| format!("{r} GB/s"));
    for r in &rows {
        writeln!(
            out,
            "{:>8} {:>5} {:>6.2} {:>11.4} {:>9.4} {:>7.3} {:>8.3} {:>9.1} {:>9.2}",
            rate(r.link_gb_per_s),
            r.arm,
            r.mean_parts,
            r.exchange_s,
            r.model_s,
            r.model_over_measured,
            r.step_s,
            r.fit_fixed_us,
            r.fit_gb_per_s
        )?;
    }
    for c in &choices {
        writeln!(
            out,
            "{}: best fixed {} parts ({:.4} s); auto {:.4} s with {:.2} parts on \
             average, {:.3}x the best",
            link(c.link_gb_per_s),
            c.best_arm,
            c.best_exchange_s,
            c.auto_exchange_s,
            c.auto_mean_parts,
            c.auto_over_best
        )?;
    }
    writeln!(
        out,
        "\nprojected ({} experts, top-{}, d_model {}, d_ff {}, {} tokens a device, {} TFLOP/s):",
        args.project_experts,
        args.project_top_k,
        args.project_d_model,
        args.project_d_ff,
        args.project_tokens,
        args.project_tflops
    )?;
    writeln!(
        out,
        "{:>7} {:>6} {:<8} {:>9} {:>10} {:>10} {:>5} {:>8}",
        "devices", "GB/s", "pass", "wire_ms", "compute_ms", "one_ms", "best", "best/one"
    )?;
    for p in &projection {
        writeln!(
            out,
            "{:>7} {:>6} {:<8} {:>9.3} {:>10.3} {:>10.3} {:>5} {:>8.3}",
            p.devices,
            p.link_gb_per_s,
            p.pass,
            1e3 * p.wire_s,
            1e3 * p.compute_s,
            1e3 * p.times_s[0],
            p.best_parts,
            p.best_over_one
        )?;
    }
    Ok(())
}

/// The arms' measurements: devices in this process, or (`mpi`) this
/// process's rank of an MPI job; `None` on a rank other than 0.
fn measure(cfg: &bench::pipeline::PipelineBench, mpi: bool) -> Result<Option<Measured>, CliError> {
    if !mpi {
        eprintln!(
            "{} with {} experts a layer on {} devices, {} × {} tokens a step…",
            cfg.preset,
            cfg.experts.unwrap_or(0),
            cfg.devices,
            cfg.batch,
            cfg.seq_len
        );
        let say = |line: &str| eprintln!("# {line}");
        return Ok(Some(bench::pipeline::run(cfg, Transport::InProcess, say)?));
    }
    measure_ranks(cfg)
}

#[cfg(feature = "mpi")]
fn measure_ranks(cfg: &bench::pipeline::PipelineBench) -> Result<Option<Measured>, CliError> {
    use strata::comm::{Comm, MpiComm};
    let (mut comm, world) = MpiComm::init().map_err(|e| e.to_string())?;
    let rank = comm.rank();
    let mut endpoint = || -> Result<Box<dyn Comm>, String> {
        comm.second_endpoint()
            .map_err(|e| e.to_string())?
            .ok_or_else(|| {
                "MPI did not grant MPI_THREAD_MULTIPLE, which each arm's own \
                            endpoint needs"
                    .to_string()
            })
    };
    let say = |line: &str| {
        if rank == 0 {
            eprintln!("# {line}");
        }
    };
    let measured = bench::pipeline::run(cfg, Transport::Ranks(&mut endpoint), say);
    match measured {
        Ok(measured) => {
            world.finish();
            Ok((rank == 0).then_some(measured))
        }
        Err(e) => {
            eprintln!("strata: error: rank {rank}: {e}");
            drop(world); // MPI_Abort: every rank stops
            Err(e.into())
        }
    }
}

#[cfg(not(feature = "mpi"))]
fn measure_ranks(_: &bench::pipeline::PipelineBench) -> Result<Option<Measured>, CliError> {
    Err(
        "--mpi runs the arms as MPI ranks: build strata with --features mpi and start it \
         with mpirun -n N"
            .to_string()
            .into(),
    )
}
