//! Records the host tier keeps resident (`EngineConfig::host_stream_slots`)
//! leave the store's traffic: a streamed record is written back once a
//! step, a kept one only at checkpoints.

mod common;

use common::{batch, hyper, model, record_bytes};
use strata::engine::{Engine, EngineConfig};
use strata::math::ExpertKind;
use strata::model::ModelConfig;
use strata_tiers::Dtype;

const STEPS: usize = 6;

/// The test engine: 8 host slots for 16 records, `stream` of them
/// streaming; with 4 streaming, 4 keep layer 1's experts 0–3 and layer 1's
/// other 4 fit the streaming slots, so their updates may be deferred.
/// Each step is `micro_batches` micro-batches.
fn engine(
    dir: &std::path::Path,
    stream: Option<usize>,
    defer: bool,
    micro_batches: usize,
) -> (Engine, ModelConfig) {
    let model = model(2, ExpertKind::SwiGlu);
    let expert_bytes = (model.expert_params() * 4) as u64;
    let engine = Engine::new(
        model.clone(),
        EngineConfig {
            store_path: Some(dir.join(format!("{stream:?}-{defer}-{micro_batches}.strata"))),
            device_budget_bytes: 2 * expert_bytes,
            host_budget_bytes: 8 * record_bytes(&model),
            host_stream_slots: stream,
            defer_last_layer_updates: defer,
            compute_dtype: Dtype::F32,
            hyper: hyper(),
            optimizer_threads: 2,
            micro_batches,
            ..EngineConfig::default()
        },
    )
    .unwrap();
    (engine, model)
}

/// Bytes written to and read from the store over `STEPS` steps, and the
/// records kept.
fn traffic(stream: Option<usize>, dir: &std::path::Path) -> (u64, u64, usize) {
    let (mut engine, model) = engine(dir, stream, true, 1);
    let (mut written, mut read) = (0, 0);
    for s in 0..STEPS {
        let m = engine.step(&batch(&model, s)).unwrap();
        written += m.bytes_host_to_ssd;
        read += m.bytes_ssd_to_host;
    }
    (written, read, engine.host_kept())
}

#[test]
fn kept_records_are_neither_read_nor_written_back_each_step() {
    let dir = tempfile::tempdir().unwrap();
    let record = record_bytes(&model(2, ExpertKind::SwiGlu));
    let (written_all, read_all, kept_none) = traffic(None, dir.path());
    let (written_kept, read_kept, kept) = traffic(Some(4), dir.path());
    eprintln!(
        "records of {record} B; every slot streaming: {written_all} B written, {read_all} read; \
         4 kept: {written_kept} written, {read_kept} read"
    );
    assert_eq!((kept_none, kept), (0, 4));
    // Streaming through every slot, each of the 16 records is evicted,
    // so written back, once a step (the first step's first evictions may
    // find records not yet updated, hence one step's slack).
    assert!(
        written_all >= 16 * record * (STEPS as u64 - 1),
        "{written_all} bytes written, records of {record}"
    );
    // Keeping 4, only the other 12 are; early write-backs of the last
    // step's records may fall into the next, hence a little slack either way.
    assert!(
        written_kept <= 12 * record * (STEPS as u64 + 1),
        "{written_kept} bytes written, records of {record}"
    );
    assert!(written_kept < written_all && read_kept < read_all);
}

/// Every expert's params after `STEPS` steps at a changing learning rate,
/// and how many experts' updates were deferred.
fn params_after(
    defer: bool,
    micro_batches: usize,
    dir: &std::path::Path,
) -> (Vec<Vec<f32>>, usize) {
    let (mut engine, model) = engine(dir, Some(4), defer, micro_batches);
    for s in 0..STEPS {
        // A learning rate that changes every step, as schedules do: a held
        // update takes the rate of the step whose gradient it applies.
        engine.set_lr(1e-3 * (1 + s % 3) as f32).unwrap();
        engine.step(&batch(&model, s)).unwrap();
    }
    let deferred = engine.deferred_updates();
    // Reading params applies the updates still held.
    let params = (0..model.layers)
        .flat_map(|l| (0..model.experts).map(move |e| (l, e)))
        .map(|(l, e)| engine.expert_params(l, e).unwrap())
        .collect();
    (params, deferred)
}

/// Also where gradients sum over micro-batches: the held update is of the
/// summed gradient, applied before the next step's first micro-batch.
#[test]
fn deferred_updates_change_no_bit() {
    let dir = tempfile::tempdir().unwrap();
    let bits = |p: &[Vec<f32>]| -> Vec<Vec<u32>> {
        p.iter()
            .map(|v| v.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    for micro_batches in [1, 2] {
        let (plain, none) = params_after(false, micro_batches, dir.path());
        let (deferred, count) = params_after(true, micro_batches, dir.path());
        assert_eq!((none, count), (0, 4), "{micro_batches} micro-batches");
        assert!(
            bits(&plain) == bits(&deferred),
            "the last layer's deferred updates changed params with {micro_batches} \
             micro-batches"
        );
    }
}
