//! Going back one checkpoint (`ExpertStore::roll_back`), as ranks that
//! must resume from the same step do: the older checkpoint's records come
//! back, a record overwritten since is refused without changing the store,
//! and a crash at any operation of the roll-back leaves the store at one
//! of the two checkpoints with every record intact.

use std::sync::Arc;

use strata_tiers::io::{AlignedBuf, FaultPlan, FaultyFile, MemFile};
use strata_tiers::{ExpertId, ExpertStore, Parts, TierError};

mod common;

use common::store_files::{check_all, experts, layout, write_step, Shared};

/// Every expert at step 1, committed; the first two at step 2, committed.
fn two_checkpoints(store: &ExpertStore) -> Result<(), TierError> {
    let all = experts(&layout());
    write_step(store, &all, 1)?;
    store.checkpoint(1)?;
    write_step(store, &all[..2], 2)?;
    store.checkpoint(2)
}

fn at_two(e: ExpertId) -> u64 {
    if experts(&layout())[..2].contains(&e) {
        2
    } else {
        1
    }
}

fn reopen(mem: &MemFile) -> ExpertStore {
    ExpertStore::open_on(Box::new(MemFile::from_bytes(mem.to_bytes())), None).unwrap()
}

#[test]
fn a_store_rolls_back_to_the_checkpoint_before_its_newest() {
    let mem = Arc::new(MemFile::new());
    let store = ExpertStore::create_on(Box::new(Shared(mem.clone())), layout()).unwrap();
    two_checkpoints(&store).unwrap();
    assert_eq!(store.previous_checkpoint().unwrap(), Some(1));
    store.roll_back(2).unwrap(); // the newest already: nothing to do
    assert_eq!(store.committed_step(), 2);
    check_all(&store, at_two);

    store.roll_back(1).unwrap();
    assert_eq!(store.committed_step(), 1);
    check_all(&store, |_| 1);
    // Durable, and no newer checkpoint is left to be opened instead.
    let reopened = reopen(&mem);
    assert_eq!(reopened.committed_step(), 1);
    assert_eq!(reopened.previous_checkpoint().unwrap(), Some(1));
    check_all(&reopened, |_| 1);

    // Training goes on from step 1 as from any checkpoint.
    let all = experts(&layout());
    write_step(&store, &all[3..], 2).unwrap();
    store.checkpoint(2).unwrap();
    let reopened = reopen(&mem);
    assert_eq!(reopened.committed_step(), 2);
    check_all(&reopened, |e| if all[3..].contains(&e) { 2 } else { 1 });
}

#[test]
fn a_step_the_store_does_not_hold_is_refused_naming_what_it_holds() {
    let mem = Arc::new(MemFile::new());
    let store = ExpertStore::create_on(Box::new(Shared(mem.clone())), layout()).unwrap();
    two_checkpoints(&store).unwrap();
    let e = store.roll_back(7).unwrap_err().to_string();
    assert!(
        e.contains("no checkpoint at step 7") && e.contains("newest is at step 2"),
        "{e}"
    );
    assert!(e.contains("the one before at step 1"), "{e}");
    // Written to since its newest checkpoint: refused.
    write_step(&store, &experts(&layout())[..1], 3).unwrap();
    let e = store.roll_back(1).unwrap_err().to_string();
    assert!(e.contains("written since its checkpoint at step 2"), "{e}");
}

#[test]
fn a_record_overwritten_after_the_newest_checkpoint_fails_the_roll_back_and_changes_nothing() {
    let mem = Arc::new(MemFile::new());
    let store = ExpertStore::create_on(Box::new(Shared(mem.clone())), layout()).unwrap();
    two_checkpoints(&store).unwrap();
    // A run that went on past step 2: expert 0's working copy is the one
    // step 1 committed.
    let all = experts(&layout());
    write_step(&store, &all[..1], 3).unwrap();
    drop(store);
    let reopened = reopen(&mem);
    assert_eq!(reopened.committed_step(), 2);
    let e = reopened.roll_back(1).unwrap_err().to_string();
    assert!(
        e.contains(&format!("expert {}", all[0])) && e.contains("overwritten"),
        "{e}"
    );
    assert_eq!(reopened.committed_step(), 2);
    check_all(&reopened, at_two);
    let again = reopen(&mem);
    assert_eq!(again.committed_step(), 2);
    check_all(&again, at_two);
}

/// Rolls back on a device that fails at operation `k`, then checks what a
/// power cut leaves, under several ways the unsynced writes may land.
/// Returns whether the roll-back ran to its end.
fn roll_back_crashing_at(image: &[u8], k: u64) -> bool {
    let device = Arc::new(FaultyFile::from_image(
        image.to_vec(),
        FaultPlan {
            fail_at_op: Some(k),
            ..FaultPlan::default()
        },
    ));
    let done = ExpertStore::open_on(Box::new(Shared(device.clone())), None)
        .and_then(|s| s.roll_back(1))
        .is_ok();
    for tear_seed in 0..4 {
        device.set_plan(FaultPlan {
            tear_seed,
            ..FaultPlan::default()
        });
        let recovered =
            ExpertStore::open_on(Box::new(MemFile::from_bytes(device.crash_image())), None)
                .unwrap();
        match recovered.committed_step() {
            1 => check_all(&recovered, |_| 1),
            2 => {
                assert!(!done, "a roll-back that returned did not last");
                check_all(&recovered, at_two);
            }
            other => panic!("recovered at step {other} after a roll-back to 1"),
        }
        // A roll-back cut short can be run again.
        recovered.roll_back(1).unwrap();
        check_all(&recovered, |_| 1);
    }
    done
}

#[test]
fn a_crash_at_every_operation_of_a_roll_back_leaves_one_of_the_two_checkpoints() {
    let mem = Arc::new(MemFile::new());
    let store = ExpertStore::create_on(Box::new(Shared(mem.clone())), layout()).unwrap();
    two_checkpoints(&store).unwrap();
    drop(store);
    let image = mem.to_bytes();
    let mut k = 0;
    while !roll_back_crashing_at(&image, k) {
        k += 1;
        assert!(k < 100, "a roll-back takes fewer than 100 operations");
    }
    // Open, the older superblock and map, two records, map, sync, superblock, sync.
    assert!(k >= 7, "a roll-back makes at least 7 operations, saw {k}");
    let mut buf = AlignedBuf::zeroed(layout().record_bytes() as usize);
    let last = reopen(&mem).read(experts(&layout())[0], Parts::Full, buf.as_mut_slice());
    assert_eq!(last.unwrap(), 2, "the image rolled back was a copy");
}
