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
mod step;
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

use crate::model::{Batch, DenseKernels, ModelConfig, Network};
use crate::placement::CostModel;
use crate::EngineError;
use pipeline::PassOptions;
use slot_table::{Accumulators, DeviceState};
use updates::{Held, SharedExperts};

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

#[cfg(test)]
mod tests;
