//! A step's I/O follows its routing (one device). An expert that gets no
//! token in a pass is not read for its forward or its backward, and has
//! no update to read its state for or to write back; so the host tier's
//! schedule (`access.rs`) asks only for the experts a pass routes to.
//!
//! A layer's routing is known once its router has run, just before its
//! experts; from then on its accesses are exact, and once the forward has
//! routed every layer, so is the whole backward. Ahead of a layer's router
//! the prefetcher walks what that layer's last routing asked for (the
//! previous pass's, or every expert before the first): a prediction whose
//! misses (experts routed that it left out) and unused reads (experts it
//! named that got no token) each step counts.
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
use super::updates::SharedExperts;
use crate::model::ModelConfig;

/// One device's prediction of each layer's routing.
pub(crate) struct RoutedIo {
    /// Per layer, the experts with tokens in the latest pass that routed
    /// it (ascending): this pass's where the layer is routed, the
    /// previous pass's (the prediction) where not yet.
    routed: Vec<Vec<usize>>,
}

impl RoutedIo {
    /// Before any routing, every expert is expected.
    pub fn new(layers: usize, experts: usize) -> Self {
        Self {
            routed: vec![(0..experts).collect(); layers],
        }
    }

    /// Records `layer`'s routing in this pass (`experts` ascending);
    /// returns how many experts the prediction missed (routed, not
    /// predicted) and how many it named for nothing (predicted, no token).
    pub fn routed(&mut self, layer: usize, experts: &[usize]) -> (u64, u64) {
        let predicted: HashSet<usize> = self.routed[layer].iter().copied().collect();
        let hits = experts.iter().filter(|e| predicted.contains(e)).count();
        self.routed[layer].clear();
        self.routed[layer].extend_from_slice(experts);
        (
            (experts.len() - hits) as u64,
            (predicted.len() - hits) as u64,
        )
    }

    /// The host tier's schedule from `from` on, `from`'s layer and those
    /// before it (in this pass) as routed, the later ones as predicted.
    pub fn schedule(
        &self,
        model: &ModelConfig,
        shared: &SharedExperts,
        overlapped: bool,
        from: Phase,
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
        let expected = Expected {
            layers: &self.routed,
            holding: &holding,
            held: &held,
            updates: shared.train,
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
        let mut io = RoutedIo::new(2, 4);
        // Before any routing every expert is expected: nothing missed,
        // the two without tokens unused.
        assert_eq!(io.routed(0, &[1, 3]), (0, 2));
        // The next pass predicts [1, 3]: 2 missed (0, 2), 1 unused (3).
        assert_eq!(io.routed(0, &[0, 1, 2]), (2, 1));
        assert_eq!(io.routed[0], [0, 1, 2]);
        assert_eq!(io.routed[1], [0, 1, 2, 3]);
    }
}
