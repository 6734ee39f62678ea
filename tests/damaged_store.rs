//! A damaged store or dense file, read back by a resumed engine: each ends
//! in an error that names what is damaged, within a bound, never in a hang
//! (the store case runs under a watchdog). `train --resume` on a damaged
//! record: `app/tests/damaged_run.rs`.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::tiny_lm::tiny_config;
use common::{bounded, damage_record, flip_byte};
use strata::engine::{Engine, EngineConfig};
use strata::lm::{MoeLm, TokenBatch};
use strata_tiers::Dtype;

/// Far above what any case here takes (well under a second each).
const BOUND: Duration = Duration::from_secs(60);

fn batch(step: u64) -> TokenBatch {
    let seq_len = 8;
    let tokens = (0..4 * (seq_len as u64 + 1))
        .map(|i| ((i * 37 + step * 11) % 200) as u32)
        .collect();
    TokenBatch {
        seq_len,
        tokens,
        loss_mask: None,
        doc_starts: None,
    }
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

/// Resumes `store` and steps until a step fails (its first read of the
/// damaged `what` may come in the first step or a later one), under the
/// watchdog; the error's text.
fn first_step_error(store: PathBuf, what: &'static str) -> String {
    bounded(&format!("steps on {what}"), BOUND, move || {
        let lm = MoeLm::new(tiny_config()).unwrap();
        let mut engine = Engine::resume_network(&lm, engine_config(store)).unwrap();
        let failed = (2..5).find_map(|s| engine.step_network(&lm, &batch(s)).err());
        failed
            .unwrap_or_else(|| panic!("{what} is read without an error"))
            .to_string()
    })
}

/// Trains two steps into `store` and commits them.
fn trained_store(store: &Path) {
    let lm = MoeLm::new(tiny_config()).unwrap();
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
    let err = first_step_error(store, "a damaged record");
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
    let lm = MoeLm::new(tiny_config()).unwrap();
    let err = Engine::resume_network(&lm, engine_config(store))
        .err()
        .expect("a damaged dense file is read without an error")
        .to_string();
    assert!(
        err.contains("experts.strata.dense-2") && err.contains("checksum mismatch"),
        "{err}"
    );
}

/// Trains four steps into `store`, committing at steps 2 and 4.
fn store_with_two_checkpoints(store: &Path) {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let mut engine = Engine::new_network(&lm, engine_config(store.to_path_buf())).unwrap();
    for s in 0..4 {
        engine.step_network(&lm, &batch(s)).unwrap();
        if s % 2 == 1 {
            engine.checkpoint().unwrap();
        }
    }
}

/// Which superblock copy (0: A, 1: B) holds the newest generation, and
/// that generation.
fn newest_superblock(store: &Path) -> (u64, u64) {
    use strata_tiers::format::{Superblock, BLOCK_BYTES};
    let bytes = std::fs::read(store).unwrap();
    (0..2u64)
        .filter_map(|which| {
            let at = which as usize * BLOCK_BYTES;
            Superblock::decode(&bytes[at..at + BLOCK_BYTES])
                .unwrap()
                .map(|sb| (which, sb.generation))
        })
        .max_by_key(|&(_, generation)| generation)
        .unwrap()
}

/// Resumes `store`, says what it noted, and takes one more step.
fn resume_and_step(store: &Path) -> (u64, Vec<String>) {
    let lm = MoeLm::new(tiny_config()).unwrap();
    let mut engine = Engine::resume_network(&lm, engine_config(store.to_path_buf()))
        .unwrap_or_else(|e| panic!("the fallback does not resume: {e}"));
    let at = engine.steps();
    engine.step_network(&lm, &batch(at)).unwrap();
    (at, engine.notes().to_vec())
}

#[test]
fn a_damaged_newest_superblock_falls_back_to_the_previous_checkpoint_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("experts.strata");
    store_with_two_checkpoints(&store);
    let (which, _) = newest_superblock(&store);
    // The committed step's field, inside the checksummed bytes.
    flip_byte(&store, which * 4096 + 24);
    let (at, notes) = resume_and_step(&store);
    assert_eq!(at, 2, "{notes:?}");
    let said = notes.join("\n");
    let copy = ["A", "B"][which as usize];
    assert!(
        said.contains(&format!("superblock {copy} is damaged")),
        "{said}"
    );
    assert!(said.contains("checkpoint at step 2"), "{said}");
}

#[test]
fn a_damaged_newest_copy_map_falls_back_to_the_previous_checkpoint_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("experts.strata");
    store_with_two_checkpoints(&store);
    let (which, generation) = newest_superblock(&store);
    let layout = strata_tiers::ExpertStore::open(&store, None, &Default::default())
        .unwrap()
        .layout();
    flip_byte(&store, layout.map_offset(which as usize) + 3);
    let (at, notes) = resume_and_step(&store);
    assert_eq!(at, 2, "{notes:?}");
    let said = notes.join("\n");
    assert!(
        said.contains(&format!(
            "copy map of generation {generation} (checkpoint at step 4)"
        )),
        "{said}"
    );
    assert!(said.contains("previous checkpoint, at step 2"), "{said}");
}

#[test]
fn both_superblocks_damaged_is_an_error_that_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("experts.strata");
    store_with_two_checkpoints(&store);
    flip_byte(&store, 24);
    flip_byte(&store, 4096 + 24);
    let lm = MoeLm::new(tiny_config()).unwrap();
    let err = Engine::resume_network(&lm, engine_config(store))
        .err()
        .expect("a store with no intact superblock opens")
        .to_string();
    assert!(err.contains("neither superblock is intact"), "{err}");
}

#[test]
fn a_damaged_state_part_fails_the_update_naming_the_expert() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("experts.strata");
    trained_store(&store);
    let layout = strata_tiers::ExpertStore::open(&store, None, &Default::default())
        .unwrap()
        .layout();
    let state = layout.compute_part_bytes() + strata_tiers::format::PART_HEADER_BYTES as u64 + 5;
    for copy in 0..2 {
        flip_byte(&store, layout.record_offset(1, copy) + state);
    }
    let err = first_step_error(store, "a damaged state part");
    assert!(
        err.contains("expert 0.1") && err.contains("checksum"),
        "the error names neither the expert nor the checksum: {err}"
    );
}
