//! What the store's tests share: a small layout of two layers, each
//! expert's content at a step, and a device a store and its test share.

use std::sync::Arc;

use strata_tiers::io::{AlignedBuf, RecordDevice};
use strata_tiers::{record_mut, Dtype, ExpertId, ExpertStore, Layout, Parts, TierError};

pub fn layout() -> Layout {
    Layout {
        layers: 2,
        experts_per_layer: 3,
        params_per_expert: 1500,
        compute_dtype: Dtype::Bf16,
        moments: true,
    }
}

pub fn experts(layout: &Layout) -> Vec<ExpertId> {
    (0..layout.layers)
        .flat_map(|l| (0..layout.experts_per_layer).map(move |i| ExpertId::new(l, i)))
        .collect()
}

/// Deterministic content of `expert` as of `step`.
pub fn fill(layout: &Layout, expert: ExpertId, step: u64, buf: &mut [u8]) {
    let seed = (expert.layer as u64 * 131 + expert.index as u64) * 1_000_003 + step * 7919;
    let r = record_mut(layout, buf).unwrap();
    for (i, b) in r.compute.iter_mut().enumerate() {
        *b = (seed.wrapping_add(i as u64 * 31) % 251) as u8;
    }
    for (i, x) in r.master.iter_mut().enumerate() {
        *x = (seed % 1000) as f32 + i as f32;
    }
    r.m.fill(step as f32);
    r.v.fill(-(step as f32));
}

pub fn check(layout: &Layout, expert: ExpertId, step: u64, buf: &mut [u8]) {
    let mut want = AlignedBuf::zeroed(layout.record_bytes() as usize);
    fill(layout, expert, step, want.as_mut_slice());
    let want = record_mut(layout, want.as_mut_slice()).unwrap();
    let got = record_mut(layout, buf).unwrap();
    assert_eq!(
        got.compute, want.compute,
        "expert {expert} step {step}: compute"
    );
    assert_eq!(
        got.master, want.master,
        "expert {expert} step {step}: master"
    );
    assert_eq!(got.m, want.m, "expert {expert} step {step}: m");
    assert_eq!(got.v, want.v, "expert {expert} step {step}: v");
}

/// Writes every expert in `which` at `step`.
pub fn write_step(store: &ExpertStore, which: &[ExpertId], step: u64) -> Result<(), TierError> {
    let layout = store.layout();
    let mut buf = AlignedBuf::zeroed(layout.record_bytes() as usize);
    for &e in which {
        fill(&layout, e, step, buf.as_mut_slice());
        store.write(e, step, buf.as_mut_slice())?;
    }
    Ok(())
}

/// Reads every expert back and checks it against the step it should hold.
pub fn check_all(store: &ExpertStore, expected_step: impl Fn(ExpertId) -> u64) {
    let layout = store.layout();
    let mut buf = AlignedBuf::zeroed(layout.record_bytes() as usize);
    for e in experts(&layout) {
        let step = store.read(e, Parts::Full, buf.as_mut_slice()).unwrap();
        assert_eq!(step, expected_step(e), "expert {e}");
        check(&layout, e, step, buf.as_mut_slice());
    }
}

/// Shares one device between a store and the test.
pub struct Shared<D>(pub Arc<D>);

impl<D: RecordDevice> RecordDevice for Shared<D> {
    fn engine(&self) -> &'static str {
        self.0.engine()
    }
    fn read_batch(&self, ops: &mut [strata_tiers::io::ReadOp<'_>]) -> Result<(), TierError> {
        self.0.read_batch(ops)
    }
    fn write_batch(&self, ops: &[strata_tiers::io::WriteOp<'_>]) -> Result<(), TierError> {
        self.0.write_batch(ops)
    }
    fn sync(&self) -> Result<(), TierError> {
        self.0.sync()
    }
    fn len_bytes(&self) -> Result<u64, TierError> {
        self.0.len_bytes()
    }
    fn set_len_bytes(&self, bytes: u64) -> Result<(), TierError> {
        self.0.set_len_bytes(bytes)
    }
}
