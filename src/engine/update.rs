//! An expert's optimizer update as the pool sees it: the exclusive host
//! slot of its record (master params, moments, compute copy) plus its f32
//! gradient (in host memory, or still coming down from a GPU) and its own
//! step count.

use half::{bf16, f16};
use std::sync::Arc;
use std::time::Instant;
use strata_optim::{CopyOut, GradRef, UpdateTarget, UpdateViews};

use strata_tiers::{Dtype, Timeline, WriteGuard};

use crate::backend::ArrivingGradient;
use crate::EngineError;

/// An expert's complete gradient as its update reads it.
pub(crate) enum ExpertGradient {
    /// In host memory.
    Host(Vec<f32>),
    /// The last micro-batch's, coming down from a GPU: the update's worker
    /// waits for it ([`UpdateTarget::prepare`]) and adds it onto the
    /// earlier micro-batches' sum, where there is one, as
    /// `SharedExperts::accumulate` would have.
    Arriving {
        last: Box<dyn ArrivingGradient>,
        onto: Option<Vec<f32>>,
    },
}

impl ExpertGradient {
    /// The values; an arriving gradient must have been waited for.
    fn values(&self) -> &[f32] {
        match self {
            Self::Host(grad) => grad,
            Self::Arriving { last, .. } => last.values(),
        }
    }

    /// Waits for an arriving gradient and adds it onto its sum, which then
    /// stands in for it (its buffer goes back to the device). Returns
    /// whether it waited.
    fn land(&mut self) -> Result<bool, EngineError> {
        let Self::Arriving { last, onto } = self else {
            return Ok(false);
        };
        last.wait()?;
        if let Some(mut sum) = onto.take() {
            let values = last.values();
            sum.iter_mut().zip(values).for_each(|(s, g)| *s += g);
            *self = Self::Host(sum);
        }
        Ok(true)
    }
}

pub(crate) struct ExpertUpdate {
    pub guard: WriteGuard,
    pub grad: ExpertGradient,
    pub step: u64,
    pub dtype: Dtype,
    /// Where the update is recorded, from its first chunk's start to its
    /// end (`EngineConfig::timeline`).
    pub timeline: Option<Arc<Timeline>>,
    pub started: Option<Instant>,
}

impl UpdateTarget for ExpertUpdate {
    fn prepare(&mut self) -> Result<(), String> {
        let t0 = Instant::now();
        if !self.grad.land().map_err(|e| e.to_string())? {
            return Ok(());
        }
        if let Some(timeline) = &self.timeline {
            let expert = self.guard.expert();
            timeline.record("optimizer", "gradient lands", t0, || expert.to_string());
        }
        Ok(())
    }

    fn views(&mut self) -> UpdateViews<'_> {
        if self.timeline.is_some() && self.started.is_none() {
            self.started = Some(Instant::now());
        }
        let record = self.guard.record_mut();
        // The compute part starts 64 bytes into a 4096-aligned slot, so the
        // casts are aligned for f32, bf16 and f16 alike.
        let copy = match self.dtype {
            Dtype::F32 => CopyOut::F32(bytemuck::cast_slice_mut::<u8, f32>(record.compute)),
            Dtype::Bf16 => CopyOut::Bf16(bytemuck::cast_slice_mut::<u8, bf16>(record.compute)),
            Dtype::F16 => CopyOut::F16(bytemuck::cast_slice_mut::<u8, f16>(record.compute)),
        };
        UpdateViews {
            params: record.master,
            m: record.m,
            v: record.v,
            grad: GradRef::F32(self.grad.values()),
            copy,
            step: &mut self.step,
        }
    }

    /// On the optimizer worker, as the update ends: checksum the record
    /// and hand its host slot back, dirty, so neither waits for the engine
    /// to collect the update (the prefetcher can write it back and reuse
    /// the slot at once, and the write-back has nothing left to compute).
    fn finished(&mut self) {
        self.guard.seal(self.step);
        if let (Some(timeline), Some(started)) = (&self.timeline, self.started) {
            let expert = self.guard.expert();
            timeline.record("optimizer", "update", started, || expert.to_string());
        }
    }
}
