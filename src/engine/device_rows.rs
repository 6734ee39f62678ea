//! A device's experts on rows in its own memory (a GPU): a group of a
//! layer's experts computed in one call (`ExpertDevice::experts_forward_rows`,
//! `experts_backward_rows`), and the group's gradients left on the device
//! until the next group's backward is queued, then taken: into a
//! page-locked buffer the update's worker waits for, or into host memory
//! of the engine's, waited for at once.

use std::time::Instant;

use super::pipeline::DeviceRunner;
use crate::backend::{
    ArrivingGradient, DeviceGradient, Download, ExpertBackwardRows, ExpertForwardRows,
};
use crate::EngineError;

/// An expert's gradient on the device, not yet taken.
pub(crate) struct PendingGradient {
    grad: Box<dyn DeviceGradient>,
    key: usize,
    last_micro_batch: bool,
}

impl DeviceRunner<'_> {
    /// [`Self::expert_forward`] on rows in the device's memory, for a
    /// group of experts in one call.
    ///
    /// # Safety
    /// As [`ExpertDevice::experts_forward_rows`](crate::backend::ExpertDevice::experts_forward_rows).
    pub(super) unsafe fn experts_forward_rows(
        &mut self,
        group: &[ExpertForwardRows],
    ) -> Result<(), EngineError> {
        let (d, f) = (self.model.d_model, self.model.d_ff);
        let rows: usize = group.iter().map(|e| e.x.len / d).sum();
        self.dev.acc.assignments_computed += rows as u64;
        let t0 = Instant::now();
        let kind = self.model.expert_kind;
        // SAFETY: the caller's contract.
        unsafe { self.dev.device.experts_forward_rows(kind, group, d, f)? };
        if self.dev.device.computes() {
            self.dev.acc.expert_compute_s += t0.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// [`Self::expert_backward`] on rows in the device's memory, for a
    /// group of `layer`'s experts (`experts`, each with its rows in
    /// `group`) in one call. Their gradients stay on the device until the
    /// next group's backward is queued.
    ///
    /// # Safety
    /// As [`ExpertDevice::experts_backward_rows`](crate::backend::ExpertDevice::experts_backward_rows).
    pub(super) unsafe fn experts_backward_rows(
        &mut self,
        layer: usize,
        experts: &[usize],
        group: &[ExpertBackwardRows],
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        let (d, f) = (self.model.d_model, self.model.d_ff);
        let kind = self.model.expert_kind;
        let rows: usize = group.iter().map(|e| e.x.len / d).sum();
        self.dev.acc.assignments_computed += rows as u64;
        let t0 = Instant::now();
        let device = &mut self.dev.device;
        // SAFETY: the caller's contract.
        let grads = unsafe { device.experts_backward_rows(kind, group, d, f)? };
        if device.computes() {
            self.dev.acc.expert_compute_s += t0.elapsed().as_secs_f64();
        }
        assert_eq!(grads.len(), experts.len(), "a gradient an expert");
        // The group before this one's come down while this one computes.
        self.take_pending_gradients()?;
        self.pending = experts
            .iter()
            .zip(grads)
            .map(|(&expert, grad)| PendingGradient {
                grad,
                key: self.key(layer, expert),
                last_micro_batch,
            })
            .collect();
        Ok(())
    }

    /// Hands each of [`Self::pending`]'s gradients on as
    /// [`Self::expert_backward`] does, in the group's order.
    pub(super) fn take_pending_gradients(&mut self) -> Result<(), EngineError> {
        for p in std::mem::take(&mut self.pending) {
            self.take_gradient(p)?;
        }
        Ok(())
    }

    /// Hands a gradient left on the device on. Where it goes to the
    /// optimizer at once and the device has a page-locked buffer free, its
    /// download is queued and the update's worker waits for it; else it is
    /// taken into a host buffer here, and that wait is compute time.
    fn take_gradient(&mut self, p: PendingGradient) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let mut device_grad = p.grad;
        if self.shared.submits_at_once(p.key, p.last_micro_batch) {
            match device_grad.start_download()? {
                Download::Started(arriving) => {
                    self.wait_landing()?;
                    return self.arriving_gradient(p.key, arriving, t0);
                }
                Download::NoBuffer(unmoved) => device_grad = unmoved,
            }
        }
        let mut grad = self.shared.grads.take(); // overwritten whole
        device_grad.take(&mut grad)?;
        // Its update may need a host slot for the record: the uploads in
        // flight unpin their own first (with two groups' host slots these
        // and the next group's hold them all). The device has mostly run
        // them by now, its compute being queued after them.
        self.wait_landing()?;
        self.expert_gradient(p.key, grad, t0, p.last_micro_batch)
    }

    /// [`Self::expert_gradient`] for a gradient still coming down, which
    /// goes to the optimizer at once (`SharedExperts::submits_at_once`).
    fn arriving_gradient(
        &mut self,
        key: usize,
        grad: Box<dyn ArrivingGradient>,
        t0: Instant,
    ) -> Result<(), EngineError> {
        self.count_gradient(t0);
        self.dev.slots.invalidate(key); // its params are about to change
        self.make_room_for_update()?;
        self.dev.acc.stall_optimizer_s += self.shared.submit_arriving(key, grad)?;
        self.dev.in_flight.push_back(key);
        Ok(())
    }
}
