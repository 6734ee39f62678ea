//! The SSD tier: round trips, crash safety at every sync point, the I/O
//! latch, corruption detection, and clear errors for bad files.

use std::sync::Arc;

use strata_tiers::format::BLOCK_BYTES;
use strata_tiers::io::{AlignedBuf, EnginePreference, FaultPlan, FaultyFile, FileOptions, MemFile};
use strata_tiers::{
    compute_bytes, record_mut, Dtype, ExpertId, ExpertStore, Layout, Parts, TierError,
};

mod common;

use common::store_files::{check, check_all, experts, fill, layout, write_step, Shared};

#[test]
fn records_round_trip_and_only_checkpoints_are_durable() {
    let mem = Arc::new(MemFile::new());
    let store = ExpertStore::create_on(Box::new(Shared(mem.clone())), layout()).unwrap();
    let all = experts(&layout());
    write_step(&store, &all, 1).unwrap();
    check_all(&store, |_| 1);

    // Compute-only reads need only the compute part.
    let mut small = AlignedBuf::zeroed(layout().compute_part_bytes() as usize);
    store
        .read(all[4], Parts::Compute, small.as_mut_slice())
        .unwrap();
    let mut full = AlignedBuf::zeroed(layout().record_bytes() as usize);
    fill(&layout(), all[4], 1, full.as_mut_slice());
    assert_eq!(
        compute_bytes(&layout(), small.as_slice()).unwrap(),
        compute_bytes(&layout(), full.as_slice()).unwrap()
    );

    // Not yet checkpointed: a reopen sees nothing written.
    let reopened =
        ExpertStore::open_on(Box::new(MemFile::from_bytes(mem.to_bytes())), None).unwrap();
    assert!(matches!(
        reopened.read(all[0], Parts::Full, full.as_mut_slice()),
        Err(TierError::NeverWritten { .. })
    ));

    store.checkpoint(1).unwrap();
    write_step(&store, &all[..2], 2).unwrap();
    let reopened =
        ExpertStore::open_on(Box::new(MemFile::from_bytes(mem.to_bytes())), None).unwrap();
    assert_eq!(reopened.committed_step(), 1);
    check_all(&reopened, |_| 1);
    store.checkpoint(2).unwrap();
    let reopened =
        ExpertStore::open_on(Box::new(MemFile::from_bytes(mem.to_bytes())), None).unwrap();
    assert_eq!(reopened.committed_step(), 2);
    check_all(&reopened, |e| if all[..2].contains(&e) { 2 } else { 1 });
}

/// A store of frozen experts keeps no moments: its records are 8 bytes a
/// param shorter, round-trip, and reopen as such; a reader expecting
/// moments is refused.
#[test]
fn a_store_without_moments_keeps_master_and_compute_alone() {
    let frozen = Layout {
        moments: false,
        ..layout()
    };
    let saved = layout().record_bytes() - frozen.record_bytes();
    assert!(saved >= 8 * 1500 - 4096, "{saved}");
    let mut buf = AlignedBuf::zeroed(frozen.record_bytes() as usize);
    let r = record_mut(&frozen, buf.as_mut_slice()).unwrap();
    assert_eq!((r.master.len(), r.m.len(), r.v.len()), (1500, 0, 0));

    let mem = Arc::new(MemFile::new());
    let store = ExpertStore::create_on(Box::new(Shared(mem.clone())), frozen).unwrap();
    let all = experts(&frozen);
    write_step(&store, &all, 1).unwrap();
    store.checkpoint(1).unwrap();
    let reopened =
        ExpertStore::open_on(Box::new(MemFile::from_bytes(mem.to_bytes())), None).unwrap();
    assert_eq!(reopened.layout(), frozen);
    check_all(&reopened, |_| 1);
    let err = ExpertStore::open_on(
        Box::new(MemFile::from_bytes(mem.to_bytes())),
        Some(layout()),
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("layout"), "{err}");
}

/// The workload the crash tests cut short: three checkpoints, each
/// rewriting a different subset of experts.
fn workload(store: &ExpertStore) -> Result<(), TierError> {
    let all = experts(&store.layout());
    write_step(store, &all, 1)?;
    store.checkpoint(1)?;
    write_step(store, &all[1..4], 2)?;
    store.checkpoint(2)?;
    write_step(store, &all[3..], 3)?;
    write_step(store, &all[..1], 3)?;
    store.checkpoint(3)
}

/// What each expert holds at each committed step of `workload`.
fn workload_step(committed: u64, e: ExpertId) -> u64 {
    let all = experts(&layout());
    let pos = all.iter().position(|&x| x == e).unwrap();
    match committed {
        1 => 1,
        2 => {
            if (1..4).contains(&pos) {
                2
            } else {
                1
            }
        }
        3 => {
            if pos >= 3 || pos == 0 {
                3
            } else {
                2
            }
        }
        other => panic!("the workload never commits step {other}"),
    }
}

/// Runs the workload on a fault device with `plan`, crashes, and checks the
/// recovered store under several ways the unsynced writes may have landed.
fn crash_and_recover(plan: FaultPlan) -> bool {
    let device = Arc::new(FaultyFile::new(plan));
    let last_ok = {
        let Ok(store) = ExpertStore::create_on(Box::new(Shared(device.clone())), layout()) else {
            return false; // the crash came before the store existed
        };
        let result = workload(&store);
        let completed = result.is_ok();
        // What the workload saw committed before it failed.
        let committed = store.committed_step();
        if completed {
            assert_eq!(committed, 3);
        }
        committed
    };
    for tear_seed in 0..4 {
        let plan = FaultPlan {
            tear_seed,
            ..FaultPlan::default()
        };
        let image = {
            device.set_plan(plan);
            device.crash_image()
        };
        let recovered = ExpertStore::open_on(Box::new(MemFile::from_bytes(image)), None).unwrap();
        let step = recovered.committed_step();
        // A checkpoint that returned is durable; one that was cut short may
        // or may not have reached its superblock, but nothing else is possible.
        assert!(
            step == last_ok || step == last_ok + 1,
            "recovered step {step}, last committed {last_ok}"
        );
        if step == 0 {
            continue; // nothing was ever committed
        }
        check_all(&recovered, |e| workload_step(step, e));
    }
    !device.is_dead()
}

#[test]
fn a_crash_at_every_sync_point_recovers_the_last_committed_checkpoint() {
    let mut k = 0;
    while !crash_and_recover(FaultPlan {
        fail_at_sync: Some(k),
        ..FaultPlan::default()
    }) {
        k += 1;
        assert!(k < 100, "the workload has fewer than 100 syncs");
    }
    assert!(k >= 9, "three checkpoints sync at least 9 times, saw {k}");
}

#[test]
fn a_crash_at_every_io_operation_recovers_the_last_committed_checkpoint() {
    let mut k = 0;
    while !crash_and_recover(FaultPlan {
        fail_at_op: Some(k),
        ..FaultPlan::default()
    }) {
        k += 1;
        assert!(k < 1000, "the workload has fewer than 1000 operations");
    }
    assert!(
        k >= 30,
        "the workload makes at least 30 operations, saw {k}"
    );
}

#[test]
fn the_first_io_error_latches() {
    let device = Arc::new(FaultyFile::new(FaultPlan::default()));
    let store = ExpertStore::create_on(Box::new(Shared(device.clone())), layout()).unwrap();
    let (ops, _) = device.counts();
    device.set_plan(FaultPlan {
        fail_at_op: Some(ops),
        ..FaultPlan::default()
    });
    let all = experts(&layout());
    assert!(matches!(
        write_step(&store, &all, 1),
        Err(TierError::Io { .. })
    ));
    // The device is dead now, but the store says why without touching it.
    device.set_plan(FaultPlan::default());
    let err = store.checkpoint(1).unwrap_err();
    assert!(
        matches!(err, TierError::PreviousIo { op: "write", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("reopen"), "{err}");
}

#[test]
fn a_flipped_byte_is_a_checksum_error_naming_the_expert() {
    let mem = Arc::new(MemFile::new());
    let store = ExpertStore::create_on(Box::new(Shared(mem.clone())), layout()).unwrap();
    let all = experts(&layout());
    write_step(&store, &all, 1).unwrap();
    store.checkpoint(1).unwrap();
    let l = layout();
    let mut bytes = mem.to_bytes();
    // Expert 1.2 is dense slot 5; its committed copy is copy 1 (the first
    // write went to the working copy).
    let victim = ExpertId::new(1, 2);
    for (part_at, needle) in [
        (100u64, "compute params"),
        (l.compute_part_bytes() + 200, "optimizer state"),
    ] {
        let mut image = bytes.clone();
        image[(l.record_offset(5, 1) + part_at) as usize] ^= 0x10;
        let damaged = ExpertStore::open_on(Box::new(MemFile::from_bytes(image)), None).unwrap();
        let mut buf = AlignedBuf::zeroed(l.record_bytes() as usize);
        let err = damaged
            .read(victim, Parts::Full, buf.as_mut_slice())
            .unwrap_err();
        assert!(matches!(err, TierError::Checksum { expert, .. } if expert == victim));
        let text = err.to_string();
        assert!(
            text.contains("expert 1.2") && text.contains(needle),
            "{text}"
        );
        // Other experts read fine.
        damaged
            .read(all[0], Parts::Full, buf.as_mut_slice())
            .unwrap();
    }
    // A damaged header is caught too.
    bytes[(l.record_offset(5, 1) + 20) as usize] ^= 1;
    let damaged = ExpertStore::open_on(Box::new(MemFile::from_bytes(bytes)), None).unwrap();
    let mut buf = AlignedBuf::zeroed(l.record_bytes() as usize);
    let err = damaged
        .read(victim, Parts::Compute, buf.as_mut_slice())
        .unwrap_err();
    assert!(err.to_string().contains("expert 1.2"), "{err}");
}

fn committed_image() -> Vec<u8> {
    let mem = Arc::new(MemFile::new());
    let store = ExpertStore::create_on(Box::new(Shared(mem.clone())), layout()).unwrap();
    write_step(&store, &experts(&layout()), 1).unwrap();
    store.checkpoint(1).unwrap();
    mem.to_bytes()
}

fn open_image(image: Vec<u8>, expected: Option<Layout>) -> Result<ExpertStore, TierError> {
    ExpertStore::open_on(Box::new(MemFile::from_bytes(image)), expected)
}

#[test]
fn bad_files_get_clear_errors() {
    let image = committed_image();

    let mut truncated = image.clone();
    truncated.truncate(image.len() - 4096);
    let err = open_image(truncated, None).err().unwrap();
    assert!(matches!(err, TierError::Truncated { .. }), "{err}");

    let err = open_image(vec![0u8; 100], None).err().unwrap();
    assert!(matches!(err, TierError::NotAStore(_)), "{err}");
    let err = open_image(vec![7u8; 3 * BLOCK_BYTES], None).err().unwrap();
    assert!(err.to_string().contains("wrong magic"), "{err}");

    // A future format version: patch both superblocks, checksums and all.
    let mut future = image.clone();
    for at in [0, BLOCK_BYTES] {
        future[at + 8..at + 12].copy_from_slice(&2u32.to_le_bytes());
        let crc = crc32c::crc32c(&future[at..at + 92]);
        future[at + 92..at + 96].copy_from_slice(&crc.to_le_bytes());
    }
    let err = open_image(future, None).err().unwrap();
    assert!(
        matches!(err, TierError::UnsupportedVersion { found: 2, .. }),
        "{err}"
    );

    let other = Layout {
        params_per_expert: 1501,
        ..layout()
    };
    let err = open_image(image.clone(), Some(other)).err().unwrap();
    assert!(matches!(err, TierError::LayoutMismatch { .. }), "{err}");
    assert!(err.to_string().contains("1501 params"), "{err}");

    let store = open_image(image, Some(layout())).unwrap();
    let err = store
        .read(ExpertId::new(5, 0), Parts::Full, &mut [0u8; 10])
        .unwrap_err();
    assert!(err.to_string().contains("2 layers of 3 experts"), "{err}");
    let mut small = AlignedBuf::zeroed(4096);
    let err = store
        .read(ExpertId::new(0, 0), Parts::Full, small.as_mut_slice())
        .unwrap_err();
    assert!(matches!(err, TierError::BufferSize { .. }), "{err}");
    assert!(ExpertStore::create_on(
        Box::new(MemFile::new()),
        Layout {
            layers: 0,
            ..layout()
        }
    )
    .is_err());
}

/// File options for each engine a real file can use, named.
fn every_engine() -> [(&'static str, FileOptions); 2] {
    [EnginePreference::Auto, EnginePreference::Pread].map(|engine| {
        let name = match engine {
            EnginePreference::Pread => "pread",
            _ => "auto",
        };
        let options = FileOptions {
            engine,
            ..FileOptions::default()
        };
        (name, options)
    })
}

#[test]
fn real_files_round_trip_through_every_engine() {
    let dir = tempfile::tempdir().unwrap();
    for (name, options) in every_engine() {
        let path = dir.path().join(format!("{name}.strata"));
        let store = ExpertStore::create(&path, layout(), &options).unwrap();
        if options.engine == EnginePreference::Pread {
            assert_eq!(store.engine(), "pread");
        } else {
            eprintln!("auto engine: {} {:?}", store.engine(), store.notes());
        }
        write_step(&store, &experts(&layout()), 4).unwrap();
        store.checkpoint(4).unwrap();
        drop(store);
        let store = ExpertStore::open(&path, Some(layout()), &options).unwrap();
        assert_eq!(store.committed_step(), 4);
        check_all(&store, |_| 4);
        // Creating over an existing store is refused.
        assert!(ExpertStore::create(&path, layout(), &options).is_err());
    }
    let missing = ExpertStore::open(&dir.path().join("nope"), None, &FileOptions::default());
    assert!(matches!(missing, Err(TierError::File { .. })));
}

/// A new store file holds its whole length on disk from the start
/// (fallocate), through every engine, so that a run cannot find the disk
/// full in its middle; where the file system cannot reserve it, the store
/// says so in a note instead.
#[test]
fn a_new_store_file_reserves_its_whole_length() {
    use std::os::unix::fs::MetadataExt;
    let big = Layout {
        params_per_expert: 100_000, // 1.4 MB a record, two copies each
        ..layout()
    };
    let dir = tempfile::tempdir().unwrap();
    for (name, options) in every_engine() {
        let path = dir.path().join(format!("{name}.strata"));
        let store = ExpertStore::create(&path, big, &options).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), big.file_bytes());
        let unreserved = store.notes().iter().find(|n| n.contains("cannot reserve"));
        match unreserved {
            Some(note) => eprintln!("{name}: {note}"),
            None => assert!(
                meta.blocks() * 512 >= big.file_bytes(),
                "{name}: {} of {} bytes on disk",
                meta.blocks() * 512,
                big.file_bytes()
            ),
        }
    }
}

/// The full records of `which`, read in one batch: the batch's result and
/// the buffers.
fn read_full_records(
    store: &ExpertStore,
    which: &[ExpertId],
) -> (Result<Vec<u64>, TierError>, Vec<AlignedBuf>) {
    let record_bytes = store.layout().record_bytes() as usize;
    let mut bufs: Vec<AlignedBuf> = which
        .iter()
        .map(|_| AlignedBuf::zeroed(record_bytes))
        .collect();
    let mut requests: Vec<(ExpertId, Parts, &mut [u8])> = which
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&e, b)| (e, Parts::Full, b.as_mut_slice()))
        .collect();
    let steps = store.read_many(&mut requests);
    (steps, bufs)
}

#[test]
fn batched_reads_fill_every_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("batch.strata");
    let store = ExpertStore::create(&path, layout(), &FileOptions::default()).unwrap();
    let all = experts(&layout());
    write_step(&store, &all, 9).unwrap();
    let l = layout();
    let (steps, mut bufs) = read_full_records(&store, &all);
    assert_eq!(steps.unwrap(), vec![9; all.len()]);
    for (e, b) in all.iter().zip(bufs.iter_mut()) {
        check(&l, *e, 9, b.as_mut_slice());
    }
}

/// Records of several read chunks (1 MiB each) read back whole through
/// every engine, in one batch and in parts; a byte flipped deep inside a
/// later chunk of one record fails that record's read with a checksum
/// error naming it, whichever chunk arrives first.
#[test]
fn records_longer_than_a_read_chunk_are_checked_across_chunks() {
    let big = Layout {
        layers: 1,
        experts_per_layer: 3,
        // 2 × 200k compute bytes + 12 × 200k state bytes: about 2.8 MB.
        params_per_expert: 200_000,
        compute_dtype: Dtype::Bf16,
        moments: true,
    };
    let all = experts(&big);
    let dir = tempfile::tempdir().unwrap();
    for (name, options) in every_engine() {
        let path = dir.path().join(format!("{name}.strata"));
        let store = ExpertStore::create(&path, big, &options).unwrap();
        write_step(&store, &all, 3).unwrap();
        store.checkpoint(3).unwrap();
        let (steps, mut bufs) = read_full_records(&store, &all);
        assert_eq!(steps.unwrap(), vec![3; 3]);
        for (e, b) in all.iter().zip(bufs.iter_mut()) {
            check(&big, *e, 3, b.as_mut_slice());
        }
        let mut buf = AlignedBuf::zeroed(big.record_bytes() as usize);
        for parts in [Parts::Compute, Parts::State] {
            let range = parts.range(&big);
            store
                .read(all[1], parts, &mut buf.as_mut_slice()[range])
                .unwrap();
        }
        check(&big, all[1], 3, buf.as_mut_slice());
        drop(store);

        // Flip a byte 2.5 MB into expert 0.1's committed copy (copy 1).
        let mut image = std::fs::read(&path).unwrap();
        image[(big.record_offset(1, 1) + 2_500_000) as usize] ^= 0x40;
        let damaged_path = dir.path().join(format!("{name}-damaged.strata"));
        std::fs::write(&damaged_path, image).unwrap();
        let store = ExpertStore::open(&damaged_path, Some(big), &options).unwrap();
        let err = read_full_records(&store, &all).0.unwrap_err();
        assert!(
            matches!(err, TierError::Checksum { expert, .. } if expert == all[1]),
            "{err}"
        );
        let mut buf = AlignedBuf::zeroed(big.record_bytes() as usize);
        assert!(store
            .read(all[1], Parts::State, buf.as_mut_slice())
            .is_err());
        store
            .read(all[1], Parts::Compute, buf.as_mut_slice())
            .unwrap();
        store.read(all[2], Parts::Full, buf.as_mut_slice()).unwrap();
    }
}
