//! What one training step cost and moved: the engine's main performance
//! signal (DESIGN.md, "Every wait is measured").

use serde::Serialize;
use strata_tiers::CacheStats;

use super::slot_table::Accumulators;

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub tokens: usize,
    pub loss: f32,
    pub wall_s: f64,
    /// Time in expert and dense compute (wall time less the stalls).
    pub compute_s: f64,
    /// Time waiting for host → device copies (with several devices, the
    /// mean over devices, as are the other stalls below).
    pub stall_upload_s: f64,
    /// Time waiting for expert records to arrive from the SSD tier.
    pub stall_ssd_s: f64,
    /// Time waiting for an expert's optimizer update before its forward.
    pub stall_optimizer_s: f64,
    /// Time with at least one SSD read, write or fsync in flight (the
    /// prefetcher's, demand loads' and write-backs' together): near
    /// `wall_s`, the step is bound by the SSD.
    pub ssd_busy_s: f64,
    pub bytes_ssd_to_host: u64,
    pub bytes_host_to_ssd: u64,
    /// The least this step's routing needed moved between the SSD and the
    /// host tier, both ways: each routed expert's record read once and
    /// written back once, none for a record the host tier keeps resident
    /// (none at all where it holds every record). Set against
    /// `bytes_ssd_to_host + bytes_host_to_ssd`, it shows the waste.
    pub bytes_ssd_min: u64,
    pub bytes_host_to_device: u64,
    pub bytes_device_to_host: u64,
    /// Every other byte copied between host and device memory this step
    /// (activations, dense weights and gradients, indices, scalars; all
    /// devices): 0 on the cpu backend, whose device memory is the host's.
    pub bytes_pcie_other: u64,
    /// Host-tier acquires served without waiting.
    pub host_hit_rate: f64,
    /// Records whose compute params moved from a host record slot to a
    /// compute cell to free the slot (`EngineConfig::host_cell_slots`).
    pub host_demotions: u64,
    /// Expert uses served by an expert already on the device.
    pub device_hit_rate: f64,
    /// One device: experts routed to that the forward's prefetch did not
    /// foresee, and experts it foresaw that got no token: ahead of a
    /// layer's router the prefetcher reads what the traced affinity with
    /// the layer before predicts (`routed_io.rs`).
    pub prediction_missed: u64,
    pub prediction_unused: u64,
    /// Several devices: seconds a step in collectives (token exchanges,
    /// counts, the dense all-reduce), the mean over devices; with a
    /// modeled link (`EngineConfig::link`), its waits included.
    pub comm_s: f64,
    /// Several devices: the MoE layers' token exchanges (all-to-alls) a
    /// device ran this step: 4 a layer and micro-batch (dispatch and
    /// combine, forward and backward), more where a layer's exchange goes
    /// in parts (`EngineConfig::exchange_parts`); 0 on one device.
    pub token_exchanges: u64,
    /// Several devices: seconds a step in the MoE layers' exchanges, from
    /// the first dispatch to the last combine written back (the experts'
    /// compute and their waits inside), the most of any device.
    pub exchange_s: f64,
    /// Several devices with a fitted link (`--pipeline auto`, or
    /// [`Engine::calibrate_exchange`](super::Engine::calibrate_exchange)):
    /// what the exchange's cost model predicted for the same exchanges in
    /// the parts they went in (`exchange_s`'s prediction); 0 without one.
    pub exchange_model_s: f64,
    /// Several devices: `[layer][forward, backward]` seconds in each
    /// layer's exchange (`exchange_s` by layer, the most of any device),
    /// and the parts it went in (`EngineConfig::exchange_parts`; in the
    /// last micro-batch, where there are several); empty on one device.
    pub exchange_layer_s: Vec<[f64; 2]>,
    pub exchange_layer_parts: Vec<[usize; 2]>,
    /// Assignments condensed into another row of their expert
    /// (`EngineConfig::condense`: computed once, their output copied),
    /// over every layer and device; 0 without condensation.
    pub condensed: u64,
    /// The condensation threshold this step ran with, where it condenses.
    pub condense_threshold: Option<f32>,
    /// `[layer][expert]` assignments this step (all devices); with
    /// condensation, the rows the experts computed.
    pub tokens_per_expert: Vec<Vec<u32>>,
    /// Per device: expert assignments it computed, forward and backward
    /// (placement's balance; one entry with one device).
    pub assignments_per_device: Vec<u64>,
    /// Per device: seconds in expert GEMMs.
    pub expert_compute_s_per_device: Vec<f64>,
    /// Several devices: per device, `[forward, backward]` seconds of the
    /// MoE layers' exchanges spent on the device's own work, neither its
    /// experts' compute nor waiting for the wire: gathering the rows it
    /// sends, joining and splitting each expert's, staging its experts,
    /// handing gradients on, writing what came back (the exchange's cost
    /// model counts it an expert at a time); empty on one device.
    pub exchange_local_s_per_device: Vec<[f64; 2]>,
    /// Several devices: per device, `[forward, backward]` experts its
    /// exchanges computed (the own work's divisor); empty on one device.
    pub exchange_experts_per_device: Vec<[u64; 2]>,
    /// The global gradient norm, before clipping, where the step clips it
    /// (`EngineConfig::clip_grad_norm`).
    pub grad_norm: Option<f64>,
}

impl StepMetrics {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("metrics serialize")
    }

    /// max / min − 1 of the devices' computed assignments (0: balanced).
    pub fn device_load_gap(&self) -> f64 {
        crate::placement::load_gap(
            &self
                .assignments_per_device
                .iter()
                .map(|&a| a as f64)
                .collect::<Vec<_>>(),
        )
    }
}

/// [layer][pass] the most seconds any device spent in the layer's
/// exchange; empty where no device exchanged (one device).
fn by_layer_max(devices: &[&Accumulators]) -> Vec<[f64; 2]> {
    if devices.iter().all(|a| a.token_exchanges == 0) {
        return Vec::new();
    }
    let mut most = devices[0].exchange_layer_s.clone();
    for a in &devices[1..] {
        for (m, o) in most.iter_mut().zip(&a.exchange_layer_s) {
            m[0] = m[0].max(o[0]);
            m[1] = m[1].max(o[1]);
        }
    }
    most
}

/// One step's metrics from the host tier's counters and each device's.
pub(crate) fn gather<'a>(
    step: u64,
    tokens: usize,
    loss: f32,
    wall_s: f64,
    stats: &CacheStats,
    ssd_busy_s: f64,
    devices: impl Iterator<Item = &'a Accumulators>,
) -> StepMetrics {
    let devices: Vec<&Accumulators> = devices.collect();
    let n = devices.len() as f64;
    let mean = |f: fn(&Accumulators) -> f64| devices.iter().map(|a| f(a)).sum::<f64>() / n;
    let sum = |f: fn(&Accumulators) -> u64| devices.iter().map(|a| f(a)).sum::<u64>();
    let stall_upload_s = mean(|a| a.stall_upload_s);
    let stall_optimizer_s = mean(|a| a.stall_optimizer_s);
    // The host tier's stall is summed over every acquirer.
    let stall_ssd_s = stats.stall_ns as f64 * 1e-9 / n;
    let (hits, misses) = (sum(|a| a.device_hits), sum(|a| a.device_misses));
    let layer_s = by_layer_max(&devices);
    let (local, local_experts) = match layer_s.is_empty() {
        true => (Vec::new(), Vec::new()),
        false => (
            devices.iter().map(|a| a.exchange_local_s).collect(),
            devices.iter().map(|a| a.exchange_experts).collect(),
        ),
    };
    let mut tokens_per_expert = devices[0].tokens_per_expert.clone();
    for a in &devices[1..] {
        for (row, other) in tokens_per_expert.iter_mut().zip(&a.tokens_per_expert) {
            row.iter_mut().zip(other).for_each(|(t, o)| *t += o);
        }
    }
    StepMetrics {
        step,
        tokens,
        loss,
        wall_s,
        compute_s: (wall_s - stall_upload_s - stall_ssd_s - stall_optimizer_s).max(0.0),
        stall_upload_s,
        stall_ssd_s,
        stall_optimizer_s,
        ssd_busy_s,
        bytes_ssd_to_host: stats.bytes_read,
        bytes_host_to_ssd: stats.bytes_written,
        bytes_ssd_min: 0, // the engine's, from the routing and the host tier
        bytes_host_to_device: sum(|a| a.bytes_host_to_device),
        bytes_device_to_host: sum(|a| a.bytes_device_to_host),
        bytes_pcie_other: 0, // the engine's, from its dense kernels
        host_hit_rate: stats.hit_rate(),
        host_demotions: stats.demotions,
        device_hit_rate: if hits + misses == 0 {
            1.0
        } else {
            hits as f64 / (hits + misses) as f64
        },
        prediction_missed: sum(|a| a.prediction_missed),
        prediction_unused: sum(|a| a.prediction_unused),
        comm_s: mean(|a| a.comm_s),
        token_exchanges: devices.iter().map(|a| a.token_exchanges).max().unwrap_or(0),
        exchange_s: devices.iter().map(|a| a.exchange_s).fold(0.0, f64::max),
        exchange_model_s: devices
            .iter()
            .map(|a| a.exchange_model_s)
            .fold(0.0, f64::max),
        exchange_layer_parts: match layer_s.is_empty() {
            true => Vec::new(),
            false => devices[0].exchange_layer_parts.clone(),
        },
        exchange_layer_s: layer_s,
        condensed: sum(|a| a.condensed),
        condense_threshold: None, // the engine's
        tokens_per_expert,
        assignments_per_device: devices.iter().map(|a| a.assignments_computed).collect(),
        expert_compute_s_per_device: devices.iter().map(|a| a.expert_compute_s).collect(),
        exchange_local_s_per_device: local,
        exchange_experts_per_device: local_experts,
        grad_norm: None,
    }
}
