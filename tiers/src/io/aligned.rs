//! 4096-aligned host memory: single buffers for headers, and the one
//! region the host tier carves into slots. An allocator hook lets a GPU
//! backend register (page-lock) the region with its driver. Buffers of
//! 2 MiB and more are mapped on their own and advised for transparent huge
//! pages (see `map_huge`).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::format::BLOCK_BYTES;
use crate::TierError;

/// Owned, zeroed, 4096-aligned bytes whose length is a multiple of 4096, as
/// O_DIRECT needs; from 2 MiB on, 2 MiB-aligned and advised for huge pages.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

/// Buffers of at least this size are mapped on their own (`map_huge`),
/// smaller ones come from the global allocator.
const HUGE_PAGE_BYTES: usize = 2 << 20;

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads through &self, like a Vec<u8>.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` is rounded up to a whole number of blocks (at least one).
    pub fn zeroed(len: usize) -> AlignedBuf {
        let len = len.max(1).div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        let layout = Layout::from_size_align(len, BLOCK_BYTES).expect("valid layout");
        let ptr = if len >= HUGE_PAGE_BYTES {
            crate::sys::map_huge(len, HUGE_PAGE_BYTES)
        } else {
            // SAFETY: the layout has a non-zero size (len ≥ 4096).
            NonNull::new(unsafe { alloc_zeroed(layout) })
        };
        let ptr = ptr.unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
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
        if self.len >= HUGE_PAGE_BYTES {
            // SAFETY: `zeroed` took [ptr, ptr + len) from `map_huge`, which
            // mapped exactly that; nothing else unmaps it, and it is unmapped
            // once, here.
            unsafe { crate::sys::unmap(self.ptr, self.len) };
        } else {
            let layout = Layout::from_size_align(self.len, BLOCK_BYTES).expect("valid layout");
            // SAFETY: allocated in `zeroed` with this exact layout, freed once.
            unsafe { dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

/// One large host allocation. How it was obtained (plain pages, or pages
/// a GPU driver has locked) is the allocator's business.
///
/// The region is the one handle through which its bytes are read and
/// written. Whoever registers it with a driver (io_uring's fixed buffers,
/// CUDA's page-locking) takes a [`RegionLease`] instead: the lease keeps the
/// memory mapped for as long as the registration lives, and gives no access.
pub struct HostRegion {
    memory: Arc<RegionMemory>,
    /// Whether the allocator page-locked it (reported, not relied on).
    pub page_locked: bool,
}

/// A callback run before a region's memory is freed (a driver's unregister).
pub type OnRegionDrop = Box<dyn FnOnce(*mut u8, usize) + Send + Sync>;

struct RegionMemory {
    buf: AlignedBuf,
    on_drop: Option<OnRegionDrop>,
}

impl Drop for RegionMemory {
    fn drop(&mut self) {
        if let Some(f) = self.on_drop.take() {
            f(self.buf.ptr.as_ptr(), self.buf.len);
        }
    }
}

/// Keeps a [`HostRegion`]'s memory mapped while a driver holds it
/// registered. It reads no byte and writes none: its address and length
/// are for the driver's registration call.
#[derive(Clone)]
pub struct RegionLease(Arc<RegionMemory>);

impl RegionLease {
    pub fn as_ptr(&self) -> *mut u8 {
        self.0.buf.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.0.buf.len
    }

    pub fn is_empty(&self) -> bool {
        self.0.buf.len == 0
    }
}

impl HostRegion {
    pub fn new(buf: AlignedBuf, page_locked: bool, on_drop: Option<OnRegionDrop>) -> Self {
        Self {
            memory: Arc::new(RegionMemory { buf, on_drop }),
            page_locked,
        }
    }

    pub fn len(&self) -> usize {
        self.memory.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.memory.buf.is_empty()
    }

    /// The start of the memory, for carving it into slots.
    pub fn as_ptr(&self) -> *mut u8 {
        self.memory.buf.ptr.as_ptr()
    }

    /// The whole region, to read and write.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let (ptr, len) = (self.as_ptr(), self.len());
        // SAFETY: the memory is valid for `len` initialized bytes while the
        // Arc lives, and `&mut self` makes this access exclusive: a region
        // is never cloned, and leases give no access to the bytes.
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }
    }

    /// A lease that keeps this memory mapped for a driver's registration.
    pub fn lease(&self) -> RegionLease {
        RegionLease(Arc::clone(&self.memory))
    }

    /// Gives up writing: the region becomes read-only bytes that can be
    /// shared (e.g. one source lent to many uploads).
    pub fn into_shared(self) -> SharedRegion {
        SharedRegion(self.memory)
    }
}

/// A [`HostRegion`] nobody writes any more: its bytes can be read through
/// any number of shared references, and leased like a region's.
pub struct SharedRegion(Arc<RegionMemory>);

impl SharedRegion {
    pub fn as_slice(&self) -> &[u8] {
        self.0.buf.as_slice()
    }

    pub fn lease(&self) -> RegionLease {
        RegionLease(Arc::clone(&self.0))
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

    /// The `VmFlags` line of the mapping that holds `addr`, from
    /// /proc/self/smaps (Linux).
    fn vm_flags_at(addr: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = range.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return Some(flags.trim().to_string());
                }
            }
        }
        None
    }

    #[test]
    fn large_buffers_are_huge_page_aligned_zeroed_and_advised() {
        let len = (5 << 20) + 4096;
        let mut b = AlignedBuf::zeroed(len);
        assert_eq!(b.len(), len);
        let addr = b.as_slice().as_ptr() as usize;
        assert_eq!(addr % HUGE_PAGE_BYTES, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[0] = 1;
        b.as_mut_slice()[len - 1] = 2;
        assert_eq!((b.as_slice()[0], b.as_slice()[len - 1]), (1, 2));
        // Where the kernel has transparent huge pages, the mapping carries
        // the advice ("hg" in VmFlags).
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists();
        if let (true, Some(flags)) = (thp, vm_flags_at(addr)) {
            assert!(
                flags.split_whitespace().any(|f| f == "hg"),
                "VmFlags {flags}"
            );
        }
        // After a drop (munmap), a new buffer of the same size is again
        // zeroed.
        drop(b);
        let again = AlignedBuf::zeroed(len);
        assert!(again.as_slice().iter().all(|&x| x == 0));
    }
}
