//! The engine: a MoE stack trained expert by expert through the three
//! tiers (docs/design.md; ES-MoE §4.1).
//!
//! ```
//! use strata::engine::{Engine, EngineConfig};
//! use strata::model::{Batch, ModelConfig};
//!
//! let model = ModelConfig { layers: 2, d_model: 16, d_ff: 32, experts: 4, top_k: 2,
//!                           classes: 8, ..ModelConfig::default() };
//! let mut engine = Engine::new(model.clone(), EngineConfig::default()).unwrap();
//! let batch = Batch {
//!     inputs: (0..32 * 16).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect(),
//!     targets: (0..32).map(|i| (i % 8) as u32).collect(),
//! };
//! let first = engine.step(&batch).unwrap();
//! for _ in 0..20 {
//!     engine.step(&batch).unwrap();
//! }
//! let last = engine.step(&batch).unwrap();
//! assert!(last.loss < first.loss);
//! println!("{}", last.to_json()); // wall time, stalls, bytes per tier pair, hit rates
//! ```

mod access;
mod available_memory;
mod build;
mod condensing;
mod config;
mod dense_buckets;
mod dense_state;
mod dense_update;
mod device_rows;
mod device_threads;
mod exchange;
mod grad_buffers;
mod gradients;
mod host_groups;
mod host_plan;
mod metrics;
mod multi;
mod open;
mod part_search;
mod pipeline;
mod pipelining;
mod rank_checkpoint;
mod ranks;
mod routed_io;
mod routing_trace;
mod slot_table;
mod update;
mod updates;
mod verify;

use std::sync::Arc;

use strata_optim::AdamWHyper;
use strata_tiers::{ExpertId, ExpertStore, Parts};

pub use available_memory::{
    available_host_memory, host_memory_available, AvailableMemory, MemoryBound,
};
pub use build::{host_cell_slot_count, host_kept_count};
pub use config::{EngineConfig, ExchangeParts, ExpertCompute, ScheduleKind, MIN_HOST_STREAM_SLOTS};
pub use exchange::{project_exchange, LinkFit, UniformLayer};
pub use gradients::Gradients;
pub use host_plan::{cpu_expert_group_bound, gradient_buffers, HostMemoryPlan};
pub use metrics::StepMetrics;
pub use ranks::rank_of_expert;
pub use routing_trace::RoutingTrace;
pub use slot_table::scratch_buffers_kept;
pub use verify::{verify_checkpoint, CheckpointReport};

use crate::model::{Batch, DenseKernels, Evaluation, ModelConfig, Network};
use crate::placement::CostModel;
use crate::EngineError;
use access::Phase;
use build::step_schedule;
use condensing::{condensed_pass, StepCondense};
use pipeline::{DeviceRunner, PassOptions};
use slot_table::{Accumulators, DeviceState};
use updates::{ClipInput, Held, SharedExperts};

/// A MoE stack whose experts live in the three tiers.
pub struct Engine {
    model: ModelConfig,
    config: EngineConfig,
    /// One per device worker (`config.devices`). Declared (so dropped)
    /// before `shared`: a GPU device page-locks the host tier's region,
    /// which must be unregistered before the host tier frees it.
    devices: Vec<DeviceState>,
    /// Per device: the dense layers' GEMMs (the cpu's, or its GPU's).
    dense_kernels: Vec<Arc<dyn DenseKernels + Send + Sync>>,
    shared: SharedExperts,
    /// Why the tiers run below their best (no io_uring or O_DIRECT, host
    /// memory not page-locked for a GPU).
    notes: Vec<String>,
    dense: Vec<f32>,
    /// The trainable dense params' moments, in order.
    dense_m: Vec<f32>,
    dense_v: Vec<f32>,
    /// The network's frozen dense ranges (`Network::frozen_dense`).
    frozen: Vec<std::ops::Range<usize>>,
    /// Where `EngineConfig::condense` searches by signatures: its planes.
    signatures: Option<crate::condense::SignatureTables>,
    /// The first and the last step's losses, which an adaptive condensation
    /// threshold follows ([`Engine::set_condense_losses`]).
    condense_losses: (Option<f32>, Option<f32>),
    /// Where `EngineConfig::trace_routing`: every step's transitions.
    routing_trace: Option<RoutingTrace>,
    dense_step: u64,
    /// A GPU stepped the dense params it holds since the host's copy of
    /// them and their moments was last brought up to date (`sync_dense`).
    dense_newer_on_device: bool,
    /// Several devices: the placement's cost model, recalibrated from each
    /// step's measured expert compute.
    cost: CostModel,
    /// Several devices or ranks: the link's fitted cost, once measured
    /// ([`Engine::calibrate_exchange`]).
    link_fit: Option<LinkFit>,
    /// Several devices: the exchange's own work per expert, [forward,
    /// backward], from each step's measure (`exchange::local_cost`).
    exchange_local: [f64; 2],
    /// `ExchangeParts::Auto`: each layer's search for its part count.
    part_search: Option<part_search::PartSearch>,
    /// [layer][expert] the previous step's global load (pinning's input).
    prev_load: Option<Vec<Vec<u32>>>,
    /// Several devices: the thread each computes its share on.
    device_threads: device_threads::DeviceThreads,
    /// Several devices: the thread each reduces its dense gradient's
    /// buckets on.
    dense_reducers: Vec<dense_buckets::ReducerThread>,
    /// Ranks as processes: this rank's endpoint and the experts it owns,
    /// from [`Engine::join_ranks`].
    ranks: Option<ranks::Ranks>,
    step: u64,
}

impl Engine {
    pub fn model(&self) -> &ModelConfig {
        &self.model
    }

    /// The configuration this engine was built with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Steps completed.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Device slots (experts that fit on one device at once).
    pub fn device_slots(&self) -> usize {
        self.devices[0].slots.slot_count()
    }

    /// How many experts a pass stages and computes at once
    /// ([`EngineConfig::expert_group`]; 1 with several devices or ranks).
    pub fn expert_group(&self) -> usize {
        self.devices[0].group
    }

    /// Device workers.
    pub fn devices(&self) -> usize {
        self.devices.len()
    }

    /// Why the tiers run below their best, if they do: the store's I/O
    /// fell back from io_uring or O_DIRECT, or a GPU could not page-lock
    /// the host tier's memory (its uploads are then staged by the driver).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Host slots (expert records that fit in host memory at once, less
    /// those split into compute cells).
    pub fn host_slots(&self) -> usize {
        self.shared.cache.slot_count()
    }

    /// Host compute cells, each one record's compute part
    /// (`EngineConfig::host_cell_slots`).
    pub fn host_cells(&self) -> usize {
        self.shared.cache.cell_count()
    }

    /// Of the host slots, those keeping a record resident for the whole
    /// run (`EngineConfig::host_stream_slots`); the rest stream.
    pub fn host_kept(&self) -> usize {
        self.shared.cache.kept_count()
    }

    /// Experts whose updates wait for the next step's forward (see
    /// [`EngineConfig::defer_last_layer_updates`]).
    pub fn deferred_updates(&self) -> usize {
        self.shared.deferred_count()
    }

    /// One training step on `batch` (split into the configured micro-batches).
    pub fn step(&mut self, batch: &Batch) -> Result<StepMetrics, EngineError> {
        let model = self.model.clone();
        self.step_network(&model, batch)
    }

    /// The learning rate of the updates from the next step on (schedules).
    /// Updates of earlier steps still held (deferred to the next forward)
    /// keep the rate of the step that computed their gradients.
    pub fn set_lr(&mut self, lr: f32) -> Result<(), EngineError> {
        let hyper = AdamWHyper {
            lr,
            ..self.config.hyper
        };
        self.shared.optimizer.set_hyper(hyper)?;
        self.config.hyper = hyper;
        Ok(())
    }

    fn check_network<N: Network>(&self, net: &N) -> Result<(), EngineError> {
        if net.moe() != &self.model || net.dense_params() != self.dense.len() {
            return Err(EngineError::Config(
                "the network is not the one this engine was built for".into(),
            ));
        }
        if net.frozen_dense() != self.frozen {
            return Err(EngineError::Config(
                "the network freezes other dense tensors than the one this engine was built for"
                    .into(),
            ));
        }
        Ok(())
    }

    fn pass_options(&self) -> PassOptions {
        PassOptions {
            recompute_hidden: self.config.recompute_hidden,
        }
    }

    /// What every device's dense kernels have copied besides experts.
    fn pcie_other_bytes(&self) -> u64 {
        self.dense_kernels
            .iter()
            .map(|k| k.pcie_other_bytes())
            .sum()
    }

    fn reset_counters(&mut self) {
        let (layers, experts) = (self.model.layers, self.model.experts);
        for dev in &mut self.devices {
            dev.acc = Accumulators::new(layers, experts);
            // What evaluations routed is not the training's.
            if let Some(counter) = dev.routing.as_mut() {
                counter.clear();
            }
        }
    }

    /// The first step's loss and the last one's, which an adaptive
    /// condensation threshold ([`crate::condense::Threshold::Adaptive`])
    /// follows. The engine keeps them from its own steps; a resumed run
    /// hands them back from its metrics, so that it continues with the
    /// thresholds of a run that never stopped.
    pub fn set_condense_losses(&mut self, first: Option<f32>, last: Option<f32>) {
        self.condense_losses = (first, last);
    }

    /// See [`Engine::set_condense_losses`].
    pub fn condense_losses(&self) -> (Option<f32>, Option<f32>) {
        self.condense_losses
    }

    /// The routing trace of every step since the engine opened (or since
    /// `set_routing_trace`), where `EngineConfig::trace_routing` is on.
    pub fn routing_trace(&self) -> Option<&RoutingTrace> {
        self.routing_trace.as_ref()
    }

    /// [`Engine::routing_trace`] of every rank's tokens: on ranks as
    /// processes each rank traces its own, and this sums them (a
    /// collective: every rank calls it at the same point); elsewhere, the
    /// engine's own.
    pub fn routing_trace_of_ranks(&mut self) -> Result<Option<RoutingTrace>, EngineError> {
        let Some(mine) = self.routing_trace.clone() else {
            return Ok(None);
        };
        match self.ranks.as_mut() {
            Some(r) => Ok(Some(routing_trace::sum_over_ranks(&mut *r.comm, mine)?)),
            None => Ok(Some(mine)),
        }
    }

    /// Continues from `trace` (a resumed run's earlier steps); it must be
    /// of this engine's shape, and tracing on. On ranks, give rank 0 the
    /// whole trace and the others an empty one of as many steps
    /// ([`RoutingTrace::empty_at`]): their sum is the whole.
    pub fn set_routing_trace(&mut self, trace: RoutingTrace) -> Result<(), EngineError> {
        let m = &self.model;
        if self.routing_trace.is_none()
            || (trace.layers, trace.experts, trace.top_k) != (m.layers, m.experts, m.top_k)
            || trace.transitions.len() != m.layers - 1
            || trace
                .transitions
                .iter()
                .any(|t| t.len() != m.experts * m.experts)
        {
            return Err(EngineError::Config(format!(
                "a routing trace of {} layers × {} experts, top-{} does not continue this \
                 engine's ({} × {}, top-{}, tracing {})",
                trace.layers,
                trace.experts,
                trace.top_k,
                m.layers,
                m.experts,
                m.top_k,
                if self.routing_trace.is_some() {
                    "on"
                } else {
                    "off"
                }
            )));
        }
        self.routing_trace = Some(trace);
        Ok(())
    }

    /// The mean loss of `batch`, forward only: nothing is updated. It runs
    /// on the first device, or on ranks as processes each rank's part of
    /// the batch. The prefetch schedule restarts at the next step's
    /// forward.
    pub fn evaluate<N: Network>(&mut self, net: &N, batch: &N::Batch) -> Result<f32, EngineError> {
        if self.ranks.is_some() {
            self.check_network(net)?;
            net.validate_batch(batch)?;
            return self.evaluate_rank(net, batch);
        }
        self.forward_pass(
            net,
            batch,
            "Engine::evaluate",
            |net, dense, runner, kernels| net.forward_loss(dense, batch, runner, kernels),
        )
    }

    /// The forward pass of `batch` alone: every token's logits (and its
    /// target, and their mean cross-entropy); nothing is updated. For a
    /// language model, token i of sequence s is row `s · seq_len + i`, its
    /// logits predicting token i + 1.
    ///
    /// ```
    /// use strata::engine::{Engine, EngineConfig};
    /// use strata::lm::{LmConfig, MoeLm, TokenBatch};
    ///
    /// let lm = MoeLm::new(LmConfig::preset("tiny").unwrap()).unwrap();
    /// let mut engine = Engine::new_network(&lm, EngineConfig::default()).unwrap();
    /// let batch = TokenBatch { seq_len: 4, tokens: vec![1, 2, 3, 4, 5], loss_mask: None, doc_starts: None };
    /// let out = engine.forward(&lm, &batch).unwrap();
    /// assert_eq!((out.tokens(), out.width), (4, lm.config().vocab));
    /// let log_probs = out.target_log_probs();
    /// let mean = -log_probs.iter().map(|&l| l as f64).sum::<f64>() / 4.0;
    /// assert!((mean as f32 - out.loss).abs() < 1e-4);
    /// ```
    pub fn forward<N: Network>(
        &mut self,
        net: &N,
        batch: &N::Batch,
    ) -> Result<Evaluation, EngineError> {
        let what = "Engine::forward (every token's logits)";
        self.forward_pass(net, batch, what, |net, dense, runner, kernels| {
            net.forward_eval(dense, batch, runner, kernels)
        })
    }

    /// `pass` (a forward of `batch` alone) on the first device, `what`
    /// naming it where ranks as processes cannot run it.
    fn forward_pass<N: Network, R>(
        &mut self,
        net: &N,
        batch: &N::Batch,
        what: &str,
        pass: impl FnOnce(
            &N,
            &[f32],
            &mut DeviceRunner<'_>,
            &dyn DenseKernels,
        ) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        self.check_network(net)?;
        net.validate_batch(batch)?;
        self.whole_world(what)?;
        self.reset_counters();
        let options = self.pass_options();
        let mut runner =
            DeviceRunner::new(&self.model, &self.shared, &mut self.devices[0], options);
        let out = pass(net, &self.dense, &mut runner, &*self.dense_kernels[0]);
        // The next step starts from its forward again.
        let order = match self.devices.len() {
            1 => {
                let overlapped = self.config.schedule.overlaps(self.device_slots());
                let from = Phase::Forward(0);
                let device = &self.devices[0];
                let (slots, staging) = (&device.slots, (overlapped, device.group));
                device
                    .io
                    .schedule(&self.model, &self.shared, staging, from, slots)
            }
            _ => step_schedule(
                &self.model,
                &self.config,
                self.device_slots(),
                &self.shared.cache,
            ),
        };
        self.shared.cache.set_schedule(order);
        out
    }

    /// One training step of any [`Network`] built on this engine's MoE
    /// layers (see [`Engine::new_network`]).
    pub fn step_network<N>(&mut self, net: &N, batch: &N::Batch) -> Result<StepMetrics, EngineError>
    where
        N: Network + Sync,
        N::Batch: Sync,
    {
        self.check_network(net)?;
        net.validate_batch(batch)?;
        let timeline = self.config.timeline.clone();
        let _span = strata_tiers::TimelineSpan::start(timeline.as_deref(), "step", "step")
            .with_detail(|| format!("step {}", self.step + 1));
        let start = std::time::Instant::now();
        self.shared.cache.take_stats(); // this step's counters start now
        self.shared.cache.store().take_busy();
        self.reset_counters();
        let pcie_before = self.pcie_other_bytes();
        let tokens_total = net.batch_tokens(batch);
        let keep_norm = self
            .residence()
            .map(|_| self.config.clip_grad_norm.is_some());
        let result = self.passes(net, batch, tokens_total, keep_norm);
        let (loss, mut dense_grad, held_norm_sq) = match result {
            Ok(r) => r,
            Err(e) => {
                self.shared.discard_partial();
                return Err(e);
            }
        };
        let ranks = self
            .ranks
            .as_mut()
            .map(|r| &mut *r.comm as &mut dyn crate::comm::Comm);
        let clip = self.config.clip_grad_norm.map(|max_norm| ClipInput {
            max_norm,
            // Frozen tensors have no gradient, as in torch.
            dense_norm_sq: held_norm_sq
                + trainable_runs(dense_grad.len(), &self.frozen)
                    .flat_map(|r| &dense_grad[r])
                    .map(|&g| g as f64 * g as f64)
                    .sum::<f64>(),
            ranks,
        });
        let (finish_stall, clipped) = self.shared.finish_step(clip)?;
        let scale = clipped.map_or(1.0, |c| c.scale.min(1.0));
        if scale < 1.0 {
            dense_grad.iter_mut().for_each(|g| *g *= scale);
        }
        self.devices[0].acc.stall_optimizer_s += finish_stall;
        self.step_dense(&dense_grad, scale)?;
        self.step += 1;
        let stats = self.shared.cache.take_stats();
        let ssd_busy_s = self.shared.cache.store().take_busy().as_secs_f64();
        let mut metrics = metrics::gather(
            self.step,
            net.processed_tokens(batch),
            loss,
            start.elapsed().as_secs_f64(),
            &stats,
            ssd_busy_s,
            self.devices.iter().map(|d| &d.acc),
        );
        metrics.grad_norm = clipped.map(|c| c.norm);
        metrics.condense_threshold =
            step_condense(&self.config, None, self.condense_losses).map(|c| c.threshold);
        if loss.is_finite() {
            self.condense_losses = (self.condense_losses.0.or(Some(loss)), Some(loss));
        }
        metrics.bytes_pcie_other = self.pcie_other_bytes() - pcie_before;
        metrics.bytes_ssd_min = routed_io::min_ssd_bytes(
            &self.shared.cache,
            &self.shared.layout,
            &self.model,
            self.shared.train,
            &metrics.tokens_per_expert,
        );
        if self.devices.len() > 1 {
            // LPT's cost model; ranks' experts stay with their owners.
            self.recalibrate(&metrics);
        }
        self.share_cost_over_ranks(&metrics)?;
        self.advance_part_search(&metrics)?;
        self.prev_load = Some(metrics.tokens_per_expert.clone());
        if let Some(trace) = self.routing_trace.as_mut() {
            for dev in &mut self.devices {
                if let Some(counter) = dev.routing.as_mut() {
                    counter.drain_into(trace);
                }
            }
            trace.steps += 1;
        }
        Ok(metrics)
    }

    /// The step's passes on this engine's devices, or its rank's share;
    /// returns the loss, the dense gradient and (one device) what
    /// [`Engine::end_dense_grad`] returns.
    fn passes<N>(
        &mut self,
        net: &N,
        batch: &N::Batch,
        tokens_total: usize,
        keep_norm: Option<bool>,
    ) -> Result<(f32, Vec<f32>, f64), EngineError>
    where
        N: Network + Sync,
        N::Batch: Sync,
    {
        let passes = if self.ranks.is_some() {
            self.passes_rank(net, batch, tokens_total)
        } else if self.config.ranks > 1 {
            return Err(EngineError::Config(format!(
                "EngineConfig::ranks is {}, and this rank has not joined the others: call \
                 Engine::join_ranks with its communicator before the first step",
                self.config.ranks
            )));
        } else if self.devices.len() == 1 {
            return self.passes_one_device(net, batch, tokens_total, keep_norm);
        } else {
            self.passes_devices(net, batch, tokens_total)
        };
        passes.map(|(loss, grad)| (loss, grad, 0.0))
    }

    /// Every micro-batch on the only device; returns the loss and the dense
    /// gradient.
    /// `keep_norm`: see [`Engine::end_dense_grad`]; the third value is
    /// what that returns.
    fn passes_one_device<N: Network>(
        &mut self,
        net: &N,
        batch: &N::Batch,
        tokens_total: usize,
        keep_norm: Option<bool>,
    ) -> Result<(f32, Vec<f32>, f64), EngineError> {
        let parts = net.split_batch(batch, self.config.micro_batches);
        let count = parts.len();
        let mut dense_grad = vec![0.0f32; self.dense.len()];
        let kernels = Arc::clone(&self.dense_kernels[0]);
        kernels.grads_begin(&dense_grad);
        let mut loss = 0.0f32;
        let options = self.pass_options();
        let condense = step_condense(&self.config, self.signatures.as_ref(), self.condense_losses);
        let mut runner =
            DeviceRunner::new(&self.model, &self.shared, &mut self.devices[0], options);
        let mut condensed = 0;
        for (i, part) in parts.iter().enumerate() {
            let (losses, n) = condensed_pass(&mut runner, condense, &self.model, |runner| {
                net.forward_backward(
                    &self.dense,
                    &mut dense_grad,
                    part,
                    tokens_total,
                    count,
                    i + 1 == count,
                    runner,
                    &*kernels,
                )
            })?;
            loss += losses.total;
            condensed += n;
        }
        self.devices[0].acc.condensed += condensed;
        let held_norm_sq = self.end_dense_grad(&*kernels, &mut dense_grad, keep_norm)?;
        Ok((loss, dense_grad, held_norm_sq))
    }

    /// Waits for every update in flight.
    pub fn drain(&mut self) -> Result<(), EngineError> {
        self.shared.release_held(Held::All)?;
        self.shared.drain()?;
        Ok(())
    }

    /// An expert's f32 master params (after every update in flight).
    pub fn expert_params(&mut self, layer: usize, expert: usize) -> Result<Vec<f32>, EngineError> {
        self.held_here(layer, expert)?;
        self.drain()?;
        let guard = self
            .shared
            .cache
            .acquire(ExpertId::new(layer as u32, expert as u32), Parts::Full)?;
        Ok(guard.state().expect("a full guard has state").0.to_vec())
    }

    /// An expert's AdamW step count.
    pub fn expert_step(&mut self, layer: usize, expert: usize) -> Result<u64, EngineError> {
        self.held_here(layer, expert)?;
        self.drain()?;
        let id = ExpertId::new(layer as u32, expert as u32);
        Ok(self.shared.version(id.dense_index(self.model.experts)))
    }

    /// The dense params, laid out as the network's `dense_params` (for
    /// the language model, tensor by tensor as
    /// [`MoeLm::tensors`](crate::lm::MoeLm::tensors) names them). Where a
    /// GPU steps them ([`EngineConfig::dense_on_device`]) they are copied
    /// down first.
    pub fn dense_params(&mut self) -> Result<&[f32], EngineError> {
        self.sync_dense()?;
        Ok(&self.dense)
    }

    /// [`Engine::dense_params`] and [`Engine::store`] together (an export
    /// reads both).
    pub fn dense_params_and_store(&mut self) -> Result<(&[f32], &ExpertStore), EngineError> {
        self.sync_dense()?;
        Ok((&self.dense, self.shared.cache.store()))
    }

    /// The SSD tier. Its records are the experts' current state after
    /// `checkpoint` (the host tier may hold newer ones until then).
    pub fn store(&self) -> &ExpertStore {
        self.shared.cache.store()
    }

    /// Makes every expert's current state durable in the store as
    /// checkpoint `self.steps()`.
    pub fn checkpoint_experts(&mut self) -> Result<(), EngineError> {
        self.drain()?;
        self.shared.cache.checkpoint(self.step)?;
        self.every_rank_committed()
    }

    /// A full checkpoint at `self.steps()`: the dense state file first, then
    /// every expert, committed by the store. A crash at any point leaves
    /// the previous checkpoint resumable, and the previous checkpoint's
    /// dense file is kept until the next one commits. Needs a `store_path`.
    pub fn checkpoint(&mut self) -> Result<(), EngineError> {
        let Some(path) = self.config.store_path.clone() else {
            return Err(EngineError::Config(
                "checkpoint needs a store_path (the SSD tier is in memory)".into(),
            ));
        };
        self.drain()?;
        self.sync_dense()?;
        // Kept until the next commit: should this commit's superblock or
        // copy map be damaged later, the store opens the previous one,
        // and its dense state is still here.
        let previous = self.shared.cache.store().committed_step();
        dense_state::write(
            &path,
            &dense_state::DenseStateRef {
                step: self.step,
                dense_step: self.dense_step,
                params: &self.dense,
                m: &self.dense_m,
                v: &self.dense_v,
            },
        )?;
        self.shared.cache.checkpoint(self.step)?;
        dense_state::remove_others(&path, &[previous, self.step]);
        self.every_rank_committed()
    }
}

/// How many of `0..len` are outside `frozen` (ascending, disjoint).
fn trainable_len(len: usize, frozen: &[std::ops::Range<usize>]) -> usize {
    trainable_runs(len, frozen).map(|r| r.len()).sum()
}

/// The ranges of `0..len` outside `frozen` (ascending, disjoint), in order.
fn trainable_runs(
    len: usize,
    frozen: &[std::ops::Range<usize>],
) -> impl Iterator<Item = std::ops::Range<usize>> {
    let mut starts = vec![0];
    let mut ends = Vec::new();
    for f in frozen {
        ends.push(f.start);
        starts.push(f.end);
    }
    ends.push(len);
    starts
        .into_iter()
        .zip(ends)
        .filter(|(a, b)| a < b)
        .map(|(a, b)| a..b)
}

/// This step's condensation, where the engine condenses: its threshold
/// from the losses so far.
fn step_condense<'a>(
    config: &EngineConfig,
    signatures: Option<&'a crate::condense::SignatureTables>,
    (first, last): (Option<f32>, Option<f32>),
) -> Option<StepCondense<'a>> {
    config.condense.map(|c| StepCondense {
        threshold: c.threshold.at(first, last),
        max_share: c.max_share,
        signatures,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{fill_uniform, Batch};

    /// `tokens` tokens of uniform(±1) inputs drawn from `seed`.
    fn batch_of(model: &ModelConfig, tokens: usize, seed: u64) -> Batch {
        let mut inputs = vec![0.0f32; tokens * model.d_model];
        fill_uniform(&mut inputs, seed, 1, 1.0);
        let targets = (0..tokens as u32)
            .map(|i| i % model.classes as u32)
            .collect();
        Batch { inputs, targets }
    }

    #[test]
    fn a_step_leaves_its_layer_buffers_for_the_next() {
        let model = ModelConfig {
            layers: 3,
            ..ModelConfig::default()
        };
        let mut engine = Engine::new(model.clone(), EngineConfig::default()).unwrap();
        let batch = batch_of(&model, 40, 5);
        assert_eq!(engine.devices[0].buffers.kept(), 0);
        for _ in 0..2 {
            engine.step(&batch).unwrap();
            // Three per layer (its experts' outputs, its norm's input and
            // output, kept from its forward to its backward) and the
            // step's four besides (the stack's output, which the head
            // reads; the backward's (T·K, D) buffer of its experts' input
            // gradients; the residual gradient in and out), handed back
            // within the bound.
            assert_eq!(engine.devices[0].buffers.kept(), 3 * model.layers + 4);
        }
    }

    #[test]
    fn saved_activations_stay_within_a_quarter_over_a_pass_s_need() {
        let model = ModelConfig {
            layers: 2,
            ..ModelConfig::default()
        };
        let mut engine = Engine::new(model.clone(), EngineConfig::default()).unwrap();
        let held = |engine: &Engine| -> usize {
            let saved = engine.devices[0].saved.iter().flatten();
            saved.map(|s| s.a.capacity() + s.b.capacity()).sum()
        };
        engine.step(&batch_of(&model, 64, 64)).unwrap();
        let large = held(&engine);
        // Two vectors (n, d_ff) an expert, n summing to tokens × top_k.
        let need = |tokens: usize| 2 * tokens * model.top_k * model.d_ff * model.layers;
        assert!(large >= need(64), "{large} values held");
        for _ in 0..3 {
            engine.step(&batch_of(&model, 4, 4)).unwrap();
            let small = held(&engine);
            assert!(
                small <= need(4) * 5 / 4,
                "{small} values held for {}",
                need(4)
            );
        }
        // Tokens growing a little each step: each buffer grows to what its
        // pass needs, not to twice its capacity; then falling by a third:
        // one held over a quarter above its need is let go.
        for tokens in [40, 44, 48, 52, 36] {
            engine.step(&batch_of(&model, tokens, 4)).unwrap();
            let held = held(&engine);
            assert!(
                held <= need(tokens) * 5 / 4,
                "{held} values held for {}",
                need(tokens)
            );
        }
    }

    /// Experts whose updates take far longer than their backward (many
    /// params, a few rows each, one optimizer thread): the updates would
    /// pile up behind the backward but for the device's bound on those in
    /// flight. In every schedule the gradient buffers the engine makes stay
    /// within the host plan's count.
    #[test]
    fn expert_gradients_alive_stay_within_the_host_plan() {
        let model = ModelConfig {
            layers: 4,
            d_model: 32,
            d_ff: 1024,
            ..ModelConfig::default()
        };
        let base = EngineConfig {
            optimizer_threads: 1,
            ..EngineConfig::default()
        };
        let configs = [
            base.clone(),
            EngineConfig {
                expert_group: Some(1),
                ..base.clone()
            },
            EngineConfig {
                micro_batches: 2,
                ..base.clone()
            },
            EngineConfig {
                schedule: ScheduleKind::Naive,
                ..base.clone()
            },
            EngineConfig {
                devices: 2,
                ..base.clone()
            },
        ];
        // Records streaming through fewer host slots than a layer has
        // experts, on one device and on two.
        let record = Engine::layout(&model, &base).record_bytes();
        let streaming = EngineConfig {
            host_budget_bytes: 3 * record,
            ..base.clone()
        };
        let configs = configs.into_iter().chain([
            streaming.clone(),
            EngineConfig {
                devices: 2,
                ..streaming.clone()
            },
        ]);
        for config in configs {
            let planned = host_plan::gradient_buffers(&Engine::layout(&model, &config), &config);
            let mut engine = Engine::new(model.clone(), config.clone()).unwrap();
            for seed in 0..8 {
                engine.step(&batch_of(&model, 16, seed)).unwrap();
            }
            let made = engine.shared.grads.held_max();
            assert!(
                made <= planned,
                "{made} gradient buffers held, {planned} planned: {config:?}"
            );
        }
    }

    #[test]
    fn trainable_runs_are_the_complement_of_the_frozen_ranges() {
        let runs = |frozen: &[std::ops::Range<usize>]| {
            super::trainable_runs(10, frozen).collect::<Vec<_>>()
        };
        let one = |r: std::ops::Range<usize>| vec![r];
        assert_eq!(runs(&[]), one(0..10));
        assert_eq!(runs(&[2..4, 6..7]), [0..2, 4..6, 7..10]);
        assert_eq!(runs(&[0..3, 8..10]), one(3..8));
        assert!(runs(&one(0..10)).is_empty());
    }
}
