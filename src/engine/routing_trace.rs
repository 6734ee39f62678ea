//! Inter-layer expert affinity (ExFlow): how often a token routed to expert
//! e at one MoE layer is routed to expert e' at the next, counted over the
//! steps traced (`EngineConfig::trace_routing`). Top-k aware: a token adds
//! one to each of its k × k (e, e') pairs.

use serde::{Deserialize, Serialize};

use crate::comm::Comm;
use crate::math::Permutation;
use crate::EngineError;

/// Transition counts between consecutive MoE layers, summed over steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoutingTrace {
    /// MoE layers (the transitions are between `layers − 1` pairs).
    pub layers: usize,
    pub experts: usize,
    pub top_k: usize,
    /// Training steps counted.
    pub steps: u64,
    /// `[l]`: E × E counts, row-major, from MoE layer l (row) to l + 1
    /// (column).
    pub transitions: Vec<Vec<u64>>,
}

impl RoutingTrace {
    pub fn new(layers: usize, experts: usize, top_k: usize) -> Self {
        Self {
            layers,
            experts,
            top_k,
            steps: 0,
            transitions: vec![vec![0; experts * experts]; layers.saturating_sub(1)],
        }
    }

    /// P(e' at layer l + 1 | e at layer l), E × E row-major: each row of
    /// counts divided by its sum (a row with no tokens stays zero).
    pub fn conditional(&self, l: usize) -> Vec<f64> {
        let e = self.experts;
        let mut p = vec![0.0; e * e];
        for (row, counts) in p
            .chunks_exact_mut(e)
            .zip(self.transitions[l].chunks_exact(e))
        {
            let total: u64 = counts.iter().sum();
            if total > 0 {
                for (p, &c) in row.iter_mut().zip(counts) {
                    *p = c as f64 / total as f64;
                }
            }
        }
        p
    }

    /// The counts and, beside them, every layer pair's conditional
    /// probabilities (`conditional`), as JSON a plotting tool reads.
    pub fn to_json(&self) -> String {
        let conditional: Vec<Vec<f64>> = (0..self.transitions.len())
            .map(|l| self.conditional(l))
            .collect();
        let mut value = serde_json::to_value(self).expect("a trace serializes");
        value["conditional"] = serde_json::to_value(conditional).expect("floats serialize");
        serde_json::to_string(&value).expect("JSON")
    }

    /// No transitions, `steps` steps counted: a rank's own share of a
    /// resumed trace other than rank 0's.
    pub fn empty_at(&self, steps: u64) -> Self {
        Self {
            steps,
            ..Self::new(self.layers, self.experts, self.top_k)
        }
    }

    /// Adds another trace's counts and steps (the same shape).
    pub fn add(&mut self, other: &RoutingTrace) {
        assert_eq!(
            (self.layers, self.experts, self.top_k),
            (other.layers, other.experts, other.top_k),
            "traces of one model"
        );
        self.steps += other.steps;
        for (mine, theirs) in self.transitions.iter_mut().zip(&other.transitions) {
            mine.iter_mut().zip(theirs).for_each(|(a, b)| *a += b);
        }
    }
}

/// Every rank's `mine` summed: the counts added, the steps (the same on
/// every rank) kept.
pub(super) fn sum_over_ranks(
    comm: &mut dyn Comm,
    mine: RoutingTrace,
) -> Result<RoutingTrace, EngineError> {
    let words: Vec<u32> = mine
        .transitions
        .iter()
        .flatten()
        .flat_map(|&c| [c as u32, (c >> 32) as u32])
        .collect();
    let mut total = mine.empty_at(mine.steps);
    for theirs in comm.all_gather_u32(words)? {
        let mut counts = theirs
            .chunks_exact(2)
            .map(|w| u64::from(w[0]) | u64::from(w[1]) << 32);
        for c in total.transitions.iter_mut().flatten() {
            *c += counts.next().ok_or_else(|| {
                EngineError::Config("the ranks trace routing of other shapes".into())
            })?;
        }
    }
    Ok(total)
}

/// The last MoE layer's choices of the micro-batch in progress, to pair
/// with the next layer's: what both the trace and the affinity prefetch
/// (`routed_io.rs`) count.
pub(crate) struct LayerPairs {
    experts: usize,
    top_k: usize,
    /// The layer last routed, if any, and its experts in `last` (T · K, in
    /// assignment order); `now` is the next layer's, reused.
    last_layer: Option<usize>,
    last: Vec<u32>,
    now: Vec<u32>,
}

impl LayerPairs {
    pub fn new(experts: usize, top_k: usize) -> Self {
        Self {
            experts,
            top_k,
            last_layer: None,
            last: Vec::new(),
            now: Vec::new(),
        }
    }

    /// Layer `layer` routed its tokens as `perm` says. Where the layer
    /// before it routed the same tokens, returns that layer and each
    /// token's (expert there, expert here) pairs, k × k a token.
    pub fn routed(
        &mut self,
        layer: usize,
        perm: &Permutation,
    ) -> Option<(usize, impl Iterator<Item = (usize, usize)> + '_)> {
        assignment_experts(perm, self.experts, &mut self.now);
        let before = self
            .last_layer
            .filter(|&b| b + 1 == layer && self.last.len() == self.now.len());
        std::mem::swap(&mut self.last, &mut self.now);
        self.last_layer = Some(layer);
        let k = self.top_k;
        let (from, to) = (&self.now, &self.last);
        before.map(|b| {
            let pairs = from
                .chunks_exact(k)
                .zip(to.chunks_exact(k))
                .flat_map(|(p, n)| {
                    p.iter()
                        .flat_map(move |&a| n.iter().map(move |&b| (a as usize, b as usize)))
                });
            (b, pairs)
        })
    }

    /// Forgets the layer last routed (a new pass pairs nothing with it).
    pub fn forget(&mut self) {
        self.last_layer = None;
    }
}

/// One device's counting within a step.
pub(crate) struct TransitionCounter {
    pub trace: RoutingTrace,
    pairs: LayerPairs,
}

impl TransitionCounter {
    pub fn new(layers: usize, experts: usize, top_k: usize) -> Self {
        Self {
            trace: RoutingTrace::new(layers, experts, top_k),
            pairs: LayerPairs::new(experts, top_k),
        }
    }

    /// Layer `layer` routed its tokens as `perm` says; counts the pairs with
    /// the layer before it where that one routed the same tokens.
    pub fn routed(&mut self, layer: usize, perm: &Permutation) {
        let e = self.trace.experts;
        if let Some((before, pairs)) = self.pairs.routed(layer, perm) {
            let counts = &mut self.trace.transitions[before];
            for (from, to) in pairs {
                counts[from * e + to] += 1;
            }
        }
    }

    /// Adds the counts so far to `total` and starts again from zero.
    pub fn drain_into(&mut self, total: &mut RoutingTrace) {
        total.add(&self.trace);
        self.clear();
    }

    /// Forgets the counts so far (an evaluation's).
    pub fn clear(&mut self) {
        self.trace.transitions.iter_mut().for_each(|t| t.fill(0));
        self.pairs.forget();
    }
}

/// Each assignment's expert (token t's k choices at t·k … t·k + k − 1),
/// from the permutation that sorted them by expert, into `out`.
fn assignment_experts(perm: &Permutation, experts: usize, out: &mut Vec<u32>) {
    out.clear();
    out.resize(perm.order.len(), 0);
    for e in 0..experts {
        let rows = perm.offsets[e] as usize..perm.offsets[e + 1] as usize;
        for &a in &perm.order[rows] {
            out[a as usize] = e as u32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transitions_pair_each_tokens_choices_at_consecutive_layers() {
        // Three tokens, top-2, four experts.
        let layer0 = [0u32, 1, 2, 3, 0, 3];
        let layer1 = [1u32, 2, 1, 0, 3, 2];
        let mut c = TransitionCounter::new(3, 4, 2);
        c.routed(0, &Permutation::from_routing(&layer0, 4));
        c.routed(1, &Permutation::from_routing(&layer1, 4));
        let mut t = RoutingTrace::new(3, 4, 2);
        c.drain_into(&mut t);
        let mut want = vec![0u64; 16];
        for (p, n) in layer0.chunks(2).zip(layer1.chunks(2)) {
            for &a in p {
                for &b in n {
                    want[a as usize * 4 + b as usize] += 1;
                }
            }
        }
        assert_eq!(t.transitions[0], want);
        assert_eq!(t.transitions[0].iter().sum::<u64>(), 3 * 2 * 2);
        assert!(t.transitions[1].iter().all(|&x| x == 0));
        // Expert 0 at layer 0 (tokens 0 and 2) went to 1, 2, 3, 2.
        let p = t.conditional(0);
        assert_eq!(&p[..4], &[0.0, 0.25, 0.5, 0.25]);
        // A layer skipped (a new micro-batch's first layer) pairs nothing.
        c.routed(2, &Permutation::from_routing(&layer1, 4));
        c.routed(0, &Permutation::from_routing(&layer0, 4));
        assert!(c.trace.transitions.iter().flatten().all(|&x| x == 0));
        // Drained, the counter starts from zero.
        c.routed(1, &Permutation::from_routing(&layer1, 4));
        c.clear();
        assert!(c.trace.transitions.iter().flatten().all(|&x| x == 0));
    }
}
