//! The fuzz targets of `fuzz/` on stable, in every CI run: the committed
//! corpus replayed (the seeds and what cargo-fuzz kept), then mutations of
//! each seed (bit flips, bytes overwritten, lengths and counts set to
//! extremes, cuts, insertions). Every
//! input must end in a value or an error: a panic fails the test and names
//! the input, which is written to `target/fuzz-findings/`; a hang fails it
//! by its watchdog. The long coverage-guided runs are cargo-fuzz's
//! (docs/testing.md, "Fuzzing").
//!
//! `STRATA_FUZZ_MUTATIONS=N` sets the mutations a seed (default 1000);
//! `STRATA_FUZZ_WRITE_SEEDS=1` rewrites the seed files of the corpus.

mod common;

#[path = "../fuzz/src/lib.rs"]
mod targets;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Duration;

type Target = fn(&[u8]);

const TARGETS: [(&str, Target); 5] = [
    ("store", targets::store),
    ("dense", targets::dense),
    ("safetensors", targets::safetensors),
    ("hf_config", targets::hf_config),
    ("data", targets::data),
];

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

/// splitmix64: the same mutations on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One mutation of `input`.
fn mutate(input: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut out = input.to_vec();
    let len = out.len();
    match rng.below(6) {
        0 if len > 0 => {
            let at = rng.below(len);
            out[at] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            for _ in 0..1 + rng.below(8) {
                let at = rng.below(len);
                out[at] = rng.next() as u8;
            }
        }
        2 if len >= 8 => {
            // A length, count or offset field set to an extreme.
            let at = rng.below(len / 8) * 8;
            let extreme = [0u64, 1, u64::MAX, 1 << 40, u32::MAX as u64, 4096][rng.below(6)];
            out[at..at + 8].copy_from_slice(&extreme.to_le_bytes());
        }
        3 => out.truncate(rng.below(len + 1)),
        4 if len > 0 => {
            let from = rng.below(len);
            let to = (from + 1 + rng.below(64)).min(len);
            let chunk = out[from..to].to_vec();
            let at = rng.below(len);
            out.splice(at..at, chunk);
        }
        _ => {
            let at = rng.below(len + 1);
            let bytes: Vec<u8> = (0..1 + rng.below(16)).map(|_| rng.next() as u8).collect();
            out.splice(at..at, bytes);
        }
    }
    out
}

/// Runs `target` on `input`; a panic fails the test, naming the input and
/// keeping it under `target/fuzz-findings/`.
fn must_not_panic(name: &str, target: Target, input: &[u8], what: &str) {
    if catch_unwind(AssertUnwindSafe(|| target(input))).is_err() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-findings");
        let _ = std::fs::create_dir_all(&dir);
        let path = dir.join(format!("{name}-{}", what.replace(['/', ' '], "_")));
        let _ = std::fs::write(&path, input);
        panic!(
            "fuzz target {name} panicked on {what} (input kept in {})",
            path.display()
        );
    }
}

#[test]
fn every_corpus_input_and_its_mutations_end_in_a_value_or_an_error() {
    if std::env::var_os("STRATA_FUZZ_WRITE_SEEDS").is_some() {
        seeds::write();
    }
    let mutations: usize = std::env::var("STRATA_FUZZ_MUTATIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000);
    common::bounded("the fuzz corpus", Duration::from_secs(600), move || {
        for (name, target) in TARGETS {
            let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir(name))
                .unwrap_or_else(|e| panic!("fuzz/corpus/{name}: {e}"))
                .map(|e| e.unwrap().path())
                .collect();
            files.sort();
            assert!(!files.is_empty(), "fuzz/corpus/{name} is empty");
            let mut rng = Rng(0x5eed);
            for file in &files {
                let input = std::fs::read(file).unwrap();
                let label = file.file_name().unwrap().to_string_lossy().into_owned();
                must_not_panic(name, target, &input, &label);
                // cargo-fuzz's finds are replayed; the seeds are mutated.
                if !label.starts_with("seed-") {
                    continue;
                }
                for k in 0..mutations {
                    let mutated = mutate(&input, &mut rng);
                    must_not_panic(name, target, &mutated, &format!("{label} mutation {k}"));
                }
            }
            eprintln!(
                "{name}: {} corpus files, {mutations} mutations each",
                files.len()
            );
        }
    });
}

/// The seed inputs of the corpus: one valid file of each kind.
mod seeds {
    use super::*;
    use strata::lm::LmConfig;
    use strata_tiers::io::{AlignedBuf, FileOptions};
    use strata_tiers::ExpertStore;

    fn put(target: &str, name: &str, bytes: &[u8]) {
        let dir = corpus_dir(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(name), bytes).unwrap();
    }

    pub fn write() {
        let dir = tempfile::tempdir().unwrap();

        // A store with every record written and committed.
        let layout = targets::seed_layout();
        let path = dir.path().join("seed.strata");
        let store = ExpertStore::create(&path, layout, &FileOptions::default()).unwrap();
        let count = layout.expert_count() as usize;
        let mut region = AlignedBuf::zeroed(count * layout.record_bytes() as usize);
        region
            .as_mut_slice()
            .iter_mut()
            .enumerate()
            .for_each(|(k, x)| *x = (k % 7) as u8);
        let mut writes: Vec<_> = region
            .as_mut_slice()
            .chunks_exact_mut(layout.record_bytes() as usize)
            .enumerate()
            .map(|(k, b)| (layout.expert_at(k as u64), 1, b))
            .collect();
        store.write_many(&mut writes).unwrap();
        store.checkpoint(1).unwrap();
        drop(store);
        put("store", "seed-committed", &std::fs::read(&path).unwrap());

        // A dense file of the `dense` target's store (docs/formats.md).
        let n = targets::DENSE_PARAMS;
        let mut dense = Vec::new();
        dense.extend_from_slice(b"STRATADN");
        dense.extend_from_slice(&1u32.to_le_bytes());
        dense.extend_from_slice(&targets::DENSE_STEP.to_le_bytes());
        dense.extend_from_slice(&7u64.to_le_bytes());
        dense.extend_from_slice(&(n as u64).to_le_bytes());
        for k in 0..3 * n {
            dense.extend_from_slice(&(k as f32 * 0.25).to_le_bytes());
        }
        let crc = crc32c::crc32c(&dense);
        dense.extend_from_slice(&crc.to_le_bytes());
        put("dense", "seed-valid", &dense);

        // A safetensors file of two tensors.
        let values: Vec<u8> = (0..64).flat_map(|k| (k as f32).to_le_bytes()).collect();
        let halves: Vec<u8> = (0..64u16).flat_map(|k| k.to_le_bytes()).collect();
        let a = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![8, 8], &values)
            .unwrap();
        let b = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![64], &halves)
            .unwrap();
        let bytes = safetensors::serialize([("a.weight", a), ("b.weight", b)], &None).unwrap();
        put("safetensors", "seed-two-tensors", &bytes);

        put(
            "hf_config",
            "seed-tiny",
            LmConfig::preset("tiny").unwrap().to_hf_json().as_bytes(),
        );

        let jsonl = (0..12)
            .map(|k| format!("{{\"text\": \"document {k}: {}\"}}\n", "ab".repeat(k)))
            .collect::<String>();
        put("data", "seed-jsonl", jsonl.as_bytes());
        put(
            "data",
            "seed-text",
            "plain text, one document\n".repeat(6).as_bytes(),
        );
    }
}
