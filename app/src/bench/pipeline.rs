//! `strata bench pipeline`: each MoE layer's exchange in n parts (MPMoE's
//! pipelined all-to-all, `--pipeline N`) against one, over modeled links,
//! and what `--pipeline auto`'s cost model predicted and chose.
//!
//! Per link, one engine per arm (1, 2, 4 and 8 parts, and `auto`), each
//! on its devices in this process, all training the same preset from the
//! same start on the same batches: the arms train the same bits, so every
//! arm sees the same routing at every step. Every engine fits its link
//! before its first step (`Engine::calibrate_exchange`), so each step
//! reports the model's prediction for the parts it ran (`exchange_model_s`)
//! beside the time its MoE layers' exchanges took, the experts' compute
//! inside (`exchange_s`). A round steps every arm once, in an order that
//! rotates. The first rounds are not counted: at least `warmup` (the first
//! step measures the experts' time per row, which the model's compute term
//! needs), and as many as `auto`'s search takes to settle, so that its
//! counted steps run the parts it chose.
//!
//! Then the model alone, projected to machines this one is not
//! ([`project`]): a layer of a given shape routed uniformly over 8 and 64
//! devices, its experts at a given FLOP rate, over given links.

use serde::Serialize;
use strata::comm::{Comm, Link};
use strata::engine::{
    project_exchange, Engine, EngineConfig, ExchangeParts, LinkFit, StepMetrics, UniformLayer,
};
use strata::lm::data::{Corpus, DataConfig, Dataset, Tokenizer};
use strata::lm::{LmConfig, MoeLm};
use strata::model::Network;

use super::median;

/// What to train, over which links.
#[derive(Clone, Debug)]
pub struct PipelineBench {
    pub preset: String,
    /// Experts a layer (the preset's if `None`); a layer splits into at
    /// most as many parts as a device has experts.
    pub experts: Option<usize>,
    pub devices: usize,
    pub batch: usize,
    pub seq_len: usize,
    /// Modeled links, GB/s each way (`None`: the transport as it is).
    pub links_gb_per_s: Vec<Option<f64>>,
    pub latency_us: f64,
    /// Fixed part counts to run beside `auto`.
    pub parts: Vec<usize>,
    pub warmup: usize,
    pub rounds: usize,
}

/// The bound on uncounted rounds while `auto` searches: one uncounted
/// step and two of each count up to 8 take 17.
const MOST_WARMUP: usize = 40;

/// One arm over one link: medians over the counted steps.
#[derive(Clone, Debug, Serialize)]
pub struct PipelineRow {
    pub bench: &'static str,
    pub preset: String,
    pub devices: usize,
    pub experts: usize,
    pub tokens: usize,
    /// `in-process` (devices of one process) or `mpi` (ranks).
    pub transport: &'static str,
    /// The modeled link (null: none, the transport as it is).
    pub link_gb_per_s: Option<f64>,
    pub latency_us: f64,
    /// `1`, `2`, … or `auto`.
    pub arm: String,
    pub steps: usize,
    /// The MoE layers' exchanges a step, compute inside.
    pub exchange_s: f64,
    /// What the cost model predicted for them.
    pub model_s: f64,
    /// Median of each step's prediction over its measurement.
    pub model_over_measured: f64,
    pub step_s: f64,
    /// Of the exchanges' time: the experts' GEMMs (the most of any
    /// device) and the collectives (their mean over the devices).
    pub expert_compute_s: f64,
    pub comm_s: f64,
    /// Parts a layer and pass, on average (from the token exchanges).
    pub mean_parts: f64,
    /// The link as this arm's engine fitted it.
    pub fit_fixed_us: f64,
    pub fit_gb_per_s: f64,
    /// `auto`: [layer][forward, backward] the counts its search settled on.
    pub settled: Option<Vec<[usize; 2]>>,
}

/// Over one link: the fastest fixed arm, and `auto` against it.
#[derive(Clone, Debug, Serialize)]
pub struct PipelineChoice {
    pub bench: &'static str,
    pub link_gb_per_s: Option<f64>,
    pub best_arm: String,
    pub best_exchange_s: f64,
    pub auto_exchange_s: f64,
    /// `auto`'s exchange time over the best fixed arm's (1.05: 5 % slower).
    pub auto_over_best: f64,
    pub auto_mean_parts: f64,
}

/// Where the arms' engines exchange: devices in this process, or ranks,
/// each arm's engine joining them through an endpoint of its own.
pub enum Transport<'a> {
    InProcess,
    Ranks(&'a mut dyn FnMut() -> Result<Box<dyn Comm>, String>),
}

/// Every arm's row, and each link's choice.
pub type Measured = (Vec<PipelineRow>, Vec<PipelineChoice>);

/// Runs every link's arms; `say` hears progress.
pub fn run(
    cfg: &PipelineBench,
    mut transport: Transport<'_>,
    mut say: impl FnMut(&str),
) -> Result<Measured, String> {
    let lm = model(cfg)?;
    let (mut rows, mut choices) = (Vec::new(), Vec::new());
    for &rate in &cfg.links_gb_per_s {
        let link = rate.map(|r| Link::new(r, cfg.latency_us)).transpose()?;
        let arms: Vec<ExchangeParts> = cfg
            .parts
            .iter()
            .map(|&n| ExchangeParts::Fixed(n))
            .chain([ExchangeParts::Auto])
            .collect();
        let mut engines = Vec::with_capacity(arms.len());
        for &parts in &arms {
            let config = EngineConfig {
                devices: cfg.devices,
                link,
                exchange_parts: parts,
                ..EngineConfig::default()
            };
            let mut engine = match &mut transport {
                Transport::InProcess => {
                    Engine::new_network(&lm, config).map_err(|e| e.to_string())?
                }
                Transport::Ranks(endpoint) => {
                    let comm = endpoint()?;
                    let config = EngineConfig {
                        devices: 1,
                        ranks: comm.size(),
                        ..config
                    };
                    let mut engine = Engine::new_network(&lm, config).map_err(|e| e.to_string())?;
                    engine.join_ranks(comm).map_err(|e| e.to_string())?;
                    engine
                }
            };
            let fit = engine
                .calibrate_exchange()
                .map_err(|e| e.to_string())?
                .ok_or("one device exchanges nothing: give --devices 2 or more")?;
            engines.push((engine, fit, Vec::<StepMetrics>::new()));
        }
        let what = match rate {
            Some(r) => format!("{r} GB/s"),
            None => "no modeled link".into(),
        };
        let mut data = dataset(cfg)?;
        let (mut round, mut counted) = (0, 0);
        while counted < cfg.rounds {
            let searching = engines.iter().any(|(e, _, _)| {
                e.config().exchange_parts == ExchangeParts::Auto && e.auto_parts().is_none()
            });
            let counts = round >= cfg.warmup && (!searching || round >= MOST_WARMUP);
            let batch = data.next_batch().map_err(|e| e.to_string())?;
            for i in 0..engines.len() {
                let (engine, _, steps) = &mut engines[(i + round) % arms.len()];
                let m = engine
                    .step_network(&lm, &batch)
                    .map_err(|e| e.to_string())?;
                if counts {
                    steps.push(m);
                }
            }
            round += 1;
            counted += usize::from(counts);
            say(&format!(
                "{what}: round {round}, {counted} of {} counted",
                cfg.rounds
            ));
        }
        let link_rows: Vec<PipelineRow> = arms
            .iter()
            .zip(&engines)
            .map(|(parts, (engine, fit, steps))| {
                let mut r = row(cfg, &lm, rate, *parts, fit, steps);
                r.settled = engine.auto_parts();
                if let Some((_, ranks)) = engine.rank() {
                    (r.transport, r.devices) = ("mpi", ranks);
                }
                r
            })
            .collect();
        choices.extend(choice(rate, &link_rows));
        rows.extend(link_rows);
    }
    Ok((rows, choices))
}

fn model(cfg: &PipelineBench) -> Result<MoeLm, String> {
    let mut config = LmConfig::preset(&cfg.preset).map_err(|e| e.to_string())?;
    config.vocab = Tokenizer::Bytes.vocab_size();
    config.max_seq = config.max_seq.max(cfg.seq_len);
    if let Some(experts) = cfg.experts {
        config.experts = experts;
    }
    MoeLm::new(config).map_err(|e| e.to_string())
}

fn dataset(cfg: &PipelineBench) -> Result<Dataset, String> {
    Dataset::open(
        DataConfig {
            corpus: Corpus::Builtin { documents: 200_000 },
            seq_len: cfg.seq_len,
            batch_seqs: cfg.batch,
            ..DataConfig::default()
        },
        Tokenizer::Bytes,
    )
    .map_err(|e| e.to_string())
}

fn row(
    cfg: &PipelineBench,
    lm: &MoeLm,
    rate: Option<f64>,
    parts: ExchangeParts,
    fit: &LinkFit,
    steps: &[StepMetrics],
) -> PipelineRow {
    let of = |f: fn(&StepMetrics) -> f64| median(steps.iter().map(f).collect());
    let exchanges_one = 4.0 * lm.moe().layers as f64;
    PipelineRow {
        bench: "pipeline",
        preset: cfg.preset.clone(),
        devices: cfg.devices,
        experts: lm.moe().experts,
        tokens: cfg.batch * cfg.seq_len,
        transport: "in-process",
        link_gb_per_s: rate,
        latency_us: cfg.latency_us,
        arm: match parts {
            ExchangeParts::Fixed(n) => n.to_string(),
            ExchangeParts::Auto => "auto".into(),
        },
        steps: steps.len(),
        exchange_s: of(|m| m.exchange_s),
        model_s: of(|m| m.exchange_model_s),
        model_over_measured: of(|m| m.exchange_model_s / m.exchange_s),
        step_s: of(|m| m.wall_s),
        expert_compute_s: of(|m| {
            m.expert_compute_s_per_device
                .iter()
                .cloned()
                .fold(0.0, f64::max)
        }),
        comm_s: of(|m| m.comm_s),
        mean_parts: steps
            .iter()
            .map(|m| m.token_exchanges as f64 / exchanges_one)
            .sum::<f64>()
            / steps.len() as f64,
        fit_fixed_us: fit.fixed_s * 1e6,
        fit_gb_per_s: if fit.s_per_byte > 0.0 {
            1e-9 / fit.s_per_byte
        } else {
            f64::INFINITY
        },
        settled: None,
    }
}

/// The fastest fixed arm over a link, and `auto` against it.
fn choice(rate: Option<f64>, rows: &[PipelineRow]) -> Option<PipelineChoice> {
    let auto = rows.iter().find(|r| r.arm == "auto")?;
    let best = rows
        .iter()
        .filter(|r| r.arm != "auto")
        .min_by(|a, b| a.exchange_s.total_cmp(&b.exchange_s))?;
    Some(PipelineChoice {
        bench: "pipeline_choice",
        link_gb_per_s: rate,
        best_arm: best.arm.clone(),
        best_exchange_s: best.exchange_s,
        auto_exchange_s: auto.exchange_s,
        auto_over_best: auto.exchange_s / best.exchange_s,
        auto_mean_parts: auto.mean_parts,
    })
}

/// A layer of another machine to project the model onto.
#[derive(Clone, Debug)]
pub struct Projection {
    pub d_model: usize,
    /// An expert's hidden width (SwiGLU: three projections).
    pub d_ff: usize,
    pub experts: usize,
    pub top_k: usize,
    /// Tokens each device routes a step, spread evenly over the experts.
    pub tokens_per_device: usize,
    /// The experts' GEMM rate on that machine, TFLOP/s.
    pub tflops: f64,
    pub devices: Vec<usize>,
    pub links_gb_per_s: Vec<f64>,
    pub latency_us: f64,
    /// Bytes of a row on the wire (strata's exchange sends f32 rows: 4
    /// a value).
    pub value_bytes: u64,
}

/// The model's times for one projected layer and pass.
#[derive(Clone, Debug, Serialize)]
pub struct ProjectionRow {
    pub bench: &'static str,
    pub devices: usize,
    pub link_gb_per_s: f64,
    pub latency_us: f64,
    pub experts: usize,
    pub top_k: usize,
    pub d_model: usize,
    pub d_ff: usize,
    pub tokens_per_device: usize,
    pub tflops: f64,
    /// `forward` or `backward` (twice the forward's FLOPs).
    pub pass: &'static str,
    /// 1, 2, … 8 parts (a layer splits into at most as many parts as a
    /// device has experts; counts past that repeat).
    pub times_s: Vec<f64>,
    pub best_parts: usize,
    /// The fastest count's time over one part's.
    pub best_over_one: f64,
    /// One part: both collectives, and the busiest device's compute.
    pub wire_s: f64,
    pub compute_s: f64,
}

/// The model over every device count and link of `p`, forward and
/// backward.
pub fn project(p: &Projection) -> Vec<ProjectionRow> {
    let mut rows = Vec::new();
    for &devices in &p.devices {
        for &rate in &p.links_gb_per_s {
            let link = LinkFit {
                fixed_s: p.latency_us * 1e-6,
                s_per_byte: 1.0 / (rate * 1e9),
            };
            let forward_s_per_row = 6.0 * (p.d_model * p.d_ff) as f64 / (p.tflops * 1e12);
            for (pass, share) in [("forward", 1.0), ("backward", 2.0)] {
                let layer = UniformLayer {
                    devices,
                    experts: p.experts,
                    rows_per_expert: (p.tokens_per_device * p.top_k / p.experts) as u32,
                    row_bytes: p.d_model as u64 * p.value_bytes,
                    s_per_row: forward_s_per_row * share,
                };
                let times = project_exchange(&link, &layer);
                let (best, best_s) = times
                    .iter()
                    .enumerate()
                    .min_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, &t)| (i + 1, t))
                    .unwrap_or((1, times[0]));
                let compute_s = project_exchange(
                    &LinkFit {
                        fixed_s: 0.0,
                        s_per_byte: 0.0,
                    },
                    &layer,
                )[0];
                rows.push(ProjectionRow {
                    bench: "pipeline_projection",
                    devices,
                    link_gb_per_s: rate,
                    latency_us: p.latency_us,
                    experts: p.experts,
                    top_k: p.top_k,
                    d_model: p.d_model,
                    d_ff: p.d_ff,
                    tokens_per_device: p.tokens_per_device,
                    tflops: p.tflops,
                    pass,
                    best_parts: best,
                    best_over_one: best_s / times[0],
                    wire_s: times[0] - compute_s,
                    compute_s,
                    times_s: times,
                });
            }
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_arm_reports_its_exchange_and_the_model_s_prediction() {
        let cfg = PipelineBench {
            preset: "tiny".into(),
            experts: Some(8),
            devices: 2,
            batch: 4,
            seq_len: 16,
            links_gb_per_s: vec![Some(1.0)],
            latency_us: 10.0,
            parts: vec![1, 4],
            warmup: 1,
            rounds: 2,
        };
        let (rows, choices) = run(&cfg, Transport::InProcess, |_| {}).unwrap();
        assert_eq!(rows.len(), 3);
        for r in &rows {
            assert_eq!(r.steps, 2);
            assert!(r.exchange_s > 0.0 && r.model_s > 0.0, "{r:?}");
            assert!(r.fit_fixed_us >= 0.0 && r.fit_gb_per_s > 0.0, "{r:?}");
        }
        // One part: 4 exchanges a layer; four: more.
        assert_eq!(rows[0].mean_parts, 1.0);
        assert!(rows[1].mean_parts > 1.0, "{:?}", rows[1]);
        assert_eq!(choices.len(), 1);
        assert!(choices[0].best_arm == "1" || choices[0].best_arm == "4");
        // auto's counted steps ran the parts it settled on.
        assert!(rows[2].settled.is_some(), "{:?}", rows[2]);
    }

    #[test]
    fn a_projection_hides_compute_where_the_wire_and_the_experts_balance() {
        let p = Projection {
            d_model: 2048,
            d_ff: 768,
            experts: 128,
            top_k: 8,
            tokens_per_device: 8192,
            tflops: 400.0,
            devices: vec![8, 64],
            links_gb_per_s: vec![100.0],
            latency_us: 20.0,
            value_bytes: 4,
        };
        let rows = project(&p);
        assert_eq!(rows.len(), 4);
        for r in &rows {
            assert_eq!(r.times_s.len(), 8);
            assert!(r.best_over_one <= 1.0 && r.wire_s > 0.0 && r.compute_s > 0.0);
            // Never better than the wire or the compute alone allow.
            let floor = r.wire_s.max(r.compute_s);
            assert!(r.best_over_one * r.times_s[0] >= floor, "{r:?}");
        }
        // 64 devices hold 2 experts each: at most 2 parts.
        let wide = &rows[2];
        assert!(wide.best_parts <= 2 && wide.times_s[2..].iter().all(|&t| t == wide.times_s[1]));
    }
}
