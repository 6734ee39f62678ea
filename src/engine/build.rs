//! Building an engine around its store: the host tier (the prefetcher's
//! lookahead, and the tier's split into kept records, streaming slots,
//! compute cells and held updates), the devices (their host memory
//! page-locked, or their uploads staged), the optimizer pool, and the
//! dense kernels each device's dense layers run on.

use std::sync::Arc;

use strata_optim::{ExpertOptimizer, Kernel, OptimizerConfig};
use strata_tiers::{
    EvictionPolicy, ExpertId, ExpertStore, HostCache, HostCacheConfig, Layout, Parts,
};

use super::access::access_schedule;
use super::part_search::PartSearch;
use super::routed_io::RoutedIo;
use super::routing_trace::TransitionCounter;
use super::slot_table::{group_size, scratch_buffers_kept, DeviceState};
use super::updates::SharedExperts;
use super::RoutingTrace;
use super::{
    dense_state, multi, Engine, EngineConfig, ExchangeParts, ScheduleKind, MIN_HOST_STREAM_SLOTS,
};
use crate::model::{DenseKernels, ModelConfig, ScratchBuffers, TimedKernels};
use crate::EngineError;

impl Engine {
    /// The engine over `store`, with the dense `state` it resumes from
    /// (`frozen`: the dense ranges without moments).
    pub(super) fn build(
        model: ModelConfig,
        config: EngineConfig,
        store: Arc<ExpertStore>,
        state: dense_state::DenseState,
        frozen: Vec<std::ops::Range<usize>>,
    ) -> Result<Self, EngineError> {
        let layout = store.layout();
        let cache = host_cache(&config, &store, &layout)?;
        let mut devices = open_devices(&model, &config, &layout)?;
        let mut notes = store.notes().to_vec();
        notes.extend(page_lock_host_tier(&mut devices, &cache)?);
        let device_slots = devices[0].slots.slot_count();
        cache.keep_resident(&kept_experts(
            model.layers,
            model.experts,
            &config,
            cache.slot_count(),
        ))?;
        let group = expert_group(&model, &config, &devices[0], &cache);
        for dev in &mut devices {
            dev.group = group;
            dev.scratch = ScratchBuffers::new(scratch_buffers_kept(group));
        }
        cache.set_schedule(step_schedule(&model, &config, device_slots, &cache));
        let shared = shared_experts(&model, &config, &store, layout, cache, device_slots)?;
        let cost = multi::initial_cost(&model, &layout, config.devices);
        let dense_kernels = dense_kernels(&devices, &config);
        for kernels in &dense_kernels {
            kernels.weights_changed(&state.params);
        }
        Ok(Self {
            devices,
            dense_kernels,
            shared,
            notes,
            dense: state.params,
            dense_m: state.m,
            dense_v: state.v,
            frozen,
            signatures: config.condense.and_then(|c| match c.search {
                crate::condense::Search::Lsh { tables, bits } => Some(
                    crate::condense::SignatureTables::new(tables, bits, model.d_model),
                ),
                crate::condense::Search::AllPairs => None,
            }),
            condense_losses: (None, None),
            routing_trace: config
                .trace_routing
                .then(|| RoutingTrace::new(model.layers, model.experts, model.top_k)),
            dense_step: state.dense_step,
            dense_newer_on_device: false,
            cost,
            link_fit: None,
            exchange_local: [0.0; 2],
            part_search: (config.exchange_parts == ExchangeParts::Auto)
                .then(|| PartSearch::new(model.layers)),
            prev_load: None,
            device_threads: Default::default(),
            dense_reducers: Vec::new(),
            ranks: None,
            step: state.step,
            model,
            config,
        })
    }
}

/// The host tier over `store` within the host budget, its prefetcher's
/// lookahead and batch as the schedule and devices allow.
fn host_cache(
    config: &EngineConfig,
    store: &Arc<ExpertStore>,
    layout: &Layout,
) -> Result<HostCache, EngineError> {
    // Several devices walk a layer's experts at once, so their accesses
    // stray from any one order; a lookahead beyond half of a device's
    // share of the host slots then loads records the host tier must
    // evict before their use (measured in `strata bench step --devices 2`:
    // 3.4× the SSD reads at a lookahead of 16 with 8 host slots).
    let host_slots = (config.host_budget_bytes / layout.record_bytes()) as usize;
    let prefetch = match config.schedule {
        ScheduleKind::ExpertWise if config.devices > 1 => config
            .prefetch_ahead_max
            .min((host_slots / (2 * config.devices)).max(1)),
        ScheduleKind::ExpertWise => config.prefetch_ahead_max,
        ScheduleKind::Naive => 0,
    };
    let cache = HostCache::new(
        Arc::clone(store),
        HostCacheConfig {
            host_budget_bytes: config.host_budget_bytes,
            policy: EvictionPolicy::ScheduleDistance,
            prefetch_ahead_max: prefetch,
            // A batch's loads become usable when its last read ends,
            // so a wide batch makes the nearest expert wait for the
            // farthest (each record is one large read, which keeps the
            // disk busy by itself). In `bench step` batches of 8 left
            // the expert-wise schedule 0.44 / 0.39 s of SSD stall a
            // step, batches of 2 0.22 / 0.16 s (alternating runs).
            prefetch_batch_max: 2,
            cell_slots: host_cell_slot_count(config, host_slots, layout.expert_count() as usize),
            timeline: config.timeline.clone(),
            ..HostCacheConfig::default()
        },
    )?;
    Ok(cache)
}

/// How many experts a pass stages and computes at once
/// ([`EngineConfig::expert_group`]): on one device of one process, the
/// group asked for (or the device's limit) within half its slots, and,
/// where the host tier streams, within half its streaming slots, which
/// two groups' uploads hold at once; 1 with several devices or ranks,
/// whose exchange computes one expert at a time.
fn expert_group(
    model: &ModelConfig,
    config: &EngineConfig,
    device: &DeviceState,
    cache: &HostCache,
) -> usize {
    if config.workers() > 1 {
        return 1;
    }
    let slots = device.slots.slot_count();
    let group = group_size(config.expert_group, device.device.group_limit(), slots);
    group_within_streaming(
        group,
        cache.slot_count(),
        cache.kept_count(),
        model.layers * model.experts,
    )
}

/// `group` within half the host tier's streaming slots where its
/// `record_slots` (`kept` of them keeping a record resident) hold fewer
/// than the `records`: two groups' uploads hold them at once.
pub(crate) fn group_within_streaming(
    group: usize,
    record_slots: usize,
    kept: usize,
    records: usize,
) -> usize {
    match record_slots < records {
        true => group.min((record_slots.saturating_sub(kept) / 2).max(1)),
        false => group,
    }
}

/// Each of the config's devices opened with its slots, its routed I/O and
/// (where traced) its routing counter.
fn open_devices(
    model: &ModelConfig,
    config: &EngineConfig,
    layout: &Layout,
) -> Result<Vec<DeviceState>, EngineError> {
    (0..config.devices)
        .map(|ordinal| {
            let device = config.backend.open_device(
                config.first_gpu + ordinal,
                config.device_budget_bytes,
                layout,
                (config.dense_gemm, config.expert_gemm),
            )?;
            let device = crate::backend::ModeledExpertDevice::wrap(device, config.expert_compute);
            let routed = RoutedIo::new(
                model.layers,
                model.experts,
                model.top_k,
                config.affinity_prefetch,
            );
            let mut state = DeviceState::new(device, model.layers, model.experts, routed);
            state.routing = config
                .trace_routing
                .then(|| TransitionCounter::new(model.layers, model.experts, model.top_k));
            Ok(state)
        })
        .collect()
}

/// Page-locks the host tier's memory for the devices' uploads; where
/// that is refused, every device stages its uploads instead, and the
/// note that says so is returned.
fn page_lock_host_tier(
    devices: &mut [DeviceState],
    cache: &HostCache,
) -> Result<Option<String>, EngineError> {
    let Some(why) = devices[0].device.page_lock_host_region(cache.region()) else {
        return Ok(None);
    };
    for dev in devices.iter_mut() {
        dev.device.stage_uploads()?;
    }
    Ok(Some(format!(
        "host memory for {} uploads: {why}; uploads are staged through page-locked \
         buffers instead (one more host copy each)",
        devices[0].device.name()
    )))
}

/// The experts' shared state: the host tier, the optimizer pool, each
/// expert's step count (its params' version in the store), and the
/// updates held for the next forward.
fn shared_experts(
    model: &ModelConfig,
    config: &EngineConfig,
    store: &ExpertStore,
    layout: Layout,
    cache: HostCache,
    device_slots: usize,
) -> Result<SharedExperts, EngineError> {
    let optimizer = ExpertOptimizer::new(OptimizerConfig {
        threads: config.optimizer_threads,
        in_flight_max: model.layers * model.experts,
        kernel: Kernel::detect(),
        hyper: config.hyper,
        ..OptimizerConfig::default()
    })?;
    // Each expert's step count: its params' version (0 for a new store).
    let steps = (0..model.layers * model.experts)
        .map(|key| {
            let id = ExpertId::from_dense_index(key, model.experts);
            Ok(store.expert_step(id)?.unwrap_or(0))
        })
        .collect::<Result<Vec<u64>, EngineError>>()?;
    let mut shared = SharedExperts::new(
        model.experts,
        config.devices,
        config.schedule,
        layout,
        cache,
        optimizer,
        steps,
    );
    shared.timeline = config.timeline.clone();
    shared.train = config.train_experts;
    // The same set `step_schedule` gives its accesses for.
    let slots = shared.cache.slot_count();
    let overlapped = config.schedule.overlaps(device_slots);
    shared.defer_updates(&deferred_experts(
        model.layers,
        model.experts,
        config,
        overlapped,
        slots,
    ));
    Ok(shared)
}

/// Each device's dense kernels, timed where a timeline records.
fn dense_kernels(
    devices: &[DeviceState],
    config: &EngineConfig,
) -> Vec<Arc<dyn DenseKernels + Send + Sync>> {
    devices
        .iter()
        .map(|d| {
            let kernels = d.device.dense_kernels();
            match &config.timeline {
                Some(t) => Arc::new(TimedKernels::new(kernels, Arc::clone(t))) as Arc<_>,
                None => kernels,
            }
        })
        .collect()
}

/// The experts the host tier keeps resident (`host_stream_slots`): with
/// the expert-wise schedule on one device, where the tier cannot hold
/// every record, all its slots but the streaming ones, filled from the
/// last layer down in index order. A kept record is read and written back
/// by checkpoints only; a streamed one once a step each way. (The last
/// layer's first: in the I/O-only step of `bench step`'s stack, the same
/// count kept from other layers moved more bytes, as the fewer streaming
/// slots then read some records twice.)
pub(super) fn kept_experts(
    layers: usize,
    experts: usize,
    config: &EngineConfig,
    host_slots: usize,
) -> Vec<ExpertId> {
    let keep = host_kept_count(config, host_slots, layers * experts);
    (0..layers)
        .rev()
        .flat_map(|l| (0..experts).map(move |e| ExpertId::new(l as u32, e as u32)))
        .take(keep)
        .collect()
}

/// The experts whose updates wait for the next step's forward, in a
/// stack of `layers` × `experts` whose pipeline overlaps or not: the last
/// layer's experts not kept (see [`EngineConfig::defer_last_layer_updates`]),
/// with one device, when records are kept and those fit in the streaming
/// slots (the forward's tail then reads them in full just before that
/// layer).
pub(super) fn deferred_experts(
    layers: usize,
    experts: usize,
    config: &EngineConfig,
    overlapped: bool,
    host_slots: usize,
) -> Vec<ExpertId> {
    if !overlapped || config.workers() != 1 || layers == 0 || !config.defer_last_layer_updates {
        return Vec::new();
    }
    let keep = kept_experts(layers, experts, config, host_slots).len();
    let others = experts.saturating_sub(keep);
    if keep == 0 || others > host_slots - keep {
        return Vec::new();
    }
    let last = (layers - 1) as u32;
    (keep..experts)
        .map(|e| ExpertId::new(last, e as u32))
        .collect()
}

/// How many of `host_slots` keep a record resident under `config`, with
/// `records` expert records in the store (see [`EngineConfig::host_stream_slots`]).
pub fn host_kept_count(config: &EngineConfig, host_slots: usize, records: usize) -> usize {
    match config.host_stream_slots {
        Some(stream) if streams_on_one_device(config, host_slots, records) => {
            host_slots.saturating_sub(stream.max(MIN_HOST_STREAM_SLOTS))
        }
        _ => 0,
    }
}

/// Whether the host tier's split (kept records, compute cells) applies:
/// the expert-wise schedule on one device, with fewer than the store's
/// `records` fitting in `host_slots`.
fn streams_on_one_device(config: &EngineConfig, host_slots: usize, records: usize) -> bool {
    config.schedule == ScheduleKind::ExpertWise && config.workers() == 1 && host_slots < records
}

/// How many of the host budget's `budget_slots` record slots are split
/// into compute cells under `config`, with `records` expert records in
/// the store (see [`EngineConfig::host_cell_slots`]): none but with the
/// expert-wise schedule on one device where records stream.
pub fn host_cell_slot_count(config: &EngineConfig, budget_slots: usize, records: usize) -> usize {
    match streams_on_one_device(config, budget_slots, records) {
        true => config.host_cell_slots,
        false => 0,
    }
}

/// The host tier's schedule of a step from its start (see `access.rs`):
/// overlapped on the expert-wise schedule with two device slots or more;
/// the forward's tail asks for full records with one device.
pub(super) fn step_schedule(
    model: &ModelConfig,
    config: &EngineConfig,
    device_slots: usize,
    cache: &HostCache,
) -> Vec<(ExpertId, Parts)> {
    let overlapped = config.schedule.overlaps(device_slots);
    let tail_slots = if config.workers() == 1 {
        cache.slot_count() - cache.kept_count()
    } else {
        0
    };
    let deferred = deferred_experts(
        model.layers,
        model.experts,
        config,
        overlapped,
        cache.slot_count(),
    );
    access_schedule(
        model,
        overlapped,
        tail_slots,
        &deferred,
        config.train_experts,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(list: &[(u32, u32)]) -> Vec<ExpertId> {
        list.iter().map(|&(l, e)| ExpertId::new(l, e)).collect()
    }

    #[test]
    fn the_last_layer_s_streamed_experts_hold_their_updates_where_they_fit() {
        let config = EngineConfig::default();
        // 2 × 8 experts, 8 host slots, 4 streaming: layer 1's experts 0–3
        // kept, its 4–7 held (they fit the streaming slots).
        assert_eq!(
            deferred_experts(2, 8, &config, true, 8),
            ids(&[(1, 4), (1, 5), (1, 6), (1, 7)])
        );
        // 3 × 4 experts, 10 host slots: 6 kept (all of layer 2), so the
        // last layer streams none and holds none.
        assert!(deferred_experts(3, 4, &config, true, 10).is_empty());
        // 2 × 8 experts, 6 host slots: 2 kept, the last layer's other 6
        // do not fit the 4 streaming slots.
        assert!(deferred_experts(2, 8, &config, true, 6).is_empty());
        // Nothing is held where the pipeline does not overlap, with
        // several devices, where every record is resident, or when the
        // config says not to.
        assert!(deferred_experts(2, 8, &config, false, 8).is_empty());
        assert!(deferred_experts(2, 8, &config, true, 16).is_empty());
        let two = EngineConfig {
            devices: 2,
            ..config.clone()
        };
        assert!(deferred_experts(2, 8, &two, true, 8).is_empty());
        let off = EngineConfig {
            defer_last_layer_updates: false,
            ..config
        };
        assert!(deferred_experts(2, 8, &off, true, 8).is_empty());
    }
}
