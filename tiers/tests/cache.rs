//! The host tier: a model-based randomized test against a plain map,
//! prefetch hit rates, eviction policies, and budget errors.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::*;
use proptest::prelude::*;
use strata_tiers::io::AlignedBuf;
use strata_tiers::{
    record_mut, EvictionPolicy, ExpertId, ExpertStore, HostCache, HostCacheConfig, Parts,
    ReadGuard, TierError,
};

/// A host tier of `slots` slots over `store`, with no prefetcher.
fn cache_without_prefetch(store: Arc<ExpertStore>, slots: u64) -> HostCache {
    let layout = store.layout();
    HostCache::new(
        store,
        HostCacheConfig {
            host_budget_bytes: slots * layout.record_bytes(),
            prefetch_ahead_max: 0,
            ..HostCacheConfig::default()
        },
    )
    .unwrap()
}

#[derive(Clone, Debug)]
enum Op {
    Read(u32, bool),
    Hold(u32),
    ReleaseOldest,
    /// An update that ends by `mark_dirty` and dropping the guard, or
    /// (true) by `seal`, which checksums and hands the slot back at once;
    /// taken by `acquire_to_update` (true: the compute part may be stale
    /// until written) or `acquire_mut`.
    Update(u32, bool, bool),
    Flush,
    Checkpoint,
}

fn op(experts: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..experts, any::<bool>()).prop_map(|(e, full)| Op::Read(e, full)),
        1 => (0..experts).prop_map(Op::Hold),
        1 => Just(Op::ReleaseOldest),
        3 => (0..experts, any::<bool>(), any::<bool>())
            .prop_map(|(e, seal, to_update)| Op::Update(e, seal, to_update)),
        1 => Just(Op::Flush),
        1 => Just(Op::Checkpoint),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_cache_behaves_like_a_map(
        ops in prop::collection::vec(op(7), 1..60),
        slots in 2u64..5,
        cell_slots in 0usize..2,
        lru in any::<bool>(),
        prefetch in any::<bool>(),
        update_reads_state in any::<bool>(),
    ) {
        let layout = layout(7);
        let store = populated(layout);
        let cache = HostCache::new(store.clone(), HostCacheConfig {
            host_budget_bytes: (slots + cell_slots as u64) * layout.record_bytes(),
            cell_slots,
            policy: if lru { EvictionPolicy::Lru } else { EvictionPolicy::ScheduleDistance },
            prefetch_ahead_max: if prefetch { 4 } else { 0 },
            ..HostCacheConfig::default()
        }).unwrap();
        if prefetch {
            // A schedule the ops do not follow (compute reads, then full
            // ones or updates' state reads, which move records between
            // record slots and compute cells): prefetching must not
            // change results.
            let update = if update_reads_state { Parts::State } else { Parts::Full };
            cache.set_schedule(moe_schedule_with(7, update));
        }
        // The model: each expert's current version.
        let mut model: BTreeMap<u32, u64> = (0..7).map(|i| (i, 0)).collect();
        let mut held: Vec<(ReadGuard, u64)> = Vec::new();
        let mut held_sealed = Vec::new();
        let mut step = 0u64;
        for op in ops {
            match op {
                Op::Read(i, full) => {
                    let parts = if full { Parts::Full } else { Parts::Compute };
                    match cache.acquire(ExpertId::new(0, i), parts) {
                        Ok(g) => check_read(&layout, &g, model[&i]),
                        Err(TierError::AllSlotsPinned { .. }) => {
                            prop_assert!(held.len() as u64 >= slots);
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                Op::Hold(i) => {
                    // Keep at most slots - 1 pins, so progress stays possible.
                    if (held.len() as u64) < slots - 1 {
                        let g = cache.acquire(ExpertId::new(0, i), Parts::Compute).unwrap();
                        held.push((g, model[&i]));
                    }
                }
                Op::ReleaseOldest => {
                    if !held.is_empty() {
                        held.remove(0);
                    }
                }
                Op::Update(i, seal, to_update) => {
                    if held.iter().any(|(g, _)| g.expert().index == i) {
                        continue; // a writer would wait for our own pin
                    }
                    let e = ExpertId::new(0, i);
                    let mut g = match to_update {
                        true => cache.acquire_to_update(e).unwrap(),
                        false => cache.acquire_mut(e).unwrap(),
                    };
                    let version = model[&i] + 1;
                    let r = g.record_mut();
                    let n = r.compute.len();
                    r.compute.copy_from_slice(&compute_of(e, version, n));
                    r.master.fill(master_of(e, version));
                    r.m.fill(version as f32);
                    if seal {
                        g.seal(version);
                        // The sealed guard holds nothing: the slot is
                        // reusable while it lives (as in the optimizer pool).
                        held_sealed.push(g);
                    } else {
                        g.mark_dirty(version);
                    }
                    model.insert(i, version);
                }
                Op::Flush => cache.flush().unwrap(),
                Op::Checkpoint => {
                    step += 1;
                    cache.checkpoint(step).unwrap();
                }
            }
            // Pinned experts never move or change under their guards.
            for (g, version) in &held {
                check_read(&layout, g, *version);
            }
            prop_assert!(cache.resident().len() <= slots as usize + cache.cell_count());
            let full = cache.resident().iter().filter(|r| r.1 == Parts::Full).count();
            prop_assert!(full as u64 <= slots);
        }
        drop(held);
        drop(held_sealed);
        // Everything reads back as the model says, through the cache...
        for (&i, &version) in &model {
            let g = cache.acquire(ExpertId::new(0, i), Parts::Full).unwrap();
            check_read(&layout, &g, version);
        }
        // ...and, after a final checkpoint, straight from the store.
        cache.checkpoint(step + 1).unwrap();
        let mut buf = AlignedBuf::zeroed(layout.record_bytes() as usize);
        for (&i, &version) in &model {
            let e = ExpertId::new(0, i);
            let written = store.read(e, Parts::Full, buf.as_mut_slice()).unwrap();
            // Never-updated experts keep their version-0 record.
            prop_assert_eq!(written, version);
            let r = record_mut(&layout, buf.as_mut_slice()).unwrap();
            prop_assert_eq!(&r.compute[..], &compute_of(e, version, r.compute.len())[..]);
            prop_assert!(r.master.iter().all(|&x| x == master_of(e, version)));
        }
    }
}

/// forward over every expert, then backward (full records for the optimizer).
fn moe_schedule(experts: u32) -> Vec<(ExpertId, Parts)> {
    moe_schedule_with(experts, Parts::Full)
}

/// forward over every expert, then backward: each expert's `update`
/// access (its full record, or its state alone where its compute params
/// are still on the device).
fn moe_schedule_with(experts: u32, update: Parts) -> Vec<(ExpertId, Parts)> {
    let forward = (0..experts).map(|i| (ExpertId::new(0, i), Parts::Compute));
    let backward = (0..experts).rev().map(|i| (ExpertId::new(0, i), update));
    forward.chain(backward).collect()
}

#[test]
fn prefetch_hits_every_access_when_the_schedule_is_followed_and_the_window_fits() {
    let experts = 12;
    let layout = layout(experts);
    let store = populated(layout);
    let cache = HostCache::new(
        store,
        HostCacheConfig {
            // A third of the experts fit; the prefetch window is 3 accesses.
            host_budget_bytes: 4 * layout.record_bytes(),
            prefetch_ahead_max: 3,
            prefetch_batch_max: 3,
            ..HostCacheConfig::default()
        },
    )
    .unwrap();
    let schedule = moe_schedule(experts);
    cache.set_schedule(schedule.clone());
    for _step in 0..3 {
        for &(e, parts) in &schedule {
            // Compute that takes as long as the prefetcher needs: wait
            // until it has brought this access's parts in by itself (it
            // must, within its window), however late a busy machine
            // schedules its thread; then the access is a hit.
            let deadline = std::time::Instant::now() + Duration::from_secs(20);
            while !cache
                .resident()
                .iter()
                .any(|&(r, p, _)| r == e && (p == parts || p == Parts::Full))
            {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the prefetcher never loaded {e:?} ({parts:?})"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            let g = cache.acquire(e, parts).unwrap();
            check_read(&layout, &g, 0);
            drop(g);
        }
    }
    let stats = cache.stats();
    assert_eq!(stats.acquires(), 3 * schedule.len() as u64);
    assert_eq!(stats.hits, stats.acquires(), "{stats:?}");
    assert_eq!((stats.late, stats.misses, stats.stall_ns), (0, 0, 0));
    assert_eq!(stats.hit_rate(), 1.0);
}

/// Demand-only hit rate of a policy over four repetitions of `schedule`.
fn demand_hit_rate(policy: EvictionPolicy, schedule: &[(ExpertId, Parts)]) -> f64 {
    let layout = layout(10);
    let cache = HostCache::new(
        populated(layout),
        HostCacheConfig {
            host_budget_bytes: 4 * layout.record_bytes(),
            policy,
            prefetch_ahead_max: 0,
            ..HostCacheConfig::default()
        },
    )
    .unwrap();
    cache.set_schedule(schedule.to_vec());
    for _ in 0..4 {
        for &(e, parts) in schedule {
            drop(cache.acquire(e, parts).unwrap());
        }
    }
    cache.stats().hit_rate()
}

#[test]
fn schedule_distance_eviction_is_never_worse_than_lru() {
    // Training: forward reads compute params, backward needs the state too
    // (every backward access loads the state part, a miss by either policy).
    let training = moe_schedule(10);
    // Evaluation: forward only, a cyclic scan larger than the cache, where
    // LRU always evicts exactly the expert needed next.
    let evaluation: Vec<_> = (0..10)
        .map(|i| (ExpertId::new(0, i), Parts::Compute))
        .collect();
    for (name, schedule) in [("training", &training), ("evaluation", &evaluation)] {
        let lru = demand_hit_rate(EvictionPolicy::Lru, schedule);
        let distance = demand_hit_rate(EvictionPolicy::ScheduleDistance, schedule);
        eprintln!("{name}: demand hit rate lru {lru:.3}, schedule distance {distance:.3}");
        assert!(
            distance >= lru,
            "{name}: lru {lru} vs schedule distance {distance}"
        );
        if name == "evaluation" {
            assert_eq!(lru, 0.0);
            assert!(distance > 0.2, "{distance}");
        }
    }
}

#[test]
fn budgets_and_pins_get_clear_errors() {
    let layout = layout(4);
    let store = populated(layout);
    let err = HostCache::new(
        store.clone(),
        HostCacheConfig {
            host_budget_bytes: layout.record_bytes() - 1,
            ..HostCacheConfig::default()
        },
    )
    .err()
    .unwrap();
    assert!(matches!(
        err,
        TierError::BudgetTooSmall { tier: "host", .. }
    ));
    assert!(err.to_string().contains("raise it to at least"), "{err}");

    let cache = cache_without_prefetch(store, 2);
    let a = cache.acquire(ExpertId::new(0, 0), Parts::Compute).unwrap();
    let b = cache.acquire(ExpertId::new(0, 1), Parts::Compute).unwrap();
    let err = cache
        .acquire(ExpertId::new(0, 2), Parts::Compute)
        .err()
        .unwrap();
    assert!(
        matches!(err, TierError::AllSlotsPinned { slots: 2 }),
        "{err}"
    );
    drop((a, b));
    let mut w = cache.acquire_mut(ExpertId::new(0, 3)).unwrap();
    w.mark_dirty(1);
    let err = cache.flush().unwrap_err();
    assert!(matches!(err, TierError::DirtyExpertHeld { .. }), "{err}");
    drop(w);
    cache.flush().unwrap();
    let err = cache
        .acquire(ExpertId::new(3, 0), Parts::Compute)
        .err()
        .unwrap();
    assert!(matches!(err, TierError::NoSuchExpert { .. }), "{err}");
}

/// With every slot pinned, `acquire_within` waits for another thread to
/// drop a guard (as an upload completing does) instead of failing, and
/// still fails once its wait is over.
#[test]
fn an_acquire_within_waits_for_a_pin_to_be_released() {
    let layout = layout(4);
    let cache = cache_without_prefetch(populated(layout), 2);
    let a = cache.acquire(ExpertId::new(0, 0), Parts::Compute).unwrap();
    let b = cache.acquire(ExpertId::new(0, 1), Parts::Compute).unwrap();
    let short = cache.acquire_within(
        ExpertId::new(0, 2),
        Parts::Compute,
        Duration::from_millis(20),
    );
    assert!(matches!(short, Err(TierError::AllSlotsPinned { slots: 2 })));
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(a);
        });
        let g = cache
            .acquire_mut_within(ExpertId::new(0, 2), Duration::from_secs(30))
            .unwrap();
        drop(g);
    });
    drop(b);
}

#[test]
fn a_record_is_ready_to_update_only_when_its_state_is_loaded_and_free() {
    let layout = layout(4);
    let cache = cache_without_prefetch(populated(layout), 2);
    let (e0, e1) = (ExpertId::new(0, 0), ExpertId::new(0, 1));
    assert!(!cache.ready_to_update(e0), "not resident");
    let compute = cache.acquire(e0, Parts::Compute).unwrap();
    assert!(!cache.ready_to_update(e0), "compute params only, pinned");
    drop(compute);
    assert!(!cache.ready_to_update(e0), "compute params only");
    let full = cache.acquire(e0, Parts::Full).unwrap();
    assert!(!cache.ready_to_update(e0), "pinned by a reader");
    drop(full);
    assert!(cache.ready_to_update(e0));
    let writer = cache.acquire_mut_within(e0, Duration::ZERO).unwrap();
    assert!(!cache.ready_to_update(e0), "taken by a writer");
    drop(writer);
    assert!(cache.ready_to_update(e0) && !cache.ready_to_update(e1));
    // Its state alone is enough for an update.
    drop(cache.acquire_to_update(e1).unwrap());
    assert!(cache.ready_to_update(e1));
}

/// An update of a record not in host memory reads its optimizer state
/// alone, the writer writes the compute part whole, and the record reads
/// back at the new version; one whose writer stops before writing keeps a
/// compute part that is not the record's, which a reader then reads in
/// from the store (and no write-back ever sees).
#[test]
fn an_update_reads_the_state_alone_and_writes_the_compute_part_whole() {
    let layout = layout(4);
    let store = populated(layout);
    let cache = cache_without_prefetch(store.clone(), 2);
    let [e0, e1, e2, e3] = [0, 1, 2, 3].map(|i| ExpertId::new(0, i));
    let state = layout.state_part_bytes();
    let compute = layout.compute_part_bytes();

    let mut g = cache.acquire_to_update(e0).unwrap();
    assert_eq!(cache.stats().bytes_read, state, "the state part alone");
    assert_eq!(cache.resident(), vec![(e0, Parts::State, false)]);
    set_version(&mut g, e0, 1);
    g.seal(1);
    assert_eq!(cache.resident(), vec![(e0, Parts::Full, true)]);
    let r = cache.acquire(e0, Parts::Full).unwrap();
    check_read(&layout, &r, 1);
    drop(r);

    // A writer that stops before writing leaves the slot clean and lacking
    // its compute part: a reader reads it in.
    drop(cache.acquire_to_update(e1).unwrap());
    let before = cache.stats().bytes_read;
    let r = cache.acquire(e1, Parts::Compute).unwrap();
    check_read(&layout, &r, 0);
    assert_eq!(cache.stats().bytes_read - before, compute);
    drop(r);

    // Evicting both (the dirty one written back first) and flushing leaves
    // the store at the versions written.
    for e in [e2, e3] {
        let mut g = cache.acquire_to_update(e).unwrap();
        set_version(&mut g, e, 2);
        g.seal(2);
    }
    cache.checkpoint(1).unwrap();
    for (e, version) in [(e0, 1), (e1, 0), (e2, 2), (e3, 2)] {
        check_stored(&store, e, version);
    }
    drop(cache);

    // The prefetcher reads an update's access as the state part alone.
    let cache = HostCache::new(
        store.clone(),
        HostCacheConfig {
            host_budget_bytes: 2 * layout.record_bytes(),
            prefetch_ahead_max: 4,
            ..HostCacheConfig::default()
        },
    )
    .unwrap();
    cache.set_schedule(vec![(e1, Parts::State), (e1, Parts::Compute)]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while cache.resident() != vec![(e1, Parts::State, false)] {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            cache.resident()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(cache.stats().bytes_read, state);
    let mut g = cache.acquire_to_update(e1).unwrap();
    assert_eq!(cache.stats().hits, 1);
    set_version(&mut g, e1, 3);
    g.seal(3);
    let r = cache.acquire(e1, Parts::Compute).unwrap();
    check_read(&layout, &r, 3);
    assert_eq!(cache.stats().bytes_read, state, "nothing more read");
}

/// A sealed write guard hands its slot back while it lives: with both
/// slots sealed, other experts still load (writing the sealed records
/// back with the checksums `seal` stamped), and everything reads back,
/// verified, at the sealed versions.
#[test]
fn a_sealed_slot_is_written_back_and_reused_while_its_guard_lives() {
    let layout = layout(4);
    let store = populated(layout);
    let cache = cache_without_prefetch(store.clone(), 2);
    let mut sealed = Vec::new();
    for i in 0..2 {
        let e = ExpertId::new(0, i);
        let mut g = cache.acquire_mut(e).unwrap();
        set_version(&mut g, e, 5);
        g.seal(5);
        sealed.push(g);
    }
    // Both slots are dirty but unpinned: no wait, no AllSlotsPinned.
    for i in 2..4 {
        let g = cache.acquire(ExpertId::new(0, i), Parts::Full).unwrap();
        check_read(&layout, &g, 0);
    }
    // A sealed expert written again, not sealed, is stamped anew.
    let e = ExpertId::new(0, 0);
    let mut g = cache.acquire_mut(e).unwrap();
    set_version(&mut g, e, 6);
    g.mark_dirty(6);
    drop(g);
    drop(sealed);
    cache.checkpoint(1).unwrap();
    for (i, version) in [(0, 6), (1, 5), (2, 0), (3, 0)] {
        check_stored(&store, ExpertId::new(0, i), version);
    }
}

/// Where the host tier holds every record, `seal` leaves the checksums to
/// the flush: records sealed (several times over) and checkpointed read
/// back from the store verified, at their last sealed versions; a record
/// whose headers still carried an older step would fail the read.
#[test]
fn records_sealed_in_a_tier_that_holds_them_all_are_checksummed_at_flush() {
    let layout = layout(3);
    let store = populated(layout);
    let cache = cache_without_prefetch(store.clone(), 3);
    for version in 1..=3 {
        for i in 0..3 {
            let e = ExpertId::new(0, i);
            let mut g = cache.acquire_mut(e).unwrap();
            set_version(&mut g, e, version + i as u64);
            g.seal(version + i as u64);
        }
        cache.checkpoint(version).unwrap();
        for i in 0..3 {
            check_stored(&store, ExpertId::new(0, i), version + i as u64);
        }
    }
}

/// A host tier of `slots` slots over four experts with `order` as its
/// schedule and a prefetcher looking one access ahead; expert 0 is updated
/// (its full access, the schedule's first) to version 5 and released.
fn updated_first(slots: u64, order: &[(u32, Parts)]) -> (Arc<ExpertStore>, HostCache) {
    let layout = layout(4);
    let store = populated(layout);
    let cache = HostCache::new(
        store.clone(),
        HostCacheConfig {
            host_budget_bytes: slots * layout.record_bytes(),
            prefetch_ahead_max: 1,
            ..HostCacheConfig::default()
        },
    )
    .unwrap();
    let order = order
        .iter()
        .map(|&(i, p)| (ExpertId::new(0, i), p))
        .collect();
    cache.set_schedule(order);
    let e = ExpertId::new(0, 0);
    let mut g = cache.acquire_mut(e).unwrap();
    set_version(&mut g, e, 5);
    g.seal(5);
    drop(g);
    (store, cache)
}

fn dirty(cache: &HostCache, e: ExpertId) -> bool {
    cache.resident().iter().any(|&(r, _, d)| r == e && d)
}

/// With nothing to load, the prefetcher writes back a dirty record the
/// schedule next only reads (it will be evicted unchanged), so the load
/// that evicts it need not wait for the write; never one the schedule
/// updates next, nor anything where every record stays resident.
#[test]
fn the_prefetcher_writes_back_early_what_is_next_only_read() {
    let e0 = ExpertId::new(0, 0);
    let (c, f) = (Parts::Compute, Parts::Full);
    // Next for expert 0: a read (distance 0), then the other experts.
    let reads_next = [(0, f), (0, c), (1, c), (2, c), (3, c)];
    let (store, cache) = updated_first(2, &reads_next);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while dirty(&cache, e0) {
        assert!(std::time::Instant::now() < deadline, "never written back");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(cache.stats().write_backs, 1);
    assert_eq!(cache.stats().bytes_written, layout(4).record_bytes());
    check_stored(&store, e0, 5);
    // Still resident: read from the host tier, a hit.
    let before = cache.stats();
    let g = cache.acquire(e0, Parts::Compute).unwrap();
    check_read(&layout(4), &g, 5);
    let after = cache.stats();
    assert_eq!(after.hits, before.hits + 1);
    assert_eq!((after.late, after.misses), (before.late, before.misses));
    drop(g);

    // Next for expert 0: its update (after 1, 2, 3); and a tier that holds
    // every record. Neither writes anything back before a flush.
    let updated_next = [(0, f), (1, c), (2, c), (3, c)];
    for (slots, order) in [(2, &updated_next[..]), (4, &reads_next[..])] {
        let (store, cache) = updated_first(slots, order);
        std::thread::sleep(Duration::from_millis(100));
        assert!(dirty(&cache, e0), "{slots} slots, {order:?}");
        assert_eq!(cache.stats().write_backs, 0);
        cache.flush().unwrap();
        check_stored(&store, e0, 5);
    }
}

/// Kept experts stay resident while the others stream through the
/// remaining slots: never evicted, never written back before a flush
/// (not even early, by an idle prefetcher), read as hits; the flush writes
/// them; more than the slots less `MIN_STREAMING_SLOTS` is refused; and
/// an expert no longer kept is evicted (written back) like any other.
#[test]
fn kept_experts_stay_resident_while_the_others_stream() {
    let layout = layout(6);
    let store = populated(layout);
    let ids: Vec<ExpertId> = (0..6).map(|i| ExpertId::new(0, i)).collect();
    let cache = HostCache::new(
        store.clone(),
        HostCacheConfig {
            host_budget_bytes: 4 * layout.record_bytes(),
            prefetch_ahead_max: 2,
            ..HostCacheConfig::default()
        },
    )
    .unwrap();
    // The schedule reads expert 0 next after its update, which would let
    // an idle prefetcher write it back early were it not kept.
    let order = [0, 1, 2, 3, 4, 5]
        .iter()
        .map(|&i| (ids[i], Parts::Compute))
        .collect();
    cache.set_schedule(order);
    assert!(matches!(
        cache.keep_resident(&ids[..3]),
        Err(TierError::TooManyKept {
            kept: 3,
            slots: 4,
            streaming: 2
        })
    ));
    cache.keep_resident(&ids[..2]).unwrap();
    assert_eq!(cache.kept_count(), 2);
    for (i, version) in [(0, 5), (1, 7)] {
        let mut g = cache.acquire_mut(ids[i]).unwrap();
        set_version(&mut g, ids[i], version);
        g.seal(version);
    }
    for _round in 0..3 {
        for &e in &ids[2..] {
            let g = cache.acquire(e, Parts::Full).unwrap();
            check_read(&layout, &g, 0);
        }
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(dirty(&cache, ids[0]) && dirty(&cache, ids[1]));
    assert_eq!(cache.stats().write_backs, 0, "{:?}", cache.stats());
    let before = cache.stats();
    for (i, version) in [(0, 5), (1, 7)] {
        let g = cache.acquire(ids[i], Parts::Full).unwrap();
        check_read(&layout, &g, version);
    }
    assert_eq!(cache.stats().hits, before.hits + 2);
    cache.flush().unwrap();
    check_stored(&store, ids[0], 5);
    check_stored(&store, ids[1], 7);

    // No longer kept: expert 1 is evicted, its new version written back
    // without a flush, once three others are held at once in the three
    // slots expert 0 leaves (the prefetcher may bring it back afterwards).
    let mut g = cache.acquire_mut(ids[1]).unwrap();
    set_version(&mut g, ids[1], 8);
    g.seal(8);
    drop(g);
    cache.keep_resident(&ids[..1]).unwrap();
    let held: Vec<ReadGuard> = ids[2..5]
        .iter()
        .map(|&e| cache.acquire(e, Parts::Full).unwrap())
        .collect();
    check_stored(&store, ids[1], 8);
    drop(held);
    let resident: Vec<ExpertId> = cache.resident().iter().map(|r| r.0).collect();
    assert!(resident.contains(&ids[0]), "{resident:?}");
}

/// A host tier given a timeline records each SSD call with the records it
/// moved, and each acquire that had to wait, on the thread that did it.
#[test]
fn a_timeline_records_every_read_write_and_wait() {
    let layout = layout(4);
    let store = populated(layout);
    let timeline = Arc::new(strata_tiers::Timeline::new(64));
    let cache = HostCache::new(
        store,
        HostCacheConfig {
            host_budget_bytes: 2 * layout.record_bytes(),
            prefetch_ahead_max: 0,
            timeline: Some(Arc::clone(&timeline)),
            ..HostCacheConfig::default()
        },
    )
    .unwrap();
    let e = |i| ExpertId::new(0, i);
    drop(cache.acquire(e(0), Parts::Compute).unwrap()); // a load
    drop(cache.acquire(e(0), Parts::Compute).unwrap()); // a hit: no event
    let mut g = cache.acquire_mut(e(1)).unwrap();
    set_version(&mut g, e(1), 1);
    g.seal(1);
    drop(g);
    drop(cache.acquire(e(2), Parts::Full).unwrap()); // evicts 0 (clean) or 1 (dirty)
    cache.flush().unwrap();
    let events = timeline.take().events;
    let named = |category: &str, name: &str| {
        events
            .iter()
            .filter(|ev| ev.category == category && ev.name == name)
            .map(|ev| ev.detail.as_str())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        named("ssd", "read"),
        ["0.0 compute", "0.1 full", "0.2 full"]
    );
    assert_eq!(named("ssd", "write"), ["0.1"]);
    assert_eq!(
        named("stall", "load"),
        ["0.0 compute", "0.1 full", "0.2 full"]
    );
    let me = std::thread::current().name().unwrap().to_string();
    assert!(events.iter().all(|ev| ev.thread == me), "{events:?}");
    // Each load contains its read.
    for (read, load) in named_events(&events, "read").zip(named_events(&events, "load")) {
        assert!(
            load.start <= read.start && read.end() <= load.end(),
            "{read:?} {load:?}"
        );
    }
}

fn named_events<'a>(
    events: &'a [strata_tiers::TimelineEvent],
    name: &'a str,
) -> impl Iterator<Item = &'a strata_tiers::TimelineEvent> {
    events.iter().filter(move |ev| ev.name == name)
}
