//! Criterion bench of the SSD tier's record reads: eight 4 MiB records
//! (1M bf16 params each, their master and moments) read whole in one
//! batch through `ExpertStore::read_many`, checksums verified, as the
//! prefetcher issues them. The file is fresh in the page cache, so this
//! measures the read path's own cost (I/O engine, copies, CRCs); `strata
//! bench tiers` measures a real disk against fio.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use strata_tiers::io::{AlignedBuf, FileOptions};
use strata_tiers::{record_mut, Dtype, ExpertId, ExpertStore, Layout, Parts};

fn reads(c: &mut Criterion) {
    let layout = Layout {
        layers: 1,
        experts_per_layer: 8,
        params_per_expert: 1 << 20,
        compute_dtype: Dtype::Bf16,
        moments: true,
    };
    let dir = tempfile::tempdir().unwrap();
    let store = ExpertStore::create(
        &dir.path().join("bench.strata"),
        layout,
        &FileOptions::default(),
    )
    .unwrap();
    let record = layout.record_bytes() as usize;
    let experts: Vec<ExpertId> = (0..8).map(|i| ExpertId::new(0, i)).collect();
    for &e in &experts {
        let mut buf = AlignedBuf::zeroed(record);
        let r = record_mut(&layout, buf.as_mut_slice()).unwrap();
        r.master.fill(0.5 + e.index as f32);
        store.write(e, 1, buf.as_mut_slice()).unwrap();
    }
    store.checkpoint(1).unwrap();
    let mut bufs: Vec<AlignedBuf> = experts.iter().map(|_| AlignedBuf::zeroed(record)).collect();

    let mut group = c.benchmark_group("record_reads");
    group.throughput(Throughput::Bytes((record * experts.len()) as u64));
    group.sample_size(10);
    group.bench_function("8 full records in one batch", |b| {
        b.iter(|| {
            let mut requests: Vec<(ExpertId, Parts, &mut [u8])> = experts
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&e, buf)| (e, Parts::Full, buf.as_mut_slice()))
                .collect();
            store.read_many(&mut requests).unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, reads);
criterion_main!(benches);
