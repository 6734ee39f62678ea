//! The order in which compute asks the host tier for experts in a step:
//! what the prefetcher walks and what schedule-distance eviction measures
//! (`strata_tiers::HostCache::set_schedule`).
//!
//! One device: forward layers 0..L-1 (compute params, experts in index
//! order), then backward L-1..0 (experts in reverse order: compute params
//! for the backward, then the full record for the update). When the
//! pipeline overlaps, the next expert's compute params are asked for before
//! this one's update, so a layer's backward reads C(r0), C(r1), F(r0),
//! C(r2), F(r1), …, F(rn).
//!
//! The host tier keeps what the forward loads last until the backward,
//! which starts with it: so when one device's pipeline overlaps, the last
//! accesses of the forward, as many as the host tier has streaming slots
//! (those not keeping a record resident; at most a layer), ask for the
//! full record. The prefetcher then reads their optimizer
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
    backward_deferring(l, experts, overlapped, &[])
}

/// `backward_of`, without the update's access of the experts in
/// `deferred` (their updates come in the next step's forward).
fn backward_deferring(
    l: usize,
    experts: &[usize],
    overlapped: bool,
    deferred: &[ExpertId],
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
    order.retain(|a| !(a.1 == Parts::Full && deferred.contains(&a.0)));
    order
}

/// The one-device schedule of a whole step; the forward's last
/// `tail_slots` accesses (at most a layer) ask for the full record when
/// the pipeline overlaps. An expert in `deferred` has its update's access
/// (the full record) just before its forward's, and none in the backward.
pub(crate) fn access_schedule(
    model: &ModelConfig,
    overlapped: bool,
    tail_slots: usize,
    deferred: &[ExpertId],
) -> Vec<Access> {
    let all: Vec<usize> = (0..model.experts).collect();
    let reversed: Vec<usize> = all.iter().rev().copied().collect();
    let mut order = Vec::new();
    for l in 0..model.layers {
        order.extend(forward_of(l, &all));
    }
    if overlapped {
        let n = order.len();
        for access in &mut order[n - tail_slots.min(model.experts)..] {
            access.1 = Parts::Full;
        }
    }
    let forward = std::mem::take(&mut order);
    for (expert, parts) in forward {
        if deferred.contains(&expert) {
            order.push((expert, Parts::Full)); // its held update
            order.push((expert, Parts::Compute));
        } else {
            order.push((expert, parts));
        }
    }
    for l in (0..model.layers).rev() {
        order.extend(backward_deferring(l, &reversed, overlapped, deferred));
    }
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
/// `devices`, rotated to start at `from` (the schedule is cyclic).
pub(crate) fn placed_schedule(
    model: &ModelConfig,
    overlapped: bool,
    devices: usize,
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
                (0..devices).map(|d| forward_of(l, &mine(p, d))).collect(),
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
                (0..devices)
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
        let one = access_schedule(&m, true, 0, &[]);
        let placed = [None, None];
        assert_eq!(
            placed_schedule(&m, true, 2, &placed, Phase::Forward(0)),
            one
        );
        let mut rotated = one.clone();
        rotated.rotate_left(8 + 8);
        assert_eq!(
            placed_schedule(&m, true, 2, &placed, Phase::Backward(0)),
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
        let order = placed_schedule(&m, false, 2, &placed, Phase::Forward(0));
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
        let order = access_schedule(&m, true, 3, &[]);
        assert_eq!(&order[..4], &[c(0, 0), c(0, 1), c(0, 2), c(0, 3)]);
        assert_eq!(&order[4..8], &[c(1, 0), f(1, 1), f(1, 2), f(1, 3)]);
        // The backward is unchanged; a host tier beyond a layer stops at it.
        assert_eq!(order[8..], access_schedule(&m, true, 0, &[])[8..]);
        let wide = access_schedule(&m, true, 100, &[]);
        assert_eq!(
            &wide[..8],
            &[&order[..4], &[f(1, 0)], &order[5..8]].concat()
        );
        // Without the overlap nothing is read ahead, so nothing changes.
        assert!(access_schedule(&m, false, 3, &[])[..8]
            .iter()
            .all(|a| a.1 == Parts::Compute));
    }

    #[test]
    fn a_held_update_is_read_in_full_in_the_forward_and_not_in_the_backward() {
        let m = model();
        let c = |l, e| (id(l, e), Parts::Compute);
        let f = |l, e| (id(l, e), Parts::Full);
        let order = access_schedule(&m, true, 0, &[id(0, 1)]);
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
        assert_eq!(order.len(), access_schedule(&m, true, 0, &[]).len());
    }
}
