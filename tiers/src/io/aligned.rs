//! 4096-aligned host memory: single buffers for headers, and the one
//! region the host tier carves into slots. An allocator hook lets a GPU
//! backend register (page-lock) the region with its driver.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::format::BLOCK_BYTES;
use crate::TierError;

/// Owned, zeroed, 4096-aligned bytes whose length is a multiple of 4096, as
/// O_DIRECT needs.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads through &self, like a Vec<u8>.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` is rounded up to a whole number of blocks (at least one).
    pub fn zeroed(len: usize) -> AlignedBuf {
        let len = len.max(1).div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        let layout = Layout::from_size_align(len, BLOCK_BYTES).expect("valid layout");
        // SAFETY: the layout has a non-zero size (len ≥ 4096).
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialized (zeroed) bytes, owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, BLOCK_BYTES).expect("valid layout");
        // SAFETY: allocated in `zeroed` with this exact layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// One large host allocation. How it was obtained (plain pages, or pages
/// a GPU driver has locked) is the allocator's business.
pub struct HostRegion {
    buf: AlignedBuf,
    /// Whether the allocator page-locked it (reported, not relied on).
    pub page_locked: bool,
    /// Called before the memory is freed (a driver's unregister).
    on_drop: Option<Box<dyn FnOnce(*mut u8, usize) + Send + Sync>>,
}

impl HostRegion {
    pub fn new(
        buf: AlignedBuf,
        page_locked: bool,
        on_drop: Option<Box<dyn FnOnce(*mut u8, usize) + Send + Sync>>,
    ) -> Self {
        Self {
            buf,
            page_locked,
            on_drop,
        }
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.buf.ptr.as_ptr()
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            f(self.buf.ptr.as_ptr(), self.buf.len);
        }
    }
}

/// Supplies the host tier's one allocation. The default gives plain
/// 4096-aligned pages; a CUDA backend registers them with the driver.
pub trait HostAllocator: Send + Sync {
    fn allocate(&self, bytes: usize) -> Result<HostRegion, TierError>;
}

/// Plain 4096-aligned, zeroed pages.
#[derive(Clone, Copy, Debug, Default)]
pub struct PageAllocator;

impl HostAllocator for PageAllocator {
    fn allocate(&self, bytes: usize) -> Result<HostRegion, TierError> {
        Ok(HostRegion::new(AlignedBuf::zeroed(bytes), false, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_block_aligned_and_block_sized() {
        let mut b = AlignedBuf::zeroed(5000);
        assert_eq!(b.len(), 8192);
        assert_eq!(b.as_slice().as_ptr() as usize % 4096, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[8191] = 7;
        assert_eq!(b.as_slice()[8191], 7);
        assert_eq!(AlignedBuf::zeroed(0).len(), 4096);
    }
}
