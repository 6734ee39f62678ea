//! Records the host tier keeps resident (`EngineConfig::host_stream_slots`)
//! leave the store's traffic: a streamed record is written back once a
//! step, a kept one only at checkpoints.

mod common;

use common::{batch, hyper, model, record_bytes};
use strata::engine::{Engine, EngineConfig};
use strata::math::ExpertKind;
use strata_tiers::Dtype;

const STEPS: usize = 6;

/// Bytes written to and read from the store over `STEPS` steps, and the
/// records kept.
fn traffic(stream: Option<usize>, dir: &std::path::Path) -> (u64, u64, usize) {
    let model = model(2, ExpertKind::SwiGlu);
    let expert_bytes = (model.expert_params() * 4) as u64;
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            store_path: Some(dir.join(format!("{stream:?}.strata"))),
            device_budget_bytes: 2 * expert_bytes,
            // 8 slots for 16 records.
            host_budget_bytes: 8 * record_bytes(&model),
            host_stream_slots: stream,
            compute_dtype: Dtype::F32,
            hyper: hyper(),
            optimizer_threads: 2,
            ..EngineConfig::default()
        },
    )
    .unwrap();
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
