//! The exact affinity placement: an integer program (ExFlow §IV-D, with
//! counts for its probabilities) solved by `good_lp` over `microlp`, a
//! pure-Rust simplex with branch and bound.
//!
//! Binary `x[l][e][d]`: expert e of layer l on device d; each expert on one
//! device, at most `capacity` experts and `load_caps[l]` tokens a device.
//! Continuous `z[l][a][d] ≤ Σ_b T[l][a][b] · x[l+1][b][d]` and
//! `≤ (Σ_b T[l][a][b]) · x[l][a][d]`: the pairs from expert a kept on device
//! d, which only a's own device can keep. Maximize Σ z. Devices are
//! interchangeable, so layer 0's expert a may only go to devices 0..=a
//! (one of the device permutations of every solution survives), which
//! shortens the search several-fold.

use good_lp::{
    constraint, microlp, variable, variables, Expression, Solution, SolverModel, Variable,
};

use super::affinity::{AffinityError, AffinityProblem, Owners};

/// The largest problem `place_exact` takes: layers × experts × devices.
/// Its search grows exponentially: 3 × 8 × 4 took seconds on the
/// development machine, 4 × 8 × 4 had not ended after eight minutes.
pub const EXACT_MAX_CELLS: usize = 96;

/// The optimum of `problem` (see the module's text), for small problems.
pub fn place_exact(problem: &AffinityProblem<'_>) -> Result<Owners, AffinityError> {
    problem.check()?;
    let (layers, e, n) = (problem.layers, problem.experts, problem.devices);
    if layers * e * n > EXACT_MAX_CELLS {
        return Err(AffinityError(format!(
            "{layers} layers × {e} experts × {n} devices is too large for the exact placement \
             (at most {EXACT_MAX_CELLS}); use the heuristic"
        )));
    }
    let (loads, caps, room) = (problem.loads(), problem.load_caps(), problem.capacity());
    let mut vars = variables!();
    let x: Vec<Vec<Vec<Variable>>> = (0..layers)
        .map(|_| {
            (0..e)
                .map(|_| (0..n).map(|_| vars.add(variable().binary())).collect())
                .collect()
        })
        .collect();
    let mut objective = Expression::from(0.0);
    let mut kept = Vec::new();
    for (l, t) in problem.transitions.iter().enumerate() {
        for a in 0..e {
            let out: u64 = t[a * e..(a + 1) * e].iter().sum();
            if out == 0 {
                continue;
            }
            for (d, &on_d) in x[l][a].iter().enumerate() {
                let z = vars.add(variable().min(0.0));
                objective += z;
                let flow: Expression = (0..e).map(|b| t[a * e + b] as f64 * x[l + 1][b][d]).sum();
                kept.push(constraint!(z <= flow));
                kept.push(constraint!(z <= out as f64 * on_d));
            }
        }
    }
    let mut model = vars.maximise(objective).using(microlp);
    for c in kept {
        model = model.with(c);
    }
    for (l, layer) in x.iter().enumerate() {
        for row in layer {
            let one: Expression = row.iter().sum();
            model = model.with(constraint!(one == 1.0));
        }
        for d in 0..n {
            let count: Expression = layer.iter().map(|row| row[d]).sum();
            model = model.with(constraint!(count <= room as f64));
            let load: Expression = (0..e).map(|a| loads[l][a] as f64 * layer[a][d]).sum();
            model = model.with(constraint!(load <= caps[l] as f64));
        }
    }
    for (a, row) in x[0].iter().enumerate() {
        for &var in &row[(a + 1).min(n)..] {
            model = model.with(constraint!(var == 0.0));
        }
    }
    let solution = model
        .solve()
        .map_err(|why| AffinityError(format!("the integer program failed: {why}")))?;
    Ok(x.iter()
        .map(|layer| {
            layer
                .iter()
                .map(|row| {
                    (0..n)
                        .find(|&d| solution.value(row[d]) > 0.5)
                        .expect("each expert is on one device") as u16
                })
                .collect()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::super::affinity::{balanced_start, place};
    use super::*;

    #[test]
    fn the_heuristic_is_within_5_percent_of_the_optimum() {
        let mut worst: f64 = 1.0;
        for seed in 1..9 {
            let t = super::super::affinity::tests::random_trace(3, 6, seed);
            for devices in [2, 3] {
                let p = AffinityProblem {
                    layers: 3,
                    experts: 6,
                    devices,
                    transitions: &t,
                    load_slack: 0.1,
                };
                let exact = place_exact(&p).unwrap();
                let heuristic = place(&p).unwrap();
                assert!(p.feasible(&exact), "seed {seed}");
                let (best, ours) = (p.staying(&exact), p.staying(&heuristic));
                assert!(
                    ours <= best,
                    "the heuristic beat the optimum: {ours} > {best}"
                );
                assert!(p.staying(&balanced_start(&p)) <= best);
                eprintln!(
                    "seed {seed} devices {devices}: {ours} / {best} (start {})",
                    p.staying(&balanced_start(&p))
                );
                worst = worst.min(ours as f64 / best as f64);
            }
        }
        eprintln!("heuristic ÷ optimum, worst of 16: {worst:.3}");
        assert!(worst >= 0.95, "{worst}");
    }

    #[test]
    fn a_problem_too_large_is_refused_by_name() {
        let t = vec![vec![1; 64 * 64]];
        let p = AffinityProblem {
            layers: 2,
            experts: 64,
            devices: 8,
            transitions: &t,
            load_slack: 0.1,
        };
        let err = place_exact(&p).unwrap_err();
        assert!(err.0.contains("too large for the exact placement"), "{err}");
    }
}
