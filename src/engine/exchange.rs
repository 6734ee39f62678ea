//! One device's share of a layer when several devices run a step (ES-MoE
//! §4.2, fig. 3): after the gate, the devices all-gather their per-expert
//! token counts, each places every expert by the same greedy LPT over the
//! global counts (so all agree without talking), sends each expert's rows
//! to the device it was given, computes its own experts on the rows of all
//! devices (concatenated in device order), and sends the outputs back.
//!
//! An expert's rows arrive in device order and, within a device, in token
//! order, so its GEMMs see the same rows in the same order whichever device
//! computes it: placement and pinning change where the work runs, never
//! the numbers.

use std::time::Instant;

use super::access::{placed_schedule, Phase, PlacedLayer};
use super::config::ExchangeParts;
use super::dense_buckets::DenseBuckets;
use super::pipeline::{DeviceRunner, Pass};
use crate::backend::SlotParams;
use crate::comm::Comm;
use crate::math::{gather_forward, AssignmentGrads, Permutation};
use crate::model::{ExpertRunner, ScratchBuf};
use crate::placement::{CostModel, LptPlacer};
use crate::EngineError;

mod granularity;
mod pipelined;

pub(crate) use granularity::{calibrate, local_cost};
pub use granularity::{project_exchange, LinkFit, UniformLayer};

/// This micro-batch's decisions for one layer, kept from its forward for
/// its backward (the experts' saved activations live where they ran).
#[derive(Clone, Default)]
struct LayerPlan {
    /// [device][expert] assignments routed from each device's tokens.
    counts: Vec<Vec<u32>>,
    /// [expert] the device that computes it.
    owner: Vec<u16>,
}

/// How every device's or rank's exchange runner splits and prices a
/// step's exchange.
#[derive(Clone)]
pub(crate) struct ExchangeTuning {
    /// How each layer's exchange is split into parts, each on the wire
    /// while the experts of another compute (`pipelined`).
    pub parts: ExchangeParts,
    /// The link's fitted cost (`granularity`): with it each layer's
    /// predicted time is counted.
    pub link_fit: Option<LinkFit>,
    /// `ExchangeParts::Auto`: [layer][forward, backward] the parts the
    /// search (`part_search.rs`) asks for this step.
    pub auto_counts: Vec<[usize; 2]>,
    /// The exchange's own work per expert, [forward, backward], as the
    /// model counts it (`granularity::local_cost`).
    pub local_s_per_expert: [f64; 2],
}

impl Default for ExchangeTuning {
    /// One part a layer, nothing modeled.
    fn default() -> Self {
        Self {
            parts: ExchangeParts::Fixed(1),
            link_fit: None,
            auto_counts: Vec::new(),
            local_s_per_expert: [0.0; 2],
        }
    }
}

pub(crate) struct ExchangeRunner<'a, C: Comm> {
    pub inner: DeviceRunner<'a>,
    pub comm: C,
    placer: LptPlacer,
    cost: CostModel,
    /// [layer][expert] the device where the expert is pinned.
    pinned: &'a [Vec<Option<u16>>],
    /// Ranks as processes: [layer][expert] the rank that owns the expert,
    /// whose tiers alone hold its record; it computes the expert at every
    /// step instead of LPT's choice. `None`: LPT places every layer.
    owners: Option<&'a [Vec<u16>]>,
    plans: Vec<LayerPlan>,
    /// Where the dense gradient's final ranges go during the backward, if
    /// they are reduced beside it.
    pub buckets: Option<DenseBuckets>,
    /// How each layer's exchange is split and priced (`pipelined`).
    tuning: ExchangeTuning,
}

impl<'a, C: Comm> ExchangeRunner<'a, C> {
    pub fn new(
        inner: DeviceRunner<'a>,
        comm: C,
        cost: CostModel,
        pinned: &'a [Vec<Option<u16>>],
        owners: Option<&'a [Vec<u16>]>,
    ) -> Self {
        let (layers, experts) = (inner.model.layers, inner.model.experts);
        let devices = comm.size();
        Self {
            inner,
            comm,
            placer: LptPlacer::new(experts, devices),
            cost,
            pinned,
            owners,
            plans: vec![LayerPlan::default(); layers],
            buckets: None,
            tuning: ExchangeTuning::default(),
        }
    }

    /// This runner with the step's `tuning`.
    pub fn tuned(mut self, tuning: ExchangeTuning) -> Self {
        self.tuning = tuning;
        self
    }

    fn me(&self) -> u16 {
        self.comm.rank() as u16
    }

    /// Per source device, where each of this device's experts (those
    /// `keep` keeps) starts in the rows that device sends here (experts in
    /// index order), in values.
    fn offsets(&self, layer: usize, keep: &dyn Fn(usize) -> bool) -> Vec<Vec<usize>> {
        let plan = &self.plans[layer];
        let d = self.inner.model.d_model;
        plan.counts
            .iter()
            .map(|counts| {
                let mut at = 0;
                (0..counts.len())
                    .map(|e| {
                        let here = at;
                        if plan.owner[e] == self.me() && keep(e) {
                            at += counts[e] as usize * d;
                        }
                        here
                    })
                    .collect()
            })
            .collect()
    }

    /// The layer's exchange in one part: every row dispatched (from
    /// `fill`), `compute` run on each of this device's experts' rows, and
    /// every result sent back and written to `out`.
    fn whole(
        &mut self,
        layer: usize,
        perm: &Permutation,
        pass: Pass,
        fill: impl FnMut(&mut [f32], &[u32]),
        out: &mut [f32],
        mut compute: impl ExpertRows,
    ) -> Result<(), EngineError> {
        let d = self.inner.model.d_model;
        let all = |_: usize| true;
        let sends = self.outgoing(layer, perm, &all, fill);
        self.inner.dev.acc.token_exchanges += 2;
        let received = self.all_to_all(sends)?;
        let offsets = self.offsets(layer, &all);
        let mut replies = self.reply_buffers(layer, &all);
        let mine = self.mine(layer, matches!(pass, Pass::Backward));
        self.inner.dev.acc.exchange_experts[pass_index(pass)] += mine.len() as u64;
        let plan = &self.plans[layer];
        let rows: Vec<Vec<f32>> = mine
            .iter()
            .map(|&e| concat(plan, d, e, &received, &offsets))
            .collect();
        drop(received);
        let mut results: Vec<(usize, ScratchBuf)> = Vec::with_capacity(mine.len());
        let mut rows = rows.into_iter();
        self.inner
            .pipeline(pass, layer, &mine, |runner, expert, params| {
                let input = rows.next().expect("one block of rows per expert");
                results.push((expert, compute(runner, expert, params, input)?));
                Ok(())
            })?;
        for (expert, result) in results {
            split_into(
                &self.plans[layer],
                d,
                expert,
                &result,
                &mut replies,
                &offsets,
            );
            self.inner.dev.scratch.give(result);
        }
        let back = self.all_to_all(replies)?;
        self.scatter_back(layer, perm, &all, &back, out);
        Ok(())
    }

    /// Counts the time since `start` as the layer's exchange in `pass`,
    /// and what of it was neither the experts' compute nor waiting for the
    /// wire (each measured since `start`) as its own work.
    fn count_exchange(&mut self, layer: usize, pass: Pass, start: ExchangeStart) {
        let secs = start.at.elapsed().as_secs_f64();
        let acc = &mut self.inner.dev.acc;
        acc.exchange_s += secs;
        acc.exchange_layer_s[layer][pass_index(pass)] += secs;
        let experts = acc.expert_compute_s - start.expert_compute_s;
        let waited = acc.exchange_wait_s - start.wait_s;
        acc.exchange_local_s[pass_index(pass)] += (secs - experts - waited).max(0.0);
    }

    /// Where a layer's exchange starts: the clock and the counters its own
    /// work is told apart by.
    fn exchange_start(&self) -> ExchangeStart {
        let acc = &self.inner.dev.acc;
        ExchangeStart {
            at: Instant::now(),
            expert_compute_s: acc.expert_compute_s,
            wait_s: acc.exchange_wait_s,
        }
    }

    /// `comm`'s all-to-all of `sends`, its time counted as waiting for the
    /// wire.
    fn all_to_all(&mut self, sends: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, EngineError> {
        let t0 = Instant::now();
        let received = self.comm.all_to_all(sends);
        self.inner.dev.acc.exchange_wait_s += t0.elapsed().as_secs_f64();
        Ok(received?)
    }

    /// Tells the host tier the order its devices will now ask for experts
    /// in. Devices of one process share it, and rank 0 speaks for them all
    /// (every device is past the layer's first collective, and none stages
    /// an expert before rank 0 joins the next one); a rank of its own
    /// (`owners`) lists its own experts alone, those of layers still to be
    /// routed included.
    fn reschedule(&self, from: Phase) {
        let me = self.comm.rank();
        if self.owners.is_none() && me != 0 {
            return;
        }
        let model = self.inner.model;
        let placed_upto = match from {
            Phase::Forward(l) => l,
            Phase::Backward(_) => model.layers - 1,
        };
        let unrouted = [vec![1u32; model.experts]];
        let placed: Vec<Option<PlacedLayer<'_>>> = (0..model.layers)
            .map(|l| match (l <= placed_upto, self.owners) {
                (true, _) => Some(PlacedLayer {
                    owner: &self.plans[l].owner,
                    counts: &self.plans[l].counts,
                }),
                (false, Some(owners)) => Some(PlacedLayer {
                    owner: &owners[l],
                    counts: &unrouted,
                }),
                (false, None) => None,
            })
            .collect();
        let devices = match self.owners {
            Some(_) => me..me + 1,
            None => 0..self.comm.size(),
        };
        let order = placed_schedule(model, self.inner.overlapped(), devices, &placed, from);
        self.inner.shared.cache.set_schedule(order);
    }

    /// This device's experts with tokens, in `order`.
    fn mine(&self, layer: usize, reverse: bool) -> Vec<usize> {
        let plan = &self.plans[layer];
        let total = |e: usize| plan.counts.iter().map(|c| c[e] as u64).sum::<u64>();
        let mut mine: Vec<usize> = (0..plan.owner.len())
            .filter(|&e| plan.owner[e] == self.me() && total(e) > 0)
            .collect();
        if reverse {
            mine.reverse();
        }
        mine
    }

    /// Buffers for the replies: to each device, its rows of this device's
    /// experts (those `keep` keeps).
    fn reply_buffers(&self, layer: usize, keep: &dyn Fn(usize) -> bool) -> Vec<Vec<f32>> {
        let plan = &self.plans[layer];
        let d = self.inner.model.d_model;
        plan.counts
            .iter()
            .map(|counts| {
                let n: usize = (0..counts.len())
                    .filter(|&e| plan.owner[e] == self.me() && keep(e))
                    .map(|e| counts[e] as usize * d)
                    .sum();
                vec![0.0f32; n]
            })
            .collect()
    }

    /// This device's rows of every expert `keep` keeps (from `fill`),
    /// grouped by the device that computes the expert.
    fn outgoing(
        &self,
        layer: usize,
        perm: &Permutation,
        keep: &dyn Fn(usize) -> bool,
        mut fill: impl FnMut(&mut [f32], &[u32]),
    ) -> Vec<Vec<f32>> {
        let plan = &self.plans[layer];
        let d = self.inner.model.d_model;
        let mut sends = vec![Vec::new(); self.comm.size()];
        for e in 0..plan.owner.len() {
            let rows = perm.rows(e);
            if rows.is_empty() || !keep(e) {
                continue;
            }
            let buf = &mut sends[plan.owner[e] as usize];
            let at = buf.len();
            buf.resize(at + rows.len() * d, 0.0);
            fill(&mut buf[at..], rows);
        }
        sends
    }

    /// Writes what came back (rows of this device's tokens, from each
    /// expert's device) to their expert's block of `out` (expert order), for
    /// the experts `keep` keeps.
    fn scatter_back(
        &self,
        layer: usize,
        perm: &Permutation,
        keep: &dyn Fn(usize) -> bool,
        back: &[Vec<f32>],
        out: &mut [f32],
    ) {
        let plan = &self.plans[layer];
        let d = self.inner.model.d_model;
        let mut cursor = vec![0usize; back.len()];
        for e in 0..plan.owner.len() {
            let block = perm.block_mut(out, e, d);
            if block.is_empty() || !keep(e) {
                continue;
            }
            let owner = plan.owner[e] as usize;
            let n = block.len();
            crate::parallel::copy_into(block, &back[owner][cursor[owner]..cursor[owner] + n]);
            cursor[owner] += n;
        }
    }
}

/// The clock and counters at a layer exchange's start
/// ([`ExchangeRunner::count_exchange`]).
struct ExchangeStart {
    at: Instant,
    expert_compute_s: f64,
    wait_s: f64,
}

/// What a device runs on one of its experts' rows (as they arrived from
/// every device, in device order): the block of results to send back.
pub(super) trait ExpertRows:
    FnMut(&mut DeviceRunner<'_>, usize, SlotParams, Vec<f32>) -> Result<ScratchBuf, EngineError>
{
}

impl<F> ExpertRows for F where
    F: FnMut(&mut DeviceRunner<'_>, usize, SlotParams, Vec<f32>) -> Result<ScratchBuf, EngineError>
{
}

/// A pass's index in per-layer [forward, backward] pairs.
fn pass_index(pass: Pass) -> usize {
    match pass {
        Pass::Forward => 0,
        Pass::Backward => 1,
    }
}

/// Each device's rows for `expert`, concatenated in device order.
fn concat(
    plan: &LayerPlan,
    d: usize,
    expert: usize,
    received: &[Vec<f32>],
    offsets: &[Vec<usize>],
) -> Vec<f32> {
    let mut rows = Vec::new();
    for (src, buf) in received.iter().enumerate() {
        let at = offsets[src][expert];
        rows.extend_from_slice(&buf[at..at + plan.counts[src][expert] as usize * d]);
    }
    rows
}

/// Splits an expert's output rows back into the replies to each device.
fn split_into(
    plan: &LayerPlan,
    d: usize,
    expert: usize,
    rows: &[f32],
    replies: &mut [Vec<f32>],
    offsets: &[Vec<usize>],
) {
    let mut from = 0;
    for (src, reply) in replies.iter_mut().enumerate() {
        let n = plan.counts[src][expert] as usize * d;
        let at = offsets[src][expert];
        reply[at..at + n].copy_from_slice(&rows[from..from + n]);
        from += n;
    }
}

impl<C: Comm> ExpertRunner for ExchangeRunner<'_, C> {
    fn take_buffer(&mut self, len: usize) -> Vec<f32> {
        self.inner.take_buffer(len)
    }

    fn give_buffer(&mut self, buf: Vec<f32>) {
        self.inner.give_buffer(buf);
    }

    fn dense_grad_final(&mut self, grad: &[f32], range: std::ops::Range<usize>) {
        if let Some(buckets) = self.buckets.as_mut() {
            buckets.final_range(grad, range);
        }
    }

    fn forward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let (k, d, experts) = (
            self.inner.model.top_k,
            self.inner.model.d_model,
            self.inner.model.experts,
        );
        let local: Vec<u32> = (0..experts).map(|e| perm.rows(e).len() as u32).collect();
        for (e, &c) in local.iter().enumerate() {
            self.inner.dev.acc.tokens_per_expert[layer][e] += c;
        }
        if let Some(counter) = self.inner.dev.routing.as_mut() {
            counter.routed(layer, perm);
        }
        let counts = self.comm.all_gather_u32(local)?;
        let global: Vec<u32> = (0..experts)
            .map(|e| counts.iter().map(|c| c[e]).sum())
            .collect();
        let owner = match self.owners {
            Some(owners) => owners[layer].clone(),
            None => {
                let mut owner = vec![0u16; experts];
                self.placer
                    .place(&global, &self.pinned[layer], &self.cost, &mut owner);
                owner
            }
        };
        self.plans[layer] = LayerPlan { counts, owner };
        self.reschedule(Phase::Forward(layer));
        let mine = self.mine(layer, false);
        self.inner.dev.fit_saved(layer, &mine);

        let fill = |buf: &mut [f32], rows: &[u32]| gather_forward(buf, x, rows, k, d);
        // An expert's output from its rows, which it keeps for the backward.
        let compute = |runner: &mut DeviceRunner<'_>, e: usize, params, xe: Vec<f32>| {
            let mut ye = runner.dev.scratch.take(xe.len()); // written whole
            runner.expert_forward(layer, e, &xe, params, &mut ye)?;
            runner.dev.saved_x[layer][e] = xe;
            Ok(ye)
        };
        let start = self.exchange_start();
        let pass = Pass::Forward;
        let result = match self.partitions(layer, pass) {
            Some(parts) => self.in_parts(layer, perm, pass, &parts, fill, out, compute),
            None => self.whole(layer, perm, pass, fill, out, compute),
        };
        self.count_exchange(layer, Pass::Forward, start);
        result
    }

    fn backward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        _x: &[f32],
        dout: AssignmentGrads<'_, f32>,
        dx: &mut [f32],
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        self.reschedule(Phase::Backward(layer));
        let fill = |buf: &mut [f32], rows: &[u32]| dout.gather(buf, rows);
        // An expert's input gradient from its output gradient's rows.
        let compute = |runner: &mut DeviceRunner<'_>, e: usize, params, dye: Vec<f32>| {
            let xe = std::mem::take(&mut runner.dev.saved_x[layer][e]);
            let mut dxe = runner.dev.scratch.take(xe.len()); // written whole
            let last = last_micro_batch;
            runner.expert_backward(layer, e, &xe, &dye, params, last, &mut dxe)?;
            Ok(dxe)
        };
        let start = self.exchange_start();
        let pass = Pass::Backward;
        let result = match self.partitions(layer, pass) {
            Some(parts) => self.in_parts(layer, perm, pass, &parts, fill, dx, compute),
            None => self.whole(layer, perm, pass, fill, dx, compute),
        };
        self.count_exchange(layer, Pass::Backward, start);
        result
    }
}
