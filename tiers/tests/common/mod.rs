//! What the host tier's tests share: a small layout, a store holding
//! every expert at version 0, and checks of what a guard or the store
//! reads against each expert's content at a version.

#![allow(dead_code)] // each test file uses its own share of these

pub mod store_files;

use std::sync::Arc;

use strata_tiers::io::{AlignedBuf, MemFile};
use strata_tiers::{
    record_mut, Dtype, ExpertId, ExpertStore, Layout, Parts, ReadGuard, WriteGuard,
};

pub fn layout(experts: u32) -> Layout {
    Layout {
        layers: 1,
        experts_per_layer: experts,
        params_per_expert: 700,
        compute_dtype: Dtype::Bf16,
        moments: true,
    }
}

/// Content of an expert at a version: compute bytes and state floats.
pub fn compute_of(e: ExpertId, version: u64, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| ((e.index as u64 * 37 + version * 11 + i as u64) % 251) as u8)
        .collect()
}

pub fn master_of(e: ExpertId, version: u64) -> f32 {
    e.index as f32 * 100.0 + version as f32
}

pub fn fill(layout: &Layout, e: ExpertId, version: u64, buf: &mut [u8]) {
    let r = record_mut(layout, buf).unwrap();
    let n = r.compute.len();
    r.compute.copy_from_slice(&compute_of(e, version, n));
    r.master.fill(master_of(e, version));
    r.m.fill(version as f32);
    r.v.fill(1.0);
}

/// A store with every expert written at version 0 and committed.
pub fn populated(layout: Layout) -> Arc<ExpertStore> {
    let store = ExpertStore::create_on(Box::new(MemFile::new()), layout).unwrap();
    let mut buf = AlignedBuf::zeroed(layout.record_bytes() as usize);
    for i in 0..layout.experts_per_layer {
        let e = ExpertId::new(0, i);
        fill(&layout, e, 0, buf.as_mut_slice());
        store.write(e, 0, buf.as_mut_slice()).unwrap();
    }
    store.checkpoint(0).unwrap();
    Arc::new(store)
}

pub fn check_read(layout: &Layout, g: &ReadGuard, version: u64) {
    let e = g.expert();
    let n = layout.compute_payload_bytes() as usize;
    assert_eq!(
        g.compute(),
        &compute_of(e, version, n)[..],
        "expert {e} v{version}"
    );
    if let Some((master, m, _)) = g.state() {
        assert!(
            master.iter().all(|&x| x == master_of(e, version)),
            "expert {e}"
        );
        assert!(m.iter().all(|&x| x == version as f32));
    }
}

pub fn set_version(g: &mut WriteGuard, e: ExpertId, version: u64) {
    let r = g.record_mut();
    let n = r.compute.len();
    r.compute.copy_from_slice(&compute_of(e, version, n));
    r.master.fill(master_of(e, version));
    r.m.fill(version as f32);
}

/// `e`'s record reads back from the store, verified, at `version`.
pub fn check_stored(store: &ExpertStore, e: ExpertId, version: u64) {
    let layout = store.layout();
    let mut buf = AlignedBuf::zeroed(layout.record_bytes() as usize);
    assert_eq!(
        store.read(e, Parts::Full, buf.as_mut_slice()).unwrap(),
        version
    );
    let r = record_mut(&layout, buf.as_mut_slice()).unwrap();
    assert_eq!(&r.compute[..], &compute_of(e, version, r.compute.len())[..]);
    assert!(r.master.iter().all(|&x| x == master_of(e, version)));
}
