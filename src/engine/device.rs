//! One device of the engine: its tier (an arena carved into expert slots,
//! [`DeviceSlots`] saying which expert version each holds and which are
//! pinned), what its forward kept for the backward, and its counters.

use strata_tiers::{CpuDeviceArena, DeviceArena, Dtype, Layout};

use crate::backend::Backend;
use crate::math::ExpertSaved;
use crate::EngineError;

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
}

impl Accumulators {
    pub fn new(layers: usize, experts: usize) -> Self {
        Self {
            tokens_per_expert: vec![vec![0; experts]; layers],
            ..Self::default()
        }
    }
}

/// Which expert (and which version of its params) each device slot holds.
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
    /// is neither `protect` nor holding a pinned expert.
    pub fn claim(&mut self, key: usize, version: u64, protect: Option<usize>) -> usize {
        let pinned = &self.pinned;
        let slot = (0..self.owner.len())
            .filter(|&s| Some(s) != protect)
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
    /// Computes the experts this device runs.
    pub backend: Box<dyn Backend>,
    pub arena: CpuDeviceArena,
    pub slots: DeviceSlots,
    /// [layer][expert] what this device's forward kept for the backward.
    pub saved: Vec<Vec<ExpertSaved<f32>>>,
    /// [layer][expert] the input rows of the experts this device computed
    /// for other devices' tokens too (exchange runs only).
    pub saved_x: Vec<Vec<Vec<f32>>>,
    /// The f32 params of the expert being computed (reused every pass).
    pub params_scratch: Vec<f32>,
    pub acc: Accumulators,
}

impl DeviceState {
    pub fn new(
        backend: Box<dyn Backend>,
        device_budget_bytes: u64,
        layout: &Layout,
        layers: usize,
        experts: usize,
    ) -> Result<Self, EngineError> {
        let slot_bytes = layout.compute_payload_bytes() as usize;
        let arena = CpuDeviceArena::new(device_budget_bytes, slot_bytes, 64)?;
        let slots = DeviceSlots::new(arena.slot_count(), layers * experts);
        Ok(Self {
            backend,
            arena,
            slots,
            saved: vec![vec![ExpertSaved::default(); experts]; layers],
            saved_x: vec![vec![Vec::new(); experts]; layers],
            params_scratch: Vec::with_capacity(layout.params_per_expert as usize),
            acc: Accumulators::new(layers, experts),
        })
    }

    /// Writes the compute params in a device slot into `out` as f32
    /// (widened from bf16/f16), reusing `out`'s allocation.
    pub fn read_params(
        &self,
        layout: &Layout,
        slot: usize,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let view = self.arena.view(slot)?;
        let n = layout.params_per_expert as usize;
        let bytes = &view.bytes()[..layout.compute_payload_bytes() as usize];
        out.clear();
        match layout.compute_dtype {
            Dtype::F32 => out.extend_from_slice(&bytemuck::cast_slice::<u8, f32>(bytes)[..n]),
            Dtype::Bf16 => out.extend(
                bytemuck::cast_slice::<u8, half::bf16>(bytes)
                    .iter()
                    .map(|x| x.to_f32()),
            ),
            Dtype::F16 => out.extend(
                bytemuck::cast_slice::<u8, half::f16>(bytes)
                    .iter()
                    .map(|x| x.to_f32()),
            ),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stale_version_is_a_miss_and_frees_its_slot() {
        let mut s = DeviceSlots::new(2, 4);
        let a = s.claim(0, 5, None);
        assert_eq!(s.lookup(0, 5), Some(a));
        assert_eq!(s.lookup(0, 6), None);
        assert_eq!(s.lookup(0, 5), None);
    }

    #[test]
    fn pinned_experts_are_never_evicted() {
        let mut s = DeviceSlots::new(4, 8);
        s.set_pinned([3].into_iter());
        s.claim(3, 0, None);
        for key in [0, 1, 2, 4, 5, 6, 7, 0, 1] {
            s.claim(key, 0, None);
            assert_eq!(s.pinned_resident(), 1);
        }
        assert!(s.lookup(3, 0).is_some());
    }
}
