//! Record I/O behind one small trait, [`RecordDevice`], with four engines:
//! io_uring + O_DIRECT (`uring.rs`), pread/pwrite (`pread.rs`), memory
//! (`mem.rs`) and a fault injector for crash tests (`faulty.rs`).

mod aligned;
mod faulty;
mod mem;
mod pread;
mod uring;

use std::path::Path;

pub use aligned::{
    AlignedBuf, HostAllocator, HostRegion, OnRegionDrop, PageAllocator, RegionLease, SharedRegion,
};
pub use faulty::{FaultPlan, FaultyFile};
pub use mem::MemFile;
pub use pread::PreadFile;
pub use uring::UringFile;

use crate::TierError;

/// Called with each completed read's index and bytes (see `read_batch_each`):
/// the bytes are the op's buffer itself, lent for the buffer's whole
/// lifetime `'b`.
pub type OnReadComplete<'a, 'b> = dyn FnMut(usize, &'b [u8]) -> Result<(), TierError> + 'a;

/// One read: fill `buf` from `offset`.
pub struct ReadOp<'a> {
    pub offset: u64,
    pub buf: &'a mut [u8],
}

impl<'b> ReadOp<'b> {
    /// Moves the (read) buffer out as shared bytes, leaving an empty one.
    pub fn take_bytes(&mut self) -> &'b [u8] {
        let buf: &'b mut [u8] = std::mem::take(&mut self.buf);
        buf
    }
}

/// One write: `buf` to `offset`.
pub struct WriteOp<'a> {
    pub offset: u64,
    pub buf: &'a [u8],
}

/// Positioned, whole-buffer reads and writes and a durability barrier.
/// A batch may run its ops concurrently (up to the engine's queue depth);
/// it returns once all are complete, or with the first error.
pub trait RecordDevice: Send + Sync {
    /// `io_uring`, `pread`, `memory` or `faulty`.
    fn engine(&self) -> &'static str;
    /// Whether the engine runs one batch at a time, however many threads
    /// call it (the others wait on a lock inside it).
    fn one_batch_at_a_time(&self) -> bool {
        false
    }
    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Result<(), TierError>;
    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Result<(), TierError>;
    /// Makes every completed write durable (fdatasync).
    fn sync(&self) -> Result<(), TierError>;
    fn len_bytes(&self) -> Result<u64, TierError>;
    fn set_len_bytes(&self, bytes: u64) -> Result<(), TierError>;
    /// Sets the length to `bytes` with the medium's space for them
    /// reserved where it can be (a file: fallocate), so that no write
    /// within that length can find the disk full. Returns false where the
    /// medium cannot reserve it (the length is then set, and space is
    /// taken as bytes are written); memory has nothing to reserve.
    fn reserve_len_bytes(&self, bytes: u64) -> Result<bool, TierError> {
        self.set_len_bytes(bytes).map(|()| true)
    }

    /// Like `read_batch`, calling `on_complete(i, bytes)` as soon as op i's
    /// bytes have all arrived (while later ops are still in flight, where the
    /// engine overlaps them), so checking one record overlaps reading the
    /// next. An error from `on_complete` ends the batch with that error.
    ///
    /// Each completed op's buffer moves out to `on_complete` (as shared
    /// bytes, for the buffer's whole lifetime, so another thread may go on
    /// checking it after the call returns); the op is left with an empty
    /// buffer.
    fn read_batch_each<'b>(
        &self,
        ops: &mut [ReadOp<'b>],
        on_complete: &mut OnReadComplete<'_, 'b>,
    ) -> Result<(), TierError> {
        self.read_batch(ops)?;
        ops.iter_mut()
            .enumerate()
            .try_for_each(|(i, op)| on_complete(i, op.take_bytes()))
    }

    /// Registers `region` with the engine (io_uring fixed buffers), so
    /// I/O into it skips per-operation page pinning. Returns whether the
    /// engine registered it; engines without the notion do not. The engine
    /// holds a lease on the region until `unregister_buffers` or its drop.
    fn register_buffers(&self, region: &HostRegion) -> bool {
        let _ = region;
        false
    }

    /// Forgets a registration (before its memory is freed).
    fn unregister_buffers(&self) {}

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), TierError> {
        self.read_batch(&mut [ReadOp { offset, buf }])
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), TierError> {
        self.write_batch(&[WriteOp { offset, buf }])
    }
}

/// Which engine `open_file` should use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EnginePreference {
    /// io_uring with O_DIRECT when the kernel and file system allow, else
    /// pread/pwrite (with O_DIRECT if allowed).
    #[default]
    Auto,
    Uring,
    Pread,
}

/// How to open a store file.
#[derive(Clone, Debug)]
pub struct FileOptions {
    pub engine: EnginePreference,
    /// io_uring submission queue depth (ops in flight at most).
    pub queue_depth: u32,
    /// Bypass the page cache (O_DIRECT); dropped, with a note, where the
    /// file system refuses it (tmpfs).
    pub direct: bool,
}

impl Default for FileOptions {
    fn default() -> Self {
        Self {
            engine: EnginePreference::Auto,
            queue_depth: 32,
            direct: true,
        }
    }
}

/// An opened file and what was chosen for it.
pub struct OpenedFile {
    pub device: Box<dyn RecordDevice>,
    /// Why a preferred engine or O_DIRECT was not used, if so.
    pub notes: Vec<String>,
}

/// Opens (or creates) a store file with the preferred engine, falling back
/// to pread/pwrite when io_uring is refused, and to buffered I/O when
/// O_DIRECT is refused. The reasons end up in `notes`.
pub fn open_file(
    path: &Path,
    create: bool,
    options: &FileOptions,
) -> Result<OpenedFile, TierError> {
    let mut notes = Vec::new();
    let (file, direct) = pread::open_std(path, create, options.direct, &mut notes)?;
    if options.engine != EnginePreference::Pread {
        match UringFile::new(
            file.try_clone().map_err(|e| file_error(path, e))?,
            options.queue_depth,
        ) {
            Ok(uring) => {
                return Ok(OpenedFile {
                    device: Box::new(uring.with_direct(direct)),
                    notes,
                })
            }
            Err(e) if options.engine == EnginePreference::Uring => {
                return Err(TierError::File {
                    path: path.to_path_buf(),
                    source: std::io::Error::new(e.kind(), format!("io_uring refused: {e}")),
                })
            }
            Err(e) => notes.push(uring::refusal_note(&e)),
        }
    }
    Ok(OpenedFile {
        device: Box::new(PreadFile::new(file, direct)),
        notes,
    })
}

/// fdatasync, as every file engine does it.
pub(crate) fn file_sync(file: &std::fs::File) -> Result<(), TierError> {
    file.sync_data().map_err(|e| TierError::io("fsync", 0, e))
}

pub(crate) fn file_len(file: &std::fs::File) -> Result<u64, TierError> {
    Ok(file
        .metadata()
        .map_err(|e| TierError::io("stat", 0, e))?
        .len())
}

pub(crate) fn file_set_len(file: &std::fs::File, bytes: u64) -> Result<(), TierError> {
    file.set_len(bytes)
        .map_err(|e| TierError::io("truncate", bytes, e))
}

/// `RecordDevice::reserve_len_bytes` for a file: fallocate over its whole
/// length, or, where the file system cannot (EOPNOTSUPP), the length alone.
pub(crate) fn file_reserve_len(file: &std::fs::File, bytes: u64) -> Result<bool, TierError> {
    use std::os::fd::AsRawFd;
    if bytes == 0 {
        return file_set_len(file, 0).map(|()| true);
    }
    let len = libc::off_t::try_from(bytes)
        .map_err(|_| TierError::io("fallocate", bytes, std::io::ErrorKind::InvalidInput.into()))?;
    // SAFETY: the descriptor belongs to `file`, open for the whole call;
    // fallocate reads no memory of ours.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc == 0 {
        // Also shortens a longer file, as set_len would.
        return file_set_len(file, bytes).map(|()| true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => file_set_len(file, bytes).map(|()| false),
        _ => Err(TierError::io("fallocate", bytes, e)),
    }
}

pub(crate) fn file_error(path: &Path, source: std::io::Error) -> TierError {
    TierError::File {
        path: path.to_path_buf(),
        source,
    }
}
