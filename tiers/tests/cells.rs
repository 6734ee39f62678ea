//! Compute cells (`HostCacheConfig::cell_slots`): experts read for their
//! compute params alone take a cell, a full access moves them to a record
//! slot without waiting on the cell's readers, and the prefetcher moves a
//! clean record next read for its compute params into a cell when a record
//! slot is wanted — with every read returning the expert's current bytes.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use strata_tiers::{ExpertId, ExpertStore, HostCache, HostCacheConfig, Parts, TierError};

/// A host tier of `record_slots` record slots and one slot's worth of
/// compute cells over `experts` experts, looking `ahead` accesses ahead.
fn with_cells(experts: u32, record_slots: u64, ahead: usize) -> (Arc<ExpertStore>, HostCache) {
    let layout = layout(experts);
    let store = populated(layout);
    let cache = HostCache::new(
        Arc::clone(&store),
        HostCacheConfig {
            host_budget_bytes: (record_slots + 1) * layout.record_bytes(),
            cell_slots: 1,
            prefetch_ahead_max: ahead,
            ..HostCacheConfig::default()
        },
    )
    .unwrap();
    (store, cache)
}

fn ids(n: u32) -> Vec<ExpertId> {
    (0..n).map(|i| ExpertId::new(0, i)).collect()
}

/// Waits (at most 20 s) for the prefetcher to reach `done`.
fn wait_for(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn compute_reads_take_cells_and_full_access_takes_a_record_slot() {
    let layout = layout(8);
    let e = ids(8);
    let (store, cache) = with_cells(8, 2, 0);
    // A bf16 record of 700 params is 4 compute parts.
    assert_eq!((cache.slot_count(), cache.cell_count()), (2, 4));
    let held: Vec<_> = e[..4]
        .iter()
        .map(|&x| cache.acquire(x, Parts::Compute).unwrap())
        .collect();
    assert_eq!(cache.cells_resident().len(), 4);
    for g in &held {
        check_read(&layout, g, 0);
    }
    // The cells are all pinned; the record slots take compute reads too.
    let more = cache.acquire(e[4], Parts::Compute).unwrap();
    assert!(!cache.cells_resident().contains(&e[4]));
    drop(more);

    // A writer of an expert read from a cell neither waits for the
    // cell's reader nor changes its bytes: it takes a record slot, where
    // later reads find the new version. The compute part is copied from
    // the cell, so only the state part is read.
    let state = layout.record_bytes() - layout.compute_part_bytes();
    let before = cache.stats();
    let mut w = cache.acquire_mut(e[1]).unwrap();
    assert_eq!(cache.stats().bytes_read - before.bytes_read, state);
    set_version(&mut w, e[1], 3);
    w.seal(3);
    drop(w);
    check_read(&layout, &held[1], 0);
    let g = cache.acquire(e[1], Parts::Compute).unwrap();
    check_read(&layout, &g, 3);
    drop(g);
    assert!(!cache.cells_resident().contains(&e[1]));

    // The cell it left is free once its reader is done.
    drop(held);
    let g = cache.acquire(e[5], Parts::Compute).unwrap();
    assert!(cache.cells_resident().contains(&e[5]));
    drop(g);

    // A full read of an expert in a cell: compute part copied, state read.
    let before = cache.stats();
    let g = cache.acquire(e[2], Parts::Full).unwrap();
    assert_eq!(cache.stats().bytes_read - before.bytes_read, state);
    assert_eq!(cache.stats().misses, before.misses + 1);
    assert!(!cache.cells_resident().contains(&e[2]));
    check_read(&layout, &g, 0);
    drop(g);
    cache.checkpoint(1).unwrap();
    check_stored(&store, e[1], 3);
}

#[test]
fn kept_experts_and_full_reads_never_take_cells() {
    let e = ids(8);
    let (_store, cache) = with_cells(8, 3, 0);
    cache.keep_resident(&e[..1]).unwrap();
    // A kept expert read for compute lands in a record slot, so its full
    // access then reads only its state part.
    drop(cache.acquire(e[0], Parts::Compute).unwrap());
    assert!(cache.cells_resident().is_empty());
    let before = cache.stats();
    drop(cache.acquire(e[0], Parts::Full).unwrap());
    let state = layout(8).record_bytes() - layout(8).compute_part_bytes();
    assert_eq!(cache.stats().bytes_read - before.bytes_read, state);
    drop(cache.acquire(e[1], Parts::Full).unwrap());
    assert!(cache.cells_resident().is_empty());
    // Too many kept is counted against the record slots alone.
    assert!(matches!(
        cache.keep_resident(&e[..2]),
        Err(TierError::TooManyKept { slots: 3, .. })
    ));
}

#[test]
fn a_kept_expert_waits_for_a_record_slot_while_others_take_cells() {
    let e = ids(8);
    let (_store, cache) = with_cells(8, 3, 0);
    cache.keep_resident(&e[..1]).unwrap();
    let held: Vec<_> = e[1..4]
        .iter()
        .map(|&x| cache.acquire(x, Parts::Full).unwrap())
        .collect();
    // Every record slot is pinned: the kept expert has nowhere to go, and
    // the error counts the record slots alone, which it could have taken.
    assert!(matches!(
        cache.acquire(e[0], Parts::Compute),
        Err(TierError::AllSlotsPinned { slots: 3 })
    ));
    let g = cache.acquire(e[4], Parts::Compute).unwrap();
    assert!(cache.cells_resident().contains(&e[4]));
    drop((g, held));
    drop(cache.acquire(e[0], Parts::Compute).unwrap());
    assert!(!cache.cells_resident().contains(&e[0]));
}

/// Two record slots hold experts 0 and 1 (1 updated to version 4), next
/// read for compute; experts 2 and 3 are wanted in full after them. The
/// prefetcher writes 1 back, moves both into cells and loads 2 and 3; the
/// whole schedule then reads as hits at the right versions.
#[test]
fn the_prefetcher_moves_records_next_read_for_compute_into_cells() {
    let layout = layout(6);
    let e = ids(6);
    let (c, f) = (Parts::Compute, Parts::Full);
    let (store, cache) = with_cells(6, 2, 4);
    let order = vec![
        (e[0], f),
        (e[1], f),
        (e[0], c),
        (e[1], c),
        (e[2], f),
        (e[3], f),
    ];
    cache.set_schedule(order.clone());
    drop(cache.acquire(e[0], f).unwrap());
    let mut w = cache.acquire_mut(e[1]).unwrap();
    set_version(&mut w, e[1], 4);
    w.seal(4);
    drop(w);
    wait_for("experts 0 and 1 in cells", || {
        let cells = cache.cells_resident();
        cells.contains(&e[0]) && cells.contains(&e[1])
    });
    wait_for("experts 2 and 3 loaded in full", || {
        let resident = cache.resident();
        [2, 3].iter().all(|&i| resident.contains(&(e[i], f, false)))
    });
    let stats = cache.stats();
    assert_eq!((stats.demotions, stats.write_backs), (2, 1), "{stats:?}");
    check_stored(&store, e[1], 4);
    let before = cache.stats();
    for &(x, parts) in &order[2..] {
        let g = cache.acquire(x, parts).unwrap();
        check_read(&layout, &g, if x == e[1] { 4 } else { 0 });
    }
    let after = cache.stats();
    assert_eq!(after.hits - before.hits, 4, "{after:?}");
}

#[test]
fn a_budget_without_a_record_slot_besides_the_cells_is_refused() {
    let layout = layout(8);
    let result = HostCache::new(
        populated(layout),
        HostCacheConfig {
            host_budget_bytes: 2 * layout.record_bytes(),
            cell_slots: 2,
            ..HostCacheConfig::default()
        },
    );
    let Err(err) = result else {
        panic!("two slots, both split into cells, were accepted");
    };
    assert!(matches!(err, TierError::BudgetTooSmall { .. }), "{err}");
    assert!(err.to_string().contains("compute cells"), "{err}");
}

#[test]
fn a_tier_that_holds_every_record_has_no_cells() {
    let (_store, cache) = with_cells(4, 4, 0);
    assert_eq!((cache.slot_count(), cache.cell_count()), (4, 0));
}

/// An expert in a cell whose full record the schedule wants next is moved
/// by the prefetcher into a record slot with one read of its state part:
/// its compute part is copied over from the cell.
#[test]
fn the_prefetcher_reads_only_the_state_of_a_record_whose_compute_part_is_in_a_cell() {
    let layout = layout(6);
    let e = ids(6);
    let (c, f) = (Parts::Compute, Parts::Full);
    let (_store, cache) = with_cells(6, 2, 2);
    // The prefetcher brings expert 1 into a cell; expert 0 is read there.
    cache.set_schedule(vec![(e[1], c)]);
    wait_for("expert 1 in a cell", || {
        cache.cells_resident().contains(&e[1])
    });
    drop(cache.acquire(e[0], c).unwrap());
    assert!(cache.cells_resident().contains(&e[0]));
    let before = cache.stats();
    cache.set_schedule(vec![(e[0], f), (e[1], c)]);
    wait_for("expert 0 loaded in full", || {
        cache.resident().contains(&(e[0], f, false))
    });
    let after = cache.stats();
    assert_eq!(
        after.bytes_read - before.bytes_read,
        layout.record_bytes() - layout.compute_part_bytes()
    );
    assert!(!cache.cells_resident().contains(&e[0]));
    let g = cache.acquire(e[0], f).unwrap();
    check_read(&layout, &g, 0);
    assert_eq!(cache.stats().hits, after.hits + 1);
}
