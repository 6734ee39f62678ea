//! An in-memory store file, for tests and for runs that need no SSD tier.

use std::sync::Mutex;

use super::{ReadOp, RecordDevice, WriteOp};
use crate::TierError;

#[derive(Default)]
pub struct MemFile {
    bytes: Mutex<Vec<u8>>,
}

impl MemFile {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Self {
            bytes: Mutex::new(bytes),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        self.bytes.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn range(offset: u64, len: usize, size: usize) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(len)?;
    (end <= size).then_some(start..end)
}

impl RecordDevice for MemFile {
    fn engine(&self) -> &'static str {
        "memory"
    }

    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Result<(), TierError> {
        let bytes = self.lock();
        for op in ops.iter_mut() {
            let r = range(op.offset, op.buf.len(), bytes.len()).ok_or_else(|| {
                TierError::io("read", op.offset, std::io::ErrorKind::UnexpectedEof.into())
            })?;
            op.buf.copy_from_slice(&bytes[r]);
        }
        Ok(())
    }

    fn write_batch(&self, ops: &[WriteOp<'_>]) -> Result<(), TierError> {
        let mut bytes = self.lock();
        for op in ops {
            let end = op.offset as usize + op.buf.len();
            if bytes.len() < end {
                bytes.resize(end, 0);
            }
            bytes[op.offset as usize..end].copy_from_slice(op.buf);
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), TierError> {
        Ok(())
    }

    fn len_bytes(&self) -> Result<u64, TierError> {
        Ok(self.lock().len() as u64)
    }

    fn set_len_bytes(&self, bytes: u64) -> Result<(), TierError> {
        self.lock().resize(bytes as usize, 0);
        Ok(())
    }
}
