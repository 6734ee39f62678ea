//! What a layer's exchange in parts costs: the performance model of
//! MPMoE (`../shared/papers/002`, §IV), fitted to this run's link.
//!
//! A collective takes `fixed_s + s_per_byte × bytes`, where `bytes` is the
//! larger of what the busiest rank sends and receives (a line fitted to
//! all-to-alls timed on the run's own endpoints, [`calibrate`]); an
//! expert's rows take `s_per_row` each (the placement's cost per token,
//! measured step after step, split 1 : 2 between forward and backward as
//! their FLOPs are) and the exchange's own work on a device an expert
//! each (measured per pass, [`local_cost`]). The parts then run as the exchange runs them
//! ([`predict`]): the dispatches of parts 0 … n − 1 on the wire one after
//! another; part p's experts compute once its dispatch has arrived and
//! the part before has computed; part p's combine goes once its experts
//! are done on every rank and the wire is free. The layer ends with the
//! last combine.
//!
//! The model predicts (`exchange_model_s` beside the measured
//! `exchange_s`) and projects to machines this one is not
//! ([`project_exchange`]); `--pipeline auto` chooses by measuring instead
//! (`part_search.rs`), since what a part costs beyond its collective (a
//! thread's hand-off, copies on cores the experts compute on) depends on
//! the machine.

use std::time::Instant;

use crate::comm::{Comm, CommError};
use crate::engine::part_search::MAX_PARTS;
use crate::engine::pipeline::Pass;

/// Bytes each rank sends to each peer in the calibration's all-to-alls.
const CALIBRATION_BYTES: [usize; 3] = [0, 256 << 10, 2 << 20];

/// Timings of each size; the least is kept.
const CALIBRATION_REPEATS: usize = 5;

/// A collective's time on this link: `fixed_s + s_per_byte × bytes`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkFit {
    pub fixed_s: f64,
    pub s_per_byte: f64,
}

impl LinkFit {
    /// Seconds for a collective whose busiest rank moves `bytes` one way.
    pub fn time(&self, bytes: u64) -> f64 {
        self.fixed_s + self.s_per_byte * bytes as f64
    }

    /// The least-squares line through `(bytes, seconds)`, neither term
    /// below zero.
    pub fn through(points: &[(f64, f64)]) -> Self {
        let n = points.len() as f64;
        if points.is_empty() {
            return Self {
                fixed_s: 0.0,
                s_per_byte: 0.0,
            };
        }
        let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
        let my = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let s_per_byte = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
        Self {
            fixed_s: (my - s_per_byte * mx).max(0.0),
            s_per_byte,
        }
    }
}

/// Fits this link: all-to-alls of each of [`CALIBRATION_BYTES`] to every
/// peer, the least of [`CALIBRATION_REPEATS`] timings of each, then the
/// ranks' lines averaged (an all-reduce), so that every rank holds the
/// same fit. Every rank must call it at the same point.
pub(crate) fn calibrate(comm: &mut dyn Comm) -> Result<LinkFit, CommError> {
    let peers = comm.size().saturating_sub(1);
    let mut points = Vec::with_capacity(CALIBRATION_BYTES.len());
    for bytes in CALIBRATION_BYTES {
        let mut least = f64::INFINITY;
        for _ in 0..CALIBRATION_REPEATS {
            let sends = vec![vec![0.0f32; bytes / 4]; comm.size()];
            let t0 = Instant::now();
            comm.all_to_all(sends)?;
            least = least.min(t0.elapsed().as_secs_f64());
        }
        points.push(((bytes * peers) as f64, least));
    }
    let fit = LinkFit::through(&points);
    let mut terms = [fit.fixed_s as f32, (fit.s_per_byte * 1e9) as f32];
    comm.all_reduce_sum(&mut terms)?;
    let ranks = comm.size() as f64;
    Ok(LinkFit {
        fixed_s: terms[0] as f64 / ranks,
        s_per_byte: terms[1] as f64 / ranks * 1e-9,
    })
}

/// What the model knows of one layer's exchange in one pass.
pub(crate) struct LayerLoad<'a> {
    /// [device][expert] rows routed from each device's tokens.
    pub counts: &'a [Vec<u32>],
    /// [expert] the device that computes it.
    pub owner: &'a [u16],
    /// Bytes of one row on the wire.
    pub row_bytes: u64,
    /// Seconds of expert compute per row in this pass.
    pub s_per_row: f64,
    /// Seconds of the exchange's own work per expert a device computes in
    /// this pass ([`local_cost`]).
    pub s_per_expert: f64,
}

impl<'a> LayerLoad<'a> {
    /// A layer of `counts` and `owner` in `pass`: f32 rows of `d_model`
    /// on the wire, `pass_share` of the placement's expert compute per row
    /// (`per_token_s`, forward and backward together), and the exchange's
    /// own work per expert a device computes in this pass
    /// (`local_s_per_expert`: [forward, backward], [`local_cost`]).
    pub fn in_pass(
        counts: &'a [Vec<u32>],
        owner: &'a [u16],
        d_model: usize,
        (per_token_s, local_s_per_expert): (f64, [f64; 2]),
        pass: Pass,
    ) -> Self {
        let local = match pass {
            Pass::Forward => local_s_per_expert[0],
            Pass::Backward => local_s_per_expert[1],
        };
        Self {
            counts,
            owner,
            row_bytes: (d_model * 4) as u64,
            s_per_row: per_token_s * pass_share(pass),
            s_per_expert: local,
        }
    }
}

/// The exchange's own work on a device per expert it computes,
/// `[forward, backward]`: the seconds of each layer's exchange that were
/// neither its experts' compute nor waiting for the wire (staging each
/// expert, the update it waits for, its gradient handed on, its rows
/// joined and split; `StepMetrics::exchange_local_s_per_device`) over the
/// experts the device computed in that pass. The model counts it an
/// expert at a time beside the experts' compute.
pub(crate) fn local_cost(local_s: [f64; 2], experts: [u64; 2]) -> [f64; 2] {
    [0, 1].map(|p| match experts[p] {
        0 => 0.0,
        n => local_s[p] / n as f64,
    })
}

/// The share of an expert's cost per row (its forward and backward
/// together, as the placement measures it) that `pass` takes: a third in
/// the forward, two in the backward, as their GEMMs' FLOPs.
fn pass_share(pass: Pass) -> f64 {
    match pass {
        Pass::Forward => 1.0 / 3.0,
        Pass::Backward => 2.0 / 3.0,
    }
}

/// The predicted time of a layer's exchange and expert compute, with
/// expert e in part `part_of[e]` of `parts` (`usize::MAX`: no rows).
pub(crate) fn predict(
    link: &LinkFit,
    load: &LayerLoad<'_>,
    part_of: &[usize],
    parts: usize,
) -> f64 {
    let devices = load.counts.len();
    // [part][device]: rows sent away, rows received, rows computed,
    // experts computed.
    let mut out = vec![vec![0u64; devices]; parts];
    let mut inn = vec![vec![0u64; devices]; parts];
    let mut rows = vec![vec![0u64; devices]; parts];
    let mut experts = vec![vec![0u64; devices]; parts];
    for (e, &p) in part_of.iter().enumerate() {
        if p >= parts {
            continue;
        }
        let owner = load.owner[e] as usize;
        experts[p][owner] += 1;
        for (src, counts) in load.counts.iter().enumerate() {
            let c = counts[e] as u64;
            rows[p][owner] += c;
            if src != owner {
                out[p][src] += c;
                inn[p][owner] += c;
            }
        }
    }
    // The dispatch's busiest rank; the combine moves the same rows back.
    let wire = |p: usize| {
        let busiest = (0..devices)
            .map(|r| out[p][r].max(inn[p][r]))
            .max()
            .unwrap_or(0);
        link.time(busiest * load.row_bytes)
    };
    let mut wire_free = 0.0f64;
    let mut dispatched = vec![0.0; parts];
    for (p, at) in dispatched.iter_mut().enumerate() {
        wire_free += wire(p);
        *at = wire_free;
    }
    let mut computed = vec![0.0f64; devices];
    for p in 0..parts {
        for (r, done) in computed.iter_mut().enumerate() {
            let own = experts[p][r] as f64 * load.s_per_expert;
            *done = done.max(dispatched[p]) + rows[p][r] as f64 * load.s_per_row + own;
        }
        let ready = computed.iter().cloned().fold(0.0, f64::max);
        wire_free = wire_free.max(ready) + wire(p);
    }
    wire_free
}

/// A layer to project the model onto (`strata bench pipeline`'s
/// projections to machines this one is not): every device routes
/// `rows_per_expert` rows to every expert, and expert e is computed on
/// device e mod `devices`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UniformLayer {
    pub devices: usize,
    pub experts: usize,
    pub rows_per_expert: u32,
    /// Bytes of one row on the wire.
    pub row_bytes: u64,
    /// Seconds of expert compute per row in the pass projected.
    pub s_per_row: f64,
}

/// The model's time for `layer` over `link` in 1, 2, … 8
/// parts (index n − 1), the parts cut as the exchange cuts them (a share
/// of each device's experts); a layer has at most as many parts as a
/// device has experts, so counts past that repeat its time.
pub fn project_exchange(link: &LinkFit, layer: &UniformLayer) -> Vec<f64> {
    let counts = vec![vec![layer.rows_per_expert; layer.experts]; layer.devices];
    let owner: Vec<u16> = (0..layer.experts)
        .map(|e| (e % layer.devices) as u16)
        .collect();
    let lists: Vec<Vec<usize>> = (0..layer.devices)
        .map(|d| (d..layer.experts).step_by(layer.devices).collect())
        .collect();
    let most = lists.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let load = LayerLoad {
        counts: &counts,
        owner: &owner,
        row_bytes: layer.row_bytes,
        s_per_row: layer.s_per_row,
        s_per_expert: 0.0,
    };
    (1..=MAX_PARTS)
        .map(|n| {
            let n = n.min(most);
            let mut of = vec![usize::MAX; layer.experts];
            for list in &lists {
                for (i, &e) in list.iter().enumerate() {
                    of[e] = i * n / list.len();
                }
            }
            predict(link, &load, &of, n)
        })
        .collect()
}

#[cfg(test)]
mod tests;
