//! A damaged store or dense file, read back by a resumed engine and by
//! `train --resume`: each ends in an error that names what is damaged,
//! within a bound, never in a hang (every case runs under a watchdog).

mod common;

use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use common::bounded;
use common::tiny_lm::{small_flags, tiny_config, write_checkpoint};
use strata::engine::{Engine, EngineConfig};
use strata::lm::{MixtralLm, TokenBatch};
use strata::trainer::{self, Source, TrainFlags};
use strata_tiers::format::PART_HEADER_BYTES;
use strata_tiers::io::FileOptions;
use strata_tiers::{Dtype, ExpertStore};

/// Far above what any case here takes (well under a second each).
const BOUND: Duration = Duration::from_secs(60);

fn flip_byte(path: &Path, at: u64) {
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut byte).unwrap();
    byte[0] ^= 0x40;
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&byte).unwrap();
}

/// Flips a byte of `slot`'s compute params in both copies of its record,
/// so whichever copy is committed is damaged.
fn damage_record(store: &Path, slot: u64) {
    let layout = ExpertStore::open(store, None, &FileOptions::default())
        .unwrap()
        .layout();
    for copy in 0..2 {
        flip_byte(
            store,
            layout.record_offset(slot, copy) + PART_HEADER_BYTES as u64 + 5,
        );
    }
}

fn batch(step: u64) -> TokenBatch {
    let seq_len = 8;
    let tokens = (0..4 * (seq_len as u64 + 1))
        .map(|i| ((i * 37 + step * 11) % 200) as u32)
        .collect();
    TokenBatch { seq_len, tokens }
}

/// Room for two of the eight records: every step streams from the store.
fn engine_config(store: PathBuf) -> EngineConfig {
    let moe = tiny_config().moe();
    let record = common::record_bytes(&moe);
    EngineConfig {
        store_path: Some(store),
        compute_dtype: Dtype::F32,
        device_budget_bytes: 2 * (moe.expert_params() * 4) as u64,
        host_budget_bytes: 3 * record,
        host_stream_slots: Some(3),
        optimizer_threads: 1,
        ..EngineConfig::default()
    }
}

/// Trains two steps into `store` and commits them.
fn trained_store(store: &Path) {
    let lm = MixtralLm::new(tiny_config()).unwrap();
    let mut engine = Engine::new_network(&lm, engine_config(store.to_path_buf())).unwrap();
    for s in 0..2 {
        engine.step_network(&lm, &batch(s)).unwrap();
    }
    engine.checkpoint().unwrap();
}

#[test]
fn a_damaged_record_fails_the_resumed_engine_s_step_naming_the_expert() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("experts.strata");
    trained_store(&store);
    damage_record(&store, 0);
    let err = bounded("a step on a damaged record", BOUND, move || {
        let lm = MixtralLm::new(tiny_config()).unwrap();
        let mut engine = Engine::resume_network(&lm, engine_config(store)).unwrap();
        let mut last = Ok(());
        // Its first read may come in the first step or the next.
        for s in 2..5 {
            last = engine.step_network(&lm, &batch(s)).map(|_| ());
            if last.is_err() {
                break;
            }
        }
        last.expect_err("a damaged record is read without an error")
            .to_string()
    });
    eprintln!("{err}");
    assert!(
        err.contains("expert 0.0") && err.contains("checksum"),
        "the error names neither the expert nor the checksum: {err}"
    );
}

#[test]
fn a_damaged_dense_file_fails_the_resume_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("experts.strata");
    trained_store(&store);
    let dense = dir.path().join("experts.strata.dense-2");
    let len = std::fs::metadata(&dense).unwrap().len();
    flip_byte(&dense, len / 2);
    let lm = MixtralLm::new(tiny_config()).unwrap();
    let err = Engine::resume_network(&lm, engine_config(store))
        .err()
        .expect("a damaged dense file is read without an error")
        .to_string();
    assert!(
        err.contains("experts.strata.dense-2") && err.contains("checksum mismatch"),
        "{err}"
    );
}

#[test]
fn train_resume_on_a_damaged_record_stops_with_an_error_naming_the_expert() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let model = dir.path().join("model");
    write_checkpoint(&model, &tiny_config());
    let first = TrainFlags {
        steps: Some(2),
        eval_every: Some(0),
        ..small_flags(&out)
    };
    trainer::run(&first, Source::Finetune(model), &AtomicBool::new(false)).unwrap();
    damage_record(&out.join("experts.strata"), 0);
    let again = TrainFlags {
        resume: true,
        steps: Some(4),
        ..small_flags(&out)
    };
    let err = bounded("train --resume on a damaged record", BOUND, move || {
        trainer::run(&again, Source::Scratch, &AtomicBool::new(false))
            .expect_err("the damaged record is read without an error")
    });
    eprintln!("{err}");
    assert!(
        err.contains("expert 0.0") && err.contains("checksum"),
        "the error names neither the expert nor the checksum: {err}"
    );
}
