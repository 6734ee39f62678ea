//! Criterion bench of one engine step of the `tiny` language model on the
//! cpu backend, two ways: every expert resident, and its records
//! streaming from a store file through a host tier of a quarter of them.
//! The difference is what the tiers cost a step when the disk is the page
//! cache; `strata bench step` measures the schedule against its bounds.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use strata::engine::{Engine, EngineConfig};
use strata::lm::{LmConfig, MoeLm, TokenBatch};

fn step(c: &mut Criterion) {
    let lm = MoeLm::new(LmConfig::preset("tiny").unwrap()).unwrap();
    let batch = TokenBatch {
        seq_len: 32,
        tokens: (0..8 * 33u32).map(|i| (i * 37 + 11) % 256).collect(),
        loss_mask: None,
        doc_starts: None,
    };
    let tokens = 8 * 32;
    let dir = tempfile::tempdir().unwrap();
    let record = {
        let moe = lm.config().moe();
        // bf16 compute copy, then f32 master, m and v, each part 4 KiB-aligned.
        let p = moe.expert_params() as u64;
        (2 * p + 64).div_ceil(4096) * 4096 + (12 * p + 64).div_ceil(4096) * 4096
    };
    let records = (lm.config().layers * lm.config().experts) as u64;
    let configs = [
        (
            "resident",
            EngineConfig {
                device_budget_bytes: 64 << 20,
                host_budget_bytes: 256 << 20,
                ..EngineConfig::default()
            },
        ),
        (
            "streaming from a store file",
            EngineConfig {
                device_budget_bytes: 64 << 20,
                host_budget_bytes: records / 4 * record,
                host_stream_slots: Some(records as usize / 4),
                store_path: Some(dir.path().join("bench.strata")),
                ..EngineConfig::default()
            },
        ),
    ];
    let mut group = c.benchmark_group("engine_step");
    group.throughput(Throughput::Elements(tokens));
    group.sample_size(10);
    for (name, config) in configs {
        let mut engine = Engine::new_network(&lm, config).unwrap();
        group.bench_function(BenchmarkId::new("tiny", name), |b| {
            b.iter(|| engine.step_network(&lm, &batch).unwrap().loss)
        });
    }
    group.finish();
}

criterion_group!(benches, step);
criterion_main!(benches);
