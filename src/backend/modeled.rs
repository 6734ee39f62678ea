//! A device that moves experts through its tier exactly as the device it
//! wraps, but does not compute them: their outputs and gradients are zero.
//! With a FLOP rate it also holds the calling thread, asleep, for as long
//! as a device of that rate would take, so its compute costs a step wall
//! time but no host core, as an accelerator's does. `strata bench step`'s
//! I/O-only and modeled-device runs choose it through
//! [`EngineConfig::expert_compute`](crate::engine::EngineConfig::expert_compute);
//! the training path never knows it is there.

use std::sync::Arc;
use std::time::Duration;

use strata_tiers::io::HostRegion;
use strata_tiers::DeviceArena;

use super::{ExpertDevice, SlotParams};
use crate::math::{ExpertKind, ExpertSaved};
use crate::model::DenseKernels;
use crate::EngineError;

/// What a device does with an expert's forward and backward.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum ExpertCompute {
    /// Compute them on the backend.
    #[default]
    Run,
    /// Benches only: move experts through the tiers and the optimizer
    /// exactly as training does, but skip the expert GEMMs (outputs and
    /// gradients are zero). This is the I/O-only run of `strata bench step`.
    Skip,
    /// Benches only: skip the GEMMs as [`ExpertCompute::Skip`] does and
    /// hold the device's thread, asleep, for as long as a device running
    /// the expert's FLOPs at `flops_per_s` would take (the forward's
    /// 2·n·D·F per matrix, the backward's twice that). A model of an
    /// accelerator for a machine without one: its compute costs the step
    /// wall time but no host core, as a GPU's does, so the schedule's
    /// overlap can be studied where the cpu backend's GEMMs would take the
    /// cores the I/O and the optimizer need.
    Modeled { flops_per_s: f64 },
}

/// The device of [`ExpertCompute::Skip`] and [`ExpertCompute::Modeled`]:
/// the wrapped device's tier and dense kernels, no expert GEMMs.
pub struct ModeledExpertDevice {
    inner: Box<dyn ExpertDevice>,
    /// `None`: no time at all (Skip).
    flops_per_s: Option<f64>,
}

impl ModeledExpertDevice {
    /// `device` as `compute` says: itself for [`ExpertCompute::Run`],
    /// else wrapped.
    pub fn wrap(device: Box<dyn ExpertDevice>, compute: ExpertCompute) -> Box<dyn ExpertDevice> {
        let flops_per_s = match compute {
            ExpertCompute::Run => return device,
            ExpertCompute::Skip => None,
            ExpertCompute::Modeled { flops_per_s } => Some(flops_per_s),
        };
        Box::new(Self {
            inner: device,
            flops_per_s,
        })
    }

    /// Sleeps for `gemm_passes` passes over the expert's matrices on `n`
    /// rows (the forward 1, the backward 2: its input and weight
    /// gradients) at the modeled rate.
    fn take_the_time(&self, kind: ExpertKind, n: usize, d: usize, f: usize, gemm_passes: usize) {
        if let Some(rate) = self.flops_per_s {
            let flops = (gemm_passes * 2 * n * kind.params(d, f)) as f64;
            std::thread::sleep(Duration::from_secs_f64(flops / rate));
        }
    }
}

impl ExpertDevice for ModeledExpertDevice {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn arena(&self) -> &dyn DeviceArena {
        self.inner.arena()
    }

    fn page_lock_host_region(&mut self, region: &HostRegion) -> Option<String> {
        self.inner.page_lock_host_region(region)
    }

    fn dense_kernels(&self) -> Arc<dyn DenseKernels + Send + Sync> {
        self.inner.dense_kernels()
    }

    fn stage_uploads(&mut self) -> Result<(), EngineError> {
        self.inner.stage_uploads()
    }

    /// Modeled, it computes for the time it sleeps; skipping, not at all.
    fn computes(&self) -> bool {
        self.flops_per_s.is_some()
    }

    /// Its backward needs nothing its forward would keep.
    fn backward_recomputes(&self) -> bool {
        true
    }

    fn expert_forward(
        &mut self,
        kind: ExpertKind,
        out: &mut [f32],
        _saved: &mut ExpertSaved<f32>,
        _x: &[f32],
        _params: SlotParams,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        crate::parallel::fill_zeros(out);
        self.take_the_time(kind, n, d, f, 1);
        Ok(())
    }

    fn expert_backward(
        &mut self,
        kind: ExpertKind,
        dx: &mut [f32],
        dparams: &mut [f32],
        _dout: &[f32],
        _saved: &ExpertSaved<f32>,
        _x: &[f32],
        _params: SlotParams,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        crate::parallel::fill_zeros(dparams);
        crate::parallel::fill_zeros(dx);
        self.take_the_time(kind, n, d, f, 2);
        Ok(())
    }
}
