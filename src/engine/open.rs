//! Opening an engine: on a new store, on a resumed one, or on one whose
//! experts were imported, after checking the model and config; `build.rs`
//! then builds the host tier, the devices and the optimizer pool around
//! the store.

use std::sync::Arc;

use strata_tiers::encode_compute;
use strata_tiers::io::{AlignedBuf, FileOptions, MemFile};
use strata_tiers::{record_mut, ExpertId, ExpertStore, Layout};

use super::build::host_cell_slot_count;
use super::trainable_len;
use super::{
    dense_state, host_memory_available, Engine, EngineConfig, ExpertCompute, HostMemoryPlan,
    ScheduleKind, MIN_HOST_STREAM_SLOTS,
};
use crate::model::{ModelConfig, Network};
use crate::EngineError;

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
        let frozen = net.frozen_dense();
        let dense = net.init_dense();
        let m = trainable_len(dense.len(), &frozen);
        let state = dense_state::DenseState {
            step: 0,
            dense_step: 0,
            params: dense,
            m: vec![0.0; m],
            v: vec![0.0; m],
        };
        if let Some(path) = &config.store_path {
            // Step 0 is committed by write_initial_records; give it its
            // dense file so even an untrained store can be resumed.
            dense_state::write(path, &state.as_ref())?;
        }
        Self::build(model, config, Arc::new(store), state, frozen)
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
        let frozen = net.frozen_dense();
        let n = net.dense_params();
        let state = dense_state::read(&path, step, n, Some(trainable_len(n, &frozen)))?;
        Self::build(model, config, Arc::new(store), state, frozen)
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
        let frozen = net.frozen_dense();
        let m = trainable_len(dense.len(), &frozen);
        let state = dense_state::DenseState {
            step: store.committed_step(),
            dense_step: 0,
            params: dense,
            m: vec![0.0; m],
            v: vec![0.0; m],
        };
        dense_state::write(&path, &state.as_ref())?;
        Self::build(model, config, Arc::new(store), state, frozen)
    }

    fn check(model: &ModelConfig, config: &EngineConfig) -> Result<(), EngineError> {
        model.validate()?;
        config
            .hyper
            .validate()
            .map_err(|e| EngineError::Config(e.to_string()))?;
        if config.micro_batches == 0 || config.optimizer_threads == 0 || config.devices == 0 {
            return Err(EngineError::Config(
                "micro_batches, optimizer_threads and devices must be at least 1".into(),
            ));
        }
        if config.devices > usize::from(u16::MAX) {
            return Err(EngineError::Config(format!(
                "{} devices asked for; at most {} are supported",
                config.devices,
                u16::MAX
            )));
        }
        Self::check_ranks(config)?;
        Self::check_host_slots(model, config)?;
        Self::check_step_options(config)?;
        let layout = Self::layout(model, config);
        HostMemoryPlan::of(&layout, config).check(host_memory_available().as_ref())
    }

    /// The host tier's slots: enough of them stream records.
    fn check_host_slots(model: &ModelConfig, config: &EngineConfig) -> Result<(), EngineError> {
        if let Some(n) = config
            .host_stream_slots
            .filter(|&n| n < MIN_HOST_STREAM_SLOTS)
        {
            return Err(EngineError::Config(format!(
                "host_stream_slots = {n}: at least {MIN_HOST_STREAM_SLOTS} host slots must \
                 stream records (one updated, one uploading, one loading); use None to keep \
                 none resident"
            )));
        }
        let layout = Self::layout(model, config);
        let budget_slots = (config.host_budget_bytes / layout.record_bytes()) as usize;
        let cells = host_cell_slot_count(config, budget_slots, layout.expert_count() as usize);
        let left = budget_slots.saturating_sub(cells);
        if cells > 0 && left < MIN_HOST_STREAM_SLOTS {
            return Err(EngineError::Config(format!(
                "host_cell_slots = {cells} leaves {left} of the host budget's {budget_slots} \
                 record slots; at least {MIN_HOST_STREAM_SLOTS} must hold records to stream \
                 them: split fewer slots into compute cells or raise host_budget_bytes"
            )));
        }
        Ok(())
    }

    /// Clipping, condensation, pinning and a modeled device: each in
    /// range, and none with an option it does not combine with.
    fn check_step_options(config: &EngineConfig) -> Result<(), EngineError> {
        if let Some(max) = config.clip_grad_norm {
            if !(max.is_finite() && max > 0.0) {
                return Err(EngineError::Config(format!(
                    "clip_grad_norm = {max} must be a positive number"
                )));
            }
            if config.schedule != ScheduleKind::Naive {
                return Err(EngineError::Config(
                    "clip_grad_norm needs ScheduleKind::Naive: the global norm is known only \
                     when the backward ends, so every expert's update waits for it"
                        .into(),
                ));
            }
        }
        if let Some(c) = &config.condense {
            c.check().map_err(|e| EngineError::Config(e.0))?;
            let pairs = (config.trace_routing.then_some("trace_routing"))
                .or(config.affinity_prefetch.then_some("affinity_prefetch"));
            if let Some(what) = pairs {
                return Err(EngineError::Config(format!(
                    "token condensation with {what}: {what} pairs each token's experts across \
                     layers, and a condensed layer computes fewer tokens; turn one off"
                )));
            }
            if config.backend != crate::backend::BackendKind::Cpu {
                return Err(EngineError::Config(
                    "token condensation runs on the cpu backend (its rows in host memory); \
                     a GPU's activations stay in its memory: use the cpu backend or turn \
                     condensation off"
                        .into(),
                ));
            }
        }
        if !(0.0..=1.0).contains(&config.pin_fraction) {
            return Err(EngineError::Config(format!(
                "pin_fraction = {} must be between 0 and 1",
                config.pin_fraction
            )));
        }
        if let ExpertCompute::Modeled { flops_per_s } = config.expert_compute {
            if !(flops_per_s.is_finite() && flops_per_s > 0.0) {
                return Err(EngineError::Config(format!(
                    "ExpertCompute::Modeled {{ flops_per_s: {flops_per_s} }}: the modeled \
                     device's rate must be a positive number of FLOP/s"
                )));
            }
        }
        Ok(())
    }

    /// What ranks as processes do not yet combine with.
    fn check_ranks(config: &EngineConfig) -> Result<(), EngineError> {
        if config.ranks == 0 || config.ranks > usize::from(u16::MAX) {
            return Err(EngineError::Config(format!(
                "ranks = {}: between 1 and {} ranks are supported",
                config.ranks,
                u16::MAX
            )));
        }
        if config.ranks == 1 {
            return Ok(());
        }
        let clash = [
            (config.devices > 1, "several devices per rank (devices > 1)"),
            (config.affinity_prefetch, "affinity_prefetch"),
        ];
        match clash.iter().find(|(on, _)| *on) {
            Some((_, what)) => Err(EngineError::Config(format!(
                "ranks as processes ({} ranks) with {what}: not supported yet; run one rank \
                 per process with one device, or run the devices in one process (devices = N)",
                config.ranks
            ))),
            None => Ok(()),
        }
    }

    /// The store layout of `model`'s experts under `config`.
    pub fn layout(model: &ModelConfig, config: &EngineConfig) -> Layout {
        Layout {
            layers: model.layers as u32,
            experts_per_layer: model.experts as u32,
            params_per_expert: model.expert_params() as u64,
            compute_dtype: config.compute_dtype,
            // Frozen experts keep no Adam moments.
            moments: config.train_experts,
        }
    }

    pub(crate) fn file_options(config: &EngineConfig) -> FileOptions {
        FileOptions {
            queue_depth: config.io_queue_depth,
            ..FileOptions::default()
        }
    }
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
