//! The expert-wise schedule (ES-MoE §4.1, fig. 2) as an [`ExpertRunner`]:
//! per layer, expert by expert, the next expert's upload is issued before
//! this one computes; after an expert's backward its gradient goes to the
//! optimizer at once. The `naive` schedule (ZeRO-Offload at expert
//! granularity) uploads synchronously and leaves the optimizer to the end.

use std::time::Instant;

use strata_tiers::{CopyEvent, DeviceArena, Dtype, ExpertId, Parts};

use super::{DeviceSlots, Engine, ScheduleKind};
use crate::backend::Backend;
use crate::math::{gather_forward, Permutation};
use crate::model::ExpertRunner;
use crate::EngineError;

pub(crate) struct EngineRunner<'a> {
    pub engine: &'a mut Engine,
}

/// An expert on its way to (or already on) the device.
struct Staged {
    expert: usize,
    slot: usize,
    upload: Option<CopyEvent>,
}

impl EngineRunner<'_> {
    fn key(&self, layer: usize, expert: usize) -> usize {
        layer * self.engine.model.experts + expert
    }

    /// Makes `expert`'s compute params arrive in a device slot: waits for
    /// its pending update, pins its host record, and starts the upload into
    /// a slot other than `protect`.
    fn stage(
        &mut self,
        layer: usize,
        expert: usize,
        protect: Option<usize>,
    ) -> Result<Staged, EngineError> {
        let key = self.key(layer, expert);
        let e = &mut *self.engine;
        e.reap_finished()?;
        if e.pending[key] {
            let t0 = Instant::now();
            e.finish_update(key)?;
            e.acc.stall_optimizer_s += t0.elapsed().as_secs_f64();
        }
        if let Some(slot) = e.device.lookup(key) {
            e.acc.device_hits += 1;
            return Ok(Staged {
                expert,
                slot,
                upload: None,
            });
        }
        e.acc.device_misses += 1;
        let id = ExpertId::new(layer as u32, expert as u32);
        let guard = match e.cache.acquire(id, Parts::Compute) {
            Err(strata_tiers::TierError::AllSlotsPinned { .. }) => {
                e.drain_counted()?;
                e.cache.acquire(id, Parts::Compute)?
            }
            other => other?,
        };
        let slot = e.device.claim(key, protect);
        let upload = e.arena.upload_htod(slot, Box::new(guard))?;
        e.acc.bytes_host_to_device += e.store_layout.compute_payload_bytes();
        if e.config.schedule == ScheduleKind::Naive {
            let t0 = Instant::now();
            upload.wait()?;
            e.acc.stall_upload_s += t0.elapsed().as_secs_f64();
            return Ok(Staged {
                expert,
                slot,
                upload: None,
            });
        }
        Ok(Staged {
            expert,
            slot,
            upload: Some(upload),
        })
    }

    /// Walks `order`, staging expert i+1 before computing expert i when
    /// the device has room for both, and calls `compute` on each.
    fn pipeline(
        &mut self,
        layer: usize,
        order: &[usize],
        mut compute: impl FnMut(&mut Self, usize, &[f32]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let overlap = self.engine.config.schedule == ScheduleKind::ExpertWise
            && self.engine.device.slot_count() >= 2;
        let mut next = match order.first() {
            Some(&e) => Some(self.stage(layer, e, None)?),
            None => None,
        };
        for i in 0..order.len() {
            let current = next.take().expect("staged");
            if overlap && i + 1 < order.len() {
                next = Some(self.stage(layer, order[i + 1], Some(current.slot))?);
            }
            if let Some(upload) = &current.upload {
                let t0 = Instant::now();
                upload.wait()?;
                self.engine.acc.stall_upload_s += t0.elapsed().as_secs_f64();
            }
            // One params buffer for every expert pass, lent out of the
            // engine while `compute` borrows the runner.
            let mut params = std::mem::take(&mut self.engine.params_scratch);
            let computed = self
                .engine
                .device_params(current.slot, &mut params)
                .and_then(|()| compute(self, current.expert, &params));
            self.engine.params_scratch = params;
            computed?;
            if next.is_none() && i + 1 < order.len() {
                next = Some(self.stage(layer, order[i + 1], Some(current.slot))?);
            }
        }
        Ok(())
    }
}

impl ExpertRunner for EngineRunner<'_> {
    fn forward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let model = self.engine.model.clone();
        let (d, f, k) = (model.d_model, model.d_ff, model.top_k);
        let order: Vec<usize> = (0..model.experts)
            .filter(|&e| !perm.rows(e).is_empty())
            .collect();
        for e in 0..model.experts {
            self.engine.acc.tokens_per_expert[layer][e] += perm.rows(e).len() as u32;
        }
        self.pipeline(layer, &order, |runner, expert, params| {
            let rows = perm.rows(expert);
            let mut xe = vec![0.0f32; rows.len() * d];
            gather_forward(&mut xe, x, rows, k, d);
            let mut ye = vec![0.0f32; rows.len() * d];
            let eng = &mut *runner.engine;
            let saved = &mut eng.saved[layer][expert];
            eng.backend.expert_ffn_forward(
                model.expert_kind,
                &mut ye,
                saved,
                &xe,
                params,
                rows.len(),
                d,
                f,
            );
            if eng.config.recompute_hidden {
                saved.a = Vec::new();
                saved.b = Vec::new();
            }
            crate::math::scatter_to_assignments(out, &ye, rows, d);
            Ok(())
        })
    }

    fn backward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        dout: &[f32],
        dx: &mut [f32],
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        let model = self.engine.model.clone();
        let (d, f, k) = (model.d_model, model.d_ff, model.top_k);
        let order: Vec<usize> = (0..model.experts)
            .rev()
            .filter(|&e| !perm.rows(e).is_empty())
            .collect();
        self.pipeline(layer, &order, |runner, expert, params| {
            let rows = perm.rows(expert);
            let mut xe = vec![0.0f32; rows.len() * d];
            gather_forward(&mut xe, x, rows, k, d);
            let mut dye = vec![0.0f32; rows.len() * d];
            crate::math::gather_from_assignments(&mut dye, dout, rows, d);
            let key = runner.key(layer, expert);
            let eng = &mut *runner.engine;
            let skip = eng.config.skip_expert_compute;
            if eng.config.recompute_hidden && !skip {
                let mut scratch = vec![0.0f32; rows.len() * d];
                let saved = &mut eng.saved[layer][expert];
                eng.backend.expert_ffn_forward(
                    model.expert_kind,
                    &mut scratch,
                    saved,
                    &xe,
                    params,
                    rows.len(),
                    d,
                    f,
                );
            }
            let mut grad = vec![0.0f32; params.len()];
            let mut dxe = vec![0.0f32; rows.len() * d];
            let saved = &eng.saved[layer][expert];
            if !skip {
                eng.backend.expert_ffn_backward(
                    model.expert_kind,
                    &mut dxe,
                    &mut grad,
                    &dye,
                    saved,
                    &xe,
                    params,
                    rows.len(),
                    d,
                    f,
                );
            }
            eng.acc.bytes_device_to_host += 4 * grad.len() as u64;
            crate::math::scatter_to_assignments(dx, &dxe, rows, d);
            // Gradients of earlier micro-batches are summed first, in order.
            let grad = match eng.grad_accum[key].take() {
                Some(mut sum) => {
                    sum.iter_mut().zip(&grad).for_each(|(s, g)| *s += g);
                    sum
                }
                None => grad,
            };
            if last_micro_batch {
                eng.device.invalidate(key); // its params are about to change
                eng.submit_update(key, grad)?;
            } else {
                eng.grad_accum[key] = Some(grad);
            }
            Ok(())
        })
    }
}

impl DeviceSlots {
    pub(crate) fn new(slot_count: usize) -> Self {
        Self {
            owner: vec![None; slot_count],
            last_use: vec![0; slot_count],
            clock: 0,
        }
    }

    pub(crate) fn slot_count(&self) -> usize {
        self.owner.len()
    }

    pub(crate) fn lookup(&mut self, key: usize) -> Option<usize> {
        let slot = self.owner.iter().position(|&o| o == Some(key))?;
        self.clock += 1;
        self.last_use[slot] = self.clock;
        Some(slot)
    }

    /// A slot for `key`: a free one, else the least recently used one that
    /// is not `protect`.
    pub(crate) fn claim(&mut self, key: usize, protect: Option<usize>) -> usize {
        let slot = (0..self.owner.len())
            .filter(|&s| Some(s) != protect)
            .min_by_key(|&s| (self.owner[s].is_some(), self.last_use[s]))
            .expect("at least one claimable slot");
        self.clock += 1;
        self.owner[slot] = Some(key);
        self.last_use[slot] = self.clock;
        slot
    }

    pub(crate) fn invalidate(&mut self, key: usize) {
        for o in self.owner.iter_mut() {
            if *o == Some(key) {
                *o = None;
            }
        }
    }
}

impl Engine {
    /// Writes the compute params in a device slot into `out` as f32
    /// (widened from bf16/f16), reusing `out`'s allocation.
    pub(crate) fn device_params(&self, slot: usize, out: &mut Vec<f32>) -> Result<(), EngineError> {
        let view = self.arena.view(slot)?;
        let n = self.model.expert_params();
        let bytes = &view.bytes()[..self.store_layout.compute_payload_bytes() as usize];
        out.clear();
        match self.store_layout.compute_dtype {
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
