//! A device stages and computes a layer's experts a group at a time
//! (`EngineConfig::expert_group`; a GPU runs each product of a group as
//! one grouped GEMM, `tests/gpu_slot_order.rs`). On the cpu device, whose
//! group is 1 unless asked, a group changes only the staging: the next
//! group's uploads issued before this one computes, each into a slot
//! neither this group's nor the next's earlier ones. The results are the
//! bits of one expert at a time, with every record in host memory and
//! with records streaming from the SSD; the group stays within half the
//! device's slots and half the host tier's streaming slots, and is 1 on
//! several devices.

mod common;

use common::{batch, hyper, model, record_bytes};
use strata::engine::{Engine, EngineConfig};
use strata::math::ExpertKind;
use strata::model::ModelConfig;
use strata_tiers::Dtype;

const STEPS: usize = 4;

/// An engine of `slots` device slots and, with `host_records`, that many
/// host records (all streaming; else every record in host memory),
/// computing `group` experts at a time where it may.
fn engine(
    dir: &std::path::Path,
    (slots, group): (u64, usize),
    host_records: Option<u64>,
    devices: usize,
) -> (Engine, ModelConfig) {
    let model = model(2, ExpertKind::SwiGlu);
    let expert_bytes = (model.expert_params() * 4) as u64;
    let name = format!("{slots}-{group}-{host_records:?}-{devices}.strata");
    let defaults = EngineConfig::default();
    let engine = Engine::new(
        model.clone(),
        EngineConfig {
            store_path: Some(dir.join(name)),
            device_budget_bytes: slots * expert_bytes,
            host_budget_bytes: host_records
                .map_or(defaults.host_budget_bytes, |n| n * record_bytes(&model)),
            host_stream_slots: host_records.map(|n| n as usize),
            compute_dtype: Dtype::F32,
            hyper: hyper(),
            optimizer_threads: 2,
            devices,
            expert_group: Some(group),
            ..defaults
        },
    )
    .unwrap();
    (engine, model)
}

/// Every step's loss and every expert's params after `STEPS` steps, and
/// the group the engine took.
fn run(
    dir: &std::path::Path,
    slots_group: (u64, usize),
    host_records: Option<u64>,
    devices: usize,
) -> (Vec<f32>, Vec<Vec<f32>>, usize) {
    let (mut engine, model) = engine(dir, slots_group, host_records, devices);
    let losses = (0..STEPS)
        .map(|s| engine.step(&batch(&model, s)).unwrap().loss)
        .collect();
    let params = (0..model.layers)
        .flat_map(|l| (0..model.experts).map(move |e| (l, e)))
        .map(|(l, e)| engine.expert_params(l, e).unwrap())
        .collect();
    (losses, params, engine.expert_group())
}

#[test]
fn experts_staged_a_group_at_a_time_train_the_bits_of_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let (losses, params, one) = run(dir.path(), (2, 1), None, 1);
    assert_eq!(one, 1);
    // (slots, group asked, host records), the group the engine takes.
    let cases = [
        ((6, 3), None, 3),
        ((16, 8), None, 8),
        // Half the slots at most.
        ((5, 4), None, 2),
        // Half of 6 streaming host slots at most.
        ((8, 4), Some(6), 3),
        ((4, 2), Some(4), 2),
    ];
    for (slots_group, host_records, took) in cases {
        let (l, p, group) = run(dir.path(), slots_group, host_records, 1);
        let case = format!("{slots_group:?} with {host_records:?} host records");
        assert_eq!(group, took, "{case}: the group");
        assert_eq!(l, losses, "{case}: the losses");
        assert!(p == params, "{case}: the experts' params");
    }
}

/// Several devices exchange tokens and compute an expert at a time.
#[test]
fn several_devices_compute_one_expert_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let (mut engine, model) = engine(dir.path(), (8, 4), None, 2);
    assert_eq!(engine.expert_group(), 1);
    engine.step(&batch(&model, 0)).unwrap();
}
