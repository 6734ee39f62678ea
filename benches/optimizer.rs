//! Criterion benches of the AdamW kernels: every supported variant, fp32
//! (f32 grad, no copy) and mixed (bf16 grad, bf16 copy out), reported as
//! bytes moved (28 a param) so the figure reads against memory bandwidth.
//! `strata bench optim` measures the same through the thread pool, next to
//! a bandwidth ceiling taken in the same run.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::bf16;
use strata_optim::{adamw_step, AdamWHyper, CopyOut, GradRef, Kernel, StepScalars};

fn kernels(c: &mut Criterion) {
    // 4M params = 112 MB a step: well past the caches, short enough to repeat.
    let n = 4 << 20;
    let mut p = vec![0.1f32; n];
    let mut m = vec![0.0f32; n];
    let mut v = vec![0.0f32; n];
    let g32 = vec![0.01f32; n];
    let g16 = vec![bf16::from_f32(0.01); n];
    let mut copy = vec![bf16::ZERO; n];
    let scalars = StepScalars::new(&AdamWHyper::default(), 10, 1.0);

    let mut group = c.benchmark_group("adamw");
    group.throughput(Throughput::Bytes(28 * n as u64));
    group.sample_size(10);
    for kernel in Kernel::supported() {
        group.bench_function(BenchmarkId::new("fp32", kernel.name()), |b| {
            b.iter(|| {
                adamw_step(
                    kernel,
                    &scalars,
                    &mut p,
                    &mut m,
                    &mut v,
                    GradRef::F32(&g32),
                    CopyOut::None,
                )
                .unwrap()
            })
        });
        group.bench_function(BenchmarkId::new("mixed", kernel.name()), |b| {
            b.iter(|| {
                adamw_step(
                    kernel,
                    &scalars,
                    &mut p,
                    &mut m,
                    &mut v,
                    GradRef::Bf16(&g16),
                    CopyOut::Bf16(&mut copy),
                )
                .unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
