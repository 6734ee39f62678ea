//! The fuzz targets: each reads one kind of untrusted file from arbitrary
//! bytes, and must end in a value or an error, never a panic, an abort or
//! a hang. cargo-fuzz drives them (`fuzz_targets/`); `tests/fuzz_corpus.rs`
//! replays the committed corpus through them, and mutations of it, in CI.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use strata::lm::data::{Corpus, DataConfig, Dataset, Tokenizer};
use strata::lm::safetensors_io::Checkpoint;
use strata::lm::LmConfig;
use strata_tiers::io::{AlignedBuf, FileOptions, MemFile};
use strata_tiers::{Dtype, ExpertStore, Layout, Parts};

/// Work a target does on one input, at most: a store it opens is read
/// record by record only up to these sizes.
const RECORD_BYTES_MAX: u64 = 1 << 20;
const EXPERTS_MAX: u64 = 256;

/// An expert store file (superblocks, copy maps, record headers and
/// payloads): opened from memory, then every record read and checked.
pub fn store(data: &[u8]) {
    let device = Box::new(MemFile::from_bytes(data.to_vec()));
    let Ok(store) = ExpertStore::open_on(device, None) else {
        return;
    };
    let layout = store.layout();
    if layout.record_bytes() > RECORD_BYTES_MAX || layout.expert_count() > EXPERTS_MAX {
        return;
    }
    let mut buf = AlignedBuf::zeroed(layout.record_bytes() as usize);
    for slot in 0..layout.expert_count() {
        let _ = store.read(layout.expert_at(slot), Parts::Full, buf.as_mut_slice());
    }
}

/// The small store `dense` checks its dense files against: 2 × 2 experts
/// of 8 params, committed at step 3, in a directory kept for the process.
pub const DENSE_PARAMS: usize = 24;
pub const DENSE_STEP: u64 = 3;

pub fn seed_layout() -> Layout {
    Layout {
        layers: 2,
        experts_per_layer: 2,
        params_per_expert: 8,
        compute_dtype: Dtype::Bf16,
        moments: true,
    }
}

fn dense_store() -> &'static Path {
    static STORE: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, path) = STORE.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("s.strata");
        let store =
            ExpertStore::create(&path, seed_layout(), &FileOptions::default()).expect("a store");
        store.checkpoint(DENSE_STEP).expect("a commit");
        (dir, path)
    });
    path
}

/// A dense-state file (`<store>.dense-<step>`), checked against its store.
pub fn dense(data: &[u8]) {
    let store = dense_store();
    let path = store.with_file_name(format!("s.strata.dense-{DENSE_STEP}"));
    if std::fs::write(&path, data).is_ok() {
        let _ = strata::engine::verify_checkpoint(store, DENSE_PARAMS);
    }
}

fn scratch_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a temporary directory"))
        .path()
}

/// A safetensors file: its header parsed and every tensor read, as a
/// checkpoint import does.
pub fn safetensors(data: &[u8]) {
    let dir = scratch_dir().join("checkpoint");
    let _ = std::fs::create_dir_all(&dir);
    if std::fs::write(dir.join("model.safetensors"), data).is_err() {
        return;
    }
    let Ok(checkpoint) = Checkpoint::open(&dir) else {
        return;
    };
    let names: Vec<String> = checkpoint.tensor_names().map(str::to_string).collect();
    let mut out = vec![0f32; 64];
    for name in names {
        for shape in [&[64][..], &[8, 8], &[4, 16]] {
            let _ = checkpoint.read_f32(&name, shape, &mut out);
        }
    }
}

/// A Hugging Face `config.json`.
pub fn hf_config(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = LmConfig::from_hf_json(text);
    }
}

/// Training text: a `.jsonl` file (when the input starts with `{`) or
/// plain text, cut into a few batches of sequences.
pub fn data(data: &[u8]) {
    let name = match data.first() {
        Some(b'{') => "data.jsonl",
        _ => "data.txt",
    };
    let path = scratch_dir().join(name);
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let config = DataConfig {
        corpus: Corpus::Files(vec![path]),
        seq_len: 8,
        batch_seqs: 2,
        eval_every: 3,
        eval_seqs_max: 4,
        shuffle_buffer: 4,
        ..DataConfig::default()
    };
    let Ok(mut dataset) = Dataset::open(config, Tokenizer::Bytes) else {
        return;
    };
    for _ in 0..4 {
        if dataset.next_batch().is_err() {
            return;
        }
    }
    let _ = dataset.eval_batches();
}
