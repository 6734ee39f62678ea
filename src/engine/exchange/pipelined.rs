//! A layer's exchange in parts, each on the wire while the experts of
//! another compute (MPMoE's pipelined all-to-all, `../shared/papers/002`).
//!
//! MPMoE splits a layer's tokens along the batch. Here the parts are
//! groups of the experts each device computes: part p holds the p-th
//! share of every device's experts (in the order it computes them), so
//! every device has work in every part, and every expert's rows still
//! arrive whole, from every device, in the unpipelined order. Its GEMMs
//! therefore see the same rows as in one exchange, and a weight gradient,
//! a sum over its rows, keeps its order: the results are the same bits,
//! where a split along the batch would sum each weight gradient in pieces.
//!
//! The endpoint moves to a wire thread for the layer, which runs the
//! collectives in the order every rank queues them: the dispatches of
//! parts 0, 1, …, n − 1 at once, then the combine of each part once its
//! experts have computed. While the experts of part p compute, the
//! dispatches of the parts after it and the combine of the one before are
//! on the wire. A part in which this device has no expert still takes its
//! place in that order (its sends and replies empty), as its peers call it.
//! A failure ends the wire thread after the collective it is in; every
//! collective queued is one every rank queues, so none waits for a peer
//! that will not come unless that peer's endpoint is gone, which fails it.

use crossbeam_channel::{bounded, Receiver, Sender};

use super::granularity::{predict, LayerLoad};
use super::{concat, pass_index, split_into, ExchangeRunner, ExpertRows, LayerPlan};
use crate::comm::{Comm, CommError};
use crate::engine::config::ExchangeParts;
use crate::engine::pipeline::Pass;
use crate::math::Permutation;
use crate::model::{ScratchBuf, ScratchBuffers};
use crate::EngineError;

/// [expert] the part its exchange is in (`usize::MAX`: no token routed to
/// it), and the number of parts.
pub(super) struct Parts {
    of: Vec<usize>,
    count: usize,
}

impl<C: Comm> ExchangeRunner<'_, C> {
    /// How this layer's exchange is split for `pass`, or `None` for one
    /// exchange. Every rank finds the same parts: they follow from the
    /// layer's plan, which every rank holds, and, under `auto`, from the
    /// search's counts, which every rank shares. With a fitted link, the
    /// model's time for the split is counted (`exchange_model_s`).
    pub(super) fn partitions(&mut self, layer: usize, pass: Pass) -> Option<Parts> {
        let lists = self.compute_lists(layer, pass);
        let most = lists.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let experts = self.plans[layer].owner.len();
        let asked = match self.tuning.parts {
            ExchangeParts::Fixed(n) => n,
            ExchangeParts::Auto => self.tuning.auto_counts[layer][pass_index(pass)],
        };
        let count = asked.clamp(1, most);
        let of = parts_of(&lists, count, experts);
        if let Some(fit) = self.tuning.link_fit {
            let load = self.layer_load(layer, pass);
            self.inner.dev.acc.exchange_model_s += predict(&fit, &load, &of, count);
        }
        self.inner.dev.acc.exchange_layer_parts[layer][pass_index(pass)] = count;
        (count > 1).then_some(Parts { of, count })
    }

    /// [device] its experts with rows in this layer, in the order it
    /// computes them in `pass`.
    fn compute_lists(&self, layer: usize, pass: Pass) -> Vec<Vec<usize>> {
        let plan = &self.plans[layer];
        let total = |e: usize| plan.counts.iter().map(|c| c[e] as u64).sum::<u64>();
        (0..self.comm.size())
            .map(|dev| {
                let mut list: Vec<usize> = (0..plan.owner.len())
                    .filter(|&e| plan.owner[e] as usize == dev && total(e) > 0)
                    .collect();
                if matches!(pass, Pass::Backward) {
                    list.reverse(); // the order `mine` computes them in
                }
                list
            })
            .collect()
    }

    /// What the cost model needs of this layer in `pass`: its plan, a
    /// row's bytes, and the pass's share of the placement's cost per row.
    fn layer_load(&self, layer: usize, pass: Pass) -> LayerLoad<'_> {
        let plan = &self.plans[layer];
        let d = self.inner.model.d_model;
        let cost = (self.cost.per_token_s, self.tuning.local_s_per_expert);
        LayerLoad::in_pass(&plan.counts, &plan.owner, d, cost, pass)
    }

    /// Dispatches this device's rows (from `fill`) part by part, runs
    /// `compute` on each of its experts' rows as their part arrives, sends
    /// the results back part by part, and writes what comes back to `out`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn in_parts(
        &mut self,
        layer: usize,
        perm: &Permutation,
        pass: Pass,
        parts: &Parts,
        mut fill: impl FnMut(&mut [f32], &[u32]),
        out: &mut [f32],
        mut compute: impl ExpertRows,
    ) -> Result<(), EngineError> {
        let n = parts.count;
        let keep = |p: usize| move |e: usize| parts.of[e] == p;
        let sends: Vec<_> = (0..n)
            .map(|p| self.outgoing(layer, perm, &keep(p), &mut fill))
            .collect();
        let offsets: Vec<_> = (0..n).map(|p| self.offsets(layer, &keep(p))).collect();
        let replies: Vec<_> = (0..n)
            .map(|p| self.reply_buffers(layer, &keep(p)))
            .collect();
        let mine = self.mine(layer, matches!(pass, Pass::Backward));
        self.inner.dev.acc.exchange_experts[pass_index(pass)] += mine.len() as u64;
        let rank = self.comm.rank();
        self.inner.dev.acc.token_exchanges += 2 * n as u64;
        let Self {
            inner, comm, plans, ..
        } = self;
        let plan = &plans[layer];
        let d = inner.model.d_model;
        let (backs, waited_s) = std::thread::scope(|s| {
            let (to_wire, jobs) = bounded::<Vec<Vec<f32>>>(2 * n);
            let (done, from_wire) = bounded(2 * n);
            std::thread::Builder::new()
                .name("strata-exchange-wire".into())
                .spawn_scoped(s, move || run_wire(comm, jobs, done))
                .map_err(|e| EngineError::Config(format!("the exchange's wire thread: {e}")))?;
            for p_sends in sends {
                let _ = to_wire.send(p_sends); // room for every job; a stopped wire says why
            }
            let mut wire = Wire {
                plan,
                d,
                rank,
                offsets,
                replies,
                to_wire,
                from_wire,
                held: None,
                received: Vec::new(),
                outputs: Vec::new(),
                waited_s: 0.0,
            };
            inner.pipeline(pass, layer, &mine, |runner, expert, params| {
                wire.enter(parts.of[expert], &mut runner.dev.scratch)?;
                let rows = concat(
                    plan,
                    d,
                    expert,
                    &wire.received,
                    &wire.offsets[parts.of[expert]],
                );
                let result = compute(runner, expert, params, rows)?;
                wire.outputs.push((expert, result));
                Ok(())
            })?;
            wire.enter(n, &mut inner.dev.scratch)?;
            let backs = (0..n)
                .map(|_| wire.arrived())
                .collect::<Result<Vec<_>, _>>()?;
            Ok::<_, EngineError>((backs, wire.waited_s))
        })?;
        self.inner.dev.acc.exchange_wait_s += waited_s;
        for (p, back) in backs.iter().enumerate() {
            self.scatter_back(layer, perm, &keep(p), back, out);
        }
        Ok(())
    }
}

/// [expert] its part when each device's `lists` (its experts in compute
/// order) are cut into `count` shares in order (`usize::MAX`: no rows).
fn parts_of(lists: &[Vec<usize>], count: usize, experts: usize) -> Vec<usize> {
    let mut of = vec![usize::MAX; experts];
    for list in lists {
        for (i, &e) in list.iter().enumerate() {
            of[e] = i * count / list.len();
        }
    }
    of
}

/// The wire thread: each queued all-to-all in turn, its result sent back,
/// until the jobs end or one fails.
fn run_wire<C: Comm>(
    comm: &mut C,
    jobs: Receiver<Vec<Vec<f32>>>,
    done: Sender<Result<Vec<Vec<f32>>, CommError>>,
) {
    for sends in jobs {
        let result = comm.all_to_all(sends);
        let failed = result.is_err();
        if done.send(result).is_err() || failed {
            break;
        }
    }
}

/// The compute thread's side of a layer's parts.
struct Wire<'a> {
    plan: &'a LayerPlan,
    d: usize,
    rank: usize,
    /// [part][source device][expert] where the expert's rows start.
    offsets: Vec<Vec<Vec<usize>>>,
    /// [part][device] the rows going back to it.
    replies: Vec<Vec<Vec<f32>>>,
    to_wire: Sender<Vec<Vec<f32>>>,
    from_wire: Receiver<Result<Vec<Vec<f32>>, CommError>>,
    /// The part whose rows are in `received`.
    held: Option<usize>,
    received: Vec<Vec<f32>>,
    /// The held part's results so far, by expert.
    outputs: Vec<(usize, ScratchBuf)>,
    /// Seconds the compute thread has waited for the wire thread.
    waited_s: f64,
}

impl Wire<'_> {
    /// Moves on to part `p` (`count`: past the last): each part before it
    /// is finished (its results queued to go back) and the next one's rows
    /// taken from the wire, in order, parts without an expert here too.
    fn enter(&mut self, p: usize, scratch: &mut ScratchBuffers) -> Result<(), EngineError> {
        while self.held != Some(p) {
            if let Some(h) = self.held {
                for (expert, rows) in self.outputs.drain(..) {
                    split_into(
                        self.plan,
                        self.d,
                        expert,
                        &rows,
                        &mut self.replies[h],
                        &self.offsets[h],
                    );
                    scratch.give(rows);
                }
                let _ = self.to_wire.send(std::mem::take(&mut self.replies[h]));
            }
            let next = self.held.map_or(0, |h| h + 1);
            if next == self.offsets.len() {
                self.held = Some(next);
                self.received = Vec::new();
                break;
            }
            self.received = self.arrived()?;
            self.held = Some(next);
        }
        Ok(())
    }

    /// The next collective's result, or why the wire stopped; the wait
    /// for it counted.
    fn arrived(&mut self) -> Result<Vec<Vec<f32>>, EngineError> {
        let t0 = std::time::Instant::now();
        let result = self.from_wire.recv().map_err(|_| EngineError::Device {
            device: self.rank,
            why: "the exchange's wire thread stopped".into(),
        });
        self.waited_s += t0.elapsed().as_secs_f64();
        Ok(result??)
    }
}
