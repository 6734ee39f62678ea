//! Ranks as processes ([`EngineConfig::ranks`](super::EngineConfig::ranks)):
//! this engine is one rank of N, one process each (started by `mpirun`,
//! with `comm::MpiComm`, feature `mpi`), with one device worker.
//!
//! A step runs as one device of `devices = N` in one process does
//! (`multi.rs`): the same share of the batch, the same exchange, the same
//! all-reduces in rank order. What differs is who owns an expert. LPT moves
//! an expert from device to device as the load shifts, which ranks with
//! tiers of their own could follow only by moving its record; so here
//! expert e of every layer lives on rank e mod N and is computed there at
//! every step. Its record, its gradient, its moments and its update never
//! leave that rank: only tokens, the dense gradient and the loss cross.
//! No record is held by two ranks, so ranks on one machine never hold one
//! record twice in host memory.
//!
//! Placement changes no bit (an expert's rows arrive in rank order
//! whichever device computes them), so N ranks train exactly what N
//! in-process devices train under LPT; `tests/mpi_ranks.rs` compares them
//! over 20 steps.

use std::sync::Arc;

use super::condensing::StepCondense;
use super::dense_buckets::ReducerThread;
use super::exchange::ExchangeRunner;
use super::multi::{device_share, split_into, Share};
use super::pipeline::DeviceRunner;
use super::step::step_condense;
use super::Engine;
use crate::comm::{Comm, Link, ModeledLink};
use crate::model::{DenseKernels, Network};
use crate::EngineError;
use strata_tiers::ExpertId;

/// This rank's endpoint and who owns which expert.
pub(super) struct Ranks {
    pub comm: Box<dyn Comm>,
    /// A second endpoint, over which the dense gradient is reduced beside
    /// the backward, where the communicator gives one.
    pub second: Option<Box<dyn Comm>>,
    /// [layer][expert] the rank that owns the expert.
    pub owners: Vec<Vec<u16>>,
    /// The thread the dense gradient's buckets are reduced on.
    pub reducer: Arc<ReducerThread>,
}

/// The rank of `ranks` that owns `expert` (and holds its record up to
/// date): its index mod `ranks`, in every layer.
pub fn rank_of_expert(expert: ExpertId, ranks: usize) -> usize {
    expert.index as usize % ranks
}

/// Expert e of every layer on rank e mod `ranks`: each rank gets every
/// layer's share, within one expert of the others'.
pub fn round_robin_owners(layers: usize, experts: usize, ranks: usize) -> Vec<Vec<u16>> {
    let layer: Vec<u16> = (0..experts)
        .map(|e| rank_of_expert(ExpertId::new(0, e as u32), ranks) as u16)
        .collect();
    vec![layer; layers]
}

impl Engine {
    /// Joins the other ranks of `comm`'s world: from now on each step is
    /// this rank's share of it. `comm` must have [`EngineConfig::ranks`]
    /// ranks, and every rank must run the same model from the same step
    /// (checked: a rank that differs is named). Join before the first
    /// step, or after [`Engine::resume`] from this rank's own checkpoint.
    ///
    /// [`EngineConfig::ranks`]: super::EngineConfig::ranks
    pub fn join_ranks(&mut self, mut comm: Box<dyn Comm>) -> Result<(), EngineError> {
        let n = self.config.ranks;
        if self.ranks.is_some() {
            return Err(EngineError::Config(
                "this engine has joined its ranks already".into(),
            ));
        }
        if comm.size() != n {
            return Err(EngineError::Config(format!(
                "the communicator has {} ranks, and EngineConfig::ranks says {n}: start as many \
                 processes as the config names (mpirun -n {n})",
                comm.size()
            )));
        }
        let m = &self.model;
        let mine: Vec<u32> = [
            m.layers,
            m.experts,
            m.d_model,
            m.d_ff,
            m.top_k,
            self.config.micro_batches,
            self.dense.len(),
        ]
        .iter()
        .map(|&v| v as u32)
        .chain([self.step as u32, (self.step >> 32) as u32])
        .collect();
        let all = comm.all_gather_u32(mine.clone())?;
        if let Some(rank) = all.iter().position(|theirs| *theirs != mine) {
            return Err(EngineError::Config(format!(
                "rank {rank} runs another model, micro-batch count or step than rank {} \
                 ((layers, experts, d_model, d_ff, top_k, micro_batches, dense params, step) \
                 {:?} against {:?}): start every rank from the same model and checkpoint step",
                comm.rank(),
                &all[rank],
                mine
            )));
        }
        let owners = round_robin_owners(m.layers, m.experts, n);
        let second = comm.second_endpoint()?;
        self.ranks = Some(Ranks {
            comm,
            second,
            owners,
            reducer: Arc::new(ReducerThread::new("strata-dense-reduce".into())),
        });
        Ok(())
    }

    /// (this rank, ranks) once [`Engine::join_ranks`] has run.
    pub fn rank(&self) -> Option<(usize, usize)> {
        self.ranks.as_ref().map(|r| (r.comm.rank(), r.comm.size()))
    }

    /// Whether this process holds `expert` of `layer` up to date: always,
    /// but on ranks as processes, where only its owner does.
    pub fn owns_expert(&self, layer: usize, expert: usize) -> bool {
        match &self.ranks {
            Some(r) => {
                r.owners.get(layer).and_then(|l| l.get(expert)).copied()
                    == Some(r.comm.rank() as u16)
            }
            None => true,
        }
    }

    /// An error naming the rank that holds `expert` of `layer`, where
    /// another does.
    pub(super) fn held_here(&self, layer: usize, expert: usize) -> Result<(), EngineError> {
        match &self.ranks {
            Some(r) if !self.owns_expert(layer, expert) => {
                let owner = r.owners.get(layer).and_then(|l| l.get(expert));
                Err(EngineError::Config(match owner {
                    Some(o) => format!(
                        "expert {expert} of layer {layer} lives on rank {o}, not on rank {}: \
                         ask that rank",
                        r.comm.rank()
                    ),
                    None => format!("there is no expert {expert} of layer {layer}"),
                }))
            }
            _ => Ok(()),
        }
    }

    /// An error for what needs the whole world's experts, on a rank.
    pub(super) fn whole_world(&self, what: &str) -> Result<(), EngineError> {
        match self.rank() {
            Some((rank, n)) if n > 1 => Err(EngineError::Config(format!(
                "{what} needs every expert, and rank {rank} of {n} holds only its own: \
                 not supported on ranks as processes yet"
            ))),
            _ => Ok(()),
        }
    }

    /// Whether this rank or any other says `mine`: for what every rank
    /// must do at the same step, as stopping after a signal. Without ranks,
    /// `mine`.
    pub fn any_rank(&mut self, mine: bool) -> Result<bool, EngineError> {
        let Some(ranks) = self.ranks.as_mut() else {
            return Ok(mine);
        };
        let mut said = [f32::from(u8::from(mine))];
        ranks.comm.all_reduce_sum(&mut said)?;
        Ok(said[0] > 0.0)
    }

    /// [`Engine::evaluate`] on a rank: its part of the batch (one of N,
    /// split as a step splits it) through the exchange, and the mean over
    /// every rank's counted tokens. The sums run in another order than one
    /// device's, so the mean may differ from it in the last bits.
    pub(super) fn evaluate_rank<N: Network>(
        &mut self,
        net: &N,
        batch: &N::Batch,
    ) -> Result<f32, EngineError> {
        let (rank, n) = self.rank().expect("a rank's pass runs after join_ranks");
        let parts = split_into(net, batch, n, 1, "ranks")?;
        self.reset_counters();
        let unpinned = vec![vec![None; self.model.experts]; self.model.layers];
        self.with_rank_runner(&unpinned, None, |runner, dense, kernels, _| {
            let loss = net.forward_loss(dense, &parts[rank], runner, kernels)?;
            let counted = net.batch_tokens(&parts[rank]);
            // A part with no counted token adds nothing (its mean is 0/0).
            let sum = match counted {
                0 => 0.0,
                c => loss * c as f32,
            };
            let mut sums = [sum, counted as f32];
            runner.comm.all_reduce_sum(&mut sums)?;
            Ok(sums[0] / sums[1])
        })
    }

    /// This rank's micro-batches; returns the step's loss and dense
    /// gradient, all-reduced over the ranks.
    pub(super) fn passes_rank<N>(
        &mut self,
        net: &N,
        batch: &N::Batch,
        tokens_total: usize,
    ) -> Result<(f32, Vec<f32>), EngineError>
    where
        N: Network,
    {
        let m = self.config.micro_batches;
        let (rank, n) = self.rank().expect("a rank's pass runs after join_ranks");
        let parts = split_into(net, batch, n, m, "ranks")?;
        let pinned = self.pin_plan();
        let link = self.config.link;
        let bucket_bytes = self.config.dense_bucket_bytes;
        let mut second = self.ranks.as_mut().and_then(|r| r.second.take());
        let reducer = self.ranks.as_ref().map(|r| Arc::clone(&r.reducer));
        let reducer = reducer.expect("a rank's pass runs after join_ranks");
        let result = self.with_rank_runner(&pinned, link, |runner, dense, kernels, condense| {
            let share = Share {
                net,
                parts: &parts[rank * m..(rank + 1) * m],
                dense,
                tokens_total,
                shares: n * m,
                bucket_bytes,
                reducer: &reducer,
                condense,
            };
            device_share(runner, kernels, share, &mut second)
        });
        if let Some(r) = self.ranks.as_mut() {
            r.second = second;
        }
        result
    }

    /// Runs `f` with this rank's exchange runner (its device, its endpoint
    /// over `link`, the fixed owners, `pinned`), the dense params, the
    /// device's dense kernels and the step's condensation.
    fn with_rank_runner<T>(
        &mut self,
        pinned: &[Vec<Option<u16>>],
        link: Option<Link>,
        f: impl FnOnce(
            &mut ExchangeRunner<'_, ModeledLink<&mut dyn Comm>>,
            &[f32],
            &dyn DenseKernels,
            Option<StepCondense<'_>>,
        ) -> T,
    ) -> T {
        let options = self.pass_options();
        let cost = self.cost;
        let tuning = self.exchange_tuning();
        let condense = step_condense(&self.config, self.signatures.as_ref(), self.condense_losses);
        let Engine {
            model,
            shared,
            devices,
            dense_kernels,
            dense,
            ranks,
            ..
        } = self;
        let ranks = ranks.as_mut().expect("joined");
        let inner = DeviceRunner::new(model, shared, &mut devices[0], options);
        let comm = ModeledLink::new(&mut *ranks.comm as &mut dyn Comm, link);
        let mut runner =
            ExchangeRunner::new(inner, comm, cost, pinned, Some(&ranks.owners)).tuned(tuning);
        f(&mut runner, dense, &*dense_kernels[0], condense)
    }
}
