//! Affinity placement on two levels, and placed anew when the affinity
//! drifts (ExFlow §IV-D, staged affinity):
//! - [`place_two_level`]: GPUs grouped in nodes. The experts are placed
//!   on the nodes first ([`place`] with a device a node), so that the
//!   pairs that must leave a GPU leave it within its node where they can;
//!   then each node's experts on its GPUs, on the pairs between experts of
//!   that node.
//! - [`replace_if_it_pays`]: a placement made on an older trace against a
//!   fresh one on a newer trace. The fresh one's devices are renamed (one
//!   renaming for every layer, which keeps every pair where it was) to
//!   leave as many experts where they are as can be; it is taken when
//!   the rows it keeps off the link over a horizon outweigh the records
//!   it moves.

use super::affinity::{place, AffinityError, AffinityProblem, Owners};

/// The share of traced pairs a placement keeps on one GPU and within one
/// node.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LevelShares {
    pub gpu: f64,
    pub node: f64,
}

/// The shares `owners` keeps, GPUs numbered node by node
/// (`gpus_per_node` a node).
pub fn level_shares(
    problem: &AffinityProblem<'_>,
    owners: &Owners,
    gpus_per_node: usize,
) -> LevelShares {
    let nodes: Owners = owners
        .iter()
        .map(|row| row.iter().map(|&g| g / gpus_per_node as u16).collect())
        .collect();
    let total = problem.total().max(1) as f64;
    LevelShares {
        gpu: problem.staying(owners) as f64 / total,
        node: problem.staying(&nodes) as f64 / total,
    }
}

/// `problem.devices` GPUs in `nodes` nodes of equal size: the experts
/// placed on nodes, then within each node on its GPUs (see the module).
/// Each GPU holds at most the flat problem's capacity; the load caps hold
/// at each level (a node's, and a GPU's within its node's experts).
pub fn place_two_level(
    problem: &AffinityProblem<'_>,
    nodes: usize,
) -> Result<Owners, AffinityError> {
    problem.check()?;
    if nodes == 0 || !problem.devices.is_multiple_of(nodes) {
        return Err(AffinityError(format!(
            "{} GPUs in {nodes} nodes: give a node count that divides the GPUs",
            problem.devices
        )));
    }
    let per_node = problem.devices / nodes;
    let node_of = place(&AffinityProblem {
        devices: nodes,
        ..problem.clone()
    })?;
    let mut owners: Owners = vec![vec![0; problem.experts]; problem.layers];
    for node in 0..nodes {
        // [layer]: the experts this node holds, padded to one width with
        // experts of no pairs.
        let members: Vec<Vec<usize>> = node_of
            .iter()
            .map(|row| {
                (0..problem.experts)
                    .filter(|&e| row[e] as usize == node)
                    .collect()
            })
            .collect();
        let width = members.iter().map(Vec::len).max().unwrap_or(0);
        if width == 0 {
            continue;
        }
        let e = problem.experts;
        let transitions: Vec<Vec<u64>> = (0..problem.layers - 1)
            .map(|l| {
                let mut t = vec![0u64; width * width];
                for (i, &a) in members[l].iter().enumerate() {
                    for (j, &b) in members[l + 1].iter().enumerate() {
                        t[i * width + j] = problem.transitions[l][a * e + b];
                    }
                }
                t
            })
            .collect();
        let inner = place(&AffinityProblem {
            layers: problem.layers,
            experts: width,
            devices: per_node.min(width),
            transitions: &transitions,
            load_slack: problem.load_slack,
        })?;
        for (l, row) in members.iter().enumerate() {
            for (i, &expert) in row.iter().enumerate() {
                owners[l][expert] = (node * per_node) as u16 + inner[l][i];
            }
        }
    }
    Ok(owners)
}

/// What [`replace_if_it_pays`] decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Replacement {
    /// The placement to run with: the fresh one renamed, or the current.
    pub owners: Owners,
    pub replaced: bool,
    /// Experts (over every layer) the fresh placement would move.
    pub moved: usize,
    /// Pairs a step the current and the fresh placement keep on a device,
    /// on the newer trace.
    pub kept_now: f64,
    pub kept_fresh: f64,
}

/// `current` (placed on an older trace) against a fresh placement of
/// `problem` (the newer trace, counted over `steps` steps). The fresh one
/// is taken when the bytes it keeps off the link over `horizon_steps`
/// (each pair kept saves a row each way, forward and backward:
/// `row_bytes` × 4) reach the bytes of the records it moves
/// (`record_bytes` each).
pub fn replace_if_it_pays(
    problem: &AffinityProblem<'_>,
    current: &Owners,
    steps: u64,
    row_bytes: u64,
    record_bytes: u64,
    horizon_steps: u64,
) -> Result<Replacement, AffinityError> {
    let fresh = renamed_to_match(place(problem)?, current, problem.devices);
    let moved = fresh
        .iter()
        .zip(current)
        .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count())
        .sum();
    let per_step = |o: &Owners| problem.staying(o) as f64 / steps.max(1) as f64;
    let (kept_now, kept_fresh) = (per_step(current), per_step(&fresh));
    let saved = (kept_fresh - kept_now) * (4 * row_bytes) as f64 * horizon_steps as f64;
    let replaced = moved > 0 && saved >= (moved as u64 * record_bytes) as f64;
    Ok(Replacement {
        owners: if replaced { fresh } else { current.clone() },
        replaced,
        moved,
        kept_now,
        kept_fresh,
    })
}

/// `fresh` with its devices renamed, one renaming for all layers, so that
/// as many experts as can be keep `current`'s device: greedily, the
/// (fresh, current) device pair with the most experts in common first.
fn renamed_to_match(fresh: Owners, current: &Owners, devices: usize) -> Owners {
    let mut common = vec![vec![0usize; devices]; devices];
    for (f, c) in fresh.iter().zip(current) {
        for (&a, &b) in f.iter().zip(c) {
            common[a as usize][b as usize] += 1;
        }
    }
    let mut pairs: Vec<(usize, usize, usize)> = (0..devices)
        .flat_map(|a| (0..devices).map(move |b| (a, b)))
        .map(|(a, b)| (common[a][b], a, b))
        .collect();
    pairs.sort_by_key(|&(n, a, b)| (std::cmp::Reverse(n), a, b));
    let (mut name, mut taken) = (vec![None; devices], vec![false; devices]);
    for (_, a, b) in pairs {
        if name[a].is_none() && !taken[b] {
            name[a] = Some(b as u16);
            taken[b] = true;
        }
    }
    fresh
        .into_iter()
        .map(|row| {
            row.into_iter()
                .map(|d| name[d as usize].expect("a name each"))
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::affinity::tests::{problem, random_trace};
    use super::*;

    #[test]
    fn two_levels_keep_more_within_nodes_and_stay_feasible() {
        let mut better_nodes = 0;
        for seed in 1..9 {
            let t = random_trace(4, 16, seed);
            let p = problem(&t, 16, 8);
            let flat = place(&p).unwrap();
            let staged = place_two_level(&p, 2).unwrap();
            // Every GPU within the flat capacity, every expert placed.
            for row in &staged {
                let mut count = [0usize; 8];
                row.iter().for_each(|&g| count[g as usize] += 1);
                assert!(count.iter().all(|&c| c <= p.capacity()), "{row:?}");
            }
            let (f, s) = (level_shares(&p, &flat, 4), level_shares(&p, &staged, 4));
            assert!(s.node >= s.gpu && f.node >= f.gpu);
            better_nodes += usize::from(s.node > f.node);
        }
        assert!(better_nodes >= 6, "{better_nodes} of 8");
    }

    #[test]
    fn one_node_is_the_flat_placement_and_a_bad_count_is_named() {
        let t = random_trace(3, 8, 4);
        let p = problem(&t, 8, 4);
        let one = place_two_level(&p, 1).unwrap();
        assert_eq!(p.staying(&one), p.staying(&place(&p).unwrap()));
        let e = place_two_level(&p, 3).unwrap_err();
        assert!(e.0.contains("4 GPUs in 3 nodes"), "{e}");
    }

    #[test]
    fn a_placement_is_replaced_only_when_the_rows_it_saves_pay_for_the_moves() {
        let (old, new) = (random_trace(4, 16, 2), random_trace(4, 16, 3));
        let current = place(&problem(&old, 16, 4)).unwrap();
        let p = problem(&new, 16, 4);
        // On its own trace a placement is kept: nothing would pay.
        let same =
            replace_if_it_pays(&problem(&old, 16, 4), &current, 1, 4096, 1 << 20, 1000).unwrap();
        assert!(!same.replaced);
        assert_eq!(same.owners, current);
        // A drifted trace: worth it over a long horizon, not over one step
        // with records this large.
        let long = replace_if_it_pays(&p, &current, 1, 4096, 1 << 20, 1_000_000).unwrap();
        assert!(long.replaced && long.kept_fresh > long.kept_now, "{long:?}");
        assert!(p.feasible(&long.owners));
        assert!(long.moved > 0 && long.moved < 4 * 16);
        let short = replace_if_it_pays(&p, &current, 1, 4096, 1 << 30, 1).unwrap();
        assert!(!short.replaced);
        assert_eq!(short.owners, current);
        assert_eq!(short.moved, long.moved);
    }

    #[test]
    fn renaming_keeps_every_pair_and_matches_devices() {
        let t = random_trace(3, 8, 6);
        let p = problem(&t, 8, 4);
        let placed = place(&p).unwrap();
        // The same placement under other names comes back as it was.
        let shuffled: Owners = placed
            .iter()
            .map(|row| row.iter().map(|&d| (d + 1) % 4).collect())
            .collect();
        assert_eq!(p.staying(&shuffled), p.staying(&placed));
        assert_eq!(renamed_to_match(shuffled, &placed, 4), placed);
    }
}
