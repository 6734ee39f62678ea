//! The dense params' AdamW at the end of a step: all of them on the host,
//! or, where one GPU keeps them ([`EngineConfig::dense_on_device`]), those
//! it holds on the GPU and the rest on the host. Both are strata-optim's
//! element update, so where the gradient is the same the params are the
//! same bits either way.
//!
//! [`EngineConfig::dense_on_device`]: super::EngineConfig::dense_on_device

use std::ops::Range;
use std::sync::Arc;

use strata_optim::{adamw_step, CopyOut, GradRef, Kernel, StepScalars};

use super::{trainable_runs, Engine};
use crate::model::{ranges_without, DenseKernels, DenseResidence};
use crate::EngineError;

impl Engine {
    /// The device that keeps and steps the dense params it computes with,
    /// where this engine lets it (one device in the world,
    /// `dense_on_device`: ranks all-reduce the dense gradient on the host).
    pub(super) fn residence(&self) -> Option<&dyn DenseResidence> {
        if !self.config.dense_on_device || self.config.workers() != 1 {
            return None;
        }
        self.dense_kernels[0].residence()
    }

    fn trainable(&self) -> Vec<Range<usize>> {
        trainable_runs(self.dense.len(), &self.frozen).collect()
    }

    /// Ends one device's dense gradient. `keep_norm`: `None` adds all of
    /// it into `grad` (`grads_flush`); `Some(norm)` leaves what the device
    /// holds there ([`DenseResidence::finish_grads`]) and returns its sum
    /// of squares over the trainable params when `norm`.
    pub(super) fn end_dense_grad(
        &self,
        kernels: &dyn DenseKernels,
        grad: &mut [f32],
        keep_norm: Option<bool>,
    ) -> Result<f64, EngineError> {
        match (keep_norm, kernels.residence()) {
            (Some(norm), Some(residence)) => residence.finish_grads(grad, &self.trainable(), norm),
            _ => kernels.grads_flush(grad).map(|()| 0.0),
        }
    }

    /// AdamW on the dense params with `grad` (the host's part of the
    /// gradient, scaled already by the clip factor `scale`; the device's
    /// part is scaled in its update).
    pub(super) fn step_dense(&mut self, grad: &[f32], scale: f32) -> Result<(), EngineError> {
        self.dense_step += 1;
        let trainable = self.trainable();
        let kernels = Arc::clone(&self.dense_kernels[0]);
        let residence = self
            .residence()
            .is_some()
            .then(|| kernels.residence())
            .flatten();
        let held = residence.map(|r| r.held()).unwrap_or_default();
        let s = StepScalars::new(&self.config.hyper, self.dense_step, 1.0);
        // Element by element: the trainable runs step as the whole would,
        // each with its moments (kept for the trainable params alone).
        let kernel = Kernel::detect();
        let mut packed = 0;
        let mut updated = Ok(());
        for run in &trainable {
            for r in ranges_without(std::slice::from_ref(run), &held) {
                let moments = packed + (r.start - run.start)..packed + (r.end - run.start);
                updated = updated.and_then(|()| {
                    adamw_step(
                        kernel,
                        &s,
                        &mut self.dense[r.clone()],
                        &mut self.dense_m[moments.clone()],
                        &mut self.dense_v[moments],
                        GradRef::F32(&grad[r]),
                        CopyOut::None,
                    )
                    .map_err(EngineError::from)
                });
            }
            packed += run.len();
        }
        match residence {
            Some(residence) => {
                // What the host stepped no device holds: nothing to drop.
                updated?;
                let s = StepScalars::new(&self.config.hyper, self.dense_step, scale);
                self.dense_newer_on_device = true;
                residence.step(&s, &trainable, &self.dense_m, &self.dense_v)
            }
            None => {
                // Even a failed update may have written some params.
                for kernels in &self.dense_kernels {
                    kernels.weights_changed(&self.dense);
                }
                updated
            }
        }
    }

    /// Brings the host's dense params and moments up to date with what
    /// the device stepped.
    pub(super) fn sync_dense(&mut self) -> Result<(), EngineError> {
        if !self.dense_newer_on_device {
            return Ok(());
        }
        let trainable = self.trainable();
        let kernels = Arc::clone(&self.dense_kernels[0]);
        let residence = kernels
            .residence()
            .expect("dense params newer on a device that keeps none");
        residence.sync(
            &mut self.dense,
            &trainable,
            &mut self.dense_m,
            &mut self.dense_v,
        )?;
        self.dense_newer_on_device = false;
        Ok(())
    }
}
