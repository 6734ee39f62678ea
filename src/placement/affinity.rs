//! Affinity placement (ExFlow, `../shared/papers/001_…` §IV-B–D): assign
//! every MoE layer's experts to devices so that the tokens that go from an
//! expert at layer l to an expert at layer l + 1 stay on one device as
//! often as they can, under each device's capacity (experts a layer) and
//! the load balance a per-layer placement keeps.
//!
//! The input is a routing trace's transition counts
//! ([`crate::engine::RoutingTrace`]): `T[l][a][b]`, the token pairs routed
//! to expert a at layer l and to expert b at layer l + 1. The objective is
//! the pairs that stay: `Σ_l Σ_{a,b} T[l][a][b] · [owner_l(a) = owner_{l+1}(b)]`.
//!
//! Two solvers: [`place_exact`], an integer program solved by `good_lp`'s
//! pure-Rust branch and bound (small cases only: it grows exponentially),
//! and [`place`], a heuristic for the sizes models have (64–256 experts,
//! 8–64 devices): a balanced start, then per layer, with its neighbours
//! fixed, moves and swaps that raise the pairs kept (each layer's problem
//! is then an assignment with fixed gains), sweeping the layers forward and
//! back until nothing improves.

use std::fmt;

/// What to place: the transitions of a routing trace, and the devices.
#[derive(Clone, Debug)]
pub struct AffinityProblem<'a> {
    pub layers: usize,
    pub experts: usize,
    pub devices: usize,
    /// `[l]`: E × E counts, row-major, from layer l (row) to l + 1
    /// (column); `layers − 1` of them.
    pub transitions: &'a [Vec<u64>],
    /// How far over the balanced placement's busiest device a device's
    /// tokens may go (0.1: 10 %).
    pub load_slack: f64,
}

/// Why a problem cannot be placed.
#[derive(Clone, Debug, PartialEq)]
pub struct AffinityError(pub String);

impl fmt::Display for AffinityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AffinityError {}

/// `[layer][expert]`: the device of each expert.
pub type Owners = Vec<Vec<u16>>;

impl AffinityProblem<'_> {
    pub(crate) fn check(&self) -> Result<(), AffinityError> {
        let bad = |why: String| Err(AffinityError(why));
        if self.devices == 0 || self.devices > u16::MAX as usize {
            return bad(format!("{} devices: need 1 to 65535", self.devices));
        }
        if self.layers == 0 || self.experts == 0 {
            return bad("no layers or no experts to place".into());
        }
        if self.transitions.len() != self.layers - 1 {
            return bad(format!(
                "{} transition matrices for {} layers: need {}",
                self.transitions.len(),
                self.layers,
                self.layers - 1
            ));
        }
        if let Some(t) = self
            .transitions
            .iter()
            .find(|t| t.len() != self.experts * self.experts)
        {
            return bad(format!(
                "a transition matrix of {} counts for {} experts: need {}",
                t.len(),
                self.experts,
                self.experts * self.experts
            ));
        }
        if self.load_slack.is_nan() || self.load_slack < 0.0 {
            return bad(format!("load slack {}: need ≥ 0", self.load_slack));
        }
        Ok(())
    }

    /// Experts a device may hold in a layer: an even share, rounded up.
    pub fn capacity(&self) -> usize {
        self.experts.div_ceil(self.devices)
    }

    /// `[layer][expert]`: the token pairs through each expert (its row's
    /// sum; the last layer's, its column's).
    pub fn loads(&self) -> Vec<Vec<u64>> {
        let e = self.experts;
        let mut loads = vec![vec![0u64; e]; self.layers];
        for (l, t) in self.transitions.iter().enumerate() {
            for a in 0..e {
                loads[l][a] = t[a * e..(a + 1) * e].iter().sum();
            }
            if l + 2 == self.layers {
                for b in 0..e {
                    loads[l + 1][b] = (0..e).map(|a| t[a * e + b]).sum();
                }
            }
        }
        loads
    }

    /// Per layer, the most tokens a device may take: the balanced start's
    /// busiest device (greedy LPT under the capacity) × (1 + slack), and
    /// never below the layer's largest expert.
    pub fn load_caps(&self) -> Vec<u64> {
        let start = balanced_start(self);
        let loads = self.loads();
        (0..self.layers)
            .map(|l| {
                let mut per_device = vec![0u64; self.devices];
                for (e, &d) in start[l].iter().enumerate() {
                    per_device[d as usize] += loads[l][e];
                }
                let busiest = per_device.iter().copied().max().unwrap_or(0);
                ((busiest as f64 * (1.0 + self.load_slack)).floor() as u64).max(busiest)
            })
            .collect()
    }

    /// The token pairs that stay on their device under `owners`.
    pub fn staying(&self, owners: &Owners) -> u64 {
        let e = self.experts;
        let mut kept = 0;
        for (l, t) in self.transitions.iter().enumerate() {
            for a in 0..e {
                for b in 0..e {
                    if owners[l][a] == owners[l + 1][b] {
                        kept += t[a * e + b];
                    }
                }
            }
        }
        kept
    }

    /// Every token pair traced.
    pub fn total(&self) -> u64 {
        self.transitions.iter().flatten().sum()
    }

    /// Whether `owners` respects the capacity and the load caps.
    pub fn feasible(&self, owners: &Owners) -> bool {
        let (loads, caps) = (self.loads(), self.load_caps());
        owners.len() == self.layers
            && owners.iter().enumerate().all(|(l, row)| {
                let mut count = vec![0usize; self.devices];
                let mut load = vec![0u64; self.devices];
                for (e, &d) in row.iter().enumerate() {
                    count[d as usize] += 1;
                    load[d as usize] += loads[l][e];
                }
                row.len() == self.experts
                    && count.iter().all(|&c| c <= self.capacity())
                    && load.iter().all(|&w| w <= caps[l])
            })
    }
}

/// Each layer placed for balance alone: experts by decreasing load, each
/// to the least loaded device with room (ties to the lower index). What
/// the engine's per-layer placement does, under a capacity.
pub fn balanced_start(problem: &AffinityProblem<'_>) -> Owners {
    let cap = problem.capacity();
    problem
        .loads()
        .iter()
        .map(|loads| {
            let mut order: Vec<usize> = (0..problem.experts).collect();
            order.sort_by_key(|&e| (std::cmp::Reverse(loads[e]), e));
            let mut count = vec![0usize; problem.devices];
            let mut load = vec![0u64; problem.devices];
            let mut owner = vec![0u16; problem.experts];
            for e in order {
                let d = (0..problem.devices)
                    .filter(|&d| count[d] < cap)
                    .min_by_key(|&d| (load[d], d))
                    .expect("capacity × devices ≥ experts");
                owner[e] = d as u16;
                count[d] += 1;
                load[d] += loads[e];
            }
            owner
        })
        .collect()
}

/// The heuristic. A start chained from one anchor layer, placed for
/// balance: each layer after it placed for the pairs it shares with the
/// layer before, each layer before it for those with the layer after.
/// Then sweeps: per layer, with both neighbours fixed, moves and swaps
/// that keep more pairs, within the capacity and the load caps, forward
/// and back until a sweep improves nothing. This from anchors at the
/// first, middle and last layer, then `PERTURBATIONS` times from the best
/// so far with one layer placed anew at random; the best found wins.
/// Deterministic.
pub fn place(problem: &AffinityProblem<'_>) -> Result<Owners, AffinityError> {
    problem.check()?;
    let (loads, caps) = (problem.loads(), problem.load_caps());
    let balanced = balanced_start(problem);
    let mut anchors = vec![0, problem.layers / 2, problem.layers - 1];
    anchors.dedup();
    let mut best: Option<(u64, Owners)> = None;
    let keep_best = |owners: Owners, best: &mut Option<(u64, Owners)>| {
        let kept = problem.staying(&owners);
        if best.as_ref().is_none_or(|b| kept > b.0) {
            *best = Some((kept, owners));
        }
    };
    for anchor in anchors {
        let mut owners = chained_start(problem, &balanced, &loads, &caps, anchor);
        sweep(problem, &loads, &caps, &mut owners);
        keep_best(owners, &mut best);
    }
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..PERTURBATIONS {
        let mut owners = best.as_ref().expect("an anchor ran").1.clone();
        perturb(problem, &loads, &caps, &mut owners, &mut rng);
        sweep(problem, &loads, &caps, &mut owners);
        keep_best(owners, &mut best);
    }
    Ok(best.expect("an anchor ran").1)
}

/// Restarts of the sweeps from the best placement with one layer shaken.
const PERTURBATIONS: usize = 24;

/// The start chained outward from `anchor` (see [`place`]).
fn chained_start(
    problem: &AffinityProblem<'_>,
    balanced: &Owners,
    loads: &[Vec<u64>],
    caps: &[u64],
    anchor: usize,
) -> Owners {
    let mut owners = balanced.clone();
    let outward = (anchor + 1..problem.layers)
        .map(|l| (l, l - 1))
        .chain((0..anchor).rev().map(|l| (l, l + 1)));
    for (l, from) in outward {
        let gains = neighbour_gains(problem, &owners, l, from);
        improve_layer(problem, &gains, &loads[l], caps[l], &mut owners[l]);
    }
    owners
}

/// Per layer with both neighbours fixed, moves and swaps, forward and
/// back, until a sweep improves nothing.
fn sweep(problem: &AffinityProblem<'_>, loads: &[Vec<u64>], caps: &[u64], owners: &mut Owners) {
    const MAX_SWEEPS: usize = 50;
    for round in 0..MAX_SWEEPS {
        let mut improved = false;
        for i in 0..problem.layers {
            let l = match round % 2 {
                0 => i,
                _ => problem.layers - 1 - i,
            };
            let gains = layer_gains(problem, owners, l);
            improved |= improve_layer(problem, &gains, &loads[l], caps[l], &mut owners[l]);
        }
        if !improved {
            return;
        }
    }
}

/// Places one layer (chosen at random) anew at random: its experts in a
/// random order, each to a random device with room under the load cap (a
/// few tries; the layer stays as it was if none fits).
fn perturb(
    problem: &AffinityProblem<'_>,
    loads: &[Vec<u64>],
    caps: &[u64],
    owners: &mut Owners,
    rng: &mut u64,
) {
    let mut next = || {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng as usize
    };
    let (e, n, room) = (problem.experts, problem.devices, problem.capacity());
    let l = next() % problem.layers;
    'attempt: for _ in 0..8 {
        let mut order: Vec<usize> = (0..e).collect();
        for i in (1..e).rev() {
            order.swap(i, next() % (i + 1));
        }
        let (mut count, mut load) = (vec![0usize; n], vec![0u64; n]);
        let mut owner = vec![0u16; e];
        for x in order {
            let fits: Vec<usize> = (0..n)
                .filter(|&d| count[d] < room && load[d] + loads[l][x] <= caps[l])
                .collect();
            if fits.is_empty() {
                continue 'attempt;
            }
            let d = fits[next() % fits.len()];
            owner[x] = d as u16;
            count[d] += 1;
            load[d] += loads[l][x];
        }
        owners[l] = owner;
        return;
    }
}

/// `[expert][device]`: the token pairs layer `l`'s expert would share
/// with layer `from`'s (l − 1 or l + 1) on that device.
fn neighbour_gains(
    problem: &AffinityProblem<'_>,
    owners: &Owners,
    l: usize,
    from: usize,
) -> Vec<Vec<u64>> {
    let (e, n) = (problem.experts, problem.devices);
    let mut gains = vec![vec![0u64; n]; e];
    for (x, gain) in gains.iter_mut().enumerate() {
        for y in 0..e {
            let pairs = match from < l {
                true => problem.transitions[from][y * e + x],
                false => problem.transitions[l][x * e + y],
            };
            gain[owners[from][y] as usize] += pairs;
        }
    }
    gains
}

/// `[expert][device]`: the token pairs layer `l`'s expert would keep on
/// that device, given both its neighbours' owners.
fn layer_gains(problem: &AffinityProblem<'_>, owners: &Owners, l: usize) -> Vec<Vec<u64>> {
    let mut gains = vec![vec![0u64; problem.devices]; problem.experts];
    let neighbours = [
        l.checked_sub(1),
        Some(l + 1).filter(|&n| n < problem.layers),
    ];
    for from in neighbours.into_iter().flatten() {
        for (sum, part) in gains
            .iter_mut()
            .zip(neighbour_gains(problem, owners, l, from))
        {
            sum.iter_mut().zip(part).for_each(|(s, p)| *s += p);
        }
    }
    gains
}

/// Moves and swaps within one layer while one raises the gain and keeps
/// the capacity and `cap`; returns whether anything changed.
fn improve_layer(
    problem: &AffinityProblem<'_>,
    gains: &[Vec<u64>],
    loads: &[u64],
    cap: u64,
    owner: &mut [u16],
) -> bool {
    let (e, n, room) = (problem.experts, problem.devices, problem.capacity());
    let mut count = vec![0usize; n];
    let mut load = vec![0u64; n];
    for (x, &d) in owner.iter().enumerate() {
        count[d as usize] += 1;
        load[d as usize] += loads[x];
    }
    let gain = |x: usize, d: usize| gains[x][d] as i64;
    let mut changed = false;
    loop {
        let mut best: Option<(i64, usize, usize, Option<usize>)> = None;
        for x in 0..e {
            let dx = owner[x] as usize;
            // Moves to a device with room.
            for d in 0..n {
                let delta = gain(x, d) - gain(x, dx);
                if d != dx
                    && delta > 0
                    && count[d] < room
                    && load[d] + loads[x] <= cap
                    && best.is_none_or(|b| delta > b.0)
                {
                    best = Some((delta, x, d, None));
                }
            }
            // Swaps with an expert on another device.
            for y in x + 1..e {
                let dy = owner[y] as usize;
                if dx == dy {
                    continue;
                }
                let delta = gain(x, dy) + gain(y, dx) - gain(x, dx) - gain(y, dy);
                let fits =
                    load[dy] - loads[y] + loads[x] <= cap && load[dx] - loads[x] + loads[y] <= cap;
                if delta > 0 && fits && best.is_none_or(|b| delta > b.0) {
                    best = Some((delta, x, dy, Some(y)));
                }
            }
        }
        let Some((_, x, d, swap)) = best else {
            return changed;
        };
        let dx = owner[x] as usize;
        load[dx] -= loads[x];
        load[d] += loads[x];
        owner[x] = d as u16;
        match swap {
            Some(y) => {
                load[d] -= loads[y];
                load[dx] += loads[y];
                owner[y] = dx as u16;
            }
            None => {
                count[dx] -= 1;
                count[d] += 1;
            }
        }
        changed = true;
    }
}

pub use super::affinity_exact::{place_exact, EXACT_MAX_CELLS};
pub use super::affinity_levels::{
    level_shares, place_two_level, replace_if_it_pays, LevelShares, Replacement,
};

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A trace of `layers` × `experts` whose pairs are random (xorshift
    /// from `seed`), a share of them zero.
    pub(crate) fn random_trace(layers: usize, experts: usize, seed: u64) -> Vec<Vec<u64>> {
        let mut s = seed.max(1);
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        (0..layers - 1)
            .map(|_| {
                (0..experts * experts)
                    .map(|_| match next() % 100 {
                        r if r >= 60 => r,
                        _ => 0,
                    })
                    .collect()
            })
            .collect()
    }

    pub(crate) fn problem(
        transitions: &[Vec<u64>],
        experts: usize,
        devices: usize,
    ) -> AffinityProblem<'_> {
        AffinityProblem {
            layers: transitions.len() + 1,
            experts,
            devices,
            transitions,
            load_slack: 0.1,
        }
    }

    #[test]
    fn a_chain_of_experts_is_kept_whole() {
        // Every token at expert a goes to expert (a + 1) mod 4 next: a
        // placement following the chain keeps every pair.
        let e = 4;
        let chain: Vec<u64> = (0..e * e)
            .map(|i| u64::from((i / e + 1) % e == i % e) * 10)
            .collect();
        let t = vec![chain.clone(), chain];
        let p = problem(&t, e, 2);
        let owners = place(&p).unwrap();
        assert!(p.feasible(&owners));
        assert_eq!(p.staying(&owners), p.total());
        // The balanced start keeps about half of them.
        assert!(p.staying(&balanced_start(&p)) < p.total());
    }

    #[test]
    fn the_heuristic_is_feasible_and_never_below_its_start() {
        for seed in 1..20 {
            let t = random_trace(4, 16, seed);
            for devices in [2, 4, 8] {
                let p = problem(&t, 16, devices);
                let owners = place(&p).unwrap();
                assert!(p.feasible(&owners), "seed {seed}, {devices} devices");
                assert!(p.feasible(&balanced_start(&p)));
                assert!(p.staying(&owners) >= p.staying(&balanced_start(&p)));
            }
        }
    }

    #[test]
    fn a_malformed_problem_is_named() {
        let t = random_trace(3, 4, 1);
        let mut p = problem(&t, 4, 2);
        p.layers = 4;
        assert!(place(&p)
            .unwrap_err()
            .0
            .contains("2 transition matrices for 4 layers"));
        let mut p = problem(&t, 5, 2);
        p.experts = 5;
        assert!(place(&p).unwrap_err().0.contains("16 counts for 5 experts"));
        let p = problem(&t, 4, 0);
        assert!(place(&p).unwrap_err().0.contains("0 devices"));
    }
}
