//! A step's I/O follows its routing (one device). An expert that gets no
//! token in a pass is not read for its forward or its backward, and has
//! no update to read its state for or to write back; so the host tier's
//! schedule (`access.rs`) asks only for the experts a pass routes to.
//!
//! A layer's routing is known once its router has run, just before its
//! experts; from then on its accesses are exact, and once the forward has
//! routed every layer, so is the whole backward. Ahead of a layer's router
//! the prefetcher walks a prediction: what the layer's last routing asked
//! for (every expert before the first). With
//! `EngineConfig::affinity_prefetch`, the next layer's is drawn from
//! inter-layer affinity (ExFlow) as soon as this layer is routed (before
//! the next layer's attention runs): the token pairs counted between the
//! two layers' experts over the passes so far (the recent ones weighing
//! most) and this layer's routing give each next expert's expected
//! tokens, and those expected to get half a token or more are named (a
//! next layer whose experts have no pairs counted yet keeps its last
//! routing). Each step counts the prediction's misses (experts routed
//! that it left out) and unused names (experts it named that got no
//! token).
//!
//! The least a step must move between the SSD and the host tier follows
//! from its routing too: each routed expert's record once each way (its
//! compute params and its optimizer state read, the updated record
//! written), none for a record the host tier keeps resident (or for any,
//! where it holds them all), and only the compute params of frozen
//! experts. A host tier that still holds some records from the step
//! before (the streaming slots' last ones) can move less than that.

use std::collections::HashSet;

use strata_tiers::{ExpertId, HostCache, Layout};

use super::access::{routed_schedule, Expected, Phase};
use super::routing_trace::LayerPairs;
use super::slot_table::DeviceSlots;
use super::updates::SharedExperts;
use crate::math::Permutation;
use crate::model::ModelConfig;

/// One device's prediction of each layer's routing.
pub(crate) struct RoutedIo {
    /// Per layer, the experts expected to get tokens (ascending): this
    /// pass's where the layer is routed; the next layer's from affinity;
    /// the previous pass's for the rest.
    routed: Vec<Vec<usize>>,
    experts: usize,
    /// Whether the next layer is predicted from affinity
    /// (`EngineConfig::affinity_prefetch`) or, as the later ones, from its
    /// last routing.
    affinity: bool,
    /// `[l]`: E × E token pairs from expert a at layer l to b at l + 1,
    /// each pass's weighing [`PAIRS_DECAY`] of the one after it.
    transitions: Vec<Vec<f64>>,
    pairs: LayerPairs,
}

/// An expert is predicted for the next layer where the tokens expected to
/// reach it (from this layer's routing and the traced affinity) come to
/// this share of one token or more: missing an expert costs a read on
/// demand, naming one for nothing a compute part read ahead.
const EXPECTED_TOKENS_MIN: f64 = 0.5;

/// How much a pass's pairs weigh in the next pass's prediction against
/// its own: routing drifts as the router trains, so the recent pairs
/// describe it best (on moe-s's first 13 steps, pairs counted over the
/// whole run named 448 experts for nothing, these 401; docs/performance.md).
const PAIRS_DECAY: f64 = 0.5;

impl RoutedIo {
    /// Before any routing, every expert is expected.
    pub fn new(layers: usize, experts: usize, top_k: usize, affinity: bool) -> Self {
        Self {
            routed: vec![(0..experts).collect(); layers],
            experts,
            affinity,
            transitions: vec![vec![0.0; experts * experts]; layers.saturating_sub(1)],
            pairs: LayerPairs::new(experts, top_k),
        }
    }

    /// Whether the next layer is predicted from token pairs, which reads
    /// each pass's assignments.
    pub fn pairs_tokens(&self) -> bool {
        self.affinity
    }

    /// Records `layer`'s routing in this pass (`perm`; `experts`, those
    /// with tokens, ascending); returns how many experts the prediction
    /// missed (routed, not predicted) and how many it named for nothing
    /// (predicted, no token). The next layer's prediction is then made
    /// from this routing and the pairs traced so far.
    pub fn routed(&mut self, layer: usize, perm: &Permutation, experts: &[usize]) -> (u64, u64) {
        let predicted = std::mem::replace(&mut self.routed[layer], experts.to_vec());
        // Both ascending.
        let hits = experts
            .iter()
            .filter(|e| predicted.binary_search(e).is_ok())
            .count();
        if self.affinity {
            self.count_pairs(layer, perm);
            if layer + 1 < self.routed.len() {
                if let Some(next) = self.predict_next(layer, perm) {
                    self.routed[layer + 1] = next;
                }
            }
        }
        (
            (experts.len() - hits) as u64,
            (predicted.len() - hits) as u64,
        )
    }

    /// Adds this pass's pairs between the layer routed before and `layer`,
    /// the earlier passes' weighing less.
    fn count_pairs(&mut self, layer: usize, perm: &Permutation) {
        let e = self.experts;
        if let Some((before, pairs)) = self.pairs.routed(layer, perm) {
            let counts = &mut self.transitions[before];
            counts.iter_mut().for_each(|c| *c *= PAIRS_DECAY);
            for (from, to) in pairs {
                counts[from * e + to] += 1.0;
            }
        }
    }

    /// The experts of layer `layer + 1` expected to get
    /// [`EXPECTED_TOKENS_MIN`] of a token or more: Σ over this layer's
    /// experts a of (a's assignments) × P(b | a). `None` until some
    /// expert routed here has pairs traced.
    fn predict_next(&self, layer: usize, perm: &Permutation) -> Option<Vec<usize>> {
        let e = self.experts;
        let counts = &self.transitions[layer];
        let mut expected = vec![0.0f64; e];
        let mut known = false;
        for a in 0..e {
            let n = perm.count(a);
            let row = &counts[a * e..(a + 1) * e];
            let total: f64 = row.iter().sum();
            if n == 0 || total == 0.0 {
                continue;
            }
            known = true;
            for (x, &c) in expected.iter_mut().zip(row) {
                *x += n as f64 * c / total;
            }
        }
        known.then(|| {
            (0..e)
                .filter(|&b| expected[b] >= EXPECTED_TOKENS_MIN)
                .collect()
        })
    }

    /// The host tier's schedule from `from` on, `from`'s layer and those
    /// before it (in this pass) as routed, the later ones as predicted;
    /// the device stages `group` experts at a time (`DeviceState::group`).
    pub fn schedule(
        &self,
        model: &ModelConfig,
        shared: &SharedExperts,
        (overlapped, group): (bool, usize),
        from: Phase,
        slots: &DeviceSlots,
    ) -> Vec<(ExpertId, strata_tiers::Parts)> {
        let cache = &shared.cache;
        let holding = shared.deferring();
        let mut held = shared.held();
        // The layers already past come round again in the next step, when
        // the updates this step holds will be waiting.
        let past = match from {
            Phase::Forward(l) => l,
            Phase::Backward(_) => model.layers,
        };
        for (l, experts) in self.routed[..past].iter().enumerate() {
            let ids = experts.iter().map(|&e| ExpertId::new(l as u32, e as u32));
            held.extend(ids.filter(|id| holding.contains(id)));
        }
        let staging = (overlapped, group);
        let on_device = self.backward_on_device(model, shared.train, staging, past, slots);
        let expected = Expected {
            layers: &self.routed,
            holding: &holding,
            held: &held,
            updates: shared.train,
            on_device: &on_device,
        };
        // The forward's tail reads the last layer's full records ahead of
        // its backward: only once that layer is routed, or a prediction's
        // miss would read a whole record for nothing.
        let tail_slots = match past + 1 >= model.layers {
            true => cache.slot_count() - cache.kept_count(),
            false => 0,
        };
        routed_schedule(model, overlapped, tail_slots, &expected, from)
    }

    /// The experts whose backward will find their compute params on the
    /// device: the forward from layer `from` on and then the backward,
    /// over the experts each layer is expected to route to, replayed on
    /// the device's slot table (each backward frees its expert's slot
    /// where experts `update`). A wrong guess costs a read, never a
    /// result: an expert not on the device after all reads its compute
    /// params on demand.
    fn backward_on_device(
        &self,
        model: &ModelConfig,
        updates: bool,
        (overlapped, group): (bool, usize),
        from: usize,
        slots: &DeviceSlots,
    ) -> HashSet<ExpertId> {
        let key = |l: usize, e: usize| ExpertId::new(l as u32, e as u32).dense_index(self.experts);
        let forward = (from..model.layers).map(|l| {
            let keys = self.routed[l].iter().map(|&e| key(l, e)).collect();
            (keys, false)
        });
        let backward = (0..model.layers).rev().map(|l| {
            let keys = self.routed[l].iter().rev().map(|&e| key(l, e)).collect();
            (keys, updates)
        });
        let passes: Vec<(Vec<usize>, bool)> = forward.chain(backward).collect();
        let hits = slots.replay_hits(&passes, overlapped, group);
        let forward_passes = model.layers - from.min(model.layers);
        let backward_stages = passes.iter().zip(&hits).skip(forward_passes);
        backward_stages
            .flat_map(|((keys, _), hits)| keys.iter().zip(hits))
            .filter(|&(_, &hit)| hit)
            .map(|(&k, _)| ExpertId::from_dense_index(k, self.experts))
            .collect()
    }
}

/// Whether the host tier streams records (holds fewer than all of them):
/// only then does its schedule decide what moves.
pub(crate) fn streams(cache: &HostCache, model: &ModelConfig) -> bool {
    cache.slot_count() < model.layers * model.experts
}

/// The least a step with `tokens_per_expert` ([layer][expert]) must move
/// between the SSD and the host tier, both ways (see the module's text).
pub(crate) fn min_ssd_bytes(
    cache: &HostCache,
    layout: &Layout,
    model: &ModelConfig,
    train: bool,
    tokens_per_expert: &[Vec<u32>],
) -> u64 {
    if !streams(cache, model) {
        return 0;
    }
    let kept = cache.kept();
    let per_expert = match train {
        true => 2 * layout.record_bytes(),
        false => layout.compute_part_bytes(),
    };
    let moved = tokens_per_expert
        .iter()
        .enumerate()
        .flat_map(|(l, row)| {
            row.iter()
                .enumerate()
                .filter(|&(_, &t)| t > 0)
                .map(move |(e, _)| ExpertId::new(l as u32, e as u32))
        })
        .filter(|id| !kept.contains(id))
        .count();
    moved as u64 * per_expert
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prediction_counts_its_misses_and_its_unused_experts() {
        let mut io = RoutedIo::new(2, 4, 1, true);
        let perm = |experts: &[u32]| Permutation::from_routing(experts, 4);
        // Before any routing every expert is expected: nothing missed,
        // the two without tokens unused.
        assert_eq!(io.routed(0, &perm(&[1, 3, 3]), &[1, 3]), (0, 2));
        // Nothing traced yet: layer 1 keeps every expert.
        assert_eq!(io.routed[1], [0, 1, 2, 3]);
        assert_eq!(io.routed(1, &perm(&[2, 0, 0]), &[0, 2]), (0, 2));
        // The next pass predicts layer 0 from its last routing, [1, 3]:
        // 2 missed (0, 2), 1 unused (3).
        assert_eq!(io.routed(0, &perm(&[0, 1, 2]), &[0, 1, 2]), (2, 1));
        assert_eq!(io.routed[0], [0, 1, 2]);
    }

    #[test]
    fn the_next_layer_is_predicted_from_the_pairs_traced() {
        let mut io = RoutedIo::new(2, 4, 1, true);
        let perm = |experts: &[u32]| Permutation::from_routing(experts, 4);
        // Traced: tokens at 1 went to 2, tokens at 3 to 0 (twice) and 1.
        io.routed(0, &perm(&[1, 3, 3, 3]), &[1, 3]);
        io.routed(1, &perm(&[2, 0, 0, 1]), &[0, 1, 2]);
        // Two tokens at 1 expect two at 2; one at 3 expects 2/3 of a token
        // at 0 and 1/3 at 1 (under the half-token line).
        io.routed(0, &perm(&[1, 1, 3]), &[1, 3]);
        assert_eq!(io.routed[1], [0, 2]);
        // The prediction is what layer 1 is then held to.
        assert_eq!(io.routed(1, &perm(&[2, 2, 1]), &[1, 2]), (1, 1));
    }
}
