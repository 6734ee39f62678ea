//! The engine: a MoE stack trained expert by expert through the three
//! tiers (DESIGN.md "The schedule and prefetch", ES-MoE §4.1).
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

mod dense_state;
mod metrics;
mod runner;
mod update;

use std::path::PathBuf;
use std::sync::Arc;

use strata_optim::{
    adamw_step, AdamWHyper, CopyOut, ExpertKey, ExpertOptimizer, GradRef, Kernel, OptimizerConfig,
    StepScalars,
};
use strata_tiers::io::{AlignedBuf, FileOptions, MemFile};
use strata_tiers::safetensors_io::encode_compute;
use strata_tiers::{
    record_mut, CpuDeviceArena, Dtype, EvictionPolicy, ExpertId, ExpertStore, HostCache,
    HostCacheConfig, Layout, Parts,
};

pub use metrics::StepMetrics;
use update::ExpertUpdate;

use crate::backend::CpuBackend;
use crate::math::ExpertSaved;
use crate::model::{Batch, ModelConfig, Network};
use crate::EngineError;

/// How experts move and when they are updated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScheduleKind {
    /// Prefetch along the schedule, upload the next expert while this one
    /// computes, update each expert as soon as its backward ends.
    #[default]
    ExpertWise,
    /// ZeRO-Offload at expert granularity: no prefetch, synchronous
    /// uploads, every update after the whole backward pass.
    Naive,
}

/// Budgets, store and schedule.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The store file; `None` keeps the SSD tier in memory.
    pub store_path: Option<PathBuf>,
    pub device_budget_bytes: u64,
    pub host_budget_bytes: u64,
    pub optimizer_threads: usize,
    pub schedule: ScheduleKind,
    pub hyper: AdamWHyper,
    /// Precision of the compute params that travel to the device.
    pub compute_dtype: Dtype,
    /// Micro-batches per step (gradient accumulation).
    pub micro_batches: usize,
    /// Recompute the experts' hidden activations in the backward instead
    /// of keeping them.
    pub recompute_hidden: bool,
    /// Scheduled accesses the prefetcher looks ahead.
    pub prefetch_ahead_max: usize,
    /// Queue depth of the store's io_uring.
    pub io_queue_depth: u32,
    /// Benches only: move experts through the tiers and the optimizer
    /// exactly as training does, but skip the expert GEMMs (outputs and
    /// gradients are zero). This is the I/O-only run of `strata bench step`.
    pub skip_expert_compute: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            store_path: None,
            device_budget_bytes: 1 << 30,
            host_budget_bytes: 4 << 30,
            optimizer_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            schedule: ScheduleKind::ExpertWise,
            hyper: AdamWHyper::default(),
            compute_dtype: Dtype::F32,
            micro_batches: 1,
            recompute_hidden: false,
            prefetch_ahead_max: 16,
            io_queue_depth: 32,
            skip_expert_compute: false,
        }
    }
}

/// Per-step accumulators.
#[derive(Default)]
struct Accumulators {
    stall_upload_s: f64,
    stall_optimizer_s: f64,
    bytes_host_to_device: u64,
    bytes_device_to_host: u64,
    device_hits: u64,
    device_misses: u64,
    tokens_per_expert: Vec<Vec<u32>>,
}

/// Which expert owns which device slot.
pub(crate) struct DeviceSlots {
    owner: Vec<Option<usize>>,
    last_use: Vec<u64>,
    clock: u64,
}

/// A MoE stack whose experts live in the three tiers.
pub struct Engine {
    model: ModelConfig,
    config: EngineConfig,
    store_layout: Layout,
    backend: CpuBackend,
    cache: HostCache,
    arena: CpuDeviceArena,
    optimizer: ExpertOptimizer<ExpertUpdate>,
    dense: Vec<f32>,
    dense_m: Vec<f32>,
    dense_v: Vec<f32>,
    dense_step: u64,
    /// Per expert (layer·E + e): its AdamW step count.
    expert_steps: Vec<u64>,
    /// Per expert: submitted to the optimizer and not yet waited for.
    pending: Vec<bool>,
    /// Per expert: gradient summed over earlier micro-batches.
    grad_accum: Vec<Option<Vec<f32>>>,
    /// Naive schedule: updates held until the backward pass is over.
    deferred: Vec<(usize, Vec<f32>)>,
    /// [layer][expert] what the forward kept for the backward.
    saved: Vec<Vec<ExpertSaved<f32>>>,
    device: DeviceSlots,
    /// The f32 params of the expert being computed (reused every pass).
    params_scratch: Vec<f32>,
    acc: Accumulators,
    step: u64,
}

impl Engine {
    /// Builds the tiers for `model` within the budgets and writes every
    /// expert's initial record. With a `store_path`, the file must not exist.
    pub fn new(model: ModelConfig, config: EngineConfig) -> Result<Self, EngineError> {
        Self::new_network(&model, config)
    }

    /// [`Engine::new`] for any [`Network`]: its MoE layers' experts go to
    /// the tiers, its dense params start at `net.init_dense()`.
    pub fn new_network<N: Network>(net: &N, config: EngineConfig) -> Result<Self, EngineError> {
        let model = net.moe().clone();
        Self::check(&model, &config)?;
        let layout = Self::layout(&model, &config);
        let store = match &config.store_path {
            Some(path) => ExpertStore::create(path, layout, &Self::file_options(&config))?,
            None => ExpertStore::create_on(Box::new(MemFile::new()), layout)?,
        };
        write_initial_records(&model, &store)?;
        let dense = net.init_dense();
        let n = dense.len();
        let state = dense_state::DenseState {
            step: 0,
            dense_step: 0,
            params: dense,
            m: vec![0.0; n],
            v: vec![0.0; n],
        };
        if let Some(path) = &config.store_path {
            // Step 0 is committed by write_initial_records; give it its
            // dense file so even an untrained store can be resumed.
            dense_state::write(path, &state)?;
        }
        Self::build(model, config, Arc::new(store), state)
    }

    /// Reopens the store at `config.store_path` and its dense-state file and
    /// continues from its last committed checkpoint (see `checkpoint`).
    pub fn resume(model: ModelConfig, config: EngineConfig) -> Result<Self, EngineError> {
        Self::resume_network(&model, config)
    }

    /// [`Engine::resume`] for any [`Network`].
    pub fn resume_network<N: Network>(net: &N, config: EngineConfig) -> Result<Self, EngineError> {
        let model = net.moe().clone();
        Self::check(&model, &config)?;
        let Some(path) = config.store_path.clone() else {
            return Err(EngineError::Config("resume needs a store_path".into()));
        };
        let layout = Self::layout(&model, &config);
        let store = ExpertStore::open(&path, Some(layout), &Self::file_options(&config))?;
        let step = store.committed_step();
        let state = dense_state::read(&path, step, net.dense_params())?;
        let mut engine = Self::build(model, config, Arc::new(store), state)?;
        for key in 0..engine.expert_steps.len() {
            let id = engine.expert_id(key);
            engine.expert_steps[key] = engine.cache.store().expert_step(id)?.unwrap_or(0);
        }
        Ok(engine)
    }

    /// Opens a store whose experts were imported (step 0 committed, e.g.
    /// by `strata_tiers::import_experts`) and starts from `dense`, the
    /// network's imported dense params: fine-tuning.
    pub fn open_imported<N: Network>(
        net: &N,
        config: EngineConfig,
        dense: Vec<f32>,
    ) -> Result<Self, EngineError> {
        let model = net.moe().clone();
        Self::check(&model, &config)?;
        let Some(path) = config.store_path.clone() else {
            return Err(EngineError::Config(
                "open_imported needs a store_path".into(),
            ));
        };
        if dense.len() != net.dense_params() {
            return Err(EngineError::Config(format!(
                "{} dense params given, the network has {}",
                dense.len(),
                net.dense_params()
            )));
        }
        let layout = Self::layout(&model, &config);
        let store = ExpertStore::open(&path, Some(layout), &Self::file_options(&config))?;
        let n = dense.len();
        let state = dense_state::DenseState {
            step: store.committed_step(),
            dense_step: 0,
            params: dense,
            m: vec![0.0; n],
            v: vec![0.0; n],
        };
        dense_state::write(&path, &state)?;
        Self::build(model, config, Arc::new(store), state)
    }

    fn check(model: &ModelConfig, config: &EngineConfig) -> Result<(), EngineError> {
        model.validate()?;
        config
            .hyper
            .validate()
            .map_err(|e| EngineError::Config(e.to_string()))?;
        if config.micro_batches == 0 || config.optimizer_threads == 0 {
            return Err(EngineError::Config(
                "micro_batches and optimizer_threads must be at least 1".into(),
            ));
        }
        Ok(())
    }

    fn layout(model: &ModelConfig, config: &EngineConfig) -> Layout {
        Layout {
            layers: model.layers as u32,
            experts_per_layer: model.experts as u32,
            params_per_expert: model.expert_params() as u64,
            compute_dtype: config.compute_dtype,
        }
    }

    fn file_options(config: &EngineConfig) -> FileOptions {
        FileOptions {
            queue_depth: config.io_queue_depth,
            ..FileOptions::default()
        }
    }

    fn build(
        model: ModelConfig,
        config: EngineConfig,
        store: Arc<ExpertStore>,
        state: dense_state::DenseState,
    ) -> Result<Self, EngineError> {
        let layout = store.layout();
        let prefetch = match config.schedule {
            ScheduleKind::ExpertWise => config.prefetch_ahead_max,
            ScheduleKind::Naive => 0,
        };
        let cache = HostCache::new(
            Arc::clone(&store),
            HostCacheConfig {
                host_budget_bytes: config.host_budget_bytes,
                policy: EvictionPolicy::ScheduleDistance,
                prefetch_ahead_max: prefetch,
                prefetch_batch_max: 8,
                ..HostCacheConfig::default()
            },
        )?;
        let slot_bytes = layout.compute_payload_bytes() as usize;
        let arena = CpuDeviceArena::new(config.device_budget_bytes, slot_bytes, 64)?;
        let overlapped = config.schedule == ScheduleKind::ExpertWise && arena_slots(&arena) >= 2;
        cache.set_schedule(access_schedule(&model, overlapped));
        let optimizer = ExpertOptimizer::new(OptimizerConfig {
            threads: config.optimizer_threads,
            in_flight_max: model.layers * model.experts,
            kernel: Kernel::detect(),
            hyper: config.hyper,
            ..OptimizerConfig::default()
        })?;
        let experts = model.layers * model.experts;
        let device = DeviceSlots::new(arena_slots(&arena));
        Ok(Self {
            store_layout: layout,
            backend: CpuBackend,
            cache,
            arena,
            optimizer,
            dense: state.params,
            dense_m: state.m,
            dense_v: state.v,
            dense_step: state.dense_step,
            expert_steps: vec![0; experts],
            pending: vec![false; experts],
            grad_accum: vec![None; experts],
            deferred: Vec::new(),
            saved: vec![vec![ExpertSaved::default(); model.experts]; model.layers],
            device,
            params_scratch: Vec::with_capacity(model.expert_params()),
            acc: Accumulators::default(),
            step: state.step,
            model,
            config,
        })
    }

    pub fn model(&self) -> &ModelConfig {
        &self.model
    }

    /// Steps completed.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Device slots (experts that fit on the device at once).
    pub fn device_slots(&self) -> usize {
        self.device.slot_count()
    }

    /// Host slots (expert records that fit in host memory at once).
    pub fn host_slots(&self) -> usize {
        self.cache.slot_count()
    }

    /// One training step on `batch` (split into the configured micro-batches).
    pub fn step(&mut self, batch: &Batch) -> Result<StepMetrics, EngineError> {
        let model = self.model.clone();
        self.step_network(&model, batch)
    }

    /// The learning rate of the updates from the next step on (schedules).
    pub fn set_lr(&mut self, lr: f32) -> Result<(), EngineError> {
        let hyper = AdamWHyper {
            lr,
            ..self.config.hyper
        };
        self.optimizer.set_hyper(hyper)?;
        self.config.hyper = hyper;
        Ok(())
    }

    fn check_network<N: Network>(&self, net: &N) -> Result<(), EngineError> {
        if net.moe() != &self.model || net.dense_params() != self.dense.len() {
            return Err(EngineError::Config(
                "the network is not the one this engine was built for".into(),
            ));
        }
        Ok(())
    }

    /// The mean loss of `batch`, forward only: nothing is updated. The
    /// prefetch schedule restarts at the next step's forward.
    pub fn evaluate<N: Network>(&mut self, net: &N, batch: &N::Batch) -> Result<f32, EngineError> {
        self.check_network(net)?;
        net.validate_batch(batch)?;
        self.acc = Accumulators {
            tokens_per_expert: vec![vec![0; self.model.experts]; self.model.layers],
            ..Accumulators::default()
        };
        let dense = std::mem::take(&mut self.dense);
        let mut runner = runner::EngineRunner { engine: self };
        let loss = net.forward_loss(&dense, batch, &mut runner, &CpuBackend);
        self.dense = dense;
        let overlapped =
            self.config.schedule == ScheduleKind::ExpertWise && self.device.slot_count() >= 2;
        self.cache
            .set_schedule(access_schedule(&self.model, overlapped));
        loss
    }

    /// One training step of any [`Network`] built on this engine's MoE
    /// layers (see [`Engine::new_network`]).
    pub fn step_network<N: Network>(
        &mut self,
        net: &N,
        batch: &N::Batch,
    ) -> Result<StepMetrics, EngineError> {
        self.check_network(net)?;
        net.validate_batch(batch)?;
        let start = std::time::Instant::now();
        self.cache.take_stats(); // this step's counters start now
        self.acc = Accumulators {
            tokens_per_expert: vec![vec![0; self.model.experts]; self.model.layers],
            ..Accumulators::default()
        };
        let parts = net.split_batch(batch, self.config.micro_batches);
        let tokens_total = net.batch_tokens(batch);
        let count = parts.len();
        let mut dense_grad = vec![0.0f32; self.dense.len()];
        let mut loss = 0.0f32;
        let dense = std::mem::take(&mut self.dense);
        let mut result = Ok(());
        for (i, part) in parts.iter().enumerate() {
            let mut runner = runner::EngineRunner { engine: self };
            match net.forward_backward(
                &dense,
                &mut dense_grad,
                part,
                tokens_total,
                count,
                i + 1 == count,
                &mut runner,
                &CpuBackend,
            ) {
                Ok(l) => loss += l.total,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.dense = dense;
        if result.is_err() {
            // A failed step leaves no partial gradient behind for the next.
            self.grad_accum.iter_mut().for_each(|g| *g = None);
            self.deferred.clear();
        }
        result?;
        // Experts touched only by earlier micro-batches.
        for key in 0..self.grad_accum.len() {
            if let Some(grad) = self.grad_accum[key].take() {
                self.device.invalidate(key);
                self.submit_update(key, grad)?;
            }
        }
        if self.config.schedule == ScheduleKind::Naive {
            for (key, grad) in std::mem::take(&mut self.deferred) {
                self.submit_now(key, grad)?;
            }
            self.drain()?;
        }
        self.dense_step += 1;
        let s = StepScalars::new(&self.config.hyper, self.dense_step, 1.0);
        adamw_step(
            Kernel::detect(),
            &s,
            &mut self.dense,
            &mut self.dense_m,
            &mut self.dense_v,
            GradRef::F32(&dense_grad),
            CopyOut::None,
        )?;
        self.step += 1;
        let stats = self.cache.take_stats();
        let wall_s = start.elapsed().as_secs_f64();
        let stall_ssd_s = stats.stall_ns as f64 * 1e-9;
        let acc = &self.acc;
        let device_uses = acc.device_hits + acc.device_misses;
        Ok(StepMetrics {
            step: self.step,
            tokens: tokens_total,
            loss,
            wall_s,
            compute_s: (wall_s - acc.stall_upload_s - stall_ssd_s - acc.stall_optimizer_s).max(0.0),
            stall_upload_s: acc.stall_upload_s,
            stall_ssd_s,
            stall_optimizer_s: acc.stall_optimizer_s,
            bytes_ssd_to_host: stats.bytes_read,
            bytes_host_to_ssd: stats.bytes_written,
            bytes_host_to_device: acc.bytes_host_to_device,
            bytes_device_to_host: acc.bytes_device_to_host,
            host_hit_rate: stats.hit_rate(),
            device_hit_rate: if device_uses == 0 {
                1.0
            } else {
                acc.device_hits as f64 / device_uses as f64
            },
            tokens_per_expert: acc.tokens_per_expert.clone(),
        })
    }

    /// Hands an expert's complete gradient to the optimizer (or, on the
    /// naive schedule, holds it until the backward pass is over).
    fn submit_update(&mut self, key: usize, grad: Vec<f32>) -> Result<(), EngineError> {
        if self.config.schedule == ScheduleKind::Naive {
            self.deferred.push((key, grad));
            return Ok(());
        }
        self.submit_now(key, grad)
    }

    fn submit_now(&mut self, key: usize, grad: Vec<f32>) -> Result<(), EngineError> {
        self.reap_finished()?;
        let expert = self.expert_id(key);
        let guard = match self.cache.acquire_mut(expert) {
            Err(strata_tiers::TierError::AllSlotsPinned { .. }) => {
                self.drain_counted()?;
                self.cache.acquire_mut(expert)?
            }
            other => other?,
        };
        let target = ExpertUpdate {
            guard,
            grad,
            step: self.expert_steps[key],
            dtype: self.store_layout.compute_dtype,
        };
        self.optimizer.submit(ExpertKey(key as u64), target)?;
        self.pending[key] = true;
        Ok(())
    }

    /// Waits for one expert's update and marks its record dirty.
    fn finish_update(&mut self, key: usize) -> Result<(), EngineError> {
        let (mut target, _) = self.optimizer.wait(ExpertKey(key as u64))?;
        self.pending[key] = false;
        self.expert_steps[key] = target.step;
        target.guard.mark_dirty(target.step);
        Ok(())
    }

    /// Takes back every update that has already finished (without waiting),
    /// so its host slot is free for the prefetcher again.
    pub(crate) fn reap_finished(&mut self) -> Result<(), EngineError> {
        for key in 0..self.pending.len() {
            if !self.pending[key] {
                continue;
            }
            if let Some((mut target, _)) = self.optimizer.try_wait(ExpertKey(key as u64))? {
                self.pending[key] = false;
                self.expert_steps[key] = target.step;
                target.guard.mark_dirty(target.step);
            }
        }
        Ok(())
    }

    /// `drain`, counted as optimizer stall: updates in flight hold their
    /// host slots, and a small host budget can need them back.
    pub(crate) fn drain_counted(&mut self) -> Result<(), EngineError> {
        let t0 = std::time::Instant::now();
        self.drain()?;
        self.acc.stall_optimizer_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Waits for every update in flight.
    pub fn drain(&mut self) -> Result<(), EngineError> {
        for key in 0..self.pending.len() {
            if self.pending[key] {
                self.finish_update(key)?;
            }
        }
        Ok(())
    }

    fn expert_id(&self, key: usize) -> ExpertId {
        ExpertId::new(
            (key / self.model.experts) as u32,
            (key % self.model.experts) as u32,
        )
    }

    /// An expert's f32 master params (after every update in flight).
    pub fn expert_params(&mut self, layer: usize, expert: usize) -> Result<Vec<f32>, EngineError> {
        self.drain()?;
        let guard = self
            .cache
            .acquire(ExpertId::new(layer as u32, expert as u32), Parts::Full)?;
        Ok(guard.state().expect("a full guard has state").0.to_vec())
    }

    /// An expert's AdamW step count.
    pub fn expert_step(&mut self, layer: usize, expert: usize) -> Result<u64, EngineError> {
        self.drain()?;
        Ok(self.expert_steps[layer * self.model.experts + expert])
    }

    pub fn dense_params(&self) -> &[f32] {
        &self.dense
    }

    /// The SSD tier. Its records are the experts' current state after
    /// `checkpoint` (the host tier may hold newer ones until then).
    pub fn store(&self) -> &ExpertStore {
        self.cache.store()
    }

    /// Makes every expert's current state durable in the store as
    /// checkpoint `self.steps()`.
    pub fn checkpoint_experts(&mut self) -> Result<(), EngineError> {
        self.drain()?;
        self.cache.checkpoint(self.step)?;
        Ok(())
    }

    /// A full checkpoint at `self.steps()`: the dense state file first, then
    /// every expert, committed by the store. A crash at any point leaves
    /// the previous checkpoint resumable. Needs a `store_path`.
    pub fn checkpoint(&mut self) -> Result<(), EngineError> {
        let Some(path) = self.config.store_path.clone() else {
            return Err(EngineError::Config(
                "checkpoint needs a store_path (the SSD tier is in memory)".into(),
            ));
        };
        self.drain()?;
        dense_state::write(
            &path,
            &dense_state::DenseState {
                step: self.step,
                dense_step: self.dense_step,
                params: self.dense.clone(),
                m: self.dense_m.clone(),
                v: self.dense_v.clone(),
            },
        )?;
        self.cache.checkpoint(self.step)?;
        dense_state::remove_others(&path, self.step);
        Ok(())
    }
}

fn arena_slots(arena: &CpuDeviceArena) -> usize {
    use strata_tiers::DeviceArena;
    arena.slot_count()
}

/// The order the runner asks the host tier for experts: forward layers
/// 0..L-1 (compute params, experts in index order), then backward L-1..0
/// (experts in reverse order: compute params for the backward, then the
/// full record for the update). When the pipeline overlaps, the next
/// expert's compute params are asked for before this one's update, so the
/// backward of a layer reads C(r0), C(r1), F(r0), C(r2), F(r1), …, F(rn).
fn access_schedule(model: &ModelConfig, overlapped: bool) -> Vec<(ExpertId, Parts)> {
    let id = |l: usize, e: usize| ExpertId::new(l as u32, e as u32);
    let mut order = Vec::new();
    for l in 0..model.layers {
        for e in 0..model.experts {
            order.push((id(l, e), Parts::Compute));
        }
    }
    for l in (0..model.layers).rev() {
        let experts: Vec<usize> = (0..model.experts).rev().collect();
        if overlapped {
            order.push((id(l, experts[0]), Parts::Compute));
            for w in experts.windows(2) {
                order.push((id(l, w[1]), Parts::Compute));
                order.push((id(l, w[0]), Parts::Full));
            }
            order.push((id(l, *experts.last().expect("≥ 1 expert")), Parts::Full));
        } else {
            for &e in &experts {
                order.push((id(l, e), Parts::Compute));
                order.push((id(l, e), Parts::Full));
            }
        }
    }
    order
}

/// Writes each expert's initial params (zero moments) and commits step 0.
fn write_initial_records(model: &ModelConfig, store: &ExpertStore) -> Result<(), EngineError> {
    let layout = store.layout();
    let mut buf = AlignedBuf::zeroed(layout.record_bytes() as usize);
    for l in 0..model.layers {
        for e in 0..model.experts {
            {
                let r = record_mut(&layout, buf.as_mut_slice())?;
                model.init_expert(l, e, r.master);
                r.m.fill(0.0);
                r.v.fill(0.0);
                encode_compute(layout.compute_dtype, r.master, r.compute);
            }
            store.write(ExpertId::new(l as u32, e as u32), 0, buf.as_mut_slice())?;
        }
    }
    store.checkpoint(0)?;
    Ok(())
}
