//! One device of the engine: its tier (an arena carved into expert slots,
//! [`DeviceSlots`] saying which expert version each holds and which are
//! pinned), what its forward kept for the backward, and its counters.

use std::collections::VecDeque;

use super::routed_io::RoutedIo;
use super::routing_trace::TransitionCounter;
use crate::backend::ExpertDevice;
use crate::math::ExpertSaved;
use crate::model::{F32BufferPool, ScratchBuffers};

/// Per-step counters of one device.
#[derive(Default)]
pub(crate) struct Accumulators {
    pub stall_upload_s: f64,
    pub stall_optimizer_s: f64,
    pub bytes_host_to_device: u64,
    pub bytes_device_to_host: u64,
    pub device_hits: u64,
    pub device_misses: u64,
    /// [layer][expert] assignments routed from this device's tokens.
    pub tokens_per_expert: Vec<Vec<u32>>,
    /// Expert assignments this device computed (all layers, both passes).
    pub assignments_computed: u64,
    /// Seconds in expert GEMMs (the placement cost model's input).
    pub expert_compute_s: f64,
    /// Experts routed to that the forward's prediction left out, and
    /// experts it named that got no token (`routed_io.rs`).
    pub prediction_missed: u64,
    pub prediction_unused: u64,
    /// Assignments condensed into another of their expert's rows before
    /// this device sent them (`EngineConfig::condense`).
    pub condensed: u64,
    /// Seconds in collectives with the other devices (modeled waits of
    /// `EngineConfig::link` included).
    pub comm_s: f64,
    /// The MoE layers' token exchanges (all-to-alls) this device ran.
    pub token_exchanges: u64,
    /// Seconds in the MoE layers' exchanges (compute inside), and what the
    /// exchange's cost model predicted for them.
    pub exchange_s: f64,
    pub exchange_model_s: f64,
    /// [forward, backward] seconds of the exchanges' own work on this
    /// device (`StepMetrics::exchange_local_s_per_device`), and seconds it
    /// waited for the wire (inside `exchange_s`).
    pub exchange_local_s: [f64; 2],
    pub exchange_wait_s: f64,
    /// [forward, backward] experts the exchanges computed on this device.
    pub exchange_experts: [u64; 2],
    /// [layer][forward, backward] seconds in the layer's exchange (summed
    /// over micro-batches), and the parts it went in.
    pub exchange_layer_s: Vec<[f64; 2]>,
    pub exchange_layer_parts: Vec<[usize; 2]>,
}

impl Accumulators {
    pub fn new(layers: usize, experts: usize) -> Self {
        Self {
            tokens_per_expert: vec![vec![0; experts]; layers],
            exchange_layer_s: vec![[0.0; 2]; layers],
            exchange_layer_parts: vec![[0; 2]; layers],
            ..Self::default()
        }
    }
}

/// Which expert (and which version of its params) each device slot holds.
#[derive(Clone)]
pub(crate) struct DeviceSlots {
    owner: Vec<Option<(usize, u64)>>,
    last_use: Vec<u64>,
    clock: u64,
    /// Per expert key: kept resident on this device (never evicted).
    pinned: Vec<bool>,
}

impl DeviceSlots {
    pub fn new(slot_count: usize, experts: usize) -> Self {
        Self {
            owner: vec![None; slot_count],
            last_use: vec![0; slot_count],
            clock: 0,
            pinned: vec![false; experts],
        }
    }

    pub fn slot_count(&self) -> usize {
        self.owner.len()
    }

    /// The slot holding `key` at `version`. A slot holding an older version
    /// is freed.
    pub fn lookup(&mut self, key: usize, version: u64) -> Option<usize> {
        let slot = self
            .owner
            .iter()
            .position(|o| o.is_some_and(|(k, _)| k == key))?;
        if self.owner[slot] != Some((key, version)) {
            self.owner[slot] = None;
            return None;
        }
        self.clock += 1;
        self.last_use[slot] = self.clock;
        Some(slot)
    }

    /// A slot for `key`: a free one, else the least recently used one that
    /// is neither in `protect` nor holding a pinned expert.
    pub fn claim(&mut self, key: usize, version: u64, protect: &[usize]) -> usize {
        let pinned = &self.pinned;
        let slot = (0..self.owner.len())
            .filter(|s| !protect.contains(s))
            .filter(|&s| !self.owner[s].is_some_and(|(k, _)| pinned[k]))
            .min_by_key(|&s| (self.owner[s].is_some(), self.last_use[s]))
            .expect("pinning leaves at least two claimable slots");
        self.clock += 1;
        self.owner[slot] = Some((key, version));
        self.last_use[slot] = self.clock;
        slot
    }

    /// Frees `key`'s slot (its params are about to change).
    pub fn invalidate(&mut self, key: usize) {
        for o in self.owner.iter_mut() {
            if o.is_some_and(|(k, _)| k == key) {
                *o = None;
            }
        }
    }

    /// Pins exactly `keys` (unpinning the rest). The caller keeps the count
    /// at most `slot_count() − 2`, so two slots stay free to stream through.
    pub fn set_pinned(&mut self, keys: impl Iterator<Item = usize>) {
        self.pinned.fill(false);
        for k in keys {
            self.pinned[k] = true;
        }
        debug_assert!(self.pinned.iter().filter(|&&p| p).count() + 2 <= self.owner.len().max(2));
    }

    /// Which experts of `passes` will find their compute params on this
    /// device when staged: the stagings of `DeviceRunner::pipeline`
    /// replayed on a copy of the table, pass after pass. A pass is its
    /// experts' keys in staging order and whether each expert's slot is
    /// freed after its compute (a backward whose updates change the
    /// params); its experts are staged `group` at a time; with
    /// `overlapped`, the next group is staged before this one's compute, as
    /// the pipeline does. A slot's version is taken as current: one goes
    /// stale only by an update, which frees it.
    pub fn replay_hits(
        &self,
        passes: &[(Vec<usize>, bool)],
        overlapped: bool,
        group: usize,
    ) -> Vec<Vec<bool>> {
        let mut table = self.clone();
        passes
            .iter()
            .map(|(order, frees)| table.replay_pass(order, *frees, overlapped, group))
            .collect()
    }

    fn replay_pass(
        &mut self,
        order: &[usize],
        frees: bool,
        overlapped: bool,
        group: usize,
    ) -> Vec<bool> {
        let groups: Vec<&[usize]> = order.chunks(group.max(1)).collect();
        let mut hits = Vec::with_capacity(order.len());
        let mut next = groups.first().map(|keys| self.replay_stage(keys, &[]));
        for (i, keys) in groups.iter().enumerate() {
            let staged = next.take().expect("staged");
            let slots: Vec<usize> = staged.iter().map(|&(slot, _)| slot).collect();
            hits.extend(staged.iter().map(|&(_, hit)| hit));
            if overlapped && i + 1 < groups.len() {
                next = Some(self.replay_stage(groups[i + 1], &slots));
            }
            if frees {
                for &key in *keys {
                    self.invalidate(key);
                }
            }
            if next.is_none() && i + 1 < groups.len() {
                let protect = if self.slot_count() > keys.len() {
                    &slots[..]
                } else {
                    &[]
                };
                next = Some(self.replay_stage(groups[i + 1], protect));
            }
        }
        hits
    }

    /// A replayed stage of `keys`, one after another, each claim sparing
    /// `protect` and the group's slots claimed before it: each key's slot,
    /// and whether it was there.
    fn replay_stage(&mut self, keys: &[usize], protect: &[usize]) -> Vec<(usize, bool)> {
        let mut spared = protect.to_vec();
        keys.iter()
            .map(|&key| {
                let held = self.owner.iter().flatten().find(|(k, _)| *k == key);
                let staged = match held
                    .copied()
                    .and_then(|(_, version)| self.lookup(key, version))
                {
                    Some(slot) => (slot, true),
                    None => (self.claim(key, 0, &spared), false),
                };
                spared.push(staged.0);
                staged
            })
            .collect()
    }

    /// Experts pinned on this device.
    pub fn pinned_count(&self) -> usize {
        self.pinned.iter().filter(|&&p| p).count()
    }

    /// Pinned experts currently held (at any version).
    #[cfg(test)]
    fn pinned_resident(&self) -> usize {
        self.owner
            .iter()
            .filter(|o| o.is_some_and(|(k, _)| self.pinned[k]))
            .count()
    }
}

/// One device worker's state.
pub(crate) struct DeviceState {
    /// Its expert slots and the experts' compute on them.
    pub device: Box<dyn ExpertDevice>,
    pub slots: DeviceSlots,
    /// How many experts a pass stages and computes at once (1: one at a
    /// time); see [`group_size`].
    pub group: usize,
    /// [layer][expert] what this device's forward kept for the backward.
    pub saved: Vec<Vec<ExpertSaved<f32>>>,
    /// [layer][expert] the input rows of the experts this device computed
    /// for other devices' tokens too (exchange runs only).
    pub saved_x: Vec<Vec<Vec<f32>>>,
    /// The layers' (T·K, D) and (T, D) buffers between steps: three per
    /// layer (its experts' outputs, its norm's input and output live from
    /// its forward to its backward), the five a step uses besides, and one
    /// to spare.
    pub buffers: F32BufferPool,
    /// The per-expert buffers (input rows, output, their gradients), at
    /// most the three an expert's backward holds at once plus one.
    pub scratch: ScratchBuffers,
    pub acc: Accumulators,
    /// Where `EngineConfig::trace_routing`: this step's layer-to-layer
    /// expert transitions.
    pub routing: Option<TransitionCounter>,
    /// Each layer's last routing: what the host tier is asked for.
    pub io: RoutedIo,
    /// The experts (table rows) whose updates this device submitted, the
    /// oldest first; some may have been waited for since. Kept within
    /// `updates_in_flight_max` of pending ones (`DeviceRunner::expert_gradient`).
    pub in_flight: VecDeque<usize>,
}

/// How many experts a device stages and computes at once: `asked` (the
/// device's own limit where `None`), and at most half of its `slots`, so
/// that one group computes while the next one's uploads land in slots of
/// their own; at least 1.
/// Scratch buffers a device keeps at least: an expert's gathered rows
/// and output gradient, and the exchange's.
pub(crate) const SCRATCH_KEPT: usize = 4;

/// The scratch buffers a device keeps with `group` experts computed at
/// once: a group's rows gathered at once, each expert's input and, in the
/// backward, its output gradient; 4 at least (an expert's gathered rows
/// and output gradient, and the exchange's).
pub fn scratch_buffers_kept(group: usize) -> usize {
    SCRATCH_KEPT.max(2 * group)
}

pub(crate) fn group_size(asked: Option<usize>, limit: usize, slots: usize) -> usize {
    asked.unwrap_or(limit).min(slots / 2).max(1)
}

impl DeviceState {
    /// Frees the saved activations of `layer`'s experts other than
    /// `computed` (ascending), which this pass does not compute here: what
    /// the device keeps between passes stays within one pass's need.
    pub fn fit_saved(&mut self, layer: usize, computed: &[usize]) {
        for (e, saved) in self.saved[layer].iter_mut().enumerate() {
            if computed.binary_search(&e).is_err() {
                saved.fit(0);
            }
        }
    }

    pub fn new(device: Box<dyn ExpertDevice>, layers: usize, experts: usize, io: RoutedIo) -> Self {
        let slots = DeviceSlots::new(device.arena().slot_count(), layers * experts);
        Self {
            device,
            slots,
            group: 1,
            saved: vec![vec![ExpertSaved::default(); experts]; layers],
            saved_x: vec![vec![Vec::new(); experts]; layers],
            buffers: F32BufferPool::new(3 * layers + 6),
            scratch: ScratchBuffers::new(SCRATCH_KEPT),
            acc: Accumulators::new(layers, experts),
            routing: None,
            io,
            in_flight: VecDeque::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_version_is_a_miss_and_frees_its_slot() {
        let mut s = DeviceSlots::new(2, 4);
        let a = s.claim(0, 5, &[]);
        assert_eq!(s.lookup(0, 5), Some(a));
        assert_eq!(s.lookup(0, 6), None);
        assert_eq!(s.lookup(0, 5), None);
    }

    /// The replay follows the table's least-recently-used choice, the
    /// protected slot and the slots an update frees (worked by hand).
    #[test]
    fn a_replay_predicts_each_stage_s_hit() {
        for overlapped in [false, true] {
            let mut table = DeviceSlots::new(3, 8);
            for key in [5, 6, 7, 1] {
                table.claim(key, 1, &[]); // 1 takes 5's slot: {6, 7, 1}
            }
            let passes = vec![
                // 2 takes 6's slot (1's protected), 3 takes 1's.
                (vec![1, 2, 7, 3], false),
                // 3, 7 and 2 are there; freed after each, so 1 and 6
                // take free slots and find nothing.
                (vec![3, 7, 2, 1, 6], true),
            ];
            let hits = table.replay_hits(&passes, overlapped, 1);
            let expected = vec![
                vec![true, false, true, false],
                vec![true, true, true, false, false],
            ];
            assert_eq!(hits, expected, "overlapped {overlapped}");
            // The table itself is unchanged.
            assert!(table.lookup(1, 1).is_some() && table.lookup(5, 1).is_none());
        }
        // 3, there before the pass, is the least recently used when 6
        // needs a slot: gone by the next pass, where 6 is found.
        let mut table = DeviceSlots::new(3, 8);
        table.claim(3, 0, &[]);
        let passes = vec![(vec![1, 2, 6], false), (vec![6, 3], false)];
        assert_eq!(
            table.replay_hits(&passes, true, 1),
            vec![vec![false, false, false], vec![true, false]]
        );
    }

    #[test]
    fn pinned_experts_are_never_evicted() {
        let mut s = DeviceSlots::new(4, 8);
        s.set_pinned([3].into_iter());
        s.claim(3, 0, &[]);
        for key in [0, 1, 2, 4, 5, 6, 7, 0, 1] {
            s.claim(key, 0, &[]);
            assert_eq!(s.pinned_resident(), 1);
        }
        assert!(s.lookup(3, 0).is_some());
    }
}
