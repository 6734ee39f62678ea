//! The expert-wise schedule (ES-MoE §4.1, fig. 2) on one device: per layer,
//! expert by expert (or a group of experts at a time: a GPU's grouped
//! GEMMs, `device_rows.rs`; the cpu's experts side by side,
//! `host_groups.rs`), the next expert's upload is issued before this one
//! computes; after an expert's backward its gradient goes to the optimizer
//! at once. The `naive` schedule (ZeRO-Offload at expert granularity)
//! uploads synchronously and leaves the optimizer to the end.
//!
//! [`DeviceRunner`] is one device's view of the engine (its own tier, the
//! shared host/SSD tiers and optimizer); as an [`ExpertRunner`] it runs a
//! layer's experts on its own tokens. The several-device runner
//! (`exchange.rs`) drives the same staging and expert passes on tokens
//! gathered from every device.

use std::time::Instant;

use strata_tiers::{CopyEvent, ExpertId, Parts, TimelineSpan};

use super::access::Phase;
use super::routed_io::streams;
use super::slot_table::DeviceState;
use super::updates::{updates_in_flight_max, Held, SharedExperts, When};
use super::ScheduleKind;

use super::device_rows::PendingGradient;
use crate::backend::{DeviceRows, ExpertBackwardRows, ExpertForwardRows, SlotParams};
use crate::math::{AssignmentGrads, Permutation};
use crate::model::{ExpertRunner, ModelConfig};
use crate::EngineError;

/// What a device pass needs to know of the engine's configuration.
#[derive(Clone, Copy)]
pub(crate) struct PassOptions {
    pub recompute_hidden: bool,
}

pub(crate) struct DeviceRunner<'a> {
    pub model: &'a ModelConfig,
    pub shared: &'a SharedExperts,
    pub dev: &'a mut DeviceState,
    pub options: PassOptions,
    /// The last group's gradients, left on the device by its backward on
    /// device rows, taken once the next group's backward is queued (or at
    /// the pass's end). Dropped with the runner when a step fails.
    pub pending: Vec<PendingGradient>,
    /// The last group's uploads the device orders its compute after (a
    /// GPU), not yet seen to land on the host: their host slots stay
    /// pinned until then.
    pub landing: Vec<Landing>,
}

impl<'a> DeviceRunner<'a> {
    /// A runner for `dev`'s passes, with nothing pending or landing.
    pub fn new(
        model: &'a ModelConfig,
        shared: &'a SharedExperts,
        dev: &'a mut DeviceState,
        options: PassOptions,
    ) -> Self {
        Self {
            model,
            shared,
            dev,
            options,
            pending: Vec::new(),
            landing: Vec::new(),
        }
    }
}

/// An upload the device orders its compute after, not yet waited for.
pub(crate) struct Landing {
    upload: CopyEvent,
    layer: usize,
    expert: usize,
}

/// Which pass an expert loop belongs to.
#[derive(Clone, Copy)]
pub(crate) enum Pass {
    Forward,
    Backward,
}

impl Pass {
    fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        }
    }
}

/// An expert on its way to (or already on) the device.
struct Staged {
    expert: usize,
    slot: usize,
    upload: Option<CopyEvent>,
}

impl DeviceRunner<'_> {
    /// The table row of `layer`'s `expert` (`ExpertId::dense_index`).
    pub fn key(&self, layer: usize, expert: usize) -> usize {
        ExpertId::new(layer as u32, expert as u32).dense_index(self.model.experts)
    }

    pub fn overlapped(&self) -> bool {
        self.shared.schedule.overlaps(self.dev.slots.slot_count())
    }

    /// `layer`'s `routed` experts (ascending) are this pass's: the host
    /// tier is asked for them alone from now on, for the next layer's
    /// experts the affinity prediction names, and for the later layers'
    /// their last routing's (one device; `routed_io.rs`).
    fn follow_routing(&mut self, layer: usize, perm: &Permutation, routed: &[usize]) {
        let (missed, unused) = self.dev.io.routed(layer, perm, routed);
        self.dev.acc.prediction_missed += missed;
        self.dev.acc.prediction_unused += unused;
        if streams(&self.shared.cache, self.model) {
            let from = Phase::Forward(layer);
            let order = self.dev.io.schedule(
                self.model,
                self.shared,
                (self.overlapped(), self.group()),
                from,
                &self.dev.slots,
            );
            self.shared.cache.set_schedule(order);
        }
    }

    /// Makes `expert`'s compute params arrive in a device slot: waits for
    /// its pending update, pins its host record, and starts the upload into
    /// a slot not in `protect`.
    fn stage(
        &mut self,
        layer: usize,
        expert: usize,
        protect: &[usize],
    ) -> Result<Staged, EngineError> {
        let key = self.key(layer, expert);
        let shared = self.shared;
        let acc = &mut self.dev.acc;
        shared.reap_finished()?;
        // A deferred update of this expert goes in now, just before its
        // forward, as its record arrives (the forward's tail reads it in
        // full): the update's access is then the one the schedule expects.
        acc.stall_optimizer_s += shared.release_held(Held::Of(key))?;
        let t0 = Instant::now();
        let waited = shared.wait_update(key)?;
        acc.stall_optimizer_s += waited;
        if let Some(timeline) = shared.timeline.as_deref().filter(|_| waited > 0.0) {
            timeline.record("stall", "update", t0, || format!("{layer}.{expert}"));
        }
        let version = shared.version(key);
        if let Some(slot) = self.dev.slots.lookup(key, version) {
            acc.device_hits += 1;
            return Ok(Staged {
                expert,
                slot,
                upload: None,
            });
        }
        acc.device_misses += 1;
        let id = ExpertId::new(layer as u32, expert as u32);
        let (guard, waited) =
            shared.acquire(|cache, wait| cache.acquire_within(id, Parts::Compute, wait))?;
        acc.stall_optimizer_s += waited;
        let slot = self.dev.slots.claim(key, version, protect);
        let upload = self.dev.device.arena().upload_htod(slot, Box::new(guard))?;
        acc.bytes_host_to_device += shared.layout.compute_payload_bytes();
        if shared.schedule == ScheduleKind::Naive {
            let _span = TimelineSpan::start(shared.timeline.as_deref(), "stall", "upload")
                .with_detail(|| format!("{layer}.{expert}"));
            let t0 = Instant::now();
            upload.wait()?;
            acc.stall_upload_s += t0.elapsed().as_secs_f64();
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

    /// [`Self::stage`] for each of `experts` in turn, each into a slot
    /// neither in `protect` nor taken by the group before it (`spared`, a
    /// buffer the pass reuses, holds both).
    fn stage_group(
        &mut self,
        layer: usize,
        experts: &[usize],
        protect: &[usize],
        spared: &mut Vec<usize>,
    ) -> Result<Vec<Staged>, EngineError> {
        spared.clear();
        spared.extend_from_slice(protect);
        let mut group = Vec::with_capacity(experts.len());
        for &expert in experts {
            let staged = self.stage(layer, expert, spared)?;
            spared.push(staged.slot);
            group.push(staged);
        }
        Ok(group)
    }

    /// How many experts the device computes at once here: the engine's
    /// group ([`DeviceState::group`](super::slot_table::DeviceState)),
    /// which is 1 but on one device whose experts read rows in its own
    /// memory and compute several in one call (a GPU's grouped GEMMs).
    pub fn group(&self) -> usize {
        self.dev.group
    }

    /// Walks `order`, staging expert i+1 before computing expert i when
    /// the device has room for both, and calls `compute` on each
    /// ([`Self::pipeline_groups`] a group of one at a time).
    pub fn pipeline(
        &mut self,
        pass: Pass,
        layer: usize,
        order: &[usize],
        mut compute: impl FnMut(&mut Self, usize, SlotParams) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        self.pipeline_groups(pass, layer, order, |runner, group| {
            for &(expert, params) in group {
                compute(runner, expert, params)?;
            }
            Ok(())
        })
    }

    /// Walks `order` in groups of [`Self::group`] experts, staging group
    /// i+1 before computing group i when the device has room for both, and
    /// calls `compute` on each group's experts and their slots. Where the
    /// device orders its reads after the uploads itself (a GPU), the host
    /// does not wait for a group's uploads before its compute is queued,
    /// only, before it stages another group or hands a gradient to an
    /// update (which may need a host slot), for the group's before it: so
    /// it leads the device by two groups at most, and holds no more host
    /// slots in uploads than two groups' worth. The pass ends by waiting
    /// for the device's queued work, then for the last group's uploads.
    pub fn pipeline_groups(
        &mut self,
        pass: Pass,
        layer: usize,
        order: &[usize],
        mut compute: impl FnMut(&mut Self, &[(usize, SlotParams)]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let shared = self.shared;
        let timeline = shared.timeline.as_deref();
        let _span = TimelineSpan::start(timeline, "experts", pass.name())
            .with_detail(|| format!("layer {layer}, {} experts", order.len()));
        let overlap = self.overlapped();
        let on_device = self.dev.device.orders_uploads();
        let group = self.group().max(1);
        let groups: Vec<&[usize]> = order.chunks(group).collect();
        // Reused from group to group.
        let (mut slots, mut members) = (Vec::with_capacity(group), Vec::with_capacity(group));
        let mut spared = Vec::with_capacity(2 * group);
        let mut next = match groups.first() {
            Some(experts) => Some(self.stage_group(layer, experts, &[], &mut spared)?),
            None => None,
        };
        for i in 0..groups.len() {
            let current = next.take().expect("staged");
            slots.clear();
            slots.extend(current.iter().map(|s| s.slot));
            self.wait_landing()?;
            if overlap && i + 1 < groups.len() {
                next = Some(self.stage_group(layer, groups[i + 1], &slots, &mut spared)?);
                // The held updates of the group after next, if their
                // records are in: the schedule asks for them right after
                // the next group's compute params, and they run beside
                // this compute.
                if let (Pass::Forward, Some(after)) = (pass, groups.get(i + 2)) {
                    for &expert in *after {
                        let key = self.key(layer, expert);
                        self.dev.acc.stall_optimizer_s +=
                            shared.release_held(Held::OfIfReady(key))?;
                    }
                }
            }
            members.clear();
            for staged in current {
                let expert = staged.expert;
                match staged.upload {
                    Some(upload) if on_device => self.landing.push(Landing {
                        upload,
                        layer,
                        expert,
                    }),
                    Some(upload) => self.wait_upload(&upload, layer, expert)?,
                    None => {}
                }
                members.push((expert, SlotParams::new(&self.shared.layout, staged.slot)));
            }
            compute(self, &members)?;
            if next.is_none() && i + 1 < groups.len() {
                // A device of one group's slots refills them: the compute
                // that read them has ended (cpu) or orders the uploads
                // after it (GPU).
                let protect = match self.dev.slots.slot_count() > slots.len() {
                    true => &slots[..],
                    false => &[],
                };
                next = Some(self.stage_group(layer, groups[i + 1], protect, &mut spared)?);
            }
        }
        self.finish_pass()
    }

    /// Waits on the host for [`Self::landing`]'s uploads, if any, which
    /// unpins their host slots.
    pub(super) fn wait_landing(&mut self) -> Result<(), EngineError> {
        for l in std::mem::take(&mut self.landing) {
            self.wait_upload(&l.upload, l.layer, l.expert)?;
        }
        Ok(())
    }

    /// Waits on the host for `layer`'s `expert`'s upload, a stall.
    fn wait_upload(
        &mut self,
        upload: &CopyEvent,
        layer: usize,
        expert: usize,
    ) -> Result<(), EngineError> {
        let timeline = self.shared.timeline.as_deref();
        let _span = TimelineSpan::start(timeline, "stall", "upload")
            .with_detail(|| format!("{layer}.{expert}"));
        let t0 = Instant::now();
        upload.wait()?;
        self.dev.acc.stall_upload_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Waits for the expert work the device has queued in this pass (its
    /// time is the experts' compute), then for the [`Self::landing`] upload
    /// it ordered that work after, which has landed by then unless it
    /// failed.
    fn finish_pass(&mut self) -> Result<(), EngineError> {
        self.take_pending_gradients()?;
        let t0 = Instant::now();
        self.dev.device.finish_pass()?;
        if self.dev.device.computes() {
            self.dev.acc.expert_compute_s += t0.elapsed().as_secs_f64();
        }
        self.wait_landing()
    }

    /// ye (n, D) = expert(xe (n, D)), written whole, keeping what its
    /// backward needs.
    pub fn expert_forward(
        &mut self,
        layer: usize,
        expert: usize,
        xe: &[f32],
        params: SlotParams,
        ye: &mut [f32],
    ) -> Result<(), EngineError> {
        let (d, f) = (self.model.d_model, self.model.d_ff);
        let n = xe.len() / d;
        assert_eq!(ye.len(), n * d);
        self.dev.acc.assignments_computed += n as u64;
        let t0 = Instant::now();
        let saved = &mut self.dev.saved[layer][expert];
        saved.fit(n * f);
        self.dev
            .device
            .expert_forward(self.model.expert_kind, ye, saved, xe, params, n, d, f)?;
        if self.options.recompute_hidden {
            saved.a = Vec::new();
            saved.b = Vec::new();
        }
        if self.dev.device.computes() {
            self.dev.acc.expert_compute_s += t0.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// dxe (n, D) from dye (n, D); the expert's gradient is summed with the
    /// step's earlier micro-batches' and, on the last, handed to the
    /// optimizer at once.
    #[allow(clippy::too_many_arguments)]
    pub fn expert_backward(
        &mut self,
        layer: usize,
        expert: usize,
        xe: &[f32],
        dye: &[f32],
        params: SlotParams,
        last_micro_batch: bool,
        dxe: &mut [f32],
    ) -> Result<(), EngineError> {
        let (d, f) = (self.model.d_model, self.model.d_ff);
        let kind = self.model.expert_kind;
        let n = xe.len() / d;
        let key = self.key(layer, expert);
        // Overwritten by the backward.
        let mut grad = self.shared.grads.take();
        debug_assert_eq!(grad.len(), params.count);
        assert_eq!(dxe.len(), n * d); // written whole, by the device or here
        self.dev.acc.assignments_computed += n as u64;
        let t0 = Instant::now();
        let saved = &mut self.dev.saved[layer][expert];
        if self.options.recompute_hidden && !self.dev.device.backward_recomputes() {
            // The output is written whole and not needed: only `saved`.
            let mut scratch = self.dev.scratch.take(n * d);
            let device = &mut self.dev.device;
            device.expert_forward(kind, &mut scratch, saved, xe, params, n, d, f)?;
            self.dev.scratch.give(scratch);
        }
        self.dev
            .device
            .expert_backward(kind, dxe, &mut grad, dye, saved, xe, params, n, d, f)?;
        self.expert_gradient(key, grad, t0, last_micro_batch)
    }

    /// The gradient of the expert at table row `key`, its backward begun
    /// at `t0`, summed with the step's earlier micro-batches' and, on the
    /// last, handed to the optimizer at once.
    pub(super) fn expert_gradient(
        &mut self,
        key: usize,
        grad: Vec<f32>,
        t0: Instant,
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        self.count_gradient(t0);
        if let Some(grad) = self.shared.accumulate(key, grad, last_micro_batch) {
            if self.shared.train {
                self.dev.slots.invalidate(key); // its params are about to change
            }
            let now = self.shared.submits_at_once(key, true);
            if now {
                self.make_room_for_update()?;
            }
            self.dev.acc.stall_optimizer_s += self.shared.submit(key, grad, When::Scheduled)?;
            if now {
                self.dev.in_flight.push_back(key);
            }
        }
        Ok(())
    }

    /// Before this device submits an update: waits for its oldest updates
    /// until fewer than [`updates_in_flight_max`] are in flight, so that
    /// the gradients they hold stay within the memory plan's count
    /// (`HostMemoryPlan::gradients`). The wait is the optimizer's stall.
    pub(super) fn make_room_for_update(&mut self) -> Result<(), EngineError> {
        let max = updates_in_flight_max(self.shared.experts_per_layer);
        self.shared.retain_pending(&mut self.dev.in_flight);
        while self.dev.in_flight.len() >= max {
            let oldest = self.dev.in_flight.pop_front();
            let oldest = oldest.expect("it holds max ≥ 2 keys");
            self.dev.acc.stall_optimizer_s += self.shared.wait_update(oldest)?;
        }
        Ok(())
    }
}

impl DeviceRunner<'_> {
    /// A layer's forward is routed by `perm`: counts its tokens per
    /// expert and tells the tiers; returns the experts with tokens, in the
    /// order they compute.
    fn forward_routed(&mut self, layer: usize, perm: &Permutation) -> Vec<usize> {
        let experts = self.model.experts;
        let order: Vec<usize> = (0..experts).filter(|&e| perm.count(e) > 0).collect();
        for e in 0..experts {
            self.dev.acc.tokens_per_expert[layer][e] += perm.count(e) as u32;
        }
        if let Some(counter) = self.dev.routing.as_mut() {
            counter.routed(layer, perm);
        }
        self.dev.fit_saved(layer, &order);
        if self.shared.devices == 1 {
            self.follow_routing(layer, perm, &order);
        }
        order
    }

    /// An expert's gradient in the step's metrics: its bytes to the host,
    /// and the time since `t0` (its backward's start, or the wait for it)
    /// as compute.
    pub(super) fn count_gradient(&mut self, t0: Instant) {
        if self.dev.device.computes() {
            self.dev.acc.expert_compute_s += t0.elapsed().as_secs_f64();
        }
        self.dev.acc.bytes_device_to_host += 4 * self.shared.layout.params_per_expert;
    }
}

impl ExpertRunner for DeviceRunner<'_> {
    fn takes_device_rows(&self) -> bool {
        self.shared.devices == 1 && self.dev.device.takes_device_rows()
    }

    fn needs_assignments(&self) -> bool {
        self.dev.routing.is_some() || self.dev.io.pairs_tokens()
    }

    unsafe fn forward_layer_rows(
        &mut self,
        layer: usize,
        perm: &Permutation,
        rows: DeviceRows,
        out: DeviceRows,
    ) -> Result<(), EngineError> {
        let d = self.model.d_model;
        let order = self.forward_routed(layer, perm);
        self.pipeline_groups(Pass::Forward, layer, &order, |runner, experts| {
            let group: Vec<ExpertForwardRows> = experts
                .iter()
                .map(|&(expert, params)| {
                    let span = perm.span(expert);
                    let (x, out) = (rows.rows(span.clone(), d), out.rows(span, d));
                    ExpertForwardRows { params, x, out }
                })
                .collect();
            // SAFETY: each expert's block of the caller's rows (this
            // function's contract).
            unsafe { runner.experts_forward_rows(&group) }
        })
    }

    unsafe fn backward_layer_rows(
        &mut self,
        layer: usize,
        perm: &Permutation,
        [rows, dout, dx]: [DeviceRows; 3],
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        let (d, experts) = (self.model.d_model, self.model.experts);
        let order: Vec<usize> = (0..experts).rev().filter(|&e| perm.count(e) > 0).collect();
        self.pipeline_groups(Pass::Backward, layer, &order, |runner, members| {
            let group: Vec<ExpertBackwardRows> = members
                .iter()
                .map(|&(expert, params)| {
                    let [x, dout, dx] = [rows, dout, dx].map(|r| r.rows(perm.span(expert), d));
                    ExpertBackwardRows {
                        params,
                        x,
                        dout,
                        dx,
                    }
                })
                .collect();
            let experts: Vec<usize> = members.iter().map(|&(e, _)| e).collect();
            // SAFETY: as in the forward.
            unsafe { runner.experts_backward_rows(layer, &experts, &group, last_micro_batch) }
        })
    }

    fn take_buffer(&mut self, len: usize) -> Vec<f32> {
        self.dev.buffers.take(len)
    }

    fn give_buffer(&mut self, buf: Vec<f32>) {
        self.dev.buffers.give(buf);
    }

    fn forward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let order = self.forward_routed(layer, perm);
        self.pipeline_groups(Pass::Forward, layer, &order, |runner, members| {
            runner.forward_group(layer, perm, x, out, members)
        })
    }

    fn backward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        dout: AssignmentGrads<'_, f32>,
        dx: &mut [f32],
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        let experts = self.model.experts;
        let order: Vec<usize> = (0..experts).rev().filter(|&e| perm.count(e) > 0).collect();
        self.pipeline_groups(Pass::Backward, layer, &order, |runner, members| {
            runner.backward_group(layer, perm, x, dout, dx, last_micro_batch, members)
        })
    }
}
