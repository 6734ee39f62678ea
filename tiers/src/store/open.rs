//! Creating a store and opening one: the superblock pair read, the newest
//! intact checkpoint (superblock and copy map) chosen, and what was passed
//! over said in the store's notes.

use std::path::Path;
use std::sync::Mutex;

use super::{describe, lock, ExpertStore, Meta};
use crate::busy::BusyClock;
use crate::format::{crc, decode_map, Layout, MapEntry, Superblock, BLOCK_BYTES, NEVER_WRITTEN};
use crate::io::{open_file, AlignedBuf, FileOptions, RecordDevice};
use crate::TierError;

impl ExpertStore {
    /// Creates a new store file (it must not exist yet) for `layout`.
    pub fn create(path: &Path, layout: Layout, options: &FileOptions) -> Result<Self, TierError> {
        layout.validate()?;
        let opened = open_file(path, true, options)?;
        let mut store = Self::create_on(opened.device, layout)?;
        store.notes.splice(0..0, opened.notes);
        store.path = Some(path.to_path_buf());
        Ok(store)
    }

    /// Opens an existing store file; with `expected`, its layout must match.
    pub fn open(
        path: &Path,
        expected: Option<Layout>,
        options: &FileOptions,
    ) -> Result<Self, TierError> {
        if !path.exists() {
            return Err(TierError::File {
                path: path.to_path_buf(),
                source: std::io::ErrorKind::NotFound.into(),
            });
        }
        let opened = open_file(path, false, options)?;
        let mut store = Self::open_on(opened.device, expected)?;
        store.notes.splice(0..0, opened.notes);
        store.path = Some(path.to_path_buf());
        Ok(store)
    }

    /// Creates a store on any device (memory, fault injector).
    pub fn create_on(device: Box<dyn RecordDevice>, layout: Layout) -> Result<Self, TierError> {
        layout.validate()?;
        let count = layout.expert_count() as usize;
        let committed = vec![
            MapEntry {
                step: NEVER_WRITTEN,
                copy: 0,
            };
            count
        ];
        let mut store = Self {
            device,
            layout,
            meta: Mutex::new(Meta {
                superblock: Superblock {
                    generation: 0,
                    committed_step: 0,
                    layout,
                    map_crc: 0,
                },
                committed,
                pending: vec![None; count],
            }),
            latch: Mutex::new(None),
            notes: Vec::new(),
            path: None,
            busy: BusyClock::default(),
            turn: Mutex::new(()),
        };
        let reserved = store.guard("allocate", || {
            store.device.reserve_len_bytes(layout.file_bytes())
        })?;
        // Generation 0 commits step 0 with every expert unwritten.
        let mut meta = lock(&store.meta);
        store.commit(&mut meta, 0, 0)?;
        drop(meta);
        if !reserved {
            store.notes.push(format!(
                "the file system cannot reserve the store's {} bytes (fallocate is not \
                 supported there): they are taken as records are written, so keep that much \
                 free on it for the whole run",
                layout.file_bytes()
            ));
        }
        Ok(store)
    }

    /// Opens a store on any device.
    pub fn open_on(
        device: Box<dyn RecordDevice>,
        expected: Option<Layout>,
    ) -> Result<Self, TierError> {
        let len = device.len_bytes()?;
        let blocks = superblock_pair(&*device, len)?;
        let Candidates {
            intact: candidates,
            newest,
            mut notes,
        } = superblock_candidates(blocks.as_slice())?;
        for sb in candidates {
            let layout = sb.layout;
            if len < layout.file_bytes() {
                return Err(TierError::Truncated {
                    expected: layout.file_bytes(),
                    actual: len,
                });
            }
            let mut map = AlignedBuf::zeroed(layout.map_bytes() as usize);
            device.read_at(
                map.as_mut_slice(),
                layout.map_offset((sb.generation % 2) as usize),
            )?;
            if crc(map.as_slice()) != sb.map_crc {
                // A map overwritten by a later, uncommitted checkpoint, or
                // damaged.
                notes.push(format!(
                    "the copy map of generation {} (checkpoint at step {}) does not match its \
                     checksum; it is not used",
                    sb.generation, sb.committed_step
                ));
                continue;
            }
            if let Some(expected) = expected {
                if expected != layout {
                    return Err(TierError::LayoutMismatch {
                        found: describe(&layout),
                        expected: describe(&expected),
                    });
                }
            }
            let count = layout.expert_count() as usize;
            let committed = decode_map(map.as_slice(), count)?;
            if !notes.is_empty() {
                let newer = newest.filter(|&(generation, _)| generation > sb.generation);
                notes.push(match newer {
                    Some((_, step)) => format!(
                        "opened the previous checkpoint, at step {} (the newest, at step {step}, \
                         is unreadable)",
                        sb.committed_step
                    ),
                    None => format!("opened the checkpoint at step {}", sb.committed_step),
                });
            }
            return Ok(Self {
                device,
                layout,
                meta: Mutex::new(Meta {
                    superblock: sb,
                    committed,
                    pending: vec![None; count],
                }),
                latch: Mutex::new(None),
                notes,
                path: None,
                busy: BusyClock::default(),
                turn: Mutex::new(()),
            });
        }
        Err(TierError::CorruptSuperblock(
            "neither superblock is intact with an intact copy map",
        ))
    }
}

/// The superblock pair at the start of a store `len` bytes long on
/// `device`, refused unless one of the two has the store's magic.
fn superblock_pair(device: &dyn RecordDevice, len: u64) -> Result<AlignedBuf, TierError> {
    if len < 2 * BLOCK_BYTES as u64 {
        return Err(TierError::NotAStore(format!(
            "the file is {len} bytes, smaller than a superblock pair"
        )));
    }
    let mut blocks = AlignedBuf::zeroed(2 * BLOCK_BYTES);
    device.read_at(blocks.as_mut_slice(), 0)?;
    let b = blocks.as_slice();
    let magic_ok = |x: &[u8]| x[..8] == crate::format::SUPERBLOCK_MAGIC;
    if !magic_ok(&b[..BLOCK_BYTES]) && !magic_ok(&b[BLOCK_BYTES..]) {
        return Err(TierError::NotAStore(
            "no strata superblock (wrong magic); is this a store file?".to_string(),
        ));
    }
    Ok(blocks)
}

/// The intact superblocks of the pair `b` (A, then B), newest first; the
/// newest's (generation, committed step); and a note for each copy with
/// the magic but no intact checksum (damaged, or torn by a crash while it
/// was written), which is passed over: the other one is opened, and the
/// store says so.
fn superblock_candidates(b: &[u8]) -> Result<Candidates, TierError> {
    let magic_ok = |x: &[u8]| x[..8] == crate::format::SUPERBLOCK_MAGIC;
    let mut notes = Vec::new();
    let mut candidates = Vec::new();
    for (which, block) in ["A", "B"]
        .into_iter()
        .zip([&b[..BLOCK_BYTES], &b[BLOCK_BYTES..]])
    {
        match Superblock::decode(block)? {
            Some(sb) => candidates.push(sb),
            None if magic_ok(block) => notes.push(format!(
                "superblock {which} is damaged (or was torn by a crash while it was \
                 written); it is not used"
            )),
            None => {}
        }
    }
    candidates.sort_by_key(|sb| std::cmp::Reverse(sb.generation));
    let newest = candidates
        .first()
        .map(|sb| (sb.generation, sb.committed_step));
    Ok(Candidates {
        intact: candidates,
        newest,
        notes,
    })
}

/// What [`superblock_candidates`] found.
struct Candidates {
    intact: Vec<Superblock>,
    newest: Option<(u64, u64)>,
    notes: Vec<String>,
}
