//! A device's experts on rows in host memory, a group at a time: each
//! expert's rows gathered, then the group computed in one call
//! (`ExpertDevice::experts_forward`, `experts_backward`: the cpu device
//! computes them side by side on its compute threads), then each
//! expert's gradient handed on in the group's order, as one expert at a
//! time hands them. A group of one is [`DeviceRunner::expert_forward`] and
//! [`DeviceRunner::expert_backward`].

use std::time::Instant;

use super::pipeline::DeviceRunner;
use crate::backend::{ExpertBackward, ExpertForward, SlotParams};
use crate::math::{gather_forward, AssignmentGrads, ExpertSaved, Permutation};
use crate::EngineError;

impl DeviceRunner<'_> {
    /// The forward of a group of `layer`'s experts (`members`, each with
    /// its slot) on `x`'s rows, into their blocks of `out`.
    pub(super) fn forward_group(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        out: &mut [f32],
        members: &[(usize, SlotParams)],
    ) -> Result<(), EngineError> {
        let (d, k, f) = (self.model.d_model, self.model.top_k, self.model.d_ff);
        if let [(expert, params)] = *members {
            let rows = perm.rows(expert);
            let mut xe = self.dev.scratch.take(rows.len() * d); // gathered over
            gather_forward(&mut xe, x, rows, k, d);
            let ye = perm.block_mut(out, expert, d);
            self.expert_forward(layer, expert, &xe, params, ye)?;
            self.dev.scratch.give(xe);
            return Ok(());
        }
        let experts: Vec<usize> = members.iter().map(|&(e, _)| e).collect();
        let xs: Vec<_> = experts
            .iter()
            .map(|&e| {
                let rows = perm.rows(e);
                let mut xe = self.dev.scratch.take(rows.len() * d); // gathered over
                gather_forward(&mut xe, x, rows, k, d);
                xe
            })
            .collect();
        for &e in &experts {
            self.dev.saved[layer][e].fit(perm.count(e) * f);
        }
        let outs = pick_mut(expert_blocks(perm, out, d), &experts);
        let saved = pick_mut(self.dev.saved[layer].iter_mut().collect(), &experts);
        let mut group: Vec<ExpertForward> = members
            .iter()
            .zip(xs.iter().zip(outs.into_iter().zip(saved)))
            .map(|(&(_, params), (x, (out, saved)))| ExpertForward {
                params,
                x,
                out,
                saved,
            })
            .collect();
        let rows: usize = experts.iter().map(|&e| perm.count(e)).sum();
        self.dev.acc.assignments_computed += rows as u64;
        let t0 = Instant::now();
        let kind = self.model.expert_kind;
        self.dev.device.experts_forward(kind, &mut group, d, f)?;
        if self.dev.device.computes() {
            self.dev.acc.expert_compute_s += t0.elapsed().as_secs_f64();
        }
        if self.options.recompute_hidden {
            for e in group.iter_mut() {
                e.saved.a = Vec::new();
                e.saved.b = Vec::new();
            }
        }
        drop(group);
        xs.into_iter().for_each(|xe| self.dev.scratch.give(xe));
        Ok(())
    }

    /// The backward of a group of `layer`'s experts (`members`) from
    /// `dout`, into their blocks of `dx`; each expert's gradient is then
    /// handed on, in the group's order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward_group(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        dout: AssignmentGrads<'_, f32>,
        dx: &mut [f32],
        last_micro_batch: bool,
        members: &[(usize, SlotParams)],
    ) -> Result<(), EngineError> {
        let (d, k, f) = (self.model.d_model, self.model.top_k, self.model.d_ff);
        let recomputes = self.options.recompute_hidden && !self.dev.device.backward_recomputes();
        if members.len() == 1 || recomputes {
            for &(expert, params) in members {
                let rows = perm.rows(expert);
                // Both gathered over.
                let mut xe = self.dev.scratch.take(rows.len() * d);
                gather_forward(&mut xe, x, rows, k, d);
                let mut dye = self.dev.scratch.take(rows.len() * d);
                dout.gather(&mut dye, rows);
                let dxe = perm.block_mut(dx, expert, d);
                self.expert_backward(layer, expert, &xe, &dye, params, last_micro_batch, dxe)?;
                self.dev.scratch.give(xe);
                self.dev.scratch.give(dye);
            }
            return Ok(());
        }
        let experts: Vec<usize> = members.iter().map(|&(e, _)| e).collect();
        let gathered: Vec<_> = experts
            .iter()
            .map(|&e| {
                let rows = perm.rows(e);
                // Both gathered over.
                let mut xe = self.dev.scratch.take(rows.len() * d);
                gather_forward(&mut xe, x, rows, k, d);
                let mut dye = self.dev.scratch.take(rows.len() * d);
                dout.gather(&mut dye, rows);
                (xe, dye)
            })
            .collect();
        // Overwritten by the backward.
        let mut grads: Vec<Vec<f32>> = experts.iter().map(|_| self.shared.grads.take()).collect();
        let dxs = pick_mut(expert_blocks(perm, dx, d), &experts);
        let saved: &[ExpertSaved<f32>] = &self.dev.saved[layer];
        let mut group: Vec<ExpertBackward> = members
            .iter()
            .zip(gathered.iter().zip(dxs.into_iter().zip(grads.iter_mut())))
            .map(
                |(&(e, params), ((x, dout), (dx, dparams)))| ExpertBackward {
                    params,
                    x,
                    dout,
                    saved: &saved[e],
                    dx,
                    dparams,
                },
            )
            .collect();
        let rows: usize = experts.iter().map(|&e| perm.count(e)).sum();
        self.dev.acc.assignments_computed += rows as u64;
        let t0 = Instant::now();
        let kind = self.model.expert_kind;
        self.dev.device.experts_backward(kind, &mut group, d, f)?;
        drop(group);
        if self.dev.device.computes() {
            self.dev.acc.expert_compute_s += t0.elapsed().as_secs_f64();
        }
        for (xe, dye) in gathered {
            self.dev.scratch.give(xe);
            self.dev.scratch.give(dye);
        }
        for (&e, grad) in experts.iter().zip(grads) {
            let key = self.key(layer, e);
            // The group's time is counted above: each gradient adds none.
            self.expert_gradient(key, grad, Instant::now(), last_micro_batch)?;
        }
        Ok(())
    }
}

/// Each expert's block of an expert-ordered (T·K, D) buffer, in expert
/// order.
fn expert_blocks<'b>(perm: &Permutation, mut buf: &'b mut [f32], d: usize) -> Vec<&'b mut [f32]> {
    let experts = perm.offsets.len() - 1;
    let mut blocks = Vec::with_capacity(experts);
    for e in 0..experts {
        let (block, rest) = std::mem::take(&mut buf).split_at_mut(perm.count(e) * d);
        blocks.push(block);
        buf = rest;
    }
    blocks
}

/// The items at `picks` (distinct indices), in `picks`' order.
fn pick_mut<T>(items: Vec<T>, picks: &[usize]) -> Vec<T> {
    let mut items: Vec<Option<T>> = items.into_iter().map(Some).collect();
    picks
        .iter()
        .map(|&i| items[i].take().expect("each expert of a group once"))
        .collect()
}
