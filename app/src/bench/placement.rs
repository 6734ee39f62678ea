//! `strata bench placement`: the latency of one LPT placement for E
//! experts on N devices, and the per-device load gap (max/min − 1) and
//! makespan over the lower bound of LPT against static round-robin
//! ownership, under uniform and Zipf-skewed token counts.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::Timing;
use strata::placement::{load_gap, makespan_lower_bound, round_robin_loads, CostModel, LptPlacer};

/// Token counts drawn for one layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Distribution {
    Uniform,
    Zipf(f64),
}

impl Distribution {
    pub fn name(self) -> String {
        match self {
            Distribution::Uniform => "uniform".into(),
            Distribution::Zipf(s) => format!("zipf{s:.1}"),
        }
    }
}

#[derive(Serialize, Debug)]
pub struct LatencyRow {
    pub bench: &'static str,
    pub experts: usize,
    pub devices: usize,
    pub latency_ns: f64,
}

#[derive(Serialize, Debug)]
pub struct BalanceRow {
    pub bench: &'static str,
    pub experts: usize,
    pub devices: usize,
    pub distribution: String,
    pub policy: &'static str,
    /// Median over the trials.
    pub load_gap: f64,
    pub makespan_over_bound: f64,
}

/// Compute cost per token only: balance is about tokens.
const COST: CostModel = CostModel {
    upload_s: 0.0,
    per_token_s: 1e-6,
    fixed_s: 0.0,
};

fn next(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `tokens` assignments spread over `experts` by `dist`: each token picks
/// an expert with probability ∝ 1 (uniform) or 1/rank^s (Zipf, ranks
/// shuffled over the experts).
pub fn draw_tokens(experts: usize, tokens: usize, dist: Distribution, seed: u64) -> Vec<u32> {
    let mut s = seed;
    let weights: Vec<f64> = match dist {
        Distribution::Uniform => vec![1.0; experts],
        Distribution::Zipf(exp) => {
            let mut w: Vec<f64> = (0..experts)
                .map(|r| 1.0 / (r as f64 + 1.0).powf(exp))
                .collect();
            for i in (1..experts).rev() {
                let j = (next(&mut s) % (i as u64 + 1)) as usize;
                w.swap(i, j);
            }
            w
        }
    };
    let total: f64 = weights.iter().sum();
    let mut cdf = Vec::with_capacity(experts);
    let mut acc = 0.0;
    for w in &weights {
        acc += w / total;
        cdf.push(acc);
    }
    let mut counts = vec![0u32; experts];
    for _ in 0..tokens {
        let u = (next(&mut s) >> 11) as f64 / (1u64 << 53) as f64;
        let e = cdf.partition_point(|&c| c < u).min(experts - 1);
        counts[e] += 1;
    }
    counts
}

/// Median ns of one placement over `reps` calls (after a warm-up).
pub fn latency(experts: usize, devices: usize, reps: usize) -> f64 {
    let tokens = draw_tokens(experts, experts * 64, Distribution::Zipf(1.0), 7);
    let resident = vec![None; experts];
    let mut owner = vec![0u16; experts];
    let mut placer = LptPlacer::new(experts, devices);
    let mut samples: Vec<Duration> = Vec::with_capacity(reps);
    for i in 0..reps + reps / 10 {
        let t0 = Instant::now();
        std::hint::black_box(placer.place(
            std::hint::black_box(&tokens),
            &resident,
            &COST,
            &mut owner,
        ));
        if i >= reps / 10 {
            samples.push(t0.elapsed());
        }
    }
    Timing::of(&samples).median_s * 1e9
}

/// Median load gap and makespan/bound of LPT and round-robin over trials.
pub fn balance(
    experts: usize,
    devices: usize,
    dist: Distribution,
    trials: usize,
) -> [BalanceRow; 2] {
    let tokens_per_layer = experts * 256;
    let mut lpt = (Vec::new(), Vec::new());
    let mut rr = (Vec::new(), Vec::new());
    let resident = vec![None; experts];
    let mut owner = vec![0u16; experts];
    let mut placer = LptPlacer::new(experts, devices);
    let mut rr_loads = vec![0.0; devices];
    for trial in 0..trials {
        let tokens = draw_tokens(experts, tokens_per_layer, dist, 1000 + trial as u64);
        let bound = makespan_lower_bound(&tokens, devices, &COST);
        let loads = placer.place(&tokens, &resident, &COST, &mut owner);
        lpt.0.push(load_gap(loads));
        lpt.1
            .push(loads.iter().copied().fold(0.0, f64::max) / bound);
        round_robin_loads(&tokens, devices, &COST, &mut rr_loads);
        rr.0.push(load_gap(&rr_loads));
        rr.1.push(rr_loads.iter().copied().fold(0.0, f64::max) / bound);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let row = |policy, (gaps, spans): &mut (Vec<f64>, Vec<f64>)| BalanceRow {
        bench: "placement",
        experts,
        devices,
        distribution: dist.name(),
        policy,
        load_gap: median(gaps),
        makespan_over_bound: median(spans),
    };
    [row("lpt", &mut lpt), row("round_robin", &mut rr)]
}

/// The whole bench: latency rows, then balance rows.
pub fn run(reps: usize, trials: usize) -> (Vec<LatencyRow>, Vec<BalanceRow>) {
    let mut lat = Vec::new();
    let mut bal = Vec::new();
    for experts in [8, 64, 256] {
        for devices in [2, 4, 8] {
            lat.push(LatencyRow {
                bench: "placement",
                experts,
                devices,
                latency_ns: latency(experts, devices, reps),
            });
            for dist in [
                Distribution::Uniform,
                Distribution::Zipf(1.0),
                Distribution::Zipf(1.5),
            ] {
                bal.extend(balance(experts, devices, dist, trials));
            }
        }
    }
    (lat, bal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zipf_is_skewed_and_uniform_is_not() {
        let u = draw_tokens(64, 64_000, Distribution::Uniform, 1);
        let z = draw_tokens(64, 64_000, Distribution::Zipf(1.5), 1);
        assert_eq!(u.iter().sum::<u32>(), 64_000);
        assert_eq!(z.iter().sum::<u32>(), 64_000);
        let max = |v: &[u32]| *v.iter().max().unwrap() as f64;
        assert!(max(&u) < 1300.0, "{u:?}");
        assert!(max(&z) > 20_000.0, "{z:?}");
    }

    #[test]
    fn lpt_beats_round_robin_under_skew() {
        let [lpt, rr] = balance(64, 4, Distribution::Zipf(1.0), 5);
        assert!(lpt.load_gap < rr.load_gap, "{lpt:?} {rr:?}");
        assert!(lpt.makespan_over_bound >= 1.0 - 1e-9);
    }
}
