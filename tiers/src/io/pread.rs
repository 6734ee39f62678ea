//! pread/pwrite: the fallback engine when io_uring is refused.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use super::{file_error, OnReadComplete, ReadOp, RecordDevice, WriteOp};
use crate::TierError;

/// Opens the file, with O_DIRECT when asked and allowed; returns whether
/// O_DIRECT is in effect.
pub(crate) fn open_std(
    path: &Path,
    create: bool,
    direct: bool,
    notes: &mut Vec<String>,
) -> Result<(File, bool), TierError> {
    let open = |flags: i32| {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(create)
            .custom_flags(flags)
            .open(path)
    };
    if direct {
        match open(libc::O_DIRECT) {
            Ok(file) => return Ok((file, true)),
            // EINVAL: the file system refuses O_DIRECT (tmpfs on older kernels).
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                notes.push(format!(
                    "{}: O_DIRECT refused by the file system ({e}); using the page cache",
                    path.display()
                ));
                if create {
                    // create_new may have made the file before O_DIRECT failed.
                    let _ = std::fs::remove_file(path);
                }
            }
            Err(e) => return Err(file_error(path, e)),
        }
    }
    let file = open(0).map_err(|e| file_error(path, e))?;
    Ok((file, false))
}

/// Positioned reads and writes with the standard library (EINTR and short
/// transfers are retried by `read_exact_at` / `write_all_at`).
pub struct PreadFile {
    file: File,
    direct: bool,
}

impl PreadFile {
    pub fn new(file: File, direct: bool) -> Self {
        Self { file, direct }
    }

    pub fn is_direct(&self) -> bool {
        self.direct
    }
}

impl RecordDevice for PreadFile {
    fn engine(&self) -> &'static str {
        "pread"
    }

    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Result<(), TierError> {
        for op in ops.iter_mut() {
            self.file
                .read_exact_at(op.buf, op.offset)
                .map_err(|e| TierError::io("read", op.offset, e))?;
        }
        Ok(())
    }

    /// One op after another, each handed to `on_complete` as soon as it
    /// has been read (so checking it overlaps reading the next).
    fn read_batch_each<'b>(
        &self,
        ops: &mut [ReadOp<'b>],
        on_complete: &mut OnReadComplete<'_, 'b>,
    ) -> Result<(), TierError> {
        for (i, op) in ops.iter_mut().enumerate() {
            self.file
                .read_exact_at(op.buf, op.offset)
                .map_err(|e| TierError::io("read", op.offset, e))?;
            on_complete(i, op.take_bytes())?;
        }
        Ok(())
    }

    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Result<(), TierError> {
        for op in ops {
            self.file
                .write_all_at(op.buf, op.offset)
                .map_err(|e| TierError::io("write", op.offset, e))?;
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), TierError> {
        super::file_sync(&self.file)
    }

    fn len_bytes(&self) -> Result<u64, TierError> {
        super::file_len(&self.file)
    }

    fn set_len_bytes(&self, bytes: u64) -> Result<(), TierError> {
        super::file_set_len(&self.file, bytes)
    }

    fn reserve_len_bytes(&self, bytes: u64) -> Result<bool, TierError> {
        super::file_reserve_len(&self.file, bytes)
    }
}
