//! Criterion bench of per-layer expert placement (greedy LPT over the
//! global token counts), at the shapes a step places every layer:
//! 64 experts on 8 devices, a quarter of them pinned. It runs once per
//! layer per step on every device, so it must stay far below a layer's
//! compute (microseconds against milliseconds).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use strata::placement::{CostModel, LptPlacer};

fn placement(c: &mut Criterion) {
    let cost = CostModel {
        upload_s: 2e-3,
        per_token_s: 1e-6,
        fixed_s: 5e-5,
    };
    let mut group = c.benchmark_group("placement");
    for (experts, devices) in [(8usize, 2usize), (64, 8), (256, 8)] {
        // A skewed load, as routing gives: a few hot experts.
        let tokens: Vec<u32> = (0..experts)
            .map(|e| (4096 / (1 + e % 17)) as u32 + (e as u32 * 7919) % 64)
            .collect();
        let resident: Vec<Option<u16>> = (0..experts)
            .map(|e| (e % 4 == 0).then_some((e % devices) as u16))
            .collect();
        let mut owner = vec![0u16; experts];
        let mut placer = LptPlacer::new(experts, devices);
        group.bench_function(
            BenchmarkId::new("lpt", format!("{experts}x{devices}")),
            |b| b.iter(|| placer.place(&tokens, &resident, &cost, &mut owner)[0]),
        );
    }
    group.finish();
}

criterion_group!(benches, placement);
criterion_main!(benches);
