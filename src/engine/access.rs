//! The order in which compute asks the host tier for experts in a step:
//! what the prefetcher walks and what schedule-distance eviction measures
//! (`strata_tiers::HostCache::set_schedule`).
//!
//! One device: forward layers 0..L-1 (compute params, experts in index
//! order), then backward L-1..0 (experts in reverse order: compute params
//! for the backward, then the full record for the update), each over the
//! experts its routing sends tokens to (`routed_io.rs`). An expert whose
//! compute params are still on the device from its forward asks the
//! backward for its optimizer state alone (`Parts::State`), as its update
//! writes the compute part whole. When the
//! pipeline overlaps, the next expert's compute params are asked for before
//! this one's update, so a layer's backward reads C(r0), C(r1), F(r0),
//! C(r2), F(r1), …, F(rn).
//!
//! The host tier keeps what the forward loads last until the backward,
//! which starts with it: so when one device's pipeline overlaps, the last
//! accesses of the forward, as many as the host tier has streaming slots
//! (those not keeping a record resident; at most a layer), ask for the
//! full record (the last layer's last experts routed to). The prefetcher
//! then reads their optimizer
//! state while the forward computes, instead of in the backward, which
//! also writes every record back and so moves most of a step's bytes:
//! with the host tier holding a quarter of the experts of 4 layers, this
//! moves one eighth of the step's traffic from the backward to the forward.
//! (Not with several devices: their prefetch looks only host slots ÷
//! (2 × devices) ahead, so the tail would be read early for nothing.)
//!
//! Several devices: each walks its own experts of a layer in that pattern,
//! at the same time. Once a layer is placed, its accesses are the devices'
//! sequences interleaved position by position, which is the order they
//! arrive in when the devices keep pace; layers not yet placed keep the
//! one-device order.

use std::collections::HashSet;

use strata_tiers::{ExpertId, Parts};

use crate::model::ModelConfig;

type Access = (ExpertId, Parts);

/// A placed layer: each expert's device, and each device's token counts
/// per expert (an expert with none is not asked for).
pub(crate) struct PlacedLayer<'a> {
    pub owner: &'a [u16],
    pub counts: &'a [Vec<u32>],
}

impl PlacedLayer<'_> {
    fn has_tokens(&self, expert: usize) -> bool {
        self.counts.iter().any(|c| c[expert] > 0)
    }
}

/// Where in the step the schedule starts.
#[derive(Clone, Copy)]
pub(crate) enum Phase {
    Forward(usize),
    Backward(usize),
}

fn id(l: usize, e: usize) -> ExpertId {
    ExpertId::new(l as u32, e as u32)
}

fn forward_of(l: usize, experts: &[usize]) -> Vec<Access> {
    experts
        .iter()
        .map(|&e| (id(l, e), Parts::Compute))
        .collect()
}

/// One device's backward accesses over `experts` (already in reverse).
fn backward_of(l: usize, experts: &[usize], overlapped: bool) -> Vec<Access> {
    backward_deferring(l, experts, overlapped, &HashSet::new(), &HashSet::new())
}

/// `backward_of`, without the update's access of the experts in
/// `holding` (their updates come in a later step's forward); an expert in
/// `on_device` has its compute params on the device from its forward, so
/// the host tier is asked for no compute params of it, and its update
/// for its optimizer state alone (`Parts::State`: the update writes the
/// compute part whole).
fn backward_deferring(
    l: usize,
    experts: &[usize],
    overlapped: bool,
    holding: &HashSet<ExpertId>,
    on_device: &HashSet<ExpertId>,
) -> Vec<Access> {
    let mut order = Vec::new();
    let Some(&first) = experts.first() else {
        return order;
    };
    if overlapped {
        order.push((id(l, first), Parts::Compute));
        for w in experts.windows(2) {
            order.push((id(l, w[1]), Parts::Compute));
            order.push((id(l, w[0]), Parts::Full));
        }
        order.push((id(l, *experts.last().expect("not empty")), Parts::Full));
    } else {
        for &e in experts {
            order.push((id(l, e), Parts::Compute));
            order.push((id(l, e), Parts::Full));
        }
    }
    order.retain(|a| !(a.1 == Parts::Full && holding.contains(&a.0)));
    order.retain(|a| !(a.1 == Parts::Compute && on_device.contains(&a.0)));
    for a in order.iter_mut() {
        if a.1 == Parts::Full && on_device.contains(&a.0) {
            a.1 = Parts::State;
        }
    }
    order
}

/// What one device's step asks the host tier for.
pub(crate) struct Expected<'a> {
    /// Per layer: the experts with tokens, ascending (where a layer is not
    /// routed yet, the ones expected to get some).
    pub layers: &'a [Vec<usize>],
    /// Experts whose updates are held from their backward until their next
    /// forward (`EngineConfig::defer_last_layer_updates`): none in the backward.
    pub holding: &'a HashSet<ExpertId>,
    /// Experts with a held update, read in full just before their forward.
    pub held: &'a HashSet<ExpertId>,
    /// Whether experts update: where they are frozen, no access asks for
    /// a full record.
    pub updates: bool,
    /// Experts whose backward will find their compute params on the
    /// device (`DeviceSlots::replay_hits`): the backward asks the host
    /// tier for their optimizer state alone.
    pub on_device: &'a HashSet<ExpertId>,
}

/// The one-device schedule of a whole step over every expert; the
/// forward's last `tail_slots` accesses (at most a layer) ask for the full
/// record when the pipeline overlaps. An expert in `deferred` has its
/// update's access (the full record) just before its forward's, and none
/// in the backward. Where experts do not `update`, nothing asks for a
/// full record.
pub(crate) fn access_schedule(
    model: &ModelConfig,
    overlapped: bool,
    tail_slots: usize,
    deferred: &[ExpertId],
    updates: bool,
) -> Vec<Access> {
    let all: Vec<Vec<usize>> = vec![(0..model.experts).collect(); model.layers];
    let deferred: HashSet<ExpertId> = deferred.iter().copied().collect();
    let expected = Expected {
        layers: &all,
        holding: &deferred,
        held: &deferred,
        updates,
        on_device: &HashSet::new(),
    };
    routed_schedule(model, overlapped, tail_slots, &expected, Phase::Forward(0))
}

/// The one-device schedule of a step over the experts `expected` names,
/// rotated to start at `from` (the schedule is cyclic: past the step's
/// end it stands for the next step, whose routing is not known yet). The
/// last layer's last `tail_slots` experts ask for the full record in the
/// forward when the pipeline overlaps.
pub(crate) fn routed_schedule(
    model: &ModelConfig,
    overlapped: bool,
    tail_slots: usize,
    expected: &Expected<'_>,
    from: Phase,
) -> Vec<Access> {
    let mut order = Vec::new();
    let mut start = 0;
    for (l, experts) in expected.layers.iter().enumerate() {
        if matches!(from, Phase::Forward(f) if f == l) {
            start = order.len();
        }
        let tail = match overlapped && expected.updates && l + 1 == model.layers {
            true => experts.len() - tail_slots.min(experts.len()),
            false => experts.len(),
        };
        for (i, &e) in experts.iter().enumerate() {
            let expert = id(l, e);
            if expected.updates && expected.held.contains(&expert) {
                order.push((expert, Parts::Full)); // its held update
                order.push((expert, Parts::Compute));
            } else if i >= tail {
                order.push((expert, Parts::Full));
            } else {
                order.push((expert, Parts::Compute));
            }
        }
    }
    for (l, experts) in expected.layers.iter().enumerate().rev() {
        if matches!(from, Phase::Backward(b) if b == l) {
            start = order.len();
        }
        let reversed: Vec<usize> = experts.iter().rev().copied().collect();
        let mut backward = backward_deferring(
            l,
            &reversed,
            overlapped,
            expected.holding,
            expected.on_device,
        );
        if !expected.updates {
            backward.retain(|a| a.1 == Parts::Compute);
        }
        order.extend(backward);
    }
    order.rotate_left(start);
    order
}

/// Per-device sequences interleaved position by position.
fn interleave(sequences: Vec<Vec<Access>>) -> Vec<Access> {
    let longest = sequences.iter().map(Vec::len).max().unwrap_or(0);
    let mut order = Vec::new();
    for i in 0..longest {
        for s in &sequences {
            if let Some(&a) = s.get(i) {
                order.push(a);
            }
        }
    }
    order
}

/// The step's schedule with the placed layers' accesses interleaved across
/// `devices` (those whose experts this host tier holds: every device of a
/// process, or a rank's own), rotated to start at `from` (the schedule is
/// cyclic).
pub(crate) fn placed_schedule(
    model: &ModelConfig,
    overlapped: bool,
    devices: std::ops::Range<usize>,
    placed: &[Option<PlacedLayer<'_>>],
    from: Phase,
) -> Vec<Access> {
    let mine = |p: &PlacedLayer<'_>, d: usize| -> Vec<usize> {
        (0..model.experts)
            .filter(|&e| p.owner[e] as usize == d && p.has_tokens(e))
            .collect()
    };
    let all: Vec<usize> = (0..model.experts).collect();
    let reversed: Vec<usize> = all.iter().rev().copied().collect();
    let mut order = Vec::new();
    let mut start = 0;
    for (l, layer) in placed.iter().enumerate() {
        if matches!(from, Phase::Forward(f) if f == l) {
            start = order.len();
        }
        match layer {
            Some(p) => order.extend(interleave(
                devices
                    .clone()
                    .map(|d| forward_of(l, &mine(p, d)))
                    .collect(),
            )),
            None => order.extend(forward_of(l, &all)),
        }
    }
    for l in (0..model.layers).rev() {
        if matches!(from, Phase::Backward(b) if b == l) {
            start = order.len();
        }
        match &placed[l] {
            Some(p) => order.extend(interleave(
                devices
                    .clone()
                    .map(|d| {
                        let mut m = mine(p, d);
                        m.reverse();
                        backward_of(l, &m, overlapped)
                    })
                    .collect(),
            )),
            None => order.extend(backward_of(l, &reversed, overlapped)),
        }
    }
    order.rotate_left(start);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelConfig {
        ModelConfig {
            layers: 2,
            experts: 4,
            ..ModelConfig::default()
        }
    }

    #[test]
    fn unplaced_it_is_the_one_device_schedule_rotated() {
        let m = model();
        let one = access_schedule(&m, true, 0, &[], true);
        let placed = [None, None];
        assert_eq!(
            placed_schedule(&m, true, 0..2, &placed, Phase::Forward(0)),
            one
        );
        let mut rotated = one.clone();
        rotated.rotate_left(8 + 8);
        assert_eq!(
            placed_schedule(&m, true, 0..2, &placed, Phase::Backward(0)),
            rotated
        );
    }

    #[test]
    fn a_placed_layer_interleaves_the_devices_and_skips_idle_experts() {
        let m = model();
        let owner = [1u16, 0, 0, 1];
        // Expert 2 got no token on either device.
        let counts = [vec![1, 0, 0, 2], vec![3, 1, 0, 0]];
        let placed = [
            Some(PlacedLayer {
                owner: &owner,
                counts: &counts,
            }),
            None,
        ];
        let order = placed_schedule(&m, false, 0..2, &placed, Phase::Forward(0));
        let c = |l, e| (id(l, e), Parts::Compute);
        let f = |l, e| (id(l, e), Parts::Full);
        // Forward of layer 0: device 0 has [1], device 1 has [0, 3].
        assert_eq!(&order[..3], &[c(0, 1), c(0, 0), c(0, 3)]);
        // Backward of layer 0 ends the step: device 0 [1], device 1 [3, 0].
        let tail = &order[order.len() - 6..];
        assert_eq!(
            tail,
            &[c(0, 1), c(0, 3), f(0, 1), f(0, 3), c(0, 0), f(0, 0)]
        );
    }

    #[test]
    fn the_forward_ends_asking_for_what_the_host_tier_keeps_for_the_backward() {
        let m = model();
        let c = |l, e| (id(l, e), Parts::Compute);
        let f = |l, e| (id(l, e), Parts::Full);
        // Forward 0: C C C C; forward 1: C, then 3 host slots' worth of F.
        let order = access_schedule(&m, true, 3, &[], true);
        assert_eq!(&order[..4], &[c(0, 0), c(0, 1), c(0, 2), c(0, 3)]);
        assert_eq!(&order[4..8], &[c(1, 0), f(1, 1), f(1, 2), f(1, 3)]);
        // The backward is unchanged; a host tier beyond a layer stops at it.
        assert_eq!(order[8..], access_schedule(&m, true, 0, &[], true)[8..]);
        let wide = access_schedule(&m, true, 100, &[], true);
        assert_eq!(
            &wide[..8],
            &[&order[..4], &[f(1, 0)], &order[5..8]].concat()
        );
        // Without the overlap nothing is read ahead, so nothing changes.
        assert!(access_schedule(&m, false, 3, &[], true)[..8]
            .iter()
            .all(|a| a.1 == Parts::Compute));
    }

    #[test]
    fn a_held_update_is_read_in_full_in_the_forward_and_not_in_the_backward() {
        let m = model();
        let c = |l, e| (id(l, e), Parts::Compute);
        let f = |l, e| (id(l, e), Parts::Full);
        let order = access_schedule(&m, true, 0, &[id(0, 1)], true);
        assert_eq!(&order[..5], &[c(0, 0), f(0, 1), c(0, 1), c(0, 2), c(0, 3)]);
        // Layer 0's backward (the step's last 7 accesses, 8 less the update
        // of expert 1): its compute params only.
        let tail = &order[order.len() - 7..];
        assert_eq!(
            tail,
            &[
                c(0, 3),
                c(0, 2),
                f(0, 3),
                c(0, 1),
                f(0, 2),
                c(0, 0),
                f(0, 0)
            ]
        );
        assert_eq!(order.len(), access_schedule(&m, true, 0, &[], true).len());
    }

    #[test]
    fn an_expert_on_the_device_asks_the_backward_for_its_state_alone() {
        let m = model();
        let (c, f) = (
            |l, e| (id(l, e), Parts::Compute),
            |l, e| (id(l, e), Parts::Full),
        );
        let s = |l, e| (id(l, e), Parts::State);
        let all: Vec<Vec<usize>> = vec![(0..4).collect(); 2];
        let on_device: HashSet<ExpertId> = [id(1, 2), id(1, 0), id(0, 3)].into();
        let holding = [id(1, 2)].into();
        let expected = Expected {
            layers: &all,
            holding: &holding,
            held: &HashSet::new(),
            updates: true,
            on_device: &on_device,
        };
        let order = routed_schedule(&m, true, 0, &expected, Phase::Forward(0));
        // The forward is unchanged.
        assert!(order[..8].iter().all(|a| a.1 == Parts::Compute));
        // Layer 1's backward over 3, 2, 1, 0: 2's update is held, 2 and 0
        // are on the device.
        assert_eq!(
            &order[8..13],
            &[c(1, 3), f(1, 3), c(1, 1), f(1, 1), s(1, 0)]
        );
        assert_eq!(
            &order[13..],
            &[
                c(0, 2),
                s(0, 3),
                c(0, 1),
                f(0, 2),
                c(0, 0),
                f(0, 1),
                f(0, 0)
            ]
        );
    }
}
