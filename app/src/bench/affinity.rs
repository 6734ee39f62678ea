//! `strata bench affinity`: how many token-layer transitions stay on their
//! device when every layer's experts are placed for balance alone (what
//! the per-layer placement does) against placed for inter-layer affinity
//! (`strata::placement::affinity`), on a routing trace written by
//! `strata train --trace-routing`; the heuristic against the integer
//! program's optimum where the latter runs; and the heuristic's time at
//! model sizes.

use std::time::Instant;

use serde::Serialize;
use strata::engine::RoutingTrace;
use strata::placement::affinity::{
    balanced_start, place, place_exact, AffinityProblem, EXACT_MAX_CELLS,
};

#[derive(Serialize, Debug)]
pub struct AffinityRow {
    pub bench: &'static str,
    /// Where the transitions come from: the trace file, or `synthetic`.
    pub source: String,
    pub layers: usize,
    pub experts: usize,
    pub devices: usize,
    /// `balanced` (per layer, for load alone), `affinity` (the heuristic)
    /// or `exact` (the integer program).
    pub policy: &'static str,
    /// Token pairs traced between consecutive layers.
    pub transitions: u64,
    /// Of them, the share whose two experts sit on one device.
    pub staying_share: f64,
    pub seconds: f64,
}

/// The rows for `trace` over each of `devices` that divides into its
/// experts sensibly (2 ≤ devices ≤ experts), with `slack` over the
/// balanced placement's busiest device allowed.
pub fn on_trace(
    source: &str,
    trace: &RoutingTrace,
    devices: &[usize],
    slack: f64,
) -> Result<Vec<AffinityRow>, String> {
    let mut rows = Vec::new();
    for &n in devices.iter().filter(|&&n| n >= 2 && n <= trace.experts) {
        let problem = AffinityProblem {
            layers: trace.layers,
            experts: trace.experts,
            devices: n,
            transitions: &trace.transitions,
            load_slack: slack,
        };
        rows.extend(compare(source, &problem)?);
    }
    Ok(rows)
}

/// Balanced, the heuristic and (where small enough) the exact placement
/// of one problem.
fn compare(source: &str, problem: &AffinityProblem<'_>) -> Result<Vec<AffinityRow>, String> {
    let total = problem.total();
    let row = |policy, owners: &Vec<Vec<u16>>, seconds: f64| AffinityRow {
        bench: "affinity",
        source: source.to_string(),
        layers: problem.layers,
        experts: problem.experts,
        devices: problem.devices,
        policy,
        transitions: total,
        staying_share: problem.staying(owners) as f64 / total.max(1) as f64,
        seconds,
    };
    let timed = |f: &dyn Fn() -> Result<Vec<Vec<u16>>, String>| {
        let t0 = Instant::now();
        f().map(|o| (o, t0.elapsed().as_secs_f64()))
    };
    let mut rows = Vec::new();
    let (owners, s) = timed(&|| Ok(balanced_start(problem)))?;
    rows.push(row("balanced", &owners, s));
    let (owners, s) = timed(&|| place(problem).map_err(|e| e.to_string()))?;
    rows.push(row("affinity", &owners, s));
    if problem.layers * problem.experts * problem.devices <= EXACT_MAX_CELLS {
        let (owners, s) = timed(&|| place_exact(problem).map_err(|e| e.to_string()))?;
        rows.push(row("exact", &owners, s));
    }
    Ok(rows)
}

/// Transitions drawn with affinity: from expert a, a share `affinity` of
/// the tokens go to one expert of the next layer (a fixed random map),
/// the rest spread at random. Deterministic from `seed`.
pub fn synthetic_trace(layers: usize, experts: usize, affinity: f64, seed: u64) -> RoutingTrace {
    let mut s = seed.max(1);
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut trace = RoutingTrace::new(layers, experts, 1);
    for t in &mut trace.transitions {
        let mut image: Vec<usize> = (0..experts).collect();
        for i in (1..experts).rev() {
            image.swap(i, (next() % (i as u64 + 1)) as usize);
        }
        for a in 0..experts {
            for _ in 0..200 {
                let b = match (next() % 1000) as f64 / 1000.0 < affinity {
                    true => image[a],
                    false => (next() % experts as u64) as usize,
                };
                t[a * experts + b] += 1;
            }
        }
    }
    trace.steps = 1;
    trace
}

/// The bench without a trace: the heuristic against the optimum on small
/// synthetic cases, and its time at model sizes.
pub fn synthetic(slack: f64) -> Result<Vec<AffinityRow>, String> {
    let mut rows = Vec::new();
    for (layers, experts, devices) in [(3, 8, 2), (3, 8, 4), (4, 8, 4)] {
        let trace = synthetic_trace(layers, experts, 0.5, 7);
        rows.extend(on_trace("synthetic", &trace, &[devices], slack)?);
    }
    for (layers, experts, devices) in [(16, 64, 8), (16, 128, 16), (16, 256, 64)] {
        let trace = synthetic_trace(layers, experts, 0.5, 7);
        rows.extend(on_trace("synthetic", &trace, &[devices], slack)?);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affinity_keeps_more_than_balance_and_the_optimum_bounds_both() {
        let trace = synthetic_trace(3, 8, 0.6, 3);
        let rows = on_trace("synthetic", &trace, &[2, 4, 16], 0.1).unwrap();
        // 16 devices for 8 experts is skipped; 2 and 4 give three rows each.
        assert_eq!(rows.len(), 6);
        for set in rows.chunks(3) {
            let [balanced, affinity, exact] = set else {
                unreachable!()
            };
            assert_eq!(
                (balanced.policy, affinity.policy, exact.policy),
                ("balanced", "affinity", "exact")
            );
            assert!(affinity.staying_share > balanced.staying_share, "{set:?}");
            assert!(exact.staying_share >= affinity.staying_share, "{set:?}");
            assert!(
                affinity.staying_share >= 0.95 * exact.staying_share,
                "{set:?}"
            );
        }
    }
}
