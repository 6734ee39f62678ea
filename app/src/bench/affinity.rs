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
    balanced_start, level_shares, place, place_exact, place_two_level, replace_if_it_pays,
    AffinityProblem, EXACT_MAX_CELLS,
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
    /// With `--nodes`: the share whose two experts sit in one node.
    pub node_share: Option<f64>,
    pub seconds: f64,
}

/// `--later`: a placement made on the earlier trace, set against one made
/// afresh on what the later trace added.
#[derive(Serialize, Debug)]
pub struct DriftRow {
    pub bench: &'static str,
    pub devices: usize,
    /// Steps in the earlier trace and in what the later one added.
    pub steps_before: u64,
    pub steps_after: u64,
    /// Token pairs a step kept on a device after the earlier trace, by the
    /// earlier placement and by a fresh one.
    pub kept_a_step_now: f64,
    pub kept_a_step_fresh: f64,
    pub experts_moved: usize,
    pub row_bytes: u64,
    pub record_bytes: u64,
    pub horizon_steps: u64,
    pub replaced: bool,
}

/// The rows for `trace` over each of `devices` that divides into its
/// experts sensibly (2 ≤ devices ≤ experts), with `slack` over the
/// balanced placement's busiest device allowed.
/// With `nodes`, the devices are GPUs in that many nodes: each row gains
/// its node share, and a `two-level` row is added where the nodes divide
/// the devices.
pub fn on_trace(
    source: &str,
    trace: &RoutingTrace,
    devices: &[usize],
    slack: f64,
    nodes: Option<usize>,
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
        rows.extend(compare(source, &problem, nodes)?);
    }
    Ok(rows)
}

/// The earlier trace's placement against a fresh one on what `later`
/// (the same run's trace, written later) added, for each device count.
pub fn drift(
    earlier: &RoutingTrace,
    later: &RoutingTrace,
    devices: &[usize],
    slack: f64,
    (row_bytes, record_bytes, horizon_steps): (u64, u64, u64),
) -> Result<Vec<DriftRow>, String> {
    if (earlier.layers, earlier.experts) != (later.layers, later.experts)
        || later.steps < earlier.steps
        || later
            .transitions
            .iter()
            .flatten()
            .zip(earlier.transitions.iter().flatten())
            .any(|(l, e)| l < e)
    {
        return Err("--later is not a later trace of the same run as --trace".into());
    }
    if later.steps == earlier.steps {
        return Err("--later has no steps beyond --trace's: give a trace written later".into());
    }
    let added: Vec<Vec<u64>> = later
        .transitions
        .iter()
        .zip(&earlier.transitions)
        .map(|(l, e)| l.iter().zip(e).map(|(a, b)| a - b).collect())
        .collect();
    let steps_after = later.steps - earlier.steps;
    let mut rows = Vec::new();
    for &n in devices.iter().filter(|&&n| n >= 2 && n <= earlier.experts) {
        let problem = |transitions| AffinityProblem {
            layers: earlier.layers,
            experts: earlier.experts,
            devices: n,
            transitions,
            load_slack: slack,
        };
        let current = place(&problem(&earlier.transitions)).map_err(|e| e.to_string())?;
        let r = replace_if_it_pays(
            &problem(&added),
            &current,
            steps_after,
            row_bytes,
            record_bytes,
            horizon_steps,
        )
        .map_err(|e| e.to_string())?;
        rows.push(DriftRow {
            bench: "affinity-drift",
            devices: n,
            steps_before: earlier.steps,
            steps_after,
            kept_a_step_now: r.kept_now,
            kept_a_step_fresh: r.kept_fresh,
            experts_moved: r.moved,
            row_bytes,
            record_bytes,
            horizon_steps,
            replaced: r.replaced,
        });
    }
    Ok(rows)
}

/// Balanced, the heuristic and (where small enough) the exact placement
/// of one problem.
fn compare(
    source: &str,
    problem: &AffinityProblem<'_>,
    nodes: Option<usize>,
) -> Result<Vec<AffinityRow>, String> {
    let total = problem.total();
    let per_node = nodes
        .filter(|&m| m > 0 && problem.devices.is_multiple_of(m))
        .map(|m| problem.devices / m);
    let row = |policy, owners: &Vec<Vec<u16>>, seconds: f64| AffinityRow {
        bench: "affinity",
        source: source.to_string(),
        layers: problem.layers,
        experts: problem.experts,
        devices: problem.devices,
        policy,
        transitions: total,
        staying_share: problem.staying(owners) as f64 / total.max(1) as f64,
        node_share: per_node.map(|g| level_shares(problem, owners, g).node),
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
    if let (Some(m), Some(_)) = (nodes, per_node) {
        let (owners, s) = timed(&|| place_two_level(problem, m).map_err(|e| e.to_string()))?;
        rows.push(row("two-level", &owners, s));
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
        rows.extend(on_trace("synthetic", &trace, &[devices], slack, None)?);
    }
    for (layers, experts, devices) in [(16, 64, 8), (16, 128, 16), (16, 256, 64)] {
        let trace = synthetic_trace(layers, experts, 0.5, 7);
        rows.extend(on_trace("synthetic", &trace, &[devices], slack, None)?);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn affinity_keeps_more_than_balance_and_the_optimum_bounds_both() {
        let trace = synthetic_trace(3, 8, 0.6, 3);
        let rows = on_trace("synthetic", &trace, &[2, 4, 16], 0.1, None).unwrap();
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

    #[test]
    fn nodes_add_a_two_level_row_and_every_row_s_node_share() {
        let trace = synthetic_trace(4, 16, 0.5, 5);
        let rows = on_trace("synthetic", &trace, &[8], 0.1, Some(2)).unwrap();
        let policies: Vec<&str> = rows.iter().map(|r| r.policy).collect();
        assert_eq!(policies, ["balanced", "affinity", "two-level"]);
        for r in &rows {
            assert!(r.node_share.unwrap() >= r.staying_share, "{r:?}");
        }
        let [_, flat, staged] = &rows[..] else {
            unreachable!()
        };
        assert!(staged.node_share >= flat.node_share, "{rows:?}");
        // Nodes that do not divide the devices: no node share, no row.
        let rows = on_trace("synthetic", &trace, &[8], 0.1, Some(3)).unwrap();
        assert_eq!(rows.len(), 2);
        assert!(rows.iter().all(|r| r.node_share.is_none()));
    }

    #[test]
    fn a_later_trace_of_the_run_is_set_against_the_earlier_placement() {
        let earlier = synthetic_trace(3, 8, 0.6, 3);
        let mut later = earlier.clone();
        later.add(&synthetic_trace(3, 8, 0.6, 4));
        let rows = drift(&earlier, &later, &[2, 4], 0.1, (4096, 1 << 20, 1 << 20)).unwrap();
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert_eq!((r.steps_before, r.steps_after), (1, 1));
            let gain = r.kept_a_step_fresh > r.kept_a_step_now;
            assert_eq!(r.replaced, r.experts_moved > 0 && gain, "{r:?}");
        }
        let e = drift(&later, &earlier, &[2], 0.1, (1, 1, 1)).unwrap_err();
        assert!(e.contains("not a later trace"), "{e}");
    }
}
